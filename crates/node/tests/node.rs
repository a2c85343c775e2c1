//! Node tests: processes, mailboxes, shared buffers, collectives, failures and teardown.
//!
//! A node must start before any thread of its process, and libtest runs each test on a thread,
//! so this file is its own harness (`harness = false`): `main` first lets a child process
//! become a node child, then runs the tests one after another on the main thread. After every
//! test it asserts that no shared-memory segment of this process and no child process is left.
//! An optional argument filters tests by substring.

mod common;

use std::io::{BufRead, BufReader};
use std::panic::AssertUnwindSafe;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{message, mix, reduce_input};
use simpler_core::{
    CallConfig, DType, EngineClass, KernelId, KernelSpec, RunArgs, Task, Worker, WorkerConfig,
};
use simpler_cpu::CpuPlatform;
use simpler_node::{
    ChildCtx, ChildFns, ChildId, CollectiveError, Collectives, ExitStatus, Node, NodeConfig,
    NodeError, NodeTask, NodeTaskId, ReduceOp, ReduceType, SharedBufferId, exchange_counts,
    segments_of_this_process,
};

/// In a child: which child should hang or fail at start-up (`chip 1`, ...).
const HANG_ENV: &str = "SIMPLER_NODE_TEST_HANG";
const FAIL_ENV: &str = "SIMPLER_NODE_TEST_FAIL_START";
/// Makes this binary a driver process for the signal tests.
const DRIVER_ENV: &str = "SIMPLER_NODE_TEST_DRIVER";

fn fns() -> ChildFns {
    ChildFns::new()
        .register("echo", |_, args| Ok(args.to_vec()))
        .register("fail", |ctx, _| Err(format!("boom from {}", ctx.id())))
        .register("a2a", a2a)
        .register("a2a_die", a2a_die)
        .register("reduce", reduce)
        .register("collective_or_fail", collective_or_fail)
        .register("buffer_check", buffer_check)
        .register("files_limit", files_limit)
        .register("worker_add", worker_add)
        .register("step", step)
        .register("shared_add", shared_add)
        .register("chip_fatal", chip_fatal)
        .register("fail_on_chip_1", |ctx, _| match ctx.id() {
            ChildId::Chip(1) => Err("chip 1 says no".into()),
            _ => Ok(Vec::new()),
        })
        .register("hang", |_, _| {
            loop {
                std::thread::park();
            }
        })
        .register("die", |_, _| {
            // SAFETY: raising a signal has no memory-safety preconditions.
            unsafe { libc::raise(libc::SIGKILL) };
            Ok(Vec::new())
        })
        .on_start(start_hook)
        .chip_worker(chip_worker)
}

fn start_hook(ctx: &mut ChildCtx) -> Result<(), String> {
    let me = ctx.id().to_string();
    if std::env::var(FAIL_ENV).is_ok_and(|v| v == me) {
        return Err(format!("{me} refuses to start"));
    }
    if std::env::var(HANG_ENV).is_ok_and(|v| v == me) {
        // Never ready: blocks until the parent kills this process.
        loop {
            std::thread::park();
        }
    }
    Ok(())
}

const ADD_ONE: KernelId = KernelId(1);

/// Each chip's own worker: one CPU core and an `add_one` kernel.
fn chip_worker(_chip: usize) -> Result<Worker, String> {
    let w = Worker::new(
        CpuPlatform::new(),
        WorkerConfig {
            cores: Some(1),
            timeouts: None,
            idle_spin: None,
        },
    )
    .map_err(|e| e.to_string())?;
    w.register_kernel(KernelSpec::new(
        ADD_ONE,
        "add_one",
        EngineClass::Vector,
        |ctx| {
            for v in ctx.write::<f32>(0)? {
                *v += 1.0;
            }
            Ok(())
        },
    ))
    .map_err(|e| e.to_string())?;
    Ok(w)
}

fn u64_at(args: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(args[8 * i..8 * i + 8].try_into().unwrap())
}

