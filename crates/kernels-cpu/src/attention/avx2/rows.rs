//! Every KV head at once over a range of tokens, token-major: each pool row's K (then V) is
//! read whole, for all heads, in address order. Groups 1–4 read the range as several
//! far-apart sequential streams side by side and leave them to the hardware prefetchers
//! ([`rows_streams`]); groups 5–8 read it as one stream with a software prefetch a few rows
//! ahead ([`rows_g`]).
//!
//! Two kernels share this walk and its `p · V` ([`Scores`]): the AVX2 one widens K to fp32
//! and takes two FMAs per query and 16 elements against the pre-scaled fp32 queries
//! ([`scores_rows`]); the AVX-512 BF16 one takes the bf16 query and key pairs as they are,
//! one 256-bit `vdpbf16ps` per query and 16 elements, and scales the finished score
//! ([`scores_rows_bf16`]). On Zen 4 the second took 0.78× the first's time on one thread,
//! 0.87–0.90× on two at 4 × 1024 and 16 × 1024 where each thread had its own bandwidth and
//! 0.95× where the two shared the lower state, and 0.82× with the pool in cache (`attn_bw
//! --shape`, interleaved rounds); whole 16 × 1024 steps 0.96× (`docs/benchmarks.md`,
//! session 45): the walk reads KV as the AVX2 kernel does, and the scores cost a third of the
//! instructions.

use std::arch::x86_64::*;
use std::ops::Range;

use half::bf16;

use super::super::PagedKv;
use super::update;
use crate::simd::{hsum256, prefetch_l2};

/// Runs every KV head (states back to back in `state`, scores in `s`, [`rows_scores_len`])
/// over `tokens`, token-major: runs of at most [`ROWS_RUN`] tokens, each row's K (then V)
/// read whole, for all heads, in address order, so the pool is read as sequential streams
/// (what the hardware prefetchers follow). Groups 1–2 read four such streams side by side,
/// groups 3–4 two ([`rows_streams`]); groups 5–8 one, with a software prefetch
/// [`ROWS_AHEAD`] rows ahead of each of the K and V streams, one head's lines per head call
/// so the misses spread over the arithmetic ([`rows_g`]).
///
/// Scores are taken by `scores`: [`Scores::Fp32`] from the pre-scaled fp32 queries of the
/// states, [`Scores::Bf16`] from the bf16 queries it carries.
///
/// # Safety
/// As [`decode_partial`](super::decode_partial) for every head; with [`Scores::Bf16`], the CPU
/// supports AVX-512 F/BW/VL and AVX-512 BF16 and its queries hold `heads * group * hd`
/// elements (the row's, in head order).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows_over(
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    tokens: Range<usize>,
    scores: Scores<'_>,
    state: &mut [f32],
    s: &mut [f32],
) {
    let sc = scores;
    macro_rules! go {
        ($($g:literal => $sr:literal, $pr:literal, $pl:literal);*) => {
            match group {
                // SAFETY: forwarded contract; the group matches the instantiation.
                $($g => unsafe { rows_g::<$g, $sr, $pr, $pl>(kv, block_table, tokens, sc, state, s) },)*
                // SAFETY: forwarded contract.
                1 => unsafe { rows_streams::<1, 4, 32>(kv, block_table, tokens, sc, state, s) },
                // SAFETY: forwarded contract.
                2 => unsafe { rows_streams::<2, 4, 32>(kv, block_table, tokens, sc, state, s) },
                // SAFETY: forwarded contract.
                3 => unsafe { rows_streams::<3, 2, 16>(kv, block_table, tokens, sc, state, s) },
                // SAFETY: forwarded contract.
                4 => unsafe { rows_streams::<4, 2, 16>(kv, block_table, tokens, sc, state, s) },
                _ => unreachable!("group {group} not supported"),
            }
        };
    }
    // Groups 5–8: rows per scores / p·V block and p·V lanes. Blocks of adjacent rows (their
    // head slices 2 KB apart) keep the reads from overlapping the arithmetic, while a row from
    // each of several far-apart streams gives both the register reuse and a faster read (see
    // `rows_streams`): four streams for groups 1–2, two for 3–4, whose `G × S` accumulators
    // and queries still fit the registers. Group 5 measured level with two streams (its
    // queries no longer fit), so 5–8 keep the adjacent-row blocks.
    go!(5 => 1, 4, 16; 6 => 1, 4, 16; 7 => 1, 2, 16; 8 => 1, 2, 16);
}

