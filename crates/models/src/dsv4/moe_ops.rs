//! The MoE decode step's runtime kernels (`docs/dsv4.md`, "MoE on the runtime"): host bodies
//! that wrap `simpler_kernels_cpu::dsv4::moe` through [`TaskCtx`]. Nothing here names a
//! platform. Malformed arguments give a [`KernelError`] naming the kernel, never a panic.
//!
//! | kernel | tensor arguments (index order) | scalars |
//! |---|---|---|
//! | [`MOE_ROUTE`] | x_mixed In f32 `[T,D]`, token ids In u32 `[T]`, ffn_norm NoDep f32 `[D]`, gate NoDep f32 `[E,D]`, bias NoDep f32 `[E]`, hash table NoDep u32 `[V,K]`; xq Out i8 `[T,D]`, xs Out f32 `[T,1]`, experts Out u32 `[T,K]`, weights Out f32 `[T,K]` (SPMD over token rows) | eps, route_scale, hash |
//! | [`MOE_DISPATCH`] | experts In, weights In, xq In, xs In; counts Out u32 `[L]`, offsets Out u32 `[L+1]`, rows Out i8 `[C,D]`, scales Out f32 `[C]`, row weights Out f32 `[C]`, route ids Out u32 `[C]` | first_expert, n_experts |
//! | [`MOE_GATE_UP`] (SPMD over the active groups' `I` columns end to end) | q In i8 `[R,D]`, s In f32 `[R]`, W1 NoDep i8 `[G,I,D]`, S1 NoDep f32 `[G,I]`, W3, S3; h Out f32 `[R,I]`; (offsets In u32 `[G+1]`) | limit |
//! | [`MOE_QUANT_H`] (SPMD over rows) | h In f32 `[R,I]`; hq Out i8 `[R,I]`, hs Out f32 `[R,1]`; (row weights In f32 `[R]`, offsets In u32 `[G+1]`) | |
//! | [`MOE_DOWN`] (SPMD over the active groups' `D` columns end to end) | hq In, hs In, W2 NoDep i8 `[G,D,I]`, S2 NoDep f32 `[G,D]`; y Out f32 `[R,D]`; (offsets In) | |
//! | [`MOE_COMBINE`] (SPMD over `D` columns) | y In f32 `[C,D]`, route ids In u32 `[C]`, offsets In u32 `[L+1]`; routed Out f32 `[T·K,D]` | |
//! | [`MOE_REDUCE`] (SPMD over rows) | shared In f32 `[S,T,D]`, routed In f32 `[T,K,D]`; y Out f32 `[T,D]` (bf16 values) | |
//! | [`MOE_HC_PRE`] (SPMD over rows) | x_hc In f32 `[T,hc·D]`, mix NoDep f32 `[M,hc·D]`, base NoDep f32 `[M]`; hcw Out f32 `[T,M]` (pre, post, comb as [`super::ops::HC_PRE`] writes them), x_mixed Out f32 `[T,D]` | hc, iters, hc_eps, rms_eps, s0, s1, s2 |
//!
//! The step ends with [`super::ops::HC_POST`] (the attention layers' `hc_post`), so a worker
//! running it registers both [`register`] and [`super::ops::register`].
//!
//! `T` tokens, `K` routes per token, `E` routed experts, `L` local experts, `C` dispatch rows
//! (capacity), `G` groups (experts) of an expert phase, `R` its rows. Without offsets an expert
//! phase is one group over all its rows (the shared experts); with them, group `g` owns rows
//! `offsets[g]..offsets[g+1]` and rows past `offsets[G]` are unused (the quantiser zeroes them).

use simpler_core::{EngineClass, KernelError, KernelId, KernelSpec, TaskCtx, Worker};
use simpler_kernels_cpu::dsv4::hc;
use simpler_kernels_cpu::dsv4::moe as k;
use simpler_kernels_cpu::{ActsI8, I8Layout, NextRows, WeightsI8};

use super::int8_layout::{Int8Use, kernel_layout};

/// Gate input, logits, scores and routing of every token.
pub const MOE_ROUTE: KernelId = KernelId(3240);
/// Routed rows grouped per local expert (the seam a collective replaces).
pub const MOE_DISPATCH: KernelId = KernelId(3241);
/// `h = silu(min(x W1ᵀ, l)) · clamp(x W3ᵀ, ±l)` for a share of the active groups' `I` columns
/// laid end to end (one call per group the share reaches).
pub const MOE_GATE_UP: KernelId = KernelId(3242);
/// `h` re-quantised per row, the routing weight folded into its scale.
pub const MOE_QUANT_H: KernelId = KernelId(3243);
/// `y = hq W2ᵀ` for a share of the active groups' `D` columns laid end to end.
pub const MOE_DOWN: KernelId = KernelId(3244);
/// Expert outputs back to `[T, K, D]` route order (the seam a collective replaces).
pub const MOE_COMBINE: KernelId = KernelId(3245);
/// `y = bf16(Σ shared + Σ routed)`.
pub const MOE_REDUCE: KernelId = KernelId(3246);
/// `hc_pre` of every token without a norm (the route task folds the FFN norm into the int8
/// scale): the mixed stream and the hyper-connection weights.
pub const MOE_HC_PRE: KernelId = KernelId(3247);

