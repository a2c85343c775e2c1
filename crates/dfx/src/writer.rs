//! The trace file writer: JSON Lines, one anchor line per writer, then spans and device
//! alignments, buffered in large chunks.
//!
//! A writer serialises every line with `serde_json` into one reused buffer and hands the buffer
//! to the file only when it holds [`CHUNK_BYTES`], on [`TraceWriter::flush`] and on drop, so the
//! cost per span is one serialisation into memory.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Serialize;
use simpler_core::RunReport;
use simpler_core::clock::ClockAnchor;
use simpler_core::trace::{ClockOffset, DeviceClockAlignment, ProcessClock, SpanRecord, TraceLine};

use crate::error::{DfxError, Result, io};

/// Bytes buffered before they are written out.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// Writes trace lines (see `docs/trace-format.md`) to a file or any [`Write`].
///
/// The first line a writer produces is its process's [`ClockAnchor`]; a file opened with
/// [`TraceWriter::append`] may therefore hold several anchors (one per writer that appended).
/// Buffered lines are flushed on drop; call [`TraceWriter::finish`] to see a write error.
pub struct TraceWriter<W: Write = File> {
    out: Option<W>,
    buf: Vec<u8>,
    anchor: ClockAnchor,
    path: PathBuf,
    lines: u64,
}

/// A trace line by reference, serialised exactly like [`TraceLine`] without cloning the record.
#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum LineRef<'a> {
    Anchor(&'a ClockAnchor),
    Process(&'a ProcessClock),
    Span(&'a SpanRecord),
    DeviceAlignment {
        pid: u32,
        inv: u64,
        alignment: &'a DeviceClockAlignment,
    },
}

/// Which rank of a multi-process run this process is, for the `process` line of its traces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessRole {
    /// This process's rank.
    pub rank: u32,
    /// Number of ranks.
    pub ranks: u32,
    /// What it is (`chip 1`, `mpi rank 3`).
    pub role: String,
    /// Its clock's offset to rank 0's (see [`ClockOffset`]).
    pub clock_offset: Option<ClockOffset>,
}

impl ProcessRole {
    /// Chip `rank` of a node of `ranks` chips: a child process of this host, so on rank 0's
    /// clock exactly (offset 0).
    pub fn chip(rank: u32, ranks: u32) -> ProcessRole {
        ProcessRole {
            rank,
            ranks,
            role: format!("chip {rank}"),
            clock_offset: Some(ClockOffset {
                reference_boot_id: this_process_clock().boot_id,
                offset_ns: 0,
                uncertainty_ns: 0,
            }),
        }
    }

    /// Rank `rank` of an `mpirun` job of `ranks`, with its clock offset to rank 0 as measured
    /// at start-up (on another host, the only link between the two clocks).
    pub fn mpi_rank(rank: u32, ranks: u32, clock_offset: ClockOffset) -> ProcessRole {
        ProcessRole {
            rank,
            ranks,
            role: format!("mpi rank {rank}"),
            clock_offset: Some(clock_offset),
        }
    }
}

static ROLE: OnceLock<ProcessRole> = OnceLock::new();

/// Names this process's rank in every trace it writes from now on (a node's chip, an `mpirun`
/// rank). Set once; a second call with a different role is refused (returns the role already
/// set), since one process has one rank.
pub fn set_process_role(role: ProcessRole) -> std::result::Result<(), ProcessRole> {
    let set = ROLE.get_or_init(|| role.clone());
    if *set == role {
        Ok(())
    } else {
        Err(set.clone())
    }
}

/// `CLOCK_MONOTONIC` in ns: the clock of the `process` lines' `mono_ns` (and of the clock
/// offsets between ranks).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// This process's place on the host's monotonic clock (and its rank, if set).
///
/// The process axis is `Instant`-based, which on Linux reads `CLOCK_MONOTONIC`: one clock read
/// between two axis reads gives the axis' zero on that clock, to within half the bracket
/// (the narrowest of a few tries). The boot id says which hosts' (boots') clocks are one.
pub fn this_process_clock() -> ProcessClock {
    static BASE: OnceLock<(String, u64, u64)> = OnceLock::new();
    let (boot_id, mono_ns, uncertainty_ns) = BASE
        .get_or_init(|| {
            let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .map(|s| s.trim().to_string())
                .unwrap_or_default();
            let (mut best, mut zero) = (u64::MAX, 0);
            for _ in 0..5 {
                let a = simpler_core::clock::now_ns();
                let m = monotonic_ns();
                let b = simpler_core::clock::now_ns();
                if b - a < best {
                    best = b - a;
                    zero = m.saturating_sub(a + (b - a) / 2);
                }
            }
            (boot_id, zero, best / 2 + 1)
        })
        .clone();
    let role = ROLE.get();
    ProcessClock {
        pid: std::process::id(),
        boot_id,
        mono_ns,
        uncertainty_ns,
        rank: role.map(|r| r.rank),
        ranks: role.map(|r| r.ranks),
        role: role.map(|r| r.role.clone()),
        clock_offset: role.and_then(|r| r.clock_offset.clone()),
    }
}

impl TraceWriter<File> {
    /// Opens `path` for appending (creating it and its directory if needed) and writes this
    /// process's anchor line and its `process` line (host clock and rank).
    pub fn append(path: impl AsRef<Path>) -> Result<TraceWriter<File>> {
        let mut w = TraceWriter::append_with_anchor(path, ClockAnchor::process())?;
        w.process_clock(&this_process_clock())?;
        Ok(w)
    }

    /// Like [`TraceWriter::append`] with an explicit anchor (tests, replays).
    pub fn append_with_anchor(
        path: impl AsRef<Path>,
        anchor: ClockAnchor,
    ) -> Result<TraceWriter<File>> {
        let path = path.as_ref();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io("create directory", dir))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io("open", path))?;
        let mut w = TraceWriter::with_path(file, anchor, path.to_path_buf());
        w.write_anchor();
        Ok(w)
    }
}

