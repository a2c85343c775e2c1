//! Batch-1 GEMV against a plain read of the same bytes, on the decode plan's SPMD tiles: the
//! 0.6B projections × `--layers` (cold: more than the last-level cache), each matrix cut into
//! the plan's ~1 MiB row tiles, the tiles dealt to the threads in turn as the runtime's block
//! claims do. Every variant's pass is timed per thread by CPU time (`--wall` for the wall
//! clock) and the variants alternate A B … B A in one process, so host load drifts cancel.
//!
//! `cargo run --release -p simpler-kernels-cpu --example gemv_b1 [-- --layers 6 --reps 10 --threads 2 --head]`
//!
//! Variants: `Read` (one sequential AVX2 read of each tile), `Read4` (each tile as four
//! concurrent streams, as `membw` reads), `Gemm` (the library's `gemm_bf16` at batch 1),
//! `GemmPairs` (the same on the matrices in the paired layout, what the decode streams on the
//! AVX2 and AVX-512 BF16 paths), and
//! `--q S:PF[:HINT],...` GEMVs written here for comparison: the tile's rows as `S` contiguous
//! ranges walked side by side, prefetching `PF` elements ahead (0: none) with hint `HINT` (0
//! T0, 1 T1, 2 T2, 3 NTA; plus 10: 64-element steps with two prefetches). `--base I` names
//! the variant the paired ratios divide by (0: `Read`). `--head` adds the LM head
//! (151936 × 1024) once per pass.

mod common;

use std::sync::Barrier;
use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::{
    GemmTile, Isa, OutMode, PackedActs, WeightsBf16, gemm_bf16, pack_acts_bf16, packed_len,
    pair_weights_bf16, with_isa,
};

/// `(N, K)` of the 0.6B projections (gate and up as one 6144-row matrix, as the plan holds
/// them side by side in one task).
const SHAPES: [(usize, usize); 6] = [
    (2048, 1024),
    (1024, 1024),
    (1024, 1024),
    (1024, 2048),
    (6144, 1024),
    (1024, 3072),
];

