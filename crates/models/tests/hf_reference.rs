//! The external reference: small random Qwen3 checkpoints written by `transformers` (both
//! `config.json` layouts, tied and untied heads, YaRN and linear RoPE, bf16 and f32 storage, a
//! sharded file) with `transformers`' fp32 logits recorded beside them by
//! `tools/qwen3_hf_reference.py`. Each is loaded, prefilled in chunks and decoded on the
//! runtime, teacher-forced with the reference's tokens, and every position's logits are
//! compared: relative L2 error, cosine, and argmax (a different id only where the reference
//! logits of both ids are within the tolerance of each other, a near-tie).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::SafeTensors;
use simpler_core::{CallConfig, Worker};
use simpler_models::qwen3::golden::PrefillChunk;
use simpler_models::qwen3::{
    KvBuffers, LoadOptions, PagedBatch, Qwen3Config, Qwen3Weights, ResidentModel, RopeScaling,
    Session, load_checkpoint, ops,
};

/// Relative L2 error allowed per row: bf16 activations at the spec's cast points against an
/// fp32 run of the same weights (`transformers`' own bf16 run differs from its fp32 one by
/// about as much).
const MAX_REL_L2: f64 = 3e-2;
/// Smallest cosine similarity allowed per row.
const MIN_COSINE: f64 = 0.999;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

struct Reference {
    tokens: Vec<u32>,
    logits: Vec<f32>,
    prompt_len: usize,
}

fn reference(dir: &Path) -> Reference {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let prompt_len = meta.metadata().as_ref().unwrap()["prompt_len"]
        .parse()
        .unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tokens = st
        .tensor("tokens")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let logits = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Reference {
        tokens,
        logits,
        prompt_len,
    }
}

/// Relative L2 error and cosine of `a` against the reference `e`.
fn agreement(a: &[f32], e: &[f32]) -> (f64, f64) {
    let (mut d2, mut e2, mut a2, mut ae) = (0f64, 0f64, 0f64, 0f64);
    for (&a, &e) in a.iter().zip(e) {
        let (a, e) = (a as f64, e as f64);
        d2 += (a - e) * (a - e);
        e2 += e * e;
        a2 += a * a;
        ae += a * e;
    }
    ((d2 / e2).sqrt(), ae / (a2.sqrt() * e2.sqrt()))
}

fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// Checks one row; returns whether the argmax matched exactly.
fn check_row(case: &str, pos: usize, got: &[f32], want: &[f32]) -> bool {
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{case} position {pos}: non-finite logits"
    );
    let (rel, cos) = agreement(got, want);
    eprintln!("{case} position {pos}: relative L2 {rel:.2e}, cosine {cos:.6}");
    assert!(
        rel <= MAX_REL_L2 && cos >= MIN_COSINE,
        "{case} position {pos}: relative L2 {rel:.3e} (max {MAX_REL_L2}), cosine {cos:.6} (min {MIN_COSINE})"
    );
    let (a, e) = (argmax(got), argmax(want));
    if a != e {
        // A near-tie: the reference rates our choice within the row's tolerance of its own.
        let scale =
            (want.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
        let gap = (want[e] - want[a]) as f64;
        assert!(
            gap <= 4.0 * MAX_REL_L2 * scale,
            "{case} position {pos}: argmax {a} vs reference {e}, a gap of {gap:.4} in the reference (row rms {scale:.4})"
        );
    }
    a == e
}

fn worker() -> Worker {
    let w = common::two_core_worker();
    ops::register(&w).unwrap();
    w
}

/// A worker and a session over `weights` with one sequence's block table covering `total`
/// tokens (its length `len`).
fn session(weights: &Qwen3Weights, len: usize, total: usize) -> (Worker, Session, PagedBatch) {
    let w = worker();
    let batch = PagedBatch::identity(vec![len], total, 128);
    let model =
        ResidentModel::upload(&w, weights, batch.max_blocks * batch.page_size, None).unwrap();
    let kv = KvBuffers::new(&w, &weights.config, batch.num_pages(), batch.page_size).unwrap();
    let s = Session::new(&w, Arc::new(model), kv);
    (w, s, batch)
}

/// Prefill of the prompt in chunks of `chunk`, then teacher-forced decode of the reference's
/// continuation; every position from the prompt's last on is compared.
fn run_case(name: &str, chunk: usize) -> (usize, usize) {
    let dir = fixtures().join(name);
    let r = reference(&dir);
    let weights = load_checkpoint(&dir, &LoadOptions::default()).unwrap();
    let c = weights.config.clone();
    let vocab = c.vocab_size;
    assert_eq!(r.logits.len(), r.tokens.len() * vocab);
    let total = r.tokens.len();
    let (w, mut s, batch) = session(&weights, r.prompt_len, total);
    let cfg = CallConfig::default();
    let mut done = 0;
    let mut rows = 0;
    let mut exact = 0;
    while done < r.prompt_len {
        let end = (done + chunk).min(r.prompt_len);
        s.read_logits = end == r.prompt_len;
        let out = s
            .prefill(
                &w,
                &batch,
                &[PrefillChunk {
                    seq: 0,
                    tokens: r.tokens[done..end].to_vec(),
                    seq_len: end,
                }],
                &cfg,
            )
            .unwrap();
        if end == r.prompt_len {
            let p = end - 1;
            exact += usize::from(check_row(
                name,
                p,
                &out.logits,
                &r.logits[p * vocab..(p + 1) * vocab],
            ));
            rows += 1;
        }
        done = end;
    }
    s.read_logits = true;
    for p in r.prompt_len..total {
        let step = PagedBatch {
            seq_lens: vec![p + 1],
            ..batch.clone()
        };
        let out = s.decode(&w, &step, &[r.tokens[p]], &cfg).unwrap();
        exact += usize::from(check_row(
            name,
            p,
            &out.logits,
            &r.logits[p * vocab..(p + 1) * vocab],
        ));
        rows += 1;
    }
    (exact, rows)
}

