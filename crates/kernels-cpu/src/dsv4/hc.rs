//! Hyper-connections (`docs/dsv4.md`, "hc_pre", "hc_post"): the residual is `hc` streams of
//! `d` values per token; a sub-layer reads one mixed stream and writes its output back into
//! every stream.
//!
//! `hc_pre` is three kernels so a task can batch the expensive part: [`hc_mix_logits`] (the
//! `hc_mix × hc·d` projection of every token, the only one that streams weights; also as its
//! two factors [`hc_mix_dots`] and [`hc_inv_rms`], so a task graph can split the weight rows),
//! [`hc_weights`] (sigmoids and Sinkhorn on a token's `hc_mix` logits, scalar: 24 values) and
//! [`hc_mix_streams`] (the weighted sum of the streams, rounded half up to bf16).
//!
//! A token's hyper-connection weights are one `[hc_mix]` row, `hc_mix = (2 + hc) · hc`:
//! `pre [hc] | post [hc] | comb [hc, hc]` (`comb[i][o]`: from stream `i` into stream `o`).

use super::norm::inv_rms_f64;
use crate::multiversion::multiversion;

/// Weights per token of `hc` streams: `pre`, `post` and the `hc × hc` mixing matrix.
pub const fn hc_mix_len(hc: usize) -> usize {
    (2 + hc) * hc
}

/// The mix logits of `rows` tokens: for token `t` (`x` row `t`, `n = hc·d` values) and mix
/// row `m` (`w` row `m`, `n` values), `out[t, m] = (Σ x·w[m]) / sqrt(mean(x²) + eps)` — the
/// token's [`hc_inv_rms`] times its [`hc_mix_dots`] (so a task graph may take the two apart).
///
/// # Panics
/// If `w.len()` is not a multiple of `n`, or `x` and `out` do not hold the same number of
/// rows (`x.len() / n == out.len() / (w.len() / n)`).
pub fn hc_mix_logits(x: &[f32], n: usize, w: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        n > 0 && w.len().is_multiple_of(n) && x.len().is_multiple_of(n),
        "hc_mix_logits: x len {}, w len {} for rows of {n}",
        x.len(),
        w.len()
    );
    let m = w.len() / n;
    assert_eq!(out.len(), x.len() / n * m, "hc_mix_logits: out len");
    if m == 0 {
        return;
    }
    hc_mix_dots(x, n, w, out, m);
    for (xr, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(m)) {
        let inv = hc_inv_rms(xr, eps);
        for v in o {
            *v *= inv;
        }
    }
}

/// `1 / sqrt(mean(x²) + eps)` of one token's `hc · d` values, the mean in f64 rounded to f32
/// once: the factor [`hc_mix_logits`] applies to the token's [`hc_mix_dots`].
pub fn hc_inv_rms(x: &[f32], eps: f32) -> f32 {
    inv_rms_f64(x, eps)
}

/// [`hc_inv_rms`] of each of `out.len()` tokens (`x` rows of `n` values), bit for bit, the
/// tokens' sums interleaved so their chains of adds overlap: [`super::rms_inv_rows`] under the
/// name the hyper-connection kernels go by.
///
/// # Panics
/// If `x` is not `out.len()` rows of `n`.
pub fn hc_inv_rms_rows(x: &[f32], n: usize, eps: f32, out: &mut [f32]) {
    super::norm::rms_inv_rows(x, n, eps, out)
}

/// Weight rows and tokens of one register block of [`hc_mix_dots`]: eight independent f64
/// accumulators of four lanes cover the latency of the adds that one dot product's single
/// chain waits on, and each converted chunk is used two or four times.
const MIX_ROWS: usize = 2;
const MIX_TOKENS: usize = 4;
/// Weight rows per block for tokens left over from whole blocks of [`MIX_TOKENS`].
const MIX_ROWS_ALONE: usize = 8;

