//! int8 weights (`docs/qwen3.md`, "int8 weights"): which format a resident model holds its
//! projections and LM head in, and the symmetric per-output-channel quantisation done at
//! upload.
//!
//! # Resident int8 layout
//! A `[rows, cols]` projection becomes `rows` records of `cols + 4` bytes: the row's int8
//! values, then its fp32 scale (little-endian). Keeping each row's scale beside it means a
//! task's weight view (a slice of rows, as the orchestration cuts SPMD shares and LM-head
//! tiles) carries its scales with it, and the orchestration changes only the dtype and the
//! row width it binds. The 4 bytes cost `4 / cols` of the stream (0.4% at 1024 columns).
//!
//! # Interleaved projections
//! Where the int8 products run lane-wise on AVX-512 VNNI (this machine's int8 path is AVX-512
//! VNNI or AMX-INT8), a W8A8 projection whose rows fill whole 16-row groups is held
//! interleaved instead ([`int8_interleaved`]): the `rows × cols` values in the
//! [`I8Layout::Interleaved`] order (each 64-byte line one quad of `k` of a group's 16 rows, the
//! `vpdpbusd` operand), then the `rows` fp32 scales. The matrix takes the same bytes as its
//! records, so the bound shape `[rows, cols + 4]` does not change; the kernel tells the two
//! apart by the same rule, from the whole matrix it is bound (one matrix per task), and slices
//! an SPMD share on whole groups (shares are cut in units of 16 rows). On the Qwen3-0.6B
//! shapes from memory, one thread, the lane-wise kernel over interleaved weights streamed
//! 1.07×, 1.16×, 1.18× and 1.33× the row-major kernel's bytes per second at 1, 2, 4 and 16
//! activation rows, and from 9 rows on AMX the interleaved groups are the tile unit's B
//! operand as they lie (`docs/benchmarks.md`, session 30). Wide activations (`int8-wide`, and the
//! LM head, which keeps fp32 activations) need row-major records, and elsewhere the
//! interleaved order goes through the portable loops, so those stay records.

use half::bf16;
use simpler_kernels_cpu::{I8Layout, I8Path, PACK_ROWS, pack_weights_i8_as, quantize_row_bf16_i8};

/// How a resident model stores its projections and LM head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// bf16, as loaded.
    #[default]
    Bf16,
    /// int8 per output channel with fp32 scales; activations as [`Int8Acts`] says.
    Int8(Int8Acts),
}

/// How int8 projections take their activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Int8Acts {
    /// The projections' activations quantised per row to int8 (W8A8; exact i32 sums): level
    /// with `Wide` at batch 1 and faster at batch 16 here (`docs/benchmarks.md`), so `int8`
    /// means this. The LM head keeps fp32 activations (`docs/qwen3.md`, "int8 weights").
    #[default]
    Quantised,
    /// Kept fp32 and multiplied by the int8 weights widened in registers.
    Wide,
}

/// A weight format name the code does not support.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported weight format {0:?} (expected bf16, int8, int8-w8a8 or int8-wide)")]
pub struct UnknownWeightFormat(pub String);

impl WeightFormat {
    /// The name `parse` accepts.
    pub const fn name(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Int8(Int8Acts::Quantised) => "int8",
            WeightFormat::Int8(Int8Acts::Wide) => "int8-wide",
        }
    }

    /// `bf16`, `int8` (the faster activation mode, W8A8), `int8-w8a8` or `int8-wide`.
    pub fn parse(s: &str) -> Result<WeightFormat, UnknownWeightFormat> {
        Ok(match s {
            "bf16" => WeightFormat::Bf16,
            "int8" | "int8-w8a8" => WeightFormat::Int8(Int8Acts::Quantised),
            "int8-wide" => WeightFormat::Int8(Int8Acts::Wide),
            other => return Err(UnknownWeightFormat(other.to_string())),
        })
    }

    /// Whether projections are int8.
    pub fn is_int8(self) -> bool {
        matches!(self, WeightFormat::Int8(_))
    }

    /// Bytes one resident `[rows, cols]` projection takes.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            WeightFormat::Bf16 => rows * cols * 2,
            WeightFormat::Int8(_) => rows * int8_record(cols),
        }
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = UnknownWeightFormat;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        WeightFormat::parse(s)
    }
}

/// Bytes of one resident int8 row of `cols` values (values, then the fp32 scale).
pub const fn int8_record(cols: usize) -> usize {
    cols + 4
}

