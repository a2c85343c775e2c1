//! The DeepSeek-V4 MoE commands through the `simpler` binary: one step checked against the
//! golden with its report, the bench's statistics, and layer kinds refused by name.

mod common;

use common::{simpler, text};

#[test]
fn run_dsv4_moe_checks_against_the_golden_and_reports() {
    let out = simpler(&[
        "run",
        "dsv4",
        "--layer",
        "moe",
        "--preset",
        "small",
        "--check",
        "--membw-seconds",
        "0.2",
        "--cores",
        "2",
    ]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    for needle in [
        "dsv4 moe, preset small",
        "experts hit",
        "% of membw",
        "per-phase bound",
        "experts gate/up",
        "check (MoE tolerance 3e-3 / 5%): shared",
        "x_out",
    ] {
        assert!(so.contains(needle), "missing {needle:?} in\n{so}");
    }
}

#[test]
fn bench_dsv4_moe_prints_the_spec_statistics() {
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
        "--cores",
        "2",
    ]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{so}\n{se}");
    for needle in [
        "effective_us min",
        "median",
        "fast_effective_us",
        "valid_rounds 4/4",
        "per-phase bound",
    ] {
        assert!(so.contains(needle), "missing {needle:?} in\n{so}");
    }
}

#[test]
fn layer_kinds_not_implemented_are_refused_by_name() {
    for (cmd, flag) in [("run", "--layer"), ("bench", "--kernel")] {
        let out = simpler(&[cmd, "dsv4", flag, "swa", "--preset", "tiny"]);
        let se = text(&out.stderr);
        assert!(!out.status.success());
        assert!(se.contains(&format!("{flag} swa")), "{se}");
        let out = simpler(&[cmd, "dsv4", flag, "mlp", "--preset", "tiny"]);
        assert!(text(&out.stderr).contains("unknown layer kind"));
    }
    let out = simpler(&["bench", "dsv4", "--kernel", "moe", "--preset", "huge"]);
    assert!(text(&out.stderr).contains("huge"));
}
