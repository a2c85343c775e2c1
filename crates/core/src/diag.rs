//! Collection side of the run diagnostics: dependency capture (`dep_gen`), the topology
//! fingerprint shared with swimlane records, orchestrator submit records (swimlane level 4) and
//! per-scope-site ring statistics. Everything here is off unless its switch is on.

use std::collections::HashMap;
use std::sync::Arc;

use crate::kernel::{KernelSpec, TensorArg};
use crate::task::{ScopeKind, TaskId};
use crate::tensor::BufferId;
use crate::tensormap::TensorMap;
use crate::trace::{
    ArgRecord, DepGraph, EdgeRecord, EdgeSource, OverlapKind, ScopeKindRecord, ScopeSiteUsage,
    SubmitRecord, TRACE_FORMAT_VERSION, TaskNode, TensorNode,
};

/// Formats a byte count with a binary unit (`256 MiB`).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if v.fract() == 0.0 {
        format!("{} {}", v as u64, UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// FNV-1a, 64 bit: stable across processes and platforms.
#[derive(Clone, Copy)]
pub(crate) struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub(crate) fn u64(&mut self, v: u64) {
        for b in v.to_le_bytes() {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub(crate) fn bytes(&mut self, s: &[u8]) {
        for &b in s {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

#[derive(Default)]
pub(crate) struct Diagnostics {
    pub(crate) dep_gen: bool,
    pub(crate) fingerprint_on: bool,
    pub(crate) ring_stats: bool,
    pub(crate) graph: DepGraph,
    tensor_index: HashMap<(BufferId, u32), usize>,
    pub(crate) fingerprint: Fnv,
    pub(crate) submits: Vec<SubmitRecord>,
    pub(crate) submits_dropped: u64,
    pub(crate) sites: HashMap<(&'static str, u32, u32), ScopeSiteUsage>,
}

impl Diagnostics {
    pub(crate) fn new(dep_gen: bool, swimlane: u8, ring_stats: bool) -> Diagnostics {
        Diagnostics {
            dep_gen,
            fingerprint_on: dep_gen || swimlane > 0,
            ring_stats,
            ..Diagnostics::default()
        }
    }

    pub(crate) fn capturing(&self) -> bool {
        self.dep_gen
    }
    pub(crate) fn fingerprinting(&self) -> bool {
        self.fingerprint_on
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn capture_task(
        &mut self,
        id: TaskId,
        kind: ScopeKind,
        depth: usize,
        kernel: &Option<Arc<KernelSpec>>,
        block_num: u32,
        args: &[TensorArg],
        map: &TensorMap,
    ) {
        let mut arg_records = Vec::with_capacity(args.len());
        for a in args {
            let t = &a.tensor;
            let version = map.version(t.buffer);
            let next = self.graph.tensors.len();
            let idx = *self.tensor_index.entry((t.buffer, version)).or_insert(next);
            if idx == next {
                self.graph.tensors.push(TensorNode {
                    buffer: t.buffer.0,
                    version,
                    dtype: t.dtype,
                    size: t.buffer_bytes,
                });
            }
            arg_records.push(ArgRecord {
                tag: a.tag.name().to_string(),
                tensor: idx,
                offset: t.offset,
                shape: t.shape().to_vec(),
                strides: t.strides().to_vec(),
            });
        }
        self.graph.tasks.push(TaskNode {
            id: id.trace_id(),
            scope: match kind {
                ScopeKind::Auto => ScopeKindRecord::Auto,
                ScopeKind::Manual => ScopeKindRecord::Manual,
            },
            scope_depth: depth as u32,
            kernel: kernel.as_ref().map_or(u32::MAX, |k| k.id.0),
            kernel_name: kernel.as_ref().map_or_else(String::new, |k| k.name.clone()),
            block_num,
            args: arg_records,
        });
    }

    /// Records the edges of a submitted task (all distinct (producer, source) pairs among the
    /// producers it waits for) and folds the task into the fingerprint.
    pub(crate) fn capture_edges(
        &mut self,
        id: TaskId,
        waits_for: impl Iterator<Item = (TaskId, EdgeSource, OverlapKind)>,
        block_num: u32,
        kernel: Option<u32>,
    ) {
        self.fingerprint.u64(id.trace_id());
        self.fingerprint.u64(kernel.map_or(u64::MAX, u64::from));
        self.fingerprint.u64(block_num as u64);
        let mut seen: Vec<(TaskId, EdgeSource)> = Vec::new();
        for (task, source, overlap) in waits_for {
            if seen.contains(&(task, source)) {
                continue;
            }
            seen.push((task, source));
            self.fingerprint.u64(task.trace_id());
            if self.dep_gen {
                self.graph.edges.push(EdgeRecord {
                    pred: task.trace_id(),
                    succ: id.trace_id(),
                    source,
                    overlap,
                });
            }
        }
    }

    pub(crate) fn submit_record(&mut self, task: TaskId, start: u64, end: u64, cap: usize) {
        if self.submits.len() < cap {
            self.submits.push(SubmitRecord {
                task_id: task.trace_id(),
                start,
                end,
            });
        } else {
            self.submits_dropped += 1;
        }
    }

    /// A scope instance closed: what was submitted directly in it (tasks, heap bytes,
    /// dependency-pool and dependency-map entries) against its site's largest so far.
    pub(crate) fn scope_closed(&mut self, f: &crate::orch::ScopeFrame) {
        let site = f.site;
        let key = (site.file(), site.line(), site.column());
        let e = self.sites.entry(key).or_insert_with(|| ScopeSiteUsage {
            site: format!("{}:{}", site.file(), site.line()),
            ring: f.ring,
            ..ScopeSiteUsage::default()
        });
        e.opened += 1;
        e.max_tasks = e.max_tasks.max(f.tasks);
        e.max_heap = e.max_heap.max(f.heap);
        e.max_dep_pool = e.max_dep_pool.max(f.deps);
        e.max_map_entries = e.max_map_entries.max(f.map);
    }

    /// The fingerprint as 16 hex digits.
    pub(crate) fn fingerprint_hex(&self) -> String {
        format!("{:016x}", self.fingerprint.finish())
    }

    pub(crate) fn take_graph(&mut self) -> DepGraph {
        let mut g = std::mem::take(&mut self.graph);
        g.v = TRACE_FORMAT_VERSION;
        g.fingerprint = self.fingerprint_hex();
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(256 << 20), "256 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(12), "12 B");
    }
}
