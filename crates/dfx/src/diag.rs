//! The diagnostics files a run writes into its output directory (`swimlane.json`, `deps.json`,
//! `ring_stats.json`): writing them from a [`RunReport`] and reading them back with version checks.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use simpler_core::RunReport;
use simpler_core::clock::ClockAnchor;
use simpler_core::trace::{
    DepGraph, ProcessClock, RingStats, SwimlaneRecords, TRACE_FORMAT_VERSION,
};

pub use crate::blocks::MAX_CORES;
use crate::error::{DfxError, Result, io};

/// File name of the swimlane records in a run's output directory.
pub const SWIMLANE_FILE: &str = "swimlane.json";
/// File name of the captured dependency graph.
pub const DEPS_FILE: &str = "deps.json";
/// File name of the ring statistics.
pub const RING_STATS_FILE: &str = "ring_stats.json";

/// What to do about dropped swimlane records: the knob, as the `simpler` command line and
/// [`simpler_core::CallConfig`] spell it. Every warning about dropped records ends with it.
pub const DROPPED_RECORDS_HINT: &str = "record again with a larger --swimlane-capacity (CallConfig.swimlane_capacity; default 1048576 records per run)";

/// The line every swimlane analysis writes first into `out` when the recorder dropped
/// records: how many, what that does to this analysis's numbers (`consequence`), and the knob
/// to raise. Nothing when none were dropped.
pub fn warn_dropped(out: &mut String, dropped: u64, consequence: &str) {
    if dropped > 0 {
        use std::fmt::Write as _;
        let _ = writeln!(
            out,
            "WARNING: {dropped} swimlane records were DROPPED: {consequence}; {DROPPED_RECORDS_HINT}"
        );
    }
}

/// File name of the span trace written into an output directory when no trace file is given.
pub const TRACE_FILE: &str = "trace.jsonl";

/// Name of the directory holding step `step`'s diagnostics inside a multi-step command's
/// output directory: `step-000042` (zero-padded so that listings sort in step order).
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// Writes everything a finished run's configuration asks for: its spans to `cfg.trace` (or to
/// `trace.jsonl` in `cfg.output_dir`), and its diagnostics into `cfg.output_dir`. The runtime
/// core never writes files; callers (the CLI does it for every run) call this. Returns the
/// files written.
pub fn write_run_outputs(
    report: &RunReport,
    cfg: &simpler_core::CallConfig,
) -> Result<Vec<PathBuf>> {
    write_outputs(report, cfg, None)
}

/// [`write_run_outputs`] for one step of a command that runs many: the spans are appended to
/// the same trace file as every other step's, and the diagnostics go to
/// `cfg.output_dir/step-<step>/` ([`step_dir_name`]) so that no step overwrites another's.
/// With `diagnostics` false only the spans are written (a step the user did not ask to keep).
pub fn write_step_outputs(
    report: &RunReport,
    cfg: &simpler_core::CallConfig,
    step: u64,
    diagnostics: bool,
) -> Result<Vec<PathBuf>> {
    write_outputs(report, cfg, Some((step, diagnostics)))
}

fn write_outputs(
    report: &RunReport,
    cfg: &simpler_core::CallConfig,
    step: Option<(u64, bool)>,
) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let trace = cfg
        .trace
        .clone()
        .or_else(|| cfg.output_dir.as_ref().map(|d| d.join(TRACE_FILE)));
    if let Some(path) = trace {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io("create directory", parent))?;
        }
        let mut w = crate::TraceWriter::append(&path)?;
        w.report(report, 0)?;
        w.finish()?;
        written.push(path);
    }
    match (&cfg.output_dir, step) {
        (Some(dir), None) => written.extend(write_run_diagnostics(dir, report)?),
        (Some(dir), Some((step, true))) => {
            written.extend(write_run_diagnostics(
                &dir.join(step_dir_name(step)),
                report,
            )?);
        }
        (Some(_), Some((_, false))) | (None, _) => {}
    }
    Ok(written)
}

/// A record with a top-level `"v"` added (for the record types that have none of their own).
#[derive(Serialize)]
struct Versioned<'a, T: Serialize> {
    v: u32,
    #[serde(flatten)]
    inner: &'a T,
}

