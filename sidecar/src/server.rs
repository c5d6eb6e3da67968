//! The HTTP server: one listener for proxied traffic, the control API and `/metrics`,
//! and the start/stop life cycle of a sidecar.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::{Request, Response, header};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;

use crate::body::{RespBody, full_body};
use crate::config::Config;
use crate::episodes::Episodes;
use crate::metrics::Metrics;
use crate::policy::PolicyFollower;
use crate::sink::{FullPolicy, Recorder, RecorderOptions};
use crate::upstream::Upstream;

/// [`AppState`] at the path it had before it moved to [`crate::state`] (`control.rs`
/// still imports it from here).
pub use crate::state::AppState;

/// Idle upstream connections kept for reuse. Each holds ~40 KB (hyper's read and write
/// buffers); a harness rarely has more calls in flight than this, and calls beyond it
/// still work, on connections opened for them.
pub const MAX_IDLE_UPSTREAM: usize = 128;

/// The upstream connection pool for the settings (HTTP/1.1 keep-alive, http and https).
pub fn upstream(config: &Config) -> anyhow::Result<Arc<Upstream>> {
    Ok(Arc::new(Upstream::new(
        &config.upstream,
        config.connect_timeout,
        MAX_IDLE_UPSTREAM,
        Duration::from_secs(90),
    )?))
}

/// Routes one request: `/metrics`, the control API, or the proxy.
pub async fn handle(
    state: Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, Infallible> {
    let path = req.uri().path();
    if path == "/metrics" && req.method() == http::Method::GET {
        let mut exposition = crate::metrics::Exposition::default();
        state
            .metrics
            .expose(state.episodes.open_count(), &mut exposition);
        state.budget.expose(&mut exposition);
        if let Some(policy) = &state.policy {
            policy.expose(&mut exposition);
        }
        let mut resp = Response::new(full_body(exposition.encode()));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
        );
        return Ok(resp);
    }
    if path == "/tapline" || path.starts_with("/tapline/") {
        return Ok(crate::control::handle(state, req).await);
    }
    Ok(crate::proxy::proxy(state, req).await)
}

/// A running sidecar.
#[derive(Debug)]
pub struct Sidecar {
    addr: SocketAddr,
    state: Arc<AppState>,
    stop: watch::Sender<bool>,
    server: JoinHandle<()>,
    recorder: Arc<Recorder>,
}

impl Sidecar {
    /// Binds the listener, opens the store and starts serving.
    pub async fn start(config: Config) -> anyhow::Result<Sidecar> {
        let store = tapline_proto::store::open_store(&config.store)?;
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.listen))?;
        let addr = listener.local_addr()?;
        let metrics = Arc::new(Metrics::default());
        let budget = crate::budget::MemoryBudget::new(config.memory_budget_bytes);
        let (recorder, _recovery) = Recorder::start(
            store.clone(),
            RecorderOptions {
                sidecar_id: config.sidecar_id.clone(),
                spool_dir: config.spool_dir.clone(),
                spool_max_bytes: config.spool_max_bytes,
                full_policy: config.spool_full_policy,
                segment_max_bytes: config.segment_max_bytes,
                segment_max_records: config.segment_max_records as u64,
                segment_max_age: config.segment_max_age,
                fsync_interval: config.fsync_interval,
                zstd_level: config.zstd_level,
                segment_format: config.segment_format,
                queue_capacity: 65_536,
                memory_budget: budget.clone(),
            },
            metrics.clone(),
        )
        .map_err(|e| anyhow::anyhow!("spool directory {}: {e}", config.spool_dir.display()))?;
        let (episodes, restored) = Episodes::open(&config.spool_dir).map_err(|e| {
            anyhow::anyhow!("episode journal in {}: {e}", config.spool_dir.display())
        })?;
        metrics
            .episodes_restored
            .store(restored.open as u64, Ordering::Relaxed);
        if restored.open + restored.known > 0 || restored.recovery.torn_bytes > 0 {
            tracing::info!(
                open = restored.open,
                remembered = restored.known,
                bound = restored.bound.as_deref().unwrap_or(""),
                torn_bytes = restored.recovery.torn_bytes,
                "restored the episode table from the journal"
            );
        }
        let ack_wait = match config.spool_full_policy {
            FullPolicy::Drop => Some(Duration::from_secs(2)),
            FullPolicy::Block => None,
        };
        let upstream_base = config.upstream.to_string().trim_end_matches('/').to_owned();
        let (stop, stop_rx) = watch::channel(false);
        let policy = match &config.policy {
            Some(p) => {
                let follower = Arc::new(PolicyFollower::new(
                    p.clone(),
                    store.store.clone(),
                    &store.prefix,
                ));
                // The first read before serving, so calls follow an announced policy from
                // the start; a store that does not answer in time is read again later.
                let _ = tokio::time::timeout(Duration::from_secs(5), follower.poll()).await;
                tokio::spawn(follower.clone().run(stop_rx.clone()));
                Some(follower)
            }
            None => None,
        };
        let state = Arc::new(AppState {
            upstream: upstream(&config)?,
            upstream_base,
            store_display: store.display.clone(),
            sink: recorder.clone(),
            recorder: Some(recorder.clone()),
            ack_wait,
            episodes,
            metrics,
            budget,
            policy,
            config,
        });
        tokio::spawn(keep_episodes(state.clone(), stop_rx.clone()));
        let server = tokio::spawn(accept_loop(listener, state.clone(), stop_rx));
        Ok(Sidecar {
            addr,
            state,
            stop,
            server,
            recorder,
        })
    }

    /// The address the sidecar listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Shared state (for tests and metrics).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// One line saying where the sidecar listens, forwards and records.
    pub fn describe(&self) -> String {
        format!(
            "tapline-sidecar {} listening on http://{}, forwarding to {} ({}), recording to {} as sidecar {:?}",
            env!("CARGO_PKG_VERSION"),
            self.addr,
            self.state.upstream_base,
            self.state.config.upstream_kind.as_str(),
            self.state.store_display,
            self.state.config.sidecar_id,
        )
    }

    /// Stops accepting connections, lets open responses finish for up to `drain`, then
    /// uploads queued records for up to `flush`.
    pub async fn shutdown(self, drain: Duration, flush: Duration) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(drain, self.server).await.is_err() {
            tracing::warn!(
                ?drain,
                "open connections did not finish in time; closing them"
            );
        }
        self.recorder.shutdown(flush).await;
    }
}

