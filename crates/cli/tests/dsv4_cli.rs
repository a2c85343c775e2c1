//! The DeepSeek-V4 commands end to end through the `simpler` binary: `run dsv4` checked
//! against the golden with its report, `bench dsv4` statistics, and the layers not
//! implemented yet refused by name.

mod common;

use std::process::Output;

use common::{refused, simpler, text};

/// `run dsv4 --layer LAYER --preset small --check`, then `more`.
fn small_checked<'a>(layer: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "run", "dsv4", "--layer", layer, "--preset", "small", "--check",
    ];
    args.extend_from_slice(more);
    args
}

/// `bench dsv4 --kernel KERNEL --preset tiny` with a short bandwidth probe and no cache flush
/// between steps (the tiny layer's times are not what these tests check), then `more`.
fn bench_tiny<'a>(kernel: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = bench_tiny_flushed(kernel, more);
    args.push("--warm-cache");
    args
}

/// [`bench_tiny`] with the default flush of the last-level cache before each step.
fn bench_tiny_flushed<'a>(kernel: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "bench",
        "dsv4",
        "--kernel",
        kernel,
        "--preset",
        "tiny",
        "--membw-seconds",
        "0.2",
    ];
    args.extend_from_slice(more);
    args
}

/// Two measured rounds, no warm-up, a short bandwidth probe, two cores, no cache flush
/// between steps (these runs check results and the report, not times; the bench tests below
/// run the flush).
const QUICK: &[&str] = &[
    "--rounds",
    "2",
    "--warmup",
    "0",
    "--membw-seconds",
    "0.2",
    "--cores",
    "2",
    "--warm-cache",
];

/// Asserts that `out` succeeded and its output holds every one of `needles`; returns it.
fn succeeded_with(out: &Output, what: &str, needles: &[&str]) -> String {
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{what}: {so}\n{se}");
    for needle in needles {
        assert!(so.contains(needle), "{what}: missing {needle:?} in\n{so}");
    }
    assert!(!so.contains("FAILED"), "{what}: {so}");
    so
}

#[test]
fn run_dsv4_checks_each_implemented_layer_against_the_golden_and_reports() {
    for layer in ["swa", "csa", "hca"] {
        let out = simpler(&small_checked(layer, QUICK));
        let so = succeeded_with(
            &out,
            layer,
            &[
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
                "median step (effective) at membw's median pass",
                "starts [0, 3, 127, 8192]",
            ],
        );
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
                "ok: indexer picks:",
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
        let out = simpler(&bench_tiny(
            kernel,
            &["--start-pos", "300", "--rounds", "3", "--warmup", "1"],
        ));
        succeeded_with(
            &out,
            kernel,
            &[
                "effective_us: n=3 (warm-up 1 discarded) min=",
                "median=",
                "mean=",
                "max=",
                "% of membw",
                "per-phase bound",
                "quietest step",
                "median step at membw's median pass",
                "starts [300, 300, 300, 300]",
            ],
        );
    }
}

/// `--versus-proj-blocks` runs both tilings interleaved and prints their ratio, and the main
/// measurement before it is the same report as without the flag.
#[test]
fn bench_dsv4_compares_projection_blocks_step_against_step() {
    let out = simpler(&bench_tiny(
        "swa",
        &[
            "--rounds",
            "4",
            "--warmup",
            "1",
            "--versus-proj-blocks",
            "3",
        ],
    ));
    let so = succeeded_with(
        &out,
        "swa --versus-proj-blocks 3",
        &[
            "effective_us: n=4 (warm-up 1 discarded) min=",
            "per-phase bound",
            "projection blocks compared (interleaved steps A B B A ..",
            "blocks (this run)",
            "[B: 3 blocks]: n=4",
            "median of paired ratios B/A = ",
        ],
    );
    assert!(so.contains("95% interval ["), "{so}");
}

