//! How a step is cut into tasks: how many SPMD blocks each projection task has (so every core
//! streams disjoint weight rows, several blocks per core for balance; the runtime's
//! `write_block_cols` gives each block its tapered share of the rows), split-KV chunks for decode attention (so small
//! batches still use every core), row blocks for prefill attention, and the per-sequence rows
//! and KV slots of a step.

use std::ops::Range;

use simpler_kernels_cpu::{PACK_BLOCK, paging, split_range};

use super::config::Qwen3Config;
use super::weights::PagedBatch;

/// Tiling knobs. The defaults suit a CPU with a few cores; everything is derived from the
/// model shape, the batch and the core count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TilePolicy {
    /// Cores the graph runs on.
    pub cores: usize,
    /// About how many weight bytes one projection tile streams.
    pub tile_bytes: usize,
    /// Fewest tiles of each projection per core (balance at the phase's end).
    pub tiles_per_core: usize,
    /// Shortest KV chunk of split-KV decode attention, in tokens (the default, 128: a chunk
    /// pays a fixed cost — state set-up, softmax, its partial written and combined — and at
    /// batch 1 over 257 tokens two chunks of 128 took ~2.0–2.2 ms of a step's attention phases
    /// against 2.3–2.7 ms for four of 64).
    pub min_kv_chunk: usize,
    /// Longest KV chunk, in tokens (by default none: a sequence is cut only as far as
    /// `attn_tasks_per_core` asks, and the phase ends on the first sequence's short chunks,
    /// [`TilePolicy::kv_splits`]). Each chunk past a sequence's first costs a partial written
    /// and read back by a combine task on another core (~8 µs of a core each at 16 × 1024 on
    /// Zen 4). Until session 55 chunks were capped at 256 tokens, which cut every 1024-token
    /// sequence of a 16 × 1024 step into four chunks and a combine: with no cap that step took
    /// 0.95–0.97× the time and 1 × 4096 0.97×, 4 × 1024 level (`docs/benchmarks.md`).
    pub max_kv_chunk: usize,
    /// Decode attention tasks per core to aim for.
    pub attn_tasks_per_core: usize,
    /// Query rows per prefill attention task (the default: [`default_prefill_rows`]).
    pub prefill_rows: usize,
    /// Most bytes of fp32 products one block of a prefill's q/k/v task writes before its
    /// epilogue reads them back ([`LayerBlocks::qkv_prefill`]; the default:
    /// [`QKV_SCRATCH_BYTES`]).
    pub qkv_scratch_bytes: usize,
}

/// Query rows per prefill attention task by default. 64 below AMX: where prefill attention
/// runs the AVX2 blocked kernel a task is then (at group 2) two 64-query blocks that share
/// each widened run of the prefix's K and V; on one thread at the 0.6B shape (512 tokens,
/// `prefill_attn`) 64-row tasks took ~0.83 of the time of 32-row ones, and 128-row tasks
/// (four blocks, whose outputs and queries no longer stay in L2 across a run) more than 64.
/// The AVX-512 BF16 vector kernel (8 blocks of 16 queries sharing one gathered prefix) took
/// 7.4–7.9 ms there at 32, 64 and 128 rows alike on Zen 4. 32 on the AMX tiles, whose kernel
/// was tuned at that size.
pub fn default_prefill_rows() -> usize {
    use simpler_kernels_cpu::isa::Isa;
    if Isa::detected() >= Isa::AmxBf16 {
        32
    } else {
        64
    }
}

impl TilePolicy {
    /// The default policy for `cores` cores.
    pub fn for_cores(cores: usize) -> TilePolicy {
        TilePolicy {
            cores: cores.max(1),
            tile_bytes: 1 << 20,
            tiles_per_core: 4,
            min_kv_chunk: 128,
            max_kv_chunk: usize::MAX,
            attn_tasks_per_core: 4,
            prefill_rows: default_prefill_rows(),
            qkv_scratch_bytes: QKV_SCRATCH_BYTES,
        }
    }

    /// SPMD blocks of a projection with `n` output rows of `row_bytes` weight bytes each:
    /// about `tile_bytes` of weights per block, at least `tiles_per_core` per core, at most one
    /// per 16-row packing block.
    pub fn blocks(&self, n: usize, row_bytes: usize) -> u32 {
        let by_bytes = n.saturating_mul(row_bytes).div_ceil(self.tile_bytes.max(1));
        let want = by_bytes.max(self.tiles_per_core * self.cores);
        let units = n.div_ceil(PACK_BLOCK);
        u32::try_from(want.min(units).max(1)).unwrap_or(u32::MAX)
    }

