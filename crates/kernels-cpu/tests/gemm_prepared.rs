//! `gemm_bf16_prepared` against `gemm_bf16` on the same activations, bit for bit, on every
//! path: whole-`K` tiles (the prepared AMX tiles are used), partial `K` and split-`K` adds
//! (they are not), batches around the AMX path's smallest batch and its 32-row blocks, `K`
//! with and without a 16-element strip and an edge, and one preparation reused for several
//! weight matrices; the same with the activations prepared from fp32 rows (`prepare_f32`);
//! the row-scaled product (`gemm_scaled_bf16_prepared`), on row-major and tiled weights.
//! `gemm_bf16_converted` (a conversion made once, no copy of the rows) the same on row-major,
//! tiled and paired weights; and a conversion is used only for the activations it was made
//! from, which a buffer overwritten after the conversion shows.

mod common;

use common::{Rng, all_paths};
use simpler_kernels_cpu::{
    ActsConversion, GemmTile, Isa, OutMode, PackedActs, PreparedActs, WeightLayout, WeightsBf16,
    gemm_bf16, gemm_bf16_converted, gemm_bf16_prepared, gemm_scaled_bf16,
    gemm_scaled_bf16_converted, gemm_scaled_bf16_prepared, pack_acts_bf16, packed_len,
    pair_weights_bf16, tile_weights_bf16,
};

/// How many elements of `got` differ from `want` in their bits.
fn bit_diffs(want: &[f32], got: &[f32]) -> usize {
    want.iter()
        .zip(got)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count()
}

#[test]
fn prepared_activations_give_the_bits_of_the_plain_product() {
    let mut rng = Rng(41);
    for (batch, k) in [
        (64, 512),
        (16, 64),
        (17, 48),
        (33, 40),
        (3, 512),
        (64, 100),
        (40, 16),
    ] {
        let x = rng.vec_bf16(batch * k, 1.0);
        let mut packed = vec![0.0f32; packed_len(batch, k)];
        pack_acts_bf16(&x, batch, k, &mut packed);
        let acts = PackedActs::new(&packed, batch, k);
        let x_f32: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        // Several weight matrices of different row counts against one preparation.
        let ws: Vec<(usize, Vec<_>)> = [128usize, 37, 16]
            .iter()
            .map(|&n| (n, rng.vec_bf16(n * k, 1.0)))
            .collect();
        let tiles = |n: usize| {
            [
                GemmTile {
                    n: 0..n,
                    k: 0..k,
                    mode: OutMode::Store,
                },
                GemmTile {
                    n: n / 3..n,
                    k: 0..k,
                    mode: OutMode::Store,
                },
                GemmTile {
                    n: 0..n,
                    k: k / 2..k,
                    mode: OutMode::Add,
                },
            ]
        };
        let ran = all_paths(&format!("prepared batch {batch} K {k}"), || {
            let mut prep = PreparedActs::default();
            prep.prepare(acts);
            let mut from_f32 = PreparedActs::default();
            from_f32.prepare_f32(&x_f32, batch, k);
            let mut diffs = 0usize;
            for ((n, w), prep) in ws.iter().flat_map(|w| [(w, &prep), (w, &from_f32)]) {
                let wm = WeightsBf16::new(w, *n, k);
                for tile in tiles(*n) {
                    let ld = tile.n.len() + 5;
                    let seed: Vec<f32> = (0..batch * ld).map(|i| i as f32 * 0.25).collect();
                    let mut want = seed.clone();
                    gemm_bf16(wm, acts, &tile, &mut want, ld);
                    let mut got = seed;
                    gemm_bf16_prepared(wm, prep, &tile, &mut got, ld);
                    diffs += bit_diffs(&want, &got);
                    // The scaled product, and both on the tiled copy where the shape has one.
                    let scale: Vec<f32> = (0..batch).map(|b| 0.5 + b as f32 * 0.125).collect();
                    let mut want = vec![0.0f32; batch * ld];
                    gemm_scaled_bf16(wm, acts, &tile, &scale, &mut want, ld);
                    let mut got = vec![0.0f32; batch * ld];
                    gemm_scaled_bf16_prepared(wm, prep, &tile, &scale, &mut got, ld);
                    diffs += bit_diffs(&want, &got);
                    if n % 16 == 0
                        && k % 32 == 0
                        && tile.n.start % 16 == 0
                        && tile.k.start % 32 == 0
                    {
                        let t = tile_weights_bf16(w, *n, k);
                        let wt = WeightsBf16::with_layout(&t, *n, k, WeightLayout::Tiled);
                        let mut want = vec![0.0f32; batch * ld];
                        gemm_scaled_bf16(wt, acts, &tile, &scale, &mut want, ld);
                        let mut got = vec![0.0f32; batch * ld];
                        gemm_scaled_bf16_prepared(wt, prep, &tile, &scale, &mut got, ld);
                        diffs += bit_diffs(&want, &got);
                    }
                }
            }
            diffs
        });
        for (isa, diffs) in ran {
            assert_eq!(diffs, 0, "{} batch {batch} K {k}", isa.name());
        }
    }
}

