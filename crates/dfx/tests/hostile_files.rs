//! Files the tools did not write: every reader and every analysis over what it read must give a
//! result or an error, never a panic (overflow included: tests build with overflow checks), a
//! hang or an allocation sized by a number in the file. Known hostile values first, then
//! proptest over mutated copies of valid files.

mod common;

use std::path::{Path, PathBuf};

use common::{scenario_a, scenario_b};
use proptest::prelude::*;
use serde_json::{Value, json};
use simpler_core::clock::ClockAnchor;
use simpler_core::trace::{
    DepGraph, DeviceClockAlignment, RingStats, RingUsage, ScopeSiteUsage, SwimlaneRecords, Usage,
};
use simpler_core::{Interval, RunReport};
use simpler_dfx::diag::{self, MAX_CORES};
use simpler_dfx::reader::{self, MAX_LINE_BYTES};
use simpler_dfx::{
    DfxError, TraceWriter, critical_path, deps, html, idle, overhead, perfetto, rings, swimlane,
    timing, write_run_diagnostics,
};

fn iv(a: u64, b: u64) -> Interval {
    Interval {
        start_ns: a,
        end_ns: b,
    }
}

fn run_report(inv: u64, t0: u64) -> RunReport {
    RunReport {
        inv,
        callable: 3,
        orchestration: "t".into(),
        label: Some("decode".into()),
        host_wall: iv(t0, t0 + 100),
        bind: iv(t0 + 1, t0 + 3),
        bind_args: iv(t0 + 1, t0 + 2),
        runner: iv(t0 + 3, t0 + 98),
        device_wall: iv(t0 + 5, t0 + 96),
        graph_build: iv(t0 + 5, t0 + 9),
        orch: iv(t0 + 10, t0 + 60),
        sched: iv(t0 + 12, t0 + 90),
        post_orch: iv(t0 + 60, t0 + 90),
        validate: iv(t0 + 98, t0 + 99),
        ..RunReport::default()
    }
}

