//! The shared-memory backend: the chips of one host exchange data through one segment mapped
//! by every chip process.
//!
//! # Layout
//! A barrier (three `u32` atomics: arrival count, generation, abandoned-by), then one *area*
//! per rank: a header (a flag, a byte total and `ranks` byte counts, all `u64`) and a staging
//! area of `cap` bytes. Every offset is a multiple of 64, so no two ranks write the same cache
//! line.
//!
//! # Protocol
//! A collective call is rounds of: every rank writes its own area, barrier, every rank reads
//! the areas it needs, barrier. Between the two barriers nobody writes an area; outside them
//! only its owner does. So no byte is written while another process reads it.
//!
//! The barrier makes the writes before it visible to the reads after it. A rank arrives with
//! `count.fetch_add(1, AcqRel)`: the increments form one release sequence, so the last rank to
//! arrive (the one that reads `ranks - 1`) has acquired every earlier rank's writes. It resets
//! `count` to 0 and then bumps `generation` (a `Release` `fetch_add`); a waiting rank loads
//! `generation` with `Acquire`, sees the bump, and so happens-after the last arrival and
//! thereby after every rank's writes. Each rank reads `generation` *before* arriving, so it
//! cannot miss the bump (it only waits while the value is still the one it read, and
//! futex-waits only on that value: a bump between its load and its wait makes the wait return
//! at once). The reset of
//! `count` is sequenced before the bump, so a rank that goes on to the next barrier (after
//! seeing the bump) finds `count` reset. Generations wrap at 2^32 barriers; a rank can only be
//! one barrier behind the others, so wrapping never aliases.
//!
//! A rank that dies leaves the others waiting in the barrier; the node's parent sees the death
//! (its doorbell pipe hangs up) and ends every child, so no process waits for ever.
//!
//! # Abandonment
//! A rank that gives up (its function failed, so it will not make the calls the others wait
//! for) *abandons* the group: it sets a third barrier word, `abandoned`, from 0 to its rank
//! plus one (a compare-exchange, so the first abandoner stays named), then bumps `generation`
//! with a `Release` read-modify-write and futex-wakes it. Every rank checks `abandoned` when
//! it enters a barrier and when it leaves one on a changed generation, and returns
//! [`CollectiveError::Abandoned`] instead of going on. No wake-up is lost: a waiter only
//! sleeps on `generation` while it holds the value it read before arriving, and the
//! abandoner changes that word after setting the flag, so the sleep returns at once or is
//! woken. Every change of `generation` (the last arrival's included) is a read-modify-write,
//! so each one continues the release sequence of the abandoner's bump: a rank whose `Acquire`
//! load sees any generation from the bump on happens-after the flag was set, and sees it.
//!
//! A rank that leaves a barrier on the abandoner's bump returns the error and writes no area
//! again (every call checks the flag before writing); a rank that leaves on the last arrival
//! passed a complete barrier, so the read phase it starts is protected as before. The
//! fast path costs one extra load of a word that stays in every rank's cache (it is only
//! written on abandonment).
//!
//! The flag stays set until the node's parent resets the barrier (`reset`) after the group call,
//! when no rank is inside a collective: every rank of the group has answered, and a chip
//! that was not in the call was idle (the parent waits for every call it starts).

use std::sync::atomic::{AtomicU32, Ordering};

use super::{Collectives, ReduceOp, ReduceType};
use crate::error::CollectiveError;
use crate::futex;
use crate::shm::Segment;

const BARRIER_BYTES: usize = 64;
/// Byte offsets of the barrier words.
const COUNT: usize = 0;
const GENERATION: usize = 4;
const ABANDONED: usize = 8;
/// Spins (with a yield every 128) before a waiting rank sleeps in the kernel.
const SPINS: u32 = 4096;
const FLAG_OK: u64 = 0;
const FLAG_BAD_ARGS: u64 = 1;
const FLAG_TOO_LARGE: u64 = 2;

fn round64(x: usize) -> usize {
    x.div_ceil(64) * 64
}

fn header_bytes(ranks: usize) -> usize {
    round64(8 * (2 + ranks))
}

