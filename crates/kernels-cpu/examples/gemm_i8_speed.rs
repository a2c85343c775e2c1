//! Paired timing of one projection shape streamed from memory: the bf16 GEMM against the
//! int8 products (W8A8 with its activation quantisation, and wide), at several batch sizes,
//! one thread. Each round runs every variant over its own set of matrices (together far
//! larger than the caches) in rotating order; the report is the median per variant and the
//! median of per-round ratios to bf16, so host load common to a round cancels.
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemm_i8_speed -- N K ROUNDS`

use std::time::Instant;

mod common;

use half::bf16;
use simpler_kernels_cpu::{
    ActsI8, GemmTile, I8Path, OutMode, PackedActs, WeightsBf16, WeightsI8, gemm_bf16, gemm_i8_w8a8,
    gemm_i8_wide, pack_acts_f32, packed_len, quantize_acts_i8, with_i8_path,
};

fn main() {
    // `I8_PATH=avx512-vnni` (any `I8Path` name) times that path instead of the best one.
    if let Ok(name) = std::env::var("I8_PATH") {
        let path = I8Path::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .unwrap_or_else(|| panic!("unknown int8 path {name:?}"));
        with_i8_path(path, run).unwrap_or_else(|| panic!("{name} is not supported here"));
        return;
    }
    run();
}

fn run() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let (n, k, rounds) = (
        args.first().copied().unwrap_or(3072),
        args.get(1).copied().unwrap_or(1024),
        args.get(2).copied().unwrap_or(15),
    );
    // Enough matrices that a pass streams ~200 MB of bf16 weights.
    let mats = (200usize << 20) / (2 * n * k) + 1;
    let mut seed = 1u64;
    let mut rnd = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    // Huge pages, as the runtime holds weights (`common::huge_pool`).
    let wb: Vec<&[bf16]> = (0..mats)
        .map(|_| {
            let w = common::huge_pool(n * k);
            w.iter_mut().for_each(|v| *v = bf16::from_f32(rnd()));
            &*w
        })
        .collect();
    let wq: Vec<&[i8]> = (0..mats)
        .map(|_| {
            let w = common::huge_i8(n * k);
            w.iter_mut().for_each(|v| *v = (rnd() * 250.0) as i8);
            &*w
        })
        .collect();
    let sw = vec![0.01f32; n];
    let tile = GemmTile {
        n: 0..n,
        k: 0..k,
        mode: OutMode::Store,
    };
    println!(
        "[{n} x {k}], {mats} matrices per variant, int8 path {}",
        I8Path::current().name()
    );
    for batch in [1usize, 4, 16] {
        let x: Vec<f32> = (0..batch * k).map(|_| rnd()).collect();
        let mut packed = vec![0.0; packed_len(batch, k)];
        pack_acts_f32(&x, batch, k, &mut packed);
        let mut out = vec![0.0f32; batch * n];
        let names = ["bf16", "int8 w8a8", "int8 wide"];
        let mut times = vec![Vec::new(); 3];
        for round in 0..rounds + 1 {
            for j in 0..3 {
                let v = (round + j) % 3;
                let t = Instant::now();
                for m in 0..mats {
                    match v {
                        0 => gemm_bf16(
                            WeightsBf16::new(wb[m], n, k),
                            PackedActs::new(&packed, batch, k),
                            &tile,
                            &mut out,
                            n,
                        ),
                        1 => {
                            // The activation quantisation is part of the W8A8 cost.
                            let (mut q, mut s) = (vec![0i8; batch * k], vec![0.0f32; batch]);
                            quantize_acts_i8(&x, batch, k, k, None, &mut q, k, &mut s);
                            gemm_i8_w8a8(
                                WeightsI8::new(wq[m], &sw, n, k, k),
                                ActsI8::new(&q, &s, batch, k, k),
                                &tile,
                                &mut out,
                                n,
                            )
                        }
                        _ => gemm_i8_wide(
                            WeightsI8::new(wq[m], &sw, n, k, k),
                            &x,
                            batch,
                            k,
                            None,
                            &tile,
                            &mut out,
                            n,
                        ),
                    }
                }
                if round > 0 {
                    times[v].push(t.elapsed().as_secs_f64() / mats as f64);
                }
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let base: Vec<f64> = times[0].clone();
        for (j, name) in names.iter().enumerate() {
            let mut ratios: Vec<f64> = times[j].iter().zip(&base).map(|(t, b)| b / t).collect();
            let mut t = times[j].clone();
            let med = median(&mut t);
            let best = t[0];
            let bytes = if j == 0 { 2 * n * k } else { n * k } as f64;
            println!(
                "batch {batch:>2} {name:<10} median {:>8.1} us (best {:>8.1} us, {:>5.1} GB/s best) speed vs bf16 x{:.2} (median of paired rounds)",
                med * 1e6,
                best * 1e6,
                bytes / best / 1e9,
                median(&mut ratios)
            );
        }
    }
}
