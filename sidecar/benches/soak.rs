//! Soak: the sidecar binary under steady mixed traffic for a long time, with its store
//! (a real S3-compatible server, s3s-fs) going down and up. Reports the sidecar's memory
//! (RSS) and spool depth over time, and checks at the end that every call, reward and
//! episode event reached the store exactly once.
//!
//! `cargo bench -p tapline-sidecar --bench soak -- [--minutes 30] [--rate 20]
//!   [--outage-every-secs 300] [--outage-secs 60] [--sample-secs 30] [--big-every 0]`
//!
//! Traffic: episodes of four calls (chat JSON, chat SSE, Anthropic Messages SSE,
//! Responses JSON; one call in 50 carries a 1 MiB prompt), a reward and an end, at
//! `--rate` calls per second, paced by the clock (open loop). With `--big-every N`, the
//! first call of every Nth episode is one at the capture cap: a 30 MB prompt answered by
//! a 20 MB event stream (20,000 events), the call that OOM-killed a 256Mi pod before the
//! memory budget.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::TryStreamExt;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tapline_proto::segment::{Limits, read_segment};
use tapline_proto::{EpisodeEventKind, RecordKind};

const ACCESS: &str = "AKIDTAPLINESOAK";
const SECRET: &str = "tapline-soak-secret";

#[derive(Debug, Clone)]
struct Options {
    minutes: f64,
    rate: f64,
    outage_every: Duration,
    outage: Duration,
    sample: Duration,
    big_every: u64,
}

fn options() -> Options {
    let mut o = Options {
        minutes: 30.0,
        rate: 20.0,
        outage_every: Duration::from_secs(300),
        outage: Duration::from_secs(60),
        sample: Duration::from_secs(30),
        big_every: 0,
    };
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = || -> f64 {
            it.clone()
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{flag} needs a number"))
        };
        let v = value();
        it.next();
        match flag.as_str() {
            "--minutes" => o.minutes = v,
            "--rate" => o.rate = v,
            "--outage-every-secs" => o.outage_every = Duration::from_secs_f64(v),
            "--outage-secs" => o.outage = Duration::from_secs_f64(v),
            "--sample-secs" => o.sample = Duration::from_secs_f64(v),
            "--big-every" => o.big_every = v as u64,
            other => panic!("unknown flag {other}"),
        }
    }
    o
}

/// s3s-fs with signature checks, serving buckets under `root`.
async fn s3_server(root: &Path) -> SocketAddr {
    std::fs::create_dir_all(root.join("records")).unwrap();
    let fs = s3s_fs::FileSystem::new(root).unwrap();
    let mut builder = s3s::service::S3ServiceBuilder::new(fs);
    builder.set_auth(s3s::auth::SimpleAuth::from_single(ACCESS, SECRET));
    let service = builder.build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let service = service.clone();
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    addr
}

/// A TCP relay in front of the store that can be switched off: when down, it cuts every
/// relayed connection and closes new ones at once, as a store outage looks to a client.
struct Switch {
    up: Arc<AtomicBool>,
    relays: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Switch {
    async fn start(to: SocketAddr) -> (SocketAddr, Switch) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(AtomicBool::new(true));
        let relays: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let (u, r) = (up.clone(), relays.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !u.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let relay = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                let mut relays = r.lock().unwrap();
                relays.retain(|h| !h.is_finished());
                relays.push(relay);
            }
        });
        (addr, Switch { up, relays })
    }

    fn set(&self, up: bool) {
        self.up.store(up, Ordering::SeqCst);
        if !up {
            for relay in self.relays.lock().unwrap().drain(..) {
                relay.abort();
            }
        }
    }
}

