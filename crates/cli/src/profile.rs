//! The `generate --profile` report: where the time of a generation went, by phase (load,
//! generate), by API call (prefill in total, decode per step: the end-to-end TPOT), and by
//! callable (each orchestration's runs: host time from bind to return, device time on the
//! cores). `--profile-verbose` adds a table per step and the time per layer.
//!
//! The first decode step is warm-up (first touch of the decode path's buffers and code):
//! `generate` runs it with `CallConfig::warmup`, so its report (and its trace) says so; the
//! steps whose reports say so are listed and labelled, and kept out of the averages.

use std::fmt::Write;
use std::time::Instant;

use simpler_core::RunReport;

/// One runtime step as the report needs it.
#[derive(Clone, Debug)]
pub(crate) struct Step {
    /// `prefill` or `decode`.
    pub(crate) kind: &'static str,
    /// Sequences in the step.
    pub(crate) rows: usize,
    /// Tokens computed.
    pub(crate) tokens: usize,
    /// End to end: inputs written, run, outputs read back.
    pub(crate) e2e_ns: u64,
    /// The run's report.
    pub(crate) report: RunReport,
}

impl Step {
    /// A step that started at `t` and just returned `report`.
    pub(crate) fn new(
        kind: &'static str,
        rows: usize,
        tokens: usize,
        t: Instant,
        report: &RunReport,
    ) -> Step {
        Step {
            kind,
            rows,
            tokens,
            e2e_ns: u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX),
            report: report.clone(),
        }
    }

    fn slot_ns(&self, slot: u8) -> u64 {
        self.report
            .task_slots
            .iter()
            .find(|t| t.slot == slot)
            .map_or(0, |t| t.span.dur_ns())
    }
}

/// n, total, mean, min and max of nanosecond samples, in ms.
fn stats(xs: &[u64]) -> (usize, f64, f64, f64, f64) {
    let ms = |ns: u64| ns as f64 / 1e6;
    if xs.is_empty() {
        return (0, 0.0, 0.0, 0.0, 0.0);
    }
    let total: u64 = xs.iter().sum();
    (
        xs.len(),
        ms(total),
        ms(total) / xs.len() as f64,
        ms(*xs.iter().min().unwrap_or(&0)),
        ms(*xs.iter().max().unwrap_or(&0)),
    )
}

fn row(out: &mut String, name: &str, xs: &[u64]) {
    let (n, total, avg, min, max) = stats(xs);
    let _ = writeln!(
        out,
        "  {name:<24} {n:>6} {total:>11.2} {avg:>10.3} {min:>10.3} {max:>10.3}"
    );
}

