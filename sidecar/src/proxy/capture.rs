//! Record building: the [`Capture`] of a call (its record so far and the response bytes
//! teed into it), and how the record is completed and handed to the sink, with an ack
//! that resolves once it is in the spool ([`Spooled`]).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tapline_proto::{Api, LlmCall, Outcome, RecordKind};

use crate::budget::Reservation;
use crate::clock::now_nanos;
use crate::episodes::Attribution;
use crate::rebuild;
use crate::sink::Dropped;
use crate::state::AppState;

/// Resolves once a record is in the spool (or was dropped, counted and flagged).
pub(super) type Spooled = Pin<Box<dyn std::future::Future<Output = Result<(), Dropped>> + Send>>;

/// Everything known about a call while its response streams.
pub(super) struct Capture {
    pub(super) state: Arc<AppState>,
    /// The record so far.
    pub(super) call: LlmCall,
    /// The response body, up to the capture cap.
    body: Vec<u8>,
    /// Response bytes received in all.
    body_size: u64,
    /// Request body bytes forwarded so far, when the body was longer than the cap and
    /// streamed through.
    request_size: Option<Arc<AtomicU64>>,
    /// What the call holds against the memory budget: its request (as reserved when it
    /// was read) and `body`'s capacity; given back once the record is spooled.
    held: Reservation,
    /// What `held` was for the request, before any response byte.
    request_held: u64,
    /// The budget refused more of the response: `body` stops growing.
    budget_cut: bool,
}

/// Records the call as aborted by the client if the proxy future is dropped (the client
/// went away) before the response was handed to it.
pub(super) struct CallGuard(Option<Capture>);

impl CallGuard {
    pub(super) fn new(capture: Capture) -> Self {
        CallGuard(Some(capture))
    }

    /// The capture, until it is taken.
    pub(super) fn capture(&mut self) -> &mut Capture {
        self.0.as_mut().expect("capture is present until taken")
    }

    pub(super) fn take(&mut self) -> Capture {
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
    /// A capture of `call`, before any response byte. `request_size` counts the bytes of
    /// a request body too long to be read before forwarding.
    pub(super) fn new(
        state: Arc<AppState>,
        call: LlmCall,
        request_size: Option<Arc<AtomicU64>>,
        held: Reservation,
    ) -> Self {
        Capture {
            state,
            call,
            body: Vec::new(),
            body_size: 0,
            request_size,
            request_held: held.bytes(),
            held,
            budget_cut: false,
        }
    }

    /// Tees response bytes into the record (up to the capture cap).
    pub(super) fn push(&mut self, data: &[u8]) {
        if self.call.first_byte_unix_nanos == 0 {
            self.call.first_byte_unix_nanos = now_nanos();
        }
        self.body_size += data.len() as u64;
        let cap = self.state.config.capture_cap_bytes;
        if self.body.len() < cap && !self.budget_cut {
            let mut take = data.len().min(cap - self.body.len());
            let needed = self.body.len() + take;
            if needed > self.body.capacity() {
                // Grow as a Vec would (doubling, from 8 KiB, never past the cap), with
                // the new capacity reserved against the budget first; when the budget
                // is short, keep the part of this frame that fits and stop there.
                let grown = needed
                    .max(self.body.capacity().saturating_mul(2))
                    .max(8 << 10)
                    .min(cap);
                let base = self.request_held;
                let capacity = if self.held.try_grow_to(base + grown as u64) {
                    grown
                } else {
                    let held = self.held.grow_up_to(base + needed as u64);
                    usize::try_from(held.saturating_sub(base))
                        .unwrap_or(usize::MAX)
                        .min(needed)
                };
                self.body
                    .reserve_exact(capacity.saturating_sub(self.body.len()));
                if capacity < needed {
                    take = capacity.saturating_sub(self.body.len());
                    self.body.extend_from_slice(&data[..take]);
                    self.budget_cut = true;
                    // Counted once a call (its request may have been cut too).
                    if !self
                        .call
                        .capture_warnings
                        .iter()
                        .any(|w| w.starts_with("memory_budget: "))
                    {
                        self.state.budget.count_cut();
                    }
                    let warning = budget_warning(
                        &self.state,
                        &format!("response capture cut at {} bytes", self.body.len()),
                    );
                    self.call.capture_warnings.push(warning);
                    return;
                }
            }
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
    pub(super) fn finish(mut self, outcome: Outcome, error: Option<String>) {
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
    pub(super) fn finish_acked(mut self, outcome: Outcome, error: Option<String>) -> Spooled {
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
        call.response_body = std::mem::take(&mut self.body).into();
        // The live count by outcome goes by transport and status; an error reported
        // inside a 2xx body is counted when the segment is built (`body_errors`).
        self.state
            .metrics
            .outcome(rebuild::by_status(call.outcome(), call.http_status));
        let episode_id = call.episode_id.clone();
        let ack = self.state.sink.submit(RecordKind::LlmCall(self.call));
        let state = self.state;
        let held = self.held;
        Box::pin(async move {
            let result = ack.await;
            // In the spool (or dropped): the call's bodies are freed.
            drop(held);
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

/// A call's record as it starts: a new span id, which call (API, method, path), when it
/// started, and whose (what the attribution says: episode, task, group, sequence, tags).
pub(super) fn call_head(
    a: &Attribution,
    sidecar_id: &str,
    api: Api,
    method: &http::Method,
    path: &str,
    start_unix_nanos: i64,
) -> LlmCall {
    LlmCall {
        span_id: uuid::Uuid::now_v7().to_string(),
        api: api as i32,
        method: method.to_string(),
        path: path.to_owned(),
        start_unix_nanos,
        episode_id: a.episode_id.clone(),
        task_id: a.task_id.clone(),
        group_id: a.group_id.clone(),
        seq: a.seq,
        sidecar_id: sidecar_id.to_owned(),
        tags: a.tags.clone(),
        ..Default::default()
    }
}

/// The capture warning of a call the memory budget cut.
pub(super) fn budget_warning(state: &AppState, what: &str) -> String {
    format!(
        "memory_budget: {what}: {} of the {} bytes of --memory-budget-bytes were held by calls in flight and the segment builder",
        state.budget.used(),
        state.budget.limit()
    )
}

/// Waits for a record to reach the spool, at most `wait` (`None`: as long as it takes).
pub(super) async fn wait_spooled(spooled: Spooled, wait: Option<Duration>) {
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
