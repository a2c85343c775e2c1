//! Row-major vs tiled bf16 weights (`WeightLayout`): the Qwen3-0.6B projection shapes at
//! several batches, weights streamed from memory, passes of the two layouts interleaved
//! A B B A in one process so both see the same host load. Prints, per shape and batch, the
//! median and fastest GB/s of weights streamed per layout and the median paired ratio
//! tiled / row-major of the rates.
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemm_tiled_bw [-- --batches 1,4,8,16
//! --reps 5 --mib 256 --threads 2 --split plan|taper|halves --shapes q,k,down --cpu-time]`
//!
//! - `--mib`: the size of each layout's copies of a shape (above the last-level cache, so
//!   every pass streams from memory; at least one copy of the largest shape).
//! - `--split plan` (the default) cuts each matrix into the SPMD blocks of the Qwen3 decode
//!   plan (about 1 MiB of weights each, at least 4 per thread, whole 16-row groups) that the
//!   threads take from a shared counter, as the runtime's workers do, so the per-call costs
//!   of small blocks count; `taper` takes the same number of blocks with the runtime's tapered
//!   shares (`write_block_cols`: the last half of 8 or more blocks halving down to 1/16 of a
//!   full share, so most shares are an odd number of 16-row groups, as a prefill step's
//!   projections are cut); `halves` gives each thread one call over its share of the rows.
//!   Prefill-shaped runs: `--batches 512,128,64 --split taper --mib 32`.
//! - `--shapes`: name prefixes of the shapes to run (default all but the LM head).
//! - `--blocks N`: N blocks per matrix instead of the split's count (DeepSeek-V4's graphs cut
//!   each projection into 12, with `--split taper`).
//! - `--cpu-time`: rates from the threads' CPU time instead of the wall clock (on a host
//!   loaded with other work the threads are descheduled for much of the wall time; their
//!   CPU time still sees the shared memory traffic but not the waiting).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PackedActs, WeightLayout, WeightsBf16, gemm_bf16, pack_acts_bf16,
    packed_len, path_for, tile_weights_bf16, tiled_len,
};

/// `(name, N, K)`: q, k (and v), o, gate (and up), down, gate+up as one matrix, LM head; then
/// DeepSeek-V4 FLASH's bf16 input projections (`Wq_a`, and `Wkv` / a compressor matrix).
const SHAPES: [(&str, usize, usize); 9] = [
    ("q 2048x1024", 2048, 1024),
    ("k 1024x1024", 1024, 1024),
    ("o 1024x2048", 1024, 2048),
    ("gate 3072x1024", 3072, 1024),
    ("down 1024x3072", 1024, 3072),
    ("gate_up 6144x1024", 6144, 1024),
    ("lm_head 151936x1024", 151_936, 1024),
    ("dsv4_wq_a 1024x4096", 1024, 4096),
    ("dsv4_wkv 512x4096", 512, 4096),
];