/// Tokens per run of the token-major pass (the online-softmax tile; runs also end at pages).
///
/// 128 rather than 32: each run ends with an online-softmax update per head (the running
/// max, the exponentials, the outputs rescaled), and longer runs take fewer of them; the
/// scores of a run (`kv_heads * group * 128` floats, at most 32 KiB) stay in L1/L2. The
/// AVX2 kernel took 0.92–0.99× the time at 1 × 256, 4 × 1024 and 16 × 1024 for group 2
/// (cold, `attn_bw --shape`, alternating rounds), 0.96–0.99× for groups 5 and 8, and the
/// 4 × 1024 step 0.975× (old/new 1.026 [1.005, 1.043]; `docs/benchmarks.md`, session 36).
const ROWS_RUN: usize = 128;

/// Rows the software prefetch of [`rows_g`] (and of the AVX-512 BF16 kernel's streams in
/// [`rows_streams`]) runs ahead of its stream, and rows of each stream
/// [`Walk::prefetch_first`] asks for before a call's first block.
const ROWS_AHEAD: usize = 4;

/// How [`rows_over`] takes the scores `q · k`.
#[derive(Clone, Copy)]
pub(super) enum Scores<'a> {
    /// K widened to fp32 against the states' pre-scaled fp32 queries (AVX2 and FMA).
    Fp32,
    /// `vdpbf16ps` on the bf16 queries (the row's, `heads * group * hd` in head order) and K
    /// as they are, each finished score times `scale` (AVX-512 BF16).
    Bf16 { q: &'a [bf16], scale: f32 },
}

/// Floats of score scratch [`rows_over`] needs.
pub(super) fn rows_scores_len(kv_heads: usize, group: usize) -> usize {
    kv_heads * group * ROWS_RUN
}

/// What one call walks: the two pools' rows by token, and the strides of the heads' states
/// and scores for a group of `G`.
struct Walk<'a> {
    kp: *const u16,
    vp: *const u16,
    /// Elements per pool row (every head's slice).
    row: usize,
    page: usize,
    block_table: &'a [u32],
    heads: usize,
    hd: usize,
    /// Floats per head state.
    per: usize,
    /// Score floats per head.
    sh: usize,
}

impl<'a> Walk<'a> {
    fn new<const G: usize>(kv: &PagedKv<'_>, block_table: &'a [u32]) -> Walk<'a> {
        Walk {
            kp: kv.k.as_ptr().cast::<u16>(),
            vp: kv.v.as_ptr().cast::<u16>(),
            row: kv.row(),
            page: kv.page_size,
            block_table,
            heads: kv.kv_heads,
            hd: kv.head_dim,
            per: G * (2 * kv.head_dim + 2),
            sh: G * ROWS_RUN,
        }
    }

    /// Token `t`'s row in pool `p` (`kp` or `vp`; a plain address, dereferenced only by the
    /// callers, for tokens their contract covers).
    fn at(&self, p: *const u16, t: usize) -> *const u16 {
        let slot = self.block_table[t / self.page] as usize * self.page + t % self.page;
        p.wrapping_add(slot * self.row)
    }

    /// Token `t + ROWS_AHEAD`'s row in pool `p`, or null from `end` on: what a block at `t`
    /// prefetches.
    fn ahead(&self, p: *const u16, t: usize, end: usize) -> *const u16 {
        if t + ROWS_AHEAD < end {
            self.at(p, t + ROWS_AHEAD)
        } else {
            std::ptr::null()
        }
    }

    /// Prefetches the first `ROWS_AHEAD` rows of `tokens` in both pools (no earlier block
    /// prefetches them).
    fn prefetch_first(&self, tokens: Range<usize>) {
        for u in tokens.start..(tokens.start + ROWS_AHEAD).min(tokens.end) {
            for e in (0..self.row).step_by(32) {
                prefetch_l2(self.at(self.kp, u).wrapping_add(e));
                prefetch_l2(self.at(self.vp, u).wrapping_add(e));
            }
        }
    }
}