/// `swimlane.json`: the records with a `"v"`, and the writing process's anchor and `process`
/// line (host clock, rank), as in a trace file.
#[derive(Serialize)]
struct ClockedSwimlane<'a> {
    v: u32,
    anchor: ClockAnchor,
    process: ProcessClock,
    #[serde(flatten)]
    inner: &'a SwimlaneRecords,
}

/// Where a swimlane file's times lie: the anchor and `process` line of the process that wrote
/// it (both absent in files written before they were added).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct SwimlaneClock {
    /// The writing process's clock anchor.
    #[serde(default)]
    pub anchor: Option<ClockAnchor>,
    /// Its host clock and rank.
    #[serde(default)]
    pub process: Option<ProcessClock>,
}

/// Reads the [`SwimlaneClock`] of a `swimlane.json` (streaming; the records are skipped).
pub fn read_swimlane_clock(path: &Path) -> Result<SwimlaneClock> {
    let file = File::open(path).map_err(io("open", path))?;
    let clock: SwimlaneClock = serde_json::from_reader(BufReader::with_capacity(1 << 16, file))
        .map_err(|source| DfxError::Json {
            path: path.to_path_buf(),
            line: 0,
            source,
        })?;
    if let (Some(a), Some(p)) = (&clock.anchor, &clock.process)
        && a.pid != p.pid
    {
        return Err(DfxError::Invalid {
            path: path.to_path_buf(),
            line: 0,
            what: format!(
                "anchor of pid {} with a process line of pid {}",
                a.pid, p.pid
            ),
        });
    }
    Ok(clock)
}

/// Writes the diagnostics present in `report` into `dir` (created if needed): `swimlane.json`
/// when it has swimlane records, `deps.json` when it has a dependency graph, `ring_stats.json`
/// when it has ring statistics. Returns the files written.
pub fn write_run_diagnostics(dir: &Path, report: &RunReport) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    if report.swimlane.is_none() && report.deps.is_none() && report.ring_stats.is_none() {
        return Ok(written);
    }
    std::fs::create_dir_all(dir).map_err(io("create directory", dir))?;
    if let Some(s) = &report.swimlane {
        // The records' times are on this process's axis: say where it lies, so files of
        // several ranks can be merged (`SwimlaneClock`).
        written.push(write_json(
            &dir.join(SWIMLANE_FILE),
            &ClockedSwimlane {
                v: TRACE_FORMAT_VERSION,
                anchor: ClockAnchor::process(),
                process: crate::writer::this_process_clock(),
                inner: s,
            },
        )?);
    }
    if let Some(d) = &report.deps {
        written.push(write_json(&dir.join(DEPS_FILE), d)?);
    }
    if let Some(r) = &report.ring_stats {
        written.push(write_json(
            &dir.join(RING_STATS_FILE),
            &Versioned {
                v: TRACE_FORMAT_VERSION,
                inner: r,
            },
        )?);
    }
    Ok(written)
}

/// Writes any value as compact JSON to `path`.
pub fn write_json<T: Serialize + ?Sized>(path: &Path, value: &T) -> Result<PathBuf> {
    let file = File::create(path).map_err(io("create", path))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    serde_json::to_writer(&mut w, value).map_err(|source| DfxError::Json {
        path: path.into(),
        line: 0,
        source,
    })?;
    w.write_all(b"\n").map_err(io("write", path))?;
    w.flush().map_err(io("write", path))?;
    Ok(path.to_path_buf())
}

/// Reads `swimlane.json`, refusing records no run can have written: a core id or count past
/// [`MAX_CORES`], a block on a core the file's `cores` does not have, a block whose times are
/// out of order (it ends before it starts; at level 2 and above also dispatched after its start
/// or finished before its end), a task's block recorded twice, a phase or submit that ends
/// before it starts.
pub fn read_swimlane(path: &Path) -> Result<SwimlaneRecords> {
    let r: SwimlaneRecords = read_versioned(path)?;
    crate::blocks::validate(&r)
        .and_then(|()| swimlane_consistency(&r))
        .map_err(|what| DfxError::Invalid {
            path: path.to_path_buf(),
            line: 0,
            what,
        })?;
    Ok(r)
}

/// Reads `deps.json`, refusing a graph no run can have captured: two tasks with one id, an
/// edge naming a task the graph does not have, an argument naming a tensor past `tensors[]`.
/// (A cycle is refused by the analyses, which order the graph.)
pub fn read_deps(path: &Path) -> Result<DepGraph> {
    let g: DepGraph = read_versioned(path)?;
    deps_consistency(&g).map_err(|what| DfxError::Invalid {
        path: path.to_path_buf(),
        line: 0,
        what,
    })?;
    Ok(g)
}

