//! Task-level times folded from per-block swimlane records, shared by the swimlane, overhead
//! and critical-path analyses.
//!
//! At swimlane level 1 there is no dispatch/finish: a task's dispatch is taken as its start and
//! its finish as its end (so head and tail overheads are zero there).

use std::collections::HashMap;

use simpler_core::EngineClass;
use simpler_core::trace::{SwimlaneRecords, TaskRecord};

/// One task's times from its block records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TaskTimes {
    pub(crate) func: u32,
    pub(crate) class: EngineClass,
    pub(crate) blocks: u32,
    /// Earliest dispatch of a block.
    pub(crate) dispatch: u64,
    /// Earliest kernel start.
    pub(crate) start: u64,
    /// Latest kernel end.
    pub(crate) end: u64,
    /// Latest finish.
    pub(crate) finish: u64,
    /// Core of the block that ended last.
    pub(crate) last_core: u32,
    /// Core of the block that started first.
    pub(crate) first_core: u32,
    /// Longest single block execution.
    pub(crate) max_exec: u64,
}

/// `a - b` as a signed number of ns, saturating (records read from a file may hold any value).
pub(crate) fn signed_diff(a: u64, b: u64) -> i64 {
    (a as i128 - b as i128).clamp(i64::MIN as i128, i64::MAX as i128) as i64
}

/// Whether the records carry dispatch/finish (level >= 2).
pub(crate) fn has_sched_times(r: &SwimlaneRecords) -> bool {
    r.level >= 2
}

/// Dispatch and finish of one block, with the level-1 fallback.
pub(crate) fn dispatch_finish(r: &SwimlaneRecords, b: &TaskRecord) -> (u64, u64) {
    if has_sched_times(r) {
        (b.dispatch, b.finish)
    } else {
        (b.start, b.end)
    }
}

/// Folds the block records per task.
pub(crate) fn task_times(r: &SwimlaneRecords) -> HashMap<u64, TaskTimes> {
    let mut out: HashMap<u64, TaskTimes> = HashMap::new();
    for b in &r.tasks {
        let (d, f) = dispatch_finish(r, b);
        let e = out.entry(b.task_id).or_insert(TaskTimes {
            func: b.func,
            class: b.class,
            blocks: 0,
            dispatch: d,
            start: b.start,
            end: b.end,
            finish: f,
            last_core: b.core,
            first_core: b.core,
            max_exec: 0,
        });
        e.blocks += 1;
        e.dispatch = e.dispatch.min(d);
        if b.start < e.start {
            e.start = b.start;
            e.first_core = b.core;
        }
        if b.end >= e.end {
            e.end = b.end;
            e.last_core = b.core;
        }
        e.finish = e.finish.max(f);
        e.max_exec = e.max_exec.max(b.end.saturating_sub(b.start));
    }
    out
}

/// `[first dispatch, last finish]` over all block records (level 1: start and end).
pub(crate) fn execution_span(r: &SwimlaneRecords) -> Option<(u64, u64)> {
    let lo = r
        .tasks
        .iter()
        .map(|b| dispatch_finish(r, b).0.min(b.start))
        .min()?;
    let hi = r
        .tasks
        .iter()
        .map(|b| dispatch_finish(r, b).1.max(b.end))
        .max()?;
    // A hostile file can have every record end before it starts; the span is then empty,
    // never reversed (the analyses clamp into it and subtract its ends).
    Some((lo, hi.max(lo)))
}

/// Number of cores: the larger of the recorded count and the highest core id seen + 1.
pub(crate) fn core_count(r: &SwimlaneRecords) -> u32 {
    r.tasks
        .iter()
        .map(|b| b.core.saturating_add(1))
        .max()
        .unwrap_or(0)
        .max(r.cores)
}

/// Most cores a swimlane may name: core ids and counts above it are refused, because the
/// analyses keep per-core state.
pub const MAX_CORES: u32 = 1 << 16;

/// Refuses records no run can have written and that would make an analysis allocate per
/// core id: a core id or count above [`MAX_CORES`], a level above 4.
pub(crate) fn validate(r: &SwimlaneRecords) -> std::result::Result<(), String> {
    if r.level > 4 {
        return Err(format!("swimlane level {} is not one of 1..=4", r.level));
    }
    if r.cores > MAX_CORES {
        return Err(format!(
            "cores = {} is more than the {MAX_CORES} cores the tools accept",
            r.cores
        ));
    }
    let cores = r.tasks.iter().map(|b| b.core);
    let phase_ids = r.phases.iter().flat_map(|p| [p.core, p.sched]);
    if let Some(c) = cores.chain(phase_ids).find(|&c| c >= MAX_CORES) {
        return Err(format!(
            "core or scheduler id {c} is not below the {MAX_CORES} cores the tools accept"
        ));
    }
    Ok(())
}

