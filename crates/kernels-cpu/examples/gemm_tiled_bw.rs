//! Row-major vs tiled bf16 weights (`WeightLayout`): the Qwen3-0.6B projection shapes at
//! several batches on 2 threads (each a half of `N`), weights streamed from memory, passes of
//! the two layouts interleaved A B B A in one process so both see the same host load.
//! Prints, per shape and batch, the median and fastest GB/s of weights streamed per layout
//! and the median paired ratio tiled / row-major of the rates.
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemm_tiled_bw [-- --batches 1,4,8,16 --reps 5 --mib 256]`
//!
//! `--mib` is the size of each layout's copies of a shape (above the last-level cache, so
//! every pass streams from memory).

mod common;

use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PackedActs, WeightLayout, WeightsBf16, gemm_bf16, pack_acts_bf16,
    packed_len, path_for, tile_weights_bf16, tiled_len,
};

/// `(name, N, K)`: q, gate (and up), down, and gate+up as one matrix.
const SHAPES: [(&str, usize, usize); 4] = [
    ("q 2048x1024", 2048, 1024),
    ("gate 3072x1024", 3072, 1024),
    ("down 1024x3072", 1024, 3072),
    ("gate_up 6144x1024", 6144, 1024),
];

const THREADS: usize = 2;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let batches: Vec<usize> = get("--batches")
        .unwrap_or_else(|| "1,4,8,16".into())
        .split(',')
        .map(|s| s.parse().expect("--batches: comma-separated integers"))
        .collect();
    let reps: usize = get("--reps").map_or(5, |s| s.parse().expect("--reps"));
    let mib: usize = get("--mib").map_or(256, |s| s.parse().expect("--mib"));
    let pool_len = mib << 19;
    let row_major = common::huge_pool(pool_len);
    let tiled = common::huge_pool(pool_len);
    let isa = Isa::current();
    println!(
        "isa {}; {mib} MiB of copies per layout per shape; {THREADS} threads",
        isa.name()
    );
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for &(name, n, k) in &SHAPES {
        let len = n * k;
        assert_eq!(
            tiled_len(n, k),
            Some(len),
            "shapes are whole groups and steps"
        );
        let copies = (pool_len / len).max(1);
        for d in row_major[..copies * len].iter_mut() {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *d = bf16::from_f32(((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04);
        }
        for c in 0..copies {
            let t = tile_weights_bf16(&row_major[c * len..(c + 1) * len], n, k);
            tiled[c * len..(c + 1) * len].copy_from_slice(&t);
        }
        let rm: Vec<WeightsBf16<'_>> = (0..copies)
            .map(|c| WeightsBf16::new(&row_major[c * len..(c + 1) * len], n, k))
            .collect();
        let tl: Vec<WeightsBf16<'_>> = (0..copies)
            .map(|c| WeightsBf16::tiled(&tiled[c * len..(c + 1) * len], n, k))
            .collect();
        let bytes = (copies * len * 2) as f64;
        for &batch in &batches {
            let x: Vec<bf16> = (0..batch * k)
                .map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5))
                .collect();
            let mut packed = vec![0.0f32; packed_len(batch, k)];
            pack_acts_bf16(&x, batch, k, &mut packed);
            let acts = PackedActs::new(&packed, batch, k);
            let (mut ga, mut gb, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
            // One untimed pass of each to fault in scratch and settle the clocks.
            pass(&rm, acts);
            pass(&tl, acts);
            for _ in 0..reps.max(1) {
                let a1 = bytes / pass(&rm, acts) / 1e9;
                let b1 = bytes / pass(&tl, acts) / 1e9;
                let b2 = bytes / pass(&tl, acts) / 1e9;
                let a2 = bytes / pass(&rm, acts) / 1e9;
                ratio.extend([b1 / a1, b2 / a2]);
                ga.extend([a1, a2]);
                gb.extend([b1, b2]);
            }
            let med = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (ma, mb, mr) = (med(&mut ga), med(&mut gb), med(&mut ratio));
            println!(
                "{name:<18} batch {batch:>2}: row-major ({}) median {ma:>5.1} GB/s (best {:>5.1}), tiled ({}) median {mb:>5.1} (best {:>5.1}), tiled/row-major median {mr:.3} of {} pairs",
                path_for(isa, batch, WeightLayout::RowMajor).name(),
                ga[ga.len() - 1],
                path_for(isa, batch, WeightLayout::Tiled).name(),
                gb[gb.len() - 1],
                ratio.len()
            );
        }
    }
}

/// One pass over every copy, each thread computing its half of the rows; seconds.
fn pass(mats: &[WeightsBf16<'_>], acts: PackedActs<'_>) -> f64 {
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            s.spawn(move || {
                for w in mats {
                    let rows = w.rows() * t / THREADS..w.rows() * (t + 1) / THREADS;
                    let part = w.row_range(rows.clone());
                    let mut out = vec![0.0f32; acts.rows() * rows.len()];
                    let tile = GemmTile {
                        n: 0..rows.len(),
                        k: 0..w.cols(),
                        mode: OutMode::Store,
                    };
                    gemm_bf16(part, acts, &tile, &mut out, rows.len());
                    std::hint::black_box(&out);
                }
            });
        }
    });
    t0.elapsed().as_secs_f64()
}
