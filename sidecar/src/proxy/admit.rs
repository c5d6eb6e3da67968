//! Stage 2, admission: the request body is read up to the capture cap, each length held
//! against the memory budget first. A body over the cap or over the budget is still
//! forwarded whole (its head read here, the rest streamed), but its model cannot be
//! read, so under `--policy` it is refused instead: it could not be sent to a version
//! the sidecar can name.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body::Body;
use tapline_proto::Api;

use super::request::{api_error, read_capped, request_model};
use crate::body::RespBody;
use crate::budget::Reservation;
use crate::config::UpstreamKind;
use crate::state::AppState;

/// A request body as admitted.
pub(super) struct Admitted<B> {
    /// The body (all of it, or with `rest` its head).
    pub(super) bytes: Bytes,
    /// Bytes read.
    pub(super) len: usize,
    /// The part not read: the body is over the cap or the budget.
    pub(super) rest: Option<B>,
    /// The budget refused to hold it: it is forwarded, not captured.
    pub(super) over_budget: bool,
    /// Its `model` (empty when the body was not read whole).
    pub(super) model: String,
    /// What the call holds against the budget for it.
    pub(super) held: Reservation,
}

impl<B> Admitted<B> {
    /// What the record keeps of it.
    pub(super) fn captured(&self, cap: usize) -> Bytes {
        if self.over_budget {
            Bytes::new()
        } else {
            self.bytes.slice(..self.len.min(cap))
        }
    }
}

/// Why a request was not admitted.
pub(super) enum NotAdmitted<E> {
    /// The client went away while sending it: nothing to forward.
    ClientGone(E),
    /// It is answered with this.
    Refused(Response<RespBody>),
}

/// How many copies of a request the call holds while it is forwarded: the body read,
/// and one more for each rewrite of it (`--policy` routing, token fidelity).
pub(super) fn held_copies(policy: bool, kind: UpstreamKind) -> u64 {
    1 + u64::from(policy) + u64::from(kind != UpstreamKind::Openai)
}

/// Reads and admits a request body.
pub(super) async fn admit<B>(
    state: &AppState,
    api: Api,
    body: B,
) -> Result<Admitted<B>, NotAdmitted<B::Error>>
where
    B: Body<Data = Bytes> + Unpin,
{
    let cap = state.config.capture_cap_bytes;
    let copies = held_copies(state.policy.is_some(), state.config.upstream_kind);
    let mut held = state.budget.empty();
    let read = read_capped(body, cap, &mut |len| held.try_grow_to(copies * len as u64))
        .await
        .map_err(NotAdmitted::ClientGone)?;
    state
        .metrics
        .request_bytes
        .fetch_add(read.len as u64, Ordering::Relaxed);
    let model = if read.rest.is_none() {
        request_model(&read.bytes)
    } else {
        String::new()
    };
    if let Some(policy) = &state.policy
        && let Some(current) = policy.current()
        && let Some(refusal) = unroutable(
            Unread {
                over_budget: read.over_budget,
                over_cap: read.rest.is_some(),
            },
            api,
            cap,
            state.budget.limit(),
            &policy.config().name,
            &current.served_model,
        )
    {
        if !read.over_budget {
            policy.refused_too_large.fetch_add(1, Ordering::Relaxed);
        }
        return Err(NotAdmitted::Refused(refusal));
    }
    Ok(Admitted {
        bytes: read.bytes,
        len: read.len,
        rest: read.rest,
        over_budget: read.over_budget,
        model,
        held,
    })
}

/// Why a body was not read whole.
#[derive(Debug, Clone, Copy)]
pub(super) struct Unread {
    pub(super) over_budget: bool,
    pub(super) over_cap: bool,
}

