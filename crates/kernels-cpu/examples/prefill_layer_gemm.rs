//! The Qwen3-0.6B prefill layer's four GEMM phases as the step runs them — q/k/v together, then
//! o (added into the residual), gate/up with SwiGLU, down (added) — on 2 threads (`--threads`)
//! that claim SPMD blocks from a shared counter, over several layers' weights (so each layer's
//! weights come from memory, as in the step, not from L3 as in a one-shape loop). Two block splits
//! (`--a` and `--b`, blocks per projection) alternate A B B A; each pass's cost is the CPU time
//! of the threads (time spent waiting at a phase end or descheduled does not count), printed
//! per phase as CPU ms and, over the runs, as % of the FMA rate the same threads measured just
//! before each pass in thread CPU time, with the median of the paired ratios B/A.
//!
//! `cargo run --release -p simpler-kernels-cpu --example prefill_layer_gemm -- [--rows 512]
//! [--layers 4] [--reps 4] [--a q=8,k=8,v=8,o=8,gu=12,d=8] [--b q=4,k=2,v=2,o=4,gu=12,d=4]
//! [--a-zero 1] [--b-zero 0] [--threads 2] [--b-layers N]`
//!
//! `--b-layers N` has B cycle over the first `N` layers' weights only (1: one layer, 30 MiB,
//! mostly in the 32 MiB L3 between passes), to price the weights' trip from memory.
//!
//! `--a-zero` / `--b-zero` (default 1 / 0) zero each block's scratch first, as the step's
//! kernels did before session 16. `--ceiling N,K,batch` instead repeats one small product on
//! one thread with its operands in cache: the kernel's rate without memory traffic.

mod common;

use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PACK_BLOCK, PackedActs, WeightsBf16, gemm_bf16, pack_acts_bf16,
    pack_segment_bf16, packed_ld, packed_len, split_range, swiglu_bf16,
};

const H: usize = 1024;
const QW: usize = 2048;
const KVW: usize = 1024;
const I: usize = 3072;

/// Blocks per projection.
#[derive(Clone, Copy, Debug)]
struct Split {
    q: usize,
    k: usize,
    v: usize,
    o: usize,
    gu: usize,
    d: usize,
}

fn parse_split(s: &str) -> Split {
    let mut sp = Split {
        q: 8,
        k: 8,
        v: 8,
        o: 8,
        gu: 12,
        d: 8,
    };
    for kv in s.split(',') {
        let (k, v) = kv.split_once('=').expect("name=blocks");
        let v: usize = v.parse().expect("blocks");
        match k {
            "q" => sp.q = v,
            "k" => sp.k = v,
            "v" => sp.v = v,
            "o" => sp.o = v,
            "gu" => sp.gu = v,
            "d" => sp.d = v,
            _ => panic!("unknown projection {k}"),
        }
    }
    sp
}

/// One layer's weights.
struct Layer {
    q: &'static [bf16],
    k: &'static [bf16],
    v: &'static [bf16],
    o: &'static [bf16],
    g: &'static [bf16],
    u: &'static [bf16],
    d: &'static [bf16],
}

fn fill(len: usize, seed: &mut u64) -> &'static [bf16] {
    let v = common::huge_pool(len);
    for e in v.iter_mut() {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *e = bf16::from_f32(((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04);
    }
    v
}

/// A block of work: phase-local job index → (which product, rows).
#[derive(Clone, Copy)]
enum Prod {
    Q,
    K,
    V,
    O,
    Gu,
    D,
}

fn jobs(p: &[(Prod, usize, usize)]) -> Vec<(Prod, std::ops::Range<usize>)> {
    let mut v = Vec::new();
    for &(prod, n, blocks) in p {
        let units = n.div_ceil(PACK_BLOCK);
        for b in 0..blocks {
            let r = split_range(units, blocks, b);
            let r = (r.start * PACK_BLOCK).min(n)..(r.end * PACK_BLOCK).min(n);
            if !r.is_empty() {
                v.push((prod, r));
            }
        }
    }
    v
}

/// Outputs shared by the threads (each block writes its own columns).
struct Outs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    x: Vec<f32>,
    act: Vec<f32>,
}

