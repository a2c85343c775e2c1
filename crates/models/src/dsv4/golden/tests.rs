//! Tests of the golden itself: properties its math must satisfy, second formulations of the
//! same quantity, and the cases the spec names (boundaries, short windows, routing extremes).
//! Each asserts something a wrong golden would break.

use super::*;
use crate::dsv4::config::Dsv4Config;
use crate::dsv4::fixture::{
    Dsv4Fixture, Expert, Int8Matrix, MIXED_STARTS, TOKENS_PER_SEQ, generate_fixture,
};
use crate::rng::Rng;

fn tiny_fixture() -> Dsv4Fixture {
    generate_fixture(&Dsv4Config::tiny(), &MIXED_STARTS, 1234).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

// ---- building blocks ----

#[test]
fn sinkhorn_output_is_doubly_stochastic() {
    let mut rng = Rng::new(5, 0);
    for spread in [0.1f32, 1.0, 4.0] {
        let mut logits = vec![0.0f32; 16];
        rng.fill_normal(&mut logits, 0.0, spread);
        let c = sinkhorn(&logits, 4, 20, 1e-6);
        for i in 0..4 {
            let row: f32 = c[i * 4..(i + 1) * 4].iter().sum();
            let col: f32 = (0..4).map(|r| c[r * 4 + i]).sum();
            assert!((row - 1.0).abs() < 1e-3, "spread {spread} row {i}: {row}");
            assert!((col - 1.0).abs() < 1e-4, "spread {spread} col {i}: {col}");
        }
        assert!(c.iter().all(|&v| v > 0.0));
    }
    // One iteration (softmax then columns) leaves rows far from stochastic at a wide spread,
    // so the row check above measures the later iterations.
    let mut logits = vec![0.0f32; 16];
    Rng::new(6, 0).fill_normal(&mut logits, 0.0, 4.0);
    let c = sinkhorn(&logits, 4, 1, 1e-6);
    let worst = (0..4)
        .map(|i| (c[i * 4..(i + 1) * 4].iter().sum::<f32>() - 1.0).abs())
        .fold(0.0f32, f32::max);
    assert!(worst > 1e-2, "{worst}");
}

#[test]
fn hc_pre_weights_are_in_range_and_mix_the_streams() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let d = cfg.hidden;
    let x = &f.inputs.x_hc[..cfg.hc_mult * d];
    let hp = hc_pre(cfg, &f.attn.hc, x);
    assert!(hp.pre.iter().all(|&p| p > 0.0 && p <= 1.0 + 1e-6));
    assert!(hp.post.iter().all(|&p| p > 0.0 && p < 2.0));
    for j in 0..d {
        let direct: f32 = (0..cfg.hc_mult).map(|i| x[i * d + j] * hp.pre[i]).sum();
        assert!((hp.x_mixed[j] - direct).abs() <= direct.abs() / 128.0 + 1e-6);
        assert_eq!(hp.x_mixed[j], rb_half_up(hp.x_mixed[j]), "x_mixed is bf16");
    }
    // hc_post with a zero sub-layer output is the comb mix alone; columns of comb sum to one,
    // so a residual whose streams are equal passes through unchanged.
    let same: Vec<f32> = (0..cfg.hc_mult).flat_map(|_| x[..d].to_vec()).collect();
    let y = hc_post(cfg, &hp, &same, &vec![0.0; d]);
    assert!(
        max_abs_diff(&y[..d], &x[..d]) < 2e-3,
        "{}",
        max_abs_diff(&y[..d], &x[..d])
    );
}

#[test]
fn bf16_half_up_rounds_ties_away_from_zero() {
    let tie = 1.0 + 2f32.powi(-8);
    assert_eq!(rb_half_up(tie), 1.0 + 2f32.powi(-7));
    assert_eq!(
        rb(tie),
        1.0,
        "round-to-nearest-even keeps the even neighbour"
    );
    assert_eq!(rb_half_up(-tie), -(1.0 + 2f32.powi(-7)));
    assert_eq!(rb_half_up(1.0 + 2f32.powi(-9)), 1.0);
}

#[test]
fn rope_then_inverse_is_identity_and_scores_depend_on_distance_only() {
    for cfg in [Dsv4Config::flash(), Dsv4Config::tiny()] {
        for kind in [RopeKind::Plain, RopeKind::Yarn] {
            let f = rope_inv_freq(&cfg, kind);
            let mut rng = Rng::new(9, 0);
            let mut q = vec![0.0f32; cfg.rope_dim];
            let mut k = vec![0.0f32; cfg.rope_dim];
            rng.fill_normal(&mut q, 0.0, 1.0);
            rng.fill_normal(&mut k, 0.0, 1.0);
            let mut v = q.clone();
            let cs = rope_cos_sin(&f, 8193);
            rope(&mut v, &cs);
            assert!(max_abs_diff(&v, &q) > 0.1, "{kind:?} rotates");
            rope_inverse(&mut v, &cs);
            assert!(max_abs_diff(&v, &q) < 1e-5, "{kind:?}");
            let score = |pq: usize, pk: usize| {
                let (mut a, mut b) = (q.clone(), k.clone());
                rope(&mut a, &rope_cos_sin(&f, pq));
                rope(&mut b, &rope_cos_sin(&f, pk));
                a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
            };
            assert!((score(130, 3) - score(8319, 8192)).abs() < 1e-3, "{kind:?}");
        }
    }
}

