//! What the serving tests share: the worker they run on.

use simpler_core::{Worker, WorkerConfig};

/// A 2-core CPU worker without kernels (the engine loaders register their own).
pub(crate) fn bare_worker() -> Worker {
    Worker::new(
        simpler_cpu::CpuPlatform::new(),
        WorkerConfig {
            cores: Some(2),
            timeouts: None,
            idle_spin: None,
        },
    )
    .unwrap()
}

/// [`bare_worker`] with the Qwen3 kernels registered.
#[allow(dead_code)] // Not every test file builds its engine by hand.
pub(crate) fn qwen3_worker() -> Worker {
    let worker = bare_worker();
    simpler_models::qwen3::ops::register(&worker).unwrap();
    worker
}
