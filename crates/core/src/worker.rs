//! The [`Worker`]: owns a platform's cores, the registered kernels and orchestrations, and runs
//! orchestrations one at a time (`run` blocks; `submit` returns a [`RunHandle`]).
//!
//! Threads of a worker: one per core (started through the platform and replaced by the
//! [`CorePool`]), one orchestrator thread that executes queued runs (`exec`), and one watchdog
//! that enforces the timeouts (`watchdog`). The worker sits on top: it hands the executor the
//! parts of itself a run needs ([`ExecEnv`]) and the watchdog a way to replace the orchestrator
//! thread, so neither of them imports the worker.
//!
//! Which run is current has one owner: the [`Registration`] the executing orchestrator thread
//! holds (cores join the registered run, the watchdog watches it). When a run fails, its
//! orchestrator thread waits (at most the grace period) for the cores to leave the run, hands
//! cores still stuck in a kernel to new threads, and releases the run's buffers only once no
//! core can touch them. If the orchestration function itself is stuck, the watchdog delivers
//! the error, unregisters the run and gives the job queue to a new orchestrator thread; the old
//! one, when it returns, cannot unregister the run that replaced it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::buffer::Buffer;
use crate::config::{CallConfig, Timeouts};
use crate::error::{ConfigError, Error, ErrorCode, PlatformError, RunError};
use crate::exec::{ExecEnv, Job, JobGraph, OrchFn, RunArgs};
use crate::graph::{CapturedGraph, GraphShape};
use crate::kernel::{KernelSpec, Registry};
use crate::orch::Orchestrator;
use crate::platform::{Platform, PlatformInfo};
use crate::pool::{CorePool, JobResult, RunHandle};
use crate::report::RunReport;
use crate::run::Arena;
use crate::task::EngineClass;
use crate::tensor::BufferId;

/// How to build a worker.
#[derive(Clone, Debug, Default)]
pub struct WorkerConfig {
    /// Number of cores (default: the platform's default, e.g. available parallelism).
    pub cores: Option<usize>,
    /// Timeouts; `None` reads the defaults and the environment overrides.
    pub timeouts: Option<Timeouts>,
    /// How long a core with nothing to do inside a run spins before it parks (at most
    /// [`crate::config::MAX_IDLE_SPIN`]; zero parks after the first few checks). `None` reads
    /// [`crate::config::ENV_IDLE_SPIN_US`], else [`crate::config::DEFAULT_IDLE_SPIN`]. Spinning
    /// saves the wake-up at a phase end; lower it where several processes share the CPUs.
    pub idle_spin: Option<Duration>,
}

/// What the worker's handle, its orchestrator thread and its watchdog share: the platform, the
/// core pool, registered kernels and orchestrations, the job queue and the cached arena.
pub(crate) struct WorkerShared {
    /// Process-unique id (a captured graph replays only on the worker that captured it).
    pub(crate) id: u64,
    pub(crate) platform: Arc<dyn Platform>,
    pub(crate) info: PlatformInfo,
    pub(crate) core_pool: Arc<CorePool>,
    pub(crate) n_cores: usize,
    pub(crate) registry: Mutex<Arc<Registry>>,
    orchestrations: Mutex<HashMap<String, OrchFn>>,
    jobs: Mutex<VecDeque<Job>>,
    jobs_cv: Condvar,
    pub(crate) arena: Mutex<Option<Arc<Arena>>>,
    pub(crate) timeouts: Timeouts,
    pub(crate) warnings: Vec<String>,
    pub(crate) closed: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    orch_gen: AtomicU64,
    /// The current orchestrator thread holds a job it took from the queue (set and cleared
    /// under the `jobs` lock, so `shutdown` never sees a job in neither place: popped but not
    /// yet registered as the current run).
    orch_busy: AtomicBool,
}

/// A worker: cores of one platform, ready to run orchestrations.
pub struct Worker {
    inner: Arc<WorkerShared>,
}

/// Most cores (scheduler threads) a worker takes.
pub const MAX_CORES: usize = 1024;

