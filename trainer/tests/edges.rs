//! Edges: completions cut at the right stop token, model directories that cannot be
//! used, and segments that fail their checks — each with an error that names the
//! problem.

mod common;

use common::model_dir;
use object_store::PutPayload;
use object_store::path::Path;
use serde_json::json;
use tapline_proto::keys::SegmentKey;
use tapline_proto::store::open_store;
use tapline_proto::{Completion, Record, RecordKind, Reward};
use tapline_trainer::ingest::{IngestOptions, read_store};
use tapline_trainer::model::{Model, ModelError, ModelOptions};
use tapline_trainer::tokenize::{ChatRequest, completion_text, finish_completion, render_prompt};

fn completion_ids(model: &Model, request: &serde_json::Value, completion: &Completion) -> Vec<u32> {
    let request = ChatRequest::from_json(request).expect("request");
    let kwargs = serde_json::Map::new();
    let prompt = render_prompt(model, &request, &kwargs).expect("prompt");
    let text = completion_text(model, &request, &kwargs, &prompt, completion).expect("completion");
    finish_completion(
        model,
        model.encode(&text).expect("encode"),
        &completion.finish_reason,
    )
}

#[test]
fn completions_end_at_the_turns_stop_token_or_not_at_all_when_cut_by_length() {
    let request = json!({"messages": [{"role": "user", "content": "Hi"}]});
    let stop = |text: &str, finish: &str| Completion {
        text: text.into(),
        finish_reason: finish.into(),
        ..Completion::default()
    };
    // Llama 3 ends a turn with <|eot_id|>, not its eos_token <|end_of_text|>; its
    // template then opens another assistant header, which is not part of the completion.
    let llama = Model::load(&model_dir("llama3"), &ModelOptions::default()).expect("llama3");
    let eot = llama.encode("<|eot_id|>").expect("encode");
    let mut want = llama.encode("Hello there.").expect("encode");
    want.extend(&eot);
    assert_eq!(
        completion_ids(&llama, &request, &stop("Hello there.", "stop")),
        want
    );
    want.pop();
    assert_eq!(
        completion_ids(&llama, &request, &stop("Hello there.", "length")),
        want
    );

    // Qwen3: what it generated, <|im_end|> included, without the template's "\n" after.
    let qwen = Model::load(&model_dir("qwen3"), &ModelOptions::default()).expect("qwen3");
    let completion = Completion {
        text: "Sure.".into(),
        reasoning: "Short.".into(),
        finish_reason: "stop".into(),
        ..Completion::default()
    };
    let want = qwen
        .encode("<think>\nShort.\n</think>\n\nSure.<|im_end|>")
        .expect("encode");
    assert_eq!(completion_ids(&qwen, &request, &completion), want);
}

#[test]
fn unusable_model_directories_are_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = Model::load(dir.path(), &ModelOptions::default()).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    let qwen = model_dir("qwen3");
    std::fs::copy(
        qwen.join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("copy");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "<|im_end|>"}"#,
    )
    .expect("write");
    let err = Model::load(dir.path(), &ModelOptions::default()).unwrap_err();
    assert!(matches!(err, ModelError::NoChatTemplate { .. }), "{err}");
    assert!(err.to_string().contains("--chat-template"), "{err}");

    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#,
    )
    .expect("write");
    let err = Model::load(dir.path(), &ModelOptions::default()).unwrap_err();
    assert!(err.to_string().contains("\"default\""), "{err}");

    // A named list: "tool_use" is chosen when the request has tools.
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools:{{ tools | length }}"}]}"#,
    )
    .expect("write");
    let model = Model::load(dir.path(), &ModelOptions::default()).expect("load");
    let kwargs = serde_json::Map::new();
    let with_tools =
        ChatRequest::from_json(&json!({"messages": [], "tools": [{}, {}]})).expect("request");
    let without = ChatRequest::from_json(&json!({"messages": []})).expect("request");
    assert_eq!(
        render_prompt(&model, &with_tools, &kwargs).expect("render"),
        "tools:2"
    );
    assert_eq!(
        render_prompt(&model, &without, &kwargs).expect("render"),
        "plain"
    );

    // chat_template.jinja wins over tokenizer_config.json; a broken one is reported.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}",
    )
    .expect("write");
    let err = Model::load(dir.path(), &ModelOptions::default()).unwrap_err();
    assert!(err.to_string().contains("does not compile"), "{err}");

    let err = Model::load(
        &qwen,
        &ModelOptions {
            stop_tokens: vec!["<|no_such_token|>".into()],
            ..ModelOptions::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("<|no_such_token|>"), "{err}");
}

