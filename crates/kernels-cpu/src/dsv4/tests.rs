//! Each kernel on every path this CPU has against a plain scalar loop, and the paths against
//! each other (the `multiversion!` builds add in the same order, so they must agree exactly
//! where the reference's order is the kernel's).

use super::*;
use crate::isa::{Isa, with_isa};

/// Uniform values in `[-1, 1)` from a fixed xorshift stream.
pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// Runs `f` on every supported path and checks that they all give the same result.
fn on_every_path<T: PartialEq + std::fmt::Debug>(f: impl Fn() -> T) -> T {
    let first = with_isa(Isa::Portable, &f).expect("portable always runs");
    for isa in Isa::ALL {
        if let Some(r) = with_isa(isa, &f) {
            assert_eq!(r, first, "{isa:?} differs from portable");
        }
    }
    first
}

#[test]
fn hc_mix_logits_match_a_plain_dot_product() {
    let (hc, d, m, rows) = (4, 70, hc_mix_len(4), 3);
    let n = hc * d;
    let x = values(rows * n, 1);
    let w = values(m * n, 2);
    let got = on_every_path(|| {
        let mut out = vec![0.0f32; rows * m];
        hc_mix_logits(&x, n, &w, 1e-6, &mut out);
        out
    });
    for t in 0..rows {
        let xr = &x[t * n..(t + 1) * n];
        let ms: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / n as f64;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        for j in 0..m {
            let dot: f64 = xr
                .iter()
                .zip(&w[j * n..(j + 1) * n])
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            let e = (dot * inv) as f32;
            let a = got[t * m + j];
            assert!(
                (a - e).abs() <= 1e-5 * (1.0 + e.abs()),
                "[{t},{j}] {a} vs {e}"
            );
        }
    }
}

#[test]
fn sinkhorn_is_doubly_stochastic_and_weights_are_in_range() {
    let hc = 4;
    let mut mix = values(hc_mix_len(hc), 3);
    let base = values(hc_mix_len(hc), 4);
    hc_weights(&mut mix, hc, [1.0, 1.0, 1.0], &base, 20, 1e-6);
    for i in 0..hc {
        assert!(mix[i] > 0.0 && mix[i] < 1.0 + 1e-5, "pre {}", mix[i]);
        assert!(
            mix[hc + i] > 0.0 && mix[hc + i] < 2.0,
            "post {}",
            mix[hc + i]
        );
    }
    let comb = &mix[2 * hc..];
    for o in 0..hc {
        let col: f32 = (0..hc).map(|i| comb[i * hc + o]).sum();
        assert!((col - 1.0).abs() < 1e-5, "column {o} sums to {col}");
        let row: f32 = comb[o * hc..(o + 1) * hc].iter().sum();
        // Rows converge more slowly than the columns the last round normalised.
        assert!((row - 1.0).abs() < 1e-2, "row {o} sums to {row}");
    }
    // One iteration is the row softmax (plus eps) with normalised columns.
    let mut one = vec![0.0f32, 0.0, 0.0, 0.0];
    sinkhorn(&mut one, 2, 1, 0.0);
    assert_eq!(one, vec![0.5, 0.5, 0.5, 0.5]);
}

#[test]
fn mixed_streams_round_half_up_and_sum_pairwise() {
    let d = 37;
    let x = values(4 * d, 5);
    let pre = [0.3f32, 0.9, 0.1, 0.55];
    let got = on_every_path(|| {
        let mut out = vec![0.0f32; d];
        hc_mix_streams(&x, &pre, &mut out);
        out
    });
    for j in 0..d {
        let v =
            (x[j] * pre[0] + x[d + j] * pre[1]) + (x[2 * d + j] * pre[2] + x[3 * d + j] * pre[3]);
        assert_eq!(got[j], round_bf16_half_up(v));
    }
    // A tie rounds away from zero (nearest-even would keep 1.0 / -1.0).
    let tie = f32::from_bits(0x3F80_8000);
    assert_eq!(round_bf16_half_up(tie), f32::from_bits(0x3F81_0000));
    assert_eq!(round_bf16_half_up(-tie), -f32::from_bits(0x3F81_0000));
    assert_eq!(crate::f32_to_bf16(tie).to_f32(), 1.0);
    // Three streams are summed in order.
    let mut out3 = vec![0.0f32; d];
    hc_mix_streams(&x[..3 * d], &pre[..3], &mut out3);
    for j in 0..d {
        let v = x[j] * pre[0] + x[d + j] * pre[1] + x[2 * d + j] * pre[2];
        assert_eq!(out3[j], round_bf16_half_up(v));
    }
}

