//! Split-KV decode attention throughput on one thread: KV bytes streamed per second for a
//! Qwen3 head shape over a paged pool larger than the last-level cache.
//!
//! `cargo run --release -p simpler-kernels-cpu --example attn_bw [-- --seq 256 --group 2 --heads 8 --seqs 64 --passes 1 --all-heads --kernel avx512-bf16-pairs]`
//!
//! `--shape BxL [--layers 28 --rounds 9 --chunk 256 --threads 2 --paths read,avx512-bf16]`:
//! the model's decode attention phase instead — batch `B` of `L` tokens, every layer with its
//! own pools (cold, as in a step), each sequence cut into chunks of about `--chunk` tokens (the
//! plan's 256 at these shapes; one task per chunk, every KV head), the tasks claimed by
//! `--threads` threads (2, the step's) in order, a barrier between layers. The named paths
//! alternate round by round: decode kernels (`set_process_decode_kernel`: `avx2`, `avx512-bf16`, `avx512-bf16-heads`, ..), `read` (a plain read of
//! each task's rows in address order), `read-split:N[kv]` (the same rows as `N` far-apart
//! streams read side by side, 128 bytes of each in turn; `kv`: K's and V's together),
//! `read-heads:N` (the kernel's access pattern without its arithmetic, `N` heads per pass) and
//! `read-ahead:A` (head-major runs as the AVX-512 kernel reads them, each head's slices
//! prefetched `A` head passes ahead); per path, the median and minimum wall time of a round
//! and of the threads' CPU time, and for every path after the first the median of the rounds'
//! ratios to the first path's (wall and CPU).

mod common;

use std::ops::Range;
use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::{
    PagedKv, decode_attention_heads_bf16, decode_attention_partial_bf16, partial_len, split_range,
};

/// Head dimension and tokens per page (Qwen3's) in both modes.
const HD: usize = 128;
const PAGE: usize = 128;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |name: &str, d: usize| common::arg(name).map_or(d, |s| s.parse().expect("integer"));
    let (seq, group, kv_heads, seqs) = (
        get("--seq", 256),
        get("--group", 2),
        get("--heads", 8),
        get("--seqs", 64),
    );
    if let Some(shape) = common::arg("--shape") {
        let (b, l) = shape.split_once('x').expect("--shape BxL");
        plan_phase(
            b.parse().expect("batch"),
            l.parse().expect("length"),
            group,
            kv_heads,
            get("--layers", 28),
            get("--rounds", 9),
            get("--chunk", PLAN_CHUNK),
            get("--threads", 2).max(1),
            &common::arg("--paths").unwrap_or_else(|| "avx2,avx512-bf16,avx512-bf16-heads".into()),
        );
        return;
    }
    let passes = get("--passes", 1);
    let hd = HD;
    let blocks = seq.div_ceil(PAGE);
    let mut rnd = uniform_bf16(0x9E37_79B9_7F4A_7C15);
    let kv = random_pools(seqs * blocks * PAGE, kv_heads, &mut rnd);
    let (k, v) = (kv.k, kv.v);
    let q: Vec<bf16> = (0..kv_heads * group * hd).map(|_| rnd()).collect();
    let tables = contiguous_tables(seqs, blocks);
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
    if let Some(name) = common::arg("--kernel") {
        use simpler_kernels_cpu::attention::{DecodeKernel, set_process_decode_kernel};
        let k = DecodeKernel::from_name(&name).unwrap_or_else(|| panic!("unknown kernel {name:?}"));
        assert!(set_process_decode_kernel(Some(k)), "this CPU lacks {name}");
    }
    for rep in 0..3 {
        let t = Instant::now();
        let cpu: f64 = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..threads)
                .map(|th| {
                    let (tables, kv, q) = (&tables, &kv, &q);
                    sc.spawn(move || {
                        let c0 = common::thread_cpu_seconds();
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
                        common::thread_cpu_seconds() - c0
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).sum()
        });
        let dt = t.elapsed().as_secs_f64();
        let bytes = (passes * seqs * kv_heads * seq * hd * 2 * 2) as f64;
        println!(
            "rep {rep}: {:.1} us per (sequence, kv head) call, {:.2} GB/s of KV, {:.2} GB per thread CPU second",
            dt / (passes * seqs * kv_heads) as f64 * 1e6,
            bytes / dt / 1e9,
            bytes / cpu / 1e9
        );
    }
}