/// Bytes of the segment for `ranks` ranks with `cap` bytes of staging each; `None` when that
/// overflows a `usize` (a child learns both numbers from its environment).
pub(crate) fn segment_bytes(ranks: usize, cap: usize) -> Option<usize> {
    let header = ranks.checked_add(2)?.checked_mul(8)?.checked_add(63)? / 64 * 64;
    let area = header.checked_add(cap.checked_add(63)? / 64 * 64)?;
    ranks.checked_mul(area)?.checked_add(BARRIER_BYTES)
}

fn barrier_word(segment: &Segment, offset: usize) -> &AtomicU32 {
    assert!(
        offset + 4 <= BARRIER_BYTES && offset.is_multiple_of(4) && segment.len() >= BARRIER_BYTES
    );
    // SAFETY: the barrier words lie at the start of the live mapping (page-aligned, so 4-byte
    // aligned; in bounds, checked above), are only ever accessed atomically, and zero is a
    // valid value.
    unsafe { &*segment.ptr().add(offset).cast::<AtomicU32>() }
}

/// Clears an abandonment and the arrival count of a segment made with [`segment_bytes`], so
/// the next collective call starts afresh. The caller (the node's parent, after a group call)
/// guarantees that no rank is inside a collective and that the ranks' next calls are ordered
/// after this (its command post is a `Release` store the child reads with `Acquire`).
/// `generation` keeps its value: a rank compares it only with the value it read on arrival.
pub(crate) fn reset(segment: &Segment) {
    barrier_word(segment, COUNT).store(0, Ordering::Relaxed);
    barrier_word(segment, ABANDONED).store(0, Ordering::Relaxed);
}

/// The rank that abandoned the group on this segment since the last [`reset`], if one did.
pub(crate) fn abandoned_by(segment: &Segment) -> Option<usize> {
    match barrier_word(segment, ABANDONED).load(Ordering::Acquire) {
        0 => None,
        r => Some(r as usize - 1),
    }
}

/// The shared-memory communicator of one chip process.
pub struct ShmCollectives {
    segment: Segment,
    rank: usize,
    ranks: usize,
    cap: usize,
}

impl ShmCollectives {
    /// Rank `rank` of `ranks` on `segment`, which the parent made with [`segment_bytes`].
    pub(crate) fn new(segment: Segment, rank: usize, ranks: usize, cap: usize) -> ShmCollectives {
        assert!(
            segment_bytes(ranks, cap).is_some_and(|need| segment.len() >= need) && rank < ranks,
            "a collective segment of {} bytes for rank {rank} of {ranks} with {cap} bytes each",
            segment.len()
        );
        ShmCollectives {
            segment,
            rank,
            ranks,
            cap: round64(cap),
        }
    }

