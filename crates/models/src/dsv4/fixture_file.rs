//! Fixture files: one DeepSeek-V4 decode-step case ([`Dsv4Fixture`]) saved to and loaded from a
//! safetensors file, so a case can be kept, shared and replayed without its seed.
//!
//! Layout (`docs/dsv4.md`, "Fixture files"): the metadata holds `format` (`simpler-dsv4-fixture`),
//! `version` (`1`) and `config` (the [`Dsv4Config`] as JSON); every tensor of the fixture is a
//! named tensor (`attn.wq_b.q`, `moe.routed.3.w2.scale`, `window.block_table`, ...). Loading
//! trusts nothing in the file: each tensor must be present with the dtype and the shape the
//! configuration and the step's batch imply, no unknown tensor may be present, and every index
//! (block table, token ids, hash rows) must be in range — otherwise the error names the tensor
//! or the metadata key, and nothing is half-loaded.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::tensor::{Dtype, SafeTensors, View};

use super::config::{ConfigError, Dsv4Config};
use super::fixture::{
    AttnWeights, CompressedCache, CompressorState, CompressorWeights, CsaParts, Dsv4Fixture,
    Expert, HcWeights, HcaParts, IndexCache, Int8Matrix, MoeWeights, OverlapState, StepInputs,
    TOKENS_PER_SEQ, WindowCache,
};

/// The `format` metadata value of a fixture file.
pub const FORMAT: &str = "simpler-dsv4-fixture";
/// The layout version this code writes. It reads this one and [`VERSION_1`].
pub const VERSION: &str = "2";
/// The first layout: no `inputs.real_tokens` (every row a real token).
pub const VERSION_1: &str = "1";

/// A fixture file that cannot be written or read.
#[derive(Debug, thiserror::Error)]
pub enum FixtureFileError {
    /// The file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The file is not a safetensors file (or is truncated).
    #[error("{}: not a fixture file: {why}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What the safetensors reader said.
        why: String,
    },
    /// A metadata key is missing or holds something else.
    #[error("fixture metadata `{key}`: {why}")]
    Metadata {
        /// The key.
        key: &'static str,
        /// What is wrong.
        why: String,
    },
    /// The configuration in the metadata is invalid.
    #[error("fixture metadata `config`: {0}")]
    Config(#[from] ConfigError),
    /// A tensor the configuration needs is absent.
    #[error("fixture tensor `{tensor}` is missing")]
    Missing {
        /// Its name.
        tensor: String,
    },
    /// A tensor has the wrong element type.
    #[error("fixture tensor `{tensor}`: dtype {found}, expected {expected}")]
    Dtype {
        /// Its name.
        tensor: String,
        /// The dtype the layout has.
        expected: String,
        /// The dtype in the file.
        found: String,
    },
    /// A tensor has the wrong shape.
    #[error("fixture tensor `{tensor}`: shape {found:?}, expected {expected:?}")]
    Shape {
        /// Its name.
        tensor: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor the layout does not have (a file of another layout or version).
    #[error("fixture tensor `{tensor}` is not part of the fixture layout")]
    Unknown {
        /// Its name.
        tensor: String,
    },
    /// A value is out of its range (an index past its table, a start past the RoPE tables).
    #[error("fixture tensor `{tensor}`: {why}")]
    Value {
        /// Its name.
        tensor: String,
        /// What is wrong.
        why: String,
    },
}

type Result<T> = std::result::Result<T, FixtureFileError>;

/// One tensor to write: its dtype, shape and little-endian bytes (made when written, so saving
/// holds at most one tensor's copy besides the fixture).
struct Out<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Box<dyn Fn() -> Vec<u8> + 'a>,
    len: usize,
}

impl View for &Out<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned((self.bytes)())
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

#[derive(Default)]
struct Writer<'a> {
    tensors: Vec<(String, Out<'a>)>,
}

