//! The CSA kernels (`simpler_kernels_cpu::dsv4::csa`) composed as one decode step's
//! compressors and indexer, single-threaded, against the independent golden
//! (`dsv4::golden::csa_step`): every state row, compressed row and index row the step writes,
//! each token's scores and its top-k selection. The projections feeding the kernels come from
//! the golden's own building blocks, so a difference is the kernels'.

use simpler_kernels_cpu as k;
use simpler_kernels_cpu::dsv4::csa::{
    IndexQueries, Overlap, index_query_i8, index_row_i8, index_scores, overlap_pool_row,
    overlap_state_write, top_k_rows,
};
use simpler_models::dsv4::check::CacheTol;
use simpler_models::dsv4::fixture::{
    CompressorWeights, Dsv4Fixture, IndexCache, OverlapState, TOKENS_PER_SEQ,
};
use simpler_models::dsv4::golden::{
    self, RopeKind, hc_pre, matvec_bf16, quant_row, rms_norm, rope_cos_sin, rope_inv_freq,
};
use simpler_models::dsv4::{Dsv4Config, MIXED_STARTS, generate_fixture};

/// `(cos, sin)` per pair at `pos`, split as the kernels take them.
fn angles(inv_freq: &[f64], pos: usize) -> (Vec<f32>, Vec<f32>) {
    rope_cos_sin(inv_freq, pos).into_iter().unzip()
}

/// Each token's attention-normed input, from the golden's building blocks.
fn normed_inputs(f: &Dsv4Fixture) -> Vec<Vec<f32>> {
    let cfg = &f.config;
    let n = cfg.hc_mult * cfg.hidden;
    (0..f.inputs.n_tokens())
        .map(|t| {
            let hp = hc_pre(cfg, &f.attn.hc, &f.inputs.x_hc[t * n..(t + 1) * n]);
            rms_norm(&hp.x_mixed, Some(f.attn.attn_norm.as_slice()), cfg.rms_eps)
        })
        .collect()
}

/// What the kernels write for one compressor: state rows (`[kv | score]` per token) and the
/// closed rows `(seq, index, row)`.
struct Compressed {
    kv: Vec<f32>,
    score: Vec<f32>,
    closed: Vec<(usize, usize, Vec<f32>)>,
}

fn run_compressor(
    f: &Dsv4Fixture,
    w: &CompressorWeights,
    state: &OverlapState,
    x_n: &[Vec<f32>],
    inv_freq: &[f64],
) -> Compressed {
    let cfg = &f.config;
    let ov = Overlap {
        ratio: state.ratio,
        width: state.width,
    };
    let wide = ov.row_width();
    let mut kv_ring = state.kv.clone();
    let mut sc_ring = state.score.clone();
    let mut out = Compressed {
        kv: Vec::new(),
        score: Vec::new(),
        closed: Vec::new(),
    };
    for (t, x) in x_n.iter().enumerate() {
        let (b, pos) = (t / TOKENS_PER_SEQ, f.inputs.position(t));
        let ring = b * ov.ring_len()..(b + 1) * ov.ring_len();
        let (kv, gate) = (matvec_bf16(x, &w.wkv, wide), matvec_bf16(x, &w.wgate, wide));
        overlap_state_write(
            ov,
            pos,
            &kv,
            &gate,
            &w.ape,
            &mut kv_ring[ring.clone()],
            &mut sc_ring[ring.clone()],
        );
        let slot = ov.slot(pos) * wide;
        out.kv
            .extend_from_slice(&kv_ring[ring.start + slot..ring.start + slot + wide]);
        out.score
            .extend_from_slice(&sc_ring[ring.start + slot..ring.start + slot + wide]);
        if ov.closes(pos) {
            let w0 = pos + 1 - ov.ratio;
            let (cos, sin) = angles(inv_freq, w0);
            let mut row = vec![0.0f32; ov.width];
            overlap_pool_row(
                ov,
                &kv_ring[ring.clone()],
                &sc_ring[ring],
                w0,
                &w.norm,
                cfg.rms_eps,
                &cos,
                &sin,
                &mut row,
            );
            out.closed.push((b, (pos + 1) / ov.ratio - 1, row));
        }
    }
    out
}

