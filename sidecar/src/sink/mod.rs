//! Where records go once captured: the [`RecordSink`] interface and the [`Recorder`]
//! behind it — a spool writer thread and a segment uploader task.
//!
//! ```text
//! submit ──queue──▶ spool writer thread ──append──▶ spool (.open) ──seal──▶ .sealed
//!                        │ (ack once written)                              │
//!                                              uploader task ◀─────────────┘
//!                                              build segment (complete each call:
//!                                              rebuild::complete), create-only PUT,
//!                                              retry, then delete the sealed file (ack)
//! ```
//!
//! - Capture never waits for storage. [`RecordSink::submit`] only enqueues; the returned
//!   [`Ack`] resolves once the record is in the spool (or was dropped). The proxy waits
//!   for that ack before it sends the last byte of a response, so a response the client
//!   received whole is always in the spool; the wait is a local file append. Calls are
//!   spooled as captured (raw bytes); the segment builder derives their completions, so
//!   no response waits for the rebuild of its own body.
//! - Segments are cut by size, by age and when an episode ends. Each sealed spool file
//!   becomes exactly one segment whose key depends only on its content, so an upload
//!   retried after a crash writes the same key (create-only PUT: harmless).
//! - When the spool is full, the `drop` policy drops the new record, counts it and tells
//!   the caller (the episode is flagged incomplete); `block` makes the ack wait until
//!   uploads free space, which holds back responses: backpressure.
//!
//! This module holds the interface and the recorder with its spool writer thread;
//! `upload.rs` builds the segments and uploads them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tapline_proto::store::StoreLocation;
use tapline_proto::{EpisodeEventKind, RecordKind};
use tokio::sync::{Notify, oneshot};

use crate::metrics::Metrics;
use crate::spool::{AppendError, Recovery, Spool};

mod upload;

/// A record could not be accepted and was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("record dropped: the spool is full, failing, or shutting down")]
pub struct Dropped;

/// Resolves once the record is in the spool (`Ok`) or was dropped.
#[derive(Debug)]
pub struct Ack(AckInner);

#[derive(Debug)]
enum AckInner {
    Ready(Option<Result<(), Dropped>>),
    Waiting(oneshot::Receiver<Result<(), Dropped>>),
}

impl Ack {
    /// An ack that is already resolved.
    pub fn ready(result: Result<(), Dropped>) -> Ack {
        Ack(AckInner::Ready(Some(result)))
    }
}

impl std::future::Future for Ack {
    type Output = Result<(), Dropped>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match &mut self.0 {
            AckInner::Ready(result) => {
                std::task::Poll::Ready(result.take().unwrap_or(Err(Dropped)))
            }
            AckInner::Waiting(rx) => std::pin::Pin::new(rx)
                .poll(cx)
                .map(|r| r.unwrap_or(Err(Dropped))),
        }
    }
}

/// Accepts records without waiting.
pub trait RecordSink: Send + Sync + std::fmt::Debug {
    /// Queues a payload; the sink numbers it and wraps it in a `Record`.
    fn submit(&self, kind: RecordKind) -> Ack;
}

/// [`crate::clock::now_nanos`], at the path it had before it moved (`control.rs` still
/// imports it from here).
pub use crate::clock::now_nanos;

/// What to do with a new record when the spool is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FullPolicy {
    /// Drop the record, count it, flag its episode; never hold back traffic.
    Drop,
    /// Hold back responses until uploads free space.
    Block,
}

/// Settings of a [`Recorder`].
#[derive(Debug, Clone)]
pub struct RecorderOptions {
    /// This sidecar's id.
    pub sidecar_id: String,
    /// Spool directory.
    pub spool_dir: std::path::PathBuf,
    /// Hard cap of the spool's size on disk.
    pub spool_max_bytes: u64,
    /// What to do when the spool is full.
    pub full_policy: FullPolicy,
    /// Uncompressed bytes per segment before it is cut.
    pub segment_max_bytes: u64,
    /// Records per segment before it is cut.
    pub segment_max_records: u64,
    /// Age of a segment's first record before it is cut.
    pub segment_max_age: Duration,
    /// Interval between fsyncs of the open spool file.
    pub fsync_interval: Duration,
    /// zstd level of segments.
    pub zstd_level: i32,
    /// Segment format version written (`tapline_proto::segment::VERSION` unless an
    /// upgrade needs the older one).
    pub segment_format: u8,
    /// Records that may wait in memory for the spool writer (policy `block`). The queue
    /// grows to this on demand; nothing is allocated up front.
    pub queue_capacity: usize,
    /// The budget the segment builder reserves against, per record (shared with the
    /// proxy's captures).
    pub memory_budget: std::sync::Arc<crate::budget::MemoryBudget>,
}

enum Msg {
    Record(RecordKind, oneshot::Sender<Result<(), Dropped>>),
}

