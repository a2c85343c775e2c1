//! HF checkpoints: load a local directory (`config.json`, `model.safetensors` or a sharded
//! `model.safetensors.index.json`), memory-mapped, bf16/f16/f32 accepted and converted to bf16
//! projections and fp32 norms; save weights back in HF naming (used by round-trip tests).
//!
//! Every failure is a [`CheckpointError`] naming the tensor and the file; nothing panics on a
//! bad checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, TensorView};

use super::config::{ConfigError, Qwen3Config};
use super::fixture::Progress;
use super::weights::{LayerWeights, Qwen3Weights, TensorMut};

/// Why a checkpoint could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The checkpoint path is not a directory (a file, or nothing at all).
    #[error(
        "{}: {what}; a checkpoint is a directory (config.json and the safetensors files)",
        dir.display()
    )]
    NotADirectory {
        /// The path given.
        dir: PathBuf,
        /// What is there instead.
        what: &'static str,
    },
    /// `config.json` is absent.
    #[error("{}: missing config.json", dir.display())]
    MissingConfig {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// `config.json` is invalid.
    #[error("{}: {source}", file.display())]
    Config {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        source: ConfigError,
    },
    /// Neither `model.safetensors` nor `model.safetensors.index.json` exists.
    #[error("{}: no model.safetensors or model.safetensors.index.json", dir.display())]
    MissingWeights {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A file could not be read or written.
    #[error("{}: {source}", file.display())]
    Io {
        /// The file.
        file: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The shard index is malformed.
    #[error("{}: bad index: {why}", file.display())]
    BadIndex {
        /// The index file.
        file: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The file is shorter (or longer) than its header says.
    #[error("{}: its size does not match its header (truncated or extended): {why}", file.display())]
    Truncated {
        /// The file.
        file: PathBuf,
        /// The parser's finding.
        why: String,
    },
    /// The file is not valid safetensors.
    #[error("{}: invalid safetensors: {why}", file.display())]
    BadFile {
        /// The file.
        file: PathBuf,
        /// The parser's finding.
        why: String,
    },
    /// A tensor's header entry is inconsistent (its dtype and shape do not make the bytes its
    /// offsets span, its offsets overlap another tensor's or leave a gap, run past the file,
    /// ...): the parser refuses the whole file without naming it.
    #[error("{}: invalid safetensors header for tensor `{tensor}`: {why}", file.display())]
    BadTensor {
        /// The tensor name (the first offending one, in offset order).
        tensor: String,
        /// The file.
        file: PathBuf,
        /// What is wrong, with the dtype, shape and offsets.
        why: String,
    },
    /// A required tensor is absent.
    #[error("tensor `{tensor}` missing from {}", file.display())]
    MissingTensor {
        /// The tensor name.
        tensor: String,
        /// Where it was looked for (the shard the index names, or the single file).
        file: PathBuf,
    },
    /// A tensor has the wrong shape.
    #[error("tensor `{tensor}` in {}: shape {got:?}, expected {expected:?}", file.display())]
    Shape {
        /// The tensor name.
        tensor: String,
        /// The file.
        file: PathBuf,
        /// What the config implies.
        expected: Vec<usize>,
        /// What the file holds.
        got: Vec<usize>,
    },
    /// A tensor the model does not use (a bias, a layer past `num_hidden_layers`, ...): its
    /// presence means the checkpoint is not the model the config describes.
    #[error(
        "tensor `{tensor}` in {} is not used by a Qwen3 model with this config.json (no biases, {layers} layers)",
        file.display()
    )]
    Unexpected {
        /// The tensor name.
        tensor: String,
        /// The file.
        file: PathBuf,
        /// `num_hidden_layers` of the config.
        layers: usize,
    },
    /// A tensor's dtype is not bf16, f16 or f32.
    #[error("tensor `{tensor}` in {}: dtype {dtype} not supported (BF16, F16, F32)", file.display())]
    Dtype {
        /// The tensor name.
        tensor: String,
        /// The file.
        file: PathBuf,
        /// The dtype named in the file.
        dtype: String,
    },
    /// A weight is NaN or infinite: every output of the model would be too (greedy decoding
    /// then picks token 0 at every step, silently).
    #[error(
        "tensor `{tensor}` in {}: element {index} is {value}; a checkpoint's weights must be finite",
        file.display()
    )]
    NonFinite {
        /// The tensor name.
        tensor: String,
        /// The file.
        file: PathBuf,
        /// The first such element, in the model's row-major order.
        index: usize,
        /// Its value.
        value: f32,
    },
}

