//! Benchmark statistics for every `simpler bench`: warm-up handling, summaries with a 95%
//! interval, multi-rank rounds, and the interleaved A/B comparison whose drift cancels.
//!
//! The interval of a summary is the Student t-interval of the mean. A comparison is the median
//! of the paired ratios `B[k] / A[k]`, with a seeded percentile bootstrap over the pairs.

use std::fmt::Write as _;
use std::io::Write;

use simpler_core::CallConfig;

use crate::stats::{self, SplitMix64};

/// Which interval [`Summary::ci95`] is.
pub const SUMMARY_INTERVAL: &str = "t-interval of the mean";
/// Fraction trimmed from each end for [`Summary::trimmed_mean`].
pub const TRIM_FRACTION: f64 = 0.10;
/// Bootstrap resamples of [`compare`].
pub const BOOTSTRAP_RESAMPLES: usize = 2000;
/// Seed of [`compare`]'s bootstrap (fixed, so a report is reproducible).
pub const BOOTSTRAP_SEED: u64 = 0x5151_7E57_0000_0001;

/// Statistics of one metric over measured rounds (in the samples' unit).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Samples summarised.
    pub n: usize,
    /// Smallest.
    pub min: f64,
    /// Median.
    pub median: f64,
    /// Mean.
    pub mean: f64,
    /// Largest.
    pub max: f64,
    /// Mean of the samples left after dropping 10% (rounded down) from each end.
    pub trimmed_mean: f64,
    /// Sample standard deviation.
    pub std_dev: f64,
    /// 95% t-interval of the mean (`mean ± t(0.975, n-1) · s / √n`); the mean itself when
    /// n = 1; NaN when n = 0.
    pub ci95: (f64, f64),
}

impl Summary {
    /// Summarises all of `samples`.
    pub fn of(samples: &[f64]) -> Summary {
        let n = samples.len();
        if n == 0 {
            let nan = f64::NAN;
            return Summary {
                n,
                min: nan,
                median: nan,
                mean: nan,
                max: nan,
                trimmed_mean: nan,
                std_dev: nan,
                ci95: (nan, nan),
            };
        }
        let sorted = stats::sorted(samples);
        let mean = stats::mean(samples);
        let std_dev = stats::std_dev(samples);
        // One sample: no interval (NaN bounds), rather than a zero-width one.
        let half = if n > 1 {
            stats::t_975(n - 1) * std_dev / (n as f64).sqrt()
        } else {
            f64::NAN
        };
        Summary {
            n,
            min: sorted[0],
            median: stats::median(samples),
            mean,
            max: sorted[n - 1],
            trimmed_mean: stats::trimmed_mean(samples, TRIM_FRACTION),
            std_dev,
            ci95: (mean - half, mean + half),
        }
    }

    /// Discards the first `warmup` samples, then summarises the rest.
    pub fn after_warmup(samples: &[f64], warmup: usize) -> Summary {
        Summary::of(&samples[warmup.min(samples.len())..])
    }
}

/// Rounds of a multi-rank benchmark combined per round.
#[derive(Clone, Debug, PartialEq)]
pub struct MultiRank {
    /// Per valid round: the slowest rank (`effective_us`).
    pub effective: Vec<f64>,
    /// Per valid round: the fastest rank (`fast_effective_us`).
    pub fast_effective: Vec<f64>,
    /// Rounds where every rank reported.
    pub valid_rounds: usize,
    /// Measured rounds (after warm-up).
    pub rounds: usize,
}

/// Combines per-round, per-rank values: discards the first `warmup` rounds, drops a round in
/// which any of the `n_ranks` ranks is missing (`None`, or fewer values than ranks), and keeps
/// the max over ranks (`effective`) and the min (`fast_effective`) of the others.
pub fn combine_ranks(rounds: &[Vec<Option<f64>>], n_ranks: usize, warmup: usize) -> MultiRank {
    let measured = &rounds[warmup.min(rounds.len())..];
    let mut out = MultiRank {
        effective: Vec::new(),
        fast_effective: Vec::new(),
        valid_rounds: 0,
        rounds: measured.len(),
    };
    for r in measured {
        if n_ranks == 0 || r.len() < n_ranks || r[..n_ranks].iter().any(Option::is_none) {
            continue;
        }
        let vals = r[..n_ranks].iter().flatten();
        out.effective
            .push(vals.clone().copied().fold(f64::NEG_INFINITY, f64::max));
        out.fast_effective
            .push(vals.copied().fold(f64::INFINITY, f64::min));
        out.valid_rounds += 1;
    }
    out
}

