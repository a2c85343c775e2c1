//! What a decode or prefill step must move and compute: weight bytes streamed, KV bytes read
//! and written, matmul and attention FLOPs — the numerators of the bandwidth share, the FLOP
//! rate and the roofline bound (`docs/performance.md`) — and the same step as phases in
//! dependency order ([`DecodePhases`]), the numerators of the per-phase bound.

use super::config::Qwen3Config;
use super::quant::{Int8Acts, WeightFormat};
use super::weights::LayerWeights;
use crate::phase_cost::{Limit, Peaks, PhaseCost};

/// Bytes and FLOPs of one decode or prefill step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepCost {
    /// Weight bytes streamed: every layer run (a shared weight set counts once per layer: it is
    /// streamed again each layer), plus the final norm, the LM head and the gathered embedding
    /// rows when the head runs.
    pub weight_bytes: f64,
    /// KV bytes read by attention (every cached token of every layer, the new one included).
    pub kv_read_bytes: f64,
    /// KV bytes written (the new tokens' K and V rows).
    pub kv_write_bytes: f64,
    /// Matrix-product FLOPs (2 per multiply-add).
    pub matmul_flops: f64,
    /// Attention FLOPs (`q·k` and `p·v`, 2 per multiply-add).
    pub attention_flops: f64,
}

impl StepCost {
    /// A decode step over `layers` layers for sequences of `seq_lens` (current token
    /// included), with the embedding gather and LM head when `with_head`.
    pub fn decode(c: &Qwen3Config, layers: usize, with_head: bool, seq_lens: &[usize]) -> StepCost {
        let b = seq_lens.len() as f64;
        let tokens: f64 = seq_lens.iter().map(|&s| s as f64).sum();
        let (h, v) = (c.hidden_size as f64, c.vocab_size as f64);
        let kv_row = (c.kv_width() * 2) as f64; // bytes of one K (or V) row
        let layers_f = layers as f64;
        let mut cost = StepCost {
            weight_bytes: layers_f * c.layer_weight_bytes() as f64,
            kv_read_bytes: layers_f * tokens * 2.0 * kv_row,
            kv_write_bytes: layers_f * b * 2.0 * kv_row,
            matmul_flops: 2.0 * b * layers_f * c.layer_projection_params() as f64,
            attention_flops: layers_f * 4.0 * (c.q_width() as f64) * tokens,
        };
        if with_head {
            cost.weight_bytes += 4.0 * h + 2.0 * v * h + 2.0 * b * h;
            cost.matmul_flops += 2.0 * b * v * h;
        }
        cost
    }

    /// The same step with the projections and the LM head held in `format` (bytes change,
    /// FLOPs do not); `layers` and `with_head` as the step was costed with.
    pub fn in_format(
        mut self,
        c: &Qwen3Config,
        layers: usize,
        with_head: bool,
        format: WeightFormat,
    ) -> StepCost {
        let bf16 = WeightFormat::Bf16;
        let saved =
            |r: usize, k: usize| bf16.matrix_bytes(r, k) as f64 - format.matrix_bytes(r, k) as f64;
        let per_layer: f64 = LayerWeights::shapes(c)[..7]
            .iter()
            .map(|&(_, [r, k])| saved(r, k))
            .sum();
        self.weight_bytes -= layers as f64 * per_layer;
        if with_head {
            self.weight_bytes -= saved(c.vocab_size, c.hidden_size);
        }
        self
    }

