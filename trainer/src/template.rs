//! Hugging Face chat templates rendered outside Python, as transformers renders them.
//!
//! transformers compiles a model's `chat_template` with Jinja2 (`trim_blocks` and
//! `lstrip_blocks` on, loop controls enabled) and adds three names to it: a `tojson`
//! filter that is `json.dumps(x, ensure_ascii=False, indent=?, separators=?,
//! sort_keys=?)` (no HTML escaping, key order kept), and the globals `raise_exception`
//! and `strftime_now`. This module does the same with minijinja plus
//! `minijinja-contrib`'s Python-compatible methods (`startswith`, `split`, `items`, ...).
//!
//! The context of a render is `messages`, `tools` (none when the request had no `tools`,
//! which templates tell apart from `[]`), `documents` (none), `add_generation_prompt`,
//! the tokenizer's special tokens (`bos_token`, `eos_token`, ...) and the request's
//! `chat_template_kwargs` (e.g. `enable_thinking`), like transformers'
//! `apply_chat_template` and vLLM.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, syntax::SyntaxConfig};

/// Name under which the template is compiled (no `.html`, so no auto-escaping).
const TEMPLATE_NAME: &str = "chat_template";

/// Why a chat template could not be compiled or rendered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateError {
    /// The template does not compile.
    #[error("chat template does not compile: {0:#}")]
    Compile(#[source] Error),
    /// Rendering failed (including a `raise_exception` call by the template).
    #[error("chat template failed to render: {0:#}")]
    Render(#[source] Error),
    /// `continue_final_message` was asked for but the final message cannot be found.
    #[error("continue_final_message: {0}")]
    ContinueFinalMessage(String),
}

/// What a template is rendered with.
#[derive(Debug, Clone, Copy)]
pub struct RenderInput<'a> {
    /// The conversation, already normalized (see `crate::tokenize::normalize_messages`).
    pub messages: &'a [serde_json::Value],
    /// The tool definitions; `None` when the request had no `tools` field.
    pub tools: Option<&'a [serde_json::Value]>,
    /// Whether to open an assistant turn at the end.
    pub add_generation_prompt: bool,
    /// Whether to leave the final message open (transformers' `continue_final_message`).
    pub continue_final_message: bool,
    /// Extra variables: special tokens first, then `chat_template_kwargs` over them.
    pub variables: &'a serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` with transformers' settings and extras.
    pub fn new(source: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(TemplateError::Compile)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(TemplateError::Compile)?;
        Ok(ChatTemplate { env })
    }

    /// Renders the template.
    pub fn render(&self, input: &RenderInput<'_>) -> Result<String, TemplateError> {
        let mut ctx = serde_json::Map::new();
        for (key, value) in input.variables {
            ctx.insert(key.clone(), value.clone());
        }
        ctx.insert(
            "messages".into(),
            serde_json::Value::Array(input.messages.to_vec()),
        );
        ctx.insert(
            "tools".into(),
            input.tools.map_or(serde_json::Value::Null, |t| {
                serde_json::Value::Array(t.to_vec())
            }),
        );
        ctx.insert("documents".into(), serde_json::Value::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(input.add_generation_prompt),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(TemplateError::Render)?;
        let rendered = template
            .render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(TemplateError::Render)?;
        if input.continue_final_message {
            cut_after_final_message(rendered, input.messages)
        } else {
            Ok(rendered)
        }
    }
}

/// transformers' `continue_final_message`: cut the render right after the final
/// message's text, so that generation continues it.
fn cut_after_final_message(
    rendered: String,
    messages: &[serde_json::Value],
) -> Result<String, TemplateError> {
    let err = |m: &str| TemplateError::ContinueFinalMessage(m.to_owned());
    let last = messages
        .last()
        .ok_or_else(|| err("there are no messages"))?;
    let final_text = match last.get("content") {
        Some(serde_json::Value::String(s)) => s.as_str(),
        Some(serde_json::Value::Array(parts)) => parts
            .iter()
            .rev()
            .find_map(|p| p.get("text").and_then(|t| t.as_str()))
            .ok_or_else(|| err("the final message has no text part"))?,
        _ => return Err(err("the final message has no text content")),
    };
    let stripped = final_text.trim();
    let at = rendered
        .rfind(stripped)
        .ok_or_else(|| err("the final message's text is not in the rendered template"))?;
    let lstripped = final_text.trim_start();
    let end = if rendered.get(at..at + lstripped.len()) == Some(final_text) {
        at + lstripped.len()
    } else {
        at + stripped.len()
    };
    let mut rendered = rendered;
    rendered.truncate(end);
    Ok(rendered)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> Result<String, Error> {
    let now = chrono::Local::now();
    let mut out = String::new();
    write!(out, "{}", now.format(&format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        )
    })?;
    Ok(out)
}

/// Options of Python's `json.dumps` that HF's `tojson` exposes.
#[derive(Debug, Clone)]
pub struct JsonOptions {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// Pretty-printing indent (`None`: one line).
    pub indent: Option<String>,
    /// Item separator.
    pub item_sep: String,
    /// Key separator.
    pub key_sep: String,
    /// Sort object keys.
    pub sort_keys: bool,
}

impl Default for JsonOptions {
    fn default() -> Self {
        JsonOptions {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson_filter(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let mut given: [Option<Value>; 4] = Default::default();
    if args.len() > NAMES.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 positional arguments",
        ));
    }
    for (slot, arg) in given.iter_mut().zip(args.iter()) {
        *slot = Some(arg.clone());
    }
    for (slot, name) in given.iter_mut().zip(NAMES) {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slot.is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument {name:?}"),
                ));
            }
            *slot = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = given;
    let mut opts = JsonOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..JsonOptions::default()
    };
    match indent {
        Some(v) if v.is_none() || v.is_undefined() => {}
        Some(v) => {
            opts.indent = Some(match v.kind() {
                ValueKind::String => v.as_str().unwrap_or_default().to_owned(),
                ValueKind::Number if v.is_integer() => {
                    " ".repeat(usize::try_from(v.as_i64().unwrap_or(0)).unwrap_or(0))
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    ));
                }
            });
            opts.item_sep = ",".into();
        }
        None => {}
    }
    if let Some(seps) = separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                opts.item_sep = a.as_str().unwrap_or_default().to_owned();
                opts.key_sep = b.as_str().unwrap_or_default().to_owned();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ));
            }
        }
    }
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(out)
}

