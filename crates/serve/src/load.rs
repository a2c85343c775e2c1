//! Loading an engine: `TextEngine::load(worker, source, runtime config)` — a preset (seeded
//! random weights with the real Qwen3 vocabulary) or a checkpoint directory (its weights, its
//! tokenizer, its EOS ids) — with the KV cache sized from the memory left after the weights.
//!
//! The KV cache takes `kv_memory_fraction` of what the platform says it can still allocate
//! minus what the weights, RoPE tables and step buffers take (the models crate's memory
//! estimate), but no more blocks than `max_batch_size` sequences of `max_seq_len` tokens can
//! hold at once: beyond that only the prefix cache would use them, and on a shared host the
//! memory is better left to others. `num_kv_blocks` fixes the count instead (and is checked
//! against the same limit).

use std::path::PathBuf;
use std::sync::Arc;

use simpler_core::{CallConfig, Worker};
use simpler_models::qwen3::fixture::Progress;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{
    LoadOptions, MemoryEstimate, Qwen3Config, ResidentModel, RunShape, WeightFormat, WeightLayout,
    eos_token_ids, load_config, ops,
};

use crate::engine::{Engine, EngineConfig, EngineError};
use crate::text::{TextEngine, TextError};
use crate::tokenizer::Tokenizer;

/// Where the model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A built-in shape with seeded random weights (`qwen3-0.6b`, `qwen3-tiny`, ...).
    Preset {
        /// Its name.
        name: String,
        /// Seed of the weights.
        seed: u64,
    },
    /// An HF checkpoint directory (`config.json`, safetensors, `tokenizer.json`).
    Dir(PathBuf),
}

/// How the engine is built and sized.
#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeConfig {
    /// Tokens per KV block (the Qwen3 kernels' page size is the only one supported).
    pub page_size: usize,
    /// Most sequences in one step.
    pub max_batch_size: usize,
    /// Longest sequence, prompt and completion together (`None`: the model's
    /// `max_position_embeddings`).
    pub max_seq_len: Option<usize>,
    /// Most tokens (prompt chunks and decodes) in one step.
    pub max_num_batched_tokens: usize,
    /// Most tokens one prompt's chunk takes of a step (`None`: the whole budget), so that a
    /// long prompt does not hold up the decodes sharing its steps.
    pub long_prefill_threshold: Option<usize>,
    /// Share of the memory left after the weights given to the KV cache.
    pub kv_memory_fraction: f64,
    /// KV blocks instead of a share of the memory.
    pub num_kv_blocks: Option<usize>,
    /// Most bytes the engine may take (`None`: what the platform has available).
    pub memory_budget: Option<u64>,
    /// How the projections and the LM head are held: `bf16`, or `int8` (per output channel,
    /// quantised at upload; `int8-w8a8` is the same, `int8-wide` keeps fp32 activations).
    pub weight_dtype: String,
    /// KV cache dtype (`bf16`).
    pub kv_dtype: String,
    /// How every step runs: ring sizes per dispatch, the orchestration mode, diagnostics.
    pub call: CallConfig,
}

impl Default for RuntimeConfig {
    fn default() -> RuntimeConfig {
        RuntimeConfig {
            page_size: PAGE_SIZE,
            max_batch_size: 16,
            max_seq_len: None,
            max_num_batched_tokens: 2048,
            long_prefill_threshold: None,
            kv_memory_fraction: 0.5,
            num_kv_blocks: None,
            memory_budget: None,
            weight_dtype: "bf16".into(),
            kv_dtype: "bf16".into(),
            call: CallConfig::default(),
        }
    }
}

/// The engine's sizes and the memory figures behind them.
#[derive(Clone, Debug, PartialEq)]
pub struct Sizing {
    /// What the engine gets.
    pub engine: EngineConfig,
    /// Bytes of everything but the KV cache (weights, RoPE tables, step buffers).
    pub rest_bytes: u64,
    /// Bytes of one KV block.
    pub block_bytes: u64,
    /// The memory limit and where it comes from, if known.
    pub limit: Option<(u64, String)>,
}

impl Sizing {
    /// One line for a log: the KV cache and where its size comes from.
    pub fn describe(&self, rt: &RuntimeConfig) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        let e = &self.engine;
        let why = match (&rt.num_kv_blocks, &self.limit) {
            (Some(_), _) => "as num_kv_blocks gives".to_string(),
            (None, Some((l, source))) => format!(
                "at most {:.0}% of the {:.2} GB left after {:.2} GB of weights and buffers ({source}), and no more than {} sequences of {} tokens hold",
                rt.kv_memory_fraction * 100.0,
                gb(l.saturating_sub(self.rest_bytes)),
                gb(self.rest_bytes),
                e.max_batch_size,
                e.max_seq_len
            ),
            (None, None) => String::new(),
        };
        format!(
            "KV cache {} blocks of {PAGE_SIZE} tokens ({:.2} GB, {} tokens): {why}",
            e.num_blocks,
            gb(self.block_bytes * e.num_blocks as u64),
            e.num_blocks * PAGE_SIZE
        )
    }
}

