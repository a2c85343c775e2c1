//! The OpenAI-compatible HTTP server (axum): `GET /health`, `GET /v1/models`,
//! `GET /v1/models/{id}`, `POST /v1/completions`, `POST /v1/chat/completions` (JSON, or
//! server-sent events ending in `data: [DONE]`), `GET /metrics`.
//!
//! Handlers tokenize and hand the ids to the engine thread through a [`ServiceHandle`]; a
//! request's events come back on its own channel. A client that goes away drops that channel
//! (the response future or the event stream is dropped), and the engine thread ends the request
//! and frees its blocks before its next step. Errors are OpenAI error objects:
//! 400 (bad field, malformed JSON), 404 (unknown model or route), 408 (a body late past the
//! read timeout), 413 (prompt or body too long), 415 (a body that is not JSON by its
//! headers), 503 (overloaded or shutting down), 500 (a failed step).
//!
//! Shutdown keeps the listener open while the engine drains, so that a client (or a load
//! balancer polling `/health`) gets a 503 saying why rather than a refused connection; the
//! listener closes when the engine thread has ended every request.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::Listener;
use futures_util::stream::{self, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::openai::{FieldError, Input, Job, chat_job, completion_job};
use crate::service::{Event, Refusal, ServiceHandle, Usage};
use crate::text::TextFinish;
use crate::tokenizer::Tokenizer;
use crate::write_deadline::{WriteDeadline, WriteStalled};

/// Most bytes a request body may have.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// What one client may hold of the server: its connections, the time it may take to send a
/// request and to take a response. Without them a client that opens connections and sends
/// nothing (or a request's first bytes only), or asks for a stream and stops reading it, holds
/// a file descriptor each for ever, and a few thousand such take the server out of service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// How long a connection may take to send a request's headers, counted from when the
    /// server waits for them (a new connection, or one idle after its last response), and
    /// a request's body, counted from its headers. Past it an idle or partial connection is
    /// closed, and a request whose body is late gets 408.
    pub read_timeout: std::time::Duration,
    /// How long a response's bytes may wait on a client that takes none of them (its socket
    /// full: it stopped reading but keeps the connection); past it the connection is closed
    /// and its request cancelled. Counted only while bytes wait, from the first that cannot be
    /// sent, and restarted whenever the client takes some: a client that keeps reading and a
    /// stream's gaps between tokens are never cut. A graceful shutdown also gives responses
    /// still being written this long once the engine has drained, then closes them.
    pub write_timeout: std::time::Duration,
    /// Connections served at once; more wait in the listener's backlog until one closes.
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> ConnLimits {
        ConnLimits {
            read_timeout: std::time::Duration::from_secs(30),
            write_timeout: std::time::Duration::from_secs(30),
            max_connections: 512,
        }
    }
}

impl ConnLimits {
    /// A zero timeout or connection count would serve nothing: refused, naming the field.
    pub fn check(&self) -> Result<(), String> {
        if self.read_timeout.is_zero() {
            return Err("ConnLimits.read_timeout is 0: no request could arrive in time".into());
        }
        if self.write_timeout.is_zero() {
            return Err(
                "ConnLimits.write_timeout is 0: a response that fills the socket would fail".into(),
            );
        }
        if self.max_connections == 0 {
            return Err("ConnLimits.max_connections is 0: no connection would be served".into());
        }
        if self.max_connections > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(format!(
                "ConnLimits.max_connections is {}: at most {} (the connection semaphore's limit)",
                self.max_connections,
                tokio::sync::Semaphore::MAX_PERMITS
            ));
        }
        Ok(())
    }
}

/// What the server serves.
#[derive(Debug)]
pub struct AppState {
    /// The engine thread.
    pub handle: ServiceHandle,
    /// The model's tokenizer (with its chat template).
    pub tokenizer: Arc<Tokenizer>,
    /// The model's name in requests and `/v1/models` (not empty: [`check_model_name`]).
    pub model: String,
    /// Longest sequence (prompt and completion) the engine holds: `max_seq_len`, or less
    /// where the KV blocks hold less (`simpler serve` takes the smaller). Reported as
    /// `max_model_len` in `/v1/models`; the engine refuses a prompt that leaves no room within
    /// it and caps a completion limit to what fits.
    pub max_model_len: usize,
    /// When the server started (Unix seconds).
    pub created: u64,
    /// The connections a client may hold, and how long a request may take to arrive.
    pub limits: ConnLimits,
}

