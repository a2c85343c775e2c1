//! Qwen3 with int8 weights on the runtime (2 CPU cores), both activation modes: the fp32
//! golden on the dequantised weights within the bf16 tolerances, and the bf16 model's logits
//! within the int8 tolerance (`docs/qwen3.md`, "int8 weights").

mod common;

use std::sync::Arc;

use common::qwen3::{check_model_step, stretched_fixture, worker};

use half::bf16;
use simpler_core::{CallConfig, Worker};
use simpler_models::qwen3::golden::{self, Acts, Int8Agreement, Tolerance};
use simpler_models::qwen3::quant::{
    dequantize_matrix_bf16, dequantize_matrix_f32, int8_interleaved, quantize_matrix,
};
use simpler_models::qwen3::{
    Fixture, Int8Acts, KvBuffers, KvCache, LayerWeights, Qwen3Weights, ResidentModel, Session,
    WeightFormat,
};

const MODES: [WeightFormat; 2] = [
    WeightFormat::Int8(Int8Acts::Quantised),
    WeightFormat::Int8(Int8Acts::Wide),
];

/// The weights an int8 model stands for: every projection and the LM head quantised and
/// dequantised, `q · scale` exactly (fp32), or rounded to bf16 (`rounded`, what
/// `ResidentModel::download_layer` reads back).
fn dequantised_with<W: Send + Sync>(
    w: &Qwen3Weights,
    dequantise: impl Fn(&[i8], usize) -> Vec<W>,
) -> Qwen3Weights<W> {
    let c = &w.config;
    let shapes = LayerWeights::shapes(c);
    let round =
        |x: &[bf16], rows: usize, cols: usize| dequantise(&quantize_matrix(x, rows, cols), cols);
    Qwen3Weights {
        config: c.clone(),
        layers: w
            .layers
            .iter()
            .map(|l| {
                Arc::new(l.map_projections(|i, m| {
                    let [r, k] = shapes[i].1;
                    round(m, r, k)
                }))
            })
            .collect(),
        embedding: w.embedding.clone(),
        final_norm: w.final_norm.clone(),
        lm_head: Some(round(w.lm_head(), c.vocab_size, c.hidden_size)),
    }
}

fn dequantised(w: &Qwen3Weights) -> Qwen3Weights<f32> {
    dequantised_with(w, dequantize_matrix_f32)
}

fn rounded(w: &Qwen3Weights) -> Qwen3Weights {
    dequantised_with(w, dequantize_matrix_bf16)
}

fn session(w: &Worker, f: &Fixture, format: WeightFormat) -> Session {
    let model = ResidentModel::upload_as(w, &f.weights, f.rope.max_seq, format, None).unwrap();
    assert_eq!(model.format, format);
    let kv = KvBuffers::new(w, &f.weights.config, f.kv.num_pages, f.kv.page_size).unwrap();
    kv.upload(&f.kv).unwrap();
    Session::new(w, Arc::new(model), kv)
}

#[test]
fn int8_model_matches_the_golden_on_the_dequantised_weights() {
    let f = stretched_fixture("small", &[1, 127, 128, 129, 300]);
    let deq = dequantised(&f.weights);
    let w = worker();
    for format in MODES {
        let want = golden::decode_model_as(
            &deq,
            &mut f.kv.clone(),
            &f.batch,
            &f.rope,
            &f.tokens,
            Acts::of(format),
        );
        // The default split, and five q/k/v blocks, some of them crossing from q's heads into
        // k's and from k's into v's (`GEMM_ROPE_STEP` over interleaved int8 rows).
        for five in [false, true] {
            let mut s = session(&w, &f, format);
            if five {
                s.policy.tiles_per_core = 1;
                s.policy.tile_bytes = (1 << 20) / 5 + 1;
            }
            let got = s
                .decode(&w, &f.batch, &f.tokens, &CallConfig::default())
                .unwrap();
            check_model_step(&format!("{}, five: {five}", format.name()), &got, &want);
        }
    }
}

#[test]
fn int8_logits_agree_with_the_bf16_model() {
    // 64 rows: with 16, one near-tie flipped is 6% of the agreement.
    let lens: Vec<usize> = (0..64).map(|b| 1 + (b * 37) % 290).collect();
    let f = stretched_fixture("small", &lens);
    let w = worker();
    let vocab = f.weights.config.vocab_size;
    let bf16_logits = session(&w, &f, WeightFormat::Bf16)
        .decode(&w, &f.batch, &f.tokens, &CallConfig::default())
        .unwrap()
        .logits;
    for format in MODES {
        let got = session(&w, &f, format)
            .decode(&w, &f.batch, &f.tokens, &CallConfig::default())
            .unwrap();
        let a = Int8Agreement::measure(&got.logits, &bf16_logits, vocab);
        println!("{}: {a:?}", format.name());
        a.check().unwrap();
    }
}

