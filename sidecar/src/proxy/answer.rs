//! Stages 5 and 6, the answer: the response head is recorded and passed on, then the
//! body is delivered one of three ways ([`Delivery`]) — teed frame by frame into the
//! capture as it streams ([`CaptureBody`], the usual way), rewritten whole (a JSON
//! answer to undo `--policy` routing or token fidelity in), or, empty, at once. Each way
//! finishes the record, and holds the last byte until it is in the spool.
//!
//! A JSON answer is rewritten only when it fits the capture cap and the memory budget
//! can hold its copies ([`rewrite_copies`]); a larger one goes to the harness as the
//! upstream sent it, and its record says so.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::response::Parts;
use http::{Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use serde_json::Value;
use tapline_proto::{Api, LlmCall, Outcome};

use super::capture::{CallGuard, Capture, wait_spooled};
use super::fidelity::{Injected, ModelRestore, Rewrite, SseRewriter, strip_injected};
use super::forward::Failure;
use super::request::{api_error, read_capped, recorded_headers, remove_hop_by_hop};
use super::stream::{CaptureBody, terminal_event};
use crate::body::{RespBody, full_body};
use crate::rebuild::{Truncated, decode_content_within};
use crate::sse::TerminalWatch;
use crate::state::AppState;
use crate::upstream::UpstreamBody;

/// Header that carries the span id of a proxied call back to the client.
pub const SPAN_ID_HEADER: &str = "x-tapline-span-id";

/// What the answer must have undone of the outbound rewrites.
#[derive(Debug, Default)]
pub(super) struct Undo {
    /// Token fidelity's fields, to remove.
    pub(super) injected: Injected,
    /// `--policy`: the version called, and the harness's model name to give back.
    pub(super) route: Option<(u64, ModelRestore)>,
}

/// What the response head says about its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Head {
    /// An event stream (`text/event-stream`).
    pub(super) streamed: bool,
    /// Compressed (a `Content-Encoding` other than identity): its bytes cannot be
    /// rewritten.
    pub(super) encoded: bool,
}

/// Records the response head in `call` (status, allowed headers, policy version) and
/// prepares it for the client: hop-by-hop headers off, the span id on.
pub(super) fn record_head(
    call: &mut LlmCall,
    head: &mut Parts,
    recorded: &[String],
    version_called: Option<u64>,
) -> Head {
    remove_hop_by_hop(&mut head.headers);
    let encoded = head
        .headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|e| !e.eq_ignore_ascii_case("identity"));
    let streamed = head
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("text/event-stream"));
    call.streamed = streamed;
    call.http_status = u32::from(head.status.as_u16());
    call.response_headers = recorded_headers(&head.headers, recorded);
    if let Some(version) = version_called {
        // Only a call sent to a version the sidecar can name records one.
        call.policy_version = version.to_string();
    } else if let Some(version) = head
        .headers
        .get("x-tapline-policy-version")
        .and_then(|v| v.to_str().ok())
    {
        call.policy_version = version.to_owned();
    }
    if let Ok(v) = HeaderValue::from_str(&call.span_id) {
        head.headers.insert(SPAN_ID_HEADER, v);
    }
    Head { streamed, encoded }
}

/// How a response body reaches the client.
#[derive(Debug, PartialEq)]
pub(super) enum Delivery {
    /// Read whole (decoded when compressed), rewritten, sent as one: `strip` token
    /// fidelity's fields, `restore` the harness's model name.
    Whole {
        strip: Option<Injected>,
        restore: Option<ModelRestore>,
    },
    /// No body (content-length 0, 204, 304): the call is complete with its head.
    Empty,
    /// Streamed frame by frame, each event rewritten with the SSE rewriter when it
    /// says so; `compressed`: there was something to undo, but the stream is compressed
    /// and goes unchanged.
    Stream {
        rewrite: Option<(Injected, Option<ModelRestore>)>,
        compressed: bool,
    },
}

