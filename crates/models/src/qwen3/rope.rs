//! Rotary position embeddings: the base θ, the scaling a checkpoint asks for (`rope_type`
//! `default`, `linear`, `dynamic` or `yarn`, with their parameters as `transformers` reads
//! them), and the cos/sin tables the kernels and the golden index by position.
//!
//! Every type is expressed as per-position angles and one amplitude, so the kernels never
//! know which type ran: row `p` of the tables is `cos(p·f_i)·a`, `sin(p·f_i)·a` with the
//! type's inverse frequencies `f_i` and attention factor `a` (1 except for YaRN).
//! `docs/qwen3-checkpoints.md` states the formulas.

use serde::{Deserialize, Serialize};

/// How the inverse frequencies are scaled (`rope_parameters.rope_type`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// `f_i = θ^(-2i/d)`.
    Default,
    /// Position interpolation: `f_i / factor`.
    Linear {
        /// Divides every frequency.
        factor: f64,
    },
    /// Dynamic NTK: at sequence length `L` above `max_position_embeddings` (`M`) the base
    /// becomes `θ·(factor·L/M − (factor − 1))^(d/(d−2))`; at or below `M` it is θ.
    Dynamic {
        /// The NTK factor.
        factor: f64,
    },
    /// YaRN: frequencies blended between the original and `f_i / factor` by a linear ramp over
    /// the dimensions whose wavelengths lie between `beta_fast` and `beta_slow` rotations of
    /// the original context; cos and sin scaled by `attention_factor`.
    Yarn {
        /// The context extension factor.
        factor: f64,
        /// The pretraining context the ramp is measured against.
        original_max_position_embeddings: usize,
        /// Rotations bounding the extrapolated (unchanged) dimensions.
        beta_fast: f64,
        /// Rotations bounding the interpolated (divided) dimensions.
        beta_slow: f64,
        /// Amplitude of cos and sin (resolved from `mscale`/`mscale_all_dim` when not given).
        attention_factor: f64,
        /// Round the ramp's bounds outwards to whole dimensions.
        truncate: bool,
    },
}

/// The RoPE of a model: base and scaling.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    /// The base θ.
    pub theta: f64,
    /// The scaling.
    pub scaling: RopeScaling,
}

impl Rope {
    /// Plain RoPE with base `theta`.
    pub fn plain(theta: f64) -> Rope {
        Rope {
            theta,
            scaling: RopeScaling::Default,
        }
    }

