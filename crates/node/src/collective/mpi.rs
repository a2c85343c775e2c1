//! The MPI backend (feature `mpi`): the ranks of an `mpirun` job, on one host or many, through
//! the `mpi` crate over the system's MPI library (Open MPI or MPICH).
//!
//! It keeps the shared-memory backend's contract exactly, which plain MPI calls would not:
//!
//! - **Refusals are agreed.** Before any data moves, one fixed-size `MPI_Alltoall` carries each
//!   rank's verdict on its own arguments and the byte count it sends to each peer. Every rank
//!   then knows whether any rank refused, and either all exchange or none does.
//! - **A receive count that differs from the sender's is the receiver's error only.** The
//!   receiver learnt the true counts in the first step, receives into scratch memory with them
//!   (so the `MPI_Alltoallv` matches on both sides and nobody hangs or truncates), and returns
//!   `CountMismatch`; the other ranks complete normally.
//! - **Sums have the bits of a sequential sum in rank order.** `MPI_Allreduce` may add in any
//!   order (trees, pairs), which changes float results with the rank count and the library;
//!   instead every rank gathers every rank's piece (`MPI_Allgather`) and adds in rank order.
//!   That reads `ranks` times the data, the price of results that equal the single-process
//!   computation bit for bit.

use mpi::Count;
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives, Destination, Root, Source};

use super::{Collectives, ReduceOp, ReduceType};
use crate::clock_offset::{OffsetEstimate, PingSample, estimate_offset};
use crate::error::CollectiveError;

/// Bytes of a boot id sent to every rank (the kernel's are 36).
const BOOT_ID_BYTES: usize = 64;

const FLAG_OK: u64 = 0;
const FLAG_BAD_ARGS: u64 = 1;
const FLAG_TOO_LARGE: u64 = 2;

/// A communicator over MPI. Build it from a communicator of an initialized MPI universe
/// (`mpi::initialize()`, then `universe.world()`); the universe must outlive it.
pub struct MpiCollectives {
    comm: SimpleCommunicator,
    rank: usize,
    ranks: usize,
}

impl MpiCollectives {
    /// The collectives of `comm`.
    pub fn new(comm: SimpleCommunicator) -> MpiCollectives {
        let rank = comm.rank() as usize;
        let ranks = comm.size() as usize;
        MpiCollectives { comm, rank, ranks }
    }

    /// Ends every rank of the job (`MPI_Abort` with `code`). What a rank that failed does
    /// when its peers may be inside a collective waiting for it: MPI has no way to release
    /// them short of this, and `mpirun` then ends the job with a failure.
    pub fn abort(&self, code: i32) -> ! {
        self.comm.abort(code)
    }

    /// This rank's `CLOCK_MONOTONIC` offset to rank 0's, and rank 0's boot id (which host's
    /// clock the offset is to; `boot_id` is this rank's, longer ones are cut at 64 bytes).
    /// `now_ns` reads the clock to compare: the one the ranks' traces record (`CLOCK_MONOTONIC`).
    /// Every rank must call it at the same point (a collective). Rank 0 runs `round_trips`
    /// ping-pongs with each other rank in turn and keeps the shortest
    /// ([`crate::clock_offset`]); its own offset is zero. Run it at start-up, before the
    /// ranks' traced work, so the traces can be merged on rank 0's clock across hosts.
    pub fn clock_offset_to_rank_0(
        &mut self,
        round_trips: usize,
        boot_id: &str,
        now_ns: impl Fn() -> u64,
    ) -> (OffsetEstimate, String) {
        let mut boot = [0u8; BOOT_ID_BYTES];
        if self.rank == 0 {
            let b = &boot_id.as_bytes()[..boot_id.len().min(BOOT_ID_BYTES)];
            boot[..b.len()].copy_from_slice(b);
        }
        self.comm.process_at_rank(0).broadcast_into(&mut boot[..]);
        let len = boot.iter().position(|&b| b == 0).unwrap_or(BOOT_ID_BYTES);
        let reference_boot_id = String::from_utf8_lossy(&boot[..len]).into_owned();
        let round_trips = round_trips.max(1);
        let estimate = if self.rank == 0 {
            for r in 1..self.ranks {
                let peer = self.comm.process_at_rank(r as i32);
                let samples: Vec<PingSample> = (0..round_trips)
                    .map(|_| {
                        let sent_ns = now_ns();
                        peer.send(&sent_ns);
                        let (remote_ns, _) = peer.receive::<u64>();
                        let received_ns = now_ns();
                        PingSample {
                            sent_ns,
                            remote_ns,
                            received_ns,
                        }
                    })
                    .collect();
                // A monotonic clock gives usable samples; if not, the offset is unknown.
                let e = estimate_offset(&samples).unwrap_or(OffsetEstimate {
                    offset_ns: 0,
                    uncertainty_ns: u64::MAX,
                });
                peer.send(&[e.offset_ns as u64, e.uncertainty_ns][..]);
            }
            OffsetEstimate::ZERO
        } else {
            let root = self.comm.process_at_rank(0);
            for _ in 0..round_trips {
                let _ = root.receive::<u64>();
                root.send(&now_ns());
            }
            let mut e = [0u64; 2];
            root.receive_into(&mut e[..]);
            OffsetEstimate {
                offset_ns: e[0] as i64,
                uncertainty_ns: e[1],
            }
        };
        (estimate, reference_boot_id)
    }

    /// The refusal of the lowest refusing rank (this rank's own in detail), given every rank's
    /// flag.
    fn refusal(
        &self,
        op: &'static str,
        flags: impl Iterator<Item = u64>,
        own: &Option<CollectiveError>,
    ) -> Option<CollectiveError> {
        flags
            .enumerate()
            .find(|&(_, f)| f != FLAG_OK)
            .map(|(r, _)| match own {
                Some(e) if r == self.rank => e.clone(),
                _ => CollectiveError::PeerRefused { op, rank: r },
            })
    }
}

