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
//! The handler, [`proxy`], is a short sequence of stages, one module each:
//! 1. `attribute`: the API, the path forwarded, what the path prefix and the
//!    `x-tapline-*` headers say about the episode (then [`crate::episodes`] attributes
//!    the call);
//! 2. `admit`: the request body read up to the capture cap, held against the memory
//!    budget, and refused under `--policy` when its model cannot be read;
//! 3. `outbound`: the request as it goes out (`--policy` routing, token fidelity from
//!    `fidelity`, this hop's headers off);
//! 4. `forward`: sent to the upstream; what fails there is a `Failure`, answered and
//!    recorded by [`local_failure`];
//! 5. `answer`: the response head recorded, and the body delivered — streamed through
//!    `stream`'s `CaptureBody` (teed into the capture, the last frame held until the
//!    record is spooled), rewritten whole, or empty;
//! 6. `capture`: the record, finished and handed to the sink.
//!
//! `request` holds what several stages share: the capped read, header rules, API
//! detection, the error answer in the API's shape.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use http::{Request, Response};
use hyper::body::Incoming;
use tapline_proto::{Api, LlmCall, Outcome, RecordKind};

mod admit;
mod answer;
mod attribute;
mod capture;
mod fidelity;
mod forward;
mod model_name;
mod outbound;
mod request;
mod stream;

/// The body types at the paths they had before they moved to [`crate::body`]
/// (`control.rs` still imports `RespBody` and `full_body` from here).
pub use crate::body::{BoxError, RespBody, UpBody, full_body};
pub use answer::SPAN_ID_HEADER;
pub use fidelity::{Injected, inject, strip_injected};
pub use request::{api_error, api_of};

use crate::clock::now_nanos;
use crate::state::AppState;
use admit::{Admitted, NotAdmitted, admit};
use answer::{Undo, local_failure};
use capture::{CallGuard, Capture, budget_warning, call_head};
use forward::forward;
use outbound::{Read, outbound};
use request::recorded_headers;

/// Proxies one request: the stages in order, each returning early with its own answer
/// when the call ends there.
pub async fn proxy(state: Arc<AppState>, req: Request<Incoming>) -> Response<RespBody> {
    let started = Instant::now();
    let start_nanos = now_nanos();
    let (mut parts, body) = req.into_parts();
    let target = match attribute::target(&mut parts) {
        Ok(target) => target,
        Err(refused) => return *refused,
    };
    let api = target.api;
    state.metrics.request(api);
    let call = call_head(
        &state.episodes.attribute(target.hints),
        &state.config.sidecar_id,
        api,
        &parts.method,
        &target.path_and_query,
        start_nanos,
    );
    let admitted = match admit(&state, api, body).await {
        Ok(admitted) => admitted,
        Err(NotAdmitted::Refused(refused)) => return refused,
        Err(NotAdmitted::ClientGone(error)) => return client_gone(&state, call, &error),
    };
    let (capture, body, headers, undo) = go_out(&state, api, call, admitted, parts.headers);
    let mut guard = CallGuard::new(capture);
    let path_and_query = &target.path_and_query;
    let (response, waited) =
        match forward(&state, parts.method, path_and_query, body, headers).await {
            Ok(sent) => sent,
            Err(failure) => return local_failure(guard.take(), api, failure).await,
        };
    match answer::answer(&state, guard, api, response, undo).await {
        Ok(response) => {
            state
                .metrics
                .added_latency(started.elapsed().saturating_sub(waited));
            response
        }
        Err(failed) => failed,
    }
}

/// The client went away while sending its request: nothing to forward; the call is
/// recorded as aborted.
fn client_gone(
    state: &AppState,
    mut call: LlmCall,
    error: &dyn std::fmt::Display,
) -> Response<RespBody> {
    call.end_unix_nanos = now_nanos();
    call.outcome = Outcome::ClientAborted as i32;
    call.error = format!("client request body failed: {error}");
    state.metrics.outcome(Outcome::ClientAborted);
    let api = call.api();
    drop(state.sink.submit(RecordKind::LlmCall(call)));
    api_error(
        api,
        http::StatusCode::BAD_REQUEST,
        "bad_request",
        "tapline: request body could not be read",
    )
}

/// Stage 3 with the state: the outbound request for an admitted body, and the call's
/// capture with what its record keeps of the request.
fn go_out(
    state: &Arc<AppState>,
    api: Api,
    mut call: LlmCall,
    admitted: Admitted<Incoming>,
    headers: http::HeaderMap,
) -> (Capture, UpBody, http::HeaderMap, Undo) {
    let cap = state.config.capture_cap_bytes;
    call.request_body = admitted.captured(cap);
    let Admitted {
        bytes,
        len,
        rest,
        over_budget,
        model,
        held,
    } = admitted;
    let route = match (&state.policy, &rest) {
        (Some(policy), None) => policy
            .route(&model)
            .map(|current| (current, model.as_str())),
        _ => None,
    };
    let metrics = state.metrics.clone();
    let on_forwarded = move |n: usize| {
        metrics.request_bytes.fetch_add(n as u64, Ordering::Relaxed);
    };
    let read = Read { bytes, len, rest };
    let out = outbound(
        state.config.upstream_kind,
        api,
        read,
        route,
        headers,
        on_forwarded,
    );
    if let (Some(policy), Some(_)) = (&state.policy, &out.route) {
        // Counted once the body names the version (`set_model` found its `model`).
        policy.rewrites.fetch_add(1, Ordering::Relaxed);
    }
    call.request_truncated = len > cap || over_budget;
    call.request_body_size = len as u64;
    call.request_headers = recorded_headers(&out.headers, &state.config.recorded_headers);
    call.request_model = model;
    call.token_fields_injected = out.injected.any();
    if over_budget {
        state.budget.count_cut();
        let warning = budget_warning(state, "request not captured");
        call.capture_warnings.push(warning);
    }
    let capture = Capture::new(state.clone(), call, out.forwarded, held);
    let undo = Undo {
        injected: out.injected,
        route: out.route,
    };
    (capture, out.body, out.headers, undo)
}
