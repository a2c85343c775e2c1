//! The DeepSeek-V4 building-block kernels (`simpler_kernels_cpu::dsv4`) against the golden's
//! functions (`simpler_models::dsv4::golden`), on every instruction-set path this CPU has.

use simpler_kernels_cpu::dsv4 as k;
use simpler_kernels_cpu::{Isa, with_isa};
use simpler_models::dsv4::Dsv4Config;
use simpler_models::dsv4::check::RelDiff;
use simpler_models::dsv4::fixture::{generate_attn_weights, generate_inputs};
use simpler_models::dsv4::golden::{self, RopeKind};

fn paths() -> impl Iterator<Item = Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_supported())
}

/// Every token's `hc_pre` and `hc_post` through the kernels, compared with the golden.
#[test]
fn hc_pre_and_post_match_the_golden() {
    let cfg = Dsv4Config::small();
    let w = generate_attn_weights(&cfg, 7).hc;
    let inputs = generate_inputs(&cfg, &[0, 3, 127, 8192], 7);
    let (hc, d) = (cfg.hc_mult, cfg.hidden);
    let n = hc * d;
    let m = k::hc_mix_len(hc);
    assert_eq!(m, cfg.hc_mix());
    for isa in paths() {
        with_isa(isa, || {
            let rows = inputs.n_tokens();
            let mut mix = vec![0.0f32; rows * m];
            k::hc_mix_logits(&inputs.x_hc, n, &w.mix, cfg.rms_eps, &mut mix);
            for t in 0..rows {
                let x = &inputs.x_hc[t * n..(t + 1) * n];
                let g = golden::hc_pre(&cfg, &w, x);
                let hw = &mut mix[t * m..(t + 1) * m];
                k::hc_weights(hw, hc, w.scale, &w.base, cfg.hc_sinkhorn_iters, cfg.hc_eps);
                let close = |a: &[f32], e: &[f32], what: &str| {
                    for (i, (a, e)) in a.iter().zip(e).enumerate() {
                        assert!(
                            (a - e).abs() <= 2e-5 * (1.0 + e.abs()),
                            "{isa:?} token {t} {what}[{i}]: {a} vs {e}"
                        );
                    }
                };
                close(&hw[..hc], &g.pre, "pre");
                close(&hw[hc..2 * hc], &g.post, "post");
                close(&hw[2 * hc..], &g.comb, "comb");
                let mut xm = vec![0.0f32; d];
                k::hc_mix_streams(x, &g.pre, &mut xm);
                assert_eq!(
                    xm, g.x_mixed,
                    "{isa:?} token {t}: x_mixed from the same pre"
                );
                let out: Vec<f32> = g.x_mixed.iter().map(|v| v * 0.5).collect();
                let mut y = vec![0.0f32; n];
                k::hc_post(x, &out, &g.post, &g.comb, &mut y);
                assert_eq!(
                    y,
                    golden::hc_post(&cfg, &g, x, &out),
                    "{isa:?} token {t}: hc_post"
                );
            }
        });
    }
}

#[test]
fn rms_norm_matches_the_golden_with_and_without_weight() {
    let cfg = Dsv4Config::small();
    let w = generate_attn_weights(&cfg, 3);
    let inputs = generate_inputs(&cfg, &[5, 9, 11, 13], 3);
    let x = &inputs.x_hc[..4 * cfg.hidden];
    for isa in paths() {
        with_isa(isa, || {
            for weight in [Some(w.attn_norm.as_slice()), None] {
                let mut got = x.to_vec();
                k::rms_norm_round(&mut got, cfg.hidden, weight, cfg.rms_eps);
                let want: Vec<f32> = x
                    .chunks(cfg.hidden)
                    .flat_map(|r| golden::rms_norm(r, weight, cfg.rms_eps))
                    .collect();
                // Sums in a different order: at most a bf16 rounding step apart.
                RelDiff {
                    thd: 8e-3,
                    pct: 0.0,
                }
                .check("rms_norm", &got, &want)
                .unwrap_or_else(|e| panic!("{isa:?}: {e}"));
            }
        });
    }
}

#[test]
fn rope_tables_and_rotations_match_the_golden() {
    let cfg = Dsv4Config::flash();
    let y = cfg.yarn;
    let ramp = k::YarnRamp {
        factor: y.factor,
        beta_fast: y.beta_fast,
        beta_slow: y.beta_slow,
        original_len: y.original_max_position,
    };
    let cases = [
        (
            RopeKind::Plain,
            k::rope_inv_freq_plain(cfg.rope_theta, cfg.rope_dim),
        ),
        (
            RopeKind::Yarn,
            k::rope_inv_freq_yarn(cfg.compress_rope_theta, cfg.rope_dim, ramp),
        ),
    ];
    let hd = cfg.head_dim;
    let x: Vec<f32> = (0..2 * hd)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    for (kind, freq) in cases {
        assert_eq!(
            freq,
            golden::rope_inv_freq(&cfg, kind),
            "{kind:?} frequencies"
        );
        let table = k::RopeTable::new(&freq, cfg.max_position);
        for pos in [0usize, 1, 127, 8191, 16383] {
            let cs = golden::rope_cos_sin(&freq, pos);
            let (cos, sin) = table.at(pos).expect("position in the table");
            let pairs: Vec<(f32, f32)> = cos.iter().copied().zip(sin.iter().copied()).collect();
            assert_eq!(pairs, cs, "{kind:?} pos {pos}");
            for isa in paths() {
                with_isa(isa, || {
                    for dir in [k::RopeDir::Forward, k::RopeDir::Inverse] {
                        let mut got = x.clone();
                        k::rope_interleaved(&mut got, hd, cos, sin, dir);
                        let mut want = x.clone();
                        for h in want.chunks_mut(hd) {
                            match dir {
                                k::RopeDir::Forward => {
                                    golden::rope(&mut h[hd - cfg.rope_dim..], &cs)
                                }
                                k::RopeDir::Inverse => {
                                    golden::rope_inverse(&mut h[hd - cfg.rope_dim..], &cs)
                                }
                            }
                        }
                        assert_eq!(got, want, "{isa:?} {kind:?} {dir:?} pos {pos}");
                    }
                });
            }
        }
    }
}
