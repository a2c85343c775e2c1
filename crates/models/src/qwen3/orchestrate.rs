//! The Qwen3 step as a task graph: decode (full model or the fixture's layers chunk) and chunked
//! causal prefill, one scope per layer so the live set does not grow with the layer count.
//!
//! The file reads as a model file, bottom up: view helpers and the bound tensors, then norm,
//! the projection (`gemm`), the MLP, attention (projections, RoPE + K/V write, decode and
//! prefill attention), the layer, and the model step with its head. Each function names the
//! golden step (`golden/mod.rs`) it implements.
//!
//! One layer (`R` rows; decode defers `1/rms` past the projections, prefill normalises first):
//! ```text
//! norm(x) -> packed n [R, ld(H)] (+ r [R])
//! q, k, v (SPMD, whole-head shares): n @ W^T (* r), q/k norm + RoPE at each row's step
//!         entry                             -> Q bf16 [R, Nq]; K/V rows into the paged pool
//! attention per (sequence, KV chunk)       -> a packed [R, ld(Nq)]   (+ combine when split)
//! o_proj (SPMD): x[:, share] += a @ Wo^T    (the residual, in place)
//! norm(x) -> packed m (+ r2)
//! gate/up + SwiGLU (SPMD)                  -> act packed [R, ld(I)]
//! down (SPMD): x[:, share] += act @ Wd^T
//! ```
//! Attention reads the pools through NoDep views and waits on the task that wrote the layer's
//! K/V rows, the q/k/v projections themselves. Every phase whose output many tasks wrote (the
//! attention output, the SwiGLU activations) ends in a barrier task, and its consumers read
//! the output NoDep after that barrier: one edge per consumer instead of one per producer (a
//! consumer would otherwise wait on every producer). Timing slots: 0 input
//! (embedding or cast), 1 layers, 2 head.

use std::ops::Range;

use simpler_core::{
    DType, OUTPUT_ALIGN, Orchestrator, RunArgs, RunError, ScopeKind, Task, TaskId, Tensor,
    TensorError,
};
use simpler_kernels_cpu::{PACK_BLOCK, packed_ld, partial_len};

use super::config::Qwen3Config;
use super::ops;
use super::ops::STEP_FIELDS;
use super::ops::args::{
    Arg, ArgmaxArgs, AttnCombineArgs, AttnDecodeArgs, AttnPrefillArgs, CastArgs, EmbedArgs,
    GateUpArgs, GemmArgs, GemmRopeArgs, LmHeadArgs, NormArgs, NormDeferredArgs,
};
use super::ops::scalars::{
    AttnCombineScalars, AttnDecodeScalars, AttnPrefillScalars, GateUpScalars, GemmRopeScalars,
    GemmScalars, LmHeadScalars, NormScalars, PushScalars,
};
use super::plan::{KvSplit, LayerBlocks, SeqRows};
use super::quant::{Int8Acts, WeightFormat, int8_record};
use super::resident::slot;

/// RunArgs buffer indices after the model's buffers.
pub(crate) mod io {
    use super::slot;
    /// K pools `[layers, slots, Nkv]` bf16.
    pub(crate) const K_CACHE: usize = slot::COUNT;
    /// V pools.
    pub(crate) const V_CACHE: usize = slot::COUNT + 1;
    /// Block tables `[table rows, max_blocks]` u32.
    pub(crate) const BLOCK_TABLE: usize = slot::COUNT + 2;
    /// Token ids u32 `[R]` (model variant) or hidden bf16 `[R, H]` (layers variant).
    pub(crate) const INPUT: usize = slot::COUNT + 3;
    /// Logits f32 `[S, V]` (model) or hidden bf16 `[R, H]` (layers).
    pub(crate) const OUT_MAIN: usize = slot::COUNT + 4;
    /// Greedy ids u32 `[S]` (model).
    pub(crate) const OUT_IDS: usize = slot::COUNT + 5;
    /// Final hidden state f32 `[S, H]` before the final norm (model).
    pub(crate) const OUT_HIDDEN: usize = slot::COUNT + 6;
    /// Step entries u32 `[R, 2]`: each row's length (its position + 1) and the slot its K/V
    /// go to.
    pub(crate) const STEP: usize = slot::COUNT + 7;
    /// Buffers of a run.
    pub(crate) const COUNT: usize = slot::COUNT + 8;
}

/// Decode or prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StepKind {
    /// One new token per sequence, deferred `1/rms`, split-KV attention.
    Decode,
    /// Chunks of tokens per sequence, ordinary RMSNorm, causal attention.
    Prefill,
}

