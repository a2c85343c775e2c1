//! Matrix kernels of the step: GEMM tiles (projections, split-K accumulation into the residual),
//! the gate/up tiles fused with SwiGLU, and the LM-head tiles with their argmax.
//!
//! A multi-row tile's output is a strided column slice of a `[R, N]` tensor; the GEMM runs into
//! per-core scratch (`[R, n]`, contiguous) and the rows are copied out, which costs `R * n`
//! floats against the tile's `n * K` streamed weights.
//!
//! The projection and gate/up kernels are SPMD: a task covers a whole projection (or a tile of
//! it) and each block computes its share of the output columns (`TaskCtx::write_block_cols`,
//! in units of 16), so a phase is one task whose blocks the cores take as they free up: the
//! phase's tail is one small block, and the orchestrator submits one task instead of one per
//! tile.

use half::bf16;
use simpler_core::{DType, KernelError, RowsMut, TaskCtx};
use simpler_kernels_cpu as k;
use simpler_kernels_cpu::{
    ActsConversion, ActsI8, GemmTile, OutMode, PACK_BLOCK, PackedActs, TILE_ROWS, WeightLayout,
    WeightsBf16, WeightsI8,
};

use crate::qwen3::layout::bf16_layout;
use crate::qwen3::quant::{int8_interleaved, int8_record, interleaved_scales, record_scale};

use super::args::{argmax, gate_up, gemm, gemm_rope, lm_head};
use super::attn::STEP_FIELDS;
use super::scalars::{GateUpScalars, GemmRopeScalars, GemmScalars, KernelScalars, LmHeadScalars};
use super::{bad, check_packed, check_packed_range, dims2, with_scratch_dirty};

/// A weight tile: bf16 rows, or int8 records (`quant`: each row's values then its fp32
/// scale), told apart by the bound dtype; int8 W8A8 projections of whole 16-row groups may be
/// held interleaved instead (`quant::int8_interleaved`: `scales` holds the rows' scale bytes,
/// `data` their interleaved values).
#[derive(Clone, Copy)]
enum Weights<'a> {
    Bf16(WeightsBf16<'a>),
    I8 {
        data: &'a [i8],
        rows: usize,
        k: usize,
        scales: Option<&'a [i8]>,
    },
}

impl<'a> Weights<'a> {
    fn rows(&self) -> usize {
        match self {
            Weights::Bf16(w) => w.rows(),
            Weights::I8 { rows, .. } => *rows,
        }
    }

    /// Rows `first..first + n` (an SPMD block's share; shares start on multiples of 16, as
    /// tiled and paired weights need: checked, `name` names the kernel in the error).
    fn block_rows(self, first: usize, n: usize, name: &str) -> Result<Weights<'a>, KernelError> {
        Ok(match self {
            Weights::Bf16(w) => {
                if w.layout() != WeightLayout::RowMajor && !first.is_multiple_of(TILE_ROWS) {
                    return Err(bad(
                        name,
                        format!(
                            "block share from row {first} of {:?} weights is not on a group of {TILE_ROWS}",
                            w.layout()
                        ),
                    ));
                }
                Weights::Bf16(w.row_range(first..first + n))
            }
            Weights::I8 {
                data,
                k,
                scales: None,
                ..
            } => {
                let rec = int8_record(k);
                Weights::I8 {
                    data: &data[first * rec..(first + n) * rec],
                    rows: n,
                    k,
                    scales: None,
                }
            }
            Weights::I8 {
                data,
                rows,
                k,
                scales: Some(tail),
            } => {
                // Whole groups are contiguous and read alike wherever they start; a share
                // ends inside a group only at the matrix's end.
                if !first.is_multiple_of(TILE_ROWS)
                    || (first + n != rows && !n.is_multiple_of(TILE_ROWS))
                {
                    return Err(bad(
                        name,
                        format!(
                            "block share of rows {first}..{} of interleaved int8 weights is not whole groups of {TILE_ROWS}",
                            first + n
                        ),
                    ));
                }
                Weights::I8 {
                    data: &data[first * k..(first + n) * k],
                    rows: n,
                    k,
                    scales: Some(&tail[first * 4..(first + n) * 4]),
                }
            }
        })
    }
}

/// A task's activations, prepared once for every product it runs: packed fp32 for bf16
/// weights; for int8 weights, natural-order fp32 (wide) or int8 rows with their scales (W8A8).
enum Acts<'a> {
    Packed(PackedActs<'a>),
    /// Packed fp32 for bf16 weights with the path's conversion of them made once
    /// ([`PREPARED_BF16`]: the AVX-512 BF16 path's natural-order rows or the AMX tiles).
    Converted(PackedActs<'a>, &'a ActsConversion),
    Wide {
        x: Vec<f32>,
        rows: usize,
        k: usize,
    },
    Quantised {
        q: Vec<i8>,
        scales: Vec<f32>,
        rows: usize,
        k: usize,
    },
}

/// What a core's cached int8 activations were prepared from: the task's execution
/// ([`TaskCtx::instance`]: no other task of any run matches it), the input's place and shape,
/// and the activation mode.
#[derive(Clone, Copy, PartialEq, Eq)]
struct PreparedKey {
    instance: (u64, simpler_core::TaskId),
    at: usize,
    rows: usize,
    k: usize,
    w8a8: bool,
}