/// `w` (`[n, k]` row-major) in each layout it can take: row-major, paired, and tiled where `n`
/// and `k` are whole tiles.
fn layouts(w: &[half::bf16], n: usize, k: usize) -> Vec<(WeightLayout, Vec<half::bf16>)> {
    let mut v = vec![
        (WeightLayout::RowMajor, w.to_vec()),
        (WeightLayout::Pairs, pair_weights_bf16(w, n, k)),
    ];
    if n.is_multiple_of(16) && k.is_multiple_of(32) {
        v.push((WeightLayout::Tiled, tile_weights_bf16(w, n, k)));
    }
    v
}

#[test]
fn converted_activations_give_the_bits_of_the_plain_product() {
    let mut rng = Rng(43);
    // One conversion for every shape, as a core's cache is reused: its buffers grow and keep
    // stale elements past the current shape's.
    let conv = std::cell::RefCell::new(ActsConversion::default());
    for (batch, k) in [
        (1, 64),
        (2, 512),
        (3, 48),
        (4, 100),
        (5, 512),
        (16, 16),
        (17, 64),
        (64, 96),
    ] {
        let x = rng.vec_bf16(batch * k, 1.0);
        let mut packed = vec![0.0f32; packed_len(batch, k)];
        pack_acts_bf16(&x, batch, k, &mut packed);
        let acts = PackedActs::new(&packed, batch, k);
        let n = 48;
        let w = rng.vec_bf16(n * k, 1.0);
        let tiles = [
            GemmTile {
                n: 0..n,
                k: 0..k,
                mode: OutMode::Store,
            },
            GemmTile {
                n: 16..n,
                k: 0..k,
                mode: OutMode::Add,
            },
            // Split-K parts (the conversion covers the whole body, so it is not used).
            GemmTile {
                n: 0..n,
                k: 0..k / 2 / 32 * 32,
                mode: OutMode::Store,
            },
            GemmTile {
                n: 0..n,
                k: k / 2 / 32 * 32..k,
                mode: OutMode::Add,
            },
        ];
        let scale: Vec<f32> = (0..batch).map(|b| 0.75 + b as f32 * 0.0625).collect();
        let ran = all_paths(&format!("converted batch {batch} K {k}"), || {
            let mut conv = conv.borrow_mut();
            conv.convert(acts);
            let conv = &*conv;
            let mut diffs = 0usize;
            for (layout, data) in layouts(&w, n, k) {
                let wm = WeightsBf16::with_layout(&data, n, k, layout);
                for tile in &tiles {
                    let ld = tile.n.len() + 3;
                    let seed: Vec<f32> = (0..batch * ld).map(|i| i as f32 * 0.5).collect();
                    let mut want = seed.clone();
                    gemm_bf16(wm, acts, tile, &mut want, ld);
                    let mut got = seed.clone();
                    gemm_bf16_converted(wm, acts, conv, tile, &mut got, ld);
                    diffs += bit_diffs(&want, &got);
                    let mut want = seed.clone();
                    gemm_scaled_bf16(wm, acts, tile, &scale, &mut want, ld);
                    let mut got = seed;
                    gemm_scaled_bf16_converted(wm, acts, conv, tile, &scale, &mut got, ld);
                    diffs += bit_diffs(&want, &got);
                }
            }
            diffs
        });
        for (isa, diffs) in ran {
            assert_eq!(diffs, 0, "{} batch {batch} K {k}", isa.name());
        }
    }
}

