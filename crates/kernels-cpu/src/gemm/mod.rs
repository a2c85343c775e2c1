//! bf16 matrix products with fp32 accumulation: `out[b, n] (+)= sum_k w[n, k] * x[b, k]`, one
//! tile (`n` rows × a `k` slice) per call, so split-K partial sums can accumulate into a
//! zero-seeded fp32 buffer.
//!
//! # Layouts
//! - Weights `[N, K]` bf16 in one of two [`WeightLayout`]s:
//!   - `RowMajor`: row `n` is contiguous along `K` (the HF `[out, in]` layout), element
//!     `(n, k)` at `n * K + k`.
//!   - `Tiled`: the streaming order of the AVX-512 BF16 and AMX paths, made once at load by
//!     [`tile_weights_bf16`]. Rows form groups of [`TILE_ROWS`] = 16, `K` steps of
//!     [`TILE_COLS`] = 32; one group's step is a 1 KiB block (16 rows × 32 elements, row-major
//!     inside: exactly one AMX tile of 64-byte rows), and a group's blocks follow each other
//!     along `K`, then the next group. With `Kp = K` rounded up to 32, element `(n, k)` is at
//!     [`tiled_index`]: `((n / 16 * (Kp / 32) + k / 32) * 16 + n % 16) * 32 + k % 32`. The
//!     buffer holds `N` rounded up to 16 rows of `Kp` elements ([`tiled_len`]); the padding
//!     (rows past `N`, columns past `K`) is zero. A kernel then reads each row group as one
//!     sequential stream (an AMX tile load is 1 KiB of consecutive bytes instead of a 64-byte
//!     line from each of 16 rows a row apart, which the hardware prefetchers follow poorly).
//!     Rows `16 g..` of a tiled matrix are again a tiled matrix (a row group is contiguous), so
//!     a row slice from a multiple of 16 ([`WeightsBf16::row_range`]) needs no copy; when
//!     `K % 32 == 0` and `N % 16 == 0` the tiled buffer is exactly as long as the row-major
//!     one, so byte offsets of such row slices agree between the layouts.
//!     Tiles on tiled weights start at a multiple of 16 rows and of 32 in `K` (else
//!     [`gemm_bf16`] panics, as for a tile outside the matrix).
//!     Which paths benefit: [`tiled_weights_pay`] (the AMX path, which takes tiled weights at
//!     every batch). The AVX-512 BF16 path streams the tiled form directly too (a whole group
//!     per pass); the AVX2 path never receives it from a model that asks
//!     [`tiled_weights_pay`], and computes it (correctly, slowly) through the portable path.
//!   - `Pairs`: the streaming order of the AVX2 path's batched products, made once at load by
//!     [`pair_weights_bf16`]. Rows form groups of [`PAIR_ROWS`] = 8; inside a group the
//!     elements go by pairs of `K`: pair `p` of the group is 16 bf16 (32 bytes), rows `8 g ..
//!     8 g + 8` at `k = 2 p` and `2 p + 1`, interleaved row by row. With `Kp = K` rounded up to
//!     2, element `(n, k)` is at [`pairs_index`]:
//!     `((n / 8 * (Kp / 2) + k / 2) * 8 + n % 8) * 2 + k % 2`; the buffer holds `N` rounded up to 8 rows of `Kp` elements ([`pairs_len`]),
//!     padding zero. One 256-bit load is then eight rows' pair at one `k`: a shift left by 16
//!     gives the eight rows at the even `k` as fp32 and a mask the eight at the odd `k`, each
//!     multiplied by one broadcast activation, so eight output rows accumulate lane by lane
//!     (no horizontal sums) and each batch row's activations are read as scalars instead of
//!     as a vector per weight vector (`avx2/pairs.rs` gives the measurements). A row group
//!     is contiguous, so row slices from a multiple of 8 need no copy, and when `K` is even
//!     and `N % 8 == 0` the buffer is exactly as long as the row-major one. Tiles on paired
//!     weights start at a multiple of 8 rows ([`gemm_bf16`] panics otherwise). The AVX-512
//!     BF16 path takes the same 32 bytes as the operand of a 256-bit `vdpbf16ps` (eight rows'
//!     pair against a broadcast pair of activations: no widening, `avx512_pairs.rs`); the
//!     portable path gathers rows.
//! - Activations are *packed* once per layer input by [`pack_acts_bf16`]: fp32 `[B, K]` where
//!   each full 16-element block of a row is reordered to `[x0, x2, .., x14, x1, x3, .., x15]`
//!   (a row's last `K % 16` elements stay in order). The AVX2 path widens a 256-bit load of
//!   16 bf16 weights into their even and odd halves with one shift and one mask, and these meet
//!   the packed activations lane for lane.
//! - Output fp32: element `(b, n)` of a tile lives at `out[b * ld_out + (n - tile.n.start)]`.
//!
//! # Speed (see `docs/performance.md`)
//! Batch 1–2 is bandwidth-bound: the AVX2 path streams four rows per pass with software
//! prefetch ~512 B ahead that carries on into the next rows past a row's end. From batch 3 an
//! assembly loop keeps a 3 × 4 block of accumulators in registers (a last group of three batch
//! rows padded to four), each widened weight vector feeding four FMAs, prefetching 2 KiB
//! ahead; from batch 8 a row group's second batch group prefetches the next row group.
//! From batch 64 (prefill) the AVX2 path widens each weight once per call into fp32 panels
//! and runs a register-blocked 6 × 16 micro-kernel over them (`avx2/panel.rs`). On paired
//! weights the AVX2 path runs one broadcast kernel at every batch (`avx2/pairs.rs`), faster
//! than the passes above from batch 5 and level below.
//!
//! # Paths (chosen per call on [`Isa::current`])
//! - `amx-bf16`, batch ≥ 5, or any batch on tiled weights: AMX tiles (`amx.rs`): the weights
//!   are the tile unit's `A` operand in place, the activations are converted per call into
//!   VNNI tiles (one batch row on tiled weights: one-column tiles over four streams, no
//!   conversion).
//! - `avx512-bf16` (and `amx-bf16` below batch 5): `vdpbf16ps` on the weights as they lie and
//!   the activations converted per call to natural-order bf16: dot products over row-major or
//!   tiled weights (`avx512.rs`), broadcast pairs over paired weights from batch 2
//!   (`avx512_pairs.rs`; batch 1 of paired weights takes the AVX2 passes).
//! - `avx2`: the even/odd widening above (`avx2/`); tiled weights go to `portable`.
//! - `portable`: plain Rust (tiled weights: each row's tile body is gathered into a row first).
//!
//! The bf16 paths round activations that are not bf16 values to nearest even (the model's
//! activations are bf16 values, so for them every path multiplies the same numbers).

use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use half::bf16;

use crate::isa::Isa;
use crate::multiversion::multiversion;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_pairs;
mod portable;

/// The 16 × 16 32-bit transpose of the AMX path (the prefill attention's tiles use it too).
#[cfg(target_arch = "x86_64")]
pub(crate) use amx::transpose16 as amx_transpose16;

/// The AMX tile configuration of the GEMM (eight 16 × 64-byte tiles), for the peak measurement
/// and the prefill attention.
#[cfg(target_arch = "x86_64")]
pub(crate) fn amx_tile_config() -> *const u8 {
    amx::tile_config()
}

/// Which path [`gemm_bf16`] takes for a product of `batch` row-major activation rows when
/// kernels run on `isa` (AMX tiles start at batch 5; batches 3–4 take the AVX-512 BF16 path,
/// batches 1–2 the AVX2 passes).
pub fn path_for_batch(isa: Isa, batch: usize) -> Isa {
    path_for(isa, batch, WeightLayout::RowMajor)
}

/// Which path [`gemm_bf16`] takes for `batch` activation rows against weights in `layout` on
/// `isa`, never a wider one than `isa`: the dispatch itself asks this function, so what a
/// bench or test names is what runs. Row-major weights as [`path_for_batch`] says; tiled
/// weights take the AMX tiles at every batch (a tile load of a tiled block is 1 KiB in order;
/// one batch row gets its own pass over four streams, level with the vector path on row-major
/// weights), the AVX-512 BF16 path below AMX and the portable loops below that (the AVX2
/// passes read rows in place); paired weights take the AVX-512 BF16 broadcast kernel from
/// batch 2 where the path has it and the AVX2 passes below that (and on AVX2).
pub fn path_for(isa: Isa, batch: usize, layout: WeightLayout) -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let (amx, avx512, avx2) = (
            isa >= Isa::AmxBf16,
            isa >= Isa::Avx512Bf16,
            isa >= Isa::Avx2,
        );
        match layout {
            WeightLayout::Pairs if avx512 && batch >= AVX512_PAIRS_MIN_BATCH => Isa::Avx512Bf16,
            WeightLayout::Pairs if avx2 => Isa::Avx2,
            WeightLayout::Tiled if amx => Isa::AmxBf16,
            WeightLayout::Tiled if avx512 => Isa::Avx512Bf16,
            WeightLayout::RowMajor if amx && batch >= amx::MIN_BATCH => Isa::AmxBf16,
            WeightLayout::RowMajor if avx512 && batch > AVX2_STREAMS_MAX_BATCH => Isa::Avx512Bf16,
            WeightLayout::RowMajor if avx2 => Isa::Avx2,
            _ => Isa::Portable,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, batch, layout);
        Isa::Portable
    }
}

