//! Options shared by every `simpler run ...` (and the benchmarks): cores, ring sizes, mode and
//! the diagnostics switches; and what to do with a finished run's report — [`emit`] for a
//! command that runs once, [`StepOutputs`] for one that runs many steps.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use simpler_core::config::ENV_STREAM_SYNC_TIMEOUT_MS;
use simpler_core::{
    CallConfig, OrchMode, RingValue, RunReport, RuntimeEnv, Timeouts, Worker, WorkerConfig,
    human_bytes,
};
use simpler_cpu::CpuPlatform;
use simpler_models::qwen3::Qwen3Config;

/// Runtime and diagnostics options.
#[derive(Args, Debug, Clone)]
pub(crate) struct RunOpts {
    /// Cores (threads) of the CPU platform [default: available parallelism].
    #[arg(long, value_parser = core_count)]
    pub(crate) cores: Option<usize>,
    /// Task-window slots per ring: N or four comma-separated values (power of two >= 4).
    #[arg(long, value_parser = RingValue::parse)]
    pub(crate) ring_task_window: Option<RingValue>,
    /// Heap bytes per ring (e.g. 256M, or four values): N or a,b,c,d.
    #[arg(long, value_parser = RingValue::parse)]
    pub(crate) ring_heap: Option<RingValue>,
    /// Dependency-pool entries per ring: N or a,b,c,d.
    #[arg(long, value_parser = RingValue::parse)]
    pub(crate) ring_dep_pool: Option<RingValue>,
    /// Dependency-map entries of a run: one per live reader or writer of a tensor region
    /// (16 to 2^28) [default: 65536].
    #[arg(long, value_name = "ENTRIES")]
    pub(crate) tensormap_capacity: Option<u64>,
    /// Submit everything first, then execute (for measurement; rings must hold the graph).
    #[arg(long)]
    pub(crate) serial: bool,
    /// Where diagnostics are written (required by --swimlane, --dep-gen, --ring-stats).
    #[arg(long)]
    pub(crate) output_dir: Option<PathBuf>,
    /// Per-task timeline: 1 kernels, 2 +dispatch/finish, 3 +scheduler phases, 4 +submits.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=4), default_value_t = 0)]
    pub(crate) swimlane: u8,
    /// Capture the dependency graph (deps.json).
    #[arg(long)]
    pub(crate) dep_gen: bool,
    /// Record ring high-water marks (ring_stats.json).
    #[arg(long)]
    pub(crate) ring_stats: bool,
    /// Write the run spans as JSON Lines to FILE.
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// Swimlane records one run may keep (split evenly over the cores, each share rounded up);
    /// past it records are dropped and counted [default: 1048576].
    #[arg(long, value_name = "RECORDS")]
    pub(crate) swimlane_capacity: Option<usize>,
    /// Steps whose diagnostics a multi-step command (run qwen3-decode, generate, serve, bench
    /// serve) keeps, each in OUTPUT_DIR/step-NNNNNN/: `all`, or step numbers and ranges counted
    /// from 0 in the order the command runs them, e.g. `0,5-7`. The trace keeps every step.
    #[arg(long, value_name = "LIST", default_value = "all", value_parser = StepSet::parse)]
    pub(crate) diag_steps: StepSet,
}

/// The steps `--diag-steps` selects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StepSet {
    All,
    /// Inclusive ranges.
    Ranges(Vec<(u64, u64)>),
}

impl StepSet {
    pub(crate) fn parse(s: &str) -> Result<StepSet> {
        if s.trim() == "all" {
            return Ok(StepSet::All);
        }
        let num = |t: &str| {
            t.trim()
                .parse::<u64>()
                .with_context(|| format!("{t:?} is not a step number"))
        };
        let mut ranges = Vec::new();
        for item in s.split(',') {
            let (a, b) = match item.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => (num(item)?, num(item)?),
            };
            if a > b {
                bail!("step range {item:?} runs backwards");
            }
            ranges.push((a, b));
        }
        Ok(StepSet::Ranges(ranges))
    }

    pub(crate) fn contains(&self, step: u64) -> bool {
        match self {
            StepSet::All => true,
            StepSet::Ranges(r) => r.iter().any(|&(a, b)| (a..=b).contains(&step)),
        }
    }

    /// Refuses a set that picks none of the `steps` a command will run (numbered from 0), so
    /// that a list past the end is not taken and ignored.
    pub(crate) fn check_within(&self, steps: u64) -> Result<()> {
        if let StepSet::Ranges(r) = self
            && !r.iter().any(|&(a, _)| a < steps)
        {
            bail!(
                "--diag-steps {self}: picks none of the {steps} steps this run takes (numbered from 0)"
            );
        }
        Ok(())
    }
}

