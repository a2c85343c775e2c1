//! `simpler run qwen3-decode`: Qwen3 decode on the runtime with a per-token report — TPOT, the
//! timing layers of `docs/trace-format.md`, time per layer, bytes streamed per step and the achieved
//! bandwidth against this machine's, measured in the same run, and the roofline share — with
//! an optional (default-on for small shapes) check against the golden.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, anyhow, bail};
use clap::{Args, ValueEnum};
use half::bf16;
use simpler_core::{CallConfig, RunReport, TaskSlotTiming};
use simpler_dfx::bench_stats::{Diagnostics, Summary, format_diagnostics, format_summary};
use simpler_kernels_cpu::membw::{MachinePeaks, MeasureOptions, measure};
use simpler_kernels_cpu::{Isa, TILE_COLS, TILE_ROWS, path_for};
use simpler_models::qwen3::check::compare_step_as;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{
    DecodePeaks, DecodePhases, LayerWeights, PagedBatch, RunShape, Session, StepCost, WeightFormat,
    ops, phase_spans_ns,
};

use crate::opts::{self, RunOpts};
use crate::qwen3_cmd::{
    DecodeCase, ModelArgs, Replay, TileArgs, describe_graphs, describe_weights, load_model,
};

/// What a decode step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Variant {
    /// Embedding, layers, final norm, LM head, greedy ids.
    Model,
    /// The fixture's layers chunk: bf16 hidden in and out, no embedding or head.
    Layers,
}

/// When `run qwen3-decode` compares with the golden.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum CheckWhen {
    /// When the golden needs at most a few seconds of plain loops.
    Auto,
    /// Always.
    On,
    /// Never.
    Off,
}

/// Arguments of `simpler run qwen3-decode`.
#[derive(Args, Debug)]
pub(crate) struct DecodeArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Sequences decoded together (1-64).
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
    /// Tokens in each sequence at the first step, the current one included.
    #[arg(long, default_value_t = 256)]
    pub(crate) seq_len: usize,
    /// Longest sequence the block tables cover [default: seq-len + steps - 1].
    #[arg(long)]
    pub(crate) max_seq: Option<usize>,
    /// Decoder layers to run [default: all of the model's].
    #[arg(long)]
    pub(crate) layers: Option<usize>,
    /// Decode steps per round; each step feeds its output into the next.
    #[arg(long, default_value_t = 4)]
    pub(crate) steps: usize,
    /// Measured rounds: a round is the `--steps` steps, replayed from the same state.
    #[arg(long, default_value_t = 5)]
    pub(crate) rounds: usize,
    /// Warm-up rounds (discarded).
    #[arg(long, default_value_t = 1)]
    pub(crate) warmup: usize,
    /// One weight set for every layer (presets; each layer keeps its own KV pool, filled with
    /// layer 0's as in the reference fixture).
    #[arg(long)]
    pub(crate) shared_weights: bool,
    /// Compare the first step with the golden (hidden state, every layer's K/V writes, logits
    /// and argmax): `auto` when the golden needs at most a few seconds; `--check` alone is `on`.
    #[arg(
        long,
        value_enum,
        num_args = 0..=1,
        default_value_t = CheckWhen::Auto,
        default_missing_value = "on",
        conflicts_with = "no_check"
    )]
    pub(crate) check: CheckWhen,
    /// The same as `--check off`.
    #[arg(long, hide = true)]
    pub(crate) no_check: bool,
    /// What a step runs.
    #[arg(long, value_enum, default_value_t = Variant::Model)]
    pub(crate) variant: Variant,
    /// Seconds spent measuring this machine's bandwidth and FMA peak before the run (at least
    /// 0.2 are).
    #[arg(long, value_parser = crate::opts::seconds, default_value_t = 1.5)]
    pub(crate) membw_seconds: f64,
    /// Replay a captured graph for the steps of one topology (`on`), run the orchestration
    /// for every step (`off`), or run it and check each step's graph against the one captured
    /// for its topology (`verify`); the report says which ran.
    #[arg(long, value_enum, default_value_t = Replay::On)]
    pub(crate) replay: Replay,
    #[command(flatten)]
    pub(crate) tiles: TileArgs,
    #[command(flatten)]
    pub(crate) run: RunOpts,
}

/// Golden FLOPs above which `--check` is off unless asked for (the golden runs at a few
/// GFLOP/s on two cores).
const CHECK_DEFAULT_MAX_FLOPS: f64 = 12e9;

