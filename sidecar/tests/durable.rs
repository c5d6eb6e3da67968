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
    spawn_sidecar_with(listen, upstream, dir, &[])
}

fn spawn_sidecar_with(listen: SocketAddr, upstream: &str, dir: &Path, extra: &[&str]) -> Process {
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
        .args(extra)
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

fn free_port() -> SocketAddr {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// What a harness knows of one episode after its requests: only answers it received
/// count; a request cut by the kill makes the episode's state uncertain.
#[derive(Debug, Default, Clone)]
struct Seen {
    rewards: Vec<String>,
    ended: bool,
    uncertain: bool,
}

/// Sends one control request; `None` when the sidecar died before answering.
async fn control(
    client: &TestClient,
    addr: SocketAddr,
    path: &str,
    body: Value,
) -> Option<(StatusCode, Value)> {
    let resp = client
        .request(post(addr, path, body.to_string()))
        .await
        .ok()?;
    let status = resp.status();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

/// Plays harnesses until `stop`: create an episode, two calls in it, a reward, and end
/// every other episode.
async fn harness(
    addr: SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<(String, Seen)> {
    let client = client();
    let mut out = Vec::new();
    let mut n = 0u32;
    while !stop.load(Ordering::SeqCst) {
        let Some((status, created)) = control(
            &client,
            addr,
            "/tapline/v1/episodes",
            json!({"task_id": "t"}),
        )
        .await
        else {
            break;
        };
        assert_eq!(status, StatusCode::CREATED, "{created}");
        let id = created["episode_id"].as_str().unwrap().to_owned();
        let mut seen = Seen::default();
        let path = format!("/e/{id}/v1/chat/completions");
        for _ in 0..2 {
            if send_ok(&client, post(addr, &path, "{}")).await.is_none() {
                seen.uncertain = true;
            }
        }
        if !seen.uncertain {
            match control(
                &client,
                addr,
                &format!("/tapline/v1/episodes/{id}/rewards"),
                json!({"value": 1.0}),
            )
            .await
            {
                Some((StatusCode::CREATED, r)) => seen
                    .rewards
                    .push(r["reward_id"].as_str().unwrap().to_owned()),
                Some((status, r)) => panic!("reward for an open episode refused: {status} {r}"),
                None => seen.uncertain = true,
            }
        }
        if !seen.uncertain && n.is_multiple_of(2) {
            match control(
                &client,
                addr,
                &format!("/tapline/v1/episodes/{id}/end"),
                json!({"status": "succeeded"}),
            )
            .await
            {
                Some((StatusCode::OK, _)) => seen.ended = true,
                Some((status, r)) => panic!("end of an open episode refused: {status} {r}"),
                None => seen.uncertain = true,
            }
        }
        n += 1;
        out.push((id, seen));
        if seen_uncertain(&out) {
            break;
        }
    }
    out
}

fn seen_uncertain(out: &[(String, Seen)]) -> bool {
    out.last().is_some_and(|(_, s)| s.uncertain)
}

async fn send_ok(
    client: &TestClient,
    req: http::Request<http_body_util::Full<Bytes>>,
) -> Option<()> {
    let resp = client.request(req).await.ok()?;
    resp.into_body().collect().await.ok()?;
    Some(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_episodes_survive_sigkill_at_random_points_under_load() {
    let upstream = Upstream::start(|_| {
        Script::json(r#"{"choices":[{"index":0,"message":{"content":"hi"}}]}"#)
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let listen = free_port();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
        | 1;
    eprintln!("kill times seeded with {seed}");
    let mut rng = seed;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut episodes: Vec<(String, Seen)> = Vec::new();
    for _round in 0..3 {
        let process = spawn_sidecar(listen, &upstream.url(), dir.path());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let workers: Vec<_> = (0..4)
            .map(|_| tokio::spawn(harness(listen, stop.clone())))
            .collect();
        tokio::time::sleep(Duration::from_millis(300 + next() % 900)).await;
        drop(process); // SIGKILL, wherever the sidecar is
        stop.store(true, Ordering::SeqCst);
        for w in workers {
            episodes.extend(w.await.unwrap());
        }
    }
    let open: Vec<&String> = episodes
        .iter()
        .filter(|(_, s)| !s.ended && !s.uncertain)
        .map(|(id, _)| id)
        .collect();
    let ended: Vec<&String> = episodes
        .iter()
        .filter(|(_, s)| s.ended)
        .map(|(id, _)| id)
        .collect();
    assert!(
        open.len() > 10 && ended.len() > 10,
        "{} open, {} ended: too little load",
        open.len(),
        ended.len()
    );

    // After the last kill, a restart accepts rewards and ends for every episode the
    // harnesses saw open, and still refuses both for every one they saw end.
    let process = spawn_sidecar(listen, &upstream.url(), dir.path());
    let client = client();
    let mut late_rewards = Vec::new();
    for id in &open {
        let (status, body) = control(
            &client,
            listen,
            &format!("/tapline/v1/episodes/{id}/rewards"),
            json!({"value": 0.5}),
        )
        .await
        .unwrap();
        assert_eq!(
            status,
            StatusCode::CREATED,
            "reward for open episode {id} after restarts: {body}"
        );
        late_rewards.push(body["reward_id"].as_str().unwrap().to_owned());
        let (status, body) = control(
            &client,
            listen,
            &format!("/tapline/v1/episodes/{id}/end"),
            json!({"status": "failed"}),
        )
        .await
        .unwrap();
        assert_eq!(
            status,
            StatusCode::OK,
            "end of open episode {id} after restarts: {body}"
        );
    }
    for id in &ended {
        let (status, body) = control(
            &client,
            listen,
            &format!("/tapline/v1/episodes/{id}/rewards"),
            json!({"value": 0.5}),
        )
        .await
        .unwrap();
        assert_eq!(
            status,
            StatusCode::CONFLICT,
            "reward for ended episode {id}: {body}"
        );
    }

    // Every accepted reward is stored exactly once, and every episode ended once.
    let store = format!("file://{}", dir.path().join("store").display());
    let accepted: HashSet<String> = episodes
        .iter()
        .flat_map(|(_, s)| s.rewards.iter().cloned())
        .chain(late_rewards)
        .collect();
    let mut stored: Vec<Record> = Vec::new();
    for _ in 0..300 {
        stored = records(&store).await;
        let ids: HashSet<&str> = stored
            .iter()
            .filter_map(|r| match &r.kind {
                Some(RecordKind::Reward(w)) => Some(w.reward_id.as_str()),
                _ => None,
            })
            .collect();
        let ends = stored
            .iter()
            .filter(|r| matches!(&r.kind, Some(RecordKind::EpisodeEvent(e)) if e.kind == tapline_proto::EpisodeEventKind::End as i32))
            .count();
        if accepted.iter().all(|id| ids.contains(id.as_str())) && ends >= open.len() + ended.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut rewards: std::collections::HashMap<&str, usize> = Default::default();
    let mut ends: std::collections::HashMap<&str, usize> = Default::default();
    for r in &stored {
        match &r.kind {
            Some(RecordKind::Reward(w)) => *rewards.entry(w.reward_id.as_str()).or_default() += 1,
            Some(RecordKind::EpisodeEvent(e))
                if e.kind == tapline_proto::EpisodeEventKind::End as i32 =>
            {
                *ends.entry(e.episode_id.as_str()).or_default() += 1;
            }
            _ => {}
        }
    }
    for id in &accepted {
        assert_eq!(
            rewards.get(id.as_str()),
            Some(&1),
            "reward {id} stored once"
        );
    }
    for id in open.iter().chain(&ended) {
        assert_eq!(ends.get(id.as_str()), Some(&1), "episode {id} ended once");
    }
    assert!(ends.values().all(|&n| n == 1), "no episode ended twice");
    drop(process);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_episode_is_ended_timed_out_by_the_sidecar() {
    let upstream = Upstream::start(|_| {
        Script::json(r#"{"choices":[{"index":0,"message":{"content":"hi"}}]}"#)
    })
    .await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| {
        raw.episode_ttl_secs = Some(0.4);
    })
    .await;
    let addr = sidecar.local_addr();
    let client = client();
    let (_, idle) = control(
        &client,
        addr,
        "/tapline/v1/episodes",
        json!({"task_id": "t"}),
    )
    .await
    .unwrap();
    let idle = idle["episode_id"].as_str().unwrap().to_owned();
    let (_, busy) = control(
        &client,
        addr,
        "/tapline/v1/episodes",
        json!({"task_id": "t"}),
    )
    .await
    .unwrap();
    let busy = busy["episode_id"].as_str().unwrap().to_owned();
    // Calls keep one episode active past the TTL; the other gets none.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1200) {
        send_ok(
            &client,
            post(addr, &format!("/e/{busy}/v1/chat/completions"), "{}"),
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = control(
        &client,
        addr,
        &format!("/tapline/v1/episodes/{idle}/rewards"),
        json!({"value": 1}),
    )
    .await
    .unwrap();
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "the idle episode has ended: {body}"
    );
    let (status, _) = control(
        &client,
        addr,
        &format!("/tapline/v1/episodes/{busy}/rewards"),
        json!({"value": 1}),
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::CREATED, "an active episode stays open");
    assert_eq!(
        sidecar
            .state()
            .metrics
            .episodes_timed_out
            .load(Ordering::SeqCst),
        1
    );
    let mut end = None;
    for _ in 0..200 {
        end = records(&store)
            .await
            .into_iter()
            .find_map(|r| match r.kind {
                Some(RecordKind::EpisodeEvent(e))
                    if e.kind == tapline_proto::EpisodeEventKind::End as i32 =>
                {
                    Some(e)
                }
                _ => None,
            });
        if end.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let end = end.expect("the timed-out end is recorded");
    assert_eq!(end.episode_id, idle);
    assert_eq!(end.status, tapline_proto::EndStatus::TimedOut as i32);
    assert_eq!(end.metadata["ended_by"], "tapline-sidecar");
    assert!(end.metadata["reason"].contains("--episode-ttl-secs"));
}

/// Spool files of `dir` with extension `ext`, sorted.
fn spool_files(dir: &Path, ext: &str) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spool_file_whose_build_killed_the_sidecar_twice_is_set_aside_and_the_rest_flows() {
    let upstream = Upstream::start(|_| {
        Script::json(r#"{"choices":[{"index":0,"message":{"content":"hi"}}]}"#)
    })
    .await;
    let root = tempfile::tempdir().unwrap();
    let spool = root.path().join("spool");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // The store is down: three calls stay in the spool, one sealed file each.
    let spool2 = spool.clone();
    let (first, _) = sidecar(&upstream.url(), move |raw| {
        raw.store = Some(s3_url(port, SECRET));
        raw.spool_dir = Some(spool2);
        raw.segment_max_records = Some(1);
    })
    .await;
    let client = client();
    let mut spans = Vec::new();
    for i in 0..3 {
        let (status, headers, _) = send(
            &client,
            post(
                first.local_addr(),
                "/v1/chat/completions",
                format!(r#"{{"messages":[{{"role":"user","content":"q{i}"}}]}}"#),
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        spans.push(headers["x-tapline-span-id"].to_str().unwrap().to_owned());
    }
    wait_for(
        async || spool_files(&spool, "sealed").len() == 3,
        "three sealed spool files",
    )
    .await;
    first
        .shutdown(Duration::from_secs(1), Duration::from_millis(200))
        .await;
    let sealed = spool_files(&spool, "sealed");
    assert_eq!(sealed.len(), 3, "nothing could be uploaded");
    assert!(
        spool_files(&spool, "building").is_empty(),
        "a build that ends leaves no note behind"
    );
    // As two processes killed while building the second file's segment leave it (and
    // one killed while building the first: a coincidence, built again).
    let note = |p: &Path| p.with_extension("building");
    std::fs::write(note(&sealed[1]), "2\n").unwrap();
    std::fs::write(note(&sealed[0]), "1\n").unwrap();

    let (_addr, _server) = s3_server(root.path(), port).await;
    let spool2 = spool.clone();
    let (second, _) = sidecar(&upstream.url(), move |raw| {
        raw.store = Some(s3_url(port, SECRET));
        raw.spool_dir = Some(spool2);
        raw.segment_max_records = Some(1);
    })
    .await;
    let metrics = second.state().metrics.clone();
    wait_for(
        async || metrics.records_stored.load(Ordering::SeqCst) >= 2,
        "the other two files to upload",
    )
    .await;
    assert_eq!(metrics.spool_files_set_aside.load(Ordering::SeqCst), 1);
    assert_eq!(metrics.capture_failures.load(Ordering::SeqCst), 1);
    let (status, _, body) = send(
        &client,
        http::Request::get(format!("http://{}/tapline/v1/health", second.local_addr()))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let health: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(health["spool_files_set_aside"], 1, "{health}");
    second
        .shutdown(Duration::from_secs(1), Duration::from_secs(5))
        .await;

    let unbuildable = spool_files(&spool, "unbuildable");
    assert_eq!(unbuildable.len(), 1);
    assert_eq!(
        unbuildable[0].file_stem(),
        sealed[1].file_stem(),
        "the second file, kept for an operator"
    );
    assert!(spool_files(&spool, "sealed").is_empty());
    assert!(spool_files(&spool, "building").is_empty());
    let stored: HashSet<String> = s3_records(port).await.into_iter().map(|r| r.id).collect();
    let want: HashSet<String> = [spans[0].clone(), spans[2].clone()].into();
    assert_eq!(stored, want);
}
