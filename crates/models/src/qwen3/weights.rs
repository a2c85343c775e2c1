//! What a Qwen3 model holds in memory: bf16 projections in the HF `[out, in]` layout, fp32 norm
//! weights, the embedding table and an optional untied LM head; the shared-weights mode (every
//! layer one `Arc`); RoPE tables; and the paged KV cache with its block tables (`docs/qwen3.md`,
//! "Paged KV cache").

use std::borrow::Cow;
use std::sync::Arc;

use half::bf16;

use super::config::Qwen3Config;

/// One decoder layer's weights. Projections are `[out, in]` row-major (row `o` holds the
/// weights of output `o` along the input): `y[o] = sum_i x[i] * w[o * in + i]`. They are bf16
/// as a checkpoint stores them; the golden also reads fp32 projections (`W = f32`: an int8
/// model's exact `q · scale` values, which bf16 cannot hold).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights<W = bf16> {
    /// `q_proj` `[heads * head_dim, hidden]`.
    pub wq: Vec<W>,
    /// `k_proj` `[kv_heads * head_dim, hidden]`.
    pub wk: Vec<W>,
    /// `v_proj` `[kv_heads * head_dim, hidden]`.
    pub wv: Vec<W>,
    /// `o_proj` `[hidden, heads * head_dim]`.
    pub wo: Vec<W>,
    /// `gate_proj` `[intermediate, hidden]`.
    pub w_gate: Vec<W>,
    /// `up_proj` `[intermediate, hidden]`.
    pub w_up: Vec<W>,
    /// `down_proj` `[hidden, intermediate]`.
    pub w_down: Vec<W>,
    /// `q_norm` `[head_dim]`.
    pub q_norm: Vec<f32>,
    /// `k_norm` `[head_dim]`.
    pub k_norm: Vec<f32>,
    /// `input_layernorm` `[hidden]`.
    pub input_norm: Vec<f32>,
    /// `post_attention_layernorm` `[hidden]`.
    pub post_norm: Vec<f32>,
}

/// A projection weight element the golden multiplies: bf16 as stored, or fp32.
pub trait ProjectionElem: Copy + Into<f32> + Send + Sync + std::fmt::Debug + PartialEq {
    /// The embedding table as this element: the LM head of a tied model.
    fn from_embedding(e: &[bf16]) -> Cow<'_, [Self]>;
}

impl ProjectionElem for bf16 {
    fn from_embedding(e: &[bf16]) -> Cow<'_, [bf16]> {
        Cow::Borrowed(e)
    }
}

impl ProjectionElem for f32 {
    fn from_embedding(e: &[bf16]) -> Cow<'_, [f32]> {
        Cow::Owned(e.iter().map(|v| v.to_f32()).collect())
    }
}

impl<W> LayerWeights<W> {
    /// The same layer with every projection replaced by `f(index, projection)` (index in
    /// the order of [`LayerWeights::shapes`]) and the norm weights kept.
    pub fn map_projections<V>(&self, mut f: impl FnMut(usize, &[W]) -> Vec<V>) -> LayerWeights<V> {
        LayerWeights {
            wq: f(0, &self.wq),
            wk: f(1, &self.wk),
            wv: f(2, &self.wv),
            wo: f(3, &self.wo),
            w_gate: f(4, &self.w_gate),
            w_up: f(5, &self.w_up),
            w_down: f(6, &self.w_down),
            q_norm: self.q_norm.clone(),
            k_norm: self.k_norm.clone(),
            input_norm: self.input_norm.clone(),
            post_norm: self.post_norm.clone(),
        }
    }
}

impl LayerWeights {
    /// Zero weights of the right shapes.
    pub fn zeros(c: &Qwen3Config) -> LayerWeights {
        let (h, q, kv, i, d) = (
            c.hidden_size,
            c.q_width(),
            c.kv_width(),
            c.intermediate_size,
            c.head_dim,
        );
        LayerWeights {
            wq: vec![bf16::ZERO; q * h],
            wk: vec![bf16::ZERO; kv * h],
            wv: vec![bf16::ZERO; kv * h],
            wo: vec![bf16::ZERO; h * q],
            w_gate: vec![bf16::ZERO; i * h],
            w_up: vec![bf16::ZERO; i * h],
            w_down: vec![bf16::ZERO; h * i],
            q_norm: vec![0.0; d],
            k_norm: vec![0.0; d],
            input_norm: vec![0.0; h],
            post_norm: vec![0.0; h],
        }
    }

