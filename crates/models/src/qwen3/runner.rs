//! Running Qwen3 steps on a worker: a [`Session`] holds a resident model and its paged KV
//! cache, plans each step on the host (rows, slots, SPMD blocks, KV chunks), binds the step's inputs
//! and outputs, runs the orchestration and reads the results back.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use half::bf16;
use simpler_core::clock::now_ns;
use simpler_core::{
    Buffer, CallConfig, CapturedGraph, GraphCache, GraphShape, Interval, RunArgs, RunReport, Worker,
};

use super::golden::PrefillChunk;
use super::ops::STEP_FIELDS;
use super::orchestrate::{self, StepKind, StepPlan, Variant, io};
use super::plan::{LayerBlocks, SeqRows, TilePolicy, check_batch};
use super::quant::{Int8Acts, WeightFormat};
use super::resident::{KvBuffers, Qwen3RunError, ResidentModel};
use super::weights::PagedBatch;

/// What a full-model step (decode or prefill) produced, one row per sequence.
#[derive(Clone, Debug)]
pub struct StepOutput {
    /// Greedy next token of each sequence (argmax, ties to the lowest index).
    pub next_tokens: Vec<u32>,
    /// fp32 logits `[sequences, vocab]` (empty when the session does not read them back).
    pub logits: Vec<f32>,
    /// fp32 hidden state after the last layer `[sequences, hidden]` (before the final norm).
    pub hidden: Vec<f32>,
    /// The run's timing.
    pub report: RunReport,
}

/// What a layers-chunk step produced.
#[derive(Clone, Debug)]
pub struct LayersOutput {
    /// bf16 hidden state after the layers `[batch, hidden]`.
    pub hidden: Vec<bf16>,
    /// The run's timing.
    pub report: RunReport,
}

/// I/O buffer roles (a session keeps one buffer per role and size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Role {
    Table,
    Input,
    Main,
    Ids,
    Hidden,
    Step,
}

/// A resident model with its KV cache, ready to run steps.
#[derive(Debug)]
pub struct Session {
    model: Arc<ResidentModel>,
    kv: KvBuffers,
    /// How steps are cut into tasks.
    pub policy: TilePolicy,
    /// Whether full-model steps read the logits back (off saves a `[rows, vocab]` copy).
    pub read_logits: bool,
    /// Whether decode steps replay a captured graph: the first step of a topology (batch,
    /// block-table width, KV chunk counts, ...) is captured, later steps of the same topology
    /// replay it without running the orchestration (`docs/runtime.md`, "Captured graphs").
    /// Off: every step is orchestrated. The step's `RunReport::graph` says which ran.
    pub replay: bool,
    /// Whether a decode step that would replay the captured graph is orchestrated and
    /// captured instead and checked against it (`simpler_core::GraphCache::set_verify`): a
    /// difference fails the step, naming what the decode shape left out. For tests and
    /// debugging (every step pays its orchestration); only with [`Session::replay`] on.
    pub verify_replay: bool,
    /// The last captured decode graph.
    decode_graph: GraphCache,
    /// One step I/O buffer per role, grown (to a power of two) when a step needs more: a
    /// long-lived session keeps at most one buffer per role, however many step sizes it sees.
    io: HashMap<Role, Buffer>,
}

impl Session {
    /// A session over `model` and `kv`, tiled for `worker`'s cores.
    pub fn new(worker: &Worker, model: Arc<ResidentModel>, kv: KvBuffers) -> Session {
        Session {
            model,
            kv,
            policy: TilePolicy::for_cores(worker.cores()),
            read_logits: true,
            replay: true,
            verify_replay: false,
            decode_graph: GraphCache::default(),
            io: HashMap::new(),
        }
    }

    /// The resident model.
    pub fn model(&self) -> &ResidentModel {
        &self.model
    }

    /// The KV cache.
    pub fn kv(&self) -> &KvBuffers {
        &self.kv
    }

    fn io_buffer(
        &mut self,
        worker: &Worker,
        role: Role,
        bytes: usize,
    ) -> Result<Buffer, Qwen3RunError> {
        let bytes = bytes.max(4);
        if let Some(b) = self.io.get(&role)
            && b.len() >= bytes
        {
            return Ok(b.clone());
        }
        let b = worker.alloc(bytes.next_power_of_two())?;
        self.io.insert(role, b.clone());
        Ok(b)
    }

    /// Bytes held in step I/O buffers (bounded by the largest step seen, whatever the number
    /// of steps).
    pub fn io_bytes(&self) -> usize {
        self.io.values().map(Buffer::len).sum()
    }

