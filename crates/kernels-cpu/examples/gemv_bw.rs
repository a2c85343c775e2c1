//! Standalone GEMV/GEMM benchmark: the Qwen3-0.6B projection shapes on 1 and 2 threads
//! (disjoint row halves), achieved GB/s and GFLOP/s against the measured `membw` peaks.
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemv_bw [-- --batches 1,4,16 --layers 6 --reps 5 --rows N --k K --shape N,K --portable]`
//!
//! `--versus-isa PATH` also times every pass on a second path (e.g. `avx512-bf16` against the
//! detected `amx-bf16`), passes interleaved A B B A so both see the same host load, and prints
//! the median and fastest pass of each with the median of the paired ratios B/A.
//!
//! `--cpu-time` times each thread's pass by its CPU time instead of the wall clock (on a host
//! shared with other work, time descheduled does not count; cache pollution still does).
//!
//! `--shape N,K` replaces the 0.6B shapes by one `N × K` matrix (per layer), e.g. a 14B
//! projection: `--shape 96,17408 --layers 1 --reps 30` times one tile from cache.

mod common;

use std::sync::Barrier;
use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::membw::{MeasureOptions, measure};
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PackedActs, WeightsBf16, gemm_bf16, pack_acts_bf16, packed_len,
    with_isa,
};

/// `(name, N, K)` of the 0.6B projections.
const SHAPES: [(&str, usize, usize); 7] = [
    ("q", 2048, 1024),
    ("k", 1024, 1024),
    ("v", 1024, 1024),
    ("o", 1024, 2048),
    ("gate", 3072, 1024),
    ("up", 3072, 1024),
    ("down", 1024, 3072),
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = common::arg;
    let batches = common::batches("1,2,4,16");
    let layers: usize = get("--layers").map_or(6, |s| s.parse().expect("--layers"));
    let reps: usize = get("--reps").map_or(5, |s| s.parse().expect("--reps"));
    let isa = if args.iter().any(|a| a == "--portable") {
        Isa::Portable
    } else {
        Isa::detected()
    };
    let versus = get("--versus-isa").map(|n| {
        let i = Isa::from_name(&n).unwrap_or_else(|| panic!("--versus-isa: unknown path {n:?}"));
        assert!(i.is_supported(), "--versus-isa: {n} not supported here");
        i
    });
    with_isa(isa, || run(&batches, layers, reps, isa, versus)).expect("isa not supported");
}

fn run(batches: &[usize], layers: usize, reps: usize, isa: Isa, versus: Option<Isa>) {
    let peaks = measure(&MeasureOptions::default());
    println!(
        "membw: read 1t {:.1} GB/s (median {:.1}), {}t {:.1} GB/s (median {:.1}); FMA 1t {:.1} GFLOP/s, {}t {:.1} GFLOP/s; isa {}",
        peaks.read_gbs_one,
        peaks.read_gbs_one_median,
        peaks.threads,
        peaks.read_gbs_all,
        peaks.read_gbs_all_median,
        peaks.fma_gflops_one,
        peaks.threads,
        peaks.fma_gflops_all,
        isa.name()
    );
    // `layers` copies of every projection so the weights do not fit in the last-level cache.
    let mut seed = 0x1234_5678_u64;
    let only_k: Option<usize> = std::env::args()
        .skip_while(|a| a != "--k")
        .nth(1)
        .map(|s| s.parse().expect("--k"));
    // `--rows N` caps every projection at N rows: small enough, the pass runs from cache and
    // measures the kernel's arithmetic rate instead of the memory's.
    let max_rows: Option<usize> = std::env::args()
        .skip_while(|a| a != "--rows")
        .nth(1)
        .map(|s| s.parse().expect("--rows"));
    let custom: Option<(&str, usize, usize)> = std::env::args()
        .skip_while(|a| a != "--shape")
        .nth(1)
        .map(|s| {
            let (n, k) = s.split_once(',').expect("--shape N,K");
            (
                "custom",
                n.parse().expect("--shape N"),
                k.parse().expect("--shape K"),
            )
        });
    let shapes: Vec<(&str, usize, usize)> = custom.map_or(SHAPES.to_vec(), |c| vec![c]);
    let mats: Vec<(usize, usize, &[bf16])> = (0..layers)
        .flat_map(|_| shapes.iter())
        .filter(|s| only_k.is_none_or(|k| s.2 == k))
        .map(|&(_, n, k)| {
            let n = max_rows.map_or(n, |m| n.min(m));
            let data = common::huge_pool(n * k);
            for d in data.iter_mut() {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *d = bf16::from_f32(((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04);
            }
            (n, k, &*data)
        })
        .collect();
    let weight_bytes: usize = mats.iter().map(|(n, k, _)| n * k * 2).sum();
    let params: usize = mats.iter().map(|(n, k, _)| n * k).sum();
    println!(
        "weights: {} matrices, {:.1} MB per pass",
        mats.len(),
        weight_bytes as f64 / 1e6
    );
    for &batch in batches {
        let kmax = shapes.iter().map(|s| s.2).max().unwrap_or(1);
        let x: Vec<bf16> = (0..batch * kmax)
            .map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5))
            .collect();
        // One packed activation per K used.
        let mut ks: Vec<usize> = shapes.iter().map(|s| s.2).collect();
        ks.sort_unstable();
        ks.dedup();
        let packed: Vec<(usize, Vec<f32>)> = ks
            .iter()
            .map(|&k| {
                let mut p = vec![0.0f32; packed_len(batch, k)];
                let xs: Vec<bf16> = (0..batch)
                    .flat_map(|b| x[b * kmax..b * kmax + k].iter().copied())
                    .collect();
                pack_acts_bf16(&xs, batch, k, &mut p);
                (k, p)
            })
            .collect();
        for threads in [1usize, 2] {
            if let Some(b_isa) = versus {
                versus_passes(&mats, &packed, batch, threads, reps, (isa, b_isa));
                continue;
            }
            let secs = time_pass(&mats, &packed, batch, threads, reps, isa);
            let gbs = weight_bytes as f64 / secs / 1e9;
            let gflops = 2.0 * (params * batch) as f64 / secs / 1e9;
            let (bw, fma) = if threads == 1 {
                (peaks.read_gbs_one, peaks.fma_gflops_one)
            } else {
                (peaks.read_gbs_all, peaks.fma_gflops_all)
            };
            println!(
                "batch {batch:>2} threads {threads}: {:>7.2} ms/pass  {gbs:>6.1} GB/s = {:>5.1}% of read bw  {gflops:>6.1} GFLOP/s = {:>5.1}% of FMA peak",
                secs * 1e3,
                100.0 * gbs / bw,
                100.0 * gflops / fma
            );
        }
    }
}

/// `reps` rounds of A B B A passes (one pass each on paths `a` and `b`): the median and fastest
/// pass of each path and the median of the paired ratios B/A.
fn versus_passes(
    mats: &[(usize, usize, &[bf16])],
    packed: &[(usize, Vec<f32>)],
    batch: usize,
    threads: usize,
    reps: usize,
    (a, b): (Isa, Isa),
) {
    let (mut ta, mut tb, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps.max(1) {
        let a1 = time_pass(mats, packed, batch, threads, 1, a);
        let b1 = time_pass(mats, packed, batch, threads, 1, b);
        let b2 = time_pass(mats, packed, batch, threads, 1, b);
        let a2 = time_pass(mats, packed, batch, threads, 1, a);
        ratio.push(b1 / a1);
        ratio.push(b2 / a2);
        ta.extend([a1, a2]);
        tb.extend([b1, b2]);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "batch {batch:>2} threads {threads}: A {} median {:.2} ms (fastest {:.2}), B {} median {:.2} ms (fastest {:.2}), B/A median {:.3} of {} pairs",
        a.name(),
        med(&mut ta) * 1e3,
        ta[0] * 1e3,
        b.name(),
        med(&mut tb) * 1e3,
        tb[0] * 1e3,
        med(&mut ratio),
        ratio.len()
    );
}

/// Best time of `reps` passes over every matrix on path `isa`, rows split in halves across
/// `threads`.
fn time_pass(
    mats: &[(usize, usize, &[bf16])],
    packed: &[(usize, Vec<f32>)],
    batch: usize,
    threads: usize,
    reps: usize,
    isa: Isa,
) -> f64 {
    let barrier = Barrier::new(threads);
    let times: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || {
                    with_isa(isa, || {
                        let nmax = mats.iter().map(|m| m.0).max().unwrap_or(0);
                        let mut out = vec![0.0f32; batch * nmax];
                        let mut best = f64::MAX;
                        let cpu = std::env::args().any(|a| a == "--cpu-time");
                        for _ in 0..reps {
                            barrier.wait();
                            let t0 = Instant::now();
                            let c0 = common::thread_cpu_seconds();
                            for (n, k, w) in mats {
                                let x = &packed.iter().find(|p| p.0 == *k).expect("packed K").1;
                                let rows = (n / threads * t)..(n / threads * (t + 1));
                                let tile = GemmTile {
                                    n: rows.clone(),
                                    k: 0..*k,
                                    mode: OutMode::Store,
                                };
                                gemm_bf16(
                                    WeightsBf16::new(w, *n, *k),
                                    PackedActs::new(x, batch, *k),
                                    &tile,
                                    &mut out,
                                    rows.len(),
                                );
                            }
                            let t = if cpu {
                                common::thread_cpu_seconds() - c0
                            } else {
                                t0.elapsed().as_secs_f64()
                            };
                            best = best.min(t);
                            std::hint::black_box(&out);
                        }
                        best
                    })
                    .expect("isa")
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect()
    });
    times.into_iter().fold(0.0, f64::max)
}
