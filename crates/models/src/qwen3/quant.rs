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

use half::bf16;
use simpler_kernels_cpu::quantize_row_bf16_i8;

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

/// The scale of resident record `rec` (`int8_record(cols)` bytes).
pub fn record_scale(rec: &[i8], cols: usize) -> f32 {
    let b: [u8; 4] = std::array::from_fn(|i| rec[cols + i] as u8);
    f32::from_le_bytes(b)
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
