//! The device-graph plan of a task graph captured on the CPU runtime: a node per launching
//! task, ordering passed through tasks that launch nothing, keep-alive edges left out.

use std::time::Duration;

use half::bf16;
use simpler_core::*;
use simpler_cpu::CpuPlatform;
use simpler_cuda::graph_plan::{KernelArg, KernelLaunch, PlanNode, plan};
use simpler_cuda::{CudaDevice, CudaError, DeviceGraph, KernelCache};

const A: KernelId = KernelId(1);
const B: KernelId = KernelId(2);
const HOST_ONLY: KernelId = KernelId(3);

fn worker() -> Worker {
    let w = Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(2),
            timeouts: Some(Timeouts {
                scheduler: Duration::from_millis(2000),
                op_execute: Duration::from_millis(4000),
                stream_sync: Duration::from_millis(8000),
            }),
            idle_spin: None,
        },
    )
    .unwrap();
    for (id, name) in [(A, "a"), (B, "b"), (HOST_ONLY, "host_only")] {
        w.register_kernel(KernelSpec::new(id, name, EngineClass::Vector, |ctx| {
            ctx.write_chunk::<f32>(0, 4)?
                .iter_mut()
                .for_each(|v| *v += 1.0);
            Ok(())
        }))
        .unwrap();
    }
    w
}

/// The seven-task graph of the tests below: t0 a(x), t1 a(y), t2 dummy after both, t3 b(z)
/// after t2, t4 host_only(z), t5 b(z), t6 b(x).
fn capture(w: &Worker) -> CapturedGraph {
    let bufs: Vec<Buffer> = (0..3)
        .map(|_| w.buffer_from(&[0.0f32; 4]).unwrap())
        .collect();
    let args = RunArgs {
        buffers: bufs,
        scalars: vec![],
    };
    let (_, graph) = w
        .capture_fn(
            "plan",
            args,
            &CallConfig::default(),
            GraphShape::new(),
            |o, a| {
                let t = |i: usize| a.buffers[i].tensor(DType::F32, &[4]).unwrap();
                let t0 = o.submit(Task::new(A).in_out(&t(0)))?;
                let t1 = o.submit(Task::new(A).in_out(&t(1)))?;
                let t2 = o.submit(Task::dummy().after(t0.id).after(t1.id))?;
                o.submit(Task::new(B).in_out(&t(2)).after(t2.id))?;
                o.submit(Task::new(HOST_ONLY).in_out(&t(2)))?;
                o.submit(Task::new(B).in_out(&t(2)))?;
                o.submit(Task::new(B).in_out(&t(0)))?;
                Ok(())
            },
        )
        .unwrap();
    graph
}

/// t0 a(x), t1 a(y), t2 dummy after both, t3 b(z) after t2, t4 host_only(z) (waits for t3),
/// t5 b(z) (waits for t4), t6 b(x) (waits for t0). Nodes: t0, t1, t3 after {t0, t1},
/// t5 after {t3} (through t4), t6 after {t0}.
#[test]
fn ordering_passes_through_tasks_that_launch_nothing() {
    let w = worker();
    let graph = capture(&w);
    assert_eq!(graph.tasks().len(), 7);
    let p = plan(&graph, |_, task| {
        Ok(match task.kernel {
            Some(A) => Some("a"),
            Some(B) => Some("b"),
            _ => None,
        })
    })
    .unwrap();
    assert_eq!(p.fingerprint, graph.fingerprint());
    let node = |task, launch, deps: &[usize]| PlanNode {
        task,
        launch,
        deps: deps.to_vec(),
    };
    assert_eq!(
        p.nodes,
        vec![
            node(0, "a", &[]),
            node(1, "a", &[]),
            node(3, "b", &[0, 1]),
            node(5, "b", &[2]),
            node(6, "b", &[0]),
        ]
    );
    // A kernel the platform cannot launch stops the plan with its error.
    let e = plan(&graph, |i, _| -> Result<Option<()>, CudaError> {
        if i == 3 {
            Err(CudaError::invalid("kernel", "no device code for `b`"))
        } else {
            Ok(Some(()))
        }
    })
    .unwrap_err();
    assert!(e.to_string().contains("no device code"), "{e}");
}

