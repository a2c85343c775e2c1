//! Branch-free scalar math the compiler can vectorise: `exp` for softmax and SiLU.

/// `e^x` to within ~2 ulp for `x` in `[-87, 88]`, clamped outside (so `-inf` gives ~1e-38,
/// which a softmax multiplies by zero). Cody–Waite reduction `x = n ln2 + f`, a degree-6
/// polynomial for `e^f`, and `2^n` built from exponent bits.
#[inline(always)]
pub(crate) fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5 · 2^23 rounds `x · log2 e` (|·| < 2^22) to the nearest integer, ties to even,
    // and leaves that integer in the low mantissa bits: `n` and `2^n` without a float-to-int
    // conversion, so the body vectorises (Rust's saturating `as i32` does not).
    const ROUNDER: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUNDER;
    let n = t - ROUNDER;
    let f = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0 / 720.0;
    let p = p * f + 1.0 / 120.0;
    let p = p * f + 1.0 / 24.0;
    let p = p * f + 1.0 / 6.0;
    let p = p * f + 0.5;
    let p = p * f + 1.0;
    let p = p * f + 1.0;
    // n in [-126, 127]: a normal power of two (t's bits are those of 1.5 · 2^23 plus n).
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUNDER.to_bits() - 127) << 23);
    p * scale
}

#[cfg(test)]
mod tests {
    use super::exp_approx;

    #[test]
    fn exp_approx_is_close_to_std() {
        let mut worst = 0.0f32;
        let mut x = -80.0f32;
        while x < 80.0 {
            let (a, e) = (exp_approx(x), x.exp());
            worst = worst.max((a - e).abs() / e);
            x += 0.0137;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert!(exp_approx(f32::NEG_INFINITY) < 1e-37);
        assert_eq!(exp_approx(0.0), 1.0);
    }
}
