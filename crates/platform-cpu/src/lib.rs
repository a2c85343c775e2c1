//! The CPU platform: each core is an OS thread, memory is zeroed, page-aligned host memory, and
//! kernel bodies run on the core threads and dereference tensor addresses directly.
//!
//! The default core count is the machine's available parallelism. Cores do not busy-spin when
//! idle (the core's scheduler spins for a few tens of microseconds, yielding, then parks), so a
//! 2-core machine still gives the orchestrator thread its share.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::thread::JoinHandle;

use simpler_core::{Memory, Platform, PlatformError, PlatformInfo};

/// Alignment of every allocation (a page: AVX loads never straddle it, and offsets stay
/// aligned for every element type).
const ALIGN: usize = 4096;

/// The CPU platform.
#[derive(Clone, Debug, Default)]
pub struct CpuPlatform {
    _private: (),
}

impl CpuPlatform {
    /// A CPU platform.
    pub fn new() -> CpuPlatform {
        CpuPlatform::default()
    }
}

/// Host memory from the global allocator.
///
/// Allocated with the allocator's natural alignment and aligned by hand: `alloc_zeroed` with a
/// large alignment would write every byte, while a plain zeroed allocation of a large block is
/// served by fresh zero pages that cost nothing until touched (a 256 MiB ring heap is free until
/// used).
struct HostMemory {
    raw: NonNull<u8>,
    ptr: usize,
    len: usize,
}

// SAFETY: HostMemory owns its allocation exclusively; sharing the address between threads is
// what the runtime does with it, and all concurrent access is ordered by the runtime.
unsafe impl Send for HostMemory {}
// SAFETY: as above; `&HostMemory` only exposes the address and length.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    fn layout(len: usize) -> Result<Layout, PlatformError> {
        len.checked_add(ALIGN)
            .and_then(|n| Layout::from_size_align(n, 16).ok())
            .ok_or_else(|| PlatformError {
                platform: "cpu".into(),
                what: format!("cannot lay out {len} bytes"),
            })
    }

    fn new(len: usize) -> Result<HostMemory, PlatformError> {
        let layout = HostMemory::layout(len)?;
        // SAFETY: the layout has a non-zero size (at least ALIGN bytes).
        let p = unsafe { alloc_zeroed(layout) };
        let raw = NonNull::new(p).ok_or_else(|| PlatformError {
            platform: "cpu".into(),
            what: format!(
                "out of memory allocating {}",
                simpler_core::human_bytes(len as u64)
            ),
        })?;
        let ptr = (raw.as_ptr() as usize).next_multiple_of(ALIGN);
        Ok(HostMemory { raw, ptr, len })
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `alloc_zeroed` with exactly this layout (constructed the same
        // way from `len`, which never changes) and is freed once.
        unsafe {
            dealloc(
                self.raw.as_ptr(),
                HostMemory::layout(self.len).expect("valid at allocation"),
            )
        }
    }
}

impl Memory for HostMemory {
    fn addr(&self) -> usize {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn host_accessible(&self) -> bool {
        true
    }
}

impl Platform for CpuPlatform {
    fn info(&self) -> PlatformInfo {
        PlatformInfo {
            name: "cpu".into(),
            default_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            host_kernels: true,
        }
    }

    fn alloc(&self, bytes: usize) -> Result<Box<dyn Memory>, PlatformError> {
        Ok(Box::new(HostMemory::new(bytes)?))
    }

    fn spawn_core(
        &self,
        index: usize,
        body: Box<dyn FnOnce() + Send>,
    ) -> Result<JoinHandle<()>, PlatformError> {
        std::thread::Builder::new()
            .name(format!("simpler-core-{index}"))
            .spawn(body)
            .map_err(|e| PlatformError {
                platform: "cpu".into(),
                what: format!("cannot start core thread {index}: {e}"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_zeroed_aligned_and_freed() {
        let p = CpuPlatform::new();
        let m = p.alloc(10_000).unwrap();
        assert_eq!(m.addr() % ALIGN, 0);
        assert_eq!(m.len(), 10_000);
        // SAFETY: the block is 10_000 bytes of host memory owned by `m`, alive here.
        let bytes = unsafe { std::slice::from_raw_parts(m.addr() as *const u8, m.len()) };
        assert!(bytes.iter().all(|&b| b == 0));
        let z = p.alloc(0).unwrap();
        assert!(z.is_empty());
        assert!(p.info().default_cores >= 1);
    }
}

/// The README's example runs as a doctest of this crate, so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
