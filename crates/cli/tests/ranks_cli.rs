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
