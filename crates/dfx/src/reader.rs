//! Reads trace files and merges them onto one wall-clock axis.
//!
//! Every writer starts with its process's clock anchor, and (since the node level) a `process`
//! line giving the process's zero on its host's `CLOCK_MONOTONIC` and its rank. Processes of
//! one host (one boot id) are placed through that shared clock onto the axis of the first of
//! them, exactly up to the stated read uncertainties; a process without a `process` line (or
//! the first of another host) is placed by its wall-clock anchor. A process of another host
//! whose `process` line carries a clock offset to rank 0's host (an `mpirun` rank, measured
//! by round trips at start-up) is placed on that host's clock through the offset, so the ranks
//! of several hosts share one axis too. A span's host timestamp plus
//! its process's place gives wall time, so spans of several processes (and files) line up.
//! Device spans of an invocation with a `device_alignment` line are mapped through it onto the
//! host axis first. Lines with a format version newer than [`TRACE_FORMAT_VERSION`] are refused with
//! the file and line named.
//!
//! Files are streamed line by line (a trace of many steps is never held whole), a line longer
//! than [`MAX_LINE_BYTES`] is refused rather than buffered, a span whose `ts_ns + dur_ns`
//! overflows is refused with its line, and every other timestamp sum saturates: a file may hold
//! any value, and a bad one gives an error or a clamped time, never a panic. [`read_spans`]
//! also refuses files without any span, for the tools that report on them.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use simpler_core::clock::ClockAnchor;
use simpler_core::trace::{
    Clock, DeviceClockAlignment, ProcessClock, SpanRecord, TRACE_FORMAT_VERSION, TraceLine,
};

use crate::error::{DfxError, Result, io};

/// One process instance seen in the files: a pid together with the anchor it wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessInfo {
    /// Process id.
    pub pid: u32,
    /// Its clock anchor.
    pub anchor: ClockAnchor,
    /// File the anchor came from.
    pub file: PathBuf,
    /// Its `process` line (host clock, rank), if it wrote one.
    pub clock: Option<ProcessClock>,
    /// Wall-clock ns of its monotonic zero on the merged axis.
    pub zero_wall_ns: i128,
    /// How its axis was placed on the merged one.
    pub alignment: ClockAlignment,
}

impl ProcessInfo {
    /// Its rank, if its `process` line named one.
    pub fn rank(&self) -> Option<u32> {
        self.clock.as_ref().and_then(|c| c.rank)
    }

    /// `rank 1 (chip 1, pid 4242)`, or `pid 4242` for a process that named no rank.
    pub fn display_name(&self) -> String {
        let role = self.clock.as_ref().and_then(|c| c.role.as_deref());
        match (self.rank(), role) {
            (Some(r), Some(role)) => format!("rank {r} ({role}, pid {})", self.pid),
            (Some(r), None) => format!("rank {r} (pid {})", self.pid),
            (None, Some(role)) => format!("{role} (pid {})", self.pid),
            (None, None) => format!("pid {}", self.pid),
        }
    }
}

/// How a process's axis was placed on the merged axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockAlignment {
    /// Through its host's monotonic clock, onto the axis of process `reference` (the first
    /// process of the same boot id; itself for that one), within `uncertainty_ns`.
    Monotonic {
        /// Index into [`Trace::processes`].
        reference: usize,
        /// Half-width of the interval holding the true offset to `reference`.
        uncertainty_ns: u64,
    },
    /// Through the clock offset its `process` line gives to another host's monotonic clock
    /// (measured at start-up by round trips to rank 0), then that clock, onto the axis of
    /// process `reference` (the first process placed on that host's clock).
    Measured {
        /// Index into [`Trace::processes`].
        reference: usize,
        /// Half-width of the interval holding the true offset to `reference`: the read
        /// uncertainties and the offset's own.
        uncertainty_ns: u64,
    },
    /// By its own wall-clock anchor (no `process` line, or the reference of another host):
    /// as good as the wall clocks' agreement, which the files cannot tell.
    Wall,
}

