//! Sparse attention with an attention sink over a candidate list (`docs/dsv4.md`, "SWA layer"
//! step 3): every head of a token attends to the same candidate rows (one row is K and V of
//! every head), with the softmax in fp32, `o = bf16(p) @ kv` and the sink as a logit with a
//! zero value row: `out = o / (Σ p + exp(sink − m))`.
//!
//! A candidate is `None` when masked (padding, an invalid index): it is skipped, so it changes
//! nothing; a list with no valid row gives zeros.
//!
//! # Engines
//! The KV row is shared by every head (MQA-like), so the rows are read once for all the heads
//! of the call, and the softmax is taken over all of them at once (the exact max of each head,
//! not a running one), so the value product runs once over every row and `out` is written once.
//! On AVX-512 BF16 where the AMX tiles do not take the call (no AMX, or heads not whole
//! 16-head blocks) and rows of whole 16-column blocks, the call runs on the **head-lane
//! engine** (`lanes.rs`): the heads are the vector lanes, each row's pairs are broadcast from
//! where the row lies into the scores, the rows are interleaved into the value product's pair
//! layout (`amx::interleave_pair`) as they are scored, and every product is `vdpbf16ps`. On a
//! FLASH CSA token it took 0.82× the time of the row-block form below on Zen 4 (200 against
//! 165 GFLOP/s on one core, `docs/benchmarks.md`, session 47).
//!
//! # Row blocks (AMX, AVX2, portable)
//! 1. the valid rows are taken block by block (at most [`ATTN_TILE`] rows): a candidate may
//!    be a run of rows adjacent in their cache (a sequence's window slots, HCA's compressed
//!    rows), and a run of at least `MIN_IN_PLACE` (32) rows is read where it lies; the other rows
//!    (the scattered compressed candidates) are copied into a contiguous `[nb, d]` block, a
//!    row copy each; nothing is transposed;
//! 2. the scores of every head against each block are one product with the rows as the
//!    weights and the heads' queries as the activations (AMX tiles from 16 heads, AVX2,
//!    portable), written into the call's `[heads, n]` scores; on AMX the queries are converted
//!    once per call straight into the tile unit's layout (`AmxActs`: no packed copy), elsewhere
//!    packed once ([`crate::gemm_bf16_prepared`]); on AMX each pair of rows is also
//!    interleaved into the value product's pair layout as soon as it is copied (read back from
//!    L1) or, in place, from its cache, and only one block of plain rows is kept;
//! 3. the softmax of all heads over all `n` scores (`softmax_rows`: scale, max, `exp` as a
//!    power of two (`math::exp2_approx`, ~2e-7 relative), sum,
//!    `bf16(p)` written as bf16 bits `[heads, n32]`, the `P` operand of every value product)
//!    is one lane-blocked body compiled portable, for AVX2 and for AVX-512, chosen at run
//!    time; the builds agree bit for bit;
//! 4. the value product `out[h] = Σ_j bf16(p[h, j]) · row_j` over all `n` rows: on AMX
//!    (`amx.rs`, heads a multiple of 16, `d` of 32) the rows are in pairs in the tile unit's
//!    VNNI layout, the heads' weights are the `A` operand and each 32-head × 32-column block
//!    of `out` stays in tiles over every row, stored once; elsewhere `pv_add` reads the rows as
//!    they lie (`[n, d]`): on AVX2 a register-blocked kernel of 6 heads × 16 columns
//!    (`pv_avx2`), on the other builds a lane body of 4 heads × 16 columns built like the
//!    softmax; the two give the same bits.

use half::bf16;

#[cfg(target_arch = "x86_64")]
use crate::gemm::{AmxActs, gemm_bf16_amx};
use crate::gemm::{GemmTile, PreparedActs, WeightsBf16, gemm_bf16_prepared};
use crate::isa::Isa;
use crate::math::exp2_approx;
use crate::multiversion::multiversion;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod lanes;
#[cfg(target_arch = "x86_64")]
mod pv_avx2;

