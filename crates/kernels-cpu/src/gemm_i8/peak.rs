//! The measured int8 dot-product peak of each path: independent chains of the instructions
//! the kernels' inner loops issue, one thread and all threads; a path whose kernels issue two
//! sequences (AVX2: the sign trick, 16-bit products) takes the faster. The chains run in
//! registers, except that the 16-bit one reads its weights (a 4 KiB cycle) and the
//! activations that do not fit the registers from L1, as its kernel does: `vpmovsxbw` from a
//! register is a slower instruction on Zen 3 than from memory. Rates count two operations per
//! multiply-accumulate (GOP/s, like GFLOP/s).

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
    /// A figure came only from runs in which a thread was held off its CPU: a lower bound
    /// (`membw::compute_peak_checked`).
    pub lower_bound: bool,
}

/// A chain: the instructions it times, multiply-accumulates per iteration, the loop.
#[cfg(target_arch = "x86_64")]
type Chain = (&'static str, f64, fn(u64));

/// Peaks of every supported SIMD or tile path (not the portable one), each measured for about
/// `budget` split between one and `threads` threads.
pub fn int8_peaks(threads: usize, budget: Duration) -> Vec<Int8Peak> {
    let mut peaks = Vec::new();
    #[cfg(target_arch = "x86_64")]
    for path in I8Path::ALL {
        if path == I8Path::Portable || !path.is_supported() {
            continue;
        }
        // The sequences each path's kernels issue; a path with two takes the faster.
        let chains: &[Chain] = match path {
            I8Path::Avx2 => &[
                (
                    "vpmaddubsw+vpmaddwd (256-bit)",
                    x86::MADDUBS_MACS,
                    x86::maddubs,
                ),
                (
                    "vpmovsxbw+vpmaddwd (256-bit, i16)",
                    x86::MADD16_MACS,
                    x86::madd16,
                ),
            ],
            I8Path::AvxVnni => &[("vpdpbusd (256-bit)", x86::VNNI256_MACS, x86::vnni256)],
            I8Path::Avx512Vnni => &[("vpdpbusd (512-bit)", x86::VNNI512_MACS, x86::vnni512)],
            I8Path::Amx => &[("tdpbssd (16x16x64 tiles)", x86::AMX_MACS, x86::amx)],
            I8Path::Portable => unreachable!(),
        };
        let share = budget / (2 * chains.len() as u32);
        let best = chains
            .iter()
            .map(|&(instructions, macs, run)| {
                // Two operations per multiply-accumulate.
                let one = chain_peak(1, share, run, 2.0 * macs);
                let all = chain_peak(threads.max(1), share, run, 2.0 * macs);
                Int8Peak {
                    path,
                    instructions,
                    gops_one: one.rate,
                    gops_all: all.rate,
                    lower_bound: !(one.undisturbed && all.undisturbed),
                }
            })
            .max_by(|a, b| a.gops_all.total_cmp(&b.gops_all));
        peaks.extend(best);
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

    /// Batch rows of the i16 chain: the 8-row sets of the AVX2 kernel, each widened weight
    /// vector serving all of them.
    const MADD16_ROWS: usize = 8;
    pub(super) const MADD16_MACS: f64 = (MADD16_ROWS * 32) as f64;
    /// Weight bytes the i16 chain cycles through (in L1, as a chunk of the kernel's rows).
    const W_BYTES: usize = 4096;

    pub(super) fn madd16(iters: u64) {
        assert!(I8Path::Avx2.is_supported());
        // SAFETY: AVX2 checked just above.
        unsafe { madd16_impl(iters) }
    }
    #[target_feature(enable = "avx2")]
    fn madd16_impl(iters: u64) {
        // The AVX2 sets' sequence per 32 weight bytes: the two halves widened to i16 once,
        // then per batch row two `vpmaddwd` against the row's widened activations and two
        // adds. The weights change every iteration; each row has its own activations (which
        // do not all fit the registers next to the accumulators: some are read from L1 as
        // memory operands, as the kernel reads all of them).
        let w: Vec<i8> = (0..W_BYTES).map(|i| (i % 251) as i8).collect();
        let a: [[__m256i; 2]; MADD16_ROWS] = std::array::from_fn(|b| {
            black_box([
                _mm256_set1_epi16(b as i16 - 5),
                _mm256_set1_epi16(11 - b as i16),
            ])
        });
        let mut acc = [_mm256_setzero_si256(); MADD16_ROWS];
        for i in 0..iters as usize {
            // SAFETY: 32 bytes at a multiple of 32 below `W_BYTES`, inside `w`.
            let (w0, w1) = unsafe {
                let p = w.as_ptr().add(i % (W_BYTES / 32) * 32);
                (
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast())),
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(16).cast())),
                )
            };
            for (v, a) in acc.iter_mut().zip(&a) {
                let x = _mm256_add_epi32(_mm256_madd_epi16(w0, a[0]), _mm256_madd_epi16(w1, a[1]));
                *v = _mm256_add_epi32(*v, x);
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
