//! `simpler trace idle`: where the cores wait between kernels.
//!
//! Every stretch of a core's time inside the execution span with no block running is charged to the
//! pair of kernels around it: the kernel whose block the core last finished and the kernel of
//! the block it ran next (the run's start and end stand in at the edges). Summed, the gaps are
//! exactly `cores × execution span − busy`: the cores' time spent outside kernels (what
//! `simpler bench qwen3-decode` reports as a share of the run's effective interval, a little
//! longer than the execution span), taken apart by phase boundary. A large
//! `A → B` total usually means a barrier: the cores that finish `A` early wait for its last
//! block and for whatever small serial step leads to `B`; an `A → A (same task)` total is the
//! cost of claiming SPMD blocks.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use simpler_core::trace::{DepGraph, SwimlaneRecords};

use crate::blocks::{check_records, core_count, execution_span};
use crate::error::{DfxError, Result};
use crate::stats::{percentile_sorted, us};
use crate::swimlane::{kernel_names, name_of};

/// One side of a gap: a kernel, or the run's start or end.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Edge {
    /// The execution span's start (the gap before a core's first block).
    RunStart,
    /// A block of this kernel (id).
    Kernel(u32),
    /// The execution span's end (the gap after a core's last block).
    RunEnd,
}

/// The idle time charged to one `(before, after)` pair.
#[derive(Clone, Debug, PartialEq)]
pub struct IdleRow {
    /// What the core last finished (kernel name or `run start`).
    pub before: String,
    /// What the core ran next (kernel name or `run end`).
    pub after: String,
    /// Both blocks belong to the same task (an SPMD task's consecutive blocks).
    pub same_task: bool,
    /// Gaps charged to the pair (zero-length ones included).
    pub count: usize,
    /// Their total, ns.
    pub total_ns: u64,
    /// `total_ns` over `cores × execution span`.
    pub share: f64,
    /// Median gap, ns.
    pub p50_ns: u64,
    /// 90th percentile gap, ns.
    pub p90_ns: u64,
    /// Longest gap, ns.
    pub max_ns: u64,
}

impl IdleRow {
    /// `before -> after`, with ` (same task)` for consecutive blocks of one task.
    pub fn pair(&self) -> String {
        let same = if self.same_task { " (same task)" } else { "" };
        format!("{} -> {}{same}", self.before, self.after)
    }
}

/// The idle analysis of one swimlane.
#[derive(Clone, Debug, PartialEq)]
pub struct Idle {
    /// Execution span (first block dispatch to last block finish), ns.
    pub execution_span_ns: u64,
    /// Cores.
    pub cores: u32,
    /// Kernel execution time summed over cores, ns.
    pub busy_ns: u64,
    /// `cores × execution span − busy`, ns: the sum of every row's `total_ns`.
    pub idle_ns: u64,
    /// Rows, largest total first.
    pub rows: Vec<IdleRow>,
    /// Records the recorder dropped: their blocks' time counts as idle.
    pub dropped: u64,
}

impl Idle {
    /// Idle share of the cores' time inside the execution span.
    pub fn idle_share(&self) -> f64 {
        let all = self.execution_span_ns as f64 * f64::from(self.cores);
        if all > 0.0 {
            self.idle_ns as f64 / all
        } else {
            0.0
        }
    }
}

type Key = (Edge, Edge, bool);

