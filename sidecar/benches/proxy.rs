//! Added latency, throughput and memory of the sidecar.
//!
//! Runs a fast local upstream and a load generator in this process and the real
//! `tapline-sidecar` binary (recording to a local directory store) as a child process,
//! then measures the same workloads direct-to-upstream and through the sidecar, in the
//! same run:
//! - closed loop at 1, 64 and 512 concurrent clients (keep-alive connections), JSON and
//!   SSE responses: latency percentiles and requests per second;
//! - open loop at a fixed 1,000 requests per second: p50/p99 added latency;
//! - the sidecar's peak resident memory (VmHWM);
//! - last, long streams (2,001 chunks, 320 KB) at 1 and 64 clients, and the peak memory
//!   after them.
//!
//! `cargo bench -p tapline-sidecar --bench proxy` (add `-- --quick` for a short run, and
//! `--mode json|sse|paced|long`, repeatable, to run only those workloads;
//! `TAPLINE_BENCH_SIDECAR=path` measures another build of the sidecar, e.g. a baseline).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

const JSON_BODY: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."},"finish_reason":"stop"}],"usage":{"prompt_tokens":50,"completion_tokens":30,"total_tokens":80}}"#;

/// An answer streamed as `content` chunks, then one chunk with the finish reason and
/// `[DONE]`: `content + 1` chunks in all.
fn sse_chunks(content: usize) -> Vec<Bytes> {
    let mut chunks: Vec<Bytes> = (0..content)
        .map(|i| {
            Bytes::from(format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"bench\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}},\"finish_reason\":null}}]}}\n\n"
            ))
        })
        .collect();
    chunks.push(Bytes::from_static(b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n"));
    chunks
}

async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let chunks = Arc::new(sse_chunks(20));
    let long = Arc::new(sse_chunks(2_000));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            let chunks = chunks.clone();
            let long = long.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let chunks = chunks.clone();
                    let long = long.clone();
                    async move {
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        let stream = body.windows(13).any(|w| w == b"\"stream\":true");
                        let paced = body.windows(7).any(|w| w == b"\"paced\"");
                        let chunks = if body.windows(6).any(|w| w == b"\"long\"") {
                            long
                        } else {
                            chunks
                        };
                        let resp: Response<
                            http_body_util::combinators::BoxBody<Bytes, Infallible>,
                        > = if paced {
                            // One chunk per millisecond, like a (very fast) decoding server.
                            let frames = futures::stream::unfold(
                                (chunks.clone(), 0usize),
                                |(chunks, i)| async move {
                                    if i > 0 {
                                        tokio::time::sleep(Duration::from_millis(1)).await;
                                    }
                                    let chunk = chunks.get(i)?.clone();
                                    Some((Ok(hyper::body::Frame::data(chunk)), (chunks, i + 1)))
                                },
                            );
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(http_body_util::StreamBody::new(frames).boxed())
                                .unwrap()
                        } else if stream {
                            let frames = futures::stream::iter(
                                chunks
                                    .iter()
                                    .cloned()
                                    .map(|c| Ok(hyper::body::Frame::data(c)))
                                    .collect::<Vec<_>>(),
                            );
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(http_body_util::StreamBody::new(frames).boxed())
                                .unwrap()
                        } else {
                            Response::builder()
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from_static(JSON_BODY.as_bytes())).boxed())
                                .unwrap()
                        };
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

