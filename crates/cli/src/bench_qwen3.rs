//! `simpler bench qwen3-decode`: decode at several batch × context shapes (bytes per step,
//! GB/s and % of membw, % of the roofline bound, and the share of the step spent outside
//! kernels), with warm-up, rounds and interval statistics.
//!
//! "Outside kernels" is measured on one extra step recorded at swimlane level 1:
//! `1 - sum of kernel busy time / (cores x effective)`, i.e. the share of the cores' time
//! during `effective` (orch ∪ sched) that no kernel was running (runtime dispatch and completion,
//! dependency waits, load imbalance at phase ends, the orchestrator thread sharing the cores).

use std::cell::RefCell;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use simpler_core::{CallConfig, OutsideShare, RunReport, Worker};
use simpler_dfx::bench_stats::{
    Comparison, Diagnostics, Summary, format_compare, format_diagnostics, format_summary,
    run_interleaved,
};
use simpler_kernels_cpu::{I8Layout, I8Path, Isa, attention, set_process_isa, w8a8_path};
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{
    DecodePeaks, DecodePhases, Int8Acts, RunShape, Session, StepCost, TilePolicy, WeightFormat, ops,
};

use crate::opts::RunOpts;
use crate::qwen3_cmd::{
    DecodeCase, ModelArgs, Replay, TileArgs, describe_graphs, describe_weights, load_model,
    load_weights, upload, upload_keeping,
};
use crate::qwen3_decode::{best_peaks, format_peaks, machine_peaks};

/// Arguments of `simpler bench qwen3-decode`.
#[derive(Args, Debug)]
pub(crate) struct DecodeBenchArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Shapes to measure, `BATCHxSEQ_LEN`, comma-separated [default: 1x256,4x1024,16x1024;
    /// with `--platform cuda`: 1x512,16x3500].
    #[arg(long, value_delimiter = ',')]
    shapes: Option<Vec<String>>,
    /// Decoder layers [default: all of the model's].
    #[arg(long)]
    layers: Option<usize>,
    /// One weight set for every layer (presets).
    #[arg(long)]
    shared_weights: bool,
    /// Warm-up rounds per shape (discarded; one step each).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Measured rounds per shape: a bench round is one step, replayed from the same state
    /// (as `run`'s rounds replay their steps).
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Seconds spent measuring this machine's bandwidth and FMA peak first (at least 0.2 are)
    /// [default: 2].
    #[arg(long, value_parser = crate::opts::seconds, value_name = "SECONDS")]
    membw_seconds: Option<f64>,
    /// Also measure the cost of span tracing: for each shape, steps without a trace (A) and
    /// with every step's spans written to a trace file (B), interleaved A B B A ..., reported as
    /// the median of the paired step-time ratios B/A with its 95% interval.
    #[arg(long)]
    trace_overhead: bool,
    /// Also compare this run's tiling with another, step against step: `KEY=VALUE` pairs
    /// (`tile-kib`, `tiles-per-core`, `max-kv-chunk`) applied on top of it, e.g.
    /// `max-kv-chunk=1024`. Each shape then runs interleaved steps A B B A .. and reports
    /// the median of the paired step-time ratios B/A with its 95% interval (pairs of neighbouring
    /// steps see the same host load, where separate runs do not).
    #[arg(long, value_name = "KEY=VALUE,..")]
    versus: Option<String>,
    /// Also compare this run's kernel path with another instruction-set path (`portable`,
    /// `avx2`, `avx512-bf16`, `amx-bf16`), step against step in this process: interleaved
    /// steps A B B A .. and the median of the paired B/A ratios with its 95% interval. The weights
    /// stay as this machine's path holds them: a layout the other path cannot read (tiled bf16,
    /// interleaved int8) goes through its portable loops, so B is not that path's own speed.
    #[arg(long, value_name = "PATH")]
    versus_isa: Option<String>,
    /// Also compare this run's decode attention kernel with another (`portable`, `avx2`,
    /// `avx512-bf16`, `avx512-bf16-heads`, `avx512-bf16-pairs`; the GEMM and every other kernel
    /// keep this run's path), step against step in this process: interleaved steps A B B A .. and the median of
    /// the paired B/A ratios with its 95% interval.
    #[arg(long, value_name = "KERNEL")]
    versus_attention: Option<String>,
    /// Also compare this run's weights with another format (`bf16`, `int8`, `int8-wide`), step
    /// against step: a second copy of the model is uploaded in that format and each shape runs
    /// interleaved steps A B B A .. on the two, reporting the median of the paired step-time ratios B/A with its
    /// 95% interval.
    #[arg(long, value_name = "FORMAT", value_parser = WeightFormat::parse)]
    versus_weights: Option<WeightFormat>,
    /// Steps recorded at swimlane level 1 to measure the share of the cores' time spent
    /// outside kernels (the median is reported: one step's share varies with host noise)
    /// [default: 5].
    #[arg(long, value_name = "N", value_parser = crate::qwen3_cmd::positive)]
    outside_steps: Option<usize>,
    /// Replay a captured graph for every step after the first (`on`), run the orchestration
    /// for every step (`off`), or run it and check each step's graph against the captured one
    /// (`verify`); the report says which ran [default: on].
    #[arg(long, value_enum)]
    replay: Option<Replay>,
    /// Also compare replayed steps (A) with orchestrated ones (B), step against step in this
    /// process: interleaved A B B A .. step times (the median of the paired B/A ratios with its 95% interval),
    /// and the outside-kernel share and orchestration span of interleaved recorded steps.
    #[arg(long)]
    versus_replay: bool,
    #[command(flatten)]
    tiles: TileArgs,
    #[command(flatten)]
    run: RunOpts,
}