/// A seeded xorshift generator of bf16 values uniform in [-0.5, 0.5).
fn uniform_bf16(seed: u64) -> impl FnMut() -> bf16 {
    let mut s = seed;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        bf16::from_f32((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
    }
}

/// K and V pools of `slots` rows of `kv_heads` heads filled by `rnd`, each in a 2 MiB-aligned
/// anonymous mapping advised to use huge pages, as the runtime allocates them.
fn random_pools(slots: usize, kv_heads: usize, rnd: &mut impl FnMut() -> bf16) -> PagedKv<'static> {
    let k = common::huge_pool(slots * kv_heads * HD);
    let v = common::huge_pool(slots * kv_heads * HD);
    for x in k.iter_mut().chain(v.iter_mut()) {
        *x = rnd();
    }
    PagedKv {
        k,
        v,
        kv_heads,
        head_dim: HD,
        page_size: PAGE,
    }
}

/// Block tables of `seqs` sequences of `blocks` pages each, laid out one after the other.
fn contiguous_tables(seqs: usize, blocks: usize) -> Vec<Vec<u32>> {
    (0..seqs)
        .map(|b| (0..blocks).map(|j| (b * blocks + j) as u32).collect())
        .collect()
}

/// Tokens per decode attention task at the Qwen3 shapes on 2 cores (the plan's longest chunk).
const PLAN_CHUNK: usize = 256;

