//! Data exchange between the orchestrator and tasks: `get_tensor_data` / `set_tensor_data`
//! wait (with a timeout) for the tensor's producers, then copy.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::dtype::Element;
use crate::error::{ErrorCode, Locator, RunError};
use crate::orch::Orchestrator;
use crate::slot::state;
use crate::task::{ArgTag, TaskId};
use crate::tensor::Tensor;

impl Orchestrator {
    /// Waits until every task that writes `tensor` (its creator and the live writers of an
    /// overlapping region) has completed, then copies its elements out in row-major order.
    /// Fails with TENSOR_WAIT_TIMEOUT after `timeout`.
    pub fn get_tensor_data<T: Element>(
        &mut self,
        tensor: &Tensor,
        timeout: Duration,
    ) -> Result<Vec<T>, RunError> {
        self.prepare_host_access::<T>(tensor, false, timeout, "get_tensor_data")?;
        let mut out = Vec::with_capacity(tensor.numel() as usize);
        let base = tensor.addr as *const T;
        tensor.for_each_offset(|off| {
            // SAFETY: `off` indexes an element inside the tensor's buffer (views are bounds
            // checked when made), the buffer is host memory alive for the run, every producer
            // has completed so no task writes it now (writers submitted later do not exist yet), and
            // every bit pattern is a valid `T`.
            out.push(unsafe { base.add(off as usize).read() });
        });
        Ok(out)
    }

    /// Waits like [`Orchestrator::get_tensor_data`], and also for the live tasks reading the
    /// region, then writes `data` (row-major, one value per element) into `tensor`. Tasks
    /// submitted afterwards see the new contents. (Tasks reading it through `NoDep` are not
    /// tracked: their submitter promised that nothing writes it while they may run.)
    pub fn set_tensor_data<T: Element>(
        &mut self,
        tensor: &Tensor,
        data: &[T],
        timeout: Duration,
    ) -> Result<(), RunError> {
        if data.len() as u64 != tensor.numel() {
            return Err(self.fail(RunError::new(
                ErrorCode::InvalidArgs,
                format!(
                    "set_tensor_data: {} values for a tensor of shape {:?}",
                    data.len(),
                    tensor.shape()
                ),
                "pass exactly one value per element",
            )));
        }
        self.prepare_host_access::<T>(tensor, true, timeout, "set_tensor_data")?;
        let base = tensor.addr as *mut T;
        let mut i = 0;
        tensor.for_each_offset(|off| {
            // SAFETY: as in `get_tensor_data`; the element is in bounds and no task writes or
            // reads it concurrently: the creator and every live writer and tracked reader of
            // the region have completed, tasks submitted later wait for nothing but are not
            // submitted yet, and `NoDep` readers are excluded by `Task::no_dep`'s contract.
            unsafe { base.add(off as usize).write(data[i]) };
            i += 1;
        });
        Ok(())
    }

    /// Waits for the tensor's creator and the live writers of its region (and, to write it,
    /// the live readers too).
    fn prepare_host_access<T: Element>(
        &mut self,
        tensor: &Tensor,
        write: bool,
        timeout: Duration,
        what: &str,
    ) -> Result<(), RunError> {
        self.check_fatal()?;
        if self.capture.is_some() {
            return Err(self.fail(RunError::new(
                ErrorCode::InvalidArgs,
                format!(
                    "{what} in a captured run: data the orchestration reads or writes mid-run cannot be replayed"
                ),
                "keep host data exchange out of captured runs (put per-run values in buffers written before the run)",
            )));
        }
        if tensor.dtype != T::DTYPE {
            return Err(self.fail(RunError::new(
                ErrorCode::InvalidArgs,
                format!(
                    "{what}: the tensor holds {}, {} was asked for",
                    tensor.dtype,
                    T::DTYPE
                ),
                "use the element type the tensor was created with",
            )));
        }
        if !self.run.host_memory {
            return Err(self.fail(RunError::new(
                ErrorCode::InvalidArgs,
                format!("{what}: this platform's memory is not host-accessible"),
                "copy results into a user buffer and read it after the run",
            )));
        }
        self.validate_tensor_for_host(tensor, what)?;
        let mut producers: Vec<TaskId> = tensor.owner.into_iter().collect();
        let mut hits = Vec::new();
        self.map
            .lookup(&tensor.region(), write, &self.run.arena.rings, &mut hits);
        producers.extend(hits.iter().map(|h| h.task));
        let deadline = Instant::now() + timeout;
        for p in producers {
            let mut spins = 0u32;
            loop {
                self.check_fatal()?;
                let s = self.run.arena.rings.slot(p);
                if s.task_local.load(Ordering::Acquire) != p.local()
                    || s.state.load(Ordering::Acquire) >= state::COMPLETED
                {
                    break;
                }
                if self.serial {
                    return Err(self.fail(self.wait_error(
                        p,
                        what,
                        "serial mode runs nothing until the orchestration returns, so this wait can never end",
                        "run in overlapped mode (CallConfig.mode = Overlapped) to read task results during orchestration",
                    )));
                }
                if Instant::now() >= deadline {
                    return Err(self.fail(self.wait_error(
                        p,
                        what,
                        &format!("the producer did not complete within {timeout:?}"),
                        &format!("pass a longer timeout to {what} (e.g. {:?})", timeout * 4),
                    )));
                }
                spins += 1;
                if spins < 64 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
        Ok(())
    }

    fn wait_error(&self, p: TaskId, what: &str, why: &str, hint: &str) -> RunError {
        let s = self.run.arena.rings.slot(p);
        let st = state::name(s.state.load(Ordering::Acquire));
        let kernel = s.desc().kernel_name();
        RunError::new(
            ErrorCode::TensorWaitTimeout,
            format!("{what} waited for {p} ({kernel}), which is {st}: {why}"),
            hint,
        )
        .at(Locator {
            task: Some(p),
            kernel: Some(kernel),
            ring: Some(p.ring()),
            core: None,
        })
    }

    fn validate_tensor_for_host(&self, tensor: &Tensor, what: &str) -> Result<(), RunError> {
        // Same validity rules as a task argument read by the orchestrator.
        self.check_tensor_usable(0, ArgTag::Input, tensor, what)
    }
}
