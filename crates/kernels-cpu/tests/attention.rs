//! Paged attention (split-KV decode with combine, chunked causal prefill) against an fp64
//! softmax reference over the gathered sequence, at the spec's attention tolerance.

mod common;

use common::{Rng, both, to_f32};
use half::bf16;
use proptest::prelude::*;
use simpler_kernels_cpu::*;

struct Setup {
    kv_heads: usize,
    hd: usize,
    ps: usize,
    k: Vec<bf16>,
    v: Vec<bf16>,
    /// One row per sequence, `max_blocks` entries each.
    tables: Vec<Vec<u32>>,
}

impl Setup {
    fn new(
        seqs: usize,
        max_blocks: usize,
        kv_heads: usize,
        hd: usize,
        ps: usize,
        rng: &mut Rng,
    ) -> Setup {
        let pages = seqs * max_blocks;
        let row = kv_heads * hd;
        let k = rng.vec_bf16(pages * ps * row, 1.0);
        let v: Vec<bf16> = (0..pages * ps * row)
            .map(|_| bf16::from_f32(0.3 + 0.5 * rng.uniform()))
            .collect();
        // A shuffled page assignment, so logical blocks are not contiguous.
        let mut perm: Vec<u32> = (0..pages as u32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        let tables = perm.chunks(max_blocks).map(|c| c.to_vec()).collect();
        Setup {
            kv_heads,
            hd,
            ps,
            k,
            v,
            tables,
        }
    }

    fn kv(&self) -> PagedKv<'_> {
        PagedKv {
            k: &self.k,
            v: &self.v,
            kv_heads: self.kv_heads,
            head_dim: self.hd,
            page_size: self.ps,
        }
    }

    /// Prefill rows of sequence `s` (queries `q`, row 0 at position `first_pos`) against KV head
    /// `kv_head`, at the scale `1 / sqrt(head_dim)`.
    fn prefill_rows<'a>(
        &'a self,
        s: usize,
        q: &'a [f32],
        group: usize,
        kv_head: usize,
        first_pos: usize,
    ) -> PrefillRows<'a> {
        PrefillRows {
            queries: PrefillQueries::F32(q),
            group,
            kv: self.kv(),
            block_table: &self.tables[s],
            kv_head,
            first_pos,
            scale: 1.0 / (self.hd as f32).sqrt(),
        }
    }

    /// fp64 softmax attention of query `q` (one head, fp32) over tokens `0..len` of sequence `s`.
    fn reference(&self, s: usize, kv_head: usize, q: &[f32], len: usize, scale: f32) -> Vec<f32> {
        self.range_reference(s, kv_head, q, 0..len, scale)
    }

    /// [`Setup::reference`] over tokens `range` of sequence `s`.
    fn range_reference(
        &self,
        s: usize,
        kv_head: usize,
        q: &[f32],
        range: std::ops::Range<usize>,
        scale: f32,
    ) -> Vec<f32> {
        let row = self.kv_heads * self.hd;
        let slot = |t: usize| self.tables[s][t / self.ps] as usize * self.ps + t % self.ps;
        let at = |pool: &[bf16], t: usize, d: usize| {
            f64::from(pool[slot(t) * row + kv_head * self.hd + d].to_f32())
        };
        let scores: Vec<f64> = range
            .clone()
            .map(|t| {
                (0..self.hd)
                    .map(|d| f64::from(q[d]) * at(&self.k, t, d))
                    .sum::<f64>()
                    * f64::from(scale)
            })
            .collect();
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let l: f64 = p.iter().sum();
        (0..self.hd)
            .map(|d| {
                (range
                    .clone()
                    .zip(&p)
                    .map(|(t, w)| w * at(&self.v, t, d))
                    .sum::<f64>()
                    / l) as f32
            })
            .collect()
    }
}

/// The widened queries of rows built with them.
fn f32_queries<'a>(rows: &PrefillRows<'a>) -> &'a [f32] {
    match rows.queries {
        PrefillQueries::F32(q) => q,
        PrefillQueries::Bf16 { .. } => panic!("rows of bf16 queries"),
    }
}

/// `prefill_attention_rows_f32` of `rows` on every path this CPU has (see
/// `common::all_paths`).
fn prefill_on_every_path(what: &str, rows: &PrefillRows<'_>) -> Vec<(Isa, Vec<f32>)> {
    common::all_paths(what, || {
        // NaN: an output a path leaves unwritten fails the comparisons (callers hand it
        // scratch that holds an earlier task's values).
        let mut out = vec![f32::NAN; f32_queries(rows).len()];
        prefill_attention_rows_f32(rows, &mut out);
        out
    })
}

