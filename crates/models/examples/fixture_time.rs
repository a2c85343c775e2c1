//! Times fixture generation and the golden decode step for a preset:
//! `cargo run --release -p simpler-models --example fixture_time -- qwen3-0.6b [batch] [seq_len]`.

use std::time::Instant;

use simpler_models::qwen3::{FixtureOptions, Qwen3Config, generate_fixture, golden};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("qwen3-0.6b", |s| s.as_str());
    let batch: usize = args.get(2).map_or(1, |s| s.parse().expect("batch"));
    let seq_len: usize = args.get(3).map_or(128, |s| s.parse().expect("seq_len"));
    let config = Qwen3Config::preset(name).expect("preset");
    let t = Instant::now();
    let f = generate_fixture(&config, &FixtureOptions::small(batch, seq_len), None);
    println!(
        "{name}: generated {} parameters in {:.2} s",
        config.params(),
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let out = golden::decode_model(&f.weights, &mut f.kv.clone(), &f.batch, &f.rope, &f.tokens);
    println!(
        "golden decode step (batch {batch}, seq_len {seq_len}): {:.2} s, next tokens {:?}",
        t.elapsed().as_secs_f64(),
        out.next_tokens
    );
}
