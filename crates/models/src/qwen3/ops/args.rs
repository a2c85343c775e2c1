//! Each kernel's tensor arguments as one struct with named fields, pushed onto a task in the
//! order the kernel reads them; the kernel reads them through index constants generated from
//! the same field list (`gemm::acts`). A swap on either side is a rename, not a silent
//! reordering. How each tensor is tracked is part of its value: [`Arg`].

use simpler_core::{DType, Task, Tensor};

/// One tensor argument and how the runtime tracks it. Not `Clone`: an [`Arg::untracked`]
/// carries its caller's promise about one task, which a copy must not carry to another.
///
/// ```compile_fail
/// fn copy<'a>(a: &simpler_models::qwen3::ops::args::Arg<'a>) -> simpler_models::qwen3::ops::args::Arg<'a> {
///     a.clone()
/// }
/// ```
#[derive(Debug)]
pub enum Arg<'a> {
    /// Read (`Input`).
    In(&'a Tensor),
    /// Read then written (`InOut`).
    InOut(&'a Tensor),
    /// Written into an existing buffer (`OutputExisting`).
    Out(&'a Tensor),
    /// Written into a new runtime-allocated tensor (`Output`).
    New(DType, Vec<u64>),
    /// Read without dependency tracking: only through [`Arg::untracked`].
    Untracked(Untracked<'a>),
}

/// A tensor passed `NoDep`; its only constructor is the unsafe [`Arg::untracked`].
#[derive(Debug)]
pub struct Untracked<'a>(&'a Tensor);

impl<'a> Arg<'a> {
    /// A read-only argument the runtime does not track.
    ///
    /// # Safety
    /// As [`Task::no_dep`]: no task that can run at the same time as this one writes the
    /// tensor's bytes (they are written by no task during the run, or every writer is ordered
    /// before this task by an explicit dependency and no later writer can run before it ends).
    pub unsafe fn untracked(t: &'a Tensor) -> Arg<'a> {
        Arg::Untracked(Untracked(t))
    }

    /// Appends the argument to `t`.
    pub fn push(self, t: Task) -> Task {
        match self {
            Arg::In(x) => t.input(x),
            Arg::InOut(x) => t.in_out(x),
            Arg::Out(x) => t.output_existing(x),
            Arg::New(dtype, shape) => t.output(dtype, &shape),
            // SAFETY: an `Untracked` exists only through `Arg::untracked`, whose caller took on
            // `Task::no_dep`'s contract for this tensor.
            Arg::Untracked(Untracked(x)) => unsafe { t.no_dep(x) },
        }
    }
}

/// Declares a kernel's tensor arguments: the struct (`Option` for a trailing optional one), its
/// `push`, and `idx::$kernel::$field` index constants in the same order.
macro_rules! kernel_tensors {
    ($(#[$m:meta])* $name:ident, $idx:ident { $($field:ident),+ $(; $opt:ident)? }) => {
        $(#[$m])*
        #[derive(Debug)]
        pub struct $name<'a> {
            $(
                #[allow(missing_docs)]
                pub $field: Arg<'a>,
            )+
            $(
                #[allow(missing_docs)]
                pub $opt: Option<Arg<'a>>,
            )?
        }

        impl $name<'_> {
            /// Appends the tensors to `t` in the kernel's order.
            pub fn push(self, t: Task) -> Task {
                $(let t = self.$field.push(t);)+
                $(let t = match self.$opt {
                    Some(a) => a.push(t),
                    None => t,
                };)?
                t
            }
        }

        /// Argument indices of the kernel.
        #[allow(non_upper_case_globals, missing_docs)]
        pub mod $idx {
            kernel_tensors!(@idx 0usize; $($field,)+ $($opt,)?);
        }
    };
    (@idx $n:expr; $f:ident, $($rest:ident,)*) => {
        pub const $f: usize = $n;
        kernel_tensors!(@idx $n + 1; $($rest,)*);
    };
    (@idx $n:expr;) => {};
}

kernel_tensors!(
    /// `EMBED`: table `[V,H]` bf16, ids `[R]` u32, x `[R,H]` f32 written.
    EmbedArgs, embed { table, ids, x }
);
kernel_tensors!(
    /// The casts and the copy: `src` read, `dst` written (same length).
    CastArgs, cast { src, dst }
);
kernel_tensors!(
    /// `RMS_NORM_DEFERRED`: x `[R,H]`, g `[H]`, packed `[R,ld(H)]` and `1/rms` `[R]` written.
    NormDeferredArgs, norm_deferred { x, g, packed, r }
);
kernel_tensors!(
    /// `RMS_NORM`: x `[R,H]`, g `[H]`, packed `[R,ld(H)]` written.
    NormArgs, norm { x, g, packed }
);
kernel_tensors!(
    /// `GEMM_TILE`: packed acts `[R,ld(K)]`, weights `[n,K]`, out `[R,n]` (written or
    /// accumulated), an optional per-row scale `[R]`.
    GemmArgs, gemm { acts, w, out; scale }
);
kernel_tensors!(
    /// `GATE_UP_SWIGLU`: packed acts `[R,ld(H)]`, gate and up weights `[n,H]`, the packed
    /// activations written, an optional per-row scale `[R]`.
    GateUpArgs, gate_up { acts, w_gate, w_up, act; scale }
);
kernel_tensors!(
    /// `GEMM_ROPE_STEP`: packed acts `[n,ld(H)]`; the q, k and v weights `[Wq,H]`, `[Wkv,H]`,
    /// `[Wkv,H]`; the q and k norm weights `[d]`; the whole cos/sin tables `[max_seq,d]`; the
    /// rows' step entries `[n,2]` u32 (`seq_len, slot`); written: bf16 Q `[n,Wq]` and one
    /// layer's K and V pools `[slots,Wkv]` at each row's slot (positions and slots read at run
    /// time); an optional per-row scale `[n]`.
    GemmRopeArgs, gemm_rope { acts, wq, wk, wv, q_norm, k_norm, cos, sin, step, q_out, k_out, v_out; scale }
);
kernel_tensors!(
    /// `ATTN_DECODE`: Q row bf16, K and V pools, the block-table row, the sequence's step
    /// entry `[1,2]` u32 (its length), the output (the packed row, or the chunk's partials).
    AttnDecodeArgs, attn_decode { q, k_pool, v_pool, table, step, out }
);
kernel_tensors!(
    /// `ATTN_COMBINE`: the partials `[C, kv_heads*plen]`, the packed output row.
    AttnCombineArgs, attn_combine { partials, out }
);
kernel_tensors!(
    /// `ATTN_PREFILL`: Q rows bf16, K and V pools, the block-table row, packed output columns.
    AttnPrefillArgs, attn_prefill { q, k_pool, v_pool, table, out }
);
kernel_tensors!(
    /// `LM_HEAD_TILE`: packed acts `[R,ld(H)]`, head weights `[V,H]`, logits `[R,V]` and the
    /// per-block argmax slots `[B,R,2]` written.
    LmHeadArgs, lm_head { acts, w, logits, best }
);
kernel_tensors!(
    /// `ARGMAX_COMBINE`: the per-block argmax slots, the ids written.
    ArgmaxArgs, argmax { best, ids }
);

#[cfg(test)]
mod tests {
    use super::*;
    use simpler_core::{
        EngineClass, KernelId, KernelSpec, RunArgs, ScopeKind, Worker, WorkerConfig,
    };
    use std::sync::{Arc, Mutex};

    /// The kernel sees each named tensor at its generated index, with its tag, and a missing
    /// optional tensor is absent rather than shifted.
    #[test]
    fn fields_land_at_their_generated_indices() {
        let w = Worker::new(
            simpler_cpu::CpuPlatform::new(),
            WorkerConfig {
                cores: Some(1),
                timeouts: None,
                idle_spin: None,
            },
        )
        .unwrap();
        let seen: Arc<Mutex<Vec<Vec<u64>>>> = Arc::default();
        let s2 = seen.clone();
        w.register_kernel(KernelSpec::new(
            KernelId(9002),
            "shapes",
            EngineClass::Vector,
            move |ctx| {
                let dims: Vec<u64> = (0..ctx.num_args())
                    .map(|i| ctx.tensor(i).map(|t| t.shape()[0]).unwrap_or(0))
                    .collect();
                s2.lock().unwrap().push(dims);
                Ok(())
            },
        ))
        .unwrap();
        let bufs: Vec<_> = (1..=4u64)
            .map(|n| w.alloc(4 * n as usize).unwrap())
            .collect();
        let args = RunArgs {
            buffers: bufs,
            scalars: vec![],
        };
        w.run_fn("args", args, &Default::default(), |o, a| {
            let t: Vec<Tensor> = (0..4)
                .map(|i| o.bind(&a.buffers[i], DType::F32, &[i as u64 + 1]))
                .collect::<Result<_, _>>()?;
            o.scope(ScopeKind::Auto, |o| {
                for scale in [Some(Arg::In(&t[3])), None] {
                    let task = GemmArgs {
                        acts: Arg::In(&t[0]),
                        w: Arg::In(&t[1]),
                        out: Arg::InOut(&t[2]),
                        scale,
                    }
                    .push(Task::new(KernelId(9002)));
                    o.submit(task)?;
                }
                Ok(())
            })
        })
        .unwrap();
        let seen = seen.lock().unwrap();
        let mut want = vec![0u64; 4];
        for (i, len) in [
            (gemm::acts, 1),
            (gemm::w, 2),
            (gemm::out, 3),
            (gemm::scale, 4),
        ] {
            want[i] = len;
        }
        assert_eq!(seen[0], want);
        assert_eq!(seen[1], want[..3].to_vec());
        assert_eq!((gemm::acts, gemm::w, gemm::out, gemm::scale), (0, 1, 2, 3));
        assert_eq!(
            (gemm_rope::step, gemm_rope::v_out, gemm_rope::scale),
            (8, 11, 12)
        );
    }
}
