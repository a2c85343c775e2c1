//! The DeepSeek-V4 decode layers' runtime kernels: ids, names, engine classes, and host
//! implementations that wrap `simpler_kernels_cpu::dsv4` (and the int8 and bf16 GEMMs)
//! through [`TaskCtx`]. Nothing here names a platform.
//!
//! The bf16 projections (`x_n @ Wq_aᵀ`, `x_n @ Wkvᵀ`, the compressor's `Wc_kv`/`Wc_gate`) run
//! on the Qwen3 step's SPMD GEMM kernel ([`crate::qwen3::ops::GEMM_TILE`]), which
//! [`register`] registers as well.
//!
//! Ids: 3200–3219 the attention layers (here), 3220–3239 kept for CSA, 3240–3259 for MoE.
//!
//! | kernel | tensor arguments (in order) | scalars |
//! |---|---|---|
//! | [`HC_MIX`] (SPMD mix rows) | x_hc In f32 `[T,hc·D]`, mix NoDep f32 `[M,hc·D]`, dots Out f32 `[T,M]` | — |
//! | [`HC_PRE`] (SPMD rows) | x_hc In f32 `[T,hc·D]`, dots In f32 `[T,M]`, base NoDep f32 `[M]`, norm NoDep f32 `[D]`, hcw Out f32 `[T,M]`, xn Out packed `[T,ld(D)]` | hc, iters, hc_eps, rms_eps, s0, s1, s2 |
//! | [`ACT_I8`] (SPMD rows) | x In f32 `[T,K]`, q Out i8 `[T,K]`, scales Out f32 `[T,G]`, (norm NoDep f32 `[K]`) | groups G, eps |
//! | [`Q_B`] (SPMD heads) | qr_i8 In i8 `[T,q_lora]`, qr_scale In f32 `[T,1]`, wq_b NoDep i8 `[H·hd,q_lora]`, scales NoDep f32 `[H·hd]`, tok NoDep u32 `[T,3]`, cos NoDep, sin NoDep, q Out bf16 `[T,H·hd]` | hd, eps |
//! | [`KV_WRITE`] | kv In f32 `[T,hd]`, kv_norm NoDep, tok NoDep, cos, sin, cache InOut bf16 `[slots,hd]` | eps |
//! | [`HCA_COMPRESS`] | kv In f32 `[T,hd]`, score In f32 `[T,hd]`, ape NoDep `[ratio,hd]`, norm NoDep `[hd]`, tok NoDep, cos, sin, state_kv InOut `[B·ratio,hd]`, state_score InOut, cache InOut bf16 `[B·rows,hd]` | ratio, max_rows, eps |
//! | [`SPARSE_ATTN`] | q In bf16 `[1,h·hd]`, win NoDep i32 `[1,W]` (window-cache slots, −1 masked), window cache In bf16, sinks NoDep `[h]`, cos, sin, tok NoDep u32 `[1,3]` (the token's row: its position), out Out bf16 `[1,h·hd]`, (comp NoDep i32 `[1,C]` rows, −1 masked; compressed cache In bf16) | hd, scale |
//! | [`WO_A`] (SPMD cols) | attn In bf16 `[T,H·hd]`, wo_a NoDep bf16 `[G·R,K]`, o_r Out f32 `[T,G·R]` | groups |
//! | [`WO_B`] (SPMD cols) | o_r_i8 In i8 `[T,G·R]`, o_r_scale In f32 `[T,G]`, wo_b NoDep i8 `[D,G·R]`, scales NoDep f32 `[D]`, y Out f32 `[T,D]` | groups |
//! | [`HC_POST`] (SPMD rows) | x_hc In, y In f32 `[T,D]`, hcw In f32 `[T,M]`, x_out Out f32 `[T,hc·D]` | hc |
//!
//! | [`CSA_COMPRESS`] | kv In f32 `[T,2W]`, gate In f32 `[T,2W]`, ape NoDep `[ratio,2W]`, norm NoDep `[W]`, tok NoDep, cos, sin, ring_kv InOut `[B·2·ratio,2W]`, ring_score InOut, then main: cache InOut bf16 `[B·rows,W]`; indexer: index_q InOut i8 `[B·rows,W]`, index_scale InOut f32 `[B·rows]` | ratio, max_rows, eps |
//! | [`CSA_INDEX_Q`] (SPMD heads) | qr_i8 In i8 `[T,q_lora]`, qr_scale In f32 `[T,1]`, W_idx NoDep i8 `[IH·W,q_lora]`, scales NoDep f32, tok NoDep, cos, sin, q_i8 Out i8 `[T,IH·W]`, q_scale Out f32 `[T,IH]` | W |
//! | [`CSA_SCORES`] (SPMD (seq, chunk)) | q_i8 In, q_scale In, weights In f32 `[T,IH]`, tok NoDep, index_q In i8 `[B·rows,W]`, index_scale In, scores Out f32 `[B·chunks·T/B, chunk]` | ratio, max_rows, chunk, weight_scale |
//! | [`CSA_PLAN`] (SPMD tokens) | scores In, tok NoDep, comp Out i32 `[T,C]` (compressed-cache rows, −1 masked) | ratio, max_rows, chunk, top_k |
//!
//! `tok` holds per token `(sequence, position, window slot)` (`u32::MAX`: no slot). RoPE
//! tables are `[positions, rope_dim/2]` f32 ([`simpler_kernels_cpu::dsv4::RopeTable`]).
//! Malformed arguments give a [`KernelError`] naming the kernel, never a panic.

