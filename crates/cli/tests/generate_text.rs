//! `simpler generate` with text: `--prompt` and `--chat` through a checkpoint's own tokenizer
//! files give the same tokens as the equivalent `--prompt-ids`, the text printed is those
//! tokens decoded, and sampling is seeded.

mod common;

use common::{refused, simpler, text};

use std::path::{Path, PathBuf};

use simpler_models::qwen3::{Qwen3Config, Rope, SaveOptions, generate_weights, save_checkpoint};
use simpler_serve::{ChatMessage, Tokenizer};

/// A one-layer, narrow checkpoint with the real Qwen3 vocabulary (untied, so logits vary) and
/// the tokenizer files beside it.
fn checkpoint(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("simpler-gen-text-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = Qwen3Config::preset("qwen3-0.6b").unwrap();
    c.hidden_size = 64;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.intermediate_size = 128;
    c.num_hidden_layers = 1;
    c.tie_word_embeddings = false;
    c.rope = Rope::plain(1e6);
    let w = generate_weights(&c, 5, false, None);
    save_checkpoint(&dir, &w, &SaveOptions::default()).unwrap();
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../serve/assets/qwen3");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(assets.join(f), dir.join(f)).unwrap();
    }
    dir
}

fn generate(dir: &Path, input: &[&str], extra: &[&str]) -> (String, String) {
    let mut a = vec![
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--max-new-tokens",
        "6",
        "--ignore-eos",
    ];
    a.extend_from_slice(input);
    a.extend_from_slice(extra);
    let out = simpler(&a);
    assert!(out.status.success(), "{input:?}: {}", text(&out.stderr));
    (text(&out.stdout), text(&out.stderr))
}

#[test]
fn text_prompts_equal_their_token_ids_and_print_the_decoded_text() {
    let dir = checkpoint("text");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let prompt = "The capital of France is";
    let ids = tok.encode(prompt).unwrap();
    let csv: Vec<String> = ids.iter().map(u32::to_string).collect();
    let (ids_out, _) = generate(&dir, &["--prompt-ids", &csv.join(",")], &[]);
    let generated: Vec<u32> = ids_out
        .trim()
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect();
    let (text_out, err) = generate(&dir, &["--prompt", prompt], &[]);
    assert!(
        err.contains(&format!("prompt {} tokens", ids.len())),
        "{err}"
    );
    assert!(err.contains("TTFT") && err.contains("ms/token"), "{err}");
    assert_eq!(
        text_out.strip_suffix('\n').unwrap(),
        tok.decode(&generated, true).unwrap()
    );

    // A chat message goes through the template.
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi there"),
    ];
    let rendered = tok
        .apply_chat_template(&messages, true, Some(false))
        .unwrap();
    let n = tok.encode(&rendered).unwrap().len();
    let (_, err) = generate(
        &dir,
        &[
            "--chat",
            "Hi there",
            "--system",
            "Be brief.",
            "--no-thinking",
        ],
        &[],
    );
    assert!(err.contains(&format!("prompt {n} tokens")), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sampling_is_seeded_and_bad_parameters_are_refused() {
    let dir = checkpoint("sample");
    let ids = ["--prompt-ids", "9707,11,1879"];
    let hot = [
        "--temperature",
        "2.0",
        "--top-p",
        "0.95",
        "--sample-seed",
        "11",
    ];
    let (a, err) = generate(&dir, &ids, &hot);
    assert!(err.contains("sampling at temperature 2"), "{err}");
    let (b, _) = generate(&dir, &ids, &hot);
    assert_eq!(a, b, "same seed, same tokens");
    let (c, _) = generate(
        &dir,
        &ids,
        &[
            "--temperature",
            "2.0",
            "--top-p",
            "0.95",
            "--sample-seed",
            "12",
        ],
    );
    assert_ne!(a, c, "another seed");
    let (greedy, err) = generate(&dir, &ids, &[]);
    assert!(err.contains("greedy"), "{err}");
    let (greedy0, _) = generate(&dir, &ids, &["--temperature", "0"]);
    assert_eq!(greedy, greedy0);
    // Bad sampling values are refused by name, and greedy decoding (the default temperature
    // 0) refuses the sampling flags it would not use; nothing runs.
    for (temperature, flag, value, needle) in [
        ("0", "--temperature", "-1", "temperature"),
        ("1", "--top-p", "0", "top-p"),
        ("1", "--top-k", "0", "top-k"),
        ("0", "--top-k", "3", "--top-k: applies when sampling"),
        ("0", "--top-p", "0.5", "--top-p: applies when sampling"),
        (
            "0",
            "--sample-seed",
            "9",
            "--sample-seed: applies when sampling",
        ),
    ] {
        let out = simpler(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1",
            "--temperature",
            temperature,
            flag,
            value,
        ]);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{flag} {value}");
        assert!(err.contains(needle), "{flag} {value}: {err}");
        assert!(text(&out.stdout).is_empty(), "{flag} {value}: ran anyway");
    }
    // Text with a model whose vocabulary is smaller than the tokenizer's is refused by name.
    let out = simpler(&["generate", "--preset", "tiny", "--prompt", "Hello"]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("151669 ids") && err.contains("1000"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--model NAME` takes a preset's name where no directory of that name exists (the spec's
/// `--model DIR|preset`): the same tokens as `--preset NAME`. A name that is neither a
/// directory nor a preset is refused naming both readings, before anything runs.
#[test]
fn model_takes_a_preset_name() {
    let run = |how: &str| {
        let out = simpler(&[
            "generate",
            how,
            "qwen3-tiny",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "3",
        ]);
        assert!(out.status.success(), "{how}: {}", text(&out.stderr));
        text(&out.stdout)
    };
    // With --prompt-ids, stdout is the new ids.
    let (by_model, by_preset) = (run("--model"), run("--preset"));
    assert_eq!(by_model.trim().split(',').count(), 3, "{by_model}");
    assert_eq!(by_model, by_preset);
    refused(
        &[
            "generate",
            "--model",
            "qwen3-nope",
            "--prompt-ids",
            "1",
            "--max-new-tokens",
            "1",
        ],
        "--model qwen3-nope: no such checkpoint directory, and not a preset (presets: qwen3-14b",
    );
}

/// `--seed` seeds a preset's weights only: with a checkpoint, `generate`, `serve` and `bench
/// serve` (which take nothing else from it) refuse it by name before loading anything, and
/// point at the sampling seed; with a preset it still changes the weights, so the tokens.
#[test]
fn seed_with_a_checkpoint_is_refused_where_it_would_change_nothing() {
    let dir = checkpoint("seed");
    let d = dir.to_str().unwrap();
    for cmd in [
        &["generate", "--model", d, "--seed", "7", "--prompt-ids", "1"][..],
        &["serve", "--model", d, "--seed", "7"][..],
        &["bench", "serve", "--model", d, "--seed", "7"][..],
    ] {
        refused(cmd, "--seed 7: seeds a preset's random weights");
    }
    let (out, _) = generate(&dir, &["--prompt-ids", "1,2,3"], &[]);
    assert!(!out.trim().is_empty());
    let run = |seed: &str| {
        let out = simpler(&[
            "generate",
            "--preset",
            "qwen3-tiny",
            "--seed",
            seed,
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    assert_ne!(run("1"), run("2"), "the preset's seed changed no token");
}
