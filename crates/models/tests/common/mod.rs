//! Set-up shared by the models' integration tests.

use simpler_core::{Worker, WorkerConfig};

/// A CPU worker on two cores with no kernels registered yet (each test registers the model
/// ops it runs).
pub(crate) fn two_core_worker() -> Worker {
    Worker::new(
        simpler_cpu::CpuPlatform::new(),
        WorkerConfig {
            cores: Some(2),
            timeouts: None,
        },
    )
    .unwrap()
}

pub(crate) mod qwen3;
