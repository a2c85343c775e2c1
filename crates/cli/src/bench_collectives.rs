//! `simpler bench collectives`: all-to-all (variable-size interface, equal sizes per peer) and
//! all-reduce latency and bandwidth by message size, over the node's shared-memory backend
//! (the chips of a node on this host) or over MPI (the ranks of an `mpirun` job).
//!
//! Every rank times every call; per round the slowest rank's time is the round's
//! `effective_us` (the collective ends when its last rank does) and the fastest's
//! `fast_effective_us`; a round some rank did not report is dropped (`valid_rounds`). With
//! `--trace-dir` every rank writes its own trace (one `run` span per call, the round number as
//! its invocation), which `simpler trace timing --rounds` merges into the same statistics.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use simpler_core::trace::{AttrValue, Clock, SpanRecord, TRACE_FORMAT_VERSION};
use simpler_dfx::TraceWriter;
use simpler_dfx::bench_stats::{MultiRank, Summary, combine_ranks};
use simpler_dfx::writer::{ProcessRole, set_process_role};
use simpler_node::{
    ChildCtx, ChildFns, ChildId, Collectives, Node, NodeConfig, ReduceOp, ReduceType,
};

/// The chip function's name in the node's function table.
const CHIP_FN: &str = "bench_collectives";

/// Registers this command's chip function.
pub(crate) fn register(fns: ChildFns) -> ChildFns {
    fns.register(CHIP_FN, chip_fn)
}

/// Which collectives backend to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
    /// The node's shared-memory collectives: one child process per chip on this host.
    Shm,
    /// MPI (build with `--features mpi`): the ranks of `mpirun -np N` on this host, launched
    /// by this command.
    Mpi,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Shm => "shm",
            Backend::Mpi => "mpi",
        }
    }
}

/// Arguments of `simpler bench collectives`.
#[derive(Args, Debug, Clone)]
pub(crate) struct BenchCollectivesArgs {
    /// Rank counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    ranks: Vec<usize>,
    /// Backend: `shm` (a node's chips) or `mpi` (ranks of an `mpirun` job).
    #[arg(long, value_enum, default_value = "shm")]
    collectives: Backend,
    /// Bytes each rank sends to each rank (all-to-all) and bytes reduced (all-reduce, as f32
    /// values), comma-separated multiples of 4.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0,1024,16384,262144,1048576"
    )]
    sizes: Vec<usize>,
    /// Measured rounds per operation and size.
    #[arg(long, default_value_t = 200)]
    rounds: usize,
    /// Warm-up rounds before them (discarded).
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Write each rank's trace here (`<backend>-<N>ranks-rank<r>.jsonl`).
    #[arg(long, value_name = "DIR")]
    trace_dir: Option<PathBuf>,
    /// Seconds each rank count's processes may take to answer one operation and size's
    /// rounds before the node fails, naming the ranks that did not answer (shm) [default:
    /// 600].
    #[arg(long, value_name = "SECONDS", value_parser = crate::opts::rank_timeout)]
    rank_timeout_secs: Option<f64>,
}

/// The operations measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllToAll,
    AllReduce,
}

impl Op {
    const ALL: [Op; 2] = [Op::AllToAll, Op::AllReduce];

    fn name(self) -> &'static str {
        match self {
            Op::AllToAll => "all_to_all",
            Op::AllReduce => "all_reduce",
        }
    }

    fn code(self) -> u64 {
        match self {
            Op::AllToAll => 0,
            Op::AllReduce => 1,
        }
    }

    fn from_code(c: u64) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.code() == c)
    }

    /// Bytes one rank sends to the others (all-to-all) or reduces (all-reduce) per call.
    fn moved(self, size: usize, ranks: usize) -> usize {
        match self {
            Op::AllToAll => size * (ranks - 1),
            Op::AllReduce => size / 4 * 4,
        }
    }
}

/// Largest all-to-all message per peer (the shared-memory backend stages a rank's whole send).
const MAX_SIZE: usize = 64 << 20;

/// Most message bytes of one call over all ranks (`ranks² × size`).
const MAX_TOTAL: usize = 1 << 30;

/// Most rounds (warm-up included): every rank's times come back in one mailbox answer.
const MAX_ROUNDS: usize = 1000;

/// One measurement's setting, as every rank receives it.
struct Job {
    op: Op,
    size: usize,
    rounds: usize,
    backend: Backend,
    trace_dir: Option<PathBuf>,
}

