//! Completions, usage and token ids rebuilt from a response body or an event stream.
//!
//! Everything here is best effort and never fails: what cannot be parsed becomes a
//! warning in [`Rebuilt::warnings`], and the raw bytes are kept by the caller so a record
//! can be re-processed later.
//!
//! Supported shapes (see `PROTOCOLS.md`, "Streams the sidecar must rebuild"), one module
//! (file) each:
//! - `chat`: OpenAI chat completions, as JSON or as `data:` chunks ending with
//!   `data: [DONE]`, including vLLM's `prompt_token_ids`, `token_ids` and logprobs;
//! - `completions`: legacy completions, the same shape as chat completions with a few
//!   fields of their own (parsed by `chat`'s state machine);
//! - `responses`: OpenAI Responses, as JSON or as named events (the terminal
//!   `response.completed` / `.incomplete` / `.failed` event is the truth, deltas are the
//!   fallback);
//! - `anthropic`: Anthropic Messages, as JSON or as named events.
//!
//! This module holds what they share: [`rebuild`], which tells JSON from events and
//! dispatches by API, [`complete`], which fills a captured record in from its raw bytes,
//! the `content-encoding` decoder, and the JSON helpers and accumulators the shapes use.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Read;

use tapline_proto::{Api, Completion, LlmCall, Outcome, ToolCall, Usage};

use crate::json::Json as Value;
use crate::sse::{SseEvent, SseParser};

mod anthropic;
mod chat;
mod completions;
mod responses;

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
        let mut events = SseEvents::new(body).peekable();
        if !(events.peek().is_none() && looks_like_json(body)) {
            if !streamed {
                r.warnings
                    .push("expected a JSON body, got an event stream; parsed it as events".into());
            }
            match family {
                Family::OpenAi => chat::stream(events, &mut r),
                Family::Responses => responses::stream(events, &mut r),
                Family::Anthropic => anthropic::stream(events, &mut r),
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
        Family::OpenAi => chat::json(&value, &mut r),
        Family::Responses => responses::json(&value, &mut r),
        Family::Anthropic => anthropic::json(&value, &mut r),
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
    complete_within(call, &mut |_| true)
}

/// [`complete`], asking `room` before a content-encoded body decodes past each size
/// (the decoded bytes so far); a `false` stops the decoding with a warning, as a body
/// over [`MAX_DECODED_BYTES`] does. The segment builder passes its memory budget here.
pub fn complete_within(call: &mut LlmCall, room: &mut dyn FnMut(usize) -> bool) -> Completed {
    let api = call.api();
    let transport_ok = call.outcome() == Outcome::Ok;
    let mut body_error = false;
    if api != Api::Other && !call.response_body.is_empty() {
        let encoding = call
            .response_headers
            .get("content-encoding")
            .map(String::as_str);
        match decode_content_within(encoding, &call.response_body, Truncated::Keep, room) {
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

/// Which parser a response goes to.
#[derive(Debug, Clone, Copy)]
enum Family {
    /// Chat and legacy completions ([`chat`], with [`completions`]).
    OpenAi,
    /// [`responses`].
    Responses,
    /// [`anthropic`].
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
    decode_content_within(encoding, body, Truncated::Keep, &mut |_| true)
}

/// What a decoder does at a premature end of its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Truncated {
    /// Keep what decoded (a record's body: the caller flags the truncation).
    Keep,
    /// An error (a body to be sent on as if complete).
    Refuse,
}

/// [`decode_content`], asking `room` for each size the decoded body grows to.
pub(crate) fn decode_content_within<'a>(
    encoding: Option<&str>,
    body: &'a [u8],
    truncated: Truncated,
    room: &mut dyn FnMut(usize) -> bool,
) -> Result<Cow<'a, [u8]>, String> {
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
        let decoded = decode_one(coding, &data, truncated, room)?;
        data = Cow::Owned(decoded);
    }
    Ok(data)
}