impl DecodeBenchArgs {
    /// `--membw-seconds`, default 2. The flag is an `Option` so that `--platform cuda` can
    /// refuse it even when given at its default value.
    fn membw_seconds(&self) -> f64 {
        self.membw_seconds.unwrap_or(2.0)
    }

    /// `--outside-steps`, default 5 (an `Option` for the same reason).
    fn outside_steps(&self) -> usize {
        self.outside_steps.unwrap_or(5)
    }
}

fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (b, l) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| anyhow::anyhow!("shape {s:?}: expected BATCHxSEQ_LEN, e.g. 4x1024"))?;
    let count = |t: &str, what: &str| {
        t.trim().parse::<usize>().map_err(|_| {
            anyhow::anyhow!(
                "shape {s:?}: {what} {t:?} is not a whole number (BATCHxSEQ_LEN, e.g. 4x1024)"
            )
        })
    };
    let (b, l) = (count(b, "batch")?, count(l, "sequence length")?);
    if !(1..=64).contains(&b) || l == 0 {
        bail!("shape {s:?}: batch 1..=64 and a positive sequence length");
    }
    Ok((b, l))
}

/// `cfg` recording a swimlane (level 1 at least) for [`RunReport::outside_kernels`]. The core
/// requires an output directory when a diagnostic is on: without `--output-dir` it is the
/// temporary directory, and nothing is written there ([`crate::opts::emit_case`] writes a
/// recorded step only where `--output-dir` was given).
pub(crate) fn swimlane_config(cfg: &CallConfig) -> CallConfig {
    CallConfig {
        swimlane: cfg.swimlane.max(1),
        output_dir: cfg
            .output_dir
            .clone()
            .or_else(|| Some(std::env::temp_dir())),
        ..cfg.clone()
    }
}

/// A percentage for a table cell, one decimal; `-` where it was not measured (NaN).
pub(crate) fn pct_cell(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{v:.1}")
    }
}

/// Says which of `total` recorded steps gave no outside-kernel share because their swimlane
/// dropped records (the dropped tasks' time would have counted as outside kernels); `None`
/// when none did.
pub(crate) fn left_out_line(left_out: &[RunReport], total: usize) -> Option<String> {
    let last = left_out.last()?.swimlane.as_ref()?;
    let which = if left_out.len() == total {
        format!("outside kernels not measured: the swimlanes of all {total} recorded steps")
    } else {
        format!(
            "outside kernels: {} of the {total} recorded steps left out, their swimlanes",
            left_out.len()
        )
    };
    Some(format!(
        "{which} dropped kernel records (the last kept {}, dropped {}); {}",
        last.tasks.len(),
        last.tasks_dropped,
        simpler_dfx::diag::DROPPED_RECORDS_HINT
    ))
}

/// Median, least and greatest of `v` (NaN when empty).
fn median_range(v: &[f64]) -> (f64, f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    (
        // As every summary's median: the mean of the middle two of an even count.
        Summary::of(&v).median,
        v.first().copied().unwrap_or(f64::NAN),
        v.last().copied().unwrap_or(f64::NAN),
    )
}

/// The outside-kernel share net of the cores' descheduled time, and that time's share, of
/// recorded steps as `net X% [lo..hi], descheduled Y% [lo..hi]` (percent; median \[range\]);
/// `None` when no step measured its descheduled time.
fn net_of_preemption(shares: &[OutsideShare]) -> Option<String> {
    let net: Vec<f64> = shares.iter().filter_map(|s| s.net).collect();
    let desched: Vec<f64> = shares.iter().filter_map(|s| s.descheduled).collect();
    if net.is_empty() {
        return None;
    }
    let (n, nl, nh) = median_range(&net);
    let (d, dl, dh) = median_range(&desched);
    Some(format!(
        "net {:.2}% [{:.2}..{:.2}], descheduled {:.2}% [{:.2}..{:.2}]",
        100.0 * n,
        100.0 * nl,
        100.0 * nh,
        100.0 * d,
        100.0 * dl,
        100.0 * dh
    ))
}

/// The three phase boundaries where the cores of a recorded step waited longest (what
/// `simpler trace idle` lists), as one report line.
fn largest_idle_boundaries(r: &RunReport) -> Option<String> {
    let idle = simpler_dfx::idle::analyze(r.swimlane.as_ref()?, None).ok()?;
    let top: Vec<String> = idle
        .rows
        .iter()
        .take(3)
        .map(|row| format!("{} {:.1}%", row.pair(), 100.0 * row.share))
        .collect();
    (!top.is_empty()).then(|| {
        format!(
            "  largest idle boundaries of that step (% of cores x execution span, first block dispatch to last finish; `simpler trace idle` lists all): {}",
            top.join(", ")
        )
    })
}

/// One shape's results.
struct Row {
    shape: String,
    tpot_ms: f64,
    gbs: f64,
    membw_pct: f64,
    roofline_pct: f64,
    best_roofline_pct: f64,
    phase_pct: f64,
    best_phase_pct: f64,
    /// The median step against the per-phase bound at membw's median pass.
    median_phase_pct: f64,
    outside_pct: f64,
    /// Net of the cores' descheduled time (NaN where not measured).
    net_pct: f64,
    limit: &'static str,
}