/// Quantises `w` (`[rows, cols]` bf16) into resident int8 records (see the module docs).
pub fn quantize_matrix(w: &[bf16], rows: usize, cols: usize) -> Vec<i8> {
    assert_eq!(
        w.len(),
        rows * cols,
        "quantize_matrix: {} values for {rows} x {cols}",
        w.len()
    );
    let rec = int8_record(cols);
    let mut out = vec![0i8; rows * rec];
    for (src, dst) in w.chunks_exact(cols.max(1)).zip(out.chunks_exact_mut(rec)) {
        let (q, s) = dst.split_at_mut(cols);
        let scale = quantize_row_bf16_i8(src, q);
        for (d, b) in s.iter_mut().zip(scale.to_le_bytes()) {
            *d = b as i8;
        }
    }
    out
}

/// Whether a resident `[rows, cols]` int8 matrix is held interleaved (module docs): a W8A8
/// projection (`w8a8`) of whole 16-row groups on a machine whose int8 path reads interleaved
/// weights lane-wise. Decided from the detected path (not a thread's override), so the upload
/// and every kernel of the process agree.
pub fn int8_interleaved(rows: usize, cols: usize, w8a8: bool) -> bool {
    w8a8 && rows > 0
        && cols > 0
        && rows.is_multiple_of(PACK_ROWS)
        && I8Path::detected() >= I8Path::Avx512Vnni
}

/// Quantises `w` (`[rows, cols]` bf16) into the resident form `interleaved` says: records, or
/// the interleaved values then the scales (module docs). Either takes `rows * int8_record(cols)`
/// bytes. Interleaved, `rows` must be whole 16-row groups.
pub fn quantize_matrix_as(w: &[bf16], rows: usize, cols: usize, interleaved: bool) -> Vec<i8> {
    if !interleaved {
        return quantize_matrix(w, rows, cols);
    }
    assert!(
        w.len() == rows * cols && rows.is_multiple_of(PACK_ROWS),
        "quantize_matrix_as: {} values for {rows} x {cols} interleaved (whole 16-row groups)",
        w.len()
    );
    let mut values = vec![0i8; rows * cols];
    let mut scales = Vec::with_capacity(rows);
    for (src, dst) in w
        .chunks_exact(cols.max(1))
        .zip(values.chunks_exact_mut(cols.max(1)))
    {
        scales.push(quantize_row_bf16_i8(src, dst));
    }
    let mut out = vec![0i8; rows * int8_record(cols)];
    let (data, tail) = out.split_at_mut(rows * cols);
    pack_weights_i8_as(I8Layout::Interleaved, &values, rows, cols, cols, data);
    for (d, s) in tail.chunks_exact_mut(4).zip(&scales) {
        for (b, v) in d.iter_mut().zip(s.to_le_bytes()) {
            *b = v as i8;
        }
    }
    out
}

/// The scales of an interleaved resident matrix's rows `first..first + n` (`tail`: its bytes
/// after the `rows × cols` values).
pub fn interleaved_scales(tail: &[i8], first: usize, n: usize) -> Vec<f32> {
    tail[first * 4..(first + n) * 4]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(std::array::from_fn(|i| b[i] as u8)))
        .collect()
}

