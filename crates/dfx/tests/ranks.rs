//! Traces of several ranks (one file per process): placement on one axis through the host's
//! monotonic clock (wall-clock anchors that disagree do not move them), hosts placed by wall
//! clock, Perfetto rows named and ordered by rank, the per-round multi-rank statistics, and
//! hostile `process` lines refused with their file and line.

mod common;

use std::path::{Path, PathBuf};

use simpler_core::clock::ClockAnchor;
use simpler_core::trace::{ClockOffset, ProcessClock};
use simpler_dfx::DfxError;
use simpler_dfx::TraceWriter;
use simpler_dfx::perfetto::timing_to_perfetto;
use simpler_dfx::reader::{ClockAlignment, Trace, read_traces};
use simpler_dfx::timing::{by_callable, multi_rank, rounds_table};
use simpler_dfx::writer::{ProcessRole, set_process_role, this_process_clock};

const BOOT: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

fn clock(pid: u32, boot: &str, mono_ns: u64, rank: Option<u32>) -> ProcessClock {
    ProcessClock {
        pid,
        boot_id: boot.into(),
        mono_ns,
        uncertainty_ns: 20,
        rank,
        ranks: rank.map(|_| 2),
        role: rank.map(|r| format!("chip {r}")),
        clock_offset: None,
    }
}

fn span_line(pid: u32, inv: u64, name: &str, ts_ns: u64, dur_ns: u64) -> String {
    common::span_line(pid, inv, 0, name, ts_ns, dur_ns)
}

