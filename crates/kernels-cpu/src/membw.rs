//! The machine's two roofline denominators, measured: streaming read bandwidth (one thread and
//! all threads) and fp32 FMA peak (one core and all cores). Prints nothing.
//!
//! Bandwidth reads a buffer much larger than the last-level cache several times with wide loads,
//! each thread its part as four concurrent streams, and reports the best and the median pass;
//! the FMA peak runs chains of independent 256-bit FMAs (enough accumulators to cover the FMA
//! latency on every pipe). Both run on the [`Isa::current`] path.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use crate::isa::Isa;

/// What [`measure`] found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MachinePeaks {
    /// Threads used for the "all" figures.
    pub threads: usize,
    /// Best streaming read bandwidth of one thread, GB/s (1e9 bytes/s).
    pub read_gbs_one: f64,
    /// Median read bandwidth of one thread over the passes, GB/s.
    pub read_gbs_one_median: f64,
    /// Best streaming read bandwidth of all threads together, GB/s.
    pub read_gbs_all: f64,
    /// Median read bandwidth of all threads together, GB/s.
    pub read_gbs_all_median: f64,
    /// fp32 FMA peak of one core, GFLOP/s (an FMA counts 2 FLOPs per lane).
    pub fma_gflops_one: f64,
    /// fp32 FMA peak of all threads together, GFLOP/s.
    pub fma_gflops_all: f64,
}

/// How [`measure`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeasureOptions {
    /// Rough total wall time of the four measurements (allocation excluded).
    pub duration: Duration,
    /// Size of the streamed buffer in bytes (make it several times the last-level cache).
    pub buffer_bytes: usize,
    /// Threads for the "all" figures.
    pub threads: usize,
}

