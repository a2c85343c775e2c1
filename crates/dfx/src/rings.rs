//! `simpler trace rings`: ring high-water marks per ring and per scope site against capacity,
//! with a warning for anything above [`WARN_FRACTION`].

use std::fmt::Write;

use simpler_core::trace::{RingStats, Usage};

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
            let tasks = Usage {
                high_water: sc.max_tasks,
                capacity: r.task_window.capacity,
            };
            check(
                format!("scope {} (ring {}) tasks", sc.site, sc.ring),
                &tasks,
                "CallConfig.runtime_env.ring_task_window",
            );
            let heap = Usage {
                high_water: sc.max_heap,
                capacity: r.heap.capacity,
            };
            check(
                format!("scope {} (ring {}) heap", sc.site, sc.ring),
                &heap,
                "CallConfig.runtime_env.ring_heap",
            );
        }
    }
    out
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
            "{:<32} {:>5} {:>8} {:>28} {:>32}",
            "scope site", "ring", "opened", "max tasks / window", "max heap / ring heap"
        );
        for sc in &s.scopes {
            let ring = s.rings.iter().find(|r| r.ring == sc.ring);
            let tasks = Usage {
                high_water: sc.max_tasks,
                capacity: ring.map_or(0, |r| r.task_window.capacity),
            };
            let heap = Usage {
                high_water: sc.max_heap,
                capacity: ring.map_or(0, |r| r.heap.capacity),
            };
            let _ = writeln!(
                out,
                "{:<32} {:>5} {:>8} {:>28} {:>32}",
                sc.site,
                sc.ring,
                sc.opened,
                cell(&tasks),
                cell(&heap)
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
    use simpler_core::trace::{RingUsage, ScopeSiteUsage};

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
            scopes: vec![ScopeSiteUsage {
                site: "decode.rs:10".into(),
                ring: 1,
                opened: 3,
                max_tasks: 0,
                max_heap: 90,
            }],
        };
        let w = warnings(&s);
        assert_eq!(w.len(), 3, "{w:?}");
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
    }
}
