//! The OpenAI request bodies the server accepts, checked field by field.
//!
//! A field that would change the result is either implemented or refused with an error that
//! names it: unknown fields are refused (serde's `deny_unknown_fields`), and fields we know but
//! do not implement are accepted only at their neutral value (`n` 1, penalties 0, no logprobs,
//! no echo). `user` is accepted and ignored: it changes nothing generated.

use serde::Deserialize;
use serde_json::Value;

use crate::chat::ChatMessage;
use crate::text::GenerateConfig;

/// A request the handlers can run: what to tokenize, how to generate, how to answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// The `model` field.
    pub model: String,
    /// The prompt.
    pub input: Input,
    /// Generation settings.
    pub cfg: GenerateConfig,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Send a usage chunk before `[DONE]`.
    pub include_usage: bool,
}

/// The prompt of a job.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// Completion text, tokenized as is.
    Text(String),
    /// Completion token ids.
    Ids(Vec<u32>),
    /// Chat messages, rendered by the chat template.
    Chat {
        /// The conversation.
        messages: Vec<ChatMessage>,
        /// Qwen3's `enable_thinking` (from `chat_template_kwargs`), if given.
        enable_thinking: Option<bool>,
    },
}

/// Bad request: the message names the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FieldError {
    /// What is wrong.
    pub message: String,
    /// The field, where one is to blame.
    pub param: Option<String>,
}

fn bad(param: &str, message: impl Into<String>) -> FieldError {
    FieldError {
        message: message.into(),
        param: Some(param.to_string()),
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<i64>),
    Batch(Vec<Vec<i64>>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct CompletionBody {
    model: String,
    prompt: PromptField,
    #[serde(flatten)]
    common: Common,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<i64>,
}

#[derive(Deserialize)]
struct ChatBody {
    model: String,
    messages: Vec<MessageField>,
    max_completion_tokens: Option<i64>,
    chat_template_kwargs: Option<ChatTemplateKwargs>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatTemplateKwargs {
    enable_thinking: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageField {
    role: String,
    content: Option<ContentField>,
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ContentField {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

/// Fields both endpoints take. (`deny_unknown_fields` does not compose with `flatten` in serde;
/// unknown keys are found by `check_keys` against the lists below instead.)
#[derive(Deserialize)]
struct Common {
    max_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    stop: Option<StopField>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    seed: Option<i64>,
    n: Option<i64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    logit_bias: Option<Value>,
    user: Option<String>,
    ignore_eos: Option<bool>,
}

const COMMON_KEYS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stream",
    "stream_options",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "user",
    "ignore_eos",
];
const COMPLETION_KEYS: &[&str] = &["prompt", "echo", "suffix", "best_of"];
const CHAT_KEYS: &[&str] = &["messages", "max_completion_tokens", "chat_template_kwargs"];

/// Most stop strings a request may give (OpenAI allows 4).
const MAX_STOP: usize = 4;

fn check_keys(body: &Value, endpoint_keys: &[&str]) -> Result<(), FieldError> {
    let Some(map) = body.as_object() else {
        return Err(FieldError {
            message: "the request body must be a JSON object".into(),
            param: None,
        });
    };
    for k in map.keys() {
        if !COMMON_KEYS.contains(&k.as_str()) && !endpoint_keys.contains(&k.as_str()) {
            return Err(bad(k, format!("unsupported field `{k}`")));
        }
    }
    Ok(())
}

fn parse<T: for<'de> Deserialize<'de>>(body: &[u8], keys: &[&str]) -> Result<T, FieldError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| FieldError {
        message: format!("the body is not valid JSON: {e}"),
        param: None,
    })?;
    check_keys(&v, keys)?;
    serde_json::from_value(v).map_err(|e| FieldError {
        message: format!("invalid request: {e}"),
        param: None,
    })
}

/// Parses a `/v1/completions` body.
pub fn completion_job(body: &[u8]) -> Result<Job, FieldError> {
    let b: CompletionBody = parse(body, COMPLETION_KEYS)?;
    if b.echo == Some(true) {
        return Err(bad("echo", "`echo` is not supported"));
    }
    if b.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(bad("suffix", "`suffix` is not supported"));
    }
    if b.best_of.is_some_and(|n| n != 1) {
        return Err(bad("best_of", "`best_of` must be 1"));
    }
    let input = match b.prompt {
        PromptField::Text(t) => Input::Text(t),
        PromptField::Texts(mut t) if t.len() == 1 => Input::Text(t.remove(0)),
        PromptField::Ids(ids) => Input::Ids(ids_field(&ids)?),
        PromptField::Batch(mut b) if b.len() == 1 => Input::Ids(ids_field(&b.remove(0))?),
        PromptField::Texts(_) | PromptField::Batch(_) => {
            return Err(bad(
                "prompt",
                "one prompt per request: send a string or a list of token ids",
            ));
        }
    };
    common(b.model, input, b.common)
}

/// Parses a `/v1/chat/completions` body.
pub fn chat_job(body: &[u8]) -> Result<Job, FieldError> {
    let b: ChatBody = parse(body, CHAT_KEYS)?;
    if b.messages.is_empty() {
        return Err(bad("messages", "`messages` is empty"));
    }
    let mut messages = Vec::with_capacity(b.messages.len());
    for (i, m) in b.messages.into_iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "developer" | "user" | "assistant"
        ) {
            return Err(bad(
                &format!("messages[{i}].role"),
                format!("role `{}` is not supported", m.role),
            ));
        }
        if m.name.is_some() {
            return Err(bad(
                &format!("messages[{i}].name"),
                "message names are not supported",
            ));
        }
        let content = match m.content {
            None => String::new(),
            Some(ContentField::Text(t)) => t,
            Some(ContentField::Parts(parts)) => {
                let mut t = String::new();
                for (j, p) in parts.into_iter().enumerate() {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(s)) => t.push_str(&s),
                        _ => {
                            return Err(bad(
                                &format!("messages[{i}].content[{j}]"),
                                "only text content parts are supported",
                            ));
                        }
                    }
                }
                t
            }
        };
        let role = if m.role == "developer" {
            "system"
        } else {
            &m.role
        };
        messages.push(ChatMessage::new(role, &content));
    }
    let mut common_fields = b.common;
    if let Some(n) = b.max_completion_tokens {
        if common_fields.max_tokens.is_some_and(|m| m != n) {
            return Err(bad(
                "max_completion_tokens",
                "`max_tokens` and `max_completion_tokens` disagree",
            ));
        }
        common_fields.max_tokens = Some(n);
    }
    let enable_thinking = b.chat_template_kwargs.and_then(|k| k.enable_thinking);
    common(
        b.model,
        Input::Chat {
            messages,
            enable_thinking,
        },
        common_fields,
    )
}

