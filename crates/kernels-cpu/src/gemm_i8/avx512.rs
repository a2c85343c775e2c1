//! 512-bit int8 paths: AVX-512 VNNI `vpdpbusd` (weights offset by +128, removed with the
//! activation rows' sums taken once per call) and the wide product in 512-bit registers.
//! Blocks of weight rows × batch rows, every accumulator in one of the 32 registers.

use std::arch::x86_64::*;

use super::{Lowered, LoweredWide, PACK_ROWS, QUAD, WithActSums};
use crate::gemm::OutMode;
use crate::simd::{prefetch_l1, prefetch_l2};

/// Weight rows per W8A8 block: 24 accumulators at 8 batch rows (more independent
/// `vpdpbusd` chains than the instruction's latency needs), 3 offset weight vectors and the
/// offset constant within 32 registers; each activation vector is used three times.
const R: usize = 3;
/// Most batch rows per W8A8 block: the decode batch of 8 in one pass over the weights.
const B: usize = 8;
/// Weight rows and batch rows per wide block.
const R_WIDE: usize = 4;
const B_WIDE: usize = 4;
/// Bytes of `k` per step.
const STEP: usize = 64;

/// W8A8 with 512-bit `vpdpbusd` over a tile's `k` segments.
///
/// # Safety
/// AVX-512 F/BW/VNNI available; `segs` (at least one) checked by `gemm_i8_w8a8`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn gemm(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    let lo: Vec<WithActSums<'_, '_>> = segs.iter().map(|s| WithActSums::new(s, STEP)).collect();
    drive!(&lo, out, ld_out, R, B, STEP, block_vnni, 0i32);
}

/// `sums[r][b]` = the body of rows `n0 + r` × batch rows `b0 + b`: `sum (w + 128) a` minus
/// `128 sum a`, wrapping in i32 (the true value is in range, so the wrap cancels).
///
/// # Safety
/// AVX-512 F/BW/VNNI available; the rows lie inside the tile of a checked `lw`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
unsafe fn block_vnni<const RR: usize, const BB: usize>(
    lo: &WithActSums<'_, '_>,
    n0: usize,
    b0: usize,
    sums: &mut [[i32; B]; R],
) {
    let lw = lo.lw;
    let steps = lw.k.len() / STEP;
    let k0 = lw.k.start;
    // Row-major: each row's steps follow one another; packed: a row's 64-byte chunks lie a
    // block (its group's rows × 64) apart, and `k0` is a multiple of 64 (`gemm_i8_w8a8`).
    let wp: [*const i8; RR] = std::array::from_fn(|r| lw.w_ptr(n0 + r, k0));
    let ws: [usize; RR] = std::array::from_fn(|r| lw.wa.chunk_stride(n0 + r));
    // The same rows of the next block; past the tile's end, the rows the caller streams next
    // (counted as if every block were whole, so the single-row blocks at the end continue
    // where the last whole block stopped), else this block's own.
    let pf: [(*const i8, usize); RR] = std::array::from_fn(|r| {
        if n0 + RR + r < lw.n.end {
            (lw.w_ptr(n0 + RR + r, k0), lw.wa.chunk_stride(n0 + RR + r))
        } else {
            lw.next
                .and_then(|nx| nx.row(n0 + R + r - lw.n.end, k0))
                .unwrap_or((wp[r], ws[r]))
        }
    });
    let ap: [*const i8; BB] = std::array::from_fn(|b| lw.a[(b0 + b) * lw.lda + k0..].as_ptr());
    let flip = _mm512_set1_epi8(i8::MIN);
    let mut acc = [[_mm512_setzero_si512(); BB]; RR];
    for s in 0..steps {
        let w: [__m512i; RR] = std::array::from_fn(|r| {
            // The same row of the next block, one block ahead (module docs of `gemm_i8`).
            prefetch_l2(pf[r].0.wrapping_add(s * pf[r].1));
            // SAFETY: `s * STEP + STEP <= k.len()` values of row `n0 + r` lie from each start
            // pointer, step `s` at `s * ws[r]` (contiguous when row-major; in whole chunks
            // of the row's group when packed), inside the weights (rows checked by the
            // caller).
            _mm512_xor_si512(
                unsafe { _mm512_loadu_si512(wp[r].add(s * ws[r]).cast()) },
                flip,
            )
        });
        for b in 0..BB {
            // SAFETY: as above.
            let a = unsafe { _mm512_loadu_si512(ap[b].add(s * STEP).cast()) };
            for r in 0..RR {
                acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], w[r], a);
            }
        }
    }
    for r in 0..RR {
        for b in 0..BB {
            sums[r][b] = _mm512_reduce_add_epi32(acc[r][b]).wrapping_sub(lo.offset(b0 + b));
        }
    }
}

