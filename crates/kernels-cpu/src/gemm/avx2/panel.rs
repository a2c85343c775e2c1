//! The AVX2 path's prefill GEMM (batches of [`MIN_BATCH`] rows and more): a packed,
//! register-blocked product in the manner of BLIS, instead of the dot-product passes of the
//! decode batches.
//!
//! Why: the dot-product passes widen every weight vector (a shift or a mask) again for each
//! group of four batch rows, and those integer ops share Zen's vector pipes with the FMAs;
//! measured at 42-68% of the FMA rate at 512 rows on a shared Zen 3 host. Here each weight is
//! widened once per call into fp32 and then feeds every batch row: 70-85% in the same runs,
//! 1.2-1.7 times the passes' rate (`examples/gemm_prefill_rate.rs`, `docs/benchmarks.md`).
//!
//! - The `K` body is taken in blocks of [`KC`] = 512 elements and the tile's rows in blocks of
//!   [`NC`] = 64; each such block of weights is widened into a per-thread buffer (`NC × KC`
//!   fp32, 128 KiB) as panels of [`NR`] = 16 rows: panel element `(kp, j)` at `kp * 16 + j` is
//!   row `j` of the panel at the `kp`-th element of the block *in packed order* (the
//!   activations' even/odd permutation of each 16-element block, `pack_acts_bf16`), so the
//!   activations are read straight along their packed rows. The widening is a shift / mask of
//!   16 bf16 (the even and odd halves, already in packed order) and an 8 × 8 transpose per 8
//!   rows and half. Rows past the tile's end are zero.
//! - The micro-kernel (assembly for 6 rows, intrinsics for the last 1-5) keeps [`MR`] = 6
//!   batch rows × 16 columns in 12 `ymm` accumulators; per `K` element it loads the panel's two
//!   vectors and broadcasts each batch row's activation: 12 FMAs per 8 loads, which Zen 3's
//!   load ports sustain at the two FMA pipes' rate.
//! - Loop order: per widened block, per [`MC`] = 72 batch rows (their `MC × KC` activations,
//!   144 KiB, stay in L2), each panel passes under those rows 6 at a time. A call prefetches
//!   the next call's six activation rows line by line (the rows are short streams the hardware
//!   prefetchers would meet cold at each call), and its output lines (read or written only
//!   after the `K` block); the calls of a block spread prefetches of the next block's weights
//!   (otherwise the widening waits on DRAM for each line: a sixth of the time at 144 rows).
//! - Each `K` block's sums are stored (the first block of a `Store` tile) or added to the
//!   output, times the row scale when there is one (so a scaled product over several `K`
//!   blocks rounds the scale per block, within the tests' tolerance); a tile's `K` elements
//!   outside the 16-element body are added last, one sum per output element.
//!
//! The buffer is one per thread, grown once to its fixed size (`NC × KC` fp32, 128 KiB) on the
//! thread's first prefill call and kept for its life; nothing is allocated per call after that.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::super::{Lowered, OutMode, edge_sum};
use crate::simd::transpose8;

/// Batch rows per micro-kernel pass.
pub(super) const MR: usize = 6;
/// Output columns (weight rows) per panel.
pub(super) const NR: usize = 16;
/// `K` elements per block (a multiple of 16). Longer blocks mean fewer passes over the output
/// and longer activation streams per call; measured on the 0.6B prefill shapes at 512 rows
/// (paired in one process): 512 against 256 took 2-10% less time, 1024 no less than 512, 128
/// 5-8% more.
pub(super) const KC: usize = 512;
/// Weight rows per widened block (a multiple of [`NR`]): `NC × KC` fp32 is 128 KiB. 128 or 256
/// rows measured the same.
pub(super) const NC: usize = 64;
/// Batch rows per activation block (a multiple of [`MR`]): each panel in turn passes under
/// these rows' `MC × KC` fp32 (144 KiB, in L2 beside the widened block). 48 to 288 measured
/// within 3% of each other.
pub(super) const MC: usize = 72;

/// Least batch that takes this kernel by default (below it, the dot-product passes): from 64
/// rows it was ahead on every 0.6B shape, level around 48, behind at 32 (`docs/benchmarks.md`).
pub(crate) const MIN_BATCH: usize = 64;

/// `ymm` vectors in the widened block buffer.
const BUF_VECS: usize = NC * KC / 8;

