//! Split-KV decode attention throughput on one thread: KV bytes streamed per second for a
//! Qwen3 head shape over a paged pool larger than the last-level cache.
//!
//! `cargo run --release -p simpler-kernels-cpu --example attn_bw [-- --seq 256 --group 2 --heads 8 --seqs 64 --passes 1 --all-heads]`

mod common;

use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::{
    PagedKv, decode_attention_heads_bf16, decode_attention_partial_bf16, partial_len,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |name: &str, d: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map_or(d, |s| s.parse().expect("integer"))
    };
    let (seq, group, kv_heads, seqs) = (
        get("--seq", 256),
        get("--group", 2),
        get("--heads", 8),
        get("--seqs", 64),
    );
    let passes = get("--passes", 1);
    let hd = 128;
    let page = 128;
    let blocks = seq.div_ceil(page);
    let row = kv_heads * hd;
    let slots = seqs * blocks * page;
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        bf16::from_f32((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
    };
    // Pools in 2 MiB-aligned anonymous mappings advised to use huge pages, as the runtime
    // allocates them.
    let kmap = common::huge_pool(slots * row);
    let vmap = common::huge_pool(slots * row);
    for x in kmap.iter_mut().chain(vmap.iter_mut()) {
        *x = rnd();
    }
    let (k, v) = (&kmap[..], &vmap[..]);
    let q: Vec<bf16> = (0..kv_heads * group * hd).map(|_| rnd()).collect();
    let kv = PagedKv {
        k,
        v,
        kv_heads,
        head_dim: hd,
        page_size: page,
    };
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|b| (0..blocks).map(|j| (b * blocks + j) as u32).collect())
        .collect();
    let all_heads = args.iter().any(|a| a == "--all-heads");
    if args.iter().any(|a| a == "--stream") {
        for _ in 0..3 {
            let t = Instant::now();
            let mut acc = 0u64;
            for (a, b) in k.chunks(4096).zip(v.chunks(4096)) {
                acc = acc.wrapping_add(
                    a.iter()
                        .chain(b)
                        .map(|x| u64::from(x.to_bits()))
                        .sum::<u64>(),
                );
            }
            let dt = t.elapsed().as_secs_f64();
            println!(
                "plain read of K and V: {:.2} GB/s ({acc})",
                (k.len() + v.len()) as f64 * 2.0 / dt / 1e9
            );
        }
    }
    let threads = get("--threads", 1).max(1);
    for rep in 0..3 {
        let t = Instant::now();
        std::thread::scope(|sc| {
            for th in 0..threads {
                let (tables, kv, q) = (&tables, &kv, &q);
                sc.spawn(move || {
                    let mut partial = vec![0.0f32; partial_len(group, hd)];
                    let mut partials = vec![0.0f32; kv_heads * partial_len(group, hd)];
                    for table in tables
                        .iter()
                        .skip(th)
                        .step_by(threads)
                        .cycle()
                        .take(seqs * passes / threads)
                    {
                        if all_heads {
                            decode_attention_heads_bf16(
                                q,
                                group,
                                kv,
                                table,
                                0..seq,
                                0.088,
                                &mut partials,
                            );
                        } else {
                            for g in 0..kv_heads {
                                decode_attention_partial_bf16(
                                    q,
                                    group,
                                    kv,
                                    table,
                                    g,
                                    0..seq,
                                    0.088,
                                    &mut partial,
                                );
                            }
                        }
                    }
                });
            }
        });
        let dt = t.elapsed().as_secs_f64();
        let bytes = (passes * seqs * kv_heads * seq * hd * 2 * 2) as f64;
        println!(
            "rep {rep}: {:.1} us per (sequence, kv head) call, {:.2} GB/s of KV",
            dt / (passes * seqs * kv_heads) as f64 * 1e6,
            bytes / dt / 1e9
        );
    }
}
