//! The orchestrator: the API an orchestration function uses to submit tasks, open scopes,
//! allocate tensors, add explicit dependencies and exchange data with tasks.
//!
//! One orchestrator exists per run and lives on the thread running the orchestration function;
//! it alone owns the ring cursors and the dependency map, so submitting takes no lock except the
//! producers' small fan-out locks while wiring edges.

use std::panic::Location;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::buffer::Buffer;
use crate::clock::now_ns;
use crate::diag::Diagnostics;
use crate::dtype::DType;
use crate::error::{ErrorCode, Locator, RunError};
use crate::kernel::{TaskDesc, TensorArg};
use crate::ring::{OUTPUT_ALIGN, RingCursor};
use crate::run::RunShared;
use crate::slot::{NO_ENTRY, entry_ref, state};
use crate::task::{ArgSpec, ArgTag, EngineClass, ScopeKind, Task, TaskId};
use crate::tensor::{BufferId, MAX_DIMS, Relation, Tensor};
use crate::tensormap::{Hit, IdMap, TensorMap};
use crate::trace::{EdgeSource, OverlapKind};

pub(crate) struct ScopeFrame {
    pub(crate) seq: u64,
    pub(crate) kind: ScopeKind,
    pub(crate) ring: u8,
    pub(crate) first_local: u32,
    /// Tasks submitted directly in this scope instance.
    pub(crate) tasks: u64,
    /// Heap bytes allocated directly in this scope instance.
    pub(crate) heap: u64,
    /// Dependency-pool entries (producer edges) taken directly in this scope instance.
    pub(crate) deps: u64,
    /// Dependency-map entries inserted directly in this scope instance.
    pub(crate) map: u64,
    pub(crate) site: &'static Location<'static>,
}

/// The result of a submit: the task's id and the tensors the runtime allocated for its
/// `Output` arguments (in argument order).
#[derive(Clone, Debug)]
pub struct Submitted {
    /// The task.
    pub id: TaskId,
    /// Runtime-allocated outputs, in the order of the task's `Output` arguments.
    pub outputs: Vec<Tensor>,
}

impl Submitted {
    /// Output `i` (panics if the task has fewer outputs: a programming error in the
    /// orchestration, like indexing past a slice).
    pub fn output(&self, i: usize) -> Tensor {
        self.outputs[i]
    }
}

/// A producer found for a task being submitted.
#[derive(Clone, Copy)]
pub(crate) struct Producer {
    pub(crate) task: TaskId,
    pub(crate) source: EdgeSource,
    pub(crate) overlap: OverlapKind,
    /// False for a keep-alive only: a `NoDep` argument viewing an output must keep that
    /// output's memory alive while the task may read it, without waiting for its creator.
    pub(crate) wait: bool,
}

/// The orchestration function's handle on the run.
pub struct Orchestrator {
    pub(crate) run: Arc<RunShared>,
    pub(crate) cursors: Vec<RingCursor>,
    pub(crate) scopes: Vec<ScopeFrame>,
    next_scope_seq: u64,
    pub(crate) map: TensorMap,
    pub(crate) bound: IdMap<BufferId, Buffer>,
    pub(crate) epoch: u64,
    /// The run's tag in the ids it hands out (`task::run_tag(epoch)`).
    pub(crate) run_tag: u32,
    pub(crate) serial: bool,
    hits: Vec<Hit>,
    pub(crate) producers: Vec<Producer>,
    pub(crate) diag: Diagnostics,
    pub(crate) ring_waits: u64,
    /// Parks the orchestrator while it waits; `RunShared::orch_unparker` wakes it.
    pub(crate) parker: crossbeam_utils::sync::Parker,
    /// Submits so far (for [`YIELD_CHECK`]).
    submits: u32,
    /// When the orchestrator last looked whether to yield its CPU (ns since the process
    /// anchor; see [`Orchestrator::maybe_yield`]).
    last_yield_check: u64,
    /// [`Sleep::woken`](crate::sleep::Sleep::woken) at the last yield (at creation: before the
    /// run's start wakes its parked cores, so that wake-up is one to yield for).
    woken_at_yield: u64,
    /// The recording of a capturing run (`Worker::capture_fn`).
    pub(crate) capture: Option<Box<crate::graph::Capture>>,
}

