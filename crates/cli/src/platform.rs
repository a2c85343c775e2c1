//! `--platform cpu|cuda`, taken by every `simpler run`, `bench` and `generate`.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};

/// Where a command runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum PlatformChoice {
    /// Host threads and host memory.
    Cpu,
    /// An NVIDIA GPU (a binary built with the `cuda` feature, a driver and a device).
    Cuda,
}

/// The platform flag.
#[derive(Args, Debug)]
pub(crate) struct PlatformOpt {
    /// Platform: `cpu`, or `cuda` (needs a build with `--features cuda`, an NVIDIA driver and
    /// a device; refused with the reason otherwise).
    #[arg(long, global = true, value_enum, default_value_t = PlatformChoice::Cpu)]
    pub(crate) platform: PlatformChoice,
}

/// The device `--platform cuda` would use, or why it cannot be used.
pub(crate) fn cuda_device() -> Result<simpler_cuda::DeviceInfo> {
    simpler_cuda::probe(0).map_err(|e| anyhow::anyhow!("--platform cuda: {e}"))
}

/// Refuses `--platform cuda` for a command without a CUDA path: first why CUDA cannot be
/// used here at all, if that is the case, else that this command has no CUDA path yet.
pub(crate) fn refuse_cuda(command: &str) -> Result<()> {
    let dev = cuda_device()?;
    bail!(
        "--platform cuda: `simpler {command}` has no CUDA path yet (device {} {} found); on the \
         CUDA platform, `simpler bench qwen3-decode` runs the Qwen3 decode step",
        dev.name,
        dev.arch()
    )
}
