//! `simpler bench qwen3-decode --platform cuda`: the Qwen3 decode step on the GPU with random
//! weights generated on the device, per shape: ms per step (GPU events around the step, and
//! host wall time), bytes streamed per step, GB/s and % of the read bandwidth measured in the
//! same run (`read_probe` over a buffer far larger than L2). Each round runs the step replayed
//! as a CUDA graph (A) and launched kernel by kernel (B), interleaved A B B A, so the cost of
//! per-kernel host launches is measured beside the graph under the same conditions. Each shape
//! runs on the tensor-core kernels launched programmatically and plainly, and one further step
//! of each is profiled kernel by kernel (device time per kernel, summed over its launches).
//! The plain CUDA-core kernels are the golden test's second path.

use anyhow::{Context, Result};
use simpler_cuda::{CudaDevice, DecodeKernels, DecodeShape, DeviceInfo, KernelCache, Qwen3Decoder};
use simpler_dfx::bench_stats::Summary;
use simpler_models::qwen3::Qwen3Config;
use simpler_models::qwen3::weights::PAGE_SIZE;

/// What to measure.
pub(crate) struct CudaBench {
    /// The model (random weights of this shape).
    pub(crate) config: Qwen3Config,
    /// The device found by the run-time check.
    pub(crate) device: DeviceInfo,
    /// `(batch, context)` pairs.
    pub(crate) shapes: Vec<(usize, usize)>,
    /// Seed of the weights and KV pools.
    pub(crate) seed: u64,
    /// Discarded rounds per shape.
    pub(crate) warmup: usize,
    /// Measured rounds per shape.
    pub(crate) rounds: usize,
}

/// The decode shape of `batch` sequences of `seq_len` tokens on identity block tables.
pub(crate) fn decode_shape(c: &Qwen3Config, batch: usize, seq_len: usize) -> DecodeShape {
    let max_blocks = seq_len.div_ceil(PAGE_SIZE);
    DecodeShape {
        hidden: c.hidden_size,
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        intermediate: c.intermediate_size,
        layers: c.num_hidden_layers,
        vocab: c.vocab_size,
        rms_norm_eps: c.rms_norm_eps as f32,
        batch,
        page_size: PAGE_SIZE,
        max_blocks,
        pages: batch * max_blocks,
        rope_positions: max_blocks * PAGE_SIZE,
    }
}

/// Bytes of the bandwidth probe: a quarter of the free memory, at most 8 GiB, at least 64 times
/// the L2 when the device has that much.
fn probe_bytes(info: &DeviceInfo) -> usize {
    let want = (info.free_memory / 4).min(8 << 30).max(64 * info.l2_bytes);
    usize::try_from(want.min(info.free_memory / 2)).unwrap_or(usize::MAX)
}

