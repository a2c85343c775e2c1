//! `simpler trace swimlane`: per-task timeline records to Perfetto JSON (orchestrator,
//! scheduler and per-core lanes, a ready-queue-depth counter, dependency arrows with
//! happens-before checks) and the per-kernel table.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write;

use serde_json::{Map, Value};
use simpler_core::trace::{DepGraph, SchedPhase, SwimlaneRecords};

use crate::blocks::{
    TaskTimes, dispatch_finish, has_sched_times, signed_diff, task_name, task_times,
};
use crate::deps::kernel_label;
use crate::diag::SwimlaneClock;
use crate::error::{DfxError, Result};
use crate::perfetto::{PerfettoTrace, ns_to_us};
use crate::reader::Trace;
use crate::stats::us;

const PID: u32 = 1;
const ORCH_TID: u64 = 1;
const SCHED_TID: u64 = 100;
const CORE_TID: u64 = 10_000;

/// One row of the per-kernel table (times in ns; `None` at swimlane level 1).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelRow {
    /// Kernel id.
    pub func: u32,
    /// Kernel name (from the swimlane file or deps.json), `kernel <id>` or `dummy`.
    pub name: String,
    /// Tasks that ran it.
    pub tasks: usize,
    /// Block records.
    pub blocks: usize,
    /// Mean `end - start` per block.
    pub mean_exec: f64,
    /// Mean `finish - dispatch` per block.
    pub mean_latency: Option<f64>,
    /// This kernel's share of all blocks' execution time.
    pub share: f64,
    /// Mean `start - dispatch` per block.
    pub mean_head: Option<f64>,
    /// Mean `finish - end` per block.
    pub mean_tail: Option<f64>,
}

/// A dependency arrow whose producer's last block ends after the consumer's first block starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Producer task (a task with block records).
    pub pred: u64,
    /// Consumer task.
    pub succ: u64,
    /// The task without block records (dummy, barrier, skipped) the dependency runs through,
    /// when the producer is not a direct predecessor.
    pub via: Option<u64>,
    /// Producer's last block end.
    pub pred_end: u64,
    /// Consumer's first block start.
    pub succ_start: u64,
}

/// Dependency arrows between tasks that have block records, with dependencies that run through
/// tasks without records (dummy and barrier tasks) collapsed onto their recorded producers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Arrows {
    /// `(pred, succ)` pairs drawn: direct edges between recorded tasks, and for an edge from
    /// an unrecorded task `u` into a recorded one, the latest-ending recorded task that reaches
    /// `u` through unrecorded tasks only.
    pub drawn: Vec<(u64, u64)>,
    /// Of `drawn`, the pairs that run through unrecorded tasks.
    pub through_unrecorded: usize,
    /// Edges with nothing to check: into a recorded task from an unrecorded one that no
    /// recorded task reaches (a dummy at the start of the graph: nothing ran before it), or
    /// from a task the graph lacks.
    pub skipped: usize,
    /// Happens-before violations among the drawn ones.
    pub violations: Vec<Violation>,
}

/// Kernel names: those the swimlane file carries, then any more from the deps graph.
pub(crate) fn kernel_names(r: &SwimlaneRecords, deps: Option<&DepGraph>) -> HashMap<u32, String> {
    let mut names: HashMap<u32, String> = r
        .kernels
        .iter()
        .map(|(&k, n)| (k, kernel_label(k, n)))
        .collect();
    if let Some(d) = deps {
        for t in &d.tasks {
            names
                .entry(t.kernel)
                .or_insert_with(|| kernel_label(t.kernel, &t.kernel_name));
        }
    }
    names
}

pub(crate) fn name_of(names: &HashMap<u32, String>, func: u32) -> String {
    names
        .get(&func)
        .cloned()
        .unwrap_or_else(|| kernel_label(func, ""))
}

/// Per-kernel sums: tasks, blocks, exec, latency, head, tail.
type KernelAcc = (BTreeSet<u64>, usize, f64, f64, f64, f64);

