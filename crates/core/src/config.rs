//! Per-run configuration ([`CallConfig`], [`RuntimeEnv`]) with validation that names the field,
//! and the three timeouts with their environment overrides and ordering rule.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::ConfigError;

/// Number of ring sets (a task uses ring `min(scope_depth, 3)`).
pub const RING_COUNT: usize = 4;

/// A ring size: one value for all rings, or one per ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingValue {
    /// The same value for every ring.
    All(u64),
    /// One value per ring (0..=3).
    PerRing([u64; RING_COUNT]),
}

impl RingValue {
    /// The value for ring `r`.
    pub fn get(&self, r: usize) -> u64 {
        match self {
            RingValue::All(v) => *v,
            RingValue::PerRing(v) => v[r],
        }
    }

    /// Parses `N` or `a,b,c,d`, with optional `K`/`M`/`G` (binary) suffixes.
    pub fn parse(s: &str) -> Result<RingValue, String> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let vals = parts
            .iter()
            .map(|p| parse_size(p))
            .collect::<Result<Vec<u64>, String>>()?;
        match vals.len() {
            1 => Ok(RingValue::All(vals[0])),
            RING_COUNT => Ok(RingValue::PerRing([vals[0], vals[1], vals[2], vals[3]])),
            n => Err(format!(
                "expected one value or {RING_COUNT} comma-separated values, got {n}"
            )),
        }
    }
}

/// Parses a size like `4096`, `64K`, `256M`, `2G` (binary multiples).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.char_indices().last() {
        Some((i, 'k' | 'K')) => (&s[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&s[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size (examples: 4096, 64K, 256M, 2G)"))?;
    n.checked_mul(mul)
        .ok_or_else(|| format!("{s:?} overflows 64 bits"))
}

impl std::fmt::Display for RingValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingValue::All(v) => write!(f, "{v}"),
            RingValue::PerRing(v) => write!(f, "{},{},{},{}", v[0], v[1], v[2], v[3]),
        }
    }
}

/// Ring sizes of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeEnv {
    /// Task window slots per ring (power of two, >= 4).
    pub ring_task_window: RingValue,
    /// Heap bytes per ring for runtime-allocated outputs (>= 1024, a multiple of 1024).
    pub ring_heap: RingValue,
    /// Dependency pool entries per ring (>= 4).
    pub ring_dep_pool: RingValue,
}

impl Default for RuntimeEnv {
    fn default() -> RuntimeEnv {
        RuntimeEnv {
            ring_task_window: RingValue::All(16384),
            ring_heap: RingValue::All(256 << 20),
            ring_dep_pool: RingValue::All(16384),
        }
    }
}

/// Validated ring sizes, one entry per ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RingSizes {
    pub(crate) window: [u32; RING_COUNT],
    pub(crate) heap: [u64; RING_COUNT],
    pub(crate) dep_pool: [u32; RING_COUNT],
}

impl RingSizes {
    /// Bytes of the rings' task slots and dependency-pool entries: arrays built (and touched)
    /// when a worker first runs with these sizes, unlike the heaps, whose pages are committed
    /// as tensors use them.
    pub(crate) fn array_bytes(&self) -> u64 {
        let slot = std::mem::size_of::<crate::slot::Slot>() as u64;
        let entry = std::mem::size_of::<crate::slot::DepEntry>() as u64;
        (0..RING_COUNT)
            .map(|r| self.window[r] as u64 * slot + self.dep_pool[r] as u64 * entry)
            .sum()
    }
}

fn field_name(base: &str, v: &RingValue, r: usize) -> String {
    match v {
        RingValue::All(_) => format!("CallConfig.runtime_env.{base}"),
        RingValue::PerRing(_) => format!("CallConfig.runtime_env.{base}[{r}]"),
    }
}

