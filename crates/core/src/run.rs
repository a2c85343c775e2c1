//! State shared by everyone taking part in one run: the ring arrays, ready queues, counters, the
//! fatal latch and the completion signal.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use crossbeam_deque::Injector;
use crossbeam_utils::sync::Unparker;

use crate::buffer::Buffer;
use crate::config::RingSizes;
use crate::error::{PlatformError, RunError};
use crate::kernel::Registry;
use crate::platform::{Memory, Platform};
use crate::ring::RingCursor;
use crate::sleep::{CoreWake, RoomSignal};
use crate::slot::{RingSlots, Rings};
use crate::task::{EngineClass, TIMING_SLOTS, TaskId};
use crate::tensormap::TensorMap;
use crate::trace::{PhaseRecord, QueueDepthSample, TaskRecord};

/// Ring arrays and heap memory; kept by the worker across runs of the same sizes.
pub(crate) struct Arena {
    pub(crate) sizes: RingSizes,
    pub(crate) rings: Rings,
    pub(crate) heaps: Vec<Box<dyn Memory>>,
    /// The orchestrator's cursors and dependency map, parked here between runs so a run does
    /// not rebuild them (only the orchestrator thread takes them).
    pub(crate) parked_orchestrator: Mutex<Option<(Vec<RingCursor>, TensorMap)>>,
}

impl Arena {
    pub(crate) fn new(sizes: RingSizes, platform: &dyn Platform) -> Result<Arena, PlatformError> {
        let mut rings = Vec::new();
        let mut heaps = Vec::new();
        for r in 0..crate::config::RING_COUNT {
            rings.push(RingSlots::new(sizes.window[r], sizes.dep_pool[r]));
            heaps.push(platform.alloc(sizes.heap[r] as usize)?);
        }
        Ok(Arena {
            sizes,
            rings: Rings { rings },
            heaps,
            parked_orchestrator: Mutex::new(None),
        })
    }
}

/// How long cores get to leave a failed run before those still inside user code (a kernel or a
/// dispatch predicate that ignores cancellation) are left behind and their cores handed to new
/// threads.
pub(crate) const GRACE: Duration = Duration::from_millis(300);

/// The user buffers a run holds bound: while they are here, host copies fail and no other run
/// can bind them, and the memory stays alive.
///
/// A run releases them once no core or orchestrator of the run can touch them any more: at the
/// end of a run whose cores have all left, or else when the run's last handle is dropped, which
/// a core left behind inside a kernel holds until that kernel returns (so memory a kernel may
/// still write is neither unbound nor freed).
#[derive(Default)]
pub(crate) struct BoundBuffers(Mutex<Vec<Buffer>>);

impl BoundBuffers {
    pub(crate) fn push(&self, b: Buffer) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(b);
    }

    /// Unbinds and drops every buffer (idempotent).
    pub(crate) fn release(&self) {
        let bufs = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        for b in bufs {
            b.unbind();
        }
    }
}

impl Drop for BoundBuffers {
    fn drop(&mut self) {
        self.release();
    }
}

/// First writer wins; later errors are dropped.
#[derive(Default)]
pub(crate) struct FatalLatch {
    /// Written once (first writer wins).
    error: OnceLock<RunError>,
    pub(crate) stop: AtomicBool,
}

impl FatalLatch {
    /// The latched error. Visible as soon as it is latched, before `stop` is raised: a thread
    /// that lost the race to latch reads the winner's error here at once.
    pub(crate) fn get(&self) -> Option<&RunError> {
        self.error.get()
    }
}

/// Per-core state of a run: what it is running (for the watchdog) and its swimlane buffers.
#[derive(Default)]
pub(crate) struct CoreState {
    /// The generation + 1 of the core thread inside this run's core loop, 0 when none is.
    pub(crate) inside: AtomicU64,
    /// Task id + 1 of the block being executed, 0 when idle.
    pub(crate) current: AtomicU64,
    /// Blocks this core ran.
    pub(crate) blocks: AtomicU64,
    pub(crate) records: Mutex<Vec<TaskRecord>>,
    pub(crate) phases: Mutex<Vec<PhaseRecord>>,
    pub(crate) depth: Mutex<Vec<QueueDepthSample>>,
}