/// [`prefill_on_every_path`] for `rows` of sequence `seq` of `st`, each path's outputs checked
/// against the portable path's and, for every query of the rows `check_rows`, against the
/// fp64 reference.
fn prefill_agrees_on_every_path(
    what: &str,
    st: &Setup,
    seq: usize,
    rows: &PrefillRows<'_>,
    check_rows: impl Iterator<Item = usize> + Clone,
) {
    let (hd, group) = (st.hd, rows.group);
    let ran = prefill_on_every_path(what, rows);
    for (isa, out) in &ran {
        let path = attention::prefill_path(*isa, hd);
        let on = format!("{what} on {} (prefill path {})", isa.name(), path.name());
        common::assert_close(out, &ran[0].1, 5e-3, 2e-2, &format!("{on} vs portable"));
        for i in check_rows.clone() {
            for j in 0..group {
                let at = (i * group + j) * hd;
                let q = &f32_queries(rows)[at..at + hd];
                let e = st.reference(seq, rows.kv_head, q, rows.first_pos + i + 1, rows.scale);
                let ctx = format!("{on} vs reference, row {i} query {j}");
                common::assert_close(&out[at..at + hd], &e, 5e-3, 2e-2, &ctx);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn split_kv_decode_matches_softmax_reference(
        seqs in 1usize..4, kv_heads in 1usize..3, group in 1usize..6, hd16 in 1usize..5,
        small_pages in any::<bool>(), n_chunks in 1usize..6, seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let hd = hd16 * 16 + if seed % 3 == 0 { 8 } else { 0 };
        let ps = if small_pages { 16 } else { 128 };
        let max_blocks = 3;
        let st = Setup::new(seqs, max_blocks, kv_heads, hd, ps, &mut rng);
        let width = kv_heads * group * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        for s in 0..seqs {
            // Ragged lengths, often crossing page boundaries.
            let len = 1 + rng.below(max_blocks * ps);
            let q = rng.vec_bf16(width, 1.0);
            let (p, a) = both(|| {
                let mut out = vec![bf16::ZERO; width];
                for g in 0..kv_heads {
                    decode_attention_bf16(&q, group, &st.kv(), &st.tables[s], g, len, n_chunks, scale,
                        &mut out[g * group * hd..(g + 1) * group * hd]);
                }
                to_f32(&out)
            });
            if let Some(a) = &a {
                common::assert_close(a, &p, 5e-3, 2e-2, "avx2 vs portable");
            }
            for h in 0..kv_heads * group {
                let qh = to_f32(&q[h * hd..(h + 1) * hd]);
                let e = st.reference(s, h / group, &qh, len, scale);
                common::assert_close(&p[h * hd..(h + 1) * hd], &e, 5e-3, 2e-2, "decode vs reference");
            }
        }
    }

    #[test]
    fn chunked_prefill_matches_causal_reference(
        kv_heads in 1usize..3, group in 1usize..4, prefix in 0usize..40, chunk in 1usize..40,
        row_split in 0.0f64..1.0, seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let (hd, ps) = (32, 16);
        let st = Setup::new(2, 6, kv_heads, hd, ps, &mut rng);
        let width = kv_heads * group * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        // Sequence 1 sits after 3 tokens of another sequence in the packed tensors.
        let seq = PrefillSeq { seq_len: prefix + chunk, chunk_len: chunk, token_offset: 3 };
        let t_total = 3 + chunk;
        let q = rng.vec_bf16(t_total * width, 1.0);
        let cut = (chunk as f64 * row_split) as usize;
        let (p, a) = both(|| {
            let mut out = vec![bf16::ZERO; t_total * width];
            for g in 0..kv_heads {
                // Two calls over disjoint row ranges, as two tasks would.
                prefill_attention_bf16(&q, group, &st.kv(), &st.tables[1], g, seq, 0..cut, scale, &mut out);
                prefill_attention_bf16(&q, group, &st.kv(), &st.tables[1], g, seq, cut..chunk, scale, &mut out);
            }
            to_f32(&out)
        });
        if let Some(a) = &a {
            common::assert_close(a, &p, 5e-3, 2e-2, "avx2 vs portable");
        }
        prop_assert!(p[..3 * width].iter().all(|&v| v == 0.0), "rows of the other sequence were written");
        for i in 0..chunk {
            for h in 0..kv_heads * group {
                let base = (3 + i) * width + h * hd;
                let qh = to_f32(&q[base..base + hd]);
                let e = st.reference(1, h / group, &qh, prefix + i + 1, scale);
                common::assert_close(&p[base..base + hd], &e, 5e-3, 2e-2, "prefill vs reference");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Every path of the causal prefill rows (the AMX-BF16 tiles where the CPU has them)
    /// against the portable one and the fp64 reference, at shapes that straddle the AMX path's
    /// edges: query counts around its 16-query blocks, prefixes ending inside and at the edges
    /// of its 32-token blocks, pages smaller and larger than a block, head dimensions of one to
    /// eight 32-element steps (and 80, which the tiles do not take), groups up to 8.
    #[test]
    fn prefill_rows_agree_on_every_path(
        kv_heads in 1usize..3, group in 1usize..9, first_pos in 0usize..140, n_rows in 1usize..40,
        hd_pick in 0usize..7, small_pages in any::<bool>(), seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let hd = [32, 64, 96, 128, 128, 256, 80][hd_pick];
        let ps = if small_pages { 16 } else { 128 };
        let blocks = (first_pos + n_rows).div_ceil(ps);
        let st = Setup::new(2, blocks, kv_heads, hd, ps, &mut rng);
        let q: Vec<f32> = rng.vec_bf16(n_rows * group * hd, 1.0).iter().map(|v| v.to_f32()).collect();
        let rows = st.prefill_rows(1, &q, group, kv_heads - 1, first_pos);
        prefill_agrees_on_every_path("prefill rows", &st, 1, &rows, 0..n_rows);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Calls of several query blocks (the AVX2 kernel widens each run of tokens once for every
    /// block that sees it, so blocks end on different tokens of a shared run) at ragged query
    /// counts, prefixes and head dimensions, on every path against the portable one and the
    /// fp64 reference.
    #[test]
    fn prefill_rows_of_many_blocks_agree_on_every_path(
        group in 1usize..5, first_pos in 0usize..200, n_rows in 40usize..150,
        hd_pick in 0usize..3, seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let hd = [32, 128, 96][hd_pick];
        let ps = 16;
        let blocks = (first_pos + n_rows).div_ceil(ps);
        let st = Setup::new(1, blocks, 2, hd, ps, &mut rng);
        let q: Vec<f32> = rng.vec_bf16(n_rows * group * hd, 2.0).iter().map(|v| v.to_f32()).collect();
        let rows = st.prefill_rows(0, &q, group, 1, first_pos);
        let check = [0, n_rows / 3, n_rows / 2 + 1, n_rows - 1];
        prefill_agrees_on_every_path("prefill rows, many blocks", &st, 0, &rows, check.into_iter());
    }
}

/// A long prefix (several 128-token pages, a score range wide enough that the running max
/// moves block after block) on every path against the portable one, the shape Qwen3-0.6B
/// prefill runs (group 2, head 128, 32 rows per call).
#[test]
fn prefill_rows_long_prefix_on_every_path() {
    let mut rng = Rng(5);
    let (kv_heads, group, hd, ps) = (2, 2, 128, 128);
    let (first_pos, n_rows) = (457, 32);
    let st = Setup::new(1, 4, kv_heads, hd, ps, &mut rng);
    // Large queries: sharp, position-dependent softmax.
    let q: Vec<f32> = rng
        .vec_bf16(n_rows * group * hd, 4.0)
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let rows = st.prefill_rows(0, &q, group, 1, first_pos);
    let check = [0, 15, 16, 31].into_iter();
    prefill_agrees_on_every_path("prefill rows, long prefix", &st, 0, &rows, check);
}

#[test]
fn prefill_path_takes_bf16_pairs_only_where_they_fit() {
    assert_eq!(attention::prefill_path(Isa::Avx2, 128), Isa::Avx2);
    assert_eq!(attention::prefill_path(Isa::Portable, 128), Isa::Portable);
    if cfg!(target_arch = "x86_64") {
        assert_eq!(attention::prefill_path(Isa::AmxBf16, 128), Isa::AmxBf16);
        assert_eq!(attention::prefill_path(Isa::AmxBf16, 256), Isa::AmxBf16);
        assert_eq!(
            attention::prefill_path(Isa::Avx512Bf16, 128),
            Isa::Avx512Bf16
        );
        assert_eq!(
            attention::prefill_path(Isa::Avx512Bf16, 32),
            Isa::Avx512Bf16
        );
    }
    for isa in [Isa::AmxBf16, Isa::Avx512Bf16] {
        assert_eq!(attention::prefill_path(isa, 80), Isa::Avx2);
        assert_eq!(attention::prefill_path(isa, 288), Isa::Avx2);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn all_heads_partials_equal_per_head_partials(
        kv_heads in 1usize..4, group in 1usize..9, hd32 in 1usize..5, small_pages in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let hd = hd32 * 32;
        let ps = if small_pages { 16 } else { 128 };
        let st = Setup::new(1, 3, kv_heads, hd, ps, &mut rng);
        let q = rng.vec_bf16(kv_heads * group * hd, 1.0);
        let len = 3 * ps;
        let (t0, t1) = (rng.below(len), rng.below(len));
        let tokens = t0.min(t1)..t0.max(t1) + 1;
        let rec = partial_len(group, hd);
        let ran = all_decode_kernels("decode attention, all heads", || {
            let mut all = vec![0.0f32; kv_heads * rec];
            decode_attention_heads_bf16(&q, group, &st.kv(), &st.tables[0], tokens.clone(), 0.1, &mut all);
            all
        });
        let mut per_head = vec![0.0f32; kv_heads * rec];
        with_isa(Isa::Portable, || {
            for (g, part) in per_head.chunks_exact_mut(rec).enumerate() {
                decode_attention_partial_bf16(&q, group, &st.kv(), &st.tables[0], g, tokens.clone(), 0.1, part);
            }
        });
        for (kernel, out) in &ran {
            if *kernel == "portable" {
                common::assert_close(out, &per_head, 1e-4, 1e-5, "portable all heads vs per head");
                continue;
            }
            // Compare normalised outputs (the running max may differ by rounding).
            for (x, y) in out.chunks_exact(hd + 2).zip(per_head.chunks_exact(hd + 2)) {
                let ox: Vec<f32> = x[2..].iter().map(|v| v / x[1]).collect();
                let oy: Vec<f32> = y[2..].iter().map(|v| v / y[1]).collect();
                common::assert_close(&ox, &oy, 5e-3, 1e-3, kernel);
            }
        }
    }
}

#[test]
fn combine_of_partials_equals_one_chunk() {
    let mut rng = Rng(11);
    let st = Setup::new(1, 4, 2, 128, 128, &mut rng);
    let q = rng.vec_bf16(2 * 5 * 128, 1.0);
    let len = 3 * 128 + 77;
    let mut one = vec![bf16::ZERO; 5 * 128];
    let mut many = vec![bf16::ZERO; 5 * 128];
    decode_attention_bf16(&q, 5, &st.kv(), &st.tables[0], 1, len, 1, 0.088, &mut one);
    // More chunks than tokens in some: empty partials must be ignored.
    decode_attention_bf16(&q, 5, &st.kv(), &st.tables[0], 1, len, 7, 0.088, &mut many);
    common::assert_close(&to_f32(&many), &to_f32(&one), 8e-3, 1e-3, "7 chunks vs 1");
    let mut empty = vec![1.0f32; partial_len(5, 128)];
    decode_attention_partial_bf16(&q, 5, &st.kv(), &st.tables[0], 1, 10..10, 0.088, &mut empty);
    assert!(
        empty
            .chunks(130)
            .all(|r| r[0] == f32::NEG_INFINITY && r[1..].iter().all(|&v| v == 0.0))
    );
}

/// Runs `f` with every decode attention kernel this CPU has (`attention::with_decode_kernel`,
/// the portable one first), printing the kernels run and skipped so a test log says what it
/// covered: each path's own kernels, and all three AVX-512 BF16 ones (token-major, head-major,
/// token-pair) on any CPU with that path.
fn all_decode_kernels<R>(what: &str, f: impl Fn() -> R) -> Vec<(&'static str, R)> {
    let mut ran = Vec::new();
    let mut skipped = Vec::new();
    for k in attention::DecodeKernel::ALL {
        // On the kernel's own path, so a process capped by `SIMPLER_ISA` still runs it.
        match with_isa(k.isa(), || attention::with_decode_kernel(k, &f)).flatten() {
            Some(r) => ran.push((k.name(), r)),
            None => skipped.push(k.name()),
        }
    }
    println!(
        "{what}: ran {:?}; skipped (not on this CPU) {skipped:?}",
        ran.iter().map(|(k, _)| *k).collect::<Vec<_>>()
    );
    ran
}

/// Classifies a value for the path comparison: the same class and, when finite, close.
fn same_class(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan())
        || (a.is_infinite() && a == b)
        || (a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-2 * (1.0 + a.abs()))
}

/// Every path's outputs in `ran` (the portable path's first) against the portable path's,
/// element by element, with [`same_class`] (a key was set to `poison`).
fn assert_same_classes_as_portable<P: std::fmt::Debug>(ran: &[(P, Vec<f32>)], poison: f32) {
    let (_, p) = &ran[0];
    for (path, out) in &ran[1..] {
        for (i, (&x, &y)) in p.iter().zip(out).enumerate() {
            assert!(
                same_class(x, y),
                "key {poison}, element {i}: portable {x} vs {path:?} {y}"
            );
        }
    }
}

/// Non-finite keys make non-finite scores: an infinite or NaN score poisons the softmax, a
/// score of minus infinity only drops its token. Both paths must agree on which, element by
/// element.
#[test]
fn non_finite_scores_behave_the_same_on_both_paths() {
    let mut rng = Rng(31);
    let (hd, ps, group) = (64usize, 16usize, 2usize);
    // q > 0 everywhere, so a key of +inf gives a score of +inf and -inf gives -inf; NaN gives
    // NaN.
    let q: Vec<bf16> = (0..group * hd)
        .map(|_| bf16::from_f32(0.1 + 0.5 * rng.uniform().abs()))
        .collect();
    for (poison, finite_out) in [
        (f32::NEG_INFINITY, true),
        (f32::INFINITY, false),
        (f32::NAN, false),
    ] {
        let mut s = Setup::new(1, 4, 1, hd, ps, &mut rng);
        let slot = |t: usize| s.tables[0][t / ps] as usize * ps + t % ps;
        // Token 9's key: one dimension poisoned.
        let at = slot(9) * hd + 5;
        s.k[at] = bf16::from_f32(poison);
        let len = 40;
        let (p, a) = both(|| {
            let mut out = vec![bf16::ZERO; group * hd];
            decode_attention_bf16(&q, group, &s.kv(), &s.tables[0], 0, len, 3, 0.125, &mut out);
            to_f32(&out)
        });
        assert_eq!(
            p.iter().all(|v| v.is_finite()),
            finite_out,
            "portable, key {poison}: {:?}",
            &p[..4]
        );
        if finite_out {
            // Minus infinity drops the token: the result is attention over the other 39.
            let qf = to_f32(&q[..hd]);
            let mut s2 = Setup {
                k: s.k.clone(),
                ..Setup::new(1, 4, 1, hd, ps, &mut Rng(0))
            };
            s2.v.clone_from(&s.v);
            s2.tables.clone_from(&s.tables);
            s2.k[at] = bf16::from_f32(-1e30);
            let want = s2.reference(0, 0, &qf, len, 0.125);
            for (d, (&g, &w)) in p[..hd].iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 2e-2 + 5e-3 * w.abs(), "d {d}: {g} vs {w}");
            }
        }
        if let Some(a) = a {
            for (i, (&x, &y)) in p.iter().zip(&a).enumerate() {
                assert!(
                    same_class(x, y),
                    "key {poison}, element {i}: portable {x} vs avx2 {y}"
                );
            }
        }
    }
}

/// Every path of the all-heads decode attention against the fp64 softmax reference over a
/// token range (normalised partials), at ragged shapes: every group the kernels take, head
/// dimensions from one 32-element block to 256, pages smaller and larger than a run, ranges
/// starting and ending mid-page, a single token, odd lengths.
#[test]
fn all_heads_decode_matches_the_reference_on_every_path() {
    let mut rng = Rng(2024);
    for (group, hd, ps, kv_heads) in [
        (1, 32, 16, 3),
        (2, 128, 128, 8),
        (2, 96, 16, 2),
        (3, 64, 128, 2),
        (4, 160, 16, 1),
        (5, 128, 128, 2),
        (6, 32, 128, 1),
        (7, 256, 16, 1),
        (8, 64, 128, 2),
    ] {
        let st = Setup::new(1, 4, kv_heads, hd, ps, &mut rng);
        let q = rng.vec_bf16(kv_heads * group * hd, 1.0);
        let scale = 1.0 / (hd as f32).sqrt();
        let n = 4 * ps;
        // Groups 1–4 read a range as four or two parts side by side: 1..4 (some parts
        // empty) and the odd range whose parts cross pages at different rows cover the
        // parts' uneven ends.
        for tokens in [
            0..n,
            3..n - 5,
            ps - 1..ps + 1,
            7..8,
            ps + 2..3 * ps + 9,
            1..4,
            ps / 2 + 1..4 * ps - 2,
        ] {
            let what = format!("group {group} hd {hd} page {ps}");
            all_kernels_match_the_reference(&st, &q, group, tokens, scale, &what);
        }
    }
}

/// Every decode attention kernel's all-heads partials of `q` over `tokens` (normalised)
/// against the fp64 softmax reference (`5e-3` relative, `2e-2` absolute); an empty range must
/// give the empty record `[-inf, 0, 0, ..]`. `what` names the case in a failure.
fn all_kernels_match_the_reference(
    st: &Setup,
    q: &[bf16],
    group: usize,
    tokens: std::ops::Range<usize>,
    scale: f32,
    what: &str,
) {
    let (hd, kv_heads) = (st.hd, st.kv_heads);
    let rec = partial_len(group, hd);
    let ran = all_decode_kernels("decode attention vs reference", || {
        let mut all = vec![0.0f32; kv_heads * rec];
        decode_attention_heads_bf16(
            q,
            group,
            &st.kv(),
            &st.tables[0],
            tokens.clone(),
            scale,
            &mut all,
        );
        all
    });
    for (kernel, out) in &ran {
        for h in 0..kv_heads * group {
            let r = &out[h * (hd + 2)..(h + 1) * (hd + 2)];
            let what = format!("{kernel} {what} tokens {tokens:?} head {h}");
            if tokens.is_empty() {
                assert!(
                    r[0] == f32::NEG_INFINITY && r[1..].iter().all(|&v| v == 0.0),
                    "{what}: {:?}",
                    &r[..4]
                );
                continue;
            }
            let qh = to_f32(&q[h * hd..(h + 1) * hd]);
            let want = st.range_reference(0, h / group, &qh, tokens.clone(), scale);
            let got: Vec<f32> = r[2..].iter().map(|v| v / r[1]).collect();
            common::assert_close(&got, &want, 5e-3, 2e-2, &what);
        }
    }
}

/// Non-finite keys on the all-heads path: every path agrees with the portable one on which
/// outputs are finite (a key of minus infinity drops its token, plus infinity poisons the
/// head, and so does NaN: the vector paths' running max skips a NaN score, but its
/// exponential stays NaN as the portable path's does).
#[test]
fn all_heads_non_finite_keys_agree_on_every_path() {
    let mut rng = Rng(77);
    let (hd, ps, group, kv_heads) = (64usize, 16usize, 2usize, 2usize);
    let q: Vec<bf16> = (0..kv_heads * group * hd)
        .map(|_| bf16::from_f32(0.1 + 0.5 * rng.uniform().abs()))
        .collect();
    for poison in [f32::NEG_INFINITY, f32::INFINITY, f32::NAN] {
        let mut s = Setup::new(1, 4, kv_heads, hd, ps, &mut rng);
        let at = (s.tables[0][0] as usize * ps + 9) * kv_heads * hd + hd + 5;
        s.k[at] = bf16::from_f32(poison);
        let rec = partial_len(group, hd);
        let ran = all_decode_kernels("decode attention, non-finite key", || {
            let mut all = vec![0.0f32; kv_heads * rec];
            decode_attention_heads_bf16(&q, group, &s.kv(), &s.tables[0], 0..40, 0.125, &mut all);
            all.chunks_exact(hd + 2)
                .flat_map(|r| r[2..].iter().map(|v| v / r[1]).collect::<Vec<f32>>())
                .collect::<Vec<f32>>()
        });
        assert_same_classes_as_portable(&ran, poison);
    }
}

/// Choosing a decode attention kernel: on a thread, `with_decode_kernel` gives that kernel's
/// bits whatever the process chose, and restores the thread's default after; process-wide,
/// `set_process_decode_kernel` runs the chosen kernel on threads whose path allows it (a
/// thread on a lower path keeps its own kernel) until reset; a kernel this CPU lacks is
/// refused by both. Each path's default is `attention::path`'s kernel.
#[test]
fn decode_kernel_choice_selects_the_kernel() {
    use attention::DecodeKernel;
    let mut rng = Rng(5);
    let (kv_heads, group, hd) = (2usize, 2usize, 128usize);
    let st = Setup::new(1, 3, kv_heads, hd, 16, &mut rng);
    let q = rng.vec_bf16(kv_heads * group * hd, 1.0);
    let run = || {
        let mut all = vec![0.0f32; kv_heads * partial_len(group, hd)];
        decode_attention_heads_bf16(&q, group, &st.kv(), &st.tables[0], 3..45, 0.1, &mut all);
        all
    };
    let by_kernel: Vec<(DecodeKernel, Vec<f32>)> = DecodeKernel::ALL
        .into_iter()
        .filter_map(|k| {
            with_isa(k.isa(), || attention::with_decode_kernel(k, run))
                .flatten()
                .map(|r| (k, r))
        })
        .collect();
    for k in DecodeKernel::ALL {
        assert_eq!(DecodeKernel::from_name(k.name()), Some(k));
        if !k.is_supported() {
            assert!(attention::with_decode_kernel(k, run).is_none());
            assert!(!attention::set_process_decode_kernel(Some(k)));
        }
    }
    // A thread whose path is below a kernel's is refused it: `Some` means it ran.
    if let Some(k) = DecodeKernel::ALL
        .into_iter()
        .rev()
        .find(|k| k.is_supported() && *k != DecodeKernel::Portable)
    {
        assert_eq!(
            with_isa(Isa::Portable, || attention::with_decode_kernel(k, run)),
            Some(None)
        );
    }
    // Each path this CPU has runs its default kernel's bits (for this group; the group's own
    // choice is checked below).
    for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
        let want = &by_kernel
            .iter()
            .find(|(k, _)| *k == attention::path(isa, group))
            .expect("supported")
            .1;
        assert_eq!(
            &with_isa(isa, run).expect("supported"),
            want,
            "{}",
            isa.name()
        );
    }
    // The thread's choice wins over the process's, and both are undone.
    let (first, first_out) = &by_kernel[0];
    let (last, last_out) = by_kernel.last().expect("portable at least");
    assert!(attention::set_process_decode_kernel(Some(*last)));
    let chosen = attention::with_decode_kernel(*first, run).expect("supported");
    let process = with_isa(last.isa(), run).expect("supported");
    // A thread on the portable path keeps its own kernel under a vector kernel's choice.
    let portable = with_isa(Isa::Portable, run).expect("portable");
    assert!(attention::set_process_decode_kernel(None));
    assert_eq!(&chosen, first_out);
    assert_eq!(&process, last_out);
    assert_eq!(&portable, &by_kernel[0].1);
    assert_eq!(run(), with_isa(Isa::current(), run).expect("current"));
    // From a group of 5 the AVX-512 BF16 path takes the token-pair kernel, below it the
    // token-major one; every path runs its group's default kernel.
    assert_eq!(
        attention::path(Isa::Avx512Bf16, 5),
        DecodeKernel::Avx512Bf16Pairs
    );
    assert_eq!(
        attention::path(Isa::Avx512Bf16, 4),
        DecodeKernel::Avx512Bf16
    );
    let group5 = 5usize;
    let q5 = rng.vec_bf16(kv_heads * group5 * hd, 1.0);
    let run5 = || {
        let mut all = vec![0.0f32; kv_heads * partial_len(group5, hd)];
        decode_attention_heads_bf16(&q5, group5, &st.kv(), &st.tables[0], 3..45, 0.1, &mut all);
        all
    };
    for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
        let k = attention::path(isa, group5);
        let chosen = with_isa(isa, || attention::with_decode_kernel(k, run5)).flatten();
        assert_eq!(with_isa(isa, run5), chosen, "{} group 5", isa.name());
    }
}

/// The causal prefill rows on every path against the portable one and the fp64 reference at
/// the edges of the AVX2 blocked kernel: query counts just below, at and above its smallest
/// block (12), its 16-query tiles and its 64-query blocks (split into nearly equal blocks),
/// prefixes ending inside, at and past its 48-token runs and 16- or 128-token pages, GQA
/// groups 1 to 8, and a call whose first row starts at position 0.
#[test]
fn prefill_rows_blocked_edges_on_every_path() {
    let mut rng = Rng(4242);
    for (group, n_rows, first_pos, hd, ps, kv_heads) in [
        (1usize, 11usize, 0usize, 32usize, 16usize, 1usize),
        (1, 12, 47, 64, 16, 2),
        (2, 8, 48, 128, 128, 2),
        (3, 5, 95, 96, 16, 1),
        (2, 32, 96, 128, 128, 3),
        (1, 65, 1, 32, 16, 1),
        (4, 17, 130, 64, 128, 2),
        (8, 9, 17, 256, 16, 1),
        (5, 13, 200, 32, 16, 2),
        (2, 50, 0, 128, 16, 2),
    ] {
        let blocks = (first_pos + n_rows).div_ceil(ps);
        let st = Setup::new(1, blocks, kv_heads, hd, ps, &mut rng);
        let q: Vec<f32> = rng
            .vec_bf16(n_rows * group * hd, 3.0)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let what = format!(
            "prefill rows, blocked edges, group {group} rows {n_rows} first_pos {first_pos} hd {hd} page {ps}"
        );
        let rows = st.prefill_rows(0, &q, group, kv_heads - 1, first_pos);
        prefill_agrees_on_every_path(&what, &st, 0, &rows, 0..n_rows);
    }
}

/// The packed entry (`prefill_attention_rows_packed`) from bf16 Q rows, read where they lie
/// (a KV head's group inside wider rows), against the fp32 entry on the widened group, then
/// `cast_f32_bf16` and `pack_segment_bf16`: bit for bit on every path, at head dimensions the
/// bf16 engines take and one they do not (48), row counts that are not whole query blocks,
/// groups of 1, 2 and 5, every KV head, and a NaN key (quietened NaN outputs where the
/// portable path has them). The packed entry given the widened queries writes the same bits.
#[test]
fn packed_prefill_rows_from_bf16_queries_are_the_fp32_entry_rounded_and_packed() {
    let mut rng = Rng(2027);
    for (hd, group, n_rows, first_pos, nan_key) in [
        (128usize, 2usize, 37usize, 50usize, false),
        (64, 5, 9, 0, false),
        (128, 1, 16, 100, true),
        (48, 2, 11, 30, false),
    ] {
        let (kv_heads, ps) = (3usize, 16usize);
        let mut st = Setup::new(1, 12, kv_heads, hd, ps, &mut rng);
        if nan_key {
            let t = first_pos + 3;
            let at = (st.tables[0][t / ps] as usize * ps + t % ps) * kv_heads * hd + hd + 7;
            st.k[at] = bf16::NAN;
        }
        let width = kv_heads * group * hd;
        // Q rows of every head, with room after the last row's group.
        let q = rng.vec_bf16(n_rows * width + 5, 2.0);
        for kv_head in 0..kv_heads {
            let what =
                format!("packed prefill rows hd {hd} group {group} rows {n_rows} head {kv_head}");
            let per_row = group * hd;
            let widened: Vec<f32> = (0..n_rows)
                .flat_map(|i| {
                    q[i * width + kv_head * per_row..][..per_row]
                        .iter()
                        .map(|v| v.to_f32())
                })
                .collect();
            let f32_rows = st.prefill_rows(0, &widened, group, kv_head, first_pos);
            let bf16_rows = PrefillRows {
                queries: PrefillQueries::Bf16 {
                    rows: &q,
                    stride: width,
                    offset: kv_head * per_row,
                    n_rows,
                },
                ..f32_rows
            };
            let ran = common::all_paths(&what, || {
                let mut want = vec![f32::NAN; n_rows * per_row];
                prefill_attention_rows_f32(&f32_rows, &mut want);
                let mut ob = vec![bf16::ZERO; per_row];
                let mut packed_want = vec![f32::NAN; n_rows * per_row];
                for (src, dst) in want
                    .chunks_exact(per_row)
                    .zip(packed_want.chunks_exact_mut(per_row))
                {
                    cast_f32_bf16(src, &mut ob);
                    pack_segment_bf16(&ob, 0, per_row, dst);
                }
                let packed = |rows: &PrefillRows<'_>| {
                    let mut got = vec![f32::NAN; n_rows * per_row];
                    let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(per_row).collect();
                    prefill_attention_rows_packed(rows, &mut outs);
                    got
                };
                (packed_want, packed(&bf16_rows), packed(&f32_rows))
            });
            for (isa, (want, from_bf16, from_f32)) in &ran {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(from_bf16),
                    bits(want),
                    "{what} on {}: bf16 queries",
                    isa.name()
                );
                assert_eq!(
                    bits(from_f32),
                    bits(want),
                    "{what} on {}: fp32 queries",
                    isa.name()
                );
            }
            if nan_key && kv_head == 1 {
                assert!(
                    ran[0].1.0.iter().any(|v| v.is_nan()),
                    "{what}: the NaN key reaches no output"
                );
            }
        }
    }
}

/// Packed rows of the wrong length and bf16 rows that end before the last row's group are
/// refused before anything is written.
#[test]
fn packed_prefill_rows_refuse_bad_outputs_and_short_query_rows() {
    let mut rng = Rng(7);
    let (hd, group, n_rows) = (64usize, 2usize, 4usize);
    let st = Setup::new(1, 2, 1, hd, 16, &mut rng);
    let per_row = group * hd;
    let q = rng.vec_bf16(n_rows * per_row, 1.0);
    let rows = |n_rows: usize, stride: usize| PrefillRows {
        queries: PrefillQueries::Bf16 {
            rows: &q,
            stride,
            offset: 0,
            n_rows,
        },
        group,
        kv: st.kv(),
        block_table: &st.tables[0],
        kv_head: 0,
        first_pos: 0,
        scale: 0.125,
    };
    // A refused call leaves its outputs as they were.
    let run = |r: PrefillRows<'_>, out_rows: usize, len: usize| {
        let mut got = vec![7.0f32; out_rows * len];
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(len).collect();
            prefill_attention_rows_packed(&r, &mut outs);
        }))
        .map_err(|e| e.downcast_ref::<String>().cloned().unwrap_or_default());
        if result.is_err() {
            assert!(
                got.iter().all(|&v| v == 7.0),
                "a refused call wrote its outputs"
            );
        }
        result
    };
    assert!(run(rows(n_rows, per_row), n_rows, per_row).is_ok());
    let short_out = run(rows(n_rows, per_row), n_rows, per_row - 16).unwrap_err();
    assert!(short_out.contains("an output row is not"), "{short_out}");
    // One row more than `q` holds, and a stride shorter than the group.
    for (n, stride) in [(n_rows + 1, per_row), (n_rows, per_row - 1)] {
        let e = run(rows(n, stride), n, per_row).unwrap_err();
        assert!(e.contains("outside"), "{n} rows of stride {stride}: {e}");
    }
    // The thread's scratch is whole: the next call runs.
    assert!(run(rows(n_rows, per_row), n_rows, per_row).is_ok());
}

