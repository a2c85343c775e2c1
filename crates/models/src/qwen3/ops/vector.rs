//! Vector kernels of the step: embedding gather, casts, copies and the two RMSNorm forms that
//! write packed GEMM activations.

use half::bf16;
use simpler_core::{KernelError, TaskCtx};
use simpler_kernels_cpu as k;

use super::{bad, check_packed, dims2};

pub(super) fn embed(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let (vocab, hidden) = dims2(ctx, 0)?;
    let table = ctx.read::<bf16>(0)?;
    let ids = ctx.read::<u32>(1)?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(bad(
            "embedding_gather_bf16",
            format!("token id {id} outside the vocabulary of {vocab}"),
        ));
    }
    let x = ctx.write::<f32>(2)?;
    if x.len() != ids.len() * hidden {
        return Err(bad(
            "embedding_gather_bf16",
            format!(
                "output holds {} floats for {} ids of {hidden}",
                x.len(),
                ids.len()
            ),
        ));
    }
    k::embedding_gather_bf16(table, hidden, ids, x);
    Ok(())
}

pub(super) fn cast_bf16_f32(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let src = ctx.read::<bf16>(0)?;
    let dst = ctx.write::<f32>(1)?;
    if src.len() != dst.len() {
        return Err(bad(
            "cast_bf16_f32",
            "source and destination lengths differ",
        ));
    }
    k::cast_bf16_f32(src, dst);
    Ok(())
}

pub(super) fn cast_f32_bf16(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let src = ctx.read::<f32>(0)?;
    let dst = ctx.write::<bf16>(1)?;
    if src.len() != dst.len() {
        return Err(bad(
            "cast_f32_bf16",
            "source and destination lengths differ",
        ));
    }
    k::cast_f32_bf16(src, dst);
    Ok(())
}

pub(super) fn copy_f32(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let src = ctx.read::<f32>(0)?;
    let dst = ctx.write::<f32>(1)?;
    if src.len() != dst.len() {
        return Err(bad("copy_f32", "source and destination lengths differ"));
    }
    dst.copy_from_slice(src);
    Ok(())
}

pub(super) fn rms_norm_deferred(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let (rows, h) = dims2(ctx, 0)?;
    let x = ctx.read::<f32>(0)?;
    let g = ctx.read::<f32>(1)?;
    let eps = ctx.scalar_f32(0)?;
    if g.len() != h {
        return Err(bad(
            "rms_norm_deferred_f32",
            format!("norm weight of {} for rows of {h}", g.len()),
        ));
    }
    let packed = ctx.write::<f32>(2)?;
    check_packed("rms_norm_deferred_f32", packed.len(), rows, h)?;
    let r = ctx.write::<f32>(3)?;
    if r.len() != rows {
        return Err(bad(
            "rms_norm_deferred_f32",
            format!("{} scales for {rows} rows", r.len()),
        ));
    }
    k::rms_norm_deferred_packed(x, g, eps, packed, r);
    Ok(())
}

pub(super) fn rms_norm(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let (rows, h) = dims2(ctx, 0)?;
    let x = ctx.read::<f32>(0)?;
    let g = ctx.read::<f32>(1)?;
    let eps = ctx.scalar_f32(0)?;
    if g.len() != h {
        return Err(bad(
            "rms_norm_f32",
            format!("norm weight of {} for rows of {h}", g.len()),
        ));
    }
    let packed = ctx.write::<f32>(2)?;
    check_packed("rms_norm_f32", packed.len(), rows, h)?;
    k::rms_norm_packed(x, g, eps, packed);
    Ok(())
}
