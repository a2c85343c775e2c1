//! The spec's tolerances (`03-qwen3.md`, "Goldens and tolerances") and the comparisons that
//! apply them.

/// How well two tensors agree.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Agreement {
    /// Elements compared.
    pub n: usize,
    /// Elements within the tolerance.
    pub within: usize,
    /// Largest `|a - e|`.
    pub max_abs: f32,
    /// Index of the worst element (largest excess over the tolerance).
    pub worst: usize,
}

impl Agreement {
    /// Share of elements within the tolerance.
    pub fn fraction(&self) -> f64 {
        if self.n == 0 {
            1.0
        } else {
            self.within as f64 / self.n as f64
        }
    }
}

/// A `|a - e| <= atol + rtol |e|` tolerance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Relative part.
    pub rtol: f32,
    /// Absolute part.
    pub atol: f32,
    /// Share of elements that must be within (1.0: all).
    pub min_fraction: f64,
}

impl Tolerance {
    /// The 40-layer stack: rtol 5e-2, atol 1e-1, every element.
    pub const STACK: Tolerance = Tolerance {
        rtol: 5e-2,
        atol: 1e-1,
        min_fraction: 1.0,
    };
    /// One layer: `|a - e| <= 3e-3 + 3e-3 |e|` for at least 98% of elements.
    pub const ONE_LAYER: Tolerance = Tolerance {
        rtol: 3e-3,
        atol: 3e-3,
        min_fraction: 0.98,
    };
    /// Attention alone vs an fp32 softmax reference: rtol 5e-3, atol 2e-2.
    pub const ATTENTION: Tolerance = Tolerance {
        rtol: 5e-3,
        atol: 2e-2,
        min_fraction: 1.0,
    };

    /// Compares `actual` with `expected` (NaN anywhere counts as outside).
    pub fn compare(&self, actual: &[f32], expected: &[f32]) -> Agreement {
        let mut ag = Agreement {
            n: actual.len().max(expected.len()),
            within: 0,
            max_abs: 0.0,
            worst: 0,
        };
        let mut worst_excess = f32::NEG_INFINITY;
        for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            let diff = (a - e).abs();
            let excess = if diff.is_nan() {
                f32::INFINITY
            } else {
                diff - (self.atol + self.rtol * e.abs())
            };
            if excess <= 0.0 {
                ag.within += 1;
            }
            if diff > ag.max_abs || diff.is_nan() {
                ag.max_abs = diff;
            }
            if excess > worst_excess {
                worst_excess = excess;
                ag.worst = i;
            }
        }
        ag
    }

    /// `Ok` when enough elements agree (and the lengths match); else a message naming the
    /// worst element.
    pub fn check(&self, what: &str, actual: &[f32], expected: &[f32]) -> Result<Agreement, String> {
        if actual.len() != expected.len() {
            return Err(format!(
                "{what}: {} elements vs {} expected",
                actual.len(),
                expected.len()
            ));
        }
        let ag = self.compare(actual, expected);
        if ag.fraction() >= self.min_fraction {
            Ok(ag)
        } else {
            Err(format!(
                "{what}: {:.3}% within |a-e| <= {} + {}|e| (need {:.1}%); worst [{}]: {} vs {}",
                100.0 * ag.fraction(),
                self.atol,
                self.rtol,
                100.0 * self.min_fraction,
                ag.worst,
                actual[ag.worst],
                expected[ag.worst]
            ))
        }
    }
}

/// The full-model check: argmax identical for every row.
pub fn check_argmax(actual: &[u32], expected: &[u32]) -> Result<(), String> {
    if actual.len() != expected.len() {
        return Err(format!(
            "{} tokens vs {} expected",
            actual.len(),
            expected.len()
        ));
    }
    match actual.iter().zip(expected).position(|(a, e)| a != e) {
        None => Ok(()),
        Some(i) => Err(format!(
            "row {i}: argmax {} vs {} expected",
            actual[i], expected[i]
        )),
    }
}
