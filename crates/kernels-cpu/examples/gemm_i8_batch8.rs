//! The W8A8 GEMM at the MoE's batch (8 rows) on each int8 path this machine has, against the
//! two limits that can bind it: the measured int8 dot-product peak of the path and the
//! measured streaming read bandwidth, one thread. Each round streams a set of expert-shaped
//! matrices (together far larger than the caches) once per path in rotating order; the report
//! gives the best and median weight bandwidth and int8 rate per path, the bound
//! `max(bytes / bandwidth, ops / peak)`, which of the two binds, and the share of the bound
//! the best and median rounds reach.
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemm_i8_batch8 -- [N K ROUNDS BATCH
//! MIB [LAYOUT]]` (default 2048 4096 9 8 256 row-major: one FLASH expert's `W1`, 256 MiB of
//! matrices per pass; `LAYOUT`: `row-major`, `packed` or `interleaved`).
//! A small `MIB` (one or two) keeps the matrices in the core's cache: the products then run
//! at the int8 rate, and `%peak` (the rate over the path's measured peak) is the share that
//! counts; the bandwidth columns assume streaming and do not apply.

use std::time::{Duration, Instant};

mod common;

use simpler_kernels_cpu::gemm_i8::peak::int8_peaks;
use simpler_kernels_cpu::membw::read_bandwidth;
use simpler_kernels_cpu::{
    ActsI8, GemmTile, I8Layout, I8Path, OutMode, WeightsI8, gemm_i8_w8a8, pack_weights_i8_as,
    quantize_acts_i8, with_i8_path,
};

fn main() {
    let all: Vec<String> = std::env::args().skip(1).collect();
    let layout = match all.get(5).map(String::as_str) {
        None | Some("row-major") => I8Layout::RowMajor,
        Some("packed") => I8Layout::Packed,
        Some("interleaved") => I8Layout::Interleaved,
        Some(other) => panic!("LAYOUT {other:?}: row-major, packed or interleaved"),
    };
    let args: Vec<usize> = all
        .iter()
        .take(5)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let n = args.first().copied().unwrap_or(2048);
    let k = args.get(1).copied().unwrap_or(4096);
    let rounds = args.get(2).copied().unwrap_or(9).max(1);
    let batch = args.get(3).copied().unwrap_or(8).max(1);
    let mib = args.get(4).copied().unwrap_or(256).max(1);
    let mats = (mib << 20) / (n * k) + 1;
    let mut seed = 7u64;
    let mut rnd = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    // Huge pages, as the runtime holds weights (`common::huge_i8`).
    let wq: Vec<&[i8]> = (0..mats)
        .map(|_| {
            let rm: Vec<i8> = (0..n * k).map(|_| (rnd() * 250.0) as i8).collect();
            let w = common::huge_i8(n * k);
            pack_weights_i8_as(layout, &rm, n, k, k, w);
            &*w
        })
        .collect();
    let sw = vec![0.01f32; n];
    let x: Vec<f32> = (0..batch * k).map(|_| rnd()).collect();
    let mut xq = vec![0i8; batch * k];
    let mut xs = vec![0.0f32; batch];
    quantize_acts_i8(&x, batch, k, k, None, &mut xq, k, &mut xs);
    let tile = GemmTile {
        n: 0..n,
        k: 0..k,
        mode: OutMode::Store,
    };
    let mut out = vec![0.0f32; batch * n];

    // AVX2 and AVX-VNNI read packed and interleaved weights only through the portable loops.
    let paths: Vec<I8Path> = I8Path::ALL
        .into_iter()
        .filter(|p| p.is_supported())
        .filter(|p| layout == I8Layout::RowMajor || *p >= I8Path::Avx512Vnni)
        .collect();
    let peaks = int8_peaks(1, Duration::from_secs(2));
    let bw_buf = vec![1u64; (512usize << 20) / 8];
    let (bw_best, bw_median) = read_bandwidth(&bw_buf, 1, Duration::from_secs(2));
    drop(bw_buf);
    println!(
        "W8A8 GEMM [{n} x {k}] int8 {}, batch {batch}, one thread, {mats} matrices ({} MiB) per pass, {rounds} rounds",
        layout.name(),
        (mats * n * k) >> 20
    );
    println!("streaming read, one thread: best {bw_best:.1} GB/s, median {bw_median:.1} GB/s");

    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
    for round in 0..rounds {
        for j in 0..paths.len() {
            let i = (round + j) % paths.len();
            let t = Instant::now();
            with_i8_path(paths[i], || {
                for m in &wq {
                    let w = WeightsI8::with_layout(m, &sw, n, k, layout);
                    gemm_i8_w8a8(w, ActsI8::new(&xq, &xs, batch, k, k), &tile, &mut out, n);
                }
            });
            secs[i].push(t.elapsed().as_secs_f64() / mats as f64);
        }
    }
    let bytes = (n * k) as f64;
    let ops = 2.0 * (batch * n * k) as f64;
    println!(
        "{:<12} {:>9} {:>9} {:>9} {:>10} {:>11} {:>9} {:>8} {:>8} {:>6}",
        "path",
        "best us",
        "med us",
        "GB/s",
        "GOP/s",
        "peak GOP/s",
        "binds",
        "%best",
        "%median",
        "%peak"
    );
    for (i, p) in paths.iter().enumerate() {
        let s = &mut secs[i];
        s.sort_by(f64::total_cmp);
        let (best, median) = (s[0], s[s.len() / 2]);
        let peak = peaks.iter().find(|q| q.path == *p).map(|q| q.gops_one);
        let t_bw = bytes / (bw_best * 1e9);
        let t_op = peak.map_or(0.0, |g| ops / (g * 1e9));
        let bound = t_bw.max(t_op);
        let binds = if peak.is_none() {
            "(no peak)"
        } else if t_op > t_bw {
            "int8 peak"
        } else {
            "bandwidth"
        };
        println!(
            "{:<12} {:>9.1} {:>9.1} {:>9.2} {:>10.1} {:>11} {:>9} {:>7.0}% {:>7.0}% {:>6}",
            p.name(),
            best * 1e6,
            median * 1e6,
            bytes / best / 1e9,
            ops / best / 1e9,
            peak.map_or("-".into(), |g| format!("{g:.1}")),
            binds,
            100.0 * bound / best,
            100.0 * bound / median,
            peak.map_or("-".into(), |g| format!(
                "{:.0}%",
                100.0 * ops / best / 1e9 / g
            )),
        );
    }
}
