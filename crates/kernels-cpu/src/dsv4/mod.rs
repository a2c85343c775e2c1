//! DeepSeek-V4 "flash" decode kernels (`docs/dsv4.md`).

pub mod csa;
