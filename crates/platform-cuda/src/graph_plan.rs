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
