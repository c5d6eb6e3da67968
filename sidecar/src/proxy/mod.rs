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
//!
//! The handler, [`proxy`], is here; the rest is one module per stage:
//! - `request`: API detection, the episode prefix and `x-tapline-*` headers, the capped
//!   read of the request body, hop-by-hop and recorded headers, error answers;
//! - `fidelity`: token ids and log-probs asked of vLLM/SGLang and removed from the
//!   client's copy;
//! - `capture`: the call's record while its response streams, and its hand-off to the
//!   sink;
//! - `stream`: the response body the client reads, teed into the capture, with the last
//!   frame held until the record is spooled.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;
use tapline_proto::{Api, LlmCall, Outcome, RecordKind};

mod capture;
mod fidelity;
mod model_name;
mod request;
mod stream;

/// The body types at the paths they had before they moved to [`crate::body`]
/// (`control.rs` still imports `RespBody` and `full_body` from here).
pub use crate::body::{BoxError, RespBody, UpBody, full_body};
pub use fidelity::{Injected, inject, strip_injected};
pub use request::{api_error, api_of};

use crate::clock::now_nanos;
use crate::episodes::{EPISODE_ID_RULE, Hints, valid_episode_id};
use crate::sse::TerminalWatch;
use crate::state::AppState;
use crate::upstream::SendError;
use capture::{CallGuard, Capture, Spooled, attributed};
use fidelity::{ModelRestore, Rewrite, SseRewriter};
use request::{
    error_chain, read_capped, recorded_headers, remove_hop_by_hop, request_model,
    split_episode_prefix, take_tapline_headers,
};
use stream::{CaptureBody, terminal_event};

/// Header that carries the span id of a proxied call back to the client.
pub const SPAN_ID_HEADER: &str = "x-tapline-span-id";

