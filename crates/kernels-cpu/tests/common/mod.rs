//! Helpers shared by the kernel tests: both-ISA runs, a seeded generator, tolerance checks.

#![allow(dead_code, unreachable_pub)]

use half::bf16;
use simpler_kernels_cpu::{
    GemmTile, Isa, PackedActs, WeightLayout, WeightsBf16, gemm_bf16, gemm_scaled_bf16,
    pack_acts_bf16, packed_len, pair_weights_bf16, tile_weights_bf16, with_isa,
};

/// Runs `f` on the portable path and, when this CPU has it, on the AVX2 path: for kernels
/// whose wider paths run their AVX2 code (attention, vector kernels), these two are every
/// path they have.
pub fn both<R>(f: impl Fn() -> R) -> (R, Option<R>) {
    let p = with_isa(Isa::Portable, &f).expect("portable always runs");
    let a = with_isa(Isa::Avx2, &f);
    if a.is_none() {
        println!("avx2 path skipped: not on this CPU (portable only)");
    }
    (p, a)
}

/// Runs `f` on every path this CPU has (the portable path first), printing the paths run and
/// skipped so a test log says what it covered.
pub fn all_paths<R>(what: &str, f: impl Fn() -> R) -> Vec<(Isa, R)> {
    let mut ran = Vec::new();
    let mut skipped = Vec::new();
    for isa in Isa::ALL {
        match with_isa(isa, &f) {
            Some(r) => ran.push((isa, r)),
            None => skipped.push(isa.name()),
        }
    }
    println!(
        "{what}: ran {:?}; skipped (not on this CPU) {skipped:?}",
        ran.iter().map(|(i, _)| i.name()).collect::<Vec<_>>()
    );
    ran
}

/// A small seeded generator (splitmix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec_f32(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
    pub fn vec_bf16(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(self.uniform() * scale))
            .collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Asserts `|a - e| <= atol + rtol |e|` element-wise.
#[track_caller]
pub fn assert_close(a: &[f32], e: &[f32], rtol: f32, atol: f32, what: &str) {
    assert_eq!(a.len(), e.len(), "{what}: lengths");
    for (i, (&x, &y)) in a.iter().zip(e).enumerate() {
        assert!(
            (x - y).abs() <= atol + rtol * y.abs(),
            "{what}[{i}]: got {x}, expected {y}"
        );
    }
}

/// Asserts that `layout` arranges a `[rows, cols]` matrix into `len` elements, round-trips it,
/// puts element `(n, k)` at `index(n, k, cols)` with no two elements in one place, and zeroes
/// the rest.
#[track_caller]
pub fn assert_layout_places_every_element(
    layout: WeightLayout,
    rows: usize,
    cols: usize,
    len: usize,
    index: impl Fn(usize, usize, usize) -> usize,
) {
    let w: Vec<bf16> = (0..rows * cols)
        .map(|i| bf16::from_f32((i + 1) as f32))
        .collect();
    let t = layout.arrange_bf16(&w, rows, cols);
    assert_eq!(t.len(), len, "{layout:?} {rows}x{cols}: length");
    assert_eq!(
        layout.row_major_bf16(&t, rows, cols),
        w,
        "{layout:?} {rows}x{cols}: round trip"
    );
    let mut seen = vec![false; len];
    for n in 0..rows {
        for k in 0..cols {
            let at = index(n, k, cols);
            assert!(!seen[at], "{layout:?} {rows}x{cols}: ({n}, {k}) collides");
            seen[at] = true;
            assert_eq!(
                t[at],
                w[n * cols + k],
                "{layout:?} {rows}x{cols}: ({n}, {k})"
            );
        }
    }
    for (i, v) in t.iter().enumerate() {
        if !seen[i] {
            assert_eq!(
                v.to_f32(),
                0.0,
                "{layout:?} {rows}x{cols}: padding element {i}"
            );
        }
    }
}