/// Reads `ring_stats.json`, refusing statistics no run can have written: a capacity of 0, a
/// high-water mark above its capacity, a scope site on a ring the file does not list.
pub fn read_ring_stats(path: &Path) -> Result<RingStats> {
    let s: RingStats = read_versioned(path)?;
    ring_stats_consistency(&s).map_err(|what| DfxError::Invalid {
        path: path.to_path_buf(),
        line: 0,
        what,
    })?;
    Ok(s)
}

/// What makes swimlane records inconsistent, if anything (see [`read_swimlane`]). The
/// analyses take records built in memory as they are; this is for files.
fn swimlane_consistency(r: &SwimlaneRecords) -> std::result::Result<(), String> {
    let sched_times = crate::blocks::has_sched_times(r);
    let mut seen = std::collections::HashMap::with_capacity(r.tasks.len());
    for (i, b) in r.tasks.iter().enumerate() {
        let at = || {
            format!(
                "tasks[{i}] (task {} block {} on core {})",
                crate::blocks::task_name(b.task_id),
                b.block,
                b.core
            )
        };
        if b.core >= r.cores {
            return Err(format!(
                "{}: core {} is not below the file's cores = {}",
                at(),
                b.core,
                r.cores
            ));
        }
        let mut order = vec![("start", b.start, "end", b.end)];
        if sched_times {
            order.push(("dispatch", b.dispatch, "start", b.start));
            order.push(("end", b.end, "finish", b.finish));
        }
        if let Some((first, a, then, z)) = order.into_iter().find(|&(_, a, _, z)| z < a) {
            return Err(format!("{}: {then} {z} is before {first} {a}", at()));
        }
        if let Some(j) = seen.insert((b.task_id, b.block), i) {
            return Err(format!(
                "{}: the same block of the same task is also tasks[{j}]",
                at()
            ));
        }
    }
    for (i, p) in r.phases.iter().enumerate() {
        if p.core >= r.cores {
            return Err(format!(
                "phases[{i}]: core {} is not below the file's cores = {}",
                p.core, r.cores
            ));
        }
        if p.end < p.start {
            return Err(format!(
                "phases[{i}] (scheduler {} on core {}): end {} is before start {}",
                p.sched, p.core, p.end, p.start
            ));
        }
    }
    for (i, s) in r.submits.iter().enumerate() {
        if s.end < s.start {
            return Err(format!(
                "submits[{i}] (task {}): end {} is before start {}",
                crate::blocks::task_name(s.task_id),
                s.end,
                s.start
            ));
        }
    }
    Ok(())
}

/// What makes a dependency graph inconsistent, if anything (see [`read_deps`]).
fn deps_consistency(g: &DepGraph) -> std::result::Result<(), String> {
    let name = crate::blocks::task_name;
    let mut index = std::collections::HashMap::with_capacity(g.tasks.len());
    for (i, t) in g.tasks.iter().enumerate() {
        if let Some(j) = index.insert(t.id, i) {
            return Err(format!(
                "tasks[{i}]: id {} ({}) is also the id of tasks[{j}]",
                t.id,
                name(t.id)
            ));
        }
        if let Some((k, a)) = t
            .args
            .iter()
            .enumerate()
            .find(|(_, a)| a.tensor >= g.tensors.len())
        {
            return Err(format!(
                "tasks[{i}] (task {}).args[{k}]: tensor {} is not below the {} tensors of the file",
                name(t.id),
                a.tensor,
                g.tensors.len()
            ));
        }
    }
    for (i, e) in g.edges.iter().enumerate() {
        for (field, id) in [("pred", e.pred), ("succ", e.succ)] {
            if !index.contains_key(&id) {
                return Err(format!(
                    "edges[{i}]: {field} {id} ({}) is not a task of the graph",
                    name(id)
                ));
            }
        }
    }
    Ok(())
}

