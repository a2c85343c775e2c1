//! The HTTP server on loopback, driven by a plain HTTP/1.1 client: answers equal the text
//! engine's, streams concatenate to the same text and end in `[DONE]`, bad requests get error
//! objects naming the field and the server keeps serving, 64 concurrent streams (some
//! cancelled midway) lose nothing and return every block, `/metrics` agrees with what was
//! sent, a model is retrieved by its id, a shutdown lets in-flight requests finish while
//! new ones get 503, and a body over the limit (413) or a full queue (503 `overloaded`) is
//! refused while the server goes on.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
use serde_json::{Value, json};
use simpler_models::qwen3::{Qwen3Config, WeightFormat, generate_weights};
use simpler_serve::http::{AppState, ConnLimits, MAX_BODY_BYTES, serve, serve_on};
use simpler_serve::{
    Engine, EngineConfig, GenerateConfig, Service, ServiceConfig, TextEngine, Tokenizer,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

const MODEL: &str = "qwen3-tiny";

fn engine(cfg: EngineConfig) -> Engine {
    let worker = common::qwen3_worker();
    let c = Qwen3Config::preset(MODEL).unwrap();
    let w = generate_weights(&c, 7, false, None);
    Engine::new(worker, &w, c.eos_token_ids.clone(), cfg).unwrap()
}

fn sizes() -> EngineConfig {
    EngineConfig {
        max_batch_size: 16,
        max_num_batched_tokens: 512,
        max_seq_len: 4096,
        num_blocks: 256,
        long_prefill_threshold: None,
        weights: WeightFormat::Bf16,
    }
}

struct Server {
    addr: SocketAddr,
    service: Option<Service>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(cfg: EngineConfig, max_waiting: usize) -> Server {
    start_as(cfg, max_waiting, MODEL).await
}

/// [`start`], serving the model as `name`.
async fn start_as(cfg: EngineConfig, max_waiting: usize, name: &str) -> Server {
    start_with(cfg, max_waiting, name, Tokenizer::qwen3().unwrap()).await
}

/// [`start_as`], with `tokenizer` (and its chat template).
async fn start_with(
    cfg: EngineConfig,
    max_waiting: usize,
    name: &str,
    tokenizer: Tokenizer,
) -> Server {
    start_limited(cfg, max_waiting, name, tokenizer, ConnLimits::default()).await
}

/// [`start_with`], with connection limits `limits`.
async fn start_limited(
    cfg: EngineConfig,
    max_waiting: usize,
    name: &str,
    tokenizer: Tokenizer,
    limits: ConnLimits,
) -> Server {
    let tokenizer = Arc::new(tokenizer);
    let service = Service::start(
        engine(cfg),
        tokenizer.clone(),
        ServiceConfig {
            max_waiting,
            drain: Duration::from_secs(60),
        },
    )
    .unwrap();
    let state = Arc::new(AppState {
        handle: service.handle(),
        tokenizer,
        model: name.into(),
        max_model_len: cfg.max_seq_len,
        created: 0,
        limits,
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, state, async move {
        let _ = stopped.await;
    }));
    Server {
        addr,
        service: Some(service),
        stop: Some(stop),
        task,
    }
}

impl Server {
    /// Stops the server and gives the engine back.
    async fn stop(mut self) -> Engine {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await.unwrap().unwrap();
        let service = self.service.take().unwrap();
        tokio::task::spawn_blocking(move || service.stop())
            .await
            .unwrap()
            .unwrap()
    }
}

/// Sends one request; returns the status and the (de-chunked) body.
async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a header block");
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let chunked = head
        .lines()
        .any(|l| l.eq_ignore_ascii_case("transfer-encoding: chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, &body.to_string()).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

fn reference_text(prompt: &str, cfg: &GenerateConfig) -> (String, usize) {
    let mut te = TextEngine::new(engine(sizes()), Tokenizer::qwen3().unwrap()).unwrap();
    let r = te.generate_result(prompt, cfg).unwrap();
    (r.text, r.token_ids.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_equal_the_text_engine_and_streams_concatenate_to_them() {
    let srv = start(sizes(), 64).await;
    let prompt = "The quick brown fox jumps over the lazy dog. Then";
    let cfg = GenerateConfig {
        max_new_tokens: 12,
        ..GenerateConfig::default()
    };
    let (want, want_tokens) = reference_text(prompt, &cfg);

    let (status, v) = post(
        srv.addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 12}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(v["usage"]["completion_tokens"], want_tokens);

    // Streamed: the deltas concatenate to the same text; usage before [DONE] when asked.
    let (status, body) = http(
        srv.addr,
        "POST",
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "stream": true,
                "stream_options": {"include_usage": true}})
        .to_string(),
    )
    .await;
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], want_tokens);
    // Every other chunk says `"usage": null`, as OpenAI's do.
    for c in &chunks[..chunks.len() - 1] {
        assert!(c.get("usage").is_some_and(Value::is_null), "{c}");
    }
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, want);
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("length")]);

    // Chat: the prompt is the chat template's rendering.
    let tok = Tokenizer::qwen3().unwrap();
    let rendered = tok
        .apply_chat_template(
            &[simpler_serve::ChatMessage::new("user", "Hi!")],
            true,
            None,
        )
        .unwrap();
    let (want_chat, _) = reference_text(&rendered, &cfg);
    let (status, v) = post(
        srv.addr,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 12}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want_chat.as_str());
    let (_, body) = http(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}],
                "max_tokens": 12, "stream": true})
        .to_string(),
    )
    .await;
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // No usage asked: no chunk carries the key.
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "{chunks:?}"
    );
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want_chat);

    // A stop string ends the text before it (and the request there).
    let stop_at: String = want.chars().skip(6).take(3).collect();
    let (_, v) = post(
        srv.addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "stop": [stop_at]}),
    )
    .await;
    let cut = &want[..want.find(&stop_at).unwrap()];
    assert_eq!(v["choices"][0]["text"], cut);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let (status, body) = http(srv.addr, "GET", "/v1/models", "").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], MODEL);
    let (status, _) = http(srv.addr, "GET", "/health", "").await;
    assert_eq!(status, 200);
    let e = srv.stop().await;
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_error_objects_and_the_server_keeps_serving() {
    let srv = start(
        EngineConfig {
            max_seq_len: 256,
            ..sizes()
        },
        64,
    )
    .await;
    let long: Vec<u32> = (0..300).map(|i| 1000 + i).collect();
    let user = json!([{"role": "user", "content": "x"}]);
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/completions", "{not json".into(), 400, None),
        (
            "/v1/completions",
            json!({"model": "gpt-4", "prompt": "x"}).to_string(),
            404,
            Some("model_not_found"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": long}).to_string(),
            400,
            Some("context_length_exceeded"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x ".repeat(300)}]})
                .to_string(),
            400,
            Some("context_length_exceeded"),
        ),
        // A prompt that alone does not fit is named as the prompt, a limit given or not.
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": long, "max_tokens": 5}).to_string(),
            400,
            Some("context_length_exceeded"),
        ),
        // A `top_p` that rounds to 0 in 32 bits is refused by its own name.
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "temperature": 1, "top_p": 1e-46}).to_string(),
            400,
            None,
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": -3}).to_string(),
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []})
                .to_string(),
            400,
            None,
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": [999_999_999]}).to_string(),
            400,
            None,
        ),
        ("/v1/nothing", "{}".into(), 404, Some("not_found")),
    ];
    let params = [
        None,
        Some("model"),
        Some("prompt"),
        Some("messages"),
        Some("prompt"),
        Some("top_p"),
        Some("max_tokens"),
        Some("tools"),
        Some("prompt"),
        None,
    ];
    assert_eq!(params.len(), cases.len());
    for ((path, body, status, code), param) in cases.into_iter().zip(params) {
        let (got, text) = http(srv.addr, "POST", path, &body).await;
        assert_eq!(got, status, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        if let Some(c) = code {
            assert_eq!(e["code"], c, "{v}");
        }
        assert_eq!(e["param"].as_str(), param, "{path} {body}: {v}");
        // The message starts with the field it names (clients often show only the message).
        if let Some(p) = param {
            let m = e["message"].as_str().unwrap();
            assert!(
                m.starts_with(p) || m.starts_with(&format!("`{p}`")),
                "{path} {body}: {v}"
            );
        }
        // And the next request is served.
        let (ok, v) = post(
            srv.addr,
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Hello", "max_tokens": 2}),
        )
        .await;
        assert_eq!(ok, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 2);
    }
    // A limit the prompt leaves too little room for is capped to what fits: a one-token
    // prompt and 255 more fill the 256 a sequence holds, whether the limit asks for exactly
    // that or more, and the answer says it stopped at the length.
    for max_tokens in [255, 256, 100_000] {
        let (ok, v) = post(
            srv.addr,
            "/v1/completions",
            json!({"model": MODEL, "prompt": [5], "max_tokens": max_tokens, "ignore_eos": true}),
        )
        .await;
        assert_eq!(ok, 200, "{max_tokens}: {v}");
        assert_eq!(v["usage"]["completion_tokens"], 255, "{max_tokens}: {v}");
        assert_eq!(
            v["choices"][0]["finish_reason"], "length",
            "{max_tokens}: {v}"
        );
    }
    let (ok, v) = post(
        srv.addr,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": user, "max_completion_tokens": 300,
               "ignore_eos": true}),
    )
    .await;
    assert_eq!(ok, 200, "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 256 - prompt_tokens, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let e = srv.stop().await;
    assert_eq!(e.free_blocks(), e.total_blocks());
}

