//! The spec's tolerances for DeepSeek-V4 outputs (`docs/dsv4.md`, "Tolerances"): a
//! relative-difference ratio with a share of elements allowed over it for layer outputs, and
//! `atol + rtol·|e|` with a share allowed outside for caches; and the comparisons of a runtime
//! step against the golden that tests and `simpler run dsv4 --check` share.

use half::bf16;

use super::fixture::{HcaParts, WindowCache};
use super::golden::AttnStep;
use super::runner::{AttnCaches, AttnStepOutput};

/// A relative-difference check: `rdiff = |a - e|` when that is below `thd`, else
/// `|a - e| / max(|a|, |e|, 2^-14 / thd)`; passes when at most `pct` of the elements have
/// `rdiff > thd` (NaN always counts as over).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RelDiff {
    /// Threshold on `rdiff`.
    pub thd: f32,
    /// Share of elements allowed over it (0.008 is 0.8%).
    pub pct: f64,
}

/// An `|a - e| <= atol + rtol·|e|` check with a share of elements allowed outside.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheTol {
    /// Absolute part.
    pub atol: f32,
    /// Relative part.
    pub rtol: f32,
    /// Share of elements allowed outside.
    pub pct: f64,
}

/// The outcome of a comparison.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outcome {
    /// Elements compared.
    pub n: usize,
    /// Elements over the threshold (or outside the tolerance).
    pub over: usize,
    /// Index of the worst element.
    pub worst: usize,
    /// Its `rdiff` (or absolute excess for caches).
    pub worst_value: f32,
}

impl Outcome {
    /// Share of elements over.
    pub fn share_over(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.over as f64 / self.n as f64
        }
    }
}

impl RelDiff {
    /// SWA and HCA `x_out`: 3e-3 / 0.8%.
    pub const SWA_HCA: RelDiff = RelDiff {
        thd: 3e-3,
        pct: 0.008,
    };
    /// CSA `x_out`: 4e-3 / 0.8%.
    pub const CSA: RelDiff = RelDiff {
        thd: 4e-3,
        pct: 0.008,
    };
    /// MoE output: 3e-3 / 5%.
    pub const MOE: RelDiff = RelDiff {
        thd: 3e-3,
        pct: 0.05,
    };

    /// `rdiff` of one pair.
    pub fn rdiff(&self, a: f32, e: f32) -> f32 {
        let diff = (a - e).abs();
        if diff.is_nan() {
            return f32::INFINITY;
        }
        if diff < self.thd {
            diff
        } else {
            diff / a.abs().max(e.abs()).max(2f32.powi(-14) / self.thd)
        }
    }

    /// Compares `actual` with `expected`; `Err` names `what`, the share and the worst element.
    pub fn check(&self, what: &str, actual: &[f32], expected: &[f32]) -> Result<Outcome, String> {
        let out = outcome(actual, expected, |a, e| {
            let r = self.rdiff(a, e);
            (r > self.thd, r)
        });
        judge(what, out, self.pct, actual, expected)
    }

    /// [`RelDiff::check`] of `[rows, width]` outputs, and then what no share of elements
    /// catches: a column with more than half of its rows over the threshold fails (given 4
    /// rows or more). A block of outputs left unwritten or computed from the wrong inputs —
    /// one SPMD block of a projection, a few whole columns — is a share of the elements
    /// small enough for the tolerance to pass, while rounding differences do not gather in
    /// one column (`run dsv4 --layer moe --check` at FLASH: 0.3% of `y`'s elements over, spread over
    /// its columns).
    pub fn check_columns(
        &self,
        what: &str,
        actual: &[f32],
        expected: &[f32],
        width: usize,
    ) -> Result<Outcome, String> {
        let out = self.check(what, actual, expected)?;
        if width == 0 || !actual.len().is_multiple_of(width) {
            return Err(format!(
                "{what}: {} elements are not rows of {width}",
                actual.len()
            ));
        }
        let rows = actual.len() / width;
        if rows < 4 {
            return Ok(out);
        }
        let mut per_column = vec![0usize; width];
        for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            if self.rdiff(a, e) > self.thd {
                per_column[i % width] += 1;
            }
        }
        let bad = per_column.iter().filter(|&&n| 2 * n > rows).count();
        if let Some((c, &n)) = per_column.iter().enumerate().max_by_key(|&(_, &n)| n)
            && 2 * n > rows
        {
            return Err(format!(
                "{what}: {bad} of {width} columns have most of their {rows} rows over the tolerance (column {c}: {n}), though only {:.3}% of all elements are",
                100.0 * out.share_over()
            ));
        }
        Ok(out)
    }
}