/// Paired measurements of two variants run interleaved.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Interleaved {
    /// Measured values of A (round k).
    pub a: Vec<f64>,
    /// Measured values of B (round k, paired with `a[k]`).
    pub b: Vec<f64>,
    /// The order everything ran in, warm-up included (`"ABBAAB..."`).
    pub order: String,
    /// Warm-up pairs run first and discarded.
    pub warmup: usize,
}

impl Interleaved {
    /// [`compare`] of the kept pairs, remembering the warm-up pairs discarded before them.
    pub fn compare(&self) -> Comparison {
        Comparison {
            warmup: self.warmup,
            ..compare(&self.a, &self.b)
        }
    }
}

/// Runs `warmup + rounds` rounds of both variants interleaved A B, B A, A B, B A, ... (so a
/// slow drift of the machine hits both equally) and keeps the pairs after the warm-up.
pub fn run_interleaved(
    rounds: usize,
    warmup: usize,
    mut a: impl FnMut() -> f64,
    mut b: impl FnMut() -> f64,
) -> Interleaved {
    let mut out = Interleaved {
        warmup,
        ..Interleaved::default()
    };
    for k in 0..warmup + rounds {
        let (va, vb) = if k % 2 == 0 {
            out.order.push_str("AB");
            let va = a();
            (va, b())
        } else {
            out.order.push_str("BA");
            let vb = b();
            (a(), vb)
        };
        if k >= warmup {
            out.a.push(va);
            out.b.push(vb);
        }
    }
    out
}

/// The median of the paired ratios `B[k] / A[k]` with its 95% interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// `median over k of B[k] / A[k]`: each pair ran side by side, so a drift of the machine
    /// between pairs cancels in its ratio.
    pub ratio: f64,
    /// 2.5% and 97.5% percentiles of the bootstrap medians.
    pub ci95: (f64, f64),
    /// Summary of A.
    pub a: Summary,
    /// Summary of B.
    pub b: Summary,
    /// Bootstrap resamples.
    pub resamples: usize,
    /// Bootstrap seed.
    pub seed: u64,
    /// Warm-up pairs discarded before these ([`Interleaved::compare`]; 0 from [`compare`]).
    pub warmup: usize,
}

/// Compares paired rounds (`a[k]` ran next to `b[k]`) with [`BOOTSTRAP_RESAMPLES`] resamples
/// seeded with [`BOOTSTRAP_SEED`].
pub fn compare(a: &[f64], b: &[f64]) -> Comparison {
    compare_seeded(a, b, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)
}

/// [`compare`] with an explicit resample count and seed: the median of the paired ratios, and
/// each resample draws pair indices with replacement and takes the median of those pairs'
/// ratios.
pub fn compare_seeded(a: &[f64], b: &[f64], resamples: usize, seed: u64) -> Comparison {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let paired: Vec<f64> = a.iter().zip(b).map(|(x, y)| y / x).collect();
    let ratio = stats::median(&paired);
    let mut ratios = Vec::with_capacity(resamples);
    let mut rng = SplitMix64::new(seed);
    let mut r = vec![0.0; n];
    if n > 0 {
        for _ in 0..resamples {
            for v in r.iter_mut() {
                *v = paired[rng.below(n)];
            }
            ratios.push(stats::median(&r));
        }
    }
    let sorted = stats::sorted(&ratios);
    let ci95 = (
        stats::percentile_sorted(&sorted, 2.5).unwrap_or(f64::NAN),
        stats::percentile_sorted(&sorted, 97.5).unwrap_or(f64::NAN),
    );
    Comparison {
        ratio,
        ci95,
        a: Summary::of(a),
        b: Summary::of(b),
        resamples,
        seed,
        warmup: 0,
    }
}