    /// A prefill step of one sequence over `layers` layers: `prompt_len` new tokens at
    /// positions `past_len..past_len + prompt_len` (the first `past_len` already cached), with
    /// the embedding gather and the LM head when `with_head` — the head runs for the step's
    /// last position only, as `Session::prefill` computes it.
    ///
    /// Every projection runs for every new token; position `p` (0-based) attends causally to
    /// the `p + 1` tokens `0..=p`, so attention costs `4 * q_width` FLOPs per visible token per
    /// layer (`q·k` and `p·v`). Bytes are the compulsory traffic: each layer's weights once,
    /// each visible KV row once per layer, the new tokens' K/V rows written once.
    pub fn prefill(
        c: &Qwen3Config,
        layers: usize,
        with_head: bool,
        prompt_len: usize,
        past_len: usize,
    ) -> StepCost {
        let (n, past) = (prompt_len as f64, past_len as f64);
        let (h, v) = (c.hidden_size as f64, c.vocab_size as f64);
        let kv_row = (c.kv_width() * 2) as f64; // bytes of one K (or V) row
        let layers_f = layers as f64;
        // Sum over the new positions of the tokens each one sees: sum_{j=past+1}^{past+n} j.
        let visible = n * past + n * (n + 1.0) / 2.0;
        let mut cost = StepCost {
            weight_bytes: layers_f * c.layer_weight_bytes() as f64,
            kv_read_bytes: layers_f * (past + n) * 2.0 * kv_row,
            kv_write_bytes: layers_f * n * 2.0 * kv_row,
            matmul_flops: 2.0 * n * layers_f * c.layer_projection_params() as f64,
            attention_flops: layers_f * 4.0 * (c.q_width() as f64) * visible,
        };
        if with_head {
            cost.weight_bytes += 4.0 * h + 2.0 * v * h + 2.0 * n * h;
            cost.matmul_flops += 2.0 * v * h;
        }
        cost
    }

    /// All bytes moved.
    pub fn bytes(&self) -> f64 {
        self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes
    }

    /// All FLOPs.
    pub fn flops(&self) -> f64 {
        self.matmul_flops + self.attention_flops
    }

    /// The roofline bound in seconds: `max(bytes / bandwidth, flops / peak)` for a bandwidth
    /// in GB/s and a peak in GFLOP/s.
    pub fn roofline_s(&self, gbs: f64, gflops: f64) -> f64 {
        (self.bytes() / (gbs * 1e9)).max(self.flops() / (gflops * 1e9))
    }
}

/// Which compute rate a phase's float work runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// The bf16 GEMM path the step's projections take (AMX tiles, `vdpbf16ps` or fp32 FMA,
    /// by batch and CPU).
    Matrix,
    /// fp32 FMA: products that widen int8 weights to fp32 (and the head's int8 LM head).
    Fma,
    /// The instruction the decode attention kernel's products run on (`vdpbf16ps` for the
    /// AVX-512 BF16 kernels, fp32 FMA for the AVX2 and portable ones).
    Attention,
}

/// A decode step phase: its bytes and operations summed over the layers it repeats in (every
/// layer's instance is the same shape, so the sum of their bounds is the bound of the sum), and
/// the engine its float work runs on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepPhase {
    /// Bytes and operations.
    pub cost: PhaseCost,
    /// The rate its float FLOPs run at.
    pub engine: Engine,
}

/// The machine's denominators for a decode step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodePeaks {
    /// Streaming read bandwidth, GB/s.
    pub gbs: f64,
    /// Peak of the bf16 GEMM path the step's batch takes, GFLOP/s.
    pub matrix_gflops: f64,
    /// fp32 FMA peak, GFLOP/s.
    pub fma_gflops: f64,
    /// Peak of the instruction the decode attention kernel's products run on, GFLOP/s.
    pub attention_gflops: f64,
    /// int8 dot-product peak of the int8 path (0 when the step has no int8 products).
    pub int8_gops: f64,
}

impl DecodePeaks {
    /// The denominators of a phase on `engine`.
    pub fn on(&self, engine: Engine) -> Peaks {
        Peaks {
            gbs: self.gbs,
            gflops: match engine {
                Engine::Matrix => self.matrix_gflops,
                Engine::Fma => self.fma_gflops,
                Engine::Attention => self.attention_gflops,
            },
            int8_gops: self.int8_gops,
        }
    }
}

