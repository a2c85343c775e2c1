//! The AVX2 path on paired weights (`WeightLayout::Pairs`): eight output rows per vector, each
//! batch row's activation broadcast, so the sums build up lane by lane.
//!
//! Why: the dot-product passes on row-major weights (`quad.rs`) load a vector of packed
//! activations for every three FMAs, and at 16 batch rows those rows (64 KiB at `K` = 1024,
//! 192 KiB at 3072) do not fit in L1: the pass streams ~256 bytes from L2 per 24 FMAs and ends
//! every output with a horizontal sum. Here one 256-bit load holds eight rows' pair of `K`
//! elements; a shift and a mask widen it into the eight rows at the even and at the odd `k`,
//! and each meets one broadcast activation per batch row. Per pair of `k`, three row groups ×
//! four batch rows take three weight loads, a mask load and eight 4-byte broadcasts for 24
//! FMAs, and a finished vector is eight outputs. Measured on Zen 3 (one thread, 16 batch rows,
//! `[3072, 1024]`, both kernels alternating in one process): 82 against 72.5 GFLOP/s with the
//! weights in L3, 69.5 against 54.9 streamed from memory (`docs/benchmarks.md`, session 20).
//!
//! - Batch 1: the tile's row groups as four contiguous quarters walked side by side (one
//!   group of each per pass), each stream prefetching ahead into its own next group.
//! - Batch 2 and up: passes of three row groups (a third of the tile apart, each stream
//!   walking consecutive groups) × four batch rows, in assembly for whole 3 × 4 blocks (all
//!   sixteen `ymm` registers: twelve accumulators, three widened vectors, one broadcast) and
//!   in intrinsics for the smaller blocks at the edges. Each pass runs once per group of four
//!   batch rows while its three groups sit in L1/L2. From five batch rows (two runs or
//!   more) the runs of a pass share the prefetch of each stream's next group between them,
//!   so the weight stream runs through the pass; a pass of one run (2–4 batch rows) leaves
//!   its three sequential streams to the hardware prefetchers (see [`pass`]).
//! - The `K` range a call sums is its whole packing blocks (16 elements, 8 pairs: one loop
//!   step), and the elements outside them are added per output by `edge_sum`.

use std::arch::asm;
use std::arch::x86_64::*;

use super::super::{Lowered, PAIR_ROWS, edge_sum, finish};
use crate::simd::prefetch_l1;

/// Row groups per batched pass.
const NV: usize = 3;
/// Batch rows per batched pass.
const QB: usize = 4;
/// Row-group streams of the batch-1 pass.
const GEMV_STREAMS: usize = 4;
/// How far ahead of its loads the batch-1 pass prefetches each stream, in bytes (0, 128,
/// 256, 1024 and 2048 measured level or slower on Zen 3 in `gemm_step_bw`).
const GEMV_PF_BYTES: usize = 512;
/// bf16 elements of one group's pair (eight rows × two `k`).
const PAIR_ELEMS: usize = 2 * PAIR_ROWS;

#[repr(align(32))]
#[allow(dead_code, reason = "read by the assembly loop through `ODD_MASK`")]
struct Mask([u32; 8]);

/// The high half of every 32-bit lane: picks the odd `k` of a pair as an fp32.
static ODD_MASK: Mask = Mask([0xFFFF_0000; 8]);

/// Accumulators of one block: `acc[QB * s + b]` for row group `s` and batch row `b` (lane
/// `i`: row `8 g + i` of that group).
type Acc = [__m256; 16];

/// One run's operands, every pointer at the END of its range (the run covers the `len`
/// elements before it).
struct Run<const S: usize, const B: usize> {
    /// The row groups' pair streams (bf16 bits; `len / 2` pairs of 16 elements each).
    g: [*const u16; S],
    /// The batch rows' packed activations (fp32; `len` elements each).
    x: [*const f32; B],
    /// Where each stream's prefetch region ends: `lines` 64-byte lines per 16-element step.
    pf: [*const u8; S],
    /// Lines prefetched per stream and step: 0, 1, 2 or 4.
    lines: usize,
    /// `K` elements covered (a multiple of 16).
    len: usize,
}

