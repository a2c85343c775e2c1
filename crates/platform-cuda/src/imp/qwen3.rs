//! The Qwen3 decode step on the device: weights, paged KV pools and scratch in device memory,
//! the step's kernels launched in dependency order on one stream, captured once as a CUDA
//! graph and replayed every step. Per-step inputs (token ids, positions, slot mapping, block
//! tables, sequence lengths) live in device buffers the graph reads; the host writes them
//! before each replay, so a step is one graph launch whatever its contents.

use std::cell::RefCell;
use std::time::Instant;

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph, LaunchConfig, PushKernelArg};
use half::bf16;
use simpler_kernels_cuda::GEMV_MAX_ROWS;

use crate::graph_plan::KernelArg;
use crate::imp::device::{CudaDevice, DeviceBuffer, driver_err};
use crate::{CudaError, DecodeKernels, DecodeShape, HostLayer, HostModel, KernelTime, StepTiming};
use crate::{interleave_gate_up, tile_layout};

/// One layer's device buffers.
struct Layer {
    /// `[(Hq + 2 Hkv) d, H]`: q, k, v projections stacked.
    qkv: DeviceBuffer,
    /// `[H, Hq d]`.
    o: DeviceBuffer,
    /// `[2 I, H]`: gate and up rows in groups of 16, the eight gate rows of `j = 8 q ..
    /// 8 q + 7` then their eight up rows (the tensor-core GEMV's SwiGLU epilogue finds each
    /// pair in one lane; the plain path's `swiglu` reads the same order).
    gate_up: DeviceBuffer,
    /// `[H, I]`.
    down: DeviceBuffer,
    input_norm: DeviceBuffer,
    post_norm: DeviceBuffer,
    q_norm: DeviceBuffer,
    k_norm: DeviceBuffer,
    /// `[pages * page_size, Hkv d]` bf16.
    k_pool: DeviceBuffer,
    v_pool: DeviceBuffer,
}

/// Per-step inputs, written by the host before each replay.
struct Inputs {
    ids: DeviceBuffer,
    pos: DeviceBuffer,
    slots: DeviceBuffer,
    seq_lens: DeviceBuffer,
    block_table: DeviceBuffer,
}

/// Activations and partials.
struct Scratch {
    x: DeviceBuffer,
    xn: DeviceBuffer,
    /// Each row's deferred `1/rms` of the last norm, fp32 `[batch]`.
    inv: DeviceBuffer,
    qkv: DeviceBuffer,
    q: DeviceBuffer,
    attn: DeviceBuffer,
    gu: DeviceBuffer,
    act: DeviceBuffer,
    part_o: DeviceBuffer,
    part_ml: DeviceBuffer,
    logits: DeviceBuffer,
    next_ids: DeviceBuffer,
}

/// The decode step of one Qwen3 model on one device.
pub struct Qwen3Decoder {
    dev: CudaDevice,
    shape: DecodeShape,
    layers: Vec<Layer>,
    embedding: DeviceBuffer,
    final_norm: DeviceBuffer,
    lm_head: DeviceBuffer,
    cos: DeviceBuffer,
    sin: DeviceBuffer,
    inputs: Inputs,
    scratch: Scratch,
    splits: usize,
    chunk: usize,
    graph: Option<CudaGraph>,
    start: CudaEvent,
    end: CudaEvent,
    kernels: DecodeKernels,
    /// Whether kernels launch with programmatic serialisation (may start under the previous
    /// kernel's tail).
    pdl: bool,
    /// While a step is profiled: an event after each launch, with the kernel's name.
    marks: RefCell<Option<Vec<(&'static str, CudaEvent)>>>,
}

const BF: usize = 2;
const F32: usize = 4;

/// `(grid, block)` as a launch configuration.
fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn i32_of(field: &'static str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::invalid(field, format!("{v} exceeds i32")))
}

impl Qwen3Decoder {
    /// A decoder with random weights generated on the device (seeded), for benchmarks: the
    /// weights never cross the PCIe bus. RoPE tables come from the host (`cos`, `sin`,
    /// `[rope_positions, head_dim]`).
    pub fn new_random(
        dev: CudaDevice,
        shape: DecodeShape,
        seed: u64,
        cos: &[f32],
        sin: &[f32],
    ) -> Result<Qwen3Decoder, CudaError> {
        let kernels = DecodeKernels::from_env()?;
        Self::new_random_with(dev, shape, seed, cos, sin, kernels)
    }

