//! Qwen3 configuration: parsed from an HF `config.json`, validated (errors name the field),
//! presets for the real sizes and small test shapes, and the byte counts the benchmarks divide
//! by.

use serde::{Deserialize, Serialize};

/// A Qwen3 dense model's shape and constants.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Qwen3Config {
    /// Hidden size `H`.
    pub hidden_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (GQA).
    pub num_key_value_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// SwiGLU intermediate size.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon (every norm).
    pub rms_norm_eps: f64,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// Whether the LM head is the embedding table.
    pub tie_word_embeddings: bool,
    /// Longest position the model was trained for.
    pub max_position_embeddings: usize,
    /// Storage dtype named by the checkpoint (informational).
    pub torch_dtype: String,
}

/// An invalid configuration; names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The JSON did not parse or lacks a required field.
    #[error("config.json: {0}")]
    Parse(String),
    /// A field has a value the model cannot run with.
    #[error("config field `{field}` = {value}: {why}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Its value, printed.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// No preset has that name.
    #[error("unknown preset `{0}` (known: {known})", known = Qwen3Config::PRESETS.join(", "))]
    UnknownPreset(String),
}

/// The fields as HF writes them (several optional).
#[derive(Deserialize)]
struct RawConfig {
    hidden_size: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: usize,
    num_hidden_layers: usize,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    torch_dtype: Option<String>,
}

impl Qwen3Config {
    /// Names accepted by [`Qwen3Config::preset`].
    pub const PRESETS: [&'static str; 6] = [
        "qwen3-14b",
        "qwen3-8b",
        "qwen3-1.7b",
        "qwen3-0.6b",
        "tiny",
        "small",
    ];

    /// Parses an HF `config.json` and validates it.
    pub fn from_json(text: &str) -> Result<Qwen3Config, ConfigError> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        if raw.num_attention_heads == 0 {
            return Err(invalid("num_attention_heads", 0, "must be positive"));
        }
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        let cfg = Qwen3Config {
            hidden_size: raw.hidden_size,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(raw.num_attention_heads),
            head_dim,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(40_960),
            torch_dtype: raw.torch_dtype.unwrap_or_else(|| "bfloat16".into()),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The configuration as HF `config.json` text.
    pub fn to_json(&self) -> String {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "architectures".into(),
                serde_json::json!(["Qwen3ForCausalLM"]),
            );
            o.insert("model_type".into(), serde_json::json!("qwen3"));
        }
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// A named preset: `qwen3-14b`, `qwen3-8b`, `qwen3-1.7b`, `qwen3-0.6b` (the real shapes,
    /// θ = 1e6) or the test shapes `tiny` and `small`.
    pub fn preset(name: &str) -> Result<Qwen3Config, ConfigError> {
        #[allow(clippy::type_complexity)]
        let (h, heads, kv, hd, inter, layers, vocab, tied, theta): (
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            bool,
            f64,
        ) = match name {
            "qwen3-14b" => (5120, 40, 8, 128, 17408, 40, 151_936, false, 1e6),
            "qwen3-8b" => (4096, 32, 8, 128, 12288, 36, 151_936, false, 1e6),
            "qwen3-1.7b" => (2048, 16, 8, 128, 6144, 28, 151_936, true, 1e6),
            "qwen3-0.6b" => (1024, 16, 8, 128, 3072, 28, 151_936, true, 1e6),
            "tiny" => (256, 4, 2, 64, 512, 2, 1000, true, 1e4),
            "small" => (512, 8, 4, 64, 1024, 4, 4096, false, 1e4),
            _ => return Err(ConfigError::UnknownPreset(name.to_string())),
        };
        Ok(Qwen3Config {
            hidden_size: h,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: hd,
            intermediate_size: inter,
            num_hidden_layers: layers,
            vocab_size: vocab,
            rms_norm_eps: 1e-6,
            rope_theta: theta,
            tie_word_embeddings: tied,
            max_position_embeddings: 40_960,
            torch_dtype: "bfloat16".into(),
        })
    }