impl<'a> Writer<'a> {
    fn push(
        &mut self,
        name: String,
        dtype: Dtype,
        shape: Vec<usize>,
        len: usize,
        bytes: Box<dyn Fn() -> Vec<u8> + 'a>,
    ) {
        debug_assert_eq!(
            shape.iter().product::<usize>() * dtype.bitsize() / 8,
            len,
            "{name}"
        );
        self.tensors.push((
            name,
            Out {
                dtype,
                shape,
                bytes,
                len,
            },
        ));
    }
    fn f32(&mut self, name: impl Into<String>, shape: &[usize], v: &'a [f32]) {
        self.push(
            name.into(),
            Dtype::F32,
            shape.to_vec(),
            v.len() * 4,
            Box::new(move || v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        );
    }
    fn bf16(&mut self, name: impl Into<String>, shape: &[usize], v: &'a [bf16]) {
        self.push(
            name.into(),
            Dtype::BF16,
            shape.to_vec(),
            v.len() * 2,
            Box::new(move || v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()),
        );
    }
    fn i8(&mut self, name: impl Into<String>, shape: &[usize], v: &'a [i8]) {
        self.push(
            name.into(),
            Dtype::I8,
            shape.to_vec(),
            v.len(),
            Box::new(move || v.iter().map(|&x| x as u8).collect()),
        );
    }
    fn u32(&mut self, name: impl Into<String>, shape: &[usize], v: &'a [u32]) {
        self.push(
            name.into(),
            Dtype::U32,
            shape.to_vec(),
            v.len() * 4,
            Box::new(move || v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        );
    }
    fn u64(&mut self, name: impl Into<String>, shape: &[usize], v: &'a [usize]) {
        self.push(
            name.into(),
            Dtype::U64,
            shape.to_vec(),
            v.len() * 8,
            Box::new(move || v.iter().flat_map(|&x| (x as u64).to_le_bytes()).collect()),
        );
    }
    fn int8(&mut self, name: &str, m: &'a Int8Matrix) {
        self.i8(format!("{name}.q"), &[m.rows, m.cols], &m.q);
        self.f32(format!("{name}.scale"), &[m.rows], &m.scale);
    }
    fn hc(&mut self, name: &str, hc: &'a HcWeights, cfg: &Dsv4Config) {
        self.f32(
            format!("{name}.mix"),
            &[cfg.hc_mix(), cfg.hc_mult * cfg.hidden],
            &hc.mix,
        );
        self.f32(format!("{name}.scale"), &[3], &hc.scale);
        self.f32(format!("{name}.base"), &[cfg.hc_mix()], &hc.base);
    }
    fn expert(&mut self, name: &str, e: &'a Expert) {
        self.int8(&format!("{name}.w1"), &e.w1);
        self.int8(&format!("{name}.w3"), &e.w3);
        self.int8(&format!("{name}.w2"), &e.w2);
    }
    fn compressor(
        &mut self,
        name: &str,
        c: &'a CompressorWeights,
        out: usize,
        ratio: usize,
        norm: usize,
        hidden: usize,
    ) {
        self.bf16(format!("{name}.wkv"), &[out, hidden], &c.wkv);
        self.bf16(format!("{name}.wgate"), &[out, hidden], &c.wgate);
        self.f32(format!("{name}.ape"), &[ratio, out], &c.ape);
        self.f32(format!("{name}.norm"), &[norm], &c.norm);
    }
}

/// Writes `f` to `path` (replacing it).
pub fn save_fixture(f: &Dsv4Fixture, path: &Path) -> Result<()> {
    let cfg = &f.config;
    let (d, hd, h) = (cfg.hidden, cfg.head_dim, cfg.n_heads);
    let batch = f.inputs.starts.len();
    let t = batch * TOKENS_PER_SEQ;
    let mut w = Writer::default();
    let a = &f.attn;
    w.hc("attn.hc", &a.hc, cfg);
    w.f32("attn.attn_norm", &[d], &a.attn_norm);
    w.bf16("attn.wq_a", &[cfg.q_lora_rank, d], &a.wq_a);
    w.f32("attn.q_norm", &[cfg.q_lora_rank], &a.q_norm);
    w.int8("attn.wq_b", &a.wq_b);
    w.bf16("attn.wkv", &[hd, d], &a.wkv);
    w.f32("attn.kv_norm", &[hd], &a.kv_norm);
    w.bf16(
        "attn.wo_a",
        &[cfg.o_groups, cfg.o_lora_rank, cfg.heads_per_group() * hd],
        &a.wo_a,
    );
    w.int8("attn.wo_b", &a.wo_b);
    w.f32("attn.sink", &[h], &a.sink);
    let m = &f.moe;
    w.hc("moe.hc", &m.hc, cfg);
    w.f32("moe.ffn_norm", &[d], &m.ffn_norm);
    w.f32("moe.gate", &[cfg.n_routed_experts, d], &m.gate);
    w.f32("moe.bias", &[cfg.n_routed_experts], &m.bias);
    w.u32(
        "moe.tid2eid",
        &[cfg.vocab_size, cfg.n_activated_experts],
        &m.tid2eid,
    );
    for (i, e) in m.routed.iter().enumerate() {
        w.expert(&format!("moe.routed.{i}"), e);
    }
    for (i, e) in m.shared.iter().enumerate() {
        w.expert(&format!("moe.shared.{i}"), e);
    }
    let win = &f.window;
    w.u64(
        "window.block_table",
        &[batch, win.max_blocks],
        &win.block_table,
    );
    w.bf16("window.rows", &[win.rows.len() / hd.max(1), hd], &win.rows);
    let hca = &f.hca;
    w.compressor("hca.compressor", &hca.compressor, hd, cfg.hca_ratio, hd, d);
    w.f32("hca.state.kv", &[batch * cfg.hca_ratio, hd], &hca.state.kv);
    w.f32(
        "hca.state.score",
        &[batch * cfg.hca_ratio, hd],
        &hca.state.score,
    );
    w.bf16(
        "hca.cache",
        &[batch, hca.cache.max_rows, hd],
        &hca.cache.rows,
    );
    let csa = &f.csa;
    let (r, iw) = (cfg.csa_ratio, cfg.index_head_dim);
    w.compressor("csa.compressor", &csa.compressor, 2 * hd, r, hd, d);
    w.f32("csa.state.kv", &[batch * 2 * r, 2 * hd], &csa.state.kv);
    w.f32(
        "csa.state.score",
        &[batch * 2 * r, 2 * hd],
        &csa.state.score,
    );
    w.bf16(
        "csa.cache",
        &[batch, csa.cache.max_rows, hd],
        &csa.cache.rows,
    );
    w.compressor(
        "csa.index_compressor",
        &csa.index_compressor,
        2 * iw,
        r,
        iw,
        d,
    );
    w.f32(
        "csa.index_state.kv",
        &[batch * 2 * r, 2 * iw],
        &csa.index_state.kv,
    );
    w.f32(
        "csa.index_state.score",
        &[batch * 2 * r, 2 * iw],
        &csa.index_state.score,
    );
    w.i8(
        "csa.index_cache.q",
        &[batch, csa.index_cache.max_rows, iw],
        &csa.index_cache.q,
    );
    w.f32(
        "csa.index_cache.scale",
        &[batch, csa.index_cache.max_rows],
        &csa.index_cache.scale,
    );
    w.int8("csa.wq_idx", &csa.wq_idx);
    w.bf16("csa.w_weights", &[cfg.index_heads, d], &csa.w_weights);
    w.u64("inputs.starts", &[batch], &f.inputs.starts);
    w.u64("inputs.real_tokens", &[batch], &f.inputs.real_tokens);
    w.u32("inputs.token_ids", &[t], &f.inputs.token_ids);
    w.f32("inputs.x_hc", &[t, cfg.hc_mult, d], &f.inputs.x_hc);

    let metadata: HashMap<String, String> = [
        ("format".to_string(), FORMAT.to_string()),
        ("version".to_string(), VERSION.to_string()),
        ("config".to_string(), cfg.to_json()),
    ]
    .into();
    let views = w.tensors.iter().map(|(n, o)| (n.clone(), o));
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(source) => FixtureFileError::Io {
            path: path.to_path_buf(),
            source,
        },
        other => FixtureFileError::Format {
            path: path.to_path_buf(),
            why: other.to_string(),
        },
    })
}

