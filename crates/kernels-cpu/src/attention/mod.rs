//! Attention over the paged KV cache (vLLM layout): split-KV decode (flash-decoding partials
//! and their combine) and chunked causal prefill, both with online softmax over KV runs of at
//! most 128 tokens.
//!
//! # Layouts
//! - One layer's K (and V) pool is viewed as `[num_pages * page_size, kv_heads * head_dim]`
//!   bf16: row `page * page_size + token_in_page`, column `kv_head * head_dim + d`.
//! - `block_table` (one sequence's row, `u32`): logical block `j` -> physical page.
//! - Queries are bf16 rows of `num_heads * head_dim` (RoPE applied); query head
//!   `h = kv_head * group + j` reads KV head `kv_head` (GQA).
//! - A decode partial for one `(sequence, kv_head, chunk)` is `group` records of
//!   `[m, l, o[0..head_dim]]` fp32: `m` the running max score, `l` the sum of `exp(s - m)`,
//!   `o` the unnormalised `sum exp(s - m) v` ([`partial_len`] floats in all).

use std::ops::Range;

use half::bf16;

use crate::convert::f32_to_bf16;
use crate::multiversion::multiversion;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod flash;
#[cfg(target_arch = "x86_64")]
mod pairs;

/// The partial records (`[m, l, o...]` per query, `hd + 2` floats) of one head's SIMD state
/// `st` (`[queries, o, m, l]` as the x86 kernels keep it, `group` queries). The kernels hold
/// `o` in lane pairs: each `2 * HALF` outputs sit as the even elements then the odd ones
/// (what one 2-wide `bf16` dot product yields), so the records put them back in element order.
#[cfg(target_arch = "x86_64")]
fn write_partials<const HALF: usize>(st: &[f32], group: usize, hd: usize, out: &mut [f32]) {
    let o = &st[group * hd..2 * group * hd];
    let ml = &st[2 * group * hd..];
    for j in 0..group {
        let rec = &mut out[j * (hd + 2)..(j + 1) * (hd + 2)];
        rec[0] = ml[j];
        rec[1] = ml[group + j];
        for (dst, src) in rec[2..]
            .chunks_exact_mut(2 * HALF)
            .zip(o[j * hd..(j + 1) * hd].chunks_exact(2 * HALF))
        {
            for i in 0..HALF {
                dst[2 * i] = src[i];
                dst[2 * i + 1] = src[HALF + i];
            }
        }
    }
}
mod core;
mod prefill;

pub use prefill::{
    PrefillQueries, PrefillRows, PrefillSeq, prefill_attention_bf16, prefill_attention_rows_f32,
    prefill_attention_rows_packed,
};

/// A kernel of the all-heads decode attention ([`decode_attention_heads_bf16`], what the model
/// runs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeKernel {
    /// Plain loops, one KV head at a time.
    Portable,
    /// AVX2 + FMA, token-major: each pool row read whole for every head, groups 1–4 as several
    /// far-apart streams; K and V widened to fp32.
    Avx2,
    /// AVX-512 BF16, token-major: the AVX2 kernel's walk and `p · V`, the scores on `vdpbf16ps`
    /// (bf16 queries and keys as they are).
    Avx512Bf16,
    /// AVX-512 BF16, head-major: each 32-token run worked head by head with the next heads'
    /// slices prefetched, 16 rows' scores reduced together, `p · V` on 512-bit vectors.
    Avx512Bf16Heads,
    /// AVX-512 BF16, token-major runs worked head by head, both products on `vdpbf16ps`:
    /// `p · V` over token pairs with the probabilities rounded to bf16 (`pairs.rs`).
    Avx512Bf16Pairs,
}

impl DecodeKernel {
    /// Every kernel, in order of the instruction set they need.
    pub const ALL: [DecodeKernel; 5] = [
        DecodeKernel::Portable,
        DecodeKernel::Avx2,
        DecodeKernel::Avx512Bf16,
        DecodeKernel::Avx512Bf16Heads,
        DecodeKernel::Avx512Bf16Pairs,
    ];

