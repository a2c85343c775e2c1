//! A replayed graph refills the task slots' descriptions in place: once the slots have held
//! the graph's tasks, replaying a graph of more tasks allocates no more than replaying a short
//! one (the per-run allocations, a report and its vectors, do not depend on the task count).
//! Its own test binary: the counting allocator sees every thread of the process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use simpler_core::*;
use simpler_cpu::CpuPlatform;

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counter is a plain
// atomic add.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// `out[i] = in[i] * scale + 1` with the task's f32 scalar.
const STEP: KernelId = KernelId(1);

const N: u64 = 64;

/// A chain of `len` tasks from buffer 0 into buffer 1, intermediates on the ring heap.
fn chain(len: usize) -> impl Fn(&mut Orchestrator, &RunArgs) -> Result<(), RunError> {
    move |o, a| {
        let x = o.bind(&a.buffers[0], DType::F32, &[N])?;
        let y = o.bind(&a.buffers[1], DType::F32, &[N])?;
        o.scope(ScopeKind::Auto, |o| {
            let mut cur = x;
            for _ in 0..len - 1 {
                cur = o
                    .submit(
                        Task::new(STEP)
                            .input(&cur)
                            .output(DType::F32, &[N])
                            .scalar_f32(0.5),
                    )?
                    .output(0);
            }
            o.submit(
                Task::new(STEP)
                    .input(&cur)
                    .output_existing(&y)
                    .scalar_f32(0.5),
            )?;
            Ok(())
        })
    }
}

#[test]
fn replaying_more_tasks_allocates_no_more() {
    let w = Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(2),
            timeouts: None,
            idle_spin: None,
        },
    )
    .unwrap();
    w.register_kernel(KernelSpec::new(STEP, "step", EngineClass::Vector, |ctx| {
        let s = ctx.scalar_f32(0)?;
        let x = ctx.read::<f32>(0)?;
        for (o, v) in ctx.write::<f32>(1)?.iter_mut().zip(x) {
            *o = v * s + 1.0;
        }
        Ok(())
    }))
    .unwrap();
    let x = w.buffer_from(&vec![1.0f32; N as usize]).unwrap();
    let y = w.alloc(N as usize * 4).unwrap();
    let args = RunArgs {
        buffers: vec![x, y],
        scalars: vec![],
    };
    let cfg = CallConfig::default();
    let shape = GraphShape::new().with("n", N);
    let (short, long) = (8usize, 200usize);
    let (_, g_short) = w
        .capture_fn("short", args.clone(), &cfg, shape.clone(), chain(short))
        .unwrap();
    let (_, g_long) = w
        .capture_fn("long", args.clone(), &cfg, shape.clone(), chain(long))
        .unwrap();
    // Allocations of one replay, the fewest of a few (a thread may allocate for its own
    // reasons now and then).
    let count = |g: &CapturedGraph| {
        (0..5)
            .map(|_| {
                let before = ALLOCS.load(Ordering::Relaxed);
                w.replay(g, args.clone(), &cfg, &shape).unwrap();
                ALLOCS.load(Ordering::Relaxed) - before
            })
            .min()
            .unwrap()
    };
    // Warm: every slot the long chain uses has held a task.
    for _ in 0..3 {
        count(&g_long);
    }
    let (a_short, a_long) = (count(&g_short), count(&g_long));
    assert!(
        a_long < a_short + (long - short) / 4,
        "replaying {long} tasks allocated {a_long} times, {short} tasks {a_short} times"
    );
    println!("allocations per replay: {short} tasks {a_short}, {long} tasks {a_long}");
}