/// Argument indices of each kernel (the orchestration pushes them in this order).
pub mod idx {
    /// [`super::MOE_ROUTE`].
    pub mod route {
        /// x_mixed.
        pub const X: usize = 0;
        /// Token ids.
        pub const TOKENS: usize = 1;
        /// FFN norm weight.
        pub const NORM: usize = 2;
        /// Gate.
        pub const GATE: usize = 3;
        /// Selection bias.
        pub const BIAS: usize = 4;
        /// Hash table.
        pub const HASH: usize = 5;
        /// int8 activations.
        pub const XQ: usize = 6;
        /// Their scales.
        pub const XS: usize = 7;
        /// Chosen experts.
        pub const EXPERTS: usize = 8;
        /// Routing weights.
        pub const WEIGHTS: usize = 9;
    }
    /// [`super::MOE_DISPATCH`].
    pub mod dispatch {
        /// Chosen experts `[T,K]`.
        pub const EXPERTS: usize = 0;
        /// Routing weights `[T,K]`.
        pub const WEIGHTS: usize = 1;
        /// int8 activations `[T,D]`.
        pub const XQ: usize = 2;
        /// Their scales `[T]`.
        pub const XS: usize = 3;
        /// Rows per local expert.
        pub const COUNTS: usize = 4;
        /// Group offsets.
        pub const OFFSETS: usize = 5;
        /// Gathered int8 rows.
        pub const ROWS: usize = 6;
        /// Their scales.
        pub const SCALES: usize = 7;
        /// Their routing weights.
        pub const ROW_WEIGHTS: usize = 8;
        /// Their route ids.
        pub const ROUTE_IDS: usize = 9;
    }
    /// [`super::MOE_GATE_UP`].
    pub mod gate_up {
        /// int8 rows.
        pub const Q: usize = 0;
        /// Their scales.
        pub const S: usize = 1;
        /// `W1` of every group.
        pub const W1: usize = 2;
        /// Its scales.
        pub const S1: usize = 3;
        /// `W3` of every group.
        pub const W3: usize = 4;
        /// Its scales.
        pub const S3: usize = 5;
        /// `h` written.
        pub const H: usize = 6;
        /// Optional group offsets.
        pub const OFFSETS: usize = 7;
    }
    /// [`super::MOE_QUANT_H`].
    pub mod quant_h {
        /// `h`.
        pub const H: usize = 0;
        /// int8 `h` written.
        pub const HQ: usize = 1;
        /// Its scales written.
        pub const HS: usize = 2;
        /// Optional per-row routing weights (with the offsets).
        pub const WEIGHTS: usize = 3;
        /// Optional group offsets.
        pub const OFFSETS: usize = 4;
    }
    /// [`super::MOE_DOWN`].
    pub mod down {
        /// int8 `h`.
        pub const HQ: usize = 0;
        /// Its scales.
        pub const HS: usize = 1;
        /// `W2` of every group.
        pub const W2: usize = 2;
        /// Its scales.
        pub const S2: usize = 3;
        /// `y` written.
        pub const Y: usize = 4;
        /// Optional group offsets.
        pub const OFFSETS: usize = 5;
    }
    /// [`super::MOE_COMBINE`].
    pub mod combine {
        /// Expert outputs in dispatch order.
        pub const Y: usize = 0;
        /// Route id of each dispatch row.
        pub const ROUTE_IDS: usize = 1;
        /// Group offsets (their last entry is the rows in use).
        pub const OFFSETS: usize = 2;
        /// `[T·K, D]` written.
        pub const ROUTED: usize = 3;
    }
    /// [`super::MOE_HC_PRE`].
    pub mod hc_pre {
        /// The residual streams `[T, hc·D]`.
        pub const X: usize = 0;
        /// Mix weights.
        pub const MIX: usize = 1;
        /// Mix biases.
        pub const BASE: usize = 2;
        /// Hyper-connection weights written `[T, M]`.
        pub const HCW: usize = 3;
        /// `x_mixed` written.
        pub const MIXED: usize = 4;
    }
    /// [`super::MOE_REDUCE`].
    pub mod reduce {
        /// Shared experts' outputs.
        pub const SHARED: usize = 0;
        /// Routed outputs in route order.
        pub const ROUTED: usize = 1;
        /// `y` written (bf16 values in f32).
        pub const Y: usize = 2;
    }
}

