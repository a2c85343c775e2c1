//! Collectives between the chips of a node, behind one trait that every backend implements.
//!
//! The trait has the shape MPI and NCCL share, so that either fits it without adapters:
//! buffers are the backend's own memory type ([`Collectives::Buf`]: host bytes for shared
//! memory and MPI, device memory for a later NCCL backend), counts are in bytes and both sides
//! of a variable all-to-all pass them (as `MPI_Alltoallv` does, and as NCCL's grouped
//! send/receive needs), and a reduction names its element type and operation (`MPI_Datatype`
//! and `MPI_Op`, `ncclDataType_t` and `ncclRedOp_t`). Receivers learn their counts from a
//! first all-to-all of counts ([`exchange_counts`]), as the MoE dispatch does.
//!
//! Every rank of a communicator makes the same calls in the same order. A call never leaves a
//! rank waiting because another refused its arguments: the refusal is seen by every rank
//! (`PeerRefused` on the others). A receive count that differs from what its sender sends is
//! reported by the receiving rank only (the others' data is exchanged normally).

#[cfg(feature = "mpi")]
pub mod mpi;
pub mod shm;

use crate::error::CollectiveError;

/// Element types a reduction understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceType {
    /// IEEE binary32.
    F32,
}

/// Reduction operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum, accumulated in rank order (`((r0 + r1) + r2) + ...`), so every rank gets the same
    /// bits and they equal a sequential sum over the ranks.
    Sum,
}

/// A communicator: `ranks()` processes, this one being `rank()`.
pub trait Collectives {
    /// The memory the backend moves (`[u8]` for host backends).
    type Buf: ?Sized;

    /// This process's rank.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn ranks(&self) -> usize;

    /// Variable-size all-to-all. `send` holds the messages to ranks `0..ranks()` back to back,
    /// `send_counts[j]` bytes for rank `j`; `recv` receives the messages from every rank back
    /// to back, `recv_counts[i]` bytes from rank `i`. Zero counts are allowed.
    fn all_to_all_v(
        &mut self,
        send: &Self::Buf,
        send_counts: &[usize],
        recv: &mut Self::Buf,
        recv_counts: &[usize],
    ) -> Result<(), CollectiveError>;

    /// In-place all-reduce of `buf`, which holds elements of `ty`; every rank passes the same
    /// length.
    fn all_reduce(
        &mut self,
        buf: &mut Self::Buf,
        ty: ReduceType,
        op: ReduceOp,
    ) -> Result<(), CollectiveError>;
}

/// Tells every rank how many bytes each other rank will send it: `send_counts[j]` goes to rank
/// `j`, and the result's `[i]` is what rank `i` sends here.
pub fn exchange_counts<C: Collectives<Buf = [u8]> + ?Sized>(
    comm: &mut C,
    send_counts: &[usize],
) -> Result<Vec<usize>, CollectiveError> {
    let n = comm.ranks();
    let send: Vec<u8> = send_counts
        .iter()
        .flat_map(|&c| (c as u64).to_le_bytes())
        .collect();
    let mut recv = vec![0u8; 8 * n];
    comm.all_to_all_v(&send, &vec![8; send_counts.len()], &mut recv, &vec![8; n])?;
    Ok(recv
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .collect())
}

/// This rank's own verdict on the arguments of an all-to-all over `ranks` ranks whose
/// backend carries at most `cap` bytes from one rank: `None` when they are consistent. Every
/// backend checks the same things, so every backend refuses the same calls.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_all_to_all_args(
    op: &'static str,
    rank: usize,
    ranks: usize,
    send_len: usize,
    send_counts: &[usize],
    recv_len: usize,
    recv_counts: &[usize],
    cap: usize,
) -> Option<CollectiveError> {
    let bad = |reason: String| CollectiveError::BadArgs { op, rank, reason };
    if send_counts.len() != ranks || recv_counts.len() != ranks {
        return Some(bad(format!(
            "{} send and {} receive counts for {ranks} ranks",
            send_counts.len(),
            recv_counts.len()
        )));
    }
    // Checked: counts that wrap around could otherwise add up to the buffer's length.
    let total = |c: &[usize]| c.iter().try_fold(0usize, |a, &b| a.checked_add(b));
    let (Some(sent), Some(received)) = (total(send_counts), total(recv_counts)) else {
        return Some(bad(format!(
            "the counts overflow a usize (send {send_counts:?}, receive {recv_counts:?})"
        )));
    };
    if sent != send_len {
        return Some(bad(format!(
            "send counts add up to {sent}, the send buffer is {send_len} bytes"
        )));
    }
    if received != recv_len {
        return Some(bad(format!(
            "receive counts add up to {received}, the receive buffer is {recv_len} bytes"
        )));
    }
    if send_len > cap {
        return Some(CollectiveError::TooLarge {
            op,
            rank,
            len: send_len,
            cap,
        });
    }
    None
}
