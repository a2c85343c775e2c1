//! `simpler trace ...`: reads trace files and diagnostics written by runs.

use clap::Args;

/// Arguments of `simpler trace`.
#[derive(Args, Debug)]
pub(crate) struct TraceArgs {}

pub(crate) fn main(_args: TraceArgs) -> anyhow::Result<()> {
    anyhow::bail!("simpler trace: not built yet")
}