/// Every MoE kernel: `(id, name, class, body)`.
pub fn specs() -> Vec<KernelSpec> {
    type Body = fn(&TaskCtx<'_>) -> Result<(), KernelError>;
    let table: [(KernelId, &str, EngineClass, Body); 8] = [
        (MOE_ROUTE, "moe_route_i8", EngineClass::Vector, route),
        (MOE_DISPATCH, "moe_dispatch", EngineClass::Vector, dispatch),
        (MOE_GATE_UP, "moe_gate_up_w8a8", EngineClass::Cube, gate_up),
        (MOE_QUANT_H, "moe_quant_h", EngineClass::Vector, quant_h),
        (MOE_DOWN, "moe_down_w8a8", EngineClass::Cube, down),
        (MOE_COMBINE, "moe_combine", EngineClass::Vector, combine),
        (MOE_REDUCE, "moe_reduce_bf16", EngineClass::Vector, reduce),
        (MOE_HC_PRE, "moe_hc_pre", EngineClass::Vector, hc_pre),
    ];
    table
        .into_iter()
        .map(|(id, name, class, body)| KernelSpec::new(id, name, class, body))
        .collect()
}

/// Registers the MoE kernels on `worker` (once per worker).
pub fn register(worker: &Worker) -> Result<(), simpler_core::Error> {
    for spec in specs() {
        worker.register_kernel(spec)?;
    }
    Ok(())
}

fn bad(kernel: &str, what: impl std::fmt::Display) -> KernelError {
    KernelError::new(format!("{kernel}: {what}"))
}

fn moe_err(kernel: &str, e: k::MoeError) -> KernelError {
    bad(kernel, e)
}

/// `(leading dims flattened, last dim)` of argument `i`.
fn dims2(ctx: &TaskCtx<'_>, i: usize) -> Result<(usize, usize), KernelError> {
    let shape = ctx.tensor(i)?.shape();
    let cols = *shape.last().unwrap_or(&1) as usize;
    let rows = shape[..shape.len().saturating_sub(1)]
        .iter()
        .product::<u64>() as usize;
    Ok((rows, cols))
}

/// Checks that argument `i` holds `want` elements.
fn expect_len(kernel: &str, what: &str, got: usize, want: usize) -> Result<(), KernelError> {
    if got == want {
        Ok(())
    } else {
        Err(bad(
            kernel,
            format!("{what} holds {got} elements, expected {want}"),
        ))
    }
}

fn scalar_flag(ctx: &TaskCtx<'_>, i: usize, kernel: &str) -> Result<bool, KernelError> {
    match ctx.scalar(i)? {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(bad(kernel, format!("scalar {i} is {v}, expected 0 or 1"))),
    }
}

fn expect_scalars(ctx: &TaskCtx<'_>, kernel: &str, n: usize) -> Result<(), KernelError> {
    if ctx.num_scalars() == n {
        Ok(())
    } else {
        Err(bad(
            kernel,
            format!("{} scalars, expected {n}", ctx.num_scalars()),
        ))
    }
}

fn route(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    use idx::route as a;
    const NAME: &str = "moe_route_i8";
    expect_scalars(ctx, NAME, 3)?;
    let eps = ctx.scalar_f32(0)?;
    let route_scale = ctx.scalar_f32(1)?;
    let hash = scalar_flag(ctx, 2, NAME)?;
    let (t, d) = dims2(ctx, a::X)?;
    let (_, top_k) = dims2(ctx, a::EXPERTS)?;
    let x = ctx.read::<f32>(a::X)?;
    let tokens = ctx.read::<u32>(a::TOKENS)?;
    let norm = ctx.read::<f32>(a::NORM)?;
    let gate = ctx.read::<f32>(a::GATE)?;
    let bias = ctx.read::<f32>(a::BIAS)?;
    let table = ctx.read::<u32>(a::HASH)?;
    let n_experts = bias.len();
    expect_len(NAME, "token ids", tokens.len(), t)?;
    expect_len(NAME, "ffn_norm", norm.len(), d)?;
    expect_len(NAME, "gate", gate.len(), n_experts * d)?;
    if top_k == 0 || !table.len().is_multiple_of(top_k) {
        return Err(bad(
            NAME,
            format!(
                "hash table of {} entries is not rows of {top_k}",
                table.len()
            ),
        ));
    }
    let vocab = table.len() / top_k;
    // SPMD over token rows: each block routes its share of the tokens. Every output has the
    // `T` rows of `x_mixed`, so every output's share is the same rows.
    for (i, name, cols) in [
        (a::XQ, "xq", d),
        (a::XS, "xs", 1),
        (a::EXPERTS, "experts", top_k),
        (a::WEIGHTS, "weights", top_k),
    ] {
        let (rows, c) = dims2(ctx, i)?;
        if (rows, c) != (t, cols) {
            return Err(bad(
                NAME,
                format!("{name} of shape [{rows}, {c}], expected [{t}, {cols}] (a row per token)"),
            ));
        }
    }
    let mut xq = ctx.write_block_rows::<i8>(a::XQ)?;
    let mut xs = ctx.write_block_rows::<f32>(a::XS)?;
    let mut experts = ctx.write_block_rows::<u32>(a::EXPERTS)?;
    let mut weights = ctx.write_block_rows::<f32>(a::WEIGHTS)?;
    let (r0, nr) = (xq.first_row(), xq.len());
    let mut q = vec![0i8; nr * d];
    let mut s = vec![0.0f32; nr];
    for (i, r) in (r0..r0 + nr).enumerate() {
        s[i] = k::moe_quant_input(
            &x[r * d..(r + 1) * d],
            norm,
            eps,
            &mut q[i * d..(i + 1) * d],
        );
        xq.row(i).copy_from_slice(&q[i * d..(i + 1) * d]);
        xs.row(i)[0] = s[i];
    }
    let mut logits = vec![0.0f32; nr * n_experts];
    k::moe_gate_logits(&q, &s, gate, d, &mut logits).map_err(|e| moe_err(NAME, e))?;
    let mut scores = vec![0.0f32; n_experts];
    for (i, r) in (r0..r0 + nr).enumerate() {
        let hash_row = if hash {
            let id = tokens[r] as usize;
            if id >= vocab {
                return Err(bad(
                    NAME,
                    format!("token id {id} of row {r} is past the hash table's {vocab} rows"),
                ));
            }
            Some(&table[id * top_k..(id + 1) * top_k])
        } else {
            None
        };
        k::moe_route(
            &logits[i * n_experts..(i + 1) * n_experts],
            bias,
            hash_row,
            route_scale,
            &mut scores,
            experts.row(i),
            weights.row(i),
        )
        .map_err(|e| moe_err(NAME, e))?;
    }
    Ok(())
}

fn dispatch(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    use idx::dispatch as a;
    const NAME: &str = "moe_dispatch";
    expect_scalars(ctx, NAME, 2)?;
    let first = ctx.scalar_usize(0)?;
    let n_experts = ctx.scalar_usize(1)?;
    let experts = ctx.read::<u32>(a::EXPERTS)?;
    let weights = ctx.read::<f32>(a::WEIGHTS)?;
    let (t, d) = dims2(ctx, a::XQ)?;
    let xq = ctx.read::<i8>(a::XQ)?;
    let xs = ctx.read::<f32>(a::XS)?;
    expect_len(NAME, "xs", xs.len(), t)?;
    expect_len(NAME, "weights", weights.len(), experts.len())?;
    if t == 0 || !experts.len().is_multiple_of(t) {
        return Err(bad(
            NAME,
            format!("{} routes for {t} tokens", experts.len()),
        ));
    }
    let top_k = experts.len() / t;
    let counts = ctx.write::<u32>(a::COUNTS)?;
    let n_local = counts.len();
    if first + n_local > n_experts {
        return Err(bad(
            NAME,
            format!(
                "local experts {first}..{} past the {n_experts} routed experts",
                first + n_local
            ),
        ));
    }
    let (cap, dq) = dims2(ctx, a::ROWS)?;
    expect_len(NAME, "dispatch row width", dq, d)?;
    let plan = k::moe_dispatch_plan(experts, n_experts, first..first + n_local, cap)
        .map_err(|e| moe_err(NAME, e))?;
    counts.copy_from_slice(&plan.counts);
    let offsets = ctx.write::<u32>(a::OFFSETS)?;
    expect_len(NAME, "offsets", offsets.len(), n_local + 1)?;
    offsets.copy_from_slice(&plan.offsets);
    let rows = ctx.write::<i8>(a::ROWS)?;
    let scales = ctx.write::<f32>(a::SCALES)?;
    let row_w = ctx.write::<f32>(a::ROW_WEIGHTS)?;
    let ids = ctx.write::<u32>(a::ROUTE_IDS)?;
    for (what, len) in [
        ("scales", scales.len()),
        ("row weights", row_w.len()),
        ("route ids", ids.len()),
    ] {
        expect_len(NAME, what, len, cap)?;
    }
    for r in 0..cap {
        let dst = &mut rows[r * d..(r + 1) * d];
        match plan.order.get(r) {
            Some(&route) => {
                let tok = route as usize / top_k;
                dst.copy_from_slice(&xq[tok * d..(tok + 1) * d]);
                scales[r] = xs[tok];
                row_w[r] = weights[route as usize];
                ids[r] = route;
            }
            None => {
                dst.fill(0);
                scales[r] = 0.0;
                row_w[r] = 0.0;
                ids[r] = u32::MAX;
            }
        }
    }
    Ok(())
}

/// The groups of an expert phase over `rows` rows: the offsets argument at `i` when present
/// (checked to partition a prefix of the rows), else one group of every row.
fn groups(
    ctx: &TaskCtx<'_>,
    i: usize,
    rows: usize,
    n_groups: usize,
    kernel: &str,
) -> Result<Vec<u32>, KernelError> {
    if ctx.num_args() <= i {
        if n_groups != 1 {
            return Err(bad(
                kernel,
                format!("{n_groups} weight groups but no offsets"),
            ));
        }
        return Ok(vec![0, rows as u32]);
    }
    let off = ctx.read::<u32>(i)?;
    expect_len(kernel, "offsets", off.len(), n_groups + 1)?;
    k::check_offsets(off, rows).map_err(|e| moe_err(kernel, e))?;
    Ok(off.to_vec())
}

/// The groups of checked `offsets` that own rows, in order: an expert without rows costs
/// nothing (its weights are never touched), and each active expert's call names the next one's
/// rows for prefetching.
fn active_groups(offsets: &[u32]) -> Vec<usize> {
    offsets
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w[0] != w[1])
        .map(|(e, _)| e)
        .collect()
}

