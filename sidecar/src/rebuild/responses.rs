//! OpenAI Responses, as JSON or as named events. In a stream the terminal
//! `response.completed` / `.incomplete` / `.failed` event is the truth; the deltas are
//! the fallback when the stream ends without one.

use std::collections::{BTreeMap, HashMap};

use super::{
    ChoiceAcc, Rebuilt, ToolAcc, arguments_text, compact, error_member, error_message, event_json,
    get_str, openai_usage, set_first,
};
use crate::json::Json as Value;
use crate::sse::SseEvent;

/// Adds one `output[]` item of a Responses object to `acc`.
fn apply_output_item(acc: &mut ChoiceAcc, item: &Value<'_>) {
    let parts = |key: &str| {
        item.get(key)
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
    };
    match get_str(item, "type").unwrap_or_default() {
        "message" => {
            for part in parts("content") {
                if get_str(part, "type") == Some("output_text") {
                    acc.text.push_str(get_str(part, "text").unwrap_or_default());
                    if let Some(lps) = part.get("logprobs").and_then(Value::as_array) {
                        acc.logprobs.extend(
                            lps.iter()
                                .filter_map(|t| t.get("logprob").and_then(Value::as_f64)),
                        );
                    }
                }
            }
        }
        "reasoning" => {
            for part in parts("summary").iter().chain(parts("content")) {
                acc.reasoning
                    .push_str(get_str(part, "text").unwrap_or_default());
            }
        }
        kind @ ("function_call" | "custom_tool_call") => {
            let (tool_kind, args_key) = if kind == "function_call" {
                ("function", "arguments")
            } else {
                ("custom", "input")
            };
            let key = acc.tools.len() as u64;
            acc.tools.insert(
                key,
                ToolAcc {
                    id: get_str(item, "call_id").unwrap_or_default().to_owned(),
                    kind: tool_kind.to_owned(),
                    name: get_str(item, "name").unwrap_or_default().to_owned(),
                    arguments: item.get(args_key).map(arguments_text).unwrap_or_default(),
                },
            );
        }
        _ => {}
    }
}

/// Parses a whole Responses object (the JSON body or a terminal event's `response`).
fn apply_response_object(resp: &Value<'_>, r: &mut Rebuilt) {
    if let Some(model) = get_str(resp, "model").filter(|m| !m.is_empty()) {
        model.clone_into(&mut r.response_model);
    }
    let mut acc = ChoiceAcc::default();
    match resp.get("output").and_then(Value::as_array) {
        Some(items) => items
            .iter()
            .for_each(|item| apply_output_item(&mut acc, item)),
        None => r.warnings.push("response: no output array".into()),
    }
    let status = get_str(resp, "status").unwrap_or_default();
    acc.finish_reason = if status == "incomplete" {
        resp.get("incomplete_details")
            .and_then(|d| get_str(d, "reason"))
            .filter(|s| !s.is_empty())
            .unwrap_or(status)
            .to_owned()
    } else {
        status.to_owned()
    };
    if let Some(u) = resp.get("usage").filter(|u| u.is_object()) {
        r.usage = Some(openai_usage(u));
    }
    if let Some(err) = error_member(resp) {
        r.stream_error = Some(error_message(err));
    } else if status == "failed" {
        r.stream_error = Some("response failed".into());
    }
    r.completions = vec![acc.into_completion(0)];
}

/// Rebuilds a Responses JSON body.
pub(super) fn json(value: &Value<'_>, r: &mut Rebuilt) {
    let is_response = value.get("output").is_some() || get_str(value, "object") == Some("response");
    if is_response {
        apply_response_object(value, r);
    } else if let Some(err) = error_member(value) {
        r.stream_error = Some(error_message(err));
    } else {
        r.warnings
            .push("response body: not a Responses object".into());
    }
}

/// An output item as seen through stream deltas.
#[derive(Debug, Default)]
struct ItemAcc<'a> {
    kind: String,
    text: String,
    reasoning: String,
    logprobs: Vec<f64>,
    call_id: String,
    name: String,
    arguments: String,
    arguments_done: Option<String>,
    done: Option<Value<'a>>,
}