/// The shapes of `--shapes`, or `default`.
fn shapes_or(args: &DecodeBenchArgs, default: &[&str]) -> Result<Vec<(usize, usize)>> {
    let shapes: Vec<(usize, usize)> = match &args.shapes {
        Some(list) => list.iter().map(|s| parse_shape(s)).collect::<Result<_>>()?,
        None => default
            .iter()
            .map(|s| parse_shape(s))
            .collect::<Result<_>>()?,
    };
    // Each shape's outputs go to a folder named after it: a shape given twice would measure
    // the same again and replace the first one's files.
    for (i, (b, l)) in shapes.iter().enumerate() {
        if shapes[..i].contains(&(*b, *l)) {
            bail!("--shapes: {b}x{l} is given twice");
        }
    }
    Ok(shapes)
}

/// `simpler bench qwen3-decode --platform cuda`: the flags that only mean something on the
/// CPU runtime are refused by name; the rest goes to [`crate::bench_qwen3_cuda`].
pub(crate) fn decode_cuda(args: DecodeBenchArgs) -> Result<()> {
    // The flags first, so a CPU-runtime flag is refused by name whether or not a device is
    // there.
    let cpu_only = [
        (
            "--model (checkpoint upload to the device is not wired yet)",
            args.model.model.is_some(),
        ),
        ("--shared-weights", args.shared_weights),
        ("--trace-overhead", args.trace_overhead),
        ("--versus", args.versus.is_some()),
        ("--versus-isa", args.versus_isa.is_some()),
        ("--versus-attention", args.versus_attention.is_some()),
        ("--versus-weights", args.versus_weights.is_some()),
        (
            "--weights other than bf16",
            args.model.weights != WeightFormat::Bf16,
        ),
        (
            "--tile-kib / --tiles-per-core / --max-kv-chunk",
            args.tiles.tile_kib.is_some()
                || args.tiles.tiles_per_core.is_some()
                || args.tiles.max_kv_chunk.is_some(),
        ),
        (
            "--bf16-layout tiled / pairs",
            matches!(
                args.model.bf16_layout,
                Some(
                    crate::qwen3_cmd::Bf16LayoutArg::Tiled | crate::qwen3_cmd::Bf16LayoutArg::Pairs
                )
            ),
        ),
        ("--replay", args.replay.is_some()),
        ("--versus-replay", args.versus_replay),
        ("--outside-steps", args.outside_steps.is_some()),
        ("--membw-seconds", args.membw_seconds.is_some()),
        ("--memory-budget", args.model.memory_budget.is_some()),
        ("--cores", args.run.cores.is_some()),
        ("--serial", args.run.serial),
        (
            "--tensormap-capacity",
            args.run.tensormap_capacity.is_some(),
        ),
        (
            "--ring-task-window / --ring-heap / --ring-dep-pool",
            args.run.ring_task_window.is_some()
                || args.run.ring_heap.is_some()
                || args.run.ring_dep_pool.is_some(),
        ),
    ];
    const WHY: &str = "not available with --platform cuda (a CPU-runtime option)";
    if let Some((flag, _)) = cpu_only.iter().find(|(_, set)| *set) {
        bail!("{flag}: {WHY}");
    }
    args.run.refuse_diagnostics(WHY)?;
    let device = crate::platform::cuda_device()?;
    crate::opts::check_rounds(args.warmup, args.rounds)?;
    let shapes = shapes_or(&args, &["1x512", "16x3500"])?;
    let c = args.model.config(args.layers)?;
    let max_seq = shapes.iter().map(|s| s.1).max().unwrap_or(1);
    ModelArgs::check_positions(&c, max_seq, "--shapes")?;
    crate::bench_qwen3_cuda::run(&crate::bench_qwen3_cuda::CudaBench {
        config: c,
        device,
        shapes,
        seed: args.model.seed(),
        warmup: args.warmup,
        rounds: args.rounds,
    })
}

