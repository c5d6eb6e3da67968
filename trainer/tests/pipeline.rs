//! The whole data pipeline on a store of synthetic agent traces recorded with the real
//! Qwen3 tokenizer: recorded prompt ids are transformers' own `apply_chat_template`
//! output (what vLLM returns), recorded completion ids the tokenized generated text —
//! except where a test case makes them drift on purpose.

mod common;

use std::collections::BTreeMap;
use std::process::Command;

use common::traces::{Trace, Turn, agent_tools, tool_result};
use common::{Case, hf_ids, model_dir};
use serde_json::{Value, json};
use tapline_proto::Outcome;
use tapline_proto::store::{StoreLocation, open_store};
use tapline_trainer::config::RunConfig;
use tapline_trainer::ingest::{self, read_store};
use tapline_trainer::pipeline::{Prepared, TrainSequence};
use tapline_trainer::{Model, ModelOptions, prepare};

/// 2026-12-02T09:49:02Z.
const T0: i64 = 1_796_204_942_000_000_000;
const HOUR: i64 = 3_600_000_000_000;

/// How a scripted episode's ids are recorded.
#[derive(Clone, Copy, PartialEq)]
enum Ids {
    /// Prompt ids from transformers, completion ids of the generated text.
    Recorded,
    /// No ids at all: the pipeline tokenizes text.
    None,
    /// Like `Recorded`, but the first completion's "\n\n" is sampled as two "\n".
    SplitNewlines,
}