/// The starts of a case: the mixed starts, and starts whose visible rows exceed the top-k.
fn cases() -> Vec<(Dsv4Config, Vec<usize>)> {
    vec![
        (Dsv4Config::tiny(), MIXED_STARTS.to_vec()),
        (Dsv4Config::small(), MIXED_STARTS.to_vec()),
        // small: top-k 16; starts 126 and 130 see 31..33 rows and cross ratio-4 boundaries.
        (Dsv4Config::small(), vec![126, 130, 67, 1023]),
    ]
}

#[test]
fn csa_compressors_and_indexer_match_the_golden() {
    for (cfg, starts) in cases() {
        let f = generate_fixture(&cfg, &starts, 21).unwrap();
        let gold = golden::csa_step(&cfg, &f.attn, &f.window, &f.csa, &f.inputs);
        let gw = gold.csa.as_ref().unwrap();
        let inv_freq = rope_inv_freq(&cfg, RopeKind::Yarn);
        let x_n = normed_inputs(&f);
        let tag = format!("{starts:?} hidden {}", cfg.hidden);

        // Main compressor: state rows exactly, compressed rows at the cache tolerance.
        let main = run_compressor(&f, &f.csa.compressor, &f.csa.state, &x_n, &inv_freq);
        assert_eq!(main.kv, gw.state_write.kv, "{tag}: main state kv");
        assert_eq!(main.score, gw.state_write.score, "{tag}: main state score");
        let mr = f.csa.cache.max_rows;
        let slots: Vec<Option<usize>> = main
            .closed
            .iter()
            .map(|(b, i, _)| Some(b * mr + i))
            .collect();
        assert_eq!(slots, gw.compressed.slots, "{tag}: compressed slots");
        let got: Vec<f32> = main
            .closed
            .iter()
            .flat_map(|(_, _, r)| r.iter().map(|&v| k::f32_to_bf16(v).to_f32()))
            .collect();
        let want: Vec<f32> = gw.compressed.rows.iter().map(|v| v.to_f32()).collect();
        CacheTol::KV
            .check(&format!("{tag}: compressed rows"), &got, &want)
            .unwrap();

        // Indexer compressor: state rows exactly, index rows (dequantised) at the cache
        // tolerance plus half an int8 step.
        let idx = run_compressor(
            &f,
            &f.csa.index_compressor,
            &f.csa.index_state,
            &x_n,
            &inv_freq,
        );
        assert_eq!(idx.kv, gw.index_state_write.kv, "{tag}: index state kv");
        assert_eq!(
            idx.score, gw.index_state_write.score,
            "{tag}: index state score"
        );
        let iw = cfg.index_head_dim;
        let mut cache: IndexCache = f.csa.index_cache.clone();
        assert_eq!(idx.closed.len(), gw.index_write.slots.len(), "{tag}");
        for (n, (b, i, row)) in idx.closed.iter().enumerate() {
            let slot = b * cache.max_rows + i;
            assert_eq!(slot, gw.index_write.slots[n], "{tag}: index slot");
            let mut r = row.clone();
            let s = index_row_i8(&mut r, &mut cache.q[slot * iw..(slot + 1) * iw]);
            cache.scale[slot] = s;
            let ws = gw.index_write.scale[n];
            assert!(
                (s - ws).abs() <= ws / 128.0,
                "{tag}: index scale {s} vs {ws}"
            );
            for c in 0..iw {
                let (g, e) = (
                    f32::from(cache.q[slot * iw + c]) * s,
                    f32::from(gw.index_write.q[n * iw + c]) * ws,
                );
                assert!(
                    (g - e).abs() <= 0.5 * ws + 1e-4 + e.abs() / 128.0,
                    "{tag}: index row {n} channel {c}: {g} vs {e}"
                );
            }
        }

        // Indexer per sequence: query heads from the golden's int8 qr, roped at the step's
        // first position; head weights; scores against the cache with this step's rows; top-k.
        let (ih, q_lora) = (cfg.index_heads, cfg.q_lora_rank);
        let n_idx = ih * iw;
        let wq = &f.csa.wq_idx;
        let w8 = k::WeightsI8::new(&wq.q, &wq.scale, n_idx, q_lora, q_lora);
        for (b, &start) in starts.iter().enumerate() {
            let toks: Vec<usize> = (b * TOKENS_PER_SEQ..(b + 1) * TOKENS_PER_SEQ).collect();
            let mut qi = vec![0i8; toks.len() * n_idx];
            let mut qs = vec![0.0f32; toks.len() * ih];
            let mut wts = vec![0.0f32; toks.len() * ih];
            let (cos, sin) = angles(&inv_freq, start);
            for (j, &t) in toks.iter().enumerate() {
                let qr = rms_norm(
                    &matvec_bf16(&x_n[t], &f.attn.wq_a, q_lora),
                    Some(f.attn.q_norm.as_slice()),
                    cfg.rms_eps,
                );
                let (sa, qr_i8) = quant_row(&qr);
                let qr_i8: Vec<i8> = qr_i8.iter().map(|&v| v as i8).collect();
                let acts = k::ActsI8::new(&qr_i8, std::slice::from_ref(&sa), 1, q_lora, q_lora);
                let mut q = vec![0.0f32; n_idx];
                let tile = k::GemmTile {
                    n: 0..n_idx,
                    k: 0..q_lora,
                    mode: k::OutMode::Store,
                };
                k::gemm_i8_w8a8(w8, acts, &tile, &mut q, n_idx);
                index_query_i8(
                    &mut q,
                    iw,
                    &cos,
                    &sin,
                    &mut qi[j * n_idx..(j + 1) * n_idx],
                    &mut qs[j * ih..(j + 1) * ih],
                );
                for (o, v) in wts[j * ih..(j + 1) * ih].iter_mut().zip(matvec_bf16(
                    &x_n[t],
                    &f.csa.w_weights,
                    ih,
                )) {
                    *o = v * cfg.index_weight_scale();
                }
            }
            let visible: Vec<usize> = toks.iter().map(|&t| gw.picks[t].visible).collect();
            let most = visible.iter().copied().max().unwrap_or(0);
            let mut scores = vec![0.0f32; toks.len() * most];
            let r0 = b * cache.max_rows;
            index_scores(
                IndexQueries {
                    q: &qi,
                    scale: &qs,
                    weight: &wts,
                    tokens: toks.len(),
                    heads: ih,
                    head_dim: iw,
                },
                &cache.q[r0 * iw..(r0 + cache.max_rows) * iw],
                &cache.scale[r0..r0 + cache.max_rows],
                0..most,
                &mut scores,
                most,
            );
            for (j, &t) in toks.iter().enumerate() {
                let pick = &gw.picks[t];
                let got = &scores[j * most..j * most + pick.visible];
                // Scores: the largest golden score sets the scale of the comparison (int8 ties
                // of the query can move a score by a step of one head's contribution).
                let top = pick.scores.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (c, (g, e)) in got.iter().zip(&pick.scores).enumerate() {
                    assert!(
                        (g - e).abs() <= 2e-2 * top + 1e-6,
                        "{tag}: token {t} row {c}: score {g} vs {e}"
                    );
                }
                let mut sel = Vec::new();
                top_k_rows(got, cfg.index_topk, &mut sel);
                assert_eq!(sel.len(), pick.selected.len(), "{tag}: token {t} count");
                // The same rows, except where the golden's scores at the cut are too close to
                // tell apart at this precision.
                let cut = pick.selected.last().map_or(0.0, |&r| pick.scores[r]);
                for &r in &sel {
                    let r = r as usize;
                    assert!(
                        pick.selected.contains(&r) || (pick.scores[r] - cut).abs() <= 2e-2 * top,
                        "{tag}: token {t} selected row {r} (score {}) not in the golden's top-k (cut {cut})",
                        pick.scores[r]
                    );
                }
            }
        }
    }
}
