//! The DeepSeek-V4 hyper-connection pre-mix (`hc_pre`) at the FLASH decode step's shape, one
//! thread: 8 tokens of 4 streams × 4096, 24 mix weight rows. Times each part as the task graph
//! runs it (the mix products of every token, then per token its 1/rms, weights, mixed stream
//! and attention norm), best and median round of wall time.
//!
//! `cargo run --release -p simpler-kernels-cpu --example dsv4_hc -- [ROUNDS [cold]]` (default 50;
//! `cold`: each round starts after the benchmarks' cache flush, a read of at least twice the
//! last-level cache, as a benchmarked step does, so the weights and the residual come from
//! memory). The inputs are on huge pages, as the runtime's are: from 4 KiB pages the cold mix
//! took 1.1–1.17× the time.

use std::time::Instant;

mod common;

use simpler_kernels_cpu::dsv4::{
    hc_inv_rms_rows, hc_mix_dots, hc_mix_len, hc_mix_streams, hc_weights, rms_norm_round,
};
use simpler_kernels_cpu::membw::CacheFlush;

/// Mix weight rows per `HC_MIX` task at FLASH on 2 cores.
const ROWS_PER_TASK: usize = 6;

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("ROUNDS: a number"))
        .unwrap_or(50)
        .max(1);
    let flush = match std::env::args().nth(2).as_deref() {
        None => None,
        Some("cold") => Some(CacheFlush::new(1)),
        Some(other) => panic!("{other:?}: the second argument is `cold` or nothing"),
    };
    let (tokens, hc, d) = (8usize, 4usize, 4096usize);
    let (n, m) = (hc * d, hc_mix_len(hc));
    // Deterministic values in (-0.5, 0.5) that do not repeat over the rows.
    let val = |i: usize| (i as f32 * 0.618_034).sin() * 0.5;
    // Huge pages, as the runtime holds its weights and buffers (`common::huge_f32`).
    let x = common::huge_f32(tokens * n);
    x.iter_mut().enumerate().for_each(|(i, v)| *v = val(i));
    let x: &[f32] = x;
    let w = common::huge_f32(m * n);
    w.iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = val(i + 7) * 0.01);
    let w: &[f32] = w;
    let base: Vec<f32> = (0..m).map(|i| val(i + 11)).collect();
    let norm: Vec<f32> = (0..d).map(|i| 1.0 + val(i + 13) * 0.1).collect();
    let mut dots = vec![0.0f32; tokens * m];
    let mut part = vec![0.0f32; tokens * ROWS_PER_TASK];
    let mut mixed = vec![0.0f32; tokens * d];
    let mut inv = vec![0.0f32; tokens];
    let (mut t_dots, mut t_rest) = (Vec::new(), Vec::new());
    let mut sink = 0.0f32;
    for round in 0..=rounds {
        if let Some(f) = &flush {
            f.run();
        }
        let t0 = Instant::now();
        // The graph's split: four tasks of six weight rows, each over every token.
        for j0 in (0..m).step_by(ROWS_PER_TASK) {
            let j1 = (j0 + ROWS_PER_TASK).min(m);
            hc_mix_dots(
                x,
                n,
                &w[j0 * n..j1 * n],
                &mut part[..tokens * (j1 - j0)],
                j1 - j0,
            );
            for (t, o) in part[..tokens * (j1 - j0)].chunks_exact(j1 - j0).enumerate() {
                dots[t * m + j0..t * m + j1].copy_from_slice(o);
            }
        }
        let t1 = Instant::now();
        // One HC_PRE task's work over all the tokens (the graph gives each core a share).
        hc_inv_rms_rows(x, n, 1e-6, &mut inv);
        for (t, lg) in dots.chunks_exact_mut(m).enumerate() {
            let xr = &x[t * n..(t + 1) * n];
            lg.iter_mut().for_each(|v| *v *= inv[t]);
            hc_weights(lg, hc, [0.5, 0.5, 0.5], &base, 20, 1e-6);
            hc_mix_streams(xr, &lg[..hc], &mut mixed[t * d..(t + 1) * d]);
        }
        rms_norm_round(&mut mixed, d, Some(&norm), 1e-6);
        let t2 = Instant::now();
        sink += mixed[0];
        if round > 0 {
            t_dots.push((t1 - t0).as_secs_f64() * 1e6);
            t_rest.push((t2 - t1).as_secs_f64() * 1e6);
        }
    }
    for v in [&mut t_dots, &mut t_rest] {
        v.sort_by(f64::total_cmp);
    }
    println!(
        "dsv4 hc_pre: {tokens} tokens x {hc} x {d}, {m} mix rows, one thread, {} (checksum {sink})",
        flush
            .as_ref()
            .map_or("warm".to_string(), |f| format!("after {}", f.describe()))
    );
    println!(
        "  mix dots        best {:8.1} us  median {:8.1} us",
        t_dots[0],
        t_dots[t_dots.len() / 2]
    );
    println!(
        "  per-token rest  best {:8.1} us  median {:8.1} us",
        t_rest[0],
        t_rest[t_rest.len() / 2]
    );
}
