//! What the server counts, in the Prometheus text format or OpenMetrics (`GET /metrics`): requests by how they
//! ended, refusals by reason, tokens in and out, requests running and waiting, KV blocks in
//! use, the prefix cache's hits, and TTFT / TPOT histograms.
//!
//! The engine thread is the only writer of the load gauges and of everything counted when a
//! request ends; refusals made before a request reaches it (shutdown) are counted by the
//! handle. Each request is counted once in `simpler_requests_total`, by how it ended.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// How a request ended (the `finish` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// End of sequence or a stop string.
    Stop,
    /// Its token limit.
    Length,
    /// Its client went away.
    Cancelled,
    /// A failure.
    Error,
}

impl Ended {
    fn label(self) -> &'static str {
        match self {
            Ended::Stop => "stop",
            Ended::Length => "length",
            Ended::Cancelled => "cancelled",
            Ended::Error => "error",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FinishLabel {
    finish: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

/// The server's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<FinishLabel, Counter>,
    rejected: Family<ReasonLabel, Counter>,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    prefix_hit_tokens: Counter,
    preemptions: Counter,
    connections_cut: Counter,
    running: Gauge,
    waiting: Gauge,
    kv_used: Gauge,
    ttft: Histogram,
    tpot: Histogram,
    /// For the hit-rate gauge: prompt tokens and cached tokens since start.
    hit_rate: Gauge<f64, AtomicU64>,
}

/// TTFT buckets (seconds): 10 ms to ~82 s.
fn ttft_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.01, 2.0, 14)
}

/// TPOT buckets (seconds): 1 ms to ~8 s.
fn tpot_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 14)
}

impl Metrics {
    /// Metrics of a server whose KV pool has `kv_total` blocks.
    pub fn new(kv_total: usize) -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<FinishLabel, Counter>::default();
        let rejected = Family::<ReasonLabel, Counter>::default();
        let prompt_tokens = Counter::default();
        let generation_tokens = Counter::default();
        let prefix_hit_tokens = Counter::default();
        let preemptions = Counter::default();
        let connections_cut = Counter::default();
        let running = Gauge::default();
        let waiting = Gauge::default();
        let kv_used = Gauge::default();
        let kv_total_g: Gauge = Gauge::default();
        kv_total_g.set(i64::try_from(kv_total).unwrap_or(i64::MAX));
        let ttft = Histogram::new(ttft_buckets());
        let tpot = Histogram::new(tpot_buckets());
        let hit_rate = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "simpler_requests",
            "Requests that ended, by how (stop, length, cancelled, error)",
            requests.clone(),
        );
        registry.register(
            "simpler_requests_rejected",
            "Requests refused before running, by reason",
            rejected.clone(),
        );
        registry.register(
            "simpler_prompt_tokens",
            "Prompt tokens of accepted requests",
            prompt_tokens.clone(),
        );
        registry.register(
            "simpler_generation_tokens",
            "Tokens generated",
            generation_tokens.clone(),
        );
        registry.register(
            "simpler_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache at admission",
            prefix_hit_tokens.clone(),
        );
        registry.register(
            "simpler_prefix_cache_hit_rate",
            "Prefix-cache hit tokens over prompt tokens since start",
            hit_rate.clone(),
        );
        registry.register(
            "simpler_preemptions",
            "Requests preempted for lack of KV blocks (recomputed later)",
            preemptions.clone(),
        );
        registry.register(
            "simpler_connections_cut",
            "Connections the server closed because the client took none of a response's bytes for the write timeout, or was still being written to that long after a shutdown's drain",
            connections_cut.clone(),
        );
        registry.register(
            "simpler_requests_running",
            "Requests admitted to the engine",
            running.clone(),
        );
        registry.register(
            "simpler_requests_waiting",
            "Requests waiting for admission",
            waiting.clone(),
        );
        registry.register(
            "simpler_kv_blocks_used",
            "KV cache blocks held by requests",
            kv_used.clone(),
        );
        registry.register(
            "simpler_kv_blocks_total",
            "KV cache blocks in the pool",
            kv_total_g,
        );
        registry.register(
            "simpler_time_to_first_token_seconds",
            "From a request's arrival at the HTTP server (before tokenizing) to its first token",
            ttft.clone(),
        );
        registry.register(
            "simpler_time_per_output_token_seconds",
            "Each finished request's mean time between tokens after its first (one observation per request)",
            tpot.clone(),
        );
        Metrics {
            registry,
            requests,
            rejected,
            prompt_tokens,
            generation_tokens,
            prefix_hit_tokens,
            preemptions,
            connections_cut,
            running,
            waiting,
            kv_used,
            ttft,
            tpot,
            hit_rate,
        }
    }

    /// The OpenMetrics text exposition (`application/openmetrics-text; version=1.0.0`).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// The Prometheus text exposition (`text/plain; version=0.0.4`): what a scraper that does
    /// not ask for OpenMetrics reads (rewritten from the OpenMetrics one).
    pub fn render_prometheus_text(&self) -> String {
        openmetrics_to_prometheus_text(&self.render())
    }

    /// A request refused before it ran, by `reason`.
    pub fn rejected(&self, reason: &str) {
        self.rejected
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    pub(crate) fn accepted(&self, prompt_tokens: usize) {
        self.prompt_tokens.inc_by(prompt_tokens as u64);
    }

    /// The engine's running totals: prompt tokens admitted and, of those, found in the prefix
    /// cache.
    pub(crate) fn prefix_totals(&self, hit_tokens: u64, admitted_prompt_tokens: u64) {
        let seen = self.prefix_hit_tokens.get();
        self.prefix_hit_tokens
            .inc_by(hit_tokens.saturating_sub(seen));
        if admitted_prompt_tokens > 0 {
            self.hit_rate
                .set(hit_tokens as f64 / admitted_prompt_tokens as f64);
        }
    }

    pub(crate) fn first_token(&self, ttft: Duration) {
        self.ttft.observe(ttft.as_secs_f64());
    }

    /// The engine's running total of preemptions.
    pub(crate) fn preemptions_total(&self, total: u64) {
        let seen = self.preemptions.get();
        self.preemptions.inc_by(total.saturating_sub(seen));
    }

    /// A connection closed for a client that does not take its response (`ConnLimits`'
    /// write timeout).
    pub fn connection_cut(&self) {
        self.connections_cut.inc();
    }

    /// One token generated.
    pub(crate) fn token(&self) {
        self.generation_tokens.inc();
    }

    pub(crate) fn ended(&self, how: Ended, tpot: Option<Duration>) {
        self.requests
            .get_or_create(&FinishLabel {
                finish: how.label().to_string(),
            })
            .inc();
        if let Some(t) = tpot {
            self.tpot.observe(t.as_secs_f64());
        }
    }

    pub(crate) fn set_load(&self, running: usize, waiting: usize, kv_used: usize) {
        self.running.set(running as i64);
        self.waiting.set(waiting as i64);
        self.kv_used.set(kv_used as i64);
    }
}