#[test]
fn an_int8_model_reads_back_its_dequantised_weights() {
    let f = stretched_fixture("small", &[5]);
    let w = worker();
    let deq = rounded(&f.weights);
    let m = ResidentModel::upload_as(&w, &f.weights, f.rope.max_seq, MODES[0], None).unwrap();
    assert_eq!(m.download_layer(0).unwrap(), *deq.layers[0]);
    // The exact values, which the CLI's check gives its golden.
    assert_eq!(
        m.download_layer_f32(0).unwrap(),
        *dequantised(&f.weights).layers[0]
    );
    let h = f.weights.config.hidden_size;
    assert_eq!(
        m.download_lm_head_rows(3..7).unwrap(),
        deq.lm_head.as_ref().unwrap()[3 * h..7 * h]
    );
    // The values the head multiplies, unrounded (what the CLI's check feeds its golden), and
    // their bf16 rounding is the readback above.
    let exact = m.download_lm_head_rows_f32(3..7).unwrap();
    let records = quantize_matrix(&f.weights.lm_head()[3 * h..7 * h], 4, h);
    assert_eq!(exact, dequantize_matrix_f32(&records, h));
    assert!(
        exact
            .iter()
            .zip(&deq.lm_head.as_ref().unwrap()[3 * h..7 * h])
            .all(|(a, b)| bf16::from_f32(*a) == *b)
    );
    // The projections were held interleaved where this machine's int8 path reads them so
    // (`quant::int8_interleaved`), records elsewhere: the readback is the same either way.
    let c = &f.weights.config;
    eprintln!(
        "int8 projections held {}",
        if int8_interleaved(c.hidden_size, c.hidden_size, true) {
            "interleaved"
        } else {
            "as records"
        }
    );
    // int8 projections (a byte and 4 / K per value) against bf16 (two bytes).
    let bf = ResidentModel::upload(&w, &f.weights, f.rope.max_seq, None).unwrap();
    assert!(m.resident_bytes() < bf.resident_bytes());
}

/// One int8 layer against the golden on its exact dequantised weights, the W8A8 activations
/// rounded as the model rounds them: within the one-layer tolerance in both modes (on this
/// fixture every element is bit-identical). Until the golden held the weights in fp32 and
/// rounded activation ties to even, as the kernels do, W8A8 had only 87% of the elements
/// within it.
#[test]
fn one_int8_layer_against_the_dequantised_golden() {
    let f = stretched_fixture("small", &[1, 128, 129, 260]);
    let c = &f.weights.config;
    let deq = dequantised(&f.weights);
    let x: Vec<f32> = f.hidden.iter().map(|v| v.to_f32()).collect();
    let w = worker();
    for format in MODES {
        let mut one = one_layer_cache(&f);
        let (want, _) = golden::decode_layer(
            c,
            &deq.layers[0],
            &mut one,
            &f.batch,
            &f.rope,
            &x,
            Acts::of(format),
        );
        let want: Vec<f32> = want.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let mut s = session(&w, &f, format);
        let got = s
            .decode_layers(&w, &f.batch, &f.hidden, 0..1, &CallConfig::default())
            .unwrap();
        let got: Vec<f32> = got.hidden.iter().map(|v| v.to_f32()).collect();
        let identical = got.iter().zip(&want).filter(|(a, b)| a == b).count();
        println!(
            "{}: one layer, {identical} of {} elements bit-identical to the golden",
            format.name(),
            got.len()
        );
        Tolerance::ONE_LAYER
            .check(&format!("{}: one layer", format.name()), &got, &want)
            .unwrap();
    }
}

/// Layer 0's cache of `f` as a one-layer cache.
fn one_layer_cache(f: &Fixture) -> KvCache {
    let c = &f.weights.config;
    KvCache {
        layers: 1,
        num_pages: f.kv.num_pages,
        page_size: f.kv.page_size,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        k: f.kv.layer_k(0).to_vec(),
        v: f.kv.layer_v(0).to_vec(),
    }
}

