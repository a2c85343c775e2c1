//! Deterministic seeded fixtures with the spec's distributions (`docs/qwen3.md`, "Fixtures"):
//! weights, the initial KV pools, the input hidden state and token ids.
//!
//! Every tensor is cut into fixed chunks, each drawn from its own stream `(seed, tensor, chunk)`,
//! so the result does not depend on the number of threads that generate it. Generation runs on
//! up to `available_parallelism` std threads and reports progress through a callback.
//! Weights are drawn directly in the `[out, in]` layout (the distributions are i.i.d., so the
//! reference fixture's `[in, out]` tensors need no transpose here).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use half::bf16;

use super::config::Qwen3Config;
use super::rope::RopeTables;
use super::weights::{KvCache, LayerWeights, PAGE_SIZE, PagedBatch, Qwen3Weights, TensorMut};
use crate::rng::Rng;

/// Progress callback: `(elements done, elements total)`; called from generator threads.
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Sync);

/// `(mean, std)` of each tensor's normal distribution.
pub mod dist {
    /// Input hidden state.
    pub const HIDDEN: (f32, f32) = (0.0, 1.0);
    /// `input_layernorm`, `post_attention_layernorm`, final norm.
    pub const NORM: (f32, f32) = (1.0, 0.1);
    /// `q_proj`, `k_proj`, `v_proj`.
    pub const QKV: (f32, f32) = (0.0, 0.02);
    /// `q_norm`, `k_norm`.
    pub const QK_NORM: (f32, f32) = (1.0, 0.1);
    /// Initial K cache.
    pub const K_CACHE: (f32, f32) = (0.0, 0.01);
    /// Initial V cache.
    pub const V_CACHE: (f32, f32) = (0.3, 0.02);
    /// `o_proj`.
    pub const WO: (f32, f32) = (0.0, 0.0006);
    /// `gate_proj`, `up_proj`.
    pub const GATE_UP: (f32, f32) = (0.0, 0.02);
    /// `down_proj`.
    pub const DOWN: (f32, f32) = (0.0, 0.0004);
    /// Embedding table (rows are the input hidden states of the full model).
    pub const EMBEDDING: (f32, f32) = (0.0, 1.0);
    /// Untied LM head.
    pub const LM_HEAD: (f32, f32) = (0.0, 0.02);
}

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct FixtureOptions {
    /// Seed of every stream.
    pub seed: u64,
    /// Sequences.
    pub batch: usize,
    /// Longest sequence the block tables cover.
    pub max_seq: usize,
    /// Every sequence's length, the current token included.
    pub seq_len: usize,
    /// One weight set shared by every layer (each layer still has its own KV pool).
    pub shared_weights: bool,
    /// Fill the KV pools with the spec's distributions (else zeros).
    pub fill_kv: bool,
    /// Generate layer 0's pool once and copy it to every layer (the reference fixture's
    /// replication; much faster for 40 layers).
    pub replicate_kv: bool,
    /// Override of the config's RoPE θ (the reference fixture uses 1e4).
    pub rope_theta: Option<f64>,
}

impl FixtureOptions {
    /// The reference stress case: batch 16, max_seq 5500, seq_len 3500, seed 1234, θ 1e4,
    /// shared weights, KV replicated across layers.
    pub fn reference() -> FixtureOptions {
        FixtureOptions {
            seed: 1234,
            batch: 16,
            max_seq: 5500,
            seq_len: 3500,
            shared_weights: true,
            fill_kv: true,
            replicate_kv: true,
            rope_theta: Some(1e4),
        }
    }

    /// A small case for tests: `batch` sequences of `seq_len` tokens, distinct weights.
    pub fn small(batch: usize, seq_len: usize) -> FixtureOptions {
        FixtureOptions {
            seed: 1234,
            batch,
            max_seq: seq_len.max(1).div_ceil(PAGE_SIZE) * PAGE_SIZE,
            seq_len,
            shared_weights: false,
            fill_kv: true,
            replicate_kv: false,
            rope_theta: None,
        }
    }
}