    /// [`Qwen3Decoder::new_random`] on the given kernels (their weight layout is fixed here).
    pub fn new_random_with(
        dev: CudaDevice,
        shape: DecodeShape,
        seed: u64,
        cos: &[f32],
        sin: &[f32],
        kernels: DecodeKernels,
    ) -> Result<Qwen3Decoder, CudaError> {
        let d = Self::alloc(dev, shape, cos, sin, kernels)?;
        let s = d.shape;
        let mut seed = seed;
        let mut next = || {
            seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
            seed
        };
        let fill_w = |d: &Qwen3Decoder, b: &DeviceBuffer, k: usize, sd: u64| {
            d.fill_bf16(b, sd, 0.0, 1.0 / (k as f32).sqrt())
        };
        for l in &d.layers {
            fill_w(&d, &l.qkv, s.hidden, next())?;
            fill_w(&d, &l.o, s.heads * s.head_dim, next())?;
            fill_w(&d, &l.gate_up, s.hidden, next())?;
            fill_w(&d, &l.down, s.intermediate, next())?;
            for n in [&l.input_norm, &l.post_norm, &l.q_norm, &l.k_norm] {
                d.fill_f32(n, next(), 1.0, 0.1)?;
            }
            // Random K/V history, so attention reads real values at any context.
            d.fill_bf16(&l.k_pool, next(), 0.0, 1.0)?;
            d.fill_bf16(&l.v_pool, next(), 0.0, 1.0)?;
        }
        d.fill_bf16(&d.embedding, next(), 0.0, 1.0)?;
        d.fill_bf16(&d.lm_head, next(), 0.0, 1.0 / (s.hidden as f32).sqrt())?;
        d.fill_f32(&d.final_norm, next(), 1.0, 0.1)?;
        d.dev.synchronize()?;
        Ok(d)
    }

    /// A decoder with the host model's weights and KV pools copied to the device.
    pub fn from_host(
        dev: CudaDevice,
        shape: DecodeShape,
        model: &HostModel<'_>,
    ) -> Result<Qwen3Decoder, CudaError> {
        let kernels = DecodeKernels::from_env()?;
        Self::from_host_with(dev, shape, model, kernels)
    }

    /// [`Qwen3Decoder::from_host`] on the given kernels (their weight layout is fixed here).
    pub fn from_host_with(
        dev: CudaDevice,
        shape: DecodeShape,
        model: &HostModel<'_>,
        kernels: DecodeKernels,
    ) -> Result<Qwen3Decoder, CudaError> {
        let d = Self::alloc(dev, shape, model.cos, model.sin, kernels)?;
        let s = d.shape;
        if model.layers.len() != s.layers {
            return Err(CudaError::invalid(
                "layers",
                format!("{} given, the shape has {}", model.layers.len(), s.layers),
            ));
        }
        let (qw, kvw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let check = |field: &'static str, len: usize, want: usize| {
            if len == want {
                Ok(())
            } else {
                Err(CudaError::invalid(
                    field,
                    format!("{len} elements, expected {want}"),
                ))
            }
        };
        for (l, hl) in d.layers.iter().zip(&model.layers) {
            let HostLayer {
                wq,
                wk,
                wv,
                wo,
                w_gate,
                w_up,
                w_down,
                ..
            } = hl;
            check("wq", wq.len(), qw * s.hidden)?;
            check("wk", wk.len(), kvw * s.hidden)?;
            check("wv", wv.len(), kvw * s.hidden)?;
            check("wo", wo.len(), s.hidden * qw)?;
            check("w_gate", w_gate.len(), s.intermediate * s.hidden)?;
            check("w_up", w_up.len(), s.intermediate * s.hidden)?;
            check("w_down", w_down.len(), s.hidden * s.intermediate)?;
            check("input_norm", hl.input_norm.len(), s.hidden)?;
            check("post_norm", hl.post_norm.len(), s.hidden)?;
            check("q_norm", hl.q_norm.len(), s.head_dim)?;
            check("k_norm", hl.k_norm.len(), s.head_dim)?;
            check("k_pool", hl.k_pool.len(), s.pool_slots() * kvw)?;
            check("v_pool", hl.v_pool.len(), s.pool_slots() * kvw)?;
            let stacked: Vec<bf16> = [*wq, *wk, *wv].concat();
            let gate_up = interleave_gate_up(w_gate, w_up, s.intermediate, s.hidden);
            l.qkv
                .upload(&d.weight_layout(&stacked, qw + 2 * kvw, s.hidden))?;
            l.o.upload(&d.weight_layout(wo, s.hidden, qw))?;
            l.gate_up
                .upload(&d.weight_layout(&gate_up, 2 * s.intermediate, s.hidden))?;
            l.down
                .upload(&d.weight_layout(w_down, s.hidden, s.intermediate))?;
            l.input_norm.upload(hl.input_norm)?;
            l.post_norm.upload(hl.post_norm)?;
            l.q_norm.upload(hl.q_norm)?;
            l.k_norm.upload(hl.k_norm)?;
            l.k_pool.upload(hl.k_pool)?;
            l.v_pool.upload(hl.v_pool)?;
        }
        check("embedding", model.embedding.len(), s.vocab * s.hidden)?;
        check("lm_head", model.lm_head.len(), s.vocab * s.hidden)?;
        check("final_norm", model.final_norm.len(), s.hidden)?;
        d.embedding.upload(model.embedding)?;
        d.lm_head
            .upload(&d.weight_layout(model.lm_head, s.vocab, s.hidden))?;
        d.final_norm.upload(model.final_norm)?;
        Ok(d)
    }

