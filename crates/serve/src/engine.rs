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

use simpler_core::{CallConfig, RunReport, Worker};
use simpler_models::qwen3::golden::PrefillChunk;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{
    KvBuffers, PagedBatch, Qwen3RunError, Qwen3Weights, ResidentModel, Session, WeightFormat,
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
    /// Most tokens one prompt's chunk takes of a step (`None`: as many as the budget leaves),
    /// so that one long prompt does not take a whole step from the decodes beside it.
    pub long_prefill_threshold: Option<usize>,
    /// How the projections and the LM head are held: bf16 as loaded, or int8 quantised at
    /// upload (`WeightFormat`).
    pub weights: WeightFormat,
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence id was generated (it is the last token).
    Eos,
    /// `max_new_tokens` were generated (or the sequence reached `max_seq_len`).
    Length,
    /// The caller ended it ([`Engine::stop`]; a stop string).
    Stop,
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

/// A request's handle, unique within its engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a request produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// Generated token ids (an EOS included when it ended the request).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens found in the prefix cache at admission (not computed again).
    pub cached_tokens: usize,
    /// From the request's arrival to its first generated token (time to first token).
    pub ttft: Duration,
    /// From the request's arrival to its last token.
    pub finished: Duration,
}

/// One token a step generated for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepOutput {
    /// The request.
    pub id: RequestId,
    /// The token.
    pub token: u32,
    /// Set when this token ended the request (its blocks are already released).
    pub finished: Option<Completion>,
}

/// Counters of the engine since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Runtime steps run.
    pub steps: u64,
    /// Requests admitted (each once, however often it is preempted).
    pub requests: u64,
    /// Prompt tokens of those requests.
    pub prompt_tokens: u64,
    /// Of those, tokens found in the prefix cache at the first admission.
    pub prefix_hit_tokens: u64,
    /// Tokens computed (prompt chunks, recomputation and decodes).
    pub computed_tokens: u64,
    /// Tokens served from the prefix cache instead, at every admission (re-admissions after
    /// preemption included).
    pub cached_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Of those, tokens drawn by a request's sampler from the step's logits (the others are
    /// the step's argmax).
    pub sampled_tokens: u64,
    /// Requests preempted for lack of KV blocks.
    pub preemptions: u64,
    /// Requests aborted by their caller.
    pub aborted: u64,
    /// Most sequences in one step.
    pub max_batch: usize,
}

/// Why the engine refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A request of a list cannot be served as asked.
    #[error("request {index}: {why}")]
    BadRequest {
        /// Its index in the submitted list.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// A request cannot be served as asked.
    #[error("{0}")]
    Invalid(String),
    /// The configuration cannot run.
    #[error("engine configuration: {0}")]
    Config(String),
    /// A runtime step failed; the requests it ran were ended and their blocks released.
    #[error("a step of {} requests failed: {source}", failed.len())]
    Step {
        /// The requests the step ran (ended).
        failed: Vec<RequestId>,
        /// Why (boxed: a run error is large and this path is rare).
        source: Box<Qwen3RunError>,
    },
    /// A runtime failure outside a step (boxed: it is large and rare).
    #[error(transparent)]
    Run(Box<Qwen3RunError>),
}

impl From<Qwen3RunError> for EngineError {
    fn from(e: Qwen3RunError) -> EngineError {
        EngineError::Run(Box::new(e))
    }
}

/// One request in flight.
struct Seq {
    id: RequestId,
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
    /// Prompt tokens served from the prefix cache at the first admission.
    cached_tokens: usize,
    admitted_once: bool,
    arrived: Instant,
    first_token: Option<Duration>,
}

/// Called with each runtime run's report (its spans, and the diagnostics the call
/// configuration records), on the thread that steps the engine, right after the run: a
/// caller's way to write them ([`Engine::set_step_observer`]).
pub type StepObserver = Box<dyn FnMut(&RunReport) + Send>;