thread_local! {
    /// The calling thread's widened weight block (allocated on its first call).
    static BUF: RefCell<Vec<__m256>> = const { RefCell::new(Vec::new()) };
}

/// Computes the tile described by `lw` into `out`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `lw` must describe a row-major tile inside its matrices
/// with `out` long enough (as checked by `gemm_dispatch`) and a non-empty body (`kb0 < kb1`).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) {
    #[cfg(test)]
    tests::CALLS.with(|c| c.set(c.get() + 1));
    BUF.with_borrow_mut(|buf| {
        if buf.len() < BUF_VECS {
            buf.resize(BUF_VECS, _mm256_setzero_ps());
        }
        // SAFETY: forwarded contract; `buf` holds BUF_VECS vectors.
        unsafe { gemm_with(lw, buf, out, ld_out) }
    });
}

/// [`gemm`] with the thread's buffer.
///
/// # Safety
/// As [`gemm`], with a non-empty body (`kb0 < kb1`, as the AVX2 dispatch sends), and
/// `buf.len() >= BUF_VECS`.
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_with(lw: &Lowered<'_>, buf: &mut [__m256], out: &mut [f32], ld_out: usize) {
    debug_assert!(!lw.tiled && lw.kb1 > lw.kb0 && buf.len() >= BUF_VECS);
    let n = lw.n.clone();
    let out_ptr = out.as_mut_ptr();
    let mut kc0 = lw.kb0;
    while kc0 < lw.kb1 {
        let kc = KC.min(lw.kb1 - kc0);
        let store = kc0 == lw.kb0 && lw.mode == OutMode::Store;
        let mut nc0 = n.start;
        while nc0 < n.end {
            let nc = NC.min(n.end - nc0);
            let panels = nc.div_ceil(NR);
            for p in 0..panels {
                // SAFETY: rows nc0 + p·NR .. + rows lie inside the tile and columns
                // kc0 .. kc0 + kc inside its body; the panel's 2·kc vectors start at
                // p·2·KC < BUF_VECS and end by (p + 1)·2·KC <= BUF_VECS.
                unsafe {
                    widen(
                        lw,
                        nc0 + p * NR,
                        NR.min(nc - p * NR),
                        kc0,
                        kc,
                        buf[p * 2 * KC..].as_mut_ptr(),
                    )
                };
            }
            // The next block's weights: the next rows at this `K` block, else the tile's first
            // rows at the next.
            let (nk0, nn0) = if nc0 + nc < n.end {
                (kc0, nc0 + nc)
            } else {
                (kc0 + kc, n.start)
            };
            let mut next = if nk0 < lw.kb1 {
                let calls = lw.batch.div_ceil(MR) * panels;
                let rows = NC.min(n.end - nn0);
                WeightPrefetch::new(lw, nn0, rows, nk0, KC.min(lw.kb1 - nk0), calls)
            } else {
                WeightPrefetch::none()
            };
            for mb0 in (0..lw.batch).step_by(MC) {
                let mb1 = (mb0 + MC).min(lw.batch);
                for p in 0..panels {
                    let mut b0 = mb0;
                    while b0 < mb1 {
                        let mr = MR.min(mb1 - b0);
                        let tile = Micro {
                            panel: buf[p * 2 * KC..].as_ptr(),
                            x: lw.x[b0 * lw.ldx + kc0..].as_ptr(),
                            ldx: lw.ldx,
                            kc,
                            // `wrapping_add`: only formed here; the micro-kernel writes the
                            // `cols` elements of `mr` rows from it, inside `out` (below).
                            out: out_ptr.wrapping_add(b0 * ld_out + (nc0 + p * NR - n.start)),
                            ld_out,
                            cols: NR.min(nc - p * NR),
                            store,
                            scale: lw.scale.map(|s| s[b0..].as_ptr()),
                        };
                        // SAFETY: the panel holds `kc` widened elements of `cols` rows (zero
                        // past them); batch rows b0 .. b0 + mr have `kc` packed elements from
                        // kc0 inside `lw.x` (kc0 + kc <= kb1 <= ldw < ldx); output rows
                        // b0 .. b0 + mr at columns nc0 + p·NR - n.start .. + cols are inside
                        // the tile, so inside `out` (checked by the dispatch), and the scale
                        // has the batch rows from b0.
                        unsafe { micro_dyn(mr, &tile) };
                        next.step();
                        b0 += mr;
                    }
                }
            }
            nc0 += nc;
        }
        kc0 += kc;
    }
    if lw.has_edges() {
        for b in 0..lw.batch {
            let s = lw.scale.map_or(1.0, |s| s[b]);
            for nn in n.clone() {
                let e = edge_sum(lw, nn, b);
                // The body (never empty here) was stored or added above.
                out[b * ld_out + (nn - n.start)] += e * s;
            }
        }
    }
}

