//! One DeepSeek-V4 attention layer's decode step (SWA or HCA) on a worker: [`AttnLayer`]
//! holds the layer's weights, its window cache and (HCA) its compressor state and compressed
//! cache in worker buffers; [`AttnLayer::step`] plans the step on the host (each token's
//! position, window slot and candidate lists), runs the task graph of `orchestrate.rs`
//! and reads the new residual back. The caches stay on the worker, written in place by the
//! step; [`AttnLayer::read_caches`] reads them back for the checks.

use std::sync::Arc;

use half::bf16;
use simpler_core::{
    Buffer, CallConfig, CapturedGraph, Element, GraphCache, GraphShape, RunArgs, RunReport, Worker,
};
use simpler_kernels_cpu::dsv4::{RopeTable, YarnRamp, rope_inv_freq_plain, rope_inv_freq_yarn};

use super::bf16_layout::{projection_upload_layout, wo_a_upload_layout};
use super::config::{Dsv4Config, LayerKind};
use super::fixture::{
    AttnWeights, CsaParts, HcaParts, Int8Matrix, StepInputs, TOKENS_PER_SEQ, WindowCache,
};
use super::int8_layout::{Int8Use, stacked_in_layout, upload_layout};
use super::ops::{NO_SLOT, TOK_COLS};
use super::orchestrate::io as io_slot;
use super::orchestrate::{self, AttnPlan, buf};
use super::orchestrate_csa;