/// The batch from which the AVX2 path takes its packed prefill kernel, set process-wide by
/// [`set_avx2_panel_min_batch`] (0: the kernel's default).
static AVX2_PANEL_MIN_BATCH: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// [`with_avx2_panel_min_batch`]'s override on this thread.
    static AVX2_PANEL_OVERRIDE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Sets the least batch at which the AVX2 path takes its packed prefill kernel (the
/// register-blocked product over widened weight panels) instead of its dot-product passes, for
/// every thread without a [`with_avx2_panel_min_batch`] override (`None`: the default, 64), so
/// a benchmark can alternate the two on the runtime's worker threads. `Some(usize::MAX)` turns
/// the packed kernel off. Other paths ignore it.
pub fn set_avx2_panel_min_batch(min: Option<usize>) {
    AVX2_PANEL_MIN_BATCH.store(min.map_or(0, |m| m.max(1)), Ordering::Relaxed);
}

/// Whether the AVX-512 BF16 paired kernel prefetches a multi-run pass's next groups into L1
/// (the default; `avx512_pairs::L1_PREFETCH_RUNS`) or L2 on every thread.
static PAIRED_L1_PREFETCH: AtomicBool = AtomicBool::new(true);

/// Sets where the AVX-512 BF16 paired kernel's passes of 2–4 full runs (16, 24 or 32 batch rows)
/// prefetch the next pass's weights on every thread: into L1 (`true`, the default) or L2
/// (`false`, what the other batches do), so a benchmark can compare the two on the same threads (the
/// results are the same bits either way). Other paths ignore it.
pub fn set_paired_l1_prefetch(on: bool) {
    PAIRED_L1_PREFETCH.store(on, Ordering::Relaxed);
}

/// The [`set_paired_l1_prefetch`] setting.
#[cfg(target_arch = "x86_64")]
fn paired_l1_prefetch() -> bool {
    PAIRED_L1_PREFETCH.load(Ordering::Relaxed)
}

/// Runs `f` with [`set_avx2_panel_min_batch`]`(Some(min))` in force on this thread alone.
pub fn with_avx2_panel_min_batch<R>(min: usize, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            AVX2_PANEL_OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(AVX2_PANEL_OVERRIDE.with(|o| o.replace(Some(min.max(1)))));
    f()
}

/// Whether the AVX2 assembly pass spreads the prefetch of a pass's successor over its first
/// two groups of batch rows (the default), set process-wide by [`set_avx2_spread_prefetch`].
static AVX2_SPREAD_PREFETCH: AtomicBool = AtomicBool::new(true);

/// Turns the AVX2 path's spread prefetch on (the default) or off for every thread, so a
/// benchmark can alternate the two in one process. On: at 7 batch rows and more, the first
/// two groups of four batch rows of a pass each prefetch half of the next pass's weight rows,
/// at half the rate. Off: the second group prefetches all of them and the first runs ahead in
/// its own rows. Results are the same bits either way; other paths ignore it.
pub fn set_avx2_spread_prefetch(on: bool) {
    AVX2_SPREAD_PREFETCH.store(on, Ordering::Relaxed);
}

/// Whether the AVX2 spread prefetch is on ([`set_avx2_spread_prefetch`]).
#[cfg(target_arch = "x86_64")]
fn avx2_spread_prefetch() -> bool {
    AVX2_SPREAD_PREFETCH.load(Ordering::Relaxed)
}

/// The least batch of the AVX2 packed prefill kernel in force on this thread (`default` when
/// nothing is set).
#[cfg(target_arch = "x86_64")]
fn avx2_panel_min_batch(default: usize) -> usize {
    AVX2_PANEL_OVERRIDE.with(Cell::get).unwrap_or_else(|| {
        match AVX2_PANEL_MIN_BATCH.load(Ordering::Relaxed) {
            0 => default,
            m => m,
        }
    })
}

/// Elements per packing block (one 256-bit load of bf16).
pub const PACK_BLOCK: usize = 16;

/// Rows per group of the tiled weight layout (one AMX tile's rows; the module docs).
pub const TILE_ROWS: usize = 16;
/// `K` elements per block of the tiled weight layout (one 64-byte line of bf16).
pub const TILE_COLS: usize = 32;
/// Rows per group of the paired weight layout (one 256-bit vector of fp32 outputs).
pub const PAIR_ROWS: usize = 8;

/// How a bf16 weight matrix lies in memory (the module docs give the index formulas).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WeightLayout {
    /// Row `n` contiguous along `K`.
    #[default]
    RowMajor,
    /// 16-row groups of 1 KiB blocks along `K` ([`tile_weights_bf16`]).
    Tiled,
    /// 8-row groups of interleaved `K` pairs ([`pair_weights_bf16`]).
    Pairs,
}

impl WeightLayout {
    /// Row-major `w` (`[rows, cols]`) rearranged into this layout (a copy; row-major: as it
    /// is).
    ///
    /// # Panics
    /// If `w.len() != rows * cols` or the arranged length overflows.
    pub fn arrange_bf16(self, w: &[bf16], rows: usize, cols: usize) -> Vec<bf16> {
        match self {
            WeightLayout::RowMajor => {
                assert_eq!(
                    Some(w.len()),
                    rows.checked_mul(cols),
                    "arrange_bf16: len {} != {rows} x {cols}",
                    w.len()
                );
                w.to_vec()
            }
            WeightLayout::Tiled => tile_weights_bf16(w, rows, cols),
            WeightLayout::Pairs => pair_weights_bf16(w, rows, cols),
        }
    }

    /// The row-major matrix of `t`, a `[rows, cols]` matrix in this layout.
    ///
    /// # Panics
    /// If `t` is not the layout's length for `[rows, cols]`.
    pub fn row_major_bf16(self, t: &[bf16], rows: usize, cols: usize) -> Vec<bf16> {
        match self {
            WeightLayout::RowMajor => {
                assert_eq!(
                    Some(t.len()),
                    rows.checked_mul(cols),
                    "row_major_bf16: len {} != {rows} x {cols}",
                    t.len()
                );
                t.to_vec()
            }
            WeightLayout::Tiled => untile_weights_bf16(t, rows, cols),
            WeightLayout::Pairs => unpair_weights_bf16(t, rows, cols),
        }
    }
}

/// Length of a paired `[rows, cols]` matrix: `rows` rounded up to 8 times `cols` rounded up to
/// 2 (`None` on overflow).
pub const fn pairs_len(rows: usize, cols: usize) -> Option<usize> {
    let r = match rows.checked_next_multiple_of(PAIR_ROWS) {
        Some(r) => r,
        None => return None,
    };
    match cols.checked_next_multiple_of(2) {
        Some(c) => r.checked_mul(c),
        None => None,
    }
}

/// The row groups of pass `i` of a paired tile's `S` streams (groups `g0..`, `len` passes a
/// stream, each stream walking consecutive groups `len` apart from the next stream's), and
/// each stream's next group: its own next one, or after the last pass, one of the groups left
/// over past the streams. The paired kernels of every path walk their tiles this way.
#[cfg(target_arch = "x86_64")]
fn pass_groups<const S: usize>(g0: usize, len: usize, i: usize) -> ([usize; S], [usize; S]) {
    let groups: [usize; S] = std::array::from_fn(|s| g0 + s * len + i);
    let next = std::array::from_fn(|s| {
        if i + 1 < len {
            groups[s] + 1
        } else {
            g0 + S * len + s
        }
    });
    (groups, next)
}

/// Where element `(n, k)` of a paired matrix of `cols` columns lies.
#[inline]
pub const fn pairs_index(n: usize, k: usize, cols: usize) -> usize {
    let pairs = cols.div_ceil(2);
    ((n / PAIR_ROWS * pairs + k / 2) * PAIR_ROWS + n % PAIR_ROWS) * 2 + k % 2
}

/// Rearranges row-major `w` (`[rows, cols]`) into the paired layout (zero padding; see the
/// module docs).
///
/// # Panics
/// If `w.len() != rows * cols` or the paired length overflows.
pub fn pair_weights_bf16(w: &[bf16], rows: usize, cols: usize) -> Vec<bf16> {
    assert_eq!(
        Some(w.len()),
        rows.checked_mul(cols),
        "pair_weights_bf16: len {} != {rows} x {cols}",
        w.len()
    );
    let len = pairs_len(rows, cols).expect("pair_weights_bf16: size overflows");
    let mut out = vec![bf16::ZERO; len];
    for (n, row) in w.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (k, &v) in row.iter().enumerate() {
            out[pairs_index(n, k, cols)] = v;
        }
    }
    out
}

