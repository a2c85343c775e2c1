//! DeepSeek-V4 MoE kernels (`docs/dsv4.md`, "MoE layer"): the gate's int8 input with RMSNorm
//! folded into its scale, the fp32 gate logits and routing (hash rows or the biased top-k),
//! the dispatch plan that groups routed rows per expert, the SwiGLU expert halves on top of the
//! W8A8 GEMM ([`crate::gemm_i8_w8a8`]) and the reduce.
//!
//! Every product goes through `gemm_i8`, so the expert kernels inherit its run-time path choice
//! ([`crate::I8Path`]) and its bit-identical results across paths; the elementwise parts are
//! `multiversion!` bodies (portable and AVX2 builds of the same code).

use std::ops::Range;

use crate::gemm::{GemmTile, OutMode};
use crate::gemm_i8::{ActsI8, NextRows, WeightsI8, gemm_i8_w8a8_then, quantize_row_i8_ties_away};
use crate::multiversion::multiversion;

/// A routing input the kernels cannot use; names the offending value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MoeError {
    /// A hash-table row names an expert past the routed experts.
    #[error("hash routing row names expert {expert}, but there are {n_experts} routed experts")]
    HashExpert {
        /// The expert named.
        expert: u32,
        /// Routed experts.
        n_experts: usize,
    },
    /// A route names an expert past the routed experts.
    #[error("route {route} names expert {expert}, but there are {n_experts} routed experts")]
    RouteExpert {
        /// Route id (`token · top_k + k`).
        route: usize,
        /// The expert named.
        expert: u32,
        /// Routed experts.
        n_experts: usize,
    },
    /// More rows would go to the local experts than the dispatch buffer holds.
    #[error("{rows} routed rows for the local experts, but the dispatch buffer holds {capacity}")]
    Capacity {
        /// Rows routed to the local experts.
        rows: usize,
        /// Rows the buffer holds.
        capacity: usize,
    },
    /// Slice lengths disagree with the shapes.
    #[error("moe {what}: {got} elements, expected {want}")]
    Shape {
        /// The argument.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length the shapes call for.
        want: usize,
    },
    /// Group offsets that do not partition the rows.
    #[error("moe group offsets {offsets:?} are not non-decreasing from 0 within {rows} rows")]
    Offsets {
        /// The offsets.
        offsets: Vec<u32>,
        /// Rows available.
        rows: usize,
    },
}

fn shape(what: &'static str, got: usize, want: usize) -> Result<(), MoeError> {
    if got == want {
        Ok(())
    } else {
        Err(MoeError::Shape { what, got, want })
    }
}

multiversion!(
    fn sum_squares(x: &[f32]) -> f32 {
        let mut acc = [0.0f32; 8];
        let body = x.len() / 8 * 8;
        for c in x[..body].chunks_exact(8) {
            for l in 0..8 {
                acc[l] += c[l] * c[l];
            }
        }
        let tail: f32 = x[body..].iter().map(|v| v * v).sum();
        acc.iter().sum::<f32>() + tail
    }
);

/// The MoE input of one token as int8: `q = quant(x · norm_w)` per row and the returned scale
/// `amax/127 · 1/sqrt(mean x² + eps)`, so `q · scale` is `RMSNorm(x) · norm_w` (the norm folded
/// into the activation scale instead of a separate pass).
///
/// # Panics
/// If `norm_w` or `q` differ in length from `x`.
pub fn moe_quant_input(x: &[f32], norm_w: &[f32], eps: f32, q: &mut [i8]) -> f32 {
    assert_eq!(norm_w.len(), x.len(), "moe_quant_input: norm weight length");
    let inv = 1.0 / (sum_squares(x) / x.len().max(1) as f32 + eps).sqrt();
    let a: Vec<f32> = x.iter().zip(norm_w).map(|(x, g)| x * g).collect();
    quantize_row_i8_ties_away(&a, q) * inv
}

/// Token rows whose dot products with one gate row [`gate_dots`] computes together.
const GATE_ROWS: usize = 4;

