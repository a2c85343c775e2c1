//! Seeded fixtures for one DeepSeek-V4 decode step (`docs/dsv4.md`, "Fixtures"): the weights
//! of an attention layer and of a MoE layer (large projections int8 with per-output-channel
//! fp32 scales), the sliding-window KV cache, and the step's inputs (batch 4 × 2 tokens).
//!
//! Distributions: projection weights `N(0,1)/sqrt(fan_in)` (then int8-quantised where int8),
//! norm weights `N(1, 0.1)`, cache rows of unit RMS, `x_hc ~ U(-1, 1)`. Every tensor draws from
//! its own stream `(seed, tensor id)`, so adding a tensor never changes the others.

use half::bf16;

use super::config::Dsv4Config;
use crate::rng::Rng;

/// The spec's default starts of the four sequences (`docs/dsv4.md`, "Fixtures"): each crosses
/// a different case inside the step (positions `start`, `start + 1`):
/// - 0: no earlier row at all (a one-row window for the first token);
/// - 3: position 3 closes a ratio-4 window;
/// - 127: position 127 closes a ratio-128 window and a ratio-4 window, and 128 opens page 1;
/// - 8192: a long, full window with no boundary inside the step.
pub const MIXED_STARTS: [usize; 4] = [0, 3, 127, 8192];

/// The benchmark case `--start-pos N`: every sequence starts at `n` (at 8192 no compression
/// boundary falls inside the step).
pub fn uniform_starts(n: usize) -> [usize; 4] {
    [n; 4]
}

/// Tokens per sequence in a decode step (previous + current token).
pub const TOKENS_PER_SEQ: usize = 2;

/// A `[rows, cols]` int8 matrix with one fp32 scale per row (output channel):
/// `w[r, c] ≈ q[r, c] · scale[r]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Int8Matrix {
    /// Rows (output channels).
    pub rows: usize,
    /// Columns (inputs).
    pub cols: usize,
    /// `[rows, cols]` row-major.
    pub q: Vec<i8>,
    /// `[rows]`.
    pub scale: Vec<f32>,
}

impl Int8Matrix {
    /// Quantises `w` (`[rows, cols]`) symmetrically per row: `scale = amax / 127`.
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Int8Matrix {
        let mut q = vec![0i8; rows * cols];
        let mut scale = vec![0.0f32; rows];
        for r in 0..rows {
            let (s, qr) = quantize_row(&w[r * cols..(r + 1) * cols]);
            scale[r] = s;
            q[r * cols..(r + 1) * cols].copy_from_slice(&qr);
        }
        Int8Matrix {
            rows,
            cols,
            q,
            scale,
        }
    }

    /// Row `r`'s int8 values.
    pub fn row(&self, r: usize) -> &[i8] {
        &self.q[r * self.cols..(r + 1) * self.cols]
    }
}

/// Symmetric per-row int8: `(scale, q)` with `scale = amax/127` and `q = round(x / scale)`
/// (ties away from zero). An all-zero row gets scale 0 and zeros.
pub fn quantize_row(x: &[f32]) -> (f32, Vec<i8>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return (0.0, vec![0; x.len()]);
    }
    let scale = amax / 127.0;
    let q = x
        .iter()
        .map(|&v| (v / scale).round().clamp(-127.0, 127.0) as i8)
        .collect();
    (scale, q)
}

/// The hyper-connection weights of one sub-layer (attention or MoE).
#[derive(Clone, Debug, PartialEq)]
pub struct HcWeights {
    /// `fn`: `[hc_mix, hc_mult · hidden]` fp32.
    pub mix: Vec<f32>,
    /// Scales of the pre, post and comb parts.
    pub scale: [f32; 3],
    /// Biases `[hc_mix]`.
    pub base: Vec<f32>,
}

