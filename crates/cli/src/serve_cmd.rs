//! `simpler serve`: the OpenAI-compatible HTTP server over the engine.
//!
//! The KV cache gets a share (`--kv-memory-fraction`) of the memory left after the weights,
//! step buffers and RoPE tables (from the memory estimate, against what the machine has
//! available or `--memory-budget`), but no more than `--max-batch-size` sequences of
//! `--max-seq-len` tokens can hold at once (on a host shared with other programs, memory the
//! engine cannot use is better left to them), unless `--num-kv-blocks` fixes it. The server binds
//! 127.0.0.1 unless told otherwise and prints `listening on http://HOST:PORT` when ready
//! (`--port 0` picks a free port). SIGINT or SIGTERM starts a graceful shutdown: new requests
//! get 503 while in-flight requests finish (or get an error after `--drain-secs`), then the
//! listener closes.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use simpler_models::qwen3::ops;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_serve::http::{AppState, ConnLimits, serve, unix_now};
use simpler_serve::load::tokenizer_and_eos;
use simpler_serve::{Engine, RuntimeConfig, Service, ServiceConfig};

use crate::opts::{self, RunOpts};
use crate::qwen3_cmd::{ModelArgs, load_model};

/// Arguments of `simpler serve`.
#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Address to bind (only this machine by default).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0: any free port; the line `listening on ...` says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model's name in requests and /v1/models [default: the preset's name, or the
    /// checkpoint directory's].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Most sequences in one engine step.
    #[arg(long, default_value_t = 16)]
    max_batch_size: usize,
    /// Most tokens (prompt chunks and decodes) in one engine step.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Longest sequence, prompt and completion together [default: the model's
    /// max_position_embeddings].
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Share of the memory left after the weights given to the KV cache.
    #[arg(long, default_value_t = 0.5)]
    kv_memory_fraction: f64,
    /// KV blocks (of 128 tokens) instead of a share of the memory.
    #[arg(long, conflicts_with = "kv_memory_fraction")]
    num_kv_blocks: Option<usize>,
    /// Most tokens one prompt's chunk takes of a step, so a long prompt does not hold up the
    /// decodes beside it [default: the whole budget].
    #[arg(long)]
    long_prefill_threshold: Option<usize>,
    /// Most requests waiting for admission; more get 503.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Seconds in-flight requests may run after a shutdown signal (at most 86400).
    #[arg(long, default_value_t = 30)]
    drain_secs: u64,
    /// Connections served at once; more wait in the listener's backlog until one closes
    /// (within the process's open-file limit).
    #[arg(long, default_value_t = ConnLimits::default().max_connections)]
    max_connections: usize,
    /// Seconds a connection may take to send a request's headers (new, or idle after a
    /// response: then it is closed) and then its body (else 408).
    #[arg(long, default_value_t = ConnLimits::default().read_timeout.as_secs_f64())]
    read_timeout_secs: f64,
    /// Seconds a response's bytes may wait on a client that takes none of them (it stopped
    /// reading); then the connection is closed and its request cancelled.
    #[arg(long, default_value_t = ConnLimits::default().write_timeout.as_secs_f64())]
    write_timeout_secs: f64,
    /// Decoder layers to run [default: all] (a quick look at a large model; the output is then
    /// not the model's).
    #[arg(long)]
    layers: Option<usize>,
    #[command(flatten)]
    run: RunOpts,
}

/// `RuntimeConfig`'s field names in an error, as this command's flags spell them.
fn as_flags(message: &str) -> String {
    [
        ("max_num_batched_tokens", "--max-num-batched-tokens"),
        ("long_prefill_threshold", "--long-prefill-threshold"),
        ("kv_memory_fraction", "--kv-memory-fraction"),
        ("max_batch_size", "--max-batch-size"),
        ("memory_budget", "--memory-budget"),
        ("num_kv_blocks", "--num-kv-blocks"),
        ("max_seq_len", "--max-seq-len"),
        ("weight_dtype", "--weights"),
    ]
    .iter()
    .fold(message.to_string(), |m, (field, flag)| {
        m.replace(field, flag)
    })
}

