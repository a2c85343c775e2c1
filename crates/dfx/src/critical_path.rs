//! `simpler trace critical-path`: the static longest path (a lower bound with unlimited cores)
//! and the observed path walked back from the last-finishing task, with every nanosecond of the
//! execution span (first block dispatch to last block finish) attributed to exactly one of
//! compute, data-wait, orchestration-wait, core-wait or scheduling.
//!
//! The walk keeps a cursor that starts at the execution span's end and only moves back. At each
//! task on the path (times as in `overhead`: readiness from deps.json, level-1 fallbacks):
//! `finish..end` is scheduling (completion processing), `end..start` compute,
//! `start..dispatch` scheduling (dispatch overhead), `dispatch..ready` core-wait where every
//! core was executing and scheduling where one was idle. The next task is the predecessor whose
//! completion gated this task's readiness (the latest). From the cursor down to that
//! completion: the part after both the completion and the task's submit end is data-wait
//! (something off the path: records that are missing); the part between the completion and a
//! later submit end is orchestration-wait (the task did not exist yet). The path's first task
//! ends the walk; the rest down to the span's start is split the same way. Each interval is
//! clipped to the cursor, so the five totals add up to the execution span exactly.
//!
//! Submit ends are recorded at swimlane level 4 only. Below it a task that waited for the
//! orchestrator counts as ready when its predecessors completed, so that wait lands in
//! scheduling (a core idle) or core-wait: the report says so.

use std::collections::HashMap;
use std::fmt::Write;

use simpler_core::trace::{DepGraph, SwimlaneRecords};

use crate::blocks::{BusyProfile, execution_span, task_name, task_times};
use crate::deps::Graph;
use crate::error::{DfxError, Result};
use crate::stats::us;
use crate::swimlane::kernel_names;

/// Time attributed to one task of the observed path (ns).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Task id.
    pub task: u64,
    /// Kernel label.
    pub kernel: String,
    /// Whether the task has block records (dummy and skipped tasks have none).
    pub recorded: bool,
    /// Kernel execution (first start to last end).
    pub compute: u64,
    /// Waiting before readiness for something other than the path's predecessor or the
    /// orchestrator.
    pub data_wait: u64,
    /// Waiting for the orchestrator to submit the task (after the path's predecessor had
    /// completed); level 4 only, see the module docs.
    pub orch_wait: u64,
    /// Ready while every core was executing.
    pub core_wait: u64,
    /// Ready with a core idle, dispatch overhead and completion processing.
    pub scheduling: u64,
}

/// Result of the analysis.
#[derive(Clone, Debug, PartialEq)]
pub struct CriticalPath {
    /// Execution span: `[first block dispatch, last block finish]`.
    pub execution_span: (u64, u64),
    /// Swimlane level of the records (below 4, orchestration-wait cannot be told apart).
    pub level: u8,
    /// Tasks of the static longest path, first to last.
    pub static_path: Vec<u64>,
    /// Its length: the sum of its tasks' longest block executions.
    pub static_ns: u64,
    /// The observed path, first task to last.
    pub observed: Vec<Step>,
}

impl CriticalPath {
    /// Names of the [`CriticalPath::totals`] buckets, in order.
    pub const BUCKETS: [&'static str; 5] = [
        "compute",
        "data-wait",
        "orch-wait",
        "core-wait",
        "scheduling",
    ];

    /// `[compute, data-wait, orch-wait, core-wait, scheduling]` over the observed path.
    pub fn totals(&self) -> [u64; 5] {
        let mut t = [0; 5];
        for s in &self.observed {
            t[0] += s.compute;
            t[1] += s.data_wait;
            t[2] += s.orch_wait;
            t[3] += s.core_wait;
            t[4] += s.scheduling;
        }
        t
    }

    /// Execution span in ns.
    pub fn execution_span_ns(&self) -> u64 {
        self.execution_span.1 - self.execution_span.0
    }
}

