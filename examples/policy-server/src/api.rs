//! The request side of the API: OpenAI-shaped errors, and a chat completions body checked
//! field by field into [`ChatParams`] before it reaches the model.
//!
//! Pure: no IO. Unknown fields are ignored (clients send many); known fields this server
//! cannot honour with a non-default value (`n > 1`, `top_logprobs > 0`, penalties, ...)
//! are refused with a 400 that names them, so that a harness never gets silently
//! different sampling from what it asked for.

use http::StatusCode;
use serde_json::{Map, Value, json};
use tapline_trainer::tokenize::{ChatRequest, TokenizeError};

/// An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What is wrong and, where it helps, what to do.
    pub message: String,
    /// The request field at fault, if any.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_owned()),
        }
    }

    /// A 400 not tied to one field.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    /// An error with any status.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// OpenAI's `type` for this status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => "invalid_request_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::METHOD_NOT_ALLOWED => "invalid_request_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            _ => "internal_server_error",
        }
    }

    /// The JSON body.
    pub fn to_json(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": null,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// A tokenize-stage error as a 400, naming the field when its message does (the
/// trainer's messages put field names in backticks).
pub fn tokenize_error(error: &TokenizeError) -> ApiError {
    let message = error.to_string();
    let param = match error {
        TokenizeError::BadRequest(m) => m
            .split('`')
            .nth(1)
            .map_or_else(|| "messages".to_owned(), str::to_owned),
        _ => "messages".to_owned(),
    };
    ApiError {
        status: StatusCode::BAD_REQUEST,
        message,
        param: Some(param),
    }
}

/// A checked chat completions request.
#[derive(Debug, Clone)]
pub struct ChatParams {
    /// The requested model: an adapter loaded by `/v1/load_lora_adapter` under this
    /// name serves the request; the served model name (or none), the base weights; any
    /// other name is answered 404 (the HTTP side checks it).
    pub model: Option<String>,
    /// Messages, tools, template kwargs and generation-prompt flags, read by the trainer's
    /// own code so that the prompt ids equal the trainer's.
    pub request: ChatRequest,
    /// Answer as server-sent events.
    pub stream: bool,
    /// With `stream`: a last chunk with the usage.
    pub include_usage: bool,
    /// Sampling temperature; below 1e-5 means greedy.
    pub temperature: f64,
    /// Nucleus sampling mass, in (0, 1].
    pub top_p: f64,
    /// The most tokens to generate; `None`: the server default.
    pub max_tokens: Option<u32>,
    /// Seed of this request's sampling; `None`: derived from the server seed.
    pub seed: Option<u64>,
    /// Strings that end the generation (not included in the content).
    pub stop: Vec<String>,
    /// Per-token log-probabilities in the response.
    pub logprobs: bool,
    /// vLLM's `return_token_ids`: prompt and completion ids in the response.
    pub return_token_ids: bool,
}

/// Reads a field that must be a number (or null / absent).
fn number(obj: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| ApiError::field(name, format!("`{name}` is not a finite number"))),
        Some(_) => Err(ApiError::field(name, format!("`{name}` must be a number"))),
    }
}

/// Reads a field that must be an integer (or null / absent).
fn integer(obj: &Map<String, Value>, name: &str) -> Result<Option<i128>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
            .map(Some)
            .ok_or_else(|| ApiError::field(name, format!("`{name}` must be an integer"))),
        Some(_) => Err(ApiError::field(
            name,
            format!("`{name}` must be an integer"),
        )),
    }
}

/// Reads a field that must be a boolean (or null / absent).
fn boolean(obj: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::field(name, format!("`{name}` must be a boolean"))),
    }
}

/// A positive token count that fits in `u32`.
fn token_count(obj: &Map<String, Value>, name: &str) -> Result<Option<u32>, ApiError> {
    match integer(obj, name)? {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(u32::try_from(n).unwrap_or(u32::MAX))),
        Some(n) => Err(ApiError::field(
            name,
            format!("`{name}` must be at least 1, got {n}"),
        )),
    }
}

