//! `simpler run dsv4` and `simpler bench dsv4`: one decode step (batch 4 × 2 tokens) of a
//! DeepSeek-V4 layer on the runtime, from a seeded fixture, with the timing layers, the bytes
//! and GB/s of each phase, the share of this machine's bandwidth and of the per-phase bound
//! (both measured in the run), and (`--check`) the comparison with the golden.
//!
//! Each layer kind is a [`LayerStep`]; [`prepare`] picks one per `--layer`/`--kernel`, so a
//! new kind is one implementation and one match arm.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use simpler_core::{CallConfig, Interval, RunReport, Worker};
use simpler_dfx::bench_stats::{
    Diagnostics, Summary, format_compare, format_diagnostics, format_summary, run_interleaved,
};
use simpler_kernels_cpu::gemm_i8::peak::int8_peaks;
use simpler_kernels_cpu::isa::set_process_isa;
use simpler_kernels_cpu::membw::{CacheFlush, MachinePeaks};
use simpler_kernels_cpu::{I8Path, Isa};
use simpler_models::dsv4::check::{attn_step_checks, csa_cache_checks, csa_pick_check};
use simpler_models::dsv4::fixture::{
    AttnWeights, CsaParts, HcaParts, StepInputs, WindowCache, generate_attn_weights, generate_csa,
    generate_hca, generate_inputs, generate_window_cache,
};
use simpler_models::dsv4::golden::{csa_step, hca_step, swa_step};
use simpler_models::dsv4::{
    AttnLayer, Dsv4Config, LayerCost, LayerKind, MIXED_STARTS, Peaks, TOKENS_PER_SEQ, ops,
    uniform_starts,
};

use crate::bench_qwen3::isa_flag;
use crate::opts::{self, RunOpts};
use crate::qwen3_cmd::{Replay, describe_graphs};
use crate::qwen3_decode::{best_peaks, format_peaks, machine_peaks};

/// The layer kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LayerArg {
    /// Sliding window attention.
    Swa,
    /// Ratio-4 compressed attention with the indexer.
    Csa,
    /// Ratio-128 compressed attention.
    Hca,
    /// The mixture of experts.
    Moe,
}

impl LayerArg {
    fn name(self) -> &'static str {
        match self {
            LayerArg::Swa => "swa",
            LayerArg::Csa => "csa",
            LayerArg::Hca => "hca",
            LayerArg::Moe => "moe",
        }
    }
}

/// What a step is made of: shapes, starts, seed, and the measurement of the machine.
#[derive(Args, Debug)]
pub(crate) struct CaseArgs {
    /// Shapes: the spec's FLASH configuration or a narrower variant.
    #[arg(long, default_value = "flash", value_parser = ["flash", "small", "tiny"])]
    preset: String,
    /// Every sequence starts at N (at 8192 no compression boundary falls inside the step)
    /// [default: the mixed starts 0,3,127,8192].
    #[arg(long, value_name = "N")]
    start_pos: Option<usize>,
    /// Fixture seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds spent measuring this machine's bandwidth and peaks (before and after the steps;
    /// at least 0.2 each time) [default: 1.5; with --ep at most 1, and 1 by default].
    #[arg(long, value_parser = crate::opts::seconds, value_name = "SECONDS")]
    membw_seconds: Option<f64>,
    /// Run the steps back to back, leaving in the last-level cache whatever of the layer the
    /// previous step left there. By default each step starts after a read of twice the
    /// last-level cache (not timed), as a step of a whole model finds the layer: in memory.
    /// Refused with --ep, whose ranks always run their steps back to back.
    #[arg(long)]
    warm_cache: bool,
    /// moe: route by the token-id table of the first `n_hash_layers` (3) layers (`hash`), or
    /// by the gate's top-k with bias, as every later layer (`top-k`) [default: top-k].
    /// Refused for the other layers.
    #[arg(long, value_enum)]
    routing: Option<RoutingArg>,
    /// swa, csa, hca with `run`: real tokens of each sequence, comma-separated, 0 to 2 each
    /// (e.g. `2,1,0,2`); a sequence's other rows are padding (the spec's slot -1): computed,
    /// written to no cache, left out of --check's output comparisons [default: 2 each].
    /// Refused for moe and by `bench dsv4`, which measures whole steps.
    #[arg(long, value_delimiter = ',', value_name = "N,N,..")]
    real_tokens: Option<Vec<usize>>,
}

/// How the MoE layer routes its tokens (`--routing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum RoutingArg {
    /// The token-id table (layers below `n_hash_layers`).
    Hash,
    /// The gate's top-k of score + bias (every later layer).
    TopK,
}

impl CaseArgs {
    /// Whether the MoE layer routes by the token-id table (`--routing hash`).
    pub(crate) fn hash_routing(&self) -> bool {
        self.routing == Some(RoutingArg::Hash)
    }

    /// Refuses `--routing` when a layer of `layers` is not the MoE.
    fn check_routing(&self, layers: &[LayerArg]) -> Result<()> {
        if let (Some(_), Some(other)) = (self.routing, layers.iter().find(|&&l| l != LayerArg::Moe))
        {
            bail!(
                "--routing: it picks how the moe layer routes its tokens; {} routes none",
                other.name()
            );
        }
        Ok(())
    }

    /// Refuses `--start-pos` where every layer is the MoE: its step reads no position (the
    /// starts only count its tokens, the same at every start), so the flag would change
    /// nothing.
    fn check_start(&self, layers: &[LayerArg]) -> Result<()> {
        if let Some(n) = self.start_pos
            && layers.iter().all(|&l| l == LayerArg::Moe)
        {
            bail!(
                "--start-pos {n}: the moe layer reads no position (its step is the same at every start); it applies to swa, csa and hca"
            );
        }
        Ok(())
    }

    /// `--real-tokens` for `starts`, checked (every row real without the flag).
    fn real_tokens(&self, starts: &[usize]) -> Result<Vec<usize>> {
        let Some(real) = &self.real_tokens else {
            return Ok(vec![TOKENS_PER_SEQ; starts.len()]);
        };
        if real.len() != starts.len() {
            bail!(
                "--real-tokens: {} values for the step's {} sequences",
                real.len(),
                starts.len()
            );
        }
        if let Some((b, n)) = real.iter().enumerate().find(|&(_, &n)| n > TOKENS_PER_SEQ) {
            bail!(
                "--real-tokens: sequence {b} has {n} real tokens; a step has {TOKENS_PER_SEQ} rows a sequence"
            );
        }
        Ok(real.clone())
    }

    /// `--membw-seconds`, default 1.5 (with `--ep`, 1: [`EP_MEMBW_SECONDS`]). An `Option`
    /// so that `--ep` can tell a value given from the default.
    fn membw_seconds(&self) -> f64 {
        self.membw_seconds.unwrap_or(1.5)
    }
}

/// Most seconds of bandwidth measurement with `--ep` (rank 0 measures after the steps while the
/// other ranks wait for it), and the default there.
const EP_MEMBW_SECONDS: f64 = 1.0;

/// Expert parallelism of the MoE layer.
#[derive(Args, Debug, Clone)]
pub(crate) struct EpOpts {
    /// Expert-parallel ranks (moe only): each routes its own tokens, exchanges rows with the
    /// others and computes its share of the experts (1 runs the same pieces in this process).
    #[arg(long, value_name = "N")]
    ep: Option<usize>,
    /// The ranks' collectives (with --ep): `shm` (a node's chip processes on this host) or
    /// `mpi` (`mpirun -np N`; build with --features mpi) [default: shm].
    #[arg(long, value_enum)]
    collectives: Option<crate::bench_collectives::Backend>,
    /// Routed experts per rank at the flash preset, 16 or 32 (with --ep) [default: 16].
    #[arg(long, value_name = "N")]
    experts_per_rank: Option<usize>,
    /// Seconds the ranks' processes may take over their whole run before the node fails,
    /// naming the ranks that did not answer (with --ep, shm collectives): a rank that hangs
    /// (stopped, or stuck in an exchange with one that is) is diagnosed after this long
    /// [default: 600]. Refused with --ep 1, whose one rank runs in this process.
    #[arg(long, value_name = "SECONDS", value_parser = crate::opts::rank_timeout)]
    rank_timeout_secs: Option<f64>,
}