/// One measured step.
#[derive(Clone, Debug)]
struct Sample {
    e2e_s: f64,
    report: RunReport,
    cost: StepCost,
}

fn slot_us(slots: &[TaskSlotTiming], s: u8) -> f64 {
    slots
        .iter()
        .find(|t| t.slot == s)
        .map_or(0.0, |t| t.span.us())
}

fn median(xs: impl Iterator<Item = f64>) -> f64 {
    Summary::of(&xs.collect::<Vec<f64>>()).median
}

/// The machine's denominators, measured now.
pub(crate) fn machine_peaks(seconds: f64) -> MachinePeaks {
    measure(&MeasureOptions {
        duration: std::time::Duration::from_secs_f64(seconds.max(0.2)),
        ..MeasureOptions::default()
    })
}

/// The larger of two measurements, field by field: the machine's bandwidth drifts with host
/// load, so the run measures before and after its steps and divides by the better figure
/// (the conservative denominator).
pub(crate) fn best_peaks(a: &MachinePeaks, b: &MachinePeaks) -> MachinePeaks {
    MachinePeaks {
        threads: a.threads,
        read_gbs_one: a.read_gbs_one.max(b.read_gbs_one),
        read_gbs_one_median: a.read_gbs_one_median.max(b.read_gbs_one_median),
        read_gbs_all: a.read_gbs_all.max(b.read_gbs_all),
        read_gbs_all_median: a.read_gbs_all_median.max(b.read_gbs_all_median),
        fma_gflops_one: a.fma_gflops_one.max(b.fma_gflops_one),
        fma_gflops_all: a.fma_gflops_all.max(b.fma_gflops_all),
        bf16_dot_gflops_one: a.bf16_dot_gflops_one.max(b.bf16_dot_gflops_one),
        bf16_dot_gflops_all: a.bf16_dot_gflops_all.max(b.bf16_dot_gflops_all),
        amx_bf16_gflops_one: a.amx_bf16_gflops_one.max(b.amx_bf16_gflops_one),
        amx_bf16_gflops_all: a.amx_bf16_gflops_all.max(b.amx_bf16_gflops_all),
        // One clean measurement of the two makes the larger figure a measured one.
        compute_lower_bound: a.compute_lower_bound && b.compute_lower_bound,
    }
}

/// The compute peak the matrix products of a step with `rows` activation rows run against:
/// that of the path the GEMM takes for them on this machine (`Isa::detected`, so
/// `SIMPLER_ISA` counts).
pub(crate) fn matmul_peak(p: &MachinePeaks, rows: usize) -> f64 {
    p.matmul_gflops_all(gemm_path(rows))
}

/// The path a Qwen3 model's bf16 GEMM takes for `rows` activation rows on this machine
/// (`Isa::detected`): its matrices are tiled where that pays (`qwen3::layout`; every preset's
/// are whole 16-row groups and 32-column steps), and tiled weights take the AMX tiles at
/// every batch.
pub(crate) fn gemm_path(rows: usize) -> Isa {
    gemm_path_on(Isa::detected(), rows)
}

/// [`gemm_path`] with the kernels capped at `isa` (`--versus-isa`'s B steps): the weights keep
/// this process's layout, so the path is the one `isa` takes on that layout.
pub(crate) fn gemm_path_on(isa: Isa, rows: usize) -> Isa {
    let layout = simpler_models::qwen3::layout::bf16_layout(TILE_ROWS, TILE_COLS);
    path_for(isa, rows, layout)
}

/// The denominators of a decode step of `c` with `rows` activation rows: bandwidth, the peak
/// of the GEMM path those rows take, the fp32 FMA peak (widened int8 products), the peak of the
/// instruction the run's decode attention kernel takes for `c`'s shape
/// (`attention::kernel_for`: `vdpbf16ps` for the AVX-512 BF16 kernels, the strict figure for
/// the token-major one whose `p · V` still widens to FMA; a kernel another process-wide choice
/// runs, as `--versus-attention`'s B steps, is not what it names), and for W8A8 weights the
/// int8 peak of the path that runs (measured now, over about `seconds / 4`).
pub(crate) fn decode_peaks(
    p: &MachinePeaks,
    rows: usize,
    c: &simpler_models::qwen3::Qwen3Config,
    format: WeightFormat,
    seconds: f64,
) -> DecodePeaks {
    let int8_gops = if format.is_int8() {
        crate::dsv4_cmd::int8_peak(p.threads, seconds).0
    } else {
        0.0
    };
    let attention = attention_kernel(c);
    DecodePeaks {
        gbs: p.read_gbs_all,
        matrix_gflops: matmul_peak(p, rows),
        fma_gflops: p.fma_gflops_all,
        attention_gflops: p.matmul_gflops_all(attention.isa()),
        int8_gops,
    }
}

