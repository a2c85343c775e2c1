//! Claiming and finishing the blocks of an SPMD task (one task slot's two block counters).
//!
//! # Protocol
//! A task enters the ready queues as one *entry* (its id). A core that takes the entry (from a
//! queue, or from its private hand-off slot) claims the next block with [`BlockClaims::claim`]
//! and, when blocks remain after it, pushes the entry back before running the block, so idle
//! cores join. So a task has at most one entry, queued or held by a core between its pop and
//! its claim.
//!
//! A core that has just run a block may claim another of the same task directly
//! ([`BlockClaims::finish`] with `more`), without going back through the queues: a hand-off
//! costs a queue pop, a push and a wake-up check, where this costs one compare-and-swap. Two
//! rules keep that safe:
//! - **It leaves the last block to the entry.** The direct claim only succeeds when at least one
//!   block stays unclaimed after it. Only the holder of the entry ever takes the last block, so
//!   while an entry exists an unclaimed block exists: every claim through an entry succeeds, no
//!   entry outlives its task, and no entry can reach a slot that was since given to another
//!   task (a stale entry would claim a block of the slot's next task).
//! - **It claims before counting the block it ran as done.** The task completes (and its slot
//!   can be consumed and reused) only once `done` reaches the block count, which needs this
//!   core's increment; the claim is sequenced before that increment, which the completing core
//!   reads (`AcqRel`), and the orchestrator resets the counters only after that completion. So
//!   the claim always lands on this task's counter, never on the next task's.
//!
//! `crate::claim::loom_tests` checks both rules on the real type, and that each is needed.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU32, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, Ordering};

/// The block counters of one task slot.
pub(crate) struct BlockClaims {
    /// Blocks claimed so far (may overshoot the count only through [`BlockClaims::claim`]).
    next: AtomicU32,
    /// Blocks finished.
    done: AtomicU32,
}

/// What a core does after finishing a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Finished {
    /// A block of the same task this core claimed directly: run it next.
    pub(crate) next: Option<u32>,
    /// The finished block was the task's last: the caller completes the task.
    pub(crate) last: bool,
}

impl BlockClaims {
    pub(crate) fn new() -> BlockClaims {
        BlockClaims {
            next: AtomicU32::new(0),
            done: AtomicU32::new(0),
        }
    }

    /// Zeroes both counters for the slot's next task (the orchestrator, before it publishes
    /// the task; the publication orders these stores).
    pub(crate) fn reset(&self) {
        self.next.store(0, Ordering::Relaxed);
        self.done.store(0, Ordering::Relaxed);
    }

    /// The holder of the task's entry claims the next of its `blocks` blocks. Returns the block,
    /// or `None` when every block was already claimed (never, by the protocol above; a guard).
    pub(crate) fn claim(&self, blocks: u32) -> Option<u32> {
        let b = self.next.fetch_add(1, Ordering::AcqRel);
        (b < blocks).then_some(b)
    }

    /// A core finished one of the task's `blocks` blocks. With `more`, it first claims another
    /// block directly if one would still be left for the task's entry; then it counts its block
    /// done. Never both a claimed block and `last`.
    pub(crate) fn finish(&self, blocks: u32, more: bool) -> Finished {
        let next = if more {
            self.next
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                    (b.saturating_add(1) < blocks).then_some(b + 1)
                })
                .ok()
        } else {
            None
        };
        let last = self.done.fetch_add(1, Ordering::AcqRel) + 1 == blocks;
        Finished { next, last }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// One core alone with a 4-block task: it claims block 0 through the entry, then blocks 1
    /// and 2 directly; block 3 is left to the entry (which it pushed back), and its claim
    /// finishes the task.
    #[test]
    fn direct_claims_leave_the_last_block_to_the_entry() {
        let c = BlockClaims::new();
        assert_eq!(c.claim(4), Some(0));
        let f = c.finish(4, true);
        assert_eq!((f.next, f.last), (Some(1), false));
        let f = c.finish(4, true);
        assert_eq!((f.next, f.last), (Some(2), false));
        let f = c.finish(4, true);
        assert_eq!(
            (f.next, f.last),
            (None, false),
            "block 3 stays for the entry"
        );
        assert_eq!(c.claim(4), Some(3));
        let f = c.finish(4, true);
        assert_eq!((f.next, f.last), (None, true));
        // Without `more` nothing is claimed; a claim past the count is refused.
        c.reset();
        assert_eq!(c.claim(1), Some(0));
        assert_eq!(c.claim(1), None);
        assert_eq!(
            c.finish(1, false),
            Finished {
                next: None,
                last: true
            }
        );
        c.reset();
        assert_eq!(c.claim(2), Some(0));
        assert_eq!(c.finish(2, false).next, None);
    }
}

