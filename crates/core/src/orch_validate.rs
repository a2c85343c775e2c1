//! The orchestrator's argument checks at submit: a task's shape (tensor count, tags, scalars)
//! against its kernel's class, each tensor's usability (bound here, not freed, inside a live
//! scope), and explicit dependencies on earlier tasks of the same run.

use crate::error::{ErrorCode, Locator, RunError};
use crate::orch::{Orchestrator, invalid};
use crate::task::{
    ArgSpec, ArgTag, EngineClass, MAX_SCALAR_ARGS, MAX_TENSOR_ARGS, TIMING_SLOTS, Task, TaskId,
};
use crate::tensor::Tensor;

impl Orchestrator {
    pub(crate) fn validate_shape_of_task(
        &self,
        task: &Task,
        kname: &str,
        class: EngineClass,
    ) -> Result<(), RunError> {
        if task.args.len() > MAX_TENSOR_ARGS {
            return Err(self.fail(invalid(
                format!(
                    "kernel {kname:?}: {} tensor arguments, at most {MAX_TENSOR_ARGS}",
                    task.args.len()
                ),
                "split the task or pack tensors into fewer buffers",
            )));
        }
        if task.scalars.len() > MAX_SCALAR_ARGS {
            return Err(self.fail(invalid(
                format!(
                    "kernel {kname:?}: {} scalars, at most {MAX_SCALAR_ARGS}",
                    task.scalars.len()
                ),
                "pass the values in a tensor instead",
            )));
        }
        if task.unsafe_tag_requested {
            return Err(self.fail(invalid(
                format!("kernel {kname:?}: a NoDep argument was added with Task::arg"),
                "NoDep reads are not ordered against writers; request them with the unsafe Task::no_dep and uphold its contract, or use Input",
            )));
        }
        if task.block_num == 0 {
            return Err(self.fail(invalid(
                format!("kernel {kname:?}: block_num is 0"),
                "use blocks(n) with n >= 1",
            )));
        }
        if let Some(s) = task.timing_slot
            && s as usize >= TIMING_SLOTS
        {
            return Err(self.fail(invalid(
                format!("kernel {kname:?}: timing slot {s}, slots are 0..{TIMING_SLOTS}"),
                "use a slot below 8",
            )));
        }
        if task.sync_start && task.block_num > self.cores(class) as u32 {
            return Err(self.fail(
                RunError::new(
                    ErrorCode::RequireSyncStartInvalid,
                    format!(
                        "kernel {kname:?}: sync-start task of {} blocks, but only {} cores can run {} tasks",
                        task.block_num,
                        self.cores(class),
                        class.name()
                    ),
                    format!(
                        "use at most {} blocks, or give the run more cores (CallConfig.cores, up to the worker's WorkerConfig.cores)",
                        self.cores(class)
                    ),
                )
                .at(Locator { kernel: Some(kname.to_string()), ..Locator::default() }),
            ));
        }
        // A written argument may not overlap any other argument of the same task.
        let tensors: Vec<(usize, ArgTag, &Tensor)> = task
            .args
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a {
                ArgSpec::Tensor(tag, t) => Some((i, *tag, t)),
                ArgSpec::Output(_) => None,
            })
            .collect();
        for (x, &(i, ti, a)) in tensors.iter().enumerate() {
            for &(j, tj, b) in &tensors[x + 1..] {
                if (ti.is_written() || tj.is_written())
                    && a.buffer == b.buffer
                    && !a.disjoint_from(b, 1 << 16)
                {
                    return Err(self.fail(invalid(
                        format!(
                            "kernel {kname:?}: argument {i} ({}, offset {} shape {:?} strides {:?}) and argument {j} ({}, offset {} shape {:?} strides {:?}) of buffer #{} overlap (or are too large to prove apart) and one is written",
                            ti.name(),
                            a.offset,
                            a.shape(),
                            a.strides(),
                            tj.name(),
                            b.offset,
                            b.shape(),
                            b.strides(),
                            a.buffer.0
                        ),
                        "pass a written region once (InOut if the kernel also reads it)",
                    )));
                }
            }
        }
        Ok(())
    }

    pub(crate) fn check_tensor_usable(
        &self,
        i: usize,
        tag: ArgTag,
        t: &Tensor,
        kname: &str,
    ) -> Result<(), RunError> {
        if tag == ArgTag::Output {
            return Err(self.fail(invalid(
                format!("kernel {kname:?}: argument {i} is tagged Output but is an existing tensor"),
                "use Task::output(dtype, shape) for runtime-allocated outputs, or OutputExisting for your buffer",
            )));
        }
        match t.owner {
            None => {
                if !self.bound.contains_key(&t.buffer) {
                    return Err(self.fail(invalid(
                        format!("kernel {kname:?}: argument {i} views buffer #{} which is not bound to this run", t.buffer.0),
                        "pass the buffer in RunArgs or bind it with Orchestrator::bind",
                    )));
                }
            }
            Some(owner) => {
                if t.run_epoch != self.epoch {
                    return Err(self.fail(invalid(
                        format!("kernel {kname:?}: argument {i} is an output of an earlier run"),
                        "outputs live only within their run; copy data into a user buffer to keep it",
                    )));
                }
                let c = &self.cursors[owner.ring() as usize];
                let live = owner.local() >= c.reclaimed && owner.local() < c.next_local;
                if !live || !self.scope_is_open(c.meta(owner.local()).scope_seq) {
                    return Err(self.fail(invalid(
                        format!(
                            "kernel {kname:?}: argument {i} was created by {owner} in a scope that has ended; its memory may already be reused"
                        ),
                        "allocate it in an enclosing scope (Orchestrator::alloc) and write it with OutputExisting or InOut",
                    )));
                }
            }
        }
        Ok(())
    }

    pub(crate) fn validate_explicit_dep(&self, d: TaskId, kname: &str) -> Result<(), RunError> {
        // The tag first: an id of an earlier run (or of another worker's run) has a position
        // that may well be in range here, and would name whatever task holds it now.
        if d.run_tag() != self.run_tag {
            return Err(self.fail(invalid(
                format!(
                    "kernel {kname:?}: explicit dependency on {d}, which was not returned by a submit of this run (it comes from another run or worker, or was built by hand)"
                ),
                "task ids are valid only within the run that submitted them; depend only on ids returned by earlier submits of the same run",
            )));
        }
        let ok = (d.ring() as usize) < self.cursors.len()
            && d.local() < self.cursors[d.ring() as usize].next_local;
        if !ok {
            return Err(self.fail(invalid(
                format!("kernel {kname:?}: explicit dependency on {d}, which has not been submitted in this run"),
                "depend only on ids returned by earlier submits of the same run",
            )));
        }
        Ok(())
    }
}
