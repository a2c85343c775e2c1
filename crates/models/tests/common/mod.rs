//! Set-up shared by the models' integration tests.

use simpler_core::{Worker, WorkerConfig};

/// A CPU worker on two cores with no kernels registered yet (each test registers the model
/// ops it runs).
pub(crate) fn two_core_worker() -> Worker {
    cpu_worker(2)
}

/// A CPU worker on `cores` cores with no kernels registered yet.
pub(crate) fn cpu_worker(cores: usize) -> Worker {
    Worker::new(
        simpler_cpu::CpuPlatform::new(),
        WorkerConfig {
            cores: Some(cores),
            timeouts: None,
            idle_spin: None,
        },
    )
    .unwrap()
}

pub(crate) mod process_isa;
pub(crate) mod qwen3;
