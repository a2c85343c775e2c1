//! The CUDA platform (simpler-cuda): device memory, kernel compilation through NVRTC with an
//! on-disk cache, and the Qwen3 decode step on the device as a replayed CUDA graph.
//!
//! The CUDA libraries are loaded at run time (cudarc's dynamic loading): a binary built with
//! the `cuda` feature runs on a machine without a driver, and every entry point first checks
//! that the library it needs loads ([`probe`], [`nvrtc_version`]) and answers with a
//! [`CudaError`] saying what is missing instead of touching CUDA. Without the feature the same
//! names exist and answer [`CudaError::NotCompiled`], so callers carry no `#[cfg]`.
//!
//! The shapes, the host-side views of a model and the kernel cache are platform-neutral and
//! compiled either way ([`DecodeShape`], [`HostModel`], [`cache`]).

pub mod cache;
mod error;
pub mod graph_plan;

#[cfg(feature = "cuda")]
mod imp;
#[cfg(not(feature = "cuda"))]
mod stub;

use std::time::{Duration, Instant};

use half::bf16;

pub use cache::{CompileReport, KernelCache};
pub use error::CudaError;
#[cfg(feature = "cuda")]
pub use imp::{
    CudaDevice, CudaPlatform, DeviceBuffer, DeviceGraph, Qwen3Decoder, compile_cubin,
    compile_modules, nvrtc_version, probe, read_bandwidth,
};
#[cfg(not(feature = "cuda"))]
pub use stub::{
    CudaDevice, CudaPlatform, DeviceBuffer, DeviceGraph, Qwen3Decoder, compile_cubin,
    compile_modules, nvrtc_version, probe, read_bandwidth,
};

/// Compiled kernel modules: each source with its cubin.
pub type CompiledModules = Vec<(simpler_kernels_cuda::KernelSource, Vec<u8>)>;

/// Whether this build has the CUDA platform (the `cuda` feature).
pub fn compiled() -> bool {
    cfg!(feature = "cuda")
}

/// What a device is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// The driver's name for it.
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Free device memory when probed.
    pub free_memory: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// L2 cache in bytes.
    pub l2_bytes: u64,
}

impl DeviceInfo {
    /// The architecture kernels are compiled for (`sm_90` on Hopper).
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// The shape of a Qwen3 decode step on the device: the model's dimensions, the batch and the
/// paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeShape {
    /// Hidden size `H`.
    pub hidden: usize,
    /// Query heads `Hq`.
    pub heads: usize,
    /// KV heads `Hkv`.
    pub kv_heads: usize,
    /// Head dimension `d`.
    pub head_dim: usize,
    /// MLP width `I`.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Vocabulary `V`.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Block-table entries per sequence (the context capacity is `max_blocks * page_size`).
    pub max_blocks: usize,
    /// Pages in each layer's pool.
    pub pages: usize,
    /// Positions the RoPE tables cover.
    pub rope_positions: usize,
}

