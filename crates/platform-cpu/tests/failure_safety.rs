//! What a failed run leaves behind: its buffers are neither readable, rebindable nor freed while
//! a kernel of the run may still touch them (also a kernel the watchdog abandoned), stuck cores
//! are replaced so later runs use every core, and malformed sizes are clean errors.
//!
//! Every wait here is bounded; a kernel that is meant to outlive its run waits for a flag the
//! test sets, never for a fixed time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use simpler_core::*;
use simpler_cpu::CpuPlatform;

const WRITER: KernelId = KernelId(1);
const FAIL_ONCE_WRITER_RUNS: KernelId = KernelId(2);
const GANG: KernelId = KernelId(3);
const INC: KernelId = KernelId(4);
const SPIN: KernelId = KernelId(5);

/// Waits (at most 20 s) for `cond`; false if it never held.
fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    cond()
}

/// Flags shared by a run's kernels and the test.
#[derive(Default)]
struct Flags {
    /// The writer kernel has started.
    started: AtomicBool,
    /// The writer may go on (set by the test).
    release: AtomicBool,
    /// The writer also goes on once the run is cancelled (it lingers, then leaves by itself).
    release_on_cancel: AtomicBool,
    /// The writer has written and returned.
    left: AtomicBool,
}

/// A platform whose memory records when it is freed.
#[derive(Clone, Default)]
struct Tracking {
    cpu: CpuPlatform,
    freed: Arc<Mutex<Vec<usize>>>,
}

struct TrackedMemory {
    mem: Box<dyn Memory>,
    freed: Arc<Mutex<Vec<usize>>>,
}

// SAFETY: every method forwards to the CPU platform's memory, which upholds the contract.
unsafe impl Memory for TrackedMemory {
    fn addr(&self) -> usize {
        self.mem.addr()
    }
    fn len(&self) -> usize {
        self.mem.len()
    }
    fn host_accessible(&self) -> bool {
        self.mem.host_accessible()
    }
}

impl Drop for TrackedMemory {
    fn drop(&mut self) {
        self.freed.lock().unwrap().push(self.mem.addr());
    }
}

// SAFETY: allocation and threads come from the CPU platform; memory is only wrapped.
unsafe impl Platform for Tracking {
    fn info(&self) -> PlatformInfo {
        self.cpu.info()
    }
    fn alloc(&self, bytes: usize) -> Result<Box<dyn Memory>, PlatformError> {
        Ok(Box::new(TrackedMemory {
            mem: self.cpu.alloc(bytes)?,
            freed: self.freed.clone(),
        }))
    }
    fn spawn_core(
        &self,
        index: usize,
        body: Box<dyn FnOnce() + Send>,
    ) -> Result<JoinHandle<()>, PlatformError> {
        self.cpu.spawn_core(index, body)
    }
}