/// Under `--policy` (following `policy`, now served as `served`): the answer to a
/// request whose model could not be read, so that the base model does not answer a call
/// meant for the policy. The budget's refusal is temporary (503 with `Retry-After`),
/// the cap's is not (413).
pub(super) fn unroutable(
    unread: Unread,
    api: Api,
    cap: usize,
    budget_limit: u64,
    policy: &str,
    served: &str,
) -> Option<Response<RespBody>> {
    if unread.over_budget {
        let mut refused = api_error(
            api,
            StatusCode::SERVICE_UNAVAILABLE,
            "memory_budget_full",
            &format!(
                "tapline: the sidecar's memory budget ({budget_limit} bytes, --memory-budget-bytes) is held by other calls, so it cannot read this request's model and route it to policy {policy} (now {served}); retry, or raise --memory-budget-bytes with the container's memory limit"
            ),
        );
        refused
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return Some(refused);
    }
    if unread.over_cap {
        return Some(api_error(
            api,
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            &format!(
                "tapline: the request body is larger than the capture cap ({cap} bytes), so this sidecar cannot read its model and route it to policy {policy} (now {served}); raise --capture-cap-bytes (TAPLINE_CAPTURE_CAP_BYTES)"
            ),
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::MemoryBudget;
    use http_body::Frame;
    use http_body_util::{BodyExt, StreamBody};

    type Chunks =
        StreamBody<futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, String>>>>;

    fn chunks(parts: &[&[u8]]) -> Chunks {
        let frames: Vec<Result<Frame<Bytes>, String>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::copy_from_slice(p))))
            .collect();
        StreamBody::new(futures::stream::iter(frames))
    }

    async fn rest_of(body: Chunks) -> Vec<u8> {
        body.collect().await.unwrap().to_bytes().to_vec()
    }

    #[tokio::test]
    async fn a_body_under_the_cap_is_read_whole_and_held_once_per_copy() {
        let budget = MemoryBudget::new(1 << 20);
        let mut held = budget.empty();
        let read = read_capped(chunks(&[b"{\"model\":", b"\"m\"}"]), 64, &mut |len| {
            held.try_grow_to(3 * len as u64)
        })
        .await
        .unwrap();
        assert_eq!(&read.bytes[..], b"{\"model\":\"m\"}");
        assert_eq!(read.len, 13);
        assert!(read.rest.is_none() && !read.over_budget);
        assert_eq!(held.bytes(), 39);
        assert_eq!(budget.used(), 39);
        drop(held);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn a_body_over_the_cap_gives_its_head_and_the_rest_unread() {
        let read = read_capped(chunks(&[b"abcd", b"efgh", b"ijkl", b"mn"]), 6, &mut |_| {
            true
        })
        .await
        .unwrap();
        // Read until past the cap, then stopped: head and rest are the body, in order.
        assert_eq!(&read.bytes[..], b"abcdefgh");
        assert!(!read.over_budget);
        assert_eq!(rest_of(read.rest.unwrap()).await, b"ijklmn");
    }

    #[tokio::test]
    async fn a_budget_refusal_stops_the_read_and_keeps_the_rest_forwardable() {
        let budget = MemoryBudget::new(10);
        let mut held = budget.empty();
        let read = read_capped(
            chunks(&[b"abcd", b"efgh", b"ijkl", b"mnop"]),
            64,
            &mut |len| held.try_grow_to(len as u64),
        )
        .await
        .unwrap();
        assert!(read.over_budget);
        // The frame that met the refusal was read: it is forwarded with the head.
        assert_eq!(&read.bytes[..], b"abcdefghijkl");
        assert_eq!(rest_of(read.rest.unwrap()).await, b"mnop");
        assert_eq!(held.bytes(), 8, "the refused length is not held");
    }

    #[tokio::test]
    async fn a_declared_length_the_budget_cannot_hold_is_refused_before_any_read() {
        let body = http_body_util::Full::new(Bytes::from_static(b"0123456789"));
        let budget = MemoryBudget::new(4);
        let mut held = budget.empty();
        let read = read_capped(body, 64, &mut |len| held.try_grow_to(len as u64))
            .await
            .unwrap();
        assert!(read.over_budget && read.len == 0 && read.bytes.is_empty());
        let rest = read.rest.unwrap().collect().await.unwrap().to_bytes();
        assert_eq!(&rest[..], b"0123456789");
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn under_a_policy_an_unread_model_is_refused_for_the_right_reason() {
        let none = Unread {
            over_budget: false,
            over_cap: false,
        };
        assert!(unroutable(none, Api::ChatCompletions, 8, 1 << 20, "p", "p@v3").is_none());

        let full = Unread {
            over_budget: true,
            over_cap: true,
        };
        let resp = unroutable(full, Api::ChatCompletions, 8, 1 << 20, "p", "p@v3").unwrap();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["code"], "memory_budget_full");
        assert!(body["error"]["message"].as_str().unwrap().contains("p@v3"));

        let big = Unread {
            over_budget: false,
            over_cap: true,
        };
        let resp = unroutable(big, Api::AnthropicMessages, 8, 1 << 20, "p", "p@v3").unwrap();
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(!resp.headers().contains_key(header::RETRY_AFTER));
    }

    #[test]
    fn each_rewrite_of_a_request_is_one_more_copy_held() {
        assert_eq!(held_copies(false, UpstreamKind::Openai), 1);
        assert_eq!(held_copies(true, UpstreamKind::Openai), 2);
        assert_eq!(held_copies(true, UpstreamKind::Vllm), 3);
        assert_eq!(held_copies(false, UpstreamKind::Sglang), 2);
    }
}