/// Writes row-major `w` (`[rows, cols]`) into `out` in the paired layout, as
/// [`pair_weights_bf16`] does but into a caller's buffer (zero padding), so a kernel can pair a
/// block of rows per call: where `cols` is a multiple of 16 and the CPU has AVX2, each 8-row
/// group goes through 8 × 8 transposes of 32-bit pairs (a pair of `K` is one 32-bit lane), a
/// load and a store per 16 elements of a row.
///
/// # Panics
/// If `w.len() != rows * cols` or `out` is not [`pairs_len`]`(rows, cols)` long.
pub fn pair_rows_bf16_into(w: &[bf16], rows: usize, cols: usize, out: &mut [bf16]) {
    assert_eq!(
        Some(w.len()),
        rows.checked_mul(cols),
        "pair_rows_bf16_into: len {} != {rows} x {cols}",
        w.len()
    );
    assert_eq!(
        Some(out.len()),
        pairs_len(rows, cols),
        "pair_rows_bf16_into: out len {} for {rows} x {cols}",
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if cols.is_multiple_of(16) && Isa::current() >= Isa::Avx2 {
        // SAFETY: AVX2 (checked); the lengths were checked above.
        unsafe { pair_rows_avx2(w, rows, cols, out) };
        return;
    }
    out.fill(bf16::ZERO);
    for (n, row) in w.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (k, &v) in row.iter().enumerate() {
            out[pairs_index(n, k, cols)] = v;
        }
    }
}

/// [`pair_rows_bf16_into`] on AVX2: per 8-row group and 16 columns, the eight rows' 32 bytes
/// (eight 32-bit pairs each) transposed so output vector `j` holds pair `j` of the eight rows.
///
/// # Safety
/// AVX2 available; `cols % 16 == 0`, `w.len() == rows * cols`, `out.len() == pairs_len(rows,
/// cols)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pair_rows_avx2(w: &[half::bf16], rows: usize, cols: usize, out: &mut [half::bf16]) {
    use std::arch::x86_64::*;
    assert!(cols.is_multiple_of(16) && w.len() == rows * cols);
    assert!(out.len() >= rows.div_ceil(PAIR_ROWS) * PAIR_ROWS * cols);
    let zero = [half::bf16::ZERO; 16];
    for g in 0..rows.div_ceil(PAIR_ROWS) {
        let base = g * PAIR_ROWS * cols;
        for c in (0..cols).step_by(16) {
            let r: [__m256; 8] = std::array::from_fn(|i| {
                let n = g * PAIR_ROWS + i;
                let src = if n < rows {
                    &w[n * cols + c..n * cols + c + 16]
                } else {
                    &zero[..]
                };
                // SAFETY: `src` is 16 bf16 (32 bytes).
                unsafe { _mm256_loadu_ps(src.as_ptr().cast()) }
            });
            let t = crate::simd::transpose8(r);
            for (j, v) in t.iter().enumerate() {
                // Pair `c / 2 + j` of the group: 16 elements at `base + (c / 2 + j) * 16`.
                let at = base + (c / 2 + j) * 2 * PAIR_ROWS;
                let dst = &mut out[at..at + 2 * PAIR_ROWS];
                // SAFETY: `dst` is 16 bf16 (32 bytes).
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr().cast(), *v) };
            }
        }
    }
}

/// The row-major matrix of paired `t` (`[rows, cols]`, as [`pair_weights_bf16`] wrote it).
///
/// # Panics
/// If `t.len() != pairs_len(rows, cols)`.
pub fn unpair_weights_bf16(t: &[bf16], rows: usize, cols: usize) -> Vec<bf16> {
    assert_eq!(
        Some(t.len()),
        pairs_len(rows, cols),
        "unpair_weights_bf16: len {} for {rows} x {cols}",
        t.len()
    );
    let mut out = Vec::with_capacity(rows * cols);
    for n in 0..rows {
        out.extend((0..cols).map(|k| t[pairs_index(n, k, cols)]));
    }
    out
}

/// Whether kernels running on `isa` stream paired weights faster than row-major ones: the
/// AVX2 path (`avx2/pairs.rs`) and the AVX-512 BF16 path (`avx512_pairs.rs`, AVX-512 BF16
/// machines without AMX), not the AMX path, which streams tiled weights
/// ([`tiled_weights_pay`]).
pub fn paired_weights_pay(isa: Isa) -> bool {
    matches!(isa, Isa::Avx2 | Isa::Avx512Bf16)
}

/// Length of a tiled `[rows, cols]` matrix: `rows` rounded up to 16 times `cols` rounded up to
/// 32 (`None` on overflow).
pub const fn tiled_len(rows: usize, cols: usize) -> Option<usize> {
    let r = match rows.checked_next_multiple_of(TILE_ROWS) {
        Some(r) => r,
        None => return None,
    };
    match cols.checked_next_multiple_of(TILE_COLS) {
        Some(c) => r.checked_mul(c),
        None => None,
    }
}

/// Where element `(n, k)` of a tiled matrix of `cols` columns lies.
#[inline]
pub const fn tiled_index(n: usize, k: usize, cols: usize) -> usize {
    let steps = cols.div_ceil(TILE_COLS);
    ((n / TILE_ROWS * steps + k / TILE_COLS) * TILE_ROWS + n % TILE_ROWS) * TILE_COLS
        + k % TILE_COLS
}

/// Rearranges row-major `w` (`[rows, cols]`) into the tiled layout (zero padding; see the
/// module docs).
///
/// # Panics
/// If `w.len() != rows * cols` or the tiled length overflows.
pub fn tile_weights_bf16(w: &[bf16], rows: usize, cols: usize) -> Vec<bf16> {
    assert_eq!(
        Some(w.len()),
        rows.checked_mul(cols),
        "tile_weights_bf16: len {} != {rows} x {cols}",
        w.len()
    );
    let len = tiled_len(rows, cols).expect("tile_weights_bf16: size overflows");
    let mut out = vec![bf16::ZERO; len];
    for (n, row) in w.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (s, chunk) in row.chunks(TILE_COLS).enumerate() {
            let at = tiled_index(n, s * TILE_COLS, cols);
            out[at..at + chunk.len()].copy_from_slice(chunk);
        }
    }
    out
}

/// The row-major matrix of tiled `t` (`[rows, cols]`, as [`tile_weights_bf16`] wrote it).
///
/// # Panics
/// If `t.len() != tiled_len(rows, cols)`.
pub fn untile_weights_bf16(t: &[bf16], rows: usize, cols: usize) -> Vec<bf16> {
    assert_eq!(
        Some(t.len()),
        tiled_len(rows, cols),
        "untile_weights_bf16: len {} for {rows} x {cols}",
        t.len()
    );
    let mut out = Vec::with_capacity(rows * cols);
    for n in 0..rows {
        for s in (0..cols).step_by(TILE_COLS) {
            let at = tiled_index(n, s, cols);
            out.extend_from_slice(&t[at..at + TILE_COLS.min(cols - s)]);
        }
    }
    out
}

/// Whether kernels running on `isa` stream tiled weights faster than row-major ones, so a
/// model should tile its bf16 matrices at load: on the AMX path, which then takes every batch
/// (`docs/performance.md`). The AVX-512 BF16 path computes tiled weights but reads row-major
/// ones as fast or faster; the AVX2 and portable paths read row-major weights best.
pub fn tiled_weights_pay(isa: Isa) -> bool {
    isa >= Isa::AmxBf16
}

/// bf16 weights `[rows, cols]` in a [`WeightLayout`] (row-major: the HF `[out, in]` layout).
#[derive(Clone, Copy, Debug)]
pub struct WeightsBf16<'a> {
    data: &'a [bf16],
    rows: usize,
    cols: usize,
    layout: WeightLayout,
}

