//! A run on some of the worker's cores (`CallConfig::cores`): its tasks run on those cores
//! only and the orchestration sees their count; a count the worker lacks is refused by name
//! and the next run goes on; a gang larger than the run's cores is refused; a captured graph
//! replays only on the count it was captured with; runs that alternate counts lose no work.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use simpler_core::*;
use simpler_cpu::CpuPlatform;

/// Each block writes `1 + its core` into its element of the output.
const WHERE: KernelId = KernelId(1);
/// `x[i] += 1` over its whole argument.
const INC: KernelId = KernelId(2);

/// Blocks per task of [`WHERE`].
const BLOCKS: usize = 4;

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
    w.register_kernel(KernelSpec::new(
        WHERE,
        "where",
        EngineClass::Vector,
        |ctx| {
            let out = ctx.write_chunk::<u32>(0, 1)?;
            out[0] = 1 + ctx.core() as u32;
            Ok(())
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(INC, "inc", EngineClass::Vector, |ctx| {
        for v in ctx.write::<f32>(0)? {
            *v += 1.0;
        }
        Ok(())
    }))
    .unwrap();
    w
}

fn with_cores(cores: Option<usize>) -> CallConfig {
    CallConfig {
        cores,
        ..CallConfig::default()
    }
}

/// `tasks` tasks of [`BLOCKS`] blocks, each recording where its blocks ran into its row of
/// `a.buffers[0]`; the orchestration's view of the cores goes into `seen`.
fn spread(
    tasks: usize,
    seen: Arc<AtomicUsize>,
) -> impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync + 'static {
    move |o, a| {
        seen.store(o.cores(EngineClass::Vector), Ordering::SeqCst);
        let out = o.bind(&a.buffers[0], DType::U32, &[(tasks * BLOCKS) as u64])?;
        for t in 0..tasks {
            let row = out.slice(0, (t * BLOCKS) as u64, ((t + 1) * BLOCKS) as u64)?;
            o.submit(Task::new(WHERE).output_existing(&row).blocks(BLOCKS as u32))?;
        }
        Ok(())
    }
}

#[test]
fn a_run_takes_the_first_cores_its_call_config_names() {
    let w = worker(3);
    let tasks = 200;
    for cores in [Some(1), Some(2), None, Some(3), Some(1)] {
        let out = w.alloc(tasks * BLOCKS * 4).unwrap();
        let seen = Arc::new(AtomicUsize::new(0));
        let args = RunArgs {
            buffers: vec![out.clone()],
            scalars: vec![],
        };
        let r = w
            .run_fn(
                "spread",
                args,
                &with_cores(cores),
                spread(tasks, seen.clone()),
            )
            .unwrap();
        let n = cores.unwrap_or(3);
        assert_eq!(r.cores as usize, n, "{cores:?}");
        assert_eq!(seen.load(Ordering::SeqCst), n, "the orchestration's count");
        let ran: Vec<u32> = out.read().unwrap();
        assert!(
            ran.iter().all(|&c| (1..=n as u32).contains(&c)),
            "{cores:?}: blocks ran on cores {:?}",
            ran.iter().collect::<std::collections::BTreeSet<_>>()
        );
    }
}

#[test]
fn a_core_count_the_worker_lacks_is_refused_and_the_next_run_goes_on() {
    let w = worker(3);
    let out = w.alloc(BLOCKS * 4).unwrap();
    let args = RunArgs {
        buffers: vec![out.clone()],
        scalars: vec![],
    };
    let seen = Arc::new(AtomicUsize::new(0));
    for (cores, reason) in [
        (0usize, "a run needs at least one core"),
        (4, "this worker has 3 cores; a run takes 1 to 3 of them"),
    ] {
        let cfg = with_cores(Some(cores));
        if cores == 0 {
            assert!(cfg.check().is_err(), "checked before any run");
        }
        match w.run_fn("spread", args.clone(), &cfg, spread(1, seen.clone())) {
            Err(Error::Config(e)) => {
                assert_eq!(e.field, "CallConfig.cores");
                assert_eq!(e.value, cores.to_string());
                assert!(e.reason.contains(reason), "{}", e.reason);
            }
            other => panic!("cores {cores}: expected a refusal, got {other:?}"),
        }
        // Nothing ran, and the buffer is free for the next run.
        assert_eq!(seen.load(Ordering::SeqCst), 0);
        assert_eq!(out.read::<u32>().unwrap(), vec![0; BLOCKS]);
    }
    w.run_fn(
        "spread",
        args,
        &with_cores(Some(2)),
        spread(1, seen.clone()),
    )
    .unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    assert!(out.read::<u32>().unwrap().iter().all(|&c| c == 1 || c == 2));
}