/// A 2-core worker with short timeouts, a writer kernel that ignores cancellation (it waits for
/// `flags.release`, then fills argument 0 with 7.0), a kernel that fails once the writer runs,
/// a gang kernel that records the cores of its blocks, and an incrementer.
fn worker(platform: Tracking, flags: Arc<Flags>, gang_cores: Arc<Mutex<Vec<usize>>>) -> Worker {
    let w = Worker::new(
        platform,
        WorkerConfig {
            cores: Some(2),
            timeouts: Some(Timeouts {
                scheduler: Duration::from_millis(1000),
                op_execute: Duration::from_millis(2000),
                stream_sync: Duration::from_millis(5000),
            }),
            idle_spin: None,
        },
    )
    .unwrap();
    let f = flags.clone();
    w.register_kernel(KernelSpec::new(
        WRITER,
        "writer",
        EngineClass::Vector,
        move |ctx| {
            f.started.store(true, Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_secs(20);
            let go = || {
                f.release.load(Ordering::SeqCst)
                    || (f.release_on_cancel.load(Ordering::SeqCst) && ctx.is_cancelled())
            };
            while !go() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            ctx.write::<f32>(0)?.fill(7.0);
            f.left.store(true, Ordering::SeqCst);
            Ok(())
        },
    ))
    .unwrap();
    let f = flags;
    w.register_kernel(KernelSpec::new(
        FAIL_ONCE_WRITER_RUNS,
        "fails",
        EngineClass::Vector,
        move |_| {
            wait_for(|| f.started.load(Ordering::SeqCst));
            Err(KernelError::new("failing while the writer runs"))
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(
        GANG,
        "gang",
        EngineClass::Vector,
        move |ctx| {
            gang_cores.lock().unwrap().push(ctx.core());
            ctx.sync_barrier()?;
            Ok(())
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(SPIN, "spin", EngineClass::Vector, |ctx| {
        wait_for(|| ctx.is_cancelled());
        Ok(())
    }))
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

/// Runs the writer on `buf` next to a kernel that fails once the writer has started.
fn failing_run(w: &Worker, buf: &Buffer) -> RunError {
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    match w.run_fn("fails", args, &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[64])?;
        o.submit(Task::new(WRITER).output_existing(&t))?;
        o.submit(Task::new(FAIL_ONCE_WRITER_RUNS))?;
        Ok(())
    }) {
        Err(Error::Run(e)) => e,
        other => panic!("expected a kernel failure, got {other:?}"),
    }
}

/// A sync-start gang of every core, which forms only if no core is missing.
fn gang_of_all_cores(w: &Worker, gang_cores: &Mutex<Vec<usize>>) {
    gang_cores.lock().unwrap().clear();
    let n = w.cores() as u32;
    w.run_fn(
        "gang",
        RunArgs::default(),
        &CallConfig::default(),
        move |o, _| {
            o.submit(Task::new(GANG).blocks(n).require_sync_start())?;
            Ok(())
        },
    )
    .expect("a gang of every core runs");
    let mut cores = gang_cores.lock().unwrap().clone();
    cores.sort();
    assert_eq!(cores, (0..w.cores()).collect::<Vec<_>>());
}

#[test]
fn a_failed_run_returns_after_its_lingering_kernel_left_the_buffer() {
    let flags = Arc::new(Flags::default());
    let gang = Arc::new(Mutex::new(Vec::new()));
    let w = worker(Tracking::default(), flags.clone(), gang.clone());
    let buf = w.alloc(64 * 4).unwrap();
    // The writer still writes after the run failed, but ends by itself within the grace
    // period.
    flags.release_on_cancel.store(true, Ordering::SeqCst);
    let e = failing_run(&w, &buf);
    assert_eq!(e.code, ErrorCode::KernelFailed, "{e}");
    // By the time the run returned, the writer had finished: the host sees its write, and
    // nothing changes the buffer afterwards.
    assert!(flags.left.load(Ordering::SeqCst));
    assert_eq!(buf.read::<f32>().unwrap(), vec![7.0; 64]);
    gang_of_all_cores(&w, &gang);
}

#[test]
fn an_abandoned_kernels_buffer_stays_bound_until_it_leaves() {
    let flags = Arc::new(Flags::default());
    let gang = Arc::new(Mutex::new(Vec::new()));
    let w = worker(Tracking::default(), flags.clone(), gang.clone());
    let buf = w.alloc(64 * 4).unwrap();
    let e = failing_run(&w, &buf);
    assert_eq!(e.code, ErrorCode::KernelFailed, "{e}");
    assert!(!flags.left.load(Ordering::SeqCst));
    // The writer is still inside its kernel: the buffer can be neither read nor written from
    // the host, nor bound by another run.
    assert!(matches!(buf.read::<f32>(), Err(BufferError::InUse { .. })));
    assert!(matches!(
        buf.write(&[1.0f32; 64]),
        Err(BufferError::InUse { .. })
    ));
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    match w.run_fn("rebind", args, &CallConfig::default(), |_, _| Ok(())) {
        Err(Error::Run(e)) => {
            assert_eq!(e.code, ErrorCode::InvalidArgs);
            assert!(e.detail.contains("bound"), "{e}");
        }
        other => panic!("rebinding a buffer an abandoned kernel writes: {other:?}"),
    }
    // Meanwhile the worker runs other work on every core (the stuck one was replaced).
    gang_of_all_cores(&w, &gang);
    let other = w.buffer_from(&[0.0f32; 8]).unwrap();
    let args = RunArgs {
        buffers: vec![other.clone()],
        scalars: vec![],
    };
    w.run_fn("inc", args, &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[8])?;
        o.submit(Task::new(INC).in_out(&t))?;
        Ok(())
    })
    .unwrap();
    assert_eq!(other.read::<f32>().unwrap(), vec![1.0; 8]);
    // Once the writer leaves, the buffer is the host's again, with the writer's data.
    flags.release.store(true, Ordering::SeqCst);
    assert!(wait_for(|| flags.left.load(Ordering::SeqCst)));
    assert!(wait_for(|| buf.read::<f32>().is_ok()));
    assert_eq!(buf.read::<f32>().unwrap(), vec![7.0; 64]);
    gang_of_all_cores(&w, &gang);
}

#[test]
fn an_abandoned_kernels_buffer_is_freed_only_after_it_leaves() {
    let flags = Arc::new(Flags::default());
    let gang = Arc::new(Mutex::new(Vec::new()));
    let platform = Tracking::default();
    let freed = platform.freed.clone();
    let w = worker(platform, flags.clone(), gang.clone());
    let buf = w.alloc(64 * 4).unwrap();
    let e = failing_run(&w, &buf);
    assert_eq!(e.code, ErrorCode::KernelFailed, "{e}");
    // The caller drops its last handle while the writer still runs: the memory must stay.
    drop(buf);
    let n_freed = freed.lock().unwrap().len();
    flags.release.store(true, Ordering::SeqCst);
    assert!(wait_for(|| flags.left.load(Ordering::SeqCst)));
    assert_eq!(
        n_freed, 0,
        "the buffer was freed while a kernel could still write it"
    );
    // After the writer left, the memory is released (no leak).
    assert!(wait_for(|| !freed.lock().unwrap().is_empty()));
    gang_of_all_cores(&w, &gang);
}

#[test]
fn an_output_too_large_for_64_bits_is_a_clean_error() {
    let flags = Arc::new(Flags::default());
    let gang = Arc::new(Mutex::new(Vec::new()));
    let w = worker(Tracking::default(), flags, gang.clone());
    for shape in [
        vec![u64::MAX],
        vec![1 << 40, 1 << 40],
        vec![u64::MAX / 2, 2],
    ] {
        let s = shape.clone();
        let r = w.run_fn(
            "huge",
            RunArgs::default(),
            &CallConfig::default(),
            move |o, _| {
                o.submit(Task::new(INC).output(DType::U8, &s))?;
                Ok(())
            },
        );
        match r {
            Err(Error::Run(e)) => assert!(
                matches!(e.code, ErrorCode::InvalidArgs | ErrorCode::HeapRingDeadlock),
                "{shape:?}: {e}"
            ),
            other => panic!("{shape:?}: expected a clean error, got {other:?}"),
        }
        // Two outputs whose sum overflows.
        let r = w.run_fn("sum", RunArgs::default(), &CallConfig::default(), |o, _| {
            o.submit(
                Task::dummy()
                    .output(DType::U8, &[u64::MAX - 4096])
                    .output(DType::U8, &[u64::MAX - 4096]),
            )?;
            Ok(())
        });
        assert!(matches!(r, Err(Error::Run(_))), "{r:?}");
    }
    gang_of_all_cores(&w, &gang);
}

#[test]
fn views_from_another_worker_or_run_are_rejected() {
    let gang = Arc::new(Mutex::new(Vec::new()));
    let a = worker(Tracking::default(), Arc::default(), gang.clone());
    let b = worker(Tracking::default(), Arc::default(), gang.clone());
    // Each worker's first buffer: ids must differ, so a view of b's buffer is not "bound" in
    // a run of `a` that bound a's buffer.
    let mine = a.buffer_from(&[0.0f32; 8]).unwrap();
    let foreign = b.buffer_from(&[0.0f32; 8]).unwrap();
    assert_ne!(mine.id(), foreign.id());
    let view = foreign.tensor(DType::F32, &[8]).unwrap();
    let args = RunArgs {
        buffers: vec![mine.clone()],
        scalars: vec![],
    };
    let r = a.run_fn("foreign", args, &CallConfig::default(), move |o, a| {
        o.bind(&a.buffers[0], DType::F32, &[8])?;
        o.submit(Task::new(INC).in_out(&view))?;
        Ok(())
    });
    match r {
        Err(Error::Run(e)) => assert!(e.detail.contains("not bound"), "{e}"),
        other => panic!("a view of another worker's buffer was accepted: {other:?}"),
    }
    assert_eq!(foreign.read::<f32>().unwrap(), vec![0.0; 8]);

    // An output of a run of `b`, used in the first run of `a` (same per-worker run number).
    let leaked: Arc<Mutex<Option<Tensor>>> = Arc::default();
    let l = leaked.clone();
    b.run_fn(
        "first",
        RunArgs::default(),
        &CallConfig::default(),
        |_, _| Ok(()),
    )
    .unwrap();
    b.run_fn(
        "leak",
        RunArgs::default(),
        &CallConfig::default(),
        move |o, _| {
            let s = o.submit(Task::dummy().output(DType::F32, &[8]))?;
            *l.lock().unwrap() = Some(s.output(0));
            Ok(())
        },
    )
    .unwrap();
    let out = leaked.lock().unwrap().take().unwrap();
    let r = a.run_fn(
        "use",
        RunArgs::default(),
        &CallConfig::default(),
        move |o, _| {
            o.submit(Task::dummy())?;
            o.submit(Task::new(INC).in_out(&out))?;
            Ok(())
        },
    );
    match r {
        Err(Error::Run(e)) => assert!(e.detail.contains("earlier run"), "{e}"),
        other => panic!("another worker's output was accepted: {other:?}"),
    }
    gang_of_all_cores(&a, &gang);
}

/// A task id kept from an earlier run names a position that the next run fills again, so only
/// the run it carries tells the two apart: it is refused, and so is an id of another worker's
/// run. The run after that is unaffected.
#[test]
fn a_task_id_from_an_earlier_run_or_another_worker_is_refused() {
    let gang = Arc::new(Mutex::new(Vec::new()));
    let a = worker(Tracking::default(), Arc::default(), gang.clone());
    let b = worker(Tracking::default(), Arc::default(), gang.clone());
    let ids: Arc<Mutex<Vec<TaskId>>> = Arc::default();
    let keep = ids.clone();
    a.run_fn(
        "first",
        RunArgs::default(),
        &CallConfig::default(),
        move |o, _| {
            let first = o.submit(Task::dummy())?.id;
            o.submit(Task::dummy().after(first))?;
            keep.lock().unwrap().push(first);
            Ok(())
        },
    )
    .unwrap();
    let stale = ids.lock().unwrap()[0];
    let keep = ids.clone();
    let r = a.run_fn(
        "second",
        RunArgs::default(),
        &CallConfig::default(),
        move |o, _| {
            // The same position as `stale`, submitted in this run: an id without its run would
            // pass the "submitted in this run" check and name this task.
            let fresh = o.submit(Task::dummy())?.id;
            keep.lock().unwrap().push(fresh);
            o.submit(Task::dummy().after(stale))?;
            Ok(())
        },
    );
    let fresh = ids.lock().unwrap()[1];
    assert_eq!((fresh.ring(), fresh.local()), (stale.ring(), stale.local()));
    assert_ne!(fresh, stale);
    let refused = |r: Result<RunReport, Error>| match r {
        Err(Error::Run(e)) => {
            assert_eq!(e.code, ErrorCode::InvalidArgs, "{e}");
            assert!(
                e.detail.contains("not returned by a submit of this run"),
                "{e}"
            );
        }
        other => panic!("a task id of another run was accepted: {other:?}"),
    };
    refused(r);
    refused(b.run_fn(
        "foreign",
        RunArgs::default(),
        &CallConfig::default(),
        move |o, _| {
            o.submit(Task::dummy())?;
            o.submit(Task::dummy().after(stale))?;
            Ok(())
        },
    ));
    // The run after that: explicit dependencies on its own ids order its tasks.
    let buf = a.buffer_from(&[0.0f32; 4]).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    a.run_fn("third", args, &CallConfig::default(), |o, args| {
        let t = o.bind(&args.buffers[0], DType::F32, &[4])?;
        let first = o.submit(Task::new(INC).in_out(&t))?.id;
        o.submit(Task::new(INC).in_out(&t).after(first))?;
        Ok(())
    })
    .unwrap();
    assert_eq!(buf.read::<f32>().unwrap(), vec![2.0; 4]);
    gang_of_all_cores(&a, &gang);
}

#[test]
fn a_core_stuck_past_the_scheduler_timeout_is_replaced_for_the_next_run() {
    let flags = Arc::new(Flags::default());
    let gang = Arc::new(Mutex::new(Vec::new()));
    let w = worker(Tracking::default(), flags.clone(), gang.clone());
    let buf = w.alloc(64 * 4).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    // The writer ignores cancellation: the watchdog fails the run (S1), and the core stays
    // inside the kernel past the grace period.
    let r = w.run_fn("stuck", args, &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[64])?;
        o.submit(Task::new(WRITER).output_existing(&t))?;
        Ok(())
    });
    match r {
        Err(Error::Run(e)) => {
            assert_eq!(e.code, ErrorCode::SchedulerTimeout, "{e}");
            assert_eq!(e.subclass, Some(SchedSubclass::S1StuckTask));
        }
        other => panic!("expected S1, got {other:?}"),
    }
    assert!(!flags.left.load(Ordering::SeqCst));
    // The next run has every core: a gang of all of them forms.
    gang_of_all_cores(&w, &gang);
    flags.release.store(true, Ordering::SeqCst);
    assert!(wait_for(|| flags.left.load(Ordering::SeqCst)));
    assert!(wait_for(|| buf.read::<f32>().is_ok()));
    gang_of_all_cores(&w, &gang);
}