/// A `first_pos` whose last row's position does not fit a `usize` is refused on every path,
/// outputs untouched: wrapped, the checked token range came out empty while the kernels read
/// the pages of positions up to `first_pos` (past the pool; found by an outside audit).
#[test]
fn prefill_rows_whose_positions_overflow_are_refused_on_every_path() {
    let mut rng = Rng(11);
    let (hd, group, n_rows) = (32usize, 1usize, 2usize);
    let st = Setup::new(1, 1, 1, hd, 16, &mut rng);
    let q = rng.vec_f32(n_rows * group * hd, 1.0);
    // Page 1 is not in the one-page pool; a valid call would need page 0 alone.
    let table = [0u32, 1, 0];
    for first_pos in [usize::MAX - 1, usize::MAX] {
        let rows = PrefillRows {
            queries: PrefillQueries::F32(&q),
            group,
            kv: st.kv(),
            block_table: &table,
            kv_head: 0,
            first_pos,
            scale: 0.125,
        };
        for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
            let mut out = vec![7.0f32; q.len()];
            let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                with_isa(isa, || prefill_attention_rows_f32(&rows, &mut out));
            }))
            .map_err(|e| e.downcast_ref::<String>().cloned().unwrap_or_default())
            .unwrap_err();
            assert!(e.contains("overflows"), "{isa:?} at {first_pos}: {e}");
            assert!(out.iter().all(|&v| v == 7.0), "{isa:?}: outputs written");
        }
    }
}