mod attn;
mod csa;
mod hc;

use simpler_core::{EngineClass, KernelError, KernelId, KernelSpec, TaskCtx, Worker};

use crate::qwen3::ops::dims2;

/// hc_pre of a block of tokens from their mix dots ([`HC_MIX`]): logits, weights (Sinkhorn),
/// mixed stream, attention norm into packed GEMM activations.
pub const HC_PRE: KernelId = KernelId(3200);
/// The hc mix products of every token for a block of the mix weight rows.
pub const HC_MIX: KernelId = KernelId(3208);
/// Per-row int8 activations of a projection input (optionally RMS-normed first), written once
/// for every block of the W8A8 projections that read them.
pub const ACT_I8: KernelId = KernelId(3209);
/// The W8A8 query projection of a block of heads from the int8 `qr` ([`ACT_I8`]) with its
/// epilogue (head norm, RoPE, bf16).
pub const Q_B: KernelId = KernelId(3201);
/// The KV row of every token: norm, RoPE, bf16, written into the window cache.
pub const KV_WRITE: KernelId = KernelId(3202);
/// The ratio-128 compressor: state rows, and the pooled row of every token closing a window.
pub const HCA_COMPRESS: KernelId = KernelId(3203);
/// Sparse attention with sink of one token and a block of heads over its candidate lists,
/// then inverse RoPE and bf16.
pub const SPARSE_ATTN: KernelId = KernelId(3204);
/// The grouped output projection's first half: `o_r[g] = o[g] @ Wo_a[g]ᵀ`.
pub const WO_A: KernelId = KernelId(3205);
/// The grouped output projection's second half: `Wo_b` against the int8 `o_r` per (token,
/// group) ([`ACT_I8`]), bf16.
pub const WO_B: KernelId = KernelId(3206);
/// hc_post of a block of tokens.
pub const HC_POST: KernelId = KernelId(3207);

/// The CSA overlapping compressor (main or the indexer's): ring rows, and the pooled row of
/// every token closing a window (bf16 KV row, or Hadamard-rotated int8 index row).
pub const CSA_COMPRESS: KernelId = KernelId(3220);
/// The indexer's query heads of a block of heads: W8A8 `W_idx` on the int8 `qr` ([`ACT_I8`]),
/// RoPE, Hadamard, int8.
pub const CSA_INDEX_Q: KernelId = KernelId(3221);
/// The indexer's int8 scores of one sequence's chunk of visible compressed rows.
pub const CSA_SCORES: KernelId = KernelId(3222);
/// The planning task: each token's top-k compressed rows as its candidate list.
pub const CSA_PLAN: KernelId = KernelId(3223);

/// `tok` columns: sequence, position, window slot.
pub const TOK_COLS: usize = 3;
/// A `tok` window slot meaning "no write" (the spec's slot −1): the row is padding, and no
/// kernel writes a cache row, compressor state or compressed row for it.
pub const NO_SLOT: u32 = u32::MAX;

