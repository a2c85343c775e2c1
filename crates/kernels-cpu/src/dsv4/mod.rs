//! DeepSeek-V4 "flash" decode kernels (`docs/dsv4.md`): the CSA layer's compressor, indexer
//! and top-k ([`csa`]) and the sparse attention's planning ([`plan`]).

pub mod csa;
pub mod plan;