/// A generated decode case.
#[derive(Clone, Debug)]
pub struct Fixture {
    /// Model weights.
    pub weights: Qwen3Weights,
    /// KV cache of every layer.
    pub kv: KvCache,
    /// Block tables and lengths.
    pub batch: PagedBatch,
    /// Input hidden state `[batch, hidden]` bf16 (for the layers-chunk variant).
    pub hidden: Vec<bf16>,
    /// Input token ids `[batch]` (for the full model).
    pub tokens: Vec<u32>,
    /// RoPE tables covering `max_seq`.
    pub rope: RopeTables,
}

/// Stream ids of the tensors (so every tensor draws from its own streams).
const STREAM_EMBEDDING: u64 = 1;
const STREAM_FINAL_NORM: u64 = 2;
const STREAM_LM_HEAD: u64 = 3;
const STREAM_HIDDEN: u64 = 4;
const STREAM_TOKENS: u64 = 5;
const STREAM_LAYER0: u64 = 1 << 20;
const STREAM_KV0: u64 = 1 << 30;
/// Elements per chunk.
const CHUNK: usize = 1 << 18;

enum Dest<'a> {
    Bf16(&'a mut [bf16]),
    F32(&'a mut [f32]),
}

/// A chunk to fill: destination, distribution, stream.
struct Job<'a> {
    dest: Dest<'a>,
    dist: (f32, f32),
    stream: u64,
}

/// Splits a tensor into chunk jobs.
fn jobs<'a>(out: &mut Vec<Job<'a>>, dest: TensorMut<'a>, dist: (f32, f32), tensor_stream: u64) {
    // Chunk index in the low 20 bits keeps streams of different tensors apart.
    let stream = |i: usize| (tensor_stream << 20) ^ i as u64;
    match dest {
        TensorMut::Bf16(s) => {
            for (i, c) in s.chunks_mut(CHUNK).enumerate() {
                out.push(Job {
                    dest: Dest::Bf16(c),
                    dist,
                    stream: stream(i),
                });
            }
        }
        TensorMut::F32(s) => {
            for (i, c) in s.chunks_mut(CHUNK).enumerate() {
                out.push(Job {
                    dest: Dest::F32(c),
                    dist,
                    stream: stream(i),
                });
            }
        }
    }
}

/// Fills every job on up to `available_parallelism` threads.
fn run_jobs(seed: u64, jobs: Vec<Job<'_>>, progress: Option<Progress<'_>>) {
    let total: u64 = jobs
        .iter()
        .map(|j| match &j.dest {
            Dest::Bf16(s) => s.len() as u64,
            Dest::F32(s) => s.len() as u64,
        })
        .sum();
    let done = AtomicU64::new(0);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len())
        .max(1);
    let queue = Mutex::new(jobs.into_iter());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let job = match queue.lock() {
                        Ok(mut q) => q.next(),
                        Err(_) => None,
                    };
                    let Some(job) = job else { break };
                    let mut rng = Rng::new(seed, job.stream);
                    let (mean, std) = job.dist;
                    let n = match job.dest {
                        Dest::Bf16(d) => {
                            let mut buf = [0.0f32; 1024];
                            for c in d.chunks_mut(buf.len()) {
                                rng.fill_normal(&mut buf[..c.len()], mean, std);
                                for (o, &v) in c.iter_mut().zip(&buf) {
                                    *o = bf16::from_f32(v);
                                }
                            }
                            d.len()
                        }
                        Dest::F32(d) => {
                            rng.fill_normal(d, mean, std);
                            d.len()
                        }
                    };
                    let now = done.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
                    if let Some(p) = progress {
                        p(now, total);
                    }
                }
            });
        }
    });
}

fn layer_jobs<'a>(out: &mut Vec<Job<'a>>, layer: &'a mut LayerWeights, stream: u64) {
    let dists = [
        dist::QKV,
        dist::QKV,
        dist::QKV,
        dist::WO,
        dist::GATE_UP,
        dist::GATE_UP,
        dist::DOWN,
    ];
    let norm_dists = [dist::QK_NORM, dist::QK_NORM, dist::NORM, dist::NORM];
    for (i, (t, d)) in layer
        .tensors_mut()
        .into_iter()
        .zip(dists.iter().chain(&norm_dists))
        .enumerate()
    {
        jobs(out, t, *d, stream + i as u64);
    }
}

