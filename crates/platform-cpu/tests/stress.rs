//! Stress: a million tasks through small rings, with outputs, tensor dependencies and explicit
//! ones; afterwards every ring's window, heap and dependency pool, and the dependency map, are
//! fully reclaimed, and the result is right.

use simpler_core::*;
use simpler_cpu::CpuPlatform;

const ADD: KernelId = KernelId(1);
const COPY_ADD: KernelId = KernelId(2);
const MOVE: KernelId = KernelId(3);

#[test]
fn a_million_tasks_through_small_rings_reclaim_everything() {
    let w = Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(2),
            timeouts: None,
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
            for r in 0..ROUNDS {
                o.scope(ScopeKind::Auto, |o| {
                    for half in 0..2 {
                        let s = (r * 2 + half) % SLOTS;
                        let slot = acc.slice(0, s, s + 1)?;
                        // out = slot + 1 in a fresh output; slot = out (after the read of
                        // slot: write-after-read is ordered explicitly); slot += 1 twice, once
                        // behind a dummy. Net +3 per half round.
                        let copy =
                            o.submit(Task::new(COPY_ADD).input(&slot).output(DType::U64, &[1]))?;
                        o.submit(
                            Task::new(MOVE)
                                .input(&copy.output(0))
                                .in_out(&slot)
                                .after(copy.id),
                        )?;
                        o.submit(Task::new(ADD).in_out(&slot))?;
                        let gate = o.submit(Task::dummy().in_out(&slot))?.id;
                        o.submit(Task::new(ADD).in_out(&slot).after(gate))?;
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