#[test]
fn an_abandoned_orchestrator_returning_late_leaves_the_next_run_alone() {
    let gang = Arc::new(Mutex::new(Vec::new()));
    let w = worker(Tracking::default(), Arc::default(), gang.clone());
    let release_first = Arc::new(AtomicBool::new(false));
    let second_started = Arc::new(AtomicBool::new(false));
    // Held by the first orchestration function, which its orchestrator thread drops with the
    // job after it has dropped the run's registration: the receiver then sees the channel
    // close, the handshake that tells the second run that the first thread's cleanup is done.
    let (first_job, first_job_dropped) = std::sync::mpsc::channel::<()>();
    let first_job_dropped = Mutex::new(first_job_dropped);
    // The first orchestration sits in user code until released: the watchdog fails the run
    // (S5), delivers the error and hands the job queue to a new orchestrator thread.
    let rel = release_first.clone();
    let r = w.run_fn(
        "stuck_orch",
        RunArgs::default(),
        &CallConfig::default(),
        move |_, _| {
            let _held = &first_job;
            wait_for(|| rel.load(Ordering::SeqCst));
            Ok(())
        },
    );
    match r {
        Err(Error::Run(e)) => {
            assert_eq!(
                e.subclass,
                Some(SchedSubclass::S5OrchestratorStarved),
                "{e}"
            )
        }
        other => panic!("expected S5, got {other:?}"),
    }
    // The second run is registered while the first orchestrator is still stuck; once that
    // thread has returned and cleaned up, it submits a task that only the watchdog can end. It
    // must still be watched (and its cores still joined).
    let started = second_started.clone();
    let mut second = w
        .submit_fn(
            "second",
            RunArgs::default(),
            &CallConfig::default(),
            move |o, _| {
                started.store(true, Ordering::SeqCst);
                let waited = first_job_dropped
                    .lock()
                    .unwrap()
                    .recv_timeout(Duration::from_secs(20));
                if waited != Err(std::sync::mpsc::RecvTimeoutError::Disconnected) {
                    return Err(RunError::new(
                        ErrorCode::ExplicitOrchFatal,
                        format!("the first orchestrator thread never finished: {waited:?}"),
                        "",
                    ));
                }
                o.submit(Task::new(SPIN))?;
                Ok(())
            },
        )
        .unwrap();
    assert!(wait_for(|| second_started.load(Ordering::SeqCst)));
    release_first.store(true, Ordering::SeqCst);
    let mut result = None;
    assert!(
        wait_for(|| {
            result = second.poll();
            result.is_some()
        }),
        "the second run was no longer watched after the first orchestrator returned"
    );
    match result.unwrap() {
        Err(Error::Run(e)) => {
            assert_eq!(e.subclass, Some(SchedSubclass::S1StuckTask), "{e}")
        }
        other => panic!("expected S1, got {other:?}"),
    }
    gang_of_all_cores(&w, &gang);
}

