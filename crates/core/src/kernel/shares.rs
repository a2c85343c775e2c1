//! How an SPMD task's items are shared over its blocks: the tapered split behind
//! [`TaskCtx::block_range_tapered`](super::TaskCtx::block_range_tapered) and
//! [`TaskCtx::write_block_cols`](super::TaskCtx::write_block_cols).

use std::ops::Range;

/// Weights of a full-size block in the geometric tapers, deepest first: the tail's weights
/// halve from there down to 1 (so its last shares are 1/16, 1/8 or 1/4 of a full one).
const TAPERS: [usize; 3] = [16, 8, 4];

/// Sum of the first `k` tail weights of the geometric taper from `full`: `full/2, full/4, ..,
/// 1, 1, ..`.
fn geometric_tail(full: usize, k: usize) -> usize {
    let (mut sum, mut w, mut t) = (0, full / 2, 0);
    while t < k && w > 1 {
        sum += w;
        w /= 2;
        t += 1;
    }
    sum + (k - t)
}

/// Share `i` of `n` items over `blocks` blocks, tapered so a task's last blocks are small:
/// with 8 or more blocks, the last half's shares halve one after the other (1/2, 1/4, 1/8,
/// 1/16, then 1/16 of a full share) when there are enough items for every share to be
/// non-empty; failing that, down to 1/8 (1/2, 1/4, 1/8, 1/8, ..), then down to 1/4 of a full
/// share (1/2, 1/4, 1/4, ..), or else half size (with at
/// least two items per block); otherwise the shares are equal. (With equal shares a
/// DeepSeek-V4 `q_b` of 64 whole heads over 12 blocks ended on three 3-head blocks of ~110 µs
/// each, and one core waited for the last of them 60–95 µs in every step; it now ends on 5, 2
/// and four 1-head blocks.) With at least as many items as blocks, no share is empty.
///
/// Why half the blocks: cores take blocks in order as they come free, so the shorter the
/// blocks left when one core runs out, the less the other has to finish alone. A tail of a
/// quarter (two blocks of an 8-block projection: 1/2 and 1/4 of a full share, which the two
/// cores often start together) left one core waiting ~10–17 µs at most phase ends of a Qwen3
/// decode step; a tail of half (1/2, 1/4, 1/8, 1/8 there: while one core runs the half, the
/// other runs the rest) took the share of a step outside kernels from 3.3% to 2.9% at 1 × 256
/// and from 3.2% to 3.0% at 4 × 1024 (`docs/benchmarks.md`, session 33).
/// Public so that kernel benchmarks can split work exactly as the runtime does.
pub fn tapered_range(n: usize, blocks: usize, i: usize) -> Range<usize> {
    let blocks = blocks.max(1);
    let tail = if blocks >= 8 { blocks / 2 } else { 0 };
    let full = blocks - tail;
    // The deepest taper whose every share gets an item.
    let geometric = TAPERS
        .into_iter()
        .find(|&f| tail > 0 && n >= f * full + geometric_tail(f, tail));
    let halves = tail > 0 && geometric.is_none() && n >= 2 * blocks;
    // Prefix of the weights before block `j`.
    let before = |j: usize| {
        let (head, k) = (j.min(full), j.saturating_sub(full));
        if let Some(f) = geometric {
            f * head + geometric_tail(f, k)
        } else if halves {
            2 * head + k
        } else {
            j
        }
    };
    // Rounded from the end: each share's start is `n` less the floor of what its weights
    // from there on ask for, so the last shares are at most their exact size and the rounding
    // excess lands on the first ones. (Rounded from the front, 64 whole heads over 12 blocks
    // ended on 3, 3 and 4 heads: the 4-head block ran alone at the end of a DeepSeek-V4 `q_b`
    // phase while the other core waited ~170 µs.)
    let total = before(blocks) as u128;
    let at = |j: usize| n - (n as u128 * (total - before(j) as u128) / total) as usize;
    at(i.min(blocks))..at((i + 1).min(blocks))
}

