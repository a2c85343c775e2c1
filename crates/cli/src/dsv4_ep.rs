//! `simpler run dsv4 --layer moe --ep N` and `simpler bench dsv4 --kernel moe --ep N`: the
//! expert-parallel MoE step over the node's collectives (`docs/dsv4.md`, "Expert
//! parallelism"), with the ranks as a node's chip processes on this host (`--collectives shm`)
//! or as the ranks of `mpirun -np N` (`--collectives mpi`).
//!
//! Every rank re-reads the command line (a chip gets the parent's arguments; an MPI rank has
//! its own), builds its own worker and its own experts, and runs the step's pieces from
//! `simpler_models::dsv4::moe_ep` around the two all-to-alls:
//!
//! ```text
//! route     front_step (hc_pre, route) on the rank's tokens
//! dispatch  pack, exchange counts, all-to-all, unpack
//! compute   expert_step (shared experts on the own tokens, local experts on the rows)
//! combine   pack, all-to-all back, scatter to route order
//! reduce    back_step (reduce in the single-rank order, hc_post)
//! ```
//!
//! Each rank times the phases of every step; rank 0 gathers every rank's times and (with
//! `--check`) outputs through the collectives, prints the per-rank lines and the multi-rank
//! statistics, and compares the outputs with the single-rank step of the same fixture, bit for
//! bit, and with the golden. `--trace FILE` and `--output-dir DIR` become one file or
//! directory per rank (`FILE.rank<r>`, `DIR/rank<r>`), which the `trace` tools merge.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use simpler_core::trace::{Clock, SpanRecord, TRACE_FORMAT_VERSION};
use simpler_core::{CallConfig, RunReport};
use simpler_dfx::TraceWriter;
use simpler_dfx::bench_stats::{Summary, combine_ranks, format_summary};
use simpler_dfx::writer::{ProcessRole, set_process_role};
use simpler_models::dsv4::fixture::{
    generate_inputs, generate_moe_weights, generate_moe_weights_local,
};
use simpler_models::dsv4::moe_ep::{
    combine_bytes_max, combine_recv_counts, dispatch_bytes_max, pack_combine, pack_dispatch,
    rank_tokens, unpack_combine, unpack_dispatch,
};
use simpler_models::dsv4::moe_graph::{ExpertPlacement, MoeLayer, MoeOutput};
use simpler_models::dsv4::{Dsv4Config, TOKENS_PER_SEQ, moe_ops, ops};
use simpler_node::{ChildCtx, ChildFns, ChildId, Collectives, Node, NodeConfig, exchange_counts};

use crate::bench_collectives::Backend;
use crate::opts::RunOpts;

/// The chip function's name in the node's function table.
const CHIP_FN: &str = "dsv4_moe_ep";

/// Registers this command's chip function.
pub(crate) fn register(fns: ChildFns) -> ChildFns {
    fns.register(CHIP_FN, chip_fn)
}

/// Experts per rank at FLASH width unless `--experts-per-rank` says otherwise.
const FLASH_PER_RANK: usize = crate::dsv4_moe::FLASH_EXPERTS_PER_RANK;

/// The phases of a step, in order.
const PHASES: [&str; 5] = ["route", "dispatch", "compute", "combine", "reduce"];

/// An expert-parallel command, as every rank reads it from the command line.
#[derive(Debug, Clone)]
pub(crate) struct EpCmd {
    pub(crate) preset: String,
    pub(crate) start_pos: Option<usize>,
    pub(crate) seed: u64,
    pub(crate) ep: usize,
    pub(crate) collectives: Backend,
    pub(crate) per_rank: Option<usize>,
    /// `--rank-timeout-secs`: the node's limit on the ranks' whole run (shm collectives).
    pub(crate) rank_timeout: Option<f64>,
    /// `--routing hash`: the first (hash-routed) layer instead of the first top-k one.
    pub(crate) hash_routing: bool,
    pub(crate) check: bool,
    pub(crate) rounds: usize,
    pub(crate) warmup: usize,
    /// Seconds rank 0 measures the host's bandwidth for, after the steps.
    pub(crate) membw_seconds: f64,
    pub(crate) run: RunOpts,
}