/// The orchestrator yields its CPU once this much time has passed since its last yield
/// (checked every [`YIELD_CHECK`] submits). It shares the CPUs with the core threads (one per
/// CPU by default), and a core woken onto the orchestrator's CPU otherwise waits for the
/// orchestrator's whole time slice. Bounding the rate by time, not by submits, keeps the system
/// calls off a fast orchestrator's path. Measurements: `docs/benchmarks.md`.
const YIELD_INTERVAL_NS: u64 = 50_000;
/// Submits between two looks at the clock for [`YIELD_INTERVAL_NS`].
const YIELD_CHECK: u32 = 8;

pub(crate) fn invalid(detail: String, hint: &str) -> RunError {
    RunError::new(ErrorCode::InvalidArgs, detail, hint)
}

impl Orchestrator {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        run: Arc<RunShared>,
        cursors: Vec<RingCursor>,
        map: TensorMap,
        epoch: u64,
        serial: bool,
        diag: Diagnostics,
        parker: crossbeam_utils::sync::Parker,
    ) -> Orchestrator {
        let first_local = cursors[0].next_local;
        Orchestrator {
            submits: 0,
            last_yield_check: 0,
            woken_at_yield: run.wake.sleep.woken(),
            run,
            cursors,
            scopes: vec![ScopeFrame {
                seq: 0,
                kind: ScopeKind::Auto,
                ring: 0,
                first_local,
                tasks: 0,
                heap: 0,
                deps: 0,
                map: 0,
                site: Location::caller(),
            }],
            next_scope_seq: 1,
            map,
            bound: IdMap::default(),
            epoch,
            run_tag: crate::task::run_tag(epoch),
            serial,
            hits: Vec::new(),
            producers: Vec::new(),
            diag,
            ring_waits: 0,
            parker,
            capture: None,
        }
    }

    pub(crate) fn into_state(self) -> (Vec<RingCursor>, TensorMap) {
        (self.cursors, self.map)
    }

    /// Cores of this run that can run tasks of `class` (the run takes `CallConfig::cores` of
    /// the worker's).
    pub fn cores(&self, class: EngineClass) -> usize {
        self.run.class_cores[class.index()] as usize
    }

    /// All cores of this run (`CallConfig::cores` of the worker's, by default all).
    pub fn total_cores(&self) -> usize {
        self.run.cores.len()
    }

    /// Current scope depth (0 = the implicit outer scope).
    pub fn scope_depth(&self) -> usize {
        self.scopes.len() - 1
    }

    pub(crate) fn check_fatal(&self) -> Result<(), RunError> {
        match self.run.fatal.get() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Reports a fatal error from the orchestration (EXPLICIT_ORCH_FATAL): every core stops and
    /// the run returns this error. Returns it so the orchestration can `return Err(...)`.
    pub fn fatal(&self, detail: impl Into<String>) -> RunError {
        let e = RunError::new(
            ErrorCode::ExplicitOrchFatal,
            detail,
            "the orchestration function reported this; fix the inputs it complains about",
        );
        self.run.fail(e.clone());
        self.run.fatal.get().cloned().unwrap_or(e)
    }

    /// Latches `e` (unless an error is latched already) and returns the run's error.
    pub(crate) fn fail(&self, e: RunError) -> RunError {
        self.run.fail(e.clone());
        self.run.fatal.get().cloned().unwrap_or(e)
    }

    /// Makes `buffer` usable by this run's tasks and returns a contiguous view of it.
    pub fn bind(
        &mut self,
        buffer: &Buffer,
        dtype: DType,
        shape: &[u64],
    ) -> Result<Tensor, RunError> {
        if !self.bound.contains_key(&buffer.id()) {
            if !buffer.bind() {
                return Err(self.fail(invalid(
                    format!(
                        "buffer #{} is already bound to another run in flight",
                        buffer.id().0
                    ),
                    "wait for the other run to finish before binding the buffer again",
                )));
            }
            self.bound.insert(buffer.id(), buffer.clone());
            self.run.bound.push(buffer.clone());
            if let Some(c) = &mut self.capture {
                c.add_buffer(buffer);
            }
        }
        buffer.tensor(dtype, shape).map_err(|e| {
            self.fail(invalid(
                format!("view of buffer #{}: {e}", buffer.id().0),
                "fix the shape passed to bind",
            ))
        })
    }

    /// Records a buffer the run bound at its start (RunArgs).
    pub(crate) fn adopt_bound(&mut self, b: Buffer) {
        self.bound.insert(b.id(), b);
    }

    /// Opens a scope. Prefer [`Orchestrator::scope`], which cannot be left unbalanced.
    ///
    /// Manual scopes skip dependency tracking and are opened only through the unsafe
    /// [`Orchestrator::begin_manual_scope`]; asking for one here fails with INVALID_ARGS.
    #[track_caller]
    pub fn begin_scope(&mut self, kind: ScopeKind) -> Result<(), RunError> {
        if kind == ScopeKind::Manual {
            return Err(self.fail(invalid(
                "a manual scope was requested through begin_scope/scope".into(),
                "manual scopes skip dependency tracking: open them with the unsafe Orchestrator::begin_manual_scope or manual_scope and uphold their contract",
            )));
        }
        self.open_scope(kind, Location::caller())
    }

    /// Opens a manual scope: tasks submitted in it are ordered only by their explicit
    /// dependencies and creator edges, not by the tensors they touch (they are still recorded,
    /// so tasks of auto scopes submitted later wait for them). Prefer
    /// [`Orchestrator::manual_scope`].
    ///
    /// # Safety
    /// Until the scope is closed, every task submitted in it must be ordered (explicit
    /// dependencies, creator edges) after every task still running or pending that writes bytes
    /// it reads or writes, and after every such task that reads bytes it writes; the same holds
    /// between the scope's own tasks. Otherwise kernels get aliasing slices.
    #[track_caller]
    pub unsafe fn begin_manual_scope(&mut self) -> Result<(), RunError> {
        self.open_scope(ScopeKind::Manual, Location::caller())
    }

    pub(crate) fn open_scope(
        &mut self,
        kind: ScopeKind,
        site: &'static Location<'static>,
    ) -> Result<(), RunError> {
        self.check_fatal()?;
        let outer = self.scopes.last().expect("implicit scope");
        if kind == ScopeKind::Auto && outer.kind == ScopeKind::Manual {
            return Err(self.fail(invalid(
                "an auto scope cannot be opened inside a manual scope".into(),
                "open a manual scope here, or close the manual scope first",
            )));
        }
        let depth = self.scopes.len();
        let ring = depth.min(crate::config::RING_COUNT - 1) as u8;
        let seq = self.next_scope_seq;
        self.next_scope_seq += 1;
        let first_local = self.cursors[ring as usize].next_local;
        if let Some(c) = &mut self.capture {
            c.ops.push(crate::graph::GraphOp::Open(kind, site));
        }
        self.scopes.push(ScopeFrame {
            seq,
            kind,
            ring,
            first_local,
            tasks: 0,
            heap: 0,
            deps: 0,
            map: 0,
            site,
        });
        Ok(())
    }

    /// Closes the innermost scope: its tasks may be reclaimed once they completed and their
    /// consumers released them.
    pub fn end_scope(&mut self) -> Result<(), RunError> {
        if self.scopes.len() <= 1 {
            return Err(self.fail(invalid(
                "end_scope without a matching begin_scope".into(),
                "balance begin_scope/end_scope, or use Orchestrator::scope",
            )));
        }
        self.close_innermost();
        self.check_fatal()
    }

    /// Runs `body` inside a new scope of `kind` (`Auto`; see [`Orchestrator::begin_scope`]).
    #[track_caller]
    pub fn scope<R>(
        &mut self,
        kind: ScopeKind,
        body: impl FnOnce(&mut Orchestrator) -> Result<R, RunError>,
    ) -> Result<R, RunError> {
        self.begin_scope(kind)?;
        self.run_scope_body(body)
    }

    /// Runs `body` inside a new manual scope.
    ///
    /// # Safety
    /// The contract of [`Orchestrator::begin_manual_scope`], for every task `body` submits.
    #[track_caller]
    pub unsafe fn manual_scope<R>(
        &mut self,
        body: impl FnOnce(&mut Orchestrator) -> Result<R, RunError>,
    ) -> Result<R, RunError> {
        self.open_scope(ScopeKind::Manual, Location::caller())?;
        self.run_scope_body(body)
    }

    fn run_scope_body<R>(
        &mut self,
        body: impl FnOnce(&mut Orchestrator) -> Result<R, RunError>,
    ) -> Result<R, RunError> {
        let depth = self.scopes.len();
        let r = body(self);
        // Close whatever the body left open, so an early `?` return never leaks a scope.
        while self.scopes.len() >= depth {
            self.close_innermost();
        }
        r
    }

    /// Drops the scope reference of every task submitted directly in the innermost scope.
    pub(crate) fn close_innermost(&mut self) {
        let frame = self.scopes.pop().expect("scope to close");
        if frame.seq != 0
            && let Some(c) = &mut self.capture
        {
            c.ops.push(crate::graph::GraphOp::Close);
        }
        let cursor = &mut self.cursors[frame.ring as usize];
        let mut local = frame.first_local.max(cursor.reclaimed);
        while local < cursor.next_local {
            let m = cursor.meta_mut(local);
            if m.scope_seq == frame.seq && !m.scope_released {
                m.scope_released = true;
                self.run
                    .release_by_orchestrator(TaskId::in_run(self.run_tag, frame.ring, local));
            }
            local += 1;
        }
        if self.diag.ring_stats {
            self.diag.scope_closed(&frame);
        }
    }

    pub(crate) fn scope_is_open(&self, seq: u64) -> bool {
        self.scopes.iter().any(|s| s.seq == seq)
    }

    /// Allocates a tensor from the ring heap without running a kernel (its contents are
    /// unspecified until a task writes it). It lives until the current scope ends.
    pub fn alloc(&mut self, dtype: DType, shape: &[u64]) -> Result<Tensor, RunError> {
        let s = self.submit(Task::dummy().output(dtype, shape))?;
        Ok(s.output(0))
    }

    /// Submits a task. Dependencies are found from its tensors (in auto scopes) and its
    /// explicit `after` list; outputs are allocated from the ring heap. Blocks while the ring
    /// has no room; fails (and stops the run) on a provable deadlock or invalid arguments.
    // The steps, each a method below: validate the task and size its outputs, collect its
    // producers, wait for ring room (the only blocking point), fill the slot, wire the edges
    // into the producers' fan-out lists, and publish the task.
    pub fn submit(&mut self, mut task: Task) -> Result<Submitted, RunError> {
        let t_submit = if self.run.swimlane >= 4 { now_ns() } else { 0 };
        self.check_fatal()?;
        self.maybe_yield();
        let c = self.validate(&task)?;
        let (n_unique, entries) = self.collect_producers(&task, &c)?;
        let heap_start =
            self.wait_for_room(c.ring, c.block_bytes, n_unique as u64, entries, &c.kname)?;
        let (local, block_addr, dep_start) = self.cursors[c.ring as usize].allocate(
            heap_start,
            c.block_bytes,
            n_unique as u64,
            c.scope_seq,
        );
        let id = TaskId::in_run(self.run_tag, c.ring, local);
        {
            let f = self.scopes.last_mut().expect("scope");
            f.tasks += 1;
            f.heap += c.block_bytes;
            f.deps += n_unique as u64;
            f.map += entries;
        }
        let scope_kind = c.scope_kind;
        let outputs = self.fill(c, &mut task, id, local, block_addr, dep_start, n_unique)?;
        self.wire(id, dep_start, n_unique);
        if self.diag.capturing() || self.diag.fingerprinting() {
            let kernel = self
                .run
                .arena
                .rings
                .slot(id)
                .desc()
                .kernel
                .as_ref()
                .map(|k| k.id.0);
            let edges = self
                .producers
                .iter()
                .filter(|p| p.wait)
                .map(|p| (p.task, p.source, p.overlap));
            self.diag.capture_edges(id, edges, task.block_num, kernel);
        }
        self.publish(id, &task, scope_kind);
        if self.run.swimlane >= 4 {
            self.diag.submit_record(
                id,
                t_submit,
                now_ns(),
                self.run.swimlane_cap_per_core * self.run.cores.len(),
            );
        }
        Ok(Submitted { id, outputs })
    }

    /// Yields the CPU now and then (see [`YIELD_INTERVAL_NS`]), where a parked core was woken
    /// since the last yield (the run's start wakes them): such a core may be waiting for the
    /// orchestrator's CPU. Cores that spin hold their own CPUs, and a yield would hand the CPU
    /// to whatever else the host runs (beside CPU-bound processes each yield cost a time
    /// slice: a million-task run took 2.3 times as long).
    ///
    /// Not counted: the orchestrator's own wake-up from a wait for ring room, which may take
    /// the CPU of a core inside a kernel. Yielding after each such wait as well measured no
    /// different on a quiet host (ring-bound `bench runtime`) and lost most of the gain beside
    /// CPU-bound processes, where a ring-bound run waits for room often: the orchestrator soon
    /// parks again, which gives the core its CPU back (`docs/benchmarks.md`, session 62).
    pub(crate) fn maybe_yield(&mut self) {
        self.submits = self.submits.wrapping_add(1);
        if self.submits.is_multiple_of(YIELD_CHECK) {
            let now = now_ns();
            if now.saturating_sub(self.last_yield_check) >= YIELD_INTERVAL_NS {
                let woken = self.run.wake.sleep.woken();
                if woken != self.woken_at_yield {
                    std::thread::yield_now();
                    self.woken_at_yield = woken;
                }
                self.last_yield_check = now_ns();
            }
        }
    }

    /// Step 1: the kernel, the task's shape and its arguments' geometry, and the sizes of its
    /// outputs in one heap block (every size checked).
    fn validate(&self, task: &Task) -> Result<Checked, RunError> {
        let (scope_seq, scope_kind, ring) = {
            let f = self.scopes.last().expect("implicit scope");
            (f.seq, f.kind, f.ring)
        };
        let kernel = match task.kernel {
            Some(k) => match self.run.registry.get(k) {
                Some(spec) => Some(spec.clone()),
                None => {
                    return Err(self.fail(invalid(
                        format!("kernel id {} is not registered", k.0),
                        "register it with Worker::register_kernel before running",
                    )));
                }
            },
            None => None,
        };
        let class = kernel.as_ref().map_or(EngineClass::Vector, |k| k.class);
        let kname = match &kernel {
            Some(k) => k.name.clone(),
            None if task.args.iter().any(|a| matches!(a, ArgSpec::Output(_))) => {
                "<alloc>".to_string()
            }
            None => "<dummy>".to_string(),
        };
        self.validate_shape_of_task(task, &kname, class)?;

        // Outputs: sizes and the packed heap block.
        let mut block_bytes = 0u64;
        let mut out_offsets = Vec::new();
        for a in &task.args {
            if let ArgSpec::Output(o) = a {
                if o.shape.is_empty() || o.shape.len() > MAX_DIMS {
                    return Err(self.fail(invalid(
                        format!("kernel {kname:?}: an output has {} dimensions (1..={MAX_DIMS} allowed)", o.shape.len()),
                        "fix the output shape",
                    )));
                }
                // Sizes come from the caller: every step is checked, so a huge shape is an
                // error here rather than a wrapped size that later becomes a huge slice.
                let padded = o
                    .shape
                    .iter()
                    .try_fold(o.dtype.size() as u64, |acc, &d| acc.checked_mul(d))
                    .and_then(|bytes| bytes.checked_next_multiple_of(OUTPUT_ALIGN))
                    .and_then(|padded| block_bytes.checked_add(padded));
                let Some(next) = padded else {
                    return Err(self.fail(invalid(
                        format!(
                            "kernel {kname:?}: output shape {:?} of {} (with the outputs before it) does not fit in 64-bit byte sizes",
                            o.shape, o.dtype
                        ),
                        "fix the output shape",
                    )));
                };
                out_offsets.push(block_bytes);
                block_bytes = next;
            }
        }
        let heap_cap = self.cursors[ring as usize].heap_cap;
        if block_bytes > heap_cap {
            let suggested = block_bytes
                .checked_next_power_of_two()
                .unwrap_or(u64::MAX)
                .max(1024);
            let used = self.cursors[ring as usize].heap_used();
            // The head is named in the text only (see `wait_for_room`'s pool check).
            let (_, head_note) = self.head_of(ring);
            return Err(self.fail(
                RunError::new(
                    ErrorCode::HeapRingDeadlock,
                    format!(
                        "kernel {kname:?} needs a {block_bytes}-byte output block but ring {ring}'s heap holds {heap_cap} bytes ({used} in use; {head_note})"
                    ),
                    format!(
                        "raise ring_heap to at least {} for this run: CallConfig.runtime_env.ring_heap",
                        crate::diag::human_bytes(suggested)
                    ),
                )
                .diagnosed(crate::error::Diagnosis::Proven)
                .at(Locator { ring: Some(ring), kernel: Some(kname), ..Locator::default() }),
            ));
        }
        Ok(Checked {
            kernel,
            class,
            kname,
            scope_seq,
            scope_kind,
            ring,
            out_offsets,
            block_bytes,
        })
    }

    /// Step 2: each existing tensor's usability, then the producers the task waits for
    /// (creator edges, the TensorMap's live writers — and for a written argument its live
    /// readers — of overlapping bytes, explicit dependencies), deduplicated into
    /// `self.producers[..n]`. Returns `n` and the dependency-map entries the task will add.
    fn collect_producers(&mut self, task: &Task, c: &Checked) -> Result<(usize, u64), RunError> {
        let (kname, scope_kind) = (c.kname.as_str(), c.scope_kind);
        self.producers.clear();
        let mut entries = 0u64;
        for (i, a) in task.args.iter().enumerate() {
            let ArgSpec::Tensor(tag, t) = a else { continue };
            self.check_tensor_usable(i, *tag, t, kname)?;
            if matches!(tag, ArgTag::Input | ArgTag::InOut | ArgTag::OutputExisting) {
                entries += 1;
            }
            if let Some(owner) = t.owner {
                self.producers.push(Producer {
                    task: owner,
                    source: EdgeSource::Creator,
                    overlap: OverlapKind::None,
                    wait: *tag != ArgTag::NoDep,
                });
            }
            if *tag == ArgTag::NoDep {
                continue;
            }
            // Readers wait for the live writers of their region; writers also for its live
            // readers (write-after-read and write-after-write are ordered too).
            if scope_kind == ScopeKind::Auto {
                self.hits.clear();
                let region = t.region();
                let written = tag.is_written();
                self.map
                    .lookup(&region, written, &self.run.arena.rings, &mut self.hits);
                for h in &self.hits {
                    let overlap = match h.relation {
                        Relation::Covers => OverlapKind::Covers,
                        Relation::Partial => OverlapKind::Partial,
                        _ => OverlapKind::Conservative,
                    };
                    self.producers.push(Producer {
                        task: h.task,
                        source: EdgeSource::Tensormap,
                        overlap,
                        wait: true,
                    });
                }
            }
        }
        for &d in &task.deps {
            self.validate_explicit_dep(d, kname)?;
            self.producers.push(Producer {
                task: d,
                source: EdgeSource::Explicit,
                overlap: OverlapKind::None,
                wait: true,
            });
        }
        Ok((dedup_count(&mut self.producers), entries))
    }

    /// Step 4, once the room is allocated: the arguments as the kernel sees them (outputs
    /// placed in the heap block at `block_addr`) and the slot's contents. Nobody else looks at
    /// the slot until it is published. Returns the outputs.
    #[allow(clippy::too_many_arguments)]
    fn fill(
        &mut self,
        c: Checked,
        task: &mut Task,
        id: TaskId,
        local: u32,
        block_addr: usize,
        dep_start: u64,
        n_unique: usize,
    ) -> Result<Vec<Tensor>, RunError> {
        let Checked {
            kernel,
            class,
            kname,
            scope_kind,
            out_offsets,
            block_bytes,
            ..
        } = c;
        // Arguments as the kernel sees them.
        let mut args = Vec::with_capacity(task.args.len());
        let mut outputs = Vec::new();
        for a in &task.args {
            match a {
                ArgSpec::Tensor(tag, t) => args.push(TensorArg {
                    tag: *tag,
                    tensor: *t,
                }),
                ArgSpec::Output(o) => {
                    let off = out_offsets[outputs.len()];
                    // Cannot overflow: the padded sizes summed without overflow above.
                    let bytes = o.shape.iter().product::<u64>() * o.dtype.size() as u64;
                    let bid = BufferId::fresh();
                    let mut t = Tensor::new_contiguous(
                        bid,
                        block_addr + off as usize,
                        bytes,
                        o.dtype,
                        &o.shape,
                    )
                    .map_err(|e| {
                        self.fail(invalid(
                            format!("output of {kname:?}: {e}"),
                            "fix the output shape",
                        ))
                    })?;
                    t.owner = Some(id);
                    t.run_epoch = self.epoch;
                    outputs.push(t);
                    args.push(TensorArg {
                        tag: ArgTag::Output,
                        tensor: t,
                    });
                }
            }
        }
        if self.diag.capturing() {
            self.diag.capture_task(
                id,
                scope_kind,
                self.scopes.len() - 1,
                &kernel,
                task.block_num,
                &args,
                &self.map,
            );
        }
        if let Some(cap) = &mut self.capture {
            cap.record(crate::graph::SubmittedTask {
                id,
                kernel: &kernel,
                kname: &kname,
                class,
                blocks: task.block_num,
                sync_start: task.sync_start,
                args: &args,
                scalars: &task.scalars,
                predicate: task.predicate,
                timing_slot: task.timing_slot,
                ring: id.ring(),
                block_bytes,
                out_offsets: &out_offsets,
                producers: &self.producers[..n_unique],
            });
        }
        let desc = TaskDesc {
            id,
            epoch: self.epoch,
            kernel,
            class,
            block_num: task.block_num,
            sync_start: task.sync_start,
            args,
            scalars: std::mem::take(&mut task.scalars),
            predicate: task.predicate,
            timing_slot: task.timing_slot,
            splits: crate::kernel::Splits::new(task.block_num, task.args.len()),
        };
        self.fill_slot(local, dep_start, n_unique, desc);
        Ok(outputs)
    }

    /// Writes a task's slot (its counters, an empty fan-out list, its description) before it
    /// is published; nobody else looks at the slot until then.
    pub(crate) fn fill_slot(&self, local: u32, dep_start: u64, n_unique: usize, desc: TaskDesc) {
        let id = desc.id;
        self.fill_slot_with(id, local, dep_start, n_unique, |d| *d = desc);
    }

    /// [`Orchestrator::fill_slot`] with the description written in place by `write` (which
    /// must set every field): the slot's previous description is reused, its argument and
    /// scalar vectors keeping their capacity, whenever no core still holds it (a replayed step
    /// then allocates nothing per task).
    pub(crate) fn fill_slot_with(
        &self,
        id: TaskId,
        local: u32,
        dep_start: u64,
        n_unique: usize,
        write: impl FnOnce(&mut TaskDesc),
    ) {
        let slot = self.run.arena.rings.slot(id);
        slot.task_local.store(local, Ordering::Relaxed);
        slot.state.store(state::PENDING, Ordering::Relaxed);
        slot.fanin.store(1, Ordering::Relaxed);
        slot.refs.store(2, Ordering::Relaxed);
        slot.blocks.reset();
        slot.dep_start.store(dep_start, Ordering::Relaxed);
        slot.dep_count.store(n_unique as u32, Ordering::Relaxed);
        {
            let mut f = slot.fanout();
            f.completed = false;
            f.head = NO_ENTRY;
        }
        {
            let mut d = slot.desc.lock().unwrap_or_else(|p| p.into_inner());
            match Arc::get_mut(&mut d) {
                Some(slot_desc) => write(slot_desc),
                None => {
                    let mut fresh = TaskDesc::empty();
                    write(&mut fresh);
                    *d = Arc::new(fresh);
                }
            }
        }
        self.run.outstanding.fetch_add(1, Ordering::AcqRel);
        self.run.submitted.fetch_add(1, Ordering::Relaxed);
    }

    /// Step 5: links the task's edges into its producers' fan-out lists. The fan-in count is
    /// raised *before* an edge becomes visible in the producer's list (under its lock): the
    /// producer may complete the moment the lock is released, and its decrement must never
    /// meet a count that lacks its own increment.
    pub(crate) fn wire(&self, id: TaskId, dep_start: u64, n_unique: usize) {
        let ring = id.ring();
        let rings = &self.run.arena.rings;
        let slot = rings.slot(id);
        let ring_slots = &rings.rings[ring as usize];
        for (i, p) in self.producers[..n_unique].iter().enumerate() {
            let pos = dep_start + i as u64;
            let entry = ring_slots.entry_at(pos);
            entry.consumer.store(id.0, Ordering::Relaxed);
            let ps = rings.slot(p.task);
            if ps.task_local.load(Ordering::Acquire) == p.task.local() && ps.try_acquire() {
                entry.producer.store(p.task.0, Ordering::Relaxed);
                if p.wait {
                    let mut f = ps.fanout();
                    if !f.completed {
                        slot.fanin.fetch_add(1, Ordering::AcqRel);
                        entry.next.store(f.head, Ordering::Relaxed);
                        f.head = entry_ref(ring, (pos % ring_slots.entries.len() as u64) as u32);
                    }
                }
            } else {
                entry.producer.store(u64::MAX, Ordering::Relaxed);
            }
        }
        self.run.edges.fetch_add(n_unique as u64, Ordering::Relaxed);
    }

    /// Step 6: the dependency map learns the task's accesses, and the submit guard drops: the
    /// task is ready now if every producer has completed.
    fn publish(&mut self, id: TaskId, task: &Task, scope_kind: ScopeKind) {
        // The dependency map learns the new readers and writers. A writer retires the entries
        // its region covers only if it waited for them (an auto scope).
        for a in &task.args {
            match a {
                ArgSpec::Tensor(ArgTag::Input, t) => self.map.record_reader(id, t.region()),
                ArgSpec::Tensor(ArgTag::InOut | ArgTag::OutputExisting, t) => self
                    .map
                    .record_writer(id, t.region(), scope_kind == ScopeKind::Auto),
                _ => {}
            }
        }
        self.make_ready(id);
    }

    /// Drops the submit guard: the task is ready now if every producer has completed.
    pub(crate) fn make_ready(&self, id: TaskId) {
        let slot = self.run.arena.rings.slot(id);
        if slot.fanin.fetch_sub(1, Ordering::AcqRel) == 1 {
            let mut work = Vec::new();
            self.run.on_ready(id, None, None, &mut work);
            if let Some(&t) = work.first() {
                work.clear();
                let mut next = None;
                self.run.complete(t, None, &mut next, &mut work);
                if let Some(n) = next {
                    self.run.queue(self.run.slot(n).desc().class).push(n);
                    self.run.wake.sleep.notify_one();
                }
            }
        }
    }
}