    fn alloc(
        dev: CudaDevice,
        shape: DecodeShape,
        cos: &[f32],
        sin: &[f32],
        kernels: DecodeKernels,
    ) -> Result<Qwen3Decoder, CudaError> {
        let s = shape;
        s.validate()?;
        let need = s.device_bytes();
        let free = dev.info().free_memory;
        if need > free {
            return Err(CudaError::invalid(
                "shape",
                format!("the decoder needs {need} bytes of device memory, {free} are free"),
            ));
        }
        let table = s.rope_positions * s.head_dim;
        if cos.len() != table || sin.len() != table {
            return Err(CudaError::invalid(
                "rope tables",
                format!(
                    "cos {} / sin {} elements, expected {table}",
                    cos.len(),
                    sin.len()
                ),
            ));
        }
        let (h, qw, kvw, i, v, b) = (
            s.hidden,
            s.heads * s.head_dim,
            s.kv_heads * s.head_dim,
            s.intermediate,
            s.vocab,
            s.batch,
        );
        let splits = s.decode_splits(dev.info().multiprocessors as usize);
        // Whole 16-token tiles per chunk (the tensor-core attention's step).
        let chunk = s.context_capacity().div_ceil(splits).next_multiple_of(16);
        let mut layers = Vec::with_capacity(s.layers);
        for _ in 0..s.layers {
            layers.push(Layer {
                qkv: dev.alloc(weight_elems(kernels, qw + 2 * kvw, h) * BF)?,
                o: dev.alloc(weight_elems(kernels, h, qw) * BF)?,
                gate_up: dev.alloc(weight_elems(kernels, 2 * i, h) * BF)?,
                down: dev.alloc(weight_elems(kernels, h, i) * BF)?,
                input_norm: dev.alloc(h * F32)?,
                post_norm: dev.alloc(h * F32)?,
                q_norm: dev.alloc(s.head_dim * F32)?,
                k_norm: dev.alloc(s.head_dim * F32)?,
                k_pool: dev.alloc(s.pool_slots() * kvw * BF)?,
                v_pool: dev.alloc(s.pool_slots() * kvw * BF)?,
            });
        }
        let inputs = Inputs {
            ids: dev.alloc(b * 4)?,
            pos: dev.alloc(b * 4)?,
            slots: dev.alloc(b * 4)?,
            seq_lens: dev.alloc(b * 4)?,
            block_table: dev.alloc(b * s.max_blocks * 4)?,
        };
        let scratch = Scratch {
            x: dev.alloc(b * h * F32)?,
            xn: dev.alloc(b * h * BF)?,
            inv: dev.alloc(b * F32)?,
            qkv: dev.alloc(b * (qw + 2 * kvw) * F32)?,
            q: dev.alloc(b * qw * BF)?,
            attn: dev.alloc(b * qw * BF)?,
            gu: dev.alloc(b * 2 * i * F32)?,
            act: dev.alloc(b * i * BF)?,
            part_o: dev.alloc(b * s.heads * splits * s.head_dim * F32)?,
            part_ml: dev.alloc(b * s.heads * splits * 2 * F32)?,
            logits: dev.alloc(b * v * F32)?,
            next_ids: dev.alloc(b * 4)?,
        };
        let cos_b = dev.alloc(table * F32)?;
        let sin_b = dev.alloc(table * F32)?;
        cos_b.upload(cos)?;
        sin_b.upload(sin)?;
        let ev = || {
            dev.ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(driver_err("cuEventCreate"))
        };
        let (start, end) = (ev()?, ev()?);
        let pdl = crate::pdl_from_env()?;
        Ok(Qwen3Decoder {
            embedding: dev.alloc(v * h * BF)?,
            final_norm: dev.alloc(h * F32)?,
            lm_head: dev.alloc(weight_elems(kernels, v, h) * BF)?,
            cos: cos_b,
            sin: sin_b,
            layers,
            inputs,
            scratch,
            splits,
            chunk,
            graph: None,
            start,
            end,
            kernels,
            pdl,
            marks: RefCell::new(None),
            dev,
            shape: s,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &DecodeShape {
        &self.shape
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// The kernels the step runs.
    pub fn kernels(&self) -> DecodeKernels {
        self.kernels
    }

    /// Whether kernels launch programmatically (see [`Qwen3Decoder::set_pdl`]).
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// Launches later steps' kernels with programmatic serialisation (each may start under the
    /// previous one's tail, its weights fetched before it waits) or plainly (the captured
    /// graph is dropped and captured again).
    pub fn set_pdl(&mut self, pdl: bool) {
        if pdl != self.pdl {
            self.pdl = pdl;
            self.graph = None;
        }
    }

    /// `w` (`[n, k]` bf16 row-major) as this decoder's kernels read it: the tensor-core GEMV's
    /// tile layout, or as it is for the plain GEMV.
    fn weight_layout(&self, w: &[bf16], n: usize, k: usize) -> Vec<bf16> {
        match self.kernels {
            DecodeKernels::TensorCore => tile_layout(w, n, k),
            DecodeKernels::Plain => w.to_vec(),
        }
    }

    /// Whether the decode attention runs on tensor cores (the chosen kernels, head_dim 128,
    /// at most 16 query heads per KV head).
    fn attention_mma(&self) -> bool {
        let s = &self.shape;
        self.kernels == DecodeKernels::TensorCore
            && s.head_dim == simpler_kernels_cuda::ATTN_MMA_HEAD_DIM
            && s.heads / s.kv_heads <= simpler_kernels_cuda::ATTN_MMA_MAX_GROUP
    }

    /// While profiling, records an event after the launch just made.
    fn mark(&self, name: &'static str) -> Result<(), CudaError> {
        if let Some(marks) = self.marks.borrow_mut().as_mut() {
            let ev = self
                .dev
                .ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(driver_err("cuEventCreate"))?;
            ev.record(&self.dev.stream)
                .map_err(driver_err("cuEventRecord"))?;
            marks.push((name, ev));
        }
        Ok(())
    }

    /// KV splits of the decode attention (fixed when the decoder is made, so one graph serves
    /// every context length up to the capacity).
    pub fn splits(&self) -> usize {
        self.splits
    }

    fn fill_bf16(
        &self,
        b: &DeviceBuffer,
        seed: u64,
        offset: f32,
        scale: f32,
    ) -> Result<(), CudaError> {
        fill_random(&self.dev, "fill_random_bf16", BF, b, seed, offset, scale)
    }

    fn fill_f32(
        &self,
        b: &DeviceBuffer,
        seed: u64,
        offset: f32,
        scale: f32,
    ) -> Result<(), CudaError> {
        fill_random(&self.dev, "fill_random_f32", F32, b, seed, offset, scale)
    }

    /// Launches kernel `name` on the step's stream, `grid` blocks of `block` threads, with
    /// `args` in the kernel's parameter order; with programmatic launch on
    /// ([`Qwen3Decoder::set_pdl`]) it may start under the previous kernel's tail (each kernel
    /// waits for that one before it touches anything the step writes: `pdl_wait` in
    /// `cu/common.cuh`). Then, while profiling, an event marks its end.
    ///
    /// # Safety
    /// Every address in `args` must hold what the kernel reads and writes for this grid. (Their
    /// number and kinds are checked against the kernel's signature: a mismatch is an error.)
    unsafe fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[KernelArg],
    ) -> Result<(), CudaError> {
        let f = self.dev.function(name)?;
        self.dev.check_args(name, args)?;
        let mut slots: Vec<[u8; 8]> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s.as_mut_ptr().cast::<c_void>())
            .collect();
        // SAFETY: an all-zero attribute is a valid value of this plain C struct (id 0 is
        // "ignore"); its id and value are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: self.dev.stream.cu_stream(),
            attrs: if self.pdl {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: the context is current (`record` binds it); `params` points at one 8-byte
        // slot per argument, alive for this call (the driver copies the values, also into a
        // graph being captured); the caller vouches that they match the kernel.
        let r = unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::Driver {
                what: name,
                detail: format!("cuLaunchKernelEx: {r:?}"),
            });
        }
        self.mark(name)
    }

    /// `y[R, n] (+)= s[R] * (x[R, k] @ w[n, k]^T)` in launches of up to `GEMV_MAX_ROWS` rows;
    /// `rscale` is the device address of `s` (fp32 `[batch]`), or 0 for none. With `swiglu`
    /// (tensor cores only) `w` is the interleaved gate/up matrix and `y` receives
    /// `act = bf16(silu(gate) * up)`, bf16 `[R, n / 2]`.
    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &self,
        w: &DeviceBuffer,
        x: u64,
        y: u64,
        rscale: u64,
        n: usize,
        k: usize,
        accumulate: bool,
        swiglu: bool,
    ) -> Result<(), CudaError> {
        if self.kernels == DecodeKernels::Plain && swiglu {
            return Err(CudaError::invalid(
                "gemv",
                "the plain GEMV has no SwiGLU epilogue",
            ));
        }
        // The SwiGLU epilogue writes bf16 [rows, n / 2].
        let y_row = if swiglu { n / 2 * BF } else { n * F32 };
        let (ni, ki, acc) = (i32_of("n", n)?, i32_of("k", k)?, i32::from(accumulate));
        let mut r0 = 0;
        while r0 < self.shape.batch {
            let rows = (self.shape.batch - r0).min(GEMV_MAX_ROWS);
            let (name, rows_per_block, threads) = match (self.kernels, swiglu, rows <= 8) {
                (DecodeKernels::Plain, _, _) => ("gemv_bf16", 8, 256),
                (DecodeKernels::TensorCore, false, true) => ("gemv_bf16_mma_n8", 16, 128),
                (DecodeKernels::TensorCore, true, true) => ("gemv_bf16_mma_n8_swiglu", 16, 128),
                (DecodeKernels::TensorCore, false, false) => ("gemv_bf16_mma", 16, 128),
                (DecodeKernels::TensorCore, true, false) => ("gemv_bf16_mma_swiglu", 16, 128),
            };
            let blocks = n.div_ceil(rows_per_block) as u32;
            let sp = if rscale == 0 {
                0
            } else {
                rscale + (r0 * F32) as u64
            };
            let args = [
                KernelArg::Ptr(w.ptr()),
                KernelArg::Ptr(x + (r0 * k * BF) as u64),
                KernelArg::Ptr(y + (r0 * y_row) as u64),
                KernelArg::Ptr(sp),
                KernelArg::I32(ni),
                KernelArg::I32(ki),
                KernelArg::I32(rows as i32),
                KernelArg::I32(acc),
            ];
            // SAFETY: `gemv_bf16*(w, x, y, rscale, n, k, batch, accumulate)`: w holds [n, k]
            // bf16, x [rows, k] bf16 from row r0, y [rows, n] fp32 (the SwiGLU forms: bf16
            // [rows, n / 2]) from row r0, rscale null or fp32 from row r0 (the buffers are
            // sized for the whole batch); k % 8 == 0 and the rows are 16-byte aligned
            // (`DecodeShape::validate`).
            unsafe { self.launch(name, (blocks, 1, 1), threads, &args) }?;
            r0 += rows;
        }
        Ok(())
    }

