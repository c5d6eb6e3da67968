//! tapline's wire contract: the record schema, the segment object format, segment keys,
//! store URLs, and the JSON view of records used by `tapline-sidecar dump`.
//!
//! Every component that reads or writes records goes through this crate, so the format
//! lives in exactly one place:
//! - [`v1`]: the protobuf messages generated from `proto/tapline/v1/record.proto`.
//! - [`segment`]: writer and streaming reader for segment objects.
//! - [`keys`]: the object key scheme for segments (time-sortable, deterministic).
//! - [`store`]: opening an `object_store` from a URL.
//! - [`json`]: records as JSON objects (one per line in `dump`).

pub mod encode;
pub mod json;
pub mod keys;
pub mod policy;
pub mod segment;
pub mod store;
mod store_local;

/// Messages of `proto/tapline/v1/record.proto`, generated at build time by prost.
///
/// The `.proto` file is the documentation of every field.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/tapline.v1.rs"));
}

pub use v1::{
    Api, Completion, EndStatus, EpisodeEvent, EpisodeEventKind, LlmCall, Outcome, Record, Reward,
    ToolCall, Usage, record::Kind as RecordKind,
};

impl Record {
    /// Wraps a payload in an envelope whose `id` is the payload's own id.
    pub fn new(
        sidecar_id: &str,
        sidecar_seq: u64,
        written_unix_nanos: i64,
        kind: RecordKind,
    ) -> Self {
        let id = match &kind {
            RecordKind::LlmCall(call) => call.span_id.clone(),
            RecordKind::Reward(reward) => reward.reward_id.clone(),
            RecordKind::EpisodeEvent(event) => event.event_id.clone(),
        };
        Record {
            id,
            sidecar_id: sidecar_id.to_owned(),
            sidecar_seq,
            written_unix_nanos,
            kind: Some(kind),
        }
    }

    /// The episode the record belongs to, if any.
    pub fn episode_id(&self) -> Option<&str> {
        let id = match self.kind.as_ref()? {
            RecordKind::LlmCall(call) => &call.episode_id,
            RecordKind::Reward(reward) => &reward.episode_id,
            RecordKind::EpisodeEvent(event) => &event.episode_id,
        };
        (!id.is_empty()).then_some(id.as_str())
    }
}