/// A decode step as phases in dependency order: per layer the input norm, the q/k/v
/// projections with their epilogue (q/k norm + RoPE + the K/V writes), attention, `o_proj`,
/// the post-attention norm, gate/up + SwiGLU and down (each waits for the one before, through
/// the tensors or barrier tasks of `orchestrate.rs`), with the embedding gather before the
/// layers and the head (final norm, LM head, argmax) after them.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodePhases {
    /// The phases, in dependency order.
    pub phases: Vec<StepPhase>,
}

/// Index of each phase in [`DecodePhases::phases`] (a task's phase in a recorded step).
pub mod phase {
    /// Embedding gather (or the layers variant's cast).
    pub const INPUT: usize = 0;
    /// Input RMSNorm.
    pub const ATTN_NORM: usize = 1;
    /// q/k/v projections with their epilogue: q/k norm, RoPE, the new K/V rows into the pools.
    pub const QKV: usize = 2;
    /// Decode attention (and the split-KV combine).
    pub const ATTENTION: usize = 3;
    /// Output projection into the residual.
    pub const O_PROJ: usize = 4;
    /// Post-attention RMSNorm.
    pub const MLP_NORM: usize = 5;
    /// Gate and up projections with SwiGLU.
    pub const GATE_UP: usize = 6;
    /// Down projection into the residual.
    pub const DOWN: usize = 7;
    /// Final norm, LM head, argmax (or the layers variant's cast out).
    pub const HEAD: usize = 8;
    /// Phases of a step.
    pub const COUNT: usize = 9;
}

impl DecodePhases {
    /// The phases of a decode step over `layers` layers for sequences of `seq_lens` (current
    /// token included), the embedding gather and the LM head when `with_head`, projections and
    /// LM head held in `format`. Bytes and FLOPs add up to [`StepCost::decode`] in that format.
    pub fn decode(
        c: &Qwen3Config,
        layers: usize,
        with_head: bool,
        seq_lens: &[usize],
        format: WeightFormat,
    ) -> DecodePhases {
        let f = |v: usize| v as f64;
        let (r, l) = (f(seq_lens.len()), f(layers));
        let tokens: f64 = seq_lens.iter().map(|&s| f(s)).sum();
        let (h, d, kv_row) = (f(c.hidden_size), f(c.head_dim), f(c.kv_width() * 2));
        let shapes = LayerWeights::shapes(c);
        let w8a8 = format == WeightFormat::Int8(Int8Acts::Quantised);
        // Projections: weights at the format's size; W8A8 counts int8 operations, the rest
        // float FLOPs (int8 weights with wide activations are widened to fp32 and FMA'd).
        let engine = if format.is_int8() {
            Engine::Fma
        } else {
            Engine::Matrix
        };
        let proj = |name: &'static str, which: &[usize]| {
            let bytes: f64 = which
                .iter()
                .map(|&i| f(format.matrix_bytes(shapes[i].1[0], shapes[i].1[1])))
                .sum();
            let macs: f64 = which
                .iter()
                .map(|&i| f(shapes[i].1[0] * shapes[i].1[1]))
                .sum();
            let ops = 2.0 * r * l * macs;
            StepPhase {
                cost: PhaseCost {
                    name,
                    bytes: l * bytes,
                    flops: if w8a8 { 0.0 } else { ops },
                    int8_ops: if w8a8 { ops } else { 0.0 },
                },
                engine,
            }
        };
        let vector = |name: &'static str, bytes: f64| StepPhase {
            cost: PhaseCost {
                name,
                bytes,
                flops: 0.0,
                int8_ops: 0.0,
            },
            engine: Engine::Fma,
        };
        let (head_bytes, head_flops, input_bytes) = if with_head {
            let (v, s) = (f(c.vocab_size), r);
            let w = f(format.matrix_bytes(c.vocab_size, c.hidden_size));
            (4.0 * h + w, 2.0 * s * v * h, 2.0 * r * h)
        } else {
            (0.0, 0.0, 0.0)
        };
        let head_engine = if format.is_int8() {
            Engine::Fma
        } else {
            Engine::Matrix
        };
        // The projections' epilogue also reads the q/k norm weights and writes the new K and V
        // rows.
        let mut qkv = proj("qkv", &[0, 1, 2]);
        qkv.cost.bytes += l * (8.0 * d + r * 2.0 * kv_row);
        let phases = vec![
            vector("input", input_bytes),
            vector("attn_norm", l * 4.0 * h),
            qkv,
            StepPhase {
                cost: PhaseCost {
                    name: "attention",
                    bytes: l * tokens * 2.0 * kv_row,
                    flops: l * 4.0 * f(c.q_width()) * tokens,
                    int8_ops: 0.0,
                },
                engine: Engine::Attention,
            },
            proj("o_proj", &[3]),
            vector("mlp_norm", l * 4.0 * h),
            proj("gate_up", &[4, 5]),
            proj("down", &[6]),
            StepPhase {
                cost: PhaseCost {
                    name: "head",
                    bytes: head_bytes,
                    flops: head_flops,
                    int8_ops: 0.0,
                },
                engine: head_engine,
            },
        ];
        debug_assert_eq!(phases.len(), phase::COUNT);
        DecodePhases { phases }
    }

    /// Seconds of phase `i` at the machine's limits, and what binds it.
    pub fn phase_bound(&self, i: usize, m: &DecodePeaks) -> (f64, Limit) {
        let p = &self.phases[i];
        p.cost.bound(&m.on(p.engine))
    }

    /// The per-phase bound in seconds: the phases one after the other, each at its limit.
    pub fn bound_s(&self, m: &DecodePeaks) -> f64 {
        (0..self.phases.len())
            .map(|i| self.phase_bound(i, m).0)
            .sum()
    }

    /// All bytes.
    pub fn bytes(&self) -> f64 {
        self.phases.iter().map(|p| p.cost.bytes).sum()
    }

    /// All float FLOPs and int8 operations.
    pub fn ops(&self) -> f64 {
        self.phases
            .iter()
            .map(|p| p.cost.flops + p.cost.int8_ops)
            .sum()
    }
}