impl ClockAlignment {
    /// The process whose axis it was placed on, and the uncertainty of that placement; `None`
    /// for [`ClockAlignment::Wall`].
    pub fn reference(&self) -> Option<(usize, u64)> {
        match *self {
            ClockAlignment::Monotonic {
                reference,
                uncertainty_ns,
            }
            | ClockAlignment::Measured {
                reference,
                uncertainty_ns,
            } => Some((reference, uncertainty_ns)),
            ClockAlignment::Wall => None,
        }
    }
}

/// How a span's start was placed on the wall-clock axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// A host span: its process's zero on the merged axis + `ts_ns`.
    Host,
    /// A device span mapped through its invocation's alignment, within `uncertainty_ns`.
    Device {
        /// Half-width of the alignment's uncertainty.
        uncertainty_ns: u64,
    },
    /// A device span without an alignment line: taken as already on the host axis.
    DeviceUnaligned,
}

/// A span with its place on the merged axis.
#[derive(Clone, Debug, PartialEq)]
pub struct AlignedSpan {
    /// The record as read.
    pub span: SpanRecord,
    /// Index into [`Trace::processes`].
    pub process: usize,
    /// Start in wall-clock nanoseconds since the Unix epoch.
    pub wall_ns: u64,
    /// How `wall_ns` was obtained.
    pub placement: Placement,
    /// Start on its process's axis (device spans mapped onto it); `wall_ns` is this plus the
    /// process's `zero_wall_ns`.
    host_ns: i128,
}

impl AlignedSpan {
    /// End in wall-clock nanoseconds (saturating: a file may hold any duration).
    pub fn wall_end_ns(&self) -> u64 {
        self.wall_ns.saturating_add(self.span.dur_ns)
    }
}

/// Spans of one or more trace files, merged.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// Files read, in order.
    pub files: Vec<PathBuf>,
    /// Process instances, in order of their anchors.
    pub processes: Vec<ProcessInfo>,
    /// Spans in file and line order.
    pub spans: Vec<AlignedSpan>,
    /// Every span read so far by its identity (`span_identity`), to refuse one read twice;
    /// kept across files, so each file adds its own spans only. (Two different spans with one
    /// 64-bit identity keep only the first: a later copy of the second is not caught.)
    seen: HashMap<u64, usize>,
}

impl Trace {
    /// Earliest span start (wall ns), or 0 without spans.
    pub fn origin_wall_ns(&self) -> u64 {
        self.spans.iter().map(|s| s.wall_ns).min().unwrap_or(0)
    }

    /// Device spans that had no alignment line.
    pub fn unaligned_device_spans(&self) -> usize {
        self.spans
            .iter()
            .filter(|s| s.placement == Placement::DeviceUnaligned)
            .count()
    }
}

/// Longest trace line accepted (a span with its attributes is a few hundred bytes).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Reads and merges trace files, streaming each one line by line.
pub fn read_traces<P: AsRef<Path>>(paths: &[P]) -> Result<Trace> {
    let mut trace = Trace::default();
    for p in paths {
        let path = p.as_ref();
        let file = File::open(path).map_err(io("open", path))?;
        parse_reader(&mut trace, BufReader::with_capacity(1 << 16, file), path)?;
    }
    Ok(trace)
}

/// [`read_traces`] for the tools that report on spans: files that hold no span at all (empty,
/// or only anchor and `process` lines) are refused with an error naming them, so that no tool
/// prints an empty report and succeeds.
pub fn read_spans<P: AsRef<Path>>(paths: &[P]) -> Result<Trace> {
    let trace = read_traces(paths)?;
    if trace.spans.is_empty() {
        let names: Vec<String> = paths
            .iter()
            .map(|p| p.as_ref().display().to_string())
            .collect();
        return Err(DfxError::Missing(match &names[..] {
            [one] => format!(
                "{one}: no span lines (the file is empty, or holds only anchor and process lines): nothing to report"
            ),
            _ => format!(
                "{}: no span lines in any of these {} files (each is empty, or holds only anchor and process lines): nothing to report",
                names.join(", "),
                names.len()
            ),
        }));
    }
    Ok(trace)
}

