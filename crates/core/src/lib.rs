//! The simpler runtime core: the task model, the orchestrator, the dependency map (TensorMap),
//! the ring sets, the scheduler and the [`Platform`] trait platforms implement.
//!
//! The core does no I/O and names no platform: platforms (CPU threads, CUDA) implement
//! [`Platform`]; trace files are written by `simpler-dfx` from the values in [`RunReport`].
//! `ARCHITECTURE.md` at the repository root describes how one run flows through these modules.

mod buffer;
mod claim;
pub mod clock;
pub mod config;
mod diag;
pub mod dtype;
pub mod error;
mod exec;
pub mod graph;
pub mod kernel;
mod orch;
mod orch_data;
mod orch_replay;
mod orch_validate;
mod orch_wait;
pub mod platform;
mod pool;
pub mod report;
mod ring;
mod run;
mod sched;
mod sleep;
mod slot;
pub mod task;
pub mod tensor;
mod tensormap;
mod timing;
pub mod trace;
mod watchdog;
mod worker;

pub use buffer::Buffer;
pub use config::{CallConfig, OrchMode, RingValue, RuntimeEnv, Timeouts};
pub use diag::human_bytes;
pub use dtype::{DType, Element};
pub use error::{
    BufferError, ConfigError, Diagnosis, Error, ErrorCode, KernelError, Locator, PlatformError,
    RunError, SchedSubclass, TensorError,
};
pub use exec::{OrchFn, RunArgs};
pub use graph::{
    ArgSource, CapturedGraph, GraphArg, GraphDep, GraphMode, GraphOutput, GraphShape, GraphTask,
};
pub use kernel::{
    KernelFn, KernelId, KernelSpec, Predicate, Rows, RowsMut, TaskCtx, TensorArg, tapered_range,
};
pub use orch::{Orchestrator, Submitted};
pub use platform::{Memory, Platform, PlatformInfo, ThreadCounters, ThreadTimes};
pub use pool::RunHandle;
pub use report::{Interval, OutsideShare, RingOccupancy, RunCounters, RunReport, TaskSlotTiming};
pub use ring::OUTPUT_ALIGN;
pub use task::{ArgTag, EngineClass, OutputSpec, ScopeKind, Task, TaskId};
pub use tensor::{BufferId, MAX_DIMS, Tensor};
pub use worker::{GraphCache, MAX_CORES, Worker, WorkerConfig};
