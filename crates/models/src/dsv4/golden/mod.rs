//! The independent fp32 golden of one DeepSeek-V4 decode step (`docs/dsv4.md`): plain scalar
//! loops that follow the documented formulas and cast points and share no code with the
//! kernels. This file holds the building blocks every layer kind uses (hyper-connections with
//! Sinkhorn, RMSNorm, interleaved RoPE with YaRN and its inverse, per-row int8); the layers
//! are in [`attention`] (SWA, CSA, HCA), [`compress`] (the HCA compressor), [`csa`] (the
//! overlapping compressor and the indexer) and [`moe`].

pub mod attention;
pub mod compress;
pub mod csa;
pub mod moe;

use half::bf16;

use super::config::Dsv4Config;
use super::fixture::HcWeights;

pub use attention::{
    AttnStep, CacheWrite, attention_core, attention_dense, csa_step, hca_step, output_projection,
    swa_step,
};
pub use compress::{StateWrite, compress_step, pool_window};
pub use csa::{
    ClosedRow, CsaWrites, IndexPick, IndexWrite, hadamard, index_pick, overlap_compress_step,
};
pub use moe::{
    MoeStep, Route, expert_forward, moe_after_hc_pre, moe_step, quant_activations, route,
};

/// `bf16(x)` as f32, round to nearest even (every cast point unless stated otherwise).
pub fn rb(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// `bf16(x)` as f32 with ties rounded away from zero in magnitude ("round half up" of
/// `x_mixed`): add half an ulp of bf16 to the magnitude bits and truncate.
pub fn rb_half_up(x: f32) -> f32 {
    if !x.is_finite() {
        return rb(x);
    }
    f32::from_bits(x.to_bits().wrapping_add(0x8000) & 0xFFFF_0000)
}

/// What `hc_pre` produces for one token.
#[derive(Clone, Debug, PartialEq)]
pub struct HcPre {
    /// Stream weights into the sub-layer `[hc]`.
    pub pre: Vec<f32>,
    /// Weights of the sub-layer output into each stream `[hc]`.
    pub post: Vec<f32>,
    /// Stream mixing `comb[i][o]` `[hc, hc]` row-major (from stream `i` into stream `o`),
    /// doubly stochastic after Sinkhorn.
    pub comb: Vec<f32>,
    /// `bf16(Σ_i x_i · pre_i)` `[hidden]` (half-up rounding).
    pub x_mixed: Vec<f32>,
}

/// `hc_pre` of one token: `x` is `[hc, hidden]`.
pub fn hc_pre(cfg: &Dsv4Config, w: &HcWeights, x: &[f32]) -> HcPre {
    let hc = cfg.hc_mult;
    let d = cfg.hidden;
    let n = hc * d;
    // Sums over the hc · hidden values in f64 (see `matvec_bf16`): `x_mixed` is rounded to
    // bf16 right after, so an fp32 sum's error would flip some of its values.
    let ms = (x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / n as f64) as f32;
    let inv = 1.0 / (ms + cfg.rms_eps).sqrt();
    let mix: Vec<f32> = (0..cfg.hc_mix())
        .map(|m| {
            let row = &w.mix[m * n..(m + 1) * n];
            let dot = row
                .iter()
                .zip(x)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum::<f64>();
            inv * dot as f32
        })
        .collect();
    let sigmoid = |v: f32| 1.0 / (1.0 + (-v).exp());
    let pre = (0..hc)
        .map(|i| sigmoid(mix[i] * w.scale[0] + w.base[i]) + cfg.hc_eps)
        .collect();
    let post = (0..hc)
        .map(|i| 2.0 * sigmoid(mix[hc + i] * w.scale[1] + w.base[hc + i]))
        .collect();
    let logits: Vec<f32> = (0..hc * hc)
        .map(|k| mix[2 * hc + k] * w.scale[2] + w.base[2 * hc + k])
        .collect();
    let comb = sinkhorn(&logits, hc, cfg.hc_sinkhorn_iters, cfg.hc_eps);
    let mut hp = HcPre {
        pre,
        post,
        comb,
        x_mixed: vec![0.0; d],
    };
    for (j, o) in hp.x_mixed.iter_mut().enumerate() {
        // Pairwise order as documented: (x0 p0 + x1 p1) + (x2 p2 + x3 p3) for 4 streams.
        let term = |i: usize| x[i * d + j] * hp.pre[i];
        let v = if hc == 4 {
            (term(0) + term(1)) + (term(2) + term(3))
        } else {
            (0..hc).map(term).sum()
        };
        *o = rb_half_up(v);
    }
    hp
}

/// Row softmax of `logits` (`[n, n]`) plus `eps`, columns normalised, then `iters - 1` rounds
/// of (rows, columns); every divisor is `sum + eps`.
pub fn sinkhorn(logits: &[f32], n: usize, iters: usize, eps: f32) -> Vec<f32> {
    let mut c = vec![0.0f32; n * n];
    for i in 0..n {
        let row = &logits[i * n..(i + 1) * n];
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let s: f32 = row.iter().map(|v| (v - m).exp()).sum();
        for o in 0..n {
            c[i * n + o] = (row[o] - m).exp() / s + eps;
        }
    }
    let norm_cols = |c: &mut [f32]| {
        for o in 0..n {
            let s: f32 = (0..n).map(|i| c[i * n + o]).sum();
            for i in 0..n {
                c[i * n + o] /= s + eps;
            }
        }
    };
    let norm_rows = |c: &mut [f32]| {
        for row in c.chunks_mut(n) {
            let s: f32 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= s + eps);
        }
    };
    norm_cols(&mut c);
    for _ in 1..iters {
        norm_rows(&mut c);
        norm_cols(&mut c);
    }
    c
}

