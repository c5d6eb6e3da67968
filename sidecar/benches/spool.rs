//! Storage cost and spool throughput on realistic multi-turn agent traces.
//!
//! Each synthetic episode is an agent loop: a system prompt with tool schemas, a task,
//! then turns of assistant tool calls and tool results; every call's request repeats the
//! whole conversation so far, as harnesses do. Prints bytes stored per call, the
//! compression ratio at several zstd settings, and records per second through
//! spool append + seal + segment build.
//!
//! `cargo bench -p tapline-sidecar --bench spool`

use std::time::Instant;

use serde_json::json;
use tapline_proto::segment::encode_segment;
use tapline_proto::{Completion, LlmCall, Record, RecordKind, ToolCall};
use tapline_sidecar::spool::{Spool, read_sealed};

/// Deterministic pseudo-random text, so runs are comparable.
struct Words(u64);

impl Words {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn text(&mut self, words: usize) -> String {
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

fn episode(words: &mut Words, episode: usize, turns: usize) -> Vec<RecordKind> {
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
            request_body: serde_json::to_vec(&request).unwrap_or_default(),
            response_body: response.into_bytes(),
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

fn main() {
    let episodes = 64;
    let turns = 12;
    let mut words = Words(0x9e37_79b9_7f4a_7c15);
    let kinds: Vec<RecordKind> = (0..episodes)
        .flat_map(|e| episode(&mut words, e, turns))
        .collect();
    let records: Vec<Record> = kinds
        .iter()
        .enumerate()
        .map(|(i, k)| Record::new("bench", i as u64 + 1, 1_700_000_000_000_000_000, k.clone()))
        .collect();
    let raw: usize = records.iter().map(prost::Message::encoded_len).sum();
    let calls = records.len();
    println!(
        "{episodes} episodes x {turns} turns = {calls} calls; raw records {:.1} MiB ({:.1} KiB per call)",
        raw as f64 / 1048576.0,
        raw as f64 / calls as f64 / 1024.0
    );
    println!();
    println!("| segments | zstd | stored bytes per call | ratio | encode MB/s |");
    println!("|---|---|---|---|---|");
    // Segments cut at 8 MiB of records, as the sidecar does by default.
    let mut groups: Vec<&[Record]> = Vec::new();
    let mut start = 0;
    let mut size = 0;
    for (i, r) in records.iter().enumerate() {
        size += prost::Message::encoded_len(r);
        if size >= 8 << 20 {
            groups.push(&records[start..=i]);
            start = i + 1;
            size = 0;
        }
    }
    if start < records.len() {
        groups.push(&records[start..]);
    }
    for level in [1, 3, 9, 19] {
        let started = Instant::now();
        let stored: usize = groups
            .iter()
            .map(|g| encode_segment(g.iter(), level).unwrap().0.len())
            .sum();
        let secs = started.elapsed().as_secs_f64();
        println!(
            "| 8 MiB | level {level} | {:.0} B | {:.1}x | {:.0} |",
            stored as f64 / calls as f64,
            raw as f64 / stored as f64,
            raw as f64 / secs / 1e6
        );
    }
    // One segment per episode (cut at episode end), the worst case for cross-call reuse.
    let started = Instant::now();
    let stored: usize = records
        .chunks(turns)
        .map(|g| encode_segment(g.iter(), 3).unwrap().0.len())
        .sum();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "| 1 per episode | level 3 | {:.0} B | {:.1}x | {:.0} |",
        stored as f64 / calls as f64,
        raw as f64 / stored as f64,
        raw as f64 / secs / 1e6
    );

    // Throughput: spool append (+ fsync at seal) + read back + segment build.
    let dir = tempfile::tempdir().unwrap();
    let (mut spool, _) = Spool::open(dir.path(), u64::MAX, 0).unwrap();
    let started = Instant::now();
    let mut appended = 0u64;
    for kind in &kinds {
        spool
            .append("bench", 1_700_000_000_000_000_000, &mut Some(kind.clone()))
            .unwrap();
        appended += 1;
        if spool.open_bytes() >= 8 << 20 {
            let sealed = spool.seal().unwrap().unwrap();
            let back = read_sealed(&sealed.path).unwrap();
            encode_segment(&back, 3).unwrap();
            spool.ack(sealed.first_seq).unwrap();
        }
    }
    if let Some(sealed) = spool.seal().unwrap() {
        let back = read_sealed(&sealed.path).unwrap();
        encode_segment(&back, 3).unwrap();
        spool.ack(sealed.first_seq).unwrap();
    }
    let secs = started.elapsed().as_secs_f64();
    println!();
    println!(
        "spool append + seal (fsync) + read back + zstd-3 segment: {:.0} records/s, {:.0} MB/s (one core)",
        appended as f64 / secs,
        raw as f64 / secs / 1e6
    );
}