pub(crate) fn decode(args: DecodeBenchArgs) -> Result<()> {
    args.run.refuse_diag_steps("bench qwen3-decode")?;
    let shapes = shapes_or(&args, &["1x256", "4x1024", "16x1024"])?;
    crate::opts::check_rounds(args.warmup, args.rounds)?;
    crate::opts::check_recorded_steps("--outside-steps", args.outside_steps())?;
    if args.versus_replay && args.replay == Some(Replay::Verify) {
        bail!(
            "--versus-replay compares replayed steps with orchestrated ones; drop --replay verify"
        );
    }
    let versus = args.versus.as_deref().map(TileArgs::parse).transpose()?;
    if let Some(keys) = versus.as_ref().map(TileArgs::prefill_keys)
        && !keys.is_empty()
    {
        bail!(
            "--versus {}: a prefill step's key; this command runs decode steps only (compare it with `bench qwen3-prefill --versus`)",
            keys.join(", ")
        );
    }
    let versus_isa = isa_flag("--versus-isa", args.versus_isa.as_deref())?;
    let versus_attention = decode_kernel_flag(args.versus_attention.as_deref())?;
    let cfg = args.run.recording_call_config("decode")?;
    let c = args.model.config(args.layers)?;
    // The model's heads pick its decode attention kernel (`attention::kernel_for`).
    let here = crate::qwen3_decode::attention_kernel(&c);
    if let Some(kernel) = versus_attention {
        if kernel == here {
            bail!(
                "--versus-attention {}: this run's decode attention already runs it; give another kernel",
                kernel.name()
            );
        }
        if kernel.isa() > Isa::detected() {
            bail!(
                "--versus-attention {}: it runs on {}, above this run's path {}",
                kernel.name(),
                kernel.isa().name(),
                Isa::detected().name()
            );
        }
    }
    let max_seq = shapes.iter().map(|s| s.1).max().unwrap_or(1);
    ModelArgs::check_positions(&c, max_seq, "--shapes")?;
    // Each shape's KV cache is dropped before the next: the largest one counts.
    let kv_slots = shapes
        .iter()
        .map(|&(b, s)| b * s.div_ceil(PAGE_SIZE) * PAGE_SIZE)
        .max()
        .unwrap_or(0);
    args.model.check_memory(
        &c,
        &RunShape {
            layers: c.num_hidden_layers,
            shared_weights: args.shared_weights,
            kv_slots,
            max_seq: max_seq.next_multiple_of(PAGE_SIZE),
            step_tokens: shapes.iter().map(|s| s.0).max().unwrap_or(1),
            weights: args.model.weights,
            stream_layers: args.versus_weights.is_none(),
        },
        &crate::qwen3_cmd::FitFlags {
            layers: true,
            shared_weights: true,
            context: "smaller shapes (--shapes BATCHxSEQ)",
        },
    )?;
    let worker = args.run.worker()?;
    ops::register(&worker)?;
    let peaks = machine_peaks(args.membw_seconds());
    let layers = c.num_hidden_layers;
    let resident_seq = max_seq.next_multiple_of(PAGE_SIZE);
    // A comparison format needs the host weights for its own copy (`upload` drops the host
    // embedding and LM head, so it goes first); otherwise a preset's layers are generated and
    // uploaded one at a time (`load_model`).
    let (model, versus_model) = match args.versus_weights {
        Some(f) => {
            let mut weights = load_weights(&args.model, &c, args.shared_weights)?;
            let versus = upload_keeping(&worker, &weights, resident_seq, f)?;
            let model = upload(&worker, &mut weights, resident_seq, args.model.weights)?;
            (model, Some(versus))
        }
        None => (
            load_model(
                &args.model,
                &worker,
                &c,
                args.shared_weights,
                resident_seq,
                args.model.weights,
            )?,
            None,
        ),
    };
    println!(
        "simpler bench qwen3-decode: {}, {layers} layers, full model step (embedding, layers, LM head, argmax); {} cores",
        args.model.describe(),
        worker.cores()
    );
    println!("{}", describe_weights(args.model.weights));
    println!("{}", format_peaks(&peaks));
    println!("{}", format_diagnostics(&Diagnostics::of(&cfg)));
    println!("KV pools: the spec's distributions, layer 0's pool replicated to every layer");
    let mut rows = Vec::new();
    for &(batch, seq_len) in &shapes {
        let case = DecodeCase::new(&c, batch, seq_len, seq_len, args.model.seed(), true);
        let kv = case.kv_buffers(&worker, &c)?;
        case.fill_kv(&c, &kv)?;
        let mut session = Session::new(&worker, model.clone(), kv);
        args.tiles.apply(&mut session);
        session.replay = args.replay.unwrap_or(Replay::On).on();
        session.verify_replay = args.replay.is_some_and(Replay::verify);
        session.read_logits = false;
        let mut samples = Vec::new();
        let mut last = None;
        for i in 0..args.warmup + args.rounds {
            let t = Instant::now();
            let out = session.decode(&worker, &case.batch, &case.tokens, &cfg)?;
            let dt = t.elapsed().as_secs_f64();
            if i >= args.warmup {
                samples.push(dt * 1e3);
                last = Some(out.report);
            }
        }
        let sw_cfg = swimlane_config(&cfg);
        let mut recorded: Vec<(OutsideShare, RunReport)> = Vec::new();
        // Recorded steps whose swimlane dropped records: they give no share.
        let mut left_out: Vec<RunReport> = Vec::new();
        // The same steps' share over the whole host call (bind, validate and the session's
        // own work included): the kernels' busy time is `(1 - raw) · cores · effective`.
        let mut whole_step: Vec<f64> = Vec::new();
        for _ in 0..args.outside_steps() {
            let t = Instant::now();
            let sw = session.decode(&worker, &case.batch, &case.tokens, &sw_cfg)?;
            let e2e_ns = t.elapsed().as_nanos() as f64;
            if let Some(o) = sw.report.outside_kernels() {
                let eff_ns = sw.report.effective().dur_ns() as f64;
                whole_step.push(1.0 - (1.0 - o.raw) * eff_ns / e2e_ns.max(1.0));
                recorded.push((o, sw.report));
            } else {
                left_out.push(sw.report);
            }
        }
        recorded.sort_by(|a, b| a.0.raw.total_cmp(&b.0.raw));
        let outsides: Vec<f64> = recorded.iter().map(|r| r.0.raw).collect();
        let shares: Vec<OutsideShare> = recorded.iter().map(|r| r.0).collect();
        let median_step = recorded.get(recorded.len() / 2).map(|r| &r.1);
        // The recorded step the per-phase table below comes from, with whatever else was asked
        // for; with several shapes each in its own folder. Where every recorded step dropped
        // records, one of them is written (marked incomplete) for the trace tools.
        let shape_cfg =
            crate::opts::case_config(&cfg, &format!("{batch}x{seq_len}"), shapes.len() > 1);
        crate::opts::emit_case(&shape_cfg, median_step.or(left_out.last()), last.as_ref())?;
        // Bandwidth drifts with host load: each shape divides by the better of the run's
        // first measurement and one taken right after its steps.
        let peaks = best_peaks(&peaks, &machine_peaks(args.membw_seconds().min(1.0)));
        let s = Summary::of(&samples);
        let cost = StepCost::decode(&c, layers, true, &case.batch.seq_lens).in_format(
            &c,
            layers,
            true,
            args.model.weights,
        );
        let t = s.median / 1e3;
        let gbs = cost.bytes() / t / 1e9;
        let compute = crate::qwen3_decode::matmul_peak(&peaks, batch);
        let bound = cost.roofline_s(peaks.read_gbs_all, compute);
        let phases =
            DecodePhases::decode(&c, layers, true, &case.batch.seq_lens, args.model.weights);
        let dpeaks = crate::qwen3_decode::decode_peaks(
            &peaks,
            batch,
            &c,
            args.model.weights,
            args.membw_seconds().min(1.0),
        );
        let phase = phases.bound_s(&dpeaks);
        // The same bound with the bandwidth phases at membw's median pass: the median step
        // against it pairs like with like on a host whose bandwidth jumps between states (on
        // Zen 4, passes of ~35 and ~60 GB/s in one measurement: the best pass is then a state
        // the median step mostly did not see).
        let phase_median_pass = phases.bound_s(&DecodePeaks {
            gbs: peaks.read_gbs_all_median,
            ..dpeaks
        });
        let outside = Summary::of(&outsides).median;
        let (outside_lo, outside_hi) = (
            outsides.first().copied().unwrap_or(f64::NAN),
            outsides.last().copied().unwrap_or(f64::NAN),
        );
        let eff_ms = last.as_ref().map_or(f64::NAN, |r| r.effective().us() / 1e3);
        let limit = if cost.bytes() / (peaks.read_gbs_all * 1e9) >= cost.flops() / (compute * 1e9) {
            "bandwidth"
        } else {
            "compute"
        };
        println!("batch {batch} x {seq_len} tokens:");
        println!("  {}", crate::qwen3_decode::format_paths(batch, &c));
        println!("  {}", format_summary("step_ms", &s, args.warmup));
        println!(
            "  {:.2} tokens/s; effective (orch ∪ sched) {eff_ms:.2} ms of the {:.2} ms step",
            batch as f64 / t,
            s.median
        );
        // Median step against the median pass, the quietest step against the best pass: each
        // pairs like with like (a best pass escaped the host's bursts that a median step paid).
        let gbs_quiet = cost.bytes() / (s.min / 1e3) / 1e9;
        println!(
            "  bytes/step {:.3} GB (weights {:.3}, KV read {:.3}, KV written {:.4}) -> median step {gbs:.2} GB/s = {:.1}% of membw's median pass ({:.1} GB/s; {:.1}% of the best pass); quietest step {gbs_quiet:.2} GB/s = {:.1}% of membw's best pass ({:.1} GB/s; best case) — passes of the measurements before and after, the better",
            cost.bytes() / 1e9,
            cost.weight_bytes / 1e9,
            cost.kv_read_bytes / 1e9,
            cost.kv_write_bytes / 1e9,
            100.0 * gbs / peaks.read_gbs_all_median,
            peaks.read_gbs_all_median,
            100.0 * gbs / peaks.read_gbs_all,
            100.0 * gbs_quiet / peaks.read_gbs_all,
            peaks.read_gbs_all
        );
        println!(
            "  FLOPs/step {:.2} G -> {:.1} GFLOP/s; roofline bound {:.2} ms ({limit}-bound) = {:.1}% achieved",
            cost.flops() / 1e9,
            cost.flops() / t / 1e9,
            bound * 1e3,
            100.0 * bound / t,
        );
        println!(
            "  {}",
            crate::qwen3_decode::format_phase_share("median step", t, phase)
        );
        println!(
            "  {}",
            crate::qwen3_decode::format_phase_share("quietest step", s.min / 1e3, phase)
        );
        println!(
            "  median step {:.2} ms = {:.1}% of the per-phase bound at membw's median pass ({:.2} ms: the bandwidth phases at {:.1} GB/s)",
            t * 1e3,
            100.0 * phase_median_pass / t,
            phase_median_pass * 1e3,
            peaks.read_gbs_all_median
        );
        // The quietest step against the best bandwidth pass: both are the machine with its
        // co-tenants idle, where the median step pays for every burst of host load that the
        // best pass escaped.
        let best_roofline_pct = 100.0 * bound / (s.min / 1e3);
        println!(
            "  quietest step {:.2} ms = {best_roofline_pct:.1}% of the roofline bound (both best-case: the fastest of the {} steps against the best bandwidth pass)",
            s.min, s.n
        );
        if let Some(warning) = host_noise_warning(
            s.median / s.min - 1.0,
            1.0 - peaks.read_gbs_all_median / peaks.read_gbs_all,
        ) {
            println!("  {warning}");
        }
        let (whole, whole_lo, whole_hi) = median_range(&whole_step);
        if !outsides.is_empty() {
            println!(
                "  outside kernels {:.1}% of the cores' time during effective (median of {} steps at swimlane level 1, range {:.1}..{:.1}%: 1 - kernel busy / (cores x effective)); {:.1}% of the whole step (range {:.1}..{:.1}%: the host call end to end, bind and read-back included)",
                100.0 * outside,
                outsides.len(),
                100.0 * outside_lo,
                100.0 * outside_hi,
                100.0 * whole,
                100.0 * whole_lo,
                100.0 * whole_hi
            );
        }
        if let Some(line) = left_out_line(&left_out, args.outside_steps()) {
            println!("  {line}");
        }
        if let Some(net) = net_of_preemption(&shares) {
            println!(
                "  of the time the cores' threads held a CPU (the same steps, median [range]): {net} (net: 1 - kernel busy / (cores x effective - descheduled); descheduled: the threads runnable but waiting while the OS ran other processes, / (cores x effective))"
            );
        }
        if let Some(line) = median_step.and_then(largest_idle_boundaries) {
            println!("{line}");
        }
        if let Some(table) =
            median_step.and_then(|r| crate::qwen3_decode::format_phase_table(&phases, &dpeaks, r))
        {
            println!("  per phase (the recorded step with the median outside-kernel share):");
            print!("{table}");
        }
        println!(
            "  {}",
            describe_graphs(
                args.replay.unwrap_or(Replay::On),
                last.iter().chain(recorded.iter().map(|r| &r.1))
            )
        );
        if args.versus_replay {
            let v = ab_replay(
                &mut session,
                &case,
                &worker,
                &cfg,
                args.rounds,
                args.warmup,
                args.outside_steps(),
            )?;
            println!(
                "  replay compared (A: captured graph replayed, B: orchestrated; interleaved steps A B B A ..; median of the paired B/A ratios with a bootstrap interval):"
            );
            print_indented(&format_compare(
                "step_ms",
                "replay",
                "orchestrated",
                &v.step,
            ));
            println!("{}", v.describe());
        }
        if args.trace_overhead {
            let path = std::env::temp_dir().join(format!(
                "simpler-trace-overhead-{}.jsonl",
                std::process::id()
            ));
            let traced = CallConfig {
                trace: Some(path.clone()),
                ..cfg.clone()
            };
            let policy = session.policy;
            let c = ab_steps(
                &mut session,
                &case,
                &worker,
                (&cfg, policy),
                (&traced, policy),
                args.rounds,
                args.warmup,
            );
            let _ = std::fs::remove_file(&path);
            println!(
                "  trace overhead (A: no trace, B: every step's spans appended to a JSON Lines file):"
            );
            print_indented(&format_compare("step_ms", "no trace", "trace", &c?));
        }
        if let Some(versus) = &versus {
            let a = session.policy;
            let mut b = a;
            versus.apply_to(&mut b);
            let c = ab_steps(
                &mut session,
                &case,
                &worker,
                (&cfg, a),
                (&cfg, b),
                args.rounds,
                args.warmup,
            )?;
            println!(
                "  tiling compared (interleaved steps A B B A ..; median of the paired B/A ratios with a bootstrap interval):"
            );
            let spec = args.versus.as_deref().unwrap_or_default();
            print_indented(&format_compare("step_ms", "this run's tiling", spec, &c));
        }
        if let Some(isa) = versus_isa {
            let c = ab_switched(
                &mut session,
                &case,
                &worker,
                &cfg,
                (args.rounds, args.warmup),
                |b| {
                    set_process_isa(b.then_some(isa));
                },
            )?;
            println!(
                "  kernel paths compared (interleaved steps A B B A ..; median of the paired B/A ratios with a bootstrap interval):"
            );
            // What each side runs on this run's weights: the GEMM path for their layout, and
            // for int8 weights the int8 path the cap leaves.
            let label = |isa: Isa| {
                let gemm = crate::qwen3_decode::gemm_path_on(isa, batch).name();
                let int8 = I8Path::hardware().capped(isa);
                match args.model.weights {
                    WeightFormat::Int8(Int8Acts::Quantised) => {
                        // The projections' layout (whole 16-row groups, as the model's are).
                        let layout = if simpler_models::qwen3::quant::int8_interleaved(16, 64, true)
                        {
                            I8Layout::Interleaved
                        } else {
                            I8Layout::RowMajor
                        };
                        format!("{gemm}, int8 {}", w8a8_path(int8, layout, batch).name())
                    }
                    WeightFormat::Int8(_) => format!("{gemm}, int8 {}", int8.name()),
                    WeightFormat::Bf16 => gemm.to_string(),
                }
            };
            let a_name = format!("{} (this run)", label(Isa::detected()));
            print_indented(&format_compare("step_ms", &a_name, &label(isa), &c));
        }
        if let Some(kernel) = versus_attention {
            let c = ab_switched(
                &mut session,
                &case,
                &worker,
                &cfg,
                (args.rounds, args.warmup),
                |b| {
                    attention::set_process_decode_kernel(b.then_some(kernel));
                },
            )?;
            println!(
                "  decode attention kernels compared (every other kernel on this run's path; interleaved steps A B B A ..; median of the paired B/A ratios with a bootstrap interval):"
            );
            let a_name = format!("{} (this run)", here.name());
            let b_name = kernel.name();
            print_indented(&format_compare("step_ms", &a_name, b_name, &c));
        }
        if let (Some(vm), Some(vf)) = (&versus_model, args.versus_weights) {
            let kv_b = case.kv_buffers(&worker, &c)?;
            case.fill_kv(&c, &kv_b)?;
            let mut other = Session::new(&worker, vm.clone(), kv_b);
            other.policy = session.policy;
            other.read_logits = false;
            let c = ab_sessions(
                &mut session,
                &mut other,
                &case,
                &worker,
                &cfg,
                args.rounds,
                args.warmup,
            )?;
            println!(
                "  weights compared (interleaved steps A B B A ..; median of the paired B/A ratios with a bootstrap interval):"
            );
            print_indented(&format_compare(
                "step_ms",
                args.model.weights.name(),
                vf.name(),
                &c,
            ));
        }
        rows.push(Row {
            shape: format!("{batch}x{seq_len}"),
            tpot_ms: s.median,
            gbs,
            membw_pct: 100.0 * gbs / peaks.read_gbs_all,
            roofline_pct: 100.0 * bound / t,
            best_roofline_pct,
            phase_pct: 100.0 * phase / t,
            best_phase_pct: 100.0 * phase / (s.min / 1e3),
            median_phase_pct: 100.0 * phase_median_pass / t,
            outside_pct: 100.0 * outside,
            net_pct: 100.0
                * median_range(&shares.iter().filter_map(|s| s.net).collect::<Vec<_>>()).0,
            limit,
        });
    }
    println!(
        "summary (medians; \"best\": the quietest step against the best pass; %phase: of the per-phase bound; \"med\": the median step against the bound at membw's median pass):"
    );
    println!(
        "  {:>9} {:>10} {:>8} {:>8} {:>10} {:>10} {:>8} {:>11} {:>10} {:>9} {:>5}  bound",
        "shape",
        "step ms",
        "GB/s",
        "%membw",
        "%roofline",
        "%roof best",
        "%phase",
        "%phase best",
        "%phase med",
        "%outside",
        "%net"
    );
    for r in &rows {
        println!(
            "  {:>9} {:>10.2} {:>8.2} {:>8.1} {:>10.1} {:>10.1} {:>8.1} {:>11.1} {:>10.1} {:>9} {:>5}  {}",
            r.shape,
            r.tpot_ms,
            r.gbs,
            r.membw_pct,
            r.roofline_pct,
            r.best_roofline_pct,
            r.phase_pct,
            r.best_phase_pct,
            r.median_phase_pct,
            pct_cell(r.outside_pct),
            pct_cell(r.net_pct),
            r.limit
        );
    }
    Ok(())
}