/// How projection weights are laid out in the file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightLayout {
    /// HF `[out, in]` (`nn.Linear`): loaded as is.
    #[default]
    OutIn,
    /// `[in, out]` (`y = x @ W`, the reference fixture): transposed once at load.
    InOut,
}

/// Loading options.
#[derive(Clone, Copy, Default)]
pub struct LoadOptions<'a> {
    /// Layout of the projection and LM-head tensors in the files.
    pub layout: WeightLayout,
    /// Progress: `(tensors done, tensors total)`.
    pub progress: Option<Progress<'a>>,
    /// Load only the first this many layers (the returned config says so); the others'
    /// tensors are neither checked nor read.
    pub layers: Option<usize>,
}

impl std::fmt::Debug for LoadOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("layout", &self.layout)
            .field("progress", &self.progress.is_some())
            .field("layers", &self.layers)
            .finish()
    }
}

/// One memory-mapped shard.
struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
}

fn io(file: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        file: file.to_path_buf(),
        source,
    }
}

fn map_file(path: &Path) -> Result<Shard, CheckpointError> {
    let f = std::fs::File::open(path).map_err(io(path))?;
    // A directory opens, then fails to map with "No such device".
    if !f.metadata().map_err(io(path))?.is_file() {
        return Err(CheckpointError::Io {
            file: path.to_path_buf(),
            source: std::io::Error::other("not a regular file"),
        });
    }
    // SAFETY: the mapping is read-only and lives as long as the loader; a checkpoint file
    // modified by another process while it is loaded is outside this loader's contract (the
    // same assumption every mmap-based safetensors loader makes).
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io(path))?;
    Ok(Shard {
        path: path.to_path_buf(),
        map,
    })
}

/// Parses a shard, turning parser errors into errors that name the file (and, for an
/// unsupported dtype string, the tensor).
fn parse(shard: &Shard) -> Result<SafeTensors<'_>, CheckpointError> {
    let file = shard.path.clone();
    SafeTensors::deserialize(&shard.map).map_err(|e| match e {
        SafeTensorError::MetadataIncompleteBuffer => CheckpointError::Truncated {
            file,
            why: match cut_tensor(&shard.map) {
                Some(cut) => cut,
                None => e.to_string(),
            },
        },
        SafeTensorError::HeaderTooSmall | SafeTensorError::InvalidHeaderLength => {
            CheckpointError::Truncated {
                file,
                why: e.to_string(),
            }
        }
        SafeTensorError::InvalidHeaderDeserialization(_) => match unknown_dtype(&shard.map) {
            Some((tensor, dtype)) => CheckpointError::Dtype {
                tensor,
                file,
                dtype,
            },
            None => CheckpointError::BadFile {
                file,
                why: e.to_string(),
            },
        },
        // The header's entries disagree with each other or with the file: the parser says
        // so without naming the tensor (or names it without saying why).
        SafeTensorError::TensorInvalidInfo
        | SafeTensorError::InvalidOffset(_)
        | SafeTensorError::ValidationOverflow
        | SafeTensorError::MisalignedSlice => match bad_entry(&shard.map) {
            Some((tensor, why)) => CheckpointError::BadTensor { tensor, file, why },
            None => CheckpointError::BadFile {
                file,
                why: e.to_string(),
            },
        },
        other => CheckpointError::BadFile {
            file,
            why: other.to_string(),
        },
    })
}

/// The header's tensor entries (`__metadata__` left out) as parsed JSON, with the length of
/// the data section after the header (`None` for a header that does not parse).
fn header_entries(buf: &[u8]) -> Option<(serde_json::Map<String, serde_json::Value>, u64)> {
    let n = usize::try_from(u64::from_le_bytes(buf.get(..8)?.try_into().ok()?)).ok()?;
    let end = 8usize.checked_add(n)?;
    let header: serde_json::Value = serde_json::from_slice(buf.get(8..end)?).ok()?;
    let mut entries = header.as_object()?.clone();
    entries.remove("__metadata__");
    Some((entries, (buf.len() - end) as u64))
}

