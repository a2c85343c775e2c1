//! How far one process's `CLOCK_MONOTONIC` is from another's, from round trips between them
//! (the NTP estimate).
//!
//! The reference sends at `sent_ns` on its clock; the other process replies at once with its
//! own clock's reading `remote_ns`; the reference receives at `received_ns`. The reply was
//! read somewhere inside `[sent_ns, received_ns]` of the reference's clock, so
//! `remote_ns − (sent_ns + received_ns) / 2` is the other clock minus the reference's to
//! within half the round trip, whatever the two directions' delays were. Of several round
//! trips the shortest gives the narrowest bound (the one least delayed by scheduling), so it
//! alone is kept. The clocks are assumed not to drift apart during the run (monotonic clocks
//! of disciplined hosts drift by parts per million: a few µs per second).

/// One round trip: the reference's clock when it sent and when it received the reply, and
/// the other process's clock when it replied (all ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PingSample {
    /// Reference clock when the ping left.
    pub sent_ns: u64,
    /// The other clock when it answered.
    pub remote_ns: u64,
    /// Reference clock when the answer arrived.
    pub received_ns: u64,
}

/// The other clock minus the reference's, and the half-width of the interval holding it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffsetEstimate {
    /// The other clock minus the reference's at one instant, ns.
    pub offset_ns: i64,
    /// Half the round trip it came from, rounded up, ns.
    pub uncertainty_ns: u64,
}

impl OffsetEstimate {
    /// The reference against itself.
    pub const ZERO: OffsetEstimate = OffsetEstimate {
        offset_ns: 0,
        uncertainty_ns: 0,
    };
}

/// The estimate from the shortest round trip of `samples`; `None` without a usable one (a
/// sample whose answer arrived before it left is not one).
pub fn estimate_offset(samples: &[PingSample]) -> Option<OffsetEstimate> {
    let best = samples
        .iter()
        .filter(|s| s.received_ns >= s.sent_ns)
        .min_by_key(|s| s.received_ns - s.sent_ns)?;
    let rtt = best.received_ns - best.sent_ns;
    let mid = best.sent_ns as i128 + (rtt / 2) as i128;
    let offset = best.remote_ns as i128 - mid;
    Some(OffsetEstimate {
        offset_ns: offset.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
        uncertainty_ns: rtt.div_ceil(2),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A remote clock `skew` ns ahead of the reference, one-way delays drawn from a
    /// deterministic generator (asymmetric: the way back is often slower), and a reply time
    /// that is read at once on arrival.
    fn round_trips(skew: i64, n: usize, seed: u64) -> Vec<PingSample> {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut now: u64 = 5_000_000_000;
        (0..n)
            .map(|_| {
                let out = 2_000 + next() % 50_000;
                let back = 2_000 + next() % 200_000;
                let sent_ns = now;
                let remote_ns = (sent_ns as i64 + out as i64 + skew) as u64;
                let received_ns = sent_ns + out + back;
                now = received_ns + next() % 10_000;
                PingSample {
                    sent_ns,
                    remote_ns,
                    received_ns,
                }
            })
            .collect()
    }

    #[test]
    fn the_true_skew_lies_within_the_stated_uncertainty() {
        for (skew, seed) in [(3_700_000i64, 1u64), (-1_234_567_890, 2), (0, 3), (17, 4)] {
            let samples = round_trips(skew, 16, seed);
            let e = estimate_offset(&samples).unwrap();
            assert!(
                (e.offset_ns - skew).unsigned_abs() <= e.uncertainty_ns,
                "skew {skew}: {e:?}"
            );
            // The shortest round trip was used.
            let shortest = samples
                .iter()
                .map(|s| s.received_ns - s.sent_ns)
                .min()
                .unwrap();
            assert_eq!(e.uncertainty_ns, shortest.div_ceil(2));
        }
    }

    #[test]
    fn more_round_trips_never_widen_the_bound() {
        let samples = round_trips(42_000, 64, 9);
        let few = estimate_offset(&samples[..4]).unwrap();
        let many = estimate_offset(&samples).unwrap();
        assert!(many.uncertainty_ns <= few.uncertainty_ns);
        assert!((many.offset_ns - 42_000).unsigned_abs() <= many.uncertainty_ns);
    }

    #[test]
    fn a_symmetric_round_trip_gives_the_exact_skew() {
        let s = PingSample {
            sent_ns: 1_000,
            remote_ns: 1_500 + 250,
            received_ns: 2_000,
        };
        assert_eq!(
            estimate_offset(&[s]),
            Some(OffsetEstimate {
                offset_ns: 250,
                uncertainty_ns: 500
            })
        );
    }

    #[test]
    fn no_usable_sample_gives_no_estimate() {
        assert_eq!(estimate_offset(&[]), None);
        let backwards = PingSample {
            sent_ns: 10,
            remote_ns: 5,
            received_ns: 9,
        };
        assert_eq!(estimate_offset(&[backwards]), None);
        // Extreme readings clamp, never overflow.
        let extreme = PingSample {
            sent_ns: 0,
            remote_ns: u64::MAX,
            received_ns: 0,
        };
        assert_eq!(estimate_offset(&[extreme]).unwrap().offset_ns, i64::MAX);
    }
}