impl<'a> WeightsBf16<'a> {
    /// Views row-major `data` as `[rows, cols]`.
    ///
    /// # Panics
    /// If `data.len() != rows * cols`.
    pub fn new(data: &'a [bf16], rows: usize, cols: usize) -> WeightsBf16<'a> {
        assert_eq!(
            Some(data.len()),
            rows.checked_mul(cols),
            "weights: len {} != {rows} x {cols}",
            data.len()
        );
        WeightsBf16 {
            data,
            rows,
            cols,
            layout: WeightLayout::RowMajor,
        }
    }
    /// Views `data`, written by [`tile_weights_bf16`], as tiled `[rows, cols]`.
    ///
    /// # Panics
    /// If `data.len() != tiled_len(rows, cols)`.
    pub fn tiled(data: &'a [bf16], rows: usize, cols: usize) -> WeightsBf16<'a> {
        assert_eq!(
            Some(data.len()),
            tiled_len(rows, cols),
            "tiled weights: len {} for {rows} x {cols}",
            data.len()
        );
        WeightsBf16 {
            data,
            rows,
            cols,
            layout: WeightLayout::Tiled,
        }
    }
    /// Views `data`, written by [`pair_weights_bf16`], as paired `[rows, cols]`.
    ///
    /// # Panics
    /// If `data.len() != pairs_len(rows, cols)`.
    pub fn paired(data: &'a [bf16], rows: usize, cols: usize) -> WeightsBf16<'a> {
        assert_eq!(
            Some(data.len()),
            pairs_len(rows, cols),
            "paired weights: len {} for {rows} x {cols}",
            data.len()
        );
        WeightsBf16 {
            data,
            rows,
            cols,
            layout: WeightLayout::Pairs,
        }
    }
    /// Views `data` as `[rows, cols]` in `layout`.
    ///
    /// # Panics
    /// As [`WeightsBf16::new`], [`WeightsBf16::tiled`] or [`WeightsBf16::paired`].
    pub fn with_layout(
        data: &'a [bf16],
        rows: usize,
        cols: usize,
        layout: WeightLayout,
    ) -> WeightsBf16<'a> {
        match layout {
            WeightLayout::RowMajor => WeightsBf16::new(data, rows, cols),
            WeightLayout::Tiled => WeightsBf16::tiled(data, rows, cols),
            WeightLayout::Pairs => WeightsBf16::paired(data, rows, cols),
        }
    }
    /// Rows `r` as a matrix of their own, in the same layout (no copy).
    ///
    /// # Panics
    /// If `r` lies outside the rows, or does not start on a multiple of 16 rows (tiled) or
    /// of 8 (paired).
    pub fn row_range(&self, r: Range<usize>) -> WeightsBf16<'a> {
        assert!(
            r.start <= r.end && r.end <= self.rows,
            "weights: rows {r:?} outside {} rows",
            self.rows
        );
        let n = r.end - r.start;
        match self.layout {
            WeightLayout::RowMajor => WeightsBf16::new(
                &self.data[r.start * self.cols..r.end * self.cols],
                n,
                self.cols,
            ),
            WeightLayout::Tiled => {
                assert!(
                    r.start.is_multiple_of(TILE_ROWS),
                    "tiled weights: row slice {r:?} does not start on a group of {TILE_ROWS}"
                );
                let group = self.cols.next_multiple_of(TILE_COLS) * TILE_ROWS;
                let g0 = r.start / TILE_ROWS;
                let len = n.div_ceil(TILE_ROWS) * group;
                WeightsBf16::tiled(&self.data[g0 * group..g0 * group + len], n, self.cols)
            }
            WeightLayout::Pairs => {
                assert!(
                    r.start.is_multiple_of(PAIR_ROWS),
                    "paired weights: row slice {r:?} does not start on a group of {PAIR_ROWS}"
                );
                let group = self.cols.next_multiple_of(2) * PAIR_ROWS;
                let g0 = r.start / PAIR_ROWS;
                let len = n.div_ceil(PAIR_ROWS) * group;
                WeightsBf16::paired(&self.data[g0 * group..g0 * group + len], n, self.cols)
            }
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
    /// The elements, in [`WeightsBf16::layout`] order.
    pub fn data(&self) -> &'a [bf16] {
        self.data
    }
    /// How the elements lie.
    pub fn layout(&self) -> WeightLayout {
        self.layout
    }
}

/// Activations packed by [`pack_acts_bf16`]: fp32 rows of `cols` elements at a row stride of
/// [`packed_ld`]`(cols)` (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct PackedActs<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
}

/// Row stride of packed activations with `cols` columns: `cols` rounded up to 16 plus 16, so
/// consecutive rows never sit a multiple of 4 KiB apart (rows at such strides share L1 sets
/// and thrash when a micro-kernel streams several at once).
pub const fn packed_ld(cols: usize) -> usize {
    cols.div_ceil(PACK_BLOCK) * PACK_BLOCK + PACK_BLOCK
}

/// Length of a packed activation buffer of `rows` rows of `cols` columns.
pub const fn packed_len(rows: usize, cols: usize) -> usize {
    rows * packed_ld(cols)
}

impl<'a> PackedActs<'a> {
    /// Views `data` (written by [`pack_acts_bf16`] or [`pack_acts_f32`]) as `rows` packed rows
    /// of `cols` columns.
    ///
    /// # Panics
    /// If `data.len() != packed_len(rows, cols)`.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> PackedActs<'a> {
        let ld = cols
            .checked_next_multiple_of(PACK_BLOCK)
            .and_then(|c| c.checked_add(PACK_BLOCK));
        let need = ld.and_then(|ld| ld.checked_mul(rows));
        assert_eq!(
            Some(data.len()),
            need,
            "packed acts: len {} for {rows} x {cols}",
            data.len()
        );
        PackedActs { data, rows, cols }
    }
    /// Number of batch rows (`B`).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns (`K`).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The packed elements (row stride [`packed_ld`]`(cols)`).
    pub fn data(&self) -> &'a [f32] {
        self.data
    }
}

/// How a call combines its result with the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutMode {
    /// `out = result`.
    Store,
    /// `out += result` (split-K partial sums into a zero-seeded buffer).
    Add,
}

/// The part of the product one call computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmTile {
    /// Output columns (weight rows) `N` computed.
    pub n: Range<usize>,
    /// The slice of `K` summed.
    pub k: Range<usize>,
    /// Store or accumulate.
    pub mode: OutMode,
}

impl GemmTile {
    /// The whole product of `w`, stored.
    pub fn full(w: &WeightsBf16<'_>) -> GemmTile {
        GemmTile {
            n: 0..w.rows(),
            k: 0..w.cols(),
            mode: OutMode::Store,
        }
    }
}

/// Where element `k` of a row of `cols` elements sits in the packed row.
#[inline]
pub fn pack_index(k: usize, cols: usize) -> usize {
    let block = k / PACK_BLOCK * PACK_BLOCK;
    if block + PACK_BLOCK > cols {
        return k;
    }
    let i = k - block;
    block
        + if i.is_multiple_of(2) {
            i / 2
        } else {
            PACK_BLOCK / 2 + i / 2
        }
}

/// Packs bf16 activations `x [rows, cols]` for [`gemm_bf16`] into `out`
/// ([`packed_len`]`(rows, cols)` fp32; padding is zeroed). Each value is widened exactly (its
/// bits shifted into the high half; a NaN keeps its payload).
///
/// # Panics
/// If `x` is not `rows * cols` long or `out` not `packed_len(rows, cols)`.
pub fn pack_acts_bf16(x: &[bf16], rows: usize, cols: usize, out: &mut [f32]) {
    assert_eq!(
        Some(x.len()),
        rows.checked_mul(cols),
        "pack_acts_bf16: x len"
    );
    assert_eq!(out.len(), packed_len(rows, cols), "pack_acts_bf16: out len");
    if cols == 0 {
        // Rows of padding only (`chunks_exact` would yield none to zero).
        out.fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let avx2 = Isa::current() >= Isa::Avx2;
    for (src, dst) in x
        .chunks_exact(cols.max(1))
        .zip(out.chunks_exact_mut(packed_ld(cols)))
    {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: `Isa::current` is Avx2 or wider only on a CPU with AVX2.
            unsafe { pack_row_bf16_avx2(src, dst) };
            continue;
        }
        pack_row(src, dst, |v| widen_bf16(*v));
    }
}

/// `v` as f32, bit for bit (the bf16 bits in the high half).
#[inline(always)]
fn widen_bf16(v: bf16) -> f32 {
    f32::from_bits(u32::from(v.to_bits()) << 16)
}

/// [`pack_row`] of a bf16 row, widened as [`widen_bf16`]: a packing block's 16 values are
/// one 256-bit load whose 32-bit lanes hold the pairs `(x[2i], x[2i + 1])`, so the even
/// values are the lanes shifted left by 16 and the odd ones the lanes' high halves. (The
/// generic body compiled to a word insert per value: `wo_a`'s packing of one group, 8 rows of
/// 4096, took ~45 700 cycles in the FLASH step.)
///
/// # Safety
/// AVX2 available. `dst` must be at least `src.len()` long (asserted).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_row_bf16_avx2(src: &[bf16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(dst.len() >= src.len(), "pack_row_bf16: dst len");
    let full = src.len() / PACK_BLOCK * PACK_BLOCK;
    let high = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
    for (s, d) in src[..full]
        .chunks_exact(PACK_BLOCK)
        .zip(dst[..full].chunks_exact_mut(PACK_BLOCK))
    {
        // SAFETY: `s` is 16 bf16 (32 bytes) and `d` 16 f32 (64 bytes), both whole blocks.
        unsafe {
            let v = _mm256_loadu_si256(s.as_ptr().cast());
            let even = _mm256_slli_epi32::<16>(v);
            let odd = _mm256_and_si256(v, high);
            _mm256_storeu_si256(d.as_mut_ptr().cast(), even);
            _mm256_storeu_si256(d.as_mut_ptr().add(PACK_BLOCK / 2).cast(), odd);
        }
    }
    for (s, d) in src[full..].iter().zip(&mut dst[full..]) {
        *d = widen_bf16(*s);
    }
    dst[src.len()..].fill(0.0);
}