/// Min dispatch / max finish of the tasks tagged with one timing slot.
pub(crate) struct SlotTiming {
    pub(crate) first_dispatch: AtomicU64,
    pub(crate) last_finish: AtomicU64,
    pub(crate) tasks: AtomicU64,
}

impl Default for SlotTiming {
    fn default() -> SlotTiming {
        SlotTiming {
            first_dispatch: AtomicU64::new(u64::MAX),
            last_finish: AtomicU64::new(0),
            tasks: AtomicU64::new(0),
        }
    }
}

/// A barrier for the blocks of a gang (sync-start task); reusable, gives up when the run fails.
pub(crate) struct SpinBarrier {
    count: u32,
    arrived: AtomicU32,
    generation: AtomicU32,
    cancel: Arc<AtomicBool>,
}

impl SpinBarrier {
    pub(crate) fn new(count: u32, cancel: Arc<AtomicBool>) -> SpinBarrier {
        SpinBarrier {
            count,
            arrived: AtomicU32::new(0),
            generation: AtomicU32::new(0),
            cancel,
        }
    }
}

impl crate::kernel::GangBarrier for SpinBarrier {
    fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.count {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::AcqRel);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            if self.cancel.load(Ordering::Relaxed) {
                return;
            }
            spins += 1;
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// A gang being formed: cores join one by one, each taking the next block.
pub(crate) struct GangForm {
    pub(crate) task: TaskId,
    pub(crate) need: u32,
    pub(crate) joined: u32,
    pub(crate) barrier: Arc<SpinBarrier>,
}

/// Everything the cores, the orchestrator, the watchdog and the host waiter share in one run.
pub(crate) struct RunShared {
    /// The run's process-unique epoch (also carried by its outputs).
    pub(crate) epoch: u64,
    pub(crate) arena: Arc<Arena>,
    /// Wakes the cores and tells replaced core threads to leave (the run's only view of the
    /// core pool).
    pub(crate) wake: Arc<CoreWake>,
    pub(crate) registry: Arc<Registry>,
    pub(crate) queues: [Injector<TaskId>; 3],
    pub(crate) fatal: FatalLatch,
    pub(crate) cancel: Arc<AtomicBool>,
    /// Submitted but not completed, plus one while the orchestration runs.
    pub(crate) outstanding: AtomicI64,
    pub(crate) submitted: AtomicU64,
    pub(crate) skipped: AtomicU64,
    pub(crate) edges: AtomicU64,
    /// Closed in serial mode until the orchestration returns.
    pub(crate) dispatch_open: AtomicBool,
    /// The user buffers bound to this run.
    pub(crate) bound: BoundBuffers,
    /// Set when the run is over (success or failure): cores leave.
    pub(crate) finished: AtomicBool,
    pub(crate) orch_done: AtomicBool,
    /// Wakes the orchestrator when it waits for ring room (or the run fails).
    pub(crate) room: RoomSignal,
    pub(crate) done: Mutex<bool>,
    pub(crate) done_cv: Condvar,
    pub(crate) cores: Box<[CoreState]>,
    pub(crate) gang: Mutex<Option<GangForm>>,
    pub(crate) gang_pending: AtomicBool,
    pub(crate) timing_slots: [SlotTiming; TIMING_SLOTS],
    pub(crate) sched_start: AtomicU64,
    pub(crate) sched_end: AtomicU64,
    pub(crate) swimlane: u8,
    pub(crate) swimlane_cap_per_core: usize,
    pub(crate) dropped: AtomicU64,
    /// Of `dropped`, the kernel (task block) records: a swimlane missing none of them still
    /// gives each core's busy time.
    pub(crate) tasks_dropped: AtomicU64,
    /// Cores that can run each class (index by `EngineClass::index`).
    pub(crate) class_cores: [u32; 3],
    /// Whether tensor memory is host memory (the orchestrator may copy data in and out).
    pub(crate) host_memory: bool,
}

/// What a run is made of besides its own counters and queues.
pub(crate) struct RunParts {
    pub(crate) epoch: u64,
    pub(crate) arena: Arc<Arena>,
    pub(crate) wake: Arc<CoreWake>,
    pub(crate) registry: Arc<Registry>,
    pub(crate) bound: BoundBuffers,
    pub(crate) orch_unparker: Unparker,
    pub(crate) cores: usize,
    pub(crate) serial: bool,
    pub(crate) swimlane: u8,
    pub(crate) swimlane_capacity: usize,
    pub(crate) host_memory: bool,
}

impl RunShared {
    /// A run that has not started: nothing submitted, the orchestration's unit of outstanding
    /// work held.
    pub(crate) fn new(p: RunParts) -> RunShared {
        let n = p.cores;
        RunShared {
            epoch: p.epoch,
            arena: p.arena,
            wake: p.wake,
            registry: p.registry,
            queues: Default::default(),
            fatal: FatalLatch::default(),
            cancel: Arc::new(AtomicBool::new(false)),
            outstanding: AtomicI64::new(1),
            submitted: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            edges: AtomicU64::new(0),
            dispatch_open: AtomicBool::new(!p.serial),
            bound: p.bound,
            finished: AtomicBool::new(false),
            orch_done: AtomicBool::new(false),
            room: RoomSignal::new(p.orch_unparker),
            done: Mutex::new(false),
            done_cv: Condvar::new(),
            cores: (0..n).map(|_| CoreState::default()).collect(),
            gang: Mutex::new(None),
            gang_pending: AtomicBool::new(false),
            timing_slots: Default::default(),
            sched_start: AtomicU64::new(0),
            sched_end: AtomicU64::new(0),
            swimlane: p.swimlane,
            swimlane_cap_per_core: if p.swimlane > 0 {
                p.swimlane_capacity.div_ceil(n).max(1)
            } else {
                0
            },
            dropped: AtomicU64::new(0),
            tasks_dropped: AtomicU64::new(0),
            class_cores: [n as u32; 3],
            host_memory: p.host_memory,
        }
    }
}

impl RunShared {
    pub(crate) fn slot(&self, id: TaskId) -> &crate::slot::Slot {
        self.arena.rings.slot(id)
    }