impl DecodeShape {
    /// Checks what the kernels require; the error names the field.
    pub fn validate(&self) -> Result<(), CudaError> {
        let nonzero = [
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate", self.intermediate),
            ("layers", self.layers),
            ("vocab", self.vocab),
            ("batch", self.batch),
            ("page_size", self.page_size),
            ("max_blocks", self.max_blocks),
            ("pages", self.pages),
            ("rope_positions", self.rope_positions),
        ];
        if let Some((f, _)) = nonzero.iter().find(|(_, v)| *v == 0) {
            return Err(CudaError::invalid(f, "must be at least 1"));
        }
        if !self.head_dim.is_multiple_of(32)
            || self.head_dim > simpler_kernels_cuda::ATTN_MAX_HEAD_DIM
        {
            return Err(CudaError::invalid(
                "head_dim",
                format!(
                    "{} is not a multiple of 32 up to {}",
                    self.head_dim,
                    simpler_kernels_cuda::ATTN_MAX_HEAD_DIM
                ),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads)
            || self.heads / self.kv_heads > simpler_kernels_cuda::ATTN_MAX_GROUP
        {
            return Err(CudaError::invalid(
                "heads",
                format!(
                    "{} query heads over {} KV heads: a whole group of at most {} is needed",
                    self.heads,
                    self.kv_heads,
                    simpler_kernels_cuda::ATTN_MAX_GROUP
                ),
            ));
        }
        if self.hidden > simpler_kernels_cuda::NORM_MAX_HIDDEN {
            return Err(CudaError::invalid(
                "hidden",
                format!(
                    "{} exceeds the {} an RMSNorm block holds",
                    self.hidden,
                    simpler_kernels_cuda::NORM_MAX_HIDDEN
                ),
            ));
        }
        for (f, k) in [
            ("hidden", self.hidden),
            ("intermediate", self.intermediate),
            ("heads * head_dim", self.heads * self.head_dim),
        ] {
            if !k.is_multiple_of(8) {
                return Err(CudaError::invalid(f, format!("{k} is not a multiple of 8")));
            }
        }
        if !self.rms_norm_eps.is_finite() || self.rms_norm_eps <= 0.0 {
            return Err(CudaError::invalid(
                "rms_norm_eps",
                "must be finite and positive",
            ));
        }
        if self
            .pages
            .checked_mul(self.page_size)
            .is_none_or(|s| s > u32::MAX as usize)
        {
            return Err(CudaError::invalid("pages", "slot numbers must fit in u32"));
        }
        Ok(())
    }

    /// Slots in each layer's pool.
    pub fn pool_slots(&self) -> usize {
        self.pages * self.page_size
    }

    /// Longest sequence a block-table row can hold.
    pub fn context_capacity(&self) -> usize {
        self.max_blocks * self.page_size
    }

    /// KV splits of decode attention: blocks for eight per multiprocessor, and no chunk under
    /// 64 tokens (four 16-token tiles, one per warp). Measured on an H200 at 16 x 3500: 9 splits
    /// (this rule) 3.5 ms of attention a step, 17 splits 4.3 ms.
    pub fn decode_splits(&self, multiprocessors: usize) -> usize {
        let want = (8 * multiprocessors.max(1)).div_ceil(self.batch * self.kv_heads);
        want.clamp(1, (self.context_capacity() / 64).max(1))
    }

    /// Bytes of weights a step streams: every projection, the norms and the LM head (the
    /// embedding table is gathered, one row per sequence).
    pub fn weight_bytes(&self) -> u64 {
        let (h, qw, kvw, i) = (
            self.hidden as u64,
            (self.heads * self.head_dim) as u64,
            (self.kv_heads * self.head_dim) as u64,
            self.intermediate as u64,
        );
        let layer = 2 * ((qw + 2 * kvw) * h + h * qw + 2 * i * h + h * i) + 4 * (2 * h);
        self.layers as u64 * layer + 2 * self.vocab as u64 * h + 4 * h
    }

    /// KV bytes a step reads and writes for sequences of these lengths.
    pub fn kv_bytes(&self, seq_lens: &[u32]) -> u64 {
        let row = 2 * 2 * (self.kv_heads * self.head_dim) as u64;
        self.layers as u64
            * seq_lens
                .iter()
                .map(|&l| u64::from(l) * row + row)
                .sum::<u64>()
    }

    /// Device memory the decoder allocates.
    pub fn device_bytes(&self) -> u64 {
        let (h, qw, kvw, i, v, b) = (
            self.hidden as u64,
            (self.heads * self.head_dim) as u64,
            (self.kv_heads * self.head_dim) as u64,
            self.intermediate as u64,
            self.vocab as u64,
            self.batch as u64,
        );
        let pools = self.layers as u64 * 2 * self.pool_slots() as u64 * kvw * 2;
        let embed = 2 * v * h;
        let rope = 2 * 4 * (self.rope_positions * self.head_dim) as u64;
        let splits = self.context_capacity().div_ceil(32) as u64;
        let scratch = b
            * (4 * h
                + 2 * h
                + 4 * (qw + 2 * kvw)
                + 4 * qw
                + 8 * i
                + 2 * i
                + 4 * v
                + 32
                + (self.max_blocks as u64) * 4)
            + b * self.heads as u64 * splits * (self.head_dim as u64 + 2) * 4;
        // The tensor-core kernels' tile layout pads each matrix to 16 rows and 32 columns
        // (`tile_layout`): counted as an upper bound whichever kernels run.
        let pad = |n: u64, k: u64| 2 * (n.next_multiple_of(16) * k.next_multiple_of(32) - n * k);
        let padding = self.layers as u64
            * (pad(qw + 2 * kvw, h) + pad(h, qw) + pad(2 * i, h) + pad(h, i))
            + pad(v, h);
        self.weight_bytes() + padding + pools + embed + rope + scratch
    }
}

/// One layer's weights and KV pools on the host, for [`Qwen3Decoder::from_host`]: the HF
/// layouts (`[out, in]` bf16 rows), fp32 norms, pools `[slots, Hkv d]` bf16.
#[derive(Clone, Copy, Debug)]
pub struct HostLayer<'a> {
    /// `[Hq d, H]`.
    pub wq: &'a [bf16],
    /// `[Hkv d, H]`.
    pub wk: &'a [bf16],
    /// `[Hkv d, H]`.
    pub wv: &'a [bf16],
    /// `[H, Hq d]`.
    pub wo: &'a [bf16],
    /// `[I, H]`.
    pub w_gate: &'a [bf16],
    /// `[I, H]`.
    pub w_up: &'a [bf16],
    /// `[H, I]`.
    pub w_down: &'a [bf16],
    /// `[H]`.
    pub input_norm: &'a [f32],
    /// `[H]`.
    pub post_norm: &'a [f32],
    /// `[d]`.
    pub q_norm: &'a [f32],
    /// `[d]`.
    pub k_norm: &'a [f32],
    /// `[slots, Hkv d]`.
    pub k_pool: &'a [bf16],
    /// `[slots, Hkv d]`.
    pub v_pool: &'a [bf16],
}

/// A whole model on the host, for [`Qwen3Decoder::from_host`].
#[derive(Clone, Debug)]
pub struct HostModel<'a> {
    /// Every layer.
    pub layers: Vec<HostLayer<'a>>,
    /// `[V, H]`.
    pub embedding: &'a [bf16],
    /// `[H]`.
    pub final_norm: &'a [f32],
    /// `[V, H]` (the embedding again when tied).
    pub lm_head: &'a [bf16],
    /// RoPE `cos`, `[rope_positions, d]`.
    pub cos: &'a [f32],
    /// RoPE `sin`, `[rope_positions, d]`.
    pub sin: &'a [f32],
}

