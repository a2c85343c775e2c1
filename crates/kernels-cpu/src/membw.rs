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
    /// AVX-512 BF16 dot-product peak of one core (`vdpbf16ps` chains, 2 FLOPs per bf16 pair
    /// product), GFLOP/s; 0 where the CPU lacks AVX-512 BF16 or the path is capped below it.
    pub bf16_dot_gflops_one: f64,
    /// AVX-512 BF16 dot-product peak of all threads together, GFLOP/s (0 as above).
    pub bf16_dot_gflops_all: f64,
    /// AMX-BF16 tile peak of one core (`tdpbf16ps` on tiles held in registers, 16 × 16 × 32
    /// products per instruction), GFLOP/s; 0 where the CPU or OS lacks AMX or the path is
    /// capped below it.
    pub amx_bf16_gflops_one: f64,
    /// AMX-BF16 tile peak of all threads together, GFLOP/s (0 as above).
    pub amx_bf16_gflops_all: f64,
    /// Some compute figure above came only from runs in which a thread was held off its CPU
    /// (see [`compute_peak`]): it is a lower bound, and a rate above it is no surprise.
    pub compute_lower_bound: bool,
}

impl MachinePeaks {
    /// All-thread compute peak of the instruction the matrix products of `path` run on:
    /// AMX tiles, AVX-512 BF16 dot products, or fp32 FMA (AVX2 and portable; the portable path
    /// is measured on whatever the compiler made of its loop). Falls back to the next lower
    /// figure when one was not measured.
    pub fn matmul_gflops_all(&self, path: Isa) -> f64 {
        let picks = [
            (Isa::AmxBf16, self.amx_bf16_gflops_all),
            (Isa::Avx512Bf16, self.bf16_dot_gflops_all),
        ];
        picks
            .into_iter()
            .find(|&(isa, g)| path >= isa && g > 0.0)
            .map_or(self.fma_gflops_all, |(_, g)| g)
    }
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
            buffer_bytes: default_buffer_bytes(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// The least streamed buffer, and the buffer where the last-level cache is not reported.
pub const MIN_BUFFER_BYTES: usize = 256 << 20;

/// The streamed buffer is at least this many times the last-level cache.
pub const BUFFER_PER_LLC: usize = 4;

/// The default streamed buffer: [`BUFFER_PER_LLC`] times the last-level cache, at least
/// [`MIN_BUFFER_BYTES`], but never more than a quarter of the memory Linux reports available
/// (the run's own data must still fit beside it; that cap wins over the floor).
///
/// Why it follows the cache: a fixed 256 MiB read from a 480 MiB L3 (a Xeon host of these
/// sessions) measured 45 GB/s on 2 threads, against 34–35 GB/s from buffers of 2 and 4 GiB,
/// so every bandwidth share was divided by an L3 rate no step can reach from memory.
pub fn default_buffer_bytes() -> usize {
    cache_multiple_bytes(last_level_cache_bytes(), BUFFER_PER_LLC)
}

/// `per_llc` times the last-level cache `llc` ([`MIN_BUFFER_BYTES`] where none is reported),
/// at least [`MIN_BUFFER_BYTES`], at most a quarter of the memory Linux reports available.
fn cache_multiple_bytes(llc: Option<usize>, per_llc: usize) -> usize {
    let want = llc
        .map_or(MIN_BUFFER_BYTES, |c| c.saturating_mul(per_llc))
        .max(MIN_BUFFER_BYTES);
    match available_memory_bytes() {
        Some(avail) => want.min(avail / 4),
        None => want,
    }
}

/// The largest data or unified cache Linux reports for CPU 0 (`/sys/devices/system/cpu/cpu0/
/// cache/index*/size`), in bytes; `None` where nothing is reported (other systems, sandboxes).
pub fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| {
        let path = e.ok()?.path();
        let kind = std::fs::read_to_string(path.join("type")).ok()?;
        if kind.trim() == "Instruction" {
            return None;
        }
        parse_cache_size(&std::fs::read_to_string(path.join("size")).ok()?)
    })
    .max()
}

/// A sysfs cache size (`"491520K"`, `"32M"`, `"512"`) in bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: usize = digits.parse().ok()?;
    let mul = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mul)
}

