//! `simpler trace timing`: per-callable span statistics, one row per invocation (`--rounds`)
//! and the median span tree (`--tree`), with the timing layers ①–④ of `docs/trace-format.md`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write;

use simpler_core::trace::AttrValue;

use crate::bench_stats::{self, Summary};
use crate::reader::{AlignedSpan, Trace};
use crate::stats::{self, us};

/// One run of one process: the spans sharing `(process, inv, callable)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Invocation {
    /// Index into [`Trace::processes`].
    pub process: usize,
    /// Process id.
    pub pid: u32,
    /// Per-process invocation counter.
    pub inv: u64,
    /// Callable hash.
    pub callable: String,
    /// The `label` attribute of its `run` span, if it has one.
    pub label: Option<String>,
    /// Its `run` span says `warmup: true`: the caller ran it outside its measurements.
    pub warmup: bool,
    /// Earliest span start (wall ns).
    pub wall_ns: u64,
    /// Indices into [`Trace::spans`], in file order.
    pub spans: Vec<usize>,
}

/// The invocations of one callable.
#[derive(Clone, Debug, PartialEq)]
pub struct CallableGroup {
    /// Callable hash.
    pub callable: String,
    /// Distinct labels its `run` spans carry (empty: none said).
    pub labels: Vec<String>,
    /// Invocations, earliest first.
    pub invs: Vec<Invocation>,
    /// Sum of its `run` durations (what "busiest" sorts by).
    pub run_total_ns: u64,
}

impl CallableGroup {
    /// `decode`, `decode/prefill`, or `-` when no `run` span said.
    pub fn label(&self) -> String {
        if self.labels.is_empty() {
            "-".into()
        } else {
            self.labels.join("/")
        }
    }

    /// The invocations statistics are taken over: those the trace does not mark warm-up; all
    /// of them where every one is marked (a bench's recorded warm-up step alone is still worth
    /// reading). The second value says which, for the table's header.
    pub fn for_statistics(&self) -> (CallableGroup, Option<String>) {
        let note = self.statistics_note();
        if self.invs.iter().all(|i| i.warmup) {
            return (self.clone(), note);
        }
        let group = CallableGroup {
            invs: self.invs.iter().filter(|i| !i.warmup).cloned().collect(),
            ..self.clone()
        };
        (group, note)
    }

    /// What [`CallableGroup::for_statistics`] says of the warm-up marks (`None`: there are none).
    fn statistics_note(&self) -> Option<String> {
        let warm = self.invs.iter().filter(|i| i.warmup).count();
        if warm == 0 {
            None
        } else if warm == self.invs.len() {
            Some(format!(
                "all {warm} invocations are marked warm-up: shown, as nothing else is"
            ))
        } else {
            Some(format!("{warm} invocations marked warm-up left out"))
        }
    }
}

/// One row of `--rounds` (durations in ns; `None` where the span is absent).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Round {
    /// Process id.
    pub pid: u32,
    /// Invocation.
    pub inv: u64,
    /// `run`.
    pub host: Option<u64>,
    /// `run.runner.device_wall`.
    pub device: Option<u64>,
    /// `max(orch end, sched end) - min(orch start, sched start)`.
    pub effective: Option<u64>,
    /// `orch`.
    pub orch: Option<u64>,
    /// `sched`.
    pub sched: Option<u64>,
    /// `run.runner`.
    pub runner: Option<u64>,
    /// `engine.step`: the engine's whole step around the run, where the engine recorded it.
    pub engine: Option<u64>,
}

impl Round {
    /// Layers ①–⑤ of `docs/trace-format.md` in ns (signed: a negative value means mis-nested
    /// spans); ⑤ only where the engine recorded its step (`engine.step`).
    pub fn layers(&self) -> [Option<i64>; 5] {
        let signed = |x: i128| x.clamp(i64::MIN as i128, i64::MAX as i128) as i64;
        let d = |a: Option<u64>, b: Option<u64>| Some(signed(a? as i128 - b? as i128));
        [
            self.effective.map(|e| signed(e as i128)),
            d(self.device, self.effective),
            d(self.runner, self.device),
            d(self.host, self.runner),
            d(self.engine, self.host),
        ]
    }
}

