//! The MPI backend under `mpirun` (feature `mpi`): `cargo test -p simpler-node --features mpi`.
//!
//! Run plainly, this binary launches itself under `mpirun -np 2` and `-np 4` on this host
//! (loopback) and checks that every rank succeeded. Run by `mpirun` (it sees
//! `OMPI_COMM_WORLD_SIZE` or `PMI_SIZE`), it is one rank: it runs the same all-to-all (ragged
//! and zero-size messages) and all-reduce cases as the shared-memory tests and compares each
//! result with the plain computation, bit for bit, exiting non-zero on any difference, then
//! estimates its clock offset to rank 0 (zero within its bound on one host). A last
//! job of 3 ranks checks that a rank's `abort` ends the job while the others wait for it.

mod common;

use common::{message, reduce_input};
use simpler_node::{
    CollectiveError, Collectives, MpiCollectives, OffsetEstimate, ReduceOp, ReduceType,
    exchange_counts, mpirun_command, under_mpirun,
};

/// Makes a rank run `abort_main`.
const ABORT_ARG: &str = "abort";

fn rank_main() {
    let universe = mpi::initialize().expect("MPI initializes once");
    let mut comm = MpiCollectives::new(universe.world());
    let (me, n) = (comm.rank(), comm.ranks());
    for seed in [0u64, 1, 2, 3] {
        let msgs: Vec<Vec<u8>> = (0..n).map(|j| message(seed, me, j)).collect();
        let send_counts: Vec<usize> = msgs.iter().map(Vec::len).collect();
        let recv_counts = exchange_counts(&mut comm, &send_counts).unwrap();
        let mut recv = vec![0u8; recv_counts.iter().sum()];
        comm.all_to_all_v(&msgs.concat(), &send_counts, &mut recv, &recv_counts)
            .unwrap();
        let expected: Vec<u8> = (0..n).flat_map(|src| message(seed, src, me)).collect();
        assert_eq!(recv, expected, "all-to-all rank {me} of {n}, seed {seed}");
    }
    // A wrong receive count is the receiver's error; the others complete.
    let msgs: Vec<Vec<u8>> = (0..n).map(|j| vec![j as u8; 3]).collect();
    let mut recv_counts = vec![3; n];
    if me == 1 {
        recv_counts[0] = 2;
    }
    let mut recv = vec![0u8; recv_counts.iter().sum()];
    let r = comm.all_to_all_v(&msgs.concat(), &[3; 64][..n], &mut recv, &recv_counts);
    if me == 1 {
        assert!(
            matches!(r, Err(CollectiveError::CountMismatch { src: 0, .. })),
            "{r:?}"
        );
    } else {
        r.unwrap();
    }
    // A refusal is everyone's error.
    let bad = if me == 0 { 5 } else { 0 };
    let r = comm.all_to_all_v(&[0u8; 5][..bad], &vec![0; n], &mut [], &vec![0; n]);
    match (me, r) {
        (0, Err(CollectiveError::BadArgs { .. })) => {}
        (_, Err(CollectiveError::PeerRefused { rank: 0, .. })) if me != 0 => {}
        (_, r) => panic!("rank {me}: expected a refusal, got {r:?}"),
    }
    // What MPI's C-int counts cannot hold on the receiving side is refused by every rank in
    // the first, agreed step: rank 1 sends one byte past `i32::MAX / ranks` to rank 0 (rank 0
    // overflowed and ended alone while the others waited), then every rank all-reduces that
    // many bytes. The buffers are zeroed allocations no refused call touches.
    let cap = i32::MAX as usize / n;
    let mut sends = vec![0; n];
    let mut recvs = vec![0; n];
    if me == 1 {
        sends[0] = cap + 1;
    }
    if me == 0 {
        recvs[1] = cap + 1;
    }
    let send = vec![0u8; sends.iter().sum()];
    let mut recv = vec![0u8; recvs.iter().sum()];
    let r = comm.all_to_all_v(&send, &sends, &mut recv, &recvs);
    match (me, r) {
        (1, Err(CollectiveError::TooLarge { len, cap: c, .. })) if len == cap + 1 && c == cap => {}
        (_, Err(CollectiveError::PeerRefused { rank: 1, .. })) if me != 1 => {}
        (_, r) => panic!("rank {me}: expected the oversize all-to-all refused, got {r:?}"),
    }
    let mut big = vec![0u8; (cap / 4 + 1) * 4];
    let r = comm.all_reduce(&mut big, ReduceType::F32, ReduceOp::Sum);
    match (me, r) {
        (0, Err(CollectiveError::TooLarge { cap: c, .. })) if c == cap => {}
        (_, Err(CollectiveError::PeerRefused { rank: 0, .. })) if me != 0 => {}
        (_, r) => panic!("rank {me}: expected the oversize all-reduce refused, got {r:?}"),
    }
    drop((send, recv, big));
    for (seed, len) in [(7u64, 1000usize), (8, 1), (9, 0)] {
        let mut buf: Vec<u8> = reduce_input(seed, me, len)
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        comm.all_reduce(&mut buf, ReduceType::F32, ReduceOp::Sum)
            .unwrap();
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| reduce_input(seed, r, len)).collect();
        let expected: Vec<u8> = (0..len)
            .map(|k| (1..n).fold(inputs[0][k], |acc, r| acc + inputs[r][k]))
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        assert_eq!(buf, expected, "all-reduce rank {me} of {n}, len {len}");
    }
    // Clock offsets to rank 0: every rank learns rank 0's host (boot id), and on one host
    // (one CLOCK_MONOTONIC) the true offset is zero, so it lies within the stated bound.
    let (offset, reference) = comm.clock_offset_to_rank_0(
        16,
        &format!("host of rank {me}"),
        simpler_dfx::writer::monotonic_ns,
    );
    assert_eq!(reference, "host of rank 0", "rank {me}");
    if me == 0 {
        assert_eq!(offset, OffsetEstimate::ZERO);
    } else {
        assert!(offset.uncertainty_ns < u64::MAX, "rank {me}: {offset:?}");
        assert!(
            offset.offset_ns.unsigned_abs() <= offset.uncertainty_ns,
            "rank {me}: {offset:?} on one host"
        );
    }
    println!("rank {me} of {n}: ok (clock offset {offset:?})");
}

