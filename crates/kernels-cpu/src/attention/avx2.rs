//! AVX2+FMA split-KV decode attention: one KV head's group of `G` queries against a range of
//! tokens, one page run (at most 128 tokens) at a time with online softmax.
//!
//! - bf16 K and V are widened by the even/odd split of `crate::gemm` (one 256-bit load of 16
//!   values, a shift for the even lanes, a mask for the odd ones); the queries and the
//!   running outputs are kept in the matching permuted order (each 16-block as
//!   `[x0, x2, .., x14, x1, x3, .., x15]`) and put back in order when the partial is written.
//! - Scores are register-blocked over `TB` tokens × `G` queries, so the dot products overlap
//!   instead of forming one latency chain per token.
//! - `p · V` keeps a slice of the outputs in registers across the whole run.
//! - Max, `exp` and sums of the online softmax run eight lanes at a time.
//! - The next run's K and V rows are prefetched while the current one is computed.
//!
//! Nothing is allocated: queries, outputs and scores live on the stack.

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
/// Tokens per run when every head is processed: the current run's rows and the prefetched
/// next run's (K and V, `2 * RUN_ALL_HEADS * row` bf16 each) must fit in L2 together.
const RUN_ALL_HEADS: usize = 32;
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
    unsafe { heads_over(group, kv, block_table, kv_head..kv_head + 1, tokens, st) };
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
    for (g, st) in state.chunks_exact_mut(per).enumerate() {
        init_state(&q[g * qh..(g + 1) * qh], group, hd, scale, st);
    }
    // SAFETY: forwarded contract; `state` holds one state per head.
    unsafe { heads_over(group, kv, block_table, 0..kv.kv_heads, tokens, state) };
    let rec = group * (hd + 2);
    for (st, out) in state.chunks_exact(per).zip(partials.chunks_exact_mut(rec)) {
        write_partials(st, group, hd, out);
    }
}

/// Floats of scratch [`decode_partials_heads`] needs.
pub(super) fn heads_state_len(kv_heads: usize, group: usize, head_dim: usize) -> usize {
    kv_heads * group * (2 * head_dim + 2)
}

