//! The Qwen3 step's runtime kernels: ids, names, engine classes, argument conventions and host
//! implementations that wrap `simpler-kernels-cpu` through [`TaskCtx`]. A host kernel runs on
//! any platform whose memory the host addresses directly; nothing here names a platform.
//!
//! # Argument conventions
//! `R` rows (decode: sequences; prefill: packed tokens), `H` hidden, `N`/`K` a projection's
//! output/input width, `ld(K)` = [`packed_ld`]`(K)`. "packed" tensors are fp32 activations in
//! the GEMM's packed layout; a tile's column range `c0..c0+n` of a packed tensor starts on a
//! multiple of 16 and ends on one or at `K`, so it holds exactly those columns.
//!
//! [`GEMM_TILE`], [`GATE_UP_SWIGLU`] and [`LM_HEAD_TILE`] are SPMD: with `B` blocks, each block
//! computes its share of the `n` output columns (weight rows), split in units of 16 by
//! `TaskCtx::write_block_cols`; the orchestration submits one task per projection.
//! [`GEMM_ROPE_STEP`] (decode's q, k and v in one task) splits in whole heads of the three
//! together, so each block's epilogue norms and rotates heads it computed itself.
//!
//! Tensor arguments and scalars are each one struct per kernel ([`args`], [`scalars`]), written
//! by the orchestration and read by the kernel from the same definition; the table below is
//! their summary.
//!
//! | kernel | tensor arguments | scalars |
//! |---|---|---|
//! | [`EMBED`] | table NoDep bf16 `[V,H]`, ids In u32 `[R]`, x Out f32 `[R,H]` | |
//! | [`CAST_BF16_F32`] / [`CAST_F32_BF16`] | src In, dst Out (contiguous, same length) | |
//! | [`COPY_F32`] | src In f32, dst Out f32 (contiguous, same length) | |
//! | [`RMS_NORM_DEFERRED`] | x In f32 `[R,H]`, g NoDep f32 `[H]`, packed Out `[R,ld(H)]`, r Out f32 `[R]` | [`NormScalars`](scalars::NormScalars) |
//! | [`RMS_NORM`] | x In f32 `[R,H]`, g NoDep f32 `[H]`, packed Out `[R,ld(H)]` | [`NormScalars`](scalars::NormScalars) |
//! | [`GEMM_TILE`] | acts In packed `[R,ld(K)]`, w NoDep bf16 `[n,K]`, out Out/InOut f32 `[R,n]`, (r In f32 `[R]`) | [`GemmScalars`](scalars::GemmScalars) |
//! | [`GATE_UP_SWIGLU`] | acts In packed `[R,ld(H)]`, wg NoDep `[n,H]`, wu NoDep `[n,H]`, act Out packed `[R,ld(I)]`, (r In `[R]`) | [`GateUpScalars`](scalars::GateUpScalars) |
//! | [`GEMM_ROPE_STEP`] | acts In packed `[n,ld(H)]`, wq NoDep `[Wq,H]`, wk NoDep `[Wkv,H]`, wv NoDep `[Wkv,H]`, q norm NoDep f32 `[d]`, k norm NoDep f32 `[d]`, cos NoDep `[max_seq,d]`, sin NoDep `[max_seq,d]`, step NoDep u32 `[n,2]`, Q Out bf16 `[n,Wq]`, K pool Out bf16 `[slots,Wkv]`, V pool Out bf16 `[slots,Wkv]` (SPMD: each block whole heads of q, k and v together, its columns of each through `write_rect`), (r In f32 `[n]`) | [`GemmRopeScalars`](scalars::GemmRopeScalars) |
//! | [`ATTN_DECODE`] | Q In bf16 `[1,Nq]`, K pool NoDep, V pool NoDep, block-table row NoDep u32, step NoDep u32 `[1,2]`, out Out f32 (final: the packed row `[1,Nq]`; partial: `[1,kv_heads*plen]`) | [`AttnDecodeScalars`](scalars::AttnDecodeScalars) |
//! | [`ATTN_COMBINE`] | partials In f32 `[C,kv_heads*plen]`, out Out the packed row `[1,Nq]` | [`AttnCombineScalars`](scalars::AttnCombineScalars) |
//! | [`ATTN_PREFILL`] | Q In bf16 `[n,Nq]`, K pool NoDep, V pool NoDep, block-table row NoDep u32, out Out packed cols `[n,group*d]` | [`AttnPrefillScalars`](scalars::AttnPrefillScalars) |
//! | [`LM_HEAD_TILE`] | acts In packed `[R,ld(H)]`, w NoDep bf16 `[n,H]`, logits Out f32 `[R,n]`, best Out u32 `[B,R,2]` (one slot per block) | [`LmHeadScalars`](scalars::LmHeadScalars) |
//! | [`ARGMAX_COMBINE`] | best In u32 `[T,R,2]` (index, f32 bits), ids Out u32 `[R]` | |
//!
//! A decode step's per-step values live in the step entries (`[seq_len, slot]` u32 per row,
//! a buffer the host writes before each step), not in scalars or view offsets: the decode
//! kernels read positions, slots and lengths at run time, so consecutive steps submit the same
//! graph and a captured one replays (`simpler_core::graph`).
//!
//! KV pools are `[slots, kv_heads * head_dim]` bf16 views of one layer (`docs/qwen3.md`); the
//! attention kernels read them through NoDep views, so the orchestration orders them after the
//! K/V writes explicitly. Malformed arguments give a [`KernelError`], never a panic.

