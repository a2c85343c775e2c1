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

/// The query heads of a [`PrefillRows`]: the group's heads of each row, query head `kv_head *
/// group + j` of row `i` at `[i, j]`.
#[derive(Clone, Copy, Debug)]
pub enum PrefillQueries<'a> {
    /// Widened, `[n_rows, group, head_dim]` fp32.
    F32(&'a [f32]),
    /// As the Q rows hold them: row `i`'s group at `rows[i * stride + offset..]`, `group *
    /// head_dim` bf16 (the AVX-512 BF16 and AMX paths read them there; the others widen them
    /// first).
    Bf16 {
        /// The Q rows.
        rows: &'a [bf16],
        /// Elements from one row to the next.
        stride: usize,
        /// Where the group's first head starts in a row.
        offset: usize,
        /// Rows.
        n_rows: usize,
    },
}

/// A block of query rows of one sequence against one KV head, for the runtime's per-task
/// tiles of causal prefill: row `i` is the token at position `first_pos + i` and attends to
/// tokens `0..=first_pos + i` (their K/V already in the pool). What
/// [`prefill_attention_rows_f32`], [`prefill_attention_rows_packed`] and each of their paths
/// take.
#[derive(Clone, Copy, Debug)]
pub struct PrefillRows<'a> {
    /// The group's query heads of each row.
    pub queries: PrefillQueries<'a>,
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
    /// Query rows (`group` query heads each; a whole number of them where `check` passed).
    pub fn n_rows(&self) -> usize {
        match self.queries {
            PrefillQueries::F32(q) => q.len() / self.group.saturating_mul(self.kv.head_dim).max(1),
            PrefillQueries::Bf16 { n_rows, .. } => n_rows,
        }
    }

    /// The widened queries, for the paths that take only those.
    ///
    /// # Panics
    /// If the queries are bf16 rows (the entry points widen them for those paths).
    pub(super) fn f32_queries(&self) -> &[f32] {
        match self.queries {
            PrefillQueries::F32(q) => q,
            PrefillQueries::Bf16 { .. } => panic!("prefill rows: bf16 queries on an fp32 path"),
        }
    }

    /// Values of every row's query heads (`n_rows × group × head_dim`).
    fn values(&self) -> usize {
        self.n_rows() * self.group * self.kv.head_dim
    }

    /// bf16 queries widened to fp32 `[n_rows, group, head_dim]` (checked rows); `None` for
    /// queries that are fp32 already.
    fn widened(&self) -> Option<Vec<f32>> {
        let PrefillQueries::Bf16 {
            rows,
            stride,
            offset,
            n_rows,
        } = self.queries
        else {
            return None;
        };
        let per_row = self.group * self.kv.head_dim;
        let mut q = vec![0.0f32; n_rows * per_row];
        for (i, dst) in q.chunks_exact_mut(per_row.max(1)).enumerate() {
            crate::convert::cast_bf16_f32(&rows[i * stride + offset..][..per_row], dst);
        }
        Some(q)
    }

    /// The tokens some row attends to: `0..first_pos + n_rows`.
    ///
    /// # Panics
    /// If `first_pos + n_rows` overflows (the kernels' causal limits `first_pos + i + 1`
    /// must never exceed the range `check` validated).
    pub fn tokens(&self) -> Range<usize> {
        let end = self.first_pos.checked_add(self.n_rows());
        0..end.unwrap_or_else(|| {
            panic!(
                "prefill rows: first_pos {} + {} rows overflows",
                self.first_pos,
                self.n_rows()
            )
        })
    }

    /// Panics unless the pools pass their checks, `queries` is a whole number of rows (bf16
    /// rows: every row's group inside `rows`), `out_values` as many values, `kv_head` a head of
    /// the pools and every page of [`Self::tokens`] inside `block_table` and the pool: the
    /// contract every path's kernel relies on.
    fn check(&self, out_values: usize) {
        self.kv.check();
        let per_row = self.group.checked_mul(self.kv.head_dim);
        let per_row = per_row.filter(|&p| p > 0).unwrap_or_else(|| {
            panic!(
                "prefill rows: group {} × head_dim {} query values per row",
                self.group, self.kv.head_dim
            )
        });
        match self.queries {
            PrefillQueries::F32(q) => assert!(
                q.len().is_multiple_of(per_row),
                "prefill rows: q len {} not a multiple of {per_row}",
                q.len()
            ),
            PrefillQueries::Bf16 {
                rows,
                stride,
                offset,
                n_rows,
            } => {
                // The group inside a row, and the last row's group inside `rows`.
                let group_end = offset.checked_add(per_row);
                let end = n_rows.checked_sub(1).map_or(Some(0), |last| {
                    last.checked_mul(stride)
                        .and_then(|v| v.checked_add(group_end?))
                });
                assert!(
                    n_rows == 0
                        || (group_end.is_some_and(|g| g <= stride)
                            && end.is_some_and(|e| e <= rows.len())),
                    "prefill rows: {n_rows} bf16 rows of stride {stride} with the group of {per_row} at {offset} outside the rows' {} values",
                    rows.len()
                );
            }
        }
        assert_eq!(out_values, self.values(), "prefill rows: out len");
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
    rows.check(out.len());
    // SAFETY: `rows.check` passed with `out`'s length.
    if unsafe { flash_rows(rows, Outputs::F32(out)) } {
        return;
    }
    let (queries, widened_rows);
    let rows = match rows.widened() {
        None => rows,
        Some(q) => {
            queries = q;
            widened_rows = PrefillRows {
                queries: PrefillQueries::F32(&queries),
                ..*rows
            };
            &widened_rows
        }
    };
    rows_f32_vector(rows, out);
}

