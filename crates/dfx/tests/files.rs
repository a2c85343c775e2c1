//! Trace files end to end: writing, merging two processes by their anchors, the timing tables
//! (effective time with overlapping orch and sched), Perfetto exports and the joined
//! diagnostics files.

mod common;

use std::path::Path;

use simpler_core::clock::ClockAnchor;
use simpler_core::{Interval, RunReport};
use simpler_dfx::diag::{self, load_joined};
use simpler_dfx::perfetto::timing_to_perfetto;
use simpler_dfx::reader::read_traces;
use simpler_dfx::timing::{self, by_callable, round};
use simpler_dfx::{DfxError, TraceWriter, swimlane, write_run_diagnostics};

fn iv(a: u64, b: u64) -> Interval {
    Interval {
        start_ns: a * 1000,
        end_ns: b * 1000,
    }
}

/// A run at `t0` µs: run [t0, t0+len], orch [+10, +60], sched [+12, +90].
fn report(inv: u64, callable: u64, label: Option<&str>, t0: u64, len: u64) -> RunReport {
    RunReport {
        inv,
        callable,
        orchestration: "test".into(),
        label: label.map(str::to_string),
        host_wall: iv(t0, t0 + len),
        bind: iv(t0 + 1, t0 + 3),
        bind_args: iv(t0 + 1, t0 + 2),
        runner: iv(t0 + 3, t0 + len - 2),
        device_wall: iv(t0 + 5, t0 + len - 4),
        graph_build: iv(t0 + 5, t0 + 9),
        config_validate: iv(t0 + 5, t0 + 6),
        arena_wire: iv(t0 + 6, t0 + 8),
        reset: iv(t0 + 8, t0 + 9),
        orch: iv(t0 + 10, t0 + 60),
        sched: iv(t0 + 12, t0 + 90),
        post_orch: iv(t0 + 60, t0 + 90),
        validate: iv(t0 + len - 2, t0 + len - 1),
        ..RunReport::default()
    }
}

/// A trace writer appending to `path` as process 7, its wall clock at 1 s.
fn writer_of_pid_7(path: &std::path::Path) -> TraceWriter {
    TraceWriter::append_with_anchor(
        path,
        ClockAnchor {
            pid: 7,
            wall_ns: 1_000_000_000,
        },
    )
    .unwrap()
}

