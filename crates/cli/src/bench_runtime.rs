//! `simpler bench runtime`: the runtime's own costs — empty-task throughput, dependent-chain
//! latency per hop and SPMD block overhead — with warm-up, rounds and interval statistics.
//! Diagnostics asked for are written for the last round of each section, to
//! `OUTPUT_DIR/<section>` (throughput, serial, chain, spmd, fanout); variant B's where its own
//! options say.

use anyhow::{Result, bail};
use clap::Args;
use simpler_core::{
    CallConfig, EngineClass, KernelId, KernelSpec, OrchMode, RingValue, RunReport, RuntimeEnv,
    ScopeKind, Task, TaskId, Worker,
};
use simpler_dfx::bench_stats::{
    Diagnostics, Summary, format_compare, format_diagnostics, format_summary, run_interleaved,
};

use crate::opts::{RunOpts, case_config, flags_in};

const EMPTY: KernelId = KernelId(1);

/// Arguments of `simpler bench runtime`.
#[derive(Args, Debug)]
pub(crate) struct BenchRuntimeArgs {
    /// Tasks per round of the throughput benchmark.
    #[arg(long, default_value_t = 200_000)]
    tasks: u64,
    /// Tasks per scope in the throughput benchmark.
    #[arg(long, default_value_t = 2048)]
    scope: u64,
    /// Hops per round of the dependent-chain benchmark.
    #[arg(long, default_value_t = 50_000)]
    hops: u64,
    /// Blocks of the SPMD task.
    #[arg(long, default_value_t = 50_000)]
    blocks: u32,
    /// Readers of one buffer in the fan-out benchmark.
    #[arg(long, default_value_t = 8192)]
    readers: u64,
    /// Warm-up rounds (discarded).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Measured rounds.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Also run the throughput benchmark with these options as variant B (e.g. "--cores 1" or
    /// "--swimlane 2 --output-dir /tmp/b"), interleaved A B B A ... with A (the options above),
    /// and report the ratio B/A with its interval.
    #[arg(long, value_name = "OPTIONS", allow_hyphen_values = true)]
    compare: Option<String>,
    #[command(flatten)]
    run: RunOpts,
}

fn rounds(args: &BenchRuntimeArgs, mut one: impl FnMut() -> Result<f64>) -> Result<Summary> {
    let mut samples = Vec::new();
    for _ in 0..args.warmup + args.rounds {
        samples.push(one()?);
    }
    Ok(Summary::after_warmup(&samples, args.warmup))
}

/// Like [`rounds`] for a section whose runs return their report with the sample: the last
/// round's spans and diagnostics are written as `cfg` says (each section has its own
/// `OUTPUT_DIR/<section>` from [`case_config`], so no section replaces another's files; an
/// explicit `--trace FILE` is shared, and each section's spans are appended to it).
/// Task slots and dependency entries of each ring in the runs that submit a whole graph before
/// running it (serial mode).
const SERIAL_RING: u64 = 1 << 20;

fn rounds_written(
    args: &BenchRuntimeArgs,
    cfg: &CallConfig,
    mut one: impl FnMut(&CallConfig) -> Result<(f64, RunReport)>,
) -> Result<Summary> {
    let mut last = None;
    let s = rounds(args, || {
        let (v, r) = one(cfg)?;
        last = Some(r);
        Ok(v)
    })?;
    if let Some(r) = &last {
        crate::opts::emit(r, cfg)?;
    }
    Ok(s)
}