multiversion! {
    /// The raw mix products of `rows` tokens: `out[t · ld_out + j] = f32(Σ x[t]·w[j])` for
    /// every token `t` (`x` row `t`, `n` values) and weight row `j` (`w` row `j`). Each sum
    /// runs in f64 in four lanes (lane `i` adds the products of values `i, i + 4, ...` in
    /// order; the lanes combine as `(l0 + l2) + (l1 + l3)`, then the `n % 4` tail in order):
    /// the mixed stream is rounded to bf16 right after, and an fp32 sum over `hc · d` values
    /// errs enough to flip some of those roundings. A product of two f32 is exact in f64, so
    /// a fused multiply-add gives the bits of a multiply then an add. Tokens and weight rows
    /// are taken in register blocks (2 rows × 4 tokens, 6 × 2 in the chunked form of more
    /// than four tokens). Where the CPU has AVX-512 the blocks run in 512-bit registers (two
    /// tokens' lanes per register), with the same sums.
    ///
    /// # Panics
    /// If `n` is 0, `w.len()` or `x.len()` is not a multiple of `n`, `ld_out` is less than
    /// `w`'s row count, or `out` is shorter than `rows` rows of `ld_out`.
    pub fn hc_mix_dots(x: &[f32], n: usize, w: &[f32], out: &mut [f32], ld_out: usize) {
        assert!(n > 0 && w.len().is_multiple_of(n), "hc_mix_dots: w len {} for rows of {n}", w.len());
        assert!(x.len().is_multiple_of(n), "hc_mix_dots: x len {} for rows of {n}", x.len());
        let (rows, m) = (x.len() / n, w.len() / n);
        assert!(ld_out >= m, "hc_mix_dots: ld_out {ld_out} < {m} weight rows");
        assert!(
            rows == 0 || (rows - 1).checked_mul(ld_out).and_then(|o| o.checked_add(m)).is_some_and(|need| out.len() >= need),
            "hc_mix_dots: out len {}",
            out.len()
        );
        let xr = |t: usize| &x[t * n..(t + 1) * n];
        let wr = |j: usize| &w[j * n..(j + 1) * n];
        #[cfg(target_arch = "x86_64")]
        let wide = crate::isa::Isa::current() >= crate::isa::Isa::Avx512Bf16;
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        // Several token blocks: each weight value converted once for all of them (on AVX-512
        // in 6-row blocks of 512-bit registers); one block against several row pairs: each
        // token value converted once for all of those (on AVX-512 the 2 × 4 blocks below
        // convert a weight quad once for two tokens' lanes and keep their path).
        if rows > MIX_TOKENS {
            // SAFETY: `wide` is set above only where the CPU has AVX-512 (`Isa::current()`).
            unsafe { mix_chunked(x, n, w, out, ld_out, wide) };
            return;
        }
        if !wide && rows > 0 && m > MIX_ROWS {
            mix_few_tokens(x, n, w, out, ld_out);
            return;
        }
        let mut t0 = 0;
        while t0 < rows {
            let tb = (rows - t0).min(MIX_TOKENS);
            let per = if tb == MIX_TOKENS { MIX_ROWS } else { MIX_ROWS_ALONE };
            let mut j0 = 0;
            while j0 < m {
                let jb = (m - j0).min(per);
                let mut put = |r: usize, t: usize, v: f64| out[(t0 + t) * ld_out + j0 + r] = v as f32;
                if (jb, tb) == (MIX_ROWS, MIX_TOKENS) {
                    let xs = std::array::from_fn(|t| xr(t0 + t));
                    let ws = std::array::from_fn(|r| wr(j0 + r));
                    #[cfg(target_arch = "x86_64")]
                    let s = if wide {
                        // SAFETY: `Isa::current` is Avx512Bf16 or wider only on a CPU with
                        // AVX-512 F; every row is `n` long.
                        unsafe { mix_block_avx512(xs, ws) }
                    } else {
                        mix_block::<MIX_ROWS, MIX_TOKENS>(xs, ws)
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    let s = mix_block::<MIX_ROWS, MIX_TOKENS>(xs, ws);
                    for (r, st) in s.iter().enumerate() {
                        for (t, &v) in st.iter().enumerate() {
                            put(r, t, v);
                        }
                    }
                } else if jb == MIX_ROWS_ALONE {
                    for t in 0..tb {
                        let s = mix_block::<MIX_ROWS_ALONE, 1>([xr(t0 + t)], std::array::from_fn(|r| wr(j0 + r)));
                        for (r, st) in s.iter().enumerate() {
                            put(r, t, st[0]);
                        }
                    }
                } else {
                    for r in 0..jb {
                        for t in 0..tb {
                            put(r, t, mix_block::<1, 1>([xr(t0 + t)], [wr(j0 + r)])[0][0]);
                        }
                    }
                }
                j0 += jb;
            }
            t0 += tb;
        }
    }
}

/// Most values of a weight row converted to f64 at a time by [`mix_chunked`].
const MIX_CHUNK: usize = 256;

/// Bytes of converted weight values a chunk of [`mix_chunked`] may take, so that they stay in
/// L1 while every token block reads them: the FLASH attention step's 6 weight rows per task
/// take chunks of [`MIX_CHUNK`] (12 KiB), the MoE step's 24 rows chunks of 84 values.
const MIX_CHUNK_BYTES: usize = 16 << 10;

/// Weight rows and tokens of one register block of [`mix_chunked`]: twelve accumulators, two
/// tokens' values converted once for all six rows (the attention steps' `HC_MIX` tasks hold
/// six rows, so each token value is converted once per task), the rows' converted values
/// read as memory operands of the multiply-adds. On Zen 3 (`examples/dsv4_hc`, one thread,
/// warm) 190–191 us for the FLASH mix; 2 × 4 blocks (each token value converted once per
/// pair of rows) 212–215, and 3 × 3 took 208–213 us, 4 × 2 and 3 × 2 ~230, 2 × 3 ~245; 3 × 4
/// spilled accumulators (330).
const CHUNK_ROWS: usize = 6;
const CHUNK_TOKENS: usize = 2;

/// Weight rows of one register block of [`mix_few_tokens`] (× [`MIX_TOKENS`] tokens): there
/// the tokens' values are converted already and each pair of rows' quads is converted once
/// for four tokens.
const FEW_ROWS: usize = 2;

/// [`hc_mix_dots`] with each weight value converted to f64 once: `k` in chunks of at most
/// [`MIX_CHUNK`] values ([`MIX_CHUNK_BYTES`] for all rows), each weight row's chunk converted
/// into scratch, then register blocks of
/// [`CHUNK_ROWS`] rows × [`CHUNK_TOKENS`] tokens (accumulators kept in memory between chunks)
/// convert each token's values once per block and read the rows' converted chunks. The 2 × 4
/// blocks of [`mix_block`] converted each token's values once per pair of weight rows and each
/// row's once per four tokens (six conversions per eight fused multiply-adds): on Zen 3 the
/// FLASH step's mix (8 tokens × 24 rows × 16384, four tasks) took 368 us on one thread, these
/// blocks 208–218 us. With one block of tokens or fewer (the MoE step's `hc_pre` blocks of 4
/// tokens against 24 rows) each weight value is converted once anyway and the rows' scratch
/// only added stores (the phase took 1.2× the time): those calls take [`mix_few_tokens`].
/// Each lane adds the same products in the same order as before: the sums are bit for bit
/// the same.
///
/// With `wide` (the CPU has AVX-512 F) the blocks are [`chunk_block_avx512`]'s: up to
/// [`WIDE_ROWS`] rows × 4 tokens in 512-bit registers.
///
/// # Safety
/// `wide` only where the CPU has AVX-512 F (`Isa::current() >= Isa::Avx512Bf16`).
#[inline(always)]
unsafe fn mix_chunked(x: &[f32], n: usize, w: &[f32], out: &mut [f32], ld_out: usize, wide: bool) {
    let (rows, m) = (x.len() / n, w.len() / n);
    let body = n / 4 * 4;
    let chunk = (MIX_CHUNK_BYTES / (8 * m.max(1)) / 4 * 4).clamp(4, MIX_CHUNK);
    let ch4 = chunk / 4;
    // acc[j * rows + t]: the four lanes of token `t` against weight row `j`.
    let mut acc = vec![[0.0f64; 4]; rows * m];
    let mut wf = vec![[0.0f64; 4]; m * ch4];
    let mut c0 = 0;
    while c0 < body {
        let len = chunk.min(body - c0);
        let q = len / 4;
        convert_chunks(w, n, c0..c0 + len, &mut wf, ch4);
        let xs = |t: usize| &x[t * n + c0..t * n + c0 + len].as_chunks::<4>().0[..q];
        let ws = |j: usize| &wf[j * ch4..j * ch4 + q];
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: `wide` only where the CPU has AVX-512 F (this function's contract).
            unsafe { chunk_blocks_avx512(&mut acc, (rows, m, q), xs, ws) };
            c0 += len;
            continue;
        }
        let _ = wide;
        chunk_blocks::<CHUNK_ROWS, CHUNK_TOKENS, _, _>(&mut acc, (rows, m, q), xs, ws);
        c0 += len;
    }
    write_mix(&acc, (x, w, n), out, ld_out);
}

/// Weight rows per register block of [`chunk_block_avx512`]: six rows × two registers of
/// two tokens' lanes are twelve accumulators, each converted pair of tokens feeds six
/// multiply-adds and each weight quad (converted already) is one broadcast load, so the
/// block is bound by its multiply-adds, where the 2 × 4 blocks of [`mix_block_avx512`]
/// spent about three shuffle or conversion operations per multiply-add (the FLASH SWA step's
/// mix: `docs/dsv4.md`, "hc_pre on the runtime").
#[cfg(target_arch = "x86_64")]
const WIDE_ROWS: usize = 6;

/// [`chunk_blocks`] on AVX-512: blocks of 4 tokens run [`chunk_block_avx512`] over up to
/// [`WIDE_ROWS`] rows, fewer tokens the portable blocks. Same products in the same order.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn chunk_blocks_avx512<'a>(
    acc: &mut [[f64; 4]],
    (rows, m, q): (usize, usize, usize),
    xs: impl Fn(usize) -> &'a [[f32; 4]],
    ws: impl Fn(usize) -> &'a [[f64; 4]],
) {
    let mut j0 = 0;
    while j0 < m {
        let jb = (m - j0).min(WIDE_ROWS);
        let mut t0 = 0;
        while t0 + MIX_TOKENS <= rows {
            let x = std::array::from_fn(|t| xs(t0 + t));
            macro_rules! rows {
                ($($r:literal)*) => {
                    match jb {
                        // SAFETY: AVX-512 F by this function's contract.
                        $($r => unsafe {
                            chunk_block_avx512::<$r>(acc, rows, (j0, t0), x, std::array::from_fn(|r| ws(j0 + r)), q)
                        },)*
                        _ => unreachable!("{jb} rows past {WIDE_ROWS}"),
                    }
                };
            }
            rows!(1 2 3 4 5 6);
            t0 += MIX_TOKENS;
        }
        for t in t0..rows {
            for r in j0..j0 + jb {
                chunk_block::<1, 1, _, _>(acc, rows, (r, t), [xs(t)], [ws(r)], q);
            }
        }
        j0 += jb;
    }
}

