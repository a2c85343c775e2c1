//! All-to-all and all-reduce cost by message size: over the shared-memory backend for 2 and 4
//! ranks with `cargo run --release -p simpler-node --example collectives_bench [rounds]`, and
//! over MPI with the example built with `--features mpi` and started by
//! `mpirun -np N target/release/examples/collectives_bench [rounds]`.
//!
//! Each chip times every call; per round the slowest rank's time is the round's time (the
//! collective ends when its last rank does) and the fastest rank's is printed beside it.
//! Prints the median over the measured rounds; bandwidth is the bytes one rank sends to the
//! others per call divided by that time.

use std::time::Instant;

use simpler_node::{
    ChildCtx, ChildFns, ChildId, Collectives, Node, NodeConfig, ReduceOp, ReduceType,
};

const WARMUP: usize = 20;

fn u64_at(args: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(args[8 * i..8 * i + 8].try_into().unwrap())
}

/// Times `rounds` calls after a warm-up: op 0 is an all-to-all of `size` bytes to every rank,
/// op 1 an all-reduce of `size` bytes of f32. Returns each measured call's nanoseconds.
fn time_calls<C: Collectives<Buf = [u8]> + ?Sized>(
    comm: &mut C,
    op: u64,
    size: usize,
    rounds: usize,
) -> Result<Vec<u64>, String> {
    let n = comm.ranks();
    let send = vec![comm.rank() as u8; size * n];
    let mut recv = vec![0u8; size * n];
    let counts = vec![size; n];
    let mut times = Vec::with_capacity(rounds);
    for round in 0..WARMUP + rounds {
        let t = Instant::now();
        if op == 0 {
            comm.all_to_all_v(&send, &counts, &mut recv, &counts)
        } else {
            comm.all_reduce(&mut recv[..size / 4 * 4], ReduceType::F32, ReduceOp::Sum)
        }
        .map_err(|e| e.to_string())?;
        if round >= WARMUP {
            times.push(t.elapsed().as_nanos() as u64);
        }
    }
    Ok(times)
}

/// The chip function: args op, bytes per peer, rounds; answers the times.
fn bench(ctx: &mut ChildCtx, args: &[u8]) -> Result<Vec<u8>, String> {
    let (op, size, rounds) = (
        u64_at(args, 0),
        u64_at(args, 1) as usize,
        u64_at(args, 2) as usize,
    );
    let comm = ctx.collectives().ok_or("not a chip")?;
    let times = time_calls(comm, op, size, rounds)?;
    Ok(times.iter().flat_map(|t| t.to_le_bytes()).collect())
}

const SIZES: [usize; 6] = [0, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20];

/// Prints one row from every rank's times.
fn row(backend: &str, name: &str, n: usize, op: u64, size: usize, per_rank: &[Vec<u64>]) {
    let rounds = per_rank[0].len();
    let slowest: Vec<u64> = (0..rounds)
        .map(|r| per_rank.iter().map(|t| t[r]).max().unwrap())
        .collect();
    let fastest: Vec<u64> = (0..rounds)
        .map(|r| per_rank.iter().map(|t| t[r]).min().unwrap())
        .collect();
    let (slow, fast) = (median(slowest), median(fastest));
    // Bytes one rank sends to the others (all-to-all), or reduces (all-reduce).
    let moved = if op == 0 {
        size * (n - 1)
    } else {
        size / 4 * 4
    };
    let gbps = moved as f64 / slow.max(1) as f64;
    println!(
        "{backend:<4} {name:<11} {n:>5}  {size:>10}  {:>18.2}  {:>18.2}  {gbps:>9.2}",
        slow as f64 / 1e3,
        fast as f64 / 1e3
    );
}

/// Under `mpirun` (feature `mpi`): every rank times the calls, rank 0 prints.
#[cfg(feature = "mpi")]
fn mpi_main(rounds: usize) {
    use mpi::traits::{Communicator, CommunicatorCollectives};
    let universe = mpi::initialize().expect("MPI initializes once");
    let world = universe.world();
    let mut comm = simpler_node::MpiCollectives::new(universe.world());
    let n = world.size() as usize;
    for (op, name) in [(0u64, "all_to_all"), (1, "all_reduce")] {
        for size in SIZES {
            let times = time_calls(&mut comm, op, size, rounds).expect("bench");
            let mut all = vec![0u64; n * rounds];
            world.all_gather_into(&times[..], &mut all[..]);
            if world.rank() == 0 {
                let per_rank: Vec<Vec<u64>> =
                    all.chunks_exact(rounds).map(<[u64]>::to_vec).collect();
                row("mpi", name, n, op, size, &per_rank);
            }
        }
    }
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() {
    let fns = ChildFns::new().register("bench", bench);
    simpler_node::child_main_if_requested(&fns);
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    #[cfg(feature = "mpi")]
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
    {
        mpi_main(rounds);
        return;
    }
    println!(
        "     op          ranks  bytes/peer   median_us(slowest)  median_us(fastest)  GB/s/rank"
    );
    for n in [2usize, 4] {
        let mut node = Node::start(NodeConfig {
            chips: n,
            collective_bytes: n * (1 << 20),
            ..NodeConfig::default()
        })
        .expect("node start");
        for (op, name) in [(0u64, "all_to_all"), (1, "all_reduce")] {
            for size in SIZES {
                let args: Vec<u8> = [op, size as u64, rounds as u64]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                let calls: Vec<(ChildId, &[u8])> =
                    (0..n).map(|i| (ChildId::Chip(i), &args[..])).collect();
                let answers = node.call_group("bench", &calls).expect("bench");
                let per_rank: Vec<Vec<u64>> = answers
                    .iter()
                    .map(|a| {
                        a.chunks_exact(8)
                            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
                            .collect()
                    })
                    .collect();
                row("shm", name, n, op, size, &per_rank);
            }
        }
        node.close().expect("close");
    }
}
