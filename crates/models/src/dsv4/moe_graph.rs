//! The MoE layer's decode step as a task graph (`docs/dsv4.md`, "MoE on the runtime"):
//!
//! ```text
//! hc_pre (no norm)      x_hc [T,hc·D] -> x_mixed [T,D], hc weights [T,M] (pre, post, comb)
//! route (SPMD rows)     x_mixed -> xq, xs [T] (bound [T,1]); experts, weights [T,K]
//! dispatch              -> counts [L], offsets [L+1], rows i8 [C,D], scales, weights, route ids [C]
//! shared gate_up/quant/down   xq -> shared [S,T,D]              (every token, weight 1)
//! routed gate_up (SPMD) rows -> h [C,I]; quant_h -> hq, hs (weight folded); down (SPMD) -> y [C,D]
//! combine (SPMD)        y -> routed [T,K,D] in route order
//! reduce                -> y [T,D] = bf16(shared + Σ routed)
//! hc_post               -> x_out [T,hc,D]
//! ```
//!
//! # The expert-parallel seam
//! Dispatch and combine are the only tasks that know where an expert lives: dispatch writes the
//! rows for the local experts of [`ExpertPlacement`] (`rank`'s range) into explicit tensors
//! (counts, offsets, int8 rows, scales, routing weights, route ids), the expert phases read
//! only those tensors, and combine scatters the expert outputs back by route id. A node level
//! replaces the dispatch task with "exchange counts, all-to-all the rows" writing the same
//! tensors and the combine task with "all-to-all back, scatter by route id", leaving route,
//! the expert phases and reduce as they are. The expert phases are SPMD over the output
//! columns of the groups with rows, laid end to end (each block one long call per group it
//! reaches), so an expert without a token costs a read of the offsets and nothing else.

use std::ops::Range;
use std::sync::Arc;

use simpler_core::{
    Buffer, CallConfig, DType, Orchestrator, RunArgs, RunError, RunReport, Task, TaskId, Tensor,
    Worker,
};

use super::config::Dsv4Config;
use super::fixture::{Expert, Int8Matrix, MoeWeights};
use super::int8_layout::{Int8Use, stacked_in_layout, upload_layout};
use super::moe_ops::{self, idx};

/// Where the routed experts live: `per_rank` consecutive experts per rank, expert `e` on rank
/// `e / per_rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertPlacement {
    /// Routed experts in all.
    pub n_experts: usize,
    /// Experts per rank.
    pub per_rank: usize,
}

impl ExpertPlacement {
    /// Every expert on one rank.
    pub fn single(n_experts: usize) -> ExpertPlacement {
        ExpertPlacement {
            n_experts,
            per_rank: n_experts,
        }
    }

    /// Ranks of the placement.
    pub fn ranks(&self) -> usize {
        self.n_experts.div_ceil(self.per_rank.max(1))
    }

    /// The rank holding expert `e`.
    pub fn rank_of(&self, e: usize) -> usize {
        e / self.per_rank.max(1)
    }

    /// The experts of `rank`.
    pub fn local(&self, rank: usize) -> Range<usize> {
        let a = (rank * self.per_rank).min(self.n_experts);
        a..(a + self.per_rank).min(self.n_experts)
    }
}