    fn plan(
        &self,
        kind: StepKind,
        variant: Variant,
        layers: Range<usize>,
        batch: &PagedBatch,
        seqs: Vec<SeqRows>,
    ) -> Result<StepPlan, Qwen3RunError> {
        let m = &self.model;
        let c = &m.config;
        check_batch(batch, self.kv.slots(), self.kv.page_size, m.max_seq)
            .map_err(Qwen3RunError::Invalid)?;
        if let Some(&len) = batch
            .seq_lens
            .iter()
            .find(|&&l| l > c.max_position_embeddings)
        {
            return Err(Qwen3RunError::Invalid(format!(
                "a sequence of {len} tokens is past the model's max_position_embeddings ({})",
                c.max_position_embeddings
            )));
        }
        if layers.start > layers.end
            || layers.end > c.num_hidden_layers
            || layers.end > self.kv.layers
        {
            return Err(Qwen3RunError::Invalid(format!(
                "layers {layers:?} outside the model's {} layers",
                c.num_hidden_layers
            )));
        }
        let rows: usize = seqs.iter().map(|s| s.n_rows).sum();
        if rows == 0 {
            return Err(Qwen3RunError::Invalid(
                "a step needs at least one token".into(),
            ));
        }
        let kv_chunks = match kind {
            StepKind::Decode => {
                let lens: Vec<usize> = seqs.iter().map(|s| s.seq_len).collect();
                self.policy.kv_splits(&lens)
            }
            StepKind::Prefill => Vec::new(),
        };
        Ok(StepPlan {
            config: c.clone(),
            format: m.format,
            sets: m.sets,
            set_of_layer: m.set_of_layer.clone(),
            max_seq: m.max_seq,
            kv_layers: self.kv.layers,
            slots: self.kv.slots(),
            page_size: self.kv.page_size,
            table_rows: batch.batch(),
            max_blocks: batch.max_blocks,
            kind,
            variant,
            layers,
            rows,
            seqs,
            blocks: LayerBlocks::new(c, &self.policy),
            kv_chunks,
            prefill_rows: self.policy.prefill_rows,
            qkv_scratch_bytes: self.policy.qkv_scratch_bytes,
            small_task_blocks: self.policy.cores,
        })
    }

    /// Binds the step's buffers, runs the orchestration and returns its report.
    fn run(
        &mut self,
        worker: &Worker,
        plan: StepPlan,
        batch: &PagedBatch,
        input: Buffer,
        out: [Buffer; 3],
        cfg: &CallConfig,
    ) -> Result<RunReport, Qwen3RunError> {
        let table = self.io_buffer(worker, Role::Table, batch.block_table.len() * 4)?;
        table.write(&batch.block_table)?;
        // Each row's length (its position + 1) and the slot its K/V go to: the q/k/v task's
        // epilogue reads them (`ops::GEMM_ROPE_STEP`), so a decode graph serves every step.
        let mut entries = vec![0u32; plan.rows * STEP_FIELDS];
        for s in &plan.seqs {
            for i in 0..s.n_rows {
                let pos = s.first_pos() + i;
                let e = &mut entries[(s.row0 + i) * STEP_FIELDS..][..STEP_FIELDS];
                e.copy_from_slice(&[pos as u32 + 1, batch.slot(s.table_row, pos) as u32]);
            }
        }
        let step = self.io_buffer(worker, Role::Step, entries.len() * 4)?;
        step.write(&entries)?;
        let mut buffers = self.model.buffers().to_vec();
        buffers.extend([self.kv.k.clone(), self.kv.v.clone(), table, input]);
        buffers.extend(out);
        buffers.push(step);
        debug_assert_eq!(buffers.len(), io::COUNT);
        let name = match (plan.kind, plan.variant) {
            (StepKind::Decode, Variant::Model) => "qwen3.decode",
            (StepKind::Decode, Variant::Layers) => "qwen3.decode_layers",
            (StepKind::Prefill, _) => "qwen3.prefill",
        };
        let args = RunArgs {
            buffers,
            scalars: Vec::new(),
        };
        if plan.kind != StepKind::Decode || !self.replay {
            let plan = Arc::new(plan);
            return Ok(worker.run_fn(name, args, cfg, move |o, a| orchestrate::step(o, a, &plan))?);
        }
        let shape = decode_shape(&plan);
        let plan = Arc::new(plan);
        self.decode_graph.set_verify(self.verify_replay);
        Ok(self
            .decode_graph
            .run(worker, name, args, cfg, shape, move |o, a| {
                orchestrate::step(o, a, &plan)
            })?)
    }

