//! Model code that names no platform: for each model family its configuration, weights,
//! deterministic fixtures, an independent fp32 golden reference, and checkpoint loading.
//!
//! Only Qwen3 dense models live here so far (`qwen3`, following `03-qwen3.md`). Nothing in this
//! crate knows about the runtime or any kernel library: a platform composes the step from its
//! own kernels and checks it against [`qwen3::golden`].

pub mod qwen3;
pub mod rng;
