//! The device: the run-time check, the context with its stream and loaded kernels, device
//! memory, and the [`Platform`] whose memory lives on the device.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, result as drv, sys as drv_sys};
use cudarc::nvrtc::Ptx;
use simpler_core::{Element, Memory, Platform, PlatformError, PlatformInfo};
use simpler_kernels_cuda::ParamKind;

use crate::cache::{CompileReport, KernelCache};
use crate::graph_plan::KernelArg;
use crate::imp::nvrtc::compile_modules;
use crate::{CudaError, DeviceInfo};

pub(crate) fn driver_err(what: &'static str) -> impl Fn(drv::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        what,
        detail: format!("{e:?}"),
    }
}

/// Checks, without panicking, that the driver library loads, initialises and has device
/// `ordinal`, and describes it. A CPU-only machine gets [`CudaError::Unavailable`] saying
/// which of these failed.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    // SAFETY: `is_culib_present` only tries to open the library by its candidate names.
    if !unsafe { drv_sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "no NVIDIA driver library (libcuda.so) on the library search path".into(),
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| CudaError::Unavailable(format!("the driver did not initialise: {e:?}")))?;
    if ordinal >= count.max(0) as usize {
        return Err(CudaError::Unavailable(format!(
            "device {ordinal} asked for, {count} CUDA device(s) present"
        )));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| CudaError::Unavailable(format!("no context on device {ordinal}: {e:?}")))?;
    describe(&ctx)
}

fn describe(ctx: &Arc<CudaContext>) -> Result<DeviceInfo, CudaError> {
    let attr = |a| ctx.attribute(a).map_err(driver_err("cuDeviceGetAttribute"));
    let (major, minor) = ctx
        .compute_capability()
        .map_err(driver_err("cuDeviceGetAttribute"))?;
    let (free, total) = ctx.mem_get_info().map_err(driver_err("cuMemGetInfo"))?;
    Ok(DeviceInfo {
        ordinal: ctx.ordinal(),
        name: ctx.name().map_err(driver_err("cuDeviceGetName"))?,
        compute_capability: (major, minor),
        total_memory: total as u64,
        free_memory: free as u64,
        multiprocessors: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u64,
    })
}

/// One device: its context, one stream, and every kernel of `simpler-kernels-cuda` loaded.
/// Clones share all of it.
#[derive(Clone)]
pub struct CudaDevice {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    functions: Arc<HashMap<&'static str, CudaFunction>>,
    /// Each loaded kernel's parameters, read from its signature.
    params: Arc<HashMap<&'static str, Vec<ParamKind>>>,
    info: DeviceInfo,
}

impl CudaDevice {
    /// Opens device `ordinal` (after [`probe`]) and loads every kernel module, compiled for
    /// the device's architecture through `cache`; the report says what was compiled.
    pub fn open(
        ordinal: usize,
        cache: &KernelCache,
    ) -> Result<(CudaDevice, CompileReport), CudaError> {
        let info = probe(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            CudaError::Unavailable(format!("no context on device {ordinal}: {e:?}"))
        })?;
        // One stream and raw device pointers: the per-slice events cudarc records for
        // multi-stream safety would be captured into the CUDA graph.
        // SAFETY: no `CudaSlice` of this context is shared across streams (none is created).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let (modules, report) = compile_modules(cache, simpler_kernels_cuda::ALL, &info.arch())?;
        let mut functions = HashMap::new();
        let mut params = HashMap::new();
        for (src, cubin) in modules {
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(driver_err("cuModuleLoadData"))?;
            for &k in src.kernels {
                let f = module
                    .load_function(k)
                    .map_err(driver_err("cuModuleGetFunction"))?;
                functions.insert(k, f);
                let p = src.params(k).ok_or_else(|| {
                    CudaError::invalid("kernel", format!("`{k}`'s signature does not parse"))
                })?;
                params.insert(k, p);
            }
        }
        Ok((
            CudaDevice {
                ctx,
                stream,
                functions: Arc::new(functions),
                params: Arc::new(params),
                info,
            },
            report,
        ))
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The loaded kernel `name`.
    pub(crate) fn function(&self, name: &'static str) -> Result<&CudaFunction, CudaError> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::invalid("kernel", format!("`{name}` is not loaded")))
    }

    /// Checks a launch of `name` with `args` against the kernel's signature (count and kinds).
    pub(crate) fn check_args(
        &self,
        name: &'static str,
        args: &[KernelArg],
    ) -> Result<(), CudaError> {
        let params = self
            .params
            .get(name)
            .ok_or_else(|| CudaError::invalid("kernel", format!("`{name}` is not loaded")))?;
        crate::graph_plan::check_args(name, params, args)
    }

    /// `bytes` of zeroed device memory, refused when the device has less free.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        DeviceBuffer::new(&self.ctx, bytes)
    }

    /// Waits for the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))
    }
}

