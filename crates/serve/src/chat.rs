//! Chat templates: the Jinja template a tokenizer ships, rendered by `minijinja` with the
//! Python string methods HF templates call (`startswith`, `split`, `lstrip`, ...), never by
//! pasting strings.

use minijinja::{Environment, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(source: &str) -> Result<ChatTemplate, minijinja::Error> {
        let mut env = Environment::new();
        // HF templates are written for Jinja2 in Python: keep its whitespace rules and string
        // methods.
        env.set_trim_blocks(false);
        env.set_lstrip_blocks(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(NAME, source.to_string())?;
        Ok(ChatTemplate { env })
    }

    /// Renders `messages`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<String, minijinja::Error> {
        let t = self.env.get_template(NAME)?;
        // An absent `enable_thinking` must stay undefined: the template tests `is defined`.
        match enable_thinking {
            Some(e) => t.render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                enable_thinking => e,
                bos_token => bos_token,
                eos_token => eos_token,
            }),
            None => t.render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
            }),
        }
    }
}
