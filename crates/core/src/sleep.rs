//! Sleep and wake: of cores with nothing to do, and of the orchestrator waiting for ring room.
//!
//! A core with nothing to do spins briefly (yielding now and then, so that on a machine with as
//! many cores as threads the orchestrator still gets the CPU), then announces itself as a
//! sleeper and parks. Whoever makes work available calls [`Sleep::notify_one`] (or
//! `notify_all`), which wakes one announced sleeper.
//!
//! No wake-up is lost: a core counts itself in `sleepers`, sets its flag, issues a `SeqCst`
//! fence, and only then re-checks for work before parking; a waker publishes the work, issues a
//! `SeqCst` fence, and only then reads the count and the flags. Either the core sees the work,
//! or the waker sees the core: its count (which it drops only once awake again), so the waker
//! scans the flags, and its flag (unless another waker took it, and woke it). A parked core
//! that is unparked before it parks returns at once (the parker keeps the token).
//!
//! A core can change threads: a thread still inside a failed run's core loop after the grace
//! period is retired and the core handed to a new thread (`CorePool::retire_stuck_cores`).
//! The retired thread is usually stuck in a kernel, but it may be idle in the sleep protocol
//! instead, not in user code at all (a loaded host kept it from leaving in time). For a while two threads then use one core's flag. So
//! the flag holds the *generation* of the thread that announced (generation + 1; 0 is none),
//! a thread withdraws only its own announcement, and one never overwrites a newer generation's;
//! and `sleepers` counts threads between `announce` and `withdraw`, each thread adding and
//! removing only itself, so a thread clearing another's flag can never leave the count off.
//! (It used to count flags, with the flag a plain bool: the retired thread's late `withdraw`
//! cleared its successor's announcement, which `notify_one` then never woke, and left the count
//! one too high for good.)
//!
//! A run may take only the first of the worker's cores (`CallConfig::cores`): the others stay
//! idle in the pool, and may be announced there. [`Sleep::set_members`] limits the cores
//! `notify_one` wakes to the run's, so a wake-up is never spent on a core that will not run
//! the work. The limit is set before the run is published (the orchestrator's thread stores it,
//! then registers the run with a lock and a release increment of the pool's run sequence, which
//! every core of the run loads with acquire before it joins), so every `notify_one` of the run
//! (by its orchestrator or its cores) reads it; it is reset to every core after the run is
//! unregistered. For the run's own cores the argument above is unchanged: a core of the run
//! that announced is within the limit, so the waker that misses its work still sees it. (The
//! run's cores are the first ones and the scan starts at core 0, so even a limit read stale
//! could only spend a wake-up on an outside core when no core of the run was announced.)
//!
//! [`RoomSignal`] is the orchestrator's side: it says that it waits for a ring slot to be
//! consumed, fences and re-checks the slot before parking; the core that consumes a slot
//! fences and checks whether the orchestrator waits. The same store-buffer argument holds.

#[cfg(loom)]
use loom::sync::{
    Mutex,
    atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence},
};
#[cfg(not(loom))]
use std::sync::{
    Mutex,
    atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence},
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
    /// Per core: generation + 1 of the thread announced as about to park, 0 when none is.
    flags: Box<[AtomicU64]>,
    /// Threads between `announce` and `withdraw` (at least the announced ones).
    sleepers: AtomicUsize,
    unparkers: Box<[Mutex<U>]>,
    /// `notify_one` wakes only cores `0 .. members` (the current run's).
    members: AtomicUsize,
    /// Parked cores `notify_one` and `notify_all` have woken: the orchestrator yields its
    /// CPU only after one was (`Orchestrator::maybe_yield`). A counter read without ordering:
    /// a stale read delays or skips one yield, which is a cost, never a lost wake-up.
    woken: AtomicU64,
}

impl<U: Wake> Sleep<U> {
    pub(crate) fn new(unparkers: Vec<U>) -> Sleep<U> {
        Sleep {
            flags: unparkers.iter().map(|_| AtomicU64::new(0)).collect(),
            sleepers: AtomicUsize::new(0),
            members: AtomicUsize::new(unparkers.len()),
            woken: AtomicU64::new(0),
            unparkers: unparkers.into_iter().map(Mutex::new).collect(),
        }
    }