/// Reads tensors by name, checking dtype and shape, and remembers which were taken.
struct Reader<'a> {
    st: SafeTensors<'a>,
    taken: BTreeSet<String>,
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

impl<'a> Reader<'a> {
    fn view(&mut self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<&'a [u8]> {
        let v = self
            .st
            .tensor(name)
            .map_err(|_| FixtureFileError::Missing {
                tensor: name.to_string(),
            })?;
        if v.dtype() != dtype {
            return Err(FixtureFileError::Dtype {
                tensor: name.to_string(),
                expected: dtype_name(dtype),
                found: dtype_name(v.dtype()),
            });
        }
        if v.shape() != shape {
            return Err(FixtureFileError::Shape {
                tensor: name.to_string(),
                expected: shape.to_vec(),
                found: v.shape().to_vec(),
            });
        }
        self.taken.insert(name.to_string());
        Ok(v.data())
    }

    /// The shape of `name` (for the sizes the configuration leaves free: batch, cache rows).
    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        self.st
            .tensor(name)
            .map(|v| v.shape().to_vec())
            .map_err(|_| FixtureFileError::Missing {
                tensor: name.to_string(),
            })
    }

    fn dim(&self, name: &str, rank: usize, axis: usize) -> Result<usize> {
        let s = self.shape(name)?;
        if s.len() != rank {
            return Err(FixtureFileError::Value {
                tensor: name.to_string(),
                why: format!("rank {} (shape {s:?}), expected rank {rank}", s.len()),
            });
        }
        Ok(s[axis])
    }

    fn f32(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let b = self.view(name, Dtype::F32, shape)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }
    fn bf16(&mut self, name: &str, shape: &[usize]) -> Result<Vec<bf16>> {
        let b = self.view(name, Dtype::BF16, shape)?;
        Ok(b.chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect())
    }
    fn i8(&mut self, name: &str, shape: &[usize]) -> Result<Vec<i8>> {
        Ok(self
            .view(name, Dtype::I8, shape)?
            .iter()
            .map(|&b| b as i8)
            .collect())
    }
    fn u32(&mut self, name: &str, shape: &[usize]) -> Result<Vec<u32>> {
        let b = self.view(name, Dtype::U32, shape)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }
    fn index(&mut self, name: &str, shape: &[usize]) -> Result<Vec<usize>> {
        let b = self.view(name, Dtype::U64, shape)?;
        b.chunks_exact(8)
            .map(|c| {
                let v = u64::from_le_bytes(c.try_into().unwrap());
                usize::try_from(v).map_err(|_| FixtureFileError::Value {
                    tensor: name.to_string(),
                    why: format!("{v} does not fit this machine's usize"),
                })
            })
            .collect()
    }
    fn int8(&mut self, name: &str, rows: usize, cols: usize) -> Result<Int8Matrix> {
        Ok(Int8Matrix {
            rows,
            cols,
            q: self.i8(&format!("{name}.q"), &[rows, cols])?,
            scale: self.f32(&format!("{name}.scale"), &[rows])?,
        })
    }
    fn hc(&mut self, name: &str, cfg: &Dsv4Config) -> Result<HcWeights> {
        let s = self.f32(&format!("{name}.scale"), &[3])?;
        Ok(HcWeights {
            mix: self.f32(
                &format!("{name}.mix"),
                &[cfg.hc_mix(), cfg.hc_mult * cfg.hidden],
            )?,
            scale: [s[0], s[1], s[2]],
            base: self.f32(&format!("{name}.base"), &[cfg.hc_mix()])?,
        })
    }
    fn expert(&mut self, name: &str, cfg: &Dsv4Config) -> Result<Expert> {
        let (d, i) = (cfg.hidden, cfg.moe_inter_dim);
        Ok(Expert {
            w1: self.int8(&format!("{name}.w1"), i, d)?,
            w3: self.int8(&format!("{name}.w3"), i, d)?,
            w2: self.int8(&format!("{name}.w2"), d, i)?,
        })
    }
    fn compressor(
        &mut self,
        name: &str,
        out: usize,
        ratio: usize,
        norm: usize,
        hidden: usize,
    ) -> Result<CompressorWeights> {
        Ok(CompressorWeights {
            wkv: self.bf16(&format!("{name}.wkv"), &[out, hidden])?,
            wgate: self.bf16(&format!("{name}.wgate"), &[out, hidden])?,
            ape: self.f32(&format!("{name}.ape"), &[ratio, out])?,
            norm: self.f32(&format!("{name}.norm"), &[norm])?,
        })
    }
}