/// The `--shape` mode (see the module docs).
#[allow(clippy::too_many_arguments)]
fn plan_phase(
    batch: usize,
    len: usize,
    group: usize,
    kv_heads: usize,
    layers: usize,
    rounds: usize,
    chunk: usize,
    threads: usize,
    paths: &str,
) {
    use simpler_kernels_cpu::attention::DecodeKernel;
    use std::sync::Barrier;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (hd, page) = (HD, PAGE);
    let blocks = len.div_ceil(page);
    let row = kv_heads * hd;
    // `None`: the plain read pass over the same rows.
    let names: Vec<&str> = paths.split(',').collect();
    let paths: Vec<Option<DecodeKernel>> = paths
        .split(',')
        .map(|n| match n {
            "read" => None,
            _ if n.starts_with("read-heads")
                || n.starts_with("read-ahead")
                || n.starts_with("read-split") =>
            {
                None
            }
            _ => Some(DecodeKernel::from_name(n).unwrap_or_else(|| panic!("unknown kernel {n:?}"))),
        })
        .collect();
    let mut rnd = uniform_bf16(0x2545_F491_4F6C_DD1D);
    let pools: Vec<PagedKv<'static>> = (0..layers)
        .map(|_| random_pools(batch * blocks * page, kv_heads, &mut rnd))
        .collect();
    let qs: Vec<Vec<bf16>> = (0..batch)
        .map(|_| (0..kv_heads * group * hd).map(|_| rnd()).collect())
        .collect();
    let tables = contiguous_tables(batch, blocks);
    let chunks = len.div_ceil(chunk.max(1));
    let tasks: Vec<(usize, std::ops::Range<usize>)> = (0..batch)
        .flat_map(|b| (0..chunks).map(move |c| (b, split_range(len, chunks, c))))
        .collect();
    let rec = partial_len(group, hd);
    println!(
        "{batch} x {len}: {} tasks of ~{} tokens per layer, {layers} layers, {:.0} MB of KV per round, {threads} threads",
        tasks.len(),
        len / chunks,
        (layers * batch * len * row * 4) as f64 / 1e6
    );
    let mut walls: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
    let mut cpus: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
    for round in 0..=rounds {
        for (pi, &path) in paths.iter().enumerate() {
            if let Some(path) = path {
                assert!(
                    simpler_kernels_cpu::attention::set_process_decode_kernel(Some(path)),
                    "this CPU lacks {}",
                    path.name()
                );
            }
            let next: Vec<AtomicUsize> = (0..layers).map(|_| AtomicUsize::new(0)).collect();
            let barrier = Barrier::new(threads);
            let t = Instant::now();
            let cpu: f64 = std::thread::scope(|sc| {
                let hs: Vec<_> = (0..threads)
                    .map(|_| {
                        let (pools, qs, tables, tasks, next, barrier) =
                            (&pools, &qs, &tables, &tasks, &next, &barrier);
                        // `read-heads:N`: N heads per pass (1, the kernel's order, by default).
                        let heads_order = names[pi].strip_prefix("read-heads").map(|n| {
                            n.strip_prefix(':')
                                .map_or(1, |n| n.parse::<usize>().expect("read-heads:N"))
                        });
                        // `read-ahead:A`: head-major runs, slices prefetched A head passes ahead.
                        let ahead = names[pi].strip_prefix("read-ahead").map(|n| {
                            n.strip_prefix(':')
                                .map_or(2, |n| n.parse::<usize>().expect("read-ahead:A"))
                        });
                        // `read-split:N[kv]`: each task's K range, then its V range, as N equal
                        // parts read side by side 128 bytes at a time (`kv`: K's and V's parts
                        // all side by side).
                        let split = names[pi].strip_prefix("read-split:").map(|n| {
                            let kv = n.ends_with("kv");
                            let parts = n.trim_end_matches("kv").parse::<usize>();
                            (parts.expect("read-split:N[kv]").max(1), kv)
                        });
                        sc.spawn(move || {
                            let c0 = common::thread_cpu_seconds();
                            let mut partials = vec![0.0f32; kv_heads * rec];
                            let mut sink = 0u64;
                            for (layer, kv) in pools.iter().enumerate() {
                                let (k, v) = (kv.k, kv.v);
                                loop {
                                    let i = next[layer].fetch_add(1, Ordering::Relaxed);
                                    let Some((b, r)) = tasks.get(i) else { break };
                                    if let Some(a) = ahead {
                                        sink ^= read_ahead(
                                            k,
                                            v,
                                            &tables[*b],
                                            page,
                                            (kv_heads, hd),
                                            a,
                                            r.clone(),
                                        );
                                        continue;
                                    }
                                    if let Some((parts, kv_too)) = split {
                                        let at = |t: usize| {
                                            (tables[*b][t / page] as usize * page + t % page) * row
                                        };
                                        let (lo, hi) = (at(r.start), at(r.end - 1) + row);
                                        let len = (hi - lo) / parts / 64 * 64;
                                        let part = |pool: &'static [bf16], p: usize| {
                                            &pool[lo + p * len..lo + (p + 1) * len]
                                        };
                                        if kv_too {
                                            let all: Vec<&[bf16]> = (0..parts)
                                                .flat_map(|p| [part(k, p), part(v, p)])
                                                .collect();
                                            sink ^= read_side_by_side(&all);
                                        } else {
                                            for pool in [k, v] {
                                                let all: Vec<&[bf16]> =
                                                    (0..parts).map(|p| part(pool, p)).collect();
                                                sink ^= read_side_by_side(&all);
                                            }
                                        }
                                        continue;
                                    }
                                    if let Some(per_pass) = heads_order {
                                        let w = per_pass.clamp(1, kv_heads) * hd;
                                        sink ^=
                                            read_heads(k, v, &tables[*b], page, row, w, r.clone());
                                        continue;
                                    }
                                    if path.is_none() {
                                        let at = |t: usize| {
                                            (tables[*b][t / page] as usize * page + t % page) * row
                                        };
                                        for pool in [k, v] {
                                            sink ^=
                                                read_rows(&pool[at(r.start)..at(r.end - 1) + row]);
                                        }
                                        continue;
                                    }
                                    decode_attention_heads_bf16(
                                        &qs[*b],
                                        group,
                                        kv,
                                        &tables[*b],
                                        r.clone(),
                                        0.088,
                                        &mut partials,
                                    );
                                }
                                barrier.wait();
                            }
                            std::hint::black_box(sink);
                            common::thread_cpu_seconds() - c0
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("thread")).sum()
            });
            let wall = t.elapsed().as_secs_f64();
            // Round 0 warms every path up and is not counted.
            if round > 0 {
                walls[pi].push(wall);
                cpus[pi].push(cpu);
            }
        }
    }
    assert!(simpler_kernels_cpu::attention::set_process_decode_kernel(
        None
    ));
    let stat = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2] * 1e3, v[0] * 1e3)
    };
    let bytes = (layers * batch * len * row * 4) as f64;
    // Rounds alternate the paths, so a round's ratio to the first path sees the same host
    // load on both sides; their median resolves what the medians of noisy times do not.
    let paired = |v: &[Vec<f64>], pi: usize| {
        let mut r: Vec<f64> = v[pi].iter().zip(&v[0]).map(|(a, b)| a / b).collect();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    };
    for pi in 1..paths.len() {
        println!(
            "{:>12}: median of the rounds' ratios to {}: wall {:.3}, thread CPU {:.3}",
            names[pi],
            names[0],
            paired(&walls, pi),
            paired(&cpus, pi)
        );
    }
    for (pi, path) in paths.iter().enumerate() {
        let (wm, wmin) = stat(&mut walls[pi]);
        let (cm, cmin) = stat(&mut cpus[pi]);
        let name = names[pi];
        let _ = path;
        println!(
            "{name:>12}: wall median {wm:.2} ms (min {wmin:.2}, {:.1} GB/s at the min), thread CPU median {cm:.2} ms (min {cmin:.2}, {:.1} GB/s per core-second)",
            bytes / wmin / 1e6,
            bytes / cmin / 1e6,
        );
    }
    common::print_load_average();
}