/// One register block of the chunked mix on AVX-512: `R` weight rows × 4 tokens, a register
/// holding two tokens' four lanes (token `2p` in lanes 0–3, `2p + 1` in 4–7) against one
/// row. Each lane adds, in order, the same exact f64 products as [`chunk_block`] (a fused
/// multiply-add of an exact product rounds once, as the add does), so the sums are bit for
/// bit the same; `acc` holds the lanes between chunks.
///
/// # Safety
/// The CPU has AVX-512 F.
///
/// # Panics
/// If a token's or row's chunk is shorter than `q` quads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn chunk_block_avx512<const R: usize>(
    acc: &mut [[f64; 4]],
    rows: usize,
    (j0, t0): (usize, usize),
    x: [&[[f32; 4]]; 4],
    w: [&[[f64; 4]]; R],
    q: usize,
) {
    use std::arch::x86_64::*;
    assert!(x.iter().all(|s| s.len() >= q) && w.iter().all(|s| s.len() >= q));
    let at = |r: usize, t: usize| (j0 + r) * rows + t0 + t;
    let mut a: [[__m512d; 2]; R] = std::array::from_fn(|r| {
        std::array::from_fn(|p| {
            let (lo, hi) = (acc[at(r, 2 * p)], acc[at(r, 2 * p + 1)]);
            // SAFETY: two arrays of four f64 each.
            unsafe {
                _mm512_insertf64x4::<1>(
                    _mm512_castpd256_pd512(_mm256_loadu_pd(lo.as_ptr())),
                    _mm256_loadu_pd(hi.as_ptr()),
                )
            }
        })
    });
    for c in 0..q {
        // SAFETY: quad `c < q` of each token's and row's chunk (asserted above).
        let four = |t: usize| unsafe { _mm_loadu_ps(x[t].get_unchecked(c).as_ptr()) };
        let xp = [
            _mm512_cvtps_pd(_mm256_set_m128(four(1), four(0))),
            _mm512_cvtps_pd(_mm256_set_m128(four(3), four(2))),
        ];
        for (ar, wr) in a.iter_mut().zip(&w) {
            // SAFETY: as above.
            let wv =
                unsafe { _mm512_broadcast_f64x4(_mm256_loadu_pd(wr.get_unchecked(c).as_ptr())) };
            ar[0] = _mm512_fmadd_pd(xp[0], wv, ar[0]);
            ar[1] = _mm512_fmadd_pd(xp[1], wv, ar[1]);
        }
    }
    for (r, ar) in a.iter().enumerate() {
        for (p, &v) in ar.iter().enumerate() {
            let mut l = [0.0f64; 8];
            // SAFETY: `l` holds eight f64.
            unsafe { _mm512_storeu_pd(l.as_mut_ptr(), v) };
            acc[at(r, 2 * p)].copy_from_slice(&l[..4]);
            acc[at(r, 2 * p + 1)].copy_from_slice(&l[4..]);
        }
    }
}

