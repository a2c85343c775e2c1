//! DeepSeek-V4 "flash" configuration as data (`docs/dsv4.md`, "Configuration"): the FLASH
//! shapes, small variants for tests, validation whose errors name the field, and JSON in/out.
//!
//! Derived constants (softmax scale, indexer weight scale, the number of hyper-connection mix
//! weights) are methods, not fields, so a configuration cannot contradict itself.

use serde::{Deserialize, Serialize};

/// YaRN parameters of the compressed layers' RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Yarn {
    /// Frequency division of the long-wavelength pairs (16).
    pub factor: f64,
    /// Rotations over the original length above which a pair keeps its frequency (32).
    pub beta_fast: f64,
    /// Rotations below which a pair is fully interpolated (1).
    pub beta_slow: f64,
    /// Context length the base frequencies were trained for (65536).
    pub original_max_position: usize,
}

/// The three attention layer kinds; the MoE layer follows each of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Sliding window only (compress ratio 0).
    Swa,
    /// Overlapping ratio-4 compression plus the indexer's top-k.
    Csa,
    /// Ratio-128 compression, every visible compressed row.
    Hca,
}

/// A DeepSeek-V4 decode layer's shapes and constants.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dsv4Config {
    /// Hidden size `D`.
    pub hidden: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Head dimension (one KV row is this wide; it is both K and V).
    pub head_dim: usize,
    /// Trailing dimensions of each head that carry RoPE (the leading ones do not).
    pub rope_dim: usize,
    /// Query low-rank width (`Wq_a` output).
    pub q_lora_rank: usize,
    /// Output low-rank width per group (`Wo_a[g]` output).
    pub o_lora_rank: usize,
    /// Output projection groups (heads per group = `n_heads / o_groups`).
    pub o_groups: usize,
    /// Sliding-window length in positions (the current one included).
    pub window: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Compress ratio of CSA layers (overlapping windows).
    pub csa_ratio: usize,
    /// Compress ratio of HCA layers.
    pub hca_ratio: usize,
    /// Compressed KV width of the CSA compressor (twice `head_dim`: two overlapping halves).
    pub csa_compress_dim: usize,
    /// Indexer heads.
    pub index_heads: usize,
    /// Indexer head dimension (a power of two: the Hadamard transform).
    pub index_head_dim: usize,
    /// Compressed rows the indexer keeps per token.
    pub index_topk: usize,
    /// Hyper-connection streams (the residual is `hc_mult` streams of `hidden`).
    pub hc_mult: usize,
    /// Sinkhorn iterations, the first (row softmax then columns) included.
    pub hc_sinkhorn_iters: usize,
    /// Hyper-connection epsilon (added to `pre`, to `comb`, and to every Sinkhorn divisor).
    pub hc_eps: f32,
    /// Routed experts.
    pub n_routed_experts: usize,
    /// Experts each token is routed to.
    pub n_activated_experts: usize,
    /// Shared experts (every token).
    pub n_shared_experts: usize,
    /// Expert width (SwiGLU intermediate).
    pub moe_inter_dim: usize,
    /// Factor on the normalised routing weights.
    pub route_scale: f32,
    /// SwiGLU clamp: `gate <= limit`, `|up| <= limit`.
    pub swiglu_limit: f32,
    /// Layers `0..n_hash_layers` route by a token-id table instead of the gate's top-k.
    pub n_hash_layers: usize,
    /// Vocabulary size (rows of the hash-routing table).
    pub vocab_size: usize,
    /// RoPE base of SWA layers (plain RoPE).
    pub rope_theta: f64,
    /// RoPE base of compressed layers (with YaRN).
    pub compress_rope_theta: f64,
    /// YaRN of the compressed layers.
    pub yarn: Yarn,
    /// Positions the RoPE tables cover; a step past it is refused.
    pub max_position: usize,
    /// KV page size in rows.
    pub page_size: usize,
}

/// An invalid configuration; names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The JSON did not parse (serde's message names the field).
    #[error("dsv4 config: {0}")]
    Parse(String),
    /// A field has a value the layers cannot run with.
    #[error("dsv4 config field `{field}` = {value}: {why}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Its value, printed.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// No preset has that name.
    #[error("unknown dsv4 preset `{0}` (known: flash, small, tiny)")]
    UnknownPreset(String),
}

/// Largest size accepted for any dimension: far above FLASH, low enough that products of a few
/// sizes cannot overflow.
const MAX_DIM: usize = 1 << 24;