fn args(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

// ---- child functions ----

/// All-to-all of `message(seed, me, j)` to every j; answers what it received, in rank order.
fn a2a(ctx: &mut ChildCtx, args: &[u8]) -> Result<Vec<u8>, String> {
    let seed = u64_at(args, 0);
    let comm = ctx.collectives().ok_or("not a chip")?;
    let (me, n) = (comm.rank(), comm.ranks());
    let msgs: Vec<Vec<u8>> = (0..n).map(|j| message(seed, me, j)).collect();
    let send_counts: Vec<usize> = msgs.iter().map(Vec::len).collect();
    let recv_counts = exchange_counts(comm, &send_counts).map_err(|e| e.to_string())?;
    let mut recv = vec![0u8; recv_counts.iter().sum()];
    comm.all_to_all_v(&msgs.concat(), &send_counts, &mut recv, &recv_counts)
        .map_err(|e| e.to_string())?;
    Ok(recv)
}

/// Like `a2a`, but rank `args[1]` kills itself first, leaving the others in the collective.
fn a2a_die(ctx: &mut ChildCtx, args: &[u8]) -> Result<Vec<u8>, String> {
    if ctx.id() == ChildId::Chip(u64_at(args, 1) as usize) {
        // SAFETY: raising a signal has no memory-safety preconditions.
        unsafe { libc::raise(libc::SIGKILL) };
    }
    a2a(ctx, args)
}

/// Runs `rank + 1` dependent `add_one` tasks on the chip's worker; answers the 16 floats.
fn worker_add(ctx: &mut ChildCtx, _args: &[u8]) -> Result<Vec<u8>, String> {
    let ChildId::Chip(rank) = ctx.id() else {
        return Err("not a chip".into());
    };
    let w = ctx.worker().ok_or("no worker")?;
    let buf = w.buffer_from(&[0.0f32; 16]).map_err(|e| e.to_string())?;
    let args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    w.run_fn("add", args, &CallConfig::default(), move |orch, args| {
        let t = orch.bind(&args.buffers[0], DType::F32, &[16])?;
        for _ in 0..=rank {
            orch.submit(Task::new(ADD_ONE).in_out(&t))?;
        }
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    let out = buf.read::<f32>().map_err(|e| e.to_string())?;
    Ok(out.iter().flat_map(|v| v.to_ne_bytes()).collect())
}

/// Adds `args[0]` to the 16 floats of the node task's first buffer with as many `add_one`
/// tasks of a chip-level orchestration on the chip's own worker.
fn shared_add(ctx: &mut ChildCtx, args: &[u8]) -> Result<Vec<u8>, String> {
    let n = u64_at(args, 0);
    if ctx.task_buffers() != 1 {
        return Err(format!("{} task buffers", ctx.task_buffers()));
    }
    let shared = ctx.task_buffer(0).ok_or("no task buffer")?;
    let mut bytes = [0u8; 64];
    // SAFETY: the node runs this task alone among the tasks that declare the buffer.
    unsafe { shared.read(0, &mut bytes) };
    let start: Vec<f32> = bytes
        .chunks(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    let w = ctx.worker().ok_or("no worker")?;
    let buf = w.buffer_from(&start).map_err(|e| e.to_string())?;
    let run_args = RunArgs {
        buffers: vec![buf.clone()],
        scalars: vec![],
    };
    w.run_fn(
        "add",
        run_args,
        &CallConfig::default(),
        move |orch, args| {
            let t = orch.bind(&args.buffers[0], DType::F32, &[16])?;
            for _ in 0..n {
                orch.submit(Task::new(ADD_ONE).in_out(&t))?;
            }
            Ok(())
        },
    )
    .map_err(|e| e.to_string())?;
    let out: Vec<u8> = buf
        .read::<f32>()
        .map_err(|e| e.to_string())?
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    // SAFETY: as above.
    unsafe { shared.write(0, &out) };
    Ok(Vec::new())
}

/// A chip-level orchestration that reports a fatal error (EXPLICIT_ORCH_FATAL).
fn chip_fatal(ctx: &mut ChildCtx, _args: &[u8]) -> Result<Vec<u8>, String> {
    let me = ctx.id().to_string();
    let w = ctx.worker().ok_or("no worker")?;
    let run_args = RunArgs {
        buffers: vec![],
        scalars: vec![],
    };
    w.run_fn("fatal", run_args, &CallConfig::default(), move |orch, _| {
        Err(orch.fatal(format!("bad input on {me}")))
    })
    .map_err(|e| e.to_string())?;
    Ok(Vec::new())
}

/// Bytes of `collective_or_fail`'s report buffer per chip: a length word, then the text.
const REPORT_BYTES: usize = 256;

/// Chip `args[1]` fails at once; the others run `a2a` (`args[2]` = 0) or `reduce` (1) with
/// seed `args[0]`, and write the error they get into their slot of buffer `args[3]`.
fn collective_or_fail(ctx: &mut ChildCtx, a: &[u8]) -> Result<Vec<u8>, String> {
    let ChildId::Chip(me) = ctx.id() else {
        return Err("not a chip".into());
    };
    if me == u64_at(a, 1) as usize {
        return Err(format!("chip {me} gives up before its collective"));
    }
    let result = match u64_at(a, 2) {
        0 => a2a(ctx, a),
        _ => reduce(ctx, &args(&[u64_at(a, 0), 1000])),
    };
    let err = match result {
        Ok(_) => "no error".to_string(),
        Err(e) => e,
    };
    let buf = ctx
        .buffer(SharedBufferId::from_bits(u64_at(a, 3)))
        .ok_or("report buffer not mapped")?;
    let text = &err.as_bytes()[..err.len().min(REPORT_BYTES - 8)];
    // SAFETY: each chip writes only its own slot; the parent reads after the call.
    unsafe {
        buf.write(REPORT_BYTES * me, &(text.len() as u64).to_le_bytes());
        buf.write(REPORT_BYTES * me + 8, text);
    }
    Err(err)
}

fn reduce(ctx: &mut ChildCtx, args: &[u8]) -> Result<Vec<u8>, String> {
    let (seed, len) = (u64_at(args, 0), u64_at(args, 1) as usize);
    let comm = ctx.collectives().ok_or("not a chip")?;
    let mut buf: Vec<u8> = reduce_input(seed, comm.rank(), len)
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    comm.all_reduce(&mut buf, ReduceType::F32, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    Ok(buf)
}

/// Checks the parent's pattern in the buffer's first `len` bytes, then writes its own mark at
/// `len + 64 * slot`.
fn buffer_check(ctx: &mut ChildCtx, args: &[u8]) -> Result<Vec<u8>, String> {
    let (id, len, seed) = (u64_at(args, 0), u64_at(args, 1) as usize, u64_at(args, 2));
    let slot = match ctx.id() {
        ChildId::Chip(i) => i,
        ChildId::Sub(i) => ctx.chips() + i,
    };
    let buf = ctx
        .buffer(SharedBufferId::from_bits(id))
        .ok_or("buffer not mapped")?;
    let mut seen = vec![0u8; len];
    // SAFETY: the parent wrote the pattern before the call and writes nothing during it.
    unsafe { buf.read(0, &mut seen) };
    if seen != pattern(seed, len) {
        return Err("pattern differs".into());
    }
    // SAFETY: each child writes only its own 64 bytes; the parent reads after the call.
    unsafe { buf.write(len + 64 * slot, &[slot as u8 + 1; 64]) };
    Ok(Vec::new())
}

/// Sets this child's soft limit of open files: 0 with a byte `0` in `args` (so mapping a
/// buffer fails here), back to the hard limit with no arguments.
fn files_limit(_: &mut ChildCtx, args: &[u8]) -> Result<Vec<u8>, String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err("getrlimit failed".into());
    }
    lim.rlim_cur = if args == [0] { 0 } else { lim.rlim_max };
    // SAFETY: `lim` is a valid limit (soft at most hard).
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err("setrlimit failed".into());
    }
    Ok(Vec::new())
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|k| mix(seed ^ k as u64) as u8).collect()
}

// ---- the tests ----

fn config(chips: usize, sub_workers: usize) -> NodeConfig {
    NodeConfig {
        chips,
        sub_workers,
        ..NodeConfig::default()
    }
}

fn chips_all(n: usize, a: &[u8]) -> Vec<(ChildId, &[u8])> {
    (0..n).map(|i| (ChildId::Chip(i), a)).collect()
}

fn check_all_to_all(n: usize, seed: u64) {
    let mut node = Node::start(config(n, 1)).unwrap();
    let a = args(&[seed]);
    let got = node.call_group("a2a", &chips_all(n, &a)).unwrap();
    for (me, recv) in got.iter().enumerate() {
        let expected: Vec<u8> = (0..n).flat_map(|src| message(seed, src, me)).collect();
        assert_eq!(recv, &expected, "rank {me} of {n}, seed {seed}");
    }
    node.close().unwrap();
}

fn all_to_all_2_and_4_ranks() {
    for n in [2, 4] {
        for seed in [0, 1, 2, 3] {
            check_all_to_all(n, seed);
        }
    }
}

/// Runs `reduce` on all `n` chips of `node` and checks every rank's sum.
fn check_reduce(node: &mut Node, n: usize, seed: u64, len: usize) {
    let a = args(&[seed, len as u64]);
    let got = node.call_group("reduce", &chips_all(n, &a)).unwrap();
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| reduce_input(seed, r, len)).collect();
    let expected: Vec<u8> = (0..len)
        .map(|k| (1..n).fold(inputs[0][k], |acc, r| acc + inputs[r][k]))
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    for (rank, bytes) in got.iter().enumerate() {
        assert_eq!(bytes, &expected, "rank {rank} of {n}, len {len}");
    }
}

fn all_reduce_2_and_4_ranks() {
    for n in [2, 4] {
        // 256 staging bytes: 1000 elements take 16 rounds; 0 elements take one.
        let mut node = Node::start(NodeConfig {
            collective_bytes: 256,
            ..config(n, 0)
        })
        .unwrap();
        for (seed, len) in [(7u64, 1000usize), (8, 1), (9, 0), (10, 64)] {
            check_reduce(&mut node, n, seed, len);
        }
        node.close().unwrap();
    }
}

fn oversize_all_to_all_fails_on_every_rank() {
    let mut node = Node::start(NodeConfig {
        collective_bytes: 64,
        ..config(2, 0)
    })
    .unwrap();
    // Seed 5 sends more than 64 bytes from at least one rank.
    assert!((0..2).any(|s| (0..2).map(|d| message(5, s, d).len()).sum::<usize>() > 64));
    let a = args(&[5]);
    match node.call_group("a2a", &chips_all(2, &a)) {
        Err(NodeError::CallFailed { message, .. }) => {
            assert!(
                message.contains("staging area") || message.contains("refused"),
                "{message}"
            )
        }
        other => panic!("expected a refused all-to-all, got {other:?}"),
    }
    // Every rank returned: the node still works.
    check_group_echo(&mut node, 2);
    node.close().unwrap();
}

fn check_group_echo(node: &mut Node, chips: usize) {
    let calls: Vec<(ChildId, &[u8])> = (0..chips).map(|i| (ChildId::Chip(i), &b"hi"[..])).collect();
    let got = node.call_group("echo", &calls).unwrap();
    assert!(got.iter().all(|g| g == b"hi"));
}

fn buffers_created_after_start_are_visible_everywhere() {
    let (chips, subs) = (3, 2);
    let mut node = Node::start(config(chips, subs)).unwrap();
    node.call(ChildId::Sub(1), "echo", b"warm").unwrap();
    for (round, len) in [(1u64, 4096usize), (2, 100_000)] {
        let id = node.create_buffer(len + 64 * (chips + subs)).unwrap();
        // The name is gone as soon as every child has mapped the segment.
        assert!(segments_of_this_process().is_empty());
        let buf = node.buffer(id).unwrap();
        // SAFETY: no child touches the buffer before the call below.
        unsafe { buf.write(0, &pattern(round, len)) };
        let a = args(&[id.to_bits(), len as u64, round]);
        let mut calls: Vec<(ChildId, &[u8])> = chips_all(chips, &a);
        calls.extend((0..subs).map(|i| (ChildId::Sub(i), &a[..])));
        node.call_group("buffer_check", &calls).unwrap();
        let buf = node.buffer(id).unwrap();
        for slot in 0..chips + subs {
            let mut mark = [0u8; 64];
            // SAFETY: the children have answered; nobody writes the buffer now.
            unsafe { buf.read(len + 64 * slot, &mut mark) };
            assert_eq!(mark, [slot as u8 + 1; 64], "slot {slot}");
        }
        // Freed: unmapped in every child and here.
        node.free_buffer(id).unwrap();
        assert!(node.buffer(id).is_none());
        match node.call(ChildId::Sub(1), "buffer_check", &a) {
            Err(NodeError::CallFailed { message, .. }) => assert_eq!(message, "buffer not mapped"),
            other => panic!("expected an unmapped buffer, got {other:?}"),
        }
        assert!(matches!(node.free_buffer(id), Err(NodeError::NotFound(_))));
    }
    node.close().unwrap();
}

