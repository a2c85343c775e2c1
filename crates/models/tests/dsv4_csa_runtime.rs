//! The DeepSeek-V4 CSA decode step on the runtime (2 CPU cores) against the independent
//! golden (`golden::csa_step`): the new residual with the CSA tolerance, and every cache the
//! step writes — window cache, both compressors' rings, the compressed rows, the index rows
//! (int8 and scale) — read back whole from the worker and compared with the fixture's caches
//! plus the golden's writes. Small shapes at the mixed starts (ratio-4 windows closed inside
//! the step at 3 and 127, start 0 with fewer visible rows than the top-k), at starts whose
//! visible rows outnumber the top-k (so the selection matters), tiny shapes with sliding
//! windows, and FLASH shapes at start 8192 (2048 visible rows, top-512).

mod common;

use half::bf16;
use simpler_core::{CallConfig, Worker};
use simpler_models::dsv4::check::{CacheTol, RelDiff, csa_cache_checks, csa_pick_check};
use simpler_models::dsv4::fixture::{
    AttnWeights, CsaParts, StepInputs, WindowCache, generate_attn_weights, generate_csa,
    generate_inputs, generate_window_cache,
};
use simpler_models::dsv4::golden::{self, AttnStep};
use simpler_models::dsv4::{AttnLayer, Dsv4Config, MIXED_STARTS, ops, uniform_starts};

fn worker(cores: usize) -> Worker {
    let w = common::cpu_worker(cores);
    ops::register(&w).unwrap();
    w
}

struct Case {
    cfg: Dsv4Config,
    /// Sequences in the step.
    batch: usize,
    attn: AttnWeights,
    window: WindowCache,
    csa: CsaParts,
    inputs: StepInputs,
}

fn case(cfg: Dsv4Config, starts: &[usize], seed: u64) -> Case {
    Case {
        batch: starts.len(),
        attn: generate_attn_weights(&cfg, seed),
        window: generate_window_cache(&cfg, starts, seed),
        csa: generate_csa(&cfg, starts, seed),
        inputs: generate_inputs(&cfg, starts, seed),
        cfg,
    }
}

fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Runs the step on the worker and checks the residual and every cache against the golden.
/// The caller holds `common::process_isa` (its last check compares two steps bit for bit).
fn run_and_check(c: &Case, w: &Worker) {
    let g: AttnStep = golden::csa_step(&c.cfg, &c.attn, &c.window, &c.csa, &c.inputs);
    let mut layer = AttnLayer::upload_csa(w, &c.cfg, &c.attn, &c.window, &c.csa, c.batch).unwrap();
    let out = layer.step(w, &c.inputs, &CallConfig::default()).unwrap();
    RelDiff::CSA.check("x_out", &out.x_out, &g.x_out).unwrap();
    let caches = layer.read_caches().unwrap();
    let hd = c.cfg.head_dim;
    let mut want = widen(&c.window.rows);
    for (slot, row) in g
        .window_write
        .slots
        .iter()
        .zip(g.window_write.rows.chunks(hd))
    {
        let s = slot.expect("every step position has a page");
        want[s * hd..(s + 1) * hd].copy_from_slice(&widen(row));
    }
    CacheTol::KV
        .check("window cache", &widen(&caches.window), &want)
        .unwrap();
    let cc = caches.csa.as_ref().expect("CSA caches");
    for (what, outcome) in csa_cache_checks(&c.csa, &g, cc) {
        if let Err(e) = outcome {
            panic!("{what}: {e}");
        }
    }
    // The indexer's choices, token by token, against the golden's top-k.
    let max_rows = c.csa.cache.max_rows;
    let picked = csa_pick_check(&g, &out.csa_picks, max_rows).unwrap();
    let gw = g.csa.as_ref().unwrap();
    let want: usize = gw.picks.iter().map(|p| p.selected.len()).sum();
    assert_eq!(picked.n, want);
    // The check sees a wrong choice: a token with more visible rows than its top-k gets its
    // best row replaced by its worst one (far from the cut unless the scores are flat).
    let width = out.csa_picks.len() / gw.picks.len();
    let worst_of =
        |p: &golden::IndexPick| (0..p.visible).min_by(|&a, &b| p.scores[a].total_cmp(&p.scores[b]));
    let far = gw.picks.iter().enumerate().find_map(|(t, p)| {
        let (&best, worst) = (p.selected.first()?, worst_of(p)?);
        (p.visible > p.selected.len()
            && p.scores[best] - p.scores[worst] > 0.1 * p.scores[best].abs())
        .then_some((t, p, worst))
    });
    if let Some((t, p, worst)) = far {
        let base = (t / simpler_models::dsv4::TOKENS_PER_SEQ * max_rows) as i32;
        let mut bad = out.csa_picks.clone();
        let row = &mut bad[t * width..(t + 1) * width];
        let at = row
            .iter()
            .position(|&v| v == base + p.selected[0] as i32)
            .unwrap();
        row[at] = base + worst as i32;
        let e = csa_pick_check(&g, &bad, max_rows).unwrap_err();
        assert!(e.contains(&format!("token {t} row")), "{e}");
    }
    // The checker sees a wrong written row: shift the first compressed row the step wrote.
    if let Some(Some(slot)) = g.csa.as_ref().and_then(|w| w.compressed.slots.first()) {
        let mut bad = cc.clone();
        for v in &mut bad.compressed[slot * hd..(slot + 1) * hd] {
            *v = bf16::from_f32(v.to_f32() + 0.5);
        }
        let failed: Vec<&str> = csa_cache_checks(&c.csa, &g, &bad)
            .into_iter()
            .filter(|(_, o)| o.is_err())
            .map(|(w, _)| w)
            .collect();
        assert_eq!(failed, ["compressed rows written"]);
    }
    // The same step on a fresh upload gives the same bits (a replay on this layer would not:
    // its rings have moved on).
    let mut fresh = AttnLayer::upload_csa(w, &c.cfg, &c.attn, &c.window, &c.csa, c.batch).unwrap();
    let again = fresh.step(w, &c.inputs, &CallConfig::default()).unwrap();
    assert_eq!(again.x_out, out.x_out, "a step is deterministic");
}