#[test]
fn hc_post_matches_a_plain_loop() {
    // Whole column blocks and a tail, a tail alone, whole blocks alone.
    for (hc, d) in [(4, 29), (4, 70), (3, 7), (2, 32)] {
        hc_post_case(hc, d);
    }
}

fn hc_post_case(hc: usize, d: usize) {
    let x = values(hc * d, 6);
    let out = values(d, 7);
    let post = values(hc, 8);
    let comb = values(hc * hc, 9);
    let got = on_every_path(|| {
        let mut y = vec![0.0f32; hc * d];
        hc_post(&x, &out, &post, &comb, &mut y);
        y
    });
    for o in 0..hc {
        for j in 0..d {
            let mut acc = post[o] * out[j];
            for i in 0..hc {
                acc += x[i * d + j] * comb[i * hc + o];
            }
            assert_eq!(got[o * d + j], acc, "[{o},{j}]");
        }
    }
}

#[test]
fn rms_norm_round_matches_a_plain_loop_with_and_without_weight() {
    let (row, rows) = (40, 3);
    let x = values(row * rows, 10);
    let w: Vec<f32> = values(row, 11).iter().map(|v| 1.0 + 0.1 * v).collect();
    for weight in [Some(w.as_slice()), None] {
        let got = on_every_path(|| {
            let mut y = x.clone();
            rms_norm_round(&mut y, row, weight, 1e-6);
            y
        });
        for (r, xr) in x.chunks(row).enumerate() {
            let ms: f32 = xr.iter().map(|v| v * v).sum::<f32>() / row as f32;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for (i, &v) in xr.iter().enumerate() {
                let e = half::bf16::from_f32(v * inv * weight.map_or(1.0, |w| w[i])).to_f32();
                let a = got[r * row + i];
                // The lane-summed mean may differ in its last bit: one bf16 ulp at most.
                assert!((a - e).abs() <= e.abs() / 128.0, "[{r},{i}] {a} vs {e}");
            }
        }
    }
}

/// At a narrow roped width (the tiny preset's 8) the ramp is the spec's formula as written:
/// `low = floor(c(32))`, `high = ceil(c(1))`, no clamp; `high` (4) lies past the last pair (3),
/// which a clamp to the pairs would have moved.
#[test]
fn yarn_ramp_at_a_narrow_width_is_the_unclamped_formula() {
    let (theta, dim, factor, orig) = (160000f64, 8usize, 16.0, 65536.0);
    let c =
        |r: f64| dim as f64 * (orig / (2.0 * std::f64::consts::PI * r)).ln() / (2.0 * theta.ln());
    let (low, high) = (c(32.0).floor(), c(1.0).ceil());
    assert_eq!((low, high), (1.0, 4.0));
    let ramp = YarnRamp {
        factor,
        beta_fast: 32.0,
        beta_slow: 1.0,
        original_len: 65536,
    };
    let got = rope_inv_freq_yarn(theta, dim, ramp);
    for (j, f) in got.into_iter().enumerate() {
        let plain = theta.powf(-2.0 * j as f64 / dim as f64);
        let keep = 1.0 - ((j as f64 - low) / (high - low)).clamp(0.0, 1.0);
        let want = plain / factor * (1.0 - keep) + plain * keep;
        assert!((f - want).abs() <= 1e-12 * plain, "pair {j}: {f} vs {want}");
    }
}

