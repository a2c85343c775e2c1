//! AVX-512 BF16 split-KV decode attention for every KV head of a sequence at once, head-major
//! (`DecodeKernel::Avx512Bf16Heads`: what the model runs at decode on the AMX path; AVX-512
//! BF16 hosts without AMX run the token-major `avx2::rows` walk with `vdpbf16ps` scores).
//!
//! Per step a decode token's attention reads each KV row once and does 2 FLOPs per byte; the
//! AVX2 kernel spends several instructions per bf16 element (widen, two FMAs per query, the
//! partial outputs loaded and stored per row), which on two busy cores made attention the
//! phase furthest from its bound. Here:
//! - `q · k` takes the bf16 query and key pairs as they are (`vdpbf16ps`: 32 multiply-adds
//!   per instruction, no widening); the scale multiplies the finished score. The 16-lane dot
//!   products of 16 rows are summed horizontally together (`sum16`), not one row at a time.
//! - `p · v` widens 32 bf16 of V per 512-bit load (shift for the even elements, mask for the
//!   odd ones) and keeps a slice of every query's outputs in registers across a run of up to
//!   32 tokens, so the outputs are loaded and stored once per run, not once per row.
//! - A run is worked head by head (registers stay on one head) while the head slices
//!   [`PREFETCH_AHEAD`] passes ahead (this run's later heads, then the next run's first ones)
//!   are prefetched into L2.
//! - Each score takes two chains of `vdpbf16ps` (even and odd 32-element blocks) summed at the
//!   end, so a row's dot product waits on half as many dependent instructions. At head_dim 128
//!   ([`QB`] blocks) the head's queries are loaded into registers once per 16 rows and the
//!   loop is unrolled, so each row loads only its K slice.
//! - The online-softmax update runs on 16 lanes ([`update16`], the AVX2 kernel's `e^x`
//!   polynomial), and the rescale of the running outputs by `e^(m_old - m_new)` happens as
//!   the `p · v` pass loads them (one pass over the outputs per run, not two). At batch 4 the
//!   AVX2 update took a sixth of the kernel's time with the pool in cache.
//!
//! The running outputs are kept in this module's own order (each 32-element block as its 16
//! even then 16 odd elements) and put back in order when the partials are written.

use std::arch::x86_64::*;
use std::ops::Range;

use half::bf16;

use super::PagedKv;
use super::flash::exp512;
use crate::simd::{as_pbh, prefetch_l2};

/// Largest query group handled here.
const MAX_GROUP: usize = 8;

/// Largest head dimension handled here.
const MAX_HD: usize = 256;

/// Tokens per run (the online-softmax tile; never crosses a page).
const RUN: usize = 32;

/// How many head passes ahead a head's K and V slices are prefetched into L2 (capped at the
/// head count; past the last head of a run, into the next run). In the model's decode
/// attention phase on 4 KiB pages (`attn_bw --shape`, 2 threads), 1–3 heads ahead took 6–7%
/// less CPU time than a whole run ahead (8 heads at Qwen3's shape); 4 took 3–4% less, and two
/// runs ahead was slower still: prefetches issued long before their use hold the fill buffers
/// that the current run's loads wait on.
const PREFETCH_AHEAD: usize = 2;

/// The head dimension, in 32-element blocks, whose queries are held in registers across a
/// run (Qwen3's 128): the score loop is then unrolled and loads only K.
const QB: usize = 4;

/// Whether [`decode_partials_heads`] handles this shape.
pub(super) fn supports(group: usize, head_dim: usize) -> bool {
    (1..=MAX_GROUP).contains(&group) && head_dim.is_multiple_of(32) && head_dim <= MAX_HD
}

/// Floats of scratch [`decode_partials_heads`] needs: per head its outputs, max and sum, and
/// the run's scores.
pub(super) fn heads_state_len(kv_heads: usize, group: usize, head_dim: usize) -> usize {
    kv_heads * state_len(group, head_dim) + kv_heads * group * RUN
}

/// One head's state: `[group, hd]` unused (the layout `update` expects starts with the
/// queries, which this kernel reads as bf16 from the row), `[group, hd]` outputs, `[group]`
/// running max, `[group]` running sum.
fn state_len(group: usize, hd: usize) -> usize {
    group * (2 * hd + 2)
}

