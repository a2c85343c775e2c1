//! The DeepSeek-V4 MoE decode step on the runtime (2 CPU cores) against the independent golden
//! (`docs/dsv4.md`, "MoE on the runtime"): the reduced output within the MoE tolerance, the
//! shared sum and every per-route contribution, and the routing itself, for hash-routed and
//! top-k-routed layers, with mixed starts, an expert that gets every token and one that gets
//! none, and once at FLASH width.

mod common;

use simpler_core::{CallConfig, DType, RunArgs, Task, Worker};
use simpler_kernels_cpu::dsv4::moe::{ExpertI8, expert_forward};
use simpler_kernels_cpu::{ActsI8, WeightsI8};
use simpler_models::dsv4::check::{CacheTol, RelDiff};
use simpler_models::dsv4::fixture::{
    Expert, Int8Matrix, MoeWeights, StepInputs, generate_inputs, generate_moe_weights,
};
use simpler_models::dsv4::golden::{HcPre, moe_after_hc_pre, moe_step};
use simpler_models::dsv4::moe_graph::{ExpertPlacement, MoeLayer, MoeRunError};
use simpler_models::dsv4::{Dsv4Config, MIXED_STARTS, moe_ops, uniform_starts};

fn worker() -> Worker {
    let w = common::two_core_worker();
    moe_ops::register(&w).unwrap();
    simpler_models::dsv4::ops::register(&w).unwrap();
    w
}

/// The tiny configuration's MoE layer `layer` on one rank (weights from `seed`) and a step's
/// residual of 8 tokens, every value `value`.
fn tiny_layer(
    w: &Worker,
    seed: u64,
    layer: usize,
    value: f32,
) -> (Dsv4Config, MoeWeights, MoeLayer, Vec<f32>) {
    let cfg = Dsv4Config::tiny();
    let weights = generate_moe_weights(&cfg, seed);
    let moe = MoeLayer::new(w, &cfg, &weights, layer, ExpertPlacement::single(8), 0).unwrap();
    let x = vec![value; 8 * cfg.hc_mult * cfg.hidden];
    (cfg, weights, moe, x)
}