/// One line: a step time against the per-phase bound.
pub(crate) fn format_phase_share(what: &str, t_s: f64, bound_s: f64) -> String {
    format!(
        "{what} {:.2} ms = {:.1}% of the per-phase bound ({:.2} ms: each phase at this machine's bandwidth or the peak of the path it runs on, phases in dependency order)",
        t_s * 1e3,
        100.0 * bound_s / t_s,
        bound_s * 1e3
    )
}

/// The per-phase table of a step recorded at swimlane level >= 1: each phase's time (its
/// runs, one per layer, first block start to last block end, summed), its bound, bytes and
/// GB/s, and the time between phases (first block start to last block end, less the phases'
/// time).
pub(crate) fn format_phase_table(
    phases: &DecodePhases,
    peaks: &DecodePeaks,
    report: &RunReport,
) -> Option<String> {
    let sw = report.swimlane.as_ref()?;
    let spans = phase_spans_ns(sw);
    let first = sw.tasks.iter().map(|t| t.start).min()?;
    let last = sw.tasks.iter().map(|t| t.end).max()?;
    let exec = last.saturating_sub(first) as f64 / 1e6;
    let mut s = String::from(
        "    phase        time_ms  bound_ms  % of bound  bound by       MB     GB/s\n",
    );
    let mut in_phases = 0.0;
    for (i, p) in phases.phases.iter().enumerate() {
        let t = spans[i] as f64 / 1e6;
        in_phases += t;
        let (bound, limit) = phases.phase_bound(i, peaks);
        let bound = bound * 1e3;
        let pct = if t > 0.0 { 100.0 * bound / t } else { 0.0 };
        let gbs = if t > 0.0 { p.cost.bytes / t / 1e6 } else { 0.0 };
        s += &format!(
            "    {:<10} {:>9.2} {:>9.2} {:>10.1}%  {:<9} {:>8.1} {:>8.2}\n",
            p.cost.name,
            t,
            bound,
            pct,
            limit.name(),
            p.cost.bytes / 1e6,
            gbs
        );
    }
    let total = phases.bound_s(peaks) * 1e3;
    s += &format!(
        "    between phases {:.2} ms (first block start to last block end {exec:.2} ms, less the phases' {in_phases:.2} ms: one phase done, the next not started on any core); the phases' time at {:.1}% of their bound\n",
        exec - in_phases,
        if in_phases > 0.0 {
            100.0 * total / in_phases
        } else {
            0.0
        }
    );
    Some(s)
}

/// The decode attention kernel this machine's path runs for `c`'s heads.
pub(crate) fn attention_kernel(
    c: &simpler_models::qwen3::Qwen3Config,
) -> simpler_kernels_cpu::attention::DecodeKernel {
    simpler_kernels_cpu::attention::kernel_for(Isa::detected(), c.group(), c.head_dim)
}

/// One line naming the instruction-set paths the kernels of a step of `c` with `rows`
/// activation rows take (so every number says which path produced it).
pub(crate) fn format_paths(rows: usize, c: &simpler_models::qwen3::Qwen3Config) -> String {
    let isa = Isa::detected();
    let capped = match std::env::var("SIMPLER_ISA") {
        Ok(v) => format!(", SIMPLER_ISA={v}"),
        Err(_) => String::new(),
    };
    let layout = match simpler_models::qwen3::layout::bf16_layout(TILE_ROWS, TILE_COLS) {
        simpler_kernels_cpu::WeightLayout::RowMajor => "row-major",
        simpler_kernels_cpu::WeightLayout::Pairs => "paired",
        simpler_kernels_cpu::WeightLayout::Tiled => "tiled",
    };
    format!(
        "kernel paths: GEMM {} ({rows} activation rows; bf16 matrices {layout}), decode attention {}, vector kernels {}; this CPU's best path {}{capped}",
        gemm_path(rows).name(),
        attention_kernel(c).name(),
        simpler_kernels_cpu::attention::vector_path(isa).name(),
        Isa::hardware().name(),
    )
}

