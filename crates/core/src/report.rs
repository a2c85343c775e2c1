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
}

impl RunReport {
    /// `max(orch_end, sched_end) - min(orch_start, sched_start)`.
    pub fn effective(&self) -> Interval {
        Interval {
            start_ns: self.orch.start_ns.min(self.sched.start_ns),
            end_ns: self.orch.end_ns.max(self.sched.end_ns),
        }
    }

    /// The standard span tree of this run as trace records (see `docs/trace-format.md`).
    pub fn spans(&self, pid: u32, tid: u64) -> Vec<SpanRecord> {
        crate::timing::spans_of(self, pid, tid)
    }
}
