//! Serving: what turns text into token ids and back for the engine and the commands — the
//! model's tokenizer (the real Qwen3 files embedded for the presets), its chat template
//! rendered by a Jinja engine, incremental detokenization, and the sampler.

pub mod chat;
pub mod detok;
pub mod sampler;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use detok::IncrementalDecoder;
pub use sampler::{Sampler, SamplingParams};
pub use tokenizer::{Tokenizer, TokenizerError};
