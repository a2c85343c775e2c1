//! int8 GEMM: the quantisers, every W8A8 path bit for bit against an i64 reference loop (and
//! so against each other), and every wide path against an f64 loop, at ragged shapes, tile
//! edges, split-K slices and extreme values, with the weights row-major and packed
//! ([`I8Layout::Packed`]: the same reference, bit for bit). Each test prints the paths it
//! covered.

mod common;

use std::ops::Range;

use common::Rng;
use simpler_kernels_cpu::{
    ActsI8, GemmTile, I8Layout, I8Path, NextRows, OutMode, PACK_K, PACK_ROWS, WeightsI8,
    gemm_i8_w8a8, gemm_i8_w8a8_then, gemm_i8_wide, interleaved_index_i8, pack_weights_i8,
    pack_weights_i8_as, packed_index_i8, quantize_acts_i8, quantize_row_i8, with_i8_path,
};
use simpler_kernels_cpu::{Isa, with_isa};

/// The supported paths, after printing which ran and which this machine lacks.
fn paths(test: &str) -> Vec<I8Path> {
    let (run, skip): (Vec<_>, Vec<_>) = I8Path::ALL.into_iter().partition(|p| p.is_supported());
    let names = |v: &[I8Path]| v.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ");
    println!("{test}: int8 paths covered: {}", names(&run));
    if !skip.is_empty() {
        println!(
            "{test}: skipped (this machine lacks them): {}",
            names(&skip)
        );
    }
    run
}

struct Case {
    n: usize,
    k: usize,
    batch: usize,
    ldw: usize,
    lda: usize,
    w: Vec<i8>,
    sw: Vec<f32>,
    a: Vec<i8>,
    sa: Vec<f32>,
    x: Vec<f32>,
}

/// Values: uniform int8 (weights may be -128, activations not), or only the extremes when
/// `extreme` (the saturation and wrap cases).
fn case(n: usize, k: usize, batch: usize, extreme: bool, seed: u64) -> Case {
    let mut rng = Rng(seed);
    let ldw = k + rng.below(3) * 5;
    let lda = k + rng.below(2) * 7;
    let mut byte = |lo: i32| -> i8 {
        if extreme {
            [lo, 127, lo, 127, 0][rng.below(5)] as i8
        } else {
            (lo + rng.below((128 - lo) as usize) as i32) as i8
        }
    };
    let w = (0..n * ldw).map(|_| byte(-128)).collect();
    let a = (0..batch * lda).map(|_| byte(-127)).collect();
    let sw = rng.vec_f32(n, 0.02);
    let sa = rng.vec_f32(batch, 0.05);
    let x = rng.vec_f32(batch * lda, 2.0);
    Case {
        n,
        k,
        batch,
        ldw,
        lda,
        w,
        sw,
        a,
        sa,
        x,
    }
}

fn reference_w8a8(c: &Case, b: usize, n: usize, k: Range<usize>) -> f32 {
    let s: i64 = k
        .map(|i| i64::from(c.w[n * c.ldw + i]) * i64::from(c.a[b * c.lda + i]))
        .sum();
    // The documented finish: the exact sum, times the weight scale, times the row scale.
    i32::try_from(s).expect("sum in i32") as f32 * c.sw[n] * c.sa[b]
}

/// The case's weights packed, then the same interleaved.
fn packed_of(c: &Case) -> Vec<i8> {
    let nk = c.n * c.k;
    let mut p = vec![0i8; 2 * nk];
    let (packed, interleaved) = p.split_at_mut(nk);
    pack_weights_i8(&c.w, c.n, c.k, c.ldw, packed);
    pack_weights_i8_as(I8Layout::Interleaved, &c.w, c.n, c.k, c.ldw, interleaved);
    p
}

/// The case's weights in `layout` (`packed` as [`packed_of`] makes it).
fn weights<'a>(c: &'a Case, packed: &'a [i8], layout: I8Layout) -> WeightsI8<'a> {
    let nk = c.n * c.k;
    match layout {
        I8Layout::RowMajor => WeightsI8::new(&c.w, &c.sw, c.n, c.k, c.ldw),
        I8Layout::Packed => WeightsI8::packed(&packed[..nk], &c.sw, c.n, c.k),
        I8Layout::Interleaved => WeightsI8::interleaved(&packed[nk..], &c.sw, c.n, c.k),
    }
}

