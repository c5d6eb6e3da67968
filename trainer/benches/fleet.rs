//! Ingest at fleet scale: a store written by many sidecars, read by the trainer twice
//! (the first run, then an incremental run after more segments arrive, some of them
//! late), on the local file store and on s3s-fs (a real S3 server, over HTTP).
//!
//! `cargo bench -p tapline-trainer --bench fleet [-- --segments 1000,10000
//! [--stores local,s3] [--concurrency 32] [--s3-max 10000] [--latency-ms 30]]`. Each sidecar writes 20 segments over 10 hours
//! (one small multi-turn episode per segment: start, three growing chat calls, a reward,
//! the end); one segment in 20 is held back and uploaded with the second batch (late,
//! out of order), and the second batch adds 2 new segments per sidecar an hour later.
//! Reported per run: segments and records read, `list` calls, wall time, segments/s and
//! records/s, how far the RSS of the process that ran it (a fresh one per run) rose at
//! its peak and stayed after, the records read still held (the difference is what
//! reading in flight costs), the cursor's size and the size the
//! version-1 cursor (a key per segment) would have had. The first run is also done with
//! one read at a time, the baseline for the concurrent reads. Then the first run of 1,000
//! segments on the local store behind an added latency per request (`--latency-ms`,
//! default 30, S3's first-byte latency for small objects) at 1, 8, 32 and 64 reads at a
//! time: what the default concurrency is chosen by. Last, the cursor and the listing
//! extrapolated to a day of 10,000 sidecars.

#[path = "../tests/common/s3.rs"]
mod s3;
#[path = "../tests/common/traces.rs"]
mod traces;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path as ObjectPath;
use object_store::{
    GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use serde_json::json;
use tapline_proto::Outcome;
use tapline_proto::keys::SegmentKey;
use tapline_proto::segment::encode_segment;
use tapline_proto::store::{StoreLocation, open_store};
use tapline_trainer::ingest::{self, IngestOptions};
use traces::{Trace, agent_tools, agent_turn, tool_result};

const HOUR: i64 = 3600;
/// 2027-01-01T00:00:00Z.
const T0: i64 = 1_798_761_600;
const SEGMENTS_PER_SIDECAR: u64 = 20;
const HOURS: i64 = 10;
const LATE_EVERY: u64 = 20;
const LOOKBACK: u32 = 24;

struct Args {
    segments: Vec<u64>,
    stores: Vec<String>,
    concurrency: usize,
    /// Sizes above this are not run on s3s-fs.
    s3_max: u64,
    /// Latency added to each request in the concurrency sweep (0: no sweep).
    latency_ms: u64,
}

fn args() -> Args {
    let mut a = Args {
        segments: vec![1_000, 10_000],
        stores: vec!["local".into(), "s3".into()],
        concurrency: IngestOptions::default().concurrent_reads,
        s3_max: 10_000,
        latency_ms: 30,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--segments" => {
                a.segments = value()
                    .split(',')
                    .map(|n| n.parse().expect("--segments: numbers"))
                    .collect();
            }
            "--stores" => a.stores = value().split(',').map(str::to_owned).collect(),
            "--concurrency" => a.concurrency = value().parse().expect("--concurrency: a number"),
            "--s3-max" => a.s3_max = value().parse().expect("--s3-max: a number"),
            "--latency-ms" => a.latency_ms = value().parse().expect("--latency-ms: a number"),
            "--bench" => {}
            other => panic!("unknown argument {other}; see the file's documentation"),
        }
    }
    a
}

/// One segment: one small agent episode of three calls, as a sidecar records it.
fn segment(sidecar: &str, index: u64, at_unix_secs: i64) -> (SegmentKey, Vec<u8>) {
    let mut trace = Trace::new(sidecar, at_unix_secs * 1_000_000_000);
    trace.seq = index * 6;
    let episode = format!("{sidecar}-ep-{index}");
    let task = format!("task-{}", index % 5);
    trace.start(&episode, &task, "");
    let mut messages = vec![
        json!({"role": "system", "content": "You are a careful coding agent."}),
        json!({"role": "user", "content": format!("Fix issue #{index} in module {sidecar}.")}),
    ];
    for k in 0..3 {
        let turn = agent_turn(k, k == 2);
        let request = json!({"model": "m", "messages": messages, "tools": agent_tools()});
        trace.chat_call(
            &episode,
            &task,
            k as u32,
            &request,
            turn.completion(vec![], vec![]),
            vec![],
            Outcome::Ok,
        );
        messages.push(turn.history_message(false));
        messages.push(tool_result(k));
    }
    trace.reward(&episode, "", "", 1.0);
    trace.end(&episode, &task, "", false);
    let key = SegmentKey::new(sidecar, index * 6, at_unix_secs * 1_000_000_000).expect("key");
    let (bytes, _) = encode_segment(&trace.records, 3).expect("encode");
    (key, bytes)
}

