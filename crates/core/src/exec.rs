//! Executing one run on the orchestrator thread: bind, graph build (config, arena, reset),
//! launch, orchestration, drain, validate, and the [`RunReport`].
//!
//! What a run is ([`Job`]: an orchestration function, its [`RunArgs`], a config and where the
//! result lands) and what executing it needs of the worker ([`ExecEnv`]) are defined here, so
//! the executor sits below the worker and never reaches it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_utils::sync::Parker;

use crate::buffer::Buffer;
use crate::clock::now_ns;
use crate::config::CallConfig;
use crate::config::{OrchMode, RING_COUNT};
use crate::diag::{Diagnostics, Fnv};
use crate::error::{Error, ErrorCode, RunError};
use crate::graph::{Capture, CaptureEnd, CapturedGraph, GraphMode, GraphShape};
use crate::kernel::Registry;
use crate::orch::Orchestrator;
use crate::platform::{Platform, ThreadCounters};
use crate::pool::{CorePool, JobResult};
use crate::report::{Interval, RingOccupancy, RunCounters, RunReport, TaskSlotTiming};
use crate::ring::RingCursor;
use crate::run::{Arena, BoundBuffers, GRACE, RunParts, RunShared, SlotTiming};
use crate::tensormap::TensorMap;
use crate::trace::{RingStats, RingUsage, SwimlaneRecords, Usage};

/// An orchestration function: submits the run's tasks.
pub type OrchFn = Arc<dyn Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync>;

/// Arguments of a run: buffers (bound for the run's duration) and scalars.
#[derive(Clone, Debug, Default)]
pub struct RunArgs {
    /// Buffers the orchestration may view (`Orchestrator::bind` with one of these is free).
    pub buffers: Vec<Buffer>,
    /// Scalars.
    pub scalars: Vec<u64>,
}

/// A queued run.
pub(crate) struct Job {
    pub(crate) name: String,
    pub(crate) f: OrchFn,
    pub(crate) args: RunArgs,
    pub(crate) cfg: CallConfig,
    pub(crate) result: Arc<JobResult>,
    pub(crate) graph: JobGraph,
}

/// Whether a run records its graph or replays one.
pub(crate) enum JobGraph {
    /// An ordinary run.
    Plain,
    /// Record the graph under `shape`; a successful run leaves it in `out`.
    Capture {
        shape: GraphShape,
        out: Arc<Mutex<Option<CapturedGraph>>>,
    },
    /// `f` replays this graph.
    Replay(CapturedGraph),
}

/// What executing a run needs of its worker: the platform (for arenas), the core pool (to
/// register the run and replace stuck cores), the kernels, the cached arena and the warnings
/// every report carries.
pub(crate) struct ExecEnv<'a> {
    pub(crate) platform: &'a dyn Platform,
    /// Whether tensor memory is host memory.
    pub(crate) host_memory: bool,
    pub(crate) core_pool: &'a Arc<CorePool>,
    pub(crate) cores: usize,
    pub(crate) registry: Arc<Registry>,
    pub(crate) arena: &'a Mutex<Option<Arc<Arena>>>,
    pub(crate) warnings: &'a [String],
    /// The worker's process-unique id (captured graphs replay only on their worker).
    pub(crate) worker_id: u64,
}

/// Per-process invocation counter.
static INVOCATIONS: AtomicU64 = AtomicU64::new(0);

fn iv(start_ns: u64, end_ns: u64) -> Interval {
    Interval {
        start_ns,
        end_ns: end_ns.max(start_ns),
    }
}

pub(crate) fn execute(inner: &ExecEnv<'_>, job: Job) -> Result<RunReport, Error> {
    let host0 = now_ns();
    // bind: the run's buffers become unavailable to host copies until the run releases them.
    let bound = BoundBuffers::default();
    let mut seen = Vec::new();
    for b in &job.args.buffers {
        if seen.contains(&b.id()) {
            continue;
        }
        if !b.bind() {
            return Err(RunError::new(
                ErrorCode::InvalidArgs,
                format!("buffer #{} is bound to another run in flight", b.id().0),
                "wait for that run before passing the buffer again",
            )
            .into());
        }
        seen.push(b.id());
        bound.push(b.clone());
    }
    let bind1 = now_ns();
    run_bound(inner, &job, host0, bind1, bound)
}

