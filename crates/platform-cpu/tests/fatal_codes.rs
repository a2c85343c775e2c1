//! One test per fatal code the public API can reach. Each triggers the condition with small
//! `runtime_env` values (or short timeouts), then checks the code, that the hint names the knob,
//! that the run returned instead of hanging, and that the same worker then runs a normal job
//! correctly.
//!
//! Not reachable through the API, so not here: SCHEDULER_TIMEOUT S3 (ready tasks with idle
//! cores: a lost wake-up, i.e. a runtime bug) and S4 (pending tasks that can never become
//! ready: every dependency points at an earlier task, which always completes).

use std::time::{Duration, Instant};

use simpler_core::*;
use simpler_cpu::CpuPlatform;

const INC: KernelId = KernelId(1);
const FAIL: KernelId = KernelId(2);
const PANIC: KernelId = KernelId(3);
const SPIN_UNTIL_CANCELLED: KernelId = KernelId(4);
const SLEEP_50MS: KernelId = KernelId(5);
const STUCK: KernelId = KernelId(6);
const NOP: KernelId = KernelId(7);
const SLEEP_5MS: KernelId = KernelId(9);

fn worker_with(cores: usize, timeouts: Option<Timeouts>) -> Worker {
    let w = Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(cores),
            timeouts,
            idle_spin: None,
        },
    )
    .unwrap();
    w.register_kernel(KernelSpec::new(INC, "inc", EngineClass::Vector, |ctx| {
        for v in ctx.write::<f32>(0)? {
            *v += 1.0;
        }
        Ok(())
    }))
    .unwrap();
    w.register_kernel(KernelSpec::new(FAIL, "fails", EngineClass::Vector, |_| {
        Err(KernelError::new("bad input row 3"))
    }))
    .unwrap();
    w.register_kernel(KernelSpec::new(
        PANIC,
        "panics",
        EngineClass::Vector,
        |_| panic!("index out of range"),
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(
        SPIN_UNTIL_CANCELLED,
        "spins",
        EngineClass::Vector,
        |ctx| {
            while !ctx.is_cancelled() {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(
        SLEEP_50MS,
        "sleep50",
        EngineClass::Vector,
        |_| {
            std::thread::sleep(Duration::from_millis(50));
            Ok(())
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(STUCK, "stuck", EngineClass::Vector, |_| {
        // Ignores cancellation on purpose: the watchdog must replace this core.
        std::thread::sleep(Duration::from_millis(1500));
        Ok(())
    }))
    .unwrap();
    w.register_kernel(KernelSpec::new(NOP, "nop", EngineClass::Vector, |_| Ok(())))
        .unwrap();
    w.register_kernel(KernelSpec::new(
        SLEEP_5MS,
        "sleep5",
        EngineClass::Vector,
        |_| {
            std::thread::sleep(Duration::from_millis(5));
            Ok(())
        },
    ))
    .unwrap();
    w
}

fn worker() -> Worker {
    worker_with(2, None)
}

fn tight(window: u64, heap: u64, pool: u64) -> CallConfig {
    CallConfig {
        runtime_env: RuntimeEnv {
            ring_task_window: RingValue::All(window),
            ring_heap: RingValue::All(heap),
            ring_dep_pool: RingValue::All(pool),
        },
        ..CallConfig::default()
    }
}

/// Runs `f`, expects `code`, checks the hint mentions `knob`, then proves the worker still works.
fn expect_fatal(
    w: &Worker,
    cfg: &CallConfig,
    code: ErrorCode,
    knob: &str,
    f: impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync + 'static,
) -> RunError {
    let t = Instant::now();
    let err = match w.run_fn("fatal", RunArgs::default(), cfg, f) {
        Err(Error::Run(e)) => e,
        other => panic!("expected {code:?}, got {other:?}"),
    };
    assert_eq!(err.code, code, "{err}");
    assert!(
        err.hint.contains(knob),
        "hint {:?} should name {knob}",
        err.hint
    );
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    assert_normal_job_works(w);
    err
}

fn assert_normal_job_works(w: &Worker) {
    let buf = w.buffer_from(&[0.0f32; 16]).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    w.run_fn("normal", args, &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[16])?;
        o.scope(ScopeKind::Auto, |o| {
            for _ in 0..10 {
                o.submit(Task::new(INC).in_out(&t))?;
            }
            Ok(())
        })
    })
    .unwrap();
    assert_eq!(buf.read::<f32>().unwrap(), vec![10.0; 16]);
}

#[test]
fn scope_deadlock_when_one_scope_fills_the_window() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &tight(8, 1 << 20, 64),
        ErrorCode::ScopeDeadlock,
        "ring_task_window",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                for _ in 0..8 {
                    o.submit(Task::new(NOP))?;
                }
                Ok(())
            })
        },
    );
    assert_eq!(e.diagnosis, Some(Diagnosis::Proven));
    assert!(e.detail.contains("holds 7 tasks"), "{e}");
    // Every fatal report names the resource's use and the head task with its state.
    assert!(e.detail.contains("7 of 8 slots in flight"), "{e}");
    assert!(e.detail.contains("head task 1:0 ("), "{e}");
    assert_eq!(e.locator.ring, Some(1));
}

