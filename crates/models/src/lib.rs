//! Model code that names no platform: for each model family its configuration, weights,
//! deterministic fixtures, an independent fp32 golden reference, and checkpoint loading.
//!
//! Qwen3 dense models (`qwen3`, following `docs/qwen3.md`) run end to end; DeepSeek-V4 flash
//! (`dsv4`, following `docs/dsv4.md`) has its configuration, fixtures and golden so far. The Qwen3 step runs on
//! the runtime (`simpler-core`) as a task graph of host kernels that wrap `simpler-kernels-cpu`;
//! nothing here names a platform (a host kernel runs on any platform whose memory the host
//! addresses). The golden reference is independent of both and calls no kernel library.

pub mod dsv4;
pub mod phase_cost;
pub mod qwen3;
pub mod rng;