/// The outputs' first elements, shared by the threads: blocks write disjoint columns, so they
/// reach them through pointers (a slice of the whole output would alias the other block's).
#[derive(Clone, Copy)]
struct OutPtrs {
    q: *mut f32,
    k: *mut f32,
    v: *mut f32,
    x: *mut f32,
    act: *mut f32,
}
// SAFETY: the threads write disjoint column ranges of the outputs, which outlive them.
unsafe impl Send for OutPtrs {}
// SAFETY: as above.
unsafe impl Sync for OutPtrs {}

fn main() {
    assert!(Isa::detected() == Isa::Avx2, "AVX2 path only");
    let rows: usize = common::arg("--rows").map_or(512, |s| s.parse().expect("--rows"));
    let layers: usize = common::arg("--layers").map_or(4, |s| s.parse().expect("--layers"));
    let reps: usize = common::arg("--reps").map_or(4, |s| s.parse().expect("--reps"));
    // B's distinct layers (cycled): 1 keeps one layer's 30 MiB of weights mostly in L3.
    let lb: usize = common::arg("--b-layers")
        .map_or(layers, |s| s.parse().expect("--b-layers"))
        .clamp(1, layers);
    let threads: usize = common::arg("--threads").map_or(2, |s| s.parse().expect("--threads"));
    let sa = parse_split(&common::arg("--a").unwrap_or_else(|| "q=8".into()));
    let sb = parse_split(&common::arg("--b").unwrap_or_else(|| "q=4,k=2,v=2,o=4,d=4".into()));
    let za = common::arg("--a-zero").is_none_or(|s| s != "0");
    let zb = common::arg("--b-zero").is_some_and(|s| s != "0");
    println!(
        "rows {rows}, {layers} layers; A {sa:?} zeroed scratch {za}; B {sb:?} zeroed scratch {zb}"
    );

    if let Some(shape) = common::arg("--ceiling") {
        ceiling(&shape, reps);
        return;
    }
    let mut seed = 0x1234_5678_u64;
    let ws: Vec<Layer> = (0..layers)
        .map(|_| Layer {
            q: fill(QW * H, &mut seed),
            k: fill(KVW * H, &mut seed),
            v: fill(KVW * H, &mut seed),
            o: fill(H * QW, &mut seed),
            g: fill(I * H, &mut seed),
            u: fill(I * H, &mut seed),
            d: fill(H * I, &mut seed),
        })
        .collect();
    let pack = |k: usize| {
        let x: Vec<bf16> = (0..rows * k)
            .map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5))
            .collect();
        let mut p = vec![0.0f32; packed_len(rows, k)];
        pack_acts_bf16(&x, rows, k, &mut p);
        p
    };
    let (xn, xa, xm) = (pack(H), pack(QW), pack(I));
    let mut outs = Outs {
        q: vec![0.0; rows * QW],
        k: vec![0.0; rows * KVW],
        v: vec![0.0; rows * KVW],
        x: vec![0.0; rows * H],
        act: vec![0.0; packed_len(rows, I)],
    };
    let flops = |n: usize, k: usize| 2.0 * (rows * n * k) as f64;
    let phase_flops = [
        flops(QW + 2 * KVW, H),
        flops(H, QW),
        flops(2 * I, H),
        flops(H, I),
    ];
    let names = ["qkv", "o", "gate/up", "down"];

    let run = |sp: Split, zero: bool, distinct: usize, outs: &mut Outs| -> ([f64; 4], f64) {
        let phases = [
            jobs(&[
                (Prod::Q, QW, sp.q),
                (Prod::K, KVW, sp.k),
                (Prod::V, KVW, sp.v),
            ]),
            jobs(&[(Prod::O, H, sp.o)]),
            jobs(&[(Prod::Gu, I, sp.gu)]),
            jobs(&[(Prod::D, H, sp.d)]),
        ];
        let counters: Vec<AtomicUsize> = (0..layers * 4).map(|_| AtomicUsize::new(0)).collect();
        let barrier = Barrier::new(threads);
        let op = OutPtrs {
            q: outs.q.as_mut_ptr(),
            k: outs.k.as_mut_ptr(),
            v: outs.v.as_mut_ptr(),
            x: outs.x.as_mut_ptr(),
            act: outs.act.as_mut_ptr(),
        };
        let (xn, xa, xm) = (&xn, &xa, &xm);
        let (phases, counters, barrier, ws) = (&phases, &counters, &barrier, &ws);
        let res: Vec<([f64; 4], f64)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(move || {
                        let mut scratch = vec![0.0f32; 2 * rows * I];
                        let mut act = vec![bf16::ZERO; rows * I];
                        let ones = vec![1.0f32; rows];
                        barrier.wait();
                        let fma = common::thread_fma_gflops(FMA_ITERS);
                        let mut t = [0.0f64; 4];
                        for l in 0..layers {
                            let w = &ws[l % distinct];
                            for (ph, js) in phases.iter().enumerate() {
                                barrier.wait();
                                let c0 = common::thread_cpu_seconds();
                                loop {
                                    let j = counters[l * 4 + ph].fetch_add(1, Ordering::Relaxed);
                                    let Some((prod, r)) = js.get(j).cloned() else {
                                        break;
                                    };
                                    // SAFETY: each job writes only its own columns of one
                                    // output; the outputs outlive the scope.
                                    unsafe {
                                        block(
                                            prod,
                                            r,
                                            w,
                                            (xn, xa, xm),
                                            op,
                                            rows,
                                            &mut scratch,
                                            &mut act,
                                            &ones,
                                            zero,
                                        )
                                    };
                                }
                                t[ph] += common::thread_cpu_seconds() - c0;
                            }
                        }
                        (t, fma)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        let mut t = [0.0; 4];
        for (ti, _) in &res {
            for p in 0..4 {
                t[p] += ti[p];
            }
        }
        let fma = res.iter().map(|r| r.1).sum::<f64>() / threads as f64;
        (t, fma)
    };

    // Warm-up of both.
    run(sa, za, layers, &mut outs);
    run(sb, zb, lb, &mut outs);
    let mut res: [Vec<([f64; 4], f64)>; 2] = [Vec::new(), Vec::new()];
    for r in 0..reps {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for which in order {
            let (sp, z, d) = if which == 0 {
                (sa, za, layers)
            } else {
                (sb, zb, lb)
            };
            let x = run(sp, z, d, &mut outs);
            let tot: f64 = x.0.iter().sum();
            println!(
                "{} cpu {:.1} ms (qkv {:.1}, o {:.1}, gu {:.1}, d {:.1}); {:.1}% of FMA ({:.1} GFLOP/s/thread)",
                ["A", "B"][which],
                tot * 1e3,
                x.0[0] * 1e3,
                x.0[1] * 1e3,
                x.0[2] * 1e3,
                x.0[3] * 1e3,
                100.0 * phase_flops.iter().sum::<f64>() * layers as f64 / tot / 1e9 / x.1,
                x.1
            );
            res[which].push(x);
        }
    }
    println!("--- medians (% of the pass's own thread-CPU FMA rate); B/A median of paired ratios");
    for p in 0..5 {
        let get = |x: &([f64; 4], f64)| {
            if p < 4 { x.0[p] } else { x.0.iter().sum() }
        };
        let fl = if p < 4 {
            phase_flops[p]
        } else {
            phase_flops.iter().sum()
        } * layers as f64;
        let pct = |w: usize| {
            median(
                &res[w]
                    .iter()
                    .map(|x| 100.0 * fl / get(x) / 1e9 / x.1)
                    .collect::<Vec<_>>(),
            )
        };
        let ratio = median(
            &res[0]
                .iter()
                .zip(&res[1])
                .map(|(a, b)| get(b) / get(a))
                .collect::<Vec<_>>(),
        );
        println!(
            "{:<8} A {:>5.1}%  B {:>5.1}%  B/A cpu {:.3}",
            if p < 4 { names[p] } else { "all" },
            pct(0),
            pct(1),
            ratio
        );
    }
}

/// One block as the step's kernels run it: the product into per-thread scratch (zeroed first
/// when `zero`, as the step's kernels did before session 16), then copied (or, for the
/// residual, copied in, added and copied out) into the shared output; gate/up: both products,
/// SwiGLU and the packed store of its rows.
///
/// # Safety
/// `o` points at outputs of the example's shapes for `rows` rows; no other thread touches
/// columns `r` of the output this block writes during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    prod: Prod,
    r: std::ops::Range<usize>,
    w: &Layer,
    (xn, xa, xm): (&[f32], &[f32], &[f32]),
    o: OutPtrs,
    rows: usize,
    scratch: &mut [f32],
    act: &mut [bf16],
    ones: &[f32],
    zero: bool,
) {
    let n = r.len();
    if zero {
        let len = if matches!(prod, Prod::Gu) {
            2 * rows * n
        } else {
            rows * n
        };
        scratch[..len].fill(0.0);
        act[..rows * n].fill(bf16::ZERO);
    }
    let tile = |k: usize, mode| GemmTile {
        n: 0..n,
        k: 0..k,
        mode,
    };
    let sub = |m: &'static [bf16], k: usize| WeightsBf16::new(&m[r.start * k..r.end * k], n, k);
    let (m, k, x, out, ld, mode) = match prod {
        Prod::Q => (w.q, H, xn, o.q, QW, OutMode::Store),
        Prod::K => (w.k, H, xn, o.k, KVW, OutMode::Store),
        Prod::V => (w.v, H, xn, o.v, KVW, OutMode::Store),
        Prod::O => (w.o, QW, xa, o.x, H, OutMode::Add),
        Prod::D => (w.d, I, xm, o.x, H, OutMode::Add),
        Prod::Gu => {
            let (gate, up) = scratch[..2 * rows * n].split_at_mut(rows * n);
            let x = PackedActs::new(xn, rows, H);
            gemm_bf16(sub(w.g, H), x, &tile(H, OutMode::Store), gate, n);
            gemm_bf16(sub(w.u, H), x, &tile(H, OutMode::Store), up, n);
            let a = &mut act[..rows * n];
            swiglu_bf16(gate, up, ones, a);
            let ld = packed_ld(I);
            for b in 0..rows {
                // SAFETY: columns r of packed row b (r on packing blocks) are this block's.
                let dst = unsafe { std::slice::from_raw_parts_mut(o.act.add(b * ld + r.start), n) };
                pack_segment_bf16(&a[b * n..(b + 1) * n], r.start, I, dst);
            }
            return;
        }
    };
    let (wm, xp) = (sub(m, k), PackedActs::new(x, rows, k));
    let s = &mut scratch[..rows * n];
    if mode == OutMode::Add {
        for b in 0..rows {
            // SAFETY: row b's columns r of `out` are this block's (contract).
            unsafe {
                std::ptr::copy_nonoverlapping(out.add(b * ld + r.start), s[b * n..].as_mut_ptr(), n)
            };
        }
    }
    gemm_bf16(wm, xp, &tile(k, mode), s, n);
    for b in 0..rows {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(s[b * n..].as_ptr(), out.add(b * ld + r.start), n) };
    }
}

