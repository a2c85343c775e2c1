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
        // (id, weight) of the candidates; put in order (most likely first, ties to the lower
        // id) only as far as the draw reaches.
        let mut cand = Ranked::new(candidates(logits, max, p.temperature));
        if let Some(k) = p.top_k {
            cand.truncate(k.max(1));
        }
        let mut total = cand.total();
        if !(total.is_finite() && total > 0.0) {
            return greedy(logits);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = (0..cand.len())
                .find(|&i| {
                    acc += cand.get(i).1 / total;
                    acc >= f64::from(p.top_p)
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
            total = cand.total();
        }
        let mut u = self.next_f64() * total;
        for i in 0..cand.len() {
            let (id, w) = cand.get(i);
            if u < w {
                return Some(id);
            }
            u -= w;
        }
        cand.len().checked_sub(1).map(|i| cand.get(i).0)
    }
}

/// The candidates of a draw: `(id, weight)` of every finite logit whose weight
/// `e^((v - max) / temperature)` is above 0, in id order. An exponent below -746 gives 0 (the
/// least subnormal is e^-744.4) and is not taken: libm takes a slow path to say so, and a
/// random model's logits, spread wide, spent as long there as in the exponentials kept.
fn candidates(logits: &[f32], max: f32, temperature: f32) -> Vec<(u32, f64)> {
    logits
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (i as u32, ((v - max) / temperature) as f64))
        .filter(|&(_, x)| x > -746.0)
        .map(|(i, x)| (i, x.exp()))
        .filter(|&(_, w)| w > 0.0)
        .collect()
}

