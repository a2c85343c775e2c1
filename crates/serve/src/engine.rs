//! The engine: requests in, tokens out, with continuous batching over one Qwen3 session.
//!
//! Every engine step is one runtime run over every scheduled sequence: prompt chunks and
//! decodes together (a decode is a one-token chunk), within a token budget. Running requests
//! are scheduled first, then waiting ones first-come-first-served while batch slots, budget and
//! KV blocks last. A prompt longer than the budget is prefilled in chunks. A prompt whose
//! leading full blocks are in the prefix cache starts after them. When a running request
//! needs a block and none is free, the most recently admitted request is preempted: its blocks
//! are released and it goes back to the front of the queue, to be recomputed from its prompt
//! and the tokens it had generated (recompute, not swap).
//!
//! A step with a prompt chunk runs the prefill path for all its rows (a decode is then a
//! one-token chunk); a step of decodes only runs the decode path (split-KV attention, the
//! norm's `1/rms` deferred past the projections). The two paths agree within the golden's
//! tolerance, so a sequence batched with prompt chunks can differ from the same sequence alone
//! only where two logits nearly tie; the tests' batches give exactly the tokens of each request
//! alone.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use simpler_core::{CallConfig, Worker};
use simpler_models::qwen3::golden::PrefillChunk;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{
    KvBuffers, PagedBatch, Qwen3RunError, Qwen3Weights, ResidentModel, Session,
};

use crate::kv_blocks::{Allocation, BlockManager};
use crate::sampler::{Sampler, SamplingParams};

/// How the engine is sized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most sequences in one step.
    pub max_batch_size: usize,
    /// Most tokens (prompt chunks and decodes) in one step.
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + generated); RoPE tables cover it.
    pub max_seq_len: usize,
    /// KV blocks of `PAGE_SIZE` tokens in the pool.
    pub num_blocks: usize,
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence id was generated (it is the last token).
    Eos,
    /// `max_new_tokens` were generated (or the sequence reached `max_seq_len`).
    Length,
}

/// What one request asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate (capped to what fits in `max_seq_len`).
    pub max_new_tokens: usize,
    /// Sampling; greedy by default.
    pub sampling: SamplingParams,
    /// Keep going past end-of-sequence ids.
    pub ignore_eos: bool,
}

/// What a request produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// Generated token ids (an EOS included when it ended the request).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Prompt tokens found in the prefix cache at admission (not computed again).
    pub cached_tokens: usize,
    /// From the call's start to the first generated token (time to first token).
    pub ttft: Duration,
    /// From the call's start to the last token.
    pub finished: Duration,
}

/// Counters of the engine since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Runtime steps run.
    pub steps: u64,
    /// Tokens computed (prompt chunks and decodes).
    pub computed_tokens: u64,
    /// Prompt tokens served from the prefix cache instead.
    pub cached_tokens: u64,
    /// Requests preempted for lack of KV blocks.
    pub preemptions: u64,
    /// Most sequences in one step.
    pub max_batch: usize,
}

/// Why the engine refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A request cannot be served as asked.
    #[error("request {index}: {why}")]
    BadRequest {
        /// Its index in the submitted list.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// The configuration cannot run.
    #[error("engine configuration: {0}")]
    Config(String),
    /// A runtime step failed.
    #[error(transparent)]
    Run(#[from] Qwen3RunError),
}

/// One request in flight.
struct Seq {
    index: usize,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_len: usize,
    sampler: Sampler,
    greedy: bool,
    ignore_eos: bool,
    alloc: Option<Allocation>,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    cached_tokens: usize,
    first_token: Option<Duration>,
}

/// The engine.
pub struct Engine {
    worker: Worker,
    session: Session,
    blocks: BlockManager,
    eos: Vec<u32>,
    cfg: EngineConfig,
    call: CallConfig,
    vocab: usize,
    stats: EngineStats,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats)
            .finish()
    }
}