fn decode_one(
    coding: &str,
    body: &[u8],
    truncated: Truncated,
    room: &mut dyn FnMut(usize) -> bool,
) -> Result<Vec<u8>, String> {
    match coding {
        "gzip" | "x-gzip" => read_lenient(
            flate2::read::MultiGzDecoder::new(body),
            coding,
            truncated,
            room,
        ),
        "deflate" => {
            // HTTP `deflate` is zlib-wrapped, but some servers send raw deflate.
            if looks_like_zlib(body) {
                read_lenient(
                    flate2::read::ZlibDecoder::new(body),
                    coding,
                    truncated,
                    room,
                )
            } else {
                read_lenient(
                    flate2::read::DeflateDecoder::new(body),
                    coding,
                    truncated,
                    room,
                )
            }
        }
        "zstd" => {
            let decoder = zstd::stream::read::Decoder::new(body)
                .map_err(|e| format!("content-encoding zstd: {e}"))?;
            read_lenient(decoder, coding, truncated, room)
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

/// Reads a decoder to its end; a premature end of input (truncation) keeps what decoded,
/// or is an error (`Truncated::Refuse`).
fn read_lenient(
    mut reader: impl Read,
    coding: &str,
    truncated: Truncated,
    room: &mut dyn FnMut(usize) -> bool,
) -> Result<Vec<u8>, String> {
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
                if !room(out.len()) {
                    return Err(format!(
                        "content-encoding {coding}: decoding past {} bytes would exceed the sidecar's memory budget (--memory-budget-bytes); the raw body is kept",
                        out.len()
                    ));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::UnexpectedEof
                    && truncated == Truncated::Keep =>
            {
                return Ok(out);
            }
            Err(e) => return Err(format!("content-encoding {coding}: {e}")),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Shared helpers of the shapes

/// The events of an SSE body, parsed as they are taken: the body is fed to the parser
/// 64 KiB at a time, so what is held besides the body is one slice's events, not one
/// `String` per event of the whole stream (500,000 one-character events were ~50 MiB).
struct SseEvents<'b> {
    parser: SseParser,
    rest: &'b [u8],
    /// The current slice's events not yet taken, last first (taken with `pop`, the
    /// buffer reused for the next slice).
    ready: Vec<SseEvent>,
    finished: bool,
}

impl<'b> SseEvents<'b> {
    fn new(body: &'b [u8]) -> Self {
        SseEvents {
            parser: SseParser::new(),
            rest: body,
            ready: Vec::new(),
            finished: false,
        }
    }
}

impl Iterator for SseEvents<'_> {
    type Item = SseEvent;

    fn next(&mut self) -> Option<SseEvent> {
        const SLICE: usize = 64 << 10;
        loop {
            if let Some(event) = self.ready.pop() {
                return Some(event);
            }
            if !self.rest.is_empty() {
                let (slice, rest) = self.rest.split_at(self.rest.len().min(SLICE));
                self.rest = rest;
                self.parser.feed(slice, &mut self.ready);
            } else if !self.finished {
                self.finished = true;
                self.parser.finish(&mut self.ready);
            } else {
                return None;
            }
            self.ready.reverse();
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A chat completions stream: reasoning, then text, then `[DONE]`.
    pub(super) fn chat_sse() -> &'static str {
        concat!(
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"reasoning\":\"think \"}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"reasoning\":\"more\"}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: [DONE]\n\n",
        )
    }

    #[test]
    fn a_stream_longer_than_one_parse_slice_rebuilds_whole_across_the_slice_edges() {
        // 3,000 events of multi-byte text (~300 KiB): the parser is fed 64 KiB at a time,
        // so slice edges fall inside events, lines, `\r\n` pairs and UTF-8 characters.
        let mut body = String::new();
        let mut want = String::new();
        for i in 0..3000 {
            let piece = format!("{i}é€😀 ");
            want.push_str(&piece);
            body.push_str(&format!(
                "data: {{\"id\":\"c\",\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{piece}\"}}}}]}}\r\n\r\n"
            ));
        }
        body.push_str("data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\r\n\r\ndata: [DONE]\r\n\r\n");
        assert!(body.len() > 4 * (64 << 10));
        let r = rebuild(Api::ChatCompletions, true, body.as_bytes());
        assert_eq!(r.warnings, Vec::<String>::new());
        assert_eq!(r.completions.len(), 1);
        assert_eq!(r.completions[0].text, want);
        assert_eq!(r.completions[0].finish_reason, "stop");
    }

    fn captured(api: Api, streamed: bool, status: u32, body: &[u8]) -> LlmCall {
        LlmCall {
            api: api as i32,
            streamed,
            http_status: status,
            outcome: Outcome::Ok as i32,
            response_body: body.to_vec().into(),
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
