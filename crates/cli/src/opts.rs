//! Options shared by every `simpler run ...` (and the benchmarks): cores, ring sizes, mode and
//! the diagnostics switches; and what to do with a finished run's report.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use simpler_core::{CallConfig, OrchMode, RingValue, RunReport, RuntimeEnv, Worker, WorkerConfig};
use simpler_cpu::CpuPlatform;

/// Runtime and diagnostics options.
#[derive(Args, Debug, Clone)]
pub(crate) struct RunOpts {
    /// Cores (threads) of the CPU platform [default: available parallelism].
    #[arg(long)]
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
}

impl RunOpts {
    pub(crate) fn call_config(&self, label: &str) -> Result<CallConfig> {
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
            ..CallConfig::default()
        };
        cfg.check().map_err(|e| {
            anyhow::anyhow!("{} = {}: {}", flag_of_field(&e.field), e.value, e.reason)
        })?;
        Ok(cfg)
    }

    pub(crate) fn worker(&self) -> Result<Worker> {
        let w = Worker::new(
            CpuPlatform::new(),
            WorkerConfig {
                cores: self.cores,
                timeouts: None,
            },
        )
        .context("starting the CPU worker")?;
        for warning in w.warnings() {
            eprintln!("warning: {warning}");
        }
        Ok(w)
    }
}

/// The command-line flag that sets a `CallConfig` field (`CallConfig.output_dir` ->
/// `--output-dir`, `CallConfig.runtime_env.ring_heap[2]` -> `--ring-heap (ring 2)`); fields
/// no flag sets keep their name.
fn flag_of_field(field: &str) -> String {
    let Some(rest) = field.strip_prefix("CallConfig.") else {
        return field.to_string();
    };
    let rest = rest.strip_prefix("runtime_env.").unwrap_or(rest);
    let (name, ring) = match rest.split_once('[') {
        Some((n, r)) => (n, Some(r.trim_end_matches(']'))),
        None => (rest, None),
    };
    const FLAGS: [&str; 7] = [
        "ring_task_window",
        "ring_heap",
        "ring_dep_pool",
        "swimlane",
        "output_dir",
        "dep_gen",
        "ring_stats",
    ];
    if !FLAGS.contains(&name) {
        return field.to_string();
    }
    let flag = format!("--{}", name.replace('_', "-"));
    match ring {
        Some(r) => format!("{flag} (ring {r})"),
        None => flag,
    }
}

/// Writes the report's spans and diagnostics where the configuration says.
pub(crate) fn emit(report: &RunReport, cfg: &CallConfig) -> Result<()> {
    for p in simpler_dfx::write_run_outputs(report, cfg)? {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
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
    use super::flag_of_field;

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
            "CallConfig.tensormap_capacity"
        );
    }
}