/// `MemAvailable` of `/proc/meminfo`, in bytes (`None` where it is not readable).
fn available_memory_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A buffer whose read pushes a step's data out of the last-level cache, so a benchmark of one
/// layer can start each step the way a step of a whole model finds that layer: in memory.
///
/// Why: one DeepSeek-V4 FLASH layer's step reads 150–400 MB, which fits a 480 MiB L3 (a Xeon
/// host of these sessions); run back to back, its steps read much of it from the cache, and a
/// share of the memory bandwidth above 100% for a phase was the sign. A model's other layers
/// would have evicted it. The read is not part of any timed step.
pub struct CacheFlush {
    /// Plain pages: a flush needs no huge pages, and asking for them (`MADV_HUGEPAGE`, with
    /// the host's `defrag` set to `madvise`) made each fault compact memory synchronously:
    /// 38 s of system time for one benchmark process's 960 MiB on a fragmented host.
    buf: Vec<u64>,
    threads: usize,
    /// The last-level cache the size was taken from, `None` where none is reported.
    llc: Option<usize>,
}

impl CacheFlush {
    /// The flushing reads' buffer per last-level cache byte: a streaming read does not evict
    /// every line of a cache with adaptive replacement, so it reads more than the cache holds.
    pub const PER_LLC: usize = 2;

    /// A flush of [`Self::PER_LLC`] times the last-level cache (at least [`MIN_BUFFER_BYTES`],
    /// at most a quarter of the available memory), read by `threads` threads.
    pub fn new(threads: usize) -> CacheFlush {
        let llc = last_level_cache_bytes();
        let bytes = cache_multiple_bytes(llc, Self::PER_LLC);
        // Written once, so every page is backed by memory of its own (an untouched anonymous
        // mapping reads the shared zero page, which the cache holds after one line).
        let buf: Vec<u64> = (0..(bytes / 8).max(4096) / 64 * 64)
            .map(|i| i as u64)
            .collect();
        CacheFlush {
            buf,
            threads: threads.max(1),
            llc,
        }
    }

    /// What one flush reads, against the cache it is meant to evict: `"a 960 MiB read, twice
    /// the 480 MiB last-level cache"`, or what made it less (no cache size reported, the
    /// memory cap). Only the cache Linux reports for CPU 0 counts: on a host of several
    /// sockets each reads its own share.
    pub fn describe(&self) -> String {
        let mib = self.bytes() >> 20;
        match self.llc {
            Some(c) if self.bytes() + 512 >= c.saturating_mul(Self::PER_LLC) => {
                // The read's own ratio: a floor on the read's size can make it more than
                // `PER_LLC` times a small cache.
                let times = self.bytes() as f64 / c.max(1) as f64;
                format!(
                    "a {mib} MiB read, {} times the {} MiB last-level cache",
                    if (times - times.round()).abs() < 0.05 {
                        format!("{}", times.round())
                    } else {
                        format!("{times:.1}")
                    },
                    c >> 20
                )
            }
            Some(c) if self.bytes() < c => format!(
                "a {mib} MiB read, capped at a quarter of the available memory: less than the {} MiB last-level cache, so steps start partly warm",
                c >> 20
            ),
            Some(c) => format!(
                "a {mib} MiB read, capped at a quarter of the available memory (the last-level cache is {} MiB)",
                c >> 20
            ),
            None => format!("a {mib} MiB read (no last-level cache size reported here)"),
        }
    }

    /// Bytes read per flush.
    pub fn bytes(&self) -> usize {
        self.buf.len() * 8
    }

    /// Reads the whole buffer once, split over the threads.
    pub fn run(&self) {
        let words = &self.buf[..];
        let part = words.len().div_ceil(self.threads);
        std::thread::scope(|s| {
            for chunk in words.chunks(part) {
                s.spawn(move || std::hint::black_box(read_sum(chunk)));
            }
        });
    }
}

/// Measures read bandwidth and FMA peak (see the module docs).
pub fn measure(opts: &MeasureOptions) -> MachinePeaks {
    measure_with_passes(opts).0
}

/// Every timed pass of [`measure`]'s two bandwidth figures, GB/s in the order run (an
/// untimed warm-up pass comes before each set).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReadPasses {
    /// One thread.
    pub one: Vec<f64>,
    /// All threads together.
    pub all: Vec<f64>,
}