/// A platform whose next allocation can be held at a gate, so a test knows the orchestrator
/// thread has taken a job off the queue (it allocates the run's arena then) and has not yet
/// registered it as the current run.
#[derive(Clone, Default)]
struct GatedAlloc {
    cpu: CpuPlatform,
    gate: Arc<AllocGate>,
}

#[derive(Default)]
struct AllocGate {
    armed: AtomicBool,
    entered: AtomicBool,
    open: AtomicBool,
}

// SAFETY: allocation and threads come from the CPU platform; an armed gate only delays the
// allocation (bounded: it opens by itself after 20 s so a broken test cannot hang).
unsafe impl Platform for GatedAlloc {
    fn info(&self) -> PlatformInfo {
        self.cpu.info()
    }
    fn alloc(&self, bytes: usize) -> Result<Box<dyn Memory>, PlatformError> {
        if self.gate.armed.swap(false, Ordering::SeqCst) {
            self.gate.entered.store(true, Ordering::SeqCst);
            wait_for(|| self.gate.open.load(Ordering::SeqCst));
        }
        self.cpu.alloc(bytes)
    }
    fn spawn_core(
        &self,
        index: usize,
        body: Box<dyn FnOnce() + Send>,
    ) -> Result<JoinHandle<()>, PlatformError> {
        self.cpu.spawn_core(index, body)
    }
}

