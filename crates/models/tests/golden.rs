//! The golden against itself and against a straightforward recomputation: paged layout
//! invariance with ragged lengths crossing pages, one layer in f64 loops, the bf16 chunk
//! variant, KV writes landing in the cache, and prefill-then-decode vs token-by-token decode.

use half::bf16;
use simpler_models::qwen3::golden::{self, PrefillChunk, Tolerance};
use simpler_models::qwen3::{FixtureOptions, KvCache, PagedBatch, Qwen3Config, generate_fixture};

fn tiny() -> Qwen3Config {
    Qwen3Config::preset("tiny").unwrap()
}

/// A fixture of `lens.len()` sequences with ragged lengths (up to 3 pages each).
fn ragged(lens: &[usize]) -> simpler_models::qwen3::Fixture {
    let mut f = generate_fixture(&tiny(), &FixtureOptions::small(lens.len(), 3 * 128), None);
    f.batch.seq_lens = lens.to_vec();
    f
}

#[test]
fn paged_layout_does_not_change_results() {
    let f = ragged(&[1, 128, 129, 300]);
    let x: Vec<f32> = f.hidden.iter().map(|v| v.to_f32()).collect();
    let mut kv_a = f.kv.clone();
    let a = golden::decode_layers(&f.weights, 0..2, &mut kv_a, &f.batch, &f.rope, &x);
    // Same logical contents with pages reversed.
    let pages = f.batch.num_pages();
    let mut shuffled = f.batch.clone();
    shuffled.block_table = f
        .batch
        .block_table
        .iter()
        .map(|&p| (pages - 1) as u32 - p)
        .collect();
    let mut kv_b = f.kv.clone();
    let row = f.kv.row() * f.kv.page_size;
    for l in 0..f.kv.layers {
        let (kp, vp) = kv_b.layer_mut(l);
        for p in 0..pages {
            let q = pages - 1 - p;
            kp[q * row..(q + 1) * row].copy_from_slice(&f.kv.layer_k(l)[p * row..(p + 1) * row]);
            vp[q * row..(q + 1) * row].copy_from_slice(&f.kv.layer_v(l)[p * row..(p + 1) * row]);
        }
    }
    let b = golden::decode_layers(&f.weights, 0..2, &mut kv_b, &shuffled, &f.rope, &x);
    assert_eq!(a.hidden, b.hidden);
    for (wa, wb) in a.kv_writes.iter().zip(&b.kv_writes) {
        assert_eq!(wa.k, wb.k);
        assert_eq!(wa.v, wb.v);
    }
    // The writes are in the cache, at the slot mapping.
    let slots = f.batch.slot_mapping();
    for (l, w) in a.kv_writes.iter().enumerate() {
        assert_eq!(
            w.slots,
            slots.iter().map(|&s| s as usize).collect::<Vec<_>>()
        );
        for (t, &s) in w.slots.iter().enumerate() {
            let (k, v) = kv_a.rows(l, s);
            assert_eq!(k, &w.k[t * kv_a.row()..(t + 1) * kv_a.row()]);
            assert_eq!(v, &w.v[t * kv_a.row()..(t + 1) * kv_a.row()]);
        }
    }
    let (hb, _) = golden::decode_layers_bf16(
        &f.weights,
        0..2,
        &mut f.kv.clone(),
        &f.batch,
        &f.rope,
        &f.hidden,
    );
    let rounded: Vec<bf16> = a.hidden.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(hb, rounded);
}