/// [`hc_mix_dots`] for one block of tokens (at most [`MIX_TOKENS`]) against several pairs of
/// weight rows: `k` in chunks of [`MIX_CHUNK`], the tokens' chunk converted to f64 once into
/// scratch, the weight rows converted in the loop (each value once, for every token). The
/// 2 × 4 blocks of [`mix_block`] converted every token value again for each pair of rows
/// (the MoE step's `hc_pre` blocks: 4 tokens against 24 rows, twelve times; its phase took
/// 234–271 us, now 192–217 on Zen 3). Same products in the same order as every path: the
/// same bits.
#[inline(always)]
fn mix_few_tokens(x: &[f32], n: usize, w: &[f32], out: &mut [f32], ld_out: usize) {
    let (rows, m) = (x.len() / n, w.len() / n);
    let body = n / 4 * 4;
    let ch4 = MIX_CHUNK / 4;
    let mut acc = vec![[0.0f64; 4]; rows * m];
    let mut xf = vec![[0.0f64; 4]; rows * ch4];
    let mut c0 = 0;
    while c0 < body {
        let len = MIX_CHUNK.min(body - c0);
        let q = len / 4;
        convert_chunks(x, n, c0..c0 + len, &mut xf, ch4);
        let xs = |t: usize| &xf[t * ch4..t * ch4 + q];
        let ws = |j: usize| &w[j * n + c0..j * n + c0 + len].as_chunks::<4>().0[..q];
        chunk_blocks::<FEW_ROWS, MIX_TOKENS, _, _>(&mut acc, (rows, m, q), xs, ws);
        c0 += len;
    }
    write_mix(&acc, (x, w, n), out, ld_out);
}

