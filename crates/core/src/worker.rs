//! The [`Worker`]: owns a platform's cores, the registered kernels and orchestrations, and runs
//! orchestrations one at a time (`run` blocks; `submit` returns a [`RunHandle`]).
//!
//! Threads of a worker: one per core (started through the platform), one orchestrator thread
//! that executes queued runs, and one watchdog that enforces the timeouts.
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

use crossbeam_utils::sync::Parker;

use crate::buffer::Buffer;
use crate::config::{CallConfig, Timeouts};
use crate::error::{ConfigError, Error, PlatformError, RunError};
use crate::kernel::{KernelSpec, Registry};
use crate::orch::Orchestrator;
use crate::platform::{Platform, PlatformInfo};
use crate::report::RunReport;
use crate::run::{Arena, RunShared};
use crate::sleep::Sleep;
use crate::task::EngineClass;
use crate::tensor::BufferId;

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

/// How to build a worker.
#[derive(Clone, Debug, Default)]
pub struct WorkerConfig {
    /// Number of cores (default: the platform's default, e.g. available parallelism).
    pub cores: Option<usize>,
    /// Timeouts; `None` reads the defaults and the environment overrides.
    pub timeouts: Option<Timeouts>,
}

/// Coordination between the worker, its core threads and its watchdog.
pub(crate) struct CorePool {
    pub(crate) sleep: Sleep,
    /// The run being executed: the one place that says which run is current. Set and cleared
    /// only through a [`Registration`]; cores join what it holds, the watchdog watches it.
    current: Mutex<Option<ActiveRun>>,
    /// Signalled when a run registers (the watchdog waits on it while idle).
    registered: Condvar,
    /// Bumped after every change of `current`, so idle cores notice one without the lock.
    run_seq: AtomicU64,
    pub(crate) shutdown: AtomicBool,
    core_gen: Box<[AtomicU64]>,
}

/// The run being executed, as the cores and the watchdog see it.
#[derive(Clone)]
pub(crate) struct ActiveRun {
    pub(crate) run: Arc<RunShared>,
    pub(crate) result: Arc<JobResult>,
}

/// The registration of a run as the worker's current run, owned by whoever executes it (the
/// orchestrator thread). Dropping it unregisters the run, unless another run has been
/// registered since (a stuck orchestrator returning late must not unregister the run a new
/// orchestrator thread started meanwhile). Dropped while unwinding from a runtime fault, it
/// first fails the run and stops its cores.
pub(crate) struct Registration<'a> {
    core_pool: &'a CorePool,
    run: Arc<RunShared>,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.run.finished.load(Ordering::SeqCst) {
            self.run.fail(RunError::new(
                crate::ErrorCode::ExplicitOrchFatal,
                "internal runtime error while executing the run",
                "please report this with the command that triggered it",
            ));
            self.run.finished.store(true, Ordering::SeqCst);
        }
        self.core_pool.unregister(&self.run);
    }
}

impl CorePool {
    pub(crate) fn is_current_generation(&self, core: usize, generation: u64) -> bool {
        self.core_gen[core].load(Ordering::Acquire) == generation
    }

    /// Registers `run` as the current run (replacing a run whose executor was abandoned).
    pub(crate) fn register(&self, run: Arc<RunShared>, result: Arc<JobResult>) -> Registration<'_> {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(ActiveRun {
            run: run.clone(),
            result,
        });
        self.run_seq.fetch_add(1, Ordering::AcqRel);
        self.registered.notify_all();
        self.sleep.notify_all();
        Registration {
            core_pool: self,
            run,
        }
    }

    /// Unregisters `run` if it is still the current run.
    pub(crate) fn unregister(&self, run: &Arc<RunShared>) {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(&c.run, run)) {
            *cur = None;
            drop(cur);
            self.run_seq.fetch_add(1, Ordering::AcqRel);
            self.sleep.notify_all();
        }
    }

    /// The current run, if any.
    pub(crate) fn current(&self) -> Option<ActiveRun> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The current run; waits up to `timeout` for one to register when there is none.
    pub(crate) fn wait_current(&self, timeout: Duration) -> Option<ActiveRun> {
        let g = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .registered
            .wait_timeout_while(g, timeout, |c| c.is_none())
            .unwrap_or_else(|p| p.into_inner());
        g.clone()
    }

    /// Body of core thread `core` (generation `generation`): takes part in each run until the
    /// worker shuts down or the core is handed to a new thread.
    fn core_main(&self, core: usize, generation: u64, parker: Parker) {
        let mut seen = 0;
        loop {
            if self.shutdown.load(Ordering::Acquire)
                || !self.is_current_generation(core, generation)
            {
                return;
            }
            let seq = self.run_seq.load(Ordering::Acquire);
            if seq != seen {
                seen = seq;
                if let Some(active) = self.current() {
                    // Only the run is kept: the result handle is the watchdog's business.
                    let run = active.run;
                    run.core_loop(core, &parker, generation);
                }
                continue;
            }
            self.sleep.announce(core);
            if self.run_seq.load(Ordering::Acquire) == seen
                && !self.shutdown.load(Ordering::Acquire)
            {
                parker.park_timeout(Duration::from_secs(1));
            }
            self.sleep.withdraw(core);
        }
    }
}