/// One line describing the peaks.
pub(crate) fn format_peaks(p: &MachinePeaks) -> String {
    let mut wide = String::new();
    for (name, all, one) in [
        (
            "AVX-512 BF16 dot",
            p.bf16_dot_gflops_all,
            p.bf16_dot_gflops_one,
        ),
        (
            "AMX-BF16 tile",
            p.amx_bf16_gflops_all,
            p.amx_bf16_gflops_one,
        ),
    ] {
        if all > 0.0 {
            wide += &format!("; {name} peak {all:.1} GFLOP/s ({one:.1} on 1)");
        }
    }
    format!(
        "machine (measured in this run): streaming read {:.1} GB/s on {} threads (best pass; median {:.1}), {:.1} GB/s on 1 (median {:.1}); FMA peak {:.1} GFLOP/s on {} threads ({:.1} on 1){wide}",
        p.read_gbs_all,
        p.threads,
        p.read_gbs_all_median,
        p.read_gbs_one,
        p.read_gbs_one_median,
        p.fma_gflops_all,
        p.threads,
        p.fma_gflops_one
    ) + if p.compute_lower_bound {
        "; compute peaks from runs in which a thread was held off its CPU only: lower bounds"
    } else {
        ""
    }
}

pub(crate) fn main(args: DecodeArgs) -> Result<()> {
    if !(1..=64).contains(&args.batch) || args.seq_len == 0 || args.steps == 0 || args.rounds == 0 {
        bail!("--batch must be 1..=64 and --seq-len, --steps, --rounds at least 1");
    }
    let Some(last_len) = (args.seq_len - 1).checked_add(args.steps) else {
        bail!(
            "--seq-len {} --steps {}: the last step's length overflows",
            args.seq_len,
            args.steps
        );
    };
    let Some(all_rounds) = args.warmup.checked_add(args.rounds) else {
        bail!(
            "--warmup {} --rounds {}: their sum overflows",
            args.warmup,
            args.rounds
        );
    };
    if let Some(steps) = all_rounds.checked_mul(args.steps) {
        args.run.diag_steps.check_within(steps as u64)?;
    }
    let max_seq = args.max_seq.unwrap_or(last_len);
    if max_seq < last_len {
        bail!("--max-seq {max_seq} is shorter than seq-len + steps - 1 = {last_len}");
    }
    let cfg = args.run.call_config("decode")?;
    let c = args.model.config(args.layers)?;
    ModelArgs::check_positions(&c, max_seq, "--seq-len/--steps/--max-seq")?;
    let blocks = max_seq.div_ceil(PAGE_SIZE);
    args.model.check_memory(
        &c,
        &RunShape {
            layers: c.num_hidden_layers,
            shared_weights: args.shared_weights,
            kv_slots: args.batch * blocks * PAGE_SIZE,
            max_seq: blocks * PAGE_SIZE,
            step_tokens: args.batch,
            weights: args.model.weights,
            stream_layers: true,
        },
        &crate::qwen3_cmd::FitFlags {
            layers: true,
            shared_weights: true,
            context: "a shorter context or a smaller batch (--max-seq, --seq-len, --batch)",
        },
    )?;
    let worker = args.run.worker()?;
    ops::register(&worker)?;
    let peaks = machine_peaks(args.membw_seconds);

    let layers = c.num_hidden_layers;
    let with_head = args.variant == Variant::Model;
    let case = DecodeCase::new(
        &c,
        args.batch,
        args.seq_len,
        max_seq,
        args.model.seed(),
        args.shared_weights,
    );
    let golden_flops = StepCost::decode(&c, layers, with_head, &case.batch.seq_lens).flops();
    let check = match (args.check, args.no_check) {
        (_, true) | (CheckWhen::Off, _) => false,
        (CheckWhen::On, _) => true,
        (CheckWhen::Auto, _) => golden_flops <= CHECK_DEFAULT_MAX_FLOPS,
    };
    let model = load_model(
        &args.model,
        &worker,
        &c,
        args.shared_weights,
        case.batch.max_blocks * case.batch.page_size,
        args.model.weights,
    )?;
    let kv = case.kv_buffers(&worker, &c)?;
    case.fill_kv(&c, &kv)?;
    let mut session = Session::new(&worker, model.clone(), kv);
    args.tiles.apply(&mut session);
    session.replay = args.replay.on();
    session.verify_replay = args.replay.verify();

    println!(
        "simpler run qwen3-decode: {}, {} layers (hidden {}, heads {}/{}x{}, intermediate {}, vocab {}), variant {:?}",
        args.model.describe(),
        layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
        args.variant
    );
    println!(
        "batch {}, seq_len {} -> {} over {} steps, block tables for {} tokens; {} cores; weights {:.2} GB resident ({} weight set{}), KV cache {:.2} GB",
        args.batch,
        args.seq_len,
        last_len,
        args.steps,
        case.batch.max_blocks * case.batch.page_size,
        worker.cores(),
        model.resident_bytes() as f64 / 1e9,
        model.sets,
        if model.sets == 1 { "" } else { "s" },
        2.0 * session.kv().k.len() as f64 / 1e9
    );
    println!("{}", describe_weights(args.model.weights));
    println!("{}", format_peaks(&peaks));
    println!("{}", format_paths(args.batch, &c));
    println!("{}", format_diagnostics(&Diagnostics::of(&cfg)));

    // Rounds of steps; the first step of the first round is kept for the check.
    let mut samples = Vec::new();
    let mut first: Option<(Vec<f32>, Vec<f32>, Vec<u32>)> = None;
    let mut outputs = opts::StepOutputs::new(&args.run);
    // The warm-up rounds' steps are marked in the trace, which the trace tools leave out.
    let warm_cfg = CallConfig {
        warmup: true,
        ..cfg.clone()
    };
    for round in 0..all_rounds {
        let cfg = if round < args.warmup { &warm_cfg } else { &cfg };
        let mut tokens = case.tokens.clone();
        let mut hidden = case.hidden.clone();
        for step in 0..args.steps {
            let batch = PagedBatch {
                seq_lens: case.batch.seq_lens.iter().map(|&s| s + step).collect(),
                ..case.batch.clone()
            };
            session.read_logits = check && first.is_none();
            let t0 = Instant::now();
            let report = match args.variant {
                Variant::Model => {
                    let out = session.decode(&worker, &batch, &tokens, cfg)?;
                    let e2e = t0.elapsed().as_secs_f64();
                    tokens.clone_from(&out.next_tokens);
                    if first.is_none() {
                        first = Some((out.hidden, out.logits, out.next_tokens));
                    }
                    (out.report, e2e)
                }
                Variant::Layers => {
                    let out = session.decode_layers(&worker, &batch, &hidden, 0..layers, cfg)?;
                    let e2e = t0.elapsed().as_secs_f64();
                    hidden.clone_from(&out.hidden);
                    if first.is_none() {
                        first = Some((
                            out.hidden.iter().map(|v| v.to_f32()).collect(),
                            Vec::new(),
                            Vec::new(),
                        ));
                    }
                    (out.report, e2e)
                }
            };
            let (report, e2e_s) = report;
            outputs.emit(&report, cfg)?;
            if !cfg.warmup {
                let cost = StepCost::decode(&c, layers, with_head, &batch.seq_lens).in_format(
                    &c,
                    layers,
                    with_head,
                    args.model.weights,
                );
                samples.push(Sample {
                    e2e_s,
                    report,
                    cost,
                });
            }
        }
    }
    outputs.finish();

    if check {
        let (hidden, logits, ids) = first.ok_or_else(|| anyhow!("no step ran"))?;
        let x0: Vec<f32> = match args.variant {
            Variant::Model => model.download_embedding_rows(&case.tokens)?,
            Variant::Layers => case.hidden.iter().map(|v| v.to_f32()).collect(),
        };
        let t = Instant::now();
        let acts = simpler_models::qwen3::golden::Acts::of(args.model.weights);
        // The golden multiplies the weights the model holds, read back as the values the
        // kernels multiply (bf16 widened; an int8 model's exact `q · scale`, which bf16 cannot
        // hold), one weight set at a time. The head is read back by `golden`.
        let mut held: Option<(usize, Arc<LayerWeights<f32>>)> = None;
        let mut layer = |l: usize| {
            let set = model.set_of_layer[l];
            match &held {
                Some((s, w)) if *s == set => Ok(w.clone()),
                _ => {
                    let w = Arc::new(model.download_layer_f32(set).map_err(|e| e.to_string())?);
                    held = Some((set, w.clone()));
                    Ok(w)
                }
            }
        };
        let mut want = case.golden(&c, layers, &mut layer, acts, &model, &x0, with_head)?;
        if args.variant == Variant::Layers {
            // The layers chunk rounds its output to bf16 once, at the end.
            want.hidden
                .iter_mut()
                .for_each(|v| *v = bf16::from_f32(*v).to_f32());
        }
        let kv = session.kv();
        let mut rows = |l: usize, s: usize| kv.read_slot(l, s).map_err(|e| e.to_string());
        let head = with_head.then_some((logits.as_slice(), ids.as_slice()));
        let lines = compare_step_as(&want, &hidden, head, &mut rows, args.model.weights)
            .map_err(|e| anyhow!("check FAILED against the golden: {e}"))?;
        println!(
            "check vs golden (first step; golden took {:.1} s):",
            t.elapsed().as_secs_f64()
        );
        for l in lines {
            println!("  ok: {l}");
        }
    } else {
        println!(
            "check: off (--check on to compare with the golden; ~{:.0} GFLOP of plain loops)",
            golden_flops / 1e9
        );
    }
    let after = machine_peaks(args.membw_seconds);
    println!(
        "machine after the steps: streaming read {:.1} GB/s (best pass), FMA {:.1} GFLOP/s; the report divides by the better of before and after",
        after.read_gbs_all, after.fma_gflops_all
    );
    let peaks = best_peaks(&peaks, &after);
    // One more step recorded at swimlane level 1 for the per-phase table (the measured steps
    // ran without the recorder).
    let batch = PagedBatch {
        seq_lens: case.batch.seq_lens.clone(),
        ..case.batch.clone()
    };
    session.read_logits = false;
    let sw_cfg = crate::bench_qwen3::swimlane_config(&cfg);
    let recorded = match args.variant {
        Variant::Model => {
            session
                .decode(&worker, &batch, &case.tokens, &sw_cfg)?
                .report
        }
        Variant::Layers => {
            session
                .decode_layers(&worker, &batch, &case.hidden, 0..layers, &sw_cfg)?
                .report
        }
    };
    let phases = DecodePhases::decode(&c, layers, with_head, &batch.seq_lens, args.model.weights);
    let dpeaks = decode_peaks(
        &peaks,
        args.batch,
        &c,
        args.model.weights,
        args.membw_seconds,
    );
    print_report(
        &samples,
        &peaks,
        args.batch,
        layers,
        args.warmup,
        args.rounds,
        args.steps,
    );
    let tpot = Summary::of(&samples.iter().map(|s| s.e2e_s).collect::<Vec<f64>>());
    // The phases of the first step's shape (later steps of a round are a token longer).
    let bound = phases.bound_s(&dpeaks);
    println!(
        "  {}",
        format_phase_share("median step", tpot.median, bound)
    );
    println!("  {}", format_phase_share("quietest step", tpot.min, bound));
    match format_phase_table(&phases, &dpeaks, &recorded) {
        Some(t) => {
            println!(
                "  per phase (one step recorded at swimlane level 1 after the measured ones, at the first step's lengths):"
            );
            print!("{t}");
        }
        None => println!("  per phase: the recorded step carried no swimlane"),
    }
    println!(
        "  {}",
        describe_graphs(args.replay, samples.iter().map(|s| &s.report))
    );
    Ok(())
}

