//! int8 matrix products for weights quantised symmetrically per output channel:
//! `out[b, n] (+)= sw[n] * sum_k w[n, k] * x[b, k]` (times a per-row factor), one tile
//! (`n` rows × a `k` slice) per call, like [`crate::gemm`].
//!
//! Two products share the weight format:
//! - **W8A8** ([`gemm_i8_w8a8`]): activations quantised per row to int8 with an fp32 scale
//!   ([`quantize_acts_i8`]); the `k` sum is exact in i32 and scaled once,
//!   `out = sum * sw[n] * sa[b]`. Every path computes the same integers and finishes with the
//!   same float expression, so every path gives bit-identical results.
//! - **Wide** ([`gemm_i8_wide`]): fp32 activations in natural order against int8 weights
//!   widened to fp32 in registers; `out = sw[n] * sum_k w * x (* row_scale[b])`. Paths differ
//!   only in the order of fp32 additions.
//!
//! # Layouts
//! - Weights `[N, K]` int8, row `n` at `data[n * ld..n * ld + K]` (`ld >= K`, so a caller may
//!   keep other bytes after each row), fp32 scale per row: `w_real[n, k] = sw[n] * w[n, k]`.
//! - Quantised activations `[B, K]` int8 at row stride `ld`, one fp32 scale per row, values in
//!   `-127..=127` (the AVX2 sign trick below needs `-128` absent; the quantiser never makes it).
//!   Or one scale per (row, group) when each row was quantised in equal groups of `K`
//!   ([`ActsI8::grouped`], DeepSeek-V4's `o_r` per output group): the product then cuts the
//!   tile's `k` at the group boundaries, and each block of weight rows runs through every
//!   group before the next block, so the weights still stream once, row by row (a product
//!   per group read every row in strided pieces, one group's span at a time: measured
//!   1.4–1.7× slower at `Wo_b`'s FLASH shape on the shared host).
//! - Output fp32: element `(b, n)` of a tile at `out[b * ld_out + (n - tile.n.start)]`.
//! - Packed weights ([`I8Layout::Packed`], written by [`pack_weights_i8`], viewed by
//!   [`WeightsI8::packed`]): the same `N * K` bytes of a row-major `[N, K]` matrix, reordered
//!   so a kernel step reads contiguous memory. Rows go in groups of [`PACK_ROWS`] (16), `k` in
//!   chunks of [`PACK_K`] (64 bytes); inside a group each chunk is a block of the group's rows
//!   × the chunk's bytes, row after row, and the blocks follow in `k` order:
//!
//!   ```text
//!   g = n / 16, r = n % 16, h = min(16, N - 16 g)      (rows of the group)
//!   c = k / 64, j = k % 64, w = min(64, K - 64 c)      (bytes of the chunk)
//!   index(n, k) = 16 g K + 64 c h + r w + j
//!   ```
//!
//!   No padding: a whole group and a whole chunk make one 1 KiB block (16 rows × 64 bytes,
//!   exactly an AMX A tile at stride 64); the last group may have fewer rows and the last chunk
//!   fewer bytes, and their blocks shrink to `h × w`. The scales stay one per row in row order.
//!   Why: at row stride `K` a kernel step reads 16 (AMX) or 3 (AVX-512) rows a stride apart,
//!   separate streams that cross pages on their own (no transparent huge pages here) and that
//!   the hardware prefetchers follow poorly; packed, an AMX group streams 1 KiB blocks in order.
//!   Every path reads either layout and computes the same integers (bit-identical results). The
//!   SIMD paths need each `k` slice (and, with grouped activations, each group's span) to start
//!   at a multiple of 64 in packed weights; other slices, and the AVX2 and AVX-VNNI paths (whose
//!   machines [`I8Layout::preferred_for`] never packs for), run the portable loops, which read any
//!   element through the formula. The wide product ([`gemm_i8_wide`]) takes row-major weights
//!   only and refuses packed ones by name. Views of a row range of packed weights
//!   ([`WeightsI8::rows_range`]) keep the whole matrix and an offset, so any range works.
//! - Interleaved weights ([`I8Layout::Interleaved`], written by [`pack_weights_i8_as`],
//!   viewed by [`WeightsI8::interleaved`]): the same `N * K` bytes in the same 16-row groups,
//!   but `k` in quads of [`QUAD`] (4) bytes, and inside a group each quad a block of the
//!   group's rows × the quad's bytes:
//!
//!   ```text
//!   q = k / 4, j = k % 4, w = min(4, K - 4 q)           (bytes of the quad)
//!   index(n, k) = 16 g K + 4 q h + r w + j
//!   ```
//!
//!   A whole group's quad is one 64-byte line, 4 bytes of each of its 16 rows: the
//!   `vpdpbusd` operand whose 16 lanes are 16 output rows, against one batch row's quad
//!   broadcast to every lane. The sums then come out with the rows in the lanes: no horizontal
//!   sum per output (the row-major blocks reduce 16 lanes per output, which at 8 batch rows
//!   held them to ~15 GB/s per thread with the weights in L2, against ~25–31 for the
//!   lane-wise kernel; `docs/benchmarks.md`). Only the AVX-512 VNNI and AMX paths (the
//!   latter at any batch: the tiles take packed weights only) read them with SIMD, through
//!   the lane-wise kernel, from segments that start on a whole quad; rows
//!   outside whole groups of a tile, and every other path, go through the formula.
//!
//! # Paths ([`I8Path`], chosen at run time)
//! - Portable: plain loops.
//! - AVX2: 1–4 batch rows stream the weights in blocks over the whole slice with `vpmaddubsw`:
//!   `|w|` as u8 times `sign(x, w)` as s8, pairs summed to i16 (at most `2 * 128 * 127`, no
//!   saturation) then to i32 with `vpmaddwd` against ones. 5 and more go in sets of 8 over `k`
//!   chunks held in L1 on 16-bit values: the activations widened once per call, each weight
//!   vector once per step, products and pair sums by `vpmaddwd` (two multiply-pipe
//!   instructions per batch row and 32 bytes where the sign trick takes three; `avx2.rs`).
//! - AVX-VNNI (256-bit) and AVX-512 VNNI (`vpdpbusd`): the instruction wants u8 × s8, so the
//!   weights enter as `w + 128` (a xor of the sign bit on each loaded vector) against the
//!   activations as they lie, and each batch row's sum over the slice, taken once per call,
//!   removes the offset: `sum (w + 128) x - 128 sum x`. Every `vpdpbusd` is then a useful
//!   one (offsetting the activations instead needs each weight row's sum, a `vpdpbusd` per
//!   weight vector and batch pass: a fifth of the instructions at 8 rows in two passes).
//!   Sums wrap in i32 and the final value is in range, so the wrap cancels.
//!   On interleaved weights the same offset trick runs lane-wise (`avx512::gemm_lanes`): two
//!   16-row groups × up to 8 batch rows in 16 accumulators, each step one line per group.
//! - AMX-INT8 (`tdpbssd`): the weight rows are the A tile as they lie (16 rows × 64 bytes),
//!   the activations are repacked per call into the B tile layout (`k / 4` rows of four bytes
//!   per batch row), so nothing about the weights changes; for batches of at least
//!   [`AMX_MIN_BATCH`] rows, else the VNNI path runs. Interleaved weights are already the B
//!   tile's layout (64 bytes of `k` of a 16-row group are 16 consecutive lines of quads), so
//!   over them the activation rows are the A tile as they lie and the weights the B tile
//!   (`amx::gemm_interleaved`): nothing is repacked either way. At 512 rows (a Qwen3-0.6B
//!   prefill) the lane-wise kernel had taken 2.2× the step time of the row-major AMX pass.
//!
//! The W8A8 blocks prefetch (into L2) the rows of the next block while they stream the current
//! one, a step's worth per row as they go (the AVX2 8-row sets a line per row every other step,
//! a chunk ahead): an int8 row of a small model is only a few cache lines long, too short for
//! the hardware prefetcher to ramp up within it when a block's rows are adjacent (one thread
//! streamed 4.6 GB/s without this against 7.8 GB/s for the bf16 GEMM that prefetches the same
//! way). The AVX2 1–4 row streams do not: each of their far-apart streams reads consecutive
//! rows, which the hardware follows, and their prefetches cost more issue slots than they
//! saved (`avx2.rs`, `block_into`).
//!
//! A product that knows which weight rows the caller streams next ([`gemm_i8_w8a8_then`] with
//! [`NextRows`]) has its last blocks prefetch those rows instead of nothing, so the next call
//! starts on rows already in L2. The expert products of a MoE step are many short calls (one
//! per expert and column block, ~64–128 rows each), each of which would otherwise start cold:
//! an int8 row stream is latency bound at 1–3 batch rows, and its first rows cost most.
//! The AVX-512 VNNI blocks and the AVX2 path's sets (batches of 5 rows and more) use the hint;
//! the other paths, the lane-wise kernel on interleaved weights among them, ignore it.
//!
//! `k` slices are summed in steps of 32 (AVX2, AVX-VNNI) or 64 bytes (AVX-512, AMX) from the
//! slice start, the rest by a scalar loop: no alignment or multiple is required of `K`.

