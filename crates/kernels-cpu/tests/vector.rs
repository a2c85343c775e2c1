//! Vector kernels (conversion, norms, RoPE, SwiGLU, residual, embedding, argmax) against plain
//! scalar loops, on both paths.

mod common;

use common::{Rng, all_paths, both};
use half::bf16;
use proptest::prelude::*;
use simpler_kernels_cpu::*;

fn bits(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn cast_f32_bf16_rounds_to_nearest_even() {
    let mut rng = Rng(7);
    let mut src: Vec<f32> = (0..1000)
        .map(|_| f32::from_bits(rng.next_u64() as u32))
        .collect();
    src.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        f32::MAX,
    ]);
    // 1 + 2^-8 is a tie: rounds to even (1.0); 1 + 3*2^-8 rounds up to 1 + 2^-6.
    assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0).to_f32(), 1.0);
    assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0).to_f32(), 1.0 + 1.0 / 64.0);
    let (p, a) = both(|| {
        let mut d = vec![bf16::ZERO; src.len()];
        cast_f32_bf16(&src, &mut d);
        d
    });
    for (i, &s) in src.iter().enumerate() {
        let e = bf16::from_f32(s);
        if s.is_nan() {
            assert!(p[i].is_nan());
        } else {
            assert_eq!(p[i].to_bits(), e.to_bits(), "portable {s:e}");
        }
    }
    if let Some(a) = a {
        for (i, (x, y)) in p.iter().zip(&a).enumerate() {
            assert!(
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                "avx2 differs at {i}"
            );
        }
    }
    let (wp, wa) = both(|| {
        let mut d = vec![0.0f32; p.len()];
        cast_bf16_f32(&p, &mut d);
        d
    });
    for (x, y) in wp.iter().zip(&p) {
        assert!(x.to_bits() == y.to_f32().to_bits() || x.is_nan());
    }
    if let Some(wa) = wa {
        assert!(wa.iter().zip(&wp).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}

fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let s: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    1.0 / ((s / x.len() as f64) as f32 + eps).sqrt()
}

/// The outputs of every norm of `x` (rows of `g.len()`), as bits: the deferred bf16 and
/// packed forms with their scales, the ordinary bf16 and packed forms.
type NormBits = (Vec<u16>, Vec<f32>, Vec<u32>, Vec<f32>, Vec<u16>, Vec<u32>);

fn norms(x: &[f32], g: &[f32], eps: f32, rows: usize) -> NormBits {
    let h = g.len();
    let mut n = vec![bf16::ZERO; rows * h];
    let mut r = vec![0.0f32; rows];
    rms_norm_deferred_bf16(x, g, eps, &mut n, &mut r);
    let mut packed = vec![0.0f32; packed_len(rows, h)];
    let mut r2 = vec![0.0f32; rows];
    rms_norm_deferred_packed(x, g, eps, &mut packed, &mut r2);
    let mut o = vec![bf16::ZERO; rows * h];
    rms_norm_bf16(x, g, eps, &mut o);
    let mut packed_o = vec![0.0f32; packed_len(rows, h)];
    rms_norm_packed(x, g, eps, &mut packed_o);
    (
        bits(&n),
        r,
        f32_bits(&packed),
        r2,
        bits(&o),
        f32_bits(&packed_o),
    )
}