/// Groups the spans into invocations, earliest first.
pub fn invocations(trace: &Trace) -> Vec<Invocation> {
    let mut map: BTreeMap<(usize, u64, &str), Invocation> = BTreeMap::new();
    for (i, s) in trace.spans.iter().enumerate() {
        let e = map
            .entry((s.process, s.span.inv, &s.span.callable))
            .or_insert_with(|| Invocation {
                process: s.process,
                pid: s.span.pid,
                inv: s.span.inv,
                callable: s.span.callable.clone(),
                label: None,
                warmup: false,
                wall_ns: s.wall_ns,
                spans: Vec::new(),
            });
        e.wall_ns = e.wall_ns.min(s.wall_ns);
        if s.span.name == "run" {
            if let Some(AttrValue::Str(l)) = s.span.attrs.get("label") {
                e.label = Some(l.clone());
            }
            e.warmup = s.span.attrs.get("warmup") == Some(&AttrValue::Bool(true));
        }
        e.spans.push(i);
    }
    let mut v: Vec<Invocation> = map.into_values().collect();
    v.sort_by_key(|i| (i.wall_ns, i.process, i.inv));
    v
}

/// Invocations grouped per callable, busiest (largest total `run` time) first.
pub fn by_callable(trace: &Trace) -> Vec<CallableGroup> {
    let mut groups: BTreeMap<String, CallableGroup> = BTreeMap::new();
    for inv in invocations(trace) {
        let g = groups
            .entry(inv.callable.clone())
            .or_insert_with(|| CallableGroup {
                callable: inv.callable.clone(),
                labels: Vec::new(),
                invs: Vec::new(),
                run_total_ns: 0,
            });
        if let Some(l) = &inv.label
            && !g.labels.contains(l)
        {
            g.labels.push(l.clone());
        }
        let run = first(trace, &inv, "run").map_or(0, |s| s.span.dur_ns);
        g.run_total_ns = g.run_total_ns.saturating_add(run);
        g.invs.push(inv);
    }
    let mut v: Vec<CallableGroup> = groups.into_values().collect();
    v.sort_by(|a, b| {
        b.run_total_ns
            .cmp(&a.run_total_ns)
            .then(a.callable.cmp(&b.callable))
    });
    v
}

/// The `--rounds` row of one invocation.
pub fn round(trace: &Trace, inv: &Invocation) -> Round {
    let dur = |name: &str| first(trace, inv, name).map(|s| s.span.dur_ns);
    let (o, s) = (first(trace, inv, "orch"), first(trace, inv, "sched"));
    let effective = match (o, s) {
        (Some(o), Some(s)) => Some(o.wall_end_ns().max(s.wall_end_ns()) - o.wall_ns.min(s.wall_ns)),
        (Some(x), None) | (None, Some(x)) => Some(x.span.dur_ns),
        (None, None) => None,
    };
    Round {
        pid: inv.pid,
        inv: inv.inv,
        host: dur("run"),
        device: dur("run.runner.device_wall"),
        effective,
        orch: o.map(|x| x.span.dur_ns),
        sched: s.map(|x| x.span.dur_ns),
        runner: dur("run.runner"),
        engine: dur("engine.step"),
    }
}

/// The default table: per callable, each span name (indented by depth) with n, mean, median,
/// min, max and p90 in µs, then the median layers ①–④.
pub fn timing_table(trace: &Trace) -> String {
    let mut out = String::new();
    for g in by_callable(trace) {
        header(&mut out, trace, &g);
        let g = statistics_of(&mut out, &g);
        let _ = writeln!(
            out,
            "{:<40} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "span (µs)", "n", "mean", "median", "min", "max", "p90"
        );
        let mut samples: HashMap<String, Vec<f64>> = HashMap::new();
        for inv in &g.invs {
            for &i in &inv.spans {
                let s = &trace.spans[i].span;
                samples
                    .entry(s.name.clone())
                    .or_default()
                    .push(s.dur_ns as f64);
            }
        }
        let eff: Vec<f64> = g
            .invs
            .iter()
            .filter_map(|i| round(trace, i).effective)
            .map(|e| e as f64)
            .collect();
        for (name, depth) in ordered_names(trace, &g.invs) {
            let label = format!("{}{}", "  ".repeat(depth as usize), name);
            row(&mut out, &label, &samples[&name]);
            if name == "sched" && !eff.is_empty() {
                row(
                    &mut out,
                    &format!("{}effective = orch ∪ sched", "  ".repeat(depth as usize)),
                    &eff,
                );
            }
        }
        layers(&mut out, trace, &g);
        out.push('\n');
    }
    if out.is_empty() {
        out.push_str("no spans in the trace\n");
    }
    let unaligned = trace.unaligned_device_spans();
    if unaligned > 0 {
        let _ = writeln!(
            out,
            "note: {unaligned} device spans had no device_alignment line and were taken as on the host axis"
        );
    }
    out
}

