//! The KV cache's block manager: paged blocks of `block_size` tokens with reference counts, a
//! least-recently-freed list of free blocks, and prefix caching: every full block is known by
//! a chained hash of its parent's hash and its tokens, so a new sequence whose prompt starts
//! with cached blocks shares them instead of computing them again. A free block keeps its
//! contents (and its place in the cache) until it is taken for something else, oldest first.
//!
//! Invariants, checked by `check` in the tests after every operation:
//! - a block is on the free list exactly when its reference count is 0;
//! - the cache maps a hash to a block whose recorded hash and tokens are that block's;
//! - every block is free, or referenced by the sequences that hold it (counted once each).

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash, Hasher};

/// A block of the KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// Not enough free blocks.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("out of KV blocks: {needed} needed, {free} free of {total}")]
pub struct OutOfBlocks {
    /// Blocks the request needs.
    pub needed: usize,
    /// Blocks free now.
    pub free: usize,
    /// Blocks in the pool.
    pub total: usize,
}

const NONE: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Block {
    refs: u32,
    /// Times the block was taken fresh (its K/V rewritten for another sequence): a cached
    /// block records its parent's generation, so it cannot pass for the child of whatever
    /// the parent's storage holds later.
    generation: u64,
    /// Set when the block is full and registered in the cache.
    cached: Option<Cached>,
    /// Free-list links (`NONE` at the ends / when not free).
    prev: u32,
    next: u32,
}

/// What a cached block holds: its chained hash, the block it was computed after (`NONE` for
/// a first block) at that block's generation, and its tokens. A hit needs all of them to
/// match, so a hash collision can never hand out K/V computed after other tokens: the tokens
/// are compared and the parent is the very block the previous hit returned, holding the same
/// K/V as when this block was computed after it (by induction, the whole prefix is equal).
#[derive(Clone, Debug)]
struct Cached {
    hash: u64,
    parent: u32,
    parent_generation: u64,
    tokens: Vec<u32>,
}

/// The blocks of one sequence and how many of its first tokens came from the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Block table of the sequence, in order.
    pub blocks: Vec<BlockId>,
    /// Leading tokens whose K/V are already in the blocks (a multiple of the block size).
    pub cached_tokens: usize,
}

/// Counters of the prefix cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Full prompt blocks looked up.
    pub queried_blocks: u64,
    /// Of those, found in the cache.
    pub hit_blocks: u64,
}

