//! What a decode or prefill step must move and compute: weight bytes streamed, KV bytes read
//! and written, matmul and attention FLOPs — the numerators of the bandwidth share, the FLOP
//! rate and the roofline bound (`docs/performance.md`).

use super::config::Qwen3Config;
use super::quant::WeightFormat;
use super::weights::LayerWeights;

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

    /// The per-phase bound: weights and matmuls (`max(weights / bw, matmul / peak)`) plus
    /// attention (`max(kv / bw, attention / peak)`). Phases of a layer run one after the
    /// other, so this is the tighter bound when one is FMA-bound and the other bandwidth-bound.
    pub fn phase_bound_s(&self, gbs: f64, gflops: f64) -> f64 {
        let bw = gbs * 1e9;
        let peak = gflops * 1e9;
        let dense = (self.weight_bytes / bw).max(self.matmul_flops / peak);
        let attn =
            ((self.kv_read_bytes + self.kv_write_bytes) / bw).max(self.attention_flops / peak);
        dense + attn
    }
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
        assert!(s.phase_bound_s(20.0, 180.0) >= s.roofline_s(20.0, 180.0));
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
}