impl std::fmt::Display for StepSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepSet::All => write!(f, "all"),
            StepSet::Ranges(r) => {
                let items: Vec<String> = r
                    .iter()
                    .map(|&(a, b)| {
                        if a == b {
                            a.to_string()
                        } else {
                            format!("{a}-{b}")
                        }
                    })
                    .collect();
                write!(f, "{}", items.join(","))
            }
        }
    }
}

impl RunOpts {
    /// The run's configuration from the flags, for a command that records a swimlane only when
    /// `--swimlane` asks for one.
    pub(crate) fn call_config(&self, label: &str) -> Result<CallConfig> {
        self.config_for(label, false)
    }

    /// As [`RunOpts::call_config`], for a bench that records a step's swimlane on its own (at
    /// level 1, in memory when no `--output-dir` is given) to measure its outside-kernel share:
    /// there `--swimlane-capacity` sizes that record with or without `--swimlane`.
    pub(crate) fn recording_call_config(&self, label: &str) -> Result<CallConfig> {
        self.config_for(label, true)
    }

    fn config_for(&self, label: &str, records_anyway: bool) -> Result<CallConfig> {
        let d = RuntimeEnv::default();
        let cfg = CallConfig {
            runtime_env: RuntimeEnv {
                ring_task_window: self.ring_task_window.unwrap_or(d.ring_task_window),
                ring_heap: self.ring_heap.unwrap_or(d.ring_heap),
                ring_dep_pool: self.ring_dep_pool.unwrap_or(d.ring_dep_pool),
            },
            mode: if self.serial {
                OrchMode::Serial
            } else {
                OrchMode::Overlapped
            },
            swimlane: self.swimlane,
            dep_gen: self.dep_gen,
            ring_stats: self.ring_stats,
            output_dir: self.output_dir.clone(),
            trace: self.trace.clone(),
            label: Some(label.to_string()),
            swimlane_capacity: self
                .swimlane_capacity
                .unwrap_or(CallConfig::default().swimlane_capacity),
            tensormap_capacity: self
                .tensormap_capacity
                .unwrap_or(CallConfig::default().tensormap_capacity),
            ..CallConfig::default()
        };
        cfg.check().map_err(|e| {
            anyhow::anyhow!("{} = {}: {}", flag_of_field(&e.field), e.value, e.reason)
        })?;
        // A capacity sizes the swimlane records: where none is recorded it would size nothing.
        // (`--swimlane` without `--output-dir` is refused by `check` above.)
        if self.swimlane_capacity.is_some() && cfg.swimlane == 0 && !records_anyway {
            bail!(
                "--swimlane-capacity: sizes the swimlane records, and this command records none without --swimlane N (and --output-dir)"
            );
        }
        check_output_paths(&cfg)?;
        if self.diag_steps != StepSet::All && (cfg.swimlane == 0 && !cfg.dep_gen && !cfg.ring_stats)
        {
            bail!(
                "--diag-steps: picks the steps whose diagnostics are written, and none is on: add --swimlane, --dep-gen or --ring-stats (with --output-dir)"
            );
        }
        Ok(cfg)
    }

    /// Refuses the flags that record or write diagnostics (`--swimlane`, `--dep-gen`,
    /// `--ring-stats`, `--trace`, `--output-dir`, `--swimlane-capacity`, `--diag-steps`) for a
    /// command that writes none, naming the first one given; `why` says what the command does
    /// instead.
    pub(crate) fn refuse_diagnostics(&self, why: &str) -> Result<()> {
        for (flag, given) in [
            ("--swimlane", self.swimlane != 0),
            ("--dep-gen", self.dep_gen),
            ("--ring-stats", self.ring_stats),
            ("--trace", self.trace.is_some()),
            ("--output-dir", self.output_dir.is_some()),
            ("--swimlane-capacity", self.swimlane_capacity.is_some()),
            ("--diag-steps", self.diag_steps != StepSet::All),
        ] {
            if given {
                bail!("{flag}: {why}");
            }
        }
        Ok(())
    }

