//! GEMM kernels against a plain f64 loop, and the AVX2 path against the portable one.

mod common;

use common::{GemmCase, Rng, all_paths};
use half::bf16;
use proptest::prelude::*;
use simpler_kernels_cpu::{
    GemmTile, OutMode, PackedActs, WeightLayout, WeightsBf16, gemm_bf16, pack_index,
    pack_segment_bf16,
};

fn check(c: &GemmCase, tile: GemmTile, scaled: bool, seed: u64) {
    let mut rng = Rng(seed ^ 0xABCD);
    let ld = tile.n.len() + rng.below(3);
    let out_len = (c.batch - 1) * ld + tile.n.len();
    let seed_out = rng.vec_f32(out_len, 1.0);
    let scale = rng.vec_f32(c.batch, 2.0);
    let scale = scaled.then_some(&scale[..]);
    let outs = all_paths("gemm", || {
        c.run(WeightLayout::RowMajor, &tile, scale, &seed_out, ld)
    });
    for b in 0..c.batch {
        for n in tile.n.clone() {
            let (mut e, mut tol) = c.reference(&tile, b, n);
            if let Some(s) = scale {
                e *= f64::from(s[b]);
                tol *= f64::from(s[b].abs());
            }
            let i = b * ld + (n - tile.n.start);
            if tile.mode == OutMode::Add {
                e += f64::from(seed_out[i]);
                tol += 1e-6;
            }
            for (path, out) in &outs {
                let got = f64::from(out[i]);
                assert!(
                    (got - e).abs() <= tol,
                    "{} b={b} n={n} tile={tile:?}: {got} vs {e}",
                    path.name()
                );
            }
        }
    }
    // Nothing outside the tile's elements is touched.
    for (path, out) in &outs {
        for (i, (&o, &s)) in out.iter().zip(&seed_out).enumerate() {
            if i % ld >= tile.n.len() {
                assert_eq!(o, s, "{} wrote padding element {i}", path.name());
            }
        }
    }
}

#[test]
fn pack_index_is_a_permutation() {
    for cols in [1usize, 15, 16, 17, 40, 64, 1000] {
        let mut seen = vec![false; cols];
        for k in 0..cols {
            let p = pack_index(k, cols);
            assert!(!seen[p], "cols {cols}: {k} collides");
            seen[p] = true;
        }
    }
}

/// A packed segment (an SPMD block's columns) lands where `pack_index` puts each column of
/// the whole row, on every path, for every valid range; ranges off the blocks are refused.
#[test]
fn packed_segments_match_pack_index() {
    for cols in [1usize, 15, 16, 17, 40, 64, 100, 257] {
        let row: Vec<bf16> = (0..cols).map(|c| bf16::from_f32(c as f32)).collect();
        for c0 in (0..cols).step_by(16) {
            let mut ends: Vec<usize> = (c0 + 16..=cols).step_by(16).collect();
            ends.push(cols);
            for end in ends {
                let mut want = vec![f32::NAN; end - c0];
                for c in c0..end {
                    want[pack_index(c, cols) - c0] = c as f32;
                }
                for (path, got) in all_paths("pack_segment_bf16", || {
                    let mut dst = vec![f32::NAN; end - c0];
                    pack_segment_bf16(&row[c0..end], c0, cols, &mut dst);
                    dst
                }) {
                    assert_eq!(got, want, "{} cols {cols}, {c0}..{end}", path.name());
                }
            }
        }
    }
    for (c0, end, cols) in [(1, 17, 40), (0, 20, 40), (32, 48, 40)] {
        let src = vec![bf16::ZERO; end - c0];
        let mut dst = vec![0.0; end - c0];
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pack_segment_bf16(&src, c0, cols, &mut dst)
        }));
        assert!(r.is_err(), "{c0}..{end} of {cols} accepted");
    }
}