/// Expert `e`'s `[rows, cols]` matrix of the stacked weights `w` (scales `s`).
fn expert_weights<'a>(
    w: &'a [i8],
    s: &'a [f32],
    e: usize,
    rows: usize,
    cols: usize,
    layout: I8Layout,
) -> WeightsI8<'a> {
    WeightsI8::with_layout(
        &w[e * rows * cols..(e + 1) * rows * cols],
        &s[e * rows..(e + 1) * rows],
        rows,
        cols,
        layout,
    )
}

/// Stacked int8 weights of `groups` experts, `rows` rows each, and their scales.
type GroupWeights<'a> = (&'a [i8], &'a [f32], usize, usize);

/// The int8 weights `[G, n, kdim]` at `wi` (scales `[G, n]` at `si`) as
/// `(data, scales, G, n)`.
fn group_weights<'a>(
    ctx: &'a TaskCtx<'_>,
    wi: usize,
    si: usize,
    kdim: usize,
    kernel: &str,
) -> Result<GroupWeights<'a>, KernelError> {
    let w = ctx.read::<i8>(wi)?;
    let s = ctx.read::<f32>(si)?;
    let shape = ctx.tensor(wi)?.shape();
    if shape.len() != 3 || shape[2] as usize != kdim {
        return Err(bad(
            kernel,
            format!("weights of shape {shape:?}, expected [groups, rows, {kdim}]"),
        ));
    }
    let (g, n) = (shape[0] as usize, shape[1] as usize);
    expect_len(kernel, "weight scales", s.len(), g * n)?;
    Ok((w, s, g, n))
}