/// [`measure`], with every bandwidth pass (for a report of their spread).
pub fn measure_with_passes(opts: &MeasureOptions) -> (MachinePeaks, ReadPasses) {
    let threads = opts.threads.max(1);
    let words = (opts.buffer_bytes / 8).max(4096) / 64 * 64;
    let mut buf = StreamBuffer::new(words);
    for (i, w) in buf.words_mut().iter_mut().enumerate() {
        *w = i as u64;
    }
    let isa = Isa::current();
    // Two figures each for bandwidth and FMA, and for each wider compute path the CPU runs.
    let extra = [Isa::Avx512Bf16, Isa::AmxBf16]
        .iter()
        .filter(|&&p| isa >= p)
        .count();
    let share = opts.duration / (4 + 2 * extra as u32);
    let one_passes = read_bandwidth_passes(buf.words(), 1, share);
    let all_passes = read_bandwidth_passes(buf.words(), threads, share);
    let ((one, one_med), (all, all_med)) =
        (best_and_median(&one_passes), best_and_median(&all_passes));
    drop(buf);
    let mut lower_bound = false;
    let mut path_peak = |path: Isa, n: usize| {
        if isa < path {
            return 0.0;
        }
        let peak = compute_peak_checked(path, n, share);
        lower_bound |= !peak.undisturbed;
        peak.rate
    };
    let peaks = MachinePeaks {
        threads,
        read_gbs_one: one,
        read_gbs_one_median: one_med,
        read_gbs_all: all,
        read_gbs_all_median: all_med,
        fma_gflops_one: path_peak(Isa::Portable, 1),
        fma_gflops_all: path_peak(Isa::Portable, threads),
        bf16_dot_gflops_one: path_peak(Isa::Avx512Bf16, 1),
        bf16_dot_gflops_all: path_peak(Isa::Avx512Bf16, threads),
        amx_bf16_gflops_one: path_peak(Isa::AmxBf16, 1),
        amx_bf16_gflops_all: path_peak(Isa::AmxBf16, threads),
        compute_lower_bound: lower_bound,
    };
    (
        peaks,
        ReadPasses {
            one: one_passes,
            all: all_passes,
        },
    )
}

