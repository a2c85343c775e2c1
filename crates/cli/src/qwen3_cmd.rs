//! Shared pieces of the Qwen3 commands: where the model comes from (a preset with seeded random
//! weights, or a local HF checkpoint), progress bars while weights are generated, loaded and
//! uploaded, the decode case (block tables, inputs, KV pools filled pool by pool), and the
//! streamed golden check.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use simpler_core::{GraphMode, RunReport, Worker};
use simpler_cpu::host_memory;
use simpler_models::qwen3::check::{GoldenSource, GoldenStep, HeadSource, golden_decode_streamed};
use simpler_models::qwen3::golden::Acts;
use simpler_models::qwen3::{
    FixtureOptions, Int8Acts, KvBuffers, LayerWeights, LoadOptions, MemoryEstimate, PagedBatch,
    ProjectionElem, Qwen3Config, Qwen3Weights, ResidentModel, RunShape, Session, TilePolicy,
    UnknownWeightFormat, WeightFormat, WeightLayout, generate_inputs, generate_kv_pools,
    generate_weights, load_checkpoint, load_config,
};

/// Where the model comes from.
#[derive(Args, Debug, Clone)]
pub(crate) struct ModelArgs {
    /// Built-in shape with seeded random weights (nothing is downloaded): qwen3-14b, qwen3-8b,
    /// qwen3-1.7b, qwen3-0.6b, qwen3-tiny (a test shape with the real vocabulary), tiny, small
    /// [default: qwen3-0.6b].
    #[arg(long, conflicts_with = "model")]
    pub(crate) preset: Option<String>,
    /// A local HF checkpoint directory (config.json and model.safetensors or a sharded
    /// model.safetensors.index.json), or a preset's name (as --preset) where no such directory
    /// exists.
    #[arg(long, value_name = "DIR|PRESET")]
    pub(crate) model: Option<PathBuf>,
    /// The checkpoint stores projections [in, out] (y = x @ W) instead of HF's [out, in].
    #[arg(long)]
    pub(crate) in_out_layout: bool,
    /// Seed of a preset's random weights and, in `run qwen3-decode` and the decode and prefill
    /// benches, of the KV pools and inputs [default: 1234]. With a `--model` checkpoint it only
    /// draws those KV pools and inputs, so `generate`, `serve` and `bench serve`, which take
    /// nothing else from it, refuse it there (their sampling has its own `--sample-seed`).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// How the projections and the LM head are held: `bf16`, or `int8` (per-output-channel
    /// int8 with fp32 scales, quantised at upload; activations quantised per row, the faster
    /// mode here). `int8-w8a8` is `int8`; `int8-wide` keeps fp32 activations (for comparison).
    #[arg(long, default_value = "bf16", value_parser = parse_weight_format)]
    pub(crate) weights: WeightFormat,
    /// How bf16 matrices lie in memory on the CPU: `row-major`; `pairs` (8-row groups of
    /// interleaved column pairs, what the AVX2 and the AVX-512 BF16 paths stream: faster at
    /// every decode batch there); or `tiled` (16-row groups of 1 KiB blocks, streamed by the
    /// AMX tiles at every batch: 6.5% faster at 16 × 1024 on the AMX Xeon measured, 8.7% slower
    /// at 1 × 256 and 3.9% at 4 × 1024). Each only where the shape allows it (row-major
    /// elsewhere); `tiled` only on the AMX path (refused on others). `--platform cuda` refuses
    /// an explicit `tiled` or `pairs`: the device holds row-major weights [default: pairs on
    /// the AVX2 path and on AVX-512 BF16 without AMX, row-major elsewhere].
    #[arg(long, value_enum)]
    pub(crate) bf16_layout: Option<Bf16LayoutArg>,
    /// Most memory the run may take, in GB [default: what the machine has available: the
    /// smaller of MemAvailable and the room under the cgroup limit].
    #[arg(long, value_name = "GB")]
    pub(crate) memory_budget: Option<f64>,
    /// RoPE θ of a preset, e.g. 1e4 for the reference stress case's fixture (a checkpoint's
    /// config.json states its own, so it refuses this) [default: the preset's: 1e6 as Qwen3's
    /// checkpoints have it, 1e4 for tiny and small].
    #[arg(long, value_name = "THETA")]
    pub(crate) rope_theta: Option<f64>,
}