/// The walk's cursor: moves only back, never below the execution span's start.
struct Cursor {
    at: u64,
    floor: u64,
}

impl Cursor {
    /// Moves the cursor back to `to` (clipped) and returns how far it moved.
    fn take(&mut self, to: u64) -> u64 {
        let to = to.max(self.floor);
        if to < self.at {
            let d = self.at - to;
            self.at = to;
            d
        } else {
            0
        }
    }
}

/// Runs the analysis (the dependency graph is required; fingerprints are checked by the caller).
pub fn analyze(r: &SwimlaneRecords, deps: &DepGraph) -> Result<CriticalPath> {
    let (m0, m1) = execution_span(r)
        .ok_or_else(|| DfxError::Missing("the swimlane has no block records".into()))?;
    crate::blocks::check_records(r)?;
    let g = Graph::new(deps)?;
    let times = task_times(r);
    let names = kernel_names(r, Some(deps));
    let busy = BusyProfile::new(r);
    let submit_end: HashMap<u64, u64> = r.submits.iter().map(|s| (s.task_id, s.end)).collect();
    let n = g.ids.len();
    // Readiness and completion per node (None: unknown).
    let (mut ready, mut done): (Vec<Option<u64>>, Vec<Option<u64>>) =
        (vec![None; n], vec![None; n]);
    let mut dist = vec![0u64; n];
    let mut best_pred: Vec<Option<usize>> = vec![None; n];
    for &v in &g.topo {
        let id = g.ids[v];
        let gate = g.preds[v]
            .iter()
            .filter_map(|&p| done[p])
            .max()
            .into_iter()
            .chain(submit_end.get(&id).copied())
            .max();
        match times.get(&id) {
            Some(t) => {
                ready[v] = Some(gate.unwrap_or(t.dispatch));
                done[v] = Some(t.finish);
            }
            None => {
                ready[v] = gate;
                done[v] = gate;
            }
        }
        let bp = g.preds[v]
            .iter()
            .copied()
            .max_by_key(|&p| (dist[p], std::cmp::Reverse(p)));
        best_pred[v] = bp;
        dist[v] = times
            .get(&id)
            .map_or(0, |t| t.max_exec)
            .saturating_add(bp.map_or(0, |p| dist[p]));
    }
    let mut static_path = Vec::new();
    let mut at = (0..n).max_by_key(|&v| (dist[v], std::cmp::Reverse(v)));
    let static_ns = at.map_or(0, |v| dist[v]);
    while let Some(v) = at {
        static_path.push(g.ids[v]);
        at = best_pred[v];
    }
    static_path.reverse();

    // The observed walk.
    let last = times
        .iter()
        .max_by_key(|(id, t)| (t.finish, t.end, std::cmp::Reverse(**id)))
        .map(|(id, _)| *id)
        .ok_or_else(|| DfxError::Missing("no task records".into()))?;
    let mut cur = Cursor { at: m1, floor: m0 };
    let mut observed = Vec::new();
    let mut node: Option<usize> = g.index.get(&last).copied();
    let mut id = last;
    loop {
        let mut step = Step {
            task: id,
            recorded: false,
            ..Step::default()
        };
        if let Some(t) = times.get(&id) {
            step.recorded = true;
            step.kernel = names
                .get(&t.func)
                .cloned()
                .unwrap_or_else(|| crate::deps::kernel_label(t.func, ""));
            step.scheduling += cur.take(t.finish);
            step.scheduling += cur.take(t.end);
            step.compute += cur.take(t.start);
            step.scheduling += cur.take(t.dispatch);
            let rd = node.and_then(|v| ready[v]).unwrap_or(t.dispatch);
            let before = cur.at;
            let waited = cur.take(rd);
            let cw = busy.all_busy(before - waited, before);
            step.core_wait += cw;
            step.scheduling += waited - cw;
        } else {
            step.kernel = node.map_or_else(String::new, |v| {
                let t = &deps.tasks[v];
                crate::deps::kernel_label(t.kernel, &t.kernel_name)
            });
        }
        let next = node.and_then(|v| {
            g.preds[v]
                .iter()
                .copied()
                .filter(|&p| done[p].is_some())
                .max_by_key(|&p| (done[p], p))
        });
        let gate = next.and_then(|p| done[p]).unwrap_or(m0);
        let submitted = submit_end.get(&id).copied().unwrap_or(0);
        step.data_wait += cur.take(gate.max(submitted));
        step.orch_wait += cur.take(gate);
        observed.push(step);
        match next {
            Some(p) => {
                node = Some(p);
                id = g.ids[p];
            }
            None => break,
        }
    }
    observed.reverse();
    Ok(CriticalPath {
        execution_span: (m0, m1),
        level: r.level,
        static_path,
        static_ns,
        observed,
    })
}

