//! The independent fp32 golden reference (`docs/qwen3.md`: the decode step, prefill, tolerances):
//! plain loops that follow the spec's bf16 cast points exactly and call no kernel library.
//! It returns the hidden output and every layer's K/V cache writes, and holds the spec's
//! tolerance checks.
//!
//! Work is spread with `std::thread::scope` over output rows (projections) and
//! `(sequence, KV head)` pairs (attention), with the thread count sized to the work (at most
//! 8 threads, and one for anything under ~1 MFLOP) — never one thread per tiny operation.

mod tolerance;

use half::bf16;

use super::config::Qwen3Config;
use super::quant::{Int8Acts, WeightFormat};
use super::rope::RopeTables;
use super::weights::{KvCache, LayerWeights, PagedBatch, ProjectionElem, Qwen3Weights};

pub use tolerance::{Agreement, Int8Agreement, NearTie, Tolerance, check_argmax, describe_argmax};

/// `bf16(x)` as an f32 (round to nearest even).
fn rb(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// One layer's K/V rows written by a step: `[tokens, kv_heads * head_dim]` each, in the order
/// of the step's tokens (decode: one per sequence; prefill: token-major packed).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerKvWrite {
    /// Pool slot of each token.
    pub slots: Vec<usize>,
    /// Roped, bf16 K rows.
    pub k: Vec<bf16>,
    /// bf16 V rows.
    pub v: Vec<bf16>,
}

/// What a decode over some layers produced.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeOutput {
    /// fp32 hidden state after the last layer `[batch, hidden]`.
    pub hidden: Vec<f32>,
    /// Every layer's K/V writes, in layer order.
    pub kv_writes: Vec<LayerKvWrite>,
}

/// What a full-model step produced.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelOutput {
    /// fp32 logits `[rows, vocab]` (decode: one row per sequence; prefill: each sequence's
    /// last token).
    pub logits: Vec<f32>,
    /// Greedy next token per row (argmax, ties to the lowest index).
    pub next_tokens: Vec<u32>,
    /// fp32 hidden state after the last layer (same rows as `logits`).
    pub hidden: Vec<f32>,
    /// Every layer's K/V writes.
    pub kv_writes: Vec<LayerKvWrite>,
}

/// Runs `f(i)` for every `i in 0..n` on a thread count sized to `flops_per_item * n`, each
/// thread owning a contiguous run of items and the matching `out` chunks (`out_per_item`
/// elements per item).
fn par_items<T: Send>(
    n: usize,
    flops_per_item: usize,
    out: &mut [T],
    out_per_item: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let total = n.saturating_mul(flops_per_item);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = (total / (1 << 20)).clamp(1, cores.min(8)).min(n.max(1));
    if threads <= 1 {
        for (i, o) in out.chunks_mut(out_per_item.max(1)).enumerate().take(n) {
            f(i, o);
        }
        return;
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        for (t, chunk) in out.chunks_mut(per * out_per_item).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (j, o) in chunk.chunks_mut(out_per_item).enumerate() {
                    f(t * per + j, o);
                }
            });
        }
    });
}

/// `y[b, o] = sum_i x[b, i] * w[o, i]` with `w` `[n, k]` bf16 (`[out, in]`), x fp32 rows
/// holding bf16 values. Returns `[rows, n]`.
fn matmul<W: Copy + Into<f32> + Sync>(
    x: &[f32],
    rows: usize,
    w: &[W],
    n: usize,
    k: usize,
) -> Vec<f32> {
    // Computed transposed ([n, rows]) so each thread owns whole weight rows.
    let mut yt = vec![0.0f32; n * rows];
    par_items(n, 2 * k * rows, &mut yt, rows, |o, dst| {
        let wrow: Vec<f32> = w[o * k..(o + 1) * k].iter().map(|&v| v.into()).collect();
        for (b, d) in dst.iter_mut().enumerate() {
            *d = dot(&x[b * k..(b + 1) * k], &wrow);
        }
    });
    let mut y = vec![0.0f32; rows * n];
    for o in 0..n {
        for b in 0..rows {
            y[b * n + o] = yt[o * rows + b];
        }
    }
    y
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// RMSNorm of every `h`-wide row of `x` with weight `g`, rounded to bf16: `bf16(x*g)` with
/// each row's `1/rms` returned apart (deferred), or `bf16(x/rms*g)` with unit scales.
fn norm_rows(x: &[f32], h: usize, g: &[f32], eps: f32, mode: NormMode) -> (Vec<f32>, Vec<f32>) {
    let rows = x.len() / h;
    let mut r = vec![1.0f32; rows];
    let mut n = vec![0.0f32; rows * h];
    for t in 0..rows {
        let xr = &x[t * h..(t + 1) * h];
        let inv = inv_rms(xr, eps);
        for i in 0..h {
            n[t * h + i] = match mode {
                NormMode::Deferred => rb(xr[i] * g[i]),
                NormMode::Ordinary => rb(xr[i] * inv * g[i]),
            };
        }
        if mode == NormMode::Deferred {
            r[t] = inv;
        }
    }
    (n, r)
}

/// `1/sqrt(mean(x²) + eps)`.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let s: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (s / x.len() as f32 + eps).sqrt()
}

