//! AVX-512 BF16 split-KV decode attention for every KV head of a sequence at once, with both
//! products on `vdpbf16ps` (`DecodeKernel::Avx512Bf16Pairs`).
//!
//! The other vector kernels take `q · k` on `vdpbf16ps` but widen V to fp32 for `p · V`: two
//! FMAs on eight or sixteen lanes per 16 elements and query, plus the widening, which at
//! Qwen3-14B's group of 5 made the token-major kernel compute-bound at ~11 GB/s of KV per
//! core (173 cycles per token and KV head on Zen 4, `attn_bw --shape 4x1024 --group 5
//! --layers 1 --threads 1`). Here `p · V` runs on token *pairs*: rows `t` and `t + 1` of V
//! are interleaved 16 bits at a time (`vpunpcklwd`/`vpunpckhwd`: each 32-bit lane holds
//! `(v[t][d], v[t + 1][d])`), the probabilities `(p[t], p[t + 1])` are rounded to bf16 and
//! broadcast as one 32-bit pair, and one `vdpbf16ps` adds `p[t]·v[t][d] + p[t+1]·v[t+1][d]`
//! to 16 outputs. Per token and query that is half the instructions of the scores, and no
//! widening.
//!
//! Numerics: the probabilities `exp(s - m)` (in `(0, 1]`) become bf16 operands of the
//! `p · V` product, as the specification's "matmuls take bf16 operands, accumulate in fp32"
//! reads, and close to how `transformers` computes it (it rounds the *normalised* softmax to
//! the activations' bf16 before the product with V; here the unnormalised `exp(s - m)` is
//! rounded and the division stays fp32). The running sum `l` adds the *rounded* probabilities
//! (a `vdpbf16ps` against ones), so `o / l` stays a convex combination of the V rows: the
//! rounding moves each weight by at most 2⁻⁸ of itself (subnormal ones are flushed to zero)
//! and never the outputs' scale.
//!
//! The walk: runs of at most [`RUN`] tokens inside one page. Per run, the scores are taken
//! 16 rows at a time, head by head (`avx512::scores16`, one transposing reduction for 16
//! rows), while the run's V rows are prefetched into L2; the online softmax turns each
//! query's scores into bf16 probability pairs; then `p · V`, head by head, keeps a slice of
//! every query's outputs in registers across the run while the next run's K rows are
//! prefetched. A run's rows are one contiguous stretch of its page, and each phase
//! prefetches the other pool's stretch in address order ([`Ahead`]), a few lines per step:
//! from memory (Qwen3-14B's group of 5, `attn_bw --shape 16x3500 --group 5`, 2 threads) that
//! took 0.71–1.02× the time of prefetching each row's head slice as the row's K slice was
//! read, and prefetching the next run's K during the scores and its V during `p · V` took
//! 0.96–1.13×; runs of 32 tokens measured level with 64 and runs of 128 took 1.09× (against
//! the plain read in the same runs) (`docs/benchmarks.md`, session 53).
//!
//! Where it runs: from a group of 5 on the AVX-512 BF16 path (`attention::path`). With the
//! KV cache in L2 it took 0.42× the token-major `vdpbf16ps` kernel's time at a group of 5 and
//! 0.5–0.57× at 2 (0.52–0.62× at 5 from L3); from memory, at Qwen3-0.6B's group of 2, the
//! token-major kernel's four far-apart row streams read faster than these runs (its
//! 16 × 1024 phase took 0.78–0.83× this kernel's time), while at Qwen3-14B's group of 5 this
//! kernel took 0.88–0.94× the token-major kernel's time and a whole 16 × 3500 decode step
//! 0.971× (paired steps).
//!
//! The running outputs are kept in this module's own order (per 32-element block: the 16
//! outputs of `vpunpcklwd`'s lanes, then the 16 of `vpunpckhwd`'s) and put back in order when
//! the partials are written ([`write_partials`]).

use std::arch::x86_64::*;
use std::ops::Range;

use half::bf16;

use super::PagedKv;
use super::avx512::scores16;
use super::flash::exp512;
use crate::simd::{as_pbh, prefetch_l2};

