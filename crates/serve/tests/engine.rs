//! The engine: batched requests give exactly the tokens they give alone (chunked prompts and
//! decodes sharing steps), the prefix cache skips computing cached blocks without changing a
//! token, preemption by recompute changes no token, and bad requests are refused before
//! anything runs, leaving the engine usable.

use simpler_core::{Worker, WorkerConfig};
use simpler_models::qwen3::{Qwen3Config, generate_weights, ops};
use simpler_serve::{Engine, EngineConfig, FinishReason, Request, SamplingParams};

fn engine(num_blocks: usize, budget: usize) -> Engine {
    let worker = Worker::new(
        simpler_cpu::CpuPlatform::new(),
        WorkerConfig {
            cores: Some(2),
            timeouts: None,
        },
    )
    .unwrap();
    ops::register(&worker).unwrap();
    let mut c = Qwen3Config::preset("tiny").unwrap();
    // An untied head, so greedy decoding does not just repeat the input token.
    c.tie_word_embeddings = false;
    let w = generate_weights(&c, 21, false, None);
    Engine::new(
        worker,
        &w,
        vec![],
        EngineConfig {
            max_batch_size: 8,
            max_num_batched_tokens: budget,
            max_seq_len: 1024,
            num_blocks,
        },
    )
    .unwrap()
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
