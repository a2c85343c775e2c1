//! The engine: batched requests give exactly the tokens they give alone (chunked prompts and
//! decodes sharing steps), the prefix cache skips computing cached blocks without changing a
//! token, preemption by recompute changes no token, and bad requests are refused before
//! anything runs, leaving the engine usable.

mod common;

use std::sync::Arc;

use simpler_core::{CallConfig, Worker};
use simpler_models::qwen3::golden::PrefillChunk;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{
    KvBuffers, PagedBatch, Qwen3Config, Qwen3Weights, ResidentModel, Session, WeightFormat,
    generate_weights,
};
use simpler_serve::{Engine, EngineConfig, FinishReason, Request, SamplingParams};

/// Longest sequence of these engines.
const MAX_SEQ: usize = 1024;

/// A 2-core worker with the Qwen3 kernels and the tiny model's weights (seed 21).
fn worker_and_weights() -> (Worker, Qwen3Weights) {
    let worker = common::qwen3_worker();
    let mut c = Qwen3Config::preset("tiny").unwrap();
    // An untied head, so greedy decoding does not just repeat the input token.
    c.tie_word_embeddings = false;
    (worker, generate_weights(&c, 21, false, None))
}

fn engine(num_blocks: usize, budget: usize) -> Engine {
    engine_as(num_blocks, budget, WeightFormat::Bf16)
}

fn engine_as(num_blocks: usize, budget: usize, weights: WeightFormat) -> Engine {
    let (worker, w) = worker_and_weights();
    Engine::new(
        worker,
        &w,
        vec![],
        EngineConfig {
            max_batch_size: 8,
            max_num_batched_tokens: budget,
            max_seq_len: MAX_SEQ,
            num_blocks,
            long_prefill_threshold: None,
            weights,
        },
    )
    .unwrap()
}

/// The greedy tokens of `prompt` on a session over the same weights held as `format`: one
/// prefill step of the whole prompt, then one decode step a token, as the engine runs one
/// request whose prompt fits its step budget.
fn session_greedy(format: WeightFormat, prompt: &[u32], n: usize) -> Vec<u32> {
    let (worker, w) = worker_and_weights();
    let model = Arc::new(ResidentModel::upload_as(&worker, &w, MAX_SEQ, format, None).unwrap());
    let at = |len: usize| PagedBatch::identity(vec![len], MAX_SEQ, PAGE_SIZE);
    let kv = KvBuffers::new(&worker, &w.config, at(1).num_pages(), PAGE_SIZE).unwrap();
    let mut s = Session::new(&worker, model, kv);
    let cfg = CallConfig::default();
    let chunk = PrefillChunk {
        seq: 0,
        tokens: prompt.to_vec(),
        seq_len: prompt.len(),
    };
    let out = s
        .prefill(&worker, &at(prompt.len()), &[chunk], &cfg)
        .unwrap();
    let mut tokens = vec![out.next_tokens[0]];
    while tokens.len() < n {
        let last = tokens[tokens.len() - 1];
        let out = s
            .decode(&worker, &at(prompt.len() + tokens.len()), &[last], &cfg)
            .unwrap();
        tokens.push(out.next_tokens[0]);
    }
    tokens
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 101) % 997)
        .collect()
}

fn req(prompt: Vec<u32>, max_new_tokens: usize) -> Request {
    Request {
        prompt,
        max_new_tokens,
        sampling: SamplingParams::default(),
        ignore_eos: false,
    }
}

#[test]
fn a_batch_gives_the_tokens_each_request_gives_alone() {
    let reqs = vec![
        req(prompt(5, 1), 8),
        req(prompt(200, 2), 5),
        req(prompt(37, 3), 12),
        req(prompt(129, 4), 3),
        Request {
            sampling: SamplingParams {
                temperature: 0.9,
                top_k: Some(20),
                top_p: 0.95,
                seed: 5,
            },
            ..req(prompt(60, 5), 6)
        },
    ];
    // A 64-token budget: the long prompts are prefilled in chunks while the others decode.
    let mut e = engine(32, 64);
    let batched = e.generate(&reqs).unwrap();
    let s = e.stats();
    assert!(s.max_batch >= 3, "{s:?}");
    assert_eq!(e.free_blocks(), 32);
    for (r, b) in reqs.iter().zip(&batched) {
        assert_eq!(b.tokens.len(), r.max_new_tokens);
        assert_eq!(b.finish_reason, FinishReason::Length);
        let mut alone = engine(32, 1024);
        let a = alone.generate(std::slice::from_ref(r)).unwrap();
        assert_eq!(a[0].tokens, b.tokens, "prompt of {}", r.prompt.len());
    }
}

