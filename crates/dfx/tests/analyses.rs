//! Known-answer tests of the analyses on synthetic records: overhead shares, head/tail
//! distributions, critical-path decomposition, the per-kernel table, happens-before checks and
//! the timing tables.

mod common;

use common::{graph, rec, scenario_a, scenario_b};
use proptest::prelude::*;
use simpler_core::EngineClass;
use simpler_core::trace::SwimlaneRecords;
use simpler_dfx::overhead::{self, Distribution, Readiness};
use simpler_dfx::{critical_path, idle, swimlane};

#[test]
fn overhead_shares_with_deps() {
    let (r, d) = scenario_a();
    let o = overhead::analyze(&r, Some(&d)).unwrap();
    assert_eq!(o.execution_span, (0, 210));
    assert_eq!(o.readiness, Readiness::Deps);
    // Cube: T1 waits [0, 15) with core 1 idle.
    let cube = o
        .classes
        .iter()
        .find(|c| c.class == Some(EngineClass::Cube))
        .unwrap();
    assert_eq!(cube.bound_ns, 15);
    assert_eq!(cube.verdict(), "compute/dependency-bound");
    // Vector: T0 [0,10), T2 [60,90) (core 1 idle), T3 [160,180) (both idle).
    let vector = o
        .classes
        .iter()
        .find(|c| c.class == Some(EngineClass::Vector))
        .unwrap();
    assert_eq!(vector.bound_ns, 60);
    assert_eq!(vector.verdict(), "scheduler-bound");
    assert_eq!(o.all.bound_ns, 65);
    assert!((o.all.share - 65.0 / 210.0).abs() < 1e-12);
    assert_eq!(o.phases[&0], [5, 10, 60]);
    let text = overhead::report(&o);
    assert!(
        text.contains("vector") && text.contains("28.6%") && text.contains("scheduler-bound"),
        "{text}"
    );
    assert!(
        text.contains("readiness: latest predecessor finish from deps.json"),
        "{text}"
    );
}

#[test]
fn overhead_without_deps_falls_back_to_dispatch_and_says_so() {
    let (r, _) = scenario_a();
    let o = overhead::analyze(&r, None).unwrap();
    assert_eq!(o.readiness, Readiness::DispatchFallback);
    // Waits are dispatch..start only: T0 [0,10), T1 [0,15), T2 [80,90), T3 [170,180).
    assert_eq!(o.all.bound_ns, 15 + 10 + 10);
    assert_eq!(
        o.classes
            .iter()
            .find(|c| c.class == Some(EngineClass::Vector))
            .unwrap()
            .bound_ns,
        30
    );
    assert_eq!(overhead::verdict(35.0 / 210.0), "partly scheduler-limited");
    assert!(overhead::report(&o).contains("NO deps.json"));
}

#[test]
fn overhead_counts_no_time_when_every_core_is_busy() {
    let (r, d) = scenario_b();
    let o = overhead::analyze(&r, Some(&d)).unwrap();
    // T1 waits [5, 100) while the only core runs T0: not scheduler-bound. T2 waits [170, 175)
    // with the core idle.
    assert_eq!(o.all.bound_ns, 5);
    assert_eq!(o.execution_span, (0, 205));
}

#[test]
fn head_and_tail_distributions() {
    let (r, d) = scenario_a();
    let o = overhead::analyze(&r, Some(&d)).unwrap();
    let head = o.head.unwrap();
    assert_eq!(
        (head.n, head.p, head.max, head.mean),
        (4, [10, 10, 10, 10, 15, 15], 15, 11.25)
    );
    let tail = o.tail.unwrap();
    assert_eq!((tail.p[2], tail.max, tail.mean), (10, 20, 12.5));
    let xs: Vec<i64> = (1..=100).collect();
    let dist = Distribution::of(&xs).unwrap();
    assert_eq!(
        (dist.p, dist.max, dist.mean),
        ([10, 25, 50, 75, 90, 99], 100, 50.5)
    );
    // Level 1 has no dispatch/finish.
    let mut l1 = r.clone();
    l1.level = 1;
    let o1 = overhead::analyze(&l1, None).unwrap();
    assert!(o1.head.is_none() && o1.tail.is_none());
    assert!(overhead::report(&o1).contains("n/a (swimlane level 1"));
}

