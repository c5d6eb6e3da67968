//! Test harness: a scripted upstream, a sidecar on a fresh in-memory store, a client,
//! and readers for the records the sidecar stored.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, TryStreamExt};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tapline_proto::segment::{Limits, decode_segment};
use tapline_proto::{LlmCall, Record, RecordKind};
use tapline_sidecar::config::RawConfig;
use tapline_sidecar::server::Sidecar;
use tokio::sync::Notify;

/// A request the upstream received.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// How the upstream answers one request.
#[derive(Debug, Clone)]
pub struct Script {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub chunks: Vec<Bytes>,
    /// Delay before the response head.
    pub head_delay: Duration,
    /// Delay before each chunk.
    pub chunk_delay: Duration,
    /// Wait for this before sending chunk `gate_before`.
    pub gate: Option<(usize, Arc<Notify>)>,
    /// Fail the body (connection reset) after the chunks.
    pub abort_after_chunks: bool,
}

impl Script {
    pub fn json(body: impl Into<Bytes>) -> Script {
        Script {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            chunks: vec![body.into()],
            head_delay: Duration::ZERO,
            chunk_delay: Duration::ZERO,
            gate: None,
            abort_after_chunks: false,
        }
    }

    pub fn sse(chunks: Vec<Bytes>) -> Script {
        Script {
            headers: vec![(
                "content-type".into(),
                "text/event-stream; charset=utf-8".into(),
            )],
            chunks,
            ..Script::json(Bytes::new())
        }
    }
}

type Handler = dyn Fn(&Received) -> Script + Send + Sync;

/// An HTTP/1.1 server that answers from a script and remembers what it received.
pub struct Upstream {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Vec<Received>>>,
    /// Set when a response body could not be sent because the receiver went away.
    pub cancelled: Arc<AtomicBool>,
    pub connections: Arc<AtomicUsize>,
}

impl Upstream {
    pub async fn start(handler: impl Fn(&Received) -> Script + Send + Sync + 'static) -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handler: Arc<Handler> = Arc::new(handler);
        let received = Arc::new(Mutex::new(Vec::new()));
        let cancelled = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(AtomicUsize::new(0));
        let (r, c, n) = (received.clone(), cancelled.clone(), connections.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                n.fetch_add(1, Ordering::SeqCst);
                let (handler, r, c) = (handler.clone(), r.clone(), c.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let (handler, r, c) = (handler.clone(), r.clone(), c.clone());
                        async move { Ok::<_, Infallible>(serve(req, &*handler, &r, &c).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Upstream {
            addr,
            received,
            cancelled,
            connections,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn last(&self) -> Received {
        self.received
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("upstream received a request")
    }

    /// How many requests reached the upstream.
    #[allow(dead_code)]
    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }
}

type UpstreamBody =
    StreamBody<futures::channel::mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>>;

async fn serve(
    req: Request<Incoming>,
    handler: &Handler,
    log: &Mutex<Vec<Received>>,
    cancelled: &Arc<AtomicBool>,
) -> Response<UpstreamBody> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let received = Received {
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default(),
        headers: parts.headers,
        body,
    };
    let script = handler(&received);
    log.lock().unwrap().push(received);
    tokio::time::sleep(script.head_delay).await;
    let (mut tx, rx) = futures::channel::mpsc::channel(1);
    let cancelled = cancelled.clone();
    let script2 = script.clone();
    tokio::spawn(async move {
        for (i, chunk) in script2.chunks.into_iter().enumerate() {
            if let Some((at, gate)) = &script2.gate
                && *at == i
            {
                gate.notified().await;
            }
            tokio::time::sleep(script2.chunk_delay).await;
            if tx.send(Ok(Frame::data(chunk))).await.is_err() {
                cancelled.store(true, Ordering::SeqCst);
                return;
            }
        }
        if script2.abort_after_chunks {
            // Let the chunks reach the wire before the connection breaks.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = tx.send(Err(std::io::Error::other("scripted abort"))).await;
        }
    });
    let mut resp = Response::new(StreamBody::new(rx));
    *resp.status_mut() = StatusCode::from_u16(script.status).unwrap();
    for (k, v) in &script.headers {
        resp.headers_mut().append(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    resp
}

/// Starts a sidecar in front of `upstream` with a fresh in-memory store.
pub async fn sidecar(upstream: &str, tweak: impl FnOnce(&mut RawConfig)) -> (Sidecar, String) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    let store = format!("memory://proxy-test-{}-{n}", std::process::id());
    // Every sidecar gets its own spool: a spool belongs to one sidecar.
    let spool = std::env::temp_dir().join(format!("tapline-test-spool-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&spool);
    let mut raw = RawConfig {
        listen: Some("127.0.0.1:0".into()),
        upstream: Some(upstream.to_owned()),
        store: Some(store.clone()),
        spool_dir: Some(spool),
        sidecar_id: Some("test-sidecar".into()),
        segment_max_age_secs: Some(0.05),
        response_timeout_secs: Some(5.0),
        ..Default::default()
    };
    tweak(&mut raw);
    let sidecar = Sidecar::start(raw.validate().unwrap()).await.unwrap();
    (sidecar, store)
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub fn post(addr: SocketAddr, path: &str, body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .unwrap()
}

/// Sends a request and reads the whole response.
pub async fn send(
    client: &TestClient,
    req: Request<Full<Bytes>>,
) -> (StatusCode, HeaderMap, Bytes) {
    let resp = client.request(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, body)
}

/// Every record in the store, in key order.
pub async fn records(store: &str) -> Vec<Record> {
    let loc = tapline_proto::store::open_store(store).unwrap();
    let root = tapline_proto::keys::segments_root(&loc.prefix);
    let mut metas: Vec<_> = loc.store.list(Some(&root)).try_collect().await.unwrap();
    metas.sort_by(|a, b| a.location.cmp(&b.location));
    let mut out = Vec::new();
    for m in metas {
        let bytes = loc
            .store
            .get(&m.location)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        out.extend(decode_segment(&bytes, Limits::default()).unwrap());
    }
    out
}

/// Waits until the store holds at least `n` LLM call records; returns them.
pub async fn calls(store: &str, n: usize) -> Vec<LlmCall> {
    // 30 s: segments are sealed and uploaded by background threads, which a loaded
    // machine (CI with other builds) can delay by seconds.
    for _ in 0..1200 {
        let calls: Vec<LlmCall> = records(store)
            .await
            .into_iter()
            .filter_map(|r| match r.kind {
                Some(RecordKind::LlmCall(c)) => Some(c),
                _ => None,
            })
            .collect();
        if calls.len() >= n {
            return calls;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("store {store} never held {n} calls");
}

pub fn fixture(name: &str) -> Bytes {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Bytes::from(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

/// Reads a streamed body frame by frame.
pub async fn next_chunk(body: &mut Incoming) -> Option<Bytes> {
    loop {
        let frame = body.frame().await?.ok()?;
        if let Ok(data) = frame.into_data() {
            return Some(data);
        }
    }
}