impl CacheTol {
    /// KV caches: atol 1e-4, rtol 1/128, at most 0.5% outside.
    pub const KV: CacheTol = CacheTol {
        atol: 1e-4,
        rtol: 1.0 / 128.0,
        pct: 0.005,
    };

    /// The step's bf16-rounded intermediates (`q` after RoPE, the attention output after the
    /// inverse RoPE), which the spec gives no tolerance: one bf16 ulp at the tensor's RMS
    /// (`atol = rms(expected) / 128`) on top of the caches' rule. Their errors are absolute at
    /// the row's scale, not relative to each element: `q` is rounded to bf16 after its head
    /// norm and then rotated, so a small rotated value carries the rounding of its unit-size
    /// inputs. And a last-bit difference in a 4096-term sum (a kernel's blocked order against
    /// the golden's f64) can move one int8 code of `qr`, which shifts every `q` value of that
    /// token by ~1e-4 of itself and flips a few percent of their bf16 roundings: on the AVX2
    /// path at FLASH (seed 22) 1.0% of `q` was over the output threshold, all within one ulp
    /// at the row's scale, while `x_out` stayed within its spec tolerance.
    pub fn bf16_intermediate(expected: &[f32]) -> CacheTol {
        let ms = expected
            .iter()
            .map(|&e| f64::from(e) * f64::from(e))
            .sum::<f64>()
            / expected.len().max(1) as f64;
        CacheTol {
            atol: (ms.sqrt() / 128.0) as f32,
            ..CacheTol::KV
        }
    }

    /// Compares `actual` with `expected`; `Err` names `what`, the share and the worst element.
    pub fn check(&self, what: &str, actual: &[f32], expected: &[f32]) -> Result<Outcome, String> {
        let out = outcome(actual, expected, |a, e| {
            let excess = (a - e).abs() - (self.atol + self.rtol * e.abs());
            let excess = if excess.is_nan() {
                f32::INFINITY
            } else {
                excess
            };
            (excess > 0.0, excess)
        });
        judge(what, out, self.pct, actual, expected)
    }
}

