//! Hyper-connection kernels: the mix products of every token (`hc_mix`, SPMD over the mix
//! weight rows, so each weight row is read once per step), `hc_pre` (the weights, the mixed
//! stream and the attention norm into packed GEMM activations, SPMD over token rows) and
//! `hc_post` (SPMD over token rows).

use simpler_core::{KernelError, TaskCtx};
use simpler_kernels_cpu::dsv4 as k;
use simpler_kernels_cpu::{pack_acts_f32, packed_ld};

use super::{bad, check_len, dims2};

/// `HC_MIX` argument indices.
pub(crate) mod mix {
    pub(crate) const X: usize = 0;
    pub(crate) const W: usize = 1;
    pub(crate) const DOTS: usize = 2;
}

/// `HC_PRE` argument indices.
pub(crate) mod pre {
    pub(crate) const X: usize = 0;
    pub(crate) const DOTS: usize = 1;
    pub(crate) const BASE: usize = 2;
    pub(crate) const NORM: usize = 3;
    pub(crate) const HCW: usize = 4;
    pub(crate) const XN: usize = 5;
}

/// `HC_POST` argument indices.
pub(crate) mod post {
    pub(crate) const X: usize = 0;
    pub(crate) const Y: usize = 1;
    pub(crate) const HCW: usize = 2;
    pub(crate) const OUT: usize = 3;
}

pub(super) fn hc_mix(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_hc_mix";
    let (rows, n) = dims2(ctx, mix::X)?;
    let (m, wn) = dims2(ctx, mix::W)?;
    if wn != n || n == 0 {
        return Err(bad(
            NAME,
            format!("mix weights [{m}, {wn}] for rows of {n}"),
        ));
    }
    let x = ctx.read::<f32>(mix::X)?;
    let w = ctx.read::<f32>(mix::W)?;
    let mut dots = ctx.write_block_cols::<f32>(mix::DOTS, 1)?;
    if dots.len() != rows || dots.view_row_len() != m {
        return Err(bad(NAME, "dots are not [tokens, mix rows]"));
    }
    let (j0, nj) = (dots.first_col(), dots.row_len());
    if nj == 0 {
        return Ok(());
    }
    let mut out = vec![0.0f32; rows * nj];
    k::hc_mix_dots(x, n, &w[j0 * n..(j0 + nj) * n], &mut out, nj);
    for (t, o) in out.chunks_exact(nj).enumerate() {
        dots.row(t).copy_from_slice(o);
    }
    Ok(())
}

pub(super) fn hc_pre(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_hc_pre";
    let hc = ctx.scalar_usize(0)?;
    let iters = ctx.scalar_usize(1)?;
    let hc_eps = ctx.scalar_f32(2)?;
    let rms_eps = ctx.scalar_f32(3)?;
    let scale = [ctx.scalar_f32(4)?, ctx.scalar_f32(5)?, ctx.scalar_f32(6)?];
    let (rows, n) = dims2(ctx, pre::X)?;
    let m = k::hc_mix_len(hc);
    if hc == 0 || !n.is_multiple_of(hc) {
        return Err(bad(NAME, format!("rows of {n} are not {hc} streams")));
    }
    let d = n / hc;
    let x = ctx.read::<f32>(pre::X)?;
    let dots = ctx.read::<f32>(pre::DOTS)?;
    let base = ctx.read::<f32>(pre::BASE)?;
    let norm = ctx.read::<f32>(pre::NORM)?;
    check_len(NAME, "mix dots", dots.len(), rows * m)?;
    check_len(NAME, "base", base.len(), m)?;
    check_len(NAME, "norm", norm.len(), d)?;
    let mut hcw = ctx.write_block_rows::<f32>(pre::HCW)?;
    let mut xn = ctx.write_block_rows::<f32>(pre::XN)?;
    if hcw.row_len() != m || xn.row_len() != packed_ld(d) || hcw.len() != xn.len() {
        return Err(bad(
            NAME,
            "weights rows of hc_mix and packed rows of the hidden size",
        ));
    }
    let (t0, nt) = (hcw.first_row(), hcw.len());
    if t0 + nt > rows {
        return Err(bad(NAME, "more output rows than input rows"));
    }
    let xs = &x[t0 * n..(t0 + nt) * n];
    // The logits as `hc_mix_logits` forms them: the token's 1/rms times its dots.
    // The tokens of the block go through each step together: their f64 sums (1/rms of the
    // streams, then of the mixed rows) are independent chains that overlap.
    let mut logits = dots[t0 * m..(t0 + nt) * m].to_vec();
    let mut inv = vec![0.0f32; nt];
    k::hc_inv_rms_rows(xs, n, rms_eps, &mut inv);
    for (lg, &inv) in logits.chunks_exact_mut(m).zip(&inv) {
        for v in lg {
            *v *= inv;
        }
    }
    let mut mixed = vec![0.0f32; nt * d];
    for (r, (lg, mx)) in logits
        .chunks_exact_mut(m)
        .zip(mixed.chunks_exact_mut(d))
        .enumerate()
    {
        k::hc_weights(lg, hc, scale, base, iters, hc_eps);
        hcw.row(r).copy_from_slice(lg);
        k::hc_mix_streams(&xs[r * n..(r + 1) * n], &lg[..hc], mx);
    }
    k::rms_norm_round(&mut mixed, d, Some(norm), rms_eps);
    // The packing kernel moves whole blocks (the baseline build's element loop here, each
    // store at its `pack_index`, made the phase 1.06× slower in the SWA step on Zen 3).
    for (r, mx) in mixed.chunks_exact(d).enumerate() {
        pack_acts_f32(mx, 1, d, xn.row(r));
    }
    Ok(())
}

pub(super) fn hc_post(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_hc_post";
    let hc = ctx.scalar_usize(0)?;
    let (rows, n) = dims2(ctx, post::X)?;
    if hc == 0 || !n.is_multiple_of(hc) {
        return Err(bad(NAME, format!("rows of {n} are not {hc} streams")));
    }
    let (d, m) = (n / hc, k::hc_mix_len(hc));
    let x = ctx.read::<f32>(post::X)?;
    let y = ctx.read::<f32>(post::Y)?;
    let hcw = ctx.read::<f32>(post::HCW)?;
    check_len(NAME, "y", y.len(), rows * d)?;
    check_len(NAME, "hc weights", hcw.len(), rows * m)?;
    let mut out = ctx.write_block_rows::<f32>(post::OUT)?;
    if out.row_len() != n {
        return Err(bad(NAME, "output rows are not hc · hidden wide"));
    }
    let t0 = out.first_row();
    for r in 0..out.len() {
        let t = t0 + r;
        let w = &hcw[t * m..(t + 1) * m];
        k::hc_post(
            &x[t * n..(t + 1) * n],
            &y[t * d..(t + 1) * d],
            &w[hc..2 * hc],
            &w[2 * hc..],
            out.row(r),
        );
    }
    Ok(())
}