/// A conversion is of the activations at one address: another buffer converts its own (the
/// plain product); the same buffer overwritten after the conversion gives the product of the
/// values converted, on the paths that take the conversion (the AVX-512 BF16 passes from 2
/// rows, 3 on row-major weights; the AMX tiles on tiled and row-major weights from 5 rows),
/// and the plain product of the new values elsewhere.
#[test]
fn a_conversion_is_used_only_for_the_activations_it_was_made_from() {
    let mut rng = Rng(47);
    let (n, k) = (32usize, 128usize);
    let w = rng.vec_bf16(n * k, 1.0);
    let mut stale_seen = 0usize;
    for batch in [1usize, 2, 3, 5, 8] {
        let x1 = rng.vec_bf16(batch * k, 1.0);
        let x2 = rng.vec_bf16(batch * k, 1.0);
        let pack = |x: &[half::bf16]| {
            let mut p = vec![0.0f32; packed_len(batch, k)];
            pack_acts_bf16(x, batch, k, &mut p);
            p
        };
        let (p1, p2) = (pack(&x1), pack(&x2));
        let tile = GemmTile {
            n: 0..n,
            k: 0..k,
            mode: OutMode::Store,
        };
        let ran = all_paths(&format!("conversion reuse batch {batch}"), || {
            let mut stale = 0usize;
            for (layout, data) in layouts(&w, n, k) {
                let wm = WeightsBf16::with_layout(&data, n, k, layout);
                let product = |x: &[f32]| {
                    let mut o = vec![0.0f32; batch * n];
                    gemm_bf16(wm, PackedActs::new(x, batch, k), &tile, &mut o, n);
                    o
                };
                let (want1, want2) = (product(&p1), product(&p2));
                let mut buf = p1.clone();
                let mut conv = ActsConversion::default();
                conv.convert(PackedActs::new(&buf, batch, k));
                // Other values at another address: converted anew, their plain product.
                let other = p2.clone();
                let mut got = vec![0.0f32; batch * n];
                gemm_bf16_converted(
                    wm,
                    PackedActs::new(&other, batch, k),
                    &conv,
                    &tile,
                    &mut got,
                    n,
                );
                assert_eq!(
                    bit_diffs(&want2, &got),
                    0,
                    "{layout:?} batch {batch}: other buffer"
                );
                // Overwritten in place after the conversion.
                buf.copy_from_slice(&p2);
                let mut got = vec![0.0f32; batch * n];
                gemm_bf16_converted(
                    wm,
                    PackedActs::new(&buf, batch, k),
                    &conv,
                    &tile,
                    &mut got,
                    n,
                );
                let isa = Isa::current();
                let uses = match isa {
                    Isa::AmxBf16 => layout != WeightLayout::Pairs && batch >= 5,
                    Isa::Avx512Bf16 => match layout {
                        WeightLayout::RowMajor => batch >= 3,
                        _ => batch >= 2,
                    },
                    _ => false,
                };
                let want = if uses { &want1 } else { &want2 };
                assert_eq!(
                    bit_diffs(want, &got),
                    0,
                    "{} {layout:?} batch {batch}: conversion {}",
                    isa.name(),
                    if uses { "not used" } else { "used" }
                );
                stale += usize::from(uses);
            }
            stale
        });
        stale_seen += ran.iter().map(|(_, s)| s).sum::<usize>();
    }
    if Isa::Avx512Bf16.is_supported() {
        assert!(stale_seen > 0, "no path took a conversion made once");
    }
}