#[tokio::test]
async fn corrupt_segments_fail_the_run_by_key_unless_skipped() {
    let store = open_store("memory://trainer-edges-corrupt").expect("store");
    let record = Record::new(
        "s",
        1,
        1_796_204_942_000_000_000,
        RecordKind::Reward(Reward {
            reward_id: "r".into(),
            episode_id: "e".into(),
            value: 1.0,
            ..Reward::default()
        }),
    );
    let good = SegmentKey::new("s", 1, record.written_unix_nanos).expect("key");
    let bad = SegmentKey::new("s", 2, record.written_unix_nanos).expect("key");
    let (mut bytes, _) = tapline_proto::segment::encode_segment([&record], 3).expect("encode");
    store
        .store
        .put(
            &good.to_path(&store.prefix),
            PutPayload::from(bytes.clone()),
        )
        .await
        .expect("put");
    let last = bytes.len() - 10;
    bytes[last] ^= 0xff;
    let bad_path = bad.to_path(&store.prefix);
    store
        .store
        .put(&bad_path, PutPayload::from(bytes))
        .await
        .expect("put");
    // Not a segment key: counted, not read.
    store
        .store
        .put(
            &Path::from("segments/v1/notes.txt"),
            PutPayload::from_static(b"hello"),
        )
        .await
        .expect("put");

    let err = read_store(&store, None, &IngestOptions::default(), 0)
        .await
        .unwrap_err();
    assert!(err.to_string().contains(bad_path.as_ref()), "{err}");
    assert!(
        err.to_string().contains("skip_unreadable_segments"),
        "{err}"
    );

    let options = IngestOptions {
        skip_unreadable_segments: true,
        ..IngestOptions::default()
    };
    let read = read_store(&store, None, &options, 0).await.expect("read");
    assert_eq!(read.unreadable_segments.len(), 1);
    assert_eq!(read.unreadable_segments[0].0, bad_path.as_ref());
    assert_eq!(read.new_segments.len(), 2);
    assert_eq!(read.foreign_objects, 1);
    assert_eq!(read.ingested.episodes.len(), 1);
}

/// Regression: a record over the reader's 64 MiB limit made its whole segment
/// unreadable, so the small records that shared it were lost with it.
#[tokio::test]
async fn a_segment_with_one_oversized_record_still_yields_the_others() {
    let store = open_store("memory://trainer-edges-oversized").expect("store");
    let t = 1_796_204_942_000_000_000;
    let reward = |id: &str| {
        Record::new(
            "s",
            1,
            t,
            RecordKind::Reward(Reward {
                reward_id: id.into(),
                episode_id: "e".into(),
                value: 1.0,
                ..Reward::default()
            }),
        )
    };
    let huge = Record::new(
        "s",
        2,
        t,
        RecordKind::LlmCall(tapline_proto::LlmCall {
            span_id: "big".into(),
            episode_id: "e".into(),
            request_body: vec![b'a'; 65 << 20].into(),
            ..tapline_proto::LlmCall::default()
        }),
    );
    let records = [reward("r1"), huge, reward("r2")];
    let key = SegmentKey::new("s", 1, t).expect("key");
    let (bytes, _) = tapline_proto::segment::encode_segment(&records, 3).expect("encode");
    store
        .store
        .put(&key.to_path(&store.prefix), PutPayload::from(bytes))
        .await
        .expect("put");
    let read = read_store(&store, None, &IngestOptions::default(), 0)
        .await
        .expect("the segment is read");
    assert!(read.unreadable_segments.is_empty());
    assert_eq!(read.ingested.records, 2);
    assert_eq!(read.ingested.episodes[0].rewards.len(), 2);
    assert_eq!(read.oversized_records.len(), 1);
    let (skipped_key, skipped) = &read.oversized_records[0];
    assert_eq!(skipped_key, key.to_path(&store.prefix).as_ref());
    assert_eq!(skipped.index, 1);
    assert!(skipped.bytes > 64 << 20);
}

#[test]
fn version_names_the_commit() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tapline-trainer"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let commit = text
        .trim()
        .strip_prefix(&format!(
            "tapline-trainer {} (commit ",
            env!("CARGO_PKG_VERSION")
        ))
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{text:?}"
    );
    // The manifest's commit is the same one, in full.
    assert!(
        commit == "unknown" || tapline_trainer::GIT_COMMIT.starts_with(commit),
        "{commit} vs {}",
        tapline_trainer::GIT_COMMIT
    );
}