/// Reads a streaming request until its first data chunk, then drops the connection.
async fn stream_and_cancel(addr: SocketAddr, body: Value) {
    drop(stream_open(addr, body).await);
}

/// Sends a streaming request and reads until its first data chunk; the connection stays open
/// (the request runs on) until the stream is dropped.
async fn stream_open(addr: SocketAddr, body: Value) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(post_text("/v1/completions", &body, false).as_bytes())
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "the server closed before the first chunk");
        seen.extend_from_slice(&buf[..n]);
        if String::from_utf8_lossy(&seen).contains("data: {") {
            break;
        }
    }
    s
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_streams_some_cancelled_lose_nothing_and_free_every_block() {
    let srv = start(sizes(), 256).await;
    let addr = srv.addr;
    let mut tasks = Vec::new();
    let mut prompt_tokens = 0u64;
    let mut expected_generated = 0u64;
    let mut cancelled = 0u64;
    for i in 0..64u32 {
        let len = 3 + (i as usize * 7) % 90;
        let prompt: Vec<u32> = (0..len as u32)
            .map(|t| 100 + (t * 31 + i * 17) % 5000)
            .collect();
        prompt_tokens += len as u64;
        if i % 4 == 3 {
            // Cancelled after the first chunk; it would run for 2000 tokens.
            cancelled += 1;
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2000,
                              "ignore_eos": true, "stream": true});
            tasks.push(tokio::spawn(async move {
                stream_and_cancel(addr, body).await;
                None
            }));
        } else {
            let max_tokens = 4 + (i % 9);
            expected_generated += u64::from(max_tokens);
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                              "ignore_eos": true, "stream": true,
                              "stream_options": {"include_usage": true}});
            tasks.push(tokio::spawn(async move {
                let (status, text) = http(addr, "POST", "/v1/completions", &body.to_string()).await;
                assert_eq!(status, 200);
                let data = sse_data(&text);
                assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
                let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
                assert_eq!(usage["usage"]["completion_tokens"], max_tokens);
                assert_eq!(usage["usage"]["prompt_tokens"], len);
                Some(max_tokens)
            }));
        }
    }
    let mut completed = 0;
    for t in tasks {
        if t.await.unwrap().is_some() {
            completed += 1;
        }
    }
    assert_eq!(completed, 48);
    // The cancelled requests end once the engine sees their receivers gone (before its next
    // step); stopping the service waits for that.
    // Every request ended once, by how it ended.
    let m = wait_metrics(addr, |m| {
        metric(m, "simpler_requests_running") + metric(m, "simpler_requests_waiting") == 0.0
    })
    .await;
    assert_eq!(
        metric(&m, "simpler_prompt_tokens_total"),
        prompt_tokens as f64
    );
    assert_eq!(
        metric(&m, "simpler_requests_total{finish=\"length\"}"),
        48.0
    );
    assert_eq!(
        metric(&m, "simpler_requests_total{finish=\"cancelled\"}"),
        cancelled as f64
    );
    assert_eq!(metric(&m, "simpler_kv_blocks_used"), 0.0);
    let e = srv.stop().await;
    assert_eq!(e.free_blocks(), e.total_blocks(), "every block is back");
    assert_eq!(e.running() + e.waiting(), 0);
    let s = e.stats();
    assert_eq!(s.requests, 64);
    assert_eq!(s.aborted, cancelled);
    assert!(s.max_batch > 1, "requests were batched: {s:?}");
    assert!(s.generated_tokens >= expected_generated + cancelled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_was_sent() {
    let srv = start(sizes(), 64).await;
    let mut prompt_tokens = 0;
    let mut generated = 0;
    for (i, n) in [3u32, 5, 7].into_iter().enumerate() {
        let prompt: Vec<u32> = (0..(10 + i as u32 * 60)).map(|t| 200 + t).collect();
        prompt_tokens += prompt.len();
        generated += n as usize;
        let (status, v) = post(
            srv.addr,
            "/v1/completions",
            json!({"model": MODEL, "prompt": prompt, "max_tokens": n, "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, 200, "{v}");
    }
    // The same 130-token prompt again: its full blocks come from the prefix cache.
    let prompt: Vec<u32> = (0..130).map(|t| 200 + t).collect();
    let (_, v) = post(
        srv.addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": true}),
    )
    .await;
    prompt_tokens += 130;
    generated += 2;
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "{v}");
    let (_, _) = post(
        srv.addr,
        "/v1/completions",
        json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    let (status, m) = http(srv.addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    assert_eq!(
        metric(&m, "simpler_prompt_tokens_total"),
        prompt_tokens as f64
    );
    assert_eq!(
        metric(&m, "simpler_generation_tokens_total"),
        generated as f64
    );
    assert_eq!(metric(&m, "simpler_requests_total{finish=\"length\"}"), 4.0);
    assert_eq!(
        metric(&m, "simpler_prefix_cache_hit_tokens_total"),
        cached as f64
    );
    assert_eq!(metric(&m, "simpler_time_to_first_token_seconds_count"), 4.0);
    assert_eq!(metric(&m, "simpler_requests_running"), 0.0);
    assert_eq!(metric(&m, "simpler_kv_blocks_used"), 0.0);
    assert_eq!(metric(&m, "simpler_kv_blocks_total"), 256.0);
    // The Prometheus text format unless OpenMetrics is asked for (and not refused by q=0).
    for (accept, openmetrics) in [
        (None, false),
        (Some("text/plain;version=0.0.4"), false),
        (
            Some("application/openmetrics-text;version=1.0.0;q=0"),
            false,
        ),
        (
            Some("application/openmetrics-text; version=1.0.0,text/plain;q=0.5"),
            true,
        ),
    ] {
        let mut s = TcpStream::connect(srv.addr).await.unwrap();
        let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
        s.write_all(
            format!("GET /metrics HTTP/1.1\r\nHost: t\r\n{accept}Connection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.unwrap();
        let text = String::from_utf8_lossy(&raw).to_lowercase();
        let kind = if openmetrics {
            "content-type: application/openmetrics-text; version=1.0.0"
        } else {
            "content-type: text/plain; version=0.0.4"
        };
        assert!(text.contains(kind), "{accept}: {text}");
        assert_eq!(text.contains("# eof"), openmetrics, "{accept}: {text}");
    }
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_lets_in_flight_requests_finish_and_refuses_new_ones() {
    let mut srv = start(sizes(), 64).await;
    let addr = srv.addr;
    let handle = srv.service.as_ref().unwrap().handle();
    let body = json!({"model": MODEL, "prompt": "Count with me:", "max_tokens": 40,
                      "ignore_eos": true, "stream": true});
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(post_text("/v1/completions", &body, true).as_bytes())
        .await
        .unwrap();
    // Wait for the first chunk, then shut down.
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains("data: {") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0);
        raw.extend_from_slice(&buf[..n]);
    }
    let _ = srv.stop.take().unwrap().send(());
    // The stream runs to its end.
    s.read_to_end(&mut raw).await.unwrap();
    let (_, body) = parse_response(&raw);
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let finish: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["finish_reason"].clone())
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [json!("length")]);
    // New requests are refused.
    let r = handle
        .submit(vec![1, 2, 3], GenerateConfig::default())
        .await;
    assert!(
        matches!(r, Err(simpler_serve::Refusal::ShuttingDown(_))),
        "{r:?}"
    );
    let e = srv.stop().await;
    assert_eq!(e.free_blocks(), e.total_blocks());
    assert_eq!(e.stats().generated_tokens, 40);
}

/// Polls `/metrics` until `pred` holds (bounded, so a bug fails instead of hanging).
async fn wait_metrics(addr: SocketAddr, pred: impl Fn(&str) -> bool) -> String {
    for _ in 0..2000 {
        let (_, m) = http(addr, "GET", "/metrics", "").await;
        if pred(&m) {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the metrics never reached the expected state");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_a_whole_response_request_cancels_it() {
    let srv = start(sizes(), 64).await;
    let addr = srv.addr;
    let body = json!({"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 3000,
                      "ignore_eos": true})
    .to_string();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(post_text("/v1/completions", &body, false).as_bytes())
        .await
        .unwrap();
    // Running (it needs 3000 tokens), then the client goes away.
    wait_metrics(addr, |m| metric(m, "simpler_requests_running") == 1.0).await;
    drop(s);
    let m = wait_metrics(addr, |m| {
        m.lines()
            .any(|l| l == "simpler_requests_total{finish=\"cancelled\"} 1")
    })
    .await;
    assert_eq!(metric(&m, "simpler_requests_running"), 0.0);
    let e = srv.stop().await;
    assert_eq!(e.free_blocks(), e.total_blocks());
    assert!(e.stats().generated_tokens < 3000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_stop_strings_usage_and_method_errors() {
    let srv = start(sizes(), 64).await;
    let addr = srv.addr;
    // No seed: two samples differ; the same seed twice: the same text.
    let sample = |seed: Option<u64>| {
        let mut b = json!({"model": MODEL, "prompt": "Pick words:", "max_tokens": 12,
                           "temperature": 1.0, "ignore_eos": true});
        if let Some(s) = seed {
            b["seed"] = json!(s);
        }
        b
    };
    let (_, a) = post(addr, "/v1/completions", sample(None)).await;
    let (_, b) = post(addr, "/v1/completions", sample(None)).await;
    assert_ne!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let (_, c) = post(addr, "/v1/completions", sample(Some(5))).await;
    let (_, d) = post(addr, "/v1/completions", sample(Some(5))).await;
    assert_eq!(c["choices"][0]["text"], d["choices"][0]["text"]);

    // A stop string that ends a request whose prompt came from the prefix cache: the usage
    // still says how many prompt tokens were cached.
    let prompt: Vec<u32> = (0..140).map(|t| 300 + t).collect();
    let (_, first) = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 10, "ignore_eos": true}),
    )
    .await;
    let text = first["choices"][0]["text"].as_str().unwrap().to_string();
    let stop: String = text
        .chars()
        .skip(text.chars().count() / 2)
        .take(2)
        .collect();
    let (_, again) = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 10, "ignore_eos": true,
               "stop": [stop]}),
    )
    .await;
    assert_eq!(again["choices"][0]["finish_reason"], "stop", "{again}");
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        128
    );

    // A method the route does not take: an error object.
    let (status, body) = http(addr, "GET", "/v1/completions", "").await;
    assert_eq!(status, 405);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "method_not_allowed");
    let e = srv.stop().await;
    assert_eq!(e.stats().aborted, 0, "a stop string is not an abort");
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_left_when_the_drain_time_is_over_get_an_unavailable_event() {
    let tokenizer = Arc::new(Tokenizer::qwen3().unwrap());
    let service = Service::start(
        engine(sizes()),
        tokenizer,
        ServiceConfig {
            max_waiting: 8,
            drain: Duration::ZERO,
        },
    )
    .unwrap();
    let h = service.handle();
    let mut rx = h
        .submit(
            vec![5, 6, 7],
            GenerateConfig {
                max_new_tokens: 3000,
                ignore_eos: true,
                ..GenerateConfig::default()
            },
        )
        .await
        .unwrap();
    assert!(h.is_alive());
    h.shutdown();
    let mut last = None;
    while let Some(e) = rx.recv().await {
        last = Some(e);
    }
    assert!(
        matches!(last, Some(simpler_serve::Event::Unavailable(_))),
        "{last:?}"
    );
    let e = tokio::task::spawn_blocking(move || service.stop())
        .await
        .unwrap()
        .unwrap();
    assert!(!h.is_alive());
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_is_retrieved_by_id_and_a_bad_field_is_named() {
    // A served name with a `/`, as Hugging Face names have.
    let name = "org/tiny";
    let srv = start_as(sizes(), 64, name).await;
    let addr = srv.addr;
    let (status, body) = http(addr, "GET", "/v1/models/org/tiny", "").await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["id"], name);
    assert_eq!(v["object"], "model");
    assert_eq!(v["owned_by"], "simpler");
    // The same object as in the list.
    let (_, list) = http(addr, "GET", "/v1/models", "").await;
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list["data"][0], v);
    // Percent-encoded, as clients that quote the id send it.
    let (status, _) = http(addr, "GET", "/v1/models/org%2Ftiny", "").await;
    assert_eq!(status, 200);
    for unknown in [
        "/v1/models/gpt-4",
        "/v1/models/org/tiny/x",
        "/v1/models/org",
    ] {
        let (status, body) = http(addr, "GET", unknown, "").await;
        assert_eq!(status, 404, "{unknown}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found", "{v}");
        assert_eq!(v["error"]["param"], "model", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }

    // A field of the wrong kind, and a field given twice: 400s naming the field.
    for (body, param) in [
        (
            format!(r#"{{"model":"{name}","prompt":"Hi","max_tokens":"2"}}"#),
            "max_tokens",
        ),
        (
            format!(r#"{{"model":"{name}","prompt":"Hi","max_tokens":1,"max_tokens":4}}"#),
            "max_tokens",
        ),
    ] {
        let (status, text) = http(addr, "POST", "/v1/completions", &body).await;
        assert_eq!(status, 400, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(param),
            "{v}"
        );
    }
    let (status, text) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &json!({"model": name, "messages": [{"role": "user"}]}).to_string(),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["param"], "messages[0].content", "{v}");
    // `store: false` and `metadata` change nothing.
    let (status, v) = post(
        addr,
        "/v1/chat/completions",
        json!({"model": name, "messages": [{"role": "user", "content": "Hi"}],
               "max_tokens": 2, "store": false, "metadata": {"run": "1"}}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let e = srv.stop().await;
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_served_model_name_is_refused() {
    assert!(simpler_serve::http::check_model_name("").is_err());
    assert!(simpler_serve::http::check_model_name("m").is_ok());
    let tokenizer = Arc::new(Tokenizer::qwen3().unwrap());
    let service = Service::start(
        engine(sizes()),
        tokenizer.clone(),
        ServiceConfig {
            max_waiting: 8,
            drain: Duration::from_secs(1),
        },
    )
    .unwrap();
    let state = Arc::new(AppState {
        handle: service.handle(),
        tokenizer,
        model: String::new(),
        max_model_len: 4096,
        created: 0,
        limits: ConnLimits::default(),
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    // Refused at once, whatever the shutdown future does.
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        serve(listener, state, std::future::pending()),
    )
    .await
    .expect("serve returns at once");
    let e = r.expect_err("an empty name is refused");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("empty"), "{e}");
    tokio::task::spawn_blocking(move || service.stop())
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_draining_new_requests_get_503_and_the_listener_closes_after() {
    let mut srv = start(sizes(), 64).await;
    let addr = srv.addr;
    let handle = srv.service.as_ref().unwrap().handle();
    // One long request in flight (it would run for 3000 tokens), on a keep-alive connection.
    let body = json!({"model": MODEL, "prompt": "Count with me:", "max_tokens": 3000,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(post_text("/v1/completions", &body, false).as_bytes())
        .await
        .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains("data: {") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0);
        raw.extend_from_slice(&buf[..n]);
    }
    let _ = srv.stop.take().unwrap().send(());
    for _ in 0..1000 {
        if handle.is_closing() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(handle.is_closing());
    // Draining: new connections are still answered, with 503s saying why.
    let (status, body) = http(addr, "GET", "/health", "").await;
    assert_eq!(status, 503, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "shutting_down");
    let (status, v) = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "shutting_down");
    // Every new request alike, before its body is read: not 400 for bad JSON, not 404 for
    // another model.
    for body in ["{not json", r#"{"model":"other","prompt":"Hi"}"#] {
        let (status, text) = http(addr, "POST", "/v1/completions", body).await;
        assert_eq!(status, 503, "{body}: {text}");
    }
    // Each refusal counted under its reason (the health check is not a request).
    let m = handle.metrics().render_prometheus_text();
    assert_eq!(
        metric(
            &m,
            "simpler_requests_rejected_total{reason=\"shutting_down\"}"
        ),
        3.0,
        "{m}"
    );
    assert!(
        !srv.task.is_finished(),
        "the server waits for the request in flight"
    );
    // The client leaves; its request ends, the engine thread stops and the server returns.
    drop(s);
    tokio::time::timeout(Duration::from_secs(30), &mut srv.task)
        .await
        .expect("the server returns once the engine has drained")
        .unwrap()
        .unwrap();
    assert!(!handle.is_alive());
    // Now the listener is closed.
    assert!(TcpStream::connect(addr).await.is_err());
    let service = srv.service.take().unwrap();
    let e = tokio::task::spawn_blocking(move || service.stop())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(e.free_blocks(), e.total_blocks());
    assert_eq!(e.stats().aborted, 1);
}

/// A body over the limit gets 413, and with the batch full (one running) and the queue full
/// (one waiting) a third request gets 503 `overloaded`, each with an error object; the waiting
/// request then runs when the running one is cancelled, and the server answers the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_gets_413_and_a_full_queue_503_and_the_server_goes_on() {
    let one = EngineConfig {
        max_batch_size: 1,
        ..sizes()
    };
    let srv = start(one, 1).await;
    let addr = srv.addr;
    // One byte over: the server must read all of it to find that out, so no unread byte is
    // left to make the connection's close a reset that could race its answer.
    let wrap = format!(r#"{{"model":"{MODEL}","prompt":""}}"#).len();
    let big = format!(
        r#"{{"model":"{MODEL}","prompt":"{}"}}"#,
        "x".repeat(MAX_BODY_BYTES + 1 - wrap)
    );
    assert_eq!(big.len(), MAX_BODY_BYTES + 1);
    let (status, body) = http(addr, "POST", "/v1/completions", &big).await;
    assert_eq!(status, 413, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(&format!("over {MAX_BODY_BYTES} bytes"))),
        "{body}"
    );
    let short = |prompt: &str| json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    // One running (to the sequence limit unless cancelled), one waiting behind it.
    let running = stream_open(
        addr,
        json!({"model": MODEL, "prompt": "a", "max_tokens": 4000, "ignore_eos": true,
               "stream": true}),
    )
    .await;
    let waiting = tokio::spawn(post(addr, "/v1/completions", short("b")));
    wait_metrics(addr, |m| metric(m, "simpler_requests_waiting") >= 1.0).await;
    let (status, v) = post(addr, "/v1/completions", short("c")).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "overloaded", "{v}");
    drop(running);
    let (status, v) = waiting.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    let (status, v) = post(addr, "/v1/completions", short("d")).await;
    assert_eq!(status, 200, "{v}");
    srv.stop().await;
}

/// The Qwen3 tokenizer with `template` as its chat template.
fn with_template(template: &str) -> Tokenizer {
    let config = json!({"eos_token": "<|im_end|>", "chat_template": template});
    Tokenizer::from_bytes(
        include_bytes!("../assets/qwen3/tokenizer.json"),
        Some(config.to_string().as_bytes()),
        "a test template",
    )
    .unwrap()
}

/// `chat_template_kwargs.enable_thinking` goes to a template that reads it (the built-in
/// Qwen3 one) and is refused by name where the template never reads it (as Qwen3's 2507
/// checkpoints ship theirs), since it would change nothing; a body that cannot be read (a
/// malformed chunk) is a 400, not a 413; and the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_variable_nothing_reads_and_an_unreadable_body_are_refused() {
    let kwargs = |v: bool| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
               "max_completion_tokens": 2, "chat_template_kwargs": {"enable_thinking": v}})
    };
    let srv = start(sizes(), 64).await;
    for v in [false, true] {
        let (status, body) = post(srv.addr, "/v1/chat/completions", kwargs(v)).await;
        assert_eq!(status, 200, "{body}");
    }
    srv.stop().await;

    let plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let srv = start_with(sizes(), 64, MODEL, with_template(plain)).await;
    for v in [false, true] {
        let (status, body) = post(srv.addr, "/v1/chat/completions", kwargs(v)).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(
            body["error"]["param"], "chat_template_kwargs.enable_thinking",
            "{body}"
        );
    }
    srv.stop().await;

    // A template that sets the variable from itself reads it (a look at its source for the
    // names it reads misses this one).
    let own = "{% set enable_thinking = enable_thinking | default(true) %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}";
    let srv = start_with(sizes(), 64, MODEL, with_template(own)).await;
    let mut prompt_tokens = Vec::new();
    for v in [false, true] {
        let (status, body) = post(srv.addr, "/v1/chat/completions", kwargs(v)).await;
        assert_eq!(status, 200, "{body}");
        prompt_tokens.push(body["usage"]["prompt_tokens"].clone());
    }
    assert_ne!(
        prompt_tokens[0], prompt_tokens[1],
        "the value reached the template"
    );
    srv.stop().await;

    let srv = start_with(sizes(), 64, MODEL, with_template(plain)).await;
    let mut ok = kwargs(false);
    ok.as_object_mut().unwrap().remove("chat_template_kwargs");
    let (status, body) = post(srv.addr, "/v1/chat/completions", ok.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 2, "{body}");

    // A chunk size that is no number: the body cannot be read.
    let mut c = TcpStream::connect(srv.addr).await.unwrap();
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
          Transfer-Encoding: chunked\r\nConnection: close\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let mut raw = Vec::new();
    c.read_to_end(&mut raw).await.unwrap();
    let (status, body) = parse_response(&raw);
    assert_eq!(status, 400, "{body}");
    let (status, body) = post(srv.addr, "/v1/chat/completions", ok).await;
    assert_eq!(status, 200, "{body}");
    srv.stop().await;
}