/// Tokens per run (the online-softmax tile; never crosses a page). Even, a multiple of 32
/// (the probabilities are converted 32 at a time).
const RUN: usize = 64;
const _: () = assert!(
    RUN.is_multiple_of(32),
    "the probabilities are converted 32 at a time"
);

/// bf16 1.0 in both halves of a 32-bit lane: `vdpbf16ps` against it sums a pair.
const ONES: i32 = 0x3F80_3F80;

/// Whether [`decode_partials_heads`] handles this shape: the head-major kernel's shapes,
/// whose score blocks (`avx512::scores16`) it takes.
pub(super) fn supports(group: usize, head_dim: usize) -> bool {
    super::avx512::supports(group, head_dim)
}

/// One head's state: `[group, hd]` outputs (this module's order), `[group]` running max,
/// `[group]` running sum.
fn state_len(group: usize, hd: usize) -> usize {
    group * (hd + 2)
}

/// Floats of scratch [`decode_partials_heads`] needs: every head's state, the run's fp32
/// scores and (in half as many floats) its bf16 probabilities.
pub(super) fn heads_state_len(kv_heads: usize, group: usize, head_dim: usize) -> usize {
    kv_heads * (state_len(group, head_dim) + group * RUN + group * RUN / 2)
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
    let heads = kv.kv_heads;
    let per = state_len(group, hd);
    let (states, rest) = state.split_at_mut(heads * per);
    let (scores, probs) = rest.split_at_mut(heads * group * RUN);
    let probs = &mut probs[..heads * group * RUN / 2];
    for st in states.chunks_exact_mut(per) {
        let (o, ml) = st.split_at_mut(group * hd);
        o.fill(0.0);
        ml[..group].fill(f32::NEG_INFINITY);
        ml[group..].fill(0.0);
    }
    let walk = Walk {
        q: q.as_ptr().cast::<u16>(),
        kp: kv.k.as_ptr().cast::<u16>(),
        vp: kv.v.as_ptr().cast::<u16>(),
        row: kv.row(),
        page: kv.page_size,
        block_table,
        heads,
        hd,
        scale,
    };
    // `probs` holds `heads * group * RUN` bf16 in its floats' bytes.
    let pb = probs.as_mut_ptr().cast::<u16>();
    macro_rules! go {
        ($($g:literal => $nv:literal);*) => {
            match group {
                $($g => {
                    if hd == 128 {
                        // SAFETY: forwarded contract; `states`, `scores` and `pb` have the
                        // lengths `pairs_g` needs for this group; `NV` (1, 2 or 4) divides
                        // `hd / 32 = 4` and `NB` is 4 with `hd == 128`.
                        unsafe { pairs_g::<$g, 4, $nv>(&walk, tokens, states, scores, pb) }
                    } else if hd.is_multiple_of(32 * $nv) {
                        // SAFETY: as above, `NB` 0.
                        unsafe { pairs_g::<$g, 0, $nv>(&walk, tokens, states, scores, pb) }
                    } else {
                        // SAFETY: as above, `NV` 1 (hd is a multiple of 32).
                        unsafe { pairs_g::<$g, 0, 1>(&walk, tokens, states, scores, pb) }
                    }
                })*
                _ => unreachable!("group {group} not supported"),
            }
        };
    }
    // 32-element V blocks per `p · V` pass: `2 * G * NV` accumulators and `G` probability
    // pairs stay within the 32 registers.
    go!(1 => 4; 2 => 4; 3 => 4; 4 => 2; 5 => 2; 6 => 1; 7 => 1; 8 => 1);
    let rec = group * (hd + 2);
    for (st, out) in states.chunks_exact(per).zip(partials.chunks_exact_mut(rec)) {
        write_partials(st, group, hd, out);
    }
}

/// What a call walks: the row's queries, the two pools, the block table and the shape.
struct Walk<'a> {
    q: *const u16,
    kp: *const u16,
    vp: *const u16,
    /// Elements per pool row (every head's slice).
    row: usize,
    page: usize,
    block_table: &'a [u32],
    heads: usize,
    hd: usize,
    scale: f32,
}

impl Walk<'_> {
    /// Token `t`'s pool row, in elements from the pool's start.
    fn at(&self, t: usize) -> usize {
        (self.block_table[t / self.page] as usize * self.page + t % self.page) * self.row
    }
}