// Built for AVX2 as well: the baseline build moves one element at a time.
multiversion! {
    /// Packs fp32 activations `x [rows, cols]` (normally bf16-representable values; others are
    /// used unrounded) into `out` ([`packed_len`]`(rows, cols)`; padding is zeroed).
    ///
    /// # Panics
    /// If `x` is not `rows * cols` long or `out` not `packed_len(rows, cols)`.
    pub fn pack_acts_f32(x: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
        assert_eq!(
            Some(x.len()),
            rows.checked_mul(cols),
            "pack_acts_f32: x len"
        );
        assert_eq!(out.len(), packed_len(rows, cols), "pack_acts_f32: out len");
        if cols == 0 {
            // Rows of padding only (`chunks_exact` would yield none to zero).
            out.fill(0.0);
            return;
        }
        for (src, dst) in x
            .chunks_exact(cols.max(1))
            .zip(out.chunks_exact_mut(packed_ld(cols)))
        {
            pack_row(src, dst, |v| *v);
        }
    }
}

multiversion! {
    /// Packs bf16 values for columns `c0 .. c0 + src.len()` of a row of `cols` columns into
    /// `dst`, that column range of the packed row (an SPMD block's share of a packed
    /// activation row, written in place: the gate/up block's SwiGLU rows).
    ///
    /// # Panics
    /// If `dst` and `src` differ in length, the range passes `cols`, or it does not start on a
    /// packing block and end on one or at `cols`.
    pub fn pack_segment_bf16(src: &[bf16], c0: usize, cols: usize, dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "pack_segment_bf16: dst len");
        check_segment("pack_segment_bf16", c0, src.len(), cols);
        // The segment's blocks are whole exactly where the row's are, and a last partial one
        // is the row's own tail: packed like a row of its own.
        pack_row(src, dst, |v| widen_bf16(*v));
    }
}

/// Panics (naming `what`) unless columns `c0 .. c0 + len` of a packed row of `cols` columns
/// are whole packing blocks: starting on one, ending on one or at `cols`, inside the row. A
/// segment packed on its own then has the layout it has inside the row.
pub(crate) fn check_segment(what: &str, c0: usize, len: usize, cols: usize) {
    let end = c0
        .checked_add(len)
        .unwrap_or_else(|| panic!("{what}: range overflows"));
    assert!(
        end <= cols
            && c0.is_multiple_of(PACK_BLOCK)
            && (end.is_multiple_of(PACK_BLOCK) || end == cols),
        "{what}: columns {c0}..{end} of {cols} are not whole packing blocks"
    );
}

#[inline(always)]
fn pack_row<T>(src: &[T], dst: &mut [f32], f: impl Fn(&T) -> f32) {
    let full = src.len() / PACK_BLOCK * PACK_BLOCK;
    for (s, d) in src[..full]
        .chunks_exact(PACK_BLOCK)
        .zip(dst[..full].chunks_exact_mut(PACK_BLOCK))
    {
        for i in 0..PACK_BLOCK / 2 {
            d[i] = f(&s[2 * i]);
            d[PACK_BLOCK / 2 + i] = f(&s[2 * i + 1]);
        }
    }
    for (s, d) in src[full..].iter().zip(&mut dst[full..]) {
        *d = f(s);
    }
    dst[src.len()..].fill(0.0);
}

/// One tile of `out[b, n] (+)= sum_{k in tile.k} w[n, k] * x[b, k]` for every batch row `b` of
/// `x` (bf16 weights, fp32 accumulation).
///
/// # Panics
/// If the tile lies outside `w`, `x` has a different `K`, or `out` is too short for
/// `x.rows()` rows of stride `ld_out` (`ld_out >= tile.n.len()` when there are several rows).
pub fn gemm_bf16(
    w: WeightsBf16<'_>,
    x: PackedActs<'_>,
    tile: &GemmTile,
    out: &mut [f32],
    ld_out: usize,
) {
    gemm_dispatch(w, x, tile, None, out, ld_out);
}

/// [`gemm_bf16`] with each batch row's result multiplied by `row_scale[b]` before it is stored
/// or added (the decode step's deferred `1/rms`; linear, so split-K partials may each be
/// scaled).
///
/// # Panics
/// As [`gemm_bf16`], and if `row_scale.len() != x.rows()`.
pub fn gemm_scaled_bf16(
    w: WeightsBf16<'_>,
    x: PackedActs<'_>,
    tile: &GemmTile,
    row_scale: &[f32],
    out: &mut [f32],
    ld_out: usize,
) {
    assert_eq!(row_scale.len(), x.rows(), "gemm_scaled_bf16: row_scale len");
    gemm_dispatch(w, x, tile, Some(row_scale), out, ld_out);
}

/// The conversions [`gemm_bf16`] makes of a tile's activations before its products, made once
/// for many products over the same activations: the AVX-512 BF16 path's natural-order bf16
/// rows, or the AMX path's VNNI tiles, whichever this thread's path takes for the batch, over
/// the whole of `K`'s packing blocks. [`gemm_bf16_converted`] takes them with the activations
/// they were made from and skips its own conversion where its tile's body is that whole body
/// (a split-K tile converts its part as usual). It holds no copy of the activations: a task's
/// SPMD blocks each run a product over the same input, and a copy of 512 prefill rows would
/// cost about what one conversion does.
///
/// The conversion remembers the shape and address of what it converted and is used only for
/// activations of that shape at that address; the caller keeps their values unchanged between
/// [`ActsConversion::convert`] and the products (other values there give other results, never
/// undefined behaviour: every length is checked).
#[derive(Default)]
pub struct ActsConversion {
    rows: usize,
    cols: usize,
    /// Address of the packed rows converted.
    from: usize,
    /// Natural-order bf16 rows of stride `avx512::natural_ld(body)`, zero past the body: the
    /// first `natural_len` elements (0: not made; the buffer only grows).
    #[cfg(target_arch = "x86_64")]
    natural: Vec<u16>,
    #[cfg(target_arch = "x86_64")]
    natural_len: usize,
    /// The VNNI tiles of the body `0 .. cols / 32 · 32` (empty: none made).
    #[cfg(target_arch = "x86_64")]
    vnni: Vec<amx::Line>,
}

impl std::fmt::Debug for ActsConversion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("ActsConversion");
        d.field("rows", &self.rows).field("cols", &self.cols);
        #[cfg(target_arch = "x86_64")]
        d.field("natural_len", &self.natural_len)
            .field("vnni_lines", &self.vnni.len());
        d.finish()
    }
}

impl ActsConversion {
    /// Converts `x` for the path [`gemm_bf16`] takes now for its batch: the AMX tiles from the
    /// AMX path's least batch (5 rows) on an AMX machine (where one batch block holds them),
    /// the natural-order rows from the AVX-512 BF16 path's least batch (2 rows, on paired
    /// weights) on an AVX-512 BF16 machine without AMX, nothing otherwise. The buffers are kept
    /// between calls.
    pub fn convert(&mut self, x: PackedActs<'_>) {
        (self.rows, self.cols, self.from) = (x.rows(), x.cols(), x.data().as_ptr() as usize);
        #[cfg(target_arch = "x86_64")]
        {
            self.natural_len = 0;
            self.vnni.clear();
            let lw = whole_k_lowered(x, &[]);
            match ConversionForm::on(Isa::current(), x.rows(), lw.kb1) {
                // Where the batch does not fit one block the copy stays empty and the
                // products convert per call, as `pays` says.
                Some(ConversionForm::AmxTiles) => {
                    // SAFETY: `AmxTiles` only where `Isa::current` is AmxBf16 or above, when
                    // the CPU has AMX-BF16 and AVX-512 F/BW/VL/BF16 and the tile state was
                    // granted; `lw` describes the packed rows as they are (`convert` reads
                    // only the activations).
                    unsafe { amx::convert(&lw, &mut self.vnni) };
                }
                Some(ConversionForm::NaturalRows) => {
                    // SAFETY: `NaturalRows` only where `Isa::current` is Avx512Bf16, on a CPU
                    // with AVX-512 F/BW/VL and BF16; `lw` describes the packed rows as they
                    // are (only they are read).
                    self.natural_len = unsafe { avx512::convert_natural(&lw, &mut self.natural) };
                }
                None => {}
            }
        }
    }

    /// Whether a conversion made once pays for products of `rows` rows of `cols` against
    /// weights in `layout` on this thread's path now: the path takes the form
    /// [`ActsConversion::convert`] makes. On AMX only tiled weights take the tiles made once:
    /// row-major weights streamed 3–7% faster converting per call while their first rows were
    /// prefetched (session 26, `docs/benchmarks.md`). On AVX-512 BF16 every layout the path
    /// runs takes the natural rows.
    pub fn pays(rows: usize, cols: usize, layout: WeightLayout) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let isa = Isa::current();
            let body = cols / PACK_BLOCK * PACK_BLOCK;
            match (
                path_for(isa, rows, layout),
                ConversionForm::on(isa, rows, body),
            ) {
                (Isa::AmxBf16, Some(ConversionForm::AmxTiles)) => {
                    layout == WeightLayout::Tiled && amx::converts(rows, body / 32)
                }
                (Isa::Avx512Bf16, Some(ConversionForm::NaturalRows)) => true,
                _ => false,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (rows, cols, layout);
            false
        }
    }

    /// Whether this conversion was made from `x` (its shape and address).
    fn made_from(&self, x: PackedActs<'_>) -> bool {
        (self.rows, self.cols, self.from) == (x.rows(), x.cols(), x.data().as_ptr() as usize)
    }
}

