//! fp32 ↔ bf16 conversion: round-to-nearest-even narrowing (NaN stays NaN, quietened) and
//! exact widening.

use half::bf16;

use crate::isa::Isa;
use crate::multiversion::multiversion;

/// Rounds `x` to the nearest bf16 (ties to even); NaN maps to a quiet NaN.
#[inline]
pub fn f32_to_bf16(x: f32) -> bf16 {
    let bits = x.to_bits();
    // Both results, then a select rather than an early return for NaN: loops over this
    // vectorise (a blend), where the branch kept them scalar (`round_bf16` over 8 × 32768
    // values took 69 µs on the AVX-512 Xeon).
    let quiet_nan = (bits >> 16) | 0x0040;
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    bf16::from_bits(if x.is_nan() { quiet_nan } else { rounded } as u16)
}

/// `x` rounded to the nearest bf16 value (ties to even; NaN to a quiet NaN), kept in fp32:
/// [`f32_to_bf16`] then the exact widening, with no branch, so loops over it vectorise.
#[inline]
pub(crate) fn round_bf16_f32(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(x))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free narrowing and [`round_bf16_f32`] give what the branching form and
    /// `half`'s widening gave, bit for bit, NaNs (signalling and quiet, both signs) included.
    #[test]
    fn round_bf16_f32_is_the_narrowing_then_the_widening() {
        let mut x = 0x9E37_79B9u32;
        let mut samples: Vec<u32> = (0..200_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x
            })
            .collect();
        samples.extend([
            0x7F80_0001, // signalling NaN
            0xFF80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x7F80_0000, // infinities
            0xFF80_0000,
            0x7F7F_FFFF, // rounds up to infinity
            0x3F80_8000, // tie, rounds to even (down)
            0x3F81_8000, // tie, rounds up
            0,
            0x8000_0000,
        ]);
        for b in samples {
            let v = f32::from_bits(b);
            let branching = if v.is_nan() {
                ((b >> 16) | 0x0040) as u16
            } else {
                (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16
            };
            assert_eq!(f32_to_bf16(v).to_bits(), branching, "{b:#010x}");
            assert_eq!(
                round_bf16_f32(v).to_bits(),
                bf16::from_bits(branching).to_f32().to_bits(),
                "{b:#010x}"
            );
        }
    }
}