/// A buffer whose map fails in one child (chip 1, out of descriptors) is refused naming that
/// child, and the children that mapped it unmap it again (they used to keep a mapping of an id
/// the node never recorded); the next buffer maps everywhere and the node closes cleanly.
fn a_map_failing_in_one_child_is_undone_in_the_others() {
    let (chips, subs, len) = (2, 1, 4096);
    let mut node = Node::start(config(chips, subs)).unwrap();
    let first = node.create_buffer(len + 64 * (chips + subs)).unwrap();
    node.free_buffer(first).unwrap();
    node.call(ChildId::Chip(1), "files_limit", &[0]).unwrap();
    match node.create_buffer(len + 64 * (chips + subs)) {
        Err(NodeError::CallFailed {
            child, function, ..
        }) => assert_eq!((child, function.as_str()), (ChildId::Chip(1), "map buffer")),
        other => panic!("expected chip 1's map to fail, got {other:?}"),
    }
    assert!(segments_of_this_process().is_empty());
    // Ids are handed out in order: the refused buffer had the one after `first`.
    let refused = first.to_bits() + 1;
    for child in [ChildId::Chip(0), ChildId::Sub(0)] {
        match node.call(child, "buffer_check", &args(&[refused, 0, 0])) {
            Err(NodeError::CallFailed { message, .. }) => {
                assert_eq!(message, "buffer not mapped", "{child}")
            }
            other => panic!("{child} still maps the refused buffer: {other:?}"),
        }
    }
    node.call(ChildId::Chip(1), "files_limit", &[]).unwrap();
    let id = node.create_buffer(len + 64 * (chips + subs)).unwrap();
    assert_eq!(id.to_bits(), refused + 1);
    // SAFETY: no child touches the buffer before the call below.
    unsafe { node.buffer(id).unwrap().write(0, &pattern(3, len)) };
    let a = args(&[id.to_bits(), len as u64, 3]);
    let mut calls: Vec<(ChildId, &[u8])> = chips_all(chips, &a);
    calls.push((ChildId::Sub(0), &a[..]));
    node.call_group("buffer_check", &calls).unwrap();
    node.free_buffer(id).unwrap();
    node.close().unwrap();
}

fn chips_run_their_own_workers() {
    let mut node = Node::start(config(3, 1)).unwrap();
    let got = node.call_group("worker_add", &chips_all(3, &[])).unwrap();
    for (rank, bytes) in got.iter().enumerate() {
        let expected: Vec<u8> = [(rank + 1) as f32; 16]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        assert_eq!(bytes, &expected, "chip {rank}");
    }
    match node.call(ChildId::Sub(0), "worker_add", b"") {
        Err(NodeError::CallFailed { message, .. }) => assert_eq!(message, "not a chip"),
        other => panic!("expected CallFailed, got {other:?}"),
    }
    node.close().unwrap();
}

fn child_error_is_reported_and_node_survives() {
    let mut node = Node::start(config(2, 1)).unwrap();
    match node.call(ChildId::Sub(0), "fail", b"") {
        Err(NodeError::CallFailed { child, message, .. }) => {
            assert_eq!(child, ChildId::Sub(0));
            assert_eq!(message, "boom from sub worker 0");
        }
        other => panic!("expected CallFailed, got {other:?}"),
    }
    match node.call(ChildId::Chip(1), "no such function", b"") {
        Err(NodeError::CallFailed { message, .. }) => assert!(message.contains("no function")),
        other => panic!("expected CallFailed, got {other:?}"),
    }
    assert_eq!(node.call(ChildId::Sub(0), "echo", b"x").unwrap(), b"x");
    assert!(matches!(
        node.call(ChildId::Sub(3), "echo", b""),
        Err(NodeError::NotFound(_))
    ));
    node.close().unwrap();
}

/// A chip that fails while the others wait for it in a collective releases them at once: the
/// call reports its error (not a peer's, nor a timeout), and the next group call works.
fn failed_rank_abandons_the_collective_and_node_survives() {
    let chips = 3;
    let timeout = Duration::from_secs(120);
    let mut node = Node::start(NodeConfig {
        call_timeout: timeout,
        // Small staging: a reduction of 1000 elements takes several rounds.
        collective_bytes: 256,
        ..config(chips, 0)
    })
    .unwrap();
    let report = node.create_buffer(REPORT_BYTES * chips).unwrap();
    // (failing chip, 0: all-to-all / 1: all-reduce); a failing chip after chip 0 checks that
    // the failing chip's error is the call's, not the first abandoned peer's.
    for (failing, op) in [(2usize, 0u64), (1, 1), (0, 0)] {
        let a = args(&[5, failing as u64, op, report.to_bits()]);
        let started = Instant::now();
        match node.call_group("collective_or_fail", &chips_all(chips, &a)) {
            Err(NodeError::CallFailed { child, message, .. }) => {
                assert_eq!(child, ChildId::Chip(failing));
                assert_eq!(
                    message,
                    format!("chip {failing} gives up before its collective")
                );
            }
            other => panic!("expected chip {failing} to fail, got {other:?}"),
        }
        let took = started.elapsed();
        assert!(
            took < timeout / 4,
            "the failure took {took:?}, near the {timeout:?} call timeout"
        );
        assert_peers_saw_abandonment(&node, report, chips, failing, op);
        // The collectives were reset: the same node reduces again (over several rounds).
        check_reduce(&mut node, chips, 9, 1000);
    }
    node.free_buffer(report).unwrap();
    node.close().unwrap();
}

/// The fields of a `TaskFailed` (task, child, function, message, poisoned tasks); any other
/// error fails the test.
fn task_failed(err: NodeError) -> (usize, ChildId, String, String, Vec<usize>) {
    match err {
        NodeError::TaskFailed {
            task,
            child,
            function,
            message,
            poisoned,
        } => (task, child, function, message, poisoned),
        other => panic!("expected TaskFailed, got {other}"),
    }
}

/// Every chip of `collective_or_fail` but `failing` wrote that its collective `op` was
/// abandoned by `failing` into its slot of `report`.
fn assert_peers_saw_abandonment(
    node: &Node,
    report: SharedBufferId,
    chips: usize,
    failing: usize,
    op: u64,
) {
    let buf = node.buffer(report).unwrap();
    let op_name = ["all_to_all_v", "all_reduce"][op as usize];
    for rank in (0..chips).filter(|&r| r != failing) {
        let mut len = [0u8; 8];
        // SAFETY: the chips have answered; nobody writes the buffer now.
        unsafe { buf.read(REPORT_BYTES * rank, &mut len) };
        let mut text = vec![0u8; u64::from_le_bytes(len) as usize];
        // SAFETY: as above.
        unsafe { buf.read(REPORT_BYTES * rank + 8, &mut text) };
        let text = String::from_utf8(text).unwrap();
        // The all-to-all starts with an exchange of counts, itself an all-to-all.
        assert_eq!(
            text,
            format!("{op_name} on rank {rank}: the group was abandoned by rank {failing}"),
        );
    }
}

/// The same inside an orchestrated run: a chip of a group task that fails before its
/// collective releases the chips waiting in it (the run ends with the task's failure, named by
/// that chip, not with the task's deadline), its dependents are poisoned, independent tasks
/// run, and the next run's group collectives work on the reset segment.
fn failed_chip_in_a_run_releases_its_group() {
    let chips = 3;
    let mut node = Node::start(NodeConfig {
        // Small staging: a reduction of 1000 elements takes several rounds.
        collective_bytes: 256,
        ..config(chips, 1)
    })
    .unwrap();
    let report = node.create_buffer(REPORT_BYTES * chips).unwrap();
    let log_id = node.create_buffer(LOG_BYTES).unwrap();
    let out = node.create_buffer(8).unwrap();
    let l = |t| Step::new(log_id, t);
    let all: Vec<usize> = (0..chips).collect();
    // A hang would end the run with TaskTimeout at this deadline, not with TaskFailed.
    let deadline = Duration::from_secs(120);
    for (k, (failing, op)) in [(1usize, 0u64), (2, 1), (0, 1)].into_iter().enumerate() {
        let a = args(&[5, failing as u64, op, report.to_bits()]);
        // Tags of this round: t(1)..t(4).
        let t = |n: usize| 4 * k + n;
        let err = node
            .run(|o| {
                o.submit(
                    NodeTask::group(&all, "collective_or_fail", &a)
                        .writes(out)
                        .timeout(deadline),
                )?;
                o.submit(chip_step(0, l(t(1)).op(OP_READ, out, 0)).reads(out))?; // poisoned
                o.submit(sub_step(0, l(t(2))))?; // independent
                o.submit(chip_step(failing, l(t(3))).after(NodeTaskId(0)))?; // poisoned
                o.submit(chip_step(1, l(t(4))))?; // independent, after the group on chip 1
                Ok(())
            })
            .unwrap_err();
        let (task, child, function, message, poisoned) = task_failed(err);
        assert_eq!(
            (task, child, function.as_str()),
            (0, ChildId::Chip(failing), "collective_or_fail")
        );
        assert_eq!(
            message,
            format!("chip {failing} gives up before its collective")
        );
        assert_eq!(poisoned, vec![1, 3]);
        assert_peers_saw_abandonment(&node, report, chips, failing, op);
        let log = Log(node.buffer(log_id).unwrap());
        assert_eq!(
            (log.start(t(1)), log.start(t(3))),
            (0, 0),
            "a poisoned task ran"
        );
        assert!(
            log.end(t(2)) != 0 && log.end(t(4)) != 0,
            "an independent task did not run"
        );
        // The next run's group collectives work: two reductions over several rounds of the
        // small staging area.
        node.run(|o| {
            for seed in [3, 4] {
                o.submit(NodeTask::group(&all, "reduce", &args(&[seed, 1000])).timeout(deadline))?;
            }
            Ok(())
        })
        .unwrap();
        check_reduce(&mut node, chips, 9, 1000);
    }
    node.close().unwrap();
}

