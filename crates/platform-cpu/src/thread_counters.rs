//! The OS scheduler's counters of a core thread, so a run can tell the time the OS gave a
//! core's CPU to other processes from the runtime's own idle time. Linux keeps them per thread
//! in `/proc/self/task/<tid>/schedstat`: time on a CPU, time runnable but waiting on a run
//! queue (both ns), and the number of time slices. Voluntary sleep (a parked core) is in
//! neither. Elsewhere there are no counters.

use simpler_core::{ThreadCounters, ThreadTimes};

/// The calling thread's counters, if the OS provides them.
pub(crate) fn current() -> Option<std::sync::Arc<dyn ThreadCounters>> {
    #[cfg(target_os = "linux")]
    {
        SchedStat::current().map(|s| std::sync::Arc::new(s) as std::sync::Arc<dyn ThreadCounters>)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// One thread's `schedstat`, kept open (a read is one `pread`, a few microseconds).
#[cfg(target_os = "linux")]
struct SchedStat {
    file: std::fs::File,
}

#[cfg(target_os = "linux")]
impl SchedStat {
    fn current() -> Option<SchedStat> {
        // `/proc/thread-self` is the calling thread's directory, `<pid>/task/<tid>`: open the
        // file by that path, which names this thread whichever thread reads it later.
        let dir = std::fs::read_link("/proc/thread-self").ok()?;
        let file =
            std::fs::File::open(std::path::Path::new("/proc").join(dir).join("schedstat")).ok()?;
        let s = SchedStat { file };
        s.read()?;
        Some(s)
    }
}

#[cfg(target_os = "linux")]
impl ThreadCounters for SchedStat {
    fn read(&self) -> Option<ThreadTimes> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 96];
        let n = self.file.read_at(&mut buf, 0).ok()?;
        parse(&buf[..n])
    }
}

/// `"<on-cpu ns> <waiting ns> <slices>"`.
fn parse(text: &[u8]) -> Option<ThreadTimes> {
    let mut fields = std::str::from_utf8(text).ok()?.split_ascii_whitespace();
    let on_cpu_ns = fields.next()?.parse().ok()?;
    let waiting_ns = fields.next()?.parse().ok()?;
    Some(ThreadTimes {
        on_cpu_ns,
        waiting_ns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_lines_parse_and_garbage_does_not() {
        assert_eq!(
            parse(b"47570705 301790373 30\n"),
            Some(ThreadTimes {
                on_cpu_ns: 47_570_705,
                waiting_ns: 301_790_373
            })
        );
        assert_eq!(parse(b""), None);
        assert_eq!(parse(b"12"), None);
        assert_eq!(parse(b"12 x 3"), None);
        assert_eq!(parse(b"-1 2 3"), None);
    }

    /// Another thread reads a core-like thread's counters: its CPU time grows while it spins
    /// and stays put while it is blocked (by far less than it grew while spinning; no
    /// wall-clock threshold), and its waiting time never goes back.
    #[cfg(target_os = "linux")]
    #[test]
    fn cpu_time_grows_when_spinning_not_when_blocked() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{Arc, mpsc};
        use std::time::{Duration, Instant};

        let spin = Arc::new(AtomicBool::new(true));
        let (counters_tx, counters_rx) = mpsc::channel();
        let (blocked_tx, blocked_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let s2 = spin.clone();
        let t = std::thread::spawn(move || {
            counters_tx
                .send(current().expect("Linux reports per-thread schedstat"))
                .unwrap();
            let mut x = 0u64;
            while s2.load(Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
            }
            blocked_tx.send(()).unwrap();
            release_rx.recv().unwrap();
        });
        let c = counters_rx.recv().unwrap();
        let start = c.read().unwrap();
        // Spin until the thread has 20 ms of CPU time (a broken counter fails here instead of
        // hanging: 60 s is a guard, not a measurement).
        let spun = 20_000_000;
        let guard = Instant::now() + Duration::from_secs(60);
        let after_spin = loop {
            let now = c.read().unwrap();
            if now.on_cpu_ns >= start.on_cpu_ns + spun {
                break now;
            }
            assert!(
                Instant::now() < guard,
                "CPU time never grew: {start:?} {now:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        spin.store(false, Ordering::Relaxed);
        blocked_rx.recv().unwrap();
        let blocked0 = c.read().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let blocked1 = c.read().unwrap();
        release_tx.send(()).unwrap();
        t.join().unwrap();
        assert!(
            blocked1.on_cpu_ns.saturating_sub(blocked0.on_cpu_ns) < spun / 4,
            "a blocked thread gained CPU time: {blocked0:?} -> {blocked1:?}"
        );
        assert!(after_spin.waiting_ns >= start.waiting_ns);
        assert!(blocked1.waiting_ns >= blocked0.waiting_ns);
    }
}