/// Groups of 16 weight rows per lane-wise block: 16 accumulators at 8 batch rows. Three
/// groups measured slower at 8 rows (24 accumulators, 3 weight vectors and the broadcast
/// leave the compiler too few registers), one group a little slower at 4 to 8.
const G_LANES: usize = 2;

/// How far ahead in its own stream each group's load asks for its line into L1, bytes (four
/// lines). The L2 prefetch (the next pair's line, tens of KiB ahead) brings the weights up
/// from memory, but each load still waited for L2: at 8 batch rows over the FLASH `Wq_b`
/// (`[32768, 1024]`, from memory, interleaved A B B A passes in one process) one thread
/// streamed 9.1 → 9.9 GB/s (median) with this, two threads 18.6 → 20.4 (`Wo_b`'s `[4096,
/// 8192]`: 18.5 → 19.4) on a loaded host, and 11.2 → 12.2 one thread on a quieter one; two
/// lines ahead gained a little less, none of 64–384 bytes lost.
const L1_AHEAD: usize = 256;

/// W8A8 over interleaved weights ([`super::I8Layout::Interleaved`]): each 64-byte line of a
/// whole group is one quad of `k` of its 16 rows, so a `vpdpbusd` against the batch row's
/// quad broadcast to every lane adds to 16 outputs at once, and the sums come out with the
/// rows in the lanes: no horizontal sums per output, no transposes. Rows outside whole groups
/// of the view (a tile that starts or ends inside a group, the matrix's last short group) are
/// summed by the scalar loop. Every block of rows runs through every segment before the next,
/// so the weights stream once, group pair by group pair, and each step prefetches into L2 the
/// line as far into what the pair streams next: its next segment, or after its last the next
/// pair's first. (Prefetching the next pair's same segment instead, as a grouped `Wo_b` was
/// first run, reached 256 KiB ahead and left each segment's start to the hardware: the
/// kernel streamed 22–23 GB/s on 2 threads against 26 with the next segment.)
///
/// # Safety
/// AVX-512 F/BW/VNNI available; `segs` (at least one, the tile of a checked call with
/// interleaved weights, every segment starting on a whole quad) as `gemm_i8_w8a8` makes them.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn gemm_lanes(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    let lo: Vec<WithActSums<'_, '_>> = segs.iter().map(|s| WithActSums::new(s, QUAD)).collect();
    // Each segment's activation quads gathered quad-major (`[quad][batch row]` as i32), so a
    // step's broadcasts read one line from one pointer at fixed offsets: with a pointer per
    // batch row the loop ran out of general registers and reloaded six of them from the
    // stack every step.
    let quads: Vec<Vec<i32>> = lo.iter().map(|l| quad_major(l)).collect();
    let first = &segs[0];
    let rows = first.n.clone();
    let mut g_start = rows.start;
    while g_start < rows.end && !first.wa.whole_group_at(g_start) {
        g_start += 1;
    }
    let mut g_end = g_start;
    while g_end + PACK_ROWS <= rows.end && first.wa.whole_group_at(g_end) {
        g_end += PACK_ROWS;
    }
    for n in (rows.start..g_start.min(rows.end)).chain(g_end.max(g_start)..rows.end) {
        for lw in segs {
            for b in 0..lw.batch {
                let s = lw.dot(n, b, lw.k.clone());
                lw.finish(out, ld_out, n, b, s);
            }
        }
    }
    let mut n0 = g_start;
    while n0 < g_end {
        let gg = ((g_end - n0) / PACK_ROWS).min(G_LANES);
        let k_first = lo[0].k.start;
        for (i, (lo, qm)) in lo.iter().zip(&quads).enumerate() {
            // What this pair streams next: its next segment, or the next pair's first.
            let ahead = match segs.get(i + 1) {
                Some(nx) => (n0, nx.k.start),
                None => (n0 + gg * PACK_ROWS, k_first),
            };
            let tail = lo.k.start + lo.k.len() / QUAD * QUAD..lo.k.end;
            let mut b0 = 0;
            while b0 < lo.batch {
                let bb = (lo.batch - b0).min(8);
                let mut sums = [[[0i32; PACK_ROWS]; 8]; G_LANES];
                macro_rules! arms {
                    ($($b:literal)*) => {
                        match (gg, bb) {
                            $((G_LANES, $b) => lanes_block::<G_LANES, $b>(lo, qm, n0, ahead, b0, &mut sums),)*
                            $((_, $b) => lanes_block::<1, $b>(lo, qm, n0, ahead, b0, &mut sums),)*
                            _ => unreachable!("at most 8 batch rows per pass"),
                        }
                    };
                }
                // SAFETY: groups n0..n0 + 16 gg are whole groups inside the tile (found
                // above), batch rows b0..b0 + bb inside the batch; the features and the
                // segment's quad start come from the caller's contract.
                unsafe { arms!(1 2 3 4 5 6 7 8) };
                for (g, sg) in sums.iter().enumerate().take(gg) {
                    for (b, sb) in sg.iter().enumerate().take(bb) {
                        if tail.is_empty() {
                            // SAFETY: AVX-512 F by the caller's contract.
                            unsafe { finish16(lo, out, ld_out, n0 + g * PACK_ROWS, b0 + b, sb) };
                            continue;
                        }
                        for (r, &v) in sb.iter().enumerate() {
                            let n = n0 + g * PACK_ROWS + r;
                            let t = lo.dot(n, b0 + b, tail.clone());
                            let sum = v.wrapping_sub(lo.offset(b0 + b)).wrapping_add(t);
                            lo.finish(out, ld_out, n, b0 + b, sum);
                        }
                    }
                }
                b0 += bb;
            }
        }
        n0 += gg * PACK_ROWS;
    }
}