/// (sidecar, segment index, time) of every segment of the first and the second batch.
/// Segments to upload: (sidecar, segment index, time).
type Batch = Vec<(String, u64, i64)>;

fn plan(sidecars: u64) -> (Batch, Batch) {
    let (mut first, mut second) = (Vec::new(), Vec::new());
    for s in 0..sidecars {
        let name = format!("harness-{s:05}");
        for i in 0..SEGMENTS_PER_SIDECAR {
            let at = T0 + (i as i64 * HOURS * HOUR) / SEGMENTS_PER_SIDECAR as i64 + (s as i64 % 60);
            if (i + s) % LATE_EVERY == LATE_EVERY - 1 {
                second.push((name.clone(), i, at));
            } else {
                first.push((name.clone(), i, at));
            }
        }
        for i in SEGMENTS_PER_SIDECAR..SEGMENTS_PER_SIDECAR + 2 {
            second.push((name.clone(), i, T0 + (HOURS + 1) * HOUR + i as i64));
        }
    }
    (first, second)
}

async fn upload(location: &StoreLocation, batch: &[(String, u64, i64)]) {
    futures::stream::iter(batch)
        .map(|(sidecar, index, at)| async move {
            let (key, bytes) = segment(sidecar, *index, *at);
            location
                .store
                .put(&key.to_path(&location.prefix), PutPayload::from(bytes))
                .await
                .expect("put segment");
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
}

fn status_mb(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

struct Measured {
    segments: usize,
    records: u64,
    list_calls: u64,
    seconds: f64,
    /// Peak RSS of the process that ran it (a fresh one per run), above its RSS at the
    /// start of the run (the libraries loaded: libtorch alone maps ~400 MB).
    peak_rss_mb: f64,
    /// Its RSS after the run, the records read still held, above the same.
    held_rss_mb: f64,
    cursor_bytes: usize,
    v1_cursor_bytes: usize,
}

/// One ingest run of `run` (read, then the cursor written as the trainer does), in a
/// fresh process of this benchmark so that its peak RSS is its own. `keys` keeps the
/// keys read so far by `run` (for the size a version-1 cursor would have).
fn run(
    url: &str,
    run: &str,
    concurrency: usize,
    now: i64,
    latency_ms: u64,
    keys: &std::path::Path,
) -> Measured {
    let out = std::process::Command::new(std::env::current_exe().expect("current exe"))
        .args(["--child", url, run])
        .args([
            concurrency.to_string(),
            now.to_string(),
            latency_ms.to_string(),
        ])
        .arg(keys)
        .output()
        .expect("run the child");
    assert!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("child output");
    Measured {
        segments: v["segments"].as_u64().expect("segments") as usize,
        records: v["records"].as_u64().expect("records"),
        list_calls: v["list_calls"].as_u64().expect("list_calls"),
        seconds: v["seconds"].as_f64().expect("seconds"),
        peak_rss_mb: v["peak_rss_mb"].as_f64().expect("peak"),
        held_rss_mb: v["held_rss_mb"].as_f64().expect("held"),
        cursor_bytes: v["cursor_bytes"].as_u64().expect("cursor") as usize,
        v1_cursor_bytes: v["v1_cursor_bytes"].as_u64().expect("v1") as usize,
    }
}

/// The child's side of [`run`]: prints the measures as JSON.
async fn child(args: &[String]) {
    let [url, run, concurrency, now, latency_ms, keys] = args else {
        panic!("--child URL RUN CONCURRENCY NOW LATENCY_MS KEYS_FILE");
    };
    let (concurrency, now, latency_ms): (usize, i64, u64) = (
        concurrency.parse().expect("concurrency"),
        now.parse().expect("now"),
        latency_ms.parse().expect("latency"),
    );
    let mut location = open_store(url).expect("store");
    if latency_ms > 0 {
        location.store = std::sync::Arc::new(Latency {
            inner: location.store.clone(),
            latency: Duration::from_millis(latency_ms),
        });
    }
    let options = IngestOptions {
        lookback_hours: LOOKBACK,
        concurrent_reads: concurrency,
        ..IngestOptions::default()
    };
    let at_start = status_mb("VmRSS:");
    let started = Instant::now();
    let read = ingest::read_store(&location, Some(run), &options, now * 1_000_000_000)
        .await
        .expect("read store");
    let cursor = ingest::next_cursor(&read, &BTreeMap::new(), LOOKBACK, &location.prefix);
    ingest::write_cursor(&location, run, &cursor, &read.cursor_version)
        .await
        .expect("write cursor");
    let seconds = started.elapsed().as_secs_f64();
    let (peak, held) = (status_mb("VmHWM:"), status_mb("VmRSS:"));
    let mut read_so_far: BTreeSet<String> = std::fs::read_to_string(keys)
        .map(|t| t.lines().map(str::to_owned).collect())
        .unwrap_or_default();
    read_so_far.extend(read.new_segments.iter().cloned());
    read_so_far.retain(|k| k.as_str() > cursor.watermark.as_str());
    let list: Vec<&str> = read_so_far.iter().map(String::as_str).collect();
    std::fs::write(keys, list.join("\n")).expect("write keys");
    let v1 = json!({
        "version": 1, "watermark": cursor.watermark, "consumed": read_so_far,
        "pending_segments": [], "pending_episodes": [],
    });
    println!(
        "{}",
        json!({
            "segments": read.new_segments.len(),
            "records": read.ingested.records,
            "list_calls": read.list_calls,
            "seconds": seconds,
            "peak_rss_mb": peak - at_start,
            "held_rss_mb": held - at_start,
            "cursor_bytes": serde_json::to_vec_pretty(&cursor).expect("json").len(),
            "v1_cursor_bytes": serde_json::to_vec_pretty(&v1).expect("json").len(),
        })
    );
}

fn print_row(store: &str, total: u64, what: &str, m: &Measured) {
    println!(
        "| {store} | {total} | {what} | {} | {} | {} | {:.2} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {} |",
        m.segments,
        m.records,
        m.list_calls,
        m.seconds,
        m.segments as f64 / m.seconds,
        m.records as f64 / m.seconds,
        m.peak_rss_mb,
        m.held_rss_mb,
        m.cursor_bytes,
        m.v1_cursor_bytes,
    );
}

/// A store that waits `latency` before answering each request (a list: before its first
/// object), as a remote object store does.
#[derive(Debug)]
struct Latency {
    inner: std::sync::Arc<dyn ObjectStore>,
    latency: Duration,
}

impl std::fmt::Display for Latency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} + {:?}", self.inner, self.latency)
    }
}