/// Every kernel of the attention layers, and the bf16 GEMM they share with Qwen3.
pub fn specs() -> Vec<KernelSpec> {
    type Body = fn(&TaskCtx<'_>) -> Result<(), KernelError>;
    let table: [(KernelId, &str, EngineClass, Body); 14] = [
        (ACT_I8, "dsv4_act_i8", EngineClass::Vector, attn::act_i8),
        (HC_MIX, "dsv4_hc_mix", EngineClass::Vector, hc::hc_mix),
        (HC_PRE, "dsv4_hc_pre", EngineClass::Vector, hc::hc_pre),
        (Q_B, "dsv4_q_b_w8a8", EngineClass::Cube, attn::q_b),
        (
            KV_WRITE,
            "dsv4_kv_write",
            EngineClass::Vector,
            attn::kv_write,
        ),
        (
            HCA_COMPRESS,
            "dsv4_hca_compress",
            EngineClass::Vector,
            attn::hca_compress,
        ),
        (
            SPARSE_ATTN,
            "dsv4_sparse_attention",
            EngineClass::Mix,
            attn::sparse_attn,
        ),
        (WO_A, "dsv4_wo_a", EngineClass::Cube, attn::wo_a),
        (WO_B, "dsv4_wo_b_w8a8", EngineClass::Cube, attn::wo_b),
        (HC_POST, "dsv4_hc_post", EngineClass::Vector, hc::hc_post),
        (
            CSA_COMPRESS,
            "dsv4_csa_compress",
            EngineClass::Vector,
            csa::csa_compress,
        ),
        (
            CSA_INDEX_Q,
            "dsv4_csa_index_q_w8a8",
            EngineClass::Cube,
            csa::csa_index_q,
        ),
        (
            CSA_SCORES,
            "dsv4_csa_scores_i8",
            EngineClass::Cube,
            csa::csa_scores,
        ),
        (
            CSA_PLAN,
            "dsv4_csa_plan",
            EngineClass::Vector,
            csa::csa_plan,
        ),
    ];
    let mut specs: Vec<KernelSpec> = table
        .into_iter()
        .map(|(id, name, class, body)| KernelSpec::new(id, name, class, body))
        .collect();
    // The Qwen3 GEMM on this model's input projections, in their layout.
    specs.push(crate::qwen3::ops::gemm_spec_with(projection_gemm));
    specs
}

/// The Qwen3 GEMM kernel on an input projection uploaded in
/// [`crate::dsv4::bf16_layout::projection_upload_layout`].
fn projection_gemm(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    crate::qwen3::ops::gemm_tile_in(ctx, crate::dsv4::bf16_layout::projection_kernel_layout)
}

/// Registers every kernel of the DeepSeek-V4 layers on `worker` (once per worker).
pub fn register(worker: &Worker) -> Result<(), simpler_core::Error> {
    for spec in specs() {
        worker.register_kernel(spec)?;
    }
    Ok(())
}

/// An argument error naming the kernel.
fn bad(kernel: &str, what: impl std::fmt::Display) -> KernelError {
    KernelError::new(format!("{kernel}: {what}"))
}

/// Checks `what` holds `want` elements.
fn check_len(kernel: &str, what: &str, got: usize, want: usize) -> Result<(), KernelError> {
    if got == want {
        Ok(())
    } else {
        Err(bad(
            kernel,
            format!("{what} holds {got} elements, expected {want}"),
        ))
    }
}

/// A token's `(sequence, position, window slot)` from `tok`.
fn token(
    kernel: &str,
    tok: &[u32],
    t: usize,
) -> Result<(usize, usize, Option<usize>), KernelError> {
    let r = tok
        .get(t * TOK_COLS..(t + 1) * TOK_COLS)
        .ok_or_else(|| bad(kernel, format!("no tok row for token {t}")))?;
    let slot = (r[2] != NO_SLOT).then_some(r[2] as usize);
    Ok((r[0] as usize, r[1] as usize, slot))
}

/// The `(cos, sin)` rows of `pos` from tables of `pairs` columns.
fn rope_rows<'a>(
    kernel: &str,
    cos: &'a [f32],
    sin: &'a [f32],
    pairs: usize,
    pos: usize,
) -> Result<(&'a [f32], &'a [f32]), KernelError> {
    let r = pos * pairs..(pos + 1) * pairs;
    match (cos.get(r.clone()), sin.get(r)) {
        (Some(c), Some(s)) if cos.len() == sin.len() => Ok((c, s)),
        _ => Err(bad(
            kernel,
            format!(
                "position {pos} outside the RoPE tables ({} positions)",
                cos.len() / pairs.max(1)
            ),
        )),
    }
}