/// Per-head RMSNorm then NeoX RoPE at `pos`, in place on one token's `heads * head_dim`.
fn norm_rope(x: &mut [f32], w: &[f32], eps: f32, rope: &RopeTables, pos: usize) {
    let d = w.len();
    let (cos, sin) = rope.row(pos);
    let half = d / 2;
    for head in x.chunks_exact_mut(d) {
        let r = inv_rms(head, eps);
        let t: Vec<f32> = head.iter().zip(w).map(|(v, g)| v * r * g).collect();
        for i in 0..half {
            head[i] = t[i] * cos[i] - t[i + half] * sin[i];
            head[i + half] = t[i + half] * cos[i + half] + t[i] * sin[i + half];
        }
    }
}

/// Softmax attention of one query head (bf16 values in f32) over the given K/V rows.
fn attend_one(q: &[f32], keys: &[&[bf16]], values: &[&[bf16]], scale: f32) -> Vec<f32> {
    let d = q.len();
    let s: Vec<f32> = keys
        .iter()
        .map(|k| {
            q.iter()
                .zip(k.iter())
                .map(|(a, b)| a * b.to_f32())
                .sum::<f32>()
                * scale
        })
        .collect();
    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let p: Vec<f32> = s.iter().map(|v| (v - m).exp()).collect();
    let l: f32 = p.iter().sum();
    let mut o = vec![0.0f32; d];
    for (pi, v) in p.iter().zip(values) {
        for (a, b) in o.iter_mut().zip(v.iter()) {
            *a += pi * b.to_f32();
        }
    }
    o.iter_mut().for_each(|a| *a /= l);
    o
}

/// What the projections multiply their weights by: the activations as they are, or (an int8
/// W8A8 model, `qwen3::quant`) each row quantised symmetrically to 127 steps of its largest
/// magnitude, `round(x · fl(127 / max|x|))` with ties to even, and taken back to fp32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acts {
    /// fp32 (bf16-rounded where the step rounds them).
    Float,
    /// Per-row int8, as a W8A8 model computes.
    PerRowInt8,
}

impl Acts {
    /// What the projections of a model in `format` multiply.
    pub fn of(format: WeightFormat) -> Acts {
        if format == WeightFormat::Int8(Int8Acts::Quantised) {
            Acts::PerRowInt8
        } else {
            Acts::Float
        }
    }

    /// `x` (rows of `width`) as the projections see them.
    fn apply(self, mut x: Vec<f32>, width: usize) -> Vec<f32> {
        if self == Acts::PerRowInt8 {
            for row in x.chunks_exact_mut(width.max(1)) {
                let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                if amax == 0.0 {
                    continue;
                }
                // The model's rule, to the last bit: each value times the fp32 `127 / max|x|`,
                // rounded half to even. Products land exactly halfway often enough to matter
                // (the activations are bf16): computing `x · 127 / max|x|` instead, or rounding
                // ties away from zero, flipped an int8 step in some rows, which moved the
                // K rows of one layer of the 0.6B preset at batch 4 past the one-layer
                // tolerance.
                let step = amax / 127.0;
                for v in row.iter_mut() {
                    *v = (*v * (127.0 / amax)).round_ties_even().clamp(-127.0, 127.0) * step;
                }
            }
        }
        x
    }
}

