//! What real runs report (`RunReport`): the spans nest as `docs/trace-format.md`
//! says — `host_wall ⊇ bind + runner + validate` in that order, `runner ⊇ device_wall ⊇
//! graph_build, orch, sched`, `graph_build` = `config_validate`, `arena_wire`, `reset` in
//! order — overlapped, serial and replayed; the task-timing slots span their tagged tasks
//! inside `sched`; the counters count what ran; the swimlane records of each level, the
//! workload's `callable` id and the ring statistics per scope site describe what ran.

use simpler_core::*;
use simpler_cpu::CpuPlatform;

/// `x[i] += 1` over its whole argument.
const INC: KernelId = KernelId(1);

fn worker() -> Worker {
    let w = Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(2),
            timeouts: None,
            idle_spin: None,
        },
    )
    .unwrap();
    w.register_kernel(KernelSpec::new(INC, "inc", EngineClass::Vector, |ctx| {
        for v in ctx.write_chunk::<f32>(0, 4)? {
            *v += 1.0;
        }
        Ok(())
    }))
    .unwrap();
    w
}

/// A buffer of `len` zeros on `w`, and run arguments holding it alone.
fn zeros_and_args(w: &Worker, len: usize) -> (Buffer, RunArgs) {
    let x = w.buffer_from(&vec![0.0f32; len]).unwrap();
    let args = RunArgs {
        buffers: vec![x.clone()],
        scalars: vec![],
    };
    (x, args)
}

/// A chain of 6 tasks of 16 blocks on the whole buffer in slot 0, then 4 tasks of 4 blocks,
/// one per quarter of the buffer, in slot 3 (each after the chain): 7 added to every element.
fn graph(o: &mut Orchestrator, a: &RunArgs) -> Result<(), RunError> {
    let t = o.bind(&a.buffers[0], DType::F32, &[64])?;
    for _ in 0..6 {
        o.submit(Task::new(INC).in_out(&t).blocks(16).timing_slot(0))?;
    }
    for i in 0..4u64 {
        let part = t.slice(0, i * 16, i * 16 + 16)?;
        o.submit(Task::new(INC).in_out(&part).blocks(4).timing_slot(3))?;
    }
    Ok(())
}

fn within(outer: &Interval, inner: &Interval, what: &str) {
    assert!(
        outer.start_ns <= inner.start_ns && inner.end_ns <= outer.end_ns,
        "{what}: {inner:?} is not inside {outer:?}"
    );
}

fn before(a: &Interval, b: &Interval, what: &str) {
    assert!(
        a.end_ns <= b.start_ns,
        "{what}: {a:?} does not end before {b:?}"
    );
}

