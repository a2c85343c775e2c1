//! Causal prefill rows on AVX2+FMA: a block of queries against the prefix as two register-
//! blocked matrix products per run of tokens, with online softmax.
//!
//! One decode pass per query row (what this path ran before) widens every K and V element
//! once per row and reads each row's outputs once per token; here a run of [`RUN`] tokens is
//! widened to fp32 once for a block of up to [`QBLK`] queries, and
//! - scores `Sᵀ[t][q] = Σ_d K[t][d] · Qᵀ[d][q]` take [`NT`] tokens × 16 queries per tile: each
//!   key element is broadcast against two 8-query vectors of the transposed (pre-scaled)
//!   queries, 12 accumulators and no horizontal sums;
//! - the online-softmax update runs down the token axis with 8 queries per vector (max,
//!   causal mask, `e^x`, sums, rescale factors: vertical operations only);
//! - `O[q][d] = O[q][d] · corr[q] + Σ_t P[t][q] · V[t][d]` takes up to 6 queries × 16 output
//!   lanes per tile, the outputs in registers across the run.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::super::PrefillRows;
use super::exp256;
use crate::simd::transpose8;

/// Most queries per block (a multiple of 16).
const QBLK: usize = 64;

/// Fewest queries worth a block: below it the padding to 16-query tiles costs more than the
/// per-row passes (`prefill_attn`, group 1: 8 queries ran at parity with the per-row passes,
/// 12 in 0.74 of their time, 4 in 1.8 times).
pub(super) const MIN_QUERIES: usize = 12;

/// Tokens per run (a multiple of [`NT`]).
const RUN: usize = 48;

/// Tokens per score tile.
const NT: usize = 6;