#[test]
fn the_prefix_cache_skips_cached_blocks_and_changes_no_token() {
    let common = prompt(300, 7);
    let with_tail = |t: u32| {
        let mut p = common.clone();
        p.extend([t, t + 1, t + 2]);
        p
    };
    let mut e = engine(16, 512);
    let first = e.generate(&[req(with_tail(1), 4)]).unwrap();
    assert_eq!(first[0].cached_tokens, 0);
    let before = e.stats().computed_tokens;
    let second = e.generate(&[req(with_tail(500), 4)]).unwrap();
    // Two full 128-token blocks of the shared 300 come from the cache.
    assert_eq!(second[0].cached_tokens, 256);
    let computed = e.stats().computed_tokens - before;
    assert_eq!(computed as usize, 303 - 256 + 3, "prompt rest + 3 decodes");
    let mut fresh = engine(16, 512);
    let want = fresh.generate(&[req(with_tail(500), 4)]).unwrap();
    assert_eq!(second[0].tokens, want[0].tokens);
    let _ = first;
}

/// Two requests that share only their first block, admitted in one step, both compute it; a
/// later prompt sharing both of the longer one's full blocks finds both (the second block was
/// once recorded after the copy of the first block that lost the race, unreachable).
#[test]
fn blocks_computed_side_by_side_are_found_by_later_prompts() {
    let base = prompt(300, 11);
    let mut e = engine(32, 1024);
    e.generate(&[req(base[..130].to_vec(), 2), req(base.clone(), 2)])
        .unwrap();
    let mut later = base[..256].to_vec();
    later.extend([5, 6, 7]);
    let done = e.generate(&[req(later.clone(), 2)]).unwrap();
    assert_eq!(done[0].cached_tokens, 256);
    assert_eq!(e.free_blocks(), 32);
    let want = engine(32, 1024).generate(&[req(later, 2)]).unwrap();
    assert_eq!(done[0].tokens, want[0].tokens);
}

#[test]
fn preemption_by_recompute_changes_no_token() {
    // Three requests growing to 2 blocks each (150 + 120 tokens) in a pool of 4 blocks.
    let reqs: Vec<Request> = (0..3).map(|i| req(prompt(150, 10 + i), 120)).collect();
    let mut e = engine(4, 512);
    let got = e.generate(&reqs).unwrap();
    assert!(e.stats().preemptions > 0, "{:?}", e.stats());
    assert_eq!(e.free_blocks(), 4);
    for (r, g) in reqs.iter().zip(&got) {
        let mut alone = engine(4, 512);
        assert_eq!(
            alone.generate(std::slice::from_ref(r)).unwrap()[0].tokens,
            g.tokens
        );
    }
}

#[test]
fn bad_requests_are_refused_before_anything_runs() {
    let mut e = engine(4, 128);
    let cases = [
        (req(vec![], 4), "empty"),
        (req(prompt(1024, 1), 4), "max_seq_len"),
        (req(vec![5, 5000], 4), "vocabulary"),
        (req(prompt(4, 1), 0), "max_new_tokens"),
        (
            Request {
                sampling: SamplingParams {
                    top_p: 0.0,
                    ..SamplingParams::default()
                },
                ..req(prompt(4, 1), 2)
            },
            "top_p",
        ),
        (req(prompt(600, 1), 4), "KV blocks"),
    ];
    for (r, needle) in cases {
        let e2 = e
            .generate(&[req(prompt(3, 2), 2), r])
            .unwrap_err()
            .to_string();
        assert!(
            e2.contains("request 1") && e2.contains(needle),
            "{needle}: {e2}"
        );
        assert_eq!(e.stats().steps, 0, "nothing ran");
    }
    // The engine still serves.
    let ok = e.generate(&[req(prompt(3, 2), 2)]).unwrap();
    assert_eq!(ok[0].tokens.len(), 2);
    assert_eq!(e.free_blocks(), 4);
}