fn child_killed_mid_collective_is_named_then_node_rebuilt() {
    let mut node = Node::start(config(4, 1)).unwrap();
    let a = args(&[1, 2]);
    match node.call_group("a2a_die", &chips_all(4, &a)) {
        Err(NodeError::ChildDied { child, status, .. }) => {
            assert_eq!(child, ChildId::Chip(2));
            assert_eq!(status, ExitStatus::Signaled(libc::SIGKILL));
        }
        other => panic!("expected chip 2 to die, got {other:?}"),
    }
    // The others were waiting in the collective: they are gone too, and the node refuses work.
    assert!(matches!(
        node.call(ChildId::Sub(0), "echo", b""),
        Err(NodeError::Broken(_))
    ));
    node.close().unwrap();
    check_all_to_all(4, 3);
}

fn child_killed_from_outside_is_named() {
    let mut node = Node::start(config(2, 0)).unwrap();
    let pid = node.children()[1].1;
    // SAFETY: `pid` is a child of this process, not yet reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    match node.call(ChildId::Chip(1), "echo", b"") {
        Err(e @ NodeError::ChildDied { .. }) => {
            assert_eq!(
                e.to_string(),
                format!("chip 1 (pid {pid}) died: killed by signal 15 (SIGTERM)")
            );
        }
        other => panic!("expected chip 1 to be reported dead, got {other:?}"),
    }
    node.close().unwrap();
}

fn child_never_ready_fails_within_deadline() {
    let result = Node::start(NodeConfig {
        ready_deadline: Duration::from_millis(300),
        env: vec![(HANG_ENV.into(), "chip 0".into())],
        ..config(2, 1)
    });
    match result {
        Err(NodeError::ReadyTimeout { child, .. }) => assert_eq!(child, ChildId::Chip(0)),
        Err(e) => panic!("expected a ready timeout, got {e}"),
        Ok(_) => panic!("expected a ready timeout, the node started"),
    }
}

fn child_failing_start_is_reported() {
    let result = Node::start(NodeConfig {
        env: vec![(FAIL_ENV.into(), "sub worker 0".into())],
        ..config(1, 1)
    });
    match result {
        Err(NodeError::StartFailed { child, message, .. }) => {
            assert_eq!(child, ChildId::Sub(0));
            assert_eq!(message, "sub worker 0 refuses to start");
        }
        Err(e) => panic!("expected StartFailed, got {e}"),
        Ok(_) => panic!("expected StartFailed, the node started"),
    }
}

fn dropping_a_node_ends_its_children() {
    let mut node = Node::start(config(2, 2)).unwrap();
    node.create_buffer(10).unwrap();
    drop(node);
}

fn bad_collective_arguments_fail_on_every_rank() {
    // Collective errors are values, checked here without processes.
    let e = CollectiveError::PeerRefused {
        op: "all_to_all_v",
        rank: 1,
    };
    assert_eq!(e.to_string(), "all_to_all_v: rank 1 refused its arguments");
}

// ---- orchestration: the event log and the `step` function ----

/// Tags (tasks, or a group's chips) the event log holds.
const LOG_TAGS: usize = 64;
const LOG_BYTES: usize = 8 * (1 + 4 * LOG_TAGS);
/// `step`'s watch modes.
const NO_WATCH: u64 = 0;
/// Look out, for a window, for the watched tag's start (which a correct schedule forbids).
const PEEK: u64 = 1;
/// Wait until every tag below the watched one has started (which a correct schedule allows).
const WAIT_ALL: u64 = 2;
/// How long a `PEEK` looks out. Only a wrong schedule's test depends on it (it gives the
/// forbidden start time to show); a correct schedule's results do not.
const PEEK_WINDOW: Duration = Duration::from_millis(20);
/// `step`'s operations on its buffer (a u64 at offset 0).
const OP_NONE: u64 = 0;
const OP_WRITE: u64 = 1;
const OP_READ: u64 = 2;

/// The event log: a shared buffer of atomic words — word 0 a counter (the clock), then per tag
/// `[start, end, seen, peeked]`. Every process touches the words only atomically; the
/// counter's `fetch_add` (SeqCst) orders events across processes, so tick order is the
/// order in which the events happened.
struct Log<'a>(&'a simpler_node::SharedBuffer);

impl Log<'_> {
    fn word(&self, k: usize) -> &AtomicU64 {
        assert!(8 * (k + 1) <= self.0.len());
        // SAFETY: in bounds (checked), 8-aligned (the mapping is page-aligned), the mapping
        // outlives `self`, and every process of the node accesses these words only atomically.
        unsafe { &*self.0.as_ptr().cast::<AtomicU64>().add(k) }
    }
    fn tick(&self) -> u64 {
        self.word(0).fetch_add(1, Ordering::SeqCst) + 1
    }
    fn slot(&self, tag: usize, field: usize) -> &AtomicU64 {
        assert!(tag < LOG_TAGS);
        self.word(1 + 4 * tag + field)
    }
    fn start(&self, tag: usize) -> u64 {
        self.slot(tag, 0).load(Ordering::SeqCst)
    }
    fn end(&self, tag: usize) -> u64 {
        self.slot(tag, 1).load(Ordering::SeqCst)
    }
    fn seen(&self, tag: usize) -> u64 {
        self.slot(tag, 2).load(Ordering::SeqCst)
    }
    fn peeked(&self, tag: usize) -> u64 {
        self.slot(tag, 3).load(Ordering::SeqCst)
    }
}

/// `step`'s arguments.
#[derive(Clone, Copy)]
struct Step {
    log: SharedBufferId,
    tag: usize,
    watch: usize,
    mode: u64,
    op: u64,
    buf: Option<SharedBufferId>,
    value: u64,
    fail: bool,
    /// In a group: the tag is `tag + chip`.
    per_chip: bool,
    /// Where in `buf` the operation's u64 lies (a multiple of 8).
    offset: u64,
}

impl Step {
    fn new(log: SharedBufferId, tag: usize) -> Step {
        Step {
            log,
            tag,
            watch: 0,
            mode: NO_WATCH,
            op: OP_NONE,
            buf: None,
            value: 0,
            fail: false,
            per_chip: false,
            offset: 0,
        }
    }
    fn watch(self, mode: u64, watch: usize) -> Step {
        Step {
            mode,
            watch,
            ..self
        }
    }
    fn op(self, op: u64, buf: SharedBufferId, value: u64) -> Step {
        Step {
            op,
            buf: Some(buf),
            value,
            ..self
        }
    }
    fn at_offset(self, offset: u64) -> Step {
        Step { offset, ..self }
    }
    fn encode(&self) -> Vec<u8> {
        args(&[
            self.log.to_bits(),
            self.tag as u64,
            self.watch as u64,
            self.mode,
            self.op,
            self.buf.map_or(u64::MAX, SharedBufferId::to_bits),
            self.value,
            self.fail as u64,
            self.per_chip as u64,
            self.offset,
        ])
    }
}

