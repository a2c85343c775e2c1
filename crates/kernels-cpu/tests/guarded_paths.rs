//! Every bf16 and int8 GEMM path this CPU has, against an f64 reference (bf16) or the
//! portable path bit for bit (int8), at ragged shapes, with every input and output buffer in
//! an mmap that ends exactly at a page boundary followed by a PROT_NONE guard page (and, for
//! the bf16 weights in a second pass, starts right after one): a vector or tile load past a
//! slice's end, or before the weights' start, faults instead of reading a neighbour's bytes.

mod common;

use std::ops::Range;

use common::Rng;
use half::bf16;
use simpler_kernels_cpu::gemm_i8::{
    ActsI8, I8Layout, I8Path, WeightsI8, gemm_i8_w8a8, pack_weights_i8_as, with_i8_path,
};
use simpler_kernels_cpu::{
    ActsConversion, GemmTile, Isa, OutMode, PackedActs, PreparedActs, WeightLayout, WeightsBf16,
    gemm_bf16, gemm_bf16_converted, gemm_bf16_prepared, pack_acts_bf16, packed_len, path_for,
    with_isa,
};

/// A buffer of `len` `T` whose last element ends exactly at a page boundary, followed by a
/// PROT_NONE page (and preceded by one: the mapping starts with a guard page too when
/// `front` is set, then the data starts right after it).
struct Guarded<T: Copy> {
    base: *mut u8,
    map_len: usize,
    ptr: *mut T,
    len: usize,
}

