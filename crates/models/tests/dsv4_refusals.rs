//! DeepSeek-V4 inputs that must be refused with an error naming what is wrong, leaving
//! everything as it was: starts past any position (generated fixtures; the fixture-file
//! loader's case is with its other refusals in `fixture_file.rs`), and
//! a step whose compressed rows do not fit the layer's cache (refused before anything is
//! written, the next step unaffected). And the `--check` comparisons fail an output with a
//! block of wrong columns, which a share of elements alone would pass.

mod common;

use simpler_core::CallConfig;
use simpler_models::dsv4::check::RelDiff;
use simpler_models::dsv4::fixture::{
    CompressedCache, IndexCache, generate_attn_weights, generate_csa, generate_hca,
    generate_inputs, generate_moe_weights, generate_window_cache,
};
use simpler_models::dsv4::golden::moe_step;
use simpler_models::dsv4::{
    AttnLayer, Dsv4Config, MIXED_STARTS, generate_fixture, ops, uniform_starts,
};

#[test]
fn a_generated_fixture_whose_start_overflows_is_refused() {
    let Err(e) = generate_fixture(&Dsv4Config::tiny(), &[usize::MAX], 1) else {
        panic!("a start at usize::MAX was accepted");
    };
    let e = e.to_string();
    assert!(e.contains("max_position"), "{e}");
}

/// The MoE check fails a step whose last 4.5% of columns are zero (one block of a projection
/// left unwritten), which the spec's 5% share alone passes; the golden's own output passes.
#[test]
fn the_moe_check_fails_a_block_of_wrong_columns() {
    let cfg = Dsv4Config::small();
    let w = generate_moe_weights(&cfg, 1);
    let inputs = generate_inputs(&cfg, &MIXED_STARTS, 1);
    let g = moe_step(&cfg, &w, cfg.n_hash_layers, &inputs);
    let d = cfg.hidden;
    let bad_cols = d * 45 / 1000;
    let corrupt = |v: &[f32]| -> Vec<f32> {
        let mut v = v.to_vec();
        for row in v.chunks_mut(d) {
            row[d - bad_cols..].fill(0.0);
        }
        v
    };
    for (what, v) in [("y", &g.y), ("routed", &g.routed)] {
        RelDiff::MOE.check_columns(what, v, v, d).unwrap();
        let bad = corrupt(v);
        // The share alone passes it ...
        RelDiff::MOE.check(what, &bad, v).unwrap();
        // ... the columns do not.
        let e = RelDiff::MOE.check_columns(what, &bad, v, d).unwrap_err();
        println!("{e}");
        assert!(e.contains(what) && e.contains("columns"), "{e}");
    }
}

/// Steps `layer` at `bad` starts and expects a refusal whose message holds every one of
/// `needles`, with the caches as they were; then a step at `good` starts runs.
fn refused_unchanged_then_runs(
    worker: &simpler_core::Worker,
    cfg: &Dsv4Config,
    layer: &mut AttnLayer,
    (bad, good): (usize, usize),
    needles: &[&str],
) {
    let before = layer.read_caches().unwrap();
    let e = layer
        .step(
            worker,
            &generate_inputs(cfg, &uniform_starts(bad), 1),
            &CallConfig::default(),
        )
        .expect_err("the step does not fit the cache")
        .to_string();
    assert!(needles.iter().all(|n| e.contains(n)), "{e}");
    assert_eq!(layer.read_caches().unwrap(), before, "{e}");
    layer
        .step(
            worker,
            &generate_inputs(cfg, &uniform_starts(good), 1),
            &CallConfig::default(),
        )
        .expect("a step that fits the cache");
}

/// The first `keep` of each sequence's `old` cache rows (`width` values each) of `v`.
fn first_rows<T: Copy>(v: &[T], old: usize, keep: usize, width: usize) -> Vec<T> {
    v.chunks(old * width)
        .flat_map(|seq| seq[..keep * width].to_vec())
        .collect()
}

/// An HCA step whose positions close a compressed row past the layer's cache is refused
/// before it runs, naming the position and the cache: the caches stay as they were, and a
/// step that fits runs afterwards.
#[test]
fn an_hca_step_past_its_compressed_cache_is_refused_before_it_writes() {
    let cfg = Dsv4Config::tiny();
    let starts = uniform_starts(255); // position 255 closes compressed row 1
    let w = generate_attn_weights(&cfg, 1);
    let window = generate_window_cache(&cfg, &starts, 1);
    let mut hca = generate_hca(&cfg, &starts, 1);
    let old = hca.cache.max_rows;
    hca.cache = CompressedCache {
        width: cfg.head_dim,
        max_rows: 1,
        rows: first_rows(&hca.cache.rows, old, 1, cfg.head_dim),
    };
    let worker = common::two_core_worker();
    ops::register(&worker).unwrap();
    let mut layer = AttnLayer::upload(&worker, &cfg, &w, &window, Some(&hca), starts.len())
        .expect("the cache's shape is consistent");
    // Positions 255 and 256 need row 1; positions 100 and 101 close no row.
    refused_unchanged_then_runs(
        &worker,
        &cfg,
        &mut layer,
        (255, 100),
        &["starts[0]", "hca", "1 rows"],
    );
}

