//! The `simpler` command line: thin glue over the runtime, the models and the DFX tools.

mod trace_cmd;

use clap::{Parser, Subcommand};

/// simpler: LLM inference as task graphs.
#[derive(Parser, Debug)]
#[command(name = "simpler", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Read trace files and diagnostics: timing tables, swimlanes, dependency graphs, analyses.
    Trace(trace_cmd::TraceArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Trace(args) => trace_cmd::main(args),
    }
}
