//! The GEMM phases of Qwen3-0.6B decode steps replayed at kernel level: per layer the q/k/v
//! projections (deferred `1/rms` row scale, stored), `o_proj` (added into a residual),
//! gate/up with SwiGLU (each block runs its gate rows, its up rows, then SwiGLU, as the
//! runtime's `gate_up_swiglu` block does) and `down` (added), every phase cut into the
//! decode plan's SPMD blocks (`TilePolicy::blocks`: about 1 MiB of weights, at least 4 per
//! thread, whole 16-row groups, equal shares) that the threads take from a shared counter,
//! with a spinning barrier between phases as the runtime's workers wait on the next phase.
//! Each layer has its own weights in both layouts (row-major and the other one, `--layout
//! tiled|pairs`, by default the one this CPU's path streams: paired on AVX2 and AVX-512 BF16 without AMX, else
//! tiled), so
//! every pass streams them from memory; passes of the two layouts alternate A B B A in one
//! process.
//!
//! Per batch, layout and phase it prints the weights' GB/s by the phase's wall time (barrier
//! to barrier, summed over the layers), by the threads' busy time (wall time inside the
//! blocks; wall minus busy per thread is the phase's tail and barrier wait) and by the
//! threads' CPU time inside the blocks (not counting time descheduled by other work on the
//! host): medians over the passes.
//!
//! `--versus-l2-prefetch`: both sides paired, the first with the AVX-512 BF16 paired
//! kernel's multi-run passes prefetching into L2 (`gemm::set_paired_l1_prefetch(false)`), the
//! second as by default (into L1).
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemm_step_bw [-- --batches 4,16
//! --layers 12 --reps 5 --threads 2 --layout pairs --versus-l2-prefetch]`

mod common;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PackedActs, WeightLayout, WeightsBf16, gemm_bf16, gemm_scaled_bf16,
    pack_acts_bf16, packed_len, pair_weights_bf16, paired_weights_pay, path_for, swiglu_bf16,
    tile_weights_bf16,
};

/// Hidden size, q width, KV width and intermediate size of Qwen3-0.6B.
const H: usize = 1024;
const QW: usize = 2048;
const KVW: usize = 1024;
const INTER: usize = 3072;

/// The phases replayed per layer.
const PHASES: [&str; 4] = ["qkv", "o_proj", "gate_up", "down"];

/// One projection of a layer: `[n, k]` in both layouts.
struct Mat<'a> {
    n: usize,
    k: usize,
    rm: &'a [bf16],
    tl: &'a [bf16],
}

impl Mat<'_> {
    fn view(&self, layout: WeightLayout) -> WeightsBf16<'_> {
        match layout {
            WeightLayout::RowMajor => WeightsBf16::new(self.rm, self.n, self.k),
            WeightLayout::Tiled => WeightsBf16::tiled(self.tl, self.n, self.k),
            WeightLayout::Pairs => WeightsBf16::paired(self.tl, self.n, self.k),
        }
    }
}

/// A layer's projections: q, k, v, o, gate, up, down.
struct Layer<'a> {
    m: [Mat<'a>; 7],
}

/// One block of a phase: which matrices (gate and up together), which rows, stored or added,
/// scaled or not.
#[derive(Clone)]
struct Block {
    mats: [usize; 2],
    pair: bool,
    rows: std::ops::Range<usize>,
    mode: OutMode,
    scaled: bool,
}