/// The shapes and placement of `cmd`: FLASH gets `ep × per_rank` routed experts
/// (`Dsv4Config::flash_ep`; EP 1 keeps one rank's `per_rank`), the small presets keep theirs
/// and split them evenly.
pub(crate) fn ep_config(cmd: &EpCmd) -> Result<(Dsv4Config, ExpertPlacement)> {
    let base = Dsv4Config::preset(&cmd.preset)?;
    let cfg = if base == Dsv4Config::flash() {
        let per_rank = cmd.per_rank.unwrap_or(FLASH_PER_RANK);
        // Checked here so the error names the flag that set it, whatever `--ep` is.
        if ![16, 32].contains(&per_rank) {
            bail!("--experts-per-rank {per_rank}: must be 16 or 32");
        }
        if cmd.ep == 1 {
            Dsv4Config {
                n_routed_experts: per_rank,
                ..base
            }
        } else {
            Dsv4Config::flash_ep(cmd.ep, per_rank).map_err(|e| anyhow!("--ep {}: {e}", cmd.ep))?
        }
    } else {
        if let Some(n) = cmd.per_rank {
            bail!(
                "--experts-per-rank {n}: only the flash preset sizes its experts by rank; --preset {} has {} routed experts",
                cmd.preset,
                base.n_routed_experts
            );
        }
        base
    };
    let e = cfg.n_routed_experts;
    if cmd.ep == 0 || !e.is_multiple_of(cmd.ep) {
        bail!(
            "--ep {}: must divide the {e} routed experts of --preset {}",
            cmd.ep,
            cmd.preset
        );
    }
    let starts = starts_of(cmd, &cfg)?;
    let tokens = starts.len() * TOKENS_PER_SEQ;
    if cmd.ep > tokens {
        bail!(
            "--ep {}: more ranks than the step's {tokens} tokens (every rank routes its own)",
            cmd.ep
        );
    }
    Ok((
        cfg,
        ExpertPlacement {
            n_experts: e,
            per_rank: e / cmd.ep,
        },
    ))
}

fn starts_of(cmd: &EpCmd, cfg: &Dsv4Config) -> Result<Vec<usize>> {
    crate::dsv4_cmd::starts_at(cmd.start_pos, &cmd.preset, cfg)
}

/// Refuses what an expert-parallel command cannot do, by flag, before anything starts.
pub(crate) fn check_cmd(cmd: &EpCmd) -> Result<()> {
    if cmd.ep == 0 {
        bail!("--ep 0: give at least 1 rank");
    }
    if cmd.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if cmd
        .rounds
        .checked_add(cmd.warmup)
        .is_none_or(|n| n > MAX_ROUNDS)
    {
        bail!(
            "--rounds {} --warmup {}: at most {MAX_ROUNDS} steps with --ep",
            cmd.rounds,
            cmd.warmup
        );
    }
    if cmd.ep > 8 {
        bail!("--ep {}: at most 8 ranks", cmd.ep);
    }
    if cmd.ep == 1 && cmd.collectives == Backend::Mpi {
        bail!("--ep 1 --collectives mpi: one rank exchanges nothing; use --ep 2 or more");
    }
    if cmd.rank_timeout.is_some() && cmd.ep == 1 {
        bail!(
            "--rank-timeout-secs: --ep 1 runs its one rank in this process, with no rank to time out; use --ep 2 or more"
        );
    }
    if cmd.rank_timeout.is_some() && cmd.collectives == Backend::Mpi {
        bail!(
            "--rank-timeout-secs: bounds the ranks of a node (shm collectives); under mpirun its own options bound the job"
        );
    }
    ep_config(cmd).map(|_| ())
}

/// Most steps per command: every rank's times travel to rank 0 in one message.
const MAX_ROUNDS: usize = 10_000;

/// `FILE` -> `FILE.rank<r>` (before the extension), `DIR` -> `DIR/rank<r>`.
fn per_rank_file(path: &Path, rank: usize) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// This rank's call configuration: the command's, with its trace and diagnostics per rank.
fn rank_call_config(cmd: &EpCmd, rank: usize) -> Result<CallConfig> {
    let mut cfg = cmd.run.call_config("dsv4.moe.ep")?;
    cfg.trace = cfg.trace.as_deref().map(|p| per_rank_file(p, rank));
    cfg.output_dir = cfg.output_dir.map(|d| d.join(format!("rank{rank}")));
    Ok(cfg)
}

/// One step's phase times (ns) and the reports of its three graphs.
struct StepTimes {
    start_ns: u64,
    phases: [u64; 5],
    reports: [RunReport; 3],
}

impl StepTimes {
    fn total(&self) -> u64 {
        self.phases.iter().sum()
    }
}

/// What a rank keeps of its steps.
struct RankRun {
    steps: Vec<StepTimes>,
    /// Whether each step reproduced the first step's output bit for bit.
    valid: Vec<bool>,
    /// The last step's output on this rank's tokens.
    out: MoeOutput,
    /// Bytes one step of this rank moves (`moe_step_cost` of its tokens and its experts'
    /// rows: the gate, the shared expert, the local experts that got rows, the activations).
    bytes: f64,
}