impl Job {
    fn encode(&self) -> Vec<u8> {
        let mut out: Vec<u8> = [
            self.op.code(),
            self.size as u64,
            self.rounds as u64,
            (self.backend == Backend::Mpi) as u64,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
        if let Some(d) = &self.trace_dir {
            out.extend_from_slice(d.as_os_str().as_encoded_bytes());
        }
        out
    }

    fn decode(b: &[u8]) -> Result<Job, String> {
        let word = |i: usize| -> Result<u64, String> {
            b.get(8 * i..8 * i + 8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
                .ok_or_else(|| "bench_collectives: arguments too short".to_string())
        };
        let op = Op::from_code(word(0)?).ok_or("bench_collectives: unknown operation")?;
        let dir = std::str::from_utf8(&b[32..]).map_err(|e| format!("trace dir: {e}"))?;
        Ok(Job {
            op,
            size: usize::try_from(word(1)?).map_err(|e| e.to_string())?,
            rounds: usize::try_from(word(2)?).map_err(|e| e.to_string())?,
            backend: if word(3)? == 1 {
                Backend::Mpi
            } else {
                Backend::Shm
            },
            trace_dir: (!dir.is_empty()).then(|| PathBuf::from(dir)),
        })
    }

    /// Stable id of what one round runs (the trace's `callable`): equal on every rank.
    fn callable(&self, ranks: usize) -> String {
        let key = format!(
            "collectives/{}/{}/{}/{ranks}",
            self.backend.name(),
            self.op.name(),
            self.size
        );
        // FNV-1a, 64 bits.
        let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        format!("{h:016x}")
    }
}

/// Runs `job.rounds` calls on `comm`; returns each call's ns, and writes a span per call to
/// this rank's trace when asked.
fn time_calls<C: Collectives<Buf = [u8]> + ?Sized>(
    comm: &mut C,
    job: &Job,
) -> Result<Vec<u64>, String> {
    let (n, me) = (comm.ranks(), comm.rank());
    let send = vec![me as u8; job.size * n];
    let mut recv = vec![0u8; job.size * n];
    let counts = vec![job.size; n];
    let mut times = Vec::with_capacity(job.rounds);
    let mut starts = Vec::with_capacity(job.rounds);
    for _ in 0..job.rounds {
        let t0 = simpler_core::clock::now_ns();
        let t = Instant::now();
        match job.op {
            Op::AllToAll => comm.all_to_all_v(&send, &counts, &mut recv, &counts),
            Op::AllReduce => comm.all_reduce(
                &mut recv[..job.size / 4 * 4],
                ReduceType::F32,
                ReduceOp::Sum,
            ),
        }
        .map_err(|e| e.to_string())?;
        times.push(t.elapsed().as_nanos() as u64);
        starts.push(t0);
    }
    if let Some(dir) = &job.trace_dir {
        let path = dir.join(format!("{}-{n}ranks-rank{me}.jsonl", job.backend.name()));
        write_spans(&path, job, n, &starts, &times).map_err(|e| e.to_string())?;
    }
    Ok(times)
}

fn write_spans(path: &Path, job: &Job, n: usize, starts: &[u64], times: &[u64]) -> Result<()> {
    let mut w = TraceWriter::append(path)?;
    let pid = w.anchor().pid;
    let callable = job.callable(n);
    let label = format!("{} {} B", job.op.name(), job.size);
    for (round, (&ts_ns, &dur_ns)) in starts.iter().zip(times).enumerate() {
        let mut span = SpanRecord {
            v: TRACE_FORMAT_VERSION,
            pid,
            tid: 0,
            inv: round as u64,
            callable: callable.clone(),
            depth: 0,
            name: "run".into(),
            ts_ns,
            dur_ns,
            clock: Clock::Host,
            attrs: Default::default(),
        };
        span.attrs
            .insert("label".into(), AttrValue::Str(label.clone()));
        span.attrs
            .insert("bytes".into(), AttrValue::Int(job.size as i64));
        w.span(&span)?;
    }
    w.finish()?;
    Ok(())
}

/// The chip function: one measurement on this chip's collectives; answers the times.
fn chip_fn(ctx: &mut ChildCtx, args: &[u8]) -> Result<Vec<u8>, String> {
    let job = Job::decode(args)?;
    let ChildId::Chip(rank) = ctx.id() else {
        return Err("bench_collectives runs on chips".into());
    };
    let ranks = ctx.chips();
    // One process, one rank: a second node's chip is another process.
    let _ = set_process_role(ProcessRole::chip(rank as u32, ranks as u32));
    let comm = ctx.collectives().ok_or("no collectives in this chip")?;
    let times = time_calls(comm, &job)?;
    Ok(times.iter().flat_map(|t| t.to_le_bytes()).collect())
}

fn check(args: &BenchCollectivesArgs) -> Result<()> {
    if args.rank_timeout_secs.is_some() && args.collectives == Backend::Mpi {
        bail!(
            "--rank-timeout-secs: bounds the ranks of a node (shm); under mpirun its own options bound the job"
        );
    }
    if let Some(&n) = args.ranks.iter().find(|&&n| !(2..=64).contains(&n)) {
        bail!("--ranks {n}: each rank count must be between 2 and 64");
    }
    if let Some(&s) = args.sizes.iter().find(|&&s| s > MAX_SIZE) {
        bail!("--sizes {s}: at most {MAX_SIZE} bytes per peer");
    }
    // The all-reduce sums f32s: another size would be measured at its whole f32s while its
    // row said the size given.
    for (flag, list) in [("--ranks", &args.ranks), ("--sizes", &args.sizes)] {
        if let Some(v) = list
            .iter()
            .enumerate()
            .find_map(|(i, v)| list[..i].contains(v).then_some(v))
        {
            bail!("{flag}: {v} is given twice");
        }
    }
    if let Some(&s) = args.sizes.iter().find(|&&s| !s.is_multiple_of(4)) {
        bail!("--sizes {s}: give multiples of 4 bytes (the all-reduce sums f32 values)");
    }
    // Every rank stages its whole send (ranks × size) in the shared segment, and sends and
    // receives as much from its own memory: bound the total before anything is allocated.
    let largest = args.sizes.iter().max().copied().unwrap_or(0);
    let most = args.ranks.iter().max().copied().unwrap_or(0);
    let in_flight = most.checked_mul(most).and_then(|r| r.checked_mul(largest));
    if in_flight.is_none_or(|b| b > MAX_TOTAL) {
        bail!(
            "--ranks {most} --sizes {largest}: {} bytes of messages in flight, at most {MAX_TOTAL}",
            in_flight.map_or("more than 2^64".to_string(), |b| b.to_string())
        );
    }
    if args.rounds == 0
        || args
            .rounds
            .checked_add(args.warmup)
            .is_none_or(|n| n > MAX_ROUNDS)
    {
        bail!(
            "--rounds {} --warmup {}: need at least one round and at most {MAX_ROUNDS} in all",
            args.rounds,
            args.warmup
        );
    }
    Ok(())
}

pub(crate) fn main(args: BenchCollectivesArgs) -> Result<()> {
    check(&args)?;
    match args.collectives {
        Backend::Shm => {
            print!("{}", header(&args));
            for &n in &args.ranks {
                shm(&args, n)?;
            }
            Ok(())
        }
        Backend::Mpi => mpi_main(&args),
    }
}

/// What this host is and what the rows mean.
fn header(args: &BenchCollectivesArgs) -> String {
    let cores = std::thread::available_parallelism().map_or(0, |c| c.get());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "collectives over {}: {} measured rounds after {} warm-up per row; this host has {cores} cores, so with more ranks than cores the ranks time-share them and a row measures that sharing as much as the transfer",
        args.collectives.name(),
        args.rounds,
        args.warmup
    );
    let _ = writeln!(
        out,
        "per round: effective = slowest rank's call, fast_effective = fastest rank's; GB/s = bytes one rank sends to the others (all-reduce: bytes reduced) / median effective"
    );
    let _ = writeln!(
        out,
        "{:<4} {:<10} {:>5} {:>10} {:>14} {:>14} {:>14} {:>10} {:>7}",
        "",
        "op",
        "ranks",
        "bytes/peer",
        "effective_us",
        "fast_eff_us",
        "eff_us min",
        "GB/s",
        "valid"
    );
    out
}

/// One row from every rank's times (warm-up included).
fn row(backend: Backend, op: Op, n: usize, size: usize, warmup: usize, per_rank: &[Vec<u64>]) {
    let rounds: Vec<Vec<Option<f64>>> = (0..per_rank.iter().map(Vec::len).max().unwrap_or(0))
        .map(|k| {
            per_rank
                .iter()
                .map(|t| t.get(k).map(|&ns| ns as f64 / 1e3))
                .collect()
        })
        .collect();
    let m: MultiRank = combine_ranks(&rounds, n, warmup);
    let (eff, fast) = (Summary::of(&m.effective), Summary::of(&m.fast_effective));
    let gbps = op.moved(size, n) as f64 / (eff.median * 1e3);
    println!(
        "{:<4} {:<10} {:>5} {:>10} {:>14.2} {:>14.2} {:>14.2} {:>10} {:>7}",
        backend.name(),
        op.name(),
        n,
        size,
        eff.median,
        fast.median,
        eff.min,
        if op.moved(size, n) == 0 {
            "-".to_string()
        } else {
            format!("{gbps:.2}")
        },
        format!("{}/{}", m.valid_rounds, m.rounds)
    );
}

fn jobs(args: &BenchCollectivesArgs) -> impl Iterator<Item = Job> + '_ {
    Op::ALL.into_iter().flat_map(move |op| {
        args.sizes.iter().map(move |&size| Job {
            op,
            size,
            rounds: args.warmup + args.rounds,
            backend: args.collectives,
            trace_dir: args.trace_dir.clone(),
        })
    })
}