/// Every comparison of an SWA, CSA or HCA step run on the runtime against the golden step `g`
/// (for CSA, [`csa_cache_checks`] adds its own caches):
/// the golden's bf16 intermediates (`q`, `attn`) at bf16 resolution, `o_proj` and the new
/// residual with the layer's tolerance, then each cache the step writes, read back whole from the worker and compared
/// with the fixture's cache (`window`, `hca`) plus the golden's writes. Each entry is the
/// output's name and its outcome (`Err` names the share over and the worst element).
pub fn attn_step_checks(
    window: &WindowCache,
    hca: Option<&HcaParts>,
    g: &AttnStep,
    out: &AttnStepOutput,
    caches: &AttnCaches,
) -> Vec<(&'static str, Result<Outcome, String>)> {
    // The CSA step's outputs have the CSA tolerance.
    let t = if g.csa.is_some() {
        RelDiff::CSA
    } else {
        RelDiff::SWA_HCA
    };
    let widen = |v: &[bf16]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    let hd = window.width;
    // `o_proj` is `[T, hidden]`, `x_out` `[T, hc_mult, hidden]`: both are rows of `hidden`.
    let hidden = g.o_proj.len() / g.real.len().max(1);
    // Padding rows' outputs mean nothing: each output is compared on the real rows only.
    let (q, gq) = (real_rows(&out.q, &g.real), real_rows(&g.q, &g.real));
    let (a, ga) = (real_rows(&out.attn, &g.real), real_rows(&g.attn, &g.real));
    let mut checks = vec![
        ("q", CacheTol::bf16_intermediate(&gq).check("q", &q, &gq)),
        (
            "attn",
            CacheTol::bf16_intermediate(&ga).check("attn", &a, &ga),
        ),
        (
            "o_proj",
            t.check_columns(
                "o_proj",
                &real_rows(&out.o_proj, &g.real),
                &real_rows(&g.o_proj, &g.real),
                hidden,
            ),
        ),
        (
            "x_out",
            t.check_columns(
                "x_out",
                &real_rows(&out.x_out, &g.real),
                &real_rows(&g.x_out, &g.real),
                hidden,
            ),
        ),
    ];
    let mut want = widen(&window.rows);
    for (slot, row) in g
        .window_write
        .slots
        .iter()
        .zip(g.window_write.rows.chunks(hd))
    {
        if let Some(s) = slot {
            want[s * hd..(s + 1) * hd].copy_from_slice(&widen(row));
        }
    }
    checks.push((
        "window cache",
        CacheTol::KV.check("window cache", &widen(&caches.window), &want),
    ));
    // The rows the step wrote, on their own as well: a few wrong rows are far below a whole
    // cache's share allowance (at tiny, the 8 rows a step writes are 0.024% of the window).
    checks.push((
        "window rows written",
        rows_written_check("window rows written", &caches.window, &g.window_write, hd),
    ));
    if let (Some(h), Some(sw), Some(cw)) = (hca, &g.state_write, &g.compressed_write) {
        let (mut kv, mut score) = (h.state.kv.clone(), h.state.score.clone());
        for (i, &s) in sw.slots.iter().enumerate() {
            kv[s * hd..(s + 1) * hd].copy_from_slice(&sw.kv[i * hd..(i + 1) * hd]);
            score[s * hd..(s + 1) * hd].copy_from_slice(&sw.score[i * hd..(i + 1) * hd]);
        }
        checks.push((
            "state kv",
            CacheTol::KV.check("state kv", &caches.state_kv, &kv),
        ));
        checks.push((
            "state score",
            CacheTol::KV.check("state score", &caches.state_score, &score),
        ));
        checks.push((
            "state rows written",
            CacheTol::KV.check(
                "state rows written",
                &[
                    rows_at(&caches.state_kv, &sw.slots, hd),
                    rows_at(&caches.state_score, &sw.slots, hd),
                ]
                .concat(),
                &[sw.kv.clone(), sw.score.clone()].concat(),
            ),
        ));
        let mut comp = widen(&h.cache.rows);
        for (slot, row) in cw.slots.iter().zip(cw.rows.chunks(hd)) {
            if let Some(s) = slot {
                comp[s * hd..(s + 1) * hd].copy_from_slice(&widen(row));
            }
        }
        checks.push((
            "compressed cache",
            CacheTol::KV.check("compressed cache", &widen(&caches.compressed), &comp),
        ));
        checks.push((
            "compressed rows written",
            rows_written_check("compressed rows written", &caches.compressed, cw, hd),
        ));
    }
    let mut untouched: Vec<Untouched<'_>> = vec![(
        "window cache",
        widen(&caches.window),
        widen(&window.rows),
        g.window_write.slots.iter().flatten().copied().collect(),
        hd,
    )];
    if let (Some(h), Some(sw), Some(cw)) = (hca, &g.state_write, &g.compressed_write) {
        untouched.extend([
            (
                "state kv",
                caches.state_kv.clone(),
                h.state.kv.clone(),
                sw.slots.clone(),
                hd,
            ),
            (
                "state score",
                caches.state_score.clone(),
                h.state.score.clone(),
                sw.slots.clone(),
                hd,
            ),
            (
                "compressed cache",
                widen(&caches.compressed),
                widen(&h.cache.rows),
                cw.slots.iter().flatten().copied().collect(),
                hd,
            ),
        ]);
    }
    checks.push(("unwritten rows", unwritten_rows(&untouched)));
    checks
}