/// Reads from `s` until the peer closes it (or `within` passes: then `None`); the bytes read
/// (a reset counts as closed).
async fn read_until_closed(s: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut raw = Vec::new();
    let closed = tokio::time::timeout(within, s.read_to_end(&mut raw)).await;
    closed.is_ok().then_some(raw)
}

/// A body the server would misread is refused naming the header (415): a `Content-Type`
/// other than JSON in UTF-8 (a form-encoded or plain-text body was parsed as JSON) or a
/// compressed body (it failed as "not valid JSON"). Without a `Content-Type` the body is read
/// as JSON; JSON types with parameters pass. The refusals count as invalid requests, and the
/// server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_by_its_headers_is_refused_naming_the_header() {
    let srv = start(sizes(), 8).await;
    let body = json!({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).to_string();
    let send = |headers: &'static str| {
        let body = body.clone();
        let addr = srv.addr;
        async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            let req = format!(
                "POST /v1/completions HTTP/1.1\r\nHost: t\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            c.write_all(req.as_bytes()).await.unwrap();
            let mut raw = Vec::new();
            c.read_to_end(&mut raw).await.unwrap();
            let (status, text) = parse_response(&raw);
            (
                status,
                serde_json::from_str::<Value>(&text).unwrap_or(Value::Null),
            )
        }
    };
    for (headers, names) in [
        ("Content-Type: text/plain\r\n", "Content-Type `text/plain`"),
        (
            "Content-Type: application/x-www-form-urlencoded\r\n",
            "Content-Type `application/x-www-form-urlencoded`",
        ),
        (
            "Content-Type: application/json; charset=latin-1\r\n",
            "charset=latin-1",
        ),
        (
            "Content-Type: application/json\r\nContent-Encoding: gzip\r\n",
            "Content-Encoding `gzip`",
        ),
    ] {
        let (status, body) = send(headers).await;
        assert_eq!(status, 415, "{headers}: {body}");
        assert_eq!(body["error"]["code"], "unsupported_media_type", "{body}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(names),
            "{body}"
        );
    }
    for headers in [
        "",
        "Content-Type: application/json\r\n",
        "Content-Type: Application/JSON; charset=\"UTF-8\"\r\n",
        "Content-Type: application/vnd.api+json\r\nContent-Encoding: identity\r\n",
    ] {
        let (status, body) = send(headers).await;
        assert_eq!(status, 200, "{headers:?}: {body}");
    }
    let (_, m) = http(srv.addr, "GET", "/metrics", "").await;
    assert_eq!(
        metric(&m, "simpler_requests_rejected_total{reason=\"invalid\"}"),
        4.0,
        "{m}"
    );
    srv.stop().await;
}