/// The seed when `--seed` is not given.
const DEFAULT_SEED: u64 = 1234;

/// The flags a command offers to make a run fit in memory: `check_memory`'s ways out name only
/// those.
pub(crate) struct FitFlags {
    /// The command takes `--layers`.
    pub(crate) layers: bool,
    /// The command takes `--shared-weights`.
    pub(crate) shared_weights: bool,
    /// How the command's context or batch is made smaller, in its flags.
    pub(crate) context: &'static str,
}

impl ModelArgs {
    /// `--seed`, or its default.
    pub(crate) fn seed(&self) -> u64 {
        self.seed.unwrap_or(DEFAULT_SEED)
    }

    /// Refuses `--seed` with a checkpoint for a command (`what`) that takes nothing but a
    /// preset's weights from it: the flag would change nothing.
    pub(crate) fn refuse_seed_with_checkpoint(&self, what: &str) -> Result<()> {
        if let (Some(seed), Some(dir)) = (self.seed, &self.model) {
            bail!(
                "--seed {seed}: seeds a preset's random weights, and {what} takes nothing else from it; --model {} is a checkpoint (to seed sampling: --sample-seed)",
                dir.display()
            );
        }
        Ok(())
    }

    /// `--model NAME` where `NAME` is no directory but a preset's name: the preset, as
    /// `--preset NAME` (a directory of that name wins). A path that is neither is refused here,
    /// naming both readings.
    pub(crate) fn resolve_preset_name(&mut self) -> Result<()> {
        let Some(path) = &self.model else {
            if self.in_out_layout {
                bail!(
                    "--in-out-layout: applies to a --model checkpoint; a preset's weights are generated, not read"
                );
            }
            return Ok(());
        };
        if path.exists() {
            return Ok(());
        }
        let name = path.to_string_lossy().into_owned();
        if !Qwen3Config::PRESETS.contains(&name.as_str()) {
            bail!(
                "--model {name}: no such checkpoint directory, and not a preset (presets: {})",
                Qwen3Config::PRESETS.join(", ")
            );
        }
        if self.in_out_layout {
            bail!("--in-out-layout: --model {name} is a preset (seeded weights), not a checkpoint");
        }
        self.model = None;
        self.preset = Some(name);
        Ok(())
    }
}

/// `--bf16-layout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Bf16LayoutArg {
    RowMajor,
    Tiled,
    Pairs,
}

/// `--weights`: an unknown value is refused with an error naming it.
fn parse_weight_format(s: &str) -> Result<WeightFormat, UnknownWeightFormat> {
    WeightFormat::parse(s)
}

/// One line naming the weight format and, for int8, the kernel path that runs it.
pub(crate) fn describe_weights(format: WeightFormat) -> String {
    use simpler_kernels_cpu::gemm_i8::{AMX_MIN_BATCH, I8Path};
    let path = I8Path::current();
    match format {
        WeightFormat::Bf16 => "weights: bf16".to_string(),
        WeightFormat::Int8(Int8Acts::Quantised) => {
            let path = match path {
                I8Path::Amx => format!("amx-int8 from batch {AMX_MIN_BATCH}, avx512-vnni below"),
                p => p.name().to_string(),
            };
            format!(
                "weights: int8 per output channel, projection activations quantised per row (W8A8), LM head fp32 activations; int8 path {path}"
            )
        }
        WeightFormat::Int8(Int8Acts::Wide) => {
            let path = match path {
                I8Path::Amx | I8Path::Avx512Vnni => "avx512",
                I8Path::AvxVnni | I8Path::Avx2 => "avx2",
                I8Path::Portable => "portable",
            };
            format!("weights: int8 per output channel, fp32 activations (wide); int8 path {path}")
        }
    }
}