/// `(best, median)` of `rates` (0 for none; the median of an even count is the mean of the
/// middle two, as every bench summary takes it).
fn best_and_median(rates: &[f64]) -> (f64, f64) {
    let mut r = rates.to_vec();
    r.sort_by(f64::total_cmp);
    match r.len() {
        0 => (0.0, 0.0),
        n if n % 2 == 0 => (r[n - 1], (r[n / 2 - 1] + r[n / 2]) / 2.0),
        n => (r[n - 1], r[n / 2]),
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
    best_and_median(&read_bandwidth_passes(buf, threads, budget))
}

/// [`read_bandwidth`]'s timed passes, GB/s each, in the order run; none when `buf` is too
/// small to split.
///
/// A pass's time runs from the first thread's start to the last thread's end. Timing each
/// thread on its own and taking the slowest would credit a pass whose threads did not overlap
/// (one held off its core, as happens on a shared host) with the sum of single-thread rates:
/// on a 2-core host that read ~2x the concurrent rate.
pub fn read_bandwidth_passes(buf: &[u64], threads: usize, budget: Duration) -> Vec<f64> {
    let threads = threads.max(1);
    let part = buf.len() / threads / 64 * 64;
    if part == 0 {
        return Vec::new();
    }
    let bytes = (part * threads * 8) as f64;
    // One untimed warm-up pass tells how many passes fit the budget.
    let t = Instant::now();
    std::hint::black_box(read_sum(&buf[..part]));
    let one_pass = t.elapsed().as_secs_f64() * threads as f64 / threads.min(2) as f64;
    let passes = ((budget.as_secs_f64() / one_pass.max(1e-6)) as usize).clamp(3, 64);
    let barrier = Barrier::new(threads);
    let per_thread: Vec<Vec<(Instant, Instant)>> = std::thread::scope(|s| {
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
                            (t, Instant::now())
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bandwidth thread panicked"))
            .collect()
    });
    (0..passes)
        .map(|p| bytes / span(per_thread.iter().map(|t| t[p])).max(1e-9) / 1e9)
        .collect()
}

/// Seconds from the earliest start to the latest end of `runs` (`(start, end)` each): the
/// time a set of threads took together.
fn span(runs: impl Iterator<Item = (Instant, Instant)>) -> f64 {
    let mut first: Option<(Instant, Instant)> = None;
    for (a, b) in runs {
        first = Some(match first {
            None => (a, b),
            Some((s, e)) => (s.min(a), e.max(b)),
        });
    }
    first.map_or(0.0, |(s, e)| (e - s).as_secs_f64())
}

/// fp32 FMA peak of `threads` threads each running independent FMA chains for about `budget`,
/// GFLOP/s.
pub fn fma_peak(threads: usize, budget: Duration) -> f64 {
    chain_peak(threads, budget, fma_chains, FMA_FLOPS_PER_ITER).rate
}

/// Compute peak of `path`'s matrix instruction (fp32 FMA for AVX2 and portable, `vdpbf16ps`
/// for AVX-512 BF16, `tdpbf16ps` for AMX-BF16) over `threads` threads for about `budget`,
/// GFLOP/s; 0 when this CPU cannot run `path`. Runs whatever the calling thread's override
/// says for the FMA figure (as [`fma_peak`]).
pub fn compute_peak(path: Isa, threads: usize, budget: Duration) -> f64 {
    compute_peak_checked(path, threads, budget).rate
}

/// [`compute_peak`], saying whether the figure came from undisturbed runs: runs repeat (up to
/// nine) until three had every thread on its CPU for the whole run, and the best of those
/// counts; when none did, the best disturbed run is kept as a lower bound.
pub fn compute_peak_checked(path: Isa, threads: usize, budget: Duration) -> PeakRate {
    if !path.is_supported() {
        return PeakRate {
            rate: 0.0,
            undisturbed: true,
        };
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 => chain_peak(threads, budget, bf16_dot_chains, DOT_FLOPS_PER_ITER),
        #[cfg(target_arch = "x86_64")]
        Isa::AmxBf16 => chain_peak(threads, budget, amx_chains, AMX_FLOPS_PER_ITER),
        _ => chain_peak(threads, budget, fma_chains, FMA_FLOPS_PER_ITER),
    }
}

/// A measured compute peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PeakRate {
    /// G operations (FLOPs, or int8 OPs) per second.
    pub rate: f64,
    /// The figure came from runs in which every thread had its CPU throughout; false: every
    /// run was disturbed and the figure is a lower bound.
    pub undisturbed: bool,
}

/// The best rate of `threads` threads running `kernel(iters)` together (`ops_per_iter`
/// operations per iteration), in G operations/s, and whether it came from undisturbed runs.
/// Each run is timed from the first thread's start to the last thread's end, as
/// [`read_bandwidth_passes`] does; the iteration count is calibrated on the calling thread so
/// one run takes about `budget / 4`. Shared by the FMA, BF16 and int8 peaks so they are timed
/// the same way.
///
/// A run in which some thread was held off its CPU (its CPU time short of the run's span, see
/// [`ran_throughout`]) measures the scheduler, not the core: its span counts time the thread
/// did not compute. Runs repeat until [`PEAK_RUNS`] were undisturbed (or [`PEAK_MAX_RUNS`]
/// ran) and the best undisturbed one is kept; only when every run was disturbed is the best of
/// them kept, as the lower bound it then is. Summing each thread's rate over its own CPU time
/// instead would credit threads that took turns on one core (SMT siblings, or vCPUs the
/// hypervisor runs in turn) with rates they cannot reach together.
pub(crate) fn chain_peak<R>(
    threads: usize,
    budget: Duration,
    kernel: fn(u64) -> R,
    ops_per_iter: f64,
) -> PeakRate {
    let threads = threads.max(1);
    let mut iters = 1u64 << 10;
    loop {
        let t = Instant::now();
        std::hint::black_box(kernel(iters));
        let dt = t.elapsed().as_secs_f64();
        if dt > budget.as_secs_f64() / 20.0 || iters > 1 << 34 {
            iters = ((iters as f64) * budget.as_secs_f64() / 4.0 / dt.max(1e-9)) as u64;
            break;
        }
        iters *= 4;
    }
    let iters = iters.max(1 << 8);
    let runs = timed_runs(threads, || {
        std::hint::black_box(kernel(iters));
    });
    let ops = ops_per_iter * iters as f64 * threads as f64;
    let (span, undisturbed) = best_span(&runs);
    PeakRate {
        rate: ops / span.max(1e-9) / 1e9,
        undisturbed,
    }
}