impl RuntimeConfig {
    /// Checks every field; an unsupported value is an error naming it.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |field: &str, why: String| Err(EngineError::Config(format!("{field}: {why}")));
        if self.page_size != PAGE_SIZE {
            return bad(
                "page_size",
                format!(
                    "{} is not supported (the kernels page by {PAGE_SIZE})",
                    self.page_size
                ),
            );
        }
        if self.max_batch_size == 0 || self.max_num_batched_tokens == 0 {
            return bad(
                "max_batch_size / max_num_batched_tokens",
                "must be at least 1".into(),
            );
        }
        if self.long_prefill_threshold == Some(0) {
            return bad("long_prefill_threshold", "must be at least 1".into());
        }
        if !(self.kv_memory_fraction > 0.0 && self.kv_memory_fraction <= 1.0) {
            return bad(
                "kv_memory_fraction",
                format!("{} is not in (0, 1]", self.kv_memory_fraction),
            );
        }
        if self.num_kv_blocks == Some(0) {
            return bad("num_kv_blocks", "must be at least 1".into());
        }
        if let Err(e) = WeightFormat::parse(&self.weight_dtype) {
            return bad("weight_dtype", e.to_string());
        }
        if self.kv_dtype != "bf16" {
            return bad(
                "kv_dtype",
                format!("`{}` is not supported (bf16)", self.kv_dtype),
            );
        }
        self.call.check().map_err(|e| {
            EngineError::Config(format!("call.{}: {} ({})", e.field, e.value, e.reason))
        })
    }

    /// The engine's sizes for model `c`, given the memory the platform has available (`None`:
    /// unknown, then `num_kv_blocks` is required).
    pub fn sizing(
        &self,
        c: &Qwen3Config,
        available: Option<(u64, String)>,
    ) -> Result<Sizing, EngineError> {
        self.validate()?;
        let max_seq_len = self.max_seq_len.unwrap_or(c.max_position_embeddings);
        if max_seq_len < 2 || max_seq_len > c.max_position_embeddings {
            return Err(EngineError::Config(format!(
                "max_seq_len {max_seq_len} must be in 2..={} (max_position_embeddings)",
                c.max_position_embeddings
            )));
        }
        let max_seq = max_seq_len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        // Checked by `validate` above.
        let weights = WeightFormat::parse(&self.weight_dtype)
            .map_err(|e| EngineError::Config(format!("weight_dtype: {e}")))?;
        let shape = |kv_slots| RunShape {
            layers: c.num_hidden_layers,
            shared_weights: false,
            kv_slots,
            max_seq,
            step_tokens: self.max_num_batched_tokens,
            weights,
            // `TextEngine::load` and `simpler serve` bring the layers one at a time.
            stream_layers: true,
        };
        let overflow =
            |e: simpler_models::qwen3::memory::MemoryOverflow| EngineError::Config(e.to_string());
        let rest = MemoryEstimate::of(c, &shape(0)).map_err(overflow)?.total();
        let block_bytes = (c.kv_bytes_per_token() * PAGE_SIZE) as u64;
        let limit = match (self.memory_budget, available) {
            (Some(b), Some((a, source))) if a < b => {
                Some((a, format!("{source}, below the budget")))
            }
            (Some(b), _) => Some((b, "memory_budget".to_string())),
            (None, a) => a,
        };
        let gb = |b: u64| b as f64 / 1e9;
        let num_blocks = match (self.num_kv_blocks, &limit) {
            (Some(n), _) => n,
            (None, Some((limit, source))) => {
                let left = limit.saturating_sub(rest);
                let most = self.max_batch_size.saturating_mul(max_seq / PAGE_SIZE);
                let n = ((left as f64 * self.kv_memory_fraction / block_bytes as f64) as usize)
                    .min(most);
                if n == 0 {
                    return Err(EngineError::Config(format!(
                        "no room for a KV cache: the weights and step buffers need about {:.2} GB of {:.2} GB available ({source}), leaving {:.3} GB; a block of {PAGE_SIZE} tokens takes {:.3} MB",
                        gb(rest),
                        gb(*limit),
                        gb(left),
                        block_bytes as f64 / 1e6
                    )));
                }
                n
            }
            (None, None) => {
                return Err(EngineError::Config(format!(
                    "the platform cannot say how much memory is available: give num_kv_blocks (a block of {PAGE_SIZE} tokens takes {:.3} MB)",
                    block_bytes as f64 / 1e6
                )));
            }
        };
        let kv_slots = num_blocks.checked_mul(PAGE_SIZE).ok_or_else(|| {
            EngineError::Config(format!("num_kv_blocks {num_blocks} is too large"))
        })?;
        let total = MemoryEstimate::of(c, &shape(kv_slots)).map_err(overflow)?;
        if let Some((limit, source)) = &limit
            && total.total() > *limit
        {
            return Err(EngineError::Config(format!(
                "the engine needs about {:.2} GB but {:.2} GB is available ({source}): {}",
                gb(total.total()),
                gb(*limit),
                total.describe()
            )));
        }
        Ok(Sizing {
            engine: EngineConfig {
                max_batch_size: self.max_batch_size,
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_seq_len,
                num_blocks,
                long_prefill_threshold: self.long_prefill_threshold,
                weights,
            },
            rest_bytes: rest,
            block_bytes,
            limit,
        })
    }
}