impl ModelArgs {
    /// A short description of the source.
    pub(crate) fn describe(&self) -> String {
        match &self.model {
            Some(dir) => format!("checkpoint {}", dir.display()),
            None => format!(
                "preset {} (seeded random weights, seed {}{})",
                self.preset_name(),
                self.seed(),
                self.rope_theta
                    .map_or(String::new(), |t| format!(", RoPE θ {t:e}"))
            ),
        }
    }

    fn preset_name(&self) -> &str {
        self.preset.as_deref().unwrap_or("qwen3-0.6b")
    }

    /// The configuration the command will run, read before any weight is generated or
    /// loaded (a checkpoint's `config.json` only), with `layers` applied.
    pub(crate) fn config(&self, layers: Option<usize>) -> Result<Qwen3Config> {
        let mut c = match &self.model {
            Some(dir) => load_config(dir)?,
            None => Qwen3Config::preset(self.preset_name())?,
        };
        if let Some(theta) = self.rope_theta {
            if let Some(dir) = &self.model {
                bail!(
                    "--rope-theta {theta}: sets a preset's RoPE θ; --model {} is a checkpoint, whose config.json states its own",
                    dir.display()
                );
            }
            if !(theta.is_finite() && theta > 1.0) {
                bail!("--rope-theta {theta}: give a finite base above 1 (e.g. 1e4 or 1e6)");
            }
            c.rope.theta = theta;
        }
        if let Some(n) = layers {
            if n == 0 || n > c.num_hidden_layers {
                bail!("--layers {n}: the model has {} layers", c.num_hidden_layers);
            }
            c.num_hidden_layers = n;
        }
        Ok(c)
    }

    /// Refuses sequences longer than the model's `max_position_embeddings` (`flag` names what
    /// set the length).
    pub(crate) fn check_positions(c: &Qwen3Config, longest: usize, flag: &str) -> Result<()> {
        if longest > c.max_position_embeddings {
            bail!(
                "{flag}: sequences reach {longest} tokens, past the model's max_position_embeddings of {} (RoPE {} beyond that is not what the checkpoint was configured for)",
                c.max_position_embeddings,
                c.rope.type_name()
            );
        }
        Ok(())
    }

    /// Refuses a run of `c` shaped `shape` that cannot fit in the memory available (or the
    /// `--memory-budget`), before anything is allocated: the message gives the estimate item
    /// by item and the ways out. Prints the estimate otherwise.
    /// `--memory-budget` in bytes, checked.
    pub(crate) fn memory_budget_bytes(&self) -> Result<Option<u64>> {
        match self.memory_budget {
            Some(gb) if !(gb.is_finite() && gb > 0.0) => {
                bail!("--memory-budget {gb}: give a positive number of GB")
            }
            Some(gb) => Ok(Some((gb * 1e9) as u64)),
            None => Ok(None),
        }
    }

    /// The memory this run may take and where that figure comes from (`--memory-budget`, or
    /// what the machine has available); `None` when neither is known.
    pub(crate) fn memory_limit(&self) -> Result<Option<(u64, String)>> {
        let machine = host_memory::available();
        Ok(Some(match (self.memory_budget, &machine) {
            (Some(gb), _) if !(gb.is_finite() && gb > 0.0) => {
                bail!("--memory-budget {gb}: give a positive number of GB")
            }
            (Some(gb), Some(m)) if (m.available as f64) < gb * 1e9 => (
                m.available,
                format!("{} (below --memory-budget {gb})", m.source),
            ),
            (Some(gb), _) => ((gb * 1e9) as u64, "--memory-budget".to_string()),
            (None, Some(m)) => (m.available, m.source.clone()),
            (None, None) => return Ok(None),
        }))
    }