/// Model checks (loom) of the protocol above: two cores share a task of three blocks through a
/// one-entry queue, as `RunShared::dispatch` and `exec_block` do; the core that completes the
/// task hands the slot to a new task at once (as the orchestrator may, once it is consumed).
/// Every interleaving must run each block exactly once, never find the entry's claim refused,
/// leave no entry behind at completion, and never claim a block of the slot's next task. A
/// reduced copy with either rule broken checks that loom finds the fault, so the passing model
/// means something. Run with `RUSTFLAGS="--cfg loom" cargo test -p simpler-core --lib loom`
/// (docs/checking.md).
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::{Arc, Mutex};
    use loom::thread;

    const BLOCKS: u32 = 3;

    struct Task {
        claims: BlockClaims,
        /// The task's entry while it is queued (a one-task ready queue).
        queue: Mutex<Option<()>>,
        ran: [AtomicBool; BLOCKS as usize],
        completed: AtomicBool,
        /// The first fault a core found (the cores stop then). Faults are recorded rather than
        /// panicked in a core thread, and reported by the model's own thread once both cores
        /// are joined.
        fault: Mutex<Option<&'static str>>,
    }

    /// How a core finishes a block: the real `BlockClaims::finish`, or a copy with one rule
    /// broken.
    #[derive(Clone, Copy)]
    enum Finish {
        Real,
        /// Direct claims may take the last block.
        TakesTheLast,
        /// The block is counted done before the direct claim.
        CountsFirst,
    }

    fn finish(t: &Task, how: Finish) -> Finished {
        match how {
            Finish::Real => t.claims.finish(BLOCKS, true),
            Finish::TakesTheLast => {
                let next = t
                    .claims
                    .next
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                        (b < BLOCKS).then_some(b + 1)
                    })
                    .ok();
                let last = t.claims.done.fetch_add(1, Ordering::AcqRel) + 1 == BLOCKS;
                Finished { next, last }
            }
            Finish::CountsFirst => {
                let last = t.claims.done.fetch_add(1, Ordering::AcqRel) + 1 == BLOCKS;
                let next = t
                    .claims
                    .next
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                        (b + 1 < BLOCKS).then_some(b + 1)
                    })
                    .ok();
                Finished { next, last }
            }
        }
    }

    fn found(t: &Task, fault: &'static str) {
        t.fault.lock().unwrap().get_or_insert(fault);
    }

    /// One core: takes the entry when there is one, claims, pushes the entry back while blocks
    /// remain, runs blocks (claiming more directly) and completes the task on its last block.
    fn core(t: &Task, how: Finish) {
        while !t.completed.load(Ordering::Acquire) && t.fault.lock().unwrap().is_none() {
            let entry = t.queue.lock().unwrap().take();
            if entry.is_none() {
                thread::yield_now();
                continue;
            }
            let Some(mut b) = t.claims.claim(BLOCKS) else {
                return found(t, "a stale entry: its claim was refused");
            };
            if b + 1 < BLOCKS {
                *t.queue.lock().unwrap() = Some(());
            }
            loop {
                if t.ran[b as usize].swap(true, Ordering::Relaxed) {
                    return found(t, "a block ran twice");
                }
                let f = finish(t, how);
                if f.last && f.next.is_some() {
                    return found(t, "the last block finished with another claimed");
                }
                if f.last {
                    if t.queue.lock().unwrap().is_some() {
                        return found(t, "an entry outlived its task");
                    }
                    // The slot goes to the next task: its counters restart.
                    t.claims.reset();
                    t.completed.store(true, Ordering::Release);
                }
                match f.next {
                    Some(n) => b = n,
                    None => break,
                }
            }
        }
    }

    fn model(how: Finish) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            let t = Arc::new(Task {
                claims: BlockClaims::new(),
                queue: Mutex::new(Some(())),
                ran: [
                    AtomicBool::new(false),
                    AtomicBool::new(false),
                    AtomicBool::new(false),
                ],
                completed: AtomicBool::new(false),
                fault: Mutex::new(None),
            });
            let t2 = t.clone();
            let other = thread::spawn(move || core(&t2, how));
            core(&t, how);
            other.join().unwrap();
            if let Some(fault) = *t.fault.lock().unwrap() {
                panic!("fault: {fault}");
            }
            assert!(t.ran.iter().all(|r| r.load(Ordering::Relaxed)));
            // Nobody claimed a block of the slot's next task.
            assert_eq!(
                t.claims.next.load(Ordering::Relaxed),
                0,
                "fault: a claim on the next task"
            );
            assert_eq!(
                t.claims.done.load(Ordering::Relaxed),
                0,
                "fault: a block of the next task done"
            );
        });
    }

    #[test]
    fn direct_block_claims_run_every_block_once_and_leave_no_stale_entry() {
        model(Finish::Real);
    }

    #[test]
    fn direct_block_claims_without_either_rule_go_wrong() {
        for how in [Finish::TakesTheLast, Finish::CountsFirst] {
            let err = std::panic::catch_unwind(|| model(how)).expect_err("loom finds the fault");
            let msg = err
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            assert!(msg.contains("fault:"), "{msg}");
        }
    }
}