/// One attention layer's weights (shared by SWA, CSA and HCA; the compressors and the indexer
/// are not generated yet).
#[derive(Clone, Debug, PartialEq)]
pub struct AttnWeights {
    /// Hyper-connections before the attention.
    pub hc: HcWeights,
    /// Attention RMSNorm weight `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `Wq_a` `[q_lora, hidden]` bf16.
    pub wq_a: Vec<bf16>,
    /// RMSNorm weight of `qr` `[q_lora]`.
    pub q_norm: Vec<f32>,
    /// `Wq_b` int8 `[n_heads · head_dim, q_lora]`.
    pub wq_b: Int8Matrix,
    /// `Wkv` `[head_dim, hidden]` bf16.
    pub wkv: Vec<bf16>,
    /// RMSNorm weight of `kv` `[head_dim]`.
    pub kv_norm: Vec<f32>,
    /// `Wo_a` `[o_groups, o_lora, heads_per_group · head_dim]` bf16.
    pub wo_a: Vec<bf16>,
    /// `Wo_b` int8 `[hidden, o_groups · o_lora]`.
    pub wo_b: Int8Matrix,
    /// Attention sink logit per head `[n_heads]`.
    pub sink: Vec<f32>,
}

/// One SwiGLU expert, int8 with per-row scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Expert {
    /// Gate `W1` `[inter, hidden]`.
    pub w1: Int8Matrix,
    /// Up `W3` `[inter, hidden]`.
    pub w3: Int8Matrix,
    /// Down `W2` `[hidden, inter]`.
    pub w2: Int8Matrix,
}

/// One MoE layer's weights.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeWeights {
    /// Hyper-connections before the MoE.
    pub hc: HcWeights,
    /// FFN RMSNorm weight `[hidden]`.
    pub ffn_norm: Vec<f32>,
    /// Gate `[n_routed_experts, hidden]` fp32.
    pub gate: Vec<f32>,
    /// Selection bias `[n_routed_experts]` (chooses experts, never weights them).
    pub bias: Vec<f32>,
    /// Hash routing table `[vocab_size, n_activated_experts]` (layers below `n_hash_layers`).
    pub tid2eid: Vec<u32>,
    /// Routed experts.
    pub routed: Vec<Expert>,
    /// Shared experts.
    pub shared: Vec<Expert>,
}

/// The sliding-window KV cache: paged, `[pages · page_size, head_dim]` bf16, with an identity
/// block table (sequence `b`'s block `j` is page `b · max_blocks + j`).
#[derive(Clone, Debug, PartialEq)]
pub struct WindowCache {
    /// Row width (`head_dim`).
    pub width: usize,
    /// Page size in rows.
    pub page_size: usize,
    /// Blocks per sequence.
    pub max_blocks: usize,
    /// `[batch, max_blocks]` physical pages.
    pub block_table: Vec<usize>,
    /// `[pages · page_size, width]`.
    pub rows: Vec<bf16>,
}

impl WindowCache {
    /// Pool row of sequence `b`'s position `pos`, `None` past its block table.
    pub fn slot(&self, b: usize, pos: usize) -> Option<usize> {
        let block = pos / self.page_size;
        (block < self.max_blocks).then(|| {
            self.block_table[b * self.max_blocks + block] * self.page_size + pos % self.page_size
        })
    }

    /// The row at a pool slot.
    pub fn row(&self, slot: usize) -> &[bf16] {
        &self.rows[slot * self.width..(slot + 1) * self.width]
    }
}

/// The weights of a non-overlapping compressor (HCA): `width` is `head_dim`.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressorWeights {
    /// `Wc_kv` `[width, hidden]` bf16.
    pub wkv: Vec<bf16>,
    /// `Wc_gate` `[width, hidden]` bf16.
    pub wgate: Vec<bf16>,
    /// Position bias of the scores `[ratio, width]` (row `p % ratio`).
    pub ape: Vec<f32>,
    /// RMSNorm weight of the pooled row `[width]`.
    pub norm: Vec<f32>,
}

/// A compressor's state: the `[kv | score]` rows of each sequence's open window, fp32, at row
/// `seq · ratio + position % ratio`.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressorState {
    /// Positions per compressed row.
    pub ratio: usize,
    /// Width of the kv and of the score parts.
    pub width: usize,
    /// `[batch · ratio, width]`.
    pub kv: Vec<f32>,
    /// `[batch · ratio, width]`.
    pub score: Vec<f32>,
}

/// A compressed KV cache, `[batch, max_rows, width]` bf16: row `i` of a sequence pools
/// positions `i · ratio .. (i + 1) · ratio`.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressedCache {
    /// Row width.
    pub width: usize,
    /// Rows per sequence.
    pub max_rows: usize,
    /// `[batch · max_rows, width]`.
    pub rows: Vec<bf16>,
}

