//! One KV head's group of queries over a range of tokens, a page run (at most [`RUN`] tokens)
//! at a time: the next run's head slices (one pool row apart) are prefetched while the
//! current one computes, scores are register-blocked over `TB` tokens × `G` queries, and
//! `p · V` keeps a slice of the outputs in registers across the run.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::PagedKv;
use super::{MAX_GROUP, update};
use crate::simd::{hsum256, prefetch_l2};

/// Most tokens per run (a page run of the online softmax).
const RUN: usize = 128;

/// Rows per `p · V` block (their V slices stay in L1 while every output lane is updated).
const PV_ROWS: usize = 16;

/// Queries per `p · V` pass (their outputs stay in registers).
const PV_QUERIES: usize = 4;

/// Runs one head's state over `tokens`, page run by page run (at most [`RUN`] tokens), the
/// next run's head slices prefetched while the current one computes.
///
/// # Safety
/// As [`decode_partial`](super::decode_partial).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn head_over(
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    kv_head: usize,
    tokens: Range<usize>,
    state: &mut [f32],
) {
    macro_rules! go {
        ($($g:literal => $tb:literal),*) => {
            match group {
                // SAFETY: forwarded contract; the group matches the instantiation.
                $($g => unsafe { head_g::<$g, $tb>(kv, block_table, kv_head, tokens, state) },)*
                _ => unreachable!("group {group} not supported"),
            }
        };
    }
    go!(1 => 8, 2 => 4, 3 => 4, 4 => 3, 5 => 2, 6 => 2, 7 => 1, 8 => 1);
}

/// [`head_over`] for group `G`, `TB` tokens a score block.
///
/// # Safety
/// As [`head_over`], with `G` the group `kv` was checked for.
#[target_feature(enable = "avx2,fma")]
unsafe fn head_g<const G: usize, const TB: usize>(
    kv: &PagedKv<'_>,
    block_table: &[u32],
    kv_head: usize,
    tokens: Range<usize>,
    st: &mut [f32],
) {
    let hd = kv.head_dim;
    let row = kv.row();
    let mut s = [0.0f32; MAX_GROUP * RUN];
    let kp = kv.k.as_ptr().cast::<u16>();
    let vp = kv.v.as_ptr().cast::<u16>();
    let page = kv.page_size;
    let slot_of = |t: usize| block_table[t / page] as usize * page + t % page;
    let mut t = tokens.start;
    while t < tokens.end {
        let run = RUN.min(page - t % page).min(tokens.end - t);
        let base = slot_of(t) * row + kv_head * hd;
        // The next run's head slices (one pool row apart), prefetched while this one computes.
        let next = t + run;
        if next < tokens.end {
            let nrun = RUN.min(page - next % page).min(tokens.end - next);
            let nbase = slot_of(next) * row + kv_head * hd;
            for i in 0..nrun {
                for e in (0..hd).step_by(32) {
                    prefetch_l2(kp.wrapping_add(nbase + i * row + e));
                    prefetch_l2(vp.wrapping_add(nbase + i * row + e));
                }
            }
        }
        let mut i = 0;
        while i + TB <= run {
            // SAFETY: rows i..i+TB of this run are inside the pool (caller's contract).
            unsafe { scores::<G, TB>(st, kp.add(base + i * row), row, hd, &mut s, RUN, i) };
            i += TB;
        }
        while i < run {
            // SAFETY: as above, for one row.
            unsafe { scores::<G, 1>(st, kp.add(base + i * row), row, hd, &mut s, RUN, i) };
            i += 1;
        }
        // SAFETY: run <= RUN is the score stride; the run's V rows are inside the pool.
        unsafe {
            update::<G>(&mut s, RUN, run, hd, st);
            pv_head::<G>(&s, RUN, vp.add(base), row, 0..run, hd, st);
        }
        t += run;
    }
}

/// `o_j += sum_i p_ji v_i` for every query of one head's state `st`, rows `rows` of V at `v`.
///
/// # Safety
/// As [`pv`].
#[target_feature(enable = "avx2,fma")]
unsafe fn pv_head<const G: usize>(
    p: &[f32],
    sr: usize,
    v: *const u16,
    row: usize,
    rows: Range<usize>,
    hd: usize,
    st: &mut [f32],
) {
    let o = &mut st[G * hd..2 * G * hd];
    let mut j0 = 0;
    while j0 < G {
        let n = PV_QUERIES.min(G - j0);
        let r = rows.clone();
        // SAFETY: forwarded; queries j0..j0+n < G.
        unsafe {
            match n {
                1 => pv::<G, 1, 2>(p, sr, v, row, r, hd, o, j0),
                2 => pv::<G, 2, 2>(p, sr, v, row, r, hd, o, j0),
                3 => pv::<G, 3, 1>(p, sr, v, row, r, hd, o, j0),
                _ => pv::<G, 4, 1>(p, sr, v, row, r, hd, o, j0),
            }
        }
        j0 += n;
    }
}

