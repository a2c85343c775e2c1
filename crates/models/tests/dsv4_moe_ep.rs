//! The expert-parallel MoE step's pieces (`moe_ep`, the split step of `MoeLayer`) with the
//! exchanges done by plain copies between in-process ranks: every output of EP 2 and EP 4 is
//! bit-identical to the single-rank step of the same fixture, with ranks that hold only their
//! own experts, mixed starts, a hash-routed and a top-k-routed layer. (The node level runs the
//! same pieces over real collectives; the CLI tests cover those.)

mod common;

use simpler_core::{CallConfig, Worker};
use simpler_models::dsv4::fixture::{
    generate_inputs, generate_moe_weights, generate_moe_weights_local,
};
use simpler_models::dsv4::moe_ep::{
    combine_recv_counts, pack_combine, pack_dispatch, rank_tokens, unpack_combine, unpack_dispatch,
};
use simpler_models::dsv4::moe_graph::{ExpertPlacement, MoeLayer, MoeOutput};
use simpler_models::dsv4::{Dsv4Config, MIXED_STARTS, moe_ops};

fn worker() -> Worker {
    let w = common::two_core_worker();
    moe_ops::register(&w).unwrap();
    simpler_models::dsv4::ops::register(&w).unwrap();
    w
}

/// Rank `s`'s message to rank `j` out of its back-to-back send.
fn message(bytes: &[u8], counts: &[usize], j: usize) -> Vec<u8> {
    let start: usize = counts[..j].iter().sum();
    bytes[start..start + counts[j]].to_vec()
}

/// All-to-all by copies: `sends[s] = (bytes, counts)`; returns each rank's `(recv, counts)`.
fn all_to_all(sends: &[(Vec<u8>, Vec<usize>)]) -> Vec<(Vec<u8>, Vec<usize>)> {
    let n = sends.len();
    (0..n)
        .map(|j| {
            let parts: Vec<Vec<u8>> = sends.iter().map(|(b, c)| message(b, c, j)).collect();
            let counts = parts.iter().map(Vec::len).collect();
            (parts.concat(), counts)
        })
        .collect()
}