/// What an HCA layer adds to the attention weights and caches.
#[derive(Clone, Debug, PartialEq)]
pub struct HcaParts {
    /// The ratio-`hca_ratio` compressor.
    pub compressor: CompressorWeights,
    /// Its state before the step (each sequence's open window up to its start, zeros after).
    pub state: CompressorState,
    /// Compressed rows completed before the step (unit RMS), zeros after.
    pub cache: CompressedCache,
}

/// An overlapping compressor's state (CSA, ratio 4): each sequence keeps the rows of its
/// previous and current window, `2 · ratio` rows at `seq · 2 · ratio + position % (2 · ratio)`,
/// each `[kv | score]` of `2 · width` channels (the first `width` pair with the next window,
/// the second `width` with this one).
#[derive(Clone, Debug, PartialEq)]
pub struct OverlapState {
    /// Positions per compressed row (4).
    pub ratio: usize,
    /// Output width `W`; the rows are `2 · W` wide.
    pub width: usize,
    /// `[batch · 2 · ratio, 2 · width]`.
    pub kv: Vec<f32>,
    /// `[batch · 2 · ratio, 2 · width]`.
    pub score: Vec<f32>,
}

/// The indexer's int8 cache: `[batch, max_rows, width]` int8 with one fp32 scale per row.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexCache {
    /// Row width (`index_head_dim`).
    pub width: usize,
    /// Rows per sequence.
    pub max_rows: usize,
    /// `[batch · max_rows, width]`.
    pub q: Vec<i8>,
    /// `[batch · max_rows]`.
    pub scale: Vec<f32>,
}

/// What a CSA layer adds to the attention weights and caches.
#[derive(Clone, Debug, PartialEq)]
pub struct CsaParts {
    /// The ratio-4 compressor (`Wc_*` `[2 · head_dim, hidden]`, `ape` `[4, 2 · head_dim]`,
    /// norm `[head_dim]`).
    pub compressor: CompressorWeights,
    /// Its state before the step.
    pub state: OverlapState,
    /// Compressed rows completed before the step (unit RMS), zeros after.
    pub cache: CompressedCache,
    /// The indexer's own ratio-4 compressor (`index_head_dim` wide).
    pub index_compressor: CompressorWeights,
    /// Its state before the step.
    pub index_state: OverlapState,
    /// Index rows completed before the step, zeros after.
    pub index_cache: IndexCache,
    /// `W_idx` int8 `[index_heads · index_head_dim, q_lora]`.
    pub wq_idx: Int8Matrix,
    /// Head-weight projection `W_w` `[index_heads, hidden]` bf16.
    pub w_weights: Vec<bf16>,
}

/// The inputs of one decode step: `batch` sequences of `TOKENS_PER_SEQ` rows, row
/// `t = b · TOKENS_PER_SEQ + s` at position `starts[b] + s` ([`StepInputs::position`]).
///
/// A sequence may have fewer real tokens than rows (`real_tokens[b]`); its last rows are then
/// padding, the spec's slot −1: they are computed (the step keeps its shape, so a captured
/// graph replays) but write nothing — no window row, no compressor state, no compressed or
/// index row — and their outputs mean nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct StepInputs {
    /// First position of each sequence in this step.
    pub starts: Vec<usize>,
    /// Real tokens of each sequence (`0..=TOKENS_PER_SEQ`); the rows after them are padding.
    pub real_tokens: Vec<usize>,
    /// Token ids `[T]` (hash routing reads them).
    pub token_ids: Vec<u32>,
    /// Hyper-connection residual `[T, hc_mult, hidden]` fp32.
    pub x_hc: Vec<f32>,
}

impl StepInputs {
    /// Rows `T` of the step.
    pub fn n_tokens(&self) -> usize {
        self.starts.len() * TOKENS_PER_SEQ
    }

    /// Position of row `t`: `starts[b] + s` for a real token; a padding row sits at its
    /// sequence's first position, so padding never needs a position (or a page) the sequence
    /// does not have.
    pub fn position(&self, t: usize) -> usize {
        let start = self.starts[t / TOKENS_PER_SEQ];
        if self.is_padding(t) {
            start
        } else {
            start + t % TOKENS_PER_SEQ
        }
    }

    /// Whether row `t` is padding (written nowhere).
    pub fn is_padding(&self, t: usize) -> bool {
        t % TOKENS_PER_SEQ >= self.real_tokens[t / TOKENS_PER_SEQ]
    }
}

