//! Padding rows (the spec's slot −1, `StepInputs::real_tokens`) in the DeepSeek-V4 SWA, HCA
//! and CSA decode steps on the runtime: a padding row is computed but writes nothing.
//!
//! Each case pads sequences whose padding rows, were they real, would write: a sequence with
//! no real token at a start that closes a ratio-4 and a ratio-128 window (127), one at a
//! start that closes a ratio-4 window (3), and one with one real token of two. The checks:
//! - every cache the step writes equals the fixture's plus the golden's writes, and the
//!   golden writes nothing for padding rows (so a kernel that wrote a padding row's window
//!   row, compressor state, compressed row or index row fails the whole-cache comparison);
//! - the real rows' outputs match the golden;
//! - the real rows' outputs are bit-identical to the same step with every row real (padding
//!   changes nothing else), and the captured graph of a full step replays a padded one.

mod common;

use simpler_core::{CallConfig, GraphMode, Worker};
use simpler_models::dsv4::check::{attn_step_checks, csa_cache_checks, csa_pick_check};
use simpler_models::dsv4::fixture::{
    AttnWeights, CsaParts, HcaParts, StepInputs, WindowCache, generate_attn_weights, generate_csa,
    generate_hca, generate_inputs, generate_window_cache,
};
use simpler_models::dsv4::golden::{self, AttnStep};
use simpler_models::dsv4::runner::{AttnCaches, AttnStepOutput};
use simpler_models::dsv4::{AttnLayer, Dsv4Config, LayerKind, TOKENS_PER_SEQ, ops};

fn worker() -> Worker {
    let w = common::two_core_worker();
    ops::register(&w).unwrap();
    w
}

/// Starts and real tokens: sequence 0 real throughout (its second row closes a ratio-4
/// window at 3); 1 and 2 all padding at starts that would close windows (127: ratio 4 and
/// 128; 3: ratio 4); 3 one real token of two.
const STARTS: [usize; 4] = [2, 127, 3, 11];
const REAL: [usize; 4] = [2, 0, 0, 1];

struct Case {
    cfg: Dsv4Config,
    kind: LayerKind,
    attn: AttnWeights,
    window: WindowCache,
    hca: Option<HcaParts>,
    csa: Option<CsaParts>,
    inputs: StepInputs,
}

fn case(cfg: Dsv4Config, kind: LayerKind, seed: u64) -> Case {
    let mut inputs = generate_inputs(&cfg, &STARTS, seed);
    inputs.real_tokens = REAL.to_vec();
    Case {
        attn: generate_attn_weights(&cfg, seed),
        window: generate_window_cache(&cfg, &STARTS, seed),
        hca: (kind == LayerKind::Hca).then(|| generate_hca(&cfg, &STARTS, seed)),
        csa: (kind == LayerKind::Csa).then(|| generate_csa(&cfg, &STARTS, seed)),
        inputs,
        kind,
        cfg,
    }
}

impl Case {
    fn golden(&self, inputs: &StepInputs) -> AttnStep {
        match self.kind {
            LayerKind::Swa => golden::swa_step(&self.cfg, &self.attn, &self.window, inputs),
            LayerKind::Hca => golden::hca_step(
                &self.cfg,
                &self.attn,
                &self.window,
                self.hca.as_ref().unwrap(),
                inputs,
            ),
            LayerKind::Csa => golden::csa_step(
                &self.cfg,
                &self.attn,
                &self.window,
                self.csa.as_ref().unwrap(),
                inputs,
            ),
        }
    }

    fn upload(&self, w: &Worker) -> AttnLayer {
        let b = STARTS.len();
        match &self.csa {
            Some(c) => AttnLayer::upload_csa(w, &self.cfg, &self.attn, &self.window, c, b),
            None => AttnLayer::upload(w, &self.cfg, &self.attn, &self.window, self.hca.as_ref(), b),
        }
        .unwrap()
    }

    fn step(&self, w: &Worker, inputs: &StepInputs) -> (AttnStepOutput, AttnCaches) {
        let mut layer = self.upload(w);
        let out = layer.step(w, inputs, &CallConfig::default()).unwrap();
        (out, layer.read_caches().unwrap())
    }
}

/// Every check of the step against the golden (which writes nothing for padding rows).
fn check(c: &Case, g: &AttnStep, out: &AttnStepOutput, caches: &AttnCaches) {
    let mut checks = attn_step_checks(&c.window, c.hca.as_ref(), g, out, caches);
    if let (Some(p), Some(cc)) = (&c.csa, &caches.csa) {
        checks.extend(csa_cache_checks(p, g, cc));
        checks.push((
            "indexer picks",
            csa_pick_check(g, &out.csa_picks, p.cache.max_rows),
        ));
    }
    for (what, r) in checks {
        if let Err(e) = r {
            panic!("{:?} with padding: {what}: {e}", c.kind);
        }
    }
}