impl Worker {
    /// Starts a worker on `platform`.
    pub fn new(platform: impl Platform, config: WorkerConfig) -> Result<Worker, Error> {
        let platform: Arc<dyn Platform> = Arc::new(platform);
        let info = platform.info();
        let n_cores = config.cores.unwrap_or(info.default_cores);
        if n_cores == 0 || n_cores > MAX_CORES {
            return Err(ConfigError {
                field: "WorkerConfig.cores".into(),
                value: n_cores.to_string(),
                reason: format!("must be between 1 and {MAX_CORES}"),
            }
            .into());
        }
        let (timeouts, warnings) = match config.timeouts {
            Some(t) => {
                if let Some(rule) = t.broken_rule() {
                    return Err(ConfigError {
                        field: "WorkerConfig.timeouts".into(),
                        value: format!("{t:?}"),
                        reason: rule.into(),
                    }
                    .into());
                }
                (t, Vec::new())
            }
            None => Timeouts::from_env(),
        };
        let mut warnings = warnings;
        warnings.extend(crate::config::legacy_env_warnings(&|k| {
            std::env::var(k).ok()
        }));
        let idle_spin = match config.idle_spin {
            Some(d) if d > crate::config::MAX_IDLE_SPIN => {
                return Err(ConfigError {
                    field: "WorkerConfig.idle_spin".into(),
                    value: format!("{d:?}"),
                    reason: format!(
                        "must be at most {:?} (a core spinning longer is a busy loop)",
                        crate::config::MAX_IDLE_SPIN
                    ),
                }
                .into());
            }
            Some(d) => d,
            None => {
                let (d, warning) =
                    crate::config::idle_spin_from_env_with(&|k| std::env::var(k).ok());
                warnings.extend(warning);
                d
            }
        };
        let core_pool = CorePool::start(platform.clone(), n_cores, idle_spin)?;
        static NEXT_WORKER_ID: AtomicU64 = AtomicU64::new(1);
        let inner = Arc::new(WorkerShared {
            id: NEXT_WORKER_ID.fetch_add(1, Ordering::Relaxed),
            platform,
            info,
            core_pool,
            n_cores,
            registry: Mutex::new(Arc::new(Registry::default())),
            orchestrations: Mutex::new(HashMap::new()),
            jobs: Mutex::new(VecDeque::new()),
            jobs_cv: Condvar::new(),
            arena: Mutex::new(None),
            timeouts,
            warnings,
            closed: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            orch_gen: AtomicU64::new(0),
            orch_busy: AtomicBool::new(false),
        });
        inner.spawn_orchestrator(0)?;
        let w = inner.clone();
        let h = std::thread::Builder::new()
            .name("simpler-watchdog".into())
            .spawn(move || {
                // The watchdog sees the pool and the timeouts; taking over from a stuck
                // orchestrator thread is the worker's business, handed to it as a callback.
                let take_over = || {
                    let _ = w.replace_orchestrator();
                };
                crate::watchdog::run(&w.core_pool, w.timeouts, &take_over)
            })
            .map_err(|e| PlatformError {
                platform: "host".into(),
                what: format!("cannot start the watchdog thread: {e}"),
            })?;
        inner
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(h);
        Ok(Worker { inner })
    }

    /// Number of cores.
    pub fn cores(&self) -> usize {
        self.inner.n_cores
    }

    /// Cores that can run tasks of `class` (on the CPU platform every core runs every class).
    pub fn cores_for(&self, _class: EngineClass) -> usize {
        self.inner.n_cores
    }

    /// Bytes the platform can still allocate now and where the figure comes from (see
    /// [`Platform::memory_available`]).
    pub fn memory_available(&self) -> Option<(u64, String)> {
        self.inner.platform.memory_available()
    }

    /// The platform's description.
    pub fn platform(&self) -> &PlatformInfo {
        &self.inner.info
    }

    /// Timeouts in force.
    pub fn timeouts(&self) -> Timeouts {
        self.inner.timeouts
    }

    /// How long an idle core spins inside a run before it parks (see `WorkerConfig.idle_spin`).
    pub fn idle_spin(&self) -> Duration {
        self.inner.core_pool.wake.idle_spin
    }

    /// Warnings raised while configuring the worker (ignored environment overrides).
    pub fn warnings(&self) -> &[String] {
        &self.inner.warnings
    }