    /// The captured decode graph the next step of the same topology would replay, if any.
    pub fn decode_graph(&self) -> Option<&CapturedGraph> {
        self.decode_graph.graph()
    }

    /// One full-model decode step: `tokens[b]` is sequence `b`'s newest token, at position
    /// `batch.seq_lens[b] - 1`; its K/V land at `batch.slot_mapping()[b]` in every layer.
    pub fn decode(
        &mut self,
        worker: &Worker,
        batch: &PagedBatch,
        tokens: &[u32],
        cfg: &CallConfig,
    ) -> Result<StepOutput, Qwen3RunError> {
        let t0 = now_ns();
        if tokens.len() != batch.batch() {
            return Err(Qwen3RunError::Invalid(format!(
                "{} tokens for a batch of {}",
                tokens.len(),
                batch.batch()
            )));
        }
        let seqs = decode_rows(batch);
        let layers = 0..self.model.config.num_hidden_layers;
        let plan = self.plan(StepKind::Decode, Variant::Model, layers, batch, seqs)?;
        let mut out = self.run_model(worker, plan, batch, tokens, cfg)?;
        stamp_engine_step(&mut out.report, t0);
        Ok(out)
    }

    /// The layers-chunk decode step over `layers`: bf16 hidden `[batch, hidden]` in, bf16 out,
    /// fp32 carried between layers, no embedding or head (the reference fixture's variant).
    pub fn decode_layers(
        &mut self,
        worker: &Worker,
        batch: &PagedBatch,
        hidden: &[bf16],
        layers: Range<usize>,
        cfg: &CallConfig,
    ) -> Result<LayersOutput, Qwen3RunError> {
        let t0 = now_ns();
        let h = self.model.config.hidden_size;
        if hidden.len() != batch.batch() * h {
            return Err(Qwen3RunError::Invalid(format!(
                "hidden of {} elements for {} rows of {h}",
                hidden.len(),
                batch.batch()
            )));
        }
        let plan = self.plan(
            StepKind::Decode,
            Variant::Layers,
            layers,
            batch,
            decode_rows(batch),
        )?;
        let bytes = hidden.len() * 2;
        let input = self.io_buffer(worker, Role::Input, bytes)?;
        input.write(hidden)?;
        let out = self.io_buffer(worker, Role::Main, bytes)?;
        let spare = self.io_buffer(worker, Role::Ids, 4)?;
        let report = self.run(
            worker,
            plan,
            batch,
            input,
            [out.clone(), spare.clone(), spare],
            cfg,
        )?;
        let mut done = LayersOutput {
            hidden: out.read_at::<bf16>(0, hidden.len())?,
            report,
        };
        stamp_engine_step(&mut done.report, t0);
        Ok(done)
    }

    /// A chunked causal prefill step: each chunk's tokens end at its `seq_len` (the cached
    /// prefix `0..seq_len - tokens.len()` is already in the cache); every chunk token's K/V is
    /// written; logits and greedy ids come back for each chunk's last token. `batch` supplies
    /// the block tables (its `seq_lens` are not used).
    pub fn prefill(
        &mut self,
        worker: &Worker,
        batch: &PagedBatch,
        chunks: &[PrefillChunk],
        cfg: &CallConfig,
    ) -> Result<StepOutput, Qwen3RunError> {
        let t0 = now_ns();
        let mut seqs = Vec::with_capacity(chunks.len());
        let mut tokens = Vec::new();
        for ch in chunks {
            if ch.tokens.is_empty() || ch.tokens.len() > ch.seq_len || ch.seq >= batch.batch() {
                return Err(Qwen3RunError::Invalid(format!(
                    "prefill chunk of {} tokens ending at {} for sequence {} of {}",
                    ch.tokens.len(),
                    ch.seq_len,
                    ch.seq,
                    batch.batch()
                )));
            }
            if ch.seq_len > batch.max_blocks * batch.page_size {
                return Err(Qwen3RunError::Invalid(format!(
                    "prefill chunk ends at {} tokens, the block table holds {}",
                    ch.seq_len,
                    batch.max_blocks * batch.page_size
                )));
            }
            seqs.push(SeqRows {
                table_row: ch.seq,
                seq_len: ch.seq_len,
                n_rows: ch.tokens.len(),
                row0: tokens.len(),
            });
            tokens.extend_from_slice(&ch.tokens);
        }
        if let Some(&len) = chunks
            .iter()
            .map(|c| &c.seq_len)
            .find(|&&l| l > self.model.max_seq)
        {
            return Err(Qwen3RunError::Invalid(format!(
                "prefill to {len} tokens, the RoPE tables cover {}",
                self.model.max_seq
            )));
        }
        let layers = 0..self.model.config.num_hidden_layers;
        let plan = self.plan(StepKind::Prefill, Variant::Model, layers, batch, seqs)?;
        let mut out = self.run_model(worker, plan, batch, &tokens, cfg)?;
        stamp_engine_step(&mut out.report, t0);
        Ok(out)
    }