/// The first tensor, in offset order (the parser's), whose header entry the parser refuses,
/// and why: its offsets do not start where the previous tensor's end, end before they start,
/// or span other than `dtype` × `shape` bytes, or that byte count overflows or is not whole.
fn bad_entry(buf: &[u8]) -> Option<(String, String)> {
    let (entries, data) = header_entries(buf)?;
    // (data_offsets, name, dtype, shape)
    type Entry<'a> = ((u64, u64), &'a str, Dtype, Vec<u64>);
    let mut infos: Vec<Entry<'_>> = entries
        .iter()
        .filter_map(|(name, v)| {
            let o = v.get("data_offsets")?.as_array()?;
            let offsets = (o.first()?.as_u64()?, o.get(1)?.as_u64()?);
            let dtype: Dtype = serde_json::from_value(v.get("dtype")?.clone()).ok()?;
            let shape = v
                .get("shape")?
                .as_array()?
                .iter()
                .map(serde_json::Value::as_u64)
                .collect::<Option<Vec<u64>>>()?;
            Some((offsets, name.as_str(), dtype, shape))
        })
        .collect();
    infos.sort_by_key(|i| i.0);
    let mut start = 0u64;
    for ((s, e), name, dtype, shape) in infos {
        let entry = format!("dtype {dtype}, shape {shape:?}, data_offsets [{s}, {e}]");
        let why = if s != start {
            Some(format!(
                "{entry}: it must start where the tensor before it ends, at {start} ({})",
                if s < start {
                    "it overlaps that tensor"
                } else {
                    "a gap of unused bytes"
                }
            ))
        } else if e < s {
            Some(format!("{entry}: its end is before its start"))
        } else {
            let bits = shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_mul(dtype.bitsize() as u64));
            match bits {
                None => Some(format!("{entry}: its byte count overflows")),
                Some(b) if b % 8 != 0 => {
                    Some(format!("{entry}: {b} bits is not a whole number of bytes"))
                }
                Some(b) if b / 8 != e - s => Some(format!(
                    "{entry}: the dtype and shape make {} bytes, the offsets span {}{}{}",
                    b / 8,
                    e - s,
                    if e > data {
                        format!(" and run past the end of the file's data section ({data} bytes)")
                    } else {
                        String::new()
                    },
                    if matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
                        String::new()
                    } else {
                        format!(" (and {dtype} is not a dtype this loader reads: BF16, F16, F32)")
                    },
                )),
                Some(_) => None,
            }
        };
        if let Some(why) = why {
            return Some((name.to_string(), why));
        }
        start = e;
    }
    None
}

/// Which tensor a file whose data section is shorter or longer than its header says cuts
/// (the first, in file order, whose bytes run past the end), or the surplus: the parser says
/// only that the file is "not fully covered".
fn cut_tensor(buf: &[u8]) -> Option<String> {
    let (entries, data) = header_entries(buf)?;
    let mut spans: Vec<(u64, u64, &str)> = entries
        .iter()
        .filter_map(|(name, v)| {
            let o = v.get("data_offsets")?.as_array()?;
            Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?, name.as_str()))
        })
        .collect();
    spans.sort_unstable();
    let end = spans.iter().map(|s| s.1).max().unwrap_or(0);
    Some(match spans.iter().find(|s| s.1 > data) {
        Some(&(start, stop, name)) => format!(
            "tensor {name} needs bytes {start}..{stop} of the data section, which holds {data} \
             ({} bytes missing from the file's end)",
            end - data
        ),
        None => format!(
            "the data section holds {data} bytes, its tensors end at {end}: {} bytes past them",
            data - end
        ),
    })
}

/// The first tensor whose header dtype string is none the parser knows.
fn unknown_dtype(buf: &[u8]) -> Option<(String, String)> {
    let (entries, _) = header_entries(buf)?;
    entries.iter().find_map(|(name, v)| {
        let d = v.get("dtype")?;
        serde_json::from_value::<Dtype>(d.clone())
            .is_err()
            .then(|| {
                (
                    name.clone(),
                    d.as_str().map_or_else(|| d.to_string(), str::to_string),
                )
            })
    })
}

/// Where each tensor lives.
struct Source<'a> {
    /// tensor name -> (shard index, parsed shard)
    index: HashMap<String, usize>,
    shards: Vec<(PathBuf, SafeTensors<'a>)>,
    /// The file a missing tensor is reported against.
    default_file: PathBuf,
    /// Shard file named by the index for tensors absent from their shard.
    named: HashMap<String, PathBuf>,
}

impl<'a> Source<'a> {
    fn get(&self, name: &str) -> Result<(&Path, TensorView<'a>), CheckpointError> {
        let missing = || CheckpointError::MissingTensor {
            tensor: name.to_string(),
            file: self
                .named
                .get(name)
                .cloned()
                .unwrap_or_else(|| self.default_file.clone()),
        };
        let &i = self.index.get(name).ok_or_else(missing)?;
        let (path, st) = &self.shards[i];
        let view = st.tensor(name).map_err(|_| missing())?;
        Ok((path, view))
    }
}

