//! Loading an engine from a preset with a runtime configuration: KV blocks from the memory
//! left after the weights (capped by what the batch can hold), refusals that name the field,
//! a loaded engine that turns text into text, and a model directory that answers as the
//! preset it was written from.

mod common;

use simpler_core::Worker;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{Int8Acts, Qwen3Config, WeightFormat};
use simpler_serve::{EngineError, GenerateConfig, ModelSource, RuntimeConfig, TextEngine};

fn worker() -> Worker {
    common::bare_worker()
}

fn config_error(r: Result<simpler_serve::Sizing, EngineError>) -> String {
    match r {
        Err(EngineError::Config(m)) => m,
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[test]
fn kv_blocks_come_from_the_memory_left_after_the_weights() {
    let c = Qwen3Config::preset("qwen3-0.6b").unwrap();
    let rt = RuntimeConfig {
        max_seq_len: Some(4096),
        ..RuntimeConfig::default()
    };
    let block = (c.kv_bytes_per_token() * PAGE_SIZE) as u64;
    // Plenty of memory: capped at what 16 sequences of 4096 tokens hold.
    let s = rt.sizing(&c, Some((1 << 40, "test".into()))).unwrap();
    assert_eq!(s.engine.num_blocks, 16 * 4096 / PAGE_SIZE);
    // Little memory: half of what is left after the rest.
    let avail = s.rest_bytes + 40 * block;
    let s = rt.sizing(&c, Some((avail, "test".into()))).unwrap();
    assert_eq!(s.engine.num_blocks, 20);
    assert!(s.describe(&rt).contains("20 blocks"), "{}", s.describe(&rt));
    // int8 projections leave more of the same memory to the KV cache.
    let int8 = RuntimeConfig {
        weight_dtype: "int8".into(),
        ..rt.clone()
    }
    .sizing(&c, Some((avail, "test".into())))
    .unwrap();
    assert!(int8.rest_bytes < s.rest_bytes);
    assert!(int8.engine.num_blocks > 20, "{}", int8.engine.num_blocks);
    // A budget below what the platform has wins.
    let s = RuntimeConfig {
        memory_budget: Some(avail),
        ..rt.clone()
    }
    .sizing(&c, Some((1 << 40, "test".into())))
    .unwrap();
    assert_eq!(s.engine.num_blocks, 20);
    // No room: an error with the numbers.
    let m = config_error(rt.sizing(&c, Some((s.rest_bytes / 2, "test".into()))));
    assert!(
        m.contains("no room for a KV cache") && m.contains("GB"),
        "{m}"
    );
    // Unknown memory needs an explicit count; an explicit count that cannot fit is refused.
    let m = config_error(rt.sizing(&c, None));
    assert!(m.contains("num_kv_blocks"), "{m}");
    let fixed = RuntimeConfig {
        num_kv_blocks: Some(1000),
        ..rt.clone()
    };
    assert_eq!(fixed.sizing(&c, None).unwrap().engine.num_blocks, 1000);
    let m = config_error(fixed.sizing(&c, Some((avail, "test".into()))));
    assert!(m.contains("needs about"), "{m}");
    // The weight format reaches the engine's configuration.
    for (dtype, format) in [
        ("bf16", WeightFormat::Bf16),
        ("int8", WeightFormat::Int8(Int8Acts::Quantised)),
        ("int8-w8a8", WeightFormat::Int8(Int8Acts::Quantised)),
        ("int8-wide", WeightFormat::Int8(Int8Acts::Wide)),
    ] {
        let rt = RuntimeConfig {
            weight_dtype: dtype.into(),
            ..fixed.clone()
        };
        assert_eq!(
            rt.sizing(&c, None).unwrap().engine.weights,
            format,
            "{dtype}"
        );
    }
}

#[test]
fn unsupported_settings_are_refused_by_name() {
    let c = Qwen3Config::preset("qwen3-tiny").unwrap();
    let cases: Vec<(RuntimeConfig, &str)> = vec![
        (
            RuntimeConfig {
                page_size: 64,
                ..RuntimeConfig::default()
            },
            "page_size",
        ),
        (
            RuntimeConfig {
                weight_dtype: "int4".into(),
                ..RuntimeConfig::default()
            },
            "weight_dtype",
        ),
        (
            RuntimeConfig {
                kv_dtype: "fp8".into(),
                ..RuntimeConfig::default()
            },
            "kv_dtype",
        ),
        (
            RuntimeConfig {
                kv_memory_fraction: 1.5,
                ..RuntimeConfig::default()
            },
            "kv_memory_fraction",
        ),
        (
            RuntimeConfig {
                max_seq_len: Some(1 << 20),
                ..RuntimeConfig::default()
            },
            "max_seq_len",
        ),
        (
            RuntimeConfig {
                long_prefill_threshold: Some(0),
                ..RuntimeConfig::default()
            },
            "long_prefill_threshold",
        ),
    ];
    for (rt, field) in cases {
        let m = config_error(rt.sizing(&c, Some((1 << 34, "test".into()))));
        assert!(m.contains(field), "{field}: {m}");
    }
}

#[test]
fn a_loaded_preset_turns_text_into_text_and_a_long_prefill_threshold_changes_no_token() {
    let source = ModelSource::Preset {
        name: "qwen3-tiny".into(),
        seed: 3,
    };
    let rt = RuntimeConfig {
        max_seq_len: Some(1024),
        num_kv_blocks: Some(16),
        ..RuntimeConfig::default()
    };
    let (mut te, sizing) = TextEngine::load(worker(), &source, &rt, None).unwrap();
    assert_eq!(sizing.engine.num_blocks, 16);
    let cfg = GenerateConfig {
        max_new_tokens: 8,
        ..GenerateConfig::default()
    };
    let prompt = "A long prompt, so that a small threshold cuts it into several chunks: one two three four five six seven eight nine ten.";
    let whole = te.generate_result(prompt, &cfg).unwrap();
    assert!(!whole.token_ids.is_empty());
    assert_eq!(
        whole.text,
        te.tokenizer().decode(&whole.token_ids, true).unwrap()
    );
    te.close();
    let (mut chunked, _) = TextEngine::load(
        worker(),
        &source,
        &RuntimeConfig {
            long_prefill_threshold: Some(5),
            ..rt
        },
        None,
    )
    .unwrap();
    let r = chunked.generate_result(prompt, &cfg).unwrap();
    assert!(chunked.engine().stats().steps >= whole.prompt_tokens.div_ceil(5) as u64);
    assert_eq!(r.token_ids, whole.token_ids);
}

/// A model directory as today's tools write it (HF `config.json`, `model.safetensors` in two
/// shards, bf16 norms, the tokenizer's files beside them) loads end to end through
/// `ModelSource::Dir` and answers exactly as the preset its weights were generated from.
#[test]
fn a_model_directory_serves_the_same_text_as_its_preset() {
    use simpler_models::qwen3::{SaveOptions, generate_weights, save_checkpoint};
    let dir = std::env::temp_dir().join(format!("simpler-serve-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let c = Qwen3Config::preset("qwen3-tiny").unwrap();
    let seed = 5;
    save_checkpoint(
        &dir,
        &generate_weights(&c, seed, false, None),
        &SaveOptions {
            max_shard_bytes: Some(1 << 20),
            norms_bf16: true,
            ..SaveOptions::default()
        },
    )
    .unwrap();
    let assets = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/qwen3");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(assets.join(f), dir.join(f)).unwrap();
    }
    let rt = RuntimeConfig {
        max_seq_len: Some(512),
        num_kv_blocks: Some(16),
        ..RuntimeConfig::default()
    };
    let cfg = GenerateConfig {
        max_new_tokens: 12,
        ..GenerateConfig::default()
    };
    let prompt = "Every model directory should load as its preset does:";
    let answer = |source: &ModelSource| {
        let (mut te, _) = TextEngine::load(worker(), source, &rt, None).unwrap();
        let r = te.generate_result(prompt, &cfg).unwrap();
        te.close();
        r
    };
    let from_dir = answer(&ModelSource::Dir(dir.clone()));
    let from_preset = answer(&ModelSource::Preset {
        name: "qwen3-tiny".into(),
        seed,
    });
    assert!(!from_dir.token_ids.is_empty());
    assert_eq!(from_dir.token_ids, from_preset.token_ids);
    assert_eq!(from_dir.text, from_preset.text);
    let _ = std::fs::remove_dir_all(&dir);
}