const LAYOUTS: [I8Layout; 3] = [I8Layout::RowMajor, I8Layout::Packed, I8Layout::Interleaved];

fn run_w8a8(
    c: &Case,
    packed: &[i8],
    layout: I8Layout,
    tile: &GemmTile,
    seed_out: &[f32],
    ld: usize,
) -> Vec<f32> {
    let mut out = seed_out.to_vec();
    let w = weights(c, packed, layout);
    let a = ActsI8::new(&c.a, &c.sa, c.batch, c.k, c.lda);
    gemm_i8_w8a8(w, a, tile, &mut out, ld);
    out
}

/// Random tile inside `[n, k]`: whole, or a slice of rows and/or of `k`, stored or added;
/// one of them starting `k` at a multiple of 64 (a packed chunk's start, where the SIMD paths
/// read packed weights) and its rows anywhere (crossing packed groups).
fn tiles(c: &Case, rng: &mut Rng) -> Vec<GemmTile> {
    let mut v = vec![GemmTile {
        n: 0..c.n,
        k: 0..c.k,
        mode: OutMode::Store,
    }];
    let n0 = rng.below(c.n);
    let k0 = rng.below(c.k.div_ceil(PACK_K)) * PACK_K;
    v.push(GemmTile {
        n: n0..n0 + 1 + rng.below(c.n - n0),
        k: k0..k0 + 1 + rng.below(c.k - k0),
        mode: OutMode::Add,
    });
    for _ in 0..2 {
        let n0 = rng.below(c.n);
        let n1 = n0 + 1 + rng.below(c.n - n0);
        let k0 = rng.below(c.k);
        let k1 = k0 + 1 + rng.below(c.k - k0);
        v.push(GemmTile {
            n: n0..n1,
            k: k0..k1,
            mode: if rng.below(2) == 0 {
                OutMode::Add
            } else {
                OutMode::Store
            },
        });
    }
    v
}

fn check_w8a8(c: &Case, paths: &[I8Path], seed: u64) {
    let mut rng = Rng(seed ^ 0x5EED);
    for tile in tiles(c, &mut rng) {
        check_tile(c, paths, tile, &mut rng);
    }
}

/// One tile of `c` on every path and layout against the reference, bit for bit, over an
/// output of random values (a stride of up to two more than the tile's rows).
fn check_tile(c: &Case, paths: &[I8Path], tile: GemmTile, rng: &mut Rng) {
    let packed = packed_of(c);
    let ld = tile.n.len() + rng.below(3);
    let seed_out = rng.vec_f32((c.batch - 1) * ld + tile.n.len(), 1.0);
    let mut expect = seed_out.clone();
    for b in 0..c.batch {
        for n in tile.n.clone() {
            let v = reference_w8a8(c, b, n, tile.k.clone());
            let o = &mut expect[b * ld + n - tile.n.start];
            match tile.mode {
                OutMode::Store => *o = v,
                OutMode::Add => *o += v,
            }
        }
    }
    for &p in paths {
        for layout in LAYOUTS {
            let got = with_i8_path(p, || run_w8a8(c, &packed, layout, &tile, &seed_out, ld))
                .expect("supported");
            for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
                assert!(
                    g.to_bits() == e.to_bits(),
                    "{} {layout:?}: [{} x {}] batch {} tile {tile:?} out[{i}] = {g}, reference {e}",
                    p.name(),
                    c.n,
                    c.k,
                    c.batch
                );
            }
        }
    }
}

#[test]
fn w8a8_every_path_equals_the_reference_bit_for_bit_at_ragged_shapes() {
    let paths = paths("w8a8 ragged");
    let mut seed = 1;
    // Rows around the 3- and 4-row blocks and 16-row tiles; k around the 32/64-byte steps;
    // batches around the 2-, 4- and 8-row blocks (every count up to 9), the AMX minimum and
    // its 16-row groups.
    for n in [1, 2, 3, 4, 5, 6, 7, 15, 16, 17, 32, 33, 49] {
        for k in [1, 31, 32, 33, 64, 65, 127, 200] {
            for batch in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17] {
                seed += 1;
                check_w8a8(&case(n, k, batch, false, seed), &paths, seed);
            }
        }
    }
}

