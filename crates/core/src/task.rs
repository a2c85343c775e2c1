//! The task model: engine classes, task ids, argument direction tags and the [`Task`] builder an
//! orchestration submits.

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::kernel::{KernelId, Predicate};
use crate::tensor::Tensor;

/// Most tensor arguments a task may have.
pub const MAX_TENSOR_ARGS: usize = 32;
/// Most scalar arguments a task may have.
pub const MAX_SCALAR_ARGS: usize = 16;
/// Number of user task-timing slots.
pub const TIMING_SLOTS: usize = 8;

/// What kind of engine a kernel needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineClass {
    /// Matrix work.
    Cube,
    /// Elementwise and reduction work.
    Vector,
    /// One task using a cube lane and vector lanes together.
    Mix,
}

impl EngineClass {
    /// All classes, in ready-queue priority order (Mix first).
    pub const ALL: [EngineClass; 3] = [EngineClass::Mix, EngineClass::Cube, EngineClass::Vector];

    /// Dense index (Mix 0, Cube 1, Vector 2).
    pub const fn index(self) -> usize {
        match self {
            EngineClass::Mix => 0,
            EngineClass::Cube => 1,
            EngineClass::Vector => 2,
        }
    }

    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            EngineClass::Mix => "mix",
            EngineClass::Cube => "cube",
            EngineClass::Vector => "vector",
        }
    }
}

/// A submitted task: `(run_tag << 40) | (ring << 32) | local_id`.
///
/// The run tag names the run that submitted the task, so an id kept from an earlier run (of
/// this or another worker) is refused instead of naming whichever task the same slot holds
/// now. Tags come from the process-unique run epoch and repeat only after
/// [`TaskId::RUN_TAGS`] runs; tag 0 is never a run's, so an id built with [`TaskId::new`]
/// names a position, not a submitted task. Trace files carry [`TaskId::trace_id`], without
/// the tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TaskId(pub u64);

const RUN_TAG_SHIFT: u32 = 40;

impl TaskId {
    /// How many distinct run tags there are (tags cycle through `1..=RUN_TAGS`).
    pub const RUN_TAGS: u32 = (1 << (64 - RUN_TAG_SHIFT)) - 1;

    /// Builds an id from its ring and the ring-local sequence number, with no run tag (as trace
    /// files spell ids; no submit returns such an id).
    pub const fn new(ring: u8, local: u32) -> TaskId {
        TaskId(((ring as u64) << 32) | local as u64)
    }
    /// The id of task `local` of ring `ring` in the run tagged `run_tag`.
    pub(crate) const fn in_run(run_tag: u32, ring: u8, local: u32) -> TaskId {
        TaskId(((run_tag as u64) << RUN_TAG_SHIFT) | TaskId::new(ring, local).0)
    }
    /// The tag of the run that submitted the task (0: none).
    pub const fn run_tag(self) -> u32 {
        (self.0 >> RUN_TAG_SHIFT) as u32
    }
    /// The id as trace files record it: `(ring << 32) | local_id`, without the run tag (a run's
    /// files describe one run, and stay the same from run to run of one workload).
    pub const fn trace_id(self) -> u64 {
        self.0 & ((1 << RUN_TAG_SHIFT) - 1)
    }
    /// Ring set the task lives in (0..=3).
    pub const fn ring(self) -> u8 {
        (self.0 >> 32) as u8
    }
    /// Sequence number within the ring (per run, from 0).
    pub const fn local(self) -> u32 {
        self.0 as u32
    }
}

/// The run tag of the run with epoch `epoch`: never 0, repeating every [`TaskId::RUN_TAGS`]
/// runs.
pub(crate) const fn run_tag(epoch: u64) -> u32 {
    (epoch % TaskId::RUN_TAGS as u64) as u32 + 1
}

impl std::fmt::Display for TaskId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "task {}:{}", self.ring(), self.local())
    }
}

/// How dependencies are found inside a scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScopeKind {
    /// From the tensors each task touches (the default).
    Auto,
    /// Only from explicit dependencies ([`Task::after`]); creator edges still keep outputs
    /// alive. May nest inside manual scopes; an auto scope inside a manual one is an error.
    /// Opened only through the unsafe [`Orchestrator::manual_scope`](crate::Orchestrator::manual_scope).
    Manual,
}

/// How a task uses a tensor argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArgTag {
    /// Read.
    Input,
    /// Written; the runtime allocates it from the ring heap.
    Output,
    /// Read, then written.
    InOut,
    /// Written into a buffer the user owns.
    OutputExisting,
    /// Passed through; never used for dependencies (read-only for kernels). Requested only
    /// through the unsafe [`Task::no_dep`], whose contract replaces the tracking.
    NoDep,
}

impl ArgTag {
    /// Whether a kernel may write through this argument.
    pub const fn is_written(self) -> bool {
        matches!(
            self,
            ArgTag::Output | ArgTag::InOut | ArgTag::OutputExisting
        )
    }
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            ArgTag::Input => "input",
            ArgTag::Output => "output",
            ArgTag::InOut => "in_out",
            ArgTag::OutputExisting => "output_existing",
            ArgTag::NoDep => "no_dep",
        }
    }
}

/// Shape and element type of an output the runtime allocates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputSpec {
    /// Element type.
    pub dtype: DType,
    /// Shape (row-major, contiguous), at most 5 dimensions.
    pub shape: Vec<u64>,
}

/// One tensor argument as the orchestration gives it.
#[derive(Clone, Debug)]
pub(crate) enum ArgSpec {
    /// An existing tensor with its tag (anything but `Output`).
    Tensor(ArgTag, Tensor),
    /// A runtime-allocated output.
    Output(OutputSpec),
}