/// The expert-parallel command of these flags, `None` without `--ep`; refuses the flags that
/// do not apply, by name.
fn ep_cmd(
    layer: LayerArg,
    ep: &EpOpts,
    case: &CaseArgs,
    run: &RunOpts,
    (check, rounds, warmup): (bool, usize, usize),
) -> Result<Option<crate::dsv4_ep::EpCmd>> {
    let Some(n) = ep.ep else {
        if ep.collectives.is_some() {
            bail!("--collectives: only with --ep");
        }
        if ep.experts_per_rank.is_some() {
            bail!("--experts-per-rank: only with --ep");
        }
        if ep.rank_timeout_secs.is_some() {
            bail!("--rank-timeout-secs: only with --ep");
        }
        return Ok(None);
    };
    if layer != LayerArg::Moe {
        bail!(
            "--ep {n}: expert parallelism applies to the moe layer, not {}",
            layer.name()
        );
    }
    if case.real_tokens.is_some() {
        bail!("--real-tokens: padding rows apply to swa, csa and hca, not moe");
    }
    if case.warm_cache {
        bail!(
            "--warm-cache: the expert-parallel ranks run their steps back to back (they do not flush the cache); the flag applies without --ep"
        );
    }
    if run.diag_steps != opts::StepSet::All {
        bail!("--diag-steps: with --ep every rank writes its last step's diagnostics");
    }
    if let Some(secs) = case.membw_seconds.filter(|&s| s > EP_MEMBW_SECONDS) {
        bail!(
            "--membw-seconds {secs}: at most {EP_MEMBW_SECONDS} with --ep (rank 0 measures the bandwidth while the other ranks wait)"
        );
    }
    let cmd = crate::dsv4_ep::EpCmd {
        preset: case.preset.clone(),
        start_pos: case.start_pos,
        seed: case.seed,
        ep: n,
        collectives: ep
            .collectives
            .unwrap_or(crate::bench_collectives::Backend::Shm),
        per_rank: ep.experts_per_rank,
        rank_timeout: ep.rank_timeout_secs,
        hash_routing: case.hash_routing(),
        check,
        rounds,
        warmup,
        membw_seconds: case.membw_seconds().min(EP_MEMBW_SECONDS),
        run: run.clone(),
    };
    crate::dsv4_ep::check_cmd(&cmd)?;
    Ok(Some(cmd))
}

/// The expert-parallel command of `run dsv4` (`None` without `--ep`).
pub(crate) fn ep_cmd_of_run(a: &RunDsv4Args) -> Result<Option<crate::dsv4_ep::EpCmd>> {
    ep_cmd(
        a.layer,
        &a.ep,
        &a.case,
        &a.run,
        (a.check, a.rounds, a.warmup),
    )
}

/// The expert-parallel command of `bench dsv4` (`None` without `--ep`).
pub(crate) fn ep_cmd_of_bench(a: &BenchDsv4Args) -> Result<Option<crate::dsv4_ep::EpCmd>> {
    if let [layer] = a.kernel[..] {
        return ep_cmd(layer, &a.ep, &a.case, &a.run, (false, a.rounds, a.warmup));
    }
    if a.ep.ep.is_some() {
        bail!("--ep: the expert-parallel step measures the moe layer alone; give --kernel moe");
    }
    // Without --ep: the same refusals of --collectives and --experts-per-rank as one layer's.
    ep_cmd(
        LayerArg::Moe,
        &a.ep,
        &a.case,
        &a.run,
        (false, a.rounds, a.warmup),
    )
}

/// Arguments of `simpler run dsv4`.
#[derive(Args, Debug)]
pub(crate) struct RunDsv4Args {
    /// The layer whose decode step runs.
    #[arg(long, value_enum)]
    layer: LayerArg,
    #[command(flatten)]
    case: CaseArgs,
    /// Compare the step's output, intermediates and every cache it writes with the golden.
    #[arg(long)]
    check: bool,
    /// Measured steps (each replays the same step from the layer's caches).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Warm-up steps (discarded).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// swa, csa and hca: replay the first step's captured graph for every later step (`on`),
    /// run the orchestration for every step (`off`), or run it and check each later step's
    /// graph against the captured one (`verify`) [default: on]. Refused for moe, whose steps
    /// are orchestrated.
    #[arg(long, value_enum)]
    replay: Option<Replay>,
    #[command(flatten)]
    ep: EpOpts,
    #[command(flatten)]
    run: RunOpts,
}

/// Arguments of `simpler bench dsv4`.
#[derive(Args, Debug)]
pub(crate) struct BenchDsv4Args {
    /// The layers whose decode steps are measured, comma-separated (`swa,csa,hca,moe`): each
    /// on its own fixture and with its own measurement of the machine, one after the other,
    /// and with more than one a table compares them at the end.
    #[arg(long, value_enum, value_delimiter = ',', required = true)]
    kernel: Vec<LayerArg>,
    #[command(flatten)]
    case: CaseArgs,
    /// Measured steps.
    #[arg(long, default_value_t = 100)]
    rounds: usize,
    /// Warm-up steps (discarded).
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Also compare this run's SPMD blocks per projection (SWA, CSA and HCA: the projections
    /// and `q_b`, `wo_a`, `wo_b`; six per core by default) with `N` blocks, step against step
    /// in this process: interleaved steps A B B A .. and the median of the paired
    /// effective-time ratios B/A with its 95% interval. 1 to 4096
    #[arg(long, value_name = "N")]
    versus_proj_blocks: Option<u32>,
    /// swa, csa and hca: replay the first step's captured graph for every later step (`on`),
    /// run the orchestration for every step (`off`), or run it and check each later step's
    /// graph against the captured one (`verify`) [default: on]. Refused for moe, whose steps
    /// are orchestrated.
    #[arg(long, value_enum)]
    replay: Option<Replay>,
    /// Also compare replayed steps (A) with orchestrated ones (B), step against step in this
    /// process: interleaved steps A B B A .. and the median of the paired effective-time ratios B/A
    /// with its 95% interval (swa, csa and hca).
    #[arg(long)]
    versus_replay: bool,
    /// Also compare this run's kernel path with another instruction-set path (`portable`,
    /// `avx2`, `avx512-bf16`, `amx-bf16`), step against step in this process: interleaved
    /// steps A B B A .. and the median of the paired effective-time ratios B/A with its 95% interval,
    /// and each phase's median span on either side. The weights stay as this machine's path
    /// laid them out (paired or tiled bf16, and packed or interleaved int8, go through the
    /// other path's portable loops where it cannot read them), and the int8 kernels are capped
    /// with it (no AMX-INT8 below `amx-bf16`, no VNNI below `avx512-bf16`), so B is not
    /// always that path's own speed. Refused with `--ep`.
    #[arg(long, value_name = "PATH")]
    versus_isa: Option<String>,
    #[command(flatten)]
    ep: EpOpts,
    #[command(flatten)]
    run: RunOpts,
}

