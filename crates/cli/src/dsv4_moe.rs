//! The DeepSeek-V4 MoE layer from the command line: `run dsv4 --layer moe` (one step with its
//! report, `--check` against the golden) and `bench dsv4 --kernel moe` (warm-up and measured
//! rounds with `effective_us`, `fast_effective_us`, `valid_rounds` and the share of the
//! per-phase bound; `docs/dsv4.md`, "MoE benchmark").
//!
//! FLASH shapes: `Dsv4Config::flash_ep(2, 16)` gives each rank 16 routed experts; one machine
//! runs one rank's 16 experts with every route of the step local (no exchange), which is the
//! expert work of an EP2 rank whose tokens all stay home. Smaller presets run whole.

use std::time::Instant;

use anyhow::{Result, anyhow, bail};
use simpler_core::{CallConfig, RunReport, Worker};
use simpler_dfx::bench_stats::Summary;
use simpler_kernels_cpu::I8Path;
use simpler_kernels_cpu::gemm_i8::peak::int8_peaks;
use simpler_kernels_cpu::membw::MachinePeaks;
use simpler_models::dsv4::check::RelDiff;
use simpler_models::dsv4::fixture::{
    MoeWeights, StepInputs, generate_inputs, generate_moe_weights,
};
use simpler_models::dsv4::golden::moe_step;
use simpler_models::dsv4::moe_cost::{Limits, PhaseCost, moe_step_phases, per_phase_bound_s};
use simpler_models::dsv4::moe_graph::{ExpertPlacement, MoeLayer, MoeOutput};
use simpler_models::dsv4::{Dsv4Config, MIXED_STARTS, moe_ops, uniform_starts};

use crate::qwen3_decode::{best_peaks, machine_peaks};

/// Experts per rank of the FLASH benchmark (`flash_ep(2, 16)`).
pub(crate) const FLASH_EXPERTS_PER_RANK: usize = 16;

/// A seeded MoE case: configuration, weights, the step's inputs and the layer index.
pub(crate) struct MoeCase {
    pub(crate) cfg: Dsv4Config,
    pub(crate) weights: MoeWeights,
    pub(crate) inputs: StepInputs,
    pub(crate) layer: usize,
    /// What the shape stands for (printed).
    pub(crate) note: String,
}

/// The case of `preset` (`flash`: one EP2 rank's 16 experts at FLASH widths) with every
/// sequence at `start_pos` (default: the mixed starts), layer `layer` (default: the first
/// top-k-routed layer).
pub(crate) fn moe_case(
    preset: &str,
    start_pos: Option<usize>,
    layer: Option<usize>,
    seed: u64,
) -> Result<MoeCase> {
    let (cfg, note) = if preset == "flash" {
        let ep = Dsv4Config::flash_ep(2, FLASH_EXPERTS_PER_RANK)?;
        let note = format!(
            "FLASH widths, flash_ep(2, {FLASH_EXPERTS_PER_RANK}): {} routed experts over 2 ranks; this machine runs one rank's {FLASH_EXPERTS_PER_RANK} experts with every route of the step local (no exchange)",
            ep.n_routed_experts
        );
        (
            Dsv4Config {
                n_routed_experts: FLASH_EXPERTS_PER_RANK,
                ..ep
            },
            note,
        )
    } else {
        let c = Dsv4Config::preset(preset)?;
        let note = format!(
            "preset {preset}: {} routed experts, all local",
            c.n_routed_experts
        );
        (c, note)
    };
    let starts = start_pos.map_or(MIXED_STARTS, uniform_starts);
    if let Some(&s) = starts.iter().find(|&&s| s + 1 >= cfg.max_position) {
        bail!(
            "--start-pos {s}: positions {s} and {} must be below max_position {}",
            s + 1,
            cfg.max_position
        );
    }
    let layer = layer.unwrap_or(cfg.n_hash_layers);
    Ok(MoeCase {
        weights: generate_moe_weights(&cfg, seed),
        inputs: generate_inputs(&cfg, &starts, seed),
        cfg,
        layer,
        note,
    })
}

