//! Rebuilds every response body under `tests/fixtures/` and compares the result with the
//! hand-written `<name>.expected.json` next to it; also checks that SSE framing of every
//! `.sse` fixture does not depend on where the bytes are split.
//!
//! The API comes from the file-name prefix, `streamed` from the extension (`.sse`).
//! In an expectation, `warnings` lists one substring per expected warning, in order.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tapline_proto::Api;
use tapline_sidecar::rebuild::{Rebuilt, rebuild};
use tapline_sidecar::sse::{SseEvent, SseParser};

const REQUIRED: &[&str] = &[
    "openai_chat_json_tool_calls.json",
    "openai_chat_sse_text_usage.sse",
    "openai_chat_sse_tool_calls.sse",
    "vllm_chat_json_token_ids.json",
    "vllm_chat_sse_token_ids.sse",
    "vllm_completions_sse_token_ids.sse",
    "openai_responses_json.json",
    "openai_responses_sse.sse",
    "anthropic_messages_json_tool_use.json",
    "anthropic_messages_sse_thinking_tool_use.sse",
    "anthropic_messages_sse_error.sse",
    "openai_chat_sse_error_midstream.sse",
];

fn fixtures_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures"))
}

/// Every fixture body (not the expectations, not the README), sorted by name.
fn fixtures() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = file_name(p);
            !name.ends_with(".expected.json") && (name.ends_with(".json") || name.ends_with(".sse"))
        })
        .collect();
    out.sort();
    out
}

fn file_name(p: &Path) -> &str {
    p.file_name().unwrap().to_str().unwrap()
}

fn api_for(name: &str) -> Api {
    const PREFIXES: &[(&str, Api)] = &[
        ("openai_chat_", Api::ChatCompletions),
        ("vllm_chat_", Api::ChatCompletions),
        ("openai_completions_", Api::Completions),
        ("vllm_completions_", Api::Completions),
        ("openai_responses_", Api::Responses),
        ("vllm_responses_", Api::Responses),
        ("anthropic_messages_", Api::AnthropicMessages),
    ];
    PREFIXES
        .iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map(|(_, api)| *api)
        .unwrap_or_else(|| panic!("{name}: no API for this file-name prefix"))
}

/// The rebuilt result in the shape of the expectation files (warnings compared apart).
fn to_json(r: &Rebuilt) -> Value {
    json!({
        "completions": r.completions.iter().map(|c| json!({
            "index": c.index,
            "text": c.text,
            "reasoning": c.reasoning,
            "tool_calls": c.tool_calls.iter().map(|t| json!({
                "id": t.id,
                "type": t.r#type,
                "name": t.name,
                "arguments": t.arguments,
            })).collect::<Vec<_>>(),
            "finish_reason": c.finish_reason,
            "token_ids": c.token_ids,
            "logprobs": c.logprobs,
        })).collect::<Vec<_>>(),
        "usage": r.usage.as_ref().map(|u| json!({
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "cached_prompt_tokens": u.cached_prompt_tokens,
            "reasoning_tokens": u.reasoning_tokens,
        })),
        "response_model": r.response_model,
        "prompt_token_ids": r.prompt_token_ids,
        "stream_error": r.stream_error,
    })
}

#[test]
fn required_fixtures_exist_with_expectations() {
    let names: Vec<String> = fixtures().iter().map(|p| file_name(p).to_owned()).collect();
    for required in REQUIRED {
        assert!(names.iter().any(|n| n == required), "missing {required}");
    }
    let readme = std::fs::read_to_string(fixtures_dir().join("README.md")).unwrap();
    for name in &names {
        let stem = name.rsplit_once('.').unwrap().0;
        assert!(
            fixtures_dir()
                .join(format!("{stem}.expected.json"))
                .exists(),
            "{name}: no {stem}.expected.json"
        );
        assert!(
            readme.contains(name.as_str()),
            "{name} not listed in README.md"
        );
    }
}

#[test]
fn every_fixture_rebuilds_as_expected() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for path in fixtures() {
        let name = file_name(&path);
        let body = std::fs::read(&path).unwrap();
        let streamed = name.ends_with(".sse");
        let rebuilt = rebuild(api_for(name), streamed, &body);

        let stem = name.rsplit_once('.').unwrap().0;
        let expected_text =
            std::fs::read_to_string(fixtures_dir().join(format!("{stem}.expected.json"))).unwrap();
        let mut expected: Value = serde_json::from_str(&expected_text)
            .unwrap_or_else(|e| panic!("{stem}.expected.json: {e}"));
        let warnings = expected
            .as_object_mut()
            .unwrap()
            .remove("warnings")
            .unwrap_or_else(|| json!([]));
        let warnings: Vec<&str> = warnings
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w.as_str().unwrap())
            .collect();

        let actual = to_json(&rebuilt);
        if actual != expected {
            failures.push(format!(
                "{name}: rebuilt\n{}\nexpected\n{}",
                serde_json::to_string_pretty(&actual).unwrap(),
                serde_json::to_string_pretty(&expected).unwrap()
            ));
        }
        let warnings_match = rebuilt.warnings.len() == warnings.len()
            && rebuilt
                .warnings
                .iter()
                .zip(&warnings)
                .all(|(got, want)| got.contains(want));
        if !warnings_match {
            failures.push(format!(
                "{name}: warnings {:?}, expected ones containing {:?}",
                rebuilt.warnings, warnings
            ));
        }
        checked += 1;
    }
    assert!(checked >= REQUIRED.len());
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
}

fn parse(chunks: &[&[u8]]) -> (Vec<SseEvent>, u64) {
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    for chunk in chunks {
        parser.feed(chunk, &mut events);
    }
    parser.finish(&mut events);
    (events, parser.consumed_through_last_event())
}

#[test]
fn sse_fixtures_frame_the_same_at_every_split() {
    let mut files = 0;
    for path in fixtures() {
        let name = file_name(&path);
        if !name.ends_with(".sse") {
            continue;
        }
        let body = std::fs::read(&path).unwrap();
        let whole = parse(&[&body]);
        assert!(!whole.0.is_empty(), "{name}: no events");
        for k in 0..=body.len() {
            let split = parse(&[&body[..k], &body[k..]]);
            assert!(split == whole, "{name}: split at byte {k} differs");
        }
        files += 1;
    }
    assert!(files >= 8);
}

#[test]
fn streamed_fixtures_rebuild_the_same_from_crlf_framing() {
    // Servers behind some proxies re-frame with CRLF; the content must not change.
    for path in fixtures() {
        let name = file_name(&path);
        if !name.ends_with(".sse") {
            continue;
        }
        let body = std::fs::read_to_string(&path).unwrap();
        let crlf = body.replace('\n', "\r\n");
        let api = api_for(name);
        let a = rebuild(api, true, body.as_bytes());
        let b = rebuild(api, true, crlf.as_bytes());
        assert_eq!(to_json(&a), to_json(&b), "{name}");
        assert_eq!(a.warnings.len(), b.warnings.len(), "{name}");
    }
}
