//! The CUDA C sources of simpler's GPU kernels, as text: a leaf crate with no logic, so the
//! sources have one home that the CUDA platform compiles (through NVRTC, at run time) and
//! that tests compile for sm_90 on machines without a GPU.
//!
//! Every module source is [`COMMON`] followed by its own file; [`KernelSource::full_text`]
//! gives that text. The entry points are `extern "C"`, so their names are the ones listed.
//! The argument conventions are in each file's comments (`cu/*.cu`).

/// Definitions every kernel source uses (bf16 bits ↔ fp32, warp and block sums, the paged
/// slot formula), prepended to each module so the sources need no CUDA header.
pub const COMMON: &str = include_str!("../cu/common.cuh");

/// One CUDA C module: its name, its own text and the kernels it defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// Module name (the file stem).
    pub name: &'static str,
    /// The file's text (without [`COMMON`]).
    pub text: &'static str,
    /// The `extern "C"` kernels the module defines.
    pub kernels: &'static [&'static str],
}

/// How a launch passes one kernel parameter (the 8-byte slot's contents).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A device pointer (any `T*`).
    Ptr,
    /// `int`.
    I32,
    /// `u32` (`unsigned int`).
    U32,
    /// `u64` (`unsigned long long`).
    U64,
    /// `float`.
    F32,
}

impl KernelSource {
    /// The text NVRTC compiles: [`COMMON`] then the module's own text.
    pub fn full_text(&self) -> String {
        format!("{COMMON}\n{}", self.text)
    }

    /// The parameters of kernel `name` in order, read from its `extern "C"` signature, so a
    /// launch can be checked against them before the driver reads its argument slots; `None`
    /// when the module defines no such kernel or a parameter's type is not one of
    /// [`ParamKind`]'s (a test checks every listed kernel parses).
    pub fn params(&self, name: &str) -> Option<Vec<ParamKind>> {
        for def in self.text.split("extern \"C\" __global__ void").skip(1) {
            let def = def.trim_start();
            let def = def.strip_prefix("__launch_bounds__").map_or(def, |r| {
                r.split_once(')').map_or(r, |(_, tail)| tail).trim_start()
            });
            let Some((kname, rest)) = def.split_once('(') else {
                continue;
            };
            if kname.trim() != name {
                continue;
            }
            let list = rest.split_once(')')?.0;
            return list
                .split(',')
                .map(|p| {
                    let p = p.trim();
                    if p.contains('*') {
                        return Some(ParamKind::Ptr);
                    }
                    let words: Vec<&str> = p.split_whitespace().collect();
                    match words.get(..words.len().checked_sub(1)?)? {
                        ["int"] => Some(ParamKind::I32),
                        ["u32"] | ["unsigned", "int"] => Some(ParamKind::U32),
                        ["u64"] | ["unsigned", "long", "long"] => Some(ParamKind::U64),
                        ["float"] => Some(ParamKind::F32),
                        _ => None,
                    }
                })
                .collect();
        }
        None
    }
}

/// The parameters of kernel `name` in whichever module of [`ALL`] defines it.
pub fn kernel_params(name: &str) -> Option<Vec<ParamKind>> {
    ALL.iter()
        .filter(|m| m.kernels.contains(&name))
        .find_map(|m| m.params(name))
}

/// Embedding gather and RMSNorm.
pub const NORM: KernelSource = KernelSource {
    name: "norm",
    text: include_str!("../cu/norm.cu"),
    kernels: &["embed_rows", "rms_norm"],
};

/// Decode projections (bf16 weights × up to 16 activation rows): the tensor-core form and
/// the plain one it is checked against.
pub const GEMV: KernelSource = KernelSource {
    name: "gemv",
    text: include_str!("../cu/gemv.cu"),
    kernels: &[
        "gemv_bf16",
        "gemv_bf16_mma",
        "gemv_bf16_mma_swiglu",
        "gemv_bf16_mma_n8",
        "gemv_bf16_mma_n8_swiglu",
    ],
};

/// Prefill projections (tiled GEMM).
pub const GEMM: KernelSource = KernelSource {
    name: "gemm",
    text: include_str!("../cu/gemm.cu"),
    kernels: &["gemm_bf16"],
};

/// q/k norm, RoPE and the paged KV write.
pub const ROPE_KV: KernelSource = KernelSource {
    name: "rope_kv",
    text: include_str!("../cu/rope_kv.cu"),
    kernels: &["qk_norm_rope_kv"],
};

/// Split-KV paged decode attention (two passes; the first plain or on tensor cores) and
/// causal prefill attention.
pub const ATTENTION: KernelSource = KernelSource {
    name: "attention",
    text: include_str!("../cu/attention.cu"),
    kernels: &[
        "attn_decode_partial",
        "attn_decode_partial_mma",
        "attn_decode_combine",
        "attn_prefill",
    ],
};

