//! Memory per call: how much one call raises the sidecar's peak resident memory, from the
//! moment it arrives until its record is in the store.
//!
//! `cargo bench -p tapline-sidecar --bench memory -- [--only NAME]`
//!
//! Each workload runs against a fresh sidecar process (the release binary, or the one
//! `TAPLINE_BENCH_SIDECAR` names, to compare two builds on one machine): one warm-up
//! call, then the peak (VmHWM) is reset through `/proc/PID/clear_refs` and the workload
//! runs. Printed, in MiB above the resident memory before the workload: the peak when the
//! client has the whole answer, the peak once the store acknowledged the record (the
//! segment builder runs in between), and what is still resident after.
//!
//! Workloads, each under the 32 MiB capture cap:
//! - `normal`: 200 chat calls of 4 KB requests and 2 KB answers, 8 at a time;
//! - `big`: one call with a 30 MB request and a 20 MB streamed answer (SSE, 64 KB events);
//! - `json`: one call with a 30 MB request and a 20 MB JSON answer;
//! - `events`: one stream of 500,000 one-character SSE events (29 MB);
//! - `crowd`: six `big` calls at once, under the default `--memory-budget-bytes`
//!   (160 MiB): the calls that do not fit are proxied whole and recorded cut; printed
//!   with how many were cut;
//! - `crowd-unbounded`: the same with a budget of 1 TiB, i.e. none (what the sidecar did
//!   before the budget).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

type HttpClient = Client<HttpConnector, Full<Bytes>>;
type UpBody =
    StreamBody<futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

/// What the fake upstream answers.
#[derive(Debug, Clone)]
enum Answer {
    Json(Bytes),
    Sse(Arc<Vec<Bytes>>),
}

fn answer_for(workload: &str) -> Answer {
    match workload {
        "big" => {
            let chunk = format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
                "x".repeat(64 << 10)
            );
            let n = (20 << 20) / chunk.len();
            let mut events: Vec<Bytes> = (0..n).map(|_| Bytes::from(chunk.clone())).collect();
            events.push(Bytes::from_static(b"data: [DONE]\n\n"));
            Answer::Sse(Arc::new(events))
        }
        "events" => {
            let event = Bytes::from_static(
                b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n",
            );
            // 500,000 events in frames of 100: the upstream writes them as it would.
            let frame: Vec<u8> = event
                .iter()
                .copied()
                .cycle()
                .take(event.len() * 100)
                .collect();
            let frame = Bytes::from(frame);
            let mut events: Vec<Bytes> = (0..5_000).map(|_| frame.clone()).collect();
            events.push(Bytes::from_static(b"data: [DONE]\n\n"));
            Answer::Sse(Arc::new(events))
        }
        "json" => Answer::Json(Bytes::from(format!(
            "{{\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}}}}]}}",
            "y".repeat(20 << 20)
        ))),
        _ => Answer::Json(Bytes::from(format!(
            "{{\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}}}}]}}",
            "z".repeat(2000)
        ))),
    }
}

async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let workload = req
                        .headers()
                        .get("x-bench-workload")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("normal")
                        .to_owned();
                    let _ = req.into_body().collect().await;
                    let (frames, sse) = match answer_for(&workload) {
                        Answer::Json(b) => (vec![Ok(Frame::data(b))], false),
                        Answer::Sse(events) => (
                            events.iter().map(|e| Ok(Frame::data(e.clone()))).collect(),
                            true,
                        ),
                    };
                    let body: UpBody = StreamBody::new(futures::stream::iter(frames));
                    let mut resp = Response::new(body);
                    resp.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static(if sse {
                            "text/event-stream"
                        } else {
                            "application/json"
                        }),
                    );
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    addr
}

fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn request_body(bytes: usize, stream: bool) -> Bytes {
    Bytes::from(format!(
        "{{\"model\":\"m\",\"stream\":{stream},\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
        "q".repeat(bytes)
    ))
}

