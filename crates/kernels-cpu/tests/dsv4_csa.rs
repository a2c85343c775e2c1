//! The CSA kernels (`simpler_kernels_cpu::dsv4::csa`) against plain scalar references, and
//! their paths against each other: the pooling and the Hadamard transform bit for bit across
//! the portable and AVX2 builds, the index scores bit for bit on every int8 path and against
//! the documented float expression, the top-k against a full stable sort.

mod common;

use common::{Rng, all_paths};
use simpler_kernels_cpu::dsv4::csa::{
    IndexQueries, Overlap, hadamard_f32, index_query_i8, index_row_i8, index_scores,
    overlap_pool_row, overlap_state_write, top_k_rows,
};
use simpler_kernels_cpu::{I8Path, with_i8_path};

/// Plain-loop pool of window `w0` (std `exp`, candidates in the documented order), RMSNorm
/// in f64 and rounded to bf16, RoPE in f32.
fn reference_pool(
    ov: Overlap,
    kv: &[f32],
    sc: &[f32],
    w0: usize,
    norm: &[f32],
    cos: &[f32],
    sin: &[f32],
) -> Vec<f32> {
    let (w, wide) = (ov.width, ov.row_width());
    let mut cands: Vec<(usize, usize)> = Vec::new();
    if w0 >= ov.ratio {
        cands.extend((w0 - ov.ratio..w0).map(|q| (q, 0)));
    }
    cands.extend((w0..w0 + ov.ratio).map(|q| (q, w)));
    let at =
        |v: &[f32], (q, off): (usize, usize), c: usize| v[(q % (2 * ov.ratio)) * wide + off + c];
    let pooled: Vec<f64> = (0..w)
        .map(|c| {
            let m = cands
                .iter()
                .map(|&cd| at(sc, cd, c))
                .fold(f32::NEG_INFINITY, f32::max);
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for &cd in &cands {
                let e = f64::from(at(sc, cd, c) - m).exp();
                num += e * f64::from(at(kv, cd, c));
                den += e;
            }
            num / den
        })
        .collect();
    let ms = pooled.iter().map(|v| v * v).sum::<f64>() / w as f64;
    let inv = 1.0 / (ms + 1e-6).sqrt();
    let mut row: Vec<f32> = pooled
        .iter()
        .zip(norm)
        .map(|(v, &g)| half::bf16::from_f64(v * inv * f64::from(g)).to_f32())
        .collect();
    let r = &mut row[w - 2 * cos.len()..];
    for j in 0..cos.len() {
        let (e, o) = (r[2 * j], r[2 * j + 1]);
        r[2 * j] = e * cos[j] - o * sin[j];
        r[2 * j + 1] = e * sin[j] + o * cos[j];
    }
    row
}

