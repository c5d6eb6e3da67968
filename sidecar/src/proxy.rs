//! The proxy: forwards every request to the upstream unchanged, streams the response back
//! frame by frame, and records the call beside the stream.
//!
//! Invariants:
//! - The client receives the upstream's status, headers (minus hop-by-hop headers, plus
//!   `x-tapline-span-id`) and body bytes unchanged, each body frame as soon as it arrives.
//!   The one exception is token fidelity (`--upstream-kind vllm|sglang`): fields the
//!   sidecar asked for on its own are removed from the client's copy.
//! - The last frame of a response is held until the call's record is in the spool, so a
//!   response the client received whole is always captured. Only the raw record is
//!   written then (one append to the page cache); the rebuild from the raw bytes waits
//!   for the segment builder (`rebuild::complete`). Calls that failed or that the client
//!   dropped are recorded on a separate task; nothing waits for them.
//! - Request bodies larger than the capture cap are forwarded whole; the record keeps a
//!   prefix and says it is truncated.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;
use tapline_proto::{Api, LlmCall, Outcome, RecordKind};

/// The body types at the paths they had before they moved to [`crate::body`]
/// (`control.rs` still imports `RespBody` and `full_body` from here).
pub use crate::body::{BoxError, RespBody, UpBody, full_body};
use crate::clock::now_nanos;
use crate::config::{NEVER_RECORDED, UpstreamKind};
use crate::episodes::{EPISODE_ID_RULE, Hints, valid_episode_id};
use crate::rebuild;
use crate::sink::Dropped;
use crate::sse::{LineFramer, Piece, Terminal, TerminalWatch};
use crate::state::AppState;
use crate::upstream::{SendError, UpstreamBody};

/// Header that carries the span id of a proxied call back to the client.
pub const SPAN_ID_HEADER: &str = "x-tapline-span-id";

const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Decides the API family from the method and path (without query).
pub fn api_of(method: &http::Method, path: &str) -> Api {
    if method != http::Method::POST {
        return Api::Other;
    }
    let path = path.trim_end_matches('/');
    if path.ends_with("/chat/completions") {
        Api::ChatCompletions
    } else if path.ends_with("/completions") {
        Api::Completions
    } else if path.ends_with("/responses") {
        Api::Responses
    } else if path.ends_with("/messages") {
        Api::AnthropicMessages
    } else {
        Api::Other
    }
}

/// A JSON error body in the shape of the API the client called.
pub fn api_error(api: Api, status: StatusCode, code: &str, message: &str) -> Response<RespBody> {
    let body = match api {
        Api::AnthropicMessages => serde_json::json!({
            "type": "error",
            "error": {"type": if status == StatusCode::GATEWAY_TIMEOUT { "timeout_error" } else { "api_error" }, "message": message},
        }),
        _ => serde_json::json!({
            "error": {"message": message, "type": code, "param": null, "code": code},
        }),
    };
    let mut resp = Response::new(full_body(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// What the sidecar asked the upstream for on its own, to be removed from the response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Injected {
    /// `return_token_ids` was added: remove `prompt_token_ids` and `token_ids`.
    pub token_ids: bool,
    /// `logprobs` was added: set `choices[].logprobs` to null.
    pub logprobs: bool,
}

impl Injected {
    fn any(self) -> bool {
        self.token_ids || self.logprobs
    }
}

/// Adds token-id and logprob requests to a request body for vLLM/SGLang upstreams.
/// Returns the new body and what was added, or `None` when nothing was added.
pub fn inject(kind: UpstreamKind, api: Api, body: &[u8]) -> Option<(Bytes, Injected)> {
    if kind == UpstreamKind::Openai || !matches!(api, Api::ChatCompletions | Api::Completions) {
        return None;
    }
    let mut value: Value = serde_json::from_slice(body).ok()?;
    let obj = value.as_object_mut()?;
    let streaming = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let mut injected = Injected::default();
    // SGLang refuses return_token_ids on streamed chat completions.
    let ids_possible = !(kind == UpstreamKind::Sglang && api == Api::ChatCompletions && streaming);
    if ids_possible && !obj.contains_key("return_token_ids") {
        obj.insert("return_token_ids".into(), Value::Bool(true));
        injected.token_ids = true;
    }
    let asked_logprobs = match obj.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(_) => true,
    };
    if !asked_logprobs {
        let on = if api == Api::ChatCompletions {
            Value::Bool(true)
        } else {
            Value::from(0)
        };
        obj.insert("logprobs".into(), on);
        injected.logprobs = true;
    }
    if !injected.any() {
        return None;
    }
    let bytes = serde_json::to_vec(&value).ok()?;
    Some((Bytes::from(bytes), injected))
}

/// Removes injected fields from one response JSON object. Returns whether it changed.
pub fn strip_injected(value: &mut Value, injected: Injected) -> bool {
    let Some(obj) = value.as_object_mut() else {
        return false;
    };
    let mut changed = false;
    if injected.token_ids {
        changed |= obj.shift_remove("prompt_token_ids").is_some();
    }
    if let Some(Value::Array(choices)) = obj.get_mut("choices") {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            if injected.token_ids {
                changed |= choice.shift_remove("token_ids").is_some();
                changed |= choice.shift_remove("prompt_token_ids").is_some();
            }
            if injected.logprobs
                && let Some(lp) = choice.get_mut("logprobs")
                && !lp.is_null()
            {
                *lp = Value::Null;
                changed = true;
            }
        }
    }
    changed
}