/// One layer kind's prepared decode step: what `run` and `bench` drive.
pub(crate) trait LayerStep {
    /// One line: the layer and its shapes.
    fn describe(&self) -> String;
    /// Runs the step once.
    fn step(&mut self, worker: &Worker, cfg: &CallConfig) -> Result<RunReport>;
    /// Runs the step on a fresh copy of the fixture's caches and compares everything it
    /// produces with the golden: one `(output, outcome)` line each.
    fn check(&mut self, worker: &Worker, cfg: &CallConfig) -> Result<Vec<(String, bool)>>;
    /// Bytes and operations per phase.
    fn cost(&self) -> LayerCost;
    /// Whether the latest step's output is valid (reproduces the first step's), for a kind
    /// whose bench counts `valid_rounds` (the MoE); `None` for the others.
    fn round_valid(&self) -> Option<bool> {
        None
    }
    /// SPMD blocks of each projection, for a kind whose graph has a projection tiling
    /// (`--versus-proj-blocks`); `None` for the others.
    fn proj_blocks(&self) -> Option<u32> {
        None
    }
    /// Sets the projection blocks of the next steps (only where [`LayerStep::proj_blocks`]
    /// is `Some`).
    fn set_proj_blocks(&mut self, _blocks: u32) {}
    /// Whether the kind's steps can replay a captured graph ([`LayerStep::set_replay`]).
    fn can_replay(&self) -> bool {
        false
    }
    /// Turns replay of the next steps on or off, and their check against a fresh capture
    /// (only where [`LayerStep::can_replay`]).
    fn set_replay(&mut self, _on: bool, _verify: bool) {}
    /// Token rows of the step (the activation rows of its projections).
    fn rows(&self) -> usize;
    /// The kernel paths the step runs on, one line.
    fn paths(&self) -> String {
        format_paths(self.rows(), None)
    }
}

/// `kernel paths: ...` of a DeepSeek-V4 step of `rows` token rows: the int8 products' path
/// at those rows (the AMX path's tiles start at
/// [`AMX_MIN_BATCH`](simpler_kernels_cpu::gemm_i8::AMX_MIN_BATCH) rows: below, its products
/// run on AVX-512 VNNI), for an attention step `attn` the bf16 projections' GEMM path and
/// layout (for its `Wq_a`, `[q_lora, hidden]`) and the sparse attention's engine, the vector
/// kernels' path (hc, norms, RoPE, pooling), and this CPU's best.
pub(crate) fn format_paths(rows: usize, attn: Option<(&Dsv4Config, usize)>) -> String {
    use simpler_kernels_cpu::gemm_i8::AMX_MIN_BATCH;
    let isa = Isa::current();
    let capped = match std::env::var("SIMPLER_ISA") {
        Ok(v) => format!(", SIMPLER_ISA={v}"),
        Err(_) => String::new(),
    };
    let int8 = match I8Path::current() {
        I8Path::Amx if rows < AMX_MIN_BATCH => format!(
            "{} ({rows} rows; amx-int8 from {AMX_MIN_BATCH})",
            I8Path::Avx512Vnni.name()
        ),
        p => format!("{} ({rows} rows)", p.name()),
    };
    let attention = attn.map_or(String::new(), |(c, heads)| {
        let layout =
            simpler_models::dsv4::bf16_layout::projection_kernel_layout(c.q_lora_rank, c.hidden);
        let name = match layout {
            simpler_kernels_cpu::WeightLayout::RowMajor => "row-major",
            simpler_kernels_cpu::WeightLayout::Pairs => "paired",
            simpler_kernels_cpu::WeightLayout::Tiled => "tiled",
        };
        format!(
            ", bf16 GEMM {} (bf16 matrices {name}), sparse attention {}",
            simpler_kernels_cpu::path_for(Isa::detected(), rows, layout).name(),
            simpler_kernels_cpu::dsv4::attention::engine(isa, heads, c.head_dim)
        )
    });
    format!(
        "kernel paths: int8 products {int8}{attention}, vector kernels {}; this CPU's best path {}{capped}",
        isa.name(),
        Isa::hardware().name()
    )
}

/// The step of `layer` on `cfg`'s shapes at `starts`.
fn prepare(
    layer: LayerArg,
    cfg: &Dsv4Config,
    starts: &[usize],
    case: &CaseArgs,
    worker: &Worker,
) -> Result<Box<dyn LayerStep>> {
    let seed = case.seed;
    if layer == LayerArg::Moe && case.real_tokens.is_some() {
        bail!("--real-tokens: padding rows apply to swa, csa and hca, not moe");
    }
    let real = case.real_tokens(starts)?;
    let attn = |kind| -> Result<Box<dyn LayerStep>> {
        Ok(Box::new(AttnCase::new(
            worker, cfg, starts, &real, seed, kind,
        )?))
    };
    match layer {
        LayerArg::Swa => attn(LayerKind::Swa),
        LayerArg::Hca => attn(LayerKind::Hca),
        LayerArg::Csa => attn(LayerKind::Csa),
        LayerArg::Moe => Ok(Box::new(crate::dsv4_moe::MoeStep::new(
            worker,
            cfg,
            starts,
            seed,
            case.hash_routing(),
        )?)),
    }
}

/// An SWA, CSA or HCA layer with its fixture.
struct AttnCase {
    kind: LayerKind,
    cfg: Dsv4Config,
    starts: Vec<usize>,
    weights: AttnWeights,
    window: WindowCache,
    hca: Option<HcaParts>,
    csa: Option<CsaParts>,
    inputs: StepInputs,
    layer: AttnLayer,
}

/// Uploads the layer of `kind` (its compressor parts in `hca` or `csa`).
fn upload_layer(
    worker: &Worker,
    cfg: &Dsv4Config,
    weights: &AttnWeights,
    window: &WindowCache,
    hca: Option<&HcaParts>,
    csa: Option<&CsaParts>,
    batch: usize,
) -> Result<AttnLayer> {
    Ok(match csa {
        Some(p) => AttnLayer::upload_csa(worker, cfg, weights, window, p, batch)?,
        None => AttnLayer::upload(worker, cfg, weights, window, hca, batch)?,
    })
}

impl AttnCase {
    fn new(
        worker: &Worker,
        cfg: &Dsv4Config,
        starts: &[usize],
        real_tokens: &[usize],
        seed: u64,
        kind: LayerKind,
    ) -> Result<AttnCase> {
        let weights = generate_attn_weights(cfg, seed);
        let window = generate_window_cache(cfg, starts, seed);
        let hca = (kind == LayerKind::Hca).then(|| generate_hca(cfg, starts, seed));
        let csa = (kind == LayerKind::Csa).then(|| generate_csa(cfg, starts, seed));
        let mut inputs = generate_inputs(cfg, starts, seed);
        inputs.real_tokens = real_tokens.to_vec();
        let layer = upload_layer(
            worker,
            cfg,
            &weights,
            &window,
            hca.as_ref(),
            csa.as_ref(),
            starts.len(),
        )?;
        Ok(AttnCase {
            kind,
            cfg: cfg.clone(),
            starts: starts.to_vec(),
            weights,
            window,
            hca,
            csa,
            inputs,
            layer,
        })
    }
}