async fn call(client: &HttpClient, base: &str, workload: &str, body: Bytes) {
    let req = Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-bench-workload", workload)
        .body(Full::new(body))
        .unwrap();
    let resp = client.request(req).await.expect("the sidecar answers");
    assert!(resp.status().is_success(), "{}", resp.status());
    resp.into_body().collect().await.expect("the whole answer");
}

async fn metric(client: &HttpClient, base: &str, name: &str) -> f64 {
    let req = Request::get(format!("{base}/metrics"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let Ok(resp) = client.request(req).await else {
        return 0.0;
    };
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

struct Figures {
    answered: f64,
    uploaded: f64,
    after: f64,
    seconds: f64,
    /// Calls whose capture the memory budget cut.
    cut: f64,
}

async fn run(name: &str, binary: &str, upstream: SocketAddr) -> Figures {
    let work = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut sidecar: Child = Command::new(binary)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--upstream", &format!("http://{upstream}")])
        .arg("--store")
        .arg(work.path().join("store"))
        .arg("--spool-dir")
        .arg(work.path().join("spool"))
        .args(["--sidecar-id", "memory", "--segment-max-age-secs", "0.2"])
        .args(if name == "crowd-unbounded" {
            &["--memory-budget-bytes", "1099511627776"][..]
        } else {
            &[][..]
        })
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the sidecar binary starts");
    let pid = sidecar.id();
    let base = format!("http://127.0.0.1:{port}");
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the sidecar did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Warm-up: one small call through every stage, uploaded.
    call(&client, &base, "normal", request_body(1000, false)).await;
    let stored = |n: f64| {
        let client = client.clone();
        let base = base.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(120);
            while metric(&client, &base, "tapline_records_stored_total").await < n {
                assert!(Instant::now() < deadline, "records never reached the store");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    stored(1.0).await;
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset VmHWM");
    let before = status_kib(pid, "VmRSS:");
    let started = Instant::now();
    let calls = match name {
        "normal" => {
            let mut set = tokio::task::JoinSet::new();
            for worker in 0..8 {
                let client = client.clone();
                let base = base.clone();
                set.spawn(async move {
                    for _ in 0..25 {
                        call(&client, &base, "normal", request_body(4000, false)).await;
                    }
                    worker
                });
            }
            while set.join_next().await.is_some() {}
            200.0
        }
        "big" => {
            call(&client, &base, "big", request_body(30 << 20, true)).await;
            1.0
        }
        "json" => {
            call(&client, &base, "json", request_body(30 << 20, false)).await;
            1.0
        }
        "events" => {
            call(&client, &base, "events", request_body(1000, true)).await;
            1.0
        }
        "crowd" | "crowd-unbounded" => {
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..6 {
                let client = client.clone();
                let base = base.clone();
                set.spawn(async move {
                    call(&client, &base, "big", request_body(30 << 20, true)).await;
                });
            }
            while set.join_next().await.is_some() {}
            6.0
        }
        other => panic!("no workload {other}"),
    };
    let answered = status_kib(pid, "VmHWM:");
    stored(1.0 + calls).await;
    let seconds = started.elapsed().as_secs_f64();
    let uploaded = status_kib(pid, "VmHWM:");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = status_kib(pid, "VmRSS:");
    let cut = metric(&client, &base, "tapline_memory_budget_cuts_total").await;
    let _ = sidecar.kill();
    let _ = sidecar.wait();
    let mib = |kib: u64| kib.saturating_sub(before) as f64 / 1024.0;
    Figures {
        answered: mib(answered),
        uploaded: mib(uploaded),
        after: mib(after),
        seconds,
        cut,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    let binary = std::env::var("TAPLINE_BENCH_SIDECAR")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_tapline-sidecar").to_owned());
    let upstream = upstream().await;
    println!("memory: sidecar {binary}");
    println!(
        "| workload | peak growth by the answer's end (MiB) | peak growth by upload (MiB) | resident after (MiB) | seconds | captures cut by the budget |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for name in [
        "normal",
        "big",
        "json",
        "events",
        "crowd",
        "crowd-unbounded",
    ] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let f = run(name, &binary, upstream).await;
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.2} | {} |",
            f.answered, f.uploaded, f.after, f.seconds, f.cut
        );
    }
}