fn check(r: &RunReport, how: &str) {
    let h = |w: &str| format!("{how}: {w}");
    within(&r.host_wall, &r.bind, &h("bind in host_wall"));
    within(&r.bind, &r.bind_args, &h("bind.args in bind"));
    within(&r.host_wall, &r.runner, &h("runner in host_wall"));
    within(&r.host_wall, &r.validate, &h("validate in host_wall"));
    before(&r.bind, &r.runner, &h("bind, then runner"));
    before(&r.runner, &r.validate, &h("runner, then validate"));
    within(&r.runner, &r.device_wall, &h("device_wall in runner"));
    for (s, name) in [
        (&r.graph_build, "graph_build"),
        (&r.orch, "orch"),
        (&r.sched, "sched"),
        (&r.post_orch, "post_orch"),
    ] {
        within(&r.device_wall, s, &h(&format!("{name} in device_wall")));
    }
    within(&r.graph_build, &r.config_validate, &h("config_validate"));
    within(&r.graph_build, &r.arena_wire, &h("arena_wire"));
    within(&r.graph_build, &r.reset, &h("reset"));
    before(
        &r.config_validate,
        &r.arena_wire,
        &h("config_validate, then arena_wire"),
    );
    before(&r.arena_wire, &r.reset, &h("arena_wire, then reset"));
    before(&r.graph_build, &r.orch, &h("graph_build, then orch"));
    assert_eq!(
        r.post_orch.start_ns, r.orch.end_ns,
        "{how}: post_orch starts at orch's end"
    );
    assert_eq!(
        r.effective().start_ns,
        r.orch.start_ns.min(r.sched.start_ns)
    );
    // Slots: 6 chain tasks in 0, 4 in 3, each span inside sched; the fan-out waits for the
    // chain, so slot 3 ends after slot 0 has.
    let slot = |n: u8| {
        r.task_slots
            .iter()
            .find(|s| s.slot == n)
            .unwrap_or_else(|| panic!("{how}: slot {n} in {:?}", r.task_slots))
    };
    let (s0, s3) = (slot(0), slot(3));
    assert_eq!((s0.tasks, s3.tasks, r.task_slots.len()), (6, 4, 2), "{how}");
    within(&r.sched, &s0.span, &h("slot 0 in sched"));
    within(&r.sched, &s3.span, &h("slot 3 in sched"));
    assert!(s0.span.end_ns <= s3.span.end_ns, "{how}: {s0:?} {s3:?}");
    assert!(
        s0.span.end_ns > s0.span.start_ns,
        "{how}: slot 0 took no time"
    );
    assert_eq!(r.counters.tasks, 10, "{how}");
    assert_eq!(r.counters.blocks, 6 * 16 + 4 * 4, "{how}");
    assert_eq!(r.cores, 2, "{how}");
}

#[test]
fn the_run_report_nests_its_spans_and_times_its_slots() {
    let w = worker();
    let (x, args) = zeros_and_args(&w, 64);
    let overlapped = CallConfig::default();
    let serial = CallConfig {
        mode: OrchMode::Serial,
        ..CallConfig::default()
    };
    for round in 0..3 {
        check(
            &w.run_fn("slots", args.clone(), &overlapped, graph).unwrap(),
            &format!("overlapped {round}"),
        );
        let r = w.run_fn("slots", args.clone(), &serial, graph).unwrap();
        check(&r, &format!("serial {round}"));
        // Serial: nothing is dispatched before the orchestration returns.
        assert!(
            r.task_slots
                .iter()
                .all(|s| s.span.start_ns >= r.orch.end_ns),
            "serial {round}: {:?} against orch {:?}",
            r.task_slots,
            r.orch
        );
    }
    let shape = GraphShape::new();
    let (r, g) = w
        .capture_fn("slots", args.clone(), &overlapped, shape.clone(), graph)
        .unwrap();
    check(&r, "captured");
    let r = w.replay(&g, args, &overlapped, &shape).unwrap();
    check(&r, "replayed");
    // Every run added 6 + 1 to each element.
    assert_eq!(x.read::<f32>().unwrap(), vec![8.0 * 7.0; 64]);
}

/// The label and the warm-up mark reach the report of a run, a capture and a replay as the
/// config says (the trace's `run` attributes come from them), and leave the result alone.
#[test]
fn the_label_and_the_warm_up_mark_reach_every_report() {
    let w = worker();
    let (x, args) = zeros_and_args(&w, 64);
    let warm = CallConfig {
        label: Some("decode".into()),
        warmup: true,
        ..CallConfig::default()
    };
    let measured = CallConfig {
        warmup: false,
        ..warm.clone()
    };
    let marks = |r: &RunReport| (r.label.clone(), r.warmup);
    let d = Some("decode".to_string());
    let r = w.run_fn("slots", args.clone(), &warm, graph).unwrap();
    assert_eq!(marks(&r), (d.clone(), true));
    let r = w.run_fn("slots", args.clone(), &measured, graph).unwrap();
    assert_eq!(marks(&r), (d.clone(), false));
    let shape = GraphShape::new();
    let (r, g) = w
        .capture_fn("slots", args.clone(), &warm, shape.clone(), graph)
        .unwrap();
    assert_eq!(marks(&r), (d.clone(), true));
    let r = w.replay(&g, args.clone(), &measured, &shape).unwrap();
    assert_eq!(marks(&r), (d.clone(), false));
    let r = w.replay(&g, args, &warm, &shape).unwrap();
    assert_eq!(marks(&r), (d, true));
    assert_eq!(x.read::<f32>().unwrap(), vec![5.0 * 7.0; 64]);
}