/// Writes one rank's file: the anchor of `pid` at `wall_ns`, an optional process line, then
/// `run` spans of the given `(inv, ts_ns, dur_ns)`.
fn write_rank(
    path: &Path,
    pid: u32,
    wall_ns: u64,
    process: Option<&ProcessClock>,
    runs: &[(u64, u64, u64)],
) {
    let anchor = ClockAnchor { pid, wall_ns };
    let mut w = TraceWriter::append_with_anchor(path, anchor).unwrap();
    if let Some(p) = process {
        w.process_clock(p).unwrap();
    }
    w.finish().unwrap();
    let mut text = std::fs::read_to_string(path).unwrap();
    for &(inv, ts, dur) in runs {
        text.push_str(&span_line(anchor.pid, inv, "run", ts, dur));
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

fn files(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    (
        dir.join("r0.jsonl"),
        dir.join("r1.jsonl"),
        dir.join("r2.jsonl"),
    )
}

#[test]
fn one_host_aligns_on_its_monotonic_clock_whatever_the_wall_anchors_say() {
    let dir = common::temp_dir("ranks-mono");
    let (a, b, c) = files(&dir);
    // Rank 1 started 700 ns after rank 0 on the host's monotonic clock, but its wall-clock
    // anchor says 5 ms before (a wall clock stepped between the two starts).
    write_rank(
        &a,
        10,
        1_000_000_000,
        Some(&clock(10, BOOT, 50_000, Some(0))),
        &[(0, 1_000, 100)],
    );
    write_rank(
        &b,
        11,
        995_000_000,
        Some(&clock(11, BOOT, 50_700, Some(1))),
        &[(0, 1_000, 100)],
    );
    // An old-style file without a process line: placed by its wall anchor.
    write_rank(&c, 12, 1_000_002_000, None, &[(0, 0, 10)]);
    let t = read_traces(&[&a, &b, &c]).unwrap();
    let start = |pid: u32| t.spans.iter().find(|s| s.span.pid == pid).unwrap().wall_ns;
    assert_eq!(start(10), 1_000_001_000);
    assert_eq!(start(11), 1_000_001_700);
    assert_eq!(start(12), 1_000_002_000);
    assert_eq!(
        t.processes[1].alignment,
        ClockAlignment::Monotonic {
            reference: 0,
            uncertainty_ns: 40
        }
    );
    assert_eq!(t.processes[2].alignment, ClockAlignment::Wall);
    let summary = t.clock_summary();
    assert!(
        summary.contains(
            "2 processes of host boot 0f1e2d3c aligned on its CLOCK_MONOTONIC within ±40 ns"
        ),
        "{summary}"
    );
    // Rank 1's wall anchor is 5 ms (minus 700 ns) off the monotonic placement.
    assert!(summary.contains("up to 5000.7 µs"), "{summary}");
    assert!(
        summary.contains("1 processes wrote no process line"),
        "{summary}"
    );
    // The order of the files does not matter: rank 1 first makes it the reference.
    let t2 = read_traces(&[&b, &a]).unwrap();
    let gap = |t: &simpler_dfx::reader::Trace| {
        let s = |pid: u32| t.spans.iter().find(|s| s.span.pid == pid).unwrap().wall_ns as i64;
        s(11) - s(10)
    };
    assert_eq!(gap(&t), 700);
    assert_eq!(gap(&t2), 700);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn other_hosts_are_placed_by_their_wall_clocks() {
    let dir = common::temp_dir("ranks-hosts");
    let (a, b, _) = files(&dir);
    write_rank(
        &a,
        10,
        1_000_000_000,
        Some(&clock(10, BOOT, 50_000, Some(0))),
        &[(0, 0, 100)],
    );
    write_rank(
        &b,
        10,
        1_000_000_500,
        Some(&clock(10, "another-boot", 9_999_999, Some(1))),
        &[(0, 0, 100)],
    );
    let t = read_traces(&[&a, &b]).unwrap();
    // The same pid on two hosts is two processes.
    assert_eq!(t.processes.len(), 2);
    assert_eq!(
        t.spans.iter().map(|s| s.wall_ns).collect::<Vec<_>>(),
        vec![1_000_000_000, 1_000_000_500]
    );
    assert!(t.clock_summary().contains("the 2 hosts are placed"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Start of the first span of `pid` on the merged axis.
fn start_of(t: &Trace, pid: u32) -> u64 {
    t.spans.iter().find(|s| s.span.pid == pid).unwrap().wall_ns
}

/// A rank on another host whose process line carries its measured clock offset to rank 0's
/// host is placed on rank 0's clock through it (its own monotonic clock and its wall anchor
/// say nothing about rank 0's); without the offset (a trace from before offsets were
/// written) it is placed by its wall anchor, as before.
#[test]
fn a_measured_offset_places_another_hosts_rank_on_rank_0s_clock() {
    let dir = common::temp_dir("ranks-offset");
    let r0 = dir.join("r0.jsonl");
    write_rank(
        &r0,
        10,
        1_000_000_000,
        Some(&clock(10, BOOT, 50_000, Some(0))),
        &[(0, 1_000, 100)],
    );
    let offset = |offset_ns| ClockOffset {
        reference_boot_id: BOOT.into(),
        offset_ns,
        uncertainty_ns: 500,
    };
    // Rank 1's CLOCK_MONOTONIC reads 8_949_300 ns more than rank 0's at every instant, so its
    // zero (9_000_000 on its clock) is 50_700 on rank 0's: 700 ns after rank 0's zero. Its
    // wall anchor is 3 ms off.
    let ahead = dir.join("ahead.jsonl");
    let mut c1 = clock(11, "another-boot", 9_000_000, Some(1));
    c1.clock_offset = Some(offset(8_949_300));
    write_rank(&ahead, 11, 1_003_000_000, Some(&c1), &[(0, 1_000, 100)]);
    let t = read_traces(&[&r0, &ahead]).unwrap();
    assert_eq!(start_of(&t, 10), 1_000_001_000);
    assert_eq!(start_of(&t, 11), 1_000_001_700);
    assert_eq!(
        t.processes[1].alignment,
        ClockAlignment::Measured {
            reference: 0,
            uncertainty_ns: 20 + 500 + 20
        }
    );
    let summary = t.clock_summary();
    assert!(
        summary.contains(
            "2 processes of host boot 0f1e2d3c aligned on its CLOCK_MONOTONIC (1 of them from other hosts, through the clock offsets they measured to rank 0) within ±540 ns"
        ),
        "{summary}"
    );
    // Rank 1's file first makes it the reference: the same gap.
    let t2 = read_traces(&[&ahead, &r0]).unwrap();
    assert_eq!(start_of(&t2, 11) - start_of(&t2, 10), 700);
    // A clock behind rank 0's: 1_000 on it is 50_700 on rank 0's.
    let behind = dir.join("behind.jsonl");
    let mut c1 = clock(11, "another-boot", 1_000, Some(1));
    c1.clock_offset = Some(offset(-49_700));
    write_rank(&behind, 11, 990_000_000, Some(&c1), &[(0, 1_000, 100)]);
    let t = read_traces(&[&r0, &behind]).unwrap();
    assert_eq!(start_of(&t, 11), 1_000_001_700);
    // The same file without the offset: placed by its own wall anchor.
    let old = dir.join("old.jsonl");
    c1.clock_offset = None;
    write_rank(&old, 11, 990_000_000, Some(&c1), &[(0, 1_000, 100)]);
    let t = read_traces(&[&r0, &old]).unwrap();
    assert_eq!(start_of(&t, 11), 990_001_000);
    assert!(t.clock_summary().contains("the 2 hosts are placed"));
    // On rank 0's own host an offset is a measurement of zero: the shared clock is exact and
    // the recorded offset is not applied.
    let same = dir.join("same.jsonl");
    let mut c1 = clock(11, BOOT, 50_700, Some(1));
    c1.clock_offset = Some(offset(123_456));
    write_rank(&same, 11, 1_000_000_000, Some(&c1), &[(0, 1_000, 100)]);
    let t = read_traces(&[&r0, &same]).unwrap();
    assert_eq!(start_of(&t, 11), 1_000_001_700);
    assert_eq!(
        t.processes[1].alignment,
        ClockAlignment::Monotonic {
            reference: 0,
            uncertainty_ns: 40
        }
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn perfetto_rows_are_named_and_ordered_by_rank() {
    let dir = common::temp_dir("ranks-perfetto");
    let (a, b, _) = files(&dir);
    // Rank 1's file comes first.
    write_rank(
        &a,
        21,
        0,
        Some(&clock(21, BOOT, 0, Some(1))),
        &[(0, 10, 100)],
    );
    write_rank(
        &b,
        20,
        0,
        Some(&clock(20, BOOT, 0, Some(0))),
        &[(0, 10, 100)],
    );
    let t = read_traces(&[&a, &b]).unwrap();
    let doc = timing_to_perfetto(&t).to_json();
    let events = common::check_trace_events(&doc);
    let meta = |name: &str, pid: u64| {
        events
            .iter()
            .find(|e| e["ph"] == "M" && e["name"] == name && e["pid"] == pid)
            .unwrap()["args"]
            .clone()
    };
    assert!(
        meta("process_name", 20)["name"]
            .as_str()
            .unwrap()
            .starts_with("rank 0 (chip 0, pid 20)")
    );
    assert!(
        meta("process_name", 21)["name"]
            .as_str()
            .unwrap()
            .starts_with("rank 1 (chip 1, pid 21)")
    );
    assert_eq!(meta("process_sort_index", 20)["sort_index"], 0);
    assert_eq!(meta("process_sort_index", 21)["sort_index"], 1);
    assert!(
        doc["otherData"]["clock_alignment"]
            .as_str()
            .unwrap()
            .contains("CLOCK_MONOTONIC")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two ranks' files in `dir`, ranks 0 and 1 as processes `pid` and `pid + 1`: rank 0 runs 10,
/// 20, 30, 40 µs; rank 1 15, 5, (missing), 50 µs. Returns the paths.
fn two_ranks_of_four_rounds(dir: &Path, pid: u32) -> (PathBuf, PathBuf) {
    let (a, b, _) = files(dir);
    write_rank(
        &a,
        pid,
        0,
        Some(&clock(pid, BOOT, 0, Some(0))),
        &[
            (0, 0, 10_000),
            (1, 100_000, 20_000),
            (2, 200_000, 30_000),
            (3, 300_000, 40_000),
        ],
    );
    write_rank(
        &b,
        pid + 1,
        0,
        Some(&clock(pid + 1, BOOT, 0, Some(1))),
        &[(0, 0, 15_000), (1, 100_000, 5_000), (3, 300_000, 50_000)],
    );
    (a, b)
}

#[test]
fn rounds_join_ranks_by_invocation_and_drop_incomplete_rounds() {
    let dir = common::temp_dir("ranks-rounds");
    let (a, b) = two_ranks_of_four_rounds(&dir, 30);
    let t = read_traces(&[&a, &b]).unwrap();
    let g = &by_callable(&t)[0];
    let m = multi_rank(&t, g, 0).unwrap();
    // Valid rounds 0, 1, 3: slowest 15, 20, 50; fastest 10, 5, 40.
    assert!(m.contains("valid_rounds=3/4"), "{m}");
    assert!(
        m.contains("effective_us: n=3 (warm-up 0 discarded) min=15.00 median=20.00"),
        "{m}"
    );
    assert!(
        m.contains("fast_effective_us: n=3 (warm-up 0 discarded) min=5.00 median=10.00"),
        "{m}"
    );
    assert!(m.contains("rank 1: n=3 median=15.00"), "{m}");
    // With the first round as warm-up.
    let m = multi_rank(&t, g, 1).unwrap();
    assert!(m.contains("valid_rounds=2/3"), "{m}");
    assert!(rounds_table(&t, 0).contains("2 ranks, rounds joined"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two runs of one job read together (each rank recorded by two processes) are not joined per
/// round, whose invocation numbers repeat across runs: the section says so, naming the rank
/// and both processes, rather than one run's rounds silently replacing the other's.
#[test]
fn two_runs_of_the_same_ranks_are_not_joined_per_round() {
    let dir = common::temp_dir("ranks-two-runs");
    for run in ["first", "second"] {
        std::fs::create_dir_all(dir.join(run)).unwrap();
    }
    let (a, b) = two_ranks_of_four_rounds(&dir.join("first"), 30);
    let (c, d) = two_ranks_of_four_rounds(&dir.join("second"), 40);
    let t = read_traces(&[&a, &b, &c, &d]).unwrap();
    let groups = by_callable(&t);
    assert_eq!(groups.len(), 1);
    let m = multi_rank(&t, &groups[0], 0).unwrap();
    assert!(
        m.contains("ranks not joined per round: rank 0 was recorded by 2 processes (pid 30 in")
            && m.contains("pid 40 in"),
        "{m}"
    );
    assert!(!m.contains("valid_rounds"), "{m}");
    // One run's files still join.
    let t = read_traces(&[&c, &d]).unwrap();
    assert!(
        multi_rank(&t, &by_callable(&t)[0], 0)
            .unwrap()
            .contains("valid_rounds=3/4")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A round one rank marked warm-up (`warmup: true` on its `run`) is left out on every rank,
/// before `--warmup` counts the rounds after it.
#[test]
fn a_round_one_rank_marked_warm_up_is_left_out_on_every_rank() {
    let dir = common::temp_dir("ranks-warmup");
    let (a, b) = two_ranks_of_four_rounds(&dir, 32);
    // Rank 1 marks its round 0 warm-up.
    let text = std::fs::read_to_string(&b).unwrap();
    let first = span_line(33, 0, "run", 0, 15_000);
    assert!(text.contains(&first));
    let marked = format!(
        "{},\"attrs\":{{\"warmup\":true}}}}",
        &first[..first.len() - 1]
    );
    std::fs::write(&b, text.replace(&first, &marked)).unwrap();
    let t = read_traces(&[&a, &b]).unwrap();
    let g = &by_callable(&t)[0];
    assert_eq!(g.invs.iter().filter(|i| i.warmup).count(), 1);
    let m = multi_rank(&t, g, 0).unwrap();
    // Rounds 1, 2, 3 remain; 1 and 3 are valid: slowest 20, 50; fastest 5, 40.
    assert!(m.contains("valid_rounds=2/3"), "{m}");
    assert!(
        m.contains("effective_us: n=2 (warm-up 0 discarded) min=20.00 median=35.00"),
        "{m}"
    );
    assert!(m.contains("rank 0: n=3 median=30.00"), "{m}");
    assert!(m.contains("rank 1: n=2 median=27.50"), "{m}");
    // `--warmup 1` then discards round 1 as well.
    let m = multi_rank(&t, g, 1).unwrap();
    assert!(m.contains("valid_rounds=1/2"), "{m}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Marks that leave no round to join are said; marks on every invocation are set aside.
#[test]
fn rounds_all_marked_warm_up_are_said_not_passed_over() {
    let dir = common::temp_dir("ranks-all-warm");
    let (a, b) = two_ranks_of_four_rounds(&dir, 34);
    // Marks `run` spans of `pid` at the given invocations.
    let mark = |path: &Path, pid: u32, runs: &[(u64, u64, u64)]| {
        let mut text = std::fs::read_to_string(path).unwrap();
        for &(inv, ts, dur) in runs {
            let line = span_line(pid, inv, "run", ts, dur);
            assert!(text.contains(&line));
            let marked = format!(
                "{},\"attrs\":{{\"warmup\":true}}}}",
                &line[..line.len() - 1]
            );
            text = text.replace(&line, &marked);
        }
        std::fs::write(path, text).unwrap();
    };
    // Rank 0 marks rounds 0 and 1, rank 1 round 3: rounds 0, 1 and 3 go, and round 2 has
    // only rank 0.
    mark(&a, 34, &[(0, 0, 10_000), (1, 100_000, 20_000)]);
    mark(&b, 35, &[(3, 300_000, 50_000)]);
    let t = read_traces(&[&a, &b]).unwrap();
    let m = multi_rank(&t, &by_callable(&t)[0], 0).unwrap();
    assert!(
        m.contains(
            "2 ranks: valid_rounds=0/1 (in the rounds not marked warm-up, ranks [1] recorded nothing)"
        ),
        "{m}"
    );
    // Every remaining invocation marked too: nothing is left to join, and that is said.
    mark(&a, 34, &[(2, 200_000, 30_000), (3, 300_000, 40_000)]);
    mark(&b, 35, &[(0, 0, 15_000)]);
    let t = read_traces(&[&a, &b]).unwrap();
    let g = &by_callable(&t)[0];
    assert_eq!(g.invs.iter().filter(|i| !i.warmup).count(), 1);
    let m = multi_rank(&t, g, 0).unwrap();
    assert!(
        m.contains("2 ranks: valid_rounds=0/0 (every round is marked warm-up on some rank)"),
        "{m}"
    );
    // All of them marked: the marks are set aside, saying so.
    mark(&b, 35, &[(1, 100_000, 5_000)]);
    let t = read_traces(&[&a, &b]).unwrap();
    let m = multi_rank(&t, &by_callable(&t)[0], 0).unwrap();
    assert!(
        m.contains("(every round is marked warm-up: joined, as nothing else is)")
            && m.contains("valid_rounds=3/4"),
        "{m}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rank_that_recorded_nothing_leaves_no_valid_round() {
    let dir = common::temp_dir("ranks-missing");
    let (a, b, _) = files(&dir);
    let mut c0 = clock(40, BOOT, 0, Some(0));
    let mut c2 = clock(41, BOOT, 0, Some(2));
    (c0.ranks, c2.ranks) = (Some(3), Some(3));
    write_rank(&a, 40, 0, Some(&c0), &[(0, 0, 1_000)]);
    write_rank(&b, 41, 0, Some(&c2), &[(0, 0, 1_000)]);
    let t = read_traces(&[&a, &b]).unwrap();
    let m = multi_rank(&t, &by_callable(&t)[0], 0).unwrap();
    assert!(
        m.contains("valid_rounds=0/1 (ranks [1] recorded no invocation"),
        "{m}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hostile_process_lines_are_refused_naming_the_file() {
    let dir = common::temp_dir("ranks-hostile");
    let path = dir.join("bad.jsonl");
    let anchor = r#"{"kind":"anchor","pid":5,"wall_ns":1}"#;
    let process = |extra: &str| {
        format!(
            r#"{{"kind":"process","pid":5,"boot_id":"b","mono_ns":1,"uncertainty_ns":1{extra}}}"#
        )
    };
    let cases: [(String, &str); 5] = [
        (
            format!("{anchor}\n{}", process(r#","rank":2,"ranks":2"#)),
            "rank 2 is not below ranks 2",
        ),
        (
            format!("{anchor}\n{}", process(r#","ranks":0"#)),
            "ranks 0 is not between",
        ),
        (
            format!("{anchor}\n{}", process(r#","rank":4294967295"#)),
            "rank 4294967295 is not below",
        ),
        (
            format!("{anchor}\n{}\n{}", process(""), process(r#","rank":1"#)),
            "a second, different process line",
        ),
        (format!("{anchor}\n{}", process(r#","mono_ns":-1"#)), ""),
    ];
    for (text, says) in cases {
        std::fs::write(&path, &text).unwrap();
        let e = read_traces(&[&path]).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("bad.jsonl:2") || msg.contains("bad.jsonl:3"),
            "{msg}"
        );
        assert!(msg.contains(says), "{msg}");
    }
    // A process line before any anchor of its pid.
    std::fs::write(&path, process("")).unwrap();
    assert!(matches!(
        read_traces(&[&path]).unwrap_err(),
        DfxError::MissingAnchor {
            line: 1,
            pid: 5,
            ..
        }
    ));
    // Extreme monotonic readings and anchors place spans by saturation, never panic.
    let text = format!(
        "{}\n{}\n{}\n{}\n{}\n",
        r#"{"kind":"anchor","pid":1,"wall_ns":18446744073709551615}"#,
        r#"{"kind":"process","pid":1,"boot_id":"b","mono_ns":0,"uncertainty_ns":18446744073709551615}"#,
        r#"{"kind":"anchor","pid":2,"wall_ns":0}"#,
        r#"{"kind":"process","pid":2,"boot_id":"b","mono_ns":18446744073709551615,"uncertainty_ns":18446744073709551615}"#,
        span_line(2, 0, "run", u64::MAX, 0),
    );
    std::fs::write(&path, text).unwrap();
    let t = read_traces(&[&path]).unwrap();
    assert_eq!(t.spans[0].wall_ns, u64::MAX);
    assert!(t.clock_summary().contains("±18446744073709551615 ns"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_writer_names_this_process_and_its_rank() {
    set_process_role(ProcessRole::chip(3, 4)).unwrap();
    // One process, one rank.
    assert!(set_process_role(ProcessRole::chip(0, 4)).is_err());
    let dir = common::temp_dir("ranks-writer");
    let path = dir.join("me.jsonl");
    TraceWriter::append(&path).unwrap().finish().unwrap();
    let t = read_traces(&[&path]).unwrap();
    let p = &t.processes[0];
    let c = p.clock.as_ref().unwrap();
    assert_eq!(c, &this_process_clock());
    assert_eq!(
        (c.rank, c.ranks, c.role.as_deref()),
        (Some(3), Some(4), Some("chip 3"))
    );
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    assert_eq!(c.boot_id, boot.trim());
    // A chip of a node: on rank 0's host, offset 0.
    assert_eq!(
        c.clock_offset,
        Some(ClockOffset {
            reference_boot_id: boot.trim().into(),
            offset_ns: 0,
            uncertainty_ns: 0
        })
    );
    // The process's zero on CLOCK_MONOTONIC: the monotonic read bracketed by two reads of the
    // process's axis (a thread preempted between two unbracketed reads on a loaded host moved
    // the estimate by the time it waited).
    let before = simpler_core::clock::now_ns();
    let mono = libc_now();
    let after = simpler_core::clock::now_ns();
    let ts = mono.saturating_sub(before + (after - before) / 2);
    assert!(
        c.mono_ns.abs_diff(ts) < 10_000_000 + (after - before),
        "{} vs {ts} (bracket {} ns)",
        c.mono_ns,
        after - before
    );
    assert_eq!(
        p.display_name(),
        format!("rank 3 (chip 3, pid {})", std::process::id())
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `CLOCK_MONOTONIC` now, in ns (an independent read of the clock the writer anchors to).
fn libc_now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Writes `records` as a rank's `swimlane.json` with the given anchor and process line (what
/// `write_run_diagnostics` writes in that rank's process).
fn write_swimlane(
    dir: &Path,
    records: &simpler_core::trace::SwimlaneRecords,
    clock: Option<(ClockAnchor, ProcessClock)>,
) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut doc = serde_json::to_value(records).unwrap();
    doc["v"] = 1.into();
    if let Some((a, p)) = clock {
        doc["anchor"] = serde_json::to_value(a).unwrap();
        doc["process"] = serde_json::to_value(p).unwrap();
    }
    let path = dir.join("swimlane.json");
    std::fs::write(&path, doc.to_string()).unwrap();
    path
}

#[test]
fn swimlanes_of_several_ranks_merge_with_core_lanes_per_rank() {
    use simpler_dfx::diag::{load_joined, read_swimlane_clock};
    use simpler_dfx::swimlane::{RankSwimlane, ranks_to_perfetto};

    let dir = common::temp_dir("ranks-swimlane");
    let (records, _) = common::scenario_a();
    // Rank 1's process started 1 µs after rank 0's on the monotonic clock; its wall anchor
    // says 3 ms earlier.
    let p0 = write_swimlane(
        &dir.join("r0"),
        &records,
        Some((
            ClockAnchor {
                pid: 50,
                wall_ns: 2_000_000_000,
            },
            clock(50, BOOT, 10_000, Some(0)),
        )),
    );
    let p1 = write_swimlane(
        &dir.join("r1"),
        &records,
        Some((
            ClockAnchor {
                pid: 51,
                wall_ns: 1_997_000_000,
            },
            clock(51, BOOT, 11_000, Some(1)),
        )),
    );
    // The records still load on their own (the clock fields are extra).
    let (j0, j1) = (
        load_joined(&p0, None).unwrap(),
        load_joined(&p1, None).unwrap(),
    );
    // Rank 1 given first: rows are still ordered by rank.
    let ranks = [
        RankSwimlane {
            path: &p1,
            records: &j1.swimlane,
            deps: None,
            clock: read_swimlane_clock(&p1).unwrap(),
        },
        RankSwimlane {
            path: &p0,
            records: &j0.swimlane,
            deps: None,
            clock: read_swimlane_clock(&p0).unwrap(),
        },
    ];
    let (doc, clocks) = ranks_to_perfetto(&ranks).unwrap();
    assert!(clocks.contains("2 processes of host boot"), "{clocks}");
    let doc = doc.to_json();
    let events = common::check_trace_events(&doc);
    let pid_of = |rank: &str| {
        events
            .iter()
            .find(|e| {
                e["name"] == "process_name" && e["args"]["name"].as_str().unwrap().starts_with(rank)
            })
            .unwrap()["pid"]
            .as_u64()
            .unwrap()
    };
    let (a, b) = (
        pid_of("rank 0 (chip 0, pid 50): "),
        pid_of("rank 1 (chip 1, pid 51): "),
    );
    assert_ne!(a, b);
    let sort = |pid: u64| {
        events
            .iter()
            .find(|e| e["name"] == "process_sort_index" && e["pid"] == pid)
            .unwrap()["args"]["sort_index"]
            .as_u64()
            .unwrap()
    };
    assert_eq!((sort(a), sort(b)), (0, 1));
    // Every core lane exists in both ranks, and rank 1's first block starts 1 µs after rank 0's.
    let lanes = |pid: u64| {
        events
            .iter()
            .filter(|e| e["name"] == "thread_name" && e["pid"] == pid)
            .filter(|e| e["args"]["name"].as_str().unwrap().starts_with("core"))
            .count()
    };
    assert_eq!((lanes(a), lanes(b)), (2, 2));
    let first_block = |pid: u64| {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["cat"] != "sched")
            .map(|e| e["ts"].as_f64().unwrap())
            .fold(f64::INFINITY, f64::min)
    };
    assert!((first_block(b) - first_block(a) - 1.0).abs() < 1e-9);
    // A file from before the clock fields cannot be placed: refused, naming it.
    let old = write_swimlane(&dir.join("old"), &records, None);
    let jo = load_joined(&old, None).unwrap();
    let e = ranks_to_perfetto(&[RankSwimlane {
        path: &old,
        records: &jo.swimlane,
        deps: None,
        clock: read_swimlane_clock(&old).unwrap(),
    }])
    .err()
    .unwrap();
    assert!(e.to_string().contains("old/swimlane.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The merged document counts the happens-before violations of every rank's arrows, as one
/// file's does, and leaves the count out where no rank had a graph to check.
#[test]
fn merged_swimlanes_count_every_ranks_happens_before_violations() {
    use simpler_core::EngineClass;
    use simpler_core::trace::SwimlaneRecords;
    use simpler_dfx::diag::SwimlaneClock;
    use simpler_dfx::swimlane::{RankSwimlane, ranks_to_perfetto, to_perfetto};

    // Task 1 depends on task 0 but starts (50) before task 0 ends (100).
    let r = SwimlaneRecords {
        level: 2,
        fingerprint: "fp".into(),
        cores: 2,
        tasks: vec![
            common::rec(0, 1, EngineClass::Vector, 0, [0, 0, 100, 100]),
            common::rec(1, 1, EngineClass::Vector, 1, [50, 50, 150, 150]),
        ],
        ..Default::default()
    };
    let d = common::graph(2, &[(0, 1)], "fp");
    assert_eq!(
        to_perfetto(&r, Some(&d)).to_json()["otherData"]["happens_before_violations"],
        1
    );
    let clock = |pid| SwimlaneClock {
        anchor: Some(ClockAnchor {
            pid,
            wall_ns: 1_000_000,
        }),
        process: None,
    };
    let rank = |pid, deps| RankSwimlane {
        path: Path::new("swimlane.json"),
        records: &r,
        deps,
        clock: clock(pid),
    };
    let merged = |ranks: &[RankSwimlane]| ranks_to_perfetto(ranks).unwrap().0.to_json();
    let both = merged(&[rank(60, Some(&d)), rank(61, Some(&d))]);
    assert_eq!(both["otherData"]["happens_before_violations"], 2);
    let one = merged(&[rank(60, Some(&d)), rank(61, None)]);
    assert_eq!(one["otherData"]["happens_before_violations"], 1);
    let none = merged(&[rank(60, None), rank(61, None)]);
    assert!(none["otherData"].get("happens_before_violations").is_none());
}