impl Default for MeasureOptions {
    fn default() -> MeasureOptions {
        MeasureOptions {
            duration: Duration::from_millis(1500),
            buffer_bytes: 256 << 20,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// Measures read bandwidth and FMA peak (see the module docs).
pub fn measure(opts: &MeasureOptions) -> MachinePeaks {
    let threads = opts.threads.max(1);
    let words = (opts.buffer_bytes / 8).max(4096) / 64 * 64;
    let mut buf = StreamBuffer::new(words);
    for (i, w) in buf.words_mut().iter_mut().enumerate() {
        *w = i as u64;
    }
    let quarter = opts.duration / 4;
    let (one, one_med) = read_bandwidth(buf.words(), 1, quarter);
    let (all, all_med) = read_bandwidth(buf.words(), threads, quarter);
    drop(buf);
    MachinePeaks {
        threads,
        read_gbs_one: one,
        read_gbs_one_median: one_med,
        read_gbs_all: all,
        read_gbs_all_median: all_med,
        fma_gflops_one: fma_peak(1, quarter),
        fma_gflops_all: fma_peak(threads, quarter),
    }
}

/// The streamed buffer. On Linux it sits in transparent huge pages when the kernel grants them,
/// as the runtime's large buffers do (`simpler-cpu`), so the denominator is the machine's best
/// streaming rate rather than one lowered by a TLB miss every 4 KiB.
struct StreamBuffer {
    #[cfg(target_os = "linux")]
    map: Option<(memmap2::MmapMut, usize)>,
    vec: Vec<u64>,
    words: usize,
}

impl StreamBuffer {
    const HUGE_PAGE: usize = 2 << 20;

    fn new(words: usize) -> StreamBuffer {
        #[cfg(target_os = "linux")]
        {
            let bytes = words * 8;
            if let Ok(map) = memmap2::MmapOptions::new()
                .len(bytes + Self::HUGE_PAGE)
                .map_anon()
            {
                let base = map.as_ptr() as usize;
                let off = base.next_multiple_of(Self::HUGE_PAGE) - base;
                // A hint only: the buffer works the same without huge pages.
                let _ = map.advise_range(memmap2::Advice::HugePage, off, bytes);
                return StreamBuffer {
                    map: Some((map, off)),
                    vec: Vec::new(),
                    words,
                };
            }
        }
        StreamBuffer {
            #[cfg(target_os = "linux")]
            map: None,
            vec: vec![0; words],
            words,
        }
    }

    fn words(&self) -> &[u64] {
        #[cfg(target_os = "linux")]
        if let Some((map, off)) = &self.map {
            // SAFETY: the mapping holds `off + words * 8` bytes (it was made `words * 8 + 2 MiB`
            // long and `off < 2 MiB`), `base + off` is 2 MiB-aligned (so aligned for u64), an
            // anonymous mapping is zero-initialised (valid u64s), and it lives as long as `self`.
            return unsafe {
                std::slice::from_raw_parts(map.as_ptr().add(*off).cast::<u64>(), self.words)
            };
        }
        &self.vec
    }

    fn words_mut(&mut self) -> &mut [u64] {
        #[cfg(target_os = "linux")]
        if let Some((map, off)) = &mut self.map {
            // SAFETY: as in `words`; the `&mut self` borrow makes this the only view.
            return unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().add(*off).cast::<u64>(), self.words)
            };
        }
        &mut self.vec
    }
}

/// Streaming read bandwidth of `threads` threads reading disjoint parts of `buf`, run for about
/// `budget`: `(best, median)` over the passes, GB/s.
pub fn read_bandwidth(buf: &[u64], threads: usize, budget: Duration) -> (f64, f64) {
    let threads = threads.max(1);
    let part = buf.len() / threads / 64 * 64;
    if part == 0 {
        return (0.0, 0.0);
    }
    let bytes = (part * threads * 8) as f64;
    // One untimed warm-up pass tells how many passes fit the budget.
    let t = Instant::now();
    std::hint::black_box(read_sum(&buf[..part]));
    let one_pass = t.elapsed().as_secs_f64() * threads as f64 / threads.min(2) as f64;
    let passes = ((budget.as_secs_f64() / one_pass.max(1e-6)) as usize).clamp(3, 64);
    let barrier = Barrier::new(threads);
    let per_thread: Vec<Vec<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let chunk = &buf[i * part..(i + 1) * part];
                let barrier = &barrier;
                s.spawn(move || {
                    (0..passes)
                        .map(|_| {
                            barrier.wait();
                            let t = Instant::now();
                            std::hint::black_box(read_sum(chunk));
                            t.elapsed().as_secs_f64()
                        })
                        .collect::<Vec<f64>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bandwidth thread panicked"))
            .collect()
    });
    let mut rates: Vec<f64> = (0..passes)
        .map(|p| {
            let slowest = per_thread.iter().map(|t| t[p]).fold(0.0f64, f64::max);
            bytes / slowest.max(1e-9) / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    (rates[rates.len() - 1], rates[rates.len() / 2])
}

/// fp32 FMA peak of `threads` threads each running independent FMA chains for about `budget`,
/// GFLOP/s.
pub fn fma_peak(threads: usize, budget: Duration) -> f64 {
    let threads = threads.max(1);
    // Calibrate the iteration count on this thread.
    let mut iters = 1u64 << 14;
    loop {
        let t = Instant::now();
        std::hint::black_box(fma_chains(iters));
        let dt = t.elapsed().as_secs_f64();
        if dt > budget.as_secs_f64() / 20.0 || iters > 1 << 34 {
            iters = ((iters as f64) * budget.as_secs_f64() / 4.0 / dt.max(1e-9)) as u64;
            break;
        }
        iters *= 4;
    }
    let iters = iters.max(1 << 10);
    let barrier = Barrier::new(threads);
    let best: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut best = f64::MAX;
                    for _ in 0..3 {
                        barrier.wait();
                        let t = Instant::now();
                        std::hint::black_box(fma_chains(iters));
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                    best
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("fma thread panicked"))
            .collect()
    });
    let flops = FMA_FLOPS_PER_ITER * iters as f64;
    best.iter().map(|t| flops / t.max(1e-9) / 1e9).sum()
}

/// Independent accumulators per chain loop.
const CHAINS: usize = 12;
/// FLOPs per loop iteration: `CHAINS` FMAs of 8 lanes, 2 FLOPs each.
const FMA_FLOPS_PER_ITER: f64 = (CHAINS * 8 * 2) as f64;

/// Concurrent streams each thread reads its part in. One stream per thread leaves bandwidth
/// unused on the development machine (one thread: ~12 against ~15 GB/s with four; two
/// threads: ~19 against ~24), and the decode kernels read several rows at once: a
/// denominator that a kernel can beat is no limit.
const READ_STREAMS: usize = 4;

/// XOR of every word of `buf`, read as [`READ_STREAMS`] concurrent streams (its equal parts,
/// whole 64-byte blocks each; the words after them at the end).
fn read_sum(buf: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if Isa::current() >= Isa::Avx2 {
        // SAFETY: `Isa::current` returned Avx2 or a wider path, so the CPU supports AVX2.
        return unsafe { avx2::read_sum(buf) };
    }
    let part = stream_words(buf.len());
    let mut acc = [0u64; READ_STREAMS];
    for i in (0..part).step_by(8) {
        for (s, a) in acc.iter_mut().enumerate() {
            for w in &buf[s * part + i..s * part + i + 8] {
                *a ^= w;
            }
        }
    }
    let rest = buf[part * READ_STREAMS..].iter();
    acc.iter().chain(rest).fold(0, |a, b| a ^ b)
}

/// Words per stream of [`read_sum`] over `len` words: whole 8-word (64-byte) blocks.
fn stream_words(len: usize) -> usize {
    len / READ_STREAMS / 8 * 8
}

fn fma_chains(iters: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if Isa::current() >= Isa::Avx2 {
        // SAFETY: `Isa::current` returned Avx2 or a wider path, so the CPU supports AVX2 and FMA.
        return unsafe { avx2::fma_chains(iters) };
    }
    let mut acc = [[1.0f32; 8]; CHAINS];
    let (m, a) = (
        std::hint::black_box(0.999_999f32),
        std::hint::black_box(1e-3f32),
    );
    for _ in 0..iters {
        for c in acc.iter_mut() {
            for v in c.iter_mut() {
                *v = *v * m + a;
            }
        }
    }
    acc.iter().flatten().sum()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{CHAINS, READ_STREAMS, stream_words};

    /// [`super::read_sum`] with 256-bit loads: 64 bytes of each stream per iteration.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn read_sum(buf: &[u64]) -> u64 {
        let part = stream_words(buf.len());
        let base = buf.as_ptr();
        let mut acc = [[_mm256_setzero_si256(); 2]; READ_STREAMS];
        let mut i = 0;
        while i < part {
            for (s, a) in acc.iter_mut().enumerate() {
                // SAFETY: i + 8 <= part, so the 8 words at s * part + i lie inside the first
                // READ_STREAMS * part <= buf.len() words: two 256-bit vectors.
                unsafe {
                    let p = base.add(s * part + i).cast::<__m256i>();
                    a[0] = _mm256_xor_si256(a[0], _mm256_loadu_si256(p));
                    a[1] = _mm256_xor_si256(a[1], _mm256_loadu_si256(p.add(1)));
                }
            }
            i += 8;
        }
        let all = acc
            .iter()
            .flatten()
            .fold(_mm256_setzero_si256(), |x, &y| _mm256_xor_si256(x, y));
        let mut words = [0u64; 4];
        // SAFETY: `words` is 32 bytes.
        unsafe { _mm256_storeu_si256(words.as_mut_ptr().cast::<__m256i>(), all) };
        let rest = buf[part * READ_STREAMS..].iter();
        words.iter().chain(rest).fold(0, |a, b| a ^ b)
    }