/// The rank's part of one command: its worker, experts and steps.
fn rank_steps<C: Collectives<Buf = [u8]> + ?Sized>(
    comm: &mut C,
    cmd: &EpCmd,
    call: &CallConfig,
) -> Result<RankRun> {
    let (me, n) = (comm.rank(), comm.ranks());
    let (cfg, placement) = ep_config(cmd)?;
    if placement.ranks() != n {
        bail!("--ep {}: this job has {n} ranks", cmd.ep);
    }
    let worker = cmd.run.worker()?;
    ops::register(&worker)?;
    moe_ops::register(&worker)?;
    let starts = starts_of(cmd, &cfg)?;
    let inputs = generate_inputs(&cfg, &starts, cmd.seed);
    let weights = generate_moe_weights_local(&cfg, cmd.seed, placement.local(me));
    let layer = MoeLayer::new(
        &worker,
        &cfg,
        &weights,
        crate::dsv4_moe::routed_layer(&cfg, cmd.hash_routing)?,
        placement,
        me,
    )?;
    drop(weights);
    let (d, k, hc) = (cfg.hidden, cfg.n_activated_experts, cfg.hc_mult);
    let mine = rank_tokens(inputs.n_tokens(), n, me);
    let x_hc = &inputs.x_hc[mine.start * hc * d..mine.end * hc * d];
    let ids = &inputs.token_ids[mine.clone()];
    let mut steps = Vec::new();
    let mut valid = Vec::new();
    let mut first: Option<MoeOutput> = None;
    let mut last = None;
    // Rows each of the `n_routed_experts` got on this rank (the step is deterministic: the
    // last step's).
    let mut rows_per_expert = vec![0usize; cfg.n_routed_experts];
    for _ in 0..cmd.warmup + cmd.rounds {
        let start_ns = simpler_core::clock::now_ns();
        let mut phases = [0u64; 5];
        let mut lap = Instant::now();
        let mut tick = |i: usize| {
            phases[i] = lap.elapsed().as_nanos() as u64;
            lap = Instant::now();
        };
        let front = layer.front_step(&worker, x_hc, ids, call)?;
        tick(0);
        let sent = pack_dispatch(&placement, &front, d)?;
        let recv_counts = exchange_counts(comm, &sent.counts)?;
        let mut recv = vec![0u8; recv_counts.iter().sum()];
        comm.all_to_all_v(&sent.bytes, &sent.counts, &mut recv, &recv_counts)?;
        let rx = unpack_dispatch(&placement, me, d, &recv, &recv_counts)?;
        rows_per_expert.fill(0);
        for (g, e) in placement.local(me).enumerate() {
            let (a, b) = (rx.rows.offsets[g], rx.rows.offsets[g + 1]);
            rows_per_expert[e] = (b - a) as usize;
        }
        tick(1);
        let experts = layer.expert_step(&worker, &front, &rx.rows, call)?;
        tick(2);
        let (back, back_counts) = pack_combine(&rx, &experts.y_rows, d)?;
        let counts = combine_recv_counts(&sent, d);
        let mut combined = vec![0u8; counts.iter().sum()];
        comm.all_to_all_v(&back, &back_counts, &mut combined, &counts)?;
        let routed = unpack_combine(&sent, &combined, mine.len() * k, d)?;
        tick(3);
        let out = layer.back_step(&worker, &front, &experts, &routed, call)?;
        tick(4);
        let f = first.get_or_insert_with(|| out.clone());
        valid.push(
            f.experts == out.experts
                && bits(&f.x_out) == bits(&out.x_out)
                && out.x_out.iter().all(|v| v.is_finite()),
        );
        steps.push(StepTimes {
            start_ns,
            phases,
            reports: [front.report, experts.report, out.report.clone()],
        });
        last = Some(out);
    }
    let out = last.ok_or_else(|| anyhow!("--rounds must be at least 1"))?;
    let bytes =
        simpler_models::dsv4::moe_cost::moe_step_cost(&cfg, mine.len(), &rows_per_expert).bytes();
    Ok(RankRun {
        steps,
        valid,
        out,
        bytes,
    })
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Writes this rank's trace: each graph run's spans, and per step one `run` span of the
/// expert-parallel step (the round as its invocation) with its five phases under it.
fn write_trace(path: &Path, cmd: &EpCmd, n: usize, steps: &[StepTimes]) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let mut w = TraceWriter::append(path)?;
    let pid = w.anchor().pid;
    let callable = format!("dsv4.moe.ep/{}/{n}", cmd.preset);
    for (round, s) in steps.iter().enumerate() {
        for r in &s.reports {
            w.report(r, 0)?;
        }
        let span = |name: &str, depth: u8, ts_ns: u64, dur_ns: u64| SpanRecord {
            v: TRACE_FORMAT_VERSION,
            pid,
            tid: 0,
            inv: round as u64,
            callable: callable.clone(),
            depth,
            name: name.into(),
            ts_ns,
            dur_ns,
            clock: Clock::Host,
            attrs: Default::default(),
        };
        w.span(&span("run", 0, s.start_ns, s.total()))?;
        let mut at = s.start_ns;
        for (name, &dur) in PHASES.iter().zip(&s.phases) {
            w.span(&span(name, 1, at, dur))?;
            at += dur;
        }
    }
    w.finish()?;
    Ok(())
}