pub mod args;
mod attn;
pub(crate) use attn::STEP_FIELDS;
mod dense;
pub mod scalars;
mod vector;

use std::cell::RefCell;

use simpler_core::{EngineClass, KernelError, KernelId, KernelSpec, TaskCtx, Worker};
use simpler_kernels_cpu::{PACK_BLOCK, pack_index, packed_ld};

/// `x[R,H] = f32(table[ids])` (embedding gather).
pub const EMBED: KernelId = KernelId(3100);
/// bf16 → fp32 cast.
pub const CAST_BF16_F32: KernelId = KernelId(3101);
/// fp32 → bf16 cast (round to nearest even).
pub const CAST_F32_BF16: KernelId = KernelId(3102);
/// fp32 copy.
pub const COPY_F32: KernelId = KernelId(3103);
/// Deferred-inverse RMSNorm into packed activations plus the per-row `1/rms`.
pub const RMS_NORM_DEFERRED: KernelId = KernelId(3104);
/// Ordinary RMSNorm into packed activations.
pub const RMS_NORM: KernelId = KernelId(3105);
/// One GEMM tile (`out (+)= acts @ w^T`, optionally scaled per row).
pub const GEMM_TILE: KernelId = KernelId(3106);
/// Gate and up tiles fused with SwiGLU, written as packed activations for the down projection.
pub const GATE_UP_SWIGLU: KernelId = KernelId(3107);
/// Split-KV decode attention of one sequence over one KV chunk, every KV head (final output or
/// the chunk's partials).
pub const ATTN_DECODE: KernelId = KernelId(3109);
/// Merge of split-KV decode partials into packed attention output.
pub const ATTN_COMBINE: KernelId = KernelId(3110);
/// Chunked causal prefill attention over a block of rows.
pub const ATTN_PREFILL: KernelId = KernelId(3111);
/// One LM-head tile: logits and the tile's argmax per row.
pub const LM_HEAD_TILE: KernelId = KernelId(3112);
/// Merge of the LM-head tiles' argmax into greedy token ids.
pub const ARGMAX_COMBINE: KernelId = KernelId(3113);
/// A decode q, k or v projection with its epilogue: q/k norm + RoPE into bf16 Q or the K
/// pool, v into the V pool, positions and slots read from the step entries at run time.
/// (3114, the separate q/k norm + RoPE task it absorbed, and 3115, the K/V scatter before
/// that, are retired.)
pub const GEMM_ROPE_STEP: KernelId = KernelId(3116);

