//! `simpler trace deps`: the captured dependency graph as a DAG — text summary, Graphviz DOT,
//! and exact transitive reduction (reachability bitsets in topological order).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use simpler_core::trace::{DepGraph, EdgeRecord, EdgeSource, OverlapKind};

use crate::blocks::task_name;
use crate::error::{DfxError, Result};

/// Most memory the exact transitive reduction may allocate for its reachability bitsets
/// (`n²/8` bytes for `n` tasks: 1 GiB is about 92,000 tasks).
pub const MAX_REDUCTION_BYTES: u64 = 1 << 30;

/// The DAG of a [`DepGraph`]: one node per task, one edge per distinct (pred, succ) pair.
#[derive(Clone, Debug)]
pub struct Graph {
    /// Task ids by node index (submit order).
    pub ids: Vec<u64>,
    /// Node index by task id.
    pub index: HashMap<u64, usize>,
    /// Distinct predecessors per node.
    pub preds: Vec<Vec<usize>>,
    /// Distinct successors per node.
    pub succs: Vec<Vec<usize>>,
    /// A topological order (sources first, submit order among ties).
    pub topo: Vec<usize>,
    /// Edge records naming a task that is not in the graph (not drawn).
    pub unknown_edges: usize,
}

impl Graph {
    /// Builds the DAG; a cycle is an error.
    pub fn new(g: &DepGraph) -> Result<Graph> {
        let ids: Vec<u64> = g.tasks.iter().map(|t| t.id).collect();
        let index: HashMap<u64, usize> = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let n = ids.len();
        let (mut preds, mut succs) = (vec![Vec::new(); n], vec![Vec::new(); n]);
        let mut unknown_edges = 0;
        for e in &g.edges {
            match (index.get(&e.pred), index.get(&e.succ)) {
                (Some(&p), Some(&s)) => {
                    succs[p].push(s);
                    preds[s].push(p);
                }
                _ => unknown_edges += 1,
            }
        }
        for v in preds.iter_mut().chain(succs.iter_mut()) {
            v.sort_unstable();
            v.dedup();
        }
        let mut indeg: Vec<usize> = preds.iter().map(Vec::len).collect();
        let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<usize>> = (0..n)
            .filter(|&i| indeg[i] == 0)
            .map(std::cmp::Reverse)
            .collect();
        let mut topo = Vec::with_capacity(n);
        while let Some(std::cmp::Reverse(v)) = ready.pop() {
            topo.push(v);
            for &w in &succs[v] {
                indeg[w] -= 1;
                if indeg[w] == 0 {
                    ready.push(std::cmp::Reverse(w));
                }
            }
        }
        if topo.len() < n {
            let stuck = (0..n).find(|&i| indeg[i] > 0).unwrap_or(0);
            return Err(DfxError::Cycle { task: ids[stuck] });
        }
        Ok(Graph {
            ids,
            index,
            preds,
            succs,
            topo,
            unknown_edges,
        })
    }

    /// Number of distinct edges.
    pub fn edge_count(&self) -> usize {
        self.succs.iter().map(Vec::len).sum()
    }

    /// Layer of each node: the longest path (in edges) from any source.
    pub fn layers(&self) -> Vec<usize> {
        let mut layer = vec![0; self.ids.len()];
        for &v in &self.topo {
            for &w in &self.succs[v] {
                layer[w] = layer[w].max(layer[v] + 1);
            }
        }
        layer
    }

    /// Bytes [`Graph::transitive_reduction`] needs: one bitset of `n` bits per node.
    pub fn reduction_bytes(&self) -> u64 {
        let n = self.ids.len() as u64;
        n.saturating_mul(n.div_ceil(64)).saturating_mul(8)
    }

    /// The edges `(pred, succ)` that are not implied by a longer path (exact transitive
    /// reduction), refused with [`DfxError::TooLarge`] when it would need more than
    /// [`MAX_REDUCTION_BYTES`].
    pub fn transitive_reduction(&self) -> Result<Vec<(usize, usize)>> {
        self.transitive_reduction_within(MAX_REDUCTION_BYTES)
    }

