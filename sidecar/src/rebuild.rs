//! Completions, usage and token ids rebuilt from a response body or an event stream.
//!
//! Everything here is best effort and never fails: what cannot be parsed becomes a
//! warning in [`Rebuilt::warnings`], and the raw bytes are kept by the caller so a record
//! can be re-processed later.
//!
//! Supported shapes (see `PROTOCOLS.md`, "Streams the sidecar must rebuild"):
//! - OpenAI chat completions and legacy completions, as JSON or as `data:` chunks ending
//!   with `data: [DONE]`, including vLLM's `prompt_token_ids`, `token_ids` and logprobs;
//! - OpenAI Responses, as JSON or as named events (the terminal `response.completed` /
//!   `.incomplete` / `.failed` event is the truth, deltas are the fallback);
//! - Anthropic Messages, as JSON or as named events.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::io::Read;

use crate::json::Json as Value;
use tapline_proto::{Api, Completion, LlmCall, Outcome, ToolCall, Usage};

use crate::sse::{SseEvent, SseParser};

/// What could be rebuilt from one response.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rebuilt {
    /// One entry per choice, sorted by index (a single entry for Responses and Messages).
    pub completions: Vec<Completion>,
    /// Token usage, when the upstream reported it.
    pub usage: Option<Usage>,
    /// `model` named in the response (empty when absent).
    pub response_model: String,
    /// Token ids of the prompt, when the upstream returned them (vLLM/SGLang).
    pub prompt_token_ids: Vec<u32>,
    /// An error reported inside a 2xx body or stream (OpenAI `{"error":...}` chunk,
    /// Anthropic `error` event, Responses `response.failed`/`error`): its message.
    pub stream_error: Option<String>,
    /// Things that could not be parsed; never fatal.
    pub warnings: Vec<String>,
}

/// Rebuilds completions from a response body.
///
/// `body` is the response body as received (already decompressed by the caller), JSON when
/// `!streamed`, SSE bytes when `streamed`. Works on truncated input (returns what it
/// could, with a warning).
pub fn rebuild(api: Api, streamed: bool, body: &[u8]) -> Rebuilt {
    let mut r = Rebuilt::default();
    let family = match api {
        Api::ChatCompletions | Api::Completions => Family::OpenAi,
        Api::Responses => Family::Responses,
        Api::AnthropicMessages => Family::Anthropic,
        Api::Other | Api::Unspecified => return r,
    };
    if streamed || (!looks_like_json(body) && looks_like_sse(body)) {
        let events = sse_events(body);
        if !(events.is_empty() && looks_like_json(body)) {
            if !streamed {
                r.warnings
                    .push("expected a JSON body, got an event stream; parsed it as events".into());
            }
            match family {
                Family::OpenAi => openai_stream(&events, &mut r),
                Family::Responses => responses_stream(&events, &mut r),
                Family::Anthropic => anthropic_stream(&events, &mut r),
            }
            return r;
        }
        r.warnings
            .push("expected an event stream, got a JSON body; parsed it as JSON".into());
    }
    let Some(value) = parse_json(body, || "response body".to_owned(), &mut r.warnings) else {
        return r;
    };
    match family {
        Family::OpenAi => {
            let mut st = OpenAiState::default();
            st.apply(&value, false, &mut r.warnings);
            if !value.get("choices").is_some_and(Value::is_array) && st.error.is_none() {
                r.warnings.push("response body: no choices array".into());
            }
            st.finish(&mut r);
        }
        Family::Responses => responses_json(&value, &mut r),
        Family::Anthropic => anthropic_json(&value, &mut r),
    }
    r
}

/// What [`complete`] found, for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Completed {
    /// The record has capture warnings.
    pub warned: bool,
    /// A success response whose body reported an error (the record's outcome became
    /// `upstream_error`).
    pub body_error: bool,
}

/// Fills in what a captured call's record derives from its raw bytes: the rebuilt
/// completions, usage, response model and prompt ids, warnings, the default policy
/// version, and the final outcome (an error inside a 2xx body, or a non-2xx status, make
/// an `ok` call `upstream_error`).
///
/// The proxy spools records as captured and the segment builder calls this, so a
/// response never waits for its own rebuild (`spool::Stored`). Pure: the same record
/// always completes the same way. The response body is decoded by the recorded
/// `content-encoding` header (always on the allow-list).
pub fn complete(call: &mut LlmCall) -> Completed {
    let api = call.api();
    let transport_ok = call.outcome() == Outcome::Ok;
    let mut body_error = false;
    if api != Api::Other && !call.response_body.is_empty() {
        let encoding = call
            .response_headers
            .get("content-encoding")
            .map(String::as_str);
        match decode_content(encoding, &call.response_body) {
            Ok(decoded) => {
                let rebuilt = rebuild(api, call.streamed, &decoded);
                call.completions = rebuilt.completions;
                call.usage = rebuilt.usage;
                if !rebuilt.response_model.is_empty() {
                    call.response_model = rebuilt.response_model;
                }
                call.prompt_token_ids = rebuilt.prompt_token_ids;
                if let Some(message) = rebuilt.stream_error
                    && transport_ok
                {
                    call.outcome = Outcome::UpstreamError as i32;
                    call.error = message;
                    body_error = (200..300).contains(&call.http_status);
                }
                call.capture_warnings.extend(rebuilt.warnings);
            }
            Err(e) => call
                .capture_warnings
                .push(format!("cannot decode response body: {e}")),
        }
    }
    if call.response_truncated {
        call.capture_warnings.push(format!(
            "response body truncated to {} bytes",
            call.response_body.len()
        ));
    }
    if call.policy_version.is_empty() {
        call.policy_version = call.response_model.clone();
    }
    call.outcome = by_status(call.outcome(), call.http_status) as i32;
    Completed {
        warned: !call.capture_warnings.is_empty(),
        body_error,
    }
}

/// A call that ended `ok` in transport but with a non-2xx status is an `upstream_error`.
pub fn by_status(outcome: Outcome, http_status: u32) -> Outcome {
    match outcome {
        Outcome::Ok if !(200..300).contains(&http_status) => Outcome::UpstreamError,
        other => other,
    }
}

#[derive(Debug, Clone, Copy)]
enum Family {
    OpenAi,
    Responses,
    Anthropic,
}

/// Largest body [`decode_content`] produces before giving up (guards against
/// decompression bombs; see [`crate::limits`]): four times the capture cap, far above
/// any JSON or SSE answer a model gives, and small enough for the sidecar's memory.
pub const MAX_DECODED_BYTES: usize = 128 << 20;

