//! Stage 3: every call's prompt and completion as token ids.
//!
//! Recorded ids win: when the inference server returned `prompt_token_ids` or a
//! completion's `token_ids`, those are what the model saw and sampled. Otherwise:
//!
//! - **Prompt** (chat completions): the request's `messages`, `tools` and
//!   `chat_template_kwargs` are normalized as vLLM does before rendering (a null
//!   `content` becomes `""`, text parts are joined with `\n`, tool-call `arguments`
//!   strings are parsed into objects), rendered with the model's chat template
//!   ([`crate::template`]) and tokenized without adding special tokens. The legacy
//!   completions API tokenizes `prompt` with special tokens, as vLLM does.
//! - **Completion**: the generated turn (reasoning, content, tool calls) is appended to
//!   the conversation as an assistant message and rendered without a generation prompt;
//!   what the render adds after the prompt is the completion as the template writes it.
//!   It is tokenized on its own and cut right after the first stop token (EOS or an
//!   end-of-turn token); the stop token is removed again when the generation ended on
//!   the length limit, and added when the template wrote none.
//!
//! When a call has both recorded ids and text, both are computed and compared; the
//! difference is reported by kind ([`crate::drift`]), never silently merged.
//! [`prompt_ids`] is also what `tapline-trainer tokenize` prints.

use serde_json::{Map, Value};
use tapline_proto::{Api, Completion, LlmCall};

use crate::drift::{self, DriftKind, Relation};
use crate::model::Model;
use crate::template::{RenderInput, TemplateError};

/// Why a call could not be turned into tokens. [`TokenizeError::reason`] is the name
/// used in the cleaning report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// The call holds no completion.
    #[error("the call has no completion")]
    NoCompletion,
    /// The request body is not the JSON the API expects.
    #[error("request body: {0}")]
    BadRequest(String),
    /// Text can only be tokenized for chat completions and completions requests.
    #[error(
        "{0:?} calls without recorded token ids cannot be tokenized (only chat completions and completions can)"
    )]
    UnsupportedApi(Api),
    /// A message holds content that is not text.
    #[error("message {index}: {reason}")]
    UnsupportedContent {
        /// Index of the message.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// The chat template failed.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The render with the completion does not start with the prompt's render, so the
    /// completion's text cannot be cut out of it.
    #[error(
        "the chat template renders the conversation with the completion differently from the prompt, so the completion's tokens cannot be derived from text"
    )]
    CompletionNotPrefix,
}

impl TokenizeError {
    /// Name of the error in reports.
    pub fn reason(&self) -> &'static str {
        match self {
            TokenizeError::NoCompletion => "no_completion",
            TokenizeError::BadRequest(_) => "bad_request_body",
            TokenizeError::UnsupportedApi(_) => "unsupported_api",
            TokenizeError::UnsupportedContent { .. } => "unsupported_content",
            TokenizeError::Template(_) => "template_error",
            TokenizeError::Tokenizer(_) => "tokenizer_error",
            TokenizeError::CompletionNotPrefix => "completion_render_not_prefix",
        }
    }
}

/// Settings of the tokenize stage (section `[tokenize]` of the run config).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizeOptions {
    /// Use recorded token ids when the call has them (default true). When false, every
    /// call is tokenized from text.
    pub use_recorded_ids: bool,
    /// For calls with recorded ids, also tokenize the text and report drift (default
    /// true).
    pub measure_drift: bool,
    /// `chat_template_kwargs` the inference server applied by default (e.g. vLLM's
    /// `--default-chat-template-kwargs`); a request's own kwargs override them.
    pub chat_template_kwargs: Map<String, Value>,
}

impl Default for TokenizeOptions {
    fn default() -> Self {
        TokenizeOptions {
            use_recorded_ids: true,
            measure_drift: true,
            chat_template_kwargs: Map::new(),
        }
    }
}