/// Parses the text of one trace file into `trace` (files may be added one after another).
pub fn parse_into(trace: &mut Trace, text: &str, path: &Path) -> Result<()> {
    parse_reader(trace, text.as_bytes(), path)
}

/// Parses one trace file from `input` into `trace`, one line at a time.
pub fn parse_reader<R: BufRead>(trace: &mut Trace, mut input: R, path: &Path) -> Result<()> {
    trace.files.push(path.to_path_buf());
    // Process instance by (pid, wall_ns) of its anchor, over every file read so far.
    let mut known: HashMap<(u32, u64), usize> = trace
        .processes
        .iter()
        .enumerate()
        .map(|(i, p)| ((p.anchor.pid, p.anchor.wall_ns), i))
        .collect();
    // Current process instance of each pid in this file.
    let mut current: HashMap<u32, usize> = HashMap::new();
    let mut alignments: HashMap<(usize, u64), DeviceClockAlignment> = HashMap::new();
    let first_span = trace.spans.len();
    let invalid = |line: usize, what: String| DfxError::Invalid {
        path: path.to_path_buf(),
        line,
        what,
    };
    let mut buf = Vec::new();
    let mut line_no = 0;
    loop {
        buf.clear();
        let n = (&mut input)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(io("read", path))?;
        if n == 0 {
            break;
        }
        line_no += 1;
        if buf.len() > MAX_LINE_BYTES {
            return Err(invalid(
                line_no,
                format!("line longer than {MAX_LINE_BYTES} bytes (not a trace file?)"),
            ));
        }
        let raw = std::str::from_utf8(&buf)
            .map_err(|e| invalid(line_no, format!("not UTF-8 text ({e})")))?;
        if raw.trim().is_empty() {
            continue;
        }
        match parse_line(raw, path, line_no)? {
            TraceLine::Anchor(anchor) => {
                // The same process appending again (same pid and anchor) stays one process.
                let idx = *known
                    .entry((anchor.pid, anchor.wall_ns))
                    .or_insert_with(|| {
                        trace.processes.push(ProcessInfo {
                            pid: anchor.pid,
                            anchor,
                            file: path.to_path_buf(),
                            clock: None,
                            zero_wall_ns: anchor.wall_ns as i128,
                            alignment: ClockAlignment::Wall,
                        });
                        trace.processes.len() - 1
                    });
                current.insert(anchor.pid, idx);
            }
            TraceLine::Process(clock) => {
                let process = *current
                    .get(&clock.pid)
                    .ok_or_else(|| DfxError::MissingAnchor {
                        path: path.to_path_buf(),
                        line: line_no,
                        pid: clock.pid,
                    })?;
                if let Some(why) = refused_rank(&clock) {
                    return Err(invalid(line_no, why));
                }
                match &trace.processes[process].clock {
                    Some(known) if *known != clock => {
                        return Err(invalid(
                            line_no,
                            format!(
                                "a second, different process line for pid {} under one anchor",
                                clock.pid
                            ),
                        ));
                    }
                    _ => trace.processes[process].clock = Some(clock),
                }
            }
            TraceLine::Span(span) => {
                if span.ts_ns.checked_add(span.dur_ns).is_none() {
                    return Err(invalid(
                        line_no,
                        format!(
                            "span {:?}: ts_ns {} + dur_ns {} overflows u64 (it would end after the end of the clock)",
                            span.name, span.ts_ns, span.dur_ns
                        ),
                    ));
                }
                let process = *current
                    .get(&span.pid)
                    .ok_or_else(|| DfxError::MissingAnchor {
                        path: path.to_path_buf(),
                        line: line_no,
                        pid: span.pid,
                    })?;
                let placement = match span.clock {
                    Clock::Host => Placement::Host,
                    Clock::Device => Placement::DeviceUnaligned,
                };
                let id = span_identity(process, &span);
                // `spans` is public: an index the caller's edits made stale is just replaced.
                let earlier = trace.seen.get(&id).and_then(|&i| trace.spans.get(i));
                match earlier {
                    Some(e) if e.process == process && e.span == span => {
                        return Err(invalid(
                            line_no,
                            format!(
                                "span {:?} of pid {} (inv {}, ts_ns {}) was already read: the same file (or a copy of it) given twice, or a line repeated; every tool would count it twice",
                                span.name, span.pid, span.inv, span.ts_ns
                            ),
                        ));
                    }
                    Some(e) if span_identity(e.process, &e.span) == id => {}
                    _ => {
                        trace.seen.insert(id, trace.spans.len());
                    }
                }
                trace.spans.push(AlignedSpan {
                    span,
                    process,
                    wall_ns: 0,
                    placement,
                    host_ns: 0,
                });
            }
            TraceLine::DeviceAlignment {
                pid,
                inv,
                alignment,
            } => {
                let process = *current.get(&pid).ok_or_else(|| DfxError::MissingAnchor {
                    path: path.to_path_buf(),
                    line: line_no,
                    pid,
                })?;
                alignments.insert((process, inv), alignment);
            }
        }
    }
    for s in &mut trace.spans[first_span..] {
        s.host_ns = match s.span.clock {
            Clock::Host => s.span.ts_ns as i128,
            Clock::Device => match alignments.get(&(s.process, s.span.inv)) {
                Some(a) => {
                    s.placement = Placement::Device {
                        uncertainty_ns: a.uncertainty_ns,
                    };
                    a.host_ns as i128 + s.span.ts_ns as i128 - a.device_ns as i128
                }
                None => s.span.ts_ns as i128,
            },
        };
    }
    // A later file may add a process of an earlier one's host: place everything again.
    align(trace);
    Ok(())
}