    /// The name benches print and flags take.
    pub fn name(self) -> &'static str {
        match self {
            DecodeKernel::Portable => "portable",
            DecodeKernel::Avx2 => "avx2",
            DecodeKernel::Avx512Bf16 => "avx512-bf16",
            DecodeKernel::Avx512Bf16Heads => "avx512-bf16-heads",
            DecodeKernel::Avx512Bf16Pairs => "avx512-bf16-pairs",
        }
    }

    /// The kernel of that [`name`](DecodeKernel::name).
    pub fn from_name(name: &str) -> Option<DecodeKernel> {
        DecodeKernel::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The instruction set the kernel runs on.
    pub fn isa(self) -> crate::isa::Isa {
        use crate::isa::Isa;
        match self {
            DecodeKernel::Portable => Isa::Portable,
            DecodeKernel::Avx2 => Isa::Avx2,
            DecodeKernel::Avx512Bf16
            | DecodeKernel::Avx512Bf16Heads
            | DecodeKernel::Avx512Bf16Pairs => Isa::Avx512Bf16,
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_supported(self) -> bool {
        self.isa().is_supported()
    }
}

/// The decode attention kernel a thread whose kernels run on `isa` takes for a query group of
/// `group` (query heads per KV head): on the AVX-512 BF16 path the token-major kernel up to a
/// group of 4 and the token-pair kernel from 5 on, the head-major one on the AMX path, else
/// the path's own.
///
/// Why: on Zen 4 (AVX-512 BF16 without AMX, 512-bit operations on 256-bit pipes) the
/// head-major kernel lost to the AVX2 one (0.96–0.975× the step time at 1 × 256, 4 × 1024 and
/// 16 × 1024), and the token-major `vdpbf16ps` kernel took 0.87–0.90× the AVX2 kernel's time
/// at 4 × 1024 and 16 × 1024 and 0.89× at 1 × 256 (`attn_bw --shape`, 2 threads, interleaved
/// rounds). From a group of 5 (Qwen3-14B's) its widened `p · V` made it compute-bound, and
/// the token-pair kernel, both products on `vdpbf16ps`, took 0.971× its whole 16 × 3500 step
/// (paired steps); at Qwen3-0.6B's group of 2 the token-major kernel's row streams read
/// faster from memory (`pairs.rs`). On the AMX Xeon the head-major kernel beat the AVX2 one
/// by 4–14% of the step, and both later kernels lose to it there: whole steps with the
/// token-major kernel took 1.013× (4 × 1024) and 1.032× (16 × 1024) the head-major kernel's
/// time, with the token-pair kernel 1.011× (1 × 256), 1.030× and 1.066× (paired steps in one
/// process; `docs/benchmarks.md`, sessions 30, 44, 45, 53 and 64).
pub fn path(isa: crate::isa::Isa, group: usize) -> DecodeKernel {
    use crate::isa::Isa;
    match isa {
        Isa::Portable => DecodeKernel::Portable,
        Isa::Avx2 => DecodeKernel::Avx2,
        Isa::Avx512Bf16 if group >= PAIRS_FROM_GROUP => DecodeKernel::Avx512Bf16Pairs,
        Isa::Avx512Bf16 => DecodeKernel::Avx512Bf16,
        Isa::AmxBf16 => DecodeKernel::Avx512Bf16Heads,
    }
}

/// The kernel [`decode_attention_heads_bf16`] runs on a thread of path `isa` with no kernel
/// chosen ([`with_decode_kernel`], [`set_process_decode_kernel`]), for a query group of
/// `group` and heads of `head_dim`: [`path`]'s where the vector kernels take the shape (all
/// take the same: a group of 1–8, a head dimension a multiple of 32 up to 256), else the
/// portable loops. What a report names, and the kernel whose instruction a bound is held to.
pub fn kernel_for(isa: crate::isa::Isa, group: usize, head_dim: usize) -> DecodeKernel {
    #[cfg(target_arch = "x86_64")]
    if avx2::supports(group, head_dim) {
        return path(isa, group);
    }
    let _ = (isa, group, head_dim);
    DecodeKernel::Portable
}

/// The smallest query group [`path`] gives the token-pair kernel on the AVX-512 BF16 path.
const PAIRS_FROM_GROUP: usize = 5;

/// The [`set_process_decode_kernel`] choice: 0 for none, else its index in
/// `DecodeKernel::ALL` plus one.
static PROCESS_KERNEL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

thread_local! {
    /// The [`with_decode_kernel`] choice of this thread.
    static THREAD_KERNEL: std::cell::Cell<Option<DecodeKernel>> = const { std::cell::Cell::new(None) };
}

/// Makes [`decode_attention_heads_bf16`] run `kernel` on every thread whose path allows it
/// (`kernel.isa()` at or below the thread's path; other threads keep [`path`]'s), leaving every
/// other kernel's path alone, so a benchmark can compare decode attention kernels step by step
/// in one process with the GEMM unchanged; `None` goes back to [`path`]'s. A call in flight
/// finishes on the kernel it started on. Returns `false` (and changes nothing) when this CPU
/// cannot run `kernel`.
pub fn set_process_decode_kernel(kernel: Option<DecodeKernel>) -> bool {
    let v = match kernel {
        Some(k) if !k.is_supported() => return false,
        Some(k) => DecodeKernel::ALL
            .iter()
            .position(|&a| a == k)
            .map_or(0, |p| p as u8 + 1),
        None => 0,
    };
    PROCESS_KERNEL.store(v, std::sync::atomic::Ordering::Relaxed);
    true
}

/// Runs `f` with [`decode_attention_heads_bf16`] taking `kernel` on this thread (ahead of the
/// [`set_process_decode_kernel`] choice), then restores the thread's previous choice, also
/// when `f` panics. `None` (and `f` not run) when this thread's path is below the kernel's
/// (`kernel.isa()` above [`crate::isa::Isa::current`]: a CPU without it, or a path capped by
/// `SIMPLER_ISA` or [`crate::with_isa`]), so `Some` means `kernel` ran. What tests use to cover
/// every kernel without touching other threads.
pub fn with_decode_kernel<R>(kernel: DecodeKernel, f: impl FnOnce() -> R) -> Option<R> {
    struct Restore(Option<DecodeKernel>);
    impl Drop for Restore {
        fn drop(&mut self) {
            THREAD_KERNEL.with(|c| c.set(self.0));
        }
    }
    if kernel.isa() > crate::isa::Isa::current() {
        return None;
    }
    let _restore = Restore(THREAD_KERNEL.with(|c| c.replace(Some(kernel))));
    Some(f())
}

/// The kernel [`decode_attention_heads_bf16`] runs now for a query group of `group`: this
/// thread's [`with_decode_kernel`] choice, else the process's [`set_process_decode_kernel`]
/// choice, where the thread's path allows it; else [`path`] of the thread's path. Its
/// instruction set is never above the thread's path ([`crate::isa::Isa::current`]), so never
/// above the CPU's.
fn decode_kernel(group: usize) -> DecodeKernel {
    let cur = crate::isa::Isa::current();
    let process = match PROCESS_KERNEL.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        i => Some(DecodeKernel::ALL[usize::from(i) - 1]),
    };
    match THREAD_KERNEL.with(|c| c.get()).or(process) {
        Some(k) if k.isa() <= cur => k,
        _ => path(cur, group),
    }
}

/// The path of the attention kernels that have AVX2 and portable code only (single-head
/// decode, prefill rows without tiles): every wider path runs the AVX2 code.
pub fn vector_path(isa: crate::isa::Isa) -> crate::isa::Isa {
    isa.min(crate::isa::Isa::Avx2)
}

/// The path [`prefill_attention_rows_f32`] takes for `head_dim` when kernels run on `isa`.
/// Causal prefill attention is two matrix products per query block, compute-bound: where
/// `head_dim` is a multiple of 32 up to 256 it runs them on bf16 pairs, on AMX-BF16 tiles
/// where the CPU has them, else on AVX-512 BF16 vectors; other head dimensions and CPUs
/// take the AVX2 (or portable) path.
pub fn prefill_path(isa: crate::isa::Isa, head_dim: usize) -> crate::isa::Isa {
    #[cfg(target_arch = "x86_64")]
    if isa >= crate::isa::Isa::Avx512Bf16 && flash::supports(head_dim) {
        return isa.min(crate::isa::Isa::AmxBf16);
    }
    let _ = head_dim;
    vector_path(isa)
}

/// One layer's paged K and V pools.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    /// K pool `[slots, kv_heads * head_dim]`.
    pub k: &'a [bf16],
    /// V pool, same shape.
    pub v: &'a [bf16],
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Tokens per page (128 in the reference layout).
    pub page_size: usize,
}

