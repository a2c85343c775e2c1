//! Checking a runtime decode step against the golden with one KV pool on the host at a time,
//! so shapes whose cache fills most of the machine (Qwen3-14B, batch 16, 40 layers) can still
//! be checked: the golden runs layer by layer on a one-layer cache rebuilt from the fixture's
//! pools, and the LM head is read back slice by slice.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;

use super::config::Qwen3Config;
use super::golden::{self, LayerKvWrite, Tolerance};
use super::rope::RopeTables;
use super::weights::{KvCache, LayerWeights, PagedBatch};

/// Where the streamed golden gets what it does not hold.
pub struct GoldenSource<'a> {
    /// The model configuration.
    pub config: &'a Qwen3Config,
    /// Host weights of every layer run (shared `Arc`s are fine).
    pub layers: &'a [Arc<LayerWeights>],
    /// Layer `l`'s initial K and V pools (`[slots, kv_width]` each).
    pub pools: &'a mut dyn FnMut(usize) -> (Vec<bf16>, Vec<bf16>),
    /// Pages per pool and page size.
    pub num_pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// What the projections multiply: `Acts::PerRowInt8` for an int8 W8A8 model (its
    /// activation rounding is part of what it computes; without it, 28 layers of the 0.6B
    /// preset moved logits near 0 by up to 0.17, beyond the stack tolerance).
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

/// The golden decode step over `src.layers` from fp32 input `x`, with the head when given.
pub fn golden_decode_streamed(
    src: GoldenSource<'_>,
    head: Option<HeadSource<'_>>,
    batch: &PagedBatch,
    rope: &RopeTables,
    x: &[f32],
) -> GoldenStep {
    let c = src.config;
    let mut one = c.clone();
    one.num_hidden_layers = 1;
    let mut hidden = x.to_vec();
    let mut kv_writes = Vec::with_capacity(src.layers.len());
    for (l, w) in src.layers.iter().enumerate() {
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
        let (next, wr) = golden::decode_layer(&one, w, &mut kv, batch, rope, &hidden, src.acts);
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
    GoldenStep {
        hidden,
        kv_writes,
        head,
    }
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

/// Compares a runtime step with the golden: hidden state, every layer's K/V writes (read
/// through `kv_rows(layer, slot)`), and, when both have them, logits and argmax. Returns one
/// line per comparison, or the first failure.
pub fn compare_step(
    want: &GoldenStep,
    hidden: &[f32],
    head: Option<(&[f32], &[u32])>,
    kv_rows: KvRows<'_>,
) -> Result<Vec<String>, String> {
    compare_step_as(want, hidden, head, kv_rows, false)
}

/// [`compare_step`] of an int8 model (`int8`) against the golden on its dequantised weights:
/// every comparison at the stack tolerance, layer 0's writes included. Quantised activations
/// (W8A8) and the bf16 rounding of the golden's weights keep one int8 layer outside the
/// one-layer tolerance (87% and 98% of the elements within; `docs/qwen3.md`, "int8 weights").
pub fn compare_step_as(
    want: &GoldenStep,
    hidden: &[f32],
    head: Option<(&[f32], &[u32])>,
    kv_rows: KvRows<'_>,
    int8: bool,
) -> Result<Vec<String>, String> {
    let layers = want.kv_writes.len();
    let tol = if int8 {
        Tolerance::STACK
    } else {
        stack_tolerance(layers)
    };
    let first = if int8 { tol } else { Tolerance::ONE_LAYER };
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
        "K/V writes: {layers} layers, {n} elements within tolerance (layer 0 {}, others stack), max |a-e| {worst:.2e}",
        if int8 { "stack: int8" } else { "one-layer" }
    ));
    if let (Some((logits, ids)), Some((want_logits, want_ids))) = (head, &want.head) {
        let ag = tol.check("logits", logits, want_logits)?;
        lines.push(format!(
            "logits [{}]: {:.3}% within tolerance, max |a-e| {:.2e}",
            ag.n,
            100.0 * ag.fraction(),
            ag.max_abs
        ));
        golden::check_argmax(ids, want_ids, want_logits, tol)?;
        lines.push(format!("argmax identical for all {} rows", ids.len()));
    }
    Ok(lines)
}