/// `--versus-isa portable` runs this machine's path and the portable loops interleaved,
/// prints the ratio and each phase's median on either side; a path that is not one, or the
/// flag with `--ep`, is refused by name before any fixture is built.
#[test]
fn bench_dsv4_compares_kernel_paths_step_against_step() {
    let out = simpler(&bench_tiny(
        "swa",
        &["--rounds", "3", "--warmup", "1", "--versus-isa", "portable"],
    ));
    let so = succeeded_with(
        &out,
        "swa --versus-isa portable",
        &[
            "effective_us: n=3 (warm-up 1 discarded) min=",
            "kernel paths compared (interleaved steps A B B A ..",
            "(this run)]: n=3",
            "[B: portable, int8 portable]: n=3",
            "median of paired ratios B/A = ",
            "A median_us  B median_us      B/A",
        ],
    );
    let table = &so[so.find("A median_us").expect("phase table")..];
    for phase in [
        "hc_pre",
        "projections",
        "q_b",
        "attention",
        "wo_a",
        "wo_b",
        "hc_post",
    ] {
        assert!(table.contains(phase), "no {phase} row in\n{table}");
    }
    let bad_path = bench_tiny("swa", &["--versus-isa", "avx3"]);
    // The expert-parallel ranks run their own steps: the flag would be ignored there.
    let with_ep = [
        "bench",
        "dsv4",
        "--kernel",
        "moe",
        "--preset",
        "tiny",
        "--ep",
        "2",
        "--versus-isa",
        "portable",
    ];
    for (args, needle) in [
        (&bad_path[..], "--versus-isa \"avx3\": not one of"),
        (&with_ep[..], "--versus-isa: not with --ep"),
    ] {
        let out = simpler(args);
        let se = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {se}");
        assert!(se.contains(needle), "{args:?}: {se}");
        assert!(text(&out.stdout).is_empty(), "{args:?}: ran anyway");
    }
}

/// The flag is refused by name where it changes nothing (the MoE's experts have their own
/// blocks) or makes no tiling, before any fixture is built.
#[test]
fn versus_proj_blocks_is_refused_where_it_does_not_apply() {
    for (kernel, blocks, needle) in [
        ("moe", "8", "the moe layer's experts have their own blocks"),
        ("swa", "0", "at least 1 block"),
        ("swa", "4097", "at most 4096"),
        ("hca", "4294967295", "at most 4096"),
    ] {
        let out = simpler(&bench_tiny(kernel, &["--versus-proj-blocks", blocks]));
        let se = text(&out.stderr);
        assert!(!out.status.success(), "{kernel} {blocks}: {se}");
        assert!(
            se.contains("--versus-proj-blocks") && se.contains(needle),
            "{kernel} {blocks}: {se}"
        );
        assert!(
            text(&out.stdout).is_empty(),
            "{kernel} {blocks}: ran anyway"
        );
    }
}

/// `--start-pos 127` starts every sequence at 127, so each token pair crosses a compression
/// boundary inside the step (ratio 4 for CSA, 128 for HCA: position 127 closes a window), and
/// the check covers the compressed rows it writes.
#[test]
fn run_dsv4_checks_a_uniform_start_that_closes_a_compressor_window() {
    for layer in ["csa", "hca"] {
        let mut more = vec!["--start-pos", "127"];
        more.extend_from_slice(QUICK);
        let out = simpler(&small_checked(layer, &more));
        let so = succeeded_with(
            &out,
            layer,
            &[
                "starts [127, 127, 127, 127]",
                "ok: x_out",
                "ok: compressed cache",
            ],
        );
        // Rows were written (and checked): a count, not zero.
        let key = "ok: compressed rows written: 0 of ";
        let at = so.find(key).unwrap_or_else(|| panic!("{layer}: {so}"));
        let written: usize = so[at + key.len()..]
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{layer}: a count after {key:?}"));
        assert!(written > 0, "{layer}: {so}");
    }
}