/// Loads every 64-byte line of `slice` (whole lines only; a slice is a multiple of 32 bf16),
/// with no per-call set-up, so a read of many short slices costs what their lines cost.
#[inline(always)]
fn read_lines(slice: &[bf16]) -> u64 {
    let mut acc = 0u64;
    for line in slice.chunks_exact(32) {
        // SAFETY: 8 bytes inside the line; an unaligned read of plain data.
        let w = unsafe { line.as_ptr().cast::<u64>().read_unaligned() };
        acc = acc.wrapping_add(w);
    }
    acc
}

/// Reads every bf16 of `rows` (a plain read pass: 512-bit or 256-bit loads, four independent sums), the
/// bound the attention kernel's pass over the same rows is compared with.
/// A plain read of equal-length slices side by side, 64 elements (128 bytes) of each in turn:
/// as many concurrent sequential streams as slices (AVX2 32-bit adds, as `read_rows`).
fn read_side_by_side(slices: &[&[bf16]]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { side_by_side_avx2(slices) };
    }
    slices
        .iter()
        .map(|x| read_rows(x))
        .fold(0, u64::wrapping_add)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn side_by_side_avx2(slices: &[&[bf16]]) -> u64 {
    use std::arch::x86_64::*;
    let len = slices[0].len() / 64 * 64;
    let mut acc = [_mm256_setzero_si256(); 4];
    for i in (0..len).step_by(64) {
        for x in slices {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: i + 16 * j + 16 <= len <= x.len().
                let v = unsafe { _mm256_loadu_si256(x.as_ptr().add(i + 16 * j).cast()) };
                *a = _mm256_add_epi32(*a, v);
            }
        }
    }
    let mut lanes = [0u32; 8];
    let s = _mm256_add_epi32(
        _mm256_add_epi32(acc[0], acc[1]),
        _mm256_add_epi32(acc[2], acc[3]),
    );
    // SAFETY: eight u32 in `lanes`.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), s) };
    lanes.iter().map(|&l| u64::from(l)).sum()
}

fn read_rows(rows: &[bf16]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512 F.
        return unsafe { read_rows_avx512(rows) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { read_rows_avx2(rows) };
    }
    rows.iter().map(|x| u64::from(x.to_bits())).sum()
}

/// Defines `fn $name(rows: &[bf16]) -> u64`, [`read_rows`] at one vector width: four
/// accumulators of 32-bit adds over blocks of four `$vec` loads, the tail summed as scalars.
macro_rules! read_rows_at {
    ($(#[$doc:meta])* $name:ident, $feature:literal, $vec:ty, $zero:ident, $load:ident, $add:ident) => {
        $(#[$doc])*
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feature)]
        fn $name(rows: &[bf16]) -> u64 {
            use std::arch::x86_64::*;
            const LANES: usize = size_of::<$vec>() / 2;
            let mut acc = [$zero(); 4];
            let blocks = rows.chunks_exact(4 * LANES);
            let tail: u64 = blocks
                .remainder()
                .iter()
                .map(|x| u64::from(x.to_bits()))
                .sum();
            for b in blocks {
                for (i, a) in acc.iter_mut().enumerate() {
                    // SAFETY: `b` holds four vectors of bf16; vector `i` starts at `LANES * i`.
                    let v = unsafe { $load(b[LANES * i..].as_ptr().cast()) };
                    *a = $add(*a, v);
                }
            }
            let s = $add($add(acc[0], acc[1]), $add(acc[2], acc[3]));
            // SAFETY: a vector of 32-bit lanes is plain data of the array's size.
            let lanes: [u32; LANES / 2] = unsafe { std::mem::transmute(s) };
            tail.wrapping_add(lanes.iter().map(|&x| u64::from(x)).sum::<u64>())
        }
    };
}

read_rows_at!(
    read_rows_avx512,
    "avx512f",
    __m512i,
    _mm512_setzero_si512,
    _mm512_loadu_si512,
    _mm512_add_epi32
);
read_rows_at!(
    /// In 256-bit loads, for CPUs without AVX-512 (the scalar sum's widening arithmetic, not
    /// memory, bounded it there).
    read_rows_avx2,
    "avx2",
    __m256i,
    _mm256_setzero_si256,
    _mm256_loadu_si256,
    _mm256_add_epi32
);

