//! `gemm_bf16_prepared` against `gemm_bf16` on the same activations, bit for bit, on every
//! path: whole-`K` tiles (the prepared AMX tiles are used), partial `K` and split-`K` adds
//! (they are not), batches around the AMX path's smallest batch and its 32-row blocks, `K`
//! with and without a 16-element strip and an edge, and one preparation reused for several
//! weight matrices; the same with the activations prepared from fp32 rows (`prepare_f32`);
//! the row-scaled product (`gemm_scaled_bf16_prepared`), on row-major and tiled weights.

mod common;

use common::{Rng, all_paths};
use simpler_kernels_cpu::{
    GemmTile, OutMode, PackedActs, PreparedActs, WeightLayout, WeightsBf16, gemm_bf16,
    gemm_bf16_prepared, gemm_scaled_bf16, gemm_scaled_bf16_prepared, pack_acts_bf16, packed_len,
    tile_weights_bf16,
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