#[test]
fn qwen_like_shapes_full_and_split_k() {
    for &(n, k, batch) in &[
        (64usize, 1024usize, 1usize),
        (37, 1024, 2),
        (48, 3072, 3),
        (40, 512, 4),
        // The batch 4-7 assembly pass: a 16-element tail after the pairs, row tails after
        // whole 12-row groups, and batch rows beyond the first four.
        (29, 784, 5),
        (26, 1040, 7),
        (13, 1024, 6),
        (30, 256, 16),
        (7, 2048, 9),
        // Prefill-like: several batch blocks of the wide path, a partial last one.
        (20, 320, 107),
        // Tiles long enough for whole groups of streams the full stride apart, then closer
        // streams for the rest (batch 1-3 in groups of 4 rows, 4 and up in groups of 3).
        (301, 96, 1),
        (290, 64, 3),
        (400, 48, 4),
        (317, 32, 6),
        // AMX tiles (batch >= 5, so 5-9 above take them too): one activation tile mostly
        // padding over several weight groups (batch 8, 15), a batch of exactly one tile, of
        // several tile
        // pairs with a ragged last one, 32-row weight groups with a last group of fewer than
        // 16 and of 16-31 rows, a body with a 16-element strip after whole 32-element steps,
        // a body shorter than one step, and (K = 8192) more than one batch block; batches of
        // one tile and of an odd count (the two-accumulator pass) over several whole 32-row
        // groups (each prefetching the next) and a short last one.
        (70, 1024, 8),
        (45, 528, 15),
        (64, 1024, 16),
        (100, 256, 16),
        (133, 160, 48),
        (37, 1040, 17),
        (53, 528, 45),
        (20, 16, 33),
        (5, 8192, 70),
        // An odd count of 16-row groups (the runtime's tapered shares) at several tile pairs
        // and at a prefill-sized batch: the last 16 rows take the one-weight-tile pass.
        (48, 1024, 40),
        (144, 512, 300),
    ] {
        let c = GemmCase::new(n, k, batch, (n * k + batch) as u64);
        check(&c, GemmTile::full(&WeightsBf16::new(&c.w, n, k)), false, 1);
        // Split-K: four slices accumulated into a zero-seeded buffer equal the full product.
        let slices = 4;
        let mut acc = vec![0.0f32; batch * n];
        let mut full = vec![0.0f32; batch * n];
        let w = WeightsBf16::new(&c.w, n, k);
        let x = PackedActs::new(&c.packed, batch, k);
        for s in 0..slices {
            let kr = k * s / slices..k * (s + 1) / slices;
            gemm_bf16(
                w,
                x,
                &GemmTile {
                    n: 0..n,
                    k: kr,
                    mode: OutMode::Add,
                },
                &mut acc,
                n,
            );
        }
        gemm_bf16(w, x, &GemmTile::full(&w), &mut full, n);
        // Both orders of summation are within the fp32 bound of the terms (a fixed tolerance
        // would fail long rows, whose sums cancel far below their terms' size).
        let whole = GemmTile::full(&w);
        for (i, (&a, &f)) in acc.iter().zip(&full).enumerate() {
            let (_, tol) = c.reference(&whole, i / n, i % n);
            assert!(
                f64::from((a - f).abs()) <= tol,
                "split-K vs full, {n} x {k} batch {batch} [{i}]: {a} vs {f}"
            );
        }
    }
}

/// Every batch 1-20 (the narrow passes, the assembly pass with whole and padded groups of four
/// batch rows and the intrinsics pass for one or two left over, the next-pass prefetch from
/// batch 8) at row counts that leave one or two rows after the groups of three, `K` off the
/// 16- and 32-element steps, tiles starting mid-matrix and the whole matrix, stored and added
/// with a row scale; then batches spanning several activation blocks with a padded last
/// group (`K = 8200`: blocks of four rows).
#[test]
fn every_batch_at_ragged_shapes() {
    let mut seed = 11;
    for batch in 1usize..=20 {
        for (n, k) in [(7usize, 1000usize), (101, 530), (301, 72), (2, 40)] {
            let c = GemmCase::new(n, k, batch, (n * k + batch) as u64);
            let w = WeightsBf16::new(&c.w, n, k);
            check(&c, GemmTile::full(&w), false, seed);
            let mid = GemmTile {
                n: 1.min(n - 1)..n,
                k: 3..k - 5,
                mode: OutMode::Add,
            };
            check(&c, mid, true, seed + 1);
            seed += 2;
        }
    }
    for (n, k, batch) in [(10usize, 8200usize, 35usize), (5, 8200, 23), (4, 8192, 71)] {
        let c = GemmCase::new(n, k, batch, (n + batch) as u64);
        let tile = GemmTile {
            n: 0..n,
            k: 16..k,
            mode: OutMode::Store,
        };
        check(&c, tile, true, 5);
    }
}

/// The AVX2 spread prefetch (from two groups of four batch rows, the first two groups each
/// prefetch half of the next pass's rows at half the rate) changes only where the prefetches
/// point: the same bits with it on and off, at batches of one group and of two to five
/// (padded last groups, left-over rows, several activation blocks at `K = 8200`), row counts
/// on and off multiples of the pass's three rows and its 32-row streams, `K` off the 32- and
/// 16-element steps and tiles starting mid-matrix; and within the reference's bound.
#[test]
fn spread_prefetch_changes_no_bits() {
    use simpler_kernels_cpu::gemm::set_avx2_spread_prefetch;
    let mut seed = 71;
    for batch in [4usize, 5, 7, 8, 9, 11, 12, 16, 19, 35] {
        for (n, k) in [
            (7usize, 1000usize),
            (101, 530),
            (200, 72),
            (3, 40),
            (97, 8200),
        ] {
            let c = GemmCase::new(n, k, batch, (n * k + batch) as u64 + 7);
            let w = WeightsBf16::new(&c.w, n, k);
            let mid = GemmTile {
                n: 1.min(n - 1)..n,
                k: 3..k - 5,
                mode: OutMode::Add,
            };
            for tile in [GemmTile::full(&w), mid] {
                let ld = tile.n.len() + 1;
                let seed_out = Rng(seed).vec_f32((batch - 1) * ld + tile.n.len(), 1.0);
                let run = |on: bool| {
                    all_paths("gemm spread prefetch", || {
                        set_avx2_spread_prefetch(on);
                        let out = c.run(WeightLayout::RowMajor, &tile, None, &seed_out, ld);
                        set_avx2_spread_prefetch(true);
                        out
                    })
                };
                let (off, on) = (run(false), run(true));
                for ((path, a), (_, b)) in off.iter().zip(&on) {
                    assert!(
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{} batch {batch} [{n}, {k}] {tile:?}: the spread prefetch changed bits",
                        path.name()
                    );
                }
                check(&c, tile, false, seed);
                seed += 1;
            }
        }
    }
}