/// Decompresses a body according to a `Content-Encoding` header value (identity, gzip,
/// x-gzip, deflate, zstd, or a comma-separated list of them, applied in order; others ->
/// `Err` with a message). Accepts a truncated stream by returning what decoded (`Ok`) —
/// callers flag truncation. Corrupt data is an `Err`.
pub fn decode_content<'a>(encoding: Option<&str>, body: &'a [u8]) -> Result<Cow<'a, [u8]>, String> {
    let mut data = Cow::Borrowed(body);
    let Some(encoding) = encoding else {
        return Ok(data);
    };
    let codings: Vec<String> = encoding
        .split(',')
        .map(|c| c.trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty() && c != "identity")
        .collect();
    // Codings are listed in the order they were applied: undo them from the last.
    for coding in codings.iter().rev() {
        let decoded = decode_one(coding, &data)?;
        data = Cow::Owned(decoded);
    }
    Ok(data)
}

fn decode_one(coding: &str, body: &[u8]) -> Result<Vec<u8>, String> {
    match coding {
        "gzip" | "x-gzip" => read_lenient(flate2::read::MultiGzDecoder::new(body), coding),
        "deflate" => {
            // HTTP `deflate` is zlib-wrapped, but some servers send raw deflate.
            if looks_like_zlib(body) {
                read_lenient(flate2::read::ZlibDecoder::new(body), coding)
            } else {
                read_lenient(flate2::read::DeflateDecoder::new(body), coding)
            }
        }
        "zstd" => {
            let decoder = zstd::stream::read::Decoder::new(body)
                .map_err(|e| format!("content-encoding zstd: {e}"))?;
            read_lenient(decoder, coding)
        }
        other => Err(format!("unsupported content-encoding {other:?}")),
    }
}

fn looks_like_zlib(body: &[u8]) -> bool {
    match body {
        [cmf, flg, ..] => cmf & 0x0f == 8 && (u16::from(*cmf) * 256 + u16::from(*flg)) % 31 == 0,
        _ => false,
    }
}

/// Reads a decoder to its end; a premature end of input (truncation) keeps what decoded.
fn read_lenient(mut reader: impl Read, coding: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        match reader.read(&mut buf) {
            Ok(0) => return Ok(out),
            Ok(n) => {
                out.extend_from_slice(buf.get(..n).unwrap_or_default());
                if out.len() > MAX_DECODED_BYTES {
                    return Err(format!(
                        "content-encoding {coding}: decoded body exceeds {MAX_DECODED_BYTES} bytes"
                    ));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(out),
            Err(e) => return Err(format!("content-encoding {coding}: {e}")),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Shared helpers

fn sse_events(body: &[u8]) -> Vec<SseEvent> {
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    parser.feed(body, &mut events);
    parser.finish(&mut events);
    events
}

fn trimmed_start(body: &[u8]) -> &[u8] {
    let start = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(body.len());
    body.get(start..).unwrap_or_default()
}

fn looks_like_json(body: &[u8]) -> bool {
    matches!(trimmed_start(body).first(), Some(b'{' | b'['))
}

fn looks_like_sse(body: &[u8]) -> bool {
    let t = trimmed_start(body);
    [&b"data:"[..], b"event:", b":", b"id:"]
        .iter()
        .any(|p| t.starts_with(p))
}

fn parse_json<'a>(
    bytes: &'a [u8],
    what: impl FnOnce() -> String,
    warnings: &mut Vec<String>,
) -> Option<Value<'a>> {
    match Value::parse(bytes) {
        Ok(v) => Some(v),
        Err(e) => {
            warnings.push(format!("{}: invalid JSON: {e}", what()));
            None
        }
    }
}

/// Parses one event's data; `None` (with a warning) when it is not JSON.
fn event_json<'a>(n: usize, ev: &'a SseEvent, warnings: &mut Vec<String>) -> Option<Value<'a>> {
    let what = || match &ev.event {
        Some(name) => format!("event {n} ({name})"),
        None => format!("event {n}"),
    };
    parse_json(ev.data.as_bytes(), what, warnings)
}

fn get_str<'a>(v: &'a Value<'_>, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn get_u64(v: &Value<'_>, path: &[&str]) -> Option<u64> {
    let mut cur = v;
    for key in path {
        cur = cur.get(key)?;
    }
    cur.as_u64()
}

fn compact(v: &Value<'_>) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// A tool call's arguments: the raw string, or compact JSON when an object was sent.
fn arguments_text(v: &Value<'_>) -> String {
    match v {
        Value::String(s) => s.to_string(),
        Value::Null => String::new(),
        other => compact(other),
    }
}

fn u32_array(v: Option<&Value<'_>>) -> Vec<u32> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect()
        })
        .unwrap_or_default()
}

/// The message of an error object (`{"message": ...}`, possibly nested in `error`).
fn error_message(err: &Value<'_>) -> String {
    match err {
        Value::String(s) => s.to_string(),
        Value::Object(_) => {
            if let Some(msg) = err.get("message").and_then(Value::as_str) {
                return msg.to_owned();
            }
            match err.get("error") {
                Some(inner @ (Value::Object(_) | Value::String(_))) => error_message(inner),
                _ => compact(err),
            }
        }
        other => compact(other),
    }
}

/// A non-null `error` member, if any.
fn error_member<'v, 'a>(v: &'v Value<'a>) -> Option<&'v Value<'a>> {
    v.get("error").filter(|e| !e.is_null())
}

fn set_first(field: &mut String, value: Option<&str>) {
    if field.is_empty()
        && let Some(s) = value
    {
        s.clone_into(field);
    }
}

/// OpenAI-style usage (chat/completions names, with Responses names as fallback).
fn openai_usage(u: &Value<'_>) -> Usage {
    let either = |a: &[&str], b: &[&str]| get_u64(u, a).or_else(|| get_u64(u, b)).unwrap_or(0);
    Usage {
        prompt_tokens: either(&["prompt_tokens"], &["input_tokens"]),
        completion_tokens: either(&["completion_tokens"], &["output_tokens"]),
        total_tokens: get_u64(u, &["total_tokens"]).unwrap_or(0),
        cached_prompt_tokens: either(
            &["prompt_tokens_details", "cached_tokens"],
            &["input_tokens_details", "cached_tokens"],
        ),
        reasoning_tokens: either(
            &["completion_tokens_details", "reasoning_tokens"],
            &["output_tokens_details", "reasoning_tokens"],
        ),
    }
}

