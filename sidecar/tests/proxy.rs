//! The proxy against a scripted upstream: transparency, streaming, failures, capture,
//! token fidelity and the control API.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tapline_proto::{Api, Outcome, RecordKind};
use tapline_sidecar::config::UpstreamKind;
use tokio::sync::Notify;

const CHAT_JSON: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"m-1","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19}}"#;

/// A chat stream with text, two tool calls whose arguments arrive in fragments, and usage.
const CHAT_SSE: &str = concat!(
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Caf\u{e9} \"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"},\"finish_reason\":null}]}\r\n\r\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":\"}}]},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"call_2\",\"type\":\"function\",\"function\":{\"name\":\"g\",\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\" 1}\"}},{\"index\":1,\"function\":{\"arguments\":\"{}\"}}]},\"finish_reason\":null}]}\n\n",
    ": keep-alive comment\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":9,\"total_tokens\":14}}\n\n",
    "data: [DONE]\n\n",
);

fn chat_request(stream: bool) -> String {
    json!({"model": "m-1", "stream": stream, "messages": [{"role": "user", "content": "weather?"}]})
        .to_string()
}

#[tokio::test]
async fn non_streaming_calls_pass_through_and_are_recorded() {
    let upstream = Upstream::start(|_| {
        let mut s = Script::json(CHAT_JSON);
        s.headers.push(("x-request-id".into(), "req-9".into()));
        s.headers.push(("set-cookie".into(), "secret=1".into()));
        s
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |_| {}).await;
    let client = client();
    let mut req = post(
        sidecar.local_addr(),
        "/e/ep-1/v1/chat/completions?x=1",
        chat_request(false),
    );
    req.headers_mut()
        .insert("authorization", "Bearer sk-secret".parse().unwrap());
    req.headers_mut()
        .insert("x-tapline-task-id", "task-7".parse().unwrap());
    req.headers_mut()
        .insert("x-tapline-tag-variant", "b".parse().unwrap());
    let (status, headers, body) = send(&client, req).await;

    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, CHAT_JSON.as_bytes());
    assert_eq!(headers["x-request-id"], "req-9");
    assert_eq!(
        headers["set-cookie"], "secret=1",
        "the client still gets every header"
    );
    let span_id = headers["x-tapline-span-id"].to_str().unwrap().to_owned();

    let seen = upstream.last();
    assert_eq!(seen.path, "/v1/chat/completions?x=1");
    assert_eq!(
        seen.body,
        chat_request(false).as_bytes(),
        "the request body is forwarded unchanged"
    );
    assert_eq!(seen.headers["authorization"], "Bearer sk-secret");
    assert!(
        seen.headers
            .keys()
            .all(|k| !k.as_str().starts_with("x-tapline-"))
    );

    let call = calls(&store, 1).await.remove(0);
    assert_eq!(call.span_id, span_id);
    assert_eq!(call.episode_id, "ep-1");
    assert_eq!(call.task_id, "task-7");
    assert_eq!(call.tags["variant"], "b");
    assert_eq!(call.api(), Api::ChatCompletions);
    assert_eq!(call.outcome(), Outcome::Ok);
    assert_eq!(call.http_status, 200);
    assert_eq!(call.path, "/v1/chat/completions?x=1");
    assert!(!call.streamed);
    assert_eq!(call.request_body, chat_request(false).as_bytes());
    assert_eq!(call.response_body, CHAT_JSON.as_bytes());
    assert_eq!(call.request_model, "m-1");
    assert_eq!(call.response_model, "m-1");
    assert!(
        call.start_unix_nanos <= call.first_byte_unix_nanos
            && call.first_byte_unix_nanos <= call.end_unix_nanos
    );
    let completion = &call.completions[0];
    assert_eq!(completion.finish_reason, "tool_calls");
    assert_eq!(completion.tool_calls[0].name, "get_weather");
    assert_eq!(completion.tool_calls[0].arguments, r#"{"city":"Paris"}"#);
    assert_eq!(call.usage.unwrap().total_tokens, 19);
    assert!(!call.request_headers.contains_key("authorization"));
    assert!(!call.response_headers.contains_key("set-cookie"));
    assert_eq!(call.request_headers["content-type"], "application/json");
    assert_eq!(call.response_headers["x-request-id"], "req-9");
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn sse_split_at_every_byte_boundary_arrives_unchanged_and_rebuilds_the_same() {
    let stream = CHAT_SSE.as_bytes();
    let split = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let s2 = split.clone();
    let upstream = Upstream::start(move |_| {
        let at = s2.load(Ordering::SeqCst);
        Script::sse(vec![
            Bytes::from_static(&CHAT_SSE.as_bytes()[..at]),
            Bytes::from_static(&CHAT_SSE.as_bytes()[at..]),
        ])
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.segment_max_records = Some(10_000)
    })
    .await;
    let client = client();
    for at in 0..=stream.len() {
        split.store(at, Ordering::SeqCst);
        let (status, headers, body) = send(
            &client,
            post(
                sidecar.local_addr(),
                "/v1/chat/completions",
                chat_request(true),
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["content-type"], "text/event-stream; charset=utf-8");
        assert_eq!(body, stream, "split at {at}");
    }
    let calls = calls(&store, stream.len() + 1).await;
    let first = &calls[0];
    assert!(first.streamed);
    let c = &first.completions[0];
    assert_eq!(c.text, "Caf\u{e9} ok");
    assert_eq!(c.finish_reason, "tool_calls");
    assert_eq!(c.tool_calls.len(), 2);
    assert_eq!(
        (
            c.tool_calls[0].id.as_str(),
            c.tool_calls[0].name.as_str(),
            c.tool_calls[0].arguments.as_str()
        ),
        ("call_1", "f", "{\"a\": 1}")
    );
    assert_eq!(
        (
            c.tool_calls[1].name.as_str(),
            c.tool_calls[1].arguments.as_str()
        ),
        ("g", "{}")
    );
    assert_eq!(first.usage.unwrap().completion_tokens, 9);
    for call in &calls {
        assert_eq!(call.completions, first.completions);
        assert_eq!(call.response_body, stream);
        assert_eq!(call.outcome(), Outcome::Ok);
    }
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn stream_chunks_reach_the_client_before_the_upstream_sends_the_next() {
    let gate = Arc::new(Notify::new());
    let g2 = gate.clone();
    let upstream = Upstream::start(move |_| {
        let mut s = Script::sse(vec![
            Bytes::from_static(b"data: {\"a\":1}\n\n"),
            Bytes::from_static(b"data: [DONE]\n\n"),
        ]);
        s.gate = Some((1, g2.clone()));
        s
    })
    .await;
    let (sidecar, _store) = sidecar(&upstream.url(), |_| {}).await;
    let resp = client()
        .request(post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(true),
        ))
        .await
        .unwrap();
    let mut body = resp.into_body();
    // The second chunk is only sent after the first one reached us.
    let first = tokio::time::timeout(Duration::from_secs(5), next_chunk(&mut body))
        .await
        .expect("first chunk arrives before the stream ends");
    assert_eq!(first.unwrap(), Bytes::from_static(b"data: {\"a\":1}\n\n"));
    gate.notify_one();
    assert_eq!(
        next_chunk(&mut body).await.unwrap(),
        Bytes::from_static(b"data: [DONE]\n\n")
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn unreachable_upstream_gets_502_in_the_shape_of_the_api() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (sidecar, store) = sidecar(&format!("http://{closed}"), |_| {}).await;
    let client = client();
    let (status, headers, body) = send(
        &client,
        post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(false),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert!(headers.contains_key("x-tapline-span-id"));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "upstream_unreachable");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&closed.to_string())
    );

    let (status, _, body) = send(
        &client,
        post(
            sidecar.local_addr(),
            "/v1/messages",
            r#"{"model":"claude","messages":[]}"#,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "api_error");

    let calls = calls(&store, 2).await;
    assert!(
        calls
            .iter()
            .all(|c| c.outcome() == Outcome::UpstreamUnreachable && c.http_status == 502)
    );
    assert_eq!(calls[1].api(), Api::AnthropicMessages);
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn slow_upstream_gets_504_and_a_silent_stream_is_cut() {
    let upstream = Upstream::start(|r| {
        if r.path.contains("slow-head") {
            let mut s = Script::json(CHAT_JSON);
            s.head_delay = Duration::from_secs(3);
            s
        } else {
            let mut s = Script::sse(vec![
                Bytes::from_static(b"data: {\"a\":1}\n\n"),
                Bytes::from_static(b"data: [DONE]\n\n"),
            ]);
            s.gate = Some((1, Arc::new(Notify::new()))); // never released
            s
        }
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.response_timeout_secs = Some(0.3);
        raw.idle_timeout_secs = Some(0.3);
    })
    .await;
    let client = client();
    let (status, _, body) = send(
        &client,
        post(
            sidecar.local_addr(),
            "/slow-head/v1/chat/completions",
            chat_request(false),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap()["error"]["code"],
        "upstream_timeout"
    );

    let resp = client
        .request(post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(true),
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let result = resp.into_body().collect().await;
    assert!(
        result.is_err(),
        "a stream cut by the idle timeout is not a complete body"
    );

    let calls = calls(&store, 2).await;
    assert_eq!(calls[0].outcome(), Outcome::Timeout);
    assert_eq!(calls[0].http_status, 504);
    assert_eq!(calls[1].outcome(), Outcome::Timeout);
    assert_eq!(
        &calls[1].response_body[..],
        b"data: {\"a\":1}\n\n",
        "what arrived before the cut is kept"
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn an_error_mid_stream_is_passed_on_and_recorded() {
    let upstream = Upstream::start(|_| {
        let mut s = Script::sse(vec![Bytes::from_static(
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"par\"}}]}\n\n",
        )]);
        s.abort_after_chunks = true;
        s
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |_| {}).await;
    let resp = client()
        .request(post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(true),
        ))
        .await
        .unwrap();
    assert!(
        resp.into_body().collect().await.is_err(),
        "the client sees the broken stream"
    );
    let call = calls(&store, 1).await.remove(0);
    assert_eq!(call.outcome(), Outcome::UpstreamError);
    assert_eq!(call.completions[0].text, "par");
    assert!(
        call.error.contains("upstream body failed"),
        "{}",
        call.error
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_cancels_the_upstream_and_is_recorded() {
    let many: Vec<Bytes> = (0..200)
        .map(|i| {
            Bytes::from(format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}}}}]}}\n\n"
            ))
        })
        .collect();
    let upstream = Upstream::start(move |_| {
        let mut s = Script::sse(many.clone());
        s.chunk_delay = Duration::from_millis(10);
        s
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |_| {}).await;
    let resp = client()
        .request(post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(true),
        ))
        .await
        .unwrap();
    let mut body = resp.into_body();
    next_chunk(&mut body).await.unwrap();
    next_chunk(&mut body).await.unwrap();
    drop(body);
    let call = calls(&store, 1).await.remove(0);
    assert_eq!(call.outcome(), Outcome::ClientAborted);
    assert!(
        call.completions[0].text.starts_with("t0 t1 "),
        "{}",
        call.completions[0].text
    );
    assert!(!call.completions[0].text.contains("t199"));
    for _ in 0..100 {
        if upstream.cancelled.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        upstream.cancelled.load(Ordering::SeqCst),
        "the upstream request was cancelled"
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn bodies_over_the_capture_cap_pass_whole_and_are_recorded_as_prefixes() {
    let big_response = Bytes::from(vec![b'x'; 300_000]);
    let br = big_response.clone();
    let upstream = Upstream::start(move |_| Script::json(br.clone())).await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| raw.capture_cap_bytes = Some(1000)).await;
    let big_request = format!("{{\"model\":\"m\",\"pad\":\"{}\"}}", "y".repeat(200_000));
    let (status, _, body) = send(
        &client(),
        post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            big_request.clone(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, big_response);
    assert_eq!(upstream.last().body, big_request.as_bytes());
    let call = calls(&store, 1).await.remove(0);
    assert!(call.request_truncated && call.response_truncated);
    assert_eq!(call.request_body, &big_request.as_bytes()[..1000]);
    assert_eq!(call.response_body.len(), 1000);
    assert_eq!(call.request_body_size, big_request.len() as u64);
    assert_eq!(call.response_body_size, 300_000);
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

const VLLM_JSON: &str = r#"{"id":"chatcmpl-v","object":"chat.completion","created":1,"model":"qwen","choices":[{"index":0,"message":{"role":"assistant","content":"Hi!"},"logprobs":{"content":[{"token":"Hi","logprob":-0.5,"bytes":[72,105],"top_logprobs":[]},{"token":"!","logprob":-0.25,"bytes":[33],"top_logprobs":[]},{"token":"<|im_end|>","logprob":-0.125,"bytes":[],"top_logprobs":[]}]},"finish_reason":"stop","token_ids":[9707,0,151645]}],"usage":{"prompt_tokens":3,"total_tokens":6,"completion_tokens":3},"prompt_token_ids":[1,2,3]}"#;

const VLLM_SSE: &str = concat!(
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"qwen\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}],\"prompt_token_ids\":[1,2,3]}\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"qwen\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"logprobs\":{\"content\":[{\"token\":\"Hi\",\"logprob\":-0.5,\"bytes\":[72,105],\"top_logprobs\":[]}]},\"finish_reason\":null,\"token_ids\":[9707]}]}\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"qwen\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"},\"logprobs\":{\"content\":[{\"token\":\"!\",\"logprob\":-0.25,\"bytes\":[33],\"top_logprobs\":[]}]},\"finish_reason\":\"stop\",\"token_ids\":[0]}]}\n\n",
    "data: [DONE]\n\n",
);

#[tokio::test]
async fn vllm_upstreams_return_token_ids_that_the_client_never_sees() {
    let upstream = Upstream::start(|r| {
        let req: Value = serde_json::from_slice(&r.body).unwrap();
        if req["stream"] == true {
            Script::sse(vec![Bytes::from_static(VLLM_SSE.as_bytes())])
        } else {
            Script::json(VLLM_JSON)
        }
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.upstream_kind = Some(UpstreamKind::Vllm)
    })
    .await;
    let client = client();

    let (status, headers, body) = send(
        &client,
        post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(false),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let sent: Value = serde_json::from_slice(&upstream.last().body).unwrap();
    assert_eq!(
        (sent["return_token_ids"].clone(), sent["logprobs"].clone()),
        (json!(true), json!(true))
    );
    let got: Value = serde_json::from_slice(&body).unwrap();
    // As vLLM 0.32 answers a call without the flag: the id keys present, as null.
    assert_eq!(got.get("prompt_token_ids"), Some(&Value::Null));
    assert_eq!(got["choices"][0].get("token_ids"), Some(&Value::Null));
    assert_eq!(got["choices"][0]["logprobs"], Value::Null);
    assert_eq!(got["choices"][0]["message"]["content"], "Hi!");
    assert_eq!(
        headers
            .get("content-length")
            .map(|v| v.to_str().unwrap().parse::<usize>().unwrap()),
        Some(body.len())
    );

    let (_, _, body) = send(
        &client,
        post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(true),
        ),
    )
    .await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(!text.contains("token_ids\":["), "{text}");
    assert!(text.contains("\"prompt_token_ids\":null"), "{text}");
    assert!(!text.contains("logprob\""), "{text}");
    assert!(text.contains("\"content\":\"Hi\"") && text.ends_with("data: [DONE]\n\n"));

    // A harness that asked for logprobs itself keeps them.
    let own = json!({"model": "m", "messages": [], "logprobs": true}).to_string();
    let (_, _, body) = send(
        &client,
        post(sidecar.local_addr(), "/v1/chat/completions", own),
    )
    .await;
    let got: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(got["choices"][0]["logprobs"]["content"][0]["logprob"], -0.5);
    assert!(got["choices"][0]["token_ids"].is_null());

    let calls = calls(&store, 3).await;
    for call in &calls[..2] {
        assert!(call.token_fields_injected);
        assert_eq!(call.prompt_token_ids, [1, 2, 3]);
        assert_eq!(call.completions[0].text, "Hi!");
        assert_eq!(
            call.request_body,
            chat_request(call.streamed).as_bytes(),
            "the record keeps the client's own request"
        );
    }
    assert_eq!(calls[0].completions[0].token_ids, [9707, 0, 151645]);
    assert_eq!(calls[0].completions[0].logprobs, [-0.5, -0.25, -0.125]);
    assert_eq!(calls[1].completions[0].token_ids, [9707, 0]);
    assert_eq!(calls[1].completions[0].logprobs, [-0.5, -0.25]);
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn a_json_answer_too_large_to_rewrite_passes_unchanged_and_is_flagged() {
    // An answer with its content padded to `pad` bytes.
    let padded = |pad: usize| {
        VLLM_JSON.replace(
            "\"content\":\"Hi!\"",
            &format!("\"content\":\"Hi!{}\"", " ".repeat(pad)),
        )
    };
    let upstream = Upstream::start(move |r| {
        let req: Value = serde_json::from_slice(&r.body).unwrap();
        let body = padded(req["pad"].as_u64().unwrap() as usize);
        let mut script = Script::json(body.clone());
        script
            .headers
            .push(("content-length".into(), body.len().to_string()));
        script
    })
    .await;
    // A 200 KiB cap and a 1 MiB budget: an answer rewritten with token fidelity may hold
    // ten times its length.
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.upstream_kind = Some(UpstreamKind::Vllm);
        raw.capture_cap_bytes = Some(200 << 10);
        raw.memory_budget_bytes = Some(1 << 20);
    })
    .await;
    let client = client();
    let mut answers = Vec::new();
    for pad in [300_000, 120_000, 10] {
        let request = json!({"model": "m", "pad": pad, "messages": []}).to_string();
        let (status, headers, body) = send(
            &client,
            post(sidecar.local_addr(), "/v1/chat/completions", request),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            headers["content-length"].to_str().unwrap(),
            body.len().to_string()
        );
        answers.push(body);
    }
    // Over the cap, and over what the budget holds for a rewrite: byte for byte the
    // upstream's, with the fields the harness did not ask for.
    assert_eq!(answers[0], padded(300_000).as_bytes());
    assert_eq!(answers[1], padded(120_000).as_bytes());
    // A small one is rewritten as always.
    let small: Value = serde_json::from_slice(&answers[2]).unwrap();
    assert!(small["prompt_token_ids"].is_null());
    assert_eq!(small["choices"][0]["logprobs"], Value::Null);

    let calls = calls(&store, 3).await;
    let by_size = |n: usize| {
        calls
            .iter()
            .find(|c| c.response_body_size == n as u64)
            .unwrap_or_else(|| panic!("no call answered with {n} bytes"))
    };
    let not_rewritten = |c: &tapline_proto::LlmCall| {
        c.capture_warnings
            .iter()
            .filter(|w| w.starts_with("response_not_rewritten: "))
            .cloned()
            .collect::<Vec<_>>()
    };
    let big = by_size(padded(300_000).len());
    assert!(big.response_truncated);
    assert_eq!(big.response_body.len(), 200 << 10);
    let w = not_rewritten(big);
    assert!(
        w.len() == 1 && w[0].contains("capture cap (204800 bytes)"),
        "{w:?}"
    );
    assert!(w[0].contains("token ids and log-probs"), "{w:?}");

    let mid = by_size(padded(120_000).len());
    assert!(!mid.response_truncated);
    assert_eq!(mid.response_body, padded(120_000).as_bytes());
    let w = not_rewritten(mid);
    assert!(
        w.len() == 1 && w[0].contains("memory budget (1048576 bytes)"),
        "{w:?}"
    );
    // Captured whole, it is rebuilt with the ids as any other.
    assert_eq!(mid.completions[0].token_ids, [9707, 0, 151645]);

    let small = by_size(padded(10).len());
    assert!(
        not_rewritten(small).is_empty(),
        "{:?}",
        small.capture_warnings
    );
    assert_eq!(small.completions[0].token_ids, [9707, 0, 151645]);
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn a_compressed_answer_is_asked_for_plain_and_decoded_when_it_comes_anyway() {
    use std::io::Write as _;
    let gzip = |text: &str| {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(text.as_bytes()).unwrap();
        Bytes::from(gz.finish().unwrap())
    };
    // An upstream that compresses whatever the request says.
    let (json, sse) = (gzip(VLLM_JSON), gzip(VLLM_SSE));
    let upstream = Upstream::start(move |r| {
        let req: Value = serde_json::from_slice(&r.body).unwrap();
        let mut script = if req["stream"] == true {
            Script::sse(vec![sse.clone()])
        } else {
            Script::json(json.clone())
        };
        script
            .headers
            .push(("content-encoding".into(), "gzip".into()));
        script
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.upstream_kind = Some(UpstreamKind::Vllm)
    })
    .await;
    let client = client();
    let mut request = post(
        sidecar.local_addr(),
        "/v1/chat/completions",
        chat_request(false),
    );
    request
        .headers_mut()
        .insert("accept-encoding", "gzip".parse().unwrap());
    let (status, headers, body) = send(&client, request).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        !upstream.last().headers.contains_key("accept-encoding"),
        "the answer is asked for plain"
    );
    // Compressed anyway: decoded, rewritten, sent plain.
    assert!(!headers.contains_key("content-encoding"), "{headers:?}");
    let got: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(got["prompt_token_ids"], Value::Null);
    assert_eq!(got["choices"][0]["token_ids"], Value::Null);
    assert_eq!(got["choices"][0]["logprobs"], Value::Null);
    assert_eq!(got["choices"][0]["message"]["content"], "Hi!");

    // A compressed stream cannot be rewritten event by event: it goes as it came, said.
    let (status, headers, body) = send(
        &client,
        post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(true),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-encoding"], "gzip");
    assert_eq!(body, gzip(VLLM_SSE));

    let calls = calls(&store, 2).await;
    for call in &calls {
        // Both are recorded with vLLM's ids, from the compressed bytes.
        assert_eq!(call.prompt_token_ids, [1, 2, 3], "{call:?}");
        let warned = call
            .capture_warnings
            .iter()
            .any(|w| w.starts_with("response_not_rewritten: the event stream"));
        assert_eq!(warned, call.streamed, "{:?}", call.capture_warnings);
    }
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn a_client_gone_while_its_answer_is_read_for_rewriting_is_recorded_aborted() {
    // The answer's second half comes a second later; the client gives up before.
    let (head, tail) = VLLM_JSON.split_at(VLLM_JSON.len() / 2);
    let (head, tail) = (Bytes::from(head.to_owned()), Bytes::from(tail.to_owned()));
    let upstream = Upstream::start(move |_| Script {
        chunks: vec![head.clone(), tail.clone()],
        chunk_delay: Duration::from_secs(1),
        ..Script::json(Bytes::new())
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.upstream_kind = Some(UpstreamKind::Vllm)
    })
    .await;
    let request = post(
        sidecar.local_addr(),
        "/v1/chat/completions",
        chat_request(false),
    );
    let gave_up = tokio::time::timeout(Duration::from_millis(300), client().request(request)).await;
    assert!(gave_up.is_err(), "the answer cannot have come yet");
    let calls = calls(&store, 1).await;
    assert_eq!(calls[0].outcome(), Outcome::ClientAborted, "{:?}", calls[0]);
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

#[tokio::test]
async fn openai_upstreams_get_nothing_injected() {
    let upstream = Upstream::start(|_| Script::json(CHAT_JSON)).await;
    let (sidecar, store) = sidecar(&upstream.url(), |_| {}).await;
    send(
        &client(),
        post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(false),
        ),
    )
    .await;
    assert_eq!(upstream.last().body, chat_request(false).as_bytes());
    assert!(!calls(&store, 1).await[0].token_fields_injected);
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

async fn control(
    client: &TestClient,
    addr: std::net::SocketAddr,
    path: &str,
    body: Value,
    token: Option<&str>,
) -> (StatusCode, Value) {
    let mut req = post(addr, path, body.to_string());
    if let Some(t) = token {
        req.headers_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let (status, _, body) = send(client, req).await;
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[tokio::test]
async fn control_api_episodes_rewards_binding_and_errors() {
    let upstream = Upstream::start(|_| Script::json(CHAT_JSON)).await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.control_token = Some("tok".into())
    })
    .await;
    let addr = sidecar.local_addr();
    let client = client();

    let (status, v) = control(
        &client,
        addr,
        "/tapline/v1/episodes",
        json!({"task_id": "t"}),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("control token")
    );

    let (status, ep) = control(
        &client,
        addr,
        "/tapline/v1/episodes",
        json!({"task_id": "t", "group_id": "g", "metadata": {"seed": 3, "note": "x"}, "bind": true}),
        Some("tok"),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{ep}");
    let id = ep["episode_id"].as_str().unwrap().to_owned();
    assert_eq!(ep["base_url"], format!("http://{addr}/e/{id}/v1"));

    // An unmodified harness (no prefix, no headers) is attributed to the bound episode.
    let (_, headers, _) = send(
        &client,
        post(addr, "/v1/chat/completions", chat_request(false)),
    )
    .await;
    let span = headers["x-tapline-span-id"].to_str().unwrap().to_owned();

    for (body, code) in [
        (json!({"value": "NaN"}), "invalid_value"),
        (json!({}), "invalid_value"),
        (json!({"value": 1, "bogus": 2}), "invalid_json"),
        (json!({"value": 1, "span_id": "a/b"}), "invalid_span_id"),
    ] {
        let (status, v) = control(
            &client,
            addr,
            &format!("/tapline/v1/episodes/{id}/rewards"),
            body,
            Some("tok"),
        )
        .await;
        assert_eq!(
            (status, v["error"]["code"].as_str().unwrap()),
            (StatusCode::BAD_REQUEST, code),
            "{v}"
        );
    }
    let (status, _) = control(
        &client,
        addr,
        &format!("/tapline/v1/episodes/{id}/rewards"),
        json!({"value": 0.75}),
        Some("tok"),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _) = control(
        &client,
        addr,
        &format!("/tapline/v1/episodes/{id}/rewards"),
        json!({"value": 1, "name": "format_ok", "span_id": span}),
        Some("tok"),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, v) = control(
        &client,
        addr,
        &format!("/tapline/v1/episodes/{id}/end"),
        json!({"status": "finished"}),
        Some("tok"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("succeeded")
    );
    let (status, v) = control(
        &client,
        addr,
        &format!("/tapline/v1/episodes/{id}/end"),
        json!({"status": "succeeded"}),
        Some("tok"),
    )
    .await;
    assert_eq!((status, v["calls"].as_u64()), (StatusCode::OK, Some(1)));

    // Ended and unknown episodes take no reward and no end, and nothing is written.
    for (path, body, expected, code) in [
        (
            "end",
            json!({"status": "failed"}),
            StatusCode::CONFLICT,
            "episode_ended",
        ),
        (
            "rewards",
            json!({"value": 1}),
            StatusCode::CONFLICT,
            "episode_ended",
        ),
        (
            "end",
            json!({"status": "failed"}),
            StatusCode::NOT_FOUND,
            "unknown_episode",
        ),
        (
            "rewards",
            json!({"value": 1}),
            StatusCode::NOT_FOUND,
            "unknown_episode",
        ),
    ] {
        let episode = if expected == StatusCode::CONFLICT {
            id.as_str()
        } else {
            "never-created"
        };
        let (status, v) = control(
            &client,
            addr,
            &format!("/tapline/v1/episodes/{episode}/{path}"),
            body,
            Some("tok"),
        )
        .await;
        assert_eq!(
            (status, v["error"]["code"].as_str().unwrap_or_default()),
            (expected, code),
            "{path} of {episode}: {v}"
        );
        assert!(
            v["error"]["message"].as_str().unwrap().contains(episode),
            "{v}"
        );
    }

    let (status, _, body) = send(
        &client,
        http::Request::get(format!("http://{addr}/tapline/v1/health"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap()["status"],
        "ok"
    );
    let (_, _, metrics) = send(
        &client,
        http::Request::get(format!("http://{addr}/metrics"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    assert!(
        metrics.contains("tapline_requests_total{api=\"chat_completions\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tapline_added_latency_seconds_count 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tapline_control_errors_total 10"),
        "{metrics}"
    );

    // After the end, the binding is gone.
    send(
        &client,
        post(addr, "/v1/chat/completions", chat_request(false)),
    )
    .await;
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(2))
        .await;

    let records = records(&store).await;
    let mut kinds = Vec::new();
    for r in &records {
        match r.kind.as_ref().unwrap() {
            RecordKind::EpisodeEvent(e) => kinds.push(format!(
                "event:{}:{}",
                e.kind().as_str_name(),
                e.metadata.get("seed").cloned().unwrap_or_default()
            )),
            RecordKind::Reward(rw) => kinds.push(format!(
                "reward:{}:{}:{}",
                rw.name,
                rw.value,
                rw.span_id == span
            )),
            RecordKind::LlmCall(c) => kinds.push(format!("call:{}", c.episode_id == id)),
        }
    }
    assert_eq!(
        kinds,
        [
            "event:EPISODE_EVENT_KIND_START:3",
            "call:true",
            "reward::0.75:false",
            "reward:format_ok:1:true",
            "event:EPISODE_EVENT_KIND_END:",
            "call:false",
        ]
    );
}

/// hyper drops a response body without a last poll once a known length was sent; the
/// call still counts as complete (regression: such calls were recorded as aborted).
#[tokio::test]
async fn responses_with_a_content_length_are_recorded_ok() {
    let upstream = Upstream::start(|r| {
        let body: &'static str = if r.path.contains("empty") {
            ""
        } else {
            CHAT_JSON
        };
        let mut s = Script::json(body);
        s.headers
            .push(("content-length".into(), body.len().to_string()));
        if body.is_empty() {
            s.chunks.clear();
        }
        s
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |_| {}).await;
    let client = client();
    let (status, headers, body) = send(
        &client,
        post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(false),
        ),
    )
    .await;
    assert_eq!(
        (status, body.as_ref()),
        (StatusCode::OK, CHAT_JSON.as_bytes())
    );
    assert_eq!(headers["content-length"], CHAT_JSON.len().to_string());
    let (_, _, body) = send(
        &client,
        post(
            sidecar.local_addr(),
            "/empty/v1/chat/completions",
            chat_request(false),
        ),
    )
    .await;
    assert!(body.is_empty());
    let calls = calls(&store, 2).await;
    assert!(
        calls.iter().all(|c| c.outcome() == Outcome::Ok),
        "{:?}",
        calls
            .iter()
            .map(|c| (c.outcome(), &c.error))
            .collect::<Vec<_>>()
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

/// The openai SDK closes a stream at `data: [DONE]` without waiting for the end of the
/// body; the call is complete and its record is spooled before `[DONE]` is sent.
#[tokio::test]
async fn a_client_that_closes_right_after_the_last_event_is_recorded_ok() {
    let gate = Arc::new(Notify::new());
    let g2 = gate.clone();
    let upstream = Upstream::start(move |_| {
        let mut s = Script::sse(vec![
            Bytes::from_static(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"done\"}}]}\n\ndata: [DONE]\n\n"),
            Bytes::from_static(b"\n"),
        ]);
        s.gate = Some((1, g2.clone())); // the end of the body never comes while the client listens
        s
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |_| {}).await;
    let resp = client()
        .request(post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(true),
        ))
        .await
        .unwrap();
    let mut body = resp.into_body();
    let chunk = next_chunk(&mut body).await.unwrap();
    assert!(chunk.ends_with(b"data: [DONE]\n\n"));
    // The record is in the spool by the time [DONE] arrived: count what the spool holds.
    let spooled = sidecar
        .state()
        .metrics
        .records_spooled
        .load(Ordering::SeqCst);
    assert_eq!(
        spooled, 1,
        "the record reached the spool before the last event was sent"
    );
    drop(body);
    gate.notify_one();
    let call = calls(&store, 1).await.remove(0);
    assert_eq!(call.outcome(), Outcome::Ok, "{}", call.error);
    assert_eq!(call.completions[0].text, "done");
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

/// Regression: the end of a stream was found by searching its bytes for `data: [DONE]`,
/// so an answer whose text contained those words (verbatim in the JSON of a `data` line)
/// was taken as complete at that event: the record stopped there, with a partial
/// completion. The end is now the `[DONE]` event itself.
#[tokio::test]
async fn an_answer_that_quotes_the_last_event_is_recorded_whole() {
    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a stream ends with data: [DONE]\"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\", then a blank line\"},\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    );
    let (first, rest) = STREAM.split_at(STREAM.find("\n\n").unwrap() + 2);
    let upstream = Upstream::start(move |_| {
        Script::sse(vec![
            Bytes::from_static(first.as_bytes()),
            Bytes::from_static(rest.as_bytes()),
        ])
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |_| {}).await;
    let (status, _, body) = send(
        &client(),
        post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            chat_request(true),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, STREAM.as_bytes());
    let call = calls(&store, 1).await.remove(0);
    assert_eq!(call.response_body, STREAM.as_bytes());
    assert_eq!(
        call.completions[0].text,
        "a stream ends with data: [DONE], then a blank line"
    );
    assert!(
        call.capture_warnings.is_empty(),
        "{:?}",
        call.capture_warnings
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

/// Regression: an upstream that framed its answer with both `Transfer-Encoding: chunked`
/// and a (wrong) `Content-Length` reached the client with that length and only that many
/// bytes, while the record held the whole body. RFC 9112 §6.3: the transfer coding wins
/// and an intermediary removes `Content-Length`.
#[tokio::test]
async fn a_response_with_transfer_encoding_and_content_length_arrives_whole() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let body = r#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"whole answer"},"finish_reason":"stop"}]}"#;
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let body = body.to_owned();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut head = Vec::new();
                // Read the request head and its (small, content-length framed) body.
                loop {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    head.extend_from_slice(&buf[..n]);
                    if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                        let text = String::from_utf8_lossy(&head[..end]).to_lowercase();
                        let len: usize = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        if head.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let (first, rest) = body.split_at(10);
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\ncontent-length: 10\r\n\r\n{:x}\r\n{first}\r\n{:x}\r\n{rest}\r\n0\r\n\r\n",
                    first.len(),
                    rest.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    let (sidecar, store) = common::sidecar(&upstream, |_| {}).await;
    let (status, headers, got) = common::send(
        &common::client(),
        common::post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        ),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(got, body.as_bytes(), "the client got a cut body");
    assert!(
        headers
            .get("content-length")
            .is_none_or(|v| v.to_str().unwrap() == body.len().to_string()),
        "{headers:?}"
    );
    let calls = common::calls(&store, 1).await;
    assert_eq!(calls[0].response_body, body.as_bytes());
    assert_eq!(calls[0].completions[0].text, "whole answer");
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

/// Regression: ids from `x-tapline-episode-id` were recorded verbatim (10 KB long,
/// `../../etc/passwd`, `a/b`), `.` and `..` were accepted in the path and the control
/// API, and a non-ASCII `x-tapline-task-id` was recorded as an empty string. One rule
/// now holds for the path, the header and the control API.
#[tokio::test]
async fn episode_ids_follow_one_rule_in_path_header_and_control_api() {
    let upstream = Upstream::start(|_| Script::json(CHAT_JSON)).await;
    let (sidecar, store) = sidecar(&upstream.url(), |_| {}).await;
    let addr = sidecar.local_addr();
    let client = client();
    let long = "x".repeat(10_000);
    for bad in ["../../etc/passwd", "a/b", "..", ".", "a b", long.as_str()] {
        let mut req = post(addr, "/v1/chat/completions", chat_request(false));
        req.headers_mut().insert(
            "x-tapline-episode-id",
            http::HeaderValue::from_str(bad).unwrap(),
        );
        let (status, _, body) = send(&client, req).await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert_eq!(v["error"]["code"], "invalid_episode_id", "{bad}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("x-tapline-episode-id") && message.len() < 400,
            "{message}"
        );
    }
    for path in ["/e/../v1/chat/completions", "/e/./v1/chat/completions"] {
        let (status, _, body) = send(&client, post(addr, path, chat_request(false))).await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "{path}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    for bad in ["..", ".", "a/b"] {
        let (status, v) = control(
            &client,
            addr,
            "/tapline/v1/episodes",
            json!({"task_id": "t", "episode_id": bad}),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert_eq!(v["error"]["code"], "invalid_episode_id", "{bad}: {v}");
    }
    // A valid id with a non-ASCII task id is recorded as sent.
    let mut req = post(addr, "/v1/chat/completions", chat_request(false));
    req.headers_mut()
        .insert("x-tapline-episode-id", "ep-1.v2".parse().unwrap());
    req.headers_mut().insert(
        "x-tapline-task-id",
        http::HeaderValue::from_bytes("tâche-ü".as_bytes()).unwrap(),
    );
    let (status, _, _) = send(&client, req).await;
    assert_eq!(status, StatusCode::OK);
    let calls = calls(&store, 1).await;
    assert_eq!(calls.len(), 1, "only the valid call reached the store");
    assert_eq!(calls[0].episode_id, "ep-1.v2");
    assert_eq!(calls[0].task_id, "tâche-ü");
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}

/// `--memory-budget-bytes`: calls over what the others leave of the budget are proxied
/// unchanged and recorded cut and flagged; the budget is given back once records are
/// spooled.
#[tokio::test]
async fn calls_over_the_memory_budget_pass_unchanged_and_are_recorded_cut() {
    let gate = Arc::new(Notify::new());
    let event = |i: usize| {
        Bytes::from(format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}},\"finish_reason\":null}}]}}\n\n",
            char::from(b'a' + (i % 26) as u8)
                .to_string()
                .repeat(64 << 10)
        ))
    };
    // 24 events of 64 KiB: 1.5 MiB, more than the whole budget.
    let stream: Vec<Bytes> = (0..24).map(event).collect();
    let whole: Bytes = stream.concat().into();
    let g = gate.clone();
    let s = stream.clone();
    let upstream = Upstream::start(move |r| {
        if r.body.starts_with(b"{\"model\":\"m\",\"held\"") {
            Script {
                gate: Some((1, g.clone())),
                ..Script::sse(s.clone())
            }
        } else if r.body.starts_with(b"{\"model\":\"m\",\"stream\"") {
            Script::sse(s.clone())
        } else {
            Script::json(CHAT_JSON)
        }
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.memory_budget_bytes = Some(1 << 20);
    })
    .await;
    let addr = sidecar.local_addr();
    let request = |kind: &str, pad: usize| {
        format!(
            "{{\"model\":\"m\",\"{kind}\":true,\"pad\":\"{}\",\"messages\":[]}}",
            "p".repeat(pad)
        )
    };

    // One call holds 600 KB of the 1 MiB budget while its answer waits at the gate...
    let held_request = request("held", 600_000);
    let c = client();
    let first = tokio::spawn({
        let held_request = held_request.clone();
        async move { send(&c, post(addr, "/v1/chat/completions", held_request)).await }
    });
    while upstream.count() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...so a second one of 600 KB does not fit: forwarded whole, not captured.
    let cut_request = request("cut", 600_000);
    let (status, _, body) = send(
        &client(),
        post(addr, "/v1/chat/completions", cut_request.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, CHAT_JSON.as_bytes());
    assert_eq!(upstream.last().body, cut_request.as_bytes());
    gate.notify_one();
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, whole, "the first call's answer arrives unchanged");
    // Their segment built: the builder, which waits for the budget and is served before
    // calls, holds nothing now.
    calls(&store, 2).await;

    // A 1.5 MiB answer: captured up to what the budget holds, then cut.
    let (status, _, body) = send(
        &client(),
        post(addr, "/v1/chat/completions", request("stream", 10)),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, whole);
    calls(&store, 3).await;
    // With the others spooled the budget is free again: a normal call is whole.
    let (status, _, _) = send(
        &client(),
        post(addr, "/v1/chat/completions", request("normal", 11)),
    )
    .await;
    assert_eq!(status, StatusCode::OK);

    let calls = calls(&store, 4).await;
    // Each call is known by its request's length.
    let find = |request: &str| {
        calls
            .iter()
            .find(|c| c.request_body_size == request.len() as u64)
            .unwrap_or_else(|| panic!("no call of {} bytes in {calls:?}", request.len()))
    };
    let budget_warnings = |c: &tapline_proto::LlmCall| {
        c.capture_warnings
            .iter()
            .filter(|w| w.starts_with("memory_budget: "))
            .cloned()
            .collect::<Vec<_>>()
    };
    let held = find(&held_request);
    assert_eq!(held.request_body, held_request.as_bytes());
    assert!(!held.request_truncated);
    // Its answer did not fit beside its own request: cut, flagged, the prefix kept.
    assert!(held.response_truncated);
    assert_eq!(held.response_body_size, whole.len() as u64);
    assert!(!held.response_body.is_empty() && whole.starts_with(&held.response_body));
    assert_eq!(
        budget_warnings(held).len(),
        1,
        "{:?}",
        held.capture_warnings
    );

    let cut = find(&cut_request);
    assert!(cut.request_truncated && cut.request_body.is_empty());
    assert_eq!(cut.request_body_size, cut_request.len() as u64);
    assert_eq!(
        cut.response_body,
        CHAT_JSON.as_bytes(),
        "its small answer still fitted"
    );
    assert_eq!(cut.outcome(), Outcome::Ok);
    let w = budget_warnings(cut);
    assert!(
        w.len() == 1 && w[0].contains("request not captured"),
        "{w:?}"
    );

    let streamed = find(&request("stream", 10));
    assert!(streamed.response_truncated);
    assert!(streamed.response_body.len() <= 1 << 20 && streamed.response_body.len() >= 512 << 10);
    assert!(whole.starts_with(&streamed.response_body));
    let w = budget_warnings(streamed);
    assert!(
        w.len() == 1 && w[0].contains("response capture cut at"),
        "{w:?}"
    );
    // The rebuilt completion is the prefix's text.
    assert!(streamed.completions[0].text.len() >= 7 * (64 << 10));

    let normal = find(&request("normal", 11));
    assert!(
        budget_warnings(normal).is_empty(),
        "{:?}",
        normal.capture_warnings
    );
    assert!(!normal.request_truncated && !normal.response_truncated);

    let get = |path: &str| {
        http::Request::get(format!("http://{addr}{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let health: Value =
        serde_json::from_slice(&send(&client(), get("/tapline/v1/health")).await.2).unwrap();
    assert_eq!(health["memory_budget"]["limit_bytes"], 1 << 20);
    assert_eq!(health["memory_budget"]["cut_calls"], 3, "{health}");
    assert_eq!(health["memory_budget"]["used_bytes"], 0, "{health}");
    let metrics = String::from_utf8(send(&client(), get("/metrics")).await.2.to_vec()).unwrap();
    assert!(
        metrics.contains("tapline_memory_budget_cuts_total 3"),
        "{metrics}"
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(1))
        .await;
}
