//! The DeepSeek-V4 MoE layer in `simpler run dsv4 --layer moe` and `simpler bench dsv4 --kernel
//! moe` (`docs/dsv4.md`, "MoE benchmark"): its [`LayerStep`], and the bench's
//! `faster_half_us` and `valid_rounds`.
//!
//! FLASH shapes: `Dsv4Config::flash_ep(2, 16)` gives each rank 16 routed experts; one machine
//! runs one rank's 16 experts with every route of the step local (no exchange), which is the
//! expert work of an EP2 rank whose tokens all stay home. Smaller presets run whole.

use anyhow::{Result, anyhow};
use simpler_core::{CallConfig, RunReport, Worker};
use simpler_models::dsv4::check::RelDiff;
use simpler_models::dsv4::fixture::{
    MoeWeights, StepInputs, generate_inputs, generate_moe_weights,
};
use simpler_models::dsv4::golden::moe_step;
use simpler_models::dsv4::moe_cost::moe_step_cost;
use simpler_models::dsv4::moe_graph::{ExpertPlacement, MoeLayer, MoeOutput};
use simpler_models::dsv4::{Dsv4Config, LayerCost, TOKENS_PER_SEQ, moe_ops};

use crate::dsv4_cmd::LayerStep;

/// Experts per rank of the FLASH benchmark (`flash_ep(2, 16)`).
pub(crate) const FLASH_EXPERTS_PER_RANK: usize = 16;

/// The MoE shapes of `cfg`: the FLASH preset becomes one rank of `flash_ep(2, 16)` (16
/// routed experts); other presets stay whole. Returns the note printed with the shapes.
pub(crate) fn moe_config(cfg: &Dsv4Config) -> Result<(Dsv4Config, String)> {
    if *cfg == Dsv4Config::flash() {
        let ep = Dsv4Config::flash_ep(2, FLASH_EXPERTS_PER_RANK)?;
        let note = format!(
            "flash_ep(2, {FLASH_EXPERTS_PER_RANK}): {} routed experts over 2 ranks; this machine runs one rank's {FLASH_EXPERTS_PER_RANK} experts with every route of the step local (no exchange)",
            ep.n_routed_experts
        );
        return Ok((
            Dsv4Config {
                n_routed_experts: FLASH_EXPERTS_PER_RANK,
                ..ep
            },
            note,
        ));
    }
    let note = format!("{} routed experts, all local", cfg.n_routed_experts);
    Ok((cfg.clone(), note))
}

/// A MoE layer (the first top-k-routed one, or the first hash-routed one with `--routing
/// hash`) with its seeded fixture.
pub(crate) struct MoeStep {
    cfg: Dsv4Config,
    note: String,
    starts: Vec<usize>,
    weights: MoeWeights,
    inputs: StepInputs,
    layer: MoeLayer,
    /// The first step's output: later rounds must reproduce it.
    first: Option<MoeOutput>,
    /// The latest step's output.
    last: Option<MoeOutput>,
}

impl MoeStep {
    /// Registers the MoE kernels (the attention layers' are registered by the caller) and
    /// uploads the layer.
    pub(crate) fn new(
        worker: &Worker,
        cfg: &Dsv4Config,
        starts: &[usize],
        seed: u64,
        hash_routing: bool,
    ) -> Result<MoeStep> {
        moe_ops::register(worker)?;
        let (cfg, note) = moe_config(cfg)?;
        let weights = generate_moe_weights(&cfg, seed);
        let inputs = generate_inputs(&cfg, starts, seed);
        let layer = MoeLayer::new(
            worker,
            &cfg,
            &weights,
            routed_layer(&cfg, hash_routing)?,
            ExpertPlacement::single(cfg.n_routed_experts),
            0,
        )?;
        Ok(MoeStep {
            cfg,
            note,
            starts: starts.to_vec(),
            weights,
            inputs,
            layer,
            first: None,
            last: None,
        })
    }

    fn run(&self, worker: &Worker, cfg: &CallConfig) -> Result<MoeOutput> {
        Ok(self
            .layer
            .step(worker, &self.inputs.x_hc, &self.inputs.token_ids, cfg)?)
    }

    /// Rows each routed expert received in the latest step (all zero before one ran).
    fn rows_per_expert(&self) -> Vec<usize> {
        let mut rows = vec![0usize; self.cfg.n_routed_experts];
        for out in self.last.iter() {
            for &e in &out.experts {
                if let Some(r) = rows.get_mut(e as usize) {
                    *r += 1;
                }
            }
        }
        rows
    }

    /// Whether the latest step reproduced the first one bit for bit (routing and `x_out`,
    /// all finite): the step is deterministic, so a differing round is invalid.
    pub(crate) fn last_round_valid(&self) -> bool {
        match (&self.first, &self.last) {
            (Some(f), Some(l)) => {
                f.experts == l.experts
                    && f.x_out == l.x_out
                    && l.x_out.iter().all(|v| v.is_finite())
            }
            _ => false,
        }
    }
}

/// The layer index that routes as asked: the first (hash-routed) layer, or the first top-k
/// one (`n_hash_layers`).
pub(crate) fn routed_layer(cfg: &Dsv4Config, hash: bool) -> Result<usize> {
    if hash && cfg.n_hash_layers == 0 {
        anyhow::bail!("--routing hash: this configuration has no hash-routed layer");
    }
    Ok(if hash { 0 } else { cfg.n_hash_layers })
}

/// How layer `layer` routes, in words.
pub(crate) fn describe_routing(cfg: &Dsv4Config, layer: usize) -> String {
    if layer < cfg.n_hash_layers {
        format!(
            "hash-routed: each token id's {} experts from the table",
            cfg.n_activated_experts
        )
    } else {
        format!("top-{} of score + bias", cfg.n_activated_experts)
    }
}

