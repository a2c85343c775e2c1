//! Safe code cannot get aliasing slices from the kernel accessors, whatever it passes.

use std::time::Duration;

use simpler_core::*;
use simpler_cpu::CpuPlatform;

const CHUNKS_DIFFER: KernelId = KernelId(1);
const ROWS_THEN_COLS: KernelId = KernelId(2);
const SAME_SPLIT: KernelId = KernelId(3);

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
        },
    )
    .unwrap();
    // Block b asks for chunks of 4 - 2b: block 1's chunk 2..4 would overlap block 0's 0..4.
    w.register_kernel(KernelSpec::new(
        CHUNKS_DIFFER,
        "chunks_differ",
        EngineClass::Vector,
        |ctx| {
            let chunk = 4 - 2 * ctx.block_idx();
            ctx.write_chunk::<f32>(0, chunk)?.fill(1.0);
            Ok(())
        },
    ))
    .unwrap();
    // Block 0 takes a share of the rows, block 1 a share of the columns: they would overlap.
    w.register_kernel(KernelSpec::new(
        ROWS_THEN_COLS,
        "rows_then_cols",
        EngineClass::Vector,
        |ctx| {
            let mut rows = if ctx.block_idx() == 0 {
                ctx.write_block_rows::<f32>(0)?
            } else {
                ctx.write_block_cols::<f32>(0, 1)?
            };
            for r in rows.iter_mut() {
                r.fill(1.0);
            }
            Ok(())
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(
        SAME_SPLIT,
        "same_split",
        EngineClass::Vector,
        |ctx| {
            let mut cols = ctx.write_block_cols::<f32>(0, 2)?;
            let first = cols.first_col() as f32;
            for r in cols.iter_mut() {
                r.fill(first);
            }
            Ok(())
        },
    ))
    .unwrap();
    w
}

fn run_on(w: &Worker, kernel: KernelId, blocks: u32) -> Result<Vec<f32>, Error> {
    let buf = w.buffer_from(&[0.0f32; 16]).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    w.run_fn("split", args, &CallConfig::default(), move |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[4, 4])?;
        o.submit(Task::new(kernel).in_out(&t).blocks(blocks))?;
        Ok(())
    })?;
    Ok(buf.read::<f32>().unwrap())
}

#[test]
fn blocks_cannot_split_one_argument_two_ways() {
    let w = worker();
    for k in [CHUNKS_DIFFER, ROWS_THEN_COLS] {
        match run_on(&w, k, 2) {
            Err(Error::Run(e)) => {
                assert_eq!(e.code, ErrorCode::KernelFailed, "{e}");
                assert!(e.detail.contains("split"), "{e}");
            }
            other => panic!("kernel {k:?}: two splits of one argument were granted: {other:?}"),
        }
    }
    // One split taken by every block works, and the worker is fine after the failures.
    let v = run_on(&w, SAME_SPLIT, 2).unwrap();
    assert_eq!(v, [0.0, 0.0, 2.0, 2.0].repeat(4));
}