impl Latency {
    fn delayed<T: Send + 'static>(&self, stream: BoxStream<'static, T>) -> BoxStream<'static, T> {
        let wait = tokio::time::sleep(self.latency);
        futures::stream::once(wait)
            .flat_map(move |()| futures::stream::empty())
            .chain(stream)
            .boxed()
    }
}

#[async_trait::async_trait]
impl ObjectStore for Latency {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        tokio::time::sleep(self.latency).await;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        tokio::time::sleep(self.latency).await;
        self.inner.get_opts(location, options).await
    }

    async fn delete(&self, location: &ObjectPath) -> object_store::Result<()> {
        tokio::time::sleep(self.latency).await;
        self.inner.delete(location).await
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.delayed(self.inner.list(prefix))
    }

    fn list_with_offset(
        &self,
        prefix: Option<&ObjectPath>,
        offset: &ObjectPath,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.delayed(self.inner.list_with_offset(prefix, offset))
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<ListResult> {
        tokio::time::sleep(self.latency).await;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy(&self, from: &ObjectPath, to: &ObjectPath) -> object_store::Result<()> {
        tokio::time::sleep(self.latency).await;
        self.inner.copy(from, to).await
    }

    async fn copy_if_not_exists(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
    ) -> object_store::Result<()> {
        tokio::time::sleep(self.latency).await;
        self.inner.copy_if_not_exists(from, to).await
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--child") {
        child(&argv[2..]).await;
        return;
    }
    let args = args();
    println!(
        "fleet: {SEGMENTS_PER_SIDECAR} segments per sidecar over {HOURS} h (1 in {LATE_EVERY} uploaded late with the second batch, which adds 2 per sidecar), lookback {LOOKBACK} h, {} reads at a time",
        args.concurrency
    );
    println!(
        "| store | segments | run | segments read | records | list calls | seconds | segments/s | records/s | RSS peak growth MB | RSS growth after MB | cursor bytes | v1 cursor bytes |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut per_sidecar_cursor = 0.0;
    let mut rate = 0.0;
    let mut remote_rate = 0.0;
    for store_kind in &args.stores {
        for &total in &args.segments {
            if store_kind == "s3" && total > args.s3_max {
                continue;
            }
            let sidecars = (total / SEGMENTS_PER_SIDECAR).max(1);
            let dir = tempfile::tempdir().expect("tempdir");
            let url = match store_kind.as_str() {
                "local" => format!("file://{}", dir.path().display()),
                "s3" => {
                    let addr = s3::s3s_server(dir.path()).await;
                    s3::url(addr, "fleet")
                }
                other => panic!("--stores: {other} is not local or s3"),
            };
            let location = open_store(&url).expect("store");
            let (first, second) = plan(sidecars);
            let started = Instant::now();
            upload(&location, &first).await;
            let write_secs = started.elapsed().as_secs_f64();
            let now = T0 + HOURS * HOUR;
            let measure = |run_name: &str, concurrency: usize, now: i64, keys: &str| {
                let path = dir.path().join(keys);
                tokio::task::block_in_place(|| run(&url, run_name, concurrency, now, 0, &path))
            };
            let baseline = measure("sequential", 1, now, "keys-sequential");
            print_row(store_kind, total, "first, 1 read at a time", &baseline);
            let first_run = measure("fleet", args.concurrency, now, "keys-fleet");
            print_row(store_kind, total, "first", &first_run);
            upload(&location, &second).await;
            let incremental = measure("fleet", args.concurrency, now + 2 * HOUR, "keys-fleet");
            print_row(store_kind, total, "incremental (late + new)", &incremental);
            assert_eq!(
                first_run.segments + incremental.segments,
                first.len() + second.len(),
                "every segment read once"
            );
            eprintln!(
                "fleet: {store_kind} {total}: wrote {} segments in {write_secs:.1}s; concurrent reads {:.2}x the sequential rate",
                first.len(),
                baseline.seconds / first_run.seconds
            );
            per_sidecar_cursor = incremental.cursor_bytes as f64 / sidecars as f64;
            if store_kind == "local" {
                rate = first_run.segments as f64 / first_run.seconds;
            }
        }
    }
    if args.latency_ms > 0 {
        let latency = Duration::from_millis(args.latency_ms);
        println!();
        println!(
            "First run of 1,000 segments (950 present) on the local store with {latency:?} added to every request:"
        );
        println!(
            "| reads at a time | seconds | segments/s | RSS peak growth MB | RSS growth after MB | vs 1 at a time |"
        );
        println!("|---|---|---|---|---|---|");
        let dir = tempfile::tempdir().expect("tempdir");
        let local = open_store(&format!("file://{}", dir.path().display())).expect("store");
        let (first, _) = plan(1_000 / SEGMENTS_PER_SIDECAR);
        upload(&local, &first).await;
        let url = format!("file://{}", dir.path().display());
        let mut sequential = 0.0;
        for concurrency in [1, 8, 32, 64] {
            let default = concurrency == IngestOptions::default().concurrent_reads;
            let keys = dir.path().join(format!("keys-{concurrency}"));
            let m = tokio::task::block_in_place(|| {
                run(
                    &url,
                    &format!("sweep-{concurrency}"),
                    concurrency,
                    T0 + HOURS * HOUR,
                    args.latency_ms,
                    &keys,
                )
            });
            if concurrency == 1 {
                sequential = m.seconds;
            }
            if default {
                remote_rate = m.segments as f64 / m.seconds;
            }
            println!(
                "| {concurrency} | {:.2} | {:.0} | {:.1} | {:.1} | {:.1}x |",
                m.seconds,
                m.segments as f64 / m.seconds,
                m.peak_rss_mb,
                m.held_rss_mb,
                sequential / m.seconds
            );
        }
    }
    // A day of 10,000 sidecars, each sealing a segment every 10 s.
    let sidecars = 10_000.0;
    let per_hour = sidecars * 360.0;
    let window_keys = per_hour * f64::from(LOOKBACK);
    let key_bytes =
        "    \"segments/v1/2027/01/01/00/harness-00000/0000000000000000.tlseg\",\n".len() as f64;
    println!();
    println!(
        "10,000 sidecars for a day (a segment every 10 s each: {:.1}M segments an hour): cursor {:.1} MB (v2, {:.0} bytes per sidecar measured) vs {:.1} GB (v1: {:.0}M keys in the {LOOKBACK} h lookback); {} list calls per run (the hour directories of the window, plus one), each paging through its hour's {:.1}M keys",
        per_hour / 1e6,
        per_sidecar_cursor * sidecars / 1e6,
        per_sidecar_cursor,
        window_keys * key_bytes / 1e9,
        window_keys / 1e6,
        LOOKBACK + 2,
        per_hour / 1e6,
    );
    println!(
        "reading one such hour on one trainer: {:.2} h at the local rate measured here ({rate:.0} segments/s); {:.2} h at {} ms per request with the default {} reads at a time ({remote_rate:.0} segments/s)",
        per_hour / rate.max(1.0) / 3600.0,
        per_hour / remote_rate.max(1.0) / 3600.0,
        args.latency_ms,
        IngestOptions::default().concurrent_reads,
    );
}
