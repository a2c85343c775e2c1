//! A connection whose writes must make progress: once a write finds the socket full, the
//! client has `limit` to accept some of the bytes waiting, else the write fails with
//! `TimedOut` and the connection ends.
//!
//! Why: a client that asks for a long stream and stops reading (but keeps the connection
//! open) fills the socket's buffers; without a deadline the server waited on that write for
//! ever, holding the connection's permit out of `--max-connections`, and graceful shutdown
//! (which lets responses being written finish) never returned. Hyper times reading headers,
//! not writing. The deadline is a stall limit, as nginx's `send_timeout`: it counts only while
//! the server has bytes the client does not take, so a slow reader that keeps taking bytes, or
//! a stream with long gaps between tokens, is never cut.
//!
//! # Timing argument
//! The timer is armed by the first write (or flush, or shutdown) that returns `Pending` and
//! dropped by the next one that completes (`Ready`, with bytes or an error), so it measures one
//! unbroken stall. While armed, a `Pending` poll polls the timer too: that registers the task's
//! waker with both the socket and the timer, so whichever fires first wakes the connection —
//! the socket's readiness (then the retried write completes and disarms the timer) or the
//! deadline (then this poll returns the error). Reads are passed through untouched: the read
//! side has its own deadlines (hyper's header timer, the body's in `read_body`).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// The error of a write that waited `limit` on a client taking none of its bytes (inside an
/// `io::Error` of kind `TimedOut`, so the server can tell it from a client that went away).
#[derive(Debug)]
pub(crate) struct WriteStalled {
    limit: Duration,
}

impl std::fmt::Display for WriteStalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the client took none of the response's bytes for {:.1} s (the write timeout)",
            self.limit.as_secs_f64()
        )
    }
}

impl std::error::Error for WriteStalled {}

impl WriteStalled {
    /// Whether `e`, or an error it wraps (hyper's connection error wraps the I/O error), is a
    /// stalled write's.
    pub(crate) fn caused(e: &(dyn std::error::Error + 'static)) -> bool {
        let mut at = Some(e);
        while let Some(e) = at {
            if let Some(io) = e.downcast_ref::<io::Error>()
                && io.get_ref().is_some_and(|inner| inner.is::<WriteStalled>())
            {
                return true;
            }
            if e.is::<WriteStalled>() {
                return true;
            }
            at = e.source();
        }
        false
    }
}

/// `inner` with a deadline on stalled writes (see the module docs).
#[derive(Debug)]
pub(crate) struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    /// Armed while a write waits on a full socket; `None` once one completes.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    pub(crate) fn new(inner: S, limit: Duration) -> WriteDeadline<S> {
        WriteDeadline {
            inner,
            limit,
            stalled: None,
        }
    }

    /// What a write's poll returns: `done` as it is (disarming the timer), or while it is
    /// pending, `TimedOut` once the stall has lasted `limit`.
    fn settle<T>(
        &mut self,
        cx: &mut Context<'_>,
        done: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if done.is_ready() {
            self.stalled = None;
            return done;
        }
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                WriteStalled { limit },
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.settle(cx, done)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.settle(cx, done)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_flush(cx);
        this.settle(cx, done)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let done = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.settle(cx, done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that reads nothing: the first write fills the pipe, the next waits, and fails
    /// `limit` later with `TimedOut` naming the flag.
    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_never_takes_fails_after_the_limit() {
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(ours, Duration::from_secs(5));
        w.write_all(&[1; 64]).await.unwrap();
        let start = tokio::time::Instant::now();
        let e = w.write_all(&[2; 64]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("5.0 s (the write timeout)"), "{e}");
        assert!(WriteStalled::caused(&e));
        assert!(!WriteStalled::caused(&io::Error::from(
            io::ErrorKind::TimedOut
        )));
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    /// A slow peer that takes some bytes within every limit is never cut, however long the
    /// whole write takes; each stall is timed from its own start.
    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_that_keeps_taking_bytes_is_served() {
        let (ours, mut theirs) = tokio::io::duplex(16);
        let mut w = WriteDeadline::new(ours, Duration::from_secs(5));
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 16];
            loop {
                // 4 s between reads: under the limit each time, 40+ s in all.
                tokio::time::sleep(Duration::from_secs(4)).await;
                match theirs.read(&mut buf).await.unwrap() {
                    0 => return got,
                    n => got.extend_from_slice(&buf[..n]),
                }
            }
        });
        let data: Vec<u8> = (0..160u8).collect();
        let start = tokio::time::Instant::now();
        w.write_all(&data).await.unwrap();
        w.shutdown().await.unwrap();
        assert!(start.elapsed() >= Duration::from_secs(30));
        assert_eq!(reader.await.unwrap(), data);
    }

    /// After a write completes the timer is gone: a stall that starts later gets the whole
    /// limit again, not what was left of an earlier one.
    #[tokio::test(start_paused = true)]
    async fn each_stall_gets_the_whole_limit() {
        let (ours, mut theirs) = tokio::io::duplex(8);
        let mut w = WriteDeadline::new(ours, Duration::from_secs(5));
        w.write_all(&[1; 8]).await.unwrap();
        // Stalls 4 s, then the peer takes the bytes.
        let drain = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(4)).await;
            let mut buf = [0u8; 8];
            theirs.read_exact(&mut buf).await.unwrap();
            theirs
        });
        w.write_all(&[2; 8]).await.unwrap();
        let _theirs = drain.await.unwrap();
        // A new stall: 5 s from here, not 1.
        let start = tokio::time::Instant::now();
        let e = w.write_all(&[3; 8]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    /// Reads pass through: a connection that only reads is never timed here.
    #[tokio::test(start_paused = true)]
    async fn reads_pass_through_untimed() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(ours, Duration::from_secs(1));
        let send = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(10)).await;
            theirs.write_all(b"late").await.unwrap();
            theirs
        });
        let mut buf = [0u8; 4];
        w.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"late");
        drop(send.await.unwrap());
    }
}
