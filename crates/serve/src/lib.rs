//! Serving: what turns text into token ids and back for the engine and the commands — the
//! model's tokenizer (the real Qwen3 files embedded for the presets), its chat template
//! rendered by a Jinja engine, incremental detokenization, the sampler, the KV cache's block
//! manager with prefix caching, and the engine that batches requests continuously.

pub mod chat;
pub mod detok;
pub mod engine;
pub mod http;
pub mod kv_blocks;
pub mod load;
pub mod metrics;
pub mod openai;
pub mod sampler;
pub mod service;
pub mod stream;
pub mod text;
pub mod tokenizer;
mod write_deadline;

pub use chat::{ChatMessage, ChatTemplate};
pub use detok::IncrementalDecoder;
pub use engine::{
    Completion, Engine, EngineConfig, EngineError, EngineStats, FinishReason, Request, RequestId,
    StepObserver, StepOutput,
};
pub use kv_blocks::{Allocation, BlockId, BlockManager, OutOfBlocks};
pub use load::{LoadError, ModelSource, RuntimeConfig, Sizing};
pub use sampler::{Sampler, SamplingParams};
pub use service::{Event, Refusal, Service, ServiceConfig, ServiceHandle, Usage};
pub use stream::{TextDelta, TextStream};
pub use text::{GenerateConfig, TextEngine, TextError, TextFinish, TextResult};
pub use tokenizer::{Tokenizer, TokenizerError};