    /// RMSNorm of every row of `x` into `out`: deferred (`bf16(x g)` with each row's `1/rms`
    /// written to `inv`, the decode layers' form) or, with `inv` 0, ordinary.
    fn rms_norm(&self, x: u64, g: &DeviceBuffer, out: u64, inv: u64) -> Result<(), CudaError> {
        let s = &self.shape;
        let args = [
            KernelArg::Ptr(x),
            KernelArg::Ptr(g.ptr()),
            KernelArg::Ptr(out),
            KernelArg::Ptr(inv),
            KernelArg::I32(i32_of("hidden", s.hidden)?),
            KernelArg::F32(s.rms_norm_eps),
        ];
        // SAFETY: `rms_norm(x, g, out, inv, hidden, eps)`: x fp32 [batch, H], g fp32 [H], out
        // bf16 [batch, H], inv null or fp32 [batch]; H % 4 == 0 and H within the kernel's
        // registers (`validate`); NORM_THREADS threads.
        unsafe {
            self.launch(
                "rms_norm",
                (s.batch as u32, 1, 1),
                simpler_kernels_cuda::NORM_THREADS,
                &args,
            )
        }
    }

    /// Launches the whole step on the stream, in dependency order.
    fn record(&self) -> Result<(), CudaError> {
        let s = &self.shape;
        let (sc, inp) = (&self.scratch, &self.inputs);
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let (h, qw, kvw, inter) = (
            s.hidden,
            s.heads * s.head_dim,
            s.kv_heads * s.head_dim,
            s.intermediate,
        );
        let b = s.batch as u32;
        let (hi, hq, hkv, d) = (
            i32_of("hidden", h)?,
            i32_of("heads", s.heads)?,
            i32_of("kv_heads", s.kv_heads)?,
            i32_of("head_dim", s.head_dim)?,
        );
        {
            let args = [
                KernelArg::Ptr(self.embedding.ptr()),
                KernelArg::Ptr(inp.ids.ptr()),
                KernelArg::Ptr(sc.x.ptr()),
                KernelArg::I32(hi),
            ];
            // SAFETY: `embed_rows(table, ids, x, hidden)`: table bf16 [V, H], ids u32 [batch]
            // (checked < V by `step`), x fp32 [batch, H].
            unsafe { self.launch("embed_rows", (b, 1, 1), 256, &args) }?;
        }
        let scale = 1.0f32 / (s.head_dim as f32).sqrt();
        let (page, max_blocks, chunk, splits) = (
            i32_of("page_size", s.page_size)?,
            i32_of("max_blocks", s.max_blocks)?,
            i32_of("chunk", self.chunk)?,
            i32_of("splits", self.splits)?,
        );
        for l in &self.layers {
            self.rms_norm(sc.x.ptr(), &l.input_norm, sc.xn.ptr(), sc.inv.ptr())?;
            let qkv_n = qw + 2 * kvw;
            self.gemv(
                &l.qkv,
                sc.xn.ptr(),
                sc.qkv.ptr(),
                sc.inv.ptr(),
                qkv_n,
                h,
                false,
                false,
            )?;
            {
                let args = [
                    KernelArg::Ptr(sc.qkv.ptr()),
                    KernelArg::Ptr(l.q_norm.ptr()),
                    KernelArg::Ptr(l.k_norm.ptr()),
                    KernelArg::Ptr(self.cos.ptr()),
                    KernelArg::Ptr(self.sin.ptr()),
                    KernelArg::Ptr(inp.pos.ptr()),
                    KernelArg::Ptr(inp.slots.ptr()),
                    KernelArg::Ptr(sc.q.ptr()),
                    KernelArg::Ptr(l.k_pool.ptr()),
                    KernelArg::Ptr(l.v_pool.ptr()),
                    KernelArg::I32(hq),
                    KernelArg::I32(hkv),
                    KernelArg::I32(d),
                    KernelArg::F32(s.rms_norm_eps),
                ];
                let grid = (b, (s.heads + 2 * s.kv_heads) as u32, 1);
                // SAFETY: the argument list of `qk_norm_rope_kv` in order; positions are below
                // the RoPE table and slots inside the pools (checked by `step`); block = d
                // threads with d a multiple of 32 up to 256 (`validate`).
                unsafe { self.launch("qk_norm_rope_kv", grid, s.head_dim as u32, &args) }?;
            }
            {
                let name = if self.attention_mma() {
                    "attn_decode_partial_mma"
                } else {
                    "attn_decode_partial"
                };
                let args = [
                    KernelArg::Ptr(sc.q.ptr()),
                    KernelArg::Ptr(l.k_pool.ptr()),
                    KernelArg::Ptr(l.v_pool.ptr()),
                    KernelArg::Ptr(inp.block_table.ptr()),
                    KernelArg::Ptr(inp.seq_lens.ptr()),
                    KernelArg::Ptr(sc.part_o.ptr()),
                    KernelArg::Ptr(sc.part_ml.ptr()),
                    KernelArg::I32(hq),
                    KernelArg::I32(hkv),
                    KernelArg::I32(d),
                    KernelArg::I32(page),
                    KernelArg::I32(max_blocks),
                    KernelArg::I32(chunk),
                    KernelArg::F32(scale),
                ];
                let grid = (self.splits as u32, s.kv_heads as u32, b);
                // SAFETY: the argument list of `attn_decode_partial` (and of its tensor-core
                // form, taken only for head_dim 128 and groups of at most 16); block-table
                // entries of the visited pages are inside the pool and lengths within the
                // capacity (checked by `step`); partials sized [batch, Hq, splits, d] and
                // [.., 2]; both take 128 threads.
                unsafe { self.launch(name, grid, 128, &args) }?;
            }
            {
                let args = [
                    KernelArg::Ptr(sc.part_o.ptr()),
                    KernelArg::Ptr(sc.part_ml.ptr()),
                    KernelArg::Ptr(sc.attn.ptr()),
                    KernelArg::I32(hq),
                    KernelArg::I32(d),
                    KernelArg::I32(splits),
                ];
                // SAFETY: `attn_decode_combine(part_o, part_ml, out, hq, d, n_split)`: partials
                // as written above; out bf16 [batch, Hq d]; d threads.
                unsafe {
                    self.launch(
                        "attn_decode_combine",
                        (s.heads as u32, b, 1),
                        s.head_dim as u32,
                        &args,
                    )
                }?;
            }
            // Residual adds are fused: o_proj and down_proj accumulate into x.
            self.gemv(&l.o, sc.attn.ptr(), sc.x.ptr(), 0, h, qw, true, false)?;
            self.rms_norm(sc.x.ptr(), &l.post_norm, sc.xn.ptr(), sc.inv.ptr())?;
            let gu_n = 2 * inter;
            let inv = sc.inv.ptr();
            if self.kernels == DecodeKernels::TensorCore {
                // The SwiGLU in the product's epilogue: act straight from the tiles.
                self.gemv(
                    &l.gate_up,
                    sc.xn.ptr(),
                    sc.act.ptr(),
                    inv,
                    gu_n,
                    h,
                    false,
                    true,
                )?;
            } else {
                self.gemv(
                    &l.gate_up,
                    sc.xn.ptr(),
                    sc.gu.ptr(),
                    inv,
                    gu_n,
                    h,
                    false,
                    false,
                )?;
                let args = [
                    KernelArg::Ptr(sc.gu.ptr()),
                    KernelArg::Ptr(sc.act.ptr()),
                    KernelArg::I32(i32_of("intermediate", inter)?),
                ];
                // SAFETY: `swiglu(gu, act, inter)`: gu fp32 [batch, 2I] in the interleaved
                // row order, act bf16 [batch, I].
                unsafe { self.launch("swiglu", (inter.div_ceil(256) as u32, b, 1), 256, &args) }?;
            }
            self.gemv(&l.down, sc.act.ptr(), sc.x.ptr(), 0, h, inter, true, false)?;
        }
        // The final norm is ordinary (as the golden's head).
        self.rms_norm(sc.x.ptr(), &self.final_norm, sc.xn.ptr(), 0)?;
        let logits = sc.logits.ptr();
        self.gemv(
            &self.lm_head,
            sc.xn.ptr(),
            logits,
            0,
            s.vocab,
            h,
            false,
            false,
        )?;
        let args = [
            KernelArg::Ptr(logits),
            KernelArg::Ptr(sc.next_ids.ptr()),
            KernelArg::I32(i32_of("vocab", s.vocab)?),
        ];
        // SAFETY: `argmax_rows(logits, ids, vocab)`: logits fp32 [batch, V], ids u32 [batch];
        // 1024 threads.
        unsafe { self.launch("argmax_rows", (b, 1, 1), 1024, &args) }
    }

