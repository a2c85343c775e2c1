//! The Qwen3 step on the runtime (2 CPU cores) against the independent golden: the layers
//! chunk with every layer's K/V writes (batch 1 and 16, ragged lengths crossing pages), the
//! full model's argmax, prefill-then-decode against token-by-token decode, and a checkpoint
//! round trip giving identical results.

mod common;

use std::sync::Arc;

use common::qwen3::{check_model_step, stretched_fixture, stretched_fixture_of, worker};
use half::bf16;
use simpler_core::{CallConfig, OrchMode, RingValue, RuntimeEnv, Worker};
use simpler_models::qwen3::golden::{self, PrefillChunk, Tolerance};
use simpler_models::qwen3::{
    Fixture, KvBuffers, LayerBlocks, LoadOptions, PagedBatch, Qwen3Config, ResidentModel,
    SaveOptions, Session, TilePolicy, load_checkpoint, save_checkpoint,
};

/// A layer's weight set by its index, as `ResidentModel::upload_sets` asks for them.
type LayerSource<'a> = dyn FnMut(
        usize,
    ) -> Result<
        Arc<simpler_models::qwen3::weights::LayerWeights>,
        simpler_models::qwen3::Qwen3RunError,
    > + 'a;

fn session(w: &Worker, f: &Fixture) -> Session {
    let model = ResidentModel::upload(w, &f.weights, f.rope.max_seq, None).unwrap();
    let kv = KvBuffers::new(w, &f.weights.config, f.kv.num_pages, f.kv.page_size).unwrap();
    kv.upload(&f.kv).unwrap();
    Session::new(w, Arc::new(model), kv)
}