/// Device memory owned by the value (freed on drop), addressed by its device pointer.
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        ctx.bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let (free, _) = ctx.mem_get_info().map_err(driver_err("cuMemGetInfo"))?;
        if bytes > free {
            return Err(CudaError::invalid(
                "allocation",
                format!("{bytes} bytes asked for, {free} free on the device"),
            ));
        }
        let len = bytes.max(1);
        // SAFETY: the context is current on this thread; the pointer is freed in `drop`.
        let ptr = unsafe { drv::malloc_sync(len) }.map_err(driver_err("cuMemAlloc"))?;
        let buf = DeviceBuffer {
            ctx: ctx.clone(),
            ptr,
            len: bytes,
        };
        // SAFETY: `ptr .. ptr + len` was just allocated.
        unsafe { drv::memset_d8_sync(ptr, 0, len) }.map_err(driver_err("cuMemsetD8"))?;
        // cuMemsetD8 on device memory may still be running when it returns, on the legacy
        // stream, which the kernels' non-blocking stream does not wait for.
        ctx.synchronize().map_err(driver_err("cuCtxSynchronize"))?;
        Ok(buf)
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the size is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` to the start of the buffer; returns when it is on the device.
    pub fn upload<T: Element>(&self, src: &[T]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(src);
        if bytes > self.len {
            return Err(CudaError::invalid(
                "upload",
                format!("{bytes} bytes into a {}-byte buffer", self.len),
            ));
        }
        self.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the destination holds `bytes` bytes (checked); `T: Element` is a plain
        // number type without padding, so every byte read from `src` is initialised.
        unsafe { drv::memcpy_htod_sync(self.ptr, src) }.map_err(driver_err("cuMemcpyHtoD"))?;
        // A copy from pageable memory may return before its DMA lands, and the kernels run on
        // a non-blocking stream that does not wait for it: wait for the context.
        self.ctx
            .synchronize()
            .map_err(driver_err("cuCtxSynchronize"))
    }

    /// Copies the start of the buffer into `dst` after all work queued on the device.
    pub fn download<T: Element>(&self, dst: &mut [T]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(dst);
        if bytes > self.len {
            return Err(CudaError::invalid(
                "download",
                format!("{bytes} bytes from a {}-byte buffer", self.len),
            ));
        }
        self.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // The copy waits for the legacy stream only; kernels on non-blocking streams may
        // still be writing the buffer.
        self.ctx
            .synchronize()
            .map_err(driver_err("cuCtxSynchronize"))?;
        // SAFETY: the source holds `bytes` bytes (checked); `T: Element` is a plain number
        // type (sealed: f32, f16, bf16, integers) for which every bit pattern is valid.
        unsafe { drv::memcpy_dtoh_sync(dst, self.ptr) }.map_err(driver_err("cuMemcpyDtoH"))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `malloc_sync` and is freed only here; a failure leaks.
            let _ = unsafe { drv::free_sync(self.ptr) };
        }
    }
}

// SAFETY: `addr .. addr + len` is one device allocation owned by the value until drop;
// cuMemAlloc aligns to at least 256 bytes; never host-accessible.
unsafe impl Memory for DeviceBuffer {
    fn addr(&self) -> usize {
        self.ptr as usize
    }
    fn len(&self) -> usize {
        self.len
    }
    fn host_accessible(&self) -> bool {
        false
    }
}

/// The CUDA platform for the runtime: memory (ring heaps, tensors, weights, KV pools) is
/// device memory; cores are host threads with the device's context current, so a kernel body
/// may launch device work.
pub struct CudaPlatform {
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
}

impl CudaPlatform {
    /// The platform of device `ordinal`, after [`probe`].
    pub fn new(ordinal: usize) -> Result<CudaPlatform, CudaError> {
        let info = probe(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            CudaError::Unavailable(format!("no context on device {ordinal}: {e:?}"))
        })?;
        Ok(CudaPlatform { ctx, info })
    }

    /// What the device is.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }
}

// SAFETY: `alloc` returns zeroed device memory of the asked size that upholds `Memory`
// (`DeviceBuffer`); `host_kernels` is false, so the runtime never dereferences it on the host;
// `spawn_core` runs `body` once on a new thread.
unsafe impl Platform for CudaPlatform {
    fn info(&self) -> PlatformInfo {
        PlatformInfo {
            name: "cuda".into(),
            default_cores: 1,
            host_kernels: false,
        }
    }

    fn alloc(&self, bytes: usize) -> Result<Box<dyn Memory>, PlatformError> {
        DeviceBuffer::new(&self.ctx, bytes)
            .map(|b| Box::new(b) as Box<dyn Memory>)
            .map_err(|e| PlatformError {
                platform: "cuda".into(),
                what: e.to_string(),
            })
    }

    fn spawn_core(
        &self,
        index: usize,
        body: Box<dyn FnOnce() + Send>,
    ) -> Result<JoinHandle<()>, PlatformError> {
        let ctx = self.ctx.clone();
        std::thread::Builder::new()
            .name(format!("simpler-cuda-core-{index}"))
            .spawn(move || {
                // A core whose context cannot be made current still runs its loop; the first
                // driver call of a kernel then fails with the driver's error.
                let _ = ctx.bind_to_thread();
                body()
            })
            .map_err(|e| PlatformError {
                platform: "cuda".into(),
                what: format!("starting core thread {index}: {e}"),
            })
    }

    fn memory_available(&self) -> Option<(u64, String)> {
        self.ctx
            .mem_get_info()
            .ok()
            .map(|(free, _)| (free as u64, format!("cuMemGetInfo on {}", self.info.name)))
    }
}