/// Batch 1 (the AVX2 pass cuts a tile's rows into four streams and does the rows left over
/// one at a time): row counts on and off multiples of four, from one row to more than one
/// pass, `K` bodies on 32 elements, ending on a 16-element half step, and off both (the edge
/// sums), whole matrices and tiles starting mid-matrix, stored and added with a row scale.
#[test]
fn batch_one_streams_at_ragged_row_counts() {
    let mut seed = 31;
    for n in [1usize, 2, 3, 4, 5, 7, 8, 9, 13, 64, 67, 257] {
        for k in [32usize, 48, 1024, 1040, 77, 3071] {
            let c = GemmCase::new(n, k, 1, (n * k) as u64 + 3);
            let w = WeightsBf16::new(&c.w, n, k);
            check(&c, GemmTile::full(&w), false, seed);
            let mid = GemmTile {
                n: n / 3..n,
                k: 5.min(k / 2)..k,
                mode: OutMode::Add,
            };
            check(&c, mid, true, seed + 1);
            seed += 2;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn random_tiles_match_reference(
        n in 1usize..30, k in prop_oneof![1usize..200, 200usize..700], batch in prop_oneof![1usize..20, 40usize..110],
        n_cut in 0.0f64..1.0, n_len in 0.0f64..1.0, k_cut in 0.0f64..1.0, k_len in 0.0f64..1.0,
        add in any::<bool>(), scaled in any::<bool>(), seed in any::<u64>(),
    ) {
        let c = GemmCase::new(n, k, batch, seed);
        let n0 = (n_cut * n as f64) as usize;
        let n1 = n0 + 1 + ((n - n0 - 1) as f64 * n_len) as usize;
        let k0 = (k_cut * k as f64) as usize;
        let k1 = k0 + ((k - k0) as f64 * k_len) as usize;
        let mode = if add { OutMode::Add } else { OutMode::Store };
        check(&c, GemmTile { n: n0..n1, k: k0..k1, mode }, scaled, seed);
    }
}

/// Non-finite weights (a corrupt LM-head row) give the same non-finite logits on every path,
/// and the greedy pick skips NaN the same way whichever path produced them (batch 3 takes the
/// vector paths, batch 20 the AMX tiles where the CPU has them).
#[test]
fn non_finite_weights_give_the_same_logits_on_every_path() {
    for (n, k, batch) in [(40, 96, 3), (40, 96, 20)] {
        let mut c = GemmCase::new(n, k, batch, 77);
        c.w[3 * k + 10] = bf16::from_f32(f32::INFINITY);
        c.w[7 * k + 2] = bf16::from_f32(f32::NAN);
        c.w[11 * k + 50] = bf16::from_f32(f32::NEG_INFINITY);
        let tile = GemmTile::full(&WeightsBf16::new(&c.w, n, k));
        let outs = all_paths("non-finite", || {
            c.run(
                WeightLayout::RowMajor,
                &tile,
                None,
                &vec![0.0; batch * n],
                n,
            )
        });
        let p = &outs[0].1;
        for b in 0..batch {
            let row = &p[b * n..(b + 1) * n];
            // Row 7 holds NaN for every batch row; rows 3 and 11 are infinite unless the
            // activation at that column is zero.
            assert!(row[7].is_nan(), "batch {b}: {}", row[7]);
            assert!(
                row[3].is_infinite() || row[3].is_nan(),
                "batch {b}: {}",
                row[3]
            );
            let pick = simpler_kernels_cpu::argmax_f32(row).map(|(i, _)| i);
            assert_ne!(pick, Some(7), "NaN must never be picked");
        }
        for (path, a) in &outs[1..] {
            for (i, (&x, &y)) in p.iter().zip(a).enumerate() {
                let same = (x.is_nan() && y.is_nan())
                    || (x.is_infinite() && x == y)
                    || (x.is_finite() && y.is_finite() && (x - y).abs() <= 1e-4 * (1.0 + x.abs()));
                assert!(same, "element {i}: portable {x} vs {} {y}", path.name());
            }
            for b in 0..batch {
                assert_eq!(
                    simpler_kernels_cpu::argmax_f32(&p[b * n..(b + 1) * n]).map(|(i, _)| i),
                    simpler_kernels_cpu::argmax_f32(&a[b * n..(b + 1) * n]).map(|(i, _)| i),
                    "{} batch {b}",
                    path.name()
                );
            }
        }
    }
}
