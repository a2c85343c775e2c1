//! From the runtime's captured task graph to the nodes and edges of a device graph.
//!
//! A [`CapturedGraph`] lists a run's tasks in a topological order with the producers each one
//! waits for. A device graph (a CUDA graph) has a node per kernel launch and an edge per
//! ordering; tasks that launch nothing on the device (dummy and barrier tasks, tensor
//! allocations, and any kernel the platform maps to no launch) become no node, and their
//! ordering passes through them: a node depends on the nearest launching tasks behind every
//! path of waiting edges. Keep-alive edges (`wait == false`) order nothing and are left out.
//!
//! This module is platform-neutral (it makes no CUDA call): the caller says what each task
//! launches, and the CUDA side turns the plan's nodes into kernel nodes.

use simpler_core::{CapturedGraph, GraphTask};
use simpler_kernels_cuda::ParamKind;

use crate::CudaError;

/// One kernel argument, passed by value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// A device pointer.
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `unsigned long long`.
    U64(u64),
    /// `float`.
    F32(f32),
}

impl KernelArg {
    /// The value's bytes, in the first 4 or 8 of an 8-byte slot (little-endian, as the driver
    /// reads a parameter of that size from the slot's address).
    pub fn slot(self) -> [u8; 8] {
        let mut out = [0u8; 8];
        match self {
            KernelArg::Ptr(v) | KernelArg::U64(v) => out = v.to_le_bytes(),
            KernelArg::I32(v) => out[..4].copy_from_slice(&v.to_le_bytes()),
            KernelArg::F32(v) => out[..4].copy_from_slice(&v.to_le_bytes()),
        }
        out
    }

    /// Whether this value fits a parameter of `kind` (a non-negative `int` also fills a `u32`).
    pub fn fits(self, kind: ParamKind) -> bool {
        match (self, kind) {
            (KernelArg::I32(v), ParamKind::U32) => v >= 0,
            _ => matches!(
                (self, kind),
                (KernelArg::Ptr(_), ParamKind::Ptr)
                    | (KernelArg::U64(_), ParamKind::U64)
                    | (KernelArg::I32(_), ParamKind::I32)
                    | (KernelArg::F32(_), ParamKind::F32)
            ),
        }
    }
}

/// Checks `args` against kernel `name`'s parameters `params` (from its signature): the same
/// number, each of a fitting kind. The driver reads one slot per parameter the kernel
/// declares, so a short or mistyped list must never reach it; the error names the kernel and
/// the first difference.
pub fn check_args(name: &str, params: &[ParamKind], args: &[KernelArg]) -> Result<(), CudaError> {
    if params.len() != args.len() {
        return Err(CudaError::invalid(
            "launch",
            format!(
                "`{name}` takes {} arguments, {} given",
                params.len(),
                args.len()
            ),
        ));
    }
    match params.iter().zip(args).position(|(&p, &a)| !a.fits(p)) {
        Some(i) => Err(CudaError::invalid(
            "launch",
            format!(
                "`{name}` argument {i}: {:?} given for a {:?} parameter",
                args[i], params[i]
            ),
        )),
        None => Ok(()),
    }
}

/// One kernel launch of `simpler-kernels-cuda`: the kernel's name, the launch shape and the
/// arguments in the kernel's order.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelLaunch {
    /// The `extern "C"` kernel name.
    pub kernel: &'static str,
    /// Grid dimensions.
    pub grid: (u32, u32, u32),
    /// Block dimensions.
    pub block: (u32, u32, u32),
    /// Arguments.
    pub args: Vec<KernelArg>,
}

/// One device-graph node: the launch of one captured task.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanNode<L> {
    /// The task's index in [`CapturedGraph::tasks`].
    pub task: usize,
    /// What it launches.
    pub launch: L,
    /// The nodes (indices into [`GraphPlan::nodes`]) it must follow, ascending, each once.
    pub deps: Vec<usize>,
}

/// The nodes of a device graph in a topological order, and the captured graph's fingerprint
/// (a platform caches its executable graph under it).
#[derive(Clone, Debug, PartialEq)]
pub struct GraphPlan<L> {
    /// Topology fingerprint of the captured graph.
    pub fingerprint: u64,
    /// Nodes in the captured submission order.
    pub nodes: Vec<PlanNode<L>>,
}

/// The plan of `graph`: `launch_of(index, task)` says what a task launches (`None`: nothing,
/// and its ordering passes through). An error from `launch_of` (a kernel the platform has no
/// device code for) stops the plan.
pub fn plan<L>(
    graph: &CapturedGraph,
    mut launch_of: impl FnMut(usize, &GraphTask) -> Result<Option<L>, CudaError>,
) -> Result<GraphPlan<L>, CudaError> {
    let tasks = graph.tasks();
    // For each task: the nodes a consumer of it must follow (itself if it launches, else
    // what it follows).
    let mut frontier: Vec<Vec<usize>> = Vec::with_capacity(tasks.len());
    let mut nodes = Vec::new();
    for (i, task) in tasks.iter().enumerate() {
        let mut deps: Vec<usize> = Vec::new();
        for d in task.deps.iter().filter(|d| d.wait) {
            let Some(before) = frontier.get(d.task).filter(|_| d.task < i) else {
                return Err(CudaError::invalid(
                    "captured graph",
                    format!("task {i} waits for task {}, which is not before it", d.task),
                ));
            };
            deps.extend_from_slice(before);
        }
        deps.sort_unstable();
        deps.dedup();
        match launch_of(i, task)? {
            Some(launch) => {
                frontier.push(vec![nodes.len()]);
                nodes.push(PlanNode {
                    task: i,
                    launch,
                    deps,
                });
            }
            None => frontier.push(deps),
        }
    }
    Ok(GraphPlan {
        fingerprint: graph.fingerprint(),
        nodes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launch whose arguments differ from the kernel's signature is refused, by count and by
    /// kind, before anything could read a missing slot.
    #[test]
    fn launches_are_checked_against_the_kernels_signature() {
        let params = simpler_kernels_cuda::kernel_params("rms_norm").unwrap();
        let good = [
            KernelArg::Ptr(1),
            KernelArg::Ptr(2),
            KernelArg::Ptr(3),
            KernelArg::Ptr(0),
            KernelArg::I32(8),
            KernelArg::F32(1e-6),
        ];
        check_args("rms_norm", &params, &good).unwrap();
        // The list before the deferred-norm pointer was added: one short.
        let short = [good[0], good[1], good[2], good[4], good[5]];
        let e = check_args("rms_norm", &params, &short).unwrap_err();
        assert!(e.to_string().contains("takes 6 arguments, 5 given"), "{e}");
        let mut mistyped = good;
        mistyped[4] = KernelArg::F32(8.0);
        let e = check_args("rms_norm", &params, &mistyped).unwrap_err();
        assert!(e.to_string().contains("argument 4"), "{e}");
        assert!(KernelArg::I32(3).fits(ParamKind::U32));
        assert!(!KernelArg::I32(-1).fits(ParamKind::U32));
    }
}
