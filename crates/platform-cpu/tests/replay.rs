//! Captured graphs on the CPU platform: a replay computes on the buffers' current contents
//! through relocated outputs, reports itself (graph mode, fingerprint, swimlane records), is
//! refused with an error naming what differs, survives a failing kernel (diagnosed, the worker
//! usable afterwards), and a run that exchanges data with the host mid-run is not captured.
//! (The random-graph property test replays hundreds of random graphs over fresh contents.)

use std::time::Duration;

use simpler_core::*;
use simpler_cpu::CpuPlatform;

/// `out[i] = a[i] * scale + b[i]` with `scale` the task's f32 scalar.
const AXPY: KernelId = KernelId(1);
/// `out[i] = in[i] + 1`; fails when `in[0]` is negative (a data-dependent failure).
const INC_CHECKED: KernelId = KernelId(2);

fn worker(cores: usize) -> Worker {
    let w = Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(cores),
            timeouts: None,
            idle_spin: None,
        },
    )
    .unwrap();
    w.register_kernel(KernelSpec::new(AXPY, "axpy", EngineClass::Vector, |ctx| {
        let s = ctx.scalar_f32(0)?;
        let a = ctx.read::<f32>(0)?;
        let b = ctx.read::<f32>(1)?;
        for (i, o) in ctx.write::<f32>(2)?.iter_mut().enumerate() {
            *o = a[i] * s + b[i];
        }
        Ok(())
    }))
    .unwrap();
    w.register_kernel(KernelSpec::new(
        INC_CHECKED,
        "inc_checked",
        EngineClass::Vector,
        |ctx| {
            let x = ctx.read::<f32>(0)?;
            if x[0] < 0.0 {
                return Err(KernelError::new(format!("negative input {}", x[0])));
            }
            for (o, v) in ctx.write::<f32>(1)?.iter_mut().zip(x) {
                *o = v + 1.0;
            }
            Ok(())
        },
    ))
    .unwrap();
    w
}

const N: u64 = 256;

/// `y = inc(axpy(x, x, 2) in a scope)`, with intermediates on the ring heap, then
/// `y = axpy(y, t, 0.5)` into the user buffer.
fn graph(o: &mut Orchestrator, a: &RunArgs) -> Result<(), RunError> {
    let (x, y) = bind_xy(o, a)?;
    o.scope(ScopeKind::Auto, |o| submit_chain(o, &x, &y, 2.0, false))
}

/// The run's `x` and `y`.
fn bind_xy(o: &mut Orchestrator, a: &RunArgs) -> Result<(Tensor, Tensor), RunError> {
    Ok((
        o.bind(&a.buffers[0], DType::F32, &[N])?,
        o.bind(&a.buffers[1], DType::F32, &[N])?,
    ))
}

/// [`graph`]'s tasks with the first product's scale `s` (and, `extra`, one more task at the
/// end).
fn submit_chain(
    o: &mut Orchestrator,
    x: &Tensor,
    y: &Tensor,
    s: f32,
    extra: bool,
) -> Result<(), RunError> {
    let t = o
        .submit(
            Task::new(AXPY)
                .input(x)
                .input(x)
                .output(DType::F32, &[N])
                .scalar_f32(s),
        )?
        .output(0);
    let u = o
        .submit(Task::new(INC_CHECKED).input(&t).output(DType::F32, &[N]))?
        .output(0);
    o.submit(
        Task::new(AXPY)
            .input(&u)
            .input(&t)
            .output_existing(y)
            .scalar_f32(0.5),
    )?;
    if extra {
        o.submit(Task::new(INC_CHECKED).input(&u).output(DType::F32, &[N]))?;
    }
    Ok(())
}

fn expected(x: &[f32]) -> Vec<f32> {
    expected_with(x, 2.0)
}

fn input(round: usize) -> Vec<f32> {
    (0..N as usize)
        .map(|i| i as f32 * 0.25 + round as f32)
        .collect()
}

fn setup(w: &Worker) -> (RunArgs, GraphShape, CallConfig) {
    let x = w.buffer_from(&input(0)).unwrap();
    let y = w.alloc(N as usize * 4).unwrap();
    let args = RunArgs {
        buffers: vec![x, y],
        scalars: vec![7],
    };
    (args, GraphShape::new().with("n", N), CallConfig::default())
}

