//! The watchdog: enforces the three timeouts of a run and recovers from stuck user code.
//!
//! It samples the active run every few milliseconds. *Progress* is any change of the submit or
//! completion counters or of the blocks the cores finished (a long SPMD task that keeps
//! finishing blocks is progressing, not stuck). Without progress for the scheduler timeout it classifies the stall
//! (S1 a running task is stuck, S3 ready tasks but idle cores, S5 the orchestrator produces
//! nothing, S4 nothing ready or running although tasks are pending) and fails the run. A block
//! running longer than the op-execute timeout, or a run longer than the stream-sync timeout,
//! fails it too. If the orchestration function is still running a grace period after a failure,
//! the watchdog delivers the error to the waiting caller, replaces the orchestrator thread and
//! the run's stuck cores, so nothing hangs and the worker stays usable (when the orchestration
//! has returned, its thread does that recovery itself).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::config::Timeouts;
use crate::error::{ErrorCode, Locator, RunError, SchedSubclass};
use crate::pool::{ActiveRun, CorePool, JobResult};
use crate::run::{GRACE, RunShared};
use crate::task::TaskId;

struct Watch {
    started: Instant,
    last_counts: (u64, i64, u64),
    last_progress: Instant,
    /// Per core: (task id + 1, blocks finished, since when) of the block it has been running;
    /// a new block of the same task restarts the clock.
    running: Vec<(u64, u64, Instant)>,
    failed_at: Option<Instant>,
    recovered: bool,
}

/// Watches the runs `pool` registers until the pool shuts down. `replace_orchestrator` hands
/// the job queue to a new orchestrator thread (the worker's business, not the watchdog's).
pub(crate) fn run(pool: &Arc<CorePool>, t: Timeouts, replace_orchestrator: &dyn Fn()) {
    let tick = (t.scheduler / 100).clamp(Duration::from_millis(1), Duration::from_millis(20));
    let mut watch: Option<(u64, Watch)> = None;
    loop {
        // Raised only once the worker is closed and its queued runs have finished.
        if pool.wake.shutdown.load(Ordering::Acquire) {
            return;
        }
        let Some(ActiveRun { run, result }) = pool.wait_current(Duration::from_millis(100)) else {
            watch = None;
            continue;
        };
        let key = run.epoch;
        let now = Instant::now();
        let w = match &mut watch {
            Some((k, w)) if *k == key => w,
            _ => {
                watch = Some((
                    key,
                    Watch {
                        started: now,
                        last_counts: counts(&run),
                        last_progress: now,
                        running: vec![(0, 0, now); run.cores.len()],
                        failed_at: None,
                        recovered: false,
                    },
                ));
                &mut watch.as_mut().expect("just set").1
            }
        };
        if run.stopped() {
            let failed_at = *w.failed_at.get_or_insert(now);
            if !w.recovered && now - failed_at >= GRACE {
                w.recovered = true;
                recover(pool, &run, &result, replace_orchestrator);
            }
        } else if let Some(e) = check(&run, w, now, &t) {
            run.fail(e);
        }
        // Never sleep holding the run: its arena is reused by the next run only once every
        // handle on it is gone.
        drop((run, result));
        std::thread::sleep(tick);
    }
}

fn counts(run: &RunShared) -> (u64, i64, u64) {
    (
        run.submitted.load(Ordering::Relaxed),
        run.outstanding.load(Ordering::Relaxed),
        run.cores
            .iter()
            .map(|c| c.blocks.load(Ordering::Relaxed))
            .sum(),
    )
}

fn task_locator(run: &RunShared, id: TaskId, core: Option<usize>) -> Locator {
    Locator {
        task: Some(id),
        kernel: Some(run.slot(id).desc().kernel_name()),
        core: core.map(|c| c as u32),
        ring: Some(id.ring()),
    }
}

