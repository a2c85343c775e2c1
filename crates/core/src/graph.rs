//! Captured graphs: the task graph of one run, recorded so that later runs replay it without
//! running the orchestration function or consulting the dependency map (TensorMap).
//!
//! # What is captured
//! [`Worker::capture_fn`](crate::Worker::capture_fn) runs an orchestration like `run_fn` and
//! records, as the orchestrator submits them:
//! - every task ([`GraphTask`]), in submission order, which is a topological order (a task only
//!   ever depends on tasks submitted before it): its kernel, engine class, blocks, scalars,
//!   timing slot, ring, output block layout and its tensor arguments ([`GraphArg`]), each
//!   resolved to a user buffer of the graph ([`ArgSource::Buffer`]) or to an output of an
//!   earlier task ([`ArgSource::Output`]);
//! - every task's producers ([`GraphDep`]), deduplicated as the orchestrator wired them: what
//!   the TensorMap, creator and explicit edges produced, so a replay needs no map;
//! - the scope structure (which scopes opened and closed between which submits), so a replay
//!   drops each task's scope reference at the same point and the rings reclaim as before;
//! - the buffers the run bound (`RunArgs` buffers and those bound through
//!   `Orchestrator::bind`), held by the graph so their memory outlives it.
//!
//! # Replay
//! [`Worker::replay`](crate::Worker::replay) submits the recorded tasks again in the same order,
//! on the same rings, with the recorded edges; runtime-allocated outputs are placed wherever the
//! ring heap has room in this run and every argument that views one is relocated to it. Scalars
//! are replayed as recorded: values that change from run to run (positions, block tables, slot
//! mappings) belong in buffers the graph reads, written by the host between runs. Everything
//! after submission is an ordinary run: the cores, the watchdog, failure diagnosis, the timing
//! report (its `orch` span is the replay's submission loop, and [`RunReport::graph`](crate::RunReport::graph) says
//! `Replayed`), swimlane records (with the captured topology fingerprint) and the buffers bound
//! for the run's duration.
//!
//! A replay is refused before anything runs, with an error naming what differs, when the graph
//! was captured on another worker, when the caller's [`GraphShape`] differs from the captured
//! one, when a `RunArgs` buffer is another buffer (or another size) or a `RunArgs` scalar another
//! value, when the ring sizes or the run's core count (`CallConfig::cores`) differ, or when
//! `dep_gen` asks for a dependency graph the capture did not record. A capture is refused (the run fails) when the orchestration exchanges data
//! with the host mid-run (`get_tensor_data` / `set_tensor_data`): what it read could shape the
//! graph, and what it wrote would be missing from a replay.
//!
//! # Why a replay is as safe as the run it copies
//! The orchestrator's guarantees come from three things, each preserved:
//! - *Ordering.* Kernels get non-aliasing memory because every task waits for the producers
//!   the TensorMap (or an explicit edge, or an unsafe contract) gave it. A replay wires exactly
//!   the recorded producers, into the same slots' fan-in counters and fan-out lists through the
//!   same `wire` (the protocol of `slot.rs`); the edge set is the captured run's, which was
//!   complete for the same tasks on the same buffers at the same views.
//! - *Liveness of outputs.* An argument viewing an output is accepted only while its creator's
//!   scope is open (`check_tensor_usable`), and the creator edge takes a reference on it. The
//!   replay opens and closes scopes at the same points of the submission sequence, so at each
//!   replayed submit the same scope references are held as in the captured run, and the
//!   creator edge is wired again: a relocated output is never reclaimed under its reader.
//! - *Progress.* A replay waits for ring room with the same `wait_for_room` (its deadlock
//!   proofs and backstop included), for the same slots and pool entries per task and the same
//!   heap block sizes; the scope references are dropped at the same points, so every wait is
//!   one the captured run could also have met, and it ends by the completion of tasks already
//!   submitted.
//!
//! The recorded buffers are compared by identity ([`BufferId`]) and size before a replay, and
//! the graph holds a handle on each, so an address recorded in a view is always live memory of
//! that buffer.