/// Computes the tile described by `lw` (paired weights) into `out`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `lw` must describe a tile of paired weights inside its
/// matrices, its first row on a group of 8, with `out` long enough (as `gemm_dispatch`
/// checks).
#[target_feature(enable = "avx2,fma")]
pub(in crate::gemm) unsafe fn gemm(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) {
    debug_assert!(lw.pairs && lw.n.start.is_multiple_of(PAIR_ROWS));
    let g0 = lw.n.start / PAIR_ROWS;
    let g1 = lw.n.end.div_ceil(PAIR_ROWS);
    if lw.batch == 1 {
        // SAFETY: forwarded contract.
        unsafe { gemv(lw, g0, g1, out, ld_out) };
        return;
    }
    let len = (g1 - g0) / NV;
    for i in 0..len {
        let (groups, next) = super::super::pass_groups::<NV>(g0, len, i);
        // SAFETY: the groups lie inside the tile (`s * len + i < NV * len <= g1 - g0`).
        unsafe { pass::<NV>(lw, groups, next, out, ld_out) };
    }
    let mut g = g0 + NV * len;
    while g < g1 {
        // The groups left over (fewer than NV), adjacent.
        let left = g1 - g;
        // SAFETY: groups g.. g + left lie inside the tile.
        unsafe {
            if left >= 2 {
                pass::<2>(lw, [g, g + 1], [g + 2, g + 3], out, ld_out);
                g += 2;
            } else {
                pass::<1>(lw, [g], [g + 1], out, ld_out);
                g += 1;
            }
        }
    }
}

/// Batch 1: the tile's groups as [`GEMV_STREAMS`] contiguous quarters side by side, then the
/// groups left over one at a time.
///
/// # Safety
/// As [`gemm`], with `lw.batch == 1` and `g0..g1` the tile's groups.
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv(lw: &Lowered<'_>, g0: usize, g1: usize, out: &mut [f32], ld_out: usize) {
    let len = (g1 - g0) / GEMV_STREAMS;
    for i in 0..len {
        // SAFETY: groups of the tile (`s * len + i < g1 - g0`); forwarded contract.
        unsafe {
            gemv_run::<GEMV_STREAMS>(lw, std::array::from_fn(|s| g0 + s * len + i), out, ld_out)
        };
    }
    for gg in g0 + GEMV_STREAMS * len..g1 {
        // SAFETY: a group of the tile; forwarded contract.
        unsafe { gemv_run::<1>(lw, [gg], out, ld_out) };
    }
}

/// Batch 1 over `S` groups side by side, each stream prefetching [`GEMV_PF_BYTES`] ahead.
///
/// # Safety
/// As [`gemv`], with every group in `groups` inside the tile.
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_run<const S: usize>(
    lw: &Lowered<'_>,
    groups: [usize; S],
    out: &mut [f32],
    ld_out: usize,
) {
    let g = groups.map(|gg| group_end(lw, gg));
    let run = Run::<S, 1> {
        g,
        x: [x_end(lw, 0)],
        pf: g.map(|p| p.cast::<u8>().wrapping_add(GEMV_PF_BYTES)),
        lines: 4,
        len: lw.kb1 - lw.kb0,
    };
    let mut acc = [_mm256_setzero_ps(); 16];
    // SAFETY: each group's body lies inside `lw.w` (a group of the tile), the activation row's
    // body inside `lw.x`; AVX2/FMA by contract.
    unsafe { run_dyn(&run, &mut acc) };
    store(lw, &acc, &groups, 0, 1, out, ld_out);
}