/// Longest `--drain-secs`.
const MAX_DRAIN_SECS: u64 = 86_400;

/// File descriptors the server keeps beside its connections: the listener, the model's and
/// tokenizer's files, the runtime's threads' and the standard streams, with room to spare.
const RESERVED_FDS: u64 = 64;

/// The connection limits from the flags: a timeout that is not a positive number of seconds,
/// or more connections than the open-file limit leaves room for, is refused with the numbers.
fn conn_limits(
    max_connections: usize,
    read_timeout_secs: f64,
    write_timeout_secs: f64,
    open_files: Option<u64>,
) -> Result<ConnLimits> {
    // The seconds must convert (`Duration::from_secs_f64` panics on NaN, inf or negatives);
    // what the limits themselves accept is `ConnLimits::check`'s, its fields named as flags.
    let secs = |flag: &str, t: f64| {
        if t.is_finite() && t > 0.0 && t <= 86_400.0 {
            Ok(Duration::from_secs_f64(t))
        } else {
            Err(anyhow::anyhow!("{flag} {t}: give seconds in (0, 86400]"))
        }
    };
    let limits = ConnLimits {
        read_timeout: secs("--read-timeout-secs", read_timeout_secs)?,
        write_timeout: secs("--write-timeout-secs", write_timeout_secs)?,
        max_connections,
    };
    limits.check().map_err(|e| {
        anyhow::anyhow!(
            "{}",
            e.replace("ConnLimits.max_connections", "--max-connections")
                .replace("ConnLimits.read_timeout", "--read-timeout-secs")
                .replace("ConnLimits.write_timeout", "--write-timeout-secs")
        )
    })?;
    if let Some(limit) = open_files
        && (max_connections as u64).saturating_add(RESERVED_FDS) > limit
    {
        bail!(
            "--max-connections {max_connections}: each connection holds a file descriptor, and this process may open {limit} ({RESERVED_FDS} kept for the server itself): give at most {}, or raise the limit (`ulimit -n`)",
            limit.saturating_sub(RESERVED_FDS)
        );
    }
    Ok(limits)
}