/// The layer resident on `worker` (MoE kernels registered here).
fn resident(worker: &Worker, case: &MoeCase) -> Result<MoeLayer> {
    moe_ops::register(worker)?;
    simpler_models::dsv4::ops::register(worker)?;
    Ok(MoeLayer::new(
        worker,
        &case.cfg,
        &case.weights,
        case.layer,
        ExpertPlacement::single(case.cfg.n_routed_experts),
        0,
    )?)
}

/// Rows each expert received in `out`.
fn rows_per_expert(cfg: &Dsv4Config, out: &MoeOutput) -> Vec<usize> {
    let mut rows = vec![0usize; cfg.n_routed_experts];
    for &e in &out.experts {
        if let Some(r) = rows.get_mut(e as usize) {
            *r += 1;
        }
    }
    rows
}

/// The limits the bound divides by: bandwidth and FMA from `p`, the int8 peak of the best
/// int8 path on all threads (measured now, `seconds` long).
fn limits(p: &MachinePeaks, seconds: f64) -> (Limits, String) {
    let path = I8Path::current();
    let peaks = int8_peaks(
        p.threads,
        std::time::Duration::from_secs_f64(seconds.max(0.2)),
    );
    let int8 = peaks
        .iter()
        .find(|q| q.path == path)
        .map_or(0.0, |q| q.gops_all);
    let line = format!(
        "machine (measured in this run): streaming read {:.1} GB/s on {} threads (best pass; median {:.1}); int8 peak {int8:.1} GOP/s ({}); FMA peak {:.1} GFLOP/s",
        p.read_gbs_all,
        p.threads,
        p.read_gbs_all_median,
        path.name(),
        p.fma_gflops_all
    );
    (
        Limits {
            gbs: p.read_gbs_all,
            int8_gops: int8,
            fma_gflops: p.fma_gflops_all,
        },
        line,
    )
}

fn format_phases(phases: &[PhaseCost], l: &Limits) -> String {
    let mut s = String::new();
    for p in phases {
        s += &format!(
            "    {:<26} {:>9.2} MB {:>8.3} GOP int8 {:>8.3} GFLOP  bound {:>9.1} us ({})\n",
            p.name,
            p.bytes / 1e6,
            p.int8_ops / 1e9,
            p.flops / 1e9,
            p.bound_s(l) * 1e6,
            p.binding(l)
        );
    }
    s
}

/// Checks `out` against the golden; `Err` names the output.
fn check(case: &MoeCase, out: &MoeOutput) -> Result<String> {
    let g = moe_step(&case.cfg, &case.weights, case.layer, &case.inputs);
    let want: Vec<u32> = g
        .routes
        .iter()
        .flat_map(|r| r.experts.iter().map(|&e| e as u32))
        .collect();
    if out.experts != want {
        bail!("routing differs from the golden");
    }
    let t = RelDiff::MOE;
    let mut line = String::from("check (MoE tolerance 3e-3 / 5%):");
    for (what, a, e) in [
        ("shared", &out.shared, &g.shared),
        ("routed", &out.routed, &g.routed),
        ("y", &out.y, &g.y),
        ("x_out", &out.x_out, &g.x_out),
    ] {
        let o = t.check(what, a, e).map_err(|e| anyhow!(e))?;
        line += &format!(" {what} {:.2}% over", 100.0 * o.share_over());
    }
    Ok(line)
}