#[test]
fn heap_deadlock_for_an_output_larger_than_the_heap() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &tight(64, 4096, 64),
        ErrorCode::HeapRingDeadlock,
        "ring_heap",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                o.submit(Task::new(NOP).output(DType::F32, &[2048]))?;
                Ok(())
            })
        },
    );
    assert_eq!(e.diagnosis, Some(Diagnosis::Proven));
    assert!(e.hint.contains("CallConfig.runtime_env.ring_heap"), "{e}");
    assert!(
        e.detail
            .contains("holds 4096 bytes (0 in use; head task 1:0: none in flight)"),
        "{e}"
    );
}

#[test]
fn heap_deadlock_proven_when_the_head_is_in_an_open_scope() {
    let w = worker();
    // One scope allocates 4 outputs of 1 KiB from a 3 KiB heap: the head (first output's
    // task) can never be released while that scope is open.
    let e = expect_fatal(
        &w,
        &tight(64, 3072, 64),
        ErrorCode::HeapRingDeadlock,
        "ring_heap",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                for _ in 0..4 {
                    o.submit(Task::new(NOP).output(DType::F32, &[256]))?;
                }
                Ok(())
            })
        },
    );
    assert_eq!(e.diagnosis, Some(Diagnosis::Proven));
    assert!(e.detail.contains("heap full"), "{e}");
    assert!(e.detail.contains("head task 1:0"), "{e}");
}

#[test]
fn flow_control_deadlock_proven_on_a_shared_ring() {
    let w = worker();
    // Depth 3 and depth 4 share ring 3. A depth-3 task heads the ring while its scope stays
    // open; the depth-4 scopes' tasks queue behind it until the window is full.
    let e = expect_fatal(
        &w,
        &tight(8, 1 << 20, 64),
        ErrorCode::FlowControlDeadlock,
        "ring_task_window",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                o.scope(ScopeKind::Auto, |o| {
                    o.scope(ScopeKind::Auto, |o| {
                        o.submit(Task::new(NOP))?;
                        for _ in 0..4 {
                            o.scope(ScopeKind::Auto, |o| {
                                for _ in 0..3 {
                                    o.submit(Task::new(NOP))?;
                                }
                                Ok(())
                            })?;
                        }
                        Ok(())
                    })
                })
            })
        },
    );
    assert_eq!(e.diagnosis, Some(Diagnosis::Proven));
    assert!(e.detail.contains("task window full: 7 of 8"), "{e}");
    assert_eq!(e.locator.ring, Some(3));
}

#[test]
fn flow_control_deadlock_in_serial_mode() {
    let w = worker();
    let cfg = CallConfig {
        mode: OrchMode::Serial,
        ..tight(8, 1 << 20, 64)
    };
    let e = expect_fatal(
        &w,
        &cfg,
        ErrorCode::FlowControlDeadlock,
        "ring_task_window",
        |o, _| {
            for _ in 0..4 {
                o.scope(ScopeKind::Auto, |o| {
                    for _ in 0..3 {
                        o.submit(Task::new(NOP))?;
                    }
                    Ok(())
                })?;
            }
            Ok(())
        },
    );
    assert!(e.detail.contains("serial mode"), "{e}");
}