/// A client that opens connections and sends nothing, or a request's first bytes only, no
/// longer holds them for ever: past the read timeout an idle or partial connection is
/// closed, a late body gets 408, and the server serves the next request as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_partial_connections_are_closed_after_the_read_timeout() {
    // Long enough that this test's own requests (connect, then write at once) never meet it
    // on a loaded machine; the waits for the closes are bounded at 30 s.
    let limits = ConnLimits {
        read_timeout: Duration::from_secs(2),
        ..ConnLimits::default()
    };
    let server = start_limited(sizes(), 8, MODEL, Tokenizer::qwen3().unwrap(), limits).await;
    let addr = server.addr;
    let before = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4}),
    )
    .await;
    assert_eq!(before.0, 200, "{}", before.1);
    // Nothing sent; half a header block; a whole request answered and then left idle.
    let mut quiet = TcpStream::connect(addr).await.unwrap();
    let mut partial = TcpStream::connect(addr).await.unwrap();
    partial
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    for (what, s) in [
        ("a silent connection", &mut quiet),
        ("a partial header block", &mut partial),
    ] {
        let raw = read_until_closed(s, Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("{what} is still open 30 s later"));
        assert!(raw.is_empty(), "{what}: {}", String::from_utf8_lossy(&raw));
    }
    let raw = read_until_closed(&mut kept, Duration::from_secs(30))
        .await
        .expect("an idle keep-alive connection is closed");
    assert_eq!(
        parse_response(&raw).0,
        200,
        "its request was answered first"
    );
    // A body that stops short of its Content-Length: 408, and the connection closes.
    let mut late = TcpStream::connect(addr).await.unwrap();
    late.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo",
    )
    .await
    .unwrap();
    let raw = read_until_closed(&mut late, Duration::from_secs(30))
        .await
        .expect("a late body's connection is closed");
    let (status, body) = parse_response(&raw);
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["error"]["code"], "request_timeout", "{body}");
    // The server goes on: the same answer as before.
    let after = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4}),
    )
    .await;
    assert_eq!(after.0, 200);
    assert_eq!(
        after.1["choices"][0]["text"],
        before.1["choices"][0]["text"]
    );
    server.stop().await;
}