/// Undisturbed runs [`chain_peak`] wants before it stops.
const PEAK_RUNS: usize = 3;
/// Runs [`chain_peak`] makes at most, disturbed or not.
const PEAK_MAX_RUNS: usize = 9;
/// The share of its wall time a thread must have been given its CPU for its run to count as
/// undisturbed. Timer ticks and the barrier's wake-up cost a run of milliseconds well under 1%.
const RAN_THROUGHOUT: f64 = 0.95;

/// One thread's part of a timed run: its wall-clock start and end and the CPU time it was
/// given in between.
#[derive(Clone, Copy, Debug)]
struct ThreadRun {
    start: Instant,
    end: Instant,
    cpu_seconds: f64,
}

/// Whether every thread of a run had its CPU for (nearly) the whole run, from the first
/// thread's start to the last one's end: a thread held off after the barrier starts late and
/// stretches the span without losing any of its own time, so each thread's CPU time is held
/// against the span, not against its own wall time. With steal time accounted (KVM's
/// paravirtual clock), a vCPU the hypervisor held off shows here too.
fn ran_throughout(run: &[ThreadRun]) -> bool {
    let span = span(run.iter().map(|t| (t.start, t.end)));
    run.iter().all(|t| t.cpu_seconds >= RAN_THROUGHOUT * span)
}

/// The shortest span among undisturbed runs (and true), or among all runs when none was
/// undisturbed (and false); seconds (0 for no runs).
fn best_span(runs: &[Vec<ThreadRun>]) -> (f64, bool) {
    let span_of = |run: &Vec<ThreadRun>| span(run.iter().map(|t| (t.start, t.end)));
    let clean = runs
        .iter()
        .filter(|r| ran_throughout(r))
        .map(span_of)
        .fold(f64::INFINITY, f64::min);
    if clean.is_finite() {
        return (clean, true);
    }
    let any = runs.iter().map(span_of).fold(f64::INFINITY, f64::min);
    (if any.is_finite() { any } else { 0.0 }, false)
}

/// Runs `work` on `threads` threads together, started by a barrier each round, until
/// [`PEAK_RUNS`] rounds ran undisturbed or [`PEAK_MAX_RUNS`] ran; each round's threads' times.
fn timed_runs(threads: usize, work: impl Fn() + Sync) -> Vec<Vec<ThreadRun>> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};
    let start = Barrier::new(threads);
    let recorded = Barrier::new(threads);
    let rounds: Mutex<Vec<Vec<ThreadRun>>> = Mutex::new(Vec::new());
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for round in 0..PEAK_MAX_RUNS {
                    start.wait();
                    let c0 = thread_cpu_seconds();
                    let t0 = Instant::now();
                    work();
                    let t1 = Instant::now();
                    let run = ThreadRun {
                        start: t0,
                        end: t1,
                        cpu_seconds: thread_cpu_seconds() - c0,
                    };
                    {
                        let mut rounds = rounds.lock().unwrap_or_else(|e| e.into_inner());
                        if rounds.len() == round {
                            rounds.push(Vec::with_capacity(threads));
                        }
                        rounds[round].push(run);
                    }
                    // The leader decides once every thread has recorded; the others read its
                    // decision after the next barrier, so all leave in the same round.
                    if recorded.wait().is_leader() {
                        let rounds = rounds.lock().unwrap_or_else(|e| e.into_inner());
                        let clean = rounds.iter().filter(|r| ran_throughout(r)).count();
                        done.store(clean >= PEAK_RUNS, Ordering::Relaxed);
                    }
                    start.wait();
                    if done.load(Ordering::Relaxed) {
                        break;
                    }
                }
            });
        }
    });
    rounds.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// CPU time the calling thread has been given, seconds (`CLOCK_THREAD_CPUTIME_ID`); 0 where the
