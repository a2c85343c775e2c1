//! Qwen3 configuration: parsed from an HF `config.json` in either layout `transformers` writes
//! (the older top-level `rope_theta` / `rope_scaling` / `torch_dtype`, or the current nested
//! `rope_parameters` and `dtype`), validated with checked arithmetic (errors name the key),
//! presets for the real sizes and small test shapes, and the byte counts the benchmarks
//! divide by.
//!
//! A key that changes the math and is not supported is refused, never ignored: an unknown
//! `rope_type`, sliding-window layers, attention or MLP biases, another (or a null)
//! `hidden_act` or `model_type`, partial rotary embeddings, a quantised checkpoint or a storage
//! dtype the loader does not read. Optional keys default as
//! `transformers`' `Qwen3Config` does; the RoPE base has no default (a checkpoint that omits
//! it is refused rather than run with a guessed θ).

use serde_json::{Map, Value};

pub use super::rope::{Rope, RopeScaling, RopeTables};

/// A Qwen3 dense model's shape and constants.
#[derive(Clone, Debug, PartialEq)]
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
    /// RoPE base and scaling.
    pub rope: Rope,
    /// Whether the LM head is the embedding table.
    pub tie_word_embeddings: bool,
    /// Longest sequence the model was configured for; the runtime refuses positions past it.
    pub max_position_embeddings: usize,
    /// Storage dtype named by the checkpoint (`dtype` or `torch_dtype`): one the loader reads
    /// (`bfloat16`, `float16`/`half`, `float32`/`float`), else the config is refused; the
    /// tensors' own dtypes are checked one by one.
    pub dtype: String,
    /// End-of-sequence ids named by `config.json` (`eos_token_id`, one id or a list).
    pub eos_token_ids: Vec<u32>,
}

/// An invalid configuration; names the key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The JSON did not parse.
    #[error("config.json: {0}")]
    Parse(String),
    /// A required key is absent.
    #[error("config key `{0}` is missing")]
    Missing(&'static str),
    /// A key has a value the model cannot run with.
    #[error("config key `{field}` = {value}: {why}")]
    Invalid {
        /// The key (dotted path for nested keys).
        field: String,
        /// Its value, printed.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// A key asks for math this model does not implement.
    #[error("config key `{key}` = {value} is not supported: {why}")]
    Unsupported {
        /// The key (dotted path for nested keys).
        key: String,
        /// Its value, printed.
        value: String,
        /// What would be needed.
        why: String,
    },
    /// No preset has that name.
    #[error("unknown preset `{0}` (known: {known})", known = Qwen3Config::PRESETS.join(", "))]
    UnknownPreset(String),
}

/// Largest value accepted for any size in a config: far above every real model, low enough that
/// products of a few sizes cannot overflow `usize` before the checked totals see them.
const MAX_DIM: usize = 1 << 24;

/// The `hidden_act` names this model runs: SiLU under both of `transformers`' names for it.
const ACTIVATIONS: [&str; 2] = ["silu", "swish"];

/// The `dtype` / `torch_dtype` names of what the loader reads (`transformers` resolves the
/// name with `getattr(torch, name)`, so `half` and `float` are `float16` and `float32`). Any
/// other names a checkpoint this loader does not read (quantised, fp8, f64, ...).
const DTYPES: [&str; 5] = ["bfloat16", "float16", "half", "float32", "float"];

/// The defaults `transformers`' `Qwen3Config` applies to absent optional keys.
mod defaults {
    pub(super) const HEAD_DIM: usize = 128;
    pub(super) const RMS_NORM_EPS: f64 = 1e-6;
    pub(super) const MAX_POSITION_EMBEDDINGS: usize = 32768;
    pub(super) const YARN_BETA_FAST: f64 = 32.0;
    pub(super) const YARN_BETA_SLOW: f64 = 1.0;
}

/// Typed reads of a JSON object, with errors naming the key.
struct Keys<'a> {
    obj: &'a Map<String, Value>,
    /// Prefix for nested objects (`rope_parameters.`).
    prefix: &'static str,
}

impl<'a> Keys<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
    fn wrong(&self, key: &str, v: &Value, what: &str) -> ConfigError {
        ConfigError::Invalid {
            field: self.name(key),
            value: v.to_string(),
            why: format!("must be {what}"),
        }
    }
    fn usize(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = v
            .as_u64()
            .ok_or_else(|| self.wrong(key, v, "a non-negative integer"))?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= MAX_DIM)
            .map(Some)
            .ok_or_else(|| self.wrong(key, v, &format!("at most {MAX_DIM}")))
    }
    fn f64(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_f64()
            .map(Some)
            .ok_or_else(|| self.wrong(key, v, "a number"))
    }
    fn bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| self.wrong(key, v, "true or false"))
    }
    fn str(&self, key: &str) -> Result<Option<&'a str>, ConfigError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_str()
            .map(Some)
            .ok_or_else(|| self.wrong(key, v, "a string"))
    }
    fn required(&self, key: &'static str) -> Result<usize, ConfigError> {
        self.usize(key)?.ok_or(ConfigError::Missing(key))
    }
    /// Refuses `key` unless it is absent or equal to `allowed` (numbers by value: `1` is
    /// `1.0`).
    fn only(&self, key: &str, allowed: &Value, why: &str) -> Result<(), ConfigError> {
        let same = |v: &Value| match (v.as_f64(), allowed.as_f64()) {
            (Some(a), Some(b)) => a == b,
            _ => v == allowed,
        };
        match self.get(key) {
            Some(v) if !same(v) => Err(ConfigError::Unsupported {
                key: self.name(key),
                value: v.to_string(),
                why: why.to_string(),
            }),
            _ => Ok(()),
        }
    }
}

