//! AVX2+FMA split-KV decode attention: a range of tokens against one KV head's group of `G`
//! queries ([`decode_partial`]) or every head's at once ([`decode_partials_heads`], what the
//! model runs), a run of tokens at a time with online softmax.
//!
//! - bf16 K and V are widened by the even/odd split of `crate::gemm` (one 256-bit load of 16
//!   values, a shift for the even lanes, a mask for the odd ones); the queries and the
//!   running outputs are kept in the matching permuted order (each 16-block as
//!   `[x0, x2, .., x14, x1, x3, .., x15]`) and put back in order when the partial is written.
//! - Scores are register-blocked over tokens × `G` queries, so the dot products overlap
//!   instead of forming one latency chain per token.
//! - Max, `exp` and sums of the online softmax run eight lanes at a time.
//! - One head: the next run's head slices are prefetched while the current one computes;
//!   `p · V` keeps a slice of the outputs in registers across the run.
//! - Every head: the pool is read token-major, whole rows in address order (a head's slice
//!   is only 256 bytes of a 2 KB row: walking one head down the rows, then the next, left the
//!   hardware prefetchers behind and read KV at ~5 GB/s per core instead of ~6.5), with a
//!   software prefetch a few rows ahead spread over the head calls.
//!
//! Nothing is allocated: queries, outputs and scores live on the stack or in the caller's
//! scratch.

use std::arch::x86_64::*;
use std::ops::Range;

use half::bf16;

use super::PagedKv;
use crate::simd::{hsum256, prefetch_l2};

/// Most tokens per run (a page run of the online softmax).
const RUN: usize = 128;
/// Largest query group handled here.
const MAX_GROUP: usize = 8;
/// Largest head dimension handled here.
const MAX_HD: usize = 256;
/// Rows per `p · V` block (their V slices stay in L1 while every output lane is updated).
const PV_ROWS: usize = 16;
/// Queries per `p · V` pass (their outputs stay in registers).
const PV_QUERIES: usize = 4;

/// Whether [`decode_partial`] handles this shape.
pub(super) fn supports(group: usize, head_dim: usize) -> bool {
    (1..=MAX_GROUP).contains(&group) && head_dim.is_multiple_of(32) && head_dim <= MAX_HD
}

/// Computes the partial records (`[m, l, o]` per query, see the module docs of `attention`)
/// of the group's queries `q` (`group * head_dim` bf16) over `tokens`.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `supports(group, kv.head_dim)`; `kv` passed its checks;
/// `kv_head < kv.kv_heads`; every page of `tokens` is inside `block_table` and the pool;
/// `q.len() == group * head_dim`; `partial.len() == group * (head_dim + 2)`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn decode_partial(
    q: &[bf16],
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    kv_head: usize,
    tokens: Range<usize>,
    scale: f32,
    partial: &mut [f32],
) {
    let hd = kv.head_dim;
    let mut state = [0.0f32; MAX_GROUP * (2 * MAX_HD + 2)];
    let st = &mut state[..group * (2 * hd + 2)];
    init_state(q, group, hd, scale, st);
    // SAFETY: forwarded contract; `st` is one head's state.
    unsafe { head_over(group, kv, block_table, kv_head, tokens, st) };
    write_partials(st, group, hd, partial);
}

/// [`decode_partial`] for every KV head at once (`q` the whole row, `kv_heads * group *
/// head_dim`; `partials` one record set per head, in head order), streaming whole pool rows:
/// each run's rows are read once for all heads, the next run's prefetched meanwhile.
/// `state` is scratch of [`heads_state_len`] floats.
///
/// # Safety
/// As [`decode_partial`] for every head; `q.len() == kv_heads * group * head_dim`;
/// `partials.len() == kv_heads * group * (head_dim + 2)`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn decode_partials_heads(
    q: &[bf16],
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    tokens: Range<usize>,
    scale: f32,
    partials: &mut [f32],
    state: &mut [f32],
) {
    let hd = kv.head_dim;
    let per = group * (2 * hd + 2);
    let qh = group * hd;
    let (state, scores) = state.split_at_mut(kv.kv_heads * per);
    for (g, st) in state.chunks_exact_mut(per).enumerate() {
        init_state(&q[g * qh..(g + 1) * qh], group, hd, scale, st);
    }
    // SAFETY: forwarded contract; `state` holds one state per head, `scores` the rest.
    unsafe { rows_over(group, kv, block_table, tokens, state, scores) };
    let rec = group * (hd + 2);
    for (st, out) in state.chunks_exact(per).zip(partials.chunks_exact_mut(rec)) {
        write_partials(st, group, hd, out);
    }
}