/// Which diagnostics were on while measuring (the report must say).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Diagnostics {
    /// Swimlane level (0 off).
    pub swimlane: u8,
    /// Dependency capture.
    pub dep_gen: bool,
    /// Ring statistics.
    pub ring_stats: bool,
    /// Span trace file written.
    pub trace: bool,
}

impl Diagnostics {
    /// The diagnostics a configuration turns on.
    pub fn of(config: &CallConfig) -> Diagnostics {
        Diagnostics {
            swimlane: config.swimlane,
            dep_gen: config.dep_gen,
            ring_stats: config.ring_stats,
            trace: config.trace.is_some(),
        }
    }
}

/// `diagnostics: swimlane=off dep_gen=off ring_stats=off trace=on` (always-on run timing is not
/// listed: it is always on).
pub fn format_diagnostics(d: &Diagnostics) -> String {
    let on = |b: bool| if b { "on" } else { "off" };
    let sw = if d.swimlane == 0 {
        "off".to_string()
    } else {
        format!("level{}", d.swimlane)
    };
    let any = d.swimlane > 0 || d.dep_gen || d.ring_stats || d.trace;
    format!(
        "diagnostics: swimlane={sw} dep_gen={} ring_stats={} trace={}{}",
        on(d.dep_gen),
        on(d.ring_stats),
        on(d.trace),
        if any {
            " (timings include their cost)"
        } else {
            ""
        }
    )
}

/// One line: `effective_us: n=20 min=.. median=.. mean=.. max=.. trimmed_mean=.. ci95=[.., ..]
/// (t-interval of the mean)`, plus the warm-up count when given.
pub fn format_summary(metric: &str, s: &Summary, warmup: usize) -> String {
    // One sample has no spread to give an interval from (its t-interval would be [x, x]).
    let interval = if s.n < 2 {
        "ci95=none (one sample gives no interval)".to_string()
    } else {
        format!(
            "ci95=[{:.2}, {:.2}] ({SUMMARY_INTERVAL})",
            s.ci95.0, s.ci95.1
        )
    };
    format!(
        "{metric}: n={} (warm-up {warmup} discarded) min={:.2} median={:.2} mean={:.2} max={:.2} trimmed_mean={:.2} {interval}",
        s.n, s.min, s.median, s.mean, s.max, s.trimmed_mean
    )
}

/// Lines for a multi-rank benchmark: `effective_us` (max over ranks), `fast_effective_us` (min)
/// and `valid_rounds=n/M`.
pub fn format_multi_rank(m: &MultiRank, warmup: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}",
        format_summary("effective_us", &Summary::of(&m.effective), warmup)
    );
    let _ = writeln!(
        out,
        "{}",
        format_summary("fast_effective_us", &Summary::of(&m.fast_effective), warmup)
    );
    let _ = write!(out, "valid_rounds={}/{}", m.valid_rounds, m.rounds);
    if m.valid_rounds < m.rounds {
        let _ = write!(
            out,
            " ({} rounds dropped: a rank did not report)",
            m.rounds - m.valid_rounds
        );
    }
    out
}

/// Lines for an interleaved comparison of `name_a` (A) and `name_b` (B).
pub fn format_compare(metric: &str, name_a: &str, name_b: &str, c: &Comparison) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}",
        format_summary(&format!("{metric} [A: {name_a}]"), &c.a, c.warmup)
    );
    let _ = writeln!(
        out,
        "{}",
        format_summary(&format!("{metric} [B: {name_b}]"), &c.b, c.warmup)
    );
    if c.a.n < MIN_PAIRS_FOR_INTERVAL {
        // One or two pairs: every resample's median is one of a handful of values, so a
        // percentile interval would only restate the data (one pair: [r, r]).
        let _ = write!(
            out,
            "median of paired ratios B/A = {:.4} over {} interleaved pair(s): no 95% interval from fewer than {MIN_PAIRS_FOR_INTERVAL} pairs (more --rounds give one)",
            c.ratio, c.a.n
        );
        return out;
    }
    let _ = write!(
        out,
        "median of paired ratios B/A = {:.4}, 95% interval [{:.4}, {:.4}] (bootstrap over {} interleaved pairs, {} resamples, seed {:#x})",
        c.ratio, c.ci95.0, c.ci95.1, c.a.n, c.resamples, c.seed
    );
    out
}