fn main() {
    let get = common::arg;
    let batches = common::batches("4,16");
    let layers: usize = get("--layers").map_or(12, |s| s.parse().expect("--layers"));
    let reps: usize = get("--reps").map_or(5, |s| s.parse().expect("--reps"));
    let threads: usize = get("--threads")
        .map_or(2, |s| s.parse().expect("--threads"))
        .max(1);
    let shapes = [
        (QW, H),
        (KVW, H),
        (KVW, H),
        (H, QW),
        (INTER, H),
        (INTER, H),
        (H, INTER),
    ];
    let other = match get("--layout").as_deref() {
        Some("tiled") => WeightLayout::Tiled,
        Some("pairs") => WeightLayout::Pairs,
        None if paired_weights_pay(Isa::current()) => WeightLayout::Pairs,
        None => WeightLayout::Tiled,
        Some(l) => panic!("--layout {l}: tiled or pairs"),
    };
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut fill = |n: usize, k: usize| {
        let rm = common::huge_pool(n * k);
        for d in rm.iter_mut() {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *d = bf16::from_f32(((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04);
        }
        let tl = common::huge_pool(n * k);
        tl.copy_from_slice(&match other {
            WeightLayout::Pairs => pair_weights_bf16(rm, n, k),
            _ => tile_weights_bf16(rm, n, k),
        });
        Mat {
            n,
            k,
            rm: &*rm,
            tl: &*tl,
        }
    };
    let model: Vec<Layer<'_>> = (0..layers)
        .map(|_| Layer {
            m: shapes.map(|(n, k)| fill(n, k)),
        })
        .collect();
    let layer_bytes: usize = shapes.iter().map(|(n, k)| n * k * 2).sum();
    let phase_bytes = [
        (QW + 2 * KVW) * H * 2,
        H * QW * 2,
        2 * INTER * H * 2,
        H * INTER * 2,
    ];
    let isa = Isa::current();
    println!(
        "isa {}; {layers} layers of {:.1} MB per layout; {threads} threads; plan split",
        isa.name(),
        layer_bytes as f64 / 1e6
    );
    let phases = phase_blocks(threads);
    for (name, blocks) in PHASES.iter().zip(&phases) {
        println!("  {name}: {} blocks", blocks.len());
    }
    for &batch in &batches {
        let acts_for = |k: usize| {
            let x: Vec<bf16> = (0..batch * k)
                .map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5))
                .collect();
            let mut packed = vec![0.0f32; packed_len(batch, k)];
            pack_acts_bf16(&x, batch, k, &mut packed);
            packed
        };
        let (ph, pq, pi) = (acts_for(H), acts_for(QW), acts_for(INTER));
        let acts = Acts {
            h: PackedActs::new(&ph, batch, H),
            q: PackedActs::new(&pq, batch, QW),
            i: PackedActs::new(&pi, batch, INTER),
            scale: vec![1.0; batch],
        };
        let versus_pf = std::env::args().any(|a| a == "--versus-l2-prefetch");
        assert!(
            !versus_pf || other == WeightLayout::Pairs,
            "--versus-l2-prefetch compares paired weights: give --layout pairs"
        );
        let layouts = if versus_pf {
            [other, other]
        } else {
            [WeightLayout::RowMajor, other]
        };
        // The first side's prefetch where `--versus-l2-prefetch` compares them.
        let side = |li: usize| {
            if versus_pf {
                simpler_kernels_cpu::gemm::set_paired_l1_prefetch(li == 1);
            }
        };
        let mut stats: [Vec<[PhaseTimes; 4]>; 2] = [Vec::new(), Vec::new()];
        // One untimed pass of each to fault in scratch and settle the clocks.
        for (li, l) in layouts.into_iter().enumerate() {
            side(li);
            step_pass(&model, &phases, &acts, l, threads);
        }
        for _ in 0..reps.max(1) {
            for li in [0, 1, 1, 0] {
                side(li);
                stats[li].push(step_pass(&model, &phases, &acts, layouts[li], threads));
            }
        }
        simpler_kernels_cpu::gemm::set_paired_l1_prefetch(true);
        for (li, l) in layouts.iter().enumerate() {
            let what = match (versus_pf, li) {
                (true, 0) => "Pairs, L2 prefetch".to_string(),
                (true, _) => "Pairs, L1 prefetch".to_string(),
                _ => format!("{l:?}"),
            };
            println!(
                "batch {batch:>2}, {what} ({}): GB/s by wall / busy / CPU time, medians of {} passes",
                path_for(isa, batch, *l).name(),
                stats[li].len()
            );
            for (p, name) in PHASES.iter().enumerate() {
                let bytes = (phase_bytes[p] * layers) as f64;
                let rate = |f: &dyn Fn(&PhaseTimes) -> f64| {
                    let mut v: Vec<f64> =
                        stats[li].iter().map(|s| bytes / f(&s[p]) / 1e9).collect();
                    v.sort_by(f64::total_cmp);
                    (v[v.len() / 2], v[v.len() - 1])
                };
                let (w, wb) = rate(&|t| t.wall);
                let (b, _) = rate(&|t| t.busy / threads as f64);
                let (c, _) = rate(&|t| t.cpu / threads as f64);
                // The other layout against row-major, pass by pass (neighbouring passes of A
                // B B A).
                let paired = if li == 1 {
                    let mut r: Vec<f64> = stats[1]
                        .iter()
                        .zip(&stats[0])
                        .map(|(t, r)| r[p].cpu / t[p].cpu)
                        .collect();
                    r.sort_by(f64::total_cmp);
                    format!(
                        "  CPU-time rate {}/{} median {:.3} (range {:.3}..{:.3})",
                        if versus_pf { "L1" } else { "Pairs" },
                        if versus_pf { "L2" } else { "row-major" },
                        r[r.len() / 2],
                        r[0],
                        r[r.len() - 1]
                    )
                } else {
                    String::new()
                };
                println!(
                    "  {name:<8} wall {w:>5.1} (best {wb:>5.1})  busy {b:>5.1}  cpu {c:>5.1}{paired}"
                );
            }
        }
    }
}