use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};

use half::bf16;

use crate::gemm::{GemmTile, OutMode};
use crate::isa::Isa;
use crate::multiversion::multiversion;

/// Runs `$block::<rows, batch>` over lowered tiles in blocks of `$r` weight rows (single rows
/// at the end) and up to `$b` (at most 8) batch rows, finishing each sum with the slice's
/// scalar tail (the `k` values after the last whole `$step`). `$segs` holds the `k` segments
/// of one tile (the same rows, consecutive `k` ranges, each finished on its own): every block
/// of rows runs through all segments before the next, so a row streams from memory once, in
/// order, however many activation-scale groups split its `k`.
#[cfg(target_arch = "x86_64")]
macro_rules! drive {
    ($segs:expr, $out:expr, $ld_out:expr, $r:expr, $b:expr, $step:expr, $block:ident, $zero:expr) => {{
        let segs = $segs;
        let first = &segs[0];
        let mut n0 = first.n.start;
        while n0 < first.n.end {
            let nr = if first.n.end - n0 >= $r { $r } else { 1 };
            for lw in segs.iter() {
                let tail = lw.k.start + lw.k.len() / $step * $step..lw.k.end;
                let mut b0 = 0;
                while b0 < lw.batch {
                    let bb = (lw.batch - b0).min($b);
                    let mut sums = [[$zero; $b]; $r];
                    // SAFETY: rows n0..n0+nr and batch rows b0..b0+bb lie inside the tile (loop
                    // bounds); the caller's contract covers the features and the slices.
                    // `bb` is at most `$b`, so the last arm of each half is the full block.
                    unsafe {
                        match (nr == $r, bb) {
                            (true, 1) => $block::<$r, 1>(lw, n0, b0, &mut sums),
                            (true, 2) if $b > 2 => $block::<$r, 2>(lw, n0, b0, &mut sums),
                            (true, 3) if $b > 3 => $block::<$r, 3>(lw, n0, b0, &mut sums),
                            (true, 4) if $b > 4 => $block::<$r, 4>(lw, n0, b0, &mut sums),
                            (true, 5) if $b > 5 => $block::<$r, 5>(lw, n0, b0, &mut sums),
                            (true, 6) if $b > 6 => $block::<$r, 6>(lw, n0, b0, &mut sums),
                            (true, 7) if $b > 7 => $block::<$r, 7>(lw, n0, b0, &mut sums),
                            (true, _) => $block::<$r, $b>(lw, n0, b0, &mut sums),
                            (false, 1) => $block::<1, 1>(lw, n0, b0, &mut sums),
                            (false, 2) if $b > 2 => $block::<1, 2>(lw, n0, b0, &mut sums),
                            (false, 3) if $b > 3 => $block::<1, 3>(lw, n0, b0, &mut sums),
                            (false, 4) if $b > 4 => $block::<1, 4>(lw, n0, b0, &mut sums),
                            (false, 5) if $b > 5 => $block::<1, 5>(lw, n0, b0, &mut sums),
                            (false, 6) if $b > 6 => $block::<1, 6>(lw, n0, b0, &mut sums),
                            (false, 7) if $b > 7 => $block::<1, 7>(lw, n0, b0, &mut sums),
                            (false, _) => $block::<1, $b>(lw, n0, b0, &mut sums),
                        }
                    }
                    for r in 0..nr {
                        for b in 0..bb {
                            // Most slices have no tail: skip the call per output element.
                            let t = if tail.is_empty() {
                                $zero
                            } else {
                                lw.dot(n0 + r, b0 + b, tail.clone())
                            };
                            let s = sums[r][b] + t;
                            lw.finish($out, $ld_out, n0 + r, b0 + b, s);
                        }
                    }
                    b0 += bb;
                }
            }
            n0 += nr;
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod peak;
mod portable;

/// Largest `K` a call accepts: `K * 128 * 127` must fit an i32 (the exact integer sum).
pub const MAX_K: usize = 1 << 17;

/// Smallest batch the AMX path takes; narrower batches go to AVX-512 VNNI. A batch of one would
/// use one of a tile's 16 columns. On the Xeon with AMX of session 21 (`examples/
/// gemm_i8_batch8`, one FLASH expert's `[2048, 4096]` streamed from 1.5 GiB of copies, three
/// times its 480 MiB L3, one thread) VNNI streamed 85% of the read bandwidth at batch 4 where
/// the tiles streamed 76%, and 80–82% at batch 8 against 72–74%; at 16 the tiles were ahead
/// (51% against 45%). The DeepSeek-V4 FLASH steps, whose projections and experts run at 8
/// rows, then took 6–9% less time (`docs/benchmarks.md`). An earlier Xeon had measured the
/// two level at batches 4 and 16.
pub const AMX_MIN_BATCH: usize = 9;

/// An int8 product path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum I8Path {
    /// Plain Rust.
    Portable,
    /// AVX2 `vpmaddubsw` / `vpmaddwd` (and FMA for the wide product).
    Avx2,
    /// 256-bit `vpdpbusd` (AVX-VNNI; the wide product runs as on AVX2).
    AvxVnni,
    /// 512-bit `vpdpbusd` (AVX-512 F/BW/VNNI; the wide product in 512-bit registers).
    Avx512Vnni,
    /// AMX-INT8 tiles for batches of [`AMX_MIN_BATCH`] or more, AVX-512 VNNI below.
    Amx,
}

impl I8Path {
    /// Every path, slowest first.
    pub const ALL: [I8Path; 5] = [
        I8Path::Portable,
        I8Path::Avx2,
        I8Path::AvxVnni,
        I8Path::Avx512Vnni,
        I8Path::Amx,
    ];

    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            I8Path::Portable => "portable",
            I8Path::Avx2 => "avx2",
            I8Path::AvxVnni => "avx-vnni",
            I8Path::Avx512Vnni => "avx512-vnni",
            I8Path::Amx => "amx-int8",
        }
    }

    /// Whether this CPU (and, for AMX, the operating system) can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            I8Path::Portable => true,
            I8Path::Avx2 => Isa::Avx2.is_supported(),
            I8Path::AvxVnni => Isa::Avx2.is_supported() && avx_vnni_supported(),
            I8Path::Avx512Vnni => avx512_vnni_supported(),
            I8Path::Amx => {
                avx512_vnni_supported()
                    && amx_int8_supported()
                    && crate::amx::request_tile_permission()
            }
        }
    }

    /// The best path this machine supports, whatever `SIMPLER_ISA` says (detected once).
    pub fn hardware() -> I8Path {
        static HW: AtomicU8 = AtomicU8::new(u8::MAX);
        let i = HW.load(Ordering::Relaxed);
        if let Some(p) = I8Path::ALL.get(usize::from(i)) {
            return *p;
        }
        let best = I8Path::ALL
            .into_iter()
            .rev()
            .find(|p| p.is_supported())
            .unwrap_or(I8Path::Portable);
        HW.store(best as u8, Ordering::Relaxed);
        best
    }

    /// The path of this process: [`I8Path::hardware`] capped by the bf16 path the process runs
    /// ([`Isa::detected`], which `SIMPLER_ISA` lowers), as [`I8Path::capped`] says. What the
    /// weights' int8 layouts are chosen for at load, so uploads and kernels agree.
    pub fn detected() -> I8Path {
        I8Path::hardware().capped(Isa::detected())
    }

    /// This path as a machine whose kernels run on `isa` would have it: unchanged where `isa`
    /// is this machine's best bf16 path (or above), else at most that path's int8 instructions
    /// — plain loops on the portable path, AVX2 on the AVX2 path (an AVX2 machine need not have
    /// AVX-VNNI), 512-bit VNNI on the AVX-512 BF16 path (no AMX-INT8 tiles). So capping the
    /// bf16 path (`SIMPLER_ISA`, `set_process_isa`, `with_isa`) caps the int8 products with it,
    /// as `--versus-isa` and tests that stand in for a smaller machine expect.
    pub fn capped(self, isa: Isa) -> I8Path {
        if isa >= Isa::hardware() {
            return self;
        }
        let top = match isa {
            Isa::Portable => I8Path::Portable,
            Isa::Avx2 => I8Path::Avx2,
            Isa::Avx512Bf16 => I8Path::Avx512Vnni,
            Isa::AmxBf16 => I8Path::Amx,
        };
        self.min(top)
    }

    /// The path int8 kernels on this thread take now: a [`with_i8_path`] override if one is
    /// active; else [`I8Path::hardware`] capped ([`I8Path::capped`]) by the thread's bf16 path
    /// ([`Isa::current`]: a `with_isa` override, the `set_process_isa` choice or
    /// `SIMPLER_ISA`), so `with_isa(Portable, ..)` tests a whole model on plain loops.
    pub fn current() -> I8Path {
        if let Some(p) = OVERRIDE.with(Cell::get) {
            return p;
        }
        I8Path::hardware().capped(Isa::current())
    }
}

