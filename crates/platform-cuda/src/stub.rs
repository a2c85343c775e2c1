//! The CUDA platform's API in a build without the `cuda` feature: the same names, every
//! entry point answering [`CudaError::NotCompiled`]. The types cannot be made (each holds an
//! uninhabited field), so their methods are never reached.

use std::convert::Infallible;

use half::bf16;
use simpler_core::Element;
use simpler_kernels_cuda::KernelSource;

use crate::cache::{CompileReport, KernelCache};
use crate::{
    CompiledModules, CudaError, DecodeKernels, DecodeShape, DeviceInfo, HostModel, KernelTime,
    StepTiming,
};

/// Always [`CudaError::NotCompiled`].
pub fn probe(_ordinal: usize) -> Result<DeviceInfo, CudaError> {
    Err(CudaError::NotCompiled)
}

/// Always [`CudaError::NotCompiled`].
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    Err(CudaError::NotCompiled)
}

/// Always [`CudaError::NotCompiled`].
pub fn compile_cubin(_module: &str, _source: &str, _arch: &str) -> Result<Vec<u8>, CudaError> {
    Err(CudaError::NotCompiled)
}

/// Always [`CudaError::NotCompiled`].
pub fn compile_modules(
    _cache: &KernelCache,
    _sources: &[KernelSource],
    _arch: &str,
) -> Result<(CompiledModules, CompileReport), CudaError> {
    Err(CudaError::NotCompiled)
}

/// Always [`CudaError::NotCompiled`].
pub fn read_bandwidth(
    _dev: &CudaDevice,
    _bytes: usize,
    _rounds: usize,
) -> Result<Vec<f64>, CudaError> {
    Err(CudaError::NotCompiled)
}

/// A device (never made in this build).
#[derive(Clone)]
pub struct CudaDevice(Infallible);

impl CudaDevice {
    /// Always [`CudaError::NotCompiled`].
    pub fn open(
        _ordinal: usize,
        _cache: &KernelCache,
    ) -> Result<(CudaDevice, CompileReport), CudaError> {
        Err(CudaError::NotCompiled)
    }
    /// Unreachable: no value exists.
    pub fn info(&self) -> &DeviceInfo {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn alloc(&self, _bytes: usize) -> Result<DeviceBuffer, CudaError> {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        match self.0 {}
    }
}

/// A device graph built from a plan (never made in this build).
pub struct DeviceGraph(Infallible);

impl DeviceGraph {
    /// Always [`CudaError::NotCompiled`].
    ///
    /// # Safety
    /// None needed here; the CUDA build's contract is that every pointer argument is live
    /// device memory sized for its launch and every block size one the kernel takes.
    pub unsafe fn build(
        _dev: &CudaDevice,
        _plan: &crate::graph_plan::GraphPlan<crate::graph_plan::KernelLaunch>,
    ) -> Result<DeviceGraph, CudaError> {
        Err(CudaError::NotCompiled)
    }
    /// Unreachable: no value exists.
    pub fn launch(&self) -> Result<(), CudaError> {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn fingerprint(&self) -> u64 {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn nodes(&self) -> usize {
        match self.0 {}
    }
}

/// Device memory (never made in this build).
pub struct DeviceBuffer(Infallible);

impl DeviceBuffer {
    /// Unreachable: no value exists.
    pub fn ptr(&self) -> u64 {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn len(&self) -> usize {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn upload<T: Element>(&self, _src: &[T]) -> Result<(), CudaError> {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn download<T: Element>(&self, _dst: &mut [T]) -> Result<(), CudaError> {
        match self.0 {}
    }
}

/// The runtime platform on a device (never made in this build).
pub struct CudaPlatform(Infallible);

impl CudaPlatform {
    /// Always [`CudaError::NotCompiled`].
    pub fn new(_ordinal: usize) -> Result<CudaPlatform, CudaError> {
        Err(CudaError::NotCompiled)
    }
    /// Unreachable: no value exists.
    pub fn device(&self) -> &DeviceInfo {
        match self.0 {}
    }
}

/// The Qwen3 decode step on a device (never made in this build).
pub struct Qwen3Decoder(Infallible);

impl Qwen3Decoder {
    /// Always [`CudaError::NotCompiled`].
    pub fn new_random(
        _dev: CudaDevice,
        _shape: DecodeShape,
        _seed: u64,
        _cos: &[f32],
        _sin: &[f32],
    ) -> Result<Qwen3Decoder, CudaError> {
        Err(CudaError::NotCompiled)
    }
    /// Always [`CudaError::NotCompiled`].
    pub fn new_random_with(
        _dev: CudaDevice,
        _shape: DecodeShape,
        _seed: u64,
        _cos: &[f32],
        _sin: &[f32],
        _kernels: DecodeKernels,
    ) -> Result<Qwen3Decoder, CudaError> {
        Err(CudaError::NotCompiled)
    }
    /// Always [`CudaError::NotCompiled`].
    pub fn from_host_with(
        _dev: CudaDevice,
        _shape: DecodeShape,
        _model: &HostModel<'_>,
        _kernels: DecodeKernels,
    ) -> Result<Qwen3Decoder, CudaError> {
        Err(CudaError::NotCompiled)
    }
    /// Always [`CudaError::NotCompiled`].
    pub fn from_host(
        _dev: CudaDevice,
        _shape: DecodeShape,
        _model: &HostModel<'_>,
    ) -> Result<Qwen3Decoder, CudaError> {
        Err(CudaError::NotCompiled)
    }
    /// Unreachable: no value exists.
    pub fn shape(&self) -> &DecodeShape {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn device(&self) -> &CudaDevice {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn splits(&self) -> usize {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn step(
        &mut self,
        _ids: &[u32],
        _seq_lens: &[u32],
        _block_table: &[u32],
        _use_graph: bool,
    ) -> Result<(Vec<u32>, StepTiming), CudaError> {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn kernels(&self) -> DecodeKernels {
        match self.0 {}
    }

    /// Unreachable: no value exists.
    pub fn pdl(&self) -> bool {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn set_pdl(&mut self, _pdl: bool) {
        match self.0 {}
    }

    /// Unreachable: no value exists.
    pub fn profile_step(
        &mut self,
        _ids: &[u32],
        _seq_lens: &[u32],
        _block_table: &[u32],
    ) -> Result<Vec<KernelTime>, CudaError> {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn logits(&self) -> Result<Vec<f32>, CudaError> {
        match self.0 {}
    }
    /// Unreachable: no value exists.
    pub fn kv_pools(&self, _l: usize) -> Result<(Vec<bf16>, Vec<bf16>), CudaError> {
        match self.0 {}
    }
}