/// The path a `--versus-*` flag names, refused by name when it is not a path or this CPU
/// cannot run it.
pub(crate) fn isa_flag(flag: &str, name: Option<&str>) -> Result<Option<Isa>> {
    match name {
        None => Ok(None),
        Some(name) => match Isa::from_name(name) {
            Some(isa) if isa.is_supported() => Ok(Some(isa)),
            Some(isa) => bail!("{flag} {}: this CPU cannot run it", isa.name()),
            None => bail!("{flag} {name:?}: not one of {:?}", Isa::ALL.map(Isa::name)),
        },
    }
}

/// The decode attention kernel `--versus-attention` names, refused unless it is one this CPU
/// runs.
fn decode_kernel_flag(name: Option<&str>) -> Result<Option<attention::DecodeKernel>> {
    use attention::DecodeKernel;
    match name {
        None => Ok(None),
        Some(name) => match DecodeKernel::from_name(name) {
            Some(k) if k.is_supported() => Ok(Some(k)),
            Some(k) => bail!("--versus-attention {}: this CPU cannot run it", k.name()),
            None => bail!(
                "--versus-attention {name:?}: not one of {:?}",
                DecodeKernel::ALL.map(DecodeKernel::name)
            ),
        },
    }
}

/// Interleaved steps A B B A .. of `session`, `switch(true)` before each B step and
/// `switch(false)` after it (a process-wide kernel path switch); the step times compared.
fn ab_switched(
    session: &mut Session,
    case: &DecodeCase,
    worker: &Worker,
    cfg: &CallConfig,
    (rounds, warmup): (usize, usize),
    switch: impl Fn(bool),
) -> Result<Comparison> {
    let failure = RefCell::new(None);
    let session = RefCell::new(session);
    let timed = |b: bool| {
        switch(b);
        let t = Instant::now();
        let r = session
            .borrow_mut()
            .decode(worker, &case.batch, &case.tokens, cfg);
        switch(false);
        match r {
            Ok(_) => t.elapsed().as_secs_f64() * 1e3,
            Err(e) => {
                failure.borrow_mut().get_or_insert(anyhow::Error::from(e));
                f64::NAN
            }
        }
    };
    let pairs = run_interleaved(rounds, warmup, || timed(false), || timed(true));
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }
    Ok(pairs.compare())
}