/// The same for CSA's compressed (and index) cache.
#[test]
fn a_csa_step_past_its_compressed_cache_is_refused_before_it_writes() {
    let cfg = Dsv4Config::tiny();
    let starts = uniform_starts(63);
    let w = generate_attn_weights(&cfg, 1);
    let window = generate_window_cache(&cfg, &starts, 1);
    let mut csa = generate_csa(&cfg, &starts, 1);
    // Rows for positions up to 59 only: the step's tokens close row 15 (position 63).
    let keep = 15;
    let (hd, ihd, old) = (cfg.head_dim, cfg.index_head_dim, csa.cache.max_rows);
    csa.cache = CompressedCache {
        width: hd,
        max_rows: keep,
        rows: first_rows(&csa.cache.rows, old, keep, hd),
    };
    csa.index_cache = IndexCache {
        width: ihd,
        max_rows: keep,
        q: first_rows(&csa.index_cache.q, old, keep, ihd),
        scale: first_rows(&csa.index_cache.scale, old, keep, 1),
    };
    let worker = common::two_core_worker();
    ops::register(&worker).unwrap();
    let mut layer = AttnLayer::upload_csa(&worker, &cfg, &w, &window, &csa, starts.len())
        .expect("the caches' shapes are consistent");
    refused_unchanged_then_runs(
        &worker,
        &cfg,
        &mut layer,
        (63, 40),
        &["starts[0]", "csa", "15 rows"],
    );
}

/// A hash layer's table naming one expert twice in a token's row, or an expert past the
/// routed ones, is refused at upload (as the fixture loader refuses it), naming the token; a
/// layer that routes by score does not read the table.
#[test]
fn a_hash_table_naming_an_expert_twice_is_refused_at_upload() {
    use simpler_models::dsv4::moe_graph::{ExpertPlacement, MoeLayer};
    let cfg = Dsv4Config::tiny();
    assert!(cfg.n_hash_layers > 0 && cfg.n_activated_experts > 1);
    let worker = common::two_core_worker();
    ops::register(&worker).unwrap();
    let place = ExpertPlacement::single(cfg.n_routed_experts);
    let mut w = generate_moe_weights(&cfg, 1);
    let k = cfg.n_activated_experts;
    w.tid2eid[3 * k + 1] = w.tid2eid[3 * k];
    let e = MoeLayer::new(&worker, &cfg, &w, 0, place, 0)
        .err()
        .map(|e| e.to_string())
        .expect("a repeated expert is refused");
    assert!(
        e.contains("tid2eid") && e.contains("token 3") && e.contains("twice"),
        "{e}"
    );
    MoeLayer::new(&worker, &cfg, &w, cfg.n_hash_layers, place, 0)
        .expect("a score-routed layer does not read the table");
    w.tid2eid[3 * k + 1] = cfg.n_routed_experts as u32;
    let e = MoeLayer::new(&worker, &cfg, &w, 0, place, 0)
        .err()
        .map(|e| e.to_string())
        .expect("an expert past the routed ones is refused");
    assert!(e.contains("tid2eid") && e.contains("names expert"), "{e}");
}

/// A compressed cache claiming more rows than its slots (`i32`) can name is refused at upload,
/// naming the field, without overflowing the size checks.
#[test]
fn a_compressed_cache_past_i32_slots_is_refused_at_upload() {
    let cfg = Dsv4Config::tiny();
    let starts = uniform_starts(255);
    let w = generate_attn_weights(&cfg, 1);
    let window = generate_window_cache(&cfg, &starts, 1);
    let worker = common::two_core_worker();
    ops::register(&worker).unwrap();
    for rows in [1usize << 31, usize::MAX / 2] {
        let mut hca = generate_hca(&cfg, &starts, 1);
        hca.cache.max_rows = rows;
        let e = AttnLayer::upload(&worker, &cfg, &w, &window, Some(&hca), starts.len())
            .err()
            .map(|e| e.to_string())
            .expect("refused");
        assert!(e.contains("hca.cache"), "{rows}: {e}");
        let mut csa = generate_csa(&cfg, &starts, 1);
        csa.cache.max_rows = rows;
        csa.index_cache.max_rows = rows;
        let e = AttnLayer::upload_csa(&worker, &cfg, &w, &window, &csa, starts.len())
            .err()
            .map(|e| e.to_string())
            .expect("refused");
        assert!(e.contains("csa."), "{rows}: {e}");
    }
}
