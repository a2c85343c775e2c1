//! Elementwise and small reduction kernels of the step: SwiGLU, residual add, embedding
//! gather, greedy argmax and the KV-cache row write.

use half::bf16;

use crate::convert::{bf16_to_f32, f32_to_bf16};
use crate::math::exp_approx;
use crate::multiversion::multiversion;

multiversion! {
    /// SwiGLU over rows of `gate.len() / row_scale.len()`: with `gt = gate * s` and
    /// `u = up * s` (`s = row_scale[row]`, the decode step's deferred `r2`; pass ones when
    /// the inputs are already scaled), `out = bf16(gt * sigmoid(gt) * u)`. The sigmoid's
    /// `e^-gt` is the crate's polynomial `exp_approx` (~3 ulp, then rounded to bf16), so the
    /// loop vectorises: with the library `expf` per element, SwiGLU took ~15% of a batch-16
    /// gate/up block's time next to its weight stream (`docs/benchmarks.md`).
    ///
    /// # Panics
    /// If the lengths differ or are not a multiple of `row_scale.len()`.
    pub fn swiglu_bf16(gate: &[f32], up: &[f32], row_scale: &[f32], out: &mut [bf16]) {
        assert_eq!(gate.len(), up.len(), "swiglu_bf16: up len");
        assert_eq!(gate.len(), out.len(), "swiglu_bf16: out len");
        let rows = row_scale.len().max(1);
        assert_eq!(gate.len() % rows, 0, "swiglu_bf16: rows");
        let w = gate.len() / rows;
        if w == 0 {
            return;
        }
        for (((g, u), o), &s) in gate.chunks_exact(w).zip(up.chunks_exact(w)).zip(out.chunks_exact_mut(w)).zip(row_scale) {
            for ((&gv, &uv), ov) in g.iter().zip(u).zip(o.iter_mut()) {
                let gt = gv * s;
                let sig = 1.0 / (1.0 + exp_approx(-gt));
                *ov = f32_to_bf16(gt * sig * (uv * s));
            }
        }
    }
}

multiversion! {
    avx512;
    /// [`swiglu_bf16`] of one row (`gate`, `up`, scale `s`) packed straight into `dst`, that
    /// row's columns `c0 .. c0 + gate.len()` of a packed activation row of `cols` columns:
    /// the values and the layout of `swiglu_bf16` then `pack_segment_bf16`, bit for bit, in
    /// one pass with no bf16 row between them. A prefill gate/up block's epilogue (512 rows of
    /// its columns): the two calls, each an AVX2 loop, took ~8% of the block's time next to
    /// its products (`docs/benchmarks.md`, session 59); here each packing block's 16 values
    /// are computed in one vector (AVX-512) and stored in their packed order.
    ///
    /// # Panics
    /// As `pack_segment_bf16`: if `gate`, `up` and `dst` differ in length, or the columns
    /// pass `cols` or do not start on a packing block and end on one or at `cols`.
    pub fn swiglu_pack_bf16(gate: &[f32], up: &[f32], s: f32, c0: usize, cols: usize, dst: &mut [f32]) {
        use crate::gemm::PACK_BLOCK;
        assert!(
            gate.len() == up.len() && gate.len() == dst.len(),
            "swiglu_pack_bf16: gate {}, up {}, dst {} differ",
            gate.len(),
            up.len(),
            dst.len()
        );
        crate::gemm::check_segment("swiglu_pack_bf16", c0, gate.len(), cols);
        // One element as `swiglu_bf16` computes it, rounded to bf16 and widened back.
        #[inline(always)]
        fn one(g: f32, u: f32, s: f32) -> f32 {
            let gt = g * s;
            let sig = 1.0 / (1.0 + exp_approx(-gt));
            bf16_to_f32(f32_to_bf16(gt * sig * (u * s)))
        }
        let full = gate.len() / PACK_BLOCK * PACK_BLOCK;
        for ((g, u), d) in gate[..full]
            .chunks_exact(PACK_BLOCK)
            .zip(up[..full].chunks_exact(PACK_BLOCK))
            .zip(dst[..full].chunks_exact_mut(PACK_BLOCK))
        {
            let mut v = [0.0f32; PACK_BLOCK];
            for i in 0..PACK_BLOCK {
                v[i] = one(g[i], u[i], s);
            }
            // The packed order: a block's even columns, then its odd ones (`pack_index`).
            for i in 0..PACK_BLOCK / 2 {
                d[i] = v[2 * i];
                d[PACK_BLOCK / 2 + i] = v[2 * i + 1];
            }
        }
        // A last partial block is the row's own tail: in natural order.
        for ((&g, &u), d) in gate[full..].iter().zip(&up[full..]).zip(&mut dst[full..]) {
            *d = one(g, u, s);
        }
    }
}

