//! The scheduler: how a core finds work, runs blocks, and processes completions.
//!
//! On a CPU-like platform every core thread schedules for itself (there is no separate
//! scheduler thread to starve on a 2-core machine). A core looks at its private "next" slot
//! first (a consumer its last completion made ready: the cheapest hand-off for dependency
//! chains), then the ready queues (Mix first, then Cube and Vector alternately). An SPMD task
//! stays visible while blocks remain: the core that claims a block pushes the task back before
//! running it, so idle cores claim the others; a core that finished a block claims the task's
//! next one directly, without a trip through the queues, leaving the last block to the queued
//! entry (the protocol, and why a slot is never reused under it: `claim`). A sync-start task
//! is run as a *gang*: one gang forms at a time, idle cores join it, and all its blocks start
//! together.
//!
//! Completion (by the core that finished the last block) walks the task's fan-out list, makes
//! consumers whose fan-in reaches zero ready, releases the task's producers and its own
//! completion reference, and drops the run's outstanding count. Dummy tasks and tasks whose
//! dispatch predicate is false are completed on the spot through an explicit work list (no
//! recursion on long dummy chains).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_deque::Steal;
use crossbeam_utils::sync::Parker;

use crate::clock::now_ns;
use crate::error::{ErrorCode, Locator, RunError};
use crate::kernel::{GangBarrier, TaskCtx, TaskDesc};
use crate::run::{GangForm, RunShared, SpinBarrier};
use crate::slot::{NO_ENTRY, state};
use crate::task::{EngineClass, TaskId};
use crate::trace::{PhaseRecord, QueueDepthSample, SchedPhase, TaskRecord};

/// A parked core wakes at least this often to re-check (a safety net; wake-ups are explicit).
const PARK: Duration = Duration::from_millis(100);

/// A core's scratch state while it takes part in a run.
pub(crate) struct CoreCtx<'a> {
    pub(crate) core: usize,
    pub(crate) parker: &'a Parker,
    /// The generation of the thread running the core (see `sleep`).
    generation: u64,
    next: Option<TaskId>,
    work: Vec<TaskId>,
    turn: bool,
}

fn steal(q: &crossbeam_deque::Injector<TaskId>) -> Option<TaskId> {
    loop {
        match q.steal() {
            Steal::Success(t) => return Some(t),
            Steal::Empty => return None,
            Steal::Retry => std::hint::spin_loop(),
        }
    }
}

impl RunShared {
    /// Runs core `core` for this run until the run is over (or the core is retired).
    pub(crate) fn core_loop(&self, core: usize, parker: &Parker, generation: u64) {
        let mut cx = CoreCtx {
            core,
            parker,
            generation,
            next: None,
            work: Vec::new(),
            turn: false,
        };
        // SeqCst pairs with `wait_cores_left` (see there). A core left behind in a kernel of
        // this run still holds the flag: its replacement stays out, so the flag keeps saying
        // that the old thread may touch this run's memory.
        if self.cores[core]
            .inside
            .compare_exchange(0, generation + 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return;
        }
        loop {
            if self.finished.load(Ordering::SeqCst)
                || self.stopped()
                || !self.wake.is_current_generation(core, generation)
            {
                break;
            }
            if !self.dispatch_open.load(Ordering::Acquire) {
                self.idle(&mut cx);
                continue;
            }
            if self.gang_pending.load(Ordering::Acquire) && self.join_gang(&mut cx) {
                continue;
            }
            let t0 = self.phase_start();
            let next = cx.next.take().or_else(|| self.pop(&mut cx.turn));
            match next {
                Some(t) => {
                    self.phase_end(&cx, SchedPhase::Dispatch, t0);
                    self.dispatch(&mut cx, t);
                }
                None => self.idle(&mut cx),
            }
        }
        self.cores[core].inside.store(0, Ordering::SeqCst);
    }

