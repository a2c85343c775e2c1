//! DeepSeek-V4 FLASH `wo_a` (the grouped bf16 output projection, `Wo_a [8 · 1024, 4096]`, 8
//! token rows) as the SWA graph splits it, kernel only: 8 SPMD blocks of whole groups taken
//! from a shared counter by `threads` threads, each block running `gemm_bf16` over its 1024
//! weight rows against its group's activations (packed once, outside the timing). Row-major
//! weights ("off") and the same weights paired (`pair_weights_bf16`, "on": the layout the
//! model uploads on the AVX2 path) alternate A B B A, round by round, after a check that both
//! give the same results within fp32 rounding. Reports per thread count the median of the
//! longest thread CPU time per pass for each, the ratios on/off of adjacent pairs, and
//! GFLOP/s and GB/s of thread CPU time; then the same on one thread over 24 weight rows that
//! stay in L2 (`K`-loop speed without the memory stream).
//!
//! `cargo run --release -p simpler-kernels-cpu --example dsv4_wo_a_bw -- [ROUNDS [THREADS
//! [ROWS [G:N:K]]]]` (`THREADS`: thread counts separated by commas, default `1,2`; `ROWS`:
//! batch rows, default 8; `G:N:K`: `G` matrices `[N, K]` instead of FLASH's `8:1024:4096`, cut
//! into at least 8 blocks, e.g. `1:3072:1024` for a Qwen3-0.6B `gate` at batch 16).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use half::bf16;
use simpler_kernels_cpu::membw::read_bandwidth;
use simpler_kernels_cpu::{
    GemmTile, OutMode, PackedActs, WeightsBf16, gemm_bf16, pack_acts_f32, packed_len,
    pair_weights_bf16,
};

/// `(groups, rows per group, K)`: FLASH `wo_a` unless the command line names another shape.
static SHAPE: std::sync::OnceLock<(usize, usize, usize)> = std::sync::OnceLock::new();

fn shape() -> (usize, usize, usize) {
    *SHAPE.get().unwrap_or(&(8, 1024, 4096))
}

