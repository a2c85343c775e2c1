//! The Qwen3 commands end to end through the `simpler` binary: decode checked against the
//! golden, generate from a preset and from the same weights saved as an HF checkpoint
//! (identical ids and logits), the NPY logits dump, and precise errors for bad checkpoints.

mod common;

use common::{refused, simpler, text, tmp};

use std::path::Path;

use simpler_models::qwen3::{Qwen3Config, SaveOptions, generate_weights, save_checkpoint};

#[test]
fn run_qwen3_decode_checks_against_the_golden_and_reports() {
    for variant in ["model", "layers"] {
        let out = simpler(&[
            "run",
            "qwen3-decode",
            "--preset",
            "tiny",
            "--batch",
            "3",
            "--seq-len",
            "130",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--membw-seconds",
            "0.2",
            "--variant",
            variant,
        ]);
        let (so, se) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{variant}: {so}\n{se}");
        assert!(so.contains("check vs golden"), "{so}");
        assert!(so.contains("ok: K/V writes: 2 layers"), "{so}");
        if variant == "model" {
            assert!(so.contains("ok: argmax identical for all 3 rows"), "{so}");
        }
        for needle in [
            "TPOT_ms: n=2",
            "(1) effective (orch ∪ sched)",
            "(5) engine wrap",
            "time per layer",
            "bytes per step",
            "% of this machine's streaming read bandwidth",
            "roofline bound",
            "quietest step",
            "% of the per-phase bound",
            "per phase (one step recorded",
            "qkv",
            "attention",
            "between phases",
        ] {
            assert!(
                so.contains(needle),
                "{variant}: missing {needle:?} in\n{so}"
            );
        }
    }
}