/// How a step normalises: decode defers `1/rms` past the projections, prefill does not.
#[derive(Clone, Copy, PartialEq, Eq)]
enum NormMode {
    Deferred,
    Ordinary,
}

/// One token of a layer step: where it is and how long its sequence is at that point.
struct TokenPos {
    /// Sequence index (block-table row).
    seq: usize,
    /// Position (0-based); the token attends to `0..=pos`.
    pos: usize,
}

/// One layer over `tokens` (rows of `x`, fp32 `[T, hidden]`), writing each token's K/V to
/// its slot before any attention (so chunk tokens see each other causally).
#[allow(clippy::too_many_arguments)]
fn layer_step<W: ProjectionElem>(
    c: &Qwen3Config,
    w: &LayerWeights<W>,
    layer: usize,
    kv: &mut KvCache,
    batch: &PagedBatch,
    rope: &RopeTables,
    x: &[f32],
    tokens: &[TokenPos],
    mode: NormMode,
    acts: Acts,
) -> (Vec<f32>, LayerKvWrite) {
    let (h, t_n, d) = (c.hidden_size, tokens.len(), c.head_dim);
    let (qw, kvw, inter) = (c.q_width(), c.kv_width(), c.intermediate_size);
    let eps = c.rms_norm_eps as f32;
    // Input norm: n = bf16(x*g) with r deferred, or bf16(x*r*g).
    let (n, r) = norm_rows(x, h, &w.input_norm, eps, mode);
    let n = acts.apply(n, h);
    let scale_rows = |y: &mut [f32], width: usize, s: &[f32]| {
        for (row, &sv) in y.chunks_exact_mut(width).zip(s) {
            row.iter_mut().for_each(|v| *v *= sv);
        }
    };
    let mut q = matmul(&n, t_n, &w.wq, qw, h);
    let mut k = matmul(&n, t_n, &w.wk, kvw, h);
    let mut v = matmul(&n, t_n, &w.wv, kvw, h);
    scale_rows(&mut q, qw, &r);
    scale_rows(&mut k, kvw, &r);
    scale_rows(&mut v, kvw, &r);
    // q/k norm, RoPE at each token's position, bf16.
    for (t, tp) in tokens.iter().enumerate() {
        norm_rope(&mut q[t * qw..(t + 1) * qw], &w.q_norm, eps, rope, tp.pos);
        norm_rope(&mut k[t * kvw..(t + 1) * kvw], &w.k_norm, eps, rope, tp.pos);
    }
    let qb: Vec<f32> = q.iter().map(|&v| rb(v)).collect();
    let kb: Vec<bf16> = k.iter().map(|&v| bf16::from_f32(v)).collect();
    let vb: Vec<bf16> = v.iter().map(|&v| bf16::from_f32(v)).collect();
    // Paged KV write through the slot mapping.
    let slots: Vec<usize> = tokens.iter().map(|tp| batch.slot(tp.seq, tp.pos)).collect();
    {
        let (kp, vp) = kv.layer_mut(layer);
        for (t, &s) in slots.iter().enumerate() {
            kp[s * kvw..(s + 1) * kvw].copy_from_slice(&kb[t * kvw..(t + 1) * kvw]);
            vp[s * kvw..(s + 1) * kvw].copy_from_slice(&vb[t * kvw..(t + 1) * kvw]);
        }
    }
    // GQA attention over each token's visible cache; a = bf16(o). Items: (token, kv head).
    let group = c.group();
    let kv_heads = c.num_key_value_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut a = vec![0.0f32; t_n * qw];
    let kpool = kv.layer_k(layer);
    let vpool = kv.layer_v(layer);
    let avg_len = tokens.iter().map(|tp| tp.pos + 1).sum::<usize>() / t_n.max(1);
    par_items(
        t_n * kv_heads,
        4 * group * d * avg_len.max(1),
        &mut a,
        group * d,
        |item, dst| {
            let (t, g) = (item / kv_heads, item % kv_heads);
            let tp = &tokens[t];
            let slots: Vec<usize> = (0..=tp.pos).map(|p| batch.slot(tp.seq, p)).collect();
            let keys: Vec<&[bf16]> = slots
                .iter()
                .map(|&s| &kpool[s * kvw + g * d..s * kvw + (g + 1) * d])
                .collect();
            let values: Vec<&[bf16]> = slots
                .iter()
                .map(|&s| &vpool[s * kvw + g * d..s * kvw + (g + 1) * d])
                .collect();
            for j in 0..group {
                let hq = g * group + j;
                let o = attend_one(
                    &qb[t * qw + hq * d..t * qw + (hq + 1) * d],
                    &keys,
                    &values,
                    scale,
                );
                for (dd, ov) in dst[j * d..(j + 1) * d].iter_mut().zip(o) {
                    *dd = rb(ov);
                }
            }
        },
    );
    // h1 = x + a @ Wo.
    let a = acts.apply(a, qw);
    let ao = matmul(&a, t_n, &w.wo, h, qw);
    let h1: Vec<f32> = x.iter().zip(&ao).map(|(a, b)| a + b).collect();
    // Post-attention norm, SwiGLU, down projection.
    let (m, r2) = norm_rows(&h1, h, &w.post_norm, eps, mode);
    let m = acts.apply(m, h);
    let mut gt = matmul(&m, t_n, &w.w_gate, inter, h);
    let mut up = matmul(&m, t_n, &w.w_up, inter, h);
    scale_rows(&mut gt, inter, &r2);
    scale_rows(&mut up, inter, &r2);
    let act: Vec<f32> = gt
        .iter()
        .zip(&up)
        .map(|(&g, &u)| rb(g * (1.0 / (1.0 + (-g).exp())) * u))
        .collect();
    let act = acts.apply(act, inter);
    let down = matmul(&act, t_n, &w.w_down, h, inter);
    let out = h1.iter().zip(&down).map(|(a, b)| a + b).collect();
    (
        out,
        LayerKvWrite {
            slots,
            k: kb,
            v: vb,
        },
    )
}