/// Non-finite keys in causal prefill: every path agrees with the portable one on which
/// outputs are finite, with enough rows for the AVX2 blocked kernel: a key of minus infinity
/// drops its token, plus infinity and NaN poison the rows that see it, and rows before the
/// poisoned token stay finite (the causal mask keeps it out of their softmax).
#[test]
fn prefill_rows_non_finite_keys_agree_on_every_path() {
    let mut rng = Rng(99);
    let (hd, ps, group, n_rows) = (64usize, 16usize, 2usize, 24usize);
    let q: Vec<f32> = (0..n_rows * group * hd)
        .map(|_| 0.1 + 0.5 * rng.uniform().abs())
        .collect();
    let poisoned = 30;
    for poison in [f32::NEG_INFINITY, f32::INFINITY, f32::NAN] {
        let mut s = Setup::new(1, 4, 1, hd, ps, &mut rng);
        let at = (s.tables[0][poisoned / ps] as usize * ps + poisoned % ps) * hd + 5;
        s.k[at] = bf16::from_f32(poison);
        let first_pos = 20;
        let rows = PrefillRows {
            scale: 0.125,
            ..s.prefill_rows(0, &q, group, 0, first_pos)
        };
        let ran = prefill_on_every_path("prefill rows, non-finite key", &rows);
        let (_, p) = &ran[0];
        // Rows before the poisoned token never see it.
        let clean = (poisoned - first_pos) * group * hd;
        assert!(
            p[..clean].iter().all(|v| v.is_finite()),
            "key {poison}: rows before it"
        );
        assert_eq!(
            p[clean..].iter().all(|v| v.is_finite()),
            poison == f32::NEG_INFINITY,
            "key {poison}: rows that see it"
        );
        assert_same_classes_as_portable(&ran, poison);
    }
}

