//! `simpler bench serve`: N concurrent requests of fixed prompt and output lengths served
//! together by the engine in this process — output tokens/s, TTFT and TPOT percentiles, and
//! the batched throughput against N times one stream's, measured in the same run, in rounds
//! that serve every N in turn (the output rate of each N summarised over the rounds).

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{RunShape, ops};
use simpler_serve::{Completion, Engine, EngineConfig, Request, SamplingParams};

use simpler_dfx::bench_stats::{Summary, format_summary};

use crate::opts::RunOpts;
use crate::qwen3_cmd::{ModelArgs, load_model};

/// Arguments of `simpler bench serve`.
#[derive(Args, Debug)]
pub(crate) struct BenchServeArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Concurrent requests of each measurement, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    streams: Vec<usize>,
    /// Prompt tokens of every request.
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Tokens every request generates (EOS ignored).
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Most tokens one engine step computes.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Measured rounds: each round serves every `--streams` count once, in turn (so the rows
    /// share the host's drift), each time with new prompts (no prefix-cache hits).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Warm-up rounds before them (discarded).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Sampling temperature of every request (0: greedy, the argmax taken in the step's
    /// graph; above 0 each token is drawn on the engine's thread from the step's logits, its
    /// cost inside the measured TPOT).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability (with
    /// `--temperature` above 0).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the K most likely tokens (with `--temperature` above 0).
    #[arg(long)]
    top_k: Option<usize>,
    #[command(flatten)]
    run: RunOpts,
}

impl BenchServeArgs {
    /// Request `r`'s sampling: the flags', seeded per request and measurement.
    fn sampling(&self, salt: u64, r: usize) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ r as u64,
        }
    }
}