/// Steps after the first replay the captured graph by default, `--replay off` orchestrates
/// every step, and `--versus-replay` runs both interleaved and prints their ratio.
#[test]
fn bench_dsv4_replays_its_steps_and_compares_them_with_orchestrated_ones() {
    let more = ["--rounds", "4", "--warmup", "1", "--versus-replay"];
    let out = simpler(&bench_tiny("hca", &more));
    let so = succeeded_with(
        &out,
        "hca --versus-replay",
        &[
            // The mixed starts close the ratio-128 window at 127: said, as the rounds then
            // differ in state.
            "note: a ratio-128 compressor window closes inside the step at start(s) [127]",
            // The warm-up step was captured; the measured ones replayed.
            "graph: --replay on -> 4 replayed (orch ",
            "replay compared (A: captured graph replayed, B: orchestrated",
            "[A: replayed]: n=4",
            "[B: orchestrated]: n=4",
            "median of paired ratios B/A = ",
            "orchestration span (median over every step): replay ",
        ],
    );
    assert!(so.contains("95% interval ["), "{so}");
    let out = simpler(&bench_tiny("csa", &["--rounds", "2", "--replay", "off"]));
    let so = succeeded_with(
        &out,
        "csa --replay off",
        &[
            "graph: --replay off -> 2 orchestrated (orch ",
            // Start 3 closes the first window, whose pooling no later token of the step
            // disturbs: only 127's is named.
            "note: a ratio-4 compressor window closes inside the step at start(s) [127]",
        ],
    );
    // At a start that closes no window, no note.
    let out = simpler(&bench_tiny(
        "csa",
        &["--rounds", "1", "--warmup", "0", "--start-pos", "8192"],
    ));
    let quiet = succeeded_with(&out, "csa --start-pos 8192", &["effective_us"]);
    assert!(!quiet.contains("compressor window closes") && so.contains("note:"));
    // Verifying: the warm-up step captured, every measured one orchestrated, captured and
    // checked against the graph kept before it (a difference would fail the step).
    let out = simpler(&bench_tiny(
        "csa",
        &["--rounds", "2", "--warmup", "1", "--replay", "verify"],
    ));
    succeeded_with(
        &out,
        "csa --replay verify",
        &[
            "graph: --replay verify -> 2 captured (orch ",
            "every step after a topology's first checked against the graph captured before it",
        ],
    );
    // No warm-up: the first measured step is the captured one.
    let out = simpler(&small_checked("swa", QUICK));
    succeeded_with(
        &out,
        "run swa",
        &[
            "graph: --replay on -> 1 captured (orch ",
            ", 1 replayed (orch ",
        ],
    );
}

/// `--replay` and `--versus-replay` are refused by name where they do not apply, before any
/// fixture is built.
#[test]
fn replay_flags_are_refused_where_they_do_not_apply() {
    for (args, flag, needle) in [
        (
            bench_tiny("moe", &["--replay", "on"]),
            "--replay",
            "the moe layer's steps are orchestrated every step",
        ),
        (
            vec![
                "run", "dsv4", "--layer", "moe", "--replay", "off", "--ep", "2",
            ],
            "--replay",
            "the moe layer's steps are orchestrated every step",
        ),
        (
            bench_tiny("moe", &["--versus-replay"]),
            "--versus-replay",
            "the moe layer's steps are orchestrated every step",
        ),
        (
            bench_tiny("swa", &["--versus-replay", "--replay", "off"]),
            "--versus-replay",
            "drop --replay off",
        ),
        (
            bench_tiny("hca", &["--versus-replay", "--replay", "verify"]),
            "--versus-replay",
            "drop --replay verify",
        ),
    ] {
        let out = simpler(&args);
        let se = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {se}");
        assert!(se.contains(flag) && se.contains(needle), "{args:?}: {se}");
        assert!(text(&out.stdout).is_empty(), "{args:?}: ran anyway");
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
    // Beside a layer that reads positions, a start is that layer's (alone, the moe layer
    // refuses it: `dsv4_ep_flags_that_do_not_apply_are_refused_by_name`).
    let out = simpler(&bench_tiny(
        "swa,moe",
        &["--start-pos", "8192", "--rounds", "1", "--warmup", "0"],
    ));
    succeeded_with(
        &out,
        "swa,moe --start-pos 8192",
        &["starts [8192, 8192, 8192, 8192]"],
    );
}

#[test]
fn run_and_bench_dsv4_moe() {
    let out = simpler(&small_checked("moe", QUICK));
    succeeded_with(
        &out,
        "run moe",
        &[
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
        ],
    );
    let out = simpler(&bench_tiny_flushed(
        "moe",
        &["--rounds", "4", "--warmup", "1"],
    ));
    succeeded_with(
        &out,
        "bench moe",
        &[
            "effective_us: n=4 (warm-up 1 discarded) min=",
            "fast_effective_us (one rank: its own time): n=4",
            "faster_half_us",
            "valid_rounds 4/4",
            "of membw's best pass (best case)",
            "of membw's median pass",
            "roofline bound",
            "kernel paths: int8 products ",
            "per-phase bound",
            "caches: each step starts after a",
        ],
    );
    let out = simpler(&bench_tiny("swa", &["--rounds", "2", "--warmup", "0"]));
    succeeded_with(
        &out,
        "bench swa --warm-cache",
        &["caches: warm (--warm-cache)", "quietest step"],
    );
}

/// Runs `simpler` with `args`, and then asserts that it left no shared-memory segment and no
/// child process of its node behind (both carry `simpler-node.<pid>.` in their name or
/// environment).
fn simpler_leaving_nothing(args: &[&str]) -> std::process::Output {
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_simpler"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run simpler");
    let tag = format!("simpler-node.{}.", child.id());
    let out = child.wait_with_output().expect("wait for simpler");
    let segments: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(&tag))
                .map(|e| e.file_name())
                .collect()
        })
        .unwrap_or_default();
    assert!(segments.is_empty(), "left behind: {segments:?}");
    let orphans: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("environ"))
                .is_ok_and(|env| String::from_utf8_lossy(&env).contains(&tag))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(orphans.is_empty(), "processes left behind: {orphans:?}");
    out
}