/// What goes in and comes out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Variant {
    /// Token ids in; logits and greedy ids of each sequence's last row out.
    Model,
    /// bf16 hidden in and out (fp32 carried between the layers), no embedding or head.
    Layers,
}

/// Everything the orchestration needs about one step, computed on the host.
#[derive(Clone, Debug)]
pub(crate) struct StepPlan {
    pub(crate) config: Qwen3Config,
    /// How the projections and LM head are held (their dtype and row width when bound).
    pub(crate) format: WeightFormat,
    pub(crate) sets: usize,
    pub(crate) set_of_layer: Vec<usize>,
    pub(crate) max_seq: usize,
    pub(crate) kv_layers: usize,
    pub(crate) slots: usize,
    pub(crate) page_size: usize,
    pub(crate) table_rows: usize,
    pub(crate) max_blocks: usize,
    pub(crate) kind: StepKind,
    pub(crate) variant: Variant,
    pub(crate) layers: Range<usize>,
    /// Rows of the step (decode: sequences; prefill: packed tokens).
    pub(crate) rows: usize,
    pub(crate) seqs: Vec<SeqRows>,
    pub(crate) blocks: LayerBlocks,
    /// Decode: how each sequence's KV is cut into chunks.
    pub(crate) kv_chunks: Vec<KvSplit>,
    /// Prefill: query rows per attention task.
    pub(crate) prefill_rows: usize,
    /// Prefill: the bound on a q/k/v block's products (`TilePolicy::qkv_scratch_bytes`).
    pub(crate) qkv_scratch_bytes: usize,
    /// Decode: blocks (one per core) of the layer's small task that every core waits for, the
    /// attention combine of the sequence whose chunks end the attention phase (each block a
    /// share of the KV heads; one task at batch 1 ran alone while the other cores waited).
    pub(crate) small_task_blocks: usize,
}

impl StepPlan {
    /// Whether int8 projections take int8-quantised activations.
    fn w8a8(&self) -> bool {
        self.format == WeightFormat::Int8(Int8Acts::Quantised)
    }
}

type R<T> = Result<T, RunError>;

/// A view operation's error as a fatal orchestration error.
fn view<T>(o: &Orchestrator, r: Result<T, TensorError>) -> R<T> {
    r.map_err(|e| o.fatal(format!("qwen3 orchestration: {e}")))
}

/// Rows `a..b` (dimension 0).
fn rows(o: &Orchestrator, t: &Tensor, a: usize, b: usize) -> R<Tensor> {
    view(o, t.slice(0, a as u64, b as u64))
}

/// Columns `a..b` (last dimension of a 2-D view).
fn cols(o: &Orchestrator, t: &Tensor, a: usize, b: usize) -> R<Tensor> {
    view(o, t.slice(1, a as u64, b as u64))
}

/// Entry `i` of dimension 0, with that dimension dropped.
fn entry(o: &Orchestrator, t: &Tensor, i: usize) -> R<Tensor> {
    let s = rows(o, t, i, i + 1)?;
    let shape: Vec<u64> = t.shape()[1..].to_vec();
    view(o, s.reshape(&shape))
}

/// The run's bound model, cache and I/O views.
struct Views {
    /// The 11 per-layer tensors `[sets, ...]` in `LayerWeights::shapes` order.
    layer: Vec<Tensor>,
    embedding: Tensor,
    final_norm: Tensor,
    lm_head: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    table: Tensor,
    /// The step entries `[R, 2]`.
    step: Tensor,
}