/// Which kernels the decode step runs for its projections and its attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeKernels {
    /// Tensor cores (`mma.m16n8k16`): the projections read each weight byte once for up to 16
    /// rows, the attention takes 16 tokens per product (head_dim 128, up to 16 query heads per
    /// KV head; other shapes take the plain attention).
    TensorCore,
    /// The plain CUDA-core kernels: one warp per weight row, one warp per token of attention.
    Plain,
}

impl DecodeKernels {
    /// The environment variable that chooses the kernels (`mma` or `plain`; unset: `mma`).
    pub const ENV: &'static str = "SIMPLER_CUDA_KERNELS";

    /// The choice named by [`Self::ENV`]; any other value is refused, naming the variable.
    pub fn from_env() -> Result<DecodeKernels, CudaError> {
        Self::from_value(std::env::var(Self::ENV).ok().as_deref())
    }

    /// [`Self::from_env`] of the variable's value (`None`: unset).
    fn from_value(value: Option<&str>) -> Result<DecodeKernels, CudaError> {
        match value {
            None => Ok(DecodeKernels::TensorCore),
            Some(v) => DecodeKernels::parse(v).ok_or_else(|| {
                CudaError::invalid(Self::ENV, format!("{v:?}: expected \"mma\" or \"plain\""))
            }),
        }
    }

    /// `mma` or `plain`.
    pub fn parse(s: &str) -> Option<DecodeKernels> {
        match s {
            "mma" => Some(DecodeKernels::TensorCore),
            "plain" => Some(DecodeKernels::Plain),
            _ => None,
        }
    }

    /// The name [`Self::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            DecodeKernels::TensorCore => "mma",
            DecodeKernels::Plain => "plain",
        }
    }
}

/// Whether decode kernels launch programmatically (`SIMPLER_CUDA_PDL`: `1` or unset yes, `0`
/// no; anything else is refused, naming the variable).
pub fn pdl_from_env() -> Result<bool, CudaError> {
    pdl_from(std::env::var("SIMPLER_CUDA_PDL").ok().as_deref())
}

/// [`pdl_from_env`] of the variable's value (`None`: unset).
fn pdl_from(value: Option<&str>) -> Result<bool, CudaError> {
    match value {
        None | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(CudaError::invalid(
            "SIMPLER_CUDA_PDL",
            format!("{v:?}: expected 0 or 1"),
        )),
    }
}

/// Device time of one kernel of a profiled step, summed over its launches.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// The kernel's name.
    pub name: &'static str,
    /// Launches in the step.
    pub launches: usize,
    /// Device time between the event before each launch and the one after it, summed (ms).
    pub ms: f64,
}

/// The timing of one device step: device time from GPU events around the work, and the host
/// instants it is anchored to (the start event is recorded right after `host_start`).
#[derive(Clone, Copy, Debug)]
pub struct StepTiming {
    /// Host clock just before the start event was recorded.
    pub host_start: Instant,
    /// Host time to submit the step (inputs excluded).
    pub host_submit: Duration,
    /// Host time until the end event completed.
    pub host_wall: Duration,
    /// Device time between the start and end events.
    pub device: Duration,
}