    /// From now on `notify_one` wakes only cores `0 .. n` (capped at the core count): the
    /// cores of the run about to be published, or every core (after it).
    pub(crate) fn set_members(&self, n: usize) {
        self.members
            .store(n.min(self.flags.len()), Ordering::SeqCst);
    }

    /// Core `i` changes threads: `u` wakes the new thread from now on. The retired thread's
    /// (generation `retired`) announcement is withdrawn and the thread woken, so that a thread
    /// idle in this protocol leaves at once rather than when its park times out.
    pub(crate) fn replace(&self, i: usize, u: U, retired: u64) {
        let old = std::mem::replace(
            &mut *self.unparkers[i].lock().unwrap_or_else(|p| p.into_inner()),
            u,
        );
        // Only the flag: the retired thread removes itself from `sleepers` in its `withdraw`.
        let _ = self.flags[i].compare_exchange(retired + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
        old.wake();
    }

    /// Announces the thread of generation `generation` on core `i` as about to park. The caller
    /// must re-check for work afterwards, and call `withdraw` after (whether it parked or not).
    /// False when a newer thread owns the core (this one is retired and should not park).
    pub(crate) fn announce(&self, i: usize, generation: u64) -> bool {
        // Counted before the flag is set: whenever a flag is set, its thread is counted.
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let mine = generation + 1;
        let mut cur = self.flags[i].load(Ordering::SeqCst);
        let announced = loop {
            // A newer generation's announcement stays; an older one (a retired thread that
            // has not withdrawn yet) is taken over, so the core's flag names its current thread.
            if cur > mine {
                break false;
            }
            match self.flags[i].compare_exchange(cur, mine, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => break true,
                Err(now) => cur = now,
            }
        };
        fence(Ordering::SeqCst);
        announced
    }

    /// Withdraws the announcement of the thread of generation `generation` on core `i` (it found
    /// work, was woken or timed out), leaving a newer thread's announcement alone.
    pub(crate) fn withdraw(&self, i: usize, generation: u64) {
        let _ =
            self.flags[i].compare_exchange(generation + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
        self.sleepers.fetch_sub(1, Ordering::AcqRel);
    }

    fn wake(&self, i: usize) {
        self.unparkers[i]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .wake();
    }

    /// Wakes one sleeping core of the run's ([`Sleep::set_members`]), if any.
    pub(crate) fn notify_one(&self) {
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) == 0 {
            return;
        }
        let members = self.members.load(Ordering::SeqCst);
        for (i, f) in self.flags.iter().enumerate().take(members) {
            if f.load(Ordering::Relaxed) != 0 && f.swap(0, Ordering::AcqRel) != 0 {
                self.woken.fetch_add(1, Ordering::Relaxed);
                self.wake(i);
                return;
            }
        }
    }

    /// How many parked cores `notify_one` and `notify_all` have woken so far.
    pub(crate) fn woken(&self) -> u64 {
        self.woken.load(Ordering::Relaxed)
    }

    /// Wakes every core (sleeping or not; a spurious unpark is harmless).
    pub(crate) fn notify_all(&self) {
        fence(Ordering::SeqCst);
        for (i, f) in self.flags.iter().enumerate() {
            if f.swap(0, Ordering::AcqRel) != 0 {
                self.woken.fetch_add(1, Ordering::Relaxed);
            }
            self.wake(i);
        }
    }
}

/// The orchestrator's wait for ring room (`Orchestrator::wait_for_room`) against the cores
/// that consume tasks (`RunShared::release`).
///
/// The waiter calls [`RoomSignal::begin_wait`], re-checks the head slot, parks if it is not
/// consumed, and calls [`RoomSignal::end_wait`]. A core stores the slot's consumed state and
/// then calls [`RoomSignal::notify`]. Store-buffer pattern: with a `SeqCst` fence between each
/// side's store and load, either the waiter sees the slot consumed or the core sees it waiting
/// (and unparks it; an unpark before the park is kept as a token). Without the fences both
/// could miss and the orchestrator would sleep until its park timeout.
pub(crate) struct RoomSignal<U: Wake = Unparker> {
    waiting: AtomicBool,
    orchestrator: U,
}

impl<U: Wake> RoomSignal<U> {
    pub(crate) fn new(orchestrator: U) -> RoomSignal<U> {
        RoomSignal {
            waiting: AtomicBool::new(false),
            orchestrator,
        }
    }