fn bind_all(o: &mut Orchestrator, args: &RunArgs, p: &StepPlan) -> R<Views> {
    if args.buffers.len() != io::COUNT {
        return Err(o.fatal(format!(
            "qwen3 orchestration: {} buffers, expected {}",
            args.buffers.len(),
            io::COUNT
        )));
    }
    let c = &p.config;
    let sets = p.sets as u64;
    let mut layer = Vec::with_capacity(slot::LAYER_TENSORS);
    for (kind, (_, [r, k])) in super::weights::LayerWeights::shapes(c).iter().enumerate() {
        let dtype = match (kind < 7, p.format.is_int8()) {
            (true, false) => DType::BF16,
            (true, true) => DType::I8,
            (false, _) => DType::F32,
        };
        let shape = if kind < 7 {
            vec![sets, *r as u64, weight_cols(p.format, *k)]
        } else {
            vec![sets, (*r * *k) as u64]
        };
        layer.push(o.bind(&args.buffers[kind], dtype, &shape)?);
    }
    let (v, h, d) = (c.vocab_size as u64, c.hidden_size as u64, c.head_dim as u64);
    let kv_shape = [p.kv_layers as u64, p.slots as u64, c.kv_width() as u64];
    Ok(Views {
        layer,
        embedding: o.bind(&args.buffers[slot::EMBEDDING], DType::BF16, &[v, h])?,
        final_norm: o.bind(&args.buffers[slot::FINAL_NORM], DType::F32, &[h])?,
        lm_head: o.bind(
            &args.buffers[slot::LM_HEAD],
            if p.format.is_int8() {
                DType::I8
            } else {
                DType::BF16
            },
            &[v, weight_cols(p.format, c.hidden_size)],
        )?,
        cos: o.bind(
            &args.buffers[slot::ROPE_COS],
            DType::F32,
            &[p.max_seq as u64, d],
        )?,
        sin: o.bind(
            &args.buffers[slot::ROPE_SIN],
            DType::F32,
            &[p.max_seq as u64, d],
        )?,
        k_cache: o.bind(&args.buffers[io::K_CACHE], DType::BF16, &kv_shape)?,
        v_cache: o.bind(&args.buffers[io::V_CACHE], DType::BF16, &kv_shape)?,
        table: o.bind(
            &args.buffers[io::BLOCK_TABLE],
            DType::U32,
            &[p.table_rows as u64, p.max_blocks as u64],
        )?,
        step: o.bind(
            &args.buffers[io::STEP],
            DType::U32,
            &[p.rows as u64, STEP_FIELDS as u64],
        )?,
    })
}

/// Elements per bound weight row of `k` inputs: `k` bf16, or an int8 record (`quant`).
fn weight_cols(format: WeightFormat, k: usize) -> u64 {
    match format {
        WeightFormat::Bf16 => k as u64,
        WeightFormat::Int8(_) => int8_record(k) as u64,
    }
}

/// RMSNorm of `x` with weights `g` (golden: `norm_rows`): packed activations, plus `1/rms` per
/// row for decode, where it is deferred past the projections.
fn norm(o: &mut Orchestrator, p: &StepPlan, x: &Tensor, g: &Tensor) -> R<(Tensor, Option<Tensor>)> {
    let c = &p.config;
    let (r, ld) = (p.rows as u64, packed_ld(c.hidden_size) as u64);
    let eps = c.rms_norm_eps as f32;
    Ok(match p.kind {
        StepKind::Decode => {
            let t = NormDeferredArgs {
                x: Arg::In(x),
                // SAFETY: `g` is a norm weight: written by no task during a run.
                g: unsafe { Arg::untracked(g) },
                packed: Arg::New(DType::F32, vec![r, ld]),
                r: Arg::New(DType::F32, vec![r]),
            }
            .push(Task::new(ops::RMS_NORM_DEFERRED));
            // A block of rows per core, as prefill's below.
            let blocks = o.total_cores().clamp(1, p.rows.max(1));
            let t = t.blocks(u32::try_from(blocks).unwrap_or(1));
            let s = o.submit(t.push_scalars(NormScalars { eps }).timing_slot(1))?;
            (s.output(0), Some(s.output(1)))
        }
        StepKind::Prefill => {
            let t = NormArgs {
                x: Arg::In(x),
                // SAFETY: `g` is a norm weight: written by no task during a run.
                g: unsafe { Arg::untracked(g) },
                packed: Arg::New(DType::F32, vec![r, ld]),
            }
            .push(Task::new(ops::RMS_NORM));
            // A block of rows per core: as one task the norm ran on one core while the other
            // waited for the projections it feeds.
            let blocks = o.total_cores().clamp(1, p.rows.max(1));
            let t = t.blocks(u32::try_from(blocks).unwrap_or(1));
            let s = o.submit(t.push_scalars(NormScalars { eps }).timing_slot(1))?;
            (s.output(0), None)
        }
    })
}

/// How a task reaches an input many tasks wrote: through the tensor (one edge per writer) or
/// through a barrier that follows every writer (one edge; the tensor is then passed NoDep).
#[derive(Clone, Copy)]
enum Dep {
    Tensor,
    After(TaskId),
}

impl Dep {
    /// The argument that reads `x`.
    fn arg(self, x: &Tensor) -> Arg<'_> {
        match self {
            Dep::Tensor => Arg::In(x),
            // SAFETY: a phase output read this way is written only by tasks that the barrier
            // follows (`order` adds the edge), and by no task submitted after it while this
            // one can run.
            Dep::After(_) => unsafe { Arg::untracked(x) },
        }
    }

    /// `t` ordered after the barrier, when there is one.
    fn order(self, t: Task) -> Task {
        match self {
            Dep::Tensor => t,
            Dep::After(b) => t.after(b),
        }
    }
}