use std::collections::HashMap;
use std::panic::Location;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::buffer::Buffer;
use crate::config::{RING_COUNT, RingSizes};
use crate::error::{ErrorCode, RunError};
use crate::exec::RunArgs;
use crate::kernel::{KernelId, KernelSpec, Predicate, TensorArg};
use crate::task::{ArgTag, EngineClass, ScopeKind, TaskId};
use crate::tensor::{BufferId, Tensor};
use crate::trace::{DepGraph, EdgeSource, OverlapKind};

/// What shaped a captured graph, as its caller states it: named values (batch size, block-table
/// width, chunk counts, ...). A replay is refused unless the caller's shape equals the captured
/// one field by field, and the error names the first field that differs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GraphShape {
    fields: Vec<(String, u64)>,
}

impl GraphShape {
    /// An empty shape.
    pub fn new() -> GraphShape {
        GraphShape::default()
    }

    /// The shape with `name = value` appended.
    pub fn with(mut self, name: impl Into<String>, value: u64) -> GraphShape {
        self.push(name, value);
        self
    }

    /// Appends `name = value`.
    pub fn push(&mut self, name: impl Into<String>, value: u64) {
        self.fields.push((name.into(), value));
    }

    /// The fields, in the order they were added.
    pub fn fields(&self) -> &[(String, u64)] {
        &self.fields
    }

    /// The first difference of `now` from this (captured) shape, described.
    pub fn difference(&self, now: &GraphShape) -> Option<String> {
        for (i, (name, was)) in self.fields.iter().enumerate() {
            match now.fields.get(i) {
                Some((n, v)) if n == name && v == was => {}
                Some((n, v)) if n == name => {
                    return Some(format!(
                        "shape field `{name}` is {v}, the graph was captured with {was}"
                    ));
                }
                Some((n, _)) => {
                    return Some(format!(
                        "shape field {i} is `{n}`, the graph was captured with `{name}`"
                    ));
                }
                None => {
                    return Some(format!(
                        "shape field `{name}` (captured as {was}) is missing"
                    ));
                }
            }
        }
        now.fields
            .get(self.fields.len())
            .map(|(n, v)| format!("shape field `{n}` = {v} was not part of the captured shape"))
    }
}

/// How a run's graph came about (in [`RunReport::graph`](crate::RunReport::graph)).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GraphMode {
    /// The orchestration function submitted it.
    #[default]
    Orchestrated,
    /// The orchestration function submitted it and the run recorded it (topology fingerprint).
    Captured {
        /// Topology fingerprint, 16 hex digits.
        fingerprint: String,
    },
    /// Replayed from a captured graph: no orchestration function, no dependency map; the
    /// report's `orch` span is the replay's submission loop.
    Replayed {
        /// Topology fingerprint of the replayed graph, 16 hex digits.
        fingerprint: String,
    },
}

/// Where a tensor argument of a captured task lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgSource {
    /// A user buffer: index into [`CapturedGraph::buffers`]. The view's offset, shape and
    /// strides are in elements of that buffer.
    Buffer(usize),
    /// Output `output` of task `task` (an index into [`CapturedGraph::tasks`], always a task
    /// before this one or this task itself for its own `Output` arguments). The view's offset,
    /// shape and strides are in elements of that output, which starts at
    /// [`GraphOutput::offset`] in its task's block.
    Output {
        /// The creating task.
        task: usize,
        /// Which of its outputs.
        output: usize,
    },
}

/// One tensor argument of a captured task.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct GraphArg {
    /// Direction tag.
    pub tag: ArgTag,
    /// Where the viewed memory lives.
    pub source: ArgSource,
    /// The view (dtype, element offset, shape, strides). Its buffer id and address are those of
    /// the captured run; a replay relocates views of outputs.
    pub view: Tensor,
}

/// An output a task allocates from the ring heap (contiguous, row-major).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphOutput {
    /// Byte offset in the task's heap block.
    pub offset: u64,
    /// Bytes.
    pub bytes: u64,
}

/// An edge into a captured task: it waits for (or, `wait == false`, only keeps alive) an
/// earlier task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphDep {
    /// The producer: an index into [`CapturedGraph::tasks`], always smaller than the consumer's.
    pub task: usize,
    /// True for an ordering edge; false for a keep-alive only (a `NoDep` argument viewing the
    /// producer's output must keep its memory alive without waiting for it).
    pub wait: bool,
    /// What created the edge.
    pub source: EdgeSource,
    /// How the regions overlapped, for TensorMap edges.
    pub overlap: OverlapKind,
}

