//! The tokenizer of a model: HF `tokenizer.json` through the `tokenizers` crate, the special
//! tokens and chat template of `tokenizer_config.json`, and the real Qwen3 files embedded for
//! the random-weight presets.

use std::path::Path;

use serde_json::Value;

use crate::chat::{ChatMessage, ChatTemplate};

/// The Qwen3 `tokenizer.json`, embedded (see `assets/qwen3/NOTICE.md`).
const QWEN3_TOKENIZER: &[u8] = include_bytes!("../assets/qwen3/tokenizer.json");
/// The Qwen3 `tokenizer_config.json` (special tokens, chat template).
const QWEN3_TOKENIZER_CONFIG: &[u8] = include_bytes!("../assets/qwen3/tokenizer_config.json");

/// Why a tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// `tokenizer.json` is absent from a model directory.
    #[error("{dir}: no tokenizer.json (`generate` takes token ids instead: --prompt-ids)")]
    Missing {
        /// The directory.
        dir: String,
    },
    /// A file did not parse.
    #[error("{file}: {why}")]
    Parse {
        /// The file.
        file: String,
        /// The parser's message.
        why: String,
    },
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Codec(String),
    /// The chat template failed to render.
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer has no chat template.
    #[error(
        "the tokenizer has no chat template (chat_template.jinja, or tokenizer_config.json `chat_template`)"
    )]
    NoTemplate,
    /// `chat_template` lists named templates and none is named `default`: `transformers`
    /// refuses to pick one for a chat too (the name must be given there).
    #[error(
        "tokenizer_config.json `chat_template` lists named templates ({}) but none named `default`, \
         so there is no template for a chat (completions are unaffected)",
        names.join(", ")
    )]
    NoDefaultTemplate {
        /// The names listed.
        names: Vec<String>,
    },
}

/// The chat template a tokenizer's files give.
enum TemplateSource {
    None,
    One(Box<ChatTemplate>),
    /// Named templates without a `default` (their names).
    NoDefault(Vec<String>),
}

/// A model's tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `get_vocab_size` builds the whole vocabulary map on every call: counted once.
    vocab_size: usize,
    /// The special tokens' ids (what decoding with `skip_special` leaves out).
    special: std::collections::HashSet<u32>,
    eos_token: Option<String>,
    bos_token: Option<String>,
    template: TemplateSource,
    source: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab", &self.vocab_size())
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// A special-token entry of `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Whether a model directory holds `path`: absent is `false`; a link that leads nowhere (an
/// interrupted download into a hub cache, whose files are links) is an error naming it rather
/// than a file silently taken as absent.
fn present(path: &Path) -> Result<bool, TokenizerError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(TokenizerError::Io {
            file: path.display().to_string(),
            source,
        }),
        Ok(_) => std::fs::metadata(path)
            .map(|_| true)
            .map_err(|source| TokenizerError::Io {
                file: path.display().to_string(),
                source,
            }),
    }
}

/// Refuses `added_tokens` whose declared id the tokenizer does not give them: the `tokenizers`
/// crate renumbers such a token (with a log line nobody sees), and the ids the model, the EOS
/// list and the chat template rely on then name other tokens.
fn check_added_ids(
    inner: &tokenizers::Tokenizer,
    tokenizer_json: &[u8],
    source: &str,
) -> Result<(), TokenizerError> {
    #[derive(serde::Deserialize)]
    struct Added {
        id: u32,
        content: String,
    }
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        added_tokens: Vec<Added>,
    }
    let Ok(file) = serde_json::from_slice::<File>(tokenizer_json) else {
        // The crate read the file; a shape this view does not take holds no ids to check.
        return Ok(());
    };
    for a in file.added_tokens {
        let got = inner.token_to_id(&a.content);
        if got != Some(a.id) {
            return Err(TokenizerError::Parse {
                file: format!("{source}: tokenizer.json"),
                why: format!(
                    "added token {:?} is declared as id {} but the tokenizer gives it {}",
                    a.content,
                    a.id,
                    got.map_or("no id".to_string(), |g| format!("id {g}"))
                ),
            });
        }
    }
    Ok(())
}

