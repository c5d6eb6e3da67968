//! Durable delivery: a real S3-compatible server (s3s-fs) with signed requests, a store
//! that comes and goes, SIGKILL in the middle of streaming traffic, full spools, and
//! shutdown with open streams.

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http::StatusCode;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tapline_proto::{Outcome, Record, RecordKind};
use tapline_sidecar::sink::FullPolicy;
use tokio::sync::Notify;

const ACCESS: &str = "AKIDTAPLINETEST";
const SECRET: &str = "tapline-test-secret-key";

/// Starts s3s-fs on `addr` (port 0 for any), serving buckets under `root`, with
/// signature checking on.
async fn s3_server(root: &Path, addr: SocketAddr) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    std::fs::create_dir_all(root.join("records")).unwrap();
    let fs = s3s_fs::FileSystem::new(root).unwrap();
    let mut builder = s3s::service::S3ServiceBuilder::new(fs);
    builder.set_auth(s3s::auth::SimpleAuth::from_single(ACCESS, SECRET));
    let service = builder.build();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            let service = service.clone();
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    (addr, task)
}

fn s3_url(addr: SocketAddr, secret: &str) -> String {
    format!(
        "s3://records/run-1?endpoint=http://{addr}&region=us-east-1&access_key_id={ACCESS}&secret_access_key={secret}"
    )
}

async fn s3_records(addr: SocketAddr) -> Vec<Record> {
    records(&s3_url(addr, SECRET)).await
}

fn llm_calls(records: &[Record]) -> Vec<&tapline_proto::LlmCall> {
    records
        .iter()
        .filter_map(|r| match &r.kind {
            Some(RecordKind::LlmCall(c)) => Some(c),
            _ => None,
        })
        .collect()
}

