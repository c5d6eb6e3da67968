//! The tapline sidecar: runs beside one agent harness, proxies its LLM traffic, records
//! every call, and ships the records to object storage.
//!
//! - [`config`]: flags, environment and TOML file, validated once.
//! - [`server`]: the listener, routing and the start/stop life cycle ([`server::Sidecar`]).
//! - [`state`]: [`state::AppState`], what every request handler shares.
//! - [`body`]: the HTTP body types of responses and upstream requests.
//! - [`proxy`]: forwarding and capture of LLM calls.
//! - [`upstream`]: the pool of keep-alive connections to the upstream.
//! - [`control`]: the control API under `/tapline/v1/` used by the SDKs.
//! - [`episodes`]: episode registry and call attribution.
//! - [`sse`]: server-sent-event framing, in one place: the line framer, the event parser
//!   and the watch for a stream's last event.
//! - [`json`]: a JSON tree that borrows its strings from the input.
//! - [`rebuild`]: completions, usage and token ids rebuilt from a response body or stream.
//! - [`budget`]: the memory budget captures and the segment builder reserve against.
//! - [`limits`]: what keeps every record within the readers' limits, and how it is cut.
//! - [`sink`]: the [`sink::RecordSink`] interface, the spool writer and the uploader.
//! - [`spool`]: the local spool (append-only, checksummed files) and its recovery.
//! - [`metrics`]: Prometheus counters.
//! - [`malloc`]: glibc malloc tuned so freed bodies leave the resident set.
//! - [`clock`]: the wall clock records are stamped with.
//! - [`dump`]: prints every record of a store as JSON lines (`tapline-sidecar dump`).

pub mod body;
pub mod budget;
pub mod clock;
pub mod config;
pub mod control;
pub mod dump;
pub mod episodes;
pub mod fds;
pub mod json;
pub mod limits;
pub mod malloc;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod rebuild;
pub mod server;
pub mod sink;
pub mod spool;
pub mod sse;
pub mod state;
pub mod trace;
pub mod upstream;