/// Per-thread scratch: per query block its transposed queries, outputs and softmax state (at
/// block `b`'s offset: `qt` and `o` `b * QBLK * head_dim`, the state vectors `b * QBLK`); the
/// run's widened K and V and one block's scores, shared by the blocks.
#[derive(Default)]
struct Scratch {
    qt: Vec<f32>,
    kf: Vec<f32>,
    vf: Vec<f32>,
    st: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    corr: Vec<f32>,
    lim: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// One query block of a call: its first query, its query count, the tokens any of its
/// queries sees (`0..end`) and the first token some query of it does not see.
#[derive(Clone, Copy)]
struct Block {
    qb0: usize,
    nqb: usize,
    end: usize,
    first_masked: usize,
}

/// Causal prefill rows of one KV head (see `prefill_attention_rows_f32`): query `i * group +
/// j` of `rows.queries` (`[n_rows, group, head_dim]` fp32) attends to tokens `0..=first_pos +
/// i`; `out` (same shape) gets the normalised outputs.
///
/// The call's queries are cut into blocks of at most [`QBLK`], and each run of [`RUN`] tokens
/// is widened once for every block that sees it (a call of 64 rows at group 2 is two blocks:
/// the widening of the prefix, ~12% of a one-block call's time in the step's profile, is
/// shared).
///
/// # Safety
/// The CPU supports AVX2 and FMA; `rows.kv.head_dim` is a multiple of 16; `rows` passed
/// `PrefillRows::check` with `out`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn prefill_rows(rows: &PrefillRows<'_>, out: &mut [f32]) {
    let (q, group, kv, first_pos) = (rows.f32_queries(), rows.group, &rows.kv, rows.first_pos);
    let hd = kv.head_dim;
    assert!(hd.is_multiple_of(16) && group > 0 && q.len() == out.len());
    let nq = q.len() / hd;
    // Blocks of nearly equal size, so no last block is mostly padding.
    let per = nq.div_ceil(nq.div_ceil(QBLK).max(1)).max(1);
    let blocks: Vec<Block> = (0..nq)
        .step_by(per)
        .map(|qb0| {
            let nqb = per.min(nq - qb0);
            Block {
                qb0,
                nqb,
                end: first_pos + (qb0 + nqb - 1) / group + 1,
                first_masked: first_pos + qb0 / group + 1,
            }
        })
        .collect();
    let nb = blocks.len();
    SCRATCH.with(|cell| {
        let mut s = cell.borrow_mut();
        let s = &mut *s;
        s.qt.resize(nb * QBLK * hd, 0.0);
        s.kf.resize(RUN * hd, 0.0);
        s.vf.resize(RUN * hd, 0.0);
        s.st.resize(RUN * QBLK, 0.0);
        s.o.resize(nb * QBLK * hd, 0.0);
        for v in [&mut s.m, &mut s.l, &mut s.corr, &mut s.lim] {
            v.resize(nb * QBLK, 0.0);
        }
        for (b, blk) in blocks.iter().enumerate() {
            let qp = blk.nqb.next_multiple_of(16);
            let (sb, ob) = (b * QBLK, b * QBLK * hd);
            // SAFETY: the block's queries lie inside `q`; its transposed tile (hd rows of qp
            // <= QBLK) inside `qt` at the block's offset.
            unsafe {
                transpose_queries(
                    &q[blk.qb0 * hd..(blk.qb0 + blk.nqb) * hd],
                    hd,
                    qp,
                    rows.scale,
                    &mut s.qt[ob..ob + hd * qp],
                )
            };
            for c in 0..qp {
                s.lim[sb + c] = if c < blk.nqb {
                    (first_pos + (blk.qb0 + c) / group + 1) as f32
                } else {
                    0.0
                };
            }
            s.m[sb..sb + qp].fill(f32::NEG_INFINITY);
            s.l[sb..sb + qp].fill(0.0);
            s.o[ob..ob + qp * hd].fill(0.0);
        }
        // The last block sees the most tokens.
        let end = blocks.iter().map(|b| b.end).max().unwrap_or(0);
        let (block_table, kv_head) = (rows.block_table, rows.kv_head);
        let page = kv.page_size;
        let row = kv.row();
        let kp = kv.k.as_ptr().cast::<u16>();
        let vp = kv.v.as_ptr().cast::<u16>();
        let mut t0 = 0;
        while t0 < end {
            let wide = RUN.min(end - t0);
            for i in 0..wide {
                let t = t0 + i;
                let at = (block_table[t / page] as usize * page + t % page) * row + kv_head * hd;
                // SAFETY: token t's page is inside the table and the pool (contract), so its
                // head slice of hd bf16 is readable at `at`; rows i < RUN of `kf`/`vf` hold hd
                // floats.
                unsafe {
                    widen(kp.add(at), s.kf.as_mut_ptr().add(i * hd), hd);
                    widen(vp.add(at), s.vf.as_mut_ptr().add(i * hd), hd);
                }
            }
            s.kf[wide * hd..wide.next_multiple_of(NT) * hd].fill(0.0);
            for (b, blk) in blocks.iter().enumerate() {
                if blk.end > t0 {
                    let run = RUN.min(blk.end - t0);
                    // SAFETY: run <= wide rows of `kf`/`vf` widened (and the score tiles'
                    // padding up to a multiple of NT, zero or widened, inside RUN rows);
                    // block b's state at its offsets (sized above).
                    unsafe { block_run(s, b, blk.nqb.next_multiple_of(16), hd, t0, run, blk) };
                }
            }
            t0 += wide;
        }
        let mut outs = out.chunks_exact_mut(hd);
        for (b, blk) in blocks.iter().enumerate() {
            for c in 0..blk.nqb {
                let (sb, ob) = (b * QBLK + c, (b * QBLK + c) * hd);
                let inv = if s.l[sb] > 0.0 { 1.0 / s.l[sb] } else { 0.0 };
                let o = outs.next().expect("one output row per query");
                for (d, &a) in o.iter_mut().zip(&s.o[ob..ob + hd]) {
                    *d = a * inv;
                }
            }
        }
    });
}