/// [`validate`] for records handed to an analysis directly rather than read from a file.
pub(crate) fn check_records(r: &SwimlaneRecords) -> crate::error::Result<()> {
    validate(r).map_err(|what| crate::error::DfxError::Invalid {
        path: "swimlane records".into(),
        line: 0,
        what,
    })
}

/// `ring:local` for a task id.
pub(crate) fn task_name(id: u64) -> String {
    format!("{}:{}", id >> 32, id as u32)
}

/// Measure of the instants in `[a, b)` at which all `cores` cores execute a kernel.
pub(crate) struct BusyProfile {
    /// Sorted, disjoint intervals during which every core is executing.
    full: Vec<(u64, u64)>,
}

impl BusyProfile {
    pub(crate) fn new(r: &SwimlaneRecords) -> BusyProfile {
        let cores = core_count(r);
        let mut ev: Vec<(u64, i32)> = Vec::with_capacity(2 * r.tasks.len());
        for b in &r.tasks {
            if b.end > b.start {
                ev.push((b.start, 1));
                ev.push((b.end, -1));
            }
        }
        ev.sort();
        let mut full = Vec::new();
        let mut busy: i32 = 0;
        let mut full_from: Option<u64> = None;
        let mut i = 0;
        while i < ev.len() {
            let t = ev[i].0;
            while i < ev.len() && ev[i].0 == t {
                busy += ev[i].1;
                i += 1;
            }
            let is_full = cores > 0 && busy as u32 >= cores;
            match (is_full, full_from) {
                (true, None) => full_from = Some(t),
                (false, Some(f)) => {
                    full.push((f, t));
                    full_from = None;
                }
                _ => {}
            }
        }
        BusyProfile { full }
    }

    /// Nanoseconds of `[a, b)` during which every core was executing.
    pub(crate) fn all_busy(&self, a: u64, b: u64) -> u64 {
        if b <= a {
            return 0;
        }
        let from = self.full.partition_point(|&(_, e)| e <= a);
        self.full[from..]
            .iter()
            .take_while(|&&(s, _)| s < b)
            .map(|&(s, e)| e.min(b).saturating_sub(s.max(a)))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(task_id: u64, core: u32, d: u64, s: u64, e: u64, f: u64) -> TaskRecord {
        TaskRecord {
            task_id,
            func: 0,
            class: EngineClass::Vector,
            core,
            block: 0,
            dispatch: d,
            start: s,
            end: e,
            finish: f,
        }
    }

    #[test]
    fn busy_profile_measures_full_occupancy() {
        let r = SwimlaneRecords {
            level: 2,
            cores: 2,
            tasks: vec![
                rec(1, 0, 0, 0, 10, 10),
                rec(2, 1, 0, 5, 20, 20),
                rec(3, 0, 10, 12, 30, 30),
            ],
            ..Default::default()
        };
        let p = BusyProfile::new(&r);
        // Both cores execute during [5, 10) and [12, 20).
        assert_eq!(p.all_busy(0, 100), 5 + 8);
        assert_eq!(p.all_busy(7, 14), 3 + 2);
        assert_eq!(p.all_busy(10, 12), 0);
        assert_eq!(execution_span(&r), Some((0, 30)));
        let t = task_times(&r);
        assert_eq!(t[&2].start, 5);
    }

    #[test]
    fn records_that_end_before_they_start_give_an_empty_span_and_the_analyses_still_answer() {
        // Every record ends (and finishes) before it is dispatched or started: the case the
        // hostile-files property test shrank to. The span is empty at the earliest start, and
        // the idle and overhead analyses, which clamp into it, return instead of panicking.
        let r = SwimlaneRecords {
            level: 2,
            cores: 1,
            tasks: vec![rec(1, 0, u32::MAX as u64, u32::MAX as u64, 0, 0)],
            ..Default::default()
        };
        let (lo, hi) = execution_span(&r).expect("one record gives a span");
        assert_eq!(lo, hi, "the span is empty, never reversed");
        assert!(crate::idle::analyze(&r, None).is_ok());
        assert!(crate::overhead::analyze(&r, None).is_ok());
    }
}