/// A step the layer cannot run, or a runtime failure.
#[derive(Debug, thiserror::Error)]
pub enum Dsv4RunError {
    /// The runtime refused or failed the run.
    #[error(transparent)]
    Runtime(#[from] simpler_core::Error),
    /// A host copy into or out of a buffer failed.
    #[error(transparent)]
    Buffer(#[from] simpler_core::BufferError),
    /// The request does not fit the layer, its caches or its inputs (names the field).
    #[error("{0}")]
    Invalid(String),
}

/// How a step is cut into tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnTiles {
    /// SPMD blocks of each projection (they split its output columns).
    pub proj_blocks: u32,
    /// Attention tasks per token (each a contiguous block of heads).
    pub head_blocks: usize,
    /// Blocks of the small per-token vector tasks: the activation quantisation before `q_b`
    /// and `wo_b` takes this many, the hc mix products twice as many.
    pub vector_blocks: u32,
}

impl AttnTiles {
    /// Tiles for `cores` cores and `tokens` tokens: every projection in six blocks per core
    /// (tapered, so the cores finish together), and attention in enough head blocks that each
    /// core gets at least four (token, head block) tasks, no block narrower than 16 heads
    /// (the AMX tiles' batch) unless the layer has fewer.
    ///
    /// Six, not four: with four per core the int8 projections (`q_b`, `wo_a`, `wo_b`, ~0.7–1
    /// ms a full block at FLASH shapes on 2 cores) ended on a half and a quarter block run side
    /// by side, and one core waited 150–240 µs at each (2.7% of an SWA step's cores' time).
    /// Paired in one process (`bench dsv4 --versus-proj-blocks 8`, start 8192, 30 A B B A
    /// rounds, Zen 3, 2 cores), 8 blocks took 1.003 [1.001, 1.009] of the 12-block SWA step,
    /// 1.003 [1.000, 1.008] of CSA and 1.007 [1.003, 1.012] of HCA: a small gain, most of the
    /// tail being the blocks' own spread. 10 blocks were level with 8, 16 with 12.
    pub fn for_cores(cores: usize, tokens: usize, heads: usize) -> AttnTiles {
        let want = (4 * cores).div_ceil(tokens.max(1)).max(1);
        let most = (heads / 16).max(1);
        AttnTiles {
            proj_blocks: (6 * cores).max(1) as u32,
            vector_blocks: cores.max(1) as u32,
            head_blocks: want.min(most).min(heads.max(1)),
        }
    }
}

/// The HCA layer's worker-side state.
#[derive(Debug)]
struct HcaBuffers {
    state_kv: Buffer,
    state_score: Buffer,
    cache: Buffer,
    ratio: usize,
    max_rows: usize,
}

/// The CSA layer's worker-side state: both compressors' rings, the compressed cache and the
/// index cache.
#[derive(Debug)]
struct CsaBuffers {
    ring_kv: Buffer,
    ring_score: Buffer,
    cache: Buffer,
    index_ring_kv: Buffer,
    index_ring_score: Buffer,
    index_q: Buffer,
    index_scale: Buffer,
    max_rows: usize,
}

/// The CSA caches as the worker holds them.
#[derive(Clone, Debug, PartialEq)]
pub struct CsaCaches {
    /// Main compressor ring kv `[batch · 2 · ratio, 2 · head_dim]`.
    pub ring_kv: Vec<f32>,
    /// Main compressor ring scores.
    pub ring_score: Vec<f32>,
    /// Compressed cache `[batch · max_rows, head_dim]`.
    pub compressed: Vec<bf16>,
    /// Indexer compressor ring kv `[batch · 2 · ratio, 2 · index_head_dim]`.
    pub index_ring_kv: Vec<f32>,
    /// Indexer compressor ring scores.
    pub index_ring_score: Vec<f32>,
    /// Index rows `[batch · max_rows, index_head_dim]` int8.
    pub index_q: Vec<i8>,
    /// Index row scales `[batch · max_rows]`.
    pub index_scale: Vec<f32>,
}

/// What one step produced.
#[derive(Clone, Debug)]
pub struct AttnStepOutput {
    /// New residual `[T, hc_mult, hidden]` fp32.
    pub x_out: Vec<f32>,
    /// Roped queries `[T, n_heads, head_dim]` (bf16 values).
    pub q: Vec<f32>,
    /// Attention output after inverse RoPE `[T, n_heads, head_dim]` (bf16 values).
    pub attn: Vec<f32>,
    /// Output projection `[T, hidden]` (bf16 values), the input of `hc_post`.
    pub o_proj: Vec<f32>,
    /// CSA: each token's compressed candidates as the step's planning task chose them
    /// (`[T, candidates]`, compressed-cache slot `seq · max_rows + row`, −1 masked); empty for
    /// SWA and HCA, whose candidates the host writes.
    pub csa_picks: Vec<i32>,
    /// The run's timing.
    pub report: RunReport,
}

/// The caches as the worker holds them (after the steps run so far).
#[derive(Clone, Debug, PartialEq)]
pub struct AttnCaches {
    /// Window cache `[slots, head_dim]`.
    pub window: Vec<bf16>,
    /// HCA compressor state kv `[batch · ratio, head_dim]` (empty for SWA).
    pub state_kv: Vec<f32>,
    /// HCA compressor state scores (empty for SWA).
    pub state_score: Vec<f32>,
    /// HCA compressed cache `[batch · max_rows, head_dim]` (empty for SWA).
    pub compressed: Vec<bf16>,
    /// CSA: both compressors' rings, the compressed cache and the index cache.
    pub csa: Option<CsaCaches>,
}

/// A resident SWA or HCA layer with its caches.
#[derive(Debug)]
pub struct AttnLayer {
    kind: LayerKind,
    config: Dsv4Config,
    batch: usize,
    window: WindowCache,
    /// Weight and table buffers in `buf` order (`buf::WEIGHTS` of them).
    weights: Vec<Buffer>,
    window_buf: Buffer,
    hca: Option<HcaBuffers>,
    csa: Option<CsaBuffers>,
    hc_scale: [f32; 3],
    /// How steps are cut into tasks.
    pub tiles: AttnTiles,
    /// Whether steps replay a captured graph: the first step is captured, later steps of the
    /// same shape (tiles, call configuration) replay it without running the orchestration
    /// (`docs/runtime.md`, "Captured graphs"). A step's positions, slots and candidate lists
    /// are data the kernels read, so they never change the graph. Off: every step is
    /// orchestrated. The step's `RunReport::graph` says which ran.
    pub replay: bool,
    /// Whether a step that would replay the captured graph is orchestrated and captured
    /// instead and checked against it (`simpler_core::GraphCache::set_verify`): a difference
    /// fails the step, naming what the step's shape left out. For tests and debugging; only
    /// with `replay` on.
    pub verify_replay: bool,
    io: Option<StepIo>,
    graph: GraphCache,
}

/// What the host writes for a step: per token `(sequence, position, window slot)`, and the
/// window and compressed candidate lists (`-1`: masked).
struct HostPlan {
    tok: Vec<u32>,
    win: Vec<i32>,
    comp: Vec<i32>,
}

/// The step's host-written inputs and its output, sized for the layer's batch.
#[derive(Debug)]
struct StepIo {
    /// In `io_slot` order.
    bufs: Vec<Buffer>,
}

fn upload<T: Element>(w: &Worker, data: &[T]) -> Result<Buffer, Dsv4RunError> {
    if data.is_empty() {
        return Ok(w.alloc(4)?);
    }
    Ok(w.buffer_from(data)?)
}

impl AttnLayer {
    /// Uploads an SWA layer (`hca: None`) or an HCA layer (`hca: Some`) for steps of `batch`
    /// sequences.
    ///
    /// # Errors
    /// [`Dsv4RunError::Invalid`] naming the tensor whose shape does not match `cfg`; runtime
    /// errors from the uploads.
    pub fn upload(
        worker: &Worker,
        cfg: &Dsv4Config,
        weights: &AttnWeights,
        window: &WindowCache,
        hca: Option<&HcaParts>,
        batch: usize,
    ) -> Result<AttnLayer, Dsv4RunError> {
        AttnLayer::upload_with(worker, cfg, weights, window, hca, None, batch)
    }

