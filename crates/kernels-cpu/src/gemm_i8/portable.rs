//! Portable int8 paths: plain loops (the reference every other path is tested against).

use super::{Lowered, LoweredWide};

/// Computes the W8A8 tile described by its `k` segments into `out`.
pub(super) fn gemm(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    for lw in segs {
        for n in lw.n.clone() {
            for b in 0..lw.batch {
                let sum = lw.dot(n, b, lw.k.clone());
                lw.finish(out, ld_out, n, b, sum);
            }
        }
    }
}

/// Computes the wide tile described by `lw` into `out`, eight partial sums per row so the
/// compiler can vectorise it.
pub(super) fn gemm_wide(lw: &LoweredWide<'_>, out: &mut [f32], ld_out: usize) {
    const LANES: usize = 8;
    let klen = lw.k.len();
    let body = lw.k.start + klen / LANES * LANES;
    for n in lw.n.clone() {
        let w = &lw.w[n * lw.ldw..];
        for b in 0..lw.batch {
            let x = &lw.x[b * lw.ldx..];
            let mut acc = [0.0f32; LANES];
            for (wc, xc) in w[lw.k.start..body]
                .chunks_exact(LANES)
                .zip(x[lw.k.start..body].chunks_exact(LANES))
            {
                for i in 0..LANES {
                    acc[i] += f32::from(wc[i]) * xc[i];
                }
            }
            let sum = acc.iter().sum::<f32>() + lw.dot(n, b, body..lw.k.end);
            lw.finish(out, ld_out, n, b, sum);
        }
    }
}