/// In-memory connections for [`serve_on`]: each pipe sent is one connection.
struct Pipes(tokio::sync::mpsc::UnboundedReceiver<tokio::io::DuplexStream>);

impl Listener for Pipes {
    type Io = tokio::io::DuplexStream;
    type Addr = ();

    async fn accept(&mut self) -> (tokio::io::DuplexStream, ()) {
        match self.0.recv().await {
            Some(c) => (c, ()),
            // No more connections: wait for the shutdown.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sends `req` on a new pipe connection (64 KiB each way, room for any short answer) and
/// reads the whole answer (the server closes after it: `Connection: close`).
async fn pipe_request(
    conns: &tokio::sync::mpsc::UnboundedSender<tokio::io::DuplexStream>,
    req: &str,
) -> Vec<u8> {
    let (mut ours, theirs) = tokio::io::duplex(1 << 16);
    conns.send(theirs).unwrap();
    ours.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    ours.read_to_end(&mut raw).await.unwrap();
    raw
}

/// A raw `POST` of `body` (JSON text, or a value written as JSON) to `path`, with
/// `Connection: close` when `close`.
fn post_text(path: &str, body: &impl std::fmt::Display, close: bool) -> String {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}\r\n{body}",
        body.len(),
        if close { "Connection: close\r\n" } else { "" }
    )
}

/// A client that asks for a long stream and stops reading, keeping its connection, no longer
/// holds it for ever: once its buffer is full and it takes nothing for the write timeout, the
/// connection is closed mid-stream (no `[DONE]`), its request is cancelled (generation stops
/// far short of `max_tokens`), its permit goes to the next connection (one at a time here, so
/// the next request is answered only after the close), the server answers as before and
/// counts the cut, and a graceful shutdown gives a client still reading a stream slowly the
/// write timeout, then closes it (it waited as long as the stream lasted). Connections are
/// in-memory pipes of 4 KiB, so a stream fills one at once (a loopback socket holds
/// megabytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_a_stream_is_cut_after_the_write_timeout() {
    let limits = ConnLimits {
        write_timeout: Duration::from_millis(300),
        max_connections: 1,
        ..ConnLimits::default()
    };
    let tokenizer = Arc::new(Tokenizer::qwen3().unwrap());
    let cfg = sizes();
    let service = Service::start(
        engine(cfg),
        tokenizer.clone(),
        ServiceConfig {
            max_waiting: 8,
            drain: Duration::from_secs(60),
        },
    )
    .unwrap();
    let state = Arc::new(AppState {
        handle: service.handle(),
        tokenizer,
        model: MODEL.into(),
        max_model_len: cfg.max_seq_len,
        created: 0,
        limits,
    });
    let (conns, incoming) = tokio::sync::mpsc::unbounded_channel();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve_on(Pipes(incoming), state, async move {
        let _ = stopped.await;
    }));
    let short = json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4});
    let before =
        parse_response(&pipe_request(&conns, &post_text("/v1/completions", &short, true)).await);
    assert_eq!(before.0, 200, "{}", before.1);
    // 4000 tokens take seconds to generate (~1 ms each here, more on a slower machine); their
    // chunks (~200 bytes each) fill 4 KiB within the first twenty or so, and the write
    // timeout cuts the connection 0.3 s later: the request ends cancelled, not at its limit.
    let (mut stalled, theirs) = tokio::io::duplex(4096);
    conns.send(theirs).unwrap();
    let long = json!({
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 4000,
        "ignore_eos": true,
        "stream": true,
    });
    stalled
        .write_all(post_text("/v1/completions", &long, false).as_bytes())
        .await
        .unwrap();
    // Unread. The next connection is served only once the stalled one has given its permit
    // back (60 s allowed a loaded machine).
    let after = tokio::time::timeout(
        Duration::from_secs(60),
        pipe_request(&conns, &post_text("/v1/completions", &short, true)),
    )
    .await
    .expect("the stalled connection still holds the only permit 60 s later");
    let after = parse_response(&after);
    assert_eq!(after.0, 200, "{}", after.1);
    let text_of =
        |body: &str| serde_json::from_str::<Value>(body).unwrap()["choices"][0]["text"].clone();
    assert_eq!(text_of(&after.1), text_of(&before.1));
    // Reading it now gets what the pipe held, then the close: a cut stream.
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stalled.read_to_end(&mut raw))
        .await
        .expect("the stalled connection is closed")
        .unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.starts_with("HTTP/1.1 200"),
        "{}",
        &text[..text.len().min(200)]
    );
    assert!(text.contains("data: {"), "no chunk was sent");
    assert!(
        !text.contains("[DONE]"),
        "the stream ended normally: it was not cut"
    );
    let metrics = pipe_request(
        &conns,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    let m = parse_response(&metrics).1;
    assert_eq!(
        metric(&m, "simpler_requests_total{finish=\"cancelled\"}"),
        1.0,
        "{m}"
    );
    // Both short requests' 4 tokens, and the cut one's short of its 4000.
    assert!(
        metric(&m, "simpler_generation_tokens_total") < 4008.0,
        "the cut stream's request ran to its limit: {m}"
    );
    assert_eq!(metric(&m, "simpler_connections_cut_total"), 1.0, "{m}");
    // A shutdown while a client reads a long stream a little at a time — enough to pass the
    // write timeout each time, far too little to take it all: once the engine has drained
    // (the stream's 300 tokens generated), the server waits the write timeout for the rest
    // and then closes the connection (it waited for the whole stream to be read).
    let (mut slow, theirs) = tokio::io::duplex(4096);
    conns.send(theirs).unwrap();
    let medium = json!({
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 300,
        "ignore_eos": true,
        "stream": true,
    });
    slow.write_all(post_text("/v1/completions", &medium, false).as_bytes())
        .await
        .unwrap();
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            match slow.read(&mut buf).await {
                Ok(0) | Err(_) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    });
    // The first chunk is out before the stop: the request is in flight.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(60), task)
        .await
        .expect("graceful shutdown returned")
        .unwrap()
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(30), reader)
        .await
        .expect("the slow reader's connection was closed")
        .unwrap();
    let got = String::from_utf8_lossy(&got);
    assert!(got.contains("data: {"), "{}", &got[..got.len().min(200)]);
    assert!(
        !got.contains("[DONE]"),
        "the slow reader got the whole stream: the shutdown waited for it"
    );
    tokio::task::spawn_blocking(move || service.stop())
        .await
        .unwrap()
        .unwrap();
}