thread_local! {
    /// The int8 activations this core prepared last, with what they were prepared from.
    /// Every SPMD block of an int8 projection reads the same input; each block quantised all
    /// of it, which at 4 × 1024 took ~18% of the cores' time in the step
    /// (`docs/benchmarks.md`). Now a core prepares them once per task and its other blocks
    /// of the task reuse them; a block of any other task (or run) has another key.
    static PREPARED: std::cell::RefCell<Option<(PreparedKey, Acts<'static>)>> =
        const { std::cell::RefCell::new(None) };

    /// The bf16 activations this core converted last for its GEMM path (the AMX tiles, or the
    /// AVX-512 BF16 path's natural-order rows), with what they were converted from (`None`
    /// while a conversion is under way), kept as [`PREPARED`] is (the buffers stay across
    /// tasks). Every SPMD block converted the whole input before streaming its rows: at
    /// DeepSeek-V4's 8 rows × 4096 that is 128 KiB of tiles per block of 0.35–0.7 MB of
    /// weights, and a 512-token prefill block converts 2–6 MiB of packed rows. Converted once
    /// per task and core, tiled matrices at 8 rows in 12 blocks streamed 30–33 GB/s against
    /// 23–28 (`docs/benchmarks.md`, session 26); see there for the prefill step.
    static PREPARED_BF16: std::cell::RefCell<(Option<PreparedKey>, ActsConversion)> =
        std::cell::RefCell::new((None, ActsConversion::default()));
}

/// Runs `f` on `x` prepared for weights like `w` ([`Acts`]): the int8 forms, and for bf16
/// weights the path's conversion where one made once pays ([`ActsConversion::pays`]), from
/// this core's cache when it already prepared this task's input ([`PREPARED`],
/// [`PREPARED_BF16`]).
fn with_acts<R>(
    ctx: &TaskCtx<'_>,
    x: PackedActs<'_>,
    w: &Weights<'_>,
    w8a8: bool,
    f: impl FnOnce(&Acts<'_>) -> R,
) -> R {
    let bf16_layout = match w {
        Weights::Bf16(w) => Some(w.layout()),
        Weights::I8 { .. } => None,
    };
    let key = PreparedKey {
        instance: ctx.instance(),
        at: x.data().as_ptr() as usize,
        rows: x.rows(),
        k: x.cols(),
        w8a8,
    };
    if let Some(layout) = bf16_layout {
        if !ActsConversion::pays(x.rows(), x.cols(), layout) {
            return f(&Acts::Packed(x));
        }
        return PREPARED_BF16.with_borrow_mut(|(made_from, conv)| {
            if *made_from != Some(key) {
                *made_from = None;
                conv.convert(x);
                *made_from = Some(key);
            }
            f(&Acts::Converted(x, conv))
        });
    }
    PREPARED.with_borrow_mut(|cached| {
        let acts = match cached {
            Some((k, acts)) if *k == key => acts,
            _ => &mut cached.insert((key, Acts::prepare_int8(x, w8a8))).1,
        };
        f(acts)
    })
}

impl Acts<'_> {
    /// `x` in natural order (wide) or quantised per row (W8A8), for int8 weights.
    fn prepare_int8(x: PackedActs<'_>, w8a8: bool) -> Acts<'static> {
        let (rows, k) = (x.rows(), x.cols());
        let ld = simpler_kernels_cpu::packed_ld(k);
        let mut nat = vec![0.0f32; rows * k];
        for (b, dst) in nat.chunks_exact_mut(k.max(1)).enumerate() {
            unpack_row(&x.data()[b * ld..b * ld + k], dst);
        }
        if !w8a8 {
            return Acts::Wide { x: nat, rows, k };
        }
        let mut q = vec![0i8; rows * k];
        let mut scales = vec![0.0f32; rows];
        k::quantize_acts_i8(&nat, rows, k, k, None, &mut q, k, &mut scales);
        Acts::Quantised { q, scales, rows, k }
    }
}

/// One packed row back in natural order: whole 16-blocks hold the even elements then the odd
/// ones (`pack_index`), the last `k % 16` are in order. Every SPMD block of an int8 task runs
/// this on the whole input, so it is a plain copy loop, not a `pack_index` per element (which
/// cost more than the block's int8 product at batch 16).
fn unpack_row(src: &[f32], dst: &mut [f32]) {
    const HALF: usize = PACK_BLOCK / 2;
    let full = dst.len() / PACK_BLOCK * PACK_BLOCK;
    for (s, d) in src[..full]
        .chunks_exact(PACK_BLOCK)
        .zip(dst[..full].chunks_exact_mut(PACK_BLOCK))
    {
        for i in 0..HALF {
            d[2 * i] = s[i];
            d[2 * i + 1] = s[HALF + i];
        }
    }
    dst[full..].copy_from_slice(&src[full..]);
}

/// `out (+)= x @ w^T` over `tile`, scaled per row when `scale` is given.
fn run_gemm(
    w: Weights<'_>,
    x: &Acts<'_>,
    tile: &GemmTile,
    scale: Option<&[f32]>,
    out: &mut [f32],
    ld: usize,
) {
    match (w, x) {
        (Weights::Bf16(w), Acts::Packed(x)) => match scale {
            Some(s) => k::gemm_scaled_bf16(w, *x, tile, s, out, ld),
            None => k::gemm_bf16(w, *x, tile, out, ld),
        },
        (Weights::Bf16(w), Acts::Converted(x, conv)) => match scale {
            Some(s) => k::gemm_scaled_bf16_converted(w, *x, conv, tile, s, out, ld),
            None => k::gemm_bf16_converted(w, *x, conv, tile, out, ld),
        },
        (
            Weights::I8 {
                data,
                rows,
                k: kdim,
                scales,
            },
            acts,
        ) => {
            let sw;
            let wi = match scales {
                Some(tail) => {
                    sw = interleaved_scales(tail, 0, rows);
                    WeightsI8::interleaved(data, &sw, rows, kdim)
                }
                None => {
                    let rec = int8_record(kdim);
                    // The tile's rows' scales only (the products read no others): each lies
                    // at the end of its row's record, so reading every row's cost a
                    // scattered line per row of the whole matrix in every SPMD block.
                    let mut s = vec![0.0f32; rows];
                    for r in tile.n.clone() {
                        s[r] = record_scale(&data[r * rec..], kdim);
                    }
                    sw = s;
                    WeightsI8::new(data, &sw, rows, kdim, rec)
                }
            };
            match acts {
                Acts::Wide { x, rows: b, k: kx } => {
                    k::gemm_i8_wide(wi, x, *b, *kx, scale, tile, out, ld)
                }
                Acts::Quantised {
                    q,
                    scales,
                    rows: b,
                    k: kx,
                } => {
                    // A row factor (the deferred 1/rms) is linear: fold it into the row scales.
                    let sa: Vec<f32> = match scale {
                        Some(s) => scales.iter().zip(s).map(|(a, r)| a * r).collect(),
                        None => scales.clone(),
                    };
                    k::gemm_i8_w8a8(wi, ActsI8::new(q, &sa, *b, *kx, *kx), tile, out, ld);
                }
                Acts::Packed(_) | Acts::Converted(..) => {
                    unreachable!("int8 weights get prepared activations")
                }
            }
        }
        (Weights::Bf16(_), _) => unreachable!("bf16 weights get packed activations"),
    }
}

/// Runs a GEMM whose result lands in the rows of `out` (`[rows, n]`, possibly strided).
fn gemm_into_rows(
    w: Weights<'_>,
    x: &Acts<'_>,
    tile: &GemmTile,
    scale: Option<&[f32]>,
    out: &mut RowsMut<'_, f32>,
) {
    let (rows, n) = (out.len(), out.row_len());
    // An SPMD block whose share is empty (more blocks than column units) has nothing to do.
    if rows == 0 || n == 0 {
        return;
    }
    if rows == 1 {
        run_gemm(w, x, tile, scale, out.row(0), n);
        return;
    }
    // The products are stored into the scratch (every element before it is read), then
    // stored or added into the rows. Copying the rows in for an `Add` product, then back out,
    // took one more pass over them. Adding here gives the bits the kernels' own `Add` gives
    // where a kernel adds each finished, scaled sum to the output once: the AVX-512 BF16 and
    // AMX paths, the paired and dot AVX2 passes, the portable loops and the int8 ones of one
    // activation group (this model's). The AVX2 panel kernel (row-major weights, 64 rows and
    // more) sums `K` in blocks of 512 through its output, so there the residual now joins
    // after the blocks' sum instead of before the first: a rounding-order difference, inside
    // the goldens' tolerances.
    let store = GemmTile {
        mode: OutMode::Store,
        ..tile.clone()
    };
    with_scratch_dirty(rows * n, |s| {
        run_gemm(w, x, &store, scale, s, n);
        for (src, dst) in s.chunks_exact(n).zip(out.iter_mut()) {
            match tile.mode {
                OutMode::Store => dst.copy_from_slice(src),
                OutMode::Add => k::residual_add_f32(dst, src),
            }
        }
    });
}

/// Reads the optional per-row scale at argument `i` (present when the task has `i + 1` args).
fn optional_scale<'a>(
    ctx: &'a TaskCtx<'_>,
    i: usize,
    rows: usize,
    name: &str,
) -> Result<Option<&'a [f32]>, KernelError> {
    if ctx.num_args() <= i {
        return Ok(None);
    }
    let s = ctx.read::<f32>(i)?;
    if s.len() != rows {
        return Err(bad(name, format!("{} row scales for {rows} rows", s.len())));
    }
    Ok(Some(s))
}

