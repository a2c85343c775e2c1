//! `simpler trace rings`: ring high-water marks per ring and per scope site against capacity,
//! with a warning for anything above [`WARN_FRACTION`].

use std::fmt::Write;

use simpler_core::trace::{RingStats, RingUsage, ScopeSiteUsage, Usage};

/// Fraction of capacity above which a resource is warned about.
pub const WARN_FRACTION: f64 = 0.80;

/// Resources above [`WARN_FRACTION`], as warning lines naming the knob to raise.
pub fn warnings(s: &RingStats) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |what: String, u: &Usage, knob: &str| {
        if u.fraction() > WARN_FRACTION {
            out.push(format!(
                "WARNING: {what} reached {:.0}% of capacity ({} of {}): consider raising {knob}",
                u.fraction() * 100.0,
                u.high_water,
                u.capacity
            ));
        }
    };
    for r in &s.rings {
        check(
            format!("ring {} task window", r.ring),
            &r.task_window,
            "CallConfig.runtime_env.ring_task_window",
        );
        check(
            format!("ring {} heap", r.ring),
            &r.heap,
            "CallConfig.runtime_env.ring_heap",
        );
        check(
            format!("ring {} dependency pool", r.ring),
            &r.dep_pool,
            "CallConfig.runtime_env.ring_dep_pool",
        );
    }
    check(
        "tensormap".into(),
        &s.tensormap,
        "CallConfig.tensormap_capacity",
    );
    for sc in &s.scopes {
        if let Some(r) = s.rings.iter().find(|r| r.ring == sc.ring) {
            for (what, u, knob) in site_usage(sc, r, &s.tensormap) {
                check(
                    format!("scope {} (ring {}) {what}", sc.site, sc.ring),
                    &u,
                    knob,
                );
            }
        }
    }
    out
}

/// A scope site's largest instance against its ring's capacities (and the map's): tasks,
/// heap, dependency pool, dependency map, each with the knob that sets the capacity.
fn site_usage(
    sc: &ScopeSiteUsage,
    r: &RingUsage,
    map: &Usage,
) -> [(&'static str, Usage, &'static str); 4] {
    let u = |high_water, capacity| Usage {
        high_water,
        capacity,
    };
    [
        (
            "tasks",
            u(sc.max_tasks, r.task_window.capacity),
            "CallConfig.runtime_env.ring_task_window",
        ),
        (
            "heap",
            u(sc.max_heap, r.heap.capacity),
            "CallConfig.runtime_env.ring_heap",
        ),
        (
            "dependency pool",
            u(sc.max_dep_pool, r.dep_pool.capacity),
            "CallConfig.runtime_env.ring_dep_pool",
        ),
        (
            "dependency map",
            u(sc.max_map_entries, map.capacity),
            "CallConfig.tensormap_capacity",
        ),
    ]
}

fn cell(u: &Usage) -> String {
    format!(
        "{}/{} ({:.1}%)",
        u.high_water,
        u.capacity,
        u.fraction() * 100.0
    )
}

/// The printed report: one line per ring, the tensormap, one line per scope site, warnings.
pub fn report(s: &RingStats) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<6} {:>28} {:>32} {:>28}",
        "ring", "task window", "heap (bytes)", "dep pool"
    );
    for r in &s.rings {
        let _ = writeln!(
            out,
            "{:<6} {:>28} {:>32} {:>28}",
            r.ring,
            cell(&r.task_window),
            cell(&r.heap),
            cell(&r.dep_pool)
        );
    }
    let _ = writeln!(out, "tensormap {}", cell(&s.tensormap));
    if !s.scopes.is_empty() {
        let _ = writeln!(
            out,
            "{:<32} {:>5} {:>8} {:>28} {:>32} {:>28} {:>28}",
            "scope site",
            "ring",
            "opened",
            "max tasks / window",
            "max heap / ring heap",
            "max deps / dep pool",
            "max map entries / map"
        );
        let none = RingUsage::default();
        for sc in &s.scopes {
            let ring = s.rings.iter().find(|r| r.ring == sc.ring).unwrap_or(&none);
            let [tasks, heap, deps, map] = site_usage(sc, ring, &s.tensormap).map(|(_, u, _)| u);
            let _ = writeln!(
                out,
                "{:<32} {:>5} {:>8} {:>28} {:>32} {:>28} {:>28}",
                sc.site,
                sc.ring,
                sc.opened,
                cell(&tasks),
                cell(&heap),
                cell(&deps),
                cell(&map)
            );
        }
    }
    let w = warnings(s);
    if w.is_empty() {
        let _ = writeln!(
            out,
            "no resource above {:.0}% of capacity",
            WARN_FRACTION * 100.0
        );
    }
    for line in w {
        let _ = writeln!(out, "{line}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_above_80_percent_only() {
        let s = RingStats {
            rings: vec![
                RingUsage {
                    ring: 0,
                    task_window: Usage {
                        high_water: 820,
                        capacity: 1024,
                    },
                    heap: Usage {
                        high_water: 80,
                        capacity: 100,
                    },
                    dep_pool: Usage {
                        high_water: 1,
                        capacity: 16,
                    },
                },
                RingUsage {
                    ring: 1,
                    heap: Usage {
                        high_water: 99,
                        capacity: 100,
                    },
                    ..Default::default()
                },
            ],
            tensormap: Usage {
                high_water: 10,
                capacity: 100,
            },
            scopes: vec![
                ScopeSiteUsage {
                    site: "decode.rs:10".into(),
                    ring: 1,
                    opened: 3,
                    max_tasks: 0,
                    max_heap: 90,
                    max_dep_pool: 0,
                    max_map_entries: 0,
                },
                // Ring 0's pool of 16 and the map of 100: 13 edges and 81 entries in one
                // instance warn; its 2 tasks and 8 heap bytes do not.
                ScopeSiteUsage {
                    site: "layer.rs:7".into(),
                    ring: 0,
                    opened: 1,
                    max_tasks: 2,
                    max_heap: 8,
                    max_dep_pool: 13,
                    max_map_entries: 81,
                },
            ],
        };
        let w = warnings(&s);
        assert_eq!(w.len(), 5, "{w:?}");
        assert!(
            w[3].contains(
                "scope layer.rs:7 (ring 0) dependency pool reached 81% of capacity (13 of 16)"
            ) && w[3].contains("CallConfig.runtime_env.ring_dep_pool"),
            "{w:?}"
        );
        assert!(
            w[4].contains(
                "scope layer.rs:7 (ring 0) dependency map reached 81% of capacity (81 of 100)"
            ) && w[4].contains("CallConfig.tensormap_capacity"),
            "{w:?}"
        );
        assert!(
            w[0].contains("ring 0 task window reached 80% of capacity (820 of 1024)")
                && w[0].contains("ring_task_window"),
            "{w:?}"
        );
        assert!(
            w[1].contains("ring 1 heap") && w[1].contains("99 of 100"),
            "{w:?}"
        );
        assert!(w[2].contains("scope decode.rs:10 (ring 1) heap"), "{w:?}");
        let text = report(&s);
        assert!(text.contains("820/1024 (80.1%)"), "{text}");
        assert!(text.contains("decode.rs:10"), "{text}");
        assert!(
            text.contains("max deps / dep pool") && text.contains("13/16 (81.2%)"),
            "{text}"
        );
    }
}