/// Rows per block of the copy and the scores' product; the planning's tile of a candidate
/// list ([`super::plan`]).
pub const ATTN_TILE: usize = 128;

/// Rows per step of the value product's pair layout (one `K` step of the AMX tiles): a call's
/// rows are zero-padded to a multiple of it.
const ROW_STEP: usize = 32;

/// Reusable buffers of [`sparse_attention`] (sized on first use, kept between calls).
#[derive(Debug, Default)]
pub struct AttnScratch {
    /// The valid rows `[n, d]` (one [`ATTN_TILE`] block of them where the value product takes
    /// the pair layout), zero rows after the last up to a multiple of [`ROW_STEP`].
    rows: Vec<bf16>,
    /// The queries as the scores' product takes them (converted once per call).
    q: PreparedActs,
    /// bf16 queries widened, where the scores' product takes fp32 ones (not AMX).
    q_wide: Vec<f32>,
    /// The queries as the AMX path's tiles alone, where that path takes the scores' product
    /// (then `q` is not made).
    #[cfg(target_arch = "x86_64")]
    q_amx: AmxActs,
    /// The scores `[heads, n]`.
    scores: Vec<f32>,
    /// `bf16(p)` as bf16 bits `[heads, n32]`, zero past `n` (every value product's `P`).
    p: Vec<u16>,
    m: Vec<f32>,
    l: Vec<f32>,
    /// Per head, `1 / (Σ p + exp(sink − m))`.
    inv: Vec<f32>,
    /// The pair-layout value products' operands.
    #[cfg(target_arch = "x86_64")]
    amx: amx::PvScratch,
    /// The addresses of the call's copied rows, in order: only prefetched, never read
    /// through.
    scattered: Vec<usize>,
    /// The head-lane engine's buffers (AVX-512 BF16 without AMX).
    #[cfg(target_arch = "x86_64")]
    lanes: lanes::LanesScratch,
}

/// Scattered rows prefetched ahead of their copy. Their copy waited on each row's first lines
/// from memory in turn: the cold step's attention took ~50 µs a token more than with the rows
/// cached.
const COPY_AHEAD: usize = 16;

/// Prefetches the `d` bf16 of the row at address `row` into L2 (a hint: never faults, whatever
/// the address).
fn prefetch_row(row: usize, d: usize) {
    let p = std::ptr::without_provenance::<bf16>(row);
    for off in (0..d).step_by(32) {
        crate::simd::prefetch_l2(p.wrapping_add(off));
    }
}

/// Which value-product path [`sparse_attention`] takes for `heads` heads of `d` on `isa`.
pub fn pv_path(isa: Isa, heads: usize, d: usize) -> Isa {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::AmxBf16 && amx::supports(heads, d) {
        return Isa::AmxBf16;
    }
    let _ = (heads, d);
    isa.min(Isa::Avx512Bf16)
}

/// The engine a [`sparse_attention`] call runs on ([`engine`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// Row blocks with the value product on AMX-BF16 tiles.
    AmxTiles,
    /// The head-lane engine, every product `vdpbf16ps` (`lanes.rs`).
    HeadLanes,
    /// Row blocks on this path's GEMM and value product (AVX2, portable).
    RowBlocks(Isa),
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Engine::AmxTiles => f.write_str("amx-bf16 tiles"),
            Engine::HeadLanes => f.write_str("avx512-bf16 head lanes"),
            Engine::RowBlocks(isa) => write!(f, "{} row blocks", isa.name()),
        }
    }
}

/// The engine [`sparse_attention`] runs `heads` heads of `d` on with `isa`.
pub fn engine(isa: Isa, heads: usize, d: usize) -> Engine {
    match pv_path(isa, heads, d) {
        Isa::AmxBf16 => Engine::AmxTiles,
        p if takes_lanes(p, d) => Engine::HeadLanes,
        p => Engine::RowBlocks(p),
    }
}

/// Whether the call runs on the head-lane engine (`lanes.rs`): on AVX-512 BF16 where the
/// AMX tiles do not take it, rows of whole 16-column blocks.
fn takes_lanes(path: Isa, d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        path == Isa::Avx512Bf16 && lanes::supports(d)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (path, d);
        false
    }
}

