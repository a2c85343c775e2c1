//! The OpenAI request bodies the server accepts, checked field by field.
//!
//! A field that would change the result is either implemented or refused with an error that
//! names it: unknown fields are refused, and fields we know but do not implement are accepted
//! only at their neutral value (`n` 1, penalties 0, no logprobs, no echo, `store` false).
//! `user` and `metadata` are accepted (type- and size-checked) and ignored: they change nothing
//! generated.
//!
//! A body is read in two passes, both written here rather than derived with serde:
//!
//! 1. The JSON text becomes a [`Value`], refusing an object that gives a key twice. serde_json
//!    keeps the last value of a repeated key without a word, so `"max_tokens":1,"max_tokens":4`
//!    would run 4 tokens while a reader (or a proxy that reads the first) sees 1.
//! 2. The `Value` is walked field by field (`Obj`). A derived `Deserialize` (even with
//!    `serde_path_to_error` for the path) words its errors in Rust's terms (`expected i64`,
//!    `data did not match any variant of untagged enum StopField`) and, for untagged enums,
//!    throws away which part was wrong. Walking by hand costs a few helpers and lets every
//!    error name the field's JSON path (`messages[0].content`) in `param` and in the message,
//!    and say what was expected in the API's words.

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

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

/// The error for field `param`: its message starts with the field's name (prefixed where the
/// text does not already name it first), as the docs promise clients that show only the
/// message.
/// Whether `message` starts with the field `param`: the name followed by `:` or a space, or
/// the name in backticks.
pub(crate) fn names_first(message: &str, param: &str) -> bool {
    message
        .strip_prefix(param)
        .is_some_and(|rest| rest.starts_with([':', ' ']))
        || message.starts_with(&format!("`{param}`"))
}

fn bad(param: &str, message: impl Into<String>) -> FieldError {
    let message = message.into();
    let named = names_first(&message, param);
    FieldError {
        message: if named {
            message
        } else {
            format!("{param}: {message}")
        },
        param: Some(param.to_string()),
    }
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
    "store",
    "metadata",
];
const COMPLETION_KEYS: &[&str] = &["prompt", "echo", "suffix", "best_of"];
const CHAT_KEYS: &[&str] = &["messages", "max_completion_tokens", "chat_template_kwargs"];

/// Most stop strings a request may give (OpenAI allows 4).
const MAX_STOP: usize = 4;

/// OpenAI's limits on `metadata`: keys, characters of a key, characters of a value.
const METADATA_KEYS: usize = 16;
const METADATA_KEY_CHARS: usize = 64;
const METADATA_VALUE_CHARS: usize = 512;

/// The longest piece of a string value quoted back in an error (a prompt can be megabytes).
const QUOTE_CHARS: usize = 40;

// ---- Pass 1: JSON text to a `Value`, refusing repeated keys. ----

/// One step of a JSON path: an object's key or a list's index.
enum Seg {
    Key(String),
    Index(usize),
}

/// `segs` (outermost first) as `messages[0].content`.
fn path_of(segs: &[Seg]) -> String {
    let mut p = String::new();
    for s in segs {
        match s {
            Seg::Key(k) if p.is_empty() => p.push_str(&short_key(k)),
            Seg::Key(k) => {
                p.push('.');
                p.push_str(&short_key(k));
            }
            Seg::Index(i) => p.push_str(&format!("[{i}]")),
        }
    }
    p
}

/// Builds a `Value` like serde_json's own, but fails on a repeated key. The repeated key's
/// path is collected innermost first while the error unwinds (each level adds its own step),
/// so a body without one (the usual case: prompts of a million token ids) builds no paths.
struct NoRepeats<'a> {
    /// Set where a repeated key was found: its path, innermost step first.
    repeated: &'a RefCell<Option<Vec<Seg>>>,
}

impl NoRepeats<'_> {
    /// Adds `seg` to the repeated key's path if the error unwinding through it is that one.
    fn unwinding(&self, seg: impl FnOnce() -> Seg) {
        if let Some(p) = self.repeated.borrow_mut().as_mut() {
            p.push(seg());
        }
    }
}

impl<'de> DeserializeSeed<'de> for NoRepeats<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        // serde_json's deserializer bounds the nesting (128 levels), so this recursion is
        // bounded too.
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NoRepeats<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::from(n))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::from(n))
    }

    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        Ok(Value::from(n))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        loop {
            let item = NoRepeats {
                repeated: self.repeated,
            };
            match seq.next_element_seed(item) {
                Ok(Some(v)) => out.push(v),
                Ok(None) => return Ok(Value::Array(out)),
                Err(e) => {
                    let i = out.len();
                    self.unwinding(|| Seg::Index(i));
                    return Err(e);
                }
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                *self.repeated.borrow_mut() = Some(vec![Seg::Key(k)]);
                return Err(de::Error::custom("a repeated key"));
            }
            let item = NoRepeats {
                repeated: self.repeated,
            };
            match map.next_value_seed(item) {
                Ok(v) => {
                    out.insert(k, v);
                }
                Err(e) => {
                    self.unwinding(|| Seg::Key(k));
                    return Err(e);
                }
            }
        }
        Ok(Value::Object(out))
    }
}

