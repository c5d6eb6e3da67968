//! Where records go once captured: the [`RecordSink`] interface and the [`Recorder`]
//! that numbers records, batches them into segments and uploads them.
//!
//! Capture never waits on storage: [`RecordSink::submit`] only enqueues. When the queue
//! is full the record is dropped, counted, and reported to the caller so the episode can
//! be flagged incomplete. Durable delivery (a local spool that survives crashes) plugs in
//! behind the same interface.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use object_store::{PutMode, PutOptions, PutPayload};
use tapline_proto::keys::SegmentKey;
use tapline_proto::segment::SegmentWriter;
use tapline_proto::store::StoreLocation;
use tapline_proto::{EpisodeEventKind, Record, RecordKind};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;

/// A record could not be accepted and was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("record dropped: the record queue is full or closed")]
pub struct Dropped;

/// Accepts records without waiting.
pub trait RecordSink: Send + Sync + std::fmt::Debug {
    /// Numbers the payload, wraps it in a [`Record`] and queues it for storage.
    fn submit(&self, kind: RecordKind) -> Result<(), Dropped>;
}

/// Current time in Unix nanoseconds.
pub fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Settings of a [`Recorder`].
#[derive(Debug, Clone)]
pub struct RecorderOptions {
    /// This sidecar's id.
    pub sidecar_id: String,
    /// Records per segment before it is cut.
    pub max_records: usize,
    /// Age of the oldest record of an open segment before it is cut.
    pub max_age: Duration,
    /// zstd level.
    pub zstd_level: i32,
    /// Records that may wait in memory for the uploader.
    pub queue_capacity: usize,
}

/// The sidecar's [`RecordSink`]: a bounded queue in front of a segment uploader task.
#[derive(Debug)]
pub struct Recorder {
    sidecar_id: String,
    next_seq: AtomicU64,
    tx: mpsc::Sender<Record>,
    metrics: Arc<Metrics>,
}

impl Recorder {
    /// Starts the uploader task on the current runtime. Sequence numbers start at the
    /// current time in microseconds, so they keep increasing across restarts and segment
    /// keys never collide.
    pub fn start(
        store: StoreLocation,
        options: RecorderOptions,
        metrics: Arc<Metrics>,
    ) -> (Arc<Recorder>, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(options.queue_capacity);
        let first_seq = (now_nanos() / 1_000).max(1) as u64;
        let recorder = Arc::new(Recorder {
            sidecar_id: options.sidecar_id.clone(),
            next_seq: AtomicU64::new(first_seq),
            tx,
            metrics: metrics.clone(),
        });
        let task = tokio::spawn(upload_loop(store, options, rx, metrics));
        (recorder, task)
    }

    /// Stops accepting records; the uploader task then uploads what is queued and ends.
    pub fn close(&self) {
        // Dropping every sender ends the queue; a closed flag keeps `submit` refusing.
        self.metrics.recorder_closed.store(1, Ordering::Relaxed);
    }
}

impl RecordSink for Recorder {
    fn submit(&self, kind: RecordKind) -> Result<(), Dropped> {
        if self.metrics.recorder_closed.load(Ordering::Relaxed) != 0 {
            self.metrics.records_dropped.fetch_add(1, Ordering::Relaxed);
            return Err(Dropped);
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let record = Record::new(&self.sidecar_id, seq, now_nanos(), kind);
        match self.tx.try_send(record) {
            Ok(()) => {
                self.metrics.records_queued.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(_) => {
                self.metrics.records_dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(seq, "record queue full; record dropped");
                Err(Dropped)
            }
        }
    }
}

/// A segment being written: records are compressed as they arrive, so cutting a segment
/// costs no burst of CPU.
struct OpenSegment {
    writer: SegmentWriter<Vec<u8>>,
    key: Option<SegmentKey>,
    opened: Instant,
}

/// Largest uncompressed body of one segment before it is cut.
const MAX_SEGMENT_BODY_BYTES: u64 = 8 << 20;

async fn upload_loop(
    store: StoreLocation,
    options: RecorderOptions,
    mut rx: mpsc::Receiver<Record>,
    metrics: Arc<Metrics>,
) {
    let mut open: Option<OpenSegment> = None;
    loop {
        let closing = metrics.recorder_closed.load(Ordering::Relaxed) != 0;
        let wait = match &open {
            None => Duration::from_millis(200),
            Some(seg) => options.max_age.saturating_sub(seg.opened.elapsed()),
        };
        let received = if closing {
            rx.try_recv().ok()
        } else {
            tokio::time::timeout(wait, rx.recv()).await.ok().flatten()
        };
        let mut cut = false;
        if let Some(record) = received {
            if open.is_none() {
                match SegmentWriter::new(Vec::new(), options.zstd_level) {
                    Ok(writer) => {
                        open = Some(OpenSegment {
                            writer,
                            key: SegmentKey::new(
                                &options.sidecar_id,
                                record.sidecar_seq,
                                record.written_unix_nanos,
                            )
                            .ok(),
                            opened: Instant::now(),
                        })
                    }
                    Err(error) => {
                        tracing::error!(%error, "cannot start a segment; record dropped");
                        metrics.capture_failures.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                }
            }
            let episode_end = matches!(
                &record.kind,
                Some(RecordKind::EpisodeEvent(e)) if e.kind() == EpisodeEventKind::End
            );
            if let Some(seg) = &mut open {
                if let Err(error) = seg.writer.append(&record) {
                    tracing::error!(%error, "cannot append to a segment; record dropped");
                    metrics.capture_failures.fetch_add(1, Ordering::Relaxed);
                }
                cut = episode_end
                    || seg.writer.records() >= options.max_records as u64
                    || seg.writer.body_bytes() >= MAX_SEGMENT_BODY_BYTES;
            }
        } else if let Some(seg) = &open {
            cut = closing || seg.opened.elapsed() >= options.max_age;
        }
        if cut && let Some(seg) = open.take() {
            upload(&store, seg, &metrics).await;
        }
        if closing && open.is_none() && rx.is_empty() {
            return;
        }
    }
}

/// Finishes a segment and uploads it, retrying with exponential backoff until stored.
async fn upload(store: &StoreLocation, segment: OpenSegment, metrics: &Metrics) {
    let (bytes, summary) = match segment.writer.finish() {
        Ok(done) => done,
        Err(error) => {
            tracing::error!(%error, "cannot finish segment; its records are lost");
            return;
        }
    };
    let Some(key) = segment.key else {
        tracing::error!("segment has no valid key; its records are lost");
        return;
    };
    if summary.records == 0 {
        return;
    }
    let key = key.to_path(&store.prefix);
    let payload = PutPayload::from(bytes);
    let mut backoff = Duration::from_millis(100);
    loop {
        let put = store
            .store
            .put_opts(&key, payload.clone(), PutOptions::from(PutMode::Create))
            .await;
        match put {
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => {
                metrics.segments_uploaded.fetch_add(1, Ordering::Relaxed);
                metrics
                    .records_stored
                    .fetch_add(summary.records, Ordering::Relaxed);
                metrics
                    .stored_bytes
                    .fetch_add(summary.object_bytes, Ordering::Relaxed);
                tracing::debug!(%key, records = summary.records, bytes = summary.object_bytes, "segment stored");
                return;
            }
            Err(error) => {
                metrics.upload_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, %key, retry_in = ?backoff, "segment upload failed; will retry");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}