/// One chat request, as `tapline-trainer tokenize` reads it and as the pipeline takes
/// it from a call's request body.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The conversation (OpenAI chat format).
    pub messages: Vec<Value>,
    /// Tool definitions; `None` when the request had no `tools` (or `null`).
    pub tools: Option<Vec<Value>>,
    /// Extra template variables (e.g. `enable_thinking`).
    pub chat_template_kwargs: Map<String, Value>,
    /// Open an assistant turn at the end (default true).
    pub add_generation_prompt: bool,
    /// Leave the final message open instead (default false).
    pub continue_final_message: bool,
}

impl ChatRequest {
    /// Reads the fields of an OpenAI/vLLM chat completions request body.
    pub fn from_json(body: &Value) -> Result<Self, TokenizeError> {
        let bad = |m: &str| TokenizeError::BadRequest(m.to_owned());
        let obj = body.as_object().ok_or_else(|| bad("not a JSON object"))?;
        let messages = match obj.get("messages") {
            Some(Value::Array(m)) => m.clone(),
            Some(_) => return Err(bad("`messages` is not an array")),
            None => return Err(bad("no `messages`")),
        };
        let tools = match obj.get("tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(t)) => Some(t.clone()),
            Some(_) => return Err(bad("`tools` is not an array")),
        };
        let chat_template_kwargs = match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(_) => return Err(bad("`chat_template_kwargs` is not an object")),
        };
        let flag = |name: &str, default: bool| match obj.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(TokenizeError::BadRequest(format!(
                "`{name}` is not a boolean"
            ))),
        };
        Ok(ChatRequest {
            messages,
            tools,
            chat_template_kwargs,
            add_generation_prompt: flag("add_generation_prompt", true)?,
            continue_final_message: flag("continue_final_message", false)?,
        })
    }
}

/// vLLM's normalization of a conversation before templating.
pub fn normalize_messages(messages: &[Value]) -> Result<Vec<Value>, TokenizeError> {
    messages
        .iter()
        .enumerate()
        .map(|(index, m)| {
            let unsupported = |reason: String| TokenizeError::UnsupportedContent { index, reason };
            let Value::Object(obj) = m else {
                return Err(unsupported("a message is not a JSON object".into()));
            };
            let mut obj = obj.clone();
            let content = match obj.get("content") {
                None | Some(Value::Null) => Value::String(String::new()),
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(Value::Array(parts)) => {
                    let mut texts = Vec::with_capacity(parts.len());
                    for part in parts {
                        let kind = part.get("type").and_then(Value::as_str).unwrap_or("text");
                        match (kind, part.get("text").and_then(Value::as_str)) {
                            ("text" | "input_text" | "output_text", Some(t)) => texts.push(t),
                            _ => {
                                return Err(unsupported(format!(
                                    "content part of type {kind:?} is not text"
                                )));
                            }
                        }
                    }
                    Value::String(texts.join("\n"))
                }
                Some(_) => return Err(unsupported("`content` is not a string or a list".into())),
            };
            obj.insert("content".into(), content);
            let is_assistant = obj.get("role").and_then(Value::as_str) == Some("assistant");
            if is_assistant && let Some(Value::Array(calls)) = obj.get_mut("tool_calls") {
                for call in calls {
                    if let Some(Value::Object(function)) = call.get_mut("function") {
                        let parsed = match function.get("arguments") {
                            None | Some(Value::Null) => Some(Value::Object(Map::new())),
                            Some(Value::String(s)) if s.is_empty() => {
                                Some(Value::Object(Map::new()))
                            }
                            Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok(),
                            Some(_) => None,
                        };
                        if let Some(parsed) = parsed {
                            function.insert("arguments".into(), parsed);
                        }
                    }
                }
            }
            Ok(Value::Object(obj))
        })
        .collect()
}

