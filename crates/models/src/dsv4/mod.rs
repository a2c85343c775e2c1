//! DeepSeek-V4 "flash" decode layers (`docs/dsv4.md`): configuration as data, seeded fixtures,
//! the independent fp32 golden, the spec's tolerances, and the layers' decode steps on the
//! runtime.
//!
//! Files read top to bottom: [`config`] (shapes, presets, validation) -> [`fixture`] (seeded
//! weights, caches and inputs of one decode step) -> [`golden`] (plain-loop reference of each
//! layer kind) -> [`check`] (the relative-difference tolerances) -> [`ops`] (the runtime
//! kernels) -> `orchestrate` (one step as a task graph) -> [`runner`] (a resident layer and
//! its caches on a worker) -> [`cost`] (bytes and operations per phase, the per-phase bound);
//! [`fixture_file`] keeps a fixture in a safetensors file.

pub mod bf16_layout;
pub mod check;
pub mod config;
pub mod cost;
pub mod fixture;
pub mod fixture_file;
pub mod golden;
pub mod int8_layout;
pub mod moe_cost;
pub mod moe_ep;
pub mod moe_graph;
pub mod moe_ops;
pub mod ops;
mod orchestrate;
mod orchestrate_csa;
pub mod runner;

pub use config::{ConfigError, Dsv4Config, LayerKind, Yarn};
pub use cost::{LayerCost, Peaks, PhaseCost};
pub use fixture::{
    Dsv4Fixture, FixtureError, MIXED_STARTS, TOKENS_PER_SEQ, generate_fixture, uniform_starts,
};
pub use runner::{AttnCaches, AttnLayer, AttnStepOutput, AttnTiles, CsaCaches, Dsv4RunError};
