//! A writer of Chrome Trace Event Format JSON (what Perfetto and `chrome://tracing` open), and
//! the export of merged trace spans to it.
//!
//! Timestamps are microseconds (fractional, so nanoseconds survive) from the earliest event.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};
use simpler_core::trace::Clock;

use crate::error::Result;
use crate::reader::{Placement, Trace};

/// One event of the Trace Event Format.
#[derive(Clone, Debug, Serialize)]
pub struct TraceEvent {
    /// Name (for metadata events: `process_name`, `thread_name`, `thread_sort_index`).
    pub name: String,
    /// Phase: `X` complete, `M` metadata, `C` counter, `s`/`f` flow start/finish, `i` instant.
    pub ph: &'static str,
    /// Timestamp in microseconds.
    pub ts: f64,
    /// Process (lane group).
    pub pid: u32,
    /// Thread (lane).
    pub tid: u64,
    /// Duration in microseconds (`X` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    /// Category.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cat: Option<String>,
    /// Flow id (`s`/`f`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
    /// Binding point of a flow finish (`e`: the enclosing slice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bp: Option<&'static str>,
    /// Scope of an instant event (`g` global, `p` process, `t` thread).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub s: Option<&'static str>,
    /// Arguments shown with the event.
    #[serde(skip_serializing_if = "Map::is_empty")]
    pub args: Map<String, Value>,
}

/// A Trace Event Format document being built.
#[derive(Clone, Debug, Default)]
pub struct PerfettoTrace {
    /// The events.
    pub events: Vec<TraceEvent>,
    /// `otherData`: free-form metadata shown by the viewers.
    pub other: Map<String, Value>,
}

/// Nanoseconds to Trace Event microseconds.
pub fn ns_to_us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

impl PerfettoTrace {
    fn base(
        name: impl Into<String>,
        ph: &'static str,
        ts_ns: u64,
        pid: u32,
        tid: u64,
    ) -> TraceEvent {
        TraceEvent {
            name: name.into(),
            ph,
            ts: ns_to_us(ts_ns),
            pid,
            tid,
            dur: None,
            cat: None,
            id: None,
            bp: None,
            s: None,
            args: Map::new(),
        }
    }

    /// Names a process (lane group).
    pub fn process_name(&mut self, pid: u32, name: &str) {
        let mut e = Self::base("process_name", "M", 0, pid, 0);
        e.args.insert("name".into(), name.into());
        self.events.push(e);
    }

    /// Fixes a process's position among the processes (ranks in rank order).
    pub fn process_sort_index(&mut self, pid: u32, index: u64) {
        let mut e = Self::base("process_sort_index", "M", 0, pid, 0);
        e.args.insert("sort_index".into(), index.into());
        self.events.push(e);
    }

    /// Names a thread (lane) and fixes its position among its process's lanes.
    pub fn thread_name(&mut self, pid: u32, tid: u64, name: &str) {
        let mut e = Self::base("thread_name", "M", 0, pid, tid);
        e.args.insert("name".into(), name.into());
        self.events.push(e);
        let mut e = Self::base("thread_sort_index", "M", 0, pid, tid);
        e.args.insert("sort_index".into(), tid.into());
        self.events.push(e);
    }

    /// A slice `[ts, ts + dur)`.
    #[allow(clippy::too_many_arguments)]
    pub fn complete(
        &mut self,
        pid: u32,
        tid: u64,
        name: &str,
        cat: &str,
        ts_ns: u64,
        dur_ns: u64,
        args: Map<String, Value>,
    ) {
        let mut e = Self::base(name, "X", ts_ns, pid, tid);
        e.dur = Some(ns_to_us(dur_ns));
        e.cat = Some(cat.into());
        e.args = args;
        self.events.push(e);
    }

    /// A counter sample: one track per `name` in the process.
    pub fn counter(&mut self, pid: u32, name: &str, ts_ns: u64, series: &str, value: f64) {
        let mut e = Self::base(name, "C", ts_ns, pid, 0);
        e.args.insert(series.into(), value.into());
        self.events.push(e);
    }

    /// An arrow from the slice enclosing `from` to the slice enclosing `to`, each given as
    /// `(pid, tid, ts_ns)`.
    pub fn flow(
        &mut self,
        id: u64,
        name: &str,
        from: (u32, u64, u64),
        to: (u32, u64, u64),
        args: Map<String, Value>,
    ) {
        let mut s = Self::base(name, "s", from.2, from.0, from.1);
        s.id = Some(id);
        s.cat = Some("flow".into());
        s.args = args;
        let mut f = Self::base(name, "f", to.2, to.0, to.1);
        f.id = Some(id);
        f.cat = Some("flow".into());
        f.bp = Some("e");
        self.events.push(s);
        self.events.push(f);
    }

    /// A global instant marker.
    pub fn instant(&mut self, pid: u32, name: &str, ts_ns: u64, args: Map<String, Value>) {
        let mut e = Self::base(name, "i", ts_ns, pid, 0);
        e.s = Some("g");
        e.args = args;
        self.events.push(e);
    }