#[test]
fn trace_idle_and_swimlane_name_the_kernels_of_a_recorded_decode_step() {
    let dir = tmp("idle");
    let d = dir.to_str().unwrap();
    let out = simpler(&[
        "run",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--batch",
        "2",
        "--seq-len",
        "40",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--membw-seconds",
        "0.1",
        "--no-check",
        "--swimlane",
        "1",
        "--output-dir",
        d,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A decode command keeps each step's diagnostics in its own directory.
    let step = dir.join("step-000000");
    let d = step.to_str().unwrap();
    let so = success_stdout(&["trace", "idle", d, "--top", "0"]);
    // Kernel names come from the swimlane file itself (no deps.json was captured).
    assert_contains_all(
        &so,
        &[
            "% of the cores' time",
            "gemm_tile_bf16",
            "attention_decode_bf16",
            "run start -> ",
            " -> run end",
        ],
    );
    let out = simpler(&["trace", "swimlane", d]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{so}");
    assert!(so.contains("lm_head_tile_bf16"), "{so}");
    // The steps' spans carry the session's whole step: `trace timing` reads layer ⑤ from them.
    let trace = dir.join("trace.jsonl");
    let so = success_stdout(&["trace", "timing", trace.to_str().unwrap()]);
    let five = so
        .lines()
        .find(|l| l.contains("⑤ engine/host wrap"))
        .unwrap_or_else(|| panic!("layer ⑤ in {so}"));
    let us: f64 = five
        .split_whitespace()
        .last()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("a number of µs in {five}"));
    assert!(us >= 0.0, "{five}");
    assert!(so.contains("engine.step"), "{so}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `simpler generate` on a model source; returns (stdout, logits file bytes).
fn generate(source: &[&str], npy: &Path) -> (String, Vec<u8>) {
    let mut args = vec!["generate"];
    args.extend_from_slice(source);
    let npy_s = npy.to_str().unwrap();
    args.extend([
        "--prompt-ids",
        "5,17,300,2,99",
        "--max-new-tokens",
        "4",
        "--prefill-chunk",
        "3",
        "--dump-logits",
        npy_s,
    ]);
    let out = simpler(&args);
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    (text(&out.stdout), std::fs::read(npy).unwrap())
}

#[test]
fn generate_from_a_checkpoint_equals_generate_from_the_preset() {
    let dir = tmp("gen");
    let w = generate_weights(&Qwen3Config::preset("small").unwrap(), 1234, false, None);
    let ckpt = dir.join("ckpt");
    save_checkpoint(
        &ckpt,
        &w,
        &SaveOptions {
            max_shard_bytes: Some(8 << 20),
            ..SaveOptions::default()
        },
    )
    .unwrap();
    let (ids_a, npy_a) = generate(&["--preset", "small"], &dir.join("a.npy"));
    let (ids_b, npy_b) = generate(&["--model", ckpt.to_str().unwrap()], &dir.join("b.npy"));
    // One line of 4 comma-separated ids.
    let line = ids_a.trim();
    assert_eq!(ids_a.lines().count(), 1, "{ids_a}");
    assert_eq!(line.split(',').count(), 4, "{line}");
    assert!(
        line.split(',')
            .all(|t| t.parse::<u32>().is_ok_and(|t| t < 4096)),
        "{line}"
    );
    assert_eq!(ids_a, ids_b, "checkpoint vs in-memory preset");
    assert_eq!(npy_a, npy_b, "logits differ");
    // [4, 4096] fp32 after a 64-byte-aligned header.
    let n = u16::from_le_bytes([npy_a[8], npy_a[9]]) as usize;
    let header = text(&npy_a[10..10 + n]);
    assert!(header.contains("'shape': (4, 4096)"), "{header}");
    assert_eq!(npy_a.len(), 10 + n + 4 * 4 * 4096);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--rope-theta` sets a preset's θ: the preset then generates what a checkpoint of its
/// weights with that θ in its config generates, and not what the preset's own θ does; a
/// checkpoint refuses the flag (its config states θ).
#[test]
fn rope_theta_sets_a_presets_theta_and_a_checkpoint_refuses_it() {
    let dir = tmp("theta");
    let mut c = Qwen3Config::preset("small").unwrap();
    assert_eq!(c.rope.theta, 1e4);
    c.rope.theta = 1e6;
    let w = generate_weights(&c, 1234, false, None);
    let ckpt = dir.join("ckpt");
    save_checkpoint(&ckpt, &w, &SaveOptions::default()).unwrap();
    let (ids_a, npy_a) = generate(
        &["--preset", "small", "--rope-theta", "1e6"],
        &dir.join("a.npy"),
    );
    let (ids_b, npy_b) = generate(&["--model", ckpt.to_str().unwrap()], &dir.join("b.npy"));
    assert_eq!((&ids_a, &npy_a), (&ids_b, &npy_b));
    let (_, npy_c) = generate(&["--preset", "small"], &dir.join("c.npy"));
    assert_ne!(npy_a, npy_c, "θ 1e6 and 1e4 gave the same logits");
    let out = simpler(&[
        "generate",
        "--model",
        ckpt.to_str().unwrap(),
        "--rope-theta",
        "1e4",
        "--prompt-ids",
        "1",
    ]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--rope-theta"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A valid tiny checkpoint in `dir`.
fn tiny_checkpoint(dir: &Path) -> Qwen3Config {
    let c = Qwen3Config::preset("tiny").unwrap();
    let w = generate_weights(&c, 7, false, None);
    save_checkpoint(dir, &w, &SaveOptions::default()).unwrap();
    c
}

fn expect_error(dir: &Path, needles: &[&str]) {
    let out = simpler(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
    ]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "a bad checkpoint loaded: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "missing {n:?} in: {err}");
    }
}

#[test]
fn bad_checkpoints_give_errors_naming_the_tensor_and_the_file() {
    let dir = tmp("bad");
    // Truncated weights file.
    let d = dir.join("truncated");
    tiny_checkpoint(&d);
    let f = d.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    expect_error(&d, &["model.safetensors", "loading checkpoint"]);

    // Config asking for a layer the file lacks: the missing tensor is named.
    let d = dir.join("missing");
    let mut c = tiny_checkpoint(&d);
    c.num_hidden_layers += 1;
    std::fs::write(d.join("config.json"), c.to_json()).unwrap();
    expect_error(&d, &["model.layers.2.", "missing", "model.safetensors"]);

    // Config with another intermediate size: a wrong shape, named.
    let d = dir.join("shape");
    let mut c = tiny_checkpoint(&d);
    c.intermediate_size += 16;
    std::fs::write(d.join("config.json"), c.to_json()).unwrap();
    expect_error(&d, &["mlp.", "shape", "model.safetensors"]);

    // A dtype no loader knows.
    let d = dir.join("dtype");
    tiny_checkpoint(&d);
    let header =
        r#"{"model.embed_tokens.weight":{"dtype":"Q4_K","shape":[4],"data_offsets":[0,8]}}"#;
    let mut raw = (header.len() as u64).to_le_bytes().to_vec();
    raw.extend_from_slice(header.as_bytes());
    raw.extend_from_slice(&[0u8; 8]);
    std::fs::write(d.join("model.safetensors"), raw).unwrap();
    expect_error(
        &d,
        &["model.embed_tokens.weight", "Q4_K", "model.safetensors"],
    );

    // No config at all.
    let d = dir.join("empty");
    std::fs::create_dir_all(&d).unwrap();
    expect_error(&d, &["config.json"]);
    // A file for the directory: said to be one (it was "missing config.json").
    let f = dir.join("afile");
    std::fs::write(&f, b"not a checkpoint").unwrap();
    expect_error(&f, &["afile", "is a file, not a directory"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The rows of a bench's `summary (medians..` table (after its header line).
fn summary_rows(out: &str) -> Vec<&str> {
    out.lines()
        .skip_while(|l| !l.starts_with("summary"))
        .skip(2)
        .collect()
}

/// Runs `simpler args`, asserts it succeeded, and returns its standard output.
fn success_stdout(args: &[&str]) -> String {
    let out = simpler(args);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    so
}

/// Asserts that every needle occurs in `so`.
fn assert_contains_all(so: &str, needles: &[&str]) {
    for needle in needles {
        assert!(so.contains(needle), "missing {needle:?} in\n{so}");
    }
}

/// The number after `key` (the first whitespace-separated field after it) on `line`.
fn number_after(line: &str, key: &str) -> f64 {
    let rest = &line[line
        .find(key)
        .unwrap_or_else(|| panic!("{key:?} in {line}"))
        + key.len()..];
    let field: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    field
        .parse()
        .unwrap_or_else(|_| panic!("number after {key:?} in {line}"))
}

#[test]
fn bench_qwen3_decode_reports_ratios_and_where_the_cores_wait() {
    let so = success_stdout(&[
        "bench",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--shapes",
        "1x40,2x40",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--outside-steps",
        "2",
        "--membw-seconds",
        "0.1",
        "--versus",
        "max-kv-chunk=16,tile-kib=64",
    ]);
    assert_contains_all(
        &so,
        &[
            "batch 1 x 40 tokens",
            "batch 2 x 40 tokens",
            "% of membw's median pass",
            "% of membw's best pass",
            "% of the whole step",
            "roofline bound",
            "quietest step",
            "outside kernels",
            "of the time the cores' threads held a CPU",
            "largest idle boundaries of that step",
            "% of the per-phase bound",
            "per phase (the recorded step",
            "between phases",
            "tiling compared",
            "[B: max-kv-chunk=16,tile-kib=64]",
            "median of paired ratios B/A",
            "summary (medians",
        ],
    );
    // The idle boundaries name kernels (the swimlane carries their names).
    let idle = so.lines().find(|l| l.contains("largest idle")).unwrap();
    assert!(idle.contains("_bf16") || idle.contains("_f32"), "{idle}");
    let table = summary_rows(&so);
    assert_eq!(table.len(), 2, "{so}");
    for row in table {
        // shape, step ms, GB/s, %membw, %roofline, %roof best, %phase, %phase best,
        // %phase med, %outside, %net (of preemption: Linux reads the threads' schedstat),
        // bound.
        let f: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(f.len(), 12, "{row}");
        let v: Vec<f64> = f[1..11].iter().map(|x| x.parse().unwrap()).collect();
        assert!(v.iter().all(|x| x.is_finite() && *x >= 0.0), "{row}");
        // The share net of preemption is at most the raw one.
        assert!(v[9] <= v[8] + 1e-9, "{row}");
        // The quietest step is no slower than the median one.
        assert!(v[4] >= v[3], "{row}");
        assert!(v[6] >= v[5], "{row}");
        // The median pass is no faster than the best one: its bound is no tighter.
        assert!(v[7] >= v[5] - 1e-9, "{row}");
    }
}

#[test]
fn bench_qwen3_decode_names_the_tiling_keys_it_knows() {
    for (spec, needle) in [
        ("bogus=1", "unknown tiling key"),
        ("tile-kib", "expected KEY=VALUE"),
        ("max-kv-chunk=0", "positive integer"),
    ] {
        let out = simpler(&[
            "bench",
            "qwen3-decode",
            "--preset",
            "tiny",
            "--shapes",
            "1x40",
            "--versus",
            spec,
        ]);
        let se = text(&out.stderr);
        assert!(!out.status.success(), "{spec}: {se}");
        assert!(se.contains(needle), "{spec}: {se}");
    }
}

#[test]
fn bench_qwen3_prefill_reports_rates_against_the_machine() {
    let so = success_stdout(&[
        "bench",
        "qwen3-prefill",
        "--preset",
        "tiny",
        "--prompt-lens",
        "8,20",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--membw-seconds",
        "0.1",
        "--gemm-seconds",
        "0.05",
        "--outside-steps",
        "2",
    ]);
    assert_contains_all(
        &so,
        &[
            "simpler bench qwen3-prefill: preset tiny",
            // The outside share comes from warm steps after the measured ones, not a warm-up.
            "outside kernels",
            "(median of 2 steps at swimlane level 1 after the measured rounds, range ",
            "FMA peak",
            "prompt 8 tokens",
            "prompt 20 tokens",
            "step_ms: n=1",
            "tokens/s",
            "GEMM rate: bf16 gemm_bf16 on [20 x 256] x [512 x 256]^T",
            // Each prompt says which paths its kernels took and divides by that path's peak.
            "kernel paths: GEMM ",
            &format!(
                "% of the {} peak",
                simpler_kernels_cpu::path_for_batch(simpler_kernels_cpu::Isa::detected(), 20)
                    .name()
            ),
            "% of the GEMM rate",
            "roofline bound",
            "outside kernels",
            "summary (medians):",
        ],
    );
    // The summary: one row per prompt length, every figure a positive number.
    let table = summary_rows(&so);
    assert_eq!(table.len(), 2, "{so}");
    for (row, prompt) in table.iter().zip([8.0, 20.0]) {
        let v: Vec<f64> = row
            .split_whitespace()
            .map(|f| f.parse().unwrap_or(f64::NAN))
            .collect();
        assert_eq!(v.len(), 8, "{row}");
        assert_eq!(v[0], prompt, "{row}");
        // step ms, tokens/s, GFLOP/s: positive; %peak, %GEMM, %roofline: shares, which a
        // tiny prompt on AMX tiles (a peak of thousands of GFLOP/s) rounds to 0.0.
        assert!(v[1..4].iter().all(|x| x.is_finite() && *x > 0.0), "{row}");
        assert!(v[4..7].iter().all(|x| (0.0..=100.0).contains(x)), "{row}");
        // The share outside kernels is a fraction of the cores' time.
        assert!((0.0..=100.0).contains(&v[7]), "{row}");
    }
    let rate = so.lines().find(|l| l.contains("GEMM rate:")).unwrap();
    assert!(number_after(rate, "best") > 0.0, "{rate}");

    // `--versus`: interleaved pairs of steps on the two tilings, after the measured rounds.
    let so = success_stdout(&[
        "bench",
        "qwen3-prefill",
        "--preset",
        "tiny",
        "--prompt-lens",
        "20",
        "--rounds",
        "3",
        "--warmup",
        "1",
        "--membw-seconds",
        "0.1",
        "--gemm-seconds",
        "0.05",
        "--outside-steps",
        "1",
        "--versus",
        "prefill-rows=4,qkv-scratch-kib=4",
    ]);
    assert_contains_all(
        &so,
        &[
            "tiling compared (interleaved steps A B B A ..",
            "step_ms [A: this run's tiling]: n=3 (warm-up 1 discarded)",
            "step_ms [B: prefill-rows=4,qkv-scratch-kib=4]: n=3",
            "median of paired ratios B/A = ",
        ],
    );

    // Bad lengths name the fix.
    for (lens, needle) in [("8,0", "at least 1"), ("50000", "max_position_embeddings")] {
        let out = simpler(&[
            "bench",
            "qwen3-prefill",
            "--preset",
            "tiny",
            "--prompt-lens",
            lens,
            "--membw-seconds",
            "0.1",
        ]);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{lens}: {err}");
        assert!(err.contains(needle) && !err.contains("panicked"), "{err}");
    }
}

/// `run qwen3-decode` on the tiny preset, 3 rows of 130 tokens, two steps, one round, with
/// `extra` arguments.
fn short_tiny_decode(extra: &[&str]) -> std::process::Output {
    let mut a = vec!["run", "qwen3-decode", "--preset", "tiny"];
    a.extend_from_slice(extra);
    a.extend([
        "--batch",
        "3",
        "--seq-len",
        "130",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--membw-seconds",
        "0.2",
    ]);
    simpler(&a)
}

#[test]
fn run_qwen3_decode_with_int8_weights_checks_against_the_dequantised_golden() {
    let out = short_tiny_decode(&["--weights", "int8"]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    assert!(so.contains("weights: int8 per output channel"), "{so}");
    assert!(so.contains("ok: argmax identical for all 3 rows"), "{so}");
    // One layer meets the one-layer tolerance: the golden multiplies the exact dequantised
    // weights and rounds the activations as the kernels do.
    let out = short_tiny_decode(&["--weights", "int8", "--layers", "1"]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    assert!(
        so.contains("ok: hidden [768]: 100.000% within 0.003 + 0.003|e|")
            && so.contains("within 0.003 + 0.003|e| (need 98%)"),
        "{so}"
    );
}

/// `--replay verify` checks every step that would replay against a fresh capture of its own
/// orchestration and still checks against the golden; with `--versus-replay` (which needs
/// replayed steps) it is refused.
#[test]
fn replay_verify_checks_the_steps_and_is_refused_with_versus_replay() {
    let out = short_tiny_decode(&["--replay", "verify"]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    assert!(so.contains("ok: argmax identical for all 3 rows"), "{so}");
    assert!(
        so.contains("graph: --replay verify -> ")
            && so.contains(" captured (orch ")
            && !so.contains("replayed (orch ")
            && so.contains("checked against the graph captured before it"),
        "{so}"
    );
    refused(
        &[
            "bench",
            "qwen3-decode",
            "--preset",
            "tiny",
            "--replay",
            "verify",
            "--versus-replay",
        ],
        "drop --replay verify",
    );
}

/// `bench qwen3-decode` and `generate` run int8 weights (the quantised model, W8A8 by
/// default) and say so; two generations give the same tokens.
#[test]
fn bench_and_generate_run_int8_weights() {
    let out = simpler(&[
        "bench",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--weights",
        "int8",
        "--shapes",
        "2x64",
        "--rounds",
        "2",
        "--membw-seconds",
        "0.4",
    ]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    assert!(so.contains("weights: int8 per output channel"), "{so}");
    assert!(
        so.lines().any(|l| l.trim_start().starts_with("2x64 ")),
        "a summary row for 2x64: {so}"
    );
    let generate = || {
        let out = simpler(&[
            "generate",
            "--preset",
            "tiny",
            "--weights",
            "int8",
            "--prompt-ids",
            "5,17,300",
            "--max-new-tokens",
            "3",
        ]);
        let (so, se) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{so}\n{se}");
        // The report on stderr, the tokens on stdout.
        assert!(se.contains("weights: int8 per output channel"), "{se}");
        assert!(se.contains("3 new tokens"), "{se}");
        so.lines()
            .find(|l| !l.is_empty() && l.split(',').all(|t| t.parse::<u32>().is_ok()))
            .unwrap_or_else(|| panic!("a line of token ids: {so}"))
            .to_owned()
    };
    let tokens = generate();
    assert_eq!(tokens.split(',').count(), 3, "{tokens}");
    assert_eq!(generate(), tokens);
}

/// Every layout this CPU's path streams, named, checks against the golden; `tiled` off the AMX
/// path is refused, naming the path, rather than run row-major.
#[test]
fn run_qwen3_decode_with_each_bf16_layout_checks_against_the_golden() {
    let amx = simpler_kernels_cpu::tiled_weights_pay(simpler_kernels_cpu::Isa::detected());
    for layout in ["tiled", "row-major", "pairs"] {
        let out = short_tiny_decode(&["--bf16-layout", layout]);
        let (so, se) = (text(&out.stdout), text(&out.stderr));
        if layout == "tiled" && !amx {
            assert!(!out.status.success(), "{so}");
            assert!(
                se.contains("--bf16-layout tiled: only the AMX path"),
                "{se}"
            );
            println!("tiled refused: this CPU has no AMX path");
            continue;
        }
        assert!(out.status.success(), "{layout}: {so}\n{se}");
        assert!(
            so.contains("ok: argmax identical for all 3 rows"),
            "{layout}: {so}"
        );
        // The run says how its matrices lie (tiled only where the AMX path takes it).
        let named = match layout {
            "pairs" => Some("bf16 matrices paired"),
            "row-major" => Some("bf16 matrices row-major"),
            _ => None,
        };
        if let Some(named) = named {
            assert!(so.contains(named), "{layout}: {so}");
        }
    }
    let out = simpler(&[
        "run",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--bf16-layout",
        "column",
    ]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("column") && err.contains("--bf16-layout"),
        "{err}"
    );
}

#[test]
fn an_unsupported_weight_format_is_refused_by_name() {
    for cmd in [
        &["run", "qwen3-decode"][..],
        &["bench", "qwen3-decode"],
        &["generate"],
    ] {
        let mut a = cmd.to_vec();
        a.extend(["--preset", "tiny", "--weights", "int4"]);
        let out = simpler(&a);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{cmd:?}");
        assert!(
            err.contains("int4") && err.contains("--weights"),
            "{cmd:?}: {err}"
        );
    }
}

#[test]
fn bench_qwen3_decode_compares_decode_attention_paths() {
    let args = |path: &'static str| {
        [
            "bench",
            "qwen3-decode",
            "--preset",
            "tiny",
            "--shapes",
            "2x40",
            "--rounds",
            "2",
            "--warmup",
            "0",
            "--outside-steps",
            "1",
            "--membw-seconds",
            "0.1",
            "--versus-attention",
            path,
        ]
    };
    let out = simpler(&args("portable"));
    let so = text(&out.stdout);
    assert!(out.status.success(), "{so}\n{}", text(&out.stderr));
    assert_contains_all(
        &so,
        &[
            "decode attention kernels compared",
            "[B: portable]",
            "median of paired ratios B/A",
        ],
    );
    let out = simpler(&args("avx9"));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--versus-attention \"avx9\""),
        "{}",
        text(&out.stderr)
    );
    // A kernel above the run's path (capped by SIMPLER_ISA) would never run: refused by name
    // before any step.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_simpler"))
        .args(args("avx2"))
        .env("SIMPLER_ISA", "portable")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run simpler");
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    // (A CPU without AVX2 refuses it as a kernel it cannot run.)
    assert!(
        err.contains("--versus-attention avx2")
            && (err.contains("above this run's path portable")
                || err.contains("this CPU cannot run it")),
        "{err}"
    );
}

/// `--trace-overhead` runs steps without and with a trace, interleaved, and prints both
/// distributions and their paired ratio; the trace file it appended to holds the B steps.
#[test]
fn bench_qwen3_decode_measures_the_trace_overhead() {
    let dir = tmp("trace-overhead");
    let d = dir.to_str().unwrap();
    let so = success_stdout(&[
        "bench",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--shapes",
        "2x64",
        "--rounds",
        "4",
        "--warmup",
        "1",
        "--membw-seconds",
        "0.4",
        "--trace-overhead",
        "--output-dir",
        d,
    ]);
    assert_contains_all(
        &so,
        &[
            "trace overhead (A: no trace, B: every step's spans appended to a JSON Lines file):",
            "step_ms [A: no trace]: n=4",
            "step_ms [B: trace]: n=4",
            "median of paired ratios B/A = ",
        ],
    );
    let trace = std::fs::read_to_string(dir.join("trace.jsonl")).expect("the trace file");
    assert!(trace.lines().count() > 4, "{}", trace.lines().count());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `generate --profile-verbose` with `--num-prompts 2` and `--num-layers-override 1`: one line
/// of tokens per copy, and a report whose counts agree with what ran — one prefill, a warm-up
/// decode step kept out of the averages, a row per step, the layer table over one layer; the
/// trace marks that step, and only that one, warm-up.
#[test]
fn generate_profile_counts_what_ran() {
    let dir = tmp("generate-profile");
    let trace = dir.join("trace.jsonl");
    let out = simpler(&[
        "generate",
        "--preset",
        "tiny",
        "--prompt-ids",
        "5,17,300",
        "--max-new-tokens",
        "4",
        "--num-prompts",
        "2",
        "--num-layers-override",
        "1",
        "--profile-verbose",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    let all = format!("{so}\n{se}");
    for copy in ["[0] ", "[1] "] {
        let line = all
            .lines()
            .find(|l| l.starts_with(copy))
            .unwrap_or_else(|| panic!("{copy} in {all}"));
        assert_eq!(line[copy.len()..].split(',').count(), 4, "{line}");
    }
    assert_contains_all(
        &all,
        &[
            "2 x 3 prompt tokens, 8 new tokens",
            "1 layers",
            "profile:",
            "per layer (span of the layer tasks / 1;",
        ],
    );
    let count = |label: &str| -> usize {
        let line = all
            .lines()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap_or_else(|| panic!("{label} in {all}"));
        line.trim_start()[label.len()..]
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a count in {line}"))
    };
    // 4 new tokens: a prefill step (the first token), then 3 decode steps, the first of them
    // the warm-up.
    assert_eq!(count("prefill chunks"), 1, "{all}");
    assert_eq!(count("decode warm-up step"), 1, "{all}");
    assert_eq!(count("decode per step (TPOT)"), 2, "{all}");
    let steps: Vec<&str> = all
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("steps:"))
        .skip(1)
        .take_while(|l| l.trim_start().starts_with(char::is_numeric))
        .collect();
    // Rows: the prefill (2 rows, 6 tokens), then the decode steps, the first the warm-up.
    assert_eq!(steps.len(), 4, "{all}");
    let words = |row: &str| row.split_whitespace().take(4).collect::<Vec<_>>().join(" ");
    assert_eq!(words(steps[0]), "0 prefill 2 6", "{all}");
    assert!(steps[1].ends_with("(warm-up)"), "{all}");
    assert_eq!(words(steps[3]), "3 decode 2 2", "{all}");
    let t = simpler_dfx::reader::read_traces(&[&trace]).unwrap();
    let marks: Vec<(Option<String>, bool)> = simpler_dfx::timing::invocations(&t)
        .into_iter()
        .map(|i| (i.label, i.warmup))
        .collect();
    let (p, d) = (Some("prefill".to_string()), Some("decode".to_string()));
    assert_eq!(
        marks,
        [
            (p, false),
            (d.clone(), true),
            (d.clone(), false),
            (d, false)
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--versus-isa` names what each side runs on this run's weights: this run's side is the GEMM
/// path the report's `kernel paths` line names (paired weights at two rows take the AVX-512
/// BF16 kernel where the CPU has it, not the AVX2 passes that row-major weights would), and the
/// other side the path the cap takes on the same layout.
#[test]
fn bench_versus_isa_names_the_paths_of_this_runs_layout() {
    for layout in ["pairs", "row-major"] {
        let out = simpler(&[
            "bench",
            "qwen3-decode",
            "--preset",
            "tiny",
            "--shapes",
            "2x40",
            "--bf16-layout",
            layout,
            "--versus-isa",
            "avx2",
            "--rounds",
            "3",
            "--warmup",
            "0",
            "--outside-steps",
            "1",
            "--membw-seconds",
            "0.1",
        ]);
        let so = text(&out.stdout);
        if !out.status.success() && text(&out.stderr).contains("avx2") {
            println!("skipped ({layout}): this CPU has no AVX2 path");
            continue;
        }
        assert!(out.status.success(), "{so}\n{}", text(&out.stderr));
        let gemm = so
            .lines()
            .find_map(|l| l.trim().strip_prefix("kernel paths: GEMM "))
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no kernel paths line: {so}"));
        println!("{layout}: this run's GEMM {gemm}");
        assert!(
            so.contains(&format!("[A: {gemm} (this run)]")),
            "{layout}: the comparison names another path than the run's {gemm}: {so}"
        );
        assert!(so.contains("B: avx2"), "{layout}: {so}");
    }
}
