//! Several ranks end to end: `bench collectives` runs a node of 2 chips (child processes),
//! each writes its own trace, and `trace timing` merges them on the host's monotonic clock
//! with rows per rank and the multi-rank statistics; refused flags are named.

mod common;

use common::{simpler, text, tmp};

#[test]
fn bench_collectives_ranks_write_traces_that_merge_per_round() {
    let dir = tmp("ranks");
    let out = simpler(&[
        "bench",
        "collectives",
        "--ranks",
        "2",
        "--sizes",
        "0,4096",
        "--rounds",
        "6",
        "--warmup",
        "2",
        "--trace-dir",
        dir.to_str().unwrap(),
    ]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{so}\n{}", text(&out.stderr));
    assert!(so.contains("this host has"), "{so}");
    // 2 ops × 2 sizes, every round from both ranks.
    let rows: Vec<&str> = so.lines().filter(|l| l.starts_with("shm ")).collect();
    assert_eq!(rows.len(), 4, "{so}");
    assert!(rows.iter().all(|r| r.ends_with(" 6/6")), "{so}");
    let files: Vec<String> = (0..2)
        .map(|r| {
            dir.join(format!("shm-2ranks-rank{r}.jsonl"))
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let perfetto = dir.join("merged.json");
    let out = simpler(&[
        "trace",
        "timing",
        "--rounds",
        "--warmup",
        "2",
        &files[0],
        &files[1],
        "--perfetto",
        perfetto.to_str().unwrap(),
    ]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{so}\n{}", text(&out.stderr));
    assert!(
        so.contains("clocks: 2 processes of host boot") && so.contains("CLOCK_MONOTONIC"),
        "{so}"
    );
    // One table per (operation, size), joined over the 2 ranks per round.
    assert_eq!(so.matches("2 ranks, rounds joined").count(), 4, "{so}");
    assert_eq!(so.matches("valid_rounds=6/6").count(), 4, "{so}");
    assert!(
        so.contains("rank 0: n=6") && so.contains("rank 1: n=6"),
        "{so}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&perfetto).unwrap()).unwrap();
    let names: Vec<String> = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names.iter().any(|n| n.starts_with("rank 0 (chip 0, pid ")),
        "{names:?}"
    );
    assert!(
        names.iter().any(|n| n.starts_with("rank 1 (chip 1, pid ")),
        "{names:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_collectives_refuses_bad_flags_by_name() {
    for (args, says) in [
        (&["--ranks", "1"][..], "--ranks 1"),
        (&["--rounds", "0"][..], "--rounds 0"),
        (&["--sizes", "999999999999"][..], "--sizes 999999999999"),
        (
            &["--sizes", "0,3"][..],
            "--sizes 3: give multiples of 4 bytes",
        ),
    ] {
        let mut all = vec!["bench", "collectives"];
        all.extend_from_slice(args);
        let out = simpler(&all);
        assert!(!out.status.success());
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    }
}

#[test]
fn swimlanes_of_two_processes_merge_into_one_view_with_their_core_lanes() {
    let dir = tmp("swimlanes");
    let outs: Vec<String> = (0..2)
        .map(|i| dir.join(format!("p{i}")).to_str().unwrap().to_string())
        .collect();
    for o in &outs {
        let out = simpler(&[
            "run",
            "demo",
            "--m",
            "64",
            "--k",
            "64",
            "--n",
            "64",
            "--tile",
            "32",
            "--swimlane",
            "2",
            "--dep-gen",
            "--output-dir",
            o,
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let perfetto = dir.join("merged.json");
    let out = simpler(&[
        "trace",
        "swimlane",
        &outs[0],
        &outs[1],
        "--perfetto",
        perfetto.to_str().unwrap(),
    ]);
    let so = text(&out.stdout);
    assert!(out.status.success(), "{so}\n{}", text(&out.stderr));
    assert!(so.contains("clocks: 2 processes of host boot"), "{so}");
    assert!(so.contains("wrote") && so.contains("(2 ranks)"), "{so}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&perfetto).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let pids: std::collections::BTreeSet<u64> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .filter(|e| e["args"]["name"].as_str().unwrap().starts_with("core "))
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "core lanes in both processes");
    // One graph for several swimlanes is refused by name.
    let out = simpler(&["trace", "swimlane", &outs[0], &outs[1], "--deps", &outs[0]]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--deps"),
        "{}",
        text(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank that stops answering (here stopped by SIGSTOP: a hung process) is diagnosed after
/// `--rank-timeout-secs`, naming it, and nothing is left running; it hung for the node's
/// default 600 s with nothing printed.
#[test]
fn a_hung_rank_is_named_after_the_rank_timeout() {
    if !std::path::Path::new("/proc/self/stat").exists() {
        eprintln!("skipped: no /proc to find the ranks' processes");
        return;
    }
    let parent = std::process::Command::new(env!("CARGO_BIN_EXE_simpler"))
        .args([
            "bench",
            "collectives",
            "--ranks",
            "2",
            "--rounds",
            "1000",
            "--warmup",
            "0",
            "--sizes",
            // Rounds of seconds in all: the chip is stopped well before they end.
            "16777216",
            "--rank-timeout-secs",
            "2",
        ])
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A chip process of the node: a child of `parent`, once it has started.
    let ppid_of = |pid: &str| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // `pid (comm) state ppid ...`: the fields after the last ')'.
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let chip = loop {
        let found = std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (ppid_of(&name) == Some(parent.id())).then_some(name)
        });
        if let Some(pid) = found {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no chip process started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // Let it reach its rounds, then stop it.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &chip])
        .status()
        .unwrap();
    assert!(stopped.success());
    let out = parent.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("did not answer bench_collectives within 2000 ms"),
        "{err}"
    );
    // The stopped chip was killed and reaped with the node.
    assert!(
        !std::path::Path::new(&format!("/proc/{chip}")).exists(),
        "chip {chip} is still there"
    );
}