impl Tokenizer {
    /// The real Qwen3 tokenizer, embedded in the binary.
    pub fn qwen3() -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_bytes(
            QWEN3_TOKENIZER,
            Some(QWEN3_TOKENIZER_CONFIG),
            "the built-in Qwen3 tokenizer",
        )
    }

    /// `tokenizer.json` (required), `tokenizer_config.json` and `chat_template.jinja`
    /// (optional) of a model directory. As `transformers` (from 4.47) saves and reads them, a
    /// `chat_template.jinja` beside the config is the template, over the config's own.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let tok = dir.join("tokenizer.json");
        if !present(&tok)? {
            return Err(TokenizerError::Missing {
                dir: dir.display().to_string(),
            });
        }
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| TokenizerError::Io {
                file: p.display().to_string(),
                source,
            })
        };
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if present(&cfg_path)? {
            Some(read(&cfg_path)?)
        } else {
            None
        };
        let mut t =
            Tokenizer::from_bytes(&read(&tok)?, cfg.as_deref(), &dir.display().to_string())?;
        let jinja = dir.join("chat_template.jinja");
        if present(&jinja)? {
            let bytes = read(&jinja)?;
            let parse = |why: String| TokenizerError::Parse {
                file: jinja.display().to_string(),
                why,
            };
            let text = String::from_utf8(bytes).map_err(|e| parse(e.to_string()))?;
            let template = ChatTemplate::new(&text, "chat_template.jinja")
                .map_err(|e| parse(e.to_string()))?;
            t.template = TemplateSource::One(Box::new(template));
        }
        Ok(t)
    }

    /// From the two files' contents; `source` names them in errors.
    pub fn from_bytes(
        tokenizer_json: &[u8],
        config_json: Option<&[u8]>,
        source: &str,
    ) -> Result<Tokenizer, TokenizerError> {
        let mut inner = tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|e| {
            TokenizerError::Parse {
                file: format!("{source}: tokenizer.json"),
                why: e.to_string(),
            }
        })?;
        // A `truncation` or `padding` block in the file would cut every prompt to its
        // `max_length` or pad it, silently. `transformers` turns both off for a call that asks
        // for neither (every prompt here): so do we. A prompt longer than the model's context
        // is refused by the engine, with its length.
        inner
            .with_truncation(None)
            .map_err(|e| TokenizerError::Parse {
                file: format!("{source}: tokenizer.json"),
                why: e.to_string(),
            })?
            .with_padding(None);
        check_added_ids(&inner, tokenizer_json, source)?;
        let (mut eos_token, mut bos_token, mut template) = (None, None, TemplateSource::None);
        if let Some(bytes) = config_json {
            let file = format!("{source}: tokenizer_config.json");
            let cfg: Value = serde_json::from_slice(bytes).map_err(|e| TokenizerError::Parse {
                file: file.clone(),
                why: e.to_string(),
            })?;
            eos_token = token_text(cfg.get("eos_token"));
            bos_token = token_text(cfg.get("bos_token"));
            template = match cfg.get("chat_template") {
                None | Some(Value::Null) => TemplateSource::None,
                Some(Value::String(t)) => {
                    TemplateSource::One(Box::new(compile(t, &file, "`chat_template`")?))
                }
                // Named templates (`[{"name", "template"}, ...]`): the one named `default` is
                // the chat template, as `transformers` picks it when none is named. Without
                // one, the files still load (completions need no template) and a chat is
                // refused, as `transformers` fails only when a chat is rendered.
                Some(Value::Array(list)) => named_templates(list, &file)?,
                Some(other) => {
                    return Err(TokenizerError::Parse {
                        file,
                        why: format!(
                            "`chat_template` must be a string or a list of named templates, not {other}"
                        ),
                    });
                }
            };
        }
        let special = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        Ok(Tokenizer {
            vocab_size: inner.get_vocab_size(true),
            special,
            inner,
            eos_token,
            bos_token,
            template,
            source: source.to_string(),
        })
    }

    /// Where the tokenizer came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Ids the tokenizer can produce (the vocabulary with the added tokens): one past the
    /// largest id.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of a token's text (special tokens included).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The id of `tokenizer_config.json`'s `eos_token`.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.token_id(self.eos_token.as_deref()?)
    }

    /// Token ids of `text`, no special tokens added (special tokens written in the text,
    /// such as `<|im_start|>`, are recognised as such): for text a chat template rendered,
    /// which holds its special tokens already.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, false)
    }

    /// Token ids of a plain text prompt as `transformers`' `tokenizer(text)` and vLLM's
    /// completions encode it: with the special tokens `tokenizer.json`'s post-processor puts
    /// around one sequence (a BOS, where a tokenizer adds one; Qwen3's adds none).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, true)
    }

    fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Whether `id` adds nothing to any text it is decoded in: an id outside the vocabulary,
    /// or with `skip_special` a special token ([`Tokenizer::decode`] leaves both out before
    /// anything else sees the ids).
    pub fn decodes_to_nothing(&self, id: u32, skip_special: bool) -> bool {
        id as usize >= self.vocab_size || (skip_special && self.special.contains(&id))
    }

    /// The text of `ids` (special tokens kept unless `skip_special`). Ids outside the
    /// tokenizer's vocabulary (a model's padded rows) decode to nothing.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let known: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&i| (i as usize) < self.vocab_size())
            .collect();
        self.inner
            .decode(&known, skip_special)
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// The prompt text of a conversation through the tokenizer's chat template, with the
    /// assistant's turn opened when `add_generation_prompt`. `enable_thinking: Some(false)`
    /// asks Qwen3's template for an empty reasoning block.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        let t = match &self.template {
            TemplateSource::One(t) => t,
            TemplateSource::None => return Err(TokenizerError::NoTemplate),
            TemplateSource::NoDefault(names) => {
                return Err(TokenizerError::NoDefaultTemplate {
                    names: names.clone(),
                });
            }
        };
        t.render(
            messages,
            add_generation_prompt,
            enable_thinking,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
        )
        .map_err(|e| TokenizerError::Template(e.to_string()))
    }
}