#[test]
fn dep_pool_overflow_for_a_task_with_too_many_producers() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &tight(64, 1 << 20, 4),
        ErrorCode::DepPoolOverflow,
        "ring_dep_pool",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                let ids: Vec<TaskId> = (0..6)
                    .map(|_| o.submit(Task::new(SLEEP_50MS)).map(|s| s.id))
                    .collect::<Result<_, _>>()?;
                o.submit(Task::new(NOP).after_all(ids))?;
                Ok(())
            })
        },
    );
    assert_eq!(e.diagnosis, Some(Diagnosis::Proven));
    assert!(e.detail.contains("in use; head task 1:0 ("), "{e}");
    // The locator is the refused task's (no id yet), not the head's.
    assert_eq!(e.locator.task, None);
    assert_eq!(e.locator.kernel.as_deref(), Some("nop"));
}

#[test]
fn dep_pool_overflow_proven_when_the_head_is_in_an_open_scope() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &tight(64, 1 << 20, 8),
        ErrorCode::DepPoolOverflow,
        "ring_dep_pool",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                let first = o.submit(Task::new(SLEEP_50MS))?.id;
                for _ in 0..12 {
                    o.submit(Task::new(NOP).after(first))?;
                }
                Ok(())
            })
        },
    );
    assert!(e.detail.contains("dependency pool full"), "{e}");
}

#[test]
fn invalid_args_are_rejected_with_the_reason() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::InvalidArgs,
        "split the task",
        |o, _| {
            let mut t = Task::new(NOP);
            for _ in 0..33 {
                t = t.output(DType::F32, &[1]);
            }
            o.submit(t)?;
            Ok(())
        },
    );
    assert!(e.detail.contains("33 tensor arguments"), "{e}");
    // Unregistered kernel; unbound buffer; use after the scope ended; written overlap.
    expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::InvalidArgs,
        "register_kernel",
        |o, _| {
            o.submit(Task::new(KernelId(999)))?;
            Ok(())
        },
    );
    let stray = w.alloc(64).unwrap();
    expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::InvalidArgs,
        "bind",
        move |o, _| {
            let t = stray.tensor(DType::F32, &[16])?;
            o.submit(Task::new(NOP).input(&t))?;
            Ok(())
        },
    );
    expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::InvalidArgs,
        "enclosing scope",
        |o, _| {
            let out = o.scope(ScopeKind::Auto, |o| {
                Ok(o.submit(Task::new(NOP).output(DType::F32, &[4]))?.output(0))
            })?;
            o.submit(Task::new(NOP).input(&out))?;
            Ok(())
        },
    );
    let b = w.alloc(64).unwrap();
    let args = RunArgs {
        buffers: vec![b],
        scalars: vec![],
    };
    let r = w.run_fn("overlap", args, &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[16])?;
        o.submit(
            Task::new(NOP)
                .input(&t.slice(0, 0, 8)?)
                .in_out(&t.slice(0, 4, 12)?),
        )?;
        Ok(())
    });
    let msg = r.unwrap_err().to_string();
    assert!(
        msg.contains("INVALID_ARGS") && msg.contains("overlap"),
        "{msg}"
    );
    assert_normal_job_works(&w);
}

#[test]
fn require_sync_start_larger_than_the_cores() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::RequireSyncStartInvalid,
        "WorkerConfig.cores",
        |o, _| {
            o.submit(Task::new(NOP).blocks(3).require_sync_start())?;
            Ok(())
        },
    );
    assert!(
        e.detail.contains("3 blocks") && e.detail.contains("only 2 cores"),
        "{e}"
    );
}

#[test]
fn tensor_wait_timeout_names_the_producer() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::TensorWaitTimeout,
        "timeout",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                let out = o
                    .submit(Task::new(SPIN_UNTIL_CANCELLED).output(DType::F32, &[4]))?
                    .output(0);
                o.get_tensor_data::<f32>(&out, Duration::from_millis(50))?;
                Ok(())
            })
        },
    );
    assert!(e.detail.contains("spins"), "{e}");
    assert!(e.locator.task.is_some());
}