/// Slices longer than the AVX2 path's 1024-byte `k` chunks, at batches that take its chunked
/// sets (5 rows and more: whole sets of 8, a set of 8 and a remainder, ragged sets) and the
/// ones that do not (its far-apart row streams at 2–4, with rows left over after whole
/// streams): every path equals the reference bit for bit, with and without a scalar tail,
/// tiles starting and ending inside chunks.
#[test]
fn w8a8_long_slices_across_chunks_equal_the_reference_bit_for_bit() {
    let paths = paths("w8a8 long slices");
    let mut seed = 9000;
    for n in [1, 4, 5, 9, 13] {
        for k in [1024, 1057, 2048 + 64, 3001] {
            for batch in [2, 3, 4, 5, 7, 8, 9, 16, 17] {
                seed += 1;
                check_w8a8(&case(n, k, batch, false, seed), &paths, seed);
            }
        }
    }
}

/// Whole tiles with `k` a whole number of 32-byte steps (the AVX2 path's vector finish, no
/// scalar tail) at the decode batch of 8 (whole sets) and at 5, 7 and 13 rows (partial sets,
/// alone and after a whole one), stored and added over far-apart row streams of 8 to 25
/// blocks and rows left over (the random tiles of the other tests rarely add over a whole
/// set).
#[test]
fn w8a8_whole_and_partial_sets_stored_and_added_equal_the_reference_bit_for_bit() {
    let paths = paths("w8a8 whole and partial sets");
    let mut seed = 9500;
    for (n, batch) in [32, 33, 64, 70, 100]
        .into_iter()
        .flat_map(|n| [5, 7, 8, 13].map(|b| (n, b)))
    {
        for k in [32, 1024, 2048] {
            seed += 1;
            let c = case(n, k, batch, false, seed);
            let mut rng = Rng(seed);
            for mode in [OutMode::Store, OutMode::Add] {
                let tile = GemmTile {
                    n: 0..n,
                    k: 0..k,
                    mode,
                };
                check_tile(&c, &paths, tile, &mut rng);
            }
        }
    }
}

/// Tiles of the AVX2 sets whose staged outputs pass what a thread keeps between calls
/// (8 rows × 66 000 columns), stay under it at another width (8 × 4 000), and are narrow
/// (8 × 70), added and stored in turn: every path equals the reference bit for bit, so a
/// staging buffer given back after a wide call, or reused at another width with what an
/// earlier call left in it, leaves nothing behind.
#[test]
fn w8a8_sets_wider_than_the_kept_staging_then_narrow_equal_the_reference() {
    let paths = paths("w8a8 wide then narrow sets");
    let wide = case(66_000, 64, 8, false, 9700);
    let mid = case(4_000, 64, 8, false, 9703);
    let narrow = case(70, 1024, 8, false, 9701);
    let mut rng = Rng(9702);
    for (c, mode) in [
        (&wide, OutMode::Add),
        (&narrow, OutMode::Add),
        (&wide, OutMode::Store),
        (&mid, OutMode::Store),
        (&narrow, OutMode::Store),
        (&mid, OutMode::Add),
    ] {
        let tile = GemmTile {
            n: 0..c.n,
            k: 0..c.k,
            mode,
        };
        check_tile(c, &paths, tile, &mut rng);
    }
}

/// Products whose activations, widened to 16 bits by the AVX2 sets, pass what a thread keeps
/// between calls (21 rows × 32 785 values: two sets of 8 and a ragged one of 5, a scalar
/// tail), then stay under it at another shape (9 × 4 096: a set of 8 and one of 1) and are
/// small (5 × 96): every path equals the reference bit for bit, so a widened buffer given
/// back after a large call, or reused with what an earlier call left in it, leaves nothing
/// behind.
#[test]
fn w8a8_sets_with_more_activations_than_kept_then_fewer_equal_the_reference() {
    let paths = paths("w8a8 large then small widened activations");
    let large = case(13, 32_768 + 17, 21, false, 9710);
    let mid = case(21, 4_096, 9, false, 9711);
    let small = case(11, 96, 5, false, 9712);
    let mut rng = Rng(9713);
    for c in [&large, &small, &mid, &large, &mid, &small] {
        for mode in [OutMode::Store, OutMode::Add] {
            let tile = GemmTile {
                n: 0..c.n,
                k: 0..c.k,
                mode,
            };
            check_tile(c, &paths, tile, &mut rng);
        }
    }
}