    /// Registers a kernel under its id.
    pub fn register_kernel(&self, spec: KernelSpec) -> Result<(), Error> {
        let mut reg = self
            .inner
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut next = (**reg).clone();
        next.insert(spec).map_err(Error::Registry)?;
        *reg = Arc::new(next);
        Ok(())
    }

    /// Registers an orchestration function under a name.
    pub fn register_orchestration(
        &self,
        name: impl Into<String>,
        f: impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync + 'static,
    ) -> Result<(), Error> {
        let name = name.into();
        let mut m = self
            .inner
            .orchestrations
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if m.contains_key(&name) {
            return Err(Error::Registry(format!(
                "an orchestration named {name:?} is already registered"
            )));
        }
        m.insert(name, Arc::new(f));
        Ok(())
    }

    /// Allocates a zeroed buffer of `bytes` on the platform.
    pub fn alloc(&self, bytes: usize) -> Result<Buffer, Error> {
        let mem = self.inner.platform.alloc(bytes)?;
        Ok(Buffer::new(BufferId::fresh(), mem))
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn buffer_from<T: crate::Element>(&self, data: &[T]) -> Result<Buffer, Error> {
        let b = self.alloc(std::mem::size_of_val(data))?;
        b.write(data)?;
        Ok(b)
    }

    /// Queues a run of the registered orchestration `name`.
    pub fn submit(&self, name: &str, args: RunArgs, cfg: &CallConfig) -> Result<RunHandle, Error> {
        let f = {
            let m = self
                .inner
                .orchestrations
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            match m.get(name) {
                Some(f) => f.clone(),
                None => {
                    let mut known: Vec<&str> = m.keys().map(String::as_str).collect();
                    known.sort();
                    return Err(Error::UnknownOrchestration {
                        name: name.into(),
                        known: known.join(", "),
                    });
                }
            }
        };
        self.enqueue(name.to_string(), f, args, cfg, JobGraph::Plain)
    }

    /// Queues a run of an ad-hoc orchestration function.
    pub fn submit_fn(
        &self,
        name: &str,
        args: RunArgs,
        cfg: &CallConfig,
        f: impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync + 'static,
    ) -> Result<RunHandle, Error> {
        self.enqueue(name.to_string(), Arc::new(f), args, cfg, JobGraph::Plain)
    }

    /// Runs an ad-hoc orchestration function, waits for it and returns its graph captured
    /// under `shape` for [`Worker::replay`] (see [`crate::graph`]). The run fails (nothing is
    /// captured) if it fails, or if the orchestration exchanges data with the host mid-run.
    pub fn capture_fn(
        &self,
        name: &str,
        args: RunArgs,
        cfg: &CallConfig,
        shape: GraphShape,
        f: impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync + 'static,
    ) -> Result<(RunReport, CapturedGraph), Error> {
        let out = Arc::new(Mutex::new(None));
        let graph = JobGraph::Capture {
            shape,
            out: out.clone(),
        };
        let report = self
            .enqueue(name.to_string(), Arc::new(f), args, cfg, graph)?
            .wait()?;
        let captured = out.lock().unwrap_or_else(|p| p.into_inner()).take();
        match captured {
            Some(g) => Ok((report, g)),
            None => Err(Error::Internal(format!(
                "the capture of {name:?} succeeded without a graph"
            ))),
        }
    }

    /// Replays `graph` (captured on this worker) with `args` and waits for it: the recorded
    /// tasks run again on the bytes the buffers hold now, without the orchestration function
    /// or the dependency map. Refused before anything runs, with an error naming what differs,
    /// when `shape`, a `RunArgs` buffer or scalar, the ring sizes, the run's core count or the
    /// worker differ from the capture (see [`crate::graph`]).
    pub fn replay(
        &self,
        graph: &CapturedGraph,
        args: RunArgs,
        cfg: &CallConfig,
        shape: &GraphShape,
    ) -> Result<RunReport, Error> {
        let valid = cfg.validate()?;
        let cores = cfg.run_cores(self.inner.n_cores)?;
        graph.check_replay(
            self.inner.id,
            &args,
            &valid.rings,
            cores,
            cfg.dep_gen,
            shape,
        )?;
        let g = graph.clone();
        let f: OrchFn = Arc::new(move |o: &mut Orchestrator, _: &RunArgs| o.replay(&g));
        let name = graph.name().to_string();
        self.enqueue(name, f, args, cfg, JobGraph::Replay(graph.clone()))?
            .wait()
    }

    fn enqueue(
        &self,
        name: String,
        f: OrchFn,
        args: RunArgs,
        cfg: &CallConfig,
        graph: JobGraph,
    ) -> Result<RunHandle, Error> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        cfg.validate()?;
        let result = JobResult::new();
        let job = Job {
            name,
            f,
            args,
            cfg: cfg.clone(),
            result: result.clone(),
            graph,
        };
        self.inner
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(job);
        self.inner.jobs_cv.notify_all();
        Ok(RunHandle { result })
    }