/// One run of the decode kernels' walk over a sequence's tokens (at most 32 tokens, inside
/// one page): its first pool element and token count, and the next run's (`(0, 0)` after the
/// last).
#[derive(Clone, Copy)]
struct Run {
    base: usize,
    len: usize,
    next_base: usize,
    next_len: usize,
}

/// The runs of `tokens` of the sequence with `table` (pool rows of `row` elements).
fn runs(table: &[u32], page: usize, row: usize, tokens: Range<usize>) -> impl Iterator<Item = Run> {
    let slot = move |t: usize| table[t / page] as usize * page + t % page;
    let end = tokens.end;
    let run_len = move |t: usize| 32.min(page - t % page).min(end - t);
    let mut t = tokens.start;
    std::iter::from_fn(move || {
        if t >= end {
            return None;
        }
        let len = run_len(t);
        let next = t + len;
        let (next_base, next_len) = if next < end {
            (slot(next) * row, run_len(next))
        } else {
            (0, 0)
        };
        let run = Run {
            base: slot(t) * row,
            len,
            next_base,
            next_len,
        };
        t = next;
        Some(run)
    })
}

/// Prefetches the line of `at[0]` into L2 (the kernels' `prefetch_l2`).
fn prefetch(at: &[bf16]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(at.as_ptr().cast())
    };
}

/// Reads the rows of `tokens` in the AVX-512 decode kernel's order without its arithmetic:
/// runs of 32 tokens inside a page, a slice of `w` columns at a time (the kernel's is one
/// head), each row's slice of K then of V, the next run's slices prefetched into L2
/// meanwhile. At `w = hd` this separates the kernel's access pattern from its compute; wider
/// slices show what passes over several heads would read at.
fn read_heads(
    k: &[bf16],
    v: &[bf16],
    table: &[u32],
    page: usize,
    row: usize,
    w: usize,
    tokens: Range<usize>,
) -> u64 {
    let mut runs = runs(table, page, row, tokens).peekable();
    // The first run's rows, which no earlier run prefetches.
    if let Some(first) = runs.peek() {
        for e in (0..first.len * row).step_by(32) {
            prefetch(&k[first.base + e..]);
            prefetch(&v[first.base + e..]);
        }
    }
    let mut sink = 0u64;
    // One load per line: the plain read's memory traffic without its arithmetic.
    for run in runs {
        for c in (0..row).step_by(w) {
            let w = w.min(row - c);
            for pool in [k, v] {
                for r in 0..run.len {
                    if r < run.next_len {
                        for e in (0..w).step_by(32) {
                            prefetch(&pool[run.next_base + r * row + c + e..]);
                        }
                    }
                    let at = run.base + r * row + c;
                    sink = sink.wrapping_add(read_lines(&pool[at..at + w]));
                }
            }
        }
    }
    sink
}

/// Reads the rows of `tokens` in the decode kernels' head-major order without their
/// arithmetic: runs of 32 tokens inside a page, one head at a time, its K slices then its V
/// slices, while the slices `ahead` head passes on (this run's later heads, then the next
/// run's first ones) are prefetched into L2.
fn read_ahead(
    k: &[bf16],
    v: &[bf16],
    table: &[u32],
    page: usize,
    (heads, hd): (usize, usize),
    ahead: usize,
    tokens: Range<usize>,
) -> u64 {
    let row = heads * hd;
    let ahead = ahead.min(heads);
    let mut runs = runs(table, page, row, tokens).peekable();
    // The first run's first `ahead` heads, which no earlier pass prefetches.
    if let Some(first) = runs.peek() {
        for r in 0..first.len {
            for e in (0..ahead * hd).step_by(32) {
                prefetch(&k[first.base + r * row + e..]);
                prefetch(&v[first.base + r * row + e..]);
            }
        }
    }
    let mut sink = 0u64;
    for run in runs {
        for h in 0..heads {
            let (pb, pr, ph) = if h + ahead < heads {
                (run.base, run.len, h + ahead)
            } else {
                (run.next_base, run.next_len, h + ahead - heads)
            };
            for pool in [k, v] {
                for r in 0..run.len.max(pr) {
                    if r < pr && ahead > 0 {
                        for e in (0..hd).step_by(32) {
                            prefetch(&pool[pb + r * row + ph * hd + e..]);
                        }
                    }
                    if r < run.len {
                        let at = run.base + r * row + h * hd;
                        sink = sink.wrapping_add(read_lines(&pool[at..at + hd]));
                    }
                }
            }
        }
    }
    sink
}