    /// The orchestrator is about to re-check the head slot and park.
    pub(crate) fn begin_wait(&self) {
        self.waiting.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// The orchestrator has stopped waiting.
    pub(crate) fn end_wait(&self) {
        self.waiting.store(false, Ordering::Relaxed);
    }

    /// A slot was consumed (its state stored before this call): wakes the orchestrator if it
    /// waits.
    pub(crate) fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::Relaxed) {
            self.orchestrator.wake();
        }
    }

    /// Wakes the orchestrator whether it waits or not (the run failed).
    pub(crate) fn wake(&self) {
        self.orchestrator.wake();
    }
}

/// What a run needs of the cores it runs on: waking them (the sleep protocol above), telling
/// them the worker shuts down, and telling a core thread that was replaced (its core handed to
/// a new thread) to leave.
pub(crate) struct CoreWake {
    pub(crate) sleep: Sleep,
    /// How long a core with nothing to do inside a run spins before it parks.
    pub(crate) idle_spin: std::time::Duration,
    pub(crate) shutdown: std::sync::atomic::AtomicBool,
    /// Per core: the generation of the thread that currently owns it.
    generation: Box<[std::sync::atomic::AtomicU64]>,
}

impl CoreWake {
    pub(crate) fn new(sleep: Sleep, idle_spin: std::time::Duration) -> CoreWake {
        let n = sleep.flags.len();
        CoreWake {
            sleep,
            idle_spin,
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
            w2.store(true, Ordering::SeqCst);
            s2.notify_one();
        });
        // Core side of the protocol: announce, re-check, park (bounded: the test fails rather
        // than hangs if the wake-up is lost).
        let mut parks = 0;
        loop {
            sleep.announce(0, 0);
            if work.load(Ordering::SeqCst) {
                sleep.withdraw(0, 0);
                break;
            }
            parker.park_timeout(Duration::from_secs(5));
            sleep.withdraw(0, 0);
            parks += 1;
            assert!(parks < 3, "the waker never woke the core");
        }
        t.join().unwrap();
        assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 0);
    }

    /// Counts the wake-ups of one thread.
    #[derive(Clone, Default)]
    struct Count(Arc<AtomicUsize>);

    /// `notify_all` wakes every core and counts the announced ones it woke, not the others.
    #[test]
    fn notify_all_counts_the_parked_cores_it_wakes() {
        let (c0, c1) = (Count::default(), Count::default());
        let sleep = Sleep::new(vec![c0.clone(), c1.clone()]);
        assert!(sleep.announce(1, 0));
        sleep.notify_all();
        assert_eq!((c0.get(), c1.get()), (1, 1));
        assert_eq!(sleep.woken(), 1);
        sleep.withdraw(1, 0);
        sleep.notify_all();
        assert_eq!(sleep.woken(), 1);
        assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 0);
    }

    /// A run of the first core of two: the other, idle in the pool and announced there, is
    /// never woken for the run's work, and the run's announced core is; after the run every
    /// core is woken again.
    #[test]
    fn notify_one_wakes_only_the_runs_cores() {
        let (c0, c1) = (Count::default(), Count::default());
        let sleep = Sleep::new(vec![c0.clone(), c1.clone()]);
        sleep.set_members(1);
        assert!(sleep.announce(1, 0));
        sleep.notify_one();
        assert_eq!(
            (c0.get(), c1.get()),
            (0, 0),
            "the core outside the run stays"
        );
        assert_eq!(sleep.woken(), 0, "no wake-up counted");
        assert!(sleep.announce(0, 0));
        sleep.notify_one();
        assert_eq!((c0.get(), c1.get()), (1, 0), "the run's core is woken");
        // Counted (the orchestrator's yield follows it); a call with nobody to wake is not.
        assert_eq!(sleep.woken(), 1);
        sleep.notify_one();
        assert_eq!(sleep.woken(), 1);
        sleep.withdraw(0, 0);
        sleep.set_members(2);
        sleep.notify_one();
        assert_eq!(
            (c0.get(), c1.get()),
            (1, 1),
            "every core again after the run"
        );
        sleep.withdraw(1, 0);
        assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 0);
        // A limit past the cores is capped.
        sleep.set_members(5);
        assert!(sleep.announce(1, 0));
        sleep.notify_one();
        assert_eq!(c1.get(), 2);
        sleep.withdraw(1, 0);
    }

    impl Wake for Count {
        fn wake(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl Count {
        fn get(&self) -> usize {
            self.0.load(Ordering::SeqCst)
        }
    }

    /// Core 0's thread of generation 0 is retired while idle in the protocol, not in user code,
    /// and its successor (generation 1) announces before or after the old one leaves. Each
    /// step is one call, in the orders the two threads can take.
    #[test]
    fn a_retired_idle_thread_leaves_the_count_and_its_successor_alone() {
        // Old announced, retired, new announces, old withdraws late.
        let (old, new) = (Count::default(), Count::default());
        let sleep = Sleep::new(vec![old.clone()]);
        assert!(sleep.announce(0, 0));
        sleep.replace(0, new.clone(), 0);
        assert_eq!(old.get(), 1, "the retired thread is woken to leave");
        assert!(sleep.announce(0, 1));
        sleep.withdraw(0, 0);
        assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 1);
        sleep.notify_one();
        assert_eq!(
            new.get(),
            1,
            "the successor's announcement survived the old withdraw"
        );
        sleep.withdraw(0, 1);
        assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 0);

        // Old announces only after its successor did (it had checked its generation just
        // before the retirement): it must not displace the newer announcement.
        let (old, new) = (Count::default(), Count::default());
        let sleep = Sleep::new(vec![old.clone()]);
        sleep.replace(0, new.clone(), 0);
        assert!(sleep.announce(0, 1));
        assert!(!sleep.announce(0, 0), "a retired thread does not announce");
        sleep.withdraw(0, 0);
        sleep.notify_one();
        assert_eq!(new.get(), 1);
        sleep.withdraw(0, 1);
        assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 0);

        // Old announced and was not withdrawn by the retirement's time (it announced after
        // it); the successor takes the flag over, and the count stays exact.
        let (old, new) = (Count::default(), Count::default());
        let sleep = Sleep::new(vec![old.clone()]);
        sleep.replace(0, new.clone(), 0);
        assert!(sleep.announce(0, 0));
        assert!(sleep.announce(0, 1));
        assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 2);
        sleep.withdraw(0, 0);
        sleep.notify_one();
        assert_eq!(new.get(), 1);
        sleep.withdraw(0, 1);
        assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 0);
        sleep.notify_one();
        assert_eq!(
            (old.get(), new.get()),
            (1, 1),
            "nobody announced, nobody woken"
        );
    }
}