/// `close()` right after `submit`, while the orchestrator thread is between taking the job and
/// registering its run, waits for that run instead of stopping the cores under it (which left
/// the run spinning with no cores and its handle never completing).
#[test]
fn close_right_after_submit_finishes_the_queued_run() {
    let platform = GatedAlloc::default();
    let w = Worker::new(
        platform.clone(),
        WorkerConfig {
            cores: Some(1),
            timeouts: None,
            idle_spin: None,
        },
    )
    .unwrap();
    w.register_kernel(KernelSpec::new(INC, "inc", EngineClass::Vector, |ctx| {
        ctx.write::<f32>(0)?.fill(1.0);
        Ok(())
    }))
    .unwrap();
    let buf = w.alloc(4096).unwrap();
    // The run's arena (ring heaps) is allocated after the job leaves the queue: hold it there.
    platform.gate.armed.store(true, Ordering::SeqCst);
    let mut h = w
        .submit_fn(
            "late",
            RunArgs {
                buffers: vec![buf.clone()],
                scalars: vec![],
            },
            &CallConfig::default(),
            |o, a| {
                let t = o.bind(&a.buffers[0], DType::F32, &[1024])?;
                o.submit(Task::new(INC).output_existing(&t))?;
                Ok(())
            },
        )
        .unwrap();
    assert!(
        wait_for(|| platform.gate.entered.load(Ordering::SeqCst)),
        "the orchestrator thread never took the job"
    );
    let closer = std::thread::spawn(move || w.close());
    // close() must find the job taken but not yet registered; give it time to get there (the
    // assertions below hold whether or not it has).
    std::thread::sleep(Duration::from_millis(20));
    platform.gate.open.store(true, Ordering::SeqCst);
    // Bounded: the bug made this wait forever.
    let finished = wait_for(|| h.is_done());
    assert!(finished, "the queued run never completed after close()");
    assert!(h.poll().unwrap().is_ok());
    closer.join().unwrap().unwrap();
    assert_eq!(buf.read::<f32>().unwrap()[0], 1.0);
}