#[test]
fn requests_added_while_others_run_give_the_tokens_they_give_alone() {
    let mut e = engine(64, 64);
    let first = req(prompt(90, 7), 10);
    let id = e.add_request(&first).unwrap();
    // Two steps in, a second request arrives; later an aborted one comes and goes.
    let mut got: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut record = |out: Vec<simpler_serve::StepOutput>| {
        for o in out {
            got.entry(o.id.0).or_default().push(o.token);
        }
    };
    record(e.step().unwrap());
    record(e.step().unwrap());
    let second = req(prompt(20, 8), 6);
    let id2 = e.add_request(&second).unwrap();
    let gone = e.add_request(&req(prompt(40, 9), 50)).unwrap();
    record(e.step().unwrap());
    assert!(e.abort(gone));
    assert!(!e.abort(gone), "an aborted request is gone");
    while e.has_work() {
        record(e.step().unwrap());
    }
    assert_eq!(e.free_blocks(), 64);
    assert_eq!(e.stats().aborted, 1);
    for (id, r) in [(id, &first), (id2, &second)] {
        let alone = engine(64, 1024).generate(std::slice::from_ref(r)).unwrap();
        assert_eq!(got[&id.0], alone[0].tokens, "request {id}");
    }
}

#[test]
fn a_long_lived_engine_does_not_grow() {
    // Hundreds of requests of varied lengths, a few at a time: the engine's own accounting
    // (step I/O buffers, blocks) must be what the largest step needs, not grow per request.
    let mut e = engine(32, 256);
    let mut after_warmup = None;
    for round in 0..60u32 {
        let reqs: Vec<Request> = (0..5u32)
            .map(|k| {
                let len = 1 + ((round * 5 + k) * 37 % 250) as usize;
                req(prompt(len, round * 5 + k), 1 + (k as usize % 3))
            })
            .collect();
        e.generate(&reqs).unwrap();
        assert_eq!(e.free_blocks(), 32, "round {round}: every block is back");
        if round == 20 {
            after_warmup = Some(e.io_buffer_bytes());
        }
    }
    let (warm, end) = (after_warmup.unwrap(), e.io_buffer_bytes());
    assert_eq!(e.stats().requests, 300);
    assert_eq!(
        warm, end,
        "I/O buffers grew after 100 requests: {warm} -> {end} bytes"
    );
    // Bounded by the largest step: 256 tokens, 5 rows of logits (power-of-two rounding, one
    // buffer per role).
    let vocab = e.vocab_size();
    assert!(
        end <= 4 * (256 * 4 + 5 * vocab * 4 + 5 * 4 + 256 * 64 * 4),
        "{end} bytes"
    );
}

#[test]
fn timed_decode_steps_return_their_blocks_and_refuse_what_does_not_fit() {
    let mut e = engine(16, 64);
    let t = e.time_decode_steps(3, 200, 4, 1).unwrap();
    assert_eq!(t.len(), 4);
    assert_eq!(e.free_blocks(), 16);
    // 8 sequences of 1000 tokens need 64 blocks of 128: refused, nothing held.
    let err = e.time_decode_steps(8, 1000, 4, 1).unwrap_err();
    assert!(err.to_string().contains("KV blocks"), "{err}");
    assert_eq!(e.free_blocks(), 16);
    assert!(
        e.time_decode_steps(2, 1020, 10, 1).is_err(),
        "past max_seq_len"
    );
    e.add_request(&req(prompt(5, 1), 2)).unwrap();
    assert!(
        e.time_decode_steps(1, 10, 1, 0).is_err(),
        "the engine is busy"
    );
    while e.has_work() {
        e.step().unwrap();
    }
    // More warm-up steps than steps: refused, blocks untouched.
    let err = e.time_decode_steps(1, 10, 2, 3).unwrap_err();
    assert!(err.to_string().contains("3 warm-up steps of 2"), "{err}");
    assert_eq!(e.free_blocks(), 16);
    e.add_request(&req(prompt(5, 1), 2)).unwrap();
    // And the engine still serves.
    while e.has_work() {
        e.step().unwrap();
    }
    assert_eq!(e.free_blocks(), 16);
}