impl RuntimeEnv {
    pub(crate) fn validate(&self) -> Result<RingSizes, ConfigError> {
        let mut out = RingSizes {
            window: [0; RING_COUNT],
            heap: [0; RING_COUNT],
            dep_pool: [0; RING_COUNT],
        };
        for r in 0..RING_COUNT {
            let w = self.ring_task_window.get(r);
            if w < 4 || !w.is_power_of_two() || w > 1 << 30 {
                return Err(ConfigError {
                    field: field_name("ring_task_window", &self.ring_task_window, r),
                    value: w.to_string(),
                    reason: "must be a power of two between 4 and 2^30 (default 16384)".into(),
                });
            }
            let h = self.ring_heap.get(r);
            if h < 1024 || !h.is_multiple_of(1024) {
                return Err(ConfigError {
                    field: field_name("ring_heap", &self.ring_heap, r),
                    value: h.to_string(),
                    reason: "must be at least 1024 bytes and a multiple of 1024 (default 256 MiB)"
                        .into(),
                });
            }
            let p = self.ring_dep_pool.get(r);
            if !(4..=1 << 30).contains(&p) {
                return Err(ConfigError {
                    field: field_name("ring_dep_pool", &self.ring_dep_pool, r),
                    value: p.to_string(),
                    reason: "must be between 4 and 2^30 entries (default 16384)".into(),
                });
            }
            out.window[r] = w as u32;
            out.heap[r] = h;
            out.dep_pool[r] = p as u32;
        }
        Ok(out)
    }
}

/// How orchestration and execution relate in time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OrchMode {
    /// Tasks start while the orchestrator is still submitting (default).
    #[default]
    Overlapped,
    /// All submits first, then execution (for measurement); rings must hold the whole graph.
    Serial,
}

/// Configuration that travels with every run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallConfig {
    /// Ring sizes.
    pub runtime_env: RuntimeEnv,
    /// Dependency-map capacity (entries, all buffers together).
    pub tensormap_capacity: u64,
    /// Overlapped (default) or serial orchestration.
    pub mode: OrchMode,
    /// Swimlane level 0 (off) to 4.
    pub swimlane: u8,
    /// Capture the dependency graph.
    pub dep_gen: bool,
    /// Record ring high-water marks.
    pub ring_stats: bool,
    /// Where diagnostics are written (required when one is on). The core never writes files;
    /// the tools that receive the `RunReport` do.
    pub output_dir: Option<PathBuf>,
    /// Where the run's spans are written as JSON Lines. The core never writes files:
    /// `simpler_dfx::write_run_outputs` writes this (the CLI calls it after every run).
    pub trace: Option<PathBuf>,
    /// Capacity of the swimlane record buffer in task records, split evenly over the cores (each
    /// core's share rounded up, so a run may keep up to `cores - 1` more); overflow is counted,
    /// not lost silently.
    pub swimlane_capacity: usize,
    /// Label written into the trace (`decode`, `prefill`, ...).
    pub label: Option<String>,
    /// The caller runs this as a warm-up, outside its measurements: the trace marks the run
    /// (`warmup: true` on its `run` span) and the trace tools leave it out of their statistics.
    /// Changes nothing in the run itself.
    pub warmup: bool,
    /// How many of the worker's cores (its scheduler threads) run this run's tasks: the first
    /// `n`, 1 to [`Worker::cores`](crate::Worker::cores); `None`: all of them. The others stay
    /// idle for the run. The orchestration sees the count (`Orchestrator::cores`), so it can
    /// tile for it; a task whose blocks must start together needs at most this many, and a
    /// captured graph replays only on the count it was captured with.
    pub cores: Option<usize>,
}

impl Default for CallConfig {
    fn default() -> CallConfig {
        CallConfig {
            runtime_env: RuntimeEnv::default(),
            tensormap_capacity: 1 << 16,
            mode: OrchMode::Overlapped,
            swimlane: 0,
            dep_gen: false,
            ring_stats: false,
            output_dir: None,
            trace: None,
            swimlane_capacity: 1 << 20,
            label: None,
            warmup: false,
            cores: None,
        }
    }
}

/// A validated configuration.
#[derive(Clone, Debug)]
pub(crate) struct ValidConfig {
    pub(crate) rings: RingSizes,
}

impl CallConfig {
    /// Checks the configuration without running anything, so a tool can refuse bad settings
    /// before it spends minutes loading a model (every run checks again).
    pub fn check(&self) -> Result<(), ConfigError> {
        self.validate().map(|_| ())
    }