/// The bf16 engines keep the gathered K rows and V pairs in per-thread scratch between calls:
/// a call over a short, odd prefix after one whose V rows were NaN past that prefix must not
/// read the stale pairs (its last token pair and the block's padding). On every path, on one
/// thread: the poisoned call's outputs are NaN as the portable path's, the next call's all
/// finite and close to the portable path's and to the fp64 reference.
#[test]
fn prefill_rows_after_a_poisoned_call_read_no_stale_scratch() {
    let mut rng = Rng(515);
    let (hd, ps, group, n_rows) = (128usize, 16usize, 2usize, 3usize);
    let q: Vec<f32> = rng
        .vec_bf16(n_rows * group * hd, 1.0)
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let mut poisoned = Setup::new(1, 4, 1, hd, ps, &mut rng);
    // Every V row from token 34 on is NaN; the poisoned call sees tokens 0..64.
    for t in 34..64 {
        let at = (poisoned.tables[0][t / ps] as usize * ps + t % ps) * hd;
        poisoned.v[at..at + hd].fill(bf16::NAN);
    }
    let clean = Setup::new(1, 4, 1, hd, ps, &mut rng);
    // The clean call ends at token 33 (odd): its last pair is token 32 and a zero row.
    let first_pos = 33 - n_rows;
    let ran = common::all_paths("prefill rows after a poisoned call", || {
        let mut bad = vec![0.0f32; q.len()];
        prefill_attention_rows_f32(
            &poisoned.prefill_rows(0, &q, group, 0, 64 - n_rows),
            &mut bad,
        );
        let mut out = vec![0.0f32; q.len()];
        prefill_attention_rows_f32(&clean.prefill_rows(0, &q, group, 0, first_pos), &mut out);
        (bad.iter().all(|v| v.is_nan()), out)
    });
    for (isa, (bad_nan, out)) in &ran {
        assert!(
            bad_nan,
            "{}: the poisoned call's outputs are NaN",
            isa.name()
        );
        assert!(
            out.iter().all(|v| v.is_finite()),
            "{}: stale pairs read",
            isa.name()
        );
        common::assert_close(
            out,
            &ran[0].1.1,
            5e-3,
            2e-2,
            &format!("{} vs portable", isa.name()),
        );
        for i in 0..n_rows {
            for j in 0..group {
                let at = (i * group + j) * hd;
                let e = clean.reference(
                    0,
                    0,
                    &q[at..at + hd],
                    first_pos + i + 1,
                    1.0 / (hd as f32).sqrt(),
                );
                common::assert_close(
                    &out[at..at + hd],
                    &e,
                    5e-3,
                    2e-2,
                    &format!("{} row {i}", isa.name()),
                );
            }
        }
    }
}

