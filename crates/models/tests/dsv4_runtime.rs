//! The DeepSeek-V4 SWA and HCA decode steps on the runtime (2 CPU cores) against the
//! independent golden: the new residual with the spec's tolerance, and every cache the step
//! writes (window cache; HCA compressor state and compressed cache) read back whole from the
//! worker and compared with the fixture's caches plus the golden's writes. Small shapes with
//! the mixed starts `[0, 3, 127, 8192]` (an empty window at 0, a ratio-128 window closed at
//! 127, a full window at 8192), and FLASH shapes at start 8192.

mod common;

use simpler_core::{CallConfig, Worker};
use simpler_kernels_cpu::{I8Layout, I8Path, Isa, with_isa};
use simpler_models::dsv4::check::attn_step_checks;
use simpler_models::dsv4::fixture::{
    AttnWeights, HcaParts, StepInputs, WindowCache, generate_attn_weights, generate_hca,
    generate_inputs, generate_window_cache,
};
use simpler_models::dsv4::golden::{self, AttnStep};
use simpler_models::dsv4::int8_layout::{Int8Use, kernel_layout};
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
    hca: Option<HcaParts>,
    inputs: StepInputs,
}

fn case(cfg: Dsv4Config, starts: &[usize], hca: bool, seed: u64) -> Case {
    Case {
        batch: starts.len(),
        attn: generate_attn_weights(&cfg, seed),
        window: generate_window_cache(&cfg, starts, seed),
        hca: hca.then(|| generate_hca(&cfg, starts, seed)),
        inputs: generate_inputs(&cfg, starts, seed),
        cfg,
    }
}

fn golden_step(c: &Case) -> AttnStep {
    match &c.hca {
        Some(h) => golden::hca_step(&c.cfg, &c.attn, &c.window, h, &c.inputs),
        None => golden::swa_step(&c.cfg, &c.attn, &c.window, &c.inputs),
    }
}

/// Runs the step on the worker and checks the residual, the intermediates and every cache
/// against the golden.
fn run_and_check(c: &Case, w: &Worker, g: &AttnStep) {
    let mut layer =
        AttnLayer::upload(w, &c.cfg, &c.attn, &c.window, c.hca.as_ref(), c.batch).unwrap();
    let out = layer.step(w, &c.inputs, &CallConfig::default()).unwrap();
    let caches = layer.read_caches().unwrap();
    let checks = attn_step_checks(&c.window, c.hca.as_ref(), g, &out, &caches);
    assert_eq!(checks.len(), if c.hca.is_some() { 12 } else { 7 });
    for (what, r) in checks {
        if let Err(e) = r {
            panic!("{what}: {e}");
        }
    }
    // The checks see one wrong written row, which a whole cache's share allowance can hide
    // (the window's does at every preset; the compressed cache's at small and FLASH): shift
    // the first window row the step wrote, and the first compressed row (HCA).
    let hd = c.cfg.head_dim;
    let failed = |bad: &simpler_models::dsv4::runner::AttnCaches| -> Vec<&'static str> {
        attn_step_checks(&c.window, c.hca.as_ref(), g, &out, bad)
            .into_iter()
            .filter(|(_, o)| o.is_err())
            .map(|(w, _)| w)
            .collect()
    };
    let shift = |rows: &mut [half::bf16], slot: usize| {
        for v in &mut rows[slot * hd..(slot + 1) * hd] {
            *v = half::bf16::from_f32(v.to_f32() + 0.5);
        }
    };
    let slot = g
        .window_write
        .slots
        .iter()
        .flatten()
        .next()
        .copied()
        .unwrap();
    let mut bad = caches.clone();
    shift(&mut bad.window, slot);
    assert_eq!(failed(&bad), ["window rows written"]);
    if let Some(&slot) = g
        .compressed_write
        .as_ref()
        .and_then(|w| w.slots.iter().flatten().next())
    {
        let mut bad = caches.clone();
        shift(&mut bad.compressed, slot);
        let failed = failed(&bad);
        assert!(
            failed.contains(&"compressed rows written") && failed.len() <= 2,
            "{failed:?}"
        );
    }
    // A second identical step rewrites the same rows, so it gives the same residual — unless
    // a token closed a compressor window: the next window's first token then overwrote a
    // state row the closing token pooled.
    if g.compressed_write
        .as_ref()
        .is_none_or(|w| w.slots.is_empty())
    {
        let again = layer.step(w, &c.inputs, &CallConfig::default()).unwrap();
        assert!(again.x_out == out.x_out, "a replayed step is deterministic");
    }
}

