//! `simpler generate`: chunked prefill of a prompt, then greedy decode, on the runtime, until
//! `--max-new-tokens` or an end-of-sequence id (from the checkpoint's `generation_config.json`
//! or `config.json`; `--ignore-eos` to run on). Prints the generated token ids on one line
//! (comma-separated, the EOS included) on stdout; what runs (the model, its RoPE, the EOS ids),
//! the memory check and timing go to stderr; `--dump-logits` writes the fp32 logits of every
//! generated position as `[positions, vocab]` NPY.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use simpler_models::qwen3::golden::PrefillChunk;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{KvBuffers, PagedBatch, RunShape, Session, eos_token_ids, ops};

use crate::npy;
use crate::opts::{self, RunOpts};
use crate::qwen3_cmd::{ModelArgs, load_weights, upload};

/// Arguments of `simpler generate`.
#[derive(Args, Debug)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// The prompt as token ids, comma-separated (e.g. 1,2,3).
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..)]
    pub(crate) prompt_ids: Vec<u32>,
    /// Tokens to generate (greedy).
    #[arg(long, default_value_t = 16)]
    pub(crate) max_new_tokens: usize,
    /// Write the fp32 logits of every generated position to FILE (.npy, [positions, vocab]).
    #[arg(long, value_name = "FILE")]
    pub(crate) dump_logits: Option<PathBuf>,
    /// Prompt tokens per prefill step.
    #[arg(long, default_value_t = 256)]
    pub(crate) prefill_chunk: usize,
    /// Keep generating past end-of-sequence ids.
    #[arg(long)]
    pub(crate) ignore_eos: bool,
    #[command(flatten)]
    pub(crate) run: RunOpts,
}

pub(crate) fn main(args: GenerateArgs) -> Result<()> {
    if args.max_new_tokens == 0 || args.prefill_chunk == 0 {
        bail!("--max-new-tokens and --prefill-chunk must be at least 1");
    }
    // Flags first: a bad one is refused before anything loads.
    let prefill_cfg = args.run.call_config("prefill")?;
    let decode_cfg = args.run.call_config("decode")?;
    let c = args.model.config(None)?;
    if let Some(&t) = args
        .prompt_ids
        .iter()
        .find(|&&t| t as usize >= c.vocab_size)
    {
        bail!(
            "--prompt-ids: token {t} is outside the vocabulary of {}",
            c.vocab_size
        );
    }
    let total = args
        .prompt_ids
        .len()
        .checked_add(args.max_new_tokens - 1)
        .ok_or_else(|| anyhow::anyhow!("--max-new-tokens {} is too large", args.max_new_tokens))?;
    ModelArgs::check_positions(&c, total, "--prompt-ids + --max-new-tokens")?;
    let eos = match &args.model.model {
        Some(dir) => eos_token_ids(dir, &c)?,
        None => c.eos_token_ids.clone(),
    };
    let pages = total.div_ceil(PAGE_SIZE);
    args.model.check_memory(
        &c,
        &RunShape {
            layers: c.num_hidden_layers,
            shared_weights: false,
            kv_slots: pages * PAGE_SIZE,
            max_seq: pages * PAGE_SIZE,
            step_tokens: args.prefill_chunk.min(args.prompt_ids.len()),
        },
    )?;
    eprintln!(
        "model: {}; {} layers, hidden {}, heads {}/{}x{}, vocab {}, RoPE {} (theta {}), max_position_embeddings {}",
        args.model.describe(),
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.vocab_size,
        c.rope.type_name(),
        c.rope.theta,
        c.max_position_embeddings
    );
    eprintln!(
        "stops at: {}",
        match (args.ignore_eos, eos.is_empty()) {
            (true, _) => format!("{} new tokens (--ignore-eos)", args.max_new_tokens),
            (false, true) => format!(
                "{} new tokens (the model names no EOS id)",
                args.max_new_tokens
            ),
            (false, false) => format!("EOS ids {:?} or {} new tokens", eos, args.max_new_tokens),
        }
    );
    let stop = |t: u32| !args.ignore_eos && eos.contains(&t);
    let worker = args.run.worker()?;
    ops::register(&worker)?;
    let mut weights = load_weights(&args.model, &c, false)?;
    let prompt = &args.prompt_ids;
    let batch = PagedBatch::identity(vec![prompt.len()], total, PAGE_SIZE);
    let model = upload(&worker, &mut weights, batch.max_blocks * batch.page_size)?;
    let kv = KvBuffers::new(&worker, &c, batch.num_pages(), batch.page_size)?;
    let mut session = Session::new(&worker, model, kv);
    let want_logits = args.dump_logits.is_some();
    session.read_logits = want_logits;
    let mut logits: Vec<f32> = Vec::new();

    // Prefill in chunks; the last chunk's logits give the first generated token.
    let cfg = &prefill_cfg;
    let mut outputs = opts::StepOutputs::new(&args.run);
    let t0 = Instant::now();
    let mut next = 0u32;
    let mut done = 0;
    while done < prompt.len() {
        let end = (done + args.prefill_chunk).min(prompt.len());
        let chunk = PrefillChunk {
            seq: 0,
            tokens: prompt[done..end].to_vec(),
            seq_len: end,
        };
        session.read_logits = want_logits && end == prompt.len();
        let out = session
            .prefill(&worker, &batch, &[chunk], cfg)
            .context("prefill")?;
        outputs.emit(&out.report, cfg)?;
        next = out.next_tokens[0];
        if end == prompt.len() {
            logits.extend_from_slice(&out.logits);
        }
        done = end;
    }
    let prefill_s = t0.elapsed().as_secs_f64();

    // Greedy decode.
    let cfg = &decode_cfg;
    session.read_logits = want_logits;
    let mut generated = vec![next];
    let t1 = Instant::now();
    for i in 1..args.max_new_tokens {
        if stop(next) {
            break;
        }
        let step = PagedBatch {
            seq_lens: vec![prompt.len() + i],
            ..batch.clone()
        };
        let out = session
            .decode(&worker, &step, &[next], cfg)
            .context("decode")?;
        outputs.emit(&out.report, cfg)?;
        next = out.next_tokens[0];
        generated.push(next);
        logits.extend_from_slice(&out.logits);
    }
    let decode_s = t1.elapsed().as_secs_f64();
    outputs.finish();

    let ids: Vec<String> = generated.iter().map(|t| t.to_string()).collect();
    println!("{}", ids.join(","));
    if generated.last().is_some_and(|&t| stop(t)) {
        eprintln!(
            "stopped at EOS id {} after {} new tokens",
            next,
            generated.len()
        );
    }
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} tokens/s); decode: {} tokens in {:.3} s ({:.2} ms/token)",
        prompt.len(),
        prefill_s,
        prompt.len() as f64 / prefill_s,
        generated.len() - 1,
        decode_s,
        decode_s * 1e3 / (generated.len() - 1).max(1) as f64
    );
    if let Some(path) = &args.dump_logits {
        npy::write_f32(path, &[generated.len(), c.vocab_size], &logits)?;
        eprintln!(
            "wrote {} ([{}, {}] fp32 logits)",
            path.display(),
            generated.len(),
            c.vocab_size
        );
    }
    Ok(())
}