/// The body as JSON; a repeated key is refused by its path.
fn parse_json(body: &[u8]) -> Result<Value, FieldError> {
    let repeated = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = NoRepeats {
        repeated: &repeated,
    }
    .deserialize(&mut de)
    .and_then(|v| de.end().map(|()| v));
    parsed.map_err(|e| match repeated.into_inner() {
        Some(mut segs) => {
            segs.reverse();
            let p = path_of(&segs);
            bad(&p, format!("`{p}` is given twice; give each field once"))
        }
        None => FieldError {
            message: format!("the body is not valid JSON: {e}"),
            param: None,
        },
    })
}

// ---- Pass 2: the `Value`, field by field. ----

/// `v` in words, for "expected X, got Y" (strings quoted, and cut short).
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {}", quote(s)),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// `s` as a JSON string, cut after `QUOTE_CHARS` characters.
/// A key as a path segment: cut to [`QUOTE_CHARS`] characters, so an error never echoes a
/// huge key back.
fn short_key(k: &str) -> String {
    let short: String = k.chars().take(QUOTE_CHARS).collect();
    if short.len() < k.len() {
        format!("{short}...")
    } else {
        short
    }
}

fn quote(s: &str) -> String {
    let short: String = s.chars().take(QUOTE_CHARS).collect();
    let more = if short.len() < s.len() { "..." } else { "" };
    format!("{}{more}", Value::String(short))
}

/// The error for a value of the wrong kind at `path`.
fn expected(path: &str, what: &str, got: &Value) -> FieldError {
    bad(
        path,
        format!("{path}: expected {what}, got {}", describe(got)),
    )
}

/// `v` as an integer (any JSON integer fits an `i128`); `None` for anything else, `1.0`
/// included: a field that counts takes whole numbers only.
fn integer(v: &Value) -> Option<i128> {
    v.as_i64()
        .map(i128::from)
        .or_else(|| v.as_u64().map(i128::from))
}

/// A JSON object of the body with its path, for reading fields by name.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    /// `""` for the body itself.
    path: String,
}

impl<'a> Obj<'a> {
    /// `v` at `path` as an object.
    fn new(v: &'a Value, path: &str, what: &str) -> Result<Obj<'a>, FieldError> {
        match v.as_object() {
            Some(map) => Ok(Obj {
                map,
                path: path.to_string(),
            }),
            None if path.is_empty() => Err(FieldError {
                message: format!(
                    "the request body must be a JSON object, not {}",
                    describe(v)
                ),
                param: None,
            }),
            None => Err(expected(path, what, v)),
        }
    }

    fn path(&self, key: &str) -> String {
        let key = short_key(key);
        if self.path.is_empty() {
            key
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// Refuses a key not in `allowed` (the first in key order: the parsed object keeps its
    /// keys sorted, not in the body's order).
    fn only(&self, allowed: &[&[&str]]) -> Result<(), FieldError> {
        match self
            .map
            .keys()
            .find(|k| !allowed.iter().any(|a| a.contains(&k.as_str())))
        {
            Some(k) => {
                let p = self.path(k);
                Err(bad(&p, format!("{p}: unsupported field")))
            }
            None => Ok(()),
        }
    }

    /// The field's value; `None` when absent or null (OpenAI's clients send null for "not
    /// given").
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn required(&self, key: &str) -> Result<&'a Value, FieldError> {
        self.get(key).ok_or_else(|| {
            let p = self.path(key);
            let what = if self.map.contains_key(key) {
                "may not be null"
            } else {
                "is required"
            };
            bad(&p, format!("`{p}` {what}"))
        })
    }

    fn int(&self, key: &str) -> Result<Option<i128>, FieldError> {
        self.get(key)
            .map(|v| {
                integer(v).ok_or_else(|| {
                    let path = self.path(key);
                    // JSON integers past 64 bits reach here as floats (serde_json reads them
                    // so): say that, not "got the number 1.8446744073709552e19".
                    match v.as_f64() {
                        Some(f) if f.fract() == 0.0 && f.abs() >= 9.2e18 => bad(
                            &path,
                            format!("{path}: an integer out of range (64 bits at most)"),
                        ),
                        _ => expected(&path, "an integer", v),
                    }
                })
            })
            .transpose()
    }

    fn number(&self, key: &str) -> Result<Option<f64>, FieldError> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| expected(&self.path(key), "a number", v))
            })
            .transpose()
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>, FieldError> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| expected(&self.path(key), "true or false", v))
            })
            .transpose()
    }

    fn string(&self, key: &str) -> Result<Option<&'a str>, FieldError> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| expected(&self.path(key), "a string", v))
            })
            .transpose()
    }

    fn object(&self, key: &str) -> Result<Option<Obj<'a>>, FieldError> {
        self.get(key)
            .map(|v| Obj::new(v, &self.path(key), "an object"))
            .transpose()
    }
}

/// Fields both endpoints take.
struct Common {
    max_tokens: Option<i128>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i128>,
    stop: Vec<String>,
    /// `stop` was given as a list (an error names `stop[i]`), not as one string.
    stop_was_list: bool,
    stream: bool,
    include_usage: Option<bool>,
    seed: Option<i128>,
    n: Option<i128>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    ignore_eos: bool,
}