const SSE_CHAT: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Looking at the file\"},\"finish_reason\":null}]}\n\ndata: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"bash\",\"arguments\":\"{\\\"cmd\\\":\\\"ls\\\"}\"}}]},\"finish_reason\":null}]}\n\ndata: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}],\"usage\":{\"prompt_tokens\":120,\"completion_tokens\":9,\"total_tokens\":129}}\n\ndata: [DONE]\n\n";
const SSE_ANTHROPIC: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"m\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":120,\"output_tokens\":1}}}\n\nevent: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"The tests pass now.\"}}\n\nevent: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":6}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
const CHAT_JSON: &str = r#"{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Done: the bug was an off-by-one."},"finish_reason":"stop"}],"usage":{"prompt_tokens":120,"completion_tokens":9,"total_tokens":129}}"#;
const RESPONSES_JSON: &str = r#"{"id":"resp_1","object":"response","model":"m","status":"completed","output":[{"type":"message","id":"m1","role":"assistant","content":[{"type":"output_text","text":"Patched.","annotations":[]}]}],"usage":{"input_tokens":120,"output_tokens":3,"total_tokens":123}}"#;

/// The capture-cap answer: 20 MB of chat completion chunks, 1,000 characters each.
fn big_sse() -> Bytes {
    static BODY: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    BODY.get_or_init(|| {
        let piece = "y".repeat(1000);
        let mut body = String::with_capacity(21 << 20);
        for _ in 0..20_000 {
            body.push_str(&format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{piece}\"}},\"finish_reason\":null}}]}}\n\n"
            ));
        }
        body.push_str("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
        Bytes::from(body)
    })
    .clone()
}

/// The inference server: answers each API shape with a fixed body.
async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let path = req.uri().path().to_owned();
                    let query = req.uri().query().map(str::to_owned);
                    let _ = req.into_body().collect().await;
                    let (body, sse) = if path.ends_with("/messages") {
                        (Bytes::from_static(SSE_ANTHROPIC.as_bytes()), true)
                    } else if path.ends_with("/responses") {
                        (Bytes::from_static(RESPONSES_JSON.as_bytes()), false)
                    } else if query.as_deref() == Some("big") {
                        (big_sse(), true)
                    } else if query.as_deref() == Some("stream") {
                        (Bytes::from_static(SSE_CHAT.as_bytes()), true)
                    } else {
                        (Bytes::from_static(CHAT_JSON.as_bytes()), false)
                    };
                    let mut resp = Response::new(Full::new(body));
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

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn post(
    client: &HttpClient,
    url: String,
    body: Value,
) -> (http::StatusCode, http::HeaderMap, Bytes) {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    match client.request(req).await {
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            (parts.status, parts.headers, bytes)
        }
        Err(e) => panic!("request to the sidecar failed: {e}"),
    }
}

fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// A memory line of `/proc/PID/status` (`VmRSS:` now, `VmHWM:` the peak since start).
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
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

