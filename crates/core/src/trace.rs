//! Records a run emits for the trace and the diagnostics: spans, swimlane records, the captured
//! dependency graph and ring statistics.
//!
//! The core only *produces* these values (in [`crate::RunReport`]); writing them to files and
//! reading them back is the `simpler-dfx` crate's job. The serialized forms are the versioned
//! trace format documented in `docs/trace-format.md`; bump [`TRACE_FORMAT_VERSION`] on any
//! incompatible change.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::clock::ClockAnchor;
use crate::task::EngineClass;

/// Version of the trace format (`"v"` in every span line).
pub const TRACE_FORMAT_VERSION: u32 = 1;

/// Which clock a timestamp was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Clock {
    /// The host's monotonic clock, as nanoseconds since the process anchor.
    Host,
    /// A device timer, in the device's own nanoseconds; the invocation's
    /// [`TraceLine::DeviceAlignment`] maps it onto the host axis (a reader treats a device span
    /// without one as already aligned, and says so).
    Device,
}

/// A value attached to a span.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum AttrValue {
    /// Boolean flag.
    Bool(bool),
    /// Integer.
    Int(i64),
    /// Floating-point number.
    Float(f64),
    /// Text.
    Str(String),
}

/// One timed interval of a run (`run`, `run.bind`, `orch`, `sched`, ...).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpanRecord {
    /// Trace format version ([`TRACE_FORMAT_VERSION`]).
    pub v: u32,
    /// Process id.
    pub pid: u32,
    /// Thread that recorded the span (a stable per-process number, not the OS tid).
    pub tid: u64,
    /// Per-process invocation counter: the n-th run of this process.
    pub inv: u64,
    /// Stable content hash of what ran, as 16 hex digits (same workload, same id).
    pub callable: String,
    /// Nesting depth: `run` is 0, `run.bind` is 1, `run.bind.args` 2, ...
    pub depth: u8,
    /// Standard span name (see `docs/trace-format.md`).
    pub name: String,
    /// Start, in nanoseconds on `clock`'s axis (host: since the process anchor).
    pub ts_ns: u64,
    /// Duration in nanoseconds.
    pub dur_ns: u64,
    /// Clock the timestamps come from.
    pub clock: Clock,
    /// Extra attributes (`label`: "decode"/"prefill", `round`, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: BTreeMap<String, AttrValue>,
}

/// How device timestamps were mapped onto the host axis.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceClockAlignment {
    /// Device clock value at the alignment point.
    pub device_ns: u64,
    /// Host clock value (since the process anchor) at the same point.
    pub host_ns: u64,
    /// Half-width of the interval in which the true offset lies, in nanoseconds.
    pub uncertainty_ns: u64,
}

/// Where a process's monotonic axis lies on its host's shared monotonic clock, and which rank
/// of a multi-process run (a node's chip, an `mpirun` rank) the process is.
///
/// Processes of one kernel boot (equal `boot_id`) read one `CLOCK_MONOTONIC`, so their axes
/// line up through `mono_ns` to within the stated uncertainties, however far their wall clocks
/// (the anchors) drift apart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessClock {
    /// Process id (as in its anchor).
    pub pid: u32,
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`): one host, one boot.
    pub boot_id: String,
    /// `CLOCK_MONOTONIC` (ns since boot) at the process's monotonic zero.
    pub mono_ns: u64,
    /// Half-width of the interval holding the true `mono_ns`.
    pub uncertainty_ns: u64,
    /// Rank of this process among `ranks`, when it is one of several.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// Number of ranks of the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<u32>,
    /// What the process is (`chip 1`, `mpi rank 3`, `parent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Its host clock's offset to the clock of the run's reference process (rank 0), when
    /// the ranks may run on several hosts (`mpirun`); absent in traces written before it
    /// existed, which read as "no offset known".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_offset: Option<ClockOffset>,
}

/// How far a process's `CLOCK_MONOTONIC` is from the reference process's (rank 0 of an
/// `mpirun` job), estimated at start-up by round trips to it.
///
/// Processes on the reference's own host (equal boot ids) share its clock exactly, and the
/// readers ignore the measured offset for them; for a process on another host it is the only
/// link between the two clocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockOffset {
    /// The reference's boot id (which host's clock the offset is to).
    pub reference_boot_id: String,
    /// This process's `CLOCK_MONOTONIC` minus the reference's at one instant, in ns.
    pub offset_ns: i64,
    /// Half-width of the interval holding the true offset (half the round trip it came from).
    pub uncertainty_ns: u64,
}