/// Valid files of every kind: `(file name, text)`, made once (tests run in parallel).
fn seeds() -> Vec<(&'static str, String)> {
    static SEEDS: std::sync::OnceLock<Vec<(&'static str, String)>> = std::sync::OnceLock::new();
    SEEDS.get_or_init(make_seeds).clone()
}

fn make_seeds() -> Vec<(&'static str, String)> {
    let dir = common::temp_dir("hostile-seeds");
    let (mut sw, d) = scenario_a();
    sw.kernels.insert(1, "softmax".into());
    sw.submits = scenario_b().0.submits;
    sw.level = 4;
    let report = RunReport {
        swimlane: Some(sw),
        deps: Some(d),
        ring_stats: Some(RingStats {
            rings: vec![RingUsage {
                ring: 0,
                task_window: Usage {
                    high_water: 7,
                    capacity: 8,
                },
                heap: Usage {
                    high_water: 10,
                    capacity: 1024,
                },
                dep_pool: Usage {
                    high_water: 3,
                    capacity: 16,
                },
            }],
            tensormap: Usage {
                high_water: 4,
                capacity: 16,
            },
            scopes: vec![ScopeSiteUsage {
                site: "a.rs:1".into(),
                ring: 0,
                opened: 2,
                max_tasks: 5,
                max_heap: 10,
                max_dep_pool: 3,
                max_map_entries: 4,
            }],
        }),
        ..RunReport::default()
    };
    write_run_diagnostics(&dir, &report).unwrap();
    let trace = dir.join("trace.jsonl");
    {
        let mut w = TraceWriter::append_with_anchor(
            &trace,
            ClockAnchor {
                pid: 5,
                wall_ns: 1_000,
            },
        )
        .unwrap();
        w.report(&run_report(0, 10), 0).unwrap();
        w.report(&run_report(1, 200), 1).unwrap();
        w.device_alignment(
            5,
            1,
            &DeviceClockAlignment {
                device_ns: 50,
                host_ns: 10,
                uncertainty_ns: 3,
            },
        )
        .unwrap();
        w.finish().unwrap();
    }
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    let out = vec![
        (diag::SWIMLANE_FILE, read(diag::SWIMLANE_FILE)),
        (diag::DEPS_FILE, read(diag::DEPS_FILE)),
        (diag::RING_STATS_FILE, read(diag::RING_STATS_FILE)),
        ("trace.jsonl", read("trace.jsonl")),
    ];
    std::fs::remove_dir_all(&dir).unwrap();
    out
}

/// Runs every reader and every analysis over the files in `dir`; any panic fails the test.
/// Returns how many of the readers accepted their file (so the seeds can be checked).
fn exercise(dir: &Path) -> usize {
    let mut accepted = 0;
    if let Ok(t) = reader::read_traces(&[dir.join("trace.jsonl")]) {
        accepted += 1;
        let _ = timing::timing_table(&t);
        let _ = timing::rounds_table(&t, 1);
        let _ = timing::tree(&t);
        let _ = perfetto::timing_to_perfetto(&t).to_json();
    }
    if let Ok(g) = diag::read_deps(&dir.join(diag::DEPS_FILE)) {
        accepted += 1;
        let _ = deps::summary(&g);
        let _ = deps::to_dot(&g);
        let _ = html::to_html(&g, "fuzz");
        if let Ok(r) = deps::reduce(&g) {
            let _ = deps::to_dot(&r);
        }
    }
    if let Ok(r) = diag::read_ring_stats(&dir.join(diag::RING_STATS_FILE)) {
        accepted += 1;
        let _ = rings::report(&r);
    }
    if let Ok(sw) = diag::read_swimlane(&dir.join(diag::SWIMLANE_FILE)) {
        accepted += 1;
        // The join checks fingerprints; analyse the pair whatever they say.
        analyse_swimlane(
            &sw,
            diag::read_deps(&dir.join(diag::DEPS_FILE)).ok().as_ref(),
        );
    }
    accepted
}

/// Every analysis of swimlane records, alone and with `g` when given.
fn analyse_swimlane(sw: &SwimlaneRecords, g: Option<&DepGraph>) {
    let _ = swimlane::report(sw, None);
    let _ = swimlane::to_perfetto(sw, None).to_json();
    let _ = overhead::analyze(sw, None).map(|o| overhead::report(&o));
    let _ = idle::analyze(sw, None).map(|i| idle::report(&i, 0));
    if let Some(g) = g {
        let _ = swimlane::report(sw, Some(g));
        let _ = swimlane::to_perfetto(sw, Some(g)).to_json();
        let _ = overhead::analyze(sw, Some(g)).map(|o| overhead::report(&o));
        let _ = idle::analyze(sw, Some(g)).map(|i| idle::report(&i, 3));
        let _ = critical_path::analyze(sw, g).map(|c| critical_path::report(&c, 1));
    }
}

fn write_all(dir: &Path, files: &[(&'static str, String)]) {
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
}

#[test]
fn the_seeds_are_valid() {
    let dir = common::temp_dir("hostile-valid");
    write_all(&dir, &seeds());
    assert_eq!(exercise(&dir), 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Replaces one top-level field of a document (or of every line of a JSON Lines file).
fn with_field(text: &str, pointer: &str, value: Value) -> String {
    let mut doc: Value = serde_json::from_str(text).unwrap();
    *doc.pointer_mut(pointer).unwrap() = value;
    doc.to_string()
}

fn seed(name: &str) -> String {
    seeds().into_iter().find(|(n, _)| *n == name).unwrap().1
}

#[test]
fn a_core_id_past_the_limit_is_refused_not_allocated_for() {
    let dir = common::temp_dir("hostile-core");
    let path = dir.join(diag::SWIMLANE_FILE);
    for (pointer, value) in [
        ("/tasks/0/core", json!(u32::MAX)),
        ("/cores", json!(u32::MAX)),
        ("/phases/0/sched", json!(MAX_CORES)),
        ("/level", json!(200)),
    ] {
        std::fs::write(
            &path,
            with_field(&seed(diag::SWIMLANE_FILE), pointer, value),
        )
        .unwrap();
        let e = diag::read_swimlane(&path).unwrap_err();
        assert!(
            matches!(&e, DfxError::Invalid { line: 0, path: p, .. } if p == &path),
            "{pointer}: {e}"
        );
    }
    // One below the limit is a core like any other (in a file that says it has that many).
    let most = with_field(&seed(diag::SWIMLANE_FILE), "/cores", json!(MAX_CORES));
    std::fs::write(
        &path,
        with_field(&most, "/tasks/0/core", json!(MAX_CORES - 1)),
    )
    .unwrap();
    let sw = diag::read_swimlane(&path).unwrap();
    let i = idle::analyze(&sw, None).unwrap();
    assert_eq!(i.cores, MAX_CORES);
    // Records built in memory get the same check from the analyses.
    let (mut r, _) = scenario_a();
    r.tasks[0].core = u32::MAX;
    assert!(matches!(
        idle::analyze(&r, None),
        Err(DfxError::Invalid { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn extreme_times_and_durations_do_not_overflow() {
    let dir = common::temp_dir("hostile-times");
    // A span lasting u64::MAX ns and one at the end of time (the readers refuse a span whose
    // end is past the clock's, below).
    let text = seed("trace.jsonl");
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    lines[1] = with_field(&lines[1], "/ts_ns", json!(0));
    lines[1] = with_field(&lines[1], "/dur_ns", json!(u64::MAX));
    lines[2] = with_field(&lines[2], "/ts_ns", json!(u64::MAX));
    lines[2] = with_field(&lines[2], "/dur_ns", json!(0));
    std::fs::write(dir.join("trace.jsonl"), lines.join("\n")).unwrap();
    // Blocks spanning the whole axis.
    let mut sw: Value = serde_json::from_str(&seed(diag::SWIMLANE_FILE)).unwrap();
    for t in sw["tasks"].as_array_mut().unwrap() {
        t["dispatch"] = json!(0);
        t["start"] = json!(0);
        t["end"] = json!(u64::MAX);
        t["finish"] = json!(u64::MAX);
    }
    sw["phases"][0]["end"] = json!(u64::MAX);
    sw["phases"][1]["start"] = json!(0);
    sw["phases"][1]["end"] = json!(u64::MAX);
    sw["phases"][1]["phase"] = sw["phases"][0]["phase"].clone();
    std::fs::write(dir.join(diag::SWIMLANE_FILE), sw.to_string()).unwrap();
    std::fs::write(dir.join(diag::DEPS_FILE), seed(diag::DEPS_FILE)).unwrap();
    std::fs::write(dir.join(diag::RING_STATS_FILE), seed(diag::RING_STATS_FILE)).unwrap();
    assert_eq!(exercise(&dir), 4);
    // Blocks dispatched after they finished, or ending before they start, are refused by the
    // reader; the analyses, which take records built in memory as they are, still answer.
    for t in sw["tasks"].as_array_mut().unwrap() {
        t["dispatch"] = json!(u64::MAX);
        t["finish"] = json!(i64::MAX as u64 + 7);
    }
    sw["tasks"][1]["start"] = json!(u64::MAX);
    sw["tasks"][1]["end"] = json!(0);
    std::fs::write(dir.join(diag::SWIMLANE_FILE), sw.to_string()).unwrap();
    let e = diag::read_swimlane(&dir.join(diag::SWIMLANE_FILE)).unwrap_err();
    assert!(
        e.to_string().contains("tasks[0]") && e.to_string().contains("is before dispatch"),
        "{e}"
    );
    let records: SwimlaneRecords = serde_json::from_value(sw).unwrap();
    analyse_swimlane(&records, Some(&scenario_a().1));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_overlong_or_binary_trace_line_is_an_error_with_its_line() {
    let dir = common::temp_dir("hostile-lines");
    let path = dir.join("t.jsonl");
    let anchor = seed("trace.jsonl").lines().next().unwrap().to_string();
    std::fs::write(
        &path,
        format!("{anchor}\n{}\n", "x".repeat(MAX_LINE_BYTES + 5)),
    )
    .unwrap();
    let e = reader::read_traces(&[&path]).unwrap_err();
    assert!(matches!(e, DfxError::Invalid { line: 2, .. }), "{e}");
    assert!(e.to_string().contains("longer than"), "{e}");
    std::fs::write(&path, [anchor.as_bytes(), b"\n\xff\xfe\n"].concat()).unwrap();
    let e = reader::read_traces(&[&path]).unwrap_err();
    assert!(matches!(e, DfxError::Invalid { line: 2, .. }), "{e}");
    // A long but valid line (a span with a large attribute) is still read.
    let mut span: Value =
        serde_json::from_str(seed("trace.jsonl").lines().nth(1).unwrap()).unwrap();
    span["attrs"] = json!({"note": "y".repeat(MAX_LINE_BYTES / 2)});
    std::fs::write(&path, format!("{anchor}\n{span}\n")).unwrap();
    assert_eq!(reader::read_traces(&[&path]).unwrap().spans.len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A span read twice (a file given twice, a copy of it, a line repeated) is refused with its
/// file and line, as every table would count it twice; the same process appending new spans
/// later, and a span differing only in its attributes, are read.
#[test]
fn a_span_read_twice_is_refused_and_new_spans_of_the_same_process_are_not() {
    let dir = common::temp_dir("hostile-twice");
    let text = seed("trace.jsonl");
    let (a, copy) = (dir.join("a.jsonl"), dir.join("copy.jsonl"));
    std::fs::write(&a, &text).unwrap();
    std::fs::write(&copy, &text).unwrap();
    let spans = reader::read_traces(&[&a]).unwrap().spans.len();
    assert!(spans > 1);
    for twice in [[&a, &a], [&a, &copy]] {
        let e = reader::read_traces(&twice).unwrap_err();
        assert!(
            matches!(&e, DfxError::Invalid { path, line: 2, what }
                if path == twice[1] && what.contains("already read")),
            "{e}"
        );
    }
    let mut lines: Vec<&str> = text.lines().collect();
    let last = lines.len();
    lines.push(lines[1]);
    std::fs::write(&a, lines.join("\n")).unwrap();
    let e = reader::read_traces(&[&a]).unwrap_err();
    assert!(
        matches!(e, DfxError::Invalid { line, .. } if line == last + 1),
        "{e}"
    );
    // The repeated line with another attribute, and with another start: both read.
    let mut span: Value = serde_json::from_str(lines[1]).unwrap();
    span["attrs"]["note"] = json!("another");
    let other_attrs = span.to_string();
    span["ts_ns"] = json!(span["ts_ns"].as_u64().unwrap() + 1);
    span["attrs"] = json!({});
    let later = span.to_string();
    lines.pop();
    lines.extend([other_attrs.as_str(), later.as_str()]);
    std::fs::write(&a, lines.join("\n")).unwrap();
    assert_eq!(reader::read_traces(&[&a]).unwrap().spans.len(), spans + 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Values that break arithmetic and allocation sized by them.
fn extreme() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(4)),
        Just(json!(-1)),
        Just(json!(u32::MAX)),
        Just(json!(u32::MAX as u64 + 1)),
        Just(json!(MAX_CORES)),
        Just(json!(MAX_CORES - 1)),
        Just(json!(i64::MAX)),
        Just(json!(1u64 << 63)),
        Just(json!(u64::MAX)),
        Just(json!(1e300)),
        Just(json!("7")),
        Just(json!(null)),
    ]
}

/// Numeric fields of the four file kinds.
const FIELDS: &[&str] = &[
    "start",
    "end",
    "dispatch",
    "finish",
    "ts",
    "ts_ns",
    "dur_ns",
    "wall_ns",
    "core",
    "cores",
    "sched",
    "level",
    "depth",
    "task_id",
    "id",
    "pred",
    "succ",
    "inv",
    "tid",
    "pid",
    "block",
    "block_num",
    "kernel",
    "func",
    "high_water",
    "capacity",
    "ring",
    "device_ns",
    "host_ns",
    "uncertainty_ns",
    "max_tasks",
    "max_heap",
    "max_dep_pool",
    "max_map_entries",
    "opened",
    "dropped",
    "v",
];

#[derive(Clone, Debug)]
enum Mutation {
    /// Set the n-th number (any depth, document order) to a value.
    Number(usize, Value),
    /// Set every value of one field name (all `end`s, all `core`s, ...) to a value.
    Field(&'static str, Value),
    /// Copy the n-th array element next to itself (duplicate tasks, edges, records).
    Duplicate(usize),
    /// Remove the n-th object key.
    DropKey(usize),
    /// Overwrite a byte of the text.
    Byte(usize, u8),
    /// Cut the text short.
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), extreme()).prop_map(|(i, v)| Mutation::Number(i, v)),
        2 => (proptest::sample::select(FIELDS), extreme()).prop_map(|(k, v)| Mutation::Field(k, v)),
        1 => any::<usize>().prop_map(Mutation::Duplicate),
        1 => any::<usize>().prop_map(Mutation::DropKey),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Byte(i, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ]
}

/// Visits nodes in document order; `f` returns true when it acted (then the walk stops).
fn walk(v: &mut Value, f: &mut dyn FnMut(&mut Value) -> bool) -> bool {
    if f(v) {
        return true;
    }
    match v {
        Value::Array(a) => a.iter_mut().any(|x| walk(x, f)),
        Value::Object(o) => o.values_mut().any(|x| walk(x, f)),
        _ => false,
    }
}

fn mutate_value(doc: &mut Value, m: &Mutation) {
    let count = |doc: &mut Value, pred: &dyn Fn(&Value) -> bool| {
        let mut n = 0;
        walk(doc, &mut |v| {
            n += usize::from(pred(v));
            false
        });
        n
    };
    match m {
        Mutation::Number(i, value) => {
            let n = count(doc, &|v| v.is_number());
            if n == 0 {
                return;
            }
            let mut k = i % n;
            walk(doc, &mut |v| {
                if v.is_number() {
                    if k == 0 {
                        *v = value.clone();
                        return true;
                    }
                    k -= 1;
                }
                false
            });
        }
        Mutation::Duplicate(i) => {
            let n = count(doc, &|v| v.as_array().is_some_and(|a| !a.is_empty()));
            if n == 0 {
                return;
            }
            let mut k = i % n;
            walk(doc, &mut |v| {
                if let Value::Array(a) = v
                    && !a.is_empty()
                {
                    if k == 0 {
                        let j = *i % a.len();
                        a.insert(j, a[j].clone());
                        return true;
                    }
                    k -= 1;
                }
                false
            });
        }
        Mutation::DropKey(i) => {
            let n = count(doc, &|v| v.as_object().is_some_and(|o| !o.is_empty()));
            if n == 0 {
                return;
            }
            let mut k = i % n;
            walk(doc, &mut |v| {
                if let Value::Object(o) = v
                    && !o.is_empty()
                {
                    if k == 0 {
                        let key = o.keys().nth(*i % o.len()).unwrap().clone();
                        o.remove(&key);
                        return true;
                    }
                    k -= 1;
                }
                false
            });
        }
        Mutation::Field(key, value) => {
            walk(doc, &mut |v| {
                if let Value::Object(o) = v
                    && let Some(x) = o.get_mut(*key)
                {
                    *x = value.clone();
                }
                false
            });
        }
        Mutation::Byte(..) | Mutation::Truncate(_) => {}
    }
}

/// Applies the mutations; in a JSON Lines file each structural one hits the line its index
/// picks (`index % lines`), so several lines get mutated.
fn mutate_text(text: &str, jsonl: bool, ms: &[Mutation]) -> Vec<u8> {
    let mut lines: Vec<String> = if jsonl {
        text.lines().map(str::to_string).collect()
    } else {
        vec![text.to_string()]
    };
    for m in ms {
        let picked = match m {
            Mutation::Number(i, _) | Mutation::Duplicate(i) | Mutation::DropKey(i) => {
                i % lines.len()..i % lines.len() + 1
            }
            Mutation::Field(..) => 0..lines.len(),
            Mutation::Byte(..) | Mutation::Truncate(_) => continue,
        };
        for line in &mut lines[picked] {
            let Ok(mut doc) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            mutate_value(&mut doc, m);
            *line = doc.to_string();
        }
    }
    let mut bytes = lines.join("\n").into_bytes();
    for m in ms {
        match *m {
            Mutation::Byte(i, b) if !bytes.is_empty() => {
                let i = i % bytes.len();
                bytes[i] = b;
            }
            Mutation::Truncate(i) => bytes.truncate(i % (bytes.len() + 1)),
            _ => {}
        }
    }
    bytes
}

fn fuzz_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("simpler-dfx-hostile-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// One file of the four mutated, the others valid: no reader and no analysis panics.
    #[test]
    fn no_mutated_file_makes_a_tool_panic(
        which in 0usize..4,
        ms in proptest::collection::vec(mutation(), 1..8),
    ) {
        let dir = fuzz_dir();
        let files = seeds();
        write_all(&dir, &files);
        let (name, text) = &files[which];
        let bytes = mutate_text(text, name.ends_with(".jsonl"), &ms);
        std::fs::write(dir.join(name), bytes).unwrap();
        exercise(&dir);
    }
}