#[test]
fn overlapping_pool_matches_a_scalar_reference_on_every_path() {
    let mut rng = Rng(11);
    for (ratio, width, rope) in [(4, 32, 8), (4, 128, 32), (4, 512, 64), (2, 70, 6)] {
        let ov = Overlap { ratio, width };
        let wide = ov.row_width();
        let ape = rng.vec_f32(ratio * wide, 0.3);
        let norm: Vec<f32> = rng.vec_f32(width, 0.1).iter().map(|v| 1.0 + v).collect();
        let pairs = rope / 2;
        let (cos, sin): (Vec<f32>, Vec<f32>) = (0..pairs)
            .map(|j| ((j as f32 * 0.7).cos(), (j as f32 * 0.7).sin()))
            .unzip();
        for w0 in [0, ratio, 5 * ratio] {
            let mut kv = vec![0.0f32; ov.ring_len()];
            let mut sc = vec![0.0f32; ov.ring_len()];
            // The previous window's rows, then this window's through the state write.
            for q in w0.saturating_sub(ratio)..w0 + ratio {
                let (k, g) = (rng.vec_f32(wide, 2.0), rng.vec_f32(wide, 3.0));
                overlap_state_write(ov, q, &k, &g, &ape, &mut kv, &mut sc);
                let s = ov.slot(q) * wide;
                assert_eq!(&kv[s..s + wide], &k[..]);
                for c in 0..wide {
                    assert_eq!(sc[s + c], g[c] + ape[(q % ratio) * wide + c]);
                }
            }
            assert!(ov.closes(w0 + ratio - 1) && !ov.closes(w0 + ratio - 2));
            let want = reference_pool(ov, &kv, &sc, w0, &norm, &cos, &sin);
            let runs = all_paths("overlap_pool_row", || {
                let mut out = vec![0.0f32; width];
                overlap_pool_row(ov, &kv, &sc, w0, &norm, 1e-6, &cos, &sin, &mut out);
                out
            });
            for (isa, got) in &runs {
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    runs[0].1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{isa:?} differs from portable"
                );
                for (c, (g, e)) in got.iter().zip(&want).enumerate() {
                    // One bf16 step of the normed value (the reference rounds in f64).
                    assert!(
                        (g - e).abs() <= 1e-5 + e.abs() / 128.0,
                        "ratio {ratio} width {width} w0 {w0} channel {c}: {g} vs {e}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_first_window_pools_only_its_own_rows() {
    let ov = Overlap { ratio: 4, width: 8 };
    let wide = ov.row_width();
    let mut kv = vec![0.0f32; ov.ring_len()];
    let mut sc = vec![0.0f32; ov.ring_len()];
    // Rows 4..8 of the ring (positions 4..8 of an earlier lap) would join a later window;
    // for window 0 they must not count, however large their scores.
    for r in 4..8 {
        kv[r * wide..(r + 1) * wide].fill(100.0);
        sc[r * wide..(r + 1) * wide].fill(50.0);
    }
    for r in 0..4 {
        for c in 0..wide {
            kv[r * wide + c] = if c >= 8 { (c - 8) as f32 + 1.0 } else { -9.0 };
        }
    }
    let mut out = vec![0.0f32; 8];
    overlap_pool_row(ov, &kv, &sc, 0, &[1.0; 8], 1e-6, &[], &[], &mut out);
    // Equal scores: channel c is the mean of four equal values c + 1, then normed.
    let rms = ((1..=8).map(|v| (v * v) as f32).sum::<f32>() / 8.0).sqrt();
    for (c, &v) in out.iter().enumerate() {
        let e = half::bf16::from_f32((c as f32 + 1.0) / rms).to_f32();
        assert!((v - e).abs() <= e.abs() / 128.0, "channel {c}: {v} vs {e}");
    }
}

#[test]
fn hadamard_matches_the_explicit_matrix_on_every_path() {
    let mut rng = Rng(3);
    // Below, at and above one 8-lane and one 16-lane register (the AVX2 and AVX-512 paths'
    // in-register stages).
    for n in [1usize, 2, 4, 8, 16, 32, 128, 512] {
        let x = rng.vec_f32(n, 1.0);
        let want: Vec<f64> = (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| {
                        let sign = if (i & j).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        sign * f64::from(x[j])
                    })
                    .sum::<f64>()
                    / (n as f64).sqrt()
            })
            .collect();
        let runs = all_paths("hadamard_f32", || {
            let mut v = x.clone();
            hadamard_f32(&mut v);
            v
        });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (isa, got) in &runs {
            assert_eq!(bits(got), bits(&runs[0].1), "{isa:?}");
            for (g, e) in got.iter().zip(&want) {
                assert!((f64::from(*g) - e).abs() < 1e-5, "n {n}: {g} vs {e}");
            }
        }
    }
}

#[test]
#[should_panic(expected = "power of two")]
fn hadamard_refuses_a_length_that_is_not_a_power_of_two() {
    hadamard_f32(&mut [0.0; 24]);
}

#[test]
fn index_query_heads_are_roped_rotated_and_quantised_per_head() {
    let mut rng = Rng(5);
    let (heads, dim, pairs) = (3, 32, 4);
    let q = rng.vec_f32(heads * dim, 2.0);
    let (cos, sin): (Vec<f32>, Vec<f32>) = (0..pairs)
        .map(|j| ((j as f32 + 0.3).cos(), (j as f32 + 0.3).sin()))
        .unzip();
    let mut work = q.clone();
    let (mut qi, mut qs) = (vec![0i8; heads * dim], vec![0.0f32; heads]);
    index_query_i8(&mut work, dim, &cos, &sin, &mut qi, &mut qs);
    for h in 0..heads {
        let mut head = q[h * dim..(h + 1) * dim].to_vec();
        let r = &mut head[dim - 2 * pairs..];
        for j in 0..pairs {
            let (e, o) = (r[2 * j], r[2 * j + 1]);
            r[2 * j] = e * cos[j] - o * sin[j];
            r[2 * j + 1] = e * sin[j] + o * cos[j];
        }
        let mut row = head.clone();
        let mut want = vec![0i8; dim];
        let s = index_row_i8(&mut row, &mut want);
        assert_eq!(&qi[h * dim..(h + 1) * dim], &want[..], "head {h}");
        assert_eq!(qs[h], s);
        // The int8 row times its scale is the rotated head within half a step.
        hadamard_f32(&mut head);
        for (v, &i) in head.iter().zip(&want) {
            assert!((v - f32::from(i) * s).abs() <= 0.5 * s + 1e-6);
        }
    }
}

/// The documented float expression of one score, dot products exact in i32.
fn reference_score(
    qs: &IndexQueries<'_>,
    keys: &[i8],
    key_scale: &[f32],
    t: usize,
    c: usize,
) -> f32 {
    let d = qs.head_dim;
    let k = &keys[c * d..(c + 1) * d];
    let s: f32 = (0..qs.heads)
        .map(|h| {
            let r = t * qs.heads + h;
            let q = &qs.q[r * d..(r + 1) * d];
            let dot: i32 = q
                .iter()
                .zip(k)
                .map(|(&a, &b)| i32::from(a) * i32::from(b))
                .sum();
            (dot as f32 * qs.scale[r]).max(0.0) * qs.weight[r]
        })
        .sum();
    key_scale[c] * s
}

#[test]
fn index_scores_are_bit_identical_on_every_int8_path() {
    let mut rng = Rng(9);
    for (tokens, heads, dim, n_rows, rows) in [
        (2, 4, 32, 40, 0..40),
        (2, 64, 128, 700, 3..650),
        (1, 3, 16, 5, 0..5),
        (2, 2, 64, 300, 299..300),
        // A group of 8 heads and 4 more; a pair of key blocks whose second holds one row.
        (3, 12, 64, 49, 15..32),
    ] {
        let nq = tokens * heads;
        let byte = |r: &mut Rng| ((r.next_u64() % 255) as i32 - 127) as i8;
        let q: Vec<i8> = (0..nq * dim).map(|_| byte(&mut rng)).collect();
        let mut keys: Vec<i8> = (0..n_rows * dim).map(|_| byte(&mut rng)).collect();
        // Keys may hold -128 (only the queries may not): a few, in the first and last rows.
        for i in [0, dim / 2, (n_rows - 1) * dim + 1] {
            keys[i] = i8::MIN;
        }
        let scale: Vec<f32> = rng.vec_f32(nq, 0.01).iter().map(|v| v.abs()).collect();
        let weight = rng.vec_f32(nq, 0.5);
        let mut key_scale: Vec<f32> = rng.vec_f32(n_rows, 0.02).iter().map(|v| v.abs()).collect();
        key_scale[n_rows / 2] = 0.0;
        let qs = IndexQueries {
            q: &q,
            scale: &scale,
            weight: &weight,
            tokens,
            heads,
            head_dim: dim,
        };
        let ld = rows.len() + 3;
        let mut want = vec![f32::NAN; (tokens - 1) * ld + rows.len()];
        for t in 0..tokens {
            for c in rows.clone() {
                want[t * ld + c - rows.start] = reference_score(&qs, &keys, &key_scale, t, c);
            }
        }
        let mut covered = Vec::new();
        for p in I8Path::ALL {
            let got = with_i8_path(p, || {
                let mut out = vec![f32::NAN; want.len()];
                index_scores(qs, &keys, &key_scale, rows.clone(), &mut out, ld);
                out
            });
            let Some(got) = got else { continue };
            covered.push(p.name());
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan()),
                    "{}: out[{i}] = {g}, reference {e}",
                    p.name()
                );
            }
        }
        println!("index_scores {tokens}x{heads}x{dim} rows {rows:?}: paths {covered:?}");
    }
}