    /// `CHAINS` independent FMA chains of `iters` steps each.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma_chains(iters: u64) -> f32 {
        let m = _mm256_set1_ps(std::hint::black_box(0.999_999));
        let a = _mm256_set1_ps(std::hint::black_box(1e-3));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, m, a);
            }
        }
        let mut s = _mm256_setzero_ps();
        for v in acc {
            s = _mm256_add_ps(s, v);
        }
        crate::simd::hsum256(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_buffer_holds_its_words() {
        let mut b = StreamBuffer::new(1 << 18);
        assert_eq!(b.words().len(), 1 << 18);
        assert!(b.words().iter().all(|&w| w == 0));
        for (i, w) in b.words_mut().iter_mut().enumerate() {
            *w = i as u64 * 3;
        }
        assert_eq!(b.words()[12_345], 12_345 * 3);
        assert_eq!(b.words().as_ptr() as usize % 8, 0);
    }

    #[test]
    fn read_sum_is_the_xor_of_every_word_on_every_path() {
        for len in [0usize, 5, 31, 32, 1000, 4096 + 13] {
            let buf: Vec<u64> = (0..len as u64)
                .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect();
            let want = buf.iter().fold(0, |a, b| a ^ b);
            for isa in [Isa::Portable, Isa::detected()] {
                let got = crate::isa::with_isa(isa, || read_sum(&buf)).expect("isa");
                assert_eq!(got, want, "{len} words, {isa:?}");
            }
        }
    }
}