#[derive(Debug, Default)]
struct ToolAcc {
    id: String,
    kind: String,
    name: String,
    arguments: String,
}

impl ToolAcc {
    fn into_tool_call(self, default_kind: &str) -> ToolCall {
        ToolCall {
            id: self.id,
            r#type: if self.kind.is_empty() {
                default_kind.to_owned()
            } else {
                self.kind
            },
            name: self.name,
            arguments: self.arguments,
        }
    }
}

#[derive(Debug, Default)]
struct ChoiceAcc {
    text: String,
    reasoning: String,
    tools: BTreeMap<u64, ToolAcc>,
    finish_reason: String,
    token_ids: Vec<u32>,
    logprobs: Vec<f64>,
}

impl ChoiceAcc {
    fn into_completion(self, index: u32) -> Completion {
        Completion {
            index,
            text: self.text,
            reasoning: self.reasoning,
            tool_calls: self
                .tools
                .into_values()
                .map(|t| t.into_tool_call("function"))
                .collect(),
            finish_reason: self.finish_reason,
            token_ids: self.token_ids,
            logprobs: self.logprobs,
        }
    }
}

/// Text of a `content` member: a string, null, or an array of parts with `text`.
fn content_text(v: &Value<'_>) -> String {
    match v {
        Value::String(s) => s.to_string(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.as_ref()),
                other => get_str(other, "text"),
            })
            .collect(),
        _ => String::new(),
    }
}

fn push_logprobs(out: &mut Vec<f64>, logprobs: &Value<'_>) {
    if let Some(content) = logprobs.get("content").and_then(Value::as_array) {
        out.extend(
            content
                .iter()
                .filter_map(|t| t.get("logprob").and_then(Value::as_f64)),
        );
    } else if let Some(list) = logprobs.get("token_logprobs").and_then(Value::as_array) {
        out.extend(list.iter().filter_map(Value::as_f64));
    }
}

// ---------------------------------------------------------------------------------------
// OpenAI chat completions and legacy completions

#[derive(Debug, Default)]
struct OpenAiState {
    choices: BTreeMap<u32, ChoiceAcc>,
    prompt_token_ids: Option<Vec<u32>>,
    model: String,
    usage: Option<Usage>,
    error: Option<String>,
}

impl OpenAiState {
    /// Applies a whole response (`streamed == false`) or one stream chunk.
    fn apply(&mut self, obj: &Value<'_>, streamed: bool, warnings: &mut Vec<String>) {
        if let Some(err) = error_member(obj) {
            self.error = Some(error_message(err));
        }
        set_first(&mut self.model, get_str(obj, "model"));
        if self.prompt_token_ids.is_none()
            && obj.get("prompt_token_ids").is_some_and(Value::is_array)
        {
            self.prompt_token_ids = Some(u32_array(obj.get("prompt_token_ids")));
        }
        if let Some(u) = obj.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(openai_usage(u));
        }
        let Some(choices) = obj.get("choices").and_then(Value::as_array) else {
            return;
        };
        for (pos, choice) in choices.iter().enumerate() {
            let index = match choice.get("index").and_then(Value::as_u64) {
                Some(i) => u32::try_from(i).ok(),
                None => u32::try_from(pos).ok(),
            };
            let Some(index) = index else {
                warnings.push("choice index out of range; skipped".into());
                continue;
            };
            if self.prompt_token_ids.is_none()
                && choice.get("prompt_token_ids").is_some_and(Value::is_array)
            {
                self.prompt_token_ids = Some(u32_array(choice.get("prompt_token_ids")));
            }
            let acc = self.choices.entry(index).or_default();
            apply_choice(acc, choice, streamed);
        }
    }

    fn finish(self, r: &mut Rebuilt) {
        r.completions = self
            .choices
            .into_iter()
            .map(|(index, acc)| acc.into_completion(index))
            .collect();
        r.usage = self.usage;
        r.response_model = self.model;
        r.prompt_token_ids = self.prompt_token_ids.unwrap_or_default();
        if self.error.is_some() {
            r.stream_error = self.error;
        }
    }
}

fn apply_choice(acc: &mut ChoiceAcc, choice: &Value<'_>, streamed: bool) {
    // Legacy completions carry `text` on the choice itself.
    if let Some(text) = get_str(choice, "text") {
        acc.text.push_str(text);
    }
    let msg = choice
        .get("message")
        .filter(|m| m.is_object())
        .or_else(|| choice.get("delta").filter(|m| m.is_object()));
    if let Some(msg) = msg {
        if let Some(content) = msg.get("content") {
            acc.text.push_str(&content_text(content));
        }
        let reasoning = get_str(msg, "reasoning_content").or_else(|| get_str(msg, "reasoning"));
        if let Some(reasoning) = reasoning {
            acc.reasoning.push_str(reasoning);
        }
        if let Some(calls) = msg.get("tool_calls").and_then(Value::as_array) {
            for (pos, call) in calls.iter().enumerate() {
                let key = tool_key(acc, call, pos, streamed);
                let tool = acc.tools.entry(key).or_default();
                set_first(&mut tool.id, get_str(call, "id").filter(|s| !s.is_empty()));
                set_first(
                    &mut tool.kind,
                    get_str(call, "type").filter(|s| !s.is_empty()),
                );
                if let Some(function) = call.get("function") {
                    set_first(
                        &mut tool.name,
                        get_str(function, "name").filter(|s| !s.is_empty()),
                    );
                    if let Some(args) = function.get("arguments") {
                        tool.arguments.push_str(&arguments_text(args));
                    }
                }
            }
        }
    }
    if let Some(reason) = get_str(choice, "finish_reason").filter(|s| !s.is_empty()) {
        reason.clone_into(&mut acc.finish_reason);
    }
    acc.token_ids.extend(u32_array(choice.get("token_ids")));
    if let Some(logprobs) = choice.get("logprobs").filter(|l| l.is_object()) {
        push_logprobs(&mut acc.logprobs, logprobs);
    }
}