/// Reads (and checks the kinds of) the fields both endpoints take.
fn read_common(b: &Obj) -> Result<Common, FieldError> {
    let stop = match b.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| expected(&format!("stop[{i}]"), "a string", v))
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(expected("stop", "a string or a list of strings", v)),
    };
    let stop_was_list = matches!(b.get("stop"), Some(Value::Array(_)));
    let stream_options = b.object("stream_options")?;
    let include_usage = match &stream_options {
        Some(o) => {
            o.only(&[&["include_usage"]])?;
            Some(o.boolean("include_usage")?.unwrap_or(false))
        }
        None => None,
    };
    for key in ["logprobs", "top_logprobs"] {
        // Off is null or false (chat's `logprobs` is a boolean, the completions' a count).
        if b.get(key).is_some_and(|v| *v != Value::Bool(false)) {
            return Err(bad(key, format!("`{key}` is not supported")));
        }
    }
    if b.get("logit_bias")
        .is_some_and(|v| v.as_object().is_none_or(|m| !m.is_empty()))
    {
        return Err(bad("logit_bias", "`logit_bias` is not supported"));
    }
    // Checked for its kind, then ignored: an end-user id changes nothing generated.
    b.string("user")?;
    if b.boolean("store")? == Some(true) {
        return Err(bad(
            "store",
            "`store`: this server keeps no completions; give false or leave it out",
        ));
    }
    metadata(b)?;
    Ok(Common {
        max_tokens: b.int("max_tokens")?,
        temperature: b.number("temperature")?,
        top_p: b.number("top_p")?,
        top_k: b.int("top_k")?,
        stop,
        stop_was_list,
        stream: b.boolean("stream")?.unwrap_or(false),
        include_usage,
        seed: b.int("seed")?,
        n: b.int("n")?,
        presence_penalty: b.number("presence_penalty")?,
        frequency_penalty: b.number("frequency_penalty")?,
        ignore_eos: b.boolean("ignore_eos")?.unwrap_or(false),
    })
}

/// Checks `metadata` against OpenAI's limits. It only labels a stored completion, and this
/// server stores none, so a valid one changes nothing; an invalid one is refused as OpenAI
/// would refuse it, so a request that works here works there.
fn metadata(b: &Obj) -> Result<(), FieldError> {
    let Some(m) = b.object("metadata")? else {
        return Ok(());
    };
    if m.map.len() > METADATA_KEYS {
        return Err(bad(
            "metadata",
            format!(
                "`metadata` has {} keys; at most {METADATA_KEYS}",
                m.map.len()
            ),
        ));
    }
    for (k, v) in m.map {
        if k.chars().count() > METADATA_KEY_CHARS {
            return Err(bad(
                "metadata",
                format!(
                    "`metadata`: the key {} is over {METADATA_KEY_CHARS} characters",
                    quote(k)
                ),
            ));
        }
        let p = m.path(k);
        match v.as_str() {
            Some(s) if s.chars().count() > METADATA_VALUE_CHARS => {
                return Err(bad(
                    &p,
                    format!("`{p}` is over {METADATA_VALUE_CHARS} characters"),
                ));
            }
            Some(_) => {}
            None => return Err(expected(&p, "a string", v)),
        }
    }
    Ok(())
}

/// The body, checked to be an object with no key outside `endpoint_keys` and the common ones.
fn body_object<'a>(v: &'a Value, endpoint_keys: &[&str]) -> Result<Obj<'a>, FieldError> {
    let b = Obj::new(v, "", "an object")?;
    b.only(&[COMMON_KEYS, endpoint_keys])?;
    Ok(b)
}

/// Parses a `/v1/completions` body.
pub fn completion_job(body: &[u8]) -> Result<Job, FieldError> {
    let v = parse_json(body)?;
    let b = body_object(&v, COMPLETION_KEYS)?;
    let model = model_field(&b)?;
    let input = prompt_field(b.required("prompt")?)?;
    if b.boolean("echo")? == Some(true) {
        return Err(bad("echo", "`echo` is not supported"));
    }
    if b.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(bad("suffix", "`suffix` is not supported"));
    }
    if b.int("best_of")?.is_some_and(|n| n != 1) {
        return Err(bad("best_of", "`best_of` must be 1"));
    }
    let c = read_common(&b)?;
    common(model, input, c)
}

fn model_field(b: &Obj) -> Result<String, FieldError> {
    let v = b.required("model")?;
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| expected("model", "a string", v))
}

/// `prompt`: a string, or token ids — each either alone or as a list of one.
fn prompt_field(v: &Value) -> Result<Input, FieldError> {
    const WHAT: &str = "a string or a list of token ids";
    let one_prompt = || {
        bad(
            "prompt",
            "one prompt per request: send a string or a list of token ids",
        )
    };
    let items = match v {
        Value::String(s) => return Ok(Input::Text(s.clone())),
        Value::Array(items) => items,
        other => return Err(expected("prompt", WHAT, other)),
    };
    match items.as_slice() {
        [] => Err(bad("prompt", "the prompt is empty")),
        [Value::String(s)] => Ok(Input::Text(s.clone())),
        [Value::Array(ids)] => Ok(Input::Ids(ids_field(ids, "prompt[0]")?)),
        [Value::Number(_), ..] => Ok(Input::Ids(ids_field(items, "prompt")?)),
        [Value::String(_) | Value::Array(_), ..] => Err(one_prompt()),
        [other, ..] => Err(expected(
            "prompt[0]",
            "a string, a token id or a list of token ids",
            other,
        )),
    }
}