    /// `(name, [rows, cols])` of every tensor, HF suffixes (`self_attn.q_proj.weight`, ...),
    /// in the order of [`LayerWeights::tensors`].
    pub fn shapes(c: &Qwen3Config) -> [(&'static str, [usize; 2]); 11] {
        let (h, q, kv, i, d) = (
            c.hidden_size,
            c.q_width(),
            c.kv_width(),
            c.intermediate_size,
            c.head_dim,
        );
        [
            ("self_attn.q_proj.weight", [q, h]),
            ("self_attn.k_proj.weight", [kv, h]),
            ("self_attn.v_proj.weight", [kv, h]),
            ("self_attn.o_proj.weight", [h, q]),
            ("mlp.gate_proj.weight", [i, h]),
            ("mlp.up_proj.weight", [i, h]),
            ("mlp.down_proj.weight", [h, i]),
            ("self_attn.q_norm.weight", [1, d]),
            ("self_attn.k_norm.weight", [1, d]),
            ("input_layernorm.weight", [1, h]),
            ("post_attention_layernorm.weight", [1, h]),
        ]
    }

    /// Every tensor has `c`'s shape (`LayerWeights::shapes`); an error names the first that
    /// does not, as `{prefix}.{name}`.
    pub fn check_shapes(&self, c: &Qwen3Config, prefix: &str) -> Result<(), String> {
        for ((name, [r, k]), t) in LayerWeights::shapes(c).iter().zip(self.tensors()) {
            let len = match t {
                Tensor::Bf16(s) => s.len(),
                Tensor::F32(s) => s.len(),
            };
            if len != r * k {
                return Err(format!(
                    "{prefix}.{name}: {len} elements, expected {r} x {k}"
                ));
            }
        }
        Ok(())
    }

    /// Every tensor, in the order of [`LayerWeights::shapes`].
    pub fn tensors(&self) -> [Tensor<'_>; 11] {
        [
            Tensor::Bf16(&self.wq),
            Tensor::Bf16(&self.wk),
            Tensor::Bf16(&self.wv),
            Tensor::Bf16(&self.wo),
            Tensor::Bf16(&self.w_gate),
            Tensor::Bf16(&self.w_up),
            Tensor::Bf16(&self.w_down),
            Tensor::F32(&self.q_norm),
            Tensor::F32(&self.k_norm),
            Tensor::F32(&self.input_norm),
            Tensor::F32(&self.post_norm),
        ]
    }

    /// Every tensor, mutably, in the order of [`LayerWeights::shapes`].
    pub fn tensors_mut(&mut self) -> [TensorMut<'_>; 11] {
        [
            TensorMut::Bf16(&mut self.wq),
            TensorMut::Bf16(&mut self.wk),
            TensorMut::Bf16(&mut self.wv),
            TensorMut::Bf16(&mut self.wo),
            TensorMut::Bf16(&mut self.w_gate),
            TensorMut::Bf16(&mut self.w_up),
            TensorMut::Bf16(&mut self.w_down),
            TensorMut::F32(&mut self.q_norm),
            TensorMut::F32(&mut self.k_norm),
            TensorMut::F32(&mut self.input_norm),
            TensorMut::F32(&mut self.post_norm),
        ]
    }
}

/// A weight tensor's elements, by storage type.
#[derive(Clone, Copy, Debug)]
pub enum Tensor<'a> {
    /// bf16 (projections, embedding, LM head).
    Bf16(&'a [bf16]),
    /// fp32 (norm weights).
    F32(&'a [f32]),
}

/// A weight tensor's elements, mutably.
#[derive(Debug)]
pub enum TensorMut<'a> {
    /// bf16.
    Bf16(&'a mut [bf16]),
    /// fp32.
    F32(&'a mut [f32]),
}

/// A whole model's weights (projections and an untied LM head as `W`; see [`LayerWeights`]).
#[derive(Clone, Debug)]
pub struct Qwen3Weights<W = bf16> {
    /// The configuration the shapes follow.
    pub config: Qwen3Config,
    /// One entry per layer; in shared-weights mode every entry is the same `Arc`.
    pub layers: Vec<Arc<LayerWeights<W>>>,
    /// `embed_tokens` `[vocab, hidden]`.
    pub embedding: Vec<bf16>,
    /// Final `norm` `[hidden]`.
    pub final_norm: Vec<f32>,
    /// Untied `lm_head` `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<Vec<W>>,
}

impl<W: ProjectionElem> Qwen3Weights<W> {
    /// The LM head rows `[vocab, hidden]` as `W` (the embedding table when tied).
    pub fn lm_head_rows(&self) -> Cow<'_, [W]> {
        match &self.lm_head {
            Some(h) => Cow::Borrowed(h),
            None => W::from_embedding(&self.embedding),
        }
    }
}

impl Qwen3Weights {
    /// The LM head `[vocab, hidden]` (the embedding table when tied).
    pub fn lm_head(&self) -> &[bf16] {
        self.lm_head.as_deref().unwrap_or(&self.embedding)
    }

    /// Whether every layer shares one weight set.
    pub fn is_shared(&self) -> bool {
        self.layers.windows(2).all(|w| Arc::ptr_eq(&w[0], &w[1])) && self.layers.len() > 1
    }

    /// Checks every tensor's length against the configuration; names the first that differs.
    pub fn check_shapes(&self) -> Result<(), String> {
        let c = &self.config;
        if self.layers.len() != c.num_hidden_layers {
            return Err(format!(
                "{} layers, config says {}",
                self.layers.len(),
                c.num_hidden_layers
            ));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            layer.check_shapes(c, &format!("model.layers.{l}"))?;
        }
        self.check_outer_shapes()
    }

    /// [`Qwen3Weights::check_shapes`] of the tensors outside the layers: the embedding, the
    /// final norm and an untied LM head.
    pub fn check_outer_shapes(&self) -> Result<(), String> {
        let c = &self.config;
        let emb = c.vocab_size * c.hidden_size;
        if self.embedding.len() != emb {
            return Err(format!(
                "model.embed_tokens.weight: {} elements, expected {emb}",
                self.embedding.len()
            ));
        }
        if self.final_norm.len() != c.hidden_size {
            return Err(format!(
                "model.norm.weight: {} elements, expected {}",
                self.final_norm.len(),
                c.hidden_size
            ));
        }
        match &self.lm_head {
            Some(h) if h.len() != emb => Err(format!(
                "lm_head.weight: {} elements, expected {emb}",
                h.len()
            )),
            _ => Ok(()),
        }
    }
}

/// Paged KV cache of every layer: two allocations (K and V), each holding all layers' pools
/// back to back (layer stride = one pool of `[num_pages * page_size, kv_heads * head_dim]`).
#[derive(Clone, Debug, PartialEq)]
pub struct KvCache {
    /// Layers.
    pub layers: usize,
    /// Pages per layer pool.
    pub num_pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// K pools `[layers, num_pages * page_size, kv_heads * head_dim]`.
    pub k: Vec<bf16>,
    /// V pools, same shape.
    pub v: Vec<bf16>,
}

/// Tokens per page in the reference layout.
pub const PAGE_SIZE: usize = 128;

impl KvCache {
    /// A zeroed cache for `c` with `num_pages` pages per layer.
    pub fn zeros(c: &Qwen3Config, num_pages: usize, page_size: usize) -> KvCache {
        let n = c.num_hidden_layers * num_pages * page_size * c.kv_width();
        KvCache {
            layers: c.num_hidden_layers,
            num_pages,
            page_size,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            k: zeroed_bf16(n),
            v: zeroed_bf16(n),
        }
    }
    /// Width of one row (`kv_heads * head_dim`).
    pub fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Elements of one layer's pool.
    pub fn pool_len(&self) -> usize {
        self.num_pages * self.page_size * self.row()
    }
    /// Layer `l`'s K pool.
    pub fn layer_k(&self, l: usize) -> &[bf16] {
        &self.k[l * self.pool_len()..(l + 1) * self.pool_len()]
    }
    /// Layer `l`'s V pool.
    pub fn layer_v(&self, l: usize) -> &[bf16] {
        &self.v[l * self.pool_len()..(l + 1) * self.pool_len()]
    }
    /// Layer `l`'s K and V pools, mutably.
    pub fn layer_mut(&mut self, l: usize) -> (&mut [bf16], &mut [bf16]) {
        let n = self.pool_len();
        (
            &mut self.k[l * n..(l + 1) * n],
            &mut self.v[l * n..(l + 1) * n],
        )
    }
    /// The K and V rows of pool slot `slot` in layer `l`.
    pub fn rows(&self, l: usize, slot: usize) -> (&[bf16], &[bf16]) {
        let w = self.row();
        (
            &self.layer_k(l)[slot * w..(slot + 1) * w],
            &self.layer_v(l)[slot * w..(slot + 1) * w],
        )
    }
}

/// A zero-filled bf16 vector obtained from zeroed memory (fast for multi-GiB pools).
pub(crate) fn zeroed_bf16(n: usize) -> Vec<bf16> {
    let v: Vec<u16> = vec![0u16; n];
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: bf16 is `repr(transparent)` over u16 (same size and alignment, every bit
    // pattern valid), so the allocation can change element type with the same length and
    // capacity; ManuallyDrop stops the u16 vector from freeing it.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<bf16>(), v.len(), v.capacity()) }
}

/// Block tables and lengths of a batch of sequences (vLLM layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PagedBatch {
    /// Tokens per page.
    pub page_size: usize,
    /// Entries per block-table row.
    pub max_blocks: usize,
    /// `[batch, max_blocks]`: physical page of logical block `j` of sequence `b`.
    pub block_table: Vec<u32>,
    /// Tokens of each sequence, the current one included.
    pub seq_lens: Vec<usize>,
}

impl PagedBatch {
    /// The fixture layout: sequence `b`'s block `j` is page `b * max_blocks + j`, with
    /// `max_blocks = ceil(max_seq / page_size)`.
    pub fn identity(seq_lens: Vec<usize>, max_seq: usize, page_size: usize) -> PagedBatch {
        let max_blocks = max_seq.div_ceil(page_size);
        let block_table = (0..seq_lens.len() * max_blocks).map(|i| i as u32).collect();
        PagedBatch {
            page_size,
            max_blocks,
            block_table,
            seq_lens,
        }
    }
    /// Sequences.
    pub fn batch(&self) -> usize {
        self.seq_lens.len()
    }
    /// Pages the block table refers to (`batch * max_blocks` for the identity layout).
    pub fn num_pages(&self) -> usize {
        self.block_table
            .iter()
            .map(|&p| p as usize + 1)
            .max()
            .unwrap_or(0)
    }
    /// Sequence `b`'s block-table row.
    pub fn table(&self, b: usize) -> &[u32] {
        &self.block_table[b * self.max_blocks..(b + 1) * self.max_blocks]
    }
    /// Pool slot of logical token `t` of sequence `b`.
    pub fn slot(&self, b: usize, t: usize) -> usize {
        simpler_kernels_cpu::paging::slot(self.table(b), self.page_size, t)
    }
    /// `slot_mapping[b] = block_table[b, (seq_len-1)/page] * page + (seq_len-1) % page`: where
    /// the current token's K/V go.
    pub fn slot_mapping(&self) -> Vec<u32> {
        (0..self.batch())
            .map(|b| self.slot(b, self.seq_lens[b] - 1) as u32)
            .collect()
    }
    /// Sequence lengths as `u32` (the kernels' and tensors' type).
    pub fn seq_lens_u32(&self) -> Vec<u32> {
        self.seq_lens.iter().map(|&s| s as u32).collect()
    }
    /// Whether every sequence fits its block table and no length is zero.
    pub fn check(&self) -> Result<(), String> {
        if self.block_table.len() != self.batch() * self.max_blocks {
            return Err(format!(
                "block table has {} entries for {} x {}",
                self.block_table.len(),
                self.batch(),
                self.max_blocks
            ));
        }
        for (b, &len) in self.seq_lens.iter().enumerate() {
            if len == 0 || len > self.max_blocks * self.page_size {
                return Err(format!(
                    "seq_lens[{b}] = {len} outside 1..={}",
                    self.max_blocks * self.page_size
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_mapping_follows_the_spec_formula() {
        let b = PagedBatch::identity(vec![1, 128, 129, 300], 5500, 128);
        assert_eq!(b.max_blocks, 43);
        assert_eq!(
            b.slot_mapping(),
            vec![
                0,
                43 * 128 + 127,
                86 * 128 + 128,
                3 * 43 * 128 + 2 * 128 + 43
            ]
        );
        assert_eq!(b.num_pages(), 4 * 43);
        b.check().unwrap();
    }
}