    pub(crate) fn queue(&self, class: EngineClass) -> &Injector<TaskId> {
        &self.queues[class.index()]
    }

    pub(crate) fn queues_empty(&self) -> bool {
        self.queues.iter().all(|q| q.is_empty())
    }

    pub(crate) fn queued(&self) -> usize {
        self.queues.iter().map(|q| q.len()).sum()
    }

    /// Latches `err` (first writer wins) and stops everyone.
    pub(crate) fn fail(&self, err: RunError) {
        if self.fatal.error.set(err).is_ok() {
            self.fatal.stop.store(true, Ordering::Release);
            self.cancel.store(true, Ordering::Release);
            self.wake.sleep.notify_all();
            self.room.wake();
            self.signal_done();
        }
    }

    pub(crate) fn stopped(&self) -> bool {
        self.fatal.stop.load(Ordering::Acquire)
    }

    pub(crate) fn signal_done(&self) {
        let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
        *d = true;
        self.done_cv.notify_all();
    }

    /// Waits up to `timeout` for every core to leave this run's core loop; true if they all
    /// did. Call after setting `finished`.
    ///
    /// Soundness: a core stores `inside` and then loads `finished`, this side stores `finished`
    /// and then loads `inside`, all `SeqCst`: in the single total order one of the two stores
    /// comes first, so either this side sees the core inside, or the core sees `finished` and
    /// leaves without dispatching anything. Once every `inside` reads 0, no core can touch the
    /// run's memory again.
    pub(crate) fn wait_cores_left(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            if self.cores_left() {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            spins += 1;
            if spins < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    pub(crate) fn cores_left(&self) -> bool {
        self.cores
            .iter()
            .all(|c| c.inside.load(Ordering::SeqCst) == 0)
    }

    /// Waits up to `timeout` for the run to be over; true if it is.
    pub(crate) fn wait_done(&self, timeout: Duration) -> bool {
        let d = self.done.lock().unwrap_or_else(|p| p.into_inner());
        let (d, _) = self
            .done_cv
            .wait_timeout_while(d, timeout, |d| !*d)
            .unwrap_or_else(|p| p.into_inner());
        *d
    }

    /// Drops one unit of outstanding work; the last one signals completion.
    pub(crate) fn finish_one(&self) {
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.sched_end
                .store(crate::clock::now_ns(), Ordering::Release);
            self.signal_done();
        }
    }

    /// The orchestrator drops its own reference to `id` (its scope ended); the last one marks it
    /// consumed. The orchestrator is not waiting while it does this, so no wake-up (and no
    /// fence: a scope's end releases thousands of tasks in a row, on the thread that submits).
    pub(crate) fn release_by_orchestrator(&self, id: TaskId) {
        let s = self.slot(id);
        if s.refs.fetch_sub(1, Ordering::AcqRel) == 1 {
            s.state
                .store(crate::slot::state::CONSUMED, Ordering::Release);
        }
    }

    /// Drops a reference to `id` (from a core, or from a completion on any thread); the last
    /// one marks it consumed and wakes the orchestrator if it waits for ring room.
    pub(crate) fn release(&self, id: TaskId) {
        let s = self.slot(id);
        if s.refs.fetch_sub(1, Ordering::AcqRel) == 1 {
            // `RoomSignal`'s protocol (model-checked with this `Release` store in
            // `sleep::loom_tests::ring_room_wake_up_is_never_lost`): the state first, then the
            // fence and the look at whether the orchestrator waits.
            s.state
                .store(crate::slot::state::CONSUMED, Ordering::Release);
            self.room.notify();
        }
    }
}

#[cfg(test)]
impl RunShared {
    /// A run on a tiny arena of host memory, for unit tests of what watches a run.
    pub(crate) fn for_test(cores: usize) -> RunShared {
        use crate::config::RING_COUNT;
        use crate::platform::test_memory::HostVec;
        use crossbeam_utils::sync::Parker;
        let arena = Arena {
            sizes: RingSizes {
                window: [4; RING_COUNT],
                heap: [1024; RING_COUNT],
                dep_pool: [4; RING_COUNT],
            },
            rings: Rings {
                rings: (0..RING_COUNT).map(|_| RingSlots::new(4, 4)).collect(),
            },
            heaps: (0..RING_COUNT)
                .map(|_| Box::new(HostVec::new(1024)) as Box<dyn Memory>)
                .collect(),
            parked_orchestrator: Mutex::new(None),
        };
        let unparkers = (0..cores).map(|_| Parker::new().unparker().clone());
        RunShared::new(RunParts {
            epoch: crate::tensor::fresh_run_epoch(),
            arena: Arc::new(arena),
            wake: Arc::new(CoreWake::new(
                crate::sleep::Sleep::new(unparkers.collect()),
                crate::config::DEFAULT_IDLE_SPIN,
            )),
            registry: Arc::default(),
            bound: BoundBuffers::default(),
            orch_unparker: Parker::new().unparker().clone(),
            cores,
            serial: false,
            swimlane: 0,
            swimlane_capacity: 0,
            host_memory: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn a_latched_error_is_visible_before_stop_is_raised() {
        // The window between a winner's `set` and its `stop` store: a loser must still find the
        // winner's error (`Orchestrator::fail` relied on it and panicked with "latched").
        let latch = FatalLatch::default();
        let e = RunError::new(ErrorCode::KernelFailed, "first", "hint");
        assert!(latch.error.set(e).is_ok());
        assert!(!latch.stop.load(Ordering::Acquire));
        assert_eq!(latch.get().map(|e| e.detail.as_str()), Some("first"));
    }
}