/// [`rows_over`] for group `G`.
///
/// # Safety
/// As [`rows_over`], with `G` the group `kv` was checked for.
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_g<const G: usize, const SR: usize, const PR: usize, const PL: usize>(
    kv: &PagedKv<'_>,
    block_table: &[u32],
    tokens: Range<usize>,
    sc: Scores<'_>,
    state: &mut [f32],
    s: &mut [f32],
) {
    let w = Walk::new::<G>(kv, block_table);
    let (kp, vp, row, page) = (w.kp, w.vp, w.row, w.page);
    let (heads, hd, per, sh) = (w.heads, w.hd, w.per, w.sh);
    let end = tokens.end;
    let ahead_row = |p: *const u16, t: usize| w.ahead(p, t, end);
    w.prefetch_first(tokens.clone());
    let mut t = tokens.start;
    while t < end {
        let run = ROWS_RUN.min(page - t % page).min(end - t);
        // Rows of a run lie in one page, one after another.
        let (kb, vb) = (w.at(kp, t), w.at(vp, t));
        // Scores, SR rows at a time (every head of them, in address order).
        let mut i = 0;
        while i < run {
            let kr = kb.wrapping_add(i * row);
            // SAFETY: rows i..i+SR (or i) of this run are inside the pool (caller's
            // contract); `s` holds `heads * sh` floats and i + SR <= run <= ROWS_RUN.
            unsafe {
                if i + SR <= run {
                    let pf = std::array::from_fn(|r| ahead_row(kp, t + i + r));
                    let kr = std::array::from_fn(|r| kr.wrapping_add(r * row));
                    let idx = std::array::from_fn(|r| i + r);
                    score_block::<G, SR>(sc, state, &w, kr, pf, s, idx);
                    i += SR;
                } else {
                    let pf = [ahead_row(kp, t + i)];
                    score_block::<G, 1>(sc, state, &w, [kr], pf, s, [i]);
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
            let vr = vb.wrapping_add(i * row);
            // SAFETY: rows i..i+PR (or i) of this run are inside the pool (caller's
            // contract); their scores are inside `s`.
            unsafe {
                if i + PR <= run {
                    let pf = std::array::from_fn(|r| ahead_row(vp, t + i + r));
                    let vr = std::array::from_fn(|r| vr.wrapping_add(r * row));
                    let idx = std::array::from_fn(|r| i + r);
                    pv_rows::<G, PR, PL>(s, sh, ROWS_RUN, idx, vr, pf, heads, hd, state, per);
                    i += PR;
                } else {
                    let pf = [ahead_row(vp, t + i)];
                    pv_rows::<G, 1, PL>(s, sh, ROWS_RUN, [i], [vr], pf, heads, hd, state, per);
                    i += 1;
                }
            }
        }
        t += run;
    }
}

/// [`rows_g`] over `S` far-apart streams: `tokens` cut into `S` equal sub-ranges read side
/// by side, each block taking the next row of every stream (one online-softmax run holds up
/// to `ROWS_RUN / S` rows of each; the softmax does not care which tokens a run holds).
///
/// Why: on Zen 3 a core reads several far-apart sequential streams faster than one (a plain
/// read of a decode step's pools as 2 or 4 interleaved streams took ~0.9× the time of the
/// same read as one: `attn_bw --paths read-split:1,read-split:2`), the same finding as the
/// GEMMs' row streams, while blocks of *adjacent* rows read slower than single rows (a
/// 2-stream kernel whose blocks took two adjacent rows of each stream: 1.1–1.2× its time).
///
/// The AVX2 kernel ([`Scores::Fp32`]) prefetches nothing past each stream's first rows: within
/// a page a stream is one sequential run of memory, which the hardware prefetchers follow,
/// and on Zen 3 the prefetches (a head's lines of a row further on, per head call) cost issue
/// slots the arithmetic needed: without them the two-stream kernel took 0.80–0.87× the time
/// with the pool in L2 and 0.88–0.96× cold. Four streams instead of two then took 0.76× in L2
/// and 0.90–0.94× cold; both together 0.85–0.93× at 1 × 256, 4 × 1024 and 16 × 1024 cold
/// (`attn_bw --shape`, 2 threads, alternating rounds). Groups 3–4 as two streams took
/// 0.80–0.97× the adjacent-row kernel's time (`docs/benchmarks.md`, session 36).
///
/// The AVX-512 BF16 kernel ([`Scores::Bf16`]), whose scores take a third of the AVX2 ones'
/// instructions, prefetches each stream [`ROWS_AHEAD`] rows ahead of its K and V rows, a
/// head's lines per head call: on Zen 4 that took 0.93–0.96× the time at 16 × 1024, 0.96–0.975×
/// at 4 × 1024 and 0.90× at 1 × 256 on 2 threads, 0.94× on one, 0.95× with the pool in L3 (2
/// rows ahead: about the same; 8: 0.98–1.0×) (`docs/benchmarks.md`, session 45). (It would
/// help the AVX2 kernel on Zen 4 too, 0.87× at 16 × 1024, but that CPU runs the AVX-512 one.)
///
/// # Safety
/// As [`rows_over`].
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_streams<const G: usize, const S: usize, const PL: usize>(
    kv: &PagedKv<'_>,
    block_table: &[u32],
    tokens: Range<usize>,
    sc: Scores<'_>,
    state: &mut [f32],
    s: &mut [f32],
) {
    let w = Walk::new::<G>(kv, block_table);
    let (kp, vp, row, page) = (w.kp, w.vp, w.row, w.page);
    let (heads, hd, per, sh) = (w.heads, w.hd, w.per, w.sh);
    let len = tokens.len();
    let mut cur: [usize; S] = std::array::from_fn(|x| tokens.start + len * x / S);
    let ends: [usize; S] = std::array::from_fn(|x| tokens.start + len * (x + 1) / S);
    for x in 0..S {
        w.prefetch_first(cur[x]..ends[x]);
    }
    // No prefetch past the first rows for the AVX2 kernel; `ROWS_AHEAD` rows ahead of each
    // stream for the AVX-512 BF16 one (see above).
    let none = [std::ptr::null::<u16>(); S];
    let ahead = matches!(sc, Scores::Bf16 { .. });
    // Row `i + ROWS_AHEAD` of every stream in pool `p`, where that is still the stream's (a
    // plain address: prefetched, never read).
    let rows_ahead = |p: *const u16, cur: &[usize; S], i: usize| -> [*const u16; S] {
        if !ahead {
            return none;
        }
        std::array::from_fn(|x| {
            let u = cur[x] + i + ROWS_AHEAD;
            if u < ends[x] {
                w.at(p, u)
            } else {
                std::ptr::null()
            }
        })
    };
    loop {
        let n: [usize; S] = std::array::from_fn(|x| {
            (ROWS_RUN / S)
                .min(ends[x] - cur[x])
                .min(page - cur[x] % page)
        });
        let run: usize = n.iter().sum();
        if run == 0 {
            break;
        }
        let mut off = [0usize; S];
        for x in 1..S {
            off[x] = off[x - 1] + n[x - 1];
        }
        let m = n.iter().copied().min().unwrap_or(0);
        // Each stream's rows of this run lie in one page, one after another.
        let kb: [*const u16; S] =
            std::array::from_fn(|x| if n[x] > 0 { w.at(kp, cur[x]) } else { kp });
        let vb: [*const u16; S] =
            std::array::from_fn(|x| if n[x] > 0 { w.at(vp, cur[x]) } else { vp });
        // Row `i < n[x]` of stream `x` is token `cur[x] + i`: inside `tokens` and inside
        // `cur[x]`'s page, so inside the pool by the caller's contract; its score index
        // `off[x] + i < run <= ROWS_RUN`, the score stride.
        for i in 0..m {
            let kr = std::array::from_fn(|x| kb[x].wrapping_add(i * row));
            let idx = std::array::from_fn(|x| off[x] + i);
            let pf = rows_ahead(kp, &cur, i);
            // SAFETY: rows and score indices as above (i < m <= n[x] for every stream).
            unsafe { score_block::<G, S>(sc, state, &w, kr, pf, s, idx) };
        }
        for x in 0..S {
            for i in m..n[x] {
                let kr = [kb[x].wrapping_add(i * row)];
                let idx = [off[x] + i];
                // SAFETY: as above (i < n[x]).
                unsafe { score_block::<G, 1>(sc, state, &w, kr, [none[0]], s, idx) };
            }
        }
        for (h, st) in state.chunks_exact_mut(per).enumerate() {
            // SAFETY: run <= ROWS_RUN, the score stride.
            unsafe { update::<G>(&mut s[h * sh..(h + 1) * sh], ROWS_RUN, run, hd, st) };
        }
        for i in 0..m {
            let vr = std::array::from_fn(|x| vb[x].wrapping_add(i * row));
            let idx = std::array::from_fn(|x| off[x] + i);
            let pf = rows_ahead(vp, &cur, i);
            // SAFETY: as for the scores.
            unsafe { pv_rows::<G, S, PL>(s, sh, ROWS_RUN, idx, vr, pf, heads, hd, state, per) };
        }
        for x in 0..S {
            for i in m..n[x] {
                let vr = [vb[x].wrapping_add(i * row)];
                let idx = [off[x] + i];
                // SAFETY: as for the scores.
                unsafe {
                    pv_rows::<G, 1, PL>(s, sh, ROWS_RUN, idx, vr, [none[0]], heads, hd, state, per)
                };
            }
        }
        for x in 0..S {
            cur[x] += n[x];
        }
    }
}

/// Prefetches head `h`'s slice (`hd` bf16, 64-byte lines) of each row in `pf` (null: none)
/// into L2: the kernels spread a row's prefetch over their head calls, so the misses overlap
/// the arithmetic instead of queueing behind each other.
#[inline]
fn prefetch_head(pf: &[*const u16], h: usize, hd: usize) {
    for f in pf.iter().filter(|f| !f.is_null()) {
        for e in (0..hd).step_by(32) {
            // A plain address, never dereferenced: `wrapping_add` keeps the arithmetic defined.
            prefetch_l2(f.wrapping_add(h * hd + e));
        }
    }
}

/// Scores of `R` K rows (row `r` at `k[r]`) for every head, by `sc` ([`scores_rows`] or
/// [`scores_rows_bf16`]); `pf` as [`scores_rows`] takes it.
///
/// # Safety
/// As [`scores_rows`]; with [`Scores::Bf16`], as [`scores_rows_bf16`] (the CPU supports
/// AVX-512 F/BW/VL and BF16, the queries cover every head).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn score_block<const G: usize, const R: usize>(
    sc: Scores<'_>,
    state: &[f32],
    w: &Walk<'_>,
    k: [*const u16; R],
    pf: [*const u16; R],
    s: &mut [f32],
    idx: [usize; R],
) {
    let (heads, hd, per, sh) = (w.heads, w.hd, w.per, w.sh);
    match sc {
        // SAFETY: forwarded contract.
        Scores::Fp32 => unsafe {
            scores_rows::<G, R>(state, per, k, pf, heads, hd, s, sh, ROWS_RUN, idx)
        },
        // SAFETY: forwarded contract (AVX-512 BF16 present with `Scores::Bf16`).
        Scores::Bf16 { q, scale } => unsafe {
            scores_rows_bf16::<G, R>(q, scale, k, pf, heads, hd, s, sh, ROWS_RUN, idx)
        },
    }
}

/// Scores of `R` K rows (row `r` at `k[r]`, every head's slice) against every head's `G`
/// permuted queries (`state`, one head state of `per` floats each), row `r`'s into
/// `s[h * sh + j * sr + idx[r]]`. Each query vector loaded serves the `R` rows and each
/// widened K vector the `G` queries; the `G * R` accumulators hide the FMA latency. `pf` are
/// the rows to prefetch (null: none), a head's lines per head.
///
/// # Safety
/// AVX2 and FMA; `heads * hd` bf16 readable at each `k[r]`; `hd` a multiple of 16;
/// `state.len() >= heads * per`, each head's queries first; `s` long enough.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn scores_rows<const G: usize, const R: usize>(
    state: &[f32],
    per: usize,
    k: [*const u16; R],
    pf: [*const u16; R],
    heads: usize,
    hd: usize,
    s: &mut [f32],
    sh: usize,
    sr: usize,
    idx: [usize; R],
) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    for h in 0..heads {
        prefetch_head(&pf, h, hd);
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
                let raw = unsafe { _mm256_loadu_si256(k[r].add(h * hd + d).cast::<__m256i>()) };
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
                s[h * sh + j * sr + idx[r]] = hsum256(acc[j][r]);
            }
        }
    }
}

