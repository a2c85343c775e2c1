//! Stress: a million tasks through small rings, with outputs, tensor dependencies and explicit
//! ones; afterwards every ring's window, heap and dependency pool, and the dependency map, are
//! fully reclaimed, and the result is right.

use simpler_core::*;
use simpler_cpu::CpuPlatform;

const ADD: KernelId = KernelId(1);
const COPY_ADD: KernelId = KernelId(2);
const MOVE: KernelId = KernelId(3);
const GATE: KernelId = KernelId(4);

/// Tasks the orchestration has submitted so far (read by the gate kernel).
static SUBMITTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[test]
fn a_million_tasks_through_small_rings_reclaim_everything() {
    // One call of a million tiny tasks: ~1.5 s alone, but every hand-off between its threads
    // waits for a CPU where CPU-bound processes share the cores (~20 s beside four of them,
    // past 50 s before the orchestrator yielded only after waking a core). The test is of
    // reclamation, not speed: the limit only turns a hang into a failure.
    let w = Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(2),
            timeouts: Some(Timeouts {
                stream_sync: std::time::Duration::from_secs(900),
                ..Timeouts::default()
            }),
            idle_spin: None,
        },
    )
    .unwrap();
    // acc[i] += 1 (InOut chain per slot).
    w.register_kernel(KernelSpec::new(ADD, "add", EngineClass::Vector, |ctx| {
        for v in ctx.write::<u64>(0)? {
            *v += 1;
        }
        Ok(())
    }))
    .unwrap();
    // out = in + 1 (into a fresh output, or into an existing tensor).
    w.register_kernel(KernelSpec::new(
        COPY_ADD,
        "copy_add",
        EngineClass::Cube,
        |ctx| {
            let x = ctx.read::<u64>(0)?.to_vec();
            for (o, v) in ctx.write::<u64>(1)?.iter_mut().zip(x) {
                *o = v + 1;
            }
            Ok(())
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(MOVE, "move", EngineClass::Vector, |ctx| {
        let x = ctx.read::<u64>(0)?.to_vec();
        ctx.write::<u64>(1)?.copy_from_slice(&x);
        Ok(())
    }))
    .unwrap();
    // The first task holds its ring while the orchestrator submits behind it: reclamation is
    // in order, so nothing after the gate is reclaimed before it completes, and the orchestrator
    // runs out of room (window, heap or dependency pool) within a few dozen tasks and must wait,
    // however fast the cores are. The gate lets go once 40 tasks are in (a point every resource
    // reaches before any is full), plus time for the orchestrator to reach its wait.
    w.register_kernel(KernelSpec::new(GATE, "gate", EngineClass::Vector, |_| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while SUBMITTED.load(std::sync::atomic::Ordering::SeqCst) < 40
            && std::time::Instant::now() < deadline
        {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        Ok(())
    }))
    .unwrap();
    const SLOTS: u64 = 8;
    const ROUNDS: u64 = 100_000; // 2 halves x 5 tasks per round: 1M tasks
    let acc = w.alloc(SLOTS as usize * 8).unwrap();
    let cfg = CallConfig {
        runtime_env: RuntimeEnv {
            ring_task_window: RingValue::All(64),
            ring_heap: RingValue::All(16 << 10),
            ring_dep_pool: RingValue::All(128),
        },
        ..CallConfig::default()
    };
    let args = RunArgs {
        buffers: vec![acc.clone()],
        scalars: vec![],
    };
    let report = w
        .run_fn("stress", args, &cfg, |o, a| {
            let acc = o.bind(&a.buffers[0], DType::U64, &[SLOTS])?;
            SUBMITTED.store(0, std::sync::atomic::Ordering::SeqCst);
            for r in 0..ROUNDS {
                o.scope(ScopeKind::Auto, |o| {
                    if r == 0 {
                        o.submit(Task::new(GATE))?;
                    }
                    for half in 0..2 {
                        let s = (r * 2 + half) % SLOTS;
                        let slot = acc.slice(0, s, s + 1)?;
                        // out = slot + 1 in a fresh output; slot = out (after the read of
                        // slot: write-after-read is ordered explicitly); slot += 1 twice, once
                        // behind a dummy. Net +3 per half round.
                        let copy =
                            o.submit(Task::new(COPY_ADD).input(&slot).output(DType::U64, &[1]))?;
                        SUBMITTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        o.submit(
                            Task::new(MOVE)
                                .input(&copy.output(0))
                                .in_out(&slot)
                                .after(copy.id),
                        )?;
                        o.submit(Task::new(ADD).in_out(&slot))?;
                        let gate = o.submit(Task::dummy().in_out(&slot))?.id;
                        o.submit(Task::new(ADD).in_out(&slot).after(gate))?;
                        SUBMITTED.fetch_add(4, std::sync::atomic::Ordering::SeqCst);
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
        .unwrap();
    assert!(
        report.counters.tasks >= 1_000_000,
        "{} tasks",
        report.counters.tasks
    );
    let total: u64 = acc.read::<u64>().unwrap().iter().sum();
    assert_eq!(total, ROUNDS * 2 * 3);
    for r in &report.ring_final {
        assert_eq!(
            (r.window, r.heap, r.dep_pool),
            (0, 0, 0),
            "ring {} not reclaimed: {r:?}",
            r.ring
        );
    }
    assert!(report.ring_final[1].tasks >= 1_000_000);
    assert_eq!(report.tensormap_final, 0);
    assert!(
        report.counters.ring_waits > 0,
        "small rings should have applied back-pressure"
    );
}