/// The swimlane records of real runs at each level: every block once (start ≤ end; from level 2
/// dispatch ≤ start ≤ end ≤ finish, both 0 at level 1; on one of the run's cores; dispatched and
/// ended inside `sched`); scheduler phases and ready-queue depth samples from level 3,
/// orchestrator submits (one per task) at level 4 only; on the first core alone with
/// `CallConfig::cores = Some(1)`.
#[test]
fn swimlane_records_of_each_level_describe_what_ran() {
    let w = worker();
    let (_, args) = zeros_and_args(&w, 64);
    for (level, cores) in [(1u8, None), (2, None), (3, None), (4, None), (4, Some(1))] {
        let cfg = CallConfig {
            swimlane: level,
            output_dir: Some(std::env::temp_dir()),
            cores,
            ..CallConfig::default()
        };
        let how = format!("level {level}, cores {cores:?}");
        let r = w.run_fn("slots", args.clone(), &cfg, graph).unwrap();
        let s = r.swimlane.as_ref().expect("swimlane records");
        let n = cores.unwrap_or(2) as u32;
        assert_eq!((s.level, s.cores, s.dropped), (level, n, 0), "{how}");
        assert_eq!(s.tasks.len(), 6 * 16 + 4 * 4, "{how}: one record per block");
        let mut blocks = std::collections::BTreeSet::new();
        for t in &s.tasks {
            let first = if level >= 2 {
                assert!(
                    t.dispatch <= t.start && t.start <= t.end && t.end <= t.finish,
                    "{how}: {t:?}"
                );
                t.dispatch
            } else {
                assert!(
                    t.start <= t.end && (t.dispatch, t.finish) == (0, 0),
                    "{how}: {t:?}"
                );
                t.start
            };
            assert!(t.core < n, "{how}: {t:?}");
            // `sched` ends at the last completion; a block's `finish` (its fan-out done) may
            // come after that, its kernel's end never.
            assert!(
                r.sched.start_ns <= first && t.end <= r.sched.end_ns,
                "{how}: {t:?} outside sched {:?}",
                r.sched
            );
            assert!(blocks.insert((t.task_id, t.block)), "{how}: {t:?} twice");
        }
        assert_eq!(s.kernels.values().collect::<Vec<_>>(), ["inc"], "{how}");
        if level >= 3 {
            assert!(!s.phases.is_empty(), "{how}: no phases");
            assert!(
                s.phases
                    .iter()
                    .all(|p| p.start <= p.end && p.core < n && p.sched == p.core),
                "{how}"
            );
            assert!(!s.queue_depth.is_empty(), "{how}: no queue depth samples");
        } else {
            assert!(s.phases.is_empty() && s.queue_depth.is_empty(), "{how}");
        }
        if level == 4 {
            let ids: std::collections::BTreeSet<u64> = s.tasks.iter().map(|t| t.task_id).collect();
            assert_eq!(s.submits.len(), 10, "{how}: one submit per task");
            assert!(
                s.submits
                    .iter()
                    .all(|sub| sub.start <= sub.end && ids.contains(&sub.task_id)),
                "{how}: {:?}",
                s.submits
            );
        } else {
            assert!(s.submits.is_empty(), "{how}");
        }
    }
}