    /// Uploads a CSA layer (its compressors, indexer and caches in `csa`) for steps of
    /// `batch` sequences.
    ///
    /// # Errors
    /// As [`AttnLayer::upload`]; the CSA tensors are named `csa.<field>`.
    pub fn upload_csa(
        worker: &Worker,
        cfg: &Dsv4Config,
        weights: &AttnWeights,
        window: &WindowCache,
        csa: &CsaParts,
        batch: usize,
    ) -> Result<AttnLayer, Dsv4RunError> {
        AttnLayer::upload_with(worker, cfg, weights, window, None, Some(csa), batch)
    }

    fn upload_with(
        worker: &Worker,
        cfg: &Dsv4Config,
        weights: &AttnWeights,
        window: &WindowCache,
        hca: Option<&HcaParts>,
        csa: Option<&CsaParts>,
        batch: usize,
    ) -> Result<AttnLayer, Dsv4RunError> {
        cfg.validate()
            .map_err(|e| Dsv4RunError::Invalid(e.to_string()))?;
        check_weights(cfg, weights, window, hca, batch)?;
        if let Some(p) = csa {
            check_csa(cfg, p, batch)?;
        }
        let kind = match (hca, csa) {
            (Some(_), _) => LayerKind::Hca,
            (None, Some(_)) => LayerKind::Csa,
            (None, None) => LayerKind::Swa,
        };
        let table = rope_table(cfg, kind);
        let layout = upload_layout(
            worker,
            Int8Use::Attention {
                rows: batch * TOKENS_PER_SEQ,
            },
        );
        let kg = cfg.heads_per_group() * cfg.head_dim;
        let int8 = |m: &Int8Matrix| stacked_in_layout(&m.q, 1, m.rows, m.cols, layout).into_owned();
        // An input projection `[rows, hidden]` (shapes checked above) in its GEMM's layout.
        let d = cfg.hidden;
        let proj = |w: &[bf16]| {
            let rows = w.len() / d.max(1);
            upload(
                worker,
                &projection_upload_layout(worker, rows, d).arrange_bf16(w, rows, d),
            )
        };
        let mut bufs = vec![
            upload(worker, &weights.hc.mix)?,
            upload(worker, &weights.hc.base)?,
            upload(worker, &weights.attn_norm)?,
            proj(&weights.wq_a)?,
            upload(worker, &weights.q_norm)?,
            upload(worker, &int8(&weights.wq_b))?,
            upload(worker, &weights.wq_b.scale)?,
            proj(&weights.wkv)?,
            upload(worker, &weights.kv_norm)?,
            upload(
                worker,
                &wo_a_upload_layout(worker, cfg.o_groups, cfg.o_lora_rank, kg).arrange_bf16(
                    &weights.wo_a,
                    cfg.o_groups * cfg.o_lora_rank,
                    kg,
                ),
            )?,
            upload(worker, &int8(&weights.wo_b))?,
            upload(worker, &weights.wo_b.scale)?,
            upload(worker, &weights.sink)?,
            upload(worker, table.cos())?,
            upload(worker, table.sin())?,
        ];
        let hca_bufs = match hca {
            Some(h) => {
                bufs.extend([
                    proj(&h.compressor.wkv)?,
                    proj(&h.compressor.wgate)?,
                    upload(worker, &h.compressor.ape)?,
                    upload(worker, &h.compressor.norm)?,
                ]);
                Some(HcaBuffers {
                    state_kv: upload(worker, &h.state.kv)?,
                    state_score: upload(worker, &h.state.score)?,
                    cache: upload(worker, &h.cache.rows)?,
                    ratio: h.state.ratio,
                    max_rows: h.cache.max_rows,
                })
            }
            None => None,
        };
        let csa_bufs = match csa {
            Some(p) => {
                bufs.extend([
                    proj(&p.compressor.wkv)?,
                    proj(&p.compressor.wgate)?,
                    upload(worker, &p.compressor.ape)?,
                    upload(worker, &p.compressor.norm)?,
                    proj(&p.index_compressor.wkv)?,
                    proj(&p.index_compressor.wgate)?,
                    upload(worker, &p.index_compressor.ape)?,
                    upload(worker, &p.index_compressor.norm)?,
                    upload(worker, &int8(&p.wq_idx))?,
                    upload(worker, &p.wq_idx.scale)?,
                    proj(&p.w_weights)?,
                ]);
                Some(CsaBuffers {
                    ring_kv: upload(worker, &p.state.kv)?,
                    ring_score: upload(worker, &p.state.score)?,
                    cache: upload(worker, &p.cache.rows)?,
                    index_ring_kv: upload(worker, &p.index_state.kv)?,
                    index_ring_score: upload(worker, &p.index_state.score)?,
                    index_q: upload(worker, &p.index_cache.q)?,
                    index_scale: upload(worker, &p.index_cache.scale)?,
                    max_rows: p.cache.max_rows,
                })
            }
            None => None,
        };
        debug_assert_eq!(
            bufs.len(),
            match kind {
                LayerKind::Swa => buf::WEIGHTS,
                LayerKind::Hca => buf::WEIGHTS_HCA,
                LayerKind::Csa => orchestrate_csa::buf::WEIGHTS_CSA,
            }
        );
        let tokens = batch * TOKENS_PER_SEQ;
        Ok(AttnLayer {
            kind,
            config: cfg.clone(),
            batch,
            window: WindowCache {
                rows: Vec::new(),
                ..window.clone()
            },
            weights: bufs,
            window_buf: upload(worker, &window.rows)?,
            hca: hca_bufs,
            csa: csa_bufs,
            hc_scale: weights.hc.scale,
            tiles: AttnTiles::for_cores(worker.cores(), tokens, cfg.n_heads),
            replay: true,
            verify_replay: false,
            io: None,
            graph: GraphCache::default(),
        })
    }

