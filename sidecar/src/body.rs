//! The HTTP body types of the sidecar, both ways: what every handler answers with
//! ([`RespBody`], [`full_body`]) and what the proxy sends upstream ([`UpBody`]).
//!
//! They live here, below the server, the proxy, the control API and the upstream pool,
//! so that none of those has to import another for a type.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;

/// Error type of response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Body of every response the sidecar sends.
pub type RespBody = UnsyncBoxBody<Bytes, BoxError>;
/// Body of every request the sidecar sends upstream.
pub type UpBody = UnsyncBoxBody<Bytes, BoxError>;

/// A body of fixed bytes.
pub fn full_body(bytes: impl Into<Bytes>) -> RespBody {
    http_body_util::Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}