/// Rank 1 fails and aborts the job while the others wait for it in an all-reduce.
fn abort_main() {
    let universe = mpi::initialize().expect("MPI initializes once");
    let mut comm = MpiCollectives::new(universe.world());
    if comm.rank() == 1 {
        comm.abort(3);
    }
    let mut buf = [0u8; 4];
    let r = comm.all_reduce(&mut buf, ReduceType::F32, ReduceOp::Sum);
    panic!(
        "rank {}: the all-reduce returned ({r:?}) without rank 1",
        comm.rank()
    );
}

fn main() {
    if under_mpirun() {
        if std::env::args().any(|a| a == ABORT_ARG) {
            abort_main();
        }
        rank_main();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for ranks in [2, 4] {
        let status = mpirun_command(ranks, &exe)
            .status()
            .expect("mpirun (Debian: openmpi-bin) runs");
        assert!(status.success(), "mpirun -np {ranks}: {status}");
        println!("test mpi_collectives_{ranks}_ranks ... ok");
    }
    // An aborting rank ends the job, the ranks waiting for it included. The deadline only
    // turns a hang into a failure; a working abort ends the job long before it.
    let mut job = mpirun_command(3, &exe)
        .arg(ABORT_ARG)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("mpirun (Debian: openmpi-bin) runs");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Some(status) = job.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            job.kill().unwrap();
            job.wait().unwrap();
            panic!("mpirun -np 3 with an aborting rank still runs after 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(
        !status.success(),
        "mpirun -np 3 with an aborting rank: {status}"
    );
    println!("test mpi_abort_ends_the_job ... ok");
}