/// One task of a captured graph.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct GraphTask {
    /// The kernel (`None`: a dummy task or a tensor allocation, which runs nothing).
    pub kernel: Option<KernelId>,
    /// The kernel's registered name (`<dummy>` / `<alloc>` without one).
    pub kernel_name: String,
    /// Engine class.
    pub class: EngineClass,
    /// SPMD blocks.
    pub blocks: u32,
    /// Whether the blocks start together (a gang).
    pub sync_start: bool,
    /// Tensor arguments, in the order the kernel indexes them.
    pub args: Vec<GraphArg>,
    /// Scalars, as the kernel reads them (replayed unchanged).
    pub scalars: Vec<u64>,
    /// Dispatch predicate.
    pub predicate: Option<Predicate>,
    /// Timing slot.
    pub timing_slot: Option<u8>,
    /// Ring set the task lives in (its scope depth, capped at the last ring).
    pub ring: u8,
    /// Bytes of the task's heap block (every output padded to the output alignment).
    pub block_bytes: u64,
    /// Its outputs, in the order of its `Output` arguments.
    pub outputs: Vec<GraphOutput>,
    /// The producers it waits for or keeps alive, each once.
    pub deps: Vec<GraphDep>,
}

/// A step of the captured submission sequence.
#[derive(Clone, Copy, Debug)]
pub(crate) enum GraphOp {
    Open(ScopeKind, &'static Location<'static>),
    Close,
    Submit(usize),
}

pub(crate) struct GraphInner {
    pub(crate) name: String,
    pub(crate) fingerprint: u64,
    pub(crate) shape: GraphShape,
    pub(crate) worker: u64,
    pub(crate) rings: RingSizes,
    /// The run's cores (`CallConfig::cores`, resolved).
    pub(crate) cores: usize,
    /// `RunArgs` buffers, then the buffers bound through `Orchestrator::bind`.
    pub(crate) buffers: Vec<Buffer>,
    pub(crate) run_args: usize,
    pub(crate) scalars: Vec<u64>,
    pub(crate) tasks: Vec<GraphTask>,
    pub(crate) specs: Vec<Option<Arc<KernelSpec>>>,
    pub(crate) ops: Vec<GraphOp>,
    pub(crate) deps: Option<DepGraph>,
}

/// The task graph of one run, captured by [`Worker::capture_fn`](crate::Worker::capture_fn)
/// and replayed by [`Worker::replay`](crate::Worker::replay) (module docs: what is recorded,
/// what a replay checks). Cheap to clone (shared).
///
/// The representation is platform-neutral: [`CapturedGraph::tasks`] in a topological order
/// with kernel ids, arguments resolved to buffers or to earlier tasks' outputs, and edges; a
/// platform that builds its own executable graph (a CUDA graph) from it needs nothing else.
#[derive(Clone)]
pub struct CapturedGraph {
    pub(crate) inner: Arc<GraphInner>,
}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedGraph")
            .field("name", &self.inner.name)
            .field("fingerprint", &self.fingerprint_hex())
            .field("tasks", &self.inner.tasks.len())
            .field("shape", &self.inner.shape)
            .finish()
    }
}