#[test]
fn yarn_keeps_fast_pairs_divides_slow_ones_and_blends_between() {
    let plain = rope_inv_freq_plain(160000.0, 64);
    let ramp = YarnRamp {
        factor: 16.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        original_len: 65536,
    };
    let yarn = rope_inv_freq_yarn(160000.0, 64, ramp);
    assert_eq!(plain.len(), 32);
    assert!((plain[1] - 160000f64.powf(-2.0 / 64.0)).abs() < 1e-15);
    for j in 0..16 {
        assert_eq!(yarn[j], plain[j], "pair {j} keeps its frequency");
    }
    for j in 25..32 {
        assert!(
            (yarn[j] - plain[j] / 16.0).abs() <= 1e-12 * plain[j],
            "pair {j}"
        );
    }
    for j in 16..25 {
        assert!(
            yarn[j] < plain[j] && yarn[j] > plain[j] / 16.0,
            "pair {j} blends"
        );
    }
}

#[test]
fn rope_and_its_inverse_turn_the_last_pairs_and_undo_each_other() {
    let (head, rd) = (24, 8);
    let table = RopeTable::new(&rope_inv_freq_plain(1e4, rd), 50);
    assert_eq!((table.pairs(), table.positions()), (4, 50));
    assert!(table.at(50).is_none());
    let (cos, sin) = table.at(37).expect("in the table");
    let a = 37f64 * 1e4f64.powf(-2.0 / 8.0);
    assert_eq!((cos[1], sin[1]), (a.cos() as f32, a.sin() as f32));
    let x = values(3 * head, 12);
    let fwd = on_every_path(|| {
        let mut y = x.clone();
        rope_interleaved(&mut y, head, cos, sin, RopeDir::Forward);
        y
    });
    for (h, (xh, yh)) in x.chunks(head).zip(fwd.chunks(head)).enumerate() {
        assert_eq!(
            xh[..head - rd],
            yh[..head - rd],
            "head {h}: unroped part untouched"
        );
        for j in 0..rd / 2 {
            let (e, o) = (xh[head - rd + 2 * j], xh[head - rd + 2 * j + 1]);
            assert_eq!(yh[head - rd + 2 * j], e * cos[j] - o * sin[j]);
            assert_eq!(yh[head - rd + 2 * j + 1], e * sin[j] + o * cos[j]);
        }
    }
    let back = on_every_path(|| {
        let mut y = fwd.clone();
        rope_interleaved(&mut y, head, cos, sin, RopeDir::Inverse);
        y
    });
    for (a, e) in back.iter().zip(&x) {
        assert!((a - e).abs() < 1e-6, "{a} vs {e}");
    }
}

/// The one-pass form of the attention (`docs/dsv4.md`): global max, `o = Σ bf16(p) · kv`,
/// `out = o / (Σ p + exp(sink − m))`, in f64 apart from the bf16 rounding of `p`.
pub(crate) fn attention_reference(
    q: &[f32],
    rows: &[Option<Vec<half::bf16>>],
    scale: f32,
    sink: f32,
) -> Vec<f32> {
    let d = q.len();
    let s: Vec<Option<f64>> = rows
        .iter()
        .map(|r| {
            r.as_ref().map(|r| {
                q.iter()
                    .zip(r)
                    .map(|(&a, b)| f64::from(a) * f64::from(b.to_f32()))
                    .sum::<f64>()
                    * f64::from(scale)
            })
        })
        .collect();
    let Some(m) = s.iter().flatten().copied().reduce(f64::max) else {
        return vec![0.0; d];
    };
    let mut o = vec![0.0f64; d];
    let mut l = 0.0f64;
    for (s, r) in s.iter().zip(rows) {
        if let (Some(s), Some(r)) = (s, r) {
            let p = (s - m).exp();
            l += p;
            let pb = f64::from(half::bf16::from_f64(p).to_f32());
            for (o, v) in o.iter_mut().zip(r) {
                *o += pb * f64::from(v.to_f32());
            }
        }
    }
    let z = l + (f64::from(sink) - m).exp();
    o.iter().map(|v| (v / z) as f32).collect()
}

