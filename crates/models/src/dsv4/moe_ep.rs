//! The expert-parallel MoE step's platform-neutral pieces (`docs/dsv4.md`, "Expert
//! parallelism"): which tokens a rank owns, and the wire layout of the two exchanges, packed
//! from and unpacked into what the split step of [`MoeLayer`](super::moe_graph::MoeLayer)
//! reads and writes. A node level runs
//!
//! ```text
//! front_step -> pack_dispatch -> exchange counts, all-to-all -> unpack_dispatch
//!   -> expert_step -> pack_combine -> all-to-all back -> unpack_combine -> back_step
//! ```
//!
//! # Wire layout
//! Dispatch message from rank `s` to rank `j`: `L_j` little-endian `u32` row counts (one per
//! expert of `j`, in expert order), then the rows grouped per expert, ascending, each row
//! `D` int8 values, its scale (`f32` LE) and its routing weight (`f32` LE). Within an expert
//! the rows keep the sender's route order. Combine message from `j` back to `s`: one `[D]`
//! `f32` LE row per row `s` sent to `j`, in the order `s` sent them.
//!
//! # Why the result is bit-identical to one rank
//! Every per-token stage (`hc_pre`, route, the int8 activations, the shared experts) and every
//! per-row expert stage (int8 products accumulate exactly in i32, then one scale per element)
//! gives a row the same bits whatever other rows share its batch. Combine writes each expert
//! output back to its own route slot, so the reduce sees `[T, K, D]` in route order and sums
//! it in the single-rank order (shared experts, then routes `0..K`).

use std::ops::Range;

use simpler_kernels_cpu::dsv4::moe::moe_dispatch_plan;

use super::moe_graph::{ExpertPlacement, MoeFront, MoeRunError, ReceivedRows};

