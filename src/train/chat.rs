//! A model's chat template: the Jinja `chat_template` of its
//! `tokenizer_config.json` (or `chat_template.jinja` beside it), rendered as
//! transformers' `apply_chat_template` renders it.
//!
//! The environment matches transformers': blocks trimmed (`trim_blocks`,
//! `lstrip_blocks`), loop controls, Python's string methods (`.strip()`,
//! `.startswith()`, …), `raise_exception(msg)`, a `tojson` that writes as
//! Python's `json.dumps` does, and the tokenizer's special tokens
//! (`bos_token`, `eos_token`, `pad_token`, `unk_token`) as variables beside
//! `messages` and `add_generation_prompt`. The rendered text is tokenized
//! without adding special tokens (the template writes them).
//!
//! ```
//! use oomfix::train::chat::ChatTemplate;
//!
//! let t = ChatTemplate::new(
//!     "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}\
//!      {% if add_generation_prompt %}<|assistant|>{% endif %}",
//!     Default::default(),
//! );
//! let messages = serde_json::json!([{"role": "user", "content": " Hi "}]);
//! assert_eq!(t.render(messages.as_array().unwrap(), true)?, "<|user|>Hi\n<|assistant|>");
//! # Ok::<(), String>(())
//! ```

use crate::{Error, Result};
use minijinja::value::{Kwargs, Serde, Value};
use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// The template file transformers (≥ 4.43) writes beside `tokenizer_config.json`.
pub const TEMPLATE_FILE: &str = "chat_template.jinja";

/// Template instructions one rendering may run before it is stopped (a
/// template that loops forever is an error, not a hang).
const FUEL: u64 = 50_000_000;

/// The tokenizer's special tokens a template may write.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token`.
    pub bos: Option<String>,
    /// `eos_token`.
    pub eos: Option<String>,
    /// `pad_token`.
    pub pad: Option<String>,
    /// `unk_token`.
    pub unk: Option<String>,
}

impl SpecialTokens {
    /// The special tokens of the `tokenizer_config.json` in `dir` (none
    /// without one).
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        Ok(read_config(dir)?
            .map(|(_, c)| Self::from_config(&c))
            .unwrap_or_default())
    }

    /// The special tokens of a `tokenizer_config.json` (each a string or an
    /// added-token object with a `content`).
    pub fn from_config(config: &serde_json::Value) -> Self {
        let token = |key: &str| match config.get(key) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Object(o)) => {
                o.get("content").and_then(|c| c.as_str()).map(str::to_owned)
            }
            _ => None,
        };
        SpecialTokens {
            bos: token("bos_token"),
            eos: token("eos_token"),
            pad: token("pad_token"),
            unk: token("unk_token"),
        }
    }
}

/// A chat template and the special tokens it renders with.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    tokens: SpecialTokens,
    /// The file the template came from (for messages).
    origin: Option<PathBuf>,
}

impl ChatTemplate {
    /// A template from its Jinja source.
    pub fn new(source: impl Into<String>, tokens: SpecialTokens) -> Self {
        ChatTemplate {
            source: source.into(),
            tokens,
            origin: None,
        }
    }

    /// The model's template in `dir`: `chat_template.jinja`, else the
    /// `chat_template` of `tokenizer_config.json` (a string, or a list of
    /// named templates of which `default` is taken); `None` when neither
    /// holds one. The special tokens come from `tokenizer_config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let config = read_config(dir)?;
        let tokens = config
            .as_ref()
            .map(|(_, c)| SpecialTokens::from_config(c))
            .unwrap_or_default();
        let file = dir.join(TEMPLATE_FILE);
        if file.is_file() {
            return Self::from_file(&file, tokens).map(Some);
        }
        let Some((path, config)) = config else {
            return Ok(None);
        };
        let source = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_owned)
                .ok_or_else(|| {
                    Error::input(
                        &path,
                        "\"chat_template\" lists no template named \"default\"",
                    )
                })?,
            Some(_) => {
                return Err(Error::input(
                    &path,
                    "\"chat_template\" is neither a string nor a list of named templates",
                ))
            }
        };
        Ok(Some(ChatTemplate {
            source,
            tokens,
            origin: Some(path),
        }))
    }

    /// The template in the Jinja file `path` (`--chat-template`), rendered
    /// with `tokens`.
    pub fn from_file(path: &Path, tokens: SpecialTokens) -> Result<Self> {
        let source = std::fs::read_to_string(path)
            .map_err(|e| Error::input(path, format!("cannot read the chat template: {e}")))?;
        let t = ChatTemplate {
            source,
            tokens,
            origin: Some(path.to_path_buf()),
        };
        t.environment()
            .template_from_str(&t.source)
            .map_err(|e| Error::input(path, format!("not a Jinja template: {}", one_line(&e))))?;
        Ok(t)
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The file the template was read from, if any.
    pub fn origin(&self) -> Option<&Path> {
        self.origin.as_deref()
    }

    /// The text of `messages` (JSON objects with at least `role` and
    /// `content`; other fields are passed through), with the assistant's
    /// opening when `add_generation_prompt`. A template that fails or calls
    /// `raise_exception` gives its message.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let env = self.environment();
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| one_line(&e))?;
        let t = &self.tokens;
        let ctx = minijinja::context! {
            messages => Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => t.bos.as_deref(),
            eos_token => t.eos.as_deref(),
            pad_token => t.pad.as_deref(),
            unk_token => t.unk.as_deref(),
        };
        template.render(ctx).map_err(|e| one_line(&e))
    }

    /// transformers' Jinja environment.
    fn environment(&self) -> Environment<'static> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_fuel(Some(FUEL));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_filter("tojson", tojson);
        env
    }
}

