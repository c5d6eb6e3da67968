//! `tapline-sidecar dump` on a store written by this test.

use std::process::Command;

use tapline_proto::keys::SegmentKey;
use tapline_proto::segment::encode_segment;
use tapline_proto::{LlmCall, Outcome, Record, RecordKind, Reward};

fn write_segment(dir: &std::path::Path, sidecar: &str, first_seq: u64, records: &[Record]) {
    let key = SegmentKey::new(sidecar, first_seq, records[0].written_unix_nanos).unwrap();
    let path = dir.join(key.to_path(&Default::default()).as_ref());
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, encode_segment(records, 3).unwrap().0).unwrap();
}

fn dump(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tapline-sidecar"))
        .arg("dump")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn prints_every_record_as_a_json_line() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_796_204_942_000_000_000;
    let call = Record::new(
        "side-1",
        1,
        t0,
        RecordKind::LlmCall(LlmCall {
            span_id: "span-1".into(),
            episode_id: "ep-1".into(),
            request_body: br#"{"model":"m","messages":[]}"#.to_vec().into(),
            response_body: vec![0x80, 0x81].into(),
            outcome: Outcome::Ok as i32,
            ..Default::default()
        }),
    );
    let reward = Record::new(
        "side-1",
        2,
        t0 + 1,
        RecordKind::Reward(Reward {
            reward_id: "r-1".into(),
            episode_id: "ep-1".into(),
            value: 0.5,
            ..Default::default()
        }),
    );
    write_segment(dir.path(), "side-1", 1, &[call, reward.clone()]);
    write_segment(
        dir.path(),
        "side-2",
        1,
        &[Record {
            sidecar_id: "side-2".into(),
            ..reward
        }],
    );

    let url = format!("file://{}", dir.path().display());
    let out = dump(&["--store", &url]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["kind"], "llm_call");
    assert_eq!(
        lines[0]["llm_call"]["request_body"],
        r#"{"model":"m","messages":[]}"#
    );
    assert_eq!(lines[0]["llm_call"]["response_body_base64"], "gIE=");
    assert_eq!(lines[0]["llm_call"]["outcome"], "ok");
    assert_eq!(lines[1]["reward"]["value"], 0.5);
    assert_eq!(lines[2]["sidecar_id"], "side-2");
    assert!(
        lines[0]["segment"]
            .as_str()
            .unwrap()
            .ends_with("side-1/0000000000000001.tlseg")
    );

    // --prefix narrows to one sidecar's segments.
    let out = dump(&["--store", &url, "--prefix", "2026/12/02/09/side-2"]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), 1);
}

#[test]
fn a_damaged_segment_is_named_and_fails_the_command_but_the_rest_is_printed() {
    let dir = tempfile::tempdir().unwrap();
    let rec = |seq| {
        Record::new(
            "s",
            seq,
            1_796_204_942_000_000_000,
            RecordKind::Reward(Reward {
                reward_id: format!("r{seq}"),
                value: 1.0,
                ..Default::default()
            }),
        )
    };
    write_segment(dir.path(), "s", 1, &[rec(1)]);
    write_segment(dir.path(), "s", 2, &[rec(2)]);
    let key = SegmentKey::new("s", 2, 1_796_204_942_000_000_000).unwrap();
    let path = dir.path().join(key.to_path(&Default::default()).as_ref());
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();

    let out = dump(&["--store", dir.path().to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("0000000000000002.tlseg") && stderr.contains("truncated"),
        "{stderr}"
    );
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), 1);
}

