//! `simpler trace overhead`: how much of the execution span the scheduler, not the work, set
//! the pace.
//!
//! Definitions (all on the records' one clock, integer nanoseconds):
//! * execution span: first block dispatch (level 1: start) to last finish (level 1: end) over
//!   all blocks;
//! * a core is busy while it executes a block (`start..end`), idle otherwise;
//! * a task is ready at the latest finish of its predecessors in `deps.json` (a predecessor
//!   without block records — a dummy or skipped task — completes when it became ready
//!   itself), and never before its submit ended (submits are recorded at level 4 only; below
//!   it a wait for the orchestrator counts as scheduler-bound, and the report says the share
//!   is an upper bound). A task with neither predecessors nor a submit record, or any task
//!   when no deps.json is given, is ready at its first dispatch;
//! * each block waits from its task's readiness to its own start;
//! * scheduler-bound time of class C: the instants at which a block of class C waits while at
//!   least one core is idle. Every platform of simpler runs any class on any core, so every
//!   core counts for every class.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use simpler_core::EngineClass;
use simpler_core::trace::{DepGraph, SchedPhase, SwimlaneRecords};

use crate::blocks::{
    TaskTimes, core_count, execution_span, has_sched_times, signed_diff, task_times,
};
use crate::deps::Graph;
use crate::error::{DfxError, Result};
use crate::stats::{percentile_sorted, us};

/// Share at or above which a class is scheduler-bound.
pub const SCHEDULER_BOUND: f64 = 0.25;
/// Share at or above which a class is partly scheduler-limited.
pub const PARTLY_LIMITED: f64 = 0.08;

/// Where task readiness came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Predecessor finishes from deps.json (and submit ends at level 4).
    Deps,
    /// No deps.json: each task counts as ready at its first dispatch.
    DispatchFallback,
}

/// Scheduler-bound time of one engine class (or of all, `class: None`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClassShare {
    /// The class; `None` for all classes together.
    pub class: Option<EngineClass>,
    /// Block records of the class.
    pub blocks: usize,
    /// Nanoseconds during which a block of the class waited while a core was idle.
    pub bound_ns: u64,
    /// `bound_ns / execution span`.
    pub share: f64,
}

impl ClassShare {
    /// The verdict for this share.
    pub fn verdict(&self) -> &'static str {
        verdict(self.share)
    }
}

/// A distribution of signed nanosecond values (nearest-rank percentiles).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Distribution {
    /// Samples.
    pub n: usize,
    /// Percentiles 10, 25, 50, 75, 90, 99.
    pub p: [i64; 6],
    /// Largest.
    pub max: i64,
    /// Mean.
    pub mean: f64,
}

impl Distribution {
    /// Percentiles this distribution reports.
    pub const PERCENTILES: [f64; 6] = [10.0, 25.0, 50.0, 75.0, 90.0, 99.0];

    /// The distribution of `xs`; `None` when empty.
    pub fn of(xs: &[i64]) -> Option<Distribution> {
        let mut s = xs.to_vec();
        s.sort_unstable();
        let max = *s.last()?;
        let p = Self::PERCENTILES.map(|q| percentile_sorted(&s, q).unwrap_or(0));
        Some(Distribution {
            n: s.len(),
            p,
            max,
            mean: s.iter().map(|&x| x as f64).sum::<f64>() / s.len() as f64,
        })
    }
}

/// Result of the overhead analysis.
#[derive(Clone, Debug, PartialEq)]
pub struct Overhead {
    /// `[first dispatch, last finish]`.
    pub execution_span: (u64, u64),
    /// Cores.
    pub cores: u32,
    /// Swimlane level of the records (submit ends, which gate readiness, need level 4).
    pub level: u8,
    /// Where readiness came from.
    pub readiness: Readiness,
    /// Per class present in the records (Mix, Cube, Vector order).
    pub classes: Vec<ClassShare>,
    /// All classes together.
    pub all: ClassShare,
    /// `start - dispatch` per block (level >= 2).
    pub head: Option<Distribution>,
    /// `finish - end` per block (level >= 2).
    pub tail: Option<Distribution>,
    /// Scheduler loop phase totals per scheduler: ns in dispatch, complete, idle.
    pub phases: BTreeMap<u32, [u64; 3]>,
    /// Records the recorder dropped.
    pub dropped: u64,
}