/// Writes `value` as Python's `json.dumps` would.
pub fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    depth: usize,
) -> Result<(), Error> {
    if depth > 512 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: Object of type Undefined is not JSON serializable",
            ));
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&value.to_string());
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default(), opts),
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, depth + 1);
                write_json_str(out, key, opts);
                out.push_str(&opts.key_sep);
                write_json(out, item, opts, depth + 1)?;
            }
            newline_indent(out, opts, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, depth + 1);
                write_json(out, item, opts, depth + 1)?;
            }
            newline_indent(out, opts, depth);
            out.push(']');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

fn newline_indent(out: &mut String, opts: &JsonOptions, depth: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// Python's `json.dumps` turns these keys into strings; anything else is an error.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => py_float_repr(f64::try_from(key.clone())?),
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ));
        }
    })
}

/// A JSON string literal escaped like Python's `json.dumps`.
fn write_json_str(out: &mut String, s: &str, opts: &JsonOptions) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if opts.ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed notation when
/// the decimal exponent is in -4..16 and in scientific notation (`1e+16`) otherwise.
pub fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits, e.g. "-1.2345e-5".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = usize::try_from(exp).unwrap_or(0) + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat(usize::try_from(-exp - 1).unwrap_or(0)));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, messages: serde_json::Value) -> Result<String, TemplateError> {
        let t = ChatTemplate::new(src)?;
        let messages = messages.as_array().cloned().unwrap_or_default();
        t.render(&RenderInput {
            messages: &messages,
            tools: None,
            add_generation_prompt: false,
            continue_final_message: false,
            variables: &serde_json::Map::new(),
        })
    }

    #[test]
    fn float_repr_matches_python() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123.456, "123.456"),
            (1e100, "1e+100"),
            (-0.0, "-0.0"),
            (f64::NAN, "NaN"),
            (2.0e-310, "2e-310"),
        ] {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let msgs = json!([{"role": "user", "content": "x", "args": {"b": [1, 2.0, "<&'>"], "a": {}, "ü": null, "t": true}}]);
        let out = render("{{ messages[0].args | tojson }}", msgs.clone()).unwrap();
        assert_eq!(
            out,
            r#"{"b": [1, 2.0, "<&'>"], "a": {}, "ü": null, "t": true}"#
        );
        let out = render(
            "{{ messages[0].args | tojson(indent=2, sort_keys=true) }}",
            msgs.clone(),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.0,\n    \"<&'>\"\n  ],\n  \"t\": true,\n  \"ü\": null\n}"
        );
        let out = render(
            "{{ messages[0].args | tojson(separators=(',', ':'), ensure_ascii=true) }}",
            msgs,
        )
        .unwrap();
        assert_eq!(out, r#"{"b":[1,2.0,"<&'>"],"a":{},"\u00fc":null,"t":true}"#);
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let err = render("{{ raise_exception('no system role') }}", json!([])).unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
    }

    #[test]
    fn python_string_methods_and_whitespace_control_work() {
        let out = render(
            "{% for m in messages %}\n  {{ m.content.split('</think>')[-1].lstrip('\\n') }}|{{ m.content.startswith('<think>') }}\n{% endfor %}",
            json!([{"role": "assistant", "content": "<think>r</think>\n\nhi"}]),
        )
        .unwrap();
        // Jinja2 prints Python booleans, and so does the render.
        assert_eq!(out, "  hi|True\n");
    }

    #[test]
    fn strftime_now_formats_local_time_like_python() {
        let out = render("{{ strftime_now('%d %b %Y') }}", json!([])).unwrap();
        let today = chrono::Local::now().format("%d %b %Y").to_string();
        let yesterday = (chrono::Local::now() - chrono::Duration::minutes(1))
            .format("%d %b %Y")
            .to_string();
        assert!(out == today || out == yesterday, "{out}");
        let err = render("{{ strftime_now('%Q') }}", json!([])).unwrap_err();
        assert!(err.to_string().contains("%Q"), "{err}");
    }

    #[test]
    fn continue_final_message_cuts_after_the_final_text() {
        let t =
            ChatTemplate::new("{% for m in messages %}<{{ m.content }}>\n{% endfor %}").unwrap();
        let messages = vec![json!({"role": "assistant", "content": "partial "})];
        let out = t
            .render(&RenderInput {
                messages: &messages,
                tools: None,
                add_generation_prompt: false,
                continue_final_message: true,
                variables: &serde_json::Map::new(),
            })
            .unwrap();
        assert_eq!(out, "<partial ");
    }
}