/// The partial records (`[m, l, o]` per query, see the module docs of `attention`) of every KV
/// head of the row `q` over `tokens`, head after head in `partials`.
///
/// # Safety
/// The CPU supports AVX-512 F/BW/VL and BF16 (and AVX2, FMA); `supports(group, kv.head_dim)`;
/// `kv` passed its checks; every page of `tokens` is inside `block_table` and the pool;
/// `q.len() == kv.kv_heads * group * head_dim`; `partials.len() == kv.kv_heads * group *
/// (head_dim + 2)`; `state.len() >= heads_state_len(..)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
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
    let per = state_len(group, hd);
    let (states, scores) = state.split_at_mut(kv.kv_heads * per);
    for st in states.chunks_exact_mut(per) {
        let (_, rest) = st.split_at_mut(group * hd);
        let (o, ml) = rest.split_at_mut(group * hd);
        o.fill(0.0);
        ml[..group].fill(f32::NEG_INFINITY);
        ml[group..].fill(0.0);
    }
    macro_rules! go {
        ($($g:literal => $wide:literal);*) => {
            match group {
                $($g => {
                    // Output vectors per query held in registers per pass: `G * NV <= 16`.
                    if hd == 32 * QB {
                        // SAFETY: forwarded contract; `hd` = 32 * QB is a multiple of 16 * NV
                        // (every `$wide` is at most 8).
                        unsafe { heads_g::<$g, $wide, QB>(q, kv, block_table, tokens, scale, states, scores) }
                    } else if hd.is_multiple_of(16 * $wide) {
                        // SAFETY: forwarded contract; `hd` is a multiple of 16 * NV.
                        unsafe { heads_g::<$g, $wide, 0>(q, kv, block_table, tokens, scale, states, scores) }
                    } else {
                        // SAFETY: as above (`hd` is a multiple of 32).
                        unsafe { heads_g::<$g, 2, 0>(q, kv, block_table, tokens, scale, states, scores) }
                    }
                })*
                _ => unreachable!("group {group} not supported"),
            }
        };
    }
    go!(1 => 8; 2 => 8; 3 => 4; 4 => 4; 5 => 2; 6 => 2; 7 => 2; 8 => 2);
    let rec = group * (hd + 2);
    for (st, out) in states.chunks_exact(per).zip(partials.chunks_exact_mut(rec)) {
        super::write_partials::<16>(st, group, hd, out);
    }
}

/// Lane `i` of the result is the sum of the 16 lanes of `v[i]`: pairs of vectors are folded
/// into each other (32-bit, then 64-bit unpacks within 128-bit lanes, then two 128-bit
/// shuffles across them), 45 instructions for 16 sums where one horizontal sum takes 8.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn sum16(v: &[__m512; 16]) -> __m512 {
    // Rows 2i, 2i + 1 interleaved: lane block l holds [a0+a2, b0+b2, a1+a3, b1+b3] of it.
    let p: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
    });
    // Rows 4i .. 4i + 4 in order within each 128-bit block (that block's partial sums).
    let q: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (_mm512_castps_pd(p[2 * i]), _mm512_castps_pd(p[2 * i + 1]));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        )
    });
    // Rows 8i .. 8i + 8: blocks [rows 0-3 (blocks 0+1), rows 0-3 (2+3), rows 4-7 (0+1), (2+3)].
    let w: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (q[2 * i], q[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    });
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(w[0], w[1]),
        _mm512_shuffle_f32x4::<0xDD>(w[0], w[1]),
    )
}