/// [`Lowered::finish`] of the 16 sums of rows `n..n + 16` (inside the tile) × batch row
/// `b`, `sums` without the offset yet: the same expression per lane (`sum as f32`, times the
/// row's scale, times the batch row's), so the same bits as the scalar finish.
///
/// # Safety
/// AVX-512 F available.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
unsafe fn finish16(
    lo: &WithActSums<'_, '_>,
    out: &mut [f32],
    ld_out: usize,
    n: usize,
    b: usize,
    sums: &[i32; PACK_ROWS],
) {
    let lw = lo.lw;
    // SAFETY: 16 i32 read from a 16-element array.
    let s = unsafe { _mm512_loadu_si512(sums.as_ptr().cast()) };
    let s = _mm512_sub_epi32(s, _mm512_set1_epi32(lo.offset(b)));
    let sw = &lw.sw[n..n + PACK_ROWS];
    // SAFETY: 16 f32 read from a 16-element slice.
    let v = _mm512_mul_ps(_mm512_cvtepi32_ps(s), unsafe {
        _mm512_loadu_ps(sw.as_ptr())
    });
    let v = _mm512_mul_ps(v, _mm512_set1_ps(lw.sa[b * lw.groups + lw.group]));
    let at = b * ld_out + (n - lw.n.start);
    let o = &mut out[at..at + PACK_ROWS];
    // SAFETY: 16 f32 read and written in a 16-element slice.
    unsafe {
        let v = match lw.mode {
            OutMode::Store => v,
            OutMode::Add => _mm512_add_ps(_mm512_loadu_ps(o.as_ptr()), v),
        };
        _mm512_storeu_ps(o.as_mut_ptr(), v);
    }
}

/// `sums[g][b][r]`: the body (whole quads) of row `n0 + 16 g + r` × batch row `b0 + b`, as
/// `sum (w + 128) a` (the caller removes the offset).
///
/// # Safety
/// AVX-512 F/BW/VNNI available; groups `n0..n0 + 16 GG` are whole interleaved groups inside
/// the tile of a checked `lo`, whose `k` starts on a whole quad; batch rows inside the batch.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
unsafe fn lanes_block<const GG: usize, const BB: usize>(
    lo: &WithActSums<'_, '_>,
    qm: &[i32],
    n0: usize,
    ahead: (usize, usize),
    b0: usize,
    sums: &mut [[[i32; PACK_ROWS]; 8]; G_LANES],
) {
    let lw = lo.lw;
    let quads = lw.k.len() / QUAD;
    let k0 = lw.k.start;
    // A whole group's quads are consecutive 64-byte lines from the quad of `k0`.
    let wp: [*const i8; GG] = std::array::from_fn(|g| lw.w_ptr(n0 + g * PACK_ROWS, k0));
    // The lines streamed after these (`ahead`: the groups and `k` the caller takes next) while
    // they lie in the tile and are whole (else this pair's own, already cached): only
    // prefetched, so a shorter next segment only prefetches past it.
    let pf: [*const i8; GG] = std::array::from_fn(|g| {
        let n = ahead.0 + g * PACK_ROWS;
        if n + PACK_ROWS <= lw.n.end && lw.wa.whole_group_at(n) {
            lw.w_ptr(n, ahead.1)
        } else {
            wp[g]
        }
    });
    let batch = lw.batch;
    assert!(b0 + BB <= batch && qm.len() == quads * batch);
    // Only dereferenced below at `q < quads` (an empty `qm` has no step).
    let ap = qm.as_ptr().wrapping_add(b0);
    let flip = _mm512_set1_epi8(i8::MIN);
    let mut acc = [[_mm512_setzero_si512(); BB]; GG];
    for q in 0..quads {
        let w: [__m512i; GG] = std::array::from_fn(|g| {
            prefetch_l2(pf[g].wrapping_add(q * 64));
            prefetch_l1(wp[g].wrapping_add(q * 64 + L1_AHEAD));
            // SAFETY: quad q of a whole group is 64 bytes at `q * 64` from the group's line
            // of `k0`, inside the weights (`q < quads`, the body within the tile's `k`).
            _mm512_xor_si512(
                unsafe { _mm512_loadu_si512(wp[g].add(q * 64).cast()) },
                flip,
            )
        });
        #[allow(clippy::needless_range_loop)] // `b` indexes the inner dimension of `acc` too
        for b in 0..BB {
            // SAFETY: quad `q` of batch row `b0 + b`: element `q * batch + b0 + b` of `qm`,
            // inside it (asserted above: `q < quads`, `b0 + b < batch`).
            let a = _mm512_set1_epi32(unsafe { *ap.add(q * batch + b) });
            for g in 0..GG {
                acc[g][b] = _mm512_dpbusd_epi32(acc[g][b], w[g], a);
            }
        }
    }
    for g in 0..GG {
        for b in 0..BB {
            // SAFETY: 16 i32 into a 16-element array.
            unsafe { _mm512_storeu_si512(sums[g][b].as_mut_ptr().cast(), acc[g][b]) };
        }
    }
}

