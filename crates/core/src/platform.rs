//! The [`Platform`] trait a platform implements (CPU threads, CUDA), and platform memory.

use std::sync::Arc;
use std::thread::JoinHandle;

use crate::error::PlatformError;

/// A block of platform memory. For host-memory platforms `addr` is a host pointer kernels
/// dereference; for device platforms it is a device address.
///
/// # Safety
/// The runtime's unsafe code trusts an implementation: `addr .. addr + len` is one allocation
/// that stays valid, and is not used by anything but the runtime and its kernels, until the
/// value is dropped; `addr` is aligned to at least 64 bytes; `addr` and `len` never change; and
/// when `host_accessible` is true the range is readable and writable host memory.
pub unsafe trait Memory: Send + Sync {
    /// Base address (aligned to at least 64 bytes).
    fn addr(&self) -> usize;
    /// Size in bytes.
    fn len(&self) -> usize;
    /// Whether the size is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether the host can read and write `addr .. addr+len` directly.
    fn host_accessible(&self) -> bool;
}

/// What a platform is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlatformInfo {
    /// Short name (`cpu`, `cuda`).
    pub name: String,
    /// Cores used when the worker does not ask for a count.
    pub default_cores: usize,
    /// Whether kernel bodies run on the host and may dereference tensor addresses. Where it is
    /// false, a kernel body still runs on a core's thread, but `TaskCtx`'s tensor accessors
    /// refuse every tensor (the memory may be a device's), as the orchestrator's data access does.
    pub host_kernels: bool,
}

/// A platform: memory and the threads that act as its cores.
///
/// The core's scheduler runs on the threads the platform starts ([`Platform::spawn_core`]); a
/// platform decides how those threads are made (names, pinning) and where memory lives.
///
/// # Safety
/// `alloc` returns memory of at least `bytes` bytes that upholds [`Memory`]'s contract, zeroed
/// (every bit pattern of every element type is valid, so kernels may read it before any
/// write); when [`PlatformInfo::host_kernels`] is true, that memory is host memory kernels may
/// dereference. `spawn_core` runs `body` exactly once on a new thread.
pub unsafe trait Platform: Send + Sync + 'static {
    /// Description.
    fn info(&self) -> PlatformInfo;
    /// Allocates `bytes` of zeroed memory.
    fn alloc(&self, bytes: usize) -> Result<Box<dyn Memory>, PlatformError>;
    /// Starts the thread of core `index`, running `body` until it returns.
    fn spawn_core(
        &self,
        index: usize,
        body: Box<dyn FnOnce() + Send>,
    ) -> Result<JoinHandle<()>, PlatformError>;
    /// Bytes the platform can still allocate now, and where that figure comes from, if it
    /// knows; callers size caches from it (a server's KV cache) and must ask for an explicit
    /// size where it is `None`.
    fn memory_available(&self) -> Option<(u64, String)> {
        None
    }
    /// The OS scheduler's counters of the calling thread, readable from any thread, or `None`
    /// when the platform cannot read them. Called by each core thread as it starts; a run
    /// recording a swimlane reads them before and after to tell the time the OS gave a core's
    /// CPU to other processes from the runtime's own time outside kernels
    /// ([`crate::RunReport::descheduled_ns`]).
    fn current_thread_counters(&self) -> Option<Arc<dyn ThreadCounters>> {
        None
    }
}

/// Cumulative scheduler times of one thread since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadTimes {
    /// Time the thread ran on a CPU.
    pub on_cpu_ns: u64,
    /// Time the thread was runnable but waiting for a CPU (the OS ran something else).
    pub waiting_ns: u64,
}

/// The scheduler counters of one thread ([`Platform::current_thread_counters`]).
pub trait ThreadCounters: Send + Sync {
    /// The thread's times now, or `None` when they cannot be read (the thread has exited).
    fn read(&self) -> Option<ThreadTimes>;
}

/// Host memory for the core's unit tests (no platform crate is a dependency of the core).
#[cfg(test)]
pub(crate) mod test_memory {
    use super::Memory;

    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Line([u8; 64]);

    /// Zeroed, 64-byte aligned host memory.
    pub(crate) struct HostVec {
        /// Owned (freed in `drop`); kept raw, because moving a `Box` would assert unique
        /// access and invalidate the address handed out.
        lines: *mut [Line],
        addr: usize,
        len: usize,
    }

    impl HostVec {
        pub(crate) fn new(len: usize) -> HostVec {
            let lines =
                Box::into_raw(vec![Line([0; 64]); len.div_ceil(64).max(1)].into_boxed_slice());
            // Exposed: the runtime keeps addresses as integers and casts them back.
            let addr = lines.cast::<Line>().expose_provenance();
            HostVec { lines, addr, len }
        }
    }

    impl Drop for HostVec {
        fn drop(&mut self) {
            // SAFETY: `lines` came from `Box::into_raw` in `new` and is freed only here.
            drop(unsafe { Box::from_raw(self.lines) });
        }
    }

    // SAFETY: the memory is owned by the value and only reached through its address.
    unsafe impl Send for HostVec {}
    // SAFETY: as above; `&HostVec` only exposes the address and length.
    unsafe impl Sync for HostVec {}

    // SAFETY: `addr .. addr + len` lies in the allocation `lines`, which lives until drop;
    // 64-byte aligned; host memory.
    unsafe impl Memory for HostVec {
        fn addr(&self) -> usize {
            self.addr
        }
        fn len(&self) -> usize {
            self.len
        }
        fn host_accessible(&self) -> bool {
            true
        }
    }
}