/// Generates a model's weights (the config's θ is kept; see [`FixtureOptions::rope_theta`]).
pub fn generate_weights(
    config: &Qwen3Config,
    seed: u64,
    shared: bool,
    progress: Option<Progress<'_>>,
) -> Qwen3Weights {
    let c = config;
    let n_sets = if shared { 1 } else { c.num_hidden_layers };
    let mut sets: Vec<LayerWeights> = (0..n_sets).map(|_| LayerWeights::zeros(c)).collect();
    let mut outer = Outer::zeros(c);
    let mut all = Vec::new();
    for (l, set) in sets.iter_mut().enumerate() {
        layer_jobs(&mut all, set, layer_stream(l));
    }
    outer.jobs(&mut all);
    run_jobs(seed, all, progress);
    let layers = if shared {
        let one = Arc::new(sets.pop().unwrap_or_else(|| LayerWeights::zeros(c)));
        vec![one; c.num_hidden_layers]
    } else {
        sets.into_iter().map(Arc::new).collect()
    };
    outer.into_weights(c, layers)
}

/// The weights [`generate_weights`] makes for everything but the layers (embedding, final
/// norm, untied LM head), with no layers: what a caller that generates the layers one at a
/// time ([`generate_layer`]) uploads first, so a model never has every layer on the host.
pub fn generate_outer_weights(
    config: &Qwen3Config,
    seed: u64,
    progress: Option<Progress<'_>>,
) -> Qwen3Weights {
    let mut outer = Outer::zeros(config);
    let mut all = Vec::new();
    outer.jobs(&mut all);
    run_jobs(seed, all, progress);
    outer.into_weights(config, Vec::new())
}

/// Weight set `set` as [`generate_weights`] makes it (`set` 0 is also the shared set), bit for
/// bit: each set is drawn from streams of its own.
pub fn generate_layer(config: &Qwen3Config, seed: u64, set: usize) -> LayerWeights {
    let mut layer = LayerWeights::zeros(config);
    let mut all = Vec::new();
    layer_jobs(&mut all, &mut layer, layer_stream(set));
    run_jobs(seed, all, None);
    layer
}

/// The first random stream of weight set `set`.
fn layer_stream(set: usize) -> u64 {
    STREAM_LAYER0 + 16 * set as u64
}

/// The tensors of a model outside its layers, while they are generated.
struct Outer {
    embedding: Vec<bf16>,
    final_norm: Vec<f32>,
    lm_head: Option<Vec<bf16>>,
}

impl Outer {
    fn zeros(c: &Qwen3Config) -> Outer {
        let emb_len = c.vocab_size * c.hidden_size;
        Outer {
            embedding: vec![bf16::ZERO; emb_len],
            final_norm: vec![0.0f32; c.hidden_size],
            lm_head: (!c.tie_word_embeddings).then(|| vec![bf16::ZERO; emb_len]),
        }
    }

    fn jobs<'a>(&'a mut self, all: &mut Vec<Job<'a>>) {
        jobs(
            all,
            TensorMut::Bf16(&mut self.embedding),
            dist::EMBEDDING,
            STREAM_EMBEDDING,
        );
        jobs(
            all,
            TensorMut::F32(&mut self.final_norm),
            dist::NORM,
            STREAM_FINAL_NORM,
        );
        if let Some(h) = self.lm_head.as_mut() {
            jobs(all, TensorMut::Bf16(h), dist::LM_HEAD, STREAM_LM_HEAD);
        }
    }

    fn into_weights(self, c: &Qwen3Config, layers: Vec<Arc<LayerWeights>>) -> Qwen3Weights {
        Qwen3Weights {
            config: c.clone(),
            layers,
            embedding: self.embedding,
            final_norm: self.final_norm,
            lm_head: self.lm_head,
        }
    }
}

