//! The SDK against the real `tapline-sidecar` binary in front of a local fake upstream.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tapline_proto::segment::{Limits, decode_segment};
use tapline_proto::{EndStatus as WireEnd, EpisodeEventKind, Record, RecordKind};
use tapline_sdk::{Client, EndStatus, EpisodeOptions, Error, Reward};

const CHAT: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#;

fn sidecar_binary() -> PathBuf {
    if let Ok(path) = std::env::var("TAPLINE_SIDECAR_BIN") {
        return PathBuf::from(path);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let path = root.join("target/debug/tapline-sidecar");
    if !path.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "tapline-sidecar", "--bin", "tapline-sidecar"])
            .current_dir(root)
            .status()
            .expect("cargo build");
        assert!(status.success(), "building the sidecar failed");
    }
    path
}

async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req| async {
                    Ok::<_, Infallible>(
                        hyper::Response::builder()
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(CHAT.as_bytes())))
                            .unwrap(),
                    )
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

struct Sidecar {
    child: Child,
    url: String,
    dir: tempfile::TempDir,
}

impl Sidecar {
    async fn start(upstream: SocketAddr, token: Option<&str>) -> Sidecar {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut cmd = Command::new(sidecar_binary());
        cmd.args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--upstream",
            &format!("http://{upstream}"),
        ])
        .arg("--store")
        .arg(dir.path().join("store"))
        .arg("--spool-dir")
        .arg(dir.path().join("spool"))
        .args(["--sidecar-id", "sdk-test", "--segment-max-age-secs", "0.1"])
        .env("TAPLINE_LOG", "warn")
        .stdout(Stdio::null());
        if let Some(token) = token {
            cmd.args(["--control-token", token]);
        }
        #[allow(clippy::zombie_processes, reason = "stop() or Drop waits for it")]
        let child = cmd.spawn().unwrap();
        let url = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        for _ in 0..400 {
            if http
                .get(format!("{url}/tapline/v1/health"))
                .send()
                .await
                .is_ok()
            {
                return Sidecar { child, url, dir };
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("sidecar did not start");
    }

    /// SIGTERM, wait (the sidecar flushes its records), then read the store.
    fn stop_and_read(mut self) -> Vec<Record> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let exit = self.child.wait().unwrap();
        assert!(exit.success(), "sidecar exited with {exit}");
        let mut files = Vec::new();
        let mut stack = vec![self.dir.path().join("store")];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "tlseg") {
                    files.push(path);
                }
            }
        }
        files.sort();
        files
            .iter()
            .flat_map(|f| decode_segment(&std::fs::read(f).unwrap(), Limits::default()).unwrap())
            .collect()
    }

    async fn control_requests(&self) -> u64 {
        let text = reqwest::get(format!("{}/metrics", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("tapline_control_requests_total "))
            .and_then(|v| v.parse().ok())
            .unwrap()
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn chat(base_url: &str) -> String {
    let resp = reqwest::Client::new()
        .post(format!("{base_url}/chat/completions"))
        .body(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    resp.headers()["x-tapline-span-id"]
        .to_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn an_episode_with_calls_and_rewards_produces_exactly_its_records() {
    let sidecar = Sidecar::start(upstream().await, None).await;
    let client = Client::new(&sidecar.url).unwrap();
    let mut metadata = std::collections::BTreeMap::new();
    metadata.insert("attempt".to_owned(), serde_json::json!(2));
    let episode = client
        .start_episode(
            "task-9",
            EpisodeOptions {
                group_id: Some("g-1".into()),
                metadata,
                bind: false,
            },
        )
        .await
        .unwrap();
    let id = episode.id().unwrap().to_owned();
    assert_eq!(episode.base_url(), format!("{}/e/{id}/v1", sidecar.url));
    assert_eq!(
        episode.anthropic_base_url(),
        format!("{}/e/{id}", sidecar.url)
    );
    let mut spans = Vec::new();
    for _ in 0..3 {
        spans.push(chat(episode.base_url()).await);
    }
    episode.reward_call(&spans[1], 0.25).await.unwrap();
    episode.reward_component("tests_passed", 0.5).await.unwrap();
    episode
        .reward_with(Reward {
            value: 1.0,
            tags: [("judge".to_owned(), "v2".to_owned())].into(),
            ..Default::default()
        })
        .await
        .unwrap();
    episode.end(EndStatus::Succeeded).await.unwrap();
    assert!(matches!(
        episode.end(EndStatus::Failed).await,
        Err(Error::InvalidArgument(_))
    ));

    let records = sidecar.stop_and_read();
    let mut summary = Vec::new();
    for r in &records {
        assert_eq!(r.episode_id(), Some(id.as_str()), "{r:?}");
        summary.push(match r.kind.as_ref().unwrap() {
            RecordKind::EpisodeEvent(e) if e.kind() == EpisodeEventKind::Start => {
                format!(
                    "start {} {} attempt={}",
                    e.task_id, e.group_id, e.metadata["attempt"]
                )
            }
            RecordKind::EpisodeEvent(e) => format!("end {:?} {}", e.status(), e.task_id),
            RecordKind::LlmCall(c) => format!("call {} {} {}", c.seq, c.task_id, c.group_id),
            RecordKind::Reward(w) => format!(
                "reward {:?} {} {}",
                w.name,
                w.value,
                if w.span_id.is_empty() {
                    "-"
                } else if w.span_id == spans[1] {
                    "span1"
                } else {
                    "?"
                }
            ),
        });
    }
    assert_eq!(
        summary,
        [
            "start task-9 g-1 attempt=2",
            "call 0 task-9 g-1",
            "call 1 task-9 g-1",
            "call 2 task-9 g-1",
            "reward \"\" 0.25 span1",
            "reward \"tests_passed\" 0.5 -",
            "reward \"\" 1 -",
            &format!("end {:?} task-9", WireEnd::Succeeded),
        ]
    );
}

#[tokio::test]
async fn a_bound_episode_gets_calls_made_with_the_plain_base_url() {
    let sidecar = Sidecar::start(upstream().await, None).await;
    let client = Client::new(&sidecar.url).unwrap();
    let episode = client
        .start_episode(
            "t",
            EpisodeOptions {
                bind: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    chat(&format!("{}/v1", sidecar.url)).await;
    episode.end(EndStatus::Failed).await.unwrap();
    chat(&format!("{}/v1", sidecar.url)).await;
    let records = sidecar.stop_and_read();
    let calls: Vec<_> = records
        .iter()
        .filter_map(|r| match &r.kind {
            Some(RecordKind::LlmCall(c)) => Some(c.episode_id.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(calls, [episode.id().unwrap().to_owned(), String::new()]);
}

#[tokio::test]
async fn invalid_values_are_refused_before_anything_is_sent() {
    let sidecar = Sidecar::start(upstream().await, None).await;
    let client = Client::new(&sidecar.url).unwrap();
    let episode = client.start_episode("t", Default::default()).await.unwrap();
    let before = sidecar.control_requests().await;
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let err = episode.reward(bad).await.unwrap_err();
        assert!(matches!(err, Error::InvalidValue { .. }), "{err}");
        assert!(err.to_string().contains("finite"));
    }
    assert!(matches!(
        client.start_episode(" ", Default::default()).await,
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(
        sidecar.control_requests().await,
        before,
        "nothing reached the sidecar"
    );
    // A value the sidecar itself refuses comes back as Rejected with its reason.
    let err = episode.reward_call("not/a/span", 1.0).await.unwrap_err();
    match err {
        Error::Rejected { status, code, .. } => {
            assert_eq!((status, code.as_str()), (400, "invalid_span_id"))
        }
        other => panic!("{other}"),
    }
}

#[tokio::test]
async fn an_unreachable_sidecar_is_ignored_when_fail_open_and_an_error_otherwise() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let url = format!("http://{closed}");
    let open = Client::builder().url(&url).build().unwrap();
    let episode = open.start_episode("t", Default::default()).await.unwrap();
    assert_eq!(episode.id(), None);
    assert_eq!(episode.base_url(), format!("{url}/v1"));
    episode.reward(1.0).await.unwrap();
    episode.end(EndStatus::Succeeded).await.unwrap();

    let closed_client = Client::builder()
        .url(&url)
        .fail_open(false)
        .build()
        .unwrap();
    let err = closed_client
        .start_episode("t", Default::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains(&url));
}

#[tokio::test]
async fn a_dropped_guard_ends_the_episode_as_aborted_and_the_token_is_sent() {
    let sidecar = Sidecar::start(upstream().await, Some("s3cret")).await;
    let without = Client::new(&sidecar.url).unwrap();
    match without
        .start_episode("t", Default::default())
        .await
        .unwrap_err()
    {
        Error::Rejected { status, .. } => assert_eq!(status, 401),
        other => panic!("{other}"),
    }
    let client = Client::builder()
        .url(&sidecar.url)
        .token("s3cret")
        .build()
        .unwrap();
    {
        let guard = client
            .start_episode("t", Default::default())
            .await
            .unwrap()
            .guard();
        chat(guard.base_url()).await;
        // Dropped here without end(), as after an early `?` return.
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let records = sidecar.stop_and_read();
    let end = records.iter().find_map(|r| match &r.kind {
        Some(RecordKind::EpisodeEvent(e)) if e.kind() == EpisodeEventKind::End => Some(e.status()),
        _ => None,
    });
    assert_eq!(end, Some(WireEnd::Aborted));
}

#[test]
fn the_blocking_client_does_the_same() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let up = runtime.block_on(upstream());
    let sidecar = runtime.block_on(Sidecar::start(up, None));
    let client = tapline_sdk::blocking::Client::new(&sidecar.url).unwrap();
    {
        let episode = client
            .start_episode("blocking", Default::default())
            .unwrap()
            .guard();
        runtime.block_on(chat(episode.base_url()));
        episode.reward(2.0).unwrap();
    }
    let records = sidecar.stop_and_read();
    let kinds: Vec<&str> = records
        .iter()
        .map(|r| match r.kind.as_ref().unwrap() {
            RecordKind::EpisodeEvent(e) if e.kind() == EpisodeEventKind::Start => "start",
            RecordKind::EpisodeEvent(e) if e.status() == WireEnd::Aborted => "end aborted",
            RecordKind::EpisodeEvent(_) => "end",
            RecordKind::LlmCall(_) => "call",
            RecordKind::Reward(_) => "reward",
        })
        .collect();
    assert_eq!(kinds, ["start", "call", "reward", "end aborted"]);
}