impl Dsv4Config {
    /// Names accepted by [`Dsv4Config::preset`].
    pub const PRESETS: [&'static str; 3] = ["flash", "small", "tiny"];

    /// The FLASH configuration of the spec.
    pub fn flash() -> Dsv4Config {
        Dsv4Config {
            hidden: 4096,
            n_heads: 64,
            head_dim: 512,
            rope_dim: 64,
            q_lora_rank: 1024,
            o_lora_rank: 1024,
            o_groups: 8,
            window: 128,
            rms_eps: 1e-6,
            csa_ratio: 4,
            hca_ratio: 128,
            csa_compress_dim: 1024,
            index_heads: 64,
            index_head_dim: 128,
            index_topk: 512,
            hc_mult: 4,
            hc_sinkhorn_iters: 20,
            hc_eps: 1e-6,
            n_routed_experts: 256,
            n_activated_experts: 6,
            n_shared_experts: 1,
            moe_inter_dim: 2048,
            route_scale: 1.5,
            swiglu_limit: 10.0,
            n_hash_layers: 3,
            vocab_size: 129280,
            rope_theta: 1e4,
            compress_rope_theta: 160000.0,
            yarn: Yarn {
                factor: 16.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position: 65536,
            },
            max_position: 16384,
            page_size: 128,
        }
    }

    /// A narrow variant with FLASH's structure (window 128, ratios 4 and 128, top-6 routing):
    /// 8 heads of 64 (16 roped) in 2 groups, hidden 256, 16 experts of width 128.
    pub fn small() -> Dsv4Config {
        Dsv4Config {
            hidden: 256,
            n_heads: 8,
            head_dim: 64,
            rope_dim: 16,
            q_lora_rank: 128,
            o_lora_rank: 64,
            o_groups: 2,
            csa_compress_dim: 128,
            index_heads: 4,
            index_head_dim: 32,
            index_topk: 16,
            n_routed_experts: 16,
            moe_inter_dim: 128,
            vocab_size: 1024,
            ..Dsv4Config::flash()
        }
    }

    /// The smallest useful variant: hidden 64, 2 heads of 32 (8 roped), window 8, 8 experts
    /// with top-2 routing, so windows fill and slide within a few positions.
    pub fn tiny() -> Dsv4Config {
        Dsv4Config {
            hidden: 64,
            n_heads: 2,
            head_dim: 32,
            rope_dim: 8,
            q_lora_rank: 32,
            o_lora_rank: 16,
            o_groups: 2,
            window: 8,
            csa_compress_dim: 64,
            index_heads: 2,
            index_head_dim: 16,
            index_topk: 4,
            n_routed_experts: 8,
            n_activated_experts: 2,
            moe_inter_dim: 32,
            vocab_size: 64,
            ..Dsv4Config::flash()
        }
    }

    /// FLASH with the routed experts of an expert-parallel benchmark: `ep` ranks (2, 4 or 8)
    /// of `per_rank` experts (16 or 32) each, so the whole MoE fits one machine; expert `e`
    /// lives on rank `e / per_rank`.
    pub fn flash_ep(ep: usize, per_rank: usize) -> Result<Dsv4Config, ConfigError> {
        if ![2, 4, 8].contains(&ep) {
            return Err(ConfigError::Invalid {
                field: "ep",
                value: ep.to_string(),
                why: "EP world size must be 2, 4 or 8".into(),
            });
        }
        if ![16, 32].contains(&per_rank) {
            return Err(ConfigError::Invalid {
                field: "experts_per_rank",
                value: per_rank.to_string(),
                why: "must be 16 or 32".into(),
            });
        }
        let cfg = Dsv4Config {
            n_routed_experts: ep * per_rank,
            ..Dsv4Config::flash()
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// A preset by name.
    pub fn preset(name: &str) -> Result<Dsv4Config, ConfigError> {
        match name {
            "flash" => Ok(Dsv4Config::flash()),
            "small" => Ok(Dsv4Config::small()),
            "tiny" => Ok(Dsv4Config::tiny()),
            _ => Err(ConfigError::UnknownPreset(name.to_string())),
        }
    }

    /// Parses and validates a JSON configuration (every field required, unknown fields refused).
    pub fn from_json(text: &str) -> Result<Dsv4Config, ConfigError> {
        let cfg: Dsv4Config =
            serde_json::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The configuration as pretty JSON ([`Dsv4Config::from_json`] reads it back).
    pub fn to_json(&self) -> String {
        // A struct of numbers and plain enums always serialises.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Heads per output-projection group.
    pub fn heads_per_group(&self) -> usize {
        self.n_heads / self.o_groups
    }

    /// Attention softmax scale `1/sqrt(head_dim)`.
    pub fn softmax_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Indexer head-weight scale `1/sqrt(index_head_dim) · 1/sqrt(index_heads)`.
    pub fn index_weight_scale(&self) -> f32 {
        1.0 / ((self.index_head_dim * self.index_heads) as f32).sqrt()
    }

    /// Hyper-connection mix weights: `hc` pre + `hc` post + `hc²` comb (24 for 4 streams).
    pub fn hc_mix(&self) -> usize {
        (2 + self.hc_mult) * self.hc_mult
    }

    /// Compress ratio of a layer kind (0 for SWA).
    pub fn compress_ratio(&self, kind: LayerKind) -> usize {
        match kind {
            LayerKind::Swa => 0,
            LayerKind::Csa => self.csa_ratio,
            LayerKind::Hca => self.hca_ratio,
        }
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &'static str, value: String, why: &str| ConfigError::Invalid {
            field,
            value,
            why: why.to_string(),
        };
        let sizes: [(&'static str, usize); 24] = [
            ("hidden", self.hidden),
            ("n_heads", self.n_heads),
            ("head_dim", self.head_dim),
            ("rope_dim", self.rope_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("o_lora_rank", self.o_lora_rank),
            ("o_groups", self.o_groups),
            ("window", self.window),
            ("csa_ratio", self.csa_ratio),
            ("hca_ratio", self.hca_ratio),
            ("csa_compress_dim", self.csa_compress_dim),
            ("index_heads", self.index_heads),
            ("index_head_dim", self.index_head_dim),
            ("index_topk", self.index_topk),
            ("hc_mult", self.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
            ("n_routed_experts", self.n_routed_experts),
            ("n_activated_experts", self.n_activated_experts),
            ("moe_inter_dim", self.moe_inter_dim),
            ("vocab_size", self.vocab_size),
            ("max_position", self.max_position),
            ("page_size", self.page_size),
            (
                "yarn.original_max_position",
                self.yarn.original_max_position,
            ),
            // Shared experts may be several, but the layer always has one (the reduce adds it).
            ("n_shared_experts", self.n_shared_experts),
        ];
        for (field, v) in sizes {
            if v == 0 || v > MAX_DIM {
                return Err(bad(
                    field,
                    v.to_string(),
                    &format!("must be in 1..={MAX_DIM}"),
                ));
            }
        }
        if !self.rope_dim.is_multiple_of(2) || self.rope_dim > self.head_dim {
            return Err(bad(
                "rope_dim",
                self.rope_dim.to_string(),
                &format!(
                    "must be even and at most head_dim ({}): interleaved pairs",
                    self.head_dim
                ),
            ));
        }
        if !self.n_heads.is_multiple_of(self.o_groups) {
            return Err(bad(
                "o_groups",
                self.o_groups.to_string(),
                &format!("must divide n_heads ({})", self.n_heads),
            ));
        }
        if self.csa_compress_dim != 2 * self.head_dim {
            return Err(bad(
                "csa_compress_dim",
                self.csa_compress_dim.to_string(),
                &format!(
                    "must be 2 * head_dim ({}): overlapping halves",
                    2 * self.head_dim
                ),
            ));
        }
        if !self.index_head_dim.is_power_of_two() {
            return Err(bad(
                "index_head_dim",
                self.index_head_dim.to_string(),
                "must be a power of two (Hadamard transform)",
            ));
        }
        if self.index_head_dim < self.rope_dim {
            return Err(bad(
                "index_head_dim",
                self.index_head_dim.to_string(),
                &format!("must be at least rope_dim ({})", self.rope_dim),
            ));
        }
        if self.n_activated_experts > self.n_routed_experts {
            return Err(bad(
                "n_activated_experts",
                self.n_activated_experts.to_string(),
                &format!(
                    "must be at most n_routed_experts ({})",
                    self.n_routed_experts
                ),
            ));
        }
        let positive = [
            ("rms_eps", self.rms_eps),
            ("hc_eps", self.hc_eps),
            ("route_scale", self.route_scale),
            ("swiglu_limit", self.swiglu_limit),
        ];
        for (field, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(field, v.to_string(), "must be finite and > 0"));
            }
        }
        let positive64 = [
            ("rope_theta", self.rope_theta),
            ("compress_rope_theta", self.compress_rope_theta),
            ("yarn.beta_fast", self.yarn.beta_fast),
            ("yarn.beta_slow", self.yarn.beta_slow),
        ];
        for (field, v) in positive64 {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(field, v.to_string(), "must be finite and > 0"));
            }
        }
        if !(self.rope_theta > 1.0 && self.compress_rope_theta > 1.0) {
            let (field, v) = if self.rope_theta > 1.0 {
                ("compress_rope_theta", self.compress_rope_theta)
            } else {
                ("rope_theta", self.rope_theta)
            };
            return Err(bad(field, v.to_string(), "must be > 1"));
        }
        if !(self.yarn.factor.is_finite() && self.yarn.factor >= 1.0) {
            return Err(bad(
                "yarn.factor",
                self.yarn.factor.to_string(),
                "must be finite and >= 1",
            ));
        }
        if self.yarn.beta_fast <= self.yarn.beta_slow {
            return Err(bad(
                "yarn.beta_fast",
                self.yarn.beta_fast.to_string(),
                &format!("must exceed yarn.beta_slow ({})", self.yarn.beta_slow),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_round_trip_through_json() {
        for name in Dsv4Config::PRESETS {
            let cfg = Dsv4Config::preset(name).unwrap();
            cfg.validate().unwrap();
            assert_eq!(
                Dsv4Config::from_json(&cfg.to_json()).unwrap(),
                cfg,
                "{name}"
            );
        }
        let f = Dsv4Config::flash();
        assert_eq!(f.hc_mix(), 24);
        assert_eq!(Dsv4Config::flash_ep(2, 16).unwrap().n_routed_experts, 32);
        for (ep, per_rank, field) in [(3, 16, "ep"), (2, 8, "experts_per_rank")] {
            match Dsv4Config::flash_ep(ep, per_rank) {
                Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(f.heads_per_group() * f.head_dim, 4096);
        assert!((f.index_weight_scale() - 0.01105).abs() < 1e-5);
        assert!(matches!(
            Dsv4Config::preset("huge"),
            Err(ConfigError::UnknownPreset(_))
        ));
    }

    /// Each malformed field is refused with an error naming it (and not some other field).
    #[test]
    fn malformed_configurations_name_the_field() {
        type Edit = fn(&mut Dsv4Config);
        let cases: [(&str, Edit); 12] = [
            ("hidden", |c| c.hidden = 0),
            ("rope_dim", |c| c.rope_dim = 7),
            ("rope_dim", |c| c.rope_dim = c.head_dim + 2),
            ("o_groups", |c| c.o_groups = 3),
            ("csa_compress_dim", |c| c.csa_compress_dim = c.head_dim),
            ("index_head_dim", |c| c.index_head_dim = 24),
            ("n_activated_experts", |c| c.n_activated_experts = 300),
            ("rms_eps", |c| c.rms_eps = f32::NAN),
            ("swiglu_limit", |c| c.swiglu_limit = -1.0),
            ("compress_rope_theta", |c| c.compress_rope_theta = 0.5),
            ("yarn.factor", |c| c.yarn.factor = 0.5),
            ("yarn.original_max_position", |c| {
                c.yarn.original_max_position = 0
            }),
        ];
        for (field, edit) in cases {
            let mut cfg = Dsv4Config::flash();
            edit(&mut cfg);
            match cfg.validate() {
                Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
            let msg = cfg.validate().unwrap_err().to_string();
            assert!(msg.contains(field), "{msg}");
        }
    }

    #[test]
    fn json_errors_name_the_field() {
        let mut v: serde_json::Value = serde_json::from_str(&Dsv4Config::tiny().to_json()).unwrap();
        v.as_object_mut().unwrap().remove("window");
        let e = Dsv4Config::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("window"), "{e}");
        let mut v: serde_json::Value = serde_json::from_str(&Dsv4Config::tiny().to_json()).unwrap();
        v["n_hedas"] = 3.into();
        let e = Dsv4Config::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("n_hedas"), "{e}");
        let mut v: serde_json::Value = serde_json::from_str(&Dsv4Config::tiny().to_json()).unwrap();
        v["head_dim"] = (-4).into();
        let e = Dsv4Config::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("-4"), "{e}");
        let mut v: serde_json::Value = serde_json::from_str(&Dsv4Config::tiny().to_json()).unwrap();
        v["o_groups"] = 5.into();
        let e = Dsv4Config::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("o_groups"), "{e}");
    }
}