/// A rank's message to rank 0: per step the five phase times and validity, the bytes a step
/// of the rank moves, then (with `--check`) its outputs.
fn encode_rank(run: &RankRun, check: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let word = |out: &mut Vec<u8>, v: u64| out.extend_from_slice(&v.to_le_bytes());
    word(&mut out, run.steps.len() as u64);
    for (s, &ok) in run.steps.iter().zip(&run.valid) {
        for &p in &s.phases {
            word(&mut out, p);
        }
        word(&mut out, u64::from(ok));
    }
    word(&mut out, run.bytes.to_bits());
    if check {
        let o = &run.out;
        for v in [
            &o.x_out, &o.x_mixed, &o.post, &o.comb, &o.y, &o.shared, &o.routed, &o.weights,
        ] {
            word(&mut out, v.len() as u64);
            out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        }
        word(&mut out, o.experts.len() as u64);
        out.extend(o.experts.iter().flat_map(|x| x.to_le_bytes()));
    }
    out
}

/// One step of one rank: its phase times (ns) and whether its output was valid.
type StepRecord = ([u64; 5], bool);

/// What rank 0 reads of one rank's message.
struct RankResult {
    /// Per step: phase times and validity.
    steps: Vec<StepRecord>,
    /// Bytes one step of the rank moves.
    bytes: f64,
    /// `[x_out, x_mixed, post, comb, y, shared, routed, weights]` and the experts.
    outputs: Option<(Vec<Vec<f32>>, Vec<u32>)>,
}

fn decode_rank(b: &[u8], check: bool) -> Result<RankResult> {
    let mut at = 0usize;
    let mut word = || -> Result<u64> {
        let w = b
            .get(at..at + 8)
            .ok_or_else(|| anyhow!("a rank's results end early, at byte {at}"))?;
        at += 8;
        Ok(u64::from_le_bytes(w.try_into().expect("8 bytes")))
    };
    let n = word()? as usize;
    if n > MAX_ROUNDS {
        bail!("a rank reports {n} steps");
    }
    let mut steps = Vec::with_capacity(n);
    for _ in 0..n {
        let mut p = [0u64; 5];
        for v in &mut p {
            *v = word()?;
        }
        steps.push((p, word()? == 1));
    }
    let bytes = f64::from_bits(word()?);
    if !check {
        return Ok(RankResult {
            steps,
            bytes,
            outputs: None,
        });
    }
    let mut vecs = Vec::new();
    let read4 = |at: &mut usize| -> Result<Vec<[u8; 4]>> {
        let len = b
            .get(*at..*at + 8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| anyhow!("a rank's outputs end early"))?;
        *at += 8;
        let end = *at + 4 * len;
        let v = b
            .get(*at..end)
            .ok_or_else(|| anyhow!("a rank's outputs end early"))?
            .chunks_exact(4)
            .map(|c| c.try_into().expect("4 bytes"))
            .collect();
        *at = end;
        Ok(v)
    };
    for _ in 0..8 {
        vecs.push(
            read4(&mut at)?
                .into_iter()
                .map(f32::from_le_bytes)
                .collect(),
        );
    }
    let experts = read4(&mut at)?
        .into_iter()
        .map(u32::from_le_bytes)
        .collect();
    Ok(RankResult {
        steps,
        bytes,
        outputs: Some((vecs, experts)),
    })
}

/// Sends `mine` to rank 0; rank 0 gets every rank's message, in rank order.
fn gather<C: Collectives<Buf = [u8]> + ?Sized>(comm: &mut C, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let n = comm.ranks();
    let mut send_counts = vec![0; n];
    send_counts[0] = mine.len();
    let recv_counts = exchange_counts(comm, &send_counts)?;
    let mut all = vec![0u8; recv_counts.iter().sum()];
    comm.all_to_all_v(mine, &send_counts, &mut all, &recv_counts)?;
    let mut out = Vec::new();
    let mut at = 0;
    for c in recv_counts {
        out.push(all[at..at + c].to_vec());
        at += c;
    }
    Ok(out)
}

