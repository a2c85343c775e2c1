//! The always-on timing of a run ([`RunReport`]) and the diagnostics it carries.

use serde::{Deserialize, Serialize};

use crate::trace::{DepGraph, RingStats, SpanRecord, SwimlaneRecords};

/// A closed interval on the process time axis, in nanoseconds since the clock anchor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interval {
    /// Start.
    pub start_ns: u64,
    /// End (>= start).
    pub end_ns: u64,
}

impl Interval {
    /// Length in nanoseconds.
    pub fn dur_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
    /// Length in microseconds.
    pub fn us(&self) -> f64 {
        self.dur_ns() as f64 / 1e3
    }
}

/// The span of the tasks tagged with one timing slot: min dispatch to max finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSlotTiming {
    /// The slot number the orchestration tagged tasks with.
    pub slot: u8,
    /// Tasks tagged with it.
    pub tasks: u64,
    /// Earliest dispatch to latest finish.
    pub span: Interval,
}

/// What a ring set still holds after a run (all zero when everything was reclaimed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingOccupancy {
    /// Ring index.
    pub ring: u8,
    /// Tasks submitted on this ring during the run.
    pub tasks: u64,
    /// Task-window slots still in use.
    pub window: u64,
    /// Heap bytes still in use.
    pub heap: u64,
    /// Dependency-pool entries still in use.
    pub dep_pool: u64,
}

/// Counters of one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunCounters {
    /// Tasks submitted (kernel tasks, dummies and tensor allocations).
    pub tasks: u64,
    /// Blocks executed by cores (skipped and dummy tasks run none).
    pub blocks: u64,
    /// Dependency edges created.
    pub edges: u64,
    /// Times the orchestrator waited for ring space.
    pub ring_waits: u64,
    /// Tasks completed without running because their dispatch predicate was false.
    pub skipped: u64,
}

/// The timing of one run (always on), as described in `docs/trace-format.md`.
///
/// `host_wall ⊇ bind + runner + validate`; `runner ⊇ device_wall ⊇ graph_build, orch, sched`.
/// `orch` and `sched` overlap and must never be added: `effective` is their union's extent.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunReport {
    /// Per-process invocation number of this run.
    pub inv: u64,
    /// Stable content hash of the orchestration and its arguments' shapes.
    pub callable: u64,
    /// Name of the orchestration that ran.
    pub orchestration: String,
    /// Label from the config (`decode`, `prefill`, ...).
    pub label: Option<String>,
    /// Whether the config marked this run a warm-up ([`CallConfig::warmup`](crate::CallConfig::warmup)).
    #[serde(default)]
    pub warmup: bool,
    /// The engine's whole step around this run (its inputs written, the run, its outputs read
    /// back: what a caller of the engine waits for), when the engine recorded it (the Qwen3
    /// `Session`'s steps do); zero otherwise. The trace's `engine.step` span, and timing layer
    /// ⑤ (engine/host wrap = `engine_step` − `host_wall`).
    #[serde(default)]
    pub engine_step: Interval,
    /// The whole call.
    pub host_wall: Interval,
    /// Argument binding and validation.
    pub bind: Interval,
    /// Checking the run's buffer arguments (inside `bind`).
    pub bind_args: Interval,
    /// Launch to completion.
    pub runner: Interval,
    /// Error check and result collection after the runner.
    pub validate: Interval,
    /// Execution on the platform (arena wiring to the last completion).
    pub device_wall: Interval,
    /// Configuration validation, arena wiring and ring reset.
    pub graph_build: Interval,
    /// Validating the `CallConfig` (inside `graph_build`).
    pub config_validate: Interval,
    /// Wiring ring memory (inside `graph_build`).
    pub arena_wire: Interval,
    /// Resetting ring state for the run (inside `graph_build`).
    pub reset: Interval,
    /// The orchestration function.
    pub orch: Interval,
    /// The scheduler: from launch of the cores to the last completion.
    pub sched: Interval,
    /// Work after the orchestration returned until the last completion.
    pub post_orch: Interval,
    /// User-tagged task slots.
    pub task_slots: Vec<TaskSlotTiming>,
    /// Counters.
    pub counters: RunCounters,
    /// Ring occupancy once the run was over (reclamation check).
    pub ring_final: Vec<RingOccupancy>,
    /// Live entries left in the dependency map once the run was over.
    pub tensormap_final: u64,
    /// Number of cores that ran the graph.
    pub cores: u32,
    /// Whether orchestration and execution overlapped (false in serial mode).
    pub overlapped: bool,
    /// Warnings raised while configuring the run (ignored overrides, ignored env vars).
    pub warnings: Vec<String>,
    /// Swimlane records, when `CallConfig::swimlane > 0`.
    pub swimlane: Option<SwimlaneRecords>,
    /// The dependency graph, when `CallConfig::dep_gen`.
    pub deps: Option<DepGraph>,
    /// Ring high-water marks, when `CallConfig::ring_stats`.
    pub ring_stats: Option<RingStats>,
    /// Whether the orchestration submitted the graph, and captured it, or a captured graph
    /// was replayed (then `orch` is the replay's submission loop).
    #[serde(default)]
    pub graph: crate::graph::GraphMode,
    /// Per core: how long its thread was runnable but waiting for a CPU (the OS ran another
    /// thread or process on it) from just before launch to just after the last completion.
    /// Read from the platform's thread counters in runs recording a swimlane; `None` otherwise
    /// or where the platform cannot read them.
    #[serde(default)]
    pub descheduled_ns: Option<Vec<u64>>,
}

