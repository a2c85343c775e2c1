//! How a resident bf16 matrix of the Qwen3 CPU kernels lies in memory: row-major, or one of
//! the kernels' streaming orders: tiled (`simpler_kernels_cpu::tile_weights_bf16`, the AMX
//! path's) or paired (`simpler_kernels_cpu::pair_weights_bf16`, the AVX2 and AVX-512 BF16
//! paths';
//! `docs/qwen3.md`, "bf16 weight layouts").
//!
//! The choice is a function of the matrix shape and the process's kernel path alone
//! ([`bf16_layout`]), so the upload that writes a matrix ([`crate::qwen3::ResidentModel`]) and
//! the Qwen3 kernels that read it (registered by [`crate::qwen3::ops::register`]) agree without
//! the orchestration carrying a flag. The AMX path streams tiled weights faster at every batch
//! (`simpler_kernels_cpu::tiled_weights_pay`), the AVX2 and AVX-512 BF16 paths paired ones
//! (`simpler_kernels_cpu::paired_weights_pay`). A matrix takes either only when its shape is
//! whole 16-row groups and 32-column steps (`rows % 16 == 0`, `cols % 32 == 0`), where both
//! forms have exactly the row-major length and every 16-row group is contiguous, so every
//! offset the orchestration computes (weight sets back to back, SPMD row shares in units of
//! 16) lands on the same rows in any layout. The rule covers the projections, the LM head
//! and the embedding table (a tied LM head is the embedding buffer, so the gather reads the
//! same layout). Workers whose kernels do not run on the host (CUDA) always get row-major
//! weights.
//!
//! The default ([`Bf16LayoutChoice::Streaming`]) is paired weights on the AVX2 path, where
//! they measured faster at every decode batch and level or faster at prefill, and on the
//! AVX-512 BF16 path without AMX (Zen 4: decode steps at 4, 8 and 16 × 1024 took 0.79, 0.76
//! and 0.83× the row-major time, a 512-token prefill 0.74×; `docs/benchmarks.md`, session 44),
//! and row-major elsewhere. Tiling stays opt-in (the CLI's `--bf16-layout tiled`): on AMX hosts tiled
//! weights made the 16 × 1024 decode step 6.5% faster, but the 1 × 256 step 8.7% and the
//! 4 × 1024 step 3.9% slower (the AVX2 four-stream passes over row-major weights outrun the
//! tiled passes at 1–2 rows), and a 512-token prefill measured slower end to end while its
//! GEMM kernels were not (`docs/benchmarks.md`, session 29; `docs/qwen3.md`).
//!
//! Contract: a Qwen3 kernel derives a bf16 weight tensor's layout from its `[rows, cols]` as
//! bound, so a task binds a whole matrix (as the orchestration does: one SPMD task per
//! projection and for the LM head). Other models that run the Qwen3 GEMM kernel on their own
//! weights (DeepSeek-V4) register it with their own layout rule
//! ([`crate::qwen3::ops::gemm_spec_with`]).

use std::sync::OnceLock;

use simpler_core::Worker;
use simpler_kernels_cpu::{
    Isa, TILE_COLS, TILE_ROWS, WeightLayout, paired_weights_pay, tiled_weights_pay,
};

/// Which bf16 layout this process's Qwen3 CPU models use where the shape and path allow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Bf16LayoutChoice {
    /// Paired where [`paired_weights_pay`] says the path streams it faster and the shape is
    /// whole groups and steps, else row-major (the default of a process that does not choose).
    #[default]
    Streaming,
    /// Row-major everywhere.
    RowMajor,
    /// Tiled where [`tiled_weights_pay`] says the path streams it faster and the shape is
    /// whole groups and steps.
    Tiled,
    /// Paired where the shape is whole groups and steps, on any path (the AMX path computes
    /// paired weights through the AVX-512 BF16 and AVX2 kernels, the portable one through its
    /// loops: for tests and comparisons).
    Pairs,
}

/// The process's choice, fixed by the first [`choose_bf16_layout`] or [`bf16_layout`] call.
static CHOICE: OnceLock<Bf16LayoutChoice> = OnceLock::new();