/// Token ids from a JSON id or list of ids (`eos_token_id`).
pub(crate) fn token_ids(v: Option<&Value>, key: &str) -> Result<Vec<u32>, ConfigError> {
    let bad = |v: &Value| ConfigError::Invalid {
        field: key.to_string(),
        value: v.to_string(),
        why: "must be a token id or a list of token ids".into(),
    };
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad(v))
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

impl Qwen3Config {
    /// Names accepted by [`Qwen3Config::preset`].
    pub const PRESETS: [&'static str; 7] = [
        "qwen3-14b",
        "qwen3-8b",
        "qwen3-1.7b",
        "qwen3-0.6b",
        "qwen3-tiny",
        "tiny",
        "small",
    ];

    /// Parses an HF `config.json` (either layout) and validates it.
    pub fn from_json(text: &str) -> Result<Qwen3Config, ConfigError> {
        let v: Value = serde_json::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| ConfigError::Parse("the top level is not a JSON object".into()))?;
        let k = Keys { obj, prefix: "" };
        refuse_unsupported(&k)?;
        let num_attention_heads = k.required("num_attention_heads")?;
        // A null is not the key left out for these: `transformers` has no value to run (its
        // norm cannot take a null epsilon, its attention a null head size).
        for key in ["rms_norm_eps", "max_position_embeddings", "head_dim"] {
            if obj.get(key).is_some_and(Value::is_null) {
                return Err(ConfigError::Invalid {
                    field: key.into(),
                    value: "null".into(),
                    why: "must be a number (leave the key out for the default)".into(),
                });
            }
        }
        let hidden_size = k.required("hidden_size")?;
        let head_dim = k.usize("head_dim")?.unwrap_or(defaults::HEAD_DIM);
        let max_position_embeddings = k
            .usize("max_position_embeddings")?
            .unwrap_or(defaults::MAX_POSITION_EMBEDDINGS);
        let cfg = Qwen3Config {
            hidden_size,
            num_attention_heads,
            num_key_value_heads: k
                .usize("num_key_value_heads")?
                .unwrap_or(num_attention_heads),
            head_dim,
            intermediate_size: k.required("intermediate_size")?,
            num_hidden_layers: k.required("num_hidden_layers")?,
            vocab_size: k.required("vocab_size")?,
            rms_norm_eps: k.f64("rms_norm_eps")?.unwrap_or(defaults::RMS_NORM_EPS),
            rope: read_rope(&k, max_position_embeddings)?,
            tie_word_embeddings: k.bool("tie_word_embeddings")?.unwrap_or(false),
            max_position_embeddings,
            dtype: match (
                storage_dtype(&k, "dtype")?,
                storage_dtype(&k, "torch_dtype")?,
            ) {
                (Some(d), _) | (None, Some(d)) => d.to_string(),
                (None, None) => "bfloat16".into(),
            },
            eos_token_ids: token_ids(k.get("eos_token_id"), "eos_token_id")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The configuration as HF `config.json` text, in the layout `transformers` 5 writes
    /// (`rope_parameters`, `dtype`).
    pub fn to_json(&self) -> String {
        let mut rope = serde_json::to_value(self.rope.scaling).unwrap_or(Value::Null);
        if let Some(o) = rope.as_object_mut() {
            o.insert("rope_theta".into(), self.rope.theta.into());
        }
        let v = serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "use_sliding_window": false,
            "dtype": self.dtype,
            "eos_token_id": self.eos_token_ids,
        });
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
            // The test shape with Qwen3's real vocabulary, for serving tests: text in and out
            // through the real tokenizer, in seconds on two cores.
            "qwen3-tiny" => (64, 4, 2, 16, 128, 2, 151_936, false, 1e6),
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
            rope: Rope::plain(theta),
            tie_word_embeddings: tied,
            max_position_embeddings: 40_960,
            dtype: "bfloat16".into(),
            // The real vocabulary's `<|im_end|>` and `<|endoftext|>`; the test shapes have none.
            eos_token_ids: if vocab > 151_645 {
                vec![151_645, 151_643]
            } else {
                Vec::new()
            },
        })
    }

    /// Checks every field the model math depends on, and that every size derived from the
    /// fields fits `usize` (the byte counts below then cannot overflow).
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
            if v > MAX_DIM {
                return Err(invalid(field, v, &format!("must be at most {MAX_DIM}")));
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
        if !self.head_dim.is_multiple_of(2) || self.head_dim < 4 {
            return Err(invalid(
                "head_dim",
                self.head_dim,
                "must be even and at least 4 (RoPE rotates halves)",
            ));
        }
        // The norms compute in f32: an epsilon finite in f64 can be infinite there (1e308:
        // every hidden state normed to 0, all logits 0, greedy decoding prints token 0
        // without a word) or 0 (1e-50: a zero row divides 0 by 0).
        let eps32 = self.rms_norm_eps as f32;
        if !(eps32.is_finite() && eps32 > 0.0) {
            return Err(invalid(
                "rms_norm_eps",
                super::rope::num(self.rms_norm_eps),
                &format!(
                    "must be finite and positive as an f32, the precision the norms compute in \
                     (it is {eps32} there)"
                ),
            ));
        }
        if let Err((key, value, why)) = self.rope.validate() {
            return Err(ConfigError::Invalid {
                field: format!("rope_parameters.{key}"),
                value,
                why: why.into(),
            });
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(invalid(
                "vocab_size",
                self.vocab_size,
                "token ids must fit u32",
            ));
        }
        if let Some(&id) = self
            .eos_token_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return Err(invalid(
                "eos_token_id",
                id,
                &format!("is outside the vocabulary of {}", self.vocab_size),
            ));
        }
        self.checked_params().ok_or_else(|| {
            invalid(
                "num_hidden_layers",
                self.num_hidden_layers,
                "the parameter count of this shape overflows usize",
            )
        })?;
        Ok(())
    }

    /// The parameter count with every product checked (`None`: it overflows).
    fn checked_params(&self) -> Option<usize> {
        let h = self.hidden_size;
        let q = self.num_attention_heads.checked_mul(self.head_dim)?;
        let kv = self.num_key_value_heads.checked_mul(self.head_dim)?;
        let proj = h
            .checked_mul(q)?
            .checked_mul(2)?
            .checked_add(h.checked_mul(kv)?.checked_mul(2)?)?
            .checked_add(h.checked_mul(self.intermediate_size)?.checked_mul(3)?)?;
        let layer = proj.checked_add(2 * h + 2 * self.head_dim)?;
        let emb = self.vocab_size.checked_mul(h)?;
        // Bytes, not elements, must fit: bf16 projections, and twice that while loading.
        self.num_hidden_layers
            .checked_mul(layer)?
            .checked_add(emb.checked_mul(2)?)?
            .checked_mul(8)
    }

    /// The RoPE tables of this model for positions `0..max_seq`.
    pub fn rope_tables(&self, max_seq: usize) -> RopeTables {
        RopeTables::new(
            max_seq,
            self.head_dim,
            &self.rope,
            self.max_position_embeddings,
        )
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

/// The storage dtype named by `key` (`dtype` or `torch_dtype`), refused unless it is one the
/// loader reads ([`DTYPES`]): the tensors are checked one by one as well, but a config naming
/// `int4` or `float8_e4m3fn` describes a checkpoint that is not what this loader reads, even
/// where the tensors it holds would pass (`transformers` keeps `dtype` over `torch_dtype`;
/// both are checked, since either names what the files hold).
fn storage_dtype<'a>(k: &Keys<'a>, key: &str) -> Result<Option<&'a str>, ConfigError> {
    let Some(d) = k.str(key)? else {
        return Ok(None);
    };
    if !DTYPES.contains(&d) {
        return Err(ConfigError::Unsupported {
            key: k.name(key),
            value: format!("{d:?}"),
            why: "the loader reads bf16, f16 or f32 checkpoints (\"bfloat16\", \"float16\" or \"half\", \"float32\" or \"float\"); another dtype means a quantised or otherwise different checkpoint".into(),
        });
    }
    Ok(Some(d))
}

