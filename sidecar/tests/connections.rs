//! Client connections: the `--max-connections` limit and the header read timeout.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CHAT_JSON: &str = r#"{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}"#;

/// Sends one request on `stream` and reads its response (head and a body of
/// `Content-Length` bytes) as text.
async fn round_trip(stream: &mut TcpStream, method: &str, path: &str, body: &str) -> String {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: sidecar\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if got.len() >= end + 4 + len {
                return String::from_utf8_lossy(&got[..end + 4 + len]).into_owned();
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("no response within 10 s")
            .unwrap();
        assert!(
            n > 0,
            "connection closed after {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
}

async fn health(addr: SocketAddr) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let resp = round_trip(&mut stream, "GET", "/tapline/v1/health", "").await;
    (stream, resp)
}

#[tokio::test]
async fn connections_beyond_the_limit_get_a_503_and_capacity_comes_back() {
    let upstream = Upstream::start(|_| Script::json(CHAT_JSON)).await;
    let (sidecar, store) = sidecar(&upstream.url(), |raw| raw.max_connections = Some(2)).await;
    let addr = sidecar.local_addr();

    // Two keep-alive connections hold the two places.
    let (first, resp) = health(addr).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let (mut second, resp) = health(addr).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");

    // A third is answered at once, in the API's error shape, and closed.
    let mut third = TcpStream::connect(addr).await.unwrap();
    let resp = round_trip(
        &mut third,
        "POST",
        "/v1/chat/completions",
        r#"{"model":"m","messages":[]}"#,
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    let lower = resp.to_lowercase();
    assert!(lower.contains("retry-after: 1"), "{resp}");
    assert!(lower.contains("connection: close"), "{resp}");
    assert!(resp.contains("\"code\":\"too_many_connections\""), "{resp}");
    assert!(resp.contains("--max-connections"), "{resp}");
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut rest))
        .await
        .expect("the refused connection is closed")
        .unwrap();
    assert_eq!(n, 0);
    assert!(
        upstream.received.lock().unwrap().is_empty(),
        "nothing reached the upstream"
    );

    // The served connections keep working, and a closed one frees its place.
    let resp = round_trip(
        &mut second,
        "POST",
        "/v1/chat/completions",
        r#"{"model":"m","messages":[]}"#,
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_again, resp) = health(addr).await;
        if resp.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the closed connection's place never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_m, metrics) = {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let r = round_trip(&mut s, "GET", "/metrics", "").await;
        (s, r)
    };
    let refused: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tapline_connections_refused_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(refused >= 1, "{metrics}");
    assert!(metrics.contains("tapline_connections_open "), "{metrics}");
    drop(second);
    sidecar
        .shutdown(Duration::from_secs(2), Duration::from_secs(2))
        .await;
    // Only the one call that was served is recorded.
    assert_eq!(calls(&store, 1).await.len(), 1);
}

#[tokio::test]
async fn half_a_request_head_does_not_hold_a_shutdown() {
    let upstream = Upstream::start(|_| Script::json(CHAT_JSON)).await;
    let (sidecar, _store) = sidecar(&upstream.url(), |raw| {
        raw.header_read_timeout_secs = Some(1.0)
    })
    .await;
    let mut slow = TcpStream::connect(sidecar.local_addr()).await.unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: sidecar\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    sidecar
        .shutdown(Duration::from_secs(30), Duration::from_secs(2))
        .await;
    let took = started.elapsed();
    // The connection is closed when its head times out (1 s), not when the 30 s drain
    // runs out; the bound leaves room for a slow machine.
    assert!(took < Duration::from_secs(15), "shutdown took {took:?}");
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut rest)).await;
}
