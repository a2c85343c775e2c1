//! Turns a [`RunReport`] into the standard span tree of `docs/trace-format.md`.

use std::collections::BTreeMap;

use crate::report::{Interval, RunReport};
use crate::trace::{AttrValue, Clock, SpanRecord, TRACE_FORMAT_VERSION};

pub(crate) fn spans_of(r: &RunReport, pid: u32, tid: u64) -> Vec<SpanRecord> {
    let callable = format!("{:016x}", r.callable);
    let mut out = Vec::with_capacity(16);
    let mut push = |depth: u8, name: &str, iv: Interval, attrs: BTreeMap<String, AttrValue>| {
        if iv.start_ns == 0 && iv.end_ns == 0 {
            // Never measured (a report built by hand, or a phase this run did not have).
            return;
        }
        out.push(SpanRecord {
            v: TRACE_FORMAT_VERSION,
            pid,
            tid,
            inv: r.inv,
            callable: callable.clone(),
            depth,
            name: name.to_string(),
            ts_ns: iv.start_ns,
            dur_ns: iv.dur_ns(),
            clock: Clock::Host,
            attrs,
        });
    };
    let mut run_attrs = BTreeMap::new();
    run_attrs.insert(
        "orchestration".into(),
        AttrValue::Str(r.orchestration.clone()),
    );
    run_attrs.insert("tasks".into(), AttrValue::Int(r.counters.tasks as i64));
    run_attrs.insert("cores".into(), AttrValue::Int(r.cores as i64));
    run_attrs.insert("overlapped".into(), AttrValue::Bool(r.overlapped));
    if let Some(label) = &r.label {
        run_attrs.insert("label".into(), AttrValue::Str(label.clone()));
    }
    if r.warmup {
        // Only where set: a trace of measured runs reads as before.
        run_attrs.insert("warmup".into(), AttrValue::Bool(true));
    }
    let none = BTreeMap::new;
    // The engine's step is the run's sibling, not its parent: `run` stays the root of the
    // chip-level tree the format fixes; layer ⑤ is the difference of the two.
    push(0, "engine.step", r.engine_step, none());
    push(0, "run", r.host_wall, run_attrs);
    push(1, "run.bind", r.bind, none());
    push(2, "run.bind.args", r.bind_args, none());
    push(1, "run.runner", r.runner, none());
    push(2, "run.runner.device_wall", r.device_wall, none());
    push(3, "graph_build", r.graph_build, none());
    push(4, "config_validate", r.config_validate, none());
    push(4, "arena_wire", r.arena_wire, none());
    push(4, "reset", r.reset, none());
    push(3, "orch", r.orch, none());
    push(3, "sched", r.sched, none());
    push(3, "post_orch", r.post_orch, none());
    for s in &r.task_slots {
        let mut a = BTreeMap::new();
        a.insert("tasks".into(), AttrValue::Int(s.tasks as i64));
        push(3, &format!("task_slot_{}", s.slot), s.span, a);
    }
    push(1, "run.validate", r.validate, none());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(a: u64, b: u64) -> Interval {
        Interval {
            start_ns: a,
            end_ns: b,
        }
    }

    #[test]
    fn span_tree_has_the_standard_names_and_nesting() {
        let r = RunReport {
            host_wall: iv(0, 100),
            bind: iv(1, 5),
            runner: iv(5, 95),
            device_wall: iv(6, 94),
            orch: iv(10, 60),
            sched: iv(12, 90),
            validate: iv(95, 99),
            bind_args: iv(1, 4),
            ..RunReport::default()
        };
        let spans = r.spans(7, 1);
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names[..4],
            ["run", "run.bind", "run.bind.args", "run.runner"]
        );
        let run = &spans[0];
        assert_eq!((run.depth, run.dur_ns), (0, 100));
        let dw = spans
            .iter()
            .find(|s| s.name == "run.runner.device_wall")
            .unwrap();
        assert_eq!(dw.depth, 2);
        assert_eq!(r.effective(), iv(10, 90));
    }

    #[test]
    fn only_a_warm_up_run_carries_the_warmup_attribute() {
        let run_attrs = |warmup: bool| {
            let r = RunReport {
                host_wall: iv(0, 100),
                warmup,
                ..RunReport::default()
            };
            r.spans(7, 1).swap_remove(0).attrs
        };
        assert_eq!(run_attrs(true).get("warmup"), Some(&AttrValue::Bool(true)));
        assert_eq!(run_attrs(false).get("warmup"), None);
    }
}