/// Rows the kernels cannot serve are refused before anything is read or written, on every
/// path: rows running past the block table, a table naming a page outside the pool, an output
/// of the wrong length. The output is left as it was, and the same rows with a sound table then
/// run and agree with the portable path.
#[test]
fn bad_prefill_rows_are_refused_before_any_write_and_the_next_call_runs() {
    let mut rng = Rng(17);
    let (hd, ps, group) = (64, 16, 2);
    let st = Setup::new(1, 2, 2, hd, ps, &mut rng);
    let n_rows = 5;
    let q: Vec<f32> = rng
        .vec_bf16(n_rows * group * hd, 1.0)
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let refuse = |what: &str, rows: &PrefillRows<'_>, out_len: usize, expect: &str| {
        common::all_paths(what, || {
            let mut out = vec![7.25f32; out_len];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                prefill_attention_rows_f32(rows, &mut out)
            }));
            let msg = r.expect_err("bad rows must be refused");
            let msg = msg
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| msg.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            assert!(msg.contains(expect), "{what}: {msg}");
            assert!(out.iter().all(|&v| v == 7.25), "{what}: output written");
        });
    };
    // Tokens up to 2 pages + 1: one past the two-entry table.
    let past = st.prefill_rows(0, &q, group, 1, 2 * ps + 1 - n_rows + 1);
    refuse("rows past the table", &past, q.len(), "attention");
    // A table naming page 9 of a two-page pool.
    let bad_table = [0u32, 9];
    let mut outside = st.prefill_rows(0, &q, group, 1, ps);
    outside.block_table = &bad_table;
    refuse("page outside the pool", &outside, q.len(), "attention");
    let sound = st.prefill_rows(0, &q, group, 1, ps);
    refuse("short output", &sound, q.len() - 1, "out len");
    prefill_agrees_on_every_path("after the refusals", &st, 0, &sound, 0..n_rows);
}