/// Prefetches the weights of the next widened block while the micro-kernel runs on this one,
/// a few lines per call: the widening reads each weight once, from DRAM, and without this it
/// waits on every line (a sizeable share of the time at batches of a few dozen rows).
struct WeightPrefetch {
    /// The block's first element.
    base: *const u16,
    ldw: usize,
    /// Lines per row (one more than the row's `kc` elements fill, for a row off line
    /// alignment), lines in all, lines issued so far, lines per call.
    per_row: usize,
    total: usize,
    at: usize,
    per_call: usize,
}

impl WeightPrefetch {
    /// Rows `n0 .. n0 + rows` over columns `k0 .. k0 + kc`, spread over `calls` steps.
    fn new(lw: &Lowered<'_>, n0: usize, rows: usize, k0: usize, kc: usize, calls: usize) -> Self {
        let per_row = kc / 32 + 1;
        let total = rows * per_row;
        WeightPrefetch {
            base: lw.w.as_ptr().wrapping_add(n0 * lw.ldw + k0),
            ldw: lw.ldw,
            per_row,
            total,
            at: 0,
            per_call: total.div_ceil(calls.max(1)),
        }
    }

    /// Nothing to prefetch.
    fn none() -> Self {
        WeightPrefetch {
            base: std::ptr::null(),
            ldw: 0,
            per_row: 1,
            total: 0,
            at: 0,
            per_call: 0,
        }
    }

    /// Issues the next few lines.
    #[inline]
    fn step(&mut self) {
        let end = (self.at + self.per_call).min(self.total);
        while self.at < end {
            let (r, l) = (self.at / self.per_row, self.at % self.per_row);
            // Prefetch never faults; `wrapping_add` keeps the address computation defined
            // (the last line of a row may lie past the block's columns, still in the matrix
            // or just past it).
            let p = self.base.wrapping_add(r * self.ldw + l * 32);
            // SAFETY: prefetching has no architectural effect; SSE is baseline on x86-64.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast::<i8>()) };
            self.at += 1;
        }
    }
}

/// Widens weight rows `n0 .. n0 + rows` (at most [`NR`]) over columns `k0 .. k0 + kc` into the
/// panel at `dst` (`kc · 16` fp32, packed-order `K`, zero columns past `rows`).
///
/// # Safety
/// AVX2 available; the rows lie inside `lw.w` with columns `k0 .. k0 + kc` whole 16-element
/// packing blocks of the body; `dst` is valid for `2 · kc` vector writes.
#[target_feature(enable = "avx2,fma")]
unsafe fn widen(lw: &Lowered<'_>, n0: usize, rows: usize, k0: usize, kc: usize, dst: *mut __m256) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let base = lw.w.as_ptr();
    for h in 0..2 {
        // Rows of this half of the panel (8 columns); missing rows read as zero.
        let row: [Option<*const u16>; 8] = std::array::from_fn(|j| {
            let r = h * 8 + j;
            (r < rows).then(|| base.wrapping_add((n0 + r) * lw.ldw + k0))
        });
        for kk in (0..kc).step_by(16) {
            let mut even = [_mm256_setzero_ps(); 8];
            let mut odd = [_mm256_setzero_ps(); 8];
            for j in 0..8 {
                if let Some(p) = row[j] {
                    // SAFETY: 16 elements from column k0 + kk of a row inside the tile, inside
                    // the body (kk + 16 <= kc).
                    let raw = unsafe { _mm256_loadu_si256(p.add(kk).cast::<__m256i>()) };
                    even[j] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                    odd[j] = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                }
            }
            // Packed position kp < 8 is the even half's lane kp, 8 + kp the odd half's.
            let even = transpose8(even);
            let odd = transpose8(odd);
            for kp in 0..8 {
                // SAFETY: vectors 2·(kk + kp) + h and 2·(kk + 8 + kp) + h are below 2·kc.
                unsafe {
                    dst.add(2 * (kk + kp) + h).write(even[kp]);
                    dst.add(2 * (kk + 8 + kp) + h).write(odd[kp]);
                }
            }
        }
    }
}