/// What [`ActsConversion::convert`] makes: one owner of the batch thresholds that
/// [`ActsConversion::pays`] must agree with.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ConversionForm {
    /// The AMX tiles' VNNI copy, from [`amx::MIN_BATCH`] rows.
    AmxTiles,
    /// The natural-order bf16 rows of the AVX-512 BF16 passes, from
    /// `AVX512_PAIRS_MIN_BATCH` rows and a body of at least one packing block.
    NaturalRows,
}

#[cfg(target_arch = "x86_64")]
impl ConversionForm {
    /// The form for `rows` rows with a body of `body` columns (whole packing blocks) on
    /// `isa`; `None` where the products convert per call.
    fn on(isa: Isa, rows: usize, body: usize) -> Option<ConversionForm> {
        if isa >= Isa::AmxBf16 && rows >= amx::MIN_BATCH {
            Some(ConversionForm::AmxTiles)
        } else if isa == Isa::Avx512Bf16 && rows >= AVX512_PAIRS_MIN_BATCH && body > 0 {
            Some(ConversionForm::NaturalRows)
        } else {
            None
        }
    }
}

/// Activations prepared once for many products against different weights (the sparse
/// attention's queries against each tile of candidate rows): a copy of the packed rows and
/// their [`ActsConversion`], so [`gemm_bf16_prepared`] skips the per-call conversion. Results
/// are those of [`gemm_bf16`] with the same activations, bit for bit.
#[derive(Default)]
pub struct PreparedActs {
    packed: Vec<f32>,
    rows: usize,
    cols: usize,
    conv: ActsConversion,
}

impl std::fmt::Debug for PreparedActs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedActs")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("conversion", &self.conv)
            .finish()
    }
}

impl PreparedActs {
    /// Takes `x` (copied; the buffers are reused between calls) and converts it for the path
    /// [`gemm_bf16`] takes now.
    pub fn prepare(&mut self, x: PackedActs<'_>) {
        self.packed.clear();
        self.packed.extend_from_slice(x.data());
        self.rows = x.rows();
        self.cols = x.cols();
        self.conv
            .convert(PackedActs::new(&self.packed, self.rows, self.cols));
    }

    /// [`PreparedActs::prepare`] of fp32 rows `x` (`[rows, cols]`), packed straight into the
    /// kept buffer ([`pack_acts_f32`]) instead of packed then copied.
    ///
    /// # Panics
    /// If `x` is not `rows * cols` long.
    pub fn prepare_f32(&mut self, x: &[f32], rows: usize, cols: usize) {
        self.packed.resize(packed_len(rows, cols), 0.0);
        pack_acts_f32(x, rows, cols, &mut self.packed);
        self.rows = rows;
        self.cols = cols;
        self.conv
            .convert(PackedActs::new(&self.packed, self.rows, self.cols));
    }

    /// The prepared activations as packed rows.
    pub fn acts(&self) -> PackedActs<'_> {
        PackedActs::new(&self.packed, self.rows, self.cols)
    }
}

/// The lowering of a product of `x` over the whole of `K` with weight data `w` (what
/// [`ActsConversion::convert`] converts and what the dispatch compares a tile's body against).
#[cfg(target_arch = "x86_64")]
fn whole_k_lowered<'a>(x: PackedActs<'a>, w: &'a [u16]) -> Lowered<'a> {
    let cols = x.cols();
    let body = cols / PACK_BLOCK * PACK_BLOCK;
    Lowered {
        w,
        ldw: cols,
        tiled: false,
        pairs: false,
        x: x.data(),
        ldx: packed_ld(cols),
        batch: x.rows(),
        n: 0..0,
        k: 0..cols,
        kb0: 0,
        kb1: body,
        mode: OutMode::Store,
        scale: None,
    }
}

/// [`gemm_bf16`] of `x` with the conversion `conv` made from it ([`ActsConversion::convert`];
/// one made from other activations is not used): the same results, bit for bit, without the
/// per-call conversion where the tile's body is the whole of `K`'s packing blocks and the path
/// takes the form `conv` holds.
///
/// # Panics
/// As [`gemm_bf16`].
pub fn gemm_bf16_converted(
    w: WeightsBf16<'_>,
    x: PackedActs<'_>,
    conv: &ActsConversion,
    tile: &GemmTile,
    out: &mut [f32],
    ld_out: usize,
) {
    gemm_dispatch_with(w, x, tile, None, Some(conv), out, ld_out);
}

/// [`gemm_scaled_bf16`] with a conversion made once, as [`gemm_bf16_converted`].
///
/// # Panics
/// As [`gemm_scaled_bf16`].
pub fn gemm_scaled_bf16_converted(
    w: WeightsBf16<'_>,
    x: PackedActs<'_>,
    conv: &ActsConversion,
    tile: &GemmTile,
    row_scale: &[f32],
    out: &mut [f32],
    ld_out: usize,
) {
    assert_eq!(row_scale.len(), x.rows(), "gemm_scaled_bf16: row_scale len");
    gemm_dispatch_with(w, x, tile, Some(row_scale), Some(conv), out, ld_out);
}

/// [`gemm_bf16`] on activations prepared by [`PreparedActs::prepare`]: the same results, with
/// the AMX path's activation tiles taken from `x` when the tile covers the whole of `K` and the
/// path is still AMX (otherwise as [`gemm_bf16`] on `x.acts()`).
///
/// # Panics
/// As [`gemm_bf16`].
pub fn gemm_bf16_prepared(
    w: WeightsBf16<'_>,
    x: &PreparedActs,
    tile: &GemmTile,
    out: &mut [f32],
    ld_out: usize,
) {
    gemm_dispatch_with(w, x.acts(), tile, None, Some(&x.conv), out, ld_out);
}

/// [`gemm_scaled_bf16`] on activations prepared by [`PreparedActs::prepare`]: the same
/// results, bit for bit, with the AMX path's activation tiles taken from `x` as
/// [`gemm_bf16_prepared`] takes them.
///
/// # Panics
/// As [`gemm_scaled_bf16`].
pub fn gemm_scaled_bf16_prepared(
    w: WeightsBf16<'_>,
    x: &PreparedActs,
    tile: &GemmTile,
    row_scale: &[f32],
    out: &mut [f32],
    ld_out: usize,
) {
    assert_eq!(row_scale.len(), x.rows, "gemm_scaled_bf16: row_scale len");
    gemm_dispatch_with(
        w,
        x.acts(),
        tile,
        Some(row_scale),
        Some(&x.conv),
        out,
        ld_out,
    );
}

/// Fp32 activations converted for the AMX path alone: the tile unit's VNNI copy of the rows
/// over the whole of `K`, made straight from the rows (no packed copy, which only the other
/// paths and partial tiles read). For a product that is known to take the AMX path over whole
/// weight rows, e.g. the attention's queries against blocks of candidate rows.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
pub(crate) struct AmxActs {
    vnni: Vec<amx::Line>,
    rows: usize,
    cols: usize,
}

#[cfg(target_arch = "x86_64")]
impl std::fmt::Debug for AmxActs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmxActs")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("vnni_lines", &self.vnni.len())
            .finish()
    }
}

#[cfg(target_arch = "x86_64")]
impl AmxActs {
    /// Converts `x` (`[rows, cols]` fp32) where [`gemm_bf16`] takes the AMX path over the whole
    /// of `K` now with the tiles made once (AMX-BF16 is the current path, `rows` from the AMX
    /// path's least batch to one batch block, `cols` a multiple of 32): true, and
    /// [`gemm_bf16_amx`] takes these activations; false (nothing kept) otherwise.
    ///
    /// # Panics
    /// If `x` is not `rows · cols` long.
    pub(crate) fn prepare_f32(&mut self, x: &[f32], rows: usize, cols: usize) -> bool {
        assert_eq!(Some(x.len()), rows.checked_mul(cols), "AmxActs: x len");
        // SAFETY: `prepare_with` runs this only where `Isa::current` is AmxBf16, i.e. on a CPU
        // with AVX-512 F/BW/VL and BF16.
        self.prepare_with(rows, cols, |v| unsafe {
            amx::convert_rows(x, rows, cols, v)
        })
    }

