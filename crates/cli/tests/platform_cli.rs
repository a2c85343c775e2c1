//! `--platform cpu|cuda` on every `run`, `bench` and `generate`: `cuda` is refused with the
//! reason — not compiled in, no driver or device, or no CUDA path for the command — and
//! never panics; `cpu` is the default and changes nothing.

mod common;

use common::{simpler, text};

/// Each command refuses `--platform cuda` early (before any model is generated) with an
/// error that starts with the flag and says why.
#[test]
fn cuda_is_refused_with_the_reason() {
    let commands: &[&[&str]] = &[
        &["run", "demo"],
        &["run", "qwen3-decode", "--preset", "tiny"],
        &["bench", "runtime"],
        &["bench", "membw"],
        &["bench", "qwen3-prefill", "--preset", "tiny"],
        &["bench", "serve", "--preset", "tiny"],
        &["run", "dsv4", "--layer", "swa"],
        &["bench", "dsv4", "--kernel", "swa"],
        &["generate", "--preset", "tiny", "--prompt-ids", "1,2"],
    ];
    for args in commands {
        let mut a = args.to_vec();
        a.extend(["--platform", "cuda"]);
        let out = simpler(&a);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{a:?} succeeded");
        assert!(!err.contains("panicked"), "{a:?}: {err}");
        assert!(err.contains("--platform cuda: "), "{a:?}: {err}");
        let why = [
            "not compiled with CUDA support",
            "CUDA is not usable on this machine",
            "has no CUDA path yet",
        ];
        assert!(why.iter().any(|w| err.contains(w)), "{a:?}: {err}");
    }
}

/// The flag also stands before the subcommand, and an unknown platform is refused by clap.
#[test]
fn the_flag_is_global_and_checked() {
    let out = simpler(&["bench", "--platform", "cuda", "membw"]);
    assert!(text(&out.stderr).contains("--platform cuda: "));
    let out = simpler(&["run", "demo", "--platform", "tpu"]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("tpu") && err.contains("cuda"), "{err}");
}

/// `bench qwen3-decode --platform cuda` refuses the CPU-runtime flags by name, before it
/// looks for a device (so here too, where there is none).
#[test]
fn cpu_runtime_flags_are_refused_on_cuda() {
    for (flag, value, named) in [
        ("--versus-isa", "avx2", "--versus-isa"),
        ("--bf16-layout", "tiled", "--bf16-layout tiled / pairs"),
        ("--bf16-layout", "pairs", "--bf16-layout tiled / pairs"),
        ("--replay", "off", "--replay"),
        ("--outside-steps", "3", "--outside-steps"),
        ("--membw-seconds", "0.5", "--membw-seconds"),
        // Given at their default values: still refused (they used to pass).
        ("--outside-steps", "5", "--outside-steps"),
        ("--membw-seconds", "2", "--membw-seconds"),
        ("--memory-budget", "8", "--memory-budget"),
        ("--output-dir", "/tmp/unused", "--output-dir"),
        ("--swimlane-capacity", "64", "--swimlane-capacity"),
        ("--tensormap-capacity", "1024", "--tensormap-capacity"),
        ("--diag-steps", "0", "--diag-steps"),
    ] {
        let out = simpler(&[
            "bench",
            "qwen3-decode",
            "--preset",
            "tiny",
            "--platform",
            "cuda",
            flag,
            value,
        ]);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{flag}");
        assert!(
            err.contains(&format!("{named}: not available with --platform cuda")),
            "{err}"
        );
    }
}

/// Only an explicit `--bf16-layout tiled` or `pairs` is refused: without the flag,
/// `bench qwen3-decode --platform cuda` refuses nothing about the layout (`--serial`, checked
/// after it, is what gets refused, so the bench never starts).
#[test]
fn the_default_bf16_layout_is_not_refused_on_cuda() {
    let out = simpler(&[
        "bench",
        "qwen3-decode",
        "--preset",
        "tiny",
        "--platform",
        "cuda",
        "--serial",
    ]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(!err.contains("--bf16-layout"), "{err}");
    assert!(
        err.contains("--serial: not available with --platform cuda")
            || err.contains("not compiled with CUDA support")
            || err.contains("CUDA is not usable on this machine"),
        "{err}"
    );
}

/// `--platform cpu` is the default: spelling it out runs the same command.
#[test]
fn cpu_is_the_default() {
    let out = simpler(&[
        "run",
        "demo",
        "--m",
        "64",
        "--k",
        "64",
        "--n",
        "64",
        "--platform",
        "cpu",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("outputs match the plain reference"));
}
