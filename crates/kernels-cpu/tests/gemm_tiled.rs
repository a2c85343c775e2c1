//! The tiled bf16 weight layout: packing, indexing, and every GEMM path on tiled weights
//! against the same kernel on the row-major matrix, bit for bit (each kernel sums the same
//! products in the same order whatever the layout; the AVX2 path hands tiled weights to the
//! portable one). The AMX path takes tiled weights below batch 5 too, where row-major ones
//! take the AVX-512 BF16 path: there the results are checked against an f64 reference.

mod common;

use common::{GemmCase, Rng, all_paths};
use half::bf16;
use proptest::prelude::*;
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PreparedActs, TILE_COLS, TILE_ROWS, WeightLayout, WeightsBf16,
    gemm_bf16, gemm_bf16_prepared, pack_acts_bf16, packed_len, path_for, tiled_index, tiled_len,
    tiled_weights_pay, with_isa,
};

/// The path whose row-major result the tiled result of `isa` must equal bit for bit at
/// `batch` (the same kernel), or `None` when no row-major call runs that kernel.
fn row_major_twin(isa: Isa, batch: usize) -> Option<Isa> {
    let p = path_for(isa, batch, WeightLayout::Tiled);
    (path_for(p, batch, WeightLayout::RowMajor) == p).then_some(p)
}