#[test]
fn yarn_frequencies_follow_the_ramp() {
    let cfg = Dsv4Config::flash();
    let plain = rope_inv_freq(&cfg, RopeKind::Plain);
    assert!((plain[1] - 1e4f64.powf(-2.0 / 64.0)).abs() < 1e-12);
    let yarn = rope_inv_freq(&cfg, RopeKind::Yarn);
    let base = |i: usize| 160000f64.powf(-2.0 * i as f64 / 64.0);
    // FLASH: c(32) = 15.45 → low 15; c(1) = 24.7 → high 25.
    for (i, &f) in yarn.iter().enumerate() {
        let r = f / base(i);
        match i {
            0..=15 => assert!((r - 1.0).abs() < 1e-12, "pair {i} keeps its frequency"),
            25.. => assert!((r - 1.0 / 16.0).abs() < 1e-12, "pair {i} is divided by 16"),
            _ => {
                // Blended: smooth = 1 - (i - low)/(high - low) with low 15, high 25.
                let smooth = 1.0 - (i as f64 - 15.0) / 10.0;
                assert!(
                    (r - (smooth + (1.0 - smooth) / 16.0)).abs() < 1e-12,
                    "pair {i}: {r}"
                );
            }
        }
    }
    assert_eq!(yarn.len(), 32);
    assert!(yarn.windows(2).all(|w| w[1] < w[0]));
}

// ---- attention core ----

#[test]
fn sparse_attention_matches_a_dense_masked_softmax_with_the_sink() {
    let mut rng = Rng::new(11, 0);
    let (n, hd) = (300, 32);
    let mut kv = vec![0.0f32; n * hd];
    rng.fill_normal(&mut kv, 0.0, 1.0);
    let kv: Vec<f32> = kv.iter().map(|&v| rb(v)).collect();
    let mut q = vec![0.0f32; hd];
    rng.fill_normal(&mut q, 0.0, 2.0);
    let all: Vec<&[f32]> = kv.chunks(hd).collect();
    // Every third row masked, as padding and invalid compressed indices are.
    let visible: Vec<bool> = (0..n).map(|j| j % 3 != 1).collect();
    let rows: Vec<Option<&[f32]>> = all
        .iter()
        .zip(&visible)
        .map(|(r, &v)| v.then_some(*r))
        .collect();
    for sink in [-30.0f32, 0.0, 3.0] {
        let sparse = attention_core(&q, &rows, 0.2, sink);
        let dense = attention_dense(&q, &all, &visible, 0.2, sink);
        let scale = dense.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(
            max_abs_diff(&sparse, &dense) < 4e-3 * scale,
            "sink {sink}: {} vs scale {scale}",
            max_abs_diff(&sparse, &dense)
        );
    }
    // A huge sink absorbs all the mass.
    let absorbed = attention_core(&q, &rows, 0.2, 1e3);
    assert!(absorbed.iter().all(|v| v.abs() < 1e-6));
    // No valid candidate: zeros, not NaN.
    let none: Vec<Option<&[f32]>> = vec![None; 4];
    assert!(
        attention_core(&q, &none, 0.2, 0.0)
            .iter()
            .all(|&v| v == 0.0)
    );
}

/// The kernels' form: 128-row tiles merged with an online softmax (probabilities rounded to
/// bf16 against the running maximum). A second formulation whose rounding differs from the
/// one-pass golden; the two must agree within the layer tolerance.
fn attention_online(q: &[f32], rows: &[Option<&[f32]>], scale: f32, sink: f32) -> Vec<f32> {
    let mut m = f32::NEG_INFINITY;
    let mut l = 0.0f32;
    let mut o = vec![0.0f32; q.len()];
    for tile in rows.chunks(128) {
        let s: Vec<Option<f32>> = tile
            .iter()
            .map(|r| r.map(|kv| q.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale))
            .collect();
        let Some(tile_max) = s.iter().flatten().copied().reduce(f32::max) else {
            continue; // an empty tile: the planning task skips it
        };
        let m_new = m.max(tile_max);
        let correction = (m - m_new).exp();
        l *= correction;
        o.iter_mut().for_each(|v| *v *= correction);
        for (s, kv) in s.iter().zip(tile) {
            let (Some(s), Some(kv)) = (s, kv) else {
                continue;
            };
            let p = (s - m_new).exp();
            l += p;
            for (ov, v) in o.iter_mut().zip(*kv) {
                *ov += rb(p) * v;
            }
        }
        m = m_new;
    }
    let denom = l + (sink - m).exp();
    o.iter().map(|v| v / denom).collect()
}

#[test]
fn online_tile_merge_agrees_with_the_one_pass_golden_within_tolerance() {
    let mut rng = Rng::new(12, 0);
    let hd = 64;
    // 128 window rows + 512 compressed candidates, a third of those masked (5 tiles; the last
    // tile fully masked).
    let n = 640;
    let mut kv = vec![0.0f32; n * hd];
    rng.fill_normal(&mut kv, 0.0, 1.0);
    let kv: Vec<f32> = kv.iter().map(|&v| rb(v)).collect();
    let rows: Vec<Option<&[f32]>> = kv
        .chunks(hd)
        .enumerate()
        .map(|(i, r)| (i < 512 && (i < 128 || i % 3 != 0)).then_some(r))
        .collect();
    let mut all_a = Vec::new();
    let mut all_b = Vec::new();
    for head in 0..16 {
        let mut q = vec![0.0f32; hd];
        rng.fill_normal(&mut q, 0.0, 1.0 + head as f32 * 0.3);
        let sink = head as f32 * 0.5 - 4.0;
        all_a.extend(attention_online(&q, &rows, 1.0 / 8.0, sink));
        all_b.extend(attention_core(&q, &rows, 1.0 / 8.0, sink));
    }
    crate::dsv4::check::RelDiff::SWA_HCA
        .check("online vs one-pass attention", &all_a, &all_b)
        .unwrap();
    // The comparison is not vacuous: a wrong scale is refused.
    let wrong: Vec<f32> = all_a.iter().map(|v| v * 1.01).collect();
    assert!(
        crate::dsv4::check::RelDiff::SWA_HCA
            .check("scaled", &wrong, &all_b)
            .is_err()
    );
}