/// One micro-kernel call: up to [`MR`] batch rows against one panel over one `K` block.
struct Micro {
    /// The widened panel (`2 · kc` vectors).
    panel: *const __m256,
    /// The first batch row's packed activations at the block's first column.
    x: *const f32,
    ldx: usize,
    kc: usize,
    /// The first batch row's output at the panel's first column.
    out: *mut f32,
    ld_out: usize,
    /// Output columns written (`1 ..= NR`).
    cols: usize,
    /// Store the sums (else add them to the output).
    store: bool,
    /// The first batch row's scale.
    scale: Option<*const f32>,
}

/// Dispatches `mr` rows to a const instantiation of [`micro`].
///
/// # Safety
/// As [`micro`] with `M = mr`.
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_dyn(mr: usize, t: &Micro) {
    // The output rows are read (or written) only after the whole `K` block: ask for their
    // lines now so the misses overlap the block's FMAs.
    for r in 0..mr {
        let o = t.out.wrapping_add(r * t.ld_out);
        _mm_prefetch::<_MM_HINT_T0>(o.cast::<i8>());
        _mm_prefetch::<_MM_HINT_T0>(o.wrapping_add(NR - 1).cast::<i8>());
    }
    // SAFETY: forwarded contract.
    unsafe {
        match mr {
            1 => micro::<1>(t),
            2 => micro::<2>(t),
            3 => micro::<3>(t),
            4 => micro::<4>(t),
            5 => micro::<5>(t),
            6 => {
                let acc = micro6_body(t);
                let acc: [[__m256; 2]; 6] = std::array::from_fn(|r| [acc[2 * r], acc[2 * r + 1]]);
                write_out(t, acc);
            }
            _ => unreachable!("micro-kernel rows {mr}"),
        }
    }
}

/// `M` batch rows × 16 columns over `t.kc` elements in `2 · M` accumulators, then stored or
/// added to the output's first `t.cols` columns.
///
/// # Safety
/// AVX2 and FMA available; `t.panel` valid for `2 · t.kc` vector reads; `t.x` for `t.kc`
/// reads in each of `M` rows `t.ldx` apart; `t.out` for `t.cols` reads and writes in each of
/// `M` rows `t.ld_out` apart; `t.scale`, if any, for `M` reads.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn micro<const M: usize>(t: &Micro) {
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    let x: [*const f32; M] = std::array::from_fn(|r| t.x.wrapping_add(r * t.ldx));
    for k in 0..t.kc {
        // SAFETY: k < kc, inside the panel and each activation row (contract).
        unsafe {
            let w0 = t.panel.add(2 * k).read();
            let w1 = t.panel.add(2 * k + 1).read();
            for r in 0..M {
                let a = _mm256_broadcast_ss(&*x[r].add(k));
                acc[r][0] = _mm256_fmadd_ps(w0, a, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, a, acc[r][1]);
            }
        }
    }
    // SAFETY: forwarded contract.
    unsafe { write_out(t, acc) };
}

/// Stores or adds `M` rows of 16 sums (times the rows' scales) into the output's first
/// `t.cols` columns.
///
/// # Safety
/// AVX2 available; `t.out` valid for `t.cols` reads and writes in each of `M` rows
/// `t.ld_out` apart; `t.scale`, if any, for `M` reads.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn write_out<const M: usize>(t: &Micro, acc: [[__m256; 2]; M]) {
    for (r, [mut v0, mut v1]) in acc.into_iter().enumerate() {
        if let Some(s) = t.scale {
            // SAFETY: row r < M of the scale (contract).
            let s = _mm256_set1_ps(unsafe { *s.add(r) });
            v0 = _mm256_mul_ps(v0, s);
            v1 = _mm256_mul_ps(v1, s);
        }
        let o = t.out.wrapping_add(r * t.ld_out);
        // SAFETY: `t.cols` elements of output row r (contract); whole vectors only when all
        // 16 columns are written.
        unsafe {
            if t.cols == NR {
                if !t.store {
                    v0 = _mm256_add_ps(_mm256_loadu_ps(o), v0);
                    v1 = _mm256_add_ps(_mm256_loadu_ps(o.add(8)), v1);
                }
                _mm256_storeu_ps(o, v0);
                _mm256_storeu_ps(o.add(8), v1);
            } else {
                let mut tmp = [0.0f32; NR];
                _mm256_storeu_ps(tmp.as_mut_ptr(), v0);
                _mm256_storeu_ps(tmp.as_mut_ptr().add(8), v1);
                for (c, &v) in tmp.iter().enumerate().take(t.cols) {
                    let o = o.add(c);
                    *o = if t.store { v } else { *o + v };
                }
            }
        }
    }
}