/// Every head over `tokens`, a run of at most [`RUN`] tokens (inside one page) at a time.
///
/// # Safety
/// As [`decode_partials_heads`]; `G == group`, `hd` a multiple of `16 * NV`, and `hd == 32 *
/// NB` unless `NB == 0` (then `hd` is read at run time); `states` one state per head, `scores`
/// at least `heads * G * RUN` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
unsafe fn heads_g<const G: usize, const NV: usize, const NB: usize>(
    q: &[bf16],
    kv: &PagedKv<'_>,
    block_table: &[u32],
    tokens: Range<usize>,
    scale: f32,
    states: &mut [f32],
    scores: &mut [f32],
) {
    let hd = kv.head_dim;
    let heads = kv.kv_heads;
    let row = kv.row();
    let per = state_len(G, hd);
    let sh = G * RUN;
    let page = kv.page_size;
    let slot_of = |t: usize| block_table[t / page] as usize * page + t % page;
    let kp = kv.k.as_ptr().cast::<u16>();
    let vp = kv.v.as_ptr().cast::<u16>();
    let qp = q.as_ptr().cast::<u16>();
    let run_len = |t: usize| RUN.min(page - t % page).min(tokens.end - t);
    // Head slices are prefetched `ahead` head passes before they are worked on.
    let ahead = PREFETCH_AHEAD.min(heads);
    // The first run's first `ahead` heads, which no earlier pass prefetches.
    if tokens.start < tokens.end {
        let (base, n) = (slot_of(tokens.start) * row, run_len(tokens.start));
        let w = ahead * hd;
        for r in 0..n {
            for e in (0..w).step_by(32) {
                prefetch_l2(kp.wrapping_add(base + r * row + e));
                prefetch_l2(vp.wrapping_add(base + r * row + e));
            }
        }
    }
    let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let mut t = tokens.start;
    while t < tokens.end {
        let run = run_len(t);
        let base = slot_of(t) * row;
        let next = t + run;
        // The next run's first row and length, or none.
        let (nbase, nrun) = if next < tokens.end {
            (slot_of(next) * row, run_len(next))
        } else {
            (0, 0)
        };
        // What the pass over head `h` prefetches: the slices of head `h + ahead`, in this run
        // or (past the last head) the next one, as (first row, rows, head).
        let target = |h: usize| {
            if h + ahead < heads {
                (base, run, h + ahead)
            } else {
                (nbase, nrun, h + ahead - heads)
            }
        };
        for h in 0..heads {
            let s = &mut scores[h * sh..(h + 1) * sh];
            // Scores: the group's bf16 queries against each row's head slice, 16 rows at a
            // time so their 16 horizontal sums per query take one transposing reduction.
            let mut r0 = 0;
            while r0 < run {
                let rows = (run - r0).min(16);
                let prefetch = |rr: usize| {
                    let (pbase, prows, ph) = target(h);
                    if r0 + rr < prows {
                        for e in (0..hd).step_by(32) {
                            prefetch_l2(kp.wrapping_add(pbase + (r0 + rr) * row + ph * hd + e));
                        }
                    }
                };
                // SAFETY: the head's queries are `G * hd` bf16 of the row of `heads * G * hd`;
                // rows `r0..r0 + rows` of this run are pool rows (caller's contract) whose
                // head slices hold `hd` bf16 (`hd == 32 * NB` unless NB == 0); scores
                // `j * RUN + r0 + rr` lie inside the head's `G * RUN` (r0 + rows <= run <= RUN).
                unsafe {
                    scores16::<G, NB>(
                        qp.add(h * G * hd),
                        kp.wrapping_add(base + r0 * row + h * hd),
                        row,
                        rows,
                        hd,
                        scale,
                        s.as_mut_ptr().add(r0),
                        RUN,
                        prefetch,
                    )
                };
                r0 += rows;
            }
            // Rows of a longer next run than this one (this run ended at a page's end).
            let (pbase, prows, ph) = target(h);
            for r in run..prows {
                for e in (0..hd).step_by(32) {
                    prefetch_l2(kp.wrapping_add(pbase + r * row + ph * hd + e));
                    prefetch_l2(vp.wrapping_add(pbase + r * row + ph * hd + e));
                }
            }
            let st = &mut states[h * per..(h + 1) * per];
            let corr = update16::<G>(s, run, hd, st);
            let corr: [__m512; G] = std::array::from_fn(|j| _mm512_set1_ps(corr[j]));
            // o = o * corr + p · V, NV output vectors per query in registers across the run.
            let o = st[G * hd..2 * G * hd].as_mut_ptr();
            let mut dc = 0;
            while dc < hd {
                let mut acc = [[_mm512_setzero_ps(); NV]; G];
                for (j, aj) in acc.iter_mut().enumerate() {
                    for (x, a) in aj.iter_mut().enumerate() {
                        // SAFETY: j * hd + dc + 16 * NV <= G * hd, this head's outputs.
                        let v = unsafe { _mm512_loadu_ps(o.add(j * hd + dc + 16 * x)) };
                        *a = _mm512_mul_ps(v, corr[j]);
                    }
                }
                for r in 0..run {
                    let (pbase, prows, ph) = target(h);
                    if r < prows && dc == 0 {
                        for e in (0..hd).step_by(32) {
                            prefetch_l2(vp.wrapping_add(pbase + r * row + ph * hd + e));
                        }
                    }
                    let v = vp.wrapping_add(base + r * row + h * hd + dc);
                    let mut vv = [_mm512_setzero_ps(); NV];
                    for b in 0..NV / 2 {
                        // SAFETY: this row's head slice holds hd bf16 and dc + 16 * NV <= hd.
                        let raw = unsafe { _mm512_loadu_si512(v.add(32 * b).cast()) };
                        vv[2 * b] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw));
                        vv[2 * b + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, mask));
                    }
                    for (j, aj) in acc.iter_mut().enumerate() {
                        let p = _mm512_set1_ps(s[j * RUN + r]);
                        for (a, &w) in aj.iter_mut().zip(&vv) {
                            *a = _mm512_fmadd_ps(p, w, *a);
                        }
                    }
                }
                for (j, aj) in acc.iter().enumerate() {
                    for (x, a) in aj.iter().enumerate() {
                        // SAFETY: as for the loads.
                        unsafe { _mm512_storeu_ps(o.add(j * hd + dc + 16 * x), *a) };
                    }
                }
                dc += 16 * NV;
            }
        }
        t = next;
    }
}