/// A MoE step that cannot run; names the bad input.
#[derive(Debug, thiserror::Error)]
pub enum MoeRunError {
    /// The inputs do not fit the layer.
    #[error("dsv4 moe: {0}")]
    Invalid(String),
    /// The runtime failed (a kernel error names the kernel).
    #[error(transparent)]
    Runtime(#[from] simpler_core::Error),
    /// A run error.
    #[error(transparent)]
    Run(#[from] RunError),
    /// A buffer could not be read or written.
    #[error(transparent)]
    Buffer(#[from] simpler_core::BufferError),
}

/// Buffers of a MoE run, in order.
mod io {
    pub(super) const FFN_NORM: usize = 0;
    pub(super) const GATE: usize = 1;
    pub(super) const BIAS: usize = 2;
    pub(super) const HASH: usize = 3;
    /// W1, S1, W3, S3, W2, S2 of the local routed experts.
    pub(super) const ROUTED: usize = 4;
    /// The same six of the shared experts.
    pub(super) const SHARED: usize = 10;
    pub(super) const HC_MIX: usize = 16;
    pub(super) const HC_BASE: usize = 17;
    /// Weights end here.
    pub(super) const WEIGHTS: usize = 18;
    pub(super) const X_HC: usize = WEIGHTS;
    pub(super) const TOKENS: usize = WEIGHTS + 1;
    pub(super) const Y: usize = WEIGHTS + 2;
    pub(super) const SHARED_OUT: usize = WEIGHTS + 3;
    pub(super) const ROUTED_OUT: usize = WEIGHTS + 4;
    pub(super) const EXPERTS: usize = WEIGHTS + 5;
    pub(super) const ROUTE_W: usize = WEIGHTS + 6;
    pub(super) const X_OUT: usize = WEIGHTS + 7;
    pub(super) const X_MIXED: usize = WEIGHTS + 8;
    pub(super) const HCW: usize = WEIGHTS + 9;
    pub(super) const COUNT: usize = WEIGHTS + 10;

    /// The front graph (`hc_pre`, route) of an expert-parallel step, after the weights.
    pub(super) mod front {
        use super::WEIGHTS;
        pub(crate) const X_HC: usize = WEIGHTS;
        pub(crate) const TOKENS: usize = WEIGHTS + 1;
        pub(crate) const X_MIXED: usize = WEIGHTS + 2;
        pub(crate) const HCW: usize = WEIGHTS + 3;
        pub(crate) const XQ: usize = WEIGHTS + 4;
        pub(crate) const XS: usize = WEIGHTS + 5;
        pub(crate) const EXPERTS: usize = WEIGHTS + 6;
        pub(crate) const ROUTE_W: usize = WEIGHTS + 7;
        pub(crate) const COUNT: usize = WEIGHTS + 8;
    }

    /// The expert graph (shared experts on the own tokens, local experts on the received
    /// rows), after the weights.
    pub(super) mod expert {
        use super::WEIGHTS;
        pub(crate) const XQ: usize = WEIGHTS;
        pub(crate) const XS: usize = WEIGHTS + 1;
        pub(crate) const SHARED_OUT: usize = WEIGHTS + 2;
        pub(crate) const ROWS: usize = WEIGHTS + 3;
        pub(crate) const SCALES: usize = WEIGHTS + 4;
        pub(crate) const ROW_W: usize = WEIGHTS + 5;
        pub(crate) const OFFSETS: usize = WEIGHTS + 6;
        pub(crate) const Y_ROWS: usize = WEIGHTS + 7;
        pub(crate) const COUNT: usize = WEIGHTS + 8;
    }

    /// The back graph (reduce, `hc_post`), after the weights.
    pub(super) mod back {
        use super::WEIGHTS;
        pub(crate) const X_HC: usize = WEIGHTS;
        pub(crate) const HCW: usize = WEIGHTS + 1;
        pub(crate) const SHARED_OUT: usize = WEIGHTS + 2;
        pub(crate) const ROUTED_OUT: usize = WEIGHTS + 3;
        pub(crate) const Y: usize = WEIGHTS + 4;
        pub(crate) const X_OUT: usize = WEIGHTS + 5;
        pub(crate) const COUNT: usize = WEIGHTS + 6;
    }
}

/// A MoE layer's weights resident in worker buffers: the gate, the shared experts and the
/// routed experts of one rank of `placement`.
#[derive(Debug)]
pub struct MoeLayer {
    config: Dsv4Config,
    placement: ExpertPlacement,
    rank: usize,
    /// Layer index (below `n_hash_layers`: hash routing).
    pub layer: usize,
    hc_scale: [f32; 3],
    weights: Vec<Buffer>,
}

/// What one MoE step produced (the golden's `MoeStep` parts).
#[derive(Clone, Debug)]
pub struct MoeOutput {
    /// New residual `[T, hc, D]`.
    pub x_out: Vec<f32>,
    /// `hc_pre`'s mixed stream `[T, D]` (bf16 values).
    pub x_mixed: Vec<f32>,
    /// `hc_pre`'s post weights `[T, hc]`.
    pub post: Vec<f32>,
    /// `hc_pre`'s Sinkhorn-normalised comb `[T, hc, hc]`.
    pub comb: Vec<f32>,
    /// `bf16(shared + Σ routed)` `[T, D]`, as f32.
    pub y: Vec<f32>,
    /// Shared experts' outputs `[S, T, D]`.
    pub shared: Vec<f32>,
    /// Routed contributions `[T, K, D]` in route order.
    pub routed: Vec<f32>,
    /// Chosen experts `[T, K]`.
    pub experts: Vec<u32>,
    /// Routing weights `[T, K]`.
    pub weights: Vec<f32>,
    /// The run's timing.
    pub report: RunReport,
}

/// Shapes of one run, computed on the host.
#[derive(Clone, Debug)]
struct Plan {
    d: usize,
    inter: usize,
    top_k: usize,
    n_experts: usize,
    n_shared: usize,
    local: Range<usize>,
    tokens: usize,
    capacity: usize,
    vocab: usize,
    eps: f32,
    route_scale: f32,
    limit: f32,
    hash: bool,
    /// SPMD blocks of the column-split phases (combine; the routed experts' phases).
    blocks: u32,
    /// SPMD blocks of each shared expert's phases.
    shared_blocks: u32,
    /// SPMD blocks of `hc_pre` (token rows).
    row_blocks: u32,
    hc: usize,
    hc_scale: [f32; 3],
    hc_eps: f32,
    hc_iters: usize,
}

fn upload<T: simpler_core::Element>(w: &Worker, data: &[T]) -> Result<Buffer, MoeRunError> {
    Ok(w.buffer_from(data)?)
}

/// The six buffers (W1, S1, W3, S3, W2, S2) of `experts`, each stacked `[G, ...]`.
fn expert_buffers(w: &Worker, experts: &[&Expert]) -> Result<Vec<Buffer>, MoeRunError> {
    let mut out = Vec::with_capacity(6);
    let layout = upload_layout(w, Int8Use::Experts);
    let pick: [fn(&Expert) -> &Int8Matrix; 3] = [|e| &e.w1, |e| &e.w3, |e| &e.w2];
    for pick in pick {
        let q: Vec<i8> = experts
            .iter()
            .flat_map(|e| pick(e).q.iter().copied())
            .collect();
        // Every expert of a layer has the same shape (`MoeLayer::new` checked it).
        let (rows, cols) = experts
            .first()
            .map_or((0, 0), |e| (pick(e).rows, pick(e).cols));
        let q = stacked_in_layout(&q, experts.len(), rows, cols, layout);
        let s: Vec<f32> = experts
            .iter()
            .flat_map(|e| pick(e).scale.iter().copied())
            .collect();
        // A rank without experts still binds a (one-element) buffer.
        out.push(upload(w, if q.is_empty() { &[0i8][..] } else { &q })?);
        out.push(upload(w, if s.is_empty() { &[0.0f32][..] } else { &s })?);
    }
    Ok(out)
}

impl MoeLayer {
    /// Uploads layer `layer`'s MoE weights for `rank` of `placement` (the gate and the shared
    /// experts on every rank, the routed experts of the rank's range). `w.routed` holds every
    /// routed expert or only the rank's range
    /// ([`generate_moe_weights_local`](super::fixture::generate_moe_weights_local)).
    pub fn new(
        worker: &Worker,
        config: &Dsv4Config,
        w: &MoeWeights,
        layer: usize,
        placement: ExpertPlacement,
        rank: usize,
    ) -> Result<MoeLayer, MoeRunError> {
        config
            .validate()
            .map_err(|e| MoeRunError::Invalid(e.to_string()))?;
        if placement.n_experts != config.n_routed_experts
            || placement.per_rank == 0
            || rank >= placement.ranks()
        {
            return Err(MoeRunError::Invalid(format!(
                "placement {placement:?} rank {rank} does not fit {} routed experts",
                config.n_routed_experts
            )));
        }
        let (d, e, k) = (
            config.hidden,
            config.n_routed_experts,
            config.n_activated_experts,
        );
        for (what, got, want) in [
            ("ffn_norm", w.ffn_norm.len(), d),
            ("gate", w.gate.len(), e * d),
            ("bias", w.bias.len(), e),
            ("tid2eid", w.tid2eid.len(), config.vocab_size * k),
            (
                "routed experts",
                w.routed.len(),
                // Every routed expert, or only this rank's (a rank need not hold the others).
                if w.routed.len() == placement.local(rank).len() {
                    w.routed.len()
                } else {
                    e
                },
            ),
            ("shared experts", w.shared.len(), config.n_shared_experts),
            (
                "hc.mix",
                w.hc.mix.len(),
                config.hc_mix() * config.hc_mult * d,
            ),
            ("hc.base", w.hc.base.len(), config.hc_mix()),
        ] {
            if got != want {
                return Err(MoeRunError::Invalid(format!(
                    "moe weights `{what}`: {got} elements, expected {want}"
                )));
            }
        }
        if layer < config.n_hash_layers
            && let Some(why) = super::fixture::hash_table_error(config, &w.tid2eid)
        {
            return Err(MoeRunError::Invalid(format!(
                "moe weights `tid2eid`: {why}"
            )));
        }
        let (i, dd) = (config.moe_inter_dim, config.hidden);
        for (n, ex) in w.routed.iter().chain(&w.shared).enumerate() {
            for (what, m, r, c) in [
                ("w1", &ex.w1, i, dd),
                ("w3", &ex.w3, i, dd),
                ("w2", &ex.w2, dd, i),
            ] {
                if (m.rows, m.cols, m.q.len(), m.scale.len()) != (r, c, r * c, r) {
                    return Err(MoeRunError::Invalid(format!(
                        "expert {n} `{what}` is [{}, {}], expected [{r}, {c}]",
                        m.rows, m.cols
                    )));
                }
            }
        }
        let mut weights = vec![
            upload(worker, &w.ffn_norm)?,
            upload(worker, &w.gate)?,
            upload(worker, &w.bias)?,
            upload(worker, &w.tid2eid)?,
        ];
        let local: Vec<&Expert> = if w.routed.len() == e {
            w.routed[placement.local(rank)].iter().collect()
        } else {
            w.routed.iter().collect()
        };
        weights.extend(expert_buffers(worker, &local)?);
        let shared: Vec<&Expert> = w.shared.iter().collect();
        weights.extend(expert_buffers(worker, &shared)?);
        weights.push(upload(worker, &w.hc.mix)?);
        weights.push(upload(worker, &w.hc.base)?);
        debug_assert_eq!(weights.len(), io::WEIGHTS);
        Ok(MoeLayer {
            config: config.clone(),
            placement,
            rank,
            layer,
            hc_scale: w.hc.scale,
            weights,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Dsv4Config {
        &self.config
    }

    /// This rank's routed experts.
    pub fn local_experts(&self) -> Range<usize> {
        self.placement.local(self.rank)
    }

    fn plan(&self, tokens: usize, cores: usize) -> Plan {
        let c = &self.config;
        let local = self.local_experts();
        Plan {
            d: c.hidden,
            inter: c.moe_inter_dim,
            top_k: c.n_activated_experts,
            n_experts: c.n_routed_experts,
            n_shared: c.n_shared_experts,
            // Every route may pick a local expert (a token picks an expert at most once).
            capacity: tokens * c.n_activated_experts.min(local.len()).max(1),
            local,
            tokens,
            vocab: c.vocab_size,
            eps: c.rms_eps,
            route_scale: c.route_scale,
            limit: c.swiglu_limit,
            hash: self.layer < c.n_hash_layers,
            // Blocks of the routed experts' phases: 16 per core, tapered, so the phase ends on
            // blocks of ~100 columns of one expert and the cores finish together, while a full
            // block still spans most of an expert (at FLASH widths, ~1850 of gate/up's 2048
            // columns with 16 active experts on 2 cores).
            blocks: u32::try_from(16 * cores.max(1)).unwrap_or(u32::MAX),
            // A shared expert is one group: 2 blocks per core keep its calls long (512 of
            // 2048 columns on 2 cores) and give every core a share.
            shared_blocks: u32::try_from(2 * cores.max(1)).unwrap_or(u32::MAX),
            row_blocks: u32::try_from(cores.clamp(1, tokens.max(1))).unwrap_or(1),
            hc: c.hc_mult,
            hc_scale: self.hc_scale,
            hc_eps: c.hc_eps,
            hc_iters: c.hc_sinkhorn_iters,
        }
    }

    /// Checks a step's residual (`[T, hc, D]`) and token ids against the layer.
    fn check_inputs(&self, x_hc: &[f32], token_ids: &[u32]) -> Result<(), MoeRunError> {
        let c = &self.config;
        let t = token_ids.len();
        if t == 0 || x_hc.len() != t * c.hc_mult * c.hidden {
            return Err(MoeRunError::Invalid(format!(
                "x_hc of {} elements for {t} tokens of {} x {}",
                x_hc.len(),
                c.hc_mult,
                c.hidden
            )));
        }
        if let Some((r, &id)) = token_ids
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= c.vocab_size)
        {
            return Err(MoeRunError::Invalid(format!(
                "token id {id} of row {r} is past vocab_size {}",
                c.vocab_size
            )));
        }
        Ok(())
    }

    /// One step on the residual `x_hc` (`[T, hc, D]` fp32) with the tokens' ids (hash routing
    /// reads them), every route computed on this rank (single-rank placement).
    pub fn step(
        &self,
        worker: &Worker,
        x_hc: &[f32],
        token_ids: &[u32],
        cfg: &CallConfig,
    ) -> Result<MoeOutput, MoeRunError> {
        let c = &self.config;
        let t = token_ids.len();
        if self.placement.ranks() != 1 {
            return Err(MoeRunError::Invalid(format!(
                "a step on one worker needs every expert local; the placement has {} ranks \
                 (the node level runs the expert-parallel step)",
                self.placement.ranks()
            )));
        }
        self.check_inputs(x_hc, token_ids)?;
        let (d, k, s) = (c.hidden, c.n_activated_experts, c.n_shared_experts);
        let mut buffers = self.weights.clone();
        buffers.push(upload(worker, x_hc)?);
        buffers.push(upload(worker, token_ids)?);
        let x_out = t * c.hc_mult * d * 4;
        for bytes in [
            t * d * 4,
            s * t * d * 4,
            t * k * d * 4,
            t * k * 4,
            t * k * 4,
            x_out,
            t * d * 4,
            t * c.hc_mix() * 4,
        ] {
            buffers.push(worker.alloc(bytes)?);
        }
        debug_assert_eq!(buffers.len(), io::COUNT);
        let plan = Arc::new(self.plan(t, worker.cores()));
        let args = RunArgs {
            buffers: buffers.clone(),
            scalars: Vec::new(),
        };
        let report = worker.run_fn("dsv4.moe", args, cfg, move |o, a| graph(o, a, &plan))?;
        let hcw: Vec<f32> = buffers[io::HCW].read()?;
        let (hc, m) = (c.hc_mult, c.hc_mix());
        Ok(MoeOutput {
            x_out: buffers[io::X_OUT].read()?,
            x_mixed: buffers[io::X_MIXED].read()?,
            post: hc_part(&hcw, m, hc..2 * hc),
            comb: hc_part(&hcw, m, 2 * hc..m),
            y: buffers[io::Y].read()?,
            shared: buffers[io::SHARED_OUT].read()?,
            routed: buffers[io::ROUTED_OUT].read()?,
            experts: buffers[io::EXPERTS].read()?,
            weights: buffers[io::ROUTE_W].read()?,
            report,
        })
    }

    /// This rank's placement of the routed experts.
    pub fn placement(&self) -> ExpertPlacement {
        self.placement
    }

    /// The rank this layer's routed experts belong to.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The buffers of a graph: the weights, then `extra`.
    fn args(&self, extra: Vec<Buffer>) -> RunArgs {
        let mut buffers = self.weights.clone();
        buffers.extend(extra);
        RunArgs {
            buffers,
            scalars: Vec::new(),
        }
    }

    /// The front of an expert-parallel step on this rank's tokens: `hc_pre` and route
    /// (`docs/dsv4.md`, "Expert parallelism"). What it returns feeds
    /// [`moe_ep::pack_dispatch`](super::moe_ep::pack_dispatch), [`MoeLayer::expert_step`]
    /// and [`MoeLayer::back_step`].
    pub fn front_step(
        &self,
        worker: &Worker,
        x_hc: &[f32],
        token_ids: &[u32],
        cfg: &CallConfig,
    ) -> Result<MoeFront, MoeRunError> {
        self.check_inputs(x_hc, token_ids)?;
        let c = &self.config;
        let (t, d, k) = (token_ids.len(), c.hidden, c.n_activated_experts);
        let x_hc = upload(worker, x_hc)?;
        let mut extra = vec![x_hc.clone(), upload(worker, token_ids)?];
        for bytes in [
            t * d * 4,
            t * c.hc_mix() * 4,
            t * d,
            t * 4,
            t * k * 4,
            t * k * 4,
        ] {
            extra.push(worker.alloc(bytes)?);
        }
        let args = self.args(extra);
        let buffers = args.buffers.clone();
        let plan = Arc::new(self.plan(t, worker.cores()));
        let report = worker.run_fn("dsv4.moe.front", args, cfg, move |o, a| {
            front_graph(o, a, &plan)
        })?;
        use io::front as f;
        Ok(MoeFront {
            tokens: t,
            x_hc,
            x_mixed: buffers[f::X_MIXED].clone(),
            hcw: buffers[f::HCW].clone(),
            xq_buf: buffers[f::XQ].clone(),
            xs_buf: buffers[f::XS].clone(),
            xq: buffers[f::XQ].read()?,
            xs: buffers[f::XS].read()?,
            experts: buffers[f::EXPERTS].read()?,
            weights: buffers[f::ROUTE_W].read()?,
            report,
        })
    }

    /// The expert phases of an expert-parallel step: the shared experts on this rank's tokens
    /// (`front`) and this rank's routed experts on the rows it received (`rows`).
    pub fn expert_step(
        &self,
        worker: &Worker,
        front: &MoeFront,
        rows: &ReceivedRows,
        cfg: &CallConfig,
    ) -> Result<ExpertOutput, MoeRunError> {
        let c = &self.config;
        let (t, d) = (front.tokens, c.hidden);
        let local = self.local_experts().len();
        if rows.offsets.len() != local + 1 || rows.scales.len() * d != rows.q.len() {
            return Err(MoeRunError::Invalid(format!(
                "received rows: {} offsets and {} scales for {} int8 values; this rank has {local} experts of width {d}",
                rows.offsets.len(),
                rows.scales.len(),
                rows.q.len()
            )));
        }
        // A rank that received nothing still binds one (unused) row.
        let r = rows.scales.len().max(1);
        let pad = |v: &[f32]| -> Vec<f32> {
            let mut v = v.to_vec();
            v.resize(r, 0.0);
            v
        };
        let mut q = rows.q.clone();
        q.resize(r * d, 0);
        let shared = worker.alloc(c.n_shared_experts * t * d * 4)?;
        let args = self.args(vec![
            front.xq_buf.clone(),
            front.xs_buf.clone(),
            shared.clone(),
            upload(worker, &q)?,
            upload(worker, &pad(&rows.scales))?,
            upload(worker, &pad(&rows.weights))?,
            upload(worker, &rows.offsets)?,
            worker.alloc(r * d * 4)?,
        ]);
        let buffers = args.buffers.clone();
        let plan = Arc::new(Plan {
            capacity: r,
            ..self.plan(t, worker.cores())
        });
        let report = worker.run_fn("dsv4.moe.experts", args, cfg, move |o, a| {
            expert_graph(o, a, &plan)
        })?;
        let mut y: Vec<f32> = buffers[io::expert::Y_ROWS].read()?;
        y.truncate(rows.scales.len() * d);
        Ok(ExpertOutput {
            shared,
            y_rows: y,
            report,
        })
    }

    /// The back of an expert-parallel step: `routed` (`[T, K, D]` in route order, combined
    /// from every rank) and the shared experts' outputs reduced in the single-rank order,
    /// then `hc_post`.
    pub fn back_step(
        &self,
        worker: &Worker,
        front: &MoeFront,
        experts: &ExpertOutput,
        routed: &[f32],
        cfg: &CallConfig,
    ) -> Result<MoeOutput, MoeRunError> {
        let c = &self.config;
        let (t, d, k) = (front.tokens, c.hidden, c.n_activated_experts);
        if routed.len() != t * k * d {
            return Err(MoeRunError::Invalid(format!(
                "combined routes of {} elements, expected {t} x {k} x {d}",
                routed.len()
            )));
        }
        let args = self.args(vec![
            front.x_hc.clone(),
            front.hcw.clone(),
            experts.shared.clone(),
            upload(worker, routed)?,
            worker.alloc(t * d * 4)?,
            worker.alloc(t * c.hc_mult * d * 4)?,
        ]);
        let buffers = args.buffers.clone();
        let plan = Arc::new(self.plan(t, worker.cores()));
        let report = worker.run_fn("dsv4.moe.back", args, cfg, move |o, a| {
            back_graph(o, a, &plan)
        })?;
        use io::back as b;
        let (hc, m) = (c.hc_mult, c.hc_mix());
        let hcw: Vec<f32> = front.hcw.read()?;
        Ok(MoeOutput {
            x_out: buffers[b::X_OUT].read()?,
            x_mixed: front.x_mixed.read()?,
            post: hc_part(&hcw, m, hc..2 * hc),
            comb: hc_part(&hcw, m, 2 * hc..m),
            y: buffers[b::Y].read()?,
            shared: experts.shared.read()?,
            routed: routed.to_vec(),
            experts: front.experts.clone(),
            weights: front.weights.clone(),
            report,
        })
    }
}

/// The bound expert weights of one set (routed or shared).
struct ExpertViews {
    w1: Tensor,
    s1: Tensor,
    w3: Tensor,
    s3: Tensor,
    w2: Tensor,
    s2: Tensor,
}

fn bind_experts(
    o: &mut Orchestrator,
    a: &RunArgs,
    first: usize,
    groups: usize,
    p: &Plan,
) -> Result<ExpertViews, RunError> {
    let (g, i, d) = (groups as u64, p.inter as u64, p.d as u64);
    // A set without experts binds one element of each buffer; no task reads it.
    let (wi, si, wo, so) = if groups == 0 {
        ([1, 1, 1], [1, 1], [1, 1, 1], [1, 1])
    } else {
        ([g, i, d], [g, i], [g, d, i], [g, d])
    };
    let b = &a.buffers;
    Ok(ExpertViews {
        w1: o.bind(&b[first], DType::I8, &wi)?,
        s1: o.bind(&b[first + 1], DType::F32, &si)?,
        w3: o.bind(&b[first + 2], DType::I8, &wi)?,
        s3: o.bind(&b[first + 3], DType::F32, &si)?,
        w2: o.bind(&b[first + 4], DType::I8, &wo)?,
        s2: o.bind(&b[first + 5], DType::F32, &so)?,
    })
}

/// The three expert phases over `rows` int8 rows (`q` `[R, D]`, `s` `[R]`) grouped by
/// `offsets` (one group of every row when `None`), writing `y` `[R, D]`; the two GEMM phases
/// are SPMD tasks of `blocks` blocks, each a tapered share of the active groups' columns laid
/// end to end. Returns the down projection's task.
#[allow(clippy::too_many_arguments)]
fn experts(
    o: &mut Orchestrator,
    p: &Plan,
    w: &ExpertViews,
    q: &Tensor,
    s: &Tensor,
    grouping: Option<(&Tensor, &Tensor)>,
    rows: usize,
    y: &Tensor,
    blocks: u32,
) -> Result<TaskId, RunError> {
    let (r, i) = (rows as u64, p.inter as u64);
    let h = o.alloc(DType::F32, &[r, i])?;
    let mut t = Task::new(moe_ops::MOE_GATE_UP).input(q).input(s);
    // SAFETY: expert weights are written by no task during a run.
    unsafe {
        t = t.no_dep(&w.w1).no_dep(&w.s1).no_dep(&w.w3).no_dep(&w.s3);
    }
    t = t.output_existing(&h);
    if let Some((off, _)) = grouping {
        t = t.input(off);
    }
    o.submit(t.scalar_f32(p.limit).blocks(blocks).timing_slot(3))?;
    let hq = o.alloc(DType::I8, &[r, i])?;
    // One scale per row, as a column so that the quantisation's blocks take disjoint rows.
    let hs = o.alloc(DType::F32, &[r, 1])?;
    let mut t = Task::new(moe_ops::MOE_QUANT_H)
        .input(&h)
        .output_existing(&hq)
        .output_existing(&hs);
    if let Some((off, wts)) = grouping {
        t = t.input(wts).input(off);
    }
    // SPMD over rows: alone on the critical path between the expert phases, the routed
    // rows' quantisation (48 of 2048 at FLASH) took ~70 us on one core while the other waited.
    let row_blocks = p
        .row_blocks
        .min(u32::try_from(rows.max(1)).unwrap_or(u32::MAX));
    o.submit(t.blocks(row_blocks).timing_slot(3))?;
    let mut t = Task::new(moe_ops::MOE_DOWN).input(&hq).input(&hs);
    // SAFETY: as above.
    unsafe {
        t = t.no_dep(&w.w2).no_dep(&w.s2);
    }
    t = t.output_existing(y);
    if let Some((off, _)) = grouping {
        t = t.input(off);
    }
    Ok(o.submit(t.blocks(blocks).timing_slot(4))?.id)
}

/// The gate's tensors and the hyper-connection weights, bound from the layer's weights.
struct GateViews {
    norm: Tensor,
    gate: Tensor,
    bias: Tensor,
    hash: Tensor,
    mix: Tensor,
    base: Tensor,
}

fn bind_gate(o: &mut Orchestrator, a: &RunArgs, p: &Plan) -> Result<GateViews, RunError> {
    let (d, k, e, hc) = (p.d as u64, p.top_k as u64, p.n_experts as u64, p.hc as u64);
    let b = &a.buffers;
    Ok(GateViews {
        norm: o.bind(&b[io::FFN_NORM], DType::F32, &[d])?,
        gate: o.bind(&b[io::GATE], DType::F32, &[e, d])?,
        bias: o.bind(&b[io::BIAS], DType::F32, &[e])?,
        hash: o.bind(&b[io::HASH], DType::U32, &[p.vocab as u64, k])?,
        mix: o.bind(&b[io::HC_MIX], DType::F32, &[p.hc_mix(), hc * d])?,
        base: o.bind(&b[io::HC_BASE], DType::F32, &[p.hc_mix()])?,
    })
}

impl Plan {
    /// Hyper-connection weights per token (pre, post, comb).
    fn hc_mix(&self) -> u64 {
        let hc = self.hc as u64;
        (2 + hc) * hc
    }
}

/// The tensors `hc_pre` and route write.
struct RouteOut<'a> {
    hcw: &'a Tensor,
    x_mixed: &'a Tensor,
    xq: &'a Tensor,
    xs: &'a Tensor,
    experts: &'a Tensor,
    weights: &'a Tensor,
}

/// `hc_pre` then route, on the residual `x_hc` and the token ids.
fn submit_route(
    o: &mut Orchestrator,
    p: &Plan,
    g: &GateViews,
    x_hc: &Tensor,
    tokens: &Tensor,
    out: &RouteOut<'_>,
) -> Result<(), RunError> {
    let mut task = Task::new(moe_ops::MOE_HC_PRE).input(x_hc);
    // SAFETY: the hyper-connection weights are written by no task during a run.
    unsafe {
        task = task.no_dep(&g.mix).no_dep(&g.base);
    }
    let task = task
        .output_existing(out.hcw)
        .output_existing(out.x_mixed)
        .scalar(p.hc as u64)
        .scalar(p.hc_iters as u64)
        .scalar_f32(p.hc_eps)
        .scalar_f32(p.eps)
        .scalar_f32(p.hc_scale[0])
        .scalar_f32(p.hc_scale[1])
        .scalar_f32(p.hc_scale[2])
        .blocks(p.row_blocks);
    o.submit(task.timing_slot(0))?;
    let mut task = Task::new(moe_ops::MOE_ROUTE)
        .input(out.x_mixed)
        .input(tokens);
    // SAFETY: the norm, gate, bias and hash table are written by no task during a run.
    unsafe {
        task = task
            .no_dep(&g.norm)
            .no_dep(&g.gate)
            .no_dep(&g.bias)
            .no_dep(&g.hash);
    }
    // The scales as `[T, 1]`: SPMD over token rows splits every output by its rows.
    let xs_rows = o.fatal_on(out.xs.reshape(&[p.tokens as u64, 1]))?;
    let task = task
        .output_existing(out.xq)
        .output_existing(&xs_rows)
        .output_existing(out.experts)
        .output_existing(out.weights)
        .scalar_f32(p.eps)
        .scalar_f32(p.route_scale)
        .scalar(u64::from(p.hash))
        .blocks(p.row_blocks);
    o.submit(task.timing_slot(1))?;
    Ok(())
}

/// The shared experts: every token, weight 1, straight from the routed activations, into
/// `shared` `[S, T, D]`.
fn submit_shared(
    o: &mut Orchestrator,
    a: &RunArgs,
    p: &Plan,
    xq: &Tensor,
    xs: &Tensor,
    shared: &Tensor,
) -> Result<(), RunError> {
    let (t, d) = (p.tokens as u64, p.d as u64);
    let shared_w = bind_experts(o, a, io::SHARED, p.n_shared, p)?;
    for s in 0..p.n_shared {
        let one = |o: &mut Orchestrator, v: &Tensor| -> Result<Tensor, RunError> {
            o.fatal_on(v.slice(0, s as u64, s as u64 + 1))
        };
        let sw = ExpertViews {
            w1: one(o, &shared_w.w1)?,
            s1: one(o, &shared_w.s1)?,
            w3: one(o, &shared_w.w3)?,
            s3: one(o, &shared_w.s3)?,
            w2: one(o, &shared_w.w2)?,
            s2: one(o, &shared_w.s2)?,
        };
        let out = o.fatal_on(shared.slice(0, s as u64, s as u64 + 1))?;
        let out = o.fatal_on(out.reshape(&[t, d]))?;
        experts(o, p, &sw, xq, xs, None, p.tokens, &out, p.shared_blocks)?;
    }
    Ok(())
}

/// Reduce (`y = bf16(shared + Σ routed)`) then `hc_post` into `x_out`, both SPMD over token
/// rows (run on one core, the pair left the other idle ~0.6 ms at the step's end).
#[allow(clippy::too_many_arguments)]
fn submit_reduce(
    o: &mut Orchestrator,
    p: &Plan,
    shared: &Tensor,
    routed: &Tensor,
    y: &Tensor,
    x_hc: &Tensor,
    hcw: &Tensor,
    x_out: &Tensor,
) -> Result<(), RunError> {
    let task = Task::new(moe_ops::MOE_REDUCE)
        .input(shared)
        .input(routed)
        .output_existing(y)
        .blocks(p.row_blocks);
    o.submit(task.timing_slot(5))?;
    let task = Task::new(super::ops::HC_POST)
        .input(x_hc)
        .input(y)
        .input(hcw)
        .output_existing(x_out)
        .scalar(p.hc as u64)
        .blocks(p.row_blocks);
    o.submit(task.timing_slot(5))?;
    Ok(())
}

/// The step's graph (module docs).
fn graph(o: &mut Orchestrator, a: &RunArgs, p: &Plan) -> Result<(), RunError> {
    if a.buffers.len() != io::COUNT {
        return Err(o.fatal(format!(
            "dsv4 moe orchestration: {} buffers, expected {}",
            a.buffers.len(),
            io::COUNT
        )));
    }
    let (t, d, k, hc) = (p.tokens as u64, p.d as u64, p.top_k as u64, p.hc as u64);
    let b = &a.buffers;
    let g = bind_gate(o, a, p)?;
    let routed_w = bind_experts(o, a, io::ROUTED, p.local.len(), p)?;
    let x_hc = o.bind(&b[io::X_HC], DType::F32, &[t, hc * d])?;
    let x_out = o.bind(&b[io::X_OUT], DType::F32, &[t, hc * d])?;
    let tokens = o.bind(&b[io::TOKENS], DType::U32, &[t])?;
    let y = o.bind(&b[io::Y], DType::F32, &[t, d])?;
    let shared = o.bind(&b[io::SHARED_OUT], DType::F32, &[p.n_shared as u64, t, d])?;
    let routed = o.bind(&b[io::ROUTED_OUT], DType::F32, &[t, k, d])?;
    let experts_t = o.bind(&b[io::EXPERTS], DType::U32, &[t, k])?;
    let weights_t = o.bind(&b[io::ROUTE_W], DType::F32, &[t, k])?;
    let x = o.bind(&b[io::X_MIXED], DType::F32, &[t, d])?;
    let hcw = o.bind(&b[io::HCW], DType::F32, &[t, p.hc_mix()])?;
    let xq = o.alloc(DType::I8, &[t, d])?;
    let xs = o.alloc(DType::F32, &[t])?;
    let route_out = RouteOut {
        hcw: &hcw,
        x_mixed: &x,
        xq: &xq,
        xs: &xs,
        experts: &experts_t,
        weights: &weights_t,
    };
    submit_route(o, p, &g, &x_hc, &tokens, &route_out)?;
    submit_shared(o, a, p, &xq, &xs, &shared)?;

    // Dispatch: this rank's rows grouped per local expert.
    let (l, cap) = (p.local.len() as u64, p.capacity as u64);
    let counts = o.alloc(DType::U32, &[l])?;
    let offsets = o.alloc(DType::U32, &[l + 1])?;
    let rows = o.alloc(DType::I8, &[cap, d])?;
    let scales = o.alloc(DType::F32, &[cap])?;
    let row_w = o.alloc(DType::F32, &[cap])?;
    let ids = o.alloc(DType::U32, &[cap])?;
    let task = Task::new(moe_ops::MOE_DISPATCH)
        .input(&experts_t)
        .input(&weights_t)
        .input(&xq)
        .input(&xs)
        .output_existing(&counts)
        .output_existing(&offsets)
        .output_existing(&rows)
        .output_existing(&scales)
        .output_existing(&row_w)
        .output_existing(&ids)
        .scalar(p.local.start as u64)
        .scalar(p.n_experts as u64);
    o.submit(task.timing_slot(2))?;
    debug_assert_eq!(idx::dispatch::ROUTE_IDS, 9);

    // Routed experts on the dispatched rows.
    let y_disp = o.alloc(DType::F32, &[cap, d])?;
    if p.local.is_empty() {
        // No local expert: nothing to compute; combine sees zero rows.
    } else {
        experts(
            o,
            p,
            &routed_w,
            &rows,
            &scales,
            Some((&offsets, &row_w)),
            p.capacity,
            &y_disp,
            p.blocks,
        )?;
    }

    // Combine back to route order, then reduce.
    let routed_flat = o.fatal_on(routed.reshape(&[t * k, d]))?;
    let task = Task::new(moe_ops::MOE_COMBINE)
        .input(&y_disp)
        .input(&ids)
        .input(&offsets)
        .output_existing(&routed_flat)
        .blocks(p.blocks);
    o.submit(task.timing_slot(5))?;
    submit_reduce(o, p, &shared, &routed, &y, &x_hc, &hcw, &x_out)
}

/// Columns `r` of every token's `m` hyper-connection weights.
fn hc_part(hcw: &[f32], m: usize, r: Range<usize>) -> Vec<f32> {
    hcw.chunks_exact(m)
        .flat_map(|w| w[r.clone()].to_vec())
        .collect()
}

/// What the front of an expert-parallel step leaves for the rest of it.
#[derive(Debug)]
pub struct MoeFront {
    tokens: usize,
    x_hc: Buffer,
    x_mixed: Buffer,
    hcw: Buffer,
    xq_buf: Buffer,
    xs_buf: Buffer,
    /// int8 activations `[T, D]` (what dispatch sends).
    pub xq: Vec<i8>,
    /// Their scales `[T]`.
    pub xs: Vec<f32>,
    /// Chosen experts `[T, K]`.
    pub experts: Vec<u32>,
    /// Routing weights `[T, K]`.
    pub weights: Vec<f32>,
    /// The front graph's timing.
    pub report: RunReport,
}

/// The rows one rank's routed experts compute: int8 rows grouped per local expert
/// (`offsets`, `L + 1` entries), with their scales and routing weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReceivedRows {
    /// int8 rows `[R, D]`.
    pub q: Vec<i8>,
    /// Their scales `[R]`.
    pub scales: Vec<f32>,
    /// Their routing weights `[R]`.
    pub weights: Vec<f32>,
    /// Group offsets `[L + 1]`: local expert `g` owns rows `offsets[g]..offsets[g + 1]`.
    pub offsets: Vec<u32>,
}

/// What the expert phases of an expert-parallel step produced.
#[derive(Debug)]
pub struct ExpertOutput {
    /// The shared experts' outputs `[S, T, D]` (stays on the worker for the back graph).
    shared: Buffer,
    /// The routed experts' outputs `[R, D]`, one per received row, weighted.
    pub y_rows: Vec<f32>,
    /// The expert graph's timing.
    pub report: RunReport,
}

fn expect_buffers(o: &Orchestrator, a: &RunArgs, n: usize, what: &str) -> Result<(), RunError> {
    if a.buffers.len() == n {
        Ok(())
    } else {
        Err(o.fatal(format!(
            "dsv4 moe {what} orchestration: {} buffers, expected {n}",
            a.buffers.len()
        )))
    }
}

/// `hc_pre` and route of an expert-parallel step.
fn front_graph(o: &mut Orchestrator, a: &RunArgs, p: &Plan) -> Result<(), RunError> {
    use io::front as f;
    expect_buffers(o, a, f::COUNT, "front")?;
    let (t, d, k, hc) = (p.tokens as u64, p.d as u64, p.top_k as u64, p.hc as u64);
    let b = &a.buffers;
    let g = bind_gate(o, a, p)?;
    let x_hc = o.bind(&b[f::X_HC], DType::F32, &[t, hc * d])?;
    let tokens = o.bind(&b[f::TOKENS], DType::U32, &[t])?;
    let out = RouteOut {
        hcw: &o.bind(&b[f::HCW], DType::F32, &[t, p.hc_mix()])?,
        x_mixed: &o.bind(&b[f::X_MIXED], DType::F32, &[t, d])?,
        xq: &o.bind(&b[f::XQ], DType::I8, &[t, d])?,
        xs: &o.bind(&b[f::XS], DType::F32, &[t])?,
        experts: &o.bind(&b[f::EXPERTS], DType::U32, &[t, k])?,
        weights: &o.bind(&b[f::ROUTE_W], DType::F32, &[t, k])?,
    };
    submit_route(o, p, &g, &x_hc, &tokens, &out)
}

/// The shared experts on the own tokens and the local experts on the received rows.
fn expert_graph(o: &mut Orchestrator, a: &RunArgs, p: &Plan) -> Result<(), RunError> {
    use io::expert as x;
    expect_buffers(o, a, x::COUNT, "experts")?;
    let (t, d, r, l) = (
        p.tokens as u64,
        p.d as u64,
        p.capacity as u64,
        p.local.len() as u64,
    );
    let b = &a.buffers;
    let xq = o.bind(&b[x::XQ], DType::I8, &[t, d])?;
    let xs = o.bind(&b[x::XS], DType::F32, &[t])?;
    let shared = o.bind(&b[x::SHARED_OUT], DType::F32, &[p.n_shared as u64, t, d])?;
    submit_shared(o, a, p, &xq, &xs, &shared)?;
    if p.local.is_empty() {
        return Ok(());
    }
    let routed_w = bind_experts(o, a, io::ROUTED, p.local.len(), p)?;
    let rows = o.bind(&b[x::ROWS], DType::I8, &[r, d])?;
    let scales = o.bind(&b[x::SCALES], DType::F32, &[r])?;
    let row_w = o.bind(&b[x::ROW_W], DType::F32, &[r])?;
    let offsets = o.bind(&b[x::OFFSETS], DType::U32, &[l + 1])?;
    let y = o.bind(&b[x::Y_ROWS], DType::F32, &[r, d])?;
    experts(
        o,
        p,
        &routed_w,
        &rows,
        &scales,
        Some((&offsets, &row_w)),
        p.capacity,
        &y,
        p.blocks,
    )?;
    Ok(())
}

/// Reduce and `hc_post` of an expert-parallel step.
fn back_graph(o: &mut Orchestrator, a: &RunArgs, p: &Plan) -> Result<(), RunError> {
    use io::back as bk;
    expect_buffers(o, a, bk::COUNT, "back")?;
    let (t, d, k, hc) = (p.tokens as u64, p.d as u64, p.top_k as u64, p.hc as u64);
    let b = &a.buffers;
    let x_hc = o.bind(&b[bk::X_HC], DType::F32, &[t, hc * d])?;
    let hcw = o.bind(&b[bk::HCW], DType::F32, &[t, p.hc_mix()])?;
    let shared = o.bind(&b[bk::SHARED_OUT], DType::F32, &[p.n_shared as u64, t, d])?;
    let routed = o.bind(&b[bk::ROUTED_OUT], DType::F32, &[t, k, d])?;
    let y = o.bind(&b[bk::Y], DType::F32, &[t, d])?;
    let x_out = o.bind(&b[bk::X_OUT], DType::F32, &[t, hc * d])?;
    submit_reduce(o, p, &shared, &routed, &y, &x_hc, &hcw, &x_out)
}

/// Orchestrator helpers for view errors.
trait FatalOn {
    fn fatal_on<T>(&self, r: Result<T, simpler_core::TensorError>) -> Result<T, RunError>;
}

impl FatalOn for Orchestrator {
    fn fatal_on<T>(&self, r: Result<T, simpler_core::TensorError>) -> Result<T, RunError> {
        r.map_err(|e| self.fatal(format!("dsv4 moe orchestration: {e}")))
    }
}