/// The path whose kernel [`gemm_i8_w8a8`] runs for `rows` activation rows against weights in
/// `layout` when int8 kernels take `path` (on whole quads or chunks of `k`): AMX-INT8 tiles
/// from [`AMX_MIN_BATCH`] rows and AVX-512 VNNI below them; the AVX-VNNI and AVX2 kernels read
/// row-major weights only, so packed or interleaved ones take the portable loops there. Never
/// a path above `path`. What the dispatch runs and what a report names.
pub fn w8a8_path(path: I8Path, layout: I8Layout, rows: usize) -> I8Path {
    match (path, layout) {
        (I8Path::Amx, _) if rows >= AMX_MIN_BATCH => I8Path::Amx,
        (I8Path::Amx | I8Path::Avx512Vnni, _) => I8Path::Avx512Vnni,
        (I8Path::AvxVnni, I8Layout::RowMajor) => I8Path::AvxVnni,
        (I8Path::Avx2, I8Layout::RowMajor) => I8Path::Avx2,
        _ => I8Path::Portable,
    }
}

thread_local! {
    static OVERRIDE: Cell<Option<I8Path>> = const { Cell::new(None) };
}

/// Runs `f` with every int8 kernel called on this thread taking `path`; `None` (without
/// running `f`) when this machine cannot run it.
pub fn with_i8_path<R>(path: I8Path, f: impl FnOnce() -> R) -> Option<R> {
    if !path.is_supported() {
        return None;
    }
    struct Restore(Option<I8Path>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(path))));
    Some(f())
}

#[cfg(target_arch = "x86_64")]
fn avx_vnni_supported() -> bool {
    is_x86_feature_detected!("avxvnni")
}
#[cfg(target_arch = "x86_64")]
fn avx512_vnni_supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && Isa::Avx2.is_supported()
}
#[cfg(target_arch = "x86_64")]
fn amx_int8_supported() -> bool {
    crate::amx::cpu_amx_features().is_some_and(|(int8, _)| int8)
}
#[cfg(not(target_arch = "x86_64"))]
fn avx_vnni_supported() -> bool {
    false
}
#[cfg(not(target_arch = "x86_64"))]
fn avx512_vnni_supported() -> bool {
    false
}
#[cfg(not(target_arch = "x86_64"))]
fn amx_int8_supported() -> bool {
    false
}

/// Rows per group of packed int8 weights ([`I8Layout::Packed`]): an AMX-INT8 A tile.
pub const PACK_ROWS: usize = 16;
/// Bytes of `k` per chunk of packed int8 weights: one tile row, one 512-bit load.
pub const PACK_K: usize = 64;
/// Bytes of `k` per quad of interleaved int8 weights ([`I8Layout::Interleaved`]): what one
/// 32-bit lane of `vpdpbusd` sums.
pub const QUAD: usize = 4;
/// Fewest activation rows for which the AVX-512 VNNI paths read interleaved weights
/// ([`I8Layout::preferred_for`]). From 4 rows on, the blocks over row-major weights spend
/// more on their per-row horizontal sums and register pressure than on the weights (at 8
/// rows they consumed ~15 GB/s per thread from L2, against ~30 for the lane-wise kernel);
/// below it both run far ahead of memory.
pub const INTERLEAVED_MIN_ROWS: usize = 4;

/// How the values of int8 weights `[N, K]` lie in memory (module docs, "Layouts").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum I8Layout {
    /// Row `n` at `n * ld` (`ld >= K`).
    RowMajor,
    /// Groups of [`PACK_ROWS`] rows × chunks of [`PACK_K`] bytes, blocks in `k` order
    /// ([`packed_index_i8`]), `N * K` bytes.
    Packed,
    /// Groups of [`PACK_ROWS`] rows × quads of [`QUAD`] bytes: a whole group's quad is one
    /// 64-byte line holding 4 bytes of each of its 16 rows, the `vpdpbusd` operand that puts
    /// 16 output rows in the lanes ([`interleaved_index_i8`]), `N * K` bytes.
    Interleaved,
}

impl I8Layout {
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            I8Layout::RowMajor => "row-major",
            I8Layout::Packed => "packed",
            I8Layout::Interleaved => "interleaved",
        }
    }

    /// The layout int8 weights multiplied by `rows` activation rows at a time should be built
    /// in for this machine's kernels: packed where those products run on AMX-INT8 tiles (the
    /// best path is AMX and `rows >= AMX_MIN_BATCH`; a weight tile is then one contiguous
    /// 1 KiB block); interleaved where they run on the AVX-512 VNNI lane-wise kernel (the best
    /// path has AVX-512 VNNI and `rows` is from [`INTERLEAVED_MIN_ROWS`] to 8: at 8 rows the
    /// FLASH `Wq_b` shape streamed 26.5 GB/s interleaved against 19.0 row-major on an AMX Xeon,
    /// `docs/benchmarks.md`); row-major elsewhere (fewer rows, where the row blocks run far
    /// ahead of memory, and machines without AVX-512 VNNI, whose AVX2 and AVX-VNNI paths read
    /// the other layouts only through the portable loops). Decided from
    /// the detected path, not a thread's override, so it is the same for a whole process:
    /// weights packed at load and the kernels reading them agree when both name the same
    /// `rows`.
    pub fn preferred_for(rows: usize) -> I8Layout {
        match I8Path::detected() {
            I8Path::Amx if rows >= AMX_MIN_BATCH => I8Layout::Packed,
            I8Path::Amx | I8Path::Avx512Vnni if rows >= INTERLEAVED_MIN_ROWS => {
                I8Layout::Interleaved
            }
            _ => I8Layout::RowMajor,
        }
    }
}