/// Checks a served model name: an empty one is refused. Every request must name the model,
/// and OpenAI's clients refuse an empty `model` before sending, so a server serving `""` could
/// be reached by none of them (`serve --served-model-name ''` is a quoting slip, not a choice).
pub fn check_model_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(
            "the served model name is empty: give a name clients will send as `model`".into(),
        );
    }
    Ok(())
}

/// An OpenAI error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    code: Option<&'static str>,
    param: Option<String>,
    /// The `simpler_requests_rejected_total` reason this refusal counts under, if the HTTP
    /// layer made it.
    refusal: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind: if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            },
            code: None,
            param: None,
            refusal: None,
        }
    }

    fn counted(mut self, reason: &'static str) -> ApiError {
        self.refusal = Some(reason);
        self
    }

    fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    fn body(&self) -> Value {
        // A message starts with the field it names (clients often show only the message).
        let message = match &self.param {
            Some(p) if !crate::openai::names_first(&self.message, p) => {
                format!("{p}: {}", self.message)
            }
            _ => self.message.clone(),
        };
        json!({"error": {
            "message": message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> ApiError {
        let mut a = ApiError::new(StatusCode::BAD_REQUEST, e.message);
        a.param = e.param;
        a
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> ApiError {
        match r {
            Refusal::Invalid(m) => ApiError::new(StatusCode::BAD_REQUEST, m),
            // 400 as OpenAI answers it (its clients raise `BadRequestError`); the handlers
            // name the prompt or the messages as `param`.
            Refusal::TooLong(m) => {
                ApiError::new(StatusCode::BAD_REQUEST, m).code("context_length_exceeded")
            }
            Refusal::Overloaded(m) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m).code("overloaded")
            }
            Refusal::ShuttingDown(m) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m).code("shutting_down")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // Overload and shutdown pass: tell clients when to try again.
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        r
    }
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        // A wildcard: served names often hold a `/` (`Qwen/Qwen3-0.6B`).
        .route("/v1/models/{*id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Serves `state` on `listener` until `shutdown` resolves and the engine has drained.
///
/// When `shutdown` resolves the engine refuses new requests and lets in-flight ones finish
/// (up to its drain time). Meanwhile the listener stays open: new requests, on new or open
/// connections, get 503 `shutting_down` and `/health` answers 503, so clients and load
/// balancers learn why instead of meeting a refused connection. Once the engine thread has
/// ended every request, the listener closes (new connections are refused), idle connections
/// are closed, and responses still being written (a stream's last chunks) finish — within
/// the write timeout, after which the rest are closed; then this returns.
///
/// Connections follow `state.limits` ([`ConnLimits`]): at most `max_connections` are served
/// at once (the next is accepted when one closes), one that does not send a request's
/// headers within `read_timeout` — new, idle after a response, or partway through — is closed,
/// and so is one whose client takes none of a response's waiting bytes for `write_timeout`
/// (its request is cancelled: the response's receiver is dropped).
///
/// An empty served name is refused ([`check_model_name`]), and so are limits that would serve
/// nothing ([`ConnLimits::check`]), before anything is served.
///
/// This returns only once the engine thread has ended: after its drain time at the latest,
/// unless a step in flight does not return — the runtime's watchdogs (the stream-sync
/// timeout on a whole run) bound that, and a caller that needs a hard limit (the CLI) adds
/// its own.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_on(Tcp(listener), state, shutdown).await
}

/// [`serve`] on the connections of any axum [`Listener`] — a Unix socket, or a test's in-memory
/// pipes, whose small buffers fill at once — with the same limits, shutdown and answers.
pub async fn serve_on<L: Listener>(
    mut listener: L,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let invalid = |m| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    check_model_name(&state.model).map_err(invalid)?;
    state.limits.check().map_err(invalid)?;
    let limits = state.limits;
    let handle = state.handle.clone();
    let metrics = handle.metrics().clone();
    let app = router(state);
    // axum's own `serve` sets no header read timeout (hyper applies one only with a timer)
    // and no connection limit: this loop is that function with both.
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.read_timeout);
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    // Set when the shutdown gives up on responses still being written: their tasks drop them.
    let (close_all, closing) = tokio::sync::watch::channel(false);
    let drained = async move {
        shutdown.await;
        handle.shutdown();
        // The engine thread ends once nothing is in flight (or the drain time is over).
        handle.stopped().await;
    };
    tokio::pin!(drained);
    loop {
        // A permit first: past the limit, connections wait in the backlog, not in memory.
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                // The semaphore is never closed.
                Err(_) => break,
            },
            () = &mut drained => break,
        };
        let stream = tokio::select! {
            (stream, _) = listener.accept() => stream,
            () = &mut drained => break,
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let stream = WriteDeadline::new(stream, limits.write_timeout);
        let conn = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        let (metrics, mut closing) = (metrics.clone(), closing.clone());
        tokio::spawn(async move {
            tokio::select! {
                // A connection's error (a client gone, a header timeout) is its own end; a
                // client that stopped taking its response is counted.
                r = conn => {
                    if let Err(e) = r
                        && WriteStalled::caused(&e)
                    {
                        metrics.connection_cut();
                    }
                }
                // The shutdown's last wait is over: dropping the connection closes it.
                _ = closing.wait_for(|c| *c) => metrics.connection_cut(),
            }
            drop(permit);
        });
    }
    // New connections are refused from here; idle ones close and responses being written
    // finish, within the write timeout: a client that keeps taking a few bytes within each
    // write timeout could otherwise hold the shutdown as long as its stream lasts.
    drop(listener);
    if tokio::time::timeout(limits.write_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        let _ = close_all.send(true);
    }
    Ok(())
}

/// Most bytes of a response a TCP connection keeps queued unsent in the kernel
/// (`TCP_NOTSENT_LOWAT`; bytes sent and not yet acknowledged are not counted, so it does not
/// bound the throughput). The socket then reports room each time the client has taken half of
/// it, which is what the write timeout sees as progress: without it Linux reported room only
/// once a third of a send buffer autotuned to megabytes had drained, and a client reading a
/// long stream steadily but slower than it was made (8 KB/s, or 640 KB/s against 2 KB chunks)
/// was cut as stalled. It also keeps a slow client's backlog in the server's memory, where a
/// cancelled request drops it, rather than in the kernel's.
const NOTSENT_LOWAT: usize = 32 << 10;

/// Sets [`NOTSENT_LOWAT`] on `stream` (best effort: a kernel without the option keeps its
/// default, the whole send buffer).
fn limit_unsent(stream: &tokio::net::TcpStream) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let v = NOTSENT_LOWAT as libc::c_int;
        // SAFETY: `stream`'s descriptor is an open TCP socket for this call's duration; the
        // option takes a `c_int`, passed by pointer with its size, and is only read.
        let _ = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NOTSENT_LOWAT,
                (&raw const v).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = stream;
}

