//! A Qwen3 decode step composed from `simpler-kernels-cpu` (single-threaded, tile by tile as a
//! runtime would: split-K projections accumulating into the residual, split-KV attention)
//! against the independent golden: one layer, K/V writes, and the full model's argmax.

use half::bf16;
use simpler_kernels_cpu as k;
use simpler_models::qwen3::golden::{self, Tolerance};
use simpler_models::qwen3::{
    Fixture, FixtureOptions, KvCache, PagedBatch, Qwen3Config, Qwen3Weights, RopeTables,
    generate_fixture,
};

/// `[rows, n]` = packed acts × `w` `[n, kdim]`, in `k_slices` split-K tiles and two N tiles,
/// optionally scaled per row, accumulated into `out` (which the caller seeds).
#[allow(clippy::too_many_arguments)]
fn project(
    w: &[bf16],
    n: usize,
    kdim: usize,
    packed: &[f32],
    rows: usize,
    scale: Option<&[f32]>,
    out: &mut [f32],
    k_slices: usize,
) {
    let wv = k::WeightsBf16::new(w, n, kdim);
    let xv = k::PackedActs::new(packed, rows, kdim);
    for nt in 0..2 {
        let nr = k::split_range(n, 2, nt);
        for s in 0..k_slices {
            let tile = k::GemmTile {
                n: nr.clone(),
                k: k::split_range(kdim, k_slices, s),
                mode: k::OutMode::Add,
            };
            let o = &mut out[nr.start..];
            match scale {
                Some(sc) => k::gemm_scaled_bf16(wv, xv, &tile, sc, o, n),
                None => k::gemm_bf16(wv, xv, &tile, o, n),
            }
        }
    }
}

fn pack(x: &[bf16], rows: usize, cols: usize) -> Vec<f32> {
    let mut p = vec![0.0; k::packed_len(rows, cols)];
    k::pack_acts_bf16(x, rows, cols, &mut p);
    p
}

/// One decode layer from kernels; returns the new fp32 hidden state.
fn layer(
    w: &Qwen3Weights,
    l: usize,
    kv: &mut KvCache,
    batch: &PagedBatch,
    rope: &RopeTables,
    x: &[f32],
) -> Vec<f32> {
    let c = &w.config;
    let lw = &w.layers[l];
    let (h, d, qw, kvw, inter, b_n) = (
        c.hidden_size,
        c.head_dim,
        c.q_width(),
        c.kv_width(),
        c.intermediate_size,
        batch.batch(),
    );
    let eps = c.rms_norm_eps as f32;
    let mut r = vec![0.0f32; b_n];
    let mut packed = vec![0.0f32; k::packed_len(b_n, h)];
    k::rms_norm_deferred_packed(x, &lw.input_norm, eps, &mut packed, &mut r);
    let (mut q, mut kk, mut v) = (
        vec![0.0f32; b_n * qw],
        vec![0.0f32; b_n * kvw],
        vec![0.0f32; b_n * kvw],
    );
    project(&lw.wq, qw, h, &packed, b_n, Some(&r), &mut q, 3);
    project(&lw.wk, kvw, h, &packed, b_n, Some(&r), &mut kk, 1);
    project(&lw.wv, kvw, h, &packed, b_n, Some(&r), &mut v, 2);
    let mut qb = vec![bf16::ZERO; b_n * qw];
    let slots = batch.slot_mapping();
    for b in 0..b_n {
        let (cos, sin) = rope.row(batch.seq_lens[b] - 1);
        k::qk_norm_rope_bf16(
            &mut q[b * qw..(b + 1) * qw],
            &lw.q_norm,
            eps,
            cos,
            sin,
            &mut qb[b * qw..(b + 1) * qw],
        );
        let mut kb = vec![bf16::ZERO; kvw];
        let mut vb = vec![bf16::ZERO; kvw];
        k::qk_norm_rope_bf16(
            &mut kk[b * kvw..(b + 1) * kvw],
            &lw.k_norm,
            eps,
            cos,
            sin,
            &mut kb,
        );
        k::cast_f32_bf16(&v[b * kvw..(b + 1) * kvw], &mut vb);
        let (kp, vp) = kv.layer_mut(l);
        k::kv_write_bf16(kp, slots[b] as usize, &kb);
        k::kv_write_bf16(vp, slots[b] as usize, &vb);
    }
    let mut a = vec![bf16::ZERO; b_n * qw];
    let group = c.group();
    for b in 0..b_n {
        let pkv = k::PagedKv {
            k: kv.layer_k(l),
            v: kv.layer_v(l),
            kv_heads: c.num_key_value_heads,
            head_dim: d,
            page_size: kv.page_size,
        };
        for g in 0..c.num_key_value_heads {
            let out = &mut a[b * qw + g * group * d..b * qw + (g + 1) * group * d];
            k::decode_attention_bf16(
                &qb[b * qw..(b + 1) * qw],
                group,
                &pkv,
                batch.table(b),
                g,
                batch.seq_lens[b],
                3,
                c.attn_scale(),
                out,
            );
        }
    }
    // h1 = x + a @ Wo: split-K partials accumulate straight into the residual.
    let mut h1 = x.to_vec();
    project(&lw.wo, h, qw, &pack(&a, b_n, qw), b_n, None, &mut h1, 2);
    let mut r2 = vec![0.0f32; b_n];
    k::rms_norm_deferred_packed(&h1, &lw.post_norm, eps, &mut packed, &mut r2);
    let (mut gt, mut up) = (vec![0.0f32; b_n * inter], vec![0.0f32; b_n * inter]);
    project(&lw.w_gate, inter, h, &packed, b_n, Some(&r2), &mut gt, 2);
    project(&lw.w_up, inter, h, &packed, b_n, Some(&r2), &mut up, 2);
    let mut act = vec![bf16::ZERO; b_n * inter];
    k::swiglu_bf16(&gt, &up, &vec![1.0; b_n], &mut act);
    project(
        &lw.w_down,
        h,
        inter,
        &pack(&act, b_n, inter),
        b_n,
        None,
        &mut h1,
        3,
    );
    h1
}

