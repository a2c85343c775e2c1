//! A CUDA graph built node by node from a [`GraphPlan`]: one kernel node per planned launch,
//! with the plan's edges, instantiated once and launched as a whole.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUgraph, CUgraphExec, CUgraphNode};

use crate::CudaError;
use crate::graph_plan::{GraphPlan, KernelLaunch};
use crate::imp::device::CudaDevice;

fn check(what: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver {
            what,
            detail: format!("{r:?}"),
        })
    }
}

/// An instantiated CUDA graph of a plan (destroyed on drop).
pub struct DeviceGraph {
    dev: CudaDevice,
    graph: CUgraph,
    exec: CUgraphExec,
    fingerprint: u64,
    nodes: usize,
}

impl DeviceGraph {
    /// Builds and instantiates the graph of `plan` on `dev`: every node's kernel must be loaded
    /// (an error names it), its grid and block non-empty, and its arguments of the kernel's
    /// number and kinds (checked against the signature).
    ///
    /// # Safety
    /// Each node's pointer arguments must be live device memory of `dev` holding what its
    /// kernel reads and writes for that grid, and each block size one the kernel is written for
    /// (`cu/*.cu` say which) — none of which the host can check; the graph's launches then
    /// touch exactly that memory.
    pub unsafe fn build(
        dev: &CudaDevice,
        plan: &GraphPlan<KernelLaunch>,
    ) -> Result<DeviceGraph, CudaError> {
        dev.ctx
            .bind_to_thread()
            .map_err(crate::imp::device::driver_err("cuCtxSetCurrent"))?;
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: the context is current; `graph` receives a new graph, destroyed by `Drop`
        // (or below on failure).
        check("cuGraphCreate", unsafe {
            sys::cuGraphCreate(&mut graph, 0)
        })?;
        let mut out = DeviceGraph {
            dev: dev.clone(),
            graph,
            exec: std::ptr::null_mut(),
            fingerprint: plan.fingerprint,
            nodes: plan.nodes.len(),
        };
        let mut handles: Vec<CUgraphNode> = Vec::with_capacity(plan.nodes.len());
        for (i, node) in plan.nodes.iter().enumerate() {
            let l = &node.launch;
            let f = dev.function(l.kernel)?;
            let dims = [
                l.grid.0, l.grid.1, l.grid.2, l.block.0, l.block.1, l.block.2,
            ];
            if dims.contains(&0) {
                return Err(CudaError::invalid(
                    "launch",
                    format!("node {i} ({}) has an empty grid or block", l.kernel),
                ));
            }
            // The driver reads one slot per declared parameter: a list that does not match the
            // signature is refused here (it once read past a list one argument short).
            dev.check_args(l.kernel, &l.args)?;
            let mut slots: Vec<[u8; 8]> = l.args.iter().map(|a| a.slot()).collect();
            let mut params: Vec<*mut c_void> = slots
                .iter_mut()
                .map(|s| s.as_mut_ptr().cast::<c_void>())
                .collect();
            let deps: Vec<CUgraphNode> = node
                .deps
                .iter()
                .map(|&d| {
                    handles.get(d).copied().filter(|_| d < i).ok_or_else(|| {
                        CudaError::invalid(
                            "plan",
                            format!("node {i} depends on node {d}, not before it"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?;
            let p = sys::CUDA_KERNEL_NODE_PARAMS {
                func: f.cu_function(),
                gridDimX: l.grid.0,
                gridDimY: l.grid.1,
                gridDimZ: l.grid.2,
                blockDimX: l.block.0,
                blockDimY: l.block.1,
                blockDimZ: l.block.2,
                sharedMemBytes: 0,
                kernelParams: params.as_mut_ptr(),
                extra: std::ptr::null_mut(),
                kern: std::ptr::null_mut(),
                ctx: std::ptr::null_mut(),
            };
            let mut h: CUgraphNode = std::ptr::null_mut();
            // SAFETY: `graph` is live; `deps` are nodes of it; the driver copies the parameter
            // values (`slots`, alive for this call) when the node is added.
            check("cuGraphAddKernelNode", unsafe {
                sys::cuGraphAddKernelNode_v2(&mut h, out.graph, deps.as_ptr(), deps.len(), &p)
            })?;
            handles.push(h);
        }
        // SAFETY: `graph` is complete; `exec` receives the instance, destroyed by `Drop`.
        check("cuGraphInstantiate", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut out.exec, out.graph, 0)
        })?;
        Ok(out)
    }

    /// Launches the whole graph on the device's stream.
    pub fn launch(&self) -> Result<(), CudaError> {
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(crate::imp::device::driver_err("cuCtxSetCurrent"))?;
        // SAFETY: `exec` is a live instance of this context's graph.
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, self.dev.stream.cu_stream())
        })
    }

    /// The captured graph's fingerprint this graph was built from.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Kernel nodes.
    pub fn nodes(&self) -> usize {
        self.nodes
    }
}

impl Drop for DeviceGraph {
    fn drop(&mut self) {
        if self.dev.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: each handle is destroyed once, here; null ones were never created. A failure
        // leaks and nothing else can be done in a destructor.
        unsafe {
            if !self.exec.is_null() {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}