/// `simpler run dsv4 --layer moe`: one warm-up step, one reported step.
pub(crate) fn run_moe(
    worker: &Worker,
    cfg: &CallConfig,
    case: &MoeCase,
    check_golden: bool,
    membw_seconds: f64,
) -> Result<(RunReport, String)> {
    let layer = resident(worker, case)?;
    let peaks = machine_peaks(membw_seconds);
    let (l, machine) = limits(&peaks, membw_seconds);
    let step = || layer.step(worker, &case.inputs.x_hc, &case.inputs.token_ids, cfg);
    step()?;
    let t0 = Instant::now();
    let out = step()?;
    let e2e = t0.elapsed().as_secs_f64();
    let rows = rows_per_expert(&case.cfg, &out);
    let phases = moe_step_phases(&case.cfg, case.inputs.n_tokens(), &rows);
    let bound = per_phase_bound_s(&phases, &l);
    let bytes: f64 = phases.iter().map(|p| p.bytes).sum();
    let dev = out.report.device_wall.us() * 1e-6;
    let mut s = format!("dsv4 moe, {}\n{machine}\n", case.note);
    s += &format!(
        "  layer {} ({}), {} tokens, experts hit {} of {} (rows {:?})\n",
        case.layer,
        if case.layer < case.cfg.n_hash_layers {
            "hash-routed"
        } else {
            "top-k"
        },
        case.inputs.n_tokens(),
        rows.iter().filter(|&&r| r > 0).count(),
        rows.len(),
        rows
    );
    s += &format!(
        "  step: device {:.1} us, host {:.1} us (with upload and read-back {:.1} us)\n",
        dev * 1e6,
        out.report.host_wall.us(),
        e2e * 1e6
    );
    s += &format!(
        "  bytes {:.2} MB -> {:.2} GB/s = {:.1}% of membw; per-phase bound {:.1} us: achieved {:.1}%\n",
        bytes / 1e6,
        bytes / dev / 1e9,
        100.0 * bytes / dev / 1e9 / l.gbs,
        bound * 1e6,
        100.0 * bound / dev
    );
    s += &format_phases(&phases, &l);
    if check_golden {
        s += &check(case, &out)?;
        s.push('\n');
    }
    Ok((out.report, s))
}

/// The bench's statistics: `effective_us` of every measured round, the rounds whose output
/// matched the first round's (the step is deterministic, so a differing round is invalid),
/// and the mean of the faster half of the valid rounds.
#[derive(Clone, Debug)]
pub(crate) struct MoeBench {
    pub(crate) effective: Summary,
    pub(crate) fast_effective_us: f64,
    pub(crate) valid_rounds: usize,
    pub(crate) rounds: usize,
}

/// `fast_effective_us`: the mean of the faster half (at least one) of `valid` (µs).
pub(crate) fn fast_effective(valid: &[f64]) -> f64 {
    let mut v = valid.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len().div_ceil(2).max(1).min(v.len());
    if n == 0 {
        return f64::NAN;
    }
    v[..n].iter().sum::<f64>() / n as f64
}