/// Generates a whole decode case: weights, KV pools, block tables, input hidden state and
/// token ids.
pub fn generate_fixture(
    config: &Qwen3Config,
    opts: &FixtureOptions,
    progress: Option<Progress<'_>>,
) -> Fixture {
    let mut config = config.clone();
    if let Some(theta) = opts.rope_theta {
        config.rope.theta = theta;
    }
    let batch = PagedBatch::identity(vec![opts.seq_len; opts.batch], opts.max_seq, PAGE_SIZE);
    let mut kv = KvCache::zeros(&config, batch.num_pages(), PAGE_SIZE);
    let mut hidden = vec![bf16::ZERO; opts.batch * config.hidden_size];
    let weights_progress = |d: u64, t: u64| {
        if let Some(p) = progress {
            p(d, t);
        }
    };
    let weights = generate_weights(
        &config,
        opts.seed,
        opts.shared_weights,
        Some(&weights_progress),
    );
    let mut all = Vec::new();
    jobs(
        &mut all,
        TensorMut::Bf16(&mut hidden),
        dist::HIDDEN,
        STREAM_HIDDEN,
    );
    if opts.fill_kv {
        let pool = kv.pool_len();
        let gen_layers = if opts.replicate_kv { 1 } else { kv.layers };
        let (k, v) = (&mut kv.k, &mut kv.v);
        for (l, (kp, vp)) in k
            .chunks_mut(pool.max(1))
            .zip(v.chunks_mut(pool.max(1)))
            .take(gen_layers)
            .enumerate()
        {
            jobs(
                &mut all,
                TensorMut::Bf16(kp),
                dist::K_CACHE,
                STREAM_KV0 + 2 * l as u64,
            );
            jobs(
                &mut all,
                TensorMut::Bf16(vp),
                dist::V_CACHE,
                STREAM_KV0 + 2 * l as u64 + 1,
            );
        }
    }
    run_jobs(opts.seed, all, progress);
    if opts.fill_kv && opts.replicate_kv && kv.layers > 1 {
        let pool = kv.pool_len();
        for l in 1..kv.layers {
            kv.k.copy_within(0..pool, l * pool);
            kv.v.copy_within(0..pool, l * pool);
        }
    }
    let mut rng = Rng::new(opts.seed, STREAM_TOKENS << 20);
    let tokens = (0..opts.batch)
        .map(|_| (rng.next_u64() % config.vocab_size as u64) as u32)
        .collect();
    let rope = config.rope_tables(opts.max_seq.max(opts.seq_len));
    Fixture {
        weights,
        kv,
        batch,
        hidden,
        tokens,
        rope,
    }
}

/// The configuration a fixture runs with (the options' RoPE θ override applied).
pub fn fixture_config(config: &Qwen3Config, opts: &FixtureOptions) -> Qwen3Config {
    let mut c = config.clone();
    if let Some(theta) = opts.rope_theta {
        c.rope.theta = theta;
    }
    c
}

/// The block tables, input hidden state and token ids of the fixture `generate_fixture` makes
/// for these options (without weights or KV pools).
pub fn generate_inputs(
    config: &Qwen3Config,
    opts: &FixtureOptions,
) -> (PagedBatch, Vec<bf16>, Vec<u32>) {
    let config = fixture_config(config, opts);
    let batch = PagedBatch::identity(vec![opts.seq_len; opts.batch], opts.max_seq, PAGE_SIZE);
    let mut hidden = vec![bf16::ZERO; opts.batch * config.hidden_size];
    let mut all = Vec::new();
    jobs(
        &mut all,
        TensorMut::Bf16(&mut hidden),
        dist::HIDDEN,
        STREAM_HIDDEN,
    );
    run_jobs(opts.seed, all, None);
    let mut rng = Rng::new(opts.seed, STREAM_TOKENS << 20);
    let tokens = (0..opts.batch)
        .map(|_| (rng.next_u64() % config.vocab_size as u64) as u32)
        .collect();
    (batch, hidden, tokens)
}