/// Grouped activations ([`ActsI8::grouped`]): every path, for tiles whose `k` starts, ends
/// and crosses group boundaries anywhere, equals the reference summing each group's part
/// exactly, scaling it by that group's factor and adding the parts in `k` order, the first
/// stored or added as the tile says (one product per group with that group's scales).
#[test]
fn w8a8_grouped_every_path_equals_the_per_group_reference_bit_for_bit() {
    let paths = paths("w8a8 grouped");
    let mut seed = 5000;
    for (n, groups, span) in [
        (1, 2, 1),
        (3, 2, 33),
        (4, 3, 64),
        (7, 8, 32),
        (17, 5, 65),
        (33, 4, 100),
        (33, 3, 40),
        (20, 2, 200),
        (49, 8, 128),
        (9, 3, 1100),
        // Groups of exactly one AVX2 chunk (DeepSeek-V4's `wo_b`): each segment's prefetch
        // runs into the next segment of the same rows.
        (9, 4, 1024),
    ] {
        for batch in [1, 2, 3, 4, 5, 8, 9, 16] {
            seed += 1;
            let k = groups * span;
            let c = case(n, k, batch, false, seed);
            let packed = packed_of(&c);
            let mut rng = Rng(seed ^ 0x6A0);
            let gs = rng.vec_f32(batch * groups, 0.05);
            for tile in tiles(&c, &mut rng) {
                let ld = tile.n.len() + rng.below(3);
                let seed_out = rng.vec_f32((batch - 1) * ld + tile.n.len(), 1.0);
                let mut expect = seed_out.clone();
                for b in 0..batch {
                    for nn in tile.n.clone() {
                        let o = &mut expect[b * ld + nn - tile.n.start];
                        let mut k0 = tile.k.start;
                        while k0 < tile.k.end {
                            let g = k0 / span;
                            let k1 = ((g + 1) * span).min(tile.k.end);
                            let s: i64 = (k0..k1)
                                .map(|i| {
                                    i64::from(c.w[nn * c.ldw + i]) * i64::from(c.a[b * c.lda + i])
                                })
                                .sum();
                            let v = i32::try_from(s).expect("sum in i32") as f32
                                * c.sw[nn]
                                * gs[b * groups + g];
                            if k0 == tile.k.start && tile.mode == OutMode::Store {
                                *o = v;
                            } else {
                                *o += v;
                            }
                            k0 = k1;
                        }
                    }
                }
                for (&p, layout) in paths.iter().flat_map(|p| LAYOUTS.map(|l| (p, l))) {
                    let mut got = seed_out.clone();
                    with_i8_path(p, || {
                        let w = weights(&c, &packed, layout);
                        let a = ActsI8::grouped(&c.a, &gs, batch, k, c.lda, groups);
                        gemm_i8_w8a8(w, a, &tile, &mut got, ld);
                    })
                    .expect("supported");
                    for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
                        assert!(
                            g.to_bits() == e.to_bits(),
                            "{} {layout:?}: [{n} x {k}] in {groups} groups, batch {batch}, \
                             tile {tile:?} out[{i}] = {g}, reference {e}",
                            p.name()
                        );
                    }
                }
            }
        }
    }
}

/// Packing is a permutation of the `N * K` values that puts `(n, k)` where
/// `packed_index_i8` says: 16-row groups, 64-byte chunks, the last group and chunk shrunk.
#[test]
fn packing_puts_every_value_at_its_documented_index() {
    for (n, k) in [
        (1, 1),
        (16, 64),
        (17, 65),
        (33, 200),
        (5, 130),
        (48, 128),
        (50, 63),
    ] {
        let c = case(n, k, 1, false, 9000 + (n * k) as u64);
        let both = packed_of(&c);
        let (packed, interleaved) = both.split_at(n * k);
        let mut seen = vec![false; n * k];
        let mut seen_i = vec![false; n * k];
        for r in 0..n {
            for col in 0..k {
                let i = packed_index_i8(n, k, r, col);
                assert!(!seen[i], "[{n} x {k}]: index {i} twice");
                seen[i] = true;
                assert_eq!(packed[i], c.w[r * c.ldw + col], "[{n} x {k}] ({r}, {col})");
                let i = interleaved_index_i8(n, k, r, col);
                assert!(!seen_i[i], "[{n} x {k}] interleaved: index {i} twice");
                seen_i[i] = true;
                assert_eq!(
                    interleaved[i],
                    c.w[r * c.ldw + col],
                    "[{n} x {k}] ({r}, {col})"
                );
            }
        }
        // A whole group's quad is one 64-byte line: row r of quad q at 64 q + 4 r.
        if n >= PACK_ROWS && k >= 8 {
            assert_eq!(interleaved_index_i8(n, k, 3, 4 + 2), 64 + 3 * 4 + 2);
        }
        // A whole group and chunk is one 1 KiB block: row r of chunk c at 1024 c + 64 r.
        if n >= PACK_ROWS && k >= 2 * PACK_K {
            assert_eq!(
                packed_index_i8(n, k, 3, PACK_K + 5),
                PACK_K * PACK_ROWS + 3 * 64 + 5
            );
        }
    }
}

