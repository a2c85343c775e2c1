//! Chunked causal prefill attention: token-major packed queries of one sequence's chunk against
//! the cached prefix plus the chunk itself (whose K/V the caller has already written).

use std::ops::Range;

use half::bf16;

use super::{PagedKv, core};
use crate::convert::f32_to_bf16;

/// Where one sequence's chunk sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillSeq {
    /// Tokens of the sequence after this chunk (cached prefix + chunk).
    pub seq_len: usize,
    /// Tokens in this chunk (the chunk starts at position `seq_len - chunk_len`).
    pub chunk_len: usize,
    /// Row of the chunk's first token in the packed query/output tensors.
    pub token_offset: usize,
}

/// Causal attention for chunk rows `rows` (chunk-relative, a sub-range of
/// `0..seq.chunk_len`) of one sequence and KV head `kv_head`: the query at chunk row `i`
/// (position `p = seq_len - chunk_len + i`) attends to tokens `0..=p`. Queries and outputs are
/// token-major packed `[T, num_heads * head_dim]` bf16 (`q` and `out`, same width); only the
/// group's columns of the given rows are written.
///
/// # Panics
/// If the rows or heads fall outside `q`/`out`, the chunk is longer than the sequence, or a
/// page is outside `block_table` or the pool.
#[allow(clippy::too_many_arguments)]
pub fn prefill_attention_bf16(
    q: &[bf16],
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    kv_head: usize,
    seq: PrefillSeq,
    rows: Range<usize>,
    scale: f32,
    out: &mut [bf16],
) {
    kv.check();
    let hd = kv.head_dim;
    let width = kv.kv_heads * group * hd;
    assert!(
        seq.chunk_len <= seq.seq_len,
        "prefill: chunk {} longer than sequence {}",
        seq.chunk_len,
        seq.seq_len
    );
    assert!(
        rows.end <= seq.chunk_len && rows.start <= rows.end,
        "prefill: rows {rows:?} outside chunk"
    );
    assert!(kv_head < kv.kv_heads, "prefill: kv head {kv_head}");
    assert_eq!(q.len(), out.len(), "prefill: q and out differ");
    assert!(
        (seq.token_offset + rows.end) * width <= q.len(),
        "prefill: rows outside the packed tensors"
    );
    let start = seq.seq_len - seq.chunk_len;
    let nq = rows.len() * group;
    let mut qf = vec![0.0f32; nq * hd];
    let mut limits = vec![0usize; nq];
    for (ri, i) in rows.clone().enumerate() {
        let base = (seq.token_offset + i) * width + kv_head * group * hd;
        for j in 0..group {
            let dst = &mut qf[(ri * group + j) * hd..(ri * group + j + 1) * hd];
            for (d, s) in dst.iter_mut().zip(&q[base + j * hd..base + (j + 1) * hd]) {
                *d = s.to_f32();
            }
            limits[ri * group + j] = start + i + 1;
        }
    }
    let mut m = vec![f32::NEG_INFINITY; nq];
    let mut l = vec![0.0f32; nq];
    let mut o = vec![0.0f32; nq * hd];
    core::attend(
        &qf,
        nq,
        kv,
        block_table,
        kv_head,
        0..start + rows.end,
        &limits,
        scale,
        &mut m,
        &mut l,
        &mut o,
    );
    for (ri, i) in rows.enumerate() {
        let base = (seq.token_offset + i) * width + kv_head * group * hd;
        for j in 0..group {
            let qi = ri * group + j;
            let inv = if l[qi] > 0.0 { 1.0 / l[qi] } else { 0.0 };
            for (d, &a) in out[base + j * hd..base + (j + 1) * hd]
                .iter_mut()
                .zip(&o[qi * hd..(qi + 1) * hd])
            {
                *d = f32_to_bf16(a * inv);
            }
        }
    }
}

/// A block of query rows of one sequence against one KV head, for the runtime's per-task
/// tiles of causal prefill: row `i` is the token at position `first_pos + i` and attends to
/// tokens `0..=first_pos + i` (their K/V already in the pool). What
/// [`prefill_attention_rows_f32`] and each of its paths take.
#[derive(Clone, Copy, Debug)]
pub struct PrefillRows<'a> {
    /// The group's query heads of each row, widened: `[n_rows, group, head_dim]` fp32 (query
    /// head `kv_head * group + j` of row `i` at `[i, j]`).
    pub queries: &'a [f32],
    /// Query heads per KV head (GQA).
    pub group: usize,
    /// The layer's K and V pools.
    pub kv: PagedKv<'a>,
    /// The sequence's block table.
    pub block_table: &'a [u32],
    /// The KV head the queries read.
    pub kv_head: usize,
    /// Position of row 0's token.
    pub first_pos: usize,
    /// Factor on every score (`1 / sqrt(head_dim)`).
    pub scale: f32,
}