/// Displacements of back-to-back pieces of `counts` bytes.
fn displacements(counts: &[Count]) -> Vec<Count> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let d = *at;
            *at += c;
            Some(d)
        })
        .collect()
}

impl Collectives for MpiCollectives {
    type Buf = [u8];

    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.ranks
    }

    fn all_to_all_v(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CollectiveError> {
        const OP: &str = "all_to_all_v";
        let (n, me) = (self.ranks, self.rank);
        // MPI counts and displacements are C ints, on the receiving side too: a rank receives
        // from `n` senders, so each may send at most `Count::MAX / n` bytes in all (a bound
        // every rank checks itself, so the refusal is agreed in step 1).
        let own = super::check_all_to_all_args(
            OP,
            me,
            n,
            send.len(),
            send_counts,
            recv.len(),
            recv_counts,
            Count::MAX as usize / n,
        );
        let flag = match &own {
            None => FLAG_OK,
            Some(CollectiveError::TooLarge { .. }) => FLAG_TOO_LARGE,
            Some(_) => FLAG_BAD_ARGS,
        };
        // Step 1: (flag, bytes for you) to every rank.
        let header: Vec<u64> = (0..n)
            .flat_map(|j| {
                [
                    flag,
                    if own.is_none() {
                        send_counts[j] as u64
                    } else {
                        0
                    },
                ]
            })
            .collect();
        let mut heard = vec![0u64; 2 * n];
        self.comm.all_to_all_into(&header[..], &mut heard[..]);
        if let Some(e) = self.refusal(OP, heard.chunks_exact(2).map(|p| p[0]), &own) {
            return Err(e);
        }
        // Step 2: the data, with the senders' true counts on both sides.
        let incoming: Vec<usize> = heard.chunks_exact(2).map(|p| p[1] as usize).collect();
        let mismatch = (0..n).find(|&src| incoming[src] != recv_counts[src]);
        let sc: Vec<Count> = send_counts.iter().map(|&c| c as Count).collect();
        let rc: Vec<Count> = incoming.iter().map(|&c| c as Count).collect();
        let (sd, rd) = (displacements(&sc), displacements(&rc));
        let mut scratch = Vec::new();
        let target: &mut [u8] = match mismatch {
            None => recv,
            Some(_) => {
                scratch.resize(incoming.iter().sum(), 0u8);
                &mut scratch
            }
        };
        // Empty slices share one dangling address, and Open MPI refuses a send buffer equal
        // to the receive buffer (MPI_ERR_ARG): give an empty side a distinct byte of its own.
        let (send_stub, mut recv_stub) = ([0u8; 1], [0u8; 1]);
        let send: &[u8] = if send.is_empty() { &send_stub } else { send };
        let target: &mut [u8] = if target.is_empty() {
            &mut recv_stub
        } else {
            target
        };
        self.comm.all_to_all_varcount_into(
            &Partition::new(send, &sc[..], &sd[..]),
            &mut PartitionMut::new(target, &rc[..], &rd[..]),
        );
        match mismatch {
            None => Ok(()),
            Some(src) => Err(CollectiveError::CountMismatch {
                op: OP,
                src,
                dst: me,
                sent: incoming[src],
                expected: recv_counts[src],
            }),
        }
    }

    fn all_reduce(
        &mut self,
        buf: &mut [u8],
        ty: ReduceType,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "all_reduce";
        let (ReduceType::F32, ReduceOp::Sum) = (ty, op);
        let (n, me) = (self.ranks, self.rank);
        // The gathered pieces (`n` of `buf`'s length) are counted in a C int; each rank judges
        // its own length and the flags make the refusal agreed, as the shared-memory backend's.
        let cap = Count::MAX as usize / n;
        let own = if !buf.len().is_multiple_of(4) {
            Some(CollectiveError::BadArgs {
                op: OP,
                rank: me,
                reason: format!("{} bytes is not a whole number of f32", buf.len()),
            })
        } else if buf.len() > cap {
            Some(CollectiveError::TooLarge {
                op: OP,
                rank: me,
                len: buf.len(),
                cap,
            })
        } else {
            None
        };
        let flag = match &own {
            None => FLAG_OK,
            Some(CollectiveError::TooLarge { .. }) => FLAG_TOO_LARGE,
            Some(_) => FLAG_BAD_ARGS,
        };
        let mut heard = vec![0u64; 2 * n];
        self.comm
            .all_gather_into(&[flag, buf.len() as u64][..], &mut heard[..]);
        if let Some(e) = self.refusal(OP, heard.chunks_exact(2).map(|p| p[0]), &own) {
            return Err(e);
        }
        if let Some(r) = (0..n).find(|&r| heard[2 * r + 1] as usize != buf.len()) {
            return Err(CollectiveError::CountMismatch {
                op: OP,
                src: r,
                dst: me,
                sent: heard[2 * r + 1] as usize,
                expected: buf.len(),
            });
        }
        if buf.is_empty() {
            return Ok(());
        }
        let mut all = vec![0u8; n * buf.len()];
        self.comm.all_gather_into(&buf[..], &mut all[..]);
        let pieces: Vec<&[u8]> = all.chunks_exact(buf.len()).collect();
        for (k, out) in buf.chunks_exact_mut(4).enumerate() {
            let at = |r: usize| f32::from_ne_bytes(pieces[r][4 * k..4 * k + 4].try_into().unwrap());
            let sum = (1..n).fold(at(0), |acc, r| acc + at(r));
            out.copy_from_slice(&sum.to_ne_bytes());
        }
        Ok(())
    }
}
