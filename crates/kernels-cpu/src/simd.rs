//! Small AVX2 helpers shared by the kernels: horizontal sums, a vector `exp`, bf16 rounding.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Assembly text shared by the AVX2 3 × 4 passes (bf16 `gemm::avx2::quad`, int8 wide
/// product): four activation vectors at `[{x_b} + {k}*4 + disp]` (b = 0..4, `disp` the
/// concatenated `$disp` pieces), each fed to the three widened weight vectors in `ymm12`–`ymm14`
/// and accumulated into `ymm(4 r + b)`; `ymm15` is the scratch. Text only: the caller's `asm!`
/// names the operands and declares the registers.
macro_rules! fma_3x4_asm {
    ($($disp:expr),+) => {
        concat!(
            "vmovups ymm15, [{x0} + {k}*4 + ", $($disp,)+ "]\n",
            "vfmadd231ps ymm0, ymm12, ymm15\n",
            "vfmadd231ps ymm4, ymm13, ymm15\n",
            "vfmadd231ps ymm8, ymm14, ymm15\n",
            "vmovups ymm15, [{x1} + {k}*4 + ", $($disp,)+ "]\n",
            "vfmadd231ps ymm1, ymm12, ymm15\n",
            "vfmadd231ps ymm5, ymm13, ymm15\n",
            "vfmadd231ps ymm9, ymm14, ymm15\n",
            "vmovups ymm15, [{x2} + {k}*4 + ", $($disp,)+ "]\n",
            "vfmadd231ps ymm2, ymm12, ymm15\n",
            "vfmadd231ps ymm6, ymm13, ymm15\n",
            "vfmadd231ps ymm10, ymm14, ymm15\n",
            "vmovups ymm15, [{x3} + {k}*4 + ", $($disp,)+ "]\n",
            "vfmadd231ps ymm3, ymm12, ymm15\n",
            "vfmadd231ps ymm7, ymm13, ymm15\n",
            "vfmadd231ps ymm11, ymm14, ymm15\n",
        )
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use fma_3x4_asm;

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

/// Hints the memory system to bring the cache line holding `p` into L1 (`prefetcht0`). Never
/// faults and has no effect on results, whatever `p` points at.
#[inline(always)]
pub(crate) fn prefetch_l1<T>(p: *const T) {
    // SAFETY: as `prefetch_l2`: the hint never faults and reads nothing architecturally.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>())
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

/// The 8 × 8 transpose of 32-bit lanes: lane `j` of output `i` is lane `i` of input `j`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}