    /// The run's cores on a worker of `worker_cores`: [`CallConfig::cores`], all of them by
    /// default; more than the worker has is refused naming the field and the count.
    pub(crate) fn run_cores(&self, worker_cores: usize) -> Result<usize, ConfigError> {
        match self.cores {
            None => Ok(worker_cores),
            Some(n) if n <= worker_cores => Ok(n),
            Some(n) => Err(ConfigError {
                field: "CallConfig.cores".into(),
                value: n.to_string(),
                reason: format!(
                    "this worker has {worker_cores} cores; a run takes 1 to {worker_cores} of them"
                ),
            }),
        }
    }

    pub(crate) fn validate(&self) -> Result<ValidConfig, ConfigError> {
        let rings = self.runtime_env.validate()?;
        if self.swimlane > 4 {
            return Err(ConfigError {
                field: "CallConfig.swimlane".into(),
                value: self.swimlane.to_string(),
                reason: "must be 0 (off) to 4".into(),
            });
        }
        let diag = self.swimlane > 0 || self.dep_gen || self.ring_stats;
        if diag && self.output_dir.is_none() {
            return Err(ConfigError {
                field: "CallConfig.output_dir".into(),
                value: "none".into(),
                reason: "a diagnostic (swimlane, dep_gen or ring_stats) is on; set an output directory for it".into(),
            });
        }
        if !(16..=1 << 28).contains(&self.tensormap_capacity) {
            return Err(ConfigError {
                field: "CallConfig.tensormap_capacity".into(),
                value: self.tensormap_capacity.to_string(),
                reason: "must be between 16 and 2^28 entries (default 65536)".into(),
            });
        }
        if self.cores == Some(0) {
            return Err(ConfigError {
                field: "CallConfig.cores".into(),
                value: "0".into(),
                reason: "a run needs at least one core (None: all of the worker's)".into(),
            });
        }
        if self.swimlane > 0 && self.swimlane_capacity == 0 {
            return Err(ConfigError {
                field: "CallConfig.swimlane_capacity".into(),
                value: "0".into(),
                reason: "must hold at least one record when swimlane is on".into(),
            });
        }
        Ok(ValidConfig { rings })
    }
}

/// Environment variables of old-style ring configuration; read only to warn that they are
/// ignored. The `PTO2_RING_*` ones are those of the runtime this one replaces, which scripts
/// written for it still export; the `SIMPLER_RING_*` ones are the obvious guess at ours.
pub const LEGACY_RING_ENV: [(&str, &str); 6] = [
    (
        "PTO2_RING_TASK_WINDOW",
        "CallConfig.runtime_env.ring_task_window",
    ),
    ("PTO2_RING_HEAP", "CallConfig.runtime_env.ring_heap"),
    ("PTO2_RING_DEP_POOL", "CallConfig.runtime_env.ring_dep_pool"),
    (
        "SIMPLER_RING_TASK_WINDOW",
        "CallConfig.runtime_env.ring_task_window",
    ),
    ("SIMPLER_RING_HEAP", "CallConfig.runtime_env.ring_heap"),
    (
        "SIMPLER_RING_DEP_POOL",
        "CallConfig.runtime_env.ring_dep_pool",
    ),
];

/// Warnings for legacy ring variables set in `env`.
pub(crate) fn legacy_env_warnings(env: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    LEGACY_RING_ENV
        .iter()
        .filter(|(var, _)| env(var).is_some())
        .map(|(var, field)| {
            format!(
                "environment variable {var} is ignored: ring sizes are per run; set {field} instead"
            )
        })
        .collect()
}

/// How long a core with nothing to do inside a run spins (yielding now and then) before it
/// parks, unless `WorkerConfig.idle_spin` or [`ENV_IDLE_SPIN_US`] says otherwise.
///
/// A parked core costs a wake-up when work arrives: a futex wake, and on a virtual machine
/// whose idle virtual CPU the host has descheduled, whatever the host takes to run it again.
/// On the 2-core development VM that was up to 3 ms at a time, so a 50 µs spin turned every
/// phase end longer than 50 µs inside a DeepSeek-V4 layer step into a stall of one core
/// (`docs/runtime.md`, "Idle cores"). Cores spin only inside a run; between runs they park.
pub const DEFAULT_IDLE_SPIN: Duration = Duration::from_millis(2);

/// Largest idle spin a worker accepts (a core spinning longer than this is a busy loop).
pub const MAX_IDLE_SPIN: Duration = Duration::from_secs(1);

