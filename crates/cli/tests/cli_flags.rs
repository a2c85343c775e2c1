//! Flags mean one thing and fail early: runtime flags are checked before a model loads and
//! named as flags, and `--check` is one tri-state switch.

mod common;

use common::{refused, simpler, text};

/// Bad runtime flags are refused before any model is loaded or memory checked, naming the
/// flag (not the `CallConfig` field).
#[test]
fn runtime_flags_are_checked_before_loading_and_named_as_flags() {
    for args in [
        &[
            "run",
            "qwen3-decode",
            "--preset",
            "qwen3-14b",
            "--swimlane",
            "2",
        ][..],
        &[
            "generate",
            "--preset",
            "qwen3-14b",
            "--prompt-ids",
            "1",
            "--dep-gen",
        ],
        &[
            "bench",
            "qwen3-decode",
            "--preset",
            "qwen3-14b",
            "--ring-stats",
        ],
        &[
            "bench",
            "qwen3-prefill",
            "--preset",
            "qwen3-14b",
            "--swimlane",
            "1",
        ],
    ] {
        // The budget would let the 14B model load: the flag must stop it first.
        let mut a = args.to_vec();
        a.extend(["--memory-budget", "100000"]);
        let out = simpler(&a);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            err.contains("--output-dir") && !err.contains("CallConfig"),
            "{args:?}: {err}"
        );
        assert!(
            !err.contains("memory:"),
            "{args:?}: checked memory first: {err}"
        );
    }
    let out = simpler(&[
        "run",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--ring-heap",
        "1000",
    ]);
    let err = text(&out.stderr);
    assert!(err.contains("--ring-heap = 1000"), "{err}");
    let out = simpler(&["run", "demo", "--cores", "0"]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("0 cores: give 1 to 1024"),
        "{err}"
    );
    // A swimlane capacity where no swimlane is recorded would size nothing, with or without
    // somewhere to write one.
    for more in [&[][..], &["--output-dir", "/tmp/unused"]] {
        let mut a = vec!["run", "demo", "--swimlane-capacity", "64"];
        a.extend(more);
        let out = simpler(&a);
        let err = text(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains("--swimlane-capacity: sizes the swimlane records")
                && err.contains("--swimlane N"),
            "{err}"
        );
    }
}

/// The benches record steps at swimlane level 1 on their own to measure the share outside
/// kernels: there `--swimlane-capacity` applies without `--swimlane`, and a capacity too small
/// for a step leaves the share unmeasured, saying why, instead of counting the dropped tasks'
/// time as time outside kernels (it printed ~99%).
#[test]
fn the_benches_recorded_steps_are_sized_by_the_capacity_flag() {
    for args in [
        &["bench", "qwen3-decode", "--shapes", "1x16", "--rounds", "1"][..],
        &[
            "bench",
            "qwen3-prefill",
            "--prompt-lens",
            "8",
            "--rounds",
            "1",
        ],
    ] {
        let mut a = args.to_vec();
        a.extend(["--preset", "tiny", "--membw-seconds", "0.2"]);
        let whole = simpler(&a);
        assert!(whole.status.success(), "{}", text(&whole.stderr));
        assert!(
            text(&whole.stdout).contains("outside kernels ")
                && !text(&whole.stdout).contains("not measured"),
            "{}",
            text(&whole.stdout)
        );
        a.extend(["--swimlane-capacity", "4"]);
        let out = simpler(&a);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(
            stdout.contains("outside kernels not measured: the swimlanes of all")
                && stdout.contains("dropped kernel records")
                && stdout.contains("--swimlane-capacity")
                && !stdout.contains("outside kernels 9"),
            "{stdout}"
        );
    }
}

