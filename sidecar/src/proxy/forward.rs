//! Stage 4, forwarding: the request goes to the upstream in origin form, and waits at
//! most `--response-timeout` for the response head. What goes wrong is a [`Failure`]:
//! the answer the harness gets instead (502, 504, 400) and the outcome recorded.

use std::time::Duration;

use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use tapline_proto::Outcome;

use super::request::error_chain;
use crate::body::UpBody;
use crate::state::AppState;
use crate::upstream::{SendError, UpstreamBody};

/// A call the sidecar answers itself, and how it is recorded.
#[derive(Debug)]
pub(super) struct Failure {
    pub(super) status: StatusCode,
    pub(super) outcome: Outcome,
    /// The error code in the answer.
    pub(super) code: &'static str,
    pub(super) message: String,
}

impl Failure {
    /// The upstream could not be reached, or failed before the response head.
    pub(super) fn send(base: &str, error: &SendError) -> Failure {
        let (outcome, code) = match error {
            SendError::Connect(_) => (Outcome::UpstreamUnreachable, "upstream_unreachable"),
            SendError::Request(_) => (Outcome::UpstreamError, "upstream_error"),
        };
        Failure {
            status: StatusCode::BAD_GATEWAY,
            outcome,
            code,
            message: format!("tapline: upstream {base} failed: {}", error_chain(error)),
        }
    }

    /// The upstream's body failed while the sidecar read it.
    pub(super) fn body(base: &str, error: &(dyn std::error::Error + 'static)) -> Failure {
        Failure {
            status: StatusCode::BAD_GATEWAY,
            outcome: Outcome::UpstreamError,
            code: "upstream_error",
            message: format!("tapline: upstream {base} failed: {}", error_chain(error)),
        }
    }

    /// The upstream sent nothing (`what`: "no response", "no body") within `waited`.
    pub(super) fn timeout(base: &str, what: &str, waited: Duration) -> Failure {
        Failure {
            status: StatusCode::GATEWAY_TIMEOUT,
            outcome: Outcome::Timeout,
            code: "upstream_timeout",
            message: format!("tapline: upstream {base} sent {what} within {waited:.0?}"),
        }
    }
}

/// The upstream's URI for `path_and_query`, in origin form (path and query; the
/// connection pool adds `Host`), under the base URL's own path.
pub(super) fn origin_uri(base: &str, path_and_query: &str) -> Result<Uri, Failure> {
    format!("{base}{path_and_query}")
        .parse::<Uri>()
        .map_err(|e| e.to_string())
        .and_then(|full| {
            let mut parts = full.into_parts();
            parts.scheme = None;
            parts.authority = None;
            Uri::from_parts(parts).map_err(|e| e.to_string())
        })
        .map_err(|e| Failure {
            status: StatusCode::BAD_REQUEST,
            outcome: Outcome::UpstreamError,
            code: "bad_request",
            message: format!("tapline: request path cannot be forwarded: {e}"),
        })
}

/// Sends the request; returns the response head (its body still to come) and how long
/// the upstream took to send it.
pub(super) async fn forward(
    state: &AppState,
    method: Method,
    path_and_query: &str,
    body: UpBody,
    headers: HeaderMap,
) -> Result<(Response<UpstreamBody>, Duration), Failure> {
    let uri = origin_uri(&state.upstream_base, path_and_query)?;
    let mut request = Request::new(body);
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.headers_mut() = headers;
    let sent = std::time::Instant::now();
    let timeout = state.config.response_timeout;
    match tokio::time::timeout(timeout, state.upstream.send(request)).await {
        Ok(Ok(response)) => Ok((response, sent.elapsed())),
        Ok(Err(error)) => Err(Failure::send(&state.upstream_base, &error)),
        Err(_) => Err(Failure::timeout(
            &state.upstream_base,
            "no response",
            timeout,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_go_out_in_origin_form_under_the_bases_path() {
        let uri = origin_uri("http://10.0.0.2:8000", "/v1/chat/completions?a=1").unwrap();
        assert_eq!(uri.to_string(), "/v1/chat/completions?a=1");
        assert!(uri.authority().is_none() && uri.scheme().is_none());
        let uri = origin_uri("https://gw.example/openai", "/v1/responses").unwrap();
        assert_eq!(uri.to_string(), "/openai/v1/responses");
    }

    #[test]
    fn a_path_that_cannot_be_forwarded_is_a_400_named_so() {
        let failure = origin_uri("http://h:1", "/v1/a b").unwrap_err();
        assert_eq!(failure.status, StatusCode::BAD_REQUEST);
        assert_eq!(failure.code, "bad_request");
        assert!(
            failure.message.contains("cannot be forwarded"),
            "{}",
            failure.message
        );
    }

    #[test]
    fn an_unreachable_upstream_and_a_silent_one_are_told_apart() {
        let refused = SendError::Connect("connection refused".into());
        let failure = Failure::send("http://h:1", &refused);
        assert_eq!(failure.status, StatusCode::BAD_GATEWAY);
        assert_eq!(failure.outcome, Outcome::UpstreamUnreachable);
        assert_eq!(failure.code, "upstream_unreachable");
        assert!(failure.message.contains("http://h:1") && failure.message.contains("refused"));

        let silent = Failure::timeout("http://h:1", "no response", Duration::from_secs(600));
        assert_eq!(silent.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(silent.outcome, Outcome::Timeout);
        assert_eq!(
            silent.message,
            "tapline: upstream http://h:1 sent no response within 600s"
        );
    }
}