#[test]
fn critical_path_decomposes_scenario_a_exactly() {
    let (r, d) = scenario_a();
    let c = critical_path::analyze(&r, &d).unwrap();
    assert_eq!(c.execution_span, (0, 210));
    let ids: Vec<u64> = c.observed.iter().map(|s| s.task).collect();
    assert_eq!(ids, vec![1, 2, 3]);
    // [compute, data-wait, orch-wait, core-wait, scheduling]
    assert_eq!(
        c.totals(),
        [
            35 + 60 + 20,
            0,
            0,
            0,
            15 + 10 + (20 + 10 + 10) + (10 + 10 + 10)
        ]
    );
    assert_eq!(c.totals().iter().sum::<u64>(), c.execution_span_ns());
    assert_eq!(
        (c.static_ns, c.static_path.clone()),
        (35 + 60 + 20, vec![1, 2, 3])
    );
    let text = critical_path::report(&c, 0);
    assert!(text.contains("(210 ns == execution span 210 ns)"), "{text}");
}

#[test]
fn critical_path_classifies_core_wait_and_data_wait() {
    let (r, d) = scenario_b();
    let c = critical_path::analyze(&r, &d).unwrap();
    let ids: Vec<u64> = c.observed.iter().map(|s| s.task).collect();
    assert_eq!(ids, vec![1, 2]);
    // T1: ready at its submit end 5, the core runs T0 until 100: core-wait 95; before 5 it did
    // not exist yet: orch-wait 5. T2: submitted at 170 although T1 finished at 150: orch-wait 20.
    assert_eq!(c.observed[0].core_wait, 95);
    assert_eq!((c.observed[0].orch_wait, c.observed[0].data_wait), (5, 0));
    assert_eq!((c.observed[1].orch_wait, c.observed[1].data_wait), (20, 0));
    assert_eq!(c.totals(), [50 + 25, 0, 25, 95, 10]);
    assert_eq!(c.totals().iter().sum::<u64>(), 205);
    assert_eq!((c.static_ns, c.static_path.clone()), (100, vec![0]));
    let text = critical_path::report(&c, 0);
    assert!(!text.contains("orch-wait is not measured"), "{text}");
}

/// The same run recorded at level 3 (no submit times): T2's wait for the orchestrator cannot be
/// seen, lands in scheduling, and both reports say the label is uncertain.
#[test]
fn below_level_4_the_orchestration_wait_is_reported_as_unmeasured() {
    let (mut r, d) = scenario_b();
    r.level = 3;
    r.submits.clear();
    let c = critical_path::analyze(&r, &d).unwrap();
    assert_eq!(c.totals()[2], 0);
    assert_eq!(c.observed[1].scheduling, 20 + 5 + 5);
    let text = critical_path::report(&c, 0);
    assert!(
        text.contains("swimlane level 3 records no submit times, so orch-wait is not measured"),
        "{text}"
    );
    let o = overhead::analyze(&r, Some(&d)).unwrap();
    let text = overhead::report(&o);
    assert!(
        text.contains("swimlane level 3 records no submit times"),
        "{text}"
    );
    r.level = 4;
    let text = overhead::report(&overhead::analyze(&r, Some(&d)).unwrap());
    assert!(!text.contains("records no submit times"), "{text}");
}

/// "makespan" named two quantities; every report now names one of them: the execution span
/// (block records) or effective (orch ∪ sched).
#[test]
fn reports_name_the_execution_span_not_a_makespan() {
    let (r, d) = scenario_a();
    for text in [
        critical_path::report(&critical_path::analyze(&r, &d).unwrap(), 0),
        overhead::report(&overhead::analyze(&r, Some(&d)).unwrap()),
        simpler_dfx::idle::report(&simpler_dfx::idle::analyze(&r, Some(&d)).unwrap(), 0),
    ] {
        assert!(!text.to_lowercase().contains("makespan"), "{text}");
        assert!(text.contains("execution span"), "{text}");
    }
}

#[test]
fn critical_path_walks_through_tasks_without_records() {
    // 0 -> 1 (a dummy: no records) -> 2.
    let v = EngineClass::Vector;
    let r = SwimlaneRecords {
        level: 2,
        fingerprint: "x".into(),
        cores: 2,
        tasks: vec![
            rec(0, 1, v, 0, [0, 1, 10, 12]),
            rec(2, 1, v, 1, [20, 22, 30, 31]),
        ],
        ..Default::default()
    };
    let d = graph(3, &[(0, 1), (1, 2)], "x");
    let c = critical_path::analyze(&r, &d).unwrap();
    assert_eq!(
        c.observed
            .iter()
            .map(|s| (s.task, s.recorded))
            .collect::<Vec<_>>(),
        vec![(0, true), (1, false), (2, true)]
    );
    // T2 ready at 12 (through the dummy); [12, 20) with a core idle is scheduling.
    assert_eq!(c.totals(), [9 + 8, 0, 0, 0, 1 + 2 + 8 + 2 + 1]);
    assert_eq!(c.totals().iter().sum::<u64>(), 31);
}