impl<W: Write> TraceWriter<W> {
    /// A writer over any output; writes the anchor line first.
    pub fn new(out: W, anchor: ClockAnchor) -> TraceWriter<W> {
        let mut w = TraceWriter::with_path(out, anchor, PathBuf::from("<stream>"));
        w.write_anchor();
        w
    }

    fn with_path(out: W, anchor: ClockAnchor, path: PathBuf) -> TraceWriter<W> {
        TraceWriter {
            out: Some(out),
            buf: Vec::with_capacity(CHUNK_BYTES + 4096),
            anchor,
            path,
            lines: 0,
        }
    }

    /// The anchor this writer wrote first.
    pub fn anchor(&self) -> ClockAnchor {
        self.anchor
    }

    /// Lines written so far (including the anchor).
    pub fn lines(&self) -> u64 {
        self.lines
    }

    /// Appends one span.
    pub fn span(&mut self, span: &SpanRecord) -> Result<()> {
        self.line(&LineRef::Span(span))
    }

    /// Appends several spans.
    pub fn spans<'a>(&mut self, spans: impl IntoIterator<Item = &'a SpanRecord>) -> Result<()> {
        for s in spans {
            self.line(&LineRef::Span(s))?;
        }
        Ok(())
    }

    /// Appends the standard span tree of a run ([`RunReport::spans`]) for this writer's pid.
    pub fn report(&mut self, report: &RunReport, tid: u64) -> Result<()> {
        let spans = report.spans(self.anchor.pid, tid);
        self.spans(&spans)
    }

    /// Appends a process's host clock and rank (what [`TraceWriter::append`] writes after the
    /// anchor; an explicit one for tests and replays).
    pub fn process_clock(&mut self, clock: &ProcessClock) -> Result<()> {
        self.line(&LineRef::Process(clock))
    }

    /// Appends the device clock alignment of one invocation.
    pub fn device_alignment(
        &mut self,
        pid: u32,
        inv: u64,
        alignment: &DeviceClockAlignment,
    ) -> Result<()> {
        self.line(&LineRef::DeviceAlignment {
            pid,
            inv,
            alignment,
        })
    }

    /// Appends any trace line.
    pub fn trace_line(&mut self, line: &TraceLine) -> Result<()> {
        match line {
            TraceLine::Anchor(a) => self.line(&LineRef::Anchor(a)),
            TraceLine::Process(p) => self.line(&LineRef::Process(p)),
            TraceLine::Span(s) => self.line(&LineRef::Span(s)),
            TraceLine::DeviceAlignment {
                pid,
                inv,
                alignment,
            } => self.line(&LineRef::DeviceAlignment {
                pid: *pid,
                inv: *inv,
                alignment,
            }),
        }
    }

    /// Writes everything buffered to the output and flushes it.
    pub fn flush(&mut self) -> Result<()> {
        self.drain()?;
        if let Some(out) = self.out.as_mut() {
            out.flush().map_err(io("write", &self.path))?;
        }
        Ok(())
    }

    /// Flushes and returns the output.
    pub fn finish(mut self) -> Result<W> {
        self.flush()?;
        Ok(self.out.take().expect("output present until finish"))
    }

    fn write_anchor(&mut self) {
        let anchor = self.anchor;
        // Serialising into a Vec cannot fail and nothing is written out yet.
        let _ = self.line(&LineRef::Anchor(&anchor));
    }

    fn line(&mut self, line: &LineRef<'_>) -> Result<()> {
        serde_json::to_writer(&mut self.buf, line).map_err(|source| DfxError::Json {
            path: self.path.clone(),
            line: self.lines as usize + 1,
            source,
        })?;
        self.buf.push(b'\n');
        self.lines += 1;
        if self.buf.len() >= CHUNK_BYTES {
            self.drain()
        } else {
            Ok(())
        }
    }

    fn drain(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        if let Some(out) = self.out.as_mut() {
            out.write_all(&self.buf).map_err(io("write", &self.path))?;
        }
        self.buf.clear();
        Ok(())
    }
}