#[test]
fn tensor_data_round_trips_through_the_orchestrator() {
    let w = worker();
    let buf = w.alloc(64).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    w.run_fn("data", args, &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[16])?;
        o.scope(ScopeKind::Auto, |o| {
            o.set_tensor_data(
                &t.slice(0, 0, 4)?,
                &[1.0f32, 2.0, 3.0, 4.0],
                Duration::from_secs(5),
            )?;
            o.submit(Task::new(INC).in_out(&t))?;
            let got = o.get_tensor_data::<f32>(&t.slice(0, 0, 4)?, Duration::from_secs(5))?;
            if got != [2.0, 3.0, 4.0, 5.0] {
                return Err(o.fatal(format!("read back {got:?}")));
            }
            Ok(())
        })
    })
    .unwrap();
    assert_eq!(&buf.read::<f32>().unwrap()[..5], &[2.0, 3.0, 4.0, 5.0, 1.0]);
}

#[test]
fn explicit_orchestration_fatal() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::ExplicitOrchFatal,
        "orchestration",
        |o, _| Err(o.fatal("sequence 3 is longer than max_seq")),
    );
    assert!(e.detail.contains("sequence 3"), "{e}");
    // A panicking orchestration is reported the same way.
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::ExplicitOrchFatal,
        "orchestration",
        |_, _| panic!("oops"),
    );
    assert!(e.detail.contains("panicked: oops"), "{e}");
}

#[test]
fn tensormap_overflow() {
    let w = worker();
    let cfg = CallConfig {
        tensormap_capacity: 16,
        mode: OrchMode::Serial,
        ..CallConfig::default()
    };
    let b = w.alloc(4096).unwrap();
    let args = RunArgs {
        buffers: vec![b],
        scalars: vec![],
    };
    let r = w.run_fn("map", args, &cfg, |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[1024])?;
        o.scope(ScopeKind::Auto, |o| {
            for i in 0..40 {
                o.submit(Task::new(NOP).output_existing(&t.slice(0, i * 8, i * 8 + 8)?))?;
            }
            Ok(())
        })
    });
    let e = map_overflow(r);
    assert!(e.hint.contains("tensormap_capacity"), "{e}");
    assert_eq!(e.diagnosis, Some(Diagnosis::Proven));
    assert_normal_job_works(&w);
}

#[test]
fn kernel_errors_and_panics_are_reported_with_task_and_core() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::KernelFailed,
        "kernel",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                o.submit(Task::new(FAIL))?;
                Ok(())
            })
        },
    );
    assert!(e.detail.contains("bad input row 3"), "{e}");
    assert!(e.locator.core.is_some() && e.locator.task.is_some());
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::KernelFailed,
        "kernel",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                o.submit(Task::new(PANIC))?;
                Ok(())
            })
        },
    );
    assert!(e.detail.contains("panicked: index out of range"), "{e}");
}

fn short_timeouts() -> Timeouts {
    Timeouts {
        scheduler: Duration::from_millis(300),
        op_execute: Duration::from_millis(800),
        stream_sync: Duration::from_millis(2500),
    }
}

#[test]
fn scheduler_timeout_s1_names_the_stuck_task() {
    let w = worker_with(2, Some(short_timeouts()));
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::SchedulerTimeout,
        "SIMPLER_SCHEDULER_TIMEOUT_MS",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                o.submit(Task::new(SPIN_UNTIL_CANCELLED))?;
                Ok(())
            })
        },
    );
    assert_eq!(e.subclass, Some(SchedSubclass::S1StuckTask));
    assert_eq!(e.locator.kernel.as_deref(), Some("spins"));
    assert!(e.locator.core.is_some());
}

#[test]
fn a_long_spmd_task_that_keeps_finishing_blocks_is_not_stuck() {
    // 160 blocks of 5 ms on 2 cores: the task runs ~400 ms, longer than the 300 ms scheduler
    // timeout, but every block finishes well within it, which is progress.
    let w = worker_with(2, Some(short_timeouts()));
    w.run_fn(
        "long_spmd",
        RunArgs::default(),
        &CallConfig::default(),
        |o, _| {
            o.submit(Task::new(SLEEP_5MS).blocks(160))?;
            Ok(())
        },
    )
    .expect("a task finishing blocks is progressing");
}

#[test]
fn scheduler_timeout_s5_when_the_orchestration_stalls() {
    let w = worker_with(2, Some(short_timeouts()));
    // The orchestration sleeps far longer than the watchdog allows: the error arrives without
    // waiting for it, and the worker gets a fresh orchestrator thread.
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::SchedulerTimeout,
        "orchestration function",
        |_, _| {
            std::thread::sleep(Duration::from_secs(4));
            Ok(())
        },
    );
    assert_eq!(e.subclass, Some(SchedSubclass::S5OrchestratorStarved));
}

