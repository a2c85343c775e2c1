//! Branch-free scalar math the compiler can vectorise: `exp` for softmax and SiLU, `2^x` for
//! softmaxes that fold `log2 e` into their scale.

/// `e^x` to within ~3 ulp for `x` in `[-87, 88]` (under 4e-7 relative, as its test holds;
/// 2.53e-7 the worst of 20M points in `[-87, 0]`), clamped outside (so `-inf` gives ~1e-38,
/// which a softmax multiplies by zero). Cody–Waite reduction `x = n ln2 + f`, a degree-6
/// polynomial for `e^f`, and `2^n` built from exponent bits.
#[inline(always)]
pub(crate) fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Adding 1.5 · 2^23 rounds `x · log2 e` (|·| < 2^22) to the nearest integer, ties to even,
    // and leaves that integer in the low mantissa bits: `n` and `2^n` without a float-to-int
    // conversion, so the body vectorises (Rust's saturating `as i32` does not).
    const ROUNDER: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUNDER;
    let n = t - ROUNDER;
    let f = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let [c6, c5, c4, c3, c2, c1, c0] = EXP_COEFFS;
    let p = c6 * f + c5;
    let p = p * f + c4;
    let p = p * f + c3;
    let p = p * f + c2;
    let p = p * f + c1;
    let p = p * f + c0;
    // n in [-126, 127]: a normal power of two (t's bits are those of 1.5 · 2^23 plus n).
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUNDER.to_bits() - 127) << 23);
    p * scale
}

/// `ln 2` in two parts for [`exp_approx`]'s Cody–Waite reduction: `LN2_HI` has trailing zero
/// bits, so `n · LN2_HI` is exact for the `n` that occur.
pub(crate) const EXP_LN2_HI: f32 = 0.693_145_75;
/// The rest of `ln 2` below [`EXP_LN2_HI`].
pub(crate) const EXP_LN2_LO: f32 = 1.428_606_8e-6;

/// [`exp_approx`]'s Taylor coefficients of `e^f`, highest degree first (`1/6!` .. `1`); its
/// vector forms (`attention::avx2::exp256`, `attention::flash::exp512`) evaluate the same ones
/// in the same order.
pub(crate) const EXP_COEFFS: [f32; 7] = [
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// Checks a vector form of [`exp_approx`]: `eval` maps whole vectors of `lanes` inputs to their
/// `e^x` in place. Over `[-87, 88]` and past both clamps it must be within 4e-7 of `f64::exp`
/// at the clamped input and 3e-7 of `exp_approx`, and a NaN must stay NaN.
#[cfg(test)]
pub(crate) fn check_exp_form(name: &str, lanes: usize, eval: impl Fn(&mut [f32])) {
    let xs: Vec<f32> = (0..=7000)
        .map(|i| -87.0 + 175.0 * i as f32 / 7000.0)
        .chain([-1e30, -87.5, 88.5, 1e30, f32::NAN, f32::NEG_INFINITY, 0.0])
        .collect();
    for chunk in xs.chunks(lanes) {
        let mut v = vec![0.0f32; lanes];
        v[..chunk.len()].copy_from_slice(chunk);
        eval(&mut v);
        for (&x, &y) in chunk.iter().zip(&v) {
            if x.is_nan() {
                assert!(y.is_nan(), "{name}(NaN) = {y}");
                continue;
            }
            let c = f64::from(x.clamp(-87.0, 88.0));
            let want = c.exp();
            assert!(
                ((f64::from(y) - want) / want).abs() < 4e-7,
                "{name}({x}) = {y}, e^{c} = {want}"
            );
            let s = exp_approx(x);
            assert!(
                (y - s).abs() <= s * 3e-7,
                "{name}({x}) = {y}, exp_approx {s}"
            );
        }
    }
}

/// `2^x` for the softmax's exponents (`x <= 0`, or above 0 by a rounding), to ~2e-7 relative:
/// `x = n + f` with `n` the nearest integer, `2^f` a degree-5 fit on `[-1/2, 1/2]` (relative
/// error 1.8e-7 evaluated in fp32), `2^n` made in the exponent bits. Below -126 it is taken at
/// -126 (~1e-38, as good as zero next to the max's 1); a NaN stays NaN. With the exponent in
/// base 2 the range reduction is one exact subtraction (no two-part `ln 2`) and the
/// polynomial one degree shorter than `exp_approx`'s, for the same accuracy.
#[inline(always)]
pub(crate) fn exp2_approx(x: f32) -> f32 {
    // Adding 1.5 · 2^23 rounds `x` (|x| <= 126) to the nearest integer and leaves it in the low
    // mantissa bits (see `exp_approx`).
    let x = if x < -126.0 { -126.0 } else { x };
    let t = x + EXP2_ROUNDER;
    let n = t - EXP2_ROUNDER;
    let f = x - n;
    let [c5, c4, c3, c2, c1, c0] = EXP2_COEFFS;
    let p = c5 * f + c4;
    let p = p * f + c3;
    let p = p * f + c2;
    let p = p * f + c1;
    let p = p * f + c0;
    // n in [-126, 1]: a normal power of two.
    p * f32::from_bits(t.to_bits().wrapping_sub(EXP2_ROUNDER.to_bits() - 127) << 23)
}

/// 1.5 · 2^23: added to and taken from `x`, it rounds `x` to the nearest integer ([`exp2_approx`]).
pub(crate) const EXP2_ROUNDER: f32 = 12_582_912.0;

/// The coefficients of [`exp2_approx`]'s fit of `2^f` on `[-1/2, 1/2]`, highest degree first;
/// every vector form of it (`dsv4::attention::lanes`) evaluates the same ones in the same order.
// The fit's coefficient of degree 1, 3 ulp below ln 2 (the fit trades it against the others).
#[allow(clippy::approx_constant)]
pub(crate) const EXP2_COEFFS: [f32; 6] = [
    0.001_326_471_2,
    0.009_671_512,
    0.055_507_34,
    0.240_222_42,
    0.693_147,
    1.0,
];

#[cfg(test)]
mod tests {
    use super::{exp_approx, exp2_approx};

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

    #[test]
    fn exp2_approx_is_within_3e_7_of_exp2_over_the_softmax_range() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x <= 1e-3 {
            let want = f64::from(x).exp2();
            let got = f64::from(exp2_approx(x));
            worst = worst.max((got - want).abs() / want);
            x += 0.000_731;
        }
        // Every fraction of one binade, densely.
        for i in 0..=100_000 {
            let x = -3.0 + 3.0 * i as f32 / 100_000.0;
            let want = f64::from(x).exp2();
            worst = worst.max((f64::from(exp2_approx(x)) - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp2_approx(0.0), 1.0);
        assert!(exp2_approx(f32::NEG_INFINITY) < 1.2e-38);
        assert!(exp2_approx(f32::NAN).is_nan());
    }
}
