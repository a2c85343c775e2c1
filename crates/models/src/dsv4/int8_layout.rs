//! Which layout of the int8 GEMM DeepSeek-V4's int8 weights take (row-major,
//! [`I8Layout::Packed`] or [`I8Layout::Interleaved`]; `docs/dsv4.md`, "int8 weight layout"):
//! the upload and the kernels that read the buffers must agree, and both decide from the same
//! process-wide query.
//!
//! - Upload ([`upload_layout`]): the layout the weights' use takes on this machine
//!   ([`kernel_layout`]: for the attention products, [`I8Layout::preferred_for`] their rows)
//!   when the worker's kernels run on the host
//!   ([`PlatformInfo::host_kernels`](simpler_core::PlatformInfo)); row-major otherwise, so a
//!   device platform receives the same bytes as before.
//! - Kernels ([`kernel_layout`]): these kernels run only on host-kernel platforms, so they
//!   read the same decision without the platform test.
//!
//! Packing or interleaving reorders the `N * K` values of a matrix in place of the row-major
//! copy (the buffer has the same size and shape); the scales stay per row in row order.

use std::borrow::Cow;

use simpler_core::Worker;
use simpler_kernels_cpu::{I8Layout, pack_weights_i8_as};

/// What a DeepSeek-V4 int8 weight matrix is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Use {
    /// `Wq_b`, `Wo_b` and the indexer's `W_idx`: products of the step's `rows` token rows
    /// (`batch · 2`), the same count at upload and in the kernels.
    Attention {
        /// Token rows per product.
        rows: usize,
    },
    /// The experts' `W1`, `W3`, `W2`: 0–8 rows per expert at the spec's decode batch (about 3
    /// per routed expert, every token on the shared one).
    Experts,
}

/// The layout int8 weights of `use_` are uploaded in for `worker`.
pub fn upload_layout(worker: &Worker, use_: Int8Use) -> I8Layout {
    if worker.platform().host_kernels {
        kernel_layout(use_)
    } else {
        I8Layout::RowMajor
    }
}

/// The layout this process's int8 kernels read weight buffers of `use_` in. The attention
/// products take [`I8Layout::preferred_for`] their rows: at the spec's 8 rows, interleaved for
/// the AVX-512 VNNI lane-wise kernel where the machine has it; packed from 9 rows on AMX-INT8
/// tiles. The experts go interleaved wherever the lane-wise kernel runs (whatever their row
/// count: it takes 1–8 rows), row-major elsewhere. Whole cold MoE steps measured 8–10% faster
/// interleaved than row-major (16 experts in one process, and 2 ranks of 32), although the
/// kernel harness alone (`dsv4_proj_bw moe_*`) streams 1–3 rows faster row-major
/// (`docs/benchmarks.md`, "Session 25"); packed weights measured level to 7% slower
/// ("Packed int8 weights").
pub fn kernel_layout(use_: Int8Use) -> I8Layout {
    match use_ {
        Int8Use::Attention { rows } => I8Layout::preferred_for(rows),
        Int8Use::Experts => {
            match I8Layout::preferred_for(simpler_kernels_cpu::INTERLEAVED_MIN_ROWS) {
                I8Layout::Interleaved => I8Layout::Interleaved,
                _ => I8Layout::RowMajor,
            }
        }
    }
}

/// `count` row-major matrices `[rows, cols]` stacked in `q`, each in `layout` (stacked in the
/// same order).
///
/// # Panics
/// If `q.len() != count * rows * cols`.
pub fn stacked_in_layout(
    q: &[i8],
    count: usize,
    rows: usize,
    cols: usize,
    layout: I8Layout,
) -> Cow<'_, [i8]> {
    let one = rows * cols;
    assert_eq!(q.len(), count * one, "stacked int8 weights: length");
    match layout {
        I8Layout::RowMajor => Cow::Borrowed(q),
        I8Layout::Packed | I8Layout::Interleaved => {
            let mut out = vec![0i8; q.len()];
            if one > 0 {
                for (src, dst) in q.chunks_exact(one).zip(out.chunks_exact_mut(one)) {
                    pack_weights_i8_as(layout, src, rows, cols, cols, dst);
                }
            }
            Cow::Owned(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use simpler_kernels_cpu::{interleaved_index_i8, packed_index_i8};

    /// Row-major borrows the stack as it is; packed and interleaved reorder each matrix on its
    /// own, every value where the GEMM's index formula puts it within its matrix's span.
    #[test]
    fn stacked_matrices_are_reordered_one_by_one() {
        let (count, rows, cols) = (3, 19, 70);
        let q: Vec<i8> = (0..count * rows * cols)
            .map(|i| ((i % 251) as i32 - 125) as i8)
            .collect();
        let rm = stacked_in_layout(&q, count, rows, cols, I8Layout::RowMajor);
        assert!(matches!(rm, Cow::Borrowed(_)));
        type Index = fn(usize, usize, usize, usize) -> usize;
        let layouts: [(I8Layout, Index); 2] = [
            (I8Layout::Packed, packed_index_i8),
            (I8Layout::Interleaved, interleaved_index_i8),
        ];
        for (layout, index) in layouts {
            let packed = stacked_in_layout(&q, count, rows, cols, layout);
            assert_eq!(packed.len(), q.len());
            for m in 0..count {
                let base = m * rows * cols;
                for n in 0..rows {
                    for k in 0..cols {
                        assert_eq!(
                            packed[base + index(rows, cols, n, k)],
                            q[base + n * cols + k],
                            "{layout:?} matrix {m} ({n}, {k})"
                        );
                    }
                }
            }
        }
        // No matrices: nothing to pack.
        assert!(stacked_in_layout(&[], 0, 0, 0, I8Layout::Packed).is_empty());
    }
}