/// Runs layer `layer` on the runtime and checks it against the golden; returns the routes.
///
/// End to end (`y`, `x_out` against `golden::moe_step`) and stage by stage: `hc_pre` on its own
/// (`x_mixed` as bf16 values, `post` and `comb` closely), the rest of the step against the
/// golden fed the runtime's `hc_pre` results, so a failure names its stage. (An `x_mixed`
/// value one bf16 step off moves an int8 activation, and `h`'s int8 re-quantisation turns
/// that into output noise of a few 1e-3 over 2048-wide experts: with fp32 mix sums, 28 such
/// values of 32768 took 6.1% of `y` past 3e-3 at FLASH width.)
fn check(
    w: &Worker,
    cfg: &Dsv4Config,
    weights: &MoeWeights,
    inputs: &StepInputs,
    layer: usize,
) -> Vec<u32> {
    let whole = moe_step(cfg, weights, layer, inputs);
    let moe = MoeLayer::new(
        w,
        cfg,
        weights,
        layer,
        ExpertPlacement::single(cfg.n_routed_experts),
        0,
    )
    .unwrap();
    let out = moe
        .step(w, &inputs.x_hc, &inputs.token_ids, &CallConfig::default())
        .unwrap();
    let (hc, d) = (cfg.hc_mult, cfg.hidden);
    let gold_mixed: Vec<f32> = whole.hc.iter().flat_map(|h| h.x_mixed.clone()).collect();
    CacheTol::KV
        .check("hc_pre x_mixed", &out.x_mixed, &gold_mixed)
        .unwrap();
    for (t, h) in whole.hc.iter().enumerate() {
        for (a, e) in out.post[t * hc..(t + 1) * hc].iter().zip(&h.post) {
            assert!((a - e).abs() <= 1e-5, "post {t}: {a} vs {e}");
        }
        for (a, e) in out.comb[t * hc * hc..(t + 1) * hc * hc].iter().zip(&h.comb) {
            assert!((a - e).abs() <= 1e-5, "comb {t}: {a} vs {e}");
        }
    }
    let hps: Vec<HcPre> = whole
        .hc
        .iter()
        .enumerate()
        .map(|(t, h)| HcPre {
            pre: h.pre.clone(),
            post: out.post[t * hc..(t + 1) * hc].to_vec(),
            comb: out.comb[t * hc * hc..(t + 1) * hc * hc].to_vec(),
            x_mixed: out.x_mixed[t * d..(t + 1) * d].to_vec(),
        })
        .collect();
    let gold = moe_after_hc_pre(cfg, weights, layer, inputs, hps);
    let k = cfg.n_activated_experts;
    let want: Vec<u32> = gold
        .routes
        .iter()
        .flat_map(|r| r.experts.iter().map(|&e| e as u32))
        .collect();
    assert_eq!(out.experts, want, "layer {layer}: routing");
    // The weights come from the gate on int8 activations of a bf16 x_mixed: a value on the
    // other side of a rounding step moves them by about 1e-4 relative.
    for (t, r) in gold.routes.iter().enumerate() {
        for (j, &wt) in r.weights.iter().enumerate() {
            let got = out.weights[t * k + j];
            assert!(
                (got - wt).abs() <= RelDiff::MOE.thd * wt.abs(),
                "weight {t},{j}: {got} vs {wt}"
            );
        }
    }
    let tol = RelDiff::MOE;
    tol.check("moe shared", &out.shared, &gold.shared).unwrap();
    tol.check("moe routed", &out.routed, &gold.routed).unwrap();
    tol.check("moe y", &out.y, &gold.y).unwrap();
    tol.check("moe x_out", &out.x_out, &gold.x_out).unwrap();
    tol.check("moe y (end to end)", &out.y, &whole.y).unwrap();
    tol.check("moe x_out (end to end)", &out.x_out, &whole.x_out)
        .unwrap();
    out.experts
}

#[test]
fn moe_step_matches_the_golden_on_hash_and_top_k_layers() {
    let w = worker();
    for (cfg, starts, seed) in [
        (Dsv4Config::tiny(), MIXED_STARTS, 3),
        (Dsv4Config::small(), MIXED_STARTS, 4),
        (Dsv4Config::small(), uniform_starts(8192), 5),
    ] {
        let weights = generate_moe_weights(&cfg, seed);
        let inputs = generate_inputs(&cfg, &starts, seed);
        let hashed = check(&w, &cfg, &weights, &inputs, 0);
        let topk = check(&w, &cfg, &weights, &inputs, cfg.n_hash_layers);
        assert_ne!(hashed, topk, "hash and top-k routing pick differently");
    }
}

/// An expert every token picks and one no token picks (the bias decides): the first has a
/// full group, the second an empty one that costs nothing and writes nothing.
#[test]
fn an_expert_with_every_token_and_one_with_none() {
    let w = worker();
    let cfg = Dsv4Config::small();
    let mut weights = generate_moe_weights(&cfg, 9);
    weights.bias[5] = 100.0;
    weights.bias[2] = -100.0;
    let inputs = generate_inputs(&cfg, &MIXED_STARTS, 9);
    let routes = check(&w, &cfg, &weights, &inputs, cfg.n_hash_layers);
    let k = cfg.n_activated_experts;
    for row in routes.chunks(k) {
        assert!(row.contains(&5) && !row.contains(&2), "{row:?}");
    }
    // Experts nobody picks besides 2 exist too at small shapes; the check above covered them.
    assert!(routes.len() == inputs.n_tokens() * k);
}