/// Where a run's result lands: first writer wins (the orchestrator thread, or the watchdog
/// when that thread is stuck).
///
/// The value and the "delivered" flag change together under one lock, value first: whoever
/// sees the flag set finds the value (or finds it already taken).
pub(crate) struct JobResult {
    value: Mutex<Outcome>,
    delivered: AtomicBool,
    cv: Condvar,
}

enum Outcome {
    Pending,
    Ready(Box<Result<RunReport, Error>>),
    Taken,
}

impl JobResult {
    fn new() -> Arc<JobResult> {
        Arc::new(JobResult {
            value: Mutex::new(Outcome::Pending),
            delivered: AtomicBool::new(false),
            cv: Condvar::new(),
        })
    }

    pub(crate) fn deliver(&self, r: Result<RunReport, Error>) {
        let mut v = self.value.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*v, Outcome::Pending) {
            *v = Outcome::Ready(Box::new(r));
            self.delivered.store(true, Ordering::Release);
            drop(v);
            self.cv.notify_all();
        }
    }

    pub(crate) fn is_delivered(&self) -> bool {
        self.delivered.load(Ordering::Acquire)
    }

    /// Takes the value if it is there.
    fn take(v: &mut Outcome) -> Option<Result<RunReport, Error>> {
        match std::mem::replace(v, Outcome::Taken) {
            Outcome::Ready(r) => Some(*r),
            other => {
                *v = other;
                None
            }
        }
    }
}

/// A run in flight; wait for it or poll it.
pub struct RunHandle {
    result: Arc<JobResult>,
}

impl RunHandle {
    /// Whether the run is over (its result is then available to `poll` or `wait`, unless
    /// already taken).
    pub fn is_done(&self) -> bool {
        self.result.is_delivered()
    }

    /// Takes the result if the run is over (once: a later `poll` returns `None`, and `wait`
    /// after a successful `poll` returns [`Error::Closed`]).
    pub fn poll(&mut self) -> Option<Result<RunReport, Error>> {
        let mut v = self.result.value.lock().unwrap_or_else(|p| p.into_inner());
        JobResult::take(&mut v)
    }

    /// Blocks until the run is over.
    pub fn wait(self) -> Result<RunReport, Error> {
        let mut v = self.result.value.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = JobResult::take(&mut v) {
                return r;
            }
            if matches!(*v, Outcome::Taken) {
                return Err(Error::Closed);
            }
            v = self.result.cv.wait(v).unwrap_or_else(|p| p.into_inner());
        }
    }
}

pub(crate) struct Job {
    pub(crate) name: String,
    pub(crate) f: OrchFn,
    pub(crate) args: RunArgs,
    pub(crate) cfg: CallConfig,
    pub(crate) result: Arc<JobResult>,
}

/// What the worker's handle, its orchestrator thread and its watchdog share: the platform, the
/// core pool, registered kernels and orchestrations, the job queue and the cached arena.
pub(crate) struct WorkerShared {
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
}

/// A worker: cores of one platform, ready to run orchestrations.
pub struct Worker {
    inner: Arc<WorkerShared>,
}

