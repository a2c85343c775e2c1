//! The `simpler` command line: thin glue over the runtime, the models and the DFX tools.

mod bench_collectives;
mod bench_membw;
mod bench_prefill;
mod bench_qwen3;
mod bench_qwen3_cuda;
mod bench_runtime;
mod bench_serve;
mod demo;
mod dsv4_cmd;
mod dsv4_ep;
mod dsv4_moe;
mod generate;
mod npy;
mod opts;
mod platform;
mod profile;
mod qwen3_cmd;
mod qwen3_decode;
mod serve_cmd;
mod trace_cmd;

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand};
use std::io::Write;

/// simpler: LLM inference as task graphs.
#[derive(Parser, Debug)]
#[command(name = "simpler", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a workload on the runtime and print its report.
    Run {
        #[command(flatten)]
        platform: platform::PlatformOpt,
        #[command(subcommand)]
        command: RunCommand,
    },
    /// Benchmarks: warm-up, rounds, median and spread, ratios to this machine's limits.
    Bench {
        #[command(flatten)]
        platform: platform::PlatformOpt,
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// Read trace files and diagnostics: timing tables, swimlanes, dependency graphs, analyses.
    Trace(trace_cmd::TraceArgs),
    /// Qwen3 text generation from a prompt, a chat or token ids: chunked prefill, then greedy
    /// or seeded sampled decode, on the runtime; prints the text (the ids, comma-separated,
    /// for --prompt-ids).
    Generate {
        #[command(flatten)]
        platform: platform::PlatformOpt,
        #[command(flatten)]
        args: generate::GenerateArgs,
    },
    /// The OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics) over the
    /// engine: continuous batching, prefix cache, the model's tokenizer.
    Serve(serve_cmd::ServeArgs),
}

#[derive(Subcommand, Debug)]
enum RunCommand {
    /// Tiled matmul -> bias + GELU -> column sums -> reduction, checked against a reference.
    Demo(DemoArgs),
    /// Qwen3 decode on the CPU (default: the 0.6B shape with seeded random weights), checked
    /// against the golden, with a per-token report (TPOT, timing layers, bandwidth, roofline).
    #[command(name = "qwen3-decode")]
    Qwen3Decode(qwen3_decode::DecodeArgs),
    /// One DeepSeek-V4 layer's decode step (batch 4 x 2 tokens) from a seeded fixture:
    /// timing layers, bytes and GB/s per phase, % of membw and of the per-phase bound, and
    /// `--check` against the golden.
    Dsv4(dsv4_cmd::RunDsv4Args),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Empty-task throughput, dependent-chain latency per hop, SPMD block overhead, fan-out to
    /// many readers.
    Runtime(bench_runtime::BenchRuntimeArgs),
    /// This machine's streaming read bandwidth (one and all threads) and FMA peak.
    Membw(bench_membw::MembwArgs),
    /// Qwen3 decode at batch 1, 4 and 16: bytes per step, GB/s and % of membw, % of the
    /// roofline bound, share of the step outside kernels.
    #[command(name = "qwen3-decode")]
    Qwen3Decode(bench_qwen3::DecodeBenchArgs),
    /// Qwen3 prefill at several prompt lengths: tokens/s, achieved GFLOP/s as % of the FMA
    /// peak and of the bf16 GEMM kernel's rate (both measured in the run), share outside kernels.
    #[command(name = "qwen3-prefill")]
    Qwen3Prefill(bench_prefill::PrefillBenchArgs),
    /// Concurrent requests served together by the engine: output tokens/s, TTFT and TPOT
    /// percentiles, batched throughput against N times one stream.
    Serve(bench_serve::BenchServeArgs),
    /// One DeepSeek-V4 layer's decode step, `--rounds` times: effective_us statistics, % of
    /// membw and of the per-phase bound.
    Dsv4(dsv4_cmd::BenchDsv4Args),
    /// All-to-all and all-reduce latency and bandwidth by message size, for 2 and 4 ranks,
    /// over the node's shared memory or over MPI (`mpirun`); effective_us (slowest rank),
    /// fast_effective_us (fastest) and valid_rounds per row.
    Collectives(bench_collectives::BenchCollectivesArgs),
}

/// Arguments of `simpler run demo`.
#[derive(Args, Debug)]
struct DemoArgs {
    /// Rows of A.
    #[arg(long, default_value_t = 512)]
    m: u64,
    /// Columns of A / rows of B.
    #[arg(long, default_value_t = 512)]
    k: u64,
    /// Columns of B.
    #[arg(long, default_value_t = 256)]
    n: u64,
    /// Tile edge (m, k and n must be multiples of it).
    #[arg(long, default_value_t = 64)]
    tile: u64,
    #[command(flatten)]
    run: opts::RunOpts,
}