/// Malformed inputs are refused naming what is wrong.
#[test]
fn bad_inputs_are_refused() {
    let w = worker();
    let (cfg, weights, moe, x) = tiny_layer(&w, 1, 0, 0.5);
    // Only the last token's id is past the table: the route's block holding it fails while
    // the other block routes its tokens.
    let mut ids = [3u32; 8];
    ids[7] = cfg.vocab_size as u32;
    let e = moe.step(&w, &x, &ids, &CallConfig::default()).unwrap_err();
    assert!(e.to_string().contains("token id"), "{e}");
    // The failed step leaves nothing behind: the next step equals a fresh layer's, bit for bit.
    let after = moe.step(&w, &x, &[3; 8], &CallConfig::default()).unwrap();
    let fresh = MoeLayer::new(&w, &cfg, &weights, 0, ExpertPlacement::single(8), 0)
        .unwrap()
        .step(&w, &x, &[3; 8], &CallConfig::default())
        .unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&after.x_out), bits(&fresh.x_out));
    assert_eq!(after.experts, fresh.experts);
    let e = moe
        .step(&w, &x[1..], &[0; 8], &CallConfig::default())
        .unwrap_err();
    assert!(e.to_string().contains("x_hc"), "{e}");
    let mut short = weights.clone();
    short.gate.pop();
    let e = MoeLayer::new(&w, &cfg, &short, 0, ExpertPlacement::single(8), 0).unwrap_err();
    assert!(e.to_string().contains("gate"), "{e}");
    let two = ExpertPlacement {
        n_experts: 8,
        per_rank: 4,
    };
    let moe = MoeLayer::new(&w, &cfg, &weights, 0, two, 1).unwrap();
    assert_eq!(moe.local_experts(), 4..8);
    assert!(matches!(
        moe.step(&w, &x, &[0; 8], &CallConfig::default()),
        Err(MoeRunError::Invalid(_))
    ));
}

/// The route task bound to outputs that are not a row per token (`xq` with half the tokens'
/// rows, as a miswired graph would give it) is refused naming the output and both shapes,
/// not run over the rows it has; the worker's next MoE step equals one from before the
/// failure bit for bit.
#[test]
fn a_route_bound_to_too_few_rows_is_refused_and_the_next_step_is_unaffected() {
    let w = worker();
    let (_, _, moe, x) = tiny_layer(&w, 5, 3, 0.25);
    let before = moe.step(&w, &x, &[1; 8], &CallConfig::default()).unwrap();
    let (t, d, e, k, v) = (8u64, 64u64, 8u64, 2u64, 16u64);
    let args = RunArgs {
        buffers: vec![],
        scalars: vec![],
    };
    let err = w
        .run_fn("route_rows", args, &CallConfig::default(), move |o, _| {
            let x = o.alloc(DType::F32, &[t, d])?;
            let tokens = o.alloc(DType::U32, &[t])?;
            let norm = o.alloc(DType::F32, &[d])?;
            let gate = o.alloc(DType::F32, &[e, d])?;
            let bias = o.alloc(DType::F32, &[e])?;
            let hash = o.alloc(DType::U32, &[v, k])?;
            let xq = o.alloc(DType::I8, &[t / 2, d])?;
            let xs = o.alloc(DType::F32, &[t, 1])?;
            let experts = o.alloc(DType::U32, &[t, k])?;
            let wts = o.alloc(DType::F32, &[t, k])?;
            let task = Task::new(moe_ops::MOE_ROUTE)
                .input(&x)
                .input(&tokens)
                .input(&norm)
                .input(&gate)
                .input(&bias)
                .input(&hash)
                .output_existing(&xq)
                .output_existing(&xs)
                .output_existing(&experts)
                .output_existing(&wts)
                .scalar_f32(1e-6)
                .scalar_f32(1.0)
                .scalar(0)
                .blocks(2);
            o.submit(task)?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("xq of shape [4, 64], expected [8, 64]"),
        "{err}"
    );
    let after = moe.step(&w, &x, &[1; 8], &CallConfig::default()).unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&after.x_out), bits(&before.x_out));
    assert_eq!(after.experts, before.experts);
}