#[test]
fn effective_time_is_the_union_of_overlapping_orch_and_sched() {
    let dir = common::temp_dir("timing");
    let path = dir.join("trace.jsonl");
    {
        let mut w = writer_of_pid_7(&path);
        for k in 0..3 {
            w.report(&report(k, 0xdec0de, Some("decode"), 1000 * k, 100), 1)
                .unwrap();
        }
        w.report(&report(3, 0x9f, None, 5000, 500), 1).unwrap();
    }
    let trace = read_traces(&[&path]).unwrap();
    let groups = by_callable(&trace);
    // Busiest first: the unlabelled callable has 500 µs of run, decode 3 x 100.
    assert_eq!(groups[0].callable, "000000000000009f");
    assert_eq!(groups[0].label(), "-");
    assert_eq!(groups[1].label(), "decode");
    let r = round(&trace, &groups[1].invs[0]);
    assert_eq!(r.effective, Some(80_000));
    assert_eq!(
        (r.orch, r.sched, r.host, r.device),
        (Some(50_000), Some(78_000), Some(100_000), Some(91_000))
    );
    // Layers: ① 80, ② 91 - 80, ③ 95 - 91, ④ 100 - 95 (µs); no engine step recorded, no ⑤.
    assert_eq!(
        r.layers(),
        [Some(80_000), Some(11_000), Some(4_000), Some(5_000), None]
    );
    let table = timing::timing_table(&trace);
    assert!(table.contains("label decode  invocations 3"), "{table}");
    let eff_row = table
        .lines()
        .find(|l| l.contains("effective = orch ∪ sched"))
        .unwrap();
    assert!(eff_row.contains("80.0"), "{eff_row}");
    // Layer ① is named for what it is; "makespan" meant two intervals and is not used.
    assert!(
        table
            .lines()
            .any(|l| l.contains("① effective (orch ∪ sched)") && l.contains("80.0")),
        "{table}"
    );
    assert!(!table.to_lowercase().contains("makespan"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("      orch ") && l.contains("50.0")),
        "{table}"
    );
    let rounds = timing::rounds_table(&trace, 1);
    assert!(
        rounds.contains("summary of 2 rounds (1 warm-up excluded)"),
        "{rounds}"
    );
    assert!(
        rounds
            .lines()
            .any(|l| l.contains("(warm-up)") && l.contains("80.0")),
        "{rounds}"
    );
    let tree = timing::tree(&trace);
    assert!(
        tree.lines()
            .any(|l| l.trim_start().starts_with("orch") && l.contains("∥ sched")),
        "{tree}"
    );
    assert!(tree.contains("not orch + sched = 128.0"), "{tree}");
    // Adjacent spans (arena_wire ends where reset starts) do not overlap.
    assert!(
        tree.lines()
            .any(|l| l.trim_start().starts_with("arena_wire") && !l.contains('∥')),
        "{tree}"
    );
    assert!(
        tree.lines()
            .any(|l| l.trim_start().starts_with("run.validate") && !l.contains('∥')),
        "{tree}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs the trace marks warm-up (`CallConfig::warmup`) stay out of the statistics of every
/// table, are marked in `--rounds`, and are shown where a callable has nothing else.
#[test]
fn marked_warm_up_runs_stay_out_of_the_statistics() {
    let dir = common::temp_dir("timing-warmup");
    let path = dir.join("trace.jsonl");
    {
        let mut w = writer_of_pid_7(&path);
        // Two slow warm-up steps (1000 µs), then three measured ones (100 µs).
        for k in 0..5 {
            let r = RunReport {
                warmup: k < 2,
                ..report(
                    k,
                    0xdec0de,
                    Some("decode"),
                    2000 * k,
                    if k < 2 { 1000 } else { 100 },
                )
            };
            w.report(&r, 1).unwrap();
        }
        // A callable recorded only in its warm-up.
        let only = RunReport {
            warmup: true,
            ..report(5, 0x9f, Some("prefill"), 20_000, 3000)
        };
        w.report(&only, 1).unwrap();
    }
    let trace = read_traces(&[&path]).unwrap();
    let groups = by_callable(&trace);
    let decode = groups.iter().find(|g| g.label() == "decode").unwrap();
    assert_eq!(decode.invs.iter().filter(|i| i.warmup).count(), 2);
    let run_row = |table: &str| -> String {
        let section = table.split("label decode").nth(1).unwrap().to_string();
        section
            .lines()
            .find(|l| l.starts_with("run "))
            .unwrap()
            .to_string()
    };
    let table = timing::timing_table(&trace);
    assert!(
        table.contains("(2 invocations marked warm-up left out)"),
        "{table}"
    );
    // n 3, mean = median = min = max = 100 µs: the 1000 µs warm-ups are not in it.
    let row = run_row(&table);
    let row: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        row[1..6],
        ["3", "100.0", "100.0", "100.0", "100.0"],
        "{table}"
    );
    assert!(
        table.contains("(all 1 invocations are marked warm-up: shown, as nothing else is)"),
        "{table}"
    );
    let rounds = timing::rounds_table(&trace, 0);
    assert!(
        rounds.contains("summary of 3 rounds (2 warm-up excluded)"),
        "{rounds}"
    );
    let warm_rows = rounds
        .lines()
        .filter(|l| l.contains("(warm-up)") && l.contains("1000.0"))
        .count();
    assert_eq!(warm_rows, 2, "{rounds}");
    // `--warmup 1` counts from the first unmarked round.
    let rounds = timing::rounds_table(&trace, 1);
    assert!(
        rounds.contains("summary of 2 rounds (3 warm-up excluded)"),
        "{rounds}"
    );
    // The callable recorded only in its warm-up is summarised anyway, saying so; past its one
    // round, `--warmup` leaves no round and the interval says that.
    let all = timing::rounds_table(&trace, 0);
    let prefill = all.split("label prefill").nth(1).unwrap();
    assert!(
        prefill.contains("(all 1 invocations are marked warm-up: shown, as nothing else is)")
            && prefill.contains("summary of 1 rounds (0 warm-up excluded)")
            && prefill.contains("none (one round)"),
        "{all}"
    );
    let prefill = rounds.split("label prefill").nth(1).unwrap();
    assert!(
        prefill.contains("summary of 0 rounds (1 warm-up excluded)")
            && prefill.contains("none (no round)"),
        "{rounds}"
    );
    let tree = timing::tree(&trace);
    let section = tree.split("label decode").nth(1).unwrap();
    assert!(
        section.contains("median span tree of 3 invocations"),
        "{tree}"
    );
    assert!(
        section
            .lines()
            .any(|l| l.starts_with("run ") && l.contains("+      100.0]")),
        "{tree}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn two_processes_merge_on_their_anchors() {
    let dir = common::temp_dir("merge");
    let (a, b) = (dir.join("rank0.jsonl"), dir.join("rank1.jsonl"));
    {
        // Process 100 started 300 ns before process 200; each run starts at its own 1 µs.
        let mut w = TraceWriter::append_with_anchor(
            &a,
            ClockAnchor {
                pid: 100,
                wall_ns: 5_000_000,
            },
        )
        .unwrap();
        w.report(&report(0, 1, Some("decode"), 1, 100), 0).unwrap();
        let mut w = TraceWriter::append_with_anchor(
            &b,
            ClockAnchor {
                pid: 200,
                wall_ns: 5_000_300,
            },
        )
        .unwrap();
        w.report(&report(0, 1, Some("decode"), 1, 100), 0).unwrap();
    }
    let trace = read_traces(&[&a, &b]).unwrap();
    assert_eq!(
        trace.processes.iter().map(|p| p.pid).collect::<Vec<_>>(),
        vec![100, 200]
    );
    let run = |pid: u32| {
        trace
            .spans
            .iter()
            .find(|s| s.span.pid == pid && s.span.name == "run")
            .unwrap()
            .wall_ns
    };
    assert_eq!(run(100), 5_001_000);
    assert_eq!(run(200), 5_001_300);
    assert_eq!(trace.origin_wall_ns(), 5_001_000);
    let groups = by_callable(&trace);
    assert_eq!((groups.len(), groups[0].invs.len()), (1, 2));
    let doc = timing_to_perfetto(&trace).to_json();
    let events = common::check_trace_events(&doc);
    let ts = |pid: u64| {
        events
            .iter()
            .find(|e| e["ph"] == "X" && e["name"] == "run" && e["pid"] == pid)
            .unwrap()["ts"]
            .as_f64()
            .unwrap()
    };
    assert_eq!((ts(100), ts(200)), (0.0, 0.3));
    // orch and sched overlap, so they are on different lanes of the same invocation.
    let lane = |name: &str| {
        events
            .iter()
            .find(|e| e["ph"] == "X" && e["name"] == name && e["pid"] == 100)
            .unwrap()["tid"]
            .clone()
    };
    assert_ne!(lane("orch"), lane("sched"));
    assert_eq!(lane("run"), lane("run.bind"));
    let names = common::by_phase(&events)["M"]
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .count();
    assert!(names >= 4, "{names}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A thousand steps of one process on one thread: one host track and one overlap track (for
/// `sched`, which overlaps `orch`), each `run` a slice enclosing its own sub-spans.
#[test]
fn perfetto_has_one_track_per_thread_however_many_invocations() {
    let dir = common::temp_dir("tracks");
    let path = dir.join("steps.jsonl");
    {
        let mut w = TraceWriter::append_with_anchor(
            &path,
            ClockAnchor {
                pid: 7,
                wall_ns: 1_000_000,
            },
        )
        .unwrap();
        for inv in 0..1000 {
            w.report(&report(inv, 1, Some("decode"), 200 * inv, 100), 0)
                .unwrap();
        }
    }
    let trace = read_traces(&[&path]).unwrap();
    let doc = timing_to_perfetto(&trace).to_json();
    let events = common::check_trace_events(&doc);
    let threads: Vec<String> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        threads,
        vec!["thread 0 host", "thread 0 host (overlap 1)"],
        "{threads:?}"
    );
    let runs: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"] == "run")
        .collect();
    assert_eq!(runs.len(), 1000);
    let tid = &runs[0]["tid"];
    assert!(runs.iter().all(|r| &r["tid"] == tid));
    // Every sub-span of an invocation lies inside that invocation's `run` slice.
    for e in events
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"] != "run")
    {
        let inv = e["args"]["inv"].as_u64().unwrap() as usize;
        let (rs, rd) = (
            runs[inv]["ts"].as_f64().unwrap(),
            runs[inv]["dur"].as_f64().unwrap(),
        );
        let (s, d) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        assert!(
            rs <= s && s + d <= rs + rd + 1e-9,
            "{e} outside {}",
            runs[inv]
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn device_spans_land_on_the_host_axis() {
    let dir = common::temp_dir("device");
    let path = dir.join("t.jsonl");
    std::fs::write(
        &path,
        concat!(
            r#"{"kind":"anchor","pid":3,"wall_ns":1000000}"#,
            "\n",
            r#"{"kind":"span","v":1,"pid":3,"tid":0,"inv":0,"callable":"c","depth":0,"name":"run","ts_ns":2000,"dur_ns":9000,"clock":"host"}"#,
            "\n",
            r#"{"kind":"span","v":1,"pid":3,"tid":0,"inv":0,"callable":"c","depth":1,"name":"kernel","ts_ns":777000,"dur_ns":1000,"clock":"device"}"#,
            "\n",
            r#"{"kind":"device_alignment","pid":3,"inv":0,"alignment":{"device_ns":770000,"host_ns":3000,"uncertainty_ns":200}}"#,
            "\n"
        ),
    )
    .unwrap();
    let trace = read_traces(&[&path]).unwrap();
    let doc = timing_to_perfetto(&trace).to_json();
    let events = common::check_trace_events(&doc);
    let k = events.iter().find(|e| e["name"] == "kernel").unwrap();
    // host = 3000 + (777000 - 770000) = 10000 ns; run starts at 2000 ns: 8 µs later.
    assert_eq!(k["ts"].as_f64().unwrap(), 8.0);
    assert_eq!(k["args"]["alignment_uncertainty_ns"], 200);
    assert_eq!(k["cat"], "device");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn swimlane_perfetto_follows_the_trace_event_format() {
    let (mut r, d) = common::scenario_a();
    r.queue_depth = vec![
        simpler_core::trace::QueueDepthSample {
            ts: 0,
            class: simpler_core::EngineClass::Vector,
            depth: 2,
        },
        simpler_core::trace::QueueDepthSample {
            ts: 60,
            class: simpler_core::EngineClass::Vector,
            depth: 1,
        },
    ];
    r.submits = vec![simpler_core::trace::SubmitRecord {
        task_id: 0,
        start: 0,
        end: 1,
    }];
    let doc = swimlane::to_perfetto(&r, Some(&d)).to_json();
    let events = common::check_trace_events(&doc);
    let phases = common::by_phase(&events);
    assert_eq!(
        phases["X"]
            .iter()
            .filter(|e| e["cat"] == "vector" || e["cat"] == "cube")
            .count(),
        4
    );
    assert_eq!(phases["C"].len(), 2);
    assert_eq!(phases["s"].len(), 3);
    assert_eq!(phases["f"].len(), 3);
    assert!(phases["f"].iter().all(|e| e["bp"] == "e"));
    let thread_names: Vec<&str> = phases["M"]
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    for want in ["orchestrator", "scheduler 0 (cores 0)", "core 0", "core 1"] {
        assert!(thread_names.contains(&want), "{thread_names:?}");
    }
    let block = phases["X"]
        .iter()
        .find(|e| e["args"]["task"] == "0:2")
        .unwrap();
    assert_eq!(
        (block["ts"].as_f64(), block["dur"].as_f64()),
        (Some(0.09), Some(0.06))
    );
    assert_eq!(
        (
            block["args"]["dispatch_us"].as_f64(),
            block["args"]["finish_us"].as_f64()
        ),
        (Some(0.08), Some(0.16))
    );
    assert_eq!(block["name"], "softmax");
}

#[test]
fn diagnostics_round_trip_and_fingerprint_mismatch_is_refused() {
    let dir = common::temp_dir("diag");
    let (r, d) = common::scenario_a();
    let report = RunReport {
        swimlane: Some(r.clone()),
        deps: Some(d.clone()),
        ..RunReport::default()
    };
    let files = write_run_diagnostics(&dir, &report).unwrap();
    assert_eq!(files.len(), 2);
    let joined = load_joined(&dir, None).unwrap();
    assert_eq!(joined.swimlane, r);
    assert_eq!(joined.deps.as_ref(), Some(&d));
    assert_eq!(
        joined.deps_path.as_deref(),
        Some(dir.join("deps.json").as_path())
    );
    // A deps file from another graph is refused, naming both files.
    let other = dir.join("other-deps.json");
    diag::write_json(&other, &common::graph(4, &[(0, 1)], "fp-other")).unwrap();
    let e = load_joined(&dir.join("swimlane.json"), Some(&other)).unwrap_err();
    assert!(matches!(e, DfxError::FingerprintMismatch { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("swimlane.json")
            && msg.contains("other-deps.json")
            && msg.contains("fp-a")
            && msg.contains("fp-other"),
        "{msg}"
    );
    // Without deps.json beside it, the swimlane loads alone.
    std::fs::remove_file(dir.join("deps.json")).unwrap();
    assert!(load_joined(&dir, None).unwrap().deps.is_none());
    assert!(matches!(
        load_joined(Path::new("/nonexistent/dir"), None),
        Err(DfxError::Io { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An engine that records its step around the run (`RunReport::engine_step`) gets an
/// `engine.step` span beside `run`, and `trace timing` reads layer ⑤ (the step less the run)
/// from it; a trace without one says ⑤ is not there.
#[test]
fn layer_five_is_the_engine_step_less_the_run() {
    let dir = common::temp_dir("layer5");
    let path = dir.join("trace.jsonl");
    {
        let mut w = writer_of_pid_7(&path);
        for k in 0..3 {
            let t0 = 1000 * k + 100;
            let mut r = report(k, 0x5, Some("decode"), t0, 100);
            // The engine's step: from 20 µs before the run to 13 µs after it.
            r.engine_step = iv(t0 - 20, t0 + 113);
            w.report(&r, 1).unwrap();
        }
    }
    let trace = read_traces(&[&path]).unwrap();
    let g = &by_callable(&trace)[0];
    let r = round(&trace, &g.invs[0]);
    assert_eq!(r.engine, Some(133_000));
    assert_eq!(r.layers()[4], Some(33_000));
    let table = timing::timing_table(&trace);
    assert!(
        table
            .lines()
            .any(|l| l.contains("⑤ engine/host wrap") && l.contains("33.0")),
        "{table}"
    );
    assert!(table.contains("engine.step"), "{table}");
    // Without the engine's step, ⑤ says why it is missing.
    let path2 = dir.join("no-engine.jsonl");
    {
        let mut w = TraceWriter::append(&path2).unwrap();
        w.report(&report(0, 0x6, None, 0, 100), 1).unwrap();
    }
    let table = timing::timing_table(&read_traces(&[&path2]).unwrap());
    assert!(
        table.contains("⑤ engine/host wrap") && table.contains("no engine.step span"),
        "{table}"
    );
}

/// `--tree` marks siblings that overlap by more than zero time: a zero-length span inside a
/// sibling shares no time with it.
#[test]
fn a_zero_length_span_inside_a_sibling_is_not_marked_overlapping() {
    let line =
        |name: &str, depth: u8, ts: u64, dur: u64| common::span_line(1, 0, depth, name, ts, dur);
    let text = |b_dur: u64| {
        [
            r#"{"kind":"anchor","pid":1,"wall_ns":100}"#.to_string(),
            line("run", 0, 0, 1000),
            line("a", 1, 0, 1000),
            line("b", 1, 500, b_dur),
        ]
        .join("\n")
    };
    let tree_of = |b_dur| {
        let mut t = simpler_dfx::reader::Trace::default();
        simpler_dfx::reader::parse_into(&mut t, &text(b_dur), Path::new("z.jsonl")).unwrap();
        timing::tree(&t)
    };
    let zero = tree_of(0);
    assert!(!zero.contains('∥'), "{zero}");
    // One nanosecond inside `a` is an overlap, both ways.
    let one = tree_of(1);
    assert!(one.contains("∥ b") && one.contains("∥ a"), "{one}");
}