/// Charges every gap of every core to its `(before, after)` pair.
pub fn analyze(r: &SwimlaneRecords, deps: Option<&DepGraph>) -> Result<Idle> {
    let (m0, m1) = execution_span(r)
        .ok_or_else(|| DfxError::Missing("the swimlane has no block records".into()))?;
    check_records(r)?;
    let cores = core_count(r);
    let mut by_core: Vec<Vec<(u64, u64, u32, u64)>> = vec![Vec::new(); cores as usize];
    for b in &r.tasks {
        by_core[b.core as usize].push((b.start, b.end, b.func, b.task_id));
    }
    let mut gaps: HashMap<Key, Vec<u64>> = HashMap::new();
    let mut busy = 0u64;
    for blocks in &mut by_core {
        blocks.sort_unstable();
        // (time the core became free, what it last ran, its task)
        let mut free_at = m0;
        let mut last: (Edge, Option<u64>) = (Edge::RunStart, None);
        for &(start, end, func, task) in blocks.iter() {
            let same = last.1 == Some(task);
            gaps.entry((last.0.clone(), Edge::Kernel(func), same))
                .or_default()
                .push(start.saturating_sub(free_at));
            let end = end.max(start);
            busy = busy.saturating_add(end - start.max(free_at).min(end));
            free_at = free_at.max(end);
            last = (Edge::Kernel(func), Some(task));
        }
        gaps.entry((last.0, Edge::RunEnd, false))
            .or_default()
            .push(m1.saturating_sub(free_at));
    }
    let names = kernel_names(r, deps);
    let label = |e: &Edge| match e {
        Edge::RunStart => "run start".to_string(),
        Edge::RunEnd => "run end".to_string(),
        Edge::Kernel(k) => name_of(&names, *k),
    };
    let all = (m1 - m0) as f64 * f64::from(cores);
    let mut rows: Vec<IdleRow> = gaps
        .into_iter()
        .collect::<BTreeMap<Key, Vec<u64>>>()
        .into_iter()
        .map(|((before, after, same_task), mut v)| {
            v.sort_unstable();
            let total_ns: u64 = v.iter().fold(0, |a, &x| a.saturating_add(x));
            IdleRow {
                before: label(&before),
                after: label(&after),
                same_task,
                count: v.len(),
                total_ns,
                share: if all > 0.0 {
                    total_ns as f64 / all
                } else {
                    0.0
                },
                p50_ns: percentile_sorted(&v, 50.0).unwrap_or(0),
                p90_ns: percentile_sorted(&v, 90.0).unwrap_or(0),
                max_ns: v.last().copied().unwrap_or(0),
            }
        })
        .collect();
    rows.sort_by(|a, b| {
        b.total_ns
            .cmp(&a.total_ns)
            .then_with(|| (&a.before, &a.after).cmp(&(&b.before, &b.after)))
    });
    let idle_ns = rows.iter().fold(0u64, |a, r| a.saturating_add(r.total_ns));
    Ok(Idle {
        execution_span_ns: m1 - m0,
        cores,
        busy_ns: busy,
        idle_ns,
        rows,
        dropped: r.dropped,
    })
}

/// The text report: totals, then the `top` largest pairs (all when `top` is 0).
pub fn report(idle: &Idle, top: usize) -> String {
    let mut out = String::new();
    crate::diag::warn_dropped(
        &mut out,
        idle.dropped,
        "their blocks' time counts as idle below",
    );
    let _ = writeln!(
        out,
        "execution span {} µs (first block dispatch to last block finish), {} cores: kernels busy {} µs, idle {} µs = {:.1}% of the cores' time",
        us(idle.execution_span_ns as f64),
        idle.cores,
        us(idle.busy_ns as f64),
        us(idle.idle_ns as f64),
        100.0 * idle.idle_share()
    );
    let _ = writeln!(
        out,
        "{:<58} {:>6} {:>11} {:>7} {:>9} {:>9} {:>9}",
        "idle between (before -> after)", "gaps", "total µs", "share", "p50 µs", "p90 µs", "max µs"
    );
    let shown = if top == 0 {
        idle.rows.len()
    } else {
        top.min(idle.rows.len())
    };
    for r in &idle.rows[..shown] {
        let _ = writeln!(
            out,
            "{:<58} {:>6} {:>11} {:>6.2}% {:>9} {:>9} {:>9}",
            r.pair(),
            r.count,
            us(r.total_ns as f64),
            100.0 * r.share,
            us(r.p50_ns as f64),
            us(r.p90_ns as f64),
            us(r.max_ns as f64)
        );
    }
    if shown < idle.rows.len() {
        let rest: u64 = idle.rows[shown..]
            .iter()
            .fold(0, |a, r| a.saturating_add(r.total_ns));
        let _ = writeln!(
            out,
            "({} more pairs, {} µs together; --top 0 shows all)",
            idle.rows.len() - shown,
            us(rest as f64)
        );
    }
    let _ = writeln!(
        out,
        "(each gap on a core, from one block's end to its next block's start, is charged to the two kernels around it; the totals add up to the idle time)"
    );
    out
}

#[cfg(test)]
mod tests {
    use simpler_core::task::EngineClass;
    use simpler_core::trace::TaskRecord;

    use super::*;

    fn block(task: u64, func: u32, core: u32, start: u64, end: u64) -> TaskRecord {
        TaskRecord {
            task_id: task,
            func,
            class: EngineClass::Vector,
            core,
            block: 0,
            dispatch: 0,
            start,
            end,
            finish: 0,
        }
    }