/// Converts values `cols` of every row of `src` (rows of `n`) to f64 into `dst`, row `i` at
/// `dst[i * stride..]`: element by element over flat views, one widening per vector.
#[inline(always)]
fn convert_chunks(
    src: &[f32],
    n: usize,
    cols: std::ops::Range<usize>,
    dst: &mut [[f64; 4]],
    stride: usize,
) {
    let q = cols.len() / 4;
    for (i, row) in src.chunks_exact(n).enumerate() {
        let d = dst[i * stride..i * stride + q].as_flattened_mut();
        for (d, &v) in d.iter_mut().zip(&row[cols.clone()]) {
            *d = f64::from(v);
        }
    }
}

/// Every register block of one chunk of `q` quads: up to `CR` weight rows × `CT` tokens at a
/// time (the caller's shape: [`CHUNK_ROWS`] × [`CHUNK_TOKENS`] or [`FEW_ROWS`] ×
/// [`MIX_TOKENS`]), `xs(t)` and `ws(j)` the chunk's quads of token `t` and weight row `j`.
#[inline(always)]
fn chunk_blocks<'a, const CR: usize, const CT: usize, X: Quad + 'a, W: Quad + 'a>(
    acc: &mut [[f64; 4]],
    (rows, m, q): (usize, usize, usize),
    xs: impl Fn(usize) -> X,
    ws: impl Fn(usize) -> W,
) {
    let mut j0 = 0;
    while j0 < m {
        let jb = (m - j0).min(CR);
        let mut t0 = 0;
        while t0 < rows {
            let tb = (rows - t0).min(CT);
            macro_rules! blocks {
                ($(($r:literal, $t:literal)),*) => {
                    match (jb, tb) {
                        $(($r, $t) => chunk_block::<$r, $t, _, _>(
                            acc,
                            rows,
                            (j0, t0),
                            std::array::from_fn(|t| xs(t0 + t)),
                            std::array::from_fn(|r| ws(j0 + r)),
                            q,
                        ),)*
                        _ => unreachable!("block {jb} x {tb} past {CR} x {CT}"),
                    }
                };
            }
            blocks!(
                (1, 1),
                (1, 2),
                (2, 1),
                (2, 2),
                (3, 1),
                (3, 2),
                (4, 1),
                (4, 2),
                (5, 1),
                (5, 2),
                (6, 1),
                (6, 2),
                (1, 3),
                (1, 4),
                (2, 3),
                (2, 4)
            );
            t0 += tb;
        }
        j0 += jb;
    }
}

