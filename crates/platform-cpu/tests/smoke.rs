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
            idle_spin: None,
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

#[test]
fn runs_can_be_submitted_polled_and_queued() {
    let w = worker(2);
    let buf = w.buffer_from(&[0.0f32; 8]).unwrap();
    w.register_orchestration("inc", |o, a| {
        let t = o.bind(&a.buffers[0], DType::F32, &[8])?;
        o.scope(ScopeKind::Auto, |o| {
            for _ in 0..a.scalars[0] {
                o.submit(Task::new(ADD_ONE).in_out(&t))?;
            }
            Ok(())
        })
    })
    .unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![1000],
    };
    let mut first = w
        .submit("inc", args.clone(), &CallConfig::default())
        .unwrap();
    // While the run holds the buffer, host access is refused instead of racing.
    let during = buf.read::<f32>();
    let second = w.submit("inc", args, &CallConfig::default()).unwrap();
    let r2 = second.wait().unwrap();
    let r1 = loop {
        if let Some(r) = first.poll() {
            break r.unwrap();
        }
        std::thread::yield_now();
    };
    assert!(r2.inv > r1.inv, "runs execute in submission order");
    assert_eq!(buf.read::<f32>().unwrap(), vec![2000.0; 8]);
    if let Err(e) = during {
        assert!(matches!(e, BufferError::InUse { .. }), "{e}");
    }
    // Registration errors and unknown names are reported, not panicked.
    assert!(matches!(
        w.register_kernel(KernelSpec::new(
            ADD_ONE,
            "again",
            EngineClass::Vector,
            |_| Ok(())
        )),
        Err(Error::Registry(_))
    ));
    assert!(matches!(
        w.register_orchestration("inc", |_, _| Ok(())),
        Err(Error::Registry(_))
    ));
    match w.run("nope", RunArgs::default(), &CallConfig::default()) {
        Err(Error::UnknownOrchestration { name, known }) => {
            assert_eq!(name, "nope");
            assert_eq!(known, "inc");
        }
        other => panic!("{other:?}"),
    }
    w.close().unwrap();
}

#[test]
fn sync_start_blocks_meet_at_the_barrier_and_predicates_skip() {
    const GANG: KernelId = KernelId(9);
    let w = worker(3);
    // Every block announces itself, meets the others at the barrier, and then must see all of
    // them announced: only possible if the blocks really run at the same time.
    static ARRIVED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    w.register_kernel(KernelSpec::new(GANG, "gang", EngineClass::Mix, |ctx| {
        ARRIVED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ctx.sync_barrier()?;
        let seen = ARRIVED.load(std::sync::atomic::Ordering::SeqCst);
        if seen != ctx.block_num() {
            return Err(KernelError::new(format!(
                "block {} saw {seen} arrivals",
                ctx.block_idx()
            )));
        }
        ctx.write_chunk::<u32>(0, 1)?[0] = ctx.block_idx() as u32 + 1;
        Ok(())
    }))
    .unwrap();
    fn never(_: &TaskCtx<'_>) -> bool {
        false
    }
    let buf = w.alloc(12).unwrap();
    let flag = w.buffer_from(&[5.0f32; 4]).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone(), flag.clone()],
        scalars: vec![],
    };
    let r = w
        .run_fn("gang", args, &CallConfig::default(), |o, a| {
            let t = o.bind(&a.buffers[0], DType::U32, &[3])?;
            let f = o.bind(&a.buffers[1], DType::F32, &[4])?;
            o.scope(ScopeKind::Auto, |o| {
                o.submit(
                    Task::new(GANG)
                        .output_existing(&t)
                        .blocks(3)
                        .require_sync_start(),
                )?;
                o.submit(Task::new(ADD_ONE).in_out(&f).predicate(never))?;
                Ok(())
            })
        })
        .unwrap();
    assert_eq!(buf.read::<u32>().unwrap(), vec![1, 2, 3]);
    assert_eq!(
        flag.read::<f32>().unwrap(),
        vec![5.0; 4],
        "the skipped task must not run"
    );
    assert_eq!(r.counters.skipped, 1);
}

