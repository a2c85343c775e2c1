//! Waiting on a word of shared memory across processes (Linux futex, not the private variant:
//! the word lives in a `MAP_SHARED` mapping other processes wait on too).

use std::sync::atomic::AtomicU32;

/// Blocks while `*word == expected` (returns at once if it differs; may return spuriously, so
/// callers re-check their condition in a loop).
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call; FUTEX_WAIT only reads
    // it; a null timeout means no timeout. Errors (EAGAIN: the value changed, EINTR) are
    // returns the caller's loop handles.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

/// Wakes every process waiting on `word`.
pub(crate) fn wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE does not access memory beyond it.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}
