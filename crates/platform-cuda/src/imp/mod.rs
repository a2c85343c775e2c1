//! The platform on the CUDA driver (feature `cuda`).

mod device;
mod graph_exec;
mod nvrtc;
mod qwen3;

pub use device::{CudaDevice, CudaPlatform, DeviceBuffer, probe};
pub use graph_exec::DeviceGraph;
pub use nvrtc::{compile_cubin, compile_modules, nvrtc_version};
pub use qwen3::{Qwen3Decoder, read_bandwidth};