#[test]
fn current_layout_tied_head_matches_transformers() {
    let (exact, rows) = run_case("tied_v5", 7);
    assert!(exact + 1 >= rows, "{exact} of {rows} argmax identical");
}

#[test]
fn older_layout_untied_f32_matches_transformers() {
    let (exact, rows) = run_case("untied_v4_f32", 24);
    assert!(exact + 1 >= rows, "{exact} of {rows} argmax identical");
}

#[test]
fn yarn_in_the_older_layout_from_shards_matches_transformers() {
    let weights =
        load_checkpoint(&fixtures().join("yarn_v4_sharded"), &LoadOptions::default()).unwrap();
    assert!(matches!(
        weights.config.rope.scaling,
        RopeScaling::Yarn { .. }
    ));
    let (exact, rows) = run_case("yarn_v4_sharded", 10);
    assert!(exact + 1 >= rows, "{exact} of {rows} argmax identical");
}

#[test]
fn linear_rope_in_the_current_layout_matches_transformers() {
    let (exact, rows) = run_case("linear_v5", 5);
    assert!(exact + 1 >= rows, "{exact} of {rows} argmax identical");
}

/// The last prompt position's relative L2 error after a prefill of `name` with its config
/// changed by `change`.
fn prefill_error(name: &str, change: impl FnOnce(&mut Qwen3Config)) -> f64 {
    let dir = fixtures().join(name);
    let r = reference(&dir);
    let mut weights = load_checkpoint(&dir, &LoadOptions::default()).unwrap();
    change(&mut weights.config);
    let c = weights.config.clone();
    let (w, mut s, batch) = session(&weights, r.prompt_len, r.prompt_len);
    s.read_logits = true;
    let out = s
        .prefill(
            &w,
            &batch,
            &[PrefillChunk {
                seq: 0,
                tokens: r.tokens[..r.prompt_len].to_vec(),
                seq_len: r.prompt_len,
            }],
            &CallConfig::default(),
        )
        .unwrap();
    let p = r.prompt_len - 1;
    let v = c.vocab_size;
    agreement(&out.logits, &r.logits[p * v..(p + 1) * v]).0
}

/// The faults this reference was added for fail the comparison: a RoPE base replaced by
/// 10000, and a scaling ignored. (The unchanged configs pass the same measure above.)
#[test]
fn a_wrong_rope_base_or_an_ignored_scaling_is_caught() {
    for (name, change) in [
        (
            "tied_v5",
            (|c: &mut Qwen3Config| c.rope.theta = 10_000.0) as fn(&mut Qwen3Config),
        ),
        ("yarn_v4_sharded", |c| c.rope.scaling = RopeScaling::Default),
        ("linear_v5", |c| c.rope.scaling = RopeScaling::Default),
    ] {
        assert!(
            prefill_error(name, |_| {}) <= MAX_REL_L2,
            "{name} unchanged"
        );
        let rel = prefill_error(name, change);
        assert!(
            rel > 2.0 * MAX_REL_L2,
            "{name}: relative L2 {rel:.3e} with the wrong RoPE"
        );
    }
}

/// A step past `max_position_embeddings` is refused by the session itself, and the session
/// stays usable.
#[test]
fn a_step_past_max_position_embeddings_is_refused_and_the_session_goes_on() {
    let dir = fixtures().join("yarn_v4_sharded");
    let weights = load_checkpoint(&dir, &LoadOptions::default()).unwrap();
    assert_eq!(weights.config.max_position_embeddings, 64);
    let (w, mut s, batch) = session(&weights, 64, 128);
    let cfg = CallConfig::default();
    let past = PagedBatch {
        seq_lens: vec![65],
        ..batch.clone()
    };
    let e = s.decode(&w, &past, &[1], &cfg).unwrap_err().to_string();
    assert!(e.contains("max_position_embeddings (64)"), "{e}");
    let ok = s.decode(&w, &batch, &[1], &cfg).unwrap();
    assert_eq!(ok.next_tokens.len(), 1);
}

/// A long-lived session does not grow with the number of step sizes it sees: one I/O buffer
/// per role, grown only when a step needs more.
#[test]
fn step_buffers_stay_bounded_over_many_step_sizes() {
    let dir = fixtures().join("tied_v5");
    let weights = load_checkpoint(&dir, &LoadOptions::default()).unwrap();
    let (w, mut s, batch) = session(&weights, 60, 64);
    let cfg = CallConfig::default();
    s.read_logits = true;
    let prefill = |s: &mut Session, n: usize| {
        s.prefill(
            &w,
            &batch,
            &[PrefillChunk {
                seq: 0,
                tokens: (0..n as u32).map(|t| t % 250).collect(),
                seq_len: n,
            }],
            &cfg,
        )
        .unwrap();
    };
    // The largest step first; then every smaller size leaves the buffers as they are.
    prefill(&mut s, 60);
    let most = s.io_bytes();
    for n in (1..60).rev() {
        prefill(&mut s, n);
        assert_eq!(s.io_bytes(), most, "after a step of {n} tokens");
    }
}
