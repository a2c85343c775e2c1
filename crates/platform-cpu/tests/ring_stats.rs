//! Ring statistics (`CallConfig::ring_stats`) of real runs.

use simpler_core::*;
use simpler_cpu::CpuPlatform;

/// `x[i] += 1` over its whole argument.
const INC: KernelId = KernelId(1);

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
    w.register_kernel(KernelSpec::new(INC, "inc", EngineClass::Vector, |ctx| {
        for v in ctx.write::<f32>(0)? {
            *v += 1.0;
        }
        Ok(())
    }))
    .unwrap();
    w
}

/// `ring_stats` of a real run: a scope opened at one site three times (3, 7 and 5 tasks), each
/// instance a chain of tasks updating one buffer in place: each task's one producer is the
/// task before it (the previous instance's last, for an instance's first task: submitted
/// serially, no producer has finished and dropped out of the edges), and each task inserts
/// one dependency-map entry. The site's largest instance: 7 tasks, 7 pool entries, 7 map
/// entries, no heap; the rings' and the map's high-water marks are at least that.
#[test]
fn ring_stats_of_a_real_run_count_each_scope_sites_largest_instance() {
    let w = worker(2);
    let x = w.buffer_from(&[0.0f32; 16]).unwrap();
    let args = RunArgs {
        buffers: vec![x.clone()],
        scalars: vec![],
    };
    // Serial: every task is submitted before any runs, so no producer has finished (and
    // dropped out of the edges) when its consumer is submitted.
    let cfg = CallConfig {
        ring_stats: true,
        mode: OrchMode::Serial,
        output_dir: Some(std::env::temp_dir()),
        ..CallConfig::default()
    };
    let r = w
        .run_fn("chains", args, &cfg, |o, a| {
            let t = o.bind(&a.buffers[0], DType::F32, &[16])?;
            for n in [3usize, 7, 5] {
                o.scope(ScopeKind::Auto, |o| {
                    for _ in 0..n {
                        o.submit(Task::new(INC).in_out(&t))?;
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(x.read::<f32>().unwrap(), vec![15.0; 16]);
    let s = r.ring_stats.expect("ring stats");
    let chains: Vec<_> = s
        .scopes
        .iter()
        .filter(|sc| sc.site.contains("ring_stats.rs"))
        .collect();
    assert_eq!(chains.len(), 1, "{:?}", s.scopes);
    let sc = chains[0];
    assert_eq!(sc.opened, 3);
    assert_eq!(
        (
            sc.max_tasks,
            sc.max_heap,
            sc.max_dep_pool,
            sc.max_map_entries
        ),
        (7, 0, 7, 7),
        "{sc:?}"
    );
    let ring = s.rings.iter().find(|u| u.ring == sc.ring).unwrap();
    assert!(ring.task_window.high_water >= 7, "{ring:?}");
    assert!(ring.dep_pool.high_water >= 7, "{ring:?}");
    assert!(s.tensormap.high_water >= 1, "{:?}", s.tensormap);
}
