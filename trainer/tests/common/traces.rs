//! Synthetic agent traces as a sidecar would record them, written into a store as real
//! segments. Shared by the integration tests and the benchmark.

#![allow(dead_code)]

use object_store::PutPayload;
use object_store::path::Path;
use serde_json::{Value, json};
use tapline_proto::keys::SegmentKey;
use tapline_proto::segment::encode_segment;
use tapline_proto::store::StoreLocation;
use tapline_proto::{
    Api, Completion, EndStatus, EpisodeEvent, EpisodeEventKind, LlmCall, Outcome, Record,
    RecordKind, Reward, ToolCall,
};

/// Builds records with increasing sequence numbers and times.
#[derive(Debug)]
pub struct Trace {
    pub sidecar: String,
    pub seq: u64,
    pub time: i64,
    pub records: Vec<Record>,
}

/// One generated turn of the model.
#[derive(Debug, Clone, Default)]
pub struct Turn {
    pub reasoning: String,
    pub content: String,
    /// (name, arguments JSON text exactly as generated).
    pub tool_calls: Vec<(String, String)>,
    pub finish_reason: String,
}

impl Turn {
    /// The text Qwen3 generates for this turn (what its token ids decode to).
    pub fn qwen3_generated_text(&self) -> String {
        let mut t = String::new();
        if !self.reasoning.is_empty() {
            t.push_str(&format!("<think>\n{}\n</think>\n\n", self.reasoning));
        }
        t.push_str(&self.content);
        for (i, (name, args)) in self.tool_calls.iter().enumerate() {
            if i > 0 || !self.content.is_empty() {
                t.push('\n');
            }
            t.push_str(&format!(
                "<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>"
            ));
        }
        if self.finish_reason != "length" {
            t.push_str("<|im_end|>");
        }
        t
    }

    /// The assistant message a harness appends to its history for this turn.
    pub fn history_message(&self, keep_reasoning: bool) -> Value {
        let mut m = json!({"role": "assistant", "content": self.content});
        if keep_reasoning && !self.reasoning.is_empty() {
            m["reasoning_content"] = json!(self.reasoning);
        }
        if !self.tool_calls.is_empty() {
            m["tool_calls"] = self
                .tool_calls
                .iter()
                .enumerate()
                .map(|(i, (name, args))| {
                    json!({"id": format!("call_{i}"), "type": "function",
                           "function": {"name": name, "arguments": args}})
                })
                .collect();
        }
        m
    }

    pub fn completion(&self, token_ids: Vec<u32>, logprobs: Vec<f64>) -> Completion {
        Completion {
            index: 0,
            text: self.content.clone(),
            reasoning: self.reasoning.clone(),
            tool_calls: self
                .tool_calls
                .iter()
                .enumerate()
                .map(|(i, (name, args))| ToolCall {
                    id: format!("call_{i}"),
                    r#type: "function".into(),
                    name: name.clone(),
                    arguments: args.clone(),
                })
                .collect(),
            finish_reason: if self.finish_reason.is_empty() {
                if self.tool_calls.is_empty() {
                    "stop"
                } else {
                    "tool_calls"
                }
                .into()
            } else {
                self.finish_reason.clone()
            },
            token_ids,
            logprobs,
        }
    }
}

impl Trace {
    pub fn new(sidecar: &str, start_unix_nanos: i64) -> Self {
        Trace {
            sidecar: sidecar.into(),
            seq: 0,
            time: start_unix_nanos,
            records: Vec::new(),
        }
    }

    fn push(&mut self, kind: RecordKind) {
        self.seq += 1;
        self.time += 1_000_000;
        self.records
            .push(Record::new(&self.sidecar, self.seq, self.time, kind));
    }

    pub fn start(&mut self, episode: &str, task: &str, group: &str) {
        let time = self.time;
        self.push(RecordKind::EpisodeEvent(EpisodeEvent {
            event_id: format!("{episode}-start"),
            episode_id: episode.into(),
            kind: EpisodeEventKind::Start as i32,
            task_id: task.into(),
            group_id: group.into(),
            time_unix_nanos: time,
            ..EpisodeEvent::default()
        }));
    }

    pub fn end(&mut self, episode: &str, task: &str, group: &str, incomplete: bool) {
        let time = self.time;
        self.push(RecordKind::EpisodeEvent(EpisodeEvent {
            event_id: format!("{episode}-end"),
            episode_id: episode.into(),
            kind: EpisodeEventKind::End as i32,
            task_id: task.into(),
            group_id: group.into(),
            status: EndStatus::Succeeded as i32,
            time_unix_nanos: time,
            incomplete,
            dropped_records: u64::from(incomplete),
            ..EpisodeEvent::default()
        }));
    }

    pub fn reward(&mut self, episode: &str, span: &str, name: &str, value: f64) {
        let time = self.time;
        let n = self.seq;
        self.push(RecordKind::Reward(Reward {
            reward_id: format!("{episode}-reward-{n}"),
            episode_id: episode.into(),
            span_id: span.into(),
            name: name.into(),
            value,
            time_unix_nanos: time,
            ..Reward::default()
        }));
    }

