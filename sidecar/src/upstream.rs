//! The upstream side of the proxy: a pool of HTTP/1.1 keep-alive connections, each one
//! driven by the task that uses it.
//!
//! hyper's pooled client runs every connection as a task of its own and passes each body
//! chunk to the task that answers the client through a one-slot channel: a task wake-up
//! (often a thread wake-up) per chunk, and one write to the client per chunk. Here the
//! response body polls its connection itself, so the chunks already in the socket buffer
//! are decoded in one go and leave towards the client as one frame (one write). Nothing
//! waits for more data to coalesce: a frame carries what had arrived when it was polled.
//!
//! Invariants:
//! - A connection is in the pool only while idle: its response ended and its sender is
//!   ready for the next request. It is checked for a hang-up before it is reused.
//! - A request is sent again (on a fresh connection) only when hyper hands it back unsent,
//!   which happens when a pooled connection was closed by the upstream; a request that may
//!   have reached the upstream is never sent twice.
//! - Dropping a response body before its end closes the connection, which cancels the
//!   upstream request.

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tower_service::Service;

use crate::body::{BoxError, UpBody};

type Io = MaybeHttpsStream<TokioIo<TcpStream>>;
type Conn = http1::Connection<Io, UpBody>;

/// The most bytes one coalesced frame carries.
const COALESCE_MAX: usize = 64 << 10;

/// How long a connection whose response ended may take to become ready for the next
/// request before it is closed instead of pooled.
const READY_WAIT: Duration = Duration::from_secs(1);

/// Why a request got no response head.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be made (refused, DNS, TLS, connect timeout).
    Connect(BoxError),
    /// The connection failed while sending the request or reading the response head.
    Request(hyper::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(e) => write!(f, "cannot connect: {e}"),
            SendError::Request(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SendError::Connect(e) => e.source(),
            SendError::Request(e) => std::error::Error::source(e),
        }
    }
}

/// One connection: the sender half and the connection future that does its IO.
struct Lease {
    sender: http1::SendRequest<UpBody>,
    /// `None` once the connection future finished (the connection is closed).
    conn: Option<Pin<Box<Conn>>>,
}

impl Lease {
    /// Lets the connection do what it can (write, read, notice a hang-up). Returns whether
    /// the connection is closed.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(conn) = &mut self.conn
            && let Poll::Ready(result) = conn.as_mut().poll(cx)
        {
            if let Err(error) = result {
                tracing::debug!(%error, "upstream connection ended with an error");
            }
            self.conn = None;
        }
        self.conn.is_none()
    }
}

struct Idle {
    lease: Lease,
    since: Instant,
}

/// The upstream: where requests go and the idle connections to it.
pub struct Upstream {
    connector: HttpsConnector<HttpConnector>,
    /// Scheme and authority, for connecting.
    origin: Uri,
    /// `Host` header of every request.
    host: HeaderValue,
    idle: Mutex<VecDeque<Idle>>,
    max_idle: usize,
    idle_timeout: Duration,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("origin", &self.origin)
            .field("idle", &self.idle_count())
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// An upstream at `base` (its scheme and authority are used; the path is the
    /// caller's business), keeping up to `max_idle` connections for `idle_timeout`.
    pub fn new(
        base: &Uri,
        connect_timeout: Duration,
        max_idle: usize,
        idle_timeout: Duration,
    ) -> anyhow::Result<Upstream> {
        let (Some(scheme), Some(authority)) = (base.scheme(), base.authority()) else {
            anyhow::bail!("upstream URL {base} needs a scheme and a host");
        };
        let default_port = match scheme.as_str() {
            "http" => 80,
            "https" => 443,
            other => anyhow::bail!("upstream URL {base}: scheme {other:?} is not http or https"),
        };
        let host = match authority.port_u16() {
            Some(port) if port != default_port => format!("{}:{port}", authority.host()),
            _ => authority.host().to_owned(),
        };
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Upstream {
            connector,
            origin: Uri::builder()
                .scheme(scheme.clone())
                .authority(authority.clone())
                .path_and_query("/")
                .build()?,
            host: HeaderValue::from_str(&host)?,
            idle: Mutex::new(VecDeque::new()),
            max_idle,
            idle_timeout,
        })
    }

    /// Idle connections in the pool.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Sends `req` (its URI in origin form: path and query) and waits for the response
    /// head. The response body keeps the connection and returns it to the pool at its end.
    pub async fn send(
        self: &Arc<Self>,
        mut req: Request<UpBody>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        req.headers_mut().insert(header::HOST, self.host.clone());
        loop {
            let (mut lease, reused) = match self.checkout() {
                Some(lease) => (lease, true),
                None => (self.connect().await?, false),
            };
            let mut sent = std::pin::pin!(lease.sender.try_send_request(req));
            let result = poll_fn(|cx| {
                lease.drive(cx);
                sent.as_mut().poll(cx)
            })
            .await;
            match result {
                Ok(response) => {
                    return Ok(response.map(|inner| UpstreamBody {
                        inner,
                        lease: Some(lease),
                        pool: self.clone(),
                        stashed: None,
                        ended: false,
                    }));
                }
                Err(mut error) => match error.take_message() {
                    // A pooled connection closed before the request went out: use a new one.
                    Some(unsent) if reused => req = unsent,
                    _ => return Err(SendError::Request(error.into_error())),
                },
            }
        }
    }

    async fn connect(&self) -> Result<Lease, SendError> {
        let mut connector = self.connector.clone();
        poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(SendError::Connect)?;
        let io = connector
            .call(self.origin.clone())
            .await
            .map_err(SendError::Connect)?;
        let (sender, conn) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(SendError::Request)?;
        Ok(Lease {
            sender,
            conn: Some(Box::pin(conn)),
        })
    }

    /// The most recently used idle connection that is still open, if any.
    fn checkout(&self) -> Option<Lease> {
        loop {
            let Idle { mut lease, since } = self
                .idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_back()?;
            if since.elapsed() >= self.idle_timeout {
                // Everything older is further down the pool: let `put` prune it.
                return None;
            }
            // Notice a hang-up that arrived while the connection was idle.
            let mut cx = Context::from_waker(Waker::noop());
            if !lease.drive(&mut cx) && lease.sender.is_ready() {
                return Some(lease);
            }
        }
    }

    fn put(&self, lease: Lease) {
        let now = Instant::now();
        let mut stale = Vec::new();
        {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            while idle
                .front()
                .is_some_and(|i| now.duration_since(i.since) >= self.idle_timeout)
                || idle.len() >= self.max_idle.max(1)
            {
                stale.extend(idle.pop_front());
            }
            idle.push_back(Idle { lease, since: now });
        }
        drop(stale); // closes them, outside the lock
    }

    /// Pools a connection whose response ended, once it is ready for another request.
    fn release(self: &Arc<Self>, mut lease: Lease, cx: &mut Context<'_>) {
        if lease.drive(cx) {
            return;
        }
        if lease.sender.is_ready() {
            self.put(lease);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = self.clone();
        runtime.spawn(async move {
            let ready = tokio::time::timeout(
                READY_WAIT,
                poll_fn(|cx| {
                    if lease.drive(cx) {
                        return Poll::Ready(false);
                    }
                    lease.sender.poll_ready(cx).map(|r| r.is_ok())
                }),
            )
            .await;
            if ready == Ok(true) {
                pool.put(lease);
            }
        });
    }
}

