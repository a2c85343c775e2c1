//! Helpers shared by the kernel tests: both-ISA runs, a seeded generator, tolerance checks.

#![allow(dead_code, unreachable_pub)]

use half::bf16;
use simpler_kernels_cpu::{Isa, with_isa};

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

pub fn to_f32(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}
