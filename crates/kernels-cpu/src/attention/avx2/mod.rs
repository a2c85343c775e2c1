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
//!   hardware prefetchers behind and read KV at ~5 GB/s per core instead of ~6.5); groups of
//!   1–4 queries read a range as four or two far-apart streams side by side, left to the
//!   hardware prefetchers, larger groups as one stream with a software prefetch a few rows
//!   ahead spread over the head calls.
//! - The AVX-512 BF16 path's token-major kernel (`decode_partials_heads::<true>`) is this walk
//!   with its scores on `vdpbf16ps`, its streams prefetching their rows 4 rows ahead (`rows`'
//!   module docs and `rows_streams` say why and what it measured).
//!
//! Nothing is allocated: queries, outputs and scores live on the stack or in the caller's
//! scratch. Causal prefill rows ([`prefill_rows`]) run as blocked matrix products in
//! `prefill` (its scratch is per thread), or one decode pass per row for small calls.

use std::arch::x86_64::*;
use std::ops::Range;

use half::bf16;

use super::{PagedKv, PrefillRows};
use crate::math::{EXP_COEFFS, EXP_LN2_HI, EXP_LN2_LO};
use crate::simd::hsum256;

mod head;
mod prefill;
mod rows;

use head::head_over;
use rows::{Scores, rows_over, rows_scores_len};

/// Largest query group handled here.
const MAX_GROUP: usize = 8;

/// Largest head dimension handled here.
const MAX_HD: usize = 256;

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
    super::write_partials::<8>(st, group, hd, partial);
}

/// [`decode_partial`] for every KV head at once (`q` the whole row, `kv_heads * group *
/// head_dim`; `partials` one record set per head, in head order), streaming whole pool rows:
/// each run's rows are read once for all heads, the next run's prefetched meanwhile.
/// `state` is scratch of [`heads_state_len`] floats. `BF16`: the scores on `vdpbf16ps` (the
/// bf16 queries and keys as they are, `rows::scores_rows_bf16`), the AVX-512 BF16 path's
/// token-major kernel; else widened to fp32 (the AVX2 kernel).
///
/// # Safety
/// As [`decode_partial`] for every head; `q.len() == kv_heads * group * head_dim`;
/// `partials.len() == kv_heads * group * (head_dim + 2)`; with `BF16`, the CPU supports
/// AVX-512 F/BW/VL and AVX-512 BF16.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn decode_partials_heads<const BF16: bool>(
    q: &[bf16],
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    tokens: Range<usize>,
    scale: f32,
    partials: &mut [f32],
    state: &mut [f32],
) {
    let scores = if BF16 {
        Scores::Bf16 { q, scale }
    } else {
        Scores::Fp32
    };
    let hd = kv.head_dim;
    let per = group * (2 * hd + 2);
    let qh = group * hd;
    let (state, s) = state.split_at_mut(kv.kv_heads * per);
    for (g, st) in state.chunks_exact_mut(per).enumerate() {
        init_state(&q[g * qh..(g + 1) * qh], group, hd, scale, st);
    }
    // SAFETY: forwarded contract (AVX-512 BF16 present with `BF16`; `q` is the whole row);
    // `state` holds one state per head, `s` the rest.
    unsafe { rows_over(group, kv, block_table, tokens, scores, state, s) };
    let rec = group * (hd + 2);
    for (st, out) in state.chunks_exact(per).zip(partials.chunks_exact_mut(rec)) {
        super::write_partials::<8>(st, group, hd, out);
    }
}

/// Causal prefill rows of one KV head (see `prefill_attention_rows_f32`): row `i` of
/// `rows.queries` (`group` widened queries) attends to tokens `0..=first_pos + i`; `out` gets
/// the normalised outputs. From [`prefill::MIN_QUERIES`] queries on, blocks of queries go
/// through the register-blocked matrix products of [`prefill`]; fewer rows (whose 16-query
/// tiles would be mostly padding) each take one single-head decode pass over their prefix.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `supports(rows.group, rows.kv.head_dim)`; `rows` passed
/// `PrefillRows::check` with `out`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn prefill_rows(rows: &PrefillRows<'_>, out: &mut [f32]) {
    if rows.f32_queries().len() / rows.kv.head_dim >= prefill::MIN_QUERIES {
        // SAFETY: forwarded contract; `supports` made head_dim a multiple of 32.
        unsafe { prefill::prefill_rows(rows, out) }
    } else {
        // SAFETY: forwarded contract.
        unsafe { prefill_rows_per_row(rows, out) }
    }
}

/// [`prefill_rows`] one row at a time: each row is one single-head decode pass over its
/// prefix (the prefix's K/V of one head stays in L2 across the rows).
///
/// # Safety
/// As [`prefill_rows`].
#[target_feature(enable = "avx2,fma")]
unsafe fn prefill_rows_per_row(rows: &PrefillRows<'_>, out: &mut [f32]) {
    let (q, group, kv, first_pos) = (rows.f32_queries(), rows.group, &rows.kv, rows.first_pos);
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
        init_state_with(qr, group, hd, rows.scale, st, |v| *v);
        let tokens = 0..first_pos + i + 1;
        // SAFETY: forwarded contract (tokens 0..=first_pos + i are covered).
        unsafe { head_over(group, kv, rows.block_table, rows.kv_head, tokens, st) };
        super::write_partials::<8>(st, group, hd, recs);
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

/// The online-softmax update of one head's state `st` after a run of `run` scores per query
/// (`s[j * sr ..][..run]`): scores become `exp(s - m_new)`, `l` and `o` are rescaled.
///
/// # Safety
/// AVX2 and FMA; `run <= sr`; `s.len() >= G * sr`; `st` one head's state.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn update<const G: usize>(
    s: &mut [f32],
    sr: usize,
    run: usize,
    hd: usize,
    st: &mut [f32],
) {
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

/// Eight-lane `e^x` matching `crate::math::exp_approx` (clamped to `[-87, 88]`).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp256(x: __m256) -> __m256 {
    // `max`/`min` return their second operand when either is NaN: `x` goes second so a NaN
    // score stays NaN (as `exp_approx`'s clamp keeps it) instead of becoming e^-87.
    let x = _mm256_min_ps(
        _mm256_set1_ps(88.0),
        _mm256_max_ps(_mm256_set1_ps(-87.0), x),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), f);
    let [c6, rest @ ..] = EXP_COEFFS;
    let mut p = _mm256_set1_ps(c6);
    for c in rest {
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

#[cfg(test)]
mod tests {
    use std::arch::x86_64::*;

    use super::exp256;
    use crate::isa::Isa;

    /// The vector `e^x` against `f64::exp` and the scalar `exp_approx`
    /// (`math::check_exp_form`).
    #[test]
    fn exp256_matches_the_scalar_form() {
        if !Isa::Avx2.is_supported() {
            eprintln!("skipped: the CPU lacks Avx2");
            return;
        }
        crate::math::check_exp_form("exp256", 8, |v| {
            // SAFETY: AVX2 and FMA (checked above: the AVX2 path requires both); `v` is eight floats.
            unsafe { _mm256_storeu_ps(v.as_mut_ptr(), exp256(_mm256_loadu_ps(v.as_ptr()))) }
        });
    }
}