fn run_bound(
    inner: &ExecEnv<'_>,
    job: &Job,
    host0: u64,
    bind1: u64,
    bound: BoundBuffers,
) -> Result<RunReport, Error> {
    let runner0 = bind1;
    let cv0 = now_ns();
    let valid = job.cfg.validate()?;
    let cv1 = now_ns();
    // The run's cores: the first `n` of the worker's.
    let n = job.cfg.run_cores(inner.cores)?;
    let arena = take_arena(inner, valid.rings)?;
    let aw1 = now_ns();
    let serial = job.cfg.mode == OrchMode::Serial;
    let parker = Parker::new();
    let epoch = crate::tensor::fresh_run_epoch();
    let run = Arc::new(RunShared::new(RunParts {
        epoch,
        arena: arena.clone(),
        wake: inner.core_pool.wake.clone(),
        registry: inner.registry.clone(),
        bound,
        orch_unparker: parker.unparker().clone(),
        cores: n,
        serial,
        swimlane: job.cfg.swimlane,
        swimlane_capacity: job.cfg.swimlane_capacity,
        host_memory: inner.host_memory,
    }));
    let parked = arena
        .parked_orchestrator
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    let (cursors, map) = match parked {
        Some((mut cursors, mut map)) => {
            cursors.iter_mut().for_each(RingCursor::reset);
            map.reset(job.cfg.tensormap_capacity);
            (cursors, map)
        }
        None => {
            let cursors = (0..RING_COUNT)
                .map(|r| {
                    RingCursor::new(
                        r as u8,
                        valid.rings.window[r],
                        valid.rings.heap[r],
                        arena.heaps[r].addr(),
                        valid.rings.dep_pool[r],
                    )
                })
                .collect();
            (cursors, TensorMap::new(job.cfg.tensormap_capacity))
        }
    };
    // A replay records no dependency graph (it reports the captured one); a capture needs the
    // topology fingerprint whatever the diagnostics switches say.
    let replaying = matches!(job.graph, JobGraph::Replay(_));
    let mut diag = Diagnostics::new(
        job.cfg.dep_gen && !replaying,
        job.cfg.swimlane,
        job.cfg.ring_stats,
    );
    let capturing = matches!(job.graph, JobGraph::Capture { .. });
    diag.fingerprint_on |= capturing;
    let mut orch = Orchestrator::new(run.clone(), cursors, map, epoch, serial, diag, parker);
    for b in &job.args.buffers {
        orch.adopt_bound(b.clone());
    }
    if capturing {
        orch.capture = Some(Box::new(Capture::new(&job.args.buffers)));
        orch.map.keep_completed();
    }
    let reset1 = now_ns();

    // The run's cores' scheduler counters around the run, when it records a swimlane (reading
    // them costs a few microseconds per core, outside the run's spans).
    let counters = (job.cfg.swimlane > 0)
        .then(|| inner.core_pool.thread_counters())
        .flatten()
        .map(|mut c| {
            c.truncate(n);
            c
        });
    let waits_before = counters.as_deref().and_then(waiting_ns);
    // Launch: cores join the run, the watchdog starts watching it.
    let launch = now_ns();
    run.sched_start.store(launch, Ordering::Release);
    let registration = inner.core_pool.register(run.clone(), job.result.clone());

    let orch0 = now_ns();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (job.f)(&mut orch, &job.args)
    }))
    .unwrap_or_else(|p| {
        Err(RunError::new(
            ErrorCode::ExplicitOrchFatal,
            format!(
                "the orchestration function panicked: {}",
                crate::sched::panic_message(&*p)
            ),
            "fix the orchestration function; it should return an error instead of panicking",
        ))
    });
    let orch1 = now_ns();
    finish_orchestration(&mut orch, outcome);
    if serial {
        run.dispatch_open.store(true, Ordering::Release);
        inner.core_pool.wake.sleep.notify_all();
    }
    // The watchdog fails the run (and so ends this wait) if it stops making progress.
    while !run.wait_done(Duration::from_millis(200)) {}
    let done = now_ns();
    let runner1 = done;
    let waits_after = counters.as_deref().and_then(waiting_ns);

    // Validate: stop the cores, collect errors and diagnostics.
    run.finished.store(true, Ordering::SeqCst);
    inner.core_pool.wake.sleep.notify_all();
    // When every task completed, no kernel runs any more and the bound buffers can go at once
    // (waiting only for the swimlane records a core pushes just after its last completion).
    // Otherwise a core may still be inside a kernel that ignores cancellation: the buffers stay
    // bound until every core has left, and a core still inside after the grace period is
    // handed to a new thread while the old one keeps the run (and so the buffers) alive.
    let quiet = run.outstanding.load(Ordering::Acquire) == 0;
    let all_left = if quiet {
        // No task is outstanding, so no kernel can touch a buffer: release them whatever the
        // cores are doing (a loaded host may keep one from leaving for a while, and a caller
        // reading its output right after `Ok` must not find it still bound). Only the
        // swimlane records are worth waiting for; a core slow to leave is not stuck.
        if job.cfg.swimlane > 0 {
            let _ = run.wait_cores_left(GRACE);
        }
        true
    } else {
        run.wait_cores_left(GRACE)
    };
    if all_left {
        run.bound.release();
    } else {
        inner.core_pool.retire_stuck_cores(&run);
    }
    drop(registration);
    if let Some(e) = run.fatal.get().cloned() {
        park_orchestrator(&arena, orch);
        drop(run);
        *inner.arena.lock().unwrap_or_else(|p| p.into_inner()) = Some(arena);
        return Err(e.into());
    }
    let sched_end = run.sched_end.load(Ordering::Acquire).max(launch);
    let mut report = RunReport {
        inv: INVOCATIONS.fetch_add(1, Ordering::Relaxed),
        callable: callable_hash(&job.name, &job.args),
        orchestration: job.name.clone(),
        label: job.cfg.label.clone(),
        warmup: job.cfg.warmup,
        bind: iv(host0, bind1),
        bind_args: iv(host0, bind1),
        runner: iv(runner0, runner1),
        device_wall: iv(cv0, sched_end.max(orch1)),
        graph_build: iv(cv0, reset1),
        config_validate: iv(cv0, cv1),
        arena_wire: iv(cv1, aw1),
        reset: iv(aw1, reset1),
        orch: iv(orch0, orch1),
        sched: iv(launch, sched_end),
        post_orch: iv(orch1, sched_end.max(orch1)),
        task_slots: slot_timings(&run.timing_slots),
        counters: RunCounters {
            tasks: run.submitted.load(Ordering::Relaxed),
            blocks: run
                .cores
                .iter()
                .map(|c| c.blocks.load(Ordering::Relaxed))
                .sum(),
            edges: run.edges.load(Ordering::Relaxed),
            ring_waits: orch.ring_waits,
            skipped: run.skipped.load(Ordering::Relaxed),
        },
        cores: n as u32,
        overlapped: !serial,
        warnings: inner.warnings.to_vec(),
        descheduled_ns: waits_before.zip(waits_after).map(|(a, b)| {
            a.iter()
                .zip(&b)
                .map(|(a, b)| b.saturating_sub(*a))
                .collect()
        }),
        ..RunReport::default()
    };
    collect_diagnostics(&run, &mut orch, &job.cfg, &mut report);
    match &job.graph {
        JobGraph::Plain => {}
        JobGraph::Capture { shape, out } => {
            let fingerprint = orch.diag.fingerprint.finish();
            let recorded = orch.capture.take().map(|c| {
                c.finish(CaptureEnd {
                    name: job.name.clone(),
                    fingerprint,
                    shape: shape.clone(),
                    worker: inner.worker_id,
                    rings: valid.rings,
                    cores: n,
                    run_args: job.args.buffers.len(),
                    scalars: job.args.scalars.clone(),
                    deps: report.deps.clone(),
                })
            });
            match recorded {
                Some(Ok(g)) => {
                    report.graph = GraphMode::Captured {
                        fingerprint: g.fingerprint_hex(),
                    };
                    *out.lock().unwrap_or_else(|p| p.into_inner()) = Some(g);
                }
                Some(Err(why)) => {
                    park_orchestrator(&arena, orch);
                    drop(run);
                    *inner.arena.lock().unwrap_or_else(|p| p.into_inner()) = Some(arena);
                    return Err(RunError::new(
                        ErrorCode::InvalidArgs,
                        format!("the run of {:?} cannot be captured: {why}", job.name),
                        "submit only tasks over buffers the run binds",
                    )
                    .into());
                }
                None => {}
            }
        }
        JobGraph::Replay(g) => {
            report.graph = GraphMode::Replayed {
                fingerprint: g.fingerprint_hex(),
            };
            if job.cfg.dep_gen {
                report.deps = g.inner.deps.clone();
            }
            if let Some(s) = report.swimlane.as_mut() {
                s.fingerprint = g.fingerprint_hex();
            }
        }
    }
    for c in orch.cursors.iter_mut() {
        c.reclaim(&arena.rings.rings[c.ring as usize]);
        report.ring_final.push(RingOccupancy {
            ring: c.ring,
            tasks: c.next_local as u64,
            window: c.in_flight() as u64,
            heap: c.heap_used(),
            dep_pool: c.dep_used(),
        });
    }
    orch.map.sweep(&arena.rings);
    report.tensormap_final = orch.map.len();
    park_orchestrator(&arena, orch);
    let validate1 = now_ns();
    report.validate = iv(runner1, validate1);
    report.host_wall = iv(host0, validate1);
    drop(run);
    *inner.arena.lock().unwrap_or_else(|p| p.into_inner()) = Some(arena);
    Ok(report)
}