/// Fields this server does not implement, with the value that means "off": a request
/// that sets one to anything else is refused.
fn refuse_unsupported(obj: &Map<String, Value>) -> Result<(), ApiError> {
    let unsupported = |name: &str, what: &str| {
        ApiError::field(
            name,
            format!("`{name}` {what} is not supported by tapline-policy-server"),
        )
    };
    let is_off = |v: &Value, off: &[Value]| v.is_null() || off.contains(v);
    let zero = || [json!(0), json!(0.0)];
    for name in ["presence_penalty", "frequency_penalty"] {
        if let Some(v) = obj.get(name)
            && !is_off(v, &zero())
        {
            return Err(unsupported(name, "other than 0"));
        }
    }
    if let Some(v) = obj.get("repetition_penalty")
        && !is_off(v, &[json!(1), json!(1.0)])
    {
        return Err(unsupported("repetition_penalty", "other than 1"));
    }
    if let Some(v) = obj.get("min_p")
        && !is_off(v, &zero())
    {
        return Err(unsupported("min_p", "other than 0"));
    }
    if let Some(v) = obj.get("top_k")
        && !is_off(v, &[json!(0), json!(-1)])
    {
        return Err(unsupported("top_k", "other than -1 or 0"));
    }
    if let Some(v) = obj.get("logit_bias")
        && !(v.is_null() || v.as_object().is_some_and(Map::is_empty))
    {
        return Err(unsupported("logit_bias", ""));
    }
    for name in ["echo", "ignore_eos", "include_stop_str_in_output"] {
        if obj.get(name).and_then(Value::as_bool) == Some(true) {
            return Err(unsupported(name, "true"));
        }
    }
    if obj.get("skip_special_tokens").and_then(Value::as_bool) == Some(false) {
        return Err(unsupported("skip_special_tokens", "false"));
    }
    if let Some(v) = obj.get("prompt_logprobs")
        && !v.is_null()
    {
        return Err(unsupported("prompt_logprobs", ""));
    }
    if let Some(v) = obj.get("stop_token_ids")
        && !(v.is_null() || v.as_array().is_some_and(Vec::is_empty))
    {
        return Err(unsupported("stop_token_ids", ""));
    }
    if let Some(v) = obj.get("response_format")
        && !v.is_null()
        && v.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(unsupported(
            "response_format",
            "other than {\"type\": \"text\"}",
        ));
    }
    if let Some(v) = obj.get("tool_choice")
        && !(v.is_null() || v == "auto" || v == "none")
    {
        return Err(unsupported(
            "tool_choice",
            "other than \"auto\" or \"none\" (tool calls are not parsed; they stay in `content`)",
        ));
    }
    Ok(())
}

