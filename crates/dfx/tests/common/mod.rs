//! Synthetic records with known answers, shared by the integration tests.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::Value;
use simpler_core::EngineClass;
use simpler_core::trace::{
    DepGraph, EdgeRecord, EdgeSource, OverlapKind, PhaseRecord, SchedPhase, ScopeKindRecord,
    SubmitRecord, SwimlaneRecords, TaskNode, TaskRecord,
};

/// A one-block task record.
pub(crate) fn rec(
    task_id: u64,
    func: u32,
    class: EngineClass,
    core: u32,
    t: [u64; 4],
) -> TaskRecord {
    TaskRecord {
        task_id,
        func,
        class,
        core,
        block: 0,
        dispatch: t[0],
        start: t[1],
        end: t[2],
        finish: t[3],
    }
}

/// A deps graph over tasks `0..n` with the given edges.
pub(crate) fn graph(n: u64, edges: &[(u64, u64)], fingerprint: &str) -> DepGraph {
    DepGraph {
        v: 1,
        fingerprint: fingerprint.into(),
        tasks: (0..n)
            .map(|id| TaskNode {
                id,
                scope: ScopeKindRecord::Auto,
                scope_depth: 0,
                kernel: if id == 1 { 2 } else { 1 },
                kernel_name: if id == 1 {
                    "qk_matmul".into()
                } else {
                    "softmax".into()
                },
                block_num: 1,
                args: Vec::new(),
            })
            .collect(),
        tensors: Vec::new(),
        edges: edges
            .iter()
            .map(|&(pred, succ)| EdgeRecord {
                pred,
                succ,
                source: EdgeSource::Tensormap,
                overlap: OverlapKind::Covers,
            })
            .collect(),
    }
}

/// Scenario A: 2 cores, level 3.
///
/// ```text
/// T0 vector core0  d0   s10  e100 f120
/// T1 cube   core1  d0   s15  e50  f60
/// T2 vector core1  d80  s90  e150 f160   (after T1)
/// T3 vector core0  d170 s180 e200 f210   (after T0, T2)
/// ```
pub(crate) fn scenario_a() -> (SwimlaneRecords, DepGraph) {
    let v = EngineClass::Vector;
    let r = SwimlaneRecords {
        level: 3,
        fingerprint: "fp-a".into(),
        cores: 2,
        tasks: vec![
            rec(0, 1, v, 0, [0, 10, 100, 120]),
            rec(1, 2, EngineClass::Cube, 1, [0, 15, 50, 60]),
            rec(2, 1, v, 1, [80, 90, 150, 160]),
            rec(3, 1, v, 0, [170, 180, 200, 210]),
        ],
        phases: vec![
            PhaseRecord {
                sched: 0,
                core: 0,
                phase: SchedPhase::Dispatch,
                start: 0,
                end: 5,
            },
            PhaseRecord {
                sched: 0,
                core: 0,
                phase: SchedPhase::Complete,
                start: 100,
                end: 110,
            },
            PhaseRecord {
                sched: 0,
                core: 0,
                phase: SchedPhase::Idle,
                start: 110,
                end: 170,
            },
        ],
        ..Default::default()
    };
    (r, graph(4, &[(1, 2), (0, 3), (2, 3)], "fp-a"))
}

/// Scenario B: 1 core, level 4 (submits), with a core-wait and two data-waits.
///
/// ```text
/// T0 core0 d0   s0   e100 f100   submitted [0, 0]
/// T1 core0 d100 s100 e150 f150   submitted [0, 5]
/// T2 core0 d170 s175 e200 f205   submitted [160, 170], after T1
/// ```
pub(crate) fn scenario_b() -> (SwimlaneRecords, DepGraph) {
    let v = EngineClass::Vector;
    let r = SwimlaneRecords {
        level: 4,
        fingerprint: "fp-b".into(),
        cores: 1,
        tasks: vec![
            rec(0, 1, v, 0, [0, 0, 100, 100]),
            rec(1, 1, v, 0, [100, 100, 150, 150]),
            rec(2, 1, v, 0, [170, 175, 200, 205]),
        ],
        submits: vec![
            SubmitRecord {
                task_id: 0,
                start: 0,
                end: 0,
            },
            SubmitRecord {
                task_id: 1,
                start: 0,
                end: 5,
            },
            SubmitRecord {
                task_id: 2,
                start: 160,
                end: 170,
            },
        ],
        ..Default::default()
    };
    (r, graph(3, &[(1, 2)], "fp-b"))
}