/// Each thread's time waiting for a CPU so far; `None` if any cannot be read.
fn waiting_ns(counters: &[Arc<dyn ThreadCounters>]) -> Option<Vec<u64>> {
    counters
        .iter()
        .map(|c| c.read().map(|t| t.waiting_ns))
        .collect()
}

/// Closes what the orchestration left open and drops the orchestration's guard.
fn finish_orchestration(orch: &mut Orchestrator, outcome: Result<(), RunError>) {
    if let Err(e) = outcome {
        // An error the orchestration built itself (not yet latched) becomes the run's error.
        orch.run.fail(e);
    }
    if orch.scopes.len() > 1 && orch.run.fatal.get().is_none() {
        let f = orch.scopes.last().expect("scope");
        let e = RunError::new(
            ErrorCode::InvalidArgs,
            format!(
                "the scope opened at {}:{} was never closed",
                f.site.file(),
                f.site.line()
            ),
            "call end_scope for every begin_scope, or use Orchestrator::scope",
        );
        orch.run.fail(e);
    }
    while orch.scopes.len() > 1 {
        orch.close_innermost();
    }
    orch.close_innermost();
    orch.run.orch_done.store(true, Ordering::Release);
    orch.run.finish_one();
}

fn park_orchestrator(arena: &Arena, orch: Orchestrator) {
    let (cursors, map) = orch.into_state();
    *arena
        .parked_orchestrator
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = Some((cursors, map));
}