    /// Refuses `--diag-steps` for a command that writes one run's diagnostics (`cmd` names
    /// it): the flag selects steps of the commands that write many.
    pub(crate) fn refuse_diag_steps(&self, cmd: &str) -> Result<()> {
        if self.diag_steps != StepSet::All {
            bail!(
                "--diag-steps: `simpler {cmd}` writes one recorded step's diagnostics; the flag selects steps of `run qwen3-decode`, `generate`, `serve` and `bench serve`"
            );
        }
        Ok(())
    }

    pub(crate) fn worker(&self) -> Result<Worker> {
        self.worker_with(None)
    }

    /// The worker, its stream-sync timeout (the limit on one whole run) raised to `at_least`
    /// where the default is shorter and the environment does not set it; a raise is printed.
    fn worker_with(&self, at_least: Option<Duration>) -> Result<Worker> {
        // The raise goes under the environment's overrides: one that is applied wins, one that
        // is refused falls back to the raised value, and the ordering rule is checked against
        // the raised value (a longer op_execute alone is then accepted).
        let default = Timeouts::default();
        let base = Timeouts {
            stream_sync: at_least.map_or(default.stream_sync, |n| n.max(default.stream_sync)),
            ..default
        };
        let (timeouts, mut warnings) = base.overridden_with(&|k| std::env::var(k).ok());
        if base.stream_sync > default.stream_sync && timeouts.stream_sync == base.stream_sync {
            eprintln!(
                "stream-sync timeout {:.0} s (default {:.0} s): the longest step this command runs may take that long on a slow, shared CPU (set {ENV_STREAM_SYNC_TIMEOUT_MS} to choose)",
                base.stream_sync.as_secs_f64(),
                default.stream_sync.as_secs_f64()
            );
        }
        let w = Worker::new(
            CpuPlatform::new(),
            WorkerConfig {
                cores: self.cores,
                timeouts: Some(timeouts),
                idle_spin: None,
            },
        )
        .context("starting the CPU worker")?;
        warnings.extend(w.warnings().iter().cloned());
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if let Some(n) = self.cores.filter(|&n| n > cpus) {
            warnings.push(format!(
                "--cores {n} on {cpus} CPUs: the cores take turns on them, and a step waits for the ones the OS holds off (steps run many times slower)"
            ));
        }
        for warning in warnings {
            eprintln!("warning: {warning}");
        }
        Ok(w)
    }

    /// A worker and call configuration for Qwen3 prefill steps of up to `rows` token rows
    /// after up to `context` cached positions (the longest step a command runs):
    /// - the ring heap those steps' largest scope allocates (`prefill_heap_bytes`): the
    ///   default raised to it, or a `--ring-heap` below it refused, since such a step would
    ///   fail with a heap deadlock;
    /// - a stream-sync timeout of at least that step's time at [`SLOWEST_GFLOPS_PER_CORE`]:
    ///   the default 50 s is shorter than a 3072-token 0.6B prefill on 2 cores.
    pub(crate) fn prefill_sized(
        &self,
        cfg: &mut CallConfig,
        c: &Qwen3Config,
        rows: usize,
        context: usize,
        what: &str,
    ) -> Result<Worker> {
        let need = simpler_models::qwen3::prefill_heap_bytes(c, rows);
        // The layers' scopes (depth 1) allocate from ring 1; the step's residual `x`, in its
        // outer scope, from ring 0.
        let x = (rows as u64)
            .saturating_mul(c.hidden_size as u64 * 4)
            .next_multiple_of(simpler_core::OUTPUT_ALIGN);
        let heap = cfg.runtime_env.ring_heap.get(1);
        if self.ring_heap.is_some() {
            for (ring, holds, needs, part) in [
                (1, heap, need, "one layer's scope"),
                (
                    0,
                    cfg.runtime_env.ring_heap.get(0),
                    x,
                    "the step's residual",
                ),
            ] {
                if needs > holds {
                    bail!(
                        "--ring-heap: ring {ring} holds {}, and a prefill step of {rows} rows ({what}) allocates {} in {part}; raise it or take smaller steps",
                        human_bytes(holds),
                        human_bytes(needs)
                    );
                }
            }
        } else if need > heap {
            let mib = need.div_ceil(1 << 20) << 20;
            eprintln!(
                "ring heap {} per ring (default {}): a prefill step of {rows} rows ({what}) allocates {} in one layer's scope",
                human_bytes(mib),
                human_bytes(heap),
                human_bytes(need)
            );
            cfg.runtime_env.ring_heap = RingValue::All(mib);
        }
        let layers = c.num_hidden_layers;
        let flops =
            simpler_models::qwen3::StepCost::prefill(c, layers, true, rows, context).flops();
        let cores = self
            .cores
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .unwrap_or(1);
        let slowest = flops / (cores as f64 * SLOWEST_GFLOPS_PER_CORE * 1e9);
        self.worker_with(Some(Duration::from_secs_f64(slowest.clamp(0.0, 1e6))))
    }
}