/// Checks a Chrome Trace Event Format document; returns the events.
pub(crate) fn check_trace_events(doc: &Value) -> Vec<Value> {
    let events = doc["traceEvents"]
        .as_array()
        .expect("traceEvents array")
        .clone();
    let mut process_names: HashSet<u64> = HashSet::new();
    let mut thread_names: HashSet<(u64, u64)> = HashSet::new();
    let mut used_threads: HashSet<(u64, u64)> = HashSet::new();
    let mut flows: HashMap<u64, (usize, usize)> = HashMap::new();
    for e in &events {
        let ph = e["ph"]
            .as_str()
            .unwrap_or_else(|| panic!("event without ph: {e}"));
        assert!(e["name"].is_string(), "event without name: {e}");
        let pid = e["pid"]
            .as_u64()
            .unwrap_or_else(|| panic!("event without pid: {e}"));
        assert!(e["ts"].is_number(), "event without ts: {e}");
        assert!(e["ts"].as_f64().unwrap() >= 0.0, "negative ts: {e}");
        match ph {
            "X" => {
                let tid = e["tid"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("X without tid: {e}"));
                assert!(
                    e["dur"].as_f64().is_some_and(|d| d >= 0.0),
                    "X without dur: {e}"
                );
                used_threads.insert((pid, tid));
            }
            "M" => {
                let tid = e["tid"].as_u64().expect("M tid");
                let name = e["name"].as_str().unwrap();
                match name {
                    "process_name" => {
                        assert!(e["args"]["name"].is_string(), "{e}");
                        process_names.insert(pid);
                    }
                    "thread_name" => {
                        assert!(e["args"]["name"].is_string(), "{e}");
                        thread_names.insert((pid, tid));
                    }
                    "thread_sort_index" | "process_sort_index" => {
                        assert!(e["args"]["sort_index"].is_number(), "{e}")
                    }
                    other => panic!("unexpected metadata {other}"),
                }
            }
            "C" => {
                let args = e["args"].as_object().expect("counter args");
                assert!(
                    !args.is_empty() && args.values().all(Value::is_number),
                    "{e}"
                );
            }
            "s" | "f" => {
                assert!(e["tid"].is_u64(), "{e}");
                assert!(e["cat"].is_string(), "flow without cat: {e}");
                let id = e["id"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("flow without id: {e}"));
                let c = flows.entry(id).or_default();
                if ph == "s" {
                    c.0 += 1
                } else {
                    c.1 += 1
                }
                used_threads.insert((pid, e["tid"].as_u64().unwrap()));
            }
            "i" => assert!(matches!(e["s"].as_str(), Some("g" | "p" | "t")), "{e}"),
            other => panic!("unexpected phase {other}: {e}"),
        }
    }
    for (pid, tid) in &used_threads {
        assert!(process_names.contains(pid), "pid {pid} has no process_name");
        assert!(
            thread_names.contains(&(*pid, *tid)),
            "thread {pid}/{tid} has no thread_name"
        );
    }
    for (id, (s, f)) in &flows {
        assert_eq!(
            (*s, *f),
            (1, 1),
            "flow {id} must have exactly one start and one finish"
        );
    }
    events
}

/// Events grouped by phase.
pub(crate) fn by_phase(events: &[Value]) -> BTreeMap<String, Vec<Value>> {
    let mut m: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for e in events {
        m.entry(e["ph"].as_str().unwrap().to_string())
            .or_default()
            .push(e.clone());
    }
    m
}

/// A fresh temporary directory for one test.
pub(crate) fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("simpler-dfx-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// One host span line of pid `pid`'s thread 0, as the writer puts it in a trace file.
#[allow(dead_code)] // not every test file reads trace lines
pub(crate) fn span_line(
    pid: u32,
    inv: u64,
    depth: u8,
    name: &str,
    ts_ns: u64,
    dur_ns: u64,
) -> String {
    format!(
        r#"{{"kind":"span","v":1,"pid":{pid},"tid":0,"inv":{inv},"callable":"00000000000000c0","depth":{depth},"name":"{name}","ts_ns":{ts_ns},"dur_ns":{dur_ns},"clock":"host"}}"#
    )
}