/// The printed report.
pub fn report(c: &CriticalPath, dropped: u64) -> String {
    let mut out = String::new();
    crate::diag::warn_dropped(
        &mut out,
        dropped,
        "tasks without records count as taking no time",
    );
    let ms = c.execution_span_ns();
    let pct = |x: u64| x as f64 * 100.0 / ms.max(1) as f64;
    let _ = writeln!(
        out,
        "execution span {} µs (first block dispatch to last block finish; not `effective`, which also counts orchestration before the first dispatch)",
        us(ms as f64)
    );
    let _ = writeln!(
        out,
        "static critical path (unlimited cores, task weight = its longest block): {} µs over {} tasks = {:.1}% of the execution span",
        us(c.static_ns as f64),
        c.static_path.len(),
        pct(c.static_ns)
    );
    let shown: Vec<String> = c
        .static_path
        .iter()
        .take(12)
        .map(|&t| task_name(t))
        .collect();
    let more = if c.static_path.len() > 12 { " ..." } else { "" };
    let _ = writeln!(out, "  {}{more}", shown.join(" -> "));
    let t = c.totals();
    let _ = writeln!(
        out,
        "observed path (walked back from the last-finishing task): {} tasks",
        c.observed.len()
    );
    for (name, v) in CriticalPath::BUCKETS.iter().zip(t) {
        let _ = writeln!(
            out,
            "  {name:<11} {:>12} µs {:>6.1}%  ({v} ns)",
            us(v as f64),
            pct(v)
        );
    }
    let sum: u64 = t.iter().fold(0, |a, &x| a.saturating_add(x));
    let _ = writeln!(
        out,
        "  {:<11} {:>12} µs          ({sum} ns {} execution span {ms} ns)",
        "total",
        us(sum as f64),
        if sum == ms { "==" } else { "!=" }
    );
    if c.level < 4 {
        let _ = writeln!(
            out,
            "  note: swimlane level {} records no submit times, so orch-wait is not measured: a task that waited for the orchestrator to submit it shows that wait as scheduling or core-wait; record at --swimlane 4 to tell them apart",
            c.level
        );
    }
    let _ = writeln!(
        out,
        "{:<12} {:<20} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "task", "kernel", "data-wait", "orch-wait", "core-wait", "scheduling", "compute"
    );
    let limit = 40;
    for s in c.observed.iter().take(limit) {
        let kernel = if s.recorded {
            s.kernel.clone()
        } else {
            format!("{} (no records)", s.kernel)
        };
        let _ = writeln!(
            out,
            "{:<12} {:<20} {:>12} {:>12} {:>12} {:>12} {:>12}",
            task_name(s.task),
            kernel,
            us(s.data_wait as f64),
            us(s.orch_wait as f64),
            us(s.core_wait as f64),
            us(s.scheduling as f64),
            us(s.compute as f64)
        );
    }
    if c.observed.len() > limit {
        let _ = writeln!(out, "... {} more tasks", c.observed.len() - limit);
    }
    out
}
