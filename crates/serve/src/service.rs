//! The engine on its own thread, serving requests that arrive while others run.
//!
//! The HTTP handlers (or any caller) submit a request through a [`ServiceHandle`] and get a
//! channel of [`Event`]s: text deltas, then one `Done` or `Error`. The engine thread owns the
//! [`Engine`]; between steps it takes new requests, drops those whose receiver is gone (a client
//! that disconnected: its blocks go back before the next step), runs one step over everything
//! admitted, and turns each request's tokens into text with its own [`TextStream`] (stop
//! strings end a request at the token that completes one).
//!
//! Ownership of a request: from `submit` until the engine thread sends `Done` or `Error`, the
//! thread owns it; it never forgets one. Every path that ends a request (finished, stopped,
//! cancelled, failed step, shutdown) goes through `end`, which releases its blocks (through the
//! engine) and counts it in the metrics exactly once.
//!
//! Shutdown: after [`ServiceHandle::shutdown`] new requests are refused; the ones in flight run
//! to their end, and those still running when the drain time is over get an error.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use tokio::sync::{mpsc, oneshot, watch};

use crate::engine::{Engine, EngineError, FinishReason, RequestId};
use crate::metrics::{Ended, Metrics};
use crate::stream::TextStream;
use crate::text::{GenerateConfig, TextFinish};
use crate::tokenizer::Tokenizer;

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (through the one that ended the request).
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// What a request's receiver gets.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// More text (never empty).
    Delta(String),
    /// The request ended normally.
    Done {
        /// Why.
        finish: TextFinish,
        /// Token counts.
        usage: Usage,
    },
    /// The request failed; no more events follow.
    Error(String),
    /// The server shut down before the request finished; no more events follow.
    Unavailable(String),
}

/// Why a request was not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Malformed or out of range.
    #[error("{0}")]
    Invalid(String),
    /// The prompt does not fit.
    #[error("{0}")]
    TooLong(String),
    /// Too many requests are waiting.
    #[error("{0}")]
    Overloaded(String),
    /// The service is shutting down (or its thread is gone).
    #[error("{0}")]
    ShuttingDown(String),
}

/// How the service runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceConfig {
    /// Most requests waiting for admission before new ones are refused as overloaded.
    pub max_waiting: usize,
    /// How long in-flight requests may run after shutdown before they get an error.
    pub drain: Duration,
}

impl Default for ServiceConfig {
    fn default() -> ServiceConfig {
        ServiceConfig {
            max_waiting: 256,
            drain: Duration::from_secs(30),
        }
    }
}

enum Command {
    Submit {
        prompt: Vec<u32>,
        cfg: GenerateConfig,
        arrived: Instant,
        events: mpsc::UnboundedSender<Event>,
        accepted: oneshot::Sender<Result<(), Refusal>>,
    },
    Shutdown,
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone, Debug)]
pub struct ServiceHandle {
    tx: Sender<Command>,
    metrics: Arc<Metrics>,
    closing: Arc<AtomicBool>,
    /// False once the engine thread has left its loop (stopped or panicked).
    alive: Arc<AtomicBool>,
    /// Closed (its sender dropped) once the engine thread has left its loop.
    ended: watch::Receiver<()>,
}

/// Clears `alive` when the engine thread leaves, however it leaves (a panic included), and
/// then (dropping its sender) wakes [`ServiceHandle::stopped`].
struct AliveGuard {
    alive: Arc<AtomicBool>,
    /// Never sent on: dropped with the guard, after `alive` is cleared.
    _ended: watch::Sender<()>,
}

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Release);
    }
}

/// The running service: its handle and its thread.
#[derive(Debug)]
pub struct Service {
    handle: ServiceHandle,
    thread: Option<JoinHandle<Engine>>,
}