/// Interleaved steps A B B A .. (`warmup` pairs discarded, then `rounds`) of `session`, each
/// with its call configuration and tiling; the step times compared.
fn ab_steps(
    session: &mut Session,
    case: &DecodeCase,
    worker: &Worker,
    a: (&CallConfig, TilePolicy),
    b: (&CallConfig, TilePolicy),
    rounds: usize,
    warmup: usize,
) -> Result<Comparison> {
    let failure = RefCell::new(None);
    let session = RefCell::new(session);
    let step_ms = |(cfg, policy): (&CallConfig, TilePolicy)| {
        let mut session = session.borrow_mut();
        session.policy = policy;
        let t = Instant::now();
        let r = session
            .decode(worker, &case.batch, &case.tokens, cfg)
            .map_err(anyhow::Error::from)
            .and_then(|out| simpler_dfx::write_run_outputs(&out.report, cfg).map_err(Into::into));
        match r {
            Ok(_) => t.elapsed().as_secs_f64() * 1e3,
            Err(e) => {
                failure.borrow_mut().get_or_insert(e);
                f64::NAN
            }
        }
    };
    let pairs = run_interleaved(rounds, warmup, || step_ms(a), || step_ms(b));
    // The session goes back to A's tiling.
    session.borrow_mut().policy = a.1;
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }
    Ok(pairs.compare())
}