/// Decode step through `layers` (indices into the model's layers): `x` fp32 `[batch, hidden]`
/// in, the new token of sequence `b` at position `seq_lens[b] - 1`; writes each layer's new
/// K/V into `kv` and returns the hidden output and the writes.
pub fn decode_layers<W: ProjectionElem>(
    weights: &Qwen3Weights<W>,
    layers: std::ops::Range<usize>,
    kv: &mut KvCache,
    batch: &PagedBatch,
    rope: &RopeTables,
    x: &[f32],
) -> DecodeOutput {
    decode_layers_as(weights, layers, kv, batch, rope, x, Acts::Float)
}

/// [`decode_layers`] with the projections multiplying `acts`.
pub fn decode_layers_as<W: ProjectionElem>(
    weights: &Qwen3Weights<W>,
    layers: std::ops::Range<usize>,
    kv: &mut KvCache,
    batch: &PagedBatch,
    rope: &RopeTables,
    x: &[f32],
    acts: Acts,
) -> DecodeOutput {
    let tokens: Vec<TokenPos> = batch
        .seq_lens
        .iter()
        .enumerate()
        .map(|(seq, &len)| TokenPos { seq, pos: len - 1 })
        .collect();
    let mut hidden = x.to_vec();
    let mut kv_writes = Vec::new();
    for l in layers {
        let (next, wr) = layer_step(
            &weights.config,
            &weights.layers[l],
            l,
            kv,
            batch,
            rope,
            &hidden,
            &tokens,
            NormMode::Deferred,
            acts,
        );
        hidden = next;
        kv_writes.push(wr);
    }
    DecodeOutput { hidden, kv_writes }
}

/// The fixture-compatible layers-chunk variant: bf16 hidden in, bf16 out, fp32 carried
/// between the layers and rounded once at the end.
pub fn decode_layers_bf16<W: ProjectionElem>(
    weights: &Qwen3Weights<W>,
    layers: std::ops::Range<usize>,
    kv: &mut KvCache,
    batch: &PagedBatch,
    rope: &RopeTables,
    hidden: &[bf16],
) -> (Vec<bf16>, Vec<LayerKvWrite>) {
    let x: Vec<f32> = hidden.iter().map(|v| v.to_f32()).collect();
    let out = decode_layers(weights, layers, kv, batch, rope, &x);
    (
        out.hidden.iter().map(|&v| bf16::from_f32(v)).collect(),
        out.kv_writes,
    )
}