fn meta<'m>(m: Option<&'m HashMap<String, String>>, key: &'static str) -> Result<&'m str> {
    m.and_then(|m| m.get(key))
        .map(String::as_str)
        .ok_or(FixtureFileError::Metadata {
            key,
            why: "missing".to_string(),
        })
}

/// Reads a fixture written by [`save_fixture`], checking everything (see the module docs).
pub fn load_fixture(path: &Path) -> Result<Dsv4Fixture> {
    let bytes = std::fs::read(path).map_err(|source| FixtureFileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let format_err = |why: String| FixtureFileError::Format {
        path: path.to_path_buf(),
        why,
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| format_err(e.to_string()))?;
    let metadata = header.metadata().clone();
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format_err(e.to_string()))?;
    let format = meta(metadata.as_ref(), "format")?;
    if format != FORMAT {
        return Err(FixtureFileError::Metadata {
            key: "format",
            why: format!("`{format}`, expected `{FORMAT}`"),
        });
    }
    let version = meta(metadata.as_ref(), "version")?;
    if version != VERSION && version != VERSION_1 {
        return Err(FixtureFileError::Metadata {
            key: "version",
            why: format!("`{version}`, this build reads versions {VERSION_1} and {VERSION}"),
        });
    }
    let cfg = Dsv4Config::from_json(meta(metadata.as_ref(), "config")?)?;
    cfg.validate()?;
    let mut r = Reader {
        st,
        taken: BTreeSet::new(),
    };
    let fixture = read_all(&mut r, &cfg, version == VERSION_1)?;
    if let Some(extra) = r.st.names().into_iter().find(|n| !r.taken.contains(*n)) {
        return Err(FixtureFileError::Unknown {
            tensor: extra.to_string(),
        });
    }
    check_ranges(&fixture)?;
    Ok(fixture)
}