/// Environment variable overriding the idle spin (microseconds; 0 parks after the first few
/// checks for work).
pub const ENV_IDLE_SPIN_US: &str = "SIMPLER_IDLE_SPIN_US";

/// The idle spin from the environment read through `env`: [`DEFAULT_IDLE_SPIN`] when unset, and
/// with a warning when the value is not a whole number of microseconds up to [`MAX_IDLE_SPIN`].
pub fn idle_spin_from_env_with(env: &dyn Fn(&str) -> Option<String>) -> (Duration, Option<String>) {
    let Some(raw) = env(ENV_IDLE_SPIN_US) else {
        return (DEFAULT_IDLE_SPIN, None);
    };
    match raw.trim().parse::<u64>() {
        Ok(us) if Duration::from_micros(us) <= MAX_IDLE_SPIN => (Duration::from_micros(us), None),
        _ => (
            DEFAULT_IDLE_SPIN,
            Some(format!(
                "{ENV_IDLE_SPIN_US}={raw:?} is not a whole number of microseconds from 0 to {}; using the default idle spin ({} µs)",
                MAX_IDLE_SPIN.as_micros(),
                DEFAULT_IDLE_SPIN.as_micros()
            )),
        ),
    }
}

/// The three timeouts of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Scheduler no-progress watchdog.
    pub scheduler: Duration,
    /// One task's execution.
    pub op_execute: Duration,
    /// Host wait for a whole run.
    pub stream_sync: Duration,
}

/// Environment variable overriding the scheduler watchdog (milliseconds).
pub const ENV_SCHEDULER_TIMEOUT_MS: &str = "SIMPLER_SCHEDULER_TIMEOUT_MS";
/// Environment variable overriding one task's execution limit (microseconds).
pub const ENV_OP_EXECUTE_TIMEOUT_US: &str = "SIMPLER_OP_EXECUTE_TIMEOUT_US";
/// Environment variable overriding the host wait for a run (milliseconds).
pub const ENV_STREAM_SYNC_TIMEOUT_MS: &str = "SIMPLER_STREAM_SYNC_TIMEOUT_MS";

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            scheduler: Duration::from_secs(10),
            op_execute: Duration::from_secs(45),
            stream_sync: Duration::from_secs(50),
        }
    }
}

impl Timeouts {
    /// Applies the environment overrides read through `env`, returning the timeouts and the
    /// warnings. An unparsable value is ignored (its default stays) with a warning; if the
    /// result breaks `scheduler < op_execute < stream_sync` or
    /// `stream_sync > scheduler + 1.5 s`, every override is dropped with one warning naming the
    /// broken rule.
    pub fn from_env_with(env: &dyn Fn(&str) -> Option<String>) -> (Timeouts, Vec<String>) {
        Timeouts::default().overridden_with(env)
    }

    /// [`Timeouts::from_env_with`] over `self` instead of the defaults: a command that knows
    /// its runs are long raises a timeout first, and the environment still overrides it (an
    /// override that is unparsable or breaks the ordering rule falls back to `self`).
    pub fn overridden_with(self, env: &dyn Fn(&str) -> Option<String>) -> (Timeouts, Vec<String>) {
        let defaults = self;
        let mut t = defaults;
        let mut warnings = Vec::new();
        let mut read = |var: &str, unit: &str, to: fn(u64) -> Duration| -> Option<Duration> {
            let raw = env(var)?;
            match raw.trim().parse::<u64>() {
                Ok(v) if v > 0 => Some(to(v)),
                _ => {
                    warnings.push(format!(
                        "{var}={raw:?} is not a positive integer ({unit}); using the default for this timeout"
                    ));
                    None
                }
            }
        };
        if let Some(d) = read(
            ENV_SCHEDULER_TIMEOUT_MS,
            "milliseconds",
            Duration::from_millis,
        ) {
            t.scheduler = d;
        }
        if let Some(d) = read(
            ENV_OP_EXECUTE_TIMEOUT_US,
            "microseconds",
            Duration::from_micros,
        ) {
            t.op_execute = d;
        }
        if let Some(d) = read(
            ENV_STREAM_SYNC_TIMEOUT_MS,
            "milliseconds",
            Duration::from_millis,
        ) {
            t.stream_sync = d;
        }
        if let Some(rule) = t.broken_rule() {
            warnings.push(format!(
                "timeout overrides ignored, all three keep their values ({:?} / {:?} / {:?}): {rule} (got scheduler {:?}, op_execute {:?}, stream_sync {:?})",
                defaults.scheduler,
                defaults.op_execute,
                defaults.stream_sync,
                t.scheduler,
                t.op_execute,
                t.stream_sync
            ));
            t = defaults;
        }
        (t, warnings)
    }

