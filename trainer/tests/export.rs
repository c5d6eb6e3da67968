//! `tapline-trainer export`: the Parquet files read back by pyarrow and DuckDB (the test
//! venv's, `export_check.py`) hold exactly the records of the store — every row, token
//! id, log-prob and reward — with filters selecting exactly the matching episodes and a
//! damaged segment named and skipped.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use object_store::PutPayload;
use serde_json::{Value, json};
use tapline_proto::keys::SegmentKey;
use tapline_proto::segment::{encode_segment, encode_segment_version};
use tapline_proto::store::{StoreLocation, open_store};
use tapline_proto::{
    EndStatus, EpisodeEvent, EpisodeEventKind, LlmCall, Outcome, Record, RecordKind,
};

use common::cli::trainer;
use common::traces::{Trace, agent_tools, agent_turn, tool_result};

const T0: i64 = 1_796_204_942_000_000_000;

/// Two tasks of 3 and 2 episodes, 3 tool-using calls each with recorded ids and
/// log-probs, a per-call reward, a named and a final reward; one call without an episode.
fn trace() -> Trace {
    let mut t = Trace::new("exp-a", T0);
    for (task, n) in [("add", 3usize), ("capital", 2)] {
        for i in 0..n {
            let episode = format!("{task}-{i}");
            t.start(&episode, task, "g");
            let mut messages = vec![
                json!({"role": "system", "content": "You are a coding agent."}),
                json!({"role": "user", "content": format!("Task {task} #{i}: ünïcode ✓")}),
            ];
            for k in 0..3usize {
                let turn = agent_turn(k, k == 2);
                let request = json!({"model": "m", "messages": messages, "tools": agent_tools()});
                let ids: Vec<u32> = (0..4 + k).map(|j| (i * 1000 + k * 10 + j) as u32).collect();
                let logprobs: Vec<f64> = ids
                    .iter()
                    .map(|&x| -(f64::from(x) + 0.123_456_789_012_345) / 1000.0)
                    .collect();
                let prompt: Vec<u32> = (0..10 + 3 * k).map(|j| (j * 7 + i) as u32).collect();
                let span = t.chat_call(
                    &episode,
                    task,
                    k as u32,
                    &request,
                    turn.completion(ids, logprobs),
                    prompt,
                    Outcome::Ok,
                );
                if k == 1 {
                    t.reward(&episode, &span, "step", 0.5);
                }
                messages.push(turn.history_message(true));
                if !turn.tool_calls.is_empty() {
                    messages.push(tool_result(k));
                }
            }
            t.reward(&episode, "", "tests_passed", 0.25 * i as f64);
            t.reward(&episode, "", "", 0.1);
            // A later final reward replaces the first (the latest counts).
            t.reward(&episode, "", "", i as f64 + 0.5);
            t.end(&episode, task, "g", task == "capital" && i == 1);
        }
    }
    // add-2's end says records were dropped without the flag: incomplete all the same.
    for record in &mut t.records {
        if let Some(RecordKind::EpisodeEvent(e)) = &mut record.kind
            && e.episode_id == "add-2"
            && e.kind() == EpisodeEventKind::End
        {
            e.dropped_records = 2;
        }
    }
    // An earlier end of add-0, read last, flagged incomplete: the kept end is the latest
    // by time, which is clean.
    t.seq += 1;
    t.records.push(Record::new(
        "exp-a",
        t.seq,
        t.time,
        RecordKind::EpisodeEvent(EpisodeEvent {
            event_id: "add-0-end-early".into(),
            episode_id: "add-0".into(),
            kind: EpisodeEventKind::End as i32,
            task_id: "add".into(),
            group_id: "g".into(),
            status: EndStatus::Failed as i32,
            time_unix_nanos: T0,
            incomplete: true,
            dropped_records: 5,
            ..EpisodeEvent::default()
        }),
    ));
    t.unattributed_call();
    t
}

async fn put(location: &StoreLocation, records: &[Record], bytes: Vec<u8>) -> String {
    let key = SegmentKey::new(
        &records[0].sidecar_id,
        records[0].sidecar_seq,
        records[0].written_unix_nanos,
    )
    .unwrap()
    .to_path(&location.prefix);
    location
        .store
        .put(&key, PutPayload::from(bytes))
        .await
        .unwrap();
    key.to_string()
}