/// Layer `layer`'s initial K and V pools exactly as `generate_fixture` fills them (layer 0's
/// with `replicate_kv`; zeros without `fill_kv`), one layer at a time so that caches far
/// larger than the host's spare memory can be filled pool by pool.
pub fn generate_kv_pools(
    config: &Qwen3Config,
    opts: &FixtureOptions,
    layer: usize,
    progress: Option<Progress<'_>>,
) -> (Vec<bf16>, Vec<bf16>) {
    let config = fixture_config(config, opts);
    let batch = PagedBatch::identity(vec![opts.seq_len; opts.batch], opts.max_seq, PAGE_SIZE);
    let n = batch.num_pages() * PAGE_SIZE * config.kv_width();
    let mut k = super::weights::zeroed_bf16(n);
    let mut v = super::weights::zeroed_bf16(n);
    if opts.fill_kv {
        let l = if opts.replicate_kv { 0 } else { layer } as u64;
        let mut all = Vec::new();
        jobs(
            &mut all,
            TensorMut::Bf16(&mut k),
            dist::K_CACHE,
            STREAM_KV0 + 2 * l,
        );
        jobs(
            &mut all,
            TensorMut::Bf16(&mut v),
            dist::V_CACHE,
            STREAM_KV0 + 2 * l + 1,
        );
        run_jobs(opts.seed, all, progress);
    }
    (k, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Generating the layers one at a time gives `generate_weights`' bits: every set, the
    /// shared one, and the tensors outside the layers (tied and untied heads).
    #[test]
    fn layers_generated_one_at_a_time_are_the_whole_model_s() {
        for name in ["tiny", "small"] {
            let c = Qwen3Config::preset(name).unwrap();
            let whole = generate_weights(&c, 7, false, None);
            let outer = generate_outer_weights(&c, 7, None);
            assert!(outer.layers.is_empty());
            assert_eq!(outer.embedding, whole.embedding, "{name}");
            assert_eq!(outer.final_norm, whole.final_norm, "{name}");
            assert_eq!(outer.lm_head, whole.lm_head, "{name}");
            for (l, w) in whole.layers.iter().enumerate() {
                assert!(generate_layer(&c, 7, l) == **w, "{name} layer {l}");
            }
            assert!(
                generate_layer(&c, 8, 0) != *whole.layers[0],
                "the seed matters"
            );
            let shared = generate_weights(&c, 7, true, None);
            assert!(
                generate_layer(&c, 7, 0) == *shared.layers[0],
                "{name} shared"
            );
        }
    }

    #[test]
    fn generation_is_deterministic_and_follows_the_distributions() {
        let c = Qwen3Config::preset("tiny").unwrap();
        let calls = AtomicU64::new(0);
        let p = |d: u64, t: u64| {
            assert!(d <= t);
            calls.fetch_add(1, Ordering::Relaxed);
        };
        let a = generate_fixture(&c, &FixtureOptions::small(2, 200), Some(&p));
        let b = generate_fixture(&c, &FixtureOptions::small(2, 200), None);
        assert!(calls.load(Ordering::Relaxed) > 0);
        assert_eq!(a.weights.layers[1], b.weights.layers[1]);
        assert_eq!(a.kv, b.kv);
        assert_eq!(a.hidden, b.hidden);
        assert_ne!(a.weights.layers[0], a.weights.layers[1]);
        let stats = |x: &[bf16]| {
            let n = x.len() as f64;
            let m = x.iter().map(|v| f64::from(v.to_f32())).sum::<f64>() / n;
            let s = (x
                .iter()
                .map(|v| (f64::from(v.to_f32()) - m).powi(2))
                .sum::<f64>()
                / n)
                .sqrt();
            (m, s)
        };
        let (m, s) = stats(&a.weights.layers[0].w_down);
        assert!(m.abs() < 2e-5 && (s - 0.0004).abs() < 2e-5, "down {m} {s}");
        let (m, s) = stats(a.kv.layer_v(1));
        assert!(
            (m - 0.3).abs() < 1e-3 && (s - 0.02).abs() < 1e-3,
            "v cache {m} {s}"
        );
        let shared = generate_fixture(
            &c,
            &FixtureOptions {
                shared_weights: true,
                replicate_kv: true,
                ..FixtureOptions::small(1, 10)
            },
            None,
        );
        assert!(shared.weights.is_shared());
        let opts = FixtureOptions::small(2, 200);
        let (k1, v1) = generate_kv_pools(&c, &opts, 1, None);
        assert_eq!((&k1[..], &v1[..]), (a.kv.layer_k(1), a.kv.layer_v(1)));
        let (batch, hidden, tokens) = generate_inputs(&c, &opts);
        assert_eq!(
            (batch, hidden, tokens),
            (a.batch.clone(), a.hidden.clone(), a.tokens.clone())
        );
        assert_eq!(shared.kv.layer_k(0), shared.kv.layer_k(1));
        shared.weights.check_shapes().unwrap();
    }
}
