//! Golden of the MoE layer's decode step (`docs/dsv4.md`, "MoE"): the gate (int8 activations,
//! sqrt-softplus scores, hash or biased top-k routing, normalised and scaled weights), the
//! shared and routed SwiGLU experts with the clamp, the reduce and `hc_post`. Every routed
//! expert is evaluated here; the expert-parallel split does not change the math.

use super::{HcPre, dot_i8, hc_post, hc_pre, quant_row, rb};
use crate::dsv4::config::Dsv4Config;
use crate::dsv4::fixture::{Expert, MoeWeights, StepInputs};

/// One token's routing: `(expert, weight)` in selection order.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// Chosen experts.
    pub experts: Vec<usize>,
    /// Their weights (`score / Σ score · route_scale`).
    pub weights: Vec<f32>,
    /// Every expert's score `sqrt(softplus(logit))`.
    pub scores: Vec<f32>,
}

/// What one MoE step produced.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeStep {
    /// New residual `[T, hc_mult, hidden]` fp32.
    pub x_out: Vec<f32>,
    /// Reduced expert output `bf16(shared + Σ routed)` `[T, hidden]`.
    pub y: Vec<f32>,
    /// Shared experts' output, summed, `[T, hidden]` fp32 (before the reduce).
    pub shared: Vec<f32>,
    /// Each routed expert's weighted output `[T, n_activated_experts, hidden]` fp32, in the
    /// order of `routes[t].experts` (what combine returns to the token's rank).
    pub routed: Vec<f32>,
    /// Each token's routing.
    pub routes: Vec<Route>,
    /// The hyper-connection weights of each token.
    pub hc: Vec<HcPre>,
}

/// `log(1 + e^x)` without overflow.
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// The token's int8 activations `(scale, q)`: `q` quantises `x_mixed · w_norm` per row and
/// `scale` folds the deferred `1/rms` in, so `q · scale = RMSNorm(x_mixed)` up to rounding.
pub fn quant_activations(cfg: &Dsv4Config, w: &MoeWeights, x_mixed: &[f32]) -> (f32, Vec<i32>) {
    let ms = x_mixed.iter().map(|v| v * v).sum::<f32>() / x_mixed.len() as f32;
    let inv = 1.0 / (ms + cfg.rms_eps).sqrt();
    let a: Vec<f32> = x_mixed
        .iter()
        .zip(&w.ffn_norm)
        .map(|(x, g)| x * g)
        .collect();
    let (s, q) = quant_row(&a);
    (s * inv, q)
}

/// Routing of one token from its int8 activations. Layers below `n_hash_layers` take the
/// token's row of the hash table; others the top `n_activated_experts` of `score + bias`
/// (ties to the lower expert). Weights use the unbiased scores.
pub fn route(
    cfg: &Dsv4Config,
    w: &MoeWeights,
    layer: usize,
    token_id: u32,
    xs: f32,
    xq: &[i32],
) -> Route {
    let d = cfg.hidden;
    let k = cfg.n_activated_experts;
    let scores: Vec<f32> = (0..cfg.n_routed_experts)
        .map(|e| {
            let logit: f32 = w.gate[e * d..(e + 1) * d]
                .iter()
                .zip(xq)
                .map(|(g, &q)| g * q as f32)
                .sum::<f32>()
                * xs;
            softplus(logit).sqrt()
        })
        .collect();
    let experts: Vec<usize> = if layer < cfg.n_hash_layers {
        let row = token_id as usize * k;
        w.tid2eid[row..row + k]
            .iter()
            .map(|&e| e as usize)
            .collect()
    } else {
        let mut order: Vec<usize> = (0..cfg.n_routed_experts).collect();
        // Stable sort: equal biased scores keep the lower expert first.
        order.sort_by(|&a, &b| (scores[b] + w.bias[b]).total_cmp(&(scores[a] + w.bias[a])));
        order.truncate(k);
        order
    };
    let total: f32 = experts.iter().map(|&e| scores[e]).sum();
    let weights = experts
        .iter()
        .map(|&e| scores[e] / total * cfg.route_scale)
        .collect();
    Route {
        experts,
        weights,
        scores,
    }
}