/// Every head over `tokens`, a run of at most [`RUN`] tokens (inside one page) at a time.
///
/// # Safety
/// As [`decode_partials_heads`]; `G == group`; `hd` a multiple of `32 * NV`, and `hd == 32 *
/// NB` unless `NB == 0`; `states` one state per head ([`state_len`]), `scores` `heads * G *
/// RUN` floats, `pb` `heads * G * RUN` writable bf16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
unsafe fn pairs_g<const G: usize, const NB: usize, const NV: usize>(
    w: &Walk<'_>,
    tokens: Range<usize>,
    states: &mut [f32],
    scores: &mut [f32],
    pb: *mut u16,
) {
    let (heads, hd, row) = (w.heads, w.hd, w.row);
    let per = state_len(G, hd);
    let sh = G * RUN;
    let run_len = |t: usize| RUN.min(w.page - t % w.page).min(tokens.end - t);
    // A run's rows are one contiguous stretch of its page: `run * row` elements from `at(t)`.
    let stretch = |p: *const u16, t: usize, steps: usize| {
        if t < tokens.end {
            Ahead::new(p, w.at(t), run_len(t) * row, steps)
        } else {
            Ahead::new(p, 0, 0, steps)
        }
    };
    if tokens.start < tokens.end {
        // The first run's K, which no earlier pass prefetches.
        stretch(w.kp, tokens.start, 1).finish();
    }
    let zero = _mm512_setzero_si512();
    let mut t = tokens.start;
    while t < tokens.end {
        let run = run_len(t);
        let base = w.at(t);
        let next = t + run;
        // Scores, 16 rows at a time, head by head, while the run's V rows (used by `p · V`
        // after the scores) are prefetched in address order, a few lines per row and head.
        let mut sa = stretch(w.vp, t, run * heads);
        let mut r0 = 0;
        while r0 < run {
            let rows = (run - r0).min(16);
            for h in 0..heads {
                let prefetch = |_| sa.step();
                // SAFETY: the head's queries are `G * hd` bf16 of the row (`heads * G * hd`);
                // rows `r0..r0 + rows` of the run are pool rows (caller's contract) whose head
                // slices hold `hd` bf16 (`hd == 32 * NB` unless NB == 0); score `j * RUN + r0
                // + rr` lies inside the head's `G * RUN` (r0 + rows <= run <= RUN).
                unsafe {
                    scores16::<G, NB>(
                        w.q.add(h * G * hd),
                        w.kp.wrapping_add(base + r0 * row + h * hd),
                        row,
                        rows,
                        hd,
                        w.scale,
                        scores.as_mut_ptr().add(h * sh + r0),
                        RUN,
                        prefetch,
                    )
                };
            }
            r0 += rows;
        }
        sa.finish();
        let pairs = run.div_ceil(2);
        let steps = heads * (hd / (32 * NV)) * pairs;
        // The next run's K, in address order, spread over this run's `p · V` steps.
        let mut pa = stretch(w.kp, next, steps);
        for h in 0..heads {
            let st = &mut states[h * per..(h + 1) * per];
            // SAFETY: the head's scores and probabilities are `G * RUN` entries at `h * sh`
            // of `scores` and `pb` (caller's contract); run <= RUN.
            let corr = unsafe {
                softmax_pairs::<G>(
                    scores.as_mut_ptr().add(h * sh),
                    pb.wrapping_add(h * sh),
                    run,
                    &mut st[G * hd..],
                )
            };
            let ph = pb.wrapping_add(h * sh).cast_const();
            let o = st[..G * hd].as_mut_ptr();
            let mut dc = 0;
            while dc < hd {
                // o = o * corr + p · V over the run: `2 * NV` output vectors per query (the
                // unpack-low and unpack-high lanes of NV 32-element blocks) in registers.
                let mut acc = [[_mm512_setzero_ps(); 8]; G];
                for (j, aj) in acc.iter_mut().enumerate() {
                    let c = _mm512_set1_ps(corr[j]);
                    for (x, a) in aj.iter_mut().enumerate().take(2 * NV) {
                        // SAFETY: j * hd + dc + 16 * x + 16 <= G * hd (dc + 32 * NV <= hd).
                        *a = _mm512_mul_ps(
                            unsafe { _mm512_loadu_ps(o.add(j * hd + dc + 16 * x)) },
                            c,
                        );
                    }
                }
                for i in 0..pairs {
                    pa.step();
                    let r = 2 * i;
                    let v0 = w.vp.wrapping_add(base + r * row + h * hd + dc);
                    // The odd run's last pair has no second row: zeros (its probability is 0).
                    let second = r + 1 < run;
                    let v1 = v0.wrapping_add(row);
                    // SAFETY: pair `i` of query `j` is bf16 `j * RUN + 2i, +1` of the head's
                    // probabilities (2i + 1 < RUN).
                    let pj: [__m512i; G] = std::array::from_fn(|j| unsafe {
                        _mm512_set1_epi32(ph.add(j * RUN + r).cast::<i32>().read_unaligned())
                    });
                    for b in 0..NV {
                        // SAFETY: rows r (and r + 1 when `second`) are rows of this run; their
                        // head slices hold hd bf16 and dc + 32 * b + 32 <= hd.
                        let (a, c) = unsafe {
                            let a = _mm512_loadu_si512(v0.add(32 * b).cast());
                            let c = if second {
                                _mm512_loadu_si512(v1.add(32 * b).cast())
                            } else {
                                zero
                            };
                            (a, c)
                        };
                        let lo = as_pbh(_mm512_unpacklo_epi16(a, c));
                        let hi = as_pbh(_mm512_unpackhi_epi16(a, c));
                        for (aj, p) in acc.iter_mut().zip(&pj) {
                            aj[2 * b] = _mm512_dpbf16_ps(aj[2 * b], as_pbh(*p), lo);
                            aj[2 * b + 1] = _mm512_dpbf16_ps(aj[2 * b + 1], as_pbh(*p), hi);
                        }
                    }
                }
                for (j, aj) in acc.iter().enumerate() {
                    for (x, a) in aj.iter().enumerate().take(2 * NV) {
                        // SAFETY: as for the loads.
                        unsafe { _mm512_storeu_ps(o.add(j * hd + dc + 16 * x), *a) };
                    }
                }
                dc += 32 * NV;
            }
        }
        pa.finish();
        t = next;
    }
}