    /// Runs the registered orchestration `name` and waits for it.
    pub fn run(&self, name: &str, args: RunArgs, cfg: &CallConfig) -> Result<RunReport, Error> {
        self.submit(name, args, cfg)?.wait()
    }

    /// Runs an ad-hoc orchestration function and waits for it.
    pub fn run_fn(
        &self,
        name: &str,
        args: RunArgs,
        cfg: &CallConfig,
        f: impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync + 'static,
    ) -> Result<RunReport, Error> {
        self.submit_fn(name, args, cfg, f)?.wait()
    }

    /// Finishes queued runs, stops every thread and releases the platform's memory.
    pub fn close(self) -> Result<(), Error> {
        self.inner.shutdown();
        Ok(())
    }
}

/// What of a call's configuration a kept graph must match: ring sizes, `dep_gen`, cores.
type CacheEnv = (crate::config::RuntimeEnv, bool, Option<usize>);

/// The graph a caller that runs the same step again and again keeps between steps: a run
/// replays it while the step's [`GraphShape`], its buffers and the call's ring sizes, core
/// count and `dep_gen` match the capture, and otherwise runs the orchestration, captured, in its place
/// (the old graph dropped first, so its buffers are not held past their last use). Qwen3's
/// decode steps and DeepSeek-V4's attention steps use it.
///
/// Verifying ([`GraphCache::set_verify`]) checks the caller's shapes instead of trusting them.
#[derive(Debug, Default)]
pub struct GraphCache {
    kept: Option<(CapturedGraph, CacheEnv)>,
    verify: bool,
}

impl GraphCache {
    /// Runs one step: replayed when the kept graph matches (see the type), else orchestrated
    /// by `f` and captured under `shape`.
    ///
    /// # Errors
    /// The run's or the capture's errors; a replay the worker refuses (another worker's
    /// graph, say) is returned, not retried.
    pub fn run(
        &mut self,
        worker: &Worker,
        name: &str,
        args: RunArgs,
        cfg: &CallConfig,
        shape: GraphShape,
        f: impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync + 'static,
    ) -> Result<RunReport, Error> {
        let env = (cfg.runtime_env, cfg.dep_gen, cfg.cores);
        if let Some((graph, kept_env)) = &self.kept {
            let same_buffers = graph.buffers().len() >= args.buffers.len()
                && graph
                    .buffers()
                    .iter()
                    .zip(&args.buffers)
                    .all(|(a, b)| a.id() == b.id());
            if graph.shape() == &shape && *kept_env == env && same_buffers {
                if !self.verify {
                    return worker.replay(graph, args, cfg, &shape);
                }
                // The step runs orchestrated; what a replay would have submitted must be
                // what the orchestration just did.
                let (report, fresh) = worker.capture_fn(name, args, cfg, shape, f)?;
                if let Some(d) = graph.replay_difference(&fresh) {
                    let error = RunError::new(
                        ErrorCode::InvalidArgs,
                        format!(
                            "replay check of {name:?}: the step's GraphShape equals the captured \
                             one, but a replay would have differed from this step's \
                             orchestration: {d} (the step itself ran orchestrated)"
                        ),
                        "add what shapes this difference to the GraphShape the caller builds",
                    );
                    self.kept = None;
                    return Err(error.into());
                }
                self.kept = Some((fresh, env));
                return Ok(report);
            }
        }
        self.kept = None;
        let (report, graph) = worker.capture_fn(name, args, cfg, shape, f)?;
        self.kept = Some((graph, env));
        Ok(report)
    }