/// Records its start, watches other tags (see `PEEK`, `WAIT_ALL`), writes or reads its buffer,
/// records its end, and fails if asked to.
fn step(ctx: &mut ChildCtx, a: &[u8]) -> Result<Vec<u8>, String> {
    let at = |i| u64_at(a, i);
    let mut tag = at(1) as usize;
    if at(8) == 1 {
        let ChildId::Chip(c) = ctx.id() else {
            return Err("per-chip tags need a chip".into());
        };
        tag += c;
    }
    let log = Log(ctx
        .buffer(SharedBufferId::from_bits(at(0)))
        .ok_or("no log")?);
    log.slot(tag, 0).store(log.tick(), Ordering::SeqCst);
    let watch = at(2) as usize;
    match at(3) {
        PEEK => {
            let until = Instant::now() + PEEK_WINDOW;
            while Instant::now() < until {
                if log.start(watch) != 0 {
                    log.slot(tag, 3).store(1, Ordering::SeqCst);
                    break;
                }
                std::thread::yield_now();
            }
        }
        WAIT_ALL => {
            while (0..watch).any(|t| log.start(t) == 0) {
                std::thread::yield_now();
            }
        }
        _ => {}
    }
    let (op, value, offset) = (at(4), at(6), at(9) as usize);
    if op != OP_NONE {
        let id = SharedBufferId::from_bits(at(5));
        let buf = ctx.buffer(id).ok_or("no buffer")?;
        // The operation stays inside bytes the task declared (the only ones the node ordered
        // it against), which the child is told; a buffer it did not declare is refused.
        let declared: Vec<_> = (0..ctx.task_buffers())
            .filter(|&k| ctx.task_buffer(k).map(|b| b.id()) == Some(id))
            .filter_map(|k| ctx.task_bytes(k))
            .collect();
        if !declared
            .iter()
            .any(|r| r.start <= offset && offset + 8 <= r.end)
        {
            return Err(format!(
                "step {tag}: bytes {offset}..{} are outside the declared {declared:?}",
                offset + 8
            ));
        }
        // SAFETY: the bytes lie inside a range this task declared (checked above), and the
        // node orders this task against every other task that declared overlapping bytes
        // with a write on either side; only such tasks touch them.
        unsafe {
            if op == OP_WRITE {
                buf.write(offset, &value.to_le_bytes());
            } else {
                let mut b = [0u8; 8];
                buf.read(offset, &mut b);
                log.slot(tag, 2)
                    .store(u64::from_le_bytes(b), Ordering::SeqCst);
            }
        }
    }
    log.slot(tag, 1).store(log.tick(), Ordering::SeqCst);
    if at(7) == 1 {
        return Err(format!("step {tag} fails on {}", ctx.id()));
    }
    Ok(Vec::new())
}

fn chip_step(chip: usize, s: Step) -> NodeTask {
    NodeTask::chip(chip, "step", &s.encode())
}

fn sub_step(sub: usize, s: Step) -> NodeTask {
    NodeTask::sub(sub, "step", &s.encode())
}

/// Read after write, write after read and write after write, each across two children: the
/// earlier task looks out for the later one's start, which would show a missing edge.
fn dependencies_follow_buffer_identity() {
    let mut node = Node::start(config(2, 1)).unwrap();
    let log_id = node.create_buffer(LOG_BYTES).unwrap();
    let x = node.create_buffer(8).unwrap();
    let y = node.create_buffer(8).unwrap();
    let l = |t| Step::new(log_id, t);
    node.run(|o| {
        // 0 writes x; 1 reads it (RAW); 2 writes it (WAR after 1, WAW after 0); 3 reads it.
        o.submit(chip_step(0, l(0).op(OP_WRITE, x, 7).watch(PEEK, 1)).writes(x))?;
        o.submit(chip_step(1, l(1).op(OP_READ, x, 0).watch(PEEK, 2)).reads(x))?;
        o.submit(sub_step(0, l(2).op(OP_WRITE, x, 9).watch(PEEK, 3)).writes(x))?;
        o.submit(chip_step(0, l(3).op(OP_READ, x, 0)).reads(x))?;
        // 4 writes y while 0..3 run: nothing orders it against them.
        o.submit(chip_step(1, l(4).op(OP_WRITE, y, 5)).writes(y))?;
        // 5 reads y and writes x: after 4 (RAW on y) and after 3 (WAR on x).
        o.submit(sub_step(0, l(5).op(OP_READ, y, 0)).reads(y).writes(x))?;
        Ok(())
    })
    .unwrap();
    let log = Log(node.buffer(log_id).unwrap());
    assert_eq!((log.seen(1), log.seen(3), log.seen(5)), (7, 9, 5));
    for (before, after) in [(0, 1), (1, 2), (2, 3), (4, 5), (3, 5)] {
        assert!(
            log.end(before) < log.start(after),
            "task {before} ends at {}, task {after} starts at {}",
            log.end(before),
            log.start(after)
        );
    }
    for t in 0..3 {
        assert_eq!(log.peeked(t), 0, "task {} started while {t} ran", t + 1);
    }
    node.close().unwrap();
}

/// Tasks with no common buffer on three children run at once: each waits until all three
/// have started, so none can end before.
fn independent_tasks_overlap() {
    let mut node = Node::start(config(2, 1)).unwrap();
    let log_id = node.create_buffer(LOG_BYTES).unwrap();
    let bufs: Vec<SharedBufferId> = (0..3).map(|_| node.create_buffer(8).unwrap()).collect();
    let l = |t| Step::new(log_id, t);
    node.run(|o| {
        // A schedule that serialises them fails with a task timeout instead of hanging.
        let t = Duration::from_secs(120);
        o.submit(
            chip_step(0, l(0).watch(WAIT_ALL, 3).op(OP_WRITE, bufs[0], 1))
                .writes(bufs[0])
                .timeout(t),
        )?;
        o.submit(
            chip_step(1, l(1).watch(WAIT_ALL, 3).op(OP_WRITE, bufs[1], 1))
                .writes(bufs[1])
                .timeout(t),
        )?;
        o.submit(
            sub_step(0, l(2).watch(WAIT_ALL, 3).op(OP_WRITE, bufs[2], 1))
                .writes(bufs[2])
                .timeout(t),
        )?;
        Ok(())
    })
    .unwrap();
    let log = Log(node.buffer(log_id).unwrap());
    let last_start = (0..3).map(|t| log.start(t)).max().unwrap();
    let first_end = (0..3).map(|t| log.end(t)).min().unwrap();
    assert!(last_start < first_end, "{last_start} {first_end}");
    node.close().unwrap();
}

/// Byte ranges of one buffer: tasks writing disjoint ranges run at once, a read waits only
/// for the writers of its bytes, and an access across both ranges waits for both. Each child
/// is told the bytes it declared (`step` refuses to touch others).
fn byte_ranges_order_only_common_bytes() {
    let mut node = Node::start(config(2, 1)).unwrap();
    let log_id = node.create_buffer(LOG_BYTES).unwrap();
    let x = node.create_buffer(32).unwrap();
    let l = |t| Step::new(log_id, t);
    node.run(|o| {
        // A schedule with a wrong edge fails with a task timeout instead of hanging.
        let t = Duration::from_secs(120);
        // 0 and 1 write words 0 and 1 and wait until both have started: an edge between them
        // would never let the second start. 1 also waits for 2, which reads word 0 only and so
        // must start while 1 still runs.
        o.submit(
            chip_step(0, l(0).watch(WAIT_ALL, 2).op(OP_WRITE, x, 11))
                .writes_bytes(x, 0..8)
                .timeout(t),
        )?;
        o.submit(
            chip_step(1, l(1).watch(WAIT_ALL, 3).op(OP_WRITE, x, 22).at_offset(8))
                .writes_bytes(x, 8..16)
                .timeout(t),
        )?;
        o.submit(
            sub_step(0, l(2).op(OP_READ, x, 0))
                .reads_bytes(x, 0..8)
                .timeout(t),
        )?;
        // 3 writes word 2 and reads bytes 4..12, across words 0 and 1: after 0 and 1 (RAW),
        // and after 2 (WAR on bytes 4..8).
        o.submit(
            chip_step(0, l(3).op(OP_WRITE, x, 33).at_offset(16))
                .reads_bytes(x, 4..12)
                .writes_bytes(x, 16..24),
        )?;
        // 4 reads the whole buffer: after 1 (word 1) and 3 (word 2).
        o.submit(chip_step(1, l(4).op(OP_READ, x, 0).at_offset(16)).reads(x))?;
        Ok(())
    })
    .unwrap();
    let log = Log(node.buffer(log_id).unwrap());
    let both_started = log.start(0).max(log.start(1));
    assert!(both_started < log.end(0).min(log.end(1)));
    assert!(
        log.start(2) < log.end(1),
        "the read of word 0 waited for word 1's writer"
    );
    assert_eq!((log.seen(2), log.seen(4)), (11, 33));
    for (before, after) in [(0, 3), (1, 3), (2, 3), (1, 4), (3, 4)] {
        assert!(
            log.end(before) < log.start(after),
            "task {before} ends at {}, task {after} starts at {}",
            log.end(before),
            log.start(after)
        );
    }
    // A task touching bytes it did not declare is refused by `step`, which sees its
    // declared bytes: bytes 8..16 against a declared 0..8.
    let err = node
        .run(|o| {
            o.submit(chip_step(0, l(5).op(OP_WRITE, x, 1).at_offset(8)).writes_bytes(x, 0..8))
                .map(drop)
        })
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("bytes 8..16 are outside the declared [0..8]"),
        "{err}"
    );
    node.close().unwrap();
}

