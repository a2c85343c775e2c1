//! How a resident bf16 matrix of the Qwen3 CPU kernels lies in memory: row-major, or the
//! kernels' tiled streaming order (`simpler_kernels_cpu::tile_weights_bf16`; `docs/qwen3.md`,
//! "Tiled bf16 weights").
//!
//! The choice is a function of the matrix shape and the process's kernel path alone
//! ([`bf16_layout`]), so the upload that writes a matrix ([`crate::qwen3::ResidentModel`]) and
//! the Qwen3 kernels that read it (registered by [`crate::qwen3::ops::register`]) agree without
//! the orchestration carrying a flag. The AMX path streams tiled weights faster at every batch
//! (`simpler_kernels_cpu::tiled_weights_pay`), and a matrix is tiled only when its tiled form
//! has exactly its row-major length (`rows % 16 == 0`, `cols % 32 == 0`), so every offset the
//! orchestration computes (weight sets back to back, SPMD row shares in units of 16) lands on
//! the same rows in either layout. The rule covers the projections, the LM head and the
//! embedding table (a tied LM head is the embedding buffer, so the gather reads the same
//! layout). Workers whose kernels do not run on the host (CUDA) always get row-major weights.
//!
//! Contract: a Qwen3 kernel derives a bf16 weight tensor's layout from its `[rows, cols]` as
//! bound, so a task binds a whole matrix (as the orchestration does: one SPMD task per
//! projection and for the LM head). Other models that run the Qwen3 GEMM kernel on their own
//! row-major weights (DeepSeek-V4) register [`crate::qwen3::ops::row_major_gemm_spec`].

use simpler_core::Worker;
use simpler_kernels_cpu::{Isa, TILE_COLS, TILE_ROWS, WeightLayout, tiled_weights_pay};

/// The layout of a resident `[rows, cols]` bf16 matrix read by this process's Qwen3 CPU
/// kernels.
pub fn bf16_layout(rows: usize, cols: usize) -> WeightLayout {
    if tiled_weights_pay(Isa::detected())
        && rows.is_multiple_of(TILE_ROWS)
        && cols.is_multiple_of(TILE_COLS)
        && rows > 0
        && cols > 0
    {
        WeightLayout::Tiled
    } else {
        WeightLayout::RowMajor
    }
}

/// The layout a `[rows, cols]` bf16 matrix is uploaded in to `worker`: [`bf16_layout`] where
/// kernels run on the host, row-major elsewhere.
pub(crate) fn upload_layout(worker: &Worker, rows: usize, cols: usize) -> WeightLayout {
    if worker.platform().host_kernels {
        bf16_layout(rows, cols)
    } else {
        WeightLayout::RowMajor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_groups_and_steps_are_tiled_and_only_on_the_amx_path() {
        let pays = tiled_weights_pay(Isa::detected());
        let tiled = if pays {
            WeightLayout::Tiled
        } else {
            WeightLayout::RowMajor
        };
        assert_eq!(bf16_layout(2048, 1024), tiled);
        assert_eq!(bf16_layout(151_936, 1024), tiled);
        assert_eq!(bf16_layout(1000, 256), WeightLayout::RowMajor);
        assert_eq!(bf16_layout(64, 48), WeightLayout::RowMajor);
        assert_eq!(bf16_layout(0, 64), WeightLayout::RowMajor);
        println!("tiled on this process's path: {pays}");
    }
}