/// State shared by the writer thread, the uploader task and the handlers.
#[derive(Debug)]
pub(super) struct Shared {
    spool: Mutex<Spool>,
    /// Signalled when uploads free space in the spool.
    space: Condvar,
    /// Signalled when a file is sealed.
    sealed: Notify,
    stopping: AtomicBool,
    /// Uploads stop retrying after this instant (nanoseconds since `epoch`), 0 = never.
    upload_deadline: AtomicU64,
    epoch: Instant,
    store_error: Mutex<Option<String>>,
    metrics: Arc<Metrics>,
}

impl Shared {
    fn spool(&self) -> MutexGuard<'_, Spool> {
        self.spool.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish_gauges(&self, spool: &Spool) {
        let m = &self.metrics;
        m.spool_bytes.store(spool.bytes(), Ordering::Relaxed);
        m.spool_records.store(spool.records(), Ordering::Relaxed);
        m.oldest_unacked_nanos.store(
            spool.oldest_unacked_nanos().map_or(0, |n| n.max(0) as u64),
            Ordering::Relaxed,
        );
    }

    fn past_deadline(&self) -> bool {
        let deadline = self.upload_deadline.load(Ordering::Relaxed);
        deadline != 0 && self.epoch.elapsed().as_nanos() as u64 >= deadline
    }
}

/// The sidecar's [`RecordSink`]: spool writer thread + uploader task.
#[derive(Debug)]
pub struct Recorder {
    /// Unbounded channel whose length `queued` caps at `options.queue_capacity`
    /// (a bounded `sync_channel` would allocate every slot at start: 40 MB for 65,536).
    tx: Sender<Msg>,
    shared: Arc<Shared>,
    options: RecorderOptions,
    /// Records waiting in the queue for the writer thread (policy `block` only).
    queued: Arc<AtomicU64>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    uploader: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Recorder {
    /// Opens the spool (replaying what a previous run left), starts the writer thread and
    /// the uploader task on the current runtime.
    pub fn start(
        store: StoreLocation,
        options: RecorderOptions,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<(Arc<Recorder>, Recovery)> {
        let now_micros = (now_nanos() / 1_000).max(0) as u64;
        let (spool, recovery) =
            Spool::open(&options.spool_dir, options.spool_max_bytes, now_micros)?;
        metrics
            .spool_torn_files
            .fetch_add(recovery.torn_files as u64, Ordering::Relaxed);
        metrics
            .spool_torn_bytes
            .fetch_add(recovery.torn_bytes, Ordering::Relaxed);
        if recovery.torn_files > 0 {
            tracing::warn!(
                files = recovery.torn_files,
                bytes = recovery.torn_bytes,
                "spool had a torn tail from a crash; the records before it are kept, the partial record is lost"
            );
        }
        if recovery.records > 0 {
            tracing::info!(
                records = recovery.records,
                files = recovery.sealed_files,
                "replaying records not yet acknowledged by the store"
            );
        }
        let shared = Arc::new(Shared {
            spool: Mutex::new(spool),
            space: Condvar::new(),
            sealed: Notify::new(),
            stopping: AtomicBool::new(false),
            upload_deadline: AtomicU64::new(0),
            epoch: Instant::now(),
            store_error: Mutex::new(None),
            metrics,
        });
        shared.publish_gauges(&shared.spool());
        let (tx, rx) = std::sync::mpsc::channel();
        let queued = Arc::new(AtomicU64::new(0));
        let writer = {
            let shared = shared.clone();
            let options = options.clone();
            let queued = queued.clone();
            std::thread::Builder::new()
                .name("tapline-spool".into())
                .spawn(move || writer_loop(rx, &shared, &options, &queued))?
        };
        let uploader = tokio::spawn(upload::upload_loop(store, options.clone(), shared.clone()));
        Ok((
            Arc::new(Recorder {
                tx,
                shared,
                options: options.clone(),
                queued,
                writer: Mutex::new(Some(writer)),
                uploader: Mutex::new(Some(uploader)),
            }),
            recovery,
        ))
    }

    /// The last permanent store error, if uploads are failing for a reason retries will
    /// not fix (credentials, missing bucket).
    pub fn store_error(&self) -> Option<String> {
        self.shared
            .store_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stops accepting records, seals the open spool file, and uploads for up to `flush`.
    /// What is not uploaded by then stays in the spool for the next start.
    pub async fn shutdown(&self, flush: Duration) {
        let deadline = self.shared.epoch.elapsed() + flush;
        self.shared
            .upload_deadline
            .store(deadline.as_nanos().max(1) as u64, Ordering::Relaxed);
        self.shared.stopping.store(true, Ordering::Relaxed);
        self.shared.space.notify_all();
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(writer) = writer {
            let _ = tokio::task::spawn_blocking(move || writer.join()).await;
        }
        self.shared.sealed.notify_one();
        let uploader = self
            .uploader
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(uploader) = uploader
            && tokio::time::timeout(flush + Duration::from_millis(500), uploader)
                .await
                .is_err()
        {
            tracing::warn!("uploader did not stop in time");
        }
        let left = self.shared.spool().records();
        if left > 0 {
            tracing::warn!(
                records = left,
                "records stay in the spool and will be uploaded at the next start"
            );
        }
    }
}

impl RecordSink for Recorder {
    fn submit(&self, kind: RecordKind) -> Ack {
        let shared = &self.shared;
        let metrics = &shared.metrics;
        if shared.stopping.load(Ordering::Relaxed) {
            metrics.records_dropped.fetch_add(1, Ordering::Relaxed);
            return Ack::ready(Err(Dropped));
        }
        // Fast path: append here and now (a write into the page cache), unless records
        // are already waiting for space, which must keep their order.
        let mut slot = Some(kind);
        if self.queued.load(Ordering::Acquire) == 0 {
            let end = slot.as_ref().is_some_and(is_episode_end);
            let mut spool = shared.spool();
            match spool.append(&self.options.sidecar_id, now_nanos(), &mut slot) {
                Ok(_) => {
                    metrics.records_spooled.fetch_add(1, Ordering::Relaxed);
                    if end || segment_full(&spool, &self.options) {
                        seal(&mut spool, shared);
                    }
                    // The spool gauges (health, /metrics) count this record now, not at
                    // the writer thread's next turn (up to 50 ms later).
                    shared.publish_gauges(&spool);
                    return Ack::ready(Ok(()));
                }
                Err(AppendError::Full { used, max })
                    if self.options.full_policy == FullPolicy::Drop =>
                {
                    metrics.records_dropped.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(used, max, "spool full; record dropped (policy drop)");
                    return Ack::ready(Err(Dropped));
                }
                Err(AppendError::Full { .. }) => {} // policy block: queue it below
                Err(AppendError::Io(error)) => {
                    tracing::error!(%error, "cannot write to the spool; record dropped");
                    metrics.capture_failures.fetch_add(1, Ordering::Relaxed);
                    metrics.records_dropped.fetch_add(1, Ordering::Relaxed);
                    return Ack::ready(Err(Dropped));
                }
            }
        }
        let Some(kind) = slot else {
            return Ack::ready(Err(Dropped));
        };
        let (ack_tx, ack_rx) = oneshot::channel();
        let capacity = self.options.queue_capacity as u64;
        let admitted = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < capacity).then_some(n + 1)
            })
            .is_ok();
        if !admitted {
            metrics.records_dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(capacity, "record queue full; record dropped");
            return Ack::ready(Err(Dropped));
        }
        match self.tx.send(Msg::Record(kind, ack_tx)) {
            Ok(()) => Ack(AckInner::Waiting(ack_rx)),
            Err(_) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                metrics.records_dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("spool writer stopped; record dropped");
                Ack::ready(Err(Dropped))
            }
        }
    }
}

