//! Golden of the attention layers' decode step (`docs/dsv4.md`, "SWA layer", "CSA layer",
//! "HCA layer"): one step function for the three kinds — they share hc_pre, the projections,
//! the window and the grouped output projection, and differ in RoPE and in the compressed
//! candidates appended after the window rows — and the sparse attention core with its
//! attention sink, also written a second way (a dense masked softmax with the sink as an extra
//! logit) to check the first.

use half::bf16;

use super::compress::{StateWrite, compress_step};
use super::csa::{CsaWrites, index_pick, index_rows, overlap_compress_step};
use super::{
    HcPre, RopeKind, dot_i8, hc_post, hc_pre, matvec_bf16, quant_row, rb, rms_norm, rope,
    rope_cos_sin, rope_inv_freq, rope_inverse,
};
use crate::dsv4::config::Dsv4Config;
use crate::dsv4::fixture::{AttnWeights, CsaParts, HcaParts, StepInputs, WindowCache};

/// Rows a step writes into one cache, in the step's row order.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheWrite {
    /// Pool slot of each written row (`None`: a padding row or a position without a page,
    /// nothing written).
    pub slots: Vec<Option<usize>>,
    /// The rows `[writes, width]` bf16.
    pub rows: Vec<bf16>,
}

/// What one attention step produced.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnStep {
    /// New residual `[T, hc_mult, hidden]` fp32.
    pub x_out: Vec<f32>,
    /// The window-cache rows the step writes (one per token).
    pub window_write: CacheWrite,
    /// Roped queries `[T, n_heads, head_dim]` (bf16 values).
    pub q: Vec<f32>,
    /// Attention output before the projection, after inverse RoPE `[T, n_heads, head_dim]`
    /// (bf16 values).
    pub attn: Vec<f32>,
    /// Projected output `[T, hidden]` (bf16 values), the input of `hc_post`.
    pub o_proj: Vec<f32>,
    /// The hyper-connection weights of each token.
    pub hc: Vec<HcPre>,
    /// HCA: the compressor-state rows the step writes.
    pub state_write: Option<StateWrite>,
    /// HCA: the compressed rows the step writes (only tokens that close a window write one).
    pub compressed_write: Option<CacheWrite>,
    /// CSA: the compressors' state and cache writes, and each token's indexer decision.
    pub csa: Option<CsaWrites>,
    /// Whether each row is a real token; a padding row writes nothing and its outputs are
    /// not compared ([`StepInputs::real_tokens`]).
    pub real: Vec<bool>,
}

/// The rows that write caches (the real tokens), in row order, with their `x_n`, position
/// and sequence.
struct Writers {
    x_n: Vec<Vec<f32>>,
    positions: Vec<usize>,
    seqs: Vec<usize>,
}

impl Writers {
    fn new(inputs: &StepInputs, x_ns: &[Vec<f32>]) -> Writers {
        let per_seq = inputs.n_tokens() / inputs.starts.len();
        let real: Vec<usize> = (0..inputs.n_tokens())
            .filter(|&t| !inputs.is_padding(t))
            .collect();
        Writers {
            x_n: real.iter().map(|&t| x_ns[t].clone()).collect(),
            positions: real.iter().map(|&t| inputs.position(t)).collect(),
            seqs: real.iter().map(|&t| t / per_seq).collect(),
        }
    }
}

/// Sparse attention of one head over candidate rows: `q` `[head_dim]`, `rows` the candidates
/// (`None`: an invalid, masked index). With `m` the largest score, `p = exp(s - m)`,
/// `o = Σ bf16(p) · kv`, `out = o / (Σ p + exp(sink - m))`. No valid candidate gives zeros.
pub fn attention_core(q: &[f32], rows: &[Option<&[f32]>], scale: f32, sink: f32) -> Vec<f32> {
    let scores: Vec<Option<f32>> = rows
        .iter()
        .map(|r| r.map(|kv| q.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale))
        .collect();
    let mut out = vec![0.0f32; q.len()];
    let Some(m) = scores.iter().flatten().copied().reduce(f32::max) else {
        return out;
    };
    let mut l = 0.0f32;
    for (s, kv) in scores.iter().zip(rows) {
        let (Some(s), Some(kv)) = (s, kv) else {
            continue;
        };
        let p = (s - m).exp();
        l += p;
        let pb = rb(p);
        for (o, v) in out.iter_mut().zip(*kv) {
            *o += pb * v;
        }
    }
    let denom = l + (sink - m).exp();
    out.iter_mut().for_each(|o| *o /= denom);
    out
}

