//! Qwen3 set-up shared by the tests that run the decode step on the runtime: the worker, the
//! stretched fixture and the full-model check against the golden.
//!
//! Every test binary that declares `mod common` compiles this module, and each uses a subset
//! of it (the DeepSeek-V4 binaries none), hence the `dead_code` allowance.
#![allow(dead_code)]

use std::sync::Arc;

use half::bf16;
use simpler_core::Worker;
use simpler_models::qwen3::golden::{self, ModelOutput, Tolerance};
use simpler_models::qwen3::{
    Fixture, FixtureOptions, Qwen3Config, StepOutput, generate_fixture, ops,
};

/// Two CPU cores with the Qwen3 ops registered.
pub(crate) fn worker() -> Worker {
    let w = super::two_core_worker();
    ops::register(&w).unwrap();
    w
}

/// A fixture of `preset` with ragged `seq_lens` (block tables sized for the longest).
///
/// The spec's `o_proj`/`down_proj` scales (std 6e-4 / 4e-4) barely move the residual, so a
/// broken attention or MLP would still meet the hidden-state tolerance; the tests scale both
/// by 50 so every layer's update is of the order of the residual itself. Likewise the cached
/// K (std 0.01) and V (0.3 ± 0.02) make softmax nearly uniform over nearly equal values, so
/// the tests stretch them to N(0, 1) and the attention pattern matters.
pub(crate) fn stretched_fixture(preset: &str, seq_lens: &[usize]) -> Fixture {
    stretched_fixture_of(&Qwen3Config::preset(preset).unwrap(), seq_lens)
}

/// [`stretched_fixture`] of any configuration.
pub(crate) fn stretched_fixture_of(c: &Qwen3Config, seq_lens: &[usize]) -> Fixture {
    let max = *seq_lens.iter().max().unwrap();
    let mut f = generate_fixture(c, &FixtureOptions::small(seq_lens.len(), max), None);
    f.batch.seq_lens = seq_lens.to_vec();
    for layer in &mut f.weights.layers {
        let lw = Arc::make_mut(layer);
        for w in lw.wo.iter_mut().chain(lw.w_down.iter_mut()) {
            *w = bf16::from_f32(w.to_f32() * 50.0);
        }
    }
    f.kv.k
        .iter_mut()
        .for_each(|x| *x = bf16::from_f32(x.to_f32() * 100.0));
    f.kv.v
        .iter_mut()
        .for_each(|x| *x = bf16::from_f32((x.to_f32() - 0.3) * 50.0));
    f
}

/// A full-model step against the golden's: the final hidden state and the logits within the
/// stack tolerance, and the greedy tokens identical except at near-ties (`check_argmax`).
/// `what` prefixes every message.
pub(crate) fn check_model_step(what: &str, got: &StepOutput, want: &ModelOutput) {
    Tolerance::STACK
        .check(&format!("{what}: hidden"), &got.hidden, &want.hidden)
        .unwrap();
    Tolerance::STACK
        .check(&format!("{what}: logits"), &got.logits, &want.logits)
        .unwrap();
    golden::check_argmax(
        &got.next_tokens,
        &want.next_tokens,
        &want.logits,
        Tolerance::STACK,
    )
    .unwrap();
}

/// Uploads a fixture of `c` with ragged `lens` under this process's bf16 layout choice, checks
/// that layer 0, LM-head rows 5..40 and some embedding rows read back in row order, and runs one decode step
/// against the golden (`what` names the run).
pub(crate) fn upload_read_back_and_decode(c: &Qwen3Config, lens: &[usize], what: &str) {
    use simpler_core::CallConfig;
    use simpler_models::qwen3::{KvBuffers, ResidentModel, Session};
    let mut f = generate_fixture(c, &FixtureOptions::small(lens.len(), 129), None);
    f.batch.seq_lens = lens.to_vec();
    let w = worker();
    let model = ResidentModel::upload(&w, &f.weights, f.rope.max_seq, None).unwrap();
    assert_eq!(model.download_layer(0).unwrap(), *f.weights.layers[0]);
    assert_eq!(
        model.download_lm_head_rows(5..40).unwrap(),
        f.weights.lm_head()[5 * c.hidden_size..40 * c.hidden_size]
    );
    // Embedding rows as `run`'s check reads its golden's input (rows 3, 20 and 17: inside
    // two 16-row groups, out of order).
    let h = c.hidden_size;
    let want: Vec<f32> = [3usize, 20, 17]
        .iter()
        .flat_map(|&r| {
            f.weights.embedding[r * h..(r + 1) * h]
                .iter()
                .map(|v| v.to_f32())
        })
        .collect();
    assert_eq!(model.download_embedding_rows(&[3, 20, 17]).unwrap(), want);
    // A token id past the vocabulary is refused by name, and the next read is unaffected.
    let past = c.vocab_size as u32;
    let e = model
        .download_embedding_rows(&[3, past])
        .unwrap_err()
        .to_string();
    assert!(e.contains(&format!("token id {past}")), "{e}");
    assert_eq!(model.download_embedding_rows(&[3, 20, 17]).unwrap(), want);
    let kv = KvBuffers::new(&w, c, f.kv.num_pages, f.kv.page_size).unwrap();
    kv.upload(&f.kv).unwrap();
    let mut s = Session::new(&w, Arc::new(model), kv);
    let got = s
        .decode(&w, &f.batch, &f.tokens, &CallConfig::default())
        .unwrap();
    let want = golden::decode_model(&f.weights, &mut f.kv.clone(), &f.batch, &f.rope, &f.tokens);
    check_model_step(what, &got, &want);
}