/// A response body from the upstream. Polling it drives its connection; each frame
/// carries every data chunk that was ready (up to 64 KiB), not one chunk at a time.
pub struct UpstreamBody {
    inner: Incoming,
    lease: Option<Lease>,
    pool: Arc<Upstream>,
    /// What the inner body gave after data was gathered into a frame; given next.
    stashed: Option<Option<Result<Frame<Bytes>, hyper::Error>>>,
    ended: bool,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl UpstreamBody {
    fn release(&mut self, cx: &mut Context<'_>) {
        if let Some(lease) = self.lease.take() {
            self.pool.release(lease, cx);
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(stashed) = this.stashed.take() {
            this.ended = stashed.is_none();
            return Poll::Ready(stashed);
        }
        if this.ended {
            return Poll::Ready(None);
        }
        // The chunks that are ready, joined into one frame at the end (one exact copy).
        let mut ready: Vec<Bytes> = Vec::new();
        let mut gathered = 0usize;
        loop {
            if let Some(lease) = &mut this.lease {
                lease.drive(cx);
            }
            let polled = Pin::new(&mut this.inner).poll_frame(cx);
            let frame = match polled {
                Poll::Pending if ready.is_empty() => return Poll::Pending,
                Poll::Pending => break,
                Poll::Ready(Some(Ok(frame))) if frame.is_data() => frame,
                // Trailers, an error or the end: given after the data gathered so far.
                Poll::Ready(other) => {
                    if other.is_none() {
                        this.release(cx);
                    }
                    if ready.is_empty() {
                        this.ended = other.is_none();
                        return Poll::Ready(other);
                    }
                    this.stashed = Some(other);
                    break;
                }
            };
            let data = frame.into_data().unwrap_or_default();
            gathered += data.len();
            ready.push(data);
            if gathered >= COALESCE_MAX {
                break;
            }
        }
        let data = if ready.len() == 1 {
            ready.pop().unwrap_or_default()
        } else {
            let mut joined = BytesMut::with_capacity(gathered);
            for chunk in &ready {
                joined.extend_from_slice(chunk);
            }
            joined.freeze()
        };
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        match &self.stashed {
            Some(stashed) => stashed.is_none(),
            None => self.ended || self.inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        // Nothing more comes when the body ended, or when what is stashed is its end; a
        // stashed error or trailers are still to come.
        if self.ended || matches!(self.stashed, Some(None)) {
            return SizeHint::with_exact(0);
        }
        if self.stashed.is_some() {
            return SizeHint::default();
        }
        self.inner.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A body that ended (or was empty) leaves a reusable connection; one dropped
        // midway closes it with the lease.
        if self.lease.is_some() && (self.ended || self.inner.is_end_stream()) {
            let mut cx = Context::from_waker(Waker::noop());
            self.release(&mut cx);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::body::full_body;

    /// A raw HTTP/1.1 server: for each request head read on a connection, `answer` says
    /// what to write (a list of writes with pauses between them) and whether to close.
    struct Raw {
        addr: std::net::SocketAddr,
        connections: Arc<AtomicUsize>,
        heads: Arc<Mutex<Vec<String>>>,
        closed_by_client: Arc<AtomicUsize>,
    }

    type Answer = fn() -> (Vec<&'static [u8]>, bool);

    async fn raw(answer: Answer) -> Raw {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let closed_by_client = Arc::new(AtomicUsize::new(0));
        let (c, h, e) = (connections.clone(), heads.clone(), closed_by_client.clone());
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                c.fetch_add(1, Ordering::SeqCst);
                let (h, e) = (h.clone(), e.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let mut chunk = [0u8; 4096];
                        let n = socket.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            e.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        let head: Vec<u8> = buf.drain(..end + 4).collect();
                        h.lock()
                            .unwrap()
                            .push(String::from_utf8_lossy(&head).into_owned());
                        let (writes, close) = answer();
                        for (i, w) in writes.iter().enumerate() {
                            if i > 0 {
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            socket.write_all(w).await.unwrap();
                        }
                        if close {
                            return;
                        }
                    }
                });
            }
        });
        Raw {
            addr,
            connections,
            heads,
            closed_by_client,
        }
    }

    fn pool(addr: std::net::SocketAddr) -> Arc<Upstream> {
        let base: Uri = format!("http://{addr}/prefix").parse().unwrap();
        Arc::new(Upstream::new(&base, Duration::from_secs(2), 8, Duration::from_secs(90)).unwrap())
    }

    fn get(path: &str) -> Request<UpBody> {
        let mut req = Request::new(full_body(Bytes::new()));
        *req.uri_mut() = path.parse().unwrap();
        req
    }

    /// Frames of a body, as they come.
    async fn frames(mut body: UpstreamBody) -> Vec<Bytes> {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            out.extend(frame.unwrap().into_data().ok());
        }
        out
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    #[tokio::test]
    async fn a_connection_is_reused_and_requests_carry_host_and_origin_form() {
        let server = raw(|| (vec![OK], false)).await;
        let upstream = pool(server.addr);
        for i in 0..3 {
            let resp = upstream.send(get(&format!("/v1/x?i={i}"))).await.unwrap();
            assert_eq!(frames(resp.into_body()).await.concat(), b"ok");
        }
        assert_eq!(server.connections.load(Ordering::SeqCst), 1);
        assert_eq!(upstream.idle_count(), 1);
        let heads = server.heads.lock().unwrap().clone();
        assert!(
            heads[2].starts_with("GET /v1/x?i=2 HTTP/1.1\r\n"),
            "{}",
            heads[2]
        );
        assert!(
            heads[2].contains(&format!("host: {}\r\n", server.addr)),
            "{}",
            heads[2]
        );
    }

    #[tokio::test]
    async fn a_pooled_connection_the_upstream_closed_is_replaced() {
        // The upstream closes every connection after its response, without saying so.
        let server = raw(|| (vec![OK], true)).await;
        let upstream = pool(server.addr);
        for _ in 0..3 {
            let resp = upstream.send(get("/")).await.unwrap();
            assert_eq!(frames(resp.into_body()).await.concat(), b"ok");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(server.connections.load(Ordering::SeqCst), 3);
        assert_eq!(
            server.heads.lock().unwrap().len(),
            3,
            "each request sent once"
        );
    }

    #[tokio::test]
    async fn chunks_that_arrived_together_leave_as_one_frame() {
        let server = raw(|| {
            (
                vec![
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n2\r\ncd\r\n2\r\nef\r\n",
                    b"2\r\ngh\r\n0\r\n\r\n",
                ],
                false,
            )
        })
        .await;
        let upstream = pool(server.addr);
        let resp = upstream.send(get("/")).await.unwrap();
        let got = frames(resp.into_body()).await;
        // The first write's three chunks in one frame; the later write in its own.
        assert_eq!(got, vec![Bytes::from("abcdef"), Bytes::from("gh")]);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            upstream.idle_count(),
            1,
            "the connection went back to the pool"
        );
    }

    #[tokio::test]
    async fn dropping_a_body_midway_closes_its_connection() {
        let server = raw(|| {
            (
                vec![
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n",
                    b"2\r\ncd\r\n0\r\n\r\n",
                ],
                false,
            )
        })
        .await;
        let upstream = pool(server.addr);
        let resp = upstream.send(get("/")).await.unwrap();
        let mut body = resp.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "ab");
        drop(body);
        for _ in 0..100 {
            if server.closed_by_client.load(Ordering::SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(server.closed_by_client.load(Ordering::SeqCst), 1);
        assert_eq!(upstream.idle_count(), 0);
    }

    #[tokio::test]
    async fn an_unreachable_upstream_is_a_connect_error() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let upstream = pool(port); // the listener is gone: nothing listens there
        let error = upstream.send(get("/")).await.unwrap_err();
        assert!(matches!(error, SendError::Connect(_)), "{error}");
    }
}
