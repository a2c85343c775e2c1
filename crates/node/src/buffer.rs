//! Shared buffers: memory mapped in the parent and in every child, created at any time.

use crate::shm::Segment;

/// Names a shared buffer in the parent and in every child.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SharedBufferId(pub(crate) u64);

impl SharedBufferId {
    /// The id as a number (to pass it to a child in a call's arguments).
    pub fn to_bits(self) -> u64 {
        self.0
    }

    /// The id from [`SharedBufferId::to_bits`].
    pub fn from_bits(bits: u64) -> SharedBufferId {
        SharedBufferId(bits)
    }
}

/// A buffer mapped in every process of the node. Its bytes are shared with other processes,
/// so they are reached only by copies whose callers promise that no other process writes the
/// same bytes meanwhile (the node's calls order the processes: a command's effects are
/// visible to the parent once it has been answered).
pub struct SharedBuffer {
    id: SharedBufferId,
    segment: Segment,
}

impl SharedBuffer {
    pub(crate) fn new(id: SharedBufferId, segment: Segment) -> SharedBuffer {
        SharedBuffer { id, segment }
    }

    /// Its id.
    pub fn id(&self) -> SharedBufferId {
        self.id
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.segment.len()
    }

    /// Whether it is empty (never: buffers have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.segment.len() == 0
    }

    /// Base address in this process (page-aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.segment.ptr()
    }

    /// Copies `dst.len()` bytes from `offset` into `dst`.
    ///
    /// # Safety
    /// No process writes `offset .. offset + dst.len()` while this runs.
    ///
    /// # Panics
    /// If the range is outside the buffer.
    pub unsafe fn read(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            offset
                .checked_add(dst.len())
                .is_some_and(|e| e <= self.len())
        );
        // SAFETY: in bounds (checked); no concurrent writer (contract).
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), dst.as_mut_ptr(), dst.len())
        };
    }

    /// Copies `src` to `offset`.
    ///
    /// # Safety
    /// No other process reads or writes `offset .. offset + src.len()` while this runs.
    ///
    /// # Panics
    /// If the range is outside the buffer.
    pub unsafe fn write(&self, offset: usize, src: &[u8]) {
        assert!(
            offset
                .checked_add(src.len())
                .is_some_and(|e| e <= self.len())
        );
        // SAFETY: in bounds (checked); no concurrent access (contract).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.as_ptr().add(offset), src.len())
        };
    }
}