/// Reads and validates a checkpoint directory's `config.json` (nothing else is opened).
pub fn load_config(dir: &Path) -> Result<Qwen3Config, CheckpointError> {
    // A file given for the directory would read as one without a config.json.
    let what = match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => None,
        Ok(m) if m.is_file() => Some("is a file, not a directory"),
        Ok(_) => Some("is not a directory"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some("does not exist"),
        Err(e) => return Err(io(dir)(e)),
    };
    if let Some(what) = what {
        return Err(CheckpointError::NotADirectory {
            dir: dir.to_path_buf(),
            what,
        });
    }
    let config_path = dir.join("config.json");
    if !config_path.exists() {
        return Err(CheckpointError::MissingConfig {
            dir: dir.to_path_buf(),
        });
    }
    let text = std::fs::read_to_string(&config_path).map_err(io(&config_path))?;
    Qwen3Config::from_json(&text).map_err(|source| CheckpointError::Config {
        file: config_path,
        source,
    })
}

/// A parsed `generation_config.json` and its path (for errors).
type GenerationConfig = (PathBuf, serde_json::Map<String, serde_json::Value>);

/// `generation_config.json` of a checkpoint directory, parsed, with its path (for errors);
/// `None` without the file. A file that is not a JSON object is refused.
fn generation_config(dir: &Path) -> Result<Option<GenerationConfig>, CheckpointError> {
    let path = dir.join("generation_config.json");
    if !optional_file(&path)? {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let parse = |why: String| CheckpointError::Config {
        file: path.clone(),
        source: ConfigError::Parse(why),
    };
    match serde_json::from_str(&text).map_err(|e| parse(e.to_string()))? {
        serde_json::Value::Object(map) => Ok(Some((path, map))),
        _ => Err(parse("the file is not a JSON object".into())),
    }
}

/// The end-of-sequence ids of a checkpoint directory: `generation_config.json`'s
/// `eos_token_id` when the file names one (what `transformers`' `generate` stops at), else
/// `config.json`'s (already in `config`).
pub fn eos_token_ids(dir: &Path, config: &Qwen3Config) -> Result<Vec<u32>, CheckpointError> {
    let Some((path, v)) = generation_config(dir)? else {
        return Ok(config.eos_token_ids.clone());
    };
    let bad = |source: ConfigError| CheckpointError::Config {
        file: path.clone(),
        source,
    };
    let ids = super::config::token_ids(v.get("eos_token_id"), "eos_token_id").map_err(bad)?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= config.vocab_size) {
        return Err(bad(ConfigError::Invalid {
            field: "eos_token_id".into(),
            value: id.to_string(),
            why: format!("is outside the vocabulary of {}", config.vocab_size),
        }));
    }
    Ok(if ids.is_empty() {
        config.eos_token_ids.clone()
    } else {
        ids
    })
}

/// Whether an optional file of a checkpoint directory is there: absent is `false`; a link that
/// leads nowhere (an interrupted download into a hub cache, whose files are links) is an error
/// naming it, not a file taken as absent.
fn optional_file(path: &Path) -> Result<bool, CheckpointError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(path)(e)),
        Ok(_) => std::fs::metadata(path).map(|_| true).map_err(io(path)),
    }
}

/// Keys of `generation_config.json` that describe the model rather than a way of generating:
/// they change no token.
const GENERATION_METADATA: &[&str] = &[
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "transformers_version",
    "_from_model_config",
];

/// The defaults `generation_config.json` suggests for generating (`do_sample`, `temperature`,
/// `top_p`, `top_k`, `repetition_penalty`, ...), as `key=value` in key order: what
/// `transformers`' `generate` applies when its caller does not say. simpler's commands and
/// server take their own documented defaults (greedy unless a temperature is given) and say
/// which of these they did not apply, so that none is ignored silently. Empty without the
/// file; a file that is not a JSON object is refused.
pub fn generation_defaults(dir: &Path) -> Result<Vec<String>, CheckpointError> {
    let Some((_, map)) = generation_config(dir)? else {
        return Ok(Vec::new());
    };
    let mut keys: Vec<String> = map
        .iter()
        .filter(|(k, _)| !GENERATION_METADATA.contains(&k.as_str()))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    keys.sort();
    Ok(keys)
}