fn f32_bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// NaN, infinities, signed zeros, values that round up to infinity and ties: every path
/// writes the packed norms with the same bits (quiet NaNs included) as the portable one.
#[test]
fn packed_norms_keep_special_values_on_every_path() {
    let h = 48;
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        f32::MAX,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        -(1.0 + 1.0 / 256.0),
        f32::from_bits(0x7f80_0001),
        // NaNs whose payload fills the low half: rounding them as numbers would carry out.
        f32::from_bits(0x7fff_ffff),
        f32::from_bits(0xffff_ffff),
        f32::MIN_POSITIVE / 4.0,
    ];
    let mut rng = Rng(11);
    // Rows 0..5 ordinary, then one row per special value mixed into ordinary ones.
    let mut x = rng.vec_f32(5 * h, 2.0);
    for (i, &v) in specials.iter().enumerate() {
        let mut row = rng.vec_f32(h, 2.0);
        row[(i * 7) % h] = v;
        row[(i * 7 + 17) % h] = -v;
        x.extend(row);
    }
    // A row whose products with the unit weights tie exactly between two bf16 values (bf16
    // steps by 1/128 in [1, 2)): ties to even.
    x.extend((0..h).map(|i| 1.0 + (2 * (i % 64) + 1) as f32 / 256.0));
    let rows = x.len() / h;
    let mut g = rng.vec_f32(h, 1.5);
    for k in (0..h).step_by(2) {
        g[k] = 1.0;
    }
    let paths = all_paths("packed norms, special values", || norms(&x, &g, 1e-6, rows));
    let p = &paths[0].1;
    for (isa, a) in &paths[1..] {
        let isa = isa.name();
        // A NaN is any NaN: which operand's NaN an instruction passes on (its sign and
        // payload) depends on the order the compiler chose, and NaN rows stay NaN.
        let canon = |b: u32| {
            if f32::from_bits(b).is_nan() {
                0x7fc0_0000
            } else {
                b
            }
        };
        let first =
            |a: &[u32], b: &[u32]| a.iter().zip(b).position(|(&x, &y)| canon(x) != canon(y));
        let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // bf16 bits widened to the f32 they stand for.
        let w = |v: &[u16]| v.iter().map(|&x| u32::from(x) << 16).collect::<Vec<_>>();
        for (what, got, want) in [
            ("deferred bf16", w(&a.0), w(&p.0)),
            ("deferred scales", f(&a.1), f(&p.1)),
            ("deferred packed", a.2.clone(), p.2.clone()),
            ("packed scales", f(&a.3), f(&p.3)),
            ("ordinary bf16", w(&a.4), w(&p.4)),
            ("ordinary packed", a.5.clone(), p.5.clone()),
        ] {
            if let Some(i) = first(&got, &want) {
                panic!(
                    "{isa}, {what}: element {i} is {:#x}, portable {:#x}",
                    got[i], want[i]
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn norms_match_scalar(rows in 1usize..21, h in 1usize..300, seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let x = rng.vec_f32(rows * h, 3.0);
        let g = rng.vec_f32(h, 1.5);
        let eps = 1e-6;
        let paths = all_paths("norms", || norms(&x, &g, eps, rows));
        let (_, p) = &paths[0];
        for (isa, a) in &paths[1..] {
            prop_assert_eq!(p, a, "{} against portable", isa.name());
        }
        let (n, r, packed, r2, o, packed_o) = p.clone();
        // The packed forms are the bf16 forms' values, packed.
        let packed_of = |b: &[u16]| {
            let vals: Vec<bf16> = b.iter().map(|&b| bf16::from_bits(b)).collect();
            let mut want = vec![0.0f32; packed_len(rows, h)];
            pack_acts_bf16(&vals, rows, h, &mut want);
            f32_bits(&want)
        };
        prop_assert_eq!(&packed, &packed_of(&n));
        prop_assert_eq!(&packed_o, &packed_of(&o));
        prop_assert_eq!(&r, &r2);
        for row in 0..rows {
            let xr = &x[row * h..(row + 1) * h];
            let er = inv_rms(xr, eps);
            prop_assert!((r[row] - er).abs() <= 1e-5 * er);
            for i in 0..h {
                prop_assert_eq!(n[row * h + i], bf16::from_f32(xr[i] * g[i]).to_bits());
                let e = bf16::from_f32(xr[i] * er * g[i]).to_f32();
                let got = bf16::from_bits(o[row * h + i]).to_f32();
                prop_assert!((got - e).abs() <= 1e-2 * e.abs() + 1e-6, "ordinary norm {} vs {}", got, e);
            }
        }
    }

    #[test]
    fn qk_norm_rope_matches_scalar(heads in 1usize..5, half_d in 1usize..40, pos in 0usize..50, seed in any::<u64>()) {
        let d = 2 * half_d;
        let mut rng = Rng(seed);
        let x = rng.vec_f32(heads * d, 2.0);
        let w = rng.vec_f32(d, 1.2);
        let inv: Vec<f32> = (0..half_d).map(|i| 10000f32.powf(-((2 * i) as f32) / d as f32)).collect();
        let cos: Vec<f32> = (0..d).map(|i| (pos as f32 * inv[i % half_d]).cos()).collect();
        let sin: Vec<f32> = (0..d).map(|i| (pos as f32 * inv[i % half_d]).sin()).collect();
        let (p, a) = both(|| {
            let mut s = x.clone();
            let mut o = vec![bf16::ZERO; x.len()];
            qk_norm_rope_bf16(&mut s, &w, 1e-6, &cos, &sin, &mut o);
            bits(&o)
        });
        if let Some(a) = &a {
            prop_assert_eq!(&p, a);
        }
        for h in 0..heads {
            let xh = &x[h * d..(h + 1) * d];
            let r = inv_rms(xh, 1e-6);
            let t: Vec<f32> = (0..d).map(|i| xh[i] * r * w[i]).collect();
            for i in 0..d {
                let e = if i < half_d {
                    t[i] * cos[i] - t[i + half_d] * sin[i]
                } else {
                    t[i] * cos[i] + t[i - half_d] * sin[i]
                };
                let got = bf16::from_bits(p[h * d + i]).to_f32();
                prop_assert!((got - e).abs() <= 1e-2 * e.abs() + 1e-4, "head {} dim {}: {} vs {}", h, i, got, e);
            }
        }
    }

    #[test]
    fn swiglu_residual_embedding_match_scalar(rows in 1usize..4, w in 1usize..200, seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let gate = rng.vec_f32(rows * w, 6.0);
        let up = rng.vec_f32(rows * w, 3.0);
        let scale = rng.vec_f32(rows, 2.0);
        let table = rng.vec_bf16(10 * w, 1.0);
        let ids: Vec<u32> = (0..rows).map(|_| rng.below(10) as u32).collect();
        let y = rng.vec_f32(rows * w, 1.0);
        let (p, a) = both(|| {
            let mut o = vec![bf16::ZERO; rows * w];
            swiglu_bf16(&gate, &up, &scale, &mut o);
            let mut e = vec![0.0f32; rows * w];
            embedding_gather_bf16(&table, w, &ids, &mut e);
            residual_add_f32(&mut e, &y);
            (bits(&o), e)
        });
        if let Some(a) = &a {
            prop_assert_eq!(&p, a);
        }
        for r in 0..rows {
            for i in 0..w {
                let gt = gate[r * w + i] * scale[r];
                let e = gt / (1.0 + (-gt).exp()) * (up[r * w + i] * scale[r]);
                let got = bf16::from_bits(p.0[r * w + i]).to_f32();
                prop_assert!((got - e).abs() <= 8e-3 * e.abs() + 1e-6, "swiglu {} vs {}", got, e);
                let emb = table[ids[r] as usize * w + i].to_f32() + y[r * w + i];
                prop_assert_eq!(p.1[r * w + i], emb);
            }
        }
    }
}

/// `n` values: mostly uniform in `[-scale, scale)`, with about one in eight a special value
/// (NaN, infinities, signed zeros, a subnormal, values whose products overflow).
fn vec_with_specials(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    const SPECIAL: [f32; 8] = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1e-40,
        3e38,
        -200.0,
    ];
    (0..n)
        .map(|_| {
            if rng.below(8) == 0 {
                SPECIAL[rng.below(SPECIAL.len())]
            } else {
                rng.uniform() * scale
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The fused SwiGLU-and-pack of a row segment gives the bits of `swiglu_bf16` then
    /// `pack_segment_bf16` (the portable path's), on every path, for segments starting on any
    /// packing block and ending on one or at the row's end, specials included (a NaN's sign
    /// aside).
    #[test]
    fn swiglu_pack_is_swiglu_then_pack_bit_for_bit(
        cols in 1usize..200,
        start in 0usize..13,
        blocks in 0usize..14,
        seed in any::<u64>(),
    ) {
        let c0 = (start * PACK_BLOCK).min(cols / PACK_BLOCK * PACK_BLOCK);
        let end = (c0 + blocks * PACK_BLOCK).min(cols);
        // A segment ends on a block or at `cols`; past the last whole block it runs to the end.
        let end = if end < cols && !end.is_multiple_of(PACK_BLOCK) { cols } else { end };
        let w = end - c0;
        let mut rng = Rng(seed);
        let gate = vec_with_specials(&mut rng, w, 8.0);
        let up = vec_with_specials(&mut rng, w, 4.0);
        let s = [1.0f32, 0.37, -2.5, f32::NAN][rng.below(4)];
        let mut act = vec![bf16::ZERO; w];
        let mut want = vec![f32::NAN; w];
        with_isa(Isa::Portable, || {
            swiglu_bf16(&gate, &up, &[s], &mut act);
            pack_segment_bf16(&act, c0, cols, &mut want);
        })
        .expect("portable always runs");
        // Bits, with every NaN as one value: which operand's NaN an instruction passes on
        // (and so its sign) is the compiler's choice of operand order, not the kernel's.
        let bits = |v: &[f32]| -> Vec<u32> {
            v.iter().map(|x| if x.is_nan() { 0x7FC0_0000 } else { x.to_bits() }).collect()
        };
        let want = bits(&want);
        for (path, got) in all_paths("swiglu_pack_bf16", || {
            let mut dst = vec![f32::NAN; w];
            swiglu_pack_bf16(&gate, &up, s, c0, cols, &mut dst);
            bits(&dst)
        }) {
            prop_assert_eq!(&got, &want, "{} cols {} segment {}..{}", path.name(), cols, c0, end);
        }
    }
}

#[test]
fn swiglu_pack_refuses_ragged_segments_and_lengths() {
    // (c0, end, cols, dst len): off a packing block, ending inside a block before the row's
    // end, past the row, dst too short.
    for (c0, end, cols, dst) in [
        (1, 17, 40, 16),
        (0, 20, 40, 20),
        (32, 48, 40, 16),
        (0, 16, 40, 15),
    ] {
        let (g, u) = (vec![0.5f32; end - c0], vec![0.5f32; end - c0]);
        let mut d = vec![0.0f32; dst];
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            swiglu_pack_bf16(&g, &u, 1.0, c0, cols, &mut d)
        }));
        assert!(r.is_err(), "{c0}..{end} of {cols} into {dst} accepted");
        assert!(
            d.iter().all(|&v| v == 0.0),
            "{c0}..{end}: wrote before refusing"
        );
    }
}

#[test]
fn argmax_ties_go_to_lowest_index_and_nan_never_wins() {
    assert_eq!(argmax_f32(&[]), None);
    assert_eq!(argmax_f32(&[f32::NAN]), None);
    assert_eq!(argmax_f32(&[1.0, 3.0, f32::NAN, 3.0, -1.0]), Some((1, 3.0)));
    assert_eq!(
        argmax_f32(&[f32::NEG_INFINITY, f32::NEG_INFINITY]),
        Some((0, f32::NEG_INFINITY))
    );
    // Tiles merged: the tie between tile 0 (index 1) and tile 1 (index 5) goes to index 1.
    let parts = [Some((5, 3.0)), None, Some((1, 3.0)), Some((9, 2.0))];
    assert_eq!(argmax_combine(&parts), Some((1, 3.0)));
    let mut rng = Rng(3);
    let x = rng.vec_f32(10_000, 1.0);
    let tiles: Vec<Option<(usize, f32)>> = x
        .chunks(777)
        .enumerate()
        .map(|(t, c)| argmax_f32(c).map(|(i, v)| (t * 777 + i, v)))
        .collect();
    assert_eq!(argmax_combine(&tiles), argmax_f32(&x));
}

/// The argmax's definition, element by element: the first of the largest non-NaN values.
fn argmax_reference(x: &[f32]) -> Option<(usize, f32)> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best
}

/// Values that make ties, signed zeros, infinities and NaNs common.
fn argmax_values() -> impl Strategy<Value = Vec<f32>> {
    let v = prop_oneof![
        4 => (-3i32..4).prop_map(|i| i as f32),
        1 => Just(-0.0f32),
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
        2 => any::<f32>(),
    ];
    prop::collection::vec(v, 0..80)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// On every path, ragged lengths around the 16 lanes, ties, signed zeros, infinities and
    /// NaNs anywhere: the same index and the same value bits as the definition.
    #[test]
    fn argmax_is_the_first_of_the_largest_on_every_path(x in argmax_values()) {
        let want = argmax_reference(&x).map(|(i, v)| (i, v.to_bits()));
        for isa in Isa::ALL {
            let Some(got) = with_isa(isa, || argmax_f32(&x)) else { continue };
            prop_assert_eq!(got.map(|(i, v)| (i, v.to_bits())), want, "{}", isa.name());
        }
    }
}

#[test]
fn argmax_covers_every_path_on_a_long_row() {
    // A row as long as the vocabulary's, its maximum tied at both ends of the vector body and
    // in the tail, a NaN before each: the first copy wins on every path.
    let mut rng = Rng(11);
    let mut x = rng.vec_f32(151_936 + 7, 1.0);
    for at in [40_001, 40_002, 151_940] {
        x[at] = 5.0;
    }
    x[40_000] = f32::NAN;
    for (isa, got) in common::all_paths("argmax_f32", || argmax_f32(&x)) {
        assert_eq!(got, Some((40_001, 5.0)), "{}", isa.name());
    }
    // Zeros of both signs tie (`+0.0 == -0.0`): the first wins with its own sign, across
    // lanes and into the tail (a second pass matching bits, or returning the maximum found
    // instead of the element, fails this).
    for (first, later) in [(0.0f32, -0.0f32), (-0.0, 0.0)] {
        let mut x = vec![-1.0f32; 40];
        (x[1], x[16], x[33]) = (first, later, later);
        for (isa, got) in common::all_paths("argmax_f32 of signed zeros", || argmax_f32(&x)) {
            assert_eq!(
                got.map(|(i, v)| (i, v.to_bits())),
                Some((1, first.to_bits())),
                "{}",
                isa.name()
            );
        }
    }
    let nan = vec![f32::NAN; 100];
    for (isa, got) in common::all_paths("argmax_f32 of NaNs", || argmax_f32(&nan)) {
        assert_eq!(got, None, "{}", isa.name());
    }
}

#[test]
fn the_nontemporal_copy_writes_exactly_its_destination() {
    // Every start offset within a 16-byte boundary and lengths around the 4-float stores:
    // the destination gets the source's bits (NaN payloads and signed zeros included) and
    // nothing outside it changes.
    let mut rng = Rng(5);
    let mut src = rng.vec_f32(80, 1.0);
    src[3] = f32::from_bits(0x7fc0_1234);
    src[4] = -0.0;
    for off in 0..4 {
        for len in 0..40 {
            let mut buf = vec![7.5f32; 96];
            copy_nontemporal_f32(&src[off..off + len], &mut buf[off + 8..off + 8 + len]);
            for (i, v) in buf.iter().enumerate() {
                let want = if (off + 8..off + 8 + len).contains(&i) {
                    src[i - 8].to_bits()
                } else {
                    7.5f32.to_bits()
                };
                assert_eq!(v.to_bits(), want, "offset {off}, length {len}, element {i}");
            }
        }
    }
}

#[test]
fn kv_write_places_the_row_at_its_slot() {
    let mut pool = vec![bf16::ZERO; 6 * 4];
    let row: Vec<bf16> = (1..=4).map(|v| bf16::from_f32(v as f32)).collect();
    kv_write_bf16(&mut pool, 4, &row);
    assert_eq!(&pool[16..20], &row[..]);
    assert!(
        pool[..16]
            .iter()
            .chain(&pool[20..])
            .all(|v| v.to_f32() == 0.0)
    );
}

#[test]
fn membw_reports_positive_peaks_quickly() {
    let opts = membw::MeasureOptions {
        duration: std::time::Duration::from_millis(80),
        buffer_bytes: 8 << 20,
        threads: 2,
    };
    let p = membw::measure(&opts);
    assert!(
        p.read_gbs_one > 0.0
            && p.read_gbs_all > 0.0
            && p.fma_gflops_one > 0.0
            && p.fma_gflops_all > 0.0,
        "{p:?}"
    );
    assert!(p.read_gbs_one >= p.read_gbs_one_median && p.read_gbs_all >= p.read_gbs_all_median);
    // Each wider path's peak is measured exactly where the path runs, and is what the matrix
    // products of that path are compared against.
    let isa = simpler_kernels_cpu::Isa::detected();
    for (path, one, all) in [
        (
            simpler_kernels_cpu::Isa::Avx512Bf16,
            p.bf16_dot_gflops_one,
            p.bf16_dot_gflops_all,
        ),
        (
            simpler_kernels_cpu::Isa::AmxBf16,
            p.amx_bf16_gflops_one,
            p.amx_bf16_gflops_all,
        ),
    ] {
        assert_eq!(one > 0.0 && all > 0.0, isa >= path, "{path:?}: {p:?}");
        assert_eq!(one == 0.0 && all == 0.0, isa < path, "{path:?}: {p:?}");
        println!("{} peak measured: {}", path.name(), isa >= path);
    }
    assert_eq!(
        p.matmul_gflops_all(simpler_kernels_cpu::Isa::Avx2),
        p.fma_gflops_all
    );
    assert_eq!(
        p.matmul_gflops_all(isa),
        match isa {
            simpler_kernels_cpu::Isa::AmxBf16 => p.amx_bf16_gflops_all,
            simpler_kernels_cpu::Isa::Avx512Bf16 => p.bf16_dot_gflops_all,
            _ => p.fma_gflops_all,
        }
    );
}

/// Logits for the sampling passes: a spread bulk, exponents either side of the weight cut and
/// right at it, and every special value.
fn sampling_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    let mut v: Vec<f32> = (0..n)
        .map(|_| (rng.next_u64() % 40_000) as f32 / 100.0 - 300.0)
        .collect();
    for (i, s) in [
        f32::NAN,
        f32::NEG_INFINITY,
        -0.0,
        f32::MIN,
        f32::MIN_POSITIVE,
        100.0,
    ]
    .into_iter()
    .enumerate()
    {
        if i * 7 < n {
            v[i * 7] = s;
        }
    }
    v
}