/// What the harness side sent, to check the store against.
#[derive(Debug, Default)]
struct Sent {
    spans: Vec<String>,
    rewards: Vec<String>,
    episodes: Vec<String>,
    /// Span ids of the capture-cap calls.
    big: Vec<String>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = options();
    let work = tempfile::tempdir().unwrap();
    let s3 = s3_server(&work.path().join("s3")).await;
    let (relay, switch) = Switch::start(s3).await;
    let upstream = upstream().await;
    let port = free_port();
    let store = format!(
        "s3://records/soak?endpoint=http://{relay}&region=us-east-1&access_key_id={ACCESS}&secret_access_key={SECRET}"
    );
    // TAPLINE_BENCH_SIDECAR runs another build (say, of the previous commit) instead.
    let binary = std::env::var_os("TAPLINE_BENCH_SIDECAR")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_tapline-sidecar").into());
    let mut sidecar: Child = Command::new(binary)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--upstream", &format!("http://{upstream}")])
        .args(["--store", &store, "--sidecar-id", "soak"])
        .arg("--spool-dir")
        .arg(work.path().join("spool"))
        .args(["--segment-max-age-secs", "2"])
        // Its log says every failed upload while the store is down: not for this table.
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the sidecar binary starts");
    let pid = sidecar.id();
    let base = format!("http://127.0.0.1:{port}");
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    for _ in 0..200 {
        let ok = client
            .get(format!("{base}/tapline/v1/health").parse().unwrap())
            .await
            .is_ok();
        if ok {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let idle_rss = rss_kib(pid);
    println!(
        "soak: {:.1} min at {} calls/s, store down {:?} every {:?}, a capture-cap call {}; sidecar pid {pid}, idle RSS {:.1} MiB",
        o.minutes,
        o.rate,
        o.outage,
        o.outage_every,
        match o.big_every {
            0 => "never".to_owned(),
            n => format!("every {n} episodes"),
        },
        idle_rss as f64 / 1024.0
    );
    println!(
        "| t (s) | store | calls sent | RSS (MiB) | budget held (MiB) | spool records | spool MiB |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|");

    let sent = Arc::new(Mutex::new(Sent::default()));
    let started = Instant::now();
    let total = Duration::from_secs_f64(o.minutes * 60.0);
    let interval = Duration::from_secs_f64(1.0 / o.rate);
    let mut next_sample = Duration::ZERO;
    let mut samples: Vec<(f64, u64)> = Vec::new();
    let mut max_spool = 0u64;
    let mut in_flight = tokio::task::JoinSet::new();
    let mut episode_no = 0u64;
    let mut next_call = Instant::now();
    let mut current: Option<(String, u32)> = None;
    while started.elapsed() < total {
        let t = started.elapsed();
        // The store is down for `outage` at the end of every `outage_every` period.
        let phase = t.as_secs_f64() % o.outage_every.as_secs_f64();
        let up = phase < (o.outage_every - o.outage).as_secs_f64();
        switch.set(up);
        if t >= next_sample {
            next_sample += o.sample;
            let (_, _, health) = post_get(&client, format!("{base}/tapline/v1/health")).await;
            let health: Value = serde_json::from_slice(&health).unwrap_or(Value::Null);
            let spool_records = health["spool_records"].as_u64().unwrap_or(0);
            max_spool = max_spool.max(spool_records);
            let rss = rss_kib(pid);
            samples.push((t.as_secs_f64(), rss));
            println!(
                "| {:.0} | {} | {} | {:.1} | {:.1} | {} | {:.2} |",
                t.as_secs_f64(),
                if up { "up" } else { "down" },
                sent.lock().unwrap().spans.len(),
                rss as f64 / 1024.0,
                health["memory_budget"]["used_bytes"].as_u64().unwrap_or(0) as f64
                    / (1 << 20) as f64,
                spool_records,
                health["spool_bytes"].as_u64().unwrap_or(0) as f64 / (1 << 20) as f64,
            );
        }
        // One call per tick; an episode is opened before its first call and closed
        // (reward, end) after its fourth.
        tokio::time::sleep_until(next_call.into()).await;
        next_call += interval;
        let (episode, turn) = match current.take() {
            Some(c) => c,
            None => {
                episode_no += 1;
                let (status, _, body) = post(
                    &client,
                    format!("{base}/tapline/v1/episodes"),
                    json!({"task_id": format!("task-{}", episode_no % 7), "group_id": "soak"}),
                )
                .await;
                assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
                let v: Value = serde_json::from_slice(&body).unwrap();
                let id = v["episode_id"].as_str().unwrap().to_owned();
                sent.lock().unwrap().episodes.push(id.clone());
                (id, 0)
            }
        };
        let (path, body) = match turn {
            0 => (
                "v1/chat/completions",
                json!({"model": "m", "messages": [{"role": "user", "content": "Fix the failing test."}]}),
            ),
            1 => (
                "v1/chat/completions?stream",
                json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "Fix the failing test."}, {"role": "assistant", "content": "Looking."}]}),
            ),
            2 => (
                "v1/messages",
                json!({"model": "m", "max_tokens": 64, "stream": true, "messages": [{"role": "user", "content": "Run the tests."}]}),
            ),
            _ => (
                "v1/responses",
                json!({"model": "m", "input": "Summarize the patch."}),
            ),
        };
        let mut body = body;
        let mut path = path;
        let big = o.big_every > 0 && episode_no.is_multiple_of(o.big_every) && turn == 0;
        if big {
            body["messages"][0]["content"] = json!("x".repeat(30_000_000));
            body["stream"] = json!(true);
            path = "v1/chat/completions?big";
        } else if episode_no.is_multiple_of(50) && turn == 0 {
            body["messages"][0]["content"] = json!("x".repeat(1 << 20));
        }
        let url = format!("{base}/e/{episode}/{path}");
        let (client2, sent2) = (client.clone(), sent.clone());
        let closing = turn == 3;
        let (base2, episode2) = (base.clone(), episode.clone());
        in_flight.spawn(async move {
            let (status, headers, _) = post(&client2, url, body).await;
            assert!(status.is_success(), "call failed: {status}");
            let span = headers["x-tapline-span-id"].to_str().unwrap().to_owned();
            {
                let mut sent = sent2.lock().unwrap();
                if big {
                    sent.big.push(span.clone());
                }
                sent.spans.push(span);
            }
            if closing {
                let (status, _, body) = post(
                    &client2,
                    format!("{base2}/tapline/v1/episodes/{episode2}/rewards"),
                    json!({"value": 1.0}),
                )
                .await;
                assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
                let v: Value = serde_json::from_slice(&body).unwrap();
                sent2
                    .lock()
                    .unwrap()
                    .rewards
                    .push(v["reward_id"].as_str().unwrap().to_owned());
                let (status, _, body) = post(
                    &client2,
                    format!("{base2}/tapline/v1/episodes/{episode2}/end"),
                    json!({"status": "succeeded"}),
                )
                .await;
                assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            }
        });
        if !closing {
            current = Some((episode, turn + 1));
        }
        while in_flight.try_join_next().is_some() {}
    }
    while in_flight.join_next().await.is_some() {}
    switch.set(true);
    let end_rss = rss_kib(pid);
    let high_water = status_kib(pid, "VmHWM:");
    // SIGTERM: the sidecar drains and flushes its spool, then exits.
    let stopping = Instant::now();
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let status = sidecar.wait().unwrap();
    assert!(status.success(), "the sidecar exited with {status}");
    let stop_took = stopping.elapsed();

    // Every record in the store, counted by id.
    let loc = tapline_proto::store::open_store(&store).unwrap();
    let metas: Vec<_> = loc.store.list(None).try_collect().await.unwrap();
    let mut spans: HashMap<String, u32> = HashMap::new();
    let mut rewards: HashMap<String, u32> = HashMap::new();
    let mut events: BTreeMap<(String, i32), u32> = BTreeMap::new();
    let mut stored_bytes = 0u64;
    // Capture-cap calls as stored: (request bytes, response bytes, cut by the budget,
    // cut to fit the record limit).
    let mut big_stored: HashMap<String, (usize, usize, bool, bool)> = HashMap::new();
    for m in &metas {
        let bytes = loc
            .store
            .get(&m.location)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        stored_bytes += bytes.len() as u64;
        let contents = read_segment(&bytes, Limits::default()).expect("every segment reads");
        assert!(contents.skipped.is_empty());
        for r in contents.records {
            match r.kind {
                Some(RecordKind::LlmCall(c)) => {
                    if c.request_body.len() > 10_000_000 || c.request_truncated {
                        let cut = c
                            .capture_warnings
                            .iter()
                            .any(|w| w.contains("memory_budget"));
                        let fitted = c
                            .capture_warnings
                            .iter()
                            .any(|w| w.starts_with("record_too_large:"));
                        big_stored.insert(
                            c.span_id.clone(),
                            (c.request_body.len(), c.response_body.len(), cut, fitted),
                        );
                    }
                    *spans.entry(c.span_id).or_default() += 1
                }
                Some(RecordKind::Reward(w)) => *rewards.entry(w.reward_id).or_default() += 1,
                Some(RecordKind::EpisodeEvent(e)) => {
                    *events.entry((e.episode_id, e.kind)).or_default() += 1
                }
                None => {}
            }
        }
    }
    let sent = sent.lock().unwrap();
    let missing_calls = sent
        .spans
        .iter()
        .filter(|s| !spans.contains_key(*s))
        .count();
    let duplicate_calls = spans.values().filter(|n| **n > 1).count();
    let missing_rewards = sent
        .rewards
        .iter()
        .filter(|s| !rewards.contains_key(*s))
        .count();
    let duplicate_rewards = rewards.values().filter(|n| **n > 1).count();
    let missing_starts = sent
        .episodes
        .iter()
        .filter(|e| !events.contains_key(&((*e).clone(), EpisodeEventKind::Start as i32)))
        .count();
    let duplicate_events = events.values().filter(|n| **n > 1).count();
    let missing_big = sent
        .big
        .iter()
        .filter(|s| !big_stored.contains_key(*s))
        .count();
    let whole_big = sent
        .big
        .iter()
        .filter(|s| {
            big_stored.get(*s).is_some_and(|&(req, resp, cut, fitted)| {
                !cut && !fitted && req > 30_000_000 && resp > 20_000_000
            })
        })
        .count();
    let cut_big = sent
        .big
        .iter()
        .filter(|s| big_stored.get(*s).is_some_and(|b| b.2))
        .count();
    // The request whole, the raw answer cut so that the record (with the completion
    // rebuilt whole) stays under the readers' 64 MiB limit (`limits::fit_call`).
    let fitted_big = sent
        .big
        .iter()
        .filter(|s| {
            big_stored
                .get(*s)
                .is_some_and(|&(req, _, cut, fitted)| !cut && fitted && req > 30_000_000)
        })
        .count();
    let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
    let half = samples.len() / 2;
    let late_mean = samples[half..].iter().map(|s| s.1).sum::<u64>() as f64
        / samples[half..].len().max(1) as f64;
    let early_mean = samples[..half].iter().map(|s| s.1).sum::<u64>() as f64 / half.max(1) as f64;
    println!();
    println!(
        "soak result: {} calls, {} rewards, {} episodes sent; store holds {} calls ({} missing, {} twice), {} rewards ({} missing, {} twice), {} episode events ({} starts missing, {} twice) in {} segments, {:.1} MiB",
        sent.spans.len(),
        sent.rewards.len(),
        sent.episodes.len(),
        spans.len(),
        missing_calls,
        duplicate_calls,
        rewards.len(),
        missing_rewards,
        duplicate_rewards,
        events.len(),
        missing_starts,
        duplicate_events,
        metas.len(),
        stored_bytes as f64 / (1 << 20) as f64,
    );
    println!(
        "soak memory: idle {:.1} MiB, peak {:.1} MiB sampled ({:.1} MiB VmHWM), mean of the first half {:.1} MiB, of the second half {:.1} MiB, at the end {:.1} MiB; largest spool {} records; SIGTERM to exit {:.1?}",
        idle_rss as f64 / 1024.0,
        peak as f64 / 1024.0,
        high_water as f64 / 1024.0,
        early_mean / 1024.0,
        late_mean / 1024.0,
        end_rss as f64 / 1024.0,
        max_spool,
        stop_took,
    );
    if o.big_every > 0 {
        println!(
            "soak capture-cap calls: {} sent; stored whole {}, request whole and raw answer cut to the record limit {}, cut by the memory budget {}, not found as capture-cap records {}",
            sent.big.len(),
            whole_big,
            fitted_big,
            cut_big,
            missing_big,
        );
    }
    assert_eq!(
        (
            missing_calls,
            duplicate_calls,
            missing_rewards,
            duplicate_rewards,
            missing_starts,
            duplicate_events
        ),
        (0, 0, 0, 0, 0, 0),
        "every call, reward and episode event reaches the store exactly once"
    );
}

async fn post_get(client: &HttpClient, url: String) -> (http::StatusCode, http::HeaderMap, Bytes) {
    match client.get(url.parse().unwrap()).await {
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            (parts.status, parts.headers, bytes)
        }
        Err(e) => panic!("health check failed: {e}"),
    }
}