/// Views of row ranges of packed weights (starting inside, at and across 16-row groups)
/// give the same bits as the same views of the row-major weights, on every path.
#[test]
fn packed_row_range_views_equal_row_major_views() {
    let paths = paths("w8a8 packed views");
    let mut seed = 7000;
    for (n, k) in [(50, 256), (70, 200), (40, 64)] {
        for batch in [1, 3, 4, 8, 16] {
            seed += 1;
            let c = case(n, k, batch, false, seed);
            let packed = packed_of(&c);
            for rows in [0..n, 3..n, 16..48.min(n), 17..40, 5..21, 32..n] {
                let tile = GemmTile {
                    n: 0..rows.len(),
                    k: 0..k,
                    mode: OutMode::Store,
                };
                let a = ActsI8::new(&c.a, &c.sa, batch, k, c.lda);
                for &p in &paths {
                    let run = |layout| {
                        let mut out = vec![0.0f32; batch * rows.len()];
                        let w = weights(&c, &packed, layout).rows_range(rows.clone());
                        with_i8_path(p, || gemm_i8_w8a8(w, a, &tile, &mut out, rows.len()))
                            .expect("supported");
                        out
                    };
                    let rm = run(I8Layout::RowMajor);
                    for layout in [I8Layout::Packed, I8Layout::Interleaved] {
                        let pk = run(layout);
                        assert!(
                            rm.iter().zip(&pk).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{}: [{n} x {k}] batch {batch} rows {rows:?}: {} view differs",
                            p.name(),
                            layout.name()
                        );
                    }
                }
            }
        }
    }
}

/// The wide product on one row of `w` (which it refuses unless row-major).
fn wide_on(w: WeightsI8<'_>) {
    let x = vec![0.0f32; 8];
    let tile = GemmTile {
        n: 0..4,
        k: 0..8,
        mode: OutMode::Store,
    };
    let mut out = vec![0.0f32; 4];
    gemm_i8_wide(w, &x, 1, 8, None, &tile, &mut out, 4);
}

#[test]
#[should_panic(expected = "packed int8 weights are not supported")]
fn wide_product_refuses_packed_weights() {
    wide_on(WeightsI8::packed(&[0i8; 32], &[1.0f32; 4], 4, 8));
}

#[test]
#[should_panic(expected = "interleaved int8 weights are not supported")]
fn wide_product_refuses_interleaved_weights() {
    wide_on(WeightsI8::interleaved(&[0i8; 32], &[1.0f32; 4], 4, 8));
}

/// Bytes after a packed or interleaved matrix (a buffer larger than the matrix) are never
/// read.
#[test]
fn packed_weights_ignore_bytes_after_the_matrix() {
    let paths = paths("w8a8 packed trailing bytes");
    let c = case(33, 130, 5, false, 4242);
    let both = packed_of(&c);
    let tile = GemmTile {
        n: 0..33,
        k: 0..130,
        mode: OutMode::Store,
    };
    let a = ActsI8::new(&c.a, &c.sa, 5, 130, c.lda);
    for (layout, values) in [
        (I8Layout::Packed, &both[..33 * 130]),
        (I8Layout::Interleaved, &both[33 * 130..]),
    ] {
        let mut longer = values.to_vec();
        longer.extend([127i8; 70]);
        for &p in &paths {
            let run = |data: &[i8]| {
                let mut out = vec![0.0f32; 5 * 33];
                let w = WeightsI8::with_layout(data, &c.sw, 33, 130, layout);
                with_i8_path(p, || gemm_i8_w8a8(w, a, &tile, &mut out, 33)).expect("supported");
                out
            };
            assert_eq!(run(values), run(&longer), "{} {}", p.name(), layout.name());
        }
    }
}