#[test]
fn an_unknown_store_scheme_is_a_clear_error() {
    let out = dump(&["--store", "ftp://x/y"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported scheme"));
}

/// Regression: one record over the reader's 64 MiB limit made `dump` refuse its whole
/// segment, so the small records beside it were not printed either.
#[test]
fn an_oversized_record_is_named_and_its_neighbours_are_printed() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_796_204_942_000_000_000;
    let reward = |seq: u64| {
        Record::new(
            "s",
            seq,
            t0,
            RecordKind::Reward(Reward {
                reward_id: format!("r{seq}"),
                value: 1.0,
                ..Default::default()
            }),
        )
    };
    let huge = Record::new(
        "s",
        2,
        t0,
        RecordKind::LlmCall(LlmCall {
            span_id: "big".into(),
            request_body: vec![b'a'; 65 << 20].into(),
            ..Default::default()
        }),
    );
    write_segment(dir.path(), "s", 1, &[reward(1), huge, reward(3)]);
    let out = dump(&["--store", dir.path().to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a skipped record fails the command");
    assert!(
        stderr.contains("0000000000000001.tlseg") && stderr.contains("record 1 ("),
        "{stderr}"
    );
    let printed: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<&str> = printed
        .iter()
        .map(|v| v["reward"]["reward_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["r1", "r3"]);
}

/// `dump --episode ID --format pretty`: one episode as a conversation, in order, without
/// the records of others or duplicates; `--episode` alone narrows the JSON lines.
#[test]
fn one_episode_reads_as_a_conversation() {
    use tapline_proto::{
        Api, Completion, EndStatus, EpisodeEvent, EpisodeEventKind, ToolCall, Usage,
    };
    let dir = tempfile::tempdir().unwrap();
    let t0: i64 = 1_796_204_942_000_000_000;
    let ms = 1_000_000;
    let event = |seq: u64, t: i64, kind: EpisodeEventKind, status: EndStatus| {
        Record::new(
            "side-1",
            seq,
            t,
            RecordKind::EpisodeEvent(EpisodeEvent {
                event_id: format!("ev-{seq}"),
                episode_id: "ep-A".into(),
                kind: kind as i32,
                task_id: "fix-bug".into(),
                group_id: "g1".into(),
                status: status as i32,
                metadata: [("repo".to_owned(), "tiny".to_owned())].into(),
                time_unix_nanos: t,
                ..Default::default()
            }),
        )
    };
    let call = |seq: u64, episode: &str, t: i64, request: serde_json::Value, answer: Completion| {
        Record::new(
            "side-1",
            seq,
            t,
            RecordKind::LlmCall(LlmCall {
                span_id: format!("span-{seq}"),
                episode_id: episode.into(),
                seq: seq as u32,
                method: "POST".into(),
                path: "/v1/chat/completions".into(),
                api: Api::ChatCompletions as i32,
                start_unix_nanos: t,
                first_byte_unix_nanos: t + 80 * ms,
                end_unix_nanos: t + 450 * ms,
                http_status: 200,
                outcome: Outcome::Ok as i32,
                request_model: "qwen3".into(),
                response_model: "qwen3".into(),
                policy_version: "v3".into(),
                request_body: request.to_string().into_bytes().into(),
                completions: vec![answer],
                usage: Some(Usage {
                    prompt_tokens: 50 + seq,
                    completion_tokens: 10,
                    ..Default::default()
                }),
                ..Default::default()
            }),
        )
    };
    let system = serde_json::json!({"role": "system", "content": "You fix bugs."});
    let user = serde_json::json!({"role": "user", "content": "Fix the failing test."});
    let first = call(
        2,
        "ep-A",
        t0 + 100 * ms,
        serde_json::json!({"model": "qwen3", "messages": [system, user]}),
        Completion {
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                r#type: "function".into(),
                name: "bash".into(),
                arguments: r#"{"cmd":"ls"}"#.into(),
            }],
            finish_reason: "tool_calls".into(),
            ..Default::default()
        },
    );
    let second = call(
        3,
        "ep-A",
        t0 + 900 * ms,
        serde_json::json!({"model": "qwen3", "messages": [
            system, user,
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\":\"ls\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        ]}),
        Completion {
            text: "Done: the bug was in a.py.".into(),
            finish_reason: "stop".into(),
            token_ids: vec![1, 2, 3],
            ..Default::default()
        },
    );
    let other = call(
        5,
        "ep-B",
        t0 + 200 * ms,
        serde_json::json!({"model": "qwen3", "messages": [{"role": "user", "content": "other episode secret"}]}),
        Completion::default(),
    );
    let reward = Record::new(
        "side-1",
        4,
        t0 + 1500 * ms,
        RecordKind::Reward(Reward {
            reward_id: "r-1".into(),
            episode_id: "ep-A".into(),
            name: "tests".into(),
            value: 1.0,
            time_unix_nanos: t0 + 1500 * ms,
            ..Default::default()
        }),
    );
    let start = event(1, t0, EpisodeEventKind::Start, EndStatus::Unspecified);
    let end = event(
        6,
        t0 + 2 * 1000 * ms,
        EpisodeEventKind::End,
        EndStatus::Succeeded,
    );
    // Out of order across segments, the second call delivered twice.
    write_segment(dir.path(), "side-1", 1, &[second.clone(), other, end]);
    write_segment(dir.path(), "side-1", 7, &[start, first, reward, second]);
    let url = format!("file://{}", dir.path().display());

    let out = dump(&["--store", &url, "--episode", "ep-A", "--format", "pretty"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "episode ep-A",
        "  task fix-bug, group g1",
        "  metadata repo = tiny",
        "  succeeded after 2.00 s; 2 call(s), 1 reward(s) summing to 1",
        "call 1  POST /v1/chat/completions (chat_completions)  model qwen3, policy v3",
        "  200 ok, 450 ms (first byte 80 ms), tokens 52 prompt + 10 completion",
        "  [system] You fix bugs.",
        "  [user] Fix the failing test.",
        r#"  -> tool call bash({"cmd":"ls"})  id call_1"#,
        "     finish: tool_calls",
        "  (2 earlier message(s))",
        r#"  [assistant] tool call bash({"cmd":"ls"})"#,
        "  [tool] (answer to tool call call_1)\n      a.py\n      b.py",
        "  -> [assistant] Done: the bug was in a.py.",
        "     finish: stop, 3 token ids",
        "reward tests = 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    let at = |needle: &str| text.find(needle).unwrap_or(usize::MAX);
    assert!(
        at("  start") < at("call 1") && at("call 1") < at("call 2"),
        "{text}"
    );
    assert!(
        at("call 2") < at("reward tests") && at("reward tests") < at("  end"),
        "{text}"
    );
    assert_eq!(text.matches("You fix bugs.").count(), 1, "{text}");
    assert!(
        !text.contains("call 3"),
        "the duplicate is shown once:\n{text}"
    );
    assert!(!text.contains("other episode secret"), "{text}");

    // --episode narrows the JSON lines to that episode's records (the duplicate too).
    let out = dump(&["--store", &url, "--episode", "ep-B"]);
    assert!(out.status.success());
    let lines = String::from_utf8(out.stdout).unwrap();
    assert_eq!(lines.lines().count(), 1, "{lines}");
    assert!(lines.contains("other episode secret"));

    // Clear refusals.
    let out = dump(&["--store", &url, "--format", "pretty"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("add --episode ID"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = dump(&[
        "--store",
        &url,
        "--episode",
        "ep-none",
        "--format",
        "pretty",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no record of episode ep-none"));
}
