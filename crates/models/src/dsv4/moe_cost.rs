//! What one MoE decode step must move and compute, phase by phase (`docs/dsv4.md`, "MoE on the
//! runtime"), as a [`LayerCost`] whose phases are the graph's timing slots; the per-phase
//! bound is [`LayerCost::phase_bound_s`]. Only experts that received a row count: an expert without a token costs nothing.

use super::config::Dsv4Config;
use super::cost::{LayerCost, PhaseCost};

/// The phases of one MoE step of `tokens` rows whose local experts received `rows_per_expert`
/// rows each (the shared experts get every token).
pub fn moe_step_cost(c: &Dsv4Config, tokens: usize, rows_per_expert: &[usize]) -> LayerCost {
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
    let phases = vec![
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
    ];
    LayerCost { phases }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dsv4::cost::Peaks;

    #[test]
    fn experts_without_rows_cost_nothing_and_the_bound_sums_phases() {
        let c = Dsv4Config::small();
        let a = moe_step_cost(&c, 8, &[8, 0, 0, 40]);
        let b = moe_step_cost(&c, 8, &[8, 40]);
        let gate_up = |l: &LayerCost| {
            l.phases
                .iter()
                .find(|p| p.name == "experts gate/up")
                .copied()
        };
        assert_eq!(gate_up(&a), gate_up(&b));
        // Two routed experts and one shared: three experts' weights streamed.
        let g = gate_up(&a).unwrap();
        let (i, d) = (c.moe_inter_dim as f64, c.hidden as f64);
        assert!(g.bytes > 3.0 * 2.0 * i * d && g.bytes < 4.0 * 2.0 * i * d);
        assert_eq!(g.int8_ops, 2.0 * (48.0 + 8.0) * 2.0 * i * d);
        let m = Peaks {
            gbs: 10.0,
            gflops: 1e12,
            int8_gops: 1e12,
        };
        assert!((a.phase_bound_s(&m) - a.bytes() / 10e9).abs() < 1e-12);
        let slow = Peaks {
            int8_gops: 1e-3,
            ..m
        };
        // With int8 arithmetic the slowest limit, the phase takes its operations at that rate.
        let t = LayerCost::phase_s(&g, &slow);
        assert!((t - g.int8_ops / 1e6).abs() < 1e-9 * t, "{t}");
    }
}
