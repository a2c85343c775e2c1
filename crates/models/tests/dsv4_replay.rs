//! DeepSeek-V4 attention steps replayed from a captured graph against the same steps
//! orchestrated: two copies of one layer run the same sequence of decode steps, positions
//! advancing two per step through ratio-4 and ratio-128 compression boundaries and out of an
//! empty window, one copy replaying its first step's graph and the other running the
//! orchestration every step. Every output and every cache must agree bit for bit, and the
//! reports must say which steps were captured and which replayed.

mod common;

use half::bf16;
use simpler_core::{CallConfig, GraphMode, Worker};
use simpler_models::dsv4::fixture::{
    generate_attn_weights, generate_csa, generate_hca, generate_inputs, generate_window_cache,
};
use simpler_models::dsv4::{AttnLayer, AttnStepOutput, Dsv4Config, LayerKind, ops};

fn worker() -> Worker {
    let w = common::two_core_worker();
    ops::register(&w).unwrap();
    w
}

/// The first step's sequence starts: an empty window (0), one that fills (3), a ratio-128
/// window that closes at position 127 in the fourth step (121), and a full window (250).
const FIRST: [usize; 4] = [0, 3, 121, 250];
const STEPS: usize = 6;

fn starts(step: usize) -> Vec<usize> {
    FIRST.iter().map(|s| s + 2 * step).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bf16_bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Two copies of one layer (replay on, replay off) sized for every step's positions.
fn layers(w: &Worker, cfg: &Dsv4Config, kind: LayerKind, seed: u64) -> [AttnLayer; 2] {
    let last = starts(STEPS - 1);
    let attn = generate_attn_weights(cfg, seed);
    let window = generate_window_cache(cfg, &last, seed);
    let make = |replay: bool| {
        let mut l = match kind {
            LayerKind::Swa => AttnLayer::upload(w, cfg, &attn, &window, None, last.len()),
            LayerKind::Hca => {
                let h = generate_hca(cfg, &last, seed);
                AttnLayer::upload(w, cfg, &attn, &window, Some(&h), last.len())
            }
            LayerKind::Csa => {
                let c = generate_csa(cfg, &last, seed);
                AttnLayer::upload_csa(w, cfg, &attn, &window, &c, last.len())
            }
        }
        .unwrap();
        l.replay = replay;
        l
    };
    [make(true), make(false)]
}

fn assert_same_step(kind: LayerKind, step: usize, a: &AttnStepOutput, b: &AttnStepOutput) {
    for (what, x, y) in [
        ("q", &a.q, &b.q),
        ("attn", &a.attn, &b.attn),
        ("o_proj", &a.o_proj, &b.o_proj),
        ("x_out", &a.x_out, &b.x_out),
    ] {
        assert!(
            bits(x) == bits(y),
            "{kind:?} step {step}: the replayed {what} differs from the orchestrated one"
        );
    }
}

fn assert_same_caches(kind: LayerKind, a: &AttnLayer, b: &AttnLayer) {
    let (a, b) = (a.read_caches().unwrap(), b.read_caches().unwrap());
    assert!(
        bf16_bits(&a.window) == bf16_bits(&b.window),
        "{kind:?}: window caches differ"
    );
    assert!(bits(&a.state_kv) == bits(&b.state_kv), "{kind:?}: state kv");
    assert!(
        bits(&a.state_score) == bits(&b.state_score),
        "{kind:?}: state score"
    );
    assert!(
        bf16_bits(&a.compressed) == bf16_bits(&b.compressed),
        "{kind:?}: compressed cache"
    );
    assert_eq!(a.csa, b.csa, "{kind:?}: CSA rings and caches");
}

/// Runs every step on both copies; `retile` changes both copies' attention tiling before that
/// step (the replaying copy must then capture anew).
fn replay_matches_orchestration(kind: LayerKind, retile: Option<usize>) {
    let cfg = Dsv4Config::small();
    let w = worker();
    let [mut replayed, mut orchestrated] = layers(&w, &cfg, kind, 21);
    let call = CallConfig::default();
    let mut fingerprints = Vec::new();
    for step in 0..STEPS {
        if retile == Some(step) {
            for l in [&mut replayed, &mut orchestrated] {
                l.tiles.head_blocks = if l.tiles.head_blocks == 1 { 2 } else { 1 };
            }
        }
        let inputs = generate_inputs(&cfg, &starts(step), 100 + step as u64);
        let a = replayed.step(&w, &inputs, &call).unwrap();
        let b = orchestrated.step(&w, &inputs, &call).unwrap();
        assert_eq!(b.report.graph, GraphMode::Orchestrated);
        match &a.report.graph {
            GraphMode::Captured { fingerprint } => {
                assert!(
                    step == 0 || retile == Some(step),
                    "{kind:?} step {step} was captured again with an unchanged shape"
                );
                fingerprints.push(fingerprint.clone());
            }
            GraphMode::Replayed { fingerprint } => {
                assert!(step > 0 && retile != Some(step), "{kind:?} step {step}");
                assert_eq!(Some(fingerprint), fingerprints.last());
            }
            GraphMode::Orchestrated => panic!("{kind:?} step {step} was not captured"),
        }
        assert_same_step(kind, step, &a, &b);
    }
    assert_same_caches(kind, &replayed, &orchestrated);
    assert_eq!(fingerprints.len(), 1 + usize::from(retile.is_some()));
    if retile.is_some() {
        assert_ne!(
            fingerprints[0], fingerprints[1],
            "{kind:?}: another tiling is another graph"
        );
    }
    assert!(replayed.step_graph().is_some());
    assert!(orchestrated.step_graph().is_none());
}

#[test]
fn replayed_swa_steps_are_bit_identical_to_orchestrated_ones() {
    replay_matches_orchestration(LayerKind::Swa, None);
}

#[test]
fn replayed_hca_steps_are_bit_identical_to_orchestrated_ones() {
    replay_matches_orchestration(LayerKind::Hca, None);
}

#[test]
fn replayed_csa_steps_are_bit_identical_to_orchestrated_ones() {
    replay_matches_orchestration(LayerKind::Csa, None);
}

#[test]
fn a_retiled_layer_captures_its_new_graph_and_still_matches() {
    replay_matches_orchestration(LayerKind::Hca, Some(3));
}
