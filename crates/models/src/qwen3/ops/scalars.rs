//! Each kernel's scalar arguments as one struct, written by the orchestration with `push` and
//! read by the kernel with `read`, both generated from the same field list: the order cannot
//! drift between the two sides, and a missing, extra or swapped scalar does not compile (or,
//! for a task built by hand, is a [`KernelError`] naming the kernel and the count).

use simpler_core::{KernelError, Task, TaskCtx};

/// A scalar's encoding in a task's 64-bit slots.
pub(crate) trait Scalar: Sized {
    fn push(self, t: Task) -> Task;
    fn read(ctx: &TaskCtx<'_>, i: usize) -> Result<Self, KernelError>;
}

impl Scalar for usize {
    fn push(self, t: Task) -> Task {
        t.scalar(self as u64)
    }
    fn read(ctx: &TaskCtx<'_>, i: usize) -> Result<Self, KernelError> {
        ctx.scalar_usize(i)
    }
}

impl Scalar for f32 {
    fn push(self, t: Task) -> Task {
        t.scalar_f32(self)
    }
    fn read(ctx: &TaskCtx<'_>, i: usize) -> Result<Self, KernelError> {
        ctx.scalar_f32(i)
    }
}

impl Scalar for bool {
    fn push(self, t: Task) -> Task {
        t.scalar(u64::from(self))
    }
    fn read(ctx: &TaskCtx<'_>, i: usize) -> Result<Self, KernelError> {
        match ctx.scalar(i)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(KernelError::new(format!(
                "scalar {i} is {v}, expected a flag (0 or 1)"
            ))),
        }
    }
}

/// A kernel's scalars as one value.
pub trait KernelScalars: Sized {
    /// Appends the scalars to `t`, in the order [`KernelScalars::read`] expects.
    fn push(self, t: Task) -> Task;
    /// Reads the scalars of the running task (exactly that many).
    fn read(ctx: &TaskCtx<'_>) -> Result<Self, KernelError>;
}

/// `task.push_scalars(s)`: the builder form of [`KernelScalars::push`].
pub trait PushScalars {
    /// Appends `s`'s scalars.
    fn push_scalars(self, s: impl KernelScalars) -> Task;
}

impl PushScalars for Task {
    fn push_scalars(self, s: impl KernelScalars) -> Task {
        s.push(self)
    }
}

/// Declares a kernel's scalars: the struct and its [`KernelScalars`] (push and read in field
/// order).
macro_rules! kernel_scalars {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $field:ident : $ty:ty),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub struct $name {
            $($(#[$fm])* pub $field: $ty,)+
        }

        impl KernelScalars for $name {
            fn push(self, t: Task) -> Task {
                $(let t = Scalar::push(self.$field, t);)+
                t
            }

            fn read(ctx: &TaskCtx<'_>) -> Result<Self, KernelError> {
                const N: usize = [$(stringify!($field)),+].len();
                if ctx.num_scalars() != N {
                    return Err(KernelError::new(format!(
                        "{}: {} scalars, expected {N}",
                        stringify!($name),
                        ctx.num_scalars()
                    )));
                }
                let mut i = 0usize;
                $(
                    let $field = <$ty as Scalar>::read(ctx, i)?;
                    i += 1;
                )+
                debug_assert_eq!(i, N);
                Ok($name { $($field),+ })
            }
        }
    };
}

kernel_scalars!(
    /// RMSNorm (deferred or ordinary).
    NormScalars {
        /// RMSNorm epsilon.
        eps: f32,
    }
);

kernel_scalars!(
    /// A projection: `out (+)= acts @ w^T`.
    GemmScalars {
        /// Input width `K`.
        k: usize,
        /// Accumulate into `out` (else overwrite).
        add: bool,
        /// int8 weights take int8-quantised activations (else fp32; ignored for bf16 weights).
        w8a8: bool,
    }
);

kernel_scalars!(
    /// A decode step's q, k and v projections with their epilogues (`GEMM_ROPE_STEP`).
    GemmRopeScalars {
        /// Input width `K`.
        k: usize,
        /// As [`GemmScalars::w8a8`].
        w8a8: bool,
        /// The q/k norms' epsilon.
        eps: f32,
    }
);

kernel_scalars!(
    /// Gate and up projections fused with SwiGLU.
    GateUpScalars {
        /// Hidden width `H`.
        hidden: usize,
        /// Intermediate width `I` (the packed row the output columns belong to).
        intermediate: usize,
        /// As [`GemmScalars::w8a8`].
        w8a8: bool,
    }
);

kernel_scalars!(
    /// Split-KV decode attention of one sequence over one KV chunk.
    AttnDecodeScalars {
        /// Which KV chunk of the sequence a single-block task computes (its tokens are
        /// `KvSplit { chunks, short }.range(seq_len, chunk)`, the length read from the step
        /// entry at run time); 0 for a task of one block per chunk, block `b` computing chunk
        /// `b` into partial row `b`.
        chunk: usize,
        /// KV chunks of the sequence; 1: write the final output, not partials.
        chunks: usize,
        /// Trailing chunks of half weight (`KvSplit::short`).
        short: usize,
        /// Attention scale.
        scale: f32,
        /// Tokens per page.
        page: usize,
        /// Head dimension.
        head_dim: usize,
    }
);

kernel_scalars!(
    /// Merge of split-KV partials.
    AttnCombineScalars {
        /// KV heads.
        kv_heads: usize,
        /// Query heads per KV head.
        group: usize,
        /// Head dimension.
        head_dim: usize,
    }
);

kernel_scalars!(
    /// Chunked causal prefill attention over a block of rows of one KV head.
    AttnPrefillScalars {
        /// The KV head.
        kv_head: usize,
        /// Position of the block's first row.
        first_pos: usize,
        /// Attention scale.
        scale: f32,
        /// Tokens per page.
        page: usize,
        /// First packed output column of this head's group.
        c0: usize,
        /// Query width (the packed row the output columns belong to).
        q_width: usize,
        /// Head dimension.
        head_dim: usize,
    }
);

kernel_scalars!(
    /// An LM-head share: logits and argmax.
    LmHeadScalars {
        /// Hidden width `H`.
        hidden: usize,
        /// As [`GemmScalars::w8a8`].
        w8a8: bool,
    }
);

#[cfg(test)]
mod tests {
    use super::*;
    use simpler_core::{EngineClass, KernelId, KernelSpec, RunArgs, Worker, WorkerConfig};
    use std::sync::{Arc, Mutex};