impl PrefillRows<'_> {
    /// Query rows (`group` query heads each).
    pub fn n_rows(&self) -> usize {
        self.queries.len() / (self.group * self.kv.head_dim)
    }

    /// The tokens some row attends to: `0..first_pos + n_rows`.
    pub fn tokens(&self) -> Range<usize> {
        0..self.first_pos + self.n_rows()
    }

    /// Panics unless the pools pass their checks, `queries` is a whole number of rows, `out`
    /// as long, `kv_head` a head of the pools and every page of [`Self::tokens`] inside
    /// `block_table` and the pool: the contract every path's kernel relies on.
    fn check(&self, out: &[f32]) {
        self.kv.check();
        let per_row = self.group * self.kv.head_dim;
        assert!(
            per_row > 0 && self.queries.len().is_multiple_of(per_row),
            "prefill rows: q len {} not a multiple of {per_row}",
            self.queries.len()
        );
        assert_eq!(out.len(), self.queries.len(), "prefill rows: out len");
        assert!(
            self.kv_head < self.kv.kv_heads,
            "prefill rows: kv head {}",
            self.kv_head
        );
        self.kv.check_pages(self.block_table, &self.tokens());
    }
}

/// Causal attention of `rows` (see [`PrefillRows`]): `out` (the shape of `rows.queries`) gets
/// the normalised `softmax · V` of every query, unrounded.
///
/// # Panics
/// If `rows.queries` is not a whole number of rows, `out.len() != rows.queries.len()`,
/// `rows.kv_head` is not a head of the pools, or a page is outside the block table or the
/// pool.
pub fn prefill_attention_rows_f32(rows: &PrefillRows<'_>, out: &mut [f32]) {
    rows.check(out);
    #[cfg(target_arch = "x86_64")]
    {
        let hd = rows.kv.head_dim;
        match super::prefill_path(crate::isa::Isa::current(), hd) {
            crate::isa::Isa::AmxBf16 => {
                // SAFETY: the AMX path is current only when the CPU has AMX-BF16 and AVX-512
                // BF16 and Linux granted the tile state (`Isa::hardware`); `prefill_path`
                // checked the head dimension; `rows.check` checked the pools, `kv_head`,
                // every page of the rows' tokens and that `queries`/`out` are the same whole
                // rows.
                unsafe { super::flash::prefill_rows::<true>(rows, out) };
                return;
            }
            crate::isa::Isa::Avx512Bf16 => {
                // SAFETY: the AVX-512 BF16 path is current only when the CPU has AVX-512
                // F/BW/VL/BF16 (`Isa::hardware`); the rest as above.
                unsafe { super::flash::prefill_rows::<false>(rows, out) };
                return;
            }
            _ => {}
        }
        if crate::isa::Isa::current() >= crate::isa::Isa::Avx2
            && super::avx2::supports(rows.group, hd)
        {
            // SAFETY: Avx2 or a wider path is current only when the CPU has AVX2 and FMA; the
            // shape is supported; `rows.check` checked the pools, `kv_head`, every page of the
            // rows' tokens and that `queries`/`out` are the same whole rows.
            unsafe { super::avx2::prefill_rows(rows, out) };
            return;
        }
    }
    let PrefillRows {
        queries,
        group,
        ref kv,
        block_table,
        kv_head,
        scale,
        ..
    } = *rows;
    let nq = rows.n_rows() * group;
    let limits: Vec<usize> = (0..nq).map(|qi| rows.first_pos + qi / group + 1).collect();
    let mut m = vec![f32::NEG_INFINITY; nq];
    let mut l = vec![0.0f32; nq];
    out.fill(0.0);
    core::attend(
        queries,
        nq,
        kv,
        block_table,
        kv_head,
        rows.tokens(),
        &limits,
        scale,
        &mut m,
        &mut l,
        out,
    );
    for (o, &lq) in out.chunks_exact_mut(kv.head_dim).zip(&l) {
        let inv = if lq > 0.0 { 1.0 / lq } else { 0.0 };
        o.iter_mut().for_each(|v| *v *= inv);
    }
}