/// `hc_post` of one token: `y[o, :] = post[o] · out + Σ_i x[i, :] · comb[i][o]` (fp32),
/// `x` `[hc, hidden]`, `out` `[hidden]`.
pub fn hc_post(cfg: &Dsv4Config, hp: &HcPre, x: &[f32], out: &[f32]) -> Vec<f32> {
    let (hc, d) = (cfg.hc_mult, cfg.hidden);
    let mut y = vec![0.0f32; hc * d];
    for o in 0..hc {
        for j in 0..d {
            let mut acc = hp.post[o] * out[j];
            for i in 0..hc {
                acc += x[i * d + j] * hp.comb[i * hc + o];
            }
            y[o * d + j] = acc;
        }
    }
    y
}

/// `bf16(x · rsqrt(mean x² + eps) · w)`; `w = None` is the weightless norm.
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32) -> Vec<f32> {
    let ms = (x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64) as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter()
        .enumerate()
        .map(|(i, v)| rb(v * inv * w.map_or(1.0, |w| w[i])))
        .collect()
}

/// Which RoPE a layer uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeKind {
    /// θ `rope_theta`, no scaling (SWA layers).
    Plain,
    /// θ `compress_rope_theta` with YaRN (CSA and HCA layers).
    Yarn,
}

/// The `rope_dim / 2` inverse frequencies, in f64.
pub fn rope_inv_freq(cfg: &Dsv4Config, kind: RopeKind) -> Vec<f64> {
    let dim = cfg.rope_dim as f64;
    let half = cfg.rope_dim / 2;
    let theta = match kind {
        RopeKind::Plain => cfg.rope_theta,
        RopeKind::Yarn => cfg.compress_rope_theta,
    };
    let base: Vec<f64> = (0..half)
        .map(|i| theta.powf(-2.0 * i as f64 / dim))
        .collect();
    if kind == RopeKind::Plain {
        return base;
    }
    let y = cfg.yarn;
    // c(r): the pair index whose wavelength fits r times into the original length.
    let c = |r: f64| {
        dim * (y.original_max_position as f64 / (2.0 * std::f64::consts::PI * r)).ln()
            / (2.0 * theta.ln())
    };
    let low = c(y.beta_fast).floor().max(0.0);
    // The reference clamps to the roped width; the spec's formula has no clamp, and the two
    // agree at every shape here (at tiny, c(1) = 3.09: high 4 of 7).
    let high = c(y.beta_slow).ceil().min(dim - 1.0);
    // A degenerate ramp (high <= low) would divide by zero; widen it as the reference does.
    let span = if high > low { high - low } else { 1e-3 };
    base.iter()
        .enumerate()
        .map(|(i, &f)| {
            let smooth = 1.0 - ((i as f64 - low) / span).clamp(0.0, 1.0);
            f / y.factor * (1.0 - smooth) + f * smooth
        })
        .collect()
}

/// `(cos, sin)` of each pair at `pos`, rounded to f32 after the f64 angle.
pub fn rope_cos_sin(inv_freq: &[f64], pos: usize) -> Vec<(f32, f32)> {
    inv_freq
        .iter()
        .map(|&f| {
            let a = pos as f64 * f;
            (a.cos() as f32, a.sin() as f32)
        })
        .collect()
}

/// Interleaved RoPE in place on `v` (`rope_dim` wide): pair `(2j, 2j+1)` turns by angle `j`.
pub fn rope(v: &mut [f32], cs: &[(f32, f32)]) {
    for (j, &(c, s)) in cs.iter().enumerate() {
        let (e, o) = (v[2 * j], v[2 * j + 1]);
        v[2 * j] = e * c - o * s;
        v[2 * j + 1] = e * s + o * c;
    }
}

/// The inverse rotation of [`rope`].
pub fn rope_inverse(v: &mut [f32], cs: &[(f32, f32)]) {
    for (j, &(c, s)) in cs.iter().enumerate() {
        let (e, o) = (v[2 * j], v[2 * j + 1]);
        v[2 * j] = e * c + o * s;
        v[2 * j + 1] = o * c - e * s;
    }
}

/// Per-row symmetric int8 of `x`: `(scale, q)`, `scale = amax / 127`, ties away from zero.
pub fn quant_row(x: &[f32]) -> (f32, Vec<i32>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return (0.0, vec![0; x.len()]);
    }
    let scale = amax / 127.0;
    (
        scale,
        x.iter()
            .map(|&v| (v / scale).round().clamp(-127.0, 127.0) as i32)
            .collect(),
    )
}

/// `Σ a[k] · b[k]` of an int8 row and int8 weights, exact in i32.
pub fn dot_i8(a: &[i32], b: &[i8]) -> i32 {
    a.iter().zip(b).map(|(&x, &w)| x * i32::from(w)).sum()
}

/// `y[o] = Σ_k x[k] · w[o, k]` with `w` `[n_out, x.len()]` bf16, rounded to fp32.
///
/// The sum is taken in f64: a sequential fp32 sum over thousands of terms errs by ~1e-5
/// relative (ten times a blocked kernel's error), enough to flip the bf16 and int8 roundings
/// that follow every projection, and each flip moves the layer's output by more than the
/// tolerance allows. Accumulated exactly enough, the reference is what fp32 accumulation
/// approximates, whatever its order.
pub fn matvec_bf16(x: &[f32], w: &[bf16], n_out: usize) -> Vec<f32> {
    let k = x.len();
    (0..n_out)
        .map(|o| {
            w[o * k..(o + 1) * k]
                .iter()
                .zip(x)
                .map(|(w, x)| f64::from(w.to_f32()) * f64::from(*x))
                .sum::<f64>() as f32
        })
        .collect()
}

#[cfg(test)]
mod tests;
