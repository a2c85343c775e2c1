//! What a Qwen3 run holds in memory, item by item, computed from the configuration alone so a
//! command can refuse a run that cannot fit before it allocates or generates anything.
//!
//! The figures follow what the commands do: weights are generated or loaded on the host, then
//! copied into worker buffers (a loaded checkpoint is whole on the host at the peak; a
//! preset's layers are generated and copied one weight set at a time, `stream_layers`; the
//! host drops the embedding and LM head after the copy, so both copies of those exist at the
//! peak); the KV cache
//! lives in worker buffers and is filled one layer's pools at a time from the host. Every
//! product is checked: a shape whose byte count overflows is an error, not a wrapped number.

use super::config::Qwen3Config;
use super::quant::WeightFormat;

/// The shape of a run, as far as memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunShape {
    /// Layers run (the config's, or fewer with `--layers`).
    pub layers: usize,
    /// Every layer uses one weight set.
    pub shared_weights: bool,
    /// KV slots per layer (pages × page size).
    pub kv_slots: usize,
    /// Positions the RoPE tables cover.
    pub max_seq: usize,
    /// Most tokens one step processes (decode batch, or a prefill chunk).
    pub step_tokens: usize,
    /// How the worker holds the projections and the LM head (the host's copy is bf16 either
    /// way: it is what gets quantised).
    pub weights: WeightFormat,
    /// The layers' weight sets reach the worker one at a time
    /// (`ResidentModel::upload_sets`): the host holds one besides the embedding and LM head,
    /// not all of them.
    pub stream_layers: bool,
}

/// One item of an estimate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryItem {
    /// What it is.
    pub what: &'static str,
    /// Bytes.
    pub bytes: u64,
}

/// The memory a run needs at its peak.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// The items, largest concerns first.
    pub items: Vec<MemoryItem>,
}