/// `w` (`[n, k]` bf16 row-major) in the tensor-core GEMV's tile layout (`cu/gemv.cu`): rows
/// padded with zeros to a multiple of 16 and k to a multiple of 32; for each 16-row tile and
/// 32-wide block of k, two halves of 32 words of 8 values, word `lane` of half `h` holding row
/// `16 tile + lane / 4 + 8 h` at `k = 32 kb + 8 (lane % 4) .. + 7`.
pub fn tile_layout(w: &[bf16], n: usize, k: usize) -> Vec<bf16> {
    let (tiles, nkb) = (n.div_ceil(16), k.div_ceil(32));
    let mut out = vec![bf16::ZERO; tiles * nkb * 512];
    for tile in 0..tiles {
        for kb in 0..nkb {
            for half in 0..2 {
                for lane in 0..32 {
                    let row = tile * 16 + lane / 4 + 8 * half;
                    if row >= n {
                        continue;
                    }
                    let word = ((tile * nkb + kb) * 2 + half) * 32 + lane;
                    let k0 = kb * 32 + 8 * (lane % 4);
                    for e in 0..8.min(k.saturating_sub(k0)) {
                        out[word * 8 + e] = w[row * k + k0 + e];
                    }
                }
            }
        }
    }
    out
}

/// `[w_gate; w_up]` (`[inter, hidden]` each) as the decoder's gate/up matrix: groups of 16
/// rows, the eight gate rows `8 q .. 8 q + 7` then the eight up rows of the same `j`
/// (`inter % 8 == 0`, `DecodeShape::validate`).
pub fn interleave_gate_up(gate: &[bf16], up: &[bf16], inter: usize, hidden: usize) -> Vec<bf16> {
    let mut out = Vec::with_capacity(2 * inter * hidden);
    for q in 0..inter / 8 {
        out.extend_from_slice(&gate[q * 8 * hidden..(q + 1) * 8 * hidden]);
        out.extend_from_slice(&up[q * 8 * hidden..(q + 1) * 8 * hidden]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-14B at batch 16, context 3500 (pages of 128).
    fn q14b() -> DecodeShape {
        DecodeShape {
            hidden: 5120,
            heads: 40,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 17408,
            layers: 40,
            vocab: 151_936,
            rms_norm_eps: 1e-6,
            batch: 16,
            page_size: 128,
            max_blocks: 28,
            pages: 16 * 28,
            rope_positions: 3584,
        }
    }

    #[test]
    fn shapes_the_kernels_cannot_take_are_refused_by_field() {
        assert!(q14b().validate().is_ok());
        let field = |s: DecodeShape| match s.validate() {
            Err(CudaError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(DecodeShape { batch: 0, ..q14b() }), "batch");
        assert_eq!(
            field(DecodeShape {
                head_dim: 100,
                ..q14b()
            }),
            "head_dim"
        );
        assert_eq!(
            field(DecodeShape {
                head_dim: 512,
                ..q14b()
            }),
            "head_dim"
        );
        assert_eq!(
            field(DecodeShape {
                kv_heads: 3,
                ..q14b()
            }),
            "heads"
        );
        assert_eq!(
            field(DecodeShape {
                kv_heads: 2,
                ..q14b()
            }),
            "heads"
        );
        assert_eq!(
            field(DecodeShape {
                hidden: 5124,
                ..q14b()
            }),
            "hidden"
        );
        assert_eq!(
            field(DecodeShape {
                rms_norm_eps: 0.0,
                ..q14b()
            }),
            "rms_norm_eps"
        );
        assert_eq!(
            field(DecodeShape {
                pages: usize::MAX / 2,
                ..q14b()
            }),
            "pages"
        );
    }

    /// The byte counts of the benchmark: Qwen3-14B streams ~26.4 GB of weights per step
    /// besides the embedding table (the spec's figure); the KV term is 2 (K, V) × 2 bytes ×
    /// 1024 (kv width) per token per layer.
    #[test]
    fn qwen3_14b_byte_counts() {
        let s = q14b();
        let w = s.weight_bytes() as f64 / 1e9;
        assert!((w - 27.2).abs() < 0.9, "{w} GB");
        let per_token_layer = 2 * 2 * 1024;
        assert_eq!(s.kv_bytes(&[3500]), 40 * 3501 * per_token_layer);
        assert!(s.device_bytes() > s.weight_bytes());
    }

    /// Every weight lands where the tensor-core GEMV's lane reads it (the formula of
    /// `cu/gemv.cu`, restated here per element), and the padding is zero.
    #[test]
    fn the_tile_layout_puts_each_weight_where_its_lane_reads_it() {
        for (n, k) in [(16, 32), (40, 96), (1000, 256), (7, 40)] {
            let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32(1.0 + i as f32)).collect();
            let t = tile_layout(&w, n, k);
            let nkb = k.div_ceil(32);
            assert_eq!(t.len(), n.div_ceil(16) * 16 * nkb * 32);
            let mut seen = 0;
            for (i, v) in t.iter().enumerate() {
                let (word, e) = (i / 8, i % 8);
                let (lane, half) = (word % 32, (word / 32) % 2);
                let (kb, tile) = ((word / 64) % nkb, word / 64 / nkb);
                let row = 16 * tile + lane / 4 + 8 * half;
                let col = 32 * kb + 8 * (lane % 4) + e;
                if row < n && col < k {
                    assert_eq!(*v, w[row * k + col], "n {n} k {k} row {row} col {col}");
                    seen += 1;
                } else {
                    assert_eq!(*v, bf16::ZERO, "padding at n {n} k {k}");
                }
            }
            assert_eq!(seen, n * k);
        }
    }

    /// The launch knobs read from the environment: unset is the default, the named values are
    /// taken, anything else is refused naming the variable (never silently defaulted).
    #[test]
    fn kernel_and_launch_choices_refuse_unknown_values_by_name() {
        assert_eq!(
            DecodeKernels::from_value(None).unwrap(),
            DecodeKernels::TensorCore
        );
        for k in [DecodeKernels::TensorCore, DecodeKernels::Plain] {
            assert_eq!(DecodeKernels::from_value(Some(k.name())).unwrap(), k);
        }
        let e = DecodeKernels::from_value(Some("fast")).unwrap_err();
        assert!(e.to_string().contains(DecodeKernels::ENV), "{e}");
        assert!(pdl_from(None).unwrap());
        assert!(pdl_from(Some("1")).unwrap());
        assert!(!pdl_from(Some("0")).unwrap());
        let e = pdl_from(Some("yes")).unwrap_err();
        assert!(e.to_string().contains("SIMPLER_CUDA_PDL"), "{e}");
    }

    /// Gate and up rows alternate in groups of eight.
    #[test]
    fn gate_and_up_rows_interleave_by_eight() {
        let (inter, hidden) = (16, 3);
        let gate: Vec<bf16> = (0..inter * hidden)
            .map(|i| bf16::from_f32(i as f32))
            .collect();
        let up: Vec<bf16> = (0..inter * hidden)
            .map(|i| bf16::from_f32(-(i as f32) - 1.0))
            .collect();
        let m = interleave_gate_up(&gate, &up, inter, hidden);
        for r in 0..2 * inter {
            let (q, i) = (r / 16, r % 16);
            let src = if i < 8 {
                &gate[(8 * q + i) * hidden..][..hidden]
            } else {
                &up[(8 * q + i - 8) * hidden..][..hidden]
            };
            assert_eq!(&m[r * hidden..(r + 1) * hidden], src, "row {r}");
        }
    }

    #[test]
    fn decode_splits_fill_the_device_and_keep_chunks_whole() {
        let s = q14b();
        // 132 SMs: 16 sequences x 8 KV heads = 128 blocks per split; 1056 / 128 -> 9.
        assert_eq!(s.decode_splits(132), 9);
        let one = DecodeShape {
            batch: 1,
            max_blocks: 4,
            ..s
        };
        // 1056 / 8 = 132 wanted, capped at 512 / 64 = 8 chunks of 64 tokens.
        assert_eq!(one.decode_splits(132), 8);
        let short = DecodeShape {
            batch: 1,
            page_size: 16,
            max_blocks: 1,
            ..s
        };
        assert_eq!(short.decode_splits(132), 1);
    }

    #[test]
    fn without_the_feature_every_entry_point_says_so() {
        if compiled() {
            return;
        }
        let e = probe(0).unwrap_err();
        assert!(matches!(e, CudaError::NotCompiled));
        assert!(
            e.to_string().contains("not compiled with CUDA support"),
            "{e}"
        );
        assert!(matches!(CudaPlatform::new(0), Err(CudaError::NotCompiled)));
        assert!(matches!(nvrtc_version(), Err(CudaError::NotCompiled)));
        let cache = KernelCache::new(std::env::temp_dir());
        assert!(matches!(
            CudaDevice::open(0, &cache),
            Err(CudaError::NotCompiled)
        ));
    }
}