/// FLASH widths (hidden 4096, experts 2048 wide, top-6) with the 16 routed experts of one
/// expert-parallel rank (`flash_ep(2, 16)`'s per-rank count): the benchmark's shapes.
#[test]
fn flash_width_moe_matches_the_golden() {
    let w = worker();
    let cfg = Dsv4Config {
        n_routed_experts: 16,
        ..Dsv4Config::flash_ep(2, 16).unwrap()
    };
    let weights = generate_moe_weights(&cfg, 21);
    let inputs = generate_inputs(&cfg, &uniform_starts(8192), 21);
    check(&w, &cfg, &weights, &inputs, cfg.n_hash_layers);
}

fn mat(m: &Int8Matrix) -> WeightsI8<'_> {
    WeightsI8::new(&m.q, &m.scale, m.rows, m.cols, m.cols)
}

/// The expert phases' split (each block a tapered share of the active experts' columns laid
/// end to end, one call per expert it reaches) changes no bit: at a ragged shape (experts 200
/// wide, 12.5 column units; one expert with every token, the others with uneven groups), on
/// 1, 2 and 3 cores (16, 32 and 48 blocks, so shares start and end inside experts and inside
/// units' rows), every routed contribution and the shared expert's output equal the
/// whole-expert composition `expert_forward` (one call per expert over all its columns, one
/// row at a time) bit for bit.
#[test]
fn expert_split_is_bit_identical_to_whole_expert_calls() {
    let cfg = Dsv4Config {
        moe_inter_dim: 200,
        ..Dsv4Config::small()
    };
    let mut weights = generate_moe_weights(&cfg, 31);
    weights.bias[3] = 100.0;
    let inputs = generate_inputs(&cfg, &MIXED_STARTS, 31);
    let layer = cfg.n_hash_layers;
    let (d, k) = (cfg.hidden, cfg.n_activated_experts);
    let whole = |e: &Expert, x: &[i8], s: &[f32], wt: &[f32]| {
        let mut y = vec![0.0f32; wt.len() * d];
        let e = ExpertI8 {
            w1: mat(&e.w1),
            w3: mat(&e.w3),
            w2: mat(&e.w2),
        };
        expert_forward(
            &e,
            ActsI8::new(x, s, wt.len(), d, d),
            wt,
            cfg.swiglu_limit,
            &mut y,
        );
        y
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for cores in [1, 2, 3] {
        let w = common::cpu_worker(cores);
        moe_ops::register(&w).unwrap();
        simpler_models::dsv4::ops::register(&w).unwrap();
        let moe = MoeLayer::new(
            &w,
            &cfg,
            &weights,
            layer,
            ExpertPlacement::single(cfg.n_routed_experts),
            0,
        )
        .unwrap();
        let run = CallConfig::default();
        let out = moe.step(&w, &inputs.x_hc, &inputs.token_ids, &run).unwrap();
        let front = moe
            .front_step(&w, &inputs.x_hc, &inputs.token_ids, &run)
            .unwrap();
        assert_eq!(front.experts, out.experts);
        assert!(out.experts.chunks(k).all(|r| r.contains(&3)));
        let t = inputs.n_tokens();
        for route in 0..t * k {
            let (tok, e) = (route / k, out.experts[route] as usize);
            let want = whole(
                &weights.routed[e],
                &front.xq[tok * d..(tok + 1) * d],
                &front.xs[tok..tok + 1],
                &out.weights[route..route + 1],
            );
            assert_eq!(
                bits(&out.routed[route * d..(route + 1) * d]),
                bits(&want),
                "{cores} cores: route {route} (token {tok}, expert {e})"
            );
        }
        let want = whole(&weights.shared[0], &front.xq, &front.xs, &vec![1.0; t]);
        assert_eq!(
            bits(&out.shared[..t * d]),
            bits(&want),
            "{cores} cores: shared expert"
        );
    }
}