/// A hash of what makes a span itself: its process instance and every field of the record
/// but the attributes. A writer never writes one record twice (a thread's spans of one name
/// and depth start at different times, or differ in attributes, which the equality check
/// after a hash match compares), so a span read again is a file read twice or a line copied.
fn span_identity(process: usize, s: &SpanRecord) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (process, s.pid, s.tid, s.inv, s.depth, &s.name, &s.callable).hash(&mut h);
    (s.ts_ns, s.dur_ns, s.clock == Clock::Host).hash(&mut h);
    h.finish()
}

/// Most ranks a `process` line may name (a bound for the tables built per rank).
pub const MAX_RANKS: u32 = 1 << 16;

/// Why a `process` line's rank fields are refused, if they are.
fn refused_rank(c: &ProcessClock) -> Option<String> {
    match (c.rank, c.ranks) {
        (_, Some(n)) if n == 0 || n > MAX_RANKS => {
            Some(format!("ranks {n} is not between 1 and {MAX_RANKS}"))
        }
        (Some(r), Some(n)) if r >= n => Some(format!("rank {r} is not below ranks {n}")),
        (Some(r), None) if r >= MAX_RANKS => Some(format!("rank {r} is not below {MAX_RANKS}")),
        _ => None,
    }
}

/// A process's zero on a host's monotonic clock: that host's boot id, the zero on its clock
/// (ns), the uncertainty, and whether a measured offset put it there. A process's own host,
/// unless its `process` line carries an offset to another host's clock (a clock offset to its
/// own host is a measurement of zero, and the shared clock is exact).
fn host_clock(c: &ProcessClock) -> Option<(&str, i128, u64, bool)> {
    match &c.clock_offset {
        Some(o) if !o.reference_boot_id.is_empty() && o.reference_boot_id != c.boot_id => Some((
            o.reference_boot_id.as_str(),
            c.mono_ns as i128 - o.offset_ns as i128,
            c.uncertainty_ns.saturating_add(o.uncertainty_ns),
            true,
        )),
        _ if c.boot_id.is_empty() => None,
        _ => Some((
            c.boot_id.as_str(),
            c.mono_ns as i128,
            c.uncertainty_ns,
            false,
        )),
    }
}