impl CapturedGraph {
    /// Name of the orchestration that was captured (replays report it).
    pub fn name(&self) -> &str {
        &self.inner.name
    }
    /// Topology fingerprint: every task's kernel and block count and every recorded edge (the
    /// value the capture's and its replays' swimlane and dependency files carry; it does not
    /// depend on the captured run's timing, since a capture records every hazard edge).
    pub fn fingerprint(&self) -> u64 {
        self.inner.fingerprint
    }
    /// The fingerprint as 16 hex digits.
    pub fn fingerprint_hex(&self) -> String {
        format!("{:016x}", self.inner.fingerprint)
    }
    /// The caller's shape the graph was captured under.
    pub fn shape(&self) -> &GraphShape {
        &self.inner.shape
    }
    /// The tasks in submission order (a topological order).
    pub fn tasks(&self) -> &[GraphTask] {
        &self.inner.tasks
    }
    /// The user buffers the graph views: the `RunArgs` buffers in order, then those the
    /// orchestration bound itself.
    pub fn buffers(&self) -> &[Buffer] {
        &self.inner.buffers
    }
    /// Edges `(producer, consumer)` that order tasks (keep-alive edges left out).
    pub fn edges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.inner
            .tasks
            .iter()
            .enumerate()
            .flat_map(|(c, t)| t.deps.iter().filter(|d| d.wait).map(move |d| (d.task, c)))
    }

    /// The first way a replay of this graph would differ from running, in its place, the
    /// orchestration whose fresh capture is `fresh` (the same step, on the same worker), if
    /// there is one: the buffers the graphs hold, the `RunArgs` scalars, the ring sizes, the
    /// scope structure, and every task's kernel, class, blocks, scalars, predicate, timing
    /// slot, ring, outputs, arguments (source, direction and view) and edges. Where there is
    /// none, a replay submits exactly what that orchestration submitted.
    ///
    /// A replay is accepted on the caller's word that equal [`GraphShape`]s make equal graphs
    /// (nothing else is known without running the orchestration); this is how that word is
    /// checked: [`GraphCache::set_verify`](crate::GraphCache::set_verify) orchestrates and
    /// captures every step a replay would have taken and compares the two.
    pub fn replay_difference(&self, fresh: &CapturedGraph) -> Option<String> {
        let (a, b) = (&*self.inner, &*fresh.inner);
        if a.name != b.name {
            return Some(format!(
                "orchestration {:?}, the fresh capture ran {:?}",
                a.name, b.name
            ));
        }
        if (a.buffers.len(), a.run_args) != (b.buffers.len(), b.run_args) {
            return Some(format!(
                "{} buffers ({} RunArgs), the fresh capture {} ({})",
                a.buffers.len(),
                a.run_args,
                b.buffers.len(),
                b.run_args
            ));
        }
        for (i, (x, y)) in a.buffers.iter().zip(&b.buffers).enumerate() {
            if (x.id(), x.len()) != (y.id(), y.len()) {
                return Some(format!(
                    "buffer {i} is #{} ({} bytes), the fresh capture's #{} ({} bytes)",
                    x.id().0,
                    x.len(),
                    y.id().0,
                    y.len()
                ));
            }
        }
        if a.scalars != b.scalars {
            return Some(format!(
                "RunArgs scalars {:?}, the fresh capture's {:?}",
                a.scalars, b.scalars
            ));
        }
        if a.rings != b.rings {
            return Some("the ring sizes differ".into());
        }
        if a.cores != b.cores {
            return Some(format!(
                "captured on {} cores, the fresh capture on {}",
                a.cores, b.cores
            ));
        }
        if a.tasks.len() != b.tasks.len() {
            return Some(format!(
                "{} tasks, the fresh capture {}",
                a.tasks.len(),
                b.tasks.len()
            ));
        }
        for (i, (x, y)) in a.tasks.iter().zip(&b.tasks).enumerate() {
            if let Some(d) = task_difference(x, y) {
                return Some(format!("task {i} ({}): {d}", x.kernel_name));
            }
        }
        let same_op = |x: &GraphOp, y: &GraphOp| match (x, y) {
            (GraphOp::Open(k, s), GraphOp::Open(l, t)) => k == l && s == t,
            (GraphOp::Close, GraphOp::Close) => true,
            (GraphOp::Submit(i), GraphOp::Submit(j)) => i == j,
            _ => false,
        };
        if a.ops.len() != b.ops.len() || !a.ops.iter().zip(&b.ops).all(|(x, y)| same_op(x, y)) {
            let i = a
                .ops
                .iter()
                .zip(&b.ops)
                .position(|(x, y)| !same_op(x, y))
                .unwrap_or(a.ops.len().min(b.ops.len()));
            let op = |o: Option<&GraphOp>| match o {
                Some(GraphOp::Open(k, site)) => {
                    format!("opens a scope ({k:?}) at {}:{}", site.file(), site.line())
                }
                Some(GraphOp::Close) => "closes a scope".into(),
                Some(GraphOp::Submit(t)) => format!("submits task {t}"),
                None => "ends".into(),
            };
            return Some(format!(
                "at submission step {i} the graph {}, the fresh capture {}",
                op(a.ops.get(i)),
                op(b.ops.get(i))
            ));
        }
        None
    }

    /// Why a replay with these arguments would be refused, if it would.
    pub(crate) fn check_replay(
        &self,
        worker: u64,
        args: &RunArgs,
        rings: &RingSizes,
        cores: usize,
        dep_gen: bool,
        shape: &GraphShape,
    ) -> Result<(), RunError> {
        let g = &self.inner;
        let refuse = |what: String| {
            RunError::new(
                ErrorCode::InvalidArgs,
                format!(
                    "replay of {:?} (fingerprint {}) refused: {what}",
                    g.name,
                    self.fingerprint_hex()
                ),
                "capture the graph again for these arguments (Worker::capture_fn)",
            )
        };
        if g.worker != worker {
            return Err(refuse(format!(
                "the graph was captured on worker #{}, this is worker #{worker}",
                g.worker
            )));
        }
        if let Some(d) = g.shape.difference(shape) {
            return Err(refuse(d));
        }
        if args.buffers.len() != g.run_args {
            return Err(refuse(format!(
                "{} RunArgs buffers, the graph was captured with {}",
                args.buffers.len(),
                g.run_args
            )));
        }
        for (i, (now, was)) in args.buffers.iter().zip(&g.buffers).enumerate() {
            if now.id() != was.id() || now.len() != was.len() {
                return Err(refuse(format!(
                    "RunArgs buffer {i} is buffer #{} ({} bytes), the graph was captured with buffer #{} ({} bytes)",
                    now.id().0,
                    now.len(),
                    was.id().0,
                    was.len()
                )));
            }
        }
        if args.scalars != g.scalars {
            let i = args
                .scalars
                .iter()
                .zip(&g.scalars)
                .position(|(a, b)| a != b)
                .unwrap_or(args.scalars.len().min(g.scalars.len()));
            return Err(refuse(format!(
                "RunArgs scalar {i} is {:?}, the graph was captured with {:?}",
                args.scalars.get(i),
                g.scalars.get(i)
            )));
        }
        for r in 0..RING_COUNT {
            let fields: [(&str, u64, u64); 3] = [
                (
                    "ring_task_window",
                    rings.window[r] as u64,
                    g.rings.window[r] as u64,
                ),
                ("ring_heap", rings.heap[r], g.rings.heap[r]),
                (
                    "ring_dep_pool",
                    rings.dep_pool[r] as u64,
                    g.rings.dep_pool[r] as u64,
                ),
            ];
            for (name, now, was) in fields {
                if now != was {
                    return Err(refuse(format!(
                        "CallConfig.runtime_env.{name} of ring {r} is {now}, the graph was captured with {was}"
                    )));
                }
            }
        }
        if cores != g.cores {
            return Err(refuse(format!(
                "the run takes {cores} cores (CallConfig.cores), the graph was captured on {}",
                g.cores
            )));
        }
        if dep_gen && g.deps.is_none() {
            return Err(refuse(
                "CallConfig.dep_gen is on but the capture did not record the dependency graph (capture with dep_gen on)".into(),
            ));
        }
        Ok(())
    }
}

