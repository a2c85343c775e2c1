//! Model code that names no platform: for each model family its configuration, weights,
//! deterministic fixtures, an independent fp32 golden reference, and checkpoint loading.
//!
//! Only Qwen3 dense models live here so far (`qwen3`, following `docs/qwen3.md`). The step runs on
//! the runtime (`simpler-core`) as a task graph of host kernels that wrap `simpler-kernels-cpu`;
//! nothing here names a platform (a host kernel runs on any platform whose memory the host
//! addresses). The golden reference is independent of both and calls no kernel library.

pub mod qwen3;
pub mod rng;