/// The assistant message a completion adds to the conversation.
pub fn completion_message(completion: &Completion) -> Value {
    let mut msg = Map::new();
    msg.insert("role".into(), "assistant".into());
    msg.insert("content".into(), completion.text.clone().into());
    if !completion.reasoning.is_empty() {
        msg.insert(
            "reasoning_content".into(),
            completion.reasoning.clone().into(),
        );
    }
    if !completion.tool_calls.is_empty() {
        let calls: Vec<Value> = completion
            .tool_calls
            .iter()
            .map(|tc| {
                serde_json::json!({
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.name, "arguments": tc.arguments},
                })
            })
            .collect();
        msg.insert("tool_calls".into(), Value::Array(calls));
    }
    Value::Object(msg)
}

/// Renders the prompt of `request` as text.
pub fn render_prompt(
    model: &Model,
    request: &ChatRequest,
    default_kwargs: &Map<String, Value>,
) -> Result<String, TokenizeError> {
    let messages = normalize_messages(&request.messages)?;
    render(
        model,
        request,
        default_kwargs,
        &messages,
        request.add_generation_prompt,
        request.continue_final_message,
    )
}

fn render(
    model: &Model,
    request: &ChatRequest,
    default_kwargs: &Map<String, Value>,
    messages: &[Value],
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> Result<String, TokenizeError> {
    let mut variables = model.variables().clone();
    for (k, v) in default_kwargs.iter().chain(&request.chat_template_kwargs) {
        variables.insert(k.clone(), v.clone());
    }
    let template = model.template(request.tools.is_some());
    Ok(template.render(&RenderInput {
        messages,
        tools: request.tools.as_deref(),
        add_generation_prompt,
        continue_final_message,
        variables: &variables,
    })?)
}

/// The prompt ids of `request`: rendered with the chat template, tokenized without
/// special tokens. This is what `tapline-trainer tokenize` prints.
pub fn prompt_ids(
    model: &Model,
    request: &ChatRequest,
    default_kwargs: &Map<String, Value>,
) -> Result<Vec<u32>, TokenizeError> {
    let text = render_prompt(model, request, default_kwargs)?;
    model.encode(&text).map_err(TokenizeError::Tokenizer)
}

/// The text the template adds for `completion` after the prompt of `request`.
pub fn completion_text(
    model: &Model,
    request: &ChatRequest,
    default_kwargs: &Map<String, Value>,
    prompt_text: &str,
    completion: &Completion,
) -> Result<String, TokenizeError> {
    let mut messages = normalize_messages(&request.messages)?;
    let mut generated = completion_message(completion);
    if request.continue_final_message
        && let Some(last) = messages.pop()
    {
        let before = last.get("content").and_then(Value::as_str).unwrap_or("");
        generated["content"] = format!("{before}{}", completion.text).into();
        if let Some(role) = last.get("role") {
            generated["role"] = role.clone();
        }
    }
    messages.extend(normalize_messages(&[generated])?);
    let full = render(model, request, default_kwargs, &messages, false, false)?;
    full.strip_prefix(prompt_text)
        .map(str::to_owned)
        .ok_or(TokenizeError::CompletionNotPrefix)
}

/// Cuts tokenized completion text after its first stop token; removes the stop token
/// when generation hit the length limit, adds EOS when the template wrote none.
pub fn finish_completion(model: &Model, mut ids: Vec<u32>, finish_reason: &str) -> Vec<u32> {
    let stop_at = ids.iter().position(|id| model.is_stop(*id));
    match stop_at {
        Some(at) => ids.truncate(at + 1),
        None => {
            if finish_reason != "length"
                && let Some(eos) = model.eos_id()
            {
                ids.push(eos);
            }
            return ids;
        }
    }
    if finish_reason == "length" {
        ids.pop();
    }
    ids
}

/// Where a call's ids came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IdSource {
    /// Returned by the inference server.
    Recorded,
    /// Computed from text here.
    Text,
}