/// A named column: how to get a cell from a row.
type Column<R, T> = (&'static str, fn(&R) -> T);

/// `--rounds`: one row per invocation, then a summary of the rounds after the first `warmup`.
pub fn rounds_table(trace: &Trace, warmup: usize) -> String {
    let mut out = String::new();
    for g in by_callable(trace) {
        header(&mut out, trace, &g);
        let _ = writeln!(
            out,
            "{:>6} {:>8} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "Round", "Pid", "Inv", "Host", "Device", "Effective", "Orch", "Sched"
        );
        let rows: Vec<Round> = g.invs.iter().map(|i| round(trace, i)).collect();
        // The warm-up: the invocations the trace marks (unless it marks every one: then the
        // marks are set aside, as in the other tables), then each process's first `warmup` of
        // the others (with one process: the first unmarked rows).
        let note = g.statistics_note();
        let all_marked = g.invs.iter().all(|i| i.warmup);
        let mut seen: HashMap<usize, usize> = HashMap::new();
        let warm: Vec<bool> = g
            .invs
            .iter()
            .map(|i| {
                if i.warmup && !all_marked {
                    return true;
                }
                let k = seen.entry(i.process).or_insert(0);
                *k += 1;
                *k <= warmup
            })
            .collect();
        let cell = |v: Option<u64>| v.map_or("-".to_string(), |v| us(v as f64));
        for (k, r) in rows.iter().enumerate() {
            let mark = if warm[k] { " (warm-up)" } else { "" };
            let _ = writeln!(
                out,
                "{:>6} {:>8} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10}{mark}",
                k,
                r.pid,
                r.inv,
                cell(r.host),
                cell(r.device),
                cell(r.effective),
                cell(r.orch),
                cell(r.sched)
            );
        }
        let cols: [Column<Round, Option<u64>>; 5] = [
            ("Host", |r| r.host),
            ("Device", |r| r.device),
            ("Effective", |r| r.effective),
            ("Orch", |r| r.orch),
            ("Sched", |r| r.sched),
        ];
        let measured: Vec<Round> = rows
            .iter()
            .zip(&warm)
            .filter(|(_, w)| !**w)
            .map(|(r, _)| *r)
            .collect();
        if let Some(note) = note {
            let _ = writeln!(out, "({note})");
        }
        let _ = writeln!(
            out,
            "summary of {} rounds ({} warm-up excluded), µs:",
            measured.len(),
            rows.len() - measured.len()
        );
        let summaries: Vec<Summary> = cols
            .iter()
            .map(|(_, f)| {
                Summary::of(
                    &measured
                        .iter()
                        .filter_map(f)
                        .map(|v| v as f64)
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        let _ = write!(out, "{:>22}", "");
        for (name, _) in &cols {
            let _ = write!(out, " {name:>21}");
        }
        out.push('\n');
        let lines: [Column<Summary, String>; 4] = [
            ("median", |s| us(s.median)),
            ("mean", |s| us(s.mean)),
            ("trimmed mean (10%)", |s| us(s.trimmed_mean)),
            ("95% CI of the mean", |s| {
                if s.n == 0 {
                    "none (no round)".to_string()
                } else if s.n < 2 {
                    "none (one round)".to_string()
                } else {
                    format!("[{}, {}]", us(s.ci95.0), us(s.ci95.1))
                }
            }),
        ];
        for (name, f) in lines {
            let _ = write!(out, "{name:>22}");
            for s in &summaries {
                let _ = write!(out, " {:>21}", f(s));
            }
            out.push('\n');
        }
        if let Some(m) = multi_rank(trace, &g, warmup) {
            out.push_str(&m);
        }
        out.push('\n');
    }
    out
}

/// The ranks of a callable's invocations joined per round, as the benchmarks do for several
/// ranks (`docs/trace-format.md`): round `k` is every rank's invocation `inv = k`; per round
/// the slowest rank's effective time (its `run` where it has no `orch`/`sched`) is
/// `effective_us`, the fastest's `fast_effective_us`, and a round some rank lacks is dropped
/// (`valid_rounds`). `None` unless the invocations come from at least two ranked processes;
/// a note instead of the join where one rank was recorded by several processes (several runs
/// of the job, whose invocation numbers repeat).
pub fn multi_rank(trace: &Trace, g: &CallableGroup, warmup: usize) -> Option<String> {
    let mut by_rank: BTreeMap<u32, BTreeMap<u64, f64>> = BTreeMap::new();
    let mut ranks_said = 0u32;
    // A round some rank marked warm-up is warm-up for all (`warmup` then counts the others),
    // unless every invocation is marked: then the marks are set aside, saying so.
    let all_marked = g.invs.iter().all(|i| i.warmup);
    let marked: HashSet<u64> = g
        .invs
        .iter()
        .filter(|i| i.warmup && !all_marked)
        .map(|i| i.inv)
        .collect();
    let mut recorded_ranks = std::collections::BTreeSet::new();
    // The processes that recorded each rank: one each, or the files hold several runs of
    // the job, whose rounds cannot be told apart by invocation number.
    let mut writers: BTreeMap<u32, std::collections::BTreeSet<usize>> = BTreeMap::new();
    for inv in &g.invs {
        let rank = trace.processes[inv.process].rank()?;
        writers.entry(rank).or_default().insert(inv.process);
    }
    if let Some((rank, ps)) = writers.iter().find(|(_, ps)| ps.len() > 1) {
        let pids: Vec<String> = ps
            .iter()
            .map(|&p| {
                let p = &trace.processes[p];
                format!("pid {} in {}", p.pid, p.file.display())
            })
            .collect();
        return Some(format!(
            "ranks not joined per round: rank {rank} was recorded by {} processes ({}): these files hold more than one run of the job; give one run's files to join its rounds\n",
            ps.len(),
            pids.join(", ")
        ));
    }
    for inv in &g.invs {
        let p = &trace.processes[inv.process];
        let rank = p.rank()?;
        recorded_ranks.insert(rank);
        if marked.contains(&inv.inv) {
            continue;
        }
        ranks_said = ranks_said.max(p.clock.as_ref().and_then(|c| c.ranks).unwrap_or(0));
        let r = round(trace, inv);
        if let Some(v) = r.effective.or(r.host) {
            by_rank
                .entry(rank)
                .or_default()
                .insert(inv.inv, v as f64 / 1e3);
        }
    }
    if by_rank.len() < 2 {
        // Marks that leave fewer than two ranks to join are said, not passed over.
        if recorded_ranks.len() < 2 || marked.is_empty() {
            return None;
        }
        let left: std::collections::BTreeSet<u64> = g
            .invs
            .iter()
            .map(|i| i.inv)
            .filter(|k| !marked.contains(k))
            .collect();
        let n = recorded_ranks.len();
        return Some(if left.is_empty() {
            format!("{n} ranks: valid_rounds=0/0 (every round is marked warm-up on some rank)\n")
        } else {
            let lacking: Vec<u32> = recorded_ranks
                .iter()
                .copied()
                .filter(|r| !by_rank.contains_key(r))
                .collect();
            format!(
                "{n} ranks: valid_rounds=0/{} (in the rounds not marked warm-up, ranks {lacking:?} recorded nothing)\n",
                left.len()
            )
        });
    }
    // Ranks the files said exist, even those that recorded nothing of this callable.
    let n = (ranks_said as usize).max(*by_rank.keys().max()? as usize + 1);
    let invs: std::collections::BTreeSet<u64> =
        by_rank.values().flat_map(|m| m.keys().copied()).collect();
    let missing: Vec<u32> = (0..n as u32).filter(|r| !by_rank.contains_key(r)).collect();
    if !missing.is_empty() {
        // Every round lacks these ranks.
        return Some(format!(
            "{n} ranks: valid_rounds=0/{} (ranks {missing:?} recorded no invocation of this callable)\n",
            invs.len().saturating_sub(warmup)
        ));
    }
    if invs.len().saturating_mul(n) > 1 << 24 {
        return Some(format!(
            "{n} ranks × {} rounds: too many to join per round here\n",
            invs.len()
        ));
    }
    let rounds: Vec<Vec<Option<f64>>> = invs
        .iter()
        .map(|k| {
            (0..n as u32)
                .map(|r| by_rank.get(&r).and_then(|m| m.get(k)).copied())
                .collect()
        })
        .collect();
    let m = bench_stats::combine_ranks(&rounds, n, warmup);
    let mut out = format!(
        "{n} ranks, rounds joined by invocation number (per round: slowest rank = effective_us, fastest = fast_effective_us):\n"
    );
    if all_marked {
        out.push_str("(every round is marked warm-up: joined, as nothing else is)\n");
    }
    if m.valid_rounds == 0 {
        let _ = writeln!(out, "valid_rounds=0/{} (no round has every rank)", m.rounds);
    } else {
        out.push_str(&bench_stats::format_multi_rank(&m, warmup));
        out.push('\n');
    }
    for (r, vals) in &by_rank {
        let v: Vec<f64> = vals.values().copied().skip(warmup).collect();
        if !v.is_empty() {
            let s = Summary::of(&v);
            let _ = writeln!(
                out,
                "rank {r}: n={} median={:.2} min={:.2} max={:.2} µs",
                s.n, s.median, s.min, s.max
            );
        }
    }
    Some(out)
}

/// `--tree`: per callable, the median start offset (from `run`'s start) and duration of each
/// span, nested; overlapping siblings (`orch ∥ sched`) are marked and their union is shown
/// instead of a sum.
pub fn tree(trace: &Trace) -> String {
    let mut out = String::new();
    for g in by_callable(trace) {
        header(&mut out, trace, &g);
        let g = statistics_of(&mut out, &g);
        let _ = writeln!(
            out,
            "median span tree of {} invocations: [offset from run start + duration] µs",
            g.invs.len()
        );
        let names = ordered_names(trace, &g.invs);
        let mut offs: HashMap<&str, Vec<f64>> = HashMap::new();
        let mut durs: HashMap<&str, Vec<f64>> = HashMap::new();
        let mut parents: HashMap<&str, Option<&str>> = HashMap::new();
        // Invocations in which two spans overlap by more than zero time (each pair of names
        // counted once per invocation). A sweep in start order compares a span only with the
        // spans still open when it starts, so nested and sequential spans cost linear time
        // however many a file holds.
        let mut overlaps: HashMap<(&str, &str), usize> = HashMap::new();
        for inv in &g.invs {
            let mut spans: Vec<&AlignedSpan> = inv.spans.iter().map(|&i| &trace.spans[i]).collect();
            spans.sort_by_key(|s| s.wall_ns);
            let mut open: Vec<&AlignedSpan> = Vec::new();
            let mut seen: HashSet<(&str, &str)> = HashSet::new();
            for b in spans {
                open.retain(|a| a.wall_end_ns() > b.wall_ns);
                for a in &open {
                    let (x, y) = (a.span.name.as_str(), b.span.name.as_str());
                    if x != y && b.wall_ns < b.wall_end_ns() && seen.insert((x, y)) {
                        seen.insert((y, x));
                        *overlaps.entry((x, y)).or_default() += 1;
                        *overlaps.entry((y, x)).or_default() += 1;
                    }
                }
                open.push(b);
            }
        }
        for inv in &g.invs {
            let base = first(trace, inv, "run").map_or(inv.wall_ns, |r| r.wall_ns);
            let mut stack: Vec<&str> = Vec::new();
            for &i in &inv.spans {
                let s = &trace.spans[i];
                let d = s.span.depth as usize;
                stack.truncate(d);
                let parent = if d > 0 {
                    stack.get(d - 1).copied()
                } else {
                    None
                };
                parents.entry(&s.span.name).or_insert(parent);
                while stack.len() < d {
                    stack.push("");
                }
                stack.push(&s.span.name);
                offs.entry(&s.span.name)
                    .or_default()
                    .push((s.wall_ns as i128 - base as i128) as f64);
                durs.entry(&s.span.name)
                    .or_default()
                    .push(s.span.dur_ns as f64);
            }
        }
        let med = |n: &str| (stats::median(&offs[n]), stats::median(&durs[n]));
        let roots: Vec<&str> = names
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| parents[n].is_none_or(|p| p.is_empty()))
            .collect();
        let mut stack: Vec<(&str, usize)> = roots.iter().rev().map(|&n| (n, 0)).collect();
        while let Some((n, level)) = stack.pop() {
            let (o, d) = med(n);
            let siblings: Vec<&str> = names
                .iter()
                .map(|(m, _)| m.as_str())
                .filter(|m| *m != n && parents[m] == parents[n])
                .collect();
            // Siblings that overlap in more than half of the invocations.
            let overl: Vec<&str> = siblings
                .iter()
                .copied()
                .filter(|m| 2 * overlaps.get(&(n, *m)).copied().unwrap_or(0) > g.invs.len())
                .collect();
            let mark = if overl.is_empty() {
                String::new()
            } else {
                format!("  ∥ {}", overl.join(", "))
            };
            let _ = writeln!(
                out,
                "{:<44} [{:>10} + {:>10}]{mark}",
                format!("{}{n}", "  ".repeat(level)),
                us(o),
                us(d)
            );
            if n == "sched" && names.iter().any(|(m, _)| m == "orch") {
                let eff: Vec<f64> = g
                    .invs
                    .iter()
                    .filter_map(|i| round(trace, i).effective)
                    .map(|e| e as f64)
                    .collect();
                let (oo, od) = med("orch");
                let _ = writeln!(
                    out,
                    "{:<44} [{:>10} + {:>10}]  (orch ∥ sched overlap: the union, not orch + sched = {})",
                    format!("{}= effective", "  ".repeat(level)),
                    us(oo.min(o)),
                    us(stats::median(&eff)),
                    us(od + d)
                );
            }
            let kids: Vec<&str> = names
                .iter()
                .map(|(m, _)| m.as_str())
                .filter(|m| parents[m] == Some(n))
                .collect();
            for k in kids.into_iter().rev() {
                stack.push((k, level + 1));
            }
        }
        layers(&mut out, trace, &g);
        out.push('\n');
    }
    out
}

/// [`CallableGroup::for_statistics`], its note written under the header.
fn statistics_of(out: &mut String, g: &CallableGroup) -> CallableGroup {
    let (g, note) = g.for_statistics();
    if let Some(note) = note {
        let _ = writeln!(out, "({note})");
    }
    g
}

fn header(out: &mut String, trace: &Trace, g: &CallableGroup) {
    let mut pids: Vec<u32> = g
        .invs
        .iter()
        .map(|i| trace.processes[i.process].pid)
        .collect();
    pids.dedup();
    pids.sort();
    pids.dedup();
    let _ = writeln!(
        out,
        "callable {}  label {}  invocations {}  processes {}  run total {} µs",
        g.callable,
        g.label(),
        g.invs.len(),
        pids.len(),
        us(g.run_total_ns as f64)
    );
}

fn row(out: &mut String, label: &str, xs: &[f64]) {
    let s = stats::sorted(xs);
    let p90 = stats::percentile_sorted(&s, 90.0).unwrap_or(f64::NAN);
    let _ = writeln!(
        out,
        "{:<40} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10}",
        label,
        xs.len(),
        us(stats::mean(xs)),
        us(stats::median(xs)),
        us(s[0]),
        us(s[s.len() - 1]),
        us(p90)
    );
}

fn layers(out: &mut String, trace: &Trace, g: &CallableGroup) {
    let rounds: Vec<[Option<i64>; 5]> = g.invs.iter().map(|i| round(trace, i).layers()).collect();
    let names = [
        "① effective (orch ∪ sched)",
        "② device init/finalize",
        "③ host↔device handshake",
        "④ bind + validate",
        "⑤ engine/host wrap",
    ];
    let _ = writeln!(out, "layers (median µs):");
    for (k, name) in names.iter().enumerate() {
        let xs: Vec<f64> = rounds
            .iter()
            .filter_map(|r| r[k])
            .map(|v| v as f64)
            .collect();
        if k == 4 && xs.is_empty() {
            let _ = writeln!(
                out,
                "  {name:<32} {:>10}",
                "n/a (no engine.step span: the engine did not record its step time)"
            );
            continue;
        }
        let _ = writeln!(out, "  {name:<32} {:>10}", us(stats::median(&xs)));
    }
}

fn first<'a>(trace: &'a Trace, inv: &Invocation, name: &str) -> Option<&'a AlignedSpan> {
    inv.spans
        .iter()
        .map(|&i| &trace.spans[i])
        .find(|s| s.span.name == name)
}

/// Span names of a callable in tree order: the file order of the first invocation, with names
/// that only later invocations have inserted after the name that preceded them there.
fn ordered_names(trace: &Trace, invs: &[Invocation]) -> Vec<(String, u8)> {
    let mut order: Vec<(String, u8)> = Vec::new();
    for inv in invs {
        let mut after: Option<usize> = None;
        for &i in &inv.spans {
            let s = &trace.spans[i].span;
            match order.iter().position(|(n, _)| *n == s.name) {
                Some(p) => after = Some(p),
                None => {
                    let at = after.map_or(order.len(), |p| p + 1);
                    order.insert(at, (s.name.clone(), s.depth));
                    after = Some(at);
                }
            }
        }
    }
    order
}