/// What a capturing orchestrator records as it goes.
#[derive(Default)]
pub(crate) struct Capture {
    pub(crate) tasks: Vec<GraphTask>,
    pub(crate) specs: Vec<Option<Arc<KernelSpec>>>,
    pub(crate) ops: Vec<GraphOp>,
    /// `RunArgs` buffers, then buffers bound during the run.
    pub(crate) buffers: Vec<Buffer>,
    buffer_index: HashMap<BufferId, usize>,
    task_index: HashMap<TaskId, usize>,
    /// Per task, the buffer id of each of its outputs (to resolve views of them).
    output_ids: Vec<Vec<BufferId>>,
    /// The first thing that made the run impossible to replay.
    pub(crate) refused: Option<String>,
}

/// A submitted task as the orchestrator hands it to the capture.
pub(crate) struct SubmittedTask<'a> {
    pub(crate) id: TaskId,
    pub(crate) kernel: &'a Option<Arc<KernelSpec>>,
    pub(crate) kname: &'a str,
    pub(crate) class: EngineClass,
    pub(crate) blocks: u32,
    pub(crate) sync_start: bool,
    pub(crate) args: &'a [TensorArg],
    pub(crate) scalars: &'a [u64],
    pub(crate) predicate: Option<Predicate>,
    pub(crate) timing_slot: Option<u8>,
    pub(crate) ring: u8,
    pub(crate) block_bytes: u64,
    pub(crate) out_offsets: &'a [u64],
    pub(crate) producers: &'a [crate::orch::Producer],
}