/// Final ordinary RMSNorm, LM head (fp32 logits) and greedy argmax over `rows` rows of `x`.
fn head<W: ProjectionElem>(
    weights: &Qwen3Weights<W>,
    x: &[f32],
    rows: usize,
) -> (Vec<f32>, Vec<u32>) {
    let c = &weights.config;
    let logits = head_logits(c, &weights.final_norm, &weights.lm_head_rows(), x, rows);
    let next = logits.chunks_exact(c.vocab_size).map(argmax).collect();
    (logits, next)
}

/// The final ordinary RMSNorm of `rows` rows of `x` and their fp32 logits over the LM-head
/// rows `lm_rows` (`[n, hidden]`, a slice of the vocabulary or all of it): `[rows, n]`.
/// Checks that cannot hold the whole LM head call it slice by slice.
pub fn head_logits<W: Copy + Into<f32> + Sync>(
    c: &Qwen3Config,
    final_norm: &[f32],
    lm_rows: &[W],
    x: &[f32],
    rows: usize,
) -> Vec<f32> {
    let h = c.hidden_size;
    let eps = c.rms_norm_eps as f32;
    let mut n = vec![0.0f32; rows * h];
    for t in 0..rows {
        let xr = &x[t * h..(t + 1) * h];
        let inv = inv_rms(xr, eps);
        for i in 0..h {
            n[t * h + i] = rb(xr[i] * inv * final_norm[i]);
        }
    }
    matmul(&n, rows, lm_rows, lm_rows.len() / h.max(1), h)
}

/// One decode layer with weights `w` on a one-layer cache `kv` (that layer's pool): the new
/// token of sequence `b` at position `seq_lens[b] - 1`. Checks that hold one pool at a time
/// (layers whose caches do not fit the host together) call it layer by layer. `acts` says
/// what the projections multiply (an int8 W8A8 model's per-row int8 activations, or fp32).
///
/// # Panics
/// If `kv` holds more than one layer.
#[allow(clippy::too_many_arguments)]
pub fn decode_layer<W: ProjectionElem>(
    c: &Qwen3Config,
    w: &LayerWeights<W>,
    kv: &mut KvCache,
    batch: &PagedBatch,
    rope: &RopeTables,
    x: &[f32],
    acts: Acts,
) -> (Vec<f32>, LayerKvWrite) {
    assert_eq!(kv.layers, 1, "decode_layer takes a one-layer cache");
    let tokens: Vec<TokenPos> = batch
        .seq_lens
        .iter()
        .enumerate()
        .map(|(seq, &len)| TokenPos { seq, pos: len - 1 })
        .collect();
    layer_step(
        c,
        w,
        0,
        kv,
        batch,
        rope,
        x,
        &tokens,
        NormMode::Deferred,
        acts,
    )
}

/// Argmax with ties to the lowest index (NaNs never win).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > bv {
            best = i;
            bv = v;
        }
    }
    best as u32
}

/// Full-model decode step: embedding gather of `tokens` (one per sequence, at position
/// `seq_lens[b] - 1`), every layer, final norm, LM head, argmax.
pub fn decode_model<W: ProjectionElem>(
    weights: &Qwen3Weights<W>,
    kv: &mut KvCache,
    batch: &PagedBatch,
    rope: &RopeTables,
    tokens: &[u32],
) -> ModelOutput {
    decode_model_as(weights, kv, batch, rope, tokens, Acts::Float)
}

/// [`decode_model`] with the projections multiplying `acts` (the LM head's activations stay
/// fp32, as an int8 model keeps them).
pub fn decode_model_as<W: ProjectionElem>(
    weights: &Qwen3Weights<W>,
    kv: &mut KvCache,
    batch: &PagedBatch,
    rope: &RopeTables,
    tokens: &[u32],
    acts: Acts,
) -> ModelOutput {
    let c = &weights.config;
    let x = embed(weights, tokens);
    let out = decode_layers_as(weights, 0..c.num_hidden_layers, kv, batch, rope, &x, acts);
    let (logits, next_tokens) = head(weights, &out.hidden, tokens.len());
    ModelOutput {
        logits,
        next_tokens,
        hidden: out.hidden,
        kv_writes: out.kv_writes,
    }
}