    /// [`Graph::transitive_reduction`] with its own memory limit.
    pub fn transitive_reduction_within(&self, limit_bytes: u64) -> Result<Vec<(usize, usize)>> {
        let needed_bytes = self.reduction_bytes();
        if needed_bytes > limit_bytes {
            return Err(DfxError::TooLarge {
                what: format!("the transitive reduction of {} tasks", self.ids.len()),
                needed_bytes,
                limit_bytes,
                hint: "view the graph without --reduce",
            });
        }
        let n = self.ids.len();
        let words = n.div_ceil(64);
        let mut pos = vec![0; n];
        for (k, &v) in self.topo.iter().enumerate() {
            pos[v] = k;
        }
        // reach[v]: nodes reachable from v by a path of one edge or more.
        let mut reach = vec![0u64; n * words];
        let mut kept = Vec::new();
        let mut covered = vec![0u64; words];
        for &v in self.topo.iter().rev() {
            let mut succ = self.succs[v].clone();
            succ.sort_by_key(|&w| pos[w]);
            covered.iter_mut().for_each(|w| *w = 0);
            for &w in &succ {
                if covered[w / 64] >> (w % 64) & 1 == 1 {
                    continue;
                }
                kept.push((v, w));
                covered[w / 64] |= 1 << (w % 64);
                for k in 0..words {
                    covered[k] |= reach[w * words + k];
                }
            }
            reach[v * words..(v + 1) * words].copy_from_slice(&covered);
        }
        kept.sort_unstable();
        Ok(kept)
    }
}

/// A copy of `g` holding only the edges of its transitive reduction (the first record of each
/// kept pair, so its source and overlap are kept).
pub fn reduce(g: &DepGraph) -> Result<DepGraph> {
    let graph = Graph::new(g)?;
    let kept: std::collections::HashSet<(u64, u64)> = graph
        .transitive_reduction()?
        .into_iter()
        .map(|(p, s)| (graph.ids[p], graph.ids[s]))
        .collect();
    let mut seen = std::collections::HashSet::new();
    let edges: Vec<EdgeRecord> = g
        .edges
        .iter()
        .filter(|e| kept.contains(&(e.pred, e.succ)) && seen.insert((e.pred, e.succ)))
        .cloned()
        .collect();
    Ok(DepGraph { edges, ..g.clone() })
}

/// Name of an edge source.
pub fn source_name(s: EdgeSource) -> &'static str {
    match s {
        EdgeSource::Creator => "creator",
        EdgeSource::Tensormap => "tensormap",
        EdgeSource::Explicit => "explicit",
    }
}

/// Name of an overlap kind.
pub fn overlap_name(o: OverlapKind) -> &'static str {
    match o {
        OverlapKind::Covers => "covers",
        OverlapKind::Partial => "partial",
        OverlapKind::Conservative => "conservative",
        OverlapKind::None => "none",
    }
}

/// Kernel label of a task: its name, `kernel <id>`, or `dummy`.
pub(crate) fn kernel_label(kernel: u32, name: &str) -> String {
    if kernel == u32::MAX {
        "dummy".into()
    } else if name.is_empty() {
        format!("kernel {kernel}")
    } else {
        name.to_string()
    }
}