/// Where group `gg`'s body (`K` elements `kb0..kb1`) ends: a pointer one past its last pair.
#[inline]
fn group_end(lw: &Lowered<'_>, gg: usize) -> *const u16 {
    let group = lw.ldw.next_multiple_of(2) * PAIR_ROWS;
    lw.w.as_ptr()
        .wrapping_add(gg * group + lw.kb1 / 2 * PAIR_ELEMS)
}

/// Where batch row `b`'s packed body (`kb0..kb1`) ends.
#[inline]
fn x_end(lw: &Lowered<'_>, b: usize) -> *const f32 {
    lw.x.as_ptr().wrapping_add(b * lw.ldx + lw.kb1)
}

/// One pass of `S` row groups over every batch row, `QB` at a time; with two runs or more,
/// run `r` of the pass prefetches its share of the groups `next`.
///
/// A pass of a single run prefetches nothing: its three streams each walk consecutive
/// groups, sequential memory the hardware prefetchers follow, and at 2–4 batch rows, where
/// the FMAs and the bytes bind within a few per cent of each other on Zen 3, the twelve
/// prefetches a step (4 lines × 3 streams) cost more issue slots than they saved: Qwen3-0.6B
/// decode steps at 2, 3 and 4 × 1024 took 0.947, 0.948 and 0.959× the time without them
/// (old/new 1.056 [1.049, 1.073], 1.055 [1.014, 1.089], 1.043 [1.005, 1.086]: `bench
/// qwen3-decode --versus-isa` through a temporary switch, 30 interleaved rounds). With two
/// runs or more the prefetch stays: at 8 × 1024 the step without it took 1.04× the time
/// (0.961 [0.920, 0.981]), at 16 × 1024 0.956–0.981, not resolved.
///
/// # Safety
/// As [`gemm`], with every group in `groups` inside the tile (`next` may point anywhere).
#[target_feature(enable = "avx2,fma")]
unsafe fn pass<const S: usize>(
    lw: &Lowered<'_>,
    groups: [usize; S],
    next: [usize; S],
    out: &mut [f32],
    ld_out: usize,
) {
    let len = lw.kb1 - lw.kb0;
    let g = groups.map(|gg| group_end(lw, gg));
    // Bytes of a group's body: 32 per pair.
    let body = len * 16;
    let runs = lw.batch.div_ceil(QB);
    // Lines per step so the first runs cover the next groups' bodies between them: a run at
    // `lines` per step covers `len * 4 * lines` bytes of each (none for a single run).
    let lines = match runs {
        1 => 0,
        2 | 3 => 2,
        _ => 1,
    };
    let share = len * 4 * lines;
    for r in 0..runs {
        let b0 = r * QB;
        let bv = QB.min(lw.batch - b0);
        let covered = (r + 1) * share <= body;
        let pf = next.map(|gg| {
            group_end(lw, gg)
                .wrapping_sub(len / 2 * PAIR_ELEMS)
                .cast::<u8>()
                .wrapping_add((r + 1) * share)
        });
        let lines = if covered { lines } else { 0 };
        let mut acc = [_mm256_setzero_ps(); 16];
        if len > 0 {
            // SAFETY: the groups' and batch rows' bodies lie inside `lw.w` / `lw.x` (tile
            // groups, batch rows b0..b0+bv); AVX2/FMA by contract.
            unsafe { block::<S>(lw, g, b0, bv, pf, lines, len, &mut acc) };
        }
        store(lw, &acc, &groups, b0, bv, out, ld_out);
    }
}