impl Capture {
    pub(crate) fn new(run_args: &[Buffer]) -> Capture {
        let mut c = Capture::default();
        // Positions of `RunArgs` buffers are what a replay compares, duplicates included; a
        // view resolves to the first position of its buffer.
        for (i, b) in run_args.iter().enumerate() {
            c.buffer_index.entry(b.id()).or_insert(i);
        }
        c.buffers = run_args.to_vec();
        c
    }

    /// Records a buffer the run binds (once per buffer).
    pub(crate) fn add_buffer(&mut self, b: &Buffer) {
        if !self.buffer_index.contains_key(&b.id()) {
            self.buffer_index.insert(b.id(), self.buffers.len());
            self.buffers.push(b.clone());
        }
    }

    pub(crate) fn refuse(&mut self, why: String) {
        self.refused.get_or_insert(why);
    }

    /// Records a submitted task (called before the task is published).
    pub(crate) fn record(&mut self, t: SubmittedTask<'_>) {
        let me = self.tasks.len();
        let mut out_ids = Vec::new();
        let mut args = Vec::with_capacity(t.args.len());
        for (i, a) in t.args.iter().enumerate() {
            let source = if a.tag == ArgTag::Output {
                out_ids.push(a.tensor.buffer);
                ArgSource::Output {
                    task: me,
                    output: out_ids.len() - 1,
                }
            } else if let Some(owner) = a.tensor.owner {
                let found = self.task_index.get(&owner).and_then(|&p| {
                    self.output_ids[p]
                        .iter()
                        .position(|&b| b == a.tensor.buffer)
                        .map(|o| ArgSource::Output { task: p, output: o })
                });
                match found {
                    Some(s) => s,
                    None => {
                        self.refuse(format!(
                            "kernel {:?}: argument {i} views an output the capture did not record",
                            t.kname
                        ));
                        return;
                    }
                }
            } else {
                match self.buffer_index.get(&a.tensor.buffer) {
                    Some(&b) => ArgSource::Buffer(b),
                    None => {
                        self.refuse(format!(
                            "kernel {:?}: argument {i} views buffer #{} which the capture did not record",
                            t.kname, a.tensor.buffer.0
                        ));
                        return;
                    }
                }
            };
            args.push(GraphArg {
                tag: a.tag,
                source,
                view: a.tensor,
            });
        }
        let outputs = t
            .out_offsets
            .iter()
            .zip(t.args.iter().filter(|a| a.tag == ArgTag::Output))
            .map(|(&offset, a)| GraphOutput {
                offset,
                bytes: a.tensor.nbytes(),
            })
            .collect();
        let mut deps = Vec::with_capacity(t.producers.len());
        for p in t.producers {
            match self.task_index.get(&p.task) {
                Some(&task) => deps.push(GraphDep {
                    task,
                    wait: p.wait,
                    source: p.source,
                    overlap: p.overlap,
                }),
                None => {
                    self.refuse(format!(
                        "kernel {:?}: a producer ({}) the capture did not record",
                        t.kname, p.task
                    ));
                    return;
                }
            }
        }
        self.task_index.insert(t.id, me);
        self.output_ids.push(out_ids);
        self.specs.push(t.kernel.clone());
        self.ops.push(GraphOp::Submit(me));
        self.tasks.push(GraphTask {
            kernel: t.kernel.as_ref().map(|k| k.id),
            kernel_name: t.kname.to_string(),
            class: t.class,
            blocks: t.blocks,
            sync_start: t.sync_start,
            args,
            scalars: t.scalars.to_vec(),
            predicate: t.predicate,
            timing_slot: t.timing_slot,
            ring: t.ring,
            block_bytes: t.block_bytes,
            outputs,
            deps,
        });
    }
}