/// `NodeTask::any_sub` runs on whichever sub worker is idle: two such tasks that wait until
/// both have started run at once, so on different sub workers (one child runs one task at a
/// time); a third waits for a free one. A node without sub workers refuses them, and runs on.
fn any_sub_takes_an_idle_sub_worker() {
    let mut node = Node::start(config(1, 2)).unwrap();
    let log_id = node.create_buffer(LOG_BYTES).unwrap();
    let l = |t| Step::new(log_id, t);
    node.run(|o| {
        let t = Duration::from_secs(120);
        o.submit(NodeTask::any_sub("step", &l(0).watch(WAIT_ALL, 2).encode()).timeout(t))?;
        o.submit(NodeTask::any_sub("step", &l(1).watch(WAIT_ALL, 2).encode()).timeout(t))?;
        o.submit(NodeTask::any_sub("step", &l(2).encode()))?;
        Ok(())
    })
    .unwrap();
    let log = Log(node.buffer(log_id).unwrap());
    assert!(log.start(0).max(log.start(1)) < log.end(0).min(log.end(1)));
    assert!(
        log.start(2) > log.end(0).min(log.end(1)),
        "a third sub worker?"
    );
    // Ready together, an any-sub task and one pinned to sub worker 0: the any-sub one takes
    // sub worker 1 (taking 0 would leave the pinned task waiting, and as both wait for each
    // other's start, that schedule fails by its deadline). A fresh log: tags 0 and 1 again.
    let log2 = node.create_buffer(LOG_BYTES).unwrap();
    let l2 = |t| Step::new(log2, t);
    node.run(|o| {
        let t = Duration::from_secs(60);
        o.submit(NodeTask::any_sub("step", &l2(0).watch(WAIT_ALL, 2).encode()).timeout(t))?;
        o.submit(sub_step(0, l2(1).watch(WAIT_ALL, 2)).timeout(t))?;
        Ok(())
    })
    .unwrap_or_else(|e| panic!("the any-sub task took the pinned task's sub worker: {e}"));
    node.close().unwrap();
    let mut node = Node::start(config(1, 0)).unwrap();
    let err = node
        .run(|o| o.submit(NodeTask::any_sub("echo", b"")).map(drop))
        .unwrap_err();
    assert_eq!(err.code(), 211, "{err}");
    assert!(
        err.to_string().contains("the node has no sub worker"),
        "{err}"
    );
    // Refused with declared buffers (one of the run's scope), the refusal handled and another
    // task submitted: the refused task left nothing behind (no edge to it, no free waiting
    // for it), so the run completes.
    let x = node.create_buffer(8).unwrap();
    node.run(|o| {
        let b = o.create_buffer(8)?;
        let refused = o.submit(NodeTask::any_sub("echo", b"").writes(b).reads(x));
        assert!(refused.is_err());
        o.submit(NodeTask::chip(0, "echo", b"").writes(b).reads(x))?;
        Ok(())
    })
    .unwrap();
    node.close().unwrap();
}

/// A group waits for all its chips: chip 1 is idle, chip 0 busy with an earlier task that
/// looks out for the group's start on chip 1. A later single-chip task does not overtake the
/// group on chip 1.
fn group_starts_when_all_its_chips_are_idle() {
    let mut node = Node::start(config(2, 0)).unwrap();
    let log_id = node.create_buffer(LOG_BYTES).unwrap();
    let l = |t| Step::new(log_id, t);
    node.run(|o| {
        o.submit(chip_step(0, l(0).watch(PEEK, 11)))?;
        // Tags 10 (chip 0) and 11 (chip 1).
        let group = Step {
            per_chip: true,
            ..l(10)
        };
        o.submit(NodeTask::group(&[0, 1], "step", &group.encode()))?;
        o.submit(chip_step(1, l(1)))?;
        Ok(())
    })
    .unwrap();
    let log = Log(node.buffer(log_id).unwrap());
    assert_eq!(
        log.peeked(0),
        0,
        "the group started on chip 1 while chip 0 was busy"
    );
    assert!(log.end(0) < log.start(10).min(log.start(11)));
    assert!(log.end(10).max(log.end(11)) < log.start(1));
    node.close().unwrap();
}

/// A failed task poisons every task that depends on it, directly or not, and no other; the
/// error names the task, the child and its message; the node goes on.
fn failure_poisons_dependents_only() {
    let mut node = Node::start(config(2, 1)).unwrap();
    let log_id = node.create_buffer(LOG_BYTES).unwrap();
    let [x, y, z, w, v] = [0; 5].map(|_| node.create_buffer(8).unwrap());
    let l = |t| Step::new(log_id, t);
    let err = node
        .run(|o| {
            let failing = Step {
                fail: true,
                ..l(0).op(OP_WRITE, x, 1)
            };
            o.submit(chip_step(0, failing).writes(x))?; // 0 fails
            o.submit(chip_step(1, l(1).op(OP_READ, x, 0)).reads(x).writes(y))?; // 1: RAW on 0
            o.submit(sub_step(0, l(2).op(OP_READ, y, 0)).reads(y))?; // 2: through 1
            let t3 = o.submit(chip_step(1, l(3).op(OP_WRITE, z, 4)).writes(z))?; // 3: free
            o.submit(sub_step(0, l(4).op(OP_READ, z, 0)).reads(z).writes(w))?; // 4: after 3
            o.submit(chip_step(0, l(5).op(OP_READ, w, 0)).reads(w).after(t3))?; // 5: after 4
            let g = Step {
                per_chip: true,
                ..l(6)
            };
            // 6 and 7 (a group: tags 6, 7): reads y, through 1.
            o.submit(NodeTask::group(&[0, 1], "step", &g.encode()).reads(y))?;
            o.submit(sub_step(0, l(8).op(OP_WRITE, x, 2)).writes(x))?; // 8: WAW after 0
            o.submit(chip_step(0, l(9)).after(NodeTaskId(5)))?; // 9: after 5, which runs
            o.submit(chip_step(1, l(10).op(OP_WRITE, v, 3)).writes(v))?; // 10: free
            Ok(())
        })
        .unwrap_err();
    assert_eq!(err.code(), 212);
    let (task, child, function, message, poisoned) = task_failed(err);
    assert_eq!(
        (task, child, function.as_str()),
        (0, ChildId::Chip(0), "step")
    );
    assert_eq!(message, "step 0 fails on chip 0");
    assert_eq!(poisoned, vec![1, 2, 6, 7]);
    let log = Log(node.buffer(log_id).unwrap());
    for tag in [1, 2, 6, 7, 8] {
        assert_eq!(log.start(tag), 0, "poisoned tag {tag} ran");
    }
    for tag in [0, 3, 4, 5, 9, 10] {
        assert_ne!(log.end(tag), 0, "tag {tag} did not run");
    }
    assert_eq!((log.seen(4), log.seen(5)), (4, 0));
    // The node goes on: a new run works.
    node.run(|o| o.submit(chip_step(1, l(20))).map(drop))
        .unwrap();
    assert_ne!(Log(node.buffer(log_id).unwrap()).end(20), 0);
    node.close().unwrap();
}

/// Bytes 6..2: a range whose start is after its end.
fn backwards() -> std::ops::Range<usize> {
    std::ops::Range { start: 6, end: 2 }
}