/// One expert-parallel step over `ep` in-process ranks; returns each rank's output.
fn ep_step(w: &Worker, cfg: &Dsv4Config, seed: u64, layer: usize, ep: usize) -> Vec<MoeOutput> {
    let inputs = generate_inputs(cfg, &MIXED_STARTS, seed);
    let placement = ExpertPlacement {
        n_experts: cfg.n_routed_experts,
        per_rank: cfg.n_routed_experts / ep,
    };
    let (t, d, k, hc) = (
        inputs.n_tokens(),
        cfg.hidden,
        cfg.n_activated_experts,
        cfg.hc_mult,
    );
    let run = CallConfig::default();
    let layers: Vec<MoeLayer> = (0..ep)
        .map(|r| {
            let weights = generate_moe_weights_local(cfg, seed, placement.local(r));
            MoeLayer::new(w, cfg, &weights, layer, placement, r).unwrap()
        })
        .collect();
    let fronts: Vec<_> = (0..ep)
        .map(|r| {
            let mine = rank_tokens(t, ep, r);
            let x = &inputs.x_hc[mine.start * hc * d..mine.end * hc * d];
            layers[r]
                .front_step(w, x, &inputs.token_ids[mine], &run)
                .unwrap()
        })
        .collect();
    let sent: Vec<_> = fronts
        .iter()
        .map(|f| pack_dispatch(&placement, f, d).unwrap())
        .collect();
    let received = all_to_all(
        &sent
            .iter()
            .map(|s| (s.bytes.clone(), s.counts.clone()))
            .collect::<Vec<_>>(),
    );
    let mut expert_outs = Vec::new();
    let mut back_sends = Vec::new();
    for r in 0..ep {
        let rx = unpack_dispatch(&placement, r, d, &received[r].0, &received[r].1).unwrap();
        let out = layers[r]
            .expert_step(w, &fronts[r], &rx.rows, &run)
            .unwrap();
        back_sends.push(pack_combine(&rx, &out.y_rows, d).unwrap());
        expert_outs.push(out);
    }
    let combined = all_to_all(&back_sends);
    (0..ep)
        .map(|r| {
            assert_eq!(combined[r].1, combine_recv_counts(&sent[r], d));
            let routes = rank_tokens(t, ep, r).len() * k;
            let routed = unpack_combine(&sent[r], &combined[r].0, routes, d).unwrap();
            layers[r]
                .back_step(w, &fronts[r], &expert_outs[r], &routed, &run)
                .unwrap()
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_ep_equals_single(cfg: &Dsv4Config, layer: usize, ep: usize) {
    let w = worker();
    let seed = 5;
    let inputs = generate_inputs(cfg, &MIXED_STARTS, seed);
    let single = MoeLayer::new(
        &w,
        cfg,
        &generate_moe_weights(cfg, seed),
        layer,
        ExpertPlacement::single(cfg.n_routed_experts),
        0,
    )
    .unwrap()
    .step(&w, &inputs.x_hc, &inputs.token_ids, &CallConfig::default())
    .unwrap();
    let ranks = ep_step(&w, cfg, seed, layer, ep);
    let cat = |f: fn(&MoeOutput) -> &Vec<f32>| -> Vec<u32> {
        ranks.iter().flat_map(|o| bits(f(o))).collect()
    };
    for (what, got, want) in [
        ("x_out", cat(|o| &o.x_out), bits(&single.x_out)),
        ("y", cat(|o| &o.y), bits(&single.y)),
        ("routed", cat(|o| &o.routed), bits(&single.routed)),
        ("weights", cat(|o| &o.weights), bits(&single.weights)),
        ("x_mixed", cat(|o| &o.x_mixed), bits(&single.x_mixed)),
    ] {
        assert!(
            got == want,
            "EP {ep} layer {layer}: {what} differs from one rank"
        );
    }
    // Shared outputs are [S, T_rank, D] per rank: compare token rows.
    let (s, d, t) = (cfg.n_shared_experts, cfg.hidden, inputs.n_tokens());
    for (r, o) in ranks.iter().enumerate() {
        let mine = rank_tokens(t, ep, r);
        for si in 0..s {
            let got = &o.shared[si * mine.len() * d..(si + 1) * mine.len() * d];
            let want = &single.shared[(si * t + mine.start) * d..(si * t + mine.end) * d];
            assert!(bits(got) == bits(want), "EP {ep}: shared of rank {r}");
        }
    }
    let experts: Vec<u32> = ranks.iter().flat_map(|o| o.experts.clone()).collect();
    assert_eq!(experts, single.experts, "EP {ep}: routing");
    // Rows crossed ranks, so the exchange was exercised (a rank may receive none: EP 8 on
    // the tiny preset has experts no route picks).
    let p = ExpertPlacement {
        n_experts: cfg.n_routed_experts,
        per_rank: cfg.n_routed_experts / ep,
    };
    let hit = (0..ep)
        .filter(|&r| experts.iter().any(|&e| p.rank_of(e as usize) == r))
        .count();
    assert!(hit >= 2, "EP {ep}: rows reached {hit} rank(s)");
}

#[test]
fn ep2_and_ep4_equal_one_rank_bit_for_bit_small() {
    let cfg = Dsv4Config::small();
    for ep in [2, 4] {
        // The first top-k layer and a hash-routed one.
        assert_ep_equals_single(&cfg, cfg.n_hash_layers, ep);
        assert_ep_equals_single(&cfg, 0, ep);
    }
}

#[test]
fn ep8_equals_one_rank_tiny() {
    // 8 tokens over 8 ranks: one token and one expert each.
    let cfg = Dsv4Config::tiny();
    assert_ep_equals_single(&cfg, cfg.n_hash_layers, 8);
}
