//! The CUDA platform's errors.

use std::path::PathBuf;

/// What went wrong on the CUDA platform. Every message says what to do next where there is
/// something to do.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The binary was built without the `cuda` feature.
    #[error(
        "not compiled with CUDA support: rebuild with the `cuda` feature \
         (cargo build --release -p simpler-cli --features cuda)"
    )]
    NotCompiled,
    /// The driver library, a device or the driver's initialisation is missing.
    #[error("CUDA is not usable on this machine: {0}")]
    Unavailable(String),
    /// libnvrtc cannot be loaded.
    #[error(
        "NVRTC (libnvrtc.so.13) cannot be loaded: {0}; install the CUDA toolkit or the pip \
         package nvidia-cuda-nvrtc and put its lib directory on LD_LIBRARY_PATH"
    )]
    NvrtcMissing(String),
    /// NVRTC rejected a kernel module.
    #[error("NVRTC rejected kernel module `{module}` for {arch}: {log}")]
    Compile {
        /// Module name.
        module: String,
        /// Target architecture (`sm_90`).
        arch: String,
        /// The compiler's log.
        log: String,
    },
    /// The on-disk kernel cache could not be read or written.
    #[error("kernel cache {path}: {detail}")]
    Cache {
        /// The file or directory.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
    /// A driver call failed.
    #[error("CUDA driver call failed in {what}: {detail}")]
    Driver {
        /// The operation.
        what: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// An argument is out of range; `field` names it.
    #[error("invalid {field}: {detail}")]
    Invalid {
        /// The argument or input field.
        field: &'static str,
        /// Why it is refused.
        detail: String,
    },
}

impl CudaError {
    /// An [`CudaError::Invalid`] for `field`.
    pub fn invalid(field: &'static str, detail: impl Into<String>) -> CudaError {
        CudaError::Invalid {
            field,
            detail: detail.into(),
        }
    }
}