impl LayerStep for AttnCase {
    fn rows(&self) -> usize {
        self.starts.len() * TOKENS_PER_SEQ
    }

    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "{} layer: hidden {}, {} heads x {} ({} roped), window {}{}, batch {} x {} tokens at starts {:?}",
            match self.kind {
                LayerKind::Hca => "HCA",
                LayerKind::Csa => "CSA",
                LayerKind::Swa => "SWA",
            },
            c.hidden,
            c.n_heads,
            c.head_dim,
            c.rope_dim,
            c.window,
            match self.kind {
                LayerKind::Hca => format!(", compressed every {} positions", c.hca_ratio),
                LayerKind::Csa => format!(
                    ", overlapping windows of {} positions, top-{} by {} index heads x {}",
                    c.csa_ratio, c.index_topk, c.index_heads, c.index_head_dim
                ),
                LayerKind::Swa => String::new(),
            },
            self.starts.len(),
            TOKENS_PER_SEQ,
            self.starts
        ) + &padding_note(&self.inputs.real_tokens)
    }

    fn step(&mut self, worker: &Worker, cfg: &CallConfig) -> Result<RunReport> {
        Ok(self.layer.step(worker, &self.inputs, cfg)?.report)
    }

    fn can_replay(&self) -> bool {
        true
    }

    fn set_replay(&mut self, on: bool, verify: bool) {
        self.layer.replay = on;
        self.layer.verify_replay = verify;
    }

    fn paths(&self) -> String {
        let heads = self.cfg.n_heads / self.layer.tiles.head_blocks.max(1);
        format_paths(self.rows(), Some((&self.cfg, heads)))
    }

    fn check(&mut self, worker: &Worker, cfg: &CallConfig) -> Result<Vec<(String, bool)>> {
        let c = &self.cfg;
        let mut fresh = upload_layer(
            worker,
            c,
            &self.weights,
            &self.window,
            self.hca.as_ref(),
            self.csa.as_ref(),
            self.starts.len(),
        )?;
        let out = fresh.step(worker, &self.inputs, cfg)?;
        let caches = fresh.read_caches()?;
        let g = match (&self.hca, &self.csa) {
            (Some(h), _) => hca_step(c, &self.weights, &self.window, h, &self.inputs),
            (None, Some(p)) => csa_step(c, &self.weights, &self.window, p, &self.inputs),
            (None, None) => swa_step(c, &self.weights, &self.window, &self.inputs),
        };
        let mut checks = attn_step_checks(&self.window, self.hca.as_ref(), &g, &out, &caches);
        if let (Some(p), Some(cc)) = (&self.csa, &caches.csa) {
            checks.extend(csa_cache_checks(p, &g, cc));
            checks.push((
                "indexer picks",
                csa_pick_check(&g, &out.csa_picks, p.cache.max_rows),
            ));
        }
        Ok(checks
            .into_iter()
            .map(|(what, r)| match r {
                Ok(o) => (
                    format!(
                        "ok: {what}: {} of {} elements over (worst {:.2e})",
                        o.over, o.n, o.worst_value
                    ),
                    true,
                ),
                Err(e) => (format!("FAILED: {e}"), false),
            })
            .collect())
    }

    fn cost(&self) -> LayerCost {
        LayerCost::attn_step(&self.cfg, self.kind, &self.starts)
    }

    fn proj_blocks(&self) -> Option<u32> {
        Some(self.layer.tiles.proj_blocks)
    }

    fn set_proj_blocks(&mut self, blocks: u32) {
        self.layer.tiles.proj_blocks = blocks;
    }
}

/// `", real tokens [..] (N padding rows, written nowhere)"` when a row is padding.
fn padding_note(real: &[usize]) -> String {
    let pad: usize = real.iter().map(|&n| TOKENS_PER_SEQ - n).sum();
    if pad == 0 {
        return String::new();
    }
    format!(
        ", real tokens {real:?} ({pad} padding rows, written nowhere; bytes below count them as a full step's)"
    )
}

/// The starts of `--start-pos` (or the mixed starts), checked against the configuration.
fn starts_of(case: &CaseArgs, cfg: &Dsv4Config) -> Result<Vec<usize>> {
    starts_at(case.start_pos, &case.preset, cfg)
}

/// The starts of `--start-pos start_pos` (or the mixed starts) on `--preset preset`'s `cfg`.
pub(crate) fn starts_at(
    start_pos: Option<usize>,
    preset: &str,
    cfg: &Dsv4Config,
) -> Result<Vec<usize>> {
    let starts = match start_pos {
        Some(n) => uniform_starts(n).to_vec(),
        None => MIXED_STARTS.to_vec(),
    };
    let last = starts
        .iter()
        .max()
        .copied()
        .unwrap_or(0)
        .checked_add(TOKENS_PER_SEQ - 1);
    if last.is_none_or(|l| l >= cfg.max_position) {
        bail!(
            "--start-pos {}: the step's last position {} past max_position {} of --preset {preset}",
            start_pos.unwrap_or(0),
            last.map_or("would be".to_string(), |l| format!("{l} is")),
            cfg.max_position,
        );
    }
    Ok(starts)
}

/// This machine's int8 dot-product peak on the path a step of `rows` rows takes, GOP/s over
/// all threads (0 when no SIMD int8 path was measured), and the path's name (saying so when
/// the figure is a lower bound: every run had a thread held off its CPU).
pub(crate) fn int8_peak(threads: usize, seconds: f64) -> (f64, String) {
    let path = I8Path::detected();
    let budget = Duration::from_secs_f64((seconds / 4.0).max(0.1));
    int8_peaks(threads, budget)
        .into_iter()
        .find(|p| p.path == path)
        .map_or((0.0, "portable (not measured)".to_string()), |p| {
            let note = if p.lower_bound {
                "; a lower bound: a thread was held off its CPU in every run"
            } else {
                ""
            };
            (p.gops_all, format!("{}{note}", p.path.name()))
        })
}

/// The denominators: bandwidth, the best float matrix peak, the int8 peak.
fn peaks_of(m: &MachinePeaks, int8_gops: f64) -> Peaks {
    Peaks {
        gbs: m.read_gbs_all,
        gflops: m.matmul_gflops_all(Isa::detected()),
        // A portable-only machine has no measured int8 peak: count int8 at the FMA rate.
        int8_gops: if int8_gops > 0.0 {
            int8_gops
        } else {
            m.fma_gflops_all
        },
    }
}

/// The per-phase table over the measured steps: each phase's span (its timing slot) as the
/// median, the quickest and the last step had it, its bytes, and the GB/s and share of its
/// bound at the machine's limits for the median span. One step's spans move by tens of
/// percent on a shared host, so a comparison of two builds reads the medians.
///
/// `spans[step][phase]`, in the order the steps ran (the last row is the last step).
fn format_phases(cost: &LayerCost, peaks: &Peaks, spans: &[Vec<f64>]) -> String {
    let mut s = String::from(
        "  phase              median_us     min_us    last_us      MB     GB/s   bound_us  % of bound\n",
    );
    for (i, p) in cost.phases.iter().enumerate() {
        let of_phase: Vec<f64> = spans.iter().filter_map(|st| st.get(i).copied()).collect();
        let (med, min, last) = match of_phase.last() {
            Some(&last) => {
                let sum = Summary::of(&of_phase);
                (sum.median, sum.min, last)
            }
            None => (0.0, 0.0, 0.0),
        };
        let bound = LayerCost::phase_s(p, peaks) * 1e6;
        let per = |v: f64| if med > 0.0 { v / med } else { 0.0 };
        s += &format!(
            "  {:<18} {:>10.1} {:>10.1} {:>10.1} {:>7.2} {:>8.2} {:>10.1} {:>10.1}%\n",
            p.name,
            med,
            min,
            last,
            p.bytes / 1e6,
            per(p.bytes / 1e3),
            bound,
            per(100.0 * bound),
        );
    }
    s
}

/// The line above [`format_phases`]'s table.
fn phases_title(steps: usize) -> String {
    format!(
        "per phase over the {steps} measured steps (span = first start to last end of the phase's tasks; GB/s and % of bound from the median):"
    )
}

/// Each timing slot's span of `report` for the first `phases` slots, us (0 where a slot has
/// no task): the lengths of [`phase_intervals`].
fn phase_spans(report: &RunReport, phases: usize) -> Vec<f64> {
    spans_us(&phase_intervals(report, phases))
}

/// The lengths of phase intervals, us (0 for a phase without one).
fn spans_us(intervals: &[Option<Interval>]) -> Vec<f64> {
    intervals
        .iter()
        .map(|s| s.map_or(0.0, |s| s.us()))
        .collect()
}

/// Each timing slot's interval of `report` (earliest dispatch to latest finish) for the first
/// `phases` slots; `None` where a slot had no task or an empty span.
fn phase_intervals(report: &RunReport, phases: usize) -> Vec<Option<Interval>> {
    (0..phases)
        .map(|i| {
            let slot = u8::try_from(i).unwrap_or(u8::MAX);
            report
                .task_slots
                .iter()
                .find(|t| t.slot == slot && t.span.dur_ns() > 0)
                .map(|t| t.span)
        })
        .collect()
}

/// Whether two phases' spans ran side by side in a step: their intersection is at least a
/// twentieth of the shorter one (an edge where the next phase's first task starts as the
/// last of the previous one ends is not).
fn side_by_side(a: Interval, b: Interval) -> bool {
    let inter = a
        .end_ns
        .min(b.end_ns)
        .saturating_sub(a.start_ns.max(b.start_ns));
    inter > 0 && inter.saturating_mul(20) >= a.dur_ns().min(b.dur_ns())
}