/// The TCP listener of [`serve`]: each connection with `TCP_NODELAY` and [`NOTSENT_LOWAT`], and an accept that
/// fails (out of file descriptors) retried after a pause, said on stderr once a second at
/// most (axum's own retry logs through `tracing`, which this server does not install).
struct Tcp(TcpListener);

impl Listener for Tcp {
    type Io = tokio::net::TcpStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (tokio::net::TcpStream, std::net::SocketAddr) {
        let mut last_error: Option<Instant> = None;
        loop {
            match self.0.accept().await {
                Ok((stream, addr)) => {
                    // Server-sent events are many small writes: do not wait to coalesce them.
                    let _ = stream.set_nodelay(true);
                    limit_unsent(&stream);
                    return (stream, addr);
                }
                // A connection reset before it was accepted: the listener itself is fine.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                    ) => {}
                // Out of file descriptors: wait a little rather than spin.
                Err(e) => {
                    if last_error.is_none_or(|t| t.elapsed().as_secs() >= 1) {
                        eprintln!("serve: accepting a connection failed: {e}");
                        last_error = Some(Instant::now());
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.0.local_addr()
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    if !s.handle.is_alive() {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")
            .code("engine_stopped")
            .into_response();
    }
    if s.handle.is_closing() {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down")
            .code("shutting_down")
            .into_response();
    }
    (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response()
}

/// The model object of `/v1/models` and `/v1/models/{id}`.
fn model_object(s: &AppState) -> Value {
    json!({
        "id": s.model,
        "object": "model",
        "created": s.created,
        "owned_by": "simpler",
        "max_model_len": s.max_model_len,
    })
}

/// The error for a model this server does not serve (404 `model_not_found`, as OpenAI's).
fn unknown_model(s: &AppState, asked: &str) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "the model `{asked}` does not exist; this server serves `{}`",
            s.model
        ),
    )
    .code("model_not_found");
    e.param = Some("model".into());
    e
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [model_object(&s)],
    }))
    .into_response()
}

