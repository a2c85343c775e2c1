//! The shared inner loop of decode and prefill attention: a block of queries against the KV
//! tokens of one KV head, one page run (at most 128 tokens) at a time, with online softmax.

use std::ops::Range;

use super::PagedKv;
use crate::math::exp_approx;
use crate::multiversion::multiversion;
use crate::simd::prefetch_l2;

/// Most KV tokens per run (the online-softmax tile).
const RUN: usize = 128;
/// Queries scored per pass over a run.
const QB: usize = 16;
/// Largest head dimension supported.
pub(crate) const MAX_HEAD_DIM: usize = 512;

multiversion! {
    /// Attends `nq` fp32 queries (`q`, `nq * head_dim`) to logical tokens `tokens` of the
    /// sequence with `block_table`, KV head `kv_head`. Query `j` only sees tokens below
    /// `limits[j]` (causal prefill; `usize::MAX` for decode). Updates the running softmax
    /// state `m`, `l` (`nq`) and unnormalised `o` (`nq * head_dim`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend(
        q: &[f32],
        nq: usize,
        kv: &PagedKv<'_>,
        block_table: &[u32],
        kv_head: usize,
        tokens: Range<usize>,
        limits: &[usize],
        scale: f32,
        m: &mut [f32],
        l: &mut [f32],
        o: &mut [f32],
    ) {
        let hd = kv.head_dim;
        assert!(hd <= MAX_HEAD_DIM, "attention: head_dim {hd} above {MAX_HEAD_DIM}");
        let row = kv.row();
        let col0 = kv_head * hd;
        let slots = kv.k.len() / row;
        let mut scores = [0.0f32; QB * RUN];
        let mut kbuf = [0.0f32; MAX_HEAD_DIM];
        let mut qb0 = 0;
        while qb0 < nq {
            let nqb = QB.min(nq - qb0);
            let lim = &limits[qb0..qb0 + nqb];
            let end = tokens.end.min(lim.iter().copied().max().unwrap_or(0));
            let mut t = tokens.start;
            while t < end {
                let run = RUN.min(kv.page_size - t % kv.page_size).min(end - t);
                let slot0 = kv.slot(block_table, t);
                assert!(slot0 + run <= slots, "attention: page of token {t} outside the pool");
                // The run's K and V head slices sit one pool row apart: prefetch them all up
                // front so their misses overlap instead of stalling token by token.
                for i in 0..run {
                    let at = (slot0 + i) * row + col0;
                    for e in (0..hd).step_by(32) {
                        prefetch_l2(kv.k[at + e..].as_ptr());
                        prefetch_l2(kv.v[at + e..].as_ptr());
                    }
                }
                // Valid keys of this run per query (causal limit).
                let valid = |j: usize| lim[j].saturating_sub(t).min(run);
                // Scores.
                for i in 0..run {
                    let krow = &kv.k[(slot0 + i) * row + col0..(slot0 + i) * row + col0 + hd];
                    for (d, s) in kbuf[..hd].iter_mut().zip(krow) {
                        *d = f32::from_bits(u32::from(s.to_bits()) << 16);
                    }
                    for j in 0..nqb {
                        if i < valid(j) {
                            let qj = &q[(qb0 + j) * hd..(qb0 + j + 1) * hd];
                            scores[j * RUN + i] = dot(qj, &kbuf[..hd]) * scale;
                        }
                    }
                }
                // Online softmax update.
                for j in 0..nqb {
                    let nv = valid(j);
                    if nv == 0 {
                        continue;
                    }
                    let s = &mut scores[j * RUN..j * RUN + nv];
                    let mt = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let qi = qb0 + j;
                    let m_new = m[qi].max(mt);
                    let corr = if m[qi] == f32::NEG_INFINITY { 0.0 } else { exp_approx(m[qi] - m_new) };
                    let mut sum = 0.0f32;
                    for v in s.iter_mut() {
                        *v = exp_approx(*v - m_new);
                        sum += *v;
                    }
                    l[qi] = l[qi] * corr + sum;
                    m[qi] = m_new;
                    if corr != 1.0 {
                        for v in &mut o[qi * hd..(qi + 1) * hd] {
                            *v *= corr;
                        }
                    }
                }
                // o += p · V.
                for i in 0..run {
                    let vrow = &kv.v[(slot0 + i) * row + col0..(slot0 + i) * row + col0 + hd];
                    for (d, s) in kbuf[..hd].iter_mut().zip(vrow) {
                        *d = f32::from_bits(u32::from(s.to_bits()) << 16);
                    }
                    for j in 0..nqb {
                        if i < valid(j) {
                            let p = scores[j * RUN + i];
                            let qi = qb0 + j;
                            for (a, &v) in o[qi * hd..(qi + 1) * hd].iter_mut().zip(&kbuf[..hd]) {
                                *a += p * v;
                            }
                        }
                    }
                }
                t += run;
            }
            qb0 += nqb;
        }
    }
}

/// Dot product in eight lanes.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}