/// Output columns per unit of an expert phase's split (a multiple of every GEMM path's
/// column tile).
const COL_UNIT: usize = 16;

/// One call of an expert phase: group `group`'s rows, output columns `cols`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Piece {
    group: usize,
    cols: std::ops::Range<usize>,
}

/// The calls of the block whose share is `share` of the units of the `active` groups'
/// outputs, `width` columns each, laid end to end group after group in units of
/// [`COL_UNIT`]: one call per group the share reaches, over the columns it covers. Every
/// group's unit costs the same weight bytes whatever its rows, so equal shares of units are
/// equal shares of the phase's bytes, and a block makes one long call per group instead of
/// one short call per group and column block.
fn pieces(active: &[usize], width: usize, share: std::ops::Range<usize>) -> Vec<Piece> {
    let units = width.div_ceil(COL_UNIT);
    let mut out = Vec::new();
    let mut u = share.start;
    while u < share.end && units > 0 {
        let (slot, first) = (u / units, u % units);
        let Some(&group) = active.get(slot) else {
            break;
        };
        let last = (share.end - slot * units).min(units);
        out.push(Piece {
            group,
            cols: (first * COL_UNIT).min(width)..(last * COL_UNIT).min(width),
        });
        u = slot * units + last;
    }
    out
}