    pub(crate) fn check_memory(
        &self,
        c: &Qwen3Config,
        shape: &RunShape,
        fit: &FitFlags,
    ) -> Result<()> {
        let need = MemoryEstimate::of(c, shape)?;
        let Some((limit, source)) = self.memory_limit()? else {
            eprintln!(
                "memory: this run needs about {:.2} GB; the available memory could not be read, so it is not checked",
                need.total() as f64 / 1e9
            );
            return Ok(());
        };
        let gb = |b: u64| b as f64 / 1e9;
        if need.total() > limit {
            let mut ways = Vec::new();
            if fit.layers && shape.layers > 1 {
                ways.push(format!("--layers N (fewer than {})", shape.layers));
            }
            if !shape.weights.is_int8() {
                let int8 = RunShape {
                    weights: WeightFormat::Int8(Int8Acts::Quantised),
                    ..*shape
                };
                if let Ok(e) = MemoryEstimate::of(c, &int8)
                    && e.total() <= limit
                {
                    ways.push(format!(
                        "--weights int8 (about {})",
                        simpler_models::qwen3::decimal_bytes(e.total())
                    ));
                }
            }
            if fit.shared_weights
                && self.model.is_none()
                && !shape.shared_weights
                && shape.layers > 1
            {
                ways.push("--shared-weights (one weight set for every layer)".into());
            }
            if self.model.is_none() {
                // The presets that fit in the same shape, largest first.
                let fit: Vec<&str> = Qwen3Config::PRESETS
                    .iter()
                    .copied()
                    .filter(|&p| {
                        Qwen3Config::preset(p).is_ok_and(|pc| {
                            pc.hidden_size < c.hidden_size
                                && MemoryEstimate::of(&pc, shape).is_ok_and(|e| e.total() <= limit)
                        })
                    })
                    .collect();
                if !fit.is_empty() {
                    ways.push(format!("a smaller --preset ({})", fit.join(", ")));
                }
            }
            ways.push(fit.context.into());
            let d = simpler_models::qwen3::decimal_bytes;
            bail!(
                "this run needs about {} but {} is available ({source}): {}. Ways out: {}",
                d(need.total()),
                d(limit),
                need.describe(),
                ways.join("; ")
            );
        }
        eprintln!(
            "memory: about {:.2} GB needed of {:.2} GB available ({source})",
            gb(need.total()),
            gb(limit)
        );
        Ok(())
    }
}

/// Whether decode steps replay a captured graph (`Session::replay`, `verify_replay`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Replay {
    /// Capture the first step of each topology, replay the graph afterwards.
    On,
    /// Run the orchestration for every step.
    Off,
    /// As `on`, but every step that would replay runs its orchestration, is captured and is
    /// checked against the kept graph: a difference fails the step, naming what the step's
    /// shape left out (a check of the replay, paying the orchestration every step).
    Verify,
}

impl Replay {
    /// Whether steps are captured (and, unless verifying, replayed).
    pub(crate) fn on(self) -> bool {
        self != Replay::Off
    }

    /// Whether steps that would replay are checked against a fresh capture instead.
    pub(crate) fn verify(self) -> bool {
        self == Replay::Verify
    }

    /// The flag's value as typed.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Replay::On => "on",
            Replay::Off => "off",
            Replay::Verify => "verify",
        }
    }
}

/// One line saying how the steps' graphs came about: orchestrated, captured or replayed, with
/// the median orchestration span of each kind (a replay's is its submission loop).
pub(crate) fn describe_graphs<'a>(
    replay: Replay,
    reports: impl Iterator<Item = &'a RunReport>,
) -> String {
    let mut us: [Vec<f64>; 3] = Default::default();
    for r in reports {
        let kind = match r.graph {
            GraphMode::Orchestrated => 0,
            GraphMode::Captured { .. } => 1,
            GraphMode::Replayed { .. } => 2,
        };
        us[kind].push(r.orch.us());
    }
    let parts: Vec<String> = ["orchestrated", "captured", "replayed"]
        .iter()
        .zip(&mut us)
        .filter(|(_, v)| !v.is_empty())
        .map(|(name, v)| {
            let median = simpler_dfx::bench_stats::Summary::of(v).median;
            format!("{} {name} (orch {median:.0} us median)", v.len())
        })
        .collect();
    format!(
        "graph: --replay {} -> {}{}",
        replay.name(),
        parts.join(", "),
        if replay.verify() {
            "; every step after a topology's first checked against the graph captured before it"
        } else {
            ""
        }
    )
}

