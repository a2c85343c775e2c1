//! Text in, text out: the engine behind a tokenizer — `generate` (text), `generate_result`
//! (text, token ids, finish reason) and `generate_batch` (several prompts served together).
//!
//! Stop strings are applied while the requests run ([`TextStream`]): a request ends at the
//! token that completes one, its text before the stop string, its ids through that token.

use crate::engine::{Engine, EngineError, FinishReason, Request, RequestId};
use crate::sampler::SamplingParams;
use crate::stream::TextStream;
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

    /// Ends every request, frees the KV cache and the model's buffers, and stops the worker's
    /// threads.
    pub fn close(self) {
        self.engine.close();
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

    /// The generated text of `prompt`, handed to `on_delta` piece by piece as it is decoded
    /// (text that could begin a stop string waits until it cannot); returns the whole result.
    pub fn generate_stream(
        &mut self,
        prompt: &str,
        cfg: &GenerateConfig,
        on_delta: &mut dyn FnMut(&str),
    ) -> Result<TextResult, TextError> {
        let mut r = self.run(&[prompt], cfg, Some(on_delta))?;
        r.pop()
            .ok_or_else(|| TextError::Invalid("no result for the prompt".into()))
    }

    /// Several prompts served together (at most the engine's `max_batch_size`).
    pub fn generate_batch(
        &mut self,
        prompts: &[&str],
        cfg: &GenerateConfig,
    ) -> Result<Vec<TextResult>, TextError> {
        self.run(prompts, cfg, None)
    }

    fn run(
        &mut self,
        prompts: &[&str],
        cfg: &GenerateConfig,
        mut on_delta: Option<&mut dyn FnMut(&str)>,
    ) -> Result<Vec<TextResult>, TextError> {
        let most = self.engine.config().max_batch_size;
        if prompts.len() > most {
            return Err(TextError::Invalid(format!(
                "{} prompts, more than max_batch_size {most}",
                prompts.len()
            )));
        }
        cfg.validate()?;
        if self.engine.has_work() {
            return Err(TextError::Invalid(
                "the engine is serving other requests".into(),
            ));
        }
        let requests = prompts
            .iter()
            .map(|p| Ok(cfg.request(self.tokenizer.encode_prompt(p)?)))
            .collect::<Result<Vec<Request>, TextError>>()?;
        let mut ids: Vec<RequestId> = Vec::with_capacity(requests.len());
        for r in &requests {
            match self.engine.add_request(r) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    self.engine.abort_all();
                    return Err(e.into());
                }
            }
        }
        let mut streams: Vec<TextStream> = (0..requests.len())
            .map(|_| TextStream::new(cfg.stop.clone()))
            .collect();
        let mut finish: Vec<Option<TextFinish>> = vec![None; requests.len()];
        let result = (|| -> Result<(), TextError> {
            while self.engine.has_work() {
                for o in self.engine.step()? {
                    let Some(k) = ids.iter().position(|&i| i == o.id) else {
                        continue;
                    };
                    let d = streams[k].push(&self.tokenizer, o.token)?;
                    if let Some(f) = on_delta.as_mut() {
                        f(&d.text);
                    }
                    if d.stopped {
                        self.engine.stop(o.id);
                        finish[k] = Some(TextFinish::Stop);
                    } else if let Some(c) = o.finished {
                        let tail = streams[k].finish(&self.tokenizer)?;
                        if let Some(f) = on_delta.as_mut() {
                            f(&tail.text);
                        }
                        finish[k] = Some(match c.finish_reason {
                            // The tail completed a stop string.
                            _ if tail.stopped => TextFinish::Stop,
                            FinishReason::Eos => TextFinish::Eos,
                            FinishReason::Length => TextFinish::Length,
                            FinishReason::Stop => TextFinish::Stop,
                        });
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            self.engine.abort_all();
            return Err(e);
        }
        requests
            .iter()
            .zip(streams)
            .zip(finish)
            .map(|((req, s), f)| {
                Ok(TextResult {
                    text: s.text().to_string(),
                    token_ids: s.ids().to_vec(),
                    finish_reason: f.ok_or_else(|| {
                        TextError::Invalid("a request ended without a reason".into())
                    })?,
                    prompt_tokens: req.prompt.len(),
                })
            })
            .collect()
    }
}

impl GenerateConfig {
    /// Checks what the engine does not (stop strings).
    pub fn validate(&self) -> Result<(), TextError> {
        if self.stop.iter().any(String::is_empty) {
            return Err(TextError::Invalid("an empty stop string".into()));
        }
        Ok(())
    }

    /// The engine request for `prompt` ids.
    pub fn request(&self, prompt: Vec<u32>) -> Request {
        Request {
            prompt,
            max_new_tokens: self.max_new_tokens,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                seed: self.seed,
            },
            ignore_eos: self.ignore_eos,
        }
    }
}
