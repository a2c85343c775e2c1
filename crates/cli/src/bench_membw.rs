//! `simpler bench membw`: the machine's streaming read bandwidth (one and all threads) and the
//! measured compute peak of each instruction-set path it runs (fp32 FMA; AVX-512 BF16
//! `vdpbf16ps`; AMX-BF16 `tdpbf16ps`), the denominators of every roofline ratio; and the int8
//! dot-product peak of each int8 path.

use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;
use simpler_dfx::bench_stats::{Summary, format_summary};
use simpler_kernels_cpu::Isa;
use simpler_kernels_cpu::membw::{MeasureOptions, last_level_cache_bytes, measure_with_passes};

/// Untimed passes before each bandwidth figure's timed ones (they size the pass count).
const READ_WARMUP_PASSES: usize = 1;

/// Arguments of `simpler bench membw`.
#[derive(Args, Debug)]
pub(crate) struct MembwArgs {
    /// Total seconds of measurement (split over the four figures), at least 0.4. A compute
    /// peak repeats runs in which a thread was held off its CPU, up to three times its share.
    #[arg(long, value_parser = crate::opts::seconds, default_value_t = 4.0)]
    seconds: f64,
    /// Size of the streamed buffer in MiB [default: four times the last-level cache Linux
    /// reports, at least 256 MiB, at most a quarter of the available memory].
    #[arg(long)]
    buffer_mib: Option<usize>,
    /// Threads for the all-threads figures, 1 to 1024 [default: available parallelism].
    #[arg(long, value_parser = crate::opts::core_count)]
    threads: Option<usize>,
}

pub(crate) fn membw(args: MembwArgs) -> Result<()> {
    // Each figure needs its passes (about 0.1 s of the four); a shorter total is refused
    // rather than raised, so the header's duration is the one measured.
    if !(args.seconds >= 0.4 && args.seconds.is_finite()) {
        bail!("--seconds {}: give at least 0.4", args.seconds);
    }
    let buffer_bytes = match args.buffer_mib {
        None => None,
        Some(0) => bail!("--buffer-mib 0: give at least 1"),
        Some(m) => {
            // The buffer is allocated and written once before the passes: it must fit.
            let bytes = m.checked_mul(1 << 20).filter(|&b| b <= isize::MAX as usize);
            let available = simpler_cpu::host_memory::available();
            match (bytes, available) {
                (Some(b), Some(a)) if b as u64 > a.available => bail!(
                    "--buffer-mib {m}: the buffer takes {} and {} leaves {}",
                    simpler_core::human_bytes(b as u64),
                    a.source,
                    simpler_core::human_bytes(a.available)
                ),
                (Some(b), _) => Some(b),
                (None, _) => bail!("--buffer-mib {m}: more bytes than this machine can address"),
            }
        }
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(t) = args.threads.filter(|&t| t > cpus) {
        // Each pass is timed from the first thread's start to the last one's end, so the
        // figures stay what the threads reach together on the CPUs they share.
        println!("note: {t} threads on {cpus} CPUs: they take turns on the CPUs");
    }
    let d = MeasureOptions::default();
    let (p, passes) = measure_with_passes(&MeasureOptions {
        duration: Duration::from_secs_f64(args.seconds),
        buffer_bytes: buffer_bytes.unwrap_or(d.buffer_bytes),
        threads: args.threads.unwrap_or(d.threads),
    });
    let llc = match last_level_cache_bytes() {
        Some(c) => format!("last-level cache {} MiB", c >> 20),
        None => "last-level cache not reported".to_string(),
    };
    println!(
        "simpler bench membw: {} MiB buffer ({llc}), {:.1} s",
        args.buffer_mib.unwrap_or(d.buffer_bytes >> 20),
        args.seconds
    );
    println!(
        "streaming read, 1 thread:   best {:>6.1} GB/s  median {:>6.1} GB/s",
        p.read_gbs_one, p.read_gbs_one_median
    );
    println!(
        "streaming read, {} threads: best {:>6.1} GB/s  median {:>6.1} GB/s",
        p.threads, p.read_gbs_all, p.read_gbs_all_median
    );
    // The passes' spread: on a shared host the best and the median can be far apart.
    for (name, rates) in [
        ("read_gbs_1_thread".to_string(), &passes.one),
        (format!("read_gbs_{}_threads", p.threads), &passes.all),
    ] {
        println!(
            "  {}",
            format_summary(&name, &Summary::of(rates), READ_WARMUP_PASSES)
        );
    }
    println!(
        "fp32 FMA peak:  1 thread {:.1} GFLOP/s, {} threads {:.1} GFLOP/s",
        p.fma_gflops_one, p.threads, p.fma_gflops_all
    );
    for (name, path, one, all) in [
        (
            "AVX-512 BF16 dot peak (vdpbf16ps)",
            Isa::Avx512Bf16,
            p.bf16_dot_gflops_one,
            p.bf16_dot_gflops_all,
        ),
        (
            "AMX-BF16 tile peak (tdpbf16ps)",
            Isa::AmxBf16,
            p.amx_bf16_gflops_one,
            p.amx_bf16_gflops_all,
        ),
    ] {
        if all > 0.0 {
            println!(
                "{name}: 1 thread {one:.1} GFLOP/s, {} threads {all:.1} GFLOP/s",
                p.threads
            );
        } else {
            println!(
                "{name}: not measured ({} path not run here: this CPU's best is {}, running {})",
                path.name(),
                Isa::hardware().name(),
                Isa::detected().name()
            );
        }
    }
    if p.compute_lower_bound {
        println!(
            "warning: a compute peak above was measured only in runs where a thread was held off its CPU (a busy host): read it as a lower bound"
        );
    }
    let path = Isa::detected();
    let compute = p.matmul_gflops_all(path);
    println!(
        "roofline denominators ({} path): bandwidth {:.1} GB/s, compute {:.1} GFLOP/s (ridge at {:.1} FLOP/byte)",
        path.name(),
        p.read_gbs_all,
        compute,
        compute / p.read_gbs_all
    );
    print_int8_peaks(p.threads, args.seconds);
    Ok(())
}

/// The int8 dot-product peak of each int8 path this machine has (the int8 GEMM's compute
/// denominator), a quarter of `seconds` more measurement.
fn print_int8_peaks(threads: usize, seconds: f64) {
    let budget = Duration::from_secs_f64((seconds / 4.0).max(0.2));
    let peaks = simpler_kernels_cpu::gemm_i8::peak::int8_peaks(threads, budget);
    if peaks.is_empty() {
        println!("int8 dot-product peak: no SIMD int8 path on this machine (portable only)");
    }
    for p in peaks {
        println!(
            "int8 dot-product peak, {:<11} {}: 1 thread {:.1} GOP/s, {threads} threads {:.1} GOP/s{}",
            p.path.name(),
            p.instructions,
            p.gops_one,
            p.gops_all,
            if p.lower_bound {
                " (a lower bound: a thread was held off its CPU in every run)"
            } else {
                ""
            }
        );
    }
}