    /// The same split as equal row ranges, for measuring the GEMM kernel outside the runtime
    /// (the runtime's shares taper over the last blocks; their count is [`TilePolicy::blocks`]).
    pub fn row_tiles(&self, n: usize, row_bytes: usize) -> Vec<Range<usize>> {
        let g = PACK_BLOCK;
        let units = n.div_ceil(g);
        let t = self.blocks(n, row_bytes) as usize;
        (0..t)
            .map(|i| {
                let r = split_range(units, t, i);
                (r.start * g).min(n)..(r.end * g).min(n)
            })
            .filter(|r| !r.is_empty())
            .collect()
    }

    /// KV chunks of each sequence for split-KV decode attention, as token ranges (the ranges
    /// of [`TilePolicy::kv_splits`] at these lengths).
    pub fn kv_chunks(&self, seq_lens: &[usize]) -> Vec<Vec<Range<usize>>> {
        self.kv_splits(seq_lens)
            .iter()
            .zip(seq_lens)
            .map(|(s, &len)| s.ranges(len))
            .collect()
    }

    /// How each sequence's KV is cut for split-KV decode attention (one SPMD task per
    /// sequence, a block per chunk, each covering every KV head). Chunks are about equally long across the whole batch — a sequence
    /// gets chunks in proportion to its length — so a ragged batch's attention phase does not
    /// end waiting on its longest sequence. With more chunks than cores, their count is first
    /// cut to a multiple of the core count (lengthening the shortest chunks) so the phase does
    /// not end on a round where one chunk runs and the other cores wait: at batch 1 over 257
    /// tokens, 2 chunks on 2 cores instead of 3.
    ///
    /// The phase then ends on short tasks: the first sequence's last `cores` chunks are each
    /// cut in two halves ([`KvSplit::short`]), when the halves are at least `min_kv_chunk`
    /// tokens long (shorter chunks cost more per token); a first sequence of fewer chunks than
    /// cores (a batch of more sequences than attention tasks, one chunk each) is first cut into
    /// `2 × cores` chunks, so 16 × 1024 on 2 cores is 15 chunks of 1024, two of 256 and four of
    /// 128, and its count is no longer a multiple of the cores (the cores' work still is). The runtime readies the
    /// consumers of a completed task newest first, so the first-submitted sequence's task runs
    /// last, and its blocks (one per chunk) are claimed in order; a core that finishes early
    /// then waits at most about a half chunk.
    /// Measured when chunks were capped at 256 tokens: at batch 4 × 1024 on 2 cores (16 chunks
    /// of 256 → 18, four of them 128; now 8 of 512 → 10, four of them 256), the two cores'
    /// idle between the attention phase and `o_proj` went from a median 88–97 µs a layer to
    /// 50–77 µs, and all idle gaps under 1 ms of a step from 6.6–10.4 ms (median 8.4) to
    /// 6.0–7.8 ms (median 6.8), paired runs under a load of 2.5–5; at a load of 1.5 the idle
    /// a layer went 46–98 → 44–64 µs, the gap sums a step 7.6 → 6.6 ms (medians), and the
    /// bench's "net" outside share 3.6% → 3.15% (medians of four runs each).
    pub fn kv_splits(&self, seq_lens: &[usize]) -> Vec<KvSplit> {
        let total: usize = seq_lens.iter().sum();
        let tasks = (self.attn_tasks_per_core * self.cores).max(1);
        let target = total
            .div_ceil(tasks)
            .min(self.max_kv_chunk)
            .max(self.min_kv_chunk.max(1));
        let mut counts: Vec<usize> = seq_lens
            .iter()
            .map(|&len| len.div_ceil(target).max(1))
            .collect();
        let cores = self.cores.max(1);
        let n: usize = counts.iter().sum();
        let mut excess = if n > cores { n % cores } else { 0 };
        while excess > 0 {
            // The sequence whose chunks stay shortest without it gives one up.
            let shortest = (0..counts.len())
                .filter(|&i| counts[i] > 1)
                .min_by_key(|&i| (seq_lens[i] * 1024 / (counts[i] - 1), i));
            let Some(i) = shortest else { break };
            counts[i] -= 1;
            excess -= 1;
        }
        let mut splits: Vec<KvSplit> = counts
            .into_iter()
            .map(|chunks| KvSplit { chunks, short: 0 })
            .collect();
        let n: usize = splits.iter().map(|s| s.chunks).sum();
        if let (Some(first), Some(&len)) = (splits.first_mut(), seq_lens.first()) {
            // A batch of many sequences leaves each one chunk: the first is then cut into
            // `2 × cores` chunks (`cores` where its quarters would be shorter than the shortest
            // chunk), so the halves below still end the phase. At 16 × 1024 on 2 cores the
            // idle before the last combine was 0.54–0.58 ms a step with the tail of 128-token
            // pieces this gives, against 0.64–0.81 ms with 256-token pieces.
            if cores > 1
                && n > cores
                && first.chunks < cores
                && len / (2 * cores) >= self.min_kv_chunk
            {
                first.chunks = if len / (4 * cores) >= self.min_kv_chunk {
                    2 * cores
                } else {
                    cores
                };
            }
            // Halves of the first `cores` chunks.
            let half = len / (2 * first.chunks);
            if cores > 1 && n > cores && first.chunks >= cores && half >= self.min_kv_chunk {
                first.chunks += cores;
                first.short = 2 * cores;
            }
        }
        splits
    }
}

