//! What one decode step of a DeepSeek-V4 layer must move and compute, phase by phase in
//! dependency order (the phases of the task graph, `orchestrate.rs`): the numerators of the
//! bandwidth share and of the per-phase bound, where each phase takes the longest of its
//! bytes at the machine's bandwidth, its float FLOPs at the matrix peak and its int8
//! operations at the int8 peak, and the phases add up (a phase cannot start before the one
//! it depends on ends).

use super::config::{Dsv4Config, LayerKind};
use super::fixture::TOKENS_PER_SEQ;
pub use crate::phase_cost::{Peaks, PhaseCost};

/// A layer step's phases, in dependency order (index = timing slot).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerCost {
    /// The phases.
    pub phases: Vec<PhaseCost>,
}

impl LayerCost {
    /// An SWA, CSA or HCA step with sequences starting at `starts` (`TOKENS_PER_SEQ` tokens
    /// each). CSA adds its compressors' and head weights' projections, `W_idx` to the query
    /// projection's phase, its ring rows, index-cache reads and int8 scores to the writes
    /// phase, and each token's top-k compressed rows to the attention.
    pub fn attn_step(c: &Dsv4Config, kind: LayerKind, starts: &[usize]) -> LayerCost {
        let f = |v: usize| v as f64;
        let t = f(starts.len() * TOKENS_PER_SEQ);
        let (d, hd, h, ql) = (f(c.hidden), f(c.head_dim), f(c.n_heads), f(c.q_lora_rank));
        let (g, r, hcd) = (f(c.o_groups), f(c.o_lora_rank), f(c.hc_mult * c.hidden));
        let mix = f(c.hc_mix());
        let hca = kind == LayerKind::Hca;
        let csa = kind == LayerKind::Csa;
        let (ihd, ih) = (f(c.index_head_dim), f(c.index_heads));
        // CSA: both overlapping compressors (`[2·W, D]` kv and gate each) and `W_w`.
        let proj_rows = ql
            + hd
            + if hca { 2.0 * hd } else { 0.0 }
            + if csa { 4.0 * hd + 4.0 * ihd + ih } else { 0.0 };
        // CSA: the index rows each sequence scores (the most any of its tokens sees) and the
        // scores' int8 work per token.
        let (mut index_rows, mut index_macs, mut csa_closing) = (0.0, 0.0, 0.0);
        // Candidates each token scores: its visible window, and for HCA its compressed rows.
        let mut cands = 0.0;
        let mut closing = 0.0;
        let csa_rows = (starts.iter().max().copied().unwrap_or(0) + TOKENS_PER_SEQ) / c.csa_ratio;
        for &s in starts {
            if csa {
                let last = s + TOKENS_PER_SEQ - 1;
                index_rows += f(((last + 1) / c.csa_ratio).min(csa_rows.max(1)));
            }
            for p in s..s + TOKENS_PER_SEQ {
                cands += f(p.min(c.window - 1) + 1);
                if csa {
                    let visible = ((p + 1) / c.csa_ratio).min(csa_rows.max(1));
                    cands += f(visible.min(c.index_topk));
                    index_macs += f(visible) * ih * ihd;
                    csa_closing += f(usize::from((p + 1) % c.csa_ratio == 0));
                }
                if hca {
                    cands += f(((p + 1) / c.hca_ratio).min(c.max_position / c.hca_ratio));
                    closing += f(usize::from((p + 1) % c.hca_ratio == 0));
                }
            }
        }
        let ratio = f(c.hca_ratio);
        let phases = vec![
            PhaseCost {
                name: "hc_pre",
                bytes: 4.0 * mix * hcd + 4.0 * t * hcd,
                flops: 2.0 * t * mix * hcd,
                int8_ops: 0.0,
            },
            PhaseCost {
                name: "projections",
                bytes: 2.0 * proj_rows * d,
                flops: 2.0 * t * proj_rows * d,
                int8_ops: 0.0,
            },
            PhaseCost {
                name: "q_b",
                bytes: h * hd * ql
                    + 4.0 * h * hd
                    + if csa {
                        ih * ihd * ql + 4.0 * ih * ihd
                    } else {
                        0.0
                    },
                flops: 0.0,
                int8_ops: 2.0 * t * (h * hd + if csa { ih * ihd } else { 0.0 }) * ql,
            },
            PhaseCost {
                name: "kv_write+compress",
                bytes: 2.0 * t * hd
                    + if hca {
                        8.0 * t * hd + closing * (8.0 * ratio * hd + 2.0 * hd)
                    } else {
                        0.0
                    }
                    // CSA: each token's `[kv | score]` rows (2·W each, both compressors),
                    // a closing token's 8-row pool and its rows written, the index rows
                    // scored (int8 and a scale each).
                    + if csa {
                        16.0 * t * (hd + ihd)
                            + csa_closing * (128.0 * (hd + ihd) + 2.0 * hd + ihd + 4.0)
                            + index_rows * (ihd + 4.0)
                    } else {
                        0.0
                    },
                flops: 0.0,
                int8_ops: 2.0 * index_macs,
            },
            PhaseCost {
                name: "attention",
                bytes: 2.0 * hd * cands,
                flops: 4.0 * h * hd * cands,
                int8_ops: 0.0,
            },
            PhaseCost {
                name: "wo_a",
                bytes: 2.0 * g * r * (h / g) * hd,
                flops: 2.0 * t * g * r * (h / g) * hd,
                int8_ops: 0.0,
            },
            PhaseCost {
                name: "wo_b",
                bytes: d * g * r + 4.0 * d,
                flops: 0.0,
                int8_ops: 2.0 * t * d * g * r,
            },
            PhaseCost {
                name: "hc_post",
                bytes: 8.0 * t * hcd,
                flops: 0.0,
                int8_ops: 0.0,
            },
        ];
        LayerCost { phases }
    }