fn f32s(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// Every layer's K/V rows at the golden's slots, read back from the session's cache.
fn check_kv_writes(s: &Session, want: &[golden::LayerKvWrite], tol: Tolerance, first: Tolerance) {
    let row = s.kv().row;
    for (l, wr) in want.iter().enumerate() {
        let tol = if l == 0 { first } else { tol };
        for (t, &slot) in wr.slots.iter().enumerate() {
            let (k, v) = s.kv().read_slot(l, slot).unwrap();
            tol.check(
                &format!("layer {l} K at slot {slot}"),
                &f32s(&k),
                &f32s(&wr.k[t * row..(t + 1) * row]),
            )
            .unwrap();
            tol.check(
                &format!("layer {l} V at slot {slot}"),
                &f32s(&v),
                &f32s(&wr.v[t * row..(t + 1) * row]),
            )
            .unwrap();
        }
    }
}

fn layers_chunk_matches_golden(preset: &str, seq_lens: &[usize], cfg: &CallConfig) {
    let f = stretched_fixture(preset, seq_lens);
    let w = worker();
    let mut s = session(&w, &f);
    let layers = f.weights.config.num_hidden_layers;
    let got = s
        .decode_layers(&w, &f.batch, &f.hidden, 0..layers, cfg)
        .unwrap();
    let mut kv = f.kv.clone();
    let (want, writes) =
        golden::decode_layers_bf16(&f.weights, 0..layers, &mut kv, &f.batch, &f.rope, &f.hidden);
    Tolerance::STACK
        .check("hidden after the layers", &f32s(&got.hidden), &f32s(&want))
        .unwrap();
    check_kv_writes(&s, &writes, Tolerance::STACK, Tolerance::ONE_LAYER);
    assert_eq!(got.report.counters.skipped, 0);
}

#[test]
fn layers_chunk_batch_1_matches_the_golden() {
    layers_chunk_matches_golden("small", &[300], &CallConfig::default());
}

#[test]
fn layers_chunk_ragged_batch_16_matches_the_golden() {
    let lens: Vec<usize> = (0..16).map(|b| 1 + (b * 37) % 290).collect();
    layers_chunk_matches_golden("small", &lens, &CallConfig::default());
}

#[test]
fn one_layer_meets_the_one_layer_tolerance() {
    let f = stretched_fixture("small", &[1, 128, 129, 260]);
    one_layer_matches(&f, "layer 0");
}

/// Layer 0 of `f` on the runtime against the golden at the one-layer tolerance: its hidden
/// output (rounded to bf16 once, as the layers chunk returns it) and its K/V writes. `what`
/// names the case in a failure.
fn one_layer_matches(f: &Fixture, what: &str) {
    let w = worker();
    let mut s = session(&w, f);
    let got = s
        .decode_layers(&w, &f.batch, &f.hidden, 0..1, &CallConfig::default())
        .unwrap();
    let mut kv = f.kv.clone();
    let want = golden::decode_layers(
        &f.weights,
        0..1,
        &mut kv,
        &f.batch,
        &f.rope,
        &f32s(&f.hidden),
    );
    let want_bf16: Vec<f32> = want
        .hidden
        .iter()
        .map(|&v| bf16::from_f32(v).to_f32())
        .collect();
    Tolerance::ONE_LAYER
        .check(&format!("{what} hidden"), &f32s(&got.hidden), &want_bf16)
        .unwrap();
    check_kv_writes(
        &s,
        &want.kv_writes,
        Tolerance::ONE_LAYER,
        Tolerance::ONE_LAYER,
    );
}

fn full_model_matches_golden(seq_lens: &[usize], cfg: &CallConfig) {
    full_model_matches_golden_with(seq_lens, cfg, |_| {});
}

fn full_model_matches_golden_with(
    seq_lens: &[usize],
    cfg: &CallConfig,
    policy: impl FnOnce(&mut TilePolicy),
) {
    let f = stretched_fixture("small", seq_lens);
    full_model_step_matches(&f, cfg, policy, "after all layers");
}

/// One full-model decode step of `f` (tile policy set by `policy`) against the golden: the
/// hidden state, logits and tokens, and every layer's K/V writes.
fn full_model_step_matches(
    f: &Fixture,
    cfg: &CallConfig,
    policy: impl FnOnce(&mut TilePolicy),
    what: &str,
) {
    full_model_step_matches_on(&worker(), f, cfg, policy, what);
}

/// [`full_model_step_matches`] on the worker `w`.
fn full_model_step_matches_on(
    w: &Worker,
    f: &Fixture,
    cfg: &CallConfig,
    policy: impl FnOnce(&mut TilePolicy),
    what: &str,
) {
    let mut s = session(w, f);
    policy(&mut s.policy);
    let got = s.decode(w, &f.batch, &f.tokens, cfg).unwrap();
    let want = golden::decode_model(&f.weights, &mut f.kv.clone(), &f.batch, &f.rope, &f.tokens);
    check_model_step(what, &got, &want);
    check_kv_writes(&s, &want.kv_writes, Tolerance::STACK, Tolerance::ONE_LAYER);
}

#[test]
fn full_model_argmax_is_identical_to_the_golden() {
    full_model_matches_golden(&[1, 127, 128, 129, 300], &CallConfig::default());
}

/// Qwen3-14B's query group of 5 (every other preset has 2): the full model's step and every
/// layer's K/V writes against the golden, and one layer at the one-layer tolerance. On the
/// AVX-512 BF16 path this group takes its own decode attention kernel (`attention::path`:
/// `p · V` on bf16 probabilities), which the presets' shapes never reach.
#[test]
fn a_query_group_of_5_matches_the_golden() {
    let mut c = Qwen3Config::preset("small").unwrap();
    (c.num_attention_heads, c.num_key_value_heads) = (10, 2);
    let isa = simpler_kernels_cpu::Isa::current();
    println!(
        "decode attention at group 5 on {}: {}",
        isa.name(),
        simpler_kernels_cpu::attention::path(isa, c.group()).name()
    );
    let lens = [1, 127, 128, 129, 300];
    let f = stretched_fixture_of(&c, &lens);
    full_model_step_matches(
        &f,
        &CallConfig::default(),
        |_| {},
        "group 5, after all layers",
    );

    one_layer_matches(&f, "group 5, layer 0");
}

/// Short KV chunks, so the first sequence's first chunks are halves (`KvSplit::short`), at
/// these small lengths: the attention kernel's tapered split against the golden.
fn tapered_chunks(p: &mut TilePolicy) {
    p.min_kv_chunk = 16;
    p.max_kv_chunk = 64;
}

#[test]
fn tapered_kv_chunks_match_the_golden() {
    let lens = [300, 127, 1, 129];
    let mut p = TilePolicy::for_cores(2);
    tapered_chunks(&mut p);
    assert!(p.kv_splits(&lens)[0].short > 0, "{:?}", p.kv_splits(&lens));
    full_model_matches_golden_with(&lens, &CallConfig::default(), tapered_chunks);
}

/// A batch of more sequences than attention tasks leaves each one KV chunk; the first is cut
/// into the cores' halves so the phase ends on them (`TilePolicy::kv_splits`): its combine and
/// the other sequences' single chunks against the golden.
#[test]
fn a_one_chunk_batch_whose_first_sequence_is_halved_matches_the_golden() {
    let short_chunks = |p: &mut TilePolicy| p.min_kv_chunk = 16;
    let mut p = TilePolicy::for_cores(2);
    short_chunks(&mut p);
    // The first sequence in two chunks, both halved; in four, two of them halved.
    for (first, split) in [(120, (4, 4)), (200, (6, 4))] {
        let lens = [first, 100, 130, 110, 125, 105, 115, 128, 99, 101];
        let splits = p.kv_splits(&lens);
        assert_eq!((splits[0].chunks, splits[0].short), split, "{splits:?}");
        assert!(splits[1..].iter().all(|s| s.chunks == 1), "{splits:?}");
        full_model_matches_golden_with(&lens, &CallConfig::default(), short_chunks);
    }
}

/// Decode's q, k and v are one task whose blocks split the heads of all three together
/// (`GEMM_ROPE_STEP`): at the small preset's 8 q + 4 k + 4 v heads, two blocks (one tile per
/// core) give block 1 the k and the v heads, five give blocks that cross from q into k and
/// from k into v, the default eight none, and 4 KiB tiles a block per head; each against the
/// golden.
#[test]
fn qkv_blocks_across_the_projections_match_the_golden() {
    let heads = 8 + 4 + 4;
    assert_eq!(simpler_core::tapered_range(heads, 2, 1), 8..16);
    let five: Vec<_> = (0..5)
        .map(|b| simpler_core::tapered_range(heads, 5, b))
        .collect();
    assert!(five.iter().any(|r| r.start < 8 && r.end > 8), "{five:?}");
    assert!(five.iter().any(|r| r.start < 12 && r.end > 12), "{five:?}");
    let cfg = CallConfig::default();
    let lens = [200, 3, 70];
    full_model_matches_golden_with(&lens, &cfg, |p| p.tiles_per_core = 1);
    // One MiB of q/k/v weights in tiles of a fifth of it: five blocks.
    let fifths = |p: &mut TilePolicy| {
        p.tiles_per_core = 1;
        p.tile_bytes = (1 << 20) / 5 + 1;
    };
    let mut p = TilePolicy::for_cores(2);
    fifths(&mut p);
    let c = Qwen3Config::preset("small").unwrap();
    assert_eq!(LayerBlocks::new(&c, &p).qkv, 5);
    full_model_matches_golden_with(&lens, &cfg, fifths);
    full_model_matches_golden_with(&lens, &cfg, |_| {});
    full_model_matches_golden_with(&lens, &cfg, |p| p.tile_bytes = 4096);
}

/// Four cores, five rows: the decode norm's blocks take `ceil(5 / 4) = 2` rows each, so the
/// last block's share starts past the rows and is empty; the step against the golden.
#[test]
fn more_norm_blocks_than_row_shares_match_the_golden() {
    let w = common::cpu_worker(4);
    simpler_models::qwen3::ops::register(&w).unwrap();
    let f = stretched_fixture("small", &[200, 3, 70, 1, 129]);
    full_model_step_matches_on(&w, &f, &CallConfig::default(), |_| {}, "4 cores, 5 rows");
}

#[test]
fn batch_64_full_model_matches_the_golden() {
    let lens: Vec<usize> = (0..64).map(|b| 1 + (b * 53) % 200).collect();
    let f = stretched_fixture("tiny", &lens);
    full_model_step_matches(&f, &CallConfig::default(), |_| {}, "batch 64");
}

#[test]
fn full_model_in_serial_mode_and_tiny_rings() {
    // Serial: the whole graph is submitted before execution, so rings must hold it.
    full_model_matches_golden(
        &[200, 3],
        &CallConfig {
            mode: OrchMode::Serial,
            ..CallConfig::default()
        },
    );
    // Tiny rings: scopes must be reclaimed layer by layer for the run to finish.
    let tiny = RuntimeEnv {
        ring_task_window: RingValue::All(256),
        ring_heap: RingValue::All(1 << 20),
        ring_dep_pool: RingValue::All(1024),
    };
    let cfg = CallConfig {
        runtime_env: tiny,
        ..CallConfig::default()
    };
    full_model_matches_golden(&[200, 3], &cfg);
    // Many small tiles (64 gate/up x 32 down per layer): consumers of a phase wait on its
    // barrier, so a 1024-entry dependency pool still holds a layer (2048 edges without).
    let many = CallConfig {
        runtime_env: RuntimeEnv {
            ring_task_window: RingValue::All(1024),
            ..tiny
        },
        ..CallConfig::default()
    };
    full_model_matches_golden_with(&[200, 3], &many, |p| p.tile_bytes = 4096);
}

/// A one-sequence view of row `b` of a batch's block tables.
fn single(batch: &PagedBatch, b: usize, len: usize) -> PagedBatch {
    PagedBatch {
        page_size: batch.page_size,
        max_blocks: batch.max_blocks,
        block_table: batch.table(b).to_vec(),
        seq_lens: vec![len],
    }
}

#[test]
fn prefill_then_decode_equals_token_by_token_decode() {
    let prompts: [Vec<u32>; 2] = [
        (0..150).map(|i| (i * 7 + 3) % 4000).collect(),
        (0..70).map(|i| (i * 13 + 1) % 4000).collect(),
    ];
    let new_tokens = 4;
    let f = stretched_fixture("small", &[150 + new_tokens, 70 + new_tokens]);
    let w = worker();
    let model = Arc::new(ResidentModel::upload(&w, &f.weights, f.rope.max_seq, None).unwrap());
    let kv = |_: ()| KvBuffers::new(&w, &f.weights.config, f.kv.num_pages, f.kv.page_size).unwrap();
    let cfg = CallConfig::default();

    // A: chunked prefill (both sequences in each run, chunks of up to 64 tokens), then decode.
    let mut a = Session::new(&w, model.clone(), kv(()));
    let mut done = [0usize; 2];
    let mut last = None;
    while done.iter().zip(&prompts).any(|(d, p)| d < &p.len()) {
        let chunks: Vec<PrefillChunk> = (0..2)
            .filter(|&b| done[b] < prompts[b].len())
            .map(|b| {
                let end = (done[b] + 64).min(prompts[b].len());
                PrefillChunk {
                    seq: b,
                    tokens: prompts[b][done[b]..end].to_vec(),
                    seq_len: end,
                }
            })
            .collect();
        let out = a.prefill(&w, &f.batch, &chunks, &cfg).unwrap();
        for (ch, &t) in chunks.iter().zip(&out.next_tokens) {
            done[ch.seq] = ch.seq_len;
            if ch.seq_len == prompts[ch.seq].len() {
                last.get_or_insert([0u32; 2])[ch.seq] = t;
            }
        }
    }
    let mut next_a = last.unwrap();
    let mut gen_a = vec![next_a.to_vec()];
    let mut logits_a = Vec::new();
    for step in 0..new_tokens - 1 {
        let batch = PagedBatch {
            seq_lens: vec![150 + step + 1, 70 + step + 1],
            ..f.batch.clone()
        };
        let out = a.decode(&w, &batch, &next_a, &cfg).unwrap();
        next_a = [out.next_tokens[0], out.next_tokens[1]];
        gen_a.push(next_a.to_vec());
        logits_a = out.logits;
    }

    // B: every prompt token decoded one at a time, sequence by sequence, then the same steps.
    let mut b_s = Session::new(&w, model, kv(()));
    let mut gen_b = vec![Vec::new(); new_tokens];
    let mut logits_b = Vec::new();
    for (b, prompt) in prompts.iter().enumerate() {
        let mut tok = 0;
        for (i, &t) in prompt.iter().enumerate() {
            let out = b_s
                .decode(&w, &single(&f.batch, b, i + 1), &[t], &cfg)
                .unwrap();
            tok = out.next_tokens[0];
        }
        gen_b[0].push(tok);
        for step in 0..new_tokens - 1 {
            let len = prompt.len() + step + 1;
            let out = b_s
                .decode(&w, &single(&f.batch, b, len), &[tok], &cfg)
                .unwrap();
            tok = out.next_tokens[0];
            gen_b[step + 1].push(tok);
            if step == new_tokens - 2 {
                logits_b.extend(out.logits);
            }
        }
    }
    assert_eq!(
        gen_a, gen_b,
        "greedy tokens after prefill vs token-by-token"
    );
    Tolerance::STACK
        .check("last logits", &logits_a, &logits_b)
        .unwrap();
    // The caches agree too: every prompt position of every layer.
    for (b, p) in prompts.iter().enumerate() {
        for pos in 0..p.len() {
            let slot = f.batch.slot(b, pos);
            for l in 0..f.weights.config.num_hidden_layers {
                let (ka, va) = a.kv().read_slot(l, slot).unwrap();
                let (kb, vb) = b_s.kv().read_slot(l, slot).unwrap();
                Tolerance::STACK.check("K", &f32s(&ka), &f32s(&kb)).unwrap();
                Tolerance::STACK.check("V", &f32s(&va), &f32s(&vb)).unwrap();
            }
        }
    }
}

#[test]
fn prefill_matches_the_golden() {
    let f = stretched_fixture("small", &[200, 90]);
    let w = worker();
    let mut s = session(&w, &f);
    // Sequence 0 has 120 tokens cached (the fixture's K/V), its chunk adds 80; sequence 1
    // starts empty.
    let chunks = vec![
        PrefillChunk {
            seq: 0,
            tokens: (0..80).map(|i| (i * 31 + 5) % 4096).collect(),
            seq_len: 200,
        },
        PrefillChunk {
            seq: 1,
            tokens: (0..90).map(|i| (i * 17 + 2) % 4096).collect(),
            seq_len: 90,
        },
    ];
    let got = s
        .prefill(&w, &f.batch, &chunks, &CallConfig::default())
        .unwrap();
    let want = golden::prefill_model(&f.weights, &mut f.kv.clone(), &f.batch, &f.rope, &chunks);
    check_model_step("prefill", &got, &want);
    check_kv_writes(&s, &want.kv_writes, Tolerance::STACK, Tolerance::ONE_LAYER);
}

#[test]
fn a_saved_checkpoint_runs_identically_to_the_in_memory_model() {
    for (preset, opts) in [
        ("tiny", SaveOptions::default()),
        (
            "small",
            SaveOptions {
                max_shard_bytes: Some(4 << 20),
                layout: simpler_models::qwen3::WeightLayout::InOut,
                ..SaveOptions::default()
            },
        ),
    ] {
        let f = stretched_fixture(preset, &[130, 5]);
        let dir = std::env::temp_dir().join(format!(
            "simpler-models-runtime-{}-{preset}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        save_checkpoint(&dir, &f.weights, &opts).unwrap();
        let loaded = load_checkpoint(
            &dir,
            &LoadOptions {
                layout: opts.layout,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        let w = worker();
        let run = |weights| {
            let model = ResidentModel::upload(&w, weights, f.rope.max_seq, None).unwrap();
            let kv = KvBuffers::new(&w, &f.weights.config, f.kv.num_pages, f.kv.page_size).unwrap();
            kv.upload(&f.kv).unwrap();
            let mut s = Session::new(&w, Arc::new(model), kv);
            s.decode(&w, &f.batch, &f.tokens, &CallConfig::default())
                .unwrap()
        };
        let (a, b) = (run(&f.weights), run(&loaded));
        assert_eq!(a.next_tokens, b.next_tokens, "{preset}");
        assert_eq!(a.logits, b.logits, "{preset}: logits differ");
        assert_eq!(a.hidden, b.hidden, "{preset}: hidden differs");
        // Read a layer at a time straight into the worker (`read_checkpoint` and
        // `upload_sets`, the CLI's path): the same buffers as the whole load's, in both formats.
        for format in [
            simpler_models::qwen3::WeightFormat::Bf16,
            simpler_models::qwen3::WeightFormat::Int8(Default::default()),
        ] {
            let whole = ResidentModel::upload_as(&w, &loaded, 256, format, None).unwrap();
            let layers = loaded.config.num_hidden_layers;
            let lopts = LoadOptions {
                layout: opts.layout,
                ..LoadOptions::default()
            };
            let streamed = simpler_models::qwen3::read_checkpoint(&dir, &lopts, |r| {
                let outer = r.outer()?;
                let mut layer = |l: usize| Ok(Arc::new(r.layer(l)?));
                ResidentModel::upload_sets(
                    &w,
                    &outer,
                    (0..layers).collect(),
                    &mut layer,
                    256,
                    format,
                    None,
                )
            })
            .unwrap();
            let bytes = |m: &ResidentModel| -> Vec<Vec<u8>> {
                m.buffers()
                    .iter()
                    .map(|b| b.read::<u8>().unwrap())
                    .collect()
            };
            assert!(bytes(&whole) == bytes(&streamed), "{preset} {format:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The block tables of step `s`: every sequence's pages rotated by `7 * s` through the pool,
/// so each step's K/V writes and attention reads land on other pages than the last step's.
fn rotated(f: &Fixture, seq_lens: Vec<usize>, s: usize) -> PagedBatch {
    let mb = f.batch.max_blocks;
    let pages = f.kv.num_pages;
    PagedBatch {
        page_size: f.batch.page_size,
        max_blocks: mb,
        block_table: (0..seq_lens.len() * mb)
            .map(|i| ((i + 7 * s) % pages) as u32)
            .collect(),
        seq_lens,
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn kv_bits(s: &Session) -> (Vec<u16>, Vec<u16>) {
    let read = |b: &simpler_core::Buffer| -> Vec<u16> {
        b.read::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    (read(&s.kv().k), read(&s.kv().v))
}

/// A session on `model` with its own copy of the fixture's KV cache, replaying captured
/// decode graphs or not.
fn replay_session(w: &Worker, f: &Fixture, model: &Arc<ResidentModel>, replay: bool) -> Session {
    let kv = KvBuffers::new(w, &f.weights.config, f.kv.num_pages, f.kv.page_size).unwrap();
    kv.upload(&f.kv).unwrap();
    let mut s = Session::new(w, model.clone(), kv);
    s.replay = replay;
    s
}

/// Replayed steps with tapered KV chunks (the kernel splits the longer lengths of later steps by
/// the same rule) give the same bits as orchestrated ones.
#[test]
fn replayed_steps_with_tapered_kv_chunks_are_bit_identical() {
    let f = stretched_fixture("small", &[300, 300]);
    let w = worker();
    let model = Arc::new(ResidentModel::upload(&w, &f.weights, f.rope.max_seq, None).unwrap());
    let session = |replay: bool| {
        let mut s = replay_session(&w, &f, &model, replay);
        tapered_chunks(&mut s.policy);
        s
    };
    let (mut a, mut b) = (session(true), session(false));
    let cfg = CallConfig::default();
    let mut lens = vec![250usize, 120];
    assert!(a.policy.kv_splits(&lens)[0].short > 0);
    let mut tokens = vec![7u32, 1234];
    let mut replayed = 0;
    for s in 0..6 {
        let batch = rotated(&f, lens.clone(), s);
        let ra = a.decode(&w, &batch, &tokens, &cfg).unwrap();
        let rb = b.decode(&w, &batch, &tokens, &cfg).unwrap();
        if matches!(ra.report.graph, simpler_core::GraphMode::Replayed { .. }) {
            replayed += 1;
        }
        assert_eq!(ra.next_tokens, rb.next_tokens, "step {s}");
        assert_eq!(bits(&ra.logits), bits(&rb.logits), "step {s}: logits");
        assert_eq!(bits(&ra.hidden), bits(&rb.hidden), "step {s}: hidden");
        tokens = ra.next_tokens;
        lens.iter_mut().for_each(|l| *l += 1);
    }
    assert!(replayed >= 4, "{replayed} replayed");
    assert_eq!(kv_bits(&a), kv_bits(&b), "KV caches");
}

/// Decode steps replayed from captured graphs give the same bits as orchestrated steps: logits,
/// hidden states, tokens, and the KV caches, over steps whose positions, block tables and slots
/// all move, across recaptures (a sequence crossing a page and a KV-chunk boundary, a batch
/// that shrinks), and after a replay whose kernel failed.
#[test]
fn replayed_decode_steps_are_bit_identical_to_orchestrated_ones() {
    use simpler_core::{Error, ErrorCode, GraphMode, GraphShape, RunArgs};
    let f = stretched_fixture("small", &[300, 300, 300]);
    let w = worker();
    let model = Arc::new(ResidentModel::upload(&w, &f.weights, f.rope.max_seq, None).unwrap());
    let session = |replay: bool| replay_session(&w, &f, &model, replay);
    let (mut a, mut b) = (session(true), session(false));
    let cfg = CallConfig::default();
    let mut lens = vec![110usize, 250, 30];
    let mut tokens = vec![11u32, 2222, 333];
    let (mut captured, mut replayed) = (0, 0);
    let mut step =
        |s: usize, lens: &[usize], tokens: &mut Vec<u32>, a: &mut Session, b: &mut Session| {
            let batch = rotated(&f, lens.to_vec(), s);
            let ra = a.decode(&w, &batch, tokens, &cfg).unwrap();
            let rb = b.decode(&w, &batch, tokens, &cfg).unwrap();
            assert_eq!(rb.report.graph, GraphMode::Orchestrated);
            match ra.report.graph {
                GraphMode::Captured { .. } => captured += 1,
                GraphMode::Replayed { .. } => replayed += 1,
                GraphMode::Orchestrated => panic!("step {s}: replay on, but orchestrated"),
            }
            assert_eq!(ra.next_tokens, rb.next_tokens, "step {s}");
            assert_eq!(bits(&ra.logits), bits(&rb.logits), "step {s}: logits");
            assert_eq!(bits(&ra.hidden), bits(&rb.hidden), "step {s}: hidden");
            *tokens = ra.next_tokens;
        };
    for s in 0..24 {
        step(s, &lens, &mut tokens, &mut a, &mut b);
        lens.iter_mut().for_each(|l| *l += 1);
    }
    assert_eq!(kv_bits(&a), kv_bits(&b), "KV caches after 24 steps");

    // A replay whose shape changed is refused, naming the field; one whose kernel fails is
    // diagnosed, and the sessions go on.
    let g = a.decode_graph().expect("a captured decode graph").clone();
    let mut smaller = GraphShape::new();
    for (name, v) in g.shape().fields() {
        smaller.push(name.clone(), if name == "batch" { 2 } else { *v });
    }
    let args = RunArgs {
        buffers: g.buffers().to_vec(),
        scalars: vec![],
    };
    match w.replay(&g, args.clone(), &cfg, &smaller) {
        Err(Error::Run(e)) => assert!(
            e.detail
                .contains("shape field `batch` is 2, the graph was captured with 3"),
            "{}",
            e.detail
        ),
        other => panic!("expected a refused replay, got {other:?}"),
    }
    // Bad step entries: the q, k and v projections' epilogues (SPMD over heads, k and v
    // writing the pools) check every row's entry in every block before they write, so the
    // step fails with the pools untouched (the sessions' caches still agree bit for bit
    // below).
    let step_entries = g.buffers().last().unwrap();
    let pools_before = kv_bits(&a);
    let len = |i: usize| u32::try_from(lens[i]).unwrap();
    let bad_entries: [([u32; 6], &str); 3] = [
        ([u32::MAX; 6], "outside the RoPE tables"),
        (
            [len(0), 3, len(1), u32::MAX, len(2), 5],
            "row 1: slot 4294967295 outside the pool",
        ),
        (
            [len(0), 3, len(1), 4, len(2), 3],
            "rows 0 and 2 both write slot 3",
        ),
    ];
    for (entries, why) in bad_entries {
        step_entries.write(&entries).unwrap();
        match w.replay(&g, args.clone(), &cfg, g.shape()) {
            Err(Error::Run(e)) => {
                assert_eq!(e.code, ErrorCode::KernelFailed);
                assert_eq!(e.locator.kernel.as_deref(), Some("gemm_rope_step_bf16"));
                assert!(e.detail.contains(why), "{why}: {}", e.detail);
            }
            other => panic!("{why}: expected KERNEL_FAILED, got {other:?}"),
        }
        assert!(kv_bits(&a) == pools_before, "{why}: the pools changed");
    }

    // The batch shrinks: a new topology, captured, then replayed.
    lens.pop();
    tokens.pop();
    for s in 24..30 {
        step(s, &lens, &mut tokens, &mut a, &mut b);
        lens.iter_mut().for_each(|l| *l += 1);
    }
    assert_eq!(kv_bits(&a), kv_bits(&b), "KV caches at the end");
    // First step, the page / chunk boundaries of sequence 0 (at 128) and 1 (at 256), and the
    // smaller batch were captured; everything else replayed.
    assert!((3..=6).contains(&captured), "{captured} captures");
    assert_eq!(captured + replayed, 30);
}

/// Every decode step that would replay a captured graph is checked against a fresh capture
/// of its own orchestration (`Session::verify_replay`) over 40 steps that change the batch,
/// the block tables and the lengths (by one, and by jumps across pages and KV chunk
/// boundaries), with the default KV chunks and with tapered ones (short chunks): equal decode
/// shapes gave equal graphs at every one of them, and a session that replays them gives the
/// same bits.
#[test]
fn decode_shapes_describe_every_graph_they_replay() {
    let f = stretched_fixture("small", &[300, 300, 300]);
    let w = worker();
    let model = Arc::new(ResidentModel::upload(&w, &f.weights, f.rope.max_seq, None).unwrap());
    verify_decode_shapes(&w, &f, &model, |_| {});
    verify_decode_shapes(&w, &f, &model, tapered_chunks);
}

fn verify_decode_shapes(
    w: &Worker,
    f: &Fixture,
    model: &Arc<ResidentModel>,
    policy: fn(&mut TilePolicy),
) {
    use simpler_core::GraphMode;
    let session = || {
        let mut s = replay_session(w, f, model, true);
        policy(&mut s.policy);
        s
    };
    let (mut verifying, mut replaying) = (session(), session());
    verifying.verify_replay = true;
    let cfg = CallConfig::default();
    let mut lens = vec![20usize, 127, 250];
    let mut replayed = 0;
    for s in 0..40 {
        // Three sequences, then two (steps 12..24), then three again with new lengths.
        let batch_lens: Vec<usize> = match s {
            12..24 => lens[..2].to_vec(),
            _ => lens.clone(),
        };
        let batch = rotated(f, batch_lens.clone(), s);
        let tokens: Vec<u32> = (0..batch_lens.len())
            .map(|b| ((s * 31 + b * 7) % 97) as u32)
            .collect();
        let v = verifying
            .decode(w, &batch, &tokens, &cfg)
            .unwrap_or_else(|e| panic!("step {s} (lengths {batch_lens:?}): {e}"));
        let r = replaying.decode(w, &batch, &tokens, &cfg).unwrap();
        assert!(
            matches!(v.report.graph, GraphMode::Captured { .. }),
            "step {s}: the verifying session ran {:?}",
            v.report.graph
        );
        if matches!(r.report.graph, GraphMode::Replayed { .. }) {
            replayed += 1;
        }
        // The session's whole step holds its run (timing layer ⑤ is the difference).
        for (e, w) in [&v, &r].map(|o| (o.report.engine_step, o.report.host_wall)) {
            assert!(
                e.start_ns <= w.start_ns && w.end_ns <= e.end_ns && w.end_ns > w.start_ns,
                "step {s}: engine step {e:?} does not hold the run {w:?}"
            );
        }
        assert_eq!(v.next_tokens, r.next_tokens, "step {s}");
        assert_eq!(bits(&v.logits), bits(&r.logits), "step {s}: logits");
        // Mostly one more token; every fifth step a jump (across the page at 128 and the
        // chunk boundaries), wrapping before the fixture's 300.
        for (b, l) in lens.iter_mut().enumerate() {
            let by = if s % 5 == 4 { 37 + 11 * b } else { 1 };
            *l = (*l + by - 1) % 290 + 1;
        }
    }
    assert_eq!(kv_bits(&verifying), kv_bits(&replaying), "KV caches");
    // Most steps were replays, so most were checked.
    assert!(replayed >= 20, "{replayed} replays of 40 steps");
}

/// `prefill_heap_bytes` is what a prefill step's largest scope allocates: a heap of exactly
/// that runs the step (and gives the same tokens as the default heap), 10% less is a heap
/// deadlock that names the ring heap, and the worker runs the next step after it.
#[test]
fn the_prefill_heap_estimate_is_what_a_layer_needs() {
    let prompt: Vec<u32> = (0..96).map(|i| (i * 11 + 5) % 4000).collect();
    let f = stretched_fixture("small", &[prompt.len()]);
    let w = worker();
    let model = Arc::new(ResidentModel::upload(&w, &f.weights, f.rope.max_seq, None).unwrap());
    let need = simpler_models::qwen3::prefill_heap_bytes(&f.weights.config, prompt.len());
    let chunk = [PrefillChunk {
        seq: 0,
        tokens: prompt.clone(),
        seq_len: prompt.len(),
    }];
    let batch = PagedBatch {
        seq_lens: vec![prompt.len()],
        ..single(&f.batch, 0, prompt.len())
    };
    let with_heap = |heap: u64| CallConfig {
        runtime_env: RuntimeEnv {
            ring_heap: RingValue::All(heap),
            ..RuntimeEnv::default()
        },
        ..CallConfig::default()
    };
    let run = |cfg: &CallConfig| {
        let kv = KvBuffers::new(&w, &f.weights.config, f.kv.num_pages, f.kv.page_size).unwrap();
        Session::new(&w, model.clone(), kv).prefill(&w, &batch, &chunk, cfg)
    };
    let want = run(&CallConfig::default()).unwrap().next_tokens;
    assert_eq!(run(&with_heap(need)).unwrap().next_tokens, want);
    let e = run(&with_heap(need / 10 * 9 / 1024 * 1024))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("HEAP_RING_DEADLOCK") && e.contains("ring_heap"),
        "{e}"
    );
    assert_eq!(run(&CallConfig::default()).unwrap().next_tokens, want);
}

/// A preset whose weight sets are generated and uploaded one at a time
/// (`ResidentModel::upload_sets`, what the CLI does for presets) holds the bytes of the same
/// preset generated whole and uploaded at once, in bf16 and int8, with distinct and shared
/// sets; a set of the wrong shape and a wrong count of layers are refused by name, and the
/// worker then uploads the next model.
#[test]
fn layers_uploaded_one_set_at_a_time_are_the_whole_upload() {
    use simpler_models::qwen3::{
        Int8Acts, WeightFormat, generate_layer, generate_outer_weights, generate_weights,
    };
    let c = Qwen3Config::preset("small").unwrap();
    let w = worker();
    let bytes = |m: &ResidentModel| -> Vec<Vec<u8>> {
        m.buffers()
            .iter()
            .map(|b| b.read::<u8>().unwrap())
            .collect()
    };
    for format in [WeightFormat::Bf16, WeightFormat::Int8(Int8Acts::Quantised)] {
        for shared in [false, true] {
            let whole = generate_weights(&c, 5, shared, None);
            let a = ResidentModel::upload_as(&w, &whole, 256, format, None).unwrap();
            let outer = generate_outer_weights(&c, 5, None);
            let sets: Vec<usize> = (0..c.num_hidden_layers)
                .map(|l| if shared { 0 } else { l })
                .collect();
            let mut made = Vec::new();
            let mut layer = |s: usize| {
                made.push(s);
                Ok(Arc::new(generate_layer(&c, 5, s)))
            };
            let b =
                ResidentModel::upload_sets(&w, &outer, sets.clone(), &mut layer, 256, format, None)
                    .unwrap();
            assert_eq!(
                made,
                (0..a.sets).collect::<Vec<_>>(),
                "each set made once, in order"
            );
            assert_eq!((a.sets, &a.set_of_layer), (b.sets, &b.set_of_layer));
            assert!(bytes(&a) == bytes(&b), "{format:?} shared {shared}");
        }
    }
    let outer = generate_outer_weights(&c, 5, None);
    let all: Vec<usize> = (0..c.num_hidden_layers).collect();
    let mut short = |s: usize| {
        let mut l = generate_layer(&c, 5, s);
        l.w_up.pop();
        Ok(Arc::new(l))
    };
    // The error of an upload that must be refused.
    let refusal = |sets: Vec<usize>, source: &mut LayerSource<'_>| match ResidentModel::upload_sets(
        &w,
        &outer,
        sets,
        source,
        256,
        WeightFormat::Bf16,
        None,
    ) {
        Err(e) => e.to_string(),
        Ok(_) => panic!(
            "the upload of {} layers' sets was accepted",
            c.num_hidden_layers
        ),
    };
    let e = refusal(all.clone(), &mut short);
    assert!(e.contains("weight set 0.mlp.up_proj.weight"), "{e}");
    let mut fine = |s: usize| Ok(Arc::new(generate_layer(&c, 5, s)));
    let e = refusal(vec![0; 3], &mut fine);
    assert!(e.contains("3 layers' sets for a config of"), "{e}");
    // A source that fails part-way (a checkpoint's bad tensor in a later layer): its error
    // comes back as it is, the sets already uploaded are dropped with the model's buffers.
    let mut asked = Vec::new();
    let mut failing = |s: usize| {
        asked.push(s);
        if s == 1 {
            return Err(simpler_models::qwen3::Qwen3RunError::Invalid(
                "set 1 unreadable".into(),
            ));
        }
        Ok(Arc::new(generate_layer(&c, 5, s)))
    };
    let Err(e) = ResidentModel::upload_sets(
        &w,
        &outer,
        all.clone(),
        &mut failing,
        256,
        WeightFormat::Bf16,
        None,
    ) else {
        panic!("a failing source fails the upload")
    };
    assert_eq!(e.to_string(), "set 1 unreadable");
    assert_eq!(asked, vec![0, 1], "nothing asked after the failure");
    let again =
        ResidentModel::upload_sets(&w, &outer, all, &mut fine, 256, WeightFormat::Bf16, None)
            .expect("the worker goes on");
    let whole = generate_weights(&c, 5, false, None);
    let want = ResidentModel::upload_as(&w, &whole, 256, WeightFormat::Bf16, None).unwrap();
    assert!(
        bytes(&again) == bytes(&want),
        "the next upload holds the whole model's bytes"
    );
}
