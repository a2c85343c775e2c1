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
    /// Where the template came from (`chat_template.jinja`, `tokenizer_config.json`'s
    /// `chat_template`, ...): the template's name in its errors, whose line numbers count from
    /// that text's first line.
    origin: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

/// Instructions one render may execute. A chat template's work grows with the conversation
/// (a few hundred instructions a message); a template that loops for ever (or 10^10 times)
/// would hold a core, and the server's shutdown, without end. Rendering a 4 MiB body's
/// messages takes far fewer.
pub const RENDER_FUEL: u64 = 50_000_000;

/// Bytes one render may write: four times the largest request body. A template that prints in
/// a loop would otherwise grow a prompt whose tokenization asks for gigabytes.
pub const MAX_RENDER_BYTES: usize = 16 << 20;

/// A writer that takes at most `left` more bytes, then fails.
struct Capped {
    out: Vec<u8>,
    left: usize,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() > self.left {
            return Err(std::io::Error::other(
                "the render's output is over its limit",
            ));
        }
        self.left -= buf.len();
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names where it came from in every error, at compile and at
    /// render (a template fails on some conversations only, long after it loaded).
    pub fn new(source: &str, origin: &str) -> Result<ChatTemplate, minijinja::Error> {
        let mut env = Environment::new();
        // HF templates are written for Jinja2 in Python: keep its whitespace rules and string
        // methods.
        env.set_trim_blocks(false);
        env.set_lstrip_blocks(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(RENDER_FUEL));
        // minijinja picks escaping from a template's name (`.html`, `.json`, ...), and the name
        // here is the origin: a prompt is text, never escaped, as transformers renders it.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.add_function("raise_exception", |msg: String| -> Result<Value, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(origin.to_string(), source.to_string())?;
        Ok(ChatTemplate {
            env,
            origin: origin.to_string(),
        })
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
        // minijinja names the template (and the line) of what failed while evaluating it;
        // the limits' and the output's own errors name nothing, so they get the origin here.
        let named = |e: minijinja::Error| {
            if e.name().is_some() {
                e
            } else {
                let what = e
                    .detail()
                    .map_or_else(|| e.kind().to_string(), str::to_string);
                minijinja::Error::new(e.kind(), format!("{what} (in {})", self.origin))
            }
        };
        let t = self.env.get_template(&self.origin).map_err(named)?;
        // An absent `enable_thinking`, `bos_token` or `eos_token` stays undefined, as
        // transformers leaves it: templates test `is defined` (a `none` printed as text).
        let token = |t: Option<&str>| t.map_or(Value::UNDEFINED, Value::from);
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            enable_thinking => enable_thinking.map_or(Value::UNDEFINED, Value::from),
            bos_token => token(bos_token),
            eos_token => token(eos_token),
        };
        let mut out = Capped {
            out: Vec::new(),
            left: MAX_RENDER_BYTES,
        };
        match t.render_captured_to(ctx, &mut out) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WriteFailure && out.left < MAX_RENDER_BYTES => {
                return Err(named(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("the chat template wrote more than {MAX_RENDER_BYTES} bytes"),
                )));
            }
            Err(e) => return Err(named(e)),
        }
        String::from_utf8(out.out).map_err(|_| {
            named(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "the chat template wrote text that is not UTF-8",
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, bos: Option<&str>) -> Result<String, minijinja::Error> {
        ChatTemplate::new(source, "test.jinja").unwrap().render(
            &[ChatMessage::new("user", "hi")],
            true,
            None,
            bos,
            None,
        )
    }

    /// A template that would loop 10^10 times runs out of its instructions and fails, rather
    /// than holding a core (and a server's shutdown) for ever; a normal one is far inside.
    #[test]
    fn a_template_that_does_not_end_runs_out_of_fuel() {
        let e = render(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
            None,
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfFuel, "{e}");
        assert!(e.to_string().contains("(in test.jinja"), "{e}");
        let many: Vec<ChatMessage> = (0..2000)
            .map(|i| ChatMessage::new("user", &format!("message {i}")))
            .collect();
        let qwen = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        let out = ChatTemplate::new(qwen, "qwen.jinja")
            .unwrap()
            .render(&many, false, None, None, None)
            .unwrap();
        assert!(out.ends_with("message 1999<|im_end|>\n"));
    }

    /// A template that prints in a loop stops at the output limit with an error saying so
    /// (its prompt's tokenization asked for gigabytes and aborted the process).
    #[test]
    fn a_template_that_writes_too_much_is_refused() {
        let e = render(
            r#"{% for i in range(1000) %}{% for j in range(1000) %}{{ "x" * 100 }}{% endfor %}{% endfor %}"#,
            None,
        )
        .unwrap_err();
        // The limit's own error names the template too.
        assert!(
            e.to_string().contains("wrote more than") && e.to_string().contains("(in test.jinja"),
            "{e}"
        );
    }

    /// The origin names the template in errors only: a name ending like a file type minijinja
    /// escapes (`.html`, `.json`) leaves the text as it is.
    #[test]
    fn the_origin_does_not_escape_the_prompt() {
        for origin in ["x.html", "tokenizer_config.json", "chat_template.jinja"] {
            let out = ChatTemplate::new("{{ messages[0].content }}", origin)
                .unwrap()
                .render(
                    &[ChatMessage::new("user", r#"a"<b>&'"#)],
                    false,
                    None,
                    None,
                    None,
                )
                .unwrap();
            assert_eq!(out, r#"a"<b>&'"#, "{origin}");
        }
    }

    /// An absent BOS or EOS token is undefined, as transformers leaves it: it prints as
    /// nothing and `is defined` is false (it printed `none`).
    #[test]
    fn an_absent_special_token_is_undefined() {
        assert_eq!(render("{{ bos_token }}X", None).unwrap(), "X");
        assert_eq!(
            render("{% if bos_token is defined %}B{% endif %}X", None).unwrap(),
            "X"
        );
        assert_eq!(render("{{ bos_token }}X", Some("<s>")).unwrap(), "<s>X");
    }
}
