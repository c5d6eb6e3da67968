//! Anthropic Messages, as JSON or as named events (`message_start`, content block
//! starts and deltas, `message_delta`, `message_stop`, `error`).

use std::collections::BTreeMap;

use tapline_proto::{Completion, ToolCall, Usage};

use super::{
    Rebuilt, compact, error_member, error_message, event_json, get_str, get_u64, set_first,
};
use crate::json::Json as Value;
use crate::sse::SseEvent;

/// One content block of a message.
#[derive(Debug, Default)]
struct BlockAcc {
    kind: String,
    text: String,
    thinking: String,
    id: String,
    name: String,
    /// Owned: a streamed block outlives the event that started it.
    input: Option<Value<'static>>,
    partial_json: String,
}

impl BlockAcc {
    fn from_block(block: &Value<'_>) -> Self {
        BlockAcc {
            kind: get_str(block, "type").unwrap_or_default().to_owned(),
            text: get_str(block, "text").unwrap_or_default().to_owned(),
            thinking: get_str(block, "thinking").unwrap_or_default().to_owned(),
            id: get_str(block, "id").unwrap_or_default().to_owned(),
            name: get_str(block, "name").unwrap_or_default().to_owned(),
            input: block.get("input").cloned().map(Value::into_owned),
            partial_json: String::new(),
        }
    }
}

#[derive(Debug, Default)]
struct AnthropicUsage {
    seen: bool,
    input: Option<u64>,
    output: Option<u64>,
    cache_read: Option<u64>,
}

impl AnthropicUsage {
    fn apply(&mut self, u: &Value<'_>) {
        if !u.is_object() {
            return;
        }
        self.seen = true;
        if let Some(n) = get_u64(u, &["input_tokens"]) {
            self.input = Some(n);
        }
        if let Some(n) = get_u64(u, &["output_tokens"]) {
            self.output = Some(n);
        }
        if let Some(n) = get_u64(u, &["cache_read_input_tokens"]) {
            self.cache_read = Some(n);
        }
    }

    fn into_usage(self) -> Option<Usage> {
        self.seen.then(|| Usage {
            prompt_tokens: self.input.unwrap_or(0),
            completion_tokens: self.output.unwrap_or(0),
            total_tokens: match (self.input, self.output) {
                (Some(i), Some(o)) => i.saturating_add(o),
                _ => 0,
            },
            cached_prompt_tokens: self.cache_read.unwrap_or(0),
            reasoning_tokens: 0,
        })
    }
}

/// The single completion of a message, from its blocks in index order.
fn anthropic_completion(blocks: BTreeMap<u64, BlockAcc>, stop_reason: String) -> Completion {
    let mut c = Completion {
        finish_reason: stop_reason,
        ..Completion::default()
    };
    for block in blocks.into_values() {
        match block.kind.as_str() {
            "text" => c.text.push_str(&block.text),
            "thinking" => c.reasoning.push_str(&block.thinking),
            "tool_use" | "server_tool_use" => {
                let arguments = if block.partial_json.is_empty() {
                    block.input.as_ref().map(compact).unwrap_or_default()
                } else {
                    block.partial_json
                };
                c.tool_calls.push(ToolCall {
                    id: block.id,
                    r#type: block.kind,
                    name: block.name,
                    arguments,
                });
            }
            _ => {}
        }
    }
    c
}

/// Rebuilds a Messages JSON body.
pub(super) fn json(value: &Value<'_>, r: &mut Rebuilt) {
    if get_str(value, "type") == Some("error") || value.get("content").is_none() {
        match error_member(value) {
            Some(err) => r.stream_error = Some(error_message(err)),
            None => r
                .warnings
                .push("response body: not a Messages object".into()),
        }
        return;
    }
    get_str(value, "model")
        .unwrap_or_default()
        .clone_into(&mut r.response_model);
    let mut blocks = BTreeMap::new();
    match value.get("content").and_then(Value::as_array) {
        Some(content) => {
            for (i, block) in content.iter().enumerate() {
                blocks.insert(i as u64, BlockAcc::from_block(block));
            }
        }
        None => r.warnings.push("response body: no content array".into()),
    }
    let stop = get_str(value, "stop_reason").unwrap_or_default().to_owned();
    r.completions = vec![anthropic_completion(blocks, stop)];
    let mut usage = AnthropicUsage::default();
    if let Some(u) = value.get("usage") {
        usage.apply(u);
    }
    r.usage = usage.into_usage();
}