    fn run_model(
        &mut self,
        worker: &Worker,
        plan: StepPlan,
        batch: &PagedBatch,
        tokens: &[u32],
        cfg: &CallConfig,
    ) -> Result<StepOutput, Qwen3RunError> {
        let c = &self.model.config;
        let vocab = c.vocab_size;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Qwen3RunError::Invalid(format!(
                "token id {t} outside the vocabulary of {vocab}"
            )));
        }
        let (n_seqs, h) = (plan.seqs.len(), c.hidden_size);
        let input = self.io_buffer(worker, Role::Input, tokens.len() * 4)?;
        input.write(tokens)?;
        let logits = self.io_buffer(worker, Role::Main, n_seqs * vocab * 4)?;
        let ids = self.io_buffer(worker, Role::Ids, n_seqs * 4)?;
        let hidden = self.io_buffer(worker, Role::Hidden, n_seqs * h * 4)?;
        let report = self.run(
            worker,
            plan,
            batch,
            input,
            [logits.clone(), ids.clone(), hidden.clone()],
            cfg,
        )?;
        Ok(StepOutput {
            next_tokens: ids.read_at::<u32>(0, n_seqs)?,
            logits: if self.read_logits {
                logits.read_at::<f32>(0, n_seqs * vocab)?
            } else {
                Vec::new()
            },
            hidden: hidden.read_at::<f32>(0, n_seqs * h)?,
            report,
        })
    }
}

/// Records the step's whole time, from its call at `t0` to now (its outputs read back), as
/// the report's `engine_step` (timing layer ⑤ is it less the run).
fn stamp_engine_step(report: &mut RunReport, t0: u64) {
    report.engine_step = Interval {
        start_ns: t0,
        end_ns: now_ns(),
    };
}

/// What shapes a decode step's graph: everything of the plan but the positions, slots and
/// lengths the kernels read from the step entries (the KV chunk counts stay: they set the
/// number of attention tasks).
fn decode_shape(p: &StepPlan) -> GraphShape {
    let format = match p.format {
        WeightFormat::Bf16 => 0,
        WeightFormat::Int8(Int8Acts::Wide) => 1,
        WeightFormat::Int8(Int8Acts::Quantised) => 2,
    };
    let b = &p.blocks;
    let mut s = GraphShape::new()
        .with("variant", u64::from(p.variant == Variant::Layers))
        .with("weights", format)
        .with("layers.start", p.layers.start as u64)
        .with("layers.end", p.layers.end as u64)
        .with("batch", p.rows as u64)
        .with("table_rows", p.table_rows as u64)
        .with("max_blocks", p.max_blocks as u64)
        .with("page_size", p.page_size as u64)
        .with("slots", p.slots as u64)
        .with("max_seq", p.max_seq as u64)
        .with("kv_layers", p.kv_layers as u64)
        .with("blocks.qkv", u64::from(b.qkv))
        .with("blocks.o", u64::from(b.o))
        .with("blocks.gate_up", u64::from(b.gate_up))
        .with("blocks.down", u64::from(b.down))
        .with("blocks.lm_head", u64::from(b.lm_head));
    for (i, (seq, chunks)) in p.seqs.iter().zip(&p.kv_chunks).enumerate() {
        s.push(format!("seq{i}.table_row"), seq.table_row as u64);
        s.push(format!("seq{i}.kv_chunks"), chunks.chunks as u64);
        s.push(format!("seq{i}.kv_short_chunks"), chunks.short as u64);
    }
    s
}

/// Decode rows: sequence `b` is row `b`, one token at position `seq_lens[b] - 1`.
fn decode_rows(batch: &PagedBatch) -> Vec<SeqRows> {
    batch
        .seq_lens
        .iter()
        .enumerate()
        .map(|(b, &len)| SeqRows {
            table_row: b,
            seq_len: len,
            n_rows: 1,
            row0: b,
        })
        .collect()
}