/// Whether the open spool file has reached a segment's size or record limit.
fn segment_full(spool: &Spool, options: &RecorderOptions) -> bool {
    spool.open_bytes() >= options.segment_max_bytes
        || spool.open_records() >= options.segment_max_records
}

fn is_episode_end(kind: &RecordKind) -> bool {
    matches!(kind, RecordKind::EpisodeEvent(e) if e.kind() == EpisodeEventKind::End)
}

/// The spool's background thread: appends records that had to wait for space (policy
/// `block`), seals files by age, and schedules fsyncs.
fn writer_loop(rx: Receiver<Msg>, shared: &Shared, options: &RecorderOptions, queued: &AtomicU64) {
    let metrics = &shared.metrics;
    let mut last_sync = Instant::now();
    // fsync runs on its own thread: appends (and so responses) never wait for the disk.
    let (syncer, jobs) = std::sync::mpsc::sync_channel::<crate::spool::SyncJob>(4);
    let sync_thread = std::thread::Builder::new()
        .name("tapline-fsync".into())
        .spawn(move || {
            for job in jobs {
                if let Err(error) = job.run() {
                    tracing::error!(%error, "spool fsync failed");
                }
            }
        });
    loop {
        let stopping = shared.stopping.load(Ordering::Relaxed);
        let received = if stopping {
            rx.try_recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            rx.recv_timeout(options.fsync_interval.min(Duration::from_millis(50)))
        };
        match received {
            Ok(Msg::Record(kind, ack)) => {
                let end = is_episode_end(&kind);
                let result = append(shared, options, kind);
                if result.is_ok() {
                    metrics.records_spooled.fetch_add(1, Ordering::Relaxed);
                } else {
                    metrics.records_dropped.fetch_add(1, Ordering::Relaxed);
                }
                let _ = ack.send(result);
                queued.fetch_sub(1, Ordering::AcqRel);
                let mut spool = shared.spool();
                if end || segment_full(&spool, options) {
                    seal(&mut spool, shared);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                let mut spool = shared.spool();
                seal(&mut spool, shared);
                if let Err(error) = spool.sync() {
                    tracing::error!(%error, "spool fsync at shutdown failed");
                }
                shared.publish_gauges(&spool);
                drop(syncer);
                if let Ok(thread) = sync_thread {
                    let _ = thread.join();
                }
                return;
            }
        }
        let mut spool = shared.spool();
        if last_sync.elapsed() >= options.fsync_interval {
            match spool.sync_job() {
                Ok(Some(job)) => {
                    if syncer.try_send(job).is_err() {
                        tracing::debug!("previous fsync still running; syncing later");
                    }
                }
                Ok(None) => {}
                Err(error) => tracing::error!(%error, "cannot prepare spool fsync"),
            }
            last_sync = Instant::now();
        }
        if spool
            .open_age()
            .is_some_and(|age| age >= options.segment_max_age)
        {
            seal(&mut spool, shared);
        }
        shared.publish_gauges(&spool);
    }
}

fn append(shared: &Shared, options: &RecorderOptions, kind: RecordKind) -> Result<(), Dropped> {
    let mut slot = Some(kind);
    let mut spool = shared.spool();
    loop {
        match spool.append(&options.sidecar_id, now_nanos(), &mut slot) {
            Ok(_) => return Ok(()),
            Err(AppendError::Full { used, max }) => {
                if options.full_policy == FullPolicy::Drop
                    || shared.stopping.load(Ordering::Relaxed)
                {
                    tracing::warn!(used, max, "spool full; record dropped (policy drop)");
                    return Err(Dropped);
                }
                // Policy block: seal what is open so it can be uploaded, then wait for space.
                if spool.open_records() > 0 {
                    seal(&mut spool, shared);
                }
                spool = shared
                    .space
                    .wait_timeout(spool, Duration::from_millis(100))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            Err(AppendError::Io(error)) => {
                tracing::error!(%error, "cannot write to the spool; record dropped");
                shared
                    .metrics
                    .capture_failures
                    .fetch_add(1, Ordering::Relaxed);
                return Err(Dropped);
            }
        }
    }
}

fn seal(spool: &mut Spool, shared: &Shared) {
    match spool.seal() {
        Ok(Some(_)) => shared.sealed.notify_one(),
        Ok(None) => {}
        Err(error) => tracing::error!(%error, "cannot seal spool file; will retry"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tapline_proto::{Api, LlmCall, Outcome};

    /// A chat stream broken by an error chunk.
    pub(super) const STREAM: &str = concat!(
        "data: {\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
        "data: {\"error\":{\"message\":\"overloaded\"}}\n\n",
    );

    /// A call as the proxy captures it, with [`STREAM`] as its response.
    pub(super) fn captured_call() -> LlmCall {
        LlmCall {
            span_id: "s1".into(),
            api: Api::ChatCompletions as i32,
            streamed: true,
            http_status: 200,
            outcome: Outcome::Ok as i32,
            response_body: STREAM.as_bytes().to_vec().into(),
            response_body_size: STREAM.len() as u64,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn spool_gauges_count_a_record_as_soon_as_submit_returns() {
        // Regression: the gauges were published only by the writer thread's next turn,
        // so /tapline/v1/health could report a record fewer than the spool held.
        let dir = tempfile::tempdir().unwrap();
        let store = tapline_proto::store::open_store("memory://test").unwrap();
        let options = RecorderOptions {
            sidecar_id: "s".into(),
            spool_dir: dir.path().to_owned(),
            spool_max_bytes: 1 << 30,
            full_policy: FullPolicy::Drop,
            segment_max_bytes: 1 << 30,
            segment_max_records: 1 << 20,
            segment_max_age: Duration::from_secs(3600),
            fsync_interval: Duration::from_secs(3600),
            zstd_level: 3,
            segment_format: tapline_proto::segment::VERSION,
            queue_capacity: 16,
            memory_budget: crate::budget::MemoryBudget::new(crate::budget::DEFAULT_BYTES),
        };
        let metrics = Arc::new(Metrics::default());
        let (recorder, _) = Recorder::start(store, options, metrics.clone()).unwrap();
        for i in 1..=3u64 {
            recorder
                .submit(RecordKind::LlmCall(captured_call()))
                .await
                .unwrap();
            assert_eq!(metrics.spool_records.load(Ordering::Relaxed), i);
            assert!(metrics.spool_bytes.load(Ordering::Relaxed) > 8);
            assert!(metrics.oldest_unacked_nanos.load(Ordering::Relaxed) > 0);
        }
        recorder.shutdown(Duration::from_secs(5)).await;
    }
}