/// Scores of rows `i..i+TB` (K rows at `k`, `row` elements apart) against the `G` permuted
/// queries `qf` (`[G, hd]`), into `s[j * sr + i + r]`.
///
/// # Safety
/// AVX2 and FMA; `TB` rows of `hd` bf16 readable at `k + r * row`; `hd` a multiple of 16;
/// `qf.len() >= G * hd`.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::needless_range_loop)] // register blocks indexed by (query, row)
unsafe fn scores<const G: usize, const TB: usize>(
    qf: &[f32],
    k: *const u16,
    row: usize,
    hd: usize,
    s: &mut [f32],
    sr: usize,
    i: usize,
) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let mut acc = [[_mm256_setzero_ps(); TB]; G];
    let mut d = 0;
    while d < hd {
        for r in 0..TB {
            // SAFETY: d + 16 <= hd inside row r (caller's contract).
            let raw = unsafe { _mm256_loadu_si256(k.add(r * row + d).cast::<__m256i>()) };
            let ke = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
            let ko = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
            for j in 0..G {
                // SAFETY: j * hd + d + 16 <= G * hd = qf.len().
                let (qe, qo) = unsafe {
                    (
                        _mm256_loadu_ps(qf.as_ptr().add(j * hd + d)),
                        _mm256_loadu_ps(qf.as_ptr().add(j * hd + d + 8)),
                    )
                };
                acc[j][r] = _mm256_fmadd_ps(qe, ke, acc[j][r]);
                acc[j][r] = _mm256_fmadd_ps(qo, ko, acc[j][r]);
            }
        }
        d += 16;
    }
    for j in 0..G {
        for r in 0..TB {
            s[j * sr + i + r] = hsum256(acc[j][r]);
        }
    }
}

/// `o[j] += sum_i p[j * sr + i] * v_i` (`o` is `[G, hd]`, permuted) for queries `j0..j0+GJ`,
/// over rows `rows` (V at `v`, `row` apart), `16·VB` output lanes at a time held in registers.
///
/// # Safety
/// AVX2 and FMA; rows `rows` of `hd` bf16 readable at `v + i * row`; `hd` a multiple of
/// `16·VB`; `o.len() >= G * hd`; `j0 + GJ <= G`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // register blocks by query
unsafe fn pv<const G: usize, const GJ: usize, const VB: usize>(
    p: &[f32],
    sr: usize,
    v: *const u16,
    row: usize,
    rows: Range<usize>,
    hd: usize,
    o: &mut [f32],
    j0: usize,
) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    // Rows in blocks whose V slices stay in L1 across the output-lane passes.
    let mut i0 = rows.start;
    while i0 < rows.end {
        let i1 = (i0 + PV_ROWS).min(rows.end);
        let mut dc = 0;
        while dc < hd {
            let mut acc = [[_mm256_setzero_ps(); 2]; GJ];
            let mut acc2 = [[_mm256_setzero_ps(); 2]; GJ];
            for j in 0..GJ {
                // SAFETY: (j0 + j) * hd + dc + 16·VB <= G * hd <= o.len().
                unsafe {
                    acc[j][0] = _mm256_loadu_ps(o.as_ptr().add((j0 + j) * hd + dc));
                    acc[j][1] = _mm256_loadu_ps(o.as_ptr().add((j0 + j) * hd + dc + 8));
                    if VB == 2 {
                        acc2[j][0] = _mm256_loadu_ps(o.as_ptr().add((j0 + j) * hd + dc + 16));
                        acc2[j][1] = _mm256_loadu_ps(o.as_ptr().add((j0 + j) * hd + dc + 24));
                    }
                }
            }
            for i in i0..i1 {
                // SAFETY: row i holds hd readable bf16 at v + i * row, dc + 16·VB <= hd.
                let raw = unsafe { _mm256_loadu_si256(v.add(i * row + dc).cast::<__m256i>()) };
                let ve = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                let vo = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                let (ve2, vo2) = if VB == 2 {
                    // SAFETY: as above, the next 16 lanes.
                    let raw2 =
                        unsafe { _mm256_loadu_si256(v.add(i * row + dc + 16).cast::<__m256i>()) };
                    (
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw2)),
                        _mm256_castsi256_ps(_mm256_and_si256(raw2, mask)),
                    )
                } else {
                    (ve, vo)
                };
                for j in 0..GJ {
                    let pj = _mm256_set1_ps(p[(j0 + j) * sr + i]);
                    acc[j][0] = _mm256_fmadd_ps(pj, ve, acc[j][0]);
                    acc[j][1] = _mm256_fmadd_ps(pj, vo, acc[j][1]);
                    if VB == 2 {
                        acc2[j][0] = _mm256_fmadd_ps(pj, ve2, acc2[j][0]);
                        acc2[j][1] = _mm256_fmadd_ps(pj, vo2, acc2[j][1]);
                    }
                }
            }
            for j in 0..GJ {
                // SAFETY: as for the loads.
                unsafe {
                    _mm256_storeu_ps(o.as_mut_ptr().add((j0 + j) * hd + dc), acc[j][0]);
                    _mm256_storeu_ps(o.as_mut_ptr().add((j0 + j) * hd + dc + 8), acc[j][1]);
                    if VB == 2 {
                        _mm256_storeu_ps(o.as_mut_ptr().add((j0 + j) * hd + dc + 16), acc2[j][0]);
                        _mm256_storeu_ps(o.as_mut_ptr().add((j0 + j) * hd + dc + 24), acc2[j][1]);
                    }
                }
            }
            dc += 16 * VB;
        }
        i0 = i1;
    }
}