/// Causal prefill rows of one KV head (see `prefill_attention_rows_f32`): row `i` of `q`
/// (`group` widened queries) attends to tokens `0..=first_pos + i`; `out` gets the normalised
/// outputs. Each row is one single-head decode pass over its prefix, which the register-blocked
/// kernel runs several times faster than the portable block loop (the prefix's K/V of one
/// head stays in L2 across the rows).
///
/// # Safety
/// As [`decode_partial`] for tokens `0..first_pos + rows`; `q.len() == out.len()`, a whole
/// number of rows of `group * head_dim`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn prefill_rows(
    q: &[f32],
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    kv_head: usize,
    first_pos: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let per_row = group * hd;
    let mut state = [0.0f32; MAX_GROUP * (2 * MAX_HD + 2)];
    let st = &mut state[..group * (2 * hd + 2)];
    let mut recs = [0.0f32; MAX_GROUP * (MAX_HD + 2)];
    let recs = &mut recs[..group * (hd + 2)];
    for (i, (qr, or)) in q
        .chunks_exact(per_row)
        .zip(out.chunks_exact_mut(per_row))
        .enumerate()
    {
        init_state_with(qr, group, hd, scale, st, |v| *v);
        // SAFETY: forwarded contract (tokens 0..=first_pos + i are covered).
        unsafe { head_over(group, kv, block_table, kv_head, 0..first_pos + i + 1, st) };
        write_partials(st, group, hd, recs);
        for (o, rec) in or.chunks_exact_mut(hd).zip(recs.chunks_exact(hd + 2)) {
            let inv = if rec[1] > 0.0 { 1.0 / rec[1] } else { 0.0 };
            for (d, &a) in o.iter_mut().zip(&rec[2..]) {
                *d = a * inv;
            }
        }
    }
}

/// Floats of scratch [`decode_partials_heads`] needs.
pub(super) fn heads_state_len(kv_heads: usize, group: usize, head_dim: usize) -> usize {
    kv_heads * group * (2 * head_dim + 2) + rows_scores_len(kv_heads, group)
}

/// One head's state, `group * (2 * hd + 2)` floats: queries (permuted, pre-scaled)
/// `[group, hd]`, outputs (permuted) `[group, hd]`, running max `[group]`, running sum
/// `[group]`.
fn init_state(q: &[bf16], group: usize, hd: usize, scale: f32, st: &mut [f32]) {
    init_state_with(q, group, hd, scale, st, |v| v.to_f32());
}

/// [`init_state`] for queries of any element type, widened by `f`.
fn init_state_with<T>(
    q: &[T],
    group: usize,
    hd: usize,
    scale: f32,
    st: &mut [f32],
    f: impl Fn(&T) -> f32,
) {
    let (qs, rest) = st.split_at_mut(group * hd);
    for (dst, src) in qs.chunks_exact_mut(16).zip(q.chunks_exact(16)) {
        for i in 0..8 {
            dst[i] = f(&src[2 * i]) * scale;
            dst[8 + i] = f(&src[2 * i + 1]) * scale;
        }
    }
    let (o, ml) = rest.split_at_mut(group * hd);
    o.fill(0.0);
    ml[..group].fill(f32::NEG_INFINITY);
    ml[group..].fill(0.0);
}

fn write_partials(st: &[f32], group: usize, hd: usize, out: &mut [f32]) {
    let o = &st[group * hd..2 * group * hd];
    let ml = &st[2 * group * hd..];
    for j in 0..group {
        let rec = &mut out[j * (hd + 2)..(j + 1) * (hd + 2)];
        rec[0] = ml[j];
        rec[1] = ml[group + j];
        for (dst, src) in rec[2..]
            .chunks_exact_mut(16)
            .zip(o[j * hd..(j + 1) * hd].chunks_exact(16))
        {
            for i in 0..8 {
                dst[2 * i] = src[i];
                dst[2 * i + 1] = src[8 + i];
            }
        }
    }
}

