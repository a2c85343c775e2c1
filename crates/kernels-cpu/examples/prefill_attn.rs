//! Causal prefill attention (`prefill_attention_rows_f32`) on one thread at a Qwen3 shape:
//! a prompt's rows in tasks of `--rows` query rows per KV head, as the model's prefill runs
//! them, timed by thread CPU time with the named paths interleaved call set by call set.
//!
//! `cargo run --release -p simpler-kernels-cpu --example prefill_attn [-- --len 512 --rows 32
//! --heads 8 --group 2 --reps 9 --paths avx2,portable]`

mod common;

use half::bf16;
use simpler_kernels_cpu::isa::{Isa, with_isa};
use simpler_kernels_cpu::{PagedKv, PrefillRows, prefill_attention_rows_f32};

fn main() {
    let get = |name: &str, d: usize| common::arg(name).map_or(d, |s| s.parse().expect("integer"));
    let (len, rows, kv_heads, group, reps) = (
        get("--len", 512),
        get("--rows", 32),
        get("--heads", 8),
        get("--group", 2),
        get("--reps", 9),
    );
    let paths: Vec<Isa> = common::arg("--paths")
        .unwrap_or_else(|| "avx2,portable".into())
        .split(',')
        .map(|n| Isa::from_name(n).unwrap_or_else(|| panic!("unknown path {n:?}")))
        .collect();
    let (hd, page) = (128, 128);
    let row = kv_heads * hd;
    let blocks = len.div_ceil(page);
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let k: Vec<bf16> = (0..blocks * page * row)
        .map(|_| bf16::from_f32(rnd()))
        .collect();
    let v: Vec<bf16> = (0..blocks * page * row)
        .map(|_| bf16::from_f32(rnd()))
        .collect();
    // Pages in reverse order, so logical blocks are not contiguous.
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let kv = PagedKv {
        k: &k,
        v: &v,
        kv_heads,
        head_dim: hd,
        page_size: page,
    };
    let q: Vec<f32> = (0..len * group * hd).map(|_| 2.0 * rnd()).collect();
    let mut out = vec![0.0f32; len * group * hd];
    let scale = 1.0 / (hd as f32).sqrt();
    // One call set: every KV head's tasks of `rows` rows over the whole prompt.
    let call_set = |out: &mut [f32]| {
        for g in 0..kv_heads {
            let mut r0 = 0;
            while r0 < len {
                let n = rows.min(len - r0);
                let w = group * hd;
                let rows = PrefillRows {
                    queries: simpler_kernels_cpu::PrefillQueries::F32(&q[r0 * w..(r0 + n) * w]),
                    group,
                    kv,
                    block_table: &table,
                    kv_head: g,
                    first_pos: r0,
                    scale,
                };
                prefill_attention_rows_f32(&rows, &mut out[r0 * w..(r0 + n) * w]);
                r0 += n;
            }
        }
    };
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
    for rep in 0..=reps {
        for (pi, &isa) in paths.iter().enumerate() {
            let c0 = common::thread_cpu_seconds();
            with_isa(isa, || call_set(&mut out)).unwrap_or_else(|| panic!("no {}", isa.name()));
            let dt = common::thread_cpu_seconds() - c0;
            if rep > 0 {
                times[pi].push(dt);
            }
        }
    }
    println!(
        "prefill attention, {len} tokens in tasks of {rows} rows, {kv_heads} KV heads × group {group}, head {hd}:"
    );
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = med(&mut times[0].clone());
    for (pi, isa) in paths.iter().enumerate() {
        let m = med(&mut times[pi]);
        println!(
            "{:>12} (prefill path {}): thread CPU median {:.2} ms, min {:.2} ms, {:.2}x the first",
            isa.name(),
            simpler_kernels_cpu::attention::prefill_path(*isa, hd).name(),
            m * 1e3,
            times[pi][0] * 1e3,
            m / base
        );
    }
    common::print_load_average();
}