/// The weight tile at argument `i` as `[n, kdim]` (bf16, or int8 records when bound as i8).
/// Where a bf16 weight tensor's layout comes from.
#[derive(Clone, Copy)]
enum Source {
    /// A Qwen3 resident model: the layout follows from the bound matrix's shape
    /// (`qwen3::layout`; a tiled or paired matrix has its row-major length).
    Resident,
    /// The layout another model's rule gives the bound matrix's `[rows, cols]` (models
    /// running the Qwen3 GEMM kernel on their own weights).
    Rule(fn(usize, usize) -> WeightLayout),
}

/// The weights at argument `i`, rows of `kdim`; an int8 matrix in the form its upload chose
/// for its shape and `w8a8` (`quant::int8_interleaved`).
fn weights<'a>(
    ctx: &'a TaskCtx<'_>,
    i: usize,
    kdim: usize,
    name: &str,
    source: Source,
    w8a8: bool,
) -> Result<Weights<'a>, KernelError> {
    if ctx.tensor(i)?.dtype() == DType::I8 {
        let w = ctx.read::<i8>(i)?;
        let rec = int8_record(kdim);
        if kdim == 0 || !w.len().is_multiple_of(rec) {
            return Err(bad(
                name,
                format!(
                    "int8 weight tile of {} bytes is not records of {rec}",
                    w.len()
                ),
            ));
        }
        let rows = w.len() / rec;
        if int8_interleaved(rows, kdim, w8a8) {
            let (data, tail) = w.split_at(rows * kdim);
            return Ok(Weights::I8 {
                data,
                rows,
                k: kdim,
                scales: Some(tail),
            });
        }
        return Ok(Weights::I8 {
            data: w,
            rows,
            k: kdim,
            scales: None,
        });
    }
    let w = ctx.read::<bf16>(i)?;
    if kdim == 0 || !w.len().is_multiple_of(kdim) {
        return Err(bad(
            name,
            format!("weight tile of {} elements is not rows of {kdim}", w.len()),
        ));
    }
    let rows = w.len() / kdim;
    let layout = match source {
        Source::Resident => bf16_layout(rows, kdim),
        Source::Rule(rule) => rule(rows, kdim),
    };
    Ok(Weights::Bf16(WeightsBf16::with_layout(
        w, rows, kdim, layout,
    )))
}

/// The packed activations at argument `i` as `[rows, kdim]`.
fn acts<'a>(
    ctx: &'a TaskCtx<'_>,
    i: usize,
    kdim: usize,
    name: &str,
) -> Result<PackedActs<'a>, KernelError> {
    let (rows, _) = dims2(ctx, i)?;
    let x = ctx.read::<f32>(i)?;
    check_packed(name, x.len(), rows, kdim)?;
    Ok(PackedActs::new(x, rows, kdim))
}

/// The projection kernel on a Qwen3 resident model's weights (`qwen3::layout`).
pub(super) fn gemm_tile(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    gemm_tile_from(ctx, Source::Resident)
}

/// The projection kernel on weights in the layout `rule` gives a bound `[rows, cols]`
/// matrix (the rule of the model that uploaded them).
pub(crate) fn gemm_tile_in(
    ctx: &TaskCtx<'_>,
    rule: fn(usize, usize) -> WeightLayout,
) -> Result<(), KernelError> {
    gemm_tile_from(ctx, Source::Rule(rule))
}