pub(crate) fn main(args: BenchRuntimeArgs) -> Result<()> {
    args.run.refuse_diag_steps("bench runtime")?;
    // A zero count would run nothing and print NaN or infinite rates.
    for (flag, value) in [
        ("--tasks", args.tasks),
        ("--scope", args.scope),
        ("--hops", args.hops),
        ("--blocks", u64::from(args.blocks)),
        ("--readers", args.readers),
        ("--rounds", args.rounds as u64),
    ] {
        if value == 0 {
            bail!("{flag} 0: give at least 1");
        }
    }
    crate::opts::check_rounds(args.warmup, args.rounds)?;
    // The fan-out submits its writer and every reader before running (serial mode), into the
    // serial runs' rings of 2^20 task slots and dependency entries: checked before anything
    // runs.
    // (flag, its value, the tasks a serial run of it submits: the fan-out adds its writer)
    for (flag, value, tasks) in [
        ("--tasks", args.tasks, args.tasks),
        ("--hops", args.hops, args.hops),
        ("--readers", args.readers, args.readers.saturating_add(1)),
    ] {
        if tasks >= SERIAL_RING {
            bail!(
                "{flag} {value}: the serial runs submit every task before running, into rings of 2^20 tasks and dependency entries; give fewer"
            );
        }
    }
    // Variant B's options are checked before anything runs.
    let variant_b = match &args.compare {
        Some(b_opts) => {
            #[derive(clap::Parser)]
            struct VariantB {
                #[command(flatten)]
                run: RunOpts,
            }
            let words = std::iter::once("B").chain(b_opts.split_whitespace());
            let b = <VariantB as clap::Parser>::try_parse_from(words)
                .map_err(|e| anyhow::anyhow!("--compare {b_opts:?}: {e}"))?
                .run;
            b.refuse_diag_steps("bench runtime --compare")?;
            let cfg_b = b.call_config("bench-runtime-b")?;
            Some((b_opts.clone(), b, cfg_b))
        }
        None => None,
    };
    let w = args.run.worker()?;
    w.register_kernel(KernelSpec::new(EMPTY, "empty", EngineClass::Vector, |_| {
        Ok(())
    }))?;
    let base = args.run.call_config("bench-runtime")?;
    let cores = w.cores();
    println!(
        "simpler bench runtime: {cores} cores (CPU threads), {} warm-up + {} measured rounds",
        args.warmup, args.rounds
    );
    println!("{}", format_diagnostics(&Diagnostics::of(&base)));

    // 1. Throughput of independent empty tasks, orchestration overlapped with execution.
    let (n, per_scope) = (args.tasks, args.scope);
    let throughput = |w: &Worker, cfg: &CallConfig| -> Result<RunReport> {
        Ok(
            w.run_fn("bench.throughput", Default::default(), cfg, move |o, _| {
                let mut left = n;
                while left > 0 {
                    let k = left.min(per_scope);
                    o.scope(ScopeKind::Auto, |o| {
                        for _ in 0..k {
                            o.submit(Task::new(EMPTY))?;
                        }
                        Ok(())
                    })?;
                    left -= k;
                }
                Ok(())
            })?,
        )
    };
    let s = rounds_written(&args, &case_config(&base, "throughput", true), |cfg| {
        let r = throughput(&w, cfg)?;
        Ok((n as f64 / (r.effective().dur_ns() as f64 / 1e9), r))
    })?;
    // `--serial` makes this section's runs serial too: said, as the rate then measures the
    // submits and the execution one after the other.
    let mode = match base.mode {
        OrchMode::Overlapped => "overlapped",
        OrchMode::Serial => "serial (--serial: every task submitted, then executed)",
    };
    println!("\n[throughput] {n} independent empty tasks in scopes of {per_scope}, {mode}");
    println!("{}", format_summary("tasks_per_s", &s, args.warmup));
    println!(
        "  median {:.2} M tasks/s = {:.0} ns of core time per task ({cores} cores); target >= 1 M/s: {:.0}% of target",
        s.median / 1e6,
        cores as f64 * 1e9 / s.median,
        s.median / 1e6 * 100.0
    );

    // Serial mode splits the same work into submit cost and execution cost. It submits a
    // whole graph before running it, so its rings hold 2^20 tasks and dependency entries
    // whatever `--ring-task-window` / `--ring-dep-pool` say (the report says so).
    let serial = CallConfig {
        mode: OrchMode::Serial,
        runtime_env: RuntimeEnv {
            ring_task_window: RingValue::All(SERIAL_RING),
            ring_dep_pool: RingValue::All(SERIAL_RING),
            ..base.runtime_env
        },
        ..base.clone()
    };
    let mut orch_rate = Vec::new();
    let exec = rounds_written(&args, &case_config(&serial, "serial", true), |cfg| {
        let r = throughput(&w, cfg)?;
        orch_rate.push(n as f64 / (r.orch.dur_ns() as f64 / 1e9));
        Ok((n as f64 / (r.post_orch.dur_ns() as f64 / 1e9), r))
    })?;
    let orch = Summary::after_warmup(&orch_rate, args.warmup);
    println!(
        "  serial split: submit {:.2} M tasks/s (orchestrator alone), execute {:.2} M tasks/s (cores alone)",
        orch.median / 1e6,
        exec.median / 1e6
    );
    println!(
        "  (the serial split, the chain, SPMD and fan-out runs submit whole graphs first: their rings hold 2^20 tasks and dependency entries{})",
        if args.run.ring_task_window.is_some() || args.run.ring_dep_pool.is_some() {
            ", not the --ring-task-window / --ring-dep-pool given, which apply to the throughput runs"
        } else {
            ""
        }
    );

    if let Some((b_opts, b, cfg_b)) = &variant_b {
        let wb = b.worker()?;
        wb.register_kernel(KernelSpec::new(EMPTY, "empty", EngineClass::Vector, |_| {
            Ok(())
        }))?;
        let failure = std::cell::RefCell::new(None);
        // B's last run, whose spans and diagnostics are written where B's options say.
        let last_b = std::cell::RefCell::new(None);
        let measure = |w: &Worker, cfg: &CallConfig, is_b: bool| match throughput(w, cfg) {
            Ok(r) => {
                let rate = n as f64 / (r.effective().dur_ns() as f64 / 1e9);
                if is_b {
                    *last_b.borrow_mut() = Some(r);
                }
                rate
            }
            Err(e) => {
                failure.borrow_mut().get_or_insert(e);
                f64::NAN
            }
        };
        let pairs = run_interleaved(
            args.rounds,
            args.warmup,
            || measure(&w, &base, false),
            || measure(&wb, cfg_b, true),
        );
        if let Some(e) = failure.into_inner() {
            return Err(e);
        }
        if let Some(r) = last_b.into_inner() {
            crate::opts::emit(&r, cfg_b)?;
        }
        println!(
            "\n[compare] throughput, A = the options above, B = {b_opts:?}, interleaved A B B A ..."
        );
        println!("{}", format_diagnostics(&Diagnostics::of(cfg_b)));
        println!(
            "{}",
            format_compare("tasks_per_s", "A", "B", &pairs.compare())
        );
    }

    // 2. Dependent chain: each task waits for the previous one; serial mode so that only the
    //    hand-off from completion to the next start is timed.
    let hops = args.hops;
    let chain = rounds_written(&args, &case_config(&serial, "chain", true), |cfg| {
        let r = w.run_fn("bench.chain", Default::default(), cfg, move |o, _| {
            let mut prev: Option<TaskId> = None;
            // SAFETY: the tasks have no tensor arguments, so there is no memory to order;
            // the explicit dependencies make the chain.
            unsafe {
                o.manual_scope(|o| {
                    for _ in 0..hops {
                        let t = Task::new(EMPTY);
                        let t = match prev {
                            Some(p) => t.after(p),
                            None => t,
                        };
                        prev = Some(o.submit(t)?.id);
                    }
                    Ok(())
                })
            }
        })?;
        Ok((r.post_orch.dur_ns() as f64 / 1e3 / hops as f64, r))
    })?;
    println!("\n[chain] {hops} dependent empty tasks (explicit dependencies), execution only");
    println!("{}", format_summary("us_per_hop", &chain, args.warmup));
    println!(
        "  median {:.3} us per hop; target <= 5 us: {:.1}% of the budget",
        chain.median,
        chain.median / 5.0 * 100.0
    );

    // 3. SPMD: one task of many blocks.
    let blocks = args.blocks;
    let spmd = rounds_written(&args, &case_config(&serial, "spmd", true), |cfg| {
        let r = w.run_fn("bench.spmd", Default::default(), cfg, move |o, _| {
            o.submit(Task::new(EMPTY).blocks(blocks))?;
            Ok(())
        })?;
        Ok((r.post_orch.dur_ns() as f64 / blocks as f64, r))
    })?;
    println!("\n[spmd] one empty task of {blocks} blocks, execution only");
    println!("{}", format_summary("ns_per_block", &spmd, args.warmup));
    println!(
        "  median {:.0} ns per block = {:.0} ns of core time per block ({cores} cores); vs a separate task: {:.2}x",
        spmd.median,
        spmd.median * cores as f64,
        spmd.median / (1e9 / exec.median)
    );

    // 4. Fan-out: one writer, then many readers of the same buffer. Readers register in the
    //    dependency map (later writers wait for them), so each reader's lookup must not walk
    //    the readers before it: orchestration time per reader stays flat as their number grows.
    //    The whole graph is submitted first, so the dependency map is sized for its
    //    readers + 1 entries (a map size given on the command line is taken as given); the
    //    serial rings hold them (checked at the start).
    let readers = args.readers;
    let buf = w.alloc(4096)?;
    let whole = (readers + 1)
        .saturating_mul(2)
        .checked_next_power_of_two()
        .unwrap_or(u64::MAX);
    let fan_cfg = CallConfig {
        tensormap_capacity: args
            .run
            .tensormap_capacity
            .unwrap_or(whole.max(base.tensormap_capacity)),
        ..serial.clone()
    };
    fan_cfg
        .check()
        .map_err(|e| anyhow::anyhow!("{} = {}: {}", flags_in(&e.field), e.value, e.reason))?;
    let fan = rounds_written(&args, &case_config(&fan_cfg, "fanout", true), |cfg| {
        let a = simpler_core::RunArgs {
            buffers: vec![buf.clone()],
            scalars: vec![],
        };
        let r = w.run_fn("bench.fanout", a, cfg, move |o, a| {
            let t = o.bind(&a.buffers[0], simpler_core::DType::F32, &[1024])?;
            o.scope(ScopeKind::Auto, |o| {
                o.submit(Task::new(EMPTY).output_existing(&t))?;
                for _ in 0..readers {
                    o.submit(Task::new(EMPTY).input(&t))?;
                }
                Ok(())
            })
        })?;
        Ok((r.orch.dur_ns() as f64 / readers.max(1) as f64, r))
    })?;
    println!("\n[fanout] one writer then {readers} readers of one buffer, orchestration only");
    println!("{}", format_summary("ns_per_reader", &fan, args.warmup));
    Ok(())
}