/// Token ids at `path`, each within `u32`.
fn ids_field(ids: &[Value], path: &str) -> Result<Vec<u32>, FieldError> {
    if ids.is_empty() {
        return Err(bad("prompt", "the prompt is empty"));
    }
    // The element's path is made only for an error: a prompt can hold ~10^6 ids.
    ids.iter()
        .enumerate()
        .map(|(i, v)| {
            let p = || format!("{path}[{i}]");
            let n = integer(v).ok_or_else(|| expected(&p(), "a token id (an integer)", v))?;
            u32::try_from(n).map_err(|_| {
                let p = p();
                bad(&p, format!("{p}: token id {n} is out of range"))
            })
        })
        .collect()
}

/// Parses a `/v1/chat/completions` body.
pub fn chat_job(body: &[u8]) -> Result<Job, FieldError> {
    let v = parse_json(body)?;
    let b = body_object(&v, CHAT_KEYS)?;
    let model = model_field(&b)?;
    let list = b.required("messages")?;
    let Some(list) = list.as_array() else {
        return Err(expected("messages", "a list of messages", list));
    };
    if list.is_empty() {
        return Err(bad("messages", "`messages` is empty"));
    }
    let messages = list
        .iter()
        .enumerate()
        .map(|(i, m)| message(m, i))
        .collect::<Result<Vec<_>, _>>()?;
    let max_completion_tokens = b.int("max_completion_tokens")?;
    let enable_thinking = match b.object("chat_template_kwargs")? {
        Some(k) => {
            k.only(&[&["enable_thinking"]])?;
            k.boolean("enable_thinking")?
        }
        None => None,
    };
    let mut c = read_common(&b)?;
    if let Some(n) = max_completion_tokens {
        if n < 1 {
            return Err(bad(
                "max_completion_tokens",
                format!("`max_completion_tokens` must be at least 1, not {n}"),
            ));
        }
        if c.max_tokens.is_some_and(|m| m != n) {
            return Err(bad(
                "max_completion_tokens",
                "`max_tokens` and `max_completion_tokens` disagree",
            ));
        }
        c.max_tokens = Some(n);
    }
    common(
        model,
        Input::Chat {
            messages,
            enable_thinking,
        },
        c,
    )
}

/// `messages[i]`.
fn message(v: &Value, i: usize) -> Result<ChatMessage, FieldError> {
    let m = Obj::new(v, &format!("messages[{i}]"), "a message (an object)")?;
    // `tool_calls`, `tool_call_id`, `refusal`, `audio`, ... are refused here by name, as the
    // `tools` that would produce them are at the top.
    m.only(&[&["role", "content", "name"]])?;
    let role_path = m.path("role");
    let role = m
        .string("role")?
        .ok_or_else(|| bad(&role_path, format!("`{role_path}` is required")))?;
    if !matches!(role, "system" | "developer" | "user" | "assistant") {
        return Err(bad(
            &role_path,
            format!("`{role_path}`: role `{role}` is not supported"),
        ));
    }
    if m.get("name").is_some() {
        let p = m.path("name");
        return Err(bad(&p, format!("`{p}`: message names are not supported")));
    }
    // Every role needs content. OpenAI lets an assistant message leave it out only when it
    // carries `tool_calls`, which this server refuses (above); without them such a message
    // would be rendered as an empty turn the client never wrote.
    let content_path = m.path("content");
    let content = match m.get("content") {
        None => {
            let how = if m.map.contains_key("content") {
                "null"
            } else {
                "missing"
            };
            return Err(bad(
                &content_path,
                format!(
                    "`{content_path}` is {how}: every message needs content (a string or a list of text parts)"
                ),
            ));
        }
        Some(Value::String(t)) => t.clone(),
        // Text parts joined by a newline, as vLLM, SGLang and TensorRT-LLM join them, so a
        // client moving between servers sends the model the same prompt.
        Some(Value::Array(parts)) => {
            if parts.is_empty() {
                return Err(bad(
                    &content_path,
                    format!(
                        "`{content_path}` is an empty list: give a string or at least one text part"
                    ),
                ));
            }
            let texts = parts
                .iter()
                .enumerate()
                .map(|(j, p)| text_part(p, &format!("{content_path}[{j}]")))
                .collect::<Result<Vec<_>, _>>()?;
            texts.join("\n")
        }
        Some(other) => {
            return Err(expected(
                &content_path,
                "a string or a list of text parts",
                other,
            ));
        }
    };
    let role = if role == "developer" { "system" } else { role };
    Ok(ChatMessage::new(role, &content))
}

/// One content part at `path`: `{"type": "text", "text": ...}`.
fn text_part(v: &Value, path: &str) -> Result<String, FieldError> {
    let p = Obj::new(v, path, "a content part (an object)")?;
    let kind_path = p.path("type");
    let kind = p
        .string("type")?
        .ok_or_else(|| bad(&kind_path, format!("`{kind_path}` is required")))?;
    if kind != "text" {
        return Err(bad(
            &kind_path,
            format!(
                "`{kind_path}`: only text content parts are supported, not {}",
                quote(kind)
            ),
        ));
    }
    p.only(&[&["type", "text"]])?;
    let t = p.required("text")?;
    t.as_str()
        .map(str::to_string)
        .ok_or_else(|| expected(&p.path("text"), "a string", t))
}

