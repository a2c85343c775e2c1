//! DeepSeek-V4 decode kernels (`docs/dsv4.md`).

pub mod moe;