    /// All bytes.
    pub fn bytes(&self) -> f64 {
        self.phases.iter().map(|p| p.bytes).sum()
    }

    /// All float FLOPs.
    pub fn flops(&self) -> f64 {
        self.phases.iter().map(|p| p.flops).sum()
    }

    /// All int8 operations.
    pub fn int8_ops(&self) -> f64 {
        self.phases.iter().map(|p| p.int8_ops).sum()
    }

    /// Seconds of one phase at the machine's limits: the longest of its bytes, FLOPs and int8
    /// operations at their rates.
    pub fn phase_s(p: &PhaseCost, m: &Peaks) -> f64 {
        p.bound_s(m)
    }

    /// The roofline bound in seconds: the whole step's bytes, FLOPs and int8 operations each
    /// at its rate, the longest of the three (they are assumed to overlap perfectly, which the
    /// phases' dependencies do not allow: a lower bound under the per-phase one).
    pub fn roofline_s(&self, m: &Peaks) -> f64 {
        PhaseCost {
            name: "step",
            bytes: self.bytes(),
            flops: self.flops(),
            int8_ops: self.int8_ops(),
        }
        .bound_s(m)
    }

    /// The per-phase bound in seconds: the phases one after the other, each at its limit.
    pub fn phase_bound_s(&self, m: &Peaks) -> f64 {
        self.phases.iter().map(|p| LayerCost::phase_s(p, m)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_swa_streams_its_weights_once_and_hca_adds_the_compressor() {
        let c = Dsv4Config::flash();
        let starts = [8192; 4];
        let swa = LayerCost::attn_step(&c, LayerKind::Swa, &starts);
        let hca = LayerCost::attn_step(&c, LayerKind::Hca, &starts);
        let weights = 24.0 * 16384.0 * 4.0 // hc mix fp32
            + 2.0 * (1024.0 + 512.0) * 4096.0 // Wq_a, Wkv bf16
            + 32768.0 * 1024.0 + 4.0 * 32768.0 // Wq_b int8 + scales
            + 2.0 * 8.0 * 1024.0 * 4096.0 // Wo_a bf16
            + 4096.0 * 8192.0 + 4.0 * 4096.0; // Wo_b int8 + scales
        let acts = swa.bytes() - weights;
        assert!(acts > 0.0 && acts < 4e6, "activations and KV: {acts}");
        // HCA: the two compressor projections (2 x 512 x 4096 bf16), 64 more candidates per
        // token, and the state rows.
        let extra = hca.bytes() - swa.bytes();
        let want = 2.0 * 2.0 * 512.0 * 4096.0 + 8.0 * 64.0 * 1024.0 + 8.0 * 8.0 * 512.0;
        assert!((extra - want).abs() < 1.0, "{extra} vs {want}");
        let m = Peaks {
            gbs: 10.0,
            gflops: 1e6,
            int8_gops: 1e6,
        };
        assert!((swa.phase_bound_s(&m) - swa.bytes() / 1e10).abs() < 1e-9);
        assert!((swa.roofline_s(&m) - swa.bytes() / 1e10).abs() < 1e-9);
        // At a low compute peak the attention phase becomes compute-bound.
        let slow = Peaks { gflops: 1.0, ..m };
        assert!(swa.phase_bound_s(&slow) > swa.phase_bound_s(&m));
        // The roofline overlaps the step's bytes with its FLOPs: at most the per-phase bound,
        // at least each of its terms.
        assert!(swa.roofline_s(&slow) <= swa.phase_bound_s(&slow));
        assert!(swa.roofline_s(&slow) >= swa.flops() / 1e9);
        assert!(swa.roofline_s(&slow) >= swa.bytes() / 1e10);
    }

    #[test]
    fn flash_csa_adds_its_compressors_indexer_and_top_k_rows() {
        let c = Dsv4Config::flash();
        let starts = [8192; 4];
        let swa = LayerCost::attn_step(&c, LayerKind::Swa, &starts);
        let csa = LayerCost::attn_step(&c, LayerKind::Csa, &starts);
        // Projections: both compressors' kv and gate (2 x 1024 and 2 x 256 rows) and W_w
        // (64 rows), bf16 over 4096.
        let proj = 2.0 * (2.0 * 1024.0 + 2.0 * 256.0 + 64.0) * 4096.0;
        assert_eq!(csa.phases[1].bytes - swa.phases[1].bytes, proj);
        // W_idx int8 and its scales; its int8 work for 8 tokens.
        assert_eq!(
            csa.phases[2].bytes - swa.phases[2].bytes,
            8192.0 * 1024.0 + 4.0 * 8192.0
        );
        assert_eq!(
            csa.phases[2].int8_ops - swa.phases[2].int8_ops,
            2.0 * 8.0 * 8192.0 * 1024.0
        );
        // Ring rows (no window closes at 8192), 2048 index rows of 128 + 4 per sequence, and
        // 2048 visible rows x 64 heads x 128 per token scored.
        let writes = 16.0 * 8.0 * (512.0 + 128.0) + 4.0 * 2048.0 * 132.0;
        assert_eq!(csa.phases[3].bytes - swa.phases[3].bytes, writes);
        assert_eq!(csa.phases[3].int8_ops, 2.0 * 8.0 * 2048.0 * 64.0 * 128.0);
        // Each token attends to 512 compressed rows more.
        assert_eq!(
            csa.phases[4].bytes - swa.phases[4].bytes,
            8.0 * 512.0 * 2.0 * 512.0
        );
    }

    #[test]
    fn an_empty_window_costs_one_row() {
        let c = Dsv4Config::small();
        let a = LayerCost::attn_step(&c, LayerKind::Swa, &[0]);
        // Positions 0 and 1 see 1 and 2 rows.
        assert_eq!(a.phases[4].bytes, 2.0 * 64.0 * 3.0);
    }
}