/// The engine.
pub struct Engine {
    // Declared before the worker: fields drop in order, and the session's buffers go before
    // the worker that allocated them.
    session: Session,
    worker: Worker,
    blocks: BlockManager,
    eos: Vec<u32>,
    cfg: EngineConfig,
    /// How decode steps run: the caller's configuration, labelled `<label>.decode`.
    call_decode: CallConfig,
    /// How steps with a prompt chunk run, labelled `<label>.prefill`.
    call_prefill: CallConfig,
    observer: Option<StepObserver>,
    vocab: usize,
    stats: EngineStats,
    /// Admitted requests, oldest first (the order preemption undoes).
    running: Vec<Seq>,
    /// Requests not admitted (or preempted), served first-come-first-served.
    waiting: VecDeque<Seq>,
    next_id: u64,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

/// `call` with its runs labelled `<label>.<path>` (`<path>` alone without a label).
fn labelled(call: &CallConfig, path: &str) -> CallConfig {
    CallConfig {
        label: Some(match &call.label {
            Some(l) => format!("{l}.{path}"),
            None => path.to_string(),
        }),
        ..call.clone()
    }
}

impl Engine {
    /// An engine over `weights` on `worker` (its kernels registered by the caller), stopping at
    /// `eos` ids: the weights are copied into the worker ([`ResidentModel::upload_as`]), then
    /// as [`Engine::with_model`].
    pub fn new(
        worker: Worker,
        weights: &Qwen3Weights,
        eos: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Engine, EngineError> {
        // Refused before the upload, whose time and memory it would waste.
        Self::check_config(&weights.config, &cfg)?;
        let model = Arc::new(ResidentModel::upload_as(
            &worker,
            weights,
            Self::resident_seq(&cfg),
            cfg.weights,
            None,
        )?);
        Self::with_model(worker, model, eos, cfg)
    }

    /// The positions a model the engine runs must hold RoPE tables for: `max_seq_len` in
    /// whole pages.
    pub fn resident_seq(cfg: &EngineConfig) -> usize {
        cfg.max_seq_len.div_ceil(PAGE_SIZE) * PAGE_SIZE
    }

    /// `cfg` against the model's config `c`: positive sizes, a sequence length the model's
    /// positions cover, a prefill threshold of at least 1, block ids that fit `u32`.
    fn check_config(
        c: &simpler_models::qwen3::Qwen3Config,
        cfg: &EngineConfig,
    ) -> Result<(), EngineError> {
        if cfg.max_batch_size == 0 || cfg.max_num_batched_tokens == 0 || cfg.num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "max_batch_size {}, max_num_batched_tokens {} and num_blocks {} must be positive",
                cfg.max_batch_size, cfg.max_num_batched_tokens, cfg.num_blocks
            )));
        }
        if cfg.max_seq_len < 2 || cfg.max_seq_len > c.max_position_embeddings {
            return Err(EngineError::Config(format!(
                "max_seq_len {} must be in 2..={} (max_position_embeddings)",
                cfg.max_seq_len, c.max_position_embeddings
            )));
        }
        if cfg.long_prefill_threshold == Some(0) {
            return Err(EngineError::Config(
                "long_prefill_threshold must be at least 1".into(),
            ));
        }
        if u32::try_from(cfg.num_blocks).is_err() {
            return Err(EngineError::Config(format!(
                "num_blocks {} is more than block ids can number",
                cfg.num_blocks
            )));
        }
        Ok(())
    }

    /// An engine over a model already in `worker`'s buffers (its kernels registered by the
    /// caller), stopping at `eos` ids: what a caller that uploads the layers one at a time
    /// (`ResidentModel::upload_generated`, `upload_checkpoint`) passes. The model must hold
    /// `cfg.weights` and RoPE tables for [`Engine::resident_seq`] positions; else refused, naming
    /// the field.
    pub fn with_model(
        worker: Worker,
        model: Arc<ResidentModel>,
        eos: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Engine, EngineError> {
        let c = model.config.clone();
        Self::check_config(&c, &cfg)?;
        if model.format != cfg.weights {
            return Err(EngineError::Config(format!(
                "weights: the engine asks for {:?}, the model holds {:?}",
                cfg.weights, model.format
            )));
        }
        if model.max_seq < Self::resident_seq(&cfg) {
            return Err(EngineError::Config(format!(
                "max_seq_len {}: the model's RoPE tables cover {} positions",
                cfg.max_seq_len, model.max_seq
            )));
        }
        let kv = KvBuffers::new(&worker, &c, cfg.num_blocks, PAGE_SIZE)?;
        let session = Session::new(&worker, model, kv);
        Ok(Engine {
            worker,
            session,
            blocks: BlockManager::new(cfg.num_blocks, PAGE_SIZE),
            eos,
            cfg,
            call_decode: labelled(&CallConfig::default(), "decode"),
            call_prefill: labelled(&CallConfig::default(), "prefill"),
            observer: None,
            vocab: c.vocab_size,
            stats: EngineStats::default(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_id: 0,
        })
    }

    /// How every step runs (diagnostics, tracing, ring sizes); the default otherwise. The
    /// steps' runs are labelled by path, `<label>.decode` and `<label>.prefill` (plain
    /// `decode` and `prefill` without a label), so `simpler trace timing` tells them apart.
    pub fn set_call_config(&mut self, call: CallConfig) {
        self.call_decode = labelled(&call, "decode");
        self.call_prefill = labelled(&call, "prefill");
    }

    /// Hands every later run's report to `observer` (`None`: to nobody, the default): the
    /// steps of [`Engine::step`] and of [`Engine::time_decode_steps`], each once, in order. A
    /// failed run has no report.
    pub fn set_step_observer(&mut self, observer: Option<StepObserver>) {
        self.observer = observer;
    }

    /// The draw of each row of `plan` that samples and whose chunk reaches the end of its
    /// known tokens (`None` for the other rows; `Some(None)` where every logit was NaN), on up
    /// to the machine's cores at once ([`crate::sampler::sample_rows`]; the step's workers are
    /// idle by then).
    fn draw_sampled(
        &mut self,
        plan: &[(usize, usize)],
        logits: &[f32],
    ) -> Vec<Option<Option<u32>>> {
        let mut jobs: Vec<(usize, &mut Sampler)> = Vec::new();
        let mut row_of = vec![None; self.running.len()];
        for (row, &(i, n)) in plan.iter().enumerate() {
            row_of[i] = Some((row, n));
        }
        for (i, s) in self.running.iter_mut().enumerate() {
            if let Some((row, n)) = row_of[i]
                && !s.greedy
                && s.computed + n >= s.tokens.len()
            {
                jobs.push((row, &mut s.sampler));
            }
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let results = crate::sampler::sample_rows(&mut jobs, logits, self.vocab, threads);
        let mut drawn = vec![None; plan.len()];
        self.stats.sampled_tokens += results.len() as u64;
        for (row, t) in results {
            drawn[row] = Some(t);
        }
        drawn
    }

    fn observe(&mut self, report: &RunReport) {
        if let Some(f) = self.observer.as_mut() {
            f(report);
        }
    }

    /// How the engine is sized.
    pub fn config(&self) -> EngineConfig {
        self.cfg
    }

    /// The model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The ids that end a request (unless it ignores them).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Counters since the engine was made.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Free KV blocks now (cached-but-unreferenced blocks count as free).
    pub fn free_blocks(&self) -> usize {
        self.blocks.free()
    }

    /// KV blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.blocks.total()
    }

    /// Requests admitted and not finished.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for admission (preempted ones included).
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether a step has anything to do.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// The bytes of step I/O buffers the session keeps (they grow to the largest step and no
    /// further).
    pub fn io_buffer_bytes(&self) -> usize {
        self.session.io_bytes()
    }

    /// Checks `r` against the model and the engine's sizes, and queues it; it runs from the
    /// next [`Engine::step`]. `max_new_tokens` is capped to what fits in `max_seq_len` and in
    /// the block pool.
    pub fn add_request(&mut self, r: &Request) -> Result<RequestId, EngineError> {
        self.check(r).map_err(EngineError::Invalid)?;
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let fits = self.cfg.max_seq_len.min(self.cfg.num_blocks * PAGE_SIZE);
        self.waiting.push_back(Seq {
            id,
            tokens: r.prompt.clone(),
            prompt_len: r.prompt.len(),
            max_len: r.prompt.len().saturating_add(r.max_new_tokens).min(fits),
            sampler: Sampler::new(r.sampling),
            greedy: r.sampling.temperature == 0.0,
            ignore_eos: r.ignore_eos,
            alloc: None,
            computed: 0,
            cached_tokens: 0,
            admitted_once: false,
            arrived: Instant::now(),
            first_token: None,
        });
        Ok(id)
    }

    fn check(&self, r: &Request) -> Result<(), String> {
        if r.prompt.is_empty() {
            return Err("the prompt is empty".into());
        }
        let fits = self.cfg.max_seq_len.min(self.cfg.num_blocks * PAGE_SIZE);
        if r.prompt.len() >= fits {
            return Err(format!(
                "a prompt of {} tokens leaves no room to generate: the engine holds {fits} tokens per sequence (max_seq_len {}, {} KV blocks of {PAGE_SIZE})",
                r.prompt.len(),
                self.cfg.max_seq_len,
                self.cfg.num_blocks
            ));
        }
        if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(format!(
                "token {t} is outside the vocabulary of {}",
                self.vocab
            ));
        }
        if r.max_new_tokens == 0 {
            return Err("max_new_tokens must be at least 1".into());
        }
        r.sampling
            .validate()
            .map_err(|(name, why)| format!("{name} {why}"))
    }

    /// Ends request `id` wherever it is and releases its blocks; false if it is not queued or
    /// running (finished, aborted or never made).
    pub fn abort(&mut self, id: RequestId) -> bool {
        let seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            match self.waiting.remove(i) {
                Some(s) => s,
                None => return false,
            }
        } else {
            return false;
        };
        self.retire(seq);
        self.stats.aborted += 1;
        true
    }

    /// Ends request `id` as the caller decided (a stop string it found), releasing its blocks;
    /// its completion, or `None` if it is not running or waiting.
    pub fn stop(&mut self, id: RequestId) -> Option<Completion> {
        let seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i)?
        };
        let now = seq.arrived.elapsed();
        let c = Completion {
            tokens: seq.tokens[seq.prompt_len..].to_vec(),
            finish_reason: FinishReason::Stop,
            prompt_tokens: seq.prompt_len,
            cached_tokens: seq.cached_tokens,
            ttft: seq.first_token.unwrap_or(now),
            finished: now,
        };
        self.retire(seq);
        Some(c)
    }

    /// Ends every request, frees the KV cache and the model's buffers, and stops the worker's
    /// threads.
    pub fn close(mut self) {
        self.abort_all();
        let Engine {
            worker, session, ..
        } = self;
        // The session's buffers go before the worker that allocated them.
        drop(session);
        // Closing waits for queued runs; none can be queued, steps wait for their runs.
        let _ = worker.close();
    }

    /// Ends every request and releases every block.
    pub fn abort_all(&mut self) -> Vec<RequestId> {
        let all: Vec<Seq> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        let ids = all.iter().map(|s| s.id).collect();
        for s in all {
            self.stats.aborted += 1;
            self.retire(s);
        }
        ids
    }

    fn retire(&mut self, mut s: Seq) {
        if let Some(a) = s.alloc.take() {
            self.blocks.release(a);
        }
    }

    /// Serves `requests` together with continuous batching, alone on the engine; completions
    /// in request order. Every request is checked before any runs.
    pub fn generate(&mut self, requests: &[Request]) -> Result<Vec<Completion>, EngineError> {
        if self.has_work() {
            return Err(EngineError::Invalid(format!(
                "generate serves a list alone, but {} requests are in flight",
                self.running.len() + self.waiting.len()
            )));
        }
        for (index, r) in requests.iter().enumerate() {
            self.check(r)
                .map_err(|why| EngineError::BadRequest { index, why })?;
        }
        let mut ids = Vec::with_capacity(requests.len());
        for r in requests {
            ids.push(self.add_request(r)?);
        }
        let mut done: Vec<Option<Completion>> = vec![None; requests.len()];
        let first = ids.first().map_or(0, |i| i.0);
        while self.has_work() {
            match self.step() {
                Ok(out) => {
                    for o in out {
                        if let Some(c) = o.finished {
                            done[(o.id.0 - first) as usize] = Some(c);
                        }
                    }
                }
                Err(e) => {
                    // Whatever happened, every block goes back.
                    self.abort_all();
                    return Err(e);
                }
            }
        }
        Ok(done.into_iter().flatten().collect())
    }

    /// Times `steps` decode steps of `batch` sequences that hold `context` tokens (growing by
    /// one per step): what the decode path costs without the scheduler, for benchmarks. The
    /// first `warmup` of them run marked warm-up ([`CallConfig::warmup`]: their reports and
    /// traces say so); every step's time is returned. The engine must be idle; the KV values
    /// are whatever the blocks hold (timing does not depend on them), and the blocks go back
    /// afterwards.
    pub fn time_decode_steps(
        &mut self,
        batch: usize,
        context: usize,
        steps: usize,
        warmup: usize,
    ) -> Result<Vec<Duration>, EngineError> {
        if self.has_work() {
            return Err(EngineError::Invalid(
                "timing decode steps needs an idle engine".into(),
            ));
        }
        if warmup > steps {
            return Err(EngineError::Invalid(format!(
                "{warmup} warm-up steps of {steps} timed steps: more than there are"
            )));
        }
        if batch == 0 || batch > self.cfg.max_batch_size || context == 0 {
            return Err(EngineError::Invalid(format!(
                "batch {batch} must be in 1..={} and context at least 1",
                self.cfg.max_batch_size
            )));
        }
        let end = context.saturating_add(steps);
        if end > self.cfg.max_seq_len {
            return Err(EngineError::Invalid(format!(
                "context {context} + {steps} steps exceeds max_seq_len {}",
                self.cfg.max_seq_len
            )));
        }
        let mut allocs = Vec::with_capacity(batch);
        for _ in 0..batch {
            match self.blocks.allocate(&[], end) {
                Ok(a) => allocs.push(a),
                Err(e) => {
                    for a in allocs {
                        self.blocks.release(a);
                    }
                    return Err(EngineError::Invalid(format!(
                        "{batch} sequences of {end} tokens need more KV blocks than are free: {e}"
                    )));
                }
            }
        }
        let max_blocks = end.div_ceil(PAGE_SIZE);
        let table: Vec<u32> = allocs
            .iter()
            .flat_map(|a| a.blocks.iter().map(|b| b.0))
            .collect();
        self.session.read_logits = false;
        let warm_call = CallConfig {
            warmup: true,
            ..self.call_decode.clone()
        };
        let mut times = Vec::with_capacity(steps);
        let mut result = Ok(());
        for i in 0..steps {
            let call = if i < warmup {
                &warm_call
            } else {
                &self.call_decode
            };
            let batch_i = PagedBatch {
                page_size: PAGE_SIZE,
                max_blocks,
                block_table: table.clone(),
                seq_lens: vec![context + i + 1; batch],
            };
            let t = Instant::now();
            match self
                .session
                .decode(&self.worker, &batch_i, &vec![0; batch], call)
            {
                Ok(out) => {
                    times.push(t.elapsed());
                    self.observe(&out.report);
                }
                Err(e) => {
                    result = Err(e.into());
                    break;
                }
            }
        }
        for a in allocs {
            self.blocks.release(a);
        }
        result.map(|()| times)
    }

    /// Tokens of a sequence with `left` to compute that a step with `budget` left takes.
    fn chunk(&self, left: usize, budget: usize) -> usize {
        let n = left.min(budget);
        match self.cfg.long_prefill_threshold {
            Some(t) => n.min(t.max(1)),
            None => n,
        }
    }

    /// Preempts the most recently admitted running request (to the front of `waiting`).
    fn preempt_newest(&mut self) {
        if let Some(mut s) = self.running.pop() {
            if let Some(a) = s.alloc.take() {
                self.blocks.release(a);
            }
            s.computed = 0;
            self.stats.preemptions += 1;
            self.waiting.push_front(s);
        }
    }

    /// One engine step: schedules running requests, then waiting ones, runs every scheduled
    /// chunk in one runtime run, and returns the tokens generated (finished requests have
    /// released their blocks). Nothing to do is an empty step. A failed run ends the requests
    /// it ran and releases their blocks; the engine stays usable.
    pub fn step(&mut self) -> Result<Vec<StepOutput>, EngineError> {
        if !self.has_work() {
            return Ok(Vec::new());
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        // (index into running, chunk length) of this step.
        let mut plan: Vec<(usize, usize)> = Vec::new();
        // Running requests first, oldest first; grow their blocks, preempting the newest.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let n = self.chunk(s.tokens.len() - s.computed, budget);
            let need = s.computed + n;
            let grown = match self.running[i].alloc.as_mut() {
                Some(a) => self.blocks.grow(a, need).is_ok(),
                None => false,
            };
            if !grown {
                let newest = i + 1 == self.running.len();
                self.preempt_newest();
                if newest {
                    // This was the newest: it waits, recomputed later.
                    break;
                }
                continue;
            }
            plan.push((i, n));
            budget -= n;
            i += 1;
        }
        // Then waiting requests, first come first served.
        while budget > 0 && self.running.len() < self.cfg.max_batch_size {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let Ok(alloc) = self.blocks.allocate(&front.tokens, front.tokens.len()) else {
                break;
            };
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            s.computed = alloc.cached_tokens;
            if !s.admitted_once {
                s.admitted_once = true;
                s.cached_tokens = alloc.cached_tokens;
                self.stats.requests += 1;
                self.stats.prompt_tokens += s.prompt_len as u64;
                self.stats.prefix_hit_tokens += alloc.cached_tokens as u64;
            }
            self.stats.cached_tokens += alloc.cached_tokens as u64;
            s.alloc = Some(alloc);
            let n = self.chunk(s.tokens.len() - s.computed, budget);
            self.running.push(s);
            plan.push((self.running.len() - 1, n));
            budget -= n;
        }
        if plan.is_empty() {
            return Err(EngineError::Config(format!(
                "no request fits: {} waiting, {} KV blocks free of {}",
                self.waiting.len(),
                self.blocks.free(),
                self.blocks.total()
            )));
        }
        let out = match self.run(&plan) {
            Ok(out) => out,
            Err(source) => {
                // The scheduled requests end; their blocks go back (nothing of this step was
                // committed to the prefix cache).
                let mut rows: Vec<usize> = plan.iter().map(|&(i, _)| i).collect();
                rows.sort_unstable_by(|a, b| b.cmp(a));
                let mut failed = Vec::with_capacity(rows.len());
                for i in rows {
                    let s = self.running.remove(i);
                    failed.push(s.id);
                    self.retire(s);
                }
                return Err(EngineError::Step {
                    failed,
                    source: Box::new(source),
                });
            }
        };
        self.observe(&out.report);
        self.stats.steps += 1;
        self.stats.max_batch = self.stats.max_batch.max(plan.len());
        // The sampled draws of the rows whose chunk reaches the end of their known tokens.
        let mut drawn = self.draw_sampled(&plan, &out.logits);
        // Advance; take the next token where a chunk reached the end of the known tokens.
        let mut outputs = Vec::new();
        let mut finished = Vec::new();
        for (row, &(i, n)) in plan.iter().enumerate() {
            self.stats.computed_tokens += n as u64;
            let s = &mut self.running[i];
            s.computed += n;
            if let Some(a) = &s.alloc {
                self.blocks.commit(a, &s.tokens[..s.computed]);
            }
            if s.computed < s.tokens.len() {
                continue;
            }
            let next = drawn[row].take().flatten().unwrap_or(out.next_tokens[row]);
            s.tokens.push(next);
            self.stats.generated_tokens += 1;
            s.first_token.get_or_insert_with(|| s.arrived.elapsed());
            let eos = !s.ignore_eos && self.eos.contains(&next);
            let reason = if eos {
                Some(FinishReason::Eos)
            } else if s.tokens.len() >= s.max_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                finished.push((i, outputs.len(), reason));
            }
            outputs.push(StepOutput {
                id: s.id,
                token: next,
                finished: None,
            });
        }
        // Remove finished requests (highest index first keeps the others' indices).
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, o, reason) in finished {
            let mut s = self.running.remove(i);
            if let Some(a) = s.alloc.take() {
                self.blocks.release(a);
            }
            let now = s.arrived.elapsed();
            outputs[o].finished = Some(Completion {
                tokens: s.tokens[s.prompt_len..].to_vec(),
                finish_reason: reason,
                prompt_tokens: s.prompt_len,
                cached_tokens: s.cached_tokens,
                ttft: s.first_token.unwrap_or(now),
                finished: now,
            });
        }
        Ok(outputs)
    }

    /// One runtime run over the planned chunks.
    fn run(
        &mut self,
        plan: &[(usize, usize)],
    ) -> Result<simpler_models::qwen3::StepOutput, Qwen3RunError> {
        let running = &self.running;
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
        if all_decodes {
            let last: Vec<u32> = chunks.iter().map(|c| c.tokens[0]).collect();
            self.session
                .decode(&self.worker, &batch, &last, &self.call_decode)
        } else {
            self.session
                .prefill(&self.worker, &batch, &chunks, &self.call_prefill)
        }
    }
}
