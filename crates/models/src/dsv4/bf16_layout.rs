//! The layouts of DeepSeek-V4's bf16 matrices (`docs/dsv4.md`, "bf16 weight layout"): the
//! upload and the kernel that reads a matrix must agree, and both decide from the same shape
//! and process-wide path.
//!
//! **The input projections** (`Wq_a`, `Wkv`, the compressors' and the indexer's matrices, all
//! `[rows, hidden]`, every one run by the GEMM kernel on a whole bound matrix), where the shape
//! is whole 16-row groups and 32-column steps, are paired (`WeightLayout::Pairs`) where the
//! AVX2 or the AVX-512 BF16 path (without AMX) streams paired weights faster (`simpler_kernels_cpu::paired_weights_pay`), as
//! `Wo_a` and Qwen3's matrices are, and tiled (`WeightLayout::Tiled`) where the AMX path runs
//! (`simpler_kernels_cpu::tiled_weights_pay`); row-major elsewhere. At 8 token rows in 12
//! blocks a tiled matrix with its activations converted once per task streamed 30–33 GB/s
//! against 23–26 row-major (`docs/benchmarks.md`, session 26); on Zen 3 a paired `[1024,
//! 4096]` at 8 rows took 0.89–0.92× the time of the row-major one (`examples/dsv4_wo_a_bw`),
//! and the FLASH CSA step's projection blocks 43–51 µs against 51–58 (`docs/dsv4.md`); on
//! Zen 4 (AVX-512 BF16, no AMX) the paired `vdpbf16ps` kernel took the FLASH SWA step from
//! 6.7–6.8 to 5.2–5.5 ms (`docs/benchmarks.md`, session 44).
//!
//! **`Wo_a`** takes the paired layout of the AVX2 and AVX-512 BF16 GEMMs
//! (`WeightLayout::Pairs`) or the tiled one of the AMX path:
//!
//! - where the worker's kernels run on the host and the shape is whole 16-row groups per
//!   output group and 32-column steps (so every output group and every SPMD block, which start
//!   on 16 columns of the output, start on a row group): paired where the AVX2 or AVX-512
//!   BF16 path streams paired weights faster (`simpler_kernels_cpu::paired_weights_pay`), tiled where the AMX
//!   path runs (at 8 rows in blocks of 1024 rows × 4096 the tiled pass streamed 33 GB/s
//!   against 28 row-major, `docs/benchmarks.md`, session 26);
//! - row-major otherwise, so a device platform receives the same bytes as before.
//! - The kernel reads the same decision without the platform test (these kernels run only on
//!   host-kernel platforms).
//!
//! Pairing or tiling reorders the `G · R × K` values in place of the row-major copy (the buffer
//! has the same size and shape).

use simpler_core::Worker;
use simpler_kernels_cpu::{
    Isa, TILE_COLS, TILE_ROWS, WeightLayout, paired_weights_pay, tiled_weights_pay,
};

/// Whether a `[rows, cols]` matrix is whole 16-row groups and 32-column steps (the shapes the
/// streaming layouts keep at the row-major length, every 16-row SPMD share on a group).
fn whole(rows: usize, cols: usize) -> bool {
    rows > 0 && cols > 0 && rows.is_multiple_of(TILE_ROWS) && cols.is_multiple_of(TILE_COLS)
}

/// The layout this process's GEMM kernel reads an input projection `[rows, cols]` in.
pub fn projection_kernel_layout(rows: usize, cols: usize) -> WeightLayout {
    let isa = Isa::detected();
    if !whole(rows, cols) {
        WeightLayout::RowMajor
    } else if paired_weights_pay(isa) {
        WeightLayout::Pairs
    } else if tiled_weights_pay(isa) {
        WeightLayout::Tiled
    } else {
        WeightLayout::RowMajor
    }
}

/// The layout an input projection `[rows, cols]` is uploaded in for `worker`.
pub fn projection_upload_layout(worker: &Worker, rows: usize, cols: usize) -> WeightLayout {
    if worker.platform().host_kernels {
        projection_kernel_layout(rows, cols)
    } else {
        WeightLayout::RowMajor
    }
}

/// The layout this process's `wo_a` kernel reads a `Wo_a` of `groups` groups of `rows` rows
/// by `cols` in.
pub fn wo_a_kernel_layout(groups: usize, rows: usize, cols: usize) -> WeightLayout {
    let isa = Isa::detected();
    if groups == 0 || !whole(rows, cols) {
        WeightLayout::RowMajor
    } else if paired_weights_pay(isa) {
        WeightLayout::Pairs
    } else if tiled_weights_pay(isa) {
        WeightLayout::Tiled
    } else {
        WeightLayout::RowMajor
    }
}

/// The layout `Wo_a` (`groups` groups of `rows` rows by `cols`) is uploaded in for `worker`.
pub fn wo_a_upload_layout(
    worker: &Worker,
    groups: usize,
    rows: usize,
    cols: usize,
) -> WeightLayout {
    if worker.platform().host_kernels {
        wo_a_kernel_layout(groups, rows, cols)
    } else {
        WeightLayout::RowMajor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_projections_pair_or_tile() {
        let want = if paired_weights_pay(Isa::detected()) {
            WeightLayout::Pairs
        } else if tiled_weights_pay(Isa::detected()) {
            WeightLayout::Tiled
        } else {
            WeightLayout::RowMajor
        };
        assert_eq!(projection_kernel_layout(1024, 4096), want);
        assert_eq!(projection_kernel_layout(64, 4096), want);
        for (r, k) in [(24, 64), (16, 48), (0, 64), (16, 0)] {
            assert_eq!(
                projection_kernel_layout(r, k),
                WeightLayout::RowMajor,
                "{r} {k}"
            );
        }
    }

    #[test]
    fn only_whole_groups_and_steps_pair_or_tile() {
        let want = if paired_weights_pay(Isa::detected()) {
            WeightLayout::Pairs
        } else if tiled_weights_pay(Isa::detected()) {
            WeightLayout::Tiled
        } else {
            WeightLayout::RowMajor
        };
        assert_eq!(wo_a_kernel_layout(8, 1024, 4096), want);
        for (g, r, k) in [(2, 16, 48), (2, 8, 64), (0, 16, 64), (2, 0, 64)] {
            assert_eq!(
                wo_a_kernel_layout(g, r, k),
                WeightLayout::RowMajor,
                "{g} {r} {k}"
            );
        }
    }
}