/// A task to submit: a kernel (or none, for a dummy), its arguments and scheduling options.
///
/// ```
/// # use simpler_core::{Task, KernelId, DType};
/// # fn f(a: &simpler_core::Tensor, b: &simpler_core::Tensor) {
/// let task = Task::new(KernelId(3))
///     .input(a)
///     .in_out(b)
///     .output(DType::F32, &[16, 128])
///     .scalar_f32(0.5)
///     .blocks(4);
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Task {
    pub(crate) kernel: Option<KernelId>,
    pub(crate) block_num: u32,
    pub(crate) sync_start: bool,
    pub(crate) args: Vec<ArgSpec>,
    pub(crate) scalars: Vec<u64>,
    pub(crate) deps: Vec<TaskId>,
    pub(crate) predicate: Option<Predicate>,
    pub(crate) timing_slot: Option<u8>,
    /// An untracked form was requested through the safe API (`arg(ArgTag::NoDep, ..)`).
    pub(crate) unsafe_tag_requested: bool,
}

impl Task {
    /// A task running `kernel` with one block.
    pub fn new(kernel: KernelId) -> Task {
        Task::with_kernel(Some(kernel))
    }

    /// A dummy task: it runs no kernel and completes as soon as its dependencies have.
    pub fn dummy() -> Task {
        Task::with_kernel(None)
    }

    fn with_kernel(kernel: Option<KernelId>) -> Task {
        Task {
            kernel,
            block_num: 1,
            sync_start: false,
            args: Vec::new(),
            scalars: Vec::new(),
            deps: Vec::new(),
            predicate: None,
            timing_slot: None,
            unsafe_tag_requested: false,
        }
    }

    /// Adds a tensor argument with an explicit tag. `Output` is not allowed here (use
    /// [`Task::output`]), nor `NoDep`, which is untracked and requested only through the
    /// unsafe [`Task::no_dep`]: the submit fails with INVALID_ARGS.
    pub fn arg(mut self, tag: ArgTag, tensor: &Tensor) -> Task {
        if tag == ArgTag::NoDep {
            self.unsafe_tag_requested = true;
        }
        self.args.push(ArgSpec::Tensor(tag, *tensor));
        self
    }
    /// Adds an `Input` argument.
    pub fn input(self, tensor: &Tensor) -> Task {
        self.arg(ArgTag::Input, tensor)
    }
    /// Adds an `InOut` argument.
    pub fn in_out(self, tensor: &Tensor) -> Task {
        self.arg(ArgTag::InOut, tensor)
    }
    /// Adds an `OutputExisting` argument.
    pub fn output_existing(self, tensor: &Tensor) -> Task {
        self.arg(ArgTag::OutputExisting, tensor)
    }
    /// Adds a `NoDep` argument: the kernel may read it, but the runtime neither waits for the
    /// view's writers nor makes later writers wait for this task (the creator of an output is
    /// still kept alive while the task may read it). Useful for data no task writes during the
    /// run (weights), or to replace one edge per writer by one explicit edge to a barrier.
    ///
    /// # Safety
    /// While this task may run, nothing writes any byte of the view: every task submitted
    /// earlier that writes those bytes must be ordered before this one (through explicit
    /// dependencies, e.g. `.after` a barrier task that follows them, or through the other
    /// arguments' dependencies), every task submitted later that writes them must be ordered
    /// after this one, and `Orchestrator::set_tensor_data` must not write them before this task
    /// has completed. Otherwise the kernel's `&[T]` aliases another task's `&mut [T]`.
    pub unsafe fn no_dep(mut self, tensor: &Tensor) -> Task {
        self.args.push(ArgSpec::Tensor(ArgTag::NoDep, *tensor));
        self
    }
    /// Adds an `Output` the runtime allocates (contiguous, row-major) from the ring heap.
    pub fn output(mut self, dtype: DType, shape: &[u64]) -> Task {
        self.args.push(ArgSpec::Output(OutputSpec {
            dtype,
            shape: shape.to_vec(),
        }));
        self
    }
    /// Adds a raw 64-bit scalar.
    pub fn scalar(mut self, bits: u64) -> Task {
        self.scalars.push(bits);
        self
    }
    /// Adds an `f32` scalar (read back with `TaskCtx::scalar_f32`).
    pub fn scalar_f32(self, v: f32) -> Task {
        self.scalar(v.to_bits() as u64)
    }
    /// Adds an `f64` scalar.
    pub fn scalar_f64(self, v: f64) -> Task {
        self.scalar(v.to_bits())
    }
    /// Adds an `i64` scalar.
    pub fn scalar_i64(self, v: i64) -> Task {
        self.scalar(v as u64)
    }
    /// SPMD: run the kernel `n` times, once per block index.
    pub fn blocks(mut self, n: u32) -> Task {
        self.block_num = n;
        self
    }
    /// Launch all blocks together (a gang); they may then meet at `TaskCtx::sync_barrier`.
    pub fn require_sync_start(mut self) -> Task {
        self.sync_start = true;
        self
    }
    /// Adds an explicit dependency on an earlier task.
    pub fn after(mut self, task: TaskId) -> Task {
        self.deps.push(task);
        self
    }
    /// Adds explicit dependencies on earlier tasks.
    pub fn after_all(mut self, tasks: impl IntoIterator<Item = TaskId>) -> Task {
        self.deps.extend(tasks);
        self
    }
    /// Runs the kernel only if `predicate` is true when the task is dispatched; otherwise the
    /// task completes without running.
    pub fn predicate(mut self, predicate: Predicate) -> Task {
        self.predicate = Some(predicate);
        self
    }
    /// Tags the task with a timing slot (0..8): the report gives min dispatch to max finish
    /// over the tasks of each slot.
    pub fn timing_slot(mut self, slot: u8) -> Task {
        self.timing_slot = Some(slot);
        self
    }
}