fn arb_run() -> impl Strategy<Value = (SwimlaneRecords, simpler_core::trace::DepGraph)> {
    (1usize..12, 1u32..4)
        .prop_flat_map(|(n, cores)| {
            let blocks = proptest::collection::vec(
                (0u32..cores, 0u64..50, 0u64..20, 0u64..40, 0u64..20, 0u8..4),
                n..=n,
            );
            let edges = proptest::collection::vec((0usize..n, 0usize..n), 0..2 * n);
            let submits = proptest::collection::vec(0u64..100, n..=n);
            (Just(n), Just(cores), blocks, edges, submits, any::<bool>())
        })
        .prop_map(|(n, cores, blocks, edges, submits, level4)| {
            let mut t = 0;
            let tasks = blocks
                .iter()
                .enumerate()
                .map(|(i, &(core, gap, head, exec, tail, class))| {
                    t += gap;
                    let class = [
                        EngineClass::Vector,
                        EngineClass::Cube,
                        EngineClass::Mix,
                        EngineClass::Vector,
                    ][class as usize];
                    rec(
                        i as u64,
                        1,
                        class,
                        core,
                        [t, t + head, t + head + exec, t + head + exec + tail],
                    )
                })
                .collect();
            let edges: Vec<(u64, u64)> = edges
                .into_iter()
                .filter(|(a, b)| a < b)
                .map(|(a, b)| (a as u64, b as u64))
                .collect();
            let r = SwimlaneRecords {
                level: if level4 { 4 } else { 2 },
                fingerprint: "p".into(),
                cores,
                tasks,
                submits: if level4 {
                    submits
                        .iter()
                        .enumerate()
                        .map(|(i, &s)| simpler_core::trace::SubmitRecord {
                            task_id: i as u64,
                            start: s,
                            end: s + 1,
                        })
                        .collect()
                } else {
                    Vec::new()
                },
                ..Default::default()
            };
            (r, graph(n as u64, &edges, "p"))
        })
}

proptest! {
    #[test]
    fn critical_path_always_adds_up_to_the_execution_span((r, d) in arb_run()) {
        let c = critical_path::analyze(&r, &d).unwrap();
        prop_assert_eq!(c.totals().iter().sum::<u64>(), c.execution_span_ns());
        let o = overhead::analyze(&r, Some(&d)).unwrap();
        prop_assert!(o.all.bound_ns <= c.execution_span_ns());
        for cl in &o.classes {
            prop_assert!(cl.bound_ns <= o.all.bound_ns);
        }
    }
}

#[test]
fn per_kernel_table_known_answer() {
    let (r, d) = scenario_a();
    let rows = swimlane::kernel_table(&r, Some(&d));
    assert_eq!(rows.len(), 2);
    let soft = &rows[0];
    assert_eq!(
        (soft.name.as_str(), soft.tasks, soft.blocks),
        ("softmax", 3, 3)
    );
    assert!((soft.mean_exec - 170.0 / 3.0).abs() < 1e-9);
    assert_eq!(soft.mean_latency, Some(80.0));
    assert_eq!(soft.mean_head, Some(10.0));
    assert!((soft.mean_tail.unwrap() - 40.0 / 3.0).abs() < 1e-9);
    assert!((soft.share - 170.0 / 205.0).abs() < 1e-12);
    let mm = &rows[1];
    assert_eq!(
        (
            mm.name.as_str(),
            mm.mean_exec,
            mm.mean_latency,
            mm.mean_head,
            mm.mean_tail
        ),
        ("qk_matmul", 35.0, Some(60.0), Some(15.0), Some(10.0))
    );
    // Without deps there are no names; at level 1 no latency.
    let mut l1 = r.clone();
    l1.level = 1;
    let rows = swimlane::kernel_table(&l1, None);
    assert_eq!(
        (rows[0].name.as_str(), rows[0].mean_latency),
        ("kernel 1", None)
    );
}