/// [`scores_rows`] on `vdpbf16ps`: row `r`'s score against query `j` of head `h` is the dot
/// product of the bf16 query `q[(h * G + j) * hd..]` and the row's head slice, summed in two
/// chains (even and odd 16-element blocks: `G × R` accumulators alone would wait on the
/// instruction's latency at `G × R = 8`), times `scale`.
///
/// # Safety
/// AVX2, FMA, AVX-512 F/BW/VL and AVX-512 BF16; `q.len() >= heads * G * hd`; `heads * hd`
/// bf16 readable at each `k[r]`; `hd` a multiple of 32; `s` long enough.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn scores_rows_bf16<const G: usize, const R: usize>(
    q: &[bf16],
    scale: f32,
    k: [*const u16; R],
    pf: [*const u16; R],
    heads: usize,
    hd: usize,
    s: &mut [f32],
    sh: usize,
    sr: usize,
    idx: [usize; R],
) {
    debug_assert!(q.len() >= heads * G * hd && hd.is_multiple_of(32));
    for h in 0..heads {
        prefetch_head(&pf, h, hd);
        let qh = q[h * G * hd..(h + 1) * G * hd].as_ptr().cast::<u16>();
        let mut acc = [[[_mm256_setzero_ps(); R]; G]; 2];
        let mut d = 0;
        while d < hd {
            for (c, acc) in acc.iter_mut().enumerate() {
                let dd = d + 16 * c;
                // SAFETY: j * hd + dd + 16 <= G * hd, the head's queries.
                let qv: [__m256bh; G] = std::array::from_fn(|j| unsafe {
                    as_pbh256(_mm256_loadu_si256(qh.add(j * hd + dd).cast()))
                });
                for r in 0..R {
                    // SAFETY: row r's head h slice holds hd bf16 and dd + 16 <= hd.
                    let kv = unsafe { as_pbh256(_mm256_loadu_si256(k[r].add(h * hd + dd).cast())) };
                    for j in 0..G {
                        acc[j][r] = _mm256_dpbf16_ps(acc[j][r], qv[j], kv);
                    }
                }
            }
            d += 32;
        }
        for j in 0..G {
            for r in 0..R {
                let v = _mm256_add_ps(acc[0][j][r], acc[1][j][r]);
                s[h * sh + j * sr + idx[r]] = hsum256(v) * scale;
            }
        }
    }
}