/// With int8 weights the engine runs the int8 model: its tokens are the ones a session over
/// int8 weights gives, and that model's tokens differ from the bf16 one's for this prompt
/// from the first (so the comparison tells the formats apart; many prompts give the same
/// greedy tokens on the tiny model).
#[test]
fn an_int8_engine_gives_the_int8_models_tokens() {
    let p = prompt(40, 4);
    let n = 24;
    let int8 = WeightFormat::Int8(Default::default());
    let mut e = engine_as(64, 512, int8);
    let done = e.generate(&[Request {
        ignore_eos: true,
        ..req(p.clone(), n)
    }]);
    let got = &done.unwrap()[0].tokens;
    assert_eq!(got, &session_greedy(int8, &p, n));
    assert_ne!(got, &session_greedy(WeightFormat::Bf16, &p, n));
    assert_eq!(e.config().weights, int8);
}

/// A step observer sees every run's report once, in order, with the diagnostics the call
/// configuration records: the engine's steps and its timed bare decode steps.
#[test]
fn the_step_observer_sees_every_runs_report() {
    use std::sync::{Arc, Mutex};
    let mut e = engine(64, 512);
    e.set_call_config(CallConfig {
        swimlane: 1,
        output_dir: Some(std::env::temp_dir()),
        ..CallConfig::default()
    });
    // Each report's swimlane records and warm-up mark.
    let seen: Arc<Mutex<Vec<(usize, bool)>>> = Arc::default();
    let s = seen.clone();
    e.set_step_observer(Some(Box::new(move |r| {
        let records = r.swimlane.as_ref().map_or(0, |sw| sw.tasks.len());
        s.lock().unwrap().push((records, r.warmup));
    })));
    e.generate(&[req(prompt(9, 5), 4)]).unwrap();
    let steps = e.stats().steps as usize;
    assert_eq!(seen.lock().unwrap().len(), steps);
    e.time_decode_steps(1, 16, 3, 1).unwrap();
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), steps + 3);
        assert!(
            seen.iter().all(|&(n, _)| n > 0),
            "every report has its swimlane: {seen:?}"
        );
        // Only the timed steps' first is marked warm-up.
        let marked: Vec<usize> = (0..seen.len()).filter(|&i| seen[i].1).collect();
        assert_eq!(marked, [steps], "{seen:?}");
    }
    // Taken away, the observer sees no more runs.
    e.set_step_observer(None);
    e.generate(&[req(prompt(5, 6), 2)]).unwrap();
    assert_eq!(seen.lock().unwrap().len(), steps + 3);
}

/// An engine over a model already in the worker (`Engine::with_model`, what `simpler serve`
/// and `TextEngine::load` use with layers uploaded one at a time) answers as the one that
/// uploads the same weights itself; a model in another format than the config asks, or with
/// RoPE tables shorter than its `max_seq_len`, is refused naming the field.
#[test]
fn an_engine_over_a_resident_model_answers_as_one_that_uploads_it() {
    let cfg = |weights| EngineConfig {
        max_batch_size: 4,
        max_num_batched_tokens: 64,
        max_seq_len: MAX_SEQ,
        num_blocks: 32,
        long_prefill_threshold: None,
        weights,
    };
    let request = || Request {
        prompt: vec![3, 14, 15, 92, 65],
        max_new_tokens: 6,
        sampling: SamplingParams::default(),
        ignore_eos: true,
    };
    let seq = Engine::resident_seq(&cfg(WeightFormat::Bf16));
    // A model on its own worker, its RoPE tables for `positions`.
    let resident = |positions: usize| {
        let (worker, w) = worker_and_weights();
        let m = ResidentModel::upload_as(&worker, &w, positions, WeightFormat::Bf16, None);
        (worker, Arc::new(m.unwrap()))
    };
    let refused = |positions: usize, weights: WeightFormat| {
        let (worker, model) = resident(positions);
        Engine::with_model(worker, model, vec![], cfg(weights))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = refused(seq, WeightFormat::Int8(Default::default()));
    assert!(e.contains("configuration: weights: "), "{e}");
    let e = refused(128, WeightFormat::Bf16);
    assert!(
        e.contains(&format!("configuration: max_seq_len {MAX_SEQ}")),
        "{e}"
    );
    let (worker, model) = resident(seq);
    let mut resident = Engine::with_model(worker, model, vec![], cfg(WeightFormat::Bf16)).unwrap();
    let mut own = engine_as(32, 64, WeightFormat::Bf16);
    let a = resident.generate(&[request()]).unwrap();
    let b = own.generate(&[request()]).unwrap();
    assert_eq!(a[0].tokens, b[0].tokens);
    assert_eq!(a[0].tokens.len(), 6);
}