    /// Captures the step as a CUDA graph (once; later steps replay it).
    fn capture(&mut self) -> Result<(), CudaError> {
        let st = self.dev.stream.clone();
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_err("cuStreamBeginCapture"))?;
        let recorded = self.record();
        let graph = st.end_capture(CUgraphInstantiate_flags(0));
        recorded?;
        let graph = graph
            .map_err(driver_err("cuStreamEndCapture"))?
            .ok_or_else(|| CudaError::Driver {
                what: "cuStreamEndCapture",
                detail: "the capture produced no graph".into(),
            })?;
        graph.upload().map_err(driver_err("cuGraphUpload"))?;
        self.graph = Some(graph);
        Ok(())
    }

    /// Checks and writes the step's inputs: `ids[b]` the token of sequence `b`, which is
    /// then `seq_lens[b]` tokens long (the new token at position `seq_lens[b] - 1`);
    /// `block_table` `[batch, max_blocks]` page numbers.
    fn write_inputs(
        &self,
        ids: &[u32],
        seq_lens: &[u32],
        block_table: &[u32],
    ) -> Result<(), CudaError> {
        let s = &self.shape;
        if ids.len() != s.batch || seq_lens.len() != s.batch {
            return Err(CudaError::invalid(
                "batch",
                format!(
                    "{} ids and {} lengths for batch {}",
                    ids.len(),
                    seq_lens.len(),
                    s.batch
                ),
            ));
        }
        if block_table.len() != s.batch * s.max_blocks {
            return Err(CudaError::invalid(
                "block_table",
                format!(
                    "{} entries, expected {}",
                    block_table.len(),
                    s.batch * s.max_blocks
                ),
            ));
        }
        let mut pos = Vec::with_capacity(s.batch);
        let mut slots = Vec::with_capacity(s.batch);
        for b in 0..s.batch {
            if ids[b] as usize >= s.vocab {
                return Err(CudaError::invalid(
                    "ids",
                    format!("id {} >= vocab {}", ids[b], s.vocab),
                ));
            }
            let len = seq_lens[b] as usize;
            if len == 0 || len > s.context_capacity() || len > s.rope_positions {
                return Err(CudaError::invalid(
                    "seq_lens",
                    format!(
                        "sequence {b} has length {len}; 1..={} allowed",
                        s.context_capacity().min(s.rope_positions)
                    ),
                ));
            }
            let row = &block_table[b * s.max_blocks..(b + 1) * s.max_blocks];
            if let Some(p) = row[..len.div_ceil(s.page_size)]
                .iter()
                .find(|&&p| p as usize >= s.pages)
            {
                return Err(CudaError::invalid(
                    "block_table",
                    format!("sequence {b} names page {p}; the pool has {}", s.pages),
                ));
            }
            let t = len - 1;
            pos.push(t as u32);
            slots.push(row[t / s.page_size] * s.page_size as u32 + (t % s.page_size) as u32);
        }
        self.inputs.ids.upload(ids)?;
        self.inputs.pos.upload(&pos)?;
        self.inputs.slots.upload(&slots)?;
        self.inputs.seq_lens.upload(seq_lens)?;
        self.inputs.block_table.upload(block_table)
    }