struct SidecarProcess {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl SidecarProcess {
    fn start(upstream: SocketAddr) -> SidecarProcess {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        // TAPLINE_BENCH_SIDECAR runs another build (say, of the previous commit) instead.
        let binary = std::env::var_os("TAPLINE_BENCH_SIDECAR")
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_tapline-sidecar").into());
        #[allow(
            clippy::zombie_processes,
            reason = "Drop kills and waits for the child"
        )]
        let child = Command::new(binary)
            .args([
                "--listen",
                &addr.to_string(),
                "--upstream",
                &format!("http://{upstream}"),
            ])
            .arg("--store")
            .arg(dir.path().join("store"))
            .arg("--spool-dir")
            .arg(dir.path().join("spool"))
            .args(["--sidecar-id", "bench"])
            .env("TAPLINE_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        for _ in 0..200 {
            if std::net::TcpStream::connect(addr).is_ok() {
                return SidecarProcess {
                    child,
                    addr,
                    _dir: dir,
                };
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("sidecar did not start");
    }

    /// User + system CPU seconds the sidecar used so far (clock ticks of 1/100 s).
    fn cpu_secs(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        (ticks(11) + ticks(12)) / 100.0
    }

    fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for SidecarProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> Sender {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

const REQUEST: &str = r#"{"model":"bench","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say something."}]}"#;
const PACED_REQUEST: &str = r#"{"model":"bench","stream":true,"user":"paced","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say something."}]}"#;
const LONG_REQUEST: &str = r#"{"model":"bench","stream":true,"user":"long","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say something."}]}"#;
const STREAM_REQUEST: &str = r#"{"model":"bench","stream":true,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say something."}]}"#;

/// One request on a keep-alive connection; returns the latency to the last body byte.
async fn one(sender: &mut Sender, addr: SocketAddr, mode: Mode) -> Duration {
    let body = match mode {
        Mode::Json => REQUEST,
        Mode::Sse => STREAM_REQUEST,
        Mode::SsePaced => PACED_REQUEST,
        Mode::SseLong => LONG_REQUEST,
    };
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let started = Instant::now();
    sender.ready().await.unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    resp.into_body().collect().await.unwrap();
    started.elapsed()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A JSON response.
    Json,
    /// An SSE stream of 21 chunks sent at once (worst case for per-chunk overhead).
    Sse,
    /// The same stream with 1 ms between chunks.
    SsePaced,
    /// A long answer: 2,001 chunks (320 KB) sent at once.
    SseLong,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Json => "json",
            Mode::Sse => "sse burst",
            Mode::SsePaced => "sse 1 chunk/ms",
            Mode::SseLong => "sse 2,001 chunks",
        }
    }
}

struct Run {
    latencies: Vec<Duration>,
    elapsed: Duration,
}

async fn closed_loop(addr: SocketAddr, clients: usize, total: usize, stream: Mode) -> Run {
    let per_client = total.div_ceil(clients);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        tasks.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            let mut lat = Vec::with_capacity(per_client);
            for _ in 0..per_client {
                lat.push(one(&mut sender, addr, stream).await);
            }
            lat
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    Run {
        latencies,
        elapsed: started.elapsed(),
    }
}

async fn open_loop(addr: SocketAddr, rate: u64, seconds: u64, stream: Mode) -> Run {
    // A paced stream lasts ~20 ms, so it needs more connections to reach the rate.
    let workers = if stream == Mode::SsePaced { 128u64 } else { 32 };
    let per_worker = rate * seconds / workers;
    let interval = Duration::from_nanos(1_000_000_000 * workers / rate);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        tasks.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            tokio::time::sleep(interval * w as u32 / workers as u32).await;
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut lat = Vec::with_capacity(per_worker as usize);
            for _ in 0..per_worker {
                ticker.tick().await;
                lat.push(one(&mut sender, addr, stream).await);
            }
            lat
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    Run {
        latencies,
        elapsed: started.elapsed(),
    }
}

/// (steal, total) CPU ticks of the whole machine so far: time the hypervisor gave this
/// VM's CPUs to someone else, which shows up as latency no code here can remove.
fn cpu_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    (fields.get(7).copied().unwrap_or(0), fields.iter().sum())
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn summary(mut run: Run) -> (Duration, Duration, f64) {
    run.latencies.sort();
    let rps = run.latencies.len() as f64 / run.elapsed.as_secs_f64();
    (pct(&run.latencies, 0.5), pct(&run.latencies, 0.99), rps)
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

fn signed_us(a: Duration, b: Duration) -> String {
    format!("{:+.0} µs", (a.as_secs_f64() - b.as_secs_f64()) * 1e6)
}

/// Warms both paths, then measures `total` calls direct and through the sidecar, and
/// prints one table row.
async fn closed_pair(
    up: SocketAddr,
    sidecar: SocketAddr,
    stream: Mode,
    clients: usize,
    total: usize,
) {
    closed_loop(up, clients, clients * 2, stream).await;
    closed_loop(sidecar, clients, clients * 2, stream).await;
    let direct = summary(closed_loop(up, clients, total, stream).await);
    let through = summary(closed_loop(sidecar, clients, total, stream).await);
    println!(
        "| {} | {clients} | {} | {} | {} | {} | {} | {} | {:.0} | {:.0} |",
        stream.name(),
        us(direct.0),
        us(direct.1),
        us(through.0),
        us(through.1),
        signed_us(through.0, direct.0),
        signed_us(through.1, direct.1),
        direct.2,
        through.2,
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--mode json|sse|paced` (repeatable) runs only those workloads.
    let picked: Vec<Mode> = args
        .windows(2)
        .filter(|w| w[0] == "--mode")
        .map(|w| match w[1].as_str() {
            "json" => Mode::Json,
            "sse" => Mode::Sse,
            "paced" => Mode::SsePaced,
            "long" => Mode::SseLong,
            other => panic!("--mode {other}: expected json, sse, paced or long"),
        })
        .collect();
    let wanted = move |m: Mode| picked.is_empty() || picked.contains(&m);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let up = upstream().await;
        let sidecar = SidecarProcess::start(up);
        let scale = if quick { 1 } else { 4 };
        println!("sidecar proxy benchmark ({} cores), recording to a local directory store", std::thread::available_parallelism().map_or(0, |n| n.get()));
        println!();
        println!("closed loop: latency to the last body byte, direct vs through the sidecar");
        println!("| mode | clients | direct p50 | direct p99 | sidecar p50 | sidecar p99 | added p50 | added p99 | direct req/s | sidecar req/s |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for stream in [Mode::Json, Mode::Sse].into_iter().filter(|m| wanted(*m)) {
            for clients in [1usize, 64, 512] {
                let total = (if clients == 1 { 500 } else { 2_000 }) * scale;
                closed_pair(up, sidecar.addr, stream, clients, total).await;
            }
        }
        println!();
        let seconds = if quick { 2 } else { 5 };
        // The tail of one 5-second run moves a lot on a shared machine: repeat the pair
        // (direct, then through the sidecar) and report the median run by added p99.
        let reps = if quick { 1 } else { 3 };
        println!("open loop at 1,000 requests/s for {seconds} s (32 keep-alive connections, 128 for paced streams), {reps} runs of each; the median run by added p99, and every run's added p99");
        println!("| mode | direct p50 | direct p99 | sidecar p50 | sidecar p99 | added p50 | added p99 | added p99 of each run | achieved req/s | sidecar CPU per request | CPU stolen by the host |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        for stream in [Mode::Json, Mode::Sse, Mode::SsePaced].into_iter().filter(|m| wanted(*m)) {
            let mut runs = Vec::new();
            let stolen_before = cpu_ticks();
            for _ in 0..reps {
                let direct = summary(open_loop(up, 1000, seconds, stream).await);
                let cpu_before = sidecar.cpu_secs();
                let run = open_loop(sidecar.addr, 1000, seconds, stream).await;
                let requests = run.latencies.len() as f64;
                let cpu = sidecar.cpu_secs() - cpu_before;
                let through = summary(run);
                let added_p99 = through.1.as_secs_f64() - direct.1.as_secs_f64();
                runs.push((added_p99, direct, through, cpu / requests * 1e6));
            }
            let stolen_after = cpu_ticks();
            let stolen = (stolen_after.0 - stolen_before.0) as f64
                / (stolen_after.1 - stolen_before.1).max(1) as f64;
            runs.sort_by(|a, b| a.0.total_cmp(&b.0));
            let each: Vec<String> = runs.iter().map(|r| format!("{:+.0}", r.0 * 1e6)).collect();
            let (_, direct, through, cpu_per_request) = runs[runs.len() / 2];
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} µs | {:.0} | {:.0} µs | {:.1}% |",
                stream.name(),
                us(direct.0), us(direct.1), us(through.0), us(through.1),
                signed_us(through.0, direct.0), signed_us(through.1, direct.1),
                each.join(", "), through.2, cpu_per_request, stolen * 100.0,
            );
        }
        println!();
        println!("sidecar peak resident memory (VmHWM): {:.1} MiB", sidecar.peak_rss_kib() as f64 / 1024.0);
        if wanted(Mode::SseLong) {
            // Last: each call records 320 KB, and building the segments of hundreds of
            // them keeps a core busy for seconds, which would skew what runs after.
            println!();
            println!("closed loop, long streams (2,001 chunks, 320 KB, sent at once)");
            println!("| mode | clients | direct p50 | direct p99 | sidecar p50 | sidecar p99 | added p50 | added p99 | direct req/s | sidecar req/s |");
            println!("|---|---|---|---|---|---|---|---|---|---|");
            closed_pair(up, sidecar.addr, Mode::SseLong, 1, 100 * scale).await;
            closed_pair(up, sidecar.addr, Mode::SseLong, 64, 160 * scale).await;
            println!();
            println!("sidecar peak resident memory after 64 concurrent long streams (VmHWM): {:.1} MiB", sidecar.peak_rss_kib() as f64 / 1024.0);
        }
    });
}