/// A dummy task that completes when every task of `ids` has: consumers of a phase's output
/// wait on it instead of on each producer, so fan-in stays one edge per consumer.
fn barrier(o: &mut Orchestrator, ids: Vec<TaskId>) -> R<TaskId> {
    Ok(o.submit(Task::dummy().after_all(ids))?.id)
}

/// One projection as an SPMD task (golden: `matmul` and its row scaling):
/// `out (+)= acts @ w^T (* scale)`, each block writing its share of the output columns.
#[allow(clippy::too_many_arguments)]
fn gemm(
    o: &mut Orchestrator,
    acts: &Tensor,
    dep: Dep,
    w: &Tensor,
    blocks: u32,
    out: &Tensor,
    scale: Option<&Tensor>,
    kdim: usize,
    add: bool,
    w8a8: bool,
) -> R<TaskId> {
    let t = GemmArgs {
        acts: dep.arg(acts),
        // SAFETY: `w` is a weight matrix: written by no task during a run.
        w: unsafe { Arg::untracked(w) },
        out: if add { Arg::InOut(out) } else { Arg::Out(out) },
        scale: scale.map(Arg::In),
    }
    .push(Task::new(ops::GEMM_TILE));
    let t = dep
        .order(t)
        .blocks(blocks)
        .push_scalars(GemmScalars { k: kdim, add, w8a8 })
        .timing_slot(1);
    Ok(o.submit(t)?.id)
}

/// The MLP half of a layer (golden: `layer_step` from the post-attention norm on):
/// `m = norm(x)`; `act = bf16(silu(m @ Wg^T (* r2)) * (m @ Wu^T (* r2)))`; `x += act @ Wd^T`.
fn mlp_block(o: &mut Orchestrator, p: &StepPlan, w: &LayerViews, x: &Tensor) -> R<()> {
    let c = &p.config;
    let (h, inter) = (c.hidden_size, c.intermediate_size);
    let (m, r2) = norm(o, p, x, &w.post_norm)?;
    let act = o.alloc(DType::F32, &[p.rows as u64, packed_ld(inter) as u64])?;
    let act_cols = cols(o, &act, 0, inter)?;
    let task = GateUpArgs {
        acts: Arg::In(&m),
        // SAFETY: the gate and up weights: written by no task during a run.
        w_gate: unsafe { Arg::untracked(&w.w_gate) },
        // SAFETY: as above.
        w_up: unsafe { Arg::untracked(&w.w_up) },
        act: Arg::Out(&act_cols),
        scale: r2.as_ref().map(Arg::In),
    }
    .push(Task::new(ops::GATE_UP_SWIGLU))
    .blocks(p.blocks.gate_up);
    o.submit(
        task.push_scalars(GateUpScalars {
            hidden: h,
            intermediate: inter,
            w8a8: p.w8a8(),
        })
        .timing_slot(1),
    )?;
    gemm(
        o,
        &act,
        Dep::Tensor,
        &w.w_down,
        p.blocks.down,
        x,
        None,
        inter,
        true,
        p.w8a8(),
    )?;
    Ok(())
}

/// The attention half of a layer (golden: `layer_step` from the input norm to `h1`):
/// `n = norm(x)`; `q, k, v = n @ W^T (* r)`; q/k norm and RoPE at each token's position, the
/// bf16 K/V rows written through the slot mapping; attention over the paged cache into packed
/// `a = bf16(o)`; `x += a @ Wo^T`.
fn attention_block(
    o: &mut Orchestrator,
    p: &StepPlan,
    vw: &Views,
    w: &LayerViews,
    l: usize,
    x: &Tensor,
) -> R<()> {
    let c = &p.config;
    let qw = c.q_width();
    let r = p.rows as u64;

    // Input norm, the q/k/v projections, q/k norm and RoPE into bf16 Q, and the K/V rows
    // into this layer's pools.
    let (n, rs) = norm(o, p, x, &w.input_norm)?;
    let qb = o.alloc(DType::BF16, &[r, qw as u64])?;
    let kl = entry(o, &vw.k_cache, l)?;
    let vl = entry(o, &vw.v_cache, l)?;
    let kv_ready = qkv_rope_step(o, p, vw, w, &n, rs.as_ref(), &qb, [&kl, &vl])?;

    // Attention into packed activations for o_proj.
    let a = o.alloc(DType::F32, &[r, packed_ld(qw) as u64])?;
    let attn = match p.kind {
        StepKind::Decode => attention_decode(o, p, vw, &qb, &kl, &vl, &a, &kv_ready)?,
        StepKind::Prefill => attention_prefill(o, p, vw, &qb, &kl, &vl, &a, &kv_ready)?,
    };
    let attn_done = Dep::After(barrier(o, attn)?);

    // Residual: x += a @ Wo^T, in place.
    gemm(
        o,
        &a,
        attn_done,
        &w.wo,
        p.blocks.o,
        x,
        None,
        qw,
        true,
        p.w8a8(),
    )?;
    Ok(())
}