/// This block's calls of an expert phase over checked `offsets`, `width` output columns per
/// group: its tapered share ([`TaskCtx::block_range_tapered`]) of the active groups' units.
fn block_pieces(ctx: &TaskCtx<'_>, offsets: &[u32], width: usize) -> Vec<Piece> {
    let active = active_groups(offsets);
    let share = ctx.block_range_tapered(active.len() * width.div_ceil(COL_UNIT));
    pieces(&active, width, share)
}

fn gate_up<'a>(ctx: &'a TaskCtx<'_>) -> Result<(), KernelError> {
    use idx::gate_up as a;
    const NAME: &str = "moe_gate_up_w8a8";
    expect_scalars(ctx, NAME, 1)?;
    let limit = ctx.scalar_f32(0)?;
    let (rows, d) = dims2(ctx, a::Q)?;
    let q = ctx.read::<i8>(a::Q)?;
    let s = ctx.read::<f32>(a::S)?;
    expect_len(NAME, "row scales", s.len(), rows)?;
    let (w1, s1, g, inter) = group_weights(ctx, a::W1, a::S1, d, NAME)?;
    let (w3, s3, g3, inter3) = group_weights(ctx, a::W3, a::S3, d, NAME)?;
    if (g3, inter3) != (g, inter) {
        return Err(bad(NAME, "W1 and W3 differ in shape"));
    }
    let off = groups(ctx, a::OFFSETS, rows, g, NAME)?;
    let h_dims = dims2(ctx, a::H)?;
    if h_dims != (rows, inter) {
        return Err(bad(
            NAME,
            format!("h {h_dims:?} for {rows} rows of {inter}"),
        ));
    }
    let layout = kernel_layout(Int8Use::Experts);
    let expert = |(w, s): (&'a [i8], &'a [f32]), e| expert_weights(w, s, e, inter, d, layout);
    let calls = block_pieces(ctx, &off, inter);
    for (i, Piece { group: e, cols }) in calls.iter().enumerate() {
        let (e, n) = (*e, cols.len());
        let (r0, r1) = (off[e] as usize, off[e + 1] as usize);
        let mut h = ctx.write_rect::<f32>(a::H, r0..r1, cols.clone())?;
        let x = ActsI8::new(&q[r0 * d..r1 * d], &s[r0..r1], r1 - r0, d, d);
        let mut buf = vec![0.0f32; (r1 - r0) * n];
        // The block's next call streams the next group's W1 rows after this one's W3 rows.
        let next = calls
            .get(i + 1)
            .map(|p| NextRows::new(expert((w1, s1), p.group), p.cols.start));
        k::expert_gate_up(
            expert((w1, s1), e),
            expert((w3, s3), e),
            x,
            cols.clone(),
            limit,
            &mut buf,
            n,
            next,
        );
        for (i, row) in h.iter_mut().enumerate() {
            row.copy_from_slice(&buf[i * n..(i + 1) * n]);
        }
    }
    Ok(())
}

fn quant_h(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    use idx::quant_h as a;
    const NAME: &str = "moe_quant_h";
    expect_scalars(ctx, NAME, 0)?;
    let (rows, inter) = dims2(ctx, a::H)?;
    let h = ctx.read::<f32>(a::H)?;
    let (used, weights) = if ctx.num_args() > a::OFFSETS {
        let w = ctx.read::<f32>(a::WEIGHTS)?;
        expect_len(NAME, "row weights", w.len(), rows)?;
        let off = ctx.read::<u32>(a::OFFSETS)?;
        k::check_offsets(off, rows).map_err(|e| moe_err(NAME, e))?;
        (off.last().copied().unwrap_or(0) as usize, Some(w))
    } else {
        (rows, None)
    };
    let mut hq = ctx.write_block_rows::<i8>(a::HQ)?;
    let mut hs = ctx.write_block_rows::<f32>(a::HS)?;
    if hq.view_row_len() != inter || hs.view_row_len() != 1 {
        return Err(bad(
            NAME,
            format!(
                "hq rows of {} and hs rows of {} for h rows of {inter} (expected {inter} and 1)",
                hq.view_row_len(),
                hs.view_row_len()
            ),
        ));
    }
    let r0 = hq.first_row();
    if hs.first_row() != r0 || hs.len() != hq.len() || r0 + hq.len() > rows {
        return Err(bad(NAME, "hq and hs are not the rows of h"));
    }
    for i in 0..hq.len() {
        let r = r0 + i;
        let dst = hq.row(i);
        hs.row(i)[0] = if r < used {
            let w = weights.map_or(1.0, |w| w[r]);
            k::expert_quant_h(&h[r * inter..(r + 1) * inter], w, dst)
        } else {
            dst.fill(0);
            0.0
        };
    }
    Ok(())
}