#[test]
fn sparse_attention_matches_the_one_pass_form_across_tiles_masks_and_paths() {
    let (heads, d) = (5, 40);
    // 300 candidates: three tiles, the second all masked, scattered masks in the others.
    let n = 300;
    let rows: Vec<Option<Vec<half::bf16>>> = (0..n)
        .map(|j| {
            let masked = (128..256).contains(&j) || j % 7 == 3;
            (!masked).then(|| {
                values(d, 100 + j as u64)
                    .iter()
                    .map(|&v| half::bf16::from_f32(2.0 * v))
                    .collect()
            })
        })
        .collect();
    let q: Vec<f32> = values(heads * d, 13)
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let sinks = values(heads, 14);
    let scale = 1.0 / (d as f32).sqrt();
    let cands: Vec<Option<&[half::bf16]>> = rows.iter().map(|r| r.as_deref()).collect();
    for isa in Isa::ALL {
        with_isa(isa, || {
            let mut out = vec![0.0f32; heads * d];
            sparse_attention(
                Queries::F32(&q),
                d,
                &cands,
                scale,
                &sinks,
                &mut out,
                &mut AttnScratch::default(),
            );
            for h in 0..heads {
                let e = attention_reference(&q[h * d..(h + 1) * d], &rows, scale, sinks[h]);
                for (c, (a, e)) in out[h * d..(h + 1) * d].iter().zip(&e).enumerate() {
                    // Both round `p` to bf16 against the exact max, but the kernel's `exp`
                    // (~3 ulp) can tip a rounding: a term may move by a bf16 step (2^-9) of
                    // its size (~1 here).
                    assert!(
                        (a - e).abs() <= 1e-2 * e.abs() + 2e-3,
                        "{isa:?} head {h} [{c}]: {a} vs {e}"
                    );
                }
            }
        });
    }
    // No valid candidate: zeros, whatever the sink.
    let none: Vec<Option<&[half::bf16]>> = vec![None; 5];
    let mut out = vec![1.0f32; heads * d];
    sparse_attention(
        Queries::F32(&q),
        d,
        &none,
        scale,
        &sinks,
        &mut out,
        &mut AttnScratch::default(),
    );
    assert!(out.iter().all(|&v| v == 0.0));
}

#[test]
fn softmax_pool_matches_a_plain_loop() {
    let (w, n) = (19, 9);
    let kv: Vec<Vec<f32>> = (0..n).map(|j| values(w, 200 + j)).collect();
    let sc: Vec<Vec<f32>> = (0..n)
        .map(|j| values(w, 300 + j).iter().map(|v| 3.0 * v).collect())
        .collect();
    let kr: Vec<&[f32]> = kv.iter().map(Vec::as_slice).collect();
    let sr: Vec<&[f32]> = sc.iter().map(Vec::as_slice).collect();
    let got = on_every_path(|| {
        let mut out = vec![0.0f32; w];
        softmax_pool(&kr, &sr, &mut out);
        out
    });
    for c in 0..w {
        let m = sc.iter().map(|s| s[c]).fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = sc.iter().map(|s| (s[c] - m).exp()).sum();
        let e: f32 = sc
            .iter()
            .zip(&kv)
            .map(|(s, k)| (s[c] - m).exp() * k[c])
            .sum::<f32>()
            / z;
        assert!(
            (got[c] - e).abs() <= 1e-6 * (1.0 + e.abs()),
            "[{c}] {} vs {e}",
            got[c]
        );
    }
    let mut out = vec![1.0f32; w];
    softmax_pool(&[], &[], &mut out);
    assert!(out.iter().all(|&v| v == 0.0));
}