/// Index of element `(n, k)` of packed int8 weights `[rows, cols]` (module docs, "Layouts").
///
/// # Panics
/// If `(n, k)` lies outside `[rows, cols]`.
pub fn packed_index_i8(rows: usize, cols: usize, n: usize, k: usize) -> usize {
    check_element("packed", rows, cols, n, k);
    packed_index(rows, cols, n, k)
}

fn check_element(what: &str, rows: usize, cols: usize, n: usize, k: usize) {
    assert!(
        n < rows && k < cols,
        "{what} int8 weights: element ({n}, {k}) outside [{rows}, {cols}]"
    );
}

#[inline]
fn packed_index(rows: usize, cols: usize, n: usize, k: usize) -> usize {
    grouped_index(rows, cols, n, k, PACK_K)
}

/// Index of `(n, k)` in 16-row groups whose `k` is cut into chunks of `chunk` bytes, each
/// chunk of a group a block of the group's rows × the chunk's bytes (the last group and chunk
/// shrunk): the packed (`chunk` 64) and interleaved (`chunk` 4) layouts.
#[inline]
fn grouped_index(rows: usize, cols: usize, n: usize, k: usize, chunk: usize) -> usize {
    let (g, r) = (n / PACK_ROWS, n % PACK_ROWS);
    let h = (rows - g * PACK_ROWS).min(PACK_ROWS);
    let (c, j) = (k / chunk, k % chunk);
    let w = (cols - c * chunk).min(chunk);
    g * PACK_ROWS * cols + c * chunk * h + r * w + j
}

/// Index of element `(n, k)` of interleaved int8 weights `[rows, cols]`
/// ([`I8Layout::Interleaved`]): `16 g K + 4 q h + r w + j` for row `16 g + r` of a group of
/// `h` rows and `k = 4 q + j` in a quad of `w` bytes (the last group and quad shrunk).
///
/// # Panics
/// If `(n, k)` lies outside `[rows, cols]`.
pub fn interleaved_index_i8(rows: usize, cols: usize, n: usize, k: usize) -> usize {
    check_element("interleaved", rows, cols, n, k);
    interleaved_index(rows, cols, n, k)
}

#[inline]
fn interleaved_index(rows: usize, cols: usize, n: usize, k: usize) -> usize {
    grouped_index(rows, cols, n, k, QUAD)
}

/// Writes row-major int8 weights `src [rows, cols]` (row stride `ld`) into `dst` in `layout`
/// (row-major: dense, row stride `cols`); `dst` holds exactly `rows * cols` values.
///
/// # Panics
/// As [`pack_weights_i8`].
pub fn pack_weights_i8_as(
    layout: I8Layout,
    src: &[i8],
    rows: usize,
    cols: usize,
    ld: usize,
    dst: &mut [i8],
) {
    match layout {
        I8Layout::Packed => pack_weights_i8(src, rows, cols, ld, dst),
        I8Layout::RowMajor | I8Layout::Interleaved => {
            check_pack(src, rows, cols, ld, dst);
            for n in 0..rows {
                let row = &src[n * ld..n * ld + cols];
                if layout == I8Layout::RowMajor {
                    dst[n * cols..(n + 1) * cols].copy_from_slice(row);
                    continue;
                }
                for (q, piece) in row.chunks(QUAD).enumerate() {
                    let at = interleaved_index(rows, cols, n, q * QUAD);
                    dst[at..at + piece.len()].copy_from_slice(piece);
                }
            }
        }
    }
}

fn check_pack(src: &[i8], rows: usize, cols: usize, ld: usize, dst: &[i8]) {
    assert!(ld >= cols, "pack_weights_i8: ld {ld} < cols {cols}");
    let need = if rows == 0 { 0 } else { (rows - 1) * ld + cols };
    assert!(
        src.len() >= need,
        "pack_weights_i8: {} source bytes for {rows} rows of {cols} at stride {ld}",
        src.len()
    );
    assert_eq!(
        Some(dst.len()),
        rows.checked_mul(cols),
        "pack_weights_i8: destination length for [{rows}, {cols}]"
    );
}

/// Writes row-major int8 weights `src [rows, cols]` (row stride `ld`) into `dst` in the
/// packed layout ([`I8Layout::Packed`]); `dst` holds exactly `rows * cols` values.
///
/// # Panics
/// If `ld < cols`, `src` is shorter than its last row's end, or `dst.len() != rows * cols`.
pub fn pack_weights_i8(src: &[i8], rows: usize, cols: usize, ld: usize, dst: &mut [i8]) {
    check_pack(src, rows, cols, ld, dst);
    for n in 0..rows {
        let row = &src[n * ld..n * ld + cols];
        for (c, piece) in row.chunks(PACK_K).enumerate() {
            let at = packed_index(rows, cols, n, c * PACK_K);
            dst[at..at + piece.len()].copy_from_slice(piece);
        }
    }
}

/// int8 weights `[rows, cols]`, one fp32 scale per row: row-major at row stride `ld`, or
/// packed ([`WeightsI8::packed`]).
#[derive(Clone, Copy, Debug)]
pub struct WeightsI8<'a> {
    data: &'a [i8],
    scales: &'a [f32],
    rows: usize,
    cols: usize,
    ld: usize,
    packed: Option<PackedRows>,
}

/// Where a view of packed or interleaved weights lies in its whole matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PackedRows {
    /// Rows of the whole packed matrix (`data` holds all of it).
    total: usize,
    /// The whole matrix's row of the view's row 0.
    first: usize,
    /// Interleaved ([`I8Layout::Interleaved`]) rather than packed.
    quads: bool,
}