#[test]
fn one_candidate_is_scaled_by_the_sink_share() {
    let kv = [0.5f32, -1.0, 2.0, 0.25];
    let q = [1.0f32, 0.5, -0.5, 2.0];
    let s = q.iter().zip(&kv).map(|(a, b)| a * b).sum::<f32>() * 0.5;
    let out = attention_core(&q, &[Some(&kv[..])], 0.5, 0.3);
    let share = 1.0 / (1.0 + (0.3 - s).exp());
    for (o, v) in out.iter().zip(kv) {
        assert!((o - v * share).abs() < 1e-6);
    }
}

// ---- SWA layer ----

#[test]
fn swa_writes_each_token_at_its_slot_and_crosses_pages() {
    let f = tiny_fixture();
    let step = swa_step(&f.config, &f.attn, &f.window, &f.inputs);
    let mb = f.window.max_blocks;
    let page = f.config.page_size;
    let expect = |b: usize, pos: usize| (b * mb + pos / page) * page + pos % page;
    for (t, slot) in step.window_write.slots.iter().enumerate() {
        let (b, s) = (t / TOKENS_PER_SEQ, t % TOKENS_PER_SEQ);
        assert_eq!(*slot, Some(expect(b, MIXED_STARTS[b] + s)), "row {t}");
    }
    // Sequence 2 (start 127) writes the last row of its page 0 and the first of page 1.
    assert_eq!(step.window_write.slots[4], Some(2 * mb * page + 127));
    assert_eq!(step.window_write.slots[5], Some((2 * mb + 1) * page));
    assert_eq!(step.window_write.rows.len(), 8 * f.config.head_dim);
    assert!(step.x_out.iter().all(|v| v.is_finite()));
}

#[test]
fn swa_tokens_see_their_window_only() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let base = swa_step(cfg, &f.attn, &f.window, &f.inputs);
    let row_len = cfg.hc_mult * cfg.hidden;
    // The second token of each sequence changes: the first token's output does not (causal
    // within the step), the second's does.
    let mut inputs = f.inputs.clone();
    for b in 0..4 {
        let t = b * TOKENS_PER_SEQ + 1;
        inputs.x_hc[t * row_len..(t + 1) * row_len]
            .iter_mut()
            .for_each(|v| *v = -*v);
    }
    let changed = swa_step(cfg, &f.attn, &f.window, &inputs);
    for t in 0..8 {
        let (a, b) = (
            &base.x_out[t * row_len..(t + 1) * row_len],
            &changed.x_out[t * row_len..(t + 1) * row_len],
        );
        if t % 2 == 0 {
            assert_eq!(a, b, "row {t} must not see the step's next token");
        } else {
            assert!(max_abs_diff(a, b) > 1e-2, "row {t}");
        }
    }
    // Sequence 3 at 8192, window 8: position 8185 is the oldest row of token 0's window and
    // outside token 1's; position 8184 is outside both.
    let row_out = |step: &AttnStep, t: usize| {
        step.attn[t * cfg.n_heads * cfg.head_dim..(t + 1) * cfg.n_heads * cfg.head_dim].to_vec()
    };
    for (pos, token0_changes) in [(8185usize, true), (8184, false)] {
        let mut cache = f.window.clone();
        let slot = cache.slot(3, pos).unwrap();
        for v in &mut cache.rows[slot * cache.width..(slot + 1) * cache.width] {
            *v = half::bf16::from_f32(v.to_f32() * 4.0 + 1.0);
        }
        let s = swa_step(cfg, &f.attn, &cache, &f.inputs);
        assert_eq!(
            row_out(&s, 6) != row_out(&base, 6),
            token0_changes,
            "pos {pos}"
        );
        assert_eq!(
            row_out(&s, 7),
            row_out(&base, 7),
            "pos {pos} is outside token 1's window"
        );
    }
}

#[test]
fn swa_first_token_of_an_empty_cache_attends_to_itself_only() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let step = swa_step(cfg, &f.attn, &f.window, &f.inputs);
    let (hd, rd) = (cfg.head_dim, cfg.rope_dim);
    let kv: Vec<f32> = step.window_write.rows[..hd]
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let cs = rope_cos_sin(&rope_inv_freq(cfg, RopeKind::Plain), 0);
    for h in 0..cfg.n_heads {
        let q = &step.q[h * hd..(h + 1) * hd];
        let s = q.iter().zip(&kv).map(|(a, b)| a * b).sum::<f32>() * cfg.softmax_scale();
        let share = 1.0 / (1.0 + (f.attn.sink[h] - s).exp());
        let mut expect: Vec<f32> = kv.iter().map(|v| v * share).collect();
        rope_inverse(&mut expect[hd - rd..], &cs);
        let got = &step.attn[h * hd..(h + 1) * hd];
        for (g, e) in got.iter().zip(&expect) {
            assert!(
                (g - e).abs() <= e.abs() / 128.0 + 1e-6,
                "head {h}: {g} vs {e}"
            );
        }
    }
}