/// The rows of `v` (one per token, `tokens` of them) of the real tokens.
fn real_rows<T: Copy>(v: &[T], tokens: usize, inputs: &StepInputs) -> Vec<T> {
    let w = v.len() / tokens;
    (0..tokens)
        .filter(|&t| !inputs.is_padding(t))
        .flat_map(|t| v[t * w..(t + 1) * w].iter().copied())
        .collect()
}

fn padding_writes_nothing_and_changes_no_real_row(kind: LayerKind) {
    let c = case(Dsv4Config::tiny(), kind, 43);
    let w = worker();
    let g = c.golden(&c.inputs);
    assert_eq!(
        g.real,
        [true, true, false, false, false, false, true, false],
        "the golden's real rows"
    );
    let (out, caches) = c.step(&w, &c.inputs);
    check(&c, &g, &out, &caches);

    // The golden writes nothing for padding rows, and the padding rows would write: with every
    // row real, the step writes more window rows and (HCA, CSA) compressed rows.
    let mut full = c.inputs.clone();
    full.real_tokens = vec![TOKENS_PER_SEQ; STARTS.len()];
    let gf = c.golden(&full);
    let written = |g: &AttnStep| g.window_write.slots.iter().flatten().count();
    assert_eq!((written(&g), written(&gf)), (3, 8));
    match kind {
        LayerKind::Swa => {}
        LayerKind::Hca => {
            let closed = |g: &AttnStep| g.compressed_write.as_ref().unwrap().slots.len();
            // 127 closes a ratio-128 window: only when its row is real.
            assert_eq!((closed(&g), closed(&gf)), (0, 1));
        }
        LayerKind::Csa => {
            let closed = |g: &AttnStep| g.csa.as_ref().unwrap().compressed.slots.len();
            // Real: 3 (sequence 0) and 11 (sequence 3). Full adds 127 and 3 (sequences 1
            // and 2).
            assert_eq!((closed(&g), closed(&gf)), (2, 4));
        }
    }

    // The same step with every row real: the real rows' outputs are bit-identical.
    let (out_full, _) = c.step(&w, &full);
    let t = c.inputs.n_tokens();
    let rows = |o: &AttnStepOutput| {
        (
            real_rows(&o.x_out, t, &c.inputs),
            real_rows(&o.q, t, &c.inputs),
            real_rows(&o.attn, t, &c.inputs),
        )
    };
    assert!(
        rows(&out) == rows(&out_full),
        "{kind:?}: a real row changed"
    );

    // A layer that captured a full step replays a padded one (the same shape: the slots are
    // data), bit for bit as a layer that orchestrates both steps.
    let (mut replayed, mut orchestrated) = (c.upload(&w), c.upload(&w));
    replayed.replay = true;
    let call = CallConfig::default();
    for l in [&mut replayed, &mut orchestrated] {
        l.step(&w, &full, &call).unwrap();
    }
    let a = replayed.step(&w, &c.inputs, &call).unwrap();
    let b = orchestrated.step(&w, &c.inputs, &call).unwrap();
    assert!(
        matches!(a.report.graph, GraphMode::Replayed { .. }),
        "{kind:?}: the padded step after a full one was not replayed: {:?}",
        a.report.graph
    );
    let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
    assert!(bits(&a.x_out) == bits(&b.x_out), "{kind:?}: replayed x_out");
    assert!(bits(&a.attn) == bits(&b.attn), "{kind:?}: replayed attn");
    assert_eq!(
        replayed.read_caches().unwrap(),
        orchestrated.read_caches().unwrap(),
        "{kind:?}: replayed caches"
    );
}

#[test]
fn swa_padding_rows_write_nothing() {
    padding_writes_nothing_and_changes_no_real_row(LayerKind::Swa);
}

#[test]
fn hca_padding_rows_write_nothing() {
    padding_writes_nothing_and_changes_no_real_row(LayerKind::Hca);
}

#[test]
fn csa_padding_rows_write_nothing() {
    padding_writes_nothing_and_changes_no_real_row(LayerKind::Csa);
}

#[test]
fn real_tokens_that_do_not_fit_are_refused_naming_the_field() {
    let c = case(Dsv4Config::tiny(), LayerKind::Swa, 5);
    let w = worker();
    let mut layer = c.upload(&w);
    let before = layer.read_caches().unwrap();
    for (real, want) in [
        (vec![2, 2, 3, 2], "real_tokens[2]: 3 real tokens"),
        (vec![2, 2, 2], "real_tokens: 3 sequences"),
    ] {
        let mut inputs = c.inputs.clone();
        inputs.real_tokens = real;
        let e = layer
            .step(&w, &inputs, &CallConfig::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
    }
    // Nothing ran: the caches are as uploaded, and the next step runs.
    let after = layer.read_caches().unwrap();
    assert!(after.window == before.window);
    let out = layer.step(&w, &c.inputs, &CallConfig::default()).unwrap();
    check(
        &c,
        &c.golden(&c.inputs),
        &out,
        &layer.read_caches().unwrap(),
    );
}