/// Tiled results without a bit-for-bit twin against the row-major ones of the same path.
fn close(got: &[f32], want: &[f32], what: &str) {
    common::assert_close(got, want, 1e-4, 1e-4, what);
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Tiled vs row-major on every path this CPU has.
fn check(c: &GemmCase, tile: GemmTile, scaled: bool, seed: u64) {
    let mut rng = Rng(seed ^ 0x5EED);
    let ld = tile.n.len() + rng.below(3);
    let out_len = (c.batch - 1) * ld + tile.n.len();
    let seed_out = rng.vec_f32(out_len, 1.0);
    let scale = rng.vec_f32(c.batch, 2.0);
    let scale = scaled.then_some(&scale[..]);
    let tiled = all_paths("gemm tiled", || {
        c.run(WeightLayout::Tiled, &tile, scale, &seed_out, ld)
    });
    for (isa, got) in &tiled {
        let Some(twin) = row_major_twin(*isa, c.batch) else {
            c.assert_reference(
                &tile,
                scale,
                &seed_out,
                ld,
                got,
                &format!("{} tiled", isa.name()),
            );
            continue;
        };
        let want = with_isa(twin, || {
            c.run(WeightLayout::RowMajor, &tile, scale, &seed_out, ld)
        })
        .expect("the twin path runs where the path does");
        assert_eq!(
            bits(got),
            bits(&want),
            "{} tiled vs {} row-major: n={} k={} batch={} tile={tile:?}",
            isa.name(),
            twin.name(),
            c.n,
            c.k,
            c.batch
        );
    }
}

#[test]
fn tiled_index_places_every_element_once_and_padding_is_zero() {
    for (rows, cols) in [
        (1usize, 1usize),
        (16, 32),
        (17, 33),
        (5, 100),
        (40, 64),
        (33, 1000),
    ] {
        let len = tiled_len(rows, cols).unwrap();
        assert_eq!(len, rows.div_ceil(16) * 16 * cols.div_ceil(32) * 32);
        common::assert_layout_places_every_element(
            WeightLayout::Tiled,
            rows,
            cols,
            len,
            tiled_index,
        );
        // A 16-row group's step is one 1 KiB block, the group's blocks consecutive along K.
        if rows >= 16 && cols >= 64 {
            assert_eq!(tiled_index(0, 32, cols), TILE_ROWS * TILE_COLS);
            assert_eq!(tiled_index(1, 0, cols), TILE_COLS);
            assert_eq!(tiled_index(16, 0, cols), 16 * cols.div_ceil(32) * 32);
        }
    }
    assert_eq!(tiled_len(usize::MAX, 2), None);
}

#[test]
fn tiled_weights_pay_only_on_the_amx_path() {
    assert!(!tiled_weights_pay(Isa::Portable));
    assert!(!tiled_weights_pay(Isa::Avx2));
    assert!(!tiled_weights_pay(Isa::Avx512Bf16));
    assert!(tiled_weights_pay(Isa::AmxBf16));
}

/// Ragged shapes (`N` not a multiple of 16, `K` not a multiple of 32 or 16), every batch from
/// 1 to 20 (the AVX-512 BF16 path below 5, AMX tiles from 5), tiles on group edges with
/// ragged ends, split `K`, store and add, scaled and not.
#[test]
fn tiled_matches_row_major_on_every_path() {
    for &(n, k) in &[
        (64usize, 1024usize),
        (37, 1040),
        (50, 784),
        (16, 48),
        (7, 16),
        (33, 7),
        (70, 1000),
    ] {
        for batch in 1..=20 {
            let c = GemmCase::new(n, k, batch, (n * 131 + k * 7 + batch) as u64);
            check(
                &c,
                GemmTile::full(&c.weights(WeightLayout::Tiled)),
                batch % 2 == 0,
                1,
            );
            // Tiles starting on group and step edges with ragged ends, stored and added.
            let n0 = if n > 16 { 16 } else { 0 };
            let k0 = if k > 64 { 32 } else { 0 };
            let k1 = k - k.min(5) / 2;
            for mode in [OutMode::Store, OutMode::Add] {
                check(
                    &c,
                    GemmTile {
                        n: n0..n,
                        k: k0..k1,
                        mode,
                    },
                    batch % 3 == 0,
                    batch as u64,
                );
            }
        }
    }
}

/// Tiles with an odd count of 16-row groups (as the runtime's tapered shares cut most
/// projection blocks) at batches of several activation tile pairs, a ragged last pair and a
/// prefill-sized batch: the last group of 16 rows takes the one-weight-tile pass, read in
/// place in both layouts (at the matrix's end too, where a second tile would lie outside).
#[test]
fn odd_group_counts_at_wide_batches() {
    for &(n, k, batch) in &[(48usize, 1024usize, 40usize), (16, 96, 64), (144, 512, 300)] {
        let c = GemmCase::new(n, k, batch, (n * 7 + k + batch) as u64);
        check(
            &c,
            GemmTile::full(&c.weights(WeightLayout::Tiled)),
            false,
            3,
        );
        if n > 32 {
            for mode in [OutMode::Store, OutMode::Add] {
                let tile = GemmTile {
                    n: 16..n - 16,
                    k: 0..k,
                    mode,
                };
                check(&c, tile, true, 5);
            }
        }
    }
}

/// Split-K slices on 32-element steps accumulated into a zero-seeded buffer, tiled and
/// row-major, give the same sums on every path.
#[test]
fn tiled_split_k_matches_row_major() {
    for &(n, k, batch) in &[(48usize, 3072usize, 4usize), (40, 1040, 16), (33, 200, 7)] {
        let c = GemmCase::new(n, k, batch, 9);
        let steps = k.div_ceil(TILE_COLS);
        let cuts: Vec<usize> = (0..=4)
            .map(|s| (steps * s / 4 * TILE_COLS).min(k))
            .collect();
        let split = |layout: WeightLayout| {
            let mut acc = vec![0.0f32; batch * n];
            for win in cuts.windows(2) {
                let tile = GemmTile {
                    n: 0..n,
                    k: win[0]..win[1],
                    mode: OutMode::Add,
                };
                gemm_bf16(c.weights(layout), c.acts(), &tile, &mut acc, n);
            }
            acc
        };
        for (isa, got) in all_paths("tiled split-K", || split(WeightLayout::Tiled)) {
            let what = format!("{} n={n} k={k} batch={batch}", isa.name());
            match row_major_twin(isa, batch) {
                Some(twin) => {
                    let want = with_isa(twin, || split(WeightLayout::RowMajor)).unwrap();
                    assert_eq!(bits(&got), bits(&want), "{what}");
                }
                None => close(
                    &got,
                    &with_isa(isa, || split(WeightLayout::RowMajor)).unwrap(),
                    &what,
                ),
            }
        }
    }
}

/// A row slice of tiled weights from a group edge computes those rows of the whole matrix.
#[test]
fn tiled_row_range_is_the_rows_of_the_whole() {
    let (n, k, batch) = (70, 96, 6);
    let c = GemmCase::new(n, k, batch, 3);
    let whole = c.weights(WeightLayout::Tiled);
    let mut full = vec![0.0f32; batch * n];
    gemm_bf16(whole, c.acts(), &GemmTile::full(&whole), &mut full, n);
    for r in [16..70, 32..48, 64..70, 0..5] {
        let part = whole.row_range(r.clone());
        assert_eq!(part.layout(), WeightLayout::Tiled);
        let mut out = vec![0.0f32; batch * r.len()];
        gemm_bf16(part, c.acts(), &GemmTile::full(&part), &mut out, r.len());
        for b in 0..batch {
            assert_eq!(
                bits(&out[b * r.len()..(b + 1) * r.len()]),
                bits(&full[b * n + r.start..b * n + r.end]),
                "rows {r:?} batch {b}"
            );
        }
    }
    let rm = c.weights(WeightLayout::RowMajor).row_range(3..9);
    assert_eq!(rm.data(), &c.w[3 * k..9 * k]);
}

#[test]
#[should_panic(expected = "does not start on a group")]
fn tiled_row_range_off_a_group_edge_panics() {
    let c = GemmCase::new(40, 64, 1, 1);
    let _ = c.weights(WeightLayout::Tiled).row_range(8..20);
}

#[test]
#[should_panic(expected = "must start on multiples")]
fn tiled_tile_off_a_group_edge_panics() {
    let c = GemmCase::new(40, 64, 2, 1);
    let tile = GemmTile {
        n: 8..40,
        k: 0..64,
        mode: OutMode::Store,
    };
    let mut out = vec![0.0; 2 * 32];
    gemm_bf16(
        c.weights(WeightLayout::Tiled),
        c.acts(),
        &tile,
        &mut out,
        32,
    );
}

#[test]
#[should_panic(expected = "must start on multiples")]
fn tiled_tile_off_a_step_edge_panics() {
    let c = GemmCase::new(40, 64, 2, 1);
    let tile = GemmTile {
        n: 0..40,
        k: 16..64,
        mode: OutMode::Store,
    };
    let mut out = vec![0.0; 2 * 40];
    gemm_bf16(
        c.weights(WeightLayout::Tiled),
        c.acts(),
        &tile,
        &mut out,
        40,
    );
}

#[test]
#[should_panic(expected = "tiled weights: len")]
fn tiled_view_of_a_row_major_length_panics() {
    let data = vec![bf16::ZERO; 20 * 40];
    let _ = WeightsBf16::tiled(&data, 20, 40);
}

/// Prepared activations (the AMX path's VNNI tiles made once) on tiled weights.
#[test]
fn tiled_prepared_matches_row_major() {
    for batch in [3usize, 8, 20] {
        let c = GemmCase::new(45, 512, batch, 11);
        let run = |layout: WeightLayout| {
            let mut pre = PreparedActs::default();
            pre.prepare(c.acts());
            let w = c.weights(layout);
            let mut out = vec![0.0f32; batch * c.n];
            gemm_bf16_prepared(w, &pre, &GemmTile::full(&w), &mut out, c.n);
            out
        };
        for (isa, got) in all_paths("tiled prepared", || run(WeightLayout::Tiled)) {
            let what = format!("{} batch {batch}", isa.name());
            match row_major_twin(isa, batch) {
                Some(twin) => {
                    let want = with_isa(twin, || run(WeightLayout::RowMajor)).unwrap();
                    assert_eq!(bits(&got), bits(&want), "{what}");
                }
                None => close(
                    &got,
                    &with_isa(isa, || run(WeightLayout::RowMajor)).unwrap(),
                    &what,
                ),
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_tiled_tiles_match_row_major(
        n in 1usize..70, k in prop_oneof![1usize..100, 100usize..600], batch in 1usize..21,
        n_cut in 0.0f64..1.0, n_len in 0.0f64..1.0, k_cut in 0.0f64..1.0, k_len in 0.0f64..1.0,
        add in any::<bool>(), scaled in any::<bool>(), seed in any::<u64>(),
    ) {
        let c = GemmCase::new(n, k, batch, seed);
        let n0 = (n_cut * n as f64) as usize / TILE_ROWS * TILE_ROWS;
        let n1 = n0 + 1 + ((n - n0 - 1) as f64 * n_len) as usize;
        let k0 = (k_cut * k as f64) as usize / TILE_COLS * TILE_COLS;
        let k1 = k0 + ((k - k0) as f64 * k_len) as usize;
        let mode = if add { OutMode::Add } else { OutMode::Store };
        check(&c, GemmTile { n: n0..n1, k: k0..k1, mode }, scaled, seed);
    }
}

/// One activation row against tiled weights (on AMX its own pass: one-column tiles, the
/// tile's groups walked as four regions side by side) gives, bit for bit, that row's outputs
/// of a three-row product where it is the middle row (the tile pass shared with wider
/// batches), on every path: ragged `N` (regions of unequal length, fewer groups than
/// regions, a short last group), `K` with a 16-element strip and edges, tiles off the
/// matrix's origin, store and add, scaled and not.
#[test]
fn tiled_single_row_matches_its_row_in_a_batch() {
    for &(n, k) in &[
        (1usize, 64usize),
        (16, 32),
        (37, 1040),
        (64, 1024),
        (80, 48),
        (130, 1000),
        (208, 96),
        (250, 3072),
        (33, 7),
    ] {
        let batch = GemmCase::new(n, k, 3, (n * 7 + k) as u64);
        let mut single = GemmCase::new(n, k, 1, 0);
        single.w.clone_from(&batch.w);
        single.tiled.clone_from(&batch.tiled);
        single.x = batch.x[k..2 * k].to_vec();
        single.packed = vec![0.0; packed_len(1, k)];
        pack_acts_bf16(&single.x, 1, k, &mut single.packed);
        let n0 = if n > 16 { 16 } else { 0 };
        let k0 = if k > 64 { 32 } else { 0 };
        let tiles = [
            GemmTile::full(&batch.weights(WeightLayout::Tiled)),
            GemmTile {
                n: n0..n,
                k: k0..k - k.min(5) / 2,
                mode: OutMode::Add,
            },
        ];
        for tile in tiles {
            let width = tile.n.len();
            let mut rng = Rng((n * 31 + k) as u64);
            let seed_out = rng.vec_f32(3 * width, 1.0);
            let scale = rng.vec_f32(3, 2.0);
            let one = all_paths("tiled single row", || {
                single.run(
                    WeightLayout::Tiled,
                    &tile,
                    Some(&scale[1..2]),
                    &seed_out[width..2 * width],
                    width,
                )
            });
            for (isa, got) in one {
                let three = with_isa(isa, || {
                    batch.run(WeightLayout::Tiled, &tile, Some(&scale), &seed_out, width)
                })
                .expect("the path runs");
                assert_eq!(
                    bits(&got),
                    bits(&three[width..2 * width]),
                    "{}: n={n} k={k} tile={tile:?}",
                    isa.name()
                );
            }
        }
    }
}

/// `path_for`, which the dispatch itself asks, never names a path wider than the one kernels
/// run on, and follows the layouts' rules: paired weights on the AVX-512 BF16 broadcast
/// kernel from batch 2 where that path exists and on the AVX2 passes otherwise, tiled ones on the portable loops where AVX2 is the widest path (its passes read
/// rows in place), row-major batches of 1–2 on the AVX2 passes on every wider path.
#[test]
fn path_for_stays_within_the_isa_and_follows_the_layouts() {
    for isa in Isa::ALL {
        for batch in 1..=40 {
            for layout in [
                WeightLayout::RowMajor,
                WeightLayout::Tiled,
                WeightLayout::Pairs,
            ] {
                let p = path_for(isa, batch, layout);
                let what = format!("{} batch {batch} {layout:?}", isa.name());
                assert!(p <= isa, "{what}: took {}", p.name());
                if !cfg!(target_arch = "x86_64") {
                    assert_eq!(p, Isa::Portable, "{what}");
                    continue;
                }
                let want = match layout {
                    WeightLayout::Pairs if batch >= 2 => isa.min(Isa::Avx512Bf16),
                    WeightLayout::Pairs => isa.min(Isa::Avx2),
                    WeightLayout::Tiled if isa == Isa::Avx2 => Isa::Portable,
                    WeightLayout::Tiled => isa,
                    WeightLayout::RowMajor if batch <= 2 => isa.min(Isa::Avx2),
                    // AMX tiles from their least batch on, the AVX-512 BF16 path below it.
                    WeightLayout::RowMajor if isa == Isa::AmxBf16 && p == Isa::Avx512Bf16 => {
                        assert!(
                            batch < 16 && path_for(isa, batch - 1, layout) != Isa::AmxBf16,
                            "{what}: tiles at a smaller batch, or none at 16"
                        );
                        p
                    }
                    WeightLayout::RowMajor => isa,
                };
                assert_eq!(p, want, "{what}");
            }
        }
    }
}