/// What validating a task found: its kernel, scope and ring, and its output block.
struct Checked {
    kernel: Option<Arc<crate::kernel::KernelSpec>>,
    class: EngineClass,
    kname: String,
    scope_seq: u64,
    scope_kind: ScopeKind,
    ring: u8,
    /// Offset of each output in the task's heap block.
    out_offsets: Vec<u64>,
    /// Size of the block (every output padded to `OUTPUT_ALIGN`).
    block_bytes: u64,
}

/// Sorts producers so that each task appears once in the prefix `..n` (first occurrence kept in
/// place, preserving order); duplicates (for dependency capture) follow. Returns `n`.
fn dedup_count(p: &mut [Producer]) -> usize {
    let mut n = 0;
    for i in 0..p.len() {
        match p[..n].iter().position(|q| q.task == p[i].task) {
            // Waiting wins over a keep-alive for the same task.
            Some(k) => p[k].wait |= p[i].wait,
            None => {
                p.swap(n, i);
                n += 1;
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedup_keeps_each_task_once_in_the_prefix() {
        let mk = |t: u64, s| Producer {
            wait: true,
            task: TaskId(t),
            source: s,
            overlap: OverlapKind::None,
        };
        let mut v = vec![
            mk(1, EdgeSource::Creator),
            mk(2, EdgeSource::Tensormap),
            mk(1, EdgeSource::Tensormap),
            mk(3, EdgeSource::Explicit),
            mk(2, EdgeSource::Explicit),
        ];
        let n = dedup_count(&mut v);
        assert_eq!(n, 3);
        let mut firsts: Vec<u64> = v[..n].iter().map(|p| p.task.0).collect();
        firsts.sort();
        assert_eq!(firsts, vec![1, 2, 3]);
        assert_eq!(v.len(), 5);
    }
}
