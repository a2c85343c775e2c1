//! Replaying a captured graph on the orchestrator: the recorded scopes opened and closed and
//! the recorded tasks submitted, with their recorded edges, in the recorded order
//! (`graph.rs` argues why this keeps the orchestrator's guarantees).

use crate::clock::now_ns;
use crate::error::{ErrorCode, RunError};
use crate::graph::{ArgSource, CapturedGraph, GraphOp};
use crate::kernel::TensorArg;
use crate::orch::{Orchestrator, Producer};
use crate::task::TaskId;

impl Orchestrator {
    /// Submits `graph`'s tasks as its captured run did (without the dependency map).
    pub(crate) fn replay(&mut self, graph: &CapturedGraph) -> Result<(), RunError> {
        let g = &*graph.inner;
        // Buffers the orchestration bound itself are bound here, as `bind` did then.
        for b in &g.buffers[g.run_args..] {
            if !self.bound.contains_key(&b.id()) {
                if !b.bind() {
                    return Err(self.fail(RunError::new(
                        ErrorCode::InvalidArgs,
                        format!(
                            "buffer #{} of the replayed graph is bound to another run in flight",
                            b.id().0
                        ),
                        "wait for the other run to finish before replaying",
                    )));
                }
                self.bound.insert(b.id(), b.clone());
                self.run.bound.push(b.clone());
            }
        }
        let n = g.tasks.len();
        let mut ids = vec![TaskId(0); n];
        let mut blocks = vec![0usize; n];
        for op in &g.ops {
            match *op {
                GraphOp::Open(kind, site) => self.open_scope(kind, site)?,
                GraphOp::Close => self.close_innermost(),
                GraphOp::Submit(i) => self.replay_task(graph, i, &mut ids, &mut blocks)?,
            }
        }
        Ok(())
    }

    fn replay_task(
        &mut self,
        graph: &CapturedGraph,
        i: usize,
        ids: &mut [TaskId],
        blocks: &mut [usize],
    ) -> Result<(), RunError> {
        let t_submit = if self.run.swimlane >= 4 { now_ns() } else { 0 };
        self.check_fatal()?;
        self.maybe_yield();
        let g = &*graph.inner;
        let t = &g.tasks[i];
        let (scope_seq, ring) = {
            let f = self.scopes.last().expect("implicit scope");
            (f.seq, f.ring)
        };
        if ring != t.ring {
            // The same scopes open in the same order, so this cannot differ.
            return Err(self.fail(RunError::new(
                ErrorCode::InvalidArgs,
                format!(
                    "replaying task {i} ({:?}): ring {ring}, captured on ring {}",
                    t.kernel_name, t.ring
                ),
                "report this: a replay must place tasks on their captured rings",
            )));
        }
        self.producers.clear();
        self.producers.extend(t.deps.iter().map(|d| Producer {
            task: ids[d.task],
            source: d.source,
            overlap: d.overlap,
            wait: d.wait,
        }));
        let n_deps = t.deps.len();
        let heap_start =
            self.wait_for_room(ring, t.block_bytes, n_deps as u64, 0, &t.kernel_name)?;
        let (local, block_addr, dep_start) = self.cursors[ring as usize].allocate(
            heap_start,
            t.block_bytes,
            n_deps as u64,
            scope_seq,
        );
        let id = TaskId::in_run(self.run_tag, ring, local);
        {
            let f = self.scopes.last_mut().expect("scope");
            f.tasks += 1;
            f.heap += t.block_bytes;
            f.deps += n_deps as u64;
        }
        ids[i] = id;
        blocks[i] = block_addr;
        // Views of outputs move to where this run placed them; user-buffer views stay. The
        // description is written into the slot's previous one (no allocation once every slot
        // has held a task this wide).
        let epoch = self.epoch;
        let (ids, blocks) = (&*ids, &*blocks);
        self.fill_slot_with(id, local, dep_start, n_deps, |d| {
            d.id = id;
            d.epoch = epoch;
            d.kernel.clone_from(&g.specs[i]);
            d.class = t.class;
            d.block_num = t.blocks;
            d.sync_start = t.sync_start;
            d.args.clear();
            d.args.extend(t.args.iter().map(|a| {
                let mut tensor = a.view;
                if let ArgSource::Output { task, output } = a.source {
                    tensor.addr = blocks[task] + g.tasks[task].outputs[output].offset as usize;
                    tensor.owner = Some(ids[task]);
                    tensor.run_epoch = epoch;
                }
                TensorArg { tag: a.tag, tensor }
            }));
            d.scalars.clear();
            d.scalars.extend_from_slice(&t.scalars);
            d.predicate = t.predicate;
            d.timing_slot = t.timing_slot;
            d.splits.reset(t.blocks, t.args.len());
        });
        // The fingerprint is the captured one (the executor reports it); nothing to fold.
        self.wire(id, dep_start, n_deps);
        self.make_ready(id);
        if self.run.swimlane >= 4 {
            self.diag.submit_record(
                id,
                t_submit,
                now_ns(),
                self.run.swimlane_cap_per_core * self.run.cores.len(),
            );
        }
        Ok(())
    }
}