/// A V pool whose rows are all one vector comes back as that vector on every kernel, to fp32
/// rounding (`|a - e| <= 1e-5 |e|`), at every group and across pages: the normalised output is
/// a convex combination of the V rows. The token-pair kernel rounds its probabilities to bf16
/// for `p · V` and sums the *rounded* ones into `l`; summing the unrounded ones instead would
/// leave the output off by the rounding's mean, ~1e-4 of it here, and fail.
#[test]
fn a_constant_v_comes_back_on_every_kernel() {
    let mut rng = Rng(77);
    let (kv_heads, hd, ps) = (2usize, 128usize, 128usize);
    for group in [2usize, 5, 8] {
        let mut st = Setup::new(1, 3, kv_heads, hd, ps, &mut rng);
        // Every row the same vector: a large common offset plus a per-element part, all
        // exact in bf16.
        let c: Vec<bf16> = (0..kv_heads * hd)
            .map(|i| bf16::from_f32(100.0 + (i % 17) as f32 * 0.25))
            .collect();
        for row in st.v.chunks_exact_mut(kv_heads * hd) {
            row.copy_from_slice(&c);
        }
        let q = rng.vec_bf16(kv_heads * group * hd, 4.0);
        let rec = partial_len(group, hd);
        let ran = all_decode_kernels("decode attention, constant V", || {
            let mut all = vec![0.0f32; kv_heads * rec];
            decode_attention_heads_bf16(&q, group, &st.kv(), &st.tables[0], 5..300, 0.09, &mut all);
            all
        });
        for (kernel, out) in &ran {
            for (h, r) in out.chunks_exact(rec / group).enumerate() {
                let want = &c[(h / group) * hd..(h / group + 1) * hd];
                for (d, (&o, &e)) in r[2..].iter().zip(want).enumerate() {
                    let (got, e) = (o / r[1], e.to_f32());
                    assert!(
                        (got - e).abs() <= 1e-5 * e.abs(),
                        "{kernel} group {group} head {h} element {d}: {got} vs {e}"
                    );
                }
            }
        }
    }
}

