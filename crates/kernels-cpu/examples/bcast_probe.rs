//! TEMPORARY probe: batch-16 bf16 product, current dot passes against a broadcast kernel on
//! 8-row × k-pair interleaved weights.
use std::arch::asm;
use std::arch::x86_64::*;
use std::time::Instant;

use half::bf16;
use simpler_kernels_cpu::{GemmTile, OutMode, PackedActs, WeightsBf16, gemm_bf16, pack_acts_bf16, packed_len};

#[repr(align(32))]
struct Mask([u32; 8]);
static ODD_MASK: Mask = Mask([0xFFFF_0000; 8]);

macro_rules! bc4 {
    ($xd:literal) => {
        concat!(
            "vbroadcastss ymm15, [{x0} + {c} + ", $xd, "]\n",
            "vfmadd231ps ymm0, ymm12, ymm15\n",
            "vfmadd231ps ymm4, ymm13, ymm15\n",
            "vfmadd231ps ymm8, ymm14, ymm15\n",
            "vbroadcastss ymm15, [{x1} + {c} + ", $xd, "]\n",
            "vfmadd231ps ymm1, ymm12, ymm15\n",
            "vfmadd231ps ymm5, ymm13, ymm15\n",
            "vfmadd231ps ymm9, ymm14, ymm15\n",
            "vbroadcastss ymm15, [{x2} + {c} + ", $xd, "]\n",
            "vfmadd231ps ymm2, ymm12, ymm15\n",
            "vfmadd231ps ymm6, ymm13, ymm15\n",
            "vfmadd231ps ymm10, ymm14, ymm15\n",
            "vbroadcastss ymm15, [{x3} + {c} + ", $xd, "]\n",
            "vfmadd231ps ymm3, ymm12, ymm15\n",
            "vfmadd231ps ymm7, ymm13, ymm15\n",
            "vfmadd231ps ymm11, ymm14, ymm15\n",
        )
    };
}
macro_rules! pair {
    ($wd:literal, $xe:literal, $xo:literal) => {
        concat!(
            "vmovdqu ymm12, [{g0} + {c}*4 + ", $wd, "]\n", "vpslld ymm12, ymm12, 16\n",
            "vmovdqu ymm13, [{g1} + {c}*4 + ", $wd, "]\n", "vpslld ymm13, ymm13, 16\n",
            "vmovdqu ymm14, [{g2} + {c}*4 + ", $wd, "]\n", "vpslld ymm14, ymm14, 16\n",
            bc4!($xe),
            "vmovdqa ymm12, [rip + {mask}]\n",
            "vpand ymm13, ymm12, [{g1} + {c}*4 + ", $wd, "]\n",
            "vpand ymm14, ymm12, [{g2} + {c}*4 + ", $wd, "]\n",
            "vpand ymm12, ymm12, [{g0} + {c}*4 + ", $wd, "]\n",
            bc4!($xo),
        )
    };
}

/// 24 rows (3 groups at g[0..3], each ending pointer) × 4 batch rows (x ends), `k` elements
/// (multiple of 4).
#[target_feature(enable = "avx2,fma")]
unsafe fn kern(g: [*const u16; 3], x: [*const f32; 4], k: usize, out: &mut [__m256; 12]) {
    let mut a = [_mm256_setzero_ps(); 12];
    let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7, mut a8, mut a9, mut a10, mut a11] = a;
    unsafe {
        asm!(
            "2:",
            "prefetcht0 [{g0} + {c}*4 + 1024]",
            "prefetcht0 [{g1} + {c}*4 + 1024]",
            "prefetcht0 [{g2} + {c}*4 + 1024]",
            pair!("0", "0", "4"),
            pair!("32", "8", "12"),
            "add {c}, 16",
            "jnz 2b",
            c = inout(reg) -((k * 4) as isize) => _,
            g0 = in(reg) g[0], g1 = in(reg) g[1], g2 = in(reg) g[2],
            x0 = in(reg) x[0], x1 = in(reg) x[1], x2 = in(reg) x[2], x3 = in(reg) x[3],
            mask = sym ODD_MASK,
            inout("ymm0") a0, inout("ymm1") a1, inout("ymm2") a2, inout("ymm3") a3,
            inout("ymm4") a4, inout("ymm5") a5, inout("ymm6") a6, inout("ymm7") a7,
            inout("ymm8") a8, inout("ymm9") a9, inout("ymm10") a10, inout("ymm11") a11,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack, readonly),
        );
    }
    a = [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11];
    *out = a;
}

