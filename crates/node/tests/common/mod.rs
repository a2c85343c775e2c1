//! Deterministic test data, computed the same way in every process (children, ranks, the
//! parent) and by the plain single-process computation the results are compared with.

/// SplitMix64's finaliser.
#[allow(dead_code)] // not every test binary uses every helper
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[allow(dead_code)]
/// Bytes rank `src` sends to rank `dst`: ragged, a third of them empty, none when `seed` is 0.
pub(crate) fn message(seed: u64, src: usize, dst: usize) -> Vec<u8> {
    if seed == 0 {
        return Vec::new();
    }
    let h = mix(seed ^ ((src as u64) << 32) ^ dst as u64);
    let len = if h.is_multiple_of(3) {
        0
    } else {
        (h >> 8) as usize % 301
    };
    (0..len).map(|k| mix(h ^ k as u64) as u8).collect()
}

#[allow(dead_code)]
/// Rank `rank`'s all-reduce input.
pub(crate) fn reduce_input(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|k| (mix(seed ^ ((rank as u64) << 40) ^ k as u64) % 20001) as f32 / 7.0 - 1000.0)
        .collect()
}
