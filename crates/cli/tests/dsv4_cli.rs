//! The DeepSeek-V4 commands end to end through the `simpler` binary: `run dsv4` checked
//! against the golden with its report, `bench dsv4` statistics, and the layers not
//! implemented yet refused by name.

mod common;

use common::{simpler, text};

#[test]
fn run_dsv4_checks_each_implemented_layer_against_the_golden_and_reports() {
    for layer in ["swa", "csa", "hca"] {
        let out = simpler(&[
            "run",
            "dsv4",
            "--layer",
            layer,
            "--preset",
            "small",
            "--check",
            "--rounds",
            "2",
            "--warmup",
            "0",
            "--membw-seconds",
            "0.2",
            "--cores",
            "2",
        ]);
        let (so, se) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{layer}: {so}\n{se}");
        for needle in [
            "check vs golden",
            "ok: x_out",
            "ok: window cache",
            "(1) effective (orch ∪ sched)",
            "task_slot_4",
            "per phase",
            "attention",
            "effective_us: n=2",
            "% of membw",
            "per-phase bound",
            "quietest step",
            "starts [0, 3, 127, 8192]",
        ] {
            assert!(so.contains(needle), "{layer}: missing {needle:?} in\n{so}");
        }
        if layer == "hca" {
            assert!(so.contains("ok: compressed cache"), "{so}");
            assert!(so.contains("ok: state kv"), "{so}");
        }
        if layer == "csa" {
            for needle in [
                "CSA layer",
                "ok: ring kv",
                "ok: index ring score",
                "ok: compressed rows written",
                "ok: index rows written",
                "ok: index scales",
            ] {
                assert!(so.contains(needle), "csa: missing {needle:?} in\n{so}");
            }
        }
    }
}

#[test]
fn bench_dsv4_prints_effective_us_statistics_and_ratios() {
    for kernel in ["hca", "csa"] {
        let out = simpler(&[
            "bench",
            "dsv4",
            "--kernel",
            kernel,
            "--preset",
            "tiny",
            "--start-pos",
            "300",
            "--rounds",
            "3",
            "--warmup",
            "1",
            "--membw-seconds",
            "0.2",
        ]);
        let (so, se) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{kernel}: {so}\n{se}");
        for needle in [
            "effective_us: n=3 (warm-up 1 discarded) min=",
            "median=",
            "mean=",
            "max=",
            "% of membw",
            "per-phase bound",
            "quietest step",
            "starts [300, 300, 300, 300]",
        ] {
            assert!(so.contains(needle), "{kernel}: missing {needle:?} in\n{so}");
        }
    }
}

#[test]
fn bad_layers_and_starts_are_refused_by_name() {
    let out = simpler(&[
        "run",
        "dsv4",
        "--layer",
        "swa",
        "--preset",
        "tiny",
        "--start-pos",
        "16383",
    ]);
    let se = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        se.contains("--start-pos 16383") && se.contains("max_position"),
        "{se}"
    );
    let out = simpler(&["run", "dsv4", "--layer", "mla"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("mla"));
}

#[test]
fn run_and_bench_dsv4_moe() {
    let out = simpler(&[
        "run",
        "dsv4",
        "--layer",
        "moe",
        "--preset",
        "small",
        "--check",
        "--rounds",
        "2",
        "--warmup",
        "0",
        "--membw-seconds",
        "0.2",
        "--cores",
        "2",
    ]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    for needle in [
        "MoE layer 3 (top-6 of score + bias)",
        "16 routed experts, all local",
        "ok: routing: 48 routes as the golden",
        "ok: shared",
        "ok: routed [T, K, D]",
        "ok: y",
        "ok: x_out",
        "experts gate/up",
        "effective_us: n=2",
        "% of membw",
        "per-phase bound",
        "quietest step",
    ] {
        assert!(so.contains(needle), "missing {needle:?} in\n{so}");
    }
    let out = simpler(&[
        "bench",
        "dsv4",
        "--kernel",
        "moe",
        "--preset",
        "tiny",
        "--rounds",
        "4",
        "--warmup",
        "1",
        "--membw-seconds",
        "0.2",
    ]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    for needle in [
        "effective_us: n=4 (warm-up 1 discarded) min=",
        "fast_effective_us",
        "valid_rounds 4/4",
        "per-phase bound",
    ] {
        assert!(so.contains(needle), "missing {needle:?} in\n{so}");
    }
}