/// One rank of the command: its steps, its trace, and on rank 0 the report (lines to print,
/// and whether every check passed).
fn rank_main<C: Collectives<Buf = [u8]> + ?Sized>(
    comm: &mut C,
    cmd: &EpCmd,
) -> Result<Option<(String, bool)>> {
    let (me, n) = (comm.rank(), comm.ranks());
    let call = rank_call_config(cmd, me)?;
    let run = rank_steps(comm, cmd, &call)?;
    // Diagnostics of the last step's three graphs, one directory each.
    if let Some(dir) = &call.output_dir {
        let last = run.steps.last().expect("at least one step");
        for (name, r) in ["front", "experts", "back"].iter().zip(&last.reports) {
            simpler_dfx::diag::write_run_diagnostics(&dir.join(name), r)?;
        }
    }
    let trace = call.trace.clone().or_else(|| {
        call.output_dir
            .as_ref()
            .map(|d| d.join(simpler_dfx::diag::TRACE_FILE))
    });
    if let Some(path) = &trace {
        write_trace(path, cmd, n, &run.steps)?;
    }
    let all = gather(comm, &encode_rank(&run, cmd.check))?;
    if me != 0 {
        return Ok(None);
    }
    let results = all
        .iter()
        .map(|b| decode_rank(b, cmd.check))
        .collect::<Result<Vec<_>>>()?;
    report(cmd, &results)
}

/// The step's bytes (every rank's) against this host's streaming read, measured by rank 0
/// after the steps (the ranks share the host's memory, so the whole step's bytes over its
/// time is what the memory served), and the kernel paths.
fn bandwidth_lines(cmd: &EpCmd, results: &[RankResult], eff: &Summary, tokens: usize) -> String {
    let bytes: f64 = results.iter().map(|r| r.bytes).sum();
    let m = crate::qwen3_decode::machine_peaks(cmd.membw_seconds);
    let mut s = format!(
        "{}\n{}\n",
        crate::qwen3_decode::format_peaks(&m),
        crate::dsv4_cmd::format_paths(tokens, None)
    );
    for (what, t_us, gbs, pass) in [
        (
            "median step",
            eff.median,
            m.read_gbs_all,
            "best pass (best case)",
        ),
        (
            "quietest step",
            eff.min,
            m.read_gbs_all,
            "best pass (best case)",
        ),
        (
            "median step at membw's median pass",
            eff.median,
            m.read_gbs_all_median,
            "median pass",
        ),
    ] {
        let got = bytes / (t_us * 1e-6) / 1e9;
        s += &format!(
            "  {what}: {t_us:.1} us; bytes/step {:.2} MB over the ranks -> {got:.2} GB/s = {:.1}% of membw's {pass} ({gbs:.1} GB/s)\n",
            bytes / 1e6,
            100.0 * got / gbs
        );
    }
    s
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

/// Rank 0's report: a line per rank, the multi-rank statistics, the phase split, and the
/// checks.
fn report(cmd: &EpCmd, results: &[RankResult]) -> Result<Option<(String, bool)>> {
    let (cfg, placement) = ep_config(cmd)?;
    let n = results.len();
    let mut s = String::new();
    let steps = cmd.warmup + cmd.rounds;
    if results.iter().any(|r| r.steps.len() != steps) {
        bail!("a rank reported a different number of steps than {steps}");
    }
    let median_of = |f: &dyn Fn(&StepRecord) -> f64, r: &RankResult| {
        let v: Vec<f64> = r.steps[cmd.warmup..].iter().map(f).collect();
        Summary::of(&v).median
    };
    if let Some(t) = &cmd.run.trace {
        let files: Vec<String> = (0..n)
            .map(|r| per_rank_file(t, r).display().to_string())
            .collect();
        s += &format!("trace: one file per rank: {}\n", files.join(", "));
    }
    s += &format!(
        "expert-parallel MoE: {} ranks over {}, {} routed experts ({} per rank), {} shared, {}, hidden {}, width {}; batch {} tokens; {} steps after {} warm-up; rank 0 may use {} cores (every rank runs on this host's cores; mpirun may bind each rank to its own)\n",
        n,
        cmd.collectives.name(),
        cfg.n_routed_experts,
        placement.per_rank,
        cfg.n_shared_experts,
        crate::dsv4_moe::describe_routing(
            &cfg,
            crate::dsv4_moe::routed_layer(&cfg, cmd.hash_routing)?
        ),
        cfg.hidden,
        cfg.moe_inter_dim,
        starts_of(cmd, &cfg)?.len() * TOKENS_PER_SEQ,
        cmd.rounds,
        cmd.warmup,
        cmd.run
            .cores
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(0, |c| c.get())),
    );
    s += "caches: warm: the ranks run their steps back to back, and a rank's share of the experts that fits the last-level cache is partly read from it (the single-process bench flushes it)\n";
    s += "per rank (median us of the measured steps; a phase includes waiting for the other ranks in its exchange):\n";
    for (r, res) in results.iter().enumerate() {
        let total = median_of(&|x| us(x.0.iter().sum()), res);
        let parts: Vec<String> = PHASES
            .iter()
            .enumerate()
            .map(|(i, name)| format!("{name} {:.1}", median_of(&|x| us(x.0[i]), res)))
            .collect();
        let valid = res.steps[cmd.warmup..].iter().filter(|x| x.1).count();
        s += &format!(
            "  rank {r}: effective_us {total:.1}  {}  valid {valid}/{}\n",
            parts.join("  "),
            cmd.rounds
        );
    }
    // Per round: the step ends when its slowest rank does; a rank's invalid round is missing.
    let per_round = |f: &dyn Fn(&[u64; 5]) -> u64| -> Vec<Vec<Option<f64>>> {
        (0..steps)
            .map(|k| {
                results
                    .iter()
                    .map(|r| r.steps[k].1.then(|| us(f(&r.steps[k].0))))
                    .collect()
            })
            .collect()
    };
    let m = combine_ranks(&per_round(&|p| p.iter().sum()), n, cmd.warmup);
    s += &format!(
        "{}\n",
        format_summary("effective_us", &Summary::of(&m.effective), cmd.warmup)
    );
    s += &format!(
        "fast_effective_us median {:.1} (fastest rank per round)  valid_rounds {}/{} (every rank's output identical to its first step)\n",
        Summary::of(&m.fast_effective).median,
        m.valid_rounds,
        m.rounds
    );
    s += &bandwidth_lines(
        cmd,
        results,
        &Summary::of(&m.effective),
        starts_of(cmd, &cfg)?.len() * TOKENS_PER_SEQ,
    );
    let split: Vec<String> = PHASES
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let m = combine_ranks(&per_round(&|p| p[i]), n, cmd.warmup);
            format!("{name} {:.1}", Summary::of(&m.effective).median)
        })
        .collect();
    s += &format!(
        "step split (median over rounds of the slowest rank's phase, us): {}\n",
        split.join("  ")
    );
    let mut ok = true;
    if cmd.check {
        let lines = check_outputs(cmd, &cfg, results)?;
        s += "check vs the single-rank step (bit for bit) and the golden:\n";
        for (line, good) in lines {
            s += &format!("  {line}\n");
            ok &= good;
        }
    }
    Ok(Some((s, ok)))
}