#[cfg(test)]
mod tests {
    use super::tapered_range;
    use proptest::prelude::*;

    #[test]
    fn geometric_taper_of_a_projection() {
        // 3072 rows in 16-row units over 12 blocks: 6 full shares, then about 1/2, 1/4, 1/8
        // and three of 1/16.
        let lens: Vec<usize> = (0..12).map(|i| tapered_range(192, 12, i).len()).collect();
        assert_eq!(lens.iter().sum::<usize>(), 192);
        assert!(
            lens[..6].iter().all(|&l| (27..=28).contains(&l)),
            "{lens:?}"
        );
        assert_eq!(&lens[6..], &[13, 7, 3, 2, 2, 1], "{lens:?}");
        // Too few items for the geometric taper: half-size shares, rounded from the end (the
        // last is the least; the rounding's excess lands on earlier shares).
        let lens: Vec<usize> = (0..8).map(|i| tapered_range(20, 8, i).len()).collect();
        assert_eq!(lens, [4, 3, 3, 4, 1, 2, 2, 1], "{lens:?}");
        // 64 whole heads over 12 blocks: six of 8–9, then 5, 2 and four of 1.
        let lens: Vec<usize> = (0..12).map(|i| tapered_range(64, 12, i).len()).collect();
        assert_eq!(lens, [9, 9, 9, 9, 9, 8, 5, 2, 1, 1, 1, 1], "{lens:?}");
        // A Qwen3 0.6B down projection at batch 1: 64 units over 8 blocks.
        let lens: Vec<usize> = (0..8).map(|i| tapered_range(64, 8, i).len()).collect();
        assert_eq!(lens, [13, 13, 13, 13, 6, 3, 2, 1], "{lens:?}");
    }

    proptest! {
        #[test]
        fn tapered_shares_cover_in_order_and_shrink_at_the_end(n in 0usize..5000, blocks in 1usize..300) {
            let shares: Vec<_> = (0..blocks).map(|i| tapered_range(n, blocks, i)).collect();
            prop_assert_eq!(shares[0].start, 0);
            prop_assert_eq!(shares[blocks - 1].end, n);
            for w in shares.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            if blocks <= n {
                prop_assert!(shares.iter().all(|r| !r.is_empty()), "{shares:?}");
            }
            if blocks >= 8 && n >= 4 * blocks {
                let first = shares[0].len();
                let last = shares[blocks - 1].len();
                prop_assert!(last < first, "{first} {last}");
            }
            if blocks >= 8 && n >= 8 * blocks {
                // Geometric: the last share is at most a quarter of a full one (+ rounding).
                let first = shares[0].len();
                let last = shares[blocks - 1].len();
                prop_assert!(4 * last <= first + 4, "{first} {last}");
                for w in shares[blocks - blocks / 2 - 1..].windows(2) {
                    prop_assert!(w[1].len() <= w[0].len() + 1, "{shares:?}");
                }
            }
            if blocks >= 8 && n >= 16 * blocks {
                // Deep enough for 1/16: the last share is at most a sixteenth of a full one
                // (+ rounding).
                let first = shares[0].len();
                let last = shares[blocks - 1].len();
                prop_assert!(16 * last <= first + 16, "{first} {last}");
            }
            if blocks >= 8 && n >= 2 * blocks {
                // The task ends on the smallest share of its tail: rounding never makes the
                // last share the larger one.
                let tail = &shares[blocks - blocks / 2..];
                let least = tail.iter().map(|r| r.len()).min().unwrap_or(0);
                prop_assert_eq!(shares[blocks - 1].len(), least, "{:?}", shares);
            }
            if blocks < 8 || n < 2 * blocks {
                let (lo, hi) = shares.iter().map(|r| r.len()).fold((usize::MAX, 0), |(a, b), l| (a.min(l), b.max(l)));
                prop_assert!(hi - lo <= 1);
            }
        }
    }
}