/// Writes the trace: segments of 10 records, the first one in format version 1 (as
/// tapline 0.1 wrote it), one record delivered twice (in a second segment of another
/// sidecar); returns the key of a last, damaged segment holding an episode of its own.
async fn write_store(location: &StoreLocation, trace: &Trace) -> String {
    for (i, chunk) in trace.records.chunks(10).enumerate() {
        let version = if i == 0 { 1 } else { 2 };
        let (bytes, _) = encode_segment_version(chunk, 3, version).unwrap();
        put(location, chunk, bytes).await;
    }
    let mut again = trace.records[5].clone();
    again.sidecar_id = "exp-b".into();
    again.sidecar_seq = 1;
    let (bytes, _) = encode_segment([&again], 3).unwrap();
    put(location, &[again], bytes).await;

    let mut lost = Trace::new("exp-c", T0 + 500_000_000_000);
    lost.start("lost-0", "add", "g");
    lost.reward("lost-0", "", "", 1.0);
    lost.end("lost-0", "add", "g", false);
    let (mut bytes, _) = encode_segment(&lost.records, 3).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    put(location, &lost.records, bytes).await
}

/// What the files must hold for the episodes `keep` (and the call without an episode
/// when `unattributed`), from the records themselves.
fn expected(trace: &Trace, keep: &dyn Fn(&str) -> bool, unattributed: bool) -> Value {
    let mut calls = BTreeMap::new();
    let mut rewards = BTreeMap::new();
    let mut episodes: BTreeMap<String, Value> = BTreeMap::new();
    for record in &trace.records {
        match &record.kind {
            Some(RecordKind::LlmCall(call)) => {
                let selected = if call.episode_id.is_empty() {
                    unattributed
                } else {
                    keep(&call.episode_id)
                };
                if selected {
                    calls.insert(call.span_id.clone(), call_json(call));
                }
            }
            Some(RecordKind::Reward(r)) if keep(&r.episode_id) => {
                rewards.insert(
                    r.reward_id.clone(),
                    json!({"episode_id": r.episode_id, "span_id": none_if_empty(&r.span_id),
                           "name": none_if_empty(&r.name), "value": r.value}),
                );
            }
            _ => {}
        }
    }
    for episode in trace
        .records
        .iter()
        .filter_map(Record::episode_id)
        .collect::<BTreeSet<_>>()
    {
        if !keep(episode) {
            continue;
        }
        let (task, i): (&str, usize) = {
            let (task, i) = episode.rsplit_once('-').unwrap();
            (task, i.parse().unwrap())
        };
        episodes.insert(
            episode.to_owned(),
            json!({
                "task_id": task, "group_id": "g", "status": "succeeded",
                "calls": 3, "failed_calls": 0, "rewards": 4,
                "final_reward": i as f64 + 0.5,
                "reward_components": {"tests_passed": 0.25 * i as f64},
                "incomplete": (task == "capital" && i == 1) || episode == "add-2",
                "dropped_records": match episode { "capital-1" => 1, "add-2" => 2, _ => 0 },
                "sidecar_ids": ["exp-a"],
            }),
        );
    }
    json!({"calls": calls, "rewards": rewards, "episodes": episodes})
}

fn none_if_empty(s: &str) -> Value {
    if s.is_empty() { Value::Null } else { json!(s) }
}

fn call_json(call: &LlmCall) -> Value {
    let first = call.completions.first();
    let request: Value = serde_json::from_slice(&call.request_body).unwrap_or(Value::Null);
    json!({
        "episode_id": none_if_empty(&call.episode_id),
        "task_id": none_if_empty(&call.task_id),
        "seq": call.seq,
        "outcome": if call.outcome() == Outcome::Ok { "ok" } else { "other" },
        "start_time": call.start_unix_nanos,
        "request_messages": request.get("messages"),
        "finish_reason": first.map(|c| c.finish_reason.clone()),
        "tool_calls": first.map(|c| c.tool_calls.iter().map(|t| json!({
            "id": t.id, "type": t.r#type, "name": t.name, "arguments": t.arguments,
        })).collect::<Vec<_>>()).unwrap_or_default(),
        "completion_content": first.map(|c| c.text.clone()),
        "prompt_token_ids": (!call.prompt_token_ids.is_empty()).then(|| call.prompt_token_ids.clone()),
        "completion_token_ids": first.filter(|c| !c.token_ids.is_empty()).map(|c| c.token_ids.clone()),
        "completion_logprobs": first.filter(|c| !c.logprobs.is_empty()).map(|c| c.logprobs.clone()),
    })
}