/// The body quads of `lo`'s batch rows, quad-major: element `q * batch + b` holds bytes
/// `k0 + 4 q .. k0 + 4 q + 4` of batch row `b` (native byte order, as the kernel reads them).
fn quad_major(lo: &WithActSums<'_, '_>) -> Vec<i32> {
    let (k0, quads, batch) = (lo.k.start, lo.k.len() / QUAD, lo.batch);
    let mut qm = vec![0i32; quads * batch];
    for b in 0..batch {
        let row = &lo.a[b * lo.lda + k0..b * lo.lda + k0 + quads * QUAD];
        for (q, c) in row.chunks_exact(QUAD).enumerate() {
            qm[q * batch + b] =
                i32::from_ne_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]);
        }
    }
    qm
}

/// Wide product: 16 int8 widened to fp32 per step, FMA against fp32 rows.
///
/// # Safety
/// AVX-512 F available; `lw` checked by `gemm_i8_wide`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
pub(super) unsafe fn gemm_wide(lw: &LoweredWide<'_>, out: &mut [f32], ld_out: usize) {
    drive!(
        std::slice::from_ref(lw),
        out,
        ld_out,
        R_WIDE,
        B_WIDE,
        16,
        block_wide,
        0.0f32
    );
}

/// `sums[r][b]` of the body in steps of 16.
///
/// # Safety
/// AVX-512 F available; the rows lie inside the tile of a checked `lw`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
unsafe fn block_wide<const RR: usize, const BB: usize>(
    lw: &LoweredWide<'_>,
    n0: usize,
    b0: usize,
    sums: &mut [[f32; B_WIDE]; R_WIDE],
) {
    let steps = lw.k.len() / 16;
    let k0 = lw.k.start;
    let wp: [*const i8; RR] = std::array::from_fn(|r| lw.w[(n0 + r) * lw.ldw + k0..].as_ptr());
    let xp: [*const f32; BB] = std::array::from_fn(|b| lw.x[(b0 + b) * lw.ldx + k0..].as_ptr());
    let mut acc = [[_mm512_setzero_ps(); BB]; RR];
    for s in 0..steps {
        // SAFETY: `s * 16 + 16 <= k.len()` values lie after each start pointer.
        let x: [__m512; BB] =
            std::array::from_fn(|b| unsafe { _mm512_loadu_ps(xp[b].add(s * 16)) });
        for r in 0..RR {
            if s % 4 == 0 {
                // As in the W8A8 blocks: the next block's rows, a cache line per 64 bytes.
                prefetch_l2(wp[r].wrapping_add(RR * lw.ldw + s * 16));
            }
            // SAFETY: as above (16 bytes of the weight row).
            let w16 = unsafe { _mm_loadu_si128(wp[r].add(s * 16).cast()) };
            let wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(w16));
            for b in 0..BB {
                acc[r][b] = _mm512_fmadd_ps(wf, x[b], acc[r][b]);
            }
        }
    }
    for r in 0..RR {
        for b in 0..BB {
            sums[r][b] = _mm512_reduce_add_ps(acc[r][b]);
        }
    }
}
