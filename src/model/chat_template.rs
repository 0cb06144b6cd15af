//! Chat templates (Jinja, from GGUF `tokenizer.chat_template` or `tokenizer_config.json`)
//! rendered with minijinja the way `transformers` does: `trim_blocks` + `lstrip_blocks`,
//! Python string methods (minijinja-contrib pycompat), `raise_exception`, and `tojson` keeping
//! key order.

use minijinja::{Environment, Error, ErrorKind, syntax::SyntaxConfig};
use serde::{Deserialize, Serialize};

/// Errors while compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("the model has no chat template")]
    Missing,
    #[error("invalid chat template: {0}")]
    Compile(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// "system", "user", "assistant", ...
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template plus the special-token strings it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The Jinja source.
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .finish()
    }
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compiles `source`.
    ///
    /// # Errors
    /// [`TemplateError::Compile`] when the Jinja source does not compile.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(Self {
            env,
            source: source.to_owned(),
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    ///
    /// # Errors
    /// [`TemplateError::Render`] when the template fails on these messages (e.g. it raises
    /// an exception on a role order it does not allow).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
        .map_err(|e| TemplateError::Render(format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_and_raises() {
        let src = "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no') }}{% endif %}\
                   <|im_start|>{{ m['role'] }}\n{{ m['content'].strip() }}<|im_end|>\n{% endfor %}\
                   {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::new(src, "", "<|im_end|>").expect("compile");
        let out = t
            .render(&[ChatMessage::user(" hi ")], true)
            .expect("render");
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let bad = ChatMessage {
            role: "bad".into(),
            content: String::new(),
        };
        assert!(matches!(
            t.render(&[bad], false),
            Err(TemplateError::Render(_))
        ));
    }
}