/// One `K` element of the 6 × 16 loop at panel byte displacement `$pd` (and `$pd2`) and
/// activation displacement `$xd`: the panel's two vectors, then each batch row's broadcast
/// (rows `x0`, `x0 + ld`, `x0 + 2 ld`, `x3`, ..) into two FMAs (row `r`'s accumulators are
/// `ymm(2 r)`, `ymm(2 r + 1)`).
macro_rules! k_step {
    ($pd:literal, $pd2:literal, $xd:literal) => {
        concat!(
            "vmovaps ymm12, [{p} + ",
            $pd,
            "]\n",
            "vmovaps ymm13, [{p} + ",
            $pd2,
            "]\n",
            "vbroadcastss ymm14, [{x0} + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm0, ymm12, ymm14\n",
            "vfmadd231ps ymm1, ymm13, ymm14\n",
            "vbroadcastss ymm15, [{x0} + {ld} + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm2, ymm12, ymm15\n",
            "vfmadd231ps ymm3, ymm13, ymm15\n",
            "vbroadcastss ymm14, [{x0} + {ld}*2 + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm4, ymm12, ymm14\n",
            "vfmadd231ps ymm5, ymm13, ymm14\n",
            "vbroadcastss ymm15, [{x3} + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm6, ymm12, ymm15\n",
            "vfmadd231ps ymm7, ymm13, ymm15\n",
            "vbroadcastss ymm14, [{x3} + {ld} + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm8, ymm12, ymm14\n",
            "vfmadd231ps ymm9, ymm13, ymm14\n",
            "vbroadcastss ymm15, [{x3} + {ld}*2 + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm10, ymm12, ymm15\n",
            "vfmadd231ps ymm11, ymm13, ymm15\n",
        )
    };
}