/// Chooses the delivery. Fields the upstream was asked for are removed only from a
/// successful answer; a compressed JSON answer is decoded to be rewritten, a compressed
/// stream is not rewritten.
pub(super) fn delivery(head: Head, status: StatusCode, empty: bool, undo: Undo) -> Delivery {
    let strip = (undo.injected.any() && status.is_success()).then_some(undo.injected);
    let restore = undo.route.map(|(_, r)| r);
    let undoing = strip.is_some() || restore.is_some();
    if undoing && !head.streamed {
        return Delivery::Whole { strip, restore };
    }
    if empty {
        return Delivery::Empty;
    }
    let rewrite = (undoing && !head.encoded).then(|| (strip.unwrap_or_default(), restore));
    Delivery::Stream {
        rewrite,
        compressed: undoing && head.encoded,
    }
}

/// Delivers the upstream's response; `Err` is the sidecar's own answer when the
/// upstream failed on the way (already recorded).
pub(super) async fn answer(
    state: &Arc<AppState>,
    mut guard: CallGuard,
    api: Api,
    response: Response<UpstreamBody>,
    undo: Undo,
) -> Result<Response<RespBody>, Response<RespBody>> {
    let (mut head, body) = response.into_parts();
    let version_called = undo.route.as_ref().map(|(v, _)| *v);
    let shape = record_head(
        &mut guard.capture().call,
        &mut head,
        &state.config.recorded_headers,
        version_called,
    );
    match delivery(shape, head.status, body.is_end_stream(), undo) {
        Delivery::Whole { strip, restore } => {
            whole(state, guard, api, head, body, strip, restore).await
        }
        Delivery::Empty => {
            // hyper will not poll an empty body: the call is complete now.
            let capture = guard.take();
            wait_spooled(capture.finish_acked(Outcome::Ok, None), state.ack_wait).await;
            Ok(Response::from_parts(head, full_body(Bytes::new())))
        }
        Delivery::Stream {
            rewrite,
            compressed,
        } => {
            if compressed {
                let encoding = head.headers.get(header::CONTENT_ENCODING);
                let warning = format!(
                    "response_not_rewritten: the event stream was sent as the upstream gave it: it is compressed ({}), and only a JSON answer is decoded to be rewritten",
                    encoding.map_or(String::new(), |e| String::from_utf8_lossy(e.as_bytes())
                        .into_owned())
                );
                guard.capture().call.capture_warnings.push(warning);
            }
            let rewrite = match rewrite {
                Some((injected, restore)) => {
                    head.headers.remove(header::CONTENT_LENGTH);
                    Rewrite::Sse(SseRewriter::new(injected, restore))
                }
                None => Rewrite::None,
            };
            let terminal = terminal_event(api)
                .filter(|_| shape.streamed)
                .map(TerminalWatch::new);
            let body = CaptureBody::new(
                body,
                guard.take(),
                rewrite,
                state.config.idle_timeout,
                terminal,
            );
            Ok(Response::from_parts(head, body.boxed_unsync()))
        }
    }
}

/// How many times its length a JSON answer being rewritten may hold: the bytes read and
/// the bytes sent, and for token fidelity the parsed tree between them
/// (`serde_json::Value` takes up to about 8 times the text of an answer with token ids
/// and log-probs: 32 bytes for each number of an array).
pub(super) fn rewrite_copies(strip: bool) -> u64 {
    if strip { 10 } else { 2 }
}