/// Places every process's axis on the merged one (see the module header) and every span on it.
fn align(trace: &mut Trace) {
    // Per host clock (boot id): the first process placed on it, its zero there and uncertainty.
    let mut reference: HashMap<String, (usize, i128, u64)> = HashMap::new();
    for i in 0..trace.processes.len() {
        let p = &trace.processes[i];
        let (zero, alignment) = match p.clock.as_ref().and_then(host_clock) {
            Some((boot, mono, uncertainty, measured)) => {
                let &mut (r, ref_mono, ref_uncertainty) = reference
                    .entry(boot.to_string())
                    .or_insert((i, mono, uncertainty));
                let uncertainty_ns = if r == i {
                    0
                } else {
                    uncertainty.saturating_add(ref_uncertainty)
                };
                let zero = trace.processes[r].anchor.wall_ns as i128 + mono - ref_mono;
                let alignment = if measured {
                    ClockAlignment::Measured {
                        reference: r,
                        uncertainty_ns,
                    }
                } else {
                    ClockAlignment::Monotonic {
                        reference: r,
                        uncertainty_ns,
                    }
                };
                (zero, alignment)
            }
            None => (p.anchor.wall_ns as i128, ClockAlignment::Wall),
        };
        let p = &mut trace.processes[i];
        p.zero_wall_ns = zero;
        p.alignment = alignment;
    }
    for s in &mut trace.spans {
        let zero = trace.processes[s.process].zero_wall_ns;
        s.wall_ns = (zero + s.host_ns).clamp(0, u64::MAX as i128) as u64;
    }
}

impl Trace {
    /// Adds a process known from another kind of file (a swimlane file's anchor and `process`
    /// line) and places every process again; returns its index. A `process` line whose rank
    /// fields are impossible is refused, naming `file`.
    pub fn add_process(
        &mut self,
        anchor: ClockAnchor,
        clock: Option<ProcessClock>,
        file: &Path,
    ) -> Result<usize> {
        if let Some(why) = clock.as_ref().and_then(refused_rank) {
            return Err(DfxError::Invalid {
                path: file.to_path_buf(),
                line: 0,
                what: why,
            });
        }
        self.processes.push(ProcessInfo {
            pid: anchor.pid,
            anchor,
            file: file.to_path_buf(),
            clock,
            zero_wall_ns: anchor.wall_ns as i128,
            alignment: ClockAlignment::Wall,
        });
        align(self);
        Ok(self.processes.len() - 1)
    }

    /// How the processes' clocks were aligned, and how well, in a few lines: per host (boot
    /// id), how many processes share its monotonic clock, the largest uncertainty of that
    /// alignment, and how far their wall-clock anchors disagree with it (what a merge by wall
    /// clock alone would have been off by); then the processes placed by wall clock only.
    /// Empty for a single process.
    pub fn clock_summary(&self) -> String {
        let mut out = String::new();
        if self.processes.len() < 2 {
            return out;
        }
        let mut hosts: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut wall_only = 0;
        for (i, p) in self.processes.iter().enumerate() {
            match p.alignment.reference() {
                Some((reference, _)) => match hosts.iter_mut().find(|(r, _)| *r == reference) {
                    Some((_, members)) => members.push(i),
                    None => hosts.push((reference, vec![i])),
                },
                None => wall_only += 1,
            }
        }
        for (r, members) in &hosts {
            let boot = self.processes[*r]
                .clock
                .as_ref()
                .and_then(host_clock)
                .map_or("", |(boot, ..)| boot);
            let worst = members
                .iter()
                .filter_map(|&i| self.processes[i].alignment.reference())
                .map(|(_, uncertainty_ns)| uncertainty_ns)
                .max()
                .unwrap_or(0);
            let measured = members
                .iter()
                .filter(|&&i| {
                    matches!(self.processes[i].alignment, ClockAlignment::Measured { .. })
                })
                .count();
            let wall_gap = members
                .iter()
                .map(|&i| {
                    let p = &self.processes[i];
                    (p.anchor.wall_ns as i128 - p.zero_wall_ns).unsigned_abs()
                })
                .max()
                .unwrap_or(0);
            let through = if measured > 0 {
                format!(
                    " ({measured} of them from other hosts, through the clock offsets they measured to rank 0)"
                )
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "clocks: {} processes of host boot {} aligned on its CLOCK_MONOTONIC{through} within ±{} ns (their wall-clock anchors are off that by up to {:.1} µs)",
                members.len(),
                boot.get(..8).unwrap_or(boot),
                worst,
                wall_gap as f64 / 1e3
            );
        }
        if hosts.len() > 1 {
            let _ = writeln!(
                out,
                "clocks: the {} hosts are placed against each other by their first processes' wall clocks (as good as the hosts' clock synchronisation)",
                hosts.len()
            );
        }
        if wall_only > 0 {
            let _ = writeln!(
                out,
                "clocks: {wall_only} processes wrote no process line and are placed by their wall-clock anchors only"
            );
        }
        out
    }
}