fn down(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    use idx::down as a;
    const NAME: &str = "moe_down_w8a8";
    expect_scalars(ctx, NAME, 0)?;
    let (rows, inter) = dims2(ctx, a::HQ)?;
    let hq = ctx.read::<i8>(a::HQ)?;
    let hs = ctx.read::<f32>(a::HS)?;
    expect_len(NAME, "hs", hs.len(), rows)?;
    let (w2, s2, g, d) = group_weights(ctx, a::W2, a::S2, inter, NAME)?;
    let off = groups(ctx, a::OFFSETS, rows, g, NAME)?;
    let y_dims = dims2(ctx, a::Y)?;
    if y_dims != (rows, d) {
        return Err(bad(NAME, format!("y {y_dims:?} for {rows} rows of {d}")));
    }
    let layout = kernel_layout(Int8Use::Experts);
    let expert = |e| expert_weights(w2, s2, e, d, inter, layout);
    let calls = block_pieces(ctx, &off, d);
    for (i, Piece { group: e, cols }) in calls.iter().enumerate() {
        let (e, n) = (*e, cols.len());
        let (r0, r1) = (off[e] as usize, off[e + 1] as usize);
        let mut y = ctx.write_rect::<f32>(a::Y, r0..r1, cols.clone())?;
        let x = ActsI8::new(
            &hq[r0 * inter..r1 * inter],
            &hs[r0..r1],
            r1 - r0,
            inter,
            inter,
        );
        let mut buf = vec![0.0f32; (r1 - r0) * n];
        let next = calls
            .get(i + 1)
            .map(|p| NextRows::new(expert(p.group), p.cols.start));
        k::expert_down(expert(e), x, cols.clone(), &mut buf, n, next);
        for (i, row) in y.iter_mut().enumerate() {
            row.copy_from_slice(&buf[i * n..(i + 1) * n]);
        }
    }
    Ok(())
}

fn combine(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    use idx::combine as a;
    const NAME: &str = "moe_combine";
    expect_scalars(ctx, NAME, 0)?;
    let (cap, d) = dims2(ctx, a::Y)?;
    let y = ctx.read::<f32>(a::Y)?;
    let ids = ctx.read::<u32>(a::ROUTE_IDS)?;
    expect_len(NAME, "route ids", ids.len(), cap)?;
    let off = ctx.read::<u32>(a::OFFSETS)?;
    k::check_offsets(off, cap).map_err(|e| moe_err(NAME, e))?;
    let used = off.last().copied().unwrap_or(0) as usize;
    let mut out = ctx.write_block_cols::<f32>(a::ROUTED, 16)?;
    if out.view_row_len() != d {
        return Err(bad(
            NAME,
            format!("routed rows of {} for outputs of {d}", out.view_row_len()),
        ));
    }
    let routes = out.len();
    let cols = out.first_col()..out.first_col() + out.row_len();
    for r in 0..used {
        let id = ids[r] as usize;
        if id >= routes {
            return Err(bad(
                NAME,
                format!("dispatch row {r} names route {id} of {routes}"),
            ));
        }
        out.row(id)
            .copy_from_slice(&y[r * d + cols.start..r * d + cols.end]);
    }
    Ok(())
}

fn reduce(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    use idx::reduce as a;
    const NAME: &str = "moe_reduce_bf16";
    expect_scalars(ctx, NAME, 0)?;
    let shape = ctx.tensor(a::ROUTED)?.shape().to_vec();
    if shape.len() != 3 {
        return Err(bad(
            NAME,
            format!("routed of shape {shape:?}, expected [T, K, D]"),
        ));
    }
    let (t, top_k, d) = (shape[0] as usize, shape[1] as usize, shape[2] as usize);
    let shared = ctx.read::<f32>(a::SHARED)?;
    let routed = ctx.read::<f32>(a::ROUTED)?;
    if d == 0 || t == 0 || !shared.len().is_multiple_of(t * d) {
        return Err(bad(
            NAME,
            format!("shared of {} elements is not [S, {t}, {d}]", shared.len()),
        ));
    }
    let n_shared = shared.len() / (t * d);
    // SPMD over token rows: each block reduces its share of the tokens.
    let mut y = ctx.write_block_rows::<f32>(a::Y)?;
    let (r0, nr) = (y.first_row(), y.len());
    if y.row_len() != d || r0 + nr > t {
        return Err(bad(
            NAME,
            format!(
                "y rows {r0}..{} of {} for {t} tokens of {d}",
                r0 + nr,
                y.row_len()
            ),
        ));
    }
    for r in r0..r0 + nr {
        let s: Vec<&[f32]> = (0..n_shared)
            .map(|i| &shared[(i * t + r) * d..(i * t + r + 1) * d])
            .collect();
        let ro: Vec<&[f32]> = (0..top_k)
            .map(|j| &routed[(r * top_k + j) * d..(r * top_k + j + 1) * d])
            .collect();
        k::moe_reduce(&s, &ro, y.row(r - r0));
    }
    Ok(())
}