fn print_report(
    samples: &[Sample],
    peaks: &MachinePeaks,
    batch: usize,
    layers: usize,
    warmup: usize,
    rounds: usize,
    steps: usize,
) {
    let tpot_ms: Vec<f64> = samples.iter().map(|s| s.e2e_s * 1e3).collect();
    let tpot = Summary::of(&tpot_ms);
    let us =
        |f: &dyn Fn(&RunReport) -> u64| median(samples.iter().map(|s| f(&s.report) as f64 / 1e3));
    let eff = us(&|r| r.effective().dur_ns());
    let init = us(&|r| {
        r.device_wall
            .dur_ns()
            .saturating_sub(r.effective().dur_ns())
    });
    let hand = us(&|r| r.runner.dur_ns().saturating_sub(r.device_wall.dur_ns()));
    let bind = us(&|r| r.host_wall.dur_ns().saturating_sub(r.runner.dur_ns()));
    let wrap = median(
        samples
            .iter()
            .map(|s| s.e2e_s * 1e6 - s.report.host_wall.dur_ns() as f64 / 1e3),
    );
    let layers_us = median(samples.iter().map(|s| slot_us(&s.report.task_slots, 1)));
    let head_us = median(samples.iter().map(|s| slot_us(&s.report.task_slots, 2)));
    let input_us = median(samples.iter().map(|s| slot_us(&s.report.task_slots, 0)));
    let tasks = median(samples.iter().map(|s| s.report.counters.tasks as f64));
    let cost = samples[samples.len() / 2].cost;
    let t = tpot.median / 1e3;
    let gbs = cost.bytes() / t / 1e9;
    let compute = matmul_peak(peaks, batch);
    let bound = cost.roofline_s(peaks.read_gbs_all, compute);
    let limit = if cost.bytes() / (peaks.read_gbs_all * 1e9) >= cost.flops() / (compute * 1e9) {
        "bandwidth"
    } else {
        "compute"
    };
    println!(
        "per token: {} measured steps ({rounds} rounds x {steps} steps; {warmup} warm-up round(s) discarded), {:.0} tasks per step",
        samples.len(),
        tasks
    );
    println!("  {}", format_summary("TPOT_ms", &tpot, warmup * steps));
    println!(
        "  TPOT {:.2} ms = {:.2} tokens/s ({} sequences per step)",
        tpot.median,
        batch as f64 / t,
        batch
    );
    println!(
        "  timing layers (median): (1) effective (orch ∪ sched) {eff:.0} us | (2) device init/finalize {init:.0} us | (3) handshake {hand:.0} us | (4) bind+validate {bind:.0} us | (5) engine wrap {wrap:.0} us (step time - run: inputs written, outputs read back)"
    );
    println!(
        "  time per layer {:.0} us (span of all layer tasks, first dispatch to last finish, / {layers}); input {input_us:.0} us; head (final norm + LM head + argmax) {head_us:.0} us",
        layers_us / layers as f64
    );
    println!(
        "  bytes per step: weights {:.3} GB + KV read {:.3} GB + KV written {:.2} MB = {:.3} GB",
        cost.weight_bytes / 1e9,
        cost.kv_read_bytes / 1e9,
        cost.kv_write_bytes / 1e6,
        cost.bytes() / 1e9
    );
    println!(
        "  achieved {gbs:.2} GB/s = {:.1}% of this machine's streaming read bandwidth ({:.1} GB/s, best pass; {:.1}% of the median pass)",
        100.0 * gbs / peaks.read_gbs_all,
        peaks.read_gbs_all,
        100.0 * gbs / peaks.read_gbs_all_median
    );
    println!(
        "  FLOPs per step {:.2} G (matmul {:.2} G, attention {:.3} G) = {:.1} GFLOP/s; roofline bound max(bytes/bw, flops/peak) = {:.2} ms ({limit}-bound): achieved {:.1}% of the roofline",
        cost.flops() / 1e9,
        cost.matmul_flops / 1e9,
        cost.attention_flops / 1e9,
        cost.flops() / t / 1e9,
        bound * 1e3,
        100.0 * bound / t,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peaks(fma: f64, lower_bound: bool) -> MachinePeaks {
        MachinePeaks {
            threads: 2,
            read_gbs_one: 20.0,
            read_gbs_one_median: 19.0,
            read_gbs_all: 35.0,
            read_gbs_all_median: 33.0,
            fma_gflops_one: fma / 2.0,
            fma_gflops_all: fma,
            bf16_dot_gflops_one: 0.0,
            bf16_dot_gflops_all: 0.0,
            amx_bf16_gflops_one: 0.0,
            amx_bf16_gflops_all: 0.0,
            compute_lower_bound: lower_bound,
        }
    }

    /// A compute peak measured only in disturbed runs is a lower bound, said so in the
    /// report; the better of two measurements is one only when both were.
    #[test]
    fn a_disturbed_peak_is_reported_as_a_lower_bound() {
        let (clean, held) = (peaks(230.0, false), peaks(120.0, true));
        let best = best_peaks(&held, &clean);
        assert_eq!(best.fma_gflops_all, 230.0);
        assert!(!best.compute_lower_bound);
        assert!(best_peaks(&held, &held).compute_lower_bound);
        assert!(format_peaks(&held).contains("lower bounds"));
        assert!(!format_peaks(&clean).contains("lower bound"));
    }
}