/// The errors of a run carry the child's message and the node's codes; refused tasks leave
/// nothing behind.
fn run_errors_carry_the_childs_message() {
    let mut node = Node::start(config(2, 1)).unwrap();
    match node.run(|o| o.submit(NodeTask::sub(0, "fail", b"")).map(drop)) {
        Err(NodeError::TaskFailed {
            child,
            message,
            poisoned,
            ..
        }) => {
            assert_eq!(child, ChildId::Sub(0));
            assert_eq!(message, "boom from sub worker 0");
            assert!(poisoned.is_empty());
        }
        other => panic!("expected TaskFailed, got {other:?}"),
    }
    // A group fails when one of its chips does, named by that chip.
    match node.run(|o| {
        o.submit(NodeTask::group(&[0, 1], "fail_on_chip_1", b""))
            .map(drop)
    }) {
        Err(e @ NodeError::TaskFailed { .. }) => assert_eq!(
            e.to_string(),
            "node task 0 (fail_on_chip_1) failed on chip 1: chip 1 says no (0 dependent tasks poisoned)"
        ),
        other => panic!("expected TaskFailed, got {other:?}"),
    }
    // When several chips of a group fail on their own, the one reported is the first to fail
    // (it abandoned the collectives first; which one that is, is a race), with its own
    // message, never a peer's.
    match node.run(|o| o.submit(NodeTask::group(&[1, 0], "fail", b"")).map(drop)) {
        Err(NodeError::TaskFailed { child, message, .. }) => {
            let own = match child {
                ChildId::Chip(c) => format!("boom from chip {c}"),
                other => panic!("a group of chips failed on {other:?}"),
            };
            assert_eq!(message, own);
        }
        other => panic!("expected TaskFailed, got {other:?}"),
    }
    let buf = node.create_buffer(8).unwrap();
    let echo = |c| NodeTask::chip(c, "echo", b"");
    let refused = [
        (NodeTask::group(&[1, 1], "echo", b""), 211),
        (echo(0).after(NodeTaskId(7)), 211),
        (echo(0).reads(SharedBufferId::from_bits(99)), 209),
        (echo(5), 209),
        // Bytes past the buffer's 8, and a range whose start is after its end.
        (echo(0).reads_bytes(buf, 4..12), 211),
        (echo(1).writes_bytes(buf, backwards()), 211),
    ];
    for (k, (task, code)) in refused.into_iter().enumerate() {
        let err = node
            .run(|o| {
                // A buffer of the recording is freed when the recording fails.
                let tmp = o.create_buffer(8)?;
                o.submit(echo(0).writes(tmp))?;
                o.submit(task).map(drop)
            })
            .unwrap_err();
        assert_eq!(err.code(), code, "case {k}: {err}");
        assert!(
            node.buffer(SharedBufferId::from_bits(buf.to_bits() + 1 + k as u64))
                .is_none()
        );
    }
    for (task, says) in [
        (echo(0).reads_bytes(buf, 4..12), "the buffer holds 8 bytes"),
        (
            echo(0).writes_bytes(buf, backwards()),
            "the start is after the end",
        ),
    ] {
        let err = node.run(|o| o.submit(task).map(drop)).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!("of shared buffer {}: {says}", buf.to_bits())),
            "{text}"
        );
    }
    // Nothing ran, and the node works.
    node.run(|o| o.submit(NodeTask::chip(1, "echo", b"")).map(drop))
        .unwrap();
    node.close().unwrap();
}

/// A task past its deadline ends the node with the node's timeout code, naming the child.
fn task_deadline_is_reported_and_node_rebuilt() {
    let mut node = Node::start(config(2, 1)).unwrap();
    let err = node
        .run(|o| {
            o.submit(NodeTask::chip(0, "echo", b""))?;
            o.submit(NodeTask::sub(0, "hang", b"").timeout(Duration::from_millis(200)))?;
            Ok(())
        })
        .unwrap_err();
    assert_eq!(err.code(), 213);
    match err {
        NodeError::TaskTimeout {
            task,
            child,
            function,
            timeout_ms,
            ..
        } => assert_eq!(
            (task, child, function.as_str(), timeout_ms),
            (1, ChildId::Sub(0), "hang", 200)
        ),
        other => panic!("expected TaskTimeout, got {other}"),
    }
    assert_eq!(
        node.run(|_| Ok(())).unwrap_err().code(),
        210,
        "the node is broken"
    );
    node.close().unwrap();
    let mut node = Node::start(config(1, 0)).unwrap();
    node.run(|o| o.submit(NodeTask::chip(0, "echo", b"")).map(drop))
        .unwrap();
    node.close().unwrap();
}

/// A child that dies in a run is named with its signal; the node is closed and rebuilt.
fn child_dying_in_a_run_is_named() {
    let mut node = Node::start(config(2, 1)).unwrap();
    let err = node
        .run(|o| {
            o.submit(NodeTask::sub(0, "echo", b""))?;
            o.submit(NodeTask::chip(1, "die", b""))?;
            Ok(())
        })
        .unwrap_err();
    assert_eq!(err.code(), 205);
    match err {
        NodeError::ChildDied { child, status, .. } => {
            assert_eq!(
                (child, status),
                (ChildId::Chip(1), ExitStatus::Signaled(libc::SIGKILL))
            )
        }
        other => panic!("expected ChildDied, got {other}"),
    }
    // The node is broken (its other children were ended with it); a new one works.
    assert_eq!(node.run(|_| Ok(())).unwrap_err().code(), 210);
    node.close().unwrap();
    let mut node = Node::start(config(2, 1)).unwrap();
    node.run(|o| o.submit(NodeTask::chip(1, "echo", b"")).map(drop))
        .unwrap();
    node.close().unwrap();
}

/// Buffers created in a scope end with it, after their last user, and cannot be named after
/// it; the run's own scope ends its buffers too.
fn scope_buffers_end_with_their_scope() {
    let mut node = Node::start(config(2, 1)).unwrap();
    let log_id = node.create_buffer(LOG_BYTES).unwrap();
    let l = |t| Step::new(log_id, t);
    let (inner, outer) = node
        .run(|o| {
            let inner = o.scope(|o| {
                let b = o.create_buffer(8)?;
                o.submit(chip_step(0, l(0).op(OP_WRITE, b, 3)).writes(b))?;
                o.submit(sub_step(0, l(1).op(OP_READ, b, 0)).reads(b))?;
                Ok(b)
            })?;
            let outer = o.create_buffer(8)?;
            // Task 2 runs on chip 1, unordered with the scope's tasks and its end.
            o.submit(chip_step(1, l(2).op(OP_WRITE, outer, 1)).writes(outer))?;
            match o.submit(chip_step(1, l(3)).reads(inner)) {
                Err(NodeError::InvalidTask { reason, .. }) => {
                    assert!(reason.contains("after its scope ended"), "{reason}")
                }
                other => panic!("expected InvalidTask, got {other:?}"),
            }
            Ok((inner, outer))
        })
        .unwrap();
    assert_eq!(Log(node.buffer(log_id).unwrap()).seen(1), 3);
    assert!(node.buffer(inner).is_none() && node.buffer(outer).is_none());
    // Unmapped in the children as well.
    let a = args(&[inner.to_bits(), 0, 0]);
    match node.call(ChildId::Chip(0), "buffer_check", &a) {
        Err(NodeError::CallFailed { message, .. }) => assert_eq!(message, "buffer not mapped"),
        other => panic!("expected an unmapped buffer, got {other:?}"),
    }
    // A scope whose writer fails still ends its buffer (its reader is poisoned, the end is not).
    let mut doomed = None;
    let err = node
        .run(|o| {
            o.scope(|o| {
                let b = o.create_buffer(8)?;
                doomed = Some(b);
                let failing = Step {
                    fail: true,
                    ..l(4).op(OP_WRITE, b, 1)
                };
                o.submit(chip_step(0, failing).writes(b))?;
                o.submit(sub_step(0, l(5).op(OP_READ, b, 0)).reads(b))?;
                Ok(())
            })
        })
        .unwrap_err();
    assert!(
        matches!(err, NodeError::TaskFailed { ref poisoned, .. } if poisoned == &[1]),
        "{err}"
    );
    assert!(node.buffer(doomed.unwrap()).is_none());
    node.close().unwrap();
}

/// Chip tasks run chip-level orchestrations on their own workers on shared buffers, in the
/// order the buffers give.
fn chip_tasks_run_chip_orchestrations_on_shared_buffers() {
    let mut node = Node::start(config(3, 0)).unwrap();
    let x = node.create_buffer(64).unwrap();
    let y = node.create_buffer(64).unwrap();
    node.run(|o| {
        o.submit(NodeTask::chip(0, "shared_add", &args(&[1])).writes(x))?;
        o.submit(NodeTask::chip(1, "shared_add", &args(&[2])).writes(x))?;
        o.submit(NodeTask::chip(2, "shared_add", &args(&[5])).writes(y))?;
        o.submit(NodeTask::chip(2, "shared_add", &args(&[4])).writes(x))?;
        Ok(())
    })
    .unwrap();
    for (id, want) in [(x, 7.0f32), (y, 5.0)] {
        let mut bytes = [0u8; 64];
        // SAFETY: the run has finished; no child touches the buffers.
        unsafe { node.buffer(id).unwrap().read(0, &mut bytes) };
        let expected: Vec<u8> = [want; 16].iter().flat_map(|v| v.to_ne_bytes()).collect();
        assert_eq!(bytes.to_vec(), expected);
    }
    node.close().unwrap();
}

/// A chip-level error (with the chip level's code) fails its node task with that message,
/// poisons its dependents, and leaves the chip's worker usable.
fn chip_level_errors_reach_run() {
    let mut node = Node::start(config(2, 0)).unwrap();
    let x = node.create_buffer(64).unwrap();
    let err = node
        .run(|o| {
            o.submit(NodeTask::chip(1, "chip_fatal", b"").writes(x))?;
            o.submit(NodeTask::chip(0, "shared_add", &args(&[1])).writes(x))?;
            Ok(())
        })
        .unwrap_err();
    match err {
        NodeError::TaskFailed {
            child,
            message,
            poisoned,
            ..
        } => {
            assert_eq!(child, ChildId::Chip(1));
            assert!(
                message.contains("EXPLICIT_ORCH_FATAL (code 9)")
                    && message.contains("bad input on chip 1"),
                "{message}"
            );
            assert_eq!(poisoned, vec![1]);
        }
        other => panic!("expected TaskFailed, got {other}"),
    }
    node.run(|o| {
        o.submit(NodeTask::chip(1, "shared_add", &args(&[2])).writes(x))
            .map(drop)
    })
    .unwrap();
    let mut bytes = [0u8; 4];
    // SAFETY: the run has finished; no child touches the buffer.
    unsafe { node.buffer(x).unwrap().read(0, &mut bytes) };
    assert_eq!(f32::from_ne_bytes(bytes), 2.0);
    node.close().unwrap();
}