/// SwiGLU and the greedy argmax.
pub const ELEMENTWISE: KernelSource = KernelSource {
    name: "elementwise",
    text: include_str!("../cu/elementwise.cu"),
    kernels: &["swiglu", "argmax_rows"],
};

/// Random weights on the device and the read-bandwidth probe.
pub const FILL: KernelSource = KernelSource {
    name: "fill",
    text: include_str!("../cu/fill.cu"),
    kernels: &["fill_random_bf16", "fill_random_f32", "read_probe"],
};

/// Every module.
pub const ALL: &[KernelSource] = &[NORM, GEMV, GEMM, ROPE_KV, ATTENTION, ELEMENTWISE, FILL];

/// Rows one `gemv_bf16` launch handles (`GEMV_MAX_ROWS` in `cu/gemv.cu`); larger batches
/// take several launches.
pub const GEMV_MAX_ROWS: usize = 16;

/// Threads of an `rms_norm` block (`NORM_THREADS`).
pub const NORM_THREADS: u32 = 1024;

/// Widest row `rms_norm` takes: `NORM_VEC` float4 per thread held in registers.
pub const NORM_MAX_HIDDEN: usize = 4 * 8 * NORM_THREADS as usize;

/// Largest head dimension the attention kernels take (`32 * ATT_MAX_ELEMS`).
pub const ATTN_MAX_HEAD_DIM: usize = 256;

/// Largest number of query heads per KV head (`ATT_MAX_GROUP`).
pub const ATTN_MAX_GROUP: usize = 8;

/// The one head dimension the tensor-core decode attention takes (`ATTM_D`).
pub const ATTN_MMA_HEAD_DIM: usize = 128;

/// Largest number of query heads per KV head of the tensor-core decode attention
/// (`ATTM_GROUP`: the 16 rows of its products).
pub const ATTN_MMA_MAX_GROUP: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;

    /// The listed names are the `extern "C"` kernels each file defines, and no file defines
    /// one that is not listed (a kernel the host cannot name is dead code).
    #[test]
    fn listed_kernels_match_the_sources() {
        for src in ALL {
            let defined: Vec<&str> = src
                .text
                .split("extern \"C\" __global__ void")
                .skip(1)
                .map(|rest| {
                    let rest = rest.trim_start();
                    let rest = rest.strip_prefix("__launch_bounds__").map_or(rest, |r| {
                        r.split_once(')').map_or(r, |(_, tail)| tail).trim_start()
                    });
                    rest.split('(').next().unwrap_or("").trim()
                })
                .collect();
            assert_eq!(defined, src.kernels, "module {}", src.name);
        }
    }

    /// Every listed kernel's signature parses into parameter kinds, and a few are as written.
    #[test]
    fn every_kernel_signature_parses() {
        for src in ALL {
            for k in src.kernels {
                let p = src.params(k).unwrap_or_else(|| panic!("{}: {k}", src.name));
                assert!(!p.is_empty(), "{k}");
            }
        }
        use ParamKind::*;
        assert_eq!(
            kernel_params("rms_norm").unwrap(),
            [Ptr, Ptr, Ptr, Ptr, I32, F32]
        );
        assert_eq!(
            kernel_params("fill_random_bf16").unwrap(),
            [Ptr, U64, U64, F32, F32]
        );
        assert_eq!(
            kernel_params("gemv_bf16_mma_n8").unwrap(),
            [Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32]
        );
        assert!(kernel_params("no_such_kernel").is_none());
    }

    /// The limits the host checks against are the ones the sources were written for.
    #[test]
    fn host_limits_match_the_sources() {
        assert!(
            GEMV.text
                .contains(&format!("#define GEMV_MAX_ROWS {GEMV_MAX_ROWS}"))
        );
        assert!(
            ATTENTION
                .text
                .contains(&format!("#define ATT_MAX_ELEMS {}", ATTN_MAX_HEAD_DIM / 32))
        );
        assert!(
            ATTENTION
                .text
                .contains(&format!("#define ATT_MAX_GROUP {ATTN_MAX_GROUP}"))
        );
        assert!(
            ATTENTION
                .text
                .contains(&format!("#define ATTM_D {ATTN_MMA_HEAD_DIM}"))
        );
        assert!(
            NORM.text
                .contains(&format!("#define NORM_THREADS {NORM_THREADS}"))
        );
        assert!(NORM.text.contains(&format!(
            "#define NORM_VEC {}",
            NORM_MAX_HIDDEN / 4 / NORM_THREADS as usize
        )));
        assert!(
            ATTENTION
                .text
                .contains(&format!("#define ATTM_GROUP {ATTN_MMA_MAX_GROUP}"))
        );
    }
}