/// Runs of at least this many rows (adjacent in their cache) are read where they lie, by the
/// scores' product and the pair layout; the other rows are copied into a block. A block of
/// fewer rows would pay more in the product's per-block work than its copy costs.
const MIN_IN_PLACE: usize = ROW_STEP;

/// Where a block of a call's rows lies: in its cache, or copied at an offset of the scratch's
/// `rows`.
#[derive(Clone, Copy)]
enum Block<'a> {
    InPlace(&'a [bf16]),
    Copied(usize),
}

/// The present rows of a candidate list in order, run by run.
struct Runs<'c, 'a> {
    cands: std::slice::Iter<'c, Option<&'a [bf16]>>,
    /// What is left of the current run.
    run: &'a [bf16],
    d: usize,
}

impl<'a> Runs<'_, 'a> {
    /// Rows left in the current run, moving to the next present one when it is spent; 0 when
    /// the list is.
    fn left(&mut self) -> usize {
        while self.run.is_empty() {
            match self.cands.next() {
                Some(Some(r)) => self.run = r,
                Some(None) => {}
                None => return 0,
            }
        }
        self.run.len() / self.d
    }

    /// The next `k` rows of the current run (`k <= left()`).
    fn take(&mut self, k: usize) -> &'a [bf16] {
        let (rows, rest) = self.run.split_at(k * self.d);
        self.run = rest;
        rows
    }
}

/// The queries of one [`sparse_attention`] call, `[heads, d]`.
#[derive(Clone, Copy, Debug)]
pub enum Queries<'a> {
    /// bf16 values in fp32 slots.
    F32(&'a [f32]),
    /// bf16: on AMX each tile line is one load of a row's 32 values; elsewhere widened into
    /// the scratch first.
    Bf16(&'a [bf16]),
}

impl Queries<'_> {
    fn len(&self) -> usize {
        match self {
            Queries::F32(q) => q.len(),
            Queries::Bf16(q) => q.len(),
        }
    }
}