async fn wait_for(mut check: impl AsyncFnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_reach_a_real_s3_server_and_bad_credentials_lose_nothing() {
    let upstream = Upstream::start(|_| {
        Script::json(r#"{"choices":[{"index":0,"message":{"content":"hi"}}]}"#)
    })
    .await;
    let root = tempfile::tempdir().unwrap();
    let (s3, _server) = s3_server(root.path(), "127.0.0.1:0".parse().unwrap()).await;
    let spool = tempfile::tempdir().unwrap();

    // Wrong secret: the store refuses every upload; the records stay in the spool.
    let (first, _) = sidecar(&upstream.url(), |raw| {
        raw.store = Some(s3_url(s3, "wrong-secret"));
        raw.spool_dir = Some(spool.path().to_owned());
    })
    .await;
    let client = client();
    for _ in 0..3 {
        let (status, _, _) = send(
            &client,
            post(first.local_addr(), "/v1/chat/completions", "{}"),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }
    let metrics = first.state().metrics.clone();
    wait_for(
        async || metrics.upload_permanent_errors.load(Ordering::SeqCst) > 0,
        "a refused upload",
    )
    .await;
    let (_, _, health) = send(
        &client,
        http::Request::get(format!("http://{}/tapline/v1/health", first.local_addr()))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    let health: Value = serde_json::from_slice(&health).unwrap();
    assert_eq!(health["status"], "degraded", "{health}");
    assert!(
        health["store_error"].as_str().unwrap().len() > 10,
        "{health}"
    );
    assert_eq!(health["spool_records"], 3);
    first
        .shutdown(Duration::from_secs(1), Duration::from_millis(300))
        .await;
    assert!(s3_records(s3).await.is_empty());

    // Right secret, same spool: everything arrives, signed.
    let (second, _) = sidecar(&upstream.url(), |raw| {
        raw.store = Some(s3_url(s3, SECRET));
        raw.spool_dir = Some(spool.path().to_owned());
    })
    .await;
    send(
        &client,
        post(second.local_addr(), "/v1/chat/completions", "{}"),
    )
    .await;
    second
        .shutdown(Duration::from_secs(1), Duration::from_secs(10))
        .await;
    let records = s3_records(s3).await;
    assert_eq!(llm_calls(&records).len(), 4);
    assert!(std::fs::read_dir(spool.path()).unwrap().all(|e| {
        let name = e.unwrap().file_name();
        let name = name.to_string_lossy();
        !name.ends_with(".sealed") && !name.ends_with(".open")
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_is_down_then_up_gets_every_record_once() {
    let upstream = Upstream::start(|_| {
        Script::json(r#"{"choices":[{"index":0,"message":{"content":"hi"}}]}"#)
    })
    .await;
    let root = tempfile::tempdir().unwrap();
    // Reserve a port for the store, but nobody listens there yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (sidecar, _) = sidecar(&upstream.url(), |raw| {
        raw.store = Some(s3_url(port, SECRET));
        raw.segment_max_records = Some(5);
    })
    .await;
    let client = client();
    for _ in 0..23 {
        send(
            &client,
            post(sidecar.local_addr(), "/v1/chat/completions", "{}"),
        )
        .await;
    }
    let metrics = sidecar.state().metrics.clone();
    wait_for(
        async || metrics.upload_failures.load(Ordering::SeqCst) > 0,
        "a failed upload",
    )
    .await;
    assert_eq!(metrics.records_stored.load(Ordering::SeqCst), 0);

    let (_addr, _server) = s3_server(root.path(), port).await;
    wait_for(
        async || metrics.records_stored.load(Ordering::SeqCst) >= 23,
        "the backlog to drain",
    )
    .await;
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(10))
        .await;
    let records = s3_records(port).await;
    let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    let unique: HashSet<&str> = ids.iter().copied().collect();
    assert_eq!(unique.len(), 23);
    assert_eq!(ids.len(), 23, "no record twice");
    assert!(metrics.upload_retries.load(Ordering::SeqCst) > 0);
}

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_sidecar(listen: SocketAddr, upstream: &str, dir: &Path) -> Process {
    #[allow(
        clippy::zombie_processes,
        reason = "Process::drop kills and waits for it"
    )]
    let child = Command::new(env!("CARGO_BIN_EXE_tapline-sidecar"))
        .args([
            "--listen",
            &listen.to_string(),
            "--upstream",
            upstream,
            "--sidecar-id",
            "killed",
        ])
        .arg("--store")
        .arg(dir.join("store"))
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .env("TAPLINE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    for _ in 0..400 {
        if std::net::TcpStream::connect(listen).is_ok() {
            return Process(child);
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("sidecar did not start");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_loses_no_call_the_client_received_whole() {
    let chunks: Vec<Bytes> = (0..8)
        .map(|i| {
            Bytes::from(format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}}}}]}}\n\n"
            ))
        })
        .chain([Bytes::from_static(b"data: [DONE]\n\n")])
        .collect();
    let upstream = Upstream::start(move |_| {
        let mut s = Script::sse(chunks.clone());
        s.chunk_delay = Duration::from_millis(3);
        s
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let listen: SocketAddr = format!(
        "127.0.0.1:{}",
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    )
    .parse()
    .unwrap();
    let process = spawn_sidecar(listen, &upstream.url(), dir.path());

    // Eight clients stream calls back to back; each remembers the span ids of the
    // responses it received whole.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..8 {
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            let client = client();
            let mut complete = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let Ok(resp) = client
                    .request(post(listen, "/v1/chat/completions", r#"{"stream":true}"#))
                    .await
                else {
                    break;
                };
                let span = resp.headers()["x-tapline-span-id"]
                    .to_str()
                    .unwrap()
                    .to_owned();
                match resp.into_body().collect().await.map(|b| b.to_bytes()) {
                    Ok(body) if body.ends_with(b"data: [DONE]\n\n") => complete.push(span),
                    _ => break,
                }
            }
            complete
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    drop(process); // SIGKILL
    stop.store(true, Ordering::SeqCst);
    let mut complete = Vec::new();
    for w in workers {
        complete.extend(w.await.unwrap());
    }
    assert!(
        complete.len() > 20,
        "only {} calls completed before the kill",
        complete.len()
    );

    // Restart on the same spool: what was not uploaded is replayed.
    let process = spawn_sidecar(listen, &upstream.url(), dir.path());
    let store = format!("file://{}", dir.path().join("store").display());
    let mut stored = HashSet::new();
    for _ in 0..200 {
        stored = llm_calls(&records(&store).await)
            .iter()
            .map(|c| c.span_id.clone())
            .collect();
        if complete.iter().all(|s| stored.contains(s)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let missing: Vec<_> = complete.iter().filter(|s| !stored.contains(*s)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} complete calls are missing from the store",
        missing.len(),
        complete.len()
    );
    drop(process);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spool_drops_and_flags_the_episode_under_policy_drop() {
    let upstream =
        Upstream::start(|_| Script::json(format!("{{\"pad\":\"{}\"}}", "x".repeat(3000)))).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (sidecar, _) = sidecar(&upstream.url(), |raw| {
        raw.store = Some(s3_url(port, SECRET)); // down: nothing leaves the spool
        raw.spool_max_bytes = Some(16 * 1024);
        raw.spool_full_policy = Some(FullPolicy::Drop);
    })
    .await;
    let client = client();
    let addr = sidecar.local_addr();
    let (_, _, ep) = send(
        &client,
        post(
            addr,
            "/tapline/v1/episodes",
            json!({"task_id": "t"}).to_string(),
        ),
    )
    .await;
    let id = serde_json::from_slice::<Value>(&ep).unwrap()["episode_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let started = Instant::now();
    for _ in 0..10 {
        let (status, _, _) = send(
            &client,
            post(addr, &format!("/e/{id}/v1/chat/completions"), "{}"),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::OK,
            "traffic flows although the spool is full"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "a full spool does not hold traffic back"
    );
    let metrics = sidecar.state().metrics.clone();
    assert!(metrics.records_dropped.load(Ordering::SeqCst) > 0);
    assert!(metrics.spool_bytes.load(Ordering::SeqCst) <= 16 * 1024);
    // The end event of the episode says it is incomplete (if it fits; here it does
    // not, which the trainer sees as an episode that never ended). Free space first.
    let (_root, _server) = {
        let root = tempfile::tempdir().unwrap();
        let server = s3_server(root.path(), port).await;
        (root, server)
    };
    wait_for(
        async || metrics.spool_records.load(Ordering::SeqCst) == 0,
        "the spool to drain",
    )
    .await;
    let (status, _, end) = send(
        &client,
        post(
            addr,
            &format!("/tapline/v1/episodes/{id}/end"),
            json!({"status": "succeeded"}).to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_slice::<Value>(&end).unwrap()["incomplete"],
        true
    );
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(10))
        .await;
    let records = s3_records(port).await;
    let end = records
        .iter()
        .find_map(|r| match &r.kind {
            Some(RecordKind::EpisodeEvent(e))
                if e.kind() == tapline_proto::EpisodeEventKind::End =>
            {
                Some(e.clone())
            }
            _ => None,
        })
        .unwrap();
    assert!(end.incomplete && end.dropped_records > 0, "{end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spool_holds_responses_back_under_policy_block() {
    let upstream =
        Upstream::start(|_| Script::json(format!("{{\"pad\":\"{}\"}}", "x".repeat(3000)))).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (sidecar, _) = sidecar(&upstream.url(), |raw| {
        raw.store = Some(s3_url(port, SECRET));
        raw.spool_max_bytes = Some(16 * 1024);
        raw.spool_full_policy = Some(FullPolicy::Block);
    })
    .await;
    let addr = sidecar.local_addr();
    let calls = tokio::spawn(async move {
        let client = client();
        for _ in 0..10 {
            send(&client, post(addr, "/v1/chat/completions", "{}")).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!calls.is_finished(), "responses wait for spool space");
    let metrics = sidecar.state().metrics.clone();
    assert_eq!(metrics.records_dropped.load(Ordering::SeqCst), 0);
    let root = tempfile::tempdir().unwrap();
    let _server = s3_server(root.path(), port).await;
    tokio::time::timeout(Duration::from_secs(30), calls)
        .await
        .expect("the store came back")
        .unwrap();
    sidecar
        .shutdown(Duration::from_secs(1), Duration::from_secs(10))
        .await;
    assert_eq!(llm_calls(&s3_records(port).await).len(), 10);
    assert_eq!(metrics.records_dropped.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_open_streams_finish_and_flushes_their_records() {
    let gate = Arc::new(Notify::new());
    let g2 = gate.clone();
    let upstream = Upstream::start(move |_| {
        let mut s = Script::sse(vec![
            Bytes::from_static(
                b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n",
            ),
            Bytes::from_static(b"data: [DONE]\n\n"),
        ]);
        s.gate = Some((1, g2.clone()));
        s
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |_| {}).await;
    let resp = client()
        .request(post(
            sidecar.local_addr(),
            "/v1/chat/completions",
            r#"{"stream":true}"#,
        ))
        .await
        .unwrap();
    let addr = sidecar.local_addr();
    let shutdown = tokio::spawn(sidecar.shutdown(Duration::from_secs(10), Duration::from_secs(10)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "no new connections while draining"
    );
    gate.notify_one();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    shutdown.await.unwrap();
    let calls = calls(&store, 1).await;
    assert_eq!(calls[0].outcome(), Outcome::Ok);
}