/// How a pass cuts a matrix among the threads.
#[derive(Clone, Copy)]
struct Split {
    threads: usize,
    /// Row blocks per matrix, taken from a shared counter.
    blocks: usize,
    /// Activations prepared once per matrix and thread (`PreparedActs`), not per block.
    prepared: bool,
    /// Tapered shares instead of equal ones.
    taper: bool,
    /// Rates from CPU time.
    cpu_time: bool,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = common::arg;
    let batches = common::batches("1,4,8,16");
    let reps: usize = get("--reps").map_or(5, |s| s.parse().expect("--reps"));
    let mib: usize = get("--mib").map_or(256, |s| s.parse().expect("--mib"));
    let threads: usize = get("--threads").map_or(2, |s| s.parse().expect("--threads"));
    let threads = threads.max(1);
    let (plan, taper) = match get("--split").as_deref() {
        None | Some("plan") => (true, false),
        Some("taper") => (true, true),
        Some("halves") => (false, false),
        Some(other) => panic!("--split: plan, taper or halves, not {other}"),
    };
    let shapes = get("--shapes");
    let cpu_time = args.iter().any(|a| a == "--cpu-time");
    let chosen: Vec<(&str, usize, usize)> = SHAPES
        .iter()
        .copied()
        .filter(|(name, _, _)| match &shapes {
            Some(list) => list.split(',').any(|p| name.starts_with(p)),
            None => !name.starts_with("lm_head"),
        })
        .collect();
    let largest = chosen.iter().map(|&(_, n, k)| n * k).max().unwrap_or(0);
    let pool_len = (mib << 19).max(largest);
    let row_major = common::huge_pool(pool_len);
    let tiled = common::huge_pool(pool_len);
    let isa = Isa::current();
    println!(
        "isa {}; {} MiB of copies per layout per shape; {threads} threads; {} split; {} time",
        isa.name(),
        pool_len >> 19,
        match (plan, taper) {
            (true, true) => "tapered plan",
            (true, false) => "plan",
            _ => "halves",
        },
        if cpu_time { "CPU" } else { "wall" }
    );
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for &(name, n, k) in &chosen {
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
        let split = Split {
            threads,
            blocks: if let Some(b) = common::arg("--blocks") {
                b.parse().expect("--blocks: an integer")
            } else if plan {
                plan_blocks(n, k, threads)
            } else {
                threads
            },
            taper,
            cpu_time,
            prepared: std::env::args().any(|a| a == "--prepared"),
        };
        for &batch in &batches {
            let x: Vec<bf16> = (0..batch * k)
                .map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5))
                .collect();
            let mut packed = vec![0.0f32; packed_len(batch, k)];
            pack_acts_bf16(&x, batch, k, &mut packed);
            let acts = PackedActs::new(&packed, batch, k);
            let (mut ga, mut gb, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
            // One untimed pass of each to fault in scratch and settle the clocks.
            pass(&rm, acts, split);
            pass(&tl, acts, split);
            for _ in 0..reps.max(1) {
                let a1 = bytes / pass(&rm, acts, split) / 1e9;
                let b1 = bytes / pass(&tl, acts, split) / 1e9;
                let b2 = bytes / pass(&tl, acts, split) / 1e9;
                let a2 = bytes / pass(&rm, acts, split) / 1e9;
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
                "{name:<20} batch {batch:>2}, {} blocks: row-major ({}) median {ma:>6.2} GB/s (best {:>6.2}), tiled ({}) median {mb:>6.2} (best {:>6.2}), tiled/row-major median {mr:.3} (range {:.3}..{:.3}) of {} pairs",
                split.blocks,
                path_for(isa, batch, WeightLayout::RowMajor).name(),
                ga[ga.len() - 1],
                path_for(isa, batch, WeightLayout::Tiled).name(),
                gb[gb.len() - 1],
                ratio[0],
                ratio[ratio.len() - 1],
                ratio.len()
            );
        }
    }
}

/// SPMD blocks of an `n x k` projection as the Qwen3 decode plan cuts it
/// (`TilePolicy::blocks`: about 1 MiB of weights each, at least 4 per thread, at most one per
/// 16 rows).
fn plan_blocks(n: usize, k: usize, threads: usize) -> usize {
    (n * k * 2)
        .div_ceil(1 << 20)
        .max(4 * threads)
        .min(n / 16)
        .max(1)
}

/// One pass over every copy, the threads taking each copy's row blocks (whole 16-row groups)
/// from a shared counter; seconds of wall time, or of CPU time per thread.
fn pass(mats: &[WeightsBf16<'_>], acts: PackedActs<'_>, split: Split) -> f64 {
    let next = AtomicUsize::new(0);
    let total = mats.len() * split.blocks;
    let t0 = Instant::now();
    let cpu: f64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..split.threads)
            .map(|_| {
                let next = &next;
                s.spawn(move || {
                    let c0 = common::thread_cpu_seconds();
                    let mut prepared = simpler_kernels_cpu::PreparedActs::default();
                    let mut prepared_for = usize::MAX;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= total {
                            break;
                        }
                        let (w, b) = (&mats[i / split.blocks], i % split.blocks);
                        let units = w.rows().div_ceil(16);
                        let share = if split.taper {
                            simpler_core::tapered_range(units, split.blocks, b)
                        } else {
                            units * b / split.blocks..units * (b + 1) / split.blocks
                        };
                        let rows = (share.start * 16).min(w.rows())..(share.end * 16).min(w.rows());
                        let part = w.row_range(rows.clone());
                        let mut out = vec![0.0f32; acts.rows() * rows.len()];
                        let tile = GemmTile {
                            n: 0..rows.len(),
                            k: 0..w.cols(),
                            mode: OutMode::Store,
                        };
                        if split.prepared {
                            // Once per matrix and thread, as a task's blocks on one core.
                            if prepared_for != i / split.blocks {
                                prepared.prepare(acts);
                                prepared_for = i / split.blocks;
                            }
                            simpler_kernels_cpu::gemm_bf16_prepared(
                                part,
                                &prepared,
                                &tile,
                                &mut out,
                                rows.len(),
                            );
                        } else {
                            gemm_bf16(part, acts, &tile, &mut out, rows.len());
                        }
                        std::hint::black_box(&out);
                    }
                    common::thread_cpu_seconds() - c0
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("worker")).sum()
    });
    if split.cpu_time {
        cpu / split.threads as f64
    } else {
        t0.elapsed().as_secs_f64()
    }
}