/// `qt[d * qp + c] = q[c * hd + d] · scale` for the block's `q.len() / hd` queries, zero for
/// the padding queries up to `qp`, by 8 × 8 transposes.
///
/// # Safety
/// AVX2; `hd` and `qp` multiples of 8; `q.len() / hd <= qp`; `qt.len() >= hd * qp`.
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_queries(q: &[f32], hd: usize, qp: usize, scale: f32, qt: &mut [f32]) {
    let nqb = q.len() / hd;
    assert!(hd.is_multiple_of(8) && qp.is_multiple_of(8) && nqb <= qp && qt.len() >= hd * qp);
    let sc = _mm256_set1_ps(scale);
    for c0 in (0..qp).step_by(8) {
        for d0 in (0..hd).step_by(8) {
            let r: [__m256; 8] = std::array::from_fn(|i| {
                if c0 + i < nqb {
                    // SAFETY: query c0 + i < nqb has hd floats from (c0 + i) * hd, and
                    // d0 + 8 <= hd.
                    _mm256_mul_ps(
                        unsafe { _mm256_loadu_ps(q.as_ptr().add((c0 + i) * hd + d0)) },
                        sc,
                    )
                } else {
                    _mm256_setzero_ps()
                }
            });
            for (j, v) in transpose8(r).into_iter().enumerate() {
                // SAFETY: (d0 + j) * qp + c0 + 8 <= hd * qp <= qt.len() (asserted).
                unsafe { _mm256_storeu_ps(qt.as_mut_ptr().add((d0 + j) * qp + c0), v) };
            }
        }
    }
}

/// One run of tokens `t0..t0 + run` (widened in `kf`/`vf` from row 0) for query block `b`
/// (`qp` padded queries): score tiles, the online-softmax update and `P · V` into the block's
/// outputs.
///
/// # Safety
/// AVX2 and FMA; `run <= RUN`; rows `0..run.next_multiple_of(NT)` of `kf` hold finite values
/// and rows `0..run` of `vf` the run's V; block `b`'s state in `s` sized for `qp <= QBLK`
/// queries of `hd` (a multiple of 16).
#[target_feature(enable = "avx2,fma")]
unsafe fn block_run(
    s: &mut Scratch,
    b: usize,
    qp: usize,
    hd: usize,
    t0: usize,
    run: usize,
    blk: &Block,
) {
    let (sb, ob) = (b * QBLK, b * QBLK * hd);
    assert!(run <= RUN && qp <= QBLK && s.qt.len() >= ob + hd * qp);
    let runp = run.next_multiple_of(NT);
    // Scores of the run (padding tokens run..runp included; the update skips them).
    let qt = s.qt[ob..].as_ptr();
    let mut tt = 0;
    while tt < runp {
        let mut c = 0;
        while c < qp {
            // SAFETY: tokens tt..tt+NT <= runp <= RUN rows of `kf`; queries c..c+16 <= qp
            // columns of the block's `qt` (hd rows, asserted above) and of `st` (RUN rows of
            // qp).
            unsafe {
                score_tile(
                    qt.add(c),
                    qp,
                    s.kf.as_ptr().add(tt * hd),
                    hd,
                    s.st.as_mut_ptr().add(tt * qp + c),
                )
            };
            c += 16;
        }
        tt += NT;
    }
    // SAFETY: run <= RUN rows of qp scores; the block's state vectors hold qp >= 8 floats
    // from sb.
    unsafe { update(s, sb, qp, t0, run, t0 + run > blk.first_masked) };
    let mut c = 0;
    while c < qp {
        let n = (qp - c).min(6);
        // SAFETY: queries c..c+n <= qp rows of the block's `o` and columns of `st`; run rows
        // of `vf`.
        unsafe {
            match n {
                6 => pv_tile::<6>(s, sb, ob, qp, c, run, hd),
                4 => pv_tile::<4>(s, sb, ob, qp, c, run, hd),
                _ => pv_tile::<2>(s, sb, ob, qp, c, run, hd),
            }
        }
        c += n;
    }
}