/// The same attention written densely: every row of `all` is scored, `visible[j]` masks it,
/// and the sink joins the softmax as one more logit whose value row is zero. f64, no bf16
/// rounding of the probabilities.
pub fn attention_dense(
    q: &[f32],
    all: &[&[f32]],
    visible: &[bool],
    scale: f32,
    sink: f32,
) -> Vec<f32> {
    let mut logits: Vec<f64> = all
        .iter()
        .zip(visible)
        .map(|(kv, &vis)| {
            if vis {
                q.iter()
                    .zip(*kv)
                    .map(|(a, b)| f64::from(a * b))
                    .sum::<f64>()
                    * f64::from(scale)
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    logits.push(f64::from(sink));
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum();
    (0..q.len())
        .map(|d| {
            all.iter()
                .zip(&e)
                .map(|(kv, p)| p * f64::from(kv[d]))
                .sum::<f64>()
                / z
        })
        .map(|v| v as f32)
        .collect()
}

/// A token's projections: `q` `[n_heads · head_dim]` and `kv` `[head_dim]`, both roped and
/// bf16, and the int8 `qr` the indexer reuses.
struct Projected {
    q: Vec<f32>,
    kv: Vec<f32>,
    qr_scale: f32,
    qr_i8: Vec<i32>,
}

/// The projections of one token from `x_n` (the attention-normed input, bf16 values), roped
/// with `cs` (the token's position).
fn project_qkv(cfg: &Dsv4Config, w: &AttnWeights, x_n: &[f32], cs: &[(f32, f32)]) -> Projected {
    let (hd, rd) = (cfg.head_dim, cfg.rope_dim);
    let qr = rms_norm(
        &matvec_bf16(x_n, &w.wq_a, cfg.q_lora_rank),
        Some(w.q_norm.as_slice()),
        cfg.rms_eps,
    );
    let (qr_scale, qr_i8) = quant_row(&qr);
    let mut q = vec![0.0f32; cfg.n_heads * hd];
    for h in 0..cfg.n_heads {
        let raw: Vec<f32> = (0..hd)
            .map(|d| {
                let r = h * hd + d;
                dot_i8(&qr_i8, w.wq_b.row(r)) as f32 * qr_scale * w.wq_b.scale[r]
            })
            .collect();
        let mut head = rms_norm(&raw, None, cfg.rms_eps);
        rope(&mut head[hd - rd..], cs);
        for (o, v) in q[h * hd..(h + 1) * hd].iter_mut().zip(head) {
            *o = rb(v);
        }
    }
    let mut kv = rms_norm(
        &matvec_bf16(x_n, &w.wkv, hd),
        Some(w.kv_norm.as_slice()),
        cfg.rms_eps,
    );
    rope(&mut kv[hd - rd..], cs);
    kv.iter_mut().for_each(|v| *v = rb(*v));
    Projected {
        q,
        kv,
        qr_scale,
        qr_i8,
    }
}

/// The grouped output projection of one token: `o` `[n_heads · head_dim]` (bf16 values) →
/// `[hidden]` bf16 values. Per group `g`: `o_r = o[g] @ Wo_a[g]ᵀ`, int8 per (token, group);
/// then `Σ_g (o_r_i8 · Wo_b_i8[:, g]) · o_r_scale · row_scale`.
pub fn output_projection(cfg: &Dsv4Config, w: &AttnWeights, o: &[f32]) -> Vec<f32> {
    let (g_in, r) = (cfg.heads_per_group() * cfg.head_dim, cfg.o_lora_rank);
    let groups: Vec<(f32, Vec<i32>)> = (0..cfg.o_groups)
        .map(|g| {
            let wa = &w.wo_a[g * r * g_in..(g + 1) * r * g_in];
            quant_row(&matvec_bf16(&o[g * g_in..(g + 1) * g_in], wa, r))
        })
        .collect();
    (0..cfg.hidden)
        .map(|n| {
            let row = w.wo_b.row(n);
            let acc: f32 = groups
                .iter()
                .enumerate()
                .map(|(g, (s, q))| dot_i8(q, &row[g * r..(g + 1) * r]) as f32 * s)
                .sum();
            rb(acc * w.wo_b.scale[n])
        })
        .collect()
}

/// One SWA decode step (compress ratio 0, plain RoPE): every token's output and window write.
///
/// Token `t` at position `p` attends to positions `max(0, p - window + 1) ..= p` of its own
/// sequence, oldest first; positions of this step come from the rows the step writes (so the
/// step's first token does not see its second), earlier ones from `cache`.
pub fn swa_step(
    cfg: &Dsv4Config,
    w: &AttnWeights,
    cache: &WindowCache,
    inputs: &StepInputs,
) -> AttnStep {
    attention_step(cfg, w, cache, inputs, Extra::None)
}

/// One HCA decode step (compress ratio `hca_ratio`, YaRN RoPE): the SWA step plus the
/// compressor, whose rows written in this step are visible to the token that closes their
/// window and to later ones; each token also attends to its sequence's compressed rows
/// `0 .. min(max_position / hca_ratio, (p + 1) / hca_ratio)`.
pub fn hca_step(
    cfg: &Dsv4Config,
    w: &AttnWeights,
    cache: &WindowCache,
    hca: &HcaParts,
    inputs: &StepInputs,
) -> AttnStep {
    attention_step(cfg, w, cache, inputs, Extra::Hca(hca))
}

/// One CSA decode step (compress ratio `csa_ratio`, YaRN RoPE): the SWA step plus the
/// overlapping compressor and the indexer's own compressor, whose rows written in this step
/// are visible to the token that closes their window and to later ones; each token also
/// attends to the compressed rows its indexer selects (at most `index_topk` of the visible
/// `min(max_rows, (p + 1) / csa_ratio)`).
pub fn csa_step(
    cfg: &Dsv4Config,
    w: &AttnWeights,
    cache: &WindowCache,
    csa: &CsaParts,
    inputs: &StepInputs,
) -> AttnStep {
    attention_step(cfg, w, cache, inputs, Extra::Csa(csa))
}

/// The layer kind's extra candidates.
#[derive(Clone, Copy)]
enum Extra<'a> {
    None,
    Hca(&'a HcaParts),
    Csa(&'a CsaParts),
}

/// The CSA parts of a step: the writes, and the main compressed rows as the step's attention
/// sees them (`[batch · max_rows, head_dim]` f32).
fn csa_parts(
    cfg: &Dsv4Config,
    parts: &CsaParts,
    inputs: &StepInputs,
    x_ns: &[Vec<f32>],
    projected: &[Projected],
    inv_freq: &[f64],
) -> (CsaWrites, Vec<f32>) {
    let n_tokens = inputs.n_tokens();
    let per_seq = n_tokens / inputs.starts.len();
    let positions: Vec<usize> = (0..n_tokens).map(|t| inputs.position(t)).collect();
    let seqs: Vec<usize> = (0..n_tokens).map(|t| t / per_seq).collect();
    let wr = Writers::new(inputs, x_ns);
    let (state_write, closed) = overlap_compress_step(
        cfg,
        &parts.compressor,
        &parts.state,
        &wr.x_n,
        &wr.positions,
        &wr.seqs,
        inv_freq,
    );
    let (index_state_write, index_closed) = overlap_compress_step(
        cfg,
        &parts.index_compressor,
        &parts.index_state,
        &wr.x_n,
        &wr.positions,
        &wr.seqs,
        inv_freq,
    );
    let (hd, max_rows) = (cfg.head_dim, parts.cache.max_rows);
    let mut rows: Vec<f32> = parts.cache.rows.iter().map(|v| v.to_f32()).collect();
    let mut compressed = CacheWrite {
        slots: Vec::with_capacity(closed.len()),
        rows: Vec::with_capacity(closed.len() * hd),
    };
    for c in &closed {
        let slot = c.seq * max_rows + c.index;
        for (o, &v) in rows[slot * hd..(slot + 1) * hd].iter_mut().zip(&c.row) {
            let b = bf16::from_f32(v);
            *o = b.to_f32();
            compressed.rows.push(b);
        }
        compressed.slots.push(Some(slot));
    }
    let index_write = index_rows(&index_closed, parts.index_cache.max_rows);
    let mut index_cache = parts.index_cache.clone();
    let iw = index_cache.width;
    for (k, &slot) in index_write.slots.iter().enumerate() {
        index_cache.q[slot * iw..(slot + 1) * iw]
            .copy_from_slice(&index_write.q[k * iw..(k + 1) * iw]);
        index_cache.scale[slot] = index_write.scale[k];
    }
    let picks = (0..n_tokens)
        .map(|t| {
            let b = seqs[t];
            index_pick(
                cfg,
                parts,
                &index_cache,
                b,
                projected[t].qr_scale,
                &projected[t].qr_i8,
                &x_ns[t],
                positions[t],
                inputs.starts[b],
                inv_freq,
            )
        })
        .collect();
    let writes = CsaWrites {
        state_write,
        compressed,
        index_state_write,
        index_write,
        picks,
    };
    (writes, rows)
}

fn attention_step(
    cfg: &Dsv4Config,
    w: &AttnWeights,
    cache: &WindowCache,
    inputs: &StepInputs,
    extra: Extra<'_>,
) -> AttnStep {
    let (hc, d, hd, rd) = (cfg.hc_mult, cfg.hidden, cfg.head_dim, cfg.rope_dim);
    let n_tokens = inputs.n_tokens();
    let kind = match extra {
        Extra::None => RopeKind::Plain,
        Extra::Hca(_) | Extra::Csa(_) => RopeKind::Yarn,
    };
    let hca = match extra {
        Extra::Hca(parts) => Some(parts),
        _ => None,
    };
    let inv_freq = rope_inv_freq(cfg, kind);
    let mut hcs = Vec::with_capacity(n_tokens);
    let mut projected = Vec::with_capacity(n_tokens);
    let mut x_ns = Vec::with_capacity(n_tokens);
    for t in 0..n_tokens {
        let x = &inputs.x_hc[t * hc * d..(t + 1) * hc * d];
        let hp = hc_pre(cfg, &w.hc, x);
        let x_n = rms_norm(&hp.x_mixed, Some(w.attn_norm.as_slice()), cfg.rms_eps);
        let cs = rope_cos_sin(&inv_freq, inputs.position(t));
        projected.push(project_qkv(cfg, w, &x_n, &cs));
        hcs.push(hp);
        x_ns.push(x_n);
    }
    let per_seq = n_tokens / inputs.starts.len();
    let compressed = hca.map(|parts| {
        let wr = Writers::new(inputs, &x_ns);
        let (sw, cw) = compress_step(
            cfg,
            &parts.compressor,
            &parts.state,
            &parts.cache,
            &wr.x_n,
            &wr.positions,
            &wr.seqs,
            &inv_freq,
        );
        // The compressed rows as the step's attention sees them: the cache, then this step's.
        let mut rows: Vec<f32> = parts.cache.rows.iter().map(|v| v.to_f32()).collect();
        let width = parts.cache.width;
        for (slot, row) in cw.slots.iter().zip(cw.rows.chunks(width)) {
            if let Some(slot) = slot {
                for (o, v) in rows[slot * width..(slot + 1) * width].iter_mut().zip(row) {
                    *o = v.to_f32();
                }
            }
        }
        (sw, cw, rows, parts.cache.max_rows)
    });
    let csa = match extra {
        Extra::Csa(parts) => Some(csa_parts(cfg, parts, inputs, &x_ns, &projected, &inv_freq)),
        _ => None,
    };
    let cached: Vec<f32> = cache.rows.iter().map(|v| v.to_f32()).collect();
    let mut attn = vec![0.0f32; n_tokens * cfg.n_heads * hd];
    for t in 0..n_tokens {
        let (b, pos) = (t / per_seq, inputs.position(t));
        let start = inputs.starts[b];
        let mut rows: Vec<Option<&[f32]>> = (pos.saturating_sub(cfg.window - 1)..=pos)
            .map(|p| {
                if p >= start {
                    Some(projected[b * per_seq + (p - start)].kv.as_slice())
                } else {
                    cache
                        .slot(b, p)
                        .map(|s| &cached[s * cache.width..(s + 1) * cache.width])
                }
            })
            .collect();
        if let Some((_, _, comp, max_rows)) = &compressed {
            let visible = ((pos + 1) / cfg.hca_ratio)
                .min(cfg.max_position / cfg.hca_ratio)
                .min(*max_rows);
            rows.extend((0..visible).map(|i| {
                let slot = b * max_rows + i;
                Some(&comp[slot * hd..(slot + 1) * hd])
            }));
        }
        if let (Some((writes, comp)), Extra::Csa(parts)) = (&csa, extra) {
            let max_rows = parts.cache.max_rows;
            rows.extend(writes.picks[t].selected.iter().map(|&i| {
                let slot = b * max_rows + i;
                Some(&comp[slot * hd..(slot + 1) * hd])
            }));
        }
        let cs = rope_cos_sin(&inv_freq, pos);
        for h in 0..cfg.n_heads {
            let q = &projected[t].q[h * hd..(h + 1) * hd];
            let mut o = attention_core(q, &rows, cfg.softmax_scale(), w.sink[h]);
            rope_inverse(&mut o[hd - rd..], &cs);
            let dst = &mut attn[(t * cfg.n_heads + h) * hd..(t * cfg.n_heads + h + 1) * hd];
            for (a, v) in dst.iter_mut().zip(o) {
                *a = rb(v);
            }
        }
    }
    let mut x_out = vec![0.0f32; n_tokens * hc * d];
    let mut o_proj = vec![0.0f32; n_tokens * d];
    for t in 0..n_tokens {
        let y = output_projection(
            cfg,
            w,
            &attn[t * cfg.n_heads * hd..(t + 1) * cfg.n_heads * hd],
        );
        let x = &inputs.x_hc[t * hc * d..(t + 1) * hc * d];
        x_out[t * hc * d..(t + 1) * hc * d].copy_from_slice(&hc_post(cfg, &hcs[t], x, &y));
        o_proj[t * d..(t + 1) * d].copy_from_slice(&y);
    }
    let real: Vec<bool> = (0..n_tokens).map(|t| !inputs.is_padding(t)).collect();
    let window_write = CacheWrite {
        slots: (0..n_tokens)
            .map(|t| {
                real[t]
                    .then(|| cache.slot(t / per_seq, inputs.position(t)))
                    .flatten()
            })
            .collect(),
        rows: projected
            .iter()
            .flat_map(|p| p.kv.iter().map(|&v| bf16::from_f32(v)))
            .collect(),
    };
    AttnStep {
        x_out,
        window_write,
        q: projected.iter().flat_map(|p| p.q.iter().copied()).collect(),
        csa: csa.map(|c| c.0),
        state_write: compressed.as_ref().map(|c| c.0.clone()),
        compressed_write: compressed.map(|c| c.1),
        attn,
        o_proj,
        hc: hcs,
        real,
    }
}