fn run_demo(args: DemoArgs) -> Result<()> {
    let shape = demo::DemoShape {
        m: args.m,
        k: args.k,
        n: args.n,
        tile: args.tile,
    };
    args.run.refuse_diag_steps("run demo")?;
    let w = args.run.worker()?;
    demo::register(&w, shape)?;
    let cfg = args.run.call_config("demo")?;
    let (run_args, expect) = demo::run_args(&w, shape)?;
    let out = run_args.buffers[4].clone();
    let report = w.run("demo", run_args, &cfg)?;
    opts::emit(&report, &cfg)?;
    print!("{}", opts::format_report(&report));
    let got = out.read::<f32>()?;
    let err = demo::max_rel_error(&got, &expect);
    if err > 1e-4 {
        bail!("demo result differs from the reference: max relative error {err:.2e} > 1e-4");
    }
    println!(
        "check: {} outputs match the plain reference (max relative error {err:.1e})",
        got.len()
    );
    Ok(())
}

/// The expert-parallel command of a `simpler` command line (what a rank of `run dsv4 --ep` or
/// `bench dsv4 --ep` re-reads in its own process).
pub(crate) fn parse_ep_cmd(argv: &[String]) -> Result<dsv4_ep::EpCmd> {
    let cli = Cli::try_parse_from(argv)?;
    let cmd = match cli.command {
        Command::Run {
            command: RunCommand::Dsv4(a),
            ..
        } => dsv4_cmd::ep_cmd_of_run(&a)?,
        Command::Bench {
            command: BenchCommand::Dsv4(a),
            ..
        } => dsv4_cmd::ep_cmd_of_bench(&a)?,
        _ => None,
    };
    cmd.ok_or_else(|| anyhow::anyhow!("not an expert-parallel dsv4 command: {argv:?}"))
}

impl Command {
    /// The Qwen3 model flags of the commands that take them.
    fn model_args(&mut self) -> Option<&mut qwen3_cmd::ModelArgs> {
        match self {
            Command::Run {
                command: RunCommand::Qwen3Decode(a),
                ..
            } => Some(&mut a.model),
            Command::Bench { command, .. } => match command {
                BenchCommand::Qwen3Decode(a) => Some(&mut a.model),
                BenchCommand::Qwen3Prefill(a) => Some(&mut a.model),
                BenchCommand::Serve(a) => Some(&mut a.model),
                _ => None,
            },
            Command::Generate { args, .. } => Some(&mut args.model),
            Command::Serve(a) => Some(&mut a.model),
            _ => None,
        }
    }

    /// The commands that take nothing from `--seed` but a preset's weights.
    fn seeds_weights_only(&self) -> Option<&'static str> {
        match self {
            Command::Generate { .. } => Some("generate"),
            Command::Serve(_) => Some("serve"),
            Command::Bench {
                command: BenchCommand::Serve(_),
                ..
            } => Some("bench serve"),
            _ => None,
        }
    }
}

/// What a panic of `println!`/`eprintln!` on an unwritable stream means for the process
/// (the panic's message in, the exit status and the line to print out): `None` for any other
/// panic.
fn output_failure(message: &str) -> Option<(i32, Option<String>)> {
    let (stream, why) = message
        .strip_prefix("failed printing to stdout: ")
        .map(|w| ("stdout", w))
        .or_else(|| {
            message
                .strip_prefix("failed printing to stderr: ")
                .map(|w| ("stderr", w))
        })?;
    Some(if stream == "stdout" && why.contains("os error 32") {
        // A reader that left (`simpler trace ... | head`): end as the C tools do on SIGPIPE,
        // quietly, with 128 + 13.
        (141, None)
    } else if stream == "stderr" {
        (1, None)
    } else {
        (1, Some(format!("Error: writing the output failed: {why}")))
    })
}

fn main() -> std::process::ExitCode {
    // The commands print with `println!`, which panics when stdout cannot be written (a closed
    // pipe, a full disk): the output is lost either way, so the process ends as a command-line
    // tool does rather than with a panic and a backtrace.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        match output_failure(message) {
            Some((code, line)) => {
                if let Some(line) = line {
                    let _ = writeln!(std::io::stderr(), "{line}");
                }
                std::process::exit(code);
            }
            None => default_hook(info),
        }
    }));
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {}", opts::flags_in(&error_report(&e)));
            std::process::ExitCode::FAILURE
        }
    }
}