/// The window selection written a second way: dense attention over every row the sequence
/// has, masked to the last `window` positions up to the token's own.
#[test]
fn swa_attention_matches_a_dense_mask_over_the_whole_sequence() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let step = swa_step(cfg, &f.attn, &f.window, &f.inputs);
    let (hd, rd) = (cfg.head_dim, cfg.rope_dim);
    let inv_freq = rope_inv_freq(cfg, RopeKind::Plain);
    let written: Vec<f32> = step.window_write.rows.iter().map(|v| v.to_f32()).collect();
    let cached: Vec<f32> = f.window.rows.iter().map(|v| v.to_f32()).collect();
    for t in 0..8 {
        let (b, s) = (t / TOKENS_PER_SEQ, t % TOKENS_PER_SEQ);
        let start = MIXED_STARTS[b];
        let pos = start + s;
        let all: Vec<&[f32]> = (0..start + TOKENS_PER_SEQ)
            .map(|p| {
                if p >= start {
                    let r = b * TOKENS_PER_SEQ + p - start;
                    &written[r * hd..(r + 1) * hd]
                } else {
                    let slot = f.window.slot(b, p).unwrap();
                    &cached[slot * hd..(slot + 1) * hd]
                }
            })
            .collect();
        let visible: Vec<bool> = (0..all.len())
            .map(|p| p <= pos && pos - p < cfg.window)
            .collect();
        for h in 0..cfg.n_heads {
            let q = &step.q[(t * cfg.n_heads + h) * hd..(t * cfg.n_heads + h + 1) * hd];
            let mut dense = attention_dense(q, &all, &visible, cfg.softmax_scale(), f.attn.sink[h]);
            rope_inverse(&mut dense[hd - rd..], &rope_cos_sin(&inv_freq, pos));
            let got = &step.attn[(t * cfg.n_heads + h) * hd..(t * cfg.n_heads + h + 1) * hd];
            let scale = dense.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(
                max_abs_diff(got, &dense) < 1e-2 * scale,
                "row {t} head {h}: {} (scale {scale})",
                max_abs_diff(got, &dense)
            );
        }
    }
}

/// The grouped output projection against a float formulation on the dequantised `Wo_b`
/// without the per-(token, group) int8 step: group `g` reads heads `g · hpg ..` and the
/// columns `g · o_lora ..` of `Wo_b`.
#[test]
fn grouped_output_projection_matches_a_float_formulation() {
    let cfg = Dsv4Config::small();
    let f = generate_fixture(&cfg, &MIXED_STARTS, 31).unwrap();
    let step = swa_step(&cfg, &f.attn, &f.window, &f.inputs);
    let (g_in, r) = (cfg.heads_per_group() * cfg.head_dim, cfg.o_lora_rank);
    let w = &f.attn;
    for t in [0usize, 5, 7] {
        let o = &step.attn[t * cfg.n_heads * cfg.head_dim..(t + 1) * cfg.n_heads * cfg.head_dim];
        let mut y = vec![0.0f64; cfg.hidden];
        for g in 0..cfg.o_groups {
            for k in 0..r {
                let wa = &w.wo_a[(g * r + k) * g_in..(g * r + k + 1) * g_in];
                let o_r: f64 = wa
                    .iter()
                    .zip(&o[g * g_in..(g + 1) * g_in])
                    .map(|(a, b)| f64::from(a.to_f32()) * f64::from(*b))
                    .sum();
                for (n, yn) in y.iter_mut().enumerate() {
                    let wb = f64::from(w.wo_b.q[n * w.wo_b.cols + g * r + k])
                        * f64::from(w.wo_b.scale[n]);
                    *yn += o_r * wb;
                }
            }
        }
        let got = &step.o_proj[t * cfg.hidden..(t + 1) * cfg.hidden];
        assert_eq!(got, output_projection(&cfg, w, o).as_slice());
        let norm = y.iter().map(|v| v * v).sum::<f64>().sqrt();
        let err = got
            .iter()
            .zip(&y)
            .map(|(a, b)| (f64::from(*a) - b).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(err < 0.02 * norm, "row {t}: {err} vs {norm}");
    }
}

// ---- MoE layer ----

#[test]
fn hash_layers_use_the_table_and_later_layers_the_biased_top_k() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let k = cfg.n_activated_experts;
    let hashed = moe_step(cfg, &f.moe, 0, &f.inputs);
    let topk = moe_step(cfg, &f.moe, cfg.n_hash_layers, &f.inputs);
    for t in 0..8 {
        let id = f.inputs.token_ids[t] as usize;
        let table: Vec<usize> = f.moe.tid2eid[id * k..(id + 1) * k]
            .iter()
            .map(|&e| e as usize)
            .collect();
        assert_eq!(hashed.routes[t].experts, table, "row {t}");
        let r = &topk.routes[t];
        let biased = |e: usize| r.scores[e] + f.moe.bias[e];
        for e in 0..cfg.n_routed_experts {
            if !r.experts.contains(&e) {
                assert!(r.experts.iter().all(|&c| biased(c) >= biased(e)), "row {t}");
            }
        }
        for route in [&hashed.routes[t], r] {
            let total: f32 = route.experts.iter().map(|&e| route.scores[e]).sum();
            for (&e, &w) in route.experts.iter().zip(&route.weights) {
                assert!((w - route.scores[e] / total * cfg.route_scale).abs() < 1e-6);
            }
            assert!((route.weights.iter().sum::<f32>() - cfg.route_scale).abs() < 1e-5);
        }
    }
    assert_ne!(hashed.y, topk.y);
    // The reduce: y = bf16(shared + Σ routed), with the routed rows in route order.
    let d = cfg.hidden;
    for t in 0..8 {
        for j in 0..d {
            let sum = topk.shared[t * d + j]
                + (0..k)
                    .map(|i| topk.routed[(t * k + i) * d + j])
                    .sum::<f32>();
            assert!((topk.y[t * d + j] - rb(sum)).abs() <= rb(sum).abs() / 128.0 + 1e-6);
        }
    }
}

