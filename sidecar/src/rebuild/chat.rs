//! OpenAI chat completions, as JSON or as `data:` chunks ending with `data: [DONE]`,
//! including vLLM's `prompt_token_ids`, `token_ids` and logprobs.
//!
//! Legacy completions have the same body and chunk shape: [`OpenAiState`] parses both,
//! and reads what only completions carry through [`super::completions`].

use std::collections::BTreeMap;

use tapline_proto::Usage;

use super::{
    ChoiceAcc, Rebuilt, arguments_text, completions, error_member, error_message, event_json,
    get_str, openai_usage, set_first, u32_array,
};
use crate::json::Json as Value;
use crate::sse::SseEvent;

/// Chat and legacy completions, chunk by chunk (or a whole response at once).
#[derive(Debug, Default)]
struct OpenAiState {
    choices: BTreeMap<u32, ChoiceAcc>,
    prompt_token_ids: Option<Vec<u32>>,
    model: String,
    usage: Option<Usage>,
    error: Option<String>,
}

impl OpenAiState {
    /// Applies a whole response (`streamed == false`) or one stream chunk.
    fn apply(&mut self, obj: &Value<'_>, streamed: bool, warnings: &mut Vec<String>) {
        if let Some(err) = error_member(obj) {
            self.error = Some(error_message(err));
        }
        set_first(&mut self.model, get_str(obj, "model"));
        if self.prompt_token_ids.is_none()
            && obj.get("prompt_token_ids").is_some_and(Value::is_array)
        {
            self.prompt_token_ids = Some(u32_array(obj.get("prompt_token_ids")));
        }
        if let Some(u) = obj.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(openai_usage(u));
        }
        let Some(choices) = obj.get("choices").and_then(Value::as_array) else {
            return;
        };
        for (pos, choice) in choices.iter().enumerate() {
            let index = match choice.get("index").and_then(Value::as_u64) {
                Some(i) => u32::try_from(i).ok(),
                None => u32::try_from(pos).ok(),
            };
            let Some(index) = index else {
                warnings.push("choice index out of range; skipped".into());
                continue;
            };
            if self.prompt_token_ids.is_none() {
                self.prompt_token_ids = completions::choice_prompt_token_ids(choice);
            }
            let acc = self.choices.entry(index).or_default();
            apply_choice(acc, choice, streamed);
        }
    }

    fn finish(self, r: &mut Rebuilt) {
        r.completions = self
            .choices
            .into_iter()
            .map(|(index, acc)| acc.into_completion(index))
            .collect();
        r.usage = self.usage;
        r.response_model = self.model;
        r.prompt_token_ids = self.prompt_token_ids.unwrap_or_default();
        if self.error.is_some() {
            r.stream_error = self.error;
        }
    }
}

/// Rebuilds a chat (or legacy) completions JSON body.
pub(super) fn json(value: &Value<'_>, r: &mut Rebuilt) {
    let mut st = OpenAiState::default();
    st.apply(value, false, &mut r.warnings);
    if !value.get("choices").is_some_and(Value::is_array) && st.error.is_none() {
        r.warnings.push("response body: no choices array".into());
    }
    st.finish(r);
}

/// Adds one choice of a response or chunk to its accumulator.
fn apply_choice(acc: &mut ChoiceAcc, choice: &Value<'_>, streamed: bool) {
    if let Some(text) = completions::choice_text(choice) {
        acc.text.push_str(text);
    }
    let msg = choice
        .get("message")
        .filter(|m| m.is_object())
        .or_else(|| choice.get("delta").filter(|m| m.is_object()));
    if let Some(msg) = msg {
        if let Some(content) = msg.get("content") {
            acc.text.push_str(&content_text(content));
        }
        let reasoning = get_str(msg, "reasoning_content").or_else(|| get_str(msg, "reasoning"));
        if let Some(reasoning) = reasoning {
            acc.reasoning.push_str(reasoning);
        }
        if let Some(calls) = msg.get("tool_calls").and_then(Value::as_array) {
            for (pos, call) in calls.iter().enumerate() {
                let key = tool_key(acc, call, pos, streamed);
                let tool = acc.tools.entry(key).or_default();
                set_first(&mut tool.id, get_str(call, "id").filter(|s| !s.is_empty()));
                set_first(
                    &mut tool.kind,
                    get_str(call, "type").filter(|s| !s.is_empty()),
                );
                if let Some(function) = call.get("function") {
                    set_first(
                        &mut tool.name,
                        get_str(function, "name").filter(|s| !s.is_empty()),
                    );
                    if let Some(args) = function.get("arguments") {
                        tool.arguments.push_str(&arguments_text(args));
                    }
                }
            }
        }
    }
    if let Some(reason) = get_str(choice, "finish_reason").filter(|s| !s.is_empty()) {
        reason.clone_into(&mut acc.finish_reason);
    }
    acc.token_ids.extend(u32_array(choice.get("token_ids")));
    if let Some(logprobs) = choice.get("logprobs").filter(|l| l.is_object()) {
        push_logprobs(&mut acc.logprobs, logprobs);
    }
}

/// Which tool call a fragment belongs to: its `index` in streams, its position in whole
/// messages; a streamed fragment without `index` starts a new call when it brings a new id.
fn tool_key(acc: &ChoiceAcc, call: &Value<'_>, pos: usize, streamed: bool) -> u64 {
    if !streamed {
        return pos as u64;
    }
    if let Some(i) = call.get("index").and_then(Value::as_u64) {
        return i;
    }
    let last = acc.tools.keys().next_back().copied();
    match get_str(call, "id").filter(|s| !s.is_empty()) {
        Some(id) => match acc.tools.iter().find(|(_, t)| t.id == id) {
            Some((k, _)) => *k,
            None => last.map_or(0, |k| k.saturating_add(1)),
        },
        None => last.unwrap_or(0),
    }
}

