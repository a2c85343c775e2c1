//! The paired bf16 weight layout (8-row groups of interleaved `K` pairs): packing, indexing,
//! and the GEMM on paired weights on every path this CPU has, against an f64 reference at
//! ragged shapes (rows not whole groups, `K` not whole packing blocks, split-K tiles, every
//! batch from 1 to 9 and runs of several batch groups), and bit for bit against the portable path on row-major weights where
//! the paired call runs that same code (the portable path gathers paired rows).

mod common;

use common::{GemmCase, Rng, all_paths};
use proptest::prelude::*;
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PAIR_ROWS, WeightLayout, gemm_bf16, pair_rows_bf16_into,
    pair_weights_bf16, paired_weights_pay, pairs_index, pairs_len, with_isa,
};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Paired results of `tile` on every path against the f64 reference (and, on the portable
/// path, bit for bit against the row-major result); padding between output rows untouched.
fn check(c: &GemmCase, tile: GemmTile, scaled: bool, seed: u64) {
    let mut rng = Rng(seed ^ 0x9A1F);
    let ld = tile.n.len() + rng.below(3);
    let out_len = (c.batch - 1) * ld + tile.n.len();
    let seed_out = rng.vec_f32(out_len, 1.0);
    let scale = rng.vec_f32(c.batch, 2.0);
    let scale = scaled.then_some(&scale[..]);
    for (isa, got) in all_paths("gemm paired", || {
        c.run(WeightLayout::Pairs, &tile, scale, &seed_out, ld)
    }) {
        if isa == Isa::Portable {
            let want = with_isa(Isa::Portable, || {
                c.run(WeightLayout::RowMajor, &tile, scale, &seed_out, ld)
            })
            .expect("portable runs");
            assert_eq!(
                bits(&got),
                bits(&want),
                "portable paired vs row-major {tile:?}"
            );
        }
        c.assert_reference(
            &tile,
            scale,
            &seed_out,
            ld,
            &got,
            &format!("{} paired", isa.name()),
        );
    }
}

#[test]
fn pairs_index_places_every_element_once_and_padding_is_zero() {
    for (rows, cols) in [
        (1usize, 1usize),
        (8, 2),
        (9, 3),
        (5, 100),
        (40, 64),
        (33, 1001),
    ] {
        let len = pairs_len(rows, cols).unwrap();
        assert_eq!(len, rows.div_ceil(8) * 8 * cols.div_ceil(2) * 2);
        common::assert_layout_places_every_element(
            WeightLayout::Pairs,
            rows,
            cols,
            len,
            pairs_index,
        );
    }
    // One 32-byte pair holds eight rows at k and k + 1, row by row; a group is contiguous.
    assert_eq!(pairs_index(0, 1, 64), 1);
    assert_eq!(pairs_index(1, 0, 64), 2);
    assert_eq!(pairs_index(0, 2, 64), 2 * PAIR_ROWS);
    assert_eq!(pairs_index(8, 0, 64), 8 * 64);
    assert_eq!(pairs_len(usize::MAX, 2), None);
    assert!(paired_weights_pay(Isa::Avx2));
    assert!(paired_weights_pay(Isa::Avx512Bf16));
    assert!(!paired_weights_pay(Isa::Portable));
    assert!(!paired_weights_pay(Isa::AmxBf16));
}

/// Pairing into a caller's buffer (a transpose per 8-row group and 16 columns where the path
/// has AVX2) writes exactly what `pair_weights_bf16` does, padding included, over a buffer
/// that held other values.
#[test]
fn pairing_into_a_buffer_matches_pair_weights_on_every_path() {
    let mut rng = Rng(31);
    for (rows, cols) in [
        (1usize, 16usize),
        (7, 32),
        (8, 48),
        (9, 512),
        (33, 64),
        (5, 100),
        (3, 2),
    ] {
        let w: Vec<half::bf16> = rng
            .vec_f32(rows * cols, 1.0)
            .into_iter()
            .map(half::bf16::from_f32)
            .collect();
        let want = pair_weights_bf16(&w, rows, cols);
        for (isa, got) in all_paths("pair_rows_bf16_into", || {
            let mut out = vec![half::bf16::from_f32(7.0); pairs_len(rows, cols).unwrap()];
            pair_rows_bf16_into(&w, rows, cols, &mut out);
            out
        }) {
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} {rows}x{cols}",
                isa.name()
            );
        }
    }
}

