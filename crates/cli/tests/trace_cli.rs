//! `simpler trace ...` over inconsistent files: every tool refuses them with an error naming
//! the file and the field, exits nonzero, and prints no report; an output file that is one of
//! the inputs is refused before anything is read or written.

mod common;

use std::path::Path;

use common::{simpler, text, tmp};

const ANCHOR: &str = r#"{"kind":"anchor","pid":7,"wall_ns":1000000}"#;
const PROCESS: &str = r#"{"kind":"process","pid":7,"boot_id":"b","mono_ns":5,"uncertainty_ns":1}"#;

fn span(inv: u64, depth: u8, name: &str, ts_ns: u64, dur_ns: u64) -> String {
    format!(
        r#"{{"kind":"span","v":1,"pid":7,"tid":0,"inv":{inv},"callable":"00000000000000c0","depth":{depth},"name":"{name}","ts_ns":{ts_ns},"dur_ns":{dur_ns},"clock":"host","attrs":{{"label":"decode"}}}}"#
    )
}

/// A valid trace of two invocations.
fn trace() -> String {
    let mut lines = vec![ANCHOR.to_string(), PROCESS.to_string()];
    for inv in 0..2 {
        let t0 = 1000 * inv;
        lines.push(span(inv, 0, "run", t0, 900));
        lines.push(span(inv, 1, "run.runner", t0 + 10, 800));
        lines.push(span(inv, 2, "run.runner.device_wall", t0 + 20, 700));
        lines.push(span(inv, 3, "orch", t0 + 30, 300));
        lines.push(span(inv, 3, "sched", t0 + 40, 600));
    }
    lines.join("\n") + "\n"
}

