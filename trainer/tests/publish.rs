//! `publish`: an adapter goes to every inference server under `NAME@vN`, then the version
//! is announced; against scripted vLLM and SGLang servers and real object stores.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tapline_proto::policy::announcement_path;
use tapline_proto::store::open_store;
use tapline_trainer::publish::{PublishOptions, ServerKind, announced, publish};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A server that records `(path, JSON body)` of each POST and answers `status`.
struct Scripted {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<(String, Value)>>>,
}

impl Scripted {
    async fn start(status: u16) -> Scripted {
        Scripted::start_slow(status, None).await
    }

    /// Loads of the served name `slow.0` take `slow.1` before they are answered.
    async fn start_slow(status: u16, slow: Option<(&'static str, Duration)>) -> Scripted {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let log = log.clone();
                tokio::spawn(async move {
                    let mut got = Vec::new();
                    let mut buf = [0u8; 4096];
                    let (head_end, len) = loop {
                        let n = socket.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        got.extend_from_slice(&buf[..n]);
                        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                            let len: usize = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .map_or(0, |v| v.trim().parse().unwrap());
                            break (end + 4, len);
                        }
                    };
                    while got.len() < head_end + len {
                        let n = socket.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        got.extend_from_slice(&buf[..n]);
                    }
                    let head = String::from_utf8_lossy(&got[..head_end]).into_owned();
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                    let body = serde_json::from_slice(&got[head_end..head_end + len])
                        .unwrap_or(Value::Null);
                    let delay = match slow {
                        Some((name, delay))
                            if path.ends_with("/load_lora_adapter")
                                && body["lora_name"] == name =>
                        {
                            delay
                        }
                        _ => Duration::ZERO,
                    };
                    log.lock().unwrap().push((path, body));
                    tokio::time::sleep(delay).await;
                    let text = if status == 200 {
                        "Success"
                    } else {
                        "The adapter could not be read"
                    };
                    let resp = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                        text.len()
                    );
                    let _ = socket.write_all(resp.as_bytes()).await;
                });
            }
        });
        Scripted { addr, seen }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<(String, Value)> {
        self.seen.lock().unwrap().clone()
    }
}

fn adapter_dir(root: &Path) -> std::path::PathBuf {
    let dir = root.join("adapter");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), r#"{"peft_type":"LORA"}"#).unwrap();
    std::fs::write(dir.join("manifest.json"), r#"{"run":"run-7"}"#).unwrap();
    dir
}

fn options(from: &Path, servers: &[&Scripted], kind: ServerKind) -> PublishOptions {
    PublishOptions {
        policy: "coder".into(),
        from: from.to_owned(),
        servers: servers.iter().map(|s| s.url()).collect(),
        server_kind: kind,
        path_on_server: Some("/srv/adapters/coder".into()),
        keep_loaded: 2,
        timeout: Duration::from_secs(10),
    }
}