/// `out[t · ld_out + j]`: the lanes `acc[j * rows + t]` combined with the row's tail as
/// [`hc_mix_dots`] promises.
#[inline(always)]
fn write_mix(acc: &[[f64; 4]], (x, w, n): (&[f32], &[f32], usize), out: &mut [f32], ld_out: usize) {
    let (rows, body) = (x.len() / n, n / 4 * 4);
    for (j, wr) in w.chunks_exact(n).enumerate() {
        for (t, xr) in x.chunks_exact(n).enumerate() {
            out[t * ld_out + j] = lanes_and_tail(&acc[j * rows + t], xr, wr, body) as f32;
        }
    }
}

/// Four consecutive values of a row as f64: converted ones read back, or f32 ones converted
/// on the spot.
trait Quad: Copy {
    fn quad(self, c: usize) -> [f64; 4];
}

impl Quad for &[[f64; 4]] {
    #[inline(always)]
    fn quad(self, c: usize) -> [f64; 4] {
        self[c]
    }
}

impl Quad for &[[f32; 4]] {
    #[inline(always)]
    fn quad(self, c: usize) -> [f64; 4] {
        self[c].map(f64::from)
    }
}

/// One register block of the chunked mix over `q` quads: `acc[(j0 + r) * rows + t0 + t]`
/// gains, lane by lane in order, the products of token `t`'s values `x[t]` and weight row
/// `r`'s `w[r]` (each side converted already or converted here).
#[inline(always)]
fn chunk_block<const R: usize, const T: usize, X: Quad, W: Quad>(
    acc: &mut [[f64; 4]],
    rows: usize,
    (j0, t0): (usize, usize),
    x: [X; T],
    w: [W; R],
    q: usize,
) {
    let mut a: [[[f64; 4]; T]; R] =
        std::array::from_fn(|r| std::array::from_fn(|t| acc[(j0 + r) * rows + t0 + t]));
    for c in 0..q {
        let xv: [[f64; 4]; T] = std::array::from_fn(|t| x[t].quad(c));
        for r in 0..R {
            let wv = w[r].quad(c);
            for t in 0..T {
                for i in 0..4 {
                    a[r][t][i] = xv[t][i].mul_add(wv[i], a[r][t][i]);
                }
            }
        }
    }
    for (r, ar) in a.iter().enumerate() {
        for (t, &v) in ar.iter().enumerate() {
            acc[(j0 + r) * rows + t0 + t] = v;
        }
    }
}

/// `Σ x[t]·w[r]` for every pair of a register block (rows of equal length), each summed as
/// [`hc_mix_dots`] describes.
#[inline(always)]
fn mix_block<const R: usize, const T: usize>(x: [&[f32]; T], w: [&[f32]; R]) -> [[f64; T]; R] {
    let n = x[0].len();
    let body = n / 4 * 4;
    let xb: [&[f32]; T] = x.map(|r| &r[..body]);
    let wb: [&[f32]; R] = w.map(|r| &r[..body]);
    let mut acc = [[[0.0f64; 4]; T]; R];
    for c in (0..body).step_by(4) {
        let xc: [[f64; 4]; T] =
            std::array::from_fn(|t| std::array::from_fn(|i| f64::from(xb[t][c + i])));
        for r in 0..R {
            let wc: [f64; 4] = std::array::from_fn(|i| f64::from(wb[r][c + i]));
            for t in 0..T {
                for i in 0..4 {
                    acc[r][t][i] = xc[t][i].mul_add(wc[i], acc[r][t][i]);
                }
            }
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|t| lanes_and_tail(&acc[r][t], x[t], w[r], body)))
}

/// One dot product's four lanes combined as [`hc_mix_dots`] promises, `(l0 + l2) + (l1 + l3)`,
/// plus the products from `body` on, in order.
#[inline(always)]
fn lanes_and_tail(a: &[f64; 4], x: &[f32], w: &[f32], body: usize) -> f64 {
    let tail: f64 = x[body..]
        .iter()
        .zip(&w[body..])
        .map(|(&p, &q)| f64::from(p) * f64::from(q))
        .sum();
    (a[0] + a[2]) + (a[1] + a[3]) + tail
}