/// A shape whose byte counts overflow `u64`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the memory of this run overflows 64 bits ({0})")]
pub struct MemoryOverflow(pub &'static str);

fn mul(what: &'static str, xs: &[usize]) -> Result<u64, MemoryOverflow> {
    xs.iter().try_fold(1u64, |acc, &x| {
        acc.checked_mul(x as u64).ok_or(MemoryOverflow(what))
    })
}

impl MemoryEstimate {
    /// The estimate for `c` run as `shape`.
    pub fn of(c: &Qwen3Config, shape: &RunShape) -> Result<MemoryEstimate, MemoryOverflow> {
        let (h, v) = (c.hidden_size, c.vocab_size);
        let q = c.num_attention_heads * c.head_dim;
        let kv = c.num_key_value_heads * c.head_dim;
        let i = c.intermediate_size;
        let sets = if shared_weights(shape) {
            1
        } else {
            shape.layers
        };
        // One layer's bytes with its projections held as `format`.
        let layer = |format: WeightFormat| -> Result<u64, MemoryOverflow> {
            let m = |what: &'static str, rows: usize, cols: usize, n: usize| {
                // Bounds both formats' products (`2 · cols` and `cols + 4` bytes a row).
                mul(what, &[rows, cols.saturating_add(4), 2]).and_then(|_| {
                    (format.matrix_bytes(rows, cols) as u64)
                        .checked_mul(n as u64)
                        .ok_or(MemoryOverflow(what))
                })
            };
            [
                m("q_proj", q, h, 1)?,
                m("k/v_proj", kv, h, 2)?,
                m("o_proj", h, q, 1)?,
                m("mlp gate/up", i, h, 2)?,
                m("mlp down", h, i, 1)?,
                mul("norms", &[2 * h + 2 * c.head_dim, 4])?,
            ]
            .iter()
            .try_fold(0u64, |a, &b| a.checked_add(b))
            .ok_or(MemoryOverflow("layer"))
        };
        // Every layer and the tables, the projections and the LM head as `format`: the
        // embedding stays bf16 (a gather reads one row a token), and an int8 LM head is a copy
        // of its own even where it is tied to the embedding.
        let all = |format: WeightFormat| -> Result<u64, MemoryOverflow> {
            let layers = layer(format)?
                .checked_mul(sets as u64)
                .ok_or(MemoryOverflow("layers"))?;
            let table = mul("embedding", &[v, h, 2])?;
            let head = match format {
                WeightFormat::Bf16 if c.tie_word_embeddings => 0,
                _ => mul("lm_head", &[v, h.saturating_add(4), 2])
                    .map(|_| format.matrix_bytes(v, h) as u64)?,
            };
            layers
                .checked_add(table)
                .and_then(|x| x.checked_add(head))
                .and_then(|x| x.checked_add(4 * h as u64))
                .ok_or(MemoryOverflow("weights"))
        };
        let host_weights = if shape.stream_layers {
            let all_sets = layer(WeightFormat::Bf16)?
                .checked_mul(sets as u64)
                .ok_or(MemoryOverflow("layers"))?;
            all(WeightFormat::Bf16)? - all_sets + layer(WeightFormat::Bf16)?
        } else {
            all(WeightFormat::Bf16)?
        };
        let resident_weights = all(shape.weights)?;
        let rope = mul("RoPE tables", &[shape.max_seq, c.head_dim, 8])?;
        let kv_cache = mul("KV cache", &[shape.layers, shape.kv_slots, kv, 4])?;
        let host_pool = mul("KV pools", &[shape.kv_slots, kv, 4])?;
        // Per token of a step: fp32 residual, norms and projections, the MLP's three rows, the
        // logits, with room for the runtime's packed copies.
        let per_token = mul("activations", &[8 * h + 2 * q + 2 * kv + 3 * i + v, 4])?;
        let activations = per_token
            .checked_mul(shape.step_tokens.max(1) as u64)
            .ok_or(MemoryOverflow("activations"))?;
        Ok(MemoryEstimate {
            items: vec![
                MemoryItem {
                    what: if shape.stream_layers {
                        "weights on the host (the embedding and LM head, and one layer's weight set at a time)"
                    } else {
                        "weights on the host (generated or loaded, every layer)"
                    },
                    bytes: host_weights,
                },
                MemoryItem {
                    what: "weights resident in worker buffers",
                    bytes: resident_weights.saturating_add(rope),
                },
                MemoryItem {
                    what: "KV cache",
                    bytes: kv_cache,
                },
                MemoryItem {
                    what: "one layer's KV pools on the host while filling or checking",
                    bytes: host_pool,
                },
                MemoryItem {
                    what: "step activations",
                    bytes: activations,
                },
            ],
        })
    }

    /// The sum of the items.
    pub fn total(&self) -> u64 {
        self.items
            .iter()
            .fold(0u64, |a, i| a.saturating_add(i.bytes))
    }

    /// The items, each in GB (MB or kB where smaller, so a small item does not read 0.00 GB).
    pub fn describe(&self) -> String {
        self.items
            .iter()
            .map(|i| format!("{} {}", decimal_bytes(i.bytes), i.what))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `bytes` in GB, MB or kB (decimal, as the rest of the estimate's figures), two decimals.
pub fn decimal_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else {
        format!("{:.2} kB", b / 1e3)
    }
}

fn shared_weights(shape: &RunShape) -> bool {
    shape.shared_weights || shape.layers <= 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_14b_preset_needs_two_copies_of_its_weights_and_shared_weights_one_layer() {
        let c = Qwen3Config::preset("qwen3-14b").unwrap();
        let shape = RunShape {
            layers: 40,
            shared_weights: false,
            kv_slots: 384,
            max_seq: 384,
            step_tokens: 1,
            weights: WeightFormat::Bf16,
            stream_layers: false,
        };
        let e = MemoryEstimate::of(&c, &shape).unwrap();
        // 40 layers of ~0.66 GB plus two 1.56 GB tables, twice.
        let weights = c.num_hidden_layers * c.layer_weight_bytes() + 2 * 2 * 151_936 * 5120;
        assert!((e.items[0].bytes as f64 / weights as f64 - 1.0).abs() < 1e-3);
        assert!(e.total() > 2 * weights as u64);
        let shared = MemoryEstimate::of(
            &c,
            &RunShape {
                shared_weights: true,
                ..shape
            },
        )
        .unwrap();
        assert!(shared.total() < 10_000_000_000, "{}", shared.describe());
        // KV: 40 layers x 384 slots x 1024 wide x K and V x bf16.
        assert_eq!(e.items[2].bytes, 40 * 384 * 1024 * 4);
        // Streamed layers: the host holds the tables and one layer, so the int8 model (15.6
        // GB resident) fits where its bf16 host copy (29.5 GB) would not.
        let streamed = MemoryEstimate::of(
            &c,
            &RunShape {
                stream_layers: true,
                weights: WeightFormat::Int8(Default::default()),
                ..shape
            },
        )
        .unwrap();
        let tables = 2 * 2 * 151_936 * 5120 + 4 * 5120;
        assert_eq!(
            streamed.items[0].bytes,
            (tables + c.layer_weight_bytes()) as u64,
            "{}",
            streamed.describe()
        );
        assert!(streamed.total() < 20_000_000_000, "{}", streamed.describe());
    }

    #[test]
    fn overflowing_shapes_are_errors() {
        let c = Qwen3Config::preset("tiny").unwrap();
        let shape = RunShape {
            layers: 2,
            shared_weights: false,
            kv_slots: usize::MAX / 2,
            max_seq: 128,
            step_tokens: 1,
            weights: WeightFormat::Bf16,
            stream_layers: false,
        };
        assert!(MemoryEstimate::of(&c, &shape).is_err());
    }

    /// int8 projections take a record of `cols + 4` bytes a row where bf16 takes `2 · cols`;
    /// the host copy stays bf16, and a tied LM head gets an int8 copy of its own.
    #[test]
    fn int8_weights_are_counted_as_they_are_held() {
        let c = Qwen3Config::preset("qwen3-0.6b").unwrap();
        assert!(c.tie_word_embeddings);
        let bf16 = RunShape {
            layers: c.num_hidden_layers,
            shared_weights: false,
            kv_slots: 1024,
            max_seq: 1024,
            step_tokens: 1,
            weights: WeightFormat::Bf16,
            stream_layers: false,
        };
        let int8 = RunShape {
            weights: WeightFormat::Int8(Default::default()),
            ..bf16
        };
        let (b, q) = (
            MemoryEstimate::of(&c, &bf16).unwrap(),
            MemoryEstimate::of(&c, &int8).unwrap(),
        );
        assert_eq!(b.items[0], q.items[0], "the host copy is bf16 either way");
        let (h, v, i) = (c.hidden_size, c.vocab_size, c.intermediate_size);
        let (qw, kv) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let per_layer = |bytes: &dyn Fn(usize, usize) -> usize| {
            bytes(qw, h) + 2 * bytes(kv, h) + bytes(h, qw) + 2 * bytes(i, h) + bytes(h, i)
        };
        let saved =
            c.num_hidden_layers * (per_layer(&|r, k| 2 * r * k) - per_layer(&|r, k| r * (k + 4)));
        // Fewer bytes for the layers, and the tied head's int8 copy on top.
        let head = v * (h + 4);
        assert_eq!(
            b.items[1].bytes as i64 - q.items[1].bytes as i64,
            saved as i64 - head as i64
        );
    }
}