/// The plan's tiles of an `n`-row matrix of `row_bytes` a row (`TilePolicy::for_cores(2)`).
fn tiles(n: usize, row_bytes: usize, cores: usize) -> Vec<std::ops::Range<usize>> {
    let units = n.div_ceil(16);
    let t = (n * row_bytes).div_ceil(1 << 20).max(4 * cores).min(units);
    (0..t)
        .map(|i| {
            let (a, b) = (units * i / t, units * (i + 1) / t);
            (a * 16).min(n)..(b * 16).min(n)
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Read,
    Read4,
    Gemm,
    /// The library's `gemm_bf16` at batch 1 on the same matrices in the paired layout (the
    /// decode's layout on the AVX2 and AVX-512 BF16 paths).
    GemmPairs,
    /// `Q(streams, prefetch elements)`: the tile cut into `streams` contiguous row ranges
    /// walked side by side, one row of each per pass.
    Q(usize, usize, usize),
}

fn variants() -> Vec<Variant> {
    let mut v = vec![
        Variant::Read,
        Variant::Read4,
        Variant::Gemm,
        Variant::GemmPairs,
    ];
    for q in common::arg("--q")
        .unwrap_or_else(|| "4:0,4:256,4:512,8:0,2:0".into())
        .split(',')
    {
        let f: Vec<usize> = q
            .split(':')
            .map(|x| x.parse().expect("--q S:PF[:HINT]"))
            .collect();
        v.push(Variant::Q(f[0], f[1], f.get(2).copied().unwrap_or(0)));
    }
    v
}

/// The tile's rows as `S` contiguous ranges walked side by side.
///
/// # Safety
/// AVX2 + FMA; `rows` inside the `k`-wide matrix at `w`, `rows.len()` a multiple of `S`, `k` a
/// multiple of 32, `x` the packed activations of `k`, `out` at least `rows.len()` long.
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_q<const S: usize>(
    w: *const u16,
    k: usize,
    rows: std::ops::Range<usize>,
    x: *const f32,
    out: &mut [f32],
    pf: usize,
    hint: usize,
) {
    let len = rows.len() / S;
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    for i in 0..len {
        let wr: [*const u16; S] = std::array::from_fn(|j| {
            // SAFETY: row rows.start + j * len + i lies inside the matrix (caller's contract).
            unsafe { w.add((rows.start + j * len + i) * k) }
        });
        let mut acc = [_mm256_setzero_ps(); S];
        let mut acco = [_mm256_setzero_ps(); S];
        let mut kk = 0;
        let wide = hint >= 10;
        let hint = hint % 10;
        let stepk = if wide { 64 } else { 32 };
        while kk < k {
            if pf > 0 && wide {
                for p in wr {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(kk + pf).cast::<i8>());
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(kk + pf + 32).cast::<i8>());
                }
            } else if pf > 0 {
                for p in wr {
                    let a = p.wrapping_add(kk + pf).cast::<i8>();
                    match hint {
                        0 => _mm_prefetch::<_MM_HINT_T0>(a),
                        1 => _mm_prefetch::<_MM_HINT_T1>(a),
                        2 => _mm_prefetch::<_MM_HINT_T2>(a),
                        _ => _mm_prefetch::<_MM_HINT_NTA>(a),
                    }
                }
            }
            for h in (0..stepk).step_by(16) {
                // SAFETY: kk + h + 16 <= k: inside the packed activations.
                let (xe, xo) = unsafe {
                    (
                        _mm256_loadu_ps(x.add(kk + h)),
                        _mm256_loadu_ps(x.add(kk + h + 8)),
                    )
                };
                for j in 0..S {
                    // SAFETY: kk + h + 16 <= k: inside stream j's row.
                    let raw = unsafe { _mm256_loadu_si256(wr[j].add(kk + h).cast()) };
                    let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                    let wo = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                    acc[j] = _mm256_fmadd_ps(we, xe, acc[j]);
                    acco[j] = _mm256_fmadd_ps(wo, xo, acco[j]);
                }
            }
            kk += stepk;
        }
        for j in 0..S {
            let v = _mm256_add_ps(acc[j], acco[j]);
            let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let v = _mm_hadd_ps(v, v);
            let v = _mm_hadd_ps(v, v);
            out[j * len + i] = _mm_cvtss_f32(v);
        }
    }
}

/// Sums `len` bf16 from `p` as one stream (the value only keeps the loads alive).
///
/// # Safety
/// AVX2; `p..p + len` readable, `len` a multiple of 64.
#[target_feature(enable = "avx2")]
unsafe fn read1(p: *const u16, len: usize) -> __m256i {
    let mut a = [_mm256_setzero_si256(); 4];
    let mut i = 0;
    while i < len {
        for (j, acc) in a.iter_mut().enumerate() {
            // SAFETY: i + 16 * j + 16 <= len.
            *acc = _mm256_add_epi32(*acc, unsafe {
                _mm256_loadu_si256(p.add(i + 16 * j).cast())
            });
        }
        i += 64;
    }
    _mm256_add_epi32(_mm256_add_epi32(a[0], a[1]), _mm256_add_epi32(a[2], a[3]))
}

/// Sums `len` bf16 from `p` as four concurrent streams a quarter apart.
///
/// # Safety
/// AVX2; `p..p + len` readable, `len` a multiple of 64.
#[target_feature(enable = "avx2")]
unsafe fn read4(p: *const u16, len: usize) -> __m256i {
    let q = len / 4 / 16 * 16;
    let mut a = [_mm256_setzero_si256(); 4];
    let mut i = 0;
    while i + 32 <= q {
        for (j, acc) in a.iter_mut().enumerate() {
            // SAFETY: j * q + i + 32 <= len.
            unsafe {
                *acc = _mm256_add_epi32(*acc, _mm256_loadu_si256(p.add(j * q + i).cast()));
                *acc = _mm256_add_epi32(*acc, _mm256_loadu_si256(p.add(j * q + i + 16).cast()));
            }
        }
        i += 32;
    }
    // SAFETY: the rest of the range.
    let rest = unsafe { read1(p.add(4 * q), (len - 4 * q) / 64 * 64) };
    _mm256_add_epi32(
        rest,
        _mm256_add_epi32(_mm256_add_epi32(a[0], a[1]), _mm256_add_epi32(a[2], a[3])),
    )
}