/// `out[r] = q[r] · g` for the rows `q[r]` (each `g.len()` long), each sum in eight lanes
/// (lane `l` adds the products of values `l, l + 8, ...` in order, a multiply then an add),
/// the lanes summed in order, then the tail in order: the same bits on every path. On AVX2,
/// blocks of [`GATE_ROWS`] rows share each loaded chunk of `g` and run independent chains:
/// one row at a time was a single chain of dependent adds (4096 at FLASH), ~60 us of the MoE
/// route task's critical path; the compiler regrouped a plain-Rust block's lanes into
/// shuffled half vectors, hence the intrinsics.
fn gate_dots(q: &[&[f32]], g: &[f32], out: &mut [f32]) {
    let d = g.len();
    assert!(
        q.iter().all(|r| r.len() == d) && out.len() == q.len(),
        "gate_dots: shapes"
    );
    let body = d / 8 * 8;
    let finish = |lanes: &[f32; 8], row: &[f32]| {
        let tail: f32 = row[body..].iter().zip(&g[body..]).map(|(a, b)| a * b).sum();
        lanes.iter().sum::<f32>() + tail
    };
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::current() >= crate::isa::Isa::Avx2 {
        let mut r0 = 0;
        while r0 + GATE_ROWS <= q.len() {
            // SAFETY: AVX2 is available (checked); every row is `d >= body` long.
            let lanes = unsafe {
                gate_lanes_avx2::<GATE_ROWS>(std::array::from_fn(|r| q[r0 + r]), g, body)
            };
            for (r, l) in lanes.iter().enumerate() {
                out[r0 + r] = finish(l, q[r0 + r]);
            }
            r0 += GATE_ROWS;
        }
        for r in r0..q.len() {
            // SAFETY: as above.
            let [lanes] = unsafe { gate_lanes_avx2::<1>([q[r]], g, body) };
            out[r] = finish(&lanes, q[r]);
        }
        return;
    }
    for (row, o) in q.iter().zip(out.iter_mut()) {
        let mut lanes = [0.0f32; 8];
        for (a, b) in row[..body].chunks_exact(8).zip(g[..body].chunks_exact(8)) {
            for l in 0..8 {
                lanes[l] += a[l] * b[l];
            }
        }
        *o = finish(&lanes, row);
    }
}

/// The eight lanes of each row's sum over the first `body` values (a multiple of 8), as
/// [`gate_dots`] adds them.
///
/// # Safety
/// The CPU has AVX2; every row and `g` hold at least `body` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gate_lanes_avx2<const R: usize>(q: [&[f32]; R], g: &[f32], body: usize) -> [[f32; 8]; R] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut c = 0;
    while c < body {
        // SAFETY: `c + 8 <= body`, inside `g` and every row (contract).
        let b = unsafe { _mm256_loadu_ps(g.as_ptr().add(c)) };
        for r in 0..R {
            // SAFETY: as above.
            let a = unsafe { _mm256_loadu_ps(q[r].as_ptr().add(c)) };
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(a, b));
        }
        c += 8;
    }
    let mut out = [[0.0f32; 8]; R];
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: `o` holds eight floats.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), a) };
    }
    out
}

/// Gate logits of `rows` tokens: `logits[r, e] = (q[r] · gate[e]) · scale[r]` with the int8
/// activations `q` `[rows, d]`, their scales `[rows]` and the fp32 gate `[n_experts, d]`
/// (fp32 accumulation: the int8 values are exact in fp32).
pub fn moe_gate_logits(
    q: &[i8],
    scales: &[f32],
    gate: &[f32],
    d: usize,
    logits: &mut [f32],
) -> Result<(), MoeError> {
    let rows = scales.len();
    shape("activations", q.len(), rows * d)?;
    if d == 0 || !gate.len().is_multiple_of(d) {
        return Err(MoeError::Shape {
            what: "gate",
            got: gate.len(),
            want: d,
        });
    }
    let n_experts = gate.len() / d;
    shape("logits", logits.len(), rows * n_experts)?;
    let qf: Vec<f32> = q.iter().map(|&v| f32::from(v)).collect();
    let qr: Vec<&[f32]> = qf.chunks_exact(d).collect();
    let mut dots = vec![0.0f32; rows];
    for (e, g) in gate.chunks_exact(d).enumerate() {
        gate_dots(&qr, g, &mut dots);
        for r in 0..rows {
            logits[r * n_experts + e] = dots[r] * scales[r];
        }
    }
    Ok(())
}