fn embed<W>(weights: &Qwen3Weights<W>, tokens: &[u32]) -> Vec<f32> {
    let h = weights.config.hidden_size;
    tokens
        .iter()
        .flat_map(|&t| {
            weights.embedding[t as usize * h..(t as usize + 1) * h]
                .iter()
                .map(|v| v.to_f32())
        })
        .collect()
}

/// One sequence's chunk in a prefill step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillChunk {
    /// Block-table row (index into the batch).
    pub seq: usize,
    /// The chunk's token ids; the chunk ends at `seq_len` tokens.
    pub tokens: Vec<u32>,
    /// Sequence length after the chunk (cached prefix + chunk).
    pub seq_len: usize,
}

/// Chunked causal prefill: token-major packed chunks (the cached prefix of each sequence is
/// already in `kv`), ordinary RMSNorm, every chunk token's K/V written, logits for each
/// sequence's last token. `batch` supplies the block tables (its `seq_lens` are not used).
pub fn prefill_model<W: ProjectionElem>(
    weights: &Qwen3Weights<W>,
    kv: &mut KvCache,
    batch: &PagedBatch,
    rope: &RopeTables,
    chunks: &[PrefillChunk],
) -> ModelOutput {
    let c = &weights.config;
    let h = c.hidden_size;
    let mut tokens = Vec::new();
    let mut ids = Vec::new();
    let mut last_rows = Vec::new();
    for ch in chunks {
        let start = ch.seq_len - ch.tokens.len();
        for (i, &id) in ch.tokens.iter().enumerate() {
            tokens.push(TokenPos {
                seq: ch.seq,
                pos: start + i,
            });
            ids.push(id);
        }
        last_rows.push(tokens.len() - 1);
    }
    let mut x = embed(weights, &ids);
    let mut kv_writes = Vec::new();
    for l in 0..c.num_hidden_layers {
        let (next, wr) = layer_step(
            c,
            &weights.layers[l],
            l,
            kv,
            batch,
            rope,
            &x,
            &tokens,
            NormMode::Ordinary,
            Acts::Float,
        );
        x = next;
        kv_writes.push(wr);
    }
    let last: Vec<f32> = last_rows
        .iter()
        .flat_map(|&t| x[t * h..(t + 1) * h].iter().copied())
        .collect();
    let (logits, next_tokens) = head(weights, &last, last_rows.len());
    ModelOutput {
        logits,
        next_tokens,
        hidden: last,
        kv_writes,
    }
}

#[cfg(test)]
mod tests {
    use super::Acts;

    /// W8A8 rounds `x · 127 / max|x|` with ties to even, as the kernels' `quantize_row_i8`
    /// does: with a largest magnitude of 127/64, `k/128` lands on `k/2` exactly.
    #[test]
    fn per_row_int8_rounds_ties_to_even() {
        let amax = 127.0 / 64.0;
        let step = amax / 127.0;
        let row = vec![
            amax,
            1.0 / 128.0,
            3.0 / 128.0,
            -5.0 / 128.0,
            7.0 / 128.0,
            0.0,
        ];
        let got = Acts::PerRowInt8.apply(row, 6);
        let want: Vec<f32> = [127.0, 0.0, 2.0, -2.0, 4.0, 0.0]
            .iter()
            .map(|q| q * step)
            .collect();
        assert_eq!(got, want);
        // Away from ties, plain rounding; an all-zero row stays zero.
        let got = Acts::PerRowInt8.apply(vec![1.0, 0.3, -0.7, 0.0, 0.0, 0.0], 3);
        assert_eq!(
            got,
            vec![
                1.0,
                (0.3f32 * 127.0).round() / 127.0,
                -89.0 / 127.0,
                0.0,
                0.0,
                0.0
            ]
        );
    }
}