struct Script {
    episode: &'static str,
    task: &'static str,
    reward: f64,
    ids: Ids,
    keep_reasoning: bool,
    /// (user message before the turn, or None to continue after a tool result; turn)
    turns: Vec<(Option<&'static str>, Turn)>,
}

fn tool_turn(reasoning: &str, content: &str, name: &str, args: &str) -> Turn {
    Turn {
        reasoning: reasoning.into(),
        content: content.into(),
        tool_calls: vec![(name.into(), args.into())],
        ..Turn::default()
    }
}

fn answer(reasoning: &str, content: &str) -> Turn {
    Turn {
        reasoning: reasoning.into(),
        content: content.into(),
        ..Turn::default()
    }
}

fn scripts() -> Vec<Script> {
    let exact_turns = || {
        vec![
            (
                Some("Fix the failing test in src/lib.rs."),
                tool_turn(
                    "Read the file first.",
                    "Reading it.",
                    "read_file",
                    r#"{"path": "src/lib.rs"}"#,
                ),
            ),
            (
                None,
                tool_turn(
                    "Now run the tests.",
                    "",
                    "run_shell",
                    r#"{"cmd": "cargo test -q"}"#,
                ),
            ),
            (None, answer("They pass now.", "Fixed: the test passes.")),
        ]
    };
    vec![
        Script {
            episode: "ep-exact",
            task: "t1",
            reward: 1.0,
            ids: Ids::Recorded,
            keep_reasoning: true,
            turns: exact_turns(),
        },
        Script {
            episode: "ep-text",
            task: "t1",
            reward: 0.75,
            ids: Ids::None,
            keep_reasoning: true,
            turns: exact_turns(),
        },
        Script {
            episode: "ep-bpe",
            task: "t1",
            reward: 0.0,
            ids: Ids::SplitNewlines,
            keep_reasoning: true,
            turns: vec![
                (
                    Some("Explain, then list files."),
                    tool_turn(
                        "Explain first.",
                        "First part.\n\nSecond part.",
                        "run_shell",
                        r#"{"cmd": "ls"}"#,
                    ),
                ),
                (None, answer("Done.", "Listed.")),
            ],
        },
        Script {
            episode: "ep-think",
            task: "t1",
            reward: 0.5,
            ids: Ids::Recorded,
            keep_reasoning: false,
            turns: vec![
                (Some("What is 2+2?"), answer("Add two and two.", "4")),
                (Some("And 3+3?"), answer("Add three and three.", "6")),
            ],
        },
        Script {
            episode: "ep-json",
            task: "t1",
            reward: 0.25,
            ids: Ids::Recorded,
            keep_reasoning: true,
            turns: vec![
                (
                    Some("List files."),
                    tool_turn("Use the shell.", "", "run_shell", r#"{"cmd":"ls -la"}"#),
                ),
                (None, answer("Seen them.", "Two files.")),
            ],
        },
        Script {
            episode: "ep-same-1",
            task: "t2",
            reward: 1.0,
            ids: Ids::Recorded,
            keep_reasoning: true,
            turns: vec![(Some("Say hi."), answer("Greet.", "Hi!"))],
        },
        Script {
            episode: "ep-same-2",
            task: "t2",
            reward: 1.0,
            ids: Ids::Recorded,
            keep_reasoning: true,
            turns: vec![(Some("Say hi."), answer("Greet briefly.", "Hello!"))],
        },
    ]
}

/// The requests of a script, in call order.
fn requests(script: &Script) -> Vec<Value> {
    let mut messages =
        vec![json!({"role": "system", "content": "You are a careful coding agent."})];
    let mut out = Vec::new();
    for (user, turn) in &script.turns {
        if let Some(user) = user {
            messages.push(json!({"role": "user", "content": user}));
        }
        out.push(json!({"model": "m", "messages": messages, "tools": agent_tools()}));
        messages.push(turn.history_message(script.keep_reasoning));
        if !turn.tool_calls.is_empty() {
            messages.push(tool_result(out.len()));
        }
    }
    out
}

struct World {
    model: Model,
    trace: Trace,
    /// A trace of records 10 hours old.
    old: Trace,
    /// Completion ids of ep-exact, in order (to check the loss mask).
    exact_completions: Vec<Vec<u32>>,
}

fn build_world() -> World {
    let dir = model_dir("qwen3");
    let model = Model::load(&dir, &ModelOptions::default()).expect("load qwen3");
    let scripts = scripts();
    // Recorded prompt ids come from transformers itself.
    let all: Vec<(usize, Value)> = scripts
        .iter()
        .enumerate()
        .flat_map(|(i, s)| requests(s).into_iter().map(move |r| (i, r)))
        .collect();
    let cases: Vec<Case> = all
        .iter()
        .map(|(_, r)| Case::new("prompt", r["messages"].clone()).tools(r["tools"].clone()))
        .collect();
    let mut hf = hf_ids(&dir, &cases).into_iter();

    let mut trace = Trace::new("pod-1", T0);
    let mut exact_completions = Vec::new();
    trace.unattributed_call();
    for script in &scripts {
        trace.start(script.episode, script.task, "");
        for (k, (request, (_, turn))) in requests(script).iter().zip(&script.turns).enumerate() {
            let prompt = hf
                .next()
                .expect("one result per prompt")
                .expect("transformers renders");
            let text = turn.qwen3_generated_text();
            let mut completion_ids = model.encode(&text).expect("encode");
            if script.ids == Ids::SplitNewlines && k == 0 {
                let nl = model.encode("\n").expect("encode")[0];
                let nlnl = model.encode("\n\n").expect("encode")[0];
                // The content's "\n\n" (not the one after </think>): the last one.
                let at = completion_ids
                    .iter()
                    .rposition(|t| *t == nlnl)
                    .expect("has \\n\\n");
                completion_ids.splice(at..=at, [nl, nl]);
                assert_eq!(model.decode(&completion_ids), text);
            }
            if script.episode == "ep-exact" {
                exact_completions.push(completion_ids.clone());
                if k == 1 {
                    // A failed attempt before the real call: dropped as call_failed.
                    trace.chat_call(
                        script.episode,
                        script.task,
                        99,
                        request,
                        turn.completion(vec![], vec![]),
                        vec![],
                        Outcome::UpstreamError,
                    );
                }
            }
            let logprobs: Vec<f64> = (0..completion_ids.len())
                .map(|i| -0.01 * i as f64)
                .collect();
            let (prompt_ids, completion) = match script.ids {
                Ids::None => (vec![], turn.completion(vec![], vec![])),
                _ => (prompt, turn.completion(completion_ids, logprobs)),
            };
            trace.chat_call(
                script.episode,
                script.task,
                k as u32,
                request,
                completion,
                prompt_ids,
                Outcome::Ok,
            );
        }
        trace.reward(script.episode, "", "", script.reward);
        // A named component without a weight: reported, not part of the reward.
        let tests = match script.episode {
            "ep-exact" => Some(1.0),
            "ep-text" => Some(0.5),
            "ep-same-1" => Some(9.0), // its group is dropped: not counted
            _ => None,
        };
        if let Some(v) = tests {
            trace.reward(script.episode, "", "tests", v);
        }
        trace.end(script.episode, script.task, "", false);
    }
    // Still running (recent): pending. Incomplete: dropped.
    trace.start("ep-running", "t1", "");
    trace.start("ep-incomplete", "t1", "");
    trace.reward("ep-incomplete", "", "", 1.0);
    trace.end("ep-incomplete", "t1", "", true);
    // Started long ago and never ended: dropped.
    let mut old = Trace::new("pod-2", T0 - 10 * HOUR);
    old.start("ep-abandoned", "t1", "");
    World {
        model,
        trace,
        old,
        exact_completions,
    }
}

async fn fill(store: &StoreLocation, world: &World) {
    world.trace.write(store, 7).await;
    world.old.write(store, 7).await;
}

fn sequences_of<'a>(prepared: &'a Prepared, episode: &str) -> Vec<&'a TrainSequence> {
    prepared
        .mini_batches
        .iter()
        .flat_map(|m| &m.micro_batches)
        .flat_map(|m| &m.sequences)
        .filter(|t| t.episode_id == episode)
        .collect()
}

