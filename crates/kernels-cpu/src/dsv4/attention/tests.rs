//! The attention's own kernels against plain loops, the builds against each other (bit for
//! bit), the pair-layout value products against the portable one, and the whole kernel at
//! ragged blocks on every path this CPU has (each test prints the paths it ran).

use super::*;
use crate::dsv4::tests::{attention_reference, values};
use crate::isa::with_isa;

/// Softmax-like weights `[heads, ld]`: bf16 values in `[0, 1)` as bits, zero past `n` in
/// each row.
fn weights(heads: usize, n: usize, ld: usize, seed: u64) -> Vec<u16> {
    let v = values(heads * n, seed);
    let mut w = vec![0u16; heads * ld];
    for h in 0..heads {
        for j in 0..n {
            w[h * ld + j] = half::bf16::from_f32(v[h * n + j].abs()).to_bits();
        }
    }
    w
}

fn widen(bits: u16) -> f64 {
    f64::from(half::bf16::from_bits(bits).to_f32())
}

fn bf16_rows(n: usize, seed: u64) -> Vec<bf16> {
    values(n, seed)
        .iter()
        .map(|&v| bf16::from_f32(2.0 * v))
        .collect()
}

/// Runs `f` on every path this CPU has; returns the portable result and the paths that ran,
/// after checking every path's result equals the portable one.
fn same_on_every_path<T: PartialEq + std::fmt::Debug>(f: impl Fn() -> T) -> (T, Vec<Isa>) {
    let first = with_isa(Isa::Portable, &f).expect("portable always runs");
    let mut ran = Vec::new();
    for isa in Isa::ALL {
        if let Some(r) = with_isa(isa, &f) {
            assert_eq!(r, first, "{isa:?} differs from portable");
            ran.push(isa);
        }
    }
    (first, ran)
}

#[test]
fn softmax_rows_matches_a_plain_loop_and_its_builds_agree_bit_for_bit() {
    let heads = 3;
    for n in [1usize, 15, 16, 17, 128, 640] {
        let scores: Vec<f32> = values(heads * n, n as u64)
            .iter()
            .map(|v| 9.0 * v)
            .collect();
        // Rows of `p` longer than `n`: the rest is zeroed (over stale values).
        let ld = n + 3;
        let ((m, l, p), ran) = same_on_every_path(|| {
            let (mut m, mut l) = (vec![0.0f32; heads], vec![0.0f32; heads]);
            let mut p = vec![0x7fc0u16; heads * ld];
            softmax_rows(&scores, n, 0.5, &mut m, &mut l, &mut p, ld);
            (m, l, p)
        });
        for h in 0..heads {
            let sc: Vec<f64> = scores[h * n..(h + 1) * n]
                .iter()
                .map(|&v| f64::from(v) * 0.5)
                .collect();
            let mt = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(f64::from(m[h]), mt, "n {n} head {h}: max");
            let mut sum = 0.0;
            for (j, s) in sc.iter().enumerate() {
                let e = (s - mt).exp();
                sum += e;
                let pb = widen(p[h * ld + j]);
                assert!((pb - e).abs() <= 4e-3 * e + 1e-30, "p[{h},{j}]");
            }
            assert!(
                p[h * ld + n..(h + 1) * ld].iter().all(|&b| b == 0),
                "pad {h}"
            );
            assert!((f64::from(l[h]) - sum).abs() <= 1e-5 * sum, "l {h}");
        }
        if n == 128 {
            println!("softmax_rows paths: {ran:?}");
        }
    }
}