/// The 6-row micro-kernel's sums (row `r`, columns `8 h ..`: element `2 r + h`), in assembly
/// so the twelve accumulators, two panel vectors and a broadcast occupy the sixteen `ymm`
/// registers without spills, sixteen `K` elements (one line of each activation row) per loop
/// turn.
///
/// Each turn also prefetches the same line of the next six batch rows, which the next call
/// (the same panel, the next rows) reads: a call's activation rows are short streams (`KC`
/// elements) that the hardware prefetchers would otherwise meet cold at every call.
///
/// # Safety
/// AVX2 and FMA available; `t.kc` a positive multiple of 16; `t.panel` valid for `2 · t.kc`
/// aligned vector reads; `t.x` for `t.kc` reads in each of 6 rows `t.ldx` apart.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn micro6_body(t: &Micro) -> [__m256; 12] {
    debug_assert!(t.kc > 0 && t.kc.is_multiple_of(16));
    let z = _mm256_setzero_ps();
    let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5) = (z, z, z, z, z, z);
    let (mut a6, mut a7, mut a8, mut a9, mut a10, mut a11) = (z, z, z, z, z, z);
    let row = |r: usize| t.x.wrapping_add(r * t.ldx);
    // SAFETY: the loads are the panel's 2·kc vectors in order (`p` steps 1 KiB per sixteen
    // elements) and the `kc` elements of each of the 6 rows (`x0`, `x3` step one line per turn;
    // contract); prefetches never fault; registers written are declared; no stack, no memory
    // writes.
    unsafe {
        asm!(
            "2:",
            k_step!("0", "32", "0"),
            k_step!("64", "96", "4"),
            k_step!("128", "160", "8"),
            k_step!("192", "224", "12"),
            k_step!("256", "288", "16"),
            k_step!("320", "352", "20"),
            k_step!("384", "416", "24"),
            k_step!("448", "480", "28"),
            k_step!("512", "544", "32"),
            k_step!("576", "608", "36"),
            k_step!("640", "672", "40"),
            k_step!("704", "736", "44"),
            k_step!("768", "800", "48"),
            k_step!("832", "864", "52"),
            k_step!("896", "928", "56"),
            k_step!("960", "992", "60"),
            "prefetcht0 [{n0}]",
            "prefetcht0 [{n0} + {ld}]",
            "prefetcht0 [{n0} + {ld}*2]",
            "prefetcht0 [{n3}]",
            "prefetcht0 [{n3} + {ld}]",
            "prefetcht0 [{n3} + {ld}*2]",
            "add {x0}, 64",
            "add {x3}, 64",
            "add {n0}, 64",
            "add {n3}, 64",
            "add {p}, 1024",
            "dec {turns}",
            "jnz 2b",
            p = inout(reg) t.panel => _,
            turns = inout(reg) t.kc / 16 => _,
            x0 = inout(reg) row(0) => _,
            x3 = inout(reg) row(3) => _,
            n0 = inout(reg) row(6) => _,
            n3 = inout(reg) row(9) => _,
            ld = in(reg) t.ldx * 4,
            inout("ymm0") a0, inout("ymm1") a1, inout("ymm2") a2, inout("ymm3") a3,
            inout("ymm4") a4, inout("ymm5") a5, inout("ymm6") a6, inout("ymm7") a7,
            inout("ymm8") a8, inout("ymm9") a9, inout("ymm10") a10, inout("ymm11") a11,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack, readonly),
        );
    }
    [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11]
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use half::bf16;

    use crate::dsv4::tests::values;
    use crate::gemm::{
        GemmTile, OutMode, PackedActs, WeightsBf16, gemm_bf16, gemm_scaled_bf16, pack_acts_f32,
        packed_len, with_avx2_panel_min_batch,
    };
    use crate::isa::{Isa, with_isa};

    thread_local! {
        /// Calls of the packed kernel on this thread (so a test knows it ran).
        pub(super) static CALLS: Cell<usize> = const { Cell::new(0) };
    }

    /// `(N, K, batch, tile rows, tile K, mode, scaled)`.
    type Case = (
        usize,
        usize,
        usize,
        std::ops::Range<usize>,
        std::ops::Range<usize>,
        OutMode,
        bool,
    );

    /// One product on the current path: `out` seeded with `seed_out` (ld `ld`).
    #[allow(clippy::too_many_arguments)]
    fn product(
        w: WeightsBf16<'_>,
        x: PackedActs<'_>,
        tile: &GemmTile,
        scale: Option<&[f32]>,
        seed_out: &[f32],
        ld: usize,
    ) -> Vec<f32> {
        let mut out = seed_out.to_vec();
        match scale {
            Some(s) => gemm_scaled_bf16(w, x, tile, s, &mut out, ld),
            None => gemm_bf16(w, x, tile, &mut out, ld),
        }
        out
    }

    /// The packed kernel against the portable path and an f64 sum at ragged shapes: batches
    /// not a multiple of the 6-row block (and past one and two activation blocks of 72), rows
    /// not a multiple of the 16-column panel (and over several 64-row widened blocks), `K`
    /// not a multiple of the 512-element block nor of 16 (edges on both sides of the body),
    /// tiles starting mid-matrix, `Store` and `Add`, with and without row scales.
    #[test]
    fn packed_kernel_matches_portable_at_ragged_shapes() {
        if !Isa::Avx2.is_supported() {
            println!("avx2 packed kernel skipped: not on this CPU");
            return;
        }
        // (N, K, batch, tile rows, tile K, mode, scaled)
        let cases: [Case; 8] = [
            (37, 528, 13, 0..37, 0..528, OutMode::Store, false),
            (150, 1100, 79, 5..143, 20..1093, OutMode::Add, true),
            (16, 1024, 6, 0..16, 0..1024, OutMode::Store, true),
            (70, 48, 145, 33..70, 0..48, OutMode::Store, false),
            (5, 2000, 1, 0..5, 0..2000, OutMode::Add, false),
            (129, 1536, 64, 1..129, 512..1536, OutMode::Store, true),
            (33, 100, 7, 17..33, 3..97, OutMode::Store, false),
            // No whole 16-element block inside `K`: the dispatch keeps the passes.
            (20, 40, 64, 3..19, 17..31, OutMode::Store, false),
        ];
        for (n, k, batch, nr, kr, mode, scaled) in cases {
            let wv: Vec<bf16> = values(n * k, (n * k) as u64)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect();
            let xv: Vec<f32> = values(batch * k, 3 + batch as u64)
                .iter()
                .map(|&v| bf16::from_f32(v).to_f32())
                .collect();
            let mut packed = vec![0.0f32; packed_len(batch, k)];
            pack_acts_f32(&xv, batch, k, &mut packed);
            let w = WeightsBf16::new(&wv, n, k);
            let x = PackedActs::new(&packed, batch, k);
            let tile = GemmTile {
                n: nr.clone(),
                k: kr.clone(),
                mode,
            };
            let ld = nr.len() + 3;
            let seed_out = values((batch - 1) * ld + nr.len(), 99);
            let scale_v: Vec<f32> = values(batch, 5).iter().map(|v| v * 2.0).collect();
            let scale = scaled.then_some(&scale_v[..]);
            let before = CALLS.with(Cell::get);
            let got = with_isa(Isa::Avx2, || {
                with_avx2_panel_min_batch(1, || product(w, x, &tile, scale, &seed_out, ld))
            })
            .expect("avx2 supported");
            let body = kr.start.next_multiple_of(16) + 16 <= kr.end.min(k / 16 * 16);
            assert_eq!(
                CALLS.with(Cell::get) > before,
                body,
                "packed kernel taken for {n}x{k} batch {batch}"
            );
            let port = with_isa(Isa::Portable, || product(w, x, &tile, scale, &seed_out, ld))
                .expect("portable runs");
            for b in 0..batch {
                for nn in nr.clone() {
                    let (mut e, mut mag) = (0.0f64, 0.0f64);
                    for kk in kr.clone() {
                        let p = f64::from(wv[nn * k + kk].to_f32()) * f64::from(xv[b * k + kk]);
                        e += p;
                        mag += p.abs();
                    }
                    let s = scale.map_or(1.0, |s| f64::from(s[b]));
                    let i = b * ld + (nn - nr.start);
                    e *= s;
                    let mut tol = 2e-6 * mag * s.abs() + 1e-6;
                    if mode == OutMode::Add {
                        e += f64::from(seed_out[i]);
                        tol += 1e-6;
                    }
                    for (what, v) in [("packed", &got), ("portable", &port)] {
                        assert!(
                            (f64::from(v[i]) - e).abs() <= tol,
                            "{what} {n}x{k} batch {batch} tile {nr:?}/{kr:?} b={b} n={nn}: {} vs {e}",
                            v[i]
                        );
                    }
                }
            }
            // Nothing outside the tile's columns is written.
            for (i, (&o, &s0)) in got.iter().zip(&seed_out).enumerate() {
                if i % ld >= nr.len() {
                    assert_eq!(o.to_bits(), s0.to_bits(), "padding element {i} written");
                }
            }
        }
    }

    /// Non-finite weights reach the same outputs as on the portable path (a NaN or infinity
    /// in a widened panel is not lost or spread to other columns, and zero padding columns
    /// stay out of the written ones).
    #[test]
    fn packed_kernel_keeps_non_finite_weights_in_their_columns() {
        if !Isa::Avx2.is_supported() {
            return;
        }
        let (n, k, batch) = (21, 96, 13);
        let mut wv: Vec<bf16> = values(n * k, 4)
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        wv[3 * k + 10] = bf16::from_f32(f32::INFINITY);
        wv[7 * k + 2] = bf16::NAN;
        wv[20 * k + 50] = bf16::from_f32(f32::NEG_INFINITY);
        let xv: Vec<f32> = values(batch * k, 8)
            .iter()
            .map(|v| v.abs() + 0.25)
            .collect();
        let mut packed = vec![0.0f32; packed_len(batch, k)];
        pack_acts_f32(&xv, batch, k, &mut packed);
        let w = WeightsBf16::new(&wv, n, k);
        let x = PackedActs::new(&packed, batch, k);
        let tile = GemmTile::full(&w);
        let seed = vec![0.0f32; batch * n];
        let got = with_isa(Isa::Avx2, || {
            with_avx2_panel_min_batch(1, || product(w, x, &tile, None, &seed, n))
        })
        .expect("avx2");
        let want =
            with_isa(Isa::Portable, || product(w, x, &tile, None, &seed, n)).expect("portable");
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            let col = i % n;
            match col {
                3 => assert_eq!(*g, f32::INFINITY, "{i}"),
                7 => assert!(g.is_nan(), "{i}"),
                20 => assert_eq!(*g, f32::NEG_INFINITY, "{i}"),
                _ => assert!(g.is_finite() && (g - e).abs() <= 1e-4, "{i}: {g} vs {e}"),
            }
        }
    }
}
