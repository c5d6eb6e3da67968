//! `tapline-sidecar dump --episode ID --format pretty`: one episode as a conversation,
//! for a person reading it in a terminal.
//!
//! The episode's start (task, group, metadata), then its calls in order — each with its
//! model, policy version, status, timings and token counts, the messages the harness
//! sent that the previous call had not (an agent's prompt grows every turn, so only what
//! is new is shown), and the answer: text, reasoning, tool calls, finish reason — its
//! rewards where they came, and its end. Long texts are cut at [`MAX_TEXT`] characters
//! with the number left out; `dump --episode ID` (JSON) has everything.

use std::fmt::Write as _;

use serde_json::Value;
use tapline_proto::{
    Api, Completion, EndStatus, EpisodeEvent, EpisodeEventKind, LlmCall, Outcome, Record,
    RecordKind, Reward,
};

/// Characters of one text shown before it is cut.
pub const MAX_TEXT: usize = 2000;

/// One thing that happened in the episode, in time order.
enum Item<'a> {
    Event(&'a EpisodeEvent),
    Call(&'a LlmCall),
    Reward(&'a Reward),
}

impl Item<'_> {
    /// (time, rank among things at the same time, call number).
    fn order(&self) -> (i64, u8, u32) {
        match self {
            Item::Event(e) if e.kind == EpisodeEventKind::Start as i32 => (e.time_unix_nanos, 0, 0),
            Item::Call(c) => (c.start_unix_nanos, 1, c.seq),
            Item::Reward(r) => (r.time_unix_nanos, 2, 0),
            Item::Event(e) => (e.time_unix_nanos, 3, 0),
        }
    }
}

/// The episode `episode` of `records` (records of other episodes are ignored) as text.
/// Records that came twice (at-least-once delivery) are shown once.
pub fn render(records: &[Record], episode: &str) -> String {
    let mut seen = std::collections::HashSet::new();
    let mut items: Vec<Item<'_>> = records
        .iter()
        .filter(|r| r.episode_id() == Some(episode) && seen.insert(r.id.as_str()))
        .filter_map(|r| match r.kind.as_ref()? {
            RecordKind::EpisodeEvent(e) => Some(Item::Event(e)),
            RecordKind::LlmCall(c) => Some(Item::Call(c)),
            RecordKind::Reward(r) => Some(Item::Reward(r)),
        })
        .collect();
    items.sort_by_key(Item::order);
    let mut out = String::new();
    let start = items.iter().find_map(|i| match i {
        Item::Event(e) if e.kind == EpisodeEventKind::Start as i32 => Some(*e),
        _ => None,
    });
    let end = items.iter().rev().find_map(|i| match i {
        Item::Event(e) if e.kind == EpisodeEventKind::End as i32 => Some(*e),
        _ => None,
    });
    let calls = items.iter().filter(|i| matches!(i, Item::Call(_))).count();
    let rewards: Vec<&Reward> = items
        .iter()
        .filter_map(|i| match i {
            Item::Reward(r) => Some(*r),
            _ => None,
        })
        .collect();
    let _ = writeln!(out, "episode {episode}");
    if let Some(s) = start {
        let mut line = format!("  task {}", or_dash(&s.task_id));
        if !s.group_id.is_empty() {
            let _ = write!(line, ", group {}", s.group_id);
        }
        if s.bound {
            line.push_str(", bound to its sidecar");
        }
        let _ = writeln!(out, "{line}");
        for (k, v) in &s.metadata {
            let _ = writeln!(out, "  metadata {k} = {}", cut(v, 200));
        }
    } else {
        let _ = writeln!(out, "  (no start event in the store)");
    }
    let status = end.map_or_else(
        || "not ended".to_owned(),
        |e| {
            EndStatus::try_from(e.status).map_or("ended".into(), |s| {
                s.as_str_name()
                    .trim_start_matches("END_STATUS_")
                    .to_lowercase()
            })
        },
    );
    let duration = match (start, end) {
        (Some(s), Some(e)) => format!(" after {}", seconds(e.time_unix_nanos - s.time_unix_nanos)),
        _ => String::new(),
    };
    let total: f64 = rewards.iter().map(|r| r.value).sum();
    let _ = writeln!(
        out,
        "  {status}{duration}; {calls} call(s), {} reward(s){}",
        rewards.len(),
        if rewards.is_empty() {
            String::new()
        } else {
            format!(" summing to {}", number(total))
        }
    );
    if let Some(e) = start.into_iter().chain(end).find(|e| e.incomplete) {
        let _ = writeln!(
            out,
            "  INCOMPLETE: the sidecar dropped {} record(s) of this episode; the trainer skips it",
            e.dropped_records
        );
    }

    let mut shown: Vec<Value> = Vec::new();
    let mut previous_answer: Option<String> = None;
    let mut n = 0;
    for item in &items {
        match item {
            Item::Event(e) => {
                let what = if e.kind == EpisodeEventKind::Start as i32 {
                    "start"
                } else {
                    "end"
                };
                let _ = writeln!(out, "\n{}  {what}", clock(e.time_unix_nanos));
            }
            Item::Reward(r) => {
                let name = if r.name.is_empty() { "reward" } else { &r.name };
                let of = if r.span_id.is_empty() {
                    String::new()
                } else {
                    format!(" (for call {})", r.span_id)
                };
                let _ = writeln!(
                    out,
                    "\n{}  reward {name} = {}{of}",
                    clock(r.time_unix_nanos),
                    number(r.value)
                );
            }
            Item::Call(c) => {
                n += 1;
                call(&mut out, n, c, &mut shown, &mut previous_answer);
            }
        }
    }
    out
}

fn call(
    out: &mut String,
    n: usize,
    c: &LlmCall,
    shown: &mut Vec<Value>,
    previous_answer: &mut Option<String>,
) {
    let api = Api::try_from(c.api).map_or("?".to_owned(), |a| {
        a.as_str_name().trim_start_matches("API_").to_lowercase()
    });
    let outcome = Outcome::try_from(c.outcome).map_or("?".to_owned(), |o| {
        o.as_str_name()
            .trim_start_matches("OUTCOME_")
            .to_lowercase()
    });
    let model = match (c.request_model.as_str(), c.response_model.as_str()) {
        (req, res) if res.is_empty() || res == req => or_dash(req).to_owned(),
        (req, res) => format!("{} -> {res}", or_dash(req)),
    };
    let _ = writeln!(
        out,
        "\n{}  call {n}  {} {} ({api}{})  model {model}{}",
        clock(c.start_unix_nanos),
        c.method,
        c.path,
        if c.streamed { ", streamed" } else { "" },
        if c.policy_version.is_empty() {
            String::new()
        } else {
            format!(", policy {}", c.policy_version)
        }
    );
    let mut timing = format!(
        "  {} {outcome}, {}",
        c.http_status,
        seconds(c.end_unix_nanos - c.start_unix_nanos)
    );
    if c.first_byte_unix_nanos > 0 {
        let _ = write!(
            timing,
            " (first byte {})",
            seconds(c.first_byte_unix_nanos - c.start_unix_nanos)
        );
    }
    if let Some(u) = &c.usage {
        let _ = write!(
            timing,
            ", tokens {} prompt + {} completion",
            u.prompt_tokens, u.completion_tokens
        );
        if u.cached_prompt_tokens > 0 {
            let _ = write!(timing, " ({} prompt cached)", u.cached_prompt_tokens);
        }
    }
    if !c.prompt_token_ids.is_empty() {
        let _ = write!(timing, ", {} prompt ids recorded", c.prompt_token_ids.len());
    }
    let _ = writeln!(out, "{timing}");
    if !c.error.is_empty() {
        let _ = writeln!(out, "  error: {}", c.error);
    }
    for w in &c.capture_warnings {
        let _ = writeln!(out, "  capture warning: {w}");
    }
    if c.request_truncated {
        let _ = writeln!(
            out,
            "  (request recorded in part: {} bytes)",
            c.request_body_size
        );
    }

    let messages = request_messages(&c.request_body);
    let earlier = if messages.len() >= shown.len() && messages[..shown.len()] == shown[..] {
        shown.len()
    } else {
        0
    };
    if earlier > 0 {
        let _ = writeln!(out, "  ({earlier} earlier message(s))");
    }
    for (i, m) in messages.iter().enumerate().skip(earlier) {
        let text = message_text(m);
        let role = m.get("role").and_then(Value::as_str).unwrap_or("?");
        // The previous call's answer, sent back by the harness: shown with that call.
        if i == earlier
            && earlier > 0
            && role == "assistant"
            && previous_answer.as_deref() == Some(text.as_str())
        {
            continue;
        }
        let _ = writeln!(out, "  [{role}] {}", indent(&cut(&text, MAX_TEXT)));
    }
    *shown = messages;

    if c.completions.is_empty() && c.response_body_size > 0 {
        let _ = writeln!(
            out,
            "  -> (response of {} bytes, not parsed)",
            c.response_body_size
        );
    }
    for comp in &c.completions {
        completion(out, comp, c.completions.len() > 1);
    }
    *previous_answer = c
        .completions
        .first()
        .map(|comp| comp.text.clone())
        .filter(|t| !t.is_empty());
}

fn completion(out: &mut String, c: &Completion, numbered: bool) {
    let label = if numbered {
        format!("-> [{}] ", c.index)
    } else {
        "-> ".to_owned()
    };
    if !c.reasoning.is_empty() {
        let _ = writeln!(
            out,
            "  {label}(reasoning) {}",
            indent(&cut(&c.reasoning, MAX_TEXT))
        );
    }
    if !c.text.is_empty() {
        let _ = writeln!(
            out,
            "  {label}[assistant] {}",
            indent(&cut(&c.text, MAX_TEXT))
        );
    }
    for t in &c.tool_calls {
        let _ = writeln!(
            out,
            "  {label}tool call {}({}){}",
            t.name,
            cut(&t.arguments, 500),
            if t.id.is_empty() {
                String::new()
            } else {
                format!("  id {}", t.id)
            }
        );
    }
    let mut end = format!(
        "     finish: {}",
        if c.finish_reason.is_empty() {
            "?"
        } else {
            &c.finish_reason
        }
    );
    if !c.token_ids.is_empty() {
        let _ = write!(end, ", {} token ids", c.token_ids.len());
    }
    if !c.logprobs.is_empty() {
        let _ = write!(end, ", {} log-probs", c.logprobs.len());
    }
    let _ = writeln!(out, "{end}");
}

/// The messages of a request body, in the order sent: `system` (Anthropic) first, then
/// `messages` (chat completions, Anthropic), or `input` (Responses), or `prompt`
/// (completions), each as `{"role", "content", ...}`.
fn request_messages(body: &[u8]) -> Vec<Value> {
    let Ok(body) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    let mut messages = Vec::new();
    if let Some(system) = body.get("system").filter(|s| !s.is_null()) {
        messages.push(serde_json::json!({ "role": "system", "content": system }));
    }
    if let Some(Value::Array(list)) = body.get("messages") {
        messages.extend(list.iter().cloned());
    } else if let Some(input) = body.get("input") {
        if let Some(instructions) = body.get("instructions").filter(|s| !s.is_null()) {
            messages.push(serde_json::json!({ "role": "system", "content": instructions }));
        }
        match input {
            Value::Array(items) => messages.extend(items.iter().map(|item| {
                if item.get("role").is_some() {
                    item.clone()
                } else {
                    serde_json::json!({ "role": item.get("type").cloned().unwrap_or(Value::Null), "content": item })
                }
            })),
            other => messages.push(serde_json::json!({ "role": "user", "content": other })),
        }
    } else if let Some(prompt) = body.get("prompt") {
        messages.push(serde_json::json!({ "role": "prompt", "content": prompt }));
    }
    messages
}

/// The readable text of one message: its content (text parts joined, other parts named),
/// its tool calls and the tool call it answers.
fn message_text(m: &Value) -> String {
    let mut parts: Vec<String> = Vec::new();
    if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
        parts.push(format!("(answer to tool call {id})"));
    }
    match m.get("content") {
        Some(Value::String(s)) => parts.push(s.clone()),
        Some(Value::Array(blocks)) => parts.extend(blocks.iter().map(block_text)),
        Some(Value::Null) | None => {}
        Some(other) => parts.push(block_text(other)),
    }
    if let Some(Value::Array(calls)) = m.get("tool_calls") {
        for call in calls {
            let f = call.get("function").unwrap_or(call);
            parts.push(format!(
                "tool call {}({})",
                f.get("name").and_then(Value::as_str).unwrap_or("?"),
                cut(
                    &f.get("arguments").map_or(String::new(), |a| match a {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    }),
                    500
                )
            ));
        }
    }
    parts.join("\n")
}

