//! A mailbox: one per child in the node's control segment — the parent posts one command at a
//! time, the child answers it.
//!
//! # Protocol
//! The mailbox's header is atomics; its command and answer areas are plain bytes. The parent
//! owns the command area while the child is idle (`done_seq == cmd_seq`): it writes the bytes
//! and their kind and length, then stores `cmd_seq + 1` with `Release`. The child loads
//! `cmd_seq` with `Acquire`; seeing the new number, it also sees the bytes written before the
//! store (release/acquire on one location), and owns the command area and the answer area
//! until it answers: it writes the answer bytes, status and length, then stores `done_seq` with
//! `Release`. The parent loads `done_seq` with `Acquire`, and so sees the answer. Neither side
//! writes an area the other owns, so no byte is written by one process while another reads it.
//! The lengths are read after the acquire and clamped to the area, so even a corrupt child
//! cannot make the parent read out of bounds.
//!
//! Start-up uses `state` the same way: the child writes its message (if start-up failed), then
//! stores `READY` or `FAILED` with `Release`; the parent loads it with `Acquire`.
//!
//! The atomics carry the data's visibility; waking is separate. Each side rings a pipe (one
//! byte) after its `Release` store, and the other blocks in `read`/`poll` on it. The pipe is
//! only a doorbell: a reader re-checks the sequence numbers after every wake-up, so coalesced
//! or extra bytes are harmless. The pipes also report death: a child that exits closes its end,
//! which the parent's `poll` sees as a hang-up; the parent that exits does the same for the
//! child.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Bytes of one mailbox (a multiple of the page size, so mailboxes never share a page).
pub(crate) const MAILBOX_BYTES: usize = 16 << 10;
const HEADER_BYTES: usize = 64;
const CMD_OFFSET: usize = HEADER_BYTES;
/// Bytes a command can carry.
pub(crate) const CMD_CAP: usize = 8 << 10;
const RES_OFFSET: usize = CMD_OFFSET + CMD_CAP;
/// Bytes an answer can carry.
pub(crate) const RES_CAP: usize = MAILBOX_BYTES - RES_OFFSET;

pub(crate) const STARTING: u32 = 0;
pub(crate) const READY: u32 = 1;
pub(crate) const FAILED: u32 = 2;

/// The atomics at the start of a mailbox.
#[repr(C)]
struct Header {
    cmd_seq: AtomicU64,
    done_seq: AtomicU64,
    state: AtomicU32,
    cmd_kind: AtomicU32,
    cmd_len: AtomicU32,
    res_status: AtomicU32,
    res_len: AtomicU32,
}

const _: () = assert!(size_of::<Header>() <= HEADER_BYTES);

/// One child's mailbox, borrowed from the mapped control segment.
pub(crate) struct Mailbox<'a> {
    base: *mut u8,
    _segment: PhantomData<&'a [u8]>,
}

