//! The AVX-512 BF16 paired kernel at prefill batches, as a prefill step's projection blocks
//! run it: each thread computes one tile (`--n` weight rows of `--k`, paired, on huge pages)
//! against `--batch` activation rows per call, cycling over `--mats` copies of the weights (128
//! copies of 512 KiB outrun the 32 MiB L3, so the weights come from memory as in a step),
//! GFLOP/s by each call's thread CPU time against the `vdpbf16ps` peak of one core measured in
//! the same process: the median and the best call over every thread.
//!
//! `--kc C` sums `K` in calls of `C` columns (the first stored, the rest added), a split-K
//! blocking priced from outside the kernel; `--ld-out L` spaces the output rows `L` floats
//! apart, as a block of a wider output lies in the step.
//!
//! `--converted` converts the activations once per thread (`ActsConversion`, as a step's
//! projection blocks do) instead of in every call; `--adjacent` has the threads take the
//! copies in turn from one counter, so they stream neighbouring regions at once (as a step's
//! blocks of one matrix lie), instead of each its own far part of the pool. It first prints
//! what converting the activations costs (the first, cold call and the median of 200).
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemm_prefill_pairs [-- --batch 512
//! --n 256 --k 1024 --reps 40 --mats 128 --threads 2 --kc 1024 --ld-out 256 --converted
//! --adjacent]`

mod common;

use std::time::Duration;

use half::bf16;
use simpler_kernels_cpu::membw::compute_peak;
use simpler_kernels_cpu::{
    ActsConversion, GemmTile, Isa, OutMode, PackedActs, WeightsBf16, gemm_bf16,
    gemm_bf16_converted, pack_acts_bf16, packed_len, pair_weights_bf16,
};

fn main() {
    let get = |name: &str, d: usize| common::arg(name).map_or(d, |s| s.parse().expect("integer"));
    let (batch, n, k) = (get("--batch", 512), get("--n", 256), get("--k", 1024));
    let reps = get("--reps", 40).max(1);
    let mats = get("--mats", 128).max(1);
    let threads = get("--threads", 1).max(1);
    let kc = get("--kc", k).clamp(1, k);
    let ld_out = get("--ld-out", n).max(n);
    let converted = std::env::args().any(|a| a == "--converted");
    let adjacent = std::env::args().any(|a| a == "--adjacent");
    let counter = std::sync::atomic::AtomicUsize::new(0);
    if !Isa::Avx512Bf16.is_supported() {
        println!("this CPU has no AVX-512 BF16: nothing to measure");
        return;
    }
    let w: Vec<bf16> = (0..n * k)
        .map(|i| bf16::from_f32(((i * 7919 % 1000) as f32) / 1000.0 - 0.5))
        .collect();
    let wp = pair_weights_bf16(&w, n, k);
    let pool = common::huge_pool(wp.len() * mats);
    for m in 0..mats {
        pool[m * wp.len()..(m + 1) * wp.len()].copy_from_slice(&wp);
    }
    let pool = &*pool;
    let wvs: Vec<WeightsBf16<'_>> = pool
        .chunks_exact(wp.len())
        .map(|m| WeightsBf16::paired(m, n, k))
        .collect();
    let x: Vec<bf16> = (0..batch * k)
        .map(|i| bf16::from_f32(((i * 31 % 100) as f32) / 100.0))
        .collect();
    let mut packed = vec![0.0f32; packed_len(batch, k)];
    pack_acts_bf16(&x, batch, k, &mut packed);
    {
        let acts = PackedActs::new(&packed, batch, k);
        let mut conv = ActsConversion::default();
        let mut ts = Vec::new();
        for _ in 0..200 {
            let t0 = std::time::Instant::now();
            conv.convert(acts);
            ts.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        ts.sort_by(f64::total_cmp);
        println!(
            "converting {batch} x {k} activations: first call {:.2} µs, median {:.2} µs",
            ts[ts.len() - 1],
            ts[ts.len() / 2]
        );
    }
    let peak = compute_peak(Isa::Avx512Bf16, 1, Duration::from_millis(300));
    let flops = 2.0 * (batch * n * k) as f64;
    let mut rates: Vec<f64> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|th| {
                let (wvs, packed, counter) = (&wvs, &packed, &counter);
                sc.spawn(move || {
                    let acts = PackedActs::new(packed, batch, k);
                    let mut conv = ActsConversion::default();
                    conv.convert(acts);
                    let mut out = vec![0.0f32; batch * ld_out];
                    let mut rates = Vec::new();
                    // The first call (faults, clocks) is not counted.
                    for r in 0..=reps {
                        let wv = if adjacent {
                            wvs[counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % mats]
                        } else {
                            wvs[(r + th * mats / threads) % mats]
                        };
                        let t0 = common::thread_cpu_seconds();
                        for k0 in (0..k).step_by(kc) {
                            let mode = if k0 == 0 {
                                OutMode::Store
                            } else {
                                OutMode::Add
                            };
                            let tile = GemmTile {
                                n: 0..n,
                                k: k0..(k0 + kc).min(k),
                                mode,
                            };
                            if converted {
                                gemm_bf16_converted(wv, acts, &conv, &tile, &mut out, ld_out);
                            } else {
                                gemm_bf16(wv, acts, &tile, &mut out, ld_out);
                            }
                        }
                        let t = common::thread_cpu_seconds() - t0;
                        if r > 0 {
                            rates.push(flops / t / 1e9);
                        }
                    }
                    std::hint::black_box(&out);
                    rates
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a measuring thread panicked"))
            .collect()
    });
    rates.sort_by(f64::total_cmp);
    let (med, best) = (rates[rates.len() / 2], rates[rates.len() - 1]);
    println!(
        "batch {batch} n {n} k {k} kc {kc} ld_out {ld_out}, {threads} threads: median {med:.1} \
         best {best:.1} GFLOP/s = {:.1}% / {:.1}% of one core's vdpbf16ps peak {peak:.1}",
        med / peak * 100.0,
        best / peak * 100.0
    );
}