/// What makes ring statistics inconsistent, if anything (see [`read_ring_stats`]).
fn ring_stats_consistency(s: &RingStats) -> std::result::Result<(), String> {
    let check = |what: String, u: &simpler_core::trace::Usage| {
        if u.capacity == 0 {
            Err(format!(
                "{what}.capacity is 0 (every ring and map of a run has room)"
            ))
        } else if u.high_water > u.capacity {
            Err(format!(
                "{what}.high_water {} is above its capacity {}",
                u.high_water, u.capacity
            ))
        } else {
            Ok(())
        }
    };
    for (i, r) in s.rings.iter().enumerate() {
        check(
            format!("rings[{i}] (ring {}) task_window", r.ring),
            &r.task_window,
        )?;
        check(format!("rings[{i}] (ring {}) heap", r.ring), &r.heap)?;
        check(
            format!("rings[{i}] (ring {}) dep_pool", r.ring),
            &r.dep_pool,
        )?;
    }
    check("tensormap".into(), &s.tensormap)?;
    for (i, sc) in s.scopes.iter().enumerate() {
        if !s.rings.iter().any(|r| r.ring == sc.ring) {
            return Err(format!(
                "scopes[{i}] (site {}): ring {} is not one of the file's rings[]",
                sc.site, sc.ring
            ));
        }
    }
    Ok(())
}

/// `path` itself when it is a file; `path/name` when it is a directory.
pub fn resolve(path: &Path, name: &str) -> PathBuf {
    if path.is_dir() {
        path.join(name)
    } else {
        path.to_path_buf()
    }
}

/// The `step-*` directories of a multi-step command's output directory, in step order.
pub fn step_dirs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut steps: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name().to_str().is_some_and(|n| {
                n.strip_prefix("step-")
                    .is_some_and(|d| d.parse::<u64>().is_ok())
            })
        })
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    steps.sort();
    steps
}

/// [`resolve`], refusing to guess when `path` is the output directory of a multi-step command
/// (which keeps each step's `name` in its own `step-*` directory): the error names the steps.
pub fn locate(path: &Path, name: &str) -> Result<PathBuf> {
    let file = resolve(path, name);
    if path.is_dir() && !file.exists() {
        let steps = step_dirs(path);
        if let (Some(first), Some(last)) = (steps.first(), steps.last()) {
            return Err(DfxError::Missing(format!(
                "{} holds the diagnostics of {} steps, one directory each ({} .. {}); name the step to read, e.g. {}",
                path.display(),
                steps.len(),
                first.display(),
                last.display(),
                last.display()
            )));
        }
        let cases = case_dirs(path, name);
        if let Some(first) = cases.first() {
            let names: Vec<String> = cases.iter().map(|c| c.display().to_string()).collect();
            return Err(DfxError::Missing(format!(
                "{} holds the diagnostics of {} cases of a bench, one directory each ({}); name the case to read, e.g. {}",
                path.display(),
                cases.len(),
                names.join(", "),
                first.display()
            )));
        }
    }
    Ok(file)
}

/// The subdirectories of `dir` that hold `name` (a bench's cases: `1x256/`, `512/`, `swa/`),
/// sorted.
fn case_dirs(dir: &Path, name: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut cases: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join(name).is_file())
        .collect();
    cases.sort();
    cases
}

/// The deps file to join with a swimlane: `explicit` when given, else `deps.json` beside the
/// swimlane file when it exists.
pub fn deps_beside(swimlane: &Path, explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    let beside = swimlane.parent().unwrap_or(Path::new(".")).join(DEPS_FILE);
    beside.is_file().then_some(beside)
}

/// A swimlane joined with its dependency graph.
#[derive(Clone, Debug)]
pub struct Joined {
    /// The swimlane file read.
    pub swimlane_path: PathBuf,
    /// Its records.
    pub swimlane: SwimlaneRecords,
    /// The deps file read, if any.
    pub deps_path: Option<PathBuf>,
    /// Its graph, if any (fingerprint checked).
    pub deps: Option<DepGraph>,
}

/// Loads `swimlane.json` (`path` is the file or the run's output directory) and the deps file
/// (`deps` when given, else `deps.json` beside it when present), refusing to join them when
/// their fingerprints differ.
pub fn load_joined(path: &Path, deps: Option<&Path>) -> Result<Joined> {
    let swimlane_path = locate(path, SWIMLANE_FILE)?;
    let swimlane = read_swimlane(&swimlane_path)?;
    let deps_path = deps_beside(&swimlane_path, deps);
    let deps = match &deps_path {
        Some(dp) => {
            let d = read_deps(dp)?;
            check_fingerprints(&swimlane, &swimlane_path, &d, dp)?;
            Some(d)
        }
        None => None,
    };
    Ok(Joined {
        swimlane_path,
        swimlane,
        deps_path,
        deps,
    })
}