#[test]
fn spmd_blocks_write_disjoint_column_shares_of_a_strided_view() {
    const COL_FILL: KernelId = KernelId(30);
    let w = worker(2);
    w.register_kernel(KernelSpec::new(
        COL_FILL,
        "col_fill",
        EngineClass::Vector,
        |ctx| {
            let mut share = ctx.write_block_cols::<f32>(0, ctx.scalar_usize(0)?)?;
            let (c0, n) = (share.first_col(), share.row_len());
            assert_eq!(share.view_row_len(), 30);
            let block = ctx.block_idx() as f32;
            for (r, row) in share.iter_mut().enumerate() {
                assert_eq!(row.len(), n);
                for (j, v) in row.iter_mut().enumerate() {
                    // Accumulate, so an element written by two blocks would show.
                    *v += (r * 1000 + c0 + j) as f32 + block / 100.0;
                }
            }
            Ok(())
        },
    ))
    .unwrap();
    let buf = w.buffer_from(&[0.0f32; 6 * 40]).unwrap();
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    w.run_fn("cols", args, &CallConfig::default(), |orch, args| {
        let t = orch.bind(&args.buffers[0], DType::F32, &[6, 40])?;
        let v = t.slice(1, 5, 35).expect("column view");
        orch.submit(Task::new(COL_FILL).in_out(&v).scalar(8).blocks(3))?;
        Ok(())
    })
    .unwrap();
    let got = buf.read::<f32>().unwrap();
    // Many blocks (tapered shares): every element written exactly once.
    let many = w.buffer_from(&[0.0f32; 6 * 40]).unwrap();
    let args = RunArgs {
        buffers: vec![many.clone()],
        scalars: vec![],
    };
    w.run_fn("cols-many", args, &CallConfig::default(), |orch, args| {
        let t = orch.bind(&args.buffers[0], DType::F32, &[6, 40])?;
        let v = t.slice(1, 5, 35).expect("column view");
        orch.submit(Task::new(COL_FILL).in_out(&v).scalar(1).blocks(12))?;
        Ok(())
    })
    .unwrap();
    let m = many.read::<f32>().unwrap();
    for r in 0..6 {
        for c in 5..35 {
            let v = m[r * 40 + c] - (r * 1000 + c - 5) as f32;
            assert!((0.0..0.115).contains(&v), "row {r} col {c}: block term {v}");
        }
    }
    // 30 columns in units of 8 over 3 blocks: units 2, 1, 1 (the rounding's excess on the
    // first share) -> columns 0..16, 16..24, 24..30.
    let block_of = |c: usize| match c {
        0..16 => 0.0,
        16..24 => 1.0,
        _ => 2.0,
    };
    for r in 0..6 {
        for c in 0..40 {
            let want = if (5..35).contains(&c) {
                (r * 1000 + c - 5) as f32 + block_of(c - 5) / 100.0
            } else {
                0.0
            };
            assert_eq!(got[r * 40 + c], want, "row {r} col {c}");
        }
    }
}

/// The idle spin is bounded by name, and both ends of its range run graphs whose cores wait on
/// each other (a serial chain leaves one core idle throughout; SPMD phases end on one core):
/// a core spinning the longest allowed still leaves each run at its end, and runs go on.
#[test]
fn idle_spin_is_bounded_and_both_ends_run() {
    let too_long = config::MAX_IDLE_SPIN + std::time::Duration::from_millis(1);
    match Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(2),
            timeouts: None,
            idle_spin: Some(too_long),
        },
    ) {
        Err(Error::Config(e)) => {
            assert_eq!(e.field, "WorkerConfig.idle_spin");
            assert!(e.reason.contains("at most"), "{e}");
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("an idle spin over the limit was accepted"),
    }
    for spin in [std::time::Duration::ZERO, config::MAX_IDLE_SPIN] {
        let w = Worker::new(
            CpuPlatform::new(),
            WorkerConfig {
                cores: Some(2),
                timeouts: None,
                idle_spin: Some(spin),
            },
        )
        .unwrap();
        assert_eq!(w.idle_spin(), spin);
        w.register_kernel(KernelSpec::new(
            ADD_ONE,
            "add_one",
            EngineClass::Vector,
            |ctx| {
                let x = ctx.write_chunk::<f32>(0, 64 / ctx.block_num())?;
                for v in x.iter_mut() {
                    *v += 1.0;
                }
                Ok(())
            },
        ))
        .unwrap();
        let buf = w.buffer_from(&[0.0f32; 64]).unwrap();
        for round in 1..=3 {
            let args = RunArgs {
                buffers: vec![buf.clone()],
                scalars: vec![],
            };
            w.run_fn("spin", args, &CallConfig::default(), |orch, args| {
                let t = orch.bind(&args.buffers[0], DType::F32, &[64])?;
                for i in 0..20 {
                    let task = Task::new(ADD_ONE).in_out(&t);
                    orch.submit(if i % 4 == 0 { task.blocks(2) } else { task })?;
                }
                Ok(())
            })
            .unwrap();
            assert_eq!(
                buf.read::<f32>().unwrap(),
                vec![20.0 * round as f32; 64],
                "spin {spin:?}, round {round}"
            );
        }
    }
}