fn take_arena(inner: &ExecEnv<'_>, sizes: crate::config::RingSizes) -> Result<Arc<Arena>, Error> {
    let cached = inner.arena.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(a) = cached.filter(|a| a.sizes == sizes) {
        // Cores drop their handle on the previous run just after leaving it; give them a moment
        // rather than building a new arena. A core stuck in a kernel of a failed run keeps its
        // handle for good: then the arena is left to it.
        let deadline = std::time::Instant::now() + Duration::from_millis(50);
        while Arc::strong_count(&a) > 1 && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        if Arc::strong_count(&a) == 1 {
            return Ok(a);
        }
    }
    // The slot and entry arrays are built at once (a 2^30-slot window is ~80 GB per ring): a
    // size the machine cannot hold is refused with the numbers instead of aborting the
    // process on a failed allocation.
    let need = sizes.array_bytes();
    if let Some((available, source)) = inner.platform.memory_available()
        && need > available
    {
        return Err(crate::ConfigError {
            field: "CallConfig.runtime_env".into(),
            value: format!(
                "task windows {:?}, dependency pools {:?}",
                sizes.window, sizes.dep_pool
            ),
            reason: format!(
                "the rings' slots and dependency entries take {need} bytes and {source} leaves {available}: lower CallConfig.runtime_env.ring_task_window or CallConfig.runtime_env.ring_dep_pool"
            ),
        }
        .into());
    }
    Ok(Arc::new(Arena::new(sizes, inner.platform)?))
}