impl<W: Write> Drop for TraceWriter<W> {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; `finish` reports them.
        let _ = self.flush();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use simpler_core::trace::{AttrValue, Clock, TRACE_FORMAT_VERSION};

    use super::*;

    fn span(name: &str) -> SpanRecord {
        let mut attrs = BTreeMap::new();
        attrs.insert("label".to_string(), AttrValue::Str("decode".into()));
        SpanRecord {
            v: TRACE_FORMAT_VERSION,
            pid: 9,
            tid: 1,
            inv: 0,
            callable: "00000000000000ab".into(),
            depth: 0,
            name: name.into(),
            ts_ns: 5,
            dur_ns: 10,
            clock: Clock::Host,
            attrs,
        }
    }

    #[test]
    fn lines_match_the_owned_trace_line_serialisation() {
        let anchor = ClockAnchor {
            pid: 9,
            wall_ns: 1_000,
        };
        let al = DeviceClockAlignment {
            device_ns: 1,
            host_ns: 2,
            uncertainty_ns: 3,
        };
        let mut w = TraceWriter::new(Vec::new(), anchor);
        w.span(&span("run")).unwrap();
        w.device_alignment(9, 0, &al).unwrap();
        let out = String::from_utf8(w.finish().unwrap()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3);
        let expect = [
            TraceLine::Anchor(anchor),
            TraceLine::Span(span("run")),
            TraceLine::DeviceAlignment {
                pid: 9,
                inv: 0,
                alignment: al,
            },
        ];
        for (l, e) in lines.iter().zip(&expect) {
            assert_eq!(*l, serde_json::to_string(e).unwrap());
            assert_eq!(&serde_json::from_str::<TraceLine>(l).unwrap(), e);
        }
    }

    #[test]
    fn append_keeps_earlier_lines_and_drop_flushes() {
        let dir = std::env::temp_dir().join(format!("simpler-dfx-writer-{}", std::process::id()));
        let path = dir.join("t.jsonl");
        let _ = std::fs::remove_file(&path);
        {
            let mut w = TraceWriter::append_with_anchor(
                &path,
                ClockAnchor {
                    pid: 1,
                    wall_ns: 10,
                },
            )
            .unwrap();
            w.span(&span("run")).unwrap();
        }
        {
            let mut w = TraceWriter::append_with_anchor(
                &path,
                ClockAnchor {
                    pid: 2,
                    wall_ns: 20,
                },
            )
            .unwrap();
            for _ in 0..5000 {
                w.span(&span("run")).unwrap();
            }
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2 + 1 + 5000);
        assert!(text.lines().nth(2).unwrap().contains("\"kind\":\"anchor\""));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
