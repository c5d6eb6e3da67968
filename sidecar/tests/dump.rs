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
            request_body: br#"{"model":"m","messages":[]}"#.to_vec(),
            response_body: vec![0x80, 0x81],
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
            request_body: vec![b'a'; 65 << 20],
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