impl PagedKv<'_> {
    /// Row width (`kv_heads * head_dim`).
    pub fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn check(&self) {
        assert!(
            self.head_dim > 0 && self.page_size > 0 && self.kv_heads > 0,
            "paged kv: zero dimension"
        );
        // `row()` is then exact: the kernels index rows by `kv_heads · head_dim`.
        assert!(
            self.kv_heads.checked_mul(self.head_dim).is_some(),
            "paged kv: {} heads of {} overflow a row",
            self.kv_heads,
            self.head_dim
        );
        assert_eq!(
            self.k.len(),
            self.v.len(),
            "paged kv: K and V pools differ in size"
        );
        assert_eq!(
            self.k.len() % self.row(),
            0,
            "paged kv: pool not a whole number of rows"
        );
    }

    /// Panics unless every page holding a token of `tokens` is named by `block_table` and lies
    /// inside the pool.
    fn check_pages(&self, block_table: &[u32], tokens: &Range<usize>) {
        let slots = self.k.len() / self.row();
        if let Err(e) =
            crate::paging::check_table(block_table, self.page_size, tokens.clone(), slots)
        {
            panic!("attention: {e}");
        }
    }

    /// The pool row of logical token `t` of a sequence with `block_table`.
    fn slot(&self, block_table: &[u32], t: usize) -> usize {
        crate::paging::slot(block_table, self.page_size, t)
    }
}