/// Where the cores' time went during `effective` ([`RunReport::outside_kernels`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OutsideShare {
    /// `1 - kernel busy / (cores x effective)`: everything outside kernels, the OS running
    /// other processes on the cores included.
    pub raw: f64,
    /// `descheduled / (cores x effective)`: the time the cores' threads waited for a CPU (each
    /// core's capped at the span).
    pub descheduled: Option<f64>,
    /// `1 - kernel busy / (cores x effective - descheduled)`: the share of the time the cores'
    /// threads held a CPU that was spent outside kernels, i.e. the runtime's own share. Per
    /// core, only descheduled time up to the core's time outside kernels is taken off (the OS
    /// may also preempt a kernel, whose span then includes the wait: such time counts as
    /// kernel time, so this is a lower bound when kernels were preempted).
    pub net: Option<f64>,
}

impl OutsideShare {
    /// From each core's kernel busy time, the effective span and each core's descheduled time
    /// (all ns; `descheduled`, when given, has one entry per core).
    pub fn of(
        busy: &[u64],
        effective_ns: u64,
        descheduled: Option<&[u64]>,
    ) -> Option<OutsideShare> {
        let total = busy.len() as f64 * effective_ns as f64;
        if total <= 0.0 {
            return None;
        }
        let busy_sum: u64 = busy.iter().sum();
        let raw = 1.0 - busy_sum as f64 / total;
        let d = descheduled.filter(|d| d.len() == busy.len());
        // The counters are read around the whole launch (a wider window than `effective`),
        // and the OS books a wait when the thread runs again, so a wait begun before the window
        // lands in it whole: on a loaded host a core's count can exceed the span. A thread
        // cannot wait longer than the span it is divided by: each core's count is capped at it.
        let descheduled =
            d.map(|d| d.iter().map(|&w| w.min(effective_ns)).sum::<u64>() as f64 / total);
        let net = d.and_then(|d| {
            let held: f64 = busy
                .iter()
                .zip(d)
                .map(|(&b, &w)| {
                    let outside = effective_ns.saturating_sub(b);
                    (effective_ns - w.min(outside)) as f64
                })
                .sum();
            (held > 0.0).then(|| 1.0 - busy_sum as f64 / held)
        });
        Some(OutsideShare {
            raw,
            descheduled,
            net,
        })
    }
}

impl RunReport {
    /// `max(orch_end, sched_end) - min(orch_start, sched_start)`.
    pub fn effective(&self) -> Interval {
        Interval {
            start_ns: self.orch.start_ns.min(self.sched.start_ns),
            end_ns: self.orch.end_ns.max(self.sched.end_ns),
        }
    }