pub(crate) fn run(b: &CudaBench) -> Result<()> {
    let cache = KernelCache::default_location();
    let (dev, report) = CudaDevice::open(b.device.ordinal, &cache)?;
    let info = dev.info().clone();
    println!(
        "device: {} ({}, {} SMs, {:.1} GB, {:.1} GB free)",
        info.name,
        info.arch(),
        info.multiprocessors,
        info.total_memory as f64 / 1e9,
        info.free_memory as f64 / 1e9
    );
    println!("{report}");
    let bytes = probe_bytes(&info);
    let bw = simpler_cuda::read_bandwidth(&dev, bytes, 20).context("measuring read bandwidth")?;
    let bw = Summary::of(&bw);
    println!(
        "read bandwidth (read_probe over {:.2} GiB, 20 passes): best {:.0} GB/s, median {:.0} GB/s",
        bytes as f64 / (1u64 << 30) as f64,
        bw.max / 1e9,
        bw.median / 1e9
    );
    let c = &b.config;
    println!(
        "model: {} layers, hidden {}, heads {}/{} x {}, intermediate {}, vocab {}; bf16 weights \
         generated on the device (seed {})",
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
        b.seed
    );
    let mut rows = Vec::new();
    for &(batch, seq_len) in &b.shapes {
        let shape = decode_shape(c, batch, seq_len);
        let rope = c.rope_tables(shape.rope_positions);
        let kernels = DecodeKernels::TensorCore;
        let mut dec = Qwen3Decoder::new_random_with(
            dev.clone(),
            shape,
            b.seed,
            &rope.cos,
            &rope.sin,
            kernels,
        )
        .with_context(|| format!("shape {batch}x{seq_len}"))?;
        let ids: Vec<u32> = (0..batch)
            .map(|i| ((b.seed as usize + 7919 * i) % c.vocab_size) as u32)
            .collect();
        let lens = vec![seq_len as u32; batch];
        let table: Vec<u32> = (0..(batch * shape.max_blocks) as u32).collect();
        // Programmatic launch on, then off (what it buys).
        for (k, pdl) in [("mma+pdl", true), ("mma", false)] {
            dec.set_pdl(pdl);
            let (mut graph, mut eager) = (Vec::new(), Vec::new());
            let (mut graph_wall, mut eager_wall) = (Vec::new(), Vec::new());
            for round in 0..b.warmup + b.rounds {
                let order = if round % 2 == 0 {
                    [true, false]
                } else {
                    [false, true]
                };
                for use_graph in order {
                    let (_, t) = dec
                        .step(&ids, &lens, &table, use_graph)
                        .with_context(|| format!("{batch}x{seq_len} {k}"))?;
                    if round < b.warmup {
                        continue;
                    }
                    let (dev_ms, wall_ms) = (
                        t.device.as_secs_f64() * 1e3,
                        t.host_wall.as_secs_f64() * 1e3,
                    );
                    if use_graph {
                        graph.push(dev_ms);
                        graph_wall.push(wall_ms);
                    } else {
                        eager.push(dev_ms);
                        eager_wall.push(wall_ms);
                    }
                }
            }
            let step_bytes = shape.weight_bytes() + shape.kv_bytes(&lens);
            let (g, e) = (Summary::of(&graph), Summary::of(&eager));
            let (gw, ew) = (Summary::of(&graph_wall), Summary::of(&eager_wall));
            let gbs = step_bytes as f64 / (g.median / 1e3) / 1e9;
            println!(
                "{batch}x{seq_len} {k}: {:.3} GB/step ({} KV splits); graph: {:.3} ms/step on \
                 the GPU (min {:.3}), {:.3} ms wall; {:.0} GB/s = {:.1}% of the best read pass, \
                 {:.1}% of the median; kernel-by-kernel launches: {:.3} ms on the GPU, {:.3} ms \
                 wall",
                step_bytes as f64 / 1e9,
                dec.splits(),
                g.median,
                g.min,
                gw.median,
                gbs,
                100.0 * gbs * 1e9 / bw.max,
                100.0 * gbs * 1e9 / bw.median,
                e.median,
                ew.median
            );
            let prof = dec.profile_step(&ids, &lens, &table)?;
            let total: f64 = prof.iter().map(|p| p.ms).sum();
            for p in &prof {
                println!(
                    "profile {batch}x{seq_len} {k}: {:<24} {:>4} launches {:>9.3} ms {:>5.1}%",
                    p.name,
                    p.launches,
                    p.ms,
                    100.0 * p.ms / total.max(f64::MIN_POSITIVE)
                );
            }
            rows.push((
                batch,
                seq_len,
                k.to_string(),
                g.median,
                gw.median,
                gbs,
                e.median,
                ew.median,
            ));
        }
    }
    println!();
    println!(
        "| shape | kernels | graph ms/step (GPU) | graph ms (wall) | GB/s | % of read BW (best) \
         | launches ms (GPU) | launches ms (wall) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (batch, seq_len, k, g, gw, gbs, e, ew) in rows {
        println!(
            "| {batch}x{seq_len} | {k} | {g:.3} | {gw:.3} | {gbs:.0} | {:.1} | {e:.3} | {ew:.3} |",
            100.0 * gbs * 1e9 / bw.max
        );
    }
    Ok(())
}