/// How one sequence's KV is cut into chunks for split-KV decode attention: `chunks` chunks,
/// the last `short` of them half as long as the others (a sequence's chunks are the blocks of
/// one SPMD task, claimed in order, so the task ends on them). The decode attention kernel
/// derives its chunk's tokens from the sequence's length at run time through
/// [`KvSplit::range`], so a replayed graph splits its longer sequences by the same rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSplit {
    /// Chunks of the sequence.
    pub chunks: usize,
    /// Trailing chunks of half weight (0: all chunks about equal).
    pub short: usize,
}

impl KvSplit {
    /// Tokens of chunk `chunk` of a sequence of `len` tokens: the trailing `short` chunks
    /// weigh one unit, the others two, and the units are `len` split as evenly as possible.
    /// Chunks past the last, or a `short` above `chunks`, give empty or clamped ranges, never
    /// panic.
    pub fn range(&self, len: usize, chunk: usize) -> Range<usize> {
        if chunk >= self.chunks {
            return len..len;
        }
        let short = self.short.min(self.chunks);
        if short == 0 {
            return split_range(len, self.chunks, chunk);
        }
        let long = self.chunks - short;
        let units = short + 2 * long;
        let unit = |c: usize| 2 * c.min(long) + c.saturating_sub(long);
        let at = |u: usize| {
            if u >= units {
                len
            } else {
                split_range(len, units, u).start
            }
        };
        at(unit(chunk))..at(unit(chunk + 1))
    }

    /// Every chunk's tokens, in order.
    pub fn ranges(&self, len: usize) -> Vec<Range<usize>> {
        (0..self.chunks).map(|c| self.range(len, c)).collect()
    }
}

/// SPMD blocks of every projection task of a layer and of the LM head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerBlocks {
    /// `q_proj`, `k_proj` and `v_proj` together (one task, `GEMM_ROPE_STEP`; a prefill of many
    /// rows takes more, [`LayerBlocks::qkv_prefill`]).
    pub qkv: u32,
    /// `o_proj` (hidden columns of the residual).
    pub o: u32,
    /// `gate_proj`/`up_proj` (fused with SwiGLU).
    pub gate_up: u32,
    /// `down_proj` (hidden columns of the residual).
    pub down: u32,
    /// LM head (vocabulary).
    pub lm_head: u32,
}

impl LayerBlocks {
    /// Blocks for `c` under `policy`.
    pub fn new(c: &Qwen3Config, policy: &TilePolicy) -> LayerBlocks {
        let (h, q, kv, i) = (
            c.hidden_size,
            c.q_width(),
            c.kv_width(),
            c.intermediate_size,
        );
        LayerBlocks {
            qkv: policy.blocks(q + 2 * kv, 2 * h),
            o: policy.blocks(h, 2 * q),
            gate_up: policy.blocks(i, 4 * h),
            down: policy.blocks(h, 2 * i),
            lm_head: policy.blocks(c.vocab_size, 2 * h),
        }
    }

