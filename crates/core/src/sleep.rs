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

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};

use crossbeam_utils::sync::Unparker;

pub(crate) struct Sleep {
    flags: Box<[AtomicBool]>,
    sleepers: AtomicUsize,
    unparkers: Box<[Mutex<Unparker>]>,
}

impl Sleep {
    pub(crate) fn new(unparkers: Vec<Unparker>) -> Sleep {
        Sleep {
            flags: unparkers.iter().map(|_| AtomicBool::new(false)).collect(),
            sleepers: AtomicUsize::new(0),
            unparkers: unparkers.into_iter().map(Mutex::new).collect(),
        }
    }

    /// Replaces core `i`'s unparker (a new thread took over the core).
    pub(crate) fn replace(&self, i: usize, u: Unparker) {
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
            .unpark();
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

#[cfg(test)]
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