/// A client that reads a long stream steadily but slower than it is made is never cut: on
/// TCP the socket reports room each time the client has taken some of the response (the
/// server keeps little unsent in the kernel), so the write timeout sees progress. Before, Linux
/// reported room only once a third of a send buffer autotuned to megabytes had drained, and
/// such a reader was cut within seconds. The served name is 2000 characters, so each chunk is
/// ~2.2 KB and the stream (6+ MB) outgrows the socket buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reading_steadily_slower_than_the_stream_is_not_cut() {
    let limits = ConnLimits {
        write_timeout: Duration::from_secs(1),
        ..ConnLimits::default()
    };
    let name = "m".repeat(2000);
    let server = start_limited(sizes(), 8, &name, Tokenizer::qwen3().unwrap(), limits).await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 << 10).unwrap();
    let mut s = socket.connect(server.addr).await.unwrap();
    let body = json!({
        "model": name,
        "prompt": "Hello",
        "max_tokens": 3000,
        "ignore_eos": true,
        "stream": true,
    })
    .to_string();
    s.write_all(post_text("/v1/completions", &body, true).as_bytes())
        .await
        .unwrap();
    // 64 KiB every 0.1 s at most: ~640 KB/s, slower than the tiny model makes its chunks.
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let read_all = async {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            match s.read(&mut buf).await.unwrap() {
                0 => break,
                n => raw.extend_from_slice(&buf[..n]),
            }
        }
    };
    // ~14 s alone, up to 88 s on a loaded 2-core host: the bound only catches a hang.
    tokio::time::timeout(Duration::from_secs(600), read_all)
        .await
        .expect("the stream ends within 600 s");
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.trim_end().ends_with("0") && text.contains("data: [DONE]"),
        "the steady reader was cut after {} bytes",
        raw.len()
    );
    assert!(
        raw.len() > 6_000_000,
        "{} bytes: the stream is not long enough to outgrow the socket buffers",
        raw.len()
    );
    let (_, m) = http(server.addr, "GET", "/metrics", "").await;
    assert_eq!(metric(&m, "simpler_connections_cut_total"), 0.0, "{m}");
    server.stop().await;
}