fn gemm_tile_from(ctx: &TaskCtx<'_>, source: Source) -> Result<(), KernelError> {
    const NAME: &str = "gemm_tile_bf16";
    let GemmScalars { k: kdim, add, w8a8 } = GemmScalars::read(ctx)?;
    let x = acts(ctx, gemm::acts, kdim, NAME)?;
    let w = weights(ctx, gemm::w, kdim, NAME, source, w8a8)?;
    let scale = optional_scale(ctx, gemm::scale, x.rows(), NAME)?;
    let mut out = ctx.write_block_cols::<f32>(gemm::out, PACK_BLOCK)?;
    if out.len() != x.rows() || out.view_row_len() != w.rows() {
        return Err(bad(
            NAME,
            format!(
                "output [{}, {}] for {} rows x {} columns",
                out.len(),
                out.view_row_len(),
                x.rows(),
                w.rows()
            ),
        ));
    }
    let w = w.block_rows(out.first_col(), out.row_len(), NAME)?;
    let tile = GemmTile {
        n: 0..w.rows(),
        k: 0..kdim,
        mode: if add { OutMode::Add } else { OutMode::Store },
    };
    if w.rows() == 0 {
        return Ok(());
    }
    with_acts(ctx, x, &w, w8a8, |x| {
        gemm_into_rows(w, x, &tile, scale, &mut out)
    });
    Ok(())
}

/// What a decode q/k/v block's epilogue makes of one projection's heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StepRole {
    /// q: per-head norm and RoPE at each row's position, bf16 into the Q rows.
    Q,
    /// k: per-head norm and RoPE, bf16 into the K pool at each row's slot.
    K,
    /// v: bf16 into the V pool at each row's slot.
    V,
}

/// A step's q, k and v projections as one SPMD task with their epilogues, so nothing runs
/// between the projections and the attention: the blocks split the heads of all three
/// (q's, then k's, then v's: `block_range_tapered` over their sum), each block computes whole
/// heads and, while they are in its cache, q: norms and rotates them into bf16 Q rows; k: norms
/// and rotates them into the K pool at each row's slot; v: rounds them into the V pool.
/// Positions and slots come from the step entries at run time (`seq_len - 1`, `slot`), so one
/// decode graph serves every step; a prefill's rows are its tokens, each with its own entry. A block takes its columns of each output through
/// `TaskCtx::write_rect` (every row of its heads' columns: the blocks' heads are disjoint).
///
/// As three tasks (decode until session 55, prefill until session 60), each paid its own first
/// block per core (the activations' conversion and a slower first product, 10–15 µs of a core
/// in decode; the conversion of 512 rows in prefill), its own dispatch and its own tail; the
/// attention waited on the k and v tasks. Before (decode until session 32, prefill until 60)
/// the projections wrote fp32 q/k/v, and other tasks read them back from memory to norm, rotate
/// and write them.
///
/// Every block checks every row's entry before it writes anything: a length outside the
/// tables, a slot outside the pools or two rows on one slot fails every block, so the step
/// fails with the pools untouched.
pub(super) fn gemm_rope_step(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "gemm_rope_step_bf16";
    let GemmRopeScalars { k: kdim, w8a8, eps } = GemmRopeScalars::read(ctx)?;
    let x = acts(ctx, gemm_rope::acts, kdim, NAME)?;
    let scale = optional_scale(ctx, gemm_rope::scale, x.rows(), NAME)?;
    let (q_norm, k_norm) = (
        ctx.read::<f32>(gemm_rope::q_norm)?,
        ctx.read::<f32>(gemm_rope::k_norm)?,
    );
    let (max_seq, d) = dims2(ctx, gemm_rope::cos)?;
    let cos = ctx.read::<f32>(gemm_rope::cos)?;
    let sin = ctx.read::<f32>(gemm_rope::sin)?;
    let step = ctx.read::<u32>(gemm_rope::step)?;
    let n = x.rows();
    let roles = [
        (StepRole::Q, gemm_rope::wq, gemm_rope::q_out, q_norm),
        (StepRole::K, gemm_rope::wk, gemm_rope::k_out, k_norm),
        // v has no norm.
        (StepRole::V, gemm_rope::wv, gemm_rope::v_out, &[][..]),
    ];
    let weights = |i| weights(ctx, i, kdim, NAME, Source::Resident, w8a8);
    let w = [
        weights(gemm_rope::wq)?,
        weights(gemm_rope::wk)?,
        weights(gemm_rope::wv)?,
    ];
    if d == 0
        || q_norm.len() != d
        || k_norm.len() != d
        || sin.len() != cos.len()
        || w.iter().any(|w| !w.rows().is_multiple_of(d))
    {
        return Err(bad(
            NAME,
            format!(
                "inconsistent shapes: q, k and v of {}, {} and {} output columns, head_dim {d}, norms of {} and {}, cos/sin tables of {} and {}",
                w[0].rows(),
                w[1].rows(),
                w[2].rows(),
                q_norm.len(),
                k_norm.len(),
                cos.len(),
                sin.len()
            ),
        ));
    }
    if step.len() != n * STEP_FIELDS {
        return Err(bad(
            NAME,
            format!("{} step entries for {n} rows", step.len()),
        ));
    }
    // The outputs' shapes: Q rows per step row, the pools as wide as their projections and of
    // one slot count.
    let out_dims = [
        dims2(ctx, gemm_rope::q_out)?,
        dims2(ctx, gemm_rope::k_out)?,
        dims2(ctx, gemm_rope::v_out)?,
    ];
    let slots = out_dims[1].0;
    if out_dims[0].0 != n
        || out_dims[2].0 != slots
        || out_dims.iter().zip(&w).any(|(o, w)| o.1 != w.rows())
    {
        return Err(bad(
            NAME,
            format!(
                "Q out {:?}, K pool {:?} and V pool {:?} for {n} rows of {}, {} and {} projected columns",
                out_dims[0],
                out_dims[1],
                out_dims[2],
                w[0].rows(),
                w[1].rows(),
                w[2].rows()
            ),
        ));
    }
    let rows = step_rows(NAME, step, n, max_seq, Some(slots))?;
    // This block's heads of q, k and v together, then each projection's part of them, its
    // weight rows cut before anything is written (a cut the layout refuses fails the block
    // with the pools untouched). Whole heads start on a 16-row group of the weights, where
    // tiled, paired and interleaved int8 matrices can be cut, because the upload refuses a
    // head_dim that is not a multiple of 16 (`ResidentModel::upload_as`).
    let heads = w.map(|w| w.rows() / d);
    let mine = ctx.block_range_tapered(heads.iter().sum());
    let mut first_head = 0;
    let mut parts = Vec::with_capacity(3);
    for (((role, _, oi, norm), w), nh) in roles.into_iter().zip(w).zip(heads) {
        let role_heads = first_head..first_head + nh;
        first_head += nh;
        let part = mine.start.max(role_heads.start)..mine.end.min(role_heads.end);
        if part.is_empty() {
            continue;
        }
        let (c0, cols) = ((part.start - role_heads.start) * d, part.len() * d);
        parts.push((role, oi, norm, c0, cols, w.block_rows(c0, cols, NAME)?));
    }
    for (role, oi, norm, c0, cols, w) in parts {
        let mut out =
            ctx.write_rect::<bf16>(oi, 0..out_dims_rows(role, n, slots), c0..c0 + cols)?;
        let tile = GemmTile {
            n: 0..cols,
            k: 0..kdim,
            mode: OutMode::Store,
        };
        with_acts(ctx, x, &w, w8a8, |x| {
            // Every element is stored by the product before it is read.
            with_scratch_dirty(n * cols, |s| {
                run_gemm(w, x, &tile, scale, s, cols);
                for (t, (y, &(pos, slot))) in s.chunks_exact_mut(cols).zip(&rows).enumerate() {
                    let (c, sn) = (&cos[pos * d..(pos + 1) * d], &sin[pos * d..(pos + 1) * d]);
                    match role {
                        StepRole::Q => k::qk_norm_rope_bf16(y, norm, eps, c, sn, out.row(t)),
                        StepRole::K => k::qk_norm_rope_bf16(y, norm, eps, c, sn, out.row(slot)),
                        StepRole::V => k::cast_f32_bf16(y, out.row(slot)),
                    }
                }
            });
        });
    }
    Ok(())
}