/// Refuses to join records whose topology fingerprints differ.
pub fn check_fingerprints(
    swimlane: &SwimlaneRecords,
    sp: &Path,
    deps: &DepGraph,
    dp: &Path,
) -> Result<()> {
    if swimlane.fingerprint != deps.fingerprint {
        return Err(DfxError::FingerprintMismatch {
            swimlane: sp.to_path_buf(),
            swimlane_fingerprint: swimlane.fingerprint.clone(),
            deps: dp.to_path_buf(),
            deps_fingerprint: deps.fingerprint.clone(),
        });
    }
    Ok(())
}

/// The top-level `"v"` of a document; every other field is skipped without being kept.
#[derive(Deserialize)]
struct VersionPeek {
    #[serde(default)]
    v: Option<serde_json::Value>,
}

/// Reads a whole-document file in two streaming passes: the first only looks for a newer
/// `"v"` (so a newer file is refused by version, not by whatever field it changed), the second
/// builds the record. Neither holds the file's text or a JSON tree of it.
fn read_versioned<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let json = |source| DfxError::Json {
        path: path.to_path_buf(),
        line: 0,
        source,
    };
    let open = || {
        File::open(path)
            .map(|f| BufReader::with_capacity(1 << 16, f))
            .map_err(io("open", path))
    };
    let peek: VersionPeek = serde_json::from_reader(open()?).map_err(json)?;
    // A `v` that is not a whole number (2.0, "2", -1) is no version this or any writer puts
    // there: refused, so that a newer file cannot pass under another spelling.
    let v = match &peek.v {
        None => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| DfxError::Invalid {
            path: path.to_path_buf(),
            line: 0,
            what: format!(
                "`v` {v} is not a format version (a whole number, now {TRACE_FORMAT_VERSION})"
            ),
        })?),
    };
    if let Some(v) = v
        && v > TRACE_FORMAT_VERSION as u64
    {
        return Err(DfxError::NewerVersion {
            path: path.to_path_buf(),
            line: 0,
            found: u32::try_from(v).unwrap_or(u32::MAX),
            supported: TRACE_FORMAT_VERSION,
        });
    }
    serde_json::from_reader(open()?).map_err(json)
}

#[cfg(test)]
mod tests {
    use simpler_core::trace::{RingUsage, Usage};

    use super::*;