multiversion! {
    /// `x += y` (fp32 residual stream).
    ///
    /// # Panics
    /// If the lengths differ.
    pub fn residual_add_f32(x: &mut [f32], y: &[f32]) {
        assert_eq!(x.len(), y.len(), "residual_add_f32: lengths differ");
        for (a, &b) in x.iter_mut().zip(y) {
            *a += b;
        }
    }
}

multiversion! {
    /// Gathers embedding rows: `out[i, :] = f32(table[ids[i], :])` for a bf16 table of rows of
    /// `hidden`.
    ///
    /// # Panics
    /// If an id is outside the table or `out.len() != ids.len() * hidden`.
    pub fn embedding_gather_bf16(table: &[bf16], hidden: usize, ids: &[u32], out: &mut [f32]) {
        assert_eq!(out.len(), ids.len() * hidden, "embedding_gather_bf16: out len");
        if hidden == 0 {
            return;
        }
        let vocab = table.len() / hidden;
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(hidden)) {
            let id = id as usize;
            assert!(id < vocab, "embedding_gather_bf16: token id {id} outside vocabulary {vocab}");
            for (d, &s) in o.iter_mut().zip(&table[id * hidden..(id + 1) * hidden]) {
                *d = bf16_to_f32(s);
            }
        }
    }
}

/// [`embedding_gather_bf16`] from a table in any [`crate::WeightLayout`]: a tiled table's
/// row is gathered 32 elements (one line) at a time, a paired table's element by element (a
/// row's pair every 32 bytes).
///
/// # Panics
/// If an id is outside the table or `out.len() != ids.len() * table.cols()`.
pub fn embedding_gather_rows_bf16(table: crate::WeightsBf16<'_>, ids: &[u32], out: &mut [f32]) {
    let (vocab, hidden) = (table.rows(), table.cols());
    if table.layout() == crate::WeightLayout::RowMajor {
        embedding_gather_bf16(table.data(), hidden, ids, out);
        return;
    }
    assert_eq!(
        out.len(),
        ids.len() * hidden,
        "embedding_gather_rows_bf16: out len"
    );
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(hidden.max(1))) {
        let id = id as usize;
        assert!(
            id < vocab,
            "embedding_gather_rows_bf16: token id {id} outside vocabulary {vocab}"
        );
        match table.layout() {
            crate::WeightLayout::Pairs => {
                for (kk, d) in o.iter_mut().enumerate() {
                    *d = table.data()[crate::pairs_index(id, kk, hidden)].to_f32();
                }
            }
            _ => {
                for (s, dst) in o.chunks_mut(crate::TILE_COLS).enumerate() {
                    let at = crate::tiled_index(id, s * crate::TILE_COLS, hidden);
                    let len = dst.len();
                    for (d, &v) in dst.iter_mut().zip(&table.data()[at..at + len]) {
                        *d = v.to_f32();
                    }
                }
            }
        }
    }
}

/// Lanes of [`argmax_f32`]'s passes: what the compiler maps onto one or two vector registers
/// on each build.
const ARGMAX_LANES: usize = 16;