/// Refuses the keys whose values change the math in ways this model does not implement.
fn refuse_unsupported(k: &Keys<'_>) -> Result<(), ConfigError> {
    k.only(
        "model_type",
        &"qwen3".into(),
        "only Qwen3 dense models (`model_type: qwen3`) run here",
    )?;
    if let Some(v) = k.get("architectures") {
        let names: Vec<&str> = v
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !names.contains(&"Qwen3ForCausalLM") {
            return Err(ConfigError::Unsupported {
                key: "architectures".into(),
                value: v.to_string(),
                why: "only Qwen3ForCausalLM (a causal LM head) runs here".into(),
            });
        }
    }
    // `swish` is `transformers`' other name for SiLU, and an absent key its default (`silu`).
    // A null is not the key left out: `transformers` looks the activation up by name and
    // fails on it (`ACT2FN[None]`), and it must not run here as SiLU either.
    match k.obj.get("hidden_act") {
        None => {}
        Some(Value::String(s)) if ACTIVATIONS.contains(&s.as_str()) => {}
        Some(v @ Value::String(_)) => {
            return Err(ConfigError::Unsupported {
                key: "hidden_act".into(),
                value: v.to_string(),
                why: "the MLP implements SiLU (SwiGLU) only: `silu`, or `swish`, its other name"
                    .into(),
            });
        }
        Some(v) => {
            return Err(k.wrong(
                "hidden_act",
                v,
                "the activation's name, `silu` (leave the key out for transformers' default, silu)",
            ));
        }
    }
    k.only(
        "attention_bias",
        &false.into(),
        "the projections have no bias terms",
    )?;
    // `mlp_bias` is not read: Qwen3's MLP has no bias whatever the key says (a checkpoint
    // with bias tensors is refused by their names).
    //
    // A sliding window applies, in `transformers`, to the layers from `max_window_layers` (28
    // when absent) when `use_sliding_window` is true and `sliding_window` (4096 when absent)
    // is not null: refused only where a layer would slide.
    if k.bool("use_sliding_window")? == Some(true) {
        // Absent and null differ here (`get` takes a null for absent).
        let window = match k.obj.get("sliding_window") {
            None => Some(4096),
            Some(Value::Null) => None,
            Some(_) => k.usize("sliding_window")?,
        };
        let from = k.usize("max_window_layers")?.unwrap_or(28);
        let layers = k.usize("num_hidden_layers")?.unwrap_or(0);
        if let Some(w) = window
            && layers > from
        {
            return Err(ConfigError::Unsupported {
                key: "use_sliding_window".into(),
                value: "true".into(),
                why: format!(
                    "layers {from}..{layers} would attend through a window of {w} tokens \
                     (sliding_window, max_window_layers); every layer here attends to the whole \
                     context"
                ),
            });
        }
    }
    k.only(
        "partial_rotary_factor",
        &1.0.into(),
        "RoPE rotates the whole head",
    )?;
    if let Some(v) = k.get("quantization_config") {
        return Err(ConfigError::Unsupported {
            key: "quantization_config".into(),
            value: v.to_string(),
            why: "load a bf16, f16 or f32 checkpoint".into(),
        });
    }
    if let Some(v) = k.get("layer_types") {
        let a = v
            .as_array()
            .ok_or_else(|| k.wrong("layer_types", v, "a list"))?;
        if let Some((i, t)) = a
            .iter()
            .enumerate()
            .find(|(_, t)| t.as_str() != Some("full_attention"))
        {
            return Err(ConfigError::Unsupported {
                key: format!("layer_types[{i}]"),
                value: t.to_string(),
                why: "every layer must be `full_attention`".into(),
            });
        }
        // One entry a layer, as transformers checks: a shorter list leaves layers unnamed.
        if let Some(n) = k.usize("num_hidden_layers")?
            && a.len() != n
        {
            return Err(ConfigError::Invalid {
                field: "layer_types".into(),
                value: format!("{} entries", a.len()),
                why: format!("one entry a layer: num_hidden_layers is {n}"),
            });
        }
    }
    Ok(())
}

