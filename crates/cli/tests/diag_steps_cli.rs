//! Diagnostics of commands that run many steps: every step keeps its own swimlane and deps
//! files (none overwrites another), `--diag-steps` picks which, the command prints one line
//! about them, and dropped swimlane records are reported once with the flag that fixes them.

mod common;

use common::{simpler, text, tmp};

use std::path::Path;

/// `run qwen3-decode` of 2 rounds (1 warm-up) × 2 steps = 4 steps, with `extra` flags;
/// returns stderr.
fn decode(dir: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--batch",
        "1",
        "--seq-len",
        "8",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--warmup",
        "1",
        "--membw-seconds",
        "0.05",
        "--no-check",
        "--swimlane",
        "1",
        "--dep-gen",
        "--output-dir",
        dir.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = simpler(&args);
    let se = text(&out.stderr);
    assert!(out.status.success(), "{}\n{se}", text(&out.stdout));
    se
}

fn steps_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_step_keeps_its_own_diagnostics_and_one_line_says_so() {
    let dir = tmp("all");
    let se = decode(&dir, &[]);
    assert_eq!(
        steps_in(&dir),
        ["step-000000", "step-000001", "step-000002", "step-000003"]
    );
    for step in steps_in(&dir) {
        let s = simpler_dfx::diag::load_joined(&dir.join(&step), None).unwrap();
        assert!(!s.swimlane.tasks.is_empty(), "{step}");
        assert!(s.deps.is_some(), "{step}: deps.json beside the swimlane");
    }
    // No step wrote over the top-level files.
    assert!(!dir.join("swimlane.json").exists());
    assert!(!dir.join("deps.json").exists());
    // The trace keeps all four steps.
    let trace = simpler_dfx::reader::read_traces(&[dir.join("trace.jsonl")]).unwrap();
    // The warm-up round's steps are marked so (the trace tools leave them out).
    let marks: Vec<bool> = simpler_dfx::timing::invocations(&trace)
        .iter()
        .map(|i| i.warmup)
        .collect();
    assert_eq!(marks, [true, true, false, false]);
    let timing = simpler(&["trace", "timing", dir.join("trace.jsonl").to_str().unwrap()]);
    let table = text(&timing.stdout);
    assert!(timing.status.success(), "{}", text(&timing.stderr));
    assert!(
        table.contains("invocations 4")
            && table.contains("(2 invocations marked warm-up left out)"),
        "{table}"
    );
    let wrote: Vec<&str> = se.lines().filter(|l| l.starts_with("wrote")).collect();
    assert_eq!(wrote.len(), 1, "{se}");
    assert!(
        wrote[0].contains("the spans of 4 steps")
            && wrote[0].contains("the diagnostics of 4 steps")
            && wrote[0].contains("step-000000 .. ")
            && wrote[0].contains("step-000003"),
        "{se}"
    );
    // The trace tools refuse the parent directory, naming the steps, and read a step.
    let out = simpler(&["trace", "swimlane", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("holds the diagnostics of 4 steps"),
        "{}",
        text(&out.stderr)
    );
    let step = dir.join("step-000002");
    let out = simpler(&["trace", "swimlane", step.to_str().unwrap()]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(so.contains("happens-before violations: 0"), "{so}");
    // Qwen3 routes cross-phase dependencies through barrier tasks (no block records): the
    // check goes through them instead of skipping those edges.
    let through: usize = so
        .split_once(" checked (")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no arrow count in {so}"));
    assert!(through > 0, "{so}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn diag_steps_keeps_only_the_steps_asked_for() {
    let dir = tmp("some");
    let se = decode(&dir, &["--diag-steps", "1,3-9"]);
    assert_eq!(steps_in(&dir), ["step-000001", "step-000003"]);
    assert!(se.contains("the diagnostics of 2 steps"), "{se}");
    assert!(se.contains("the spans of 4 steps"), "{se}");
    let out = simpler(&["run", "qwen3-decode", "--diag-steps", "3-1"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("runs backwards"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dropped_records_are_warned_about_once_with_the_flag_that_fixes_them() {
    let dir = tmp("dropped");
    let se = decode(&dir, &["--swimlane-capacity", "5"]);
    let s = simpler_dfx::diag::read_swimlane(&dir.join("step-000000/swimlane.json")).unwrap();
    // The file itself says it is incomplete.
    assert!(s.dropped > 0, "{} kept, none dropped", s.tasks.len());
    let warnings: Vec<&str> = se.lines().filter(|l| l.starts_with("warning")).collect();
    assert_eq!(warnings.len(), 1, "{se}");
    assert!(
        warnings[0].contains("4 of 4 steps") && warnings[0].contains("--swimlane-capacity"),
        "{se}"
    );
    // The trace tools name the same flag.
    let out = simpler(&[
        "trace",
        "swimlane",
        dir.join("step-000000").to_str().unwrap(),
    ]);
    assert!(
        text(&out.stdout).contains("--swimlane-capacity"),
        "{}",
        text(&out.stdout)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The benches that measure several cases write each case's recorded step into a folder of
/// its own under `--output-dir` (they used to record the diagnostics and write none), and
/// with `--trace` alone the last measured step's spans.
#[test]
fn benches_write_each_cases_recorded_step_apart() {
    let dir = tmp("bench-cases");
    let d = dir.to_str().unwrap();
    let quick = [
        "--preset",
        "tiny",
        "--rounds",
        "1",
        "--warmup",
        "1",
        "--membw-seconds",
        "0.05",
    ];
    let mut decode = vec![
        "bench",
        "qwen3-decode",
        "--shapes",
        "1x16,2x32",
        "--output-dir",
        d,
    ];
    decode.extend(quick);
    let out = simpler(&decode);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for shape in ["1x16", "2x32"] {
        let sw = std::fs::read_to_string(dir.join(shape).join("swimlane.json")).unwrap();
        assert!(
            sw.contains("gemm_tile_bf16"),
            "{shape}: no GEMM in its swimlane"
        );
    }
    // The trace tools given the parent directory name the cases to choose from.
    let out = simpler(&["trace", "swimlane", d]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("holds the diagnostics of 2 cases") && err.contains("1x16"),
        "{err}"
    );
    let mut prefill = vec![
        "bench",
        "qwen3-prefill",
        "--prompt-lens",
        "16,8",
        "--output-dir",
        d,
    ];
    prefill.extend(quick);
    prefill.extend(["--gemm-seconds", "0"]);
    let out = simpler(&prefill);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for len in ["16", "8"] {
        assert!(
            dir.join(len).join("swimlane.json").is_file(),
            "prompt {len}"
        );
    }
    let trace = dir.join("spans.jsonl");
    let t = trace.to_str().unwrap();
    let mut traced = vec!["bench", "qwen3-decode", "--shapes", "1x16", "--trace", t];
    traced.extend(quick);
    let out = simpler(&traced);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let spans = std::fs::read_to_string(&trace).unwrap();
    assert!(spans.lines().count() > 1, "{spans}");
    let _ = std::fs::remove_dir_all(&dir);
}