#[test]
fn an_expert_with_every_token_and_one_with_none() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let layer = cfg.n_hash_layers;
    let mut w = f.moe.clone();
    w.bias[5] = 100.0;
    w.bias[2] = -100.0;
    let base = moe_step(cfg, &w, layer, &f.inputs);
    // Hash-routed layers ignore the bias entirely.
    assert_eq!(
        moe_step(cfg, &w, 0, &f.inputs),
        moe_step(cfg, &f.moe, 0, &f.inputs)
    );
    assert!(base.routes.iter().all(|r| r.experts.contains(&5)));
    assert!(base.routes.iter().all(|r| !r.experts.contains(&2)));
    // The bias chooses but does not weigh: expert 5's weight is its score's share.
    for r in &base.routes {
        let i = r.experts.iter().position(|&e| e == 5).unwrap();
        let total: f32 = r.experts.iter().map(|&e| r.scores[e]).sum();
        assert!((r.weights[i] - r.scores[5] / total * cfg.route_scale).abs() < 1e-6);
    }
    let negate = |e: &mut Expert| e.w2.q.iter_mut().for_each(|q| *q = -*q);
    let mut unused = w.clone();
    negate(&mut unused.routed[2]);
    assert_eq!(moe_step(cfg, &unused, layer, &f.inputs).x_out, base.x_out);
    let mut used = w.clone();
    negate(&mut used.routed[5]);
    let changed = moe_step(cfg, &used, layer, &f.inputs);
    let d = cfg.hidden;
    for t in 0..8 {
        assert!(
            max_abs_diff(&changed.y[t * d..(t + 1) * d], &base.y[t * d..(t + 1) * d]) > 1e-3,
            "row {t}"
        );
    }
}

/// The int8 expert against a float expert on the dequantised weights, at ordinary scale and
/// with activations so large that the clamp decides the result.
#[test]
fn experts_match_a_float_swiglu_with_the_clamp() {
    let cfg = Dsv4Config::tiny();
    let f = generate_fixture(&cfg, &MIXED_STARTS, 77).unwrap();
    let e = &f.moe.routed[0];
    let mut x = vec![0.0f32; cfg.hidden];
    Rng::new(3, 0).fill_normal(&mut x, 0.0, 1.0);
    let (xs, xq) = quant_row(&x);
    let deq =
        |m: &Int8Matrix, r: usize, c: usize| f64::from(m.q[r * m.cols + c]) * f64::from(m.scale[r]);
    let float = |gain: f64, clamp: bool| -> Vec<f64> {
        let lim = f64::from(cfg.swiglu_limit);
        let xd: Vec<f64> = xq
            .iter()
            .map(|&q| f64::from(q) * f64::from(xs) * gain)
            .collect();
        let h: Vec<f64> = (0..cfg.moe_inter_dim)
            .map(|j| {
                let g: f64 = (0..cfg.hidden).map(|k| xd[k] * deq(&e.w1, j, k)).sum();
                let u: f64 = (0..cfg.hidden).map(|k| xd[k] * deq(&e.w3, j, k)).sum();
                let (g, u) = if clamp {
                    (g.min(lim), u.clamp(-lim, lim))
                } else {
                    (g, u)
                };
                g / (1.0 + (-g).exp()) * u * 0.7
            })
            .collect();
        (0..cfg.hidden)
            .map(|n| {
                (0..cfg.moe_inter_dim)
                    .map(|j| h[j] * deq(&e.w2, n, j))
                    .sum()
            })
            .collect()
    };
    for gain in [1.0f32, 1000.0] {
        let got = expert_forward(&cfg, e, xs * gain, &xq, 0.7);
        let want = float(f64::from(gain), true);
        let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (f64::from(*g) - w).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(err < 0.02 * norm, "gain {gain}: {err} vs {norm}");
    }
    // At gain 1000 the unclamped expert is far off: the clamp is what the match measured.
    let got = expert_forward(&cfg, e, xs * 1000.0, &xq, 0.7);
    let free = float(1000.0, false);
    assert!(
        got.iter()
            .zip(&free)
            .any(|(g, w)| (f64::from(*g) - w).abs() > 1.0)
    );
}

// ---- HCA layer ----

#[test]
fn pooling_is_a_per_channel_softmax_average() {
    let width = 3;
    // Constant kv per channel pools to that constant whatever the scores.
    let kv: Vec<f32> = (0..5).flat_map(|_| [1.5f32, -2.0, 0.25]).collect();
    let score: Vec<f32> = (0..15).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
    let pooled = pool_window(&kv, &score, width);
    assert!(max_abs_diff(&pooled, &[1.5, -2.0, 0.25]) < 1e-6);
    // A dominant score selects its row, channel by channel.
    let kv: Vec<f32> = (0..15).map(|i| i as f32).collect();
    let mut score = vec![0.0f32; 15];
    score[2 * 3] = 100.0; // channel 0 picks row 2
    score[4 * 3 + 1] = 100.0; // channel 1 picks row 4
    let pooled = pool_window(&kv, &score, width);
    assert!((pooled[0] - 6.0).abs() < 1e-4 && (pooled[1] - 13.0).abs() < 1e-4);
    // Equal scores give the mean.
    assert!((pooled[2] - (2.0 + 5.0 + 8.0 + 11.0 + 14.0) / 5.0).abs() < 1e-4);
}