/// The driver process (see `DRIVER_ENV`): starts a node, prints its pid and its children's
/// pids, and waits until stdin closes, or a signal ends it.
fn driver() -> ! {
    // A shell that starts the tests in the background (`cmd &` without job control) hands
    // them SIGINT ignored, and exec keeps an ignored disposition: the driver must die of the
    // signal the test sends, as it would started from a terminal.
    // SAFETY: resetting a disposition to its default, before any thread of this process.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
    let mut node = Node::start(config(2, 1)).unwrap();
    node.create_buffer(4096).unwrap();
    let pids: Vec<String> = node.children().iter().map(|(_, p)| p.to_string()).collect();
    println!("{} {}", std::process::id(), pids.join(" "));
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    node.close().unwrap();
    std::process::exit(0);
}

/// A signal to the parent ends every child and leaves no shared memory.
fn signal_ends_the_tree(sig: i32) {
    let mut driver = Command::new(std::env::current_exe().unwrap())
        .env(DRIVER_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(driver.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let pids: Vec<i32> = line
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    let (driver_pid, children) = (pids[0], &pids[1..]);
    assert_eq!(children.len(), 3);
    // Each child's pidfd, taken while the driver (their parent) is alive and has not reaped
    // them, so the pid cannot name another process.
    let pidfds: Vec<i32> = children
        .iter()
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
        .map(|&pid| unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32)
        .collect();
    assert!(pidfds.iter().all(|&fd| fd >= 0), "pidfd_open failed");
    // SAFETY: `driver_pid` is our child.
    assert_eq!(unsafe { libc::kill(driver_pid, sig) }, 0);
    let status = driver.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(sig), "{status:?}");
    for fd in pidfds {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // A pidfd becomes readable when its process exits: wait for that, without a timeout.
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, -1) }, 1);
        // SAFETY: closing the descriptor pidfd_open returned.
        unsafe { libc::close(fd) };
    }
    let prefix = format!("{}{driver_pid}.", simpler_node::SHM_PREFIX);
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "segments left: {left:?}");
}

fn sigterm_ends_the_tree() {
    signal_ends_the_tree(libc::SIGTERM);
}

fn sigint_ends_the_tree() {
    signal_ends_the_tree(libc::SIGINT);
}

fn start_refused_with_threads_running() {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || rx.recv());
    assert!(matches!(
        Node::start(config(1, 0)),
        Err(NodeError::ThreadsRunning { threads: 2 })
    ));
    drop(tx);
    t.join().unwrap().unwrap_err();
}

/// No segment of this process and no child process is left.
fn assert_clean(test: &str) {
    let segments = segments_of_this_process();
    assert!(segments.is_empty(), "{test}: segments left: {segments:?}");
    let mut status = 0;
    // SAFETY: waitpid with WNOHANG on any child; `status` is a valid out pointer.
    let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
    let errno = std::io::Error::last_os_error().raw_os_error();
    assert!(
        r == -1 && errno == Some(libc::ECHILD),
        "{test}: a child is left (waitpid {r})"
    );
}

/// A child variable set by hand (the node sets it for the processes it starts): descriptors
/// named twice or below 3 are refused as malformed, and descriptors that are not open are
/// refused before the child takes ownership of any (it would close a descriptor twice, or
/// one it does not own); the process exits with the reason and runs nothing.
fn a_hand_set_child_variable_is_refused() {
    let me = std::process::id();
    for (fds, code, says) in [
        ("100,101,102,-1", 4, "descriptor 100 is not open"),
        ("7,7,9,-1", 2, "malformed"),
        ("1,8,9,-1", 2, "malformed"),
    ] {
        let out = Command::new(std::env::current_exe().unwrap())
            .env(simpler_node::CHILD_ENV, format!("chip,0,2,0,{me},{fds},64"))
            .env_remove(DRIVER_ENV)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{fds}: {stderr}");
        assert!(stderr.contains(says), "{fds}: {stderr}");
    }
}

fn main() {
    simpler_node::child_main_if_requested(&fns());
    if std::env::var_os(DRIVER_ENV).is_some() {
        driver();
    }
    // Last: it starts a thread, after which no node may start in this process.
    let tests: &[(&str, fn())] = &[
        ("all_to_all_2_and_4_ranks", all_to_all_2_and_4_ranks),
        ("all_reduce_2_and_4_ranks", all_reduce_2_and_4_ranks),
        (
            "oversize_all_to_all_fails_on_every_rank",
            oversize_all_to_all_fails_on_every_rank,
        ),
        (
            "buffers_created_after_start_are_visible_everywhere",
            buffers_created_after_start_are_visible_everywhere,
        ),
        (
            "a_map_failing_in_one_child_is_undone_in_the_others",
            a_map_failing_in_one_child_is_undone_in_the_others,
        ),
        ("chips_run_their_own_workers", chips_run_their_own_workers),
        (
            "child_error_is_reported_and_node_survives",
            child_error_is_reported_and_node_survives,
        ),
        (
            "failed_rank_abandons_the_collective_and_node_survives",
            failed_rank_abandons_the_collective_and_node_survives,
        ),
        (
            "failed_chip_in_a_run_releases_its_group",
            failed_chip_in_a_run_releases_its_group,
        ),
        (
            "child_killed_mid_collective_is_named_then_node_rebuilt",
            child_killed_mid_collective_is_named_then_node_rebuilt,
        ),
        (
            "child_killed_from_outside_is_named",
            child_killed_from_outside_is_named,
        ),
        (
            "child_never_ready_fails_within_deadline",
            child_never_ready_fails_within_deadline,
        ),
        (
            "child_failing_start_is_reported",
            child_failing_start_is_reported,
        ),
        (
            "dropping_a_node_ends_its_children",
            dropping_a_node_ends_its_children,
        ),
        (
            "bad_collective_arguments_fail_on_every_rank",
            bad_collective_arguments_fail_on_every_rank,
        ),
        (
            "dependencies_follow_buffer_identity",
            dependencies_follow_buffer_identity,
        ),
        ("independent_tasks_overlap", independent_tasks_overlap),
        (
            "a_hand_set_child_variable_is_refused",
            a_hand_set_child_variable_is_refused,
        ),
        (
            "byte_ranges_order_only_common_bytes",
            byte_ranges_order_only_common_bytes,
        ),
        (
            "any_sub_takes_an_idle_sub_worker",
            any_sub_takes_an_idle_sub_worker,
        ),
        (
            "chip_tasks_run_chip_orchestrations_on_shared_buffers",
            chip_tasks_run_chip_orchestrations_on_shared_buffers,
        ),
        ("chip_level_errors_reach_run", chip_level_errors_reach_run),
        (
            "group_starts_when_all_its_chips_are_idle",
            group_starts_when_all_its_chips_are_idle,
        ),
        (
            "failure_poisons_dependents_only",
            failure_poisons_dependents_only,
        ),
        (
            "run_errors_carry_the_childs_message",
            run_errors_carry_the_childs_message,
        ),
        (
            "task_deadline_is_reported_and_node_rebuilt",
            task_deadline_is_reported_and_node_rebuilt,
        ),
        (
            "child_dying_in_a_run_is_named",
            child_dying_in_a_run_is_named,
        ),
        (
            "scope_buffers_end_with_their_scope",
            scope_buffers_end_with_their_scope,
        ),
        ("sigterm_ends_the_tree", sigterm_ends_the_tree),
        ("sigint_ends_the_tree", sigint_ends_the_tree),
        (
            "start_refused_with_threads_running",
            start_refused_with_threads_running,
        ),
    ];
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let mut failed = Vec::new();
    let mut ran = 0;
    for &(name, test) in tests {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            test();
            assert_clean(name);
        }));
        match result {
            Ok(()) => println!("test {name} ... ok"),
            Err(_) => {
                println!("test {name} ... FAILED");
                failed.push(name);
            }
        }
    }
    println!("\n{} passed; {} failed", ran - failed.len(), failed.len());
    if !failed.is_empty() {
        println!("failures: {failed:?}");
        std::process::exit(101);
    }
}