/// Rewrites complete SSE events of a stream, leaving every event it does not change
/// byte for byte as it was.
#[derive(Debug)]
struct SseRewriter {
    /// Bytes after the last complete event.
    pending: Vec<u8>,
    /// Finds the blank lines that end events (only line lengths matter: no line is kept).
    framer: LineFramer,
    /// Stream offset of `pending[0]`.
    start: u64,
    /// The line framed last was blank.
    blank: bool,
    injected: Injected,
}

impl SseRewriter {
    fn new(injected: Injected) -> Self {
        SseRewriter {
            pending: Vec::new(),
            framer: LineFramer::keeping(0),
            start: 0,
            blank: false,
            injected,
        }
    }

    /// Takes a chunk; returns the rewritten complete events it finished (maybe empty):
    /// everything up to the last blank line, so comments (keep-alives) pass at once too.
    fn push(&mut self, chunk: &[u8]) -> Bytes {
        self.pending.extend_from_slice(chunk);
        let mut cut = None;
        let blank = &mut self.blank;
        self.framer.feed(chunk, |piece| match piece {
            Piece::Line(line) => {
                *blank = line.len == 0;
                if *blank {
                    cut = Some(line.end);
                }
            }
            Piece::LateLf { end } => {
                if *blank {
                    cut = Some(end);
                }
            }
        });
        let Some(cut) = cut else {
            return Bytes::new();
        };
        let end = usize::try_from(cut.saturating_sub(self.start))
            .map_or(self.pending.len(), |n| n.min(self.pending.len()));
        let rest = self.pending.split_off(end);
        let events = std::mem::replace(&mut self.pending, rest);
        self.start = cut;
        rewrite_events(&events, self.injected)
    }

    fn finish(&mut self) -> Bytes {
        let events = std::mem::take(&mut self.pending);
        self.start = self.framer.fed();
        rewrite_events(&events, self.injected)
    }
}

fn rewrite_events(events: &[u8], injected: Injected) -> Bytes {
    let mut out = BytesMut::with_capacity(events.len());
    for line in events.split_inclusive(|b| *b == b'\n') {
        let body_len = line.len()
            - line
                .iter()
                .rev()
                .take_while(|b| matches!(b, b'\n' | b'\r'))
                .count();
        let (text, ending) = line.split_at(body_len);
        let rewritten = text
            .strip_prefix(b"data:")
            .map(|p| p.strip_prefix(b" ").unwrap_or(p))
            .filter(|payload| payload.first() == Some(&b'{'))
            .and_then(|payload| serde_json::from_slice::<Value>(payload).ok())
            .and_then(|mut v| strip_injected(&mut v, injected).then_some(v))
            .and_then(|v| serde_json::to_vec(&v).ok());
        match rewritten {
            Some(json) => {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&json);
                out.extend_from_slice(ending);
            }
            None => out.extend_from_slice(line),
        }
    }
    out.freeze()
}

/// How the response body is changed on its way to the client.
#[derive(Debug)]
enum Rewrite {
    /// Unchanged.
    None,
    /// SSE stream: injected fields removed event by event.
    Sse(SseRewriter),
}

/// Everything known about a call while its response streams.
struct Capture {
    state: Arc<AppState>,
    call: LlmCall,
    body: Vec<u8>,
    body_size: u64,
    /// Request body bytes forwarded so far, when the body was longer than the cap and
    /// streamed through.
    request_size: Option<Arc<AtomicU64>>,
}

/// Records the call as aborted by the client if the proxy future is dropped (the client
/// went away) before the response was handed to it.
struct CallGuard(Option<Capture>);

impl CallGuard {
    fn take(&mut self) -> Capture {
        self.0.take().expect("the capture is taken once")
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if let Some(capture) = self.0.take() {
            capture.finish(
                Outcome::ClientAborted,
                Some("client closed the connection before the response head arrived".to_owned()),
            );
        }
    }
}

impl Capture {
    fn push(&mut self, data: &[u8]) {
        if self.call.first_byte_unix_nanos == 0 {
            self.call.first_byte_unix_nanos = now_nanos();
        }
        self.body_size += data.len() as u64;
        let cap = self.state.config.capture_cap_bytes;
        if self.body.len() < cap {
            let take = data.len().min(cap - self.body.len());
            self.body.extend_from_slice(&data[..take]);
        }
    }