/// The rows of a q/k/v output: Q's step rows, a pool's slots.
fn out_dims_rows(role: StepRole, n: usize, slots: usize) -> usize {
    match role {
        StepRole::Q => n,
        StepRole::K | StepRole::V => slots,
    }
}

/// Each row's `(position, slot)` from its step entry (`seq_len, slot`), every entry checked
/// first: the length within the RoPE tables' `1..=max_seq` and, for a pool of `slots`
/// slots, the slot within it and no two rows on one slot. The error names the first row (in
/// row order) that fails: its length, its slot's range, or the earlier row whose slot it
/// repeats (the first such). Repeats are found by sorting, not by scanning the rows before
/// each row: every block of a 512-row prefill checks every row.
fn step_rows(
    name: &str,
    step: &[u32],
    n: usize,
    max_seq: usize,
    slots: Option<usize>,
) -> Result<Vec<(usize, usize)>, KernelError> {
    let mut rows: Vec<(usize, usize)> = Vec::with_capacity(n);
    let mut range_error = None;
    for t in 0..n {
        let (len, slot) = (
            step[t * STEP_FIELDS] as usize,
            step[t * STEP_FIELDS + 1] as usize,
        );
        if len == 0 || len > max_seq {
            range_error = Some(format!(
                "row {t}: sequence length {len} outside the RoPE tables' 1..={max_seq}"
            ));
            break;
        }
        if let Some(slots) = slots
            && slot >= slots
        {
            range_error = Some(format!(
                "row {t}: slot {slot} outside the pool's {slots} slots"
            ));
            break;
        }
        rows.push((len - 1, slot));
    }
    // Rows before the first out-of-range one: the first row repeating an earlier row's slot
    // is the second of its slot's rows in row order; of all slots', the least.
    if slots.is_some() {
        let mut by_slot: Vec<(usize, usize)> =
            rows.iter().enumerate().map(|(t, r)| (r.1, t)).collect();
        by_slot.sort_unstable();
        let repeat = by_slot
            .windows(2)
            .enumerate()
            .filter(|(i, w)| w[0].0 == w[1].0 && (*i == 0 || by_slot[i - 1].0 != w[0].0))
            .map(|(_, w)| (w[1].1, w[0].1, w[0].0))
            .min();
        if let Some((t, u, slot)) = repeat {
            return Err(bad(
                name,
                format!("rows {u} and {t} both write slot {slot}"),
            ));
        }
    }
    match range_error {
        Some(e) => Err(bad(name, e)),
        None => Ok(rows),
    }
}