#[test]
fn a_replay_computes_on_the_current_contents_and_says_it_was_replayed() {
    let w = worker(2);
    let (args, shape, cfg) = setup(&w);
    let (report, g) = w
        .capture_fn("axpy", args.clone(), &cfg, shape.clone(), graph)
        .unwrap();
    assert_eq!(
        report.graph,
        GraphMode::Captured {
            fingerprint: g.fingerprint_hex()
        }
    );
    assert_eq!(args.buffers[1].read::<f32>().unwrap(), expected(&input(0)));
    // The public representation: topological order, outputs resolved to their creators.
    let tasks = g.tasks();
    assert_eq!(tasks.len(), 3);
    assert_eq!(tasks[1].kernel, Some(INC_CHECKED));
    assert_eq!(
        tasks[1].args[0].source,
        ArgSource::Output { task: 0, output: 0 }
    );
    assert_eq!(tasks[2].args[2].source, ArgSource::Buffer(1));
    let edges: Vec<(usize, usize)> = g.edges().collect();
    assert!(edges.contains(&(0, 1)) && edges.contains(&(1, 2)) && edges.contains(&(0, 2)));
    assert!(edges.iter().all(|(p, c)| p < c));

    let swimlane = CallConfig {
        swimlane: 1,
        output_dir: Some("unused-by-the-core".into()),
        ..cfg.clone()
    };
    for round in 1..20 {
        args.buffers[0].write(&input(round)).unwrap();
        let c = if round % 5 == 0 { &swimlane } else { &cfg };
        let r = w.replay(&g, args.clone(), c, &shape).unwrap();
        assert_eq!(
            r.graph,
            GraphMode::Replayed {
                fingerprint: g.fingerprint_hex()
            }
        );
        assert_eq!(r.orchestration, "axpy");
        assert_eq!(r.counters.tasks, 3);
        assert_eq!(
            args.buffers[1].read::<f32>().unwrap(),
            expected(&input(round)),
            "round {round}"
        );
        if let Some(s) = &r.swimlane {
            assert_eq!(s.fingerprint, g.fingerprint_hex());
            assert_eq!(s.tasks.len(), 3);
        }
        // The replay's buffers were released when it returned.
        assert!(args.buffers[1].read::<f32>().is_ok());
    }
    // Interleaved with ordinary runs of other graphs, replays still hold.
    w.run_fn("other", args.clone(), &cfg, graph).unwrap();
    args.buffers[0].write(&input(3)).unwrap();
    w.replay(&g, args.clone(), &cfg, &shape).unwrap();
    assert_eq!(args.buffers[1].read::<f32>().unwrap(), expected(&input(3)));
}