    fn records(tasks: Vec<TaskRecord>) -> SwimlaneRecords {
        let mut kernels = BTreeMap::new();
        kernels.insert(7, "gemm".to_string());
        kernels.insert(8, "norm".to_string());
        SwimlaneRecords {
            level: 1,
            cores: 2,
            tasks,
            kernels,
            ..Default::default()
        }
    }

    fn row<'a>(idle: &'a Idle, before: &str, after: &str, same: bool) -> &'a IdleRow {
        idle.rows
            .iter()
            .find(|r| r.before == before && r.after == after && r.same_task == same)
            .unwrap_or_else(|| panic!("no row {before} -> {after} ({same}) in {:?}", idle.rows))
    }

    #[test]
    fn gaps_are_charged_to_the_kernels_around_them_and_add_up_to_the_idle_time() {
        // Core 0: gemm task 1 [0,100), [110,200); norm task 2 [260,270); gemm task 3 [275,400).
        // Core 1: gemm task 1 [0,150); idle until gemm task 3 [280,390); idle to 400.
        let r = records(vec![
            block(1, 7, 0, 0, 100),
            block(1, 7, 1, 0, 150),
            block(1, 7, 0, 110, 200),
            block(2, 8, 0, 260, 270),
            block(3, 7, 0, 275, 400),
            block(3, 7, 1, 280, 390),
        ]);
        let idle = analyze(&r, None).expect("analysis");
        assert_eq!((idle.execution_span_ns, idle.cores), (400, 2));
        assert_eq!(idle.busy_ns, 100 + 90 + 10 + 125 + 150 + 110);
        assert_eq!(idle.idle_ns, 800 - idle.busy_ns);
        assert_eq!(
            idle.rows.iter().map(|r| r.total_ns).sum::<u64>(),
            idle.idle_ns
        );
        let same = row(&idle, "gemm", "gemm", true);
        assert_eq!((same.count, same.total_ns), (1, 10));
        let to_norm = row(&idle, "gemm", "norm", false);
        assert_eq!((to_norm.count, to_norm.total_ns), (1, 60));
        let barrier = row(&idle, "gemm", "gemm", false);
        // Core 1 waits 130 (150 -> 280) for the next gemm.
        assert_eq!(
            (barrier.count, barrier.total_ns, barrier.max_ns),
            (1, 130, 130)
        );
        assert_eq!(row(&idle, "norm", "gemm", false).total_ns, 5);
        assert_eq!(row(&idle, "gemm", "run end", false).total_ns, 10);
        assert_eq!(row(&idle, "run start", "gemm", false).total_ns, 0);
        assert_eq!(idle.rows[0].total_ns, 130, "largest first");
        let text = report(&idle, 2);
        assert!(text.contains("gemm -> gemm "), "{text}");
        assert!(text.contains("more pairs"), "{text}");
    }

    #[test]
    fn a_core_without_blocks_is_idle_for_the_whole_execution_span() {
        let mut r = records(vec![block(1, 7, 0, 50, 150)]);
        r.cores = 2;
        let idle = analyze(&r, None).expect("analysis");
        assert_eq!(idle.execution_span_ns, 100);
        assert_eq!(idle.idle_ns, 100);
        assert_eq!(row(&idle, "run start", "run end", false).total_ns, 100);
        assert!((idle.idle_share() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn overlapping_records_on_one_core_are_not_counted_twice() {
        let r = records(vec![block(1, 7, 0, 0, 100), block(2, 8, 0, 50, 120)]);
        let idle = analyze(&r, None).expect("analysis");
        assert_eq!(idle.busy_ns, 120);
        assert_eq!(idle.idle_ns, 120, "core 1 has no blocks");
    }

    #[test]
    fn an_empty_swimlane_is_an_error() {
        let r = records(Vec::new());
        assert!(analyze(&r, None).is_err());
    }

    #[test]
    fn names_fall_back_to_the_kernel_id() {
        let mut r = records(vec![block(1, 9, 0, 0, 10), block(1, 9, 1, 0, 10)]);
        r.kernels.clear();
        let idle = analyze(&r, None).expect("analysis");
        row(&idle, "run start", "kernel 9", false);
        row(&idle, "kernel 9", "run end", false);
    }
}