/// A random seed (the standard library's per-process random keys, over a counter).
fn fresh_seed() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::collections::hash_map::RandomState::new().hash_one(NEXT.fetch_add(1, Ordering::Relaxed))
}

fn ids_field(ids: &[i64]) -> Result<Vec<u32>, FieldError> {
    if ids.is_empty() {
        return Err(bad("prompt", "the prompt is empty"));
    }
    ids.iter()
        .map(|&i| {
            u32::try_from(i).map_err(|_| bad("prompt", format!("token id {i} is out of range")))
        })
        .collect()
}

fn common(model: String, input: Input, c: Common) -> Result<Job, FieldError> {
    let d = GenerateConfig::default();
    let max_new_tokens = match c.max_tokens {
        None => d.max_new_tokens,
        Some(n) if n >= 1 => usize::try_from(n).unwrap_or(usize::MAX),
        Some(n) => {
            return Err(bad(
                "max_tokens",
                format!("`max_tokens` must be at least 1, not {n}"),
            ));
        }
    };
    let temperature = c.temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad(
            "temperature",
            format!("`temperature` must be in [0, 2], not {temperature}"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(
            "top_p",
            format!("`top_p` must be in (0, 1], not {top_p}"),
        ));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(bad(
                "top_k",
                format!("`top_k` must be positive (or -1), not {k}"),
            ));
        }
    };
    // No seed: a fresh one per request, so sampling differs between requests (OpenAI's
    // semantics); a given seed repeats.
    let seed = match c.seed {
        None => fresh_seed(),
        Some(s) => s as u64,
    };
    let stop = match c.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    if stop.len() > MAX_STOP {
        return Err(bad("stop", format!("at most {MAX_STOP} stop strings")));
    }
    if stop.iter().any(String::is_empty) {
        return Err(bad("stop", "a stop string is empty"));
    }
    if c.n.is_some_and(|n| n != 1) {
        return Err(bad("n", "`n` must be 1"));
    }
    for (name, v) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(bad(name, format!("`{name}` is not supported (only 0)")));
        }
    }
    for (name, v) in [("logprobs", &c.logprobs), ("top_logprobs", &c.top_logprobs)] {
        if v.as_ref()
            .is_some_and(|v| !(v.is_null() || *v == Value::Bool(false)))
        {
            return Err(bad(name, format!("`{name}` is not supported")));
        }
    }
    if c.logit_bias
        .as_ref()
        .is_some_and(|v| !(v.is_null() || v.as_object().is_some_and(|m| m.is_empty())))
    {
        return Err(bad("logit_bias", "`logit_bias` is not supported"));
    }
    let _ = c.user;
    let stream = c.stream.unwrap_or(false);
    let include_usage = match c.stream_options {
        Some(o) if !stream => {
            let _ = o;
            return Err(bad(
                "stream_options",
                "`stream_options` applies only when `stream` is true",
            ));
        }
        Some(o) => o.include_usage.unwrap_or(false),
        None => false,
    };
    Ok(Job {
        model,
        input,
        cfg: GenerateConfig {
            max_new_tokens,
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            seed,
            stop,
            ignore_eos: c.ignore_eos.unwrap_or(false),
        },
        stream,
        include_usage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(r: Result<Job, FieldError>) -> FieldError {
        r.expect_err("an error")
    }

    #[test]
    fn a_completion_body_becomes_a_job() {
        let j = completion_job(
            br#"{"model":"m","prompt":"hi","max_tokens":7,"temperature":0.5,"top_p":0.9,
                "top_k":20,"stop":["x"],"stream":true,"stream_options":{"include_usage":true},
                "seed":3,"n":1,"user":"u","presence_penalty":0}"#,
        )
        .unwrap();
        assert_eq!(j.model, "m");
        assert_eq!(j.input, Input::Text("hi".into()));
        assert_eq!(j.cfg.max_new_tokens, 7);
        assert_eq!(j.cfg.temperature, 0.5);
        assert_eq!(j.cfg.top_k, Some(20));
        assert_eq!(j.cfg.stop, vec!["x".to_string()]);
        assert_eq!(j.cfg.seed, 3);
        assert!(j.stream && j.include_usage);
        let j = completion_job(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(j.input, Input::Ids(vec![1, 2, 3]));
        assert_eq!(j.cfg.max_new_tokens, 256);
        assert_eq!(j.cfg.temperature, 0.0);
        // Without a seed, each request draws its own.
        let other = completion_job(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_ne!(j.cfg.seed, other.cfg.seed);
    }

    #[test]
    fn a_chat_body_becomes_messages() {
        let j = chat_job(
            br#"{"model":"m","messages":[{"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                "max_completion_tokens":5,"chat_template_kwargs":{"enable_thinking":false}}"#,
        )
        .unwrap();
        assert_eq!(
            j.input,
            Input::Chat {
                messages: vec![
                    ChatMessage::new("system", "be brief"),
                    ChatMessage::new("user", "ab")
                ],
                enable_thinking: Some(false)
            }
        );
        assert_eq!(j.cfg.max_new_tokens, 5);
    }

    #[test]
    fn what_would_change_the_result_is_refused_by_name() {
        let cases: &[(&[u8], &str)] = &[
            (
                br#"{"model":"m","prompt":"x","max_tokens":-1}"#,
                "max_tokens",
            ),
            (
                br#"{"model":"m","prompt":"x","max_tokens":0}"#,
                "max_tokens",
            ),
            (br#"{"model":"m","prompt":"x","n":2}"#, "n"),
            (
                br#"{"model":"m","prompt":"x","temperature":3}"#,
                "temperature",
            ),
            (br#"{"model":"m","prompt":"x","top_p":0}"#, "top_p"),
            (br#"{"model":"m","prompt":"x","top_k":-5}"#, "top_k"),
            (br#"{"model":"m","prompt":"x","logprobs":2}"#, "logprobs"),
            (br#"{"model":"m","prompt":"x","echo":true}"#, "echo"),
            (
                br#"{"model":"m","prompt":"x","frequency_penalty":0.5}"#,
                "frequency_penalty",
            ),
            (br#"{"model":"m","prompt":"x","stop":""}"#, "stop"),
            (
                br#"{"model":"m","prompt":"x","stop":["a","b","c","d","e"]}"#,
                "stop",
            ),
            (br#"{"model":"m","prompt":"x","tools":[]}"#, "tools"),
            (br#"{"model":"m","prompt":["a","b"]}"#, "prompt"),
            (br#"{"model":"m","prompt":[-1]}"#, "prompt"),
            (
                br#"{"model":"m","prompt":"x","stream_options":{"include_usage":true}}"#,
                "stream_options",
            ),
        ];
        for (body, field) in cases {
            let e = err(completion_job(body));
            assert_eq!(e.param.as_deref(), Some(*field), "{e:?}");
        }
        let e = err(chat_job(
            br#"{"model":"m","messages":[{"role":"tool","content":"x"}]}"#,
        ));
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = err(chat_job(br#"{"model":"m","messages":[]}"#));
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = err(chat_job(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"prompt":"y"}"#,
        ));
        assert_eq!(e.param.as_deref(), Some("prompt"));
        // Not JSON, not an object, a missing field: errors without a field to blame.
        assert!(err(completion_job(b"{not json")).message.contains("JSON"));
        assert!(err(completion_job(b"[1]")).message.contains("object"));
        assert!(
            err(completion_job(br#"{"prompt":"x"}"#))
                .message
                .contains("model")
        );
    }
}