/// Which tool call a fragment belongs to: its `index` in streams, its position in whole
/// messages; a streamed fragment without `index` starts a new call when it brings a new id.
fn tool_key(acc: &ChoiceAcc, call: &Value<'_>, pos: usize, streamed: bool) -> u64 {
    if !streamed {
        return pos as u64;
    }
    if let Some(i) = call.get("index").and_then(Value::as_u64) {
        return i;
    }
    let last = acc.tools.keys().next_back().copied();
    match get_str(call, "id").filter(|s| !s.is_empty()) {
        Some(id) => match acc.tools.iter().find(|(_, t)| t.id == id) {
            Some((k, _)) => *k,
            None => last.map_or(0, |k| k.saturating_add(1)),
        },
        None => last.unwrap_or(0),
    }
}

fn openai_stream(events: &[SseEvent], r: &mut Rebuilt) {
    let mut st = OpenAiState::default();
    let mut done = false;
    for (n, ev) in events.iter().enumerate() {
        let data = ev.data.trim();
        if data == "[DONE]" {
            done = true;
            continue;
        }
        if data.is_empty() {
            continue;
        }
        let is_error_event = ev.event.as_deref() == Some("error");
        match event_json(n, ev, &mut r.warnings) {
            Some(chunk) => {
                if is_error_event && error_member(&chunk).is_none() {
                    st.error = Some(error_message(&chunk));
                }
                st.apply(&chunk, true, &mut r.warnings);
            }
            None if is_error_event => st.error = Some(data.to_owned()),
            None => {}
        }
    }
    if !done {
        r.warnings.push("stream ended without [DONE]".into());
    }
    st.finish(r);
}

// ---------------------------------------------------------------------------------------
// OpenAI Responses

/// Adds one `output[]` item of a Responses object to `acc`.
fn apply_output_item(acc: &mut ChoiceAcc, item: &Value<'_>) {
    let parts = |key: &str| {
        item.get(key)
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
    };
    match get_str(item, "type").unwrap_or_default() {
        "message" => {
            for part in parts("content") {
                if get_str(part, "type") == Some("output_text") {
                    acc.text.push_str(get_str(part, "text").unwrap_or_default());
                    if let Some(lps) = part.get("logprobs").and_then(Value::as_array) {
                        acc.logprobs.extend(
                            lps.iter()
                                .filter_map(|t| t.get("logprob").and_then(Value::as_f64)),
                        );
                    }
                }
            }
        }
        "reasoning" => {
            for part in parts("summary").iter().chain(parts("content")) {
                acc.reasoning
                    .push_str(get_str(part, "text").unwrap_or_default());
            }
        }
        kind @ ("function_call" | "custom_tool_call") => {
            let (tool_kind, args_key) = if kind == "function_call" {
                ("function", "arguments")
            } else {
                ("custom", "input")
            };
            let key = acc.tools.len() as u64;
            acc.tools.insert(
                key,
                ToolAcc {
                    id: get_str(item, "call_id").unwrap_or_default().to_owned(),
                    kind: tool_kind.to_owned(),
                    name: get_str(item, "name").unwrap_or_default().to_owned(),
                    arguments: item.get(args_key).map(arguments_text).unwrap_or_default(),
                },
            );
        }
        _ => {}
    }
}

/// Parses a whole Responses object (the JSON body or a terminal event's `response`).
fn apply_response_object(resp: &Value<'_>, r: &mut Rebuilt) {
    if let Some(model) = get_str(resp, "model").filter(|m| !m.is_empty()) {
        model.clone_into(&mut r.response_model);
    }
    let mut acc = ChoiceAcc::default();
    match resp.get("output").and_then(Value::as_array) {
        Some(items) => items
            .iter()
            .for_each(|item| apply_output_item(&mut acc, item)),
        None => r.warnings.push("response: no output array".into()),
    }
    let status = get_str(resp, "status").unwrap_or_default();
    acc.finish_reason = if status == "incomplete" {
        resp.get("incomplete_details")
            .and_then(|d| get_str(d, "reason"))
            .filter(|s| !s.is_empty())
            .unwrap_or(status)
            .to_owned()
    } else {
        status.to_owned()
    };
    if let Some(u) = resp.get("usage").filter(|u| u.is_object()) {
        r.usage = Some(openai_usage(u));
    }
    if let Some(err) = error_member(resp) {
        r.stream_error = Some(error_message(err));
    } else if status == "failed" {
        r.stream_error = Some("response failed".into());
    }
    r.completions = vec![acc.into_completion(0)];
}

fn responses_json(value: &Value<'_>, r: &mut Rebuilt) {
    let is_response = value.get("output").is_some() || get_str(value, "object") == Some("response");
    if is_response {
        apply_response_object(value, r);
    } else if let Some(err) = error_member(value) {
        r.stream_error = Some(error_message(err));
    } else {
        r.warnings
            .push("response body: not a Responses object".into());
    }
}

/// An output item as seen through stream deltas.
#[derive(Debug, Default)]
struct ItemAcc<'a> {
    kind: String,
    text: String,
    reasoning: String,
    logprobs: Vec<f64>,
    call_id: String,
    name: String,
    arguments: String,
    arguments_done: Option<String>,
    done: Option<Value<'a>>,
}