/// Runs the case on every kernel path this CPU has (chosen process-wide: the kernels run on
/// the worker's threads) against its golden, then restores the default path. The caller holds
/// `common::process_isa::switching_paths()`.
fn check_on_every_path(c: &Case, g: &AttnStep) {
    let w = worker(2);
    for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
        assert!(simpler_kernels_cpu::set_process_isa(Some(isa)));
        run_and_check(c, &w, g);
    }
    assert!(simpler_kernels_cpu::set_process_isa(None));
    with_isa(Isa::Portable, || ()).unwrap();
}

#[test]
fn swa_step_matches_the_golden_at_mixed_starts_on_every_path() {
    let _switching = common::process_isa::switching_paths();
    let c = case(Dsv4Config::small(), &MIXED_STARTS, false, 11);
    let g = golden_step(&c);
    check_on_every_path(&c, &g);
}

#[test]
fn hca_step_matches_the_golden_at_mixed_starts_on_every_path() {
    let _switching = common::process_isa::switching_paths();
    let c = case(Dsv4Config::small(), &MIXED_STARTS, true, 12);
    let g = golden_step(&c);
    let cw = g.compressed_write.as_ref().unwrap();
    assert_eq!(
        cw.slots.len(),
        1,
        "position 127 closes the only window of the step"
    );
    check_on_every_path(&c, &g);
}

/// Eight sequences (16 token rows): the attention's int8 products then run on AMX-INT8 tiles
/// where the machine has them, and their weights go up packed; at four sequences (8 rows, the
/// other tests) they run on the AVX-512 VNNI lane-wise kernel and go up interleaved (row-major
/// on machines without AVX-512 VNNI). Either way the step
/// matches the golden, so the upload and the kernels agree on the layout.
#[test]
fn swa_step_of_eight_sequences_matches_the_golden_in_its_int8_layout() {
    let _isa = common::process_isa::same_path_throughout();
    let layout = kernel_layout(Int8Use::Attention { rows: 16 });
    let amx = I8Path::detected() == I8Path::Amx;
    assert_eq!(
        layout == I8Layout::Packed,
        amx,
        "16 rows pack only on AMX-INT8"
    );
    let vnni512 = matches!(I8Path::detected(), I8Path::Amx | I8Path::Avx512Vnni);
    assert_eq!(
        kernel_layout(Int8Use::Attention { rows: 8 }),
        if vnni512 {
            I8Layout::Interleaved
        } else {
            I8Layout::RowMajor
        },
        "8 rows run on the AVX-512 VNNI lane-wise kernel, which reads interleaved weights"
    );
    eprintln!("attention int8 weights at 16 rows: {layout:?}");
    let c = case(
        Dsv4Config::small(),
        &[0, 3, 127, 8192, 1, 64, 128, 300],
        false,
        14,
    );
    run_and_check(&c, &worker(2), &golden_step(&c));
}

#[test]
fn tiny_layers_match_the_golden_with_windows_sliding_inside_the_step() {
    let _isa = common::process_isa::same_path_throughout();
    // Window 8: every sequence but the first has a full, sliding window.
    for hca in [false, true] {
        let c = case(Dsv4Config::tiny(), &[0, 7, 126, 300], hca, 13);
        run_and_check(&c, &worker(2), &golden_step(&c));
    }
}

#[test]
fn flash_swa_step_matches_the_golden_at_start_8192() {
    let _isa = common::process_isa::same_path_throughout();
    let c = case(Dsv4Config::flash(), &uniform_starts(8192), false, 21);
    run_and_check(&c, &worker(2), &golden_step(&c));
}

#[test]
fn flash_hca_step_matches_the_golden_at_start_8192() {
    let _isa = common::process_isa::same_path_throughout();
    let c = case(Dsv4Config::flash(), &uniform_starts(8192), true, 22);
    run_and_check(&c, &worker(2), &golden_step(&c));
}

#[test]
fn malformed_inputs_are_refused_naming_the_field() {
    let c = case(Dsv4Config::tiny(), &[0, 1, 2, 3], true, 14);
    let w = worker(1);
    let mut bad = c.attn.clone();
    bad.wo_b.scale.pop();
    let e = AttnLayer::upload(&w, &c.cfg, &bad, &c.window, c.hca.as_ref(), 4).unwrap_err();
    assert!(e.to_string().contains("wo_b.scale"), "{e}");
    let mut layer = AttnLayer::upload(&w, &c.cfg, &c.attn, &c.window, c.hca.as_ref(), 4).unwrap();
    let mut inputs = c.inputs.clone();
    inputs.x_hc.pop();
    let e = layer.step(&w, &inputs, &CallConfig::default()).unwrap_err();
    assert!(e.to_string().contains("x_hc"), "{e}");
    let mut inputs = c.inputs.clone();
    inputs.starts[2] = c.cfg.max_position - 1;
    let e = layer.step(&w, &inputs, &CallConfig::default()).unwrap_err();
    assert!(e.to_string().contains("starts[2]"), "{e}");
}