/// A generated case for one decode step of each layer kind.
#[derive(Clone, Debug, PartialEq)]
pub struct Dsv4Fixture {
    /// The configuration the tensors are shaped by.
    pub config: Dsv4Config,
    /// Attention weights.
    pub attn: AttnWeights,
    /// MoE weights.
    pub moe: MoeWeights,
    /// Window cache; rows at positions `start - window .. start` of each sequence are filled,
    /// all others are zero.
    pub window: WindowCache,
    /// The HCA compressor, its state and compressed cache.
    pub hca: HcaParts,
    /// The CSA compressors, indexer and their caches.
    pub csa: CsaParts,
    /// The step's inputs.
    pub inputs: StepInputs,
}

/// A fixture that cannot be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FixtureError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] super::config::ConfigError),
    /// A sequence's positions run past the RoPE tables.
    #[error(
        "start position {start} of sequence {seq}: positions up to {last} exceed max_position {max}"
    )]
    StartPastMaxPosition {
        /// Sequence.
        seq: usize,
        /// Its start.
        start: usize,
        /// Its last position in the step.
        last: usize,
        /// The configuration's `max_position`.
        max: usize,
    },
    /// No sequence.
    #[error("starts: at least one sequence is needed")]
    NoSequence,
}

/// Stream ids: one per tensor.
mod stream {
    pub(super) const ATTN: u64 = 1 << 8;
    pub(super) const MOE: u64 = 2 << 8;
    pub(super) const EXPERT0: u64 = 1 << 20;
    pub(super) const CACHE: u64 = 3 << 8;
    pub(super) const X: u64 = 4 << 8;
    pub(super) const TOKENS: u64 = 5 << 8;
    pub(super) const HCA: u64 = 6 << 8;
    pub(super) const HCA_STATE: u64 = 7 << 8;
    pub(super) const HCA_CACHE: u64 = 8 << 8;
    pub(super) const CSA: u64 = 9 << 8;
    pub(super) const CSA_STATE: u64 = 10 << 8;
    pub(super) const CSA_CACHE: u64 = 11 << 8;
}

/// `n` draws of `N(mean, std)` from stream `id`.
fn normal(seed: u64, id: u64, n: usize, mean: f32, std: f32) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    Rng::new(seed, id).fill_normal(&mut v, mean, std);
    v
}