/// One pass over `blocks` blocks of `rows_per` weight rows (block `b` is group `b % GROUPS`'s
/// rows from `b / GROUPS * rows_per`) on `threads` threads; returns the longest thread CPU
/// time and, when `keep`, every block's output.
fn pass(
    w: WeightsBf16<'_>,
    packed: &[Vec<f32>],
    batch: usize,
    (blocks, rows_per): (usize, usize),
    threads: usize,
    keep: bool,
) -> (f64, Vec<(usize, Vec<f32>)>) {
    let (groups, r_, k) = shape();
    let next = AtomicUsize::new(0);
    let next = &next;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    let t0 = common::thread_cpu_seconds();
                    let mut outs = Vec::new();
                    let mut res = vec![0.0f32; batch * rows_per];
                    loop {
                        let blk = next.fetch_add(1, Ordering::Relaxed);
                        if blk >= blocks {
                            break;
                        }
                        let g = blk % groups;
                        let r0 = g * r_ + blk / groups * rows_per;
                        let packed = &packed[g];
                        let wg = w.row_range(r0..r0 + rows_per);
                        let tile = GemmTile {
                            mode: OutMode::Store,
                            ..GemmTile::full(&wg)
                        };
                        gemm_bf16(
                            wg,
                            PackedActs::new(packed, batch, k),
                            &tile,
                            &mut res,
                            rows_per,
                        );
                        if keep {
                            outs.push((blk, res.clone()));
                        }
                    }
                    (common::thread_cpu_seconds() - t0, outs)
                })
            })
            .collect();
        let mut cpu = 0.0f64;
        let mut outs = Vec::new();
        for h in hs {
            let (t, o) = h.join().expect("no panic");
            cpu = cpu.max(t);
            outs.extend(o);
        }
        outs.sort_by_key(|o| o.0);
        (cpu, outs)
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = args.first().map_or(9, |a| a.parse().expect("rounds"));
    let threads: Vec<usize> = args.get(1).map_or(vec![1, 2], |t| {
        t.split(',').map(|v| v.parse().expect("threads")).collect()
    });
    let batch: usize = args.get(2).map_or(8, |a| a.parse().expect("rows"));
    if let Some(sh) = args.get(3) {
        let d: Vec<usize> = sh.split(':').map(|v| v.parse().expect("G:N:K")).collect();
        SHAPE.set((d[0], d[1], d[2])).expect("set once");
    }
    let (groups, r_, k) = shape();
    let w = common::huge_pool(groups * r_ * k);
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    for v in w.iter_mut() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *v = bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1);
    }
    // The attention output is rounded to bf16 before `wo_a`.
    let x: Vec<f32> = (0..batch * groups * k)
        .map(|i| bf16::from_f32(((i * 7919 % 1000) as f32 - 500.0) / 500.0).to_f32())
        .collect();
    // Each group's activations packed once (the op packs them per block; not timed here).
    let packed: Vec<Vec<f32>> = (0..groups)
        .map(|g| {
            let mut gx = vec![0.0f32; batch * k];
            for t in 0..batch {
                gx[t * k..(t + 1) * k].copy_from_slice(&x[t * groups * k + g * k..][..k]);
            }
            let mut p = vec![0.0f32; packed_len(batch, k)];
            pack_acts_f32(&gx, batch, k, &mut p);
            p
        })
        .collect();
    // At least 8 blocks (the graph's 4 per core), each inside one group.
    let whole = if groups >= 8 {
        (groups, r_)
    } else {
        (8 / groups * groups, r_ / (8 / groups))
    };
    let cached = (1usize, 24usize);
    let wp = common::huge_pool(groups * r_ * k);
    wp.copy_from_slice(&pair_weights_bf16(w, groups * r_, k));
    let layouts = [
        WeightsBf16::new(w, groups * r_, k),
        WeightsBf16::paired(wp, groups * r_, k),
    ];
    for case in [whole, cached] {
        let a = pass(layouts[0], &packed, batch, case, 2, true).1;
        let b = pass(layouts[1], &packed, batch, case, 2, true).1;
        for ((_, x), (_, y)) in a.iter().zip(&b) {
            for (x, y) in x.iter().zip(y) {
                assert!((x - y).abs() <= 1e-3 * (1.0 + x.abs()), "paired {y} vs {x}");
            }
        }
    }
    let bw_buf = vec![1u64; (256usize << 20) / 8];
    let flop = |c: (usize, usize)| (2 * batch * c.0 * c.1 * k) as f64;
    let bytes = |c: (usize, usize)| (c.0 * c.1 * k * 2) as f64;
    let mut cases: Vec<(String, (usize, usize), usize, usize)> = threads
        .iter()
        .map(|&t| (format!("{groups} x [{r_}, {k}], {t} thr"), whole, t, 1))
        .collect();
    cases.push(("24 rows in L2, 1 thr, x80".into(), cached, 1, 80));
    for (name, case, t, reps) in cases {
        let bw = (0..3)
            .map(|_| read_bandwidth(&bw_buf, t, Duration::from_millis(200)).0)
            .fold(0.0, f64::max);
        let (mut off, mut on, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let run = |paired: bool| {
            (0..reps)
                .map(|_| pass(layouts[usize::from(paired)], &packed, batch, case, t, false).0)
                .sum::<f64>()
                / reps as f64
        };
        for r in 0..rounds {
            let (a, b) = if r % 2 == 0 {
                let a = run(false);
                (a, run(true))
            } else {
                let b = run(true);
                (run(false), b)
            };
            off.push(a);
            on.push(b);
            ratios.push(b / a);
        }
        let (mo, mn) = (median(&mut off), median(&mut on));
        let mut sorted = ratios.clone();
        println!(
            "{name} (read {bw:.1} GB/s): off {:.0} us ({:.1} GFLOP/s, {:.1} GB/s), on {:.0} us \
             ({:.1} GFLOP/s, {:.1} GB/s); on/off median {:.3} [{:.3}-{:.3}]",
            mo * 1e6,
            flop(case) / mo / 1e9,
            bytes(case) / mo / 1e9,
            mn * 1e6,
            flop(case) / mn / 1e9,
            bytes(case) / mn / 1e9,
            median(&mut sorted),
            sorted[0],
            sorted[sorted.len() - 1],
        );
        println!(
            "  pairs on/off: {}",
            ratios
                .iter()
                .map(|r| format!("{r:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
}