/// Reads a JSON answer to rewrite it, or, when it is over the cap or the budget, passes
/// it on unchanged. The record comes first: the answer is read holding one copy, the
/// capture takes its own, and only then are the rewrite's copies asked for.
async fn whole(
    state: &Arc<AppState>,
    mut guard: CallGuard,
    api: Api,
    mut head: Parts,
    body: UpstreamBody,
    strip: Option<Injected>,
    restore: Option<ModelRestore>,
) -> Result<Response<RespBody>, Response<RespBody>> {
    let cap = state.config.capture_cap_bytes;
    let idle = state.config.idle_timeout;
    let copies = rewrite_copies(strip.is_some());
    let declared = body.size_hint().exact();
    let mut held = state.budget.empty();
    // While this reads, the guard records a client that goes away as aborted.
    let read = tokio::time::timeout(
        idle,
        read_capped(body, cap, &mut |len| held.try_grow_to(len as u64)),
    )
    .await;
    let read = match read {
        Ok(Ok(read)) => read,
        Ok(Err(error)) => {
            drop(held);
            let failure = Failure::body(&state.upstream_base, &error);
            return Err(local_failure(guard.take(), api, failure).await);
        }
        Err(_) => {
            drop(held);
            let failure = Failure::timeout(&state.upstream_base, "no body", idle);
            return Err(local_failure(guard.take(), api, failure).await);
        }
    };
    let mut capture = guard.take();
    capture.push(&read.bytes);
    let left = left_in(strip.as_ref(), restore.as_ref());
    if let Some(rest) = read.rest {
        // Too large to read whole: it goes as it came, and its record says what the
        // harness got that it did not ask for.
        let over_cap = read.len > cap || declared.is_some_and(|d| d > cap as u64);
        let why = if over_cap {
            format!("it is larger than the capture cap ({cap} bytes)")
        } else {
            format!(
                "the memory budget ({} bytes) could not hold it",
                state.budget.limit()
            )
        };
        not_rewritten(&mut capture, &format!("with {left}: {why}"));
        drop(held);
        let body = CaptureBody::new(rest, capture, Rewrite::None, idle, None).after(read.bytes);
        return Ok(Response::from_parts(head, body.boxed_unsync()));
    }
    if !held.try_grow_to(copies * read.len as u64) {
        let why = format!(
            "with {left}: the memory budget ({} bytes) could not hold {copies} copies of it",
            state.budget.limit()
        );
        drop(held);
        return Ok(unchanged(state, capture, head, read.bytes, &why).await);
    }
    let encoding = head
        .headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .filter(|e| !e.eq_ignore_ascii_case("identity"))
        .map(str::to_owned);
    let plain = match &encoding {
        None => read.bytes,
        Some(encoding) => {
            let len = read.len;
            let decoded =
                decode_content_within(Some(encoding), &read.bytes, Truncated::Refuse, &mut |n| {
                    held.try_grow_to(copies * (len + n) as u64)
                })
                .map(|d| Bytes::from(d.into_owned()));
            match decoded {
                Ok(decoded) => {
                    head.headers.remove(header::CONTENT_ENCODING);
                    decoded
                }
                Err(why) => {
                    // Not decodable within the limits: it goes as it came.
                    drop(held);
                    let why = format!("with {left}: {why}");
                    return Ok(unchanged(state, capture, head, read.bytes, &why).await);
                }
            }
        }
    };
    let rewritten = rewrite_whole(plain, strip, restore.as_ref());
    drop(held);
    state
        .metrics
        .response_bytes
        .fetch_add(rewritten.len() as u64, Ordering::Relaxed);
    head.headers.remove(header::CONTENT_LENGTH);
    wait_spooled(capture.finish_acked(Outcome::Ok, None), state.ack_wait).await;
    Ok(Response::from_parts(head, full_body(rewritten)))
}

/// What the harness gets that it did not ask for when an answer is not rewritten.
fn left_in(strip: Option<&Injected>, restore: Option<&ModelRestore>) -> String {
    match (strip, restore) {
        (Some(_), Some(r)) => format!(
            "token ids and log-probs the harness did not ask for, and the served model name {}",
            r.served
        ),
        (Some(_), None) => "token ids and log-probs the harness did not ask for".to_owned(),
        (None, Some(r)) => format!("the served model name {}", r.served),
        (None, None) => "nothing changed".to_owned(),
    }
}