#[test]
fn hca_compresses_exactly_at_the_ratio_128_boundary() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let step = hca_step(cfg, &f.attn, &f.window, &f.hca, &f.inputs);
    let sw = step.state_write.as_ref().unwrap();
    let cw = step.compressed_write.as_ref().unwrap();
    let ratio = cfg.hca_ratio;
    for t in 0..8 {
        let (b, pos) = (t / TOKENS_PER_SEQ, f.inputs.position(t));
        assert_eq!(sw.slots[t], b * ratio + pos % ratio, "row {t}");
    }
    // Only position 127 (sequence 2, row 4) closes a window: one compressed row, index 0.
    assert_eq!(cw.slots, vec![Some(2 * f.hca.cache.max_rows)]);
    // The row written a second way: the open window of sequence 2 (the fixture's positions
    // 0..127 and the step's position 127) pooled in f64, then RMSNorm; RoPE at position 0 is
    // the identity.
    let width = cfg.head_dim;
    let window_rows = |v: &[f32], step_row: &[f32]| -> Vec<f64> {
        let mut rows: Vec<f64> = v[2 * ratio * width..3 * ratio * width]
            .iter()
            .map(|&x| f64::from(x))
            .collect();
        for (o, x) in rows[127 * width..].iter_mut().zip(step_row) {
            *o = f64::from(*x);
        }
        rows
    };
    let kv = window_rows(&f.hca.state.kv, &sw.kv[4 * width..5 * width]);
    let score = window_rows(&f.hca.state.score, &sw.score[4 * width..5 * width]);
    let pooled: Vec<f64> = (0..width)
        .map(|c| {
            let m = (0..ratio)
                .map(|j| score[j * width + c])
                .fold(f64::MIN, f64::max);
            let e: Vec<f64> = (0..ratio)
                .map(|j| (score[j * width + c] - m).exp())
                .collect();
            let z: f64 = e.iter().sum();
            (0..ratio).map(|j| e[j] * kv[j * width + c]).sum::<f64>() / z
        })
        .collect();
    let ms = pooled.iter().map(|v| v * v).sum::<f64>() / width as f64;
    let inv = 1.0 / (ms + f64::from(cfg.rms_eps)).sqrt();
    for (c, got) in cw.rows.iter().enumerate() {
        let want = pooled[c] * inv * f64::from(f.hca.compressor.norm[c]);
        assert!(
            (f64::from(got.to_f32()) - want).abs() <= want.abs() / 128.0 + 1e-6,
            "channel {c}: {got} vs {want}"
        );
    }
}

#[test]
fn hca_tokens_see_the_compressed_rows_of_their_past_only() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let base = hca_step(cfg, &f.attn, &f.window, &f.hca, &f.inputs);
    let per_token = cfg.n_heads * cfg.head_dim;
    let out = |s: &AttnStep, t: usize| s.attn[t * per_token..(t + 1) * per_token].to_vec();
    let width = cfg.head_dim;
    // Position 5 of sequence 2 is far outside the 8-row window of positions 127 and 128, so it
    // reaches them only through the compressed row that position 127 closes.
    let mut hca = f.hca.clone();
    let slot = 2 * cfg.hca_ratio + 5;
    hca.state.score[slot * width..(slot + 1) * width].fill(30.0);
    let s = hca_step(cfg, &f.attn, &f.window, &hca, &f.inputs);
    assert_ne!(out(&s, 4), out(&base, 4));
    assert_ne!(out(&s, 5), out(&base, 5));
    assert_eq!(out(&s, 2), out(&base, 2), "other sequences are untouched");
    // Sequence 3 at 8192 sees compressed rows 0..64; sequence 1 at 3 sees none yet.
    for (b, row, token_rows, changes) in
        [(3usize, 63usize, [6usize, 7], true), (1, 0, [2, 3], false)]
    {
        let mut hca = f.hca.clone();
        let first = (b * hca.cache.max_rows + row) * width;
        for v in &mut hca.cache.rows[first..first + width] {
            *v = half::bf16::from_f32(v.to_f32() * -3.0 + 2.0);
        }
        let s = hca_step(cfg, &f.attn, &f.window, &hca, &f.inputs);
        for t in token_rows {
            assert_eq!(
                out(&s, t) != out(&base, t),
                changes,
                "seq {b} row {row} token {t}"
            );
        }
    }
    // With no compressed row visible and no window crossing, HCA differs from SWA only by its
    // RoPE, so the two disagree (YaRN θ 160000 vs plain θ 1e4) at position 3.
    let swa = swa_step(cfg, &f.attn, &f.window, &f.inputs);
    assert_ne!(out(&swa, 2), out(&base, 2));
    assert!(base.x_out.iter().all(|v| v.is_finite()));
}

// ---- CSA layer ----

#[test]
fn hadamard_matches_the_explicit_matrix_and_is_its_own_inverse() {
    let n = 16;
    let mut v = vec![0.0f32; n];
    Rng::new(21, 0).fill_normal(&mut v, 0.0, 1.0);
    let explicit: Vec<f32> = (0..n)
        .map(|i| {
            (0..n)
                .map(|j| {
                    if (i & j).count_ones() % 2 == 0 {
                        v[j]
                    } else {
                        -v[j]
                    }
                })
                .sum::<f32>()
                / (n as f32).sqrt()
        })
        .collect();
    let mut fast = v.clone();
    hadamard(&mut fast);
    assert!(max_abs_diff(&fast, &explicit) < 1e-5);
    hadamard(&mut fast);
    assert!(max_abs_diff(&fast, &v) < 1e-5);
}

#[test]
fn csa_compresses_exactly_at_the_ratio_4_boundaries() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let step = csa_step(cfg, &f.attn, &f.window, &f.csa, &f.inputs);
    let csa = step.csa.as_ref().unwrap();
    let mr = f.csa.cache.max_rows;
    for t in 0..8 {
        let (b, pos) = (t / TOKENS_PER_SEQ, f.inputs.position(t));
        assert_eq!(csa.state_write.slots[t], b * 8 + pos % 8, "row {t}");
        assert_eq!(csa.index_state_write.slots[t], b * 8 + pos % 8, "row {t}");
    }
    // Position 3 (sequence 1) closes window 0 and position 127 (sequence 2) window 31;
    // positions 0, 1, 4, 128, 8192 and 8193 close none.
    assert_eq!(csa.compressed.slots, vec![Some(mr), Some(2 * mr + 31)]);
    assert_eq!(csa.index_write.slots, vec![mr, 2 * mr + 31]);
    assert!(csa.index_write.scale.iter().all(|&s| s > 0.0));
}