/// The config's `chat_template` (`what` names it) compiled; errors, at compile and at render,
/// name the file and it.
fn compile(text: &str, file: &str, what: &str) -> Result<ChatTemplate, TokenizerError> {
    ChatTemplate::new(text, &format!("tokenizer_config.json {what}")).map_err(|e| {
        TokenizerError::Parse {
            file: file.to_string(),
            why: format!("{what}: {e}"),
        }
    })
}

/// A list of named templates: each entry a `name` and a `template` string (`transformers`
/// fails to load anything else), the one named `default` compiled.
fn named_templates(list: &[Value], file: &str) -> Result<TemplateSource, TokenizerError> {
    let mut names = Vec::with_capacity(list.len());
    let mut default = None;
    for entry in list {
        let field = |key: &str| entry.get(key).and_then(Value::as_str);
        let (Some(name), Some(text)) = (field("name"), field("template")) else {
            return Err(TokenizerError::Parse {
                file: file.to_string(),
                why: format!(
                    "`chat_template` lists named templates, each a string `name` and a string \
                     `template`; this entry is not one: {entry}"
                ),
            });
        };
        if name == "default" {
            default = Some(text);
        }
        names.push(name.to_string());
    }
    Ok(match default {
        Some(text) => {
            TemplateSource::One(Box::new(compile(text, file, "`chat_template` `default`")?))
        }
        None => TemplateSource::NoDefault(names),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("simpler-tok-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// An added token declared with an id the tokenizer does not give it is refused naming
    /// it (the `tokenizers` crate renumbered it silently, and the model's EOS ids then named
    /// another token); the real file passes.
    #[test]
    fn an_added_token_renumbered_by_the_parser_is_refused() {
        let mut v: Value = serde_json::from_slice(QWEN3_TOKENIZER).unwrap();
        let added = v["added_tokens"].as_array_mut().unwrap();
        let im_end = added
            .iter_mut()
            .find(|a| a["content"] == "<|im_end|>")
            .unwrap();
        assert_eq!(im_end["id"], 151645);
        // Declared past every id: the parser appends it under the next free id instead.
        im_end["id"] = 200_000.into();
        let bytes = serde_json::to_vec(&v).unwrap();
        let e = Tokenizer::from_bytes(&bytes, None, "t")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer.json")
                && e.contains("\"<|im_end|>\" is declared as id 200000 but the tokenizer gives it"),
            "{e}"
        );
        Tokenizer::from_bytes(QWEN3_TOKENIZER, None, "t").unwrap();
    }

    /// A file that is a link leading nowhere (an interrupted download into a hub cache) is an
    /// error naming it, not a file taken as absent.
    #[test]
    fn a_dangling_link_is_named_not_taken_as_absent() {
        let d = dir("dangling");
        std::fs::write(d.join("tokenizer.json"), QWEN3_TOKENIZER).unwrap();
        Tokenizer::from_dir(&d).unwrap();
        std::os::unix::fs::symlink(d.join("nowhere"), d.join("tokenizer_config.json")).unwrap();
        let e = Tokenizer::from_dir(&d).unwrap_err().to_string();
        assert!(e.contains("tokenizer_config.json"), "{e}");
        std::fs::remove_file(d.join("tokenizer_config.json")).unwrap();
        std::os::unix::fs::symlink(d.join("nowhere"), d.join("chat_template.jinja")).unwrap();
        let e = Tokenizer::from_dir(&d).unwrap_err().to_string();
        assert!(e.contains("chat_template.jinja"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