/// A valid run directory: a level-2 swimlane of two tasks on two cores, their graph, ring stats.
fn write_run(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let block = |task: u64, core: u32, t: [u64; 4]| {
        format!(
            r#"{{"task_id":{task},"func":3,"class":"vector","core":{core},"block":0,"dispatch":{},"start":{},"end":{},"finish":{}}}"#,
            t[0], t[1], t[2], t[3]
        )
    };
    let swimlane = format!(
        r#"{{"v":1,"level":2,"fingerprint":"fp","cores":2,"tasks":[{},{}],"phases":[],"queue_depth":[],"submits":[],"dropped":0,"kernels":{{"3":"gemm"}}}}"#,
        block(1, 0, [100, 110, 200, 210]),
        block(2, 1, [220, 230, 300, 310])
    );
    let task = |id: u64| {
        format!(
            r#"{{"id":{id},"scope":"auto","scope_depth":0,"kernel":3,"kernel_name":"gemm","block_num":1,"args":[{{"tag":"output","tensor":0,"offset":0,"shape":[4],"strides":[1]}}]}}"#
        )
    };
    let deps = format!(
        r#"{{"v":1,"fingerprint":"fp","tasks":[{},{}],"tensors":[{{"buffer":1,"version":0,"dtype":"f32","size":16}}],"edges":[{{"pred":1,"succ":2,"source":"tensormap","overlap":"covers"}}]}}"#,
        task(1),
        task(2)
    );
    let usage = |hw: u64, cap: u64| format!(r#"{{"high_water":{hw},"capacity":{cap}}}"#);
    let rings = format!(
        r#"{{"v":1,"rings":[{{"ring":0,"task_window":{},"heap":{},"dep_pool":{}}}],"tensormap":{},"scopes":[{{"site":"a.rs:1","ring":0,"opened":1,"max_tasks":2,"max_heap":0,"max_dep_pool":1,"max_map_entries":2}}]}}"#,
        usage(2, 16383),
        usage(1024, 268435456),
        usage(1, 16384),
        usage(32, 65536)
    );
    std::fs::write(dir.join("swimlane.json"), swimlane).unwrap();
    std::fs::write(dir.join("deps.json"), deps).unwrap();
    std::fs::write(dir.join("ring_stats.json"), rings).unwrap();
}

/// Asserts that `simpler args` fails with every one of `says` in its error and prints no report.
fn fails(args: &[&str], says: &[&str]) {
    let out = simpler(args);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{args:?}: succeeded");
    for want in says {
        assert!(err.contains(want), "{args:?}: {err}");
    }
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(text(&out.stdout).is_empty(), "{args:?}: printed a report");
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Replaces `from` (which must occur) by `to` in `dir/file`.
fn edit(dir: &Path, file: &str, from: &str, to: &str) {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "{from} not in {text}");
    std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
}

#[test]
fn the_valid_files_are_read_by_every_tool() {
    let dir = tmp("trace-valid");
    write_run(&dir);
    std::fs::write(dir.join("trace.jsonl"), trace()).unwrap();
    let d = s(&dir);
    let t = dir.join("trace.jsonl");
    for args in [
        vec!["trace", "swimlane", d],
        vec!["trace", "idle", d],
        vec!["trace", "overhead", d],
        vec!["trace", "critical-path", d],
        vec!["trace", "deps", d],
        vec!["trace", "rings", d],
        vec!["trace", "timing", s(&t)],
        vec!["trace", "timing", s(&t), "--rounds", "--tree"],
    ] {
        let out = simpler(&args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A file of a valid run edited into an inconsistent one: (file, text replaced, replacement,
/// the tools that read it, what their error says).
type Case<'a> = (&'a str, &'a str, &'a str, &'a [&'a str], &'a [&'a str]);

#[test]
fn inconsistent_diagnostics_are_refused_by_every_tool_that_reads_them() {
    let dir = tmp("trace-bad-diag");
    let cases: &[Case] = &[
        (
            "swimlane.json",
            r#""start":110,"end":200"#,
            r#""start":210,"end":200"#,
            &["swimlane", "idle", "overhead", "critical-path"],
            &["tasks[0] (task 0:1 block 0 on core 0): end 200 is before start 210"],
        ),
        (
            "swimlane.json",
            r#""dispatch":220"#,
            r#""dispatch":320"#,
            &["swimlane", "idle"],
            &["tasks[1] (task 0:2 block 0 on core 1): start 230 is before dispatch 320"],
        ),
        (
            "swimlane.json",
            r#""cores":2"#,
            r#""cores":0"#,
            &["swimlane", "idle", "critical-path"],
            &["tasks[0]", "core 0 is not below the file's cores = 0"],
        ),
        (
            "swimlane.json",
            r#""cores":2"#,
            r#""cores":1"#,
            &["swimlane", "overhead"],
            &["tasks[1]", "core 1 is not below the file's cores = 1"],
        ),
        (
            "deps.json",
            r#""pred":1,"succ":2"#,
            r#""pred":1,"succ":9"#,
            &["deps", "swimlane", "critical-path"],
            &["edges[0]: succ 9 (0:9) is not a task of the graph"],
        ),
        (
            "deps.json",
            r#""tensor":0"#,
            r#""tensor":1000000000"#,
            &["deps", "swimlane", "critical-path"],
            &["tasks[0] (task 0:1).args[0]: tensor 1000000000 is not below the 1 tensors"],
        ),
        (
            "deps.json",
            r#"{"id":2,"#,
            r#"{"id":1,"#,
            &["deps", "swimlane", "critical-path"],
            &["tasks[1]: id 1 (0:1) is also the id of tasks[0]"],
        ),
        (
            "ring_stats.json",
            r#""capacity":16383"#,
            r#""capacity":0"#,
            &["rings"],
            &["rings[0] (ring 0) task_window.capacity is 0"],
        ),
        (
            "ring_stats.json",
            r#""high_water":2,"#,
            r#""high_water":1000000000000000000,"#,
            &["rings"],
            &[
                "rings[0] (ring 0) task_window.high_water 1000000000000000000 is above its capacity 16383",
            ],
        ),
    ];
    for (file, from, to, tools, says) in cases {
        write_run(&dir);
        edit(&dir, file, from, to);
        let path = dir.join(file);
        let named = format!("{}:0: ", path.display());
        for tool in *tools {
            let mut want = vec![named.as_str()];
            want.extend_from_slice(says);
            fails(&["trace", tool, s(&dir)], &want);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_span_ending_past_the_clock_is_refused() {
    let dir = tmp("trace-durmax");
    let t = dir.join("trace.jsonl");
    // The second invocation's `run` (line 8) starting at 1000 ns.
    let text = trace().replacen(
        r#""ts_ns":1000,"dur_ns":900"#,
        r#""ts_ns":1000,"dur_ns":18446744073709551615"#,
        1,
    );
    std::fs::write(&t, text).unwrap();
    for extra in [&[][..], &["--rounds"], &["--tree"]] {
        let mut args = vec!["trace", "timing", s(&t)];
        args.extend_from_slice(extra);
        fails(
            &args,
            &[
                &format!("{}:8: ", t.display()),
                "ts_ns 1000 + dur_ns 18446744073709551615 overflows u64",
            ],
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_trace_without_spans_fails_in_every_mode_naming_the_file() {
    let dir = tmp("trace-nospans");
    let out = dir.join("out.json");
    for (name, content) in [
        ("empty.jsonl", String::new()),
        ("anchored.jsonl", format!("{ANCHOR}\n{PROCESS}\n")),
    ] {
        let t = dir.join(name);
        std::fs::write(&t, content).unwrap();
        for extra in [
            &[][..],
            &["--rounds"],
            &["--tree"],
            &["--rounds", "--tree"],
            &["--perfetto", s(&out)],
        ] {
            let mut args = vec!["trace", "timing", s(&t)];
            args.extend_from_slice(extra);
            fails(&args, &[&format!("{}: no span lines", t.display())]);
        }
    }
    assert!(!out.exists(), "wrote a Perfetto file of nothing");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_output_that_is_an_input_is_refused_and_left_as_it_was() {
    let dir = tmp("trace-overwrite");
    write_run(&dir);
    let t = dir.join("trace.jsonl");
    std::fs::write(&t, trace()).unwrap();
    let before = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let (trace_text, swimlane_text, deps_text) = (
        before("trace.jsonl"),
        before("swimlane.json"),
        before("deps.json"),
    );
    // The same file under another spelling is the same file.
    let sub = dir.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let other_t = sub.join("..").join("trace.jsonl");
    for out in [&t, &other_t] {
        fails(
            &["trace", "timing", s(&t), "--perfetto", s(out)],
            &[
                "--perfetto",
                "is the input file",
                &t.display().to_string(),
                "refusing to overwrite it",
            ],
        );
    }
    let d = s(&dir);
    for file in ["swimlane.json", "deps.json"] {
        let out = dir.join(file);
        fails(
            &["trace", "swimlane", d, "--perfetto", s(&out)],
            &[
                "--perfetto",
                "is the input file",
                "refusing to overwrite it",
            ],
        );
        // Several runs: each run's files are inputs.
        fails(
            &["trace", "swimlane", d, d, "--perfetto", s(&out)],
            &["--perfetto", "is the input file"],
        );
    }
    for flag in ["--dot", "--html"] {
        fails(
            &["trace", "deps", d, flag, s(&dir.join("deps.json"))],
            &[flag, "is the input file"],
        );
    }
    assert_eq!(before("trace.jsonl"), trace_text);
    assert_eq!(before("swimlane.json"), swimlane_text);
    assert_eq!(before("deps.json"), deps_text);
    // Another output file is written as before.
    let out = dir.join("p.json");
    let run = simpler(&["trace", "timing", s(&t), "--perfetto", s(&out)]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert!(out.is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}