/// A random seed (the standard library's per-process random keys, over a counter).
fn fresh_seed() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::collections::hash_map::RandomState::new().hash_one(NEXT.fetch_add(1, Ordering::Relaxed))
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
    // Absent: greedy, not OpenAI's 1.0. Kept on purpose: it is the library's and `simpler
    // generate`'s default, so the same prompt gives the same text everywhere, and without a
    // seed a sampled default would give a different text on every call. docs/serving.md says
    // so where it lists the fields.
    let temperature = c.temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad(
            "temperature",
            format!("`temperature` must be in [0, 2], not {temperature}"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    // Checked as the engine holds it (32 bits): a value that rounds to 0 there is refused here,
    // naming the field and the value sent.
    if !(top_p > 0.0 && top_p <= 1.0 && top_p as f32 > 0.0) {
        return Err(bad(
            "top_p",
            format!("`top_p` must be in (0, 1] (and at least ~1.4e-45), not {top_p}"),
        ));
    }
    // 0 and -1 both mean no limit, as in vLLM (whose clients send either).
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(bad(
                "top_k",
                format!("`top_k` must be a positive integer, or 0 or -1 for no limit, not {k}"),
            ));
        }
    };
    // A limit on the draws without `temperature` would do nothing here (absent means greedy,
    // where OpenAI's absent means 1): the client most likely counts on sampling, so it is told
    // rather than answered greedily. With `temperature` given (0 included) it is taken as is.
    if c.temperature.is_none() {
        let limited = [("top_p", top_p < 1.0), ("top_k", top_k.is_some())];
        if let Some((field, _)) = limited.into_iter().find(|(_, set)| *set) {
            return Err(bad(
                field,
                format!(
                    "`{field}` limits sampling, but without `temperature` this server decodes \
                     greedily (its default is 0, not OpenAI's 1): give `temperature` (e.g. 1 to \
                     sample as OpenAI's default does) or leave `{field}` out"
                ),
            ));
        }
    }
    // No seed: a fresh one per request, so sampling differs between requests (OpenAI's
    // semantics); a given seed fixes the draws. A negative seed is taken as its two's
    // complement, so every integer from -2^63 to 2^64-1 is a seed.
    let seed = match c.seed {
        None => fresh_seed(),
        Some(s) => match (u64::try_from(s), i64::try_from(s)) {
            (Ok(u), _) => u,
            (Err(_), Ok(i)) => i as u64,
            (Err(_), Err(_)) => {
                return Err(bad(
                    "seed",
                    format!("`seed` must be within 64 bits, not {s}"),
                ));
            }
        },
    };
    let stop = c.stop;
    if stop.len() > MAX_STOP {
        return Err(bad("stop", format!("at most {MAX_STOP} stop strings")));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        // `stop` as one string is the list of that string.
        let p = if c.stop_was_list {
            format!("stop[{i}]")
        } else {
            "stop".to_string()
        };
        return Err(bad(&p, format!("`{p}`: a stop string is empty")));
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
    let stream = c.stream;
    let include_usage = match c.include_usage {
        Some(_) if !stream => {
            return Err(bad(
                "stream_options",
                "`stream_options` applies only when `stream` is true",
            ));
        }
        Some(u) => u,
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
            ignore_eos: c.ignore_eos,
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

    /// The messages a chat body becomes, with no `enable_thinking`.
    fn chat_of(body: &[u8], messages: &[(&str, &str)]) {
        let j = chat_job(body).unwrap();
        let want: Vec<ChatMessage> = messages
            .iter()
            .map(|&(role, content)| ChatMessage::new(role, content))
            .collect();
        assert_eq!(
            j.input,
            Input::Chat {
                messages: want,
                enable_thinking: None
            }
        );
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
        // Sampling limits that limit nothing need no `temperature`; with one given (0
        // included) a limit is taken as is.
        for body in [
            &br#"{"model":"m","prompt":"x","top_p":1,"top_k":0}"#[..],
            br#"{"model":"m","prompt":"x","top_k":-1,"seed":5}"#,
            br#"{"model":"m","prompt":"x","temperature":0,"top_p":0.5,"top_k":3}"#,
        ] {
            let j = completion_job(body).unwrap();
            assert_eq!(j.cfg.temperature, 0.0);
        }
        let j =
            completion_job(br#"{"model":"m","prompt":"x","temperature":1,"top_p":0.5}"#).unwrap();
        assert_eq!((j.cfg.temperature, j.cfg.top_p), (1.0, 0.5));
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
                    ChatMessage::new("user", "a\nb")
                ],
                enable_thinking: Some(false)
            }
        );
        assert_eq!(j.cfg.max_new_tokens, 5);
        // Both given, agreeing: taken.
        let j = chat_job(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":5}"#,
        )
        .unwrap();
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
            // Sampling limits without `temperature` (greedy here).
            (br#"{"model":"m","prompt":"x","top_p":0.5}"#, "top_p"),
            (br#"{"model":"m","prompt":"x","top_k":40}"#, "top_k"),
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
            (br#"{"model":"m","prompt":[-1]}"#, "prompt[0]"),
            (br#"{"model":"m","prompt":[1,2,4294967296]}"#, "prompt[2]"),
            (br#"{"model":"m","prompt":"x","stop":["a",""]}"#, "stop[1]"),
            (
                br#"{"model":"m","prompt":"x","stream_options":{"include_usage":true}}"#,
                "stream_options",
            ),
            (br#"{"model":"m","prompt":"x","suffix":"a"}"#, "suffix"),
            (br#"{"model":"m","prompt":"x","best_of":2}"#, "best_of"),
            (
                br#"{"model":"m","prompt":"x","presence_penalty":0.5}"#,
                "presence_penalty",
            ),
            (
                br#"{"model":"m","prompt":"x","logit_bias":{"5":1}}"#,
                "logit_bias",
            ),
            (
                br#"{"model":"m","prompt":"x","top_logprobs":2}"#,
                "top_logprobs",
            ),
            (br#"{"model":"m","prompt":[]}"#, "prompt"),
            (br#"{"model":"m","prompt":[[]]}"#, "prompt"),
            (br#"{"model":"m","prompt":[null]}"#, "prompt[0]"),
            (
                br#"{"model":"m","prompt":"x","temperature":-0.5}"#,
                "temperature",
            ),
            (
                br#"{"model":"m","prompt":"x","temperature":1,"top_p":1.5}"#,
                "top_p",
            ),
            // Above 0 as sent, 0 in the engine's 32 bits.
            (
                br#"{"model":"m","prompt":"x","temperature":1,"top_p":1e-46}"#,
                "top_p",
            ),
            (
                br#"{"model":"m","prompt":"x","stream":true,"stream_options":{"x":1}}"#,
                "stream_options.x",
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
        let user = r#""messages":[{"role":"user","content":"x"}]"#;
        for (rest, field) in [
            (
                r#","max_tokens":3,"max_completion_tokens":4"#,
                "max_completion_tokens",
            ),
            (
                r#","chat_template_kwargs":{"foo":true}"#,
                "chat_template_kwargs.foo",
            ),
        ] {
            let body = format!(r#"{{"model":"m",{user}{rest}}}"#);
            let e = err(chat_job(body.as_bytes()));
            assert_eq!(e.param.as_deref(), Some(field), "{rest}: {e:?}");
        }
        for (messages, field) in [
            (
                r#"[{"role":"user","content":"x","name":"n"}]"#,
                "messages[0].name",
            ),
            (
                r#"[{"role":"user","content":[{"text":"x"}]}]"#,
                "messages[0].content[0].type",
            ),
            (r#"[{"role":"user","content":[]}]"#, "messages[0].content"),
            (
                r#"[{"role":"user","content":[{"type":"text","text":"x","x":1}]}]"#,
                "messages[0].content[0].x",
            ),
        ] {
            let body = format!(r#"{{"model":"m","messages":{messages}}}"#);
            let e = err(chat_job(body.as_bytes()));
            assert_eq!(e.param.as_deref(), Some(field), "{messages}: {e:?}");
        }
        // `developer` is OpenAI's newer name for `system`.
        chat_of(
            br#"{"model":"m","messages":[{"role":"developer","content":"a"},{"role":"user","content":"b"}]}"#,
            &[("system", "a"), ("user", "b")],
        );
        // The field the value came from, not the one it feeds.
        let e = err(chat_job(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}"#,
        ));
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"), "{e:?}");
        // A huge key or content-part type is not echoed back whole.
        let long = "k".repeat(100_000);
        let body = format!(r#"{{"model":"m","prompt":"x","{long}":1,"{long}":2}}"#);
        let e = err(completion_job(body.as_bytes()));
        assert!(
            e.message.len() < 1000 && e.message.contains("twice"),
            "{}",
            e.message.len()
        );
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"{long}"}}]}}]}}"#
        );
        let e = err(chat_job(body.as_bytes()));
        assert!(e.message.len() < 1000, "{}", e.message.len());
        let body = format!(r#"{{"model":"m","prompt":"x","{long}":1}}"#);
        let e = err(completion_job(body.as_bytes()));
        assert!(
            e.message.len() < 1000 && e.message.contains("unsupported"),
            "{}",
            e.message
        );
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

    /// The chat body with `messages` and the extra top-level fields `rest` (JSON text).
    fn chat(messages: &str, rest: &str) -> Vec<u8> {
        format!(r#"{{"model":"m","messages":{messages}{rest}}}"#).into_bytes()
    }

    const HI: &str = r#"[{"role":"user","content":"hi"}]"#;

    #[test]
    fn a_field_of_the_wrong_kind_is_named_in_users_words() {
        let text_prompt = |rest: &str| format!(r#"{{"model":"m","prompt":"x"{rest}}}"#);
        // (body, completions or chat, param, message)
        let cases: Vec<(Vec<u8>, bool, &str, &str)> = vec![
            (
                text_prompt(r#","max_tokens":"2""#).into_bytes(),
                true,
                "max_tokens",
                r#"max_tokens: expected an integer, got the string "2""#,
            ),
            (
                text_prompt(r#","max_tokens":2.0"#).into_bytes(),
                true,
                "max_tokens",
                "max_tokens: expected an integer, got the number 2.0",
            ),
            // Past 64 bits JSON integers arrive as floats: said as such.
            (
                text_prompt(r#","seed":18446744073709551616"#).into_bytes(),
                true,
                "seed",
                "seed: an integer out of range (64 bits at most)",
            ),
            // Every message starts with the field it names.
            (
                text_prompt(r#","stop":["a","b","c","d","e"]"#).into_bytes(),
                true,
                "stop",
                "stop: at most 4 stop strings",
            ),
            (
                br#"{"model":"m","prompt":[]}"#.to_vec(),
                true,
                "prompt",
                "prompt: the prompt is empty",
            ),
            (
                text_prompt(r#","temperature":"hot""#).into_bytes(),
                true,
                "temperature",
                r#"temperature: expected a number, got the string "hot""#,
            ),
            (
                text_prompt(r#","stream":"yes""#).into_bytes(),
                true,
                "stream",
                r#"stream: expected true or false, got the string "yes""#,
            ),
            (
                text_prompt(r#","seed":1.5"#).into_bytes(),
                true,
                "seed",
                "seed: expected an integer, got the number 1.5",
            ),
            (
                text_prompt(r#","stop":5"#).into_bytes(),
                true,
                "stop",
                "stop: expected a string or a list of strings, got the number 5",
            ),
            (
                text_prompt(r#","stop":["a",7]"#).into_bytes(),
                true,
                "stop[1]",
                "stop[1]: expected a string, got the number 7",
            ),
            (
                text_prompt(r#","stream":true,"stream_options":{"include_usage":1}"#).into_bytes(),
                true,
                "stream_options.include_usage",
                "stream_options.include_usage: expected true or false, got the number 1",
            ),
            (
                text_prompt(r#","user":5"#).into_bytes(),
                true,
                "user",
                "user: expected a string, got the number 5",
            ),
            (
                br#"{"model":7,"prompt":"x"}"#.to_vec(),
                true,
                "model",
                "model: expected a string, got the number 7",
            ),
            (
                br#"{"model":"m","prompt":{}}"#.to_vec(),
                true,
                "prompt",
                "prompt: expected a string or a list of token ids, got an object",
            ),
            (
                br#"{"model":"m","prompt":[1,"a"]}"#.to_vec(),
                true,
                "prompt[1]",
                r#"prompt[1]: expected a token id (an integer), got the string "a""#,
            ),
            (
                br#"{"model":"m","prompt":[[1,2.5]]}"#.to_vec(),
                true,
                "prompt[0][1]",
                "prompt[0][1]: expected a token id (an integer), got the number 2.5",
            ),
            (
                chat(r#""hi""#, ""),
                false,
                "messages",
                r#"messages: expected a list of messages, got the string "hi""#,
            ),
            (
                chat("[3]", ""),
                false,
                "messages[0]",
                "messages[0]: expected a message (an object), got the number 3",
            ),
            (
                chat(r#"[{"role":1,"content":"x"}]"#, ""),
                false,
                "messages[0].role",
                "messages[0].role: expected a string, got the number 1",
            ),
            (
                chat(r#"[{"role":"user","content":5}]"#, ""),
                false,
                "messages[0].content",
                "messages[0].content: expected a string or a list of text parts, got the number 5",
            ),
            (
                chat(
                    r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]"#,
                    "",
                ),
                false,
                "messages[0].content[0].type",
                "`messages[0].content[0].type`: only text content parts are supported, not \"image_url\"",
            ),
            (
                chat(
                    r#"[{"role":"user","content":[{"type":"text","text":true}]}]"#,
                    "",
                ),
                false,
                "messages[0].content[0].text",
                "messages[0].content[0].text: expected a string, got true",
            ),
            (
                chat(
                    r#"[{"role":"assistant","content":"x","tool_calls":[]}]"#,
                    "",
                ),
                false,
                "messages[0].tool_calls",
                "messages[0].tool_calls: unsupported field",
            ),
            (
                chat(HI, r#","chat_template_kwargs":{"enable_thinking":"no"}"#),
                false,
                "chat_template_kwargs.enable_thinking",
                r#"chat_template_kwargs.enable_thinking: expected true or false, got the string "no""#,
            ),
            (
                chat(HI, r#","chat_template_kwargs":{"thinking":false}"#),
                false,
                "chat_template_kwargs.thinking",
                "chat_template_kwargs.thinking: unsupported field",
            ),
            (
                chat(HI, r#","max_completion_tokens":"5""#),
                false,
                "max_completion_tokens",
                r#"max_completion_tokens: expected an integer, got the string "5""#,
            ),
        ];
        for (body, completion, param, message) in cases {
            let e = err(if completion {
                completion_job(&body)
            } else {
                chat_job(&body)
            });
            let body = String::from_utf8_lossy(&body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
            assert_eq!(e.message, message, "{body}");
            for rust in ["i64", "f64", "bool", "enum", "variant", "struct"] {
                assert!(!e.message.contains(rust), "{body}: {e:?}");
            }
        }
        // A long string is quoted cut short.
        let long = "y".repeat(10_000);
        let e = err(completion_job(
            format!(r#"{{"model":"m","prompt":"x","n":"{long}"}}"#).as_bytes(),
        ));
        assert!(e.message.len() < 100, "{e:?}");
    }

    #[test]
    fn a_key_given_twice_is_refused_by_its_path() {
        let cases: &[(&[u8], &str)] = &[
            (
                br#"{"model":"m","prompt":"x","max_tokens":1,"max_tokens":4}"#,
                "max_tokens",
            ),
            (br#"{"model":"m","model":"m","prompt":"x"}"#, "model"),
            (
                br#"{"model":"m","prompt":"x","stream":true,
                    "stream_options":{"include_usage":true,"include_usage":false}}"#,
                "stream_options.include_usage",
            ),
            (
                br#"{"model":"m","prompt":"x","metadata":{"a":"1","a":"2"}}"#,
                "metadata.a",
            ),
        ];
        for (body, param) in cases {
            let e = err(completion_job(body));
            assert_eq!(e.param.as_deref(), Some(*param), "{e:?}");
            assert!(
                e.message.contains(param) && e.message.contains("twice"),
                "{e:?}"
            );
        }
        let chats: &[(&[u8], &str)] = &[
            (
                br#"{"model":"m","messages":[{"role":"user","content":"a"},
                    {"role":"user","content":"b","content":"c"}]}"#,
                "messages[1].content",
            ),
            (
                br#"{"model":"m","messages":[{"role":"user","content":
                    [{"type":"text","text":"a"},{"type":"text","text":"b","text":"c"}]}]}"#,
                "messages[0].content[1].text",
            ),
            (
                br#"{"model":"m","messages":[{"role":"user","content":"a"}],
                    "messages":[{"role":"user","content":"b"}]}"#,
                "messages",
            ),
        ];
        for (body, param) in chats {
            let e = err(chat_job(body));
            assert_eq!(e.param.as_deref(), Some(*param), "{e:?}");
        }
        // The same key in different objects is no repeat.
        chat_of(
            br#"{"model":"m","messages":[{"role":"system","content":"a"},
                {"role":"user","content":[{"type":"text","text":"b"},{"type":"text","text":"c"}]}]}"#,
            &[("system", "a"), ("user", "b\nc")],
        );
        // Broken JSON is still a JSON error, with no field to blame.
        let e = err(completion_job(br#"{"model":"m","prompt":"x","#));
        assert!(
            e.message.contains("not valid JSON") && e.param.is_none(),
            "{e:?}"
        );
    }

    #[test]
    fn top_k_zero_and_minus_one_mean_no_limit() {
        let top_k = |k: &str| {
            completion_job(
                format!(r#"{{"model":"m","prompt":"x","temperature":1,"top_k":{k}}}"#).as_bytes(),
            )
        };
        assert_eq!(top_k("0").unwrap().cfg.top_k, None);
        assert_eq!(top_k("-1").unwrap().cfg.top_k, None);
        assert_eq!(top_k("null").unwrap().cfg.top_k, None);
        assert_eq!(top_k("5").unwrap().cfg.top_k, Some(5));
        let e = err(top_k("-5"));
        assert_eq!(e.param.as_deref(), Some("top_k"));
        assert!(e.message.contains("0 or -1"), "{e:?}");
    }

    #[test]
    fn every_message_needs_content() {
        for (messages, param, how) in [
            (r#"[{"role":"user"}]"#, "messages[0].content", "missing"),
            (
                r#"[{"role":"system","content":null},{"role":"user","content":"x"}]"#,
                "messages[0].content",
                "null",
            ),
            (
                r#"[{"role":"user","content":"x"},{"role":"assistant","content":null}]"#,
                "messages[1].content",
                "null",
            ),
            (r#"[{"content":"x"}]"#, "messages[0].role", "required"),
        ] {
            let e = err(chat_job(&chat(messages, "")));
            assert_eq!(e.param.as_deref(), Some(param), "{messages}: {e:?}");
            assert!(
                e.message.contains(param) && e.message.contains(how),
                "{e:?}"
            );
        }
        // Empty text is content.
        let j = chat_job(&chat(r#"[{"role":"user","content":""}]"#, "")).unwrap();
        assert_eq!(
            j.input,
            Input::Chat {
                messages: vec![ChatMessage::new("user", "")],
                enable_thinking: None
            }
        );
    }

    #[test]
    fn store_false_and_metadata_are_accepted_and_change_nothing() {
        let plain = chat_job(&chat(HI, r#","seed":1"#)).unwrap();
        for rest in [
            r#","store":false"#,
            r#","store":null"#,
            r#","metadata":{}"#,
            r#","metadata":null"#,
            r#","store":false,"metadata":{"team":"a","run":"7"}"#,
        ] {
            let j = chat_job(&chat(HI, &format!(r#","seed":1{rest}"#))).unwrap();
            assert_eq!(j, plain, "{rest}");
        }
        let many: Vec<String> = (0..17).map(|i| format!(r#""k{i}":"v""#)).collect();
        let long_key = "k".repeat(65);
        let long_value = "v".repeat(513);
        let cases = [
            (r#","store":true"#.to_string(), "store"),
            (r#","store":"no""#.to_string(), "store"),
            (r#","metadata":"x""#.to_string(), "metadata"),
            (format!(r#","metadata":{{{}}}"#, many.join(",")), "metadata"),
            (format!(r#","metadata":{{"{long_key}":"v"}}"#), "metadata"),
            (
                format!(r#","metadata":{{"k":"{long_value}"}}"#),
                "metadata.k",
            ),
            (r#","metadata":{"k":1}"#.to_string(), "metadata.k"),
        ];
        for (rest, param) in cases {
            let e = err(chat_job(&chat(HI, &rest)));
            assert_eq!(e.param.as_deref(), Some(param), "{rest}: {e:?}");
            assert!(e.message.contains(param), "{e:?}");
        }
        // At the limits: accepted.
        let sixteen: Vec<String> = (0..16).map(|i| format!(r#""k{i}":"v""#)).collect();
        let edge = format!(
            r#","metadata":{{{},"{}":"{}"}}"#,
            sixteen[..15].join(","),
            "k".repeat(64),
            "v".repeat(512)
        );
        chat_job(&chat(HI, &edge)).unwrap();
    }

    #[test]
    fn a_seed_is_any_64_bit_integer() {
        let seed = |s: &str| {
            completion_job(format!(r#"{{"model":"m","prompt":"x","seed":{s}}}"#).as_bytes())
                .map(|j| j.cfg.seed)
        };
        assert_eq!(seed("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(seed("-1"), Ok(u64::MAX));
        assert_eq!(seed("7"), Ok(7));
        let e = seed("1e30").expect_err("not an integer");
        assert_eq!(e.param.as_deref(), Some("seed"));
    }
}