/// Widens `n` (a multiple of 8) bf16 at `src` into fp32 at `dst`, in order.
///
/// # Safety
/// AVX2; `n` bf16 readable at `src`, `n` floats writable at `dst`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn widen(src: *const u16, dst: *mut f32, n: usize) {
    let mut i = 0;
    while i < n {
        // SAFETY: i + 8 <= n elements on both sides.
        unsafe {
            let h = _mm_loadu_si128(src.add(i).cast::<__m128i>());
            let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
            _mm256_storeu_ps(dst.add(i), _mm256_castsi256_ps(w));
        }
        i += 8;
    }
}

/// `st[r * qp + x] = Σ_d kf[r * hd + d] · qt[d * qp + x]` for tokens `r < NT`, queries
/// `x < 16` (pointers at the tile's first token and query).
///
/// # Safety
/// AVX2 and FMA; `NT` rows of `hd` floats at `kf`; `hd` rows of 16 floats `qp` apart at `qt`;
/// `NT` rows of 16 floats `qp` apart writable at `st`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn score_tile(qt: *const f32, qp: usize, kf: *const f32, hd: usize, st: *mut f32) {
    let mut acc = [[_mm256_setzero_ps(); 2]; NT];
    for d in 0..hd {
        // SAFETY: row d of the query tile and element d of each token row (contract).
        unsafe {
            let a = _mm256_loadu_ps(qt.add(d * qp));
            let b = _mm256_loadu_ps(qt.add(d * qp + 8));
            for (r, ar) in acc.iter_mut().enumerate() {
                let k = _mm256_broadcast_ss(&*kf.add(r * hd + d));
                ar[0] = _mm256_fmadd_ps(k, a, ar[0]);
                ar[1] = _mm256_fmadd_ps(k, b, ar[1]);
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        // SAFETY: row r of the score tile (contract).
        unsafe {
            _mm256_storeu_ps(st.add(r * qp), ar[0]);
            _mm256_storeu_ps(st.add(r * qp + 8), ar[1]);
        }
    }
}

/// The online-softmax update of the run's scores `st[i * qp + c]` (`i < run`, tokens
/// `t0 + i`) for the block whose state starts at `sb`, eight queries at a time: tokens at or past a query's limit are masked (only
/// checked when `masked`), the scores become `P = exp(s - m_new)` (0 where masked), and `m`,
/// `l` and the outputs' rescale factor `corr = e^(m_old - m_new)` (0 while `m_old` is minus
/// infinity) are updated. A NaN score is skipped by the max and makes `P` and the sum NaN, as
/// on the other paths.
///
/// # Safety
/// AVX2 and FMA; `qp` a multiple of 8, `sb + qp` at most the state vectors' length; `run * qp
/// <= st.len()`.
#[target_feature(enable = "avx2,fma")]
unsafe fn update(s: &mut Scratch, sb: usize, qp: usize, t0: usize, run: usize, masked: bool) {
    assert!(
        qp.is_multiple_of(8)
            && sb + qp <= s.m.len().min(s.l.len()).min(s.corr.len()).min(s.lim.len())
    );
    assert!(run * qp <= s.st.len());
    let sp = s.st.as_mut_ptr();
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in (0..qp).step_by(8) {
        // SAFETY: i * qp + c + 8 <= run * qp <= st.len(); sb + c + 8 <= sb + qp for the state
        // vectors (asserted above).
        unsafe {
            let lim = _mm256_loadu_ps(s.lim.as_ptr().add(sb + c));
            let valid = |i: usize| {
                if masked {
                    _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_set1_ps((t0 + i) as f32), lim)
                } else {
                    _mm256_castsi256_ps(_mm256_set1_epi32(-1))
                }
            };
            let mut mx = ninf;
            for i in 0..run {
                let v = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sp.add(i * qp + c)), valid(i));
                // `max` returns its second operand when the first is NaN: NaN scores skipped.
                mx = _mm256_max_ps(v, mx);
            }
            let mo = _mm256_loadu_ps(s.m.as_ptr().add(sb + c));
            let mn = _mm256_max_ps(mx, mo);
            let first = _mm256_cmp_ps::<_CMP_EQ_OQ>(mo, ninf);
            let corr = _mm256_andnot_ps(first, exp256(_mm256_sub_ps(mo, mn)));
            let mut sum = _mm256_setzero_ps();
            for i in 0..run {
                let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sp.add(i * qp + c)), mn));
                let p = _mm256_and_ps(valid(i), e);
                _mm256_storeu_ps(sp.add(i * qp + c), p);
                sum = _mm256_add_ps(sum, p);
            }
            let l = _mm256_loadu_ps(s.l.as_ptr().add(sb + c));
            _mm256_storeu_ps(s.l.as_mut_ptr().add(sb + c), _mm256_fmadd_ps(l, corr, sum));
            _mm256_storeu_ps(s.m.as_mut_ptr().add(sb + c), mn);
            _mm256_storeu_ps(s.corr.as_mut_ptr().add(sb + c), corr);
        }
    }
}

