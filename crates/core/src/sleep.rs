//! Sleep and wake of cores.
//!
//! A core with nothing to do spins briefly (yielding now and then, so that on a machine with as
//! many cores as threads the orchestrator still gets the CPU), then announces itself as a
//! sleeper and parks. Whoever makes work available calls [`Sleep::notify_one`] (or
//! `notify_all`), which wakes one announced sleeper.
//!
//! No wake-up is lost: a core sets its flag, issues a `SeqCst` fence, and only then re-checks
//! for work before parking; a waker publishes the work, issues a `SeqCst` fence, and only then
//! reads the flags. Either the core sees the work or the waker sees the flag. A parked core
//! that is unparked before it parks returns at once (the parker keeps the token).

#[cfg(loom)]
use loom::sync::{
    Mutex,
    atomic::{AtomicBool, AtomicUsize, Ordering, fence},
};
#[cfg(not(loom))]
use std::sync::{
    Mutex,
    atomic::{AtomicBool, AtomicUsize, Ordering, fence},
};

use crossbeam_utils::sync::Unparker;

/// Wakes one parked thread (an unpark before the park is kept, as a token).
pub(crate) trait Wake {
    fn wake(&self);
}

impl Wake for Unparker {
    fn wake(&self) {
        self.unpark();
    }
}

pub(crate) struct Sleep<U: Wake = Unparker> {
    flags: Box<[AtomicBool]>,
    sleepers: AtomicUsize,
    unparkers: Box<[Mutex<U>]>,
}

impl<U: Wake> Sleep<U> {
    pub(crate) fn new(unparkers: Vec<U>) -> Sleep<U> {
        Sleep {
            flags: unparkers.iter().map(|_| AtomicBool::new(false)).collect(),
            sleepers: AtomicUsize::new(0),
            unparkers: unparkers.into_iter().map(Mutex::new).collect(),
        }
    }

    /// Replaces core `i`'s unparker (a new thread took over the core).
    pub(crate) fn replace(&self, i: usize, u: U) {
        *self.unparkers[i].lock().unwrap_or_else(|p| p.into_inner()) = u;
    }

