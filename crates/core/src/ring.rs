//! The orchestrator's side of a ring set: allocation of task-window slots, heap blocks and
//! dependency-pool entries, and in-order reclamation behind the watermark.
//!
//! All positions are monotonic counters; physical positions are taken modulo capacity. A heap
//! block never straddles the wrap point: if it does not fit before the end, the tail is skipped
//! and the block starts at offset 0. Reclamation walks from the oldest unreclaimed task and
//! stops at the first one not yet consumed, so slots, heap and pool are freed strictly in task
//! order and each freed prefix is contiguous.

use std::sync::atomic::Ordering;

use crate::slot::{RingSlots, state};

/// Heap alignment of each runtime-allocated output (a model that sizes the heap for its
/// steps pads each allocation to it).
pub const OUTPUT_ALIGN: u64 = 1024;

/// What the orchestrator remembers about a task in a slot (never shared).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SlotMeta {
    /// Heap position after this task's block (its `heap_free` once reclaimed).
    pub(crate) heap_end: u64,
    /// Pool position after this task's entries.
    pub(crate) dep_end: u64,
    /// Scope instance the task was submitted in.
    pub(crate) scope_seq: u64,
    /// Whether the task's scope reference has been dropped.
    pub(crate) scope_released: bool,
}

pub(crate) struct RingCursor {
    pub(crate) ring: u8,
    pub(crate) window: u32,
    pub(crate) next_local: u32,
    pub(crate) reclaimed: u32,
    pub(crate) heap_cap: u64,
    pub(crate) heap_alloc: u64,
    pub(crate) heap_free: u64,
    pub(crate) heap_addr: usize,
    pub(crate) dep_cap: u64,
    pub(crate) dep_alloc: u64,
    pub(crate) dep_free: u64,
    pub(crate) meta: Vec<SlotMeta>,
    pub(crate) hw_window: u64,
    pub(crate) hw_heap: u64,
    pub(crate) hw_dep: u64,
}

impl RingCursor {
    pub(crate) fn new(
        ring: u8,
        window: u32,
        heap_cap: u64,
        heap_addr: usize,
        dep_cap: u32,
    ) -> RingCursor {
        RingCursor {
            ring,
            window,
            next_local: 0,
            reclaimed: 0,
            heap_cap,
            heap_alloc: 0,
            heap_free: 0,
            heap_addr,
            dep_cap: dep_cap as u64,
            dep_alloc: 0,
            dep_free: 0,
            meta: vec![SlotMeta::default(); window as usize],
            hw_window: 0,
            hw_heap: 0,
            hw_dep: 0,
        }
    }

    /// Forgets everything of the previous run (slot metadata is overwritten on allocation).
    pub(crate) fn reset(&mut self) {
        self.next_local = 0;
        self.reclaimed = 0;
        self.heap_alloc = 0;
        self.heap_free = 0;
        self.dep_alloc = 0;
        self.dep_free = 0;
        self.hw_window = 0;
        self.hw_heap = 0;
        self.hw_dep = 0;
    }

    pub(crate) fn in_flight(&self) -> u32 {
        self.next_local - self.reclaimed
    }
    pub(crate) fn heap_used(&self) -> u64 {
        self.heap_alloc - self.heap_free
    }
    pub(crate) fn dep_used(&self) -> u64 {
        self.dep_alloc - self.dep_free
    }

    pub(crate) fn meta(&self, local: u32) -> &SlotMeta {
        &self.meta[(local & (self.window - 1)) as usize]
    }
    pub(crate) fn meta_mut(&mut self, local: u32) -> &mut SlotMeta {
        let m = self.window - 1;
        &mut self.meta[(local & m) as usize]
    }

    /// Whether another task fits the window (at most `window - 1` in flight).
    pub(crate) fn window_fits(&self) -> bool {
        self.in_flight() < self.window - 1
    }