impl<'a> WeightsI8<'a> {
    /// Views `data` as `rows` rows of `cols` values, row `n` starting at `n * ld`.
    ///
    /// # Panics
    /// If `ld < cols`, `cols > MAX_K`, `data` is shorter than the last row's end, or
    /// `scales.len() != rows`.
    pub fn new(
        data: &'a [i8],
        scales: &'a [f32],
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> WeightsI8<'a> {
        assert!(ld >= cols, "int8 weights: ld {ld} < cols {cols}");
        assert!(cols <= MAX_K, "int8 weights: K {cols} > {MAX_K}");
        assert_eq!(
            scales.len(),
            rows,
            "int8 weights: {} scales for {rows} rows",
            scales.len()
        );
        let need = if rows == 0 {
            Some(0)
        } else {
            (rows - 1).checked_mul(ld).and_then(|n| n.checked_add(cols))
        };
        assert!(
            need.is_some_and(|need| data.len() >= need),
            "int8 weights: {} bytes for {rows} rows of {cols} at stride {ld}",
            data.len()
        );
        WeightsI8 {
            data,
            scales,
            rows,
            cols,
            ld,
            packed: None,
        }
    }
    /// Views `data` as packed weights `[rows, cols]` ([`I8Layout::Packed`], as
    /// [`pack_weights_i8`] writes them).
    ///
    /// Values after the first `rows * cols` are not part of the matrix (as after the last
    /// row of row-major weights).
    ///
    /// # Panics
    /// If `cols > MAX_K`, `data` is shorter than `rows * cols`, or `scales.len() != rows`.
    pub fn packed(data: &'a [i8], scales: &'a [f32], rows: usize, cols: usize) -> WeightsI8<'a> {
        WeightsI8::whole(data, scales, rows, cols, false)
    }

    /// Views `data` as interleaved weights `[rows, cols]` ([`I8Layout::Interleaved`], as
    /// [`pack_weights_i8_as`] writes them).
    ///
    /// Values after the first `rows * cols` are not part of the matrix.
    ///
    /// # Panics
    /// If `cols > MAX_K`, `data` is shorter than `rows * cols`, or `scales.len() != rows`.
    pub fn interleaved(
        data: &'a [i8],
        scales: &'a [f32],
        rows: usize,
        cols: usize,
    ) -> WeightsI8<'a> {
        WeightsI8::whole(data, scales, rows, cols, true)
    }

    fn whole(
        data: &'a [i8],
        scales: &'a [f32],
        rows: usize,
        cols: usize,
        quads: bool,
    ) -> WeightsI8<'a> {
        let len = rows.checked_mul(cols).filter(|&len| len <= data.len());
        let Some(len) = len else {
            let what = if quads { "interleaved" } else { "packed" };
            panic!(
                "{what} int8 weights: {} bytes for [{rows}, {cols}]",
                data.len()
            );
        };
        let data = &data[..len];
        WeightsI8 {
            packed: Some(PackedRows {
                total: rows,
                first: 0,
                quads,
            }),
            ..WeightsI8::new(data, scales, rows, cols, cols)
        }
    }
    /// Views `data` as dense weights `[rows, cols]` in `layout` (row stride `cols` when
    /// row-major).
    ///
    /// # Panics
    /// As [`WeightsI8::new`] or [`WeightsI8::packed`].
    pub fn with_layout(
        data: &'a [i8],
        scales: &'a [f32],
        rows: usize,
        cols: usize,
        layout: I8Layout,
    ) -> WeightsI8<'a> {
        match layout {
            I8Layout::RowMajor => WeightsI8::new(data, scales, rows, cols, cols),
            I8Layout::Packed => WeightsI8::packed(data, scales, rows, cols),
            I8Layout::Interleaved => WeightsI8::interleaved(data, scales, rows, cols),
        }
    }
    /// Number of rows (`N`).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns (`K`).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Row stride in elements (row-major; `cols` for packed weights, whose rows have none).
    pub fn ld(&self) -> usize {
        self.ld
    }
    /// The layout of the values.
    pub fn layout(&self) -> I8Layout {
        match self.packed {
            None => I8Layout::RowMajor,
            Some(p) if p.quads => I8Layout::Interleaved,
            Some(_) => I8Layout::Packed,
        }
    }
    /// The per-row scales.
    pub fn scales(&self) -> &'a [f32] {
        self.scales
    }
    /// The values (for packed weights, the whole packed matrix the view lies in).
    pub fn data(&self) -> &'a [i8] {
        self.data
    }
    /// Rows `r` of these weights.
    ///
    /// # Panics
    /// If `r` lies outside the rows.
    pub fn rows_range(&self, r: Range<usize>) -> WeightsI8<'a> {
        assert!(
            r.start <= r.end && r.end <= self.rows,
            "int8 weights: rows {r:?} of {}",
            self.rows
        );
        if let Some(p) = self.packed {
            return WeightsI8 {
                scales: &self.scales[r.clone()],
                rows: r.len(),
                packed: Some(PackedRows {
                    first: p.first + r.start,
                    ..p
                }),
                ..*self
            };
        }
        let start = (r.start * self.ld).min(self.data.len());
        WeightsI8::new(
            &self.data[start..],
            &self.scales[r.clone()],
            r.len(),
            self.cols,
            self.ld,
        )
    }
}

/// Activations quantised per row: int8 `[rows, cols]` at row stride `ld`, values in
/// `-127..=127`, one fp32 scale per row (`x_real[b, k] = sa[b] * x[b, k]`), or one per
/// (row, group) when `k` is quantised in equal groups ([`ActsI8::grouped`]:
/// `x_real[b, k] = sa[b * groups + k / (cols / groups)] * x[b, k]`).
#[derive(Clone, Copy, Debug)]
pub struct ActsI8<'a> {
    data: &'a [i8],
    scales: &'a [f32],
    rows: usize,
    cols: usize,
    ld: usize,
    groups: usize,
}

impl<'a> ActsI8<'a> {
    /// Views `data` as quantised activations (as [`quantize_acts_i8`] writes them).
    ///
    /// # Panics
    /// As [`WeightsI8::new`], and if any value is `-128`.
    pub fn new(
        data: &'a [i8],
        scales: &'a [f32],
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> ActsI8<'a> {
        let w = WeightsI8::new(data, scales, rows, cols, ld);
        for b in 0..rows {
            assert!(
                !holds_i8_min(&data[b * ld..b * ld + cols]),
                "int8 activations: row {b} holds -128"
            );
        }
        ActsI8 {
            data: w.data,
            scales,
            rows,
            cols,
            ld,
            groups: 1,
        }
    }

    /// Views `data` as activations quantised in `groups` equal spans of `cols` per row, with
    /// `scales [rows, groups]` (row-major): a product sums each span exactly and scales it by
    /// its own factor, so one pass over the weights serves every group.
    ///
    /// # Panics
    /// As [`ActsI8::new`], and if `groups` is 0, does not divide `cols`, or
    /// `scales.len() != rows * groups`.
    pub fn grouped(
        data: &'a [i8],
        scales: &'a [f32],
        rows: usize,
        cols: usize,
        ld: usize,
        groups: usize,
    ) -> ActsI8<'a> {
        assert!(
            groups > 0 && cols.is_multiple_of(groups),
            "int8 activations: {cols} columns in {groups} equal groups"
        );
        // Checked: a wrapped product could match a short `scales`.
        assert!(
            rows.checked_mul(groups) == Some(scales.len()),
            "int8 activations: {} scales for {rows} rows of {groups} groups",
            scales.len()
        );
        let one = ActsI8::new(data, &scales[..rows], rows, cols, ld);
        ActsI8 {
            scales,
            groups,
            ..one
        }
    }
    /// Number of batch rows (`B`).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns (`K`).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The scales: one per row, or `[rows, groups]` ([`ActsI8::grouped`]).
    pub fn scales(&self) -> &'a [f32] {
        self.scales
    }
    /// Quantisation groups per row (1 for [`ActsI8::new`]).
    pub fn groups(&self) -> usize {
        self.groups
    }
}

/// Symmetric quantisation of one row: `q = round(x * 127 / max|x|)` (halves to even), in
/// `-127..=127`; returns the scale `max|x| / 127` (0 for an all-zero row, whose values all
/// quantise to 0). Non-finite inputs make a non-finite scale: garbage in, visible garbage out.
///
/// # Panics
/// If `q.len() != x.len()`.
pub fn quantize_row_i8(x: &[f32], q: &mut [i8]) -> f32 {
    assert_eq!(q.len(), x.len(), "quantize_row_i8: lengths");
    quantize_f32(x, q)
}

/// [`quantize_row_i8`] of a bf16 row (weights at load).
///
/// # Panics
/// If `q.len() != x.len()`.
pub fn quantize_row_bf16_i8(x: &[bf16], q: &mut [i8]) -> f32 {
    assert_eq!(q.len(), x.len(), "quantize_row_bf16_i8: lengths");
    quantize_bf16(x, q)
}

// Every SPMD block of an int8 projection quantises its whole input, so these run often: one
// body compiled for the portable, the AVX2 and the AVX-512 path (`multiversion!`), written in
// lane chunks and with `round_ties_even` (one instruction; `round` is a libm call) so the
// compiler vectorises both passes.
multiversion!(
    avx512;
    fn quantize_f32(x: &[f32], q: &mut [i8]) -> f32 {
        let amax = abs_max(x, |v| v);
        scale_round(x.len(), |i| x[i], amax, q)
    }
);

multiversion!(
    avx512;
    fn quantize_bf16(x: &[bf16], q: &mut [i8]) -> f32 {
        let amax = abs_max(x, |v| v.to_f32());
        scale_round(x.len(), |i| x[i].to_f32(), amax, q)
    }
);

