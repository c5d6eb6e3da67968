//! `--policy`: the sidecar follows a policy's announcements, sends calls for its alias to
//! the announced `NAME@vN`, records the version, and gives the harness its own model name
//! back, byte for byte, in JSON bodies and in every stream event.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use serde_json::{Value, json};
use tapline_proto::policy::{Announcement, FORMAT, announcement_path, served_model};

/// Answers in the shape of each API, naming the model the request asked for, split into
/// chunks that cut the model name in the middle.
fn echo(r: &Received) -> Script {
    let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    let model = body["model"].as_str().unwrap_or("").to_owned();
    let stream = body["stream"].as_bool().unwrap_or(false);
    let m = serde_json::to_string(&model).unwrap();
    let text = if r.path.ends_with("/messages") {
        if !stream {
            return Script::json(format!(
                r#"{{"id":"msg_1","type":"message","role":"assistant","model":{m},"content":[{{"type":"text","text":"I run as {model}"}}],"stop_reason":"end_turn","usage":{{"input_tokens":3,"output_tokens":2}}}}"#
            ));
        }
        format!(
            "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":{m},\"content\":[],\"usage\":{{\"input_tokens\":3,\"output_tokens\":1}}}}}}\n\n\
             event: content_block_start\ndata: {{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{{\"type\":\"text\",\"text\":\"\"}}}}\n\n\
             event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"quoting \\\"{model}\\\"\"}}}}\n\n\
             event: content_block_stop\ndata: {{\"type\":\"content_block_stop\",\"index\":0}}\n\n\
             event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"end_turn\"}},\"usage\":{{\"output_tokens\":2}}}}\n\n\
             event: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
        )
    } else if r.path.ends_with("/responses") {
        if !stream {
            return Script::json(format!(
                r#"{{"id":"resp_1","object":"response","model":{m},"status":"completed","output":[{{"type":"message","id":"o1","role":"assistant","content":[{{"type":"output_text","text":"ok","annotations":[]}}]}}]}}"#
            ));
        }
        format!(
            "event: response.created\ndata: {{\"type\":\"response.created\",\"response\":{{\"id\":\"resp_1\",\"model\":{m},\"status\":\"in_progress\",\"output\":[]}}}}\n\n\
             event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"item_id\":\"o1\",\"output_index\":0,\"content_index\":0,\"delta\":\"ok\"}}\n\n\
             event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{{\"id\":\"resp_1\",\"model\":{m},\"status\":\"completed\",\"output\":[{{\"type\":\"message\",\"id\":\"o1\",\"role\":\"assistant\",\"content\":[{{\"type\":\"output_text\",\"text\":\"ok\",\"annotations\":[]}}]}}]}}}}\n\n"
        )
    } else if r.path.ends_with("/chat/completions") {
        if !stream {
            return Script::json(format!(
                r#"{{"id":"c","object":"chat.completion","created":1,"model":{m},"choices":[{{"index":0,"message":{{"role":"assistant","content":"hi"}},"finish_reason":"stop"}}]}}"#
            ));
        }
        format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":{m},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"hi\"}},\"finish_reason\":null}}]}}\r\n\r\n\
             data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":{m},\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}\r\n\r\n\
             data: [DONE]\r\n\r\n"
        )
    } else {
        return Script::json(format!(
            r#"{{"id":"cmpl","object":"text_completion","created":1,"model":{m},"choices":[{{"index":0,"text":"4","finish_reason":"stop"}}]}}"#
        ));
    };
    // Cut the stream every 7 bytes: model names arrive split over chunks.
    let bytes = text.into_bytes();
    Script::sse(bytes.chunks(7).map(Bytes::copy_from_slice).collect())
}

async fn announce(store: &str, version: u64) {
    let loc = tapline_proto::store::open_store(store).unwrap();
    let a = Announcement {
        format: FORMAT.into(),
        name: "coder".into(),
        version,
        served_model: served_model("coder", version),
        adapter: Some(format!("/adapters/coder/v{version}")),
        checkpoint: None,
        run: "run-1".into(),
        manifest_sha256: String::new(),
        time: String::new(),
    };
    loc.store
        .put(
            &announcement_path(&loc.prefix, "coder"),
            serde_json::to_vec(&a).unwrap().into(),
        )
        .await
        .unwrap();
}

