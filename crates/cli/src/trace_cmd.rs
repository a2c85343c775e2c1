//! `simpler trace ...`: reads trace files and diagnostics written by runs.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use simpler_dfx::diag::{self, load_joined};
use simpler_dfx::{
    critical_path, deps, html, idle, overhead, perfetto, reader, rings, swimlane, timing,
};

/// Arguments of `simpler trace`.
#[derive(Args, Debug)]
pub(crate) struct TraceArgs {
    #[command(subcommand)]
    cmd: TraceCmd,
}

#[derive(Subcommand, Debug)]
enum TraceCmd {
    /// Span statistics per callable (busiest first), per-invocation rounds, median span tree,
    /// Perfetto export. Accepts several files (one per process) and merges them.
    Timing {
        /// Trace files (JSON Lines).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// One row per invocation: Round, Host, Device, Effective, Orch, Sched (µs), then a
        /// summary; for files of several ranks, also effective_us / fast_effective_us /
        /// valid_rounds with rounds joined by invocation number.
        #[arg(long)]
        rounds: bool,
        /// Rounds excluded from the `--rounds` summary (per callable and process, earliest
        /// first), beyond those the trace marks warm-up (`warmup: true` on a `run`, which
        /// every table leaves out).
        #[arg(long, default_value_t = 0)]
        warmup: usize,
        /// The median span tree per callable (orch ∥ sched shown as overlapping).
        #[arg(long)]
        tree: bool,
        /// Write Chrome/Perfetto JSON here (one track per process thread, invocations as nested
        /// slices, host and device aligned).
        #[arg(long, value_name = "OUT.json")]
        perfetto: Option<PathBuf>,
    },
    /// Per-task timeline to Perfetto JSON and the per-kernel table. Several paths (one per
    /// rank) make one Perfetto view with a process per rank and its core lanes, on one clock.
    Swimlane {
        /// A run's output directory or its swimlane.json; one per rank for a merged view.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// The captured dependency graph (default: deps.json beside the swimlane, if present).
        #[arg(long)]
        deps: Option<PathBuf>,
        /// Write Chrome/Perfetto JSON here.
        #[arg(long, value_name = "OUT.json")]
        perfetto: Option<PathBuf>,
    },
    /// Summary of a captured dependency graph; DOT and self-contained HTML views. Several
    /// graphs (ranks, steps, cases) are summarised one after the other.
    Deps {
        /// deps.json (or a run's output directory); several for their summaries.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Write Graphviz DOT here (one graph).
        #[arg(long, value_name = "OUT.dot")]
        dot: Option<PathBuf>,
        /// Write a self-contained HTML page here (pan, zoom, click a task for its edges; one
        /// graph).
        #[arg(long, value_name = "OUT.html")]
        html: Option<PathBuf>,
        /// Draw only the transitive reduction (edges implied by longer paths removed).
        #[arg(long)]
        reduce: bool,
    },
    /// Scheduler-bound share of the execution span per engine class, head/tail overheads, scheduler
    /// loop phase totals.
    Overhead {
        /// A run's output directory or its swimlane.json; several (ranks, steps, cases) are
        /// reported one after the other.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// The captured dependency graph (default: deps.json beside the swimlane, if present).
        #[arg(long)]
        deps: Option<PathBuf>,
    },
    /// Where the cores wait between kernels: each idle gap on a core is charged to the kernel
    /// before and the kernel after it (phase barriers, serial steps, SPMD block claims).
    Idle {
        /// A run's output directory or its swimlane.json; several (ranks, steps, cases) are
        /// reported one after the other.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// The captured dependency graph, only for kernel names missing from the swimlane
        /// (default: deps.json beside the swimlane, if present).
        #[arg(long)]
        deps: Option<PathBuf>,
        /// Pairs to list, largest total first (0: all).
        #[arg(long, default_value_t = 15)]
        top: usize,
    },
    /// Static and observed critical path; compute and stalls add up to the execution span.
    CriticalPath {
        /// A run's output directory or its swimlane.json; several (ranks, steps, cases) are
        /// reported one after the other.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// The captured dependency graph (default: deps.json beside the swimlane).
        #[arg(long)]
        deps: Option<PathBuf>,
    },
    /// Ring high-water marks against capacity.
    Rings {
        /// ring_stats.json (or a run's output directory); several are reported one after the
        /// other.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

pub(crate) fn main(args: TraceArgs) -> anyhow::Result<()> {
    match args.cmd {
        TraceCmd::Timing {
            files,
            rounds,
            warmup,
            tree,
            perfetto,
        } => {
            if warmup > 0 && !rounds {
                anyhow::bail!(
                    "--warmup: it excludes rounds from the --rounds summary; add --rounds"
                );
            }
            if let Some(out) = &perfetto {
                let inputs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
                refuse_overwrite("--perfetto", out, &inputs)?;
            }
            let trace = reader::read_spans(&files)?;
            print!("{}", trace.clock_summary());
            if rounds {
                print!("{}", timing::rounds_table(&trace, warmup));
            }
            if tree {
                print!("{}", timing::tree(&trace));
            }
            if !rounds && !tree {
                print!("{}", timing::timing_table(&trace));
            }
            if let Some(out) = perfetto {
                perfetto::timing_to_perfetto(&trace).write(&out)?;
                println!(
                    "wrote {} ({} spans, {} processes)",
                    out.display(),
                    trace.spans.len(),
                    trace.processes.len()
                );
            }
        }
        TraceCmd::Swimlane {
            paths,
            deps,
            perfetto,
        } => {
            if let [path] = &paths[..] {
                let j = load_joined(path, deps.as_deref())?;
                if let Some(out) = &perfetto {
                    refuse_overwrite("--perfetto", out, &inputs_of(std::slice::from_ref(&j)))?;
                }
                print_sources(&j);
                print!("{}", swimlane::report(&j.swimlane, j.deps.as_ref()));
                if let Some(out) = perfetto {
                    swimlane::to_perfetto(&j.swimlane, j.deps.as_ref()).write(&out)?;
                    println!("wrote {}", out.display());
                }
                return Ok(());
            }
            let joined = load_runs(&paths, deps.as_deref())?;
            if let Some(out) = &perfetto {
                refuse_overwrite("--perfetto", out, &inputs_of(&joined))?;
            }
            for j in &joined {
                print_sources(j);
                print!("{}", swimlane::report(&j.swimlane, j.deps.as_ref()));
                println!();
            }
            if let Some(out) = perfetto {
                let ranks = joined
                    .iter()
                    .map(|j| {
                        Ok(swimlane::RankSwimlane {
                            path: &j.swimlane_path,
                            records: &j.swimlane,
                            deps: j.deps.as_ref(),
                            clock: diag::read_swimlane_clock(&j.swimlane_path)?,
                        })
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let (doc, clocks) = swimlane::ranks_to_perfetto(&ranks)?;
                doc.write(&out)?;
                print!("{clocks}");
                println!("wrote {} ({} ranks)", out.display(), ranks.len());
            }
        }
        TraceCmd::Deps {
            files,
            dot,
            html: html_out,
            reduce,
        } => {
            if reduce && dot.is_none() && html_out.is_none() {
                anyhow::bail!(
                    "--reduce: it draws the transitive reduction; add --dot FILE or --html FILE (the summary counts every edge)"
                );
            }
            if files.len() > 1 {
                if let Some(flag) = [("--dot", dot.is_some()), ("--html", html_out.is_some())]
                    .into_iter()
                    .find_map(|(f, set)| set.then_some(f))
                {
                    anyhow::bail!(
                        "{flag} draws one graph; with {} graphs give one file (the summaries take several)",
                        files.len()
                    );
                }
                // Every file is read before any summary: a wrong path fails first.
                let mut graphs = Vec::with_capacity(files.len());
                for f in &files {
                    let path = diag::locate(f, diag::DEPS_FILE)?;
                    let g = diag::read_deps(&path)?;
                    graphs.push((path, g));
                }
                for (i, (path, g)) in graphs.iter().enumerate() {
                    if i > 0 {
                        println!();
                    }
                    println!("deps {}", path.display());
                    print!("{}", deps::summary(g)?);
                }
                return Ok(());
            }
            let path = diag::locate(&files[0], diag::DEPS_FILE)?;
            for (flag, out) in [("--dot", &dot), ("--html", &html_out)] {
                if let Some(out) = out {
                    refuse_overwrite(flag, out, &[&path])?;
                }
            }
            let g = diag::read_deps(&path)?;
            print!("{}", deps::summary(&g)?);
            let view = if reduce { deps::reduce(&g)? } else { g };
            if let Some(out) = dot {
                write_text(&out, &deps::to_dot(&view))?;
                println!(
                    "wrote {}{}",
                    out.display(),
                    if reduce {
                        " (transitive reduction)"
                    } else {
                        ""
                    }
                );
            }
            if let Some(out) = html_out {
                let title = format!(
                    "{}{}",
                    path.display(),
                    if reduce {
                        " (transitive reduction)"
                    } else {
                        ""
                    }
                );
                write_text(&out, &html::to_html(&view, &title)?)?;
                println!("wrote {}", out.display());
            }
        }
        TraceCmd::Overhead { paths, deps } => each_run(&paths, deps.as_deref(), |j| {
            Ok(overhead::report(&overhead::analyze(
                &j.swimlane,
                j.deps.as_ref(),
            )?))
        })?,
        TraceCmd::Idle { paths, deps, top } => each_run(&paths, deps.as_deref(), |j| {
            Ok(idle::report(
                &idle::analyze(&j.swimlane, j.deps.as_ref())?,
                top,
            ))
        })?,
        TraceCmd::CriticalPath { paths, deps } => each_run(&paths, deps.as_deref(), |j| {
            let g = j.deps.as_ref().with_context(|| {
                format!(
                    "critical-path needs the dependency graph: no deps.json beside {} (capture it with --dep-gen, or pass --deps FILE)",
                    j.swimlane_path.display()
                )
            })?;
            Ok(critical_path::report(
                &critical_path::analyze(&j.swimlane, g)?,
                j.swimlane.dropped,
            ))
        })?,
        TraceCmd::Rings { files } => {
            // Every path is located first, so a wrong one fails before any report.
            let found = files
                .iter()
                .map(|f| diag::locate(f, diag::RING_STATS_FILE))
                .collect::<Result<Vec<_>, _>>()?;
            for (k, path) in found.iter().enumerate() {
                if found.len() > 1 {
                    if k > 0 {
                        println!();
                    }
                    println!("ring stats {}", path.display());
                }
                print!("{}", rings::report(&diag::read_ring_stats(path)?));
            }
        }
    }
    Ok(())
}

/// Every run of `paths`, all loaded before any report (a wrong path fails first). `--deps`
/// names one graph, so it is refused with several paths (each takes the deps.json beside it).
fn load_runs(paths: &[PathBuf], deps: Option<&Path>) -> anyhow::Result<Vec<diag::Joined>> {
    if deps.is_some() && paths.len() > 1 {
        anyhow::bail!(
            "--deps names one graph; with {} runs each takes the deps.json beside it",
            paths.len()
        );
    }
    Ok(paths
        .iter()
        .map(|p| load_joined(p, deps))
        .collect::<Result<Vec<_>, _>>()?)
}

/// Prints each run of `paths` ([`load_runs`]): its sources and `report`, one after the other.
fn each_run(
    paths: &[PathBuf],
    deps: Option<&Path>,
    report: impl Fn(&diag::Joined) -> anyhow::Result<String>,
) -> anyhow::Result<()> {
    let runs = load_runs(paths, deps)?;
    for (k, j) in runs.iter().enumerate() {
        if k > 0 {
            println!();
        }
        print_sources(j);
        print!("{}", report(j)?);
    }
    Ok(())
}

fn print_sources(j: &diag::Joined) {
    match &j.deps_path {
        Some(d) => println!(
            "swimlane {}  deps {}",
            j.swimlane_path.display(),
            d.display()
        ),
        None => println!("swimlane {}  (no deps.json)", j.swimlane_path.display()),
    }
}

/// The files a joined run was read from: its swimlane and its deps file.
fn inputs_of(runs: &[diag::Joined]) -> Vec<&Path> {
    runs.iter()
        .flat_map(|j| std::iter::once(j.swimlane_path.as_path()).chain(j.deps_path.as_deref()))
        .collect()
}

/// Refuses an output file that is one of the input files (it would be overwritten with the
/// report on itself). Compared as canonical paths, so `./a/../trace.jsonl` and a symbolic link
/// count; an output that does not exist yet is no input.
fn refuse_overwrite(flag: &str, out: &Path, inputs: &[&Path]) -> anyhow::Result<()> {
    let Ok(out_canonical) = std::fs::canonicalize(out) else {
        return Ok(());
    };
    if let Some(input) = inputs
        .iter()
        .find(|i| std::fs::canonicalize(i).is_ok_and(|c| c == out_canonical))
    {
        anyhow::bail!(
            "{flag} {}: it is the input file {}; refusing to overwrite it (write the output to another file)",
            out.display(),
            input.display()
        );
    }
    Ok(())
}

fn write_text(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