fn count(map: &BTreeMap<String, u64>, key: &str) -> u64 {
    map.get(key).copied().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_become_exact_batches_and_drift_is_reported_not_merged() {
    let world = build_world();
    let store = open_store("memory://trainer-pipeline-test").expect("memory store");
    fill(&store, &world).await;
    let config = RunConfig::default();
    let read = read_store(&store, Some("t"), &config.ingest, 0)
        .await
        .expect("read store");
    let segments = world.trace.records.len().div_ceil(7) + world.old.records.len().div_ceil(7);
    assert_eq!(read.new_segments.len(), segments, "{:?}", read.new_segments);
    let now = T0 + HOUR / 2;
    let prepared = prepare(read.ingested, &world.model, &config, now);
    let r = &prepared.report;
    let d = &r.dropped;
    eprintln!("{}", r.table());

    // Cleaning.
    assert_eq!(count(&d.calls, "unattributed"), 1, "{d:?}");
    assert_eq!(count(&d.calls, "call_failed"), 1, "{d:?}");
    assert_eq!(count(&d.episodes, "incomplete"), 1, "{d:?}");
    assert_eq!(count(&d.episodes, "never_ended"), 1, "{d:?}");
    assert_eq!(count(&d.episodes, "zero_variance_group"), 2, "{d:?}");
    assert_eq!(count(&d.groups, "zero_variance_group"), 1, "{d:?}");
    assert_eq!(prepared.pending.keys().collect::<Vec<_>>(), ["ep-running"]);

    // Recorded prompts equal the template; drifted completions are named.
    let k = &r.tokenize;
    assert_eq!(k.prompts_from_text, 3, "ep-text's three prompts");
    assert!(k.prompts_compared >= 10);
    assert!(k.prompt_drift.is_empty(), "{:?}", k.prompt_drift);
    assert_eq!(count(&k.completion_drift, "non_canonical_bpe"), 1, "{k:?}");
    assert_eq!(count(&k.completion_drift, "json_reserialized"), 1, "{k:?}");
    assert_eq!(k.completion_drift.values().sum::<u64>(), 2, "{k:?}");

    // Merging: exact prefixes merge; every drift case breaks, named.
    let m = &r.merge;
    assert_eq!(count(&m.breaks, "non_canonical_bpe"), 1, "{m:?}");
    assert_eq!(count(&m.breaks, "thinking_stripped"), 1, "{m:?}");
    assert_eq!(count(&m.breaks, "json_reserialized"), 1, "{m:?}");
    assert_eq!(m.breaks.values().sum::<u64>(), 3, "{m:?}");
    for (episode, n) in [
        ("ep-exact", 1),
        ("ep-text", 1),
        ("ep-bpe", 2),
        ("ep-think", 2),
        ("ep-json", 2),
    ] {
        assert_eq!(sequences_of(&prepared, episode).len(), n, "{episode}");
    }
    assert!((m.merge_rate - 4.0 / 7.0).abs() < 1e-9, "{}", m.merge_rate);

    // The merged sequence: loss exactly on the sampled tokens, with their logprobs.
    let exact = sequences_of(&prepared, "ep-exact")[0];
    let s = &exact.sequence;
    let sampled: Vec<u32> = s
        .token_ids
        .iter()
        .zip(&s.loss_mask)
        .filter(|(_, m)| **m == 1)
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(sampled, world.exact_completions.concat());
    assert_eq!(s.logprobs.iter().flatten().count(), sampled.len());
    // Text-only tokenization of the same conversation gives the very same tokens.
    let text = sequences_of(&prepared, "ep-text")[0];
    assert_eq!(text.sequence.token_ids, s.token_ids);
    assert_eq!(text.sequence.loss_mask, s.loss_mask);
    assert!(text.sequence.logprobs.iter().all(Option::is_none));

    // GRPO advantages on every sampled token, token-mean weights summing to one.
    let rewards = [1.0, 0.75, 0.0, 0.5, 0.25];
    let mean = rewards.iter().sum::<f64>() / 5.0;
    let std = (rewards.iter().map(|r| (r - mean) * (r - mean)).sum::<f64>() / 4.0).sqrt();
    let want = (1.0 - mean) / (std + 1e-6);
    for (a, m) in exact.advantages.iter().zip(&s.loss_mask) {
        assert_eq!(*a, if *m == 1 { want } else { 0.0 });
    }
    let total: f64 = prepared
        .mini_batches
        .iter()
        .flat_map(|m| &m.micro_batches)
        .flat_map(|m| &m.sequences)
        .flat_map(|t| &t.weights)
        .sum();
    assert!((total - 1.0).abs() < 1e-9, "{total}");
    // The named component over the episodes trained on that have it.
    let c = &prepared.report.advantages.reward_components;
    assert_eq!(c.keys().collect::<Vec<_>>(), ["tests"], "{c:?}");
    let t = &c["tests"];
    assert_eq!((t.episodes, t.mean, t.min, t.max), (2, 0.75, 0.5, 1.0));

    // Over-long sequences are dropped by name.
    let read = read_store(&store, None, &config.ingest, 0)
        .await
        .expect("read store");
    let mut short = RunConfig::default();
    short.clean.max_seq_len = 500;
    short.schedule.micro_batch_tokens = 500;
    let prepared = prepare(read.ingested, &world.model, &short, now);
    assert_eq!(
        count(&prepared.report.dropped.sequences, "over_length"),
        2,
        "ep-exact and ep-text"
    );
    assert!(
        prepared
            .mini_batches
            .iter()
            .flat_map(|m| &m.micro_batches)
            .all(|m| m.sequences.iter().map(|t| t.sequence.len()).sum::<usize>() <= 500)
    );
}

fn trainer() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tapline-trainer"))
}

