//! Golden of the non-overlapping compressor (HCA, ratio 128; `docs/dsv4.md`, "HCA layer"):
//! every token appends a state row `[kv | score]`; the token whose position closes a window of
//! `ratio` positions pools the window per channel with a softmax over the scores, normalises
//! it and ropes it at the window's first position into one compressed KV row.

use half::bf16;

use super::attention::CacheWrite;
use super::{rms_norm, rope, rope_cos_sin};
use crate::dsv4::config::Dsv4Config;
use crate::dsv4::fixture::{CompressedCache, CompressorState, CompressorWeights};

/// State rows a step writes (fp32), at slot `seq · ratio + position % ratio`.
#[derive(Clone, Debug, PartialEq)]
pub struct StateWrite {
    /// Slot of each written row, in the step's row order.
    pub slots: Vec<usize>,
    /// `[writes, width]` kv parts.
    pub kv: Vec<f32>,
    /// `[writes, width]` score parts (`ape` included).
    pub score: Vec<f32>,
}

/// Per channel `c`: `Σ_j softmax_j(score[j][c]) · kv[j][c]` over the window's rows
/// (`kv`, `score` `[rows, width]`).
pub fn pool_window(kv: &[f32], score: &[f32], width: usize) -> Vec<f32> {
    (0..width)
        .map(|c| {
            let col = |v: &[f32]| {
                v.iter()
                    .skip(c)
                    .step_by(width)
                    .copied()
                    .collect::<Vec<f32>>()
            };
            let (k, s) = (col(kv), col(score));
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = s.iter().map(|v| (v - m).exp()).collect();
            let z: f32 = e.iter().sum();
            k.iter().zip(&e).map(|(k, e)| k * e).sum::<f32>() / z
        })
        .collect()
}

/// One step of the compressor. `x_n` holds each token's attention-normed input (`[T, hidden]`,
/// bf16 values), `positions[t]` and `seqs[t]` its position and sequence; `inv_freq` the
/// layer's RoPE. Returns the state writes and the compressed rows written (slot
/// `seq · max_rows + index`), in the step's row order.
#[allow(clippy::too_many_arguments)]
pub fn compress_step(
    cfg: &Dsv4Config,
    w: &CompressorWeights,
    state: &CompressorState,
    cache: &CompressedCache,
    x_n: &[Vec<f32>],
    positions: &[usize],
    seqs: &[usize],
    inv_freq: &[f64],
) -> (StateWrite, CacheWrite) {
    let (ratio, width, d) = (state.ratio, state.width, cfg.hidden);
    let rd = cfg.rope_dim;
    // Each sequence's window as the step sees it: the fixture's rows, then the step's own.
    let mut kv_rows = state.kv.clone();
    let mut score_rows = state.score.clone();
    let mut sw = StateWrite {
        slots: Vec::new(),
        kv: Vec::new(),
        score: Vec::new(),
    };
    let mut cw = CacheWrite {
        slots: Vec::new(),
        rows: Vec::new(),
    };
    for (t, x) in x_n.iter().enumerate() {
        let (p, b) = (positions[t], seqs[t]);
        let slot = b * ratio + p % ratio;
        let ape = &w.ape[(p % ratio) * width..(p % ratio + 1) * width];
        for c in 0..width {
            let dot = |m: &[bf16]| -> f32 {
                m[c * d..(c + 1) * d]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a.to_f32() * b)
                    .sum()
            };
            kv_rows[slot * width + c] = dot(&w.wkv);
            score_rows[slot * width + c] = dot(&w.wgate) + ape[c];
        }
        sw.slots.push(slot);
        sw.kv
            .extend_from_slice(&kv_rows[slot * width..(slot + 1) * width]);
        sw.score
            .extend_from_slice(&score_rows[slot * width..(slot + 1) * width]);
        if (p + 1) % ratio == 0 {
            let window = b * ratio * width..(b + 1) * ratio * width;
            let pooled = pool_window(&kv_rows[window.clone()], &score_rows[window], width);
            let mut row = rms_norm(&pooled, Some(w.norm.as_slice()), cfg.rms_eps);
            rope(
                &mut row[width - rd..],
                &rope_cos_sin(inv_freq, p + 1 - ratio),
            );
            cw.slots
                .push(Some(b * cache.max_rows + (p + 1) / ratio - 1));
            cw.rows.extend(row.iter().map(|&v| bf16::from_f32(v)));
        }
    }
    (sw, cw)
}