fn slot_timings(slots: &[SlotTiming]) -> Vec<TaskSlotTiming> {
    slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.tasks.load(Ordering::Relaxed) > 0)
        .map(|(i, s)| TaskSlotTiming {
            slot: i as u8,
            tasks: s.tasks.load(Ordering::Relaxed),
            span: iv(
                s.first_dispatch.load(Ordering::Relaxed),
                s.last_finish.load(Ordering::Relaxed),
            ),
        })
        .collect()
}

/// The trace's `callable`: what ran, as the same value in every process and run — the
/// orchestration's name, the sizes of its buffers and its `RunArgs` scalars (not the buffers'
/// contents, which differ from step to step of the same workload).
fn callable_hash(name: &str, args: &crate::RunArgs) -> u64 {
    let mut h = Fnv::default();
    h.bytes(name.as_bytes());
    h.u64(args.buffers.len() as u64);
    for b in &args.buffers {
        h.u64(b.len() as u64);
    }
    h.u64(args.scalars.len() as u64);
    for &s in &args.scalars {
        h.u64(s);
    }
    h.finish()
}

fn collect_diagnostics(
    run: &RunShared,
    orch: &mut Orchestrator,
    cfg: &crate::CallConfig,
    report: &mut RunReport,
) {
    let fingerprint = orch.diag.fingerprint_hex();
    if cfg.swimlane > 0 {
        let mut s = SwimlaneRecords {
            level: cfg.swimlane,
            fingerprint: fingerprint.clone(),
            cores: run.cores.len() as u32,
            dropped: run.dropped.load(Ordering::Relaxed) + orch.diag.submits_dropped,
            tasks_dropped: run.tasks_dropped.load(Ordering::Relaxed),
            ..SwimlaneRecords::default()
        };
        for c in run.cores.iter() {
            s.tasks
                .append(&mut c.records.lock().unwrap_or_else(|p| p.into_inner()));
            s.phases
                .append(&mut c.phases.lock().unwrap_or_else(|p| p.into_inner()));
            s.queue_depth
                .append(&mut c.depth.lock().unwrap_or_else(|p| p.into_inner()));
        }
        s.tasks.sort_by_key(|r| (r.start, r.core));
        s.phases.sort_by_key(|r| (r.start, r.core));
        s.queue_depth.sort_by_key(|r| r.ts);
        s.submits = std::mem::take(&mut orch.diag.submits);
        for r in &s.tasks {
            if let Some(k) = run.registry.get(crate::kernel::KernelId(r.func)) {
                s.kernels.entry(r.func).or_insert_with(|| k.name.clone());
            }
        }
        report.swimlane = Some(s);
    }
    if cfg.dep_gen {
        report.deps = Some(orch.diag.take_graph());
    }
    if cfg.ring_stats {
        let rings = orch
            .cursors
            .iter()
            .map(|c| RingUsage {
                ring: c.ring,
                task_window: Usage {
                    high_water: c.hw_window,
                    capacity: c.window as u64 - 1,
                },
                heap: Usage {
                    high_water: c.hw_heap,
                    capacity: c.heap_cap,
                },
                dep_pool: Usage {
                    high_water: c.hw_dep,
                    capacity: c.dep_cap,
                },
            })
            .collect();
        let mut scopes: Vec<_> = orch.diag.sites.drain().map(|(_, v)| v).collect();
        scopes.sort_by(|a, b| a.site.cmp(&b.site));
        report.ring_stats = Some(RingStats {
            rings,
            tensormap: Usage {
                high_water: orch.map.high_water(),
                capacity: orch.map.capacity(),
            },
            scopes,
        });
    }
}