/// The q, k and v projections as one SPMD task (`GEMM_ROPE_STEP`), every block whole heads of
/// them, with their epilogues: q/k norm and RoPE of each row at the position its step entry
/// holds into bf16 Q and the K pool, the V rows into the V pool, at the entries' slots (so a
/// decode graph does not depend on positions or slots). Returns the task, which writes the
/// pools (Q is tracked by its tensor).
///
/// Prefill ran the projections as three tasks into fp32 q/k/v and then a q/k norm + RoPE task
/// per page run (until session 60): each core converted the same activations three times, the
/// products went to a scratch and were copied into the fp32 rows, which the RoPE tasks read
/// back from memory (8 MiB a layer at 512 rows), and a barrier ended each phase.
#[allow(clippy::too_many_arguments)]
fn qkv_rope_step(
    o: &mut Orchestrator,
    p: &StepPlan,
    vw: &Views,
    w: &LayerViews,
    n: &Tensor,
    rs: Option<&Tensor>,
    qb: &Tensor,
    [kl, vl]: [&Tensor; 2],
) -> R<Vec<TaskId>> {
    let c = &p.config;
    let t = GemmRopeArgs {
        acts: Arg::In(n),
        // SAFETY: `wq` is a weight matrix: written by no task during a run.
        wq: unsafe { Arg::untracked(&w.wq) },
        // SAFETY: as `wq`.
        wk: unsafe { Arg::untracked(&w.wk) },
        // SAFETY: as `wq`.
        wv: unsafe { Arg::untracked(&w.wv) },
        // SAFETY: a q/k norm weight: written by no task during a run.
        q_norm: unsafe { Arg::untracked(&w.q_norm) },
        // SAFETY: as `q_norm`.
        k_norm: unsafe { Arg::untracked(&w.k_norm) },
        // SAFETY: the RoPE tables: written by no task during a run.
        cos: unsafe { Arg::untracked(&vw.cos) },
        // SAFETY: the RoPE tables: written by no task during a run.
        sin: unsafe { Arg::untracked(&vw.sin) },
        // SAFETY: the step entries: written by no task during a run.
        step: unsafe { Arg::untracked(&vw.step) },
        q_out: Arg::Out(qb),
        k_out: Arg::Out(kl),
        v_out: Arg::Out(vl),
        scale: rs.map(Arg::In),
    }
    .push(Task::new(ops::GEMM_ROPE_STEP));
    // No more blocks than heads: a block's share is whole heads.
    let heads = c.num_attention_heads + 2 * c.num_key_value_heads;
    let blocks = match p.kind {
        StepKind::Decode => p.blocks.qkv,
        StepKind::Prefill => p
            .blocks
            .qkv_prefill(p.rows, heads * c.head_dim, p.qkv_scratch_bytes),
    };
    let blocks = blocks.clamp(1, u32::try_from(heads.max(1)).unwrap_or(u32::MAX));
    let t = t
        .blocks(blocks)
        .push_scalars(GemmRopeScalars {
            k: c.hidden_size,
            w8a8: p.w8a8(),
            eps: c.rms_norm_eps as f32,
        })
        .timing_slot(1);
    // Q is tracked by its tensor; the pools are read NoDep, so the attention waits on this.
    Ok(vec![o.submit(t)?.id])
}