fn interleave(w: &[bf16], n: usize, k: usize) -> Vec<u16> {
    let mut p = vec![0u16; n * k];
    for r in 0..n {
        for c in 0..k {
            p[((r / 8) * (k / 2) + c / 2) * 16 + (r % 8) * 2 + c % 2] = w[r * k + c].to_bits();
        }
    }
    p
}

/// out[b * n + r] for all rows, batch 16.
fn bcast_gemm(p: &[u16], n: usize, k: usize, x: &[f32], out: &mut [f32]) {
    let gl = k * 8; // u16 per group
    for n0 in (0..n).step_by(24) {
        let g: [*const u16; 3] = std::array::from_fn(|i| p[(n0 / 8 + i) * gl..].as_ptr().wrapping_add(gl));
        for b0 in (0..16).step_by(4) {
            let xs: [*const f32; 4] = std::array::from_fn(|i| x[(b0 + i) * k..].as_ptr().wrapping_add(k));
            let mut acc = [unsafe { _mm256_setzero_ps() }; 12];
            unsafe { kern(g, xs, k, &mut acc) };
            for nv in 0..3 {
                for b in 0..4 {
                    let o = &mut out[(b0 + b) * n + n0 + nv * 8..][..8];
                    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc[nv * 4 + b]) };
                }
            }
        }
    }
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let (n, k, mats, reps) = (args[0], args[1], args[2], args[3]);
    assert!(n % 24 == 0 && k % 4 == 0);
    let batch = 16;
    let ws: Vec<Vec<bf16>> = (0..mats)
        .map(|m| (0..n * k).map(|i| bf16::from_f32(((i * 7 + m * 13) % 101) as f32 / 101.0 - 0.5)).collect())
        .collect();
    let ps: Vec<Vec<u16>> = ws.iter().map(|w| interleave(w, n, k)).collect();
    let xr: Vec<bf16> = (0..batch * k).map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5)).collect();
    let xf: Vec<f32> = xr.iter().map(|v| v.to_f32()).collect();
    let mut packed = vec![0.0f32; packed_len(batch, k)];
    pack_acts_bf16(&xr, batch, k, &mut packed);
    let acts = PackedActs::new(&packed, batch, k);
    let mut o1 = vec![0.0f32; batch * n];
    let mut o2 = vec![0.0f32; batch * n];
    let tile = GemmTile { n: 0..n, k: 0..k, mode: OutMode::Store };
    // check
    gemm_bf16(WeightsBf16::new(&ws[0], n, k), acts, &tile, &mut o1, n);
    bcast_gemm(&ps[0], n, k, &xf, &mut o2);
    let md = o1.iter().zip(&o2).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    println!("max diff {md}");
    let flops = 2.0 * (batch * n * k * mats) as f64;
    let mut t = [Vec::new(), Vec::new()];
    for _ in 0..reps {
        for v in [0, 1, 1, 0] {
            let s = Instant::now();
            for m in 0..mats {
                if v == 0 {
                    gemm_bf16(WeightsBf16::new(&ws[m], n, k), acts, &tile, &mut o1, n);
                } else {
                    bcast_gemm(&ps[m], n, k, &xf, &mut o2);
                }
            }
            t[v].push(s.elapsed().as_secs_f64());
        }
    }
    for v in 0..2 {
        t[v].sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("{}: median {:.1} GFLOP/s best {:.1}", ["dot", "bcast"][v], flops / t[v][t[v].len() / 2] / 1e9, flops / t[v][0] / 1e9);
    }
}