/// The ranks' outputs joined in token order against the single-rank step on this process
/// (every expert local) and the golden.
fn check_outputs(
    cmd: &EpCmd,
    cfg: &Dsv4Config,
    results: &[RankResult],
) -> Result<Vec<(String, bool)>> {
    let parts: Vec<&(Vec<Vec<f32>>, Vec<u32>)> = results
        .iter()
        .map(|r| {
            r.outputs
                .as_ref()
                .ok_or_else(|| anyhow!("a rank sent no outputs"))
        })
        .collect::<Result<_>>()?;
    let join = |i: usize| -> Vec<f32> { parts.iter().flat_map(|p| p.0[i].clone()).collect() };
    let (s_n, d) = (cfg.n_shared_experts, cfg.hidden);
    // Shared outputs are [S, T_rank, D] on each rank: back to [S, T, D].
    let shared: Vec<f32> = (0..s_n)
        .flat_map(|si| {
            parts.iter().flat_map(move |p| {
                let tr = p.0[5].len() / (s_n * d).max(1);
                p.0[5][si * tr * d..(si + 1) * tr * d].to_vec()
            })
        })
        .collect();
    let ep = MoeOutput {
        x_out: join(0),
        x_mixed: join(1),
        post: join(2),
        comb: join(3),
        y: join(4),
        shared,
        routed: join(6),
        weights: join(7),
        experts: parts.iter().flat_map(|p| p.1.clone()).collect(),
        report: RunReport::default(),
    };
    let worker = cmd.run.worker()?;
    ops::register(&worker)?;
    moe_ops::register(&worker)?;
    let starts = starts_of(cmd, cfg)?;
    let inputs = generate_inputs(cfg, &starts, cmd.seed);
    let weights = generate_moe_weights(cfg, cmd.seed);
    let layer = crate::dsv4_moe::routed_layer(cfg, cmd.hash_routing)?;
    let single = MoeLayer::new(
        &worker,
        cfg,
        &weights,
        layer,
        ExpertPlacement::single(cfg.n_routed_experts),
        0,
    )?
    .step(
        &worker,
        &inputs.x_hc,
        &inputs.token_ids,
        &CallConfig::default(),
    )?;
    let mut lines = vec![];
    let same = |what: &str, a: &[f32], b: &[f32]| -> (String, bool) {
        let diff = a.len() != b.len() || bits(a) != bits(b);
        if diff {
            let first = a
                .iter()
                .zip(b)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            (
                format!(
                    "FAILED: {what}: {} vs {} elements, first difference at {first:?}",
                    a.len(),
                    b.len()
                ),
                false,
            )
        } else {
            (
                format!("ok: {what}: {} elements bit-identical to one rank", a.len()),
                true,
            )
        }
    };
    lines.push(if ep.experts == single.experts {
        (
            format!("ok: routing: {} routes as one rank", ep.experts.len()),
            true,
        )
    } else {
        ("FAILED: routing differs from one rank".into(), false)
    });
    for (what, a, b) in [
        ("x_out", &ep.x_out, &single.x_out),
        ("x_mixed", &ep.x_mixed, &single.x_mixed),
        ("post", &ep.post, &single.post),
        ("comb", &ep.comb, &single.comb),
        ("y", &ep.y, &single.y),
        ("shared", &ep.shared, &single.shared),
        ("routed [T, K, D]", &ep.routed, &single.routed),
        ("routing weights", &ep.weights, &single.weights),
    ] {
        lines.push(same(what, a, b));
    }
    lines.extend(crate::dsv4_moe::golden_lines(
        cfg, &weights, layer, &inputs, &ep,
    ));
    Ok(lines)
}