/// Most rounds, warm-up and measured together, a benchmark runs: every round's sample (and for
/// some benches its report) is held until the summary, so the count sizes memory; a million
/// is days of the fastest step.
pub(crate) const MAX_BENCH_ROUNDS: usize = 1_000_000;

/// Refuses a benchmark's `--warmup` and `--rounds` where no round would be measured, or their
/// sum overflows or passes [`MAX_BENCH_ROUNDS`], naming both flags and the numbers.
pub(crate) fn check_rounds(warmup: usize, rounds: usize) -> Result<()> {
    if rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if warmup
        .checked_add(rounds)
        .is_none_or(|n| n > MAX_BENCH_ROUNDS)
    {
        bail!(
            "--warmup {warmup} --rounds {rounds}: at most {MAX_BENCH_ROUNDS} rounds in all (warm-up and measured together)"
        );
    }
    Ok(())
}

/// Most steps recorded at swimlane level for a benchmark's outside-kernel share.
pub(crate) const MAX_RECORDED_STEPS: usize = 10_000;

/// Refuses a count of extra recorded steps (`--outside-steps`) above [`MAX_RECORDED_STEPS`]:
/// each step's report, swimlane records included, is held until the summary.
pub(crate) fn check_recorded_steps(flag: &str, steps: usize) -> Result<()> {
    if steps > MAX_RECORDED_STEPS {
        bail!(
            "{flag} {steps}: at most {MAX_RECORDED_STEPS} recorded steps (each is held with its swimlane records until the summary)"
        );
    }
    Ok(())
}

/// Checks before any work — a run that failed to write at its end lost its work — that the
/// run's output directory and trace file can be made and written, creating neither: the
/// writers make them when they write, so a command refused later leaves nothing behind, and
/// ranks checking one shared path at once cannot undo each other's directories. What is
/// probed is the deepest part of each path that exists.
pub(crate) fn check_output_paths(cfg: &CallConfig) -> Result<()> {
    if let Some(dir) = &cfg.output_dir {
        check_can_make_below(dir)
            .with_context(|| format!("--output-dir {}: cannot be made", dir.display()))?;
    }
    if let Some(t) = &cfg.trace {
        if std::fs::symlink_metadata(t).is_ok() || t.as_os_str().as_encoded_bytes().ends_with(b"/")
        {
            check_writable_file("--trace", t)?;
        } else {
            let parent = t.parent().filter(|p| !p.as_os_str().is_empty());
            check_can_make_below(parent.unwrap_or(std::path::Path::new("."))).with_context(
                || format!("--trace {}: its directory cannot be made", t.display()),
            )?;
        }
    }
    Ok(())
}