impl ChatParams {
    /// Checks a parsed request body.
    pub fn from_json(body: &Value) -> Result<Self, ApiError> {
        let obj = body
            .as_object()
            .ok_or_else(|| ApiError::bad_request("the request body must be a JSON object"))?;
        if !obj.contains_key("messages") {
            return Err(ApiError::field("messages", "`messages` is required"));
        }
        let request = ChatRequest::from_json(body).map_err(|e| tokenize_error(&e))?;
        if let Some(v) = obj.get("model")
            && !(v.is_null() || v.is_string())
        {
            return Err(ApiError::field("model", "`model` must be a string"));
        }
        refuse_unsupported(obj)?;

        match integer(obj, "n")? {
            None | Some(1) => {}
            Some(n) => {
                return Err(ApiError::field(
                    "n",
                    format!("`n` = {n}: only n = 1 is supported; send separate requests"),
                ));
            }
        }
        let logprobs = boolean(obj, "logprobs")?.unwrap_or(false);
        match integer(obj, "top_logprobs")? {
            None | Some(0) => {}
            Some(n) => {
                return Err(ApiError::field(
                    "top_logprobs",
                    format!("`top_logprobs` = {n}: only 0 is supported"),
                ));
            }
        }
        let stream = boolean(obj, "stream")?.unwrap_or(false);
        let include_usage = match obj.get("stream_options") {
            None | Some(Value::Null) => false,
            Some(Value::Object(o)) => {
                if !stream {
                    return Err(ApiError::field(
                        "stream_options",
                        "`stream_options` can only be set when `stream` is true",
                    ));
                }
                boolean(o, "include_usage")
                    .map_err(|_| {
                        ApiError::field(
                            "stream_options",
                            "`stream_options.include_usage` must be a boolean",
                        )
                    })?
                    .unwrap_or(false)
            }
            Some(_) => {
                return Err(ApiError::field(
                    "stream_options",
                    "`stream_options` must be an object",
                ));
            }
        };
        let temperature = number(obj, "temperature")?.unwrap_or(1.0);
        if temperature < 0.0 {
            return Err(ApiError::field(
                "temperature",
                format!("`temperature` must be at least 0, got {temperature}"),
            ));
        }
        let top_p = number(obj, "top_p")?.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::field(
                "top_p",
                format!("`top_p` must be in (0, 1], got {top_p}"),
            ));
        }
        // vLLM: max_completion_tokens wins over the deprecated max_tokens.
        let max_completion_tokens = token_count(obj, "max_completion_tokens")?;
        let max_tokens = max_completion_tokens.or(token_count(obj, "max_tokens")?);
        let seed = integer(obj, "seed")?.map(|s| s as u64);
        let stop = match obj.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(list)) => list
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_owned).ok_or_else(|| {
                        ApiError::field("stop", "`stop` must be a string or a list of strings")
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(ApiError::field(
                    "stop",
                    "`stop` must be a string or a list of strings",
                ));
            }
        };
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::field("stop", "`stop` strings must not be empty"));
        }
        let return_token_ids = boolean(obj, "return_token_ids")?.unwrap_or(false);
        Ok(ChatParams {
            model: obj.get("model").and_then(Value::as_str).map(str::to_owned),
            request,
            stream,
            include_usage,
            temperature,
            top_p,
            max_tokens,
            seed,
            stop,
            logprobs,
            return_token_ids,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_err(body: Value, param: &str) {
        let err = ChatParams::from_json(&body).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(err.param.as_deref(), Some(param), "{body}: {err}");
        assert!(err.message.contains(param), "{body}: {err}");
        let shaped = err.to_json();
        assert_eq!(shaped["error"]["param"], param);
        assert_eq!(shaped["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn defaults_follow_openai() {
        let p = ChatParams::from_json(&json!({"model": "m", "messages": []})).unwrap();
        assert!(!p.stream && !p.include_usage && !p.logprobs && !p.return_token_ids);
        assert_eq!((p.temperature, p.top_p), (1.0, 1.0));
        assert_eq!((p.max_tokens, p.seed), (None, None));
        assert!(p.stop.is_empty());
        assert!(p.request.add_generation_prompt);
    }

    #[test]
    fn fields_are_read() {
        let p = ChatParams::from_json(&json!({
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0, "top_p": 0.5, "max_tokens": 7, "max_completion_tokens": 9,
            "seed": -1, "stop": "x", "logprobs": true, "top_logprobs": 0, "n": 1,
            "stream": true, "stream_options": {"include_usage": true},
            "return_token_ids": true, "tools": [], "chat_template_kwargs": {"a": 1},
            "presence_penalty": 0, "top_k": -1, "tool_choice": "auto", "user": "u",
        }))
        .unwrap();
        assert_eq!(p.max_tokens, Some(9));
        assert_eq!(p.seed, Some(u64::MAX));
        assert_eq!(p.stop, ["x"]);
        assert!(p.stream && p.include_usage && p.logprobs && p.return_token_ids);
        assert_eq!(p.request.tools, Some(vec![]));
        assert_eq!(p.request.chat_template_kwargs["a"], 1);
    }

    #[test]
    fn bad_fields_are_named() {
        let m = || json!([]);
        check_err(json!({"messages": m(), "n": 2}), "n");
        check_err(json!({"messages": m(), "n": "1"}), "n");
        check_err(json!({"messages": m(), "top_logprobs": 3}), "top_logprobs");
        check_err(json!({"messages": m(), "temperature": -1}), "temperature");
        check_err(
            json!({"messages": m(), "temperature": "hot"}),
            "temperature",
        );
        check_err(json!({"messages": m(), "top_p": 0}), "top_p");
        check_err(json!({"messages": m(), "max_tokens": 0}), "max_tokens");
        check_err(
            json!({"messages": m(), "max_completion_tokens": -5}),
            "max_completion_tokens",
        );
        check_err(json!({"messages": m(), "stop": [1]}), "stop");
        check_err(json!({"messages": m(), "stop": ""}), "stop");
        check_err(json!({"messages": m(), "logprobs": 1}), "logprobs");
        check_err(
            json!({"messages": m(), "stream_options": {"include_usage": true}}),
            "stream_options",
        );
        check_err(json!({"messages": m(), "seed": 1.5}), "seed");
        check_err(
            json!({"messages": m(), "frequency_penalty": 0.5}),
            "frequency_penalty",
        );
        check_err(
            json!({"messages": m(), "tool_choice": "required"}),
            "tool_choice",
        );
        check_err(json!({"messages": {}}), "messages");
        check_err(json!({}), "messages");
        check_err(json!({"messages": m(), "tools": 3}), "tools");
        check_err(json!({"messages": m(), "model": 3}), "model");
        assert!(
            ChatParams::from_json(&json!([]))
                .unwrap_err()
                .param
                .is_none()
        );
    }
}