multiversion! {
    avx512;
    /// Greedy pick: the index and value of the largest element; ties go to the lowest index and
    /// NaNs never win. `None` for an empty slice or one holding only NaNs.
    ///
    /// Two passes over lanes the compiler vectorises: the largest value (`v > m` is false for
    /// a NaN, so NaNs are skipped), then the first element equal to it. A branch per element
    /// took ~1 ns each: 15 µs of a batch-16 LM head block's ~200 (16 rows of 960 logits) on
    /// Zen 4 (`docs/benchmarks.md`, session 54). The first equal element is the one the
    /// branchy scan kept: every element before it is smaller or NaN, and `+0.0 == -0.0`, so
    /// of a tie between zeros of both signs the first still wins.
    pub fn argmax_f32(x: &[f32]) -> Option<(usize, f32)> {
        let chunks = x.chunks_exact(ARGMAX_LANES);
        let tail = chunks.remainder();
        let mut lanes = [f32::NEG_INFINITY; ARGMAX_LANES];
        for c in chunks {
            for (m, &v) in lanes.iter_mut().zip(c) {
                *m = if v > *m { v } else { *m };
            }
        }
        let mut best = f32::NEG_INFINITY;
        for &v in lanes.iter().chain(tail) {
            if v > best {
                best = v;
            }
        }
        // `best` stays -inf when every element is NaN (or -inf): then no element equals it, or
        // the first -inf does.
        let mut at = 0;
        for c in x.chunks(ARGMAX_LANES) {
            let mut hits = 0u32;
            for (j, &v) in c.iter().enumerate() {
                hits |= u32::from(v == best) << j;
            }
            if hits != 0 {
                let i = at + hits.trailing_zeros() as usize;
                return Some((i, x[i]));
            }
            at += c.len();
        }
        None
    }
}

/// `dst.copy_from_slice(src)` with non-temporal stores where the target has them (x86-64's
/// baseline `movntps`, 16 bytes at a time from `dst`'s first 16-byte boundary): the 64-byte
/// lines wholly inside `dst` are written without first being read (a line `dst` shares with
/// its neighbours, at either end, gets plain and non-temporal stores both, and is read first).
/// For outputs nothing reads soon that
/// would otherwise arrive cold, as the LM head's logits do (a `[16, vocab]` fp32 block
/// written per step, evicted by the next 311 MB of head weights): copied with plain stores,
/// each destination line was first read from memory, and the copy took ~19 µs of a ~200 µs
/// batch-16 head block on Zen 4 (`docs/benchmarks.md`, session 54).
///
/// Ends with `sfence`: non-temporal stores are weakly ordered, and a release store that tells
/// another thread `dst` is ready (a task's completion) must not become visible before them.
///
/// # Panics
/// If the lengths differ.
pub fn copy_nontemporal_f32(src: &[f32], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "copy_nontemporal_f32: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_loadu_ps, _mm_sfence, _mm_stream_ps};
        // Elements before the first 16-byte boundary (`align_offset` may answer `usize::MAX`,
        // "cannot align": then everything goes by plain stores).
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let body = (dst.len() - head) / 4 * 4;
        dst[..head].copy_from_slice(&src[..head]);
        for i in (head..head + body).step_by(4) {
            // SAFETY: `i + 4 <= head + body <= len` for both slices; `dst + i` is 16-byte
            // aligned (`head` reaches the boundary, `i - head` is a multiple of 4 floats);
            // `src` is read unaligned; SSE is part of x86-64's baseline.
            unsafe { _mm_stream_ps(dst.as_mut_ptr().add(i), _mm_loadu_ps(src.as_ptr().add(i))) };
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
        // SAFETY: SSE's `sfence` has no operands and is part of x86-64's baseline.
        unsafe { _mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Merges per-tile argmax results `(global index, value)` with the same tie rule as
/// [`argmax_f32`] (ties to the lowest index).
pub fn argmax_combine(parts: &[Option<(usize, f32)>]) -> Option<(usize, f32)> {
    let mut best: Option<(usize, f32)> = None;
    for &(i, v) in parts.iter().flatten() {
        match best {
            Some((bi, bv)) if v < bv || (v == bv && i > bi) => {}
            _ => best = Some((i, v)),
        }
    }
    best
}

/// Writes one token's K or V row (`kv_heads * head_dim` bf16) into a layer's pool viewed as
/// `[slots, row.len()]` at `slot` (`slot_mapping[b]`).
///
/// # Panics
/// If the slot is outside the pool.
pub fn kv_write_bf16(pool: &mut [bf16], slot: usize, row: &[bf16]) {
    let w = row.len();
    assert!(
        (slot + 1) * w <= pool.len(),
        "kv_write_bf16: slot {slot} outside pool of {} rows",
        pool.len() / w.max(1)
    );
    pool[slot * w..(slot + 1) * w].copy_from_slice(row);
}