/// The `q`-quantile (nearest rank) of `xs`.
fn quantile(xs: &[f64], q: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Distinct prompts (no shared prefix, so the cache does not help).
fn prompts(n: usize, len: usize, vocab: usize, salt: u64) -> Vec<Vec<u32>> {
    (0..n as u64)
        .map(|r| {
            let mut s = salt ^ (r.wrapping_mul(0x9E37_79B9_7F4A_7C15)) ^ 0x5EED;
            (0..len)
                .map(|_| {
                    s = s
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((s >> 33) % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

/// One `--streams` count's measured rounds.
struct Row {
    streams: usize,
    /// Output tokens/s of each round.
    rate: Summary,
    /// Median wall time of a round, s.
    wall_s: f64,
    /// Every round's requests.
    ttft_ms: Vec<f64>,
    tpot_ms: Vec<f64>,
    /// Median of the rounds' median bare decode steps, ms.
    step_ms: f64,
}

impl Row {
    fn of(rounds: &[Measure]) -> Row {
        let rates: Vec<f64> = rounds
            .iter()
            .map(|m| m.out_tokens as f64 / m.wall_s)
            .collect();
        let walls: Vec<f64> = rounds.iter().map(|m| m.wall_s).collect();
        let steps: Vec<f64> = rounds.iter().map(|m| m.step_ms).collect();
        Row {
            streams: rounds.first().map_or(0, |m| m.streams),
            rate: Summary::of(&rates),
            wall_s: Summary::of(&walls).median,
            ttft_ms: rounds
                .iter()
                .flat_map(|m| m.ttft_ms.iter().copied())
                .collect(),
            tpot_ms: rounds
                .iter()
                .flat_map(|m| m.tpot_ms.iter().copied())
                .collect(),
            step_ms: Summary::of(&steps).median,
        }
    }
}

/// Bare decode steps timed per measurement, the first [`TIMED_WARMUP`] of them warm-up.
const TIMED_STEPS: usize = 17;
/// The timed steps' warm-up, discarded (and marked so in the trace).
const TIMED_WARMUP: usize = 1;

struct Measure {
    streams: usize,
    /// Median time of a bare decode step at batch `streams` (no scheduler), ms.
    step_ms: f64,
    wall_s: f64,
    out_tokens: usize,
    ttft_ms: Vec<f64>,
    tpot_ms: Vec<f64>,
}

fn measure(
    engine: &mut Engine,
    streams: usize,
    args: &BenchServeArgs,
    vocab: usize,
    salt: u64,
) -> Result<Measure> {
    let reqs: Vec<Request> = prompts(streams, args.prompt_len, vocab, salt)
        .into_iter()
        .enumerate()
        .map(|(r, prompt)| Request {
            prompt,
            max_new_tokens: args.max_tokens,
            sampling: args.sampling(salt, r),
            ignore_eos: true,
        })
        .collect();
    let t = Instant::now();
    let done: Vec<Completion> = engine.generate(&reqs)?;
    let wall_s = t.elapsed().as_secs_f64();
    // The same batch's bare decode step, mid-way through the outputs' contexts.
    let context = args.prompt_len + args.max_tokens / 2;
    let steps = engine.time_decode_steps(streams, context, TIMED_STEPS, TIMED_WARMUP)?;
    let step_ms: Vec<f64> = steps[TIMED_WARMUP..]
        .iter()
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    Ok(Measure {
        streams,
        step_ms: quantile(&step_ms, 0.5),
        wall_s,
        out_tokens: done.iter().map(|c| c.tokens.len()).sum(),
        ttft_ms: done.iter().map(|c| c.ttft.as_secs_f64() * 1e3).collect(),
        tpot_ms: done
            .iter()
            .filter(|c| c.tokens.len() > 1)
            .map(|c| (c.finished - c.ttft).as_secs_f64() * 1e3 / (c.tokens.len() - 1) as f64)
            .collect(),
    })
}

pub(crate) fn main(args: BenchServeArgs) -> Result<()> {
    if args.streams.is_empty() || args.streams.contains(&0) {
        bail!("--streams: give positive counts, e.g. 1,4,16");
    }
    crate::opts::check_rounds(args.warmup, args.rounds)?;
    for (i, n) in args.streams.iter().enumerate() {
        if args.streams[..i].contains(n) {
            bail!("--streams: {n} is given twice");
        }
    }
    if args.prompt_len == 0 || args.max_tokens == 0 || args.max_num_batched_tokens == 0 {
        bail!("--prompt-len, --max-tokens and --max-num-batched-tokens must be at least 1");
    }
    if let Err((what, why)) = args.sampling(0, 0).validate() {
        bail!("--{}: {why}", what.replace('_', "-"));
    }
    if args.temperature == 0.0 && (args.top_k.is_some() || args.top_p != 1.0) {
        bail!("--top-k and --top-p shape a sampled draw: give --temperature above 0 with them");
    }
    // Room past the outputs for the bare decode steps timed at mid-output context.
    let seq = args
        .prompt_len
        .checked_add(args.max_tokens)
        .and_then(|n| n.checked_add(TIMED_STEPS))
        .with_context(|| {
            format!(
                "--prompt-len {} + --max-tokens {} + {TIMED_STEPS} timed decode steps overflows",
                args.prompt_len, args.max_tokens
            )
        })?;
    let mut call = args.run.call_config("serve")?;
    let c = args.model.config(None)?;
    ModelArgs::check_positions(
        &c,
        seq,
        &format!("--prompt-len + --max-tokens + {TIMED_STEPS} timed decode steps"),
    )?;
    let most = args.streams.iter().copied().max().unwrap_or(1);
    let blocks = most * seq.div_ceil(PAGE_SIZE);
    args.model.check_memory(
        &c,
        &RunShape {
            layers: c.num_hidden_layers,
            shared_weights: false,
            kv_slots: blocks * PAGE_SIZE,
            max_seq: seq.div_ceil(PAGE_SIZE) * PAGE_SIZE,
            step_tokens: args.max_num_batched_tokens,
            weights: args.model.weights,
            stream_layers: true,
        },
        &crate::qwen3_cmd::FitFlags {
            layers: false,
            shared_weights: false,
            context: "shorter requests or fewer streams (--prompt-len, --max-tokens, --streams)",
        },
    )?;
    // No step holds more than every stream's prompt and a decode row each.
    let rows = args
        .max_num_batched_tokens
        .min(most * (args.prompt_len + 1));
    let worker = args.run.prefill_sized(
        &mut call,
        &c,
        rows,
        seq.saturating_sub(rows),
        "--max-num-batched-tokens, --streams x --prompt-len",
    )?;
    ops::register(&worker)?;
    let cores = worker.cores();
    let engine_cfg = EngineConfig {
        max_batch_size: most,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_seq_len: seq,
        num_blocks: blocks,
        long_prefill_threshold: None,
        weights: args.model.weights,
    };
    let model = load_model(
        &args.model,
        &worker,
        &c,
        false,
        Engine::resident_seq(&engine_cfg),
        args.model.weights,
    )?;
    let mut engine = Engine::with_model(worker, model, Vec::new(), engine_cfg)?;
    // The ring sizes, the orchestration mode and the diagnostics of the flags; every step's
    // outputs written as they say.
    let outputs = crate::opts::StepOutputs::observe_engine(&mut engine, &args.run, &call)?;
    // Every step's spans are written inside the timed requests, to `--trace` or to
    // `DIR/trace.jsonl`: that is the trace's cost here.
    let diagnostics =
        simpler_dfx::bench_stats::format_diagnostics(&simpler_dfx::bench_stats::Diagnostics {
            trace: call.trace.is_some() || call.output_dir.is_some(),
            ..simpler_dfx::bench_stats::Diagnostics::of(&call)
        });
    engine.set_call_config(call.clone());
    println!(
        "simpler bench serve: {}, {} layers; {} prompt + {} output tokens per request, up to {} tokens per step; {cores} cores; requests served together by the engine (continuous batching; steps with prompt chunks on the prefill path, decode-only steps on the decode path)",
        args.model.describe(),
        c.num_hidden_layers,
        args.prompt_len,
        args.max_tokens,
        args.max_num_batched_tokens
    );
    println!("{}", crate::qwen3_cmd::describe_weights(args.model.weights));
    if args.temperature > 0.0 {
        println!(
            "sampling: temperature {}, top-p {}, top-k {} (each token drawn on the engine's thread from the step's logits; seeded per request)",
            args.temperature,
            args.top_p,
            args.top_k.map_or("off".to_string(), |k| k.to_string())
        );
    } else {
        println!("sampling: greedy (the argmax taken in the step's graph)");
    }
    // The decode steps' paths at the largest batch (the GEMM path can change with the rows).
    let most = args.streams.iter().copied().max().unwrap_or(1);
    println!(
        "{} (decode at {most} streams)",
        crate::qwen3_decode::format_paths(most, &c)
    );
    println!("{diagnostics}");
    // Rounds of every streams count in turn, warm-up rounds first (discarded); every
    // measurement has prompts of its own.
    let mut measured: Vec<Vec<Measure>> = args.streams.iter().map(|_| Vec::new()).collect();
    let mut salt = 0u64;
    for round in 0..args.warmup + args.rounds {
        // The warm-up rounds' steps are marked so in the trace (the trace tools leave them out).
        engine.set_call_config(simpler_core::CallConfig {
            warmup: round < args.warmup,
            ..call.clone()
        });
        for (i, &n) in args.streams.iter().enumerate() {
            salt += 1;
            let m = measure(&mut engine, n, &args, c.vocab_size, salt)?;
            if round >= args.warmup {
                measured[i].push(m);
            }
        }
    }
    let rows: Vec<Row> = measured.iter().map(|ms| Row::of(ms)).collect();
    let single = rows.iter().find(|m| m.streams == 1).map(|m| m.rate.median);
    println!(
        "{:>8} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>14} {:>10} {:>12}",
        "streams",
        "wall_s",
        "out_tok/s",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "tpot_p99",
        "vs_N_x_single",
        "step_bN",
        "vs_bN_step"
    );
    for m in &rows {
        let tps = m.rate.median;
        let ratio = single.map_or("n/a".to_string(), |s| {
            format!("{:.2}", tps / (s * m.streams as f64))
        });
        let tpot = quantile(&m.tpot_ms, 0.5);
        println!(
            "{:>8} {:>10.2} {:>12.2} {:>10.1} {:>10.1} {:>10.2} {:>10.2} {:>14} {:>10.2} {:>12.2}",
            m.streams,
            m.wall_s,
            tps,
            quantile(&m.ttft_ms, 0.5),
            quantile(&m.ttft_ms, 0.99),
            tpot,
            quantile(&m.tpot_ms, 0.99),
            ratio,
            m.step_ms,
            m.step_ms / tpot
        );
    }
    println!(
        "  (ms; medians of {} rounds after {} warm-up: wall_s and out_tok/s of the rounds, the percentiles over every round's requests; vs_N_x_single: output tokens/s over N times the one-stream rate measured above; step_bN: median bare decode step at batch N, mid-output context, no scheduler; vs_bN_step: serving decode throughput (N / TPOT p50) over the bare step rate (N / step_bN))",
        args.rounds, args.warmup
    );
    for m in &rows {
        println!(
            "  {}",
            format_summary(
                &format!("out_tok_per_s_{}_streams", m.streams),
                &m.rate,
                args.warmup
            )
        );
    }
    let s = engine.stats();
    println!(
        "engine: {} steps, {} tokens computed, {} served from the prefix cache, {} generated ({} sampled from the logits), {} preemptions, at most {} sequences in a step",
        s.steps,
        s.computed_tokens,
        s.cached_tokens,
        s.generated_tokens,
        s.sampled_tokens,
        s.preemptions,
        s.max_batch
    );
    if let Some(o) = &outputs {
        let o = o.lock().unwrap_or_else(|p| p.into_inner());
        o.finish();
        if let Some(why) = o.failed() {
            bail!("the steps' outputs asked for were not all written: {why}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantiles_are_nearest_rank() {
        let xs = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(quantile(&xs, 0.5), 3.0);
        assert_eq!(quantile(&xs, 0.99), 5.0);
        assert_eq!(quantile(&xs, 0.0), 1.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