/// Attention of `heads = sinks.len()` heads over `cands`.
///
/// `q` is `[heads, d]` (bf16 values; fp32 slots or bf16, [`Queries`]), `out` `[heads, d]`. A present candidate is one row of
/// `d` or a run of rows adjacent in their cache (a whole multiple of `d` long, e.g. a
/// sequence's window slots): a run of at least `MIN_IN_PLACE` (32) rows is read where it lies,
/// the rest are copied. Scores are `q · row · scale`.
///
/// # Panics
/// If `q` or `out` is not `heads · d` long or a candidate is not a whole number of rows.
pub fn sparse_attention(
    q: Queries<'_>,
    d: usize,
    cands: &[Option<&[bf16]>],
    scale: f32,
    sinks: &[f32],
    out: &mut [f32],
    s: &mut AttnScratch,
) {
    let heads = sinks.len();
    assert_eq!(q.len(), heads * d, "sparse_attention: q len");
    assert_eq!(out.len(), heads * d, "sparse_attention: out len");
    if heads == 0 || d == 0 {
        out.fill(0.0);
        return;
    }
    let n: usize = cands
        .iter()
        .flatten()
        .map(|r| {
            assert!(
                r.len().is_multiple_of(d),
                "sparse_attention: candidate len {} is not whole rows of {d}",
                r.len()
            );
            r.len() / d
        })
        .sum();
    if n == 0 {
        out.fill(0.0);
        return;
    }
    let path = pv_path(Isa::current(), heads, d);
    let engine = engine(Isa::current(), heads, d);
    #[cfg(target_arch = "x86_64")]
    if engine == Engine::HeadLanes {
        lanes::attend(q, d, cands, n, scale, sinks, out, &mut s.lanes);
        return;
    }
    // From here the rows are taken block by block; on AMX the value product takes them in
    // pairs.
    let pairs = engine == Engine::AmxTiles;
    let n32 = n.div_ceil(ROW_STEP) * ROW_STEP;
    #[cfg(target_arch = "x86_64")]
    let q_tiles = match q {
        Queries::F32(q) => s.q_amx.prepare_f32(q, heads, d),
        Queries::Bf16(q) => s.q_amx.prepare_bf16(q, heads, d),
    };
    #[cfg(not(target_arch = "x86_64"))]
    let q_tiles = false;
    if !q_tiles {
        match q {
            Queries::F32(q) => s.q.prepare_f32(q, heads, d),
            Queries::Bf16(q) => {
                s.q_wide.resize(q.len(), 0.0);
                crate::convert::cast_bf16_f32(q, &mut s.q_wide);
                s.q.prepare_f32(&s.q_wide, heads, d);
            }
        }
    }
    s.scores.resize(heads * n, 0.0);
    let rows_at = aligned64(
        &mut s.rows,
        if pairs { ATTN_TILE.min(n32) } else { n32 } * d,
    );
    #[cfg(target_arch = "x86_64")]
    let vnni_at = if pairs {
        aligned64(&mut s.amx.vnni, amx::layout_len(n32, d))
    } else {
        0..0
    };
    // 1-2. Block by block: the rows (a long run where it lies, else copied, each pair put in
    // the pair layout as soon as it is copied, read back from L1); scores[h, j] = q[h] · row[j].
    // A block in place is an even number of rows and a copied one is cut at an even count
    // before a long run, so every block starts on a whole pair.
    let mut runs = Runs {
        cands: cands.iter(),
        run: &[],
        d,
    };
    // The rows of runs shorter than `MIN_IN_PLACE` (a top-k list's scattered cache rows), in
    // order, so each of their copies can prefetch the one `COPY_AHEAD` rows on. (The few rows
    // a long run leaves past its last in-place block are copied too but not listed: after them
    // the prefetches run a little further ahead.)
    let mut scattered = std::mem::take(&mut s.scattered);
    scattered.clear();
    for r in cands.iter().flatten() {
        if r.len() / d < MIN_IN_PLACE {
            scattered.extend(r.chunks_exact(d).map(|row| row.as_ptr() as usize));
        }
    }
    for &row in scattered.iter().take(COPY_AHEAD) {
        prefetch_row(row, d);
    }
    let mut copied = 0;
    // The blocks, kept for the value product that reads the rows as they lie.
    let mut blocks = Vec::new();
    let mut j0 = 0;
    while j0 < n {
        let left = runs.left();
        let (nb, block) = if left >= MIN_IN_PLACE {
            let nb = ATTN_TILE.min(left) & !1;
            let rows = runs.take(nb);
            #[cfg(target_arch = "x86_64")]
            if pairs {
                amx::interleave(rows, d, &mut s.amx.vnni[vnni_at.clone()], n32 / 2, j0 / 2);
            }
            (nb, Block::InPlace(rows))
        } else {
            let at = rows_at.start + if pairs { 0 } else { j0 * d };
            let cap = ATTN_TILE.min(n - j0);
            // Room for the block and, at the end of an odd call, the zero row its last row pairs
            // with (a block cut before a long run is even).
            let room = if pairs { ATTN_TILE.min(n32) } else { n32 - j0 };
            let copy = &mut s.rows[at..at + room * d];
            let mut nb = 0;
            while nb < cap {
                let left = runs.left();
                if left >= MIN_IN_PLACE && nb.is_multiple_of(2) {
                    break;
                }
                // One row of a long run only evens the block; short runs are copied whole.
                let k = if left >= MIN_IN_PLACE {
                    1
                } else {
                    left.min(cap - nb)
                };
                if left < MIN_IN_PLACE {
                    for &row in scattered.iter().skip(copied + COPY_AHEAD).take(k) {
                        prefetch_row(row, d);
                    }
                    copied += k;
                }
                copy[nb * d..(nb + k) * d].copy_from_slice(runs.take(k));
                let done = nb / 2 * 2;
                nb += k;
                let upto = if pairs && !nb.is_multiple_of(2) && nb == n - j0 {
                    // The last row pairs with a zero row.
                    copy[nb * d..(nb + 1) * d].fill(bf16::ZERO);
                    nb + 1
                } else {
                    nb / 2 * 2
                };
                #[cfg(target_arch = "x86_64")]
                if pairs && upto > done {
                    amx::interleave(
                        &copy[done * d..upto * d],
                        d,
                        &mut s.amx.vnni[vnni_at.clone()],
                        n32 / 2,
                        (j0 + done) / 2,
                    );
                }
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (done, upto);
            }
            (nb, Block::Copied(at))
        };
        let rows = match block {
            Block::InPlace(r) => r,
            Block::Copied(at) => &s.rows[at..at + nb * d],
        };
        let rows = WeightsBf16::new(rows, nb, d);
        #[cfg(target_arch = "x86_64")]
        if q_tiles {
            gemm_bf16_amx(rows, &s.q_amx, &mut s.scores[j0..], n);
        }
        if !q_tiles {
            gemm_bf16_prepared(rows, &s.q, &GemmTile::full(&rows), &mut s.scores[j0..], n);
        }
        if !pairs {
            blocks.push((j0, nb, block));
        }
        j0 += nb;
    }
    s.scattered = scattered;
    #[cfg(target_arch = "x86_64")]
    if pairs {
        // The pairs past the last row meet zero weights; zero rows keep a NaN out.
        amx::zero_lines(&mut s.amx.vnni[vnni_at.clone()], d, n32 / 2, n.div_ceil(2));
    }
    // 3. The softmax over every row.
    s.m.resize(heads, 0.0);
    s.l.resize(heads, 0.0);
    s.inv.resize(heads, 0.0);
    let p_at = aligned64(&mut s.p, heads * n32);
    let pb = &mut s.p[p_at];
    softmax_rows(&s.scores, n, scale, &mut s.m, &mut s.l, pb, n32);
    let pb = &*pb;
    // 4. out[h] = bf16(p[h]) @ rows
    match path {
        #[cfg(target_arch = "x86_64")]
        Isa::AmxBf16 if pairs => {
            amx::pv_store(pb, heads, n32, &s.amx.vnni[vnni_at], d, out);
        }
        _ => {
            out.fill(0.0);
            for &(j0, nb, block) in &blocks {
                let rows = match block {
                    Block::InPlace(r) => r,
                    Block::Copied(at) => &s.rows[at..at + nb * d],
                };
                pv_add(&pb[j0..], n32, heads, nb, rows, d, out);
            }
        }
    }
    // One division per head, then products (a division per element costs more than the rest
    // of this pass).
    for ((inv, &m), (&l, &sink)) in s.inv.iter_mut().zip(&s.m).zip(s.l.iter().zip(sinks)) {
        *inv = 1.0 / (l + (sink - m).exp());
    }
    scale_rows(out, d, &s.inv);
}