    /// One decode step: writes the inputs, replays the captured graph (captured on the first
    /// call), and returns the greedy next ids with the step's timing. With `use_graph` false
    /// the kernels are launched one by one instead (the per-launch cost, for comparison).
    pub fn step(
        &mut self,
        ids: &[u32],
        seq_lens: &[u32],
        block_table: &[u32],
        use_graph: bool,
    ) -> Result<(Vec<u32>, StepTiming), CudaError> {
        self.write_inputs(ids, seq_lens, block_table)?;
        if use_graph && self.graph.is_none() {
            self.capture()?;
        }
        let st = &self.dev.stream;
        let host_start = Instant::now();
        self.start.record(st).map_err(driver_err("cuEventRecord"))?;
        match (&self.graph, use_graph) {
            (Some(g), true) => g.launch().map_err(driver_err("cuGraphLaunch"))?,
            _ => self.record()?,
        }
        self.end.record(st).map_err(driver_err("cuEventRecord"))?;
        let host_submit = host_start.elapsed();
        self.end
            .synchronize()
            .map_err(driver_err("cuEventSynchronize"))?;
        let host_wall = host_start.elapsed();
        let device_ms = self
            .start
            .elapsed_ms(&self.end)
            .map_err(driver_err("cuEventElapsedTime"))?;
        let mut next = vec![0u32; self.shape.batch];
        self.scratch.next_ids.download(&mut next)?;
        Ok((
            next,
            StepTiming {
                host_start,
                host_submit,
                host_wall,
                device: std::time::Duration::from_secs_f64(f64::from(device_ms) / 1e3),
            },
        ))
    }