/// clock cannot be read, which makes every run count as disturbed and leaves the wall-clock
/// figure in charge.
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux defines, and
    // an unsupported one only returns an error, checked here.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Independent accumulators per chain loop.
const CHAINS: usize = 12;
/// FLOPs per loop iteration: `CHAINS` FMAs of 8 lanes, 2 FLOPs each.
pub const FMA_FLOPS_PER_ITER: f64 = (CHAINS * 8 * 2) as f64;

/// FLOPs per `vdpbf16ps` chain iteration: `CHAINS` instructions of 16 lanes × 2 products, 2
/// FLOPs each.
#[cfg(target_arch = "x86_64")]
const DOT_FLOPS_PER_ITER: f64 = (CHAINS * 16 * 2 * 2) as f64;

/// FLOPs per AMX iteration: four `tdpbf16ps` of 16 × 16 outputs × 32 products, 2 FLOPs each.
#[cfg(target_arch = "x86_64")]
const AMX_FLOPS_PER_ITER: f64 = (4 * 16 * 16 * 32 * 2) as f64;

/// `CHAINS` independent `vdpbf16ps` chains of `iters` steps each.
///
/// # Panics
/// If the CPU lacks AVX-512 BF16 (callers check [`Isa::is_supported`]).
#[cfg(target_arch = "x86_64")]
fn bf16_dot_chains(iters: u64) -> f32 {
    assert!(Isa::Avx512Bf16.is_supported(), "no AVX-512 BF16");
    // SAFETY: the CPU supports AVX-512 F and BF16 (asserted).
    unsafe { wide::bf16_dot_chains(iters) }
}

/// `iters` rounds of four independent `tdpbf16ps` on tiles loaded once.
///
/// # Panics
/// If the CPU or OS lacks AMX-BF16 (callers check [`Isa::is_supported`]).
#[cfg(target_arch = "x86_64")]
fn amx_chains(iters: u64) -> f32 {
    assert!(Isa::AmxBf16.is_supported(), "no AMX-BF16");
    // SAFETY: the CPU has AMX-BF16 and the tile state was granted (asserted: `AmxBf16` is only
    // supported when both hold).
    unsafe { wide::amx_chains(iters) }
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::CHAINS;

    /// See [`super::bf16_dot_chains`].
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn bf16_dot_chains(iters: u64) -> f32 {
        // Small bf16 values (1/1024 and 1/2048: 0x3A80, 0x3A00) so the sums stay finite.
        let bits = |v: u32| _mm512_set1_epi32(std::hint::black_box(v as i32));
        // SAFETY: plain 512-bit vectors with no invalid bit patterns.
        let (a, b): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(bits(0x3A80_3A80)),
                std::mem::transmute::<__m512i, __m512bh>(bits(0x3A00_3A00)),
            )
        };
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, a, b);
            }
        }
        let mut s = _mm512_setzero_ps();
        for v in acc {
            s = _mm512_add_ps(s, v);
        }
        _mm512_reduce_add_ps(s)
    }

    /// See [`super::amx_chains`].
    ///
    /// # Safety
    /// The CPU must have AMX-BF16 and Linux must have granted the tile state.
    pub(super) unsafe fn amx_chains(iters: u64) -> f32 {
        #[repr(C, align(64))]
        struct Buf([u16; 512]);
        let cfg = crate::gemm::amx_tile_config();
        let ones = Buf([0x3A80; 512]);
        let mut c = Buf([0; 512]);
        if iters == 0 {
            return 0.0;
        }
        // SAFETY: the configuration is valid (eight 16 × 64-byte tiles) and the state granted
        // (contract); the loads read the 1 KiB of `ones` at a 64-byte stride, the store writes
        // the 1 KiB of `c`; the tile state is released before the block ends.
        unsafe {
            asm!(
                "ldtilecfg [{cfg}]",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tileloadd tmm4, [{a} + {s}*1]",
                "tileloadd tmm5, [{a} + {s}*1]",
                "tileloadd tmm6, [{a} + {s}*1]",
                "tileloadd tmm7, [{a} + {s}*1]",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {s}*1], tmm0",
                "tilerelease",
                cfg = in(reg) cfg,
                a = in(reg) ones.0.as_ptr(),
                s = in(reg) 64usize,
                c = in(reg) c.0.as_mut_ptr(),
                n = inout(reg) iters => _,
                options(nostack),
            );
        }
        f32::from_bits(u32::from(c.0[0]) | (u32::from(c.0[1]) << 16))
    }
}

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