fn read_all(r: &mut Reader<'_>, cfg: &Dsv4Config, version_1: bool) -> Result<Dsv4Fixture> {
    let (d, hd, h) = (cfg.hidden, cfg.head_dim, cfg.n_heads);
    let batch = r.dim("inputs.starts", 1, 0)?;
    if batch == 0 {
        return Err(FixtureFileError::Value {
            tensor: "inputs.starts".to_string(),
            why: "at least one sequence is needed".to_string(),
        });
    }
    let t = batch * TOKENS_PER_SEQ;
    let attn = AttnWeights {
        hc: r.hc("attn.hc", cfg)?,
        attn_norm: r.f32("attn.attn_norm", &[d])?,
        wq_a: r.bf16("attn.wq_a", &[cfg.q_lora_rank, d])?,
        q_norm: r.f32("attn.q_norm", &[cfg.q_lora_rank])?,
        wq_b: r.int8("attn.wq_b", h * hd, cfg.q_lora_rank)?,
        wkv: r.bf16("attn.wkv", &[hd, d])?,
        kv_norm: r.f32("attn.kv_norm", &[hd])?,
        wo_a: r.bf16(
            "attn.wo_a",
            &[cfg.o_groups, cfg.o_lora_rank, cfg.heads_per_group() * hd],
        )?,
        wo_b: r.int8("attn.wo_b", d, cfg.o_groups * cfg.o_lora_rank)?,
        sink: r.f32("attn.sink", &[h])?,
    };
    let moe = MoeWeights {
        hc: r.hc("moe.hc", cfg)?,
        ffn_norm: r.f32("moe.ffn_norm", &[d])?,
        gate: r.f32("moe.gate", &[cfg.n_routed_experts, d])?,
        bias: r.f32("moe.bias", &[cfg.n_routed_experts])?,
        tid2eid: r.u32("moe.tid2eid", &[cfg.vocab_size, cfg.n_activated_experts])?,
        routed: (0..cfg.n_routed_experts)
            .map(|i| r.expert(&format!("moe.routed.{i}"), cfg))
            .collect::<Result<_>>()?,
        shared: (0..cfg.n_shared_experts)
            .map(|i| r.expert(&format!("moe.shared.{i}"), cfg))
            .collect::<Result<_>>()?,
    };
    let max_blocks = r.dim("window.block_table", 2, 1)?;
    let pool_rows = r.dim("window.rows", 2, 0)?;
    let window = WindowCache {
        width: hd,
        page_size: cfg.page_size,
        max_blocks,
        block_table: r.index("window.block_table", &[batch, max_blocks])?,
        rows: r.bf16("window.rows", &[pool_rows, hd])?,
    };
    let hca_rows = r.dim("hca.cache", 3, 1)?;
    let hca = HcaParts {
        compressor: r.compressor("hca.compressor", hd, cfg.hca_ratio, hd, d)?,
        state: CompressorState {
            ratio: cfg.hca_ratio,
            width: hd,
            kv: r.f32("hca.state.kv", &[batch * cfg.hca_ratio, hd])?,
            score: r.f32("hca.state.score", &[batch * cfg.hca_ratio, hd])?,
        },
        cache: CompressedCache {
            width: hd,
            max_rows: hca_rows,
            rows: r.bf16("hca.cache", &[batch, hca_rows, hd])?,
        },
    };
    let (ratio, iw) = (cfg.csa_ratio, cfg.index_head_dim);
    let csa_rows = r.dim("csa.cache", 3, 1)?;
    let index_rows = r.dim("csa.index_cache.q", 3, 1)?;
    let overlap = |r: &mut Reader<'_>, name: &str, width: usize| -> Result<OverlapState> {
        Ok(OverlapState {
            ratio,
            width,
            kv: r.f32(&format!("{name}.kv"), &[batch * 2 * ratio, 2 * width])?,
            score: r.f32(&format!("{name}.score"), &[batch * 2 * ratio, 2 * width])?,
        })
    };
    let csa = CsaParts {
        compressor: r.compressor("csa.compressor", 2 * hd, ratio, hd, d)?,
        state: overlap(r, "csa.state", hd)?,
        cache: CompressedCache {
            width: hd,
            max_rows: csa_rows,
            rows: r.bf16("csa.cache", &[batch, csa_rows, hd])?,
        },
        index_compressor: r.compressor("csa.index_compressor", 2 * iw, ratio, iw, d)?,
        index_state: overlap(r, "csa.index_state", iw)?,
        index_cache: IndexCache {
            width: iw,
            max_rows: index_rows,
            q: r.i8("csa.index_cache.q", &[batch, index_rows, iw])?,
            scale: r.f32("csa.index_cache.scale", &[batch, index_rows])?,
        },
        wq_idx: r.int8("csa.wq_idx", cfg.index_heads * iw, cfg.q_lora_rank)?,
        w_weights: r.bf16("csa.w_weights", &[cfg.index_heads, d])?,
    };
    let inputs = StepInputs {
        starts: r.index("inputs.starts", &[batch])?,
        real_tokens: if version_1 {
            vec![TOKENS_PER_SEQ; batch]
        } else {
            r.index("inputs.real_tokens", &[batch])?
        },
        token_ids: r.u32("inputs.token_ids", &[t])?,
        x_hc: r.f32("inputs.x_hc", &[t, cfg.hc_mult, d])?,
    };
    Ok(Dsv4Fixture {
        config: cfg.clone(),
        attn,
        moe,
        window,
        hca,
        csa,
        inputs,
    })
}