/// The values a resident int8 matrix in the form `interleaved` says stands for, in row
/// order, rounded to bf16 ([`dequantize_matrix_bf16`] for records).
pub fn dequantize_matrix_as_bf16(q: &[i8], cols: usize, interleaved: bool) -> Vec<bf16> {
    if !interleaved {
        return dequantize_matrix_bf16(q, cols);
    }
    dequantize_matrix_as_f32(q, cols, true)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// The values a resident int8 matrix in the form `interleaved` says stands for, in row
/// order: `q · scale` in fp32, not rounded ([`dequantize_matrix_f32`] for records).
pub fn dequantize_matrix_as_f32(q: &[i8], cols: usize, interleaved: bool) -> Vec<f32> {
    if !interleaved {
        return dequantize_matrix_f32(q, cols);
    }
    let rows = q.len() / int8_record(cols).max(1);
    let (data, tail) = q.split_at(rows * cols);
    let scales = interleaved_scales(tail, 0, rows);
    let mut out = Vec::with_capacity(rows * cols);
    for (n, s) in scales.iter().enumerate() {
        for k in 0..cols {
            let v = data[simpler_kernels_cpu::interleaved_index_i8(rows, cols, n, k)];
            out.push(f32::from(v) * s);
        }
    }
    out
}

/// The scale of resident record `rec` (`int8_record(cols)` bytes).
pub fn record_scale(rec: &[i8], cols: usize) -> f32 {
    let b: [u8; 4] = std::array::from_fn(|i| rec[cols + i] as u8);
    f32::from_le_bytes(b)
}

/// The values resident int8 records stand for, `q · scale` in fp32 (not rounded).
pub fn dequantize_matrix_f32(q: &[i8], cols: usize) -> Vec<f32> {
    let rec = int8_record(cols);
    q.chunks_exact(rec)
        .flat_map(|r| {
            let s = record_scale(r, cols);
            r[..cols].iter().map(move |&v| f32::from(v) * s)
        })
        .collect()
}

/// The values a resident int8 matrix stands for, rounded to bf16 (the golden computes in
/// fp32 from bf16 weights; the rounding adds at most half a bf16 step to each weight).
pub fn dequantize_matrix_bf16(q: &[i8], cols: usize) -> Vec<bf16> {
    let rec = int8_record(cols);
    q.chunks_exact(rec)
        .flat_map(|r| {
            let s = record_scale(r, cols);
            r[..cols]
                .iter()
                .map(move |&v| bf16::from_f32(f32::from(v) * s))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_hold_values_and_scale_and_dequantise_within_half_a_step() {
        let (rows, cols) = (3, 37);
        let w: Vec<bf16> = (0..rows * cols)
            .map(|i| bf16::from_f32(((i * 7919) % 201) as f32 / 100.0 - 1.0))
            .collect();
        let q = quantize_matrix(&w, rows, cols);
        assert_eq!(q.len(), rows * int8_record(cols));
        let d = dequantize_matrix_bf16(&q, cols);
        for r in 0..rows {
            let rec = &q[r * int8_record(cols)..(r + 1) * int8_record(cols)];
            let s = record_scale(rec, cols);
            let amax = w[r * cols..(r + 1) * cols]
                .iter()
                .fold(0.0f32, |m, v| m.max(v.to_f32().abs()));
            assert_eq!(s, amax / 127.0);
            for c in 0..cols {
                let (orig, back) = (w[r * cols + c].to_f32(), d[r * cols + c].to_f32());
                // Half a quantisation step plus the bf16 rounding of the dequantised value.
                assert!(
                    (orig - back).abs() <= s * 0.5 + back.abs() / 256.0,
                    "{orig} vs {back}"
                );
            }
        }
    }

    /// The interleaved form holds the records' values and scales, at the records' size, and
    /// reads back to the same matrix.
    #[test]
    fn interleaved_form_holds_what_the_records_hold() {
        let (rows, cols) = (32, 37);
        let w: Vec<bf16> = (0..rows * cols)
            .map(|i| bf16::from_f32(((i * 7919) % 201) as f32 / 100.0 - 1.0))
            .collect();
        let rec = quantize_matrix(&w, rows, cols);
        let il = quantize_matrix_as(&w, rows, cols, true);
        assert_eq!(il.len(), rec.len());
        let scales = interleaved_scales(&il[rows * cols..], 0, rows);
        for n in 0..rows {
            let r = &rec[n * int8_record(cols)..(n + 1) * int8_record(cols)];
            assert_eq!(scales[n], record_scale(r, cols));
            for (k, &v) in r[..cols].iter().enumerate() {
                let at = simpler_kernels_cpu::interleaved_index_i8(rows, cols, n, k);
                assert_eq!(il[at], v, "({n}, {k})");
            }
        }
        assert_eq!(
            dequantize_matrix_as_bf16(&il, cols, true),
            dequantize_matrix_bf16(&rec, cols)
        );
        assert_eq!(
            interleaved_scales(&il[rows * cols..], 16, 2),
            scales[16..18]
        );
    }

    #[test]
    fn format_names_round_trip_and_unknown_ones_are_named() {
        for f in [
            WeightFormat::Bf16,
            WeightFormat::Int8(Int8Acts::Quantised),
            WeightFormat::Int8(Int8Acts::Wide),
        ] {
            assert_eq!(WeightFormat::parse(f.name()), Ok(f));
        }
        assert_eq!(
            WeightFormat::parse("int8-w8a8"),
            Ok(WeightFormat::Int8(Int8Acts::Quantised))
        );
        let e = WeightFormat::parse("int4").unwrap_err();
        assert!(e.to_string().contains("\"int4\""), "{e}");
    }
}