/// Scores of `rows <= 16` pool rows against one head's `G` bf16 queries (`qh`, `G * hd`),
/// times `scale`: score `r` of query `j` goes to `s[j * stride + r]`. Row `r`'s head slice is
/// at `k + r * row`; `pf(r)` runs before it is read (the caller's prefetches). Each score
/// takes two chains of `vdpbf16ps` (even and odd 32-element blocks), and the 16 rows' sums
/// per query are reduced together ([`sum16`]). With `NB > 0` (`hd == 32 * NB`) the queries
/// are loaded once for the 16 rows and the loop is unrolled.
///
/// # Safety
/// AVX-512 F/BW/VL and BF16; `qh` holds `G * hd` bf16; each of the `rows` slices holds `hd`
/// bf16, `hd` a multiple of 32 and `hd == 32 * NB` unless `NB == 0`; `s.add(j * stride + r)`
/// is writable for `j < G`, `r < rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores16<const G: usize, const NB: usize>(
    qh: *const u16,
    k: *const u16,
    row: usize,
    rows: usize,
    hd: usize,
    scale: f32,
    s: *mut f32,
    stride: usize,
    mut pf: impl FnMut(usize),
) {
    debug_assert!(rows <= 16 && hd.is_multiple_of(32) && (NB == 0 || hd == 32 * NB));
    let qreg: [[__m512i; NB]; G] = std::array::from_fn(|j| {
        std::array::from_fn(|b| {
            // SAFETY: NB > 0 only when hd == 32 * NB: block b of query j is inside `qh`.
            unsafe { _mm512_loadu_si512(qh.add(j * hd + 32 * b).cast()) }
        })
    });
    // Each query's 16 rows of 16-lane partial sums (rows past `rows`: zeros), every element
    // written once below: zero-initialising the `16 * G` vectors first (a `memset` call per
    // call) took ~12% of the kernel's time at a group of 5.
    let mut part = std::mem::MaybeUninit::<[[__m512; 16]; G]>::uninit();
    let first = part.as_mut_ptr().cast::<__m512>();
    let slot = |j: usize, rr: usize| first.wrapping_add(j * 16 + rr);
    for rr in 0..rows {
        pf(rr);
        let k = k.wrapping_add(rr * row);
        // Two chains per query: blocks d and d + 32 go to `acc` and `odd`.
        let mut acc = [_mm512_setzero_ps(); G];
        let mut odd = [_mm512_setzero_ps(); G];
        for b in 0..NB {
            // SAFETY: hd == 32 * NB: block b of this row's head slice is inside it.
            let kb = unsafe { _mm512_loadu_si512(k.add(32 * b).cast()) };
            let chains = if b % 2 == 0 { &mut acc } else { &mut odd };
            for (a, qj) in chains.iter_mut().zip(&qreg) {
                *a = _mm512_dpbf16_ps(*a, as_pbh(qj[b]), as_pbh(kb));
            }
        }
        let mut d = if NB > 0 { hd } else { 0 };
        while d < hd {
            // SAFETY: the row's head slice and each query hold `hd` bf16; d + 32 <= hd, and
            // d + 64 <= hd for the second block.
            unsafe {
                let k0 = _mm512_loadu_si512(k.add(d).cast());
                let two = d + 64 <= hd;
                let k1 = if two {
                    _mm512_loadu_si512(k.add(d + 32).cast())
                } else {
                    _mm512_setzero_si512()
                };
                for j in 0..G {
                    let qj = qh.add(j * hd + d);
                    let q0 = _mm512_loadu_si512(qj.cast());
                    acc[j] = _mm512_dpbf16_ps(acc[j], as_pbh(q0), as_pbh(k0));
                    if two {
                        let q1 = _mm512_loadu_si512(qj.add(32).cast());
                        odd[j] = _mm512_dpbf16_ps(odd[j], as_pbh(q1), as_pbh(k1));
                    }
                }
            }
            d += 64;
        }
        for j in 0..G {
            // SAFETY: j < G and rr < 16: inside `part`.
            unsafe { slot(j, rr).write(_mm512_add_ps(acc[j], odd[j])) };
        }
    }
    for rr in rows..16 {
        for j in 0..G {
            // SAFETY: as above.
            unsafe { slot(j, rr).write(_mm512_setzero_ps()) };
        }
    }
    // SAFETY: every element was written, rows `0..rows` in the loop and the rest as zeros.
    let part = unsafe { part.assume_init() };
    let keep: __mmask16 = if rows == 16 { 0xFFFF } else { (1 << rows) - 1 };
    let scale_v = _mm512_set1_ps(scale);
    for (j, pj) in part.iter().enumerate() {
        let sums = _mm512_mul_ps(sum16(pj), scale_v);
        // SAFETY: lanes `0..rows` are scores `0..rows` of query `j` (caller's contract);
        // masked-off lanes are not written.
        unsafe { _mm512_mask_storeu_ps(s.add(j * stride), keep, sums) };
    }
}