/// Runs one head's state over `tokens`, page run by page run (at most [`RUN`] tokens), the
/// next run's head slices prefetched while the current one computes.
///
/// # Safety
/// As [`decode_partial`].
#[target_feature(enable = "avx2,fma")]
unsafe fn head_over(
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

/// Runs every KV head (states back to back in `state`, scores in `s`, [`rows_scores_len`])
/// over `tokens`, token-major: runs of at most [`ROWS_RUN`] tokens, each row's K (then V)
/// read whole, for all heads, in address order. The pool is thus read as a sequential stream
/// (what the hardware prefetchers follow), and a software prefetch stays [`ROWS_AHEAD`] rows
/// ahead of each of the K and V streams, one head's lines per head call so the misses spread
/// over the arithmetic (a whole row's 32 prefetches at once stall on the miss buffers).
///
/// # Safety
/// As [`decode_partial`] for every head.
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_over(
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    tokens: Range<usize>,
    state: &mut [f32],
    s: &mut [f32],
) {
    macro_rules! go {
        ($($g:literal => $sr:literal, $pr:literal, $pl:literal);*) => {
            match group {
                // SAFETY: forwarded contract; the group matches the instantiation.
                $($g => unsafe { rows_g::<$g, $sr, $pr, $pl>(kv, block_table, tokens, state, s) },)*
                _ => unreachable!("group {group} not supported"),
            }
        };
    }
    // Rows per scores / p·V block and p·V lanes, by group. Small groups read one row at a
    // time: measured from DRAM, blocks of several rows (their head slices 2 KB apart) kept the
    // reads from overlapping the arithmetic (group 2: ~7 GB/s per core with 4-row blocks,
    // ~8 with single rows; group 1: 7 vs 10), while larger groups have enough arithmetic per
    // row that the register reuse of multi-row blocks wins.
    go!(1 => 1, 1, 32; 2 => 1, 1, 32; 3 => 2, 4, 16; 4 => 2, 4, 16; 5 => 1, 4, 16; 6 => 1, 4, 16; 7 => 1, 2, 16; 8 => 1, 2, 16);
}

/// Tokens per run of the token-major pass (the online-softmax tile).
const ROWS_RUN: usize = 32;
/// Rows the software prefetch runs ahead of each stream.
const ROWS_AHEAD: usize = 4;

/// Floats of score scratch [`rows_over`] needs.
pub(super) fn rows_scores_len(kv_heads: usize, group: usize) -> usize {
    kv_heads * group * ROWS_RUN
}

#[target_feature(enable = "avx2,fma")]
unsafe fn rows_g<const G: usize, const SR: usize, const PR: usize, const PL: usize>(
    kv: &PagedKv<'_>,
    block_table: &[u32],
    tokens: Range<usize>,
    state: &mut [f32],
    s: &mut [f32],
) {
    let hd = kv.head_dim;
    let heads = kv.kv_heads;
    let row = kv.row();
    let per = G * (2 * hd + 2);
    let sh = G * ROWS_RUN; // score floats per head
    let kp = kv.k.as_ptr().cast::<u16>();
    let vp = kv.v.as_ptr().cast::<u16>();
    let page = kv.page_size;
    let slot_of = |t: usize| block_table[t / page] as usize * page + t % page;
    let end = tokens.end;
    let ahead = ROWS_AHEAD;
    // Row `t + ahead`'s pointer in pool `p`, or null past the end.
    let ahead_row = |p: *const u16, t: usize| {
        if t + ahead < end {
            p.wrapping_add(slot_of(t + ahead) * row)
        } else {
            std::ptr::null()
        }
    };
    // The first rows, which no earlier row prefetches.
    for u in tokens.start..(tokens.start + ahead).min(end) {
        for e in (0..row).step_by(32) {
            prefetch_l2(kp.wrapping_add(slot_of(u) * row + e));
            prefetch_l2(vp.wrapping_add(slot_of(u) * row + e));
        }
    }
    let mut t = tokens.start;
    while t < end {
        let run = ROWS_RUN.min(page - t % page).min(end - t);
        let base = slot_of(t) * row;
        // Scores, SR rows at a time (every head of them, in address order).
        let mut i = 0;
        while i < run {
            let kr = kp.wrapping_add(base + i * row);
            // SAFETY: rows i..i+SR (or i) of this run are inside the pool (caller's
            // contract); `s` holds `heads * sh` floats and i + SR <= run <= ROWS_RUN.
            unsafe {
                if i + SR <= run {
                    let pf = std::array::from_fn(|r| ahead_row(kp, t + i + r));
                    scores_rows::<G, SR>(state, per, kr, pf, row, heads, hd, s, sh, ROWS_RUN, i);
                    i += SR;
                } else {
                    let pf = [ahead_row(kp, t + i)];
                    scores_rows::<G, 1>(state, per, kr, pf, row, heads, hd, s, sh, ROWS_RUN, i);
                    i += 1;
                }
            }
        }
        for (h, st) in state.chunks_exact_mut(per).enumerate() {
            // SAFETY: run <= ROWS_RUN, the score stride.
            unsafe { update::<G>(&mut s[h * sh..(h + 1) * sh], ROWS_RUN, run, hd, st) };
        }
        // o += p · V, PR rows at a time (every head of them, in address order).
        let mut i = 0;
        while i < run {
            let vr = vp.wrapping_add(base + i * row);
            // SAFETY: rows i..i+PR (or i) of this run are inside the pool (caller's
            // contract); their scores are inside `s`.
            unsafe {
                if i + PR <= run {
                    let pf = std::array::from_fn(|r| ahead_row(vp, t + i + r));
                    pv_rows::<G, PR, PL>(s, sh, ROWS_RUN, i, vr, pf, row, heads, hd, state, per);
                    i += PR;
                } else {
                    let pf = [ahead_row(vp, t + i)];
                    pv_rows::<G, 1, PL>(s, sh, ROWS_RUN, i, vr, pf, row, heads, hd, state, per);
                    i += 1;
                }
            }
        }
        t += run;
    }
}

/// The online-softmax update of one head's state `st` after a run of `run` scores per query
/// (`s[j * sr ..][..run]`): scores become `exp(s - m_new)`, `l` and `o` are rescaled.
///
/// # Safety
/// AVX2 and FMA; `run <= sr`; `s.len() >= G * sr`; `st` one head's state.
#[target_feature(enable = "avx2,fma")]
unsafe fn update<const G: usize>(s: &mut [f32], sr: usize, run: usize, hd: usize, st: &mut [f32]) {
    let (_, rest) = st.split_at_mut(G * hd);
    let (o, ml) = rest.split_at_mut(G * hd);
    let (m, l) = ml.split_at_mut(G);
    for j in 0..G {
        // SAFETY: forwarded (`run <= sr`).
        let (m_new, sum) = unsafe { softmax_run(&mut s[j * sr..(j + 1) * sr], run, m[j]) };
        let corr = if m[j] == f32::NEG_INFINITY {
            0.0
        } else {
            (m[j] - m_new).exp()
        };
        l[j] = l[j] * corr + sum;
        m[j] = m_new;
        if corr != 1.0 {
            o[j * hd..(j + 1) * hd].iter_mut().for_each(|v| *v *= corr);
        }
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

/// Eight-lane `e^x` matching `crate::math::exp_approx` (clamped to `[-87, 88]`).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp256(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), f);
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(p, _mm256_castsi256_ps(e))
}

/// Turns the run's scores `s[..run]` into `exp(s - m_new)` with `m_new = max(m, max s)`;
/// returns `(m_new, sum of the exps)`.
///
/// # Safety
/// AVX2 and FMA available.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_run(s: &mut [f32], run: usize, m: f32) -> (f32, f32) {
    assert!(run <= s.len());
    let full = run / 8 * 8;
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 <= full <= run <= s.len().
        mx = _mm256_max_ps(mx, unsafe { _mm256_loadu_ps(s.as_ptr().add(i)) });
        i += 8;
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds eight floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mx) };
    let mut m_new = lanes.iter().copied().fold(m, f32::max);
    for &v in &s[full..run] {
        m_new = m_new.max(v);
    }
    let mv = _mm256_set1_ps(m_new);
    let mut acc = _mm256_setzero_ps();
    i = 0;
    while i < full {
        // SAFETY: i + 8 <= full <= run <= s.len().
        unsafe {
            let p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s.as_ptr().add(i)), mv));
            _mm256_storeu_ps(s.as_mut_ptr().add(i), p);
            acc = _mm256_add_ps(acc, p);
        }
        i += 8;
    }
    let mut sum = hsum256(acc);
    for v in &mut s[full..run] {
        *v = crate::math::exp_approx(*v - m_new);
        sum += *v;
    }
    (m_new, sum)
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