    fn close(&mut self, outcome: Outcome, error: Option<String>) {
        self.call.end_unix_nanos = now_nanos();
        self.call.outcome = outcome as i32;
        if let Some(error) = error {
            self.call.error = error;
        }
    }

    /// Completes and queues the record on another task (nothing waits for it).
    fn finish(mut self, outcome: Outcome, error: Option<String>) {
        self.close(outcome, error);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    let ack = self.record();
                    let _ = ack.await;
                });
            }
            Err(_) => {
                drop(self.record());
            }
        }
    }

    /// Completes and queues the record now; the ack resolves once it is in the spool.
    fn finish_acked(mut self, outcome: Outcome, error: Option<String>) -> Spooled {
        self.close(outcome, error);
        self.record()
    }

    /// Queues the record as captured; what derives from the raw bytes (the rebuilt
    /// completion, the final outcome) is filled in when its segment is built
    /// (`rebuild::complete`), so the response never waits for it.
    fn record(mut self) -> Spooled {
        let call = &mut self.call;
        if let Some(size) = &self.request_size {
            call.request_body_size = size.load(Ordering::Relaxed);
        }
        call.response_truncated = self.body_size > self.body.len() as u64;
        call.response_body_size = self.body_size;
        call.response_body = std::mem::take(&mut self.body);
        // The live count by outcome goes by transport and status; an error reported
        // inside a 2xx body is counted when the segment is built (`body_errors`).
        self.state
            .metrics
            .outcome(rebuild::by_status(call.outcome(), call.http_status));
        let episode_id = call.episode_id.clone();
        let ack = self.state.sink.submit(RecordKind::LlmCall(self.call));
        let state = self.state;
        Box::pin(async move {
            let result = ack.await;
            if result.is_err() {
                state
                    .metrics
                    .capture_failures
                    .fetch_add(1, Ordering::Relaxed);
                if !episode_id.is_empty() {
                    state.episodes.note_dropped(&episode_id);
                }
            }
            result
        })
    }
}

/// The last event of a stream, by API. A client may close the connection as soon as it
/// saw this event (the openai SDK does at `[DONE]`), so the call is complete there,
/// whatever follows.
fn terminal_event(api: Api) -> Option<Terminal> {
    match api {
        Api::ChatCompletions | Api::Completions => Some(Terminal::Data("[DONE]")),
        Api::AnthropicMessages => Some(Terminal::Named(&["message_stop"])),
        Api::Responses => Some(Terminal::Named(&[
            "response.completed",
            "response.incomplete",
            "response.failed",
        ])),
        Api::Other | Api::Unspecified => None,
    }
}

/// Resolves once a record is in the spool (or was dropped, counted and flagged).
type Spooled = Pin<Box<dyn std::future::Future<Output = Result<(), Dropped>> + Send>>;

/// The last frame of a response, held back until its record is in the spool.
struct Held {
    ack: Spooled,
    frame: Option<Frame<Bytes>>,
    /// Gives up waiting after this (policy `drop`); `None` waits as long as it takes.
    timeout: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// The response body handed to the client: the upstream body, teed into the capture.
struct CaptureBody {
    inner: UpstreamBody,
    capture: Option<Capture>,
    rewrite: Rewrite,
    idle_timeout: Duration,
    /// Fires at the idle deadline; re-armed lazily (resetting a timer per frame is costly).
    idle: Pin<Box<tokio::time::Sleep>>,
    /// When the last frame arrived.
    last_frame: tokio::time::Instant,
    /// Watches for the end of the stream's last event (event streams of known APIs).
    terminal: Option<TerminalWatch>,
    held: Option<Held>,
    done: bool,
}

impl CaptureBody {
    fn finish(&mut self, outcome: Outcome, error: Option<String>) {
        if let Some(capture) = self.capture.take() {
            capture.finish(outcome, error);
        }
    }

    /// Records the call as complete and holds `frame` until the record is spooled.
    fn hold(&mut self, frame: Option<Frame<Bytes>>) {
        let Some(capture) = self.capture.take() else {
            self.held = Some(Held {
                ack: Box::pin(std::future::ready(Ok(()))),
                frame,
                timeout: None,
            });
            return;
        };
        let timeout = capture
            .state
            .ack_wait
            .map(|d| Box::pin(tokio::time::sleep(d)));
        let ack = capture.finish_acked(Outcome::Ok, None);
        self.held = Some(Held {
            ack,
            frame,
            timeout,
        });
    }