    /// Blocks of the q/k/v task of a step of `rows` rows over `cols` projected columns (q's,
    /// k's and v's together): [`LayerBlocks::qkv`], or more where a block's products (fp32,
    /// `rows` × its columns) would not fit `scratch_bytes`
    /// ([`TilePolicy::qkv_scratch_bytes`]), as the epilogue reads them back from that scratch.
    pub fn qkv_prefill(&self, rows: usize, cols: usize, scratch_bytes: usize) -> u32 {
        let by_scratch = rows
            .saturating_mul(cols)
            .saturating_mul(4)
            .div_ceil(scratch_bytes.max(1));
        self.qkv.max(u32::try_from(by_scratch).unwrap_or(u32::MAX))
    }
}

/// [`TilePolicy::qkv_scratch_bytes`] by default: half of a Zen 4 core's L2; at 512 rows of the
/// 0.6B model, blocks of two heads.
pub const QKV_SCRATCH_BYTES: usize = 512 << 10;

/// One sequence's rows in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqRows {
    /// Block-table row of the sequence.
    pub table_row: usize,
    /// Tokens of the sequence after this step (cached prefix + the step's tokens).
    pub seq_len: usize,
    /// Tokens of the sequence in this step (decode: 1).
    pub n_rows: usize,
    /// Step row of the sequence's first token.
    pub row0: usize,
}

impl SeqRows {
    /// Position of the step's first token of this sequence.
    pub fn first_pos(&self) -> usize {
        self.seq_len - self.n_rows
    }
}