/// One head's state, `group * (2 * hd + 2)` floats: queries (permuted, pre-scaled)
/// `[group, hd]`, outputs (permuted) `[group, hd]`, running max `[group]`, running sum
/// `[group]`.
fn init_state(q: &[bf16], group: usize, hd: usize, scale: f32, st: &mut [f32]) {
    let (qs, rest) = st.split_at_mut(group * hd);
    for (dst, src) in qs.chunks_exact_mut(16).zip(q.chunks_exact(16)) {
        for i in 0..8 {
            dst[i] = src[2 * i].to_f32() * scale;
            dst[8 + i] = src[2 * i + 1].to_f32() * scale;
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

/// Runs heads `heads` (states back to back in `state`) over `tokens`, run by run.
///
/// # Safety
/// As [`decode_partial`] for every head of `heads`.
#[target_feature(enable = "avx2,fma")]
unsafe fn heads_over(
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    heads: Range<usize>,
    tokens: Range<usize>,
    state: &mut [f32],
) {
    macro_rules! go {
        ($($g:literal => $tb:literal),*) => {
            match group {
                // SAFETY: forwarded contract; the group matches the instantiation.
                $($g => unsafe { heads_g::<$g, $tb>(kv, block_table, heads, tokens, state) },)*
                _ => unreachable!("group {group} not supported"),
            }
        };
    }
    go!(1 => 8, 2 => 4, 3 => 4, 4 => 3, 5 => 2, 6 => 2, 7 => 1, 8 => 1);
}

#[target_feature(enable = "avx2,fma")]
unsafe fn heads_g<const G: usize, const TB: usize>(
    kv: &PagedKv<'_>,
    block_table: &[u32],
    heads: Range<usize>,
    tokens: Range<usize>,
    state: &mut [f32],
) {
    let hd = kv.head_dim;
    let row = kv.row();
    let all = heads.len() == kv.kv_heads;
    let run_max = if all { RUN_ALL_HEADS } else { RUN };
    let per = G * (2 * hd + 2);
    let mut s = [[0.0f32; RUN]; G];
    let kp = kv.k.as_ptr().cast::<u16>();
    let vp = kv.v.as_ptr().cast::<u16>();
    let page = kv.page_size;
    let slot_of = |t: usize| block_table[t / page] as usize * page + t % page;
    // The first run's whole rows up front (later runs are prefetched one run ahead), so no
    // run is fetched by demand misses one head slice at a time.
    if all && tokens.start < tokens.end {
        let run = run_max
            .min(page - tokens.start % page)
            .min(tokens.end - tokens.start);
        let base = slot_of(tokens.start) * row;
        for e in (0..run * row).step_by(32) {
            prefetch_l2(kp.wrapping_add(base + e));
            prefetch_l2(vp.wrapping_add(base + e));
        }
    }
    let mut t = tokens.start;
    while t < tokens.end {
        let run = run_max.min(page - t % page).min(tokens.end - t);
        let slot0 = slot_of(t);
        // The next run, prefetched while this one computes: with every head, its whole rows
        // (contiguous), a share before each head so the misses overlap the arithmetic; with
        // one head, that head's slices (one pool row apart).
        let next = t + run;
        let (nrun, nbase) = if next < tokens.end {
            let nrun = run_max.min(page - next % page).min(tokens.end - next);
            (nrun, slot_of(next) * row)
        } else {
            (0, 0)
        };
        if !all {
            let nbase = nbase + heads.start * hd;
            for i in 0..nrun {
                for e in (0..hd).step_by(32) {
                    prefetch_l2(kp.wrapping_add(nbase + i * row + e));
                    prefetch_l2(vp.wrapping_add(nbase + i * row + e));
                }
            }
        }
        let share = (nrun * row).div_ceil(heads.len() * 32) * 32;
        for (h, st) in heads.clone().zip(state.chunks_exact_mut(per)) {
            // This head's share of the next run, spread over its score blocks so the misses
            // trickle out alongside the arithmetic instead of in one burst.
            let (mut pf_at, pf_end) = if all {
                let from = (h - heads.start) * share;
                (from.min(nrun * row), (from + share).min(nrun * row))
            } else {
                (0, 0)
            };
            let pf_step = (pf_end - pf_at)
                .div_ceil(run.div_ceil(TB).max(1))
                .next_multiple_of(32);
            let prefetch_some = |at: &mut usize| {
                let stop = (*at + pf_step).min(pf_end);
                for e in (*at..stop).step_by(32) {
                    prefetch_l2(kp.wrapping_add(nbase + e));
                    prefetch_l2(vp.wrapping_add(nbase + e));
                }
                *at = stop;
            };
            let base = slot0 * row + h * hd;
            let (qf, rest) = st.split_at_mut(G * hd);
            let (o, ml) = rest.split_at_mut(G * hd);
            let (m, l) = ml.split_at_mut(G);
            // Scores s[j][i] = q_j . k_i (scaled).
            let mut i = 0;
            while i + TB <= run {
                prefetch_some(&mut pf_at);
                // SAFETY: rows i..i+TB of this run are inside the pool (caller's contract).
                unsafe { scores::<G, TB>(qf, kp.add(base + i * row), row, hd, &mut s, i) };
                i += TB;
            }
            while i < run {
                // SAFETY: as above, for one row.
                unsafe { scores::<G, 1>(qf, kp.add(base + i * row), row, hd, &mut s, i) };
                i += 1;
            }
            while pf_at < pf_end {
                prefetch_some(&mut pf_at);
            }
            // Online softmax update: p = exp(s - m_new) in place, l and o rescaled.
            for j in 0..G {
                // SAFETY: run <= RUN.
                let (m_new, sum) = unsafe { softmax_run(&mut s[j], run, m[j]) };
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
            // o_j += sum_i p_ji v_i.
            let mut j0 = 0;
            while j0 < G {
                let n = PV_QUERIES.min(G - j0);
                // SAFETY: run rows of hd bf16 at vp + base + i * row are inside the pool;
                // queries j0..j0+n < G.
                unsafe {
                    match n {
                        1 => pv::<G, 1, 2>(&s, vp.add(base), row, run, hd, o, j0),
                        2 => pv::<G, 2, 2>(&s, vp.add(base), row, run, hd, o, j0),
                        3 => pv::<G, 3, 1>(&s, vp.add(base), row, run, hd, o, j0),
                        _ => pv::<G, 4, 1>(&s, vp.add(base), row, run, hd, o, j0),
                    }
                }
                j0 += n;
            }
        }
        t += run;
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
/// AVX2 and FMA available; `run <= RUN`.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_run(s: &mut [f32; RUN], run: usize, m: f32) -> (f32, f32) {
    let full = run / 8 * 8;
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 <= full <= RUN.
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
        // SAFETY: i + 8 <= full <= RUN.
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
/// queries `qf` (`[G, hd]`).
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
    s: &mut [[f32; RUN]; G],
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
            s[j][i + r] = hsum256(acc[j][r]);
        }
    }
}

/// `o[j] += sum_i p[j][i] * v_i` (`o` is `[G, hd]`, permuted) for queries `j0..j0+GJ`, over
/// `run` rows (V at `v`, `row` apart), `16·VB` output lanes at a time held in registers.
///
/// # Safety
/// AVX2 and FMA; `run` rows of `hd` bf16 readable at `v + i * row`; `hd` a multiple of
/// `16·VB`; `o.len() >= G * hd`; `j0 + GJ <= G`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // register blocks by query
unsafe fn pv<const G: usize, const GJ: usize, const VB: usize>(
    p: &[[f32; RUN]; G],
    v: *const u16,
    row: usize,
    run: usize,
    hd: usize,
    o: &mut [f32],
    j0: usize,
) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    // Rows in blocks whose V slices stay in L1 across the output-lane passes.
    let mut i0 = 0;
    while i0 < run {
        let i1 = (i0 + PV_ROWS).min(run);
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
                    let pj = _mm256_set1_ps(p[j0 + j][i]);
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