fn fixture() -> Fixture {
    let mut f = generate_fixture(
        &Qwen3Config::preset("small").unwrap(),
        &FixtureOptions::small(3, 300),
        None,
    );
    f.batch.seq_lens = vec![1, 129, 300];
    f
}

#[test]
fn one_layer_and_kv_writes_match_the_golden() {
    let f = fixture();
    let x: Vec<f32> = f.hidden.iter().map(|v| v.to_f32()).collect();
    let mut kv_k = f.kv.clone();
    let got = layer(&f.weights, 0, &mut kv_k, &f.batch, &f.rope, &x);
    let mut kv_g = f.kv.clone();
    let want = golden::decode_layers(&f.weights, 0..1, &mut kv_g, &f.batch, &f.rope, &x);
    Tolerance::ONE_LAYER
        .check("layer 0 hidden", &got, &want.hidden)
        .unwrap();
    let row = f.kv.row();
    for (t, &s) in want.kv_writes[0].slots.iter().enumerate() {
        let (kr, vr) = kv_k.rows(0, s);
        let f32s = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        Tolerance::ONE_LAYER
            .check(
                "K write",
                &f32s(kr),
                &f32s(&want.kv_writes[0].k[t * row..(t + 1) * row]),
            )
            .unwrap();
        Tolerance::ONE_LAYER
            .check(
                "V write",
                &f32s(vr),
                &f32s(&want.kv_writes[0].v[t * row..(t + 1) * row]),
            )
            .unwrap();
    }
}

#[test]
fn full_model_argmax_matches_the_golden() {
    let f = fixture();
    let w = &f.weights;
    let c = &w.config;
    let mut kv = f.kv.clone();
    let b_n = f.batch.batch();
    let mut x = vec![0.0f32; b_n * c.hidden_size];
    k::embedding_gather_bf16(&w.embedding, c.hidden_size, &f.tokens, &mut x);
    for l in 0..c.num_hidden_layers {
        x = layer(w, l, &mut kv, &f.batch, &f.rope, &x);
    }
    let mut n = vec![bf16::ZERO; x.len()];
    k::rms_norm_bf16(&x, &w.final_norm, c.rms_norm_eps as f32, &mut n);
    let mut logits = vec![0.0f32; b_n * c.vocab_size];
    project(
        w.lm_head(),
        c.vocab_size,
        c.hidden_size,
        &pack(&n, b_n, c.hidden_size),
        b_n,
        None,
        &mut logits,
        1,
    );
    let next: Vec<u32> = logits
        .chunks(c.vocab_size)
        .map(|row| {
            let tiles: Vec<_> = row
                .chunks(1000)
                .enumerate()
                .map(|(t, ch)| k::argmax_f32(ch).map(|(i, v)| (t * 1000 + i, v)))
                .collect();
            k::argmax_combine(&tiles).map_or(0, |(i, _)| i as u32)
        })
        .collect();
    let want = golden::decode_model(w, &mut f.kv.clone(), &f.batch, &f.rope, &f.tokens);
    Tolerance::STACK
        .check("hidden after all layers", &x, &want.hidden)
        .unwrap();
    golden::check_argmax(&next, &want.next_tokens, &want.logits, Tolerance::STACK).unwrap();
}