/// A NaN score is ignored by the max (as `f32::max` took it), in the vector body and in the
/// tail, with the same max on every build; a row of zeros and negative zeros has a zero max
/// and weights of one.
#[test]
fn softmax_rows_max_ignores_a_nan_score_on_every_build() {
    let (heads, n) = (3, 37);
    let mut scores: Vec<f32> = values(2 * n, 5).iter().map(|v| 4.0 * v).collect();
    scores[3] = f32::NAN;
    scores[n + 34] = f32::NAN;
    scores.extend((0..n).map(|j| if j % 2 == 0 { 0.0f32 } else { -0.0 }));
    let ((m, zero_row), ran) = same_on_every_path(|| {
        let (mut m, mut l) = (vec![0.0f32; heads], vec![0.0f32; heads]);
        let mut p = vec![0u16; heads * n];
        softmax_rows(&scores, n, 1.0, &mut m, &mut l, &mut p, n);
        (m, p[2 * n..].to_vec())
    });
    for (h, &mh) in m.iter().enumerate().take(2) {
        let want = scores[h * n..(h + 1) * n]
            .iter()
            .copied()
            .filter(|v| !v.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(mh, want, "row {h}");
    }
    assert_eq!(m[2], 0.0);
    assert!(
        zero_row.iter().all(|&b| b == bf16::ONE.to_bits()),
        "{zero_row:?}"
    );
    println!("softmax_rows NaN paths: {ran:?}");
}

#[test]
fn pv_add_matches_a_plain_loop_at_ragged_shapes_and_its_builds_agree() {
    for (heads, n, d) in [
        (1usize, 1usize, 1usize),
        (5, 1, 40),
        (4, 33, 64),
        (9, 128, 70),
        (13, 37, 512),
    ] {
        let ld = n + 1;
        let p = weights(heads, n, ld, 3);
        let rows = bf16_rows(n * d, 4);
        let base = values(heads * d, 5);
        let (out, ran) = same_on_every_path(|| {
            let mut out = base.clone();
            pv_add(&p, ld, heads, n, &rows, d, &mut out);
            out
        });
        for h in 0..heads {
            for c in 0..d {
                let want: f64 = f64::from(base[h * d + c])
                    + (0..n)
                        .map(|j| widen(p[h * ld + j]) * f64::from(rows[j * d + c].to_f32()))
                        .sum::<f64>();
                let got = f64::from(out[h * d + c]);
                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "[{h},{c}]");
            }
        }
        println!("pv_add {heads}x{n}x{d} paths: {ran:?}");
    }
}