async fn model(
    State(s): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    match id {
        Ok(Path(id)) if id == s.model => axum::Json(model_object(&s)).into_response(),
        Ok(Path(id)) => unknown_model(&s, &id).into_response(),
        // A path that does not decode (percent-encoded bytes that are not UTF-8).
        Err(e) => {
            let mut a = ApiError::new(StatusCode::BAD_REQUEST, format!("model: {e}"));
            a.param = Some("model".into());
            a.into_response()
        }
    }
}

/// `GET /metrics`: OpenMetrics to a scraper that asks for it (Prometheus does, in `Accept`),
/// the Prometheus text format 0.0.4 to everything else (as vLLM's `prometheus_client` serves
/// it by default).
async fn metrics(State(s): State<Arc<AppState>>, headers: header::HeaderMap) -> Response {
    let openmetrics = prefers_openmetrics(
        headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok()),
    );
    let m = s.handle.metrics();
    let (kind, body) = if openmetrics {
        (
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            m.render(),
        )
    } else {
        (
            "text/plain; version=0.0.4; charset=utf-8",
            m.render_prometheus_text(),
        )
    };
    ([(header::CONTENT_TYPE, kind)], body).into_response()
}

/// Whether `Accept` values ask for OpenMetrics over the Prometheus text format: an
/// `application/openmetrics-text` range with a weight above 0 and at least that of any range
/// `text/plain` matches (`text/plain`, `text/*`, `*/*`). Weights are `q=` parameters (the name
/// in any case, the value a decimal; absent: 1), per RFC 9110.
fn prefers_openmetrics<'a>(accept: impl Iterator<Item = &'a str>) -> bool {
    let (mut om, mut plain) = (0.0f32, 0.0f32);
    for range in accept.flat_map(|v| v.split(',')) {
        let mut parts = range.split(';').map(str::trim);
        let kind = parts.next().unwrap_or("").to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .map_or(Some(1.0), |(_, v)| v.trim().parse::<f32>().ok())
            .unwrap_or(0.0);
        match kind.as_str() {
            "application/openmetrics-text" => om = om.max(q),
            "text/plain" | "text/*" | "*/*" => plain = plain.max(q),
            _ => {}
        }
    }
    om > 0.0 && om >= plain
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "this route does not take that method",
    )
    .code("method_not_allowed")
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such route").code("not_found")
}

/// The whole body: 413 past [`MAX_BODY_BYTES`]; 408 when it has not arrived within
/// `limits.read_timeout`; a body that cannot be read (a malformed chunk, a connection closed
/// before its `Content-Length`) is the client's error, 400.
async fn read_body(body: Body, limits: &ConnLimits) -> Result<Bytes, ApiError> {
    let late = limits.read_timeout;
    tokio::time::timeout(late, axum::body::to_bytes(body, MAX_BODY_BYTES))
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s",
                    late.as_secs_f64()
                ),
            )
            .code("request_timeout")
        })?
        .map_err(|e| {
            let over = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if over {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("the request body is over {MAX_BODY_BYTES} bytes"),
                )
            } else {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("the request body could not be read: {e}"),
                )
            }
        })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(
    State(s): State<Arc<AppState>>,
    headers: header::HeaderMap,
    body: Body,
) -> Response {
    handle(s, &headers, body, Kind::Completion).await
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    headers: header::HeaderMap,
    body: Body,
) -> Response {
    handle(s, &headers, body, Kind::Chat).await
}