/// Flags a call whose answer was sent as the upstream gave it.
fn not_rewritten(capture: &mut Capture, why: &str) {
    let warning =
        format!("response_not_rewritten: the answer was sent as the upstream gave it, {why}");
    tracing::warn!(span_id = %capture.call.span_id, "{warning}");
    capture.call.capture_warnings.push(warning);
}

/// Sends a whole answer as it came, once its record (flagged) is spooled.
async fn unchanged(
    state: &AppState,
    mut capture: Capture,
    head: Parts,
    bytes: Bytes,
    why: &str,
) -> Response<RespBody> {
    not_rewritten(&mut capture, why);
    state
        .metrics
        .response_bytes
        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
    wait_spooled(capture.finish_acked(Outcome::Ok, None), state.ack_wait).await;
    Response::from_parts(head, full_body(bytes))
}

/// A whole JSON answer with token fidelity's fields removed (`strip`) and the harness's
/// model name given back (`restore`); bytes it cannot parse go as they came.
pub(super) fn rewrite_whole(
    body: Bytes,
    strip: Option<Injected>,
    restore: Option<&ModelRestore>,
) -> Bytes {
    let body = match strip {
        Some(injected) => serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|mut v| strip_injected(&mut v, injected).then_some(v))
            .and_then(|v| serde_json::to_vec(&v).ok())
            .map_or(body, Bytes::from),
        None => body,
    };
    match restore {
        Some(restore) => restore.apply(body),
        None => body,
    }
}