/// `product` (a value product over the rows zero-padded to whole 32-row steps, given `P` as
/// bf16 bits `[heads, n32]` zero past `n` and the rows in the pair layout, adding to `out`)
/// against the portable `pv_add` at each `(heads, n, d)`: the same bf16 products, fp32 sums in
/// another order. The rows are put in the pair layout in two calls (the first 32-row step
/// alone, then the rest at its offset), as the kernel puts them block by block.
#[cfg(target_arch = "x86_64")]
fn matches_portable_value_product(
    shapes: &[(usize, usize, usize)],
    seed: u64,
    product: impl Fn(&[u16], usize, usize, &[u16], usize, &mut [f32]),
) {
    for &(heads, n, d) in shapes {
        let n32 = n.div_ceil(32) * 32;
        let pb = weights(heads, n, n32, seed);
        let mut rows = bf16_rows(n * d, seed + 1);
        rows.resize(n32 * d, bf16::ZERO);
        let base = values(heads * d, seed + 2);
        let mut want = base.clone();
        with_isa(Isa::Portable, || {
            pv_add(&pb, n32, heads, n, &rows[..n * d], d, &mut want)
        });
        // Stale values where the layout is written: every line must be overwritten.
        let mut vnni = vec![0x7fc0u16; amx::layout_len(n32, d)];
        let (first, rest) = rows.split_at(32 * d);
        amx::interleave(first, d, &mut vnni, n32 / 2, 0);
        amx::interleave(rest, d, &mut vnni, n32 / 2, 16);
        let mut got = base.clone();
        product(&pb, heads, n32, &vnni, d, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{heads}x{n}x{d} [{i}]: {g} vs {w}"
            );
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn amx_value_product_matches_the_portable_one_at_tile_edges() {
    if !Isa::AmxBf16.is_supported() {
        println!("AMX-BF16 not available here: the AMX value product did not run");
        return;
    }
    // One and three 16-head blocks (the odd one alone), pairs of 32-column blocks, ragged
    // rows, one and five 128-row blocks of rows.
    let shapes = [
        (16, 1, 32),
        (16, 31, 64),
        (32, 33, 96),
        (48, 200, 64),
        (64, 128, 512),
        (64, 640, 512),
    ];
    // `out` is only written: garbage in it changes nothing.
    matches_portable_value_product(&shapes, 6, |pb, heads, n32, vnni, d, out| {
        let mut fresh = vec![f32::NAN; out.len()];
        amx::pv_store(pb, heads, n32, vnni, d, &mut fresh);
        for (o, f) in out.iter_mut().zip(&fresh) {
            *o += f;
        }
    });
    println!("amx value product ran");
}

#[test]
fn sparse_attention_at_block_edges_on_every_path() {
    // 16 and 48 heads of 64: one AMX head block, then a pair and a lone one where the CPU has
    // AMX.
    for (heads, d) in [(16usize, 64usize), (48, 64)] {
        attention_at_block_edges(heads, d);
    }
}

fn attention_at_block_edges(heads: usize, d: usize) {
    let q: Vec<f32> = values(heads * d, 21)
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let sinks = values(heads, 22);
    let scale = 1.0 / (d as f32).sqrt();
    // Entries 0..128: one valid row (the last); 128..256: none; 256..384: all; then 33 of 40:
    // 162 valid rows, one whole 128-row block and a ragged one of 34.
    let n = 3 * ATTN_TILE + 40;
    let rows: Vec<Option<Vec<bf16>>> = (0..n)
        .map(|j| {
            let valid = j == ATTN_TILE - 1 || (2 * ATTN_TILE..3 * ATTN_TILE + 33).contains(&j);
            valid.then(|| bf16_rows(d, 300 + j as u64))
        })
        .collect();
    let lists: [(&str, Vec<Option<&[bf16]>>); 3] = [
        ("ragged blocks", rows.iter().map(|r| r.as_deref()).collect()),
        (
            "one valid row",
            rows[..ATTN_TILE].iter().map(|r| r.as_deref()).collect(),
        ),
        ("no candidate", Vec::new()),
    ];
    let ran = lists_match_the_reference(&q, d, scale, &sinks, &lists);
    // The sink alone (every candidate masked): zeros, on the scratch of an earlier call.
    let mut s = AttnScratch::default();
    let mut out = vec![0.0f32; heads * d];
    let full: Vec<Option<&[bf16]>> = rows.iter().map(|r| r.as_deref()).collect();
    sparse_attention(Queries::F32(&q), d, &full, scale, &sinks, &mut out, &mut s);
    let masked: Vec<Option<&[bf16]>> = vec![None; 2 * ATTN_TILE];
    sparse_attention(
        Queries::F32(&q),
        d,
        &masked,
        scale,
        &sinks,
        &mut out,
        &mut s,
    );
    assert!(out.iter().all(|&v| v == 0.0));
    println!("sparse_attention {heads}x{d} (path, engine): {ran:?}");
}

/// Runs every candidate list of `lists` on every path this CPU has, one scratch per path for
/// all the lists (what a longer call left in it changes nothing), against the reference over
/// the same rows (runs taken row by row); the paths that ran, each with its engine.
fn lists_match_the_reference(
    q: &[f32],
    d: usize,
    scale: f32,
    sinks: &[f32],
    lists: &[(&str, Vec<Option<&[bf16]>>)],
) -> Vec<(Isa, Engine)> {
    let heads = sinks.len();
    let mut ran = Vec::new();
    for isa in Isa::ALL {
        let Some(()) = with_isa(isa, || {
            let mut s = AttnScratch::default();
            for (what, cands) in lists {
                let mut out = vec![7.0f32; heads * d];
                sparse_attention(Queries::F32(q), d, cands, scale, sinks, &mut out, &mut s);
                // The same queries as bf16 give the same bits as their values in fp32 slots.
                let qb: Vec<bf16> = q.iter().map(|&v| bf16::from_f32(v)).collect();
                let qr: Vec<f32> = qb.iter().map(|v| v.to_f32()).collect();
                let mut from_f32 = vec![7.0f32; heads * d];
                sparse_attention(
                    Queries::F32(&qr),
                    d,
                    cands,
                    scale,
                    sinks,
                    &mut from_f32,
                    &mut s,
                );
                let mut from_bf16 = vec![-7.0f32; heads * d];
                sparse_attention(
                    Queries::Bf16(&qb),
                    d,
                    cands,
                    scale,
                    sinks,
                    &mut from_bf16,
                    &mut s,
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&from_bf16),
                    bits(&from_f32),
                    "{what}: bf16 queries on {isa:?}"
                );
                let rows: Vec<Option<Vec<bf16>>> = cands
                    .iter()
                    .flat_map(|c| match c {
                        Some(r) => r.chunks_exact(d).map(|r| Some(r.to_vec())).collect(),
                        None => vec![None],
                    })
                    .collect();
                for h in 0..heads {
                    let e = attention_reference(&q[h * d..(h + 1) * d], &rows, scale, sinks[h]);
                    for (c, (&a, &e)) in out[h * d..(h + 1) * d].iter().zip(&e).enumerate() {
                        assert!(
                            (a - e).abs() <= 1e-2 * e.abs() + 2e-3,
                            "{isa:?} {heads}x{d} {what} head {h} [{c}]: {a} vs {e}"
                        );
                    }
                }
            }
        }) else {
            continue;
        };
        ran.push((isa, engine(isa, heads, d)));
    }
    ran
}

#[test]
fn sparse_attention_reads_runs_of_adjacent_rows_on_every_path() {
    for (heads, d) in [(16usize, 64usize), (48, 64), (5, 40)] {
        runs_match_single_rows(heads, d);
    }
}

/// Runs of adjacent cache rows (long ones read in place, an odd one split into an even run and
/// a copied row, short ones copied with their neighbours, a copied block cut before a long run
/// at an odd count) against the reference over the same rows, on every path.
fn runs_match_single_rows(heads: usize, d: usize) {
    let cache_rows = 700;
    let cache = bf16_rows(cache_rows * d, 41);
    let q: Vec<f32> = values(heads * d, 42)
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let sinks = values(heads, 43);
    let scale = 1.0 / (d as f32).sqrt();
    let run = |r0: usize, k: usize| Some(&cache[r0 * d..(r0 + k) * d]);
    // (first row, rows); `None` entries are masked.
    let lists: [(&str, Vec<Option<&[bf16]>>); 4] = [
        (
            "mixed runs",
            vec![
                run(10, 3),
                run(600, 1),
                run(100, 128),
                None,
                run(300, 33),
                run(5, 1),
                run(400, 200),
                run(650, 5),
                run(2, 1),
                run(40, 31),
                run(660, 1),
            ],
        ),
        ("one long odd run", vec![run(1, 257)]),
        (
            "an odd copy before a long run",
            vec![run(7, 1), run(9, 1), run(20, 1), run(200, 64), run(3, 1)],
        ),
        (
            "short runs only",
            (0..40).map(|i| run(i * 17 % 690, 2)).collect(),
        ),
    ];
    let ran = lists_match_the_reference(&q, d, scale, &sinks, &lists);
    println!("sparse_attention runs {heads}x{d} (path, engine): {ran:?}");
}

#[test]
fn sparse_attention_head_lanes_cover_every_block_shape() {
    // Head vectors 1 to 7 (each scores block shape; 5 heads pad one vector), heads around the
    // value product's 4-head blocks, 3 and 4 column blocks (a 16-column tail at 48).
    if !Isa::Avx512Bf16.is_supported() {
        println!("AVX-512 BF16 not available here: the head-lane engine did not run");
    }
    for (heads, d) in [
        (5usize, 48usize),
        (20, 48),
        (64, 64),
        (80, 48),
        (96, 32),
        (112, 16),
    ] {
        runs_match_single_rows(heads, d);
    }
}

#[test]
#[should_panic(expected = "not whole rows")]
fn sparse_attention_refuses_a_candidate_of_part_of_a_row() {
    let (heads, d) = (2, 8);
    let rows = bf16_rows(3 * d, 44);
    let cands = [Some(&rows[..2 * d]), Some(&rows[..d + 1])];
    let mut out = vec![0.0f32; heads * d];
    sparse_attention(
        Queries::F32(&values(heads * d, 45)),
        d,
        &cands,
        1.0,
        &values(heads, 46),
        &mut out,
        &mut AttnScratch::default(),
    );
}

#[test]
#[cfg(target_arch = "x86_64")]
fn head_lane_exp2_and_rounding_give_the_bits_of_the_scalar_forms() {
    use std::arch::x86_64::*;
    if !Isa::Avx512Bf16.is_supported() {
        println!("AVX-512 not available here: the head lanes' exp2 did not run");
        return;
    }
    let mut xs: Vec<f32> = (0..4000).map(|i| -130.0 + i as f32 * 0.0331).collect();
    xs.extend([
        0.0,
        -0.0,
        1e-3,
        -0.5,
        0.5,
        -126.0,
        -127.5,
        f32::NEG_INFINITY,
        f32::NAN,
    ]);
    xs.resize(xs.len().next_multiple_of(16), 0.25);
    for x in xs.as_chunks::<16>().0 {
        let mut got = [0.0f32; 16];
        // SAFETY: AVX-512 F (implied by AVX-512 BF16, checked above); 16-lane arrays.
        unsafe {
            _mm512_storeu_ps(
                got.as_mut_ptr(),
                lanes::exp2_16(_mm512_loadu_ps(x.as_ptr())),
            )
        };
        for (&x, &g) in x.iter().zip(&got) {
            let want = crate::math::exp2_approx(x);
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "exp2({x}): {g} vs {want}"
            );
        }
        // The softmax's bf16 rounding of the finite values, ties to even.
        let mut r = [0u32; 16];
        // SAFETY: as above.
        unsafe {
            _mm512_storeu_si512(
                r.as_mut_ptr().cast(),
                lanes::round_bf16_16(_mm512_loadu_ps(got.as_ptr())),
            )
        };
        for (&g, &r) in got.iter().zip(&r) {
            if g.is_finite() {
                assert_eq!(r, round_bf16(g).to_bits(), "bf16({g})");
            }
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn head_lane_queries_are_packed_as_pairs_of_every_head_at_every_line() {
    if !Isa::Avx512Bf16.is_supported() {
        println!("AVX-512 not available here: the head lanes' query packing did not run");
        return;
    }
    // Whole and partial 16-pair runs (d 16, 48, 80), whole and padded head groups.
    for (heads, d) in [(5usize, 48usize), (16, 32), (20, 16), (33, 80), (64, 512)] {
        let hp = heads.next_multiple_of(16);
        let q = bf16_rows(heads * d, 900 + heads as u64);
        // Every line written: garbage before.
        let mut got = vec![0xDEAD_BEEFu32; d / 2 * hp];
        // SAFETY: AVX-512 F (implied by AVX-512 BF16, checked above).
        unsafe { lanes::pack_queries(&q, heads, d, hp, &mut got) };
        for k in 0..d / 2 {
            for h in 0..hp {
                let want = if h < heads {
                    u32::from(q[h * d + 2 * k].to_bits())
                        | u32::from(q[h * d + 2 * k + 1].to_bits()) << 16
                } else {
                    0
                };
                assert_eq!(
                    got[k * hp + h],
                    want,
                    "{heads} heads x {d}: line {k}, head {h}"
                );
            }
        }
    }
}