/// Loads a Qwen3 checkpoint directory, every layer.
pub fn load_checkpoint(
    dir: &Path,
    opts: &LoadOptions<'_>,
) -> Result<Qwen3Weights, CheckpointError> {
    read_checkpoint(dir, opts, |r| {
        let mut w = r.outer()?;
        w.layers = (0..r.config().num_hidden_layers)
            .map(|l| r.layer(l).map(Arc::new))
            .collect::<Result<_, _>>()?;
        Ok(w)
    })
}

/// Opens a Qwen3 checkpoint directory, checks every tensor's header against its config (names,
/// dtypes, shapes, nothing unexpected: an error names the tensor and the file, before anything
/// is read), and hands `f` a reader that reads the tensors on demand from the mapped files:
/// [`CheckpointReader::outer`] and [`CheckpointReader::layer`], so a caller can take the layers
/// one at a time (`ResidentModel::upload_sets`) and never hold them all.
pub fn read_checkpoint<R, E: From<CheckpointError>>(
    dir: &Path,
    opts: &LoadOptions<'_>,
    f: impl FnOnce(&CheckpointReader<'_>) -> Result<R, E>,
) -> Result<R, E> {
    open_checkpoint(dir, opts, f).unwrap_or_else(|e| Err(e.into()))
}

/// [`read_checkpoint`]: the directory's errors outside, `f`'s inside.
fn open_checkpoint<R, E>(
    dir: &Path,
    opts: &LoadOptions<'_>,
    f: impl FnOnce(&CheckpointReader<'_>) -> Result<R, E>,
) -> Result<Result<R, E>, CheckpointError> {
    let mut config = load_config(dir)?;
    let all_layers = config.num_hidden_layers;
    if let Some(n) = opts.layers {
        if n == 0 || n > all_layers {
            return Err(CheckpointError::Config {
                file: dir.join("config.json"),
                source: ConfigError::Invalid {
                    field: "num_hidden_layers".into(),
                    value: all_layers.to_string(),
                    why: format!("{n} layers were asked for"),
                },
            });
        }
        config.num_hidden_layers = n;
    }

    // Which files to map.
    let single = dir.join("model.safetensors");
    let index_path = dir.join("model.safetensors.index.json");
    let (files, named): (Vec<PathBuf>, HashMap<String, PathBuf>) = if index_path.exists() {
        let bad = |why: String| CheckpointError::BadIndex {
            file: index_path.clone(),
            why,
        };
        if single.exists() {
            // Two weight sets: loading either silently could run other weights than the
            // user's tools do.
            return Err(bad(
                "model.safetensors is there too, so which weights to load is ambiguous (transformers takes model.safetensors): remove one".into(),
            ));
        }
        let text = std::fs::read_to_string(&index_path).map_err(io(&index_path))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("no `weight_map` object".into()))?;
        let mut files: Vec<PathBuf> = Vec::new();
        let mut named = HashMap::new();
        for (tensor, f) in map {
            let f = f
                .as_str()
                .ok_or_else(|| bad(format!("`{tensor}` maps to a non-string")))?;
            if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                return Err(bad(format!(
                    "`{tensor}` maps to `{f}`, not a file in the directory"
                )));
            }
            let p = dir.join(f);
            if !files.contains(&p) {
                files.push(p.clone());
            }
            named.insert(tensor.clone(), p);
        }
        (files, named)
    } else if single.exists() {
        (vec![single.clone()], HashMap::new())
    } else {
        return Err(CheckpointError::MissingWeights {
            dir: dir.to_path_buf(),
        });
    };
    let maps: Vec<Shard> = files
        .iter()
        .map(|p| map_file(p))
        .collect::<Result<_, _>>()?;
    let mut shards = Vec::new();
    let mut index = HashMap::new();
    for (i, m) in maps.iter().enumerate() {
        let st = parse(m)?;
        for name in st.names() {
            // With an index, a tensor counts only in the shard the index names.
            if named.get(name).is_none_or(|p| p == &m.path) {
                index.insert(name.to_string(), i);
            }
        }
        shards.push((m.path.clone(), st));
    }
    let default_file = if named.is_empty() { single } else { index_path };
    let src = Source {
        index,
        shards,
        default_file,
        named,
    };
    let expected = expected_tensors(&config, opts.layout);
    check_headers(&config, all_layers, &src, &expected)?;
    Ok(f(&CheckpointReader {
        config,
        src: &src,
        expected,
        progress: opts.progress,
        done: std::cell::Cell::new(0),
    }))
}

