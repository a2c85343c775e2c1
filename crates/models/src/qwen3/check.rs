//! Checking a runtime decode step against the golden with one KV pool on the host at a time,
//! so shapes whose cache fills most of the machine (Qwen3-14B, batch 16, 40 layers) can still
//! be checked: the golden runs layer by layer on a one-layer cache rebuilt from the fixture's
//! pools, and the LM head is read back slice by slice.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;

use super::config::Qwen3Config;
use super::golden::{self, LayerKvWrite, Tolerance};
use super::quant::{Int8Acts, WeightFormat};
use super::rope::RopeTables;
use super::weights::{KvCache, LayerWeights, PagedBatch, ProjectionElem};

/// Where the streamed golden gets what it does not hold.
pub struct GoldenSource<'a, W = bf16> {
    /// The model configuration.
    pub config: &'a Qwen3Config,
    /// Layers run (the model's first `layers`).
    pub layers: usize,
    /// Layer `l`'s host weights, asked for when the golden reaches it, so one layer's need be
    /// held at a time: the values the model multiplies (bf16, or an int8 model's exact
    /// `q · scale` in fp32). An error stops the golden.
    pub layer: &'a mut dyn FnMut(usize) -> Result<Arc<LayerWeights<W>>, String>,
    /// Layer `l`'s initial K and V pools (`[slots, kv_width]` each).
    pub pools: &'a mut dyn FnMut(usize) -> (Vec<bf16>, Vec<bf16>),
    /// Pages per pool and page size.
    pub num_pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// What the projections multiply: `Acts::of(format)` (a W8A8 model's activation
    /// rounding is part of what it computes: with it, one layer matches to within 2.4e-7).
    pub acts: golden::Acts,
}

/// The LM head, read a slice of the vocabulary at a time.
pub struct HeadSource<'a> {
    /// Final norm weights.
    pub final_norm: &'a [f32],
    /// LM-head rows `[n, hidden]` of a vocabulary range, the values the model multiplies (a
    /// bf16 head widened; an int8 head's `q · scale` exactly: rounding those to bf16 moved the
    /// 0.6B preset's logits, which reach ±100, by up to 0.25, beyond the stack tolerance of
    /// the logits near 0).
    pub lm_rows: &'a mut dyn FnMut(Range<usize>) -> Vec<f32>,
}

/// What the streamed golden computed.
#[derive(Clone, Debug, PartialEq)]
pub struct GoldenStep {
    /// fp32 hidden state after the last layer `[batch, hidden]`.
    pub hidden: Vec<f32>,
    /// Every layer's K/V writes.
    pub kv_writes: Vec<LayerKvWrite>,
    /// Logits `[batch, vocab]` and greedy ids, when a head was given.
    pub head: Option<(Vec<f32>, Vec<u32>)>,
}

/// The golden decode step over `src.layers` from fp32 input `x`, with the head when given;
/// the first error of `src.layer` stops it.
pub fn golden_decode_streamed<W: ProjectionElem>(
    src: GoldenSource<'_, W>,
    head: Option<HeadSource<'_>>,
    batch: &PagedBatch,
    rope: &RopeTables,
    x: &[f32],
) -> Result<GoldenStep, String> {
    let c = src.config;
    let mut one = c.clone();
    one.num_hidden_layers = 1;
    let mut hidden = x.to_vec();
    let mut kv_writes = Vec::with_capacity(src.layers);
    for l in 0..src.layers {
        let w = (src.layer)(l)?;
        let (k, v) = (src.pools)(l);
        let mut kv = KvCache {
            layers: 1,
            num_pages: src.num_pages,
            page_size: src.page_size,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            k,
            v,
        };
        let (next, wr) = golden::decode_layer(&one, &w, &mut kv, batch, rope, &hidden, src.acts);
        hidden = next;
        kv_writes.push(wr);
    }
    let head = head.map(|h| {
        let rows = batch.batch();
        let vocab = c.vocab_size;
        let mut logits = vec![0.0f32; rows * vocab];
        let step = 8192;
        let mut v0 = 0;
        while v0 < vocab {
            let v1 = (v0 + step).min(vocab);
            let part = golden::head_logits(c, h.final_norm, &(h.lm_rows)(v0..v1), &hidden, rows);
            for b in 0..rows {
                logits[b * vocab + v0..b * vocab + v1]
                    .copy_from_slice(&part[b * (v1 - v0)..(b + 1) * (v1 - v0)]);
            }
            v0 = v1;
        }
        let next = logits.chunks_exact(vocab).map(golden::argmax).collect();
        (logits, next)
    });
    Ok(GoldenStep {
        hidden,
        kv_writes,
        head,
    })
}