/// The length of the union of the spans of phases `members` in one step, ns (phases without a
/// span add nothing).
fn union_ns(spans: &[Option<Interval>], members: &[usize]) -> u64 {
    let mut iv: Vec<Interval> = members
        .iter()
        .filter_map(|&i| spans.get(i).copied().flatten())
        .collect();
    iv.sort_by_key(|s| s.start_ns);
    let mut total = 0;
    let mut cur: Option<Interval> = None;
    for s in iv {
        cur = match cur {
            Some(c) if s.start_ns < c.end_ns => Some(Interval {
                start_ns: c.start_ns,
                end_ns: c.end_ns.max(s.end_ns),
            }),
            Some(c) => {
                total += c.dur_ns();
                Some(s)
            }
            None => Some(s),
        };
    }
    total + cur.map_or(0, |c| c.dur_ns())
}

/// The lines after [`format_phases`]'s table for the phases whose tasks ran side by side (a
/// phase's tasks can start while an earlier phase's still run, where the graph lets them):
/// each such phase's own span then counts time it shared, so its "% of bound" alone says
/// little. Two phases are joined where they ran [`side_by_side`] in at least half of the
/// steps (`spans[step][phase]`); for each group so joined, the median over the steps of the
/// length of the union of its spans against the sum of their bounds. Empty when no phases
/// were joined.
fn format_overlaps(cost: &LayerCost, peaks: &Peaks, spans: &[Vec<Option<Interval>>]) -> String {
    let n = cost.phases.len();
    let mut pairs = vec![vec![0usize; n]; n];
    for step in spans {
        for (i, row) in pairs.iter_mut().enumerate() {
            for (j, count) in row.iter_mut().enumerate().skip(i + 1) {
                if let (Some(Some(a)), Some(Some(b))) = (step.get(i), step.get(j))
                    && side_by_side(*a, *b)
                {
                    *count += 1;
                }
            }
        }
    }
    // Each phase's group, named by its lowest member.
    let mut group: Vec<usize> = (0..n).collect();
    for (i, row) in pairs.iter().enumerate() {
        for (j, &count) in row.iter().enumerate().skip(i + 1) {
            if count > 0 && 2 * count >= spans.len() {
                let (from, to) = (group[i].max(group[j]), group[i].min(group[j]));
                for g in group.iter_mut().filter(|g| **g == from) {
                    *g = to;
                }
            }
        }
    }
    let mut s = String::new();
    for g in 0..n {
        let members: Vec<usize> = (0..n).filter(|&i| group[i] == g).collect();
        if members.len() < 2 {
            continue;
        }
        if s.is_empty() {
            s += "  side by side (phases whose tasks ran together in most steps; each one's span above includes the time it shared):\n";
        }
        let names: Vec<&str> = members.iter().map(|&i| cost.phases[i].name).collect();
        let bound: f64 = members
            .iter()
            .map(|&i| LayerCost::phase_s(&cost.phases[i], peaks) * 1e6)
            .sum();
        let unions: Vec<f64> = spans
            .iter()
            .map(|st| union_ns(st, &members) as f64 / 1e3)
            .collect();
        let med = Summary::of(&unions).median;
        let pct = if med > 0.0 { 100.0 * bound / med } else { 0.0 };
        s += &format!(
            "    {}: together median {med:.1} us against their bounds' sum {bound:.1} us = {pct:.1}%\n",
            names.join(" + "),
        );
    }
    s
}

/// The summary lines of a step time (seconds) against the cost; `pass` names the
/// bandwidth pass `peaks` holds (`best pass`: a best case, which the line says).
fn format_ratios(cost: &LayerCost, peaks: &Peaks, t: f64, what: &str, pass: &str) -> String {
    let gbs = cost.bytes() / t / 1e9;
    let bound = cost.phase_bound_s(peaks);
    let roof = cost.roofline_s(peaks);
    format!(
        "  {what}: {:.1} us; bytes/step {:.2} MB -> {gbs:.2} GB/s = {:.1}% of membw's {pass} ({:.1} GB/s); per-phase bound {:.1} us = {:.1}% achieved; roofline bound {:.1} us = {:.1}%",
        t * 1e6,
        cost.bytes() / 1e6,
        100.0 * gbs / peaks.gbs,
        peaks.gbs,
        bound * 1e6,
        100.0 * bound / t,
        roof * 1e6,
        100.0 * roof / t
    )
}

/// The fixture, worker and measured machine of a command.
struct Setup {
    worker: Worker,
    step: Box<dyn LayerStep>,
    machine: MachinePeaks,
    int8: (f64, String),
    /// The read before each step that evicts the last-level cache; `None` with `--warm-cache`.
    flush: Option<CacheFlush>,
}

impl Setup {
    /// Evicts the last-level cache before a step, unless the caches stay warm.
    fn flush_cache(&self) {
        if let Some(f) = &self.flush {
            f.run();
        }
    }
}

fn setup(layer: LayerArg, case: &CaseArgs, run: &RunOpts) -> Result<Setup> {
    let cfg = Dsv4Config::preset(&case.preset)?;
    let starts = starts_of(case, &cfg)?;
    let worker = run.worker()?;
    ops::register(&worker)?;
    let step = prepare(layer, &cfg, &starts, case, &worker)?;
    let machine = machine_peaks(case.membw_seconds());
    let int8 = int8_peak(machine.threads, case.membw_seconds());
    let flush = (!case.warm_cache).then(|| CacheFlush::new(machine.threads));
    Ok(Setup {
        worker,
        step,
        machine,
        int8,
        flush,
    })
}

/// The line saying what the caches hold when a step starts.
fn format_cache_state(flush: Option<&CacheFlush>) -> String {
    match flush {
        Some(f) => format!(
            "caches: each step starts after {} (not timed), so the layer comes from memory as in a whole model",
            f.describe()
        ),
        None => "caches: warm (--warm-cache): steps run back to back, and a layer that fits the last-level cache is partly read from it".into(),
    }
}

/// The measured rounds of a command.
struct Measured {
    /// Effective times, us.
    eff: Vec<f64>,
    /// Host step times, us.
    wall: Vec<f64>,
    /// Each round's validity, for kinds that judge it ([`LayerStep::round_valid`]).
    valid: Vec<Option<bool>>,
    /// Each measured round's phase spans, us ([`phase_spans`]).
    phases: Vec<Vec<f64>>,
    /// Each measured round's phase intervals ([`phase_intervals`]).
    intervals: Vec<Vec<Option<Interval>>>,
    /// The measured steps' reports, in order (the last is the last step's).
    reports: Vec<RunReport>,
}

impl Measured {
    /// The last step's report.
    fn last(&self) -> &RunReport {
        self.reports
            .last()
            .expect("measure runs at least one round")
    }
}

/// Runs `warmup + rounds` steps.
fn measure(s: &mut Setup, cfg: &CallConfig, warmup: usize, rounds: usize) -> Result<Measured> {
    let (mut eff, mut wall, mut valid, mut phases, mut intervals) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let n_phases = s.step.cost().phases.len();
    let mut reports = Vec::with_capacity(rounds);
    for i in 0..warmup + rounds {
        s.flush_cache();
        let t = Instant::now();
        let r = s.step.step(&s.worker, cfg)?;
        let dt = t.elapsed().as_secs_f64() * 1e6;
        if i >= warmup {
            eff.push(r.effective().us());
            wall.push(dt);
            valid.push(s.step.round_valid());
            let iv = phase_intervals(&r, n_phases);
            phases.push(spans_us(&iv));
            intervals.push(iv);
            reports.push(r);
        }
    }
    if reports.is_empty() {
        bail!("--rounds must be at least 1");
    }
    Ok(Measured {
        eff,
        wall,
        valid,
        phases,
        intervals,
        reports,
    })
}

