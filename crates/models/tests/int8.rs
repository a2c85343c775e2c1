//! Qwen3 with int8 weights on the runtime (2 CPU cores), both activation modes: the fp32
//! golden on the dequantised weights within the bf16 tolerances, and the bf16 model's logits
//! within the int8 tolerance (`docs/qwen3.md`, "int8 weights").

mod common;

use std::sync::Arc;

use common::qwen3::{check_model_step, stretched_fixture, worker};

use half::bf16;
use simpler_core::{CallConfig, Worker};
use simpler_models::qwen3::golden::{self, Int8Agreement, Tolerance};
use simpler_models::qwen3::quant::{
    dequantize_matrix_bf16, dequantize_matrix_f32, int8_interleaved, quantize_matrix,
};
use simpler_models::qwen3::{
    Fixture, Int8Acts, KvBuffers, LayerWeights, Qwen3Weights, ResidentModel, Session, WeightFormat,
};

const MODES: [WeightFormat; 2] = [
    WeightFormat::Int8(Int8Acts::Quantised),
    WeightFormat::Int8(Int8Acts::Wide),
];

/// The weights an int8 model stands for: every projection and the LM head quantised and
/// dequantised (rounded to bf16, the golden's weight type).
fn dequantised(w: &Qwen3Weights) -> Qwen3Weights {
    let c = &w.config;
    let round = |x: &[bf16], rows: usize, cols: usize| {
        dequantize_matrix_bf16(&quantize_matrix(x, rows, cols), cols)
    };
    let shapes = LayerWeights::shapes(c);
    let mut out = w.clone();
    out.layers = w
        .layers
        .iter()
        .map(|l| {
            let mut l = (**l).clone();
            for (i, m) in [
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ]
            .into_iter()
            .enumerate()
            {
                let [r, k] = shapes[i].1;
                *m = round(m, r, k);
            }
            Arc::new(l)
        })
        .collect();
    out.lm_head = Some(round(w.lm_head(), c.vocab_size, c.hidden_size));
    out
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
    let want = golden::decode_model(&deq, &mut f.kv.clone(), &f.batch, &f.rope, &f.tokens);
    let w = worker();
    for format in MODES {
        let mut s = session(&w, &f, format);
        let got = s
            .decode(&w, &f.batch, &f.tokens, &CallConfig::default())
            .unwrap();
        check_model_step(format.name(), &got, &want);
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
    let deq = dequantised(&f.weights);
    let m = ResidentModel::upload_as(&w, &f.weights, f.rope.max_seq, MODES[0], None).unwrap();
    assert_eq!(m.download_layer(0).unwrap(), *deq.layers[0]);
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

/// One int8 layer against the golden on the dequantised weights: within the stack tolerance,
/// and — the measured reason the int8 checks use it — outside the one-layer tolerance for
/// W8A8 (its quantised activations), while the wide mode comes within a fraction of it (the
/// golden's weights are the dequantised values rounded to bf16).
#[test]
fn one_int8_layer_against_the_dequantised_golden() {
    let f = stretched_fixture("small", &[1, 128, 129, 260]);
    let deq = dequantised(&f.weights);
    let x: Vec<f32> = f.hidden.iter().map(|v| v.to_f32()).collect();
    let mut kv = f.kv.clone();
    let want = golden::decode_layers(&deq, 0..1, &mut kv, &f.batch, &f.rope, &x);
    let want_bf16: Vec<f32> = want
        .hidden
        .iter()
        .map(|&v| bf16::from_f32(v).to_f32())
        .collect();
    let w = worker();
    for format in MODES {
        let mut s = session(&w, &f, format);
        let got = s
            .decode_layers(&w, &f.batch, &f.hidden, 0..1, &CallConfig::default())
            .unwrap();
        let got: Vec<f32> = got.hidden.iter().map(|v| v.to_f32()).collect();
        Tolerance::STACK
            .check(&format!("{}: one layer", format.name()), &got, &want_bf16)
            .unwrap();
        let one = Tolerance::ONE_LAYER.check("one layer", &got, &want_bf16);
        println!(
            "{}: against the one-layer tolerance: {one:?}",
            format.name()
        );
    }
}

/// One W8A8 layer against the golden that rounds the projections' activations as W8A8 does
/// (`golden::Acts::PerRowInt8`, plain code of its own) and against the fp32-activation
/// golden: the rounding golden is the closer one, by a margin.
#[test]
fn one_w8a8_layer_is_closer_to_the_golden_that_rounds_its_activations() {
    use simpler_models::qwen3::KvCache;
    use simpler_models::qwen3::golden::Acts;
    let f = stretched_fixture("small", &[1, 128, 129, 260]);
    let c = &f.weights.config;
    let deq = dequantised(&f.weights);
    let x: Vec<f32> = f.hidden.iter().map(|v| v.to_f32()).collect();
    let golden_with = |acts: Acts| {
        let mut one = KvCache {
            layers: 1,
            num_pages: f.kv.num_pages,
            page_size: f.kv.page_size,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            k: f.kv.layer_k(0).to_vec(),
            v: f.kv.layer_v(0).to_vec(),
        };
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
    // Mean |a - e| (the outputs are bf16, so the worst element is a bf16 step either way).
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
    // Measured 0.67 on this seeded fixture: the rounding golden removes the activations'
    // rounding noise, not the steps that flip where an activation sits near a boundary (a
    // small difference upstream, such as the golden's bf16-rounded weights, moves it across).
    assert!(mr < 0.8 * mf, "rounding golden {mr} vs fp32 golden {mf}");
}

/// Consecutive decode steps of one int8 session (the graph replayed from the second step on;
/// each core reuses the int8 activations it prepared for a task across that task's blocks):
/// every step against the golden on the dequantised weights, with the positions and the
/// tokens changing from step to step, so activations prepared for one step's task standing
/// in for the next step's would show.
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
            let want = golden::decode_model(&deq, &mut kv, &batch, &f.rope, &tokens);
            let got = s
                .decode(&w, &batch, &tokens, &CallConfig::default())
                .unwrap();
            check_model_step(&format!("{} step {step}", format.name()), &got, &want);
            tokens = want.next_tokens.clone();
            batch.seq_lens.iter_mut().for_each(|l| *l += 1);
        }
    }
}