/// A query holding `-128` (outside the queries' range) is refused on every path, before
/// anything is written.
#[test]
fn index_scores_refuse_a_query_holding_i8_min_on_every_path() {
    let (tokens, heads, dim, n_rows) = (2, 8, 32, 20);
    let mut q = vec![3i8; tokens * heads * dim];
    q[heads * dim + 5] = i8::MIN;
    let keys = vec![1i8; n_rows * dim];
    let (scale, weight, key_scale) = (
        vec![1.0; tokens * heads],
        vec![1.0; tokens * heads],
        vec![1.0; n_rows],
    );
    let qs = IndexQueries {
        q: &q,
        scale: &scale,
        weight: &weight,
        tokens,
        heads,
        head_dim: dim,
    };
    for p in I8Path::ALL {
        let Some((res, out)) = with_i8_path(p, || {
            let mut out = vec![f32::NAN; tokens * n_rows];
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                index_scores(qs, &keys, &key_scale, 0..n_rows, &mut out, n_rows)
            }));
            (res, out)
        }) else {
            continue;
        };
        let err = res.expect_err(p.name());
        let msg = err.downcast_ref::<String>().map_or("", String::as_str);
        assert!(
            msg.contains("query row 8 holds -128"),
            "{}: {msg}",
            p.name()
        );
        assert!(
            out.iter().all(|v| v.is_nan()),
            "{}: wrote before refusing",
            p.name()
        );
    }
}

#[test]
fn top_k_matches_a_stable_sort() {
    let mut rng = Rng(17);
    for n in [0usize, 1, 7, 100, 2048] {
        // Few distinct values: many ties.
        let scores: Vec<f32> = (0..n).map(|_| (rng.next_u64() % 13) as f32 - 6.0).collect();
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]));
        for k in [0, 1, 4, 512, 5000] {
            let mut got = Vec::new();
            top_k_rows(&scores, k, &mut got);
            assert_eq!(got, order[..k.min(n)], "n {n} k {k}");
        }
    }
}