/// Runs `S` groups against batch rows `b0..b0 + bv` (`bv <= QB`) into `acc`.
///
/// # Safety
/// AVX2 and FMA; the `len` elements before each `g[s]` and before batch row `b`'s body end
/// (`b0 <= b < b0 + bv`) are readable.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments, reason = "one run's operands, forwarded")]
unsafe fn block<const S: usize>(
    lw: &Lowered<'_>,
    g: [*const u16; S],
    b0: usize,
    bv: usize,
    pf: [*const u8; S],
    lines: usize,
    len: usize,
    acc: &mut Acc,
) {
    macro_rules! go {
        ($b:literal) => {{
            let run = Run::<S, $b> {
                g,
                x: std::array::from_fn(|b| x_end(lw, b0 + b)),
                pf,
                lines,
                len,
            };
            // SAFETY: forwarded contract (bv == $b rows).
            unsafe {
                // Three batch rows too, the first repeated as the fourth (its sums dropped):
                // the assembly block at 3/4 of its FMAs still beats the intrinsics' 3 × 3.
                if S == NV && $b >= QB - 1 {
                    run_3x4(&run, acc)
                } else {
                    run_dyn(&run, acc)
                }
            }
        }};
    }
    match bv {
        1 => go!(1),
        2 => go!(2),
        3 => go!(3),
        _ => go!(4),
    }
}

/// Accumulates one run of `S` groups × `B` batch rows (intrinsics; the blocks smaller than
/// 3 × 4, where the registers suffice).
///
/// # Safety
/// AVX2 and FMA; the `run.len` elements before each `run.g[s]` and `run.x[b]` are readable;
/// `run.len` is a multiple of 16.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn run_dyn<const S: usize, const B: usize>(run: &Run<S, B>, acc: &mut Acc) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let steps = run.len / 16;
    // Step `t < steps` reads pairs `8 t .. 8 t + 8` of each group (elements `16 (8 t + j) ..`
    // of the `len * 8` before `g[s]`) and activations `16 t .. 16 t + 16` of the `len` before
    // `x[b]`: inside the readable ranges (the loads below rely on this).
    // SAFETY: the starts of those ranges, inside the same readable ranges.
    let g = run.g.map(|p| unsafe { p.sub(run.len * PAIR_ROWS) });
    // SAFETY: as above.
    let x = run.x.map(|p| unsafe { p.sub(run.len) });
    let pf = run.pf.map(|p| p.wrapping_sub(run.len * 4 * run.lines));
    let mut a = [[_mm256_setzero_ps(); B]; S];
    for t in 0..steps {
        for p in pf {
            for m in 0..run.lines {
                prefetch_l1(p.wrapping_add((t * run.lines + m) * 64));
            }
        }
        for j in 0..8 {
            // SAFETY: as above; unaligned loads.
            let w: [__m256i; S] = std::array::from_fn(|s| unsafe {
                _mm256_loadu_si256(g[s].add((8 * t + j) * PAIR_ELEMS).cast())
            });
            for b in 0..B {
                // SAFETY: as above.
                let xe = unsafe { _mm256_broadcast_ss(&*x[b].add(16 * t + j)) };
                for s in 0..S {
                    let e = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w[s]));
                    a[s][b] = _mm256_fmadd_ps(e, xe, a[s][b]);
                }
            }
            for b in 0..B {
                // SAFETY: as above.
                let xo = unsafe { _mm256_broadcast_ss(&*x[b].add(16 * t + 8 + j)) };
                for s in 0..S {
                    let o = _mm256_castsi256_ps(_mm256_and_si256(w[s], mask));
                    a[s][b] = _mm256_fmadd_ps(o, xo, a[s][b]);
                }
            }
        }
    }
    for s in 0..S {
        for b in 0..B {
            acc[QB * s + b] = a[s][b];
        }
    }
}

