//! `simpler generate` against `transformers` on the reference checkpoints of
//! `crates/models/tests/fixtures/hf` (recorded by `tools/qwen3_hf_reference.py`): the same
//! greedy ids and logits, EOS ids from the checkpoint, positions bounded by
//! `max_position_embeddings`; and runs that cannot fit refused before anything is allocated.

mod common;

use common::{simpler, text, tmp};

use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/hf")
        .join(name)
}

/// (tokens, logits [T, vocab], prompt_len) of a reference.
fn reference(dir: &Path) -> (Vec<u32>, Vec<f32>, usize) {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let prompt_len = meta.metadata().as_ref().unwrap()["prompt_len"]
        .parse()
        .unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let words = |n: &str| -> Vec<[u8; 4]> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| b.try_into().unwrap())
            .collect()
    };
    let tokens = words("tokens")
        .into_iter()
        .map(|b| i32::from_le_bytes(b) as u32)
        .collect();
    let logits = words("logits")
        .into_iter()
        .map(f32::from_le_bytes)
        .collect();
    (tokens, logits, prompt_len)
}

/// The fp32 payload of an NPY file written by `--dump-logits`.
fn npy_f32(path: &Path) -> Vec<f32> {
    let b = std::fs::read(path).unwrap();
    let n = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + n..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn ids_csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn rel_l2(a: &[f32], e: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(e).map(|(a, e)| ((a - e) as f64).powi(2)).sum();
    let n: f64 = e.iter().map(|e| (*e as f64).powi(2)).sum();
    (d / n).sqrt()
}

#[test]
fn generate_follows_transformers_greedy_on_every_reference_checkpoint() {
    let dir = tmp("greedy");
    for name in ["tied_v5", "untied_v4_f32", "yarn_v4_sharded", "linear_v5"] {
        let ckpt = fixture(name);
        let (tokens, logits, prompt_len) = reference(&ckpt);
        let new = tokens.len() - prompt_len;
        let vocab = logits.len() / tokens.len();
        let npy = dir.join(format!("{name}.npy"));
        let out = simpler(&[
            "generate",
            "--model",
            ckpt.to_str().unwrap(),
            "--prompt-ids",
            &ids_csv(&tokens[..prompt_len]),
            "--max-new-tokens",
            &new.to_string(),
            "--prefill-chunk",
            "10",
            "--ignore-eos",
            "--dump-logits",
            npy.to_str().unwrap(),
        ]);
        let (so, se) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{name}: {se}");
        assert!(
            se.contains("RoPE") && se.contains(&format!("checkpoint {}", ckpt.display())),
            "{se}"
        );
        let got: Vec<u32> = so.trim().split(',').map(|t| t.parse().unwrap()).collect();
        let rows = npy_f32(&npy);
        assert_eq!((got.len(), rows.len()), (new, new * vocab), "{name}");
        // Row i holds the logits that chose generated token i: the reference's row at
        // position prompt_len - 1 + i. Compare while the sequences agree; a divergence must be
        // a near-tie in the reference.
        for (i, &id) in got.iter().enumerate() {
            let p = prompt_len - 1 + i;
            let (a, e) = (
                &rows[i * vocab..(i + 1) * vocab],
                &logits[p * vocab..(p + 1) * vocab],
            );
            let rel = rel_l2(a, e);
            assert!(
                rel < 3e-2,
                "{name} generated token {i}: relative L2 {rel:.3e}"
            );
            let want = tokens[p + 1];
            if id != want {
                let rms =
                    (e.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / vocab as f64).sqrt();
                let gap = (e[want as usize] - e[id as usize]) as f64;
                assert!(
                    gap <= 0.12 * rms,
                    "{name} token {i}: {id} vs transformers' {want} (gap {gap:.4})"
                );
                break;
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generate_stops_at_the_checkpoints_eos_ids_unless_told_otherwise() {
    let dir = tmp("eos");
    let src = fixture("linear_v5");
    let ckpt = dir.join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), ckpt.join(f)).unwrap();
    }
    let (tokens, _, prompt_len) = reference(&src);
    let continuation = &tokens[prompt_len..];
    // The third token transformers generates becomes an EOS id.
    std::fs::write(
        ckpt.join("generation_config.json"),
        format!(r#"{{"eos_token_id": [{}, 255]}}"#, continuation[2]),
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            ckpt.to_str().unwrap(),
            "--max-new-tokens",
            "8",
        ];
        let prompt = ids_csv(&tokens[..prompt_len]);
        args.extend(["--prompt-ids", prompt.as_str()]);
        args.extend_from_slice(extra);
        let out = simpler(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        (text(&out.stdout).trim().to_string(), text(&out.stderr))
    };
    let (ids, err) = run(&[]);
    assert_eq!(ids, ids_csv(&continuation[..3]), "{err}");
    assert!(
        err.contains("stopped at EOS id")
            && err.contains(&format!("EOS ids [{}, 255]", continuation[2])),
        "{err}"
    );
    let (ids, err) = run(&["--ignore-eos"]);
    assert_eq!(ids.split(',').count(), 8, "{err}");
    assert!(
        err.contains("--ignore-eos") && !err.contains("stopped at EOS"),
        "{err}"
    );
    // Without generation_config.json, config.json's eos_token_id (255) applies.
    std::fs::remove_file(ckpt.join("generation_config.json")).unwrap();
    let (ids, err) = run(&[]);
    assert!(err.contains("EOS ids [255]"), "{err}");
    assert_eq!(ids.split(',').count(), 8, "{err}");
    // An EOS id outside the vocabulary is an error naming the file and key.
    std::fs::write(
        ckpt.join("generation_config.json"),
        r#"{"eos_token_id": 999}"#,
    )
    .unwrap();
    let out = simpler(&[
        "generate",
        "--model",
        ckpt.to_str().unwrap(),
        "--prompt-ids",
        "1",
    ]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("generation_config.json")
            && err.contains("eos_token_id"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generate_refuses_to_run_past_max_position_embeddings() {
    // The YaRN checkpoint is configured for 64 positions.
    let ckpt = fixture("yarn_v4_sharded");
    let out = simpler(&[
        "generate",
        "--model",
        ckpt.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3,4,5",
        "--max-new-tokens",
        "61",
    ]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("max_position_embeddings of 64") && err.contains("65 tokens"),
        "{err}"
    );
    // 5 + 60 - 1 = 64 positions fit.
    let out = simpler(&[
        "generate",
        "--model",
        ckpt.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3,4,5",
        "--max-new-tokens",
        "60",
        "--ignore-eos",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn a_run_that_cannot_fit_is_refused_with_the_numbers_and_the_ways_out() {
    // The budget makes the refusal independent of this machine's memory: 14B's ~29.5 GB of
    // bf16 weights resident, with the embedding, LM head and one layer on the host while its
    // layers are generated one weight set at a time, needs ~33.5 GB.
    for args in [
        &[
            "run",
            "qwen3-decode",
            "--preset",
            "qwen3-14b",
            "--memory-budget",
            "20",
        ][..],
        &[
            "generate",
            "--preset",
            "qwen3-14b",
            "--prompt-ids",
            "1,2",
            "--memory-budget",
            "20",
        ],
        &[
            "bench",
            "qwen3-decode",
            "--preset",
            "qwen3-14b",
            "--memory-budget",
            "20",
        ],
    ] {
        let out = simpler(args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        for needle in [
            "this run needs about ",
            "20.00 GB is available (--memory-budget)",
            "weights resident in worker buffers",
            "KV cache",
            "Ways out: --layers N",
            "smaller --preset",
        ] {
            assert!(
                err.contains(needle),
                "{args:?}: missing {needle:?} in {err}"
            );
        }
        let need: f64 = err
            .split("needs about ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert!((30.0..40.0).contains(&need), "{args:?}: {need} GB");
        // int8 weights fit the budget at one short sequence, and the refusal says so (the
        // bench's 16 x 1024 KV cache leaves no room for them).
        assert_eq!(
            err.contains("--weights int8 (about 19."),
            args[0] != "bench",
            "{args:?}: {err}"
        );
        // Refused before the bandwidth measurement or any generation started.
        assert!(!text(&out.stdout).contains("streaming read"), "{args:?}");
    }
    // int8 weights hold the 40 distinct layers in ~19.4 GB: one budget below that is refused
    // with its own figures.
    let out = simpler(&[
        "run",
        "qwen3-decode",
        "--preset",
        "qwen3-14b",
        "--weights",
        "int8",
        "--memory-budget",
        "19",
    ]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("this run needs about 19.")
            && err.contains("one layer's weight set at a time"),
        "{err}"
    );
    // --shared-weights is offered, and fits the same budget.
    let out = simpler(&[
        "run",
        "qwen3-decode",
        "--preset",
        "qwen3-14b",
        "--memory-budget",
        "20",
    ]);
    assert!(text(&out.stderr).contains("--shared-weights"));
    let out = simpler(&[
        "run",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--memory-budget",
        "0",
    ]);
    assert!(!out.status.success() && text(&out.stderr).contains("--memory-budget 0"));
}

/// The generation defaults a checkpoint suggests and `generate` does not apply (it decodes
/// greedily without `--temperature`) are named on stderr, and the tokens stay the greedy ones;
/// the ids describing the model are not listed.
#[test]
fn generation_defaults_not_applied_are_named() {
    let dir = tmp("gen-defaults");
    for f in std::fs::read_dir(fixture("tied_v5")).unwrap().flatten() {
        std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
    }
    let run = |dir: &Path| {
        simpler(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "3",
        ])
    };
    let plain = run(&dir);
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    assert!(
        !text(&plain.stderr).contains("suggests"),
        "{}",
        text(&plain.stderr)
    );
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [255, 254], "do_sample": true, "temperature": 0.6, "top_k": 20}"#,
    )
    .unwrap();
    let out = run(&dir);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(
            "generation_config.json suggests do_sample=true, temperature=0.6, top_k=20; not applied"
        ),
        "{err}"
    );
    assert_eq!(text(&out.stdout), text(&plain.stdout), "still greedy");
    let _ = std::fs::remove_dir_all(&dir);
}