fn check(run: &RunShared, w: &mut Watch, now: Instant, t: &Timeouts) -> Option<RunError> {
    // A run whose orchestration has returned and whose tasks have all completed is over: the
    // orchestrator thread is only collecting its results. No timeout applies any more (the
    // stream-sync clock in particular keeps running until the run is unregistered).
    if run.orch_done.load(Ordering::Acquire) && run.outstanding.load(Ordering::Acquire) == 0 {
        return None;
    }
    if now - w.started > t.stream_sync {
        return Some(RunError::new(
            ErrorCode::StreamSyncTimeout,
            format!(
                "the run took longer than the stream-sync timeout of {:?}",
                t.stream_sync
            ),
            format!(
                "if the run is legitimately long, raise it: SIMPLER_STREAM_SYNC_TIMEOUT_MS={} (keep scheduler < op_execute < stream_sync)",
                (t.stream_sync.as_millis() * 2)
            ),
        ));
    }
    for (i, c) in run.cores.iter().enumerate() {
        let cur = c.current.load(Ordering::Acquire);
        let blocks = c.blocks.load(Ordering::Relaxed);
        if cur != w.running[i].0 || blocks != w.running[i].1 {
            w.running[i] = (cur, blocks, now);
        } else if cur != 0 && now - w.running[i].2 > t.op_execute {
            let id = TaskId(cur - 1);
            return Some(
                RunError::new(
                    ErrorCode::OpExecuteTimeout,
                    format!("a block of {id} has run on core {i} for longer than the op-execute timeout of {:?}", t.op_execute),
                    format!(
                        "split the task into smaller tiles, or raise SIMPLER_OP_EXECUTE_TIMEOUT_US={} (keep scheduler < op_execute < stream_sync)",
                        t.op_execute.as_micros() * 2
                    ),
                )
                .at(task_locator(run, id, Some(i))),
            );
        }
    }
    let c = counts(run);
    if c != w.last_counts {
        w.last_counts = c;
        w.last_progress = now;
        return None;
    }
    if run.outstanding.load(Ordering::Acquire) == 0 || now - w.last_progress < t.scheduler {
        return None;
    }
    let stalled = now - w.last_progress;
    let hint_timeout = format!(
        "if tasks legitimately take longer, raise SIMPLER_SCHEDULER_TIMEOUT_MS={} (keep scheduler < op_execute < stream_sync)",
        t.scheduler.as_millis() * 2
    );
    let base = |sub: SchedSubclass, detail: String, hint: String| {
        RunError::new(ErrorCode::SchedulerTimeout, detail, hint).subclass(sub)
    };
    // S1: the oldest-running block is the stuck one.
    if let Some((i, (cur, _, _))) = w
        .running
        .iter()
        .enumerate()
        .filter(|(_, (cur, _, _))| *cur != 0)
        .min_by_key(|(_, (_, _, since))| *since)
    {
        let id = TaskId(cur - 1);
        return Some(
            base(
                SchedSubclass::S1StuckTask,
                format!(
                    "no progress for {stalled:?}: {id} has been running on core {i} all that time"
                ),
                format!("check the kernel for an endless loop or a wait; {hint_timeout}"),
            )
            .at(task_locator(run, id, Some(i))),
        );
    }
    let queued = run.queued();
    if queued > 0 {
        return Some(base(
            SchedSubclass::S3IdleCores,
            format!(
                "no progress for {stalled:?}: {queued} ready tasks wait but every core is idle"
            ),
            "this is a scheduler fault (a lost wake-up); please report it with --swimlane 3 output"
                .into(),
        ));
    }
    if !run.orch_done.load(Ordering::Acquire) {
        return Some(base(
            SchedSubclass::S5OrchestratorStarved,
            format!(
                "no progress for {stalled:?}: nothing is ready or running and the orchestration function submitted nothing"
            ),
            format!(
                "check the orchestration function for a loop or a blocking wait; {hint_timeout}"
            ),
        ));
    }
    Some(base(
        SchedSubclass::S4NothingReady,
        format!(
            "no progress for {stalled:?}: {} tasks are pending but none is ready or running (a dependency that never completes)",
            run.outstanding.load(Ordering::Acquire)
        ),
        "run with --dep-gen and inspect the pending tasks' producers with `simpler trace deps`"
            .into(),
    ))
}