    /// [`AmxActs::prepare_f32`] of bf16 rows `x` (`[rows, cols]`): the same tiles as of the
    /// same values widened to fp32, each line one load.
    ///
    /// # Panics
    /// If `x` is not `rows · cols` long.
    pub(crate) fn prepare_bf16(&mut self, x: &[bf16], rows: usize, cols: usize) -> bool {
        assert_eq!(Some(x.len()), rows.checked_mul(cols), "AmxActs: x len");
        // SAFETY: as in `prepare_f32`.
        self.prepare_with(rows, cols, |v| unsafe {
            amx::convert_rows_bf16(x, rows, cols, v)
        })
    }

    /// Keeps the shape and runs `convert` into the tiles where the AMX path takes `rows` rows
    /// now (else clears them): what `convert` returns.
    fn prepare_with(
        &mut self,
        rows: usize,
        cols: usize,
        convert: impl FnOnce(&mut Vec<amx::Line>) -> bool,
    ) -> bool {
        (self.rows, self.cols) = (rows, cols);
        if Isa::current() < Isa::AmxBf16 || rows < amx::MIN_BATCH {
            self.vnni.clear();
            return false;
        }
        convert(&mut self.vnni)
    }
}

/// [`gemm_bf16`] of row-major `w` over all its rows and the whole of `K` against activations
/// converted by [`AmxActs::prepare_f32`] (which returned true, on this path): `out[b, n] = Σ_k
/// w[n, k] x[b, k]`, the same results bit for bit.
///
/// # Panics
/// If `x` holds no tiles, AMX-BF16 is not the current path, `w` is tiled or of another `K`,
/// or `out` is too short for `x`'s rows at `ld_out`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn gemm_bf16_amx(w: WeightsBf16<'_>, x: &AmxActs, out: &mut [f32], ld_out: usize) {
    assert!(
        !x.vnni.is_empty(),
        "gemm_bf16_amx: activations not converted"
    );
    assert!(
        Isa::current() >= Isa::AmxBf16,
        "gemm_bf16_amx: the AMX path is not the current one"
    );
    assert_eq!(
        w.layout(),
        WeightLayout::RowMajor,
        "gemm_bf16_amx: tiled weights"
    );
    assert_eq!(
        w.cols(),
        x.cols,
        "gemm_bf16_amx: weights K {} != {}",
        w.cols(),
        x.cols
    );
    let n = w.rows();
    if n == 0 {
        return;
    }
    assert!(ld_out >= n, "gemm_bf16_amx: ld_out {ld_out} < {n} rows");
    assert!(
        (x.rows - 1)
            .checked_mul(ld_out)
            .and_then(|v| v.checked_add(n))
            .is_some_and(|need| out.len() >= need),
        "gemm_bf16_amx: out too short"
    );
    let lw = Lowered {
        // SAFETY: bf16 is a `repr(transparent)` wrapper of u16, so the slice is reinterpreted
        // element for element with the same length and alignment.
        w: unsafe { std::slice::from_raw_parts(w.data().as_ptr().cast::<u16>(), w.data().len()) },
        ldw: x.cols,
        tiled: false,
        pairs: false,
        // Not read: the body is the whole of `K` in 32-element steps (no edges, no strip) and
        // its tiles are given.
        x: &[],
        ldx: x.cols,
        batch: x.rows,
        n: 0..n,
        k: 0..x.cols,
        kb0: 0,
        kb1: x.cols,
        mode: OutMode::Store,
        scale: None,
    };
    // SAFETY: AMX-BF16 is the current path (asserted: the CPU has it with AVX-512 BF16 and the
    // tile state was granted); `lw` is inside `w` and `out` (checked above); the tiles were
    // converted by `amx::convert_rows` for `x.rows` rows over this body, which fits one batch
    // block, so `gemm_with` takes them and reads no activations of `lw`.
    unsafe { amx::gemm_with(&lw, Some(&x.vnni), out, ld_out) };
}

/// Arguments checked and lowered for the path kernels.
struct Lowered<'a> {
    w: &'a [u16],
    /// `K` of the weights (row-major: the row stride).
    ldw: usize,
    /// The weights are in the tiled layout (`tiled_index`).
    tiled: bool,
    /// The weights are in the paired layout (`pairs_index`); neither flag: row-major.
    pairs: bool,
    x: &'a [f32],
    ldx: usize,
    batch: usize,
    n: Range<usize>,
    k: Range<usize>,
    /// Body `[kb0, kb1)`: whole packing blocks inside `k`.
    kb0: usize,
    kb1: usize,
    mode: OutMode,
    scale: Option<&'a [f32]>,
}

impl Lowered<'_> {
    /// Whether the tile has elements outside its body (a `K` range not on packing blocks).
    #[inline]
    fn has_edges(&self) -> bool {
        self.kb0 != self.k.start || self.kb1 != self.k.end
    }

    /// Weight element `(n, k)` (bits).
    #[inline]
    fn w_at(&self, n: usize, k: usize) -> u16 {
        if self.tiled {
            self.w[tiled_index(n, k, self.ldw)]
        } else if self.pairs {
            self.w[pairs_index(n, k, self.ldw)]
        } else {
            self.w[n * self.ldw + k]
        }
    }

    /// Elements from one tiled row's line to the same row's line at the next 32 `K`.
    const TILED_STEP: usize = TILE_ROWS * TILE_COLS;

    /// Where the body of weight row `n` starts (at `kb0`), and how many elements lie between
    /// its 32-element steps: the row itself, or one 1 KiB block per step when tiled.
    #[inline]
    fn body_start(&self, n: usize) -> (usize, usize) {
        if self.tiled {
            (tiled_index(n, self.kb0, self.ldw), Self::TILED_STEP)
        } else {
            (n * self.ldw + self.kb0, 32)
        }
    }
}

fn gemm_dispatch(
    w: WeightsBf16<'_>,
    x: PackedActs<'_>,
    tile: &GemmTile,
    scale: Option<&[f32]>,
    out: &mut [f32],
    ld_out: usize,
) {
    gemm_dispatch_with(w, x, tile, scale, None, out, ld_out);
}

/// [`gemm_dispatch`] with, optionally, a conversion made once of `x` (used only when it was
/// made from `x`).
fn gemm_dispatch_with(
    w: WeightsBf16<'_>,
    x: PackedActs<'_>,
    tile: &GemmTile,
    scale: Option<&[f32]>,
    conv: Option<&ActsConversion>,
    out: &mut [f32],
    ld_out: usize,
) {
    let conv = conv.filter(|c| c.made_from(x));
    let (n, k) = (tile.n.clone(), tile.k.clone());
    assert!(
        n.start <= n.end && n.end <= w.rows(),
        "gemm_bf16: n range {n:?} outside {} rows",
        w.rows()
    );
    assert!(
        k.start <= k.end && k.end <= w.cols(),
        "gemm_bf16: k range {k:?} outside {} cols",
        w.cols()
    );
    assert_eq!(
        x.cols(),
        w.cols(),
        "gemm_bf16: activations K {} != weights K {}",
        x.cols(),
        w.cols()
    );
    let batch = x.rows();
    if n.is_empty() || batch == 0 {
        return;
    }
    assert!(
        batch == 1 || ld_out >= n.len(),
        "gemm_bf16: ld_out {ld_out} < tile width {}",
        n.len()
    );
    let need = (batch - 1)
        .checked_mul(ld_out)
        .and_then(|v| v.checked_add(n.len()));
    assert!(
        need.is_some_and(|need| out.len() >= need),
        "gemm_bf16: out too short"
    );
    let cols = w.cols();
    let full_end = cols / PACK_BLOCK * PACK_BLOCK;
    let kb0 = k.start.div_ceil(PACK_BLOCK) * PACK_BLOCK;
    let kb1 = k.end.min(full_end) / PACK_BLOCK * PACK_BLOCK;
    let (kb0, kb1) = if kb0 < kb1 {
        (kb0, kb1)
    } else {
        (k.start, k.start)
    };
    let tiled = w.layout() == WeightLayout::Tiled;
    let pairs = w.layout() == WeightLayout::Pairs;
    assert!(
        !pairs || n.start.is_multiple_of(PAIR_ROWS),
        "gemm_bf16: tile rows {n:?} of paired weights must start on a multiple of {PAIR_ROWS}"
    );
    if tiled {
        assert!(
            n.start.is_multiple_of(TILE_ROWS) && k.start.is_multiple_of(TILE_COLS),
            "gemm_bf16: tile rows {n:?} / k {k:?} of tiled weights must start on multiples of \
             {TILE_ROWS} rows / {TILE_COLS} columns"
        );
    }
    let lw = Lowered {
        // SAFETY: bf16 is a `repr(transparent)` wrapper of u16, so the slice is reinterpreted
        // element for element with the same length and alignment.
        w: unsafe { std::slice::from_raw_parts(w.data().as_ptr().cast::<u16>(), w.data().len()) },
        ldw: cols,
        tiled,
        pairs,
        x: x.data(),
        ldx: packed_ld(cols),
        batch,
        n,
        k,
        kb0,
        kb1,
        mode: tile.mode,
        scale,
    };
    #[cfg(target_arch = "x86_64")]
    match path_for(Isa::current(), batch, w.layout()) {
        Isa::AmxBf16 => {
            // The tiles made once, when they were made for this body.
            let tiles = conv
                .filter(|c| !c.vnni.is_empty() && (lw.kb0, lw.kb1) == (0, full_end))
                .map(|c| c.vnni.as_slice());
            // SAFETY: `path_for` names no path wider than `Isa::current`, which only returns
            // AmxBf16 when the CPU has AMX-BF16 and AVX-512 BF16 and Linux granted the tile
            // state; `lw` was checked above (ranges inside the matrices, output long enough);
            // the tiles were converted by `amx::convert` from `x`'s rows over this body (made
            // from `x`: same shape and address).
            unsafe { amx::gemm_with(&lw, tiles, out, ld_out) };
            return;
        }
        Isa::Avx512Bf16 => {
            // The natural rows made once, when they were made for this body (the kernels check
            // their length).
            let natural = conv
                .filter(|c| c.natural_len > 0 && (lw.kb0, lw.kb1) == (0, full_end))
                .map(|c| &c.natural[..c.natural_len]);
            if pairs {
                // SAFETY: `path_for` names no path wider than `Isa::current`, which only
                // returns Avx512Bf16 or wider when the CPU supports AVX-512 F/BW/VL and BF16;
                // `lw` was checked above, paired with its first row on a group.
                unsafe { avx512_pairs::gemm(&lw, natural, out, ld_out) };
            } else {
                // SAFETY: as above; row-major or tiled weights.
                unsafe { avx512::gemm(&lw, natural, out, ld_out) };
            }
            return;
        }
        Isa::Avx2 if pairs => {
            // SAFETY: `path_for` names no path wider than `Isa::current`, which only returns
            // Avx2 or wider when the CPU supports AVX2, FMA and F16C; `lw` was checked above,
            // paired with its first row on a group.
            unsafe { avx2::gemm_pairs(&lw, out, ld_out) };
            return;
        }
        Isa::Avx2 => {
            // SAFETY: as above; `path_for` gives the AVX2 passes row-major weights only here
            // (tiled weights take the portable loops below AVX-512).
            unsafe { avx2::gemm(&lw, out, ld_out) };
            return;
        }
        Isa::Portable => {}
    }
    portable::gemm(&lw, out, ld_out);
}

