//! The CSA indexer's scores (`index_scores`) at the FLASH decode step's shape, one thread, on
//! the int8 path this machine takes: 2 tokens of a sequence × 64 index heads of 128 against
//! one 256-row chunk of index rows per call (one block of the graph's `csa_scores` task).
//! Each round times every chunk of 64 sequences' 2048-row caches (16 MiB, streamed) and then
//! as many calls on one chunk (warm), and prints both per call with a checksum.
//!
//! `cargo run --release -p simpler-kernels-cpu --example dsv4_csa_scores -- [ROUNDS]`

use std::time::Instant;

use simpler_kernels_cpu::I8Path;
use simpler_kernels_cpu::dsv4::csa::{IndexQueries, index_scores};

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(5, |r| r.parse().expect("ROUNDS"));
    let (tokens, heads, dim, rows, chunk, seqs) = (2usize, 64usize, 128usize, 2048, 256, 64);
    let nq = tokens * heads;
    let mut x = 1u64;
    let mut byte = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 56) as i8).max(-127)
    };
    let q: Vec<i8> = (0..nq * dim).map(|_| byte()).collect();
    let keys: Vec<i8> = (0..seqs * rows * dim).map(|_| byte()).collect();
    let key_scale = vec![0.01f32; seqs * rows];
    let (scale, weight) = (vec![0.02f32; nq], vec![0.3f32; nq]);
    let qs = IndexQueries {
        q: &q,
        scale: &scale,
        weight: &weight,
        tokens,
        heads,
        head_dim: dim,
    };
    let mut out = vec![0f32; tokens * chunk];
    println!(
        "dsv4 csa scores: {tokens} tokens x {heads} heads x {dim} against {chunk} rows per call, \
         int8 path {}",
        I8Path::current().name()
    );
    for round in 0..rounds {
        let t = Instant::now();
        let mut calls = 0;
        let mut sum = 0.0f64;
        for r0 in (0..seqs * rows).step_by(chunk) {
            index_scores(qs, &keys, &key_scale, r0..r0 + chunk, &mut out, chunk);
            sum += f64::from(out[7]);
            calls += 1;
        }
        let streamed = t.elapsed().as_secs_f64() * 1e6 / calls as f64;
        let t = Instant::now();
        for _ in 0..calls {
            index_scores(qs, &keys, &key_scale, 0..chunk, &mut out, chunk);
        }
        let warm = t.elapsed().as_secs_f64() * 1e6 / calls as f64;
        println!(
            "  round {round}: {streamed:.2} us/call streamed, {warm:.2} us/call warm \
             (checksum {sum:.3})"
        );
    }
}