/// One line of a trace file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TraceLine {
    /// Maps this process's monotonic axis onto wall-clock time; first line of every file.
    Anchor(ClockAnchor),
    /// The process's place on its host's monotonic clock and its rank; follows its anchor.
    Process(ProcessClock),
    /// A timed span.
    Span(SpanRecord),
    /// Device clock alignment for the spans of one invocation that use [`Clock::Device`].
    DeviceAlignment {
        /// Process id.
        pid: u32,
        /// Invocation the alignment belongs to.
        inv: u64,
        /// The alignment.
        alignment: DeviceClockAlignment,
    },
}

/// One kernel execution of one block of one task on one core (swimlane level >= 1).
///
/// All timestamps are host nanoseconds since the process anchor. `dispatch` and `finish` are
/// zero at level 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// Task id, `(ring << 32) | local_id`.
    pub task_id: u64,
    /// Kernel id (`u32::MAX` for a dummy task).
    pub func: u32,
    /// Engine class of the kernel.
    pub class: EngineClass,
    /// Core that ran the block.
    pub core: u32,
    /// Block index within the task.
    pub block: u32,
    /// When the scheduler handed the block to the core.
    pub dispatch: u64,
    /// Kernel start.
    pub start: u64,
    /// Kernel end.
    pub end: u64,
    /// When the scheduler had processed the completion (fan-out done).
    pub finish: u64,
}

/// A phase of a scheduler loop (swimlane level >= 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchedPhase {
    /// Looking for a ready task and claiming a block.
    Dispatch,
    /// Processing a completion: fan-out, releases.
    Complete,
    /// Spinning or parked with nothing to do.
    Idle,
}

/// A scheduler loop phase interval (swimlane level >= 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseRecord {
    /// Scheduler (on the CPU platform every core schedules for itself: scheduler == core).
    pub sched: u32,
    /// Core the scheduler owns.
    pub core: u32,
    /// The phase.
    pub phase: SchedPhase,
    /// Start (ns since the process anchor).
    pub start: u64,
    /// End (ns since the process anchor).
    pub end: u64,
}

/// A sample of a ready queue's depth (swimlane level >= 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueDepthSample {
    /// When (ns since the process anchor).
    pub ts: u64,
    /// Which ready queue.
    pub class: EngineClass,
    /// Tasks waiting in it.
    pub depth: u32,
}

/// One orchestrator submit (swimlane level 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitRecord {
    /// The task that was submitted.
    pub task_id: u64,
    /// Submit start (ns since the process anchor).
    pub start: u64,
    /// Submit end, including any wait for ring space.
    pub end: u64,
}

/// Everything the swimlane recorder captured during one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SwimlaneRecords {
    /// Level the run was recorded at (1..=4).
    pub level: u8,
    /// Topology fingerprint of the run's task graph (same as in the captured `deps.json`).
    pub fingerprint: String,
    /// Number of cores.
    pub cores: u32,
    /// Per-block kernel records.
    pub tasks: Vec<TaskRecord>,
    /// Scheduler phases (level >= 3).
    pub phases: Vec<PhaseRecord>,
    /// Ready queue depth samples (level >= 3).
    pub queue_depth: Vec<QueueDepthSample>,
    /// Orchestrator submits (level 4).
    pub submits: Vec<SubmitRecord>,
    /// Records that did not fit in the recorder's buffers and were dropped.
    pub dropped: u64,
    /// Of `dropped`, the per-block kernel records (`tasks`); absent in files written before
    /// the field existed (then 0: such a file says only `dropped`).
    #[serde(default)]
    pub tasks_dropped: u64,
    /// Names of the kernels the records mention, by kernel id (absent in files written before
    /// the field existed; readers then fall back to `deps.json` or the id).
    #[serde(default)]
    pub kernels: BTreeMap<u32, String>,
}

/// Scope kind, as recorded in the dependency graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScopeKindRecord {
    /// Dependencies discovered from tensors.
    Auto,
    /// Only explicit dependencies.
    Manual,
}