    fn sent(&self, n: usize) {
        if let Some(c) = &self.capture {
            c.state
                .metrics
                .response_bytes
                .fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// Whether the stream's last event is complete with `data`: the blank line that ends
    /// it has arrived.
    fn is_terminal(&mut self, data: &[u8]) -> bool {
        if self.capture.is_none() {
            return false;
        }
        self.terminal.as_mut().is_some_and(|watch| watch.feed(data))
    }
}

impl Body for CaptureBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some(held) = &mut this.held {
                let acked = held.ack.as_mut().poll(cx).is_ready();
                let gave_up = !acked
                    && held
                        .timeout
                        .as_mut()
                        .is_some_and(|t| t.as_mut().poll(cx).is_ready());
                if !acked && !gave_up {
                    return Poll::Pending;
                }
                if gave_up {
                    tracing::warn!(
                        "record not spooled in time; sending the end of the response anyway"
                    );
                }
                let frame = this.held.take().and_then(|h| h.frame);
                match frame {
                    Some(frame) => return Poll::Ready(Some(Ok(frame))),
                    None => {
                        this.done = true;
                        return Poll::Ready(None);
                    }
                }
            }
            if this.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    this.last_frame = tokio::time::Instant::now();
                    let Some(data) = frame.data_ref() else {
                        return Poll::Ready(Some(Ok(frame)));
                    };
                    if let Some(capture) = &mut this.capture {
                        capture.push(data);
                    }
                    let terminal = this.is_terminal(data);
                    let last = this.inner.is_end_stream();
                    let mut out = match &mut this.rewrite {
                        Rewrite::None => frame.into_data().unwrap_or_default(),
                        Rewrite::Sse(rewriter) => rewriter.push(data),
                    };
                    if terminal || last {
                        if let Rewrite::Sse(rewriter) = &mut this.rewrite {
                            let tail = rewriter.finish();
                            if !tail.is_empty() {
                                let mut joined = BytesMut::from(&out[..]);
                                joined.extend_from_slice(&tail);
                                out = joined.freeze();
                            }
                        }
                        this.sent(out.len());
                        let frame = (!out.is_empty()).then(|| Frame::data(out));
                        if this.capture.is_some() {
                            this.hold(frame);
                            continue;
                        }
                        if let Some(frame) = frame {
                            return Poll::Ready(Some(Ok(frame)));
                        }
                        continue;
                    }
                    if !out.is_empty() {
                        this.sent(out.len());
                        return Poll::Ready(Some(Ok(Frame::data(out))));
                    }
                }
                Poll::Ready(Some(Err(error))) => {
                    this.done = true;
                    this.finish(
                        Outcome::UpstreamError,
                        Some(format!("upstream body failed: {error}")),
                    );
                    return Poll::Ready(Some(Err(error.into())));
                }
                Poll::Ready(None) => {
                    let tail = match &mut this.rewrite {
                        Rewrite::None => Bytes::new(),
                        Rewrite::Sse(rewriter) => rewriter.finish(),
                    };
                    this.sent(tail.len());
                    let frame = (!tail.is_empty()).then(|| Frame::data(tail));
                    this.hold(frame);
                    continue;
                }
                Poll::Pending => {
                    while this.idle.as_mut().poll(cx).is_ready() {
                        let deadline = this.last_frame + this.idle_timeout;
                        if deadline > tokio::time::Instant::now() {
                            // Frames arrived since the timer was armed: wait the rest.
                            this.idle.as_mut().reset(deadline);
                            continue;
                        }
                        let message = format!(
                            "upstream sent nothing for {:.0?}; response cut",
                            this.idle_timeout
                        );
                        this.done = true;
                        this.finish(Outcome::Timeout, Some(message.clone()));
                        return Poll::Ready(Some(Err(message.into())));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        match self.rewrite {
            Rewrite::None => self.inner.size_hint(),
            Rewrite::Sse(_) => SizeHint::default(),
        }
    }
}

impl Drop for CaptureBody {
    fn drop(&mut self) {
        if self.capture.is_some() {
            self.finish(
                Outcome::ClientAborted,
                Some("client closed the connection before the response ended".to_owned()),
            );
        }
    }
}

/// Reads up to `cap` bytes of a request body. Returns the chunks read and, when the body
/// is longer, the unread remainder.
async fn read_capped(
    mut body: Incoming,
    cap: usize,
) -> Result<(Vec<Bytes>, usize, Option<Incoming>), hyper::Error> {
    let mut chunks = Vec::new();
    let mut len = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            len += data.len();
            chunks.push(data);
            if len > cap {
                return Ok((chunks, len, Some(body)));
            }
        }
    }
    Ok((chunks, len, None))
}

fn concat(chunks: &[Bytes], len: usize) -> Bytes {
    match chunks {
        [] => Bytes::new(),
        [one] => one.clone(),
        many => {
            let mut buf = BytesMut::with_capacity(len);
            for c in many {
                buf.extend_from_slice(c);
            }
            buf.freeze()
        }
    }
}