/// A second, different layout choice in one process (uploads and kernels already agreed on
/// the first: changing it would make kernels misread resident weights).
#[derive(Debug, thiserror::Error)]
#[error(
    "the bf16 weight layout of this process is already {fixed:?}; {asked:?} cannot be chosen now"
)]
pub struct LayoutAlreadyFixed {
    /// The choice in force.
    pub fixed: Bf16LayoutChoice,
    /// The choice refused.
    pub asked: Bf16LayoutChoice,
}

/// Fixes this process's bf16 layout choice before any Qwen3 model is uploaded. Choosing what
/// is already in force is accepted; a different choice after the first (or after a model was
/// uploaded or a kernel ran with the default) is refused.
pub fn choose_bf16_layout(choice: Bf16LayoutChoice) -> Result<(), LayoutAlreadyFixed> {
    let fixed = *CHOICE.get_or_init(|| choice);
    if fixed == choice {
        Ok(())
    } else {
        Err(LayoutAlreadyFixed {
            fixed,
            asked: choice,
        })
    }
}

/// The layout of a resident `[rows, cols]` bf16 matrix read by this process's Qwen3 CPU
/// kernels.
pub fn bf16_layout(rows: usize, cols: usize) -> WeightLayout {
    let choice = *CHOICE.get_or_init(Bf16LayoutChoice::default);
    layout_for(choice, Isa::detected(), rows, cols)
}

/// The rule of [`bf16_layout`] for a given choice on the kernels' path `isa`.
fn layout_for(choice: Bf16LayoutChoice, isa: Isa, rows: usize, cols: usize) -> WeightLayout {
    let whole =
        rows.is_multiple_of(TILE_ROWS) && cols.is_multiple_of(TILE_COLS) && rows > 0 && cols > 0;
    match choice {
        _ if !whole => WeightLayout::RowMajor,
        Bf16LayoutChoice::Tiled if tiled_weights_pay(isa) => WeightLayout::Tiled,
        Bf16LayoutChoice::Streaming if paired_weights_pay(isa) => WeightLayout::Pairs,
        Bf16LayoutChoice::Pairs => WeightLayout::Pairs,
        _ => WeightLayout::RowMajor,
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
    use Bf16LayoutChoice::{Pairs, RowMajor, Streaming, Tiled};

    #[test]
    fn only_chosen_whole_groups_and_steps_on_a_paying_path_are_tiled() {
        assert_eq!(
            layout_for(Tiled, Isa::AmxBf16, 2048, 1024),
            WeightLayout::Tiled
        );
        assert_eq!(
            layout_for(Tiled, Isa::AmxBf16, 151_936, 1024),
            WeightLayout::Tiled
        );
        for (rows, cols) in [(1000, 256), (64, 48), (0, 64), (16, 0)] {
            for choice in [Tiled, Pairs, Streaming] {
                for isa in [Isa::AmxBf16, Isa::Avx2] {
                    assert_eq!(layout_for(choice, isa, rows, cols), WeightLayout::RowMajor);
                }
            }
        }
        assert_eq!(
            layout_for(Tiled, Isa::Avx2, 2048, 1024),
            WeightLayout::RowMajor
        );
        for isa in [Isa::AmxBf16, Isa::Avx2, Isa::Portable] {
            assert_eq!(
                layout_for(RowMajor, isa, 2048, 1024),
                WeightLayout::RowMajor
            );
            assert_eq!(layout_for(Pairs, isa, 2048, 1024), WeightLayout::Pairs);
        }
    }

    #[test]
    fn the_default_pairs_on_the_avx2_and_avx512_bf16_paths_alone() {
        assert_eq!(Bf16LayoutChoice::default(), Streaming);
        for isa in [Isa::Avx2, Isa::Avx512Bf16] {
            assert_eq!(
                layout_for(Streaming, isa, 2048, 1024),
                WeightLayout::Pairs,
                "{isa:?}"
            );
        }
        for isa in [Isa::Portable, Isa::AmxBf16] {
            assert_eq!(
                layout_for(Streaming, isa, 2048, 1024),
                WeightLayout::RowMajor,
                "{isa:?}"
            );
        }
    }
}