    fn pop(&self, turn: &mut bool) -> Option<TaskId> {
        if let Some(t) = steal(self.queue(EngineClass::Mix)) {
            return Some(t);
        }
        *turn = !*turn;
        let (a, b) = if *turn {
            (EngineClass::Cube, EngineClass::Vector)
        } else {
            (EngineClass::Vector, EngineClass::Cube)
        };
        steal(self.queue(a)).or_else(|| steal(self.queue(b)))
    }

    fn has_work(&self) -> bool {
        self.finished.load(Ordering::Acquire)
            || self.stopped()
            || (self.dispatch_open.load(Ordering::Acquire)
                && (!self.queues_empty() || self.gang_pending.load(Ordering::Acquire)))
    }

    fn idle(&self, cx: &mut CoreCtx<'_>) {
        let t0 = self.phase_start();
        let spin_until = Instant::now() + self.wake.idle_spin;
        let mut i = 0u32;
        loop {
            if self.has_work() {
                self.phase_end(cx, SchedPhase::Idle, t0);
                return;
            }
            i += 1;
            if i.is_multiple_of(16) {
                if Instant::now() >= spin_until {
                    break;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // A retired thread (a newer one owns the core) does not park: it leaves at the top of
        // the core loop.
        if self.wake.sleep.announce(cx.core, cx.generation)
            && !self.has_work()
            && !self.wake.shutdown.load(Ordering::Acquire)
        {
            cx.parker.park_timeout(PARK);
        }
        self.wake.sleep.withdraw(cx.core, cx.generation);
        self.phase_end(cx, SchedPhase::Idle, t0);
    }

    fn dispatch(&self, cx: &mut CoreCtx<'_>, t: TaskId) {
        let slot = self.slot(t);
        let desc = slot.desc();
        if desc.sync_start {
            self.form_gang(cx, t, desc);
            return;
        }
        let Some(mut b) = slot.blocks.claim(desc.block_num) else {
            return;
        };
        if b + 1 < desc.block_num {
            self.queue(desc.class).push(t);
            self.wake.sleep.notify_one();
        }
        // Blocks this core claims directly after the one it ran (`claim`: the pushed-back entry
        // keeps the task visible, and its last block is left to that entry).
        while let Some(next) = self.exec_block(cx, t, &desc, b, None) {
            b = next;
        }
    }

    fn form_gang(&self, cx: &mut CoreCtx<'_>, t: TaskId, desc: Arc<TaskDesc>) {
        let barrier = Arc::new(SpinBarrier::new(desc.block_num, self.cancel.clone()));
        if desc.block_num > 1 {
            let mut g = self.gang.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_some() {
                // Another gang is forming: retry this one later (this core will join that one).
                drop(g);
                self.queue(desc.class).push(t);
                return;
            }
            *g = Some(GangForm {
                task: t,
                need: desc.block_num,
                joined: 1,
                barrier: barrier.clone(),
            });
            self.gang_pending.store(true, Ordering::Release);
            drop(g);
            self.wake.sleep.notify_all();
        }
        barrier.wait();
        if !self.stopped() {
            self.exec_block(cx, t, &desc, 0, Some(&*barrier));
        }
    }

    fn join_gang(&self, cx: &mut CoreCtx<'_>) -> bool {
        let mut g = self.gang.lock().unwrap_or_else(|p| p.into_inner());
        let Some(form) = g.as_mut() else { return false };
        let block = form.joined;
        form.joined += 1;
        let (t, barrier) = (form.task, form.barrier.clone());
        if form.joined == form.need {
            *g = None;
            self.gang_pending.store(false, Ordering::Release);
        }
        drop(g);
        barrier.wait();
        if !self.stopped() {
            let desc = self.slot(t).desc();
            self.exec_block(cx, t, &desc, block, Some(&*barrier));
        }
        true
    }

    /// Runs block `block` of `t`; completes `t` if it was the last block to finish. Outside a
    /// gang, returns another block of `t` this core claimed directly, to run next.
    fn exec_block(
        &self,
        cx: &mut CoreCtx<'_>,
        t: TaskId,
        desc: &TaskDesc,
        block: u32,
        gang: Option<&dyn GangBarrier>,
    ) -> Option<u32> {
        let slot = self.slot(t);
        let level = self.swimlane;
        let dispatch = if level >= 2 || desc.timing_slot.is_some() {
            now_ns()
        } else {
            0
        };
        if block == 0 {
            slot.state.store(state::RUNNING, Ordering::Release);
            if let Some(s) = desc.timing_slot {
                self.timing_slots[s as usize]
                    .first_dispatch
                    .fetch_min(dispatch, Ordering::Relaxed);
            }
        }
        let core_state = &self.cores[cx.core];
        core_state.current.store(t.0 + 1, Ordering::Release);
        let start = if level >= 1 { now_ns() } else { 0 };
        let result = match &desc.kernel {
            Some(k) => {
                let ctx = TaskCtx::new(
                    desc,
                    block,
                    cx.core as u32,
                    &self.cancel,
                    gang,
                    self.host_memory,
                );
                catch_unwind(AssertUnwindSafe(|| (k.body)(&ctx)))
            }
            None => Ok(Ok(())),
        };
        let end = if level >= 1 { now_ns() } else { 0 };
        core_state.current.store(0, Ordering::Release);
        core_state.blocks.fetch_add(1, Ordering::Relaxed);
        let failure = match result {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.0),
            Err(panic) => Some(panic_message(&*panic)),
        };
        if let Some(msg) = failure {
            self.fail(
                RunError::new(
                    ErrorCode::KernelFailed,
                    format!("kernel {:?} failed on block {block}: {msg}", desc.kernel_name()),
                    "fix the kernel or its arguments; run with --swimlane 1 to see what ran before it",
                )
                .at(Locator {
                    task: Some(t),
                    kernel: Some(desc.kernel_name()),
                    core: Some(cx.core as u32),
                    ring: Some(t.ring()),
                }),
            );
            return None;
        }
        if self.stopped() {
            return None;
        }
        // A forming gang needs idle cores, and a retired thread must leave: neither takes more.
        let more = gang.is_none()
            && !self.gang_pending.load(Ordering::Acquire)
            && self.wake.is_current_generation(cx.core, cx.generation);
        let finished = slot.blocks.finish(desc.block_num, more);
        if finished.last {
            let t0 = self.phase_start();
            self.complete(t, Some(cx.core), &mut cx.next, &mut cx.work);
            self.phase_end(cx, SchedPhase::Complete, t0);
        }
        if level >= 1 {
            // Level 1 records the kernel alone (`docs/trace-format.md`): the dispatch time is
            // measured at every level (the timing slots need it) but written from level 2.
            let (dispatch, finish) = if level >= 2 {
                (dispatch, now_ns())
            } else {
                (0, 0)
            };
            let rec = TaskRecord {
                task_id: t.trace_id(),
                func: desc.kernel.as_ref().map_or(u32::MAX, |k| k.id.0),
                class: desc.class,
                core: cx.core as u32,
                block,
                dispatch,
                start,
                end,
                finish,
            };
            if !self.record(&core_state.records, rec) {
                self.tasks_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        finished.next
    }

    /// Completes `first` and everything that completes on the spot because of it.
    /// `next` is the caller's private hand-off slot (None for the orchestrator).
    pub(crate) fn complete(
        &self,
        first: TaskId,
        core: Option<usize>,
        next: &mut Option<TaskId>,
        work: &mut Vec<TaskId>,
    ) {
        work.push(first);
        while let Some(t) = work.pop() {
            let slot = self.slot(t);
            let head = {
                let mut f = slot.fanout();
                f.completed = true;
                slot.state.store(state::COMPLETED, Ordering::Release);
                std::mem::replace(&mut f.head, NO_ENTRY)
            };
            let mut e = head;
            while e != NO_ENTRY {
                let entry = self.arena.rings.entry(e);
                let consumer = TaskId(entry.consumer.load(Ordering::Relaxed));
                // Read `next` before the decrement: once the consumer can run, its entries may
                // be reclaimed and reused.
                e = entry.next.load(Ordering::Relaxed);
                if self.slot(consumer).fanin.fetch_sub(1, Ordering::AcqRel) == 1 {
                    self.on_ready(consumer, core, Some(&mut *next), work);
                }
            }
            let ring = &self.arena.rings.rings[t.ring() as usize];
            let start = slot.dep_start.load(Ordering::Relaxed);
            for i in 0..slot.dep_count.load(Ordering::Relaxed) as u64 {
                let p = ring.entry_at(start + i).producer.load(Ordering::Relaxed);
                if p != u64::MAX {
                    self.release(TaskId(p));
                }
            }
            let desc = slot.desc();
            if let Some(s) = desc.timing_slot {
                let ts = &self.timing_slots[s as usize];
                ts.last_finish.fetch_max(now_ns(), Ordering::Relaxed);
                ts.tasks.fetch_add(1, Ordering::Relaxed);
                if desc.kernel.is_none() {
                    ts.first_dispatch.fetch_min(now_ns(), Ordering::Relaxed);
                }
            }
            self.release(t);
            self.finish_one();
        }
    }

    /// `t`'s last producer completed: run it, or complete it on the spot (dummy / predicate
    /// false).
    pub(crate) fn on_ready(
        &self,
        t: TaskId,
        core: Option<usize>,
        next: Option<&mut Option<TaskId>>,
        work: &mut Vec<TaskId>,
    ) {
        let slot = self.slot(t);
        let desc = slot.desc();
        if desc.kernel.is_none() {
            work.push(t);
            return;
        }
        if let Some(p) = desc.predicate {
            let ctx = TaskCtx::new(
                &desc,
                0,
                core.map_or(u32::MAX, |c| c as u32),
                &self.cancel,
                None,
                self.host_memory,
            );
            // A panicking predicate must not unwind through the completion that called it (it
            // would lose the rest of the fan-out and the core): it fails the run, and the task
            // counts as skipped so the graph still drains.
            let run = match catch_unwind(AssertUnwindSafe(|| p(&ctx))) {
                Ok(run) => run,
                Err(panic) => {
                    self.fail(
                        RunError::new(
                            ErrorCode::KernelFailed,
                            format!(
                                "the dispatch predicate of kernel {:?} panicked: {}",
                                desc.kernel_name(),
                                panic_message(&*panic)
                            ),
                            "fix the predicate given to Task::predicate",
                        )
                        .at(Locator {
                            task: Some(t),
                            kernel: Some(desc.kernel_name()),
                            core: core.map(|c| c as u32),
                            ring: Some(t.ring()),
                        }),
                    );
                    false
                }
            };
            if !run {
                self.skipped.fetch_add(1, Ordering::Relaxed);
                work.push(t);
                return;
            }
        }
        slot.state.store(state::READY, Ordering::Release);
        match next {
            Some(n)
                if n.is_none()
                    && !desc.sync_start
                    && self.dispatch_open.load(Ordering::Relaxed) =>
            {
                *n = Some(t)
            }
            _ => {
                self.queue(desc.class).push(t);
                self.wake.sleep.notify_one();
                if self.swimlane >= 3 {
                    let c = core.unwrap_or(0);
                    let sample = QueueDepthSample {
                        ts: now_ns(),
                        class: desc.class,
                        depth: self.queue(desc.class).len() as u32,
                    };
                    let _ = self.record(&self.cores[c].depth, sample);
                }
            }
        }
    }

    /// Keeps `rec` if the core's share of the capacity has room; counts it dropped otherwise.
    /// Whether it was kept.
    fn record<T>(&self, buf: &std::sync::Mutex<Vec<T>>, rec: T) -> bool {
        let mut v = buf.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < self.swimlane_cap_per_core {
            v.push(rec);
            true
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    fn phase_start(&self) -> u64 {
        if self.swimlane >= 3 { now_ns() } else { 0 }
    }

    fn phase_end(&self, cx: &CoreCtx<'_>, phase: SchedPhase, start: u64) {
        if self.swimlane >= 3 {
            let rec = PhaseRecord {
                sched: cx.core as u32,
                core: cx.core as u32,
                phase,
                start,
                end: now_ns(),
            };
            let _ = self.record(&self.cores[cx.core].phases, rec);
        }
    }
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}