#[tokio::test]
async fn every_server_loads_each_version_then_it_is_announced_and_old_ones_unloaded() {
    let tmp = tempfile::tempdir().unwrap();
    let from = adapter_dir(tmp.path());
    let store_dir = tmp.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let store = open_store(&format!("file://{}", store_dir.display())).unwrap();
    let (a, b) = (Scripted::start(200).await, Scripted::start(200).await);
    let opts = options(&from, &[&a, &b], ServerKind::Vllm);

    for version in 1..=3u64 {
        let published = publish(&store, &opts).await.unwrap();
        assert_eq!(published.announcement.version, version);
        assert_eq!(
            published.announcement.served_model,
            format!("coder@v{version}")
        );
        let now = announced(&store, "coder").await.unwrap().unwrap();
        assert_eq!(now, published.announcement);
        assert_eq!(now.run, "run-7");
        assert_eq!(now.manifest_sha256.len(), 64);
        assert_eq!(now.adapter.as_deref(), Some("/srv/adapters/coder"));
    }
    for server in [&a, &b] {
        assert_eq!(
            server.seen(),
            vec![
                (
                    "/v1/load_lora_adapter".into(),
                    json!({"lora_name": "coder@v1", "lora_path": "/srv/adapters/coder"})
                ),
                (
                    "/v1/load_lora_adapter".into(),
                    json!({"lora_name": "coder@v2", "lora_path": "/srv/adapters/coder"})
                ),
                (
                    "/v1/load_lora_adapter".into(),
                    json!({"lora_name": "coder@v3", "lora_path": "/srv/adapters/coder"})
                ),
                (
                    "/v1/unload_lora_adapter".into(),
                    json!({"lora_name": "coder@v1"})
                ),
            ]
        );
    }
    // The announcement is what sidecars read.
    let raw = store
        .store
        .get(&announcement_path(&store.prefix, "coder"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&raw).unwrap();
    assert_eq!(
        (v["format"].as_str(), v["version"].as_u64()),
        (Some("tapline.policy.v1"), Some(3))
    );

    // SGLang's paths.
    let s = Scripted::start(200).await;
    let mut sg = options(&from, &[&s], ServerKind::Sglang);
    sg.policy = "other".into();
    publish(&store, &sg).await.unwrap();
    assert_eq!(s.seen()[0].0, "/load_lora_adapter");
}

#[tokio::test]
async fn a_server_that_fails_is_named_and_nothing_is_announced() {
    let tmp = tempfile::tempdir().unwrap();
    let from = adapter_dir(tmp.path());
    let store = open_store("memory://publish-failing").unwrap();
    let (good, bad) = (Scripted::start(200).await, Scripted::start(500).await);
    let err = publish(&store, &options(&from, &[&good, &bad], ServerKind::Vllm))
        .await
        .unwrap_err();
    let text = format!("{err:#}");
    assert!(text.contains(&bad.url()), "{text}");
    assert!(text.contains("nothing was announced"), "{text}");
    assert!(text.contains("The adapter could not be read"), "{text}");
    assert!(announced(&store, "coder").await.unwrap().is_none());
    // The server that had loaded it unloads it again.
    assert_eq!(
        good.seen()
            .iter()
            .map(|(p, b)| (p.as_str(), b["lora_name"].as_str().unwrap().to_owned()))
            .collect::<Vec<_>>(),
        [
            ("/v1/load_lora_adapter", "coder@v1".to_owned()),
            ("/v1/unload_lora_adapter", "coder@v1".to_owned())
        ]
    );
    // The next publish skips the burned version.
    let ok = publish(&store, &options(&from, &[&good], ServerKind::Vllm))
        .await
        .unwrap();
    assert_eq!(ok.announcement.version, 2);

    // Not an adapter: refused before anything happens.
    let full = tmp.path().join("full");
    std::fs::create_dir_all(&full).unwrap();
    std::fs::write(full.join("config.json"), "{}").unwrap();
    let err = publish(&store, &options(&full, &[&good], ServerKind::Vllm))
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("full checkpoint"), "{err:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_concurrent_publishers_exactly_one_gets_each_version() {
    let tmp = tempfile::tempdir().unwrap();
    let from = adapter_dir(tmp.path());
    let store_dir = tmp.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let url = format!("file://{}", store_dir.display());
    let server = Scripted::start(200).await;
    for round in 0..5 {
        let (s1, s2) = (open_store(&url).unwrap(), open_store(&url).unwrap());
        let (o1, o2) = (
            options(&from, &[&server], ServerKind::Vllm),
            options(&from, &[&server], ServerKind::Vllm),
        );
        let (r1, r2) = tokio::join!(publish(&s1, &o1), publish(&s2, &o2));
        let versions: Vec<u64> = [&r1, &r2]
            .iter()
            .filter_map(|r| r.as_ref().ok().map(|p| p.announcement.version))
            .collect();
        // Both may succeed one after the other (then with different versions); never
        // both with the same one.
        assert!(!versions.is_empty(), "round {round}: {r1:?} {r2:?}");
        if versions.len() == 2 {
            assert_ne!(versions[0], versions[1], "round {round}");
        } else {
            let loser = match (r1, r2) {
                (Err(e), _) | (_, Err(e)) => e,
                _ => unreachable!("one of the two failed"),
            };
            assert!(
                format!("{loser:#}").contains("another publisher claimed version"),
                "{loser:#}"
            );
        }
        let now = announced(&s1, "coder").await.unwrap().unwrap();
        assert_eq!(now.version, *versions.iter().max().unwrap());
    }
    // Every load was of a distinct version: no served name was loaded twice.
    let loads: Vec<String> = server
        .seen()
        .into_iter()
        .filter(|(p, _)| p == "/v1/load_lora_adapter")
        .map(|(_, b)| b["lora_name"].as_str().unwrap().to_owned())
        .collect();
    let mut unique = loads.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(loads.len(), unique.len(), "{loads:?}");
}

/// A publisher overtaken while its servers load: the newer one does not unload the
/// version being loaded, the older one never announces itself over the newer one, and
/// unloads itself when `keep_loaded` leaves no room for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_overtaken_while_loading_never_announces_an_older_version() {
    let tmp = tempfile::tempdir().unwrap();
    let from = adapter_dir(tmp.path());
    let store_dir = tmp.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let url = format!("file://{}", store_dir.display());
    let server = Scripted::start_slow(200, Some(("coder@v1", Duration::from_millis(1500)))).await;
    let mut opts = options(&from, &[&server], ServerKind::Vllm);
    opts.keep_loaded = 1;
    let (s1, s2) = (open_store(&url).unwrap(), open_store(&url).unwrap());
    let slow = {
        let opts = opts.clone();
        tokio::spawn(async move { publish(&s1, &opts).await })
    };
    // The slow publisher has claimed version 1 and is loading it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.seen().is_empty() {
        assert!(std::time::Instant::now() < deadline, "no load arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let fast = publish(&s2, &opts).await.unwrap();
    assert_eq!(fast.announcement.version, 2);
    assert_eq!(fast.superseded_by, None);
    assert!(
        fast.unloaded.is_empty(),
        "version 1 is being loaded by its publisher: {:?}",
        fast.unloaded
    );
    let slow = slow.await.unwrap().unwrap();
    assert_eq!(slow.announcement.version, 1);
    assert_eq!(slow.superseded_by, Some(2));
    assert_eq!(slow.unloaded, ["coder@v1"]);
    let store = open_store(&url).unwrap();
    assert_eq!(
        announced(&store, "coder").await.unwrap().unwrap().version,
        2
    );
    let calls: Vec<(String, String)> = server
        .seen()
        .into_iter()
        .map(|(p, b)| (p, b["lora_name"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(
        calls,
        [
            ("/v1/load_lora_adapter".to_owned(), "coder@v1".to_owned()),
            ("/v1/load_lora_adapter".to_owned(), "coder@v2".to_owned()),
            ("/v1/unload_lora_adapter".to_owned(), "coder@v1".to_owned()),
        ]
    );
    // The next publish unloads version 2 and announces 3; nothing older comes back.
    let next = publish(&store, &opts).await.unwrap();
    assert_eq!(next.announcement.version, 3);
    // (Version 1 is unloaded again too: older versions within a window are retried.)
    assert_eq!(next.unloaded, ["coder@v1", "coder@v2"]);
    assert_eq!(
        announced(&store, "coder").await.unwrap().unwrap().version,
        3
    );
}

/// `keep_loaded` counts live versions, not version numbers: publishes that failed (and
/// burned numbers) do not make the previous live version go early.
#[tokio::test]
async fn failed_publishes_do_not_unload_the_previous_live_version_early() {
    let tmp = tempfile::tempdir().unwrap();
    let from = adapter_dir(tmp.path());
    let store = open_store("memory://publish-gaps").unwrap();
    let (good, bad) = (Scripted::start(200).await, Scripted::start(500).await);
    let ok = options(&from, &[&good], ServerKind::Vllm);
    let failing = options(&from, &[&good, &bad], ServerKind::Vllm);
    assert_eq!(publish(&store, &ok).await.unwrap().announcement.version, 1);
    for _ in 0..3 {
        publish(&store, &failing).await.unwrap_err();
    }
    let fifth = publish(&store, &ok).await.unwrap();
    assert_eq!(fifth.announcement.version, 5);
    assert!(
        fifth.unloaded.is_empty(),
        "version 1 is the previous live one: {:?}",
        fifth.unloaded
    );
    let sixth = publish(&store, &ok).await.unwrap();
    assert_eq!(sixth.unloaded, ["coder@v1"]);
}