/// `logits_max` is the plain fold over the finite values, and flags `+inf`, on every path and
/// at every length around the lane blocks.
#[test]
fn logits_max_takes_the_finite_values_on_every_path() {
    for n in (0..50).chain([151_936]) {
        for with_inf in [false, true] {
            let mut v = sampling_logits(n, n as u64 + 3);
            if with_inf && n > 0 {
                v[n / 2] = f32::INFINITY;
            }
            let want_max = v
                .iter()
                .copied()
                .filter(|x| x.is_finite())
                .fold(f32::NEG_INFINITY, f32::max);
            let want_inf = v.contains(&f32::INFINITY);
            for (isa, (m, inf)) in all_paths("logits_max", || sampling::logits_max(&v)) {
                assert_eq!(m.to_bits(), want_max.to_bits(), "{} n {n}", isa.name());
                assert_eq!(inf, want_inf, "{} n {n}", isa.name());
            }
        }
    }
    assert_eq!(
        sampling::logits_max(&[f32::NAN, f32::NEG_INFINITY]),
        (f32::NEG_INFINITY, false)
    );
}

/// The sampling weights are `f64::exp` of the exponent within 4e-7 down to the cut and 0 below
/// it (NaN and `-inf` too), the same bits on every path, and their sum is the lanes' sum: lane
/// `j` over the indices `j mod 16` in order, then the lanes in order.
#[test]
fn sampling_weights_match_the_exponential_on_every_path() {
    // 16 k + 15: the longest remainders, whose lanes a wrong lane would change.
    for n in [0, 1, 15, 16, 17, 31, 33, 63, 655, 1000, 151_936] {
        let v = sampling_logits(n, 11 + n as u64);
        let max = v
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        for t in [1.0f32, 0.7, 2.5] {
            let ran = all_paths("sampling_weights", || {
                let mut w = vec![f32::NAN; n];
                let sum = sampling::sampling_weights(&v, max, t, &mut w);
                (w, sum)
            });
            let (_, (w0, sum0)) = &ran[0];
            for (isa, (w, sum)) in &ran {
                let same = w.iter().zip(w0).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} differs from portable (n {n}, t {t})", isa.name());
                assert_eq!(sum.to_bits(), sum0.to_bits(), "{} sum", isa.name());
            }
            let mut lanes = [0.0f64; 16];
            for (i, (&x, &wi)) in v.iter().zip(w0).enumerate() {
                let e = (x - max) / t;
                if e >= sampling::WEIGHT_CUT {
                    let want = f64::from(e).exp();
                    let rel = (f64::from(wi) - want).abs() / want;
                    assert!(rel < 4e-7, "n {n} t {t}: e^{e} = {wi}, want {want}");
                } else {
                    assert_eq!(wi.to_bits(), 0, "n {n} t {t}: logit {x}, exponent {e}");
                }
                lanes[i % 16] += f64::from(wi);
            }
            let want_sum: f64 = lanes.iter().sum();
            assert_eq!(sum0.to_bits(), want_sum.to_bits(), "n {n} t {t} sum");
        }
    }
}

