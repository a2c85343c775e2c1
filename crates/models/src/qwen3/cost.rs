//! What a decode step must move and compute: weight bytes streamed, KV bytes read and written,
//! matmul and attention FLOPs — the numerators of the bandwidth share and the roofline bound
//! (`06-performance.md`).

use super::config::Qwen3Config;

/// Bytes and FLOPs of one decode step.
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
}