/// One cache for [`unwritten_rows`]: its name, contents after the step and before it, the
/// rows the golden step wrote, and the row width.
type Untouched<'a> = (&'static str, Vec<f32>, Vec<f32>, Vec<usize>, usize);

/// The rows of each cache the golden step did not write, after the step, against the same rows
/// before it, bit for bit: a step must leave them alone (a padding row writes nothing, a token
/// writes only its own rows), and a few stray rows hide in a whole cache's share allowance.
fn unwritten_rows(caches: &[Untouched<'_>]) -> Result<Outcome, String> {
    let mut out = Outcome {
        n: 0,
        over: 0,
        worst: 0,
        worst_value: 0.0,
    };
    for (what, after, before, written, width) in caches {
        if after.len() != before.len() || *width == 0 {
            return Err(format!(
                "{what}: {} values after the step, {} before",
                after.len(),
                before.len()
            ));
        }
        for (r, (a, b)) in after.chunks(*width).zip(before.chunks(*width)).enumerate() {
            if written.contains(&r) {
                continue;
            }
            if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
                return Err(format!(
                    "{what}: row {r}, which the step does not write, changed: element {i} is {} (was {})",
                    a[i], b[i]
                ));
            }
            out.n += a.len();
        }
    }
    Ok(out)
}

/// The rows of `v` (`real.len()` equal rows, one a token) whose token is real, in order. A
/// length that is not whole rows is returned as it is, so the comparison that follows fails
/// on the length.
fn real_rows(v: &[f32], real: &[bool]) -> Vec<f32> {
    if v.is_empty()
        || real.iter().all(|&r| r)
        || real.is_empty()
        || !v.len().is_multiple_of(real.len())
    {
        return v.to_vec();
    }
    let width = v.len() / real.len();
    v.chunks(width)
        .zip(real)
        .filter(|&(_, &r)| r)
        .flat_map(|(row, _)| row.iter().copied())
        .collect()
}

/// The bf16 rows a step wrote (`w`: a slot per row, `None` for no write), as `cache` holds
/// them, against the golden's, at [`CacheTol::KV`].
fn rows_written_check(
    what: &str,
    cache: &[bf16],
    w: &super::golden::CacheWrite,
    width: usize,
) -> Result<Outcome, String> {
    let written = || {
        w.slots
            .iter()
            .zip(w.rows.chunks(width))
            .filter_map(|(s, r)| s.map(|s| (s, r)))
    };
    let slots: Vec<usize> = written().map(|(s, _)| s).collect();
    let want: Vec<f32> = written()
        .flat_map(|(_, r)| r.iter().map(|x| x.to_f32()))
        .collect();
    let got: Vec<f32> = cache.iter().map(|x| x.to_f32()).collect();
    CacheTol::KV.check(what, &rows_at(&got, &slots, width), &want)
}

/// The rows `slots` (each `width` wide) of `all`, in that order; a slot past the end gives
/// nothing, so the comparison that follows fails on the length.
fn rows_at(all: &[f32], slots: &[usize], width: usize) -> Vec<f32> {
    slots
        .iter()
        .flat_map(|&s| {
            all.get(s * width..(s + 1) * width)
                .unwrap_or(&[])
                .iter()
                .copied()
        })
        .collect()
}

fn outcome(actual: &[f32], expected: &[f32], over: impl Fn(f32, f32) -> (bool, f32)) -> Outcome {
    let mut o = Outcome {
        n: actual.len(),
        over: 0,
        worst: 0,
        worst_value: f32::NEG_INFINITY,
    };
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let (is_over, v) = over(a, e);
        o.over += usize::from(is_over);
        if v > o.worst_value {
            o.worst_value = v;
            o.worst = i;
        }
    }
    o
}

