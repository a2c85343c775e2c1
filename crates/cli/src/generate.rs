//! `simpler generate`: chunked prefill of a prompt, then decode, on the runtime, until
//! `--max-new-tokens` or an end-of-sequence id (from the checkpoint's `generation_config.json`
//! or `config.json`; `--ignore-eos` to run on).
//!
//! The prompt is text (`--prompt`), a chat message rendered through the tokenizer's chat
//! template (`--chat`), or token ids (`--prompt-ids`). Text prompts print the generated text,
//! streamed as it is decoded; id prompts print the generated ids on one line (comma-separated,
//! the EOS included). Tokens are greedy unless `--temperature` is above 0 (then top-k, top-p
//! and a seeded draw). What runs (the model, its RoPE, the tokenizer, the EOS ids), the memory
//! check and the timing line (TTFT, decode tokens/s, ms/token) go to stderr; `--dump-logits`
//! writes the fp32 logits of every generated position as `[positions, vocab]` NPY.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use simpler_models::qwen3::golden::PrefillChunk;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{KvBuffers, PagedBatch, RunShape, Session, eos_token_ids, ops};
use simpler_serve::{ChatMessage, IncrementalDecoder, Sampler, SamplingParams, Tokenizer};

use crate::npy;
use crate::opts::{self, RunOpts};
use crate::profile;
use crate::qwen3_cmd::{ModelArgs, describe_weights, load_model};

/// Arguments of `simpler generate`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "chat", "prompt_ids"])))]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// The prompt as text, tokenized as is (no chat template).
    #[arg(long)]
    pub(crate) prompt: Option<String>,
    /// A user message, rendered through the tokenizer's chat template with the assistant's
    /// turn opened.
    #[arg(long)]
    pub(crate) chat: Option<String>,
    /// A system message before `--chat`.
    #[arg(long)]
    pub(crate) system: Option<String>,
    /// Ask the chat template for an empty reasoning block (Qwen3's `enable_thinking=False`).
    #[arg(long)]
    pub(crate) no_thinking: bool,
    /// The prompt as token ids, comma-separated (e.g. 1,2,3).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub(crate) prompt_ids: Option<Vec<u32>>,
    /// Decoder layers to run [default: all of the model's] (a quick look at a large model;
    /// the output is then not the model's).
    #[arg(long, visible_alias = "num-layers-override")]
    pub(crate) layers: Option<usize>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub(crate) max_new_tokens: usize,
    /// Sampling temperature (0: greedy, the largest logit).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) temperature: f32,
    /// Sample among the k most likely tokens only (with --temperature above 0).
    #[arg(long)]
    pub(crate) top_k: Option<usize>,
    /// Sample among the most likely tokens whose probability reaches p (with --temperature
    /// above 0) [default: 1].
    #[arg(long)]
    pub(crate) top_p: Option<f32>,
    /// Seed of the sampling draws (with --temperature above 0) [default: 0].
    #[arg(long)]
    pub(crate) sample_seed: Option<u64>,
    /// Write the fp32 logits of every generated position to FILE (.npy, [positions, vocab]).
    #[arg(long, value_name = "FILE")]
    pub(crate) dump_logits: Option<PathBuf>,
    /// Prompt tokens per sequence per prefill step.
    #[arg(long, default_value_t = 256)]
    pub(crate) prefill_chunk: usize,
    /// Keep generating past end-of-sequence ids.
    #[arg(long)]
    pub(crate) ignore_eos: bool,
    /// Generate for N copies of the prompt together (one batch; copy i samples with seed + i).
    #[arg(long, default_value_t = 1)]
    pub(crate) num_prompts: usize,
    /// After the timing line, a report: phases (load, generate), API (prefill total, decode
    /// per step = TPOT; the first decode step is warm-up, labelled and kept out of the
    /// averages), and per callable n/total/avg/min/max of host and device time.
    #[arg(long)]
    pub(crate) profile: bool,
    /// `--profile` plus a table per step and one per layer.
    #[arg(long)]
    pub(crate) profile_verbose: bool,
    #[command(flatten)]
    pub(crate) run: RunOpts,
}

/// The tokenizer of the model: the directory's own files, or the embedded Qwen3 one for the
/// presets (whose random weights use the real vocabulary).
fn tokenizer(args: &GenerateArgs, vocab: usize) -> Result<Tokenizer> {
    let tok = match &args.model.model {
        Some(dir) => Tokenizer::from_dir(dir)?,
        None => Tokenizer::qwen3()?,
    };
    if tok.vocab_size() > vocab {
        bail!(
            "{} has {} ids but the model's vocabulary is {vocab}: text needs a model with the tokenizer's vocabulary (the qwen3-* presets), or give --prompt-ids",
            tok.source(),
            tok.vocab_size()
        );
    }
    Ok(tok)
}

