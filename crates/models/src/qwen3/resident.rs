//! A model resident in worker buffers: the weights (one buffer per tensor kind, holding every
//! distinct weight set; in shared-weights mode one set serves every layer), the RoPE tables,
//! and the paged KV cache (one K and one V buffer holding every layer's pool back to back).

use std::sync::Arc;

use half::bf16;
use simpler_core::{Buffer, Element, Worker};
use simpler_kernels_cpu::{PACK_ROWS, WeightLayout};

use super::config::Qwen3Config;
use super::layout::{bf16_layout, upload_layout};
use super::quant::{self, WeightFormat};
use super::weights::{KvCache, LayerWeights, Qwen3Weights, Tensor};

/// Why a resident model, a KV cache or a runtime step could not be set up or run.
#[derive(Debug, thiserror::Error)]
pub enum Qwen3RunError {
    /// The runtime refused or failed the run.
    #[error(transparent)]
    Runtime(#[from] simpler_core::Error),
    /// A host copy into or out of a buffer failed.
    #[error(transparent)]
    Buffer(#[from] simpler_core::BufferError),
    /// The request does not fit the model, the cache or the inputs.
    #[error("{0}")]
    Invalid(String),
    /// A checkpoint's tensor could not be read (`ResidentModel::upload_sets` from a
    /// `CheckpointReader`).
    #[error(transparent)]
    Checkpoint(#[from] super::checkpoint::CheckpointError),
}

/// Progress callback of uploads: `(bytes done, bytes total)`.
pub type UploadProgress<'a> = &'a dyn Fn(u64, u64);

/// Index of each weight buffer (the order of [`ResidentModel::buffers`]).
pub(crate) mod slot {
    /// Slots `0..LAYER_TENSORS` hold the per-layer tensors in `LayerWeights::shapes` order
    /// (q, k, v, o, gate, up, down projections; q/k norms; input and post-attention norms).
    pub(crate) const LAYER_TENSORS: usize = 11;
    pub(crate) const EMBEDDING: usize = 11;
    pub(crate) const FINAL_NORM: usize = 12;
    pub(crate) const LM_HEAD: usize = 13;
    pub(crate) const ROPE_COS: usize = 14;
    pub(crate) const ROPE_SIN: usize = 15;
    /// Number of model buffers.
    pub(crate) const COUNT: usize = 16;
}

/// A model's weights and RoPE tables in worker buffers.
#[derive(Debug)]
pub struct ResidentModel {
    /// The configuration (RoPE θ as the weights were generated or loaded with).
    pub config: Qwen3Config,
    /// Distinct layer weight sets held.
    pub sets: usize,
    /// Weight set of each layer.
    pub set_of_layer: Vec<usize>,
    /// Positions the RoPE tables cover.
    pub max_seq: usize,
    /// How the projections and the LM head are held.
    pub format: WeightFormat,
    /// The bf16 matrices are held in the host kernels' layout (`layout::bf16_layout`): the
    /// worker runs kernels on the host. Otherwise row-major.
    host_layouts: bool,
    pub(crate) buffers: Vec<Buffer>,
}

/// Number of per-layer tensors that are projections (the first ones in
/// `LayerWeights::shapes` order); int8 formats quantise these.
const PROJECTIONS: usize = 7;

fn as_bytes_len<T>(x: &[T]) -> usize {
    std::mem::size_of_val(x)
}

impl ResidentModel {
    /// Copies `weights` into buffers of `worker`, with RoPE tables for `max_seq` positions.
    /// Layers that share one `Arc` share one weight set.
    pub fn upload(
        worker: &Worker,
        weights: &Qwen3Weights,
        max_seq: usize,
        progress: Option<UploadProgress<'_>>,
    ) -> Result<ResidentModel, Qwen3RunError> {
        Self::upload_as(worker, weights, max_seq, WeightFormat::Bf16, progress)
    }

    /// [`ResidentModel::upload`] holding the projections and the LM head in `format`; int8
    /// quantises them here, a few rows at a time (progress counts resident bytes). The
    /// embedding stays bf16 (a gather reads one row per token), so a tied LM head gets its own
    /// int8 copy.
    pub fn upload_as(
        worker: &Worker,
        weights: &Qwen3Weights,
        max_seq: usize,
        format: WeightFormat,
        progress: Option<UploadProgress<'_>>,
    ) -> Result<ResidentModel, Qwen3RunError> {
        weights.check_shapes().map_err(Qwen3RunError::Invalid)?;
        // Distinct weight sets, in first-use order.
        let mut sets: Vec<Arc<LayerWeights>> = Vec::new();
        let mut set_of_layer = Vec::with_capacity(weights.layers.len());
        for l in &weights.layers {
            match sets.iter().position(|s| Arc::ptr_eq(s, l)) {
                Some(i) => set_of_layer.push(i),
                None => {
                    set_of_layer.push(sets.len());
                    sets.push(l.clone());
                }
            }
        }
        let mut layer = |set: usize| Ok(sets[set].clone());
        Self::upload_sets(
            worker,
            weights,
            set_of_layer,
            &mut layer,
            max_seq,
            format,
            progress,
        )
    }

    /// [`ResidentModel::upload_as`] with the layers' weight sets taken from `layer` one at a
    /// time, in set order, each dropped once it is in its buffers: `outer` gives the config,
    /// embedding, final norm and LM head (its `layers` are not read), `set_of_layer` the set of
    /// every layer (sets numbered in first-use order, `0..sets`). A model then never has more
    /// than one layer on the host besides what `layer` holds (a generator or a loader). A set
    /// whose tensors do not have the config's shapes is refused, naming the tensor.
    pub fn upload_sets(
        worker: &Worker,
        outer: &Qwen3Weights,
        set_of_layer: Vec<usize>,
        layer: &mut dyn FnMut(usize) -> Result<Arc<LayerWeights>, Qwen3RunError>,
        max_seq: usize,
        format: WeightFormat,
        progress: Option<UploadProgress<'_>>,
    ) -> Result<ResidentModel, Qwen3RunError> {
        let c = &outer.config;
        let weights = outer;
        weights
            .check_outer_shapes()
            .map_err(Qwen3RunError::Invalid)?;
        if set_of_layer.len() != c.num_hidden_layers {
            return Err(Qwen3RunError::Invalid(format!(
                "{} layers' sets for a config of {} layers",
                set_of_layer.len(),
                c.num_hidden_layers
            )));
        }
        let n_sets = set_of_layer.iter().map(|&s| s + 1).max().unwrap_or(0);
        if !c.head_dim.is_multiple_of(16) {
            return Err(Qwen3RunError::Invalid(format!(
                "head_dim {} is not a multiple of 16 (the packed GEMM layout needs whole 16-column blocks per head)",
                c.head_dim
            )));
        }
        let rope = c.rope_tables(max_seq);
        let shapes = LayerWeights::shapes(c);
        // Bytes of one set's tensor `kind` in its buffer: the projections in `format`, the
        // norms fp32.
        let kind_bytes = |kind: usize| -> usize {
            let [r, k] = shapes[kind].1;
            if kind < PROJECTIONS {
                format.matrix_bytes(r, k)
            } else {
                4 * r * k
            }
        };
        let layer_bytes: u64 =
            (0..shapes.len()).map(|k| kind_bytes(k) as u64).sum::<u64>() * n_sets as u64;
        let head_bytes = match format {
            WeightFormat::Bf16 => weights.lm_head.as_ref().map_or(0, |h| as_bytes_len(h)),
            WeightFormat::Int8(_) => format.matrix_bytes(c.vocab_size, c.hidden_size),
        };
        let total = layer_bytes
            + as_bytes_len(&weights.embedding) as u64
            + head_bytes as u64
            + 4 * (c.hidden_size as u64 + 2 * rope.cos.len() as u64);
        let done = std::cell::Cell::new(0u64);
        let tick = |bytes: usize| {
            done.set(done.get() + bytes as u64);
            if let Some(p) = progress {
                p(done.get(), total);
            }
        };
        let mut buffers = Vec::with_capacity(slot::COUNT);
        let host_kernels = worker.platform().host_kernels;
        // Projections and per-layer norms: one buffer per tensor kind, sets back to back,
        // filled one set at a time.
        debug_assert_eq!(shapes.len(), slot::LAYER_TENSORS);
        for kind in 0..shapes.len() {
            buffers.push(worker.alloc(kind_bytes(kind) * n_sets)?);
        }
        for si in 0..n_sets {
            let set = layer(si)?;
            set.check_shapes(c, &format!("weight set {si}"))
                .map_err(Qwen3RunError::Invalid)?;
            for (kind, t) in set.tensors().iter().enumerate() {
                let [r, cols] = shapes[kind].1;
                let (buf, at) = (&buffers[kind], si * kind_bytes(kind));
                // The projections are bf16 and the norms fp32 (`LayerWeights::tensors`), which
                // `kind_bytes` sizes.
                match t {
                    Tensor::Bf16(x) if format.is_int8() => {
                        let il = host_kernels && int8_interleaved(format, r, cols);
                        upload_int8(buf, at, x, cols, il, &tick)?
                    }
                    Tensor::Bf16(x) => upload_bf16_matrix(worker, buf, at, x, r, cols, &tick)?,
                    Tensor::F32(x) => upload_chunked(buf, at, x, &tick)?,
                }
            }
        }
        let (v, h) = (c.vocab_size, c.hidden_size);
        let embedding = worker.alloc(as_bytes_len(&weights.embedding))?;
        upload_bf16_matrix(worker, &embedding, 0, &weights.embedding, v, h, &tick)?;
        buffers.push(embedding.clone());
        buffers.push(worker.buffer_from(&weights.final_norm)?);
        tick(as_bytes_len(&weights.final_norm));
        match (&weights.lm_head, format) {
            (_, WeightFormat::Int8(_)) => {
                let b = worker.alloc(head_bytes)?;
                // Records: the head keeps fp32 activations (`quant`).
                upload_int8(&b, 0, weights.lm_head(), c.hidden_size, false, &tick)?;
                buffers.push(b);
            }
            (Some(head), WeightFormat::Bf16) => {
                let b = worker.alloc(as_bytes_len(head))?;
                upload_bf16_matrix(worker, &b, 0, head, v, h, &tick)?;
                buffers.push(b);
            }
            (None, WeightFormat::Bf16) => buffers.push(embedding),
        }
        buffers.push(worker.buffer_from(&rope.cos)?);
        buffers.push(worker.buffer_from(&rope.sin)?);
        tick(2 * as_bytes_len(&rope.cos));
        Ok(ResidentModel {
            config: c.clone(),
            sets: n_sets,
            set_of_layer,
            max_seq,
            format,
            host_layouts: host_kernels,
            buffers,
        })
    }

    /// A preset's seeded weights (`fixture::generate_weights`' bits) generated one weight set
    /// at a time straight into buffers of `worker` ([`ResidentModel::upload_sets`]): the host
    /// holds the embedding, the LM head and one layer, never every layer. `shared` gives every
    /// layer one weight set; `progress` counts resident bytes.
    pub fn upload_generated(
        worker: &Worker,
        config: &Qwen3Config,
        seed: u64,
        shared: bool,
        max_seq: usize,
        format: WeightFormat,
        progress: Option<UploadProgress<'_>>,
    ) -> Result<ResidentModel, Qwen3RunError> {
        let outer = super::fixture::generate_outer_weights(config, seed, None);
        let mut layer =
            |set: usize| Ok(Arc::new(super::fixture::generate_layer(config, seed, set)));
        let set_of_layer = (0..config.num_hidden_layers)
            .map(|l| if shared { 0 } else { l })
            .collect();
        Self::upload_sets(
            worker,
            &outer,
            set_of_layer,
            &mut layer,
            max_seq,
            format,
            progress,
        )
    }

    /// A checkpoint directory's weights read one layer at a time from its mapped files
    /// straight into buffers of `worker` (`read_checkpoint`: every header is checked before
    /// anything is read; [`ResidentModel::upload_sets`]): the host holds the embedding, the LM
    /// head and one layer. `opts.progress` is not called (`progress` counts resident bytes).
    pub fn upload_checkpoint(
        worker: &Worker,
        dir: &std::path::Path,
        opts: &super::checkpoint::LoadOptions<'_>,
        max_seq: usize,
        format: WeightFormat,
        progress: Option<UploadProgress<'_>>,
    ) -> Result<ResidentModel, Qwen3RunError> {
        let opts = super::checkpoint::LoadOptions {
            progress: None,
            ..*opts
        };
        super::checkpoint::read_checkpoint(dir, &opts, |r| {
            let outer = r.outer()?;
            let layers = r.config().num_hidden_layers;
            let mut layer = |l: usize| Ok(Arc::new(r.layer(l)?));
            Self::upload_sets(
                worker,
                &outer,
                (0..layers).collect(),
                &mut layer,
                max_seq,
                format,
                progress,
            )
        })
    }

    /// The buffers, in the order the orchestrations bind them.
    pub fn buffers(&self) -> &[Buffer] {
        &self.buffers
    }

    /// Bytes of weights held in buffers (every distinct set once; a tied LM head once).
    pub fn resident_bytes(&self) -> usize {
        let mut seen = Vec::new();
        self.buffers[..=slot::LM_HEAD]
            .iter()
            .filter(|b| {
                let new = !seen.contains(&b.id());
                seen.push(b.id());
                new
            })
            .map(|b| b.len())
            .sum()
    }

    /// Reads layer weight set `set` back to the host (tests and checks); int8 projections
    /// come back dequantised and rounded to bf16.
    pub fn download_layer(&self, set: usize) -> Result<LayerWeights, Qwen3RunError> {
        self.download_layer_as(set, quant::dequantize_matrix_as_bf16, |v| v)
    }

    /// Reads layer weight set `set` back to the host with its projections as the values the
    /// model multiplies, in fp32: bf16 weights widened, int8 weights' exact `q · scale`
    /// (which [`ResidentModel::download_layer`] rounds to bf16).
    pub fn download_layer_f32(&self, set: usize) -> Result<LayerWeights<f32>, Qwen3RunError> {
        self.download_layer_as(set, quant::dequantize_matrix_as_f32, |v| {
            v.iter().map(|x| x.to_f32()).collect()
        })
    }

    /// Layer weight set `set` with each projection in row order as `int8(records, cols,
    /// interleaved)` (an int8 model) or `wide(values)` (bf16) makes it, and the norm weights.
    fn download_layer_as<W>(
        &self,
        set: usize,
        int8: fn(&[i8], usize, bool) -> Vec<W>,
        wide: fn(Vec<bf16>) -> Vec<W>,
    ) -> Result<LayerWeights<W>, Qwen3RunError> {
        let shapes = LayerWeights::shapes(&self.config);
        let mut proj = Vec::with_capacity(PROJECTIONS);
        for (kind, (_, [r, k])) in shapes.iter().take(PROJECTIONS).enumerate() {
            let buf = &self.buffers[kind];
            proj.push(if self.format.is_int8() {
                let bytes = self.format.matrix_bytes(*r, *k);
                let q = buf.read_at::<i8>(set * bytes, bytes)?;
                int8(
                    &q,
                    *k,
                    self.host_layouts && int8_interleaved(self.format, *r, *k),
                )
            } else {
                let n = r * k;
                let v = buf.read_at::<bf16>(set * n * std::mem::size_of::<bf16>(), n)?;
                wide(self.row_major(v, *r, *k))
            });
        }
        let norm = |kind: usize| -> Result<Vec<f32>, Qwen3RunError> {
            let n = shapes[kind].1[0] * shapes[kind].1[1];
            Ok(self.buffers[kind].read_at::<f32>(set * n * std::mem::size_of::<f32>(), n)?)
        };
        let mut proj = proj.into_iter();
        let mut next = || proj.next().unwrap_or_default();
        Ok(LayerWeights {
            wq: next(),
            wk: next(),
            wv: next(),
            wo: next(),
            w_gate: next(),
            w_up: next(),
            w_down: next(),
            q_norm: norm(PROJECTIONS)?,
            k_norm: norm(PROJECTIONS + 1)?,
            input_norm: norm(PROJECTIONS + 2)?,
            post_norm: norm(PROJECTIONS + 3)?,
        })
    }

    /// Reads rows `rows` of the LM head back to the host (`[rows, hidden]` bf16; an int8
    /// head dequantised and rounded to bf16).
    pub fn download_lm_head_rows(
        &self,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<bf16>, Qwen3RunError> {
        if self.format.is_int8() {
            let h = self.config.hidden_size;
            return Ok(quant::dequantize_matrix_bf16(&self.head_records(rows)?, h));
        }
        self.vocab_rows(slot::LM_HEAD, rows)
    }

    /// Rows `rows` of an int8 LM head, as its resident records.
    fn head_records(&self, rows: std::ops::Range<usize>) -> Result<Vec<i8>, Qwen3RunError> {
        let rec = quant::int8_record(self.config.hidden_size);
        Ok(self.buffers[slot::LM_HEAD].read_at::<i8>(rows.start * rec, rows.len() * rec)?)
    }

    /// Rows `rows` of a `[vocab, hidden]` bf16 table (the embedding or a bf16 LM head) in row
    /// order, whatever layout it is held in.
    fn vocab_rows(
        &self,
        slot: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<bf16>, Qwen3RunError> {
        let (v, h) = (self.config.vocab_size, self.config.hidden_size);
        let layout = self.held_layout(v, h);
        if layout != WeightLayout::RowMajor {
            // Whole 16-row groups around the rows (contiguous in every layout), back in row
            // order.
            let (g0, g1) = (rows.start / 16 * 16, rows.end.next_multiple_of(16));
            let g1 = g1.min(v).max(g0);
            let t = self.buffers[slot].read_at::<bf16>(g0 * h * 2, (g1 - g0) * h)?;
            let rm = layout.row_major_bf16(&t, g1 - g0, h);
            return Ok(rm[(rows.start - g0) * h..(rows.end - g0) * h].to_vec());
        }
        Ok(self.buffers[slot].read_at::<bf16>(rows.start * h * 2, rows.len() * h)?)
    }

    /// Rows `rows` of the LM head as the values the model multiplies (`[rows, hidden]` fp32:
    /// a bf16 head widened; an int8 head's `q · scale`, not rounded to bf16).
    pub fn download_lm_head_rows_f32(
        &self,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, Qwen3RunError> {
        if self.format.is_int8() {
            let h = self.config.hidden_size;
            return Ok(quant::dequantize_matrix_f32(&self.head_records(rows)?, h));
        }
        Ok(self
            .download_lm_head_rows(rows)?
            .iter()
            .map(|v| v.to_f32())
            .collect())
    }

    /// How this model's `[rows, cols]` bf16 matrices are held (`layout`).
    fn held_layout(&self, rows: usize, cols: usize) -> WeightLayout {
        if self.host_layouts {
            bf16_layout(rows, cols)
        } else {
            WeightLayout::RowMajor
        }
    }

    /// A `[rows, cols]` bf16 matrix read back from its buffer, in row order.
    fn row_major(&self, v: Vec<bf16>, rows: usize, cols: usize) -> Vec<bf16> {
        match self.held_layout(rows, cols) {
            WeightLayout::RowMajor => v,
            layout => layout.row_major_bf16(&v, rows, cols),
        }
    }

    /// Reads embedding rows of `ids` back to the host as fp32 `[ids, hidden]`.
    pub fn download_embedding_rows(&self, ids: &[u32]) -> Result<Vec<f32>, Qwen3RunError> {
        let v = self.config.vocab_size;
        let mut out = Vec::with_capacity(ids.len() * self.config.hidden_size);
        for &id in ids {
            let id = id as usize;
            if id >= v {
                return Err(Qwen3RunError::Invalid(format!(
                    "token id {id} is past the vocabulary ({v})"
                )));
            }
            out.extend(
                self.vocab_rows(slot::EMBEDDING, id..id + 1)?
                    .iter()
                    .map(|x| x.to_f32()),
            );
        }
        Ok(out)
    }

    /// The final norm weights.
    pub fn final_norm(&self) -> Result<Vec<f32>, Qwen3RunError> {
        Ok(self.buffers[slot::FINAL_NORM].read::<f32>()?)
    }
}

/// Copies `data` into `buf` at byte `offset` in 64 MiB pieces, reporting progress.
fn upload_chunked<T: Element>(
    buf: &Buffer,
    offset: usize,
    data: &[T],
    tick: &dyn Fn(usize),
) -> Result<(), Qwen3RunError> {
    let per = ((64usize << 20) / size_of::<T>()).max(1);
    for (i, c) in data.chunks(per).enumerate() {
        buf.write_at(offset + i * per * size_of::<T>(), c)?;
        tick(as_bytes_len(c));
    }
    Ok(())
}

/// Copies bf16 matrix `w` (`[rows, cols]`) into `buf` at byte `offset` in the layout the
/// worker's kernels read (`layout`): tiled or paired, 32 MiB of whole 16-row groups at a time
/// (a group is contiguous in every form, and the arranged matrix has the row-major length), or
/// as it is.
fn upload_bf16_matrix(
    worker: &Worker,
    buf: &Buffer,
    offset: usize,
    w: &[bf16],
    rows: usize,
    cols: usize,
    tick: &dyn Fn(usize),
) -> Result<(), Qwen3RunError> {
    let layout = upload_layout(worker, rows, cols);
    if layout == WeightLayout::RowMajor {
        return upload_chunked(buf, offset, w, tick);
    }
    let group = 16 * cols;
    let per = ((32usize << 20) / group).max(1) * group;
    for (i, c) in w.chunks(per).enumerate() {
        let t = layout.arrange_bf16(c, c.len() / cols, cols);
        buf.write_at(offset + i * per * 2, &t)?;
        tick(as_bytes_len(&t));
    }
    Ok(())
}

/// Whether a `[rows, cols]` projection of a model in `format` is held interleaved on a worker
/// whose kernels run on the host (`quant`, "Interleaved projections").
fn int8_interleaved(format: WeightFormat, rows: usize, cols: usize) -> bool {
    let w8a8 = format == WeightFormat::Int8(quant::Int8Acts::Quantised);
    quant::int8_interleaved(rows, cols, w8a8)
}

/// Quantises `w` (`[rows, cols]` bf16) into int8 records (`quant`), or interleaved values then
/// scales (`interleaved`, whole 16-row groups), and copies them into `buf` at byte `offset`,
/// about 64 MiB at a time, reporting progress.
fn upload_int8(
    buf: &Buffer,
    offset: usize,
    w: &[bf16],
    cols: usize,
    interleaved: bool,
    tick: &dyn Fn(usize),
) -> Result<(), Qwen3RunError> {
    if interleaved {
        let rows = w.len() / cols.max(1);
        // Chunks of whole groups: each is the interleaved matrix of its own rows (a group's
        // bytes do not depend on the others), its scales at their rows' place in the tail.
        let per = ((64usize << 20) / (cols.max(1) * PACK_ROWS)).max(1) * PACK_ROWS;
        for (i, part) in w.chunks(per * cols.max(1)).enumerate() {
            let n = part.len() / cols.max(1);
            let q = quant::quantize_matrix_as(part, n, cols, true);
            let (values, scales) = q.split_at(n * cols);
            buf.write_at(offset + i * per * cols, values)?;
            buf.write_at(offset + rows * cols + i * per * 4, scales)?;
            tick(q.len());
        }
        return Ok(());
    }
    let rec = quant::int8_record(cols);
    let per = ((64usize << 20) / rec).max(1);
    for (i, rows) in w.chunks(per * cols.max(1)).enumerate() {
        let q = quant::quantize_matrix(rows, rows.len() / cols.max(1), cols);
        buf.write_at(offset + i * per * rec, &q)?;
        tick(q.len());
    }
    Ok(())
}

/// The paged KV cache in two worker buffers: K and V, each `[layers, pages * page_size, row]`
/// bf16 (`row = kv_heads * head_dim`), layer stride one pool (`docs/qwen3.md`).
#[derive(Debug, Clone)]
pub struct KvBuffers {
    /// K pools of every layer.
    pub k: Buffer,
    /// V pools of every layer.
    pub v: Buffer,
    /// Layers.
    pub layers: usize,
    /// Pages per layer pool.
    pub num_pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Elements of one slot row (`kv_heads * head_dim`).
    pub row: usize,
}

impl KvBuffers {
    /// A zeroed cache for `config`'s layers with `num_pages` pages of `page_size` per layer.
    pub fn new(
        worker: &Worker,
        config: &Qwen3Config,
        num_pages: usize,
        page_size: usize,
    ) -> Result<KvBuffers, Qwen3RunError> {
        let row = config.kv_width();
        let bytes = config
            .num_hidden_layers
            .checked_mul(num_pages * page_size * row * 2)
            .ok_or_else(|| Qwen3RunError::Invalid("KV cache size overflows".into()))?;
        Ok(KvBuffers {
            k: worker.alloc(bytes)?,
            v: worker.alloc(bytes)?,
            layers: config.num_hidden_layers,
            num_pages,
            page_size,
            row,
        })
    }

    /// Slots (rows) of one layer's pool.
    pub fn slots(&self) -> usize {
        self.num_pages * self.page_size
    }

    /// Elements of one layer's pool.
    pub fn pool_len(&self) -> usize {
        self.slots() * self.row
    }

    fn check_layer(&self, l: usize) -> Result<(), Qwen3RunError> {
        if l >= self.layers {
            return Err(Qwen3RunError::Invalid(format!(
                "layer {l} of {}",
                self.layers
            )));
        }
        Ok(())
    }

    /// Writes layer `l`'s K and V pools (each [`KvBuffers::pool_len`] elements).
    pub fn write_layer(&self, l: usize, k: &[bf16], v: &[bf16]) -> Result<(), Qwen3RunError> {
        self.check_layer(l)?;
        if k.len() != self.pool_len() || v.len() != self.pool_len() {
            return Err(Qwen3RunError::Invalid(format!(
                "layer pools of {} / {} elements, expected {}",
                k.len(),
                v.len(),
                self.pool_len()
            )));
        }
        let off = l * self.pool_len() * 2;
        self.k.write_at(off, k)?;
        self.v.write_at(off, v)?;
        Ok(())
    }

    /// Copies a host cache of the same geometry into the buffers.
    pub fn upload(&self, kv: &KvCache) -> Result<(), Qwen3RunError> {
        if (kv.layers, kv.num_pages, kv.page_size, kv.row())
            != (self.layers, self.num_pages, self.page_size, self.row)
        {
            return Err(Qwen3RunError::Invalid(
                "host KV cache geometry differs from the buffers".into(),
            ));
        }
        for l in 0..self.layers {
            self.write_layer(l, kv.layer_k(l), kv.layer_v(l))?;
        }
        Ok(())
    }

    /// The K and V rows of slot `slot` in layer `l`.
    pub fn read_slot(
        &self,
        l: usize,
        slot: usize,
    ) -> Result<(Vec<bf16>, Vec<bf16>), Qwen3RunError> {
        self.check_layer(l)?;
        if slot >= self.slots() {
            return Err(Qwen3RunError::Invalid(format!(
                "slot {slot} of {}",
                self.slots()
            )));
        }
        let off = (l * self.pool_len() + slot * self.row) * 2;
        Ok((
            self.k.read_at(off, self.row)?,
            self.v.read_at(off, self.row)?,
        ))
    }

    /// The whole cache on the host (tests; as large as the buffers).
    pub fn download(&self, config: &Qwen3Config) -> Result<KvCache, Qwen3RunError> {
        let mut kv = KvCache::zeros(config, self.num_pages, self.page_size);
        kv.k.copy_from_slice(&self.k.read::<bf16>()?);
        kv.v.copy_from_slice(&self.v.read::<bf16>()?);
        Ok(kv)
    }
}
