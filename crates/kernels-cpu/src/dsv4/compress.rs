//! The compressors' pooling (`docs/dsv4.md`, "HCA layer", "CSA layer"): per channel `c`, a
//! softmax over the candidate rows' scores at `c` weighting their kv values at `c`.
//! The rows are given as slices so a caller can pair any channels (the overlapping ratio-4
//! compressor pools the previous window's first half with the current window's second half).

use crate::math::exp_approx;
use crate::multiversion::multiversion;

multiversion! {
    /// `out[c] = Σ_j softmax_j(score[j][c]) · kv[j][c]` over the rows `j` of `kv` and `score`
    /// (each `out.len()` wide, fp32). No row gives zeros. `exp` is the crate's polynomial
    /// (`exp_approx`, ~3 ulp) so the channel loop vectorises: a ratio-128 window is 128 rows
    /// of 512 channels, whose library `exp` calls took most of the HCA compressor's time.
    ///
    /// # Panics
    /// If `kv` and `score` hold different numbers of rows or a row is not `out.len()` long.
    pub fn softmax_pool(kv: &[&[f32]], score: &[&[f32]], out: &mut [f32]) {
        assert_eq!(kv.len(), score.len(), "softmax_pool: rows");
        let w = out.len();
        for (k, s) in kv.iter().zip(score) {
            assert!(k.len() == w && s.len() == w, "softmax_pool: row width");
        }
        let mut m = vec![f32::NEG_INFINITY; w];
        for s in score {
            for (m, &v) in m.iter_mut().zip(s.iter()) {
                *m = m.max(v);
            }
        }
        let mut z = vec![0.0f32; w];
        out.fill(0.0);
        for (k, s) in kv.iter().zip(score) {
            for c in 0..w {
                let e = exp_approx(s[c] - m[c]);
                z[c] += e;
                out[c] += e * k[c];
            }
        }
        if kv.is_empty() {
            return;
        }
        for (o, z) in out.iter_mut().zip(&z) {
            *o /= z;
        }
    }
}