/// `sqrt(softplus(x))`, with `softplus(x) = x` above 20 (where `ln(1 + e^x)` equals `x` in
/// fp32).
pub fn sqrt_softplus(x: f32) -> f32 {
    let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
    sp.sqrt()
}

/// One token's routing from its gate logits `[n_experts]`: the experts are `hash_row` when
/// given (hash-routed layers), else the `experts.len()` best of `score + bias` (ties to the
/// lower expert); `weights[k] = score[e_k] / Σ_k score[e_k] · route_scale` from the unbiased
/// scores `sqrt(softplus(logit))`. `scores` receives every expert's score.
pub fn moe_route(
    logits: &[f32],
    bias: &[f32],
    hash_row: Option<&[u32]>,
    route_scale: f32,
    scores: &mut [f32],
    experts: &mut [u32],
    weights: &mut [f32],
) -> Result<(), MoeError> {
    let n = logits.len();
    let k = experts.len();
    shape("bias", bias.len(), n)?;
    shape("scores", scores.len(), n)?;
    shape("weights", weights.len(), k)?;
    for (s, &l) in scores.iter_mut().zip(logits) {
        *s = sqrt_softplus(l);
    }
    match hash_row {
        Some(row) => {
            shape("hash row", row.len(), k)?;
            for (o, &e) in experts.iter_mut().zip(row) {
                if e as usize >= n {
                    return Err(MoeError::HashExpert {
                        expert: e,
                        n_experts: n,
                    });
                }
                *o = e;
            }
        }
        None => {
            if k > n {
                return Err(MoeError::Shape {
                    what: "top-k",
                    got: k,
                    want: n,
                });
            }
            let mut taken = vec![false; n];
            for o in experts.iter_mut() {
                let mut best: Option<usize> = None;
                for e in 0..n {
                    if taken[e] {
                        continue;
                    }
                    let v = scores[e] + bias[e];
                    // Strictly greater: an equal value keeps the lower expert found first.
                    if best.is_none_or(|b| v.total_cmp(&(scores[b] + bias[b])).is_gt()) {
                        best = Some(e);
                    }
                }
                // k <= n, so an untaken expert remains.
                let b = best.unwrap_or(0);
                taken[b] = true;
                *o = b as u32;
            }
        }
    }
    let total: f32 = experts.iter().map(|&e| scores[e as usize]).sum();
    for (w, &e) in weights.iter_mut().zip(experts.iter()) {
        *w = scores[e as usize] / total * route_scale;
    }
    Ok(())
}

/// Where the routed rows of one rank go: its local experts `local` (a range of expert ids),
/// `counts[j]` rows for local expert `local.start + j`, grouped at rows
/// `offsets[j]..offsets[j + 1]` of the dispatch buffer, which holds route `order[r]`
/// (`token · top_k + k`) at row `r`. Routes are grouped by expert, ascending, and keep their
/// route order within an expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchPlan {
    /// Rows per local expert.
    pub counts: Vec<u32>,
    /// `counts.len() + 1` row offsets (a prefix sum of `counts`).
    pub offsets: Vec<u32>,
    /// The route id of each dispatched row.
    pub order: Vec<u32>,
}

/// Plans the dispatch of `routes` (`[tokens · top_k]` expert ids) to the local experts `local`
/// of a buffer of `capacity` rows; routes to other experts are not this rank's.
pub fn moe_dispatch_plan(
    routes: &[u32],
    n_experts: usize,
    local: Range<usize>,
    capacity: usize,
) -> Result<DispatchPlan, MoeError> {
    let mut counts = vec![0u32; local.len()];
    for (r, &e) in routes.iter().enumerate() {
        if e as usize >= n_experts {
            return Err(MoeError::RouteExpert {
                route: r,
                expert: e,
                n_experts,
            });
        }
        if local.contains(&(e as usize)) {
            counts[e as usize - local.start] += 1;
        }
    }
    let mut offsets = Vec::with_capacity(counts.len() + 1);
    let mut acc = 0u32;
    offsets.push(0);
    for &c in &counts {
        acc += c;
        offsets.push(acc);
    }
    if acc as usize > capacity {
        return Err(MoeError::Capacity {
            rows: acc as usize,
            capacity,
        });
    }
    let mut next: Vec<u32> = offsets[..counts.len()].to_vec();
    let mut order = vec![0u32; acc as usize];
    for (r, &e) in routes.iter().enumerate() {
        if local.contains(&(e as usize)) {
            let j = e as usize - local.start;
            order[next[j] as usize] = r as u32;
            next[j] += 1;
        }
    }
    Ok(DispatchPlan {
        counts,
        offsets,
        order,
    })
}