/// One decode layer in f64 with plain loops, the cast points of the spec, no paging helpers.
fn layer_f64(f: &simpler_models::qwen3::Fixture, x: &[f32]) -> Vec<f32> {
    let c = &f.weights.config;
    let w = &f.weights.layers[0];
    let (h, d, qw, kvw, inter) = (
        c.hidden_size,
        c.head_dim,
        c.q_width(),
        c.kv_width(),
        c.intermediate_size,
    );
    let eps = c.rms_norm_eps;
    let rb = |v: f64| f64::from(bf16::from_f32(v as f32).to_f32());
    let mm = |inp: &[f64], wt: &[bf16], n: usize, k: usize| -> Vec<f64> {
        (0..n)
            .map(|o| {
                (0..k)
                    .map(|i| inp[i] * f64::from(wt[o * k + i].to_f32()))
                    .sum()
            })
            .collect()
    };
    let rms =
        |v: &[f64]| 1.0 / (v.iter().map(|a| a * a).sum::<f64>() / v.len() as f64 + eps).sqrt();
    let mut out = Vec::new();
    for b in 0..f.batch.batch() {
        let xr: Vec<f64> = x[b * h..(b + 1) * h]
            .iter()
            .map(|&v| f64::from(v))
            .collect();
        let r = rms(&xr);
        let n: Vec<f64> = (0..h)
            .map(|i| rb(xr[i] * f64::from(w.input_norm[i])))
            .collect();
        let mut q: Vec<f64> = mm(&n, &w.wq, qw, h).iter().map(|v| v * r).collect();
        let mut k: Vec<f64> = mm(&n, &w.wk, kvw, h).iter().map(|v| v * r).collect();
        let v: Vec<f64> = mm(&n, &w.wv, kvw, h).iter().map(|v| rb(v * r)).collect();
        let pos = f.batch.seq_lens[b] - 1;
        let (cos, sin) = f.rope.row(pos);
        for (t, nw) in [(&mut q, &w.q_norm), (&mut k, &w.k_norm)] {
            for head in t.chunks_mut(d) {
                let rr = rms(head);
                let y: Vec<f64> = head
                    .iter()
                    .zip(nw.iter())
                    .map(|(a, g)| a * rr * f64::from(*g))
                    .collect();
                for i in 0..d / 2 {
                    head[i] = rb(y[i] * f64::from(cos[i]) - y[i + d / 2] * f64::from(sin[i]));
                    head[i + d / 2] =
                        rb(y[i + d / 2] * f64::from(cos[i + d / 2])
                            + y[i] * f64::from(sin[i + d / 2]));
                }
            }
        }
        // Keys/values: the cached tokens (computed slot by slot here), then the new one.
        let mut a = vec![0.0f64; qw];
        for hq in 0..c.num_attention_heads {
            let g = hq / c.group();
            let mut s = Vec::new();
            let mut vals = Vec::new();
            for p in 0..=pos {
                let (kr, vr): (Vec<f64>, Vec<f64>) = if p == pos {
                    (
                        k[g * d..(g + 1) * d].to_vec(),
                        v[g * d..(g + 1) * d].to_vec(),
                    )
                } else {
                    let page = f.batch.block_table[b * f.batch.max_blocks + p / 128] as usize;
                    let slot = page * 128 + p % 128;
                    let (kk, vv) = f.kv.rows(0, slot);
                    (
                        kk[g * d..(g + 1) * d]
                            .iter()
                            .map(|v| f64::from(v.to_f32()))
                            .collect(),
                        vv[g * d..(g + 1) * d]
                            .iter()
                            .map(|v| f64::from(v.to_f32()))
                            .collect(),
                    )
                };
                s.push((0..d).map(|i| q[hq * d + i] * kr[i]).sum::<f64>() / (d as f64).sqrt());
                vals.push(vr);
            }
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = s.iter().map(|v| (v - m).exp()).sum();
            for i in 0..d {
                a[hq * d + i] = rb(s
                    .iter()
                    .zip(&vals)
                    .map(|(sv, vr)| (sv - m).exp() * vr[i])
                    .sum::<f64>()
                    / l);
            }
        }
        let ao = mm(&a, &w.wo, h, qw);
        let h1: Vec<f64> = xr.iter().zip(&ao).map(|(a, b)| a + b).collect();
        let r2 = rms(&h1);
        let m: Vec<f64> = (0..h)
            .map(|i| rb(h1[i] * f64::from(w.post_norm[i])))
            .collect();
        let gt: Vec<f64> = mm(&m, &w.w_gate, inter, h).iter().map(|v| v * r2).collect();
        let up: Vec<f64> = mm(&m, &w.w_up, inter, h).iter().map(|v| v * r2).collect();
        let act: Vec<f64> = gt
            .iter()
            .zip(&up)
            .map(|(g, u)| rb(g / (1.0 + (-g).exp()) * u))
            .collect();
        let dn = mm(&act, &w.w_down, h, inter);
        out.extend(h1.iter().zip(&dn).map(|(a, b)| (a + b) as f32));
    }
    out
}