/// The process's soft limit on open files (`Max open files` in `/proc/self/limits`), where
/// the system says; `None` where it does not or it is unlimited.
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub(crate) fn main(args: ServeArgs) -> Result<()> {
    // Flags first: a bad one is refused before anything loads.
    let mut call = args.run.call_config("serve")?;
    if args.max_batch_size == 0 || args.max_num_batched_tokens == 0 || args.max_waiting == 0 {
        bail!("--max-batch-size, --max-num-batched-tokens and --max-waiting must be at least 1");
    }
    if !(args.kv_memory_fraction > 0.0 && args.kv_memory_fraction <= 1.0) {
        bail!(
            "--kv-memory-fraction {}: give a share in (0, 1]",
            args.kv_memory_fraction
        );
    }
    if args.num_kv_blocks == Some(0) || args.long_prefill_threshold == Some(0) {
        bail!("--num-kv-blocks and --long-prefill-threshold must be at least 1");
    }
    // The shutdown waits the drain time and a margin on a clock: a day bounds it, as the
    // connection timeouts are bounded.
    if args.drain_secs > MAX_DRAIN_SECS {
        bail!(
            "--drain-secs {}: give at most {MAX_DRAIN_SECS} (a day)",
            args.drain_secs
        );
    }
    let limits = conn_limits(
        args.max_connections,
        args.read_timeout_secs,
        args.write_timeout_secs,
        open_file_limit(),
    )?;
    let c = args.model.config(args.layers)?;
    let max_seq_len = args.max_seq_len.unwrap_or(c.max_position_embeddings);
    if max_seq_len < 2 {
        bail!("--max-seq-len {max_seq_len}: give at least 2 (a prompt token and a new one)");
    }
    ModelArgs::check_positions(&c, max_seq_len, "--max-seq-len")?;
    // The address first: a bad host or a busy port is refused before a model load of minutes.
    // Until the server starts, a connection waits in the kernel's queue.
    let std_listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    std_listener
        .set_nonblocking(true)
        .context("making the listener non-blocking")?;
    let (tokenizer, eos) = tokenizer_and_eos(args.model.model.as_deref(), &c)?;
    if let Some(dir) = &args.model.model {
        crate::qwen3_cmd::note_generation_defaults(
            dir,
            "a request samples as its fields say (greedy without `temperature`)",
        )?;
    }
    if tokenizer.vocab_size() > c.vocab_size {
        bail!(
            "{} has {} ids but the model's vocabulary is {}: serving text needs the tokenizer's vocabulary (the qwen3-* presets)",
            tokenizer.source(),
            tokenizer.vocab_size(),
            c.vocab_size
        );
    }

    let name = match (&args.served_model_name, &args.model.model) {
        (Some(n), _) => n.clone(),
        (None, Some(dir)) => dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_name().map(|f| f.to_string_lossy().into_owned()))
            .unwrap_or_else(|| dir.display().to_string()),
        (None, None) => args
            .model
            .preset
            .clone()
            .unwrap_or_else(|| "qwen3-0.6b".into()),
    };
    simpler_serve::http::check_model_name(&name)
        .map_err(|e| anyhow::anyhow!("--served-model-name: {e}"))?;

    // KV blocks: from the memory left after everything else, or as given.
    let rt = RuntimeConfig {
        max_batch_size: args.max_batch_size,
        max_seq_len: Some(max_seq_len),
        max_num_batched_tokens: args.max_num_batched_tokens,
        long_prefill_threshold: args.long_prefill_threshold,
        weight_dtype: args.model.weights.name().into(),
        kv_memory_fraction: args.kv_memory_fraction,
        num_kv_blocks: args.num_kv_blocks,
        memory_budget: args.model.memory_budget_bytes()?,
        ..RuntimeConfig::default()
    };
    let sizing = rt
        .sizing(
            &c,
            simpler_cpu::host_memory::available().map(|m| (m.available, m.source)),
        )
        .map_err(|e| anyhow::anyhow!("{}", as_flags(&e.to_string())))?;
    let num_blocks = sizing.engine.num_blocks;

    // A step holds up to --max-num-batched-tokens rows: the ring heap and the limit on one
    // run are sized for the longest such prefill step, at the end of the longest sequence.
    let worker = args.run.prefill_sized(
        &mut call,
        &c,
        args.max_num_batched_tokens,
        max_seq_len.saturating_sub(args.max_num_batched_tokens),
        "--max-num-batched-tokens",
    )?;
    ops::register(&worker)?;
    let model = load_model(
        &args.model,
        &worker,
        &c,
        false,
        Engine::resident_seq(&sizing.engine),
        sizing.engine.weights,
    )?;
    let mut engine = Engine::with_model(worker, model, eos.clone(), sizing.engine)?;
    let outputs = opts::StepOutputs::observe_engine(&mut engine, &args.run, &call)?;
    engine.set_call_config(call);
    eprintln!(
        "model: {} as `{name}`; {} layers, vocab {}; tokenizer {}; stops at EOS ids {:?}",
        args.model.describe(),
        c.num_hidden_layers,
        c.vocab_size,
        tokenizer.source(),
        eos
    );
    eprintln!(
        "engine: up to {} sequences and {} tokens per step, {max_seq_len} tokens per sequence; {}",
        args.max_batch_size,
        args.max_num_batched_tokens,
        sizing.describe(&rt)
    );
    eprintln!("{}", crate::qwen3_cmd::describe_weights(args.model.weights));
    let tokenizer = Arc::new(tokenizer);
    let service = Service::start(
        engine,
        tokenizer.clone(),
        ServiceConfig {
            max_waiting: args.max_waiting,
            drain: Duration::from_secs(args.drain_secs),
        },
    )?;
    let state = Arc::new(AppState {
        handle: service.handle(),
        tokenizer,
        model: name,
        max_model_len: max_seq_len.min(num_blocks * PAGE_SIZE),
        created: unix_now(),
        limits,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::from_std(std_listener)
            .context("handing the listener to the HTTP runtime")?;
        let addr = listener.local_addr()?;
        println!("listening on http://{addr}");
        std::io::stdout().flush()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let mut server = tokio::spawn(serve(listener, state, async move {
            let _ = stopped.await;
        }));
        tokio::select! {
            r = &mut server => return finished(r),
            () = shutdown_signal() => {}
        }
        eprintln!(
            "shutting down: in-flight requests may finish within {} s (a second signal exits now)",
            args.drain_secs
        );
        let _ = stop.send(());
        // The server returns once every connection is closed; one that never finishes its
        // request would hold it forever, so the drain time (plus a grace for the last
        // responses to go out) bounds the wait.
        let bound = Duration::from_secs(args.drain_secs) + Duration::from_secs(5);
        tokio::select! {
            r = &mut server => finished(r),
            () = shutdown_signal() => {
                eprintln!("second signal: exiting now");
                std::process::exit(130);
            }
            () = tokio::time::sleep(bound) => {
                eprintln!("connections still open {} s after the signal: closing them", bound.as_secs());
                Ok(())
            }
        }
    });
    // Work still on the runtime's blocking threads (a prompt being templated or tokenized for
    // a request whose client left) must not hold the exit: dropping the runtime would wait
    // for it without end.
    rt.shutdown_timeout(Duration::from_secs(1));
    served?;
    let engine = service.stop();
    if let Some(o) = &outputs {
        o.lock().unwrap_or_else(|p| p.into_inner()).finish();
    }
    let Some(e) = engine else {
        bail!("the engine thread died (see the messages above); requests in flight were lost");
    };
    {
        let s = e.stats();
        eprintln!(
            "served {} requests: {} prompt tokens ({} from the prefix cache), {} generated, {} steps, {} preemptions",
            s.requests,
            s.prompt_tokens,
            s.prefix_hit_tokens,
            s.generated_tokens,
            s.steps,
            s.preemptions
        );
        e.close();
    }
    Ok(())
}

