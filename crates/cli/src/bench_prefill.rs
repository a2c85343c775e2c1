//! `simpler bench qwen3-prefill`: one causal prefill step of a whole prompt (embedding, every
//! layer, final norm, LM head and argmax for the last position) at several prompt lengths —
//! tokens/s, the step time's statistics, achieved GFLOP/s against this machine's matmul rate
//! measured in the same run, the roofline share, and the share of the step spent outside
//! kernels (`docs/performance.md`).
//!
//! Two denominators, both measured in the run:
//! - the fp32 FMA peak of every thread (`membw`), the better of a measurement before the run
//!   and one after each prompt length's steps (as `bench qwen3-decode` does);
//! - our own bf16 GEMM kernel's rate on the model's largest dense projection shape,
//!   `[prompt, hidden] x [intermediate, hidden]^T`, spread over the worker's cores the way a
//!   prefill step spreads a projection: the session's row tiles, taken in turn from a shared
//!   counter, each computed into per-thread scratch by one `gemm_bf16` call over all prompt
//!   rows, on the activations each thread converted once for its path where the step's
//!   projections do so too (`ActsConversion::pays`; timed with the thread's first tile).
//!   Measured right before that prompt length's steps; the best call counts (the rate the
//!   model's projections could reach if nothing else ran). Packing the activations is not
//!   timed.
//!
//! "Outside kernels" is read from `--outside-steps` extra steps recorded at swimlane level 1
//! after the measured rounds, `1 - kernel busy / (cores x effective)`: their median and range.
//! (Taken from the last warm-up step, at the default single warm-up that was the process's
//! first, cold step: 16–18% at 64 tokens on Zen 4 against 2.5% once warm.)

use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use half::bf16;
use simpler_core::{CallConfig, RunReport, Worker};
use simpler_dfx::bench_stats::{
    Diagnostics, Summary, format_compare, format_diagnostics, format_summary, run_interleaved,
};
use simpler_kernels_cpu::{
    ActsConversion, GemmTile, OutMode, PackedActs, WeightLayout, WeightsBf16, gemm_bf16,
    gemm_bf16_converted, pack_acts_f32, packed_len,
};
use simpler_models::qwen3::golden::PrefillChunk;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{KvBuffers, PagedBatch, Qwen3Config, RunShape, Session, StepCost, ops};

use crate::opts::RunOpts;
use crate::qwen3_cmd::{ModelArgs, TileArgs, describe_weights, load_model};
use crate::qwen3_decode::{best_peaks, format_peaks, machine_peaks};

/// Arguments of `simpler bench qwen3-prefill`.
#[derive(Args, Debug)]
pub(crate) struct PrefillBenchArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Prompt lengths in tokens, comma-separated; each is prefilled in one step from an empty
    /// cache.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    prompt_lens: Vec<usize>,
    /// Warm-up rounds per prompt length (one step each, discarded).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Steps recorded at swimlane level 1 after the measured rounds, per prompt length, for the
    /// outside-kernels share (their median and range).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = crate::qwen3_cmd::positive)]
    outside_steps: usize,
    /// Measured rounds per prompt length: a bench round is one step, replayed from the same state
    /// (as `run`'s rounds replay their steps).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seconds spent measuring this machine's bandwidth and FMA peak first (and again, at most
    /// one second, after each prompt length; at least 0.2 each time).
    #[arg(long, value_parser = crate::opts::seconds, default_value_t = 1.0)]
    membw_seconds: f64,
    /// Seconds spent measuring the bf16 GEMM kernel's rate before each prompt length.
    #[arg(long, value_parser = crate::opts::seconds, default_value_t = 1.0)]
    gemm_seconds: f64,
    #[command(flatten)]
    tiles: TileArgs,
    /// Also compare this run's tiling with another, step against step: `KEY=VALUE` pairs
    /// (`tile-kib`, `tiles-per-core`, `prefill-rows`: query rows per attention task,
    /// `qkv-scratch-kib`: the bound on a q/k/v block's products) applied on top of it, e.g.
    /// `prefill-rows=128`. Each prompt length then runs `--rounds` interleaved pairs of steps
    /// A B, B A .. (after `--warmup` pairs) and reports the median of the paired step-time
    /// ratios B/A with its 95% interval: neighbouring steps see the same host load, where
    /// separate runs do not.
    #[arg(long, value_name = "KEY=VALUE,..")]
    versus: Option<String>,
    #[command(flatten)]
    run: RunOpts,
}