impl Worker {
    /// Starts a worker on `platform`.
    pub fn new(platform: impl Platform, config: WorkerConfig) -> Result<Worker, Error> {
        let platform: Arc<dyn Platform> = Arc::new(platform);
        let info = platform.info();
        let n_cores = config.cores.unwrap_or(info.default_cores);
        if n_cores == 0 || n_cores > 1024 {
            return Err(ConfigError {
                field: "WorkerConfig.cores".into(),
                value: n_cores.to_string(),
                reason: "must be between 1 and 1024".into(),
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
        let parkers: Vec<Parker> = (0..n_cores).map(|_| Parker::new()).collect();
        let core_pool = Arc::new(CorePool {
            sleep: Sleep::new(parkers.iter().map(|p| p.unparker().clone()).collect()),
            current: Mutex::new(None),
            registered: Condvar::new(),
            run_seq: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            core_gen: (0..n_cores).map(|_| AtomicU64::new(0)).collect(),
        });
        let inner = Arc::new(WorkerShared {
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
        });
        for (i, p) in parkers.into_iter().enumerate() {
            inner.spawn_core(i, 0, p)?;
        }
        inner.spawn_orchestrator(0)?;
        let w = inner.clone();
        let h = std::thread::Builder::new()
            .name("simpler-watchdog".into())
            .spawn(move || crate::watchdog::run(&w))
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

    /// The platform's description.
    pub fn platform(&self) -> &PlatformInfo {
        &self.inner.info
    }

    /// Timeouts in force.
    pub fn timeouts(&self) -> Timeouts {
        self.inner.timeouts
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
        self.enqueue(name.to_string(), f, args, cfg)
    }

    /// Queues a run of an ad-hoc orchestration function.
    pub fn submit_fn(
        &self,
        name: &str,
        args: RunArgs,
        cfg: &CallConfig,
        f: impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> + Send + Sync + 'static,
    ) -> Result<RunHandle, Error> {
        self.enqueue(name.to_string(), Arc::new(f), args, cfg)
    }

    fn enqueue(
        &self,
        name: String,
        f: OrchFn,
        args: RunArgs,
        cfg: &CallConfig,
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

impl Drop for Worker {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

impl WorkerShared {
    fn spawn_core(
        self: &Arc<Self>,
        i: usize,
        generation: u64,
        parker: Parker,
    ) -> Result<(), PlatformError> {
        let core_pool = self.core_pool.clone();
        let h = self.platform.spawn_core(
            i,
            Box::new(move || core_pool.core_main(i, generation, parker)),
        )?;
        self.threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(h);
        Ok(())
    }

    /// Hands every core still inside `run`'s core loop (stuck in user code past the grace
    /// period) to a fresh thread. The old thread keeps its handle on the run, and with it the
    /// run's memory and bound buffers, until its kernel returns; then it exits. Idempotent: a
    /// core is replaced only if the thread inside is still the core's current one.
    pub(crate) fn retire_stuck_cores(self: &Arc<Self>, run: &RunShared) {
        for (i, c) in run.cores.iter().enumerate() {
            let inside = c.inside.load(Ordering::SeqCst);
            if inside == 0 {
                continue;
            }
            let generation = inside - 1;
            if self.core_pool.core_gen[i]
                .compare_exchange(
                    generation,
                    generation + 1,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                let parker = Parker::new();
                self.core_pool.sleep.replace(i, parker.unparker().clone());
                // Without a thread the core stays missing; later runs still complete on the
                // others.
                let _ = self.spawn_core(i, generation + 1, parker);
            }
        }
    }

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
        let generation = self.orch_gen.fetch_add(1, Ordering::AcqRel) + 1;
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
                        break j;
                    }
                    if self.closed.load(Ordering::Acquire) {
                        return;
                    }
                    q = self.jobs_cv.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let result = job.result.clone();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                crate::exec::execute(&self, job)
            }))
            // The run's registration, dropped while unwinding, has failed and unregistered it.
            .unwrap_or_else(|p| Err(Error::Internal(crate::sched::panic_message(&*p))));
            result.deliver(r);
        }
    }

    fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.jobs_cv.notify_all();
        // Let queued runs finish: the orchestrator thread exits when the queue is empty.
        loop {
            let pending = !self
                .jobs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty();
            let active = self.core_pool.current().is_some();
            if !pending && !active {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.core_pool.shutdown.store(true, Ordering::Release);
        self.core_pool.sleep.notify_all();
        self.core_pool.registered.notify_all();
        let threads: Vec<JoinHandle<()>> =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivered_never_shows_before_the_value() {
        let r = JobResult::new();
        // Hold the value's lock so a delivery cannot store its value: "delivered" must not
        // show meanwhile (it used to be set first, and `wait` then returned `Closed` for a
        // run that succeeded).
        let guard = r.value.lock().unwrap();
        let r2 = r.clone();
        let t = std::thread::spawn(move || r2.deliver(Ok(RunReport::default())));
        for _ in 0..200 {
            assert!(!r.is_delivered());
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        drop(guard);
        t.join().unwrap();
        assert!(r.is_delivered());
        let mut h = RunHandle { result: r.clone() };
        assert!(matches!(h.poll(), Some(Ok(_))));
        assert!(h.poll().is_none());
        assert!(matches!(h.wait(), Err(Error::Closed)));
        // A second delivery (the watchdog after the orchestrator) changes nothing.
        r.deliver(Err(Error::Closed));
        let mut h = RunHandle { result: r };
        assert!(h.poll().is_none());
    }
}