/// Four batch rows' broadcast of displacement `$xd` from the step's position, each meeting
/// the three widened vectors in `ymm12..14` (accumulator `ymm(4 s + b)`).
macro_rules! bcast4 {
    ($xd:literal) => {
        concat!(
            "vbroadcastss ymm15, [{x0} + {c} + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm0, ymm12, ymm15\n",
            "vfmadd231ps ymm4, ymm13, ymm15\n",
            "vfmadd231ps ymm8, ymm14, ymm15\n",
            "vbroadcastss ymm15, [{x1} + {c} + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm1, ymm12, ymm15\n",
            "vfmadd231ps ymm5, ymm13, ymm15\n",
            "vfmadd231ps ymm9, ymm14, ymm15\n",
            "vbroadcastss ymm15, [{x2} + {c} + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm2, ymm12, ymm15\n",
            "vfmadd231ps ymm6, ymm13, ymm15\n",
            "vfmadd231ps ymm10, ymm14, ymm15\n",
            "vbroadcastss ymm15, [{x3} + {c} + ",
            $xd,
            "]\n",
            "vfmadd231ps ymm3, ymm12, ymm15\n",
            "vfmadd231ps ymm7, ymm13, ymm15\n",
            "vfmadd231ps ymm11, ymm14, ymm15\n",
        )
    };
}

/// Pair `j` of the step: the three groups' vector at byte `$wd` (= 32 j) widened at the even
/// `k` (shift) against the activations at `$xe` (= 4 j), then at the odd `k` (mask) against
/// `$xo` (= 32 + 4 j; the packed block holds the even elements then the odd ones).
macro_rules! pair {
    ($wd:literal, $xe:literal, $xo:literal) => {
        concat!(
            "vmovdqu ymm12, [{g0} + {c}*4 + ",
            $wd,
            "]\n",
            "vmovdqu ymm13, [{g1} + {c}*4 + ",
            $wd,
            "]\n",
            "vmovdqu ymm14, [{g2} + {c}*4 + ",
            $wd,
            "]\n",
            "vpslld ymm12, ymm12, 16\n",
            "vpslld ymm13, ymm13, 16\n",
            "vpslld ymm14, ymm14, 16\n",
            bcast4!($xe),
            "vmovdqa ymm12, [rip + {mask}]\n",
            "vpand ymm13, ymm12, [{g1} + {c}*4 + ",
            $wd,
            "]\n",
            "vpand ymm14, ymm12, [{g2} + {c}*4 + ",
            $wd,
            "]\n",
            "vpand ymm12, ymm12, [{g0} + {c}*4 + ",
            $wd,
            "]\n",
            bcast4!($xo),
        )
    };
}

/// Prefetches of the three streams at displacement `$d` from their region ends.
macro_rules! pf3 {
    ($d:literal) => {
        concat!(
            "prefetcht0 [{p0} + ",
            $d,
            "]\n",
            "prefetcht0 [{p1} + ",
            $d,
            "]\n",
            "prefetcht0 [{p2} + ",
            $d,
            "]\n",
        )
    };
}

/// One 16-element step: eight pairs.
macro_rules! step8 {
    () => {
        concat!(
            pair!("0", "0", "32"),
            pair!("32", "4", "36"),
            pair!("64", "8", "40"),
            pair!("96", "12", "44"),
            pair!("128", "16", "48"),
            pair!("160", "20", "52"),
            pair!("192", "24", "56"),
            pair!("224", "28", "60"),
        )
    };
}