/// After a failure and the grace period: if the orchestrator thread is still inside the
/// orchestration function, deliver the error to the caller, give the job queue to a new thread
/// and hand the run's stuck cores to new threads (the orchestrator thread does that itself
/// when it is not stuck). The run stays alive, with its bound buffers, for as long as the old
/// threads hold it.
fn recover(
    pool: &Arc<CorePool>,
    run: &Arc<RunShared>,
    result: &Arc<JobResult>,
    replace_orchestrator: &dyn Fn(),
) {
    // Once the orchestration function has returned, the orchestrator thread is in runtime code
    // that ends within the grace period (it retires stuck cores itself): nothing to take over.
    if !result.is_delivered() && !run.orch_done.load(Ordering::Acquire) {
        let err = run
            .fatal
            .get()
            .cloned()
            .expect("stopped runs have an error");
        run.finished.store(true, Ordering::SeqCst);
        pool.wake.sleep.notify_all();
        pool.retire_stuck_cores(run);
        pool.unregister(run);
        replace_orchestrator();
        result.deliver(Err(err.into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(run: &RunShared, started: Instant) -> Watch {
        Watch {
            started,
            last_counts: counts(run),
            last_progress: started,
            running: vec![(0, 0, started); run.cores.len()],
            failed_at: None,
            recovered: false,
        }
    }

    /// Past every timeout (the clock is an argument, so no time passes), a run that is over
    /// gets no verdict, while the same run with a task outstanding does.
    #[test]
    fn a_finished_run_is_never_failed() {
        let t = Timeouts {
            scheduler: Duration::from_millis(10),
            op_execute: Duration::from_millis(20),
            stream_sync: Duration::from_millis(2000),
        };
        let run = RunShared::for_test(2);
        let start = Instant::now();
        let late = start + t.stream_sync * 2;
        // The orchestration has returned; one task is still outstanding.
        run.outstanding.store(1, Ordering::Release);
        run.orch_done.store(true, Ordering::Release);
        let e = check(&run, &mut watch(&run, start), late, &t).expect("a live run times out");
        assert_eq!(e.code, ErrorCode::StreamSyncTimeout);
        // Its last task completes: the run is over, whatever the clock says.
        run.finish_one();
        assert_eq!(check(&run, &mut watch(&run, start), late, &t), None);
        // A stale "running" entry does not revive it either.
        run.cores[0].current.store(1, Ordering::Release);
        let mut w = watch(&run, start);
        w.running[0] = (1, 0, start);
        assert_eq!(check(&run, &mut w, late, &t), None);
    }

    /// A stall past the scheduler timeout (and inside the others) is classified by what the
    /// run holds: ready tasks and idle cores (S3, a lost wake-up), no orchestration result yet
    /// (S5), pending tasks none of which can run (S4). S3 and S4 cannot be reached through the
    /// API (`tests/fatal_codes.rs` says why), so their verdicts are checked here on a run
    /// state set by hand.
    #[test]
    fn a_stall_is_classified_by_what_the_run_holds() {
        let t = Timeouts {
            scheduler: Duration::from_millis(10),
            op_execute: Duration::from_millis(1000),
            stream_sync: Duration::from_millis(2000),
        };
        let start = Instant::now();
        let stalled = start + Duration::from_millis(50);
        let verdict = |run: &RunShared| {
            let e = check(run, &mut watch(run, start), stalled, &t).expect("a stalled run");
            assert_eq!(e.code, ErrorCode::SchedulerTimeout);
            e.subclass
        };
        // Inside the scheduler timeout nothing is said.
        let run = RunShared::for_test(2);
        run.outstanding.store(2, Ordering::Release);
        let early = start + Duration::from_millis(5);
        assert_eq!(check(&run, &mut watch(&run, start), early, &t), None);
        // Pending, nothing queued, the orchestration still running: it is starved.
        assert_eq!(verdict(&run), Some(SchedSubclass::S5OrchestratorStarved));
        // The orchestration has returned: the pending tasks wait on something that never
        // completes.
        run.orch_done.store(true, Ordering::Release);
        let e = check(&run, &mut watch(&run, start), stalled, &t).unwrap();
        assert_eq!(e.subclass, Some(SchedSubclass::S4NothingReady));
        assert!(e.detail.contains("2 tasks are pending"), "{e}");
        assert!(e.hint.contains("--dep-gen"), "{e}");
        // A ready task no core takes: a lost wake-up, reported as a runtime fault.
        run.queues[0].push(TaskId(0));
        let e = check(&run, &mut watch(&run, start), stalled, &t).unwrap();
        assert_eq!(e.subclass, Some(SchedSubclass::S3IdleCores));
        assert!(e.detail.contains("1 ready tasks wait"), "{e}");
        assert!(e.hint.contains("scheduler fault"), "{e}");
    }
}