fn responses_stream(events: &[SseEvent], r: &mut Rebuilt) {
    let mut terminal: Option<Value<'_>> = None;
    let mut model = String::new();
    let mut error: Option<String> = None;
    let mut items: BTreeMap<u64, ItemAcc<'_>> = BTreeMap::new();
    let mut by_item_id: HashMap<String, u64> = HashMap::new();
    for (n, ev) in events.iter().enumerate() {
        if ev.data.trim().is_empty() || ev.data.trim() == "[DONE]" {
            continue;
        }
        let Some(data) = event_json(n, ev, &mut r.warnings) else {
            if ev.event.as_deref() == Some("error") {
                error = Some(ev.data.trim().to_owned());
            }
            continue;
        };
        let kind = get_str(&data, "type")
            .or(ev.event.as_deref())
            .unwrap_or_default();
        let slot = {
            let index = data
                .get("output_index")
                .and_then(Value::as_u64)
                .or_else(|| get_str(&data, "item_id").and_then(|id| by_item_id.get(id).copied()));
            index.or_else(|| items.keys().next_back().copied())
        };
        let delta = get_str(&data, "delta").unwrap_or_default();
        match kind {
            "response.created" | "response.in_progress" | "response.queued" => {
                if let Some(resp) = data.get("response") {
                    set_first(&mut model, get_str(resp, "model").filter(|m| !m.is_empty()));
                }
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                match data.get("response").filter(|v| v.is_object()) {
                    Some(resp) => terminal = Some(resp.clone()),
                    None => r
                        .warnings
                        .push(format!("event {n} ({kind}): no response object")),
                }
                if kind == "response.failed" && error.is_none() {
                    error = Some(
                        data.get("response")
                            .and_then(error_member)
                            .map_or_else(|| "response failed".to_owned(), error_message),
                    );
                }
            }
            "error" => {
                error = Some(match data.get("message").and_then(Value::as_str) {
                    Some(msg) => msg.to_owned(),
                    None => error_member(&data).map_or_else(|| compact(&data), error_message),
                });
            }
            "response.output_item.added" => {
                let Some(item) = data.get("item") else {
                    continue;
                };
                let index = data
                    .get("output_index")
                    .and_then(Value::as_u64)
                    .unwrap_or(items.keys().next_back().map_or(0, |k| k.saturating_add(1)));
                if let Some(id) = get_str(item, "id") {
                    by_item_id.insert(id.to_owned(), index);
                }
                let acc = items.entry(index).or_default();
                set_first(&mut acc.kind, get_str(item, "type"));
                set_first(&mut acc.call_id, get_str(item, "call_id"));
                set_first(&mut acc.name, get_str(item, "name"));
                let args = get_str(item, "arguments").or_else(|| get_str(item, "input"));
                set_first(&mut acc.arguments, args);
            }
            "response.output_item.done" => {
                if let (Some(index), Some(item)) = (slot, data.get("item")) {
                    items.entry(index).or_default().done = Some(item.clone());
                }
            }
            "response.output_text.delta" => {
                if let Some(index) = slot {
                    let acc = items.entry(index).or_default();
                    acc.text.push_str(delta);
                    if let Some(lps) = data.get("logprobs").and_then(Value::as_array) {
                        acc.logprobs.extend(
                            lps.iter()
                                .filter_map(|t| t.get("logprob").and_then(Value::as_f64)),
                        );
                    }
                }
            }
            "response.reasoning_summary_text.delta" | "response.reasoning_text.delta" => {
                if let Some(index) = slot {
                    items.entry(index).or_default().reasoning.push_str(delta);
                }
            }
            "response.function_call_arguments.delta" | "response.custom_tool_call_input.delta" => {
                if let Some(index) = slot {
                    items.entry(index).or_default().arguments.push_str(delta);
                }
            }
            "response.function_call_arguments.done" | "response.custom_tool_call_input.done" => {
                let done = get_str(&data, "arguments").or_else(|| get_str(&data, "input"));
                if let (Some(index), Some(args)) = (slot, done) {
                    items.entry(index).or_default().arguments_done = Some(args.to_owned());
                }
            }
            _ => {}
        }
    }
    r.response_model = model;
    match terminal {
        Some(resp) => apply_response_object(&resp, r),
        None => {
            r.warnings
                .push("stream ended without a terminal response event; rebuilt from deltas".into());
            let mut acc = ChoiceAcc::default();
            for item in items.into_values() {
                if let Some(done) = &item.done {
                    apply_output_item(&mut acc, done);
                    continue;
                }
                acc.text.push_str(&item.text);
                acc.reasoning.push_str(&item.reasoning);
                acc.logprobs.extend(item.logprobs);
                let tool_kind = match item.kind.as_str() {
                    "function_call" => "function",
                    "custom_tool_call" => "custom",
                    _ => continue,
                };
                let key = acc.tools.len() as u64;
                acc.tools.insert(
                    key,
                    ToolAcc {
                        id: item.call_id,
                        kind: tool_kind.to_owned(),
                        name: item.name,
                        arguments: item.arguments_done.unwrap_or(item.arguments),
                    },
                );
            }
            if !events.is_empty() {
                r.completions = vec![acc.into_completion(0)];
            }
        }
    }
    if error.is_some() {
        r.stream_error = error;
    }
}

// ---------------------------------------------------------------------------------------
// Anthropic Messages

/// One content block of a message.
#[derive(Debug, Default)]
struct BlockAcc<'a> {
    kind: String,
    text: String,
    thinking: String,
    id: String,
    name: String,
    input: Option<Value<'a>>,
    partial_json: String,
}

impl<'a> BlockAcc<'a> {
    fn from_block(block: &Value<'a>) -> Self {
        BlockAcc {
            kind: get_str(block, "type").unwrap_or_default().to_owned(),
            text: get_str(block, "text").unwrap_or_default().to_owned(),
            thinking: get_str(block, "thinking").unwrap_or_default().to_owned(),
            id: get_str(block, "id").unwrap_or_default().to_owned(),
            name: get_str(block, "name").unwrap_or_default().to_owned(),
            input: block.get("input").cloned(),
            partial_json: String::new(),
        }
    }
}

#[derive(Debug, Default)]
struct AnthropicUsage {
    seen: bool,
    input: Option<u64>,
    output: Option<u64>,
    cache_read: Option<u64>,
}

impl AnthropicUsage {
    fn apply(&mut self, u: &Value<'_>) {
        if !u.is_object() {
            return;
        }
        self.seen = true;
        if let Some(n) = get_u64(u, &["input_tokens"]) {
            self.input = Some(n);
        }
        if let Some(n) = get_u64(u, &["output_tokens"]) {
            self.output = Some(n);
        }
        if let Some(n) = get_u64(u, &["cache_read_input_tokens"]) {
            self.cache_read = Some(n);
        }
    }

    fn into_usage(self) -> Option<Usage> {
        self.seen.then(|| Usage {
            prompt_tokens: self.input.unwrap_or(0),
            completion_tokens: self.output.unwrap_or(0),
            total_tokens: match (self.input, self.output) {
                (Some(i), Some(o)) => i.saturating_add(o),
                _ => 0,
            },
            cached_prompt_tokens: self.cache_read.unwrap_or(0),
            reasoning_tokens: 0,
        })
    }
}

/// The single completion of a message, from its blocks in index order.
fn anthropic_completion(blocks: BTreeMap<u64, BlockAcc<'_>>, stop_reason: String) -> Completion {
    let mut c = Completion {
        finish_reason: stop_reason,
        ..Completion::default()
    };
    for block in blocks.into_values() {
        match block.kind.as_str() {
            "text" => c.text.push_str(&block.text),
            "thinking" => c.reasoning.push_str(&block.thinking),
            "tool_use" | "server_tool_use" => {
                let arguments = if block.partial_json.is_empty() {
                    block.input.as_ref().map(compact).unwrap_or_default()
                } else {
                    block.partial_json
                };
                c.tool_calls.push(ToolCall {
                    id: block.id,
                    r#type: block.kind,
                    name: block.name,
                    arguments,
                });
            }
            _ => {}
        }
    }
    c
}