    /// Announces core `i` as about to park. The caller must re-check for work afterwards.
    pub(crate) fn announce(&self, i: usize) {
        self.flags[i].store(true, Ordering::SeqCst);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Withdraws core `i`'s announcement (it found work or was woken).
    pub(crate) fn withdraw(&self, i: usize) {
        if self.flags[i].swap(false, Ordering::AcqRel) {
            self.sleepers.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn wake(&self, i: usize) {
        self.unparkers[i]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .wake();
    }

    /// Wakes one sleeping core, if any.
    pub(crate) fn notify_one(&self) {
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) == 0 {
            return;
        }
        for (i, f) in self.flags.iter().enumerate() {
            if f.load(Ordering::Relaxed) && f.swap(false, Ordering::AcqRel) {
                self.sleepers.fetch_sub(1, Ordering::AcqRel);
                self.wake(i);
                return;
            }
        }
    }

    /// Wakes every core (sleeping or not; a spurious unpark is harmless).
    pub(crate) fn notify_all(&self) {
        fence(Ordering::SeqCst);
        for i in 0..self.flags.len() {
            self.withdraw(i);
            self.wake(i);
        }
    }
}

/// What a run needs of the cores it runs on: waking them (the sleep protocol above), telling
/// them the worker shuts down, and telling a core thread that was replaced (its core handed to
/// a new thread) to leave.
pub(crate) struct CoreWake {
    pub(crate) sleep: Sleep,
    pub(crate) shutdown: std::sync::atomic::AtomicBool,
    /// Per core: the generation of the thread that currently owns it.
    generation: Box<[std::sync::atomic::AtomicU64]>,
}

impl CoreWake {
    pub(crate) fn new(sleep: Sleep) -> CoreWake {
        let n = sleep.flags.len();
        CoreWake {
            sleep,
            shutdown: std::sync::atomic::AtomicBool::new(false),
            generation: (0..n)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        }
    }

    /// Whether the thread of generation `generation` still owns core `core`.
    pub(crate) fn is_current_generation(&self, core: usize, generation: u64) -> bool {
        self.generation[core].load(std::sync::atomic::Ordering::Acquire) == generation
    }

    /// Takes core `core` from the thread of generation `generation` (for generation + 1);
    /// false if that thread no longer owns it.
    pub(crate) fn retire(&self, core: usize, generation: u64) -> bool {
        use std::sync::atomic::Ordering;
        self.generation[core]
            .compare_exchange(
                generation,
                generation + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crossbeam_utils::sync::Parker;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_notified_sleeper_wakes_and_no_wakeup_is_lost() {
        let parker = Parker::new();
        let sleep = Arc::new(Sleep::new(vec![parker.unparker().clone()]));
        let work = Arc::new(AtomicBool::new(false));
        let (s2, w2) = (sleep.clone(), work.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            w2.store(true, Ordering::SeqCst);
            s2.notify_one();
        });
        // Core side of the protocol: announce, re-check, park.
        loop {
            sleep.announce(0);
            if work.load(Ordering::SeqCst) {
                sleep.withdraw(0);
                break;
            }
            parker.park_timeout(Duration::from_secs(5));
            sleep.withdraw(0);
        }
        t.join().unwrap();
        assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 0);
    }
}

/// Model checks (loom) of the two wake-up protocols: cores sleeping and waking here, and the
/// orchestrator waiting for ring room (`Orchestrator::wait_for_room` against
/// `RunShared::release`). Loom explores every interleaving and every outcome the memory model
/// allows; a lost wake-up leaves a thread parked for good, which loom reports as a deadlock.
/// Parking here has no timeout, so the models show that no wake-up relies on the real code's
/// park timeouts. Run with `RUSTFLAGS="--cfg loom" cargo test -p simpler-core --lib loom`
/// (docs/checking.md).
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread::{self, Thread};

    impl Wake for Thread {
        fn wake(&self) {
            self.unpark();
        }
    }

    /// A core parks until work shows up; a waker publishes work (`Relaxed`: only the fences of
    /// the protocol order it) and calls `notify_one`.
    #[test]
    fn sleep_and_wake_lose_no_wake_up() {
        loom::model(|| {
            let sleep = Arc::new(Sleep::new(vec![thread::current()]));
            let work = Arc::new(AtomicBool::new(false));
            let (s2, w2) = (sleep.clone(), work.clone());
            // Not joined: an unpark token left over from `notify_one` would confuse loom's
            // join; loom runs every thread to its end anyway.
            thread::spawn(move || {
                w2.store(true, Ordering::Relaxed);
                s2.notify_one();
            });
            // The core side, as in `RunShared::idle` and `CorePool::core_main`.
            loop {
                sleep.announce(0);
                if work.load(Ordering::Relaxed) {
                    sleep.withdraw(0);
                    break;
                }
                thread::park();
                sleep.withdraw(0);
            }
        });
    }

    /// The ring-room protocol, reduced: the orchestrator announces that it waits, then checks
    /// the head slot and parks; a core marks the head consumed, then checks for a waiter and
    /// unparks it. The orderings are those of the real code: `Release` store + `SeqCst` fence +
    /// `Relaxed` load on the core side, `Relaxed` store + `SeqCst` fence + `Acquire` load on the
    /// orchestrator's.
    fn ring_room(core_fence: bool, orch_fence: bool) {
        loom::model(move || {
            let consumed = Arc::new(AtomicBool::new(false));
            let waiting = Arc::new(AtomicBool::new(false));
            let orch = thread::current();
            let (c2, w2) = (consumed.clone(), waiting.clone());
            // Not joined, as in the model above.
            thread::spawn(move || {
                c2.store(true, Ordering::Release);
                if core_fence {
                    fence(Ordering::SeqCst);
                }
                if w2.load(Ordering::Relaxed) {
                    orch.unpark();
                }
            });
            loop {
                waiting.store(true, Ordering::Relaxed);
                if orch_fence {
                    fence(Ordering::SeqCst);
                }
                if consumed.load(Ordering::Acquire) {
                    break;
                }
                thread::park();
            }
            waiting.store(false, Ordering::Relaxed);
        });
    }

    #[test]
    fn ring_room_wake_up_is_never_lost() {
        ring_room(true, true);
    }

    /// The checker finds the lost wake-up when either fence is missing (the store-buffer
    /// pattern the fences close), so the passing model above means something.
    #[test]
    fn ring_room_without_the_fences_loses_wake_ups() {
        for (core_fence, orch_fence) in [(false, true), (true, false)] {
            let err = std::panic::catch_unwind(|| ring_room(core_fence, orch_fence))
                .expect_err("loom finds the lost wake-up");
            let msg = err
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            assert!(
                msg.contains("deadlock"),
                "core fence {core_fence}, orchestrator fence {orch_fence}: {msg}"
            );
        }
    }
}