/// `e` as `fn main() -> Result` prints it — the message, its causes, a backtrace where one was
/// captured — less each cause whose text the message before it already holds (many errors
/// print their source in their own message, which then came twice).
fn error_report(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if parts.last().is_some_and(|p| p.contains(&text)) {
            continue;
        }
        parts.push(text);
    }
    let mut out = parts.first().cloned().unwrap_or_default();
    // As anyhow lays the causes out: numbered when there are several, a cause's later lines
    // indented under its first.
    let causes = &parts[1.min(parts.len())..];
    if !causes.is_empty() {
        out.push_str("\n\nCaused by:");
        for (i, p) in causes.iter().enumerate() {
            let (head, indent) = if causes.len() > 1 {
                (format!("{i:>5}: "), "       ")
            } else {
                ("    ".to_string(), "    ")
            };
            out.push('\n');
            out.push_str(&head);
            out.push_str(&p.replace('\n', &format!("\n{indent}")));
        }
    }
    let bt = e.backtrace();
    if bt.status() == std::backtrace::BacktraceStatus::Captured {
        out.push_str(&format!("\n\nStack backtrace:\n{bt}"));
    }
    out
}

fn run() -> Result<()> {
    // In a node's child process (a chip of `bench collectives`) this runs the child and exits;
    // it must come before anything starts a thread.
    simpler_node::child_main_if_requested(&dsv4_ep::register(bench_collectives::register(
        simpler_node::ChildFns::new(),
    )));
    let mut cli = Cli::parse();
    let weights_only = cli.command.seeds_weights_only();
    if let Some(model) = cli.command.model_args() {
        model.resolve_preset_name()?;
        if let Some(what) = weights_only {
            model.refuse_seed_with_checkpoint(what)?;
        }
    }
    use platform::PlatformChoice::{Cpu, Cuda};
    match cli.command {
        Command::Run { platform, command } => match (platform.platform, command) {
            (Cpu, RunCommand::Demo(a)) => run_demo(a),
            (Cpu, RunCommand::Qwen3Decode(a)) => qwen3_decode::main(a),
            (Cpu, RunCommand::Dsv4(a)) => dsv4_cmd::run(a),
            (Cuda, RunCommand::Demo(_)) => platform::refuse_cuda("run demo"),
            (Cuda, RunCommand::Qwen3Decode(_)) => platform::refuse_cuda("run qwen3-decode"),
            (Cuda, RunCommand::Dsv4(_)) => platform::refuse_cuda("run dsv4"),
        },
        Command::Bench { platform, command } => match (platform.platform, command) {
            (Cpu, BenchCommand::Runtime(a)) => bench_runtime::main(a),
            (Cpu, BenchCommand::Membw(a)) => bench_membw::membw(a),
            (Cpu, BenchCommand::Qwen3Decode(a)) => bench_qwen3::decode(a),
            (Cuda, BenchCommand::Qwen3Decode(a)) => bench_qwen3::decode_cuda(a),
            (Cpu, BenchCommand::Qwen3Prefill(a)) => bench_prefill::main(a),
            (Cpu, BenchCommand::Serve(a)) => bench_serve::main(a),
            (Cpu, BenchCommand::Dsv4(a)) => dsv4_cmd::bench(a),
            (Cpu, BenchCommand::Collectives(a)) => bench_collectives::main(a),
            (Cuda, BenchCommand::Runtime(_)) => platform::refuse_cuda("bench runtime"),
            (Cuda, BenchCommand::Membw(_)) => platform::refuse_cuda("bench membw"),
            (Cuda, BenchCommand::Qwen3Prefill(_)) => platform::refuse_cuda("bench qwen3-prefill"),
            (Cuda, BenchCommand::Serve(_)) => platform::refuse_cuda("bench serve"),
            (Cuda, BenchCommand::Dsv4(_)) => platform::refuse_cuda("bench dsv4"),
            (Cuda, BenchCommand::Collectives(_)) => platform::refuse_cuda("bench collectives"),
        },
        Command::Generate { platform, args } => match platform.platform {
            Cpu => generate::main(args),
            Cuda => platform::refuse_cuda("generate"),
        },
        Command::Serve(a) => serve_cmd::main(a),
        Command::Trace(args) => trace_cmd::main(args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_of_the_output_ends_the_process_without_a_panic() {
        assert_eq!(
            output_failure("failed printing to stdout: Broken pipe (os error 32)"),
            Some((141, None))
        );
        assert_eq!(
            output_failure("failed printing to stdout: No space left on device (os error 28)"),
            Some((
                1,
                Some(
                    "Error: writing the output failed: No space left on device (os error 28)"
                        .into()
                )
            ))
        );
        assert_eq!(
            output_failure("failed printing to stderr: Broken pipe (os error 32)"),
            Some((1, None))
        );
        assert_eq!(output_failure("index out of bounds"), None);
    }
}