/// The text summary: counts, edges by source and overlap, fan-in/fan-out distributions and
/// the tasks with the largest fan-in and fan-out.
pub fn summary(g: &DepGraph) -> Result<String> {
    let graph = Graph::new(g)?;
    let mut out = String::new();
    let n = graph.ids.len();
    let _ = writeln!(
        out,
        "fingerprint {}",
        if g.fingerprint.is_empty() {
            "-"
        } else {
            &g.fingerprint
        }
    );
    let _ = writeln!(
        out,
        "tasks {n}  tensors {}  edge records {}  distinct edges {}",
        g.tensors.len(),
        g.edges.len(),
        graph.edge_count()
    );
    let mut by_source: BTreeMap<&str, usize> = BTreeMap::new();
    let mut by_overlap: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &g.edges {
        *by_source.entry(source_name(e.source)).or_default() += 1;
        if e.source == EdgeSource::Tensormap {
            *by_overlap.entry(overlap_name(e.overlap)).or_default() += 1;
        }
    }
    let join = |m: &BTreeMap<&str, usize>| {
        m.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        out,
        "edges by source: {}",
        if by_source.is_empty() {
            "none".into()
        } else {
            join(&by_source)
        }
    );
    if !by_overlap.is_empty() {
        let _ = writeln!(out, "tensormap edges by overlap: {}", join(&by_overlap));
    }
    if graph.unknown_edges > 0 {
        let _ = writeln!(
            out,
            "WARNING: {} edge records name a task that is not in the graph",
            graph.unknown_edges
        );
    }
    let layers = graph.layers();
    let sources = graph.preds.iter().filter(|p| p.is_empty()).count();
    let sinks = graph.succs.iter().filter(|s| s.is_empty()).count();
    let depth = layers.iter().max().map_or(0, |d| d + 1);
    let _ = writeln!(
        out,
        "sources {sources}  sinks {sinks}  depth {depth} (tasks on the longest chain)"
    );
    match graph.transitive_reduction() {
        Ok(kept) => {
            let _ = writeln!(
                out,
                "transitive reduction keeps {} of {} distinct edges",
                kept.len(),
                graph.edge_count()
            );
        }
        Err(e) => {
            let _ = writeln!(out, "transitive reduction: not computed ({e})");
        }
    }
    for (what, lists) in [("fan-in", &graph.preds), ("fan-out", &graph.succs)] {
        let degs: Vec<usize> = lists.iter().map(Vec::len).collect();
        let mut hist: BTreeMap<usize, usize> = BTreeMap::new();
        for &d in &degs {
            *hist.entry(bucket(d)).or_default() += 1;
        }
        let mean = if n == 0 {
            0.0
        } else {
            degs.iter().sum::<usize>() as f64 / n as f64
        };
        let _ = writeln!(
            out,
            "{what}: mean {mean:.2}, max {}",
            degs.iter().max().unwrap_or(&0)
        );
        for (b, count) in hist {
            let label = bucket_label(b);
            let bar = "#".repeat(((count * 40).div_ceil(n.max(1))).min(40));
            let _ = writeln!(out, "  {label:>7} {count:>8} {bar}");
        }
        let mut top: Vec<usize> = (0..n).collect();
        top.sort_by_key(|&i| (std::cmp::Reverse(degs[i]), i));
        let shown: Vec<String> = top
            .iter()
            .take(5)
            .filter(|&&i| degs[i] > 0)
            .map(|&i| {
                let t = &g.tasks[i];
                format!(
                    "{} ({}) {}",
                    task_name(t.id),
                    kernel_label(t.kernel, &t.kernel_name),
                    degs[i]
                )
            })
            .collect();
        if !shown.is_empty() {
            let _ = writeln!(out, "  top {what}: {}", shown.join(", "));
        }
    }
    Ok(out)
}

/// Degree buckets: 0, 1, 2, 3-4, 5-8, 9-16, ... (each bucket named by its upper bound).
fn bucket(d: usize) -> usize {
    if d <= 2 { d } else { d.next_power_of_two() }
}

fn bucket_label(b: usize) -> String {
    if b <= 2 {
        b.to_string()
    } else {
        format!("{}-{}", b / 2 + 1, b)
    }
}

