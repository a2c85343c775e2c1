//! The error type of every DFX function: files that cannot be read or written, malformed or
//! too-new trace lines, and diagnostics that cannot be joined.

use std::path::PathBuf;

/// Everything the DFX library can fail with.
#[derive(Debug, thiserror::Error)]
pub enum DfxError {
    /// A file could not be opened, read, written or created.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`open`, `read`, `write`, `create directory`).
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A line of a trace file (or a whole diagnostics file, `line` 0) is not valid.
    #[error("{path}:{line}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0 for a whole-file JSON document).
        line: usize,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A record was written by a newer version of simpler than this reader understands.
    #[error(
        "{path}:{line}: trace format version {found} is newer than this simpler understands (up to {supported}); read it with a newer simpler"
    )]
    NewerVersion {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0 for a whole-file JSON document).
        line: usize,
        /// Version found in the file.
        found: u32,
        /// Highest version this reader understands.
        supported: u32,
    },
    /// A file parses but holds a value no run can have written (a core id past
    /// [`crate::diag::MAX_CORES`], an unknown swimlane level, a line longer than
    /// [`crate::reader::MAX_LINE_BYTES`], text that is not UTF-8).
    #[error("{path}:{line}: {what}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0 for a whole-file JSON document).
        line: usize,
        /// What is wrong, naming the field and the value.
        what: String,
    },
    /// An analysis would need more memory than it allows itself.
    #[error(
        "{what} needs {needed_bytes} bytes, more than the limit of {limit_bytes} bytes; {hint}"
    )]
    TooLarge {
        /// The analysis and its input size.
        what: String,
        /// Bytes it would allocate.
        needed_bytes: u64,
        /// The limit.
        limit_bytes: u64,
        /// What to do instead.
        hint: &'static str,
    },
    /// A span line came before any clock anchor of its process.
    #[error(
        "{path}:{line}: span of pid {pid} has no clock anchor before it (every writer starts with an anchor line)"
    )]
    MissingAnchor {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Process id of the span.
        pid: u32,
    },
    /// A swimlane file and a deps file come from different task graphs.
    #[error(
        "refusing to join {swimlane} (fingerprint {swimlane_fingerprint:?}) with {deps} (fingerprint {deps_fingerprint:?}): they were captured from different task graphs"
    )]
    FingerprintMismatch {
        /// Swimlane file.
        swimlane: PathBuf,
        /// Its fingerprint.
        swimlane_fingerprint: String,
        /// Deps file.
        deps: PathBuf,
        /// Its fingerprint.
        deps_fingerprint: String,
    },
    /// The dependency graph has a cycle (it cannot have come from a valid run).
    #[error("the dependency graph has a cycle through task {task}")]
    Cycle {
        /// A task on the cycle.
        task: u64,
    },
    /// An analysis needs an input that was not given.
    #[error("{0}")]
    Missing(String),
    /// Writing to an output stream failed.
    #[error("writing output: {0}")]
    Fmt(#[from] std::fmt::Error),
}

/// Result with [`DfxError`].
pub type Result<T, E = DfxError> = std::result::Result<T, E>;

pub(crate) fn io(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> DfxError {
    let path = path.into();
    move |source| DfxError::Io { op, path, source }
}
