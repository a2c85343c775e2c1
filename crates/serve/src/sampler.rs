//! Choosing the next token from logits: greedy, or temperature → top-k → top-p → a seeded draw.
//!
//! Non-finite logits never crash: NaN counts as impossible, `+inf` makes the choice greedy among
//! the infinite entries, and a distribution that cannot be normalised falls back to greedy.
//! The generator is SplitMix64 written out here rather than a crate's: a seed must give the
//! same tokens across versions, which general-purpose RNG crates do not promise.

use std::cell::RefCell;

use simpler_kernels_cpu::sampling::{logits_max, sampling_weights};

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
        if p.temperature == 0.0 {
            return greedy(logits);
        }
        let (max, any_inf) = logits_max(logits);
        if any_inf || max == f32::NEG_INFINITY {
            return greedy(logits);
        }
        SCRATCH.with_borrow_mut(|(weights, keys)| {
            weights.resize(logits.len(), 0.0);
            let total = sampling_weights(logits, max, p.temperature, weights);
            // Put in order (most likely first, ties to the lower id) only as far as the draw
            // reaches.
            let mut cand = Ranked::new(weights, keys, total);
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
        })
    }
}

thread_local! {
    /// A draw's weights (one per logit) and candidates' keys, kept between a thread's draws:
    /// at Qwen3's vocabulary 0.6 MB and 1.2 MB (up to 2.4 MB once a walk takes the light
    /// candidates), which a fresh allocation per draw would fault in anew.
    static SCRATCH: RefCell<(Vec<f32>, Vec<u64>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// A draw's *heavy* candidates: weights at or above this, against the top logit's 1
/// (`e^-11.1`). Only they are taken and ordered first; a draw that ends among them (on a
/// model's logits, nearly all: a few tokens hold most of the mass) never looks at the rest,
/// and one that walks past them takes and orders the rest then ([`Ranked`]). Taking and
/// partitioning all of Qwen3's ~152,000 candidates cost ~0.35 ms a draw, more than every other
/// part of it together.
const HEAVY: f32 = 1.0 / 65536.0;

/// Appends the [`key`] of every logit whose weight in `weights` (from `sampling_weights`: NaN
/// and `-inf` logits and exponents below its cut, `e^-87` of the top weight, have none) is
/// heavy ([`HEAVY`]), or, with `heavy` false, above 0 but not heavy, in id order; returns how
/// many weights are above 0.
fn take_candidates(weights: &[f32], heavy: bool, keys: &mut Vec<u64>) -> usize {
    let start = keys.len();
    keys.resize(start + weights.len(), 0);
    let out = &mut keys[start..];
    // Every key is written and the next lands past it only where it is taken: no branch per
    // logit (a filtered `extend` took ~1.2 ns a logit).
    let (mut n, mut positive) = (0, 0);
    for (i, &w) in weights.iter().enumerate() {
        out[n] = key(i as u32, w);
        let take = if heavy {
            w >= HEAVY
        } else {
            w > 0.0 && w < HEAVY
        };
        n += usize::from(take);
        positive += usize::from(w > 0.0);
    }
    keys.truncate(start + n);
    positive
}

/// A candidate as one integer whose ascending order is the draw's: heavier first, then the
/// lower id. A positive weight's bits order as its value, so the high half is their
/// complement and the low half the id; comparing plain integers made the partition of
/// Qwen3's ~152,000 candidates several times faster than a comparator on `(id, f64)` pairs.
fn key(id: u32, weight: f32) -> u64 {
    (u64::from(!weight.to_bits()) << 32) | u64::from(id)
}

/// The `(id, weight)` of a [`key`].
fn unkey(key: u64) -> (u32, f64) {
    (key as u32, f64::from(f32::from_bits(!((key >> 32) as u32))))
}

/// Draws the next token of each `(row, sampler)` from its row of `logits` (rows of `vocab`),
/// on up to `threads` threads at once (scoped; this one takes the first share): `(row, draw)`
/// in the order given. A draw takes the exponential of every logit (in vector lanes,
/// `sampling_weights`), so at Qwen3's vocabulary it costs a fraction of a millisecond
/// (`docs/serving.md`) — on the engine's thread, between steps. Each sampler is its own
/// state, so the draws are the same on any number of threads.
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

/// A draw's candidates ([`key`]s) put in order — heaviest first, ties to the lower id —
/// lazily: only the first `sorted` are in order, and only the heavy ones ([`HEAVY`]) are taken
/// until the order must reach past them. A draw rarely walks past the first few hundred of a
/// vocabulary's ~150,000 candidates, and sorting all of them took 7.5 ms a token (Qwen3's
/// vocabulary, `docs/benchmarks.md`, session 54): at batch 16 more than a decode step's time
/// on the engine's thread. The order is extended in steps (partition the rest around the next
/// step's last place, then sort the step: `O(n)` each), so a walk that does reach far still
/// ends in one full order.
struct Ranked<'a> {
    /// Every logit's weight (0: not a candidate).
    weights: &'a [f32],
    /// The heavy candidates, then (once taken) the rest; the first `sorted` in order.
    keys: &'a mut Vec<u64>,
    sorted: usize,
    /// How many candidates are heavy: each comes before every other in the order.
    heavy: usize,
    /// How many candidates there are (weights above 0), taken or not.
    count: usize,
    /// The sum of the weights: given for the whole set (`sampling_weights`' lanes), summed in
    /// order at [`Ranked::truncate`].
    total: f64,
}

impl<'a> Ranked<'a> {
    /// The first place step: the draws' usual reach on a real model's logits, with room.
    const FIRST: usize = 256;

    /// The candidates of `weights`, whose sum is `total`; `keys` is scratch.
    fn new(weights: &'a [f32], keys: &'a mut Vec<u64>, total: f64) -> Ranked<'a> {
        keys.clear();
        let count = take_candidates(weights, true, keys);
        let heavy = keys.len();
        Ranked {
            weights,
            keys,
            sorted: 0,
            heavy,
            count,
            total,
        }
    }

    fn len(&self) -> usize {
        self.count
    }

    /// Puts the first `n` candidates in order: among the heavy ones alone where `n` stays
    /// among them, else after taking the rest.
    fn sort_to(&mut self, n: usize) {
        let n = n.min(self.count);
        if n <= self.sorted {
            return;
        }
        if n > self.heavy && self.keys.len() < self.count {
            take_candidates(self.weights, false, self.keys);
        }
        let end = if n <= self.heavy {
            self.heavy
        } else {
            self.count
        };
        let rest = &mut self.keys[self.sorted..end];
        let last = n - self.sorted - 1;
        if last + 1 < rest.len() {
            rest.select_nth_unstable(last);
        }
        rest[..=last].sort_unstable();
        self.sorted = n;
    }

    /// Candidate `i` (below [`Ranked::len`]) in order: `(id, weight)`. The order grows in
    /// steps, held to the heavy candidates while `i` is one of them.
    fn get(&mut self, i: usize) -> (u32, f64) {
        if i >= self.sorted {
            let step = Self::FIRST.max(2 * self.sorted);
            let mut n = i + 1 + step;
            if i < self.heavy {
                n = n.min(self.heavy);
            }
            self.sort_to(n);
        }
        unkey(self.keys[i])
    }

    /// Keeps the `n` first in order, the sum of their weights summed in that order (nothing
    /// changes where all `n` are kept).
    fn truncate(&mut self, n: usize) {
        if n >= self.count {
            return;
        }
        self.sort_to(n);
        self.keys.truncate(n);
        self.count = n;
        self.heavy = self.heavy.min(n);
        self.total = self.keys.iter().map(|&k| unkey(k).1).sum();
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
    /// Every candidate `(id, weight)` sorted whole (heaviest first, ties to the lower id), and
    /// the vector pass's sum. The weights are the kernel's (tested against `f64::exp` with the
    /// kernels); what the references check is the order, the cuts and the walk.
    fn full_order(logits: &[f32], max: f32, temperature: f32) -> (Vec<(u32, f64)>, f64) {
        let mut weights = vec![0.0f32; logits.len()];
        let total = sampling_weights(logits, max, temperature, &mut weights);
        (ordered(&weights), total)
    }

    /// The non-zero weights as `(id, weight)`, heaviest first, ties by id: the order a draw
    /// walks.
    fn ordered(weights: &[f32]) -> Vec<(u32, f64)> {
        let mut cand: Vec<(u32, f64)> = weights
            .iter()
            .enumerate()
            .filter(|&(_, &w)| w > 0.0)
            .map(|(i, &w)| (i as u32, f64::from(w)))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        cand
    }

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
        let (mut cand, _) = full_order(logits, max, p.temperature);
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
    /// wide that most weights are cut (exponents either side of -87), and with and without
    /// top-k and top-p. (Where top-k removes candidates every sum is taken in the same order
    /// as before; otherwise the whole set's sum is the kernel's, in lanes of id order, which
    /// can move a draw, or top-p's cut, that falls within rounding of a boundary: none of these
    /// does.)
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
        // Spread as a random model's: most weights are cut; at temperature 1 some exponents
        // land just either side of the cut.
        let mut wide: Vec<f32> = (0..4000).map(|_| next() * 4000.0).collect();
        let top = wide.iter().copied().fold(f32::MIN, f32::max);
        for (i, d) in [(1, 86.0), (2, 86.9), (3, 87.0), (4, 87.1), (5, 0.5)] {
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

    /// A draw at the top of the generator's range (this seed's first is 1 − 2^-53) can run
    /// past every candidate by the rounding of its subtractions: it then takes the last
    /// candidate in order, as the full sort does. Over many rows some do.
    #[test]
    fn a_walk_past_the_end_takes_the_last_candidate() {
        let seed = 0xf56e_309e_96a0_4737;
        let mut probe = Sampler::new(SamplingParams {
            seed,
            ..SamplingParams::default()
        });
        assert_eq!(probe.next_f64(), 1.0 - f64::EPSILON / 2.0);
        let mut st = 3u64;
        let mut last_taken = 0;
        for row in 0..2000 {
            // Spread over 60: the lightest weights (~e^-60) lie below the rounding of the
            // walk's subtractions, so the walk can end past them.
            let logits: Vec<f32> = (0..256)
                .map(|_| {
                    st = st
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (st >> 40) as f32 / (1u64 << 24) as f32 * 60.0
                })
                .collect();
            let params = SamplingParams {
                temperature: 1.0,
                top_k: None,
                top_p: 1.0,
                seed,
            };
            let got = Sampler::new(params).sample(&logits);
            // The full order with the sum the sampler takes (the vector pass's: at a draw this
            // close to the top the sum's rounding decides), walked from the same draw.
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (order, total) = full_order(&logits, max, 1.0);
            let mut u = (1.0 - f64::EPSILON / 2.0) * total;
            let mut want = order.last().map(|c| c.0);
            for &(id, w) in &order {
                if u < w {
                    want = Some(id);
                    break;
                }
                u -= w;
            }
            assert_eq!(got, want, "row {row}");
            // The lightest candidate (the last in order: the larger id of a tie) is what the
            // walk's end gives; a draw of 1 - 2^-53 lands on it no other way, its weight
            // being far below 2^-53 of the sum.
            let lightest = (0..logits.len())
                .min_by(|&i, &j| logits[i].total_cmp(&logits[j]).then(j.cmp(&i)))
                .map(|i| i as u32);
            last_taken += usize::from(got == lightest);
        }
        assert!(last_taken > 0, "no row ran past its candidates");
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

    /// The candidates are exactly the logits with a weight: finite, with an exponent at or
    /// above the kernel's cut (`e^-87` of the top weight), the heavy ones and then the rest,
    /// each in id order, each key giving back its id and weight — on logits either side of
    /// the cut and right at it, at several temperatures.
    #[test]
    fn the_candidates_are_the_logits_with_weight() {
        let max = 10.0f32;
        let mut logits: Vec<f32> = (0..20_000).map(|i| max - i as f32 * 0.0625).collect();
        logits.extend([
            f32::NAN,
            f32::NEG_INFINITY,
            max - 86.5,
            max - 87.0,
            max - 87.25,
        ]);
        for t in [1.0f32, 0.5, 0.7, 1.3] {
            let mut weights = vec![0.0f32; logits.len()];
            sampling_weights(&logits, max, t, &mut weights);
            let mut keys = Vec::new();
            let positive = take_candidates(&weights, true, &mut keys);
            let heavy = keys.len();
            assert_eq!(take_candidates(&weights, false, &mut keys), positive);
            let got: Vec<(u32, f64)> = keys.iter().map(|&k| unkey(k)).collect();
            let (logits, weights) = (&logits, &weights);
            let with_weight = |light: bool| {
                logits
                    .iter()
                    .enumerate()
                    .filter(move |&(i, &v)| {
                        v.is_finite() && (v - max) / t >= -87.0 && (weights[i] < HEAVY) == light
                    })
                    .map(|(i, _)| (i as u32, f64::from(weights[i])))
            };
            let want: Vec<(u32, f64)> = with_weight(false).chain(with_weight(true)).collect();
            assert_eq!(got, want, "temperature {t}");
            assert_eq!(positive, got.len(), "temperature {t}");
            assert!(
                heavy > 0 && heavy < got.len(),
                "temperature {t}: {heavy} heavy"
            );
            assert!(got.iter().all(|c| c.1 > 0.0), "temperature {t}");
            // The last kept exponent is at the cut (logit max - 87 at temperature 1).
            if t == 1.0 {
                assert!(got.iter().any(|c| c.0 == 20_003));
                assert!(!got.iter().any(|c| c.0 == 20_004));
            }
        }
    }

    /// The lazy order is the full order however far it is asked and whatever the split
    /// between heavy and light candidates: none light, none heavy, and mixed (with weights of
    /// 0 among them, which are no candidates).
    #[test]
    fn ranked_candidates_come_in_order_however_far_they_are_asked() {
        for (name, light_every, zero_every) in
            [("all heavy", 0, 0), ("all light", 1, 0), ("mixed", 3, 7)]
        {
            let mut st = 5u64;
            let weights: Vec<f32> = (0..5000u32)
                .map(|i| {
                    st = st.wrapping_mul(6364136223846793005).wrapping_add(1);
                    // Few distinct weights: many ties, broken by the lower id.
                    let w = ((st >> 60) as f32 + 1.0) / 16.0;
                    if zero_every > 0 && i % zero_every == 0 {
                        0.0
                    } else if zero_every > 0 && i % 11 == 0 {
                        // Exactly at the boundary: heavy.
                        HEAVY
                    } else if light_every > 0 && i % light_every == 0 {
                        w * HEAVY / 2.0
                    } else {
                        w
                    }
                })
                .collect();
            let want = ordered(&weights);
            let heavy = want.iter().filter(|c| c.1 >= f64::from(HEAVY)).count();
            let mut reaches = vec![0, 1, 255, 256, 257, 1000, want.len() - 1];
            reaches.extend([heavy.saturating_sub(1), heavy, heavy + 1]);
            for reach in reaches.into_iter().filter(|&r| r < want.len()) {
                let mut keys = Vec::new();
                let mut r = Ranked::new(&weights, &mut keys, 0.0);
                assert_eq!(r.len(), want.len(), "{name}");
                assert_eq!(r.get(reach), want[reach], "{name}: reach {reach}");
                for (i, &w) in want.iter().enumerate() {
                    assert_eq!(r.get(i), w, "{name}: reach {reach}, then {i}");
                }
            }
            let cuts = [1, heavy.max(1), heavy + 1, 300];
            for n in cuts.into_iter().filter(|&n| n < want.len()) {
                let mut keys = Vec::new();
                let mut r = Ranked::new(&weights, &mut keys, 0.0);
                r.truncate(n);
                assert_eq!(r.len(), n, "{name}: truncate {n}");
                let kept: Vec<(u32, f64)> = (0..n).map(|i| r.get(i)).collect();
                assert_eq!(kept, want[..n], "{name}: truncate {n}");
                assert_eq!(r.total(), want[..n].iter().map(|c| c.1).sum::<f64>());
            }
        }
    }

    /// A key orders as the draw does and gives back its id and weight bits, for weights from
    /// the least subnormal to the largest float and ids at both ends.
    #[test]
    fn keys_order_heavier_first_then_the_lower_id() {
        let ws = [
            f32::from_bits(1),
            1e-38,
            0.5,
            1.0,
            1.0 + f32::EPSILON,
            f32::MAX,
        ];
        let ids = [0u32, 1, 7, u32::MAX - 1, u32::MAX];
        let mut all: Vec<(u32, f32)> = ws.iter().flat_map(|&w| ids.map(|i| (i, w))).collect();
        for &(i, w) in &all {
            let (id, back) = unkey(key(i, w));
            assert_eq!((id, back.to_bits()), (i, f64::from(w).to_bits()));
        }
        let mut by_key = all.clone();
        by_key.sort_by_key(|&(i, w)| key(i, w));
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        assert_eq!(by_key, all);
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
        // Greedy among the infinite ones: the lower id, every draw.
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, f32::INFINITY, 1.0, f32::INFINITY]), Some(1));
        }
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