/// A body the server would misread: a `Content-Type` other than JSON (`application/json` or
/// `application/<x>+json`, in UTF-8) or a `Content-Encoding` other than `identity` (a
/// compressed body parsed as JSON fails as "not valid JSON", which misleads). A request without
/// a `Content-Type` is read as JSON, as OpenAI's clients always send it.
fn check_body_headers(headers: &header::HeaderMap) -> Result<(), ApiError> {
    let unsupported = |m: String| {
        ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, m).code("unsupported_media_type")
    };
    for v in headers.get_all(header::CONTENT_ENCODING) {
        let v = String::from_utf8_lossy(v.as_bytes());
        if v.split(',')
            .any(|c| !c.trim().eq_ignore_ascii_case("identity"))
        {
            return Err(unsupported(format!(
                "Content-Encoding `{v}` is not supported: send the body uncompressed"
            )));
        }
    }
    if let Some(v) = headers.get(header::CONTENT_TYPE) {
        let v = String::from_utf8_lossy(v.as_bytes());
        let mut parts = v.split(';').map(str::trim);
        let media = parts.next().unwrap_or("").to_ascii_lowercase();
        let json = media == "application/json"
            || media
                .strip_prefix("application/")
                .is_some_and(|t| t.ends_with("+json"));
        let utf8 = parts
            .filter_map(|p| p.split_once('='))
            .filter(|(k, _)| k.trim().eq_ignore_ascii_case("charset"))
            .all(|(_, c)| c.trim().trim_matches('"').eq_ignore_ascii_case("utf-8"));
        if !json || !utf8 {
            return Err(unsupported(format!(
                "Content-Type `{v}`: the body must be JSON in UTF-8 (application/json)"
            )));
        }
    }
    Ok(())
}

/// Both generating endpoints: read and parse the body as `kind`, then run it.
async fn handle(s: Arc<AppState>, headers: &header::HeaderMap, body: Body, kind: Kind) -> Response {
    // While draining, every new request is refused alike, before its body is read, parsed
    // or tokenized.
    if s.handle.is_closing() {
        s.handle.metrics().rejected("shutting_down");
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down")
            .code("shutting_down")
            .into_response();
    }
    let arrived = Instant::now();
    let parse = match kind {
        Kind::Completion => completion_job,
        Kind::Chat => chat_job,
    };
    // Refusals of the body are counted as invalid (too long: `too_long`) by `respond`.
    let job = match check_body_headers(headers) {
        Ok(()) => match read_body(body, &s.limits).await {
            Ok(b) => parse(&b).map_err(ApiError::from),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    respond(s, job, kind, arrived).await
}

/// The ids of a job's prompt.
fn prompt_ids(s: &AppState, input: &Input) -> Result<Vec<u32>, ApiError> {
    let tok_err = |e: crate::tokenizer::TokenizerError| {
        ApiError::new(StatusCode::BAD_REQUEST, format!("the prompt: {e}"))
    };
    let ids = match input {
        Input::Ids(ids) => {
            let vocab = s.tokenizer.vocab_size();
            if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
                let mut e = ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("token id {t} is outside the vocabulary of {vocab}"),
                );
                e.param = Some("prompt".into());
                return Err(e);
            }
            ids.clone()
        }
        Input::Text(t) => s.tokenizer.encode_prompt(t).map_err(tok_err)?,
        Input::Chat {
            messages,
            enable_thinking,
        } => {
            let render = |e: Option<bool>| {
                s.tokenizer
                    .apply_chat_template(messages, true, e)
                    .map_err(tok_err)
            };
            let text = render(*enable_thinking)?;
            // A value the template's rendering of these messages does not depend on would
            // change nothing (a template that never reads it, as Qwen3's 2507 checkpoints
            // ship): refused by name. Compared by rendering rather than by reading the
            // template's source, which misses a template that sets the variable from itself.
            if let Some(v) = *enable_thinking
                && render(Some(!v))? == text
            {
                let mut e = ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "chat_template_kwargs.enable_thinking: this model's chat template renders \
                     these messages the same whether it is true or false, so it would change \
                     nothing",
                );
                e.param = Some("chat_template_kwargs.enable_thinking".into());
                return Err(e);
            }
            s.tokenizer.encode(&text).map_err(tok_err)?
        }
    };
    if ids.is_empty() {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "the prompt has no tokens");
        e.param = Some(
            if matches!(input, Input::Chat { .. }) {
                "messages"
            } else {
                "prompt"
            }
            .into(),
        );
        return Err(e);
    }
    Ok(ids)
}

