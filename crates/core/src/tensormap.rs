//! The dependency map (TensorMap): for each buffer, the live writers and readers of its regions.
//!
//! Readers (`Input`) wait for the live writers of overlapping regions; writers (`InOut`,
//! `OutputExisting`) wait for the live writers *and readers* of overlapping regions, so
//! write-after-read and write-after-write are ordered like read-after-write and safe code never
//! gets a slice that a running task also holds. A writer that waited for every entry its region
//! covers retires them: later tasks wait for it, and it waited for them.
//!
//! Owned by the orchestrator alone, so it needs no locking. Entries of tasks that have
//! completed are invalidated lazily (dropped when a lookup meets them) and swept in a batch when
//! the map reaches its capacity; the orchestrator applies back-pressure (waits for completions)
//! when a sweep does not free enough room.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::slot::Rings;
use crate::task::TaskId;
use crate::tensor::{BufferId, Region, Relation};

/// A hasher for small integer keys (buffer ids): one multiply, no DoS concerns here.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

struct MapEntry {
    task: TaskId,
    region: Region,
}

/// A buffer's live entries. Readers are kept apart from writers so a reader's lookup, which
/// waits only for writers, does not walk the (possibly many) readers before it: one writer
/// fanning out to N readers costs O(N) at submit, not O(N²).
#[derive(Default)]
struct BufferWriters {
    /// Writes recorded on this buffer so far (the tensor "version").
    version: u32,
    writers: Vec<MapEntry>,
    readers: Vec<MapEntry>,
}

/// Appends the live entries of `entries` overlapping `region` to `out`, dropping (and
/// uncounting from `len`) those of completed tasks.
fn scan(
    entries: &mut Vec<MapEntry>,
    region: &Region,
    live: &dyn Fn(TaskId) -> bool,
    len: &mut u64,
    out: &mut Vec<Hit>,
) {
    let mut i = 0;
    while i < entries.len() {
        let e = &entries[i];
        if !live(e.task) {
            entries.swap_remove(i);
            *len -= 1;
            continue;
        }
        let relation = region.relate(&e.region);
        if relation.overlaps() {
            out.push(Hit {
                task: e.task,
                relation,
            });
        }
        i += 1;
    }
}

/// A live task found by a lookup, and how the looked-up region relates to the task's.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hit {
    pub(crate) task: TaskId,
    pub(crate) relation: Relation,
}

pub(crate) struct TensorMap {
    buffers: IdMap<BufferId, BufferWriters>,
    len: u64,
    capacity: u64,
    high_water: u64,
    /// Treat every task of the run as live (a capturing run): lookups then find every earlier
    /// overlapping access not retired by a covering writer, whether or not it has completed,
    /// so the recorded edges do not depend on how far execution got (a replay runs with other
    /// timing). Entries then leave only when retired.
    keep_completed: bool,
}

impl TensorMap {
    pub(crate) fn new(capacity: u64) -> TensorMap {
        TensorMap {
            buffers: IdMap::default(),
            len: 0,
            capacity,
            high_water: 0,
            keep_completed: false,
        }
    }

    /// Keeps entries of completed tasks until the next reset (see `keep_completed`).
    pub(crate) fn keep_completed(&mut self) {
        self.keep_completed = true;
    }

    /// Whether entries of completed tasks are kept (a capturing run).
    pub(crate) fn keeps_completed(&self) -> bool {
        self.keep_completed
    }

    fn liveness<'a>(keep: bool, rings: &'a Rings) -> impl Fn(TaskId) -> bool + 'a {
        move |t| keep || rings.is_live(t)
    }

    /// Forgets every entry, keeping the allocations.
    pub(crate) fn reset(&mut self, capacity: u64) {
        self.buffers.clear();
        self.len = 0;
        self.capacity = capacity;
        self.high_water = 0;
        self.keep_completed = false;
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }
    pub(crate) fn high_water(&self) -> u64 {
        self.high_water
    }

    /// Current version of a buffer (number of recorded writes).
    pub(crate) fn version(&self, buffer: BufferId) -> u32 {
        self.buffers.get(&buffer).map_or(0, |b| b.version)
    }

    /// Appends to `out` every live writer (and, with `readers`, every live reader) whose region
    /// overlaps `region`, dropping entries of tasks that have completed.
    pub(crate) fn lookup(
        &mut self,
        region: &Region,
        readers: bool,
        rings: &Rings,
        out: &mut Vec<Hit>,
    ) {
        let Some(b) = self.buffers.get_mut(&region.buffer) else {
            return;
        };
        let live = Self::liveness(self.keep_completed, rings);
        scan(&mut b.writers, region, &live, &mut self.len, out);
        if readers {
            scan(&mut b.readers, region, &live, &mut self.len, out);
        }
    }

    /// Whether `n` more entries fit, sweeping completed writers first if needed.
    pub(crate) fn make_room(&mut self, n: u64, rings: &Rings) -> bool {
        if self.len + n <= self.capacity {
            return true;
        }
        self.sweep(rings);
        self.len + n <= self.capacity
    }

    /// Drops every entry whose task has completed.
    pub(crate) fn sweep(&mut self, rings: &Rings) {
        let mut len = 0;
        let live = Self::liveness(self.keep_completed, rings);
        self.buffers.retain(|_, b| {
            b.writers.retain(|e| live(e.task));
            b.readers.retain(|e| live(e.task));
            len += (b.writers.len() + b.readers.len()) as u64;
            !b.writers.is_empty() || !b.readers.is_empty() || b.version > 0
        });
        self.len = len;
    }

    /// Records `task` as the newest writer of `region`. A writer that waited for every live
    /// entry overlapping its region (`retire_covered`: it was looked up with readers) retires
    /// the entries its region covers.
    pub(crate) fn record_writer(&mut self, task: TaskId, region: Region, retire_covered: bool) {
        let b = self.buffers.entry(region.buffer).or_default();
        if retire_covered {
            let before = b.writers.len() + b.readers.len();
            b.writers
                .retain(|e| region.relate(&e.region) != Relation::Covers);
            b.readers
                .retain(|e| region.relate(&e.region) != Relation::Covers);
            self.len -= (before - b.writers.len() - b.readers.len()) as u64;
        }
        b.writers.push(MapEntry { task, region });
        b.version = b.version.wrapping_add(1);
        self.len += 1;
        self.high_water = self.high_water.max(self.len);
    }

    /// Records `task` as a reader of `region` (later writers of an overlapping region wait for
    /// it).
    pub(crate) fn record_reader(&mut self, task: TaskId, region: Region) {
        let b = self.buffers.entry(region.buffer).or_default();
        b.readers.push(MapEntry { task, region });
        self.len += 1;
        self.high_water = self.high_water.max(self.len);
    }
}