#[test]
fn a_gang_larger_than_the_runs_cores_is_refused() {
    let w = worker(3);
    let gang = |blocks: u32| {
        move |o: &mut Orchestrator, a: &RunArgs| {
            let out = o.bind(&a.buffers[0], DType::U32, &[u64::from(blocks)])?;
            o.submit(
                Task::new(WHERE)
                    .output_existing(&out)
                    .blocks(blocks)
                    .require_sync_start(),
            )?;
            Ok(())
        }
    };
    let out = w.alloc(3 * 4).unwrap();
    let args = RunArgs {
        buffers: vec![out.clone()],
        scalars: vec![],
    };
    match w.run_fn("gang", args.clone(), &with_cores(Some(2)), gang(3)) {
        Err(Error::Run(e)) => {
            assert_eq!(e.code, ErrorCode::RequireSyncStartInvalid);
            assert!(e.detail.contains("only 2 cores"), "{}", e.detail);
            assert!(e.hint.contains("CallConfig.cores"), "{}", e.hint);
        }
        other => panic!("expected REQUIRE_SYNC_START_INVALID, got {other:?}"),
    }
    w.run_fn("gang", args.clone(), &with_cores(Some(2)), gang(2))
        .unwrap();
    // The same gang of three runs on all three cores, each block on its own.
    w.run_fn("gang", args, &with_cores(None), gang(3)).unwrap();
    let mut ran: Vec<u32> = out.read().unwrap();
    ran.sort_unstable();
    assert_eq!(ran, [1, 2, 3]);
}

#[test]
fn a_graph_replays_only_on_the_cores_it_was_captured_on() {
    let w = worker(3);
    let x = w.buffer_from(&[0.0f32; 16]).unwrap();
    let args = RunArgs {
        buffers: vec![x.clone()],
        scalars: vec![],
    };
    let inc = |o: &mut Orchestrator, a: &RunArgs| {
        let t = o.bind(&a.buffers[0], DType::F32, &[16])?;
        o.submit(Task::new(INC).in_out(&t))?;
        Ok(())
    };
    let shape = GraphShape::new();
    let (_, g) = w
        .capture_fn(
            "inc",
            args.clone(),
            &with_cores(Some(1)),
            shape.clone(),
            inc,
        )
        .unwrap();
    match w.replay(&g, args.clone(), &with_cores(None), &shape) {
        Err(Error::Run(e)) => assert!(
            e.detail
                .contains("the run takes 3 cores (CallConfig.cores), the graph was captured on 1"),
            "{}",
            e.detail
        ),
        other => panic!("expected a refused replay, got {other:?}"),
    }
    // More cores than the worker has: the configuration's refusal, not a replay's.
    match w.replay(&g, args.clone(), &with_cores(Some(4)), &shape) {
        Err(Error::Config(e)) => {
            assert_eq!(
                (e.field.as_str(), e.value.as_str()),
                ("CallConfig.cores", "4")
            )
        }
        other => panic!("expected CallConfig.cores refused, got {other:?}"),
    }
    assert_eq!(
        x.read::<f32>().unwrap(),
        vec![1.0; 16],
        "the refused replays ran nothing"
    );
    w.replay(&g, args.clone(), &with_cores(Some(1)), &shape)
        .unwrap();
    assert_eq!(x.read::<f32>().unwrap(), vec![2.0; 16]);
    // A graph cache captures again when the count changes, and replays while it stays.
    let mut cache = GraphCache::default();
    let modes: Vec<bool> = [Some(1), Some(1), Some(2), Some(2), None]
        .into_iter()
        .map(|c| {
            let r = cache
                .run(&w, "inc", args.clone(), &with_cores(c), shape.clone(), inc)
                .unwrap();
            matches!(r.graph, GraphMode::Replayed { .. })
        })
        .collect();
    assert_eq!(modes, [false, true, false, true, false]);
    assert_eq!(x.read::<f32>().unwrap(), vec![7.0; 16]);
}

/// Runs alternate between one core and all of them, each a fan-out and fan-in of dependent
/// tasks: every run completes with the right sums (no wake-up spent on a core outside a run
/// leaves its work waiting; a hang would trip the watchdog and fail the run).
#[test]
fn runs_that_alternate_core_counts_lose_no_work() {
    let w = worker(3);
    let x = w.buffer_from(&[0.0f32; 64]).unwrap();
    let args = RunArgs {
        buffers: vec![x.clone()],
        scalars: vec![],
    };
    let rounds = 60;
    for r in 0..rounds {
        let cores = [Some(1), None, Some(2)][r % 3];
        w.run_fn("chains", args.clone(), &with_cores(cores), |o, a| {
            let t = o.bind(&a.buffers[0], DType::F32, &[64])?;
            for i in 0..16u64 {
                let part = t.slice(0, i * 4, i * 4 + 4)?;
                for _ in 0..8 {
                    o.submit(Task::new(INC).in_out(&part))?;
                }
            }
            Ok(())
        })
        .unwrap();
    }
    assert_eq!(x.read::<f32>().unwrap(), vec![8.0 * rounds as f32; 64]);
}