/// Checks that `offsets` start at 0, never decrease and end within `rows`: the groups are then
/// disjoint row ranges.
pub fn check_offsets(offsets: &[u32], rows: usize) -> Result<(), MoeError> {
    let ok = offsets.first() == Some(&0)
        && offsets.windows(2).all(|w| w[0] <= w[1])
        && offsets.last().is_some_and(|&l| l as usize <= rows);
    if ok {
        Ok(())
    } else {
        Err(MoeError::Offsets {
            offsets: offsets.to_vec(),
            rows,
        })
    }
}

/// One expert's int8 weights: `W1`, `W3` `[inter, d]` and `W2` `[d, inter]`, per-row scales.
#[derive(Clone, Copy, Debug)]
pub struct ExpertI8<'a> {
    /// Gate projection `W1`.
    pub w1: WeightsI8<'a>,
    /// Up projection `W3`.
    pub w3: WeightsI8<'a>,
    /// Down projection `W2`.
    pub w2: WeightsI8<'a>,
}

multiversion!(
    fn swiglu_clamp(g: &[f32], u: &[f32], limit: f32, h: &mut [f32]) {
        for ((h, &g), &u) in h.iter_mut().zip(g).zip(u) {
            let g = g.min(limit);
            let u = u.clamp(-limit, limit);
            *h = g / (1.0 + (-g).exp()) * u;
        }
    }
);

/// Columns `cols` of the expert's first half for the rows of `x`:
/// `g = x @ W1ᵀ`, `u = x @ W3ᵀ` (W8A8, scales folded), `h = silu(min(g, limit)) ·
/// clamp(u, ±limit)` into `h` (`[x.rows(), cols.len()]` at row stride `ld_h`). `next` names
/// the weight rows the caller streams afterwards (prefetched while `W3`'s rows finish; W3's
/// first rows are prefetched while `W1`'s finish): a hint that never changes results.
///
/// # Panics
/// If `cols` lies outside `W1`/`W3`, their `K` differs from `x`'s, or `h` is too short.
#[allow(clippy::too_many_arguments)]
pub fn expert_gate_up(
    w1: WeightsI8<'_>,
    w3: WeightsI8<'_>,
    x: ActsI8<'_>,
    cols: Range<usize>,
    limit: f32,
    h: &mut [f32],
    ld_h: usize,
    next: Option<NextRows<'_>>,
) {
    let (rows, n) = (x.rows(), cols.len());
    if rows == 0 || n == 0 {
        return;
    }
    let tile = GemmTile {
        n: cols,
        k: 0..x.cols(),
        mode: OutMode::Store,
    };
    let mut g = vec![0.0f32; rows * n];
    let mut u = vec![0.0f32; rows * n];
    let w3_next = NextRows::new(w3, tile.n.start);
    gemm_i8_w8a8_then(w1, x, &tile, &mut g, n, Some(w3_next));
    gemm_i8_w8a8_then(w3, x, &tile, &mut u, n, next);
    for r in 0..rows {
        swiglu_clamp(
            &g[r * n..(r + 1) * n],
            &u[r * n..(r + 1) * n],
            limit,
            &mut h[r * ld_h..r * ld_h + n],
        );
    }
}

/// Re-quantises one row of `h` for the down projection: `q = quant(h)`, returning the scale
/// times `weight` (the routing weight, 1 for shared experts), so `W2`'s output arrives already
/// weighted.
pub fn expert_quant_h(h: &[f32], weight: f32, q: &mut [i8]) -> f32 {
    quantize_row_i8_ties_away(h, q) * weight
}