/// Replayed against orchestrated steps of one session.
struct ReplayCompare {
    step: Comparison,
    /// Outside-kernel shares of interleaved recorded steps: replayed, orchestrated.
    outside: [Vec<OutsideShare>; 2],
    /// Orchestration spans (us) of the same steps.
    orch_us: [Vec<f64>; 2],
}

impl ReplayCompare {
    fn describe(&self) -> String {
        let raw = |i: usize| self.outside[i].iter().map(|s| s.raw).collect::<Vec<_>>();
        let (ra, la, ha) = median_range(&raw(0));
        let (rb, lb, hb) = median_range(&raw(1));
        let (oa, _, _) = median_range(&self.orch_us[0]);
        let (ob, _, _) = median_range(&self.orch_us[1]);
        let net = match (
            net_of_preemption(&self.outside[0]),
            net_of_preemption(&self.outside[1]),
        ) {
            (Some(a), Some(b)) => format!(
                "\n    of the time the cores' threads held a CPU (same steps): replay {a}; orchestrated {b}"
            ),
            _ => String::new(),
        };
        format!(
            "    outside kernels (interleaved recorded steps, {} each, median [range]): replay {:.2}% [{:.2}..{:.2}], orchestrated {:.2}% [{:.2}..{:.2}]{net}\n    orchestration span (median): replay {oa:.0} us (the submission loop), orchestrated {ob:.0} us",
            self.outside[0].len(),
            100.0 * ra,
            100.0 * la,
            100.0 * ha,
            100.0 * rb,
            100.0 * lb,
            100.0 * hb,
        )
    }
}