    /// The `rope_type` name.
    pub fn type_name(&self) -> &'static str {
        match self.scaling {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// Inverse frequencies (`head_dim / 2` of them) and the amplitude of cos and sin, for a
    /// forward pass whose longest sequence is `seq_len` tokens in a model trained for
    /// `max_position_embeddings` positions (only dynamic NTK depends on `seq_len`).
    pub fn inv_freq(
        &self,
        head_dim: usize,
        seq_len: usize,
        max_position_embeddings: usize,
    ) -> (Vec<f64>, f64) {
        let d = head_dim as f64;
        let plain = |base: f64| -> Vec<f64> {
            (0..head_dim / 2)
                .map(|i| 1.0 / base.powf((2 * i) as f64 / d))
                .collect()
        };
        match self.scaling {
            RopeScaling::Default => (plain(self.theta), 1.0),
            RopeScaling::Linear { factor } => (
                plain(self.theta).into_iter().map(|f| f / factor).collect(),
                1.0,
            ),
            RopeScaling::Dynamic { factor } => {
                let m = max_position_embeddings as f64;
                let l = seq_len.max(max_position_embeddings) as f64;
                let base = self.theta * ((factor * l / m) - (factor - 1.0)).powf(d / (d - 2.0));
                (plain(base), 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let orig = original_max_position_embeddings as f64;
                // The dimension whose wavelength fits `rotations` times into the original context.
                let dim_of = |rotations: f64| {
                    d * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (dim_of(beta_fast), dim_of(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(d - 1.0);
                if low == high {
                    high += 0.001;
                }
                let freqs = plain(self.theta)
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        // ramp 0: extrapolate (keep f); ramp 1: interpolate (f / factor).
                        f / factor * ramp + f * (1.0 - ramp)
                    })
                    .collect();
                (freqs, attention_factor)
            }
        }
    }

    /// Checks the parameters (errors name the field under `rope_parameters`).
    pub fn validate(&self) -> Result<(), (&'static str, String, &'static str)> {
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return Err(("rope_theta", num(self.theta), "must be finite and above 1"));
        }
        let factor = match self.scaling {
            RopeScaling::Default => return Ok(()),
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => factor,
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                if original_max_position_embeddings == 0 {
                    return Err((
                        "original_max_position_embeddings",
                        "0".into(),
                        "must be positive",
                    ));
                }
                if !(attention_factor.is_finite() && attention_factor > 0.0) {
                    return Err((
                        "attention_factor",
                        num(attention_factor),
                        "must be finite and positive",
                    ));
                }
                // `transformers` takes the logarithm of `O/(2π·β)` (a Python `math.log`, which
                // raises on a negative β), then floors it (which raises on an infinite one):
                // each β must be positive with that logarithm finite, or the ramp's bounds
                // would be NaN or infinite here.
                let orig = original_max_position_embeddings as f64;
                for (key, beta) in [("beta_fast", beta_fast), ("beta_slow", beta_slow)] {
                    if !(beta.is_finite() && beta > 0.0) {
                        return Err((key, num(beta), "must be finite and positive"));
                    }
                    if !(orig / (beta * 2.0 * std::f64::consts::PI))
                        .ln()
                        .is_finite()
                    {
                        return Err((
                            key,
                            num(beta),
                            "is out of range: ln(original_max_position_embeddings / (2π·β)), \
                             which places YaRN's ramp, is not finite",
                        ));
                    }
                }
                // `transformers` says beta_fast must be greater than beta_slow (it warns,
                // then runs the ramp backwards: the dimensions meant to keep their frequency
                // are divided and the others kept); refused, as a factor below 1 is.
                if beta_fast < beta_slow {
                    return Err((
                        "beta_fast",
                        format!(
                            "{} (beta_slow {}; an absent or zero beta is its default, 32 fast and 1 slow)",
                            num(beta_fast),
                            num(beta_slow)
                        ),
                        "must be at least beta_slow: the ramp from the kept to the divided \
                         frequencies would run backwards",
                    ));
                }
                factor
            }
        };
        if !(factor.is_finite() && factor >= 1.0) {
            return Err(("factor", num(factor), "must be finite and at least 1"));
        }
        Ok(())
    }
}

/// A config value for an error message: as written in JSON for ordinary magnitudes (`4`,
/// `0.5`), in exponent form where the plain one would run to hundreds of digits (`1e308`).
pub(crate) fn num(x: f64) -> String {
    let a = x.abs();
    if a != 0.0 && !(1e-5..1e16).contains(&a) {
        format!("{x:e}")
    } else {
        x.to_string()
    }
}

/// RoPE cos/sin tables `[max_seq, head_dim]` with the two halves repeated:
/// `cos[p, i] = a·cos(p·f_(i mod d/2))`, `sin` likewise, for the frequencies `f` and
/// amplitude `a` of [`Rope::inv_freq`].
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTables {
    /// Positions covered.
    pub max_seq: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// `[max_seq, head_dim]`.
    pub cos: Vec<f32>,
    /// `[max_seq, head_dim]`.
    pub sin: Vec<f32>,
}

impl RopeTables {
    /// Tables for positions `0..max_seq` (angles computed in f64, stored as f32).
    ///
    /// Dynamic NTK is evaluated as for a sequence of `max_seq` tokens clamped to
    /// `max_position_embeddings`: the runtime refuses positions past that limit, and below it
    /// `transformers` uses the plain frequencies.
    pub fn new(
        max_seq: usize,
        head_dim: usize,
        rope: &Rope,
        max_position_embeddings: usize,
    ) -> RopeTables {
        let half = head_dim / 2;
        let (inv, amp) = rope.inv_freq(
            head_dim,
            max_seq.min(max_position_embeddings),
            max_position_embeddings,
        );
        let mut cos = vec![0.0f32; max_seq * head_dim];
        let mut sin = vec![0.0f32; max_seq * head_dim];
        for p in 0..max_seq {
            for i in 0..head_dim {
                let a = p as f64 * inv[i % half.max(1)];
                cos[p * head_dim + i] = (a.cos() * amp) as f32;
                sin[p * head_dim + i] = (a.sin() * amp) as f32;
            }
        }
        RopeTables {
            max_seq,
            head_dim,
            cos,
            sin,
        }
    }

    /// Plain tables with base `theta` (no scaling).
    pub fn plain(max_seq: usize, head_dim: usize, theta: f64) -> RopeTables {
        RopeTables::new(max_seq, head_dim, &Rope::plain(theta), usize::MAX)
    }

    /// The table rows of position `pos`: `(cos, sin)`, `head_dim` each.
    pub fn row(&self, pos: usize) -> (&[f32], &[f32]) {
        let d = self.head_dim;
        (
            &self.cos[pos * d..(pos + 1) * d],
            &self.sin[pos * d..(pos + 1) * d],
        )
    }
}

#[cfg(test)]
mod tests {
    //! The formulas below are written out again, independently of [`Rope::inv_freq`]: each
    //! angle is computed per (position, dimension) from the definition, in the form the YaRN
    //! and NTK papers state it (wavelengths, not the ramp over frequencies).
    use super::*;
    use std::f64::consts::PI;

    const D: usize = 128;