    /// Verifying on (`true`) or off (the default). While on, a step that would replay the
    /// kept graph is orchestrated and captured instead, and the two graphs are compared
    /// ([`CapturedGraph::replay_difference`]): a difference means the caller's
    /// [`GraphShape`] leaves out something that shapes its graph, and the step returns an
    /// error naming it (its outputs are the orchestration's, so they are right) and the kept
    /// graph is dropped. For tests and debugging: every step pays its orchestration.
    pub fn set_verify(&mut self, on: bool) {
        self.verify = on;
    }

    /// Whether [`GraphCache::set_verify`] is on.
    pub fn verifying(&self) -> bool {
        self.verify
    }

    /// The graph the next step of the same shape would replay, if any.
    pub fn graph(&self) -> Option<&CapturedGraph> {
        self.kept.as_ref().map(|(g, _)| g)
    }

    /// Drops the kept graph (and its hold on the buffers it bound).
    pub fn clear(&mut self) {
        self.kept = None;
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

impl WorkerShared {
    fn spawn_orchestrator(self: &Arc<Self>, generation: u64) -> Result<(), PlatformError> {
        let me = self.clone();
        let h = std::thread::Builder::new()
            .name("simpler-orch".into())
            .spawn(move || me.orchestrator_main(generation))
            .map_err(|e| PlatformError {
                platform: "host".into(),
                what: format!("cannot start the orchestrator thread: {e}"),
            })?;
        self.threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(h);
        Ok(())
    }

    /// Hands the job queue to a fresh orchestrator thread (the old one is stuck in user code).
    pub(crate) fn replace_orchestrator(self: &Arc<Self>) -> Result<(), PlatformError> {
        let generation = {
            let _q = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
            // The abandoned thread's job is failed by the watchdog; the new thread starts idle.
            self.orch_busy.store(false, Ordering::Release);
            self.orch_gen.fetch_add(1, Ordering::AcqRel) + 1
        };
        self.jobs_cv.notify_all();
        self.spawn_orchestrator(generation)
    }

    fn orchestrator_main(self: Arc<Self>, generation: u64) {
        loop {
            let job = {
                let mut q = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if self.orch_gen.load(Ordering::Acquire) != generation {
                        return;
                    }
                    if let Some(j) = q.pop_front() {
                        self.orch_busy.store(true, Ordering::Release);
                        break j;
                    }
                    if self.closed.load(Ordering::Acquire) {
                        return;
                    }
                    q = self.jobs_cv.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let result = job.result.clone();
            let env = ExecEnv {
                platform: &*self.platform,
                host_memory: self.info.host_kernels,
                core_pool: &self.core_pool,
                registry: self
                    .registry
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone(),
                arena: &self.arena,
                cores: self.n_cores,
                warnings: &self.warnings,
                worker_id: self.id,
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                crate::exec::execute(&env, job)
            }))
            // The run's registration, dropped while unwinding, has failed and unregistered it.
            .unwrap_or_else(|p| Err(Error::Internal(crate::sched::panic_message(&*p))));
            result.deliver(r);
            let _q = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
            if self.orch_gen.load(Ordering::Acquire) == generation {
                self.orch_busy.store(false, Ordering::Release);
            }
        }
    }

    fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.jobs_cv.notify_all();
        // Let queued runs finish: the orchestrator thread exits when the queue is empty and it
        // holds no job (one it popped may not be registered as the current run yet).
        loop {
            let pending = {
                let q = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
                !q.is_empty() || self.orch_busy.load(Ordering::Acquire)
            };
            let active = self.core_pool.current().is_some();
            if !pending && !active {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.core_pool.wake.shutdown.store(true, Ordering::Release);
        self.core_pool.wake.sleep.notify_all();
        self.core_pool.registered.notify_all();
        let mut threads: Vec<JoinHandle<()>> =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        threads.extend(self.core_pool.take_threads());
        for h in threads {
            // A thread stuck in user code (already replaced) would block the join forever;
            // joining only finished threads keeps close() from hanging on it.
            if h.is_finished() || !self.is_stuck_thread(&h) {
                let _ = h.join();
            }
        }
    }

    fn is_stuck_thread(&self, h: &JoinHandle<()>) -> bool {
        // Give live threads a moment to notice the shutdown.
        for _ in 0..200 {
            if h.is_finished() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}