/// Columns `cols` of the expert's down projection: `y = hq @ W2ᵀ` (scales folded) into `y`
/// (`[hq.rows(), cols.len()]` at row stride `ld_y`); `next` as for [`expert_gate_up`].
pub fn expert_down(
    w2: WeightsI8<'_>,
    hq: ActsI8<'_>,
    cols: Range<usize>,
    y: &mut [f32],
    ld_y: usize,
    next: Option<NextRows<'_>>,
) {
    let tile = GemmTile {
        n: cols,
        k: 0..hq.cols(),
        mode: OutMode::Store,
    };
    gemm_i8_w8a8_then(w2, hq, &tile, y, ld_y, next);
}

/// A whole expert on the int8 rows `x` (the scalar-free composition of the three kernels
/// above, for tests and single-task use): `y[r] = expert(x[r]) · weights[r]`, `y` `[rows, d]`.
pub fn expert_forward(e: &ExpertI8<'_>, x: ActsI8<'_>, weights: &[f32], limit: f32, y: &mut [f32]) {
    let (rows, inter, d) = (x.rows(), e.w1.rows(), e.w2.rows());
    let mut h = vec![0.0f32; rows * inter];
    // W2's first rows follow W3's last.
    let w2_next = NextRows::new(e.w2, 0);
    expert_gate_up(e.w1, e.w3, x, 0..inter, limit, &mut h, inter, Some(w2_next));
    let mut hq = vec![0i8; rows * inter];
    let mut hs = vec![0.0f32; rows];
    for r in 0..rows {
        hs[r] = expert_quant_h(
            &h[r * inter..(r + 1) * inter],
            weights[r],
            &mut hq[r * inter..(r + 1) * inter],
        );
    }
    let hq = ActsI8::new(&hq, &hs, rows, inter, inter);
    expert_down(e.w2, hq, 0..d, y, d, None);
}