/// Answers for the upstream (502/504/400) and records the call with that outcome.
pub(super) async fn local_failure(
    mut capture: Capture,
    api: Api,
    failure: Failure,
) -> Response<RespBody> {
    let Failure {
        status,
        outcome,
        code,
        message,
    } = failure;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(status: u16, headers: &[(&str, &str)]) -> Parts {
        let mut resp = Response::builder().status(status);
        for (name, value) in headers {
            resp = resp.header(*name, *value);
        }
        resp.body(()).unwrap().into_parts().0
    }

    fn restore() -> ModelRestore {
        ModelRestore {
            served: "pol@v2".to_owned(),
            alias: "pol".to_owned(),
        }
    }

    const IDS: Injected = Injected {
        token_ids: true,
        logprobs: true,
        ids_null: false,
    };

    #[test]
    fn the_head_is_recorded_and_passed_on_with_the_span_id() {
        let mut call = LlmCall {
            span_id: "0193-span".to_owned(),
            ..Default::default()
        };
        let mut head = parts(
            201,
            &[
                ("content-type", "text/event-stream; charset=utf-8"),
                ("x-request-id", "r1"),
                ("connection", "close"),
                ("x-tapline-policy-version", "7"),
            ],
        );
        let shape = record_head(&mut call, &mut head, &["x-request-id".to_owned()], None);
        assert_eq!(
            shape,
            Head {
                streamed: true,
                encoded: false
            }
        );
        assert!(call.streamed);
        assert_eq!(call.http_status, 201);
        assert_eq!(
            call.response_headers
                .get("x-request-id")
                .map(String::as_str),
            Some("r1")
        );
        assert_eq!(call.response_headers.len(), 1);
        assert_eq!(
            call.policy_version, "7",
            "the upstream's header when none was called"
        );
        assert_eq!(head.headers[SPAN_ID_HEADER], "0193-span");
        assert!(!head.headers.contains_key(header::CONNECTION));

        // A version the sidecar called wins over what the upstream says.
        let mut head = parts(
            200,
            &[
                ("x-tapline-policy-version", "7"),
                ("content-encoding", "gzip"),
            ],
        );
        let shape = record_head(&mut call, &mut head, &[], Some(3));
        assert_eq!(call.policy_version, "3");
        assert!(shape.encoded && !shape.streamed);
        let mut head = parts(200, &[("content-encoding", "identity")]);
        assert!(!record_head(&mut call, &mut head, &[], None).encoded);
    }

    #[test]
    fn each_answer_is_delivered_the_way_its_rewrites_need() {
        let head = |streamed, encoded| Head { streamed, encoded };
        let (json, sse, gzip, gzip_sse) = (
            head(false, false),
            head(true, false),
            head(false, true),
            head(true, true),
        );
        let ok = StatusCode::OK;
        let plain = || Undo::default();
        let ids = || Undo {
            injected: IDS,
            route: None,
        };
        let routed = || Undo {
            injected: Injected::default(),
            route: Some((2, restore())),
        };
        let streamed = |rewrite| Delivery::Stream {
            rewrite,
            compressed: false,
        };
        assert_eq!(delivery(json, ok, false, plain()), streamed(None));
        assert_eq!(delivery(json, ok, true, plain()), Delivery::Empty);
        let whole_ids = Delivery::Whole {
            strip: Some(IDS),
            restore: None,
        };
        assert_eq!(delivery(json, ok, false, ids()), whole_ids);
        // An error answer has nothing injected to remove; a routed one still has the
        // served name to give back.
        assert_eq!(
            delivery(json, StatusCode::BAD_REQUEST, false, ids()),
            streamed(None)
        );
        let whole_name = Delivery::Whole {
            strip: None,
            restore: Some(restore()),
        };
        assert_eq!(
            delivery(json, StatusCode::BAD_REQUEST, false, routed()),
            whole_name
        );
        assert_eq!(delivery(sse, ok, false, ids()), streamed(Some((IDS, None))));
        assert_eq!(
            delivery(sse, ok, false, routed()),
            streamed(Some((Injected::default(), Some(restore()))))
        );
        // A compressed JSON answer is decoded to be rewritten; a compressed stream goes
        // unchanged, and says so.
        assert_eq!(delivery(gzip, ok, false, ids()), whole_ids);
        assert_eq!(delivery(gzip, ok, false, routed()), whole_name);
        let unchanged = Delivery::Stream {
            rewrite: None,
            compressed: true,
        };
        assert_eq!(delivery(gzip_sse, ok, false, ids()), unchanged);
        assert_eq!(delivery(gzip_sse, ok, false, plain()), streamed(None));
    }

    #[test]
    fn a_whole_answer_loses_what_was_injected_and_gets_its_name_back() {
        let body = Bytes::from_static(
            br#"{"id":"c1","model":"pol@v2","prompt_token_ids":[1,2],"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"logprobs":{"content":[]},"token_ids":[5]}]}"#,
        );
        let out = rewrite_whole(body.clone(), Some(IDS), Some(&restore()));
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["model"], "pol");
        assert!(v.get("prompt_token_ids").is_none());
        assert!(v["choices"][0].get("token_ids").is_none());
        assert!(v["choices"][0]["logprobs"].is_null());
        assert_eq!(v["choices"][0]["message"]["content"], "hi");

        // Only the name: every other byte as it came.
        let named = rewrite_whole(body.clone(), None, Some(&restore()));
        assert_eq!(
            String::from_utf8_lossy(&named),
            String::from_utf8_lossy(&body).replace("pol@v2", "pol")
        );
        // vLLM: the id keys stay, as null, as a direct call without the flag shows them.
        let vllm = Injected {
            ids_null: true,
            ..IDS
        };
        let v: Value =
            serde_json::from_slice(&rewrite_whole(body.clone(), Some(vllm), None)).unwrap();
        assert!(v["prompt_token_ids"].is_null() && v.get("prompt_token_ids").is_some());
        assert!(
            v["choices"][0]["token_ids"].is_null() && v["choices"][0].get("token_ids").is_some()
        );
        assert!(
            v["choices"][0].get("prompt_token_ids").is_none(),
            "no key is added"
        );
        // What is not JSON goes as it came.
        let text = Bytes::from_static(b"upstream overloaded");
        assert_eq!(
            rewrite_whole(text.clone(), Some(IDS), Some(&restore())),
            text
        );
    }
}
