//! The CUDA platform on a device: the run-time check on any machine, and — where a device
//! exists — the Qwen3 decode step against the independent fp32 golden of `simpler-models`.
//! Without a device the GPU tests print why and pass, unless `SIMPLER_REQUIRE_CUDA=1` (the
//! GPU check script sets it) makes the absence a failure.

use half::bf16;
use simpler_cuda::{
    CudaDevice, CudaError, DecodeKernels, DecodeShape, HostLayer, HostModel, KernelCache,
    Qwen3Decoder, probe,
};
use simpler_models::qwen3::golden::{self, Tolerance};
use simpler_models::qwen3::{FixtureOptions, Qwen3Config, generate_fixture};

/// The check never panics: it describes a device, or says what is missing.
#[test]
fn probe_describes_a_device_or_says_why_not() {
    match probe(0) {
        Ok(info) => {
            assert!(info.arch().starts_with("sm_"), "{info:?}");
            assert!(
                info.total_memory > 0 && info.multiprocessors > 0,
                "{info:?}"
            );
        }
        Err(CudaError::NotCompiled) => assert!(!simpler_cuda::compiled()),
        Err(CudaError::Unavailable(why)) => {
            assert!(simpler_cuda::compiled());
            assert!(!why.is_empty());
            eprintln!("no CUDA here: {why}");
        }
        Err(e) => panic!("unexpected error from probe: {e}"),
    }
    let e = probe(1 << 20).map(|_| ()).unwrap_err();
    assert!(
        matches!(e, CudaError::Unavailable(_) | CudaError::NotCompiled),
        "{e}"
    );
}