/// Checks a batch against a cache of `slots` slots and RoPE tables of `max_seq` positions.
pub(crate) fn check_batch(
    batch: &PagedBatch,
    slots: usize,
    page_size: usize,
    max_seq: usize,
) -> Result<(), String> {
    batch.check()?;
    if batch.page_size != page_size {
        return Err(format!(
            "batch pages of {} tokens, the cache has pages of {page_size}",
            batch.page_size
        ));
    }
    for (b, &len) in batch.seq_lens.iter().enumerate() {
        paging::check_table(batch.table(b), page_size, 0..len, slots)
            .map_err(|e| format!("sequence {b}: {e}"))?;
    }
    if let Some(&len) = batch.seq_lens.iter().find(|&&l| l > max_seq) {
        return Err(format!(
            "sequence of {len} tokens, the RoPE tables cover {max_seq} positions"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefill's q/k/v blocks keep each block's products within the scratch bound; a decode
    /// batch's rows leave the decode plan's count.
    #[test]
    fn prefill_qkv_blocks_bound_each_blocks_products() {
        let c = Qwen3Config::preset("qwen3-0.6b").unwrap();
        let b = LayerBlocks::new(&c, &TilePolicy::for_cores(2));
        let cols = c.q_width() + 2 * c.kv_width();
        let bound = QKV_SCRATCH_BYTES;
        assert_eq!(b.qkv_prefill(16, cols, bound), b.qkv);
        for rows in [512usize, 1000, 4096] {
            let n = b.qkv_prefill(rows, cols, bound) as usize;
            assert!(
                rows * cols.div_ceil(n) * 4 <= QKV_SCRATCH_BYTES + rows * 4,
                "{rows}: {n}"
            );
            assert!(n > b.qkv as usize, "{rows}: {n}");
        }
        assert_eq!(b.qkv_prefill(512, cols, bound), 16);
        assert_eq!(b.qkv_prefill(512, cols, bound / 2), 32);
    }

    #[test]
    fn row_tiles_cover_the_rows_in_granules() {
        let p = TilePolicy::for_cores(2);
        for (n, row_bytes) in [
            (2048, 2048),
            (1024, 6144),
            (151_936, 2048),
            (40, 64),
            (1, 64),
        ] {
            let tiles = p.row_tiles(n, row_bytes);
            assert_eq!(tiles.first().map(|r| r.start), Some(0));
            assert_eq!(tiles.last().map(|r| r.end), Some(n));
            for w in tiles.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(w[0].end % PACK_BLOCK, 0);
            }
            assert!(tiles.len() >= (n / PACK_BLOCK).min(p.cores * p.tiles_per_core));
            assert_eq!(tiles.len(), p.blocks(n, row_bytes) as usize);
        }
        let lens = [256, 10, 3000, 1024];
        let chunks = p.kv_chunks(&lens);
        assert_eq!(chunks.len(), lens.len());
        for (c, len) in chunks.iter().zip(lens) {
            assert_eq!(c.first().map(|r| r.start), Some(0));
            assert_eq!(c.last().map(|r| r.end), Some(len));
            for w in c.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
        }
        // Ragged lengths: chunks within a factor of two of each other (except a sequence
        // shorter than one chunk), so no sequence's chunks dominate the phase.
        let sizes: Vec<usize> = chunks.iter().skip(2).flatten().map(|r| r.len()).collect();
        let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        assert!(hi <= &(2 * lo), "{sizes:?}");
        // One short sequence at batch 1 still splits over every core.
        assert!(p.kv_chunks(&[256])[0].len() >= p.cores);
    }

    #[test]
    fn kv_chunk_counts_are_a_multiple_of_the_cores_when_there_are_more_chunks_than_cores() {
        for cores in [2, 3, 4, 16] {
            let p = TilePolicy::for_cores(cores);
            for lens in [
                vec![257],
                vec![1025; 4],
                vec![3000, 10, 700],
                vec![5; 3],
                vec![64, 65, 1000, 4000, 17],
            ] {
                let chunks = p.kv_chunks(&lens);
                let n: usize = chunks.iter().map(Vec::len).sum();
                let singles = lens.len();
                assert!(
                    n <= cores || n.is_multiple_of(cores) || n == singles,
                    "{cores} cores, lens {lens:?}: {n} chunks"
                );
                for (c, len) in chunks.iter().zip(&lens) {
                    assert!(!c.is_empty());
                    assert_eq!(c.iter().map(|r| r.len()).sum::<usize>(), *len);
                    assert!(c.iter().all(|r| !r.is_empty()), "{c:?}");
                }
            }
        }
        assert_eq!(TilePolicy::for_cores(2).kv_chunks(&[257])[0].len(), 2);
        assert_eq!(TilePolicy::for_cores(2).kv_chunks(&[1200])[0].len(), 8);
    }

    #[test]
    fn long_contexts_are_cut_into_chunks_no_longer_than_the_cap() {
        let mut p = TilePolicy::for_cores(2);
        // No cap by default: 4 × 4096 is the 8 tasks `attn_tasks_per_core` asks for, with
        // the first sequence's two chunks halved.
        assert_eq!(
            p.kv_splits(&[4096; 4])
                .iter()
                .map(|s| (s.chunks, s.short))
                .collect::<Vec<_>>(),
            [(4, 4), (2, 0), (2, 0), (2, 0)]
        );
        p.max_kv_chunk = 256;
        let splits = p.kv_splits(&[4096; 4]);
        for (s, r) in splits.iter().zip(p.kv_chunks(&[4096; 4])) {
            let long = s.chunks - s.short;
            assert!(r[long..].iter().all(|r| r.len() == p.max_kv_chunk / 2));
            assert!(r[..long].iter().all(|r| r.len() == p.max_kv_chunk));
        }
        for lens in [vec![3500; 16], vec![4097], vec![40_000, 1000, 9000]] {
            let chunks = p.kv_chunks(&lens);
            let longest = chunks.iter().flatten().map(|r| r.len()).max().unwrap();
            // Cutting the count to a multiple of the cores may lengthen a few chunks a little.
            assert!(
                longest <= p.max_kv_chunk + p.max_kv_chunk / 8,
                "{lens:?}: {longest}"
            );
            for (c, len) in chunks.iter().zip(&lens) {
                assert_eq!(c.iter().map(|r| r.len()).sum::<usize>(), *len);
            }
        }
    }

    #[test]
    fn kv_split_ranges_cover_every_token_once_with_half_weight_trailing_chunks() {
        for chunks in 1..12 {
            for short in 0..=chunks + 1 {
                let split = KvSplit { chunks, short };
                for len in [0, 1, 2, 7, 128, 255, 1024, 1025, 4099] {
                    let r = split.ranges(len);
                    assert_eq!(r.len(), chunks);
                    assert_eq!(r[0].start, 0);
                    assert_eq!(r[chunks - 1].end, len, "{split:?} {len}");
                    for w in r.windows(2) {
                        assert_eq!(w[0].end, w[1].start, "{split:?} {len}");
                    }
                    // Past the last chunk: empty, at the end.
                    assert_eq!(split.range(len, chunks), len..len);
                    if len >= 4 * chunks && short < chunks {
                        let (l, s) = r.split_at(chunks - short);
                        for a in s {
                            for b in l {
                                assert!(a.len() * 2 <= b.len() + 2, "{split:?} {len}: {r:?}");
                                assert!(a.len() * 2 + 2 >= b.len(), "{split:?} {len}: {r:?}");
                            }
                        }
                    }
                }
            }
        }
        // With no short chunks, the rule is the plain even split.
        let even = KvSplit {
            chunks: 5,
            short: 0,
        };
        assert_eq!(
            even.ranges(1003),
            (0..5).map(|c| split_range(1003, 5, c)).collect::<Vec<_>>()
        );
    }

    #[test]
    fn the_first_sequence_ends_the_attention_phase_on_half_chunks() {
        let mut p = TilePolicy::for_cores(2);
        let lens =
            |s: &KvSplit, len: usize| s.ranges(len).iter().map(|r| r.len()).collect::<Vec<_>>();
        // 4 × 1024: two chunks of 512 a sequence, the first's two halved.
        let splits = p.kv_splits(&[1024; 4]);
        assert_eq!(lens(&splits[0], 1024), [256; 4]);
        assert!(splits[1..].iter().all(|s| *s
            == KvSplit {
                chunks: 2,
                short: 0
            }));
        // 16 × 1024: a chunk a sequence, the first cut into four chunks, two of them halved.
        let splits = p.kv_splits(&[1024; 16]);
        assert_eq!(lens(&splits[0], 1024), [256, 256, 128, 128, 128, 128]);
        assert!(splits[1..].iter().all(|s| s.chunks == 1));
        // Into two, both halved, where quarters of it would be shorter than the shortest chunk.
        let splits = p.kv_splits(&[800; 16]);
        assert_eq!(lens(&splits[0], 800), [200; 4]);
        // ... and not at all where halves would, or where the batch is no more chunks than
        // cores.
        let splits = p.kv_splits(&[400; 16]);
        assert!(splits.iter().all(|s| s.chunks == 1), "{splits:?}");
        let mut one = p;
        one.attn_tasks_per_core = 1;
        assert_eq!(
            one.kv_splits(&[1024; 2]),
            [KvSplit {
                chunks: 1,
                short: 0
            }; 2]
        );
        // With a cap, long chunks before the halves.
        p.max_kv_chunk = 256;
        assert_eq!(
            lens(&p.kv_splits(&[1024; 4])[0], 1024),
            [256, 256, 128, 128, 128, 128]
        );
        p.max_kv_chunk = usize::MAX;
        // Ragged batch: the count stays a multiple of the cores — or a first sequence of one
        // chunk was cut to end on halves — every token in one chunk.
        for cores in [2, 3, 4] {
            let p = TilePolicy::for_cores(cores);
            for lens in [
                vec![1024; 4],
                vec![3000, 10, 700],
                vec![5000, 1024],
                vec![700; 8],
                vec![900, 300, 800, 1000, 700, 600, 500, 1100, 1200, 400],
            ] {
                let splits = p.kv_splits(&lens);
                let n: usize = splits.iter().map(|s| s.chunks).sum();
                let halves_of_one = [2 * cores, 3 * cores]
                    .map(|chunks| KvSplit {
                        chunks,
                        short: 2 * cores,
                    })
                    .contains(&splits[0]);
                assert!(
                    n <= cores || n.is_multiple_of(cores) || halves_of_one,
                    "{cores} {lens:?}: {n}"
                );
                for (s, &len) in splits.iter().zip(&lens) {
                    let r = s.ranges(len);
                    assert_eq!(r.iter().map(|r| r.len()).sum::<usize>(), len);
                    assert!(
                        r[s.chunks - s.short..]
                            .iter()
                            .all(|r| r.len() >= p.min_kv_chunk),
                        "{r:?}"
                    );
                }
            }
        }
        // Batch 1 with a round of chunks or less, and short contexts: no halves.
        assert_eq!(
            p.kv_splits(&[257]),
            [KvSplit {
                chunks: 2,
                short: 0
            }]
        );
        assert_eq!(
            p.kv_splits(&[300; 4])
                .iter()
                .map(|s| s.short)
                .sum::<usize>(),
            0
        );
        assert_eq!(p.kv_splits(&[1024])[0].short, 0);
        assert_eq!(p.kv_splits(&[2048])[0].short, 4);
    }
}
