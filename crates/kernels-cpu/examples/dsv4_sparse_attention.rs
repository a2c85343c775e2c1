//! The DeepSeek-V4 sparse attention core at the FLASH decode step's shape, one thread, on each
//! path this machine has: 8 tokens, 64 heads of 512, each token over its 128 window rows
//! (adjacent slots of a window cache) and 512 scattered rows of an 8192-row compressed cache
//! (CSA's top-512 at start 8192). Reports per path the best and median round in thread CPU
//! time (what the kernel itself costs, not the waits of a loaded host) and in wall time, and
//! the rate of the kernel's float work (`4 · heads · hd · candidates` per token), for two
//! forms of the same lists in interleaved rounds (A B B A): the window as single rows (each
//! copied) and as one run of adjacent rows (read in place), with the per-round ratio.
//!
//! `cargo run --release -p simpler-kernels-cpu --example dsv4_sparse_attention -- [ROUNDS
//! COMPRESSED [PATH]]` (default 15 512, every path; COMPRESSED 64 is HCA's step, 0 SWA's).

use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::Isa;
use simpler_kernels_cpu::dsv4::{AttnScratch, Queries, sparse_attention};
use simpler_kernels_cpu::with_isa;

/// This thread's CPU time, seconds.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; the clock id is a constant Linux supports.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let only = raw
        .get(2)
        .map(|n| Isa::from_name(n).expect("a path name, e.g. amx-bf16"));
    let args: Vec<usize> = raw
        .iter()
        .take(2)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let rounds = args.first().copied().unwrap_or(15).max(1);
    let comp = args.get(1).copied().unwrap_or(512);
    let (tokens, heads, hd, window, cache_rows) = (8usize, 64usize, 512usize, 128usize, 8192usize);
    let mut seed = 11u64;
    let mut rnd = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    let wcache: Vec<bf16> = (0..4 * window * hd)
        .map(|_| bf16::from_f32(rnd()))
        .collect();
    let ccache: Vec<bf16> = (0..cache_rows * hd)
        .map(|_| bf16::from_f32(rnd()))
        .collect();
    // bf16 queries, as the layers' graphs pass them.
    let q: Vec<bf16> = (0..tokens * heads * hd)
        .map(|_| bf16::from_f32(rnd()))
        .collect();
    let sinks: Vec<f32> = (0..heads).map(|_| rnd()).collect();
    // Each token's window as one run of adjacent rows (read in place) and the same rows one
    // slice each (every row copied): the two forms compared in the same rounds.
    let window_runs: Vec<Vec<Option<&[bf16]>>> = (0..tokens)
        .map(|t| {
            let seq = t / 2;
            let r0 = seq * window;
            let mut l = vec![Some(&wcache[r0 * hd..(r0 + window) * hd])];
            // Scattered rows of the sequence's quarter of the compressed cache.
            let per_seq = cache_rows / 4;
            l.extend((0..comp).map(|i| {
                let r = seq * per_seq + (i * 1237 + t * 31) % per_seq;
                Some(&ccache[r * hd..(r + 1) * hd])
            }));
            l
        })
        .collect();
    let single_rows: Vec<Vec<Option<&[bf16]>>> = window_runs
        .iter()
        .map(|l| {
            l.iter()
                .flatten()
                .flat_map(|r| r.chunks_exact(hd).map(Some))
                .collect()
        })
        .collect();
    let flops = 4.0 * (heads * hd * (window + comp) * tokens) as f64;
    println!(
        "dsv4 sparse attention: {tokens} tokens x {heads} heads x {hd}, {window} window + {comp} compressed candidates, one thread"
    );
    println!("  per round: the window as single rows (copied) and as one run (in place), A B B A");
    let mut out = vec![0.0f32; heads * hd];
    let mut s = AttnScratch::default();
    for isa in Isa::ALL
        .into_iter()
        .filter(|i| only.is_none_or(|o| o == *i))
    {
        let Some(times) = with_isa(isa, || {
            // [form][clock] per round: form 0 single rows, 1 runs; clock 0 cpu, 1 wall (ms).
            let mut times = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
            let mut step = |lists: &[Vec<Option<&[bf16]>>]| {
                let (c0, w0) = (thread_cpu_s(), Instant::now());
                for (t, list) in lists.iter().enumerate() {
                    let qt = &q[t * heads * hd..(t + 1) * heads * hd];
                    sparse_attention(Queries::Bf16(qt), hd, list, 0.044, &sinks, &mut out, &mut s);
                }
                (
                    (thread_cpu_s() - c0) * 1e3,
                    w0.elapsed().as_secs_f64() * 1e3,
                )
            };
            step(&single_rows);
            step(&window_runs);
            for _ in 0..rounds {
                for form in [0, 1, 1, 0] {
                    let (cpu, wall) = step(if form == 0 {
                        &single_rows
                    } else {
                        &window_runs
                    });
                    times[form][0].push(cpu);
                    times[form][1].push(wall);
                }
            }
            times
        }) else {
            continue;
        };
        let ratios: Vec<f64> = {
            let mut r: Vec<f64> = times[1][0]
                .chunks_exact(2)
                .zip(times[0][0].chunks_exact(2))
                .map(|(b, a)| (b[0] + b[1]) / (a[0] + a[1]))
                .collect();
            r.sort_by(f64::total_cmp);
            r
        };
        for (form, name) in ["single rows", "runs"].into_iter().enumerate() {
            let mut cpu = times[form][0].clone();
            let mut wall = times[form][1].clone();
            cpu.sort_by(f64::total_cmp);
            wall.sort_by(f64::total_cmp);
            println!(
                "  {:<12} {name:<11} cpu ms/step best {:7.3} median {:7.3}  wall best {:7.3} median {:7.3}  {:6.1} GFLOP/s (best cpu)",
                isa.name(),
                cpu[0],
                cpu[cpu.len() / 2],
                wall[0],
                wall[wall.len() / 2],
                flops / cpu[0] / 1e6
            );
        }
        println!(
            "  {:<12} runs / single rows (cpu, per A B B A round): min {:.3} median {:.3} max {:.3}",
            isa.name(),
            ratios[0],
            ratios[ratios.len() / 2],
            ratios[ratios.len() - 1]
        );
    }
}
