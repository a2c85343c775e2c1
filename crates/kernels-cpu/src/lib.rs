//! CPU compute kernels for LLM inference: plain functions over slices, one tile per call,
//! bf16 storage with fp32 accumulation, instruction-set paths chosen at run time ([`Isa`]:
//! AMX-BF16 tiles and AVX-512 BF16 for the matrix products, AVX2+FMA+F16C everywhere) and a
//! portable path.
//!
//! Every kernel is single-threaded: the runtime parallelises by submitting many tile tasks.
//! Each dispatches on [`Isa::current`] (detected once, overridable per thread with
//! [`with_isa`], which the tests use to run every path the CPU has). Kernels panic on
//! malformed arguments (slice lengths, ranges), like slice indexing; they never read or write
//! outside the slices they are given.

pub mod amx;
pub mod attention;
pub mod convert;
pub mod dsv4;
pub mod elementwise;
pub mod gemm;
pub mod gemm_i8;
pub mod isa;
mod math;
pub mod membw;
mod multiversion;
pub mod norm;
pub mod paging;
pub mod rope;
pub mod sampling;
mod simd;

pub use attention::{
    PagedKv, PrefillQueries, PrefillRows, PrefillSeq, decode_attention_bf16,
    decode_attention_combine_bf16, decode_attention_heads_bf16, decode_attention_partial_bf16,
    partial_len, prefill_attention_bf16, prefill_attention_rows_f32, prefill_attention_rows_packed,
    split_range,
};
pub use convert::{bf16_to_f32, cast_bf16_f32, cast_f32_bf16, f32_to_bf16};
pub use elementwise::{
    argmax_combine, argmax_f32, copy_nontemporal_f32, embedding_gather_bf16,
    embedding_gather_rows_bf16, kv_write_bf16, residual_add_f32, swiglu_bf16, swiglu_pack_bf16,
};
pub use gemm::{
    ActsConversion, GemmTile, OutMode, PACK_BLOCK, PAIR_ROWS, PackedActs, PreparedActs, TILE_COLS,
    TILE_ROWS, WeightLayout, WeightsBf16, gemm_bf16, gemm_bf16_converted, gemm_bf16_prepared,
    gemm_scaled_bf16, gemm_scaled_bf16_converted, gemm_scaled_bf16_prepared, pack_acts_bf16,
    pack_acts_f32, pack_index, pack_segment_bf16, packed_ld, packed_len, pair_rows_bf16_into,
    pair_weights_bf16, paired_weights_pay, pairs_index, pairs_len, path_for, path_for_batch,
    tile_weights_bf16, tiled_index, tiled_len, tiled_weights_pay, unpair_weights_bf16,
    untile_weights_bf16,
};
pub use gemm_i8::{
    ActsI8, I8Layout, I8Path, INTERLEAVED_MIN_ROWS, NextRows, PACK_K, PACK_ROWS, QUAD, WeightsI8,
    gemm_i8_w8a8, gemm_i8_w8a8_then, gemm_i8_wide, interleaved_index_i8, pack_weights_i8,
    pack_weights_i8_as, packed_index_i8, quantize_acts_i8, quantize_row_bf16_i8, quantize_row_i8,
    quantize_row_i8_ties_away, w8a8_path, with_i8_path,
};
pub use isa::{Isa, set_process_isa, with_isa};
pub use norm::{
    head_rms_norm_f32, rms_norm_bf16, rms_norm_deferred_bf16, rms_norm_deferred_packed,
    rms_norm_packed,
};
pub use rope::{qk_norm_rope_bf16, rope_neox_f32};