multiversion!(
    avx512;
    /// The reduce of one token's column slice: `y = bf16(Σ_s shared[s] + Σ_k routed[k])`,
    /// summed from zero in exactly that order (shared experts, then the routes in route
    /// order); the bf16 values are stored as f32 (what `hc_post` reads). Each term is added to
    /// the whole slice in turn (`y` holds the partial sums), so the adds run as vectors with
    /// every element's sum in the same order; summing each element over the terms in an inner
    /// loop ran scalar (the MoE step's two reduce blocks took ~175 µs each on Zen 3).
    ///
    /// # Panics
    /// If a term is not `y.len()` long.
    pub fn moe_reduce(shared: &[&[f32]], routed: &[&[f32]], y: &mut [f32]) {
        for t in shared.iter().chain(routed) {
            assert_eq!(t.len(), y.len(), "moe_reduce: a term of {} values for {}", t.len(), y.len());
        }
        y.fill(0.0);
        for t in shared.iter().chain(routed) {
            for (o, &v) in y.iter_mut().zip(t.iter()) {
                *o += v;
            }
        }
        for o in y.iter_mut() {
            *o = crate::convert::round_bf16_f32(*o);
        }
    }
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{I8Path, Isa, with_i8_path, with_isa};
    use half::bf16;

    /// The gate logits of every row, on every path, are the bits of one dot product at a time
    /// in the promised order (eight lanes in order, summed in order, then the tail), times the
    /// row's scale: row counts around the blocks of four, widths with and without a tail, and
    /// `-128` among the activations.
    #[test]
    fn gate_logits_are_the_lane_ordered_dots_on_every_path() {
        let reference = |q: &[f32], g: &[f32]| {
            let body = q.len() / 8 * 8;
            let mut l = [0.0f32; 8];
            for c in (0..body).step_by(8) {
                for i in 0..8 {
                    l[i] += q[c + i] * g[c + i];
                }
            }
            let tail: f32 = (body..q.len()).map(|i| q[i] * g[i]).sum();
            l.iter().sum::<f32>() + tail
        };
        for (rows, experts, d) in [(8, 32, 4096), (5, 7, 70), (1, 3, 5), (9, 4, 64), (4, 2, 8)] {
            let q: Vec<i8> = crate::dsv4::tests::values(rows * d, 3 + d as u64)
                .iter()
                .enumerate()
                .map(|(i, v)| if i % 97 == 5 { -128 } else { (v * 127.0) as i8 })
                .collect();
            let scales: Vec<f32> = (0..rows).map(|r| 0.01 + r as f32 * 1e-3).collect();
            let gate = crate::dsv4::tests::values(experts * d, 7 + experts as u64);
            let mut first: Option<Vec<u32>> = None;
            for isa in Isa::ALL {
                let Some(got) = with_isa(isa, || {
                    let mut out = vec![0.0f32; rows * experts];
                    moe_gate_logits(&q, &scales, &gate, d, &mut out).unwrap();
                    out
                }) else {
                    continue;
                };
                for r in 0..rows {
                    let qf: Vec<f32> = q[r * d..(r + 1) * d]
                        .iter()
                        .map(|&v| f32::from(v))
                        .collect();
                    for e in 0..experts {
                        let want = reference(&qf, &gate[e * d..(e + 1) * d]) * scales[r];
                        assert_eq!(
                            got[r * experts + e].to_bits(),
                            want.to_bits(),
                            "{isa:?} ({rows},{experts},{d}) [{r},{e}]"
                        );
                    }
                }
                let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                assert_eq!(first.get_or_insert(bits.clone()), &bits, "{isa:?}");
            }
        }
        // A gate that is not whole rows of `d` is refused by name.
        let err = moe_gate_logits(&[0; 8], &[1.0], &[0.0; 9], 8, &mut [0.0; 1]).unwrap_err();
        assert!(err.to_string().contains("gate"), "{err}");
    }

    #[test]
    fn top_k_ties_go_to_the_lower_expert_and_weights_normalise() {
        // Experts 1 and 3 tie on score + bias; 1 is taken first.
        let logits = [0.0f32, 5.0, 1.0, 5.0];
        let bias = [0.0f32; 4];
        let mut scores = [0.0; 4];
        let mut ex = [0u32; 2];
        let mut w = [0.0; 2];
        moe_route(&logits, &bias, None, 1.5, &mut scores, &mut ex, &mut w).unwrap();
        assert_eq!(ex, [1, 3]);
        assert!((w[0] + w[1] - 1.5).abs() < 1e-6);
        // The bias chooses but does not weigh.
        let bias = [10.0f32, 0.0, 0.0, 0.0];
        moe_route(&logits, &bias, None, 1.5, &mut scores, &mut ex, &mut w).unwrap();
        assert_eq!(ex, [0, 1]);
        let s0 = sqrt_softplus(0.0);
        let s1 = sqrt_softplus(5.0);
        assert!((w[0] - s0 / (s0 + s1) * 1.5).abs() < 1e-6);
        // Hash rows are taken as they are, and checked.
        moe_route(
            &logits,
            &bias,
            Some(&[2, 0]),
            1.5,
            &mut scores,
            &mut ex,
            &mut w,
        )
        .unwrap();
        assert_eq!(ex, [2, 0]);
        let e = moe_route(
            &logits,
            &bias,
            Some(&[2, 4]),
            1.5,
            &mut scores,
            &mut ex,
            &mut w,
        );
        assert!(matches!(e, Err(MoeError::HashExpert { expert: 4, .. })));
    }

    #[test]
    fn dispatch_groups_routes_per_local_expert_in_route_order() {
        let routes = [3u32, 1, 1, 2, 3, 0];
        let p = moe_dispatch_plan(&routes, 4, 1..4, 6).unwrap();
        assert_eq!(p.counts, [2, 1, 2]);
        assert_eq!(p.offsets, [0, 2, 3, 5]);
        assert_eq!(p.order, [1, 2, 3, 0, 4]);
        assert!(matches!(
            moe_dispatch_plan(&routes, 4, 0..4, 5),
            Err(MoeError::Capacity {
                rows: 6,
                capacity: 5
            })
        ));
        assert!(matches!(
            moe_dispatch_plan(&[7], 4, 0..4, 5),
            Err(MoeError::RouteExpert { expert: 7, .. })
        ));
        check_offsets(&p.offsets, 5).unwrap();
        assert!(check_offsets(&[0, 3, 2], 5).is_err());
        assert!(check_offsets(&[0, 3, 6], 5).is_err());
        assert!(check_offsets(&[1, 3], 5).is_err());
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The expert against a scalar f64 reference of the same integer math, on every int8 path
    /// this machine has (the paths agree bit for bit) and under the portable ISA.
    #[test]
    fn expert_matches_a_scalar_reference_on_every_path() {
        let (d, inter, rows) = (96usize, 80usize, 8usize);
        let mut seed = 11u64;
        let mut mat = |r: usize, c: usize| -> (Vec<i8>, Vec<f32>) {
            let q = (0..r * c).map(|_| (lcg(&mut seed) * 127.0) as i8).collect();
            let s = (0..r)
                .map(|_| 0.002 + 0.001 * lcg(&mut seed).abs())
                .collect();
            (q, s)
        };
        let (w1, s1) = mat(inter, d);
        let (w3, s3) = mat(inter, d);
        let (w2, s2) = mat(d, inter);
        let mut x = vec![0.0f32; rows * d];
        let mut seed2 = 5u64;
        x.iter_mut().for_each(|v| *v = lcg(&mut seed2) * 3.0);
        let norm: Vec<f32> = (0..d).map(|i| 1.0 + 0.01 * i as f32).collect();
        let mut xq = vec![0i8; rows * d];
        let xs: Vec<f32> = (0..rows)
            .map(|r| {
                moe_quant_input(
                    &x[r * d..(r + 1) * d],
                    &norm,
                    1e-6,
                    &mut xq[r * d..(r + 1) * d],
                )
            })
            .collect();
        let weights: Vec<f32> = (0..rows).map(|r| 0.1 + 0.1 * r as f32).collect();
        let limit = 0.5f32;
        // Scalar reference.
        let mut want = vec![0.0f32; rows * d];
        for r in 0..rows {
            let xr = &xq[r * d..(r + 1) * d];
            let dot = |w: &[i8], row: usize, k: usize, a: &[i8]| -> i32 {
                (0..k)
                    .map(|i| i32::from(w[row * k + i]) * i32::from(a[i]))
                    .sum()
            };
            let h: Vec<f32> = (0..inter)
                .map(|j| {
                    let g = (dot(&w1, j, d, xr) as f32 * s1[j] * xs[r]).min(limit);
                    let u = (dot(&w3, j, d, xr) as f32 * s3[j] * xs[r]).clamp(-limit, limit);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            let amax = h.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let hs = amax / 127.0;
            let hq: Vec<i8> = h.iter().map(|v| (v / hs).round() as i8).collect();
            // (ties away from zero, as the spec's int8 and `f32::round`)
            for n in 0..d {
                want[r * d + n] = dot(&w2, n, inter, &hq) as f32 * s2[n] * hs * weights[r];
            }
        }
        let run = || {
            let e = ExpertI8 {
                w1: WeightsI8::new(&w1, &s1, inter, d, d),
                w3: WeightsI8::new(&w3, &s3, inter, d, d),
                w2: WeightsI8::new(&w2, &s2, d, inter, inter),
            };
            let mut y = vec![0.0f32; rows * d];
            expert_forward(
                &e,
                ActsI8::new(&xq, &xs, rows, d, d),
                &weights,
                limit,
                &mut y,
            );
            y
        };
        let portable = with_isa(Isa::Portable, run).unwrap();
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (a, b) in portable.iter().zip(&want) {
            // The same integers; the scales multiply in another order (an ulp of `g`, `u`).
            assert!((a - b).abs() <= 0.02 * scale, "{a} vs {b}");
        }
        for path in I8Path::ALL {
            if let Some(y) = with_i8_path(path, run) {
                assert_eq!(y, portable, "{path:?}");
            }
        }
    }

    #[test]
    fn gate_logits_and_input_scale_match_plain_loops_on_both_isas() {
        let (d, rows, e) = (40usize, 3usize, 5usize);
        let mut seed = 3u64;
        let x: Vec<f32> = (0..rows * d).map(|_| lcg(&mut seed)).collect();
        let norm: Vec<f32> = (0..d).map(|_| 1.0 + 0.1 * lcg(&mut seed)).collect();
        let gate: Vec<f32> = (0..e * d).map(|_| lcg(&mut seed) * 0.2).collect();
        let run = || {
            let mut q = vec![0i8; rows * d];
            let s: Vec<f32> = (0..rows)
                .map(|r| {
                    moe_quant_input(
                        &x[r * d..(r + 1) * d],
                        &norm,
                        1e-6,
                        &mut q[r * d..(r + 1) * d],
                    )
                })
                .collect();
            let mut l = vec![0.0f32; rows * e];
            moe_gate_logits(&q, &s, &gate, d, &mut l).unwrap();
            (q, s, l)
        };
        let (q, s, l) = with_isa(Isa::Portable, run).unwrap();
        for r in 0..rows {
            let xr = &x[r * d..(r + 1) * d];
            let ms = xr.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / d as f64;
            let back: Vec<f64> = (0..d)
                .map(|i| f64::from(q[r * d + i]) * f64::from(s[r]))
                .collect();
            for i in 0..d {
                let want = f64::from(xr[i]) / (ms + 1e-6).sqrt() * f64::from(norm[i]);
                assert!((back[i] - want).abs() <= f64::from(s[r]) * 0.51, "{r} {i}");
            }
            for ex in 0..e {
                let want: f64 = (0..d)
                    .map(|i| f64::from(q[r * d + i]) * f64::from(gate[ex * d + i]))
                    .sum::<f64>()
                    * f64::from(s[r]);
                assert!((f64::from(l[r * e + ex]) - want).abs() < 1e-4);
            }
        }
        let fast = run();
        assert_eq!(fast.0, q);
        for (a, b) in fast.2.iter().zip(&l) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0));
        }
        let mut bad = vec![0.0f32; 2];
        assert!(moe_gate_logits(&q, &s, &gate, d, &mut bad).is_err());
    }

    #[test]
    fn reduce_sums_shared_then_routes_and_rounds_to_bf16() {
        let s = [1.0f32, 2.0];
        let r0 = [1e-3f32, 0.5];
        let r1 = [-1.0f32, 0.25];
        let mut y = [0.0f32; 2];
        moe_reduce(&[&s], &[&r0, &r1], &mut y);
        assert_eq!(y[0], bf16::from_f32((1.0 + 1e-3) - 1.0).to_f32());
        assert_eq!(y[1], 2.75);
    }

    /// Every path gives each element's sum in the promised order, then its bf16 rounding, at
    /// lengths around the vector widths; a term of the wrong length is refused.
    #[test]
    fn reduce_is_the_ordered_sum_on_every_path() {
        for d in [1usize, 7, 8, 9, 31, 64, 4096] {
            let terms: Vec<Vec<f32>> = (0..7)
                .map(|i| {
                    crate::dsv4::tests::values(d, 40 + i as u64)
                        .iter()
                        .map(|v| v * 3.0)
                        .collect()
                })
                .collect();
            let (shared, routed) = terms.split_at(1);
            let shared: Vec<&[f32]> = shared.iter().map(Vec::as_slice).collect();
            let routed: Vec<&[f32]> = routed.iter().map(Vec::as_slice).collect();
            let want: Vec<f32> = (0..d)
                .map(|j| {
                    let mut acc = 0.0f32;
                    for t in shared.iter().chain(&routed) {
                        acc += t[j];
                    }
                    bf16::from_f32(acc).to_f32()
                })
                .collect();
            for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512Bf16] {
                if !isa.is_supported() {
                    continue;
                }
                let mut y = vec![f32::NAN; d];
                with_isa(isa, || moe_reduce(&shared, &routed, &mut y));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&y), bits(&want), "d {d} on {isa:?}");
            }
        }
        let short = [0.0f32; 3];
        let r = std::panic::catch_unwind(|| moe_reduce(&[&short], &[], &mut [0.0f32; 4]));
        assert!(r.is_err());
    }
}