/// The RoPE of either layout: `rope_parameters` (current; may carry `rope_theta`), or a
/// top-level `rope_theta` with an optional `rope_scaling` (older). `type` is the older name of
/// `rope_type`. A theta given in both places must agree.
fn read_rope(k: &Keys<'_>, max_position_embeddings: usize) -> Result<Rope, ConfigError> {
    let top_theta = k.f64("rope_theta")?;
    let (params, prefix) = match (k.get("rope_parameters"), k.get("rope_scaling")) {
        (Some(p), _) => (Some(p), "rope_parameters."),
        (None, Some(p)) => (Some(p), "rope_scaling."),
        (None, None) => (None, ""),
    };
    let Some(params) = params else {
        let theta = top_theta.ok_or(ConfigError::Missing("rope_parameters.rope_theta"))?;
        return Ok(Rope::plain(theta));
    };
    let obj = params
        .as_object()
        .ok_or_else(|| k.wrong(prefix.trim_end_matches('.'), params, "an object"))?;
    // `transformers` nests parameters per layer type for hybrid models; Qwen3 has one type.
    let (obj, prefix) = match obj.get("full_attention").and_then(Value::as_object) {
        Some(inner) => (inner, "rope_parameters.full_attention."),
        None => (obj, prefix),
    };
    // Both layouts at once: the older `rope_scaling` must say what `rope_parameters` says
    // (a checkpoint written for both readers), or one of them would be ignored.
    if prefix.starts_with("rope_parameters")
        && let Some(scaling) = k.get("rope_scaling")
    {
        let old = scaling
            .as_object()
            .ok_or_else(|| k.wrong("rope_scaling", scaling, "an object"))?;

        for (key, v) in old.iter().filter(|(_, v)| !v.is_null()) {
            let new_key = if key == "type" {
                "rope_type"
            } else {
                key.as_str()
            };
            let same = obj.get(new_key).or_else(|| obj.get(key.as_str()));
            let agrees = match (same, v.as_f64()) {
                (Some(a), Some(b)) => a.as_f64() == Some(b),
                (Some(a), None) => a == v,
                (None, _) => false,
            };
            if !agrees {
                return Err(ConfigError::Invalid {
                    field: format!("rope_scaling.{key}"),
                    value: v.to_string(),
                    why: match same {
                        Some(a) => format!("disagrees with {prefix}{new_key} = {a}"),
                        None => format!(
                            "{prefix}{new_key} is not given, so one of the two would be ignored"
                        ),
                    },
                });
            }
        }
        // And the other way: `transformers` 5 reads `rope_scaling` alone when both are given
        // (4.x never reads `rope_parameters`), its theta from the top-level `rope_theta`
        // (10000 where that is absent), so what only `rope_parameters` says would be read
        // here and not there.
        for (key, v) in obj.iter().filter(|(_, v)| !v.is_null()) {
            let said = if key == "rope_type" {
                old.get("rope_type").or_else(|| old.get("type"))
            } else {
                old.get(key.as_str())
            };
            // Theta: 4.x takes it from the top level alone (10000 without it), 5 from
            // `rope_scaling`, else the top level; only a top-level theta means one thing to
            // both (one in `rope_scaling` too must agree: checked above).
            let missing = if key == "rope_theta" {
                top_theta.is_none()
            } else {
                said.is_none_or(Value::is_null)
            };
            if missing {
                return Err(ConfigError::Invalid {
                    field: format!("{prefix}{key}"),
                    value: v.to_string(),
                    why: if key == "rope_theta" {
                        "with rope_scaling also given, transformers 4.x takes theta from a \
                         top-level rope_theta alone (and 5 from rope_scaling), which is missing"
                            .into()
                    } else {
                        "rope_scaling (which transformers reads when both are given) does not \
                         say it, so one of the two would be ignored"
                            .into()
                    },
                });
            }
        }
    }
    let p = Keys { obj, prefix };
    let theta = match (p.f64("rope_theta")?, top_theta) {
        (Some(a), Some(b)) if a != b => {
            return Err(ConfigError::Invalid {
                field: format!("{prefix}rope_theta"),
                value: a.to_string(),
                why: format!("disagrees with the top-level rope_theta = {b}"),
            });
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => return Err(ConfigError::Missing("rope_parameters.rope_theta")),
    };
    p.only(
        "partial_rotary_factor",
        &1.0.into(),
        "RoPE rotates the whole head",
    )?;
    let rope_type = match (p.str("rope_type")?, p.str("type")?) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) => "default",
    };
    let factor = || -> Result<f64, ConfigError> {
        p.f64("factor")?.ok_or(ConfigError::Missing(match prefix {
            "rope_scaling." => "rope_scaling.factor",
            _ => "rope_parameters.factor",
        }))
    };
    let (scaling, known): (RopeScaling, &[&str]) = match rope_type {
        "default" => (RopeScaling::Default, &[]),
        "linear" => (RopeScaling::Linear { factor: factor()? }, &["factor"]),
        "dynamic" => (RopeScaling::Dynamic { factor: factor()? }, &["factor"]),
        "yarn" => {
            let inner = p.usize("original_max_position_embeddings")?;
            // A top-level value: `transformers` 5 puts it over the RoPE object's, 4.x never
            // reads it (taking the object's, else `max_position_embeddings`). Read where both
            // agree; refused where they would not.
            let top = k.usize("original_max_position_embeddings")?;
            let orig = inner.unwrap_or(max_position_embeddings);
            if let Some(t) = top
                && t != orig
            {
                return Err(ConfigError::Invalid {
                    field: "original_max_position_embeddings".into(),
                    value: t.to_string(),
                    why: format!(
                        "transformers 5 would take it for YaRN's original context and 4.x \
                         {orig} ({}); give it inside the RoPE object",
                        match inner {
                            Some(_) => format!("{prefix}original_max_position_embeddings"),
                            None => "max_position_embeddings".into(),
                        }
                    ),
                });
            }
            let factor = factor()?;
            let mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match (
                p.f64("attention_factor")?,
                p.f64("mscale")?,
                p.f64("mscale_all_dim")?,
            ) {
                (Some(a), _, _) => a,
                // Zero counts as absent, as in `transformers`.
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    mscale(factor, m) / mscale(factor, all)
                }
                _ => mscale(factor, 1.0),
            };
            let beta = |key: &str, default: f64| -> Result<f64, ConfigError> {
                Ok(p.f64(key)?.filter(|&b| b != 0.0).unwrap_or(default))
            };
            (
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: orig,
                    beta_fast: beta("beta_fast", defaults::YARN_BETA_FAST)?,
                    beta_slow: beta("beta_slow", defaults::YARN_BETA_SLOW)?,
                    attention_factor,
                    truncate: p.bool("truncate")?.unwrap_or(true),
                },
                &[
                    "factor",
                    "original_max_position_embeddings",
                    "attention_factor",
                    "mscale",
                    "mscale_all_dim",
                    "beta_fast",
                    "beta_slow",
                    "truncate",
                ],
            )
        }
        other => {
            return Err(ConfigError::Unsupported {
                key: format!("{prefix}rope_type"),
                value: format!("{other:?}"),
                why: "supported: default, linear, dynamic, yarn".into(),
            });
        }
    };
    // A parameter the type does not read would be silently ignored: refuse it instead.
    let common = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
    if let Some((key, v)) = obj.iter().find(|(key, v)| {
        !v.is_null() && !common.contains(&key.as_str()) && !known.contains(&key.as_str())
    }) {
        return Err(ConfigError::Unsupported {
            key: format!("{prefix}{key}"),
            value: v.to_string(),
            why: format!("`rope_type` {rope_type} does not use it"),
        });
    }
    Ok(Rope { theta, scaling })
}

