//! A small seeded random generator for fixtures: xoshiro256++ seeded through splitmix64, with
//! Box–Muller normals. Deterministic across platforms and thread counts (every stream is
//! derived from a seed and a stream id, never from scheduling).

/// xoshiro256++ state.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
    /// A second Box–Muller normal waiting to be returned.
    spare: Option<f32>,
}

/// One splitmix64 step: advances `state` and returns a well-mixed word.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator for `(seed, stream)`: different streams are independent sequences.
    pub fn new(seed: u64, stream: u64) -> Rng {
        let mut st = seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut s = [0u64; 4];
        for w in &mut s {
            *w = splitmix64(&mut st);
        }
        Rng { s, spare: None }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let [s0, s1, s2, s3] = self.s;
        let out = s0.wrapping_add(s3).rotate_left(23).wrapping_add(s0);
        let t = s1 << 17;
        let mut s = [s0, s1, s2 ^ s0, s3 ^ s1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        self.s = s;
        out
    }

    /// Uniform in `(0, 1]` (never 0, so `ln` is finite).
    pub fn uniform_open0(&mut self) -> f32 {
        ((self.next_u64() >> 40) + 1) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// A standard normal sample (Box–Muller; pairs are produced together).
    pub fn normal(&mut self) -> f32 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let u1 = self.uniform_open0();
        let u2 = self.uniform_open0();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        self.spare = Some(r * s);
        r * c
    }

    /// `N(mean, std)`.
    pub fn normal_with(&mut self, mean: f32, std: f32) -> f32 {
        mean + std * self.normal()
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn normals_have_the_right_moments_and_streams_differ() {
        let mut r = Rng::new(1234, 0);
        let n = 200_000;
        let xs: Vec<f64> = (0..n)
            .map(|_| f64::from(r.normal_with(0.3, 0.02)))
            .collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!((mean - 0.3).abs() < 1e-3, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 5e-4, "std {}", var.sqrt());
        let a: Vec<u64> = (0..4).map(|_| Rng::new(1, 0).next_u64()).collect();
        let mut b = Rng::new(1, 1);
        assert_ne!(a[0], b.next_u64());
        assert_eq!(Rng::new(9, 3).next_u64(), Rng::new(9, 3).next_u64());
    }
}
