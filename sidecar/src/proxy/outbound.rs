//! Stage 3, the request as it goes out: under `--policy` a call for the alias is sent to
//! the version followed now, under its served name; with token fidelity
//! (`--upstream-kind vllm|sglang`) token ids and log-probs are asked for; the headers of
//! this hop are dropped. A body too long to read first goes out as read (its head, then
//! the rest as it arrives), counted as it passes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::StreamExt;
use http::HeaderMap;
use http::header::{self, HeaderValue};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tapline_proto::Api;

use super::fidelity::{Injected, ModelRestore, inject};
use super::model_name;
use super::request::remove_hop_by_hop;
use crate::body::{BoxError, UpBody, full_body};
use crate::config::UpstreamKind;
use crate::policy::Current;

/// The request to send upstream, and what its answer must have undone.
pub(super) struct Outbound {
    pub(super) body: UpBody,
    pub(super) headers: HeaderMap,
    /// `--policy`: the version it goes to, and the harness's name for the model.
    pub(super) route: Option<(u64, ModelRestore)>,
    /// What token fidelity asked for on its own.
    pub(super) injected: Injected,
    /// Bytes of a body too long to read first, counted as they are forwarded.
    pub(super) forwarded: Option<Arc<AtomicU64>>,
}

/// A request body as read: the body (or its head) and the rest not read.
pub(super) struct Read<B> {
    pub(super) bytes: Bytes,
    pub(super) len: usize,
    pub(super) rest: Option<B>,
}

/// Builds the outbound request. `route` is the version a call for the harness's model
/// `alias` goes to (`--policy`), `on_forwarded` is told the size of each frame of a body
/// streamed through.
pub(super) fn outbound<B>(
    kind: UpstreamKind,
    api: Api,
    read: Read<B>,
    route: Option<(Current, &str)>,
    mut headers: HeaderMap,
    on_forwarded: impl Fn(usize) + Send + Sync + 'static,
) -> Outbound
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    remove_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    let Read { bytes, len, rest } = read;
    if let Some(rest) = rest {
        // Only what was read can be sent first; nothing is rewritten.
        let counter = Arc::new(AtomicU64::new(len as u64));
        let forwarded = counter.clone();
        let rest = rest
            .map_frame(move |f| {
                if let Some(d) = f.data_ref() {
                    on_forwarded(d.len());
                    counter.fetch_add(d.len() as u64, Ordering::Relaxed);
                }
                f
            })
            .map_err(Into::into);
        let head = futures::stream::iter(
            std::iter::once(bytes).map(|c| Ok::<_, BoxError>(Frame::data(c))),
        );
        let body =
            http_body_util::StreamBody::new(head.chain(http_body_util::BodyStream::new(rest)));
        return Outbound {
            body: body.boxed_unsync(),
            headers,
            route: None,
            injected: Injected::default(),
            forwarded: Some(forwarded),
        };
    }
    let routed = route.and_then(|(current, alias)| {
        let body = model_name::set_model(&bytes, &current.served_model)?;
        Some((current, alias, body))
    });
    let (bytes, route) = match routed {
        Some((current, alias, body)) => {
            let restore = ModelRestore {
                served: current.served_model,
                alias: alias.to_owned(),
            };
            (body, Some((current.version, restore)))
        }
        None => (bytes, None),
    };
    let (bytes, injected) = match inject(kind, api, &bytes) {
        Some((injected_body, injected)) => (injected_body, injected),
        None => (bytes, Injected::default()),
    };
    if route.is_some() || injected.any() {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
        // What is undone in the answer is undone in its bytes: ask for them plain (an
        // answer compressed anyway is decoded first when it is JSON).
        headers.remove(header::ACCEPT_ENCODING);
    }
    Outbound {
        body: full_body(bytes),
        headers,
        route,
        injected,
        forwarded: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn read(body: &str) -> Read<http_body_util::Full<Bytes>> {
        Read {
            bytes: Bytes::copy_from_slice(body.as_bytes()),
            len: body.len(),
            rest: None,
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        h
    }

    async fn body_of(out: Outbound) -> serde_json::Value {
        let bytes = out.body.collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    const CHAT: &str = r#"{"model":"pol","messages":[{"role":"user","content":"hi"}]}"#;

    #[tokio::test]
    async fn a_plain_call_goes_out_unchanged_less_this_hops_headers() {
        let out = outbound(
            UpstreamKind::Openai,
            Api::ChatCompletions,
            read(CHAT),
            None,
            headers(&[
                ("host", "sidecar:4100"),
                ("connection", "keep-alive"),
                ("accept-encoding", "gzip"),
                ("content-length", "58"),
            ]),
            |_| {},
        );
        assert!(out.route.is_none() && !out.injected.any() && out.forwarded.is_none());
        assert!(!out.headers.contains_key(header::HOST));
        assert!(!out.headers.contains_key(header::CONNECTION));
        assert_eq!(out.headers[header::ACCEPT_ENCODING], "gzip");
        assert_eq!(out.headers[header::CONTENT_LENGTH], "58");
        let bytes = out.body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], CHAT.as_bytes(), "byte for byte");
    }

    #[tokio::test]
    async fn a_policy_call_goes_to_the_version_followed_with_token_fidelity() {
        let current = Current {
            version: 4,
            served_model: "pol@v4".to_owned(),
        };
        let out = outbound(
            UpstreamKind::Vllm,
            Api::ChatCompletions,
            read(CHAT),
            Some((current, "pol")),
            headers(&[("accept-encoding", "gzip"), ("content-length", "58")]),
            |_| {},
        );
        let (version, restore) = out.route.clone().unwrap();
        assert_eq!(version, 4);
        assert_eq!(
            (restore.served.as_str(), restore.alias.as_str()),
            ("pol@v4", "pol")
        );
        assert!(out.injected.token_ids && out.injected.logprobs);
        assert!(
            !out.headers.contains_key(header::ACCEPT_ENCODING),
            "the served name is restored in plain bytes"
        );
        let length: usize = out.headers[header::CONTENT_LENGTH]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let body = body_of(out).await;
        assert_eq!(body["model"], "pol@v4");
        assert_eq!(body["return_token_ids"], true);
        assert_eq!(body["logprobs"], true);
        assert_eq!(length, serde_json::to_vec(&body).unwrap().len());
    }

    #[tokio::test]
    async fn a_body_too_long_to_read_goes_out_whole_and_counted_not_rewritten() {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(b"-tail1"))),
            Ok(Frame::data(Bytes::from_static(b"-tail22"))),
        ];
        let rest = http_body_util::StreamBody::new(futures::stream::iter(frames));
        let seen = Arc::new(AtomicUsize::new(0));
        let seen2 = seen.clone();
        let out = outbound(
            UpstreamKind::Vllm,
            Api::ChatCompletions,
            Read {
                bytes: Bytes::from_static(b"{\"model\":\"pol\""),
                len: 14,
                rest: Some(rest),
            },
            Some((
                Current {
                    version: 4,
                    served_model: "pol@v4".to_owned(),
                },
                "pol",
            )),
            headers(&[("content-length", "27")]),
            move |n| {
                seen2.fetch_add(n, Ordering::Relaxed);
            },
        );
        assert!(out.route.is_none() && !out.injected.any());
        assert_eq!(out.headers[header::CONTENT_LENGTH], "27");
        let forwarded = out.forwarded.clone().unwrap();
        let bytes = out.body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"{\"model\":\"pol\"-tail1-tail22");
        assert_eq!(forwarded.load(Ordering::Relaxed), 27);
        assert_eq!(seen.load(Ordering::Relaxed), 13);
    }
}