/// Runs `export` with `args`; (exit success, stdout, stderr).
fn export(store: &str, out: &Path, args: &[&str]) -> (bool, String, String) {
    let output = trainer()
        .args(["export", "--store", store, "--out"])
        .arg(out)
        .args(args)
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// `export_check.py OUT EXPECTED`: pyarrow and DuckDB read the files and compare.
fn check(out: &Path, expected: &Value) {
    let expected_path = out.join("expected.json");
    std::fs::write(&expected_path, expected.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/export_check.py");
    let output = std::process::Command::new(common::python())
        .arg(&script)
        .arg(out)
        .arg(&expected_path)
        .output()
        .expect("run export_check.py with TAPLINE_PYTHON");
    assert!(
        output.status.success(),
        "export_check.py:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_export_holds_every_record_and_filters_select_episodes() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let url = format!("file://{}", store_dir.display());
    let location = open_store(&url).unwrap();
    let trace = trace();
    let damaged = write_store(&location, &trace).await;
    let damaged_rel = damaged
        .strip_prefix(&format!("{}/", location.prefix))
        .unwrap_or(&damaged)
        .to_owned();

    // Without --skip-damaged: the rest is exported, the damaged segment named, exit 1.
    let all = dir.path().join("all");
    let (ok, stdout, stderr) = export(&url, &all, &[]);
    assert!(
        !ok,
        "a damaged segment must fail the export:\n{stdout}\n{stderr}"
    );
    assert!(stderr.contains(&damaged_rel), "{stderr}");
    assert!(stderr.contains("--skip-damaged"), "{stderr}");
    check(&all, &expected(&trace, &|_| true, true));

    // With it: the same files, exit 0, and the summary counts the duplicate.
    let (ok, stdout, stderr) = export(&url, &all, &["--skip-damaged", "--json"]);
    assert!(ok, "{stdout}\n{stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(summary["duplicate_records"], 1, "{summary}");
    assert_eq!(summary["passes"], 1, "{summary}");
    assert_eq!(summary["calls"], 16, "{summary}");
    assert_eq!(summary["damaged_segments"][0][0], damaged_rel, "{summary}");
    check(&all, &expected(&trace, &|_| true, true));
    // No temporary file is left behind.
    let names: BTreeSet<String> = std::fs::read_dir(&all)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "calls.parquet",
            "episodes.parquet",
            "expected.json",
            "rewards.parquet"
        ]
        .map(String::from)
        .into()
    );

    // --task: the episodes of that task, their calls and rewards; no call without one.
    let out = dir.path().join("task");
    let (ok, stdout, stderr) = export(
        &url,
        &out,
        &["--task", "capital", "--skip-damaged", "--json"],
    );
    assert!(ok, "{stdout}\n{stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(summary["passes"], 2, "{summary}");
    check(
        &out,
        &expected(&trace, &|e| e.starts_with("capital-"), false),
    );

    // --episode (repeatable).
    let out = dir.path().join("episode");
    let (ok, stdout, stderr) = export(
        &url,
        &out,
        &[
            "--episode",
            "add-1",
            "--episode",
            "capital-0",
            "--skip-damaged",
        ],
    );
    assert!(ok, "{stdout}\n{stderr}");
    check(
        &out,
        &expected(&trace, &|e| e == "add-1" || e == "capital-0", false),
    );

    // --since (inclusive) and --until (exclusive) on the episodes' start: add-1 and add-2.
    let start_of = |episode: &str| {
        trace
            .records
            .iter()
            .find_map(|r| match &r.kind {
                Some(RecordKind::EpisodeEvent(e)) if e.episode_id == episode && e.kind == 1 => {
                    Some(e.time_unix_nanos)
                }
                _ => None,
            })
            .unwrap()
    };
    let rfc3339 = |nanos: i64| {
        chrono::DateTime::from_timestamp_nanos(nanos)
            .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
    };
    let (since, until) = (rfc3339(start_of("add-1")), rfc3339(start_of("capital-0")));
    let out = dir.path().join("window");
    let (ok, stdout, stderr) = export(
        &url,
        &out,
        &["--since", &since, "--until", &until, "--skip-damaged"],
    );
    assert!(ok, "{stdout}\n{stderr}");
    // The call without an episode has no start time: outside any window.
    check(
        &out,
        &expected(&trace, &|e| e == "add-1" || e == "add-2", false),
    );

    // --since alone: add-1 onwards, and the call without an episode (no start time: its
    // record's time counts, which is after add-1 started).
    let out = dir.path().join("since");
    let (ok, stdout, stderr) = export(&url, &out, &["--since", &since, "--skip-damaged"]);
    assert!(ok, "{stdout}\n{stderr}");
    check(&out, &expected(&trace, &|e| e != "add-0", true));

    // Bad input is named.
    let (ok, _, stderr) = export(&url, &out, &["--since", "yesterday"]);
    assert!(!ok && stderr.contains("is not a time"), "{stderr}");
    let (ok, _, stderr) = export(&url, &out, &["--since", &until, "--until", &since]);
    assert!(
        !ok && stderr.contains("--since is not before --until"),
        "{stderr}"
    );
}

/// An empty store exports three empty files with their schemas.
#[tokio::test]
async fn an_empty_store_exports_empty_files() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let out = dir.path().join("out");
    let (ok, stdout, stderr) = export(&format!("file://{}", store_dir.display()), &out, &[]);
    assert!(ok, "{stdout}\n{stderr}");
    check(&out, &json!({"calls": {}, "rewards": {}, "episodes": {}}));
}