/// The bits of 16 bf16 values as the 256-bit `vdpbf16ps` operand.
#[target_feature(enable = "avx512f,avx512vl,avx512bf16")]
#[inline]
fn as_pbh256(v: __m256i) -> __m256bh {
    // SAFETY: both are plain 256-bit vectors with no invalid bit patterns.
    unsafe { std::mem::transmute::<__m256i, __m256bh>(v) }
}

/// `o += p · V` for `R` V rows of a run (row `r` at `v[r]`, its probabilities at score index
/// `idx[r]`) and every head, `L` output lanes (16 or 32) at a time: the lanes' outputs of the
/// `G` queries stay in registers across the `R` rows, so each is loaded and stored once per
/// `R` rows, and each widened V vector feeds `G` FMAs.
///
/// # Safety
/// AVX2 and FMA; `heads * hd` bf16 readable at each `v[r]`; `hd` a multiple of `L`;
/// `state.len() >= heads * per`; `p[h * sh + j * sr + idx[r]]` inside `p`.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn pv_rows<const G: usize, const R: usize, const L: usize>(
    p: &[f32],
    sh: usize,
    sr: usize,
    idx: [usize; R],
    v: [*const u16; R],
    pf: [*const u16; R],
    heads: usize,
    hd: usize,
    state: &mut [f32],
    per: usize,
) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let vecs = L / 8; // output vectors per query (even and odd halves of L / 16 blocks)
    for h in 0..heads {
        prefetch_head(&pf, h, hd);
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
                        _mm256_loadu_si256(v[r].add(h * hd + dc + 16 * blk).cast::<__m256i>())
                    };
                    vv[2 * blk] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                    vv[2 * blk + 1] = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                }
                for j in 0..G {
                    let pj = _mm256_set1_ps(ph[j * sr + idx[r]]);
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