/// The trace's `callable` names the workload: the same orchestration on buffers of the same
/// sizes with the same `RunArgs` scalars gets the same id in every run (orchestrated or
/// replayed, whatever the buffers hold), and another name, buffer size or scalar another.
#[test]
fn the_callable_id_follows_the_workload_not_the_run() {
    let w = worker();
    let run = |name: &str, len: usize, scalars: Vec<u64>| {
        let x = w.buffer_from(&vec![0.0f32; len]).unwrap();
        let args = RunArgs {
            buffers: vec![x],
            scalars,
        };
        w.run_fn(name, args, &CallConfig::default(), graph)
            .unwrap()
            .callable
    };
    let base = run("slots", 64, vec![3]);
    assert_eq!(run("slots", 64, vec![3]), base, "the same workload");
    assert_ne!(run("other", 64, vec![3]), base, "another name");
    assert_ne!(run("slots", 128, vec![3]), base, "another buffer size");
    assert_ne!(run("slots", 64, vec![4]), base, "another scalar");
    assert_ne!(run("slots", 64, vec![]), base, "no scalar");
    // A capture and its replays are the same workload.
    let x = w.buffer_from(&[1.0f32; 64]).unwrap();
    let args = RunArgs {
        buffers: vec![x],
        scalars: vec![3],
    };
    let (r, g) = w
        .capture_fn(
            "slots",
            args.clone(),
            &CallConfig::default(),
            GraphShape::new(),
            graph,
        )
        .unwrap();
    let replayed = w
        .replay(&g, args, &CallConfig::default(), &GraphShape::new())
        .unwrap();
    assert_eq!((r.callable, replayed.callable), (base, base));
}

/// `ring_stats` of a real run: a scope opened at one site three times (3, 7 and 5 tasks), each
/// instance a chain of tasks updating one buffer in place: each task's one producer is the
/// task before it (the previous instance's last, for an instance's first task: submitted
/// serially, no producer has finished and dropped out of the edges), and each task inserts
/// one dependency-map entry. The site's largest instance: 7 tasks, 7 pool entries, 7 map
/// entries, no heap; the rings' and the map's high-water marks are at least that.
#[test]
fn ring_stats_of_a_real_run_count_each_scope_sites_largest_instance() {
    let w = worker();
    let (x, args) = zeros_and_args(&w, 16);
    // Serial: every task is submitted before any runs, so no producer has finished (and
    // dropped out of the edges) when its consumer is submitted.
    let cfg = CallConfig {
        ring_stats: true,
        mode: OrchMode::Serial,
        output_dir: Some(std::env::temp_dir()),
        ..CallConfig::default()
    };
    let r = w
        .run_fn("chains", args, &cfg, |o, a| {
            let t = o.bind(&a.buffers[0], DType::F32, &[16])?;
            for n in [3usize, 7, 5] {
                o.scope(ScopeKind::Auto, |o| {
                    for _ in 0..n {
                        o.submit(Task::new(INC).in_out(&t).blocks(4))?;
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(x.read::<f32>().unwrap(), vec![15.0; 16]);
    let s = r.ring_stats.expect("ring stats");
    let chains: Vec<_> = s
        .scopes
        .iter()
        .filter(|sc| sc.site.contains("run_report.rs"))
        .collect();
    assert_eq!(chains.len(), 1, "{:?}", s.scopes);
    let sc = chains[0];
    assert_eq!(sc.opened, 3);
    assert_eq!(
        (
            sc.max_tasks,
            sc.max_heap,
            sc.max_dep_pool,
            sc.max_map_entries
        ),
        (7, 0, 7, 7),
        "{sc:?}"
    );
    let ring = s.rings.iter().find(|u| u.ring == sc.ring).unwrap();
    assert!(ring.task_window.high_water >= 7, "{ring:?}");
    assert!(ring.dep_pool.high_water >= 7, "{ring:?}");
    assert!(s.tensormap.high_water >= 1, "{:?}", s.tensormap);
}