#[test]
fn happens_before_violations_are_flagged_and_counted() {
    let (r, _) = scenario_a();
    // T0 ends at 100 but T2 starts at 90: a violation. T1 -> T2 is fine. 5 has no records.
    let mut d = graph(4, &[(1, 2), (0, 2), (2, 3)], "fp-a");
    d.edges.push(simpler_core::trace::EdgeRecord {
        pred: 3,
        succ: 9,
        ..d.edges[0].clone()
    });
    let a = swimlane::arrows(&r, &d);
    assert_eq!(a.drawn.len(), 3);
    // 3 -> 9: the consumer has no records and no consumers of its own; nothing to check.
    assert_eq!(a.skipped, 0);
    assert_eq!(a.violations.len(), 1);
    assert_eq!((a.violations[0].pred, a.violations[0].succ), (0, 2));
    let text = swimlane::report(&r, Some(&d));
    assert!(text.contains("happens-before violations: 1"), "{text}");
    assert!(
        text.contains(
            "VIOLATION 0:0 -> 0:2: producer ends at 100.0 µs, consumer starts at 90.0 µs"
        ) || text.contains("VIOLATION 0:0 -> 0:2"),
        "{text}"
    );
    let doc = swimlane::to_perfetto(&r, Some(&d)).to_json();
    let events = common::check_trace_events(&doc);
    let flagged: Vec<_> = events
        .iter()
        .filter(|e| e["ph"] == "s" && e["args"]["violation"] == true)
        .collect();
    assert_eq!(flagged.len(), 1);
    assert_eq!(doc["otherData"]["happens_before_violations"], 1);
}

/// Scenario A with T0 -> T2 routed through two barrier tasks (9, then 8) that have no block
/// records, as Qwen3 routes its cross-phase dependencies. T0 ends at 100, T2 starts at 90.
#[test]
fn happens_before_is_checked_through_tasks_without_records() {
    let (r, _) = scenario_a();
    let mut d = graph(4, &[(1, 2), (0, 9), (9, 8), (1, 8), (8, 2), (2, 3)], "fp-a");
    for id in [8, 9] {
        d.tasks.push(simpler_core::trace::TaskNode {
            id,
            kernel: u32::MAX,
            kernel_name: String::new(),
            ..d.tasks[0].clone()
        });
    }
    let a = swimlane::arrows(&r, &d);
    assert_eq!(a.violations.len(), 1, "{a:?}");
    let v = a.violations[0];
    assert_eq!(
        (v.pred, v.succ, v.via, v.pred_end, v.succ_start),
        (0, 2, Some(8), 100, 90)
    );
    // 1 -> 2 direct, 0 -> 2 through 8 (T0 ends after T1, so it stands for both), 2 -> 3.
    assert_eq!(a.drawn, vec![(1, 2), (0, 2), (2, 3)]);
    assert_eq!((a.through_unrecorded, a.skipped), (1, 0));
    let text = swimlane::report(&r, Some(&d));
    assert!(text.contains("happens-before violations: 1"), "{text}");
    assert!(
        text.contains("VIOLATION 0:0 -> 0:2 (through 0:8)"),
        "{text}"
    );
    let doc = swimlane::to_perfetto(&r, Some(&d)).to_json();
    common::check_trace_events(&doc);
    assert_eq!(doc["otherData"]["happens_before_violations"], 1);

    // The same graph with T2 moved after T0's end: no violation through the barriers.
    let mut ok = r.clone();
    ok.tasks[2].start = 101;
    assert!(swimlane::arrows(&ok, &d).violations.is_empty());

    // A barrier that nothing recorded reaches leaves its consumer's edge unchecked, and says so.
    let mut lone = graph(4, &[(7, 2)], "fp-a");
    lone.tasks.push(simpler_core::trace::TaskNode {
        id: 7,
        kernel: u32::MAX,
        ..lone.tasks[0].clone()
    });
    let a = swimlane::arrows(&r, &lone);
    assert_eq!((a.drawn.len(), a.skipped), (0, 1));
}

#[test]
fn dropped_records_are_reported_prominently() {
    let (mut r, d) = scenario_a();
    r.dropped = 7;
    let text = swimlane::report(&r, Some(&d));
    assert!(
        text.starts_with("WARNING: 7 swimlane records were DROPPED"),
        "{text}"
    );
    // The warning names the knob as the command line spells it (`simpler run --help` has it).
    assert!(text.contains("--swimlane-capacity"), "{text}");
    let doc = swimlane::to_perfetto(&r, None).to_json();
    assert_eq!(doc["otherData"]["dropped_records"], 7);
    let events = common::check_trace_events(&doc);
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "i" && e["name"].as_str().unwrap().contains("7 RECORDS DROPPED"))
    );
    assert!(overhead::report(&overhead::analyze(&r, None).unwrap()).starts_with("WARNING: 7"));
    assert!(
        critical_path::report(&critical_path::analyze(&r, &d).unwrap(), r.dropped)
            .starts_with("WARNING: 7")
    );
    let idle = idle::report(&idle::analyze(&r, Some(&d)).unwrap(), 0);
    assert!(idle.starts_with("WARNING: 7"), "{idle}");
    assert!(idle.contains("--swimlane-capacity"), "{idle}");
}