/// The dependency map's size is a flag: it reaches the runtime (too small a map fails with the
/// flag as the knob to raise, the entries counted as readers and writers), a bad value is
/// refused naming it, and the fan-out bench sizes its own map for its readers.
#[test]
fn the_dependency_map_is_sized_by_a_flag() {
    let bench = |readers: &str, more: &[&str]| {
        let mut a = vec![
            "bench",
            "runtime",
            "--tasks",
            "100",
            "--hops",
            "10",
            "--blocks",
            "10",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--readers",
            readers,
        ];
        a.extend_from_slice(more);
        simpler(&a)
    };
    let fanout = |more: &[&str]| bench("100000", more);
    let out = fanout(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("ns_per_reader"));
    assert!(
        text(&out.stdout).contains("in scopes of 2048, overlapped"),
        "{}",
        text(&out.stdout)
    );
    // `--serial` makes the throughput section's runs serial: its label says so.
    let out = bench("10", &["--serial"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("in scopes of 2048, serial (--serial"),
        "{}",
        text(&out.stdout)
    );
    let out = fanout(&["--tensormap-capacity", "1024"]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("TENSORMAP_OVERFLOW")
            && err.contains("readers and writers")
            && err.contains("raise tensormap_capacity to 4096 for this run: --tensormap-capacity"),
        "{err}"
    );
    let out = simpler(&["run", "demo", "--tensormap-capacity", "8"]);
    let err = text(&out.stderr);
    assert!(err.contains("--tensormap-capacity = 8"), "{err}");
    let out = simpler(&["bench", "runtime", "--readers", "2000000"]);
    let err = text(&out.stderr);
    assert!(
        err.contains("--readers 2000000") && err.contains("2^20") && out.stdout.is_empty(),
        "{err}"
    );
}

#[test]
fn check_is_one_tri_state_switch() {
    let run = |extra: &[&str]| {
        let mut a = vec![
            "run",
            "qwen3-decode",
            "--preset",
            "tiny",
            "--seq-len",
            "8",
            "--steps",
            "1",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--membw-seconds",
            "0.2",
        ];
        a.extend_from_slice(extra);
        simpler(&a)
    };
    for (extra, checked) in [
        (&[][..], true), // auto: the tiny golden is cheap
        (&["--check"][..], true),
        (&["--check", "on"][..], true),
        (&["--check", "off"][..], false),
        (&["--no-check"][..], false),
    ] {
        let out = run(extra);
        let so = text(&out.stdout);
        assert!(out.status.success(), "{extra:?}: {}", text(&out.stderr));
        assert_eq!(so.contains("check vs golden"), checked, "{extra:?}: {so}");
        assert_eq!(so.contains("check: off"), !checked, "{extra:?}: {so}");
    }
    let out = run(&["--check", "on", "--no-check"]);
    assert!(!out.status.success());
    let out = run(&["--check", "sometimes"]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("auto") && err.contains("off"),
        "{err}"
    );
}

/// `bench serve --preset tiny --streams 1` with `more`.
fn bench_serve_tiny(more: &[&str]) -> std::process::Output {
    let mut args = vec!["bench", "serve", "--preset", "tiny", "--streams", "1"];
    args.extend_from_slice(more);
    simpler(&args)
}

/// `bench serve --streams 1,4`: a row per stream count with its throughput, latency
/// percentiles and ratios (one stream against itself is 1.00), and the engine batched the four
/// streams' decodes together.
#[test]
fn bench_serve_reports_several_stream_counts_against_one_stream() {
    let out = simpler(&[
        "bench",
        "serve",
        "--preset",
        "tiny",
        "--streams",
        "1,4",
        "--prompt-len",
        "16",
        "--max-tokens",
        "8",
        "--rounds",
        "2",
    ]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{se}");
    let row = |n: &str| -> Vec<f64> {
        so.lines()
            .map(str::split_whitespace)
            .map(Iterator::collect::<Vec<_>>)
            .find(|w| w.first() == Some(&n) && w.len() == 10)
            .unwrap_or_else(|| panic!("a row for {n} streams in\n{so}"))[1..]
            .iter()
            .map(|v| v.parse().unwrap_or_else(|_| panic!("{v} in\n{so}")))
            .collect()
    };
    let (one, four) = (row("1"), row("4"));
    // wall_s out_tok/s ttft_p50 ttft_p99 tpot_p50 tpot_p99 vs_N_x_single step_bN vs_bN_step
    assert_eq!(one[6], 1.0, "{so}");
    for r in [&one, &four] {
        // wall_s may print as 0.00 on the tiny model; every rate and latency is positive.
        assert!(r[0] >= 0.0 && r[1..].iter().all(|&v| v > 0.0), "{so}");
        assert!(r[2] <= r[3] && r[4] <= r[5], "p50 above p99: {so}");
    }
    assert!(so.contains("out_tok_per_s_4_streams: n=2"), "{so}");
    let at_most: usize = so
        .split("at most ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the engine's summary in\n{so}"));
    assert!(at_most >= 2, "the four streams never shared a step: {so}");
}

/// `serve` and `bench serve` write every engine step's outputs as `run qwen3-decode` does:
/// each step's spans to the trace, the diagnostics of the steps `--diag-steps` picks to
/// `DIR/step-NNNNNN/` (they used to record them and write nothing), and the runtime flags the
/// engine takes reach its steps.
#[test]
fn serving_commands_write_their_steps_diagnostics() {
    let dir = std::env::temp_dir().join(format!("simpler-serve-diag-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let out = bench_serve_tiny(&[
        "--prompt-len",
        "4",
        "--max-tokens",
        "3",
        "--swimlane",
        "1",
        "--output-dir",
        d,
        "--diag-steps",
        "0-1",
    ]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("the diagnostics of 2 steps"), "{err}");
    // The report says which diagnostics were on (their cost is in its timings).
    assert!(
        text(&out.stdout).contains("diagnostics: swimlane=level1 dep_gen=off ring_stats=off trace=on (timings include their cost)"),
        "{}",
        text(&out.stdout)
    );
    for step in ["step-000000", "step-000001"] {
        let sw = std::fs::read_to_string(dir.join(step).join("swimlane.json")).unwrap();
        assert!(sw.contains("gemm_tile_bf16"), "{step}");
    }
    assert!(!dir.join("step-000002").exists());
    // Every step's spans: the warm-up request's and the measured one's steps and the timed
    // bare decode steps, far more than the two kept.
    let spans = std::fs::read_to_string(dir.join("trace.jsonl")).unwrap();
    let runs = |label: &str| {
        spans
            .lines()
            .filter(|l| l.contains(&format!("\"label\":\"{label}\"")))
            .count()
    };
    // The warm-up round's runs are marked warm-up, and in each of the 3 measured rounds the
    // first timed bare step: 3 engine steps (a prefill, two decodes) and 17 timed steps per
    // round.
    let trace = simpler_dfx::reader::read_traces(&[dir.join("trace.jsonl")]).unwrap();
    let marks: Vec<bool> = simpler_dfx::timing::invocations(&trace)
        .iter()
        .map(|i| i.warmup)
        .collect();
    let measured = [(3, false), (1, true), (16, false)];
    let want: Vec<bool> = std::iter::once((20, true))
        .chain(measured.into_iter().cycle().take(9))
        .flat_map(|(n, w)| std::iter::repeat_n(w, n))
        .collect();
    assert_eq!(marks, want);
    // Each run is labelled by the engine's path (`trace timing` groups them apart).
    assert!(runs("serve.prefill") >= 2, "the two requests' prefills");
    assert!(
        runs("serve.decode") > 2,
        "{} decode runs",
        runs("serve.decode")
    );
    // A folder that cannot be made is refused before any request runs.
    let blocked = dir.join("trace.jsonl").join("sub");
    let out = bench_serve_tiny(&["--output-dir", blocked.to_str().unwrap()]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("cannot be made"), "{err}");
    assert!(!text(&out.stdout).contains("streams"), "measured anyway");
    std::fs::remove_dir_all(&dir).unwrap();
    // A write that fails after the folder was made (step 1's folder name is taken by a
    // file): the engine keeps running its steps to the end of the benchmark (a server keeps
    // serving), the error is printed once and nothing more is written, and `bench serve`
    // exits non-zero after its report.
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("step-000001"), "in the way").unwrap();
    let out = bench_serve_tiny(&[
        "--prompt-len",
        "4",
        "--max-tokens",
        "3",
        "--swimlane",
        "1",
        "--output-dir",
        d,
    ]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(text(&out.stdout).contains("engine: "), "no report: {err}");
    assert_eq!(
        err.matches("the engine's step outputs are no longer written")
            .count(),
        1,
        "{err}"
    );
    assert!(
        err.contains("the steps' outputs asked for were not all written"),
        "{err}"
    );
    assert!(dir.join("step-000000").join("swimlane.json").is_file());
    assert_eq!(
        std::fs::read_to_string(dir.join("step-000001")).unwrap(),
        "in the way"
    );
    assert!(!dir.join("step-000002").exists(), "written after the error");
    std::fs::remove_dir_all(&dir).unwrap();
    // A ring heap too small for the longest step the engine may run is refused before the
    // model loads, with the step's need (the engine's steps run with the flag's rings).
    let out = bench_serve_tiny(&[
        "--prompt-len",
        "4",
        "--max-tokens",
        "2",
        "--ring-heap",
        "1K",
    ]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--ring-heap: ring 1 holds 1 KiB, and a prefill step of")
            && !err.contains("simpler bench serve:"),
        "{err}"
    );
}

/// `--diag-steps` picks steps of the commands that write many; a command that writes one
/// run's diagnostics refuses it by name before it runs (it used to write them anyway).
#[test]
fn diag_steps_is_refused_where_one_step_is_written() {
    for args in [
        &["run", "demo"][..],
        &["bench", "runtime"],
        &["bench", "qwen3-decode", "--preset", "tiny"],
        &["bench", "qwen3-prefill", "--preset", "tiny"],
        &["run", "dsv4", "--layer", "swa", "--preset", "tiny"],
        &["bench", "dsv4", "--kernel", "swa", "--preset", "tiny"],
    ] {
        let mut a = args.to_vec();
        a.extend([
            "--diag-steps",
            "0-2",
            "--swimlane",
            "1",
            "--output-dir",
            "/tmp/unused",
        ]);
        refused(&a, "--diag-steps: `simpler ");
    }
    // Where it applies, it needs a diagnostic to pick steps of (it was accepted and did
    // nothing).
    refused(
        &[
            "generate",
            "--preset",
            "qwen3-tiny",
            "--prompt",
            "x",
            "--diag-steps",
            "0",
        ],
        "--diag-steps: picks the steps whose diagnostics are written, and none is on",
    );
}

/// `bench qwen3-prefill --max-kv-chunk` is refused by name: prefill attention is not split
/// by KV chunks, so the flag would change nothing.
#[test]
fn max_kv_chunk_is_refused_for_prefill() {
    refused(
        &[
            "bench",
            "qwen3-prefill",
            "--preset",
            "tiny",
            "--max-kv-chunk",
            "128",
        ],
        "--max-kv-chunk: prefill attention",
    );
}

/// Values that were quietly raised or flags that changed nothing alone are refused by name:
/// zero tile sizes and counts, a `bench membw` shorter than its passes or with an empty
/// buffer or no thread, the `trace` flags that only qualify another, and a shape or prompt
/// length given twice (its case's folder would replace the first one's files).
#[test]
fn out_of_range_values_and_lone_qualifiers_are_refused() {
    for (args, needle) in [
        (
            &["run", "qwen3-decode", "--preset", "tiny", "--tile-kib", "0"][..],
            "--tile-kib",
        ),
        (
            &[
                "bench",
                "qwen3-decode",
                "--preset",
                "tiny",
                "--tiles-per-core",
                "0",
            ],
            "--tiles-per-core",
        ),
        (
            &[
                "run",
                "qwen3-decode",
                "--preset",
                "tiny",
                "--max-kv-chunk",
                "0",
            ],
            "--max-kv-chunk",
        ),
        (
            &[
                "bench",
                "qwen3-decode",
                "--preset",
                "tiny",
                "--outside-steps",
                "0",
            ],
            "--outside-steps",
        ),
        (
            &[
                "bench",
                "qwen3-prefill",
                "--preset",
                "tiny",
                "--outside-steps",
                "0",
            ],
            "--outside-steps",
        ),
        (
            &["bench", "membw", "--seconds", "0.1"],
            "--seconds 0.1: give at least 0.4",
        ),
        (
            &["bench", "membw", "--buffer-mib", "0"],
            "--buffer-mib 0: give at least 1",
        ),
        (
            &["trace", "timing", "/nonexistent.jsonl", "--warmup", "2"],
            "--warmup: ",
        ),
        (&["trace", "deps", "/nonexistent", "--reduce"], "--reduce: "),
        (
            &[
                "bench",
                "qwen3-decode",
                "--preset",
                "tiny",
                "--shapes",
                "1x16,2x16,1x16",
            ][..],
            "--shapes: 1x16 is given twice",
        ),
        (
            &[
                "bench",
                "qwen3-prefill",
                "--preset",
                "tiny",
                "--prompt-lens",
                "16,8,16",
            ],
            "--prompt-lens: 16 is given twice",
        ),
        (&["bench", "membw", "--threads", "0"], "0 cores: give 1 to"),
        (
            &[
                "bench",
                "qwen3-decode",
                "--preset",
                "tiny",
                "--shapes",
                "1x8x3",
            ],
            "shape \"1x8x3\": sequence length \"8x3\" is not a whole number",
        ),
        (
            &[
                "bench",
                "qwen3-decode",
                "--preset",
                "tiny",
                "--shapes",
                "x8",
            ],
            "shape \"x8\": batch \"\" is not a whole number",
        ),
        (
            &[
                "bench",
                "qwen3-decode",
                "--preset",
                "tiny",
                "--versus",
                "tile-kib=4,tile-kib=8",
            ],
            "\"tile-kib\" is given twice",
        ),
        (
            &["bench", "qwen3-decode", "--preset", "tiny", "--versus="],
            "no override",
        ),
        (
            &[
                "bench",
                "qwen3-decode",
                "--preset",
                "tiny",
                "--versus",
                "prefill-rows=32",
            ],
            "--versus prefill-rows: a prefill step's key",
        ),
        (
            &[
                "bench",
                "qwen3-prefill",
                "--preset",
                "tiny",
                "--versus",
                "max-kv-chunk=128",
            ],
            "--versus max-kv-chunk: prefill attention is not split",
        ),
        (
            &[
                "bench",
                "qwen3-prefill",
                "--preset",
                "tiny",
                "--versus",
                "qkv-scratch-kib=0",
            ],
            "the value must be a positive integer",
        ),
        (
            &["bench", "collectives", "--ranks", "2,2"],
            "--ranks: 2 is given twice",
        ),
        (
            &["bench", "collectives", "--rank-timeout-secs", "0"],
            "0 seconds: give 1 to 86400",
        ),
        (
            &[
                "run",
                "dsv4",
                "--layer",
                "moe",
                "--preset",
                "tiny",
                "--rank-timeout-secs",
                "5",
            ],
            "--rank-timeout-secs: only with --ep",
        ),
        (
            &[
                "run",
                "dsv4",
                "--layer",
                "moe",
                "--preset",
                "tiny",
                "--ep",
                "1",
                "--rank-timeout-secs",
                "1",
            ],
            "--rank-timeout-secs: --ep 1 runs its one rank in this process",
        ),
        (
            &[
                "run",
                "dsv4",
                "--layer",
                "moe",
                "--preset",
                "tiny",
                "--ep",
                "2",
                "--membw-seconds",
                "10",
            ],
            "--membw-seconds 10: at most 1 with --ep",
        ),
        (
            &["bench", "collectives", "--sizes", "1024,1024"],
            "--sizes: 1024 is given twice",
        ),
        (
            &["bench", "runtime", "--scope", "0"],
            "--scope 0: give at least 1",
        ),
    ] {
        refused(args, needle);
    }
}

/// `bench runtime` writes the last round of each section (A's five, each to its own folder)
/// and variant B's spans and diagnostics where B's options say (it used to record them and
/// write nothing), and refuses B's `--diag-steps` before anything runs.
#[test]
fn bench_runtime_writes_every_sections_outputs() {
    let dir = std::env::temp_dir().join(format!("simpler-runtime-b-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let b = format!(
        "--cores 1 --swimlane 1 --output-dir {} --trace {}",
        dir.join("b").display(),
        dir.join("b.jsonl").display()
    );
    let small = [
        "bench",
        "runtime",
        "--tasks",
        "2000",
        "--hops",
        "100",
        "--blocks",
        "100",
        "--readers",
        "64",
        "--rounds",
        "2",
        "--warmup",
        "1",
    ];
    let a_dir = dir.join("a");
    let mut args = small.to_vec();
    args.extend([
        "--swimlane",
        "1",
        "--dep-gen",
        "--ring-stats",
        "--output-dir",
        a_dir.to_str().unwrap(),
        "--compare",
        &b,
    ]);
    let out = simpler(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(dir.join("b").join("swimlane.json").is_file());
    // Every section of A writes its last round to its own folder; none replaces another's.
    for section in ["throughput", "serial", "chain", "spmd", "fanout"] {
        for file in ["swimlane.json", "deps.json"] {
            let f = a_dir.join(section).join(file);
            assert!(f.is_file(), "{} missing", f.display());
        }
    }
    let chain = std::fs::read_to_string(a_dir.join("chain").join("deps.json")).unwrap();
    let fanout = std::fs::read_to_string(a_dir.join("fanout").join("deps.json")).unwrap();
    assert_ne!(chain, fanout);
    // The analysis tools take several runs and report each, headed by its files.
    let (a_chain, a_spmd) = (a_dir.join("chain"), a_dir.join("spmd"));
    let (c, p) = (a_chain.to_str().unwrap(), a_spmd.to_str().unwrap());
    for tool in ["overhead", "idle", "critical-path"] {
        let out = simpler(&["trace", tool, c, p]);
        let so = text(&out.stdout);
        assert!(out.status.success(), "{tool}: {}", text(&out.stderr));
        for dir in [&a_chain, &a_spmd] {
            let head = format!("swimlane {}", dir.join("swimlane.json").display());
            assert_eq!(so.matches(&head).count(), 1, "{tool}: {so}");
        }
        refused(
            &["trace", tool, c, p, "--deps", "/tmp/unused.json"],
            "--deps names one graph; with 2 runs",
        );
    }
    // `trace deps` summarises several graphs, each headed by its file; it draws one.
    let out = simpler(&["trace", "deps", c, p]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "deps: {}", text(&out.stderr));
    for dir in [&a_chain, &a_spmd] {
        let head = format!("deps {}", dir.join("deps.json").display());
        assert_eq!(so.matches(&head).count(), 1, "deps: {so}");
    }
    assert_eq!(so.matches("\nfingerprint ").count(), 2, "deps: {so}");
    let one = simpler(&["trace", "deps", c]);
    assert!(one.status.success(), "deps: {}", text(&one.stderr));
    assert!(
        so.contains(&text(&one.stdout)),
        "one graph's summary is the same alone: {so}"
    );
    for flag in ["--dot", "--html"] {
        refused(
            &["trace", "deps", c, p, flag, "/tmp/unused.out"],
            &format!("{flag} draws one graph; with 2 graphs give one file"),
        );
    }
    let out = simpler(&["trace", "rings", c, p]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for dir in [&a_chain, &a_spmd] {
        let head = format!("ring stats {}", dir.join("ring_stats.json").display());
        assert_eq!(so.matches(&head).count(), 1, "{so}");
    }
    assert!(
        std::fs::read_to_string(dir.join("b.jsonl"))
            .unwrap()
            .lines()
            .count()
            > 1
    );
    let mut args = small.to_vec();
    args.extend([
        "--compare",
        "--diag-steps 0 --swimlane 1 --output-dir /tmp/unused",
    ]);
    // Refused before variant A runs: nothing is measured or printed.
    refused(&args, "--diag-steps: `simpler bench runtime --compare`");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `bench membw` measures the int8 dot-product peak of each int8 path this CPU has (the
/// denominator of the int8 products' ratios), on one thread and on all of them, and of no
/// other path.
#[test]
fn bench_membw_reports_the_int8_peak_of_each_int8_path_here() {
    let out = simpler(&["bench", "membw", "--seconds", "0.4", "--buffer-mib", "64"]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    #[cfg(target_arch = "x86_64")]
    let paths = [
        ("avx2", is_x86_feature_detected!("avx2")),
        (
            "avx512-vnni",
            is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw"),
        ),
    ];
    #[cfg(not(target_arch = "x86_64"))]
    let paths = [("avx2", false), ("avx512-vnni", false)];
    for (path, here) in paths {
        let line = so
            .lines()
            .find(|l| l.starts_with(&format!("int8 dot-product peak, {path} ")));
        let Some(line) = line else {
            assert!(!here, "no int8 peak for {path}: {so}");
            continue;
        };
        assert!(
            here,
            "an int8 peak for {path}, which this CPU lacks: {line}"
        );
        let rate = |after: &str| -> f64 {
            let at = line
                .find(after)
                .unwrap_or_else(|| panic!("{after:?} in {line}"));
            line[at + after.len()..]
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap_or_else(|_| panic!("a rate after {after:?}: {line}"))
        };
        let (one, all) = (rate("1 thread "), rate(" threads "));
        assert!(one > 0.0 && all > 0.0, "{line}");
        assert!(line.contains("GOP/s"), "{line}");
    }
}

/// `bench membw` prints the spread of each bandwidth figure's passes as every bench prints its
/// headline metric (n, min/median/mean/max, trimmed mean, 95% interval), and the best and
/// median it reports are that summary's max and median.
#[test]
fn bench_membw_reports_the_passes_spread() {
    let out = simpler(&[
        "bench",
        "membw",
        "--seconds",
        "0.4",
        "--buffer-mib",
        "64",
        "--threads",
        "2",
    ]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let field = |line: &str, key: &str| -> f64 {
        let at = line
            .find(&format!("{key}="))
            .unwrap_or_else(|| panic!("{key} in {line}"));
        line[at + key.len() + 1..]
            .split([' ', ','])
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    for (label, summary) in [
        ("streaming read, 1 thread:", "read_gbs_1_thread:"),
        ("streaming read, 2 threads:", "read_gbs_2_threads:"),
    ] {
        let head = so.lines().find(|l| l.starts_with(label)).expect(label);
        let line = so
            .lines()
            .find(|l| l.trim_start().starts_with(summary))
            .expect(summary);
        assert!(
            line.contains("(warm-up 1 discarded)") && line.contains("ci95=["),
            "{line}"
        );
        let words: Vec<&str> = head.split_whitespace().collect();
        let best: f64 = words[words.iter().position(|&w| w == "best").unwrap() + 1]
            .parse()
            .unwrap();
        let median: f64 = words[words.iter().position(|&w| w == "median").unwrap() + 1]
            .parse()
            .unwrap();
        assert!(
            (field(line, "max") - best).abs() <= 0.051,
            "{head} / {line}"
        );
        assert!(
            (field(line, "median") - median).abs() <= 0.051,
            "{head} / {line}"
        );
        assert!(field(line, "min") <= field(line, "median"));
    }
}

/// `bench serve` measures rounds, each serving every `--streams` count with prompts of its
/// own (no prefix-cache hit), and prints the spread of each count's output rate as every bench
/// prints its headline metric; zero rounds and a count given twice are refused.
#[test]
fn bench_serve_measures_rounds() {
    let out = bench_serve_tiny(&[
        "--prompt-len",
        "8",
        "--max-tokens",
        "3",
        "--rounds",
        "2",
        "--warmup",
        "1",
    ]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(so.contains("medians of 2 rounds after 1 warm-up"), "{so}");
    assert!(
        so.contains("out_tok_per_s_1_streams: n=2 (warm-up 1 discarded) min="),
        "{so}"
    );
    assert!(so.contains(" 0 served from the prefix cache"), "{so}");
    assert!(so.contains("kernel paths: GEMM "), "{so}");
    refused(
        &["bench", "serve", "--preset", "tiny", "--rounds", "0"],
        "--rounds must be at least 1",
    );
    // Flags that changed nothing where they were given.
    refused(
        &["run", "qwen3-decode", "--preset", "tiny", "--in-out-layout"],
        "--in-out-layout: applies to a --model checkpoint",
    );
    for (flag, more) in [("--system", "s"), ("--no-thinking", "")] {
        let mut args = vec!["generate", "--preset", "qwen3-tiny", "--prompt", "x", flag];
        if !more.is_empty() {
            args.push(more);
        }
        refused(&args, &format!("{flag}: applies to --chat"));
    }
    // bench runtime printed NaN or infinite rates for zero counts.
    for flag in [
        "--rounds",
        "--tasks",
        "--hops",
        "--blocks",
        "--readers",
        "--scope",
    ] {
        refused(
            &["bench", "runtime", flag, "0"],
            &format!("{flag} 0: give at least 1"),
        );
    }
    // Durations: `inf` panicked in Duration::from_secs_f64, NaN and negatives were taken as 0.
    for (cmd, flag) in [
        (
            &["run", "qwen3-decode", "--preset", "tiny"][..],
            "--membw-seconds",
        ),
        (
            &["bench", "qwen3-prefill", "--preset", "tiny"],
            "--gemm-seconds",
        ),
        (&["bench", "membw"], "--seconds"),
        (
            &["run", "dsv4", "--layer", "swa", "--preset", "tiny"],
            "--membw-seconds",
        ),
    ] {
        for v in ["inf", "NaN", "-1"] {
            let given = format!("{flag}={v}");
            let mut args = cmd.to_vec();
            args.push(&given);
            refused(&args, &format!("{v} seconds: give 0 to 3600"));
        }
    }
    refused(
        &["bench", "serve", "--preset", "tiny", "--streams", "1,4,1"],
        "--streams: 1 is given twice",
    );
}

/// `bench serve --temperature` draws each token on the engine's thread (and says so) and
/// serves every token; sampling flags that cannot apply are refused by name.
#[test]
fn bench_serve_samples_when_asked_and_refuses_what_cannot_apply() {
    let out = bench_serve_tiny(&[
        "--prompt-len",
        "8",
        "--max-tokens",
        "4",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
    ]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        so.contains("sampling: temperature 0.8, top-p 0.9, top-k 20"),
        "{so}"
    );
    assert!(
        so.contains("engine: ") && so.contains(" 0 preemptions"),
        "{so}"
    );
    let greedy = bench_serve_tiny(&["--prompt-len", "8", "--max-tokens", "2", "--rounds", "1"]);
    assert!(
        text(&greedy.stdout).contains("sampling: greedy"),
        "{}",
        text(&greedy.stdout)
    );
    for (more, why) in [
        (
            &["--temperature=-1"][..],
            "--temperature: -1 must be finite",
        ),
        (
            &["--temperature", "1", "--top-p", "0"],
            "--top-p: 0 must be in (0, 1]",
        ),
        (
            &["--temperature", "1", "--top-k", "0"],
            "--top-k: 0 must be at least 1",
        ),
        (&["--top-p", "0.5"], "give --temperature above 0 with them"),
        (&["--top-k", "5"], "give --temperature above 0 with them"),
    ] {
        let mut args = vec!["bench", "serve", "--preset", "tiny"];
        args.extend_from_slice(more);
        refused(&args, why);
    }
}

/// An error whose message already holds its cause's text prints that text once (the cause
/// used to follow under "Caused by:" again).
#[test]
fn an_error_prints_each_text_once() {
    let dir = common::tmp("bad-config");
    std::fs::write(dir.join("config.json"), r#"{"hidden_size": 8}"#).unwrap();
    let d = dir.to_string_lossy().into_owned();
    let out = simpler(&["run", "qwen3-decode", "--model", &d]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(
        err.matches("config key `num_attention_heads` is missing")
            .count(),
        1,
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `serve` binds its address before it loads the model: a busy port is refused at once, not
/// after a load of minutes.
#[test]
fn serve_refuses_a_busy_port_before_loading() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = simpler(&["serve", "--preset", "qwen3-0.6b", "--port", &port]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("binding 127.0.0.1:{port}")) && !err.contains("model:"),
        "{err}"
    );
}

/// Sizes that cannot be held are refused naming the flag, before anything is allocated: the
/// bandwidth bench's buffer (a size past 64 bits crashed, one that wrapped measured a cached
/// 1 MiB buffer and reported it), its thread count, and the demo's matrices (they panicked or
/// aborted on a failed allocation; zero sizes ran and "matched").
#[test]
fn sizes_that_cannot_be_held_are_refused_before_allocating() {
    for (args, needle) in [
        (
            &["bench", "membw", "--buffer-mib", "18446744073709551615"][..],
            "--buffer-mib 18446744073709551615: more bytes than this machine can address",
        ),
        (
            &["bench", "membw", "--buffer-mib", "17592186044417"],
            "--buffer-mib 17592186044417: more bytes",
        ),
        (
            &["bench", "membw", "--threads", "100000"],
            "100000 cores: give 1 to",
        ),
        (
            &[
                "run",
                "demo",
                "--m",
                "4611686018427387904",
                "--k",
                "64",
                "--n",
                "64",
            ],
            "--m 4611686018427387904 --k 64 --n 64: the demo's matrices",
        ),
        (
            &["run", "demo", "--n", "4611686018427387904"],
            "--m 512 --k 512 --n 4611686018427387904",
        ),
        (
            &["run", "demo", "--n", "0"],
            "--n 0: give a positive multiple of --tile",
        ),
        (&["run", "demo", "--tile", "0"], "--tile 0"),
    ] {
        refused(args, needle);
    }
}

/// Output that cannot be written ends the process with an error (status 1), not a panic: the
/// commands print with `println!`, which panics on a full disk.
#[test]
fn output_that_cannot_be_written_is_an_error_not_a_panic() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("skipped: no /dev/full here");
        return;
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_simpler"))
        .args(["run", "demo", "--m", "64", "--k", "64", "--n", "64"])
        .env("RUST_BACKTRACE", "0")
        .stdout(full)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("Error: writing the output failed: No space left on device")
            && !err.contains("panicked"),
        "{err}"
    );
}

/// Counts whose sum overflows are refused naming the flags, before anything runs: they wrapped
/// past the checks (a late error naming no flag; `bench collectives` exited 0 with NaN).
#[test]
fn counts_whose_sums_overflow_are_refused_naming_the_flags() {
    let max = "18446744073709551615";
    let decode = ["run", "qwen3-decode", "--preset", "tiny"];
    for (more, needle) in [
        (
            &["--seq-len", "8", "--steps", max][..],
            "--seq-len 8 --steps 18446744073709551615: the last step's length overflows",
        ),
        (
            &["--seq-len", max, "--steps", "2"],
            "the last step's length overflows",
        ),
        (
            &["--seq-len", "8", "--warmup", max],
            "--warmup 18446744073709551615 --rounds",
        ),
    ] {
        let mut a = decode.to_vec();
        a.extend(more);
        refused(&a, needle);
    }
    refused(
        &[
            "bench",
            "collectives",
            "--rounds",
            "1",
            "--warmup",
            max,
            "--ranks",
            "2",
            "--sizes",
            "1024",
        ],
        "--rounds 1 --warmup 18446744073709551615: need at least one round and at most",
    );
    refused(
        &[
            "run",
            "dsv4",
            "--preset",
            "tiny",
            "--layer",
            "swa",
            "--start-pos",
            max,
        ],
        "--start-pos 18446744073709551615: the step's last position would be past max_position",
    );
    // Every bench's rounds: a sum that wraps ran nothing and printed NaN with exit 0; a huge
    // count aborted on the allocation of its samples.
    let rounds_refused = format!("--warmup {max} --rounds 1: at most 1000000 rounds in all");
    let huge = "1000000000000";
    let decode: &[&str] = &[
        "bench",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--shapes",
        "1x32",
    ];
    let prefill: &[&str] = &[
        "bench",
        "qwen3-prefill",
        "--preset",
        "tiny",
        "--prompt-lens",
        "16",
    ];
    fn with<'a>(cmd: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
        [cmd, more].concat()
    }
    for bench in [
        &["bench", "runtime", "--tasks", "100"][..],
        decode,
        prefill,
        &["bench", "serve", "--preset", "tiny", "--streams", "1"],
        &["bench", "dsv4", "--kernel", "swa", "--preset", "tiny"],
        &["run", "dsv4", "--layer", "swa", "--preset", "tiny"],
    ] {
        refused(
            &with(bench, &["--rounds", "1", "--warmup", max]),
            &rounds_refused,
        );
        refused(
            &with(bench, &["--rounds", huge, "--warmup", "0"]),
            &format!("--warmup 0 --rounds {huge}: at most"),
        );
    }
    for bench in [decode, prefill] {
        refused(
            &with(bench, &["--outside-steps", huge]),
            &format!("--outside-steps {huge}: at most 10000"),
        );
    }
    // bench serve's sequence: the sum wrapped past the position check.
    let serve = ["bench", "serve", "--preset", "tiny", "--streams", "1"];
    let mut a = serve.to_vec();
    a.extend(["--prompt-len", "16", "--max-tokens", max]);
    refused(&a, &format!("--prompt-len 16 + --max-tokens {max} + "));
    let mut a = serve.to_vec();
    a.extend(["--prompt-len", huge, "--max-tokens", "1"]);
    refused(&a, "max_position_embeddings");
    // serve's drain time: a shutdown added a margin to it and panicked.
    refused(
        &["serve", "--preset", "qwen3-tiny", "--drain-secs", max],
        &format!("--drain-secs {max}: give at most 86400"),
    );
}

/// A command refused after its flags are read leaves no empty trace file or output directory
/// behind (the probe that the paths can be written used to leave them).
#[test]
fn a_refused_command_leaves_no_output_paths_behind() {
    let dir = common::tmp("no-leftovers");
    // `generate` with a layer count the model lacks: refused after the output flags are read.
    let refused_with = |outputs: &[&str]| {
        let mut a = vec![
            "generate",
            "--preset",
            "tiny",
            "--prompt-ids",
            "1",
            "--layers",
            "9",
        ];
        a.extend(outputs);
        refused(&a, "--layers 9: the model has 2 layers");
    };
    let (trace, out) = (dir.join("new/t.jsonl"), dir.join("od/x"));
    refused_with(&[
        "--trace",
        trace.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    // An existing trace file is left as it was.
    let kept = dir.join("kept.jsonl");
    std::fs::write(&kept, b"").unwrap();
    refused_with(&["--trace", kept.to_str().unwrap()]);
    assert!(kept.exists());
    // A trace path that is a dangling link: the link stays, its target is not made.
    let (link, target) = (dir.join("link.jsonl"), dir.join("target.jsonl"));
    std::os::unix::fs::symlink(&target, &link).unwrap();
    refused_with(&["--trace", link.to_str().unwrap()]);
    assert!(std::fs::symlink_metadata(&link).is_ok() && !target.exists());
    // A link into a directory that does not exist cannot be written through (a write makes
    // no directory at the far end): refused before the run, not after it.
    let far = dir.join("far.jsonl");
    std::os::unix::fs::symlink(dir.join("missing/t.jsonl"), &far).unwrap();
    // A path ending in a slash names a directory.
    let slash = format!("{}/", dir.join("nope").display());
    for (flag, path, needle) in [
        ("--trace", far.to_str().unwrap(), "whose directory"),
        ("--dump-logits", far.to_str().unwrap(), "whose directory"),
        ("--trace", slash.as_str(), "names a directory"),
    ] {
        let generate = ["generate", "--preset", "tiny", "--prompt-ids", "1"];
        refused(&[&generate[..], &[flag, path]].concat(), needle);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Output paths that cannot be written are refused before anything runs (the run's work was
/// lost when they failed at the end), and a `--diag-steps` list that picks none of the steps
/// is refused where the count is known and warned about where it is not (it wrote nothing,
/// silently).
#[test]
fn unwritable_outputs_and_a_step_list_past_the_end_are_said_before_or_after_the_run() {
    let dir = common::tmp("outputs");
    let file = dir.join("a-file");
    std::fs::write(&file, b"").unwrap();
    let file = file.to_str().unwrap();
    refused(
        &["run", "demo", "--swimlane", "1", "--output-dir", file],
        &format!("--output-dir {file}: cannot be made"),
    );
    refused(
        &["run", "demo", "--trace", &format!("{file}/t.jsonl")],
        "its directory cannot be made",
    );
    refused(
        &["run", "demo", "--trace", dir.to_str().unwrap()],
        "is a directory",
    );
    let out_dir = dir.join("out");
    let out_dir = out_dir.to_str().unwrap();
    refused(
        &[
            "run",
            "qwen3-decode",
            "--preset",
            "tiny",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--steps",
            "2",
            "--seq-len",
            "8",
            "--swimlane",
            "1",
            "--output-dir",
            out_dir,
            "--diag-steps",
            "2-9",
        ],
        "--diag-steps 2-9: picks none of the 2 steps this run takes",
    );
    refused(
        &[
            "generate",
            "--preset",
            "qwen3-tiny",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "2",
            "--dump-logits",
            dir.to_str().unwrap(),
        ],
        "is a directory",
    );
    let out = simpler(&[
        "generate",
        "--preset",
        "qwen3-tiny",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
        "--ignore-eos",
        "--swimlane",
        "1",
        "--output-dir",
        out_dir,
        "--diag-steps",
        "50",
    ]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: --diag-steps 50 picked none of the 2 steps that ran"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run that cannot fit names ways out among the command's own flags only (each command was
/// told of `--layers`, `--shared-weights`, `--max-seq` and `--seq-len`, which most lack), and
/// `serve` names its flags, not the engine's field names.
#[test]
fn memory_refusals_name_only_the_commands_flags() {
    let budget = ["--preset", "qwen3-0.6b", "--memory-budget", "0.5"];
    for (cmd, has, lacks) in [
        (
            &["bench", "qwen3-prefill"][..],
            &["--prompt-lens"][..],
            &["--layers", "--shared-weights", "--max-seq", "--seq-len"][..],
        ),
        (
            &["bench", "serve"],
            &["--prompt-len", "--max-tokens", "--streams"],
            &["--layers", "--shared-weights", "--max-seq", "--seq-len"],
        ),
        (
            &["generate", "--prompt-ids", "1"],
            &["--layers N", "--max-new-tokens", "--num-prompts"],
            &["--shared-weights", "--max-seq", "--seq-len"],
        ),
        (
            &["run", "qwen3-decode"],
            &[
                "--layers N",
                "--shared-weights",
                "--max-seq",
                "--seq-len",
                "--batch",
            ],
            &[],
        ),
    ] {
        let mut a = cmd.to_vec();
        a.extend(budget);
        let out = simpler(&a);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{a:?}");
        let ways = err
            .split("Ways out: ")
            .nth(1)
            .unwrap_or_else(|| panic!("{a:?}: {err}"));
        for flag in has {
            assert!(ways.contains(flag), "{a:?}: no {flag} in {ways}");
        }
        for flag in lacks {
            assert!(!ways.contains(flag), "{a:?}: {flag} in {ways}");
        }
    }
    let mut a = vec!["serve", "--port", "0"];
    a.extend(budget);
    refused(&a, "available (--memory-budget)");
}