/// The phase of a recorded task of a decode step, by kernel, given the phase before it (a
/// projection's phase follows from what ran before it); `None` for tasks that belong to no
/// phase (barriers).
fn phase_of(func: u32, before: usize) -> Option<usize> {
    use super::ops;
    let is = |k: simpler_core::KernelId| k.0 == func;
    Some(if is(ops::EMBED) || is(ops::CAST_BF16_F32) {
        phase::INPUT
    } else if is(ops::RMS_NORM_DEFERRED) {
        if before == phase::O_PROJ {
            phase::MLP_NORM
        } else {
            phase::ATTN_NORM
        }
    } else if is(ops::GEMM_TILE) {
        match before {
            phase::ATTENTION | phase::O_PROJ => phase::O_PROJ,
            _ => phase::DOWN,
        }
    } else if is(ops::GEMM_ROPE_STEP) {
        phase::QKV
    } else if is(ops::ATTN_DECODE) || is(ops::ATTN_COMBINE) {
        phase::ATTENTION
    } else if is(ops::GATE_UP_SWIGLU) {
        phase::GATE_UP
    } else if is(ops::COPY_F32)
        || is(ops::RMS_NORM)
        || is(ops::LM_HEAD_TILE)
        || is(ops::ARGMAX_COMBINE)
        || is(ops::CAST_F32_BF16)
    {
        phase::HEAD
    } else {
        return None;
    })
}