fn judge(
    what: &str,
    out: Outcome,
    pct: f64,
    actual: &[f32],
    expected: &[f32],
) -> Result<Outcome, String> {
    if actual.len() != expected.len() {
        return Err(format!(
            "{what}: {} elements vs {} expected",
            actual.len(),
            expected.len()
        ));
    }
    if out.share_over() > pct {
        let w = out.worst;
        return Err(format!(
            "{what}: {} of {} elements ({:.3}%) over the tolerance (allowed {:.3}%); worst [{w}]: {} vs {}",
            out.over,
            out.n,
            100.0 * out.share_over(),
            100.0 * pct,
            actual[w],
            expected[w]
        ));
    }
    Ok(out)
}

/// The CSA caches a step wrote, read back from the worker (`caches`), against the fixture's
/// CSA parts with the golden step's writes (`g`) applied: both compressors' rings, the
/// compressed rows, the index rows (compared dequantised, so an int8 step rounded the other
/// way counts as outside) and their scales, each at [`CacheTol::KV`]. Each entry is the
/// cache's name and its outcome (`Err` names the share outside and the worst element; a step
/// without CSA writes is an `Err` too).
pub fn csa_cache_checks(
    csa: &super::fixture::CsaParts,
    g: &super::golden::AttnStep,
    caches: &super::runner::CsaCaches,
) -> Vec<(&'static str, Result<Outcome, String>)> {
    let Some(gw) = g.csa.as_ref() else {
        return vec![(
            "csa caches",
            Err("the golden step wrote no CSA caches".into()),
        )];
    };
    let widen = |v: &[half::bf16]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    // A ring as the step leaves it: the fixture's rows with the golden's writes.
    let ring = |state: &super::fixture::OverlapState, sw: &super::golden::StateWrite| {
        let wide = 2 * state.width;
        let (mut kv, mut score) = (state.kv.clone(), state.score.clone());
        for (i, &s) in sw.slots.iter().enumerate() {
            kv[s * wide..(s + 1) * wide].copy_from_slice(&sw.kv[i * wide..(i + 1) * wide]);
            score[s * wide..(s + 1) * wide].copy_from_slice(&sw.score[i * wide..(i + 1) * wide]);
        }
        (kv, score)
    };
    let t = CacheTol::KV;
    let mut checks = Vec::new();
    let (kv, score) = ring(&csa.state, &gw.state_write);
    checks.push(("ring kv", t.check("ring kv", &caches.ring_kv, &kv)));
    checks.push((
        "ring score",
        t.check("ring score", &caches.ring_score, &score),
    ));
    let (kv, score) = ring(&csa.index_state, &gw.index_state_write);
    checks.push((
        "index ring kv",
        t.check("index ring kv", &caches.index_ring_kv, &kv),
    ));
    checks.push((
        "index ring score",
        t.check("index ring score", &caches.index_ring_score, &score),
    ));
    let hd = csa.cache.width;
    let mut comp = widen(&csa.cache.rows);
    for (slot, row) in gw
        .compressed
        .slots
        .iter()
        .zip(gw.compressed.rows.chunks(hd))
    {
        if let Some(s) = slot {
            comp[s * hd..(s + 1) * hd].copy_from_slice(&widen(row));
        }
    }
    checks.push((
        "compressed cache",
        t.check("compressed cache", &widen(&caches.compressed), &comp),
    ));
    // The rows this step wrote on their own too: a wrong row must not hide in the cache's
    // share allowance.
    let got = widen(&caches.compressed);
    let slots_written: Vec<usize> = gw.compressed.slots.iter().flatten().copied().collect();
    checks.push((
        "compressed rows written",
        t.check(
            "compressed rows written",
            &rows_at(&got, &slots_written, hd),
            &widen(&gw.compressed.rows),
        ),
    ));
    let iw = csa.index_cache.width;
    let (mut iq, mut is) = (csa.index_cache.q.clone(), csa.index_cache.scale.clone());
    for (k, &s) in gw.index_write.slots.iter().enumerate() {
        iq[s * iw..(s + 1) * iw].copy_from_slice(&gw.index_write.q[k * iw..(k + 1) * iw]);
        is[s] = gw.index_write.scale[k];
    }
    let deq = |q: &[i8], s: &[f32]| -> Vec<f32> {
        q.iter()
            .enumerate()
            .map(|(i, &v)| f32::from(v) * s.get(i / iw.max(1)).copied().unwrap_or(f32::NAN))
            .collect()
    };
    checks.push((
        "index rows",
        t.check(
            "index rows",
            &deq(&caches.index_q, &caches.index_scale),
            &deq(&iq, &is),
        ),
    ));
    checks.push((
        "index scales",
        t.check("index scales", &caches.index_scale, &is),
    ));
    let got = deq(&caches.index_q, &caches.index_scale);
    let want = deq(&iq, &is);
    let slots = &gw.index_write.slots;
    checks.push((
        "index rows written",
        t.check(
            "index rows written",
            &rows_at(&got, slots, iw),
            &rows_at(&want, slots, iw),
        ),
    ));
    let ring_wide = |s: &super::fixture::OverlapState| 2 * s.width;
    let float = |q: &[i8]| -> Vec<f32> { q.iter().map(|&v| f32::from(v)).collect() };
    checks.push((
        "unwritten rows",
        unwritten_rows(&[
            (
                "ring kv",
                caches.ring_kv.clone(),
                csa.state.kv.clone(),
                gw.state_write.slots.clone(),
                ring_wide(&csa.state),
            ),
            (
                "ring score",
                caches.ring_score.clone(),
                csa.state.score.clone(),
                gw.state_write.slots.clone(),
                ring_wide(&csa.state),
            ),
            (
                "index ring kv",
                caches.index_ring_kv.clone(),
                csa.index_state.kv.clone(),
                gw.index_state_write.slots.clone(),
                ring_wide(&csa.index_state),
            ),
            (
                "index ring score",
                caches.index_ring_score.clone(),
                csa.index_state.score.clone(),
                gw.index_state_write.slots.clone(),
                ring_wide(&csa.index_state),
            ),
            (
                "compressed cache",
                widen(&caches.compressed),
                widen(&csa.cache.rows),
                slots_written.clone(),
                hd,
            ),
            (
                "index rows",
                float(&caches.index_q),
                float(&csa.index_cache.q),
                slots.clone(),
                iw,
            ),
            (
                "index scales",
                caches.index_scale.clone(),
                csa.index_cache.scale.clone(),
                slots.clone(),
                1,
            ),
        ]),
    ));
    checks
}