    /// Checks every field the model math depends on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(field, v, "must be positive"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(invalid(
                "num_key_value_heads",
                self.num_key_value_heads,
                &format!(
                    "must divide num_attention_heads = {}",
                    self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                self.head_dim,
                "must be even (RoPE rotates halves)",
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(invalid(
                "rms_norm_eps",
                self.rms_norm_eps,
                "must be finite and positive",
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(invalid(
                "rope_theta",
                self.rope_theta,
                "must be finite and above 1",
            ));
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(invalid(
                "vocab_size",
                self.vocab_size,
                "token ids must fit u32",
            ));
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
    /// Width of the query projection (`heads * head_dim`).
    pub fn q_width(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    /// Width of one KV row (`kv_heads * head_dim`).
    pub fn kv_width(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    /// Attention scale `1/sqrt(head_dim)`.
    pub fn attn_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
    /// Elements of one layer's projections (q, k, v, o, gate, up, down).
    pub fn layer_projection_params(&self) -> usize {
        let h = self.hidden_size;
        h * self.q_width()
            + 2 * h * self.kv_width()
            + self.q_width() * h
            + 3 * h * self.intermediate_size
    }
    /// Bytes of one layer's weights (bf16 projections, fp32 norms).
    pub fn layer_weight_bytes(&self) -> usize {
        2 * self.layer_projection_params() + 4 * (2 * self.hidden_size + 2 * self.head_dim)
    }
    /// Weight bytes streamed by one decode step: every layer, the final norm and the LM head
    /// (the embedding table is only gathered, a few rows per step).
    pub fn weight_bytes_per_step(&self) -> usize {
        self.num_hidden_layers * self.layer_weight_bytes()
            + 4 * self.hidden_size
            + 2 * self.vocab_size * self.hidden_size
    }
    /// KV-cache bytes of one token across all layers (K and V, bf16).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.num_hidden_layers * 2 * self.kv_width() * 2
    }
    /// KV bytes a decode step reads for sequences of `seq_lens` (every cached token of every
    /// layer, the new one included).
    pub fn kv_read_bytes(&self, seq_lens: &[usize]) -> usize {
        seq_lens.iter().sum::<usize>() * self.kv_bytes_per_token()
    }
    /// Parameter count (embedding and untied LM head included).
    pub fn params(&self) -> usize {
        let emb = self.vocab_size * self.hidden_size;
        let head = if self.tie_word_embeddings { 0 } else { emb };
        self.num_hidden_layers
            * (self.layer_projection_params() + 2 * self.hidden_size + 2 * self.head_dim)
            + emb
            + head
            + self.hidden_size
    }
    /// FLOPs of the matrix products of one decode step at batch `batch` (2 per multiply-add),
    /// LM head included, attention excluded.
    pub fn matmul_flops_per_step(&self, batch: usize) -> usize {
        2 * batch
            * (self.num_hidden_layers * self.layer_projection_params()
                + self.vocab_size * self.hidden_size)
    }
}

fn invalid(field: &'static str, value: impl std::fmt::Display, why: &str) -> ConfigError {
    ConfigError::Invalid {
        field,
        value: value.to_string(),
        why: why.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_the_14b_numbers_match_the_spec() {
        for name in Qwen3Config::PRESETS {
            Qwen3Config::preset(name).unwrap().validate().unwrap();
        }
        let c = Qwen3Config::preset("qwen3-14b").unwrap();
        assert_eq!(
            (
                c.hidden_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim
            ),
            (5120, 40, 8, 128)
        );
        assert_eq!(
            (
                c.intermediate_size,
                c.num_hidden_layers,
                c.vocab_size,
                c.group()
            ),
            (17408, 40, 151_936, 5)
        );
        assert!(!c.tie_word_embeddings);
        // ~26.4 GB of layer weights per step (06 spec), ~28 GB with the LM head.
        let layers_gb = (c.num_hidden_layers * c.layer_weight_bytes()) as f64 / 1e9;
        assert!((layers_gb - 26.4).abs() < 0.1, "{layers_gb}");
        let gb = c.weight_bytes_per_step() as f64 / 1e9;
        assert!((gb - 28.0).abs() < 0.1, "{gb}");
        let small = Qwen3Config::preset("qwen3-0.6b").unwrap();
        let gb = small.weight_bytes_per_step() as f64 / 1e9;
        assert!((gb - 1.19).abs() < 0.02, "0.6b streams {gb} GB");
        assert!(matches!(
            Qwen3Config::preset("nope"),
            Err(ConfigError::UnknownPreset(_))
        ));
    }

    #[test]
    fn json_round_trips_and_defaults_apply() {
        let c = Qwen3Config::preset("small").unwrap();
        assert_eq!(Qwen3Config::from_json(&c.to_json()).unwrap(), c);
        let minimal = r#"{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
            "num_hidden_layers": 1, "vocab_size": 10}"#;
        let m = Qwen3Config::from_json(minimal).unwrap();
        assert_eq!((m.head_dim, m.num_key_value_heads), (16, 4));
    }

    #[test]
    fn invalid_fields_are_named() {
        let mut c = Qwen3Config::preset("tiny").unwrap();
        c.num_key_value_heads = 3;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
        c.num_key_value_heads = 2;
        c.rms_norm_eps = -1.0;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("rms_norm_eps")
        );
        let e = Qwen3Config::from_json(r#"{"hidden_size": 64}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_attention_heads"), "{e}");
    }
}