/// `iters` rounds of twelve independent 8-lane FMA chains on this thread (the AVX2 kernel
/// where the CPU has it), [`FMA_FLOPS_PER_ITER`] FLOPs a round: the loop [`fma_peak`] times,
/// for callers that price their own work against this thread's FMA rate.
pub fn fma_chains(iters: u64) -> f32 {
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
    fn a_pass_lasts_from_the_first_start_to_the_last_end() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // Two threads that did not overlap (one held off its core): the pass took both
        // threads' time together, 20 ms, not the slower thread's 10 ms.
        let serial = [(ms(0), ms(10)), (ms(10), ms(20))];
        assert!((span(serial.into_iter()) - 0.020).abs() < 1e-9);
        // Overlapping threads: first start to last end.
        let together = [(ms(1), ms(9)), (ms(0), ms(10))];
        assert!((span(together.into_iter()) - 0.010).abs() < 1e-9);
        assert_eq!(span(std::iter::empty()), 0.0);
    }

    #[test]
    fn a_run_with_a_thread_held_off_its_cpu_is_not_a_peak_run() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let run = |a: (u64, u64, f64), b: (u64, u64, f64)| {
            [a, b]
                .map(|(s, e, cpu_ms)| ThreadRun {
                    start: ms(s),
                    end: ms(e),
                    cpu_seconds: cpu_ms / 1e3,
                })
                .to_vec()
        };
        // Both threads computed the whole 100 ms.
        let clean = run((0, 100, 99.5), (0, 100, 99.0));
        assert!(ran_throughout(&clean));
        // One thread was given 60 ms of its 100.
        let held = run((0, 100, 99.5), (0, 100, 60.0));
        assert!(!ran_throughout(&held));
        // One thread was held off after the barrier and started late: its own 50 ms ran
        // throughout, but the run's span is 140 ms.
        let late = run((0, 100, 100.0), (90, 140, 50.0));
        assert!(!ran_throughout(&late));
        // A faster but disturbed run does not beat a slower clean one.
        let fast_held = run((0, 80, 80.0), (0, 80, 40.0));
        let slow_clean = run((0, 120, 120.0), (0, 120, 119.0));
        let runs = vec![fast_held.clone(), slow_clean];
        let (s, clean) = best_span(&runs);
        assert!((s - 0.120).abs() < 1e-9 && clean);
        // With no clean run, the best disturbed one stands (a lower bound on the rate).
        let (s, clean) = best_span(&[held, fast_held]);
        assert!((s - 0.080).abs() < 1e-9 && !clean);
        assert_eq!(best_span(&[]), (0.0, false));
    }

    #[test]
    fn timed_runs_stop_at_the_third_undisturbed_round() {
        for threads in [1, 2, 3] {
            let runs = timed_runs(threads, || {
                std::hint::black_box((0..200_000u64).fold(0u64, |a, b| a ^ b.wrapping_mul(a)));
            });
            assert!(
                (PEAK_RUNS..=PEAK_MAX_RUNS).contains(&runs.len()),
                "{}",
                runs.len()
            );
            assert!(runs.iter().all(|r| r.len() == threads));
            let clean = runs.iter().filter(|r| ran_throughout(r)).count();
            // Stopped as soon as the third clean round ran, or ran out of rounds.
            assert!(clean <= PEAK_RUNS);
            assert!(clean == PEAK_RUNS || runs.len() == PEAK_MAX_RUNS);
            if clean == PEAK_RUNS {
                assert!(ran_throughout(runs.last().unwrap()));
            }
        }
    }

    #[test]
    fn thread_cpu_time_advances_with_work_and_not_with_sleep() {
        let c0 = thread_cpu_seconds();
        std::thread::sleep(Duration::from_millis(30));
        let slept = thread_cpu_seconds() - c0;
        let c1 = thread_cpu_seconds();
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(30) {
            std::hint::black_box(t.elapsed());
        }
        let worked = thread_cpu_seconds() - c1;
        assert!(c0 > 0.0);
        assert!(slept < 0.015, "slept {slept}");
        // Busy for 30 ms of wall time: given some of it even on a loaded host.
        assert!(worked > 0.001, "worked {worked}");
    }

    #[test]
    fn sysfs_cache_sizes_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_cache_size("491520K\n"), Some(480 << 20));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("512"), Some(512));
        for bad in ["", "K", "12Q", "-4K", "99999999999999999999G"] {
            assert_eq!(parse_cache_size(bad), None, "{bad:?}");
        }
    }

    /// The default buffer is at least the floor and, where the cache is reported, several
    /// times it (unless memory is short, which this test's machines are not).
    #[test]
    fn the_default_buffer_is_several_times_the_last_level_cache() {
        let b = default_buffer_bytes();
        let quarter = available_memory_bytes().map_or(usize::MAX, |a| a / 4);
        assert!(b >= MIN_BUFFER_BYTES || b == quarter, "{b} {quarter}");
        match last_level_cache_bytes() {
            Some(llc) => {
                println!("last-level cache {} KiB, buffer {} MiB", llc >> 10, b >> 20);
                assert!(
                    b >= BUFFER_PER_LLC * llc || b == quarter,
                    "{b} {llc} {quarter}"
                );
            }
            None => println!("no cache size reported here: buffer {} MiB", b >> 20),
        }
    }

    /// The flush reads twice the cache (or the floor, or the memory cap) and every part of
    /// its buffer, whatever the thread count, including more threads than 64-word blocks.
    #[test]
    fn the_cache_flush_reads_twice_the_last_level_cache() {
        let f = CacheFlush::new(2);
        let quarter = available_memory_bytes().map_or(usize::MAX, |a| a / 4);
        let want = last_level_cache_bytes()
            .map_or(MIN_BUFFER_BYTES, |c| c * CacheFlush::PER_LLC)
            .max(MIN_BUFFER_BYTES)
            .min(quarter);
        // Whole 64-word blocks of the wanted bytes.
        assert!(
            f.bytes() <= want && f.bytes() + 512 > want,
            "{} {want}",
            f.bytes()
        );
        f.run();
        assert_eq!(
            f.buf[f.buf.len() - 1],
            f.buf.len() as u64 - 1,
            "written once"
        );
        println!("{}", f.describe());
        let many = CacheFlush {
            buf: vec![0; 4096],
            threads: 1000,
            llc: Some(1 << 30),
        };
        many.run();
        assert!(
            many.describe().contains("steps start partly warm"),
            "{}",
            many.describe()
        );
        let unknown = CacheFlush { llc: None, ..many };
        assert!(unknown.describe().contains("no last-level cache size"));
        // A read the size floor made larger than twice a small cache says its own ratio.
        let small_cache = CacheFlush {
            buf: vec![0; (256 << 20) / 8],
            threads: 1,
            llc: Some(32 << 20),
        };
        let d = small_cache.describe();
        assert!(d.contains("a 256 MiB read, 8 times the 32 MiB"), "{d}");
        let twice = CacheFlush {
            buf: vec![0; (64 << 20) / 8],
            threads: 1,
            llc: Some(32 << 20),
        };
        assert!(
            twice.describe().contains("2 times the 32 MiB"),
            "{}",
            twice.describe()
        );
    }

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

    /// The wide peak kernels compute what they claim (so the FLOP counts are real work):
    /// every product is 2^-10 × 2^-11 (dot) or 2^-10 × 2^-10 (tiles), summed exactly.
    #[test]
    fn wide_peak_kernels_sum_their_products() {
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::Avx512Bf16.is_supported() {
                let want = (CHAINS * 16 * 2 * 10) as f32 * 2f32.powi(-21);
                assert_eq!(bf16_dot_chains(10), want);
            } else {
                println!("AVX-512 BF16 peak kernel skipped: not on this CPU");
            }
            if Isa::AmxBf16.is_supported() {
                // One element of tile 0: 32 products per instruction, 10 instructions.
                assert_eq!(amx_chains(10), 10.0 * 32.0 * 2f32.powi(-20));
            } else {
                println!("AMX-BF16 peak kernel skipped: not on this CPU/OS");
            }
        }
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