/// One tensor the model reads: its name, its shape in the model (`[rows, cols]`, `rows == 1`
/// for vectors) and whether the file holds it transposed.
struct Expected {
    name: String,
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl Expected {
    /// The shape the file must hold.
    fn file_shape(&self) -> Vec<usize> {
        if self.rows == 1 {
            vec![self.cols]
        } else if self.transposed {
            vec![self.cols, self.rows]
        } else {
            vec![self.rows, self.cols]
        }
    }
}

/// Every tensor the config implies, in load order: the layers', the embedding, the final norm
/// and (untied) the LM head. With `tie_word_embeddings` the head is the embedding, as in
/// `transformers`, whatever else the file holds.
fn expected_tensors(c: &Qwen3Config, layout: WeightLayout) -> Vec<Expected> {
    let inout = layout == WeightLayout::InOut;
    let mut out = Vec::new();
    for l in 0..c.num_hidden_layers {
        for (suffix, [rows, cols]) in LayerWeights::shapes(c) {
            out.push(Expected {
                name: format!("model.layers.{l}.{suffix}"),
                rows,
                cols,
                transposed: inout && rows > 1,
            });
        }
    }
    let (h, v) = (c.hidden_size, c.vocab_size);
    out.push(Expected {
        name: "model.embed_tokens.weight".into(),
        rows: v,
        cols: h,
        transposed: false,
    });
    out.push(Expected {
        name: "model.norm.weight".into(),
        rows: 1,
        cols: h,
        transposed: false,
    });
    if !c.tie_word_embeddings {
        out.push(Expected {
            name: "lm_head.weight".into(),
            rows: v,
            cols: h,
            transposed: inout,
        });
    }
    out
}

/// Checks every header against the config before anything is allocated: each expected
/// tensor exists with a supported dtype and the right shape, and the files hold nothing else
/// (a tied checkpoint's `lm_head.weight` is allowed and unused).
fn check_headers(
    c: &Qwen3Config,
    all_layers: usize,
    src: &Source<'_>,
    expected: &[Expected],
) -> Result<(), CheckpointError> {
    for e in expected {
        let (file, view) = src.get(&e.name)?;
        if !matches!(view.dtype(), Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(CheckpointError::Dtype {
                tensor: e.name.clone(),
                file: file.into(),
                dtype: format!("{:?}", view.dtype()),
            });
        }
        let want = e.file_shape();
        if view.shape() != want.as_slice() {
            return Err(CheckpointError::Shape {
                tensor: e.name.clone(),
                file: file.into(),
                expected: want,
                got: view.shape().to_vec(),
            });
        }
    }
    let names: std::collections::HashSet<&str> = expected.iter().map(|e| e.name.as_str()).collect();
    let mut present: Vec<&String> = src.index.keys().collect();
    present.sort();
    for name in present {
        let tied_head = c.tie_word_embeddings && name == "lm_head.weight";
        // A layer the config has but this load skips: named like one the model reads.
        let skipped = (c.num_hidden_layers..all_layers).any(|l| {
            name.strip_prefix(&format!("model.layers.{l}."))
                .is_some_and(|rest| names.contains(format!("model.layers.0.{rest}").as_str()))
        });
        if !names.contains(name.as_str()) && !tied_head && !skipped {
            let (file, _) = src.get(name)?;
            return Err(CheckpointError::Unexpected {
                tensor: name.clone(),
                file: file.into(),
                layers: all_layers,
            });
        }
    }
    Ok(())
}

/// A checkpoint whose headers [`read_checkpoint`] checked, read a tensor at a time.
pub struct CheckpointReader<'a> {
    config: Qwen3Config,
    src: &'a Source<'a>,
    /// Every tensor the model reads: each layer's in `LayerWeights::shapes` order, then the
    /// embedding, final norm and (untied) LM head.
    expected: Vec<Expected>,
    progress: Option<Progress<'a>>,
    done: std::cell::Cell<u64>,
}