/// The per-kernel table, largest share first.
pub fn kernel_table(r: &SwimlaneRecords, deps: Option<&DepGraph>) -> Vec<KernelRow> {
    let names = kernel_names(r, deps);
    let sched = has_sched_times(r);
    let mut acc: BTreeMap<u32, KernelAcc> = BTreeMap::new();
    let mut total = 0.0;
    for b in &r.tasks {
        let e = acc.entry(b.func).or_default();
        e.0.insert(b.task_id);
        e.1 += 1;
        let exec = b.end.saturating_sub(b.start) as f64;
        total += exec;
        e.2 += exec;
        e.3 += b.finish as f64 - b.dispatch as f64;
        e.4 += b.start as f64 - b.dispatch as f64;
        e.5 += b.finish as f64 - b.end as f64;
    }
    let mut rows: Vec<KernelRow> = acc
        .into_iter()
        .map(|(func, (tasks, blocks, exec, lat, head, tail))| {
            let n = blocks as f64;
            let opt = |x: f64| sched.then_some(x / n);
            KernelRow {
                func,
                name: name_of(&names, func),
                tasks: tasks.len(),
                blocks,
                mean_exec: exec / n,
                mean_latency: opt(lat),
                share: if total > 0.0 { exec / total } else { 0.0 },
                mean_head: opt(head),
                mean_tail: opt(tail),
            }
        })
        .collect();
    rows.sort_by(|a, b| b.share.total_cmp(&a.share).then(a.func.cmp(&b.func)));
    rows
}

/// Dependency arrows and their happens-before check.
pub fn arrows(r: &SwimlaneRecords, deps: &DepGraph) -> Arrows {
    arrows_with(&task_times(r), deps)
}

fn arrows_with(times: &HashMap<u64, TaskTimes>, deps: &DepGraph) -> Arrows {
    let latest = latest_recorded_ancestors(times, deps);
    let mut out = Arrows::default();
    let mut seen = BTreeSet::new();
    let mut record = |out: &mut Arrows, pred: u64, succ: u64, via: Option<u64>| {
        if !seen.insert((pred, succ)) {
            return;
        }
        let (p, s) = (&times[&pred], &times[&succ]);
        out.drawn.push((pred, succ));
        out.through_unrecorded += usize::from(via.is_some());
        if p.end > s.start {
            out.violations.push(Violation {
                pred,
                succ,
                via,
                pred_end: p.end,
                succ_start: s.start,
            });
        }
    };
    for e in &deps.edges {
        if !times.contains_key(&e.succ) {
            // Checked through the unrecorded consumer's own consumers.
            continue;
        }
        if times.contains_key(&e.pred) {
            record(&mut out, e.pred, e.succ, None);
        } else {
            match latest.get(&e.pred).copied().flatten() {
                Some(p) => record(&mut out, p, e.succ, Some(e.pred)),
                None => out.skipped += 1,
            }
        }
    }
    out
}

/// For every task without block records: the recorded task with the latest end among those
/// that reach it through unrecorded tasks only (`None` when none does). A consumer of such a
/// task must start after every one of them, so checking the latest checks them all. Iterative
/// and memoised, so a long chain of barriers costs O(tasks + edges); a cycle (impossible in a
/// valid run) contributes nothing instead of looping.
fn latest_recorded_ancestors(
    times: &HashMap<u64, TaskTimes>,
    deps: &DepGraph,
) -> HashMap<u64, Option<u64>> {
    let mut preds: HashMap<u64, Vec<u64>> = HashMap::new();
    for e in &deps.edges {
        if !times.contains_key(&e.succ) {
            preds.entry(e.succ).or_default().push(e.pred);
        }
    }
    let better = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(x), Some(y)) => {
            let (tx, ty) = (times[&x].end, times[&y].end);
            Some(if (ty, y) > (tx, x) { y } else { x })
        }
        (x, None) => x,
        (None, y) => y,
    };
    let mut memo: HashMap<u64, Option<u64>> = HashMap::new();
    let mut in_progress: BTreeSet<u64> = BTreeSet::new();
    for &start in preds.keys() {
        if memo.contains_key(&start) {
            continue;
        }
        // (node, whether its predecessors have been pushed)
        let mut stack = vec![(start, false)];
        while let Some((u, expanded)) = stack.pop() {
            if memo.contains_key(&u) {
                continue;
            }
            let ps = preds.get(&u).map_or(&[][..], Vec::as_slice);
            if !expanded {
                in_progress.insert(u);
                stack.push((u, true));
                for &p in ps {
                    if !times.contains_key(&p)
                        && !memo.contains_key(&p)
                        && !in_progress.contains(&p)
                    {
                        stack.push((p, false));
                    }
                }
                continue;
            }
            let mut best = None;
            for &p in ps {
                let cand = if times.contains_key(&p) {
                    Some(p)
                } else {
                    memo.get(&p).copied().flatten()
                };
                best = better(best, cand);
            }
            in_progress.remove(&u);
            memo.insert(u, best);
        }
    }
    memo
}