/// Accumulates one 3 × 4 run in assembly (all sixteen `ymm` registers); with `B == 3` the
/// first batch row is also the fourth, whose accumulators `acc[4 s + 3]` are then garbage.
///
/// # Safety
/// As [`run_dyn`].
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn run_3x4<const S: usize, const B: usize>(run: &Run<S, B>, acc: &mut Acc) {
    debug_assert!(S == NV && B + 1 >= QB && run.len.is_multiple_of(16));
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
        ..,
    ] = *acc;
    // The counter `c` runs over the activations' bytes from -(4 len) to 0, 64 a step; the
    // weights advance 256 bytes a step (`c*4`), the prefetches `lines` 64-byte lines a step.
    // `$ins`: the step's prefetch instructions.
    macro_rules! run_loop {
        ($($ins:expr),*) => {
            asm!(
                "2:",
                $($ins,)*
                step8!(),
                "add {c}, 64",
                "jnz 2b",
                c = inout(reg) -((run.len * 4) as isize) => _,
                g0 = in(reg) run.g[0],
                g1 = in(reg) run.g[1 % S],
                g2 = in(reg) run.g[2 % S],
                p0 = in(reg) run.pf[0],
                p1 = in(reg) run.pf[1 % S],
                p2 = in(reg) run.pf[2 % S],
                x0 = in(reg) run.x[0],
                x1 = in(reg) run.x[1 % B],
                x2 = in(reg) run.x[2 % B],
                x3 = in(reg) run.x[3 % B],
                mask = sym ODD_MASK,
                inout("ymm0") a0, inout("ymm1") a1, inout("ymm2") a2, inout("ymm3") a3,
                inout("ymm4") a4, inout("ymm5") a5, inout("ymm6") a6, inout("ymm7") a7,
                inout("ymm8") a8, inout("ymm9") a9, inout("ymm10") a10, inout("ymm11") a11,
                out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                options(nostack, readonly),
            )
        };
    }
    if run.len == 0 {
        return;
    }
    // SAFETY: every load is at `end + c * scale + d` for a stream end, with the element it
    // addresses among the `len` before that end (`c` in [-4 len, 0), `d` inside a step);
    // prefetches never fault. Only ymm0–15 and `c` are written, all declared; no stack, no
    // memory writes.
    unsafe {
        match run.lines {
            // No prefetch: the operands named in a comment (every operand must be used).
            0 => run_loop!("/* {p0} {p1} {p2} */"),
            1 => run_loop!(pf3!("{c}")),
            2 => run_loop!(pf3!("{c}*2"), pf3!("{c}*2 + 64")),
            _ => run_loop!(
                pf3!("{c}*4"),
                pf3!("{c}*4 + 64"),
                pf3!("{c}*4 + 128"),
                pf3!("{c}*4 + 192")
            ),
        }
    }
    acc[..12].copy_from_slice(&[a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11]);
}

/// Writes the finished block: group `groups[s]`, batch row `b0 + b` from `acc[QB * s + b]`
/// ([`store_rows8`] each).
#[target_feature(enable = "avx2,fma")]
fn store(
    lw: &Lowered<'_>,
    acc: &Acc,
    groups: &[usize],
    b0: usize,
    bv: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    for (s, &gg) in groups.iter().enumerate() {
        for b in 0..bv {
            store_rows8(lw, acc[QB * s + b], gg * PAIR_ROWS, b0 + b, out, ld_out);
        }
    }
}

/// Writes the sums of output rows `n0..n0 + 8` for batch row `bb` (lane `i`: row `n0 + i`):
/// one vector where all eight rows lie in the tile and the tile has no edge elements, else
/// row by row with each row's edge sum. Shared by the paired kernels of every path.
#[target_feature(enable = "avx2,fma")]
pub(in crate::gemm) fn store_rows8(
    lw: &Lowered<'_>,
    v: __m256,
    n0: usize,
    bb: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    if !lw.has_edges() && n0 + PAIR_ROWS <= lw.n.end {
        let v = match lw.scale {
            Some(sc) => _mm256_mul_ps(v, _mm256_set1_ps(sc[bb])),
            None => v,
        };
        let at = bb * ld_out + (n0 - lw.n.start);
        let o = &mut out[at..at + PAIR_ROWS];
        // SAFETY: `o` is eight floats (unaligned loads and stores).
        unsafe {
            let v = match lw.mode {
                super::super::OutMode::Store => v,
                super::super::OutMode::Add => _mm256_add_ps(_mm256_loadu_ps(o.as_ptr()), v),
            };
            _mm256_storeu_ps(o.as_mut_ptr(), v);
        }
    } else {
        let mut lanes = [0.0f32; PAIR_ROWS];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        for (i, &sum) in lanes.iter().enumerate() {
            let n = n0 + i;
            if n < lw.n.end {
                finish(lw, out, ld_out, n, bb, sum + edge_sum(lw, n, bb));
            }
        }
    }
}