/// Why loading failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The configuration or the checkpoint.
    #[error(transparent)]
    Checkpoint(#[from] simpler_models::qwen3::CheckpointError),
    /// A preset name or its configuration.
    #[error(transparent)]
    Config(#[from] simpler_models::qwen3::ConfigError),
    /// The engine refused the sizes or failed to start.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The tokenizer or the pairing with the model.
    #[error(transparent)]
    Text(#[from] TextError),
    /// Registering the kernels.
    #[error("registering the Qwen3 kernels: {0}")]
    Kernels(String),
}

/// The text side of a model: a directory's own tokenizer (`tokenizer.json`, and
/// `tokenizer_config.json` where present) and EOS ids (its generation config, else its
/// `config.json`), or, without a directory (a preset), the built-in Qwen3 tokenizer and
/// `config`'s EOS ids. `TextEngine::load` and `simpler serve` both take them from here.
pub fn tokenizer_and_eos(
    dir: Option<&std::path::Path>,
    config: &Qwen3Config,
) -> Result<(Tokenizer, Vec<u32>), LoadError> {
    Ok(match dir {
        None => (
            Tokenizer::qwen3().map_err(TextError::from)?,
            config.eos_token_ids.clone(),
        ),
        Some(dir) => (
            Tokenizer::from_dir(dir).map_err(TextError::from)?,
            eos_token_ids(dir, config)?,
        ),
    })
}

impl TextEngine {
    /// Loads `source` onto `worker` (the Qwen3 kernels are registered here) and sizes the
    /// engine by `rt`; `progress` sees `(done, total)` while weights are generated or loaded.
    pub fn load(
        worker: Worker,
        source: &ModelSource,
        rt: &RuntimeConfig,
        progress: Option<Progress<'_>>,
    ) -> Result<(TextEngine, Sizing), LoadError> {
        rt.validate()?;
        let config = match source {
            ModelSource::Preset { name, .. } => Qwen3Config::preset(name)?,
            ModelSource::Dir(dir) => load_config(dir)?,
        };
        let sizing = rt.sizing(&config, worker.memory_available())?;
        let dir = match source {
            ModelSource::Preset { .. } => None,
            ModelSource::Dir(dir) => Some(dir.as_path()),
        };
        let (tokenizer, eos) = tokenizer_and_eos(dir, &config)?;
        // The layers reach the worker one at a time: the host never holds them all.
        let max_seq = Engine::resident_seq(&sizing.engine);
        let format = sizing.engine.weights;
        let progress = progress.map(|p| p as &dyn Fn(u64, u64));
        let model = match source {
            ModelSource::Preset { seed, .. } => ResidentModel::upload_generated(
                &worker, &config, *seed, false, max_seq, format, progress,
            ),
            ModelSource::Dir(dir) => {
                let opts = LoadOptions {
                    layout: WeightLayout::OutIn,
                    progress: None,
                    layers: None,
                };
                ResidentModel::upload_checkpoint(&worker, dir, &opts, max_seq, format, progress)
            }
        }
        .map_err(|e| match e {
            // A checkpoint's error stays the checkpoint's, as before the layers streamed.
            simpler_models::qwen3::Qwen3RunError::Checkpoint(c) => LoadError::Checkpoint(c),
            other => LoadError::Engine(other.into()),
        })?;
        ops::register(&worker).map_err(|e| LoadError::Kernels(e.to_string()))?;
        let mut engine = Engine::with_model(worker, Arc::new(model), eos, sizing.engine)?;
        engine.set_call_config(rt.call.clone());
        Ok((TextEngine::new(engine, tokenizer)?, sizing))
    }
}