/// The allowed headers, by lower-case name; repeated fields joined with ", " in order
/// (RFC 9110 §5.3), so that e.g. two `content-encoding` fields keep both codings.
fn recorded_headers(headers: &HeaderMap, allow: &[String]) -> BTreeMap<String, String> {
    let mut recorded = BTreeMap::new();
    for name in headers.keys() {
        let n = name.as_str();
        if NEVER_RECORDED.contains(&n) || !allow.iter().any(|a| a == n) {
            continue;
        }
        let mut joined = String::new();
        for value in headers.get_all(name) {
            if !joined.is_empty() {
                joined.push_str(", ");
            }
            joined.push_str(&String::from_utf8_lossy(value.as_bytes()));
        }
        recorded.insert(n.to_owned(), joined);
    }
    recorded
}

/// Removes what one HTTP/1.1 hop must not forward (RFC 9110 §7.6.1, RFC 9112 §6.3): the
/// hop-by-hop headers and those `Connection` names, and `Content-Length` when
/// `Transfer-Encoding` is present (the message was framed by the transfer coding; the
/// next hop frames it again, and a stale length would cut the body while it looks
/// complete, or let two parsers disagree on where it ends).
fn remove_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

/// Takes the `x-tapline-*` headers off a request.
fn take_tapline_headers(headers: &mut HeaderMap, hints: &mut Hints) {
    let names: Vec<HeaderName> = headers
        .keys()
        .filter(|n| n.as_str().starts_with("x-tapline-"))
        .cloned()
        .collect();
    for name in names {
        // Values are read as UTF-8 (a task id may be any text), not only visible ASCII.
        let value = headers
            .get_all(&name)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect::<Vec<_>>()
            .join(",");
        headers.remove(&name);
        let value = value.trim().to_owned();
        match name.as_str() {
            "x-tapline-episode-id" if !value.is_empty() => hints.header_episode = Some(value),
            "x-tapline-task-id" => hints.task_id = Some(value),
            "x-tapline-group-id" => hints.group_id = Some(value),
            other => {
                if let Some(tag) = other.strip_prefix("x-tapline-tag-") {
                    hints.tags.insert(tag.to_owned(), value);
                }
            }
        }
    }
}

/// Splits `/e/{episode}/rest` into the episode and `/rest`.
fn split_episode_prefix(path_and_query: &str) -> Option<(&str, String)> {
    let rest = path_and_query.strip_prefix("/e/")?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (id, tail) = rest.split_at(end);
    let tail = if tail.starts_with('/') {
        tail.to_owned()
    } else {
        format!("/{tail}")
    };
    Some((id, tail))
}