    /// Bytes one rank can send in one all-to-all.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        barrier_word(&self.segment, offset)
    }

    /// Fails with `Abandoned` once the group is abandoned (see the module header).
    fn check_abandoned(&self, op: &'static str) -> Result<(), CollectiveError> {
        match abandoned_by(&self.segment) {
            None => Ok(()),
            Some(by) => Err(CollectiveError::Abandoned {
                op,
                rank: self.rank,
                by,
            }),
        }
    }

    /// Gives up on the group: every rank waiting in a barrier, now or later, returns
    /// [`CollectiveError::Abandoned`] naming the first rank that abandoned, until the parent
    /// resets the segment after the group call. Idempotent.
    pub fn abandon(&self) {
        let _ = self.word(ABANDONED).compare_exchange(
            0,
            self.rank as u32 + 1,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let generation = self.word(GENERATION);
        generation.fetch_add(1, Ordering::Release);
        futex::wake_all(generation);
    }

    /// Waits until every rank has arrived (see the protocol in the module header), or fails
    /// once the group is abandoned.
    fn barrier(&self, op: &'static str) -> Result<(), CollectiveError> {
        let count = self.word(COUNT);
        let generation = self.word(GENERATION);
        let g = generation.load(Ordering::Acquire);
        // Read after `g`: a flag set after this load comes with a bump after it, which ends
        // the wait below.
        self.check_abandoned(op)?;
        if count.fetch_add(1, Ordering::AcqRel) as usize == self.ranks - 1 {
            count.store(0, Ordering::Relaxed);
            generation.fetch_add(1, Ordering::Release);
            futex::wake_all(generation);
            return Ok(());
        }
        let mut spins = 0u32;
        while generation.load(Ordering::Acquire) == g {
            // A short spin catches peers that are running now; then sleep in the kernel (the
            // ranks usually share fewer cores than there are ranks).
            if spins < SPINS {
                spins += 1;
                if spins.is_multiple_of(128) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            } else {
                futex::wait(generation, g);
            }
        }
        // The generation changed: the last arrival or an abandoner bumped it.
        self.check_abandoned(op)
    }

    fn area(&self, rank: usize) -> *mut u8 {
        let offset = BARRIER_BYTES + rank * (header_bytes(self.ranks) + self.cap);
        // SAFETY: `rank < ranks`, so the area lies in the mapping (`segment_bytes`).
        unsafe { self.segment.ptr().add(offset) }
    }

    fn data(&self, rank: usize) -> *mut u8 {
        // SAFETY: the staging area follows the header inside the rank's area.
        unsafe { self.area(rank).add(header_bytes(self.ranks)) }
    }

    /// Writes this rank's header: flag, total, counts.
    fn write_header(&self, flag: u64, total: usize, counts: &[usize]) {
        let h = self.area(self.rank).cast::<u64>();
        // SAFETY: the header has room for 2 + ranks words (`header_bytes`) and `counts` has
        // at most `ranks` entries (callers pass none unless the length matched); the area is
        // this rank's, written only outside the barriers' read phase.
        unsafe {
            h.write(flag);
            h.add(1).write(total as u64);
            for (i, &c) in counts.iter().take(self.ranks).enumerate() {
                h.add(2 + i).write(c as u64);
            }
        }
    }

    /// Word `i` of `rank`'s header (0: flag, 1: total, 2 + j: count for rank j).
    fn header_word(&self, rank: usize, i: usize) -> u64 {
        debug_assert!(i < 2 + self.ranks);
        // SAFETY: in bounds of the header; read between barriers, when nobody writes it.
        unsafe { self.area(rank).cast::<u64>().add(i).read() }
    }

    /// The refusal of the lowest refusing rank, this rank's own in detail.
    fn refusal(&self, op: &'static str, own: &Option<CollectiveError>) -> Option<CollectiveError> {
        (0..self.ranks)
            .find(|&r| self.header_word(r, 0) != FLAG_OK)
            .map(|r| match own {
                Some(e) if r == self.rank => e.clone(),
                _ => CollectiveError::PeerRefused { op, rank: r },
            })
    }
}