multiversion! {
    avx512;
    /// `out` row `h` (`d` values) times `inv[h]`. Built for each path: in `sparse_attention`'s
    /// own build the loop compiled to 128-bit products. (Scaling each 32 × 32 block of the AMX
    /// value product as it is stored, from L1, was not shown faster: the host drifted between
    /// the runs, `docs/benchmarks.md`, session 34.)
    ///
    /// # Panics
    /// If `out` is not `inv.len()` rows of `d`.
    fn scale_rows(out: &mut [f32], d: usize, inv: &[f32]) {
        assert_eq!(out.len(), inv.len() * d, "scale_rows: out len");
        for (o, &r) in out.chunks_exact_mut(d.max(1)).zip(inv) {
            o.iter_mut().for_each(|v| *v *= r);
        }
    }
}

/// `v` resized to hold `len` elements from a 64-byte boundary (whole cache lines for the
/// tile loads and the pair layout's stores); where those elements are.
fn aligned64<T: Clone + Default>(v: &mut Vec<T>, len: usize) -> std::ops::Range<usize> {
    let spare = 64 / size_of::<T>().max(1);
    v.resize(len + spare, T::default());
    let at = v.as_ptr().align_offset(64);
    let at = if at < spare { at } else { 0 };
    at..at + len
}