    /// Records a chat call; returns its span id.
    #[allow(clippy::too_many_arguments)]
    pub fn chat_call(
        &mut self,
        episode: &str,
        task: &str,
        call_seq: u32,
        request: &Value,
        completion: Completion,
        prompt_token_ids: Vec<u32>,
        outcome: Outcome,
    ) -> String {
        let span = format!("{episode}-call-{call_seq}-{}", self.seq + 1);
        let time = self.time;
        self.push(RecordKind::LlmCall(LlmCall {
            span_id: span.clone(),
            episode_id: episode.into(),
            task_id: task.into(),
            seq: call_seq,
            sidecar_id: self.sidecar.clone(),
            api: Api::ChatCompletions as i32,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            start_unix_nanos: time,
            end_unix_nanos: time + 500_000,
            http_status: if outcome == Outcome::Ok { 200 } else { 500 },
            outcome: outcome as i32,
            request_body: serde_json::to_vec(request).unwrap_or_default().into(),
            request_model: "m".into(),
            completions: vec![completion],
            prompt_token_ids,
            policy_version: "step-0".into(),
            ..LlmCall::default()
        }));
        span
    }

    /// An unattributed call.
    pub fn unattributed_call(&mut self) {
        let span = format!("unattributed-{}", self.seq + 1);
        self.push(RecordKind::LlmCall(LlmCall {
            span_id: span,
            outcome: Outcome::Ok as i32,
            http_status: 200,
            ..LlmCall::default()
        }));
    }

    /// Writes the records as segments of `per_segment` records into the store.
    pub async fn write(&self, store: &StoreLocation, per_segment: usize) -> Vec<Path> {
        let mut keys = Vec::new();
        for chunk in self.records.chunks(per_segment.max(1)) {
            let key = SegmentKey::new(
                &self.sidecar,
                chunk[0].sidecar_seq,
                chunk[0].written_unix_nanos,
            )
            .expect("valid sidecar id")
            .to_path(&store.prefix);
            let (bytes, _) = encode_segment(chunk, 3).expect("encode segment");
            store
                .store
                .put(&key, PutPayload::from(bytes))
                .await
                .expect("put segment");
            keys.push(key);
        }
        keys
    }
}

/// The tools of the synthetic agent.
pub fn agent_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "run_shell", "description": "Runs a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}},
        {"type": "function", "function": {"name": "read_file", "description": "Reads a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    ])
}

/// Turn `k` of a synthetic coding agent.
pub fn agent_turn(k: usize, last: bool) -> Turn {
    if last {
        Turn {
            reasoning: format!("All {k} steps are done; summarize."),
            content: format!("Finished after {k} steps. The tests pass."),
            ..Turn::default()
        }
    } else {
        Turn {
            reasoning: format!("Step {k}: I should inspect the repository, file number {k}."),
            content: format!("Looking at part {k}."),
            tool_calls: vec![(
                if k.is_multiple_of(2) {
                    "run_shell"
                } else {
                    "read_file"
                }
                .into(),
                if k.is_multiple_of(2) {
                    format!("{{\"cmd\": \"grep -rn todo src/mod{k}.rs | head -20\"}}")
                } else {
                    format!("{{\"path\": \"src/mod{k}.rs\"}}")
                },
            )],
            ..Turn::default()
        }
    }
}

/// The tool result the harness appends after turn `k`.
pub fn tool_result(k: usize) -> Value {
    let body: String = (0..8)
        .map(|i| {
            format!(
                "src/mod{k}.rs:{}: // todo: handle case {i} of part {k}\n",
                10 + i
            )
        })
        .collect();
    json!({"role": "tool", "tool_call_id": "call_0", "content": body})
}

/// A plain text answer.
pub fn answer(text: &str) -> Turn {
    Turn {
        content: text.into(),
        ..Turn::default()
    }
}

/// Two tasks × four episodes × two calls (answer, feedback, answer again) from sidecar
/// `sidecar`, episode ids prefixed with `prefix`, starting at `t0`; "5" and "Paris" are
/// rewarded 1, other answers 0.
pub fn two_tasks(sidecar: &str, prefix: &str, t0: i64) -> Trace {
    let mut t = Trace::new(sidecar, t0);
    for (task, question, answers) in [
        ("add", "What is 2 + 3?", ["5", "6", "5", "4"]),
        (
            "capital",
            "Capital of France?",
            ["Paris", "Rome", "Paris", "Lyon"],
        ),
    ] {
        for (i, first) in answers.iter().enumerate() {
            let episode = format!("{prefix}{task}-{i}");
            t.start(&episode, task, "g");
            let mut messages = vec![json!({"role": "user", "content": question})];
            let request = json!({"model": "m", "messages": messages.clone()});
            let turn = answer(first);
            t.chat_call(
                &episode,
                task,
                0,
                &request,
                turn.completion(vec![], vec![]),
                vec![],
                tapline_proto::Outcome::Ok,
            );
            messages.push(turn.history_message(false));
            messages.push(json!({"role": "user", "content": "Are you sure? Answer again."}));
            let request = json!({"model": "m", "messages": messages});
            let second = answer(first);
            t.chat_call(
                &episode,
                task,
                1,
                &request,
                second.completion(vec![], vec![]),
                vec![],
                tapline_proto::Outcome::Ok,
            );
            let correct = matches!(*first, "5" | "Paris");
            t.reward(&episode, "", "", if correct { 1.0 } else { 0.0 });
            t.end(&episode, task, "g", false);
        }
    }
    t
}