    fn check(rope: &Rope, max_pos: usize, angle: impl Fn(usize, usize) -> f64, amp: f64) {
        let t = RopeTables::new(300, D, rope, max_pos);
        // Many positions and every dimension: position 0 alone cannot tell bases apart.
        for p in [0usize, 1, 2, 7, 31, 100, 257, 299] {
            let (c, s) = t.row(p);
            for i in 0..D {
                let a = angle(p, i % (D / 2));
                let (ec, es) = ((a.cos() * amp) as f32, (a.sin() * amp) as f32);
                assert!(
                    (c[i] - ec).abs() <= 2e-6 && (s[i] - es).abs() <= 2e-6,
                    "{:?} p {p} i {i}: ({}, {}) vs ({ec}, {es})",
                    rope.scaling,
                    c[i],
                    s[i]
                );
            }
        }
    }

    fn wavelength(theta: f64, i: usize) -> f64 {
        2.0 * PI * theta.powf(2.0 * i as f64 / D as f64)
    }

    #[test]
    fn default_and_linear_match_their_definitions() {
        let theta = 1e6;
        check(
            &Rope::plain(theta),
            40960,
            |p, i| 2.0 * PI * p as f64 / wavelength(theta, i),
            1.0,
        );
        // Linear: position p behaves as position p / factor.
        let rope = Rope {
            theta,
            scaling: RopeScaling::Linear { factor: 4.0 },
        };
        check(
            &rope,
            40960,
            |p, i| 2.0 * PI * (p as f64 / 4.0) / wavelength(theta, i),
            1.0,
        );
        // Bases differ away from position 0.
        let a = RopeTables::plain(8, D, 1e4);
        let b = RopeTables::plain(8, D, 1e6);
        assert_eq!(a.row(0), b.row(0));
        assert_ne!(a.row(5), b.row(5));
    }

    #[test]
    fn dynamic_is_plain_within_the_trained_context_and_ntk_scaled_past_it() {
        let theta = 1e4;
        let rope = Rope {
            theta,
            scaling: RopeScaling::Dynamic { factor: 2.0 },
        };
        // Tables never cover past max_position_embeddings here: plain frequencies.
        check(
            &rope,
            4096,
            |p, i| 2.0 * PI * p as f64 / wavelength(theta, i),
            1.0,
        );
        // The NTK base at a longer sequence: L = 3M with factor 2 gives base θ·5^(d/(d−2)).
        let (f, a) = rope.inv_freq(D, 3 * 4096, 4096);
        assert_eq!(a, 1.0);
        let base = theta * 5f64.powf(D as f64 / (D as f64 - 2.0));
        for (i, f) in f.iter().enumerate() {
            let want = 2.0 * PI / (2.0 * PI * base.powf(2.0 * i as f64 / D as f64));
            assert!((f - want).abs() <= 1e-12 * want.max(1e-30), "i {i}");
        }
    }

    #[test]
    fn yarn_matches_the_wavelength_definition() {
        let (theta, factor, orig) = (1e6f64, 4.0f64, 32768usize);
        let (beta_fast, beta_slow) = (32.0, 1.0);
        let attention_factor = 0.1 * factor.ln() + 1.0;
        let rope = Rope {
            theta,
            scaling: RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate: true,
            },
        };
        // A dimension whose wavelength fits more than beta_fast times into the original
        // context keeps its frequency; one that fits fewer than beta_slow times is divided by
        // the factor; in between a linear ramp over whole dimensions, bounded by the
        // dimensions where the rotation count crosses the betas.
        let rotations = |i: usize| orig as f64 / wavelength(theta, i);
        let first_slow = (0..D / 2).find(|&i| rotations(i) < beta_fast).unwrap();
        let last_fast = (0..D / 2)
            .rev()
            .find(|&i| rotations(i) > beta_slow)
            .unwrap();
        let (lo, hi) = ((first_slow - 1) as f64, (last_fast + 1) as f64);
        let angle = |p: usize, i: usize| {
            let f = 2.0 * PI / wavelength(theta, i);
            let w = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
            p as f64 * (f * (1.0 - w) + f / factor * w)
        };
        check(&rope, 131072, angle, attention_factor);
        let t = RopeTables::new(2, D, &rope, 131072);
        assert!((t.row(0).0[0] as f64 - attention_factor).abs() < 1e-6);
    }

    #[test]
    fn validation_names_the_bad_parameter() {
        let bad = |s: RopeScaling| Rope {
            theta: 1e4,
            scaling: s,
        };
        assert_eq!(
            bad(RopeScaling::Linear { factor: 0.5 })
                .validate()
                .unwrap_err()
                .0,
            "factor"
        );
        assert_eq!(Rope::plain(1.0).validate().unwrap_err().0, "rope_theta");
        let y = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.0,
            truncate: true,
        };
        assert_eq!(
            bad(y).validate().unwrap_err().0,
            "original_max_position_embeddings"
        );
    }
}
