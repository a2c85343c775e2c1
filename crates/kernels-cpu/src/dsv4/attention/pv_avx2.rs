//! The value product `out[h, c] += Σ_j p[h, j] · rows[j, c]` on AVX2 (`super::pv_add`'s
//! contract): the same operations as the lane-blocked body (for each output element, from 0,
//! `acc = fma(p, row, acc)` in `j` order, then one add to `out`), so the results are the same
//! bits; only the blocking differs.
//!
//! Blocks of [`HEADS`] heads × 16 columns keep 12 accumulators in registers; per row `j` the
//! 16 bf16 values are widened once, in two operations (a shift for the even columns, a mask
//! for the odd ones; `block`), and each head's weight is one broadcast load from a per-block
//! copy of `P` widened to fp32 and laid out `[n, HEADS]` (made once per block of heads, read
//! by every column block). The compiled lane body spent four scalar instructions per head and
//! row widening and broadcasting `p` in the inner loop, reloaded pointers spilled to the
//! stack, and checked bounds per head. Widening each row by a zero-extension and a shift per
//! 8 values (four operations against two) made the FLASH attention phase 1.07–1.08× slower
//! (`docs/dsv4.md`).

use std::arch::x86_64::*;

use half::bf16;

/// Heads per block: 6 × 2 accumulators, the two widened row vectors, the broadcast weight and
/// the odd half's mask (or the zero register the compiler blends with) fill the 16 registers.
const HEADS: usize = 6;
/// Columns per block (two 8-lane vectors).
const COLS: usize = 16;

/// `out[h, c] += Σ_j p[h, j] · rows[j, c]` (module docs).
///
/// # Safety
/// AVX2 available; `p` holds `heads` rows of at least `n` values at stride `ld` (the last may
/// stop at `n`), `rows` is `[n, d]`, `out` is `[heads, d]`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn pv_add(
    p: &[u16],
    ld: usize,
    heads: usize,
    n: usize,
    rows: &[bf16],
    d: usize,
    out: &mut [f32],
) {
    let mut pw = vec![0.0f32; n * HEADS];
    let mut h0 = 0;
    while h0 < heads {
        let hb = HEADS.min(heads - h0);
        for j in 0..n {
            for h in 0..hb {
                pw[j * HEADS + h] = f32::from_bits(u32::from(p[(h0 + h) * ld + j]) << 16);
            }
        }
        let body = d / COLS * COLS;
        // SAFETY: heads `h0..h0 + hb` lie in `out`, `pw` holds `n` rows of `HEADS`, the
        // column blocks lie inside `d` (caller's contract; AVX2 available).
        unsafe {
            match hb {
                6 => block::<6>(&pw, n, rows, d, body, &mut out[h0 * d..]),
                5 => block::<5>(&pw, n, rows, d, body, &mut out[h0 * d..]),
                4 => block::<4>(&pw, n, rows, d, body, &mut out[h0 * d..]),
                3 => block::<3>(&pw, n, rows, d, body, &mut out[h0 * d..]),
                2 => block::<2>(&pw, n, rows, d, body, &mut out[h0 * d..]),
                _ => block::<1>(&pw, n, rows, d, body, &mut out[h0 * d..]),
            }
        }
        // The columns past the last whole block: the same operations, one element at a time.
        for h in 0..hb {
            for c in body..d {
                let mut acc = 0.0f32;
                for j in 0..n {
                    acc = pw[j * HEADS + h].mul_add(rows[j * d + c].to_f32(), acc);
                }
                out[(h0 + h) * d + c] += acc;
            }
        }
        h0 += hb;
    }
}

/// Heads `0..HB` of `out` (`[HB, d]` at least) over the columns `0..body` (a multiple of
/// [`COLS`]), weights `pw[j · HEADS + h]`.
///
/// Each row's 16 values are widened by halves where they lie: the even columns by a shift of
/// the 32-bit words, the odd ones by a mask; the accumulators hold the even and the odd
/// columns and are put back in column order once per block, before the add to `out`.
///
/// # Safety
/// AVX2 available; `pw` holds `n · HEADS` values, `rows` `n · d`, `out` `HB · d`,
/// `body <= d`.
#[target_feature(enable = "avx2,fma")]
unsafe fn block<const HB: usize>(
    pw: &[f32],
    n: usize,
    rows: &[bf16],
    d: usize,
    body: usize,
    out: &mut [f32],
) {
    assert!(pw.len() >= n * HEADS && rows.len() >= n * d && out.len() >= (HB - 1) * d + body);
    let rp = rows.as_ptr().cast::<u16>();
    let wp = pw.as_ptr();
    let high = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
    let mut c0 = 0;
    while c0 < body {
        let mut acc = [[_mm256_setzero_ps(); 2]; HB];
        for j in 0..n {
            // SAFETY: `j < n` and `c0 + 16 <= body <= d`: 16 values of row `j` (checked above).
            let v = unsafe { _mm256_loadu_si256(rp.add(j * d + c0).cast()) };
            let even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
            let odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            for (h, a) in acc.iter_mut().enumerate() {
                // SAFETY: `j · HEADS + h < n · HEADS` (checked above).
                let w = unsafe { _mm256_broadcast_ss(&*wp.add(j * HEADS + h)) };
                a[0] = _mm256_fmadd_ps(w, even, a[0]);
                a[1] = _mm256_fmadd_ps(w, odd, a[1]);
            }
        }
        for (h, a) in acc.iter().enumerate() {
            let lo = _mm256_unpacklo_ps(a[0], a[1]);
            let hi = _mm256_unpackhi_ps(a[0], a[1]);
            let first = _mm256_permute2f128_ps::<0x20>(lo, hi);
            let second = _mm256_permute2f128_ps::<0x31>(lo, hi);
            let o = &mut out[h * d + c0..h * d + c0 + COLS];
            // SAFETY: `o` holds 16 values.
            unsafe {
                let p = o.as_mut_ptr();
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), first));
                _mm256_storeu_ps(p.add(8), _mm256_add_ps(_mm256_loadu_ps(p.add(8)), second));
            }
        }
        c0 += COLS;
    }
}
