//! Helpers shared by the examples (each example uses some of them).
#![allow(dead_code)]

use half::bf16;

/// `len` bf16 in a 2 MiB-aligned anonymous mapping advised to use huge pages, as the runtime
/// holds weights and KV pools (leaked: an example runs once).
pub(crate) fn huge_pool(len: usize) -> &'static mut [bf16] {
    let bytes = huge_bytes(len.checked_mul(2).expect("pool size overflows usize"));
    // SAFETY: the slice starts on a 2 MiB boundary (so 2-byte aligned), holds `2 * len` bytes,
    // zeroed (valid bf16), and lives for the program.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<bf16>(), len) }
}

/// `len` int8 in a huge-page mapping, as [`huge_pool`]. Int8 weight matrices of 4 KiB rows
/// read as far-apart streams cross a 4 KiB page at every row: from plain pages the W8A8 GEMM
/// of a FLASH expert at 3 rows took 1.26x the time it takes from the runtime's huge pages.
pub(crate) fn huge_i8(len: usize) -> &'static mut [i8] {
    let bytes = huge_bytes(len);
    // SAFETY: the mapping holds `len` bytes (any bytes are valid i8) and lives for the program.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<i8>(), len) }
}

/// `len` f32 in a huge-page mapping, as [`huge_pool`].
pub(crate) fn huge_f32(len: usize) -> &'static mut [f32] {
    let bytes = huge_bytes(len.checked_mul(4).expect("pool size overflows usize"));
    // SAFETY: the slice starts on a 2 MiB boundary (so 4-byte aligned), holds `4 * len` bytes,
    // zeroed (valid f32), and lives for the program.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<f32>(), len) }
}

/// `bytes` zeroed bytes starting on a 2 MiB boundary of an anonymous mapping advised to use
/// huge pages (leaked: an example runs once).
fn huge_bytes(bytes: usize) -> &'static mut [u8] {
    const HUGE: usize = 2 << 20;
    let map = memmap2::MmapOptions::new()
        .len(bytes + HUGE)
        .map_anon()
        .expect("anonymous mapping");
    let off = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
    // A hint only: without huge pages the pool works the same.
    let _ = map.advise_range(memmap2::Advice::HugePage, off, bytes);
    let map = Box::leak(Box::new(map));
    &mut map[off..off + bytes]
}

/// This thread's fp32 FMA rate by its own CPU time, GFLOP/s: `iters` rounds of the FMA
/// chains `bench membw` times, for pricing a thread's work against its own peak.
pub(crate) fn thread_fma_gflops(iters: u64) -> f64 {
    use simpler_kernels_cpu::membw::{FMA_FLOPS_PER_ITER, fma_chains};
    let t0 = thread_cpu_seconds();
    std::hint::black_box(fma_chains(iters));
    iters as f64 * FMA_FLOPS_PER_ITER / (thread_cpu_seconds() - t0) / 1e9
}

/// This thread's CPU time, seconds: on a host shared with other work, time spent descheduled
/// does not count against the kernel.
pub(crate) use simpler_kernels_cpu::membw::thread_cpu_seconds;

/// Prints the host's load average (`/proc/loadavg`), which every number of a shared host's
/// run is read beside; nothing where the file is missing.
pub(crate) fn print_load_average() {
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        println!("load average: {}", load.trim());
    }
}

/// The value after `name` (e.g. `--reps`) on the command line.
pub(crate) fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// The comma-separated batch sizes after `--batches`, or `default`'s.
pub(crate) fn batches(default: &str) -> Vec<usize> {
    arg("--batches")
        .unwrap_or_else(|| default.into())
        .split(',')
        .map(|s| s.parse().expect("--batches: comma-separated integers"))
        .collect()
}
