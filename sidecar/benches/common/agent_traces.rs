//! Synthetic multi-turn agent traces shared by the benchmarks (`sidecar/benches/spool.rs`,
//! `trainer/benches/export.rs`): each episode is an agent loop — a system prompt with
//! tool schemas, a task, then turns of assistant tool calls and tool results — and every
//! call's request repeats the whole conversation so far, as harnesses do.

#![allow(dead_code)]

use serde_json::json;
use tapline_proto::{Completion, LlmCall, RecordKind, ToolCall};

/// Deterministic pseudo-random text, so runs are comparable.
pub struct Words(pub u64);

impl Words {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn text(&mut self, words: usize) -> String {
        const VOCAB: &[&str] = &[
            "the",
            "file",
            "function",
            "returns",
            "error",
            "test",
            "passed",
            "failed",
            "import",
            "def",
            "class",
            "self",
            "value",
            "None",
            "assert",
            "line",
            "module",
            "src",
            "config",
            "path",
            "list",
            "dict",
            "for",
            "in",
            "if",
            "else",
            "return",
            "print",
            "json",
            "load",
            "open",
            "with",
            "as",
            "try",
            "except",
            "raise",
            "TypeError",
        ];
        let mut out = String::new();
        for i in 0..words {
            if i > 0 {
                out.push(if self.next().is_multiple_of(11) {
                    '\n'
                } else {
                    ' '
                });
            }
            out.push_str(VOCAB[(self.next() % VOCAB.len() as u64) as usize]);
            if self.next().is_multiple_of(7) {
                out.push_str(&(self.next() % 1000).to_string());
            }
        }
        out
    }
}

/// The calls of one episode of `turns` turns.
pub fn episode(words: &mut Words, episode: usize, turns: usize) -> Vec<RecordKind> {
    let system = format!("You are a software engineering agent. {}", words.text(250));
    let tools = json!([{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]);
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": words.text(120)}),
    ];
    let mut calls = Vec::new();
    for turn in 0..turns {
        let request = json!({"model": "qwen3-8b", "messages": messages, "tools": tools, "temperature": 1.0, "stream": true});
        let thought = words.text(40);
        let cmd = format!("grep -rn {} src/ | head -{}", words.text(1), turn + 5);
        let response: String = (0..40)
            .map(|i| format!("data: {{\"id\":\"chatcmpl-{episode}-{turn}\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"qwen3-8b\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}},\"finish_reason\":null}}]}}\n\n", words.text(1 + i % 2)))
            .collect::<String>()
            + "data: [DONE]\n\n";
        calls.push(RecordKind::LlmCall(LlmCall {
            span_id: format!("0193-{episode:06}-{turn:04}-{}", words.next() % 100_000),
            episode_id: format!("ep-{episode:06}"),
            task_id: format!("task-{}", episode / 8),
            seq: turn as u32,
            request_body: serde_json::to_vec(&request).unwrap_or_default().into(),
            response_body: response.into_bytes().into(),
            streamed: true,
            completions: vec![Completion {
                text: thought.clone(),
                tool_calls: vec![ToolCall {
                    id: format!("call_{turn}"),
                    r#type: "function".into(),
                    name: "bash".into(),
                    arguments: json!({"cmd": cmd}).to_string(),
                }],
                finish_reason: "tool_calls".into(),
                token_ids: (0..120).map(|_| (words.next() % 150_000) as u32).collect(),
                logprobs: (0..120)
                    .map(|_| -((words.next() % 1000) as f64) / 300.0)
                    .collect(),
                ..Default::default()
            }],
            ..Default::default()
        }));
        messages.push(json!({"role": "assistant", "content": thought, "tool_calls": [{"id": format!("call_{turn}"), "type": "function", "function": {"name": "bash", "arguments": json!({"cmd": cmd}).to_string()}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("call_{turn}"), "content": words.text(300)}));
    }
    calls
}
