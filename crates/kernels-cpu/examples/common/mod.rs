//! Helpers shared by the examples.

use half::bf16;

/// `len` bf16 in a 2 MiB-aligned anonymous mapping advised to use huge pages, as the runtime
/// holds weights and KV pools (leaked: an example runs once).
pub(crate) fn huge_pool(len: usize) -> &'static mut [bf16] {
    const HUGE: usize = 2 << 20;
    let bytes = len * 2;
    let map = memmap2::MmapOptions::new()
        .len(bytes + HUGE)
        .map_anon()
        .expect("anonymous mapping");
    let off = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
    // A hint only: without huge pages the pool works the same.
    let _ = map.advise_range(memmap2::Advice::HugePage, off, bytes);
    let map = Box::leak(Box::new(map));
    // SAFETY: the mapping holds `off + bytes` bytes, `off` keeps 2-byte alignment, an anonymous
    // mapping is zeroed (valid bf16), and the leaked mapping lives for the program.
    unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().add(off).cast::<bf16>(), len) }
}