fn panicking_predicate(_: &TaskCtx<'_>) -> bool {
    panic!("predicate exploded")
}

/// A dispatch predicate that panics fails the run with its message (not a scheduler timeout
/// after the grace period), and the next run on the same worker uses every core.
#[test]
fn a_panicking_predicate_fails_the_run_by_name_and_the_worker_goes_on() {
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
        for v in ctx.write::<f32>(0)?.iter_mut() {
            *v += 1.0;
        }
        Ok(())
    }))
    .unwrap();
    let buf = w.alloc(4096).unwrap();
    let args = || RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    let e = w
        .run_fn("pred", args(), &CallConfig::default(), |o, a| {
            let t = o.bind(&a.buffers[0], DType::F32, &[1024])?;
            let first = o.submit(Task::new(INC).in_out(&t))?.id;
            // Dispatched when `first` completes, from that completion.
            o.submit(
                Task::new(INC)
                    .in_out(&t)
                    .after(first)
                    .predicate(panicking_predicate),
            )?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("predicate exploded") && e.contains("KERNEL_FAILED"),
        "{e}"
    );
    // The next run completes on the same worker, and the buffer is usable.
    w.run_fn("after", args(), &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[1024])?;
        o.submit(Task::new(INC).in_out(&t))?;
        Ok(())
    })
    .unwrap();
    let v = buf.read::<f32>().unwrap();
    assert_eq!(
        v[0], 2.0,
        "the first INC ran, the predicated one did not, then one more"
    );
}