/// [`mix_block`] for the 2-row × 4-token block in 512-bit registers: a register holds the
/// four lanes of two tokens (token `2p` in lanes 0–3, `2p + 1` in 4–7) against one weight
/// row, whose four values are converted once and used for both halves. Each lane adds the
/// same products in the same order as [`mix_block`] (fused multiply-add of an exact f64
/// product), so the sums are bit for bit the same, at half the multiply-adds and conversions.
///
/// # Safety
/// The CPU has AVX-512 F.
///
/// # Panics
/// If the rows do not all have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn mix_block_avx512(x: [&[f32]; 4], w: [&[f32]; 2]) -> [[f64; 4]; 2] {
    use std::arch::x86_64::*;
    let n = x[0].len();
    assert!(
        x.iter().all(|r| r.len() == n) && w.iter().all(|r| r.len() == n),
        "mix_block_avx512: row lengths"
    );
    let body = n / 4 * 4;
    // acc[r][p]: tokens 2p and 2p + 1 against weight row r.
    let mut acc = [[_mm512_setzero_pd(); 2]; 2];
    let mut c = 0;
    while c < body {
        // SAFETY: `c + 4 <= body <= n` and every row is `n` long.
        let four = |s: &[f32]| unsafe { _mm_loadu_ps(s.as_ptr().add(c)) };
        let xp = [
            _mm512_cvtps_pd(_mm256_set_m128(four(x[1]), four(x[0]))),
            _mm512_cvtps_pd(_mm256_set_m128(four(x[3]), four(x[2]))),
        ];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let wv = four(w[r]);
            let wr = _mm512_cvtps_pd(_mm256_set_m128(wv, wv));
            for (a, &xv) in acc_r.iter_mut().zip(&xp) {
                *a = _mm512_fmadd_pd(xv, wr, *a);
            }
        }
        c += 4;
    }
    let mut lanes = [[[0.0f64; 4]; 4]; 2];
    for (r, acc_r) in acc.iter().enumerate() {
        for (p, &a) in acc_r.iter().enumerate() {
            let mut v = [0.0f64; 8];
            // SAFETY: `v` holds eight f64.
            unsafe { _mm512_storeu_pd(v.as_mut_ptr(), a) };
            lanes[r][2 * p].copy_from_slice(&v[..4]);
            lanes[r][2 * p + 1].copy_from_slice(&v[4..]);
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|t| lanes_and_tail(&lanes[r][t], x[t], w[r], body)))
}

/// Turns one token's mix logits (`[hc_mix]`) into its weights (same layout, in place):
/// `pre_i = σ(l_i · s0 + b_i) + hc_eps`, `post_i = 2 σ(l_{hc+i} · s1 + b_{hc+i})`, and `comb`
/// the `hc × hc` logits `l · s2 + b` put through [`sinkhorn`] with `iters` iterations.
///
/// # Panics
/// If `mix` or `base` is not `hc_mix_len(hc)` long.
pub fn hc_weights(
    mix: &mut [f32],
    hc: usize,
    scale: [f32; 3],
    base: &[f32],
    iters: usize,
    eps: f32,
) {
    let len = hc_mix_len(hc);
    assert_eq!(mix.len(), len, "hc_weights: mix len");
    assert_eq!(base.len(), len, "hc_weights: base len");
    let sigmoid = |v: f32| 1.0 / (1.0 + (-v).exp());
    for i in 0..hc {
        mix[i] = sigmoid(mix[i] * scale[0] + base[i]) + eps;
        mix[hc + i] = 2.0 * sigmoid(mix[hc + i] * scale[1] + base[hc + i]);
    }
    let comb = &mut mix[2 * hc..];
    for (c, &b) in comb.iter_mut().zip(&base[2 * hc..]) {
        *c = *c * scale[2] + b;
    }
    sinkhorn(comb, hc, iters, eps);
}

/// Sinkhorn normalisation in place of `c` (`[n, n]` logits): row softmax plus `eps`, columns
/// divided by (sum + `eps`), then `iters - 1` rounds of rows and columns, each divided by
/// (sum + `eps`).
///
/// # Panics
/// If `c` is not `n · n` long.
pub fn sinkhorn(c: &mut [f32], n: usize, iters: usize, eps: f32) {
    assert_eq!(c.len(), n * n, "sinkhorn: len");
    if n == 0 {
        return;
    }
    for row in c.chunks_exact_mut(n) {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for v in row.iter_mut() {
            *v = (*v - m).exp();
        }
        let s: f32 = row.iter().sum();
        for v in row.iter_mut() {
            *v = *v / s + eps;
        }
    }
    let cols = |c: &mut [f32]| {
        for o in 0..n {
            let s: f32 = (0..n).map(|i| c[i * n + o]).sum();
            for i in 0..n {
                c[i * n + o] /= s + eps;
            }
        }
    };
    cols(c);
    for _ in 1..iters {
        for row in c.chunks_exact_mut(n) {
            let s: f32 = row.iter().sum();
            for v in row.iter_mut() {
                *v /= s + eps;
            }
        }
        cols(c);
    }
}