/// Lanes of the softmax's partial maxima and sums.
const LANES: usize = 16;

/// Rounds a finite `x` to the nearest bf16 value (ties to even), as fp32.
#[inline(always)]
fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000)
}

multiversion! {
    avx512;
    /// The softmax of every head over `n` scores: `scores` `[heads, n]` (unscaled, heads =
    /// `m.len()`) are scaled; per head the max `m`, `e = exp(score − m)`, `l = Σ e` and `p =
    /// bf16(e)` as bf16 bits, row `h` at `h · ld` in `p` (`[heads, ld]`, zeros after the `n`
    /// values). The maxima and sums run in [`LANES`] lanes reduced in a fixed order.
    ///
    /// # Panics
    /// If `scores` is not `heads · n` long, `p` not `heads · ld`, `ld < n` or `l` not `heads`
    /// long.
    pub(crate) fn softmax_rows(
        scores: &[f32],
        n: usize,
        scale: f32,
        m: &mut [f32],
        l: &mut [f32],
        p: &mut [u16],
        ld: usize,
    ) {
        let heads = m.len();
        assert_eq!(scores.len(), heads * n, "softmax_rows: scores len");
        assert!(ld >= n && p.len() == heads * ld, "softmax_rows: p len");
        assert_eq!(l.len(), heads, "softmax_rows: l len");
        let body = n / LANES * LANES;
        let bits = |e: f32| (round_bf16(e).to_bits() >> 16) as u16;
        for h in 0..heads {
            let sc = &scores[h * n..(h + 1) * n];
            let ph = &mut p[h * ld..(h + 1) * ld];
            // The max of the scaled scores. `f32::max`'s NaN rule kept this loop scalar (a
            // compare, a max and a blend per value); a plain comparison ignores a NaN score
            // as it does (a lane starts at -inf and takes only a larger value) and vectorizes.
            let mut mx = [f32::NEG_INFINITY; LANES];
            let larger = |m: f32, v: f32| if v > m { v } else { m };
            for s in sc[..body].as_chunks::<LANES>().0 {
                mx = std::array::from_fn(|i| larger(mx[i], s[i] * scale));
            }
            for (i, s) in sc[body..].iter().enumerate() {
                mx[i] = larger(mx[i], s * scale);
            }
            let mt = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            m[h] = mt;
            // exp(s · scale − m) = 2^(s · scale · log2 e − m · log2 e).
            let (c, mc) = (scale * std::f32::consts::LOG2_E, mt * std::f32::consts::LOG2_E);
            let mut sum = [0.0f32; LANES];
            for (s, o) in sc[..body].chunks_exact(LANES).zip(ph[..body].chunks_exact_mut(LANES)) {
                for i in 0..LANES {
                    let e = exp2_approx(s[i] * c - mc);
                    sum[i] += e;
                    o[i] = bits(e);
                }
            }
            for (i, (s, o)) in sc[body..].iter().zip(&mut ph[body..n]).enumerate() {
                let e = exp2_approx(s * c - mc);
                sum[i] += e;
                *o = bits(e);
            }
            ph[n..].fill(0);
            // Pairwise, in a fixed order.
            let mut w = LANES;
            while w > 1 {
                w /= 2;
                for i in 0..w {
                    sum[i] += sum[i + w];
                }
            }
            l[h] = sum[0];
        }
    }
}

/// Heads per block of [`pv_add_lanes`].
const PV_HEADS: usize = 4;
/// Columns per block of [`pv_add_lanes`].
const PV_COLS: usize = 16;