/// Window 31 of sequence 2 written a second way: the previous window's first-half channels and
/// this window's second-half channels pooled in f64, RMSNorm, compared before RoPE.
#[test]
fn csa_overlapping_pool_matches_a_second_formulation() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let step = csa_step(cfg, &f.attn, &f.window, &f.csa, &f.inputs);
    let csa = step.csa.as_ref().unwrap();
    let (w, wide) = (cfg.head_dim, 2 * cfg.head_dim);
    let st = &f.csa.state;
    // Ring rows of sequence 2 (8 per sequence); position 127's row is the step's first write.
    let row_of = |v: &[f32], step_v: &[f32], pos: usize| -> Vec<f64> {
        let src = if pos == 127 {
            &step_v[4 * wide..5 * wide]
        } else {
            &v[(2 * 8 + pos % 8) * wide..(2 * 8 + pos % 8 + 1) * wide]
        };
        src.iter().map(|&x| f64::from(x)).collect()
    };
    let pooled: Vec<f64> = (0..w)
        .map(|c| {
            let cands: Vec<(f64, f64)> = (120..124)
                .map(|p| {
                    (
                        row_of(&st.kv, &csa.state_write.kv, p)[c],
                        row_of(&st.score, &csa.state_write.score, p)[c],
                    )
                })
                .chain((124..128).map(|p| {
                    (
                        row_of(&st.kv, &csa.state_write.kv, p)[w + c],
                        row_of(&st.score, &csa.state_write.score, p)[w + c],
                    )
                }))
                .collect();
            let m = cands.iter().map(|c| c.1).fold(f64::MIN, f64::max);
            let z: f64 = cands.iter().map(|c| (c.1 - m).exp()).sum();
            cands.iter().map(|c| (c.1 - m).exp() * c.0).sum::<f64>() / z
        })
        .collect();
    let ms = pooled.iter().map(|v| v * v).sum::<f64>() / w as f64;
    let inv = 1.0 / (ms + f64::from(cfg.rms_eps)).sqrt();
    let mut got: Vec<f32> = csa.compressed.rows[cfg.head_dim..]
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let inv_freq = rope_inv_freq(cfg, RopeKind::Yarn);
    rope_inverse(&mut got[w - cfg.rope_dim..], &rope_cos_sin(&inv_freq, 124));
    for c in 0..w {
        let want = pooled[c] * inv * f64::from(f.csa.compressor.norm[c]);
        assert!(
            (f64::from(got[c]) - want).abs() <= want.abs() / 64.0 + 1e-3,
            "channel {c}: {} vs {want}",
            got[c]
        );
    }
}

#[test]
fn csa_first_window_has_no_previous_half_and_halves_are_not_swapped() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let base = csa_step(cfg, &f.attn, &f.window, &f.csa, &f.inputs);
    let comp = |s: &AttnStep, k: usize| {
        s.csa.as_ref().unwrap().compressed.rows[k * cfg.head_dim..(k + 1) * cfg.head_dim].to_vec()
    };
    let wide = 2 * cfg.head_dim;
    let perturbed = |seq_slot: usize, lo: usize, hi: usize| {
        let mut csa = f.csa.clone();
        let r = seq_slot * wide;
        csa.state.score[r + lo..r + hi].fill(25.0);
        csa.state.kv[r + lo..r + hi].fill(7.0);
        csa_step(cfg, &f.attn, &f.window, &csa, &f.inputs)
    };
    // Sequence 1's ring rows 4..8 would be positions -4..-1: never pooled into window 0.
    for slot in 8 + 4..8 + 8 {
        assert_eq!(
            comp(&perturbed(slot, 0, wide), 0),
            comp(&base, 0),
            "slot {slot}"
        );
    }
    // Sequence 2, position 120 (previous window of window 31): its first half is pooled, its
    // second half is not.
    let pos = 120;
    let slot = 2 * 8 + pos % 8;
    assert_ne!(comp(&perturbed(slot, 0, cfg.head_dim), 1), comp(&base, 1));
    assert_eq!(
        comp(&perturbed(slot, cfg.head_dim, wide), 1),
        comp(&base, 1)
    );
}

#[test]
fn indexer_keeps_the_top_k_of_the_visible_rows() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let step = csa_step(cfg, &f.attn, &f.window, &f.csa, &f.inputs);
    let picks = &step.csa.as_ref().unwrap().picks;
    // Start 0: nothing visible, nothing selected (fewer visible rows than top-k, down to zero).
    assert_eq!((picks[0].visible, picks[0].selected.len()), (0, 0));
    assert_eq!((picks[1].visible, picks[1].selected.len()), (0, 0));
    // Position 3 sees the row it just closed, position 4 the same one: one of top-k 4.
    assert_eq!(picks[2].selected, vec![0]);
    assert_eq!(picks[3].selected, vec![0]);
    // Position 127 sees 32 rows, 8192 sees 2048: top-k of them, by score.
    for (t, visible) in [(4usize, 32usize), (5, 32), (6, 2048), (7, 2048)] {
        let p = &picks[t];
        assert_eq!(p.visible, visible, "row {t}");
        assert_eq!(p.selected.len(), cfg.index_topk);
        let worst_kept = p
            .selected
            .iter()
            .map(|&i| p.scores[i])
            .fold(f32::MAX, f32::min);
        for i in 0..visible {
            if !p.selected.contains(&i) {
                assert!(p.scores[i] <= worst_kept, "row {t}: {i} beats a kept row");
            }
        }
        assert!(p.scores.iter().all(|s| s.is_finite()));
    }
    // Different rows score differently (the scores are not degenerate).
    assert!(picks[6].scores.windows(2).any(|w| w[0] != w[1]));
}