/// Causal attention of `rows` into packed bf16 activations: `out[i]` (`group × head_dim`
/// values, one slice per query row) gets row `i`'s normalised outputs rounded to bf16
/// (`convert::f32_to_bf16`) in the packed order of a segment of whole packing blocks
/// (`gemm::pack_index`: each 16 values' even ones, then its odd ones), as
/// [`prefill_attention_rows_f32`], `cast_f32_bf16` and `pack_segment_bf16` would leave them, bit
/// for bit. The AVX-512 BF16 and AMX paths write them so as they leave the kernel (with bf16
/// queries read where they lie: the model's prefill tasks spent ~10% of their time widening
/// queries and rounding and packing outputs); the others go through those three steps.
///
/// # Panics
/// As [`prefill_attention_rows_f32`], and if `out` is not one slice of `group × head_dim`
/// values per row, or `head_dim` is not a multiple of 16.
pub fn prefill_attention_rows_packed(rows: &PrefillRows<'_>, out: &mut [&mut [f32]]) {
    let per_row = rows.group * rows.kv.head_dim;
    assert!(
        rows.kv.head_dim.is_multiple_of(crate::gemm::PACK_BLOCK),
        "prefill rows packed: head_dim {} is not whole packing blocks",
        rows.kv.head_dim
    );
    assert!(
        out.iter().all(|r| r.len() == per_row),
        "prefill rows packed: an output row is not {per_row} values"
    );
    rows.check(out.len() * per_row);
    // SAFETY: `rows.check` passed with one row of `per_row` values per query row.
    if unsafe { flash_rows(rows, Outputs::Packed(out)) } {
        return;
    }
    let mut of = vec![0.0f32; rows.values()];
    prefill_attention_rows_f32(rows, &mut of);
    let mut ob = vec![bf16::ZERO; per_row];
    for (dst, src) in out.iter_mut().zip(of.chunks_exact(per_row.max(1))) {
        crate::convert::cast_f32_bf16(src, &mut ob);
        crate::gemm::pack_segment_bf16(&ob, 0, per_row, dst);
    }
}

/// Where [`prefill_attention_rows_f32`] and [`prefill_attention_rows_packed`] put the outputs.
pub(super) enum Outputs<'o, 'r> {
    /// Normalised fp32, `[n_rows, group, head_dim]`.
    F32(&'o mut [f32]),
    /// Rounded to bf16 and packed, one row of `group × head_dim` per query row.
    Packed(&'o mut [&'r mut [f32]]),
}

/// Runs `rows` on the AMX or AVX-512 BF16 path where it is current for the head dimension;
/// `false` (nothing written) elsewhere.
///
/// # Safety
/// `rows.check` passed with the outputs' values (`F32`: its length; `Packed`: one slice of
/// `group × head_dim` per row, `head_dim` a multiple of 16).
#[allow(unused_variables)]
unsafe fn flash_rows(rows: &PrefillRows<'_>, out: Outputs<'_, '_>) -> bool {
    #[cfg(target_arch = "x86_64")]
    match super::prefill_path(crate::isa::Isa::current(), rows.kv.head_dim) {
        crate::isa::Isa::AmxBf16 => {
            // SAFETY: the AMX path is current only when the CPU has AMX-BF16 and AVX-512
            // BF16 and Linux granted the tile state (`Isa::hardware`); `prefill_path` checked
            // the head dimension; the caller checked the pools, `kv_head`, every page of the
            // rows' tokens and that the queries and outputs are the same whole rows.
            unsafe { super::flash::prefill_rows::<true>(rows, out) };
            return true;
        }
        crate::isa::Isa::Avx512Bf16 => {
            // SAFETY: the AVX-512 BF16 path is current only when the CPU has AVX-512
            // F/BW/VL/BF16 (`Isa::hardware`); the rest as above.
            unsafe { super::flash::prefill_rows::<false>(rows, out) };
            return true;
        }
        _ => {}
    }
    false
}

/// `rows` (fp32 queries) on the AVX2 kernel where it runs the shape, else the portable loops.
fn rows_f32_vector(rows: &PrefillRows<'_>, out: &mut [f32]) {
    let queries = rows.f32_queries();
    #[cfg(target_arch = "x86_64")]
    {
        let hd = rows.kv.head_dim;
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