/// `out[h, c] += Σ_j p[h, j] · rows[j, c]`: [`pv_add_lanes`]'s contract and results (the
/// same bits), on AVX2 (without AVX-512) by `pv_avx2`'s register-blocked kernel, elsewhere by
/// the lane body.
///
/// # Panics
/// If the lengths disagree.
pub(crate) fn pv_add(
    p: &[u16],
    ld: usize,
    heads: usize,
    n: usize,
    rows: &[bf16],
    d: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = Isa::current();
        if isa >= Isa::Avx2 && isa < Isa::Avx512Bf16 {
            assert!(
                ld >= n && (heads == 0 || p.len() >= (heads - 1) * ld + n),
                "pv_add: p len"
            );
            assert_eq!(rows.len(), n * d, "pv_add: rows len");
            assert_eq!(out.len(), heads * d, "pv_add: out len");
            // SAFETY: `Isa::current` is Avx2 or wider only on a CPU with AVX2 and FMA; the
            // lengths were checked just above.
            unsafe { pv_avx2::pv_add(p, ld, heads, n, rows, d, out) };
            return;
        }
    }
    pv_add_lanes(p, ld, heads, n, rows, d, out);
}

multiversion! {
    avx512;
    /// `out[h, c] += Σ_j p[h, j] · rows[j, c]` for `p` `[heads, ld]` (bf16 bits, the first `n`
    /// of each row read; the last row may stop there, so a view from a column offset of a
    /// wider `P` is one too), `rows` `[n, d]` bf16 read in place, `out` `[heads, d]` (heads =
    /// `out.len() / d`): blocks of [`PV_HEADS`] heads × [`PV_COLS`] columns accumulate over `j`
    /// in registers (fused multiply-adds, in `j` order) and are added to `out` once.
    ///
    /// Fused, unlike this crate's other lane bodies: every build gives the same bits either
    /// way (the portable one calls the C library's `fmaf`, slow but exact, and runs only where
    /// the CPU has no AVX2 or a test forces it), and the AVX2 kernel that must match them
    /// ([`pv_avx2`]) is bound by its vector pipes, where a product and a sum cost two
    /// instructions against one (`docs/benchmarks.md`).
    ///
    /// # Panics
    /// If the lengths disagree.
    pub(crate) fn pv_add_lanes(
        p: &[u16],
        ld: usize,
        heads: usize,
        n: usize,
        rows: &[bf16],
        d: usize,
        out: &mut [f32],
    ) {
        assert!(
            ld >= n && (heads == 0 || p.len() >= (heads - 1) * ld + n),
            "pv_add: p len"
        );
        assert_eq!(rows.len(), n * d, "pv_add: rows len");
        assert_eq!(out.len(), heads * d, "pv_add: out len");
        let widen = |v: u16| f32::from_bits(u32::from(v) << 16);
        let mut h0 = 0;
        while h0 < heads {
            let hb = PV_HEADS.min(heads - h0);
            let mut c0 = 0;
            while c0 < d {
                let cw = PV_COLS.min(d - c0);
                let mut acc = [[0.0f32; PV_COLS]; PV_HEADS];
                if hb == PV_HEADS && cw == PV_COLS {
                    for j in 0..n {
                        let src = &rows[j * d + c0..j * d + c0 + PV_COLS];
                        let r: [f32; PV_COLS] = std::array::from_fn(|c| widen(src[c].to_bits()));
                        for (hh, a) in acc.iter_mut().enumerate() {
                            let pj = widen(p[(h0 + hh) * ld + j]);
                            for c in 0..PV_COLS {
                                a[c] = pj.mul_add(r[c], a[c]);
                            }
                        }
                    }
                } else {
                    for j in 0..n {
                        let src = &rows[j * d + c0..j * d + c0 + cw];
                        for (hh, a) in acc.iter_mut().enumerate().take(hb) {
                            let pj = widen(p[(h0 + hh) * ld + j]);
                            for (a, &v) in a.iter_mut().zip(src) {
                                *a = pj.mul_add(widen(v.to_bits()), *a);
                            }
                        }
                    }
                }
                for (hh, a) in acc.iter().enumerate().take(hb) {
                    let o = &mut out[(h0 + hh) * d + c0..(h0 + hh) * d + c0 + cw];
                    for (o, &a) in o.iter_mut().zip(a) {
                        *o += a;
                    }
                }
                c0 += cw;
            }
            h0 += hb;
        }
    }
}

#[cfg(test)]
mod tests;