/// Fewest pairs [`format_compare`] gives an interval for.
pub const MIN_PAIRS_FOR_INTERVAL: usize = 3;

/// Writes a full single-metric report: the diagnostics line, then the summary.
pub fn write_report(
    w: &mut dyn Write,
    metric: &str,
    samples: &[f64],
    warmup: usize,
    diag: &Diagnostics,
) -> std::io::Result<()> {
    writeln!(w, "{}", format_diagnostics(diag))?;
    writeln!(
        w,
        "{}",
        format_summary(metric, &Summary::after_warmup(samples, warmup), warmup)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-3
    }

    #[test]
    fn summary_known_answer() {
        // 3 warm-up rounds, then 1..=10.
        let mut xs = vec![1000.0, 900.0, 800.0];
        xs.extend((1..=10).map(f64::from));
        let s = Summary::after_warmup(&xs, 3);
        assert_eq!(
            (s.n, s.min, s.median, s.mean, s.max, s.trimmed_mean),
            (10, 1.0, 5.5, 5.5, 10.0, 5.5)
        );
        // s = 3.02765, se = 0.957427, t(9) = 2.262.
        assert!(
            close(s.ci95.0, 3.3343) && close(s.ci95.1, 7.6657),
            "{:?}",
            s.ci95
        );
        let t = Summary::of(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 100.0]);
        assert_eq!(t.trimmed_mean, 5.5);
        assert_eq!(t.median, 5.5);
        assert_eq!(t.mean, 14.5);
        let one = Summary::of(&[4.0]).ci95;
        assert!(
            one.0.is_nan() && one.1.is_nan(),
            "one sample gives no interval"
        );
        assert!(Summary::of(&[]).median.is_nan());
    }

    #[test]
    fn ranks_take_max_and_min_and_drop_incomplete_rounds() {
        let rounds = vec![
            vec![Some(99.0), Some(99.0)], // warm-up
            vec![Some(10.0), Some(12.0)],
            vec![Some(11.0), None],
            vec![Some(9.0), Some(8.0)],
            vec![Some(7.0)],
        ];
        let m = combine_ranks(&rounds, 2, 1);
        assert_eq!(m.effective, vec![12.0, 9.0]);
        assert_eq!(m.fast_effective, vec![10.0, 8.0]);
        assert_eq!((m.valid_rounds, m.rounds), (2, 4));
        let text = format_multi_rank(&m, 1);
        assert!(text.contains("valid_rounds=2/4"), "{text}");
        assert!(
            text.contains("effective_us: n=2") && text.contains("fast_effective_us: n=2"),
            "{text}"
        );
    }

    #[test]
    fn interleaving_is_abba_and_drift_cancels() {
        let calls = std::cell::RefCell::new(Vec::new());
        // A costs 100 + drift, B costs 110 + drift: the drift is a linear ramp.
        let drift = std::cell::Cell::new(0.0);
        let r = run_interleaved(
            8,
            2,
            || {
                calls.borrow_mut().push('A');
                drift.set(drift.get() + 1.0);
                100.0 + drift.get()
            },
            || {
                calls.borrow_mut().push('B');
                drift.set(drift.get() + 1.0);
                110.0 + drift.get()
            },
        );
        assert_eq!(r.order, "ABBAABBAABBAABBAABBA");
        assert_eq!(calls.borrow().iter().collect::<String>(), r.order);
        assert_eq!((r.a.len(), r.b.len()), (8, 8));
        let c = compare(&r.a, &r.b);
        // Both medians carry the same drift (12.5): A = 112.5, B = 122.5.
        assert_eq!((c.a.median, c.b.median), (112.5, 122.5));
        // Each pair's B ran one drift step after or before its A, alternately: the paired
        // ratios straddle the drift-free 1.1 and their median lies between the two kinds.
        let mut paired: Vec<f64> = r.a.iter().zip(&r.b).map(|(a, b)| b / a).collect();
        paired.sort_by(f64::total_cmp);
        assert_eq!(c.ratio, (paired[3] + paired[4]) / 2.0);
        assert!((1.08..1.10).contains(&c.ratio), "{c:?}");
        assert!(c.ci95.0 <= c.ratio && c.ratio <= c.ci95.1, "{c:?}");
        // Seeded: the same input gives the same interval.
        assert_eq!(compare(&r.a, &r.b), c);
    }

    #[test]
    fn compare_known_answer() {
        let a = [10.0, 10.0, 10.0, 10.0];
        let b = [15.0, 15.0, 15.0, 15.0];
        let c = compare_seeded(&a, &b, 100, 1);
        assert_eq!((c.ratio, c.ci95), (1.5, (1.5, 1.5)));
        let a: Vec<f64> = (0..40).map(|k| 100.0 + (k % 5) as f64).collect();
        let b: Vec<f64> = a.iter().map(|x| x * 2.0).collect();
        let c = compare(&a, &b);
        assert_eq!(c.ratio, 2.0);
        assert!(close(c.ci95.0, 2.0) && close(c.ci95.1, 2.0), "{c:?}");
        let text = format_compare("effective_us", "off", "on", &c);
        assert!(
            text.contains("median of paired ratios B/A = 2.0000"),
            "{text}"
        );
        // Paired: a machine that drifts between pairs (A and B both doubling) leaves each
        // pair's ratio alone; the ratio of the medians would mix the drift in.
        let a = [10.0, 10.0, 20.0, 20.0, 20.0];
        let b = [11.0, 11.0, 22.0, 22.0, 22.0];
        let c = compare_seeded(&a, &b, 100, 1);
        assert!(
            close(c.ratio, 1.1) && close(c.ci95.0, 1.1) && close(c.ci95.1, 1.1),
            "{c:?}"
        );
        let a = [10.0, 10.0, 10.0, 30.0, 30.0];
        let b = [12.0, 12.0, 30.0, 33.0, 33.0];
        // Ratios 1.2, 1.2, 3.0, 1.1, 1.1: median 1.2 (of medians: 30 / 10 = 3).
        assert!(close(compare_seeded(&a, &b, 100, 1).ratio, 1.2));
        let pairs = run_interleaved(3, 2, || 1.0, || 2.0);
        let c = pairs.compare();
        assert_eq!((c.warmup, c.a.n), (2, 3));
        assert!(format_compare("x", "a", "b", &c).contains("warm-up 2 discarded"));
        assert!(format_compare("x", "a", "b", &c).contains("95% interval ["));
        // One sample: a summary without an interval.
        let one = Summary::of(&[4.0]);
        assert!(one.ci95.0.is_nan() && one.ci95.1.is_nan());
        let line = format_summary("x", &one, 0);
        assert!(
            line.contains("ci95=none") && !line.contains("ci95=["),
            "{line}"
        );
        // One or two pairs give a ratio and no interval (one pair's would be [r, r]).
        for n in [1, 2] {
            let c = compare_seeded(&vec![10.0; n], &vec![13.0; n], 100, 1);
            let text = format_compare("x", "a", "b", &c);
            assert!(
                text.contains("B/A = 1.3000") && text.contains("no 95% interval"),
                "{text}"
            );
            assert!(!text.contains("interval ["), "{text}");
        }
    }

    #[test]
    fn printers_say_which_diagnostics_were_on() {
        let d = Diagnostics {
            swimlane: 2,
            dep_gen: false,
            ring_stats: true,
            trace: false,
        };
        let line = format_diagnostics(&d);
        assert_eq!(
            line,
            "diagnostics: swimlane=level2 dep_gen=off ring_stats=on trace=off (timings include their cost)"
        );
        assert_eq!(
            format_diagnostics(&Diagnostics::of(&CallConfig::default())),
            "diagnostics: swimlane=off dep_gen=off ring_stats=off trace=off"
        );
        let mut buf = Vec::new();
        write_report(&mut buf, "effective_us", &[5.0, 1.0, 2.0, 3.0], 1, &d).unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert!(
            text.contains("n=3 (warm-up 1 discarded) min=1.00 median=2.00"),
            "{text}"
        );
    }
}
