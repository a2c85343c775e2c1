//! fp32 ↔ bf16 conversion: round-to-nearest-even narrowing (NaN stays NaN, quietened) and
//! exact widening.

use half::bf16;

use crate::isa::Isa;
use crate::multiversion::multiversion;

/// Rounds `x` to the nearest bf16 (ties to even); NaN maps to a quiet NaN.
#[inline]
pub fn f32_to_bf16(x: f32) -> bf16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return bf16::from_bits(((bits >> 16) | 0x0040) as u16);
    }
    let lsb = (bits >> 16) & 1;
    bf16::from_bits((bits.wrapping_add(0x7FFF + lsb) >> 16) as u16)
}

/// Widens `x` to fp32 (exact).
#[inline]
pub fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// `dst[i] = bf16(src[i])`, round-to-nearest-even.
///
/// # Panics
/// If the lengths differ.
pub fn cast_f32_bf16(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "cast_f32_bf16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if Isa::current() >= Isa::Avx2 {
        // SAFETY: Avx2 or wider is only current when the CPU supports AVX2; lengths checked above.
        unsafe { avx2::cast_f32_bf16(src, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16(s);
    }
}

multiversion! {
    /// `dst[i] = f32(src[i])` (exact).
    ///
    /// # Panics
    /// If the lengths differ.
    pub fn cast_bf16_f32(src: &[bf16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "cast_bf16_f32: lengths differ");
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16_to_f32(s);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::bf16;

    /// AVX2 round-to-nearest-even narrowing, 16 values per step.
    ///
    /// # Safety
    /// AVX2 available; `src.len() == dst.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn cast_f32_bf16(src: &[f32], dst: &mut [bf16]) {
        let n16 = src.len() / 16 * 16;
        for i in (0..n16).step_by(16) {
            // SAFETY: i + 16 <= len for both slices.
            unsafe {
                let a = round8(_mm256_loadu_si256(src.as_ptr().add(i).cast()));
                let b = round8(_mm256_loadu_si256(src.as_ptr().add(i + 8).cast()));
                // packus works per 128-bit lane: [a0..3 b0..3 a4..7 b4..7] -> reorder quads.
                let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
                _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), packed);
            }
        }
        for (d, &s) in dst[n16..].iter_mut().zip(&src[n16..]) {
            *d = super::f32_to_bf16(s);
        }
    }

    /// Eight fp32 bit patterns rounded to bf16, in the low 16 bits of each lane.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn round8(bits: __m256i) -> __m256i {
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
            bits,
            _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)),
        ));
        let quiet_nan = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x40));
        let f = _mm256_castsi256_ps(bits);
        let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(f, f));
        _mm256_blendv_epi8(rounded, quiet_nan, is_nan)
    }
}