/// Split-KV decode attention: per sequence one final task over every KV head, or one task per
/// KV chunk (partials of every head) and a combine.
#[allow(clippy::too_many_arguments)]
fn attention_decode(
    o: &mut Orchestrator,
    p: &StepPlan,
    vw: &Views,
    qb: &Tensor,
    kl: &Tensor,
    vl: &Tensor,
    a: &Tensor,
    kv_ready: &[TaskId],
) -> R<Vec<TaskId>> {
    let c = &p.config;
    let (d, group, qw, kv_heads) = (c.head_dim, c.group(), c.q_width(), c.num_key_value_heads);
    let mut writers = Vec::with_capacity(p.seqs.len());
    let set = kv_heads * partial_len(group, d);
    let n_partials: usize = p
        .kv_chunks
        .iter()
        .filter(|ch| ch.chunks > 1)
        .map(|ch| ch.chunks)
        .sum();
    let partials = if n_partials > 0 {
        Some(o.alloc(DType::F32, &[n_partials as u64, set as u64])?)
    } else {
        None
    };
    let mut next_partial = 0;
    for (i, (s, split)) in p.seqs.iter().zip(&p.kv_chunks).enumerate() {
        let b = s.row0;
        let qrow = rows(o, qb, b, b + 1)?;
        let table = rows(o, &vw.table, s.table_row, s.table_row + 1)?;
        let steps = &vw.step;
        let step = rows(o, steps, b, b + 1)?;
        let out = cols(o, &rows(o, a, b, b + 1)?, 0, qw)?;
        let n_chunks = split.chunks;
        let task = |chunk: usize, out: &Tensor| {
            AttnDecodeArgs {
                q: Arg::In(&qrow),
                // SAFETY: this layer's K/V rows are written by the k and v projection tasks
                // `kv_ready` names (the task runs after them), and by no later task of this
                // layer.
                k_pool: unsafe { Arg::untracked(kl) },
                // SAFETY: as for `k_pool`.
                v_pool: unsafe { Arg::untracked(vl) },
                // SAFETY: the block table: written by no task during a run.
                table: unsafe { Arg::untracked(&table) },
                // SAFETY: the step entries: written by no task during a run.
                step: unsafe { Arg::untracked(&step) },
                out: Arg::Out(out),
            }
            .push(Task::new(ops::ATTN_DECODE))
            .after_all(kv_ready.iter().copied())
            .push_scalars(AttnDecodeScalars {
                chunk,
                chunks: n_chunks,
                short: split.short,
                scale: c.attn_scale(),
                page: p.page_size,
                head_dim: d,
            })
            .timing_slot(1)
        };
        match (n_chunks, &partials) {
            (1, _) => {
                writers.push(o.submit(task(0, &out))?.id);
            }
            (_, Some(parts)) => {
                // One SPMD task: block `c` computes chunk `c` into partial row `c`. A task per
                // chunk cost a submission (replayed or not) and a dispatch each: ~450 of a
                // 4 × 1024 step's ~1000 tasks.
                let p0 = next_partial;
                next_partial += n_chunks;
                let mine = rows(o, parts, p0, next_partial)?;
                let blocks = u32::try_from(n_chunks)
                    .map_err(|_| o.fatal("qwen3 orchestration: KV chunks past u32"))?;
                o.submit(task(0, &mine).blocks(blocks))?;
                let t = AttnCombineArgs {
                    partials: Arg::In(&mine),
                    out: Arg::Out(&out),
                }
                .push(Task::new(ops::ATTN_COMBINE));
                // The first sequence's chunks run last (`TilePolicy::kv_splits`), so its
                // combine ends the phase with the other cores idle: it is split over the KV
                // heads (where a head's columns are whole 16-column blocks of the packed row,
                // so each block's share of it is its own). The others overlap the later chunks
                // and stay one block each.
                let blocks = if i == 0 && (group * d).is_multiple_of(PACK_BLOCK) {
                    p.small_task_blocks.clamp(1, kv_heads.max(1))
                } else {
                    1
                };
                let id = o.submit(
                    t.push_scalars(AttnCombineScalars {
                        kv_heads,
                        group,
                        head_dim: d,
                    })
                    .blocks(u32::try_from(blocks).unwrap_or(u32::MAX))
                    .timing_slot(1),
                )?;
                writers.push(id.id);
            }
            (_, None) => return Err(o.fatal("qwen3 orchestration: split KV without partials")),
        }
    }
    Ok(writers)
}

