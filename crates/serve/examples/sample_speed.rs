//! What one sampled draw costs at Qwen3's vocabulary, on logits shaped like a model's (a bulk
//! of ~152,000 spread as a sum of three uniforms, standard deviation ~4.5, with a few far
//! above it) and on flat ones (every logit within 1 of the others, so a draw walks deep into
//! the order), with a few kinds of parameters: the median and the fastest of `--draws` draws
//! each, on one thread; then 16 model-shaped rows through `sample_rows` on one and two threads,
//! as the engine draws a batch.
//!
//! `cargo run --release -p simpler-serve --example sample_speed [-- --vocab 151936 --draws 300]`

use std::time::Instant;

use simpler_serve::sampler::sample_rows;
use simpler_serve::{Sampler, SamplingParams};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let vocab: usize = arg("--vocab").map_or(151_936, |s| s.parse().expect("--vocab"));
    let draws: usize = arg("--draws").map_or(300, |s| s.parse().expect("--draws"));
    let mut st = 17u64;
    let mut next = move || {
        st = st
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (st >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let mut logits: Vec<f32> = (0..vocab)
        .map(|_| (next() + next() + next()) * 9.0)
        .collect();
    for (i, v) in [
        (100, 18.0),
        (2000, 17.0),
        (77, 16.5),
        (5000, 16.5),
        (9, 14.0),
    ] {
        logits[i % vocab] = v;
    }
    let flat: Vec<f32> = (0..vocab).map(|_| next() * 2.0).collect();
    for (shape, logits) in [("model-shaped", &logits), ("flat", &flat)] {
        for (temperature, top_k, top_p) in
            [(0.7, None, 0.9), (1.0, None, 1.0), (0.7, Some(50), 1.0)]
        {
            let mut s = Sampler::new(SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: 5,
            });
            let (median, fastest) = timed(draws, || {
                std::hint::black_box(s.sample(std::hint::black_box(logits)));
            });
            println!(
                "{shape}, T {temperature} top-k {top_k:?} top-p {top_p}: median {median:.3} ms, fastest {fastest:.3} ms a draw ({vocab} logits)"
            );
        }
    }
    let rows = 16;
    let batch: Vec<f32> = (0..rows).flat_map(|_| logits.iter().copied()).collect();
    let params = SamplingParams {
        temperature: 0.7,
        top_k: None,
        top_p: 0.9,
        seed: 1,
    };
    for threads in [1, 2] {
        let mut samplers: Vec<Sampler> = (0..rows).map(|_| Sampler::new(params)).collect();
        let (median, fastest) = timed(draws / 10 + 1, || {
            let mut jobs: Vec<(usize, &mut Sampler)> = samplers.iter_mut().enumerate().collect();
            std::hint::black_box(sample_rows(&mut jobs, &batch, vocab, threads));
        });
        println!(
            "{rows} model-shaped rows on {threads} thread(s): median {median:.3} ms, fastest {fastest:.3} ms"
        );
    }
}

/// The median and the fastest of `n` timed calls of `f`, in ms.
fn timed(n: usize, mut f: impl FnMut()) -> (f64, f64) {
    let mut times: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0])
}
