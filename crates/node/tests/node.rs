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
use std::time::Duration;

use common::{message, mix, reduce_input};
use simpler_core::{
    CallConfig, DType, EngineClass, KernelId, KernelSpec, RunArgs, Task, Worker, WorkerConfig,
};
use simpler_cpu::CpuPlatform;
use simpler_node::{
    ChildCtx, ChildFns, ChildId, CollectiveError, Collectives, ExitStatus, Node, NodeConfig,
    NodeError, ReduceOp, ReduceType, SharedBufferId, exchange_counts, segments_of_this_process,
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
        .register("buffer_check", buffer_check)
        .register("worker_add", worker_add)
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

fn all_reduce_2_and_4_ranks() {
    for n in [2, 4] {
        // 256 staging bytes: 1000 elements take 16 rounds; 0 elements take one.
        let mut node = Node::start(NodeConfig {
            collective_bytes: 256,
            ..config(n, 0)
        })
        .unwrap();
        for (seed, len) in [(7u64, 1000usize), (8, 1), (9, 0), (10, 64)] {
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

/// The driver process (see `DRIVER_ENV`): starts a node, prints its pid and its children's
/// pids, and waits until stdin closes, or a signal ends it.
fn driver() -> ! {
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
        ("chips_run_their_own_workers", chips_run_their_own_workers),
        (
            "child_error_is_reported_and_node_survives",
            child_error_is_reported_and_node_survives,
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
