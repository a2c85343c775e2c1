//! Portable GEMM path: plain Rust over the packed layout, eight lanes per accumulator so the
//! compiler can vectorise it. Tiled and paired weights are gathered one row body at a time into a
//! row-major copy (this path reads them only where nothing faster runs them).

use super::{Lowered, PACK_BLOCK, edge_sum, finish};

const HALF: usize = PACK_BLOCK / 2;

/// Computes the tile described by `lw` into `out`.
pub(super) fn gemm(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) {
    let mut gathered = Vec::new();
    for n in lw.n.clone() {
        let body: &[u16] = if lw.tiled || lw.pairs {
            gathered.clear();
            gathered.extend((lw.kb0..lw.kb1).map(|kk| lw.w_at(n, kk)));
            &gathered
        } else {
            &lw.w[n * lw.ldw + lw.kb0..n * lw.ldw + lw.kb1]
        };
        for b in 0..lw.batch {
            let xrow = &lw.x[b * lw.ldx..b * lw.ldx + lw.ldw];
            let mut acc = [0.0f32; HALF];
            let body_w = body.chunks_exact(PACK_BLOCK);
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