impl Service {
    /// Starts the engine thread over `engine` (idle: no request in flight) and `tokenizer`.
    pub fn start(
        engine: Engine,
        tokenizer: Arc<Tokenizer>,
        cfg: ServiceConfig,
    ) -> Result<Service, Refusal> {
        if engine.has_work() {
            return Err(Refusal::Invalid(
                "the engine already has requests in flight".into(),
            ));
        }
        let (tx, rx) = channel::unbounded();
        let metrics = Arc::new(Metrics::new(engine.total_blocks()));
        let closing = Arc::new(AtomicBool::new(false));
        let alive = Arc::new(AtomicBool::new(true));
        let (ended_tx, ended) = watch::channel(());
        let guard = AliveGuard {
            alive: alive.clone(),
            _ended: ended_tx,
        };
        let mut state = Loop {
            engine,
            tokenizer,
            cfg,
            metrics: metrics.clone(),
            live: HashMap::new(),
            draining_since: None,
        };
        let thread = std::thread::Builder::new()
            .name("simpler-engine".into())
            .spawn(move || {
                let _guard = guard;
                state.run(&rx);
                state.engine
            })
            .map_err(|e| Refusal::ShuttingDown(format!("cannot start the engine thread: {e}")))?;
        Ok(Service {
            handle: ServiceHandle {
                tx,
                metrics,
                closing,
                alive,
                ended,
            },
            thread: Some(thread),
        })
    }

    /// A handle for submitting requests.
    pub fn handle(&self) -> ServiceHandle {
        self.handle.clone()
    }

    /// Refuses new requests, lets those in flight finish (up to the drain time), stops the
    /// thread and gives the engine back (every block free).
    pub fn stop(mut self) -> Option<Engine> {
        self.handle.shutdown();
        self.thread.take().and_then(|t| t.join().ok())
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.handle.shutdown();
            let _ = t.join();
        }
    }
}

impl ServiceHandle {
    /// Submits `prompt` ids; resolves once the engine thread accepted or refused it. The
    /// request is cancelled when the returned receiver is dropped.
    pub async fn submit(
        &self,
        prompt: Vec<u32>,
        cfg: GenerateConfig,
    ) -> Result<mpsc::UnboundedReceiver<Event>, Refusal> {
        self.submit_since(prompt, cfg, Instant::now()).await
    }

    /// [`ServiceHandle::submit`] for a request that arrived at `arrived` (its time to first
    /// token counts from there).
    pub async fn submit_since(
        &self,
        prompt: Vec<u32>,
        cfg: GenerateConfig,
        arrived: Instant,
    ) -> Result<mpsc::UnboundedReceiver<Event>, Refusal> {
        // Counted on every way out that refuses for shutdown: closing already, the engine
        // thread gone, or the thread left its loop with the command still queued (its
        // verdict dropped unanswered).
        let gone = || {
            self.metrics.rejected("shutting_down");
            Refusal::ShuttingDown("the server is shutting down".into())
        };
        if self.closing.load(Ordering::Acquire) {
            return Err(gone());
        }
        let (events, rx) = mpsc::unbounded_channel();
        let (accepted, verdict) = oneshot::channel();
        self.tx
            .send(Command::Submit {
                prompt,
                cfg,
                arrived,
                events,
                accepted,
            })
            .map_err(|_| gone())?;
        verdict.await.map_err(|_| gone())??;
        Ok(rx)
    }

    /// The service's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Whether the engine thread is still running (false after it stopped or panicked).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Resolves once the engine thread has left its loop: after a shutdown, when every request
    /// has ended (each has had its last event); or when the thread stopped otherwise.
    pub async fn stopped(&self) {
        let mut ended = self.ended.clone();
        // Nothing is ever sent: `changed` fails when the sender is dropped, with the thread.
        while ended.changed().await.is_ok() {}
    }

    /// Whether shutdown has begun.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Begins shutdown: new requests are refused, those in flight finish (up to the drain
    /// time).
    pub fn shutdown(&self) {
        if !self.closing.swap(true, Ordering::AcqRel) {
            let _ = self.tx.send(Command::Shutdown);
        }
    }
}

/// A request the engine thread owns.
struct Live {
    events: mpsc::UnboundedSender<Event>,
    text: TextStream,
    prompt_tokens: usize,
    generated: usize,
    arrived: Instant,
    first_token: Option<Instant>,
}

struct Loop {
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    cfg: ServiceConfig,
    metrics: Arc<Metrics>,
    live: HashMap<RequestId, Live>,
    draining_since: Option<Instant>,
}

