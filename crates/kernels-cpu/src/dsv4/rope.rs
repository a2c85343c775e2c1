//! Interleaved RoPE with plain or YaRN frequencies, and its inverse (`docs/dsv4.md`, "RoPE"):
//! pair `(2j, 2j+1)` of the last `rope_dim` values of a head turns by `pos · f_j`.
//!
//! The frequencies are computed in f64 ([`rope_inv_freq_plain`], [`rope_inv_freq_yarn`]); a
//! [`RopeTable`] holds `cos`/`sin` of every position's angles, each angle taken in f64 and
//! rounded to f32 once, so a table lookup gives exactly what a per-position computation would.

use crate::multiversion::multiversion;

/// `f_j = θ^(-2j / rope_dim)` for `j < rope_dim / 2`.
pub fn rope_inv_freq_plain(theta: f64, rope_dim: usize) -> Vec<f64> {
    let dim = rope_dim as f64;
    (0..rope_dim / 2)
        .map(|j| theta.powf(-2.0 * j as f64 / dim))
        .collect()
}

/// YaRN's parameters as the frequency ramp uses them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnRamp {
    /// Division of the long-wavelength pairs' frequencies.
    pub factor: f64,
    /// Rotations over `original_len` above which a pair keeps its frequency.
    pub beta_fast: f64,
    /// Rotations below which a pair is fully divided.
    pub beta_slow: f64,
    /// The trained context length.
    pub original_len: usize,
}

/// The plain frequencies blended towards `f / factor` by YaRN's linear ramp: with
/// `c(r) = rope_dim · ln(L / (2π r)) / (2 ln θ)`, `low = max(0, floor(c(β_fast)))`,
/// `high = min(rope_dim − 1, ceil(c(β_slow)))` (the clamp of DeepSeek's reference, which
/// binds only when `c(β_slow)` exceeds the roped width: never at the FLASH, small and tiny
/// shapes, where this is the plain formula), pair `j` keeps the share
/// `1 − clamp((j − low)/(high − low), 0, 1)` of its own frequency (a degenerate ramp,
/// `high <= low`, is widened to 1e-3 so it stays a step).
pub fn rope_inv_freq_yarn(theta: f64, rope_dim: usize, y: YarnRamp) -> Vec<f64> {
    let dim = rope_dim as f64;
    let turns_at = |r: f64| {
        dim * (y.original_len as f64 / (2.0 * std::f64::consts::PI * r)).ln() / (2.0 * theta.ln())
    };
    let low = turns_at(y.beta_fast).floor().max(0.0);
    let high = turns_at(y.beta_slow).ceil().min(dim - 1.0);
    let span = if high > low { high - low } else { 1e-3 };
    rope_inv_freq_plain(theta, rope_dim)
        .into_iter()
        .enumerate()
        .map(|(j, f)| {
            let keep = 1.0 - ((j as f64 - low) / span).clamp(0.0, 1.0);
            f / y.factor * (1.0 - keep) + f * keep
        })
        .collect()
}

/// `cos` and `sin` of `pos · f_j` for positions `0..positions`, `[positions, pairs]` each.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pairs: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// The table of `inv_freq` (one frequency per pair) over `positions` positions.
    pub fn new(inv_freq: &[f64], positions: usize) -> RopeTable {
        let pairs = inv_freq.len();
        let mut cos = Vec::with_capacity(positions * pairs);
        let mut sin = Vec::with_capacity(positions * pairs);
        for p in 0..positions {
            for &f in inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        RopeTable { pairs, cos, sin }
    }

    /// Pairs per position (`rope_dim / 2`).
    pub fn pairs(&self) -> usize {
        self.pairs
    }

    /// Positions covered.
    pub fn positions(&self) -> usize {
        self.cos.len().checked_div(self.pairs).unwrap_or(0)
    }

    /// `(cos, sin)` rows of `pos`, `None` past the table.
    pub fn at(&self, pos: usize) -> Option<(&[f32], &[f32])> {
        let r = pos.checked_mul(self.pairs)?..(pos + 1).checked_mul(self.pairs)?;
        Some((self.cos.get(r.clone())?, self.sin.get(r)?))
    }

    /// The whole `cos` table `[positions, pairs]` (to copy into a runtime buffer).
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// The whole `sin` table `[positions, pairs]`.
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }
}

/// Rotation direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeDir {
    /// `e' = e c − o s`, `o' = e s + o c`.
    Forward,
    /// The inverse: `e' = e c + o s`, `o' = o c − e s`.
    Inverse,
}

multiversion! {
    /// Rotates the last `2 · cos.len()` values of every `head`-long head of `x` in place
    /// (pairs interleaved: `(2j, 2j+1)` turns by angle `j`).
    ///
    /// # Panics
    /// If `cos` and `sin` differ in length, the rotated part is longer than a head, or `head`
    /// does not divide `x.len()`.
    pub fn rope_interleaved(x: &mut [f32], head: usize, cos: &[f32], sin: &[f32], dir: RopeDir) {
        let pairs = cos.len();
        assert_eq!(sin.len(), pairs, "rope_interleaved: sin len");
        assert!(head > 0 && 2 * pairs <= head && x.len().is_multiple_of(head), "rope_interleaved: head {head}, {pairs} pairs, x len {}", x.len());
        // The inverse is the forward turn by the negated angle.
        let sign = match dir {
            RopeDir::Forward => 1.0f32,
            RopeDir::Inverse => -1.0f32,
        };
        for h in x.chunks_exact_mut(head) {
            let r = &mut h[head - 2 * pairs..];
            for j in 0..pairs {
                let (c, s) = (cos[j], sign * sin[j]);
                let (e, o) = (r[2 * j], r[2 * j + 1]);
                r[2 * j] = e * c - o * s;
                r[2 * j + 1] = e * s + o * c;
            }
        }
    }
}