async fn health(client: &TestClient, addr: std::net::SocketAddr) -> Value {
    let (_, _, body) = send(
        client,
        http::Request::get(format!("http://{addr}/tapline/v1/health"))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    serde_json::from_slice(&body).unwrap()
}

/// Waits until the sidecar's health says it follows `version`.
async fn wait_for_version(client: &TestClient, addr: std::net::SocketAddr, version: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while health(client, addr).await["policy"]["version"] != version {
        assert!(
            Instant::now() < deadline,
            "the announcement was not followed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn calls_follow_the_announced_version_and_the_harness_keeps_its_model_name() {
    let upstream = Upstream::start(echo).await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.policy = Some("coder".into());
        raw.policy_alias = Some("policy".into());
        raw.policy_poll_secs = Some(0.1);
    })
    .await;
    let addr = sidecar.local_addr();
    let client = client();

    // Nothing announced yet: the call passes unchanged and names no version.
    let before = r#"{"model":"policy","messages":[{"role":"user","content":"hi"}]}"#;
    let (_, _, body) = send(&client, post(addr, "/v1/chat/completions", before)).await;
    assert_eq!(upstream.last().body, before.as_bytes());
    assert!(String::from_utf8_lossy(&body).contains(r#""model":"policy""#));

    announce(&store, 1).await;
    wait_for_version(&client, addr, 1).await;

    // Every API shape, JSON and streamed: the upstream gets `coder@v1` and nothing else
    // changed; the harness gets exactly the upstream's bytes with its own name back.
    let requests = [
        (
            "/v1/chat/completions",
            json!({"model": "policy", "messages": [{"role": "user", "content": "say \"model\":\"policy\""}]}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "model": "policy"}),
        ),
        (
            "/v1/completions",
            json!({"model": "policy", "prompt": "2+2="}),
        ),
        ("/v1/responses", json!({"model": "policy", "input": "hi"})),
        (
            "/v1/responses",
            json!({"model": "policy", "input": "hi", "stream": true}),
        ),
        (
            "/v1/messages",
            json!({"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "policy", "max_tokens": 8, "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        ),
    ];
    let mut spans = Vec::new();
    for (path, request) in &requests {
        // Spacing the harness chose is kept: the body is not re-serialized.
        let sent = serde_json::to_string_pretty(request).unwrap();
        let (status, headers, got) = send(&client, post(addr, path, sent.clone())).await;
        assert_eq!(status, 200, "{path}");
        spans.push(headers["x-tapline-span-id"].to_str().unwrap().to_owned());
        let received = upstream.last();
        assert_eq!(
            String::from_utf8_lossy(&received.body),
            sent.replacen(r#""model": "policy""#, r#""model": "coder@v1""#, 1),
            "{path}: only the model changes on the way up"
        );
        let upstream_said = echo(&received)
            .chunks
            .iter()
            .flat_map(|c| c.to_vec())
            .collect::<Vec<u8>>();
        let upstream_said = String::from_utf8(upstream_said).unwrap();
        assert!(
            upstream_said.contains("\"coder@v1\""),
            "{path}: {upstream_said}"
        );
        assert_eq!(
            String::from_utf8_lossy(&got),
            upstream_said.replace("\"coder@v1\"", "\"policy\""),
            "{path}: the harness sees its own model name, every other byte as sent"
        );
        if upstream_said.contains("quoting") {
            assert!(
                String::from_utf8_lossy(&got).contains(r#"quoting \"coder@v1\""#),
                "text that mentions the name is kept"
            );
        }
    }

    // Not the alias: unchanged, no version.
    let other = r#"{"model":"base-model","prompt":"x"}"#;
    send(&client, post(addr, "/v1/completions", other)).await;
    assert_eq!(upstream.last().body, other.as_bytes());

    // A new announcement is followed within a poll interval.
    announce(&store, 2).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        send(
            &client,
            post(
                addr,
                "/v1/completions",
                r#"{"model":"policy","prompt":"x"}"#,
            ),
        )
        .await;
        if upstream.last().body.as_ref() == br#"{"model":"coder@v2","prompt":"x"}"# {
            break;
        }
        assert!(Instant::now() < deadline, "version 2 was not followed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let h = health(&client, addr).await;
    assert_eq!(h["policy"]["served_model"], "coder@v2");
    assert_eq!(h["policy"]["alias"], "policy");
    let (_, _, metrics) = send(
        &client,
        http::Request::get(format!("http://{addr}/metrics"))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    assert!(
        metrics.contains("tapline_policy_version{policy=\"coder\"} 2"),
        "{metrics}"
    );
    let rewrites: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tapline_policy_rewrites_total{policy=\"coder\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(rewrites > requests.len() as u64, "{metrics}");

    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(5))
        .await;
    let calls = calls(&store, requests.len() + 3).await;
    let by_span = |s: &str| calls.iter().find(|c| c.span_id == s).unwrap();
    for (span, (path, _)) in spans.iter().zip(&requests) {
        let call = by_span(span);
        assert_eq!(call.policy_version, "1", "{path}");
        assert_eq!(
            call.request_model, "policy",
            "{path}: the record keeps the harness's request"
        );
        assert!(String::from_utf8_lossy(&call.request_body).contains("\"policy\""));
        assert_eq!(
            call.response_model, "coder@v1",
            "{path}: and the upstream's response"
        );
    }
    // Exactly the calls that were rewritten record a version.
    for call in &calls {
        let rewritten = call.response_model.starts_with("coder@v");
        assert_eq!(
            call.policy_version.parse::<u64>().is_ok(),
            rewritten,
            "{call:?}"
        );
    }
    assert!(calls.iter().any(|c| c.policy_version == "2"));
}

/// A request whose body is over the capture cap cannot have its model read, so while a
/// version is followed it is refused (413) instead of reaching the base model unnamed.
#[tokio::test]
async fn a_body_over_the_capture_cap_is_refused_while_a_version_is_followed() {
    let upstream = Upstream::start(echo).await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.policy = Some("coder".into());
        raw.policy_alias = Some("policy".into());
        raw.policy_poll_secs = Some(0.1);
        raw.capture_cap_bytes = Some(256);
    })
    .await;
    let addr = sidecar.local_addr();
    let client = client();
    let big = json!({"model": "policy", "prompt": "x".repeat(1000)}).to_string();

    // Nothing announced: it passes whole, to the base model as today.
    let (status, _, _) = send(&client, post(addr, "/v1/completions", big.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(upstream.last().body, big.as_bytes());
    let forwarded = upstream.count();

    announce(&store, 1).await;
    wait_for_version(&client, addr, 1).await;
    let (status, _, body) = send(&client, post(addr, "/v1/completions", big)).await;
    assert_eq!(status, 413);
    let body = String::from_utf8_lossy(&body);
    assert!(
        body.contains("--capture-cap-bytes") && body.contains("coder@v1"),
        "{body}"
    );
    assert_eq!(upstream.count(), forwarded, "nothing went upstream");
    // A small one still goes to the version.
    let small = r#"{"model":"policy","prompt":"x"}"#;
    let (status, _, _) = send(&client, post(addr, "/v1/completions", small)).await;
    assert_eq!(status, 200);
    assert_eq!(
        upstream.last().body.as_ref(),
        br#"{"model":"coder@v1","prompt":"x"}"#
    );
    assert_eq!(
        health(&client, addr).await["policy"]["refused_too_large"],
        1
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(5))
        .await;
}

/// Likewise a request the memory budget cannot hold (with the copy routing makes):
/// while a version is followed it gets 503 with `Retry-After`, not the base model.
#[tokio::test]
async fn a_request_over_the_memory_budget_is_asked_to_retry_while_a_version_is_followed() {
    let upstream = Upstream::start(echo).await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.policy = Some("coder".into());
        raw.policy_alias = Some("policy".into());
        raw.policy_poll_secs = Some(0.1);
        raw.memory_budget_bytes = Some(1 << 20);
    })
    .await;
    let addr = sidecar.local_addr();
    let client = client();
    // 600 KB, held twice while routed: over the 1 MiB budget.
    let big = json!({"model": "policy", "prompt": "x".repeat(600_000)}).to_string();

    // Nothing announced: it passes whole, recorded without its request.
    let (status, _, _) = send(&client, post(addr, "/v1/completions", big.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(upstream.last().body, big.as_bytes());
    let forwarded = upstream.count();

    announce(&store, 1).await;
    wait_for_version(&client, addr, 1).await;
    let (status, headers, body) = send(&client, post(addr, "/v1/completions", big)).await;
    assert_eq!(status, 503);
    assert_eq!(headers["retry-after"], "1");
    let body = String::from_utf8_lossy(&body);
    assert!(
        body.contains("memory_budget_full")
            && body.contains("--memory-budget-bytes")
            && body.contains("coder@v1"),
        "{body}"
    );
    assert_eq!(upstream.count(), forwarded, "nothing went upstream");
    // One that fits still goes to the version.
    let small = r#"{"model":"policy","prompt":"x"}"#;
    let (status, _, _) = send(&client, post(addr, "/v1/completions", small)).await;
    assert_eq!(status, 200);
    assert_eq!(
        upstream.last().body.as_ref(),
        br#"{"model":"coder@v1","prompt":"x"}"#
    );
    let h = health(&client, addr).await;
    assert_eq!(h["memory_budget"]["cut_calls"], 1, "{h}");
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(5))
        .await;
    let calls = calls(&store, 2).await;
    let cut = calls
        .iter()
        .find(|c| c.request_truncated)
        .expect("the first call, recorded cut");
    assert!(cut.request_body.is_empty());
    assert!(
        cut.capture_warnings
            .iter()
            .any(|w| w.starts_with("memory_budget: request not captured")),
        "{:?}",
        cut.capture_warnings
    );
}