/// The verdict for a scheduler-bound share.
pub fn verdict(share: f64) -> &'static str {
    if share >= SCHEDULER_BOUND {
        "scheduler-bound"
    } else if share >= PARTLY_LIMITED {
        "partly scheduler-limited"
    } else {
        "compute/dependency-bound"
    }
}

/// Readiness time of every task with block records (see the module docs).
pub(crate) fn ready_times(
    r: &SwimlaneRecords,
    times: &HashMap<u64, TaskTimes>,
    deps: Option<&Graph>,
) -> HashMap<u64, u64> {
    let submit_end: HashMap<u64, u64> = r.submits.iter().map(|s| (s.task_id, s.end)).collect();
    let mut ready: HashMap<u64, u64> = times.iter().map(|(&id, t)| (id, t.dispatch)).collect();
    let Some(g) = deps else { return ready };
    // Completion of each graph node (None: unknown, constrains nothing).
    let mut done: Vec<Option<u64>> = vec![None; g.ids.len()];
    for &v in &g.topo {
        let id = g.ids[v];
        let from_preds = g.preds[v].iter().filter_map(|&p| done[p]).max();
        let gate = from_preds
            .into_iter()
            .chain(submit_end.get(&id).copied())
            .max();
        match times.get(&id) {
            Some(t) => {
                if let Some(gate) = gate {
                    ready.insert(id, gate);
                }
                done[v] = Some(t.finish);
            }
            None => done[v] = gate,
        }
    }
    ready
}

/// Runs the analysis. With `deps`, its fingerprint must match the records'.
pub fn analyze(r: &SwimlaneRecords, deps: Option<&DepGraph>) -> Result<Overhead> {
    let (m0, m1) = execution_span(r)
        .ok_or_else(|| DfxError::Missing("the swimlane has no block records".into()))?;
    crate::blocks::check_records(r)?;
    let times = task_times(r);
    let graph = deps.map(Graph::new).transpose()?;
    let ready = ready_times(r, &times, graph.as_ref());
    let cores = core_count(r);
    // Sweep events: (time, kind) with kind 0..3 = waiting class delta, 3 = busy delta.
    let mut ev: Vec<(u64, usize, i64)> = Vec::with_capacity(4 * r.tasks.len());
    let mut blocks = [0usize; 3];
    for b in &r.tasks {
        let c = b.class.index();
        blocks[c] += 1;
        let rd = ready[&b.task_id].clamp(m0, m1);
        if rd < b.start {
            ev.push((rd, c, 1));
            ev.push((b.start.min(m1), c, -1));
        }
        if b.end > b.start {
            ev.push((b.start, 3, 1));
            ev.push((b.end, 3, -1));
        }
    }
    ev.sort_unstable();
    let mut level = [0i64; 4];
    let (mut bound, mut bound_any) = ([0u64; 3], 0u64);
    let mut i = 0;
    while i < ev.len() {
        let t = ev[i].0;
        while i < ev.len() && ev[i].0 == t {
            level[ev[i].1] += ev[i].2;
            i += 1;
        }
        let next = ev.get(i).map_or(t, |e| e.0);
        let (a, b) = (t.max(m0), next.min(m1));
        if b <= a || level[3] >= cores as i64 {
            continue;
        }
        for c in 0..3 {
            if level[c] > 0 {
                bound[c] += b - a;
            }
        }
        if level[..3].iter().any(|&l| l > 0) {
            bound_any += b - a;
        }
    }
    let span = (m1 - m0).max(1) as f64;
    let classes = EngineClass::ALL
        .iter()
        .filter(|c| blocks[c.index()] > 0)
        .map(|&c| ClassShare {
            class: Some(c),
            blocks: blocks[c.index()],
            bound_ns: bound[c.index()],
            share: bound[c.index()] as f64 / span,
        })
        .collect();
    let all = ClassShare {
        class: None,
        blocks: r.tasks.len(),
        bound_ns: bound_any,
        share: bound_any as f64 / span,
    };
    let (head, tail) = if has_sched_times(r) {
        let h: Vec<i64> = r
            .tasks
            .iter()
            .map(|b| signed_diff(b.start, b.dispatch))
            .collect();
        let t: Vec<i64> = r
            .tasks
            .iter()
            .map(|b| signed_diff(b.finish, b.end))
            .collect();
        (Distribution::of(&h), Distribution::of(&t))
    } else {
        (None, None)
    };
    let mut phases: BTreeMap<u32, [u64; 3]> = BTreeMap::new();
    for p in &r.phases {
        let k = match p.phase {
            SchedPhase::Dispatch => 0,
            SchedPhase::Complete => 1,
            SchedPhase::Idle => 2,
        };
        let t = &mut phases.entry(p.sched).or_default()[k];
        *t = t.saturating_add(p.end.saturating_sub(p.start));
    }
    Ok(Overhead {
        execution_span: (m0, m1),
        cores,
        level: r.level,
        readiness: if graph.is_some() {
            Readiness::Deps
        } else {
            Readiness::DispatchFallback
        },
        classes,
        all,
        head,
        tail,
        phases,
        dropped: r.dropped,
    })
}