/// How steps are cut into tasks (defaults: the models crate's `TilePolicy`).
#[derive(Args, Debug, Clone)]
pub(crate) struct TileArgs {
    /// About how many weight KiB one projection tile streams [default: 1024].
    #[arg(long, value_parser = positive)]
    pub(crate) tile_kib: Option<usize>,
    /// Fewest tiles of each projection per core [default: 4].
    #[arg(long, value_parser = positive)]
    pub(crate) tiles_per_core: Option<usize>,
    /// Longest decode attention KV chunk, in tokens [default: none: a sequence is cut only as
    /// far as the attention tasks per core ask].
    #[arg(long, value_parser = positive)]
    pub(crate) max_kv_chunk: Option<usize>,
    /// Query rows per prefill attention task (a `--versus` key of `bench qwen3-prefill` only).
    #[arg(skip)]
    pub(crate) prefill_rows: Option<usize>,
    /// KiB of fp32 products a block of prefill's q/k/v task keeps (a `--versus` key of `bench
    /// qwen3-prefill` only).
    #[arg(skip)]
    pub(crate) qkv_scratch_kib: Option<usize>,
}

/// A count of at least 1 (a zero is refused, not raised to 1).
pub(crate) fn positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

impl TileArgs {
    /// Applies the overrides to a session's policy.
    pub(crate) fn apply(&self, session: &mut Session) {
        self.apply_to(&mut session.policy);
    }

    /// Applies the overrides to `policy`.
    pub(crate) fn apply_to(&self, policy: &mut TilePolicy) {
        if let Some(k) = self.tile_kib {
            policy.tile_bytes = k << 10;
        }
        if let Some(n) = self.tiles_per_core {
            policy.tiles_per_core = n;
        }
        if let Some(n) = self.max_kv_chunk {
            policy.max_kv_chunk = n;
        }
        if let Some(n) = self.prefill_rows {
            policy.prefill_rows = n;
        }
        if let Some(k) = self.qkv_scratch_kib {
            policy.qkv_scratch_bytes = k << 10;
        }
    }

    /// The keys given that only a prefill step reads, for a command that runs none.
    pub(crate) fn prefill_keys(&self) -> Vec<&'static str> {
        [
            ("prefill-rows", self.prefill_rows.is_some()),
            ("qkv-scratch-kib", self.qkv_scratch_kib.is_some()),
        ]
        .into_iter()
        .filter_map(|(k, given)| given.then_some(k))
        .collect()
    }

    /// Overrides written `KEY=VALUE[,KEY=VALUE..]` with the flags' names (`tile-kib=512,
    /// max-kv-chunk=1024`), and the prefill keys `prefill-rows` and `qkv-scratch-kib`.
    pub(crate) fn parse(spec: &str) -> Result<TileArgs> {
        let mut t = TileArgs {
            tile_kib: None,
            tiles_per_core: None,
            max_kv_chunk: None,
            prefill_rows: None,
            qkv_scratch_kib: None,
        };
        const KEYS: &str =
            "tile-kib, tiles-per-core, max-kv-chunk, prefill-rows or qkv-scratch-kib";
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| anyhow!("{item:?}: expected KEY=VALUE, e.g. tile-kib=512"))?;
            let value: usize = value
                .trim()
                .parse()
                .map_err(|_| anyhow!("{item:?}: the value must be a positive integer"))?;
            if value == 0 {
                bail!("{item:?}: the value must be a positive integer");
            }
            let slot = match key.trim() {
                "tile-kib" => &mut t.tile_kib,
                "tiles-per-core" => &mut t.tiles_per_core,
                "max-kv-chunk" => &mut t.max_kv_chunk,
                "prefill-rows" => &mut t.prefill_rows,
                "qkv-scratch-kib" => &mut t.qkv_scratch_kib,
                other => bail!("{other:?}: unknown tiling key ({KEYS})"),
            };
            if slot.replace(value).is_some() {
                bail!("{:?} is given twice", key.trim());
            }
        }
        let given = [
            t.tile_kib,
            t.tiles_per_core,
            t.max_kv_chunk,
            t.prefill_rows,
            t.qkv_scratch_kib,
        ];
        if given.iter().all(Option::is_none) {
            bail!("{spec:?}: no override (give KEY=VALUE with {KEYS})");
        }
        Ok(t)
    }
}