/// The widest batch whose row-major tiles the AVX-512 BF16 path leaves to the AVX2 passes. On
/// the 2-core Xeon with AMX of session 21 (the decode plan's blocks of the 0.6B projections
/// streamed from memory, `examples/gemm_step_bw`, 2 threads, processes alternated) the AVX2
/// four-stream passes, with their AVX-512 host prefetch distance, streamed 35–37 GB/s at
/// batches 1 and 2 where the 512-bit `vdpbf16ps` passes streamed 31–33. A `vdpbf16ps` batch-1
/// GEMV in the AVX2 pass's four-stream shape was tried and left: over 377 MB of projections it
/// read its tiles in 1.11× a plain read's time with 512-bit vectors and 1.03–1.06× with 256-bit
/// ones, where the AVX2 pass took 1.01–1.03×. From batch 3 the two paths were level.
const AVX2_STREAMS_MAX_BATCH: usize = 2;

/// The least batch whose paired tiles the AVX-512 BF16 path takes (`avx512_pairs.rs`); smaller
/// ones run the AVX2 passes over the same weights. On Zen 4 (session 44, `bench qwen3-decode
/// --versus-isa avx2`, 20 interleaved pairs) the AVX2 passes took 0.97× the step time at
/// 1 × 256, and 1.045× at 2 × 1024, 1.015× at 3 and 1.077× at 4.
const AVX512_PAIRS_MIN_BATCH: usize = 2;

/// Sum over the tile's edges (outside the body `[kb0, kb1)`) for weight row `n`, batch row `b`.
#[inline]
fn edge_sum(lw: &Lowered<'_>, n: usize, b: usize) -> f32 {
    if !lw.has_edges() {
        return 0.0;
    }
    let xrow = &lw.x[b * lw.ldx..b * lw.ldx + lw.ldw];
    let mut s = 0.0f32;
    for kk in (lw.k.start..lw.kb0).chain(lw.kb1..lw.k.end) {
        s += f32::from_bits(u32::from(lw.w_at(n, kk)) << 16) * xrow[pack_index(kk, lw.ldw)];
    }
    s
}

/// Writes one finished sum.
#[inline]
fn finish(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize, n: usize, b: usize, sum: f32) {
    let v = match lw.scale {
        Some(s) => sum * s[b],
        None => sum,
    };
    let o = &mut out[b * ld_out + (n - lw.n.start)];
    match lw.mode {
        OutMode::Store => *o = v,
        OutMode::Add => *o += v,
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    // Seeded values in (-1, 1), most not bf16 values.
    use crate::dsv4::tests::values;
    use crate::isa::with_isa;

    /// Both packers put value `k` of a row at [`pack_index`] and zero the padding, on every
    /// path, at widths around the packing block: the bf16 one's 256-bit body, its scalar tail
    /// and the portable build agree with that definition (and with the fp32 packer of the
    /// widened values) bit for bit, a NaN's payload and signed zeros included.
    #[test]
    fn packers_place_every_value_at_its_pack_index_on_every_path() {
        for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
            with_isa(isa, || {
                for (rows, cols) in [
                    (1usize, 1usize),
                    (2, 15),
                    (3, 16),
                    (2, 17),
                    (2, 31),
                    (1, 47),
                    (4, 33),
                    (8, 4096),
                    (3, 0),
                ] {
                    let mut x: Vec<bf16> = values(rows * cols, cols as u64)
                        .iter()
                        .map(|&v| bf16::from_f32(v))
                        .collect();
                    if let Some(v) = x.first_mut() {
                        *v = bf16::from_bits(0x7F81); // a signalling NaN's bits
                    }
                    if x.len() > 1 {
                        x[1] = bf16::from_bits(0x8000);
                    }
                    let ld = packed_ld(cols);
                    let mut want = vec![f32::from_bits(0x7FC0_0001); rows * ld];
                    for r in 0..rows {
                        want[r * ld..(r + 1) * ld].fill(0.0);
                        for k in 0..cols {
                            let v = f32::from_bits(u32::from(x[r * cols + k].to_bits()) << 16);
                            want[r * ld + pack_index(k, cols)] = v;
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    let mut got = vec![1.5f32; rows * ld];
                    pack_acts_bf16(&x, rows, cols, &mut got);
                    assert_eq!(bits(&got), bits(&want), "bf16 {rows}x{cols} on {isa:?}");
                    let wide: Vec<f32> = x
                        .iter()
                        .map(|v| f32::from_bits(u32::from(v.to_bits()) << 16))
                        .collect();
                    let mut got = vec![1.5f32; rows * ld];
                    pack_acts_f32(&wide, rows, cols, &mut got);
                    assert_eq!(bits(&got), bits(&want), "f32 {rows}x{cols} on {isa:?}");
                }
            });
        }
    }

    /// The AMX tiles made straight from fp32 rows give [`gemm_bf16`]'s results on the packed
    /// rows bit for bit (activations not bf16 values, so the conversion's rounding is tested
    /// too), and are refused where the AMX path would not take them whole.
    #[test]
    fn amx_acts_from_rows_match_the_packed_product_bit_for_bit() {
        let ran = with_isa(Isa::AmxBf16, || {
            // One `AmxActs` for every shape: what a bigger call left changes nothing.
            let mut acts = AmxActs::default();
            for (rows, cols, n) in [
                (64usize, 512usize, 128usize),
                (5, 32, 1),
                (70, 96, 33),
                (16, 64, 17),
            ] {
                let x = values(rows * cols, (rows * cols) as u64);
                let wv: Vec<bf16> = values(n * cols, 7)
                    .iter()
                    .map(|&v| bf16::from_f32(v))
                    .collect();
                let w = WeightsBf16::new(&wv, n, cols);
                let mut packed = vec![0.0; packed_len(rows, cols)];
                pack_acts_f32(&x, rows, cols, &mut packed);
                let ld = n + 3;
                let mut want = vec![0.5f32; rows * ld];
                gemm_bf16(
                    w,
                    PackedActs::new(&packed, rows, cols),
                    &GemmTile::full(&w),
                    &mut want,
                    ld,
                );
                assert!(acts.prepare_f32(&x, rows, cols), "{rows}x{cols}");
                let mut got = vec![0.5f32; rows * ld];
                gemm_bf16_amx(w, &acts, &mut got, ld);
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{rows}x{cols} by {n}");
            }
            // Too few rows for the tiles, a body with a 16-element strip.
            assert!(!acts.prepare_f32(&values(4 * 64, 1), 4, 64));
            assert!(!acts.prepare_f32(&values(8 * 48, 1), 8, 48));
        });
        // Off the AMX path nothing is made.
        with_isa(Isa::Avx512Bf16, || {
            assert!(!AmxActs::default().prepare_f32(&values(64 * 64, 1), 64, 64));
        });
        println!("AMX activations from rows ran: {}", ran.is_some());
    }
}