#[test]
#[should_panic(expected = "packed int8 weights: 31 bytes for [4, 8]")]
fn packed_weights_refuse_a_wrong_length() {
    let w = vec![0i8; 31];
    let sw = vec![1.0f32; 4];
    let _ = WeightsI8::packed(&w, &sw, 4, 8);
}

#[test]
#[should_panic(expected = "equal groups")]
fn grouped_activations_refuse_groups_that_do_not_divide_k() {
    let q = vec![0i8; 10];
    let s = vec![1.0f32; 3];
    let _ = ActsI8::grouped(&q, &s, 1, 10, 10, 3);
}

/// A group count whose product with the rows wraps to the scales' length is refused by the
/// scales check (not later, by an index).
#[test]
#[should_panic(expected = "2 scales for 2 rows of 9223372036854775809 groups")]
fn grouped_activations_refuse_a_scale_count_that_only_a_wrapped_product_matches() {
    let s = vec![1.0f32; 2];
    let _ = ActsI8::grouped(&[], &s, 2, 0, 0, (1 << 63) + 1);
}

#[test]
fn w8a8_extreme_values_neither_saturate_nor_wrap() {
    let paths = paths("w8a8 extremes");
    for (i, &(n, k, batch)) in [
        (16, 1024, 1),
        (33, 4096, 3),
        (17, 2048, 4),
        (33, 4096, 5),
        (35, 4096, 8),
        (32, 256, 16),
    ]
    .iter()
    .enumerate()
    {
        check_w8a8(
            &case(n, k, batch, true, 100 + i as u64),
            &paths,
            7 + i as u64,
        );
    }
}

#[test]
fn w8a8_at_the_largest_k_keeps_the_exact_sum() {
    let paths = paths("w8a8 max k");
    // Every product at its largest (127 * 127 and 127 * -128): the sum is near i32::MAX, the
    // +128 offset sum of the VNNI paths wraps and must cancel.
    let k = simpler_kernels_cpu::gemm_i8::MAX_K;
    for (wv, av) in [(127i8, 127i8), (-128, -127), (-128, 127)] {
        let (n, batch) = (16, 4);
        let c = Case {
            n,
            k,
            batch,
            ldw: k,
            lda: k,
            w: vec![wv; n * k],
            sw: vec![1.0; n],
            a: vec![av; batch * k],
            sa: vec![1.0; batch],
            x: Vec::new(),
        };
        let expect = (i64::from(wv) * i64::from(av) * k as i64) as f32;
        let tile = GemmTile {
            n: 0..n,
            k: 0..k,
            mode: OutMode::Store,
        };
        let packed = packed_of(&c);
        for (&p, layout) in paths.iter().flat_map(|p| LAYOUTS.map(|l| (p, l))) {
            let zero = vec![0.0; batch * n];
            let got = with_i8_path(p, || run_w8a8(&c, &packed, layout, &tile, &zero, n)).unwrap();
            assert!(
                got.iter().all(|&g| g == expect),
                "{} {layout:?}: {wv} x {av}: {:?} != {expect}",
                p.name(),
                &got[..4]
            );
        }
    }
}