impl LayerStep for MoeStep {
    fn rows(&self) -> usize {
        self.starts.len() * TOKENS_PER_SEQ
    }

    fn describe(&self) -> String {
        let c = &self.cfg;
        let rows = self.rows_per_expert();
        let hit = rows.iter().filter(|&&r| r > 0).count();
        format!(
            "MoE layer {} ({}): hidden {}, {} shared + {} routed experts of width {}, {}; batch {} x {} tokens at starts {:?}{}",
            self.layer.layer,
            describe_routing(c, self.layer.layer),
            c.hidden,
            c.n_shared_experts,
            c.n_routed_experts,
            c.moe_inter_dim,
            self.note,
            self.starts.len(),
            TOKENS_PER_SEQ,
            self.starts,
            if self.last.is_some() {
                format!("; experts hit {hit} (rows {rows:?})")
            } else {
                String::new()
            }
        )
    }

    fn step(&mut self, worker: &Worker, cfg: &CallConfig) -> Result<RunReport> {
        let out = self.run(worker, cfg)?;
        let report = out.report.clone();
        if self.first.is_none() {
            self.first = Some(out.clone());
        }
        self.last = Some(out);
        Ok(report)
    }

    fn check(&mut self, worker: &Worker, cfg: &CallConfig) -> Result<Vec<(String, bool)>> {
        let out = self.run(worker, cfg)?;
        let lines = golden_lines(
            &self.cfg,
            &self.weights,
            self.layer.layer,
            &self.inputs,
            &out,
        );
        self.last = Some(out);
        Ok(lines)
    }

    fn cost(&self) -> LayerCost {
        moe_step_cost(&self.cfg, self.inputs.n_tokens(), &self.rows_per_expert())
    }

    fn round_valid(&self) -> Option<bool> {
        Some(self.last_round_valid())
    }
}

/// A MoE step's output against the golden: the routing exactly, the shared and routed parts,
/// `y` and `x_out` within the MoE tolerance; one `(line, ok)` each.
pub(crate) fn golden_lines(
    cfg: &Dsv4Config,
    weights: &MoeWeights,
    layer: usize,
    inputs: &StepInputs,
    out: &MoeOutput,
) -> Vec<(String, bool)> {
    let g = moe_step(cfg, weights, layer, inputs);
    let hidden = cfg.hidden;
    let want: Vec<u32> = g
        .routes
        .iter()
        .flat_map(|r| r.experts.iter().map(|&e| e as u32))
        .collect();
    let mut lines = vec![if out.experts == want {
        (
            format!("ok: routing: {} routes as the golden", want.len()),
            true,
        )
    } else {
        ("FAILED: routing differs from the golden".to_string(), false)
    }];
    for (what, a, e) in [
        ("shared", &out.shared, &g.shared),
        ("routed [T, K, D]", &out.routed, &g.routed),
        ("y", &out.y, &g.y),
        ("x_out", &out.x_out, &g.x_out),
    ] {
        // Every output is rows of `hidden` (`routed` is `[T, K, hidden]`, `x_out`
        // `[T, hc_mult, hidden]`).
        lines.push(match RelDiff::MOE.check_columns(what, a, e, hidden) {
            Ok(o) => (
                format!(
                    "ok: {what}: {} of {} elements over 3e-3 (5% allowed, and no column mostly over; worst {:.2e}) vs the golden",
                    o.over, o.n, o.worst_value
                ),
                true,
            ),
            Err(e) => (format!("FAILED: {e}"), false),
        });
    }
    lines
}

/// `faster_half_us`: the mean of the faster half (at least one) of the valid rounds' times.
/// (Not `fast_effective_us`, which names the fastest rank of each round of a several-rank
/// run; this is one rank's rounds.)
pub(crate) fn faster_half(valid: &[f64]) -> f64 {
    let mut v = valid.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len().div_ceil(2);
    if n == 0 {
        return f64::NAN;
    }
    v[..n].iter().sum::<f64>() / n as f64
}

/// The bench's MoE lines: `faster_half_us` and `valid_rounds` of the measured rounds
/// (`(effective_us, valid)` each).
pub(crate) fn format_moe_rounds(rounds: &[(f64, bool)]) -> Result<String> {
    if rounds.is_empty() {
        return Err(anyhow!("no measured round"));
    }
    let valid: Vec<f64> = rounds.iter().filter(|r| r.1).map(|r| r.0).collect();
    Ok(format!(
        "faster_half_us {:.1} (mean of the faster half of the valid rounds)  valid_rounds {}/{} (output identical to the first step)",
        faster_half(&valid),
        valid.len(),
        rounds.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faster_half_is_the_mean_of_the_faster_half() {
        assert_eq!(faster_half(&[4.0, 1.0, 3.0, 2.0]), 1.5);
        assert_eq!(faster_half(&[5.0, 1.0, 3.0]), 2.0);
        assert_eq!(faster_half(&[7.0]), 7.0);
        assert!(faster_half(&[]).is_nan());
        let s = format_moe_rounds(&[(2.0, true), (1.0, false), (3.0, true)]).unwrap();
        assert!(
            s.contains("faster_half_us 2.0") && s.contains("valid_rounds 2/3"),
            "{s}"
        );
    }

    #[test]
    fn flash_becomes_one_rank_of_sixteen_experts() {
        let (c, note) = moe_config(&Dsv4Config::flash()).unwrap();
        assert_eq!(c.n_routed_experts, 16);
        assert!(note.contains("flash_ep(2, 16)"), "{note}");
        let (c, _) = moe_config(&Dsv4Config::small()).unwrap();
        assert_eq!(c, Dsv4Config::small());
    }
}
