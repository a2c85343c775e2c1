//! Safe code cannot get aliasing slices, whatever it passes: the kernel accessors keep each
//! block's share apart, the runtime orders every write after the earlier readers and writers of
//! its bytes, and the untracked forms are refused unless requested through `unsafe`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use simpler_core::*;
use simpler_cpu::CpuPlatform;

const CHUNKS_DIFFER: KernelId = KernelId(1);
const ROWS_THEN_COLS: KernelId = KernelId(2);
const SAME_SPLIT: KernelId = KernelId(3);
const SLOW_READ: KernelId = KernelId(4);
const SLOW_WRITE: KernelId = KernelId(5);
const WRITE_2: KernelId = KernelId(6);
const RECTS: KernelId = KernelId(7);

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
    // Block b writes rows 2b..2b+2 of columns 0..2 and, as a second rectangle, the same rows
    // of columns 2..4, block 0's moved down by the scalar: with 0 the rectangles tile the
    // matrix; with 1 block 0's second rectangle (rows 1..3) overlaps block 1's (rows 2..4).
    w.register_kernel(KernelSpec::new(
        RECTS,
        "rects",
        EngineClass::Vector,
        |ctx| {
            let b = 2 * ctx.block_idx();
            let shift = if b == 0 { ctx.scalar_usize(0)? } else { 0 };
            let mut left = ctx.write_rect::<f32>(0, b..b + 2, 0..2)?;
            let mut right = ctx.write_rect::<f32>(0, b + shift..b + shift + 2, 2..4)?;
            for r in 0..2 {
                left.row(r).fill(10.0 + b as f32);
                right.row(r).fill(20.0 + b as f32);
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

/// Rectangles a kernel picks at run time: disjoint ones are written where they say; an
/// overlapping one fails the run naming both blocks' rectangles (whichever block asked second),
/// and the worker runs on.
#[test]
fn run_time_rectangles_are_disjoint_or_refused() {
    let w = worker();
    let run = |shift: u64| {
        let buf = w.buffer_from(&[0.0f32; 16]).unwrap();
        let args = RunArgs {
            buffers: vec![buf.clone()],
            scalars: vec![],
        };
        w.run_fn("rects", args, &CallConfig::default(), move |o, a| {
            let t = o.bind(&a.buffers[0], DType::F32, &[4, 4])?;
            o.submit(Task::new(RECTS).output_existing(&t).scalar(shift).blocks(2))?;
            Ok(())
        })
        .map(|_| buf.read::<f32>().unwrap())
    };
    let v = run(0).unwrap();
    let row = |l: f32, r: f32| [l, l, r, r];
    assert_eq!(
        v,
        [
            row(10.0, 20.0),
            row(10.0, 20.0),
            row(12.0, 22.0),
            row(12.0, 22.0)
        ]
        .concat()
    );
    match run(1) {
        Err(Error::Run(e)) => {
            assert_eq!(e.code, ErrorCode::KernelFailed, "{e}");
            assert!(e.detail.contains("overlaps rows"), "{e}");
        }
        other => panic!("overlapping rectangles were granted: {other:?}"),
    }
    assert_eq!(run(0).unwrap(), v);
}

/// Waits up to `bound` for `flag`; whether it was set.
fn wait_flag(flag: &AtomicBool, bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    while !flag.load(Ordering::SeqCst) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    flag.load(Ordering::SeqCst)
}

/// A worker whose `SLOW_READ` kernel waits (at most 500 ms) for `flag` before reading its
/// argument 0 into `seen`, whose `SLOW_WRITE` waits likewise before writing 1.0, and whose
/// `WRITE_2` writes 2.0 into argument 0 and then raises `flag`.
fn ordering_worker(flag: Arc<AtomicBool>, seen: Arc<Mutex<Vec<f32>>>) -> Worker {
    let w = worker();
    let (f, s) = (flag.clone(), seen);
    w.register_kernel(KernelSpec::new(
        SLOW_READ,
        "slow_read",
        EngineClass::Vector,
        move |ctx| {
            wait_flag(&f, Duration::from_millis(500));
            *s.lock().unwrap() = ctx.read::<f32>(0)?.to_vec();
            Ok(())
        },
    ))
    .unwrap();
    let f = flag.clone();
    w.register_kernel(KernelSpec::new(
        SLOW_WRITE,
        "slow_write",
        EngineClass::Vector,
        move |ctx| {
            wait_flag(&f, Duration::from_millis(500));
            ctx.write::<f32>(0)?.fill(1.0);
            Ok(())
        },
    ))
    .unwrap();
    let f = flag;
    w.register_kernel(KernelSpec::new(
        WRITE_2,
        "write_2",
        EngineClass::Vector,
        move |ctx| {
            ctx.write::<f32>(0)?.fill(2.0);
            f.store(true, Ordering::SeqCst);
            Ok(())
        },
    ))
    .unwrap();
    w
}

#[test]
fn a_writer_waits_for_earlier_readers_and_writers() {
    let flag = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let w = ordering_worker(flag.clone(), seen.clone());
    let buf = w.buffer_from(&[0.0f32; 8]).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    // Write-after-read, from safe code and with no explicit dependency: the writer must not
    // run while the reader may still read (the reader must see the old value).
    w.run_fn("war", args.clone(), &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[8])?;
        o.submit(Task::new(SLOW_READ).input(&t))?;
        o.submit(Task::new(WRITE_2).in_out(&t))?;
        Ok(())
    })
    .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![0.0; 8]);
    assert_eq!(buf.read::<f32>().unwrap(), vec![2.0; 8]);
    // OutputExisting over an earlier writer: the later write must win.
    flag.store(false, Ordering::SeqCst);
    w.run_fn("waw", args.clone(), &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[8])?;
        o.submit(Task::new(SLOW_WRITE).in_out(&t))?;
        o.submit(Task::new(WRITE_2).output_existing(&t))?;
        Ok(())
    })
    .unwrap();
    assert_eq!(buf.read::<f32>().unwrap(), vec![2.0; 8]);
    // set_tensor_data waits for the tasks still reading the region.
    flag.store(false, Ordering::SeqCst);
    let f = flag.clone();
    w.run_fn("set", args, &CallConfig::default(), move |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[8])?;
        o.submit(Task::new(SLOW_READ).input(&t))?;
        o.set_tensor_data(&t, &[3.0f32; 8], Duration::from_secs(5))?;
        f.store(true, Ordering::SeqCst);
        Ok(())
    })
    .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![2.0; 8]);
    assert_eq!(buf.read::<f32>().unwrap(), vec![3.0; 8]);
}

#[test]
fn untracked_forms_are_refused_from_safe_code() {
    let w = worker();
    let buf = w.buffer_from(&[0.0f32; 8]).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    let r = w.run_fn("nodep", args.clone(), &CallConfig::default(), |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[8])?;
        o.submit(Task::dummy().arg(ArgTag::NoDep, &t))?;
        Ok(())
    });
    match r {
        Err(Error::Run(e)) => assert!(e.hint.contains("unsafe Task::no_dep"), "{e}"),
        other => panic!("NoDep through Task::arg was accepted: {other:?}"),
    }
    let r = w.run_fn("manual", args, &CallConfig::default(), |o, _| {
        o.scope(ScopeKind::Manual, |_| Ok(()))
    });
    match r {
        Err(Error::Run(e)) => assert!(e.hint.contains("manual_scope"), "{e}"),
        other => panic!("a manual scope was opened from safe code: {other:?}"),
    }
    // The worker is unaffected.
    assert_eq!(run_on(&w, SAME_SPLIT, 2).unwrap().len(), 16);
}