#[test]
fn dsv4_quantisation_rounds_ties_away_from_zero() {
    // amax 127 makes the scale 1: x / scale is x itself.
    let x = [
        127.0f32, 2.5, -2.5, 0.5, -0.5, 1.4999999, -126.5, 0.49999997,
    ];
    let mut q = [0i8; 8];
    let s = on_every_path(|| {
        let mut q = [0i8; 8];
        let s = crate::quantize_row_i8_ties_away(&x, &mut q);
        (s, q)
    });
    assert_eq!(s.0, 1.0);
    assert_eq!(s.1, [127, 3, -3, 1, -1, 1, -127, 0]);
    // The nearest-even quantiser differs exactly on the ties.
    crate::quantize_row_i8(&x, &mut q);
    assert_eq!(q, [127, 2, -2, 0, 0, 1, -126, 0]);
    let mut z = [5i8; 3];
    assert_eq!(crate::quantize_row_i8_ties_away(&[0.0; 3], &mut z), 0.0);
    assert_eq!(z, [0; 3]);
}

/// `Σ a·b` as `hc_mix_dots` promises to add it: four f64 lanes over the whole chunks in
/// order, combined `(l0 + l2) + (l1 + l3)`, then the tail in order.
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let body = a.len() / 4 * 4;
    let mut l = [0.0f64; 4];
    for c in (0..body).step_by(4) {
        for i in 0..4 {
            l[i] += f64::from(a[c + i]) * f64::from(b[c + i]);
        }
    }
    let tail: f64 = (body..a.len())
        .map(|i| f64::from(a[i]) * f64::from(b[i]))
        .sum();
    ((l[0] + l[2]) + (l[1] + l[3]) + tail) as f32
}

#[test]
fn hc_mix_dots_add_in_the_promised_order_at_every_block_shape() {
    // Token counts around the two- and four-token blocks, weight-row counts around the two-,
    // six- and eight-row blocks, lengths with and without a tail, and lengths over several of the
    // chunked path's 256-value chunks (a partial last chunk, then a tail); a wider output
    // stride.
    for (rows, m, n) in [
        (8, 6, 16384),
        (4, 24, 16384),
        (2, 3, 1030),
        (9, 7, 1030),
        (3, 5, 513),
        (8, 24, 64),
        (9, 24, 70),
        (5, 7, 33),
        (1, 24, 3),
        (4, 3, 4),
        (3, 9, 17),
        // Partial blocks of the chunked path's six rows, and one-token blocks of the
        // few-token path.
        (8, 5, 1030),
        (6, 10, 257),
        (1, 5, 64),
    ] {
        let x = values(rows * n, 10 + rows as u64);
        let w = values(m * n, 20 + m as u64);
        let ld = m + 3;
        let got = on_every_path(|| {
            // The columns past `m` are the caller's: they keep their value.
            let mut out = vec![-7.0f32; rows * ld];
            hc_mix_dots(&x, n, &w, &mut out, ld);
            out
        });
        for t in 0..rows {
            for j in 0..m {
                let e = lane_dot(&x[t * n..(t + 1) * n], &w[j * n..(j + 1) * n]);
                assert_eq!(
                    got[t * ld + j].to_bits(),
                    e.to_bits(),
                    "({rows},{m},{n}) [{t},{j}]"
                );
            }
        }
        // The logits are the token's 1/rms times these dots, bit for bit.
        let logits = on_every_path(|| {
            let mut out = vec![0.0f32; rows * m];
            hc_mix_logits(&x, n, &w, 1e-6, &mut out);
            out
        });
        for t in 0..rows {
            let inv = hc_inv_rms(&x[t * n..(t + 1) * n], 1e-6);
            for j in 0..m {
                assert_eq!(
                    logits[t * m + j].to_bits(),
                    (inv * got[t * ld + j]).to_bits()
                );
            }
        }
    }
}