#[test]
fn paired_products_match_the_reference_at_edges_and_every_batch() {
    let mut seed = 1;
    for (n, k) in [
        (24usize, 64usize),
        (25, 48),
        (7, 16),
        (72, 1024),
        (97, 33),
        (40, 17),
    ] {
        // 17, 20 and 25 batch rows: two and more runs of eight on the AVX-512 BF16 path, with
        // every prefetch share and a short last run.
        for batch in (1..=9).chain([12, 16, 17, 20, 25]) {
            let c = GemmCase::new(n, k, batch, seed);
            seed += 1;
            check(
                &c,
                GemmTile::full(&c.weights(WeightLayout::Pairs)),
                false,
                seed,
            );
            // A tile from a later group, split-K with edge elements, added and scaled.
            if n > 8 {
                let tile = GemmTile {
                    n: 8..n,
                    k: 3.min(k - 1)..k,
                    mode: OutMode::Add,
                };
                check(&c, tile, true, seed);
            }
        }
    }
}

#[test]
fn a_paired_row_range_computes_those_rows_of_the_whole() {
    let (n, k, batch) = (70, 96, 6);
    let c = GemmCase::new(n, k, batch, 3);
    let whole = c.weights(WeightLayout::Pairs);
    let mut full = vec![0.0f32; batch * n];
    gemm_bf16(whole, c.acts(), &GemmTile::full(&whole), &mut full, n);
    for r in [8..70, 32..48, 64..70, 0..5] {
        let part = whole.row_range(r.clone());
        assert_eq!(part.layout(), WeightLayout::Pairs);
        let mut out = vec![0.0f32; batch * r.len()];
        gemm_bf16(part, c.acts(), &GemmTile::full(&part), &mut out, r.len());
        for b in 0..batch {
            let (got, want) = (
                &out[b * r.len()..(b + 1) * r.len()],
                &full[b * n + r.start..b * n + r.end],
            );
            common::assert_close(got, want, 1e-5, 1e-5, &format!("rows {r:?} batch {b}"));
        }
    }
}

#[test]
#[should_panic(expected = "does not start on a group")]
fn a_paired_row_range_off_a_group_edge_panics() {
    let c = GemmCase::new(40, 64, 1, 1);
    let _ = c.weights(WeightLayout::Pairs).row_range(4..20);
}

