//! DeepSeek-V4 decode-layer kernels (`docs/dsv4.md`): hyper-connections ([`hc`]: the mix
//! logits, the sigmoid/Sinkhorn weights, the mixed stream, `hc_post`), RMSNorm to bf16 values
//! with or without a weight ([`norm`]), interleaved RoPE with plain or YaRN frequencies and
//! its inverse ([`rope`]), the sparse attention core with its sink over a candidate list
//! ([`attention`]), the compressors' softmax pooling ([`compress`]), the CSA layer's
//! overlapping compressor, indexer and top-k ([`csa`]), the sparse attention's planning
//! ([`plan`]), and the MoE gate, routing, dispatch plan, experts and reduce ([`moe`]).
//!
//! The element-wise kernels are `multiversion!` bodies (a portable build and an AVX2 build
//! chosen on [`crate::Isa::current`]); both builds add in the same order, so they agree
//! bit for bit. The large projections of the layers use [`crate::gemm_bf16`] and
//! [`crate::gemm_i8_w8a8`].

pub mod attention;
pub mod compress;
pub mod csa;
pub mod hc;
pub mod moe;
pub mod norm;
pub mod plan;
pub mod rope;

pub use attention::{ATTN_TILE, AttnScratch, Queries, sparse_attention};
pub use compress::softmax_pool;
pub use hc::{
    hc_inv_rms, hc_inv_rms_rows, hc_mix_dots, hc_mix_len, hc_mix_logits, hc_mix_streams, hc_post,
    hc_weights, round_bf16_half_up, sinkhorn,
};
pub use norm::{norm_rope_heads_bf16, rms_inv_rows, rms_norm_round, round_bf16};
pub use rope::{
    RopeDir, RopeTable, YarnRamp, rope_interleaved, rope_inv_freq_plain, rope_inv_freq_yarn,
};

#[cfg(test)]
pub(crate) mod tests;