/// The command's step and call configuration, after printing what runs.
fn start(
    cmd: &str,
    flag: &str,
    layer: LayerArg,
    case: &CaseArgs,
    run: &RunOpts,
    (warmup, rounds): (usize, usize),
    replay: Option<Replay>,
) -> Result<(Setup, CallConfig)> {
    crate::opts::check_rounds(warmup, rounds)?;
    let mut s = setup(layer, case, run)?;
    let replay = replay.unwrap_or(Replay::On);
    s.step.set_replay(replay.on(), replay.verify());
    let cfg = run.call_config("dsv4")?;
    println!(
        "simpler {cmd} dsv4 {flag} {}: {}; {} cores",
        layer.name(),
        s.step.describe(),
        s.worker.cores()
    );
    println!("{}", format_diagnostics(&Diagnostics::of(&cfg)));
    println!("{}", format_cache_state(s.flush.as_ref()));
    Ok((s, cfg))
}

/// This machine's limits after the measurement (the better of the passes before and after),
/// printed, as the denominators of the step's ratios; and the same with the bandwidth at
/// membw's median pass instead of its best (what the median step is also set against: on
/// Zen 4 the 2-thread passes jump between ~35 and ~60 GB/s within one measurement, so the best
/// pass can be a state the median step mostly did not see).
fn finish_peaks(s: &Setup, case: &CaseArgs) -> (Peaks, Peaks) {
    let machine = best_peaks(&s.machine, &machine_peaks(case.membw_seconds().min(1.0)));
    println!("{}", format_peaks(&machine));
    println!(
        "int8 dot-product peak ({}): {:.1} GOP/s",
        s.int8.1, s.int8.0
    );
    println!("{}", s.step.paths());
    let peaks = peaks_of(&machine, s.int8.0);
    let median_pass = Peaks {
        gbs: machine.read_gbs_all_median,
        ..peaks
    };
    (peaks, median_pass)
}

/// Refuses `--replay` where it does not apply, before anything runs.
fn check_replay(layer: LayerArg, replay: Option<Replay>) -> Result<()> {
    if replay.is_some() && layer == LayerArg::Moe {
        bail!(
            "--replay: the moe layer's steps are orchestrated every step; it applies to swa, csa and hca"
        );
    }
    Ok(())
}

pub(crate) fn run(args: RunDsv4Args) -> Result<()> {
    check_replay(args.layer, args.replay)?;
    args.case.check_routing(&[args.layer])?;
    args.case.check_start(&[args.layer])?;
    if let Some(cmd) = ep_cmd_of_run(&args)? {
        return crate::dsv4_ep::main(cmd);
    }
    args.run.refuse_diag_steps("run dsv4")?;
    let (mut s, cfg) = start(
        "run",
        "--layer",
        args.layer,
        &args.case,
        &args.run,
        (args.warmup, args.rounds),
        args.replay,
    )?;
    if args.check {
        println!("check vs golden:");
        let lines = s.step.check(&s.worker, &cfg)?;
        for (line, _) in &lines {
            println!("  {line}");
        }
        if lines.iter().any(|(_, ok)| !ok) {
            bail!("the step differs from the golden beyond the spec's tolerance");
        }
    }
    let m = measure(&mut s, &cfg, args.warmup, args.rounds)?;
    opts::emit(m.last(), &cfg)?;
    let (peaks, median_pass) = finish_peaks(&s, &args.case);
    print!("{}", opts::format_report(m.last()));
    if s.step.can_replay() {
        println!(
            "{}",
            describe_graphs(replay_of(args.replay), m.reports.iter())
        );
    }
    let Measured {
        eff,
        wall,
        phases,
        intervals,
        ..
    } = m;
    let cost = s.step.cost();
    println!("{}", phases_title(phases.len()));
    print!("{}", format_phases(&cost, &peaks, &phases));
    print!("{}", format_overlaps(&cost, &peaks, &intervals));
    let (e, w) = (Summary::of(&eff), Summary::of(&wall));
    println!("  {}", format_summary("effective_us", &e, args.warmup));
    println!("  {}", format_summary("host_step_us", &w, args.warmup));
    println!(
        "{}",
        format_ratios(
            &cost,
            &peaks,
            e.median / 1e6,
            "median step (effective)",
            "best pass (best case)"
        )
    );
    println!(
        "{}",
        format_ratios(
            &cost,
            &peaks,
            e.min / 1e6,
            "quietest step (effective)",
            "best pass (best case)"
        )
    );
    println!(
        "{}",
        format_ratios(
            &cost,
            &median_pass,
            e.median / 1e6,
            "median step (effective) at membw's median pass",
            "median pass"
        )
    );
    Ok(())
}

pub(crate) fn bench(args: BenchDsv4Args) -> Result<()> {
    for (i, k) in args.kernel.iter().enumerate() {
        if args.kernel[..i].contains(k) {
            bail!("--kernel: {} is given twice", k.name());
        }
    }
    args.case.check_routing(&args.kernel)?;
    args.case.check_start(&args.kernel)?;
    if args.case.real_tokens.is_some() {
        bail!(
            "--real-tokens: bench dsv4 measures whole steps (every row real); use it with run dsv4"
        );
    }
    let has_moe = args.kernel.contains(&LayerArg::Moe);
    if has_moe {
        check_replay(LayerArg::Moe, args.replay)?;
    }
    let versus_isa = isa_flag("--versus-isa", args.versus_isa.as_deref())?;
    match args.versus_proj_blocks {
        Some(0) => bail!("--versus-proj-blocks: at least 1 block"),
        Some(b) if b > MAX_PROJ_BLOCKS => bail!(
            "--versus-proj-blocks {b}: at most {MAX_PROJ_BLOCKS} (FLASH's widest projection, `q_b`, has 2048 16-row units; blocks past a projection's units run empty, and each costs a dispatch)"
        ),
        _ => {}
    }
    if args.versus_replay && has_moe {
        bail!(
            "--versus-replay: the moe layer's steps are orchestrated every step; it applies to swa, csa and hca"
        );
    }
    if args.versus_replay && matches!(args.replay, Some(Replay::Off | Replay::Verify)) {
        bail!(
            "--versus-replay compares replayed steps with orchestrated ones; drop --replay {}",
            replay_of(args.replay).name()
        );
    }
    if args.versus_proj_blocks.is_some() && has_moe {
        bail!(
            "--versus-proj-blocks: the moe layer's experts have their own blocks; it applies to swa, csa and hca"
        );
    }
    if let Some(cmd) = ep_cmd_of_bench(&args)? {
        // The expert-parallel driver runs its own ranks' steps: a comparison flag would be
        // ignored there, so it is refused instead.
        for (flag, given) in [
            ("--versus-isa", versus_isa.is_some()),
            ("--versus-proj-blocks", args.versus_proj_blocks.is_some()),
            ("--versus-replay", args.versus_replay),
        ] {
            if given {
                bail!("{flag}: not with --ep (the expert-parallel ranks run their own steps)");
            }
        }
        return crate::dsv4_ep::main(cmd);
    }
    args.run.refuse_diag_steps("bench dsv4")?;
    let mut rows = Vec::with_capacity(args.kernel.len());
    for (i, &layer) in args.kernel.iter().enumerate() {
        if i > 0 {
            println!();
        }
        rows.push(bench_layer(&args, layer, versus_isa)?);
    }
    if rows.len() > 1 {
        println!();
        print!("{}", format_layer_table(&rows));
    }
    Ok(())
}

/// One layer's line of `bench dsv4`'s closing table: its step times against its own run's
/// per-phase bound.
#[derive(Debug)]
struct LayerRow {
    layer: LayerArg,
    /// The quietest and the median step, us.
    quietest_us: f64,
    median_us: f64,
    /// The per-phase bound at the layer's run's limits, us.
    bound_us: f64,
    /// Those limits: streaming read GB/s and the int8 peak, GOP/s.
    gbs: f64,
    int8_gops: f64,
}