impl<'a> Mailbox<'a> {
    /// The mailbox at `base`.
    ///
    /// # Safety
    /// `base .. base + MAILBOX_BYTES` lies in a shared mapping that outlives `'a`, is 64-byte
    /// aligned, and is used only through this protocol by one parent and one child.
    pub(crate) unsafe fn new(base: *mut u8) -> Mailbox<'a> {
        Mailbox {
            base,
            _segment: PhantomData,
        }
    }

    fn header(&self) -> &Header {
        // SAFETY: by `new`'s contract the header is in a live mapping, aligned, and only ever
        // accessed atomically (a zeroed mapping is a valid `Header`).
        unsafe { &*self.base.cast::<Header>() }
    }

    // ---- parent side ----

    /// The child's start-up state.
    pub(crate) fn state(&self) -> u32 {
        self.header().state.load(Ordering::Acquire)
    }

    /// Sequence number of the last answered command.
    pub(crate) fn done_seq(&self) -> u64 {
        self.header().done_seq.load(Ordering::Acquire)
    }

    /// Posts command `seq` (the child must have answered `seq - 1`).
    pub(crate) fn post(&self, seq: u64, kind: u32, payload: &[u8]) {
        assert!(
            payload.len() <= CMD_CAP,
            "command checked against CMD_CAP by the caller"
        );
        debug_assert_eq!(self.header().done_seq.load(Ordering::Acquire) + 1, seq);
        // SAFETY: the command area is in the mapping (contract of `new`) and the parent owns it
        // while the child is idle (protocol above); `payload` fits.
        unsafe {
            std::ptr::copy_nonoverlapping(
                payload.as_ptr(),
                self.base.add(CMD_OFFSET),
                payload.len(),
            )
        };
        let h = self.header();
        h.cmd_kind.store(kind, Ordering::Relaxed);
        h.cmd_len.store(payload.len() as u32, Ordering::Relaxed);
        h.cmd_seq.store(seq, Ordering::Release);
    }

    /// The answer (status, bytes): call after `done_seq` returned the command's number.
    pub(crate) fn answer(&self) -> (u32, Vec<u8>) {
        let h = self.header();
        let len = (h.res_len.load(Ordering::Relaxed) as usize).min(RES_CAP);
        (
            h.res_status.load(Ordering::Relaxed),
            self.read(RES_OFFSET, len),
        )
    }

    // ---- child side ----

    /// The newest command, if it has not been answered yet: (seq, kind, bytes).
    pub(crate) fn pending(&self) -> Option<(u64, u32, Vec<u8>)> {
        let h = self.header();
        let seq = h.cmd_seq.load(Ordering::Acquire);
        if seq == h.done_seq.load(Ordering::Relaxed) {
            return None;
        }
        let len = (h.cmd_len.load(Ordering::Relaxed) as usize).min(CMD_CAP);
        Some((
            seq,
            h.cmd_kind.load(Ordering::Relaxed),
            self.read(CMD_OFFSET, len),
        ))
    }

    /// Answers command `seq`.
    pub(crate) fn complete(&self, seq: u64, status: u32, bytes: &[u8]) {
        let n = self.write_answer(bytes);
        let h = self.header();
        h.res_status.store(status, Ordering::Relaxed);
        h.res_len.store(n as u32, Ordering::Relaxed);
        h.done_seq.store(seq, Ordering::Release);
    }

    /// Reports the end of start-up: `READY`, or `FAILED` with a message.
    pub(crate) fn set_state(&self, state: u32, message: &[u8]) {
        let n = self.write_answer(message);
        self.header().res_len.store(n as u32, Ordering::Relaxed);
        self.header().state.store(state, Ordering::Release);
    }

    /// Writes an answer (truncated to `RES_CAP`), returning its length.
    fn write_answer(&self, bytes: &[u8]) -> usize {
        let n = bytes.len().min(RES_CAP);
        // SAFETY: the answer area is in the mapping and the child owns it until it publishes
        // (protocol above); `n` fits.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(RES_OFFSET), n) };
        n
    }

    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        // SAFETY: `offset + len` stays in the mailbox (callers clamp `len` to the area), and
        // the reading side owns the area at this point of the protocol.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(offset), out.as_mut_ptr(), len) };
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::Segment;

    #[test]
    fn command_and_answer_round_trip() {
        let (seg, _fd) = Segment::anonymous("test-mailbox", MAILBOX_BYTES).unwrap();
        // SAFETY: the mapping is one mailbox long and outlives `mbox`; one thread plays both
        // sides, in protocol order.
        let mbox = unsafe { Mailbox::new(seg.ptr()) };
        assert_eq!(mbox.state(), STARTING);
        mbox.set_state(FAILED, b"why");
        assert_eq!((mbox.state(), mbox.answer().1), (FAILED, b"why".to_vec()));
        assert_eq!(mbox.pending(), None);
        let big = vec![7u8; CMD_CAP];
        for seq in 1..=3 {
            mbox.post(seq, 9, &big[..seq as usize * 100]);
            let (got_seq, kind, bytes) = mbox.pending().unwrap();
            assert_eq!((got_seq, kind, bytes.len()), (seq, 9, seq as usize * 100));
            assert_ne!(mbox.done_seq(), seq);
            mbox.complete(seq, 1, &vec![seq as u8; RES_CAP + 10]);
            assert_eq!(mbox.done_seq(), seq);
            assert_eq!(mbox.pending(), None);
            // An answer too long for the area is cut to it.
            assert_eq!(mbox.answer(), (1, vec![seq as u8; RES_CAP]));
        }
    }
}
