//! Where the AVX-512 BF16 paired kernel's multi-run passes prefetch the next pass's weights,
//! L2 against L1 (`gemm::set_paired_l1_prefetch`), on a plain stream: 512-row tiles of one
//! paired `[N, 1024]` bf16 matrix (128 MiB by default, far past the caches) split between the
//! threads, each tile one `gemm_bf16` call at batch `B`. The two settings alternate pass by pass
//! (A B B A) in one process; per setting the median and best GFLOP/s, and the median of the
//! passes' time ratios L1 / L2.
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemm_pairs_prefetch [-- --batches
//! 12,16,24,32 --threads 2 --rows 65536 --passes 12]`

mod common;

use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::gemm::set_paired_l1_prefetch;
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PackedActs, WeightLayout, WeightsBf16, gemm_bf16, pack_acts_bf16,
    packed_len, pair_weights_bf16, path_for,
};

const K: usize = 1024;
const TILE_ROWS: usize = 512;

fn main() {
    let get = |name: &str, d: usize| common::arg(name).map_or(d, |s| s.parse().expect("integer"));
    let batches = common::batches("12,16,24,32");
    let threads = get("--threads", 2).max(1);
    let n = get("--rows", 65536).div_ceil(TILE_ROWS * threads) * TILE_ROWS * threads;
    let passes = get("--passes", 12).max(2);
    let w: Vec<bf16> = (0..n * K)
        .map(|i| bf16::from_f32(((i * 7919 % 1000) as f32) / 1000.0 - 0.5))
        .collect();
    let wp = pair_weights_bf16(&w, n, K);
    drop(w);
    let wv = WeightsBf16::paired(&wp, n, K);
    println!(
        "paired [{n}, {K}] bf16 ({} MiB), {TILE_ROWS}-row tiles, {threads} threads",
        (n * K * 2) >> 20
    );
    for batch in batches {
        let x: Vec<bf16> = (0..batch * K)
            .map(|i| bf16::from_f32(((i * 31 % 100) as f32) / 100.0))
            .collect();
        let mut packed = vec![0.0f32; packed_len(batch, K)];
        pack_acts_bf16(&x, batch, K, &mut packed);
        let acts = PackedActs::new(&packed, batch, K);
        // [L2, L1] pass times; the first pass of each is discarded (faults, clocks).
        let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for p in 0..passes {
            let order = if p % 2 == 0 { [0, 1] } else { [1, 0] };
            for side in order {
                set_paired_l1_prefetch(side == 1);
                let t = Instant::now();
                std::thread::scope(|s| {
                    for th in 0..threads {
                        s.spawn(move || {
                            let (r0, r1) = (n * th / threads, n * (th + 1) / threads);
                            let mut out = vec![0.0f32; batch * TILE_ROWS];
                            for a in (r0..r1).step_by(TILE_ROWS) {
                                let tile = GemmTile {
                                    n: a..a + TILE_ROWS,
                                    k: 0..K,
                                    mode: OutMode::Store,
                                };
                                gemm_bf16(wv, acts, &tile, &mut out, TILE_ROWS);
                            }
                            std::hint::black_box(&out);
                        });
                    }
                });
                if p > 0 {
                    times[side].push(t.elapsed().as_secs_f64());
                }
            }
        }
        set_paired_l1_prefetch(true);
        let flops = 2.0 * (batch * n * K) as f64;
        let mut ratios: Vec<f64> = times[1].iter().zip(&times[0]).map(|(a, b)| a / b).collect();
        ratios.sort_by(f64::total_cmp);
        let stat = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            (flops / v[v.len() / 2] / 1e9, flops / v[0] / 1e9)
        };
        let ((l2m, l2b), (l1m, l1b)) = (stat(&times[0]), stat(&times[1]));
        println!(
            "batch {batch:>3} ({}): L2 median {l2m:.1} best {l2b:.1} GFLOP/s; L1 median {l1m:.1} best {l1b:.1}; time L1/L2 median {:.3} (range {:.3}..{:.3})",
            path_for(Isa::current(), batch, WeightLayout::Pairs).name(),
            ratios[ratios.len() / 2],
            ratios[0],
            ratios[ratios.len() - 1]
        );
    }
}
