//! The measured int8 dot-product peak of each path: independent chains of the instructions
//! the kernels' inner loops issue, in registers only (no loads), one thread and all threads.
//! Rates count two operations per multiply-accumulate (GOP/s, like GFLOP/s).

use std::time::Duration;

use super::I8Path;
#[cfg(target_arch = "x86_64")]
use crate::membw::chain_peak;

/// One path's measured peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Int8Peak {
    /// The path.
    pub path: I8Path,
    /// The instructions timed.
    pub instructions: &'static str,
    /// One thread, GOP/s.
    pub gops_one: f64,
    /// All threads together, GOP/s.
    pub gops_all: f64,
}

/// Peaks of every supported SIMD or tile path (not the portable one), each measured for about
/// `budget` split between one and `threads` threads.
pub fn int8_peaks(threads: usize, budget: Duration) -> Vec<Int8Peak> {
    let mut peaks = Vec::new();
    #[cfg(target_arch = "x86_64")]
    for path in I8Path::ALL {
        if path == I8Path::Portable || !path.is_supported() {
            continue;
        }
        let (instructions, macs, run): (&str, f64, fn(u64)) = match path {
            I8Path::Avx2 => (
                "vpmaddubsw+vpmaddwd (256-bit)",
                x86::MADDUBS_MACS,
                x86::maddubs,
            ),
            I8Path::AvxVnni => ("vpdpbusd (256-bit)", x86::VNNI256_MACS, x86::vnni256),
            I8Path::Avx512Vnni => ("vpdpbusd (512-bit)", x86::VNNI512_MACS, x86::vnni512),
            I8Path::Amx => ("tdpbssd (16x16x64 tiles)", x86::AMX_MACS, x86::amx),
            I8Path::Portable => unreachable!(),
        };
        // Two operations per multiply-accumulate.
        let one = chain_peak(1, budget / 2, run, 2.0 * macs);
        let all = chain_peak(threads.max(1), budget / 2, run, 2.0 * macs);
        peaks.push(Int8Peak {
            path,
            instructions,
            gops_one: one,
            gops_all: all,
        });
    }
    let _ = (threads, budget);
    peaks
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::hint::black_box;

    use super::super::I8Path;

    /// Independent accumulators per loop (covers the latency on every port).
    const CHAINS: usize = 10;
    pub(super) const MADDUBS_MACS: f64 = (CHAINS * 32) as f64;
    pub(super) const VNNI256_MACS: f64 = (CHAINS * 32) as f64;
    pub(super) const VNNI512_MACS: f64 = (CHAINS * 64) as f64;
    /// Four `tdpbssd` of 16 × 16 × 64 per iteration.
    pub(super) const AMX_MACS: f64 = (4 * 16 * 16 * 64) as f64;

    pub(super) fn maddubs(iters: u64) {
        assert!(I8Path::Avx2.is_supported());
        // SAFETY: AVX2 checked just above.
        unsafe { maddubs_impl(iters) }
    }
    #[target_feature(enable = "avx2")]
    fn maddubs_impl(iters: u64) {
        // The weight vector changes every iteration (as the kernel's loads do), so nothing
        // can be hoisted out of the loop; each chain has its own activations.
        let mut w = black_box(_mm256_set1_epi8(3));
        let step = black_box(_mm256_set1_epi8(1));
        let a: [__m256i; CHAINS] =
            std::array::from_fn(|c| black_box(_mm256_set1_epi8(c as i8 - 5)));
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_si256(); CHAINS];
        for _ in 0..iters {
            w = _mm256_add_epi8(w, step);
            let w_abs = _mm256_sign_epi8(w, w);
            for (v, a) in acc.iter_mut().zip(&a) {
                // The kernel's sequence per 32 bytes and batch row: |w| * sign(a, w), pairs to
                // i32, add.
                let p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(*a, w));
                *v = _mm256_add_epi32(*v, _mm256_madd_epi16(p, ones));
            }
        }
        black_box(acc);
    }

    pub(super) fn vnni256(iters: u64) {
        assert!(I8Path::AvxVnni.is_supported());
        // SAFETY: AVX-VNNI checked just above.
        unsafe { vnni256_impl(iters) }
    }
    #[target_feature(enable = "avx2,avxvnni")]
    fn vnni256_impl(iters: u64) {
        let w = black_box(_mm256_set1_epi8(3));
        let a = black_box(_mm256_set1_epi8(2));
        let mut acc = [_mm256_setzero_si256(); CHAINS];
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm256_dpbusd_avx_epi32(*v, a, w);
            }
        }
        black_box(acc);
    }

    pub(super) fn vnni512(iters: u64) {
        assert!(I8Path::Avx512Vnni.is_supported());
        // SAFETY: AVX-512 VNNI checked just above.
        unsafe { vnni512_impl(iters) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    fn vnni512_impl(iters: u64) {
        let w = black_box(_mm512_set1_epi8(3));
        let a = black_box(_mm512_set1_epi8(2));
        let mut acc = [_mm512_setzero_si512(); CHAINS];
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm512_dpbusd_epi32(*v, a, w);
            }
        }
        black_box(acc);
    }

    /// Full 16 × 64-byte tiles: accumulators tmm0..tmm3, operands tmm4..tmm7.
    #[repr(C, align(64))]
    struct Cfg([u8; 64]);

    pub(super) fn amx(iters: u64) {
        assert!(I8Path::Amx.is_supported());
        let mut cfg = Cfg([0; 64]);
        cfg.0[0] = 1;
        for t in 0..8 {
            cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            cfg.0[48 + t] = 16;
        }
        // SAFETY: AMX checked (and the tile state granted) just above; the configuration is
        // valid for palette 1; the loop only touches tile registers.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &raw const cfg, options(nostack, readonly));
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                options(nostack, nomem)
            );
            for _ in 0..iters {
                asm!(
                    "tdpbssd tmm0, tmm4, tmm6",
                    "tdpbssd tmm1, tmm4, tmm7",
                    "tdpbssd tmm2, tmm5, tmm6",
                    "tdpbssd tmm3, tmm5, tmm7",
                    options(nostack, nomem)
                );
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    }
}