#[test]
fn op_execute_timeout_while_other_tasks_progress() {
    let w = worker_with(2, Some(short_timeouts()));
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::OpExecuteTimeout,
        "SIMPLER_OP_EXECUTE_TIMEOUT_US",
        |o, _| {
            o.scope(ScopeKind::Auto, |o| {
                o.submit(Task::new(STUCK))?;
                for _ in 0..60 {
                    o.scope(ScopeKind::Auto, |o| {
                        o.submit(Task::new(SLEEP_50MS))?;
                        Ok(())
                    })?;
                }
                Ok(())
            })
        },
    );
    assert_eq!(e.locator.kernel.as_deref(), Some("stuck"));
}

#[test]
fn stream_sync_timeout_for_a_run_that_is_too_long() {
    let w = worker_with(2, Some(short_timeouts()));
    expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::StreamSyncTimeout,
        "SIMPLER_STREAM_SYNC_TIMEOUT_MS",
        |o, _| {
            for _ in 0..200 {
                o.scope(ScopeKind::Auto, |o| {
                    o.submit(Task::new(SLEEP_50MS))?;
                    Ok(())
                })?;
            }
            Ok(())
        },
    );
}

#[test]
fn worker_config_rejects_misordered_timeouts() {
    let t = Timeouts {
        scheduler: Duration::from_secs(5),
        op_execute: Duration::from_secs(4),
        stream_sync: Duration::from_secs(50),
    };
    match Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(1),
            timeouts: Some(t),
            idle_spin: None,
        },
    ) {
        Err(Error::Config(e)) => assert_eq!(e.field, "WorkerConfig.timeouts"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("misordered timeouts accepted"),
    }
    let cfg = CallConfig {
        runtime_env: RuntimeEnv {
            ring_task_window: RingValue::All(6),
            ..RuntimeEnv::default()
        },
        ..CallConfig::default()
    };
    let w = worker();
    match w.run_fn("x", RunArgs::default(), &cfg, |_, _| Ok(())) {
        Err(Error::Config(e)) => assert_eq!(e.field, "CallConfig.runtime_env.ring_task_window"),
        other => panic!("expected a config error, got {other:?}"),
    }
}

fn sleepy_predicate(_: &TaskCtx<'_>) -> bool {
    std::thread::sleep(Duration::from_millis(900));
    true
}

/// Set once the backstop test's orchestration has submitted B.
static B_SUBMITTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[test]
fn backstop_fires_when_nothing_progresses_without_a_proof() {
    const UNTIL_B_SUBMITTED: KernelId = KernelId(8);
    let w = worker();
    // A finishes only after B is submitted, so B becomes ready through A's completion on a
    // core, and B's predicate blocks that core. Had A completed first, B would be ready at
    // submit and the orchestrator itself would evaluate the predicate (once seen on a loaded
    // CI machine: the run then just took 900 ms and succeeded).
    w.register_kernel(KernelSpec::new(
        UNTIL_B_SUBMITTED,
        "until_b_submitted",
        EngineClass::Vector,
        |_| {
            let t = Instant::now();
            while !B_SUBMITTED.load(std::sync::atomic::Ordering::Acquire)
                && t.elapsed() < Duration::from_secs(10)
            {
                std::thread::sleep(Duration::from_micros(100));
            }
            Ok(())
        },
    ))
    .unwrap();
    // Window of 4 slots (3 in flight). A's completion makes B ready, and B's dispatch predicate
    // blocks the core for 900 ms: nothing completes and no kernel runs. The orchestrator then
    // waits on a head task (A) whose scope has ended — not a proof — and the backstop fires.
    let e = expect_fatal(
        &w,
        &tight(4, 1 << 20, 64),
        ErrorCode::FlowControlDeadlock,
        "ring_task_window",
        |o, _| {
            let b = o.scope(ScopeKind::Auto, |o| {
                let a = o.submit(Task::new(UNTIL_B_SUBMITTED))?.id;
                let b = o
                    .submit(Task::new(NOP).after(a).predicate(sleepy_predicate))?
                    .id;
                B_SUBMITTED.store(true, std::sync::atomic::Ordering::Release);
                Ok(b)
            })?;
            o.scope(ScopeKind::Auto, |o| {
                o.submit(Task::new(NOP).after(b))?;
                o.submit(Task::new(NOP))?;
                o.submit(Task::new(NOP))?;
                Ok(())
            })
        },
    );
    assert_eq!(e.diagnosis, Some(Diagnosis::Backstop), "{e}");
    assert!(e.to_string().contains("not a proof"), "{e}");
}

