//! Qwen3 dense models (`docs/qwen3.md`; HF `Qwen3ForCausalLM`): configuration, weights and the
//! paged KV cache, deterministic fixtures, the fp32 golden reference, and HF checkpoints.
//!
//! Files read top to bottom: [`config`] (shapes, presets, byte counts) -> [`weights`] (what a
//! model holds, `[out, in]` bf16 projections, the KV pools and block tables) -> [`fixture`]
//! (seeded generation) -> [`golden`] (plain-loop reference of decode, prefill and the full
//! model, and the spec's tolerances) -> [`checkpoint`] (loading and saving safetensors).

pub mod check;
pub mod checkpoint;
pub mod config;
pub mod cost;
pub mod fixture;
pub mod golden;
pub mod layout;
pub mod memory;
pub mod ops;
mod orchestrate;
pub mod plan;
pub mod quant;
pub mod resident;
pub mod rope;
pub mod runner;
pub mod weights;

pub use checkpoint::{
    CheckpointError, CheckpointReader, LoadOptions, SaveOptions, WeightLayout, eos_token_ids,
    generation_defaults, load_checkpoint, load_config, read_checkpoint, save_checkpoint,
};
pub use config::{ConfigError, Qwen3Config};
pub use cost::{DecodePeaks, DecodePhases, Engine, StepCost, StepPhase, phase_spans_ns};
pub use fixture::{
    Fixture, FixtureOptions, generate_fixture, generate_inputs, generate_kv_pools, generate_layer,
    generate_outer_weights, generate_weights,
};
pub use memory::{MemoryEstimate, RunShape, decimal_bytes};
pub use orchestrate::prefill_heap_bytes;
pub use plan::{KvSplit, LayerBlocks, TilePolicy};
pub use quant::{Int8Acts, UnknownWeightFormat, WeightFormat};
pub use resident::{KvBuffers, Qwen3RunError, ResidentModel};
pub use rope::{Rope, RopeScaling, RopeTables};
pub use runner::{LayersOutput, Session, StepOutput};
pub use weights::{KvCache, LayerWeights, PagedBatch, ProjectionElem, Qwen3Weights};