#[test]
fn csa_step_matches_the_golden_at_mixed_starts_on_every_path() {
    let c = case(Dsv4Config::small(), &MIXED_STARTS, 31);
    let g = golden::csa_step(&c.cfg, &c.attn, &c.window, &c.csa, &c.inputs);
    let gw = g.csa.as_ref().unwrap();
    // Positions 3 and 127 close ratio-4 windows inside the step; start 0 sees no compressed
    // row and start 3 fewer than the top-k.
    assert_eq!(gw.compressed.slots.len(), 2);
    assert_eq!(gw.picks[0].visible, 0);
    assert!(gw.picks[2].visible < c.cfg.index_topk);
    let _switching = common::process_isa::switching_paths();
    let w = worker(2);
    for isa in simpler_kernels_cpu::Isa::ALL
        .into_iter()
        .filter(|i| i.is_supported())
    {
        // The kernels run on the worker's threads: the process-wide choice reaches them.
        assert!(simpler_kernels_cpu::set_process_isa(Some(isa)));
        run_and_check(&c, &w);
    }
    assert!(simpler_kernels_cpu::set_process_isa(None));
}

#[test]
fn csa_step_matches_the_golden_where_the_selection_matters() {
    let _isa = common::process_isa::same_path_throughout();
    // small: top-16 of 32..256 visible rows; 130 and 1023 close windows inside the step.
    let c = case(Dsv4Config::small(), &[126, 130, 67, 1023], 32);
    let g = golden::csa_step(&c.cfg, &c.attn, &c.window, &c.csa, &c.inputs);
    let picks = &g.csa.as_ref().unwrap().picks;
    assert!(picks.iter().all(|p| p.visible > c.cfg.index_topk));
    run_and_check(&c, &worker(2));
}

/// Eight sequences (16 token rows): the query, indexer and output int8 products run on
/// AMX-INT8 tiles where the machine has them, on weights uploaded packed
/// (`int8_layout::kernel_layout`); the step still matches the golden.
#[test]
fn csa_step_of_eight_sequences_matches_the_golden_in_its_int8_layout() {
    let _isa = common::process_isa::same_path_throughout();
    let c = case(
        Dsv4Config::small(),
        &[0, 3, 127, 8192, 1, 64, 130, 1023],
        35,
    );
    run_and_check(&c, &worker(2));
}

#[test]
fn tiny_csa_layers_match_the_golden_with_windows_sliding_inside_the_step() {
    let _isa = common::process_isa::same_path_throughout();
    let c = case(Dsv4Config::tiny(), &[0, 7, 126, 300], 33);
    run_and_check(&c, &worker(2));
}

#[test]
fn flash_csa_step_matches_the_golden_at_start_8192() {
    let _isa = common::process_isa::same_path_throughout();
    let c = case(Dsv4Config::flash(), &uniform_starts(8192), 34);
    run_and_check(&c, &worker(2));
}

/// Seed 1 is `run dsv4`'s default fixture: here the residual is the most sensitive to how the
/// attention rounds (an `attn` a few ulps off flips the int8 rounding of some `o_proj` input
/// rows); a kernel with a per-tile rescale of `out` put 3.8% of `x_out` over the tolerance.
#[test]
fn flash_csa_step_matches_the_golden_at_mixed_starts() {
    let _isa = common::process_isa::same_path_throughout();
    let c = case(Dsv4Config::flash(), &MIXED_STARTS, 1);
    run_and_check(&c, &worker(2));
}

#[test]
fn malformed_csa_parts_are_refused_naming_the_tensor() {
    let c = case(Dsv4Config::tiny(), &[0, 1, 2, 3], 35);
    let w = worker(1);
    let mut bad = c.csa.clone();
    bad.wq_idx.scale.pop();
    let e = AttnLayer::upload_csa(&w, &c.cfg, &c.attn, &c.window, &bad, 4).unwrap_err();
    assert!(e.to_string().contains("csa.wq_idx.scale"), "{e}");
    let mut bad = c.csa.clone();
    bad.index_state.kv.pop();
    let e = AttnLayer::upload_csa(&w, &c.cfg, &c.attn, &c.window, &bad, 4).unwrap_err();
    assert!(e.to_string().contains("csa.index_state.kv"), "{e}");
}
