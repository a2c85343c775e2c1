//! The text API over the engine with the real Qwen3 tokenizer: the text is the generated ids
//! decoded, the ids are the engine's for the encoded prompt, stop strings cut text and ids,
//! and a batch larger than the engine allows is refused.

mod common;

use simpler_models::qwen3::{Qwen3Config, Rope, WeightFormat, generate_weights};
use simpler_serve::{
    Engine, EngineConfig, GenerateConfig, Request, SamplingParams, TextEngine, TextFinish,
    Tokenizer,
};

/// A one-layer, narrow model with the real vocabulary (untied head, so outputs vary).
fn engine() -> Engine {
    let worker = common::qwen3_worker();
    let mut c = Qwen3Config::preset("qwen3-0.6b").unwrap();
    c.hidden_size = 64;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.intermediate_size = 128;
    c.num_hidden_layers = 1;
    c.tie_word_embeddings = false;
    c.rope = Rope::plain(1e6);
    let w = generate_weights(&c, 9, false, None);
    Engine::new(
        worker,
        &w,
        vec![],
        EngineConfig {
            max_batch_size: 2,
            max_num_batched_tokens: 256,
            max_seq_len: 512,
            num_blocks: 8,
            long_prefill_threshold: None,
            weights: WeightFormat::Bf16,
        },
    )
    .unwrap()
}

#[test]
fn text_is_the_decoded_ids_and_stop_strings_cut_both() {
    let tok = Tokenizer::qwen3().unwrap();
    let prompt = "Once upon a time, in a land far away,";
    let ids = tok.encode(prompt).unwrap();
    let mut te = TextEngine::new(engine(), Tokenizer::qwen3().unwrap()).unwrap();
    let cfg = GenerateConfig {
        max_new_tokens: 10,
        ..GenerateConfig::default()
    };
    let r = te.generate_result(prompt, &cfg).unwrap();
    assert_eq!(r.prompt_tokens, ids.len());
    assert_eq!(r.finish_reason, TextFinish::Length);
    assert_eq!(r.token_ids.len(), 10);
    assert_eq!(r.text, tok.decode(&r.token_ids, true).unwrap());
    // The same ids as the token API on a fresh engine.
    let mut e = engine();
    let want = e
        .generate(&[Request {
            prompt: ids,
            max_new_tokens: 10,
            sampling: SamplingParams::default(),
            ignore_eos: false,
        }])
        .unwrap();
    assert_eq!(r.token_ids, want[0].tokens);

    // A stop string: the text of the fourth token (as it appears in the whole text).
    let head = tok.decode(&r.token_ids[..3], true).unwrap();
    let four = tok.decode(&r.token_ids[..4], true).unwrap();
    let stop = four[head.len()..].to_string();
    // (This model and seed give a fourth token with text of its own that the first three do
    // not contain, so the stop string is found exactly there.)
    assert!(
        !stop.is_empty() && !head.contains(&stop),
        "{stop:?} in {head:?}"
    );
    let cut = te
        .generate_result(
            prompt,
            &GenerateConfig {
                stop: vec![stop.clone()],
                ..cfg.clone()
            },
        )
        .unwrap();
    assert_eq!(cut.finish_reason, TextFinish::Stop, "{stop:?}");
    assert_eq!(cut.text, head, "{stop:?}");
    assert_eq!(cut.token_ids, r.token_ids[..4].to_vec());
    assert_eq!(te.generate(prompt, &cfg).unwrap(), r.text);
}

#[test]
fn batches_are_served_together_up_to_the_engines_size() {
    let mut te = TextEngine::new(engine(), Tokenizer::qwen3().unwrap()).unwrap();
    let cfg = GenerateConfig {
        max_new_tokens: 4,
        ..GenerateConfig::default()
    };
    let one = te.generate_result("Hello there", &cfg).unwrap();
    let two = te
        .generate_batch(&["Hello there", "General Kenobi"], &cfg)
        .unwrap();
    assert_eq!(two[0], one, "batched equals alone");
    assert_eq!(two.len(), 2);
    let e = te
        .generate_batch(&["a", "b", "c"], &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_batch_size 2"), "{e}");
    let e = te
        .generate_batch(
            &["a"],
            &GenerateConfig {
                stop: vec![String::new()],
                ..cfg
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty stop string"), "{e}");
    assert_eq!(te.engine().free_blocks(), 8);
}