    /// The layer kind (SWA or HCA).
    pub fn kind(&self) -> LayerKind {
        self.kind
    }

    /// The configuration.
    pub fn config(&self) -> &Dsv4Config {
        &self.config
    }

    /// Compressed rows each token sees at most (0 for SWA).
    fn comp_width(&self) -> usize {
        match (&self.hca, &self.csa) {
            (Some(h), _) => (self.config.max_position / h.ratio).min(h.max_rows),
            (None, Some(_)) => orchestrate_csa::comp_width(&self.config),
            (None, None) => 0,
        }
    }

    /// The step's host plan: `tok` rows and the candidate lists.
    fn plan(&self, inputs: &StepInputs) -> Result<HostPlan, Dsv4RunError> {
        let c = &self.config;
        if inputs.starts.len() != self.batch {
            return Err(Dsv4RunError::Invalid(format!(
                "starts: {} sequences for a layer uploaded for {}",
                inputs.starts.len(),
                self.batch
            )));
        }
        if inputs.real_tokens.len() != self.batch {
            return Err(Dsv4RunError::Invalid(format!(
                "real_tokens: {} sequences for a layer uploaded for {}",
                inputs.real_tokens.len(),
                self.batch
            )));
        }
        if let Some((b, n)) = inputs
            .real_tokens
            .iter()
            .enumerate()
            .find(|&(_, &n)| n > TOKENS_PER_SEQ)
        {
            return Err(Dsv4RunError::Invalid(format!(
                "real_tokens[{b}]: {n} real tokens, a step has {TOKENS_PER_SEQ} rows a sequence"
            )));
        }
        let t_n = inputs.n_tokens();
        let want = t_n * c.hc_mult * c.hidden;
        if inputs.x_hc.len() != want {
            return Err(Dsv4RunError::Invalid(format!(
                "x_hc: {} values, expected {want} ({t_n} tokens x {} streams x {})",
                inputs.x_hc.len(),
                c.hc_mult,
                c.hidden
            )));
        }
        let (wn, cn) = (c.window, self.comp_width().max(1));
        let mut tok = Vec::with_capacity(t_n * TOK_COLS);
        let mut win = vec![-1i32; t_n * wn];
        let mut comp = vec![-1i32; t_n * cn];
        for t in 0..t_n {
            let (b, p) = (t / TOKENS_PER_SEQ, inputs.position(t));
            if p >= c.max_position {
                return Err(Dsv4RunError::Invalid(format!(
                    "starts[{b}]: position {p} is past max_position {}",
                    c.max_position
                )));
            }
            // The compressed rows this token needs (the row it closes, and every row before it
            // that its attention reads) must fit the layer's cache. Refused here, before the
            // step: the compressors would refuse a closing row past the cache only in the
            // middle of the graph, after the window cache and the compressor state were
            // written, and a token past the cache that closes no row would attend to fewer
            // rows than its position has (a padding row needs nothing).
            let compressed = match (&self.hca, &self.csa) {
                (Some(h), _) => Some((h.ratio, h.max_rows, "hca")),
                (None, Some(cb)) => Some((c.csa_ratio, cb.max_rows, "csa")),
                (None, None) => None,
            };
            if let Some((ratio, max_rows, which)) = compressed
                && !inputs.is_padding(t)
                && (p + 1) / ratio > max_rows
            {
                return Err(Dsv4RunError::Invalid(format!(
                    "starts[{b}]: position {p} needs compressed row {} of the {which} cache, which holds {max_rows} rows a sequence",
                    (p + 1) / ratio - 1
                )));
            }
            // A padding row's slot is the spec's −1: every kernel that writes a cache row,
            // compressor state or compressed row for a token skips it.
            let slot32 = if inputs.is_padding(t) {
                NO_SLOT
            } else {
                let slot = self.window.slot(b, p).ok_or_else(|| {
                    Dsv4RunError::Invalid(format!(
                        "starts[{b}]: position {p} has no page in the window cache's block table"
                    ))
                })?;
                u32::try_from(slot)
                    .ok()
                    .filter(|&s| s != NO_SLOT)
                    .ok_or_else(|| {
                        Dsv4RunError::Invalid(format!(
                            "window slot {slot} does not fit the token table"
                        ))
                    })?
            };
            // b < batch and p < max_position were checked: both fit u32.
            tok.extend([b as u32, p as u32, slot32]);
            for (i, q) in (p.saturating_sub(wn - 1)..=p).enumerate() {
                if let Some(s) = self.window.slot(b, q) {
                    win[t * wn + i] = i32::try_from(s).map_err(|_| {
                        Dsv4RunError::Invalid(format!("window slot {s} does not fit i32"))
                    })?;
                }
            }
            if let Some(h) = &self.hca {
                let visible = ((p + 1) / h.ratio).min(self.comp_width());
                for i in 0..visible {
                    comp[t * cn + i] = (b * h.max_rows + i) as i32;
                }
            }
        }
        Ok(HostPlan { tok, win, comp })
    }