fn run_prepare(store: &str, out: &std::path::Path, now: i64, extra: &[&str]) -> String {
    let output = trainer()
        .args(["prepare", "--store", store, "--model"])
        .arg(model_dir("qwen3"))
        .arg("--out")
        .arg(out)
        .args(["--now-unix-secs", &(now / 1_000_000_000).to_string()])
        .args(extra)
        .output()
        .expect("run tapline-trainer");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "prepare failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn read_json(path: &std::path::Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).expect("read file")).expect("JSON file")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_cli_writes_documented_batches_and_advances_the_cursor() {
    let world = build_world();
    let tmp = tempfile::tempdir().expect("tempdir");
    // TAPLINE_TEST_STORE_DIR keeps the store for trying the command by hand.
    let base = std::env::var_os("TAPLINE_TEST_STORE_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| tmp.path().to_owned());
    let _ = std::fs::remove_dir_all(base.join("store"));
    let store_url = format!("file://{}", base.join("store").display());
    let store = open_store(&store_url).expect("store");
    fill(&store, &world).await;
    let out = base.join("out");
    let now = T0 + HOUR / 2;

    let stdout = run_prepare(&store_url, &out, now, &[]);
    assert!(stdout.contains("merge rate"), "{stdout}");
    assert!(stdout.contains("zero_variance_group"), "{stdout}");
    let manifest = read_json(&out.join("manifest.json"));
    assert_eq!(manifest["format"], "tapline.batches.v1");
    let files = manifest["mini_batches"].as_array().expect("mini_batches");
    assert_eq!(files.len(), 1);
    let batch = read_json(&out.join(files[0]["file"].as_str().expect("file")));
    assert_eq!(batch["format"], "tapline.mini_batch.v1");
    let mut episodes = std::collections::BTreeSet::new();
    let mut weight_sum = 0.0;
    for micro in batch["micro_batches"].as_array().expect("micro") {
        for seq in micro["sequences"].as_array().expect("sequences") {
            let n = seq["token_ids"].as_array().expect("ids").len();
            for field in ["loss_mask", "advantages", "weights"] {
                assert_eq!(seq[field].as_array().expect(field).len(), n, "{field}");
            }
            weight_sum += seq["weights"]
                .as_array()
                .expect("w")
                .iter()
                .filter_map(Value::as_f64)
                .sum::<f64>();
            episodes.insert(seq["episode_id"].as_str().expect("id").to_owned());
        }
    }
    assert!((weight_sum - 1.0).abs() < 1e-4, "{weight_sum}");
    assert_eq!(episodes.len(), 5, "{episodes:?}");
    let report = read_json(&out.join("report.json"));
    assert_eq!(report["merge"]["breaks"]["thinking_stripped"], 1);
    let cursor_path = base.join("store/trainer/runs/default/cursor.json");
    let cursor: ingest::Cursor = serde_json::from_value(read_json(&cursor_path)).expect("cursor");
    assert_eq!(
        cursor.pending_episodes.iter().collect::<Vec<_>>(),
        ["ep-running"]
    );
    // What was read is one span of sequence numbers per sidecar, not a key per segment.
    assert!(cursor.consumed.is_empty());
    assert_eq!(cursor.version, ingest::CURSOR_VERSION);
    for (sidecar, trace) in [("pod-1", &world.trace), ("pod-2", &world.old)] {
        let first = trace.records[0].sidecar_seq;
        let last = trace.records.last().expect("records").sidecar_seq;
        assert_eq!(
            cursor.sidecars[sidecar].ranges,
            [[first, last]],
            "{cursor:?}"
        );
    }

    // Nothing new: nothing trained, the pending episode is still waited for.
    run_prepare(&store_url, &out, now, &[]);
    let report = read_json(&out.join("report.json"));
    assert_eq!(report["input"]["segments"], 0);
    assert_eq!(report["input"]["pending_episodes"], 1);
    assert_eq!(report["batches"]["sequences"], 0);

    // The running episode ends in a later segment: it is trained on, from both segments.
    let mut later = Trace::new("pod-1", T0 + HOUR);
    later.seq = world.trace.seq;
    let request = json!({"messages": [{"role": "user", "content": "Late question"}]});
    let turn = answer("Think late.", "Late answer.");
    let ids = world
        .model
        .encode(&turn.qwen3_generated_text())
        .expect("encode");
    later.chat_call(
        "ep-running",
        "t1",
        0,
        &request,
        turn.completion(ids, vec![]),
        vec![],
        Outcome::Ok,
    );
    later.reward("ep-running", "", "", 1.0);
    later.end("ep-running", "t1", "", false);
    later.write(&store, 10).await;
    let config = base.join("keep-singletons.toml");
    std::fs::write(&config, "[clean]\ndrop_zero_variance_groups = false\n").expect("write config");
    run_prepare(
        &store_url,
        &out,
        T0 + 2 * HOUR,
        &["--config", config.to_str().expect("utf-8")],
    );
    let report = read_json(&out.join("report.json"));
    assert_eq!(report["input"]["segments"], 1, "{report}");
    assert_eq!(report["input"]["reread_segments"], 1, "{report}");
    assert_eq!(report["input"]["episodes"], 1, "{report}");
    assert_eq!(report["batches"]["sequences"], 1, "{report}");
    let cursor: ingest::Cursor = serde_json::from_value(read_json(&cursor_path)).expect("cursor");
    assert!(cursor.pending_episodes.is_empty() && cursor.pending_segments.is_empty());
}

#[test]
fn tokenize_cli_prints_the_prompt_ids_transformers_gives() {
    let dir = model_dir("qwen3");
    let request = json!({
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "List files."},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "run_shell", "arguments": "{\"cmd\":\"ls\"}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "a.txt"}
        ],
        "tools": agent_tools(),
        "chat_template_kwargs": {"enable_thinking": false}
    });
    let mut child = trainer()
        .args(["tokenize", "--model"])
        .arg(&dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run tapline-trainer tokenize");
    use std::io::Write as _;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(request.to_string().as_bytes())
        .expect("write request");
    let out = child.wait_with_output().expect("tokenize runs");
    assert!(out.status.success());
    let got: Value = serde_json::from_slice(&out.stdout).expect("JSON output");
    let case = Case::new("cli", request["messages"].clone())
        .tools(agent_tools())
        .kwarg("enable_thinking", json!(false));
    let want = hf_ids(&dir, &[case])
        .remove(0)
        .expect("transformers renders");
    let got: Vec<u32> = got["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .filter_map(Value::as_u64)
        .map(|i| i as u32)
        .collect();
    assert_eq!(got, want);
}
