//! Shared per-task state (task slots) and dependency-pool entries of the four ring sets.
//!
//! # Protocol
//! A slot is written by the orchestrator while its previous task is reclaimed and before the new
//! task is published; cores read it after publication (the ready-queue push/pop or the
//! `fanin` release/acquire pair orders the writes). Three counters drive a task:
//! - `fanin`: producers not yet completed, plus one guard the orchestrator drops at the end of
//!   submit. Whoever brings it to zero makes the task ready.
//! - `refs`: one for the task's scope, one for its own completion, one per consumer edge.
//!   Whoever brings it to zero marks the task consumed; only the orchestrator reclaims consumed
//!   slots (in order), so a slot is never reused behind anyone's back.
//! - `fanout`: under a small mutex, the `completed` flag and the head of the list of consumer
//!   edges. An edge is linked only while the producer is not completed; completion sets the flag
//!   and takes the list in one critical section, so no edge is lost or walked twice.

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::claim::BlockClaims;
use crate::kernel::TaskDesc;
use crate::task::TaskId;

/// "No entry" in a dependency list.
pub(crate) const NO_ENTRY: u64 = u64::MAX;
/// "No task" in a slot's `local`.
pub(crate) const NO_TASK: u32 = u32::MAX;

/// Task life cycle.
pub(crate) mod state {
    pub(crate) const PENDING: u8 = 0;
    pub(crate) const READY: u8 = 1;
    pub(crate) const RUNNING: u8 = 2;
    pub(crate) const COMPLETED: u8 = 3;
    pub(crate) const CONSUMED: u8 = 4;

    pub(crate) fn name(s: u8) -> &'static str {
        match s {
            PENDING => "pending (waiting for producers)",
            READY => "ready (queued)",
            RUNNING => "running",
            COMPLETED => "completed (held by consumers or its scope)",
            _ => "consumed",
        }
    }
}

pub(crate) struct Fanout {
    pub(crate) completed: bool,
    pub(crate) head: u64,
}

/// Shared state of one task slot.
pub(crate) struct Slot {
    /// Ring-local sequence number of the task the slot holds (`NO_TASK` before the first):
    /// tells a stale `TaskId` from the slot's current task.
    pub(crate) task_local: AtomicU32,
    pub(crate) state: AtomicU8,
    pub(crate) fanin: AtomicU32,
    pub(crate) refs: AtomicU32,
    /// Blocks claimed and finished (the claiming protocol is `claim`'s).
    pub(crate) blocks: BlockClaims,
    /// First dependency-pool entry of this task's producer list (in its own ring's pool).
    pub(crate) dep_start: AtomicU64,
    pub(crate) dep_count: AtomicU32,
    pub(crate) fanout: Mutex<Fanout>,
    pub(crate) desc: Mutex<Arc<TaskDesc>>,
}

impl Slot {
    fn new(empty: &Arc<TaskDesc>) -> Slot {
        Slot {
            task_local: AtomicU32::new(NO_TASK),
            state: AtomicU8::new(state::CONSUMED),
            fanin: AtomicU32::new(0),
            refs: AtomicU32::new(0),
            blocks: BlockClaims::new(),
            dep_start: AtomicU64::new(0),
            dep_count: AtomicU32::new(0),
            fanout: Mutex::new(Fanout {
                completed: true,
                head: NO_ENTRY,
            }),
            desc: Mutex::new(empty.clone()),
        }
    }

    pub(crate) fn fanout(&self) -> MutexGuard<'_, Fanout> {
        // A poisoned lock only means a panic elsewhere while holding it; the data (a flag and a
        // list head) is always consistent, so keep going.
        self.fanout.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn desc(&self) -> Arc<TaskDesc> {
        self.desc.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes a reference unless the task is already consumed.
    pub(crate) fn try_acquire(&self) -> bool {
        self.refs
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                if r == 0 { None } else { Some(r + 1) }
            })
            .is_ok()
    }
}

/// A dependency edge, linked into its producer's fan-out list and counted in its consumer's
/// fan-in range.
pub(crate) struct DepEntry {
    pub(crate) producer: AtomicU64,
    pub(crate) consumer: AtomicU64,
    pub(crate) next: AtomicU64,
}

/// Packs a pool position into an entry reference: `(ring << 32) | index`.
pub(crate) fn entry_ref(ring: u8, index: u32) -> u64 {
    ((ring as u64) << 32) | index as u64
}

/// The shared arrays of one ring set.
pub(crate) struct RingSlots {
    pub(crate) slots: Box<[Slot]>,
    pub(crate) mask: u32,
    pub(crate) entries: Box<[DepEntry]>,
}

impl RingSlots {
    pub(crate) fn new(window: u32, dep_pool: u32) -> RingSlots {
        // One shared placeholder description: a slot gets its own when its first task is
        // submitted (so building a 16K-slot ring costs no per-slot allocation).
        let empty = Arc::new(TaskDesc::empty());
        RingSlots {
            slots: (0..window).map(|_| Slot::new(&empty)).collect(),
            mask: window - 1,
            entries: (0..dep_pool)
                .map(|_| DepEntry {
                    producer: AtomicU64::new(0),
                    consumer: AtomicU64::new(0),
                    next: AtomicU64::new(NO_ENTRY),
                })
                .collect(),
        }
    }

    pub(crate) fn slot(&self, local: u32) -> &Slot {
        &self.slots[(local & self.mask) as usize]
    }

    /// Entry at monotonic pool position `pos`.
    pub(crate) fn entry_at(&self, pos: u64) -> &DepEntry {
        &self.entries[(pos % self.entries.len() as u64) as usize]
    }
}

/// The four ring sets' shared arrays.
pub(crate) struct Rings {
    pub(crate) rings: Vec<RingSlots>,
}

impl Rings {
    pub(crate) fn slot(&self, id: TaskId) -> &Slot {
        self.rings[id.ring() as usize].slot(id.local())
    }

    pub(crate) fn entry(&self, r: u64) -> &DepEntry {
        let ring = (r >> 32) as usize;
        let idx = r as u32 as usize;
        &self.rings[ring].entries[idx]
    }

    /// Whether `id` is a task of the current run that has not completed yet.
    pub(crate) fn is_live(&self, id: TaskId) -> bool {
        let s = self.slot(id);
        s.task_local.load(Ordering::Acquire) == id.local()
            && s.state.load(Ordering::Acquire) < state::COMPLETED
    }
}