use std::arch::x86_64::*;

struct Mat {
    n: usize,
    k: usize,
    w: &'static [bf16],
    /// The same matrix in the paired layout.
    paired: &'static [bf16],
    tiles: Vec<std::ops::Range<usize>>,
}

fn main() {
    let layers: usize = common::arg("--layers").map_or(6, |s| s.parse().expect("--layers"));
    let reps: usize = common::arg("--reps").map_or(10, |s| s.parse().expect("--reps"));
    let threads: usize = common::arg("--threads").map_or(2, |s| s.parse().expect("--threads"));
    let head = std::env::args().any(|a| a == "--head");
    let wall = std::env::args().any(|a| a == "--wall");
    assert!(
        is_x86_feature_detected!("avx2"),
        "gemv_b1 times AVX2 reads: this CPU has no AVX2"
    );
    let mut seed = 0x1234_5678_u64;
    let mut shapes: Vec<(usize, usize)> = (0..layers).flat_map(|_| SHAPES).collect();
    if head {
        shapes.push((151_936, 1024));
    }
    let mats: Vec<Mat> = shapes
        .iter()
        .map(|&(n, k)| {
            let w = common::huge_pool(n * k);
            for d in w.iter_mut() {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *d = bf16::from_f32(((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04);
            }
            let pw = pair_weights_bf16(w, n, k);
            let paired = common::huge_pool(pw.len());
            paired.copy_from_slice(&pw);
            Mat {
                n,
                k,
                w: &*w,
                paired: &*paired,
                tiles: tiles(n, 2 * k, threads),
            }
        })
        .collect();
    let bytes: usize = mats.iter().map(|m| m.n * m.k * 2).sum();
    let acts: Vec<(usize, Vec<f32>)> = [1024usize, 2048, 3072]
        .iter()
        .map(|&k| {
            let x: Vec<bf16> = (0..k)
                .map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5))
                .collect();
            let mut p = vec![0.0f32; packed_len(1, k)];
            pack_acts_bf16(&x, 1, k, &mut p);
            (k, p)
        })
        .collect();
    println!(
        "gemv_b1: {} matrices, {:.1} MB a pass, {threads} threads, timing by {}",
        mats.len(),
        bytes as f64 / 1e6,
        if wall {
            "wall clock"
        } else {
            "thread CPU time"
        }
    );
    // times[variant] = per pass: (max thread time, per-thread times, wall span)
    let vars = variants();
    // `--base I`: the variant the paired ratios divide by (default 0, the plain read).
    let base: usize = common::arg("--base").map_or(0, |s| s.parse().expect("--base"));
    let mut times: Vec<Vec<(f64, Vec<f64>, f64)>> = vec![Vec::new(); vars.len()];
    for r in 0..reps {
        let order: Vec<usize> = if r % 2 == 0 {
            (0..vars.len()).collect()
        } else {
            (0..vars.len()).rev().collect()
        };
        for v in order {
            times[v].push(pass(&mats, &acts, threads, vars[v], wall));
        }
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (i, v) in vars.iter().enumerate() {
        let t: Vec<f64> = times[i].iter().map(|x| x.0).collect();
        let ratio: Vec<f64> = times[i]
            .iter()
            .zip(&times[base])
            .map(|(a, b)| a.0 / b.0)
            .collect();
        let imbalance: Vec<f64> = times[i]
            .iter()
            .map(|x| {
                let mx = x.1.iter().copied().fold(0.0, f64::max);
                let mn = x.1.iter().copied().fold(f64::MAX, f64::min);
                mx / mn
            })
            .collect();
        let span: Vec<f64> = times[i].iter().map(|x| x.2).collect();
        let best = t.iter().copied().fold(f64::MAX, f64::min);
        println!(
            "{v:?}: median {:.2} ms ({:.1} GB/s), best {:.2} ms ({:.1} GB/s), /base median {:.3} [{:.3}..{:.3}], slowest/fastest thread {:.3}, wall span median {:.2} ms",
            med(t.clone()) * 1e3,
            bytes as f64 / med(t.clone()) / 1e9,
            best * 1e3,
            bytes as f64 / best / 1e9,
            med(ratio.clone()),
            ratio.iter().copied().fold(f64::MAX, f64::min),
            ratio.iter().copied().fold(0.0, f64::max),
            med(imbalance),
            med(span) * 1e3,
        );
    }
}

/// One pass of `v` over every matrix; the slowest thread's time, every thread's, and the wall
/// span from the barrier to the last thread's end.
fn pass(
    mats: &[Mat],
    acts: &[(usize, Vec<f32>)],
    threads: usize,
    v: Variant,
    wall: bool,
) -> (f64, Vec<f64>, f64) {
    let barrier = Barrier::new(threads);
    let t0 = Instant::now();
    let per: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || {
                    with_isa(Isa::detected(), || {
                        let mut out = vec![0.0f32; 8192];
                        let mut sink = 0i64;
                        barrier.wait();
                        let w0 = Instant::now();
                        let c0 = common::thread_cpu_seconds();
                        for m in mats {
                            let x = &acts.iter().find(|a| a.0 == m.k).expect("acts").1;
                            for tile in m.tiles.iter().skip(t).step_by(threads) {
                                match v {
                                    Variant::Read | Variant::Read4 => {
                                        let s = &m.w[tile.start * m.k..tile.end * m.k];
                                        // SAFETY: AVX2 is this example's premise (checked
                                        // below); the slice is readable and its length a
                                        // multiple of 64 (16 rows × K).
                                        let r = unsafe {
                                            if v == Variant::Read {
                                                read1(s.as_ptr().cast(), s.len())
                                            } else {
                                                read4(s.as_ptr().cast(), s.len())
                                            }
                                        };
                                        // SAFETY: any 256 bits are four valid i64.
                                        let l: [i64; 4] = unsafe { std::mem::transmute(r) };
                                        sink = sink.wrapping_add(l[0]);
                                    }
                                    Variant::Q(st, pf, hint) => {
                                        let (w, x) = (m.w.as_ptr().cast(), x.as_ptr());
                                        let tl = tile.clone();
                                        // SAFETY: AVX2 + FMA checked in main; the tile is
                                        // inside the matrix, 16 rows × K a multiple of 32.
                                        unsafe {
                                            match st {
                                                2 => gemv_q::<2>(w, m.k, tl, x, &mut out, pf, hint),
                                                4 => gemv_q::<4>(w, m.k, tl, x, &mut out, pf, hint),
                                                8 => gemv_q::<8>(w, m.k, tl, x, &mut out, pf, hint),
                                                16 => {
                                                    gemv_q::<16>(w, m.k, tl, x, &mut out, pf, hint)
                                                }
                                                _ => panic!("streams 2, 4, 8 or 16"),
                                            }
                                        }
                                    }
                                    Variant::Gemm | Variant::GemmPairs => {
                                        let tl = GemmTile {
                                            n: tile.clone(),
                                            k: 0..m.k,
                                            mode: OutMode::Store,
                                        };
                                        let wv = if v == Variant::Gemm {
                                            WeightsBf16::new(m.w, m.n, m.k)
                                        } else {
                                            WeightsBf16::paired(m.paired, m.n, m.k)
                                        };
                                        gemm_bf16(
                                            wv,
                                            PackedActs::new(x, 1, m.k),
                                            &tl,
                                            &mut out,
                                            tile.len(),
                                        );
                                    }
                                }
                            }
                        }
                        let dt = if wall {
                            w0.elapsed().as_secs_f64()
                        } else {
                            common::thread_cpu_seconds() - c0
                        };
                        std::hint::black_box((&out, sink));
                        dt
                    })
                    .expect("isa")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let span = t0.elapsed().as_secs_f64();
    (per.iter().copied().fold(0.0, f64::max), per, span)
}