    /// What each side sees: the scalars a task carries come back as written, and a task with
    /// a scalar missing is refused by name.
    #[test]
    fn scalars_round_trip_through_a_task_and_a_short_list_is_refused() {
        let w = Worker::new(
            simpler_cpu::CpuPlatform::new(),
            WorkerConfig {
                cores: Some(1),
                timeouts: None,
                idle_spin: None,
            },
        )
        .unwrap();
        let seen: Arc<Mutex<Vec<Result<AttnPrefillScalars, String>>>> = Arc::default();
        let s2 = seen.clone();
        w.register_kernel(KernelSpec::new(
            KernelId(9001),
            "read_scalars",
            EngineClass::Vector,
            move |ctx| {
                s2.lock()
                    .unwrap()
                    .push(AttnPrefillScalars::read(ctx).map_err(|e| e.to_string()));
                Ok(())
            },
        ))
        .unwrap();
        let want = AttnPrefillScalars {
            kv_head: 3,
            first_pos: 77,
            scale: 0.125,
            page: 128,
            c0: 48,
            q_width: 2048,
            head_dim: 128,
        };
        let args = RunArgs {
            buffers: vec![],
            scalars: vec![],
        };
        w.run_fn("scalars", args, &Default::default(), move |o, _| {
            o.submit(want.push(Task::new(KernelId(9001))))?;
            o.submit(Task::new(KernelId(9001)).scalar(3).scalar(77))?;
            Ok(())
        })
        .unwrap();
        let seen = seen.lock().unwrap();
        assert_eq!(seen[0], Ok(want));
        let e = seen[1].as_ref().unwrap_err();
        assert!(
            e.contains("AttnPrefillScalars: 2 scalars, expected 7"),
            "{e}"
        );
    }
}