/// At most `max_connections` are served at once: the next connection waits (accepted by the
/// kernel, not served) until one closes, then is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_wait_until_one_closes() {
    let limits = ConnLimits {
        max_connections: 2,
        ..ConnLimits::default()
    };
    let server = start_limited(sizes(), 8, MODEL, Tokenizer::qwen3().unwrap(), limits).await;
    let addr = server.addr;
    // Two connections each answered once and kept open: both hold their permits.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(30), c.read(&mut buf))
            .await
            .expect("answered")
            .unwrap();
        assert!(
            String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&buf[..n])
        );
        held.push(c);
    }
    let mut third = TcpStream::connect(addr).await.unwrap();
    third
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    assert!(
        read_until_closed(&mut third, Duration::from_secs(1))
            .await
            .is_none(),
        "a third connection was served beside two open ones"
    );
    drop(held.remove(0));
    let raw = read_until_closed(&mut third, Duration::from_secs(30))
        .await
        .expect("served once a connection closed");
    assert_eq!(parse_response(&raw).0, 200);
    server.stop().await;
}

/// Limits that would serve nothing are refused before anything is served.
#[test]
fn limits_that_serve_nothing_are_refused() {
    let zero_time = ConnLimits {
        read_timeout: Duration::ZERO,
        ..ConnLimits::default()
    };
    assert!(zero_time.check().unwrap_err().contains("read_timeout"));
    let zero_write = ConnLimits {
        write_timeout: Duration::ZERO,
        ..ConnLimits::default()
    };
    assert!(zero_write.check().unwrap_err().contains("write_timeout"));
    let zero_conns = ConnLimits {
        max_connections: 0,
        ..ConnLimits::default()
    };
    assert!(zero_conns.check().unwrap_err().contains("max_connections"));
    assert_eq!(ConnLimits::default().check(), Ok(()));
}

/// A chat template that never ends, or prints without end, fails that request (400, the
/// limit named) instead of holding a core or exhausting memory, and the server goes on:
/// completions and the next chat request answer as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_does_not_end_fails_its_request_and_the_server_goes_on() {
    let endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}";
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_completion_tokens": 2});
    let srv = start_with(sizes(), 8, MODEL, with_template(endless)).await;
    let (status, body) = post(srv.addr, "/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("fuel"),
        "{body}"
    );
    let (status, body) = post(
        srv.addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    srv.stop().await;
    let loud = r#"{% for i in range(1000) %}{% for j in range(1000) %}{{ "x" * 100 }}{% endfor %}{% endfor %}"#;
    let srv = start_with(sizes(), 8, MODEL, with_template(loud)).await;
    let (status, body) = post(srv.addr, "/v1/chat/completions", chat).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("wrote more than"),
        "{body}"
    );
    let (status, _) = post(
        srv.addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    srv.stop().await;
}
