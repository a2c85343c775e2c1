//! The node orchestration's dependencies on byte ranges of shared buffers.
//!
//! A task declares, per buffer, the bytes it reads or writes. A later access depends on every
//! earlier one that touches a common byte, unless both only read: read after write, write
//! after read and write after write. The result equals running the tasks one by one in submit
//! order, on every byte they declare.
//!
//! Each buffer keeps the accesses still *live*: a write drops the earlier accesses whose
//! ranges it covers. That loses no ordering. A later access that touches a dropped range
//! touches the covering write too, so it depends on that write, and the write on the dropped
//! access: the edge holds transitively. Partly covered accesses stay (a later access of their
//! uncovered bytes must still see them). Node graphs hold tens to thousands of tasks, so a
//! list per buffer, scanned on each submit, is enough: no interval tree.
//!
//! An empty range touches no byte: it orders nothing and is not kept.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::buffer::SharedBufferId;

/// One declared access of a task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Access {
    pub(crate) buf: SharedBufferId,
    pub(crate) bytes: Range<usize>,
    pub(crate) write: bool,
}

/// An earlier task's access that later ones may depend on.
#[derive(Clone, Debug)]
struct Live {
    task: usize,
    bytes: Range<usize>,
    write: bool,
}

/// Whether the two ranges share a byte (an empty range shares none, even inside another).
fn overlap(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start.max(b.start) < a.end.min(b.end)
}

fn covers(outer: &Range<usize>, inner: &Range<usize>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

/// The live accesses of every buffer of a run.
#[derive(Default)]
pub(crate) struct History {
    live: BTreeMap<SharedBufferId, Vec<Live>>,
}

impl History {
    /// Records task `task`'s accesses and returns the earlier tasks it must wait for (sorted,
    /// without repeats, never `task` itself: every predecessor is found before the history
    /// changes).
    pub(crate) fn submit(&mut self, task: usize, accesses: &[Access]) -> Vec<usize> {
        let mut preds = Vec::new();
        for a in accesses {
            let Some(live) = self.live.get(&a.buf) else {
                continue;
            };
            preds.extend(
                live.iter()
                    .filter(|l| (a.write || l.write) && overlap(&l.bytes, &a.bytes))
                    .map(|l| l.task),
            );
        }
        for a in accesses.iter().filter(|a| !a.bytes.is_empty()) {
            let live = self.live.entry(a.buf).or_default();
            if a.write {
                live.retain(|l| !covers(&a.bytes, &l.bytes));
            }
            live.push(Live {
                task,
                bytes: a.bytes.clone(),
                write: a.write,
            });
        }
        preds.sort_unstable();
        preds.dedup();
        preds
    }

    /// Forgets `buf` and returns every task still live on it (its scope ended: the free that
    /// follows waits for them, and through them for every earlier user).
    pub(crate) fn end(&mut self, buf: SharedBufferId) -> Vec<usize> {
        let mut tasks: Vec<usize> = self
            .live
            .remove(&buf)
            .unwrap_or_default()
            .into_iter()
            .map(|l| l.task)
            .collect();
        tasks.sort_unstable();
        tasks.dedup();
        tasks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn acc(buf: u64, bytes: Range<usize>, write: bool) -> Access {
        Access {
            buf: SharedBufferId(buf),
            bytes,
            write,
        }
    }

    #[test]
    fn only_overlapping_conflicts_are_ordered() {
        let mut h = History::default();
        assert_eq!(h.submit(0, &[acc(1, 0..64, true)]), Vec::<usize>::new());
        // Disjoint halves: each waits for the whole write, not for the other.
        assert_eq!(h.submit(1, &[acc(1, 0..32, true)]), [0]);
        assert_eq!(h.submit(2, &[acc(1, 32..64, true)]), [0]);
        // A read of the first half waits for task 1 (and task 0, which no single later write
        // covers: a redundant edge, kept); reads do not order each other.
        assert_eq!(h.submit(3, &[acc(1, 0..32, false)]), [0, 1]);
        assert_eq!(h.submit(4, &[acc(1, 16..48, false)]), [0, 1, 2]);
        // A write across the middle waits for every writer and both readers.
        assert_eq!(h.submit(5, &[acc(1, 30..34, true)]), [0, 1, 2, 3, 4]);
        // Another buffer is independent; an empty range orders nothing.
        assert_eq!(h.submit(6, &[acc(2, 0..8, true)]), Vec::<usize>::new());
        assert_eq!(h.submit(7, &[acc(1, 5..5, true)]), Vec::<usize>::new());
        // A task reading and writing the same bytes does not wait for itself.
        assert_eq!(h.submit(8, &[acc(2, 0..8, false), acc(2, 0..8, true)]), [6]);
        assert_eq!(h.end(SharedBufferId(1)), [0, 1, 2, 3, 4, 5]);
        assert_eq!(h.end(SharedBufferId(2)), [8]);
        assert_eq!(h.end(SharedBufferId(3)), Vec::<usize>::new());
    }

    #[test]
    fn a_covering_write_retires_what_it_covers() {
        let mut h = History::default();
        h.submit(0, &[acc(1, 0..8, true)]);
        h.submit(1, &[acc(1, 8..16, false)]);
        h.submit(2, &[acc(1, 0..16, true)]);
        // Tasks 0 and 1 are reached through task 2.
        assert_eq!(h.submit(3, &[acc(1, 4..12, true)]), [2]);
        // A partly covered access stays: task 3 did not cover task 2's 12..16.
        assert_eq!(h.submit(4, &[acc(1, 14..15, false)]), [2]);
    }

    /// Accesses of `tasks` tasks on two 16-byte buffers.
    fn graphs() -> impl Strategy<Value = Vec<Vec<Access>>> {
        let access = (0u64..2, 0usize..16, 0usize..17, any::<bool>()).prop_map(|(b, s, e, w)| {
            let (s, e) = if s <= e { (s, e) } else { (e, s) };
            acc(b, s..e, w)
        });
        prop::collection::vec(prop::collection::vec(access, 1..3), 1..24)
    }

    /// The plain rule, byte by byte: the two tasks touch a common byte of a buffer and one of
    /// them writes it.
    fn conflicts(x: &[Access], y: &[Access]) -> bool {
        x.iter().any(|a| {
            y.iter().any(|b| {
                a.buf == b.buf
                    && (a.write || b.write)
                    && a.bytes.clone().any(|i| b.bytes.contains(&i))
            })
        })
    }

    proptest! {
        /// Against the plain rule (every earlier task that touches a common byte, one of the
        /// two writing): every such pair is ordered through the edges (the transitive
        /// closure), and every direct edge is such a pair.
        #[test]
        fn edges_order_exactly_the_conflicts(tasks in graphs()) {
            let n = tasks.len();
            let mut h = History::default();
            let mut reach = vec![vec![false; n]; n]; // reach[j][i]: j waits for i
            for (j, accesses) in tasks.iter().enumerate() {
                for i in h.submit(j, accesses) {
                    prop_assert!(i < j);
                    let conflict = conflicts(&tasks[i], accesses);
                    prop_assert!(conflict, "edge {i} -> {j} without a common byte");
                    reach[j][i] = true;
                    let through_i = reach[i].clone();
                    for (k, r) in through_i.into_iter().enumerate() {
                        reach[j][k] |= r;
                    }
                }
            }
            for j in 0..n {
                for i in 0..j {
                    let conflict = conflicts(&tasks[i], &tasks[j]);
                    prop_assert!(!conflict || reach[j][i], "{j} is not ordered after {i}");
                }
            }
        }
    }
}