/// Rebuilds a Messages event stream.
pub(super) fn stream(events: impl Iterator<Item = SseEvent>, r: &mut Rebuilt) {
    let mut blocks: BTreeMap<u64, BlockAcc> = BTreeMap::new();
    let mut started = false;
    let mut done = false;
    let mut stop_reason = String::new();
    let mut usage = AnthropicUsage::default();
    let mut error: Option<String> = None;
    for (n, ev) in events.enumerate() {
        if ev.data.trim().is_empty() {
            continue;
        }
        let Some(data) = event_json(n, &ev, &mut r.warnings) else {
            if ev.event.as_deref() == Some("error") {
                error = Some(ev.data.trim().to_owned());
            }
            continue;
        };
        let kind = get_str(&data, "type")
            .or(ev.event.as_deref())
            .unwrap_or_default();
        let index = data.get("index").and_then(Value::as_u64);
        match kind {
            "message_start" => {
                started = true;
                if let Some(msg) = data.get("message") {
                    set_first(&mut r.response_model, get_str(msg, "model"));
                    if let Some(u) = msg.get("usage") {
                        usage.apply(u);
                    }
                }
            }
            "content_block_start" => {
                let block = data.get("content_block").unwrap_or(&Value::Null);
                let index = index.unwrap_or(blocks.len() as u64);
                blocks.insert(index, BlockAcc::from_block(block));
            }
            "content_block_delta" => {
                let Some(delta) = data.get("delta") else {
                    continue;
                };
                let index = index
                    .or_else(|| blocks.keys().next_back().copied())
                    .unwrap_or(0);
                let (kind, field, target) = match get_str(delta, "type").unwrap_or_default() {
                    "text_delta" => ("text", "text", 0),
                    "input_json_delta" => ("tool_use", "partial_json", 1),
                    "thinking_delta" => ("thinking", "thinking", 2),
                    _ => continue, // signature_delta, citations_delta, ...
                };
                let block = blocks.entry(index).or_insert_with(|| BlockAcc {
                    kind: kind.to_owned(),
                    ..BlockAcc::default()
                });
                let piece = get_str(delta, field).unwrap_or_default();
                match target {
                    0 => block.text.push_str(piece),
                    1 => block.partial_json.push_str(piece),
                    _ => block.thinking.push_str(piece),
                }
            }
            "message_delta" => {
                if let Some(reason) = data
                    .get("delta")
                    .and_then(|d| get_str(d, "stop_reason"))
                    .filter(|s| !s.is_empty())
                {
                    reason.clone_into(&mut stop_reason);
                }
                if let Some(u) = data.get("usage") {
                    usage.apply(u);
                }
            }
            "message_stop" => done = true,
            "error" => {
                error = Some(error_member(&data).map_or_else(|| compact(&data), error_message));
            }
            _ => {} // ping, content_block_stop, unknown events
        }
    }
    if !done {
        r.warnings.push("stream ended without message_stop".into());
    }
    if started || !blocks.is_empty() {
        r.completions = vec![anthropic_completion(blocks, stop_reason)];
    }
    r.usage = usage.into_usage();
    r.stream_error = error;
}

#[cfg(test)]
mod tests {
    use tapline_proto::Api;

    use super::super::rebuild;

    #[test]
    fn streams_cut_anywhere() {
        let anthropic = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude\",\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"f\",\"input\":{}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\":\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"1}\"}}\n\n",
            "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let b = anthropic.as_bytes();
        let complete = anthropic.rfind('}').unwrap() + 1;
        for k in 0..complete {
            let r = rebuild(Api::AnthropicMessages, true, &b[..k]);
            assert!(!r.warnings.is_empty(), "cut at {k}");
        }
        let full = rebuild(Api::AnthropicMessages, true, b);
        assert!(full.warnings.is_empty(), "{:?}", full.warnings);
        assert_eq!(full.completions[0].tool_calls[0].arguments, "{\"a\":1}");
        // Cut after the first fragment: the partial arguments are kept as they are.
        let cut = anthropic.find("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"1}").unwrap();
        let r = rebuild(Api::AnthropicMessages, true, &b[..cut]);
        assert_eq!(r.completions[0].tool_calls[0].arguments, "{\"a\":");
    }

    #[test]
    fn json_error_bodies_become_stream_errors() {
        let r = rebuild(
            Api::AnthropicMessages,
            false,
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        assert_eq!(r.stream_error.as_deref(), Some("Overloaded"));
    }
}