    /// The JSON document: `{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}`.
    pub fn to_json(&self) -> Value {
        let mut doc = Map::new();
        doc.insert(
            "traceEvents".into(),
            serde_json::to_value(&self.events).unwrap_or(Value::Null),
        );
        doc.insert("displayTimeUnit".into(), "ns".into());
        doc.insert("otherData".into(), Value::Object(self.other.clone()));
        Value::Object(doc)
    }

    /// Writes the document to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        crate::diag::write_json(path, &self.to_json())?;
        Ok(())
    }
}

/// Exports merged spans: one process per traced process, one track per recording thread
/// (host and device apart), all on the merged wall-clock axis. Invocations follow one another
/// on their thread's track as nested slices (`run` enclosing its sub-spans, `inv` in the args),
/// so a thousand steps make a thousand `run` slices, not a thousand tracks. Spans that would
/// not nest properly (`orch` and `sched` overlap) go to the thread's overlap tracks, reused by
/// every invocation: the track count is bounded by how many spans overlap at once.
pub fn timing_to_perfetto(trace: &Trace) -> PerfettoTrace {
    let origin = trace.origin_wall_ns();
    let mut out = PerfettoTrace::default();
    let mut used: HashSet<u32> = HashSet::new();
    let mut chrome_pid: Vec<u32> = Vec::new();
    for p in &trace.processes {
        let mut pid = p.pid;
        while !used.insert(pid) {
            pid = pid.wrapping_add(1_000_000);
        }
        chrome_pid.push(pid);
    }
    // (process, recording thread, device?) -> span indices.
    let mut tracks: BTreeMap<(usize, u64, bool), Vec<usize>> = BTreeMap::new();
    for (i, s) in trace.spans.iter().enumerate() {
        tracks
            .entry((s.process, s.span.tid, s.span.clock == Clock::Device))
            .or_default()
            .push(i);
    }
    let mut named: HashSet<usize> = HashSet::new();
    let mut next_tid: HashMap<usize, u64> = HashMap::new();
    for ((process, thread, device), mut idx) in tracks {
        let pid = chrome_pid[process];
        if named.insert(process) {
            let p = &trace.processes[process];
            out.process_name(pid, &format!("{} ({})", p.display_name(), p.file.display()));
            if let Some(rank) = p.rank() {
                out.process_sort_index(pid, rank.into());
            }
        }
        idx.sort_by_key(|&i| {
            let s = &trace.spans[i];
            (s.wall_ns, std::cmp::Reverse(s.span.dur_ns), s.span.depth)
        });
        // Greedy packing into properly nested sub-tracks.
        let mut stacks: Vec<Vec<(u64, u64)>> = Vec::new();
        let mut placed: Vec<(usize, usize)> = Vec::new();
        for &i in &idx {
            let (a, b) = (trace.spans[i].wall_ns, trace.spans[i].wall_end_ns());
            let lane = (0..=stacks.len())
                .find(|&l| {
                    let Some(st) = stacks.get_mut(l) else {
                        return true;
                    };
                    while st.last().is_some_and(|&(_, e)| e <= a) {
                        st.pop();
                    }
                    st.last().is_none_or(|&(s, e)| s <= a && b <= e)
                })
                .unwrap_or(stacks.len());
            if lane == stacks.len() {
                stacks.push(Vec::new());
            }
            stacks[lane].push((a, b));
            placed.push((i, lane));
        }
        let base = *next_tid.entry(process).or_insert(1);
        next_tid.insert(process, base + stacks.len() as u64);
        let kind = if device { "device" } else { "host" };
        for l in 0..stacks.len() {
            let name = if l == 0 {
                format!("thread {thread} {kind}")
            } else {
                format!("thread {thread} {kind} (overlap {l})")
            };
            out.thread_name(pid, base + l as u64, &name);
        }
        for (i, lane) in placed {
            let s = &trace.spans[i];
            let mut args = Map::new();
            args.insert("callable".into(), s.span.callable.clone().into());
            args.insert("inv".into(), s.span.inv.into());
            args.insert("depth".into(), s.span.depth.into());
            if let Placement::Device { uncertainty_ns } = s.placement {
                args.insert("alignment_uncertainty_ns".into(), uncertainty_ns.into());
            }
            if s.placement == Placement::DeviceUnaligned {
                args.insert("unaligned_device_clock".into(), true.into());
            }
            for (k, v) in &s.span.attrs {
                args.insert(k.clone(), serde_json::to_value(v).unwrap_or(Value::Null));
            }
            out.complete(
                pid,
                base + lane as u64,
                &s.span.name,
                kind,
                s.wall_ns - origin,
                s.span.dur_ns,
                args,
            );
        }
    }
    out.other.insert("origin_wall_ns".into(), origin.into());
    let clocks = trace.clock_summary();
    if !clocks.is_empty() {
        out.other.insert("clock_alignment".into(), clocks.into());
    }
    out
}