/// Where a dependency edge came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgeSource {
    /// The consumer reads a tensor the producer created as an `Output`.
    Creator,
    /// The TensorMap found the producer as a live writer of an overlapping region.
    Tensormap,
    /// The orchestration added it explicitly.
    Explicit,
}

/// How two regions overlapped when the TensorMap created an edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverlapKind {
    /// The consumer's region covers the producer's entirely.
    Covers,
    /// Some elements are shared.
    Partial,
    /// Treated as overlapping because the layouts could not be compared (conservative).
    Conservative,
    /// Not a tensor overlap (creator or explicit edges).
    None,
}

/// One tensor argument of a captured task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArgRecord {
    /// Direction tag (`input`, `output`, `in_out`, `output_existing`, `no_dep`).
    pub tag: String,
    /// Index into [`DepGraph::tensors`].
    pub tensor: usize,
    /// Start offset in elements.
    pub offset: u64,
    /// Shape.
    pub shape: Vec<u64>,
    /// Strides in elements.
    pub strides: Vec<u64>,
}

/// A captured task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskNode {
    /// Task id.
    pub id: u64,
    /// Scope kind it was submitted in.
    pub scope: ScopeKindRecord,
    /// Scope depth.
    pub scope_depth: u32,
    /// Kernel id (`u32::MAX` for dummy tasks).
    pub kernel: u32,
    /// Kernel name (empty for dummy tasks).
    pub kernel_name: String,
    /// SPMD block count.
    pub block_num: u32,
    /// Tensor arguments.
    pub args: Vec<ArgRecord>,
}

/// A tensor seen by the capture (one per buffer and version).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorNode {
    /// Buffer id.
    pub buffer: u64,
    /// Version of the buffer when the tensor was first seen.
    pub version: u32,
    /// Element type.
    pub dtype: crate::DType,
    /// Size of the buffer in bytes.
    pub size: u64,
}

/// A dependency edge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EdgeRecord {
    /// Producer task id.
    pub pred: u64,
    /// Consumer task id.
    pub succ: u64,
    /// Why the edge exists.
    pub source: EdgeSource,
    /// Overlap kind for TensorMap edges.
    pub overlap: OverlapKind,
}

/// The captured dependency graph of one run (`--dep-gen`, written as `deps.json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DepGraph {
    /// Format version ([`TRACE_FORMAT_VERSION`]).
    pub v: u32,
    /// Topology fingerprint: a hash of every task's kernel and block count and every edge.
    pub fingerprint: String,
    /// Tasks in submit order.
    pub tasks: Vec<TaskNode>,
    /// Tensors.
    pub tensors: Vec<TensorNode>,
    /// Edges (each at most once per pair and source).
    pub edges: Vec<EdgeRecord>,
}

/// High-water mark of one resource against its capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Highest use seen.
    pub high_water: u64,
    /// Capacity.
    pub capacity: u64,
}

impl Usage {
    /// High-water mark as a fraction of capacity.
    pub fn fraction(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.high_water as f64 / self.capacity as f64
        }
    }
}

/// Ring statistics of one ring set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RingUsage {
    /// Ring index (0..=3).
    pub ring: u8,
    /// Tasks in flight (window slots).
    pub task_window: Usage,
    /// Heap bytes in use.
    pub heap: Usage,
    /// Dependency pool entries in use.
    pub dep_pool: Usage,
}

/// Ring statistics of one scope site (where a scope was opened in the orchestration code).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScopeSiteUsage {
    /// `file:line` of the scope's opening call, or its label.
    pub site: String,
    /// Ring the scope's tasks use.
    pub ring: u8,
    /// Times the scope was opened.
    pub opened: u64,
    /// Most tasks submitted directly in one instance of the scope.
    pub max_tasks: u64,
    /// Most heap bytes allocated by one instance of the scope.
    pub max_heap: u64,
    /// Most dependency-pool entries (producer edges) taken by one instance of the scope.
    #[serde(default)]
    pub max_dep_pool: u64,
    /// Most dependency-map entries inserted by one instance of the scope (0 in a replay,
    /// which uses no map).
    #[serde(default)]
    pub max_map_entries: u64,
}

/// Ring statistics of a run (`--ring-stats`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RingStats {
    /// Per ring set.
    pub rings: Vec<RingUsage>,
    /// TensorMap entries (shared by all rings).
    pub tensormap: Usage,
    /// Per scope site.
    pub scopes: Vec<ScopeSiteUsage>,
}