/// The checks a generated fixture meets by construction: every position of the step has a
/// slot and a RoPE angle, every compressed row the step can close or read exists, and every
/// index points into its table.
fn check_ranges(f: &Dsv4Fixture) -> Result<()> {
    let cfg = &f.config;
    let bad = |tensor: &str, why: String| FixtureFileError::Value {
        tensor: tensor.to_string(),
        why,
    };
    let pages = f.window.rows.len() / (cfg.page_size * cfg.head_dim);
    if f.window.rows.len() != pages * cfg.page_size * cfg.head_dim {
        return Err(bad(
            "window.rows",
            format!(
                "{} rows is not a whole number of {}-row pages",
                f.window.rows.len() / cfg.head_dim,
                cfg.page_size
            ),
        ));
    }
    if let Some((i, &p)) = f
        .window
        .block_table
        .iter()
        .enumerate()
        .find(|&(_, &p)| p >= pages)
    {
        return Err(bad(
            "window.block_table",
            format!("entry {i} names page {p}, the pool has {pages}"),
        ));
    }
    if let Some((seq, n)) = f
        .inputs
        .real_tokens
        .iter()
        .enumerate()
        .find(|&(_, &n)| n > TOKENS_PER_SEQ)
    {
        return Err(bad(
            "inputs.real_tokens",
            format!(
                "sequence {seq} has {n} real tokens, a step has {TOKENS_PER_SEQ} rows a sequence"
            ),
        ));
    }
    for (seq, (&start, &real)) in f
        .inputs
        .starts
        .iter()
        .zip(&f.inputs.real_tokens)
        .enumerate()
    {
        // The step's last position in this sequence (padding rows sit at the start).
        let Some(last) = start.checked_add(real.max(1) - 1) else {
            return Err(bad(
                "inputs.starts",
                format!(
                    "sequence {seq} starts at {start}: its last position is past any max_position"
                ),
            ));
        };
        if last >= cfg.max_position {
            return Err(bad(
                "inputs.starts",
                format!(
                    "sequence {seq} starts at {start}: position {last} exceeds max_position {}",
                    cfg.max_position
                ),
            ));
        }
        let need = |rows: usize, ratio: usize, tensor: &str| {
            let closed = (last + 1) / ratio;
            if closed > rows {
                Err(bad(
                    tensor,
                    format!(
                        "sequence {seq} needs {closed} rows up to position {last}, the cache has {rows}"
                    ),
                ))
            } else {
                Ok(())
            }
        };
        if last / cfg.page_size >= f.window.max_blocks {
            return Err(bad(
                "window.block_table",
                format!(
                    "sequence {seq} reaches block {} at position {last}, the table has {}",
                    last / cfg.page_size,
                    f.window.max_blocks
                ),
            ));
        }
        need(f.hca.cache.max_rows, cfg.hca_ratio, "hca.cache")?;
        need(f.csa.cache.max_rows, cfg.csa_ratio, "csa.cache")?;
        need(
            f.csa.index_cache.max_rows,
            cfg.csa_ratio,
            "csa.index_cache.q",
        )?;
    }
    if let Some((i, &id)) = f
        .inputs
        .token_ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= cfg.vocab_size)
    {
        return Err(bad(
            "inputs.token_ids",
            format!("entry {i} is token {id}, vocab_size is {}", cfg.vocab_size),
        ));
    }
    if let Some(why) = super::fixture::hash_table_error(cfg, &f.moe.tid2eid) {
        return Err(bad("moe.tid2eid", why));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dsv4::{MIXED_STARTS, generate_fixture};

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("simpler-dsv4-fixture-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn a_saved_fixture_loads_back_equal() {
        let f = generate_fixture(&Dsv4Config::tiny(), &MIXED_STARTS, 5).unwrap();
        let p = tmp("roundtrip.safetensors");
        save_fixture(&f, &p).unwrap();
        assert_eq!(load_fixture(&p).unwrap(), f);
        std::fs::remove_file(&p).unwrap();
    }

    type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

    /// Rewrites a saved fixture with one tensor changed (or dropped, or added) and returns the
    /// load error.
    fn load_edited(
        name: &str,
        edit: impl FnOnce(&mut Tensors, &mut HashMap<String, String>),
    ) -> FixtureFileError {
        let f = generate_fixture(&Dsv4Config::tiny(), &MIXED_STARTS, 5).unwrap();
        load_rewritten(&f, name, edit).unwrap_err()
    }

    /// Saves `f`, rewrites the file with `edit` and loads it again.
    fn load_rewritten(
        f: &Dsv4Fixture,
        name: &str,
        edit: impl FnOnce(&mut Tensors, &mut HashMap<String, String>),
    ) -> Result<Dsv4Fixture> {
        let p = tmp(name);
        save_fixture(f, &p).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let mut metadata = header.metadata().clone().unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<_> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
            .collect();
        edit(&mut tensors, &mut metadata);
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, Some(metadata), &p).unwrap();
        let loaded = load_fixture(&p);
        std::fs::remove_file(&p).unwrap();
        loaded
    }

    #[test]
    fn padding_rows_round_trip_and_version_1_files_have_none() {
        let mut f = generate_fixture(&Dsv4Config::tiny(), &MIXED_STARTS, 5).unwrap();
        f.inputs.real_tokens = vec![2, 1, 0, 2];
        let p = tmp("padded.safetensors");
        save_fixture(&f, &p).unwrap();
        assert_eq!(load_fixture(&p).unwrap(), f);
        std::fs::remove_file(&p).unwrap();
        // A version-1 file (no `inputs.real_tokens`) loads with every row real.
        let v1 = load_rewritten(&f, "v1.safetensors", |t, m| {
            t.retain(|x| x.0 != "inputs.real_tokens");
            m.insert("version".into(), VERSION_1.into());
        })
        .unwrap();
        assert_eq!(v1.inputs.real_tokens, [TOKENS_PER_SEQ; 4]);
        // Version 2 requires the tensor; version 1 refuses it; more real tokens than rows.
        let e = load_rewritten(&f, "v2-missing.safetensors", |t, _| {
            t.retain(|x| x.0 != "inputs.real_tokens")
        })
        .unwrap_err();
        assert!(
            matches!(&e, FixtureFileError::Missing { tensor } if tensor == "inputs.real_tokens"),
            "{e}"
        );
        let e = load_rewritten(&f, "v1-extra.safetensors", |_, m| {
            m.insert("version".into(), VERSION_1.into());
        })
        .unwrap_err();
        assert!(
            matches!(&e, FixtureFileError::Unknown { tensor } if tensor == "inputs.real_tokens"),
            "{e}"
        );
        let e = load_rewritten(&f, "v2-over.safetensors", |t, _| {
            let x = find(t, "inputs.real_tokens");
            x.3[..8].copy_from_slice(&3u64.to_le_bytes());
        })
        .unwrap_err();
        assert!(
            matches!(&e, FixtureFileError::Value { tensor, .. } if tensor == "inputs.real_tokens"),
            "{e}"
        );
        let e = load_rewritten(&f, "v3.safetensors", |_, m| {
            m.insert("version".into(), "3".into());
        })
        .unwrap_err();
        assert!(e.to_string().contains("versions 1 and 2"), "{e}");
    }

    fn find<'a>(
        t: &'a mut [(String, Dtype, Vec<usize>, Vec<u8>)],
        name: &str,
    ) -> &'a mut (String, Dtype, Vec<usize>, Vec<u8>) {
        t.iter_mut().find(|x| x.0 == name).unwrap()
    }

    #[test]
    fn malformed_files_name_the_tensor_or_key() {
        let e = load_edited("missing.safetensors", |t, _| {
            t.retain(|x| x.0 != "attn.wq_b.scale")
        });
        assert!(
            matches!(&e, FixtureFileError::Missing { tensor } if tensor == "attn.wq_b.scale"),
            "{e}"
        );
        assert!(e.to_string().contains("attn.wq_b.scale"));

        let e = load_edited("dtype.safetensors", |t, _| {
            let x = find(t, "attn.sink");
            x.1 = Dtype::I32;
        });
        assert!(
            matches!(&e, FixtureFileError::Dtype { tensor, .. } if tensor == "attn.sink"),
            "{e}"
        );

        let e = load_edited("shape.safetensors", |t, _| {
            let x = find(t, "attn.wkv");
            x.2 = vec![x.2[1], x.2[0]];
        });
        assert!(
            matches!(&e, FixtureFileError::Shape { tensor, .. } if tensor == "attn.wkv"),
            "{e}"
        );

        let e = load_edited("unknown.safetensors", |t, _| {
            t.push(("attn.extra".into(), Dtype::F32, vec![1], vec![0; 4]))
        });
        assert!(
            matches!(&e, FixtureFileError::Unknown { tensor } if tensor == "attn.extra"),
            "{e}"
        );

        let e = load_edited("page.safetensors", |t, _| {
            let x = find(t, "window.block_table");
            x.3[..8].copy_from_slice(&1_000_000u64.to_le_bytes());
        });
        assert!(
            matches!(&e, FixtureFileError::Value { tensor, .. } if tensor == "window.block_table"),
            "{e}"
        );

        let e = load_edited("token.safetensors", |t, _| {
            let x = find(t, "inputs.token_ids");
            x.3[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        });
        assert!(
            matches!(&e, FixtureFileError::Value { tensor, .. } if tensor == "inputs.token_ids"),
            "{e}"
        );

        let e = load_edited("expert.safetensors", |t, _| {
            let x = find(t, "moe.tid2eid");
            x.3[..4].copy_from_slice(&999u32.to_le_bytes());
        });
        assert!(
            matches!(&e, FixtureFileError::Value { tensor, .. } if tensor == "moe.tid2eid"),
            "{e}"
        );
        // An expert named twice in one token's row.
        let e = load_edited("expert-twice.safetensors", |t, _| {
            let x = find(t, "moe.tid2eid");
            let first: [u8; 4] = x.3[..4].try_into().unwrap();
            x.3[4..8].copy_from_slice(&first);
        });
        assert!(
            matches!(&e, FixtureFileError::Value { tensor, .. } if tensor == "moe.tid2eid")
                && e.to_string().contains("token 0's row names expert"),
            "{e}"
        );

        // A start whose step reads compressed rows the cache does not have.
        let e = load_edited("start.safetensors", |t, _| {
            let x = find(t, "inputs.starts");
            x.3[..8].copy_from_slice(&9000u64.to_le_bytes());
        });
        assert!(matches!(&e, FixtureFileError::Value { .. }), "{e}");

        // A start whose step's last position overflows (it wrapped past the range checks).
        let e = load_edited("start-max.safetensors", |t, _| {
            let x = find(t, "inputs.starts");
            x.3[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        });
        assert!(
            matches!(&e, FixtureFileError::Value { tensor, .. } if tensor == "inputs.starts"),
            "{e}"
        );

        let e = load_edited("format.safetensors", |_, m| {
            m.insert("format".into(), "something-else".into());
        });
        assert!(
            matches!(&e, FixtureFileError::Metadata { key: "format", .. }),
            "{e}"
        );

        let e = load_edited("config.safetensors", |_, m| {
            let cfg = m["config"].replace("\"hidden\": 64", "\"hidden\": 0");
            m.insert("config".into(), cfg);
        });
        assert!(e.to_string().contains("hidden"), "{e}");
    }

    #[test]
    fn a_file_that_is_not_a_fixture_is_refused() {
        let p = tmp("garbage.safetensors");
        std::fs::write(&p, b"not a safetensors file at all").unwrap();
        assert!(matches!(
            load_fixture(&p),
            Err(FixtureFileError::Format { .. })
        ));
        std::fs::remove_file(&p).unwrap();
        assert!(matches!(load_fixture(&p), Err(FixtureFileError::Io { .. })));
    }
}