/// Prints the generation defaults a checkpoint's `generation_config.json` suggests that the
/// command does not apply (`instead` says what it does), so that none is ignored silently.
pub(crate) fn note_generation_defaults(dir: &std::path::Path, instead: &str) -> Result<()> {
    let suggested = simpler_models::qwen3::generation_defaults(dir)?;
    if !suggested.is_empty() {
        eprintln!(
            "note: {} suggests {}; not applied: {instead}",
            dir.join("generation_config.json").display(),
            suggested.join(", ")
        );
    }
    Ok(())
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub(crate) fn progress(len: u64, what: &str, bytes: bool) -> ProgressBar {
    let pb = ProgressBar::new(len);
    let template = if bytes {
        "{msg:>12} [{bar:40}] {bytes}/{total_bytes} ({eta})"
    } else {
        "{msg:>12} [{bar:40}] {pos}/{len} ({eta})"
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    pb
}

/// Applies `--bf16-layout` (the process's choice of how bf16 matrices are held).
fn choose_layout(args: &ModelArgs) -> Result<()> {
    use simpler_models::qwen3::layout::Bf16LayoutChoice;
    // Asked for tiles on a path that does not stream them, the models would hold the matrices
    // row-major: neither what was asked nor the path's default.
    let isa = simpler_kernels_cpu::Isa::detected();
    if args.bf16_layout == Some(Bf16LayoutArg::Tiled)
        && !simpler_kernels_cpu::tiled_weights_pay(isa)
    {
        bail!(
            "--bf16-layout tiled: only the AMX path streams tiled weights, and this CPU's kernel path is {}; give pairs or row-major, or leave the flag out",
            isa.name()
        );
    }
    simpler_models::qwen3::layout::choose_bf16_layout(match args.bf16_layout {
        None => Bf16LayoutChoice::Streaming,
        Some(Bf16LayoutArg::RowMajor) => Bf16LayoutChoice::RowMajor,
        Some(Bf16LayoutArg::Tiled) => Bf16LayoutChoice::Tiled,
        Some(Bf16LayoutArg::Pairs) => Bf16LayoutChoice::Pairs,
    })
    .context("--bf16-layout")?;
    Ok(())
}

/// Generates (preset) or loads (checkpoint) the weights of `config` (from
/// [`ModelArgs::config`], so `--layers` is already applied). `shared` gives every layer one
/// weight set (presets only).
pub(crate) fn load_weights(
    args: &ModelArgs,
    config: &Qwen3Config,
    shared: bool,
) -> Result<Qwen3Weights> {
    choose_layout(args)?;
    if let Some(dir) = &args.model {
        if shared {
            bail!("--shared-weights applies to presets (a checkpoint brings its own layers)");
        }
        let pb = progress(0, "loading", false);
        let tick = |d: u64, t: u64| {
            pb.set_length(t);
            pb.set_position(d);
        };
        let opts = LoadOptions {
            layout: if args.in_out_layout {
                WeightLayout::InOut
            } else {
                WeightLayout::OutIn
            },
            progress: Some(&tick),
            layers: Some(config.num_hidden_layers),
        };
        let w = load_checkpoint(dir, &opts)
            .with_context(|| format!("loading checkpoint {}", dir.display()))?;
        pb.finish_and_clear();
        return Ok(w);
    }
    let pb = progress(0, "generating", false);
    let tick = |d: u64, t: u64| {
        pb.set_length(t);
        pb.set_position(d);
    };
    let w = generate_weights(config, args.seed(), shared, Some(&tick));
    pb.finish_and_clear();
    Ok(w)
}

/// The model of `args` in worker buffers, its projections and LM head in `format` (RoPE
/// tables for `max_seq` positions), its layers brought one weight set at a time and each
/// uploaded (quantised, for int8) before the next: a preset's generated per set, a
/// checkpoint's read per layer from its mapped files (`read_checkpoint`, every header checked
/// first). The host never holds more than one layer besides the embedding and LM head — what
/// lets the 40-layer 14B run as int8 on a machine that cannot hold its bf16 weights. `shared`
/// gives every layer one weight set (presets only).
pub(crate) fn load_model(
    args: &ModelArgs,
    worker: &Worker,
    config: &Qwen3Config,
    shared: bool,
    max_seq: usize,
    format: WeightFormat,
) -> Result<Arc<ResidentModel>> {
    choose_layout(args)?;
    let label = match (&args.model, format) {
        (Some(_), WeightFormat::Bf16) => "loading and uploading layers",
        (Some(_), WeightFormat::Int8(_)) => "loading and quantising layers to int8",
        (None, WeightFormat::Bf16) => "generating and uploading layers",
        (None, WeightFormat::Int8(_)) => "generating and quantising layers to int8",
    };
    let pb = progress(0, label, true);
    let tick = |d: u64, t: u64| {
        pb.set_length(t);
        pb.set_position(d);
    };
    let model = match &args.model {
        Some(dir) => {
            if shared {
                bail!("--shared-weights applies to presets (a checkpoint brings its own layers)");
            }
            let opts = LoadOptions {
                layout: if args.in_out_layout {
                    WeightLayout::InOut
                } else {
                    WeightLayout::OutIn
                },
                progress: None,
                layers: Some(config.num_hidden_layers),
            };
            ResidentModel::upload_checkpoint(worker, dir, &opts, max_seq, format, Some(&tick))
                .with_context(|| format!("loading checkpoint {}", dir.display()))?
        }
        None => ResidentModel::upload_generated(
            worker,
            config,
            args.seed(),
            shared,
            max_seq,
            format,
            Some(&tick),
        )?,
    };
    pb.finish_and_clear();
    Ok(Arc::new(model))
}

/// Copies the weights into worker buffers (RoPE tables for `max_seq` positions), then drops
/// the host copies of the embedding and LM head (checks read the rows they need back), so a
/// large model is held once.
pub(crate) fn upload(
    worker: &Worker,
    weights: &mut Qwen3Weights,
    max_seq: usize,
    format: WeightFormat,
) -> Result<Arc<ResidentModel>> {
    let model = upload_keeping(worker, weights, max_seq, format)?;
    weights.embedding = Vec::new();
    weights.lm_head = None;
    Ok(model)
}

/// Copies the weights into worker buffers in `format` (int8 quantises here, with the
/// progress bar), keeping the host copies.
pub(crate) fn upload_keeping(
    worker: &Worker,
    weights: &Qwen3Weights,
    max_seq: usize,
    format: WeightFormat,
) -> Result<Arc<ResidentModel>> {
    let label = match format {
        WeightFormat::Bf16 => "uploading",
        WeightFormat::Int8(_) => "quantising to int8",
    };
    let pb = progress(0, label, true);
    let tick = |d: u64, t: u64| {
        pb.set_length(t);
        pb.set_position(d);
    };
    let model = ResidentModel::upload_as(worker, weights, max_seq, format, Some(&tick))?;
    pb.finish_and_clear();
    Ok(Arc::new(model))
}

/// A decode case: block tables, inputs and the recipe of its KV pools.
pub(crate) struct DecodeCase {
    /// The fixture options the pools and inputs follow.
    pub(crate) opts: FixtureOptions,
    /// Block tables and lengths.
    pub(crate) batch: PagedBatch,
    /// Input hidden state `[batch, hidden]` (layers variant).
    pub(crate) hidden: Vec<bf16>,
    /// Input token ids (model variant).
    pub(crate) tokens: Vec<u32>,
}

impl DecodeCase {
    /// `batch` sequences of `seq_len` tokens, block tables covering `max_seq`, KV pools drawn
    /// with the spec's distributions (layer 0's pool replicated to every layer when
    /// `replicate`, as the reference fixture does).
    pub(crate) fn new(
        config: &Qwen3Config,
        batch: usize,
        seq_len: usize,
        max_seq: usize,
        seed: u64,
        replicate: bool,
    ) -> DecodeCase {
        let opts = FixtureOptions {
            seed,
            batch,
            max_seq,
            seq_len,
            shared_weights: replicate,
            fill_kv: true,
            replicate_kv: replicate,
            rope_theta: None,
        };
        let (batch, hidden, tokens) = generate_inputs(config, &opts);
        DecodeCase {
            opts,
            batch,
            hidden,
            tokens,
        }
    }

    /// A zeroed KV cache for the case.
    pub(crate) fn kv_buffers(&self, worker: &Worker, config: &Qwen3Config) -> Result<KvBuffers> {
        Ok(KvBuffers::new(
            worker,
            config,
            self.batch.num_pages(),
            self.batch.page_size,
        )?)
    }

    /// Fills every layer's pools (one pool on the host at a time).
    pub(crate) fn fill_kv(&self, config: &Qwen3Config, kv: &KvBuffers) -> Result<()> {
        let pb = progress(kv.layers as u64, "KV pools", false);
        let mut cached: Option<(Vec<bf16>, Vec<bf16>)> = None;
        for l in 0..kv.layers {
            if cached.is_none() || !self.opts.replicate_kv {
                cached = Some(generate_kv_pools(config, &self.opts, l, None));
            }
            if let Some((k, v)) = &cached {
                kv.write_layer(l, k, v)?;
            }
            pb.inc(1);
        }
        pb.finish_and_clear();
        Ok(())
    }

    /// The streamed golden of this case's first step (fp32 input `x`) through `layers` layers
    /// (`layer(l)` gives layer `l`'s weights, their projections multiplying `acts`), with the
    /// head read back from `model` when `with_head`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn golden<W: ProjectionElem>(
        &self,
        c: &Qwen3Config,
        layers: usize,
        layer: &mut dyn FnMut(usize) -> Result<std::sync::Arc<LayerWeights<W>>, String>,
        acts: Acts,
        model: &ResidentModel,
        x: &[f32],
        with_head: bool,
    ) -> Result<GoldenStep> {
        let rope = c.rope_tables(model.max_seq);
        let mut cached: Option<(Vec<bf16>, Vec<bf16>)> = None;
        let opts = self.opts.clone();
        let mut pools = |l: usize| -> (Vec<bf16>, Vec<bf16>) {
            if opts.replicate_kv {
                cached
                    .get_or_insert_with(|| generate_kv_pools(c, &opts, 0, None))
                    .clone()
            } else {
                generate_kv_pools(c, &opts, l, None)
            }
        };
        let src = GoldenSource {
            config: c,
            layers,
            layer,
            pools: &mut pools,
            num_pages: self.batch.num_pages(),
            page_size: self.batch.page_size,
            acts,
        };
        let final_norm = model.final_norm()?;
        let mut failure = None;
        let mut lm_rows = |r: std::ops::Range<usize>| match model.download_lm_head_rows_f32(r) {
            Ok(v) => v,
            Err(e) => {
                failure = Some(e);
                Vec::new()
            }
        };
        let head = with_head.then(|| HeadSource {
            final_norm: &final_norm,
            lm_rows: &mut lm_rows,
        });
        let step = golden_decode_streamed(src, head, &self.batch, &rope, x);
        if let Some(e) = failure {
            return Err(e.into());
        }
        step.map_err(|e| anyhow!("the golden could not read its weights: {e}"))
    }
}