/// On a device: the plan of the captured graph built as a CUDA graph, t0 and t1 filling `x`
/// and `g` with random values and t3 (after both, through the dummy t2) normalising `x` with
/// `g`; the output is checked against plain host arithmetic on the downloaded inputs, so a
/// missing edge (the norm reading zeros) fails. Skips without a device unless
/// `SIMPLER_REQUIRE_CUDA=1`.
#[test]
fn the_plan_runs_as_a_cuda_graph() {
    let dev = match CudaDevice::open(0, &KernelCache::default_location()) {
        Ok((dev, _)) => dev,
        Err(e) if std::env::var("SIMPLER_REQUIRE_CUDA").is_ok_and(|v| v == "1") => {
            panic!("SIMPLER_REQUIRE_CUDA=1 but {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED the_plan_runs_as_a_cuda_graph: {e}");
            return;
        }
    };
    let w = worker();
    let graph = capture(&w);
    const N: usize = 1024;
    let x = dev.alloc(N * 4).unwrap();
    let g = dev.alloc(N * 4).unwrap();
    let out = dev.alloc(N * 2).unwrap();
    let fill = |p: u64, seed: u64, offset: f32| KernelLaunch {
        kernel: "fill_random_f32",
        grid: (4, 1, 1),
        block: (256, 1, 1),
        args: vec![
            KernelArg::Ptr(p),
            KernelArg::U64(N as u64),
            KernelArg::U64(seed),
            KernelArg::F32(offset),
            KernelArg::F32(0.5),
        ],
    };
    let p = plan(&graph, |i, _| {
        Ok(match i {
            0 => Some(fill(x.ptr(), 11, 0.0)),
            1 => Some(fill(g.ptr(), 12, 1.0)),
            3 => Some(KernelLaunch {
                kernel: "rms_norm",
                grid: (1, 1, 1),
                // The block size the kernel is written for (it holds the row in registers).
                block: (simpler_kernels_cuda::NORM_THREADS, 1, 1),
                args: vec![
                    KernelArg::Ptr(x.ptr()),
                    KernelArg::Ptr(g.ptr()),
                    KernelArg::Ptr(out.ptr()),
                    // No deferred 1/rms: the ordinary norm.
                    KernelArg::Ptr(0),
                    KernelArg::I32(N as i32),
                    KernelArg::F32(1e-6),
                ],
            }),
            _ => None,
        })
    })
    .unwrap();
    assert_eq!(
        p.nodes.iter().map(|n| n.deps.clone()).collect::<Vec<_>>(),
        vec![vec![], vec![], vec![0, 1]]
    );
    // SAFETY: every pointer is a live buffer of this device sized for its launch (x, g: N fp32;
    // out: N bf16; the fills write N values), and each block size is the kernel's.
    let dg = unsafe { DeviceGraph::build(&dev, &p) }.unwrap();
    assert_eq!((dg.nodes(), dg.fingerprint()), (3, graph.fingerprint()));
    dg.launch().unwrap();
    dev.synchronize().unwrap();
    let (mut xs, mut gs, mut os) = (vec![0f32; N], vec![0f32; N], vec![bf16::ZERO; N]);
    x.download(&mut xs).unwrap();
    g.download(&mut gs).unwrap();
    out.download(&mut os).unwrap();
    assert!(xs.iter().any(|&v| v != 0.0));
    let inv = 1.0 / (xs.iter().map(|v| v * v).sum::<f32>() / N as f32 + 1e-6).sqrt();
    for i in 0..N {
        let want = xs[i] * inv * gs[i];
        let got = os[i].to_f32();
        assert!(
            (got - want).abs() <= 1e-2 * want.abs() + 1e-3,
            "[{i}] {got} vs {want}"
        );
    }
}