/// The printed report.
pub fn report(o: &Overhead) -> String {
    let mut out = String::new();
    crate::diag::warn_dropped(&mut out, o.dropped, "the shares below are incomplete");
    let _ = writeln!(
        out,
        "execution span {} µs (first block dispatch to last block finish), {} cores",
        us((o.execution_span.1 - o.execution_span.0) as f64),
        o.cores
    );
    match o.readiness {
        Readiness::Deps if o.level >= 4 => {
            let _ = writeln!(
                out,
                "readiness: latest predecessor finish from deps.json and the task's submit end"
            );
        }
        Readiness::Deps => {
            let _ = writeln!(
                out,
                "readiness: latest predecessor finish from deps.json; swimlane level {} records no submit times, so a task still waiting for the orchestrator to submit it counts as ready and that wait as scheduler-bound (an upper bound; record at --swimlane 4 to exclude it)",
                o.level
            );
        }
        Readiness::DispatchFallback => {
            let _ = writeln!(
                out,
                "readiness: NO deps.json, so each task counts as ready only at its first dispatch; time a ready task waited before dispatch is not seen (give --deps for the full measure)"
            );
        }
    }
    let _ = writeln!(
        out,
        "{:<8} {:>8} {:>22} {:>7}  verdict",
        "class", "blocks", "scheduler-bound µs", "share"
    );
    for c in o.classes.iter().chain(std::iter::once(&o.all)) {
        let name = c.class.map_or("all", EngineClass::name);
        let _ = writeln!(
            out,
            "{name:<8} {:>8} {:>22} {:>6.1}%  {}",
            c.blocks,
            us(c.bound_ns as f64),
            c.share * 100.0,
            c.verdict()
        );
    }
    let _ = writeln!(
        out,
        "(scheduler-bound: a block of the class was ready and waiting while a core was idle; verdict: >=25% scheduler-bound, >=8% partly scheduler-limited)"
    );
    let _ = writeln!(
        out,
        "{:<28} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "overhead (µs)", "n", "p10", "p25", "p50", "p75", "p90", "p99", "max", "mean"
    );
    for (name, d) in [
        ("head (start - dispatch)", &o.head),
        ("tail (finish - end)", &o.tail),
    ] {
        match d {
            Some(d) => {
                let mut line = format!("{name:<28} {:>7}", d.n);
                for v in d.p.iter().chain(std::iter::once(&d.max)) {
                    let _ = write!(line, " {:>8}", us(*v as f64));
                }
                let _ = writeln!(out, "{line} {:>8}", us(d.mean));
            }
            None => {
                let _ = writeln!(
                    out,
                    "{name:<28} n/a (swimlane level 1 has no dispatch/finish)"
                );
            }
        }
    }
    if o.phases.is_empty() {
        let _ = writeln!(
            out,
            "scheduler loop phases: none recorded (needs swimlane level 3)"
        );
    } else {
        let _ = writeln!(out, "scheduler loop phases (µs):");
        let mut total = [0u64; 3];
        for (s, p) in &o.phases {
            phase_line(&mut out, &format!("sched {s}"), p);
            for k in 0..3 {
                total[k] = total[k].saturating_add(p[k]);
            }
        }
        phase_line(&mut out, "total", &total);
    }
    out
}

fn phase_line(out: &mut String, name: &str, p: &[u64; 3]) {
    let sum = p.iter().map(|&x| x as f64).sum::<f64>().max(1.0);
    let pct = |x: u64| x as f64 * 100.0 / sum;
    let _ = writeln!(
        out,
        "  {name:<10} dispatch {:>10} ({:>5.1}%)  complete {:>10} ({:>5.1}%)  idle {:>10} ({:>5.1}%)",
        us(p[0] as f64),
        pct(p[0]),
        us(p[1] as f64),
        pct(p[1]),
        us(p[2] as f64),
        pct(p[2])
    );
}