/// The packed activations of each `K` and the row scale.
struct Acts<'a> {
    h: PackedActs<'a>,
    q: PackedActs<'a>,
    i: PackedActs<'a>,
    scale: Vec<f32>,
}

/// Seconds one phase took over all layers of a pass.
#[derive(Clone, Copy, Default)]
struct PhaseTimes {
    /// Barrier to barrier.
    wall: f64,
    /// Summed over the threads: wall time inside the blocks.
    busy: f64,
    /// Summed over the threads: CPU time inside the blocks.
    cpu: f64,
}

/// SPMD blocks of an `n x k` projection as the decode plan cuts it (`TilePolicy::blocks`).
fn plan_blocks(n: usize, row_bytes: usize, threads: usize) -> usize {
    (n * row_bytes)
        .div_ceil(1 << 20)
        .max(4 * threads)
        .min(n / 16)
        .max(1)
}

/// Equal shares of `units` 16-row groups.
fn shares(n: usize, blocks: usize) -> Vec<std::ops::Range<usize>> {
    let units = n.div_ceil(16);
    (0..blocks)
        .map(|b| (units * b / blocks * 16).min(n)..(units * (b + 1) / blocks * 16).min(n))
        .filter(|r| !r.is_empty())
        .collect()
}

/// The blocks of the four phases, in the order the runtime submits them.
fn phase_blocks(threads: usize) -> [Vec<Block>; 4] {
    let one = |m: usize, n: usize, k: usize, mode: OutMode, scaled: bool| {
        shares(n, plan_blocks(n, 2 * k, threads))
            .into_iter()
            .map(move |rows| Block {
                mats: [m, m],
                pair: false,
                rows,
                mode,
                scaled,
            })
    };
    let qkv = one(0, QW, H, OutMode::Store, true)
        .chain(one(1, KVW, H, OutMode::Store, true))
        .chain(one(2, KVW, H, OutMode::Store, true))
        .collect();
    let o = one(3, H, QW, OutMode::Add, false).collect();
    let gate_up = shares(INTER, plan_blocks(INTER, 4 * H, threads))
        .into_iter()
        .map(|rows| Block {
            mats: [4, 5],
            pair: true,
            rows,
            mode: OutMode::Store,
            scaled: false,
        })
        .collect();
    let down = one(6, H, INTER, OutMode::Add, false).collect();
    [qkv, o, gate_up, down]
}

/// A barrier the threads spin on (the runtime's workers spin between phases too), yielding
/// the core after a while (on a host loaded with other work the last thread may be waiting
/// for it). The last thread to arrive notes when the phase ended.
struct SpinBarrier {
    arrived: AtomicUsize,
    generation: AtomicUsize,
    threads: usize,
    t0: Instant,
    /// Nanoseconds from `t0` at which each barrier released.
    released: Vec<AtomicU64>,
}