fn block_text(block: &Value) -> String {
    if let Some(s) = block.as_str() {
        return s.to_owned();
    }
    let kind = block.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "text" | "input_text" | "output_text" => block
            .get("text")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
        "tool_use" | "function_call" => format!(
            "tool call {}({})",
            block.get("name").and_then(Value::as_str).unwrap_or("?"),
            cut(
                &block
                    .get("input")
                    .or(block.get("arguments"))
                    .map_or(String::new(), |a| match a {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    }),
                500
            )
        ),
        "tool_result" | "function_call_output" => {
            let inner = block.get("content").or(block.get("output"));
            let text = match inner {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(b)) => b.iter().map(block_text).collect::<Vec<_>>().join("\n"),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            let id = block
                .get("tool_use_id")
                .or(block.get("call_id"))
                .and_then(Value::as_str)
                .unwrap_or("?");
            format!("(answer to tool call {id}) {text}")
        }
        "" => block.to_string(),
        other => format!("[{other}]"),
    }
}

/// `text` cut at `max` characters, with how many were left out.
fn cut(text: &str, max: usize) -> String {
    let count = text.chars().count();
    if count <= max {
        return text.to_owned();
    }
    let kept: String = text.chars().take(max).collect();
    format!("{kept}... ({} more characters)", count - max)
}

/// Continuation lines of a multi-line text, indented under its first.
fn indent(text: &str) -> String {
    text.replace('\n', "\n      ")
}

fn clock(unix_nanos: i64) -> String {
    chrono::DateTime::from_timestamp_nanos(unix_nanos)
        .format("%Y-%m-%d %H:%M:%S%.3fZ")
        .to_string()
}

fn seconds(nanos: i64) -> String {
    let s = nanos as f64 / 1e9;
    if s < 1.0 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

fn number(v: f64) -> String {
    let text = format!("{v:.4}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text.is_empty() || text == "-" {
        "0".into()
    } else {
        text.into()
    }
}

fn or_dash(s: &str) -> &str {
    if s.is_empty() { "-" } else { s }
}
