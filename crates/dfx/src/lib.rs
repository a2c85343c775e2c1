//! DFX: trace files (writing and reading) and the analyses over them.
//!
//! * [`writer::TraceWriter`] writes spans as JSON Lines; [`reader::read_traces`] merges files
//!   of several processes onto one wall-clock axis.
//! * [`diag::write_run_diagnostics`] writes a run's `swimlane.json`, `deps.json` and
//!   `ring_stats.json` ([`diag::write_step_outputs`]: one `step-NNNNNN` directory per step of
//!   a multi-step command); [`diag`] reads them back, bounding what a file may say.
//! * Analyses: [`timing`], [`swimlane`], [`deps`] (with [`html`]), [`overhead`], [`idle`],
//!   [`critical_path`], [`rings`]; [`perfetto`] writes Chrome Trace Event JSON.
//! * [`bench_stats`]: statistics for `simpler bench`.
//!
//! The library prints nothing: every report is returned as a `String` or written to a
//! `&mut dyn Write`. The file format is documented in `docs/trace-format.md`.

pub mod bench_stats;
mod blocks;
pub mod critical_path;
pub mod deps;
pub mod diag;
pub mod error;
pub mod html;
pub mod idle;
pub mod overhead;
pub mod perfetto;
pub mod reader;
pub mod rings;
mod stats;
pub mod swimlane;
pub mod timing;
pub mod writer;

pub use diag::{write_run_diagnostics, write_run_outputs, write_step_outputs};
pub use error::{DfxError, Result};
pub use writer::TraceWriter;
