//! Request preparation: which API a call is for, the episode it belongs to (the
//! `/e/{episode}/` path prefix and the `x-tapline-*` headers, taken off before
//! forwarding), the capped read of the request body, and the header rules of one hop
//! (hop-by-hop headers removed both ways, allow-listed headers recorded). Also the error
//! answer in the shape of the API the client called.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use tapline_proto::Api;

use crate::body::{RespBody, full_body};
use crate::config::NEVER_RECORDED;
use crate::episodes::Hints;

/// Headers that concern one connection only (RFC 9110 §7.6.1).
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

/// What [`read_capped`] read of a body.
pub(super) struct ReadBody<B> {
    /// The bytes read: all of the body, or (with `rest`) its head.
    pub(super) bytes: Bytes,
    /// How many.
    pub(super) len: usize,
    /// The unread remainder: the body is longer than the cap, or the memory budget
    /// refused to hold more of it.
    pub(super) rest: Option<B>,
    /// The memory budget refused: `bytes` are forwarded, not captured.
    pub(super) over_budget: bool,
}

/// Reads up to `cap` bytes of a body (a request's, or an answer to rewrite) into one buffer, asking `admit` before
/// holding each total length (the declared one first). Returns the bytes read (at
/// least `cap + 1` of them when the body is longer) and, then, the unread remainder;
/// when `admit` refuses, what was read so far and the remainder.
///
/// The body is held once: a single frame is kept as it came, several are copied into
/// one buffer sized from the declared length (capped, so a false `Content-Length`
/// reserves no more than `cap` plus one frame), not collected and then joined.
pub(super) async fn read_capped<B>(
    mut body: B,
    cap: usize,
    admit: &mut (dyn FnMut(usize) -> bool + Send),
) -> Result<ReadBody<B>, B::Error>
where
    B: Body<Data = Bytes> + Unpin,
{
    let declared = body.size_hint().exact();
    if let Some(declared) = declared
        && !admit(usize::try_from(declared).unwrap_or(usize::MAX).min(cap))
    {
        return Ok(ReadBody {
            bytes: Bytes::new(),
            len: 0,
            rest: Some(body),
            over_budget: true,
        });
    }
    let mut first: Option<Bytes> = None;
    let mut buf = BytesMut::new();
    let mut len = 0;
    let done = |first: Option<Bytes>, buf: BytesMut| first.unwrap_or_else(|| buf.freeze());
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        len += data.len();
        if first.is_none() && buf.is_empty() {
            first = Some(data);
        } else {
            if let Some(f) = first.take() {
                let want = declared
                    .and_then(|d| usize::try_from(d).ok())
                    .unwrap_or(0)
                    .min(cap.saturating_add(1 << 20))
                    .max(f.len() + data.len());
                buf.reserve(want);
                buf.extend_from_slice(&f);
            }
            buf.extend_from_slice(&data);
        }
        if !admit(len) {
            return Ok(ReadBody {
                bytes: done(first, buf),
                len,
                rest: Some(body),
                over_budget: true,
            });
        }
        if len > cap {
            return Ok(ReadBody {
                bytes: done(first, buf),
                len,
                rest: Some(body),
                over_budget: false,
            });
        }
    }
    Ok(ReadBody {
        bytes: done(first, buf),
        len,
        rest: None,
        over_budget: false,
    })
}

/// The allowed headers, by lower-case name; repeated fields joined with ", " in order
/// (RFC 9110 §5.3), so that e.g. two `content-encoding` fields keep both codings.
pub(super) fn recorded_headers(headers: &HeaderMap, allow: &[String]) -> BTreeMap<String, String> {
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
pub(super) fn remove_hop_by_hop(headers: &mut HeaderMap) {
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
pub(super) fn take_tapline_headers(headers: &mut HeaderMap, hints: &mut Hints) {
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
pub(super) fn split_episode_prefix(path_and_query: &str) -> Option<(&str, String)> {
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

/// The `model` of a JSON request body, without building a JSON tree.
pub(super) fn request_model(body: &[u8]) -> String {
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

/// An error and its sources, joined with `: `.
pub(super) fn error_chain(error: &dyn std::error::Error) -> String {
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

    /// What an intermediary must do with the framing and connection headers (RFC 9112
    /// §6.3, RFC 9110 §7.6.1), one rule per block.
    #[test]
    fn hop_by_hop_headers_and_conflicting_framing_are_not_forwarded() {
        let headers = |pairs: &[(&str, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(
                    HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            h
        };
        // Transfer-Encoding overrides Content-Length: the length is removed.
        let mut h = headers(&[("transfer-encoding", "chunked"), ("content-length", "5")]);
        remove_hop_by_hop(&mut h);
        assert!(h.is_empty(), "{h:?}");
        // Content-Length alone is the framing: kept.
        let mut h = headers(&[("content-length", "5")]);
        remove_hop_by_hop(&mut h);
        assert_eq!(h["content-length"], "5");
        // Fields named by Connection are removed with it, in any case and spacing.
        let mut h = headers(&[
            ("connection", "X-Trace ,  close"),
            ("connection", "x-other"),
            ("x-trace", "1"),
            ("x-other", "2"),
            ("x-kept", "3"),
        ]);
        remove_hop_by_hop(&mut h);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["x-kept"]);
        // The fixed hop-by-hop fields never pass.
        let mut h = headers(&[
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("trailer", "x-checksum"),
            ("upgrade", "h2c"),
            ("authorization", "Bearer k"),
        ]);
        remove_hop_by_hop(&mut h);
        assert_eq!(
            h.keys().map(|k| k.as_str()).collect::<Vec<_>>(),
            ["authorization"],
            "end-to-end fields pass"
        );
    }

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
}