/// Causal prefill attention per (sequence, KV head, block of rows).
#[allow(clippy::too_many_arguments)]
fn attention_prefill(
    o: &mut Orchestrator,
    p: &StepPlan,
    vw: &Views,
    qb: &Tensor,
    kl: &Tensor,
    vl: &Tensor,
    a: &Tensor,
    kv_ready: &[TaskId],
) -> R<Vec<TaskId>> {
    let c = &p.config;
    let (d, group, qw) = (c.head_dim, c.group(), c.q_width());
    let block = p.prefill_rows.max(1);
    let mut writers = Vec::new();
    for s in &p.seqs {
        let table = rows(o, &vw.table, s.table_row, s.table_row + 1)?;
        for g in 0..c.num_key_value_heads {
            let c0 = g * group * d;
            let mut i = 0;
            while i < s.n_rows {
                let n = block.min(s.n_rows - i);
                let (r0, r1) = (s.row0 + i, s.row0 + i + n);
                let out = cols(o, &rows(o, a, r0, r1)?, c0, c0 + group * d)?;
                let q = rows(o, qb, r0, r1)?;
                let t = AttnPrefillArgs {
                    q: Arg::In(&q),
                    // SAFETY: this layer's K/V rows are written by the q/k/v task in `kv_ready`
                    // (this task runs after it), and by no later task of this layer.
                    k_pool: unsafe { Arg::untracked(kl) },
                    // SAFETY: as for `k_pool`.
                    v_pool: unsafe { Arg::untracked(vl) },
                    // SAFETY: the block table: written by no task during a run.
                    table: unsafe { Arg::untracked(&table) },
                    out: Arg::Out(&out),
                }
                .push(Task::new(ops::ATTN_PREFILL));
                let id = o.submit(
                    t.after_all(kv_ready.iter().copied())
                        .push_scalars(AttnPrefillScalars {
                            kv_head: g,
                            first_pos: s.first_pos() + i,
                            scale: c.attn_scale(),
                            page: p.page_size,
                            c0,
                            q_width: qw,
                            head_dim: d,
                        })
                        .timing_slot(1),
                )?;
                writers.push(id.id);
                i += n;
            }
        }
    }
    Ok(writers)
}

/// One layer's weights (weight set `set` of the bound `[sets, ...]` tensors), by name.
struct LayerViews {
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    input_norm: Tensor,
    post_norm: Tensor,
}

impl LayerViews {
    fn of(o: &Orchestrator, vw: &Views, set: usize) -> R<LayerViews> {
        // `Views::layer` follows `LayerWeights::shapes`' order.
        let [
            wq,
            wk,
            wv,
            wo,
            w_gate,
            w_up,
            w_down,
            q_norm,
            k_norm,
            input_norm,
            post_norm,
        ]: [Tensor; 11] = vw
            .layer
            .iter()
            .map(|t| entry(o, t, set))
            .collect::<R<Vec<Tensor>>>()?
            .try_into()
            .map_err(|v: Vec<Tensor>| {
                o.fatal(format!(
                    "qwen3 orchestration: {} layer tensors, expected 11",
                    v.len()
                ))
            })?;
        Ok(LayerViews {
            wq,
            wk,
            wv,
            wo,
            w_gate,
            w_up,
            w_down,
            q_norm,
            k_norm,
            input_norm,
            post_norm,
        })
    }
}

/// One decoder layer, in place on the residual `x` (golden: `layer_step`):
/// `x = x + attention(norm(x))`, then `x = x + mlp(norm(x))`.
fn layer(o: &mut Orchestrator, p: &StepPlan, vw: &Views, l: usize, x: &Tensor) -> R<()> {
    let w = LayerViews::of(o, vw, p.set_of_layer[l])?;
    attention_block(o, p, vw, &w, l, x)?;
    mlp_block(o, p, &w, x)
}

/// Heap bytes one ring needs for a prefill step of `rows` token rows: everything one layer's
/// scope allocates (the step's largest scope: `attention_block` and `mlp_block` of a
/// prefill), each padded as the runtime pads an output. A scope's allocations stay until it
/// closes, so a heap smaller than this cannot run the step (the runtime reports a heap
/// deadlock); the step's own `x` and the head's rows are in other scopes and far smaller.
/// Decode steps allocate about as much a row (their attention partials are small).
pub fn prefill_heap_bytes(c: &Qwen3Config, rows: usize) -> u64 {
    let (h, qw) = (c.hidden_size, c.q_width());
    let r = rows as u64;
    let padded = |bytes: u64| bytes.div_ceil(OUTPUT_ALIGN) * OUTPUT_ALIGN;
    let f32s = |cols: usize| padded(r.saturating_mul(cols as u64).saturating_mul(4));
    [
        f32s(packed_ld(h)),                                    // input norm, packed
        padded(r.saturating_mul(qw as u64).saturating_mul(2)), // bf16 Q
        f32s(packed_ld(qw)),                                   // attention output, packed
        f32s(packed_ld(h)),                                    // post-attention norm, packed
        f32s(packed_ld(c.intermediate_size)),                  // MLP activations, packed
    ]
    .iter()
    .fold(0u64, |a, &b| a.saturating_add(b))
}