/// The table comparing the measured layers (each against its own run's limits, which the host's
/// drift moves between layers: the table prints them).
fn format_layer_table(rows: &[LayerRow]) -> String {
    let mut s = String::from(
        "layers (each on its own fixture, against the limits measured in its own run):\n  layer   quietest_us   median_us    bound_us   quietest   median   membw GB/s   int8 GOP/s\n",
    );
    for r in rows {
        let of = |t: f64| 100.0 * r.bound_us / t;
        s += &format!(
            "  {:<5} {:>13.1} {:>11.1} {:>11.1} {:>9.1}% {:>7.1}% {:>12.1} {:>12.1}\n",
            r.layer.name(),
            r.quietest_us,
            r.median_us,
            r.bound_us,
            of(r.quietest_us),
            of(r.median_us),
            r.gbs,
            r.int8_gops,
        );
    }
    s
}

/// Where a compressing layer's step changes the state its next round reads, a note that its
/// rounds are not one repeated step (the work is the same size). A token at position `p`
/// with `(p + 1) % ratio == 0` closes a window and pools rows of the compressor's ring; the
/// step's next token, if the step has one, then overwrites a slot that pooling read: the
/// window's first row in HCA's ring of `ratio` slots, the previous window's first row in
/// CSA's overlapping ring of `2 · ratio` (read only once a previous window exists, `p + 1 ≥
/// 2 · ratio`). A window closing on the step's last token changes nothing the next round reads.
fn closing_note(layer: LayerArg, case: &CaseArgs) -> Result<Option<String>> {
    let c = Dsv4Config::preset(&case.preset)?;
    let (ratio, first) = match layer {
        LayerArg::Csa => (c.csa_ratio, 2 * c.csa_ratio),
        LayerArg::Hca => (c.hca_ratio, c.hca_ratio),
        LayerArg::Swa | LayerArg::Moe => return Ok(None),
    };
    let closing: Vec<usize> = starts_of(case, &c)?
        .into_iter()
        .filter(|&s| (s..s + TOKENS_PER_SEQ - 1).any(|p| (p + 1) % ratio == 0 && p + 1 >= first))
        .collect();
    Ok((!closing.is_empty()).then(|| {
        format!(
            "note: a ratio-{ratio} compressor window closes inside the step at start(s) {closing:?}, so the rounds are not one repeated step (each starts from the state the last left; same work); --start-pos 8192 closes none"
        )
    }))
}

/// `bench dsv4` for one layer: its report, then its comparisons; its line of the closing table.
fn bench_layer(
    args: &BenchDsv4Args,
    layer: LayerArg,
    versus_isa: Option<simpler_kernels_cpu::Isa>,
) -> Result<LayerRow> {
    let (mut s, cfg) = start(
        "bench",
        "--kernel",
        layer,
        &args.case,
        &args.run,
        (args.warmup, args.rounds),
        args.replay,
    )?;
    // Each layer's diagnostics in a folder of its own, so the next layer's do not replace them.
    let several = args.kernel.len() > 1;
    let cfg = opts::case_config(&cfg, layer.name(), several);
    if several && let Some(dir) = &cfg.output_dir {
        println!("diagnostics of this layer: {}", dir.display());
    }
    if let Some(note) = closing_note(layer, &args.case)? {
        println!("{note}");
    }
    let m = measure(&mut s, &cfg, args.warmup, args.rounds)?;
    // The last measured step's spans and diagnostics, as `run dsv4` writes them.
    opts::emit(m.last(), &cfg)?;
    if s.step.can_replay() {
        println!(
            "{}",
            describe_graphs(replay_of(args.replay), m.reports.iter())
        );
    }
    let Measured {
        eff,
        valid,
        phases,
        intervals,
        ..
    } = m;
    let (peaks, median_pass) = finish_peaks(&s, &args.case);
    // A round judged invalid (the MoE's output differs from the first step's) does not count.
    let counted: Vec<f64> = eff
        .iter()
        .zip(&valid)
        .filter(|(_, v)| v.unwrap_or(true))
        .map(|(&t, _)| t)
        .collect();
    if counted.is_empty() {
        bail!(
            "{}: no measured round was valid (each differed from the first step's output): a race or a corrupted buffer, not a time to report",
            layer.name()
        );
    }
    let e = Summary::of(&counted);
    println!("{}", format_summary("effective_us", &e, args.warmup));
    let judged: Vec<(f64, bool)> = eff
        .iter()
        .zip(&valid)
        .filter_map(|(&t, v)| v.map(|v| (t, v)))
        .collect();
    if !judged.is_empty() {
        // One rank: the fastest rank of a round is its only one.
        println!(
            "{}",
            format_summary(
                "fast_effective_us (one rank: its own time)",
                &e,
                args.warmup
            )
        );
        println!("{}", crate::dsv4_moe::format_moe_rounds(&judged)?);
    }
    let cost = s.step.cost();
    println!(
        "{}",
        format_ratios(
            &cost,
            &peaks,
            e.median / 1e6,
            "median step",
            "best pass (best case)"
        )
    );
    println!(
        "{}",
        format_ratios(
            &cost,
            &peaks,
            e.min / 1e6,
            "quietest step",
            "best pass (best case)"
        )
    );
    println!(
        "{}",
        format_ratios(
            &cost,
            &median_pass,
            e.median / 1e6,
            "median step at membw's median pass",
            "median pass"
        )
    );
    println!("{}", phases_title(phases.len()));
    let row = LayerRow {
        layer,
        quietest_us: e.min,
        median_us: e.median,
        bound_us: cost.phase_bound_s(&peaks) * 1e6,
        gbs: peaks.gbs,
        int8_gops: peaks.int8_gops,
    };
    print!("{}", format_phases(&cost, &peaks, &phases));
    print!("{}", format_overlaps(&cost, &peaks, &intervals));
    if let Some(b) = args.versus_proj_blocks {
        let c = versus_proj_blocks(&mut s, &cfg, b, args.rounds, args.warmup)?;
        println!(
            "projection blocks compared (interleaved steps A B B A ..; median of the paired B/A ratios with a bootstrap interval):"
        );
        println!("{c}");
    }
    if let Some(isa) = versus_isa {
        println!(
            "kernel paths compared (interleaved steps A B B A ..; median of the paired B/A ratios with a bootstrap interval):"
        );
        print!(
            "{}",
            versus_isa_steps(&mut s, &cfg, isa, args.rounds, args.warmup)?
        );
    }
    if args.versus_replay {
        let c = versus_replay(&mut s, &cfg, args.rounds, args.warmup)?;
        println!(
            "replay compared (A: captured graph replayed, B: orchestrated; interleaved steps A B B A ..; median of the paired B/A ratios with a bootstrap interval):"
        );
        println!("{c}");
    }
    Ok(row)
}

/// `--replay`'s value, `on` when not given.
fn replay_of(r: Option<Replay>) -> Replay {
    r.unwrap_or(Replay::On)
}

/// Interleaved steps A B B A .. (`warmup` pairs discarded, then `rounds`): replayed (A) and
/// orchestrated (B); the effective times compared and the orchestration spans of each,
/// formatted. Replay stays on afterwards.
fn versus_replay(s: &mut Setup, cfg: &CallConfig, rounds: usize, warmup: usize) -> Result<String> {
    let (pairs, sides) =
        interleaved_steps(s, cfg, rounds, warmup, |step, a| step.set_replay(a, false))?;
    s.step.set_replay(true, false);
    let c = pairs.compare();
    let [a, b] = sides.orch.map(|v| Summary::of(&v).median);
    Ok(format!(
        "{}\n    orchestration span (median over every step): replay {a:.0} us (the submission loop), orchestrated {b:.0} us",
        format_compare("effective_us", "replayed", "orchestrated", &c)
    ))
}