#[test]
fn run_dsv4_moe_ep2_over_shm_is_bit_identical_to_one_rank_and_writes_a_trace_per_rank() {
    let dir = common::tmp("ep");
    let trace = dir.join("ep.jsonl");
    let out = simpler_leaving_nothing(&small_checked(
        "moe",
        &[
            "--ep",
            "2",
            "--rounds",
            "3",
            "--warmup",
            "1",
            "--cores",
            "1",
            "--membw-seconds",
            "0.2",
            "--trace",
            trace.to_str().unwrap(),
        ],
    ));
    let so = succeeded_with(
        &out,
        "ep 2 over shm",
        &[
            "2 ranks over shm, 16 routed experts (8 per rank)",
            "caches: warm: the ranks run their steps back to back",
            "rank 0: effective_us",
            "rank 1: effective_us",
            "fast_effective_us",
            "valid_rounds 3/3",
            "rank 0 may use 1 cores",
            "kernel paths: int8 products ",
            "bytes/step ",
            " MB over the ranks -> ",
            "of membw's best pass (best case)",
            "of membw's median pass",
            "step split",
            "ok: x_out: 8192 elements bit-identical to one rank",
            "ok: routed [T, K, D]: 12288 elements bit-identical to one rank",
            "ok: y: 0 of 2048 elements over 3e-3",
        ],
    );
    for phase in ["route", "dispatch", "compute", "combine", "reduce"] {
        assert!(so.contains(&format!("{phase} ")), "{so}");
    }
    let files: Vec<String> = (0..2)
        .map(|r| {
            dir.join(format!("ep.rank{r}.jsonl"))
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let out = simpler(&[
        "trace", "timing", "--rounds", "--warmup", "1", &files[0], &files[1],
    ]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{so}\n{}", text(&out.stderr));
    assert!(so.contains("clocks: 2 processes of host boot"), "{so}");
    assert!(so.contains("valid_rounds=3/3"), "{so}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn run_dsv4_moe_ep4_over_shm_is_bit_identical_to_one_rank() {
    let out = simpler_leaving_nothing(&small_checked(
        "moe",
        &[
            "--ep", "4", "--rounds", "1", "--warmup", "0", "--cores", "1",
        ],
    ));
    succeeded_with(
        &out,
        "ep 4 over shm",
        &[
            "4 ranks over shm",
            "ok: x_out: 8192 elements bit-identical to one rank",
        ],
    );
}

#[test]
fn dsv4_ep_flags_that_do_not_apply_are_refused_by_name() {
    for (args, says) in [
        (
            &["run", "dsv4", "--layer", "swa", "--ep", "2"][..],
            "--ep 2: expert parallelism applies to the moe layer",
        ),
        (
            &[
                "run", "dsv4", "--layer", "moe", "--preset", "small", "--ep", "3",
            ][..],
            "--ep 3: must divide the 16 routed experts",
        ),
        (
            &["run", "dsv4", "--layer", "moe", "--collectives", "shm"][..],
            "--collectives: only with --ep",
        ),
        (
            &[
                "bench",
                "dsv4",
                "--kernel",
                "moe",
                "--preset",
                "small",
                "--ep",
                "2",
                "--warm-cache",
            ][..],
            "--warm-cache: the expert-parallel ranks run their steps back to back",
        ),
        (
            &[
                "run",
                "dsv4",
                "--layer",
                "moe",
                "--preset",
                "small",
                "--ep",
                "2",
                "--experts-per-rank",
                "16",
            ][..],
            "--experts-per-rank 16",
        ),
        (
            &["run", "dsv4", "--layer", "moe", "--ep", "16"][..],
            "--ep 16",
        ),
        (
            &[
                "bench",
                "dsv4",
                "--kernel",
                "moe",
                "--ep",
                "2",
                "--experts-per-rank",
                "8",
            ][..],
            "--experts-per-rank 8: must be 16 or 32",
        ),
        // The moe layer reads no position: a start for it alone changes nothing.
        (
            &["run", "dsv4", "--layer", "moe", "--start-pos", "8192"][..],
            "--start-pos 8192: the moe layer reads no position",
        ),
        (
            &["bench", "dsv4", "--kernel", "moe", "--start-pos", "8192"][..],
            "--start-pos 8192: the moe layer reads no position",
        ),
        (
            &[
                "bench",
                "dsv4",
                "--kernel",
                "moe",
                "--ep",
                "2",
                "--start-pos",
                "8192",
            ][..],
            "--start-pos 8192: the moe layer reads no position",
        ),
        (
            &[
                "bench",
                "dsv4",
                "--kernel",
                "moe",
                "--preset",
                "tiny",
                "--ep",
                "2",
                "--diag-steps",
                "0",
            ][..],
            "--diag-steps",
        ),
    ] {
        let out = simpler(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            text(&out.stderr).contains(says),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// EP 2 over MPI on loopback, with a trace per rank holding its clock offset to rank 0: the
/// binary must be built with the `mpi` feature (`cargo test -p simpler-cli --features mpi`),
/// and `mpirun` must be on the path.
#[cfg(feature = "mpi")]
#[test]
fn run_dsv4_moe_ep2_over_mpi_is_bit_identical_to_one_rank() {
    if std::process::Command::new("mpirun")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: no mpirun on the path (Debian: openmpi-bin)");
        return;
    }
    let dir = common::tmp("ep-mpi");
    let trace = dir.join("ep.jsonl");
    let out = simpler(&small_checked(
        "moe",
        &[
            "--ep",
            "2",
            "--collectives",
            "mpi",
            "--rounds",
            "2",
            "--warmup",
            "0",
            "--cores",
            "1",
            "--trace",
            trace.to_str().unwrap(),
        ],
    ));
    succeeded_with(
        &out,
        "ep 2 over mpi",
        &[
            "2 ranks over mpi",
            "ok: x_out: 8192 elements bit-identical to one rank",
        ],
    );
    // Every rank recorded its clock offset to rank 0, measured at start-up. On one host the
    // true offset is zero, so it lies within the recorded bound; rank 0's is zero exactly.
    let files: Vec<_> = (0..2)
        .map(|r| dir.join(format!("ep.rank{r}.jsonl")))
        .collect();
    let t = simpler_dfx::reader::read_traces(&files).unwrap();
    assert_eq!(t.processes.len(), 2);
    for p in &t.processes {
        let c = p.clock.as_ref().expect("a process line");
        let o = c.clock_offset.as_ref().expect("a clock offset");
        assert_eq!(o.reference_boot_id, c.boot_id);
        assert!(o.offset_ns.unsigned_abs() <= o.uncertainty_ns, "{c:?}");
        if c.rank == Some(0) {
            assert_eq!((o.offset_ns, o.uncertainty_ns), (0, 0));
        }
    }
    assert!(
        t.clock_summary()
            .contains("clocks: 2 processes of host boot")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Several layers in one command: each layer's own report in the order given, then the table
/// with one line per layer, each against its own run's per-phase bound.
#[test]
fn bench_dsv4_measures_several_layers_and_compares_them_in_a_table() {
    let out = simpler(&bench_tiny("hca,swa", &["--rounds", "2", "--warmup", "0"]));
    let so = succeeded_with(
        &out,
        "bench dsv4 --kernel hca,swa",
        &[
            "simpler bench dsv4 --kernel hca:",
            "simpler bench dsv4 --kernel swa:",
            "layers (each on its own fixture, against the limits measured in its own run):",
        ],
    );
    assert!(
        so.find("--kernel hca:") < so.find("--kernel swa:"),
        "the layers run in the order given: {so}"
    );
    let table = &so[so.find("layers (each on its own fixture").unwrap()..];
    let rows: Vec<Vec<&str>> = table
        .lines()
        .skip(2)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "{table}");
    for (row, layer) in rows.iter().zip(["hca", "swa"]) {
        assert_eq!(row[0], layer, "{table}");
        let num = |i: usize| row[i].trim_end_matches('%').parse::<f64>().unwrap();
        let (quietest, median, bound) = (num(1), num(2), num(3));
        assert!(
            quietest > 0.0 && quietest <= median && bound > 0.0,
            "{table}"
        );
        // The shares are the bound over the step times (the printed times are rounded to
        // 0.1 us, so the recomputed shares agree to within a percent of themselves).
        let near = |share: f64, t: f64| (share - 100.0 * bound / t).abs() <= 0.01 * share + 0.1;
        assert!(near(num(4), quietest), "{table}");
        assert!(near(num(5), median), "{table}");
    }
    // One layer prints no table.
    let one = simpler(&bench_tiny("swa", &["--rounds", "1", "--warmup", "0"]));
    assert!(!succeeded_with(&one, "bench dsv4 --kernel swa", &[]).contains("layers (each"));
}

/// With several layers each writes its diagnostics into a folder of its own under
/// `--output-dir`, so no layer's files replace another's.
#[test]
fn bench_dsv4_keeps_each_layers_diagnostics_apart() {
    let dir = std::env::temp_dir().join(format!("simpler-dsv4-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let more = [
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--swimlane",
        "1",
        "--output-dir",
        d,
    ];
    let out = simpler(&bench_tiny("swa,moe", &more));
    let so = succeeded_with(&out, "bench dsv4 --kernel swa,moe --swimlane 1", &[]);
    for (layer, kernel) in [("swa", "dsv4_sparse_attention"), ("moe", "moe_gate_up")] {
        let sub = dir.join(layer);
        assert!(
            so.contains(&format!("diagnostics of this layer: {}", sub.display())),
            "{so}"
        );
        let swimlane = std::fs::read_to_string(sub.join("swimlane.json")).unwrap();
        assert!(
            swimlane.contains(kernel),
            "{layer}: no {kernel} in its swimlane"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A layer given twice, and a flag that does not apply to one of the layers, are refused by
/// name before any layer runs.
#[test]
fn bench_dsv4_refuses_a_layer_list_a_flag_does_not_fit() {
    for (kernels, more, needle) in [
        ("swa,hca,swa", &[][..], "--kernel: swa is given twice"),
        (
            "swa,moe",
            &["--replay", "off"][..],
            "the moe layer's steps are orchestrated",
        ),
        (
            "hca,moe",
            &["--versus-proj-blocks", "4"][..],
            "the moe layer's experts",
        ),
        ("moe,swa", &["--ep", "2"][..], "give --kernel moe"),
        (
            "moe,csa",
            &["--experts-per-rank", "16"][..],
            "--experts-per-rank: only with --ep",
        ),
    ] {
        let out = simpler(&bench_tiny(kernels, more));
        let se = text(&out.stderr);
        assert!(!out.status.success(), "{kernels} {more:?}: {se}");
        assert!(se.contains(needle), "{kernels} {more:?}: {se}");
        assert!(
            text(&out.stdout).is_empty(),
            "{kernels} {more:?}: ran anyway"
        );
    }
}

/// `--routing hash` runs the MoE as the first layers route (the token-id table), checked
/// against the golden of that layer, on one rank and over two; `top-k` (the default) as every
/// later layer. A layer that routes nothing refuses the flag by name.
#[test]
fn moe_routing_picks_the_hash_or_the_top_k_layer() {
    for (routing, says) in [
        (
            "hash",
            "MoE layer 0 (hash-routed: each token id's 2 experts",
        ),
        ("top-k", "MoE layer 3 (top-2 of score + bias)"),
    ] {
        let mut args = vec![
            "run",
            "dsv4",
            "--layer",
            "moe",
            "--preset",
            "tiny",
            "--routing",
            routing,
            "--check",
        ];
        args.extend_from_slice(QUICK);
        let out = simpler(&args);
        let so = text(&out.stdout);
        assert!(out.status.success(), "{routing}: {}", text(&out.stderr));
        assert!(so.contains(says), "{so}");
        assert!(so.contains("ok: routing: 16 routes as the golden"), "{so}");
    }
    let out = simpler(&[
        "run",
        "dsv4",
        "--layer",
        "moe",
        "--preset",
        "tiny",
        "--routing",
        "hash",
        "--ep",
        "2",
        "--check",
        "--rounds",
        "1",
        "--warmup",
        "0",
    ]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        so.contains("hash-routed") && so.contains("ok: routing: 16 routes as one rank"),
        "{so}"
    );
    for args in [
        &[
            "run",
            "dsv4",
            "--layer",
            "swa",
            "--preset",
            "tiny",
            "--routing",
            "hash",
        ][..],
        &[
            "bench",
            "dsv4",
            "--kernel",
            "moe,hca",
            "--preset",
            "tiny",
            "--routing",
            "top-k",
        ],
    ] {
        refused(args, "--routing: it picks how the moe layer routes");
    }
}

/// `--real-tokens` pads sequences (the spec's slot -1): the step runs with its padding rows,
/// `--check` compares the real rows and every cache (the padding wrote nothing), and the
/// report says how many rows were padding. Wrong counts, the moe layer and the benchmark
/// refuse it by name.
#[test]
fn real_tokens_pad_the_attention_step_and_are_refused_elsewhere() {
    let mut args = vec![
        "run",
        "dsv4",
        "--layer",
        "csa",
        "--preset",
        "tiny",
        "--real-tokens",
        "2,1,0,2",
        "--check",
    ];
    args.extend_from_slice(QUICK);
    let out = simpler(&args);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        so.contains("real tokens [2, 1, 0, 2] (3 padding rows, written nowhere;"),
        "{so}"
    );
    assert!(
        so.contains("ok: unwritten rows") && !so.contains("FAILED"),
        "{so}"
    );
    for (args, says) in [
        (
            &[
                "run",
                "dsv4",
                "--layer",
                "swa",
                "--preset",
                "tiny",
                "--real-tokens",
                "2,2",
            ][..],
            "--real-tokens: 2 values for the step's 4 sequences",
        ),
        (
            &[
                "run",
                "dsv4",
                "--layer",
                "hca",
                "--preset",
                "tiny",
                "--real-tokens",
                "2,3,2,2",
            ],
            "--real-tokens: sequence 1 has 3 real tokens",
        ),
        (
            &[
                "run",
                "dsv4",
                "--layer",
                "moe",
                "--preset",
                "tiny",
                "--real-tokens",
                "2,2,2,2",
            ],
            "--real-tokens: padding rows apply to swa, csa and hca, not moe",
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
                "--real-tokens",
                "2,2,2,2",
            ],
            "--real-tokens: padding rows apply to swa, csa and hca, not moe",
        ),
        (
            &[
                "bench",
                "dsv4",
                "--kernel",
                "swa",
                "--preset",
                "tiny",
                "--real-tokens",
                "2,2,2,2",
            ],
            "--real-tokens: bench dsv4 measures whole steps",
        ),
    ] {
        refused(args, says);
    }
}