/// Scores of `R` consecutive K rows (at `k`, `row` elements apart, every head's slice)
/// against every head's `G` permuted queries (`state`, one head state of `per` floats each),
/// into `s[h * sh + j * sr + i + r]`. Each query vector loaded serves the `R` rows and each
/// widened K vector the `G` queries; the `G * R` accumulators hide the FMA latency.
///
/// # Safety
/// AVX2 and FMA; `R` rows of `heads * hd` bf16 readable at `k + r * row`; `hd` a multiple
/// of 16; `state.len() >= heads * per`, each head's queries first; `s` long enough.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn scores_rows<const G: usize, const R: usize>(
    state: &[f32],
    per: usize,
    k: *const u16,
    pf: [*const u16; R],
    row: usize,
    heads: usize,
    hd: usize,
    s: &mut [f32],
    sh: usize,
    sr: usize,
    i: usize,
) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    for h in 0..heads {
        // The same head slice of rows further on: one head's lines at a time, so the misses
        // spread over the arithmetic instead of queueing behind each other.
        for f in pf {
            if !f.is_null() {
                for e in (0..hd).step_by(32) {
                    prefetch_l2(f.wrapping_add(h * hd + e));
                }
            }
        }
        let qf = state[h * per..h * per + G * hd].as_ptr();
        let mut acc = [[_mm256_setzero_ps(); R]; G];
        let mut d = 0;
        while d < hd {
            // SAFETY: j * hd + d + 16 <= G * hd (permuted queries of the head).
            let q: [[__m256; 2]; G] = std::array::from_fn(|j| unsafe {
                [
                    _mm256_loadu_ps(qf.add(j * hd + d)),
                    _mm256_loadu_ps(qf.add(j * hd + d + 8)),
                ]
            });
            for r in 0..R {
                // SAFETY: row r's head h slice holds hd bf16 and d + 16 <= hd.
                let raw =
                    unsafe { _mm256_loadu_si256(k.add(r * row + h * hd + d).cast::<__m256i>()) };
                let ke = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                let ko = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                for j in 0..G {
                    acc[j][r] = _mm256_fmadd_ps(q[j][0], ke, acc[j][r]);
                    acc[j][r] = _mm256_fmadd_ps(q[j][1], ko, acc[j][r]);
                }
            }
            d += 16;
        }
        for j in 0..G {
            for r in 0..R {
                s[h * sh + j * sr + i + r] = hsum256(acc[j][r]);
            }
        }
    }
}