    /// Reads the overrides from the process environment.
    pub fn from_env() -> (Timeouts, Vec<String>) {
        Timeouts::from_env_with(&|k| std::env::var(k).ok())
    }

    /// The ordering rule these timeouts break, if any.
    pub fn broken_rule(&self) -> Option<&'static str> {
        if self.scheduler >= self.op_execute {
            Some("scheduler timeout must be below op_execute timeout")
        } else if self.op_execute >= self.stream_sync {
            Some("op_execute timeout must be below stream_sync timeout")
        } else if self.stream_sync <= self.scheduler + Duration::from_millis(1500) {
            Some("stream_sync timeout must exceed scheduler timeout + 1.5 s")
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn defaults_without_overrides() {
        let (t, w) = Timeouts::from_env_with(&env_of(&[]));
        assert_eq!(t, Timeouts::default());
        assert!(w.is_empty());
    }

    #[test]
    fn each_override_applies() {
        let (t, w) = Timeouts::from_env_with(&env_of(&[(ENV_SCHEDULER_TIMEOUT_MS, "2000")]));
        assert_eq!(t.scheduler, Duration::from_secs(2));
        assert!(w.is_empty());
        let (t, _) = Timeouts::from_env_with(&env_of(&[(ENV_OP_EXECUTE_TIMEOUT_US, "20000000")]));
        assert_eq!(t.op_execute, Duration::from_secs(20));
        let (t, _) = Timeouts::from_env_with(&env_of(&[(ENV_STREAM_SYNC_TIMEOUT_MS, "60000")]));
        assert_eq!(t.stream_sync, Duration::from_secs(60));
    }

    #[test]
    fn each_ordering_violation_drops_all_overrides_with_one_warning() {
        let cases: [&[(&str, &str)]; 3] = [
            &[
                (ENV_SCHEDULER_TIMEOUT_MS, "46000"),
                (ENV_STREAM_SYNC_TIMEOUT_MS, "90000"),
            ],
            &[
                (ENV_OP_EXECUTE_TIMEOUT_US, "51000000"),
                (ENV_SCHEDULER_TIMEOUT_MS, "1000"),
            ],
            &[
                (ENV_SCHEDULER_TIMEOUT_MS, "1000"),
                (ENV_OP_EXECUTE_TIMEOUT_US, "1500000"),
                (ENV_STREAM_SYNC_TIMEOUT_MS, "2000"),
            ],
        ];
        let rules = ["below op_execute", "below stream_sync", "+ 1.5 s"];
        for (case, rule) in cases.iter().zip(rules) {
            let (t, w) = Timeouts::from_env_with(&env_of(case));
            assert_eq!(t, Timeouts::default(), "{case:?}");
            assert_eq!(w.len(), 1, "{w:?}");
            assert!(w[0].contains(rule), "{w:?} should name {rule}");
        }
    }

    #[test]
    fn overrides_apply_over_a_raised_base_and_fall_back_to_it() {
        let raised = Timeouts {
            stream_sync: Duration::from_secs(600),
            ..Timeouts::default()
        };
        // No override: the raised value.
        assert_eq!(raised.overridden_with(&env_of(&[])).0, raised);
        // A longer op_execute alone is checked against the raised stream-sync (against 50 s
        // it broke the ordering rule and every override was dropped).
        let (t, w) = raised.overridden_with(&env_of(&[(ENV_OP_EXECUTE_TIMEOUT_US, "120000000")]));
        assert_eq!(t.op_execute, Duration::from_secs(120), "{w:?}");
        assert_eq!(t.stream_sync, raised.stream_sync);
        // An applied stream-sync override wins; an unparsable one keeps the raised value.
        let (t, _) = raised.overridden_with(&env_of(&[(ENV_STREAM_SYNC_TIMEOUT_MS, "70000")]));
        assert_eq!(t.stream_sync, Duration::from_secs(70));
        let (t, w) = raised.overridden_with(&env_of(&[(ENV_STREAM_SYNC_TIMEOUT_MS, "soon")]));
        assert_eq!((t, w.len()), (raised, 1));
    }

    #[test]
    fn idle_spin_reads_microseconds_and_warns_on_the_rest() {
        assert_eq!(
            idle_spin_from_env_with(&env_of(&[])),
            (DEFAULT_IDLE_SPIN, None)
        );
        for (raw, us) in [("0", 0), (" 500 ", 500), ("1000000", 1_000_000)] {
            let (d, w) = idle_spin_from_env_with(&env_of(&[(ENV_IDLE_SPIN_US, raw)]));
            assert_eq!((d, w), (Duration::from_micros(us), None), "{raw:?}");
        }
        for raw in ["ten", "-1", "1000001", "2.5"] {
            let (d, w) = idle_spin_from_env_with(&env_of(&[(ENV_IDLE_SPIN_US, raw)]));
            assert_eq!(d, DEFAULT_IDLE_SPIN, "{raw:?}");
            let w = w.expect("a warning");
            assert!(w.contains(ENV_IDLE_SPIN_US) && w.contains(raw), "{w}");
        }
    }

    #[test]
    fn unparsable_value_falls_back_alone() {
        let (t, w) = Timeouts::from_env_with(&env_of(&[
            (ENV_SCHEDULER_TIMEOUT_MS, "ten"),
            (ENV_STREAM_SYNC_TIMEOUT_MS, "55000"),
        ]));
        assert_eq!(t.scheduler, Duration::from_secs(10));
        assert_eq!(t.stream_sync, Duration::from_secs(55));
        assert_eq!(w.len(), 1);
        assert!(w[0].contains(ENV_SCHEDULER_TIMEOUT_MS));
    }

    #[test]
    fn ring_values_are_validated_with_field_names() {
        let mut env = RuntimeEnv::default();
        assert!(env.validate().is_ok());
        env.ring_task_window = RingValue::All(100);
        let e = env.validate().unwrap_err();
        assert_eq!(e.field, "CallConfig.runtime_env.ring_task_window");
        env.ring_task_window = RingValue::PerRing([8, 8, 2, 8]);
        assert_eq!(
            env.validate().unwrap_err().field,
            "CallConfig.runtime_env.ring_task_window[2]"
        );
        env = RuntimeEnv {
            ring_heap: RingValue::All(1000),
            ..RuntimeEnv::default()
        };
        assert_eq!(
            env.validate().unwrap_err().field,
            "CallConfig.runtime_env.ring_heap"
        );
        env = RuntimeEnv {
            ring_dep_pool: RingValue::All(3),
            ..RuntimeEnv::default()
        };
        assert_eq!(
            env.validate().unwrap_err().field,
            "CallConfig.runtime_env.ring_dep_pool"
        );
        let cfg = CallConfig {
            swimlane: 2,
            ..CallConfig::default()
        };
        assert_eq!(cfg.validate().unwrap_err().field, "CallConfig.output_dir");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert!(parse_size("lots").is_err());
        assert_eq!(
            RingValue::parse("8,16,32,64").unwrap(),
            RingValue::PerRing([8, 16, 32, 64])
        );
        assert!(RingValue::parse("8,16").is_err());
        assert!(
            legacy_env_warnings(&env_of(&[("SIMPLER_RING_HEAP", "1")]))[0].contains("ring_heap")
        );
        // The replaced runtime's variables, as its scripts export them: one warning each,
        // naming the variable and the field.
        let w = legacy_env_warnings(&env_of(&[
            ("PTO2_RING_TASK_WINDOW", "131072"),
            ("PTO2_RING_DEP_POOL", "131072"),
        ]));
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("PTO2_RING_TASK_WINDOW") && w[0].contains("ring_task_window"));
        assert!(w[1].contains("PTO2_RING_DEP_POOL") && w[1].contains("ring_dep_pool"));
        assert!(legacy_env_warnings(&env_of(&[("PTO2_RING_HEAPS", "1")])).is_empty());
    }
}