#[test]
fn a_replay_is_refused_naming_what_differs() {
    let w = worker(1);
    let (args, shape, cfg) = setup(&w);
    let (_, g) = w
        .capture_fn("axpy", args.clone(), &cfg, shape.clone(), graph)
        .unwrap();
    let refused = |r: Result<RunReport, Error>| -> String {
        match r {
            Err(Error::Run(e)) => {
                assert_eq!(e.code, ErrorCode::InvalidArgs);
                assert!(e.detail.contains("refused"), "{}", e.detail);
                assert!(e.hint.contains("capture"), "{}", e.hint);
                e.detail
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    let bigger = GraphShape::new().with("n", N + 1);
    let e = refused(w.replay(&g, args.clone(), &cfg, &bigger));
    assert!(
        e.contains("shape field `n` is 257, the graph was captured with 256"),
        "{e}"
    );
    let other = w.alloc(N as usize * 4).unwrap();
    let swapped = RunArgs {
        buffers: vec![args.buffers[0].clone(), other],
        scalars: args.scalars.clone(),
    };
    let e = refused(w.replay(&g, swapped, &cfg, &shape));
    assert!(e.contains("RunArgs buffer 1 is buffer #"), "{e}");
    let scalars = RunArgs {
        scalars: vec![8],
        ..args.clone()
    };
    let e = refused(w.replay(&g, scalars, &cfg, &shape));
    assert!(e.contains("RunArgs scalar 0 is Some(8)"), "{e}");
    let small = CallConfig {
        runtime_env: RuntimeEnv {
            ring_heap: RingValue::All(1 << 20),
            ..RuntimeEnv::default()
        },
        ..cfg.clone()
    };
    let e = refused(w.replay(&g, args.clone(), &small, &shape));
    assert!(
        e.contains("CallConfig.runtime_env.ring_heap of ring 0"),
        "{e}"
    );
    let deps = CallConfig {
        dep_gen: true,
        output_dir: Some("unused-by-the-core".into()),
        ..cfg.clone()
    };
    let e = refused(w.replay(&g, args.clone(), &deps, &shape));
    assert!(e.contains("CallConfig.dep_gen"), "{e}");
    let w2 = worker(1);
    let e = refused(w2.replay(&g, args.clone(), &cfg, &shape));
    assert!(e.contains("captured on worker #"), "{e}");
    // Nothing ran: the output is still the capture's.
    assert_eq!(args.buffers[1].read::<f32>().unwrap(), expected(&input(0)));
    // The right arguments replay.
    w.replay(&g, args, &cfg, &shape).unwrap();
}

/// [`graph`] with its first product's scale `s` instead of 2 (or, `extra`, one more task at
/// the end): a step whose graph depends on something the shape does not name. Its scope opens
/// at another place in the code than [`graph`]'s.
fn graph_with(
    s: f32,
    extra: bool,
) -> impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync + 'static {
    move |o, a| {
        let (x, y) = bind_xy(o, a)?;
        o.scope(ScopeKind::Auto, |o| submit_chain(o, &x, &y, s, extra))
    }
}

/// An orchestration function, boxed.
type Orchestration = Box<dyn Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync>;

/// [`expected`] with the first scale `s`.
fn expected_with(x: &[f32], s: f32) -> Vec<f32> {
    x.iter()
        .map(|&v| {
            let t = v * s + v;
            (t + 1.0) * 0.5 + t
        })
        .collect()
}

#[test]
fn a_fresh_capture_of_the_same_step_shows_no_replay_difference_and_a_changed_one_is_named() {
    let w = worker(2);
    let (args, shape, cfg) = setup(&w);
    let capture = |f: Orchestration| {
        w.capture_fn("axpy", args.clone(), &cfg, shape.clone(), f)
            .unwrap()
            .1
    };
    let a = capture(Box::new(graph_with(2.0, false)));
    let same = capture(Box::new(graph_with(2.0, false)));
    assert_eq!(a.replay_difference(&same), None);
    // The fixed graph and its parameterised twin submit the same tasks, in scopes opened at
    // other places in the code.
    let d = a
        .replay_difference(&capture(Box::new(graph)))
        .expect("another scope site");
    assert!(
        d.starts_with("at submission step 0 the graph opens a scope (Auto) at ")
            && d.contains("the fresh capture opens a scope (Auto) at "),
        "{d}"
    );
    let scaled = capture(Box::new(graph_with(3.0, false)));
    let d = a.replay_difference(&scaled).expect("another scalar");
    assert!(
        d.starts_with("task 0 (axpy): scalars [") && d.contains("the fresh capture's ["),
        "{d}"
    );
    let longer = capture(Box::new(graph_with(2.0, true)));
    assert_eq!(
        a.replay_difference(&longer).as_deref(),
        Some("3 tasks, the fresh capture 4")
    );
    let other = w.alloc(N as usize * 4).unwrap();
    let moved = w
        .capture_fn(
            "axpy",
            RunArgs {
                buffers: vec![args.buffers[0].clone(), other],
                scalars: args.scalars.clone(),
            },
            &cfg,
            shape.clone(),
            graph,
        )
        .unwrap()
        .1;
    let d = a.replay_difference(&moved).expect("another buffer");
    assert!(d.starts_with("buffer 1 is #"), "{d}");
}

#[test]
fn a_verifying_cache_refuses_a_step_its_shape_did_not_describe_and_goes_on() {
    let w = worker(2);
    let (args, shape, cfg) = setup(&w);
    let x = input(0);
    let y = || args.buffers[1].read::<f32>().unwrap();
    // One step of the orchestration scaled by `s`, through `cache`.
    let step = |cache: &mut GraphCache, s: f32| {
        cache.run(
            &w,
            "axpy",
            args.clone(),
            &cfg,
            shape.clone(),
            graph_with(s, false),
        )
    };
    // Trusting the shape, a step whose scale changed replays the old graph: its old scale.
    let mut trusting = GraphCache::default();
    step(&mut trusting, 2.0).unwrap();
    let r = step(&mut trusting, 3.0).unwrap();
    assert!(matches!(r.graph, GraphMode::Replayed { .. }));
    assert_eq!(y(), expected_with(&x, 2.0));
    // Verifying, the same step runs orchestrated and is refused, naming the difference.
    let mut cache = GraphCache::default();
    cache.set_verify(true);
    assert!(cache.verifying());
    let r = step(&mut cache, 2.0).unwrap();
    assert!(matches!(r.graph, GraphMode::Captured { .. }));
    // A step that matches is checked (orchestrated, not replayed) and accepted.
    let r = step(&mut cache, 2.0).unwrap();
    assert!(matches!(r.graph, GraphMode::Captured { .. }));
    assert!(cache.graph().is_some());
    match step(&mut cache, 3.0) {
        Err(Error::Run(e)) => {
            assert_eq!(e.code, ErrorCode::InvalidArgs);
            assert!(
                e.detail.contains("replay check of \"axpy\"")
                    && e.detail.contains("task 0 (axpy): scalars"),
                "{}",
                e.detail
            );
            assert!(e.hint.contains("GraphShape"), "{}", e.hint);
        }
        other => panic!("expected the replay check to refuse, got {other:?}"),
    }
    // The step ran orchestrated: its outputs are right, and the stale graph is gone.
    assert_eq!(y(), expected_with(&x, 3.0));
    assert!(cache.graph().is_none());
    // The next step captures afresh; with verifying off it replays the new graph.
    step(&mut cache, 3.0).unwrap();
    cache.set_verify(false);
    let fresh = input(5);
    args.buffers[0].write(&fresh).unwrap();
    let r = step(&mut cache, 3.0).unwrap();
    assert!(matches!(r.graph, GraphMode::Replayed { .. }));
    assert_eq!(y(), expected_with(&fresh, 3.0));
}

#[test]
fn a_failing_kernel_in_a_replay_is_diagnosed_and_the_worker_stays_usable() {
    let w = worker(2);
    let (args, shape, cfg) = setup(&w);
    let (_, g) = w
        .capture_fn("axpy", args.clone(), &cfg, shape.clone(), graph)
        .unwrap();
    let bad: Vec<f32> = input(0).iter().map(|v| v - 1000.0).collect();
    args.buffers[0].write(&bad).unwrap();
    match w.replay(&g, args.clone(), &cfg, &shape) {
        Err(Error::Run(e)) => {
            assert_eq!(e.code, ErrorCode::KernelFailed);
            assert!(e.detail.contains("negative input"), "{}", e.detail);
            assert_eq!(e.locator.kernel.as_deref(), Some("inc_checked"));
        }
        other => panic!("expected KERNEL_FAILED, got {other:?}"),
    }
    // The failed replay released its buffers, and the next one (and a plain run) work.
    args.buffers[0].write(&input(4)).unwrap();
    w.replay(&g, args.clone(), &cfg, &shape).unwrap();
    assert_eq!(args.buffers[1].read::<f32>().unwrap(), expected(&input(4)));
    w.run_fn("plain", args.clone(), &cfg, graph).unwrap();
    assert_eq!(args.buffers[1].read::<f32>().unwrap(), expected(&input(4)));
}

#[test]
fn a_run_that_exchanges_data_with_the_host_is_not_captured() {
    let w = worker(1);
    let (args, shape, cfg) = setup(&w);
    let r = w.capture_fn("reads", args.clone(), &cfg, shape, |o, a| {
        graph(o, a)?;
        let y = o.bind(&a.buffers[1], DType::F32, &[N])?;
        o.get_tensor_data::<f32>(&y, Duration::from_secs(5))?;
        Ok(())
    });
    match r {
        Err(Error::Run(e)) => {
            assert_eq!(e.code, ErrorCode::InvalidArgs);
            assert!(
                e.detail.contains("get_tensor_data in a captured run"),
                "{}",
                e.detail
            );
        }
        other => panic!("expected a refused capture, got {other:?}"),
    }
    // The worker goes on.
    w.run_fn("plain", args.clone(), &cfg, graph).unwrap();
    assert_eq!(args.buffers[1].read::<f32>().unwrap(), expected(&input(0)));
}

#[test]
fn buffers_the_orchestration_binds_itself_are_held_and_bound_by_replays() {
    let w = worker(2);
    let x = w.buffer_from(&input(0)).unwrap();
    let y = w.alloc(N as usize * 4).unwrap();
    let (x2, y2) = (x.clone(), y.clone());
    let shape = GraphShape::new();
    let cfg = CallConfig::default();
    let (_, g) = w
        .capture_fn(
            "own",
            RunArgs::default(),
            &cfg,
            shape.clone(),
            move |o, _| {
                let args = RunArgs {
                    buffers: vec![x2.clone(), y2.clone()],
                    scalars: vec![],
                };
                graph(o, &args)
            },
        )
        .unwrap();
    assert_eq!(g.buffers().len(), 2);
    assert_eq!(y.read::<f32>().unwrap(), expected(&input(0)));
    x.write(&input(9)).unwrap();
    w.replay(&g, RunArgs::default(), &cfg, &shape).unwrap();
    assert_eq!(y.read::<f32>().unwrap(), expected(&input(9)));
}

/// `TaskCtx::instance`: every block of one task sees the same value, and no other task of any
/// run does — not the same task of the next run, nor of a replay, whose tasks take the
/// captured ids and ring places (kernels key per-thread caches of their inputs on it).
#[test]
fn a_task_instance_is_shared_by_its_blocks_and_by_no_other_task() {
    const RECORD: KernelId = KernelId(9);
    let w = worker(2);
    let seen: std::sync::Arc<std::sync::Mutex<Vec<(u64, TaskId, usize)>>> = Default::default();
    let s2 = seen.clone();
    w.register_kernel(KernelSpec::new(
        RECORD,
        "record",
        EngineClass::Vector,
        move |ctx| {
            let (epoch, id) = ctx.instance();
            s2.lock().unwrap().push((epoch, id, ctx.block_idx()));
            Ok(())
        },
    ))
    .unwrap();
    let (args, shape, cfg) = setup(&w);
    let two_tasks = |o: &mut Orchestrator, a: &RunArgs| -> Result<(), RunError> {
        let x = o.bind(&a.buffers[0], DType::F32, &[N])?;
        o.scope(ScopeKind::Auto, |o| {
            for _ in 0..2 {
                o.submit(Task::new(RECORD).input(&x).blocks(4))?;
            }
            Ok(())
        })
    };
    let (_, g) = w
        .capture_fn("record", args.clone(), &cfg, shape.clone(), two_tasks)
        .unwrap();
    w.run_fn("record", args.clone(), &cfg, two_tasks).unwrap();
    w.replay(&g, args.clone(), &cfg, &shape).unwrap();
    w.replay(&g, args, &cfg, &shape).unwrap();
    let seen = seen.lock().unwrap();
    let mut instances: Vec<(u64, TaskId)> = seen.iter().map(|&(e, id, _)| (e, id)).collect();
    instances.sort();
    instances.dedup();
    // 4 runs of 2 tasks, each seen by its 4 blocks.
    assert_eq!(seen.len(), 4 * 2 * 4);
    assert_eq!(instances.len(), 4 * 2, "{instances:?}");
    for inst in &instances {
        let mut blocks: Vec<usize> = seen
            .iter()
            .filter(|&&(e, id, _)| (e, id) == *inst)
            .map(|&(_, _, b)| b)
            .collect();
        blocks.sort();
        assert_eq!(blocks, vec![0, 1, 2, 3], "{inst:?}");
        assert_ne!(inst.0, 0, "a run's epoch is never 0");
    }
}
