//! The AVX2 path's prefill GEMM: its dot-product passes against its packed kernel on the
//! Qwen3-0.6B projection shapes at prefill batches, 1 and 2 threads, as % of the fp32 FMA peak
//! measured in the same process.
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemm_prefill_rate [-- --batches 512,32,16 --reps 3 --threads 1,2 --head]`
//!
//! Each thread computes its half of the rows (one thread: all of them) as tiles of `N / 8`
//! rows, like the runtime's 8 row tiles over 2 threads. The two kernels alternate A B B A per
//! shape (A: the passes, `set_avx2_panel_min_batch(usize::MAX)`; B: the packed kernel at any
//! batch); a pass's time is the slowest thread's CPU time, so time spent descheduled on a
//! shared host does not count. Printed: the median and best GFLOP/s of each, the median of the
//! paired ratios B/A, and the best of each as % of the FMA peak of as many threads (the best of
//! the measurements before and after). `--head` adds the LM head (151936 × 1024, 311 MB).
//! `--pairs`: A is row-major weights at the default kernel choice (the packed kernel from
//! batch 64), B the same weights paired (`pair_weights_bf16`).

mod common;

use std::sync::Barrier;
use std::time::Duration;

use half::bf16;
use simpler_kernels_cpu::gemm::set_avx2_panel_min_batch;
use simpler_kernels_cpu::membw::fma_peak;
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PackedActs, WeightsBf16, gemm_bf16, pack_acts_bf16, packed_len,
    pair_weights_bf16,
};

const SHAPES: [(&str, usize, usize); 6] = [
    ("q", 2048, 1024),
    ("k/v", 1024, 1024),
    ("o", 1024, 2048),
    ("gate/up", 3072, 1024),
    ("gate+up", 6144, 1024),
    ("down", 1024, 3072),
];

fn main() {
    let pairs_mode = std::env::args().any(|a| a == "--pairs");
    assert!(
        Isa::detected() == Isa::Avx2 || pairs_mode,
        "this benchmark compares the AVX2 path's kernels (or, with --pairs, any path's \
         row-major against paired weights); the detected path is {}",
        Isa::detected().name()
    );
    println!("kernel path: {}", Isa::detected().name());
    let batches = common::batches("512,32,16");
    let reps: usize = common::arg("--reps").map_or(3, |s| s.parse().expect("--reps"));
    let threads: Vec<usize> = common::arg("--threads")
        .unwrap_or_else(|| "1,2".into())
        .split(',')
        .map(|s| s.parse().expect("--threads"))
        .collect();
    let mut shapes = SHAPES.to_vec();
    if let Some(sh) = common::arg("--shape") {
        let (n, k) = sh.split_once(',').expect("--shape N,K");
        shapes = vec![("custom", n.parse().expect("N"), k.parse().expect("K"))];
    }
    if std::env::args().any(|a| a == "--head") {
        shapes.push(("head", 151_936, 1024));
    }
    let budget = Duration::from_millis(400);
    let peak_before: Vec<f64> = threads.iter().map(|&t| fma_peak(t, budget)).collect();
    let cpu_before: Vec<f64> = threads.iter().map(|&t| cpu_fma_peak(t)).collect();
    println!(
        "FMA peak before: wall (membw) {}; thread CPU time {}",
        fmt_peaks(&threads, &peak_before),
        fmt_peaks(&threads, &cpu_before)
    );
    let mut seed = 0x1234_5678_u64;
    let mut rows = Vec::new();
    for &(name, n, k) in &shapes {
        let w: Vec<bf16> = (0..n * k)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                bf16::from_f32(((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04)
            })
            .collect();
        let wp_data = if pairs_mode {
            pair_weights_bf16(&w, n, k)
        } else {
            Vec::new()
        };
        for &batch in &batches {
            let x: Vec<bf16> = (0..batch * k)
                .map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5))
                .collect();
            let mut packed = vec![0.0f32; packed_len(batch, k)];
            pack_acts_bf16(&x, batch, k, &mut packed);
            let acts = PackedActs::new(&packed, batch, k);
            let wm = WeightsBf16::new(&w, n, k);
            // (weights, least panel batch) of variants A and B.
            let (va, vb) = if pairs_mode {
                ((wm, 64), (WeightsBf16::paired(&wp_data, n, k), 64))
            } else {
                ((wm, usize::MAX), (wm, 1))
            };
            for &t in &threads {
                let flops = 2.0 * (batch * n * k) as f64;
                // Per pass: GFLOP/s and that as a fraction of the FMA rate the same threads
                // measured just before it.
                let mut a = Vec::new();
                let mut b = Vec::new();
                // One untimed pass of each first (buffers, page faults).
                pass(va.0, acts, t, va.1);
                pass(vb.0, acts, t, vb.1);
                for r in 0..reps {
                    let order = if r % 2 == 0 {
                        [false, true]
                    } else {
                        [true, false]
                    };
                    for packed_kernel in order {
                        let (wv, min) = if packed_kernel { vb } else { va };
                        let (s, fma) = pass(wv, acts, t, min);
                        let rate = flops / s / 1e9;
                        let v = if packed_kernel { &mut b } else { &mut a };
                        v.push((rate, rate / fma));
                    }
                }
                let ratios: Vec<f64> = a.iter().zip(&b).map(|(a, b)| b.0 / a.0).collect();
                let col = |v: &[(f64, f64)], i: usize| {
                    v.iter()
                        .map(|p| if i == 0 { p.0 } else { p.1 })
                        .collect::<Vec<f64>>()
                };
                rows.push(Row {
                    name,
                    n,
                    k,
                    batch,
                    threads: t,
                    a_med: median(&col(&a, 0)),
                    a_best: best(&col(&a, 0)),
                    b_med: median(&col(&b, 0)),
                    b_best: best(&col(&b, 0)),
                    ratio: median(&ratios),
                    a_pct: median(&col(&a, 1)),
                    b_pct: median(&col(&b, 1)),
                });
            }
        }
    }
    set_avx2_panel_min_batch(None);
    let peak_after: Vec<f64> = threads.iter().map(|&t| fma_peak(t, budget)).collect();
    let cpu_after: Vec<f64> = threads.iter().map(|&t| cpu_fma_peak(t)).collect();
    println!(
        "FMA peak after: wall (membw) {}; thread CPU time {}",
        fmt_peaks(&threads, &peak_after),
        fmt_peaks(&threads, &cpu_after)
    );
    println!(
        "{:<8} {:>6} {:>5} {:>5} {:>2} | {:>8} {:>8} | {:>8} {:>8} | {:>6} | {:>6} {:>6} | {:>6} {:>6}",
        "shape",
        "N",
        "K",
        "batch",
        "t",
        "A med",
        "A best",
        "B med",
        "B best",
        "B/A",
        "A %fma",
        "B %fma",
        "A %pk",
        "B %pk"
    );
    for r in rows {
        let i = threads.iter().position(|&x| x == r.threads).unwrap_or(0);
        // Rates are in thread CPU time, so against the peak timed the same way.
        let peak = cpu_before[i].max(cpu_after[i]);
        println!(
            "{:<8} {:>6} {:>5} {:>5} {:>2} | {:>8.2} {:>8.2} | {:>8.2} {:>8.2} | {:>6.3} | {:>5.1}% {:>5.1}% | {:>5.1}% {:>5.1}%",
            r.name,
            r.n,
            r.k,
            r.batch,
            r.threads,
            r.a_med,
            r.a_best,
            r.b_med,
            r.b_best,
            r.ratio,
            100.0 * r.a_pct,
            100.0 * r.b_pct,
            100.0 * r.a_best / peak,
            100.0 * r.b_best / peak
        );
    }
}

/// One shape's results.
struct Row {
    name: &'static str,
    n: usize,
    k: usize,
    batch: usize,
    threads: usize,
    /// GFLOP/s of the passes (A) and the packed kernel (B): median and best.
    a_med: f64,
    a_best: f64,
    b_med: f64,
    b_best: f64,
    /// Median of the paired ratios B/A.
    ratio: f64,
    /// Median fraction of the FMA rate measured just before each pass.
    a_pct: f64,
    b_pct: f64,
}

/// The fp32 FMA peak of `threads` threads timed in thread CPU time like the passes (the best
/// of five runs per thread, summed): twelve independent FMA chains, the membw measurement's
/// kernel shape.
/// Rounds of the FMA kernel run before each pass (~10 ms).
const FMA_ITERS: u64 = 5_000_000;

fn cpu_fma_peak(threads: usize) -> f64 {
    const ITERS: u64 = 20_000_000;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    (0..5)
                        .map(|_| common::thread_fma_gflops(ITERS))
                        .fold(0.0, f64::max)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("peak thread"))
            .sum()
    })
}

fn fmt_peaks(threads: &[usize], peaks: &[f64]) -> String {
    threads
        .iter()
        .zip(peaks)
        .map(|(t, p)| format!("{t}t {p:.1} GFLOP/s"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One product of `w` by `acts` over `threads` threads (each its half of the rows in tiles of
/// `N / 8`) with the packed kernel from batch `min`: the slowest thread's CPU seconds, and the
/// FMA rate of the same threads (summed, GFLOP/s) timed just before (a short run of the peak
/// kernel, so each pass has a peak measured under the same host load).
fn pass(w: WeightsBf16<'_>, acts: PackedActs<'_>, threads: usize, min: usize) -> (f64, f64) {
    set_avx2_panel_min_batch(Some(min));
    let n = w.rows();
    let batch = acts.rows();
    let tiles = 8;
    let barrier = Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || {
                    let (r0, r1) = (n * t / threads, n * (t + 1) / threads);
                    let width = r1 - r0;
                    let mut out = vec![0.0f32; batch * width];
                    let my_tiles = tiles / threads;
                    barrier.wait();
                    let fma = common::thread_fma_gflops(FMA_ITERS);
                    let c0 = common::thread_cpu_seconds();
                    for i in 0..my_tiles {
                        let a = r0 + width * i / my_tiles;
                        let b = r0 + width * (i + 1) / my_tiles;
                        let tile = GemmTile {
                            n: a..b,
                            k: 0..w.cols(),
                            mode: OutMode::Store,
                        };
                        gemm_bf16(w, acts, &tile, &mut out[a - r0..], width);
                    }
                    let dt = common::thread_cpu_seconds() - c0;
                    std::hint::black_box(&out);
                    (dt, fma)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread"))
            .fold((0.0f64, 0.0f64), |(d, f), (dt, fma)| (d.max(dt), f + fma))
    })
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}