/// The outcome of comparing recorded ids with the ids of the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriftCheck {
    /// Not compared (no recorded ids, or drift measurement is off).
    NotCompared,
    /// Equal.
    Same,
    /// Different, for this reason.
    Drift(DriftKind),
    /// The text could not be tokenized (the name of the error).
    Failed(&'static str),
}

/// A call as token ids.
#[derive(Debug, Clone)]
pub struct TokenizedCall {
    /// The call's span id.
    pub span_id: String,
    /// The prompt.
    pub prompt_ids: Vec<u32>,
    /// The completion (EOS included when the model produced it).
    pub completion_ids: Vec<u32>,
    /// Inference log-probabilities of the completion tokens, when recorded for each.
    pub logprobs: Option<Vec<f64>>,
    /// Where `prompt_ids` came from.
    pub prompt_source: IdSource,
    /// Where `completion_ids` came from.
    pub completion_source: IdSource,
    /// Recorded prompt ids against the rendered template.
    pub prompt_drift: DriftCheck,
    /// Recorded completion ids against the tokenized text.
    pub completion_drift: DriftCheck,
    /// Policy version that served the call.
    pub policy_version: String,
}

/// Turns one call into ids; see the module documentation for the rules.
pub fn tokenize_call(
    model: &Model,
    call: &LlmCall,
    options: &TokenizeOptions,
) -> Result<TokenizedCall, TokenizeError> {
    let completion = call
        .completions
        .iter()
        .find(|c| c.index == 0)
        .or(call.completions.first())
        .ok_or(TokenizeError::NoCompletion)?;
    let recorded_prompt = options.use_recorded_ids && !call.prompt_token_ids.is_empty();
    let recorded_completion = options.use_recorded_ids && !completion.token_ids.is_empty();
    let need_text = !(recorded_prompt && recorded_completion) || options.measure_drift;

    let text = need_text.then(|| text_ids(model, call, completion, options));
    // Where a side has no recorded ids, the text must work.
    if !(recorded_prompt && recorded_completion)
        && let Some(Err(_)) = &text
    {
        return Err(text
            .and_then(Result::err)
            .unwrap_or(TokenizeError::NoCompletion));
    }
    let compare = |recorded: &[u32], side: Side| match &text {
        Some(Ok(ids)) => check(model, side(ids), recorded),
        Some(Err(e)) => DriftCheck::Failed(e.reason()),
        None => DriftCheck::NotCompared,
    };
    let from_text = |side: Side| match &text {
        Some(Ok(ids)) => Ok(side(ids).to_vec()),
        _ => Err(TokenizeError::NoCompletion),
    };
    let (prompt_ids, prompt_source, prompt_drift) = if recorded_prompt {
        let drift = compare(&call.prompt_token_ids, |t| &t.prompt);
        (call.prompt_token_ids.clone(), IdSource::Recorded, drift)
    } else {
        (
            from_text(|t| &t.prompt)?,
            IdSource::Text,
            DriftCheck::NotCompared,
        )
    };
    let (completion_ids, completion_source, completion_drift) = if recorded_completion {
        let drift = compare(&completion.token_ids, |t| &t.completion);
        (completion.token_ids.clone(), IdSource::Recorded, drift)
    } else {
        (
            from_text(|t| &t.completion)?,
            IdSource::Text,
            DriftCheck::NotCompared,
        )
    };
    let logprobs = (completion_source == IdSource::Recorded
        && completion.logprobs.len() == completion_ids.len()
        && completion.logprobs.iter().all(|l| l.is_finite()))
    .then(|| completion.logprobs.clone());
    Ok(TokenizedCall {
        span_id: call.span_id.clone(),
        prompt_ids,
        completion_ids,
        logprobs,
        prompt_source,
        completion_source,
        prompt_drift,
        completion_drift,
        policy_version: call.policy_version.clone(),
    })
}