    fn step_io(&mut self, worker: &Worker) -> Result<(), Dsv4RunError> {
        if self.io.is_none() {
            let c = &self.config;
            let t_n = self.batch * TOKENS_PER_SEQ;
            let x = t_n * c.hc_mult * c.hidden * 4;
            let q = t_n * c.n_heads * c.head_dim * 4;
            let sizes = [
                t_n * TOK_COLS * 4,
                t_n * c.window * 4,
                t_n * self.comp_width().max(1) * 4,
                x,
                // The queries and the attention output are bf16 (their values are rounded
                // where they are made).
                q / 2,
                q / 2,
                t_n * c.hidden * 4,
                x,
            ];
            debug_assert_eq!(sizes.len(), io_slot::COUNT);
            let bufs = sizes
                .iter()
                .map(|&b| worker.alloc(b))
                .collect::<Result<Vec<Buffer>, _>>()?;
            self.io = Some(StepIo { bufs });
        }
        Ok(())
    }

    /// One decode step: every token's new residual; the window cache (and for HCA the
    /// compressor state and compressed cache) are written in place.
    ///
    /// # Errors
    /// [`Dsv4RunError::Invalid`] for inputs that do not fit the layer (naming the field);
    /// runtime and buffer errors.
    pub fn step(
        &mut self,
        worker: &Worker,
        inputs: &StepInputs,
        cfg: &CallConfig,
    ) -> Result<AttnStepOutput, Dsv4RunError> {
        let HostPlan { tok, win, comp } = self.plan(inputs)?;
        let comp_len = comp.len();
        let plan = Arc::new(AttnPlan {
            config: self.config.clone(),
            kind: self.kind,
            tokens: inputs.n_tokens(),
            batch: self.batch,
            window_slots: self.window.block_table.len() * self.window.page_size,
            comp_width: self.comp_width(),
            comp_rows: match (&self.hca, &self.csa) {
                (Some(h), _) => h.max_rows,
                (None, Some(c)) => c.max_rows,
                (None, None) => 0,
            },
            rope_positions: self.config.max_position,
            tiles: self.tiles,
            hc_scale: self.hc_scale,
        });
        self.step_io(worker)?;
        let io = self.io.as_ref().expect("allocated by step_io");
        io.bufs[io_slot::TOK].write(&tok)?;
        io.bufs[io_slot::WIN].write(&win)?;
        io.bufs[io_slot::COMP].write(&comp)?;
        io.bufs[io_slot::X].write(&inputs.x_hc)?;
        let outs = io.bufs.clone();
        let mut buffers = self.weights.clone();
        buffers.push(self.window_buf.clone());
        if let Some(h) = &self.hca {
            buffers.extend([h.state_kv.clone(), h.state_score.clone(), h.cache.clone()]);
        }
        if let Some(c) = &self.csa {
            buffers.extend([
                c.ring_kv.clone(),
                c.ring_score.clone(),
                c.cache.clone(),
                c.index_ring_kv.clone(),
                c.index_ring_score.clone(),
                c.index_q.clone(),
                c.index_scale.clone(),
            ]);
        }
        buffers.extend(io.bufs.iter().cloned());
        let name = match self.kind {
            LayerKind::Hca => "dsv4.hca_decode",
            LayerKind::Csa => "dsv4.csa_decode",
            LayerKind::Swa => "dsv4.swa_decode",
        };
        let args = RunArgs {
            buffers,
            scalars: Vec::new(),
        };
        let report = self.run_graph(worker, name, args, cfg, plan)?;
        let c = &self.config;
        let t_n = inputs.n_tokens();
        let q = t_n * c.n_heads * c.head_dim;
        Ok(AttnStepOutput {
            x_out: outs[io_slot::X_OUT].read_at::<f32>(0, inputs.x_hc.len())?,
            q: outs[io_slot::Q]
                .read_at::<bf16>(0, q)?
                .iter()
                .map(|v| v.to_f32())
                .collect(),
            attn: outs[io_slot::ATTN]
                .read_at::<bf16>(0, q)?
                .iter()
                .map(|v| v.to_f32())
                .collect(),
            o_proj: outs[io_slot::Y].read_at::<f32>(0, t_n * c.hidden)?,
            csa_picks: if self.kind == LayerKind::Csa {
                outs[io_slot::COMP].read_at::<i32>(0, comp_len)?
            } else {
                Vec::new()
            },
            report,
        })
    }