#[test]
#[allow(clippy::needless_range_loop)] // (b, n) index several arrays at once
fn wide_every_path_matches_an_f64_loop() {
    let paths = paths("wide");
    let mut seed = 1000;
    // Rows around the far-apart streams (2, 3 and 4 of them, rows left over); `k` around the
    // 8-element steps and the assembly loop's 64; batches around the groups of 4 batch rows
    // (a last group of 1, 2 or 3).
    for n in [1, 4, 5, 17, 33] {
        for k in [1, 7, 8, 16, 17, 64, 100, 1024] {
            for batch in [1, 2, 3, 4, 5, 6, 7, 16] {
                seed += 1;
                let c = case(n, k, batch, false, seed);
                let mut rng = Rng(seed);
                let row_scale = rng.vec_f32(batch, 2.0);
                for tile in tiles(&c, &mut rng) {
                    let ld = tile.n.len() + 1;
                    let seed_out = rng.vec_f32((batch - 1) * ld + tile.n.len(), 1.0);
                    for &p in &paths {
                        let mut out = seed_out.clone();
                        with_i8_path(p, || {
                            let w = WeightsI8::new(&c.w, &c.sw, n, k, c.ldw);
                            gemm_i8_wide(
                                w,
                                &c.x,
                                batch,
                                c.lda,
                                Some(&row_scale),
                                &tile,
                                &mut out,
                                ld,
                            )
                        })
                        .unwrap();
                        for b in 0..batch {
                            for nn in tile.n.clone() {
                                let (mut s, mut mag) = (0.0f64, 0.0f64);
                                for i in tile.k.clone() {
                                    let t = f64::from(c.w[nn * c.ldw + i])
                                        * f64::from(c.x[b * c.lda + i]);
                                    s += t;
                                    mag += t.abs();
                                }
                                let f = f64::from(c.sw[nn]) * f64::from(row_scale[b]);
                                let at = b * ld + nn - tile.n.start;
                                let base = if tile.mode == OutMode::Add {
                                    f64::from(seed_out[at])
                                } else {
                                    0.0
                                };
                                let e = base + s * f;
                                let tol = mag * f.abs() * 1e-5 + 1e-6;
                                let g = f64::from(out[at]);
                                assert!(
                                    (g - e).abs() <= tol,
                                    "{}: [{n} x {k}] b{batch} {tile:?} ({b}, {nn}): {g} vs {e}",
                                    p.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn quantised_rows_round_trip_within_half_a_step() {
    let mut rng = Rng(42);
    for len in [1, 5, 64, 1000] {
        let x = rng.vec_f32(len, 3.0);
        let mut q = vec![0i8; len];
        let s = quantize_row_i8(&x, &mut q);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(s, amax / 127.0);
        assert!(q.iter().all(|&v| v != i8::MIN));
        assert!(
            q.iter().any(|&v| v.unsigned_abs() == 127),
            "the largest value maps to +-127"
        );
        for (v, qv) in x.iter().zip(&q) {
            assert!(
                (v - f32::from(*qv) * s).abs() <= s * 0.5 + 1e-6,
                "{v} -> {qv} * {s}"
            );
        }
    }
    let mut q = vec![5i8; 4];
    assert_eq!(quantize_row_i8(&[0.0; 4], &mut q), 0.0);
    assert_eq!(q, [0; 4]);
}

#[test]
fn quantised_activations_fold_the_row_factor_into_the_scale() {
    let mut rng = Rng(9);
    let (rows, cols, ldx, ldq) = (3, 40, 45, 48);
    let x = rng.vec_f32(rows * ldx, 1.0);
    let r = [0.5f32, 2.0, -1.0];
    let (mut q, mut s) = (vec![0i8; rows * ldq], vec![0.0f32; rows]);
    quantize_acts_i8(&x, rows, cols, ldx, Some(&r), &mut q, ldq, &mut s);
    for b in 0..rows {
        let mut qq = vec![0i8; cols];
        let s0 = quantize_row_i8(&x[b * ldx..b * ldx + cols], &mut qq);
        assert_eq!(&q[b * ldq..b * ldq + cols], &qq[..]);
        assert_eq!(s[b], s0 * r[b]);
    }
}

#[test]
#[should_panic(expected = "holds -128")]
fn activations_holding_minus_128_are_refused() {
    let a = [0i8, -128];
    let _ = ActsI8::new(&a, &[1.0], 1, 2, 2);
}

/// `-128` is found wherever it lies in a row (the 32-lane body or the tail) and in whichever
/// row, while the bytes between rows (past `cols`, before the next row's stride) are not read.
#[test]
fn minus_128_is_found_anywhere_and_only_inside_rows() {
    let (rows, cols, ld) = (3, 100, 107);
    let clean: Vec<i8> = (0..rows * ld)
        .map(|i| {
            if i % ld >= cols {
                i8::MIN
            } else {
                ((i % 255) as i32 - 127) as i8
            }
        })
        .collect();
    let scales = [1.0f32; 3];
    assert_eq!(ActsI8::new(&clean, &scales, rows, cols, ld).rows(), rows);
    for b in 0..rows {
        for k in [0, 31, 32, 63, 95, 96, 99] {
            let mut bad = clean.clone();
            bad[b * ld + k] = i8::MIN;
            let refused = std::panic::catch_unwind(|| ActsI8::new(&bad, &scales, rows, cols, ld));
            assert!(refused.is_err(), "-128 at row {b} column {k} was accepted");
        }
    }
}

/// The rows a caller streams next ([`NextRows`]) are a prefetch hint only: with any next
/// weights (another shape, the other layout, a first row inside, at the end of or past their
/// rows) every path gives the reference's bits, on whole tiles and row views whose last
/// blocks are whole or single rows.
#[test]
fn next_rows_hint_never_changes_results() {
    let paths = paths("w8a8 next rows");
    let mut seed = 9100;
    let other = case(37, 300, 2, false, 9099);
    let other_packed = packed_of(&other);
    for (n, k) in [(64, 4096), (50, 256), (7, 200), (67, 130)] {
        for batch in [1, 2, 3, 4, 8] {
            seed += 1;
            let c = case(n, k, batch, false, seed);
            let packed = packed_of(&c);
            let a = ActsI8::new(&c.a, &c.sa, batch, k, c.lda);
            for rows in [0..n, 1..n, 0..n - 1, n / 2..n] {
                let tile = GemmTile {
                    n: 0..rows.len(),
                    k: 0..k,
                    mode: OutMode::Store,
                };
                let want: Vec<f32> = (0..batch)
                    .flat_map(|b| rows.clone().map(move |r| (b, r)))
                    .map(|(b, r)| reference_w8a8(&c, b, r, 0..k))
                    .collect();
                for &p in &paths {
                    for layout in LAYOUTS {
                        let nexts = [
                            NextRows::new(weights(&c, &packed, layout), 0),
                            NextRows::new(weights(&c, &packed, layout), n - 1),
                            NextRows::new(weights(&c, &packed, layout), n + 5),
                            NextRows::new(weights(&other, &other_packed, I8Layout::Packed), 30),
                            NextRows::new(
                                weights(&other, &other_packed, I8Layout::Interleaved),
                                17,
                            ),
                            NextRows::new(weights(&other, &other_packed, I8Layout::RowMajor), 0),
                        ];
                        for next in nexts {
                            let mut out = vec![0.0f32; batch * rows.len()];
                            let w = weights(&c, &packed, layout).rows_range(rows.clone());
                            with_i8_path(p, || {
                                gemm_i8_w8a8_then(w, a, &tile, &mut out, rows.len(), Some(next))
                            })
                            .expect("supported");
                            assert!(
                                out.iter()
                                    .zip(&want)
                                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{}: [{n} x {k}] batch {batch} rows {rows:?} {layout:?} \
                                 next {next:?}: differs from the reference",
                                p.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Capping the bf16 path caps the int8 products with it: a thread (or process) standing in for
/// a machine without AMX runs no AMX-INT8 tiles, one standing in for an AVX2 machine no VNNI,
/// the portable path plain loops; at this machine's own path nothing is capped; and an
/// explicit int8 path still wins over the cap.
#[test]
fn the_int8_path_follows_the_bf16_path_cap() {
    let hw = I8Path::hardware();
    for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
        let p = with_isa(isa, I8Path::current).expect("a supported path");
        println!(
            "with_isa({}) -> int8 path {} (hardware {})",
            isa.name(),
            p.name(),
            hw.name()
        );
        assert!(p.is_supported());
        assert!(p <= hw);
        if isa == Isa::hardware() {
            assert_eq!(p, hw, "at this machine's own path nothing is capped");
            continue;
        }
        let top = match isa {
            Isa::Portable => I8Path::Portable,
            Isa::Avx2 => I8Path::Avx2,
            Isa::Avx512Bf16 => I8Path::Avx512Vnni,
            Isa::AmxBf16 => unreachable!("AMX-BF16 is the top path, so it is this machine's"),
        };
        assert_eq!(p, hw.min(top), "with_isa({}) runs {}", isa.name(), p.name());
        // An explicit int8 path is taken as asked, whatever the cap.
        let asked = with_isa(isa, || with_i8_path(hw, I8Path::current)).unwrap();
        assert_eq!(asked, Some(hw));
    }
    // Without an override the thread's path is the process's.
    assert_eq!(I8Path::current(), hw.capped(Isa::current()));
    assert_eq!(I8Path::detected(), hw.capped(Isa::detected()));
}