/// Interleaved replayed (A) and orchestrated (B) steps of `session`: step times, then the
/// outside-kernel share and orchestration span of `recorded` interleaved pairs at swimlane
/// level 1. The session's replay switch is restored.
fn ab_replay(
    session: &mut Session,
    case: &DecodeCase,
    worker: &Worker,
    cfg: &CallConfig,
    rounds: usize,
    warmup: usize,
    recorded: usize,
) -> Result<ReplayCompare> {
    let was = session.replay;
    let failure = RefCell::new(None);
    let session = RefCell::new(session);
    let step = |replay: bool, cfg: &CallConfig| -> Option<(f64, RunReport)> {
        let mut s = session.borrow_mut();
        s.replay = replay;
        let t = Instant::now();
        match s.decode(worker, &case.batch, &case.tokens, cfg) {
            Ok(out) => Some((t.elapsed().as_secs_f64() * 1e3, out.report)),
            Err(e) => {
                failure.borrow_mut().get_or_insert(anyhow::Error::from(e));
                None
            }
        }
    };
    let ms = |replay| step(replay, cfg).map_or(f64::NAN, |r| r.0);
    let pairs = run_interleaved(rounds, warmup, || ms(true), || ms(false));
    let sw_cfg = swimlane_config(cfg);
    let reports = RefCell::new([Vec::new(), Vec::new()]);
    let record = |replay: bool| {
        if let Some((_, r)) = step(replay, &sw_cfg) {
            reports.borrow_mut()[usize::from(!replay)].push(r);
        }
        0.0
    };
    run_interleaved(recorded, 0, || record(true), || record(false));
    session.borrow_mut().replay = was;
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }
    let reports = reports.into_inner();
    Ok(ReplayCompare {
        step: pairs.compare(),
        outside: [0, 1].map(|i| {
            reports[i]
                .iter()
                .filter_map(RunReport::outside_kernels)
                .collect()
        }),
        orch_us: [0, 1].map(|i| reports[i].iter().map(|r| r.orch.us()).collect()),
    })
}

/// Interleaved steps A B B A .. of two sessions (two weight formats) on the same case.
fn ab_sessions(
    a: &mut Session,
    b: &mut Session,
    case: &DecodeCase,
    worker: &Worker,
    cfg: &CallConfig,
    rounds: usize,
    warmup: usize,
) -> Result<Comparison> {
    let failure = RefCell::new(None);
    let step_ms = |s: &RefCell<&mut Session>| {
        let t = Instant::now();
        match s
            .borrow_mut()
            .decode(worker, &case.batch, &case.tokens, cfg)
        {
            Ok(_) => t.elapsed().as_secs_f64() * 1e3,
            Err(e) => {
                failure.borrow_mut().get_or_insert(anyhow::Error::from(e));
                f64::NAN
            }
        }
    };
    let (a, b) = (RefCell::new(a), RefCell::new(b));
    let pairs = run_interleaved(rounds, warmup, || step_ms(&a), || step_ms(&b));
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }
    Ok(pairs.compare())
}

/// Prints `text` line by line, indented under a shape's report.
fn print_indented(text: &str) {
    for line in text.lines() {
        println!("    {line}");
    }
}

/// How far a median may sit from the best sample (as a fraction) before the run is called
/// noisy.
const NOISY_SPREAD: f64 = 0.15;

/// A warning when the host's load moved the run: the median step more than `NOISY_SPREAD`
/// over the fastest (`step_over`), or the median bandwidth pass more than that under the best
/// (`bw_under`). Ratios against the machine then mostly measure the neighbours; the
/// quietest-step ratio is the steadier one.
fn host_noise_warning(step_over: f64, bw_under: f64) -> Option<String> {
    (step_over > NOISY_SPREAD || bw_under > NOISY_SPREAD).then(|| {
        format!(
            "host noise: median step {:.0}% over the fastest, median bandwidth pass {:.0}% under the best; \
             the median ratios above mostly measure other load on this machine (prefer the quietest-step ratio, or rerun when it is quiet)",
            100.0 * step_over,
            100.0 * bw_under,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::host_noise_warning;

    #[test]
    fn noise_warning_only_past_the_spread() {
        assert_eq!(host_noise_warning(0.05, 0.14), None);
        let w = host_noise_warning(0.30, 0.0).expect("step spread");
        assert!(w.contains("median step 30% over the fastest"), "{w}");
        let w = host_noise_warning(0.0, 0.20).expect("bandwidth spread");
        assert!(
            w.contains("median bandwidth pass 20% under the best"),
            "{w}"
        );
    }
}