/// What a finished capture needs besides the recording.
pub(crate) struct CaptureEnd {
    pub(crate) name: String,
    pub(crate) fingerprint: u64,
    pub(crate) shape: GraphShape,
    pub(crate) worker: u64,
    pub(crate) rings: RingSizes,
    pub(crate) cores: usize,
    pub(crate) run_args: usize,
    pub(crate) scalars: Vec<u64>,
    pub(crate) deps: Option<DepGraph>,
}

impl Capture {
    /// The captured graph, or why the run cannot be replayed.
    pub(crate) fn finish(self, end: CaptureEnd) -> Result<CapturedGraph, String> {
        if let Some(why) = self.refused {
            return Err(why);
        }
        Ok(CapturedGraph {
            inner: Arc::new(GraphInner {
                name: end.name,
                fingerprint: end.fingerprint,
                shape: end.shape,
                worker: end.worker,
                rings: end.rings,
                cores: end.cores,
                buffers: self.buffers,
                run_args: end.run_args,
                scalars: end.scalars,
                tasks: self.tasks,
                specs: self.specs,
                ops: self.ops,
                deps: end.deps,
            }),
        })
    }
}

/// The first difference of two captured tasks in what a replay submits, described.
fn task_difference(x: &GraphTask, y: &GraphTask) -> Option<String> {
    let was = |what: &str, a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| {
        Some(format!("{what} {a:?}, the fresh capture's {b:?}"))
    };
    if x.kernel != y.kernel || x.kernel_name != y.kernel_name {
        return was("kernel", &x.kernel_name, &y.kernel_name);
    }
    if x.class != y.class {
        return was("engine class", &x.class, &y.class);
    }
    if (x.blocks, x.sync_start) != (y.blocks, y.sync_start) {
        return was(
            "blocks (sync start)",
            &(x.blocks, x.sync_start),
            &(y.blocks, y.sync_start),
        );
    }
    if x.scalars != y.scalars {
        return was("scalars", &x.scalars, &y.scalars);
    }
    let same_predicate = match (x.predicate, y.predicate) {
        (None, None) => true,
        (Some(p), Some(q)) => std::ptr::fn_addr_eq(p, q),
        _ => false,
    };
    if !same_predicate {
        return Some("another dispatch predicate".into());
    }
    if x.timing_slot != y.timing_slot {
        return was("timing slot", &x.timing_slot, &y.timing_slot);
    }
    if (x.ring, x.block_bytes) != (y.ring, y.block_bytes) || x.outputs != y.outputs {
        return was(
            "ring, heap block and outputs",
            &(x.ring, x.block_bytes, &x.outputs),
            &(y.ring, y.block_bytes, &y.outputs),
        );
    }
    if x.args.len() != y.args.len() {
        return was("argument count", &x.args.len(), &y.args.len());
    }
    for (j, (p, q)) in x.args.iter().zip(&y.args).enumerate() {
        let view = |a: &GraphArg| {
            let v = a.view;
            (
                a.tag,
                a.source,
                v.dtype(),
                v.offset(),
                v.shape().to_vec(),
                v.strides().to_vec(),
            )
        };
        if view(p) != view(q) {
            return was(
                &format!("argument {j} (direction, source, view)"),
                &view(p),
                &view(q),
            );
        }
    }
    if x.deps != y.deps {
        return was("producers", &x.deps, &y.deps);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_differences_name_the_field() {
        let a = GraphShape::new().with("batch", 4).with("max_blocks", 8);
        assert_eq!(a.difference(&a.clone()), None);
        let b = GraphShape::new().with("batch", 4).with("max_blocks", 9);
        assert_eq!(
            a.difference(&b).unwrap(),
            "shape field `max_blocks` is 9, the graph was captured with 8"
        );
        let c = GraphShape::new().with("batch", 4);
        assert!(
            a.difference(&c)
                .unwrap()
                .contains("`max_blocks` (captured as 8) is missing")
        );
        assert!(
            c.difference(&a)
                .unwrap()
                .contains("was not part of the captured shape")
        );
        let d = GraphShape::new().with("rows", 4).with("max_blocks", 8);
        assert!(a.difference(&d).unwrap().contains("is `rows`"));
    }
}
