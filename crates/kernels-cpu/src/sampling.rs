//! The vector passes of a sampled draw over a vocabulary's logits: the largest finite logit,
//! and every logit's weight `e^((v - max) / temperature)` with their sum.
//!
//! Why here: a draw over Qwen3's ~152,000 logits spent ~0.7 ms in the library's `f64` `exp`
//! and ~0.3 ms more in branchy scans and a dependent chain of `f64` adds, on the serving
//! engine's thread between steps (`docs/benchmarks.md`, session 56). These bodies are lane-blocked so the
//! compiler vectorises them, and they write no `mul_add`, so every build gives the same bits
//! (`multiversion!`): a seed draws the same tokens on every processor.

use crate::math::exp_approx;
use crate::multiversion::multiversion;

/// The smallest exponent `(v - max) / temperature` whose weight is kept: the lower clamp of
/// the crate's `exp` polynomial. Below it the weight is 0 (the candidate is dropped); at it, `e^-87` ≈ 1.6e-38
/// of the largest logit's weight (1), far under the draw's resolution (a draw is a multiple of
/// 2^-53 of the weights' sum, which is at least 1).
pub const WEIGHT_CUT: f32 = -87.0;

/// Lanes of the blocked loops (one 512-bit vector of `f32`).
const LANES: usize = 16;

/// The weight of one logit (see [`sampling_weights`]).
#[inline(always)]
fn weight(v: f32, max: f32, temperature: f32) -> f32 {
    let x = (v - max) / temperature;
    let w = exp_approx(x);
    // NaN and `-inf` exponents fail the comparison too.
    if x >= WEIGHT_CUT { w } else { 0.0 }
}

multiversion! { avx512;
    /// The largest finite value of `logits` (`-inf` where none is finite: empty, or all NaN
    /// or infinite), and whether any is `+inf`.
    pub fn logits_max(logits: &[f32]) -> (f32, bool) {
        let mut m = [f32::NEG_INFINITY; LANES];
        let mut inf = [false; LANES];
        let mut chunks = logits.chunks_exact(LANES);
        for c in &mut chunks {
            for j in 0..LANES {
                let v = c[j];
                // A NaN fails both comparisons.
                m[j] = if v > m[j] && v < f32::INFINITY { v } else { m[j] };
                inf[j] |= v == f32::INFINITY;
            }
        }
        for (j, &v) in chunks.remainder().iter().enumerate() {
            m[j] = if v > m[j] && v < f32::INFINITY { v } else { m[j] };
            inf[j] |= v == f32::INFINITY;
        }
        (m.into_iter().fold(f32::NEG_INFINITY, f32::max), inf.contains(&true))
    }
}

multiversion! { avx512;
    /// `out[i] = e^((logits[i] - max) / temperature)` where that exponent is at least
    /// [`WEIGHT_CUT`], else 0 (NaN and `-inf` logits give 0); returns the weights' sum in
    /// `f64`, taken in 16 lanes (lane `j` sums the indices `j mod 16` in order) and then the
    /// lanes in order. The exponential is the crate's `exp_approx` (within 2.6e-7 relative,
    /// at most 3 ulp, of `f64`'s for exponents in `[-87, 0]`). `max` is meant to be the largest finite logit: a larger
    /// exponent gives a weight above 1 (clamped at `e^88`).
    ///
    /// # Panics
    /// If `out` is not as long as `logits`.
    pub fn sampling_weights(logits: &[f32], max: f32, temperature: f32, out: &mut [f32]) -> f64 {
        assert_eq!(logits.len(), out.len(), "sampling_weights: out len");
        let mut acc = [0.0f64; LANES];
        let mut xs = logits.chunks_exact(LANES);
        let mut os = out.chunks_exact_mut(LANES);
        for (x, o) in (&mut xs).zip(&mut os) {
            for j in 0..LANES {
                let w = weight(x[j], max, temperature);
                o[j] = w;
                acc[j] += f64::from(w);
            }
        }
        for (j, (&x, o)) in xs.remainder().iter().zip(os.into_remainder()).enumerate() {
            let w = weight(x, max, temperature);
            *o = w;
            acc[j] += f64::from(w);
        }
        acc.iter().sum()
    }
}