async fn respond(
    s: Arc<AppState>,
    job: Result<Job, ApiError>,
    kind: Kind,
    arrived: Instant,
) -> Response {
    match run_job(&s, job, kind, arrived).await {
        Ok(r) => r,
        Err(e) => {
            // Refusals of the HTTP layer; the engine counts its own.
            if let Some(reason) = e.refusal {
                s.handle.metrics().rejected(reason);
            }
            e.into_response()
        }
    }
}

async fn run_job(
    s: &Arc<AppState>,
    job: Result<Job, ApiError>,
    kind: Kind,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let job = job.map_err(|e| {
        let reason = if e.status == StatusCode::PAYLOAD_TOO_LARGE {
            "too_long"
        } else {
            "invalid"
        };
        e.counted(reason)
    })?;
    if job.model != s.model {
        return Err(unknown_model(s, &job.model).counted("unknown_model"));
    }
    // Tokenizing and templating take CPU time in proportion to the prompt (seconds for
    // megabytes): off the async threads, so other requests and /health are not held up.
    let state = s.clone();
    let input = job.input.clone();
    let ids = tokio::task::spawn_blocking(move || prompt_ids(&state, &input))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| e.counted("invalid"))?;
    // A prompt that leaves no room to generate is the engine's refusal (naming the prompt).
    // A limit it leaves too little room for is the engine's to cap to what fits (the
    // specification's rule, which OpenAI and vLLM do not follow: they refuse it); the answer
    // then ends with `finish_reason: "length"` and its usage says how many tokens came.
    // The engine counts its own refusals.
    let rx = s
        .handle
        .submit_since(ids, job.cfg.clone(), arrived)
        .await
        .map_err(|r| {
            let too_long = matches!(r, Refusal::TooLong(_));
            let mut e = ApiError::from(r);
            if too_long {
                e.param = Some(prompt_field(kind).into());
            }
            e
        })?;
    let id = format!(
        "{}-{:016x}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        rand_id()
    );
    let created = unix_now();
    Ok(if job.stream {
        stream_response(rx, id, created, s.model.clone(), kind, job.include_usage)
    } else {
        whole_response(rx, id, created, &s.model, kind).await
    })
}

/// The field holding a request's prompt.
fn prompt_field(kind: Kind) -> &'static str {
    match kind {
        Kind::Completion => "prompt",
        Kind::Chat => "messages",
    }
}

/// A request id: the time and a process-wide counter, mixed (unique, not secret).
fn rand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(17) ^ n
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

async fn whole_response(
    mut rx: mpsc::UnboundedReceiver<Event>,
    id: String,
    created: u64,
    model: &str,
    kind: Kind,
) -> Response {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Event::Delta(d)) => text.push_str(&d),
            Some(Event::Done { finish, usage }) => {
                let choice = match kind {
                    Kind::Completion => json!({
                        "index": 0, "text": text, "logprobs": null,
                        "finish_reason": finish.openai(),
                    }),
                    Kind::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null,
                        "finish_reason": finish.openai(),
                    }),
                };
                return axum::Json(json!({
                    "id": id,
                    "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage_json(&usage),
                }))
                .into_response();
            }
            Some(Event::Error(m)) => {
                return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, m).into_response();
            }
            Some(Event::Unavailable(m)) => {
                return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m)
                    .code("shutting_down")
                    .into_response();
            }
            None => {
                return ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the engine stopped before the request finished",
                )
                .into_response();
            }
        }
    }
}