    /// The cores' time outside kernels during [`RunReport::effective`], from the swimlane
    /// (level 1 at least) and, where measured, the cores' descheduled time; `None` without a
    /// swimlane, or with one that dropped kernel records: the dropped blocks' time would count
    /// as time outside kernels (dropped phase, queue or submit records do not matter here).
    pub fn outside_kernels(&self) -> Option<OutsideShare> {
        let sw = self.swimlane.as_ref().filter(|s| s.tasks_dropped == 0)?;
        let mut busy = vec![0u64; self.cores as usize];
        for t in &sw.tasks {
            if let Some(b) = busy.get_mut(t.core as usize) {
                *b += t.end.saturating_sub(t.start);
            }
        }
        OutsideShare::of(
            &busy,
            self.effective().dur_ns(),
            self.descheduled_ns.as_deref(),
        )
    }

    /// The standard span tree of this run as trace records (see `docs/trace-format.md`).
    pub fn spans(&self, pid: u32, tid: u64) -> Vec<SpanRecord> {
        crate::timing::spans_of(self, pid, tid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_share_takes_descheduled_time_off_the_cores_time() {
        // Two cores, 1000 ns effective: core 0 ran kernels 900 ns, core 1 600 ns.
        let busy = [900, 600];
        let s = OutsideShare::of(&busy, 1000, None).unwrap();
        assert!((s.raw - 0.25).abs() < 1e-12);
        assert_eq!((s.descheduled, s.net), (None, None));
        // Core 1 waited 300 ns for a CPU: of its 400 ns outside kernels, 100 ns are ours.
        // 1 - 1500 / (2000 - 300).
        let s = OutsideShare::of(&busy, 1000, Some(&[0, 300])).unwrap();
        assert!((s.raw - 0.25).abs() < 1e-12);
        assert!((s.descheduled.unwrap() - 0.15).abs() < 1e-12);
        assert!((s.net.unwrap() - (1.0 - 1500.0 / 1700.0)).abs() < 1e-12);
        // Core 0 waited more than its time outside kernels (the OS also preempted a kernel):
        // only its 100 ns outside count, so no core's share goes negative.
        let s = OutsideShare::of(&busy, 1000, Some(&[250, 400])).unwrap();
        assert!((s.descheduled.unwrap() - 0.325).abs() < 1e-12);
        assert!((s.net.unwrap() - 0.0).abs() < 1e-12);
        // A count past the span (a wait booked whole that began before the window) is capped
        // at the span: the share stays within 100%.
        let s = OutsideShare::of(&busy, 1000, Some(&[5000, 2500])).unwrap();
        assert!((s.descheduled.unwrap() - 1.0).abs() < 1e-12);
        assert!(s.net.unwrap() >= 0.0);
        // A count per core or nothing; no cores or no span, no share.
        assert_eq!(OutsideShare::of(&busy, 1000, Some(&[1])).unwrap().net, None);
        assert_eq!(OutsideShare::of(&[], 1000, None), None);
        assert_eq!(OutsideShare::of(&busy, 0, None), None);
    }

    #[test]
    fn outside_kernels_sums_each_cores_kernel_spans() {
        use crate::trace::{SwimlaneRecords, TaskRecord};
        let task = |core: u32, start: u64, end: u64| TaskRecord {
            task_id: 0,
            func: 0,
            class: crate::EngineClass::Vector,
            core,
            block: 0,
            dispatch: start,
            start,
            end,
            finish: end,
        };
        let r = RunReport {
            cores: 2,
            orch: Interval {
                start_ns: 100,
                end_ns: 500,
            },
            sched: Interval {
                start_ns: 100,
                end_ns: 1100,
            },
            swimlane: Some(SwimlaneRecords {
                tasks: vec![task(0, 100, 600), task(0, 700, 1100), task(1, 200, 800)],
                ..SwimlaneRecords::default()
            }),
            descheduled_ns: Some(vec![0, 300]),
            ..RunReport::default()
        };
        let s = r.outside_kernels().unwrap();
        assert!((s.raw - 0.25).abs() < 1e-12);
        assert!((s.net.unwrap() - (1.0 - 1500.0 / 1700.0)).abs() < 1e-12);
        assert_eq!(RunReport::default().outside_kernels(), None);
        // A swimlane that dropped records gives no share: the dropped tasks' time is unknown.
        let mut incomplete = r.clone();
        let sw = incomplete.swimlane.as_mut().unwrap();
        // Dropped phase or submit records leave the kernels' busy time whole.
        sw.dropped = 3;
        assert!(incomplete.outside_kernels().is_some());
        incomplete.swimlane.as_mut().unwrap().tasks_dropped = 1;
        assert_eq!(incomplete.outside_kernels(), None);
    }
}