#[test]
#[should_panic(expected = "must start on a multiple")]
fn a_paired_tile_off_a_group_edge_panics() {
    let c = GemmCase::new(40, 64, 2, 1);
    let tile = GemmTile {
        n: 4..40,
        k: 0..64,
        mode: OutMode::Store,
    };
    let mut out = vec![0.0; 2 * 36];
    gemm_bf16(
        c.weights(WeightLayout::Pairs),
        c.acts(),
        &tile,
        &mut out,
        36,
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Random shapes, tiles and batches on paired weights against the reference.
    #[test]
    fn paired_products_at_random_shapes(
        n in 1usize..90,
        k in 1usize..300,
        batch in 1usize..22,
        g0 in 0usize..10,
        k0 in 0usize..40,
        add in any::<bool>(),
        scaled in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let c = GemmCase::new(n, k, batch, seed);
        let start = (g0 * PAIR_ROWS).min((n - 1) / PAIR_ROWS * PAIR_ROWS);
        let k0 = k0.min(k - 1);
        let tile = GemmTile {
            n: start..n,
            k: k0..k,
            mode: if add { OutMode::Add } else { OutMode::Store },
        };
        check(&c, tile, scaled, seed);
    }
}

/// An embedding row gathered from a paired table (a tied LM head) is the row-major row, and
/// the layout's own conversions round-trip.
#[test]
fn paired_tables_gather_and_convert_like_row_major_ones() {
    let (vocab, hidden) = (40usize, 96usize);
    let w = Rng(5).vec_bf16(vocab * hidden, 1.0);
    let paired = WeightLayout::Pairs.arrange_bf16(&w, vocab, hidden);
    assert_eq!(paired, pair_weights_bf16(&w, vocab, hidden));
    assert_eq!(
        WeightLayout::Pairs.row_major_bf16(&paired, vocab, hidden),
        w
    );
    let ids = [0u32, 39, 7, 8, 7];
    let mut want = vec![0.0f32; ids.len() * hidden];
    let mut got = vec![1.0f32; ids.len() * hidden];
    simpler_kernels_cpu::embedding_gather_rows_bf16(
        simpler_kernels_cpu::WeightsBf16::new(&w, vocab, hidden),
        &ids,
        &mut want,
    );
    simpler_kernels_cpu::embedding_gather_rows_bf16(
        simpler_kernels_cpu::WeightsBf16::paired(&paired, vocab, hidden),
        &ids,
        &mut got,
    );
    assert_eq!(bits(&got), bits(&want));
}

/// Where the AVX-512 BF16 paired kernel prefetches a pass's next groups (into L1 at 2–4 full
/// runs of eight batch rows by default, or L2) changes only where the prefetches go: the same
/// bits both ways at one run, at 2–4 runs (a last run short or whole) and past them, on tiles of
/// whole passes and of groups left over, `K` off the packing blocks and tiles starting
/// mid-matrix; and within the reference's bound.
#[test]
fn paired_l1_prefetch_changes_no_bits() {
    use simpler_kernels_cpu::gemm::set_paired_l1_prefetch;
    let mut seed = 91;
    for batch in [8usize, 9, 16, 21, 24, 32, 33] {
        for (n, k) in [(200usize, 1000usize), (24, 72), (61, 530)] {
            let c = GemmCase::new(n, k, batch, (n * k + batch) as u64 + 11);
            let w = c.weights(WeightLayout::Pairs);
            let mid = GemmTile {
                n: 8..n,
                k: 3..k - 5,
                mode: OutMode::Add,
            };
            for tile in [GemmTile::full(&w), mid] {
                let ld = tile.n.len() + 1;
                let seed_out = Rng(seed).vec_f32((batch - 1) * ld + tile.n.len(), 1.0);
                let run = |on: bool| {
                    all_paths("gemm paired prefetch", || {
                        set_paired_l1_prefetch(on);
                        let out = c.run(WeightLayout::Pairs, &tile, None, &seed_out, ld);
                        set_paired_l1_prefetch(true);
                        out
                    })
                };
                let (off, on) = (run(false), run(true));
                for ((path, a), (_, b)) in off.iter().zip(&on) {
                    assert_eq!(
                        bits(a),
                        bits(b),
                        "{} batch {batch} [{n}, {k}] {tile:?}: the L1 prefetch changed bits",
                        path.name()
                    );
                }
                check(&c, tile, false, seed);
                seed += 1;
            }
        }
    }
}

/// How a paired tile's groups are gathered into passes (three or six streams, the groups left
/// over in passes of three, two or one) changes no bits: each output's sum runs over `K` in the
/// same order in one lane whatever its neighbours, so a tile equals its groups computed one
/// tile each, on every path, at group counts that leave every remainder and at batches of one
/// to several runs.
#[test]
fn a_paired_tile_is_its_groups_bit_for_bit() {
    let mut seed = 77;
    for groups in 1..=14usize {
        let n = groups * PAIR_ROWS;
        for batch in [2usize, 3, 4, 8, 16, 17] {
            let c = GemmCase::new(n, 64, batch, seed);
            seed += 1;
            let whole = GemmTile::full(&c.weights(WeightLayout::Pairs));
            let zero = vec![0.0f32; batch * n];
            for (isa, got) in all_paths("paired tile by groups", || {
                c.run(WeightLayout::Pairs, &whole, None, &zero, n)
            }) {
                let by_group = with_isa(isa, || {
                    let mut out = vec![0.0f32; batch * n];
                    for g in 0..groups {
                        let tile = GemmTile {
                            n: g * PAIR_ROWS..(g + 1) * PAIR_ROWS,
                            k: 0..64,
                            mode: OutMode::Store,
                        };
                        let mut part = vec![0.0f32; batch * PAIR_ROWS];
                        gemm_bf16(
                            c.weights(WeightLayout::Pairs),
                            c.acts(),
                            &tile,
                            &mut part,
                            PAIR_ROWS,
                        );
                        for b in 0..batch {
                            out[b * n + g * PAIR_ROWS..][..PAIR_ROWS]
                                .copy_from_slice(&part[b * PAIR_ROWS..][..PAIR_ROWS]);
                        }
                    }
                    out
                })
                .expect("the path ran the whole tile");
                assert_eq!(
                    bits(&got),
                    bits(&by_group),
                    "{} {groups} groups batch {batch}",
                    isa.name()
                );
            }
        }
    }
}