/// One SwiGLU expert on int8 activations: `g = min(g, limit)`, `u = clamp(u, ±limit)`,
/// `h = silu(g) · u`, re-quantised per row with `weight` folded into its scale, `y = h @ W2ᵀ`.
pub fn expert_forward(cfg: &Dsv4Config, e: &Expert, xs: f32, xq: &[i32], weight: f32) -> Vec<f32> {
    let lim = cfg.swiglu_limit;
    let h: Vec<f32> = (0..cfg.moe_inter_dim)
        .map(|j| {
            let g = dot_i8(xq, e.w1.row(j)) as f32 * xs * e.w1.scale[j];
            let u = dot_i8(xq, e.w3.row(j)) as f32 * xs * e.w3.scale[j];
            let (g, u) = (g.min(lim), u.clamp(-lim, lim));
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    let (hs, hq) = quant_row(&h);
    let hs = hs * weight;
    (0..cfg.hidden)
        .map(|n| dot_i8(&hq, e.w2.row(n)) as f32 * hs * e.w2.scale[n])
        .collect()
}

/// One MoE decode step of layer `layer` (which decides hash vs top-k routing).
pub fn moe_step(cfg: &Dsv4Config, w: &MoeWeights, layer: usize, inputs: &StepInputs) -> MoeStep {
    let (hc, d) = (cfg.hc_mult, cfg.hidden);
    let hps = (0..inputs.n_tokens())
        .map(|t| hc_pre(cfg, &w.hc, &inputs.x_hc[t * hc * d..(t + 1) * hc * d]))
        .collect();
    moe_after_hc_pre(cfg, w, layer, inputs, hps)
}

/// The MoE step from each token's `hc_pre` result on: a check can feed another
/// implementation's `hc_pre` (whose bf16 `x_mixed` may differ by an ulp where the sum lies
/// at a rounding boundary) and judge the rest on the same input.
pub fn moe_after_hc_pre(
    cfg: &Dsv4Config,
    w: &MoeWeights,
    layer: usize,
    inputs: &StepInputs,
    hps: Vec<HcPre>,
) -> MoeStep {
    let (hc, d) = (cfg.hc_mult, cfg.hidden);
    let n_tokens = inputs.n_tokens();
    let mut step = MoeStep {
        x_out: vec![0.0; n_tokens * hc * d],
        y: vec![0.0; n_tokens * d],
        shared: vec![0.0; n_tokens * d],
        routed: vec![0.0; n_tokens * cfg.n_activated_experts * d],
        routes: Vec::with_capacity(n_tokens),
        hc: Vec::with_capacity(n_tokens),
    };
    for (t, hp) in hps.into_iter().enumerate().take(n_tokens) {
        let x = &inputs.x_hc[t * hc * d..(t + 1) * hc * d];
        let (xs, xq) = quant_activations(cfg, w, &hp.x_mixed);
        let r = route(cfg, w, layer, inputs.token_ids[t], xs, &xq);
        let mut acc = vec![0.0f32; d];
        for e in &w.shared {
            for (a, v) in acc.iter_mut().zip(expert_forward(cfg, e, xs, &xq, 1.0)) {
                *a += v;
            }
        }
        step.shared[t * d..(t + 1) * d].copy_from_slice(&acc);
        let k = cfg.n_activated_experts;
        for (j, (&e, &wt)) in r.experts.iter().zip(&r.weights).enumerate() {
            let out = expert_forward(cfg, &w.routed[e], xs, &xq, wt);
            for (a, v) in acc.iter_mut().zip(&out) {
                *a += v;
            }
            step.routed[(t * k + j) * d..(t * k + j + 1) * d].copy_from_slice(&out);
        }
        let y: Vec<f32> = acc.iter().map(|&v| rb(v)).collect();
        step.x_out[t * hc * d..(t + 1) * hc * d].copy_from_slice(&hc_post(cfg, &hp, x, &y));
        step.y[t * d..(t + 1) * d].copy_from_slice(&y);
        step.routes.push(r);
        step.hc.push(hp);
    }
    step
}