/// The capture warning of a call the memory budget cut.
pub(super) fn budget_warning(state: &AppState, what: &str) -> String {
    format!(
        "memory_budget: {what}: {} of the {} bytes of --memory-budget-bytes were held by calls in flight and the segment builder",
        state.budget.used(),
        state.budget.limit()
    )
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
    // What the call holds counts against the memory budget: the request, and each
    // rewritten copy of it (--policy routing, token fidelity) while it is forwarded.
    let copies = 1
        + u64::from(state.policy.is_some())
        + u64::from(state.config.upstream_kind != crate::config::UpstreamKind::Openai);
    let mut held = state.budget.empty();
    let read = read_capped(body, cap, &mut |len| held.try_grow_to(copies * len as u64)).await;
    let (request_bytes, read_len, remainder, over_budget) = match read {
        Ok(read) => (read.bytes, read.len, read.rest, read.over_budget),
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
    let captured_request = if over_budget {
        Bytes::new()
    } else {
        request_bytes.slice(..read_len.min(cap))
    };
    let request_model = if remainder.is_none() {
        request_model(&request_bytes)
    } else {
        String::new()
    };
    if over_budget
        && let Some(policy) = &state.policy
        && let Some(current) = policy.current()
    {
        // As for a body over the cap: its model cannot be read without holding it.
        let mut refused = api_error(
            api,
            StatusCode::SERVICE_UNAVAILABLE,
            "memory_budget_full",
            &format!(
                "tapline: the sidecar's memory budget ({} bytes, --memory-budget-bytes) is held by other calls, so it cannot read this request's model and route it to policy {} (now {}); retry, or raise --memory-budget-bytes with the container's memory limit",
                state.budget.limit(),
                policy.config().name,
                current.served_model
            ),
        );
        refused
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return refused;
    }
    if remainder.is_some()
        && let Some(policy) = &state.policy
        && let Some(current) = policy.current()
    {
        // Its model cannot be read, so it could not be sent to a version this sidecar can
        // name: refuse it rather than let the base model answer a call for the policy.
        policy.refused_too_large.fetch_add(1, Ordering::Relaxed);
        return api_error(
            api,
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            &format!(
                "tapline: the request body is larger than the capture cap ({cap} bytes), so this sidecar cannot read its model and route it to policy {} (now {}); raise --capture-cap-bytes (TAPLINE_CAPTURE_CAP_BYTES)",
                policy.config().name,
                current.served_model
            ),
        );
    }

    // --policy: a call for the alias goes to the version followed now, under its served
    // name; the harness gets its own model name back in the response.
    let routed = if remainder.is_none() {
        state
            .policy
            .as_ref()
            .and_then(|p| p.route(&request_model))
            .and_then(|current| {
                let body = model_name::set_model(&request_bytes, &current.served_model)?;
                Some((current, body))
            })
    } else {
        None
    };
    let (request_bytes, restore, policy_version) = match routed {
        Some((current, body)) => {
            if let Some(p) = &state.policy {
                p.rewrites.fetch_add(1, Ordering::Relaxed);
            }
            let restore = ModelRestore {
                served: current.served_model,
                alias: request_model.clone(),
            };
            (body, Some(restore), Some(current.version))
        }
        None => (request_bytes, None, None),
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
    if restore.is_some() {
        // The served name is given back in the response's bytes: ask for them plain.
        headers.remove(header::ACCEPT_ENCODING);
    }
    let mut request_size = None;
    let (up_body, injected): (UpBody, Injected) = match (injected, remainder) {
        (Some((bytes, injected)), _) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
            (full_body(bytes), injected)
        }
        (None, None) => {
            if restore.is_some() {
                headers.insert(
                    header::CONTENT_LENGTH,
                    HeaderValue::from(request_bytes.len()),
                );
            }
            (full_body(request_bytes), Injected::default())
        }
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
                std::iter::once(request_bytes).map(|c| Ok::<_, BoxError>(Frame::data(c))),
            );
            let body =
                http_body_util::StreamBody::new(head.chain(http_body_util::BodyStream::new(rest)));
            (body.boxed_unsync(), Injected::default())
        }
    };

    let mut call = LlmCall {
        span_id: span_id.clone(),
        api: api as i32,
        method: parts.method.to_string(),
        path: path_and_query.clone(),
        start_unix_nanos: start_nanos,
        request_body: captured_request,
        request_truncated: read_len > cap || over_budget,
        request_body_size: read_len as u64,
        request_headers: recorded_headers(&headers, &state.config.recorded_headers),
        request_model,
        token_fields_injected: injected.any(),
        ..attributed(&attribution, &state.config.sidecar_id)
    };
    if over_budget {
        state.budget.count_cut();
        call.capture_warnings
            .push(budget_warning(&state, "request not captured"));
    }
    let mut guard = CallGuard::new(Capture::new(state.clone(), call, request_size, held));

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
        let call = &mut guard.capture().call;
        call.streamed = streamed;
        call.http_status = u32::from(rparts.status.as_u16());
        call.response_headers = recorded_headers(&rparts.headers, &state.config.recorded_headers);
        if let Some(version) = policy_version {
            // Only a call sent to a version the sidecar can name records one.
            call.policy_version = version.to_string();
        } else if let Some(version) = rparts
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
    let restore = restore.filter(|_| content_encoding.is_none());
    if (strip || restore.is_some()) && !streamed {
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
        let stripped = if strip {
            serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|mut v| strip_injected(&mut v, injected).then_some(v))
                .and_then(|v| serde_json::to_vec(&v).ok())
                .map_or(body, Bytes::from)
        } else {
            body
        };
        let stripped = match &restore {
            Some(restore) => restore.apply(stripped),
            None => stripped,
        };
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
    let rewrite = if strip || restore.is_some() {
        rparts.headers.remove(header::CONTENT_LENGTH);
        Rewrite::Sse(SseRewriter::new(
            if strip { injected } else { Injected::default() },
            restore,
        ))
    } else {
        Rewrite::None
    };
    let body = CaptureBody::new(
        rbody,
        guard.take(),
        rewrite,
        state.config.idle_timeout,
        terminal_event(api)
            .filter(|_| streamed)
            .map(TerminalWatch::new),
    );
    state
        .metrics
        .added_latency(sent_at.duration_since(started) + head_at.elapsed());
    Response::from_parts(rparts, body.boxed_unsync())
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
