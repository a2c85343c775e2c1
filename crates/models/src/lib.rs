//! Qwen3 model code (placeholder while the crate is written).