/// How often an idle or draining loop looks at the clock.
const TICK: Duration = Duration::from_millis(50);

impl Loop {
    fn run(&mut self, rx: &Receiver<Command>) {
        loop {
            // Take commands: wait for one when idle, otherwise take what is there.
            if !self.engine.has_work() {
                if self.draining_since.is_some() {
                    break;
                }
                match rx.recv_timeout(TICK) {
                    Ok(c) => self.command(c),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => self.command(c),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.draining_since.get_or_insert_with(Instant::now);
                        break;
                    }
                }
            }
            self.drop_cancelled();
            if let Some(t) = self.draining_since
                && t.elapsed() > self.cfg.drain
            {
                self.end_all("the server shut down before the request finished");
            }
            if self.engine.has_work() {
                self.step();
            }
            self.sync_metrics();
        }
        // Whatever is left (a closed channel with requests queued) ends with an error.
        self.end_all("the server shut down");
        self.metrics.set_load(0, 0, 0);
    }

    /// Ends every request in flight with an `Unavailable` event saying `why`.
    fn end_all(&mut self, why: &str) {
        let ids: Vec<RequestId> = self.live.keys().copied().collect();
        for id in ids {
            self.engine.abort(id);
            self.end(id, Ended::Error, Some(Event::Unavailable(why.into())));
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Shutdown => {
                self.draining_since.get_or_insert_with(Instant::now);
            }
            Command::Submit {
                prompt,
                cfg,
                arrived,
                events,
                accepted,
            } => {
                let verdict = self.admit(prompt, cfg, arrived, events);
                if let Err(r) = &verdict {
                    self.metrics.rejected(match r {
                        Refusal::Invalid(_) => "invalid",
                        Refusal::TooLong(_) => "too_long",
                        Refusal::Overloaded(_) => "overloaded",
                        Refusal::ShuttingDown(_) => "shutting_down",
                    });
                }
                let id_if_accepted = verdict.as_ref().ok().copied();
                if accepted.send(verdict.map(|_| ())).is_err()
                    && let Some(id) = id_if_accepted
                {
                    // The submitter gave up before hearing back.
                    self.engine.abort(id);
                    self.end(id, Ended::Cancelled, None);
                }
            }
        }
    }

    fn admit(
        &mut self,
        prompt: Vec<u32>,
        cfg: GenerateConfig,
        arrived: Instant,
        events: mpsc::UnboundedSender<Event>,
    ) -> Result<RequestId, Refusal> {
        if self.draining_since.is_some() {
            return Err(Refusal::ShuttingDown("the server is shutting down".into()));
        }
        cfg.validate()
            .map_err(|e| Refusal::Invalid(e.to_string()))?;
        let e = self.engine.config();
        let fits = e
            .max_seq_len
            .min(e.num_blocks * simpler_models::qwen3::weights::PAGE_SIZE);
        if prompt.len() >= fits {
            return Err(Refusal::TooLong(format!(
                "the prompt has {} tokens; this server holds at most {fits} tokens per sequence, prompt and completion together",
                prompt.len()
            )));
        }
        if self.engine.waiting() >= self.cfg.max_waiting {
            return Err(Refusal::Overloaded(format!(
                "{} requests are already waiting (the most this server queues)",
                self.engine.waiting()
            )));
        }
        let prompt_tokens = prompt.len();
        let id = self
            .engine
            .add_request(&cfg.request(prompt))
            .map_err(|e| Refusal::Invalid(e.to_string()))?;
        self.metrics.accepted(prompt_tokens);
        self.live.insert(
            id,
            Live {
                events,
                text: TextStream::new(cfg.stop),
                prompt_tokens,
                generated: 0,
                arrived,
                first_token: None,
            },
        );
        Ok(id)
    }

    /// Ends requests whose receiver is gone (the client disconnected).
    fn drop_cancelled(&mut self) {
        let gone: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.engine.abort(id);
            self.end(id, Ended::Cancelled, None);
        }
    }

    fn step(&mut self) {
        let outputs = match self.engine.step() {
            Ok(o) => o,
            Err(EngineError::Step { failed, source }) => {
                for id in failed {
                    self.end(
                        id,
                        Ended::Error,
                        Some(Event::Error(format!("the step failed: {source}"))),
                    );
                }
                return;
            }
            Err(e) => {
                // Not one step's requests: nothing the engine holds can go on.
                for id in self.engine.abort_all() {
                    self.end(id, Ended::Error, Some(Event::Error(e.to_string())));
                }
                return;
            }
        };
        let now = Instant::now();
        for o in outputs {
            let Some(l) = self.live.get_mut(&o.id) else {
                continue;
            };
            l.generated += 1;
            self.metrics.token();
            if l.first_token.is_none() {
                l.first_token = Some(now);
                self.metrics.first_token(now - l.arrived);
            }
            let delta = match l.text.push(&self.tokenizer, o.token) {
                Ok(d) => d,
                Err(e) => {
                    if o.finished.is_none() {
                        self.engine.abort(o.id);
                    }
                    self.end(
                        o.id,
                        Ended::Error,
                        Some(Event::Error(format!("detokenizing: {e}"))),
                    );
                    continue;
                }
            };
            if !delta.text.is_empty() {
                // A send fails only when the receiver is gone; the next pass ends it.
                let _ = l.events.send(Event::Delta(delta.text));
            }
            if delta.stopped {
                let done = match o.finished {
                    Some(c) => Some(c),
                    None => self.engine.stop(o.id),
                };
                self.finish(o.id, TextFinish::Stop, done.map_or(0, |c| c.cached_tokens));
            } else if let Some(c) = o.finished {
                // The held-back tail (a partial stop string, an unfinished character) is part
                // of the answer: a failure to decode it ends the request with an error, as a
                // failure mid-stream does, rather than dropping it.
                let tail = match l.text.finish(&self.tokenizer) {
                    Ok(t) => t,
                    Err(e) => {
                        self.end(
                            o.id,
                            Ended::Error,
                            Some(Event::Error(format!("detokenizing: {e}"))),
                        );
                        continue;
                    }
                };
                if !tail.text.is_empty() {
                    let _ = l.events.send(Event::Delta(tail.text));
                }
                let finish = match c.finish_reason {
                    // The tail completed a stop string.
                    _ if tail.stopped => TextFinish::Stop,
                    FinishReason::Eos => TextFinish::Eos,
                    FinishReason::Length => TextFinish::Length,
                    FinishReason::Stop => TextFinish::Stop,
                };
                self.finish(o.id, finish, c.cached_tokens);
            }
        }
    }

    fn finish(&mut self, id: RequestId, finish: TextFinish, cached_tokens: usize) {
        let Some(l) = self.live.get(&id) else {
            return;
        };
        let usage = Usage {
            prompt_tokens: l.prompt_tokens,
            completion_tokens: l.generated,
            cached_tokens,
        };
        self.end(
            id,
            match finish {
                TextFinish::Length => Ended::Length,
                TextFinish::Eos | TextFinish::Stop => Ended::Stop,
            },
            Some(Event::Done { finish, usage }),
        );
    }

    /// Brings the gauges and the engine's running totals into the metrics.
    fn sync_metrics(&self) {
        let stats = self.engine.stats();
        self.metrics
            .prefix_totals(stats.prefix_hit_tokens, stats.prompt_tokens);
        self.metrics.preemptions_total(stats.preemptions);
        self.metrics.set_load(
            self.engine.running(),
            self.engine.waiting(),
            self.engine.total_blocks() - self.engine.free_blocks(),
        );
    }

    /// Forgets request `id` (its blocks already released by the engine), counts it, and then
    /// sends `last` (`Done` or an error) if given. Counting first means a client that reads
    /// `/metrics` after its answer sees its request counted.
    fn end(&mut self, id: RequestId, how: Ended, last: Option<Event>) {
        let Some(l) = self.live.remove(&id) else {
            return;
        };
        let tpot = match (l.first_token, l.generated) {
            (Some(first), n) if n > 1 => Some((Instant::now() - first) / (n as u32 - 1)),
            _ => None,
        };
        self.metrics.ended(how, tpot);
        self.sync_metrics();
        if let Some(e) = last {
            let _ = l.events.send(e);
        }
    }
}