impl<T: Copy> Guarded<T> {
    fn new(src: &[T], front: bool) -> Guarded<T> {
        // SAFETY: sysconf reads a constant of the system.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let bytes = std::mem::size_of_val(src);
        let data_pages = bytes.div_ceil(page).max(1);
        let map_len = (data_pages + 2) * page;
        // SAFETY: anonymous private mapping, no file.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let base = base.cast::<u8>();
        // SAFETY: inside the mapping.
        unsafe {
            assert_eq!(libc::mprotect(base.cast(), page, libc::PROT_NONE), 0);
            assert_eq!(
                libc::mprotect(
                    base.add((data_pages + 1) * page).cast(),
                    page,
                    libc::PROT_NONE
                ),
                0
            );
        }
        let start = if front {
            // Data starts right after the front guard (its tail is then not at the end page
            // boundary unless `bytes` is a multiple of the page).
            page
        } else {
            (data_pages + 1) * page - bytes
        };
        assert_eq!(start % std::mem::align_of::<T>(), 0);
        // SAFETY: `start + bytes` lies inside the readable pages.
        let ptr = unsafe { base.add(start) }.cast::<T>();
        // SAFETY: `src.len()` T fit from `ptr`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), ptr, src.len()) };
        Guarded {
            base,
            map_len,
            ptr,
            len: src.len(),
        }
    }
    fn get(&self) -> &[T] {
        // SAFETY: initialised above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn get_mut(&mut self) -> &mut [T] {
        // SAFETY: initialised above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy> Drop for Guarded<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// f64 reference of out[b, n] over `k` and its fp32 error bound.
fn reference(w: &[bf16], x: &[bf16], kk: usize, b: usize, n: usize, k: Range<usize>) -> (f64, f64) {
    let (mut s, mut mag) = (0.0f64, 0.0f64);
    for j in k {
        let t = f64::from(w[n * kk + j].to_f32()) * f64::from(x[b * kk + j].to_f32());
        s += t;
        mag += t.abs();
    }
    (s, mag * 2e-5 + 1e-5)
}

/// One bf16 product on every path and layout, inputs and output in guarded buffers, checked
/// against the f64 reference and the output padding.
#[allow(clippy::too_many_arguments)]
fn check_bf16(n: usize, k: usize, batch: usize, tn: Range<usize>, tk: Range<usize>, seed: u64) {
    let mut rng = Rng(seed);
    let w = rng.vec_bf16(n * k, 0.5);
    let x = rng.vec_bf16(batch * k, 2.0);
    let mut packed = vec![0.0; packed_len(batch, k)];
    pack_acts_bf16(&x, batch, k, &mut packed);
    let gx = Guarded::new(&packed, false);
    let ld = tn.len() + (seed as usize % 3);
    let out_len = (batch - 1) * ld + tn.len();
    let seed_out = rng.vec_f32(out_len, 1.0);
    for layout in [
        WeightLayout::RowMajor,
        WeightLayout::Tiled,
        WeightLayout::Pairs,
    ] {
        if layout == WeightLayout::Tiled
            && (!tn.start.is_multiple_of(16) || !tk.start.is_multiple_of(32))
        {
            continue;
        }
        if layout == WeightLayout::Pairs && !tn.start.is_multiple_of(8) {
            continue;
        }
        let arranged = layout.arrange_bf16(&w, n, k);
        for front in [false, true] {
            let gw = Guarded::new(&arranged, front);
            for isa in Isa::ALL {
                for mode in [OutMode::Store, OutMode::Add] {
                    let mut go = Guarded::new(&seed_out, false);
                    let tile = GemmTile {
                        n: tn.clone(),
                        k: tk.clone(),
                        mode,
                    };
                    let ran = with_isa(isa, || {
                        gemm_bf16(
                            WeightsBf16::with_layout(gw.get(), n, k, layout),
                            PackedActs::new(gx.get(), batch, k),
                            &tile,
                            go.get_mut(),
                            ld,
                        );
                        path_for(isa, batch, layout)
                    });
                    let Some(path) = ran else { continue };
                    let got = go.get();
                    for b in 0..batch {
                        for nn in tn.clone() {
                            let (mut e, tol) = reference(&w, &x, k, b, nn, tk.clone());
                            let i = b * ld + (nn - tn.start);
                            if mode == OutMode::Add {
                                e += f64::from(seed_out[i]);
                            }
                            let g = f64::from(got[i]);
                            assert!(
                                (g - e).abs() <= tol + 1e-6 * e.abs(),
                                "{} ({} ran) {layout:?} n={n} k={k} batch={batch} tile n={tn:?} \
                                 k={tk:?} {mode:?} b={b} row={nn}: {g} vs {e}",
                                isa.name(),
                                path.name(),
                            );
                        }
                    }
                    for (i, (&o, &s)) in got.iter().zip(&seed_out).enumerate() {
                        if i % ld >= tn.len() {
                            assert_eq!(o, s, "{} {layout:?} wrote padding {i}", isa.name());
                        }
                    }
                }
            }
        }
    }
}

/// Ragged bf16 shapes on every path, guard pages after every input and the output.
#[test]
fn bf16_every_path_ragged_shapes_guarded() {
    let hw = Isa::hardware();
    println!("hardware path: {}", hw.name());
    let mut seed = 1u64;
    for &batch in &[1usize, 2, 3, 4, 5, 7, 15, 16, 17, 31, 33, 40] {
        for &(n, k) in &[
            (1usize, 16usize),
            (3, 17),
            (17, 31),
            (16, 32),
            (33, 48),
            (47, 80),
            (50, 95),
            (64, 64),
            (40, 160),
        ] {
            seed += 1;
            check_bf16(n, k, batch, 0..n, 0..k, seed);
            // A row range starting mid-group / on a group, and a split of K.
            if n > 17 {
                check_bf16(n, k, batch, 16..n, 0..k, seed);
                check_bf16(n, k, batch, 8..n - 1, 0..k, seed);
                check_bf16(n, k, batch, 3..n - 2, 0..k, seed);
            }
            if k > 40 {
                check_bf16(n, k, batch, 0..n, 32..k, seed);
                check_bf16(n, k, batch, 0..n, 0..k - 7, seed);
                check_bf16(n, k, batch, 0..n, 5..k - 3, seed);
            }
        }
    }
}

/// Prepared and converted activations reused across calls of other shapes and tiles, on every
/// path: bit for bit what gemm_bf16 gives on the same path.
#[test]
fn bf16_prepared_and_converted_reused_across_shapes() {
    let mut rng = Rng(77);
    let mut prep = PreparedActs::default();
    let mut conv = ActsConversion::default();
    for isa in Isa::ALL {
        if !isa.is_supported() {
            continue;
        }
        for &(n, k, batch) in &[
            (48usize, 96usize, 9usize),
            (20, 64, 33),
            (33, 32, 5),
            (64, 160, 17),
            (16, 48, 40),
            (35, 70, 6),
            (48, 96, 2),
        ] {
            let w = rng.vec_bf16(n * k, 0.5);
            let x = rng.vec_bf16(batch * k, 2.0);
            let mut packed = vec![0.0; packed_len(batch, k)];
            pack_acts_bf16(&x, batch, k, &mut packed);
            for layout in [
                WeightLayout::RowMajor,
                WeightLayout::Tiled,
                WeightLayout::Pairs,
            ] {
                let arranged = layout.arrange_bf16(&w, n, k);
                let wv = WeightsBf16::with_layout(&arranged, n, k, layout);
                for tn in [0..n, 16..n] {
                    let tile = GemmTile {
                        n: tn.clone(),
                        k: 0..k,
                        mode: OutMode::Store,
                    };
                    let ld = tn.len();
                    let len = batch * ld;
                    with_isa(isa, || {
                        let acts = PackedActs::new(&packed, batch, k);
                        let mut want = vec![0.0; len];
                        gemm_bf16(wv, acts, &tile, &mut want, ld);
                        prep.prepare(acts);
                        let mut got = vec![0.0; len];
                        gemm_bf16_prepared(wv, &prep, &tile, &mut got, ld);
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{} prepared {layout:?} {n}x{k} b{batch}",
                            isa.name()
                        );
                        conv.convert(acts);
                        let mut got2 = vec![0.0; len];
                        gemm_bf16_converted(wv, acts, &conv, &tile, &mut got2, ld);
                        assert_eq!(
                            bits(&got2),
                            bits(&want),
                            "{} converted {layout:?} {n}x{k} b{batch}",
                            isa.name()
                        );
                    })
                    .unwrap();
                }
            }
        }
    }
}

/// One int8 W8A8 product on every int8 path and layout, inputs and output guarded; exact
/// i32 sums, so every path must equal the portable one bit for bit.
#[allow(clippy::too_many_arguments)]
fn check_i8(
    n: usize,
    k: usize,
    ld: usize,
    batch: usize,
    groups: usize,
    tn: Range<usize>,
    tk: Range<usize>,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let wsrc: Vec<i8> = (0..n * ld).map(|_| (rng.next_u64() % 255) as i8).collect();
    let sw: Vec<f32> = (0..n).map(|_| 0.01 + rng.uniform().abs() * 0.01).collect();
    let lda = k + (seed as usize % 5);
    let a: Vec<i8> = (0..batch * lda - (lda - k))
        .map(|_| ((rng.next_u64() % 255) as i32 - 127) as i8)
        .collect();
    let sa: Vec<f32> = (0..batch * groups)
        .map(|_| 0.02 + rng.uniform().abs() * 0.01)
        .collect();
    let ga = Guarded::new(&a, false);
    let ld_out = tn.len() + 1;
    let out_len = (batch - 1) * ld_out + tn.len();
    let seed_out = rng.vec_f32(out_len, 1.0);
    for layout in [I8Layout::RowMajor, I8Layout::Packed, I8Layout::Interleaved] {
        if layout == I8Layout::Interleaved && !n.is_multiple_of(16) {
            continue;
        }
        let (data, wld) = if layout == I8Layout::RowMajor {
            (wsrc.clone(), ld)
        } else {
            let mut d = vec![0i8; n * k];
            pack_weights_i8_as(layout, &wsrc, n, k, ld, &mut d);
            (d, k)
        };
        // Row-major: the buffer ends at the last row's last value.
        let data = if layout == I8Layout::RowMajor {
            data[..(n - 1) * ld + k].to_vec()
        } else {
            data
        };
        let gw = Guarded::new(&data, false);
        let mut want: Option<Vec<u32>> = None;
        for path in I8Path::ALL {
            let mut go = Guarded::new(&seed_out, false);
            let ran = with_i8_path(path, || {
                let w = if layout == I8Layout::RowMajor {
                    WeightsI8::new(gw.get(), &sw, n, k, wld)
                } else {
                    WeightsI8::with_layout(gw.get(), &sw, n, k, layout)
                };
                let x = if groups == 1 {
                    ActsI8::new(ga.get(), &sa, batch, k, lda)
                } else {
                    ActsI8::grouped(ga.get(), &sa, batch, k, lda, groups)
                };
                let tile = GemmTile {
                    n: tn.clone(),
                    k: tk.clone(),
                    mode: OutMode::Add,
                };
                gemm_i8_w8a8(w, x, &tile, go.get_mut(), ld_out);
            });
            if ran.is_none() {
                continue;
            }
            let got = bits(go.get());
            match &want {
                None => want = Some(got),
                Some(w) => assert_eq!(
                    &got,
                    w,
                    "{} vs portable {layout:?} n={n} k={k} ld={ld} batch={batch} groups={groups} \
                     tile n={tn:?} k={tk:?}",
                    path.name()
                ),
            }
        }
    }
}

#[test]
fn i8_every_path_ragged_shapes_guarded() {
    println!(
        "int8 paths supported: {:?}",
        I8Path::ALL
            .iter()
            .filter(|p| p.is_supported())
            .map(|p| p.name())
            .collect::<Vec<_>>()
    );
    let mut seed = 100u64;
    for &batch in &[1usize, 2, 5, 8, 9, 15, 16, 17, 33, 40] {
        for &(n, k, ld) in &[
            (16usize, 64usize, 64usize),
            (17, 65, 70),
            (32, 128, 128),
            (48, 100, 100),
            (35, 192, 200),
            (64, 257, 257),
            (33, 63, 63),
            (16, 130, 131),
        ] {
            seed += 1;
            check_i8(n, k, ld, batch, 1, 0..n, 0..k, seed);
            if n > 17 {
                check_i8(n, k, ld, batch, 1, 16..n, 0..k, seed);
                check_i8(n, k, ld, batch, 1, 5..n - 1, 0..k, seed);
            }
            if k >= 128 {
                check_i8(n, k, ld, batch, 1, 0..n, 64..k, seed);
                check_i8(n, k, ld, batch, 1, 0..n, 4..k - 3, seed);
                check_i8(n, k, ld, batch, 1, 0..n, 0..k - 1, seed);
            }
            if k % 2 == 0 {
                check_i8(n, k, ld, batch, 2, 0..n, 0..k, seed);
            }
            if k % 4 == 0 {
                check_i8(n, k, ld, batch, 4, 0..n, 0..k, seed);
            }
        }
    }
}

/// int8 row-range views of packed and interleaved weights (offset views keep the whole matrix)
/// on every path, guarded, against portable.
#[test]
fn i8_row_range_views_every_path_guarded() {
    let mut rng = Rng(9);
    for &(n, k) in &[(48usize, 130usize), (64, 64), (32, 257), (80, 100)] {
        let w: Vec<i8> = (0..n * k).map(|_| (rng.next_u64() % 255) as i8).collect();
        let sw: Vec<f32> = (0..n).map(|i| 0.01 + i as f32 * 1e-4).collect();
        for &batch in &[1usize, 4, 9, 16, 23] {
            let a: Vec<i8> = (0..batch * k)
                .map(|_| ((rng.next_u64() % 255) as i32 - 127) as i8)
                .collect();
            let sa: Vec<f32> = (0..batch).map(|b| 0.02 + b as f32 * 1e-3).collect();
            let ga = Guarded::new(&a, false);
            for layout in [I8Layout::RowMajor, I8Layout::Packed, I8Layout::Interleaved] {
                let mut d = vec![0i8; n * k];
                pack_weights_i8_as(layout, &w, n, k, k, &mut d);
                let gw = Guarded::new(&d, false);
                for r in [16..n, 5..n - 3, 17..n.min(33), 32..n] {
                    let mut want: Option<Vec<u32>> = None;
                    for path in I8Path::ALL {
                        let ld_out = r.len();
                        let mut go = Guarded::new(&vec![0.0f32; batch * ld_out], false);
                        let ran = with_i8_path(path, || {
                            let full = WeightsI8::with_layout(gw.get(), &sw, n, k, layout);
                            let view = full.rows_range(r.clone());
                            let x = ActsI8::new(ga.get(), &sa, batch, k, k);
                            let tile = GemmTile {
                                n: 0..r.len(),
                                k: 0..k,
                                mode: OutMode::Store,
                            };
                            gemm_i8_w8a8(view, x, &tile, go.get_mut(), ld_out);
                        });
                        if ran.is_none() {
                            continue;
                        }
                        let got = bits(go.get());
                        match &want {
                            None => want = Some(got),
                            Some(wv) => assert_eq!(
                                &got,
                                wv,
                                "{} {layout:?} n={n} k={k} batch={batch} rows {r:?}",
                                path.name()
                            ),
                        }
                    }
                }
            }
        }
    }
}