/// The CPU platform reporting `available` bytes of host memory.
struct Limited {
    cpu: CpuPlatform,
    available: u64,
}

// SAFETY: allocation and threads come from the CPU platform; only the memory figure differs.
unsafe impl Platform for Limited {
    fn info(&self) -> PlatformInfo {
        self.cpu.info()
    }
    fn alloc(&self, bytes: usize) -> Result<Box<dyn Memory>, PlatformError> {
        self.cpu.alloc(bytes)
    }
    fn memory_available(&self) -> Option<(u64, String)> {
        Some((self.available, "the test's limit".into()))
    }
    fn spawn_core(
        &self,
        index: usize,
        body: Box<dyn FnOnce() + Send>,
    ) -> Result<JoinHandle<()>, PlatformError> {
        self.cpu.spawn_core(index, body)
    }
}

/// Ring sizes whose slot and entry arrays the machine cannot hold are refused with the bytes
/// before anything is built (2^30 slots aborted the process on a failed allocation), and the
/// worker then runs with sizes that fit.
#[test]
fn rings_larger_than_the_memory_available_are_refused_and_the_worker_goes_on() {
    let w = Worker::new(
        Limited {
            cpu: CpuPlatform::new(),
            available: 1 << 20,
        },
        WorkerConfig {
            cores: Some(2),
            ..WorkerConfig::default()
        },
    )
    .unwrap();
    w.register_kernel(KernelSpec::new(INC, "inc", EngineClass::Vector, |ctx| {
        for v in ctx.write::<f32>(0)?.iter_mut() {
            *v += 1.0;
        }
        Ok(())
    }))
    .unwrap();
    let buf = w.buffer_from(&[1.0f32; 64]).unwrap();
    let run = |cfg: &CallConfig| {
        let args = RunArgs {
            buffers: vec![buf.clone()],
            scalars: vec![],
        };
        w.run_fn("inc", args, cfg, |o, args| {
            let t = o.bind(&args.buffers[0], DType::F32, &[64])?;
            o.submit(Task::new(INC).in_out(&t))?;
            Ok(())
        })
    };
    // The default rings: 4 × 16384 slots and entries, ~6.8 MB, over the 1 MiB limit.
    match run(&CallConfig::default()) {
        Err(Error::Config(e)) => {
            assert_eq!(e.field, "CallConfig.runtime_env");
            assert!(
                e.reason.contains("the test's limit leaves 1048576")
                    && e.reason.contains("ring_task_window"),
                "{e}"
            );
        }
        other => panic!("expected the rings refused, got {other:?}"),
    }
    assert_eq!(buf.read::<f32>().unwrap(), vec![1.0; 64]);
    let small = CallConfig {
        runtime_env: RuntimeEnv {
            ring_task_window: RingValue::All(64),
            ring_dep_pool: RingValue::All(64),
            ..RuntimeEnv::default()
        },
        ..CallConfig::default()
    };
    run(&small).unwrap();
    assert_eq!(buf.read::<f32>().unwrap(), vec![2.0; 64]);
}