/// The sum's lanes on weights of one magnitude (logits within 1 of each other), where adding
/// an element into another lane changes the rounding: the longest remainders, every path.
#[test]
fn sampling_weights_sum_in_its_lanes_at_every_remainder() {
    let mut rng = Rng(23);
    for n in [31, 47, 655, 1007, 151_935] {
        let v: Vec<f32> = (0..n)
            .map(|_| (rng.next_u64() % 1_000_000) as f32 / 1e6)
            .collect();
        let mut v = v;
        // Then a top weight of 1 with the rest ~6e-17: a sum of f32 weights in f64 is exact
        // while they are of one magnitude, so it takes a spread like this for the lanes'
        // order to show (two of them in one lane round a step up against 1; one alone not).
        if n < 100 {
            v.iter_mut().for_each(|x| *x = -37.35);
            v[0] = 0.0;
        }
        for (isa, sum) in all_paths("sampling_weights lanes", || {
            let mut w = vec![0.0f32; n];
            let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum = sampling::sampling_weights(&v, max, 1.0, &mut w);
            let mut lanes = [0.0f64; 16];
            for (i, &x) in w.iter().enumerate() {
                lanes[i % 16] += f64::from(x);
            }
            (sum, lanes.iter().sum::<f64>())
        }) {
            assert_eq!(sum.0.to_bits(), sum.1.to_bits(), "{} n {n}", isa.name());
        }
    }
}

/// The cut sits exactly at the exponent -87: kept at it, dropped just below.
#[test]
fn sampling_weights_cut_at_the_clamp() {
    let below = f32::from_bits((87.0f32).to_bits() + 1);
    let logits = [0.0, -87.0, -below, -1e30];
    let mut w = [1.0f32; 4];
    let sum = sampling::sampling_weights(&logits, 0.0, 1.0, &mut w);
    assert_eq!(w[0], 1.0);
    assert!(w[1] > 0.0 && (f64::from(w[1]) / (-87f64).exp() - 1.0).abs() < 4e-7);
    assert_eq!(w[2], 0.0);
    assert_eq!(w[3], 0.0);
    assert_eq!(sum, 1.0 + f64::from(w[1]));
}