/// `bf16(x)` with ties rounded away from zero in magnitude, as f32 (`x_mixed`'s rounding).
#[inline(always)]
pub fn round_bf16_half_up(x: f32) -> f32 {
    if x.is_finite() {
        f32::from_bits(x.to_bits().wrapping_add(0x8000) & 0xFFFF_0000)
    } else {
        crate::convert::round_bf16_f32(x)
    }
}

multiversion! {
    /// The mixed stream of one token: `out[j] = bf16_half_up(Σ_i x[i, j] · pre[i])` over the
    /// `pre.len()` streams of `x` (`[hc, d]`, `d = out.len()`); four streams are summed
    /// pairwise, `(x0 p0 + x1 p1) + (x2 p2 + x3 p3)`, other counts in order.
    ///
    /// # Panics
    /// If `x` is not `pre.len() · out.len()` long.
    pub fn hc_mix_streams(x: &[f32], pre: &[f32], out: &mut [f32]) {
        let (hc, d) = (pre.len(), out.len());
        assert_eq!(x.len(), hc * d, "hc_mix_streams: x len");
        if hc == 4 {
            let (x0, r) = x.split_at(d);
            let (x1, r) = r.split_at(d);
            let (x2, x3) = r.split_at(d);
            for j in 0..d {
                let v = (x0[j] * pre[0] + x1[j] * pre[1]) + (x2[j] * pre[2] + x3[j] * pre[3]);
                out[j] = round_bf16_half_up(v);
            }
            return;
        }
        for (j, o) in out.iter_mut().enumerate() {
            let mut v = 0.0f32;
            for (i, &p) in pre.iter().enumerate() {
                v += x[i * d + j] * p;
            }
            *o = round_bf16_half_up(v);
        }
    }
}

/// Columns per block of [`hc_post`]: one 512-bit register of fp32.
const POST_COLS: usize = 16;

multiversion! {
    avx512;
    /// `hc_post` of one token: `y[o, j] = post[o] · out[j] + Σ_i x[i, j] · comb[i·hc + o]`
    /// (fp32, added in stream order), `x` and `y` `[hc, d]`, `d = out.len()`.
    ///
    /// Each block of 16 columns (`POST_COLS`) makes every output stream's values in registers
    /// and writes them once (the stream-by-stream form read and wrote each output row `hc + 1`
    /// times: 6.4 against 3.7–4.0 µs a token at FLASH, warm, one thread).
    ///
    /// # Panics
    /// If `x` or `y` is not `hc · d` long or `comb` not `hc · hc`.
    pub fn hc_post(x: &[f32], out: &[f32], post: &[f32], comb: &[f32], y: &mut [f32]) {
        let (hc, d) = (post.len(), out.len());
        assert_eq!(x.len(), hc * d, "hc_post: x len");
        assert_eq!(y.len(), hc * d, "hc_post: y len");
        assert_eq!(comb.len(), hc * hc, "hc_post: comb len");
        let body = d / POST_COLS * POST_COLS;
        for j0 in (0..body).step_by(POST_COLS) {
            let oj: &[f32; POST_COLS] = out[j0..j0 + POST_COLS].try_into().expect("a block");
            for o in 0..hc {
                let mut v = [0.0f32; POST_COLS];
                for (vl, &ol) in v.iter_mut().zip(oj) {
                    *vl = post[o] * ol;
                }
                for i in 0..hc {
                    let c = comb[i * hc + o];
                    let xi: &[f32; POST_COLS] =
                        x[i * d + j0..i * d + j0 + POST_COLS].try_into().expect("a block");
                    for (vl, &xl) in v.iter_mut().zip(xi) {
                        *vl += xl * c;
                    }
                }
                y[o * d + j0..o * d + j0 + POST_COLS].copy_from_slice(&v);
            }
        }
        for j in body..d {
            for o in 0..hc {
                let mut v = post[o] * out[j];
                for i in 0..hc {
                    v += x[i * d + j] * comb[i * hc + o];
                }
                y[o * d + j] = v;
            }
        }
    }
}