/// A projection `[out, fan_in]` with `N(0,1)/sqrt(fan_in)` entries.
fn projection(seed: u64, id: u64, out: usize, fan_in: usize) -> Vec<f32> {
    normal(seed, id, out * fan_in, 0.0, 1.0 / (fan_in as f32).sqrt())
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn hc_weights(cfg: &Dsv4Config, seed: u64, id: u64) -> HcWeights {
    let width = cfg.hc_mult * cfg.hidden;
    HcWeights {
        mix: projection(seed, id, cfg.hc_mix(), width),
        // Three distinct scales near 1 (stream id + 15, free in both layers' streams): a
        // runtime that dropped or swapped them would fail the goldens, which unit scales hide.
        scale: {
            let s = normal(seed, id + 15, 3, 1.0, 0.25);
            [s[0], s[1], s[2]]
        },
        base: normal(seed, id + 1, cfg.hc_mix(), 0.0, 0.1),
    }
}

fn expert(cfg: &Dsv4Config, seed: u64, id: u64) -> Expert {
    let (d, i) = (cfg.hidden, cfg.moe_inter_dim);
    Expert {
        w1: Int8Matrix::quantize(&projection(seed, id, i, d), i, d),
        w3: Int8Matrix::quantize(&projection(seed, id + 1, i, d), i, d),
        w2: Int8Matrix::quantize(&projection(seed, id + 2, d, i), d, i),
    }
}

/// The attention layer's weights.
pub fn generate_attn_weights(cfg: &Dsv4Config, seed: u64) -> AttnWeights {
    let (d, hd, h) = (cfg.hidden, cfg.head_dim, cfg.n_heads);
    let id = stream::ATTN;
    let group_in = cfg.heads_per_group() * hd;
    let wq_b = projection(seed, id + 4, h * hd, cfg.q_lora_rank);
    let wo_b = projection(seed, id + 8, d, cfg.o_groups * cfg.o_lora_rank);
    AttnWeights {
        hc: hc_weights(cfg, seed, id),
        attn_norm: normal(seed, id + 2, d, 1.0, 0.1),
        wq_a: to_bf16(&projection(seed, id + 3, cfg.q_lora_rank, d)),
        q_norm: normal(seed, id + 5, cfg.q_lora_rank, 1.0, 0.1),
        wq_b: Int8Matrix::quantize(&wq_b, h * hd, cfg.q_lora_rank),
        wkv: to_bf16(&projection(seed, id + 6, hd, d)),
        kv_norm: normal(seed, id + 7, hd, 1.0, 0.1),
        wo_a: to_bf16(&projection(
            seed,
            id + 9,
            cfg.o_groups * cfg.o_lora_rank,
            group_in,
        )),
        wo_b: Int8Matrix::quantize(&wo_b, d, cfg.o_groups * cfg.o_lora_rank),
        sink: normal(seed, id + 10, h, 0.0, 1.0),
    }
}

/// The MoE layer's weights (every routed expert).
pub fn generate_moe_weights(cfg: &Dsv4Config, seed: u64) -> MoeWeights {
    generate_moe_weights_local(cfg, seed, 0..cfg.n_routed_experts)
}

/// The MoE layer's weights with only the routed experts `routed` (one rank's range of an
/// expert-parallel placement; each expert has its own stream, so these equal the same experts
/// of [`generate_moe_weights`]). An empty or out-of-range part of `routed` yields no expert.
pub fn generate_moe_weights_local(
    cfg: &Dsv4Config,
    seed: u64,
    routed: std::ops::Range<usize>,
) -> MoeWeights {
    let (d, e, k) = (cfg.hidden, cfg.n_routed_experts, cfg.n_activated_experts);
    let id = stream::MOE;
    // Each token's hash row holds k distinct experts (a partial Fisher–Yates shuffle).
    let mut rng = Rng::new(seed, id + 5);
    let mut tid2eid = Vec::with_capacity(cfg.vocab_size * k);
    let mut perm: Vec<u32> = (0..e as u32).collect();
    for _ in 0..cfg.vocab_size {
        for j in 0..k {
            let pick = j + (rng.next_u64() % (e - j) as u64) as usize;
            perm.swap(j, pick);
            tid2eid.push(perm[j]);
        }
    }
    MoeWeights {
        hc: hc_weights(cfg, seed, id),
        ffn_norm: normal(seed, id + 2, d, 1.0, 0.1),
        gate: projection(seed, id + 3, e, d),
        bias: normal(seed, id + 4, e, 0.0, 0.1),
        tid2eid,
        routed: (routed.start as u64..routed.end.min(e) as u64)
            .map(|x| expert(cfg, seed, stream::EXPERT0 + 4 * x))
            .collect(),
        shared: (0..cfg.n_shared_experts as u64)
            .map(|x| expert(cfg, seed, id + 16 + 4 * x))
            .collect(),
    }
}

/// What is wrong with a hash-routing table `tid2eid` (`[vocab_size, n_activated_experts]`)
/// for `cfg`, if anything: an entry naming an expert past the routed ones, or a token's row
/// naming one expert twice (it would send the token to that expert twice: the dispatch's
/// capacity and the combine count on distinct routes). The fixture loader and the MoE layer's
/// upload both refuse what this names.
pub(crate) fn hash_table_error(cfg: &Dsv4Config, tid2eid: &[u32]) -> Option<String> {
    if let Some((i, &e)) = tid2eid
        .iter()
        .enumerate()
        .find(|&(_, &e)| e as usize >= cfg.n_routed_experts)
    {
        return Some(format!(
            "entry {i} names expert {e}, there are {}",
            cfg.n_routed_experts
        ));
    }
    let k = cfg.n_activated_experts.max(1);
    for (t, row) in tid2eid.chunks(k).enumerate() {
        if let Some(j) = (1..row.len()).find(|&j| row[..j].contains(&row[j])) {
            return Some(format!(
                "token {t}'s row names expert {} twice (entries {} and {j})",
                row[j],
                row[..j].iter().position(|&e| e == row[j]).unwrap_or(0)
            ));
        }
    }
    None
}

/// One past the last position a step at `starts` writes (0 for no sequence).
///
/// # Panics
/// If that position does not fit a `usize` ([`generate_fixture`] refuses such starts first).
fn step_end(starts: &[usize]) -> usize {
    let max = starts.iter().max().copied().unwrap_or(0);
    max.checked_add(TOKENS_PER_SEQ)
        .unwrap_or_else(|| panic!("a step at start {max} ends past usize::MAX"))
}

/// The window cache for sequences at `starts`, covering every position the step writes; the
/// `window - 1` positions before each start hold unit-RMS rows (all a step can read).
///
/// # Panics
/// If a start's step ends past `usize::MAX`.
pub fn generate_window_cache(cfg: &Dsv4Config, starts: &[usize], seed: u64) -> WindowCache {
    let last = step_end(starts);
    let max_blocks = last.div_ceil(cfg.page_size);
    let batch = starts.len();
    let width = cfg.head_dim;
    let mut cache = WindowCache {
        width,
        page_size: cfg.page_size,
        max_blocks,
        block_table: (0..batch * max_blocks).collect(),
        rows: vec![bf16::ZERO; batch * max_blocks * cfg.page_size * width],
    };
    for (b, &start) in starts.iter().enumerate() {
        let mut rng = Rng::new(seed, stream::CACHE + b as u64);
        let mut row = vec![0.0f32; width];
        for pos in start.saturating_sub(cfg.window)..start {
            rng.fill_normal(&mut row, 0.0, 1.0);
            let rms = (row.iter().map(|v| v * v).sum::<f32>() / width as f32).sqrt();
            let Some(slot) = cache.slot(b, pos) else {
                continue;
            };
            for (o, v) in cache.rows[slot * width..(slot + 1) * width]
                .iter_mut()
                .zip(&row)
            {
                *o = bf16::from_f32(v / rms);
            }
        }
    }
    cache
}

/// Unit-RMS bf16 rows drawn from `rng` into `dst` (`width` per row).
fn unit_rms_rows(rng: &mut Rng, dst: &mut [bf16], width: usize) {
    let mut row = vec![0.0f32; width];
    for out in dst.chunks_mut(width) {
        rng.fill_normal(&mut row, 0.0, 1.0);
        let rms = (row.iter().map(|v| v * v).sum::<f32>() / width as f32).sqrt();
        for (o, v) in out.iter_mut().zip(&row) {
            *o = bf16::from_f32(v / rms);
        }
    }
}

/// The HCA compressor, its state (`N(0, 1)` kv and scores at each sequence's positions
/// `start - start % ratio .. start`) and its compressed cache (rows completed before `start`).
///
/// # Panics
/// If a start's step ends past `usize::MAX`.
pub fn generate_hca(cfg: &Dsv4Config, starts: &[usize], seed: u64) -> HcaParts {
    let (ratio, width, d) = (cfg.hca_ratio, cfg.head_dim, cfg.hidden);
    let last = step_end(starts);
    let max_rows = (last / ratio).max(1);
    let batch = starts.len();
    let mut state = CompressorState {
        ratio,
        width,
        kv: vec![0.0; batch * ratio * width],
        score: vec![0.0; batch * ratio * width],
    };
    let mut cache = CompressedCache {
        width,
        max_rows,
        rows: vec![bf16::ZERO; batch * max_rows * width],
    };
    for (b, &start) in starts.iter().enumerate() {
        let mut rng = Rng::new(seed, stream::HCA_STATE + b as u64);
        for pos in start - start % ratio..start {
            let row = (b * ratio + pos % ratio) * width;
            rng.fill_normal(&mut state.kv[row..row + width], 0.0, 1.0);
            rng.fill_normal(&mut state.score[row..row + width], 0.0, 1.0);
        }
        let done = start / ratio;
        let mut rng = Rng::new(seed, stream::HCA_CACHE + b as u64);
        let first = b * max_rows * width;
        unit_rms_rows(
            &mut rng,
            &mut cache.rows[first..first + done * width],
            width,
        );
    }
    let id = stream::HCA;
    HcaParts {
        compressor: CompressorWeights {
            wkv: to_bf16(&projection(seed, id, width, d)),
            wgate: to_bf16(&projection(seed, id + 1, width, d)),
            ape: normal(seed, id + 2, ratio * width, 0.0, 0.1),
            norm: normal(seed, id + 3, width, 1.0, 0.1),
        },
        state,
        cache,
    }
}

/// An overlapping compressor of output width `width` and its state for sequences at `starts`:
/// `N(0, 1)` rows at positions `max(0, w0 - ratio) .. start`, `w0` the start of the open window
/// (the previous window and the open one), zeros elsewhere.
fn overlap_parts(
    cfg: &Dsv4Config,
    starts: &[usize],
    seed: u64,
    id: u64,
    width: usize,
) -> (CompressorWeights, OverlapState) {
    let (ratio, d) = (cfg.csa_ratio, cfg.hidden);
    let wide = 2 * width;
    let ring = 2 * ratio;
    let mut state = OverlapState {
        ratio,
        width,
        kv: vec![0.0; starts.len() * ring * wide],
        score: vec![0.0; starts.len() * ring * wide],
    };
    for (b, &start) in starts.iter().enumerate() {
        let mut rng = Rng::new(seed, stream::CSA_STATE + 2 * b as u64 + id);
        let w0 = start - start % ratio;
        for pos in w0.saturating_sub(ratio)..start {
            let row = (b * ring + pos % ring) * wide;
            rng.fill_normal(&mut state.kv[row..row + wide], 0.0, 1.0);
            rng.fill_normal(&mut state.score[row..row + wide], 0.0, 1.0);
        }
    }
    let id = stream::CSA + 8 * id;
    let weights = CompressorWeights {
        wkv: to_bf16(&projection(seed, id, wide, d)),
        wgate: to_bf16(&projection(seed, id + 1, wide, d)),
        ape: normal(seed, id + 2, ratio * wide, 0.0, 0.1),
        norm: normal(seed, id + 3, width, 1.0, 0.1),
    };
    (weights, state)
}

/// The CSA compressor, indexer and caches for sequences at `starts`: compressed rows completed
/// before `start` are unit-RMS bf16 (main cache) and int8 rows of unit-RMS draws (index cache).
///
/// # Panics
/// If a start's step ends past `usize::MAX`.
pub fn generate_csa(cfg: &Dsv4Config, starts: &[usize], seed: u64) -> CsaParts {
    let ratio = cfg.csa_ratio;
    let last = step_end(starts);
    let max_rows = (last / ratio).max(1);
    let batch = starts.len();
    let (compressor, state) = overlap_parts(cfg, starts, seed, 0, cfg.head_dim);
    let (index_compressor, index_state) = overlap_parts(cfg, starts, seed, 1, cfg.index_head_dim);
    let (hd, id_w) = (cfg.head_dim, cfg.index_head_dim);
    let mut cache = CompressedCache {
        width: hd,
        max_rows,
        rows: vec![bf16::ZERO; batch * max_rows * hd],
    };
    let mut index_cache = IndexCache {
        width: id_w,
        max_rows,
        q: vec![0; batch * max_rows * id_w],
        scale: vec![0.0; batch * max_rows],
    };
    for (b, &start) in starts.iter().enumerate() {
        let done = start / ratio;
        let mut rng = Rng::new(seed, stream::CSA_CACHE + 2 * b as u64);
        let first = b * max_rows * hd;
        unit_rms_rows(&mut rng, &mut cache.rows[first..first + done * hd], hd);
        let mut rng = Rng::new(seed, stream::CSA_CACHE + 2 * b as u64 + 1);
        let mut row = vec![0.0f32; id_w];
        for i in 0..done {
            rng.fill_normal(&mut row, 0.0, 1.0);
            let (sc, q) = quantize_row(&row);
            let r = b * max_rows + i;
            index_cache.scale[r] = sc;
            index_cache.q[r * id_w..(r + 1) * id_w].copy_from_slice(&q);
        }
    }
    let id = stream::CSA + 32;
    let n_idx = cfg.index_heads * id_w;
    CsaParts {
        compressor,
        state,
        cache,
        index_compressor,
        index_state,
        index_cache,
        wq_idx: Int8Matrix::quantize(
            &projection(seed, id, n_idx, cfg.q_lora_rank),
            n_idx,
            cfg.q_lora_rank,
        ),
        w_weights: to_bf16(&projection(seed, id + 1, cfg.index_heads, cfg.hidden)),
    }
}

/// The step's inputs: `x_hc ~ U(-1, 1)`, token ids uniform over the vocabulary.
pub fn generate_inputs(cfg: &Dsv4Config, starts: &[usize], seed: u64) -> StepInputs {
    let n_tokens = starts.len() * TOKENS_PER_SEQ;
    let mut rng = Rng::new(seed, stream::X);
    let x_hc = (0..n_tokens * cfg.hc_mult * cfg.hidden)
        .map(|_| 2.0 * rng.uniform_open0() - 1.0)
        .collect();
    let mut rng = Rng::new(seed, stream::TOKENS);
    let token_ids = (0..n_tokens)
        .map(|_| (rng.next_u64() % cfg.vocab_size as u64) as u32)
        .collect();
    StepInputs {
        starts: starts.to_vec(),
        real_tokens: vec![TOKENS_PER_SEQ; starts.len()],
        token_ids,
        x_hc,
    }
}

/// Everything for one decode step at `starts` (see [`MIXED_STARTS`]).
pub fn generate_fixture(
    cfg: &Dsv4Config,
    starts: &[usize],
    seed: u64,
) -> Result<Dsv4Fixture, FixtureError> {
    cfg.validate()?;
    if starts.is_empty() {
        return Err(FixtureError::NoSequence);
    }
    for (seq, &start) in starts.iter().enumerate() {
        let last = start.saturating_add(TOKENS_PER_SEQ - 1);
        if last >= cfg.max_position {
            return Err(FixtureError::StartPastMaxPosition {
                seq,
                start,
                last,
                max: cfg.max_position,
            });
        }
    }
    Ok(Dsv4Fixture {
        config: cfg.clone(),
        attn: generate_attn_weights(cfg, seed),
        moe: generate_moe_weights(cfg, seed),
        window: generate_window_cache(cfg, starts, seed),
        hca: generate_hca(cfg, starts, seed),
        csa: generate_csa(cfg, starts, seed),
        inputs: generate_inputs(cfg, starts, seed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixtures_are_deterministic_and_seeds_differ() {
        let cfg = Dsv4Config::tiny();
        let a = generate_fixture(&cfg, &MIXED_STARTS, 7).unwrap();
        assert_eq!(a, generate_fixture(&cfg, &MIXED_STARTS, 7).unwrap());
        let b = generate_fixture(&cfg, &MIXED_STARTS, 8).unwrap();
        assert_ne!(a.attn.wq_b, b.attn.wq_b);
        assert_ne!(a.inputs.x_hc, b.inputs.x_hc);
        assert!(a.inputs.x_hc.iter().all(|v| (-1.0..=1.0).contains(v)));
        // Hash rows name distinct, valid experts.
        for row in a.moe.tid2eid.chunks(cfg.n_activated_experts) {
            assert!(row.iter().all(|&e| (e as usize) < cfg.n_routed_experts));
            assert!(row.iter().enumerate().all(|(i, e)| !row[..i].contains(e)));
        }
    }

    #[test]
    fn int8_quantisation_is_per_row_and_close() {
        let w = [0.6f32, -1.0, 0.25, 0.0, 0.0, 0.0, 2.0, -0.01, 1.0];
        let m = Int8Matrix::quantize(&w, 3, 3);
        assert_eq!(m.row(0), &[76, -127, 32]);
        assert_eq!(m.scale[1], 0.0);
        assert_eq!(m.row(1), &[0, 0, 0]);
        for r in 0..3 {
            for c in 0..3 {
                let back = f32::from(m.q[r * 3 + c]) * m.scale[r];
                assert!((back - w[r * 3 + c]).abs() <= m.scale[r] * 0.5 + 1e-7);
            }
        }
    }

    #[test]
    fn window_cache_fills_only_the_readable_rows_with_unit_rms() {
        let cfg = Dsv4Config::tiny();
        let f = generate_fixture(&cfg, &MIXED_STARTS, 3).unwrap();
        for (b, &start) in MIXED_STARTS.iter().enumerate() {
            for pos in 0..start + TOKENS_PER_SEQ {
                let row = f.window.row(f.window.slot(b, pos).unwrap());
                let ms = row.iter().map(|v| v.to_f32().powi(2)).sum::<f32>() / row.len() as f32;
                if pos < start && pos + cfg.window >= start {
                    assert!((ms - 1.0).abs() < 0.02, "seq {b} pos {pos}: {ms}");
                } else {
                    assert_eq!(ms, 0.0, "seq {b} pos {pos}");
                }
            }
        }
        assert!(matches!(
            generate_fixture(&cfg, &[cfg.max_position - 1], 1),
            Err(FixtureError::StartPastMaxPosition { seq: 0, .. })
        ));
    }
}