/// Time of each phase of a recorded decode step (`[phase::COUNT]`, ns): the blocks taken in
/// order of their start, each maximal run of one phase (one layer's instance) spanning from
/// its first block's start to its last block's end, the runs of a phase summed. The phases
/// follow one another (each waits for the one before), so what the step's execution span
/// holds beyond the sum is time between phases: one phase's last block done, the next not yet
/// started on any core.
pub fn phase_spans_ns(sw: &simpler_core::trace::SwimlaneRecords) -> [u64; phase::COUNT] {
    let mut blocks: Vec<_> = sw.tasks.iter().filter(|t| t.func != u32::MAX).collect();
    blocks.sort_by_key(|t| t.start);
    let mut spans = [0u64; phase::COUNT];
    // The current run: its phase, first start, last end.
    let mut run: Option<(usize, u64, u64)> = None;
    for t in blocks {
        let before = run.map_or(phase::INPUT, |r| r.0);
        let Some(p) = phase_of(t.func, before) else {
            continue;
        };
        run = match run {
            Some((q, a, b)) if q == p => Some((q, a, b.max(t.end))),
            Some((q, a, b)) => {
                spans[q] += b.saturating_sub(a);
                Some((p, t.start, t.end))
            }
            None => Some((p, t.start, t.end)),
        };
    }
    if let Some((q, a, b)) = run {
        spans[q] += b.saturating_sub(a);
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_0_6b_step_streams_its_weights() {
        let c = Qwen3Config::preset("qwen3-0.6b").unwrap();
        let s = StepCost::decode(&c, c.num_hidden_layers, true, &[256]);
        // Weights ~1.19 GB (06 spec) plus one embedding row.
        assert!(
            (s.weight_bytes / 1e9 - 1.19).abs() < 0.02,
            "{}",
            s.weight_bytes
        );
        assert_eq!(s.kv_read_bytes as usize, c.kv_read_bytes(&[256]));
        assert_eq!(s.kv_write_bytes as usize, c.kv_bytes_per_token());
        assert_eq!(s.matmul_flops as usize, c.matmul_flops_per_step(1));
    }

    /// A shape small enough to count by hand: hidden 4, 2 query heads and 1 KV head of
    /// width 2 (q_width 4, kv_width 2), intermediate 8, vocabulary 10.
    fn hand_config() -> Qwen3Config {
        let mut c = Qwen3Config::preset("tiny").unwrap();
        c.hidden_size = 4;
        c.num_attention_heads = 2;
        c.num_key_value_heads = 1;
        c.head_dim = 2;
        c.intermediate_size = 8;
        c.vocab_size = 10;
        c.num_hidden_layers = 1;
        c
    }

    #[test]
    fn prefill_counts_by_hand() {
        let c = hand_config();
        // Projections per layer: q 4x4 + k, v 2x4 each + o 4x4 + gate, up, down 8x4 each
        // = 16 + 16 + 16 + 96 = 144 multiply-adds per token; weights 2 * 144 bytes plus fp32
        // norms 4 * (4 + 4 + 2 + 2) = 48 -> 336 bytes.
        assert_eq!(c.layer_projection_params(), 144);
        assert_eq!(c.layer_weight_bytes(), 336);

        // 3 new tokens after 2 cached ones, 2 layers, no head: positions 2, 3, 4 see
        // 3 + 4 + 5 = 12 tokens.
        let s = StepCost::prefill(&c, 2, false, 3, 2);
        assert_eq!(s.matmul_flops, 2.0 * 3.0 * 2.0 * 144.0); // 1728
        assert_eq!(s.attention_flops, 2.0 * 4.0 * 4.0 * 12.0); // 384
        assert_eq!(s.weight_bytes, 2.0 * 336.0); // 672
        // A K or V row is 2 bf16 = 4 bytes: 5 tokens x (K + V) x 4 B x 2 layers read,
        // 3 tokens' worth written.
        assert_eq!(s.kv_read_bytes, 80.0);
        assert_eq!(s.kv_write_bytes, 48.0);
        assert_eq!(s.flops(), 2112.0);
        assert_eq!(s.bytes(), 800.0);

        // With the head: one LM-head row product for the last position (10 x 4 MACs), the
        // final norm (4 fp32), the head (10 x 4 bf16) and 3 gathered embedding rows (3 x 4 bf16).
        let h = StepCost::prefill(&c, 2, true, 3, 2);
        assert_eq!(h.matmul_flops, 1728.0 + 80.0);
        assert_eq!(h.weight_bytes, 672.0 + 16.0 + 80.0 + 24.0);
        assert_eq!(h.attention_flops, s.attention_flops);

        // A fresh prompt of 4 tokens: 1 + 2 + 3 + 4 = 10 visible tokens per layer.
        let f = StepCost::prefill(&c, 1, false, 4, 0);
        assert_eq!(f.attention_flops, 4.0 * 4.0 * 10.0);
        assert_eq!(f.kv_read_bytes, 4.0 * 2.0 * 4.0);
    }

    #[test]
    fn a_one_token_prefill_costs_a_decode_step() {
        let c = Qwen3Config::preset("small").unwrap();
        for past in [0, 1, 37, 300] {
            let p = StepCost::prefill(&c, c.num_hidden_layers, true, 1, past);
            let d = StepCost::decode(&c, c.num_hidden_layers, true, &[past + 1]);
            assert_eq!(p, d, "past {past}");
        }
    }

    fn peaks(gbs: f64, matrix: f64, fma: f64) -> DecodePeaks {
        DecodePeaks {
            gbs,
            matrix_gflops: matrix,
            fma_gflops: fma,
            attention_gflops: fma,
            int8_gops: 400.0,
        }
    }

    #[test]
    fn decode_phases_add_up_to_the_step() {
        let c = Qwen3Config::preset("qwen3-0.6b").unwrap();
        let lens = [1024, 1000, 1024, 7];
        for format in [
            WeightFormat::Bf16,
            WeightFormat::Int8(Int8Acts::Quantised),
            WeightFormat::Int8(Int8Acts::Wide),
        ] {
            for head in [true, false] {
                let s = StepCost::decode(&c, 28, head, &lens).in_format(&c, 28, head, format);
                let p = DecodePhases::decode(&c, 28, head, &lens, format);
                assert!((p.bytes() - s.bytes()).abs() < 1.0, "{format:?} {head}");
                assert!((p.ops() - s.flops()).abs() < 1.0, "{format:?} {head}");
            }
        }
    }

    #[test]
    fn phase_bound_by_hand() {
        // hidden 4, q_width 4, kv_width 2, intermediate 8, vocabulary 10 (hand_config).
        let c = hand_config();
        let p = DecodePhases::decode(&c, 1, true, &[3, 5], WeightFormat::Bf16);
        let qkv = &p.phases[phase::QKV].cost;
        // Wq 4x4, Wk and Wv 2x4 bf16; 2 rows x 32 multiply-adds x 2. The epilogue: q/k norm
        // weights (2 x 2 fp32) and 2 rows' new K and V rows (4 bytes each).
        assert_eq!((qkv.bytes, qkv.flops), (64.0 + 16.0 + 16.0, 128.0));
        // 8 cached tokens, K and V rows of 4 bytes; 4 x q_width 4 FLOPs per token.
        let at = &p.phases[phase::ATTENTION].cost;
        assert_eq!((at.bytes, at.flops), (64.0, 128.0));
        // Bandwidth-bound: 96 B at 1 GB/s = 96 ns, 128 FLOP at 100 GFLOP/s = 1.28 ns.
        let m = peaks(1.0, 100.0, 100.0);
        let (s, lim) = p.phase_bound(phase::QKV, &m);
        assert!(
            (s - 96e-9).abs() < 1e-15 && lim == Limit::Bandwidth,
            "{s} {lim:?}"
        );
        // Compute-bound: 128 FLOP at 0.5 GFLOP/s = 256 ns over 96 B at 1 GB/s.
        let slow = peaks(1.0, 0.5, 100.0);
        let (s, lim) = p.phase_bound(phase::QKV, &slow);
        assert!(
            (s - 256e-9).abs() < 1e-15 && lim == Limit::Float,
            "{s} {lim:?}"
        );
        // Attention runs on the FMA rate, not the matrix path's.
        assert_eq!(p.phase_bound(phase::ATTENTION, &slow).1, Limit::Bandwidth);
        let slow_fma = peaks(1.0, 100.0, 0.5);
        assert_eq!(p.phase_bound(phase::ATTENTION, &slow_fma).1, Limit::Float);
        // The bound is the sum of the phases, at least the roofline's.
        let total: f64 = (0..phase::COUNT).map(|i| p.phase_bound(i, &slow).0).sum();
        assert_eq!(p.bound_s(&slow), total);
        let s = StepCost::decode(&c, 1, true, &[3, 5]);
        assert!(p.bound_s(&m) >= s.roofline_s(1.0, 100.0) * (1.0 - 1e-12));
    }

    #[test]
    fn w8a8_projections_count_int8_operations() {
        let c = hand_config();
        let p = DecodePhases::decode(&c, 1, true, &[3], WeightFormat::Int8(Int8Acts::Quantised));
        let o = &p.phases[phase::O_PROJ].cost;
        assert_eq!((o.flops, o.int8_ops), (0.0, 2.0 * 16.0));
        // The head keeps fp32 activations.
        assert_eq!(p.phases[phase::HEAD].cost.flops, 2.0 * 10.0 * 4.0);
        assert_eq!(p.phases[phase::HEAD].engine, Engine::Fma);
    }

    #[test]
    fn recorded_blocks_are_charged_to_their_phase_runs() {
        use super::super::ops;
        use simpler_core::EngineClass;
        use simpler_core::trace::{SwimlaneRecords, TaskRecord};
        let rec = |func: simpler_core::KernelId, core: u32, start: u64, end: u64| TaskRecord {
            task_id: 0,
            func: func.0,
            class: EngineClass::Vector,
            core,
            block: 0,
            dispatch: start,
            start,
            end,
            finish: end,
        };
        // One layer on two cores: the norm, the q, k and v tasks' blocks (a barrier's record
        // among them), attention, o_proj, the post norm, gate/up, down; then the next layer's
        // norm and q/k/v (charged to the same phases).
        let mut tasks = vec![
            rec(ops::RMS_NORM_DEFERRED, 0, 0, 10),
            rec(ops::GEMM_ROPE_STEP, 0, 12, 40),
            rec(ops::GEMM_ROPE_STEP, 1, 13, 45),
            rec(ops::GEMM_ROPE_STEP, 1, 50, 52),
            rec(ops::GEMM_ROPE_STEP, 0, 50, 53),
            rec(ops::ATTN_DECODE, 0, 56, 80),
            rec(ops::ATTN_DECODE, 1, 57, 79),
            rec(ops::GEMM_TILE, 0, 81, 90),
            rec(ops::RMS_NORM_DEFERRED, 0, 91, 93),
            rec(ops::GATE_UP_SWIGLU, 1, 95, 120),
            rec(ops::GEMM_TILE, 0, 121, 130),
            rec(ops::RMS_NORM_DEFERRED, 1, 131, 133),
            rec(ops::GEMM_ROPE_STEP, 1, 134, 140),
        ];
        // A barrier's record belongs to no phase.
        tasks.push(TaskRecord {
            func: u32::MAX,
            ..rec(ops::EMBED, 0, 46, 47)
        });
        let sw = SwimlaneRecords {
            tasks,
            ..SwimlaneRecords::default()
        };
        let s = phase_spans_ns(&sw);
        assert_eq!(s[phase::ATTN_NORM], 10 + 2);
        // q, k and v blocks, one run however many tasks: 12..53, then 134..140.
        assert_eq!(s[phase::QKV], 41 + 6);
        assert_eq!(s[phase::ATTENTION], 24);
        assert_eq!(s[phase::O_PROJ], 9);
        assert_eq!(s[phase::MLP_NORM], 2);
        assert_eq!(s[phase::GATE_UP], 25);
        assert_eq!(s[phase::DOWN], 9);
        assert_eq!(s[phase::INPUT] + s[phase::HEAD], 0);
    }
}
