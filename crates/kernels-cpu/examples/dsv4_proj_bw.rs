//! The DeepSeek-V4 FLASH int8 projections as their task graphs split them, kernel only: the
//! weights of each case are cut into the graph's SPMD blocks, `threads` threads take blocks
//! from a shared counter (as the runtime's workers do), and each round streams every case's
//! weights once per int8 path in rotating order. Reports per case, path and thread count the
//! best and median time and the weight bandwidth, against the machine's streaming read
//! bandwidth measured with the same thread count. Every case runs on row-major weights and on
//! the same weights packed ([`I8Layout::Packed`]), the layouts alternated within each round
//! (the AVX2 path on row-major weights only: it hands packed ones to the portable code).
//! Both layouts are checked to give the same output bits before timing.
//!
//! Cases (FLASH shapes, batch 4 × 2 tokens):
//! - `q_b`: `Wq_b [32768, 1024]`, 8 token rows, 8 blocks of whole heads;
//! - `wo_b`: `Wo_b [4096, 8192]` in 8 `k` groups (each with its own activation scales),
//!   8 token rows, 8 column blocks;
//! - `wo_b_grouped`: the same in one call over the 8 groups (`ActsI8::grouped`);
//! - `moe_w13`: 17 experts' `W1` and `W3 [2048, 4096]`, 3 rows per expert (8 tokens × 6 of
//!   16 routed, plus the shared expert's 8), 32 column blocks;
//! - `moe_w2`: 17 experts' `W2 [4096, 2048]`, as above.
//!
//! - `moe_w13_b1`, `moe_w2_b1`: the expert products at 1 row per expert (a decode batch of 1).
//!
//! Every case also runs "chained": each call names the next matrix's rows of the same block
//! ([`NextRows`], as the MoE graph's expert loop does), alternated with the plain calls.
//!
//! `cargo run --release -p simpler-kernels-cpu --example dsv4_proj_bw -- [ROUNDS [CASES
//! [THREADS]]]` (`CASES`: names separated by commas, or `N:K:BATCH:MATRICES:BLOCKS` for a
//! case of those dimensions; `THREADS`: thread counts separated by commas, default `1,2`).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use simpler_kernels_cpu::membw::read_bandwidth;
use simpler_kernels_cpu::{
    ActsI8, GemmTile, I8Layout, I8Path, NextRows, OutMode, WeightsI8, gemm_i8_w8a8_then,
    pack_weights_i8, pack_weights_i8_as, quantize_acts_i8, with_i8_path,
};

/// One weight matrix of a case and the activation rows that multiply it.
struct Mat {
    w: &'static [i8],
    /// The same weights packed.
    packed: &'static [i8],
    /// The same weights interleaved.
    interleaved: &'static [i8],
    sw: Vec<f32>,
    n: usize,
    k: usize,
    batch: usize,
}

struct Case {
    name: &'static str,
    mats: Vec<Mat>,
    /// Column blocks per matrix (SPMD blocks; every block covers the same rows of each matrix).
    blocks: usize,
    /// `k` groups with separate activation scales.
    groups: usize,
    /// One call over every group ([`ActsI8::grouped`]) instead of one call per group.
    grouped: bool,
}

fn huge_i8(len: usize, seed: u64) -> &'static mut [i8] {
    const HUGE: usize = 2 << 20;
    let map = memmap2::MmapOptions::new()
        .len(len + HUGE)
        .map_anon()
        .expect("anonymous mapping");
    let off = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
    let _ = map.advise_range(memmap2::Advice::HugePage, off, len);
    let map = Box::leak(Box::new(map));
    // SAFETY: the mapping holds `off + len` bytes and lives for the program (leaked).
    let s = unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().add(off).cast::<i8>(), len) };
    let mut x = seed;
    for v in s.iter_mut() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *v = ((x >> 56) as i8).max(-127);
    }
    s
}