/// A task of 0 blocks, one with more scalars than a kernel may read, and an auto scope opened
/// inside a manual one are each refused with INVALID_ARGS naming what is wrong, and the worker
/// runs the next job.
#[test]
fn malformed_tasks_and_scopes_are_refused_by_name() {
    let w = worker();
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::InvalidArgs,
        "blocks(n) with n >= 1",
        |o, _| {
            o.submit(Task::new(NOP).blocks(0))?;
            Ok(())
        },
    );
    assert!(e.detail.contains("block_num is 0"), "{e}");
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::InvalidArgs,
        "in a tensor instead",
        |o, _| {
            let mut t = Task::new(NOP);
            for i in 0..17 {
                t = t.scalar(i);
            }
            o.submit(t)?;
            Ok(())
        },
    );
    assert!(e.detail.contains("17 scalars, at most 16"), "{e}");
    let e = expect_fatal(
        &w,
        &CallConfig::default(),
        ErrorCode::InvalidArgs,
        "close the manual scope first",
        |o, _| {
            // SAFETY: the manual scope submits nothing: no task can race.
            unsafe { o.begin_manual_scope()? };
            o.scope(ScopeKind::Auto, |_| Ok(()))
        },
    );
    assert!(
        e.detail
            .contains("an auto scope cannot be opened inside a manual scope"),
        "{e}"
    );
}

/// The dependency map's two proven overflows say how much it needs: one task recording more
/// readers and writers than the map holds, and a capture (which keeps every entry) outgrowing
/// it; each names the ring and kernel and suggests a capacity, and the worker runs on.
#[test]
fn tensormap_overflows_that_no_completion_can_end_suggest_a_capacity() {
    let w = worker();
    let cfg = CallConfig {
        tensormap_capacity: 16,
        ..CallConfig::default()
    };
    let b = w.alloc(4096).unwrap();
    let args = RunArgs {
        buffers: vec![b],
        scalars: vec![],
    };
    // 20 distinct inputs: 20 reader entries at once.
    let r = w.run_fn("wide", args.clone(), &cfg, |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[1024])?;
        let mut task = Task::new(NOP);
        for i in 0..20 {
            task = task.input(&t.slice(0, i * 8, i * 8 + 8)?);
        }
        o.submit(task)?;
        Ok(())
    });
    let e = map_overflow(r);
    assert!(
        e.detail
            .contains("records 20 readers and writers, the dependency map holds 16"),
        "{e}"
    );
    assert!(
        e.hint
            .contains("raise tensormap_capacity to 64 for this run: CallConfig.tensormap_capacity"),
        "{e}"
    );
    assert_eq!(e.locator.kernel.as_deref(), Some("nop"), "{e}");
    assert!(e.locator.ring.is_some(), "{e}");
    assert_normal_job_works(&w);
    // A capture of 40 writers of distinct slices: the 17th finds the map full for good.
    let r = w.capture_fn(
        "writers",
        args,
        &cfg,
        GraphShape::new(),
        |o: &mut Orchestrator, a: &RunArgs| {
            let t = o.bind(&a.buffers[0], DType::F32, &[1024])?;
            for i in 0..40 {
                o.submit(Task::new(NOP).output_existing(&t.slice(0, i * 8, i * 8 + 8)?))?;
            }
            Ok(())
        },
    );
    let e = map_overflow(r);
    assert!(
        e.detail
            .contains("a captured run keeps every dependency-map entry: 16 held"),
        "{e}"
    );
    assert!(
        e.hint
            .contains("raise tensormap_capacity to 64 for the capture"),
        "{e}"
    );
    assert_normal_job_works(&w);
}

/// The run error of `r`, a TENSORMAP_OVERFLOW.
fn map_overflow<T: std::fmt::Debug>(r: Result<T, Error>) -> RunError {
    let Err(Error::Run(e)) = r else {
        panic!("expected a run error, got {r:?}")
    };
    assert_eq!(e.code, ErrorCode::TensormapOverflow, "{e}");
    e
}