/// One W8A8 layer against the golden that rounds the projections' activations as W8A8 does
/// (`golden::Acts::PerRowInt8`, plain code of its own) and against the fp32-activation
/// golden: the rounding golden is the closer one, by a margin — the activations' rounding is
/// part of what the model computes, and the check would miss a kernel that skipped it.
#[test]
fn one_w8a8_layer_is_closer_to_the_golden_that_rounds_its_activations() {
    let f = stretched_fixture("small", &[1, 128, 129, 260]);
    let c = &f.weights.config;
    let deq = dequantised(&f.weights);
    let x: Vec<f32> = f.hidden.iter().map(|v| v.to_f32()).collect();
    let golden_with = |acts: Acts| {
        let mut one = one_layer_cache(&f);
        let (h, _) = golden::decode_layer(c, &deq.layers[0], &mut one, &f.batch, &f.rope, &x, acts);
        h.iter()
            .map(|&v| bf16::from_f32(v).to_f32())
            .collect::<Vec<f32>>()
    };
    let (rounding, float) = (golden_with(Acts::PerRowInt8), golden_with(Acts::Float));
    let w = worker();
    let mut s = session(&w, &f, MODES[0]);
    let got = s
        .decode_layers(&w, &f.batch, &f.hidden, 0..1, &CallConfig::default())
        .unwrap();
    let got: Vec<f32> = got.hidden.iter().map(|v| v.to_f32()).collect();
    let mean = |want: &[f32]| {
        got.iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .sum::<f32>()
            / got.len() as f32
    };
    let (mr, mf) = (mean(&rounding), mean(&float));
    println!(
        "W8A8 one layer: mean |a-e| {mr:.3e} against the rounding golden, {mf:.3e} against fp32"
    );
    // Measured 0 against 2.0e-3 on this seeded fixture.
    assert!(
        mf > 0.0 && mr < 0.1 * mf,
        "rounding golden {mr} vs fp32 golden {mf}"
    );
}

/// Consecutive decode steps of one int8 session (the graph replayed from the second step on;
/// each core reuses the int8 activations it prepared for a task across that task's blocks):
/// every step against the golden on the dequantised weights, with the positions and the
/// tokens changing from step to step, so activations prepared for one step's task standing
/// in for the next step's would show.
/// int8 decode steps replayed from a captured graph give the bits of orchestrated ones, in
/// both activation modes, and every replayed step's graph equals a fresh capture of its own
/// orchestration (a verifying session, `Session::verify_replay`).
#[test]
fn replayed_int8_steps_are_bit_identical_to_orchestrated_and_verified_ones() {
    use simpler_core::GraphMode;
    let f = stretched_fixture("small", &[300, 300]);
    let w = worker();
    let cfg = CallConfig::default();
    for format in MODES {
        let mut replaying = session(&w, &f, format);
        let mut verifying = session(&w, &f, format);
        verifying.verify_replay = true;
        let mut orchestrated = session(&w, &f, format);
        orchestrated.replay = false;
        let mut batch = f.batch.clone();
        batch.seq_lens = vec![120, 250];
        let mut tokens = vec![5u32, 77];
        let mut replayed = 0;
        for step in 0..12 {
            let r = replaying.decode(&w, &batch, &tokens, &cfg).unwrap();
            let v = verifying
                .decode(&w, &batch, &tokens, &cfg)
                .unwrap_or_else(|e| panic!("{} step {step}: {e}", format.name()));
            let o = orchestrated.decode(&w, &batch, &tokens, &cfg).unwrap();
            assert_eq!(o.report.graph, GraphMode::Orchestrated);
            if matches!(r.report.graph, GraphMode::Replayed { .. }) {
                replayed += 1;
            }
            for (name, x) in [("verified", &v), ("orchestrated", &o)] {
                assert_eq!(
                    r.next_tokens,
                    x.next_tokens,
                    "{} step {step}",
                    format.name()
                );
                assert!(
                    r.logits
                        .iter()
                        .map(|v| v.to_bits())
                        .eq(x.logits.iter().map(|v| v.to_bits())),
                    "{} step {step}: replayed logits differ from the {name} step's",
                    format.name()
                );
            }
            tokens = r.next_tokens;
            // Across the page at 128 (sequence 0) at step 8.
            batch.seq_lens.iter_mut().for_each(|l| *l += 1);
        }
        assert!(replayed >= 9, "{}: {replayed} replays", format.name());
    }
}

#[test]
fn consecutive_int8_steps_each_match_the_golden() {
    let f = stretched_fixture("small", &[1, 127, 128, 129, 296]);
    let deq = dequantised(&f.weights);
    let w = worker();
    for format in MODES {
        let mut s = session(&w, &f, format);
        let mut kv = f.kv.clone();
        let mut batch = f.batch.clone();
        let mut tokens = f.tokens.clone();
        for step in 0..4 {
            let want =
                golden::decode_model_as(&deq, &mut kv, &batch, &f.rope, &tokens, Acts::of(format));
            let got = s
                .decode(&w, &batch, &tokens, &CallConfig::default())
                .unwrap();
            check_model_step(&format!("{} step {step}", format.name()), &got, &want);
            tokens = want.next_tokens.clone();
            batch.seq_lens.iter_mut().for_each(|l| *l += 1);
        }
    }
}
