//! The kernel path is chosen process-wide (`simpler_kernels_cpu::set_process_isa`) so that it
//! reaches a worker's threads, and the tests of one binary run in parallel. A test that
//! switches paths holds this lock exclusively; every other test that compares two runs bit
//! for bit holds it shared, so both its runs take one path. Without it, a switch landing
//! between a test's two runs gives them different (each correct) bits. Not every binary that
//! includes `common` switches paths, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static PROCESS_ISA: RwLock<()> = RwLock::new(());

/// The lock held by a test that switches paths; dropped, it restores the default path, so a
/// test that panicked mid-switch leaves the next ones on the default.
pub(crate) struct Switching(#[allow(dead_code)] RwLockWriteGuard<'static, ()>);

impl Drop for Switching {
    fn drop(&mut self) {
        simpler_kernels_cpu::set_process_isa(None);
    }
}

/// Held while a test switches the process-wide path.
pub(crate) fn switching_paths() -> Switching {
    // Poisoned by a test that panicked holding it: that test's guard restored the path.
    Switching(PROCESS_ISA.write().unwrap_or_else(|e| e.into_inner()))
}

/// Held while a test relies on the path staying the same.
pub(crate) fn same_path_throughout() -> RwLockReadGuard<'static, ()> {
    PROCESS_ISA.read().unwrap_or_else(|e| e.into_inner())
}