/// `o[c + j] = o[c + j] · corr[c + j] + Σ_{i < run} st[i * qp + c + j] · vf[i]` for `j < MQ`,
/// 16 output lanes at a time held in registers across the run; the block's outputs start at
/// `ob` of `o`, its rescale factors at `sb` of `corr`.
///
/// # Safety
/// AVX2 and FMA; `c + MQ <= qp`; `hd` a multiple of 16; `run * hd <= vf.len()`, `run * qp <=
/// st.len()`, `ob + qp * hd <= o.len()`, `sb + qp <= corr.len()`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // register blocks indexed by query
unsafe fn pv_tile<const MQ: usize>(
    s: &mut Scratch,
    sb: usize,
    ob: usize,
    qp: usize,
    c: usize,
    run: usize,
    hd: usize,
) {
    assert!(
        c + MQ <= qp
            && run * hd <= s.vf.len()
            && run * qp <= s.st.len()
            && ob + qp * hd <= s.o.len()
            && sb + qp <= s.corr.len()
    );
    let corr: [__m256; MQ] = std::array::from_fn(|j| _mm256_set1_ps(s.corr[sb + c + j]));
    let (vf, st, o) = (s.vf.as_ptr(), s.st.as_ptr(), s.o[ob..].as_mut_ptr());
    let mut dc = 0;
    while dc < hd {
        // SAFETY: (c + j) * hd + dc + 16 <= qp * hd from `ob`; i * hd + dc + 16 <= run * hd;
        // i * qp + c + j < run * qp (asserted above).
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; MQ];
            for j in 0..MQ {
                let at = o.add((c + j) * hd + dc);
                acc[j][0] = _mm256_mul_ps(_mm256_loadu_ps(at), corr[j]);
                acc[j][1] = _mm256_mul_ps(_mm256_loadu_ps(at.add(8)), corr[j]);
            }
            for i in 0..run {
                let v0 = _mm256_loadu_ps(vf.add(i * hd + dc));
                let v1 = _mm256_loadu_ps(vf.add(i * hd + dc + 8));
                for j in 0..MQ {
                    let p = _mm256_broadcast_ss(&*st.add(i * qp + c + j));
                    acc[j][0] = _mm256_fmadd_ps(p, v0, acc[j][0]);
                    acc[j][1] = _mm256_fmadd_ps(p, v1, acc[j][1]);
                }
            }
            for j in 0..MQ {
                let at = o.add((c + j) * hd + dc);
                _mm256_storeu_ps(at, acc[j][0]);
                _mm256_storeu_ps(at.add(8), acc[j][1]);
            }
        }
        dc += 16;
    }
}