impl CheckpointReader<'_> {
    /// The model's config (with `LoadOptions::layers` applied).
    pub fn config(&self) -> &Qwen3Config {
        &self.config
    }

    /// Reads `self.expected[i]` into `dest`, counting it in the progress.
    fn read(&self, i: usize, dest: TensorMut<'_>) -> Result<(), CheckpointError> {
        let e = &self.expected[i];
        load_into(self.src, &e.name, e.rows, e.cols, e.transposed, dest)?;
        self.done.set(self.done.get() + 1);
        if let Some(p) = self.progress {
            p(self.done.get(), self.expected.len() as u64);
        }
        Ok(())
    }

    /// Layer `l`'s weights (`l` below `config().num_hidden_layers`).
    ///
    /// # Panics
    /// If `l` is not a layer of the config.
    pub fn layer(&self, l: usize) -> Result<LayerWeights, CheckpointError> {
        let c = &self.config;
        assert!(
            l < c.num_hidden_layers,
            "layer {l} of {}",
            c.num_hidden_layers
        );
        let per = LayerWeights::shapes(c).len();
        let mut lw = LayerWeights::zeros(c);
        for (k, dest) in lw.tensors_mut().into_iter().enumerate() {
            self.read(l * per + k, dest)?;
        }
        Ok(lw)
    }

    /// The embedding, final norm and (untied) LM head, with no layers.
    pub fn outer(&self) -> Result<Qwen3Weights, CheckpointError> {
        let c = &self.config;
        let first = c.num_hidden_layers * LayerWeights::shapes(c).len();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let mut embedding = vec![bf16::ZERO; v * h];
        self.read(first, TensorMut::Bf16(&mut embedding))?;
        let mut final_norm = vec![0.0f32; h];
        self.read(first + 1, TensorMut::F32(&mut final_norm))?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            let mut head = vec![bf16::ZERO; v * h];
            self.read(first + 2, TensorMut::Bf16(&mut head))?;
            Some(head)
        };
        Ok(Qwen3Weights {
            config: c.clone(),
            layers: Vec::new(),
            embedding,
            final_norm,
            lm_head,
        })
    }
}

/// Reads tensor `name` (`[rows, cols]` in the model; `[cols, rows]` in the file when
/// `transposed`; 1-D when `rows == 1`) into `dest`, converting the dtype.
fn load_into(
    src: &Source<'_>,
    name: &str,
    rows: usize,
    cols: usize,
    transposed: bool,
    dest: TensorMut<'_>,
) -> Result<(), CheckpointError> {
    let (file, view) = src.get(name)?;
    let expected: Vec<usize> = if rows == 1 {
        vec![cols]
    } else if transposed {
        vec![cols, rows]
    } else {
        vec![rows, cols]
    };
    if view.shape() != expected.as_slice() {
        return Err(CheckpointError::Shape {
            tensor: name.into(),
            file: file.into(),
            expected,
            got: view.shape().to_vec(),
        });
    }
    let data = view.data();
    let value = |i: usize| -> f32 {
        match view.dtype() {
            Dtype::BF16 => {
                bf16::from_bits(u16::from_le_bytes([data[2 * i], data[2 * i + 1]])).to_f32()
            }
            Dtype::F16 => {
                f16::from_bits(u16::from_le_bytes([data[2 * i], data[2 * i + 1]])).to_f32()
            }
            _ => f32::from_le_bytes([
                data[4 * i],
                data[4 * i + 1],
                data[4 * i + 2],
                data[4 * i + 3],
            ]),
        }
    };
    match view.dtype() {
        Dtype::BF16 | Dtype::F16 | Dtype::F32 => {}
        d => {
            return Err(CheckpointError::Dtype {
                tensor: name.into(),
                file: file.into(),
                dtype: format!("{d:?}"),
            });
        }
    }
    // Element (r, k) of the model tensor sits at file index r*cols+k, or k*rows+r transposed.
    let at = |r: usize, k: usize| {
        if transposed {
            k * rows + r
        } else {
            r * cols + k
        }
    };
    let non_finite = match dest {
        TensorMut::Bf16(d) => {
            let raw_bf16 = view.dtype() == Dtype::BF16;
            for r in 0..rows {
                for k in 0..cols {
                    let i = at(r, k);
                    d[r * cols + k] = if raw_bf16 {
                        bf16::from_bits(u16::from_le_bytes([data[2 * i], data[2 * i + 1]]))
                    } else {
                        bf16::from_f32(value(i))
                    };
                }
            }
            d.iter()
                .position(|v| !v.is_finite())
                .map(|i| (i, d[i].to_f32()))
        }
        TensorMut::F32(d) => {
            for (i, v) in d.iter_mut().enumerate() {
                *v = value(i);
            }
            d.iter().position(|v| !v.is_finite()).map(|i| (i, d[i]))
        }
    };
    if let Some((index, value)) = non_finite {
        return Err(CheckpointError::NonFinite {
            tensor: name.into(),
            file: file.into(),
            index,
            value,
        });
    }
    Ok(())
}

/// Saving options.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SaveOptions {
    /// Layout to write projections (and an untied LM head) in.
    pub layout: WeightLayout,
    /// Split into shards of about this many bytes with a `model.safetensors.index.json`
    /// (`None`: one `model.safetensors`).
    pub max_shard_bytes: Option<usize>,
    /// Write norm weights as bf16 instead of fp32 (as many real checkpoints do).
    pub norms_bf16: bool,
}