/// Just the version of a line, to explain a line that does not parse.
#[derive(Deserialize)]
struct VersionPeek {
    #[serde(default)]
    v: Option<u32>,
}

fn parse_line(raw: &str, path: &Path, line: usize) -> Result<TraceLine> {
    let newer = |found: u32| DfxError::NewerVersion {
        path: path.to_path_buf(),
        line,
        found,
        supported: TRACE_FORMAT_VERSION,
    };
    match serde_json::from_str::<TraceLine>(raw) {
        Ok(TraceLine::Span(s)) if s.v > TRACE_FORMAT_VERSION => Err(newer(s.v)),
        Ok(l) => Ok(l),
        Err(source) => match serde_json::from_str::<VersionPeek>(raw) {
            Ok(VersionPeek { v: Some(v) }) if v > TRACE_FORMAT_VERSION => Err(newer(v)),
            _ => Err(DfxError::Json {
                path: path.to_path_buf(),
                line,
                source,
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Trace> {
        let mut t = Trace::default();
        parse_into(&mut t, text, Path::new("x.jsonl"))?;
        Ok(t)
    }

    #[test]
    fn newer_version_is_refused_with_file_and_line() {
        let text = concat!(
            r#"{"kind":"anchor","pid":1,"wall_ns":100}"#,
            "\n",
            r#"{"kind":"span","v":99,"pid":1,"tid":0,"inv":0,"callable":"a","depth":0,"name":"run","ts_ns":0,"dur_ns":1,"clock":"host"}"#
        );
        let e = parse(text).unwrap_err();
        assert!(
            matches!(
                e,
                DfxError::NewerVersion {
                    line: 2,
                    found: 99,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("x.jsonl:2"), "{e}");
        // An unknown line kind from a newer version is refused the same way.
        let text = "{\"kind\":\"anchor\",\"pid\":1,\"wall_ns\":1}\n{\"kind\":\"gauge\",\"v\":2}";
        assert!(matches!(
            parse(text).unwrap_err(),
            DfxError::NewerVersion {
                line: 2,
                found: 2,
                ..
            }
        ));
        // A broken line of the current version is a JSON error with its line.
        let e = parse("{\"kind\":\"anchor\",\"pid\":1,\"wall_ns\":1}\n\n{oops").unwrap_err();
        assert!(matches!(e, DfxError::Json { line: 3, .. }), "{e}");
    }

    #[test]
    fn a_process_appending_twice_stays_one_process() {
        let a = r#"{"kind":"anchor","pid":1,"wall_ns":100}"#;
        let b = r#"{"kind":"anchor","pid":1,"wall_ns":999}"#;
        let span = r#"{"kind":"span","v":1,"pid":1,"tid":0,"inv":0,"callable":"a","depth":0,"name":"run","ts_ns":5,"dur_ns":1,"clock":"host"}"#;
        let next = r#"{"kind":"span","v":1,"pid":1,"tid":0,"inv":1,"callable":"a","depth":0,"name":"run","ts_ns":5,"dur_ns":1,"clock":"host"}"#;
        let t = parse(&[a, span, a, next, b, span].join("\n")).unwrap();
        assert_eq!(t.processes.len(), 2);
        assert_eq!(
            t.spans
                .iter()
                .map(|s| (s.process, s.wall_ns))
                .collect::<Vec<_>>(),
            vec![(0, 105), (0, 105), (1, 1004)]
        );
        // The same span again under the same process is a span read twice.
        let e = parse(&[a, span, a, span].join("\n")).unwrap_err();
        assert!(matches!(e, DfxError::Invalid { line: 4, .. }), "{e}");
    }

    #[test]
    fn span_without_anchor_is_an_error() {
        let text = r#"{"kind":"span","v":1,"pid":1,"tid":0,"inv":0,"callable":"a","depth":0,"name":"run","ts_ns":0,"dur_ns":1,"clock":"host"}"#;
        assert!(matches!(
            parse(text).unwrap_err(),
            DfxError::MissingAnchor {
                line: 1,
                pid: 1,
                ..
            }
        ));
    }

    #[test]
    fn device_spans_are_mapped_through_their_alignment() {
        let text = concat!(
            r#"{"kind":"anchor","pid":1,"wall_ns":1000}"#,
            "\n",
            r#"{"kind":"span","v":1,"pid":1,"tid":0,"inv":3,"callable":"a","depth":1,"name":"k","ts_ns":5000,"dur_ns":10,"clock":"device"}"#,
            "\n",
            r#"{"kind":"span","v":1,"pid":1,"tid":0,"inv":4,"callable":"a","depth":1,"name":"k","ts_ns":70,"dur_ns":10,"clock":"device"}"#,
            "\n",
            r#"{"kind":"device_alignment","pid":1,"inv":3,"alignment":{"device_ns":4000,"host_ns":50,"uncertainty_ns":7}}"#
        );
        let t = parse(text).unwrap();
        assert_eq!(t.spans[0].wall_ns, 1000 + 50 + 1000);
        assert_eq!(
            t.spans[0].placement,
            Placement::Device { uncertainty_ns: 7 }
        );
        assert_eq!(t.spans[1].wall_ns, 1070);
        assert_eq!(t.unaligned_device_spans(), 1);
    }

    #[test]
    fn a_span_ending_past_the_clock_is_refused_with_its_line() {
        let anchor = r#"{"kind":"anchor","pid":1,"wall_ns":100}"#;
        let span = |ts: u64, dur: u64| {
            format!(
                r#"{{"kind":"span","v":1,"pid":1,"tid":0,"inv":0,"callable":"a","depth":0,"name":"run","ts_ns":{ts},"dur_ns":{dur},"clock":"host"}}"#
            )
        };
        let e = parse(&[anchor, &span(5, 1), &span(1572, u64::MAX)].join("\n")).unwrap_err();
        assert!(matches!(e, DfxError::Invalid { line: 3, .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("x.jsonl:3")
                && msg.contains("ts_ns 1572 + dur_ns 18446744073709551615 overflows u64"),
            "{msg}"
        );
        // Up to the last nanosecond of the clock is a span like any other.
        let t = parse(&[anchor, &span(1, u64::MAX - 1), &span(u64::MAX, 0)].join("\n")).unwrap();
        assert_eq!(t.spans.len(), 2);
    }

    #[test]
    fn files_without_spans_are_refused_by_the_span_reader_naming_them() {
        let dir = std::env::temp_dir().join(format!("simpler-dfx-nospans-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (empty, anchored) = (dir.join("empty.jsonl"), dir.join("anchored.jsonl"));
        std::fs::write(&empty, "").unwrap();
        std::fs::write(
            &anchored,
            "{\"kind\":\"anchor\",\"pid\":1,\"wall_ns\":100}\n\n",
        )
        .unwrap();
        // The plain reader reads them (a process may be looked at without its spans).
        assert_eq!(
            read_traces(&[&empty, &anchored]).unwrap().processes.len(),
            1
        );
        let e = read_spans(&[&empty]).unwrap_err().to_string();
        assert!(e.contains("empty.jsonl: no span lines"), "{e}");
        let e = read_spans(&[&empty, &anchored]).unwrap_err().to_string();
        assert!(
            e.contains("empty.jsonl, ")
                && e.contains("anchored.jsonl: no span lines in any of these 2 files"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