    /// Runs the step's graph: replayed when a graph of the same shape was captured on the same
    /// buffers and environment, otherwise orchestrated (and captured when `replay` is on).
    fn run_graph(
        &mut self,
        worker: &Worker,
        name: &str,
        args: RunArgs,
        cfg: &CallConfig,
        plan: Arc<AttnPlan>,
    ) -> Result<RunReport, Dsv4RunError> {
        if !self.replay {
            return Ok(worker.run_fn(name, args, cfg, move |o, a| {
                orchestrate::attn_step(o, a, &plan)
            })?);
        }
        let shape = step_shape(&plan);
        self.graph.set_verify(self.verify_replay);
        Ok(self
            .graph
            .run(worker, name, args, cfg, shape, move |o, a| {
                orchestrate::attn_step(o, a, &plan)
            })?)
    }

    /// The captured step graph the next step would replay, if any.
    pub fn step_graph(&self) -> Option<&CapturedGraph> {
        self.graph.graph()
    }

    /// Reads the caches back from the worker.
    ///
    /// # Errors
    /// Buffer errors.
    pub fn read_caches(&self) -> Result<AttnCaches, Dsv4RunError> {
        let hd = self.config.head_dim;
        let slots = self.window.block_table.len() * self.window.page_size;
        let mut caches = AttnCaches {
            window: self.window_buf.read_at::<bf16>(0, slots * hd)?,
            state_kv: Vec::new(),
            state_score: Vec::new(),
            compressed: Vec::new(),
            csa: None,
        };
        if let Some(h) = &self.hca {
            let n = self.batch * h.ratio * hd;
            caches.state_kv = h.state_kv.read_at::<f32>(0, n)?;
            caches.state_score = h.state_score.read_at::<f32>(0, n)?;
            caches.compressed = h.cache.read_at::<bf16>(0, self.batch * h.max_rows * hd)?;
        }
        if let Some(cb) = &self.csa {
            let c = &self.config;
            let ring = self.batch * 2 * c.csa_ratio;
            let rows = self.batch * cb.max_rows;
            let iw = c.index_head_dim;
            caches.csa = Some(CsaCaches {
                ring_kv: cb.ring_kv.read_at::<f32>(0, ring * 2 * hd)?,
                ring_score: cb.ring_score.read_at::<f32>(0, ring * 2 * hd)?,
                compressed: cb.cache.read_at::<bf16>(0, rows * hd)?,
                index_ring_kv: cb.index_ring_kv.read_at::<f32>(0, ring * 2 * iw)?,
                index_ring_score: cb.index_ring_score.read_at::<f32>(0, ring * 2 * iw)?,
                index_q: cb.index_q.read_at::<i8>(0, rows * iw)?,
                index_scale: cb.index_scale.read_at::<f32>(0, rows)?,
            });
        }
        Ok(caches)
    }
}

/// What shapes a step's graph: everything of the plan (the host-written positions, slots and
/// candidate lists are data the kernels read). The configuration's numbers that reach the
/// graph as shapes or scalars are fixed by the upload, so the layer kind stands for them.
fn step_shape(p: &AttnPlan) -> GraphShape {
    let kind = match p.kind {
        LayerKind::Swa => 0,
        LayerKind::Hca => 1,
        LayerKind::Csa => 2,
    };
    GraphShape::new()
        .with("kind", kind)
        .with("tokens", p.tokens as u64)
        .with("batch", p.batch as u64)
        .with("window_slots", p.window_slots as u64)
        .with("comp_width", p.comp_width as u64)
        .with("comp_rows", p.comp_rows as u64)
        .with("rope_positions", p.rope_positions as u64)
        .with("tiles.proj_blocks", u64::from(p.tiles.proj_blocks))
        .with("tiles.head_blocks", p.tiles.head_blocks as u64)
        .with("tiles.vector_blocks", u64::from(p.tiles.vector_blocks))
}

/// The layer's RoPE table: plain θ for SWA, YaRN with the compressed θ for HCA and CSA.
pub fn rope_table(cfg: &Dsv4Config, kind: LayerKind) -> RopeTable {
    let freq = match kind {
        LayerKind::Swa => rope_inv_freq_plain(cfg.rope_theta, cfg.rope_dim),
        LayerKind::Csa | LayerKind::Hca => rope_inv_freq_yarn(
            cfg.compress_rope_theta,
            cfg.rope_dim,
            YarnRamp {
                factor: cfg.yarn.factor,
                beta_fast: cfg.yarn.beta_fast,
                beta_slow: cfg.yarn.beta_slow,
                original_len: cfg.yarn.original_max_position,
            },
        ),
    };
    RopeTable::new(&freq, cfg.max_position)
}

/// Checks every tensor's length against `cfg`; the error names the tensor.
fn check_weights(
    cfg: &Dsv4Config,
    w: &AttnWeights,
    window: &WindowCache,
    hca: Option<&HcaParts>,
    batch: usize,
) -> Result<(), Dsv4RunError> {
    let (d, hd, h) = (cfg.hidden, cfg.head_dim, cfg.n_heads);
    let (ql, g, r) = (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank);
    let m = cfg.hc_mix();
    let mut checks: Vec<(&str, usize, usize)> = vec![
        ("hc.mix", w.hc.mix.len(), m * cfg.hc_mult * d),
        ("hc.base", w.hc.base.len(), m),
        ("attn_norm", w.attn_norm.len(), d),
        ("wq_a", w.wq_a.len(), ql * d),
        ("q_norm", w.q_norm.len(), ql),
        ("wq_b", w.wq_b.q.len(), h * hd * ql),
        ("wq_b.scale", w.wq_b.scale.len(), h * hd),
        ("wkv", w.wkv.len(), hd * d),
        ("kv_norm", w.kv_norm.len(), hd),
        ("wo_a", w.wo_a.len(), g * r * cfg.heads_per_group() * hd),
        ("wo_b", w.wo_b.q.len(), d * g * r),
        ("wo_b.scale", w.wo_b.scale.len(), d),
        ("sink", w.sink.len(), h),
        ("window.width", window.width, hd),
        (
            "window.block_table",
            window.block_table.len(),
            batch * window.max_blocks,
        ),
        (
            "window.rows",
            window.rows.len(),
            window.block_table.len() * window.page_size * hd,
        ),
    ];
    if let Some(p) = hca {
        let ratio = cfg.hca_ratio;
        checks.extend([
            ("hca.compressor.wkv", p.compressor.wkv.len(), hd * d),
            ("hca.compressor.wgate", p.compressor.wgate.len(), hd * d),
            ("hca.compressor.ape", p.compressor.ape.len(), ratio * hd),
            ("hca.compressor.norm", p.compressor.norm.len(), hd),
            ("hca.state.ratio", p.state.ratio, ratio),
            ("hca.state.width", p.state.width, hd),
            ("hca.state.kv", p.state.kv.len(), batch * ratio * hd),
            ("hca.state.score", p.state.score.len(), batch * ratio * hd),
            ("hca.cache.width", p.cache.width, hd),
            (
                "hca.cache.rows",
                p.cache.rows.len(),
                batch.saturating_mul(p.cache.max_rows).saturating_mul(hd),
            ),
            // Candidate slots `seq · max_rows + row` are i32 (−1 masks).
            (
                "hca.cache.max_rows",
                usize::from(batch.saturating_mul(p.cache.max_rows) <= i32::MAX as usize),
                1,
            ),
        ]);
    }
    if batch == 0 {
        return Err(Dsv4RunError::Invalid(
            "batch: at least one sequence is needed".into(),
        ));
    }
    if let Some(&b) = window
        .block_table
        .iter()
        .find(|&&b| (b + 1) * window.page_size * hd > window.rows.len())
    {
        return Err(Dsv4RunError::Invalid(format!(
            "window.block_table: page {b} outside the pool"
        )));
    }
    for (name, got, want) in checks {
        if got != want {
            return Err(Dsv4RunError::Invalid(format!(
                "{name}: {got}, expected {want} for this configuration"
            )));
        }
    }
    Ok(())
}

/// Checks the CSA tensors' lengths against `cfg`; the error names the tensor (`csa.<field>`).
fn check_csa(cfg: &Dsv4Config, p: &CsaParts, batch: usize) -> Result<(), Dsv4RunError> {
    let (d, hd, iw, ih) = (
        cfg.hidden,
        cfg.head_dim,
        cfg.index_head_dim,
        cfg.index_heads,
    );
    let ratio = cfg.csa_ratio;
    let ring = batch * 2 * ratio;
    let rows = p.cache.max_rows;
    let checks: [(&str, usize, usize); 26] = [
        ("csa.compressor.wkv", p.compressor.wkv.len(), 2 * hd * d),
        ("csa.compressor.wgate", p.compressor.wgate.len(), 2 * hd * d),
        ("csa.compressor.ape", p.compressor.ape.len(), ratio * 2 * hd),
        ("csa.compressor.norm", p.compressor.norm.len(), hd),
        (
            "csa.index_compressor.wkv",
            p.index_compressor.wkv.len(),
            2 * iw * d,
        ),
        (
            "csa.index_compressor.wgate",
            p.index_compressor.wgate.len(),
            2 * iw * d,
        ),
        (
            "csa.index_compressor.ape",
            p.index_compressor.ape.len(),
            ratio * 2 * iw,
        ),
        (
            "csa.index_compressor.norm",
            p.index_compressor.norm.len(),
            iw,
        ),
        ("csa.state.ratio", p.state.ratio, ratio),
        ("csa.state.width", p.state.width, hd),
        ("csa.state.kv", p.state.kv.len(), ring * 2 * hd),
        ("csa.state.score", p.state.score.len(), ring * 2 * hd),
        ("csa.index_state.ratio", p.index_state.ratio, ratio),
        ("csa.index_state.width", p.index_state.width, iw),
        ("csa.index_state.kv", p.index_state.kv.len(), ring * 2 * iw),
        (
            "csa.index_state.score",
            p.index_state.score.len(),
            ring * 2 * iw,
        ),
        ("csa.cache.width", p.cache.width, hd),
        (
            "csa.cache.rows",
            p.cache.rows.len(),
            batch.saturating_mul(rows).saturating_mul(hd),
        ),
        ("csa.index_cache.width", p.index_cache.width, iw),
        ("csa.index_cache.max_rows", p.index_cache.max_rows, rows),
        (
            "csa.index_cache.q",
            p.index_cache.q.len(),
            batch.saturating_mul(rows).saturating_mul(iw),
        ),
        (
            "csa.index_cache.scale",
            p.index_cache.scale.len(),
            batch.saturating_mul(rows),
        ),
        ("csa.wq_idx.q", p.wq_idx.q.len(), ih * iw * cfg.q_lora_rank),
        ("csa.wq_idx.scale", p.wq_idx.scale.len(), ih * iw),
        ("csa.w_weights", p.w_weights.len(), ih * d),
        (
            "csa.cache.max_rows",
            usize::from(rows > 0 && batch.saturating_mul(rows) <= i32::MAX as usize),
            1,
        ),
    ];
    for (name, got, want) in checks {
        if got != want {
            return Err(Dsv4RunError::Invalid(format!(
                "{name}: {got}, expected {want} for this configuration"
            )));
        }
    }
    Ok(())
}