/// The server task's result as the command's.
fn finished(r: Result<std::io::Result<()>, tokio::task::JoinError>) -> Result<()> {
    r.context("the HTTP server task")?
        .context("the HTTP server")
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_limits_are_checked_against_the_open_file_limit() {
        let ok = conn_limits(512, 30.0, 20.0, Some(1024)).unwrap();
        assert_eq!(ok.max_connections, 512);
        assert_eq!(ok.read_timeout, Duration::from_secs(30));
        assert_eq!(ok.write_timeout, Duration::from_secs(20));
        // Where the system says nothing, nothing to check against but the semaphore's limit.
        assert!(conn_limits(100_000, 0.5, 0.5, None).is_ok());
        let e = conn_limits(usize::MAX, 0.5, 0.5, None)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--max-connections"), "{e}");
        let e = conn_limits(1000, 30.0, 30.0, Some(1024))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--max-connections 1000:") && e.contains("give at most 960"),
            "{e}"
        );
        let e = conn_limits(usize::MAX, 30.0, 30.0, Some(1024))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--max-connections"), "{e}");
        assert!(conn_limits(0, 30.0, 30.0, None).is_err());
        for t in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9, 1e-10] {
            let e = conn_limits(512, t, 30.0, None).unwrap_err().to_string();
            assert!(e.starts_with("--read-timeout-secs"), "{t}: {e}");
            let e = conn_limits(512, 30.0, t, None).unwrap_err().to_string();
            assert!(e.starts_with("--write-timeout-secs"), "{t}: {e}");
        }
    }

    #[test]
    fn the_open_file_limit_is_read_where_linux_gives_it() {
        if std::path::Path::new("/proc/self/limits").exists() {
            let n = open_file_limit();
            // Unlimited reads as none; otherwise a count.
            assert!(n.is_none_or(|n| n > 0), "{n:?}");
        }
    }
}