/// Graphviz DOT of the graph (edges coloured by source, dashed when conservative).
pub fn to_dot(g: &DepGraph) -> String {
    let mut out = String::from(
        "digraph deps {\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n",
    );
    for t in &g.tasks {
        let _ = writeln!(
            out,
            "  t{} [label=\"{}\\n{} x{}\"];",
            t.id,
            task_name(t.id),
            kernel_label(t.kernel, &t.kernel_name)
                .replace('\\', "\\\\")
                .replace('"', "\\\""),
            t.block_num
        );
    }
    for e in &g.edges {
        let color = match e.source {
            EdgeSource::Creator => "black",
            EdgeSource::Tensormap => "blue",
            EdgeSource::Explicit => "darkgreen",
        };
        let style = if e.overlap == OverlapKind::Conservative {
            ", style=dashed"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  t{} -> t{} [color={color}, tooltip=\"{}\"{style}];",
            e.pred,
            e.succ,
            source_name(e.source)
        );
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use simpler_core::trace::{ScopeKindRecord, TaskNode};

    use super::*;

    pub(crate) fn graph(n: u64, edges: &[(u64, u64)]) -> DepGraph {
        DepGraph {
            v: 1,
            fingerprint: "fp".into(),
            tasks: (0..n)
                .map(|id| TaskNode {
                    id,
                    scope: ScopeKindRecord::Auto,
                    scope_depth: 0,
                    kernel: 0,
                    kernel_name: "k".into(),
                    block_num: 1,
                    args: Vec::new(),
                })
                .collect(),
            tensors: Vec::new(),
            edges: edges
                .iter()
                .map(|&(pred, succ)| EdgeRecord {
                    pred,
                    succ,
                    source: EdgeSource::Tensormap,
                    overlap: OverlapKind::Covers,
                })
                .collect(),
        }
    }

    #[test]
    fn transitive_reduction_is_exact() {
        // 0->1->2->3 plus shortcuts 0->2, 0->3, 1->3 and an independent 4->3.
        let g = graph(
            5,
            &[
                (0, 1),
                (1, 2),
                (2, 3),
                (0, 2),
                (0, 3),
                (1, 3),
                (4, 3),
                (0, 1),
            ],
        );
        let r = reduce(&g).unwrap();
        let pairs: Vec<(u64, u64)> = r.edges.iter().map(|e| (e.pred, e.succ)).collect();
        assert_eq!(pairs, vec![(0, 1), (1, 2), (2, 3), (4, 3)]);
        // Diamond: nothing to remove.
        let d = graph(4, &[(0, 1), (0, 2), (1, 3), (2, 3)]);
        assert_eq!(reduce(&d).unwrap().edges.len(), 4);
    }

    #[test]
    fn transitive_reduction_refuses_a_graph_past_its_memory_limit() {
        // 100,000 tasks would need 100,000 × 1,563 words = 1.25 GB of bitsets.
        let g = graph(100_000, &[(0, 1), (1, 2), (0, 2)]);
        let e = reduce(&g).unwrap_err();
        match &e {
            DfxError::TooLarge {
                needed_bytes,
                limit_bytes,
                ..
            } => assert_eq!(
                (*needed_bytes, *limit_bytes),
                (100_000 * 1_563 * 8, MAX_REDUCTION_BYTES)
            ),
            other => panic!("{other}"),
        }
        assert!(e.to_string().contains("without --reduce"), "{e}");
        // The summary still works and says the reduction was not computed.
        let text = summary(&g).unwrap();
        assert!(
            text.contains("transitive reduction: not computed"),
            "{text}"
        );
        assert!(text.contains("tasks 100000"), "{text}");
        // Under a limit it fits, the same graph's small cousin reduces exactly.
        let small = Graph::new(&graph(3, &[(0, 1), (1, 2), (0, 2)])).unwrap();
        assert_eq!(small.transitive_reduction_within(24).unwrap().len(), 2);
        assert!(small.transitive_reduction_within(23).is_err());
    }

    #[test]
    fn reduction_matches_brute_force_on_random_dags() {
        let mut rng = crate::stats::SplitMix64::new(42);
        for _ in 0..30 {
            let n = 1 + rng.below(40) as u64;
            let mut edges = Vec::new();
            for s in 0..n {
                for p in 0..s {
                    if rng.below(5) == 0 {
                        edges.push((p, s));
                    }
                }
            }
            let g = graph(n, &edges);
            let kept: Vec<(u64, u64)> = reduce(&g)
                .unwrap()
                .edges
                .iter()
                .map(|e| (e.pred, e.succ))
                .collect();
            // Brute force: an edge is redundant iff succ is reachable from pred without it.
            let reach = |from: u64, to: u64, skip: (u64, u64)| {
                let mut stack = vec![from];
                let mut seen = vec![false; n as usize];
                while let Some(v) = stack.pop() {
                    for &(p, s) in &edges {
                        if p == v && (p, s) != skip && !seen[s as usize] {
                            if s == to {
                                return true;
                            }
                            seen[s as usize] = true;
                            stack.push(s);
                        }
                    }
                }
                false
            };
            let mut want: Vec<(u64, u64)> = edges
                .iter()
                .copied()
                .filter(|&e| !reach(e.0, e.1, e))
                .collect();
            want.sort();
            let mut got = kept.clone();
            got.sort();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn summary_counts_and_cycles() {
        let g = graph(4, &[(0, 1), (0, 2), (0, 3), (1, 3), (2, 3)]);
        let s = summary(&g).unwrap();
        assert!(
            s.contains("tasks 4  tensors 0  edge records 5  distinct edges 5"),
            "{s}"
        );
        assert!(s.contains("edges by source: tensormap 5"), "{s}");
        assert!(s.contains("sources 1  sinks 1  depth 3"), "{s}");
        assert!(s.contains("top fan-in: 0:3 (k) 3"), "{s}");
        assert!(s.contains("top fan-out: 0:0 (k) 3"), "{s}");
        assert!(s.contains("transitive reduction keeps 4 of 5"), "{s}");
        let cyc = graph(3, &[(0, 1), (1, 2), (2, 1)]);
        assert!(matches!(summary(&cyc).unwrap_err(), DfxError::Cycle { .. }));
        let dot = to_dot(&g);
        assert!(
            dot.starts_with("digraph deps {") && dot.contains("t0 -> t3 [color=blue"),
            "{dot}"
        );
    }
}