/// Staging bytes per chip for the shared-memory backend: the largest of the dispatch, the
/// combine and the gather to rank 0.
fn collective_bytes(cmd: &EpCmd) -> Result<usize> {
    let (cfg, placement) = ep_config(cmd)?;
    let t = starts_of(cmd, &cfg)?.len() * TOKENS_PER_SEQ;
    let tr = t.div_ceil(cmd.ep);
    let (d, k, hc, s) = (
        cfg.hidden,
        cfg.n_activated_experts,
        cfg.hc_mult,
        cfg.n_shared_experts,
    );
    let outputs = 4 * tr * (hc * d + d + hc + hc * hc + d + s * d + k * d + 2 * k) + 8 * 10;
    let times = 8 * (1 + 6 * (cmd.warmup + cmd.rounds));
    Ok(dispatch_bytes_max(&placement, tr, k, d)
        .max(combine_bytes_max(tr, k, d))
        .max(outputs + times)
        .max(1 << 16))
}

/// The chip function: the parent's command line in, rank 0's report out.
fn chip_fn(ctx: &mut ChildCtx, args: &[u8]) -> Result<Vec<u8>, String> {
    let ChildId::Chip(rank) = ctx.id() else {
        return Err("dsv4_moe_ep runs on chips".into());
    };
    let ranks = ctx.chips();
    let _ = set_process_role(ProcessRole::chip(rank as u32, ranks as u32));
    let argv: Vec<String> = std::str::from_utf8(args)
        .map_err(|e| format!("dsv4_moe_ep arguments: {e}"))?
        .split('\0')
        .map(str::to_string)
        .collect();
    let cmd = crate::parse_ep_cmd(&argv).map_err(|e| format!("{e:#}"))?;
    let comm = ctx.collectives().ok_or("no collectives in this chip")?;
    match rank_main(comm, &cmd).map_err(|e| format!("rank {rank}: {e:#}"))? {
        Some((text, true)) => Ok(text.into_bytes()),
        Some((text, false)) => Err(format!(
            "{text}the expert-parallel step differs from the single-rank step or the golden"
        )),
        None => Ok(Vec::new()),
    }
}

/// Runs `cmd` (its flags already checked).
pub(crate) fn main(cmd: EpCmd) -> Result<()> {
    check_cmd(&cmd)?;
    match cmd.collectives {
        Backend::Shm => shm_main(&cmd),
        Backend::Mpi => mpi_main(&cmd),
    }
}

fn shm_main(cmd: &EpCmd) -> Result<()> {
    let n = cmd.ep;
    if n == 1 {
        // One rank: the exchanges are copies to itself.
        let mut comm = Loopback;
        let (text, ok) = rank_main(&mut comm, cmd)?.expect("rank 0 reports");
        print!("{text}");
        if !ok {
            bail!("the expert-parallel step differs from the single-rank step or the golden");
        }
        return Ok(());
    }
    let argv: Vec<String> = std::env::args().collect();
    let bytes = argv.join("\0").into_bytes();
    let d = NodeConfig::default();
    let mut node = Node::start(NodeConfig {
        chips: n,
        collective_bytes: collective_bytes(cmd)?,
        call_timeout: cmd
            .rank_timeout
            .map_or(d.call_timeout, std::time::Duration::from_secs_f64),
        ..d
    })
    .with_context(|| format!("starting a node of {n} chips"))?;
    let calls: Vec<(ChildId, &[u8])> = (0..n).map(|i| (ChildId::Chip(i), &bytes[..])).collect();
    let answers = node.call_group(CHIP_FN, &calls);
    let closed = node.close();
    let answers = answers?;
    closed?;
    print!("{}", String::from_utf8_lossy(&answers[0]));
    Ok(())
}