/// Rebuilds a Responses event stream.
pub(super) fn stream(events: impl Iterator<Item = SseEvent>, r: &mut Rebuilt) {
    let mut terminal: Option<Value<'static>> = None;
    let mut model = String::new();
    let mut error: Option<String> = None;
    let mut items: BTreeMap<u64, ItemAcc<'static>> = BTreeMap::new();
    let mut by_item_id: HashMap<String, u64> = HashMap::new();
    let mut any_event = false;
    for (n, ev) in events.enumerate() {
        any_event = true;
        if ev.data.trim().is_empty() || ev.data.trim() == "[DONE]" {
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
        let slot = {
            let index = data
                .get("output_index")
                .and_then(Value::as_u64)
                .or_else(|| get_str(&data, "item_id").and_then(|id| by_item_id.get(id).copied()));
            index.or_else(|| items.keys().next_back().copied())
        };
        let delta = get_str(&data, "delta").unwrap_or_default();
        match kind {
            "response.created" | "response.in_progress" | "response.queued" => {
                if let Some(resp) = data.get("response") {
                    set_first(&mut model, get_str(resp, "model").filter(|m| !m.is_empty()));
                }
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                match data.get("response").filter(|v| v.is_object()) {
                    Some(resp) => terminal = Some(resp.clone().into_owned()),
                    None => r
                        .warnings
                        .push(format!("event {n} ({kind}): no response object")),
                }
                if kind == "response.failed" && error.is_none() {
                    error = Some(
                        data.get("response")
                            .and_then(error_member)
                            .map_or_else(|| "response failed".to_owned(), error_message),
                    );
                }
            }
            "error" => {
                error = Some(match data.get("message").and_then(Value::as_str) {
                    Some(msg) => msg.to_owned(),
                    None => error_member(&data).map_or_else(|| compact(&data), error_message),
                });
            }
            "response.output_item.added" => {
                let Some(item) = data.get("item") else {
                    continue;
                };
                let index = data
                    .get("output_index")
                    .and_then(Value::as_u64)
                    .unwrap_or(items.keys().next_back().map_or(0, |k| k.saturating_add(1)));
                if let Some(id) = get_str(item, "id") {
                    by_item_id.insert(id.to_owned(), index);
                }
                let acc = items.entry(index).or_default();
                set_first(&mut acc.kind, get_str(item, "type"));
                set_first(&mut acc.call_id, get_str(item, "call_id"));
                set_first(&mut acc.name, get_str(item, "name"));
                let args = get_str(item, "arguments").or_else(|| get_str(item, "input"));
                set_first(&mut acc.arguments, args);
            }
            "response.output_item.done" => {
                if let (Some(index), Some(item)) = (slot, data.get("item")) {
                    items.entry(index).or_default().done = Some(item.clone().into_owned());
                }
            }
            "response.output_text.delta" => {
                if let Some(index) = slot {
                    let acc = items.entry(index).or_default();
                    acc.text.push_str(delta);
                    if let Some(lps) = data.get("logprobs").and_then(Value::as_array) {
                        acc.logprobs.extend(
                            lps.iter()
                                .filter_map(|t| t.get("logprob").and_then(Value::as_f64)),
                        );
                    }
                }
            }
            "response.reasoning_summary_text.delta" | "response.reasoning_text.delta" => {
                if let Some(index) = slot {
                    items.entry(index).or_default().reasoning.push_str(delta);
                }
            }
            "response.function_call_arguments.delta" | "response.custom_tool_call_input.delta" => {
                if let Some(index) = slot {
                    items.entry(index).or_default().arguments.push_str(delta);
                }
            }
            "response.function_call_arguments.done" | "response.custom_tool_call_input.done" => {
                let done = get_str(&data, "arguments").or_else(|| get_str(&data, "input"));
                if let (Some(index), Some(args)) = (slot, done) {
                    items.entry(index).or_default().arguments_done = Some(args.to_owned());
                }
            }
            _ => {}
        }
    }
    r.response_model = model;
    match terminal {
        Some(resp) => apply_response_object(&resp, r),
        None => {
            r.warnings
                .push("stream ended without a terminal response event; rebuilt from deltas".into());
            let mut acc = ChoiceAcc::default();
            for item in items.into_values() {
                if let Some(done) = &item.done {
                    apply_output_item(&mut acc, done);
                    continue;
                }
                acc.text.push_str(&item.text);
                acc.reasoning.push_str(&item.reasoning);
                acc.logprobs.extend(item.logprobs);
                let tool_kind = match item.kind.as_str() {
                    "function_call" => "function",
                    "custom_tool_call" => "custom",
                    _ => continue,
                };
                let key = acc.tools.len() as u64;
                acc.tools.insert(
                    key,
                    ToolAcc {
                        id: item.call_id,
                        kind: tool_kind.to_owned(),
                        name: item.name,
                        arguments: item.arguments_done.unwrap_or(item.arguments),
                    },
                );
            }
            if any_event {
                r.completions = vec![acc.into_completion(0)];
            }
        }
    }
    if error.is_some() {
        r.stream_error = error;
    }
}

#[cfg(test)]
mod tests {
    use tapline_proto::Api;

    use super::super::rebuild;

    #[test]
    fn streams_cut_anywhere() {
        let responses = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"model\":\"gpt\",\"output\":[]}}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"output_index\":0,\"delta\":\"Hi\"}\n\n",
        );
        let b = responses.as_bytes();
        for k in 0..b.len() {
            let r = rebuild(Api::Responses, true, &b[..k]);
            assert!(!r.warnings.is_empty(), "cut at {k}");
        }
        let r = rebuild(Api::Responses, true, b);
        assert_eq!(r.completions[0].text, "Hi");
        assert_eq!(r.response_model, "gpt");
    }

    #[test]
    fn json_error_bodies_become_stream_errors() {
        let r = rebuild(
            Api::Responses,
            false,
            br#"{"object":"response","status":"failed","error":{"code":"server_error","message":"bad"},"output":[]}"#,
        );
        assert_eq!(r.stream_error.as_deref(), Some("bad"));
        assert_eq!(r.completions[0].finish_reason, "failed");
    }
}