/// Proxies one request.
pub async fn proxy(state: Arc<AppState>, req: Request<Incoming>) -> Response<RespBody> {
    let started = Instant::now();
    let start_nanos = now_nanos();
    let (mut parts, body) = req.into_parts();
    let mut hints = Hints::default();
    let original = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let path_and_query = match split_episode_prefix(&original) {
        Some((id, rest)) => {
            if !valid_episode_id(id) {
                return api_error(
                    api_of(&parts.method, rest.split('?').next().unwrap_or("")),
                    StatusCode::BAD_REQUEST,
                    "invalid_episode_id",
                    &format!(
                        "tapline: {id:?} in the path /e/{{episode_id}}/ is not an episode id ({EPISODE_ID_RULE}); use the base URL the tapline SDK returned"
                    ),
                );
            }
            hints.path_episode = Some(id.to_owned());
            rest
        }
        None => original,
    };
    take_tapline_headers(&mut parts.headers, &mut hints);
    if let Some(id) = hints.header_episode.as_deref()
        && !valid_episode_id(id)
    {
        let shown: String = id.chars().take(64).collect();
        return api_error(
            api_of(
                &parts.method,
                path_and_query.split('?').next().unwrap_or(""),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_episode_id",
            &format!(
                "tapline: the x-tapline-episode-id header {shown:?}{} is not an episode id ({EPISODE_ID_RULE})",
                if shown.len() < id.len() { "…" } else { "" }
            ),
        );
    }
    let path = path_and_query.split('?').next().unwrap_or("/");
    let api = api_of(&parts.method, path);
    state.metrics.request(api);
    let attribution = state.episodes.attribute(hints);
    let span_id = uuid::Uuid::now_v7().to_string();

    let cap = state.config.capture_cap_bytes;
    let (chunks, read_len, remainder) = match read_capped(body, cap).await {
        Ok(read) => read,
        Err(error) => {
            // The client went away while sending its request: nothing to forward.
            let call = LlmCall {
                span_id,
                api: api as i32,
                method: parts.method.to_string(),
                path: path_and_query,
                start_unix_nanos: start_nanos,
                end_unix_nanos: now_nanos(),
                outcome: Outcome::ClientAborted as i32,
                error: format!("client request body failed: {error}"),
                ..attributed(&attribution, &state.config.sidecar_id)
            };
            state.metrics.outcome(Outcome::ClientAborted);
            drop(state.sink.submit(RecordKind::LlmCall(call)));
            return api_error(
                api,
                StatusCode::BAD_REQUEST,
                "bad_request",
                "tapline: request body could not be read",
            );
        }
    };
    state
        .metrics
        .request_bytes
        .fetch_add(read_len as u64, Ordering::Relaxed);
    let request_bytes = concat(&chunks, read_len);
    let captured_request = request_bytes.slice(..read_len.min(cap));
    let request_model = if remainder.is_none() {
        request_model(&request_bytes)
    } else {
        String::new()
    };

    // Token fidelity: ask vLLM/SGLang for ids and logprobs.
    let injected = if remainder.is_none() {
        inject(state.config.upstream_kind, api, &request_bytes)
    } else {
        None
    };
    let mut headers = parts.headers;
    remove_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    let mut request_size = None;
    let (up_body, injected): (UpBody, Injected) = match (injected, remainder) {
        (Some((bytes, injected)), _) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
            (full_body(bytes), injected)
        }
        (None, None) => (full_body(request_bytes), Injected::default()),
        (None, Some(rest)) => {
            let counter = Arc::new(AtomicU64::new(read_len as u64));
            request_size = Some(counter.clone());
            let state2 = state.clone();
            let rest = rest
                .map_frame(move |f| {
                    if let Some(d) = f.data_ref() {
                        state2
                            .metrics
                            .request_bytes
                            .fetch_add(d.len() as u64, Ordering::Relaxed);
                        counter.fetch_add(d.len() as u64, Ordering::Relaxed);
                    }
                    f
                })
                .map_err(BoxError::from);
            let head = futures::stream::iter(
                chunks
                    .into_iter()
                    .map(|c| Ok::<_, BoxError>(Frame::data(c))),
            );
            let body =
                http_body_util::StreamBody::new(head.chain(http_body_util::BodyStream::new(rest)));
            (body.boxed_unsync(), Injected::default())
        }
    };

    let call = LlmCall {
        span_id: span_id.clone(),
        api: api as i32,
        method: parts.method.to_string(),
        path: path_and_query.clone(),
        start_unix_nanos: start_nanos,
        request_body: captured_request.to_vec(),
        request_truncated: read_len > cap,
        request_body_size: read_len as u64,
        request_headers: recorded_headers(&headers, &state.config.recorded_headers),
        request_model,
        token_fields_injected: injected.any(),
        ..attributed(&attribution, &state.config.sidecar_id)
    };
    let mut guard = CallGuard(Some(Capture {
        state: state.clone(),
        call,
        body: Vec::new(),
        body_size: 0,
        request_size,
    }));

    // The request goes out in origin form (path and query); the pool adds `Host`.
    let uri = match format!("{}{}", state.upstream_base, path_and_query)
        .parse::<http::Uri>()
        .map_err(|e| e.to_string())
        .and_then(|full| {
            let mut parts = full.into_parts();
            parts.scheme = None;
            parts.authority = None;
            http::Uri::from_parts(parts).map_err(|e| e.to_string())
        }) {
        Ok(uri) => uri,
        Err(e) => {
            let message = format!("tapline: request path cannot be forwarded: {e}");
            return local_failure(
                guard.take(),
                api,
                StatusCode::BAD_REQUEST,
                Outcome::UpstreamError,
                "bad_request",
                message,
            )
            .await;
        }
    };
    let mut up_req = Request::new(up_body);
    *up_req.method_mut() = parts.method;
    *up_req.uri_mut() = uri;
    *up_req.headers_mut() = headers;

    let sent_at = Instant::now();
    let response =
        tokio::time::timeout(state.config.response_timeout, state.upstream.send(up_req)).await;
    let head_at = Instant::now();
    let response = match response {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            let (outcome, code) = if matches!(error, SendError::Connect(_)) {
                (Outcome::UpstreamUnreachable, "upstream_unreachable")
            } else {
                (Outcome::UpstreamError, "upstream_error")
            };
            let message = format!(
                "tapline: upstream {} failed: {}",
                state.upstream_base,
                error_chain(&error)
            );
            return local_failure(
                guard.take(),
                api,
                StatusCode::BAD_GATEWAY,
                outcome,
                code,
                message,
            )
            .await;
        }
        Err(_) => {
            let message = format!(
                "tapline: upstream {} sent no response within {:.0?}",
                state.upstream_base, state.config.response_timeout
            );
            return local_failure(
                guard.take(),
                api,
                StatusCode::GATEWAY_TIMEOUT,
                Outcome::Timeout,
                "upstream_timeout",
                message,
            )
            .await;
        }
    };

    let (mut rparts, rbody) = response.into_parts();
    remove_hop_by_hop(&mut rparts.headers);
    let content_encoding = rparts
        .headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .filter(|e| !e.eq_ignore_ascii_case("identity"));
    let streamed = rparts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("text/event-stream"));
    {
        let capture = guard.0.as_mut().expect("capture is present until taken");
        let call = &mut capture.call;
        call.streamed = streamed;
        call.http_status = u32::from(rparts.status.as_u16());
        call.response_headers = recorded_headers(&rparts.headers, &state.config.recorded_headers);
        if let Some(version) = rparts
            .headers
            .get("x-tapline-policy-version")
            .and_then(|v| v.to_str().ok())
        {
            call.policy_version = version.to_owned();
        }
    }
    if let Ok(v) = HeaderValue::from_str(&span_id) {
        rparts.headers.insert(SPAN_ID_HEADER, v);
    }
    let strip = injected.any() && rparts.status.is_success() && content_encoding.is_none();
    if strip && !streamed {
        // A JSON body is rewritten whole: read it, remove the injected fields, send it.
        let idle = state.config.idle_timeout;
        let body = match tokio::time::timeout(idle, rbody.collect()).await {
            Ok(Ok(body)) => body.to_bytes(),
            Ok(Err(error)) => {
                let message = format!(
                    "tapline: upstream {} failed: {}",
                    state.upstream_base,
                    error_chain(&error)
                );
                return local_failure(
                    guard.take(),
                    api,
                    StatusCode::BAD_GATEWAY,
                    Outcome::UpstreamError,
                    "upstream_error",
                    message,
                )
                .await;
            }
            Err(_) => {
                let message = format!(
                    "tapline: upstream {} sent no body within {idle:.0?}",
                    state.upstream_base
                );
                return local_failure(
                    guard.take(),
                    api,
                    StatusCode::GATEWAY_TIMEOUT,
                    Outcome::Timeout,
                    "upstream_timeout",
                    message,
                )
                .await;
            }
        };
        let mut capture = guard.take();
        capture.push(&body);
        let stripped = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|mut v| strip_injected(&mut v, injected).then_some(v))
            .and_then(|v| serde_json::to_vec(&v).ok())
            .map_or(body, Bytes::from);
        state
            .metrics
            .response_bytes
            .fetch_add(stripped.len() as u64, Ordering::Relaxed);
        rparts.headers.remove(header::CONTENT_LENGTH);
        let wait = state.ack_wait;
        wait_spooled(capture.finish_acked(Outcome::Ok, None), wait).await;
        state
            .metrics
            .added_latency(sent_at.duration_since(started) + head_at.elapsed());
        return Response::from_parts(rparts, full_body(stripped));
    }
    if rbody.is_end_stream() {
        // An empty body (content-length 0, 204, 304): hyper will not poll it, so the
        // call is complete now.
        let capture = guard.take();
        let wait = state.ack_wait;
        wait_spooled(capture.finish_acked(Outcome::Ok, None), wait).await;
        state
            .metrics
            .added_latency(sent_at.duration_since(started) + head_at.elapsed());
        return Response::from_parts(rparts, full_body(Bytes::new()));
    }
    let rewrite = if strip {
        rparts.headers.remove(header::CONTENT_LENGTH);
        Rewrite::Sse(SseRewriter::new(injected))
    } else {
        Rewrite::None
    };
    let idle_timeout = state.config.idle_timeout;
    let body = CaptureBody {
        inner: rbody,
        capture: Some(guard.take()),
        rewrite,
        idle_timeout,
        idle: Box::pin(tokio::time::sleep(idle_timeout)),
        last_frame: tokio::time::Instant::now(),
        terminal: terminal_event(api)
            .filter(|_| streamed)
            .map(TerminalWatch::new),
        held: None,
        done: false,
    };
    state
        .metrics
        .added_latency(sent_at.duration_since(started) + head_at.elapsed());
    Response::from_parts(rparts, body.boxed_unsync())
}