fn anthropic_json(value: &Value<'_>, r: &mut Rebuilt) {
    if get_str(value, "type") == Some("error") || value.get("content").is_none() {
        match error_member(value) {
            Some(err) => r.stream_error = Some(error_message(err)),
            None => r
                .warnings
                .push("response body: not a Messages object".into()),
        }
        return;
    }
    get_str(value, "model")
        .unwrap_or_default()
        .clone_into(&mut r.response_model);
    let mut blocks = BTreeMap::new();
    match value.get("content").and_then(Value::as_array) {
        Some(content) => {
            for (i, block) in content.iter().enumerate() {
                blocks.insert(i as u64, BlockAcc::from_block(block));
            }
        }
        None => r.warnings.push("response body: no content array".into()),
    }
    let stop = get_str(value, "stop_reason").unwrap_or_default().to_owned();
    r.completions = vec![anthropic_completion(blocks, stop)];
    let mut usage = AnthropicUsage::default();
    if let Some(u) = value.get("usage") {
        usage.apply(u);
    }
    r.usage = usage.into_usage();
}

fn anthropic_stream(events: &[SseEvent], r: &mut Rebuilt) {
    let mut blocks: BTreeMap<u64, BlockAcc<'_>> = BTreeMap::new();
    let mut started = false;
    let mut done = false;
    let mut stop_reason = String::new();
    let mut usage = AnthropicUsage::default();
    let mut error: Option<String> = None;
    for (n, ev) in events.iter().enumerate() {
        if ev.data.trim().is_empty() {
            continue;
        }
        let Some(data) = event_json(n, ev, &mut r.warnings) else {
            if ev.event.as_deref() == Some("error") {
                error = Some(ev.data.trim().to_owned());
            }
            continue;
        };
        let kind = get_str(&data, "type")
            .or(ev.event.as_deref())
            .unwrap_or_default();
        let index = data.get("index").and_then(Value::as_u64);
        match kind {
            "message_start" => {
                started = true;
                if let Some(msg) = data.get("message") {
                    set_first(&mut r.response_model, get_str(msg, "model"));
                    if let Some(u) = msg.get("usage") {
                        usage.apply(u);
                    }
                }
            }
            "content_block_start" => {
                let block = data.get("content_block").unwrap_or(&Value::Null);
                let index = index.unwrap_or(blocks.len() as u64);
                blocks.insert(index, BlockAcc::from_block(block));
            }
            "content_block_delta" => {
                let Some(delta) = data.get("delta") else {
                    continue;
                };
                let index = index
                    .or_else(|| blocks.keys().next_back().copied())
                    .unwrap_or(0);
                let (kind, field, target) = match get_str(delta, "type").unwrap_or_default() {
                    "text_delta" => ("text", "text", 0),
                    "input_json_delta" => ("tool_use", "partial_json", 1),
                    "thinking_delta" => ("thinking", "thinking", 2),
                    _ => continue, // signature_delta, citations_delta, ...
                };
                let block = blocks.entry(index).or_insert_with(|| BlockAcc {
                    kind: kind.to_owned(),
                    ..BlockAcc::default()
                });
                let piece = get_str(delta, field).unwrap_or_default();
                match target {
                    0 => block.text.push_str(piece),
                    1 => block.partial_json.push_str(piece),
                    _ => block.thinking.push_str(piece),
                }
            }
            "message_delta" => {
                if let Some(reason) = data
                    .get("delta")
                    .and_then(|d| get_str(d, "stop_reason"))
                    .filter(|s| !s.is_empty())
                {
                    reason.clone_into(&mut stop_reason);
                }
                if let Some(u) = data.get("usage") {
                    usage.apply(u);
                }
            }
            "message_stop" => done = true,
            "error" => {
                error = Some(error_member(&data).map_or_else(|| compact(&data), error_message));
            }
            _ => {} // ping, content_block_stop, unknown events
        }
    }
    if !done {
        r.warnings.push("stream ended without message_stop".into());
    }
    if started || !blocks.is_empty() {
        r.completions = vec![anthropic_completion(blocks, stop_reason)];
    }
    r.usage = usage.into_usage();
    r.stream_error = error;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn chat_sse() -> &'static str {
        concat!(
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"reasoning\":\"think \"}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"reasoning\":\"more\"}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: [DONE]\n\n",
        )
    }

    fn captured(api: Api, streamed: bool, status: u32, body: &[u8]) -> LlmCall {
        LlmCall {
            api: api as i32,
            streamed,
            http_status: status,
            outcome: Outcome::Ok as i32,
            response_body: body.to_vec(),
            response_body_size: body.len() as u64,
            ..Default::default()
        }
    }

    #[test]
    fn complete_fills_what_the_raw_bytes_say() {
        let mut call = captured(Api::ChatCompletions, true, 200, chat_sse().as_bytes());
        let done = complete(&mut call);
        assert_eq!(done, Completed::default());
        assert_eq!(call.completions.len(), 1);
        assert_eq!(call.completions[0].text, "Hello");
        assert_eq!(call.response_model, "m");
        assert_eq!(
            call.policy_version, "m",
            "policy version defaults to the model"
        );
        assert_eq!(call.outcome(), Outcome::Ok);
        assert!(call.capture_warnings.is_empty());
        // The same record always completes the same way.
        let mut again = captured(Api::ChatCompletions, true, 200, chat_sse().as_bytes());
        complete(&mut again);
        assert_eq!(again, call);
    }

    #[test]
    fn complete_decodes_by_the_recorded_content_encoding() {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(chat_sse().as_bytes()).unwrap();
        let body = gz.finish().unwrap();
        let mut call = captured(Api::ChatCompletions, true, 200, &body);
        call.response_headers
            .insert("content-encoding".into(), "gzip".into());
        call.policy_version = "v7".into();
        complete(&mut call);
        assert_eq!(call.completions[0].text, "Hello");
        assert_eq!(
            call.policy_version, "v7",
            "a version from the upstream is kept"
        );
        // Raw bytes are kept as received.
        assert_eq!(call.response_body, body);
    }

    #[test]
    fn complete_turns_errors_in_a_2xx_stream_and_bad_statuses_into_upstream_error() {
        let stream = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"error\":{\"message\":\"overloaded\"}}\n\n";
        let mut call = captured(Api::ChatCompletions, true, 200, stream);
        let done = complete(&mut call);
        assert!(done.body_error && done.warned, "{done:?}");
        assert_eq!(call.outcome(), Outcome::UpstreamError);
        assert_eq!(call.error, "overloaded");
        assert_eq!(call.capture_warnings, ["stream ended without [DONE]"]);

        let json = br#"{"error":{"message":"model not found","type":"invalid_request_error"}}"#;
        let mut call = captured(Api::ChatCompletions, false, 404, json);
        let done = complete(&mut call);
        assert!(!done.body_error, "a 404 is not a 2xx body error");
        assert_eq!(call.outcome(), Outcome::UpstreamError);
        assert_eq!(call.error, "model not found");

        // A call that failed in transport keeps its outcome and message.
        let mut call = captured(Api::ChatCompletions, true, 200, stream);
        call.outcome = Outcome::ClientAborted as i32;
        call.error = "client closed the connection".into();
        complete(&mut call);
        assert_eq!(call.outcome(), Outcome::ClientAborted);
        assert_eq!(call.error, "client closed the connection");
    }

    #[test]
    fn complete_flags_truncation_and_leaves_other_apis_alone() {
        let sse = chat_sse().as_bytes();
        let mut call = captured(Api::ChatCompletions, true, 200, &sse[..40]);
        call.response_truncated = true;
        call.response_body_size = sse.len() as u64;
        let done = complete(&mut call);
        assert!(done.warned);
        assert_eq!(
            call.capture_warnings.last().map(String::as_str),
            Some("response body truncated to 40 bytes")
        );

        let mut call = captured(Api::Other, false, 200, b"{\"data\":[]}");
        let done = complete(&mut call);
        assert_eq!(done, Completed::default());
        assert!(call.completions.is_empty() && call.usage.is_none());
        assert_eq!(call.outcome(), Outcome::Ok);
    }

    #[test]
    fn chat_stream_with_reasoning_field() {
        let r = rebuild(Api::ChatCompletions, true, chat_sse().as_bytes());
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_eq!(r.completions.len(), 1);
        assert_eq!(r.completions[0].text, "Hello");
        assert_eq!(r.completions[0].reasoning, "think more");
        assert_eq!(r.completions[0].finish_reason, "stop");
        assert_eq!(r.response_model, "m");
    }

    #[test]
    fn truncated_stream_at_every_length_never_panics() {
        let body = chat_sse().as_bytes();
        // From here on the `[DONE]` line is complete (its blank line is optional).
        let complete = chat_sse().find("data: [DONE]").unwrap() + "data: [DONE]".len();
        for k in 0..complete {
            let r = rebuild(Api::ChatCompletions, true, &body[..k]);
            assert!(
                r.warnings.iter().any(|w| w.contains("[DONE]")),
                "cut at {k}: {:?}",
                r.warnings
            );
        }
        // Cut inside the last content chunk: the text before it survives.
        let cut = body.len() - "lo\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n".len();
        let r = rebuild(Api::ChatCompletions, true, &body[..cut]);
        assert_eq!(r.completions[0].text, "Hel");
        assert!(r.warnings.iter().any(|w| w.contains("invalid JSON")));
    }

    #[test]
    fn truncated_json_bodies_warn() {
        let body = br#"{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}"#;
        for api in [
            Api::ChatCompletions,
            Api::Completions,
            Api::Responses,
            Api::AnthropicMessages,
        ] {
            for k in 0..body.len() {
                let r = rebuild(api, false, &body[..k]);
                assert!(!r.warnings.is_empty(), "{api:?} cut at {k}");
                assert!(r.completions.is_empty());
            }
        }
    }

    #[test]
    fn anthropic_and_responses_streams_cut_anywhere() {
        let anthropic = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude\",\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"f\",\"input\":{}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\":\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"1}\"}}\n\n",
            "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let b = anthropic.as_bytes();
        let complete = anthropic.rfind('}').unwrap() + 1;
        for k in 0..complete {
            let r = rebuild(Api::AnthropicMessages, true, &b[..k]);
            assert!(!r.warnings.is_empty(), "cut at {k}");
        }
        let full = rebuild(Api::AnthropicMessages, true, b);
        assert!(full.warnings.is_empty(), "{:?}", full.warnings);
        assert_eq!(full.completions[0].tool_calls[0].arguments, "{\"a\":1}");
        // Cut after the first fragment: the partial arguments are kept as they are.
        let cut = anthropic.find("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"1}").unwrap();
        let r = rebuild(Api::AnthropicMessages, true, &b[..cut]);
        assert_eq!(r.completions[0].tool_calls[0].arguments, "{\"a\":");

        let responses = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"model\":\"gpt\",\"output\":[]}}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"output_index\":0,\"delta\":\"Hi\"}\n\n",
        );
        let b = responses.as_bytes();
        for k in 0..b.len() {
            let r = rebuild(Api::Responses, true, &b[..k]);
            assert!(!r.warnings.is_empty(), "cut at {k}");
        }
        let r = rebuild(Api::Responses, true, b);
        assert_eq!(r.completions[0].text, "Hi");
        assert_eq!(r.response_model, "gpt");
    }

    #[test]
    fn garbage_never_panics() {
        let inputs: [&[u8]; 9] = [
            b"",
            b"\xff\xfe\x00garbage\r\r\n",
            b"data: {\"choices\":[{\"index\":-1,\"delta\":{\"tool_calls\":[{\"index\":\"x\"}]}}]}\n\n",
            b"data: {\"choices\":[{\"index\":99999999999,\"delta\":{}}]}\n\n",
            b"data: [1,2,3]\n\ndata: null\n\ndata: \"str\"\n\n",
            b"event: content_block_delta\ndata: {\"delta\":{\"type\":\"text_delta\",\"text\":5}}\n\n",
            b"{\"choices\":\"nope\",\"usage\":[1],\"content\":7,\"output\":{}}",
            b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
            b"event: error\ndata: not json\n\n",
        ];
        for api in [
            Api::ChatCompletions,
            Api::Completions,
            Api::Responses,
            Api::AnthropicMessages,
            Api::Other,
            Api::Unspecified,
        ] {
            for input in inputs {
                for streamed in [false, true] {
                    let r = rebuild(api, streamed, input);
                    if matches!(api, Api::Other | Api::Unspecified) {
                        assert_eq!(r, Rebuilt::default());
                    } else {
                        assert!(
                            !r.warnings.is_empty() || r.stream_error.is_some(),
                            "{api:?} streamed={streamed} {input:?}: {r:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn invalid_chunk_is_skipped_and_others_kept() {
        let body = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\ndata: {oops\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"}}]}\n\ndata: [DONE]\n\n";
        let r = rebuild(Api::ChatCompletions, true, body);
        assert_eq!(r.completions[0].text, "ab");
        assert_eq!(r.warnings.len(), 1);
        assert!(
            r.warnings[0].contains("event 1: invalid JSON"),
            "{:?}",
            r.warnings
        );
    }

    #[test]
    fn chat_json_content_parts_and_object_arguments() {
        let body = br#"{"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"reasoning_content":"r","tool_calls":[{"id":"call_1","function":{"name":"f","arguments":{"x":1,"a":[true]}}}]},"finish_reason":"tool_calls"}]}"#;
        let r = rebuild(Api::ChatCompletions, false, body);
        assert!(r.warnings.is_empty());
        let c = &r.completions[0];
        assert_eq!(c.text, "ab");
        assert_eq!(c.reasoning, "r");
        assert_eq!(c.tool_calls[0].r#type, "function");
        assert_eq!(c.tool_calls[0].arguments, r#"{"x":1,"a":[true]}"#);
        assert_eq!(r.usage, None);
    }

    #[test]
    fn streamed_tool_calls_without_index_split_by_id() {
        let body = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"id\":\"a\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"id\":\"b\",\"function\":{\"name\":\"g\",\"arguments\":\"{\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"function\":{\"arguments\":\"}\"}}]}}]}\n\n",
            "data: [DONE]\n\n",
        );
        let r = rebuild(Api::ChatCompletions, true, body.as_bytes());
        let calls = &r.completions[0].tool_calls;
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("f", "{}")
        );
        assert_eq!(
            (calls[1].name.as_str(), calls[1].arguments.as_str()),
            ("g", "{}")
        );
    }

    #[test]
    fn json_error_bodies_become_stream_errors() {
        let r = rebuild(
            Api::ChatCompletions,
            false,
            br#"{"error":{"message":"boom","type":"server_error"}}"#,
        );
        assert_eq!(r.stream_error.as_deref(), Some("boom"));
        let r = rebuild(
            Api::AnthropicMessages,
            false,
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        assert_eq!(r.stream_error.as_deref(), Some("Overloaded"));
        let r = rebuild(
            Api::Responses,
            false,
            br#"{"object":"response","status":"failed","error":{"code":"server_error","message":"bad"},"output":[]}"#,
        );
        assert_eq!(r.stream_error.as_deref(), Some("bad"));
        assert_eq!(r.completions[0].finish_reason, "failed");
    }

    #[test]
    fn stream_labelled_body_that_is_json() {
        let r = rebuild(
            Api::ChatCompletions,
            true,
            br#"{"model":"m","choices":[{"index":0,"message":{"content":"x"}}]}"#,
        );
        assert_eq!(r.completions[0].text, "x");
        assert_eq!(r.warnings.len(), 1);
    }

    /// About 700 KB of poorly compressible events, so that encoders emit several blocks.
    fn sample() -> Vec<u8> {
        let mut v = Vec::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for i in 0..30_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.extend_from_slice(format!("data: {{\"n\":{i},\"r\":{x}}}\n\n").as_bytes());
        }
        v
    }

    /// Regression: a 1.5 MB gzip answer that inflates to 1.5 GiB drove the sidecar past
    /// 1 GB of memory while it rebuilt the completion.
    #[test]
    fn a_decompression_bomb_stops_at_the_cap() {
        use std::io::Write as _;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..(MAX_DECODED_BYTES >> 20) + 8 {
            gz.write_all(&zeros).unwrap();
        }
        let bomb = gz.finish().unwrap();
        assert!(bomb.len() < 1 << 20);
        let err = decode_content(Some("gzip"), &bomb).unwrap_err();
        assert!(err.contains("exceeds"), "{err}");
    }

    #[test]
    fn decode_gzip_and_zstd() {
        let plain = sample();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&plain).unwrap();
        let gz = gz.finish().unwrap();
        let zs = zstd::encode_all(&plain[..], 3).unwrap();
        let mut zl = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        zl.write_all(&plain).unwrap();
        let zl = zl.finish().unwrap();
        let mut raw = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        raw.write_all(&plain).unwrap();
        let raw = raw.finish().unwrap();

        assert_eq!(
            decode_content(Some("gzip"), &gz).unwrap().as_ref(),
            &plain[..]
        );
        assert_eq!(
            decode_content(Some("X-Gzip"), &gz).unwrap().as_ref(),
            &plain[..]
        );
        assert_eq!(
            decode_content(Some(" zstd "), &zs).unwrap().as_ref(),
            &plain[..]
        );
        assert_eq!(
            decode_content(Some("deflate"), &zl).unwrap().as_ref(),
            &plain[..]
        );
        assert_eq!(
            decode_content(Some("deflate"), &raw).unwrap().as_ref(),
            &plain[..]
        );
        assert!(matches!(
            decode_content(None, &plain).unwrap(),
            Cow::Borrowed(_)
        ));
        assert!(matches!(
            decode_content(Some("identity"), &plain).unwrap(),
            Cow::Borrowed(_)
        ));
        // Applied in order gzip then zstd: undone zstd first.
        let both = zstd::encode_all(&gz[..], 1).unwrap();
        assert_eq!(
            decode_content(Some("gzip, zstd"), &both).unwrap().as_ref(),
            &plain[..]
        );
        assert!(
            decode_content(Some("br"), &plain)
                .unwrap_err()
                .contains("br")
        );
        assert!(decode_content(Some("gzip"), b"this is not gzip at all").is_err());
    }

    #[test]
    fn decode_truncated_returns_prefix() {
        let plain = sample();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&plain).unwrap();
        let gz = gz.finish().unwrap();
        let zs = zstd::encode_all(&plain[..], 3).unwrap();
        for (enc, data) in [("gzip", &gz), ("zstd", &zs)] {
            for cut in [data.len() - 1, data.len() / 2, data.len() - 9] {
                let out = decode_content(Some(enc), &data[..cut])
                    .unwrap_or_else(|e| panic!("{enc} cut {cut}: {e}"));
                assert!(plain.starts_with(&out), "{enc} cut {cut}");
            }
            let half = decode_content(Some(enc), &data[..data.len() / 2]).unwrap();
            assert!(!half.is_empty(), "{enc}: nothing decoded from half");
        }
    }
}