pub(super) fn gate_up_swiglu(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "gate_up_swiglu_bf16";
    let GateUpScalars {
        hidden: h,
        intermediate: inter,
        w8a8,
    } = GateUpScalars::read(ctx)?;
    let x = acts(ctx, gate_up::acts, h, NAME)?;
    let wg = weights(ctx, gate_up::w_gate, h, NAME, Source::Resident, w8a8)?;
    let wu = weights(ctx, gate_up::w_up, h, NAME, Source::Resident, w8a8)?;
    let rows = x.rows();
    if wu.rows() != wg.rows() {
        return Err(bad(NAME, "gate and up tiles differ in rows"));
    }
    check_packed_range(NAME, 0, wg.rows(), inter)?;
    let scale = optional_scale(ctx, gate_up::scale, rows, NAME)?;
    let mut out = ctx.write_block_cols::<f32>(gate_up::act, PACK_BLOCK)?;
    if out.len() != rows || out.view_row_len() != wg.rows() {
        return Err(bad(
            NAME,
            format!(
                "output [{}, {}] for {rows} x {}",
                out.len(),
                out.view_row_len(),
                wg.rows()
            ),
        ));
    }
    // This block's columns (a multiple of 16 from the tile's start, so packed blocks stay
    // whole).
    let (wg, wu) = (
        wg.block_rows(out.first_col(), out.row_len(), NAME)?,
        wu.block_rows(out.first_col(), out.row_len(), NAME)?,
    );
    let c0 = out.first_col();
    let n = wg.rows();
    if n == 0 {
        // An empty share: more blocks than 16-column units.
        return Ok(());
    }
    let full = GemmTile {
        n: 0..n,
        k: 0..h,
        mode: OutMode::Store,
    };
    // Both products store every element of their halves.
    with_scratch_dirty(2 * rows * n, |s| {
        let (gate, up) = s.split_at_mut(rows * n);
        with_acts(ctx, x, &wg, w8a8, |x| {
            run_gemm(wg, x, &full, None, gate, n);
            run_gemm(wu, x, &full, None, up, n);
        });
        // SwiGLU rounded to bf16 and packed into this block's columns of each row, in one
        // pass (`swiglu_pack_bf16`).
        for (b, dst) in out.iter_mut().enumerate() {
            let row = b * n..(b + 1) * n;
            let s = scale.map_or(1.0, |s| s[b]);
            k::swiglu_pack_bf16(&gate[row.clone()], &up[row], s, c0, inter, dst);
        }
    });
    Ok(())
}

pub(super) fn lm_head_tile(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "lm_head_tile_bf16";
    let LmHeadScalars { hidden: h, w8a8 } = LmHeadScalars::read(ctx)?;
    let x = acts(ctx, lm_head::acts, h, NAME)?;
    let w = weights(ctx, lm_head::w, h, NAME, Source::Resident, w8a8)?;
    let rows = x.rows();
    let mut logits = ctx.write_block_cols::<f32>(lm_head::logits, PACK_BLOCK)?;
    if logits.len() != rows || logits.view_row_len() != w.rows() {
        return Err(bad(NAME, "logits view does not match the tile"));
    }
    let n0 = logits.first_col();
    let w = w.block_rows(logits.first_col(), logits.row_len(), NAME)?;
    // This block's `[rows, 2]` slot of the per-block argmax results.
    let best = ctx.write_chunk::<u32>(lm_head::best, 2 * rows)?;
    if best.len() != 2 * rows {
        return Err(bad(
            NAME,
            format!("argmax slot of {} for {rows} rows", best.len()),
        ));
    }
    let n = w.rows();
    let tile = GemmTile {
        n: 0..n,
        k: 0..h,
        mode: OutMode::Store,
    };
    // The logits are computed into this core's scratch, their argmax taken there while they
    // are in its cache, and they reach the output rows by non-temporal stores: the output's
    // lines are cold (the head's weights stream through the caches between steps), and plain
    // stores first read each of them from memory (`copy_nontemporal_f32`).
    with_scratch_dirty(rows * n, |s| {
        if n > 0 && rows > 0 {
            with_acts(ctx, x, &w, w8a8, |x| run_gemm(w, x, &tile, None, s, n));
        }
        for (b, (slot, dst)) in best.chunks_exact_mut(2).zip(logits.iter_mut()).enumerate() {
            let row = &s[b * n..(b + 1) * n];
            match k::argmax_f32(row) {
                Some((i, v)) => {
                    slot[0] = (n0 + i) as u32;
                    slot[1] = v.to_bits();
                }
                None => {
                    slot[0] = u32::MAX;
                    slot[1] = f32::NAN.to_bits();
                }
            }
            k::copy_nontemporal_f32(row, dst);
        }
    });
    Ok(())
}