    /// One step launched kernel by kernel with an event after every launch: each kernel's
    /// device time summed over its launches, in order of first launch. The events serialise
    /// nothing the stream did not already order, but each costs a little, so the sum runs
    /// slightly above an unprofiled step.
    pub fn profile_step(
        &mut self,
        ids: &[u32],
        seq_lens: &[u32],
        block_table: &[u32],
    ) -> Result<Vec<KernelTime>, CudaError> {
        self.write_inputs(ids, seq_lens, block_table)?;
        let st = &self.dev.stream;
        self.start.record(st).map_err(driver_err("cuEventRecord"))?;
        *self.marks.borrow_mut() = Some(Vec::new());
        let recorded = self.record();
        let marks = self.marks.borrow_mut().take().unwrap_or_default();
        recorded?;
        st.synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        let mut out: Vec<KernelTime> = Vec::new();
        let mut prev = &self.start;
        for (name, ev) in &marks {
            let ms = f64::from(
                prev.elapsed_ms(ev)
                    .map_err(driver_err("cuEventElapsedTime"))?,
            );
            match out.iter_mut().find(|k| k.name == *name) {
                Some(k) => {
                    k.launches += 1;
                    k.ms += ms;
                }
                None => out.push(KernelTime {
                    name,
                    launches: 1,
                    ms,
                }),
            }
            prev = ev;
        }
        Ok(out)
    }