/// The model directory's `tokenizer_config.json`, parsed, if there is one.
fn read_config(dir: &Path) -> Result<Option<(PathBuf, serde_json::Value)>> {
    let path = dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::input(&path, format!("cannot read: {e}")))?;
    let value =
        serde_json::from_str(&text).map_err(|e| Error::input(&path, format!("not JSON: {e}")))?;
    Ok(Some((path, value)))
}

/// A template error in one line: its message and, when known, the
/// template line it happened on.
fn one_line(e: &minijinja::Error) -> String {
    let what = match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    };
    match e.line() {
        Some(line) => format!("{what} (template line {line})"),
        None => what,
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`:
/// `", "` and `": "` between items without an indent, `","` and `": "`
/// with one; no HTML escaping. An object's keys come sorted (the rows are
/// read into `serde_json` values, which sort them), where Python keeps the
/// file's order.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let bad =
        |e: serde_json::Error| minijinja::Error::new(ErrorKind::BadSerialization, e.to_string());
    let mut out = Vec::new();
    match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            value.serialize(&mut ser).map_err(bad)?;
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            value.serialize(&mut ser).map_err(bad)?;
        }
    }
    let text = String::from_utf8(out).expect("serde_json writes UTF-8");
    Ok(Value::from_safe_string(text))
}

/// serde_json's compact output with Python's default separators.
struct PythonFormatter;

/// [`PythonFormatter`]'s methods that write Python's `", "` before every
/// item but the first.
macro_rules! item_separators {
    ($($method:ident),*) => {$(
        fn $method<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
    )*};
}

impl serde_json::ser::Formatter for PythonFormatter {
    item_separators!(begin_array_value, begin_object_key);

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: serde_json::Value) -> Result<String, String> {
        ChatTemplate::new(source, SpecialTokens::default())
            .render(messages.as_array().unwrap(), false)
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_trims_them() {
        let t = "{% for m in messages %}\n  {% if m.role == 'user' %}\nU:{{ m.content }}\n  {% endif %}\n{% endfor %}";
        assert_eq!(
            render(t, json!([{"role": "user", "content": "a"}])).unwrap(),
            "U:a\n"
        );
    }

    #[test]
    fn python_methods_loop_controls_and_tojson_work() {
        let t = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
                 {{ m.content.strip().upper() }}|{{ m | tojson }}{% endfor %}";
        let out = render(
            t,
            json!([{"role": "system", "content": "x"}, {"role": "user", "content": " é<b> "}]),
        )
        .unwrap();
        assert_eq!(out, r#"É<B>|{"content": " é<b> ", "role": "user"}"#);
    }

    #[test]
    fn raise_exception_and_bad_templates_give_their_message() {
        let t = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}";
        let e = render(t, json!([{"role": "tool", "content": "x"}])).unwrap_err();
        assert!(e.contains("Conversation roles must alternate"), "{e}");
        let e = render("{% for %}", json!([])).unwrap_err();
        assert!(e.contains("template line 1"), "{e}");
        let e = render("{% for i in range(10000000000) %}{% endfor %}", json!([])).unwrap_err();
        assert!(!e.is_empty());
    }

    #[test]
    fn special_tokens_come_from_strings_or_added_token_objects() {
        let config = json!({"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}});
        let tokens = SpecialTokens::from_config(&config);
        assert_eq!(tokens.bos.as_deref(), Some("<s>"));
        assert_eq!(tokens.eos.as_deref(), Some("</s>"));
        let t = ChatTemplate::new(
            "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
            tokens,
        );
        assert_eq!(
            t.render(&[json!({"role": "user", "content": "hi"})], false)
                .unwrap(),
            "<s>hi</s>"
        );
    }
}