/// Whether `dir` (and files in it) can be made: its deepest existing part is a directory in
/// which a file can be written, probed with a file of a name no other process uses, removed
/// at once.
fn check_can_make_below(dir: &std::path::Path) -> Result<()> {
    let existing = dir
        .ancestors()
        .find(|a| a.as_os_str().is_empty() || std::fs::symlink_metadata(a).is_ok())
        .filter(|a| !a.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !existing.is_dir() {
        bail!("{} is not a directory", existing.display());
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let probe = existing.join(format!(
        ".simpler-write-check-{}-{nanos}",
        std::process::id()
    ));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .with_context(|| format!("{} cannot be written", existing.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Refuses an output file `path` (given by `flag`) that cannot be written, before the work
/// that fills it: a path naming a directory; an existing file that cannot be opened for
/// appending; or, where there is no file yet, a place where none can be made — the deepest
/// existing directory on the way must take a file (the writers make the missing ones), and
/// for a link to a file not there yet, the directory the link points into must exist (a
/// write through the link makes no directory). A FIFO or a device is left alone: opening it
/// to probe could block, or end its reader. Nothing is created.
pub(crate) fn check_writable_file(flag: &str, path: &std::path::Path) -> Result<()> {
    if path.as_os_str().as_encoded_bytes().ends_with(b"/") {
        bail!("{flag} {}: names a directory, not a file", path.display());
    }
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => bail!("{flag} {}: is a directory", path.display()),
        Ok(m) if !m.is_file() => Ok(()),
        Ok(_) => {
            std::fs::OpenOptions::new()
                .append(true)
                .open(path)
                .with_context(|| format!("{flag} {}: cannot be written", path.display()))?;
            Ok(())
        }
        Err(_) => {
            let parent_of = |p: &std::path::Path| {
                p.parent()
                    .filter(|d| !d.as_os_str().is_empty())
                    .unwrap_or(std::path::Path::new("."))
                    .to_path_buf()
            };
            match std::fs::read_link(path) {
                Ok(target) => {
                    let target = parent_of(path).join(target);
                    let dir = parent_of(&target);
                    if !dir.is_dir() {
                        bail!(
                            "{flag} {}: links to {}, whose directory {} does not exist",
                            path.display(),
                            target.display(),
                            dir.display()
                        );
                    }
                    check_can_make_below(&dir)
                }
                Err(_) => check_can_make_below(&parent_of(path)),
            }
            .with_context(|| format!("{flag} {}: cannot be written", path.display()))
        }
    }
}

/// `text` with the runtime's `CallConfig` ring fields (which its errors' hints name) replaced
/// by the flags that set them on the command line.
pub(crate) fn flags_in(text: &str) -> String {
    let mut fields = FLAG_FIELDS;
    // Longer names first: `swimlane` is a prefix of `swimlane_capacity`.
    fields.sort_by_key(|f| std::cmp::Reverse(f.len()));
    fields.iter().fold(text.to_string(), |t, name| {
        let path = if name.starts_with("ring_") {
            format!("CallConfig.runtime_env.{name}")
        } else {
            format!("CallConfig.{name}")
        };
        t.replace(&path, &flag_of_field(&path))
    })
}

/// Parses `--rank-timeout-secs`: seconds from 1 to a day.
pub(crate) fn rank_timeout(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(1.0..=86_400.0).contains(&v) {
        return Err(format!("{s} seconds: give 1 to 86400"));
    }
    Ok(v)
}

/// Parses `--cores`: 1 to the most a worker takes.
pub(crate) fn core_count(s: &str) -> Result<usize, String> {
    let n: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of cores"))?;
    if !(1..=simpler_core::MAX_CORES).contains(&n) {
        return Err(format!("{n} cores: give 1 to {}", simpler_core::MAX_CORES));
    }
    Ok(n)
}

/// Parses a duration flag in seconds: a finite number from 0 to one hour. (`inf` reached
/// `Duration::from_secs_f64`, which panics, and a negative or NaN value was taken as 0.)
pub(crate) fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.0..=3600.0).contains(&v) {
        return Err(format!("{s} seconds: give 0 to 3600"));
    }
    Ok(v)
}

/// The slowest rate the CLI expects of a CPU prefill, GFLOP/s a core, when it sizes the limit
/// on one run: ~1/10 of what the 0.6B prefill measures on 2 Zen 3 cores (~37 a core), so a
/// loaded host stays inside it while a hung run is still caught (the scheduler's no-progress
/// watchdog and the per-task limit do not change).
const SLOWEST_GFLOPS_PER_CORE: f64 = 4.0;

/// The command-line flag that sets a `CallConfig` field (`CallConfig.output_dir` ->
/// `--output-dir`, `CallConfig.runtime_env.ring_heap[2]` -> `--ring-heap (ring 2)`); fields
/// no flag sets keep their name.
/// The `CallConfig` fields (and `runtime_env`'s) a flag of the same name sets.
const FLAG_FIELDS: [&str; 9] = [
    "ring_task_window",
    "tensormap_capacity",
    "ring_heap",
    "ring_dep_pool",
    "swimlane",
    "output_dir",
    "dep_gen",
    "ring_stats",
    "swimlane_capacity",
];

fn flag_of_field(field: &str) -> String {
    let Some(rest) = field.strip_prefix("CallConfig.") else {
        return field.to_string();
    };
    let rest = rest.strip_prefix("runtime_env.").unwrap_or(rest);
    let (name, ring) = match rest.split_once('[') {
        Some((n, r)) => (n, Some(r.trim_end_matches(']'))),
        None => (rest, None),
    };
    if !FLAG_FIELDS.contains(&name) {
        return field.to_string();
    }
    let flag = format!("--{}", name.replace('_', "-"));
    match ring {
        Some(r) => format!("{flag} (ring {r})"),
        None => flag,
    }
}

/// The call configuration of one case of a bench that measures several (shapes, prompt
/// lengths, layers): with `several`, its diagnostics go to `OUTPUT_DIR/case`, so one case's
/// files do not replace another's (an explicit `--trace` file is shared: spans append).
pub(crate) fn case_config(cfg: &CallConfig, case: &str, several: bool) -> CallConfig {
    let mut c = cfg.clone();
    if several {
        c.output_dir = cfg.output_dir.as_ref().map(|d| d.join(case));
    }
    c
}

/// What a bench writes for one case (`cfg`, from [`case_config`]): with `--output-dir`, the
/// `recorded` step (the one its report's tables come from, recorded at swimlane level 1 at
/// least, [`crate::bench_qwen3::swimlane_config`]); with only `--trace`, the `last` measured
/// step's spans. Nothing without either.
pub(crate) fn emit_case(
    cfg: &CallConfig,
    recorded: Option<&RunReport>,
    last: Option<&RunReport>,
) -> Result<()> {
    if cfg.output_dir.is_some() {
        if let Some(report) = recorded {
            emit(report, &crate::bench_qwen3::swimlane_config(cfg))?;
        }
    } else if cfg.trace.is_some()
        && let Some(report) = last
    {
        emit(report, cfg)?;
    }
    Ok(())
}

/// Writes the report's spans and diagnostics where the configuration says (a command that
/// runs once; see [`StepOutputs`] for one that runs many steps).
pub(crate) fn emit(report: &RunReport, cfg: &CallConfig) -> Result<()> {
    for p in simpler_dfx::write_run_outputs(report, cfg)? {
        eprintln!("wrote {}", p.display());
    }
    if let Some(sw) = report.swimlane.as_ref().filter(|s| s.dropped > 0) {
        eprintln!(
            "warning: {} swimlane records were dropped (the swimlane is incomplete); {}",
            sw.dropped,
            simpler_dfx::diag::DROPPED_RECORDS_HINT
        );
    }
    Ok(())
}

/// The outputs of a command that runs many steps: every step's spans go to the one trace file,
/// and the diagnostics of the steps `--diag-steps` selects to their own `step-NNNNNN`
/// directory, so no step overwrites another's. [`StepOutputs::finish`] prints one line for
/// all of them (and one warning if any step dropped swimlane records).
pub(crate) struct StepOutputs {
    steps: StepSet,
    next: u64,
    trace: Option<PathBuf>,
    /// Steps whose diagnostics were written: count, first and last directory.
    kept: Option<(u64, PathBuf, PathBuf)>,
    /// Steps that dropped swimlane records, and how many records in all.
    dropped: (u64, u64),
    /// Why an engine observer stopped writing ([`StepOutputs::observe_engine`]).
    failed: Option<String>,
}

impl StepOutputs {
    pub(crate) fn new(opts: &RunOpts) -> StepOutputs {
        StepOutputs {
            steps: opts.diag_steps.clone(),
            next: 0,
            trace: None,
            kept: None,
            dropped: (0, 0),
            failed: None,
        }
    }

    /// Why the engine's step outputs stopped being written, if they did.
    pub(crate) fn failed(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Writes one step's outputs; steps are numbered from 0 in the order they are emitted.
    pub(crate) fn emit(&mut self, report: &RunReport, cfg: &CallConfig) -> Result<()> {
        use simpler_dfx::diag::{TRACE_FILE, step_dir_name, write_step_outputs};
        let step = self.next;
        self.next += 1;
        let keep = self.steps.contains(step);
        let written = write_step_outputs(report, cfg, step, keep)?;
        self.trace = cfg
            .trace
            .clone()
            .or_else(|| cfg.output_dir.as_ref().map(|d| d.join(TRACE_FILE)));
        if let Some(dir) = cfg.output_dir.as_ref().map(|d| d.join(step_dir_name(step)))
            && written.iter().any(|p| p.starts_with(&dir))
        {
            match &mut self.kept {
                Some((n, _, last)) => {
                    *n += 1;
                    *last = dir;
                }
                None => self.kept = Some((1, dir.clone(), dir)),
            }
        }
        if let Some(sw) = report.swimlane.as_ref().filter(|s| s.dropped > 0) {
            self.dropped.0 += 1;
            self.dropped.1 += sw.dropped;
        }
        Ok(())
    }

    /// Hands `engine` an observer that writes every later step's outputs as `cfg` says (the
    /// spans of every step to the trace file, the diagnostics of the steps `--diag-steps`
    /// picks to `DIR/step-NNNNNN/`), and returns the outputs for [`StepOutputs::finish`];
    /// `None`, and no observer, when `cfg` asks for no file. The output directory and the
    /// trace file's directory are made first, so a path that cannot be written is refused
    /// before anything runs. A step whose files cannot be written later is not failed (a
    /// server keeps serving): the error is printed once, the observer stops writing, and
    /// [`StepOutputs::failed`] says why.
    pub(crate) fn observe_engine(
        engine: &mut simpler_serve::Engine,
        opts: &RunOpts,
        cfg: &CallConfig,
    ) -> Result<Option<std::sync::Arc<std::sync::Mutex<StepOutputs>>>> {
        if cfg.trace.is_none() && cfg.output_dir.is_none() {
            return Ok(None);
        }
        let dirs = cfg.output_dir.iter().cloned().chain(
            cfg.trace
                .as_ref()
                .and_then(|t| t.parent())
                .filter(|d| !d.as_os_str().is_empty())
                .map(PathBuf::from),
        );
        for dir in dirs {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating {} for the steps' outputs", dir.display()))?;
        }
        let outputs = std::sync::Arc::new(std::sync::Mutex::new(StepOutputs::new(opts)));
        let (shared, cfg) = (outputs.clone(), cfg.clone());
        engine.set_step_observer(Some(Box::new(move |report| {
            let mut out = shared.lock().unwrap_or_else(|p| p.into_inner());
            if out.failed.is_some() {
                return;
            }
            if let Err(e) = out.emit(report, &cfg) {
                eprintln!("warning: the engine's step outputs are no longer written: {e}");
                out.failed = Some(e.to_string());
            }
        })));
        Ok(Some(outputs))
    }

    /// Prints what was written, in one line.
    pub(crate) fn finish(&self) {
        let mut parts = Vec::new();
        if let Some(t) = &self.trace {
            parts.push(format!(
                "the spans of {} steps to {}",
                self.next,
                t.display()
            ));
        }
        if let Some((n, first, last)) = &self.kept {
            let range = if first == last {
                first.display().to_string()
            } else {
                format!("{} .. {}", first.display(), last.display())
            };
            parts.push(format!("the diagnostics of {n} steps to {range}"));
        }
        if !parts.is_empty() {
            eprintln!("wrote {}", parts.join("; "));
        }
        if self.kept.is_none() && self.steps != StepSet::All {
            // A command whose step count is not known up front (generate ends at EOS).
            eprintln!(
                "warning: --diag-steps {} picked none of the {} steps that ran (numbered from 0): no step's diagnostics were written",
                self.steps, self.next
            );
        }
        if self.dropped.0 > 0 {
            eprintln!(
                "warning: {} of {} steps dropped swimlane records ({} records in all; their swimlanes are incomplete); {}",
                self.dropped.0,
                self.next,
                self.dropped.1,
                simpler_dfx::diag::DROPPED_RECORDS_HINT
            );
        }
    }
}

/// The timing layers of a run, one per line.
pub(crate) fn format_report(r: &RunReport) -> String {
    let eff = r.effective();
    let us = |ns: u64| ns as f64 / 1e3;
    let mut s = String::new();
    s += &format!(
        "run {:?}: {} tasks, {} blocks, {} edges on {} cores ({})\n",
        r.orchestration,
        r.counters.tasks,
        r.counters.blocks,
        r.counters.edges,
        r.cores,
        if r.overlapped {
            "orchestration overlapped with execution"
        } else {
            "serial: submit all, then execute"
        }
    );
    s += &format!("  host_wall      {:>12.1} us\n", r.host_wall.us());
    s += &format!("    bind         {:>12.1} us\n", r.bind.us());
    s += &format!("    runner       {:>12.1} us\n", r.runner.us());
    s += &format!("      device_wall{:>12.1} us\n", r.device_wall.us());
    s += &format!(
        "        graph_build {:>9.1} us (config {:.1}, arena {:.1}, reset {:.1})\n",
        r.graph_build.us(),
        r.config_validate.us(),
        r.arena_wire.us(),
        r.reset.us()
    );
    s += &format!("        orch     {:>12.1} us\n", r.orch.us());
    s += &format!(
        "        sched    {:>12.1} us (overlaps orch; never add them)\n",
        r.sched.us()
    );
    s += &format!(
        "        effective{:>12.1} us = max(ends) - min(starts)\n",
        eff.us()
    );
    s += &format!("    validate     {:>12.1} us\n", r.validate.us());
    s += &format!(
        "  layers: (1) effective (orch ∪ sched) {:.1} us | (2) device init/finalize {:.1} us | (3) handshake {:.1} us | (4) bind+validate {:.1} us\n",
        eff.us(),
        us(r.device_wall.dur_ns().saturating_sub(eff.dur_ns())),
        us(r.runner.dur_ns().saturating_sub(r.device_wall.dur_ns())),
        us(r.host_wall.dur_ns().saturating_sub(r.runner.dur_ns())),
    );
    for t in &r.task_slots {
        s += &format!(
            "  task_slot_{}: {} tasks, {:.1} us\n",
            t.slot,
            t.tasks,
            t.span.us()
        );
    }
    if r.counters.ring_waits > 0 {
        s += &format!(
            "  the orchestrator waited for ring room {} times\n",
            r.counters.ring_waits
        );
    }
    if r.counters.skipped > 0 {
        s += &format!(
            "  {} tasks skipped by their dispatch predicate\n",
            r.counters.skipped
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_opts(args: &[&str]) -> RunOpts {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            run: RunOpts,
        }
        <P as clap::Parser>::try_parse_from(std::iter::once("x").chain(args.iter().copied()))
            .unwrap()
            .run
    }

    /// A long prefill step raises the default ring heap to what its layer scope allocates and
    /// the limit on one run to its time at the slow rate; a `--ring-heap` below the need is
    /// refused with both figures; a short step changes neither.
    #[test]
    fn prefill_steps_size_the_heap_and_the_run_limit() {
        let c = Qwen3Config::preset("qwen3-0.6b").unwrap();
        let opts = run_opts(&["--cores", "2"]);
        let mut cfg = opts.call_config("t").unwrap();
        let w = opts
            .prefill_sized(&mut cfg, &c, 64, 0, "--prompt-lens")
            .unwrap();
        assert_eq!(cfg.runtime_env.ring_heap, RuntimeEnv::default().ring_heap);
        assert_eq!(w.timeouts().stream_sync, Timeouts::default().stream_sync);
        let rows = 8192;
        let need = simpler_models::qwen3::prefill_heap_bytes(&c, rows);
        assert!(need > 256 << 20, "{need}");
        let w = opts
            .prefill_sized(&mut cfg, &c, rows, 0, "--prompt-lens")
            .unwrap();
        let heap = cfg.runtime_env.ring_heap.get(1);
        assert!(heap >= need && heap - need < 1 << 20, "{heap} for {need}");
        // 0.6B: ~1.2 TFLOP a 1k rows, so 8192 rows at 4 GFLOP/s a core on 2 cores is ~20 min
        // (unless the environment sets the limit, which then wins).
        if std::env::var_os(ENV_STREAM_SYNC_TIMEOUT_MS).is_none() {
            assert!(w.timeouts().stream_sync > Duration::from_secs(600));
        }
        let small = run_opts(&["--cores", "2", "--ring-heap", "256M"]);
        let mut cfg = small.call_config("t").unwrap();
        let Err(e) = small.prefill_sized(&mut cfg, &c, rows, 0, "--prompt-lens") else {
            panic!("a 256 MiB ring heap for 8192 rows was accepted");
        };
        let e = e.to_string();
        assert!(
            e.starts_with("--ring-heap: ring 1 holds 256 MiB")
                && e.contains("prefill step of 8192 rows (--prompt-lens)"),
            "{e}"
        );
    }

    #[test]
    fn error_texts_name_flags_not_fields() {
        assert_eq!(
            flags_in(
                "raise it: CallConfig.runtime_env.ring_heap of ring 0; CallConfig.swimlane_capacity"
            ),
            "raise it: --ring-heap of ring 0; --swimlane-capacity"
        );
    }

    #[test]
    fn config_fields_are_named_by_their_flags() {
        assert_eq!(flag_of_field("CallConfig.output_dir"), "--output-dir");
        assert_eq!(
            flag_of_field("CallConfig.runtime_env.ring_heap[2]"),
            "--ring-heap (ring 2)"
        );
        assert_eq!(
            flag_of_field("CallConfig.runtime_env.ring_task_window"),
            "--ring-task-window"
        );
        assert_eq!(
            flag_of_field("CallConfig.tensormap_capacity"),
            "--tensormap-capacity"
        );
        assert_eq!(flag_of_field("CallConfig.label"), "CallConfig.label");
    }
}