/// A pool slot's K and V rows of a layer, read back from the runtime's cache.
pub type KvRows<'a> = &'a mut dyn FnMut(usize, usize) -> Result<(Vec<bf16>, Vec<bf16>), String>;

/// The tolerance of a stack of `layers` layers (`docs/qwen3.md`).
pub fn stack_tolerance(layers: usize) -> Tolerance {
    if layers <= 1 {
        Tolerance::ONE_LAYER
    } else {
        Tolerance::STACK
    }
}

/// Compares a runtime step of a bf16 model with the golden: hidden state, every layer's K/V
/// writes (read through `kv_rows(layer, slot)`), and, when both have them, logits and argmax.
/// Returns one line per comparison, or the first failure.
pub fn compare_step(
    want: &GoldenStep,
    hidden: &[f32],
    head: Option<(&[f32], &[u32])>,
    kv_rows: KvRows<'_>,
) -> Result<Vec<String>, String> {
    compare_step_as(want, hidden, head, kv_rows, WeightFormat::Bf16)
}

/// [`compare_step`] of a model in `format` against the golden on the weights it multiplies
/// (an int8 model's exact `q · scale`, its W8A8 activations rounded as it rounds them): layer
/// 0's writes at the one-layer tolerance, the rest at the stack tolerance — except a deep
/// W8A8 stack's logits, at [`Tolerance::W8A8_STACK_LOGITS`] (`docs/qwen3.md`, "int8 weights").
pub fn compare_step_as(
    want: &GoldenStep,
    hidden: &[f32],
    head: Option<(&[f32], &[u32])>,
    kv_rows: KvRows<'_>,
    format: WeightFormat,
) -> Result<Vec<String>, String> {
    let layers = want.kv_writes.len();
    let tol = stack_tolerance(layers);
    let first = Tolerance::ONE_LAYER;
    let logits_tol = if format == WeightFormat::Int8(Int8Acts::Quantised) && layers > 1 {
        Tolerance::W8A8_STACK_LOGITS
    } else {
        tol
    };
    let mut lines = Vec::new();
    let ag = tol.check("hidden", hidden, &want.hidden)?;
    lines.push(format!(
        "hidden [{}]: {:.3}% within {} + {}|e|, max |a-e| {:.2e}",
        ag.n,
        100.0 * ag.fraction(),
        tol.atol,
        tol.rtol,
        ag.max_abs
    ));
    let f32s = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    let (mut n, mut worst) = (0usize, 0.0f32);
    for (l, wr) in want.kv_writes.iter().enumerate() {
        let t = if l == 0 { first } else { tol };
        let row = wr.k.len() / wr.slots.len().max(1);
        for (i, &slot) in wr.slots.iter().enumerate() {
            let (k, v) = kv_rows(l, slot)?;
            for (what, got, exp) in [("K", &k, &wr.k), ("V", &v, &wr.v)] {
                let ag = t.check(
                    &format!("layer {l} {what} write at slot {slot}"),
                    &f32s(got),
                    &f32s(&exp[i * row..(i + 1) * row]),
                )?;
                n += ag.n;
                worst = worst.max(ag.max_abs);
            }
        }
    }
    lines.push(format!(
        "K/V writes: {layers} layers, {n} elements within tolerance (layer 0 one-layer, others stack), max |a-e| {worst:.2e}"
    ));
    if let (Some((logits, ids)), Some((want_logits, want_ids))) = (head, &want.head) {
        let ag = logits_tol.check("logits", logits, want_logits)?;
        lines.push(format!(
            "logits [{}]: {:.3}% within {} + {}|e| (need {}%), the farthest at {:.2} times it (cap {}), max |a-e| {:.2e}",
            ag.n,
            100.0 * ag.fraction(),
            logits_tol.atol,
            logits_tol.rtol,
            100.0 * logits_tol.min_fraction,
            ag.worst_ratio,
            logits_tol.outlier_cap,
            ag.max_abs,
        ));
        let near_ties = golden::check_argmax(ids, want_ids, want_logits, logits_tol)?;
        lines.push(golden::describe_argmax(ids.len(), &near_ties));
    }
    Ok(lines)
}