impl SpinBarrier {
    fn wait(&self) {
        let g = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            self.released[g].store(self.t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
        } else {
            let mut spins = 0u32;
            while self.generation.load(Ordering::Acquire) == g {
                spins += 1;
                if spins < 20_000 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}

/// One pass over every layer's four phases in `layout`.
fn step_pass(
    model: &[Layer<'_>],
    phases: &[Vec<Block>; 4],
    acts: &Acts<'_>,
    layout: WeightLayout,
    threads: usize,
) -> [PhaseTimes; 4] {
    let counters: Vec<AtomicUsize> = (0..model.len() * 4).map(|_| AtomicUsize::new(0)).collect();
    let barrier = SpinBarrier {
        arrived: AtomicUsize::new(0),
        generation: AtomicUsize::new(0),
        threads,
        t0: Instant::now(),
        released: (0..=model.len() * 4).map(|_| AtomicU64::new(0)).collect(),
    };
    let batch = acts.h.rows();
    let per_thread: Vec<[PhaseTimes; 4]> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let (counters, barrier) = (&counters, &barrier);
                s.spawn(move || {
                    let mut times = [PhaseTimes::default(); 4];
                    let mut out = vec![0.0f32; batch * INTER];
                    let mut up = vec![0.0f32; batch * INTER];
                    let mut act = vec![bf16::ZERO; batch * INTER];
                    barrier.wait();
                    for (li, layer) in model.iter().enumerate() {
                        for (p, blocks) in phases.iter().enumerate() {
                            loop {
                                let i = counters[li * 4 + p].fetch_add(1, Ordering::Relaxed);
                                let Some(b) = blocks.get(i) else { break };
                                let (t0, c0) = (Instant::now(), common::thread_cpu_seconds());
                                run_block(layer, b, acts, layout, &mut out, &mut up, &mut act);
                                times[p].busy += t0.elapsed().as_secs_f64();
                                times[p].cpu += common::thread_cpu_seconds() - c0;
                            }
                            barrier.wait();
                        }
                    }
                    std::hint::black_box(&out);
                    times
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .collect()
    });
    let mut sum = [PhaseTimes::default(); 4];
    for t in &per_thread {
        for p in 0..4 {
            sum[p].busy += t[p].busy;
            sum[p].cpu += t[p].cpu;
        }
    }
    // Barrier 0 starts the pass; barrier 1 + 4 l + p ends phase p of layer l.
    let at = |i: usize| barrier.released[i].load(Ordering::Relaxed) as f64 * 1e-9;
    for i in 0..model.len() * 4 {
        sum[i % 4].wall += at(i + 1) - at(i);
    }
    sum
}

/// One SPMD block: its GEMM(s) into the thread's scratch (and SwiGLU for gate/up).
fn run_block(
    layer: &Layer<'_>,
    b: &Block,
    acts: &Acts<'_>,
    layout: WeightLayout,
    out: &mut [f32],
    up: &mut [f32],
    act: &mut [bf16],
) {
    let m = &layer.m[b.mats[0]];
    let x = match m.k {
        H => acts.h,
        QW => acts.q,
        _ => acts.i,
    };
    let n = b.rows.len();
    let batch = x.rows();
    let tile = GemmTile {
        n: 0..n,
        k: 0..m.k,
        mode: b.mode,
    };
    let w = m.view(layout).row_range(b.rows.clone());
    let out = &mut out[..batch * n];
    if b.scaled {
        gemm_scaled_bf16(w, x, &tile, &acts.scale, out, n);
    } else {
        gemm_bf16(w, x, &tile, out, n);
    }
    if b.pair {
        let wu = layer.m[b.mats[1]].view(layout).row_range(b.rows.clone());
        let up = &mut up[..batch * n];
        gemm_bf16(wu, x, &tile, up, n);
        swiglu_bf16(out, up, &acts.scale, &mut act[..batch * n]);
    }
}