/// Writes `weights` to `dir` in HF naming: `config.json` and `model.safetensors` (or shards and
/// an index). Every layer is written, also in shared-weights mode.
pub fn save_checkpoint(
    dir: &Path,
    weights: &Qwen3Weights,
    opts: &SaveOptions,
) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let c = &weights.config;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, c.to_json()).map_err(io(&config_path))?;
    // (name, dtype, shape, bytes)
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let bf16_bytes =
        |x: &[bf16], rows: usize, cols: usize, transpose: bool| -> (Vec<usize>, Vec<u8>) {
            let mut out = Vec::with_capacity(x.len() * 2);
            if transpose {
                for k in 0..cols {
                    for r in 0..rows {
                        out.extend_from_slice(&x[r * cols + k].to_bits().to_le_bytes());
                    }
                }
                (vec![cols, rows], out)
            } else {
                x.iter()
                    .for_each(|v| out.extend_from_slice(&v.to_bits().to_le_bytes()));
                (vec![rows, cols], out)
            }
        };
    let norm = |x: &[f32]| -> (Dtype, Vec<u8>) {
        if opts.norms_bf16 {
            (
                Dtype::BF16,
                x.iter()
                    .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
                    .collect(),
            )
        } else {
            (Dtype::F32, x.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    };
    let inout = opts.layout == WeightLayout::InOut;
    for (l, layer) in weights.layers.iter().enumerate() {
        for ((suffix, [rows, cols]), t) in LayerWeights::shapes(c).iter().zip(layer.tensors()) {
            let name = format!("model.layers.{l}.{suffix}");
            match t {
                super::weights::Tensor::Bf16(x) => {
                    let (shape, bytes) = bf16_bytes(x, *rows, *cols, inout);
                    tensors.push((name, Dtype::BF16, shape, bytes));
                }
                super::weights::Tensor::F32(x) => {
                    let (d, bytes) = norm(x);
                    tensors.push((name, d, vec![x.len()], bytes));
                }
            }
        }
    }
    let (h, v) = (c.hidden_size, c.vocab_size);
    let (shape, bytes) = bf16_bytes(&weights.embedding, v, h, false);
    tensors.push((
        "model.embed_tokens.weight".into(),
        Dtype::BF16,
        shape,
        bytes,
    ));
    let (d, bytes) = norm(&weights.final_norm);
    tensors.push(("model.norm.weight".into(), d, vec![h], bytes));
    if let Some(head) = &weights.lm_head {
        let (shape, bytes) = bf16_bytes(head, v, h, inout);
        tensors.push(("lm_head.weight".into(), Dtype::BF16, shape, bytes));
    }
    // Group into shards.
    let limit = opts.max_shard_bytes.unwrap_or(usize::MAX).max(1);
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0usize;
    for (i, t) in tensors.iter().enumerate() {
        if size > 0 && size + t.3.len() > limit {
            groups.push(Vec::new());
            size = 0;
        }
        size += t.3.len();
        if let Some(g) = groups.last_mut() {
            g.push(i);
        }
    }
    let n = groups.len();
    let mut weight_map = BTreeMap::new();
    for (gi, g) in groups.iter().enumerate() {
        let fname = if opts.max_shard_bytes.is_none() {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", gi + 1)
        };
        let path = dir.join(&fname);
        let mut views = Vec::new();
        for &i in g {
            let (name, dtype, shape, bytes) = &tensors[i];
            let view = TensorView::new(*dtype, shape.clone(), bytes).map_err(|e| {
                CheckpointError::BadFile {
                    file: path.clone(),
                    why: format!("{name}: {e}"),
                }
            })?;
            views.push((name.clone(), view));
            weight_map.insert(name.clone(), fname.clone());
        }
        safetensors::serialize_to_file(views, None, &path).map_err(|e| match e {
            SafeTensorError::IoError(source) => CheckpointError::Io {
                file: path.clone(),
                source,
            },
            other => CheckpointError::BadFile {
                file: path.clone(),
                why: other.to_string(),
            },
        })?;
    }
    if opts.max_shard_bytes.is_some() {
        let total: usize = tensors.iter().map(|t| t.3.len()).sum();
        let index =
            serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let path = dir.join("model.safetensors.index.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&index).unwrap_or_default(),
        )
        .map_err(io(&path))?;
    }
    Ok(())
}