/// One contiguous stretch of a pool (`lines` 64-byte lines from element `from`) prefetched
/// into L2 in order, a few lines per [`step`](Ahead::step) so the misses spread over a
/// phase's arithmetic.
struct Ahead {
    p: *const u16,
    from: usize,
    lines: usize,
    per_step: usize,
    at: usize,
}

impl Ahead {
    /// The stretch of `elems` elements from `from`, spread over `steps` steps.
    fn new(p: *const u16, from: usize, elems: usize, steps: usize) -> Ahead {
        let lines = elems.div_ceil(32);
        Ahead {
            p,
            from,
            lines,
            per_step: lines.div_ceil(steps.max(1)),
            at: 0,
        }
    }

    /// Prefetches the next lines of the stretch.
    #[inline(always)]
    fn step(&mut self) {
        let end = (self.at + self.per_step).min(self.lines);
        for l in self.at..end {
            // A plain address, never dereferenced.
            prefetch_l2(self.p.wrapping_add(self.from + 32 * l));
        }
        self.at = end;
    }

    /// Prefetches what is left of the stretch.
    fn finish(&mut self) {
        self.per_step = self.lines;
        self.step();
    }
}

/// The online-softmax step of one head after a run of `run <= RUN` scores per query
/// (`s[j * RUN..][..run]`): each query's probabilities `exp(s - m_new)` are written as bf16 to
/// `p[j * RUN..]` (zero past `run`, up to the next multiple of 32), `m` and `l` (`ml`: `[G]`
/// max then `[G]` sum) are updated, `l` with the rounded probabilities, and the factor
/// `e^(m_old - m_new)` the outputs must be scaled by is returned per query (0 for the first
/// run). The max ignores NaN scores, which still make the sum NaN, as on the other paths.
///
/// # Safety
/// AVX-512 F/BW/VL and BF16; `s` holds `G * RUN` floats and `p` `G * RUN` writable bf16;
/// `run <= RUN`; `ml.len() >= 2 * G`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
unsafe fn softmax_pairs<const G: usize>(
    s: *const f32,
    p: *mut u16,
    run: usize,
    ml: &mut [f32],
) -> [f32; G] {
    debug_assert!(run <= RUN);
    let (m, l) = ml[..2 * G].split_at_mut(G);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let ones = as_pbh(_mm512_set1_epi32(ONES));
    // Lanes of 16-float vector `v` inside the run.
    let mask = |v: usize| -> __mmask16 {
        let n = run.saturating_sub(16 * v).min(16);
        ((1u32 << n) - 1) as __mmask16
    };
    let vecs = run.div_ceil(32) * 2;
    let mut corr = [0.0f32; G];
    for j in 0..G {
        let sj = s.wrapping_add(j * RUN);
        let mut mx = ninf;
        for v in 0..vecs {
            // SAFETY: lanes inside the run are inside the query's `RUN` scores; masked-off
            // lanes are not read.
            let x = unsafe { _mm512_mask_loadu_ps(ninf, mask(v), sj.add(16 * v)) };
            let ordered = _mm512_mask_mov_ps(ninf, _mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x), x);
            mx = _mm512_max_ps(mx, ordered);
        }
        let m_new = m[j].max(_mm512_reduce_max_ps(mx));
        let mv = _mm512_set1_ps(m_new);
        let mut sum = _mm512_setzero_ps();
        for v in (0..vecs).step_by(2) {
            // SAFETY: as above.
            let (a, b) = unsafe {
                (
                    _mm512_mask_loadu_ps(ninf, mask(v), sj.add(16 * v)),
                    _mm512_mask_loadu_ps(ninf, mask(v + 1), sj.add(16 * v + 16)),
                )
            };
            let ea = _mm512_maskz_mov_ps(mask(v), exp512(_mm512_sub_ps(a, mv)));
            let eb = _mm512_maskz_mov_ps(mask(v + 1), exp512(_mm512_sub_ps(b, mv)));
            // Lanes 0–15 from `ea`, 16–31 from `eb`: tokens in order, so 32-bit lane `i`
            // holds the pair (2i, 2i + 1).
            let pv = _mm512_cvtne2ps_pbh(eb, ea);
            sum = _mm512_dpbf16_ps(sum, pv, ones);
            // SAFETY: bf16 `16 * v .. 16 * v + 32` of the query's `RUN` (v + 2 <= vecs and
            // 16 * vecs <= RUN).
            unsafe {
                _mm512_storeu_si512(
                    p.add(j * RUN + 16 * v).cast(),
                    std::mem::transmute::<__m512bh, __m512i>(pv),
                )
            };
        }
        corr[j] = if m[j] == f32::NEG_INFINITY {
            0.0
        } else {
            (m[j] - m_new).exp()
        };
        l[j] = l[j] * corr[j] + _mm512_reduce_add_ps(sum);
        m[j] = m_new;
    }
    corr
}

/// The partial records (`[m, l, o...]` per query) of one head's state `st`: the outputs back
/// from this module's order (per 32-element block, `vpunpcklwd`'s 16 lanes then
/// `vpunpckhwd`'s: lane `4c + k` of the low half is element `8c + k`, of the high half
/// element `8c + 4 + k`) to element order.
fn write_partials(st: &[f32], group: usize, hd: usize, out: &mut [f32]) {
    let (o, ml) = st.split_at(group * hd);
    for j in 0..group {
        let rec = &mut out[j * (hd + 2)..(j + 1) * (hd + 2)];
        rec[0] = ml[j];
        rec[1] = ml[group + j];
        for (dst, src) in rec[2..]
            .chunks_exact_mut(32)
            .zip(o[j * hd..(j + 1) * hd].chunks_exact(32))
        {
            let (lo, hi) = src.split_at(16);
            for c in 0..4 {
                dst[8 * c..8 * c + 4].copy_from_slice(&lo[4 * c..4 * c + 4]);
                dst[8 * c + 4..8 * c + 8].copy_from_slice(&hi[4 * c..4 * c + 4]);
            }
        }
    }
}