/// `c`, an integer value in `-127..=127` or NaN, as `c as i8` gives it (NaN to 0), in
/// operations the compiler vectorises: a float `as` cast is a saturating conversion LLVM
/// leaves scalar (one conversion and byte insert per value: the MoE route task quantised its 8
/// rows of 4096 in ~55 us). `c + 1.5 · 2^23` holds `c` in the low bits of its mantissa.
#[inline(always)]
fn small_int_to_i8(c: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    let c = if c.is_nan() { 0.0 } else { c };
    ((c + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32) as i8
}

/// `max |f(v)|` over the values of `x` (NaNs skipped, as `f32::max` skips them), 32 running
/// maxima (the maximum is exact, so their order does not matter). The body keeps each
/// maximum with a plain comparison (`a > m`, false for a NaN: the `maxps` rule) over whole
/// chunks of 32, several vector registers, so the maxima's latency does not bind.
/// `f32::max`'s NaN rule and indexing through a closure had kept the loop scalar (a load, a
/// compare, a max and a blend per value: half the time of DeepSeek-V4's per-group activation
/// quantisation).
#[inline(always)]
fn abs_max<T: Copy>(x: &[T], f: impl Fn(T) -> f32) -> f32 {
    let mut m = [0.0f32; 32];
    let mut chunks = x.chunks_exact(32);
    for c in &mut chunks {
        for (mm, &v) in m.iter_mut().zip(c) {
            let a = f(v).abs();
            *mm = if a > *mm { a } else { *mm };
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0.0f32, |a, &v| a.max(f(v).abs()));
    m.iter().fold(tail, |a, &v| a.max(v))
}

/// Writes `q[i] = round(x(i) * 127 / amax)` and returns `amax / 127` (zeros and 0 for
/// `amax == 0`).
#[inline(always)]
fn scale_round(n: usize, x: impl Fn(usize) -> f32, amax: f32, q: &mut [i8]) -> f32 {
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let inv = 127.0 / amax;
    for (i, o) in q[..n].iter_mut().enumerate() {
        // The clamp keeps -128 out.
        *o = small_int_to_i8((x(i) * inv).round_ties_even().clamp(-127.0, 127.0));
    }
    amax / 127.0
}

/// Symmetric quantisation of one row as DeepSeek-V4 defines it (`docs/dsv4.md`, "Building
/// blocks"): `scale = max|x| / 127`, `q = round(x / scale)` with ties away from zero, in
/// `-127..=127`; returns the scale (0 for an all-zero row). Differs from
/// [`quantize_row_i8`] only on exact ties (and by dividing by the scale instead of
/// multiplying by its inverse), which decides one int8 step of a value.
///
/// # Panics
/// If `q.len() != x.len()`.
pub fn quantize_row_i8_ties_away(x: &[f32], q: &mut [i8]) -> f32 {
    assert_eq!(q.len(), x.len(), "quantize_row_i8_ties_away: lengths");
    quantize_f32_away(x, q)
}

multiversion!(
    avx512;
    fn quantize_f32_away(x: &[f32], q: &mut [i8]) -> f32 {
        let amax = abs_max(x, |v| v);
        if amax == 0.0 {
            q.fill(0);
            return 0.0;
        }
        let scale = amax / 127.0;
        for (o, &v) in q.iter_mut().zip(x) {
            // Round half away from zero from `trunc` (one instruction, where `round` is a
            // libm call the compiler cannot vectorise): `v - trunc(v)` is exact.
            let y = v / scale;
            let t = y.trunc();
            let r = if (y - t).abs() >= 0.5 {
                t + 1.0f32.copysign(y)
            } else {
                t
            };
            // The clamp keeps -128 out.
            *o = small_int_to_i8(r.clamp(-127.0, 127.0));
        }
        scale
    }
);

/// Quantises fp32 activations `x [rows, cols]` (row stride `ldx`) per row into `q` (row stride
/// `ldq`) and `scales`, each scale multiplied by `row_scale[b]` when given (a deferred per-row
/// factor such as RMSNorm's `1/rms` then costs nothing in the product).
///
/// # Panics
/// If a slice is too short for its rows.
#[allow(clippy::too_many_arguments)]
pub fn quantize_acts_i8(
    x: &[f32],
    rows: usize,
    cols: usize,
    ldx: usize,
    row_scale: Option<&[f32]>,
    q: &mut [i8],
    ldq: usize,
    scales: &mut [f32],
) {
    assert!(scales.len() >= rows, "quantize_acts_i8: scales");
    for b in 0..rows {
        let s = quantize_row_i8(&x[b * ldx..b * ldx + cols], &mut q[b * ldq..b * ldq + cols]);
        scales[b] = s * row_scale.map_or(1.0, |r| r[b]);
    }
}

multiversion!(
    /// Whether `a` holds `-128`: its minimum, a reduction the compiler vectorises
    /// (`vpminsb`). Every [`ActsI8::new`] scans its rows: the slice's `contains` ran a
    /// word-at-a-time search, 1–2% of all samples of the 3-row expert products in 64-row calls.
    pub(crate) fn holds_i8_min(a: &[i8]) -> bool {
        a.iter().fold(i8::MAX, |m, &v| m.min(v)) == i8::MIN
    }
);

/// Arguments checked and lowered for the W8A8 path kernels: one `k` segment of a tile that
/// lies inside one activation-scale group.
#[derive(Clone)]
struct Lowered<'a> {
    w: &'a [i8],
    wa: WAddr,
    sw: &'a [f32],
    a: &'a [i8],
    lda: usize,
    sa: &'a [f32],
    /// Activation scales per row (`sa[b * groups + group]`).
    groups: usize,
    /// The activation-scale group this segment's `k` lies in.
    group: usize,
    batch: usize,
    n: Range<usize>,
    k: Range<usize>,
    mode: OutMode,
    /// The rows the caller streams after this tile ([`NextRows`]).
    next: Option<NextAddr<'a>>,
}

/// The lowered [`NextRows`]: their values and where they lie.
#[derive(Clone, Copy)]
struct NextAddr<'a> {
    w: &'a [i8],
    wa: WAddr,
    /// The first row (of the view) streamed next, and the view's rows.
    first: usize,
    rows: usize,
}

impl NextAddr<'_> {
    /// Pointer to element `(first + i, k)` and the distance between that row's 64-byte chunks,
    /// or `None` past the view's rows. `k` may lie past the row's end: the pointer then only
    /// feeds prefetches (wrapping arithmetic, never dereferenced).
    #[inline]
    fn row(&self, i: usize, k: usize) -> Option<(*const i8, usize)> {
        let n = self.first + i;
        if n >= self.rows || self.wa.cols == 0 {
            return None;
        }
        // The pointer is computed from the row's first value, inside the slice; the offset to
        // `k` wraps rather than being checked, since prefetching never reads architecturally.
        let at = self.wa.index(n, 0);
        let p = self.w[at..].as_ptr();
        let off = self.wa.index(n, k.min(self.wa.cols - 1)) - at;
        Some((p.wrapping_add(off), self.wa.chunk_stride(n)))
    }
}

/// The weight rows a caller streams right after a product ([`gemm_i8_w8a8_then`]): rows
/// `first..` of `w`. A hint only: results never depend on it.
#[derive(Clone, Copy, Debug)]
pub struct NextRows<'a> {
    w: WeightsI8<'a>,
    first: usize,
}

impl<'a> NextRows<'a> {
    /// Rows `first..` of `w` (nothing is prefetched when `first` is past its rows).
    pub fn new(w: WeightsI8<'a>, first: usize) -> NextRows<'a> {
        NextRows { w, first }
    }
}

/// Where the weight values of a lowered tile lie: row-major at stride `ldw`, or packed.
#[derive(Clone, Copy, Debug)]
struct WAddr {
    ldw: usize,
    cols: usize,
    packed: Option<PackedRows>,
}

impl WAddr {
    fn of(w: &WeightsI8<'_>) -> WAddr {
        WAddr {
            ldw: w.ld,
            cols: w.cols,
            packed: w.packed,
        }
    }

    /// Index of element `(n, k)` (`n` a row of the view) in the weight values.
    #[inline]
    fn index(&self, n: usize, k: usize) -> usize {
        match self.packed {
            None => n * self.ldw + k,
            Some(p) if p.quads => interleaved_index(p.total, self.cols, p.first + n, k),
            Some(p) => packed_index(p.total, self.cols, p.first + n, k),
        }
    }

    /// Values of row `n` that lie contiguously from `k` on (to the end of `k`'s chunk when
    /// packed, of its quad when interleaved), at most `len`.
    #[inline]
    fn run(&self, k: usize, len: usize) -> usize {
        match self.packed {
            None => len,
            Some(p) if p.quads => len.min(QUAD - k % QUAD),
            Some(_) => len.min(PACK_K - k % PACK_K),
        }
    }