pub(super) fn argmax_combine(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "argmax_combine_f32";
    let shape = ctx.tensor(argmax::best)?.shape().to_vec();
    if shape.len() != 3 || shape[2] != 2 {
        return Err(bad(
            NAME,
            format!("tile results of shape {shape:?}, expected [tiles, rows, 2]"),
        ));
    }
    let (tiles, rows) = (shape[0] as usize, shape[1] as usize);
    let best = ctx.read::<u32>(argmax::best)?;
    let ids = ctx.write::<u32>(argmax::ids)?;
    if ids.len() != rows {
        return Err(bad(NAME, format!("{} ids for {rows} rows", ids.len())));
    }
    for (b, id) in ids.iter_mut().enumerate() {
        let parts: Vec<Option<(usize, f32)>> = (0..tiles)
            .map(|t| {
                let at = (t * rows + b) * 2;
                (best[at] != u32::MAX).then(|| (best[at] as usize, f32::from_bits(best[at + 1])))
            })
            .collect();
        *id = k::argmax_combine(&parts).map_or(0, |(i, _)| i as u32);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use simpler_core::{DType, RunArgs, ScopeKind, Task};
    use simpler_kernels_cpu::{pack_acts_f32, packed_len};

    use super::super::GEMM_TILE;
    use super::super::args::{Arg, GemmArgs};
    use super::super::scalars::{GemmScalars, PushScalars};
    use super::{STEP_FIELDS, step_rows, unpack_row};
    use crate::qwen3::quant::{
        dequantize_matrix_as_bf16, int8_interleaved, int8_record, quantize_matrix_as,
    };

    /// The step entries' checks against a plain row-by-row reference (each row's length, then
    /// its slot's range, then a scan of the rows before it for its slot): the same rows or the
    /// same error, over every entry list of up to 4 rows of lengths 0..=3 (the tables hold 2)
    /// and slots 0..=4 (the pool holds 4), with and without a pool.
    #[test]
    fn step_rows_name_the_first_failing_row_as_a_row_by_row_scan_does() {
        fn reference(
            step: &[u32],
            n: usize,
            max_seq: usize,
            slots: Option<usize>,
        ) -> Result<Vec<(usize, usize)>, String> {
            let mut rows: Vec<(usize, usize)> = Vec::new();
            for t in 0..n {
                let (len, slot) = (step[2 * t] as usize, step[2 * t + 1] as usize);
                if len == 0 || len > max_seq {
                    return Err(format!(
                        "row {t}: sequence length {len} outside the RoPE tables' 1..={max_seq}"
                    ));
                }
                if let Some(slots) = slots {
                    if slot >= slots {
                        return Err(format!(
                            "row {t}: slot {slot} outside the pool's {slots} slots"
                        ));
                    }
                    if let Some(u) = rows.iter().position(|&(_, s)| s == slot) {
                        return Err(format!("rows {u} and {t} both write slot {slot}"));
                    }
                }
                rows.push((len - 1, slot));
            }
            Ok(rows)
        }
        assert_eq!(STEP_FIELDS, 2);
        let mut checked = 0;
        for n in 0..=4usize {
            for code in 0..(4usize * 5).pow(n as u32) {
                let mut c = code;
                let step: Vec<u32> = (0..n)
                    .flat_map(|_| {
                        let (len, slot) = (c % 4, (c / 4) % 5);
                        c /= 20;
                        [len as u32, slot as u32]
                    })
                    .collect();
                for slots in [Some(4), None] {
                    let got = step_rows("t", &step, n, 2, slots).map_err(|e| e.to_string());
                    match (got, reference(&step, n, 2, slots)) {
                        (Ok(g), Ok(w)) => assert_eq!(g, w, "{step:?}"),
                        (Err(g), Err(w)) => assert!(g.ends_with(&w), "{step:?}: {g} vs {w}"),
                        (g, w) => panic!("{step:?} {slots:?}: {g:?} vs {w:?}"),
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked > 300_000, "{checked}");
    }

    /// A block share off a 16-row group of arranged (paired or tiled) weights is refused with
    /// an error naming the kernel and the layout, where slicing would panic; row-major weights
    /// take any share, and the refused weights still serve a share on a group.
    #[test]
    fn a_block_share_off_a_group_of_arranged_weights_is_an_error() {
        use simpler_kernels_cpu::{WeightLayout, WeightsBf16};
        let rm = vec![bf16::ZERO; 32 * 64];
        for layout in [WeightLayout::Pairs, WeightLayout::Tiled] {
            let data = layout.arrange_bf16(&rm, 32, 64);
            let w = super::Weights::Bf16(WeightsBf16::with_layout(&data, 32, 64, layout));
            let e = match w.block_rows(8, 8, "qwen3_gemm") {
                Err(e) => e.to_string(),
                Ok(_) => panic!("{layout:?}: a share from row 8 was accepted"),
            };
            assert!(
                e.contains("qwen3_gemm")
                    && e.contains(&format!("{layout:?}"))
                    && e.contains("row 8"),
                "{e}"
            );
            let part = w
                .block_rows(16, 16, "qwen3_gemm")
                .expect("a share on a group");
            assert_eq!(part.rows(), 16);
        }
        let w = super::Weights::Bf16(WeightsBf16::new(&rm, 32, 64));
        assert_eq!(
            w.block_rows(8, 8, "qwen3_gemm").ok().map(|p| p.rows()),
            Some(8)
        );
    }

    /// Interleaved int8 weights take block shares of whole 16-row groups (the last may end the
    /// matrix inside one) and refuse any other share by name, where slicing would read
    /// another row's bytes.
    #[test]
    fn a_block_share_off_a_group_of_interleaved_int8_weights_is_an_error() {
        let (rows, k) = (48usize, 64usize);
        let w: Vec<bf16> = (0..rows * k)
            .map(|i| bf16::from_f32((i % 13) as f32 / 13.0 - 0.5))
            .collect();
        let q = quantize_matrix_as(&w, rows, k, true);
        let (data, tail) = q.split_at(rows * k);
        let whole = super::Weights::I8 {
            data,
            rows,
            k,
            scales: Some(tail),
        };
        for (first, n) in [(8, 16), (16, 8)] {
            let e = match whole.block_rows(first, n, "qwen3_gemm") {
                Err(e) => e.to_string(),
                Ok(_) => panic!("a share of rows {first}..{} was accepted", first + n),
            };
            assert!(
                e.contains("qwen3_gemm") && e.contains("whole groups"),
                "{e}"
            );
        }
        let Ok(super::Weights::I8 {
            data: d,
            rows: r,
            scales: Some(s),
            ..
        }) = whole.block_rows(16, 32, "qwen3_gemm")
        else {
            panic!("a share of whole groups was refused");
        };
        assert_eq!((r, d, s), (32, &data[16 * k..48 * k], &tail[64..192]));
    }

    #[test]
    fn unpack_row_inverts_the_packing() {
        for k in [1, 15, 16, 17, 40, 64] {
            let x: Vec<f32> = (0..k).map(|i| i as f32).collect();
            let mut packed = vec![0.0; packed_len(1, k)];
            pack_acts_f32(&x, 1, k, &mut packed);
            let mut back = vec![-1.0; k];
            unpack_row(&packed[..k], &mut back);
            assert_eq!(back, x, "k = {k}");
        }
    }

    /// Runs one projection task (`GEMM_TILE` in 8 blocks on `w`'s cores, weights `wbuf` bound
    /// as `wdtype [n, wcols]`) three times on one input buffer whose values change between the
    /// runs, and hands each run's activations `[rows, k]` and output `[rows, n]` to `check`.
    #[allow(clippy::too_many_arguments)]
    fn three_runs_on_one_input(
        w: &simpler_core::Worker,
        wbuf: &simpler_core::Buffer,
        wdtype: DType,
        wcols: usize,
        (rows, n, k): (usize, usize, usize),
        w8a8: bool,
        check: impl Fn(usize, &[f32], &[f32]),
    ) {
        let xbuf = w.alloc(packed_len(rows, k) * 4).unwrap();
        let obuf = w.alloc(rows * n * 4).unwrap();
        for round in 0..3usize {
            // Small integers: exact in bf16.
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 31 + round * 17) % 23) as f32 - 11.0)
                .collect();
            let mut packed = vec![0.0f32; packed_len(rows, k)];
            pack_acts_f32(&x, rows, k, &mut packed);
            xbuf.write(&packed).unwrap();
            let args = RunArgs {
                buffers: vec![xbuf.clone(), wbuf.clone(), obuf.clone()],
                scalars: vec![],
            };
            w.run_fn("gemm", args, &Default::default(), move |o, a| {
                let xt = o.bind(
                    &a.buffers[0],
                    DType::F32,
                    &[rows as u64, (packed_len(rows, k) / rows) as u64],
                )?;
                let wt = o.bind(&a.buffers[1], wdtype, &[n as u64, wcols as u64])?;
                let ot = o.bind(&a.buffers[2], DType::F32, &[rows as u64, n as u64])?;
                o.scope(ScopeKind::Auto, |o| {
                    let task = GemmArgs {
                        acts: Arg::In(&xt),
                        w: Arg::In(&wt),
                        out: Arg::Out(&ot),
                        scale: None,
                    }
                    .push(Task::new(GEMM_TILE))
                    .blocks(8)
                    .push_scalars(GemmScalars {
                        k,
                        add: false,
                        w8a8,
                    });
                    o.submit(task)?;
                    Ok(())
                })
            })
            .unwrap();
            check(round, &x, &obuf.read::<f32>().unwrap());
        }
    }

    /// Each output of `got` (`[rows, n]`) against the plain sum of `x` (`[rows, k]`) times
    /// `w` (`[n, k]`), within `tol` of the sum of the terms' sizes.
    fn check_products(round: usize, x: &[f32], w: &[bf16], got: &[f32], n: usize, tol: f32) {
        let k = w.len() / n;
        for (b, xr) in x.chunks_exact(k).enumerate() {
            for (c, wr) in w.chunks_exact(k).enumerate() {
                let terms = xr.iter().zip(wr).map(|(a, b)| a * b.to_f32());
                let want: f32 = terms.clone().sum();
                let size: f32 = terms.map(f32::abs).sum();
                let g = got[b * n + c];
                assert!(
                    (g - want).abs() <= tol * size,
                    "round {round} [{b}, {c}]: {g} vs {want} (terms of size {size})"
                );
            }
        }
    }

    /// One int8 projection task run three times on one input buffer whose values change
    /// between the runs, in 8 blocks on 2 cores: each run's output is the product of its own
    /// values. Each core keeps the int8 activations it prepared for a task ([`super::with_acts`]),
    /// and the input sits at the same address every run, so only the key's task execution
    /// tells one run's task from the last's.
    #[test]
    fn prepared_int8_activations_never_outlive_their_task() {
        let w = super::super::test_worker();
        let (rows, n, k) = (2usize, 256usize, 64usize);
        let weights: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32((i * 7919 % 201) as f32 / 100.0 - 1.0))
            .collect();
        // In the form the kernel reads a W8A8 projection of this shape in here (interleaved
        // where the int8 path is AVX-512 VNNI or AMX, else records).
        let il = int8_interleaved(n, k, true);
        let records = quantize_matrix_as(&weights, n, k, il);
        let deq = dequantize_matrix_as_bf16(&records, k, il);
        let wbuf = w.buffer_from(&records).unwrap();
        // W8A8 rounds each activation to its row's 127 steps (half a step of 11 / 127 at
        // most); another round's values miss by the size of the sum.
        three_runs_on_one_input(
            &w,
            &wbuf,
            DType::I8,
            int8_record(k),
            (rows, n, k),
            true,
            |round, x, got| check_products(round, x, &deq, got, n, 0.01),
        );
    }

    /// [`prepared_int8_activations_never_outlive_their_task`] for bf16 weights at 8 rows held
    /// as `arrange` lays them out (`K` = `k`), the GEMM kernel `gemm` registered as another
    /// model registers it, with a rule giving that layout.
    fn bf16_conversions_never_outlive_their_task(
        gemm: fn(&simpler_core::TaskCtx<'_>) -> Result<(), simpler_core::KernelError>,
        arrange: fn(&[bf16], usize, usize) -> Vec<bf16>,
        k: usize,
    ) {
        let w = super::super::bare_test_worker();
        w.register_kernel(super::super::gemm_spec_with(gemm))
            .unwrap();
        let (rows, n) = (8usize, 256usize);
        let weights: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32((i * 7919 % 201) as f32 / 100.0 - 1.0))
            .collect();
        let wbuf = w.buffer_from(&arrange(&weights, n, k)).unwrap();
        // Exact inputs: only the summation order separates the kernel from the plain sum.
        three_runs_on_one_input(
            &w,
            &wbuf,
            DType::BF16,
            k,
            (rows, n, k),
            false,
            |round, x, got| check_products(round, x, &weights, got, n, 1e-5),
        );
    }

    /// Tiled weights, where the AMX path converts each task's activations to tiles once per
    /// core and the AVX-512 BF16 path to natural-order rows ([`super::PREPARED_BF16`]; on a
    /// machine with neither nothing is kept and the test checks the plain product).
    #[test]
    fn prepared_bf16_activations_never_outlive_their_task() {
        fn tiled_gemm(ctx: &simpler_core::TaskCtx<'_>) -> Result<(), simpler_core::KernelError> {
            super::gemm_tile_in(ctx, |_, _| simpler_kernels_cpu::WeightLayout::Tiled)
        }
        bf16_conversions_never_outlive_their_task(
            tiled_gemm,
            simpler_kernels_cpu::tile_weights_bf16,
            64,
        );
    }

    /// Paired weights, where the AVX-512 BF16 path converts each task's activations to
    /// natural-order rows once per core (elsewhere nothing is kept).
    #[test]
    fn converted_bf16_rows_never_outlive_their_task() {
        fn paired_gemm(ctx: &simpler_core::TaskCtx<'_>) -> Result<(), simpler_core::KernelError> {
            super::gemm_tile_in(ctx, |_, _| simpler_kernels_cpu::WeightLayout::Pairs)
        }
        bf16_conversions_never_outlive_their_task(
            paired_gemm,
            simpler_kernels_cpu::pair_weights_bf16,
            96,
        );
    }
}