/// `simpler bench dsv4 --kernel moe`.
pub(crate) fn bench_moe(
    worker: &Worker,
    cfg: &CallConfig,
    case: &MoeCase,
    rounds: usize,
    warmup: usize,
    membw_seconds: f64,
) -> Result<(MoeBench, String)> {
    if rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let layer = resident(worker, case)?;
    let before = machine_peaks(membw_seconds);
    let step = || layer.step(worker, &case.inputs.x_hc, &case.inputs.token_ids, cfg);
    for _ in 0..warmup {
        step()?;
    }
    let first = step()?;
    let mut all = Vec::with_capacity(rounds);
    let mut valid = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let out = step()?;
        let us = out.report.device_wall.us();
        all.push(us);
        let same = out.experts == first.experts
            && out.x_out == first.x_out
            && out.x_out.iter().all(|v| v.is_finite());
        if same {
            valid.push(us);
        }
    }
    let after = machine_peaks(membw_seconds);
    let peaks = best_peaks(&before, &after);
    let (l, machine) = limits(&peaks, membw_seconds);
    let rows = rows_per_expert(&case.cfg, &first);
    let phases = moe_step_phases(&case.cfg, case.inputs.n_tokens(), &rows);
    let bound_us = per_phase_bound_s(&phases, &l) * 1e6;
    let b = MoeBench {
        effective: Summary::of(&all),
        fast_effective_us: fast_effective(&valid),
        valid_rounds: valid.len(),
        rounds,
    };
    let e = &b.effective;
    let mut s = format!("dsv4 moe bench, {}\n{machine}\n", case.note);
    s += &format!(
        "  layer {}, {} tokens, experts hit {} of {}; {warmup} warm-up + {rounds} measured rounds\n",
        case.layer,
        case.inputs.n_tokens(),
        rows.iter().filter(|&&r| r > 0).count(),
        rows.len()
    );
    s += &format!(
        "  effective_us min {:.1} median {:.1} mean {:.1} max {:.1}\n",
        e.min, e.median, e.mean, e.max
    );
    s += &format!(
        "  fast_effective_us {:.1}  valid_rounds {}/{}\n",
        b.fast_effective_us, b.valid_rounds, b.rounds
    );
    s += &format!(
        "  per-phase bound {bound_us:.1} us: quietest step {:.1}%, median {:.1}%, fast_effective {:.1}%\n",
        100.0 * bound_us / e.min,
        100.0 * bound_us / e.median,
        100.0 * bound_us / b.fast_effective_us
    );
    s += &format_phases(&phases, &l);
    Ok((b, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_effective_is_the_mean_of_the_faster_half() {
        assert_eq!(fast_effective(&[4.0, 1.0, 3.0, 2.0]), 1.5);
        assert_eq!(fast_effective(&[5.0, 1.0, 3.0]), 2.0);
        assert_eq!(fast_effective(&[7.0]), 7.0);
        assert!(fast_effective(&[]).is_nan());
    }
}

/// Arguments of `simpler run dsv4`.
#[derive(clap::Args, Debug)]
pub(crate) struct Dsv4RunArgs {
    /// Layer kind: swa, csa, hca or moe (only moe runs here so far).
    #[arg(long)]
    pub(crate) layer: String,
    /// Shape preset: flash (one EP2 rank's 16 experts at FLASH widths), small or tiny.
    #[arg(long, default_value = "flash")]
    pub(crate) preset: String,
    /// Every sequence starts at N [default: the mixed starts 0, 3, 127, 8192].
    #[arg(long)]
    pub(crate) start_pos: Option<usize>,
    /// Compare the step with the golden.
    #[arg(long)]
    pub(crate) check: bool,
    /// Fixture seed.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Seconds spent measuring bandwidth and peaks.
    #[arg(long, default_value_t = 1.5)]
    pub(crate) membw_seconds: f64,
    #[command(flatten)]
    pub(crate) run: crate::opts::RunOpts,
}

/// Arguments of `simpler bench dsv4`.
#[derive(clap::Args, Debug)]
pub(crate) struct Dsv4BenchArgs {
    /// Kernel (layer kind): swa, csa, hca or moe (only moe runs here so far).
    #[arg(long)]
    pub(crate) kernel: String,
    /// Shape preset: flash (one EP2 rank's 16 experts at FLASH widths), small or tiny.
    #[arg(long, default_value = "flash")]
    pub(crate) preset: String,
    /// Every sequence starts at N.
    #[arg(long, default_value_t = 8192)]
    pub(crate) start_pos: usize,
    /// Measured rounds.
    #[arg(long, default_value_t = 100)]
    pub(crate) rounds: usize,
    /// Warm-up rounds.
    #[arg(long, default_value_t = 5)]
    pub(crate) warmup: usize,
    /// Fixture seed.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Seconds spent measuring bandwidth and peaks (before and after the rounds).
    #[arg(long, default_value_t = 1.5)]
    pub(crate) membw_seconds: f64,
    #[command(flatten)]
    pub(crate) run: crate::opts::RunOpts,
}

fn only_moe(kind: &str, flag: &str) -> Result<()> {
    match kind {
        "moe" => Ok(()),
        "swa" | "csa" | "hca" => bail!("{flag} {kind}: not implemented yet (only moe runs)"),
        other => bail!("{flag} {other}: unknown layer kind (swa, csa, hca or moe)"),
    }
}

/// `simpler run dsv4`.
pub(crate) fn run_main(a: Dsv4RunArgs) -> Result<()> {
    only_moe(&a.layer, "--layer")?;
    let case = moe_case(&a.preset, a.start_pos, None, a.seed)?;
    let w = a.run.worker()?;
    let cfg = a.run.call_config("dsv4-moe")?;
    let (report, text) = run_moe(&w, &cfg, &case, a.check, a.membw_seconds)?;
    crate::opts::emit(&report, &cfg)?;
    print!("{text}");
    Ok(())
}

/// `simpler bench dsv4`.
pub(crate) fn bench_main(a: Dsv4BenchArgs) -> Result<()> {
    only_moe(&a.kernel, "--kernel")?;
    let case = moe_case(&a.preset, Some(a.start_pos), None, a.seed)?;
    let w = a.run.worker()?;
    let cfg = a.run.call_config("dsv4-moe")?;
    let (_, text) = bench_moe(&w, &cfg, &case, a.rounds, a.warmup, a.membw_seconds)?;
    print!("{text}");
    Ok(())
}