/// One SSE chunk of a stream.
fn chunk(
    id: &str,
    created: u64,
    model: &str,
    kind: Kind,
    delta: Option<&str>,
    first: bool,
    finish: Option<TextFinish>,
) -> Value {
    let reason = finish.map(TextFinish::openai);
    let choice = match kind {
        Kind::Completion => json!({
            "index": 0, "text": delta.unwrap_or(""), "logprobs": null, "finish_reason": reason,
        }),
        Kind::Chat => {
            let mut d = serde_json::Map::new();
            if first {
                d.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = delta {
                d.insert("content".into(), json!(t));
            }
            json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": reason})
        }
    };
    json!({
        "id": id,
        "object": if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
        "created": created,
        "model": model,
        "choices": [choice],
    })
}

/// A content chunk of a stream that ends with a usage chunk carries `"usage": null`, as
/// OpenAI's do (clients tell the usage chunk by a non-null `usage`).
fn usage_null(mut chunk: Value, include_usage: bool) -> Value {
    if include_usage && let Some(o) = chunk.as_object_mut() {
        o.insert("usage".into(), Value::Null);
    }
    chunk
}

struct StreamState {
    rx: mpsc::UnboundedReceiver<Event>,
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    include_usage: bool,
    first: bool,
    /// Events still to send after the request ended (finish chunk, usage, `[DONE]`).
    tail: Vec<SseEvent>,
    done: bool,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn stream_response(
    rx: mpsc::UnboundedReceiver<Event>,
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    include_usage: bool,
) -> Response {
    let st = StreamState {
        rx,
        id,
        created,
        model,
        kind,
        include_usage,
        first: true,
        tail: Vec::new(),
        done: false,
    };
    let events = stream::unfold(st, |mut st| async move {
        if let Some(e) = st.tail.pop() {
            return Some((Ok::<_, Infallible>(e), st));
        }
        if st.done {
            return None;
        }
        let (id, created, model, kind) = (&st.id, st.created, &st.model, st.kind);
        let ev = match st.rx.recv().await {
            Some(Event::Delta(d)) => {
                let c = chunk(id, created, model, kind, Some(&d), st.first, None);
                st.first = false;
                data(&usage_null(c, st.include_usage))
            }
            Some(Event::Done { finish, usage }) => {
                st.done = true;
                let c = chunk(id, created, model, kind, None, st.first, Some(finish));
                let mut tail = vec![data(&usage_null(c, st.include_usage))];
                if st.include_usage {
                    tail.push(data(&json!({
                        "id": id,
                        "object": if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage_json(&usage),
                    })));
                }
                tail.push(SseEvent::default().data("[DONE]"));
                tail.reverse();
                st.tail = tail;
                st.tail.pop().unwrap_or_default()
            }
            Some(Event::Error(m)) => {
                st.done = true;
                let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, m);
                st.tail = vec![SseEvent::default().data("[DONE]")];
                data(&e.body())
            }
            Some(Event::Unavailable(m)) => {
                st.done = true;
                let e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m).code("shutting_down");
                st.tail = vec![SseEvent::default().data("[DONE]")];
                data(&e.body())
            }
            None => {
                st.done = true;
                let e = ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the engine stopped before the request finished",
                );
                st.tail = vec![SseEvent::default().data("[DONE]")];
                data(&e.body())
            }
        };
        Some((Ok(ev), st))
    });
    // Keep-alive comments: a request waiting in the queue sends nothing after its headers,
    // and proxies close connections that stay silent.
    Sse::new(events.boxed())
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    /// The accepted connection carries the unsent limit (read back from the kernel).
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn accepted_tcp_connections_keep_at_most_notsent_lowat_unsent() {
        use axum::serve::Listener;
        use std::os::fd::AsRawFd;
        let mut l = super::Tcp(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
        let addr = l.0.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (server, _) = l.accept().await;
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: an open TCP socket; `v` and `len` are a `c_int` and its size, written by
        // the call.
        let r = unsafe {
            libc::getsockopt(
                server.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NOTSENT_LOWAT,
                (&raw mut v).cast(),
                &raw mut len,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        assert_eq!(v as usize, super::NOTSENT_LOWAT);
        assert!(server.nodelay().unwrap());
    }

    #[test]
    fn openmetrics_is_sent_where_accept_weighs_it_at_least_as_text() {
        let om = |v: &[&str]| super::prefers_openmetrics(v.iter().copied());
        assert!(!om(&[]));
        assert!(!om(&["text/plain;version=0.0.4"]));
        assert!(om(&[
            "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"
        ]));
        // What Prometheus sends.
        assert!(om(&[
            "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
        ]));
        for refused in ["q=0", "q=0.000", "Q=0", "q = 0"] {
            assert!(
                !om(&[&format!("application/openmetrics-text;{refused}")]),
                "{refused}"
            );
        }
        assert!(!om(&["text/plain;q=1, application/openmetrics-text;q=0.1"]));
        assert!(!om(&["application/openmetrics-text;q=nonsense"]));
        assert!(om(&["*/*;q=0.1", "APPLICATION/OpenMetrics-Text"]));
    }
}