/// Earliest timestamp in the records (the Perfetto origin).
fn origin(r: &SwimlaneRecords) -> u64 {
    let blocks = r.tasks.iter().map(|b| dispatch_finish(r, b).0.min(b.start));
    let phases = r.phases.iter().map(|p| p.start);
    let submits = r.submits.iter().map(|s| s.start);
    let queue = r.queue_depth.iter().map(|q| q.ts);
    blocks
        .chain(phases)
        .chain(submits)
        .chain(queue)
        .min()
        .unwrap_or(0)
}

/// One rank's swimlane, for a merged view of several ranks.
pub struct RankSwimlane<'a> {
    /// Its file (named in errors and in the view).
    pub path: &'a std::path::Path,
    /// Its records.
    pub records: &'a SwimlaneRecords,
    /// Its dependency graph, if any (fingerprint already checked against the records).
    pub deps: Option<&'a DepGraph>,
    /// Where its times lie ([`crate::diag::read_swimlane_clock`]).
    pub clock: SwimlaneClock,
}

/// Several ranks' swimlanes in one Perfetto document: one process per rank (named `rank r
/// (role, pid)` and ordered by rank) with its orchestrator, scheduler and per-core lanes,
/// all on one axis (placed as trace files are: through the host's monotonic clock where the
/// files share a boot id, else by wall clock; `otherData.clock_alignment` says which and how
/// well). Returns the document and the clock summary. A file without an anchor (written
/// before files carried one) cannot be placed and is refused, naming it.
pub fn ranks_to_perfetto(ranks: &[RankSwimlane<'_>]) -> Result<(PerfettoTrace, String)> {
    let mut trace = Trace::default();
    let mut zero = Vec::with_capacity(ranks.len());
    for r in ranks {
        let anchor = r.clock.anchor.ok_or_else(|| DfxError::Invalid {
            path: r.path.to_path_buf(),
            line: 0,
            what: "no `anchor`: this swimlane file cannot be placed among other ranks' (record it again)".into(),
        })?;
        let i = trace.add_process(anchor, r.clock.process.clone(), r.path)?;
        zero.push(i);
    }
    // Each file's origin on the merged axis.
    let starts: Vec<i128> = ranks
        .iter()
        .zip(&zero)
        .map(|(r, &i)| trace.processes[i].zero_wall_ns + origin(r.records) as i128)
        .collect();
    let first = starts.iter().copied().min().unwrap_or(0);
    let mut out = PerfettoTrace::default();
    let mut dropped = 0u64;
    // Summed over the files that had a graph to check their arrows against; absent when none
    // had, as in one file's document.
    let mut violations: Option<u64> = None;
    let mut fingerprints = Vec::new();
    for (k, r) in ranks.iter().enumerate() {
        let p = &trace.processes[zero[k]];
        let pid = PID + k as u32;
        let shift_us = (starts[k] - first) as f64 / 1e3;
        let one = to_perfetto(r.records, r.deps);
        if let Some(v) = one
            .other
            .get("happens_before_violations")
            .and_then(Value::as_u64)
        {
            violations = Some(violations.unwrap_or(0).saturating_add(v));
        }
        for mut e in one.events {
            e.pid = pid;
            if e.ph == "M" {
                if e.name == "process_name" {
                    let inner = e.args["name"].as_str().unwrap_or_default().to_string();
                    e.args.insert(
                        "name".into(),
                        format!("{}: {inner}", p.display_name()).into(),
                    );
                }
            } else {
                e.ts += shift_us;
            }
            // Flow ids are unique per file; keep them apart between files.
            e.id = e.id.map(|id| id | ((k as u64) << 40));
            out.events.push(e);
        }
        out.process_sort_index(pid, p.rank().map_or(k as u64, u64::from));
        dropped = dropped.saturating_add(r.records.dropped);
        fingerprints.push(Value::from(r.records.fingerprint.clone()));
    }
    let clocks = trace.clock_summary();
    out.other.insert("dropped_records".into(), dropped.into());
    if let Some(v) = violations {
        out.other
            .insert("happens_before_violations".into(), v.into());
    }
    out.other.insert("fingerprints".into(), fingerprints.into());
    out.other
        .insert("clock_alignment".into(), clocks.clone().into());
    Ok((out, clocks))
}

/// The Perfetto document: orchestrator lane (submits), scheduler lanes (phases) with one
/// ready-queue-depth counter per class, one lane per core (a slice per block) and, with a deps
/// graph, one flow arrow per dependency (flagged when it is a happens-before violation).
pub fn to_perfetto(r: &SwimlaneRecords, deps: Option<&DepGraph>) -> PerfettoTrace {
    let t0 = origin(r);
    let rel = |t: u64| t.saturating_sub(t0);
    let names = kernel_names(r, deps);
    let mut out = PerfettoTrace::default();
    out.process_name(
        PID,
        &format!(
            "simpler run (swimlane level {}, fingerprint {})",
            r.level, r.fingerprint
        ),
    );
    if r.dropped > 0 {
        let mut a = Map::new();
        a.insert("dropped_records".into(), r.dropped.into());
        out.instant(
            PID,
            &format!("{} RECORDS DROPPED: timeline incomplete", r.dropped),
            0,
            a,
        );
    }
    out.other.insert("dropped_records".into(), r.dropped.into());
    out.other
        .insert("fingerprint".into(), r.fingerprint.clone().into());
    out.other.insert("level".into(), r.level.into());
    out.other.insert("origin_ns".into(), t0.into());
    if !r.submits.is_empty() {
        out.thread_name(PID, ORCH_TID, "orchestrator");
        for s in &r.submits {
            let mut a = Map::new();
            a.insert("task_id".into(), s.task_id.into());
            out.complete(
                PID,
                ORCH_TID,
                &format!("submit {}", task_name(s.task_id)),
                "submit",
                rel(s.start),
                s.end.saturating_sub(s.start),
                a,
            );
        }
    }
    let mut owned: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    for p in &r.phases {
        owned.entry(p.sched).or_default().insert(p.core);
    }
    for (s, cores) in &owned {
        let list: Vec<String> = cores.iter().map(u32::to_string).collect();
        out.thread_name(
            PID,
            SCHED_TID + *s as u64,
            &format!("scheduler {s} (cores {})", list.join(",")),
        );
    }
    for p in &r.phases {
        let name = match p.phase {
            SchedPhase::Dispatch => "dispatch",
            SchedPhase::Complete => "complete",
            SchedPhase::Idle => "idle",
        };
        let mut a = Map::new();
        a.insert("core".into(), p.core.into());
        out.complete(
            PID,
            SCHED_TID + p.sched as u64,
            name,
            "sched",
            rel(p.start),
            p.end.saturating_sub(p.start),
            a,
        );
    }
    for q in &r.queue_depth {
        out.counter(
            PID,
            &format!("ready queue ({})", q.class.name()),
            rel(q.ts),
            "depth",
            q.depth as f64,
        );
    }
    let cores: BTreeSet<u32> = r.tasks.iter().map(|b| b.core).collect();
    for c in &cores {
        out.thread_name(PID, CORE_TID + *c as u64, &format!("core {c}"));
    }
    let sched = has_sched_times(r);
    for b in &r.tasks {
        let mut a = Map::new();
        a.insert("task".into(), task_name(b.task_id).into());
        a.insert("task_id".into(), b.task_id.into());
        a.insert("block".into(), b.block.into());
        a.insert("class".into(), b.class.name().into());
        if sched {
            a.insert("dispatch_us".into(), ns_to_us(rel(b.dispatch)).into());
            a.insert("finish_us".into(), ns_to_us(rel(b.finish)).into());
            a.insert("head_ns".into(), signed_diff(b.start, b.dispatch).into());
            a.insert("tail_ns".into(), signed_diff(b.finish, b.end).into());
        }
        out.complete(
            PID,
            CORE_TID + b.core as u64,
            &name_of(&names, b.func),
            b.class.name(),
            rel(b.start),
            b.end.saturating_sub(b.start),
            a,
        );
    }
    if let Some(d) = deps {
        let times = task_times(r);
        let arrows = arrows_with(&times, d);
        let bad: HashMap<(u64, u64), Violation> = arrows
            .violations
            .iter()
            .map(|v| ((v.pred, v.succ), *v))
            .collect();
        for (id, (p, s)) in arrows.drawn.iter().enumerate() {
            let (pt, st) = (&times[p], &times[s]);
            let from = if pt.end > pt.start {
                pt.end - 1
            } else {
                pt.end
            };
            let to = if st.end > st.start {
                st.start + 1
            } else {
                st.start
            };
            let mut a = Map::new();
            a.insert("pred".into(), task_name(*p).into());
            a.insert("succ".into(), task_name(*s).into());
            let name = match bad.get(&(*p, *s)) {
                Some(v) => {
                    a.insert("violation".into(), Value::Bool(true));
                    if let Some(u) = v.via {
                        a.insert("via".into(), task_name(u).into());
                    }
                    a.insert("pred_end_us".into(), ns_to_us(rel(v.pred_end)).into());
                    a.insert("succ_start_us".into(), ns_to_us(rel(v.succ_start)).into());
                    "dep VIOLATION (happens-before)"
                }
                None => "dep",
            };
            out.flow(
                id as u64 + 1,
                name,
                (PID, CORE_TID + pt.last_core as u64, rel(from)),
                (PID, CORE_TID + st.first_core as u64, rel(to)),
                a,
            );
        }
        out.other.insert(
            "happens_before_violations".into(),
            arrows.violations.len().into(),
        );
    }
    out
}

/// The printed report: dropped records first, then the per-kernel table and, with a deps
/// graph, the arrows and their violations.
pub fn report(r: &SwimlaneRecords, deps: Option<&DepGraph>) -> String {
    let mut out = String::new();
    crate::diag::warn_dropped(
        &mut out,
        r.dropped,
        "the record buffer was full, everything below is incomplete",
    );
    let tasks: BTreeSet<u64> = r.tasks.iter().map(|b| b.task_id).collect();
    let _ = writeln!(
        out,
        "swimlane level {}, {} cores, {} tasks, {} block records, {} scheduler phases, {} submits, fingerprint {}",
        r.level,
        crate::blocks::core_count(r),
        tasks.len(),
        r.tasks.len(),
        r.phases.len(),
        r.submits.len(),
        if r.fingerprint.is_empty() {
            "-"
        } else {
            &r.fingerprint
        }
    );
    let _ = writeln!(
        out,
        "{:<24} {:>7} {:>7} {:>12} {:>14} {:>7} {:>10} {:>10}",
        "kernel", "tasks", "blocks", "exec µs", "latency µs", "share", "head µs", "tail µs"
    );
    let opt = |x: Option<f64>| x.map_or("-".to_string(), us);
    for k in kernel_table(r, deps) {
        let _ = writeln!(
            out,
            "{:<24} {:>7} {:>7} {:>12} {:>14} {:>6.1}% {:>10} {:>10}",
            k.name,
            k.tasks,
            k.blocks,
            us(k.mean_exec),
            opt(k.mean_latency),
            k.share * 100.0,
            opt(k.mean_head),
            opt(k.mean_tail)
        );
    }
    let _ = writeln!(
        out,
        "(means per block; exec = end - start, latency = finish - dispatch, head = start - dispatch, tail = finish - end; share of all blocks' execution time)"
    );
    match deps {
        None => {
            let _ = writeln!(out, "dependency arrows: none (no deps.json given)");
        }
        Some(d) => {
            let a = arrows(r, d);
            let _ = writeln!(
                out,
                "dependency arrows: {} checked ({} through tasks without block records: dummy, barrier, skipped or dropped); {} edges from unrecorded tasks with no recorded task before them (nothing to check)",
                a.drawn.len(),
                a.through_unrecorded,
                a.skipped
            );
            let _ = writeln!(out, "happens-before violations: {}", a.violations.len());
            for v in a.violations.iter().take(20) {
                let via = v
                    .via
                    .map_or(String::new(), |u| format!(" (through {})", task_name(u)));
                let _ = writeln!(
                    out,
                    "  VIOLATION {} -> {}{via}: producer ends at {} µs, consumer starts at {} µs",
                    task_name(v.pred),
                    task_name(v.succ),
                    us(v.pred_end.saturating_sub(origin(r)) as f64),
                    us(v.succ_start.saturating_sub(origin(r)) as f64)
                );
            }
            if a.violations.len() > 20 {
                let _ = writeln!(out, "  ... {} more", a.violations.len() - 20);
            }
        }
    }
    out
}