/// The manager.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    blocks: Vec<Block>,
    /// Least recently freed first.
    free_head: u32,
    free_tail: u32,
    free_len: usize,
    cache: HashMap<u64, u32>,
    stats: CacheStats,
    /// Keys of the chained hash, random per manager: a collision cannot be prepared offline.
    keys: RandomState,
    /// Tests: leave the parent out of the hash, so that equal blocks after different parents
    /// collide (what the parent check must catch).
    #[cfg(test)]
    collide_parents: bool,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks of `block_size` tokens, all free.
    ///
    /// # Panics
    /// If `block_size` is 0 or `num_blocks` does not fit `u32`.
    pub fn new(num_blocks: usize, block_size: usize) -> BlockManager {
        assert!(block_size > 0, "block size 0");
        let n = u32::try_from(num_blocks).expect("block count fits u32");
        assert!(n < NONE, "block count fits u32");
        let blocks = (0..n)
            .map(|i| Block {
                refs: 0,
                generation: 0,
                cached: None,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
            })
            .collect();
        BlockManager {
            block_size,
            blocks,
            free_head: if n == 0 { NONE } else { 0 },
            free_tail: if n == 0 { NONE } else { n - 1 },
            free_len: num_blocks,
            cache: HashMap::new(),
            stats: CacheStats::default(),
            keys: RandomState::new(),
            #[cfg(test)]
            collide_parents: false,
        }
    }

    /// The chained hash of a full block: its parent's hash and its tokens.
    fn block_hash(&self, parent: Option<u64>, tokens: &[u32]) -> u64 {
        let mut h = self.keys.build_hasher();
        #[cfg(test)]
        let parent = if self.collide_parents { None } else { parent };
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.blocks.len()
    }
    /// Free blocks (cached or not).
    pub fn free(&self) -> usize {
        self.free_len
    }
    /// The prefix cache's counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.blocks[i as usize].prev, self.blocks[i as usize].next);
        if p == NONE {
            self.free_head = n;
        } else {
            self.blocks[p as usize].next = n;
        }
        if n == NONE {
            self.free_tail = p;
        } else {
            self.blocks[n as usize].prev = p;
        }
        self.blocks[i as usize].prev = NONE;
        self.blocks[i as usize].next = NONE;
        self.free_len -= 1;
    }

    fn push_free(&mut self, i: u32) {
        let b = &mut self.blocks[i as usize];
        b.prev = self.free_tail;
        b.next = NONE;
        if self.free_tail == NONE {
            self.free_head = i;
        } else {
            self.blocks[self.free_tail as usize].next = i;
        }
        self.free_tail = i;
        self.free_len += 1;
    }

    /// Takes a reference on block `i` (off the free list if it was free).
    fn retain(&mut self, i: u32) {
        if self.blocks[i as usize].refs == 0 {
            self.unlink(i);
        }
        self.blocks[i as usize].refs += 1;
    }

    /// The least recently freed block, its cache entry dropped.
    fn take_fresh(&mut self) -> Option<u32> {
        let i = self.free_head;
        if i == NONE {
            return None;
        }
        self.unlink(i);
        self.blocks[i as usize].generation += 1;
        if let Some(c) = self.blocks[i as usize].cached.take()
            && self.cache.get(&c.hash) == Some(&i)
        {
            self.cache.remove(&c.hash);
        }
        self.blocks[i as usize].refs = 1;
        Some(i)
    }

    /// Blocks for a new sequence of `prompt` that will grow to `total_tokens`: its longest
    /// cached prefix of full blocks is shared (always leaving at least one prompt token to
    /// compute), the rest are fresh blocks. Nothing changes on failure.
    pub fn allocate(
        &mut self,
        prompt: &[u32],
        total_tokens: usize,
    ) -> Result<Allocation, OutOfBlocks> {
        let bs = self.block_size;
        let total_tokens = total_tokens.max(prompt.len()).max(1);
        let needed = total_tokens.div_ceil(bs);
        // Cached full blocks of the prompt, leaving its last token to compute.
        let mut hits: Vec<u32> = Vec::new();
        let mut parent = None;
        let full = prompt.len().saturating_sub(1) / bs;
        for chunk in prompt.chunks_exact(bs).take(full) {
            let h = self.block_hash(parent, chunk);
            let parent_block = hits.last().copied().unwrap_or(NONE);
            match self.cache.get(&h) {
                Some(&i)
                    if self.blocks[i as usize].cached.as_ref().is_some_and(|c| {
                        c.hash == h
                            && c.parent == parent_block
                            && c.parent_generation == self.generation_of(parent_block)
                            && c.tokens == chunk
                    }) =>
                {
                    hits.push(i);
                }
                _ => break,
            }
            parent = Some(h);
        }
        // Free blocks the hits would take off the free list count against the fresh ones.
        let hits_free = hits
            .iter()
            .filter(|&&i| self.blocks[i as usize].refs == 0)
            .count();
        let fresh = needed - hits.len();
        if fresh + hits_free > self.free_len {
            return Err(OutOfBlocks {
                needed: fresh + hits_free,
                free: self.free_len,
                total: self.total(),
            });
        }
        self.stats.queried_blocks += full as u64;
        self.stats.hit_blocks += hits.len() as u64;
        for &i in &hits {
            self.retain(i);
        }
        let mut blocks: Vec<BlockId> = hits.iter().map(|&i| BlockId(i)).collect();
        for _ in 0..fresh {
            // Counted above: a free block exists for each.
            if let Some(i) = self.take_fresh() {
                blocks.push(BlockId(i));
            }
        }
        Ok(Allocation {
            cached_tokens: hits.len() * bs,
            blocks,
        })
    }

    /// Grows `a` to hold `total_tokens`. Nothing changes on failure.
    pub fn grow(&mut self, a: &mut Allocation, total_tokens: usize) -> Result<(), OutOfBlocks> {
        let needed = total_tokens.div_ceil(self.block_size);
        let more = needed.saturating_sub(a.blocks.len());
        if more > self.free_len {
            return Err(OutOfBlocks {
                needed: more,
                free: self.free_len,
                total: self.total(),
            });
        }
        for _ in 0..more {
            if let Some(i) = self.take_fresh() {
                a.blocks.push(BlockId(i));
            }
        }
        Ok(())
    }

    /// Registers the full blocks of a sequence whose first `tokens.len()` tokens are computed
    /// (K/V written), so later prompts can share them.
    ///
    /// Each block is recorded after the block a lookup of its prefix returns, so lookups
    /// reach the whole chain: where a block registered under the same hash is what a lookup
    /// of this prefix accepts (its tokens, and its parent the previous block here at that
    /// block's generation: sequences that computed the same blocks side by side), it serves
    /// and this sequence's copy stays unregistered; where the registered block is one no
    /// lookup of this prefix can reach (its parent since taken for other tokens, or other
    /// tokens under a colliding hash), this sequence's block replaces it.
    pub fn commit(&mut self, a: &Allocation, tokens: &[u32]) {
        let bs = self.block_size;
        let mut parent = None;
        let mut parent_block = NONE;
        for (chunk, &BlockId(i)) in tokens.chunks_exact(bs).zip(&a.blocks) {
            let h = self.block_hash(parent, chunk);
            parent = Some(h);
            let parent_generation = self.generation_of(parent_block);
            let registered = self.cache.get(&h).copied();
            if let Some(j) = registered
                && self.blocks[j as usize].cached.as_ref().is_some_and(|c| {
                    c.parent == parent_block
                        && c.parent_generation == parent_generation
                        && c.tokens == chunk
                })
            {
                parent_block = j;
                continue;
            }
            if let Some(j) = registered {
                self.blocks[j as usize].cached = None;
            }
            if let Some(old) = self.blocks[i as usize].cached.take()
                && self.cache.get(&old.hash) == Some(&i)
            {
                self.cache.remove(&old.hash);
            }
            self.blocks[i as usize].cached = Some(Cached {
                hash: h,
                parent: parent_block,
                parent_generation,
                tokens: chunk.to_vec(),
            });
            self.cache.insert(h, i);
            parent_block = i;
        }
    }

    /// The generation of block `i`, 0 for `NONE` (no parent).
    fn generation_of(&self, i: u32) -> u64 {
        if i == NONE {
            0
        } else {
            self.blocks[i as usize].generation
        }
    }

    /// Drops a sequence's references; blocks that reach 0 become free (most recently freed
    /// last), keeping their cache entries until taken. The tail blocks go first into the list,
    /// so a prompt's shared head outlives its private tail.
    pub fn release(&mut self, a: Allocation) {
        for &BlockId(i) in a.blocks.iter().rev() {
            let b = &mut self.blocks[i as usize];
            debug_assert!(b.refs > 0, "block {i} released more often than taken");
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                self.push_free(i);
            }
        }
    }

    /// Checks every invariant against the sequences that hold blocks now (tests).
    pub fn check(&self, held: &[&Allocation]) -> Result<(), String> {
        let mut refs = vec![0u32; self.blocks.len()];
        for a in held {
            for &BlockId(i) in &a.blocks {
                refs[i as usize] += 1;
            }
        }
        let mut on_list = vec![false; self.blocks.len()];
        let (mut i, mut n, mut prev) = (self.free_head, 0, NONE);
        while i != NONE {
            if on_list[i as usize] {
                return Err(format!("free list cycles at {i}"));
            }
            on_list[i as usize] = true;
            if self.blocks[i as usize].prev != prev {
                return Err(format!("free list back link of {i}"));
            }
            prev = i;
            i = self.blocks[i as usize].next;
            n += 1;
        }
        if n != self.free_len || prev != self.free_tail {
            return Err(format!("free list of {n} vs {} counted", self.free_len));
        }
        for (i, b) in self.blocks.iter().enumerate() {
            if b.refs != refs[i] {
                return Err(format!("block {i}: {} refs, {} holders", b.refs, refs[i]));
            }
            if (b.refs == 0) != on_list[i] {
                return Err(format!(
                    "block {i}: refs {} but on the free list: {}",
                    b.refs, on_list[i]
                ));
            }
        }
        for (&h, &i) in &self.cache {
            if self.blocks[i as usize].cached.as_ref().map(|c| c.hash) != Some(h) {
                return Err(format!(
                    "cache entry {h:x} points at block {i} of another hash"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_shared_prefix_reuses_blocks_and_leaves_one_token_to_compute() {
        let mut m = BlockManager::new(8, 4);
        let p1: Vec<u32> = (0..10).collect();
        let a = m.allocate(&p1, 12).unwrap();
        assert_eq!((a.blocks.len(), a.cached_tokens), (3, 0));
        m.commit(&a, &p1);
        // Same first 8 tokens: two blocks shared.
        let p2: Vec<u32> = (0..8).chain([99, 98, 97]).collect();
        let b = m.allocate(&p2, 11).unwrap();
        assert_eq!(b.cached_tokens, 8);
        assert_eq!(&b.blocks[..2], &a.blocks[..2]);
        assert_ne!(b.blocks[2], a.blocks[2]);
        // Exactly the cached 8 tokens as a prompt: the last block is recomputed.
        let p3: Vec<u32> = (0..8).collect();
        let c = m.allocate(&p3, 8).unwrap();
        assert_eq!(c.cached_tokens, 4);
        m.check(&[&a, &b, &c]).unwrap();
        let s = m.stats();
        assert_eq!((s.queried_blocks, s.hit_blocks), (2 + 2 + 1, 2 + 1));
        // Released blocks stay cached until taken: a new request still hits.
        m.release(a);
        m.release(b);
        m.release(c);
        assert_eq!(m.free(), 8);
        let d = m.allocate(&p1, 10).unwrap();
        assert_eq!(d.cached_tokens, 8);
        m.check(&[&d]).unwrap();
    }

    #[test]
    fn a_hash_collision_never_hands_out_a_block_computed_after_other_tokens() {
        // Blocks of 2 tokens; the hash ignores the parent, so [9, 9] after [5, 6] and after
        // [1, 2] collide. Only the parent check keeps the victim from taking the attacker's
        // second block.
        let mut m = BlockManager::new(16, 2);
        m.collide_parents = true;
        let public = [1, 2, 3, 3, 7];
        let a = m.allocate(&public, 5).unwrap();
        m.commit(&a, &public[..4]);
        let attacker = [5, 6, 9, 9, 7];
        let b = m.allocate(&attacker, 5).unwrap();
        m.commit(&b, &attacker[..4]);
        // The victim's first block is the public one; its second is the attacker's tokens
        // under the attacker's hash, but computed after [5, 6]: it must not be shared.
        let victim = [1, 2, 9, 9, 7];
        let c = m.allocate(&victim, 5).unwrap();
        assert_eq!(c.cached_tokens, 2, "only the public first block is shared");
        assert_eq!(c.blocks[0], a.blocks[0]);
        assert_ne!(c.blocks[1], b.blocks[1]);
        m.check(&[&a, &b, &c]).unwrap();
        // The attacker's own prompt still hits both of its blocks.
        let d = m.allocate(&attacker, 5).unwrap();
        assert_eq!(d.cached_tokens, 4);
        assert_eq!(&d.blocks[..2], &b.blocks[..2]);
    }

    #[test]
    fn running_out_changes_nothing_and_eviction_takes_the_oldest_free_block() {
        let mut m = BlockManager::new(6, 2);
        let a = m.allocate(&[1, 2, 3, 4, 5], 5).unwrap();
        assert_eq!(a.blocks, vec![BlockId(0), BlockId(1), BlockId(2)]);
        m.commit(&a, &[1, 2, 3, 4]);
        let e = m.allocate(&[7; 7], 8).unwrap_err();
        assert_eq!((e.needed, e.free, e.total), (4, 3, 6));
        m.check(&[&a]).unwrap();
        // Released tail first: the free list is now 3, 4, 5, 2, 1, 0 (oldest first).
        m.release(a);
        let b = m.allocate(&[9; 6], 6).unwrap();
        let b2 = m.allocate(&[8, 8], 2).unwrap();
        // Takes block 1, evicting the cached [3, 4]; block 0 ([1, 2]) is still cached.
        let b3 = m.allocate(&[6, 6], 2).unwrap();
        assert_eq!((b2.blocks[0], b3.blocks[0]), (BlockId(2), BlockId(1)));
        m.release(b);
        let c = m.allocate(&[1, 2, 3, 4, 5], 5).unwrap();
        assert_eq!(c.cached_tokens, 2, "[1, 2] survived, [3, 4] was evicted");
        assert_eq!(c.blocks[0], BlockId(0));
        m.check(&[&b2, &b3, &c]).unwrap();
    }

    #[test]
    fn blocks_computed_side_by_side_chain_through_the_block_lookups_return() {
        // A and B compute the same first block in one step; A's copy is registered, so B's
        // second block must be recorded after A's copy, or no lookup could reach it (and its
        // hash, held by the unreachable entry, could never be registered again).
        let mut m = BlockManager::new(16, 4);
        let pa: Vec<u32> = (0..4).chain([100]).collect();
        let pb: Vec<u32> = (0..8).chain([200]).collect();
        let a = m.allocate(&pa, 6).unwrap();
        let b = m.allocate(&pb, 10).unwrap();
        assert_eq!((a.cached_tokens, b.cached_tokens), (0, 0));
        m.commit(&a, &pa);
        m.commit(&b, &pb);
        m.release(a);
        m.release(b);
        for t in 300..303 {
            let p: Vec<u32> = (0..8).chain([t]).collect();
            let c = m.allocate(&p, 10).unwrap();
            assert_eq!(c.cached_tokens, 8, "both full blocks of [0, 8) are found");
            m.commit(&c, &p);
            m.release(c);
        }
        m.check(&[]).unwrap();
    }

    #[test]
    fn a_block_is_not_found_after_its_parents_storage_is_reused() {
        // Blocks of 2; the hash ignores the parent, so only the parent check stands between a
        // lookup and a block computed after other tokens. [3, 4] is computed after [1, 2] in
        // block 0; block 0 is then taken for [8, 9]. A lookup of [8, 9, 3, 4] returns block 0
        // for [8, 9], and block 1 names block 0 as its parent, but block 0 no longer holds
        // what block 1 was computed after.
        let mut m = BlockManager::new(5, 2);
        m.collide_parents = true;
        let a = m.allocate(&[1, 2, 3, 4, 5], 5).unwrap();
        assert_eq!(a.blocks, vec![BlockId(0), BlockId(1), BlockId(2)]);
        m.commit(&a, &[1, 2, 3, 4]);
        m.release(a);
        // Free list 3, 4, 2, 1, 0; move block 1 to the end so block 0 is taken first.
        m.retain(1);
        m.release(Allocation {
            blocks: vec![BlockId(1)],
            cached_tokens: 0,
        });
        let other = m.allocate(&[50, 51, 52, 53, 54], 5).unwrap();
        assert_eq!(other.blocks, vec![BlockId(3), BlockId(4), BlockId(2)]);
        let x = m.allocate(&[8, 9], 2).unwrap();
        assert_eq!(x.blocks, vec![BlockId(0)]);
        m.commit(&x, &[8, 9]);
        m.release(other);
        m.release(x);
        let y = m.allocate(&[8, 9, 3, 4, 5], 5).unwrap();
        assert_eq!(y.cached_tokens, 2, "only [8, 9] is shared");
        assert_eq!(y.blocks[0], BlockId(0));
        m.check(&[&y]).unwrap();
    }

    #[test]
    fn a_chain_stays_reachable_after_the_block_it_was_recorded_after_is_taken() {
        // A and B compute [1, 2] and [3, 4] side by side; A's copies are registered and B's
        // [5, 6] is recorded after A's [3, 4]. A ends and its blocks are taken for other
        // tokens; B commits again (as every step does): its own copies take the place of the
        // unreachable entries, and a later prompt finds all three blocks.
        let mut m = BlockManager::new(7, 2);
        let pa = [1, 2, 3, 4, 9];
        let pb = [1, 2, 3, 4, 5, 6, 10];
        let a = m.allocate(&pa, 5).unwrap();
        let b = m.allocate(&pb, 7).unwrap();
        m.commit(&a, &pa[..4]);
        m.commit(&b, &pb[..6]);
        m.release(a);
        let other = m.allocate(&[7, 7, 7, 7, 7, 7], 6).unwrap();
        assert_eq!(m.free(), 0, "A's blocks were taken");
        m.commit(&b, &pb[..6]);
        m.release(other);
        let c = m.allocate(&[1, 2, 3, 4, 5, 6, 11], 7).unwrap();
        assert_eq!(c.cached_tokens, 6);
        assert_eq!(&c.blocks[..3], &b.blocks[..3]);
        m.check(&[&b, &c]).unwrap();
    }

    #[test]
    fn a_colliding_block_does_not_serve_another_prefix() {
        // The hash ignores the parent: B's [3, 4] (after [5, 6]) collides with A's (after
        // [1, 2]). B's [7, 8] must not be recorded after A's block, or a prompt [1, 2, 3, 4,
        // 7, 8] would take K/V computed after [5, 6, 3, 4].
        let mut m = BlockManager::new(16, 2);
        m.collide_parents = true;
        let a = m.allocate(&[1, 2, 3, 4, 0], 5).unwrap();
        m.commit(&a, &[1, 2, 3, 4]);
        let pb = [5, 6, 3, 4, 7, 8, 0];
        let b = m.allocate(&pb, 7).unwrap();
        m.commit(&b, &pb[..6]);
        let c = m.allocate(&[1, 2, 3, 4, 7, 8, 9], 7).unwrap();
        assert!(c.cached_tokens <= 4, "{}", c.cached_tokens);
        assert_ne!(c.blocks[2], b.blocks[2]);
        m.check(&[&a, &b, &c]).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// Random admissions, growth, commits and releases keep every invariant; every hit
        /// holds K/V written after exactly the prompt's tokens up to it (a shadow of what each
        /// block was computed after), also where the hash ignores the parent; without such
        /// collisions a prompt identical to a committed one gets its full blocks back;
        /// releasing everything frees every block.
        #[test]
        fn random_operations_keep_the_invariants(
            ops in proptest::collection::vec((0u8..4, 0usize..6, 1usize..20), 1..60),
            collide in any::<bool>(),
        ) {
            let mut m = BlockManager::new(24, 4);
            m.collide_parents = collide;
            // Per block: the tokens up to and including it that its K/V were computed after.
            let mut written: Vec<Option<Vec<u32>>> = vec![None; 24];
            let hits_hold = |written: &[Option<Vec<u32>>], a: &Allocation, prompt: &[u32]| {
                a.blocks[..a.cached_tokens / 4].iter().enumerate().all(|(k, b)| {
                    written[b.0 as usize].as_deref() == Some(&prompt[..(k + 1) * 4])
                })
            };
            let mut held: Vec<(Allocation, Vec<u32>)> = Vec::new();
            for (op, pick, len) in ops {
                match op {
                    0 => {
                        // Prompts drawn from a few shared prefixes.
                        let prompt: Vec<u32> = (0..len as u32).map(|t| t + 100 * (pick as u32 % 3)).collect();
                        if let Ok(a) = m.allocate(&prompt, len + 3) {
                            prop_assert!(a.cached_tokens < prompt.len().max(1));
                            prop_assert_eq!(a.cached_tokens % 4, 0);
                            prop_assert!(hits_hold(&written, &a, &prompt));
                            held.push((a, prompt));
                        }
                    }
                    1 if !held.is_empty() => {
                        let i = pick % held.len();
                        let (a, p) = &mut held[i];
                        let grown = p.len() + len;
                        if m.grow(a, grown + 3).is_ok() {
                            p.extend((0..len as u32).map(|t| 1000 + t));
                        }
                    }
                    2 if !held.is_empty() => {
                        let i = pick % held.len();
                        let (a, p) = &held[i];
                        m.commit(a, p);
                        for (k, b) in a.blocks.iter().take(p.len() / 4).enumerate() {
                            written[b.0 as usize] = Some(p[..(k + 1) * 4].to_vec());
                        }
                        // Every full block of what was just committed is found again, whoever
                        // computed it first (sequences of one prefix side by side); where the
                        // hash ignores parents, a prompt's own repeated blocks may take each
                        // other's place.
                        let mut again = p.clone();
                        again.push(7);
                        if let Ok(b) = m.allocate(&again, again.len()) {
                            prop_assert!(hits_hold(&written, &b, &again));
                            if !collide {
                                prop_assert_eq!(b.cached_tokens, p.len() / 4 * 4);
                            }
                            m.release(b);
                        }
                    }
                    3 if !held.is_empty() => {
                        let i = pick % held.len();
                        let (a, _) = held.swap_remove(i);
                        m.release(a);
                    }
                    _ => {}
                }
                let refs: Vec<&Allocation> = held.iter().map(|h| &h.0).collect();
                prop_assert_eq!(m.check(&refs), Ok(()));
            }
            for (a, _) in held.drain(..) {
                m.release(a);
            }
            prop_assert_eq!(m.free(), m.total());
            prop_assert_eq!(m.check(&[]), Ok(()));
        }
    }
}