/// Floats in one decode partial: `group * (head_dim + 2)`.
pub const fn partial_len(group: usize, head_dim: usize) -> usize {
    group * (head_dim + 2)
}

/// One split-KV decode step for sequence row `q` (`num_heads * head_dim` bf16), KV head
/// `kv_head` and logical tokens `tokens` (a chunk of `0..seq_len`): writes the partial of every
/// query head of the group into `partial` (see the module docs). An empty chunk writes
/// `m = -inf, l = 0, o = 0`.
///
/// # Panics
/// If a token's page is outside `block_table` or the pool, `kv_head * group` heads do not fit
/// in `q`, or `partial.len() != partial_len(group, head_dim)`.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_partial_bf16(
    q: &[bf16],
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    kv_head: usize,
    tokens: Range<usize>,
    scale: f32,
    partial: &mut [f32],
) {
    kv.check();
    let hd = kv.head_dim;
    assert!(
        kv_head < kv.kv_heads,
        "decode attention: kv head {kv_head} of {}",
        kv.kv_heads
    );
    assert!(
        (kv_head + 1) * group * hd <= q.len(),
        "decode attention: q too short for the group"
    );
    assert_eq!(
        partial.len(),
        partial_len(group, hd),
        "decode attention: partial len"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::current() >= crate::isa::Isa::Avx2 && avx2::supports(group, hd) {
        kv.check_pages(block_table, &tokens);
        // SAFETY: Avx2 or a wider path is current only when the CPU has AVX2 and FMA; the shape is supported;
        // `kv` and `kv_head` were checked above, every page of `tokens` by `check_pages`, and
        // the partial's length by the assert.
        unsafe {
            avx2::decode_partial(
                &q[kv_head * group * hd..(kv_head + 1) * group * hd],
                group,
                kv,
                block_table,
                kv_head,
                tokens,
                scale,
                partial,
            )
        };
        return;
    }
    let qg: Vec<f32> = q[kv_head * group * hd..(kv_head + 1) * group * hd]
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let mut m = vec![f32::NEG_INFINITY; group];
    let mut l = vec![0.0f32; group];
    let mut o = vec![0.0f32; group * hd];
    let limits = vec![usize::MAX; group];
    core::attend(
        &qg,
        group,
        kv,
        block_table,
        kv_head,
        tokens,
        &limits,
        scale,
        &mut m,
        &mut l,
        &mut o,
    );
    for j in 0..group {
        let rec = &mut partial[j * (hd + 2)..(j + 1) * (hd + 2)];
        rec[0] = m[j];
        rec[1] = l[j];
        rec[2..].copy_from_slice(&o[j * hd..(j + 1) * hd]);
    }
}

/// [`decode_attention_partial_bf16`] for every KV head of sequence row `q`
/// (`kv_heads * group * head_dim` bf16) over the same `tokens`: `partials` gets one record set
/// per head, in head order (`kv_heads * partial_len(group, head_dim)` floats), by the
/// [`DecodeKernel`] `decode_kernel` picks ([`path`] of the thread's path unless a test or
/// bench chose another). The AVX-512 BF16 kernels take the bf16 query and key pairs as they
/// are (`vdpbf16ps`); every vector kernel reads each pool row once for all heads (rows are
/// contiguous, heads are not).
///
/// # Panics
/// As [`decode_attention_partial_bf16`], and if `q` or `partials` do not cover every head.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_heads_bf16(
    q: &[bf16],
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    tokens: Range<usize>,
    scale: f32,
    partials: &mut [f32],
) {
    kv.check();
    let hd = kv.head_dim;
    assert_eq!(
        q.len(),
        kv.kv_heads * group * hd,
        "decode attention: q is not one full row"
    );
    let rec = partial_len(group, hd);
    assert_eq!(
        partials.len(),
        kv.kv_heads * rec,
        "decode attention: partials len"
    );
    let k = decode_kernel(group);
    #[cfg(target_arch = "x86_64")]
    {
        type HeadsKernel = unsafe fn(
            &[bf16],
            usize,
            &PagedKv<'_>,
            &[u32],
            Range<usize>,
            f32,
            &mut [f32],
            &mut [f32],
        );
        // `decode_kernel` never names a kernel above the thread's path, so an AVX-512 BF16
        // kernel only where the CPU has AVX-512 F/BW/VL and BF16 (and AVX2, FMA), the AVX2
        // one only where it has AVX2 and FMA. Shapes a kernel lacks fall to the next one.
        let rows = avx2::supports(group, hd);
        let chosen: Option<(HeadsKernel, usize)> = match k {
            DecodeKernel::Avx512Bf16Pairs if pairs::supports(group, hd) => Some((
                pairs::decode_partials_heads,
                pairs::heads_state_len(kv.kv_heads, group, hd),
            )),
            DecodeKernel::Avx512Bf16Heads if avx512::supports(group, hd) => Some((
                avx512::decode_partials_heads,
                avx512::heads_state_len(kv.kv_heads, group, hd),
            )),
            DecodeKernel::Avx512Bf16
            | DecodeKernel::Avx512Bf16Heads
            | DecodeKernel::Avx512Bf16Pairs
                if rows =>
            {
                Some((
                    avx2::decode_partials_heads::<true>,
                    avx2::heads_state_len(kv.kv_heads, group, hd),
                ))
            }
            DecodeKernel::Avx2 if rows => Some((
                avx2::decode_partials_heads::<false>,
                avx2::heads_state_len(kv.kv_heads, group, hd),
            )),
            _ => None,
        };
        if let Some((kernel, state_len)) = chosen {
            kv.check_pages(block_table, &tokens);
            HEADS_STATE.with(|cell| {
                let mut state = cell.borrow_mut();
                state.resize(state_len, 0.0);
                // SAFETY: the kernel's instruction set is present (see `chosen`) and it
                // supports the shape; `kv` was checked, every page of `tokens` by
                // `check_pages`, `q` and `partials` by the asserts; `state` has the length
                // that kernel needs.
                unsafe {
                    kernel(
                        q,
                        group,
                        kv,
                        block_table,
                        tokens,
                        scale,
                        partials,
                        &mut state,
                    )
                };
            });
            return;
        }
    }
    let mut per_head = || {
        for (g, p) in partials.chunks_exact_mut(rec).enumerate() {
            decode_attention_partial_bf16(q, group, kv, block_table, g, tokens.clone(), scale, p);
        }
    };
    if k == DecodeKernel::Portable {
        // The portable kernel is the per-head loops on the portable path, whatever the
        // thread's path (a chosen kernel on a vector thread runs the same bits).
        crate::isa::with_isa(crate::isa::Isa::Portable, per_head).expect("portable runs anywhere");
    } else {
        per_head();
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Per-thread state of [`decode_attention_heads_bf16`] (queries, outputs, max and sum of
    /// every head), reused across calls.
    static HEADS_STATE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

multiversion! {
    /// Merges the decode partials of one `(sequence, kv_head)` (`partials`: `n_chunks`
    /// records of [`partial_len`]`(group, head_dim)`) into `out = bf16(softmax · V)` for the
    /// group's query heads (`group * head_dim`, the row's columns
    /// `kv_head * group * head_dim ..`).
    ///
    /// # Panics
    /// If `partials` is not a whole number of records or `out.len() != group * head_dim`.
    pub fn decode_attention_combine_bf16(partials: &[f32], group: usize, head_dim: usize, out: &mut [bf16]) {
        let rec = partial_len(group, head_dim);
        assert!(rec > 0 && partials.len().is_multiple_of(rec), "combine: partials len");
        assert_eq!(out.len(), group * head_dim, "combine: out len");
        let chunks = partials.len() / rec;
        let mut acc = vec![0.0f32; head_dim];
        for j in 0..group {
            let at = |c: usize| &partials[c * rec + j * (head_dim + 2)..c * rec + (j + 1) * (head_dim + 2)];
            let m = (0..chunks).map(|c| at(c)[0]).fold(f32::NEG_INFINITY, f32::max);
            acc.fill(0.0);
            let mut l = 0.0f32;
            for c in 0..chunks {
                let p = at(c);
                if p[1] == 0.0 {
                    continue;
                }
                let w = (p[0] - m).exp();
                l += p[1] * w;
                for (a, &v) in acc.iter_mut().zip(&p[2..]) {
                    *a += v * w;
                }
            }
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            for (o, &a) in out[j * head_dim..(j + 1) * head_dim].iter_mut().zip(&acc) {
                *o = f32_to_bf16(a * inv);
            }
        }
    }
}

/// Whole decode attention of one `(sequence, kv_head)` in one call (`seq_len` tokens split into
/// `n_chunks` partials, then combined): `out` gets the group's `group * head_dim` outputs.
/// A convenience over [`decode_attention_partial_bf16`] and
/// [`decode_attention_combine_bf16`].
///
/// # Panics
/// As those two.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_bf16(
    q: &[bf16],
    group: usize,
    kv: &PagedKv<'_>,
    block_table: &[u32],
    kv_head: usize,
    seq_len: usize,
    n_chunks: usize,
    scale: f32,
    out: &mut [bf16],
) {
    let rec = partial_len(group, kv.head_dim);
    let n_chunks = n_chunks.max(1);
    let mut partials = vec![0.0f32; n_chunks * rec];
    for (c, p) in partials.chunks_exact_mut(rec).enumerate() {
        let r = split_range(seq_len, n_chunks, c);
        decode_attention_partial_bf16(q, group, kv, block_table, kv_head, r, scale, p);
    }
    decode_attention_combine_bf16(&partials, group, kv.head_dim, out);
}

/// Chunk `c` of `0..n` split into `parts` nearly equal ranges (the first `n % parts` one
/// longer). Useful to pick KV chunks.
pub fn split_range(n: usize, parts: usize, c: usize) -> Range<usize> {
    let parts = parts.max(1);
    let base = n / parts;
    let extra = n % parts;
    let start = c * base + c.min(extra);
    start..start + base + usize::from(c < extra)
}
