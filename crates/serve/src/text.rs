//! Text in, text out: the engine behind a tokenizer — `generate` (text), `generate_result`
//! (text, token ids, finish reason) and `generate_batch` (several prompts served together).
//!
//! Stop strings are applied to the decoded text after generation: the text ends before the
//! earliest stop string, and the token ids end with the token that completed it. (The engine
//! does not yet stop a sequence at a stop string while it runs, so tokens after it are computed
//! and dropped, bounded by `max_new_tokens`.)

use crate::engine::{Engine, EngineError, FinishReason, Request};
use crate::sampler::SamplingParams;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// How to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateConfig {
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// 0: greedy.
    pub temperature: f32,
    /// Nucleus sampling mass.
    pub top_p: f32,
    /// Keep the k most likely tokens only.
    pub top_k: Option<usize>,
    /// Seed of the draws.
    pub seed: u64,
    /// Strings that end the text (not included).
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence ids.
    pub ignore_eos: bool,
}

impl Default for GenerateConfig {
    fn default() -> GenerateConfig {
        GenerateConfig {
            max_new_tokens: 256,
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            seed: 0,
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// Why a text ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextFinish {
    /// An end-of-sequence id.
    Eos,
    /// A stop string.
    Stop,
    /// `max_new_tokens` (or the longest sequence the engine holds).
    Length,
}

impl TextFinish {
    /// The OpenAI name (`stop` covers EOS and stop strings).
    pub fn openai(self) -> &'static str {
        match self {
            TextFinish::Eos | TextFinish::Stop => "stop",
            TextFinish::Length => "length",
        }
    }
}

/// A generated text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextResult {
    /// The text (special tokens and what follows a stop string left out).
    pub text: String,
    /// The generated ids.
    pub token_ids: Vec<u32>,
    /// Why it ended.
    pub finish_reason: TextFinish,
    /// Prompt tokens.
    pub prompt_tokens: usize,
}

/// Why a text request failed.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// Tokenizing or detokenizing.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The request cannot be served as asked.
    #[error("{0}")]
    Invalid(String),
}

/// The engine with its tokenizer.
#[derive(Debug)]
pub struct TextEngine {
    engine: Engine,
    tokenizer: Tokenizer,
}

impl TextEngine {
    /// Pairs `engine` with `tokenizer` (whose ids must be the model's).
    pub fn new(engine: Engine, tokenizer: Tokenizer) -> Result<TextEngine, TextError> {
        if tokenizer.vocab_size() > engine.vocab_size() {
            return Err(TextError::Invalid(format!(
                "{} has {} ids but the model's vocabulary is {}",
                tokenizer.source(),
                tokenizer.vocab_size(),
                engine.vocab_size()
            )));
        }
        Ok(TextEngine { engine, tokenizer })
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The generated text of `prompt`.
    pub fn generate(&mut self, prompt: &str, cfg: &GenerateConfig) -> Result<String, TextError> {
        Ok(self.generate_result(prompt, cfg)?.text)
    }

    /// The generated text of `prompt`, its ids and why it ended.
    pub fn generate_result(
        &mut self,
        prompt: &str,
        cfg: &GenerateConfig,
    ) -> Result<TextResult, TextError> {
        let mut r = self.generate_batch(&[prompt], cfg)?;
        r.pop()
            .ok_or_else(|| TextError::Invalid("no result for the prompt".into()))
    }

    /// Several prompts served together (at most the engine's `max_batch_size`).
    pub fn generate_batch(
        &mut self,
        prompts: &[&str],
        cfg: &GenerateConfig,
    ) -> Result<Vec<TextResult>, TextError> {
        let most = self.engine.config().max_batch_size;
        if prompts.len() > most {
            return Err(TextError::Invalid(format!(
                "{} prompts, more than max_batch_size {most}",
                prompts.len()
            )));
        }
        if cfg.stop.iter().any(String::is_empty) {
            return Err(TextError::Invalid("an empty stop string".into()));
        }
        let sampling = SamplingParams {
            temperature: cfg.temperature,
            top_k: cfg.top_k,
            top_p: cfg.top_p,
            seed: cfg.seed,
        };
        let requests = prompts
            .iter()
            .map(|p| {
                Ok(Request {
                    prompt: self.tokenizer.encode(p)?,
                    max_new_tokens: cfg.max_new_tokens,
                    sampling,
                    ignore_eos: cfg.ignore_eos,
                })
            })
            .collect::<Result<Vec<Request>, TokenizerError>>()?;
        let done = self.engine.generate(&requests)?;
        requests
            .iter()
            .zip(done)
            .map(|(req, c)| {
                let mut result = TextResult {
                    text: self.tokenizer.decode(&c.tokens, true)?,
                    token_ids: c.tokens,
                    finish_reason: match c.finish_reason {
                        FinishReason::Eos => TextFinish::Eos,
                        FinishReason::Length => TextFinish::Length,
                    },
                    prompt_tokens: req.prompt.len(),
                };
                self.apply_stop(&mut result, &cfg.stop)?;
                Ok(result)
            })
            .collect()
    }

    /// Cuts `r` at the earliest stop string: the text before it, the ids through the token
    /// that completed it.
    fn apply_stop(&self, r: &mut TextResult, stop: &[String]) -> Result<(), TextError> {
        let Some(at) = stop.iter().filter_map(|s| r.text.find(s.as_str())).min() else {
            return Ok(());
        };
        let end = stop
            .iter()
            .filter_map(|s| r.text.find(s.as_str()).map(|i| i + s.len()))
            .filter(|&e| e > at)
            .min()
            .unwrap_or(at);
        // The fewest ids whose text reaches the end of the earliest stop string.
        let mut keep = r.token_ids.len();
        for n in 1..=r.token_ids.len() {
            if self.tokenizer.decode(&r.token_ids[..n], true)?.len() >= end {
                keep = n;
                break;
            }
        }
        r.token_ids.truncate(keep);
        r.text.truncate(at);
        r.finish_reason = TextFinish::Stop;
        Ok(())
    }
}