#[test]
fn one_layer_matches_an_f64_recomputation() {
    let f = ragged(&[5, 130]);
    let x: Vec<f32> = f.hidden.iter().map(|v| v.to_f32()).collect();
    let e = layer_f64(&f, &x);
    let a = golden::decode_layers(&f.weights, 0..1, &mut f.kv.clone(), &f.batch, &f.rope, &x);
    Tolerance::ONE_LAYER
        .check("golden layer 0", &a.hidden, &e)
        .unwrap();
    // The check can fail: a perturbed output does not pass.
    let mut bad = a.hidden.clone();
    bad.iter_mut().step_by(10).for_each(|v| *v += 0.5);
    assert!(Tolerance::ONE_LAYER.check("perturbed", &bad, &e).is_err());
}

#[test]
fn prefill_then_decode_matches_token_by_token_decode() {
    let c = tiny();
    let f = generate_fixture(
        &c,
        &FixtureOptions {
            fill_kv: false,
            ..FixtureOptions::small(2, 256)
        },
        None,
    );
    let rope = c.rope_tables(256);
    // Two prompts of ragged length, the longer crossing a page boundary.
    let prompts: Vec<Vec<u32>> = vec![
        (0..7).map(|i| (i * 37 % 1000) as u32).collect(),
        (0..133).map(|i| (i * 11 + 3) % 1000).collect(),
    ];
    let table = PagedBatch::identity(vec![1, 1], 256, 128);

    // Token by token.
    let mut kv_a = KvCache::zeros(&c, table.num_pages(), 128);
    let mut last_a = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        for (i, &tok) in p.iter().enumerate() {
            let mut b = table.clone();
            b.seq_lens = vec![i + 1; 2];
            // Decode only sequence s: a batch of one with its table row.
            let one = PagedBatch {
                page_size: 128,
                max_blocks: b.max_blocks,
                block_table: b.table(s).to_vec(),
                seq_lens: vec![i + 1],
            };
            let out = golden::decode_model(&f.weights, &mut kv_a, &one, &rope, &[tok]);
            if i + 1 == p.len() {
                last_a.push(out);
            }
        }
    }
    // Chunked prefill: two chunks per prompt, both sequences in each step.
    let mut kv_b = KvCache::zeros(&c, table.num_pages(), 128);
    let cut: Vec<usize> = prompts.iter().map(|p| p.len() / 2).collect();
    let step1: Vec<PrefillChunk> = prompts
        .iter()
        .enumerate()
        .map(|(s, p)| PrefillChunk {
            seq: s,
            tokens: p[..cut[s]].to_vec(),
            seq_len: cut[s],
        })
        .collect();
    golden::prefill_model(&f.weights, &mut kv_b, &table, &rope, &step1);
    let step2: Vec<PrefillChunk> = prompts
        .iter()
        .enumerate()
        .map(|(s, p)| PrefillChunk {
            seq: s,
            tokens: p[cut[s]..].to_vec(),
            seq_len: p.len(),
        })
        .collect();
    let pre = golden::prefill_model(&f.weights, &mut kv_b, &table, &rope, &step2);
    let decoded: Vec<u32> = last_a.iter().map(|o| o.next_tokens[0]).collect();
    let logits_a: Vec<f32> = last_a
        .iter()
        .flat_map(|o| o.logits.iter().copied())
        .collect();
    golden::check_argmax(&pre.next_tokens, &decoded, &logits_a, Tolerance::STACK).unwrap();
    Tolerance::STACK
        .check("prefill vs decode logits", &pre.logits, &logits_a)
        .unwrap();
    // The caches agree too, and a further decode step gives the same token.
    for (s, p) in prompts.iter().enumerate() {
        let one = PagedBatch {
            page_size: 128,
            max_blocks: table.max_blocks,
            block_table: table.table(s).to_vec(),
            seq_lens: vec![p.len() + 1],
        };
        let next = last_a[s].next_tokens[0];
        let a = golden::decode_model(&f.weights, &mut kv_a.clone(), &one, &rope, &[next]);
        let b = golden::decode_model(&f.weights, &mut kv_b.clone(), &one, &rope, &[next]);
        golden::check_argmax(&b.next_tokens, &a.next_tokens, &a.logits, Tolerance::STACK).unwrap();
    }
    let ka: Vec<f32> = kv_a.k.iter().map(|v| v.to_f32()).collect();
    let kb: Vec<f32> = kv_b.k.iter().map(|v| v.to_f32()).collect();
    Tolerance::STACK.check("K caches", &kb, &ka).unwrap();
}
