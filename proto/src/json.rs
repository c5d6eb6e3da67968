//! Records as JSON objects, for people and scripts (`tapline-sidecar dump`).
//!
//! Field names are the `.proto` names. Enums are written as lower-case names without
//! their prefix (`"outcome": "client_aborted"`). Byte fields are written as text when
//! they are valid UTF-8 (`"request_body": "{...}"`) and as base64 otherwise, under the
//! field name with `_base64` appended (`"response_body_base64": "..."`), so a reader can
//! always tell which it got.

use base64::Engine;
use serde_json::{Map, Value, json};

use crate::{Completion, EpisodeEvent, LlmCall, Record, RecordKind, Reward, ToolCall, Usage};

/// The JSON view of one record.
pub fn record_to_json(record: &Record) -> Value {
    let mut out = Map::new();
    out.insert("id".into(), json!(record.id));
    out.insert("sidecar_id".into(), json!(record.sidecar_id));
    out.insert("sidecar_seq".into(), json!(record.sidecar_seq));
    out.insert(
        "written_unix_nanos".into(),
        json!(record.written_unix_nanos),
    );
    let (kind, body) = match &record.kind {
        Some(RecordKind::LlmCall(call)) => ("llm_call", llm_call(call)),
        Some(RecordKind::Reward(reward)) => ("reward", reward_json(reward)),
        Some(RecordKind::EpisodeEvent(event)) => ("episode_event", episode_event(event)),
        None => ("unknown", Value::Null),
    };
    out.insert("kind".into(), json!(kind));
    out.insert(kind.into(), body);
    Value::Object(out)
}

/// Lower-case enum name without the type prefix: `OUTCOME_CLIENT_ABORTED` → `client_aborted`.
pub fn enum_name(full: &str, prefix: &str) -> String {
    full.strip_prefix(prefix)
        .unwrap_or(full)
        .to_ascii_lowercase()
}

fn insert_bytes(out: &mut Map<String, Value>, name: &str, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(text) => out.insert(name.to_owned(), json!(text)),
        Err(_) => out.insert(
            format!("{name}_base64"),
            json!(base64::engine::general_purpose::STANDARD.encode(bytes)),
        ),
    };
}

fn llm_call(c: &LlmCall) -> Value {
    let mut out = Map::new();
    out.insert("span_id".into(), json!(c.span_id));
    out.insert("episode_id".into(), json!(c.episode_id));
    out.insert("task_id".into(), json!(c.task_id));
    out.insert("group_id".into(), json!(c.group_id));
    out.insert("seq".into(), json!(c.seq));
    out.insert("sidecar_id".into(), json!(c.sidecar_id));
    out.insert(
        "api".into(),
        json!(enum_name(c.api().as_str_name(), "API_")),
    );
    out.insert("method".into(), json!(c.method));
    out.insert("path".into(), json!(c.path));
    out.insert("start_unix_nanos".into(), json!(c.start_unix_nanos));
    out.insert(
        "first_byte_unix_nanos".into(),
        json!(c.first_byte_unix_nanos),
    );
    out.insert("end_unix_nanos".into(), json!(c.end_unix_nanos));
    out.insert("http_status".into(), json!(c.http_status));
    out.insert(
        "outcome".into(),
        json!(enum_name(c.outcome().as_str_name(), "OUTCOME_")),
    );
    out.insert("streamed".into(), json!(c.streamed));
    insert_bytes(&mut out, "request_body", &c.request_body);
    insert_bytes(&mut out, "response_body", &c.response_body);
    out.insert("request_truncated".into(), json!(c.request_truncated));
    out.insert("response_truncated".into(), json!(c.response_truncated));
    out.insert("request_body_size".into(), json!(c.request_body_size));
    out.insert("response_body_size".into(), json!(c.response_body_size));
    out.insert("request_headers".into(), json!(c.request_headers));
    out.insert("response_headers".into(), json!(c.response_headers));
    out.insert("request_model".into(), json!(c.request_model));
    out.insert("response_model".into(), json!(c.response_model));
    out.insert(
        "completions".into(),
        Value::Array(c.completions.iter().map(completion).collect()),
    );
    out.insert("prompt_token_ids".into(), json!(c.prompt_token_ids));
    out.insert("usage".into(), c.usage.as_ref().map_or(Value::Null, usage));
    out.insert("policy_version".into(), json!(c.policy_version));
    out.insert("tags".into(), json!(c.tags));
    out.insert("error".into(), json!(c.error));
    out.insert("capture_warnings".into(), json!(c.capture_warnings));
    Value::Object(out)
}

fn completion(c: &Completion) -> Value {
    json!({
        "index": c.index,
        "text": c.text,
        "reasoning": c.reasoning,
        "tool_calls": c.tool_calls.iter().map(tool_call).collect::<Vec<_>>(),
        "finish_reason": c.finish_reason,
        "token_ids": c.token_ids,
        "logprobs": c.logprobs,
    })
}

fn tool_call(t: &ToolCall) -> Value {
    json!({"id": t.id, "type": t.r#type, "name": t.name, "arguments": t.arguments})
}

fn usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "cached_prompt_tokens": u.cached_prompt_tokens,
        "reasoning_tokens": u.reasoning_tokens,
    })
}

fn reward_json(r: &Reward) -> Value {
    json!({
        "reward_id": r.reward_id,
        "episode_id": r.episode_id,
        "span_id": r.span_id,
        "name": r.name,
        "value": r.value,
        "time_unix_nanos": r.time_unix_nanos,
        "tags": r.tags,
    })
}

fn episode_event(e: &EpisodeEvent) -> Value {
    json!({
        "event_id": e.event_id,
        "episode_id": e.episode_id,
        "kind": enum_name(e.kind().as_str_name(), "EPISODE_EVENT_KIND_"),
        "task_id": e.task_id,
        "group_id": e.group_id,
        "status": enum_name(e.status().as_str_name(), "END_STATUS_"),
        "metadata": e.metadata,
        "time_unix_nanos": e.time_unix_nanos,
        "incomplete": e.incomplete,
        "dropped_records": e.dropped_records,
        "bound": e.bound,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Outcome, RecordKind};

    #[test]
    fn bodies_are_text_or_base64_and_enums_are_names() {
        let call = LlmCall {
            span_id: "s".into(),
            request_body: br#"{"model":"m"}"#.to_vec().into(),
            response_body: vec![0xff, 0x00, 0x01].into(),
            outcome: Outcome::ClientAborted as i32,
            ..Default::default()
        };
        let v = record_to_json(&Record::new("side", 1, 5, RecordKind::LlmCall(call)));
        assert_eq!(v["kind"], "llm_call");
        assert_eq!(v["id"], "s");
        assert_eq!(v["llm_call"]["request_body"], r#"{"model":"m"}"#);
        assert_eq!(v["llm_call"]["response_body_base64"], "/wAB");
        assert!(v["llm_call"].get("response_body").is_none());
        assert_eq!(v["llm_call"]["outcome"], "client_aborted");
    }
}
