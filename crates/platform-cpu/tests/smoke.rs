//! First end-to-end checks of the runtime on the CPU platform.

use simpler_core::*;
use simpler_cpu::CpuPlatform;

const ADD_ONE: KernelId = KernelId(1);
const SCALE: KernelId = KernelId(2);

fn worker(cores: usize) -> Worker {
    let w = Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(cores),
            timeouts: None,
        },
    )
    .unwrap();
    w.register_kernel(KernelSpec::new(
        ADD_ONE,
        "add_one",
        EngineClass::Vector,
        |ctx| {
            let x = ctx.write::<f32>(0)?;
            for v in x.iter_mut() {
                *v += 1.0;
            }
            Ok(())
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(
        SCALE,
        "scale",
        EngineClass::Vector,
        |ctx| {
            let s = ctx.scalar_f32(0)?;
            let x = ctx.read::<f32>(0)?.to_vec();
            let y = ctx.write_chunk::<f32>(1, x.len().div_ceil(ctx.block_num()))?;
            let lo = ctx.block_idx() * x.len().div_ceil(ctx.block_num());
            for (i, v) in y.iter_mut().enumerate() {
                *v = x[lo + i] * s;
            }
            Ok(())
        },
    ))
    .unwrap();
    w
}

#[test]
fn chain_of_in_out_tasks_runs_in_order() {
    let w = worker(2);
    let buf = w.buffer_from(&[0.0f32; 64]).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    let report = w
        .run_fn("chain", args, &CallConfig::default(), |orch, args| {
            let t = orch.bind(&args.buffers[0], DType::F32, &[64])?;
            for _ in 0..100 {
                orch.submit(Task::new(ADD_ONE).in_out(&t))?;
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(buf.read::<f32>().unwrap(), vec![100.0; 64]);
    assert_eq!(report.counters.tasks, 100);
    assert_eq!(report.counters.blocks, 100);
    eprintln!("{:#?}", report);
    let t = std::time::Instant::now();
    drop(w);
    eprintln!("drop {:?}", t.elapsed());
}

#[test]
fn outputs_flow_through_scopes_and_spmd_blocks() {
    let w = worker(2);
    let src = w
        .buffer_from(&(0..1000).map(|i| i as f32).collect::<Vec<_>>())
        .unwrap();
    let dst = w.alloc(4000).unwrap();
    let args = RunArgs {
        buffers: vec![src.clone(), dst.clone()],
        scalars: vec![],
    };
    w.run_fn("spmd", args, &CallConfig::default(), |orch, args| {
        let x = orch.bind(&args.buffers[0], DType::F32, &[1000])?;
        let y = orch.bind(&args.buffers[1], DType::F32, &[1000])?;
        orch.scope(ScopeKind::Auto, |o| {
            let a = o.submit(
                Task::new(SCALE)
                    .input(&x)
                    .output(DType::F32, &[1000])
                    .scalar_f32(2.0)
                    .blocks(7),
            )?;
            o.submit(
                Task::new(SCALE)
                    .input(&a.output(0))
                    .output_existing(&y)
                    .scalar_f32(3.0)
                    .blocks(3),
            )?;
            Ok(())
        })
    })
    .unwrap();
    let got = dst.read::<f32>().unwrap();
    for (i, v) in got.iter().enumerate() {
        assert_eq!(*v, i as f32 * 6.0);
    }
}