#[test]
fn inv_rms_of_many_rows_is_the_one_row_sum_bit_for_bit() {
    // Row counts around the eight-row blocks, lengths with and without a tail.
    for (rows, n) in [
        (1, 16),
        (3, 7),
        (4, 64),
        (5, 33),
        (8, 16384),
        (9, 130),
        (16, 36),
        (17, 129),
    ] {
        let x = values(rows * n, 60 + rows as u64);
        let got = on_every_path(|| {
            let mut out = vec![0.0f32; rows];
            hc_inv_rms_rows(&x, n, 1e-6, &mut out);
            out
        });
        for (r, g) in got.iter().enumerate() {
            let want = hc_inv_rms(&x[r * n..(r + 1) * n], 1e-6);
            assert_eq!(g.to_bits(), want.to_bits(), "({rows},{n}) row {r}");
        }
        // The norm over many rows scales each row by its own factor.
        let normed = on_every_path(|| {
            let mut y = x.clone();
            rms_norm_round(&mut y, n, None, 1e-6);
            y
        });
        for r in 0..rows {
            let mut one = x[r * n..(r + 1) * n].to_vec();
            rms_norm_round(&mut one, n, None, 1e-6);
            assert!(
                one == normed[r * n..(r + 1) * n],
                "({rows},{n}) row {r} normed"
            );
        }
    }
}

/// The fused queries' finish gives, bit for bit, the three passes it replaces (the norm to
/// bf16 values, the forward turn, the rounding) and the narrowing, on every path: heads with
/// and without a rotated part, a whole head rotated, a ragged count of heads around the
/// norm's blocks of eight, and a NaN and an infinity in a head.
#[test]
fn norm_rope_heads_bf16_is_the_norm_the_turn_and_the_rounding() {
    for (heads, head, pairs, seed) in [
        (6usize, 64usize, 8usize, 1u64),
        (5, 32, 0, 2),
        (3, 16, 8, 3),
        (9, 512, 32, 4),
        (17, 64, 4, 6),
        (1, 8, 2, 5),
    ] {
        let mut x: Vec<f32> = values(heads * head, seed).iter().map(|v| v * 3.0).collect();
        if heads > 2 {
            x[head + 1] = f32::NAN;
            x[2 * head + head - 1] = f32::INFINITY;
        }
        let cos: Vec<f32> = values(pairs, seed + 10);
        let sin: Vec<f32> = values(pairs, seed + 20);
        let want = on_every_path(|| {
            let mut y = x.clone();
            rms_norm_round(&mut y, head, None, 1e-6);
            rope_interleaved(&mut y, head, &cos, &sin, RopeDir::Forward);
            round_bf16(&mut y);
            y.iter()
                .map(|&v| crate::f32_to_bf16(v).to_bits())
                .collect::<Vec<u16>>()
        });
        let got = on_every_path(|| {
            let mut inv = vec![0.0f32; heads];
            rms_inv_rows(&x, head, 1e-6, &mut inv);
            let mut out = vec![half::bf16::ZERO; x.len()];
            norm_rope_heads_bf16(&x, head, &inv, &cos, &sin, &mut out);
            out.iter().map(|v| v.to_bits()).collect::<Vec<u16>>()
        });
        assert_eq!(got, want, "{heads} heads of {head}, {pairs} pairs");
    }
}

/// Sizes whose products wrap around a `usize` are refused: unchecked, `tokens · heads ·
/// head_dim` wrapped to 1024 passes the length asserts and the fast paths read queries far past
/// the 1024-byte slice.
#[test]
#[should_panic(expected = "index_scores: tokens x heads overflows")]
fn index_scores_refuses_sizes_that_wrap() {
    let (q, scale, weight) = (vec![1i8; 1024], vec![1.0f32; 16], vec![1.0f32; 16]);
    let keys = vec![1i8; 16 * 64];
    let mut out = vec![0.0f32; 16];
    crate::dsv4::csa::index_scores(
        crate::dsv4::csa::IndexQueries {
            q: &q,
            scale: &scale,
            weight: &weight,
            tokens: (1 << 60) + 1,
            heads: 16,
            head_dim: 64,
        },
        &keys,
        &[1.0; 16],
        0..16,
        &mut out,
        16,
    );
}