/// OpenMetrics text as the Prometheus 0.0.4 text format: the two differ, for what this server
/// exposes, in a counter family's name (OpenMetrics names the family `x` and its sample
/// `x_total`; 0.0.4 names both `x_total`, so its `# HELP`/`# TYPE` lines must say `x_total` to
/// describe the sample) and in the `# UNIT` and `# EOF` lines, which 0.0.4 does not have.
/// Samples, labels, values, gauges and histograms read the same in both. Not a general
/// converter: exemplars, timestamps (seconds there, milliseconds here), `info`/`unknown`
/// types and `_created` samples would need more, and a test holds the exposition to what
/// this handles.
pub(crate) fn openmetrics_to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|t| t.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(name) {
                    out.push_str("_total");
                }
                if !tail.is_empty() {
                    out.push(' ');
                    out.push_str(tail);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_names_every_metric_and_counts_what_happened() {
        let m = Metrics::new(64);
        m.accepted(10);
        m.prefix_totals(4, 10);
        m.first_token(Duration::from_millis(30));
        for _ in 0..7 {
            m.token();
        }
        m.preemptions_total(3);
        m.preemptions_total(3);
        m.ended(Ended::Stop, Some(Duration::from_millis(20)));
        m.ended(Ended::Cancelled, None);
        m.rejected("too_long");
        m.set_load(1, 2, 7);
        let t = m.render();
        for line in [
            "simpler_requests_total{finish=\"stop\"} 1",
            "simpler_requests_total{finish=\"cancelled\"} 1",
            "simpler_requests_rejected_total{reason=\"too_long\"} 1",
            "simpler_prompt_tokens_total 10",
            "simpler_generation_tokens_total 7",
            "simpler_preemptions_total 3",
            "simpler_prefix_cache_hit_tokens_total 4",
            "simpler_prefix_cache_hit_rate 0.4",
            "simpler_requests_running 1",
            "simpler_requests_waiting 2",
            "simpler_kv_blocks_used 7",
            "simpler_kv_blocks_total 64",
            "simpler_time_to_first_token_seconds_count 1",
            "simpler_time_per_output_token_seconds_count 1",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line:?} in\n{t}");
        }
        assert!(t.ends_with("# EOF\n"));
    }

    /// The Prometheus text format names a counter's family as its sample, and has no `# EOF`;
    /// every sample line is the OpenMetrics one.
    #[test]
    fn the_prometheus_text_names_counters_by_their_samples() {
        let m = Metrics::new(8);
        m.accepted(3);
        m.ended(Ended::Length, Some(Duration::from_millis(5)));
        let om = m.render();
        let text = m.render_prometheus_text();
        for line in [
            "# TYPE simpler_requests_total counter",
            "# TYPE simpler_prompt_tokens_total counter",
            "# TYPE simpler_kv_blocks_total gauge",
            "# TYPE simpler_time_to_first_token_seconds histogram",
            "simpler_requests_total{finish=\"length\"} 1",
            "simpler_prompt_tokens_total 3",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(
            text.lines()
                .any(|l| l.starts_with("# HELP simpler_requests_total Requests"))
        );
        assert!(!text.contains("# EOF") && !text.contains("# TYPE simpler_requests counter"));
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(samples(&om), samples(&text));
        // What the rewrite handles is all the exposition has: these types, no exemplars,
        // timestamps or `_created` samples.
        for l in om.lines() {
            if let Some(t) = l.strip_prefix("# TYPE ") {
                let kind = t.rsplit(' ').next().unwrap();
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{l}");
            } else if !l.starts_with('#') {
                assert!(!l.contains(" # ") && !l.contains("_created"), "{l}");
                assert_eq!(l.split(' ').count(), 2, "a timestamp or exemplar: {l}");
            }
        }
        assert_eq!(
            openmetrics_to_prometheus_text(
                "# TYPE a counter\n# UNIT a seconds\na_total 1\n# EOF\n"
            ),
            "# TYPE a_total counter\na_total 1\n"
        );
    }
}