pub(crate) fn main(args: GenerateArgs) -> Result<()> {
    if args.max_new_tokens == 0 || args.prefill_chunk == 0 || args.num_prompts == 0 {
        bail!("--max-new-tokens, --prefill-chunk and --num-prompts must be at least 1");
    }
    if args.chat.is_none() {
        // The system prompt and the thinking switch go into the chat template; a --prompt is
        // tokenised as written, so they would change nothing.
        for (flag, given) in [
            ("--system", args.system.is_some()),
            ("--no-thinking", args.no_thinking),
        ] {
            if given {
                bail!("{flag}: applies to --chat (the chat template); --prompt is used as written");
            }
        }
    }
    if args.num_prompts > 1 && args.dump_logits.is_some() {
        bail!("--dump-logits writes one sequence's logits: give --num-prompts 1");
    }
    if args.temperature == 0.0 {
        // Greedy decoding takes the largest logit: the sampling flags would change nothing.
        for (flag, given) in [
            ("--top-k", args.top_k.is_some()),
            ("--top-p", args.top_p.is_some()),
            ("--sample-seed", args.sample_seed.is_some()),
        ] {
            if given {
                bail!(
                    "{flag}: applies when sampling; give --temperature above 0 (0, the default, is greedy)"
                );
            }
        }
    }
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p.unwrap_or(1.0),
        seed: args.sample_seed.unwrap_or(0),
    };
    sampling
        .validate()
        .map_err(|(name, why)| anyhow!("--{} {why}", name.replace('_', "-")))?;
    // Flags first: a bad one is refused before anything loads.
    let mut prefill_cfg = args.run.call_config("prefill")?;
    let decode_cfg = args.run.call_config("decode")?;
    let c = args.model.config(args.layers)?;

    // The prompt's ids.
    let t_load = Instant::now();
    let tok = match &args.prompt_ids {
        Some(_) => None,
        None => Some(tokenizer(&args, c.vocab_size)?),
    };
    let prompt: Vec<u32> = match (&tok, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(tok), None) => {
            match (&args.prompt, &args.chat) {
                // A plain prompt gets the special tokens the tokenizer adds (a BOS, where it
                // has one); a rendered chat holds its own.
                (Some(p), _) => tok.encode_prompt(p)?,
                (None, Some(m)) => {
                    let mut messages = Vec::new();
                    if let Some(s) = &args.system {
                        messages.push(ChatMessage::new("system", s));
                    }
                    messages.push(ChatMessage::new("user", m));
                    let text = tok.apply_chat_template(
                        &messages,
                        true,
                        args.no_thinking.then_some(false),
                    )?;
                    tok.encode(&text)?
                }
                (None, None) => bail!("give --prompt, --chat or --prompt-ids"),
            }
        }
        (None, None) => bail!("give --prompt, --chat or --prompt-ids"),
    };
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    if let Some(&t) = prompt.iter().find(|&&t| t as usize >= c.vocab_size) {
        bail!(
            "--prompt-ids: token {t} is outside the vocabulary of {}",
            c.vocab_size
        );
    }
    let total = prompt
        .len()
        .checked_add(args.max_new_tokens - 1)
        .ok_or_else(|| anyhow!("--max-new-tokens {} is too large", args.max_new_tokens))?;
    ModelArgs::check_positions(&c, total, "the prompt + --max-new-tokens")?;
    let eos = match &args.model.model {
        Some(dir) => eos_token_ids(dir, &c)?,
        None => c.eos_token_ids.clone(),
    };
    if let Some(dir) = &args.model.model {
        crate::qwen3_cmd::note_generation_defaults(
            dir,
            "this command samples as its flags say (greedy without --temperature)",
        )?;
    }
    let pages = total.div_ceil(PAGE_SIZE);
    args.model.check_memory(
        &c,
        &RunShape {
            layers: c.num_hidden_layers,
            shared_weights: false,
            kv_slots: args.num_prompts * pages * PAGE_SIZE,
            max_seq: pages * PAGE_SIZE,
            step_tokens: args.num_prompts * args.prefill_chunk.min(prompt.len()),
            weights: args.model.weights,
            stream_layers: true,
        },
        &crate::qwen3_cmd::FitFlags {
            layers: true,
            shared_weights: false,
            context: "a shorter context or fewer prompts (a shorter prompt, --max-new-tokens, --num-prompts)",
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
    eprintln!("{}", describe_weights(args.model.weights));
    if let Some(t) = &tok {
        eprintln!(
            "tokenizer: {} ({} ids); prompt {} tokens",
            t.source(),
            t.vocab_size(),
            prompt.len()
        );
    }
    eprintln!(
        "stops at: {}; {}",
        match (args.ignore_eos, eos.is_empty()) {
            (true, _) => format!("{} new tokens (--ignore-eos)", args.max_new_tokens),
            (false, true) => format!(
                "{} new tokens (the model names no EOS id)",
                args.max_new_tokens
            ),
            (false, false) => format!("EOS ids {:?} or {} new tokens", eos, args.max_new_tokens),
        },
        if sampling.temperature == 0.0 {
            "greedy".to_string()
        } else {
            format!(
                "sampling at temperature {}, top-k {}, top-p {}, seed {}",
                sampling.temperature,
                sampling.top_k.map_or("off".into(), |k| k.to_string()),
                sampling.top_p,
                sampling.seed
            )
        }
    );
    let stop = |t: u32| !args.ignore_eos && eos.contains(&t);
    if let Some(path) = &args.dump_logits {
        // Checked now: a directory or an unwritable path was found only after the whole
        // generation, its logits lost. The file (and its folder) are made when written.
        crate::opts::check_writable_file("--dump-logits", path)?;
    }
    let n = args.num_prompts;
    let chunk = args.prefill_chunk.min(prompt.len());
    let worker = args.run.prefill_sized(
        &mut prefill_cfg,
        &c,
        n * chunk,
        prompt.len() - chunk,
        "--prefill-chunk x --num-prompts",
    )?;
    ops::register(&worker)?;
    let batch = PagedBatch::identity(vec![prompt.len(); n], total, PAGE_SIZE);
    let model = load_model(
        &args.model,
        &worker,
        &c,
        false,
        batch.max_blocks * batch.page_size,
        args.model.weights,
    )?;
    let kv = KvBuffers::new(&worker, &c, batch.num_pages(), batch.page_size)?;
    let mut session = Session::new(&worker, model, kv);
    let load_s = t_load.elapsed().as_secs_f64();
    // Sampling needs every step's logits; greedy reads only the runtime's argmax. Prompt i
    // samples with seed + i, so copies of one prompt draw differently.
    let greedy = sampling.temperature == 0.0;
    let want_logits = args.dump_logits.is_some() || !greedy;
    let mut samplers: Vec<Sampler> = (0..n as u64)
        .map(|i| {
            Sampler::new(SamplingParams {
                seed: sampling.seed.wrapping_add(i),
                ..sampling
            })
        })
        .collect();
    let mut pick =
        |out: &simpler_models::qwen3::StepOutput, row: usize, seq: usize| -> Result<u32> {
            if greedy {
                return Ok(out.next_tokens[row]);
            }
            samplers[seq]
                .sample(&out.logits[row * c.vocab_size..(row + 1) * c.vocab_size])
                .ok_or_else(|| anyhow!("every logit of the step is NaN"))
        };
    let mut logits: Vec<f32> = Vec::new();
    // Text streams to stdout as it is decoded for one prompt; several are printed at the end.
    let stream_text = n == 1;
    let mut decoders: Vec<IncrementalDecoder> =
        (0..n).map(|_| IncrementalDecoder::new(true)).collect();
    let mut texts = vec![String::new(); n];
    let mut stdout = std::io::stdout().lock();
    let mut emit_text = |seq: usize, id: u32, out: &mut dyn Write| -> Result<()> {
        if let Some(t) = &tok
            && !stop(id)
        {
            let d = decoders[seq].push(t, id)?;
            if stream_text {
                write!(out, "{d}")?;
                out.flush()?;
            }
            texts[seq].push_str(&d);
        }
        Ok(())
    };
    let mut steps: Vec<profile::Step> = Vec::new();

    // Prefill in chunks (every prompt's next chunk in one step); the last chunk's logits give
    // each prompt's first generated token.
    let cfg = &prefill_cfg;
    let mut outputs = opts::StepOutputs::new(&args.run);
    let t0 = Instant::now();
    let mut next = vec![0u32; n];
    let mut done = 0;
    while done < prompt.len() {
        let end = (done + args.prefill_chunk).min(prompt.len());
        let chunks: Vec<PrefillChunk> = (0..n)
            .map(|seq| PrefillChunk {
                seq,
                tokens: prompt[done..end].to_vec(),
                seq_len: end,
            })
            .collect();
        session.read_logits = want_logits && end == prompt.len();
        let t = Instant::now();
        let out = session
            .prefill(&worker, &batch, &chunks, cfg)
            .context("prefill")?;
        steps.push(profile::Step::new(
            "prefill",
            n,
            n * (end - done),
            t,
            &out.report,
        ));
        outputs.emit(&out.report, cfg)?;
        if end == prompt.len() {
            for (seq, nx) in next.iter_mut().enumerate() {
                *nx = pick(&out, seq, seq)?;
            }
            if args.dump_logits.is_some() {
                logits.extend_from_slice(&out.logits);
            }
        }
        done = end;
    }
    let ttft_s = t0.elapsed().as_secs_f64();
    for (seq, &id) in next.iter().enumerate() {
        emit_text(seq, id, &mut stdout)?;
    }

    // Decode the sequences that have not stopped, one token each per step.
    let cfg = &decode_cfg;
    // The first decode step is warm-up (the profile labels it so): its trace marks it too.
    let warm_cfg = simpler_core::CallConfig {
        warmup: true,
        ..decode_cfg.clone()
    };
    session.read_logits = want_logits;
    let mut generated: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    let t1 = Instant::now();
    for i in 1..args.max_new_tokens {
        let live: Vec<usize> = (0..n).filter(|&s| !stop(next[s])).collect();
        if live.is_empty() {
            break;
        }
        let mb = batch.max_blocks;
        let step = PagedBatch {
            page_size: batch.page_size,
            max_blocks: mb,
            block_table: live
                .iter()
                .flat_map(|&s| batch.block_table[s * mb..(s + 1) * mb].iter().copied())
                .collect(),
            seq_lens: vec![prompt.len() + i; live.len()],
        };
        let last: Vec<u32> = live.iter().map(|&s| next[s]).collect();
        let step_cfg = if i == 1 { &warm_cfg } else { cfg };
        let t = Instant::now();
        let out = session
            .decode(&worker, &step, &last, step_cfg)
            .context("decode")?;
        steps.push(profile::Step::new(
            "decode",
            live.len(),
            live.len(),
            t,
            &out.report,
        ));
        outputs.emit(&out.report, step_cfg)?;
        for (row, &seq) in live.iter().enumerate() {
            next[seq] = pick(&out, row, seq)?;
            generated[seq].push(next[seq]);
            emit_text(seq, next[seq], &mut stdout)?;
        }
        if args.dump_logits.is_some() {
            logits.extend_from_slice(&out.logits);
        }
    }
    let decode_s = t1.elapsed().as_secs_f64();
    outputs.finish();

    if let Some(t) = &tok {
        for (seq, d) in decoders.iter_mut().enumerate() {
            let tail = d.finish(t)?;
            texts[seq].push_str(&tail);
            if stream_text {
                writeln!(stdout, "{tail}")?;
            }
        }
        if !stream_text {
            for (seq, text) in texts.iter().enumerate() {
                writeln!(stdout, "[{seq}] {text}")?;
            }
        }
    } else {
        for (seq, g) in generated.iter().enumerate() {
            let ids: Vec<String> = g.iter().map(|t| t.to_string()).collect();
            if n == 1 {
                writeln!(stdout, "{}", ids.join(","))?;
            } else {
                writeln!(stdout, "[{seq}] {}", ids.join(","))?;
            }
        }
    }
    drop(stdout);
    for (seq, g) in generated.iter().enumerate() {
        if g.last().is_some_and(|&t| stop(t)) {
            eprintln!(
                "{}stopped at EOS id {} after {} new tokens",
                if n > 1 {
                    format!("[{seq}] ")
                } else {
                    String::new()
                },
                g[g.len() - 1],
                g.len()
            );
        }
    }
    let new_tokens: usize = generated.iter().map(Vec::len).sum();
    let decoded = new_tokens - n;
    let decode_steps = steps.iter().filter(|s| s.kind == "decode").count();
    // With one new token a sequence every token came from the prefill: no decode rate.
    let decode = if decode_steps == 0 {
        "no decode step (each new token came from the prefill)".to_string()
    } else {
        format!(
            "decode {:.2} tokens/s, {:.2} ms/token (per step)",
            decoded as f64 / decode_s.max(1e-9),
            decode_s * 1e3 / decode_steps as f64
        )
    };
    eprintln!(
        "{n} x {} prompt tokens, {new_tokens} new tokens: TTFT {:.1} ms (prefill {:.1} tokens/s); {decode}; overall {:.2} tokens/s; load {:.2} s",
        prompt.len(),
        ttft_s * 1e3,
        (n * prompt.len()) as f64 / ttft_s,
        new_tokens as f64 / (ttft_s + decode_s),
        load_s
    );
    if args.profile || args.profile_verbose {
        print!(
            "{}",
            profile::report(
                &steps,
                load_s,
                ttft_s + decode_s,
                c.num_hidden_layers,
                args.profile_verbose
            )
        );
    }
    if let Some(path) = &args.dump_logits {
        let rows = generated[0].len();
        npy::write_f32(path, &[rows, c.vocab_size], &logits)?;
        eprintln!(
            "wrote {} ([{rows}, {}] fp32 logits)",
            path.display(),
            c.vocab_size
        );
    }
    Ok(())
}