/// Draws the next token of each `(row, sampler)` from its row of `logits` (rows of `vocab`),
/// on up to `threads` threads at once (scoped; this one takes the first share): `(row, draw)`
/// in the order given. A draw takes the exponential of every logit, so at Qwen3's vocabulary
/// 16 sampled rows took 30 ms on one thread and 15 ms on two (model-shaped logits, Zen 4,
/// `docs/benchmarks.md`, session 54) — on the engine's thread, between steps. Each sampler
/// is its own state, so the draws are the same on any number of threads.
///
/// # Panics
/// If a row lies outside `logits`.
pub fn sample_rows(
    jobs: &mut [(usize, &mut Sampler)],
    logits: &[f32],
    vocab: usize,
    threads: usize,
) -> Vec<(usize, Option<u32>)> {
    let draw = |part: &mut [(usize, &mut Sampler)]| -> Vec<(usize, Option<u32>)> {
        part.iter_mut()
            .map(|(row, sampler)| {
                (
                    *row,
                    sampler.sample(&logits[*row * vocab..(*row + 1) * vocab]),
                )
            })
            .collect()
    };
    let threads = threads.clamp(1, jobs.len().max(1));
    if threads == 1 {
        return draw(jobs);
    }
    let per = jobs.len().div_ceil(threads);
    std::thread::scope(|sc| {
        let mut parts = jobs.chunks_mut(per);
        let first = parts.next();
        let handles: Vec<_> = parts.map(|part| sc.spawn(move || draw(part))).collect();
        let mut all = first.map_or_else(Vec::new, draw);
        for h in handles {
            // A draw does not panic on any logits (NaN and infinities included); a row outside
            // `logits` panics on this thread as it would on one thread.
            all.extend(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        all
    })
}

/// Candidates `(id, weight)` put in order — heaviest first, ties to the lower id — lazily:
/// only the first `sorted` are in order, the rest (each no heavier than those) in any. A draw
/// rarely walks past the first few hundred of a vocabulary's ~150,000 candidates, and sorting
/// all of them took 7.5 ms a token (Qwen3's vocabulary, `docs/benchmarks.md`, session 54): at
/// batch 16 more than a decode step's time on the engine's thread. The order is extended
/// in steps (partition the rest around the next step's last place, then sort the step:
/// `O(n)` each), so a walk that does reach far still ends in one full order.
struct Ranked {
    cand: Vec<(u32, f64)>,
    sorted: usize,
    /// The sum of the weights, fixed at [`Ranked::truncate`] (in order for a truncated set,
    /// in id order for the whole one).
    total: f64,
}

impl Ranked {
    /// The first place step: the draws' usual reach on a real model's logits, with room.
    const FIRST: usize = 256;

    fn new(cand: Vec<(u32, f64)>) -> Ranked {
        let total = cand.iter().map(|c| c.1).sum();
        Ranked {
            cand,
            sorted: 0,
            total,
        }
    }

    /// Heavier first, then the lower id: a total order (ids are distinct).
    fn order(a: &(u32, f64), b: &(u32, f64)) -> std::cmp::Ordering {
        b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
    }

    fn len(&self) -> usize {
        self.cand.len()
    }

    /// Puts the first `n` candidates in order.
    fn sort_to(&mut self, n: usize) {
        let n = n.min(self.cand.len());
        if n <= self.sorted {
            return;
        }
        let rest = &mut self.cand[self.sorted..];
        let last = n - self.sorted - 1;
        if last + 1 < rest.len() {
            rest.select_nth_unstable_by(last, Self::order);
        }
        rest[..=last].sort_unstable_by(Self::order);
        self.sorted = n;
    }

    /// Candidate `i` in order.
    fn get(&mut self, i: usize) -> (u32, f64) {
        if i >= self.sorted {
            let step = Self::FIRST.max(2 * self.sorted);
            self.sort_to(i + 1 + step);
        }
        self.cand[i]
    }

    /// Keeps the `n` first in order, the sum of their weights summed in that order (nothing
    /// changes where all `n` are kept).
    fn truncate(&mut self, n: usize) {
        if n >= self.cand.len() {
            return;
        }
        self.sort_to(n);
        self.cand.truncate(n);
        self.total = self.cand.iter().map(|c| c.1).sum();
    }

    fn total(&self) -> f64 {
        self.total
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

    /// The draw as first written: every candidate sorted before the draw.
    fn sample_fully_sorted(s: &mut Sampler, logits: &[f32]) -> Option<u32> {
        let p = s.params;
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
        let mut u = s.next_f64() * total;
        for &(id, w) in &cand {
            if u < w {
                return Some(id);
            }
            u -= w;
        }
        cand.last().map(|c| c.0)
    }

    /// The lazily ordered draw picks what sorting every candidate first picked, token for
    /// token, on logits shaped like a model's (a few far above a bulk), on flat ones where a
    /// draw walks deep into the order, with ties, NaNs and `-inf` among them, on ones spread so
    /// wide that most weights underflow (exponents either side of -746), and with and
    /// without top-k and top-p. (Where top-k removes candidates every sum is taken in the same
    /// order as before; otherwise the whole set's sum is now taken in id order, which can move
    /// a draw, or top-p's cut, that falls within rounding of a boundary: none of these does.)
    #[test]
    fn the_lazy_order_draws_what_the_full_sort_drew() {
        let mut st = 9u64;
        let mut next = move || {
            st = st
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (st >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut peaked: Vec<f32> = (0..20_000)
            .map(|_| (next() + next() + next()) * 6.0)
            .collect();
        for (i, v) in [
            (100, 12.0),
            (2000, 11.0),
            (77, 10.5),
            (5000, 10.5),
            (9, 8.0),
        ] {
            peaked[i] = v;
        }
        let mut flat: Vec<f32> = (0..3000).map(|_| (next() * 8.0).round() / 4.0).collect();
        flat[5] = f32::NAN;
        flat[6] = f32::NEG_INFINITY;
        // Spread as a random model's: most weights underflow to 0; at temperature 1 some
        // exponents land just either side of the underflow.
        let mut wide: Vec<f32> = (0..4000).map(|_| next() * 4000.0).collect();
        let top = wide.iter().copied().fold(f32::MIN, f32::max);
        for (i, d) in [(1, 745.0), (2, 745.2), (3, 746.0), (4, 744.0), (5, 0.5)] {
            wide[i] = top - d;
        }
        for (name, logits) in [("peaked", &peaked), ("flat", &flat), ("wide", &wide)] {
            for (temperature, top_k, top_p) in [
                (0.7, None, 0.9),
                (1.0, None, 1.0),
                (0.7, Some(50), 0.95),
                (1.3, Some(500), 1.0),
                (2.0, Some(1), 1.0),
                (1.0, None, 0.999),
            ] {
                let params = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed: 3,
                };
                let (mut a, mut b) = (Sampler::new(params), Sampler::new(params));
                for draw in 0..300 {
                    assert_eq!(
                        a.sample(logits),
                        sample_fully_sorted(&mut b, logits),
                        "{name} logits, {params:?}, draw {draw}"
                    );
                }
            }
        }
    }

    /// Rows drawn on one, two or three threads (and more threads than rows) give the same
    /// tokens in the same order, each row its own sampler's sequence.
    #[test]
    fn rows_draw_the_same_tokens_on_any_number_of_threads() {
        let (rows, vocab) = (5, 300);
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 7919) % 1013) as f32 / 100.0)
            .collect();
        let draws = |threads: usize| {
            let mut samplers: Vec<Sampler> = (0..rows)
                .map(|r| {
                    Sampler::new(SamplingParams {
                        temperature: 0.9,
                        top_k: None,
                        top_p: 0.95,
                        seed: r as u64,
                    })
                })
                .collect();
            let mut out = Vec::new();
            for _ in 0..20 {
                let mut jobs: Vec<(usize, &mut Sampler)> = samplers
                    .iter_mut()
                    .enumerate()
                    .rev()
                    .filter(|(r, _)| r % 2 == 0 || *r == 1)
                    .collect();
                out.push(sample_rows(&mut jobs, &logits, vocab, threads));
            }
            out
        };
        let one = draws(1);
        assert_eq!(one[0].iter().map(|d| d.0).collect::<Vec<_>>(), [4, 2, 1, 0]);
        assert!(one.iter().flatten().all(|d| d.1.is_some()));
        for threads in [2, 3, 8] {
            assert_eq!(draws(threads), one, "{threads} threads");
        }
        assert!(sample_rows(&mut [], &logits, vocab, 4).is_empty());
    }

    /// Skipping the exponents below -746 leaves the candidates exactly those of taking every
    /// exponential and keeping the weights above 0: the same ids and weight bits, on logits
    /// whose exponents fall on both sides of the underflow and right at it.
    #[test]
    fn the_underflow_cut_keeps_every_candidate_with_weight() {
        assert_eq!((-746f64).exp(), 0.0);
        assert!((-745f64).exp() > 0.0);
        let max = 10.0f32;
        let mut logits: Vec<f32> = (0..20_000).map(|i| max - i as f32 * 0.0625).collect();
        logits.extend([
            f32::NAN,
            f32::NEG_INFINITY,
            max - 745.125,
            max - 745.25,
            max - 746.0,
        ]);
        for t in [1.0f32, 0.5, 0.7, 1.3] {
            let every: Vec<(u32, u64)> = logits
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, &v)| (i as u32, (((v - max) / t) as f64).exp()))
                .filter(|&(_, w)| w > 0.0)
                .map(|(i, w)| (i, w.to_bits()))
                .collect();
            let cut: Vec<(u32, u64)> = candidates(&logits, max, t)
                .into_iter()
                .map(|(i, w)| (i, w.to_bits()))
                .collect();
            assert_eq!(cut, every, "temperature {t}");
            // Some weights are the least subnormal, the last kept before the underflow.
            assert!(cut.iter().any(|c| c.1 == 1), "temperature {t}");
        }
    }

    #[test]
    fn ranked_candidates_come_in_order_however_far_they_are_asked() {
        let mut st = 5u64;
        let cand: Vec<(u32, f64)> = (0..5000u32)
            .map(|i| {
                st = st.wrapping_mul(6364136223846793005).wrapping_add(1);
                // Few distinct weights: many ties, broken by the lower id.
                (i, ((st >> 60) as f64 + 1.0) / 16.0)
            })
            .collect();
        let mut want = cand.clone();
        want.sort_by(Ranked::order);
        for reach in [0, 1, 255, 256, 257, 1000, 4999] {
            let mut r = Ranked::new(cand.clone());
            assert_eq!(r.get(reach), want[reach], "reach {reach}");
            for (i, &w) in want.iter().enumerate() {
                assert_eq!(r.get(i), w, "reach {reach}, then {i}");
            }
        }
        let mut r = Ranked::new(cand.clone());
        r.truncate(300);
        assert_eq!(r.len(), 300);
        assert_eq!(r.total(), want[..300].iter().map(|c| c.1).sum::<f64>());
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
