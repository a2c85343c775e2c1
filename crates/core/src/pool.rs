//! The core pool: a worker's core threads (started on the platform, and replaced when stuck in
//! user code), the one registration of the run they take part in, and where a run's result
//! lands ([`JobResult`], read through [`RunHandle`]).
//!
//! Layering: the pool sits above the run (it hands cores to the registered [`RunShared`]) and
//! below the worker, the executor and the watchdog, none of which it knows; the run sees only
//! the [`CoreWake`] handle below it, never the pool.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_utils::sync::Parker;

use crate::error::{Error, PlatformError, RunError};
use crate::platform::{Platform, ThreadCounters};
use crate::report::RunReport;
use crate::run::RunShared;
use crate::sleep::{CoreWake, Sleep};

/// A worker's core threads: starting and replacing them, waking them ([`CoreWake`]), and the
/// registration of the run they take part in.
pub(crate) struct CorePool {
    pub(crate) wake: Arc<CoreWake>,
    platform: Arc<dyn Platform>,
    /// Every core thread started, replaced ones included (the worker joins those that end).
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The run being executed: the one place that says which run is current. Set and cleared
    /// only through a [`Registration`]; cores join what it holds, the watchdog watches it.
    current: Mutex<Option<ActiveRun>>,
    /// Signalled when a run registers (the watchdog waits on it while idle).
    pub(crate) registered: Condvar,
    /// Bumped after every change of `current`, so idle cores notice one without the lock.
    run_seq: AtomicU64,
    /// Per core: the scheduler counters of its current thread, once that thread has started
    /// (and when the platform reads them).
    counters: Mutex<Vec<Option<Arc<dyn ThreadCounters>>>>,
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
    /// Starts `cores` core threads on `platform`, whose idle cores spin `idle_spin` inside a
    /// run before they park.
    pub(crate) fn start(
        platform: Arc<dyn Platform>,
        cores: usize,
        idle_spin: Duration,
    ) -> Result<Arc<CorePool>, PlatformError> {
        let parkers: Vec<Parker> = (0..cores).map(|_| Parker::new()).collect();
        let wake = Arc::new(CoreWake::new(
            Sleep::new(parkers.iter().map(|p| p.unparker().clone()).collect()),
            idle_spin,
        ));
        let pool = Arc::new(CorePool {
            wake,
            platform,
            threads: Mutex::new(Vec::new()),
            current: Mutex::new(None),
            registered: Condvar::new(),
            run_seq: AtomicU64::new(0),
            counters: Mutex::new(vec![None; cores]),
        });
        for (i, p) in parkers.into_iter().enumerate() {
            if let Err(e) = pool.spawn_core(i, 0, p) {
                // Stop the threads already started (they hold the pool) before giving up.
                pool.wake.shutdown.store(true, Ordering::Release);
                pool.wake.sleep.notify_all();
                return Err(e);
            }
        }
        Ok(pool)
    }

    fn spawn_core(
        self: &Arc<Self>,
        i: usize,
        generation: u64,
        parker: Parker,
    ) -> Result<(), PlatformError> {
        let pool = self.clone();
        let h = self
            .platform
            .spawn_core(i, Box::new(move || pool.core_main(i, generation, parker)))?;
        self.threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(h);
        Ok(())
    }

    /// The core threads started so far (the caller joins them at shutdown).
    pub(crate) fn take_threads(&self) -> Vec<JoinHandle<()>> {
        std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Hands every core still inside `run`'s core loop (stuck in user code past the grace
    /// period, or idle there on a loaded host) to a fresh thread. The old thread keeps its
    /// handle on the run, and with it the run's memory and bound buffers, until it leaves the
    /// core loop; then it exits. Idempotent: a core is replaced only if the thread inside is
    /// still the core's current one.
    pub(crate) fn retire_stuck_cores(self: &Arc<Self>, run: &RunShared) {
        for (i, c) in run.cores.iter().enumerate() {
            let inside = c.inside.load(Ordering::SeqCst);
            if inside == 0 {
                continue;
            }
            let generation = inside - 1;
            if self.wake.retire(i, generation) {
                let parker = Parker::new();
                self.wake
                    .sleep
                    .replace(i, parker.unparker().clone(), generation);
                // Without a thread the core stays missing; later runs still complete on the
                // others.
                let _ = self.spawn_core(i, generation + 1, parker);
            }
        }
    }

    /// Registers `run` as the current run (replacing a run whose executor was abandoned).
    pub(crate) fn register(&self, run: Arc<RunShared>, result: Arc<JobResult>) -> Registration<'_> {
        // Before the run is published (`sleep.rs`: why every wake-up of the run sees it).
        self.wake.sleep.set_members(run.cores.len());
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(ActiveRun {
            run: run.clone(),
            result,
        });
        self.run_seq.fetch_add(1, Ordering::AcqRel);
        self.registered.notify_all();
        self.wake.sleep.notify_all();
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
            self.wake.sleep.set_members(usize::MAX);
            self.run_seq.fetch_add(1, Ordering::AcqRel);
            self.wake.sleep.notify_all();
        }
    }

    /// Per core, the scheduler counters of its current thread; `None` unless every core's thread
    /// has started and reports them.
    pub(crate) fn thread_counters(&self) -> Option<Vec<Arc<dyn ThreadCounters>>> {
        self.counters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
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
    pub(crate) fn core_main(&self, core: usize, generation: u64, parker: Parker) {
        let counters = self.platform.current_thread_counters();
        {
            let mut all = self.counters.lock().unwrap_or_else(|p| p.into_inner());
            if self.wake.is_current_generation(core, generation) {
                all[core] = counters;
            }
        }
        let mut seen = 0;
        loop {
            if self.wake.shutdown.load(Ordering::Acquire)
                || !self.wake.is_current_generation(core, generation)
            {
                return;
            }
            let seq = self.run_seq.load(Ordering::Acquire);
            if seq != seen {
                seen = seq;
                if let Some(active) = self.current() {
                    // Only the run is kept: the result handle is the watchdog's business. A
                    // run takes the first `run.cores.len()` cores (`CallConfig::cores`); the
                    // others stay idle here until the next run.
                    let run = active.run;
                    if core < run.cores.len() {
                        run.core_loop(core, &parker, generation);
                    }
                }
                continue;
            }
            if self.wake.sleep.announce(core, generation)
                && self.run_seq.load(Ordering::Acquire) == seen
                && !self.wake.shutdown.load(Ordering::Acquire)
            {
                parker.park_timeout(Duration::from_secs(1));
            }
            self.wake.sleep.withdraw(core, generation);
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
    pub(crate) fn new() -> Arc<JobResult> {
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
    pub(crate) result: Arc<JobResult>,
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