    /// Start position for a block of `bytes`, if it fits now.
    pub(crate) fn heap_fit(&self, bytes: u64) -> Option<u64> {
        if bytes == 0 {
            return Some(self.heap_alloc);
        }
        let phys = self.heap_alloc % self.heap_cap;
        let start = if phys + bytes > self.heap_cap {
            self.heap_alloc + (self.heap_cap - phys)
        } else {
            self.heap_alloc
        };
        (start + bytes - self.heap_free <= self.heap_cap).then_some(start)
    }

    pub(crate) fn dep_fits(&self, n: u64) -> bool {
        self.dep_alloc + n - self.dep_free <= self.dep_cap
    }

    /// Takes the next slot, a heap block at `heap_start` of `bytes`, and `deps` pool entries.
    /// Returns the task's local id and the block's host address.
    pub(crate) fn allocate(
        &mut self,
        heap_start: u64,
        bytes: u64,
        deps: u64,
        scope_seq: u64,
    ) -> (u32, usize, u64) {
        let local = self.next_local;
        self.next_local += 1;
        let addr = self.heap_addr + (heap_start % self.heap_cap) as usize;
        if bytes > 0 {
            self.heap_alloc = heap_start + bytes;
        }
        let dep_start = self.dep_alloc;
        self.dep_alloc += deps;
        let (heap_end, dep_end) = (self.heap_alloc, self.dep_alloc);
        *self.meta_mut(local) = SlotMeta {
            heap_end,
            dep_end,
            scope_seq,
            scope_released: false,
        };
        self.hw_window = self.hw_window.max(self.in_flight() as u64);
        self.hw_heap = self.hw_heap.max(self.heap_used());
        self.hw_dep = self.hw_dep.max(self.dep_used());
        (local, addr, dep_start)
    }

    /// Advances the watermark over consumed tasks; returns how many were reclaimed.
    pub(crate) fn reclaim(&mut self, slots: &RingSlots) -> u32 {
        let start = self.reclaimed;
        while self.reclaimed < self.next_local {
            let s = slots.slot(self.reclaimed);
            if s.state.load(Ordering::Acquire) != state::CONSUMED {
                break;
            }
            let m = *self.meta(self.reclaimed);
            self.heap_free = m.heap_end;
            self.dep_free = m.dep_end;
            self.reclaimed += 1;
        }
        if self.reclaimed == self.next_local {
            // Empty ring: restart the heap at its base, so a block as large as the whole heap
            // fits (otherwise it could wait for a wrap that nothing will ever cause).
            let phys = self.heap_alloc % self.heap_cap;
            if phys != 0 {
                self.heap_alloc += self.heap_cap - phys;
            }
            self.heap_free = self.heap_alloc;
        }
        self.reclaimed - start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_blocks_never_straddle_the_wrap_point() {
        let mut c = RingCursor::new(1, 8, 4096, 0x10000, 16);
        let s = c.heap_fit(3072).unwrap();
        let (_, a0, _) = c.allocate(s, 3072, 0, 0);
        assert_eq!(a0, 0x10000);
        // 1024 left before the end: a 2048 block must wait (it may not straddle).
        assert!(c.heap_fit(2048).is_none());
        // Free the first block: the 2048 block goes to offset 0, skipping the 1024 tail.
        c.heap_free = c.heap_alloc;
        let s = c.heap_fit(2048).unwrap();
        let (_, a1, _) = c.allocate(s, 2048, 0, 0);
        assert_eq!(a1, 0x10000);
        // The skipped 1024-byte tail stays accounted until this block is reclaimed.
        assert_eq!(c.heap_used(), 3072);
    }

    #[test]
    fn window_keeps_one_slot_free() {
        let mut c = RingCursor::new(0, 4, 1024, 0, 4);
        for _ in 0..3 {
            assert!(c.window_fits());
            c.allocate(c.heap_alloc, 0, 0, 0);
        }
        assert!(!c.window_fits());
        assert_eq!(c.hw_window, 3);
    }
}
