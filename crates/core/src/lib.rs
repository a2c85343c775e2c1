//! The simpler runtime core: the task model, the orchestrator, the dependency map (TensorMap),
//! the ring sets, the scheduler and the [`Platform`] trait platforms implement.
//!
//! The core does no I/O and names no platform: platforms (CPU threads, CUDA) implement
//! [`Platform`]; trace files are written by `simpler-dfx` from the values in [`RunReport`].
//! `ARCHITECTURE.md` at the repository root describes how one run flows through these modules.

pub mod clock;
pub mod config;
pub mod dtype;
pub mod error;
pub mod kernel;
pub mod report;
pub mod task;
pub mod tensor;
mod timing;
pub mod trace;

pub use config::{CallConfig, OrchMode, RingValue, RuntimeEnv, Timeouts};
pub use dtype::{DType, Element};
pub use error::{
    BufferError, ConfigError, Diagnosis, Error, ErrorCode, KernelError, Locator, PlatformError, RunError,
    SchedSubclass, TensorError,
};
pub use kernel::{KernelFn, KernelId, KernelSpec, Predicate, TaskCtx, TensorArg};
pub use report::{Interval, RunCounters, RunReport, TaskSlotTiming};
pub use task::{ArgTag, EngineClass, OutputSpec, Task, TaskId};
pub use tensor::{BufferId, MAX_DIMS, Tensor};