    #[test]
    fn writes_only_what_is_present_and_reads_it_back() {
        let dir = std::env::temp_dir().join(format!("simpler-dfx-diag-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut report = RunReport::default();
        assert!(write_run_diagnostics(&dir, &report).unwrap().is_empty());
        report.swimlane = Some(SwimlaneRecords {
            level: 2,
            fingerprint: "f".into(),
            dropped: 3,
            ..Default::default()
        });
        report.ring_stats = Some(RingStats {
            rings: vec![RingUsage {
                ring: 0,
                task_window: Usage {
                    high_water: 5,
                    capacity: 8,
                },
                heap: Usage {
                    high_water: 0,
                    capacity: 1024,
                },
                dep_pool: Usage {
                    high_water: 0,
                    capacity: 4,
                },
            }],
            tensormap: Usage {
                high_water: 0,
                capacity: 16,
            },
            ..Default::default()
        });
        let files = write_run_diagnostics(&dir, &report).unwrap();
        assert_eq!(
            files,
            vec![dir.join(SWIMLANE_FILE), dir.join(RING_STATS_FILE)]
        );
        assert!(!dir.join(DEPS_FILE).exists());
        assert_eq!(
            read_swimlane(&resolve(&dir, SWIMLANE_FILE)).unwrap(),
            *report.swimlane.as_ref().unwrap()
        );
        assert_eq!(
            read_ring_stats(&dir.join(RING_STATS_FILE)).unwrap(),
            *report.ring_stats.as_ref().unwrap()
        );
        let text = std::fs::read_to_string(dir.join(SWIMLANE_FILE)).unwrap();
        assert!(text.starts_with("{\"v\":1,"), "{text}");
        std::fs::write(
            dir.join(DEPS_FILE),
            r#"{"v":7,"fingerprint":"","tasks":[],"tensors":[],"edges":[]}"#,
        )
        .unwrap();
        let e = read_deps(&dir.join(DEPS_FILE)).unwrap_err();
        assert!(matches!(e, DfxError::NewerVersion { found: 7, .. }), "{e}");
        // A version spelled as no writer spells one is refused, not read as an older file.
        let swimlane = text.strip_prefix("{\"v\":1,").unwrap();
        for v in ["2.0", "\"2\"", "-1", "1.5"] {
            std::fs::write(dir.join(SWIMLANE_FILE), format!("{{\"v\":{v},{swimlane}")).unwrap();
            let e = read_swimlane(&dir.join(SWIMLANE_FILE)).unwrap_err();
            assert!(
                matches!(&e, DfxError::Invalid { what, .. } if what.contains("not a format version")),
                "{v}: {e}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn steps_keep_their_own_diagnostics_and_the_directory_says_which_there_are() {
        let dir = std::env::temp_dir().join(format!("simpler-dfx-steps-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = simpler_core::CallConfig {
            output_dir: Some(dir.clone()),
            ..Default::default()
        };
        for step in 0..3u64 {
            let report = RunReport {
                inv: step,
                host_wall: simpler_core::Interval {
                    start_ns: 10,
                    end_ns: 20,
                },
                swimlane: Some(SwimlaneRecords {
                    level: 1,
                    fingerprint: format!("fp{step}"),
                    ..Default::default()
                }),
                ..Default::default()
            };
            write_step_outputs(&report, &cfg, step, step != 1).unwrap();
        }
        // Steps 0 and 2 kept their own records; step 1 was not asked for; none overwrote another.
        let fp = |step: u64| {
            read_swimlane(&dir.join(step_dir_name(step)).join(SWIMLANE_FILE))
                .unwrap()
                .fingerprint
        };
        assert_eq!((fp(0), fp(2)), ("fp0".to_string(), "fp2".to_string()));
        assert!(!dir.join(step_dir_name(1)).exists());
        assert!(!dir.join(SWIMLANE_FILE).exists());
        // The trace keeps every step.
        let trace = crate::reader::read_traces(&[dir.join(TRACE_FILE)]).unwrap();
        let invs: std::collections::BTreeSet<u64> =
            trace.spans.iter().map(|s| s.span.inv).collect();
        assert_eq!(invs.into_iter().collect::<Vec<_>>(), vec![0, 1, 2]);
        // The directory itself is refused with the steps named, not read as a missing file.
        let e = load_joined(&dir, None).unwrap_err().to_string();
        assert!(e.contains("holds the diagnostics of 2 steps"), "{e}");
        assert!(e.contains("step-000002"), "{e}");
        assert_eq!(step_dirs(&dir).len(), 2);
        load_joined(&dir.join(step_dir_name(2)), None).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fingerprint_mismatch_names_both_files() {
        let s = SwimlaneRecords {
            fingerprint: "aaaa".into(),
            ..Default::default()
        };
        let d = DepGraph {
            fingerprint: "bbbb".into(),
            ..Default::default()
        };
        let e = check_fingerprints(
            &s,
            Path::new("run/swimlane.json"),
            &d,
            Path::new("other/deps.json"),
        )
        .unwrap_err();
        let msg = e.to_string();
        for want in [
            "run/swimlane.json",
            "other/deps.json",
            "aaaa",
            "bbbb",
            "refusing",
        ] {
            assert!(msg.contains(want), "{msg}");
        }
        let d2 = DepGraph {
            fingerprint: "aaaa".into(),
            ..Default::default()
        };
        check_fingerprints(&s, Path::new("a"), &d2, Path::new("b")).unwrap();
    }

    /// Writes `value` to a file of this test process and reads it back with `read`; returns
    /// the error's text, which must name the file and hold every one of `says`.
    fn refused<T: Serialize, R: std::fmt::Debug>(
        name: &str,
        value: &T,
        read: fn(&Path) -> Result<R>,
        says: &[&str],
    ) {
        let path =
            std::env::temp_dir().join(format!("simpler-dfx-refused-{}-{name}", std::process::id()));
        write_json(&path, value).unwrap();
        let e = read(&path).unwrap_err();
        let msg = e.to_string();
        let _ = std::fs::remove_file(&path);
        assert!(
            matches!(&e, DfxError::Invalid { line: 0, path: p, .. } if *p == path),
            "{name}: {msg}"
        );
        for want in says {
            assert!(msg.contains(want), "{name}: {msg}");
        }
    }

    fn block(task_id: u64, core: u32, t: [u64; 4]) -> simpler_core::trace::TaskRecord {
        simpler_core::trace::TaskRecord {
            task_id,
            func: 7,
            class: simpler_core::EngineClass::Vector,
            core,
            block: 0,
            dispatch: t[0],
            start: t[1],
            end: t[2],
            finish: t[3],
        }
    }

    fn swimlane_of(
        level: u8,
        cores: u32,
        tasks: Vec<simpler_core::trace::TaskRecord>,
    ) -> SwimlaneRecords {
        SwimlaneRecords {
            level,
            fingerprint: "f".into(),
            cores,
            tasks,
            ..Default::default()
        }
    }

    #[test]
    fn swimlane_records_out_of_order_or_on_missing_cores_are_refused() {
        let ok = swimlane_of(
            2,
            2,
            vec![
                block(1, 0, [5, 10, 20, 25]),
                block(1 << 32, 1, [5, 10, 10, 10]),
            ],
        );
        let path = std::env::temp_dir().join(format!("simpler-dfx-ok-{}", std::process::id()));
        write_json(&path, &ok).unwrap();
        assert_eq!(read_swimlane(&path).unwrap(), ok);
        std::fs::remove_file(&path).unwrap();
        let cases: Vec<(&str, SwimlaneRecords, &[&str])> = vec![
            (
                "end-before-start",
                swimlane_of(
                    2,
                    2,
                    vec![block(1, 0, [5, 10, 20, 25]), block(2, 1, [0, 30, 29, 40])],
                ),
                &[
                    "tasks[1] (task 0:2 block 0 on core 1)",
                    "end 29 is before start 30",
                ],
            ),
            (
                "dispatched-after-start",
                swimlane_of(2, 1, vec![block(1, 0, [50, 10, 20, 25])]),
                &["tasks[0]", "start 10 is before dispatch 50"],
            ),
            (
                "finish-before-end",
                swimlane_of(3, 1, vec![block(1, 0, [5, 10, 20, 15])]),
                &["tasks[0]", "finish 15 is before end 20"],
            ),
            (
                "level-1-end-before-start",
                swimlane_of(1, 1, vec![block(1, 0, [0, 10, 9, 0])]),
                &["tasks[0]", "end 9 is before start 10"],
            ),
            (
                "cores-0",
                swimlane_of(2, 0, vec![block(1, 0, [5, 10, 20, 25])]),
                &["tasks[0]", "core 0 is not below the file's cores = 0"],
            ),
            (
                "fewer-cores",
                swimlane_of(
                    2,
                    1,
                    vec![block(1, 0, [5, 10, 20, 25]), block(2, 1, [5, 10, 20, 25])],
                ),
                &["tasks[1]", "core 1 is not below the file's cores = 1"],
            ),
            (
                "same-block-twice",
                swimlane_of(
                    2,
                    2,
                    vec![block(1, 0, [5, 10, 20, 25]), block(1, 1, [5, 10, 20, 25])],
                ),
                &["tasks[1] (task 0:1 block 0 on core 1)", "also tasks[0]"],
            ),
        ];
        for (name, records, says) in cases {
            refused(name, &records, read_swimlane, says);
        }
        let mut phase = ok.clone();
        phase.level = 3;
        phase.phases.push(simpler_core::trace::PhaseRecord {
            sched: 1,
            core: 1,
            phase: simpler_core::trace::SchedPhase::Idle,
            start: 9,
            end: 8,
        });
        refused(
            "phase",
            &phase,
            read_swimlane,
            &["phases[0]", "end 8 is before start 9"],
        );
        phase.phases[0].core = 2;
        refused(
            "phase-core",
            &phase,
            read_swimlane,
            &["phases[0]", "core 2 is not below"],
        );
        let mut submit = ok.clone();
        submit.level = 4;
        submit.submits.push(simpler_core::trace::SubmitRecord {
            task_id: 1,
            start: 4,
            end: 3,
        });
        refused(
            "submit",
            &submit,
            read_swimlane,
            &["submits[0] (task 0:1)", "end 3 is before start 4"],
        );
    }

    fn graph() -> DepGraph {
        use simpler_core::trace::{
            ArgRecord, EdgeRecord, EdgeSource, OverlapKind, ScopeKindRecord, TaskNode, TensorNode,
        };
        let task = |id: u64| TaskNode {
            id,
            scope: ScopeKindRecord::Auto,
            scope_depth: 0,
            kernel: 7,
            kernel_name: "k".into(),
            block_num: 1,
            args: vec![ArgRecord {
                tag: "output".into(),
                tensor: 0,
                offset: 0,
                shape: vec![4],
                strides: vec![1],
            }],
        };
        DepGraph {
            v: 1,
            fingerprint: "f".into(),
            tasks: vec![task(0), task(1), task(1 << 32)],
            tensors: vec![TensorNode {
                buffer: 1,
                version: 0,
                dtype: simpler_core::DType::F32,
                size: 16,
            }],
            edges: [(0, 1), (1, 1 << 32)]
                .map(|(pred, succ)| EdgeRecord {
                    pred,
                    succ,
                    source: EdgeSource::Tensormap,
                    overlap: OverlapKind::Covers,
                })
                .to_vec(),
        }
    }

    #[test]
    fn graphs_with_unknown_or_repeated_tasks_or_tensors_are_refused() {
        let ok = graph();
        let path = std::env::temp_dir().join(format!("simpler-dfx-okg-{}", std::process::id()));
        write_json(&path, &ok).unwrap();
        assert_eq!(read_deps(&path).unwrap(), ok);
        std::fs::remove_file(&path).unwrap();
        let mut edge = ok.clone();
        edge.edges[1].succ = 99;
        refused(
            "edge-succ",
            &edge,
            read_deps,
            &["edges[1]: succ 99 (0:99) is not a task of the graph"],
        );
        let mut edge = ok.clone();
        edge.edges[0].pred = 5 << 32;
        refused(
            "edge-pred",
            &edge,
            read_deps,
            &["edges[0]: pred 21474836480 (5:0) is not a task"],
        );
        let mut tensor = ok.clone();
        tensor.tasks[2].args[0].tensor = 1;
        refused(
            "tensor",
            &tensor,
            read_deps,
            &["tasks[2] (task 1:0).args[0]: tensor 1 is not below the 1 tensors"],
        );
        let mut dup = ok.clone();
        dup.tasks[2].id = 0;
        refused(
            "dup",
            &dup,
            read_deps,
            &["tasks[2]: id 0 (0:0) is also the id of tasks[0]"],
        );
    }

    #[test]
    fn ring_stats_past_their_capacity_are_refused() {
        use simpler_core::trace::{RingUsage, ScopeSiteUsage, Usage};
        let u = |high_water, capacity| Usage {
            high_water,
            capacity,
        };
        let ok = RingStats {
            rings: vec![RingUsage {
                ring: 0,
                task_window: u(3, 16383),
                heap: u(1024, 1 << 28),
                dep_pool: u(16384, 16384),
            }],
            tensormap: u(32, 65536),
            scopes: vec![ScopeSiteUsage {
                site: "a.rs:1".into(),
                ring: 0,
                ..Default::default()
            }],
        };
        let path = std::env::temp_dir().join(format!("simpler-dfx-okr-{}", std::process::id()));
        write_json(&path, &ok).unwrap();
        assert_eq!(read_ring_stats(&path).unwrap(), ok);
        std::fs::remove_file(&path).unwrap();
        let mut cap0 = ok.clone();
        cap0.rings[0].heap = u(0, 0);
        refused(
            "cap0",
            &cap0,
            read_ring_stats,
            &["rings[0] (ring 0) heap.capacity is 0"],
        );
        let mut map0 = ok.clone();
        map0.tensormap = u(2, 0);
        refused("map0", &map0, read_ring_stats, &["tensormap.capacity is 0"]);
        let mut hw = ok.clone();
        hw.rings[0].task_window = u(1_000_000_000_000_000_000, 16383);
        refused(
            "hw",
            &hw,
            read_ring_stats,
            &[
                "rings[0] (ring 0) task_window.high_water 1000000000000000000 is above its capacity 16383",
            ],
        );
        let mut site = ok.clone();
        site.scopes[0].ring = 2;
        refused(
            "site",
            &site,
            read_ring_stats,
            &["scopes[0] (site a.rs:1): ring 2 is not one of the file's rings[]"],
        );
    }
}
