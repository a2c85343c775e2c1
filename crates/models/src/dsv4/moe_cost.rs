//! What one MoE decode step must move and compute, phase by phase (`docs/dsv4.md`, "MoE on the
//! runtime"): the numerators of its per-phase bound. Each phase is bounded by the slowest of
//! its bytes at the machine's bandwidth, its int8 operations at the int8 peak and its fp32
//! FLOPs at the FMA peak; phases follow each other in dependency order, so the step's bound is
//! their sum. Only experts that received a row count: an expert without a token costs nothing.

use super::config::Dsv4Config;

/// One phase's work.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseCost {
    /// Phase name.
    pub name: &'static str,
    /// Bytes read or written (weights streamed once, activations).
    pub bytes: f64,
    /// int8 operations (2 per multiply-add).
    pub int8_ops: f64,
    /// fp32 FLOPs (2 per multiply-add).
    pub flops: f64,
}

/// The machine limits a bound divides by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Streaming read bandwidth, GB/s.
    pub gbs: f64,
    /// int8 dot-product peak of the path the GEMM takes, GOP/s.
    pub int8_gops: f64,
    /// fp32 FMA peak, GFLOP/s.
    pub fma_gflops: f64,
}

impl PhaseCost {
    /// The phase's bound in seconds: the slowest of its three demands.
    pub fn bound_s(&self, l: &Limits) -> f64 {
        let t = |work: f64, rate: f64| if rate > 0.0 { work / (rate * 1e9) } else { 0.0 };
        t(self.bytes, l.gbs)
            .max(t(self.int8_ops, l.int8_gops))
            .max(t(self.flops, l.fma_gflops))
    }

    /// What binds the phase under `l`.
    pub fn binding(&self, l: &Limits) -> &'static str {
        let t = |work: f64, rate: f64| if rate > 0.0 { work / (rate * 1e9) } else { 0.0 };
        let (b, i, f) = (
            t(self.bytes, l.gbs),
            t(self.int8_ops, l.int8_gops),
            t(self.flops, l.fma_gflops),
        );
        if b >= i && b >= f {
            "bandwidth"
        } else if i >= f {
            "int8"
        } else {
            "fp32"
        }
    }
}

/// The phases of one MoE step of `tokens` rows whose local experts received `rows_per_expert`
/// rows each (the shared experts get every token).
pub fn moe_step_phases(c: &Dsv4Config, tokens: usize, rows_per_expert: &[usize]) -> Vec<PhaseCost> {
    let (t, d, i, hc) = (
        tokens as f64,
        c.hidden as f64,
        c.moe_inter_dim as f64,
        c.hc_mult as f64,
    );
    let (e, k, s) = (
        c.n_routed_experts as f64,
        c.n_activated_experts as f64,
        c.n_shared_experts as f64,
    );
    let m = c.hc_mix() as f64;
    let routed_rows: f64 = rows_per_expert.iter().map(|&r| r as f64).sum();
    let hit = rows_per_expert.iter().filter(|&&r| r > 0).count() as f64;
    let experts = hit + s;
    let rows = routed_rows + s * t;
    vec![
        PhaseCost {
            name: "hc_pre",
            bytes: 4.0 * (m * hc * d + t * hc * d + t * d),
            int8_ops: 0.0,
            flops: 2.0 * t * m * hc * d,
        },
        PhaseCost {
            name: "route",
            bytes: 4.0 * (e * d + t * d) + t * d,
            int8_ops: 0.0,
            flops: 2.0 * t * e * d,
        },
        PhaseCost {
            name: "dispatch",
            bytes: 2.0 * t * k * d,
            int8_ops: 0.0,
            flops: 0.0,
        },
        PhaseCost {
            name: "experts gate/up",
            bytes: experts * (2.0 * i * d + 8.0 * i) + rows * (d + 4.0 * i),
            int8_ops: 2.0 * rows * 2.0 * i * d,
            flops: 0.0,
        },
        PhaseCost {
            name: "experts down",
            bytes: experts * (d * i + 4.0 * d) + rows * (5.0 * i + 4.0 * d),
            int8_ops: 2.0 * rows * i * d,
            flops: 0.0,
        },
        PhaseCost {
            name: "combine, reduce, hc_post",
            bytes: 4.0 * (2.0 * routed_rows * d + (s + k) * t * d + 2.0 * t * hc * d) + 2.0 * t * d,
            int8_ops: 0.0,
            flops: 2.0 * t * hc * d * (hc + 1.0),
        },
    ]
}

/// The step's per-phase bound in seconds (phases in dependency order, summed).
pub fn per_phase_bound_s(phases: &[PhaseCost], l: &Limits) -> f64 {
    phases.iter().map(|p| p.bound_s(l)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experts_without_rows_cost_nothing_and_the_bound_sums_phases() {
        let c = Dsv4Config::small();
        let a = moe_step_phases(&c, 8, &[8, 0, 0, 40]);
        let b = moe_step_phases(&c, 8, &[8, 40]);
        let gate_up = |p: &[PhaseCost]| p.iter().find(|p| p.name == "experts gate/up").cloned();
        assert_eq!(gate_up(&a), gate_up(&b));
        // Two routed experts and one shared: three experts' weights streamed.
        let g = gate_up(&a).unwrap();
        let (i, d) = (c.moe_inter_dim as f64, c.hidden as f64);
        assert!(g.bytes > 3.0 * 2.0 * i * d && g.bytes < 4.0 * 2.0 * i * d);
        assert_eq!(g.int8_ops, 2.0 * (48.0 + 8.0) * 2.0 * i * d);
        let l = Limits {
            gbs: 10.0,
            int8_gops: 1e12,
            fma_gflops: 1e12,
        };
        let sum: f64 = a.iter().map(|p| p.bytes).sum::<f64>() / 10e9;
        assert!((per_phase_bound_s(&a, &l) - sum).abs() < 1e-12);
        assert_eq!(g.binding(&l), "bandwidth");
        let slow = Limits {
            int8_gops: 1e-3,
            ..l
        };
        assert_eq!(g.binding(&slow), "int8");
    }
}