fn shm(args: &BenchCollectivesArgs, n: usize) -> Result<()> {
    let largest = args.sizes.iter().max().copied().unwrap_or(0);
    let d = NodeConfig::default();
    let mut node = Node::start(NodeConfig {
        chips: n,
        collective_bytes: (n * largest).max(1 << 16),
        call_timeout: args
            .rank_timeout_secs
            .map_or(d.call_timeout, std::time::Duration::from_secs_f64),
        ..d
    })
    .with_context(|| format!("starting a node of {n} chips"))?;
    for job in jobs(args) {
        let bytes = job.encode();
        let calls: Vec<(ChildId, &[u8])> = (0..n).map(|i| (ChildId::Chip(i), &bytes[..])).collect();
        let answers = node.call_group(CHIP_FN, &calls)?;
        let per_rank: Vec<Vec<u64>> = answers
            .iter()
            .map(|a| {
                a.chunks_exact(8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect()
            })
            .collect();
        row(Backend::Shm, job.op, n, job.size, args.warmup, &per_rank);
    }
    node.close()?;
    if let Some(d) = &args.trace_dir {
        println!(
            "wrote {}/shm-{n}ranks-rank*.jsonl (simpler trace timing --rounds --warmup {} FILES)",
            d.display(),
            args.warmup
        );
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn mpi_main(_: &BenchCollectivesArgs) -> Result<()> {
    bail!(
        "--collectives mpi: this simpler was built without the `mpi` feature (cargo build -p simpler-cli --features mpi; needs an MPI library and libclang)"
    )
}

/// Outside `mpirun`: starts `mpirun -np N` of this command for each rank count. Inside: one
/// rank; rank 0 gathers every rank's times and prints the rows.
#[cfg(feature = "mpi")]
fn mpi_main(args: &BenchCollectivesArgs) -> Result<()> {
    if !simpler_node::under_mpirun() {
        print!("{}", header(args));
        let exe = std::env::current_exe().context("current_exe")?;
        for &n in &args.ranks {
            let mut cmd = simpler_node::mpirun_command(n, &exe);
            cmd.args(["bench", "collectives", "--collectives", "mpi"])
                .arg(format!("--ranks={n}"))
                .arg(format!(
                    "--sizes={}",
                    args.sizes
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                ))
                .arg(format!("--rounds={}", args.rounds))
                .arg(format!("--warmup={}", args.warmup));
            if let Some(d) = &args.trace_dir {
                cmd.arg("--trace-dir").arg(d);
            }
            let status = cmd
                .status()
                .context("running mpirun (Debian: openmpi-bin)")?;
            if !status.success() {
                bail!("mpirun -np {n}: {status}");
            }
        }
        return Ok(());
    }
    let universe = mpi::initialize().context("MPI initializes once")?;
    let mut comm = simpler_node::MpiCollectives::new(universe.world());
    let (me, n) = (comm.rank(), comm.ranks());
    if args.ranks != [n] {
        bail!("--ranks {:?} under an mpirun job of {n} ranks", args.ranks);
    }
    let _ = set_process_role(crate::dsv4_ep::mpi_rank_role(&mut comm));
    for job in jobs(args) {
        let times = time_calls(&mut comm, &job).map_err(anyhow::Error::msg)?;
        // Every rank's times to rank 0, through the collectives themselves.
        let mine: Vec<u8> = times.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut send_counts = vec![0; n];
        send_counts[0] = mine.len();
        let recv_counts = vec![if me == 0 { mine.len() } else { 0 }; n];
        let mut all = vec![0u8; recv_counts.iter().sum()];
        comm.all_to_all_v(&mine, &send_counts, &mut all, &recv_counts)?;
        if me == 0 {
            let per_rank: Vec<Vec<u64>> = all
                .chunks_exact(mine.len().max(1))
                .map(|r| {
                    r.chunks_exact(8)
                        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                        .collect()
                })
                .collect();
            row(Backend::Mpi, job.op, n, job.size, args.warmup, &per_rank);
        }
    }
    Ok(())
}
