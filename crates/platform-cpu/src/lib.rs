//! The CPU platform: each core is an OS thread, memory is zeroed, page-aligned host memory, and
//! kernel bodies run on the core threads and dereference tensor addresses directly.
//!
//! The default core count is the machine's available parallelism. Cores do not busy-spin when
//! idle (the core's scheduler spins for a few tens of microseconds, yielding, then parks), so a
//! 2-core machine still gives the orchestrator thread its share.

pub mod host_memory;
mod thread_counters;

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::Arc;
use std::thread::JoinHandle;

use simpler_core::{Memory, Platform, PlatformError, PlatformInfo, ThreadCounters};

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

/// Smallest allocation given transparent huge pages (on Linux).
const HUGE_MIN: usize = 4 << 20;
/// A transparent huge page.
const HUGE_PAGE: usize = 2 << 20;

/// Host memory: from the global allocator, or for large blocks on Linux an anonymous mapping
/// aligned to 2 MiB and advised to use transparent huge pages. Weights and KV pools are read
/// as long streams; with 4 KiB pages every 4 KiB of a stream is a TLB miss, which a kernel
/// streaming several rows at once pays several times over (huge pages: ~+10-30% single-thread
/// streaming read on the development machine).
///
/// Heap blocks are allocated with the allocator's natural alignment and aligned by hand:
/// `alloc_zeroed` with a large alignment would write every byte, while a plain zeroed
/// allocation of a large block is served by fresh zero pages that cost nothing until touched
/// (a 256 MiB ring heap is free until used). Mapped blocks are likewise zero and uncommitted
/// until touched (in 2 MiB steps where huge pages are granted).
struct HostMemory {
    backing: Backing,
    ptr: usize,
    len: usize,
}

enum Backing {
    Heap(NonNull<u8>),
    /// Held for its `Drop`, which unmaps the block.
    #[cfg(target_os = "linux")]
    Map {
        _map: memmap2::MmapMut,
    },
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
        #[cfg(target_os = "linux")]
        if len >= HUGE_MIN
            && let Some(m) = HostMemory::mapped(len)
        {
            return Ok(m);
        }
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
        Ok(HostMemory {
            backing: Backing::Heap(raw),
            ptr,
            len,
        })
    }

    /// A 2 MiB-aligned anonymous mapping of `len` bytes advised to use huge pages, or `None`
    /// (the caller falls back to the heap) when the mapping fails.
    #[cfg(target_os = "linux")]
    fn mapped(len: usize) -> Option<HostMemory> {
        let map = memmap2::MmapOptions::new()
            .len(len.checked_add(HUGE_PAGE)?)
            .map_anon()
            .ok()?;
        let base = map.as_ptr() as usize;
        let off = base.next_multiple_of(HUGE_PAGE) - base;
        // Only a hint: without huge pages the block works the same with 4 KiB pages.
        let _ = map.advise_range(memmap2::Advice::HugePage, off, len / HUGE_PAGE * HUGE_PAGE);
        Some(HostMemory {
            ptr: base + off,
            len,
            backing: Backing::Map { _map: map },
        })
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // A mapping unmaps itself when dropped.
        if let Backing::Heap(raw) = self.backing {
            // SAFETY: `raw` came from `alloc_zeroed` with exactly this layout (constructed the
            // same way from `len`, which never changes) and is freed once.
            unsafe {
                dealloc(
                    raw.as_ptr(),
                    HostMemory::layout(self.len).expect("valid at allocation"),
                )
            }
        }
    }
}

// SAFETY: `ptr .. ptr + len` lies in the allocation `backing` owns until drop (page-aligned,
// zeroed, host memory), and neither `ptr` nor `len` changes after `new`.
unsafe impl Memory for HostMemory {
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

// SAFETY: `alloc` returns zeroed host memory of `bytes` bytes (`HostMemory`, whose contract is
// argued above), kernels run on host threads, and `spawn_core` runs `body` once on a new thread.
unsafe impl Platform for CpuPlatform {
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

    fn memory_available(&self) -> Option<(u64, String)> {
        host_memory::available().map(|m| (m.available, m.source))
    }

    fn current_thread_counters(&self) -> Option<Arc<dyn ThreadCounters>> {
        thread_counters::current()
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

    #[test]
    fn large_blocks_are_zeroed_writable_and_aligned() {
        let p = CpuPlatform::new();
        let len = HUGE_MIN + 12_345;
        let m = p.alloc(len).unwrap();
        assert_eq!(m.len(), len);
        assert_eq!(m.addr() % ALIGN, 0);
        #[cfg(target_os = "linux")]
        assert_eq!(
            m.addr() % HUGE_PAGE,
            0,
            "mapped blocks start on a huge page"
        );
        // SAFETY: the block is `len` bytes of host memory owned by `m`, alive here, and only
        // this test touches it.
        let bytes = unsafe { std::slice::from_raw_parts_mut(m.addr() as *mut u8, m.len()) };
        assert!(bytes.iter().step_by(4093).all(|&b| b == 0));
        assert_eq!(bytes[len - 1], 0);
        bytes[0] = 7;
        bytes[len - 1] = 9;
        assert_eq!((bytes[0], bytes[len - 1]), (7, 9));
    }
}

/// The README's example runs as a doctest of this crate, so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