impl Engine {
    /// An engine over `weights` on `worker` (its kernels registered by the caller), stopping at
    /// `eos` ids.
    pub fn new(
        worker: Worker,
        weights: &Qwen3Weights,
        eos: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Engine, EngineError> {
        if cfg.max_batch_size == 0 || cfg.max_num_batched_tokens == 0 || cfg.num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "max_batch_size {}, max_num_batched_tokens {} and num_blocks {} must be positive",
                cfg.max_batch_size, cfg.max_num_batched_tokens, cfg.num_blocks
            )));
        }
        let c = &weights.config;
        if cfg.max_seq_len == 0 || cfg.max_seq_len > c.max_position_embeddings {
            return Err(EngineError::Config(format!(
                "max_seq_len {} must be in 1..={} (max_position_embeddings)",
                cfg.max_seq_len, c.max_position_embeddings
            )));
        }
        let max_seq = cfg.max_seq_len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let model = Arc::new(ResidentModel::upload(&worker, weights, max_seq, None)?);
        let kv = KvBuffers::new(&worker, c, cfg.num_blocks, PAGE_SIZE)?;
        let session = Session::new(&worker, model, kv);
        Ok(Engine {
            worker,
            session,
            blocks: BlockManager::new(cfg.num_blocks, PAGE_SIZE),
            eos,
            cfg,
            call: CallConfig::default(),
            vocab: c.vocab_size,
            stats: EngineStats::default(),
        })
    }

    /// How the engine is sized.
    pub fn config(&self) -> EngineConfig {
        self.cfg
    }

    /// The model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Counters since the engine was made.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Free KV blocks now (all of them between calls).
    pub fn free_blocks(&self) -> usize {
        self.blocks.free()
    }

    /// Serves `requests` together with continuous batching; completions in request order.
    /// Every request is checked before any runs.
    pub fn generate(&mut self, requests: &[Request]) -> Result<Vec<Completion>, EngineError> {
        let mut waiting: VecDeque<Seq> = VecDeque::new();
        for (index, r) in requests.iter().enumerate() {
            let bad = |why: String| EngineError::BadRequest { index, why };
            if r.prompt.is_empty() {
                return Err(bad("the prompt is empty".into()));
            }
            if r.prompt.len() >= self.cfg.max_seq_len {
                return Err(bad(format!(
                    "a prompt of {} tokens leaves no room in max_seq_len {}",
                    r.prompt.len(),
                    self.cfg.max_seq_len
                )));
            }
            if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= self.vocab) {
                return Err(bad(format!(
                    "token {t} is outside the vocabulary of {}",
                    self.vocab
                )));
            }
            if r.max_new_tokens == 0 {
                return Err(bad("max_new_tokens must be at least 1".into()));
            }
            r.sampling
                .validate()
                .map_err(|(name, why)| bad(format!("{name} {why}")))?;
            let blocks_needed = r.prompt.len().div_ceil(PAGE_SIZE);
            if blocks_needed > self.cfg.num_blocks {
                return Err(bad(format!(
                    "a prompt of {} tokens needs {blocks_needed} KV blocks, the pool has {}",
                    r.prompt.len(),
                    self.cfg.num_blocks
                )));
            }
            waiting.push_back(Seq {
                index,
                tokens: r.prompt.clone(),
                prompt_len: r.prompt.len(),
                max_len: (r.prompt.len() + r.max_new_tokens).min(self.cfg.max_seq_len),
                sampler: Sampler::new(r.sampling),
                greedy: r.sampling.temperature == 0.0,
                ignore_eos: r.ignore_eos,
                alloc: None,
                computed: 0,
                cached_tokens: 0,
                first_token: None,
            });
        }
        let mut done: Vec<Option<Completion>> = vec![None; requests.len()];
        let mut running: Vec<Seq> = Vec::new();
        let start = Instant::now();
        let result = (|| -> Result<(), EngineError> {
            while !waiting.is_empty() || !running.is_empty() {
                self.step(&mut waiting, &mut running, &mut done, start)?;
            }
            Ok(())
        })();
        // Whatever happened, every block goes back.
        for s in running.iter_mut().chain(waiting.iter_mut()) {
            if let Some(a) = s.alloc.take() {
                self.blocks.release(a);
            }
        }
        result?;
        Ok(done.into_iter().flatten().collect())
    }

    /// Preempts the most recently admitted running request (to the front of `waiting`).
    fn preempt_newest(&mut self, running: &mut Vec<Seq>, waiting: &mut VecDeque<Seq>) {
        if let Some(mut s) = running.pop() {
            if let Some(a) = s.alloc.take() {
                self.blocks.release(a);
            }
            s.computed = 0;
            self.stats.preemptions += 1;
            waiting.push_front(s);
        }
    }

    fn step(
        &mut self,
        waiting: &mut VecDeque<Seq>,
        running: &mut Vec<Seq>,
        done: &mut [Option<Completion>],
        start: Instant,
    ) -> Result<(), EngineError> {
        let mut budget = self.cfg.max_num_batched_tokens;
        // (index into running, chunk length) of this step.
        let mut plan: Vec<(usize, usize)> = Vec::new();
        // Running requests first, oldest first; grow their blocks, preempting the newest.
        let mut i = 0;
        while i < running.len() && budget > 0 {
            let s = &running[i];
            let n = (s.tokens.len() - s.computed).min(budget);
            let need = s.computed + n;
            let grown = match running[i].alloc.as_mut() {
                Some(a) => self.blocks.grow(a, need).is_ok(),
                None => false,
            };
            if !grown {
                if i + 1 == running.len() {
                    // This is the newest: it waits, recomputed later.
                    self.preempt_newest(running, waiting);
                    break;
                }
                self.preempt_newest(running, waiting);
                continue;
            }
            plan.push((i, n));
            budget -= n;
            i += 1;
        }
        // Then waiting requests, first come first served.
        while budget > 0 && running.len() < self.cfg.max_batch_size {
            let Some(front) = waiting.front() else { break };
            let Ok(alloc) = self.blocks.allocate(&front.tokens, front.tokens.len()) else {
                break;
            };
            let mut s = waiting.pop_front().unwrap_or_else(|| unreachable!());
            s.computed = alloc.cached_tokens;
            if s.cached_tokens == 0 {
                s.cached_tokens = alloc.cached_tokens;
            }
            self.stats.cached_tokens += alloc.cached_tokens as u64;
            s.alloc = Some(alloc);
            let n = (s.tokens.len() - s.computed).min(budget);
            running.push(s);
            plan.push((running.len() - 1, n));
            budget -= n;
        }
        if plan.is_empty() {
            return Err(EngineError::Config(format!(
                "no request fits: {} waiting, {} KV blocks free of {}",
                waiting.len(),
                self.blocks.free(),
                self.blocks.total()
            )));
        }
        // One run over every scheduled chunk.
        let max_blocks = plan
            .iter()
            .filter_map(|&(i, _)| running[i].alloc.as_ref().map(|a| a.blocks.len()))
            .max()
            .unwrap_or(1);
        let mut table = Vec::with_capacity(plan.len() * max_blocks);
        let mut seq_lens = Vec::with_capacity(plan.len());
        let mut chunks = Vec::with_capacity(plan.len());
        for (row, &(i, n)) in plan.iter().enumerate() {
            let s = &running[i];
            let blocks = s.alloc.as_ref().map_or(&[][..], |a| &a.blocks[..]);
            table.extend(blocks.iter().map(|b| b.0));
            table.extend(std::iter::repeat_n(0, max_blocks - blocks.len()));
            seq_lens.push(s.computed + n);
            chunks.push(PrefillChunk {
                seq: row,
                tokens: s.tokens[s.computed..s.computed + n].to_vec(),
                seq_len: s.computed + n,
            });
        }
        let batch = PagedBatch {
            page_size: PAGE_SIZE,
            max_blocks,
            block_table: table,
            seq_lens,
        };
        self.session.read_logits = plan.iter().any(|&(i, _)| !running[i].greedy);
        // A step of decodes only takes the decode path (split-KV attention, the norm's 1/rms
        // deferred past the projections); anything with a prompt chunk takes the prefill path.
        let all_decodes = chunks.iter().all(|c| c.tokens.len() == 1)
            && plan.iter().all(|&(i, n)| {
                running[i].computed + n == running[i].tokens.len() && running[i].computed > 0
            });
        let out = if all_decodes {
            let last: Vec<u32> = chunks.iter().map(|c| c.tokens[0]).collect();
            self.session
                .decode(&self.worker, &batch, &last, &self.call)?
        } else {
            self.session
                .prefill(&self.worker, &batch, &chunks, &self.call)?
        };
        self.stats.steps += 1;
        self.stats.max_batch = self.stats.max_batch.max(plan.len());
        let now = start.elapsed();
        // Advance; sample where a chunk reached the end of the known tokens.
        let mut finished = Vec::new();
        for (row, &(i, n)) in plan.iter().enumerate() {
            self.stats.computed_tokens += n as u64;
            let s = &mut running[i];
            s.computed += n;
            if let Some(a) = &s.alloc {
                self.blocks.commit(a, &s.tokens[..s.computed]);
            }
            if s.computed < s.tokens.len() {
                continue;
            }
            let next = if s.greedy {
                out.next_tokens[row]
            } else {
                let logits = &out.logits[row * self.vocab..(row + 1) * self.vocab];
                s.sampler.sample(logits).unwrap_or(out.next_tokens[row])
            };
            s.tokens.push(next);
            s.first_token.get_or_insert(now);
            let eos = !s.ignore_eos && self.eos.contains(&next);
            if eos || s.tokens.len() >= s.max_len {
                finished.push((
                    i,
                    if eos {
                        FinishReason::Eos
                    } else {
                        FinishReason::Length
                    },
                ));
            }
        }
        // Remove finished requests (highest index first keeps the others' indices).
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason) in finished {
            let mut s = running.remove(i);
            if let Some(a) = s.alloc.take() {
                self.blocks.release(a);
            }
            done[s.index] = Some(Completion {
                tokens: s.tokens[s.prompt_len..].to_vec(),
                finish_reason: reason,
                cached_tokens: s.cached_tokens,
                ttft: s.first_token.unwrap_or(now),
                finished: now,
            });
        }
        Ok(())
    }
}
