//! Choosing the next token from logits: greedy, or temperature → top-k → top-p → a seeded draw.
//!
//! Non-finite logits never crash: NaN counts as impossible, `+inf` makes the choice greedy among
//! the infinite entries, and a distribution that cannot be normalised falls back to greedy.
//! The generator is SplitMix64 written out here rather than a crate's: a seed must give the
//! same tokens across versions, which general-purpose RNG crates do not promise.

/// How to sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy (the largest logit, ties to the lowest id).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks the values: `Err((parameter, what is wrong))`.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err((
                "temperature",
                format!("{} must be finite and at least 0", self.temperature),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(("top_p", format!("{} must be in (0, 1]", self.top_p)));
        }
        if self.top_k == Some(0) {
            return Err(("top_k", "0 must be at least 1".into()));
        }
        Ok(())
    }
}

/// A seeded sampler (one per sequence).
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

/// The largest finite-or-infinite logit, ties to the lowest index; NaN never wins.
pub fn greedy(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i as u32)
}

impl Sampler {
    /// A sampler with `params` (validate them first).
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler {
            params,
            state: params.seed,
        }
    }

    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token, or `None` when every logit is NaN (or there are none).
    pub fn sample(&mut self, logits: &[f32]) -> Option<u32> {
        let p = self.params;
        if p.temperature == 0.0 || logits.contains(&f32::INFINITY) {
            return greedy(logits);
        }
        let max = logits
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return greedy(logits);
        }
        // (id, weight) of the candidates, most likely first.
        let mut cand: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, (((v - max) / p.temperature) as f64).exp()))
            .filter(|&(_, w)| w > 0.0)
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(k) = p.top_k {
            cand.truncate(k.max(1));
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        if !(total.is_finite() && total > 0.0) {
            return greedy(logits);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = cand
                .iter()
                .position(|c| {
                    acc += c.1 / total;
                    acc >= f64::from(p.top_p)
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut u = self.next_f64() * total;
        for &(id, w) in &cand {
            if u < w {
                return Some(id);
            }
            u -= w;
        }
        cand.last().map(|c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_ties_to_the_lowest_id_and_skips_nan() {
        assert_eq!(greedy(&[1.0, 3.0, 3.0, f32::NAN]), Some(1));
        assert_eq!(greedy(&[f32::NAN, f32::NAN]), None);
        assert_eq!(greedy(&[]), None);
        assert_eq!(greedy(&[f32::NEG_INFINITY, -1.0]), Some(1));
    }

    #[test]
    fn sampling_is_seeded_and_respects_top_k_and_top_p() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let params = SamplingParams {
            temperature: 0.8,
            top_k: Some(5),
            top_p: 1.0,
            seed: 7,
        };
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            (0..200)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<u32>>()
        };
        let a = draw(params);
        assert_eq!(a, draw(params), "same seed, same tokens");
        assert_ne!(a, draw(SamplingParams { seed: 8, ..params }));
        let mut order: Vec<u32> = (0..50).collect();
        order.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]));
        assert!(a.iter().all(|t| order[..5].contains(t)), "top-k");
        assert!(order[..5].iter().filter(|t| a.contains(t)).count() >= 3);
        // top_p tiny keeps only the most likely token.
        let only = draw(SamplingParams {
            top_k: None,
            top_p: 1e-6,
            ..params
        });
        assert!(only.iter().all(|&t| t == order[0]));
        // Frequencies follow the softmax: the most likely of a 2-token choice wins ~73%.
        let two = [1.0f32, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            ..params
        });
        let n0 = (0..4000).filter(|_| s.sample(&two) == Some(0)).count();
        let share = n0 as f64 / 4000.0;
        assert!(
            (share - 1.0 / (1.0 + (-1f64).exp())).abs() < 0.03,
            "{share}"
        );
    }

    #[test]
    fn non_finite_logits_never_crash() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: 0.9,
            seed: 1,
        });
        assert_eq!(s.sample(&[0.0, f32::INFINITY, 1.0]), Some(1));
        assert_eq!(s.sample(&[f32::NAN, f32::NAN]), None);
        assert_eq!(s.sample(&[f32::NAN, 2.0, f32::NEG_INFINITY]), Some(1));
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 3]), Some(0));
        assert!(s.sample(&[f32::MAX, f32::MIN, 0.0]).is_some());
    }

    #[test]
    fn bad_parameters_are_named() {
        let ok = SamplingParams::default();
        ok.validate().unwrap();
        for (p, name) in [
            (
                SamplingParams {
                    temperature: -1.0,
                    ..ok
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..ok
                },
                "temperature",
            ),
            (SamplingParams { top_p: 0.0, ..ok }, "top_p"),
            (SamplingParams { top_p: 1.5, ..ok }, "top_p"),
            (
                SamplingParams {
                    top_k: Some(0),
                    ..ok
                },
                "top_k",
            ),
        ] {
            assert_eq!(p.validate().unwrap_err().0, name);
        }
    }
}