/// The tokens of rank `rank` of `ranks` when a step of `tokens` rows is split across them:
/// consecutive, the first `tokens % ranks` ranks one more. Every rank owns at least one token
/// when `tokens >= ranks`.
pub fn rank_tokens(tokens: usize, ranks: usize, rank: usize) -> Range<usize> {
    let ranks = ranks.max(1);
    let (base, extra) = (tokens / ranks, tokens % ranks);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Bytes of one dispatched row of width `d`.
pub fn dispatch_row_bytes(d: usize) -> usize {
    d + 8
}

/// The largest dispatch message one rank sends: every route of its `tokens` tokens to one
/// rank of `placement`, with the counts header.
pub fn dispatch_bytes_max(
    placement: &ExpertPlacement,
    tokens: usize,
    top_k: usize,
    d: usize,
) -> usize {
    4 * placement.per_rank * placement.ranks() + tokens * top_k * dispatch_row_bytes(d)
}

/// The largest combine message one rank sends: an output row for every route of `tokens`
/// tokens (all of them to this rank's experts).
pub fn combine_bytes_max(tokens: usize, top_k: usize, d: usize) -> usize {
    tokens * top_k * d * 4
}

/// One rank's dispatch: the bytes to send and, to undo it at combine, the route id of every
/// row in the order sent.
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchSend {
    /// Messages to ranks `0..N`, back to back.
    pub bytes: Vec<u8>,
    /// Bytes to each rank.
    pub counts: Vec<usize>,
    /// Rows sent to each rank.
    pub rows: Vec<usize>,
    /// Route ids (`token · K + k`) of the rows sent, rank after rank.
    pub order: Vec<u32>,
}

/// Packs the dispatch of this rank's routes (`front`) to every rank of `placement`.
pub fn pack_dispatch(
    placement: &ExpertPlacement,
    front: &MoeFront,
    d: usize,
) -> Result<DispatchSend, MoeRunError> {
    let t = front.xs.len();
    if front.xq.len() != t * d || t == 0 || !front.experts.len().is_multiple_of(t) {
        return Err(MoeRunError::Invalid(format!(
            "dispatch: {} int8 values, {} scales and {} routes do not fit width {d}",
            front.xq.len(),
            t,
            front.experts.len()
        )));
    }
    let top_k = front.experts.len() / t;
    let (mut bytes, mut counts, mut rows, mut order) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for j in 0..placement.ranks() {
        let local = placement.local(j);
        let plan = moe_dispatch_plan(&front.experts, placement.n_experts, local, t * top_k)
            .map_err(|e| MoeRunError::Invalid(format!("dispatch to rank {j}: {e}")))?;
        let start = bytes.len();
        for c in &plan.counts {
            bytes.extend_from_slice(&c.to_le_bytes());
        }
        for &route in &plan.order {
            let tok = route as usize / top_k;
            bytes.extend(front.xq[tok * d..(tok + 1) * d].iter().map(|&v| v as u8));
            bytes.extend_from_slice(&front.xs[tok].to_le_bytes());
            bytes.extend_from_slice(&front.weights[route as usize].to_le_bytes());
        }
        counts.push(bytes.len() - start);
        rows.push(plan.order.len());
        order.extend_from_slice(&plan.order);
    }
    Ok(DispatchSend {
        bytes,
        counts,
        rows,
        order,
    })
}

/// What a rank received at dispatch: the rows grouped per local expert, and where each
/// sender's rows went (to send the outputs back in the sender's order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DispatchRecv {
    /// The rows, grouped per local expert.
    pub rows: ReceivedRows,
    /// For each sender, the grouped row index of each row it sent, in its order.
    pub slots: Vec<Vec<usize>>,
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_f32(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Unpacks what rank `rank` of `placement` received (`recv_counts[s]` bytes from rank `s`,
/// back to back), grouping the rows per local expert, senders in rank order within a group.
pub fn unpack_dispatch(
    placement: &ExpertPlacement,
    rank: usize,
    d: usize,
    recv: &[u8],
    recv_counts: &[usize],
) -> Result<DispatchRecv, MoeRunError> {
    let l = placement.local(rank).len();
    let row = dispatch_row_bytes(d);
    if recv_counts.iter().sum::<usize>() != recv.len() {
        return Err(MoeRunError::Invalid(format!(
            "dispatch: receive counts add up to {}, received {} bytes",
            recv_counts.iter().sum::<usize>(),
            recv.len()
        )));
    }
    // Per sender: its per-expert counts and where its rows start.
    let mut headers: Vec<(Vec<usize>, usize)> = Vec::with_capacity(recv_counts.len());
    let mut at = 0;
    for (s, &n) in recv_counts.iter().enumerate() {
        let msg = &recv[at..at + n];
        if n < 4 * l {
            return Err(MoeRunError::Invalid(format!(
                "dispatch from rank {s}: {n} bytes, shorter than the {l} expert counts"
            )));
        }
        let counts: Vec<usize> = msg[..4 * l]
            .chunks_exact(4)
            .map(|b| le_u32(b) as usize)
            .collect();
        let rows: usize = counts.iter().sum();
        if n != 4 * l + rows * row {
            return Err(MoeRunError::Invalid(format!(
                "dispatch from rank {s}: {n} bytes for {rows} rows of {row} bytes after {l} counts"
            )));
        }
        headers.push((counts, at + 4 * l));
        at += n;
    }
    let total: usize = headers.iter().map(|h| h.0.iter().sum::<usize>()).sum();
    let mut out = DispatchRecv {
        rows: ReceivedRows {
            q: Vec::with_capacity(total * d),
            scales: Vec::with_capacity(total),
            weights: Vec::with_capacity(total),
            offsets: vec![0],
        },
        slots: headers
            .iter()
            .map(|h| Vec::with_capacity(h.0.iter().sum()))
            .collect(),
    };
    for g in 0..l {
        for (s, (counts, base)) in headers.iter().enumerate() {
            let first: usize = counts[..g].iter().sum();
            for i in first..first + counts[g] {
                let r = &recv[base + i * row..base + (i + 1) * row];
                out.slots[s].push(out.rows.scales.len());
                out.rows.q.extend(r[..d].iter().map(|&v| v as i8));
                out.rows.scales.push(le_f32(&r[d..d + 4]));
                out.rows.weights.push(le_f32(&r[d + 4..d + 8]));
            }
        }
        out.rows.offsets.push(out.rows.scales.len() as u32);
    }
    Ok(out)
}

/// Packs the expert outputs `y_rows` (`[R, D]`, grouped rows) back to their senders.
pub fn pack_combine(
    recv: &DispatchRecv,
    y_rows: &[f32],
    d: usize,
) -> Result<(Vec<u8>, Vec<usize>), MoeRunError> {
    if y_rows.len() != recv.rows.scales.len() * d {
        return Err(MoeRunError::Invalid(format!(
            "combine: {} output values for {} rows of {d}",
            y_rows.len(),
            recv.rows.scales.len()
        )));
    }
    let mut bytes = Vec::with_capacity(y_rows.len() * 4);
    let mut counts = Vec::with_capacity(recv.slots.len());
    for slots in &recv.slots {
        for &r in slots {
            bytes.extend(
                y_rows[r * d..(r + 1) * d]
                    .iter()
                    .flat_map(|v| v.to_le_bytes()),
            );
        }
        counts.push(slots.len() * d * 4);
    }
    Ok((bytes, counts))
}

/// Bytes this rank receives from each rank at combine: an output row for each row it sent.
pub fn combine_recv_counts(sent: &DispatchSend, d: usize) -> Vec<usize> {
    sent.rows.iter().map(|r| r * d * 4).collect()
}

/// Scatters the combined outputs (rows in the order this rank sent them) to their routes:
/// `[routes, D]` in route order.
pub fn unpack_combine(
    sent: &DispatchSend,
    recv: &[u8],
    routes: usize,
    d: usize,
) -> Result<Vec<f32>, MoeRunError> {
    if recv.len() != sent.order.len() * d * 4 {
        return Err(MoeRunError::Invalid(format!(
            "combine: received {} bytes for {} rows of {d}",
            recv.len(),
            sent.order.len()
        )));
    }
    let mut out = vec![0.0f32; routes * d];
    for (row, &route) in recv.chunks_exact(d * 4).zip(&sent.order) {
        let route = route as usize;
        if route >= routes {
            return Err(MoeRunError::Invalid(format!(
                "combine: route {route} of {routes}"
            )));
        }
        for (o, b) in out[route * d..(route + 1) * d]
            .iter_mut()
            .zip(row.chunks_exact(4))
        {
            *o = le_f32(b);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_split_evenly_and_cover_the_step() {
        for (t, n) in [(8, 2), (8, 3), (8, 8), (5, 4)] {
            let parts: Vec<_> = (0..n).map(|r| rank_tokens(t, n, r)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[n - 1].end, t);
            assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
            assert!(
                parts
                    .iter()
                    .all(|p| p.len() >= t / n && p.len() <= t / n + 1)
            );
        }
    }

    #[test]
    fn a_short_or_inconsistent_message_is_refused() {
        let p = ExpertPlacement {
            n_experts: 4,
            per_rank: 2,
        };
        // Two counts, one row of width 2 announced, but no row bytes.
        let msg: Vec<u8> = [1u32, 0].iter().flat_map(|c| c.to_le_bytes()).collect();
        let e = unpack_dispatch(&p, 0, 2, &msg, &[8]).unwrap_err();
        assert!(e.to_string().contains("from rank 0"), "{e}");
        let e = unpack_dispatch(&p, 0, 2, &msg[..4], &[4]).unwrap_err();
        assert!(e.to_string().contains("shorter"), "{e}");
        let e = unpack_dispatch(&p, 0, 2, &msg, &[4]).unwrap_err();
        assert!(e.to_string().contains("receive counts"), "{e}");
    }
}