/// Rounds of the FMA kernel run before each pass (~10 ms).
const FMA_ITERS: u64 = 5_000_000;

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// `--ceiling N,K,batch`: one thread repeating one small product whose operands stay in cache:
/// the kernel's own rate without memory traffic (median of `2 · reps` passes).
fn ceiling(shape: &str, reps: usize) {
    let v: Vec<usize> = shape
        .split(',')
        .map(|s| s.parse().expect("N,K,batch"))
        .collect();
    let (n, k, batch) = (v[0], v[1], v[2]);
    let mut seed = 7u64;
    let w = fill(n * k, &mut seed);
    let x: Vec<bf16> = (0..batch * k)
        .map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5))
        .collect();
    let mut p = vec![0.0f32; packed_len(batch, k)];
    pack_acts_bf16(&x, batch, k, &mut p);
    let wm = WeightsBf16::new(w, n, k);
    let acts = PackedActs::new(&p, batch, k);
    let mut out = vec![0.0f32; batch * n];
    let tile = GemmTile {
        n: 0..n,
        k: 0..k,
        mode: OutMode::Store,
    };
    let calls = (4e8 / (2.0 * (n * k * batch) as f64)).ceil() as usize;
    let mut res = Vec::new();
    for r in 0..2 * reps + 2 {
        let fma = common::thread_fma_gflops(FMA_ITERS);
        let c0 = common::thread_cpu_seconds();
        for _ in 0..calls {
            gemm_bf16(wm, acts, &tile, &mut out, n);
        }
        let dt = common::thread_cpu_seconds() - c0;
        let rate = 2.0 * (n * k * batch * calls) as f64 / dt / 1e9;
        if r >= 2 {
            res.push(rate / fma);
        }
    }
    println!(
        "ceiling {n}x{k} batch {batch}: {:.1}% of the thread-CPU FMA rate (median), best {:.1}%",
        100.0 * median(&res),
        100.0 * res.iter().copied().fold(0.0, f64::max)
    );
}
