//! Every error the runtime returns: fatal run errors with their codes, configuration errors,
//! tensor-view errors, kernel errors and the crate-level [`Error`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::task::TaskId;

/// The fatal codes of a run (see `docs/runtime.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// One scope fills its ring's task window.
    ScopeDeadlock = 1,
    /// Heap exhausted (proof or backstop), or one output larger than the heap.
    HeapRingDeadlock = 2,
    /// Task window exhausted (proof or backstop).
    FlowControlDeadlock = 3,
    /// Dependency pool exhausted.
    DepPoolOverflow = 4,
    /// Malformed task arguments.
    InvalidArgs = 5,
    /// A sync-start task is larger than the cores that can run it.
    RequireSyncStartInvalid = 7,
    /// `get_tensor_data` / `set_tensor_data` waited too long.
    TensorWaitTimeout = 8,
    /// The orchestration function reported a fatal error.
    ExplicitOrchFatal = 9,
    /// Dependency map full with no progress.
    TensormapOverflow = 11,
    /// A kernel returned an error or panicked.
    KernelFailed = 12,
    /// No progress for the scheduler timeout (see [`SchedSubclass`]).
    SchedulerTimeout = 100,
    /// One task executed longer than the op-execute timeout.
    OpExecuteTimeout = 101,
    /// The whole run took longer than the stream-sync timeout.
    StreamSyncTimeout = 102,
}

impl ErrorCode {
    /// Numeric code.
    pub fn code(self) -> u32 {
        self as u32
    }
    /// Upper-case name.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::ScopeDeadlock => "SCOPE_DEADLOCK",
            ErrorCode::HeapRingDeadlock => "HEAP_RING_DEADLOCK",
            ErrorCode::FlowControlDeadlock => "FLOW_CONTROL_DEADLOCK",
            ErrorCode::DepPoolOverflow => "DEP_POOL_OVERFLOW",
            ErrorCode::InvalidArgs => "INVALID_ARGS",
            ErrorCode::RequireSyncStartInvalid => "REQUIRE_SYNC_START_INVALID",
            ErrorCode::TensorWaitTimeout => "TENSOR_WAIT_TIMEOUT",
            ErrorCode::ExplicitOrchFatal => "EXPLICIT_ORCH_FATAL",
            ErrorCode::TensormapOverflow => "TENSORMAP_OVERFLOW",
            ErrorCode::KernelFailed => "KERNEL_FAILED",
            ErrorCode::SchedulerTimeout => "SCHEDULER_TIMEOUT",
            ErrorCode::OpExecuteTimeout => "OP_EXECUTE_TIMEOUT",
            ErrorCode::StreamSyncTimeout => "STREAM_SYNC_TIMEOUT",
        }
    }
}

/// Which situation a scheduler timeout found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SchedSubclass {
    /// A running task is stuck.
    S1StuckTask,
    /// Ready tasks wait but cores are idle.
    S3IdleCores,
    /// Nothing is ready or running although tasks are pending (a dependency cycle or a lost
    /// completion).
    S4NothingReady,
    /// The orchestrator made no progress (starved or stuck in user code).
    S5OrchestratorStarved,
}

impl SchedSubclass {
    /// Short name (`S1` ...).
    pub fn name(self) -> &'static str {
        match self {
            SchedSubclass::S1StuckTask => "S1",
            SchedSubclass::S3IdleCores => "S3",
            SchedSubclass::S4NothingReady => "S4",
            SchedSubclass::S5OrchestratorStarved => "S5",
        }
    }
}

/// Whether a deadlock diagnosis is a proof or the time backstop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Diagnosis {
    /// The state proves that nothing can ever free the resource.
    Proven,
    /// No progress for the backstop time; not a proof.
    Backstop,
}

/// Where a fatal error happened.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Locator {
    /// Task concerned.
    pub task: Option<TaskId>,
    /// Its kernel's name.
    pub kernel: Option<String>,
    /// Core concerned.
    pub core: Option<u32>,
    /// Ring set concerned.
    pub ring: Option<u8>,
}

impl fmt::Display for Locator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(r) = self.ring {
            parts.push(format!("ring {r}"));
        }
        if let Some(t) = self.task {
            parts.push(t.to_string());
        }
        if let Some(k) = &self.kernel {
            parts.push(format!("kernel {k}"));
        }
        if let Some(c) = self.core {
            parts.push(format!("core {c}"));
        }
        if parts.is_empty() {
            f.write_str("run")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// A fatal error of a run: code, name, one-line detail, one-line hint and a locator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunError {
    /// The code.
    pub code: ErrorCode,
    /// Sub-class of a scheduler timeout.
    pub subclass: Option<SchedSubclass>,
    /// Proof or backstop, for the deadlock codes.
    pub diagnosis: Option<Diagnosis>,
    /// What happened, with the numbers.
    pub detail: String,
    /// What to do: the exact knob and a suggested value.
    pub hint: String,
    /// Where.
    pub locator: Locator,
}

impl RunError {
    /// A new error without locator.
    pub fn new(code: ErrorCode, detail: impl Into<String>, hint: impl Into<String>) -> RunError {
        RunError {
            code,
            subclass: None,
            diagnosis: None,
            detail: detail.into(),
            hint: hint.into(),
            locator: Locator::default(),
        }
    }
    /// Sets the locator.
    pub fn at(mut self, locator: Locator) -> RunError {
        self.locator = locator;
        self
    }
    /// Sets proof/backstop.
    pub fn diagnosed(mut self, d: Diagnosis) -> RunError {
        self.diagnosis = Some(d);
        self
    }
    /// Sets the scheduler-timeout sub-class.
    pub fn subclass(mut self, s: SchedSubclass) -> RunError {
        self.subclass = Some(s);
        self
    }
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (code {})", self.code.name(), self.code.code())?;
        if let Some(s) = self.subclass {
            write!(f, " {}", s.name())?;
        }
        write!(f, ": {}", self.detail)?;
        match self.diagnosis {
            Some(Diagnosis::Proven) => write!(f, " [proven deadlock]")?,
            Some(Diagnosis::Backstop) => {
                write!(f, " [backstop: no progress for 500 ms; not a proof]")?
            }
            None => {}
        }
        write!(f, "\n  hint: {}\n  at: {}", self.hint, self.locator)
    }
}