/// Every kernel of the Qwen3 step: `(id, name, class, body)`. The projection, gate/up, LM-head
/// and embedding kernels read a resident model's bf16 layout (`qwen3::layout`).
pub fn specs() -> Vec<KernelSpec> {
    type Body = fn(&TaskCtx<'_>) -> Result<(), KernelError>;
    let table: [(KernelId, &str, EngineClass, Body); 14] = [
        (
            EMBED,
            "embedding_gather_bf16",
            EngineClass::Vector,
            vector::embed,
        ),
        (
            CAST_BF16_F32,
            "cast_bf16_f32",
            EngineClass::Vector,
            vector::cast_bf16_f32,
        ),
        (
            CAST_F32_BF16,
            "cast_f32_bf16",
            EngineClass::Vector,
            vector::cast_f32_bf16,
        ),
        (COPY_F32, "copy_f32", EngineClass::Vector, vector::copy_f32),
        (
            RMS_NORM_DEFERRED,
            "rms_norm_deferred_f32",
            EngineClass::Vector,
            vector::rms_norm_deferred,
        ),
        (
            RMS_NORM,
            "rms_norm_f32",
            EngineClass::Vector,
            vector::rms_norm,
        ),
        (
            GEMM_TILE,
            "gemm_tile_bf16",
            EngineClass::Cube,
            dense::gemm_tile,
        ),
        (
            GATE_UP_SWIGLU,
            "gate_up_swiglu_bf16",
            EngineClass::Cube,
            dense::gate_up_swiglu,
        ),
        (
            GEMM_ROPE_STEP,
            "gemm_rope_step_bf16",
            EngineClass::Cube,
            dense::gemm_rope_step,
        ),
        (
            ATTN_DECODE,
            "attention_decode_bf16",
            EngineClass::Mix,
            attn::decode,
        ),
        (
            ATTN_COMBINE,
            "attention_combine_f32",
            EngineClass::Vector,
            attn::combine,
        ),
        (
            ATTN_PREFILL,
            "attention_prefill_bf16",
            EngineClass::Mix,
            attn::prefill,
        ),
        (
            LM_HEAD_TILE,
            "lm_head_tile_bf16",
            EngineClass::Cube,
            dense::lm_head_tile,
        ),
        (
            ARGMAX_COMBINE,
            "argmax_combine_f32",
            EngineClass::Vector,
            dense::argmax_combine,
        ),
    ];
    table
        .into_iter()
        .map(|(id, name, class, body)| KernelSpec::new(id, name, class, body))
        .collect()
}

/// The Qwen3 projection kernel (`GEMM_TILE`, `gemm_tile_bf16`) for models that run it on
/// their own bf16 weights, in the layout their own rule gives each bound `[rows, cols]` matrix
/// (the form in [`specs`] reads a Qwen3 resident model's layout, `qwen3::layout`). `body` is
/// the model's kernel function, which calls `gemm_tile_in` with its rule.
pub fn gemm_spec_with(body: fn(&TaskCtx<'_>) -> Result<(), KernelError>) -> KernelSpec {
    KernelSpec::new(GEMM_TILE, "gemm_tile_bf16", EngineClass::Cube, body)
}

pub(crate) use dense::gemm_tile_in;

/// Registers every kernel of the Qwen3 step on `worker` (once per worker).
pub fn register(worker: &Worker) -> Result<(), simpler_core::Error> {
    for spec in specs() {
        worker.register_kernel(spec)?;
    }
    Ok(())
}

thread_local! {
    /// Per-core staging memory (GEMM outputs of multi-row tiles, widened queries), reused
    /// across tasks so kernels do not allocate per call.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a zeroed scratch slice of `len` floats owned by this thread.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    buf.clear();
    buf.resize(len, 0.0);
    let r = f(&mut buf);
    SCRATCH.with(|s| *s.borrow_mut() = buf);
    r
}

/// Runs `f` with a scratch slice of `len` floats owned by this thread, holding whatever an
/// earlier call left (not zeroed: for callers that write every element before reading it,
/// where zeroing was a pass over up to 1 MiB per GEMM block).
fn with_scratch_dirty<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    let r = f(&mut buf[..len]);
    SCRATCH.with(|s| *s.borrow_mut() = buf);
    r
}

/// An argument-shape error naming the kernel.
fn bad(kernel: &str, what: impl std::fmt::Display) -> KernelError {
    KernelError::new(format!("{kernel}: {what}"))
}

/// `(rows, cols)` of a 2-D (or flattened leading-dims) view.
pub(crate) fn dims2(ctx: &TaskCtx<'_>, i: usize) -> Result<(usize, usize), KernelError> {
    let t = ctx.tensor(i)?;
    let shape = t.shape();
    let cols = *shape.last().unwrap_or(&1) as usize;
    let rows = shape[..shape.len().saturating_sub(1)]
        .iter()
        .product::<u64>() as usize;
    Ok((rows, cols))
}

/// Writes values for columns `c0..c0+n` of a packed row of `k` columns into `dst`, that
/// column range of the packed row (`c0` a multiple of 16; `c0 + n` one too, or `k`).
///
/// Whole packing blocks are written with the block's fixed permutation (even then odd
/// elements) rather than a `pack_index` per element, which cost ~3× as much (a 16 × 256
/// block of SwiGLU rows: 33 against ~10 µs on a loaded host). Columns past the last whole
/// block (a row's last `k % 16`), or any range not starting on a block, go through
/// `pack_index`.
fn store_packed(dst: &mut [f32], c0: usize, k: usize, value: impl Fn(usize) -> f32) {
    const HALF: usize = PACK_BLOCK / 2;
    let whole = if c0.is_multiple_of(PACK_BLOCK) {
        (k.saturating_sub(c0) / PACK_BLOCK * PACK_BLOCK).min(dst.len() / PACK_BLOCK * PACK_BLOCK)
    } else {
        0
    };
    for (b, d) in dst[..whole].chunks_exact_mut(PACK_BLOCK).enumerate() {
        let o = b * PACK_BLOCK;
        for i in 0..HALF {
            d[i] = value(o + 2 * i);
            d[HALF + i] = value(o + 2 * i + 1);
        }
    }
    for i in whole..dst.len() {
        dst[pack_index(c0 + i, k) - c0] = value(i);
    }
}

/// Checks that `c0..c0+n` is a valid packed column range of a row of `k` columns.
fn check_packed_range(kernel: &str, c0: usize, n: usize, k: usize) -> Result<(), KernelError> {
    let end = c0 + n;
    if !c0.is_multiple_of(PACK_BLOCK) || end > k || !(end.is_multiple_of(PACK_BLOCK) || end == k) {
        return Err(bad(
            kernel,
            format!("packed columns {c0}..{end} of {k} do not start and end on 16-column blocks"),
        ));
    }
    Ok(())
}

/// Checks that a packed activation tensor has rows of `packed_ld(k)`.
fn check_packed(kernel: &str, len: usize, rows: usize, k: usize) -> Result<(), KernelError> {
    if len != rows * packed_ld(k) {
        return Err(bad(
            kernel,
            format!(
                "packed activations hold {len} floats, expected {rows} x {}",
                packed_ld(k)
            ),
        ));
    }
    Ok(())
}

/// A two-core CPU worker with no kernels registered, for the kernels' own tests.
#[cfg(test)]
fn bare_test_worker() -> simpler_core::Worker {
    simpler_core::Worker::new(
        simpler_cpu::CpuPlatform::new(),
        simpler_core::WorkerConfig {
            cores: Some(2),
            timeouts: None,
            idle_spin: None,
        },
    )
    .expect("a two-core CPU worker")
}

/// A two-core CPU worker with these kernels registered, for the kernels' own tests.
#[cfg(test)]
fn test_worker() -> simpler_core::Worker {
    let w = bare_test_worker();
    register(&w).expect("the Qwen3 kernels register");
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every valid column range (from a block, to a block or the row's end) and a range off
    /// the block starts land where `pack_index` says.
    #[test]
    fn store_packed_puts_each_column_at_its_pack_index() {
        for k in [1usize, 15, 16, 17, 40, 64, 100, 257] {
            let mut ranges: Vec<(usize, usize)> = Vec::new();
            for c0 in (0..k).step_by(PACK_BLOCK) {
                let mut ends: Vec<usize> = (c0 + PACK_BLOCK..=k).step_by(PACK_BLOCK).collect();
                ends.push(k);
                ranges.extend(ends.into_iter().map(|e| (c0, e)));
            }
            // Inside the row's last partial block (in order), off the block start.
            if k % PACK_BLOCK > 1 {
                ranges.push((k / PACK_BLOCK * PACK_BLOCK + 1, k));
            }
            for (c0, end) in ranges {
                let mut dst = vec![f32::NAN; end - c0];
                store_packed(&mut dst, c0, k, |i| (c0 + i) as f32);
                let mut want = vec![f32::NAN; end - c0];
                for c in c0..end {
                    want[pack_index(c, k) - c0] = c as f32;
                }
                assert_eq!(dst, want, "k {k}, columns {c0}..{end}");
            }
        }
    }
}