/// Submits one step (golden: `decode_model`, `decode_layers_bf16`, `prefill_model`): the
/// embedding gather (or the bf16 hidden input), each layer in its own scope, then the head
/// (or the bf16 hidden output).
pub(crate) fn step(o: &mut Orchestrator, args: &RunArgs, p: &StepPlan) -> R<()> {
    let vw = bind_all(o, args, p)?;
    let c = &p.config;
    let (r, h) = (p.rows as u64, c.hidden_size as u64);
    let x = o.alloc(DType::F32, &[r, h])?;
    match p.variant {
        Variant::Model => {
            let ids = o.bind(&args.buffers[io::INPUT], DType::U32, &[r])?;
            let t = EmbedArgs {
                // SAFETY: the embedding table: written by no task during a run.
                table: unsafe { Arg::untracked(&vw.embedding) },
                ids: Arg::In(&ids),
                x: Arg::Out(&x),
            }
            .push(Task::new(ops::EMBED));
            o.submit(t.timing_slot(0))?;
        }
        Variant::Layers => {
            let hin = o.bind(&args.buffers[io::INPUT], DType::BF16, &[r, h])?;
            let t = CastArgs {
                src: Arg::In(&hin),
                dst: Arg::Out(&x),
            }
            .push(Task::new(ops::CAST_BF16_F32));
            o.submit(t.timing_slot(0))?;
        }
    }
    for l in p.layers.clone() {
        o.scope(ScopeKind::Auto, |o| layer(o, p, &vw, l, &x))?;
    }
    o.scope(ScopeKind::Auto, |o| match p.variant {
        Variant::Model => head(o, args, p, &vw, &x),
        Variant::Layers => {
            let hout = o.bind(&args.buffers[io::OUT_MAIN], DType::BF16, &[r, h])?;
            let t = CastArgs {
                src: Arg::In(&x),
                dst: Arg::Out(&hout),
            }
            .push(Task::new(ops::CAST_F32_BF16));
            o.submit(t.timing_slot(2))?;
            Ok(())
        }
    })
}

/// Final norm, LM head and greedy argmax for each sequence's last row (golden: `head`).
fn head(o: &mut Orchestrator, args: &RunArgs, p: &StepPlan, vw: &Views, x: &Tensor) -> R<()> {
    let c = &p.config;
    let (h, vocab) = (c.hidden_size as u64, c.vocab_size as u64);
    let n_seqs = p.seqs.len();
    let s = n_seqs as u64;
    let hidden = o.bind(&args.buffers[io::OUT_HIDDEN], DType::F32, &[s, h])?;
    for (i, q) in p.seqs.iter().enumerate() {
        let last = q.row0 + q.n_rows - 1;
        let (src, dst) = (rows(o, x, last, last + 1)?, rows(o, &hidden, i, i + 1)?);
        let t = CastArgs {
            src: Arg::In(&src),
            dst: Arg::Out(&dst),
        }
        .push(Task::new(ops::COPY_F32));
        o.submit(t.timing_slot(2))?;
    }
    let t = NormArgs {
        x: Arg::In(&hidden),
        // SAFETY: the final norm weight: written by no task during a run.
        g: unsafe { Arg::untracked(&vw.final_norm) },
        packed: Arg::New(DType::F32, vec![s, packed_ld(c.hidden_size) as u64]),
    }
    .push(Task::new(ops::RMS_NORM));
    let nrm = o
        .submit(
            t.push_scalars(NormScalars {
                eps: c.rms_norm_eps as f32,
            })
            .timing_slot(2),
        )?
        .output(0);
    let logits = o.bind(&args.buffers[io::OUT_MAIN], DType::F32, &[s, vocab])?;
    let blocks = p.blocks.lm_head;
    let best = o.alloc(DType::U32, &[u64::from(blocks), s, 2])?;
    // One SPMD task: each block takes a share of the vocabulary rows and writes its logits
    // columns and its argmax slot.
    let t = LmHeadArgs {
        acts: Arg::In(&nrm),
        // SAFETY: the LM head weight: written by no task during a run.
        w: unsafe { Arg::untracked(&vw.lm_head) },
        logits: Arg::Out(&logits),
        best: Arg::Out(&best),
    }
    .push(Task::new(ops::LM_HEAD_TILE));
    o.submit(
        t.push_scalars(LmHeadScalars {
            hidden: h as usize,
            // The LM head keeps fp32 activations even under W8A8: one outlier in the final
            // normed row coarsens every other element's int8 step, and the logits of the CLI's
            // spec fixture then left the stack tolerance (0.36 off at a logit of 1.1), where
            // the wide product met it (`docs/qwen3.md`, "int8 weights").
            w8a8: false,
        })
        .blocks(blocks)
        .timing_slot(2),
    )?;
    let ids = o.bind(&args.buffers[io::OUT_IDS], DType::U32, &[s])?;
    let t = ArgmaxArgs {
        best: Arg::In(&best),
        ids: Arg::Out(&ids),
    }
    .push(Task::new(ops::ARGMAX_COMBINE));
    o.submit(t.timing_slot(2))?;
    Ok(())
}