pub fn to_f32(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// A seeded bf16 GEMM case: `n × k` weights (row-major, and tiled and paired as built from
/// them at construction), `batch` activation rows, and those rows packed for the kernels.
pub struct GemmCase {
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub w: Vec<bf16>,
    pub x: Vec<bf16>,
    pub tiled: Vec<bf16>,
    pub paired: Vec<bf16>,
    pub packed: Vec<f32>,
}

impl GemmCase {
    pub fn new(n: usize, k: usize, batch: usize, seed: u64) -> GemmCase {
        let mut rng = Rng(seed);
        let w = rng.vec_bf16(n * k, 0.5);
        let x = rng.vec_bf16(batch * k, 2.0);
        let mut packed = vec![0.0; packed_len(batch, k)];
        pack_acts_bf16(&x, batch, k, &mut packed);
        let tiled = tile_weights_bf16(&w, n, k);
        let paired = pair_weights_bf16(&w, n, k);
        GemmCase {
            n,
            k,
            batch,
            w,
            x,
            tiled,
            paired,
            packed,
        }
    }

    /// The weights in `layout` (`Tiled` and `Pairs` are `w` as it was at construction).
    pub fn weights(&self, layout: WeightLayout) -> WeightsBf16<'_> {
        match layout {
            WeightLayout::RowMajor => WeightsBf16::new(&self.w, self.n, self.k),
            WeightLayout::Tiled => WeightsBf16::tiled(&self.tiled, self.n, self.k),
            WeightLayout::Pairs => WeightsBf16::paired(&self.paired, self.n, self.k),
        }
    }

    pub fn acts(&self) -> PackedActs<'_> {
        PackedActs::new(&self.packed, self.batch, self.k)
    }

    /// Output of `tile` on `layout`, the output pre-filled with `seed_out` (row stride `ld`),
    /// scaled per batch row by `scale` when given.
    pub fn run(
        &self,
        layout: WeightLayout,
        tile: &GemmTile,
        scale: Option<&[f32]>,
        seed_out: &[f32],
        ld: usize,
    ) -> Vec<f32> {
        let mut out = seed_out.to_vec();
        let w = self.weights(layout);
        match scale {
            Some(s) => gemm_scaled_bf16(w, self.acts(), tile, s, &mut out, ld),
            None => gemm_bf16(w, self.acts(), tile, &mut out, ld),
        }
        out
    }

    /// Asserts `got` (an output of `tile` written over `seed_out` at row stride `ld`, scaled
    /// by `scale` when given) against the f64 reference, and that the padding between output
    /// rows still holds `seed_out`; `what` names the run in a failure.
    #[track_caller]
    pub fn assert_reference(
        &self,
        tile: &GemmTile,
        scale: Option<&[f32]>,
        seed_out: &[f32],
        ld: usize,
        got: &[f32],
        what: &str,
    ) {
        for b in 0..self.batch {
            for n in tile.n.clone() {
                let (mut e, mut tol) = self.reference(tile, b, n);
                if let Some(s) = scale {
                    e *= f64::from(s[b]);
                    tol *= f64::from(s[b].abs());
                }
                let i = b * ld + (n - tile.n.start);
                if tile.mode == simpler_kernels_cpu::OutMode::Add {
                    e += f64::from(seed_out[i]);
                    tol += 1e-6;
                }
                let g = f64::from(got[i]);
                assert!(
                    (g - e).abs() <= tol,
                    "{what} n={} k={} batch={} b={b} row={n} tile={tile:?}: {g} vs {e}",
                    self.n,
                    self.k,
                    self.batch
                );
            }
        }
        for (i, (&o, &s)) in got.iter().zip(seed_out).enumerate() {
            if i % ld >= tile.n.len() {
                assert_eq!(o, s, "{what} wrote padding element {i}");
            }
        }
    }

    /// f64 reference of output (`b`, `n`) over `tile.k`, and the error bound of an fp32 sum of
    /// those terms.
    pub fn reference(&self, tile: &GemmTile, b: usize, n: usize) -> (f64, f64) {
        let mut s = 0.0f64;
        let mut mag = 0.0f64;
        for kk in tile.k.clone() {
            let t = f64::from(self.w[n * self.k + kk].to_f32())
                * f64::from(self.x[b * self.k + kk].to_f32());
            s += t;
            mag += t.abs();
        }
        (s, mag * 1e-5 + 1e-6)
    }
}