/// The episode table's background work: fsyncs its journal on the spool's interval
/// (a SIGKILL loses nothing written; this is for crashes of the machine) and ends
/// episodes idle for longer than `--episode-ttl-secs`.
async fn keep_episodes(state: Arc<AppState>, mut stop: watch::Receiver<bool>) {
    let ttl = state.config.episode_ttl;
    let sync_every = state.config.fsync_interval.max(Duration::from_millis(10));
    let check_every = (ttl / 10).clamp(Duration::from_millis(20), Duration::from_secs(30));
    let mut last_check = tokio::time::Instant::now();
    loop {
        let stopping = tokio::select! {
            _ = tokio::time::sleep(sync_every) => false,
            _ = stop.changed() => true,
        };
        if let Some(job) = state.episodes.sync_job() {
            let synced = tokio::task::spawn_blocking(move || job.and_then(|f| f.sync_data())).await;
            if let Ok(Err(error)) = synced {
                tracing::error!(%error, "episode journal fsync failed");
            }
        }
        if let Some(health) = state.episodes.journal_health() {
            state
                .metrics
                .episode_journal_errors
                .store(health.errors, Ordering::Relaxed);
        }
        if stopping {
            return;
        }
        if last_check.elapsed() >= check_every {
            last_check = tokio::time::Instant::now();
            crate::control::end_idle_episodes(&state, ttl).await;
        }
    }
}

/// Connections beyond `--max-connections` that are still answered (a 503 with
/// `Retry-After`); past these, new connections are closed at once.
pub const MAX_REFUSING_CONNECTIONS: usize = 64;

/// The answer to every request on a connection over `--max-connections`.
fn over_capacity(max: usize) -> Response<RespBody> {
    let body = serde_json::json!({"error": {
        "message": format!(
            "the tapline sidecar is serving its maximum of {max} connections (--max-connections); retry shortly"
        ),
        "type": "overloaded",
        "code": "too_many_connections",
    }});
    let mut resp = Response::new(full_body(body.to_string()));
    *resp.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    headers.insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    headers.insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    resp
}

/// Decrements the open-connection gauge when a connection ends, however it ends.
struct OpenConnection(Arc<Metrics>);

impl OpenConnection {
    fn new(metrics: &Arc<Metrics>) -> Self {
        metrics.connections_open.fetch_add(1, Ordering::Relaxed);
        OpenConnection(metrics.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.connections_open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<AppState>, mut stop: watch::Receiver<bool>) {
    let graceful = GracefulShutdown::new();
    let max = state.config.max_connections;
    let serving = Arc::new(Semaphore::new(max));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING_CONNECTIONS));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .keep_alive(true)
        // Also closes keep-alive connections idle this long, and bounds how long a
        // half-sent request head can hold a graceful shutdown.
        .header_read_timeout(state.config.header_read_timeout);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(conn) => conn,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let Ok(permit) = serving.clone().try_acquire_owned() else {
                    state.metrics.connections_refused.fetch_add(1, Ordering::Relaxed);
                    let Ok(permit) = refusing.clone().try_acquire_owned() else {
                        drop(stream);
                        continue;
                    };
                    let service = service_fn(move |_req: Request<Incoming>| async move {
                        Ok::<_, Infallible>(over_capacity(max))
                    });
                    let conn = http
                        .clone()
                        .keep_alive(false)
                        .serve_connection(TokioIo::new(stream), service);
                    let conn = graceful.watch(conn);
                    tokio::spawn(async move {
                        let _ = conn.await;
                        drop(permit);
                    });
                    continue;
                };
                let open = OpenConnection::new(&state.metrics);
                let state = state.clone();
                let service = service_fn(move |req| handle(state.clone(), req));
                let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
                tokio::spawn(async move {
                    if let Err(error) = conn.await {
                        tracing::debug!(%error, "connection ended with an error");
                    }
                    drop((permit, open));
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    graceful.shutdown().await;
}