/// The online-softmax update of one head's state `st` (`[G, hd]` unused, `[G, hd]` outputs,
/// `[G]` max, `[G]` sum) after a run of `run <= RUN` scores per query (`s[j * RUN..][..run]`):
/// the scores become `exp(s - m_new)`, `m` and `l` are updated, and the factor
/// `e^(m_old - m_new)` the outputs must be scaled by is returned per query (0 for the first
/// run; the caller applies it). NaN scores make the sum NaN, as on the other paths.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn update16<const G: usize>(s: &mut [f32], run: usize, hd: usize, st: &mut [f32]) -> [f32; G] {
    const { assert!(RUN == 32, "two 16-lane vectors per run") };
    assert!(run <= RUN && s.len() >= G * RUN && st.len() >= G * (2 * hd + 2));
    let ml = &mut st[2 * G * hd..2 * G * hd + 2 * G];
    let (m, l) = ml.split_at_mut(G);
    let lo: __mmask16 = if run >= 16 {
        0xFFFF
    } else {
        (1u32 << run) as u16 - 1
    };
    let hi: __mmask16 = if run >= 32 {
        0xFFFF
    } else if run > 16 {
        (1u32 << (run - 16)) as u16 - 1
    } else {
        0
    };
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut corr = [0.0f32; G];
    for j in 0..G {
        let p = s[j * RUN..(j + 1) * RUN].as_mut_ptr();
        // SAFETY: `p` has RUN = 32 floats (asserted above); masked lanes are not touched.
        let (a, b) = unsafe {
            (
                _mm512_mask_loadu_ps(ninf, lo, p),
                _mm512_mask_loadu_ps(ninf, hi, p.add(16)),
            )
        };
        // The max over the run ignores NaN scores (as `f32::max` does in the other paths'
        // folds): NaN lanes count as -inf here, and still make the sum NaN below.
        let a_ord = _mm512_mask_mov_ps(ninf, _mm512_cmp_ps_mask::<_CMP_ORD_Q>(a, a), a);
        let b_ord = _mm512_mask_mov_ps(ninf, _mm512_cmp_ps_mask::<_CMP_ORD_Q>(b, b), b);
        let m_new = m[j].max(_mm512_reduce_max_ps(_mm512_max_ps(a_ord, b_ord)));
        let mv = _mm512_set1_ps(m_new);
        let ea = _mm512_maskz_mov_ps(lo, exp512(_mm512_sub_ps(a, mv)));
        let eb = _mm512_maskz_mov_ps(hi, exp512(_mm512_sub_ps(b, mv)));
        // SAFETY: as for the loads.
        unsafe {
            _mm512_mask_storeu_ps(p, lo, ea);
            _mm512_mask_storeu_ps(p.add(16), hi, eb);
        }
        let sum = _mm512_reduce_add_ps(_mm512_add_ps(ea, eb));
        corr[j] = if m[j] == f32::NEG_INFINITY {
            0.0
        } else {
            (m[j] - m_new).exp()
        };
        l[j] = l[j] * corr[j] + sum;
        m[j] = m_new;
    }
    corr
}