/// The `model` of a JSON request body, without building a JSON tree.
fn request_model(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct ModelOnly<'a> {
        #[serde(borrow)]
        model: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_slice::<ModelOnly<'_>>(body)
        .ok()
        .and_then(|m| m.model)
        .map(|m| m.into_owned())
        .unwrap_or_default()
}

fn attributed(a: &crate::episodes::Attribution, sidecar_id: &str) -> LlmCall {
    LlmCall {
        episode_id: a.episode_id.clone(),
        task_id: a.task_id.clone(),
        group_id: a.group_id.clone(),
        seq: a.seq,
        sidecar_id: sidecar_id.to_owned(),
        tags: a.tags.clone(),
        ..Default::default()
    }
}

/// Waits for a record to reach the spool, at most `wait` (`None`: as long as it takes).
async fn wait_spooled(spooled: Spooled, wait: Option<Duration>) {
    match wait {
        Some(wait) => {
            if tokio::time::timeout(wait, spooled).await.is_err() {
                tracing::warn!("record not spooled in time; answering anyway");
            }
        }
        None => {
            let _ = spooled.await;
        }
    }
}

/// Answers for the upstream (502/504/400) and records the call with that outcome.
async fn local_failure(
    mut capture: Capture,
    api: Api,
    status: StatusCode,
    outcome: Outcome,
    code: &str,
    message: String,
) -> Response<RespBody> {
    tracing::warn!(upstream = %capture.state.upstream_base, %status, "{message}");
    let mut resp = api_error(api, status, code, &message);
    if let Ok(v) = HeaderValue::from_str(&capture.call.span_id) {
        resp.headers_mut().insert(SPAN_ID_HEADER, v);
    }
    capture.call.http_status = u32::from(status.as_u16());
    let wait = capture.state.ack_wait;
    wait_spooled(capture.finish_acked(outcome, Some(message)), wait).await;
    resp
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apis_are_told_apart_by_path() {
        let post = http::Method::POST;
        assert_eq!(api_of(&post, "/v1/chat/completions"), Api::ChatCompletions);
        assert_eq!(api_of(&post, "/v1/completions"), Api::Completions);
        assert_eq!(api_of(&post, "/v1/responses"), Api::Responses);
        assert_eq!(api_of(&post, "/v1/messages"), Api::AnthropicMessages);
        assert_eq!(api_of(&post, "/v1/messages/count_tokens"), Api::Other);
        assert_eq!(api_of(&http::Method::GET, "/v1/models"), Api::Other);
    }

    #[test]
    fn episode_prefixes_are_split_off() {
        assert_eq!(
            split_episode_prefix("/e/abc/v1/chat/completions?x=1"),
            Some(("abc", "/v1/chat/completions?x=1".to_owned()))
        );
        assert_eq!(
            split_episode_prefix("/e/abc"),
            Some(("abc", "/".to_owned()))
        );
        assert_eq!(split_episode_prefix("/v1/e/abc"), None);
    }

    #[test]
    fn injection_respects_what_the_harness_asked() {
        let body = br#"{"model":"m","messages":[],"logprobs":true,"top_logprobs":2}"#;
        let (new, inj) = inject(UpstreamKind::Vllm, Api::ChatCompletions, body).unwrap();
        assert_eq!(
            inj,
            Injected {
                token_ids: true,
                logprobs: false
            }
        );
        let v: Value = serde_json::from_slice(&new).unwrap();
        assert_eq!(v["return_token_ids"], true);
        assert_eq!(v["top_logprobs"], 2);
        assert!(inject(UpstreamKind::Openai, Api::ChatCompletions, body).is_none());
        let (new, inj) = inject(
            UpstreamKind::Sglang,
            Api::ChatCompletions,
            br#"{"stream":true}"#,
        )
        .unwrap();
        assert_eq!(
            inj,
            Injected {
                token_ids: false,
                logprobs: true
            }
        );
        assert!(!String::from_utf8_lossy(&new).contains("return_token_ids"));
        let (new, _) = inject(UpstreamKind::Vllm, Api::Completions, br#"{"prompt":"p"}"#).unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&new).unwrap()["logprobs"],
            0
        );
    }

    #[test]
    fn sse_rewriting_keeps_untouched_events_byte_for_byte_at_any_split() {
        let stream = b"data: {\"id\":\"x\",\"prompt_token_ids\":[1,2],\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"token_ids\":[5],\"logprobs\":{\"content\":[]}}]}\r\n\r\n: keep-alive\n\ndata: {\"id\":\"x\",\"choices\":[]}\n\ndata: [DONE]\n\n";
        let injected = Injected {
            token_ids: true,
            logprobs: true,
        };
        let whole = {
            let mut r = SseRewriter::new(injected);
            let mut out = r.push(stream).to_vec();
            out.extend_from_slice(&r.finish());
            out
        };
        let text = String::from_utf8(whole.clone()).unwrap();
        assert_eq!(
            text,
            "data: {\"id\":\"x\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"logprobs\":null}]}\r\n\r\n: keep-alive\n\ndata: {\"id\":\"x\",\"choices\":[]}\n\ndata: [DONE]\n\n"
        );
        for split in 0..stream.len() {
            let mut r = SseRewriter::new(injected);
            let mut out = r.push(&stream[..split]).to_vec();
            out.extend_from_slice(&r.push(&stream[split..]));
            out.extend_from_slice(&r.finish());
            assert_eq!(out, whole, "split at {split}");
        }
    }

    #[test]
    fn sse_rewriting_passes_comments_and_events_as_soon_as_they_end() {
        let injected = Injected {
            token_ids: true,
            logprobs: false,
        };
        let mut r = SseRewriter::new(injected);
        assert_eq!(&r.push(b": keep-alive\r\n")[..], b"");
        assert_eq!(&r.push(b"\r\n")[..], b": keep-alive\r\n\r\n");
        assert_eq!(
            &r.push(b"data: {\"prompt_token_ids\":[1]}\n\ndata: {\"a\"")[..],
            b"data: {}\n\n"
        );
        assert_eq!(&r.push(b":1}\n\n")[..], b"data: {\"a\":1}\n\n");
        assert_eq!(&r.push(b"data: [DONE]")[..], b"");
        assert_eq!(&r.finish()[..], b"data: [DONE]");
    }
}