/// Model checks (loom) of the two wake-up protocols: cores sleeping and waking ([`Sleep`]),
/// and the orchestrator waiting for ring room ([`RoomSignal`]). Both are the real types,
/// compiled against loom's atomics; only the work they guard is a stand-in (an atomic flag).
/// Loom explores every interleaving and every outcome the memory model allows; a lost wake-up
/// leaves a thread parked for good, which loom reports as a deadlock. Parking here has no
/// timeout, so the models show that no wake-up relies on the real code's park timeouts. Run
/// with `RUSTFLAGS="--cfg loom" cargo test -p simpler-core --lib loom` (docs/checking.md).
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

    /// Core 0's side, as in `RunShared::idle` and `CorePool::core_main`, for its thread of
    /// generation `generation`: announce, re-check, park until the work shows up.
    fn idle_until<U: Wake>(sleep: &Sleep<U>, generation: u64, work: &AtomicBool) {
        loop {
            sleep.announce(0, generation);
            if work.load(Ordering::Relaxed) {
                sleep.withdraw(0, generation);
                break;
            }
            thread::park();
            sleep.withdraw(0, generation);
        }
    }

    /// A waker thread: publishes work (`Relaxed`: only the protocol's fences order it) and
    /// wakes one core. Not joined: an unpark token left over from `notify_one` would confuse
    /// loom's join; loom runs every thread to its end anyway.
    fn publish<U: Wake + Send + Sync + 'static>(sleep: &Arc<Sleep<U>>, work: &Arc<AtomicBool>) {
        let (s, w) = (sleep.clone(), work.clone());
        thread::spawn(move || {
            w.store(true, Ordering::Relaxed);
            s.notify_one();
        });
    }

    /// A core parks until work shows up; a waker publishes work (`Relaxed`: only the fences of
    /// the protocol order it) and calls `notify_one`.
    #[test]
    fn sleep_and_wake_lose_no_wake_up() {
        loom::model(|| {
            let sleep = Arc::new(Sleep::new(vec![thread::current()]));
            let work = Arc::new(AtomicBool::new(false));
            publish(&sleep, &work);
            idle_until(&sleep, 0, &work);
            assert_eq!(sleep.sleepers.load(Ordering::SeqCst), 0);
        });
    }

    /// Core 0 has been handed to a new thread (generation 1, this one) while its old thread
    /// (generation 0) was idle in the protocol. The old thread announces and withdraws (its
    /// park timing out) at any point; a waker publishes work. The new thread's announcement
    /// must survive the old thread, so that the waker wakes it. (With the flag a plain bool,
    /// the old thread's withdraw cleared it and loom reports the new thread parked for good.)
    /// Three threads: bounded to 3 preemptions to finish in seconds (loom's advice for models
    /// of this size); the count staying exact is the unit test's business.
    #[test]
    fn a_retired_thread_loses_its_successor_no_wake_up() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let sleep = Arc::new(Sleep::new(vec![thread::current()]));
            let work = Arc::new(AtomicBool::new(false));
            let s_old = sleep.clone();
            // Not joined, as `publish`'s waker is not.
            thread::spawn(move || {
                s_old.announce(0, 0);
                s_old.withdraw(0, 0);
            });
            publish(&sleep, &work);
            idle_until(&sleep, 1, &work);
        });
    }

    /// A run of core 0 of two: core 1 is idle in the pool, announced (and withdrawing and
    /// announcing again, its park timing out) at any point; a waker publishes work. The run's
    /// core must be woken or find the work: waking core 1 wakes nobody here, so a wake-up
    /// spent on it while core 0 sleeps would leave core 0 parked for good.
    #[test]
    fn a_core_outside_the_run_takes_no_wake_up_of_its_cores() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        /// Core 0 is this thread; waking core 1 wakes nobody this model waits for.
        enum Who {
            Core(Thread),
            Outside,
        }
        impl Wake for Who {
            fn wake(&self) {
                if let Who::Core(t) = self {
                    t.unpark();
                }
            }
        }
        model.check(|| {
            let sleep = Arc::new(Sleep::new(vec![Who::Core(thread::current()), Who::Outside]));
            sleep.set_members(1);
            let work = Arc::new(AtomicBool::new(false));
            let s1 = sleep.clone();
            thread::spawn(move || {
                s1.announce(1, 0);
                s1.withdraw(1, 0);
                s1.announce(1, 0);
            });
            publish(&sleep, &work);
            idle_until(&sleep, 0, &work);
        });
    }

    /// The ring-room protocol with the real [`RoomSignal`]: the orchestrator waits for the head
    /// slot to be consumed (as `Orchestrator::wait_for_room` does, without its park timeout);
    /// a core stores the slot's state as `RunShared::release` does (`Release`) and notifies.
    #[test]
    fn ring_room_wake_up_is_never_lost() {
        loom::model(|| {
            let room = Arc::new(RoomSignal::new(thread::current()));
            let consumed = Arc::new(AtomicBool::new(false));
            let (r2, c2) = (room.clone(), consumed.clone());
            // Not joined, as in the models above.
            thread::spawn(move || {
                c2.store(true, Ordering::Release);
                r2.notify();
            });
            loop {
                room.begin_wait();
                if consumed.load(Ordering::Acquire) {
                    break;
                }
                thread::park();
            }
            room.end_wait();
        });
    }

    /// The same protocol written out with either fence removable: the checker finds the lost
    /// wake-up when either is missing (the store-buffer pattern the fences close), so the
    /// passing model above means something. (A copy, because the real type has no way to drop
    /// a fence.)
    fn ring_room_reduced(core_fence: bool, orch_fence: bool) {
        loom::model(move || {
            let consumed = Arc::new(AtomicBool::new(false));
            let waiting = Arc::new(AtomicBool::new(false));
            let orch = thread::current();
            let (c2, w2) = (consumed.clone(), waiting.clone());
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
    fn ring_room_with_both_fences_loses_no_wake_up() {
        ring_room_reduced(true, true);
    }

    #[test]
    fn ring_room_without_the_fences_loses_wake_ups() {
        for (core_fence, orch_fence) in [(false, true), (true, false)] {
            let err = std::panic::catch_unwind(|| ring_room_reduced(core_fence, orch_fence))
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
