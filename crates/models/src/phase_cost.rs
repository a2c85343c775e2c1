//! The per-phase bound shared by every model's cost: a step is a sequence of phases in
//! dependency order (a phase cannot start before the one it depends on ends), each phase takes
//! at least the longest of its bytes at the machine's bandwidth, its float FLOPs at the matrix
//! peak of the path it runs on and its int8 operations at the int8 peak, and the phases add up.
//! `dsv4::cost` and `qwen3::cost` list their phases; the arithmetic lives here once.

/// One phase's compulsory traffic and work.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PhaseCost {
    /// Phase name (the timing slot's, or the table row's).
    pub name: &'static str,
    /// Bytes read or written once (weights, cache rows, activations crossing memory).
    pub bytes: f64,
    /// Float FLOPs (2 per multiply-add) of matrix products and attention.
    pub flops: f64,
    /// int8 operations (2 per multiply-add).
    pub int8_ops: f64,
}

/// The machine's denominators for one phase.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peaks {
    /// Streaming read bandwidth, GB/s.
    pub gbs: f64,
    /// Float peak of the path the phase's products run on, GFLOP/s.
    pub gflops: f64,
    /// int8 dot-product peak, GOP/s.
    pub int8_gops: f64,
}

/// What holds a phase at its bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// Its bytes at the bandwidth.
    Bandwidth,
    /// Its float FLOPs at the float peak.
    Float,
    /// Its int8 operations at the int8 peak.
    Int8,
}

impl Limit {
    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Limit::Bandwidth => "bandwidth",
            Limit::Float => "float",
            Limit::Int8 => "int8",
        }
    }
}

impl PhaseCost {
    /// Seconds of the phase at the machine's limits (the longest of its bytes, FLOPs and int8
    /// operations at their rates), and which of them binds. Work with no rate (a zero peak)
    /// does not bound: the caller measured no path for it.
    pub fn bound(&self, m: &Peaks) -> (f64, Limit) {
        let at = |work: f64, rate: f64| {
            if work > 0.0 && rate > 0.0 {
                work / (rate * 1e9)
            } else {
                0.0
            }
        };
        let bw = at(self.bytes, m.gbs);
        let fl = at(self.flops, m.gflops);
        let i8 = at(self.int8_ops, m.int8_gops);
        if fl > bw && fl >= i8 {
            (fl, Limit::Float)
        } else if i8 > bw {
            (i8, Limit::Int8)
        } else {
            (bw, Limit::Bandwidth)
        }
    }

    /// Seconds of the phase at the machine's limits ([`PhaseCost::bound`]).
    pub fn bound_s(&self, m: &Peaks) -> f64 {
        self.bound(m).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Peaks = Peaks {
        gbs: 10.0,
        gflops: 100.0,
        int8_gops: 400.0,
    };

    #[test]
    fn a_phase_takes_its_slowest_resource() {
        // 1 GB at 10 GB/s = 0.1 s against 1 GFLOP at 100 GFLOP/s = 0.01 s.
        let streaming = PhaseCost {
            name: "gemv",
            bytes: 1e9,
            flops: 1e9,
            int8_ops: 0.0,
        };
        assert_eq!(streaming.bound(&M), (0.1, Limit::Bandwidth));
        // 1 MB (0.1 ms) against 100 GFLOP (1 s).
        let dense = PhaseCost {
            bytes: 1e6,
            flops: 1e11,
            ..streaming
        };
        assert_eq!(dense.bound(&M), (1.0, Limit::Float));
        // 80 G int8 operations at 400 GOP/s = 0.2 s, over the bytes' 0.1 s.
        let int8 = PhaseCost {
            flops: 0.0,
            int8_ops: 8e10,
            ..streaming
        };
        assert_eq!(int8.bound(&M), (0.2, Limit::Int8));
    }

    #[test]
    fn work_without_a_measured_rate_does_not_bound() {
        let p = PhaseCost {
            name: "x",
            bytes: 1e9,
            flops: 1e12,
            int8_ops: 1e12,
        };
        let m = Peaks {
            gflops: 0.0,
            int8_gops: 0.0,
            ..M
        };
        assert_eq!(p.bound(&m), (0.1, Limit::Bandwidth));
    }
}