    /// Distance between the starts of consecutive 64-byte chunks of row `n` (from a `k` that
    /// is a multiple of 64 when packed).
    #[inline]
    fn chunk_stride(&self, n: usize) -> usize {
        match self.packed {
            None => PACK_K,
            Some(p) => {
                let g = (p.first + n) / PACK_ROWS;
                PACK_K * (p.total - g * PACK_ROWS).min(PACK_ROWS)
            }
        }
    }

    /// Whether row `n` starts a whole group of [`PACK_ROWS`] rows (packed or interleaved) of
    /// the view.
    #[inline]
    fn whole_group_at(&self, n: usize) -> bool {
        self.packed.is_none_or(|p| {
            (p.first + n).is_multiple_of(PACK_ROWS) && p.first + n + PACK_ROWS <= p.total
        })
    }
}

impl Lowered<'_> {
    /// Exact i32 sum of row `n` against batch row `b` over `k`.
    #[inline]
    fn dot(&self, n: usize, b: usize, k: Range<usize>) -> i32 {
        let a = &self.a[b * self.lda..];
        let mut sum = 0i32;
        let mut i = k.start;
        while i < k.end {
            let len = self.wa.run(i, k.end - i);
            let w = &self.w[self.wa.index(n, i)..][..len];
            sum = w
                .iter()
                .zip(&a[i..i + len])
                .map(|(&w, &a)| i32::from(w) * i32::from(a))
                .fold(sum, i32::wrapping_add);
            i += len;
        }
        sum
    }

    /// Pointer to element `(n, k)` of the weights, `n` a row of the tile.
    #[inline]
    fn w_ptr(&self, n: usize, k: usize) -> *const i8 {
        self.w[self.wa.index(n, k)..].as_ptr()
    }

    /// Writes one finished sum (the same expression on every path).
    #[inline]
    fn finish(&self, out: &mut [f32], ld_out: usize, n: usize, b: usize, sum: i32) {
        let v = sum as f32 * self.sw[n] * self.sa[b * self.groups + self.group];
        let o = &mut out[b * ld_out + (n - self.n.start)];
        match self.mode {
            OutMode::Store => *o = v,
            OutMode::Add => *o += v,
        }
    }
}

/// The tile `lw` (whose `k` may cross groups of `span` values) cut at the group boundaries:
/// one segment per group it touches, in `k` order, the first with the tile's output mode and
/// the others adding to it.
fn segments<'a>(lw: &Lowered<'a>, span: usize) -> Vec<Lowered<'a>> {
    let mut segs = Vec::new();
    let mut k0 = lw.k.start;
    while k0 < lw.k.end {
        let group = k0 / span;
        let k1 = ((group + 1) * span).min(lw.k.end);
        segs.push(Lowered {
            group,
            k: k0..k1,
            mode: if k0 == lw.k.start {
                lw.mode
            } else {
                OutMode::Add
            },
            ..lw.clone()
        });
        k0 = k1;
    }
    if segs.is_empty() {
        segs.push(lw.clone());
    }
    segs
}

/// A lowered W8A8 tile with each batch row's activation sum over the slice's body (the
/// `k` values in whole steps of `step` bytes), the offset the VNNI paths remove.
#[cfg(target_arch = "x86_64")]
struct WithActSums<'l, 'a> {
    lw: &'l Lowered<'a>,
    sums: Vec<i32>,
}

#[cfg(target_arch = "x86_64")]
impl<'l, 'a> WithActSums<'l, 'a> {
    fn new(lw: &'l Lowered<'a>, step: usize) -> WithActSums<'l, 'a> {
        let body = lw.k.start..lw.k.start + lw.k.len() / step * step;
        let sums = (0..lw.batch)
            .map(|b| sum_i8(&lw.a[b * lw.lda + body.start..b * lw.lda + body.end]))
            .collect();
        WithActSums { lw, sums }
    }

    /// `128 ·` batch row `b`'s sum, the offset its body sums carry.
    #[inline]
    fn offset(&self, b: usize) -> i32 {
        self.sums[b].wrapping_mul(128)
    }
}

multiversion!(
    #[cfg(target_arch = "x86_64")]
    /// The sum of `a` (exact: at most [`MAX_K`] values of magnitude 128 fit an i32), in 32
    /// running lanes the compiler keeps in vector registers. Taken once per call and batch row
    /// on the VNNI paths: compiled for the baseline, the plain sum widened four bytes at a time
    /// and was ~8% of the expert products' samples at 3 rows and 64-row calls.
    fn sum_i8(a: &[i8]) -> i32 {
        const LANES: usize = 32;
        let mut acc = [0i32; LANES];
        let mut chunks = a.chunks_exact(LANES);
        for c in &mut chunks {
            for (s, &v) in acc.iter_mut().zip(c) {
                *s += i32::from(v);
            }
        }
        let tail: i32 = chunks.remainder().iter().map(|&v| i32::from(v)).sum();
        acc.iter().sum::<i32>() + tail
    }
);

#[cfg(target_arch = "x86_64")]
impl<'a> std::ops::Deref for WithActSums<'_, 'a> {
    type Target = Lowered<'a>;
    fn deref(&self) -> &Lowered<'a> {
        self.lw
    }
}

/// Checks a tile against the weights, `batch` rows of `K`, and an output of stride `ld_out`;
/// `false` when there is nothing to do.
fn check_tile(
    w: &WeightsI8<'_>,
    kx: usize,
    batch: usize,
    tile: &GemmTile,
    out: &[f32],
    ld_out: usize,
) -> bool {
    let (n, k) = (&tile.n, &tile.k);
    assert!(
        n.start <= n.end && n.end <= w.rows(),
        "gemm_i8: n range {n:?} outside {} rows",
        w.rows()
    );
    assert!(
        k.start <= k.end && k.end <= w.cols(),
        "gemm_i8: k range {k:?} outside {} cols",
        w.cols()
    );
    assert_eq!(
        kx,
        w.cols(),
        "gemm_i8: activations K {kx} != weights K {}",
        w.cols()
    );
    if n.is_empty() || batch == 0 {
        return false;
    }
    assert!(
        batch == 1 || ld_out >= n.len(),
        "gemm_i8: ld_out {ld_out} < tile width {}",
        n.len()
    );
    let need = (batch - 1)
        .checked_mul(ld_out)
        .and_then(|v| v.checked_add(n.len()));
    assert!(
        need.is_some_and(|need| out.len() >= need),
        "gemm_i8: out too short"
    );
    true
}

/// One tile of `out[b, n] (+)= sw[n] * sa[b] * sum_{k in tile.k} w[n, k] * x[b, k]` for every
/// batch row of `x` (exact i32 sums; bit-identical on every path). With grouped activations
/// ([`ActsI8::grouped`]) each group's part of `tile.k` is summed and scaled on its own, in `k`
/// order, the first part stored or added as `tile.mode` says and the others added: the same
/// values as one call per group with that group's scales, in one pass over the weights.
///
/// # Panics
/// If the tile lies outside `w`, `x` has a different `K`, or `out` is too short for
/// `x.rows()` rows of stride `ld_out`.
pub fn gemm_i8_w8a8(
    w: WeightsI8<'_>,
    x: ActsI8<'_>,
    tile: &GemmTile,
    out: &mut [f32],
    ld_out: usize,
) {
    gemm_i8_w8a8_then(w, x, tile, out, ld_out, None);
}