/// Rebuilds a chat (or legacy) completions event stream.
pub(super) fn stream(events: impl Iterator<Item = SseEvent>, r: &mut Rebuilt) {
    let mut st = OpenAiState::default();
    let mut done = false;
    for (n, ev) in events.enumerate() {
        let data = ev.data.trim();
        if data == "[DONE]" {
            done = true;
            continue;
        }
        if data.is_empty() {
            continue;
        }
        let is_error_event = ev.event.as_deref() == Some("error");
        match event_json(n, &ev, &mut r.warnings) {
            Some(chunk) => {
                if is_error_event && error_member(&chunk).is_none() {
                    st.error = Some(error_message(&chunk));
                }
                st.apply(&chunk, true, &mut r.warnings);
            }
            None if is_error_event => st.error = Some(data.to_owned()),
            None => {}
        }
    }
    if !done {
        r.warnings.push("stream ended without [DONE]".into());
    }
    st.finish(r);
}

/// Text of a `content` member: a string, null, or an array of parts with `text`.
fn content_text(v: &Value<'_>) -> String {
    match v {
        Value::String(s) => s.to_string(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.as_ref()),
                other => get_str(other, "text"),
            })
            .collect(),
        _ => String::new(),
    }
}

/// Log-probs of the sampled tokens: chat's `content[].logprob`, or legacy
/// `token_logprobs`.
fn push_logprobs(out: &mut Vec<f64>, logprobs: &Value<'_>) {
    if let Some(content) = logprobs.get("content").and_then(Value::as_array) {
        out.extend(
            content
                .iter()
                .filter_map(|t| t.get("logprob").and_then(Value::as_f64)),
        );
    } else {
        completions::push_token_logprobs(out, logprobs);
    }
}

#[cfg(test)]
mod tests {
    use tapline_proto::Api;

    use super::super::rebuild;
    use super::super::tests::chat_sse;

    #[test]
    fn chat_stream_with_reasoning_field() {
        let r = rebuild(Api::ChatCompletions, true, chat_sse().as_bytes());
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_eq!(r.completions.len(), 1);
        assert_eq!(r.completions[0].text, "Hello");
        assert_eq!(r.completions[0].reasoning, "think more");
        assert_eq!(r.completions[0].finish_reason, "stop");
        assert_eq!(r.response_model, "m");
    }

    #[test]
    fn truncated_stream_at_every_length_never_panics() {
        let body = chat_sse().as_bytes();
        // From here on the `[DONE]` line is complete (its blank line is optional).
        let complete = chat_sse().find("data: [DONE]").unwrap() + "data: [DONE]".len();
        for k in 0..complete {
            let r = rebuild(Api::ChatCompletions, true, &body[..k]);
            assert!(
                r.warnings.iter().any(|w| w.contains("[DONE]")),
                "cut at {k}: {:?}",
                r.warnings
            );
        }
        // Cut inside the last content chunk: the text before it survives.
        let cut = body.len() - "lo\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n".len();
        let r = rebuild(Api::ChatCompletions, true, &body[..cut]);
        assert_eq!(r.completions[0].text, "Hel");
        assert!(r.warnings.iter().any(|w| w.contains("invalid JSON")));
    }

    #[test]
    fn invalid_chunk_is_skipped_and_others_kept() {
        let body = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\ndata: {oops\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"}}]}\n\ndata: [DONE]\n\n";
        let r = rebuild(Api::ChatCompletions, true, body);
        assert_eq!(r.completions[0].text, "ab");
        assert_eq!(r.warnings.len(), 1);
        assert!(
            r.warnings[0].contains("event 1: invalid JSON"),
            "{:?}",
            r.warnings
        );
    }

    #[test]
    fn chat_json_content_parts_and_object_arguments() {
        let body = br#"{"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"reasoning_content":"r","tool_calls":[{"id":"call_1","function":{"name":"f","arguments":{"x":1,"a":[true]}}}]},"finish_reason":"tool_calls"}]}"#;
        let r = rebuild(Api::ChatCompletions, false, body);
        assert!(r.warnings.is_empty());
        let c = &r.completions[0];
        assert_eq!(c.text, "ab");
        assert_eq!(c.reasoning, "r");
        assert_eq!(c.tool_calls[0].r#type, "function");
        assert_eq!(c.tool_calls[0].arguments, r#"{"x":1,"a":[true]}"#);
        assert_eq!(r.usage, None);
    }

    #[test]
    fn streamed_tool_calls_without_index_split_by_id() {
        let body = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"id\":\"a\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"id\":\"b\",\"function\":{\"name\":\"g\",\"arguments\":\"{\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"function\":{\"arguments\":\"}\"}}]}}]}\n\n",
            "data: [DONE]\n\n",
        );
        let r = rebuild(Api::ChatCompletions, true, body.as_bytes());
        let calls = &r.completions[0].tool_calls;
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("f", "{}")
        );
        assert_eq!(
            (calls[1].name.as_str(), calls[1].arguments.as_str()),
            ("g", "{}")
        );
    }

    #[test]
    fn json_error_bodies_become_stream_errors() {
        let r = rebuild(
            Api::ChatCompletions,
            false,
            br#"{"error":{"message":"boom","type":"server_error"}}"#,
        );
        assert_eq!(r.stream_error.as_deref(), Some("boom"));
    }
}