/// One rank's communicator: an all-to-all with itself is a copy.
struct Loopback;

impl Collectives for Loopback {
    type Buf = [u8];

    fn rank(&self) -> usize {
        0
    }

    fn ranks(&self) -> usize {
        1
    }

    fn all_to_all_v(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), simpler_node::CollectiveError> {
        if send_counts != [send.len()] || recv_counts != [recv.len()] || send.len() != recv.len() {
            return Err(simpler_node::CollectiveError::BadArgs {
                op: "all_to_all_v",
                rank: 0,
                reason: format!(
                    "one rank sends {send_counts:?} of {} bytes and receives {recv_counts:?} of {}",
                    send.len(),
                    recv.len()
                ),
            });
        }
        recv.copy_from_slice(send);
        Ok(())
    }

    fn all_reduce(
        &mut self,
        _buf: &mut [u8],
        _ty: simpler_node::ReduceType,
        _op: simpler_node::ReduceOp,
    ) -> Result<(), simpler_node::CollectiveError> {
        Ok(())
    }
}

#[cfg(not(feature = "mpi"))]
fn mpi_main(_: &EpCmd) -> Result<()> {
    bail!(
        "--collectives mpi: this simpler was built without the `mpi` feature (cargo build -p simpler-cli --features mpi; needs an MPI library and libclang)"
    )
}

/// Round trips to rank 0 for a rank's clock offset (the shortest is kept).
#[cfg(feature = "mpi")]
const CLOCK_ROUND_TRIPS: usize = 16;

/// This `mpirun` rank's role in its traces, with its clock offset to rank 0 measured now, so
/// the `trace` tools can merge ranks of several hosts on rank 0's clock. A collective: every
/// rank calls it at the same point, before its traced work.
#[cfg(feature = "mpi")]
pub(crate) fn mpi_rank_role(comm: &mut simpler_node::MpiCollectives) -> ProcessRole {
    let (e, reference_boot_id) = comm.clock_offset_to_rank_0(
        CLOCK_ROUND_TRIPS,
        &simpler_dfx::writer::this_process_clock().boot_id,
        simpler_dfx::writer::monotonic_ns,
    );
    ProcessRole::mpi_rank(
        comm.rank() as u32,
        comm.ranks() as u32,
        simpler_core::trace::ClockOffset {
            reference_boot_id,
            offset_ns: e.offset_ns,
            uncertainty_ns: e.uncertainty_ns,
        },
    )
}

/// Outside `mpirun`: starts `mpirun -np N` of this same command line. Inside: one rank.
#[cfg(feature = "mpi")]
fn mpi_main(cmd: &EpCmd) -> Result<()> {
    if !simpler_node::under_mpirun() {
        let exe = std::env::current_exe().context("current_exe")?;
        let mut c = simpler_node::mpirun_command(cmd.ep, &exe);
        c.args(std::env::args().skip(1));
        let status = c.status().context("running mpirun (Debian: openmpi-bin)")?;
        if !status.success() {
            bail!("mpirun -np {}: {status}", cmd.ep);
        }
        return Ok(());
    }
    let universe = mpi::initialize().context("MPI initializes once")?;
    let mut comm = simpler_node::MpiCollectives::new(universe.world());
    let me = comm.rank();
    let _ = set_process_role(mpi_rank_role(&mut comm));
    let report = match rank_main(&mut comm, cmd) {
        Ok(report) => report,
        // The other ranks may be waiting for this one inside an exchange, which MPI cannot
        // release: end the job now rather than leave them to `mpirun`'s own limits.
        Err(e) => {
            eprintln!("error: mpi rank {me}: {e:#}");
            comm.abort(1)
        }
    };
    if let Some((text, ok)) = report {
        print!("{text}");
        if !ok {
            bail!("the expert-parallel step differs from the single-rank step or the golden");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_rank_paths_keep_the_extension() {
        assert_eq!(
            per_rank_file(Path::new("/t/x.jsonl"), 3),
            PathBuf::from("/t/x.rank3.jsonl")
        );
        assert_eq!(per_rank_file(Path::new("x"), 0), PathBuf::from("x.rank0"));
    }
}