impl Collectives for ShmCollectives {
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
        self.check_abandoned(OP)?;
        let (n, me) = (self.ranks, self.rank);
        let own = super::check_all_to_all_args(
            OP,
            me,
            n,
            send.len(),
            send_counts,
            recv.len(),
            recv_counts,
            self.cap,
        );
        match &own {
            None => {
                self.write_header(FLAG_OK, send.len(), send_counts);
                // SAFETY: `send.len() <= cap`, the staging area is this rank's and not read
                // before the barrier below.
                unsafe { std::ptr::copy_nonoverlapping(send.as_ptr(), self.data(me), send.len()) };
            }
            Some(CollectiveError::TooLarge { .. }) => self.write_header(FLAG_TOO_LARGE, 0, &[]),
            Some(_) => self.write_header(FLAG_BAD_ARGS, 0, &[]),
        }
        self.barrier(OP)?;
        let result = match self.refusal(OP, &own) {
            Some(e) => Err(e),
            None => {
                let mut result = Ok(());
                let mut at = 0;
                for (src, &expected) in recv_counts.iter().enumerate() {
                    // `src` checked its counts before staging them, but its header is another
                    // process's memory: the copy below trusts only bounds checked here.
                    let staged = self.header_word(src, 1);
                    let offset =
                        (0..me).try_fold(0u64, |a, j| a.checked_add(self.header_word(src, 2 + j)));
                    let len = self.header_word(src, 2 + me);
                    let end = offset.and_then(|o| o.checked_add(len));
                    let (Some(offset), Some(end)) = (offset, end) else {
                        result = Err(CollectiveError::BadArgs {
                            op: OP,
                            rank: src,
                            reason: "its staged counts overflow".into(),
                        });
                        break;
                    };
                    if end > staged || staged > self.cap as u64 {
                        result = Err(CollectiveError::BadArgs {
                            op: OP,
                            rank: src,
                            reason: format!(
                                "its header names bytes {offset}..{end} of the {staged} it staged (room {})",
                                self.cap
                            ),
                        });
                        break;
                    }
                    let (offset, len) = (offset as usize, len as usize);
                    if len != expected {
                        result = Err(CollectiveError::CountMismatch {
                            op: OP,
                            src,
                            dst: me,
                            sent: len,
                            expected,
                        });
                        break;
                    }
                    // SAFETY: `offset + len <= staged <= cap` (checked above), so the read is
                    // inside `src`'s staging area; `recv[at..at + len]` is in bounds because the
                    // receive counts add up to `recv.len()`; nobody writes `src`'s area until
                    // the next barrier.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.data(src).add(offset),
                            recv[at..at + len].as_mut_ptr(),
                            len,
                        )
                    };
                    at += len;
                }
                result
            }
        };
        self.barrier(OP)?;
        result
    }

    fn all_reduce(
        &mut self,
        buf: &mut [u8],
        ty: ReduceType,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "all_reduce";
        let (ReduceType::F32, ReduceOp::Sum) = (ty, op);
        self.check_abandoned(OP)?;
        let (n, me) = (self.ranks, self.rank);
        let chunk = self.cap / 4 * 4;
        let own = if !buf.len().is_multiple_of(4) {
            Some(CollectiveError::BadArgs {
                op: OP,
                rank: me,
                reason: format!("{} bytes is not a whole number of f32", buf.len()),
            })
        } else if chunk == 0 && !buf.is_empty() {
            // No staging room: without this the loop below never advances.
            Some(CollectiveError::TooLarge {
                op: OP,
                rank: me,
                len: buf.len(),
                cap: self.cap,
            })
        } else {
            None
        };
        let mut start = 0;
        loop {
            let end = (start + chunk).min(buf.len());
            if start == 0 {
                let flag = if own.is_some() {
                    FLAG_BAD_ARGS
                } else {
                    FLAG_OK
                };
                self.write_header(flag, buf.len(), &[]);
            }
            if own.is_none() {
                // SAFETY: `end - start <= cap`; this rank's staging area, not read before
                // the barrier below.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        buf[start..end].as_ptr(),
                        self.data(me),
                        end - start,
                    )
                };
            }
            self.barrier(OP)?;
            if start == 0 {
                let refused = self.refusal(OP, &own).or_else(|| {
                    (0..n)
                        .find(|&r| self.header_word(r, 1) as usize != buf.len())
                        .map(|r| CollectiveError::CountMismatch {
                            op: OP,
                            src: r,
                            dst: me,
                            sent: self.header_word(r, 1) as usize,
                            expected: buf.len(),
                        })
                });
                if let Some(e) = refused {
                    self.barrier(OP)?;
                    return Err(e);
                }
            }
            let mut acc = vec![0f32; (end - start) / 4];
            for src in 0..n {
                let data = self.data(src).cast_const();
                for (i, a) in acc.iter_mut().enumerate() {
                    let mut bytes = [0u8; 4];
                    // SAFETY: `4 * i + 4 <= end - start`, which `src` wrote before the
                    // barrier (all ranks have the same length, checked above).
                    unsafe {
                        std::ptr::copy_nonoverlapping(data.add(4 * i), bytes.as_mut_ptr(), 4)
                    };
                    let v = f32::from_ne_bytes(bytes);
                    *a = if src == 0 { v } else { *a + v };
                }
            }
            for (dst, a) in buf[start..end].chunks_exact_mut(4).zip(&acc) {
                dst.copy_from_slice(&a.to_ne_bytes());
            }
            self.barrier(OP)?;
            start = end;
            if start >= buf.len() {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    /// Runs `f(rank, comm)` on `ranks` threads, each with its own mapping of one segment (as
    /// processes have), and returns the results in rank order.
    fn on_ranks<T: Send>(
        ranks: usize,
        cap: usize,
        f: impl Fn(usize, &mut ShmCollectives) -> T + Sync,
    ) -> Vec<T> {
        let (_, fd) =
            Segment::anonymous("test-collectives", segment_bytes(ranks, cap).unwrap()).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..ranks)
                .map(|rank| {
                    let own = fd.try_clone().unwrap();
                    let seg = Segment::from_fd(own, "test").unwrap();
                    let f = &f;
                    s.spawn(move || f(rank, &mut ShmCollectives::new(seg, rank, ranks, cap)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn refused_arguments_are_everyones_error() {
        let results = on_ranks(3, 64, |rank, comm| {
            // Rank 1's send counts do not add up to its buffer.
            let send = [0u8; 3];
            let counts = if rank == 1 { [1, 1, 0] } else { [1, 1, 1] };
            let mut recv = [0u8; 3];
            comm.all_to_all_v(&send, &counts, &mut recv, &[1, 1, 1])
        });
        assert!(matches!(
            results[1],
            Err(CollectiveError::BadArgs { rank: 1, .. })
        ));
        for r in [0, 2] {
            assert_eq!(
                results[r],
                Err(CollectiveError::PeerRefused {
                    op: "all_to_all_v",
                    rank: 1
                })
            );
        }
    }

    #[test]
    fn counts_that_wrap_around_are_refused_and_the_next_call_runs() {
        let results = on_ranks(2, 64, |rank, comm| {
            // Rank 0's send counts wrap around to its 1-byte buffer's length: unchecked, rank 1
            // would copy from 2^63 bytes past rank 0's staging area.
            let counts: [usize; 2] = if rank == 0 {
                [1 << 63, (1 << 63) + 1]
            } else {
                [0, 1]
            };
            let send = [7u8; 1];
            let mut recv = [0u8; 1];
            let recv_counts = if rank == 0 { [0, 1] } else { [1, 0] };
            let first = comm.all_to_all_v(&send, &counts, &mut recv, &recv_counts);
            // The group goes on: an exchange of one byte each way.
            let mut back = [0u8; 2];
            let next = comm.all_to_all_v(&[rank as u8 + 1; 2], &[1, 1], &mut back, &[1, 1]);
            (first, next, back)
        });
        match &results[0].0 {
            Err(CollectiveError::BadArgs {
                rank: 0, reason, ..
            }) => {
                assert!(reason.contains("overflow"), "{reason}")
            }
            other => panic!("rank 0: {other:?}"),
        }
        assert_eq!(
            results[1].0,
            Err(CollectiveError::PeerRefused {
                op: "all_to_all_v",
                rank: 0
            })
        );
        for (_, next, back) in &results {
            assert_eq!(*next, Ok(()));
            assert_eq!(*back, [1, 2]);
        }
    }

    #[test]
    fn a_wrong_receive_count_is_the_receivers_error_only() {
        let results = on_ranks(2, 64, |rank, comm| {
            let send = [rank as u8 + 1; 4];
            let recv_counts = if rank == 1 { [1, 2] } else { [2, 2] };
            let mut recv = vec![0u8; recv_counts.iter().sum()];
            comm.all_to_all_v(&send, &[2, 2], &mut recv, &recv_counts)
                .map(|()| recv)
        });
        assert_eq!(results[0], Ok(vec![1, 1, 2, 2]));
        assert_eq!(
            results[1],
            Err(CollectiveError::CountMismatch {
                op: "all_to_all_v",
                src: 0,
                dst: 1,
                sent: 2,
                expected: 1
            })
        );
    }

    #[test]
    fn all_reduce_lengths_must_agree_and_calls_continue_after() {
        let results = on_ranks(2, 64, |rank, comm| {
            let mut buf = vec![0u8; 4 * (rank + 1)];
            let first = comm.all_reduce(&mut buf, ReduceType::F32, ReduceOp::Sum);
            let mut one = 1.5f32.to_ne_bytes();
            comm.all_reduce(&mut one, ReduceType::F32, ReduceOp::Sum)
                .unwrap();
            (first, f32::from_ne_bytes(one))
        });
        for (first, sum) in results {
            assert!(matches!(first, Err(CollectiveError::CountMismatch { .. })));
            assert_eq!(sum, 3.0);
        }
    }

    #[test]
    fn an_abandoned_group_releases_its_waiters_and_resets() {
        let between = std::sync::Barrier::new(3);
        let results = on_ranks(3, 64, |rank, comm| {
            let mut one = 1f32.to_ne_bytes();
            // Rank 1 takes part in one reduction, then gives up while the others wait in
            // the next (or, if it is quick, before they arrive: the same error either way).
            comm.all_reduce(&mut one, ReduceType::F32, ReduceOp::Sum)
                .unwrap();
            // Everyone has left that reduction before rank 1 gives up.
            between.wait();
            let first = if rank == 1 {
                std::thread::sleep(std::time::Duration::from_millis(50));
                comm.abandon();
                comm.abandon();
                Ok(Vec::new())
            } else {
                let mut recv = [0u8; 3];
                comm.all_to_all_v(&[rank as u8; 3], &[1, 1, 1], &mut recv, &[1, 1, 1])
                    .map(|()| recv.to_vec())
            };
            let mut buf = vec![0u8; 4 * 100];
            let later = comm.all_reduce(&mut buf, ReduceType::F32, ReduceOp::Sum);
            between.wait();
            if rank == 0 {
                reset(&comm.segment);
            }
            between.wait();
            let mut two = 2f32.to_ne_bytes();
            comm.all_reduce(&mut two, ReduceType::F32, ReduceOp::Sum)
                .unwrap();
            (
                f32::from_ne_bytes(one),
                first,
                later,
                f32::from_ne_bytes(two),
            )
        });
        for (rank, (one, first, later, two)) in results.into_iter().enumerate() {
            assert_eq!(one, 3.0);
            if rank != 1 {
                assert_eq!(
                    first,
                    Err(CollectiveError::Abandoned {
                        op: "all_to_all_v",
                        rank,
                        by: 1
                    })
                );
            }
            assert_eq!(
                later,
                Err(CollectiveError::Abandoned {
                    op: "all_reduce",
                    rank,
                    by: 1
                })
            );
            assert_eq!(two, 6.0, "rank {rank} after the reset");
        }
    }

    #[test]
    fn the_first_abandoner_is_named() {
        let between = std::sync::Barrier::new(2);
        let results = on_ranks(2, 64, |rank, comm| {
            if rank == 0 {
                comm.abandon();
            }
            between.wait();
            comm.abandon();
            let mut b = [0u8; 4];
            (
                comm.all_reduce(&mut b, ReduceType::F32, ReduceOp::Sum),
                abandoned_by(&comm.segment),
            )
        });
        for (rank, (r, by)) in results.into_iter().enumerate() {
            assert_eq!(
                r,
                Err(CollectiveError::Abandoned {
                    op: "all_reduce",
                    rank,
                    by: 0
                })
            );
            assert_eq!(by, Some(0));
        }
    }

    /// A staging area of no bytes (`NodeConfig::collective_bytes` 0; any other size is rounded
    /// up to 64) cannot move an all-reduce forward: every rank refuses it alike (the loop never
    /// advanced, and the ranks passed barriers until the node's call timeout), and the group
    /// still serves an empty call after.
    #[test]
    fn an_all_reduce_without_room_for_one_value_is_refused() {
        let cap = 0;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = on_ranks(2, cap, |_, comm| {
                let mut b = 1f32.to_ne_bytes();
                let first = comm.all_reduce(&mut b, ReduceType::F32, ReduceOp::Sum);
                let mut empty = [0u8; 0];
                let next = comm.all_reduce(&mut empty, ReduceType::F32, ReduceOp::Sum);
                (first, next, b)
            });
            let _ = tx.send(r);
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("an all-reduce with no staging room is still running after 20 s");
        assert!(
            matches!(got[0].0, Err(CollectiveError::TooLarge { len: 4, .. })),
            "cap {cap}: {:?}",
            got[0].0
        );
        assert!(
            matches!(got[1].0, Err(CollectiveError::PeerRefused { rank: 0, .. })),
            "cap {cap}: {:?}",
            got[1].0
        );
        for (_, next, b) in &got {
            assert!(next.is_ok(), "cap {cap}: {next:?}");
            assert_eq!(
                *b,
                1f32.to_ne_bytes(),
                "cap {cap}: a refused call wrote its buffer"
            );
        }
    }

    #[test]
    fn many_barriers_in_a_row() {
        // Each round's result depends on the previous round's, so a rank that ran ahead of
        // a barrier would read stale data.
        let results = on_ranks(4, 64, |rank, comm| {
            let mut x = rank as f32;
            for _ in 0..2000 {
                let mut b = x.to_ne_bytes();
                comm.all_reduce(&mut b, ReduceType::F32, ReduceOp::Sum)
                    .unwrap();
                x = f32::from_ne_bytes(b) / 4.0;
            }
            x
        });
        let mut x = [0f32, 1.0, 2.0, 3.0];
        for _ in 0..2000 {
            let s = ((x[0] + x[1]) + x[2]) + x[3];
            x = [s / 4.0; 4];
        }
        assert_eq!(results, x.to_vec());
    }
}