/// Rows outside a call's token range never reach its result: with every other row of the
/// sequence's pages (and the rest of the pool) set to NaN, every kernel matches the reference
/// over the range — odd runs, runs ending at a page's end, a single token at a page's end,
/// pages smaller than a run, every group the kernels take — and an empty range gives the empty
/// record `[-inf, 0, 0, ..]` on every kernel. (A kernel pairing a run's odd last row with the
/// row after it, or reading a probability past the run, would carry a NaN in.)
#[test]
fn rows_outside_the_range_never_reach_the_result() {
    let mut rng = Rng(404);
    for (group, hd, ps, kv_heads) in [
        (1, 64, 16, 2),
        (2, 128, 128, 2),
        (3, 96, 16, 1),
        (5, 128, 128, 2),
        (5, 64, 16, 1),
        (6, 160, 128, 1),
        (8, 256, 16, 1),
    ] {
        let scale = 1.0 / (hd as f32).sqrt();
        let q = rng.vec_bf16(kv_heads * group * hd, 1.0);
        for tokens in [
            0..0,
            ps - 1..ps,
            ps + 3..2 * ps,
            1..2 * ps + 7,
            2 * ps - 5..3 * ps + 64 + 1,
        ] {
            let mut st = Setup::new(1, 8, kv_heads, hd, ps, &mut rng);
            let row = kv_heads * hd;
            let inside: std::collections::HashSet<usize> = tokens
                .clone()
                .map(|t| st.tables[0][t / ps] as usize * ps + t % ps)
                .collect();
            for (slot, (k, v)) in
                st.k.chunks_exact_mut(row)
                    .zip(st.v.chunks_exact_mut(row))
                    .enumerate()
            {
                if !inside.contains(&slot) {
                    k.fill(bf16::NAN);
                    v.fill(bf16::NAN);
                }
            }
            let what = format!("group {group} hd {hd} page {ps}, NaN outside the range");
            all_kernels_match_the_reference(&st, &q, group, tokens, scale, &what);
        }
    }
}

/// `attention::kernel_for` names the kernel that runs: `path`'s where the vector kernels take
/// the shape, the portable loops where none does (a group above 8, a head dimension that is not
/// a multiple of 32), whose bits a call of that shape then gives.
#[test]
fn kernel_for_names_the_kernel_that_runs() {
    use attention::{DecodeKernel, kernel_for, path};
    for isa in Isa::ALL {
        for group in [1, 2, 4, 5, 8] {
            assert_eq!(kernel_for(isa, group, 128), path(isa, group));
        }
        assert_eq!(kernel_for(isa, 9, 128), DecodeKernel::Portable);
        assert_eq!(kernel_for(isa, 2, 80), DecodeKernel::Portable);
    }
    let mut rng = Rng(9);
    let (group, hd) = (9usize, 64usize);
    let st = Setup::new(1, 2, 1, hd, 16, &mut rng);
    let q = rng.vec_bf16(group * hd, 1.0);
    let run = || {
        let mut all = vec![0.0f32; partial_len(group, hd)];
        decode_attention_heads_bf16(&q, group, &st.kv(), &st.tables[0], 0..29, 0.1, &mut all);
        all
    };
    assert_eq!(run(), with_isa(Isa::Portable, run).expect("portable"));
}