/// Checks the prompt lengths against the model (`None`: only what needs no model); errors
/// name the fix.
fn check_prompt_lens(lens: &[usize], c: Option<&Qwen3Config>) -> Result<()> {
    if lens.is_empty() {
        bail!("--prompt-lens: give at least one prompt length, e.g. --prompt-lens 64,256");
    }
    for (i, &len) in lens.iter().enumerate() {
        if lens[..i].contains(&len) {
            bail!("--prompt-lens: {len} is given twice");
        }
        if len == 0 {
            bail!(
                "--prompt-lens: a prompt of 0 tokens cannot be prefilled; give lengths of at least 1, e.g. --prompt-lens 64,256"
            );
        }
        if let Some(c) = c.filter(|c| len > c.max_position_embeddings) {
            bail!(
                "--prompt-lens: {len} tokens is longer than the model's max_position_embeddings ({}); give lengths up to {}",
                c.max_position_embeddings,
                c.max_position_embeddings
            );
        }
    }
    Ok(())
}

/// Seeded prompt token ids (splitmix64), uniform over the vocabulary.
fn prompt_tokens(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = seed ^ 0x5EED_F00D_CAFE_D00D;
    (0..len)
        .map(|_| (splitmix64(&mut state) % vocab.max(1) as u64) as u32)
        .collect()
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A value in `[-scale, scale)` from the generator.
fn uniform(state: &mut u64, scale: f32) -> f32 {
    let u = (splitmix64(state) >> 40) as f32 / (1u64 << 24) as f32;
    (2.0 * u - 1.0) * scale
}

/// What [`gemm_rate`] found.
#[derive(Clone, Copy, Debug)]
struct GemmRate {
    m: usize,
    k: usize,
    n: usize,
    layout: WeightLayout,
    threads: usize,
    tiles: usize,
    calls: usize,
    best_gflops: f64,
    median_gflops: f64,
}

/// The bf16 GEMM kernel's rate on `out [m, n] = x [m, k] @ w [n, k]^T` with `tiles` spread over
/// `threads` threads (see the module docs), for about `budget`.
#[allow(clippy::too_many_arguments)]
fn gemm_rate(
    m: usize,
    k: usize,
    tiles: &[std::ops::Range<usize>],
    layout: WeightLayout,
    threads: usize,
    budget: Duration,
    seed: u64,
) -> GemmRate {
    let n = tiles.iter().map(|t| t.end).max().unwrap_or(0);
    let threads = threads.max(1);
    let mut state = seed ^ 0x0DDB_A110_u64;
    let w: Vec<bf16> = (0..n * k)
        .map(|_| bf16::from_f32(uniform(&mut state, 0.05)))
        .collect();
    let x: Vec<f32> = (0..m * k)
        .map(|_| bf16::from_f32(uniform(&mut state, 1.0)).to_f32())
        .collect();
    let mut packed = vec![0.0f32; packed_len(m, k)];
    pack_acts_f32(&x, m, k, &mut packed);
    // The weights in the layout the model's projections use, so the rate is that kernel's.
    let stored = match layout {
        WeightLayout::RowMajor => w,
        WeightLayout::Pairs => simpler_kernels_cpu::pair_weights_bf16(&w, n, k),
        WeightLayout::Tiled => simpler_kernels_cpu::tile_weights_bf16(&w, n, k),
    };
    let w = WeightsBf16::with_layout(&stored, n, k, layout);
    let x = PackedActs::new(&packed, m, k);
    let widest = tiles.iter().map(|t| t.len()).max().unwrap_or(0);
    let flops = 2.0 * (m * k * n) as f64;

    // Calls over every tile with `threads` threads. Each thread notes when it took its first
    // tile and finished its last; a call lasts from the earliest first to the latest last (a
    // thread the host kept off the CPU until the tiles were gone neither shortens nor
    // stretches it).
    let run = |calls: usize| -> Vec<f64> {
        let counters: Vec<AtomicUsize> = (0..calls).map(|_| AtomicUsize::new(0)).collect();
        let barrier = Barrier::new(threads);
        let spans: Vec<Vec<Option<(Instant, Instant)>>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    let (counters, barrier) = (&counters, &barrier);
                    s.spawn(move || {
                        let mut scratch = vec![0.0f32; m * widest];
                        let mut spans = Vec::with_capacity(counters.len());
                        // Converted once per call and thread, as a step's core converts a
                        // task's input once for all its blocks.
                        let mut conv = ActsConversion::default();
                        let converts = ActsConversion::pays(m, k, layout);
                        for next in counters {
                            barrier.wait();
                            let mut span: Option<(Instant, Instant)> = None;
                            loop {
                                let t0 = Instant::now();
                                let i = next.fetch_add(1, Ordering::Relaxed);
                                let Some(tile) = tiles.get(i) else { break };
                                let tile = GemmTile {
                                    n: tile.clone(),
                                    k: 0..k,
                                    mode: OutMode::Store,
                                };
                                let ld = tile.n.len();
                                let out = &mut scratch[..m * ld];
                                if converts {
                                    if span.is_none() {
                                        conv.convert(x);
                                    }
                                    gemm_bf16_converted(w, x, &conv, &tile, out, ld);
                                } else {
                                    gemm_bf16(w, x, &tile, out, ld);
                                }
                                let first = span.map_or(t0, |s| s.0);
                                span = Some((first, Instant::now()));
                            }
                            spans.push(span);
                        }
                        spans
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        (0..calls)
            .filter_map(|c| {
                let mine = spans.iter().filter_map(|t| t.get(c).copied().flatten());
                let (a, b) = mine.fold(None, |acc: Option<(Instant, Instant)>, (a, b)| {
                    Some(acc.map_or((a, b), |(x, y)| (x.min(a), y.max(b))))
                })?;
                Some((b - a).as_secs_f64().max(1e-9))
            })
            .collect()
    };
    // One call sizes the rest: as many as fit the budget, 2 to 200.
    let first = run(1).first().copied().unwrap_or(1.0).max(1e-6);
    let calls = ((budget.as_secs_f64() / first) as usize).clamp(2, 200);
    let mut gflops: Vec<f64> = run(calls).iter().map(|s| flops / s / 1e9).collect();
    gflops.push(flops / first / 1e9);
    let s = Summary::of(&gflops);
    GemmRate {
        layout,
        m,
        k,
        n,
        threads,
        tiles: tiles.len(),
        calls: gflops.len(),
        best_gflops: s.max,
        median_gflops: s.median,
    }
}

/// One prefill step of `tokens` from an empty cache.
fn prefill_step(
    session: &mut Session,
    worker: &Worker,
    batch: &PagedBatch,
    tokens: &[u32],
    cfg: &CallConfig,
) -> Result<(f64, RunReport)> {
    let chunk = PrefillChunk {
        seq: 0,
        tokens: tokens.to_vec(),
        seq_len: tokens.len(),
    };
    let t = Instant::now();
    let out = session
        .prefill(worker, batch, &[chunk], cfg)
        .with_context(|| format!("prefill of {} tokens", tokens.len()))?;
    Ok((t.elapsed().as_secs_f64(), out.report))
}

/// The CPU time every thread of this process has had so far (Linux `schedstat`: time on a
/// CPU, in ns), for a step's CPU time on a host shared with other work, where its wall time
/// also counts the time the threads waited for a CPU. `None` where the files are missing.
fn process_cpu_ns() -> Option<u64> {
    let mut total = 0u64;
    for entry in std::fs::read_dir("/proc/self/task").ok()? {
        let path = entry.ok()?.path().join("schedstat");
        // A thread may end between the listing and the read: it no longer counts.
        if let Ok(text) = std::fs::read_to_string(path) {
            total += text.split_whitespace().next()?.parse::<u64>().ok()?;
        }
    }
    Some(total)
}

/// One prompt length's results.
struct Row {
    prompt: usize,
    step_ms: f64,
    tokens_s: f64,
    gflops: f64,
    fma_pct: f64,
    gemm_pct: f64,
    roofline_pct: f64,
    outside_pct: f64,
}

pub(crate) fn main(args: PrefillBenchArgs) -> Result<()> {
    crate::opts::check_rounds(args.warmup, args.rounds)?;
    crate::opts::check_recorded_steps("--outside-steps", args.outside_steps)?;
    check_prompt_lens(&args.prompt_lens, None)?;
    args.run.refuse_diag_steps("bench qwen3-prefill")?;
    if args.tiles.max_kv_chunk.is_some() {
        bail!(
            "--max-kv-chunk: prefill attention is not split by KV chunks; it applies to decode (`run` and `bench qwen3-decode`)"
        );
    }
    let versus = args.versus.as_deref().map(TileArgs::parse).transpose()?;
    if versus.as_ref().is_some_and(|v| v.max_kv_chunk.is_some()) {
        bail!(
            "--versus max-kv-chunk: prefill attention is not split by KV chunks; it applies to decode (`bench qwen3-decode --versus`)"
        );
    }
    let mut cfg = args.run.recording_call_config("prefill")?;
    let c = args.model.config(None)?;
    check_prompt_lens(&args.prompt_lens, Some(&c))?;
    let layers = c.num_hidden_layers;
    let page = PAGE_SIZE;
    let longest = args.prompt_lens.iter().copied().max().unwrap_or(1);
    args.model.check_memory(
        &c,
        &RunShape {
            layers,
            shared_weights: false,
            kv_slots: longest.next_multiple_of(page),
            max_seq: longest.next_multiple_of(page),
            step_tokens: longest,
            weights: args.model.weights,
            stream_layers: true,
        },
        &crate::qwen3_cmd::FitFlags {
            layers: false,
            shared_weights: false,
            context: "shorter prompts (--prompt-lens)",
        },
    )?;
    let worker = args
        .run
        .prefill_sized(&mut cfg, &c, longest, 0, "--prompt-lens")?;
    ops::register(&worker)?;
    let peaks = machine_peaks(args.membw_seconds);
    let model = load_model(
        &args.model,
        &worker,
        &c,
        false,
        longest.next_multiple_of(page),
        args.model.weights,
    )?;
    println!(
        "simpler bench qwen3-prefill: {}, {layers} layers (hidden {}, intermediate {}, vocab {}); one prefill step per prompt from an empty cache (embedding, layers, LM head and argmax for the last position); {} cores",
        args.model.describe(),
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size,
        worker.cores()
    );
    println!("{}", describe_weights(args.model.weights));
    println!("{}", format_peaks(&peaks));
    println!("{}", format_diagnostics(&Diagnostics::of(&cfg)));
    let sw_cfg = crate::bench_qwen3::swimlane_config(&cfg);
    let mut rows = Vec::new();
    for &len in &args.prompt_lens {
        let batch = PagedBatch::identity(vec![len], len, page);
        let kv = KvBuffers::new(&worker, &c, batch.num_pages(), batch.page_size)?;
        let mut session = Session::new(&worker, model.clone(), kv);
        args.tiles.apply(&mut session);
        session.read_logits = false;
        let tokens = prompt_tokens(
            len,
            c.vocab_size,
            args.model.seed().wrapping_add(len as u64),
        );

        let gemm_tiles = session
            .policy
            .row_tiles(c.intermediate_size, 2 * c.hidden_size);
        let gemm = gemm_rate(
            len,
            c.hidden_size,
            &gemm_tiles,
            // The layout the gate/up matrix (the one timed) is uploaded in.
            simpler_models::qwen3::layout::bf16_layout(c.intermediate_size, c.hidden_size),
            worker.cores(),
            Duration::from_secs_f64(args.gemm_seconds.max(0.0)),
            args.model.seed(),
        );

        for _ in 0..args.warmup {
            prefill_step(&mut session, &worker, &batch, &tokens, &cfg)?;
        }
        let mut samples = Vec::with_capacity(args.rounds);
        let mut effective_ms = Vec::with_capacity(args.rounds);
        let mut cpu_ms = Vec::with_capacity(args.rounds);
        let mut last = None;
        for _ in 0..args.rounds {
            let c0 = process_cpu_ns();
            let (secs, report) = prefill_step(&mut session, &worker, &batch, &tokens, &cfg)?;
            if let (Some(a), Some(b)) = (c0, process_cpu_ns()) {
                cpu_ms.push(b.saturating_sub(a) as f64 / 1e6);
            }
            samples.push(secs * 1e3);
            effective_ms.push(report.effective().us() / 1e3);
            last = Some(report);
        }
        let mut recorded: Vec<(f64, RunReport)> = Vec::with_capacity(args.outside_steps);
        // Recorded steps whose swimlane dropped records: they give no share.
        let mut left_out: Vec<RunReport> = Vec::new();
        for _ in 0..args.outside_steps {
            let (_, report) = prefill_step(&mut session, &worker, &batch, &tokens, &sw_cfg)?;
            match report.outside_kernels() {
                Some(o) => recorded.push((o.raw, report)),
                None => left_out.push(report),
            }
        }
        recorded.sort_by(|a, b| a.0.total_cmp(&b.0));
        let outside_report = recorded
            .get(recorded.len() / 2)
            .map(|r| &r.1)
            .or(left_out.last());
        // With `--output-dir`, the recorded step's swimlane (and whatever else was asked for)
        // is written there, for `simpler trace swimlane` / `idle` / `critical-path`; with
        // several prompt lengths each in its own folder.
        let len_cfg = crate::opts::case_config(&cfg, &format!("{len}"), args.prompt_lens.len() > 1);
        crate::opts::emit_case(&len_cfg, outside_report, last.as_ref())?;
        let peaks = best_peaks(&peaks, &machine_peaks(args.membw_seconds.min(1.0)));

        let s = Summary::of(&samples);
        let t = s.median / 1e3;
        let cost = StepCost::prefill(&c, layers, true, len, 0).in_format(
            &c,
            layers,
            true,
            args.model.weights,
        );
        let gflops = cost.flops() / t / 1e9;
        // The compute denominator is the peak of the path the projections ran on (the AMX
        // tile peak where prefill runs on tiles), so the percentage stays below 100.
        let compute = crate::qwen3_decode::matmul_peak(&peaks, len);
        let path = crate::qwen3_decode::gemm_path(len);
        let fma_pct = 100.0 * gflops / compute;
        let gemm_pct = 100.0 * gflops / gemm.best_gflops;
        let bound = cost.roofline_s(peaks.read_gbs_all, compute);
        let limit = if cost.bytes() / (peaks.read_gbs_all * 1e9) >= cost.flops() / (compute * 1e9) {
            "bandwidth"
        } else {
            "compute"
        };
        let outside = recorded.get(recorded.len() / 2).map_or(f64::NAN, |r| r.0);
        let (out_lo, out_hi) = (
            recorded.first().map_or(f64::NAN, |r| r.0),
            recorded.last().map_or(f64::NAN, |r| r.0),
        );
        let eff_ms = Summary::of(&effective_ms).median;
        let tasks = last.as_ref().map_or(0, |r| r.counters.tasks);

        println!("prompt {len} tokens (positions 0..{len}, {tasks} tasks per step):");
        println!("  {}", crate::qwen3_decode::format_paths(len, &c));
        println!(
            "  prefill attention path: {} (head_dim {})",
            simpler_kernels_cpu::attention::prefill_path(
                simpler_kernels_cpu::Isa::detected(),
                c.head_dim
            )
            .name(),
            c.head_dim
        );
        println!("  {}", format_summary("step_ms", &s, args.warmup));
        println!(
            "  {:.1} tokens/s; effective (orch ∪ sched) {eff_ms:.2} ms of the {:.2} ms step (medians)",
            len as f64 / t,
            s.median
        );
        if !cpu_ms.is_empty() {
            let c = Summary::of(&cpu_ms);
            println!(
                "  step CPU time (every thread of the process): median {:.2} ms [{:.2}, {:.2}]",
                c.median, c.min, c.max
            );
        }
        println!(
            "  FLOPs/step {:.2} G (matmul {:.2} G, attention {:.3} G) -> {gflops:.2} GFLOP/s = {fma_pct:.1}% of the {} peak ({:.1} GFLOP/s, best of the measurements before and after; fp32 FMA peak {:.1}), {gemm_pct:.1}% of the GEMM rate",
            cost.flops() / 1e9,
            cost.matmul_flops / 1e9,
            cost.attention_flops / 1e9,
            path.name(),
            compute,
            peaks.fma_gflops_all
        );
        // A step cannot run above the peak of its path or the rate of its own GEMM on the same
        // rows: a figure above 100% means that measurement ran while this process's threads
        // were held off a CPU (a shared host; seen at `--membw-seconds 0.3`), so the
        // percentages of this prompt length are not to be trusted.
        for (pct, what) in [(fma_pct, "peak"), (gemm_pct, "GEMM rate")] {
            if pct > 100.0 {
                println!(
                    "  warning: the step ran at {pct:.1}% of the {what}: that measurement was \
                     disturbed (threads held off a CPU); rerun, with a longer --membw-seconds"
                );
            }
        }
        println!(
            "  GEMM rate: bf16 gemm_bf16 on [{} x {}] x [{} x {}]^T ({} weights, as the projections), {} row tiles over {} threads: best {:.2} GFLOP/s, median {:.2} over {} calls ({:.1}% of the {} peak)",
            gemm.m,
            gemm.k,
            gemm.n,
            gemm.k,
            match gemm.layout {
                WeightLayout::RowMajor => "row-major",
                WeightLayout::Pairs => "paired",
                WeightLayout::Tiled => "tiled",
            },
            gemm.tiles,
            gemm.threads,
            gemm.best_gflops,
            gemm.median_gflops,
            gemm.calls,
            100.0 * gemm.best_gflops / compute,
            path.name()
        );
        println!(
            "  bytes/step {:.3} GB (weights {:.3}, KV read {:.4}, KV written {:.4}); roofline bound {:.2} ms ({limit}-bound) = {:.1}% achieved",
            cost.bytes() / 1e9,
            cost.weight_bytes / 1e9,
            cost.kv_read_bytes / 1e9,
            cost.kv_write_bytes / 1e9,
            bound * 1e3,
            100.0 * bound / t
        );
        if !recorded.is_empty() {
            println!(
                "  outside kernels {:.1}% of the cores' time during effective (median of {} steps at swimlane level 1 after the measured rounds, range {:.1}..{:.1}%: 1 - kernel busy / (cores x effective))",
                100.0 * outside,
                recorded.len(),
                100.0 * out_lo,
                100.0 * out_hi
            );
        }
        if let Some(line) = crate::bench_qwen3::left_out_line(&left_out, args.outside_steps) {
            println!("  {line}");
        }
        if let Some(versus) = &versus {
            let a = session.policy;
            let mut b = a;
            versus.apply_to(&mut b);
            // Both closures run steps on the one session (one at a time).
            let state = std::cell::RefCell::new((&mut session, None::<anyhow::Error>));
            let step_ms = |policy, side: &str| {
                let (session, failure) = &mut *state.borrow_mut();
                session.policy = policy;
                match prefill_step(session, &worker, &batch, &tokens, &cfg) {
                    Ok((secs, _)) => secs * 1e3,
                    Err(e) => {
                        failure.get_or_insert(e.context(format!("a step of tiling {side}")));
                        f64::NAN
                    }
                }
            };
            let pairs = run_interleaved(
                args.rounds,
                args.warmup,
                || step_ms(a, "A (this run's)"),
                || step_ms(b, "B"),
            );
            let (_, failure) = state.into_inner();
            session.policy = a;
            if let Some(e) = failure {
                return Err(e.context("--versus"));
            }
            println!(
                "  tiling compared (interleaved steps A B B A ..; median of the paired B/A ratios with a bootstrap interval):"
            );
            let spec = args.versus.as_deref().unwrap_or_default();
            for line in
                format_compare("step_ms", "this run's tiling", spec, &pairs.compare()).lines()
            {
                println!("  {line}");
            }
        }
        rows.push(Row {
            prompt: len,
            step_ms: s.median,
            tokens_s: len as f64 / t,
            gflops,
            fma_pct,
            gemm_pct,
            roofline_pct: 100.0 * bound / t,
            outside_pct: 100.0 * outside,
        });
    }
    println!("summary (medians):");
    println!(
        "  {:>7} {:>10} {:>9} {:>8} {:>6} {:>6} {:>10} {:>9}",
        "prompt", "step ms", "tokens/s", "GFLOP/s", "%peak", "%GEMM", "%roofline", "%outside"
    );
    for r in &rows {
        println!(
            "  {:>7} {:>10.2} {:>9.1} {:>8.2} {:>6.1} {:>6.1} {:>10.1} {:>9}",
            r.prompt,
            r.step_ms,
            r.tokens_s,
            r.gflops,
            r.fma_pct,
            r.gemm_pct,
            r.roofline_pct,
            crate::bench_qwen3::pct_cell(r.outside_pct)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lengths_are_checked_with_the_fix_named() {
        let c = Qwen3Config::preset("tiny").unwrap();
        assert!(check_prompt_lens(&[1, 8], Some(&c)).is_ok());
        let e = check_prompt_lens(&[8, 0], None).unwrap_err().to_string();
        assert!(e.contains("0 tokens") && e.contains("at least 1"), "{e}");
        let too_long = c.max_position_embeddings + 1;
        assert!(check_prompt_lens(&[too_long], None).is_ok());
        let e = check_prompt_lens(&[too_long], Some(&c))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("max_position_embeddings") && e.contains("up to"),
            "{e}"
        );
        assert!(check_prompt_lens(&[], None).is_err());
    }

    #[test]
    fn the_gemm_rate_is_positive_and_counts_every_tile() {
        let tiles = [0..16, 16..32, 32..40];
        let r = gemm_rate(
            5,
            48,
            &tiles,
            WeightLayout::RowMajor,
            2,
            Duration::from_millis(5),
            7,
        );
        assert_eq!((r.m, r.k, r.n, r.tiles), (5, 48, 40, 3));
        assert!(r.calls >= 3 && r.best_gflops > 0.0 && r.best_gflops >= r.median_gflops);
        // Each layout the projections can use is timed in that layout.
        for layout in [WeightLayout::Pairs, WeightLayout::Tiled] {
            let r = gemm_rate(
                5,
                64,
                &[0..16, 16..32],
                layout,
                2,
                Duration::from_millis(5),
                7,
            );
            assert_eq!((r.layout, r.n, r.tiles), (layout, 32, 2));
            assert!(r.best_gflops > 0.0, "{layout:?}");
        }
    }

    #[test]
    fn prompt_tokens_are_seeded_and_in_the_vocabulary() {
        let a = prompt_tokens(100, 17, 3);
        assert_eq!(a, prompt_tokens(100, 17, 3));
        assert_ne!(a, prompt_tokens(100, 17, 4));
        assert!(a.iter().all(|&t| t < 17));
    }
}
