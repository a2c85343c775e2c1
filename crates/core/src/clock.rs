//! The process-wide monotonic time axis and its anchor to wall-clock time.
//!
//! Every timestamp the runtime records is nanoseconds since [`ClockAnchor::process`]'s base
//! instant, so spans from every thread of a process share one axis; the anchor maps that axis
//! onto wall time so files of several processes can be merged.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Maps this process's monotonic axis to wall-clock time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockAnchor {
    /// Process id.
    pub pid: u32,
    /// Wall-clock time (ns since the Unix epoch) at monotonic zero.
    pub wall_ns: u64,
}

struct Base {
    instant: Instant,
    anchor: ClockAnchor,
}

fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(|| {
        let instant = Instant::now();
        let wall_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Base {
            instant,
            anchor: ClockAnchor {
                pid: std::process::id(),
                wall_ns,
            },
        }
    })
}

impl ClockAnchor {
    /// This process's anchor.
    pub fn process() -> ClockAnchor {
        base().anchor
    }
}

/// Nanoseconds since the process anchor.
#[inline]
pub fn now_ns() -> u64 {
    base().instant.elapsed().as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_is_monotonic_and_anchored() {
        let a = now_ns();
        let b = now_ns();
        assert!(b >= a);
        assert_eq!(ClockAnchor::process().pid, std::process::id());
        assert!(ClockAnchor::process().wall_ns > 1_600_000_000_000_000_000);
    }
}