/// `o += p · V` for `R` consecutive V rows of a run (row `i` at `v`, the next `row`
/// elements on) and every head, `L` output lanes (16 or 32) at a time: the lanes' outputs of
/// the `G` queries stay in registers across the `R` rows, so each is loaded and stored once
/// per `R` rows, and each widened V vector feeds `G` FMAs.
///
/// # Safety
/// AVX2 and FMA; `R` rows of `heads * hd` bf16 readable at `v + r * row`; `hd` a multiple of
/// `L`; `state.len() >= heads * per`; `p[h * sh + j * sr + i + r]` inside `p`.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn pv_rows<const G: usize, const R: usize, const L: usize>(
    p: &[f32],
    sh: usize,
    sr: usize,
    i: usize,
    v: *const u16,
    pf: [*const u16; R],
    row: usize,
    heads: usize,
    hd: usize,
    state: &mut [f32],
    per: usize,
) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let vecs = L / 8; // output vectors per query (even and odd halves of L / 16 blocks)
    for h in 0..heads {
        for f in pf {
            if !f.is_null() {
                for e in (0..hd).step_by(32) {
                    prefetch_l2(f.wrapping_add(h * hd + e));
                }
            }
        }
        let ph = &p[h * sh..(h + 1) * sh];
        let o = state[h * per + G * hd..h * per + 2 * G * hd].as_mut_ptr();
        let mut dc = 0;
        while dc < hd {
            let mut acc = [[_mm256_setzero_ps(); 4]; G];
            for j in 0..G {
                for x in 0..vecs {
                    // SAFETY: j * hd + dc + L <= G * hd, the head's outputs.
                    acc[j][x] = unsafe { _mm256_loadu_ps(o.add(j * hd + dc + 8 * x)) };
                }
            }
            for r in 0..R {
                let mut vv = [_mm256_setzero_ps(); 4];
                for blk in 0..vecs / 2 {
                    // SAFETY: row r's head h slice holds hd bf16 and dc + L <= hd.
                    let raw = unsafe {
                        _mm256_loadu_si256(
                            v.add(r * row + h * hd + dc + 16 * blk).cast::<__m256i>(),
                        )
                    };
                    vv[2 * blk] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                    vv[2 * blk + 1] = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                }
                for j in 0..G {
                    let pj = _mm256_set1_ps(ph[j * sr + i + r]);
                    for x in 0..vecs {
                        acc[j][x] = _mm256_fmadd_ps(pj, vv[x], acc[j][x]);
                    }
                }
            }
            for j in 0..G {
                for x in 0..vecs {
                    // SAFETY: as for the loads.
                    unsafe { _mm256_storeu_ps(o.add(j * hd + dc + 8 * x), acc[j][x]) };
                }
            }
            dc += L;
        }
    }
}