/// The report of `steps` (in the order they ran), after `load_s` of loading and `gen_s` of
/// generation, for a model of `layers` layers.
pub(crate) fn report(
    steps: &[Step],
    load_s: f64,
    gen_s: f64,
    layers: usize,
    verbose: bool,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "profile:");
    let _ = writeln!(out, "  phase                    seconds");
    let _ = writeln!(out, "  load                     {load_s:>7.3}");
    let _ = writeln!(out, "  generate                 {gen_s:>7.3}");
    let header = |out: &mut String, what: &str| {
        let _ = writeln!(
            out,
            "  {what:<24} {:>6} {:>11} {:>10} {:>10} {:>10}",
            "n", "total_ms", "avg_ms", "min_ms", "max_ms"
        );
    };
    // API: prefill in total; decode per step without the warm-up step.
    let prefill: Vec<u64> = steps
        .iter()
        .filter(|s| s.kind == "prefill")
        .map(|s| s.e2e_ns)
        .collect();
    let decode = || steps.iter().filter(|s| s.kind == "decode");
    let measured: Vec<u64> = decode()
        .filter(|s| !s.report.warmup)
        .map(|s| s.e2e_ns)
        .collect();
    let warm: Vec<u64> = decode()
        .filter(|s| s.report.warmup)
        .map(|s| s.e2e_ns)
        .collect();
    header(&mut out, "api (end to end)");
    row(&mut out, "prefill chunks", &prefill);
    let _ = writeln!(
        out,
        "  {:<24} {:>6} {:>11.2}",
        "prefill total (TTFT)",
        1,
        prefill.iter().sum::<u64>() as f64 / 1e6
    );
    if !warm.is_empty() {
        row(&mut out, "decode warm-up step", &warm);
    }
    row(&mut out, "decode per step (TPOT)", &measured);
    // Per callable: host and device time of every run (warm-up excluded).
    let mut names: Vec<&str> = steps
        .iter()
        .map(|s| s.report.orchestration.as_str())
        .collect();
    names.dedup();
    names.sort_unstable();
    names.dedup();
    header(&mut out, "callable (warm-up out)");
    let measured_steps = || steps.iter().filter(|s| !s.report.warmup);
    for name in names {
        let runs: Vec<&Step> = measured_steps()
            .filter(|s| s.report.orchestration == name)
            .collect();
        let host: Vec<u64> = runs.iter().map(|s| s.report.host_wall.dur_ns()).collect();
        let device: Vec<u64> = runs.iter().map(|s| s.report.device_wall.dur_ns()).collect();
        row(&mut out, &format!("{name} host"), &host);
        row(&mut out, &format!("{name} device"), &device);
    }
    if verbose {
        let _ = writeln!(
            out,
            "  steps: {:>5} {:>8} {:>5} {:>7} {:>9} {:>9} {:>9} {:>9} {:>11} {:>9}",
            "step",
            "kind",
            "rows",
            "tokens",
            "e2e_ms",
            "host_ms",
            "device_ms",
            "eff_ms",
            "layer_us",
            "tasks"
        );
        for (i, s) in steps.iter().enumerate() {
            let label = if s.report.warmup { " (warm-up)" } else { "" };
            let _ = writeln!(
                out,
                "         {i:>5} {:>8} {:>5} {:>7} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>11.1} {:>9}{label}",
                s.kind,
                s.rows,
                s.tokens,
                s.e2e_ns as f64 / 1e6,
                s.report.host_wall.dur_ns() as f64 / 1e6,
                s.report.device_wall.dur_ns() as f64 / 1e6,
                s.report.effective().dur_ns() as f64 / 1e6,
                s.slot_ns(1) as f64 / 1e3 / layers.max(1) as f64,
                s.report.counters.tasks
            );
        }
        // Per layer: the span of the layer tasks over the layer count (layers run one after
        // another; the span covers the first dispatch to the last finish).
        let _ = writeln!(
            out,
            "  per layer (span of the layer tasks / {layers}; input and head tasks apart), warm-up out:"
        );
        let _ = writeln!(
            out,
            "  {:<10} {:>6} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "kind", "steps", "layer_avg_us", "layer_min_us", "layer_max_us", "input_us", "head_us"
        );
        for kind in ["prefill", "decode"] {
            let ss: Vec<&Step> = measured_steps().filter(|s| s.kind == kind).collect();
            if ss.is_empty() {
                continue;
            }
            let per_layer: Vec<f64> = ss
                .iter()
                .map(|s| s.slot_ns(1) as f64 / 1e3 / layers.max(1) as f64)
                .collect();
            let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
            let input: Vec<f64> = ss.iter().map(|s| s.slot_ns(0) as f64 / 1e3).collect();
            let head: Vec<f64> = ss.iter().map(|s| s.slot_ns(2) as f64 / 1e3).collect();
            let _ = writeln!(
                out,
                "  {kind:<10} {:>6} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>12.1}",
                ss.len(),
                mean(&per_layer),
                per_layer.iter().copied().fold(f64::INFINITY, f64::min),
                per_layer.iter().copied().fold(0.0, f64::max),
                mean(&input),
                mean(&head)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::stats;

    #[test]
    fn stats_are_in_ms() {
        assert_eq!(stats(&[1_000_000, 3_000_000]), (2, 4.0, 2.0, 1.0, 3.0));
        assert_eq!(stats(&[]), (0, 0.0, 0.0, 0.0, 0.0));
    }
}