/// The CSA indexer's choices at step level: each token's candidates as the step's planning
/// task wrote them (`picks`, [`super::runner::AttnStepOutput::csa_picks`]) against the
/// golden's top-k of its visible rows (`g`). The same count, and the same rows except where
/// the golden's scores at the cut are too close to tell apart at int8 precision: a row in one
/// set only must score within 2% of the token's largest |score| of the golden's cut (as the
/// indexer's component test allows). `max_rows` is the compressed cache's rows per sequence.
/// The outcome counts the candidates compared and those swapped at the cut.
pub fn csa_pick_check(
    g: &super::golden::AttnStep,
    picks: &[i32],
    max_rows: usize,
) -> Result<Outcome, String> {
    let what = "indexer picks";
    let Some(gw) = g.csa.as_ref() else {
        return Err(format!("{what}: the golden step made no CSA picks"));
    };
    let tokens = gw.picks.len();
    if tokens == 0 || !picks.len().is_multiple_of(tokens) {
        return Err(format!(
            "{what}: {} candidates for {tokens} tokens",
            picks.len()
        ));
    }
    let width = picks.len() / tokens;
    let mut out = Outcome {
        n: 0,
        over: 0,
        worst: 0,
        worst_value: 0.0,
    };
    for (t, (pick, row)) in gw.picks.iter().zip(picks.chunks(width)).enumerate() {
        if !g.real.get(t).copied().unwrap_or(true) {
            // A padding row's picks mean nothing.
            continue;
        }
        let seq = t / super::TOKENS_PER_SEQ;
        let base = (seq * max_rows) as i64;
        let mut got = Vec::with_capacity(pick.selected.len());
        for &v in row.iter().filter(|&&v| v >= 0) {
            let r = i64::from(v) - base;
            if !(0..pick.visible as i64).contains(&r) {
                return Err(format!(
                    "{what}: token {t} picked slot {v}, not one of its sequence's {} visible rows",
                    pick.visible
                ));
            }
            got.push(r as usize);
        }
        if got.len() != pick.selected.len() {
            return Err(format!(
                "{what}: token {t} picked {} rows, the golden {}",
                got.len(),
                pick.selected.len()
            ));
        }
        let top = pick.scores.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let cut = pick.selected.last().map_or(0.0, |&r| pick.scores[r]);
        let only_one = got
            .iter()
            .filter(|r| !pick.selected.contains(r))
            .chain(pick.selected.iter().filter(|r| !got.contains(r)));
        for &r in only_one {
            let off = (pick.scores[r] - cut).abs();
            if off > 2e-2 * top {
                return Err(format!(
                    "{what}: token {t} row {r} (golden score {}) is in one top-{} only, {off:.3e} from the cut {cut} (allowed {:.3e})",
                    pick.scores[r],
                    pick.selected.len(),
                    2e-2 * top
                ));
            }
            out.over += 1;
            if off > out.worst_value {
                out.worst_value = off;
                out.worst = t;
            }
        }
        out.n += got.len();
    }
    // Each swap was counted from both sides.
    out.over /= 2;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reldiff_passes_small_and_fails_large_differences() {
        let t = RelDiff::SWA_HCA;
        // Absolute below thd: passes however small the values.
        assert!(t.rdiff(1e-4, 2e-3) < t.thd);
        // 0.1% relative on a large value passes, 1% fails.
        assert!(t.rdiff(100.0, 100.1) <= t.thd);
        assert!(t.rdiff(100.0, 101.0) > t.thd);
        let e: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let mut a = e.clone();
        for v in a.iter_mut().skip(100).take(8) {
            *v *= 1.5;
        }
        assert!(t.check("x", &a, &e).is_ok(), "8 of 1000 over is 0.8%");
        a[500] = f32::NAN;
        let err = t.check("x_out", &a, &e).unwrap_err();
        assert!(err.contains("x_out") && err.contains("[500]"), "{err}");
        assert!(t.check("x", &a[..10], &e).is_err());
    }

    #[test]
    fn bf16_intermediates_are_judged_at_their_rows_scale() {
        // Unit-RMS rows with some small values, as a roped `q` has.
        let e: Vec<f32> = (0..1000)
            .map(|i| if i % 10 == 0 { 0.01 } else { 1.05 })
            .collect();
        let t = CacheTol::bf16_intermediate(&e);
        assert!((t.atol - 1.0 / 128.0).abs() < 1e-3, "{}", t.atol);
        // One bf16 ulp at the row's scale on every small value passes (the output threshold
        // would count each of them).
        let mut a = e.clone();
        for v in a.iter_mut().step_by(10) {
            *v += 1.0 / 128.0;
        }
        assert!(t.check("q", &a, &e).is_ok());
        assert!(RelDiff::SWA_HCA.check("q", &a, &e).is_err());
        // Four ulps on 1% of the values is a wrong result.
        let mut a = e.clone();
        for v in a.iter_mut().skip(1).step_by(100) {
            *v += 4.0 / 128.0;
        }
        assert!(t.check("q", &a, &e).unwrap_err().contains("q"));
    }

    #[test]
    fn cache_tolerance_counts_elements_outside() {
        let t = CacheTol::KV;
        let e = vec![1.0f32; 1000];
        let mut a = e.clone();
        a[3] = 1.0 + 1.0 / 128.0; // exactly at rtol·|e| (+ atol): inside
        assert_eq!(t.check("kv", &a, &e).unwrap().over, 0);
        a[4] = 1.02;
        a[5] = 0.9;
        assert_eq!(
            t.check("kv", &a, &e).unwrap().over,
            2,
            "0.2% outside is allowed"
        );
        for v in &mut a[6..10] {
            *v = 1.1;
        }
        let o = t.check("kv", &a, &e).unwrap_err();
        assert!(o.contains("6 of 1000"), "{o}");
    }
}