/// [`gemm_i8_w8a8`] that prefetches `next` (the rows the caller streams after this tile)
/// during its last blocks (module docs). The same results as without the hint.
///
/// # Panics
/// As [`gemm_i8_w8a8`].
pub fn gemm_i8_w8a8_then(
    w: WeightsI8<'_>,
    x: ActsI8<'_>,
    tile: &GemmTile,
    out: &mut [f32],
    ld_out: usize,
    next: Option<NextRows<'_>>,
) {
    if !check_tile(&w, x.cols(), x.rows(), tile, out, ld_out) {
        return;
    }
    let lw = Lowered {
        w: w.data,
        wa: WAddr::of(&w),
        sw: w.scales,
        a: x.data,
        lda: x.ld,
        sa: x.scales,
        groups: x.groups,
        group: 0,
        batch: x.rows(),
        n: tile.n.clone(),
        k: tile.k.clone(),
        mode: tile.mode,
        next: next.map(|nx| NextAddr {
            w: nx.w.data,
            wa: WAddr::of(&nx.w),
            first: nx.first,
            rows: nx.w.rows(),
        }),
    };
    let segs = segments(&lw, x.cols / x.groups);
    // Packed weights: the SIMD paths step through whole 64-byte chunks from each segment's
    // start; interleaved ones through whole quads (module docs, "Layouts").
    let step = match w.layout() {
        I8Layout::RowMajor => 1,
        I8Layout::Packed => PACK_K,
        I8Layout::Interleaved => QUAD,
    };
    let simd = segs
        .iter()
        .all(|s| s.k.start.is_multiple_of(step) || s.k.len() < step);
    #[cfg(target_arch = "x86_64")]
    if simd {
        let path = I8Path::current();
        // SAFETY: `I8Path::current` returns a path only when `is_supported` said this CPU has
        // its features (and, for AMX, Linux granted the tile state); every segment is the
        // tile checked above restricted to a `k` range inside it, starting on a whole quad
        // when interleaved (checked just above).
        // `w8a8_path` never names a path above `path`.
        unsafe {
            match (w8a8_path(path, w.layout(), lw.batch), w.layout()) {
                (I8Path::Amx, I8Layout::Interleaved) => {
                    return amx::gemm_interleaved(&segs, out, ld_out);
                }
                (I8Path::Amx, _) => return amx::gemm(&segs, out, ld_out),
                (I8Path::Avx512Vnni, I8Layout::Interleaved) => {
                    return avx512::gemm_lanes(&segs, out, ld_out);
                }
                (I8Path::Avx512Vnni, _) => return avx512::gemm(&segs, out, ld_out),
                (I8Path::AvxVnni, _) => return avx2::gemm_vnni(&segs, out, ld_out),
                (I8Path::Avx2, _) => return avx2::gemm(&segs, out, ld_out),
                (I8Path::Portable, _) => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd;
    portable::gemm(&segs, out, ld_out);
}

/// Arguments checked and lowered for the wide path kernels.
struct LoweredWide<'a> {
    w: &'a [i8],
    ldw: usize,
    sw: &'a [f32],
    x: &'a [f32],
    ldx: usize,
    row_scale: Option<&'a [f32]>,
    batch: usize,
    n: Range<usize>,
    k: Range<usize>,
    mode: OutMode,
}

impl LoweredWide<'_> {
    /// fp32 sum of row `n` against batch row `b` over `k`, in order.
    #[inline]
    fn dot(&self, n: usize, b: usize, k: Range<usize>) -> f32 {
        let w = &self.w[n * self.ldw..];
        let x = &self.x[b * self.ldx..];
        k.map(|i| f32::from(w[i]) * x[i]).sum()
    }

    #[inline]
    fn finish(&self, out: &mut [f32], ld_out: usize, n: usize, b: usize, sum: f32) {
        let mut v = sum * self.sw[n];
        if let Some(r) = self.row_scale {
            v *= r[b];
        }
        let o = &mut out[b * ld_out + (n - self.n.start)];
        match self.mode {
            OutMode::Store => *o = v,
            OutMode::Add => *o += v,
        }
    }
}

/// One tile of `out[b, n] (+)= sw[n] * sum_{k in tile.k} w[n, k] * x[b, k] (* row_scale[b])`
/// with `x` fp32 `[batch, K]` in natural order at row stride `ldx`.
///
/// # Panics
/// As [`gemm_i8_w8a8`], if `x` is too short or `row_scale` is not `batch` long, and if `w`
/// is packed (this product reads row-major weights only).
#[allow(clippy::too_many_arguments)]
pub fn gemm_i8_wide(
    w: WeightsI8<'_>,
    x: &[f32],
    batch: usize,
    ldx: usize,
    row_scale: Option<&[f32]>,
    tile: &GemmTile,
    out: &mut [f32],
    ld_out: usize,
) {
    assert!(
        w.packed.is_none(),
        "gemm_i8_wide: {} int8 weights are not supported (row-major only)",
        w.layout().name()
    );
    if !check_tile(&w, w.cols(), batch, tile, out, ld_out) {
        return;
    }
    assert!(
        ldx >= w.cols()
            && (batch - 1)
                .checked_mul(ldx)
                .and_then(|n| n.checked_add(w.cols()))
                .is_some_and(|need| x.len() >= need),
        "gemm_i8_wide: x too short"
    );
    if let Some(r) = row_scale {
        assert_eq!(r.len(), batch, "gemm_i8_wide: row_scale len");
    }
    let lw = LoweredWide {
        w: w.data,
        ldw: w.ld,
        sw: w.scales,
        x,
        ldx,
        row_scale,
        batch,
        n: tile.n.clone(),
        k: tile.k.clone(),
        mode: tile.mode,
    };
    #[cfg(target_arch = "x86_64")]
    {
        let path = I8Path::current();
        // SAFETY: the path is supported by this CPU (`I8Path::current`); `lw` was checked
        // above.
        unsafe {
            match path {
                I8Path::Amx | I8Path::Avx512Vnni => return avx512::gemm_wide(&lw, out, ld_out),
                I8Path::AvxVnni | I8Path::Avx2 => return avx2::gemm_wide(&lw, out, ld_out),
                I8Path::Portable => {}
            }
        }
    }
    portable::gemm_wide(&lw, out, ld_out);
}

#[cfg(test)]
mod quantise_tests {
    use super::*;
    use crate::isa::{Isa, with_isa};

    #[test]
    fn small_int_to_i8_is_the_cast_on_its_whole_domain() {
        for c in -127..=127 {
            assert_eq!(small_int_to_i8(c as f32), c as i8, "{c}");
        }
        assert_eq!(small_int_to_i8(-0.0), 0);
        // A float `as` cast maps NaN to 0.
        assert_eq!(small_int_to_i8(f32::NAN), 0);
    }

    /// Both row quantisers, on every path, against the plain scalar formulas with a float
    /// `as i8` cast: long rows (the vector body), ragged tails, ties, and a NaN (which the
    /// maximum skips and which quantises to 0).
    #[test]
    fn row_quantisers_match_the_scalar_cast_on_every_path() {
        for n in [4096usize, 1030, 7, 1] {
            let mut x: Vec<f32> = (0..n)
                .map(|i| ((i as f32 * 0.618).sin() * 3.0) + if i % 13 == 0 { 0.5 } else { 0.0 })
                .collect();
            if n > 3 {
                x[3] = f32::NAN;
            }
            let amax = x
                .iter()
                .filter(|v| !v.is_nan())
                .fold(0.0f32, |a, v| a.max(v.abs()));
            let even: Vec<i8> = x
                .iter()
                .map(|&v| (v * (127.0 / amax)).round_ties_even().clamp(-127.0, 127.0) as i8)
                .collect();
            let scale = amax / 127.0;
            let away: Vec<i8> = x
                .iter()
                .map(|&v| (v / scale).round().clamp(-127.0, 127.0) as i8)
                .collect();
            for isa in Isa::ALL {
                let Some((q_even, q_away)) = with_isa(isa, || {
                    let (mut a, mut b) = (vec![9i8; n], vec![9i8; n]);
                    quantize_row_i8(&x, &mut a);
                    quantize_row_i8_ties_away(&x, &mut b);
                    (a, b)
                }) else {
                    continue;
                };
                assert_eq!(q_even, even, "{isa:?} n {n} (nearest even)");
                assert_eq!(q_away, away, "{isa:?} n {n} (ties away)");
            }
        }
    }
}
