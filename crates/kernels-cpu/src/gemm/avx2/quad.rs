//! The FMA-bound pass for batches of 4 and more: three weight rows against four batch rows in
//! one pass, written in assembly so all twelve accumulators stay in registers. Larger batches
//! run it once per group of four batch rows while the three rows sit in L1.
//!
//! Why assembly: with twelve accumulators, three widened weight vectors and one activation
//! vector the loop needs all sixteen `ymm` registers, and LLVM spills accumulators and turns
//! the mask into blends around them (measured: ~45% of the FMA peak from L2). This loop runs at
//! ~90% of the peak from L2 on the development machine. Since each weight is widened once for
//! all four batch rows, the memory stream never waits on a second compute-only pass (the
//! `(4 rows × 2 batch)` pair of passes it replaced idled DRAM for half its time: ~17 against
//! ~20.5 GB/s on two cores), and it replaced the widened-scratch path of larger batches too
//! (a 14B `down_proj` tile at batch 16: 40 → 81 GFLOP/s on one core).

use std::arch::asm;

use crate::simd::fma_3x4_asm;
use std::arch::x86_64::*;

/// Batch rows per pass.
pub(super) const QB: usize = 4;
/// Weight rows per pass.
pub(super) const QR: usize = 3;

#[repr(align(32))]
#[allow(dead_code, reason = "read by the assembly loop through `ODD_MASK`")]
struct Mask([u32; 8]);

/// The high half of every 32-bit lane: picks the odd bf16 of a pair as an fp32.
static ODD_MASK: Mask = Mask([0xFFFF_0000; 8]);

/// One 16-element step at byte displacements `$wd` (weights) and `$xd` (packed activations)
/// from the loop position: the even halves (shift left 16) then the odd halves (mask), each
/// widened once per row and fed to four batch rows' FMAs (accumulator `ymm(4 r + b)`).
macro_rules! step16 {
    ($wd:literal, $xd:literal) => {
        concat!(
            "vmovdqu ymm12, [{w0} + {k}*2 + ",
            $wd,
            "]\n",
            "vmovdqu ymm13, [{w1} + {k}*2 + ",
            $wd,
            "]\n",
            "vmovdqu ymm14, [{w2} + {k}*2 + ",
            $wd,
            "]\n",
            "vpslld ymm12, ymm12, 16\n",
            "vpslld ymm13, ymm13, 16\n",
            "vpslld ymm14, ymm14, 16\n",
            fma_3x4_asm!($xd),
            "vmovdqa ymm12, [rip + {mask}]\n",
            "vpand ymm13, ymm12, [{w1} + {k}*2 + ",
            $wd,
            "]\n",
            "vpand ymm14, ymm12, [{w2} + {k}*2 + ",
            $wd,
            "]\n",
            "vpand ymm12, ymm12, [{w0} + {k}*2 + ",
            $wd,
            "]\n",
            fma_3x4_asm!($xd, " + 32"),
        )
    };
}

/// Pointers of one loop run, each at the END of its range: the run covers the `len` elements
/// before them (`len` a multiple of 16).
pub(super) struct Run {
    /// The three weight rows (bf16 bits).
    pub w: [*const u16; QR],
    /// Where each row stream's prefetch points at the end of the run (one line per 32
    /// elements, touched from `pf - len`; with `half_pf`, half a line per 32 elements, touched
    /// from `pf - len / 2`).
    pub pf: [*const u16; QR],
    /// Prefetch at half the rate: each stream covers `len / 2` elements over the run.
    pub half_pf: bool,
    /// The four packed activation rows.
    pub x: [*const f32; QB],
    /// Elements covered.
    pub len: usize,
}

/// Accumulates one run into `acc` (`acc[4 r + b]` += the even/odd-split products of weight
/// row `r` and activation row `b`, lane-wise).
///
/// # Safety
/// AVX2 and FMA available; for every row `r` and batch row `b`, the `run.len` elements before
/// `run.w[r]` (bf16) and before `run.x[b]` (fp32) are readable; `run.len` is a multiple of 16.
/// `run.pf` may point anywhere: prefetches never fault.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn accumulate(acc: &mut [__m256; QR * QB], run: &Run) {
    debug_assert!(run.len.is_multiple_of(16));
    let [
        mut a0,
        mut a1,
        mut a2,
        mut a3,
        mut a4,
        mut a5,
        mut a6,
        mut a7,
        mut a8,
        mut a9,
        mut a10,
        mut a11,
    ] = *acc;
    if run.len == 0 {
        return;
    }
    // The loop covers the run's first `pairs * 32` elements, counting up from -(elements) to
    // 0 so one register indexes every stream and the loop ends on the flags of its own
    // increment; a 16-element tail then runs as one more step at `k = 0`. Both address the
    // streams through pointers moved back by the tail.
    let pairs = run.len / 32;
    let tail = run.len - pairs * 32;
    // The same loop with the prefetches at `p + k*2` (a line per 32 elements) or `p + k`
    // (half a line per 32 elements, so a stream covers half the run's elements).
    macro_rules! run_loop {
        ($pf:literal) => {
            asm!(
                "test {k}, {k}",
                "jz 3f",
                "2:",
                concat!("prefetcht0 [{p0} + ", $pf, "]"),
                concat!("prefetcht0 [{p1} + ", $pf, "]"),
                concat!("prefetcht0 [{p2} + ", $pf, "]"),
                step16!("0", "0"),
                step16!("32", "64"),
                "add {k}, 32",
                "jnz 2b",
                "3:",
                "test {tail}, {tail}",
                "jz 4f",
                step16!("0", "0"),
                "4:",
                k = inout(reg) -((pairs * 32) as isize) => _,
                tail = in(reg) tail,
                w0 = in(reg) run.w[0].wrapping_sub(tail),
                w1 = in(reg) run.w[1].wrapping_sub(tail),
                w2 = in(reg) run.w[2].wrapping_sub(tail),
                p0 = in(reg) run.pf[0].wrapping_sub(tail),
                p1 = in(reg) run.pf[1].wrapping_sub(tail),
                p2 = in(reg) run.pf[2].wrapping_sub(tail),
                x0 = in(reg) run.x[0].wrapping_sub(tail),
                x1 = in(reg) run.x[1].wrapping_sub(tail),
                x2 = in(reg) run.x[2].wrapping_sub(tail),
                x3 = in(reg) run.x[3].wrapping_sub(tail),
                mask = sym ODD_MASK,
                inout("ymm0") a0, inout("ymm1") a1, inout("ymm2") a2, inout("ymm3") a3,
                inout("ymm4") a4, inout("ymm5") a5, inout("ymm6") a6, inout("ymm7") a7,
                inout("ymm8") a8, inout("ymm9") a9, inout("ymm10") a10, inout("ymm11") a11,
                out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                options(nostack, readonly),
            )
        };
    }
    // SAFETY: every load is at `p + k*scale + d` for a stream end `p` moved back by `tail`,
    // with the element offset `k + d/scale` in `[-pairs*32, 0)` in the loop and `[0, tail)`
    // in the tail step, relative to `end - tail`: inside the `len` elements before the stream
    // end, readable by the contract. Prefetches may point anywhere. Only ymm0–15 and `k` are
    // written, all declared; no stack, no memory writes.
    unsafe {
        if run.half_pf {
            run_loop!("{k}");
        } else {
            run_loop!("{k}*2");
        }
    }
    *acc = [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11];
}