#[test]
fn csa_tokens_attend_to_the_selected_compressed_rows_only() {
    let f = tiny_fixture();
    let cfg = &f.config;
    let base = csa_step(cfg, &f.attn, &f.window, &f.csa, &f.inputs);
    let picks = &base.csa.as_ref().unwrap().picks;
    let per_token = cfg.n_heads * cfg.head_dim;
    let out = |s: &AttnStep, t: usize| s.attn[t * per_token..(t + 1) * per_token].to_vec();
    let hd = cfg.head_dim;
    let mr = f.csa.cache.max_rows;
    let kept = picks[6].selected[0];
    let dropped = (0..2048)
        .find(|i| !picks[6].selected.contains(i) && !picks[7].selected.contains(i))
        .unwrap();
    for (row, changes) in [(kept, true), (dropped, false)] {
        let mut csa = f.csa.clone();
        let first = (3 * mr + row) * hd;
        for v in &mut csa.cache.rows[first..first + hd] {
            *v = half::bf16::from_f32(v.to_f32() * -3.0 + 2.0);
        }
        let s = csa_step(cfg, &f.attn, &f.window, &csa, &f.inputs);
        assert_eq!(
            s.csa.as_ref().unwrap().picks,
            *picks,
            "the main cache does not steer selection"
        );
        assert_eq!(out(&s, 6) != out(&base, 6), changes, "row {row}");
    }
    assert!(base.x_out.iter().all(|v| v.is_finite()));
}

// ---- whole steps at the small preset (FLASH structure: window 128, top-6, top-k 16) ----

#[test]
fn small_preset_steps_are_deterministic_and_write_every_cache() {
    let cfg = Dsv4Config::small();
    let f = generate_fixture(&cfg, &MIXED_STARTS, 99).unwrap();
    let swa = swa_step(&cfg, &f.attn, &f.window, &f.inputs);
    assert_eq!(swa, swa_step(&cfg, &f.attn, &f.window, &f.inputs));
    let csa = csa_step(&cfg, &f.attn, &f.window, &f.csa, &f.inputs);
    let hca = hca_step(&cfg, &f.attn, &f.window, &f.hca, &f.inputs);
    for step in [&swa, &csa, &hca] {
        assert_eq!(step.window_write.rows.len(), 8 * cfg.head_dim);
        assert!(step.x_out.iter().all(|v| v.is_finite()));
        assert_eq!(step.x_out.len(), 8 * cfg.hc_mult * cfg.hidden);
    }
    let w = csa.csa.as_ref().unwrap();
    assert_eq!(w.compressed.slots.len(), 2);
    assert_eq!(w.picks[6].selected.len(), cfg.index_topk);
    assert_eq!(hca.compressed_write.as_ref().unwrap().slots.len(), 1);
    // Same weights, different compressed candidates: the three kinds disagree.
    assert_ne!(swa.x_out, csa.x_out);
    assert_ne!(csa.x_out, hca.x_out);
    for layer in [0, cfg.n_hash_layers] {
        let moe = moe_step(&cfg, &f.moe, layer, &f.inputs);
        assert!(moe.routes.iter().all(|r| r.experts.len() == 6));
        assert!(moe.x_out.iter().all(|v| v.is_finite()));
    }
}

/// The attention goldens at FLASH shapes (the benchmark case: every sequence at 8192, where no
/// compression boundary falls inside the step) run and write what they should; the MoE at
/// FLASH needs an expert subset (not generated here).
#[test]
fn flash_attention_steps_run_at_full_shape() {
    use crate::dsv4::fixture::{
        generate_attn_weights, generate_csa, generate_hca, generate_inputs, generate_window_cache,
        uniform_starts,
    };
    let cfg = Dsv4Config::flash();
    let starts = uniform_starts(8192);
    let attn = generate_attn_weights(&cfg, 5);
    let window = generate_window_cache(&cfg, &starts, 5);
    let inputs = generate_inputs(&cfg, &starts, 5);
    let swa = swa_step(&cfg, &attn, &window, &inputs);
    // Positions 8192 and 8193 are rows 0 and 1 of each sequence's block 64.
    let mb = window.max_blocks;
    for (t, slot) in swa.window_write.slots.iter().enumerate() {
        let (b, s) = (t / TOKENS_PER_SEQ, t % TOKENS_PER_SEQ);
        assert_eq!(*slot, Some((b * mb + 64) * 128 + s));
    }
    let csa_parts = generate_csa(&cfg, &starts, 5);
    let csa = csa_step(&cfg, &attn, &window, &csa_parts, &inputs);
    let w = csa.csa.as_ref().unwrap();
    assert!(w.compressed.slots.is_empty() && w.index_write.slots.is_empty());
    assert!(
        w.picks
            .iter()
            .all(|p| p.visible == 2048 && p.selected.len() == 512)
    );
    let hca_parts = generate_hca(&cfg, &starts, 5);
    let hca = hca_step(&cfg, &attn, &window, &hca_parts, &inputs);
    assert!(hca.compressed_write.as_ref().unwrap().slots.is_empty());
    for step in [&swa, &csa, &hca] {
        assert_eq!(step.x_out.len(), 8 * 4 * 4096);
        assert!(step.x_out.iter().all(|v| v.is_finite()));
    }
}
