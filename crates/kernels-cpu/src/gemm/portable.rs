//! Portable GEMM path: plain Rust over the packed layout, eight lanes per accumulator so the
//! compiler can vectorise it.

use super::{Lowered, PACK_BLOCK, edge_sum, finish};

const HALF: usize = PACK_BLOCK / 2;

/// Computes the tile described by `lw` into `out`.
pub(super) fn gemm(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) {
    for n in lw.n.clone() {
        let wrow = &lw.w[n * lw.ldw..(n + 1) * lw.ldw];
        for b in 0..lw.batch {
            let xrow = &lw.x[b * lw.ldx..b * lw.ldx + lw.ldw];
            let mut acc = [0.0f32; HALF];
            let body_w = wrow[lw.kb0..lw.kb1].chunks_exact(PACK_BLOCK);
            let body_x = xrow[lw.kb0..lw.kb1].chunks_exact(PACK_BLOCK);
            for (wb, xb) in body_w.zip(body_x) {
                for i in 0..HALF {
                    let we = f32::from_bits(u32::from(wb[2 * i]) << 16);
                    let wo = f32::from_bits(u32::from(wb[2 * i + 1]) << 16);
                    acc[i] += we * xb[i] + wo * xb[HALF + i];
                }
            }
            let sum = acc.iter().sum::<f32>() + edge_sum(lw, n, b);
            finish(lw, out, ld_out, n, b, sum);
        }
    }
}
