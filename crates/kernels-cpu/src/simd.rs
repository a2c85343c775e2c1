//! Small AVX2 helpers shared by the kernels: horizontal sums, a vector `exp`, bf16 rounding.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Sum of the eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) fn hsum256(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

/// Hints the memory system to bring the cache line holding `p` into L2. Never faults and has
/// no effect on results, whatever `p` points at.
#[inline(always)]
pub(crate) fn prefetch_l2<T>(p: *const T) {
    // SAFETY: prefetch is an SSE instruction (baseline on x86_64) that never faults and reads
    // nothing architecturally, so any address is fine.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        _mm_prefetch::<_MM_HINT_T1>(p.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// 32 bf16 values as the operand type of `vdpbf16ps`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
pub(crate) fn as_pbh(v: __m512i) -> __m512bh {
    // SAFETY: both are plain 512-bit vectors with no invalid bit patterns.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}