fn device_or_skip(test: &str) -> Option<CudaDevice> {
    let require = std::env::var("SIMPLER_REQUIRE_CUDA").is_ok_and(|v| v == "1");
    let cache = KernelCache::default_location();
    match CudaDevice::open(0, &cache) {
        Ok((dev, report)) => {
            eprintln!(
                "{test}: {} ({}); {report}",
                dev.info().name,
                dev.info().arch()
            );
            Some(dev)
        }
        Err(e) if require => panic!("SIMPLER_REQUIRE_CUDA=1 but {e}"),
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

fn shape_of(c: &Qwen3Config, batch: usize, max_seq: usize, pages: usize) -> DecodeShape {
    DecodeShape {
        hidden: c.hidden_size,
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        intermediate: c.intermediate_size,
        layers: c.num_hidden_layers,
        vocab: c.vocab_size,
        rms_norm_eps: c.rms_norm_eps as f32,
        batch,
        page_size: 128,
        max_blocks: max_seq.div_ceil(128),
        pages,
        rope_positions: max_seq,
    }
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Two decode steps at batch 17 (two GEMV launches per projection) with ragged lengths
/// crossing page boundaries: logits, greedy ids and every layer's K/V writes against the
/// golden; the second step replays the captured graph with new inputs; and the graph and
/// one-launch-per-kernel paths agree bit for bit. On both kernel sets, for the tiny model
/// (head_dim 64: the plain attention under both) and a variant with head_dim 128 and five
/// query heads per KV head (Qwen3-14B's attention shape: the tensor-core attention).
#[test]
fn decode_steps_match_the_golden() {
    let Some(dev) = device_or_skip("decode_steps_match_the_golden") else {
        return;
    };
    let tiny = Qwen3Config::preset("tiny").unwrap();
    let mut wide = tiny.clone();
    wide.head_dim = 128;
    wide.num_attention_heads = 10;
    wide.num_key_value_heads = 2;
    for c in [&tiny, &wide] {
        let configs = [
            (DecodeKernels::TensorCore, true),
            (DecodeKernels::TensorCore, false),
            (DecodeKernels::Plain, false),
        ];
        for (kernels, pdl) in configs {
            eprintln!(
                "head_dim {}, {} heads / {} KV heads, kernels {}, programmatic launch {pdl}",
                c.head_dim,
                c.num_attention_heads,
                c.num_key_value_heads,
                kernels.name()
            );
            decode_steps_against_the_golden(&dev, c, kernels, pdl);
        }
    }
}

fn decode_steps_against_the_golden(
    dev: &CudaDevice,
    c: &Qwen3Config,
    kernels: DecodeKernels,
    pdl: bool,
) {
    let batch = 17;
    let f = generate_fixture(c, &FixtureOptions::small(batch, 300), None);
    let max_seq = f.batch.max_blocks * 128;
    let rope = c.rope_tables(max_seq);
    let pages = f.kv.num_pages;
    let shape = shape_of(c, batch, max_seq, pages);
    let pool = |l: usize| (f.kv.layer_k(l), f.kv.layer_v(l));
    let layers: Vec<HostLayer<'_>> = (0..c.num_hidden_layers)
        .map(|l| {
            let w = &f.weights.layers[l];
            HostLayer {
                wq: &w.wq,
                wk: &w.wk,
                wv: &w.wv,
                wo: &w.wo,
                w_gate: &w.w_gate,
                w_up: &w.w_up,
                w_down: &w.w_down,
                input_norm: &w.input_norm,
                post_norm: &w.post_norm,
                q_norm: &w.q_norm,
                k_norm: &w.k_norm,
                k_pool: pool(l).0,
                v_pool: pool(l).1,
            }
        })
        .collect();
    let model = HostModel {
        layers,
        embedding: &f.weights.embedding,
        final_norm: &f.weights.final_norm,
        lm_head: f.weights.lm_head(),
        cos: &rope.cos,
        sin: &rope.sin,
    };
    let mut dec = Qwen3Decoder::from_host_with(dev.clone(), shape, &model, kernels).unwrap();
    dec.set_pdl(pdl);
    let mut kv = f.kv.clone();
    let mut paged = f.batch.clone();
    // Ragged lengths 1..=300 (the fixture's pools hold 300 tokens of every sequence).
    paged.seq_lens = (0..batch).map(|b| 1 + (b * 131) % 300).collect();
    let mut tokens = f.tokens.clone();
    for step in 0..2 {
        let lens: Vec<u32> = paged.seq_lens.iter().map(|&l| l as u32).collect();
        let (ids, timing) = dec.step(&tokens, &lens, &paged.block_table, true).unwrap();
        let gpu_logits = dec.logits().unwrap();
        let gold = golden::decode_model(&f.weights, &mut kv, &paged, &rope, &tokens);
        eprintln!(
            "step {step}: device {:?}, host wall {:?}, {} splits",
            timing.device,
            timing.host_wall,
            dec.splits()
        );
        Tolerance::STACK
            .check(&format!("step {step} logits"), &gpu_logits, &gold.logits)
            .unwrap();
        golden::check_argmax(&ids, &gold.next_tokens, &gold.logits, Tolerance::STACK).unwrap();
        let kvw = c.kv_width();
        for l in 0..c.num_hidden_layers {
            let (k, v) = dec.kv_pools(l).unwrap();
            for (b, &len) in paged.seq_lens.iter().enumerate() {
                let s = paged.slot(b, len - 1);
                let (gk, gv) = kv.rows(l, s);
                let what = format!("step {step} layer {l} sequence {b} K");
                Tolerance::ONE_LAYER
                    .check(&what, &to_f32(&k[s * kvw..(s + 1) * kvw]), &to_f32(gk))
                    .unwrap();
                let what = format!("step {step} layer {l} sequence {b} V");
                Tolerance::ONE_LAYER
                    .check(&what, &to_f32(&v[s * kvw..(s + 1) * kvw]), &to_f32(gv))
                    .unwrap();
            }
        }
        if step == 1 {
            // The same inputs again, launched kernel by kernel: the same bits.
            let (ids2, _) = dec.step(&tokens, &lens, &paged.block_table, false).unwrap();
            assert_eq!(ids, ids2);
            let eager = dec.logits().unwrap();
            assert!(
                eager
                    .iter()
                    .zip(&gpu_logits)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "graph replay and eager launches differ"
            );
        }
        tokens = gold.next_tokens.clone();
        paged.seq_lens.iter_mut().for_each(|l| *l += 1);
    }
}

/// Bad per-step inputs are refused by name before anything reaches the device.
#[test]
fn bad_step_inputs_are_refused_by_name() {
    let Some(dev) = device_or_skip("bad_step_inputs_are_refused_by_name") else {
        return;
    };
    let c = Qwen3Config::preset("tiny").unwrap();
    let shape = shape_of(&c, 2, 256, 4);
    let rope = c.rope_tables(256);
    let mut dec = Qwen3Decoder::new_random(dev, shape, 1, &rope.cos, &rope.sin).unwrap();
    let table = [0u32, 1, 2, 3];
    let field = |r: Result<_, CudaError>| match r {
        Err(CudaError::Invalid { field, .. }) => field,
        Err(e) => panic!("unexpected {e}"),
        Ok(_) => panic!("accepted"),
    };
    assert_eq!(field(dec.step(&[1000, 0], &[1, 1], &table, true)), "ids");
    assert_eq!(field(dec.step(&[1, 2], &[0, 1], &table, true)), "seq_lens");
    assert_eq!(
        field(dec.step(&[1, 2], &[257, 1], &table, true)),
        "seq_lens"
    );
    assert_eq!(
        field(dec.step(&[1, 2], &[129, 1], &[0, 9, 2, 3], true)),
        "block_table"
    );
    assert_eq!(
        field(dec.step(&[1, 2], &[1, 1], &[0, 1, 4, 3], true)),
        "block_table"
    );
    assert_eq!(field(dec.step(&[1], &[1], &table, true)), "batch");
    // And a good step still runs after the refusals.
    let (ids, _) = dec.step(&[1, 2], &[1, 129], &table, true).unwrap();
    assert!(ids.iter().all(|&i| (i as usize) < c.vocab_size));
}