impl std::error::Error for RunError {}

impl From<TensorError> for RunError {
    /// A bad view made in an orchestration becomes INVALID_ARGS (latched when the orchestration
    /// returns it).
    fn from(e: TensorError) -> RunError {
        RunError::new(
            ErrorCode::InvalidArgs,
            format!("tensor view: {e}"),
            "fix the view's offset, shape or strides",
        )
    }
}

/// A configuration value that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {field} = {value}: {reason}")]
pub struct ConfigError {
    /// The field, as a path (`CallConfig.runtime_env.ring_heap[2]`).
    pub field: String,
    /// The value given.
    pub value: String,
    /// Why it is rejected and what is accepted.
    pub reason: String,
}

/// A tensor view that cannot be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// Too many or too few dimensions.
    #[error("a tensor has 1..={max} dimensions, got {ndim}")]
    Rank {
        /// Given.
        ndim: usize,
        /// Maximum.
        max: usize,
    },
    /// Strides and shape differ in length.
    #[error("shape {shape:?} and strides {strides:?} differ in length")]
    StrideRank {
        /// Shape.
        shape: Vec<u64>,
        /// Strides.
        strides: Vec<u64>,
    },
    /// The view reaches past the end of its buffer.
    #[error(
        "view offset {offset} shape {shape:?} strides {strides:?} reaches element {last_element}, but the buffer holds {buffer_elements}"
    )]
    OutOfBounds {
        /// Offset.
        offset: u64,
        /// Shape.
        shape: Vec<u64>,
        /// Strides.
        strides: Vec<u64>,
        /// Last element the view touches.
        last_element: u64,
        /// Elements in the buffer.
        buffer_elements: u64,
    },
    /// Sizes overflow.
    #[error("shape {shape:?} overflows 64-bit element offsets")]
    Overflow {
        /// Shape.
        shape: Vec<u64>,
    },
    /// Reshape of a non-contiguous view.
    #[error("reshape needs a contiguous view; shape {shape:?} strides {strides:?} is not")]
    NotContiguous {
        /// Shape.
        shape: Vec<u64>,
        /// Strides.
        strides: Vec<u64>,
    },
    /// Reshape to a different element count.
    #[error("cannot reshape {from:?} into {to:?}: element counts differ")]
    ReshapeCount {
        /// From.
        from: Vec<u64>,
        /// To.
        to: Vec<u64>,
    },
    /// Dimension out of range.
    #[error("dimension {dim} out of range for a {ndim}-d tensor")]
    Dim {
        /// Dimension.
        dim: usize,
        /// Rank.
        ndim: usize,
    },
    /// Slice out of range.
    #[error("slice {start}..{end} of dimension {dim} (size {size}) is out of range")]
    SliceRange {
        /// Dimension.
        dim: usize,
        /// Start.
        start: u64,
        /// End.
        end: u64,
        /// Size.
        size: u64,
    },
    /// Element type mismatch.
    #[error("element type mismatch: the tensor holds {actual}, {wanted} was asked for")]
    DType {
        /// Asked for.
        wanted: DType,
        /// Held.
        actual: DType,
    },
}

/// An error a kernel reports (returned from its body, or a panic caught by the runtime).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KernelError(pub String);

impl KernelError {
    /// A kernel error with a message.
    pub fn new(msg: impl Into<String>) -> KernelError {
        KernelError(msg.into())
    }
}

impl From<TensorError> for KernelError {
    fn from(e: TensorError) -> KernelError {
        KernelError(e.to_string())
    }
}

/// Host access to a buffer that cannot be done.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BufferError {
    /// The buffer is bound to a run in flight.
    #[error(
        "buffer #{id} is bound to a run in flight; wait for the run before reading or writing it from the host"
    )]
    InUse {
        /// Buffer id.
        id: u64,
    },
    /// Size mismatch.
    #[error("buffer #{id} holds {bytes} bytes, the host data is {given} bytes")]
    Size {
        /// Buffer id.
        id: u64,
        /// Buffer size.
        bytes: u64,
        /// Host size.
        given: u64,
    },
    /// The view does not fit the buffer.
    #[error(transparent)]
    View(#[from] TensorError),
}

/// A platform failure (memory, threads, device).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{platform}: {what}")]
pub struct PlatformError {
    /// Platform name.
    pub platform: String,
    /// What failed.
    pub what: String,
}

/// Everything the public API of the core can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A run failed with a fatal code.
    #[error(transparent)]
    Run(#[from] RunError),
    /// A configuration value was rejected before the run started.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Host access to a buffer failed.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// The platform failed.
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// A kernel or orchestration registration was rejected.
    #[error("registration rejected: {0}")]
    Registry(String),
    /// No orchestration of that name is registered.
    #[error("no orchestration named {name:?} is registered (registered: {known})")]
    UnknownOrchestration {
        /// Asked for.
        name: String,
        /// Known names, comma-separated.
        known: String,
    },
    /// A fault inside the runtime itself (a bug): the run was abandoned, the worker still works.
    #[error("internal runtime error (please report): {0}")]
    Internal(String),
    /// The worker was closed.
    #[error("the worker is closed; create a new one")]
    Closed,
}