    /// The last step's logits, `[batch, vocab]`.
    pub fn logits(&self) -> Result<Vec<f32>, CudaError> {
        let mut out = vec![0.0f32; self.shape.batch * self.shape.vocab];
        self.scratch.logits.download(&mut out)?;
        Ok(out)
    }

    /// Layer `l`'s K and V pools, `[slots, Hkv d]` bf16 each.
    pub fn kv_pools(&self, l: usize) -> Result<(Vec<bf16>, Vec<bf16>), CudaError> {
        let layer = self
            .layers
            .get(l)
            .ok_or_else(|| CudaError::invalid("layer", format!("{l} >= {}", self.layers.len())))?;
        let n = self.shape.pool_slots() * self.shape.kv_heads * self.shape.head_dim;
        let (mut k, mut v) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        layer.k_pool.download(&mut k)?;
        layer.v_pool.download(&mut v)?;
        Ok((k, v))
    }
}

/// Elements of an `[n, k]` weight matrix on the device for `kernels`: the tile layout pads
/// rows to 16 and k to 32.
fn weight_elems(kernels: DecodeKernels, n: usize, k: usize) -> usize {
    match kernels {
        DecodeKernels::TensorCore => n.next_multiple_of(16) * k.next_multiple_of(32),
        DecodeKernels::Plain => n * k,
    }
}

/// Fills `b` with `offset + scale * u`, `u` uniform in [-1, 1) from `seed`, through `kernel`
/// (`fill_random_bf16` or `fill_random_f32`, whose elements are `elem` bytes).
fn fill_random(
    dev: &CudaDevice,
    kernel: &'static str,
    elem: usize,
    b: &DeviceBuffer,
    seed: u64,
    offset: f32,
    scale: f32,
) -> Result<(), CudaError> {
    let n = (b.len() / elem) as u64;
    let f = dev.function(kernel)?;
    let mut a = dev.stream.launch_builder(f);
    let p = b.ptr();
    a.arg(&p).arg(&n).arg(&seed).arg(&offset).arg(&scale);
    // SAFETY: `fill_random_*(T*, u64 n, u64 seed, float, float)` writes n elements of `b`,
    // which holds n elements of `elem` bytes.
    unsafe { a.launch(cfg((1024, 1, 1), 256)) }.map_err(driver_err(kernel))?;
    Ok(())
}

/// The device's streaming read bandwidth: `rounds` passes of the `read_probe` kernel over a
/// buffer of `bytes` (random contents), timed with events; bytes/s of each pass.
pub fn read_bandwidth(
    dev: &CudaDevice,
    bytes: usize,
    rounds: usize,
) -> Result<Vec<f64>, CudaError> {
    let bytes = bytes / 16 * 16;
    if bytes == 0 || rounds == 0 {
        return Err(CudaError::invalid(
            "read_bandwidth",
            "bytes >= 16 and rounds >= 1 needed",
        ));
    }
    let buf = dev.alloc(bytes)?;
    let blocks = dev.info().multiprocessors.max(1) * 8;
    let sink = dev.alloc(blocks as usize * 4)?;
    fill_random(dev, "fill_random_f32", F32, &buf, 7, 0.0, 1.0)?;
    let ev = || {
        dev.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver_err("cuEventCreate"))
    };
    let (e0, e1) = (ev()?, ev()?);
    let f = dev.function("read_probe")?;
    let (p, n16, sp) = (buf.ptr(), (bytes / 16) as u64, sink.ptr());
    let mut out = Vec::with_capacity(rounds);
    for round in 0..=rounds {
        e0.record(&dev.stream)
            .map_err(driver_err("cuEventRecord"))?;
        let mut a = dev.stream.launch_builder(f);
        a.arg(&p).arg(&n16).arg(&sp);
        // SAFETY: reads n16 16-byte words of `buf`; one u32 per block of `sink`.
        unsafe { a.launch(cfg((blocks, 1, 1), 512)) }.map_err(driver_err("read_probe"))?;
        e1.record(&dev.stream)
            .map_err(driver_err("cuEventRecord"))?;
        e1.synchronize().map_err(driver_err("cuEventSynchronize"))?;
        let ms = e0
            .elapsed_ms(&e1)
            .map_err(driver_err("cuEventElapsedTime"))?;
        // Round 0 is the warm-up.
        if round > 0 {
            out.push(bytes as f64 / (f64::from(ms) / 1e3));
        }
    }
    Ok(out)
}