fn hc_pre(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    use idx::hc_pre as a;
    const NAME: &str = "moe_hc_pre";
    expect_scalars(ctx, NAME, 7)?;
    let n_hc = ctx.scalar_usize(0)?;
    let iters = ctx.scalar_usize(1)?;
    let (hc_eps, rms_eps) = (ctx.scalar_f32(2)?, ctx.scalar_f32(3)?);
    let scale = [ctx.scalar_f32(4)?, ctx.scalar_f32(5)?, ctx.scalar_f32(6)?];
    let (t, n) = dims2(ctx, a::X)?;
    if n_hc == 0 || !n.is_multiple_of(n_hc) {
        return Err(bad(NAME, format!("rows of {n} are not {n_hc} streams")));
    }
    let (d, m) = (n / n_hc, hc::hc_mix_len(n_hc));
    let x = ctx.read::<f32>(a::X)?;
    let mix_w = ctx.read::<f32>(a::MIX)?;
    let base = ctx.read::<f32>(a::BASE)?;
    expect_len(NAME, "mix", mix_w.len(), m * n)?;
    expect_len(NAME, "base", base.len(), m)?;
    // SPMD over token rows: each block mixes its share of the tokens.
    let mut hcw = ctx.write_block_rows::<f32>(a::HCW)?;
    let mut mixed = ctx.write_block_rows::<f32>(a::MIXED)?;
    if hcw.row_len() != m || mixed.row_len() != d || hcw.len() != mixed.len() {
        return Err(bad(
            NAME,
            format!(
                "hc weights rows of {} and x_mixed rows of {} for hc_mix {m} and hidden {d}",
                hcw.row_len(),
                mixed.row_len()
            ),
        ));
    }
    let (t0, nt) = (hcw.first_row(), hcw.len());
    if t0 + nt > t {
        return Err(bad(NAME, "more output rows than input rows"));
    }
    let xs = &x[t0 * n..(t0 + nt) * n];
    let mut logits = vec![0.0f32; nt * m];
    hc::hc_mix_logits(xs, n, mix_w, rms_eps, &mut logits);
    for (r, w) in logits.chunks_exact_mut(m).enumerate() {
        hc::hc_weights(w, n_hc, scale, base, iters, hc_eps);
        hcw.row(r).copy_from_slice(w);
        hc::hc_mix_streams(&xs[r * n..(r + 1) * n], &w[..n_hc], mixed.row(r));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{COL_UNIT, Piece, pieces};
    use proptest::prelude::*;

    #[test]
    fn a_share_makes_one_call_per_group_it_reaches() {
        // Groups 1, 4 and 6 of 40 columns (3 units each, the last one 8 wide).
        let p = |group, cols| Piece { group, cols };
        assert_eq!(
            pieces(&[1, 4, 6], 40, 2..7),
            [p(1, 32..40), p(4, 0..40), p(6, 0..16)]
        );
        assert_eq!(pieces(&[1, 4, 6], 40, 0..9).len(), 3);
        assert!(pieces(&[1, 4, 6], 40, 9..9).is_empty());
        assert!(pieces(&[], 40, 0..0).is_empty());
    }

    proptest! {
        /// The blocks' calls cover every active group's columns exactly once, in order.
        #[test]
        fn shares_cover_every_group_once(
            n_active in 0usize..20,
            width in 1usize..200,
            blocks in 1usize..40,
        ) {
            let active: Vec<usize> = (0..n_active).map(|a| 3 * a + 1).collect();
            let units = width.div_ceil(COL_UNIT);
            let total = n_active * units;
            let mut seen: Vec<Vec<usize>> = vec![vec![0; width]; n_active];
            for b in 0..blocks {
                let share = total * b / blocks..total * (b + 1) / blocks;
                let calls = pieces(&active, width, share.clone());
                // One call per group the share reaches.
                let reach = if share.is_empty() {
                    0
                } else {
                    (share.end - 1) / units - share.start / units + 1
                };
                prop_assert_eq!(calls.len(), reach);
                for c in calls {
                    let slot = (c.group - 1) / 3;
                    prop_assert!(!c.cols.is_empty() && c.cols.end <= width);
                    for col in c.cols {
                        seen[slot][col] += 1;
                    }
                }
            }
            prop_assert!(seen.iter().flatten().all(|&n| n == 1));
        }
    }
}