fn mat(n: usize, k: usize, batch: usize, seed: u64) -> Mat {
    let w = huge_i8(n * k, seed);
    let packed = huge_i8(n * k, seed);
    pack_weights_i8(w, n, k, k, packed);
    let interleaved = huge_i8(n * k, seed);
    pack_weights_i8_as(I8Layout::Interleaved, w, n, k, k, interleaved);
    Mat {
        w,
        packed,
        interleaved,
        sw: vec![0.01; n],
        n,
        k,
        batch,
    }
}

/// Matrix `m`'s weights in `layout`.
fn whole(m: &Mat, layout: I8Layout) -> WeightsI8<'_> {
    match layout {
        I8Layout::RowMajor => WeightsI8::new(m.w, &m.sw, m.n, m.k, m.k),
        I8Layout::Packed => WeightsI8::packed(m.packed, &m.sw, m.n, m.k),
        I8Layout::Interleaved => WeightsI8::interleaved(m.interleaved, &m.sw, m.n, m.k),
    }
}

/// Builds a case (its weights only when it runs).
type MakeCase<'a> = Box<dyn Fn() -> Case + 'a>;

/// Block `blk`'s output of matrix `mat`.
type BlockOut = (usize, usize, Vec<f32>);

/// Runs case `c` on `threads` threads with the weights in `layout` (each call naming the
/// next matrix's rows when `chained`); returns the longest thread CPU time and, when `keep`,
/// every block's output (sorted).
fn run_case(
    c: &Case,
    threads: usize,
    (layout, chained): (I8Layout, bool),
    acts: &[(Vec<i8>, Vec<f32>)],
    keep: bool,
) -> (f64, Vec<BlockOut>) {
    let next = AtomicUsize::new(0);
    let total = c.blocks;
    let next = &next;
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for _ in 0..threads {
            let path = I8Path::current();
            handles.push(s.spawn(move || {
                with_i8_path(path, || {
                    let t0 = common::thread_cpu_seconds();
                    let mut out = Vec::new();
                    let mut outs = Vec::new();
                    loop {
                        let blk = next.fetch_add(1, Ordering::Relaxed);
                        if blk >= total {
                            break;
                        }
                        for (mi, (m, (xq, xs))) in c.mats.iter().zip(acts).enumerate() {
                            let r = blk * m.n / total..(blk + 1) * m.n / total;
                            let w = whole(m, layout).rows_range(r.clone());
                            let next = c
                                .mats
                                .get(mi + 1)
                                .filter(|_| chained)
                                .map(|m| NextRows::new(whole(m, layout), blk * m.n / total));
                            out.clear();
                            out.resize(m.batch * r.len(), 0.0f32);
                            let span = m.k / c.groups;
                            if c.grouped {
                                let tile = GemmTile {
                                    n: 0..r.len(),
                                    k: 0..m.k,
                                    mode: OutMode::Add,
                                };
                                let x = ActsI8::grouped(xq, xs, m.batch, m.k, m.k, c.groups);
                                gemm_i8_w8a8_then(w, x, &tile, &mut out, r.len(), next);
                            } else {
                                for g in 0..c.groups {
                                    let tile = GemmTile {
                                        n: 0..r.len(),
                                        k: g * span..(g + 1) * span,
                                        mode: OutMode::Add,
                                    };
                                    let x = ActsI8::new(xq, &xs[..m.batch], m.batch, m.k, m.k);
                                    let next = next.filter(|_| g + 1 == c.groups);
                                    gemm_i8_w8a8_then(w, x, &tile, &mut out, r.len(), next);
                                }
                            }
                            if keep {
                                outs.push((blk, mi, out.clone()));
                            }
                        }
                    }
                    (common::thread_cpu_seconds() - t0, outs)
                })
                .expect("a supported path")
            }));
        }
        let mut cpu = 0.0f64;
        let mut outs = Vec::new();
        for h in handles {
            let (t, o) = h.join().expect("no panic");
            cpu = cpu.max(t);
            outs.extend(o);
        }
        outs.sort_by_key(|o| (o.0, o.1));
        (cpu, outs)
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = args.first().map_or(7, |a| a.parse().expect("rounds"));
    let only = args.get(1).cloned();
    let case =
        |name: &'static str, mats: Vec<Mat>, blocks: usize, groups: usize, grouped: bool| Case {
            name,
            mats,
            blocks,
            groups,
            grouped,
        };
    // Built only when named (or all without a list): each holds its weights twice.
    let all: Vec<(&str, MakeCase<'_>)> = vec![
        (
            "q_b",
            Box::new(|| case("q_b", vec![mat(32768, 1024, 8, 1)], 8, 1, false)),
        ),
        (
            "wo_b",
            Box::new(|| case("wo_b", vec![mat(4096, 8192, 8, 2)], 8, 8, false)),
        ),
        (
            "wo_b_grouped",
            Box::new(|| case("wo_b_grouped", vec![mat(4096, 8192, 8, 2)], 8, 8, true)),
        ),
        (
            "moe_w13",
            Box::new(|| {
                let mats = (0..34).map(|e| mat(2048, 4096, 3, 10 + e)).collect();
                case("moe_w13", mats, 32, 1, false)
            }),
        ),
        (
            "moe_w2",
            Box::new(|| {
                let mats = (0..17).map(|e| mat(4096, 2048, 3, 100 + e)).collect();
                case("moe_w2", mats, 32, 1, false)
            }),
        ),
        (
            "moe_w13_b1",
            Box::new(|| {
                let mats = (0..34).map(|e| mat(2048, 4096, 1, 10 + e)).collect();
                case("moe_w13_b1", mats, 32, 1, false)
            }),
        ),
        (
            "moe_w2_b1",
            Box::new(|| {
                let mats = (0..17).map(|e| mat(4096, 2048, 1, 100 + e)).collect();
                case("moe_w2_b1", mats, 32, 1, false)
            }),
        ),
    ];
    let mut cases: Vec<Case> = all
        .iter()
        .filter(|(n, _)| only.as_ref().is_none_or(|o| o.split(',').any(|x| x == *n)))
        .map(|(_, f)| f())
        .collect();
    if let Some(o) = &only {
        // `N:K:BATCH:MATS:BLOCKS`: a case of these dimensions.
        let d: Vec<usize> = o.split(':').filter_map(|v| v.parse().ok()).collect();
        if let [n, k, batch, mats, blocks] = d[..] {
            let mats = (0..mats)
                .map(|e| mat(n, k, batch, 200 + e as u64))
                .collect();
            cases.push(case("custom", mats, blocks, 1, false));
        }
    }
    let threads: Vec<usize> = args.get(2).map_or(vec![1, 2], |t| {
        t.split(',').map(|v| v.parse().expect("threads")).collect()
    });
    let paths: Vec<I8Path> = [I8Path::Avx2, I8Path::Avx512Vnni, I8Path::Amx]
        .into_iter()
        .filter(|p| p.is_supported())
        .collect();
    let acts: Vec<Vec<(Vec<i8>, Vec<f32>)>> = cases
        .iter()
        .map(|c| {
            c.mats
                .iter()
                .map(|m| {
                    let x: Vec<f32> = (0..m.batch * m.k)
                        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
                        .collect();
                    let mut q = vec![0i8; m.batch * m.k];
                    let mut s = vec![0.0f32; m.batch];
                    quantize_acts_i8(&x, m.batch, m.k, m.k, None, &mut q, m.k, &mut s);
                    let s = s.iter().flat_map(|&v| vec![v; c.groups]).collect();
                    (q, s)
                })
                .collect()
        })
        .collect();
    let layouts = [
        (I8Layout::RowMajor, false),
        (I8Layout::Packed, false),
        (I8Layout::RowMajor, true),
        (I8Layout::Packed, true),
        (I8Layout::Interleaved, false),
        (I8Layout::Interleaved, true),
    ];
    let variants: Vec<(I8Path, usize, (I8Layout, bool))> = paths
        .iter()
        .flat_map(|&p| {
            threads.iter().flat_map(move |&t| {
                layouts
                    .into_iter()
                    .filter(move |l| p != I8Path::Avx2 || l.0 == I8Layout::RowMajor)
                    .map(move |l| (p, t, l))
            })
        })
        .collect();
    // Both layouts give the same bits on every path.
    for (ci, c) in cases.iter().enumerate() {
        for &p in &paths {
            let run = |l| with_i8_path(p, || run_case(c, 2, l, &acts[ci], true).1);
            let rm = run(layouts[0]);
            // The AVX2 path takes row-major weights only (packed ones run the portable code).
            for l in layouts[1..]
                .iter()
                .filter(|l| p != I8Path::Avx2 || l.0 == I8Layout::RowMajor)
            {
                assert!(rm == run(*l), "{}: {} differs in {l:?}", c.name, p.name());
            }
        }
    }
    let max_t = threads.iter().copied().max().unwrap_or(1);
    let bw_buf = vec![1u64; (256usize << 20) / 8];
    let mut bw = vec![0.0f64; max_t];
    let mut secs = vec![vec![Vec::new(); variants.len()]; cases.len()];
    let mut cpu_secs = secs.clone();
    for round in 0..rounds {
        for &t in &threads {
            let b = &mut bw[t - 1];
            *b = b.max(read_bandwidth(&bw_buf, t, Duration::from_millis(200)).0);
        }
        for (ci, c) in cases.iter().enumerate() {
            for j in 0..variants.len() {
                let i = (round + j) % variants.len();
                let (p, t, l) = variants[i];
                let t0 = Instant::now();
                let cpu =
                    with_i8_path(p, || run_case(c, t, l, &acts[ci], false).0).expect("supported");
                secs[ci][i].push(t0.elapsed().as_secs_f64());
                cpu_secs[ci][i].push(cpu);
            }
        }
    }
    for &t in &threads {
        println!(
            "streaming read (best of the rounds), {t} threads: {:.1} GB/s",
            bw[t - 1]
        );
    }
    for (ci, c) in cases.iter().enumerate() {
        let bytes: usize = c.mats.iter().map(|m| m.n * m.k).sum();
        println!("{} ({} MiB of weights):", c.name, bytes >> 20);
        for (i, (p, t, l)) in variants.iter().enumerate() {
            let s = &mut secs[ci][i];
            s.sort_by(f64::total_cmp);
            let (best, med) = (s[0], s[s.len() / 2]);
            let gbs = bytes as f64 / best / 1e9;
            let cs = &mut cpu_secs[ci][i];
            cs.sort_by(f64::total_cmp);
            println!(
                "  {:<12} {:<17} {t} thr: best {:>8.0} us  med {:>8.0} us  {gbs:>5.1} GB/s = {:>3.0}% of membw; \
                 thread CPU best {:>8.0} us med {:>8.0} us ({:.1} GB/s)",
                p.name(),
                match l {
                    (I8Layout::Packed, false) => "packed",
                    (I8Layout::RowMajor, false) => "row-major",
                    (I8Layout::Packed, true) => "packed chained",
                    (I8Layout::RowMajor, true) => "row-major chained",
                    (I8Layout::Interleaved, false) => "interleaved",
                    (I8Layout::Interleaved, true) => "interleaved chained",
                },
                best * 1e6,
                med * 1e6,
                100.0 * gbs / bw[t - 1],
                cs[0] * 1e6,
                cs[cs.len() / 2] * 1e6,
                bytes as f64 / cs[0] / 1e9,
            );
        }
    }
}