fn check(model: &Model, text_ids: &[u32], recorded: &[u32]) -> DriftCheck {
    match drift::classify(model, text_ids, recorded, Relation::Equal) {
        None => DriftCheck::Same,
        Some(kind) => DriftCheck::Drift(kind),
    }
}

/// Prompt and completion ids computed from a call's text.
struct TextIds {
    prompt: Vec<u32>,
    completion: Vec<u32>,
}

/// Picks one side of [`TextIds`].
type Side = fn(&TextIds) -> &[u32];

/// Prompt and completion ids computed from the call's text.
fn text_ids(
    model: &Model,
    call: &LlmCall,
    completion: &Completion,
    options: &TokenizeOptions,
) -> Result<TextIds, TokenizeError> {
    let body: Value = serde_json::from_slice(&call.request_body)
        .map_err(|e| TokenizeError::BadRequest(format!("not JSON: {e}")))?;
    let tok = |text: &str| model.encode(text).map_err(TokenizeError::Tokenizer);
    match call.api() {
        Api::ChatCompletions => {
            let request = ChatRequest::from_json(&body)?;
            let prompt_text = render_prompt(model, &request, &options.chat_template_kwargs)?;
            let completion_text = completion_text(
                model,
                &request,
                &options.chat_template_kwargs,
                &prompt_text,
                completion,
            )?;
            let completion_ids =
                finish_completion(model, tok(&completion_text)?, &completion.finish_reason);
            Ok(TextIds {
                prompt: tok(&prompt_text)?,
                completion: completion_ids,
            })
        }
        Api::Completions => {
            let prompt = match body.get("prompt") {
                Some(Value::String(s)) => model
                    .encode_with(s, true)
                    .map_err(TokenizeError::Tokenizer)?,
                Some(Value::Array(items)) if items.iter().all(Value::is_u64) => items
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|n| u32::try_from(n).map_err(|_| bad_token(n)))
                    .collect::<Result<_, _>>()?,
                _ => {
                    return Err(TokenizeError::BadRequest(
                        "`prompt` must be one string or one list of token ids".into(),
                    ));
                }
            };
            let mut completion_ids = tok(&completion.text)?;
            if completion.finish_reason != "length"
                && let Some(eos) = model.eos_id()
            {
                completion_ids.push(eos);
            }
            Ok(TextIds {
                prompt,
                completion: completion_ids,
            })
        }
        other => Err(TokenizeError::UnsupportedApi(other)),
    }
}

fn bad_token(n: u64) -> TokenizeError {
    TokenizeError::BadRequest(format!("token id {n} does not fit in 32 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn normalization_follows_vllm() {
        let out = normalize_messages(&[
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}},
                {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "{not json"}},
            ]}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        ])
        .unwrap();
        assert_eq!(out[0]["content"], "");
        assert_eq!(
            out[0]["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert_eq!(out[0]["tool_calls"][1]["function"]["arguments"], json!({}));
        assert_eq!(
            out[0]["tool_calls"][2]["function"]["arguments"],
            "{not json"
        );
        assert_eq!(out[1]["content"], "a\nb");
        let err =
            normalize_messages(&[json!({"role": "user", "content": [{"type": "image_url"}]})])
                .unwrap_err();
        assert!(err.to_string().contains("image_url"), "{err}");
    }

    #[test]
    fn requests_are_read_with_vllm_defaults() {
        let r = ChatRequest::from_json(&json!({"messages": [], "model": "m"})).unwrap();
        assert!(r.add_generation_prompt && !r.continue_final_message && r.tools.is_none());
        let r = ChatRequest::from_json(&json!({"messages": [], "tools": []})).unwrap();
        assert_eq!(r.tools, Some(vec![]));
        for bad in [
            json!([]),
            json!({}),
            json!({"messages": {}}),
            json!({"messages": [], "add_generation_prompt": 1}),
        ] {
            assert!(ChatRequest::from_json(&bad).is_err(), "{bad}");
        }
    }
}
