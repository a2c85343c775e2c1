//! Small statistics shared by the analyses: median, nearest-rank percentiles, trimmed mean and
//! the Student t quantile for 95% intervals.

/// Median of `xs` (mean of the two middle values for an even count); NaN when empty.
pub(crate) fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let s = sorted(xs);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Arithmetic mean; NaN when empty.
pub(crate) fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        f64::NAN
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Sample standard deviation (n - 1); 0 for fewer than two values.
pub(crate) fn std_dev(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    let ss: f64 = xs.iter().map(|x| (x - m) * (x - m)).sum();
    (ss / (xs.len() - 1) as f64).sqrt()
}

/// Mean after dropping `floor(fraction * n)` values from each end of the sorted sample.
pub(crate) fn trimmed_mean(xs: &[f64], fraction: f64) -> f64 {
    let s = sorted(xs);
    let k = (fraction * s.len() as f64).floor() as usize;
    if s.len() <= 2 * k {
        return median(xs);
    }
    mean(&s[k..s.len() - k])
}

/// Nearest-rank percentile of an already sorted slice: the smallest value with at least `p`%
/// of the sample at or below it (`p` in 0..=100). `None` when empty.
pub(crate) fn percentile_sorted<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// `xs` sorted ascending (NaNs last).
pub(crate) fn sorted(xs: &[f64]) -> Vec<f64> {
    let mut s = xs.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s
}

/// Two-sided 97.5% quantile of Student's t distribution with `df` degrees of freedom.
///
/// Exact table values (3 decimals) up to 30 degrees of freedom, then the Cornish-Fisher
/// expansion around the normal quantile (error below 1e-4 there).
pub(crate) fn t_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    if df == 0 {
        return f64::NAN;
    }
    if df <= 30 {
        return TABLE[df - 1];
    }
    let z: f64 = 1.959_963_985;
    let v = df as f64;
    let (z3, z5, z7) = (z.powi(3), z.powi(5), z.powi(7));
    z + (z3 + z) / (4.0 * v)
        + (5.0 * z5 + 16.0 * z3 + 3.0 * z) / (96.0 * v * v)
        + (3.0 * z7 + 19.0 * z5 + 17.0 * z3 - 15.0 * z) / (384.0 * v * v * v)
}

/// A deterministic SplitMix64 generator for the seeded bootstrap.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0), by 128-bit multiply (bias below 2^-64 * n).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// Formats nanoseconds as microseconds with one decimal.
pub(crate) fn us(ns: f64) -> String {
    if ns.is_nan() {
        "-".to_string()
    } else {
        format!("{:.1}", ns / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(mean(&[1.0, 2.0, 6.0]), 3.0);
        let xs: Vec<f64> = (1..=10).map(f64::from).collect();
        // 10%: drop 1 from each end -> mean of 2..=9.
        assert_eq!(
            trimmed_mean(&[100.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, -50.0], 0.1),
            5.5
        );
        assert_eq!(percentile_sorted(&xs, 50.0), Some(5.0));
        assert_eq!(percentile_sorted(&xs, 90.0), Some(9.0));
        assert_eq!(percentile_sorted(&xs, 99.0), Some(10.0));
        assert_eq!(percentile_sorted(&xs, 10.0), Some(1.0));
        assert_eq!(percentile_sorted::<u64>(&[], 10.0), None);
        assert!((std_dev(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]) - 2.138_089_935).abs() < 1e-6);
    }

    #[test]
    fn t_quantiles() {
        assert_eq!(t_975(1), 12.706);
        assert_eq!(t_975(30), 2.042);
        assert!((t_975(40) - 2.021).abs() < 1e-3);
        assert!((t_975(120) - 1.980).abs() < 1e-3);
        assert!((t_975(100_000) - 1.960).abs() < 1e-3);
    }

    #[test]
    fn rng_is_seeded_and_in_range() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..100 {
            let x = a.below(13);
            assert_eq!(x, b.below(13));
            assert!(x < 13);
        }
    }
}