/// Interleaved steps A B B A .. (`warmup` pairs discarded, then `rounds`) on this run's kernel
/// path (A) and on `isa` (B, a process-wide switch, undone afterwards); the effective times
/// compared, then each phase's median span on either side over the measured steps,
/// formatted.
fn versus_isa_steps(
    s: &mut Setup,
    cfg: &CallConfig,
    isa: Isa,
    rounds: usize,
    warmup: usize,
) -> Result<String> {
    let result = interleaved_steps(s, cfg, rounds, warmup, |_, a| {
        set_process_isa((!a).then_some(isa));
    });
    set_process_isa(None);
    let (pairs, sides) = result?;
    let c = pairs.compare();
    // Each side names its bf16 path and the int8 path the cap leaves.
    let label = |isa: Isa| {
        format!(
            "{}, int8 {}",
            isa.name(),
            I8Path::hardware().capped(isa).name()
        )
    };
    let a_name = format!("{} (this run)", label(Isa::current()));
    let mut out = format_compare("effective_us", &a_name, &label(isa), &c);
    out.push('\n');
    let cost = s.step.cost();
    out.push_str(&format!(
        "    {:<24} {:>12} {:>12} {:>8}\n",
        "phase", "A median_us", "B median_us", "B/A"
    ));
    for (i, phase) in cost.phases.iter().enumerate() {
        let [a, b] = [0, 1].map(|side| {
            let v: Vec<f64> = sides.phases[side]
                .iter()
                .skip(warmup)
                .filter_map(|p| p.get(i).copied())
                .collect();
            Summary::of(&v).median
        });
        out.push_str(&format!(
            "    {:<24} {a:>12.1} {b:>12.1} {:>8.3}\n",
            phase.name,
            b / a
        ));
    }
    Ok(out)
}

/// What [`interleaved_steps`] records of each side's steps (index 0: A, 1: B), every step
/// (warm-up included) in order.
#[derive(Default)]
struct Sides {
    /// Orchestration spans, us.
    orch: [Vec<f64>; 2],
    /// Phase spans ([`phase_spans`]), us.
    phases: [Vec<Vec<f64>>; 2],
}

/// Interleaved steps A B B A .. (`warmup` pairs discarded, then `rounds`), each after the
/// cache flush, `set(step, true)` before every A step and `set(step, false)` before every B:
/// the effective times, and what [`Sides`] records. The first failed step's error fails the
/// comparison.
fn interleaved_steps(
    s: &mut Setup,
    cfg: &CallConfig,
    rounds: usize,
    warmup: usize,
    set: impl Fn(&mut dyn LayerStep, bool),
) -> Result<(simpler_dfx::bench_stats::Interleaved, Sides)> {
    let failure = RefCell::new(None);
    let sides = RefCell::new(Sides::default());
    let n_phases = s.step.cost().phases.len();
    let setup = RefCell::new(&mut *s);
    let step_us = |a: bool| {
        let mut s = setup.borrow_mut();
        set(&mut *s.step, a);
        s.flush_cache();
        let Setup { worker, step, .. } = &mut **s;
        match step.step(worker, cfg) {
            Ok(r) => {
                let mut sides = sides.borrow_mut();
                sides.orch[usize::from(!a)].push(r.orch.us());
                sides.phases[usize::from(!a)].push(phase_spans(&r, n_phases));
                r.effective().us()
            }
            Err(e) => {
                failure.borrow_mut().get_or_insert(e);
                f64::NAN
            }
        }
    };
    let pairs = run_interleaved(rounds, warmup, || step_us(true), || step_us(false));
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }
    Ok((pairs, sides.into_inner()))
}

/// Most SPMD blocks `--versus-proj-blocks` takes: twice the 16-row units of FLASH's widest
/// projection (`q_b`, 64 heads × 512).
const MAX_PROJ_BLOCKS: u32 = 4096;

/// Interleaved steps A B B A .. (`warmup` pairs discarded, then `rounds`) with this run's
/// projection blocks (A) and `blocks` (B); the effective times compared, formatted. The step
/// goes back to A's blocks afterwards.
fn versus_proj_blocks(
    s: &mut Setup,
    cfg: &CallConfig,
    blocks: u32,
    rounds: usize,
    warmup: usize,
) -> Result<String> {
    let Some(a) = s.step.proj_blocks() else {
        bail!("--versus-proj-blocks: this layer has no projection tiling to change");
    };
    let result = interleaved_steps(s, cfg, rounds, warmup, |step, first| {
        step.set_proj_blocks(if first { a } else { blocks })
    });
    s.step.set_proj_blocks(a);
    let (pairs, _) = result?;
    let c = pairs.compare();
    Ok(format_compare(
        "effective_us",
        &format!("{a} blocks (this run)"),
        &format!("{blocks} blocks"),
        &c,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use simpler_models::dsv4::PhaseCost;

    /// A layer cost of phases `names` that move 1 MB each and compute nothing.
    fn megabyte_phases(names: &[&'static str]) -> LayerCost {
        LayerCost {
            phases: names
                .iter()
                .map(|&name| PhaseCost {
                    name,
                    bytes: 1e6,
                    flops: 0.0,
                    int8_ops: 0.0,
                })
                .collect(),
        }
    }

    #[test]
    fn phases_that_ran_side_by_side_in_most_steps_are_reported_together() {
        // 1 MB per phase at 1000 GB/s: a 1 us bound each.
        let cost = megabyte_phases(&["first", "second", "third", "fourth"]);
        let peaks = Peaks {
            gbs: 1000.0,
            gflops: 1.0,
            int8_gops: 1.0,
        };
        let iv = |start_ns, end_ns| Some(Interval { start_ns, end_ns });
        // first and second overlap in two of three steps (by half, then a tenth of the
        // shorter span); third touches second, fourth overlaps third by 1% only.
        let spans = vec![
            vec![iv(0, 1000), iv(500, 2000), iv(2000, 3000), iv(2990, 4000)],
            vec![iv(0, 1000), iv(900, 2000), iv(2000, 3000), iv(2990, 4000)],
            vec![iv(0, 1000), iv(1000, 2000), iv(2000, 3000), None],
        ];
        let t = format_overlaps(&cost, &peaks, &spans);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2, "{t}");
        assert_eq!(
            lines[1].trim(),
            "first + second: together median 2.0 us against their bounds' sum 2.0 us = 100.0%"
        );
        // Overlapping in one step of three only: not joined.
        assert_eq!(format_overlaps(&cost, &peaks, &spans[2..]), "");
        let once = vec![spans[0].clone(), spans[2].clone(), spans[2].clone()];
        assert_eq!(format_overlaps(&cost, &peaks, &once), "");
        // The union counts shared time once and gaps not at all.
        let step = [iv(0, 10), iv(5, 20), iv(30, 40), None];
        assert_eq!(union_ns(&step, &[0, 1, 2, 3]), 30);
        assert_eq!(union_ns(&step, &[2]), 10);
    }

    #[test]
    fn the_phase_table_reads_every_measured_step() {
        // 1 MB per phase at 1 GB/s: a 1000 us bound each.
        let cost = megabyte_phases(&["first", "second"]);
        let peaks = Peaks {
            gbs: 1.0,
            gflops: 1.0,
            int8_gops: 1.0,
        };
        // Three steps; the second phase is missing from the last one's slots.
        let spans = vec![vec![3000.0, 500.0], vec![2000.0, 1000.0], vec![4000.0]];
        let t = format_phases(&cost, &peaks, &spans);
        let rows: Vec<Vec<&str>> = t
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().collect())
            .collect();
        // median 3000, quickest 2000, last 4000; 1 MB / 3000 us; bound 1000 of 3000.
        assert_eq!(
            rows[0],
            [
                "first", "3000.0", "2000.0", "4000.0", "1.00", "0.33", "1000.0", "33.3%"
            ]
        );
        // The steps that recorded the phase: median of 500 and 1000, the last of them 1000.
        assert_eq!(
            rows[1],
            [
                "second", "750.0", "500.0", "1000.0", "1.00", "1.33", "1000.0", "133.3%"
            ]
        );
        // No step at all: zeros, not a panic or a division by zero.
        let t = format_phases(&cost, &peaks, &[]);
        assert!(
            t.lines().nth(1).is_some_and(|l| l.ends_with(" 0.0%")),
            "{t}"
        );
    }
}