fn invalid(field: &str, value: impl std::fmt::Display, why: &str) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
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
    fn json_round_trips_and_defaults_follow_transformers() {
        for name in ["small", "qwen3-0.6b"] {
            let c = Qwen3Config::preset(name).unwrap();
            assert_eq!(Qwen3Config::from_json(&c.to_json()).unwrap(), c);
        }
        let minimal = r#"{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
            "num_hidden_layers": 1, "vocab_size": 10, "rope_theta": 10000.0}"#;
        let m = Qwen3Config::from_json(minimal).unwrap();
        // transformers' Qwen3Config: head_dim 128 (not hidden / heads), KV heads = heads,
        // 32768 positions, untied, eps 1e-6.
        assert_eq!((m.head_dim, m.num_key_value_heads), (128, 4));
        assert_eq!(m.max_position_embeddings, 32768);
        assert!(!m.tie_word_embeddings);
        assert_eq!(m.rms_norm_eps, 1e-6);
        assert_eq!(m.rope, Rope::plain(1e4));
    }

    const BASE: &str = r#""hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "num_hidden_layers": 1, "vocab_size": 10, "head_dim": 16, "max_position_embeddings": 4096"#;

    fn parse(extra: &str) -> Result<Qwen3Config, ConfigError> {
        Qwen3Config::from_json(&format!("{{{BASE}, {extra}}}"))
    }

    #[test]
    fn both_layouts_give_the_same_rope() {
        let old = parse(r#""rope_theta": 1000000.0, "torch_dtype": "bfloat16""#).unwrap();
        let new = parse(
            r#""rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "dtype": "float32""#,
        )
        .unwrap();
        assert_eq!(old.rope, Rope::plain(1e6));
        assert_eq!(new.rope, old.rope);
        assert_eq!(
            (old.dtype.as_str(), new.dtype.as_str()),
            ("bfloat16", "float32")
        );
        // Both, agreeing (as tools that write both layouts do).
        let both = parse(
            r#""rope_theta": 1000000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}"#,
        )
        .unwrap();
        assert_eq!(both.rope, old.rope);
        let yarn_old = parse(
            r#""rope_theta": 1000000.0, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}"#,
        )
        .unwrap();
        let yarn_new = parse(
            r#""rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 1024}"#,
        )
        .unwrap();
        assert_eq!(yarn_old.rope, yarn_new.rope);
        // Both layouts saying the same (`type` for `rope_type`, a null scaling) are read; a
        // `rope_scaling` that says otherwise, or says what `rope_parameters` does not, is
        // refused by name (it used to be ignored).
        let yarn_params = r#""rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 1024}"#;
        let both = parse(&format!(
            r#"{yarn_params}, "rope_theta": 1e6, "rope_scaling": {{"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024}}"#
        ))
        .unwrap();
        assert_eq!(both.rope, yarn_new.rope);
        // What only `rope_parameters` says is refused when `rope_scaling` is given too:
        // `transformers` reads `rope_scaling` then, its theta from the top-level `rope_theta`
        // (10000 without one).
        for (extra, field) in [
            ("", "rope_parameters.rope_theta"),
            // Theta in both objects but not at the top level: 4.x would run 10000.
            (
                r#", "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024, "rope_theta": 1000000.0}"#,
                "rope_parameters.rope_theta",
            ),
            // A key `rope_scaling` holds as null is not said there.
            (
                r#", "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": null}"#,
                "rope_parameters.original_max_position_embeddings",
            ),
            (
                r#", "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4}"#,
                "rope_parameters.original_max_position_embeddings",
            ),
        ] {
            let scaling = if extra.contains("rope_scaling") {
                String::new()
            } else {
                r#", "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024}"#.into()
            };
            let e = parse(&format!("{yarn_params}{extra}{scaling}"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(field) && e.contains("rope_scaling"),
                "{extra}: {e}"
            );
        }
        parse(r#""rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": null"#)
            .unwrap();
        for (scaling, field, why) in [
            (
                r#"{"rope_type": "yarn"}"#,
                "rope_scaling.rope_type",
                "disagrees with rope_parameters.rope_type = \"default\"",
            ),
            (
                r#"{"factor": 2.0}"#,
                "rope_scaling.factor",
                "rope_parameters.factor is not given",
            ),
        ] {
            let e = parse(&format!(
                r#""rope_parameters": {{"rope_type": "default", "rope_theta": 1e6}}, "rope_scaling": {scaling}"#
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains(field) && e.contains(why), "{scaling}: {e}");
        }
        let e = parse(&format!(
            r#"{yarn_params}, "rope_scaling": {{"type": "yarn", "factor": 8.0}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("rope_scaling.factor") && e.contains("rope_parameters.factor = 4.0"),
            "{e}"
        );
        // A top-level `original_max_position_embeddings` (what `transformers` 5 puts over the
        // RoPE object's, and 4.x never reads) is read where both would agree and refused
        // where they would not.
        let top = |v: usize| format!(r#"{yarn_params}, "original_max_position_embeddings": {v}"#);
        assert_eq!(parse(&top(1024)).unwrap().rope, yarn_new.rope);
        let e = parse(&top(2048)).unwrap_err().to_string();
        assert!(
            e.contains("original_max_position_embeddings") && e.contains("transformers 5"),
            "{e}"
        );
        let no_inner = r#""max_position_embeddings": 4096, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}"#;
        parse(&format!(
            r#"{no_inner}, "original_max_position_embeddings": 4096"#
        ))
        .unwrap();
        let e = parse(&format!(
            r#"{no_inner}, "original_max_position_embeddings": 1024"#
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("max_position_embeddings"), "{e}");
        // A null epsilon, context or head size is refused.
        for key in ["rms_norm_eps", "max_position_embeddings", "head_dim"] {
            let e = parse(&format!(r#""rope_theta": 1e6, "{key}": null"#))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains("null"), "{e}");
        }
        // Numbers by value: an integer 1 rotates the whole head as 1.0 does.
        parse(r#""rope_theta": 1e6, "partial_rotary_factor": 1"#).unwrap();
        let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        } = yarn_new.rope.scaling
        else {
            panic!("{:?}", yarn_new.rope)
        };
        assert_eq!(
            (
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate
            ),
            (4.0, 1024, 32.0, 1.0, true)
        );
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        let m = parse(
            r#""rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 2.0, "mscale_all_dim": 1.0}"#,
        )
        .unwrap();
        let RopeScaling::Yarn {
            attention_factor, ..
        } = m.rope.scaling
        else {
            panic!()
        };
        let want = (0.2 * 4f64.ln() + 1.0) / (0.1 * 4f64.ln() + 1.0);
        assert!((attention_factor - want).abs() < 1e-12);
        for (t, s) in [
            ("linear", RopeScaling::Linear { factor: 2.0 }),
            ("dynamic", RopeScaling::Dynamic { factor: 2.0 }),
        ] {
            let c = parse(&format!(
                r#""rope_parameters": {{"rope_type": "{t}", "rope_theta": 1e4, "factor": 2.0}}"#
            ))
            .unwrap();
            assert_eq!(c.rope.scaling, s);
            assert_eq!(Qwen3Config::from_json(&c.to_json()).unwrap(), c);
        }
        assert_eq!(
            Qwen3Config::from_json(&yarn_new.to_json()).unwrap(),
            yarn_new
        );
    }

    /// Each refused key gives its own error naming the key and the value.
    #[test]
    fn every_unsupported_key_is_refused_by_name() {
        let theta = r#""rope_theta": 1e4"#;
        let cases: &[(&str, &str, &str)] = &[
            (r#""model_type": "llama""#, "model_type", "llama"),
            (
                r#""architectures": ["Qwen3ForSequenceClassification"]"#,
                "architectures",
                "Qwen3ForSequenceClassification",
            ),
            (r#""hidden_act": "gelu""#, "hidden_act", "gelu"),
            (r#""attention_bias": true"#, "attention_bias", "true"),
            (
                r#""use_sliding_window": true, "max_window_layers": 0"#,
                "use_sliding_window",
                "true",
            ),
            // Past 28 layers (the default `max_window_layers`) the default window slides.
            (
                r#""use_sliding_window": true, "num_hidden_layers": 30"#,
                "use_sliding_window",
                "true",
            ),
            (
                r#""partial_rotary_factor": 0.5"#,
                "partial_rotary_factor",
                "0.5",
            ),
            (
                r#""quantization_config": {"quant_method": "fp8"}"#,
                "quantization_config",
                "fp8",
            ),
            (
                r#""layer_types": ["full_attention", "sliding_attention"]"#,
                "layer_types[1]",
                "sliding_attention",
            ),
        ];
        for (extra, key, value) in cases {
            let e = parse(&format!("{theta}, {extra}")).unwrap_err();
            assert!(
                matches!(e, ConfigError::Unsupported { .. }),
                "{extra}: {e:?}"
            );
            let e = e.to_string();
            assert!(
                e.contains(&format!("`{key}`")) && e.contains(value),
                "{extra}: {e}"
            );
        }
        // What `transformers` runs unchanged is read: `swish` is SiLU; Qwen3's MLP reads no
        // `mlp_bias`; a sliding window no layer reaches (a null window, or every layer below
        // `max_window_layers`, 28 by default).
        for extra in [
            r#""hidden_act": "swish""#,
            r#""mlp_bias": true"#,
            r#""use_sliding_window": true"#,
            r#""use_sliding_window": true, "sliding_window": null, "max_window_layers": 0"#,
            r#""use_sliding_window": true, "sliding_window": 512, "max_window_layers": 1"#,
        ] {
            parse(&format!("{theta}, {extra}")).unwrap_or_else(|e| panic!("{extra}: {e}"));
        }
        let rope_cases: &[(&str, &str)] = &[
            (
                r#""rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}"#,
                "rope_parameters.rope_type",
            ),
            (
                r#""rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}"#,
                "rope_parameters.rope_type",
            ),
            (
                r#""rope_scaling": {"type": "su"}, "rope_theta": 1e4"#,
                "rope_scaling.rope_type",
            ),
            (
                r#""rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}"#,
                "rope_parameters.factor",
            ),
            (
                r#""rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "beta_fast": 4}"#,
                "rope_parameters.beta_fast",
            ),
            (
                r#""rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}"#,
                "rope_parameters.partial_rotary_factor",
            ),
        ];
        for (extra, key) in rope_cases {
            let e = parse(extra).unwrap_err();
            assert!(
                matches!(e, ConfigError::Unsupported { .. }),
                "{extra}: {e:?}"
            );
            assert!(e.to_string().contains(&format!("`{key}`")), "{extra}: {e}");
        }
        // Allowed values of the same keys pass.
        parse(&format!(
            r#"{theta}, "model_type": "qwen3", "hidden_act": "silu", "attention_bias": false,
            "use_sliding_window": false, "sliding_window": null, "layer_types": ["full_attention"],
            "architectures": ["Qwen3ForCausalLM"], "eos_token_id": [3, 4]"#
        ))
        .unwrap();
        // One layer_types entry a layer (BASE has one layer).
        let e = parse(&format!(
            r#"{theta}, "layer_types": ["full_attention", "full_attention"]"#
        ))
        .unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { field, .. } if field == "layer_types"),
            "{e:?}"
        );
        assert!(e.to_string().contains("num_hidden_layers is 1"), "{e}");
    }

    #[test]
    fn missing_and_malformed_values_are_named() {
        // No RoPE base anywhere: refused, not 10000.
        let e = parse(r#""dtype": "bfloat16""#).unwrap_err().to_string();
        assert!(e.contains("rope_theta") && e.contains("missing"), "{e}");
        let e = parse(r#""rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_parameters.factor"), "{e}");
        let e = parse(r#""rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e6}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("disagrees"), "{e}");
        let e = parse(
            r#""rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.5}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("rope_parameters.factor"), "{e}");
        for (extra, key) in [
            (r#""rope_theta": "big""#, "rope_theta"),
            (
                r#""rope_theta": 1e4, "tie_word_embeddings": 1"#,
                "tie_word_embeddings",
            ),
            (
                r#""rope_theta": 1e4, "eos_token_id": [1, -2]"#,
                "eos_token_id",
            ),
            (r#""rope_theta": 1e4, "eos_token_id": 99"#, "eos_token_id"),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
        // Sizes beyond any model, and shapes whose byte counts overflow, are refused before
        // anything multiplies them.
        let e = Qwen3Config::from_json(
            r#"{"hidden_size": 18446744073709551615, "num_attention_heads": 4, "intermediate_size": 128,
            "num_hidden_layers": 1, "vocab_size": 10, "rope_theta": 1e4}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("hidden_size"), "{e}");
        let mut c = Qwen3Config::preset("tiny").unwrap();
        c.hidden_size = MAX_DIM;
        c.intermediate_size = MAX_DIM;
        c.num_hidden_layers = MAX_DIM;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
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

    /// `hidden_act` absent is `transformers`' default, SiLU; a null (which `transformers`
    /// cannot look up) or a non-string is refused by name, not run as SiLU.
    #[test]
    fn a_null_activation_is_refused_and_an_absent_one_is_silu() {
        let theta = r#""rope_theta": 1e4"#;
        parse(theta).unwrap();
        for act in ["silu", "swish"] {
            parse(&format!(r#"{theta}, "hidden_act": "{act}""#)).unwrap();
        }
        for (value, why) in [
            ("null", "leave the key out"),
            ("1", "leave the key out"),
            (r#""SiLU""#, "SiLU (SwiGLU) only"),
        ] {
            let e = parse(&format!(r#"{theta}, "hidden_act": {value}"#))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("`hidden_act`") && e.contains(value) && e.contains(why),
                "{value}: {e}"
            );
        }
    }

    /// YaRN's betas: `transformers` fails on a negative one (the logarithm of a negative) or
    /// one so extreme the ramp's bound is infinite, and says beta_fast must exceed
    /// beta_slow; each is refused naming the key. Zero still means the default, and equal
    /// betas pass (`transformers`' check is strict).
    #[test]
    fn yarn_betas_transformers_refuses_are_refused_by_name() {
        let yarn = |betas: &str| {
            parse(&format!(
                r#""rope_parameters": {{"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024{betas}}}"#
            ))
        };
        for betas in [
            "",
            r#", "beta_fast": 0, "beta_slow": 0"#,
            r#", "beta_fast": 8, "beta_slow": 8"#,
            r#", "beta_fast": 64.5, "beta_slow": 0.5"#,
        ] {
            yarn(betas).unwrap_or_else(|e| panic!("{betas}: {e}"));
        }
        for (betas, key, value, why) in [
            (r#", "beta_fast": -32"#, "beta_fast", "-32", "positive"),
            (r#", "beta_slow": -1"#, "beta_slow", "-1", "positive"),
            (
                r#", "beta_fast": 1, "beta_slow": 32"#,
                "beta_fast",
                "1 (beta_slow 32; an absent or zero beta is its default, 32 fast and 1 slow)",
                "at least beta_slow",
            ),
            (
                r#", "beta_fast": 1e308"#,
                "beta_fast",
                "1e308",
                "not finite",
            ),
            (
                r#", "beta_slow": 1e-320"#,
                "beta_slow",
                "1e-320",
                "not finite",
            ),
        ] {
            let e = yarn(betas).unwrap_err();
            assert!(
                matches!(&e, ConfigError::Invalid { field, value: v, why: w }
                    if field == &format!("rope_parameters.{key}") && v == value && w.contains(why)),
                "{betas}: {e:?}"
            );
        }
    }

    /// The norms compute in f32: an epsilon that is infinite (1e308) or 0 (1e-50) there is
    /// refused, though finite and positive in f64.
    #[test]
    fn an_epsilon_that_is_not_a_positive_f32_is_refused() {
        let theta = r#""rope_theta": 1e4"#;
        for eps in ["1e-5", "1e30", "1e-40"] {
            parse(&format!(r#"{theta}, "rms_norm_eps": {eps}"#))
                .unwrap_or_else(|e| panic!("{eps}: {e}"));
        }
        // (as written, as shown: serde_json reads 1e-50 as 9.999999999999999e-51, f32 value)
        for (eps, shown, f32_value) in [
            ("1e308", "1e308:", "inf"),
            ("1e-50", "e-51:", "0"),
            ("0", "0:", "0"),
            ("-1e-6", "-1e-6:", "-0.000001"),
        ] {
            let e = parse(&format!(r#"{theta}, "rms_norm_eps": {eps}"#))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("`rms_norm_eps` = ")
                    && e.contains(shown)
                    && e.contains("as an f32")
                    && e.contains(&format!("it is {f32_value}")),
                "{eps}: {e}"
            );
        }
    }

    /// `dtype` / `torch_dtype` name the stored tensors: one the loader does not read (a
    /// quantised or fp8 checkpoint) is refused naming the key, whichever key says it; the
    /// dtypes it reads pass under `transformers`' names, `torch` aliases included.
    #[test]
    fn a_storage_dtype_the_loader_does_not_read_is_refused() {
        let theta = r#""rope_theta": 1e4"#;
        for d in ["bfloat16", "float16", "half", "float32", "float"] {
            for key in ["dtype", "torch_dtype"] {
                let c = parse(&format!(r#"{theta}, "{key}": "{d}""#)).unwrap();
                assert_eq!(c.dtype, d);
            }
        }
        // Both given: `dtype` is the one kept, as in `transformers`.
        let c = parse(&format!(
            r#"{theta}, "dtype": "bfloat16", "torch_dtype": "float16""#
        ))
        .unwrap();
        assert_eq!(c.dtype, "bfloat16");
        for (extra, key, value) in [
            (r#""dtype": "int4""#, "dtype", "int4"),
            (r#""dtype": "float8_e4m3fn""#, "dtype", "float8_e4m3fn"),
            (r#""torch_dtype": "float64""#, "torch_dtype", "float64"),
            (r#""dtype": "auto""#, "dtype", "auto"),
            (
                r#""dtype": "bfloat16", "torch_dtype": "int8""#,
                "torch_dtype",
                "int8",
            ),
        ] {
            let e = parse(&format!("{theta}, {extra}")).unwrap_err();
            assert!(
                matches!(&e, ConfigError::Unsupported { key: k, value: v, .. }
                    if k == key && v == &format!("{value:?}")),
                "{extra}: {e:?}"
            );
        }
    }
}
