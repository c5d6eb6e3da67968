//! Segment building and upload: the uploader task takes the sealed spool files in
//! order, builds each one's segment on a blocking thread (completing every call with
//! `rebuild::complete` and cutting it to the readers' limit), stores it with a
//! create-only PUT under its content-derived key, retries with backoff, and then has the
//! spool forget the file and deletes it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use object_store::{PutMode, PutOptions, PutPayload};
use tapline_proto::RecordKind;
use tapline_proto::keys::SegmentKey;
use tapline_proto::segment::SegmentWriter;
use tapline_proto::store::StoreLocation;

use super::{RecorderOptions, Shared};
use crate::budget::MemoryBudget;
use crate::clock::now_nanos;
use crate::metrics::Metrics;
use crate::rebuild;
use crate::spool::{Stored, delete_file, for_each_sealed_sized};

/// Builds the segment of a sealed spool file, record by record (the file's records are
/// never decoded all at once: memory stays at one record plus the compressor). This is
/// the sidecar's biggest burst of CPU (tens of milliseconds per 8 MiB); it yields the
/// core every 64 KiB so that the threads serving traffic, which share the machine's few
/// cores, are not held up for a whole scheduler time slice.
///
/// Each record is built under a reservation of the memory budget (see
/// [`rebuild_estimate`]), waited for, so the builder and the calls in flight together
/// stay within `--memory-budget-bytes`.
fn build_segment(
    path: &std::path::Path,
    level: i32,
    format: u8,
    metrics: &Metrics,
    budget: &Arc<MemoryBudget>,
) -> std::io::Result<(Vec<u8>, tapline_proto::segment::SegmentSummary)> {
    let mut writer =
        SegmentWriter::with_version(Vec::new(), level, format).map_err(std::io::Error::other)?;
    let mut since_yield = 0usize;
    let (mut warned, mut body_errors) = (0u64, 0u64);
    // Reserved before each frame is read (the frame itself is the first copy), and
    // grown while a content-encoded body decodes.
    let held = std::cell::RefCell::new(budget.empty());
    let before = |len: u32| {
        let estimate = rebuild_estimate(u64::from(len));
        let mut held = held.borrow_mut();
        held.shrink_to(estimate);
        held.grow_to_waiting(estimate);
    };
    for_each_sealed_sized(path, before, |mut record, stored| {
        if stored == Stored::AsCaptured
            && let Some(RecordKind::LlmCall(call)) = &mut record.kind
        {
            // Each decoded byte costs about as much again to rebuild.
            let base = held.borrow().bytes();
            let mut room = |decoded: usize| {
                let need = base.saturating_add(REBUILD_FACTOR * decoded as u64);
                let mut held = held.borrow_mut();
                if need <= held.bytes() {
                    return true;
                }
                if need > budget.limit() {
                    return false;
                }
                let more = need.max(held.bytes() + held.bytes() / 2);
                held.grow_to_waiting(more);
                true
            };
            let done = rebuild::complete_within(call, &mut room);
            warned += u64::from(done.warned);
            body_errors += u64::from(done.body_error);
        }
        // Whatever was recorded, the readers must be able to read it (see `limits`).
        if let Some(RecordKind::LlmCall(call)) = &mut record.kind
            && crate::limits::fit_call(call, crate::limits::MAX_RECORD_BYTES)
        {
            tracing::warn!(
                span_id = %call.span_id,
                "record over the readers' limit: cut to fit (see its capture_warnings)"
            );
        }
        writer
            .append_in_place(&mut record)
            .map_err(std::io::Error::other)?;
        since_yield += prost::Message::encoded_len(&record);
        if since_yield >= 64 << 10 {
            std::thread::yield_now();
            since_yield = 0;
        }
        Ok(())
    })?;
    // Counted once per sealed file: a segment is built once per process and then kept
    // for every upload retry.
    metrics
        .capture_warnings
        .fetch_add(warned, Ordering::Relaxed);
    metrics
        .body_errors
        .fetch_add(body_errors, Ordering::Relaxed);
    writer.finish().map_err(std::io::Error::other)
}

/// Bytes a record's build holds, per byte of its frame, at most: the decoded frame,
/// the rebuilt completion text and the rebuild's parse state (measured: 2.7× for a
/// 50 MB call, 4.1× for 500,000 one-character SSE events; BENCHMARKS.md, "Sidecar:
/// memory per call").
const REBUILD_FACTOR: u64 = 4;

/// What building a record of `frame` bytes into a segment is budgeted at, before a
/// content-encoded body decodes: [`REBUILD_FACTOR`] per byte, plus 64 KiB for its
/// parse state. (The compressor's window is the builder's whatever the record: part of
/// the sidecar's own memory, outside the budget.)
fn rebuild_estimate(frame: u64) -> u64 {
    REBUILD_FACTOR * frame + (64 << 10)
}

/// Builds of one spool file that may die (the process killed while building it) before
/// the file is moved aside: one could be a coincidence (a deploy), two are the file.
const MAX_BUILD_DEATHS: u32 = 2;

/// Errors that retrying will not fix.
fn is_permanent(error: &object_store::Error) -> bool {
    use object_store::Error as E;
    match error {
        E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::NotSupported { .. }
        | E::NotImplemented => true,
        E::NotFound { .. } => true, // the bucket or container does not exist
        other => {
            let text = other.to_string();
            [
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "AccessDenied",
                "NoSuchBucket",
                "403 Forbidden",
            ]
            .iter()
            .any(|needle| text.contains(needle))
        }
    }
}

/// A small xorshift generator for backoff jitter (no need for a cryptographic source).
fn jitter(state: &mut u64, max: Duration) -> Duration {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    let frac = (*state >> 11) as f64 / (1u64 << 53) as f64;
    max.mul_f64(0.5 + frac / 2.0)
}

/// The uploader task: runs until the recorder stops (or its flush deadline passes).
pub(super) async fn upload_loop(
    store: StoreLocation,
    options: RecorderOptions,
    shared: Arc<Shared>,
) {
    let metrics = &shared.metrics;
    let mut rng = (now_nanos() as u64) | 1;
    loop {
        let next = shared.spool().sealed().into_iter().next();
        let Some(sealed) = next else {
            if shared.stopping.load(Ordering::Relaxed) && shared.spool().open_records() == 0 {
                return;
            }
            tokio::select! {
                () = shared.sealed.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
            continue;
        };
        if shared.past_deadline() {
            return;
        }
        // A file whose build killed the process twice (out of memory: one record too
        // large for the pod) would kill it on every restart: move it aside instead,
        // so replay always makes progress.
        let died_building = shared.spool().begin_build(sealed.first_seq);
        match died_building {
            Ok(n) if n >= MAX_BUILD_DEATHS => {
                tracing::error!(
                    file = %sealed.path.display(),
                    records = sealed.records,
                    "the sidecar stopped {n} times while building a segment from this spool file (out of memory?); moved aside as .unbuildable so the rest of the spool uploads; raise the memory limit or lower --capture-cap-bytes, and see the file's records with `tapline-sidecar dump`"
                );
                metrics
                    .capture_failures
                    .fetch_add(sealed.records, Ordering::Relaxed);
                metrics
                    .spool_files_set_aside
                    .fetch_add(1, Ordering::Relaxed);
                let mut spool = shared.spool();
                if let Err(error) = spool.set_aside(sealed.first_seq, "unbuildable") {
                    tracing::error!(%error, "cannot move the spool file aside");
                    return;
                }
                shared.publish_gauges(&spool);
                continue;
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "cannot note the segment build beside the spool file");
            }
        }
        let path = sealed.path.clone();
        let (level, format) = (options.zstd_level, options.segment_format);
        let build_metrics = shared.metrics.clone();
        let budget = options.memory_budget.clone();
        let built = tokio::task::spawn_blocking(move || {
            build_segment(&path, level, format, &build_metrics, &budget)
        })
        .await;
        if built.is_ok() {
            shared.spool().end_build(sealed.first_seq);
        }
        let (bytes, summary) = match built {
            Ok(Ok(done)) => done,
            Ok(Err(error)) => {
                tracing::error!(%error, file = %sealed.path.display(), "spool file cannot be read; moved aside as .corrupt");
                metrics
                    .capture_failures
                    .fetch_add(sealed.records, Ordering::Relaxed);
                metrics
                    .spool_files_set_aside
                    .fetch_add(1, Ordering::Relaxed);
                let mut spool = shared.spool();
                if let Err(error) = spool.quarantine(sealed.first_seq) {
                    tracing::error!(%error, "cannot move the damaged spool file aside");
                    return;
                }
                shared.publish_gauges(&spool);
                continue;
            }
            Err(error) => {
                tracing::error!(%error, "segment builder panicked");
                return;
            }
        };
        let key = match SegmentKey::new(
            &options.sidecar_id,
            sealed.first_seq,
            sealed.first_written_unix_nanos,
        ) {
            Ok(key) => key.to_path(&store.prefix),
            Err(error) => {
                tracing::error!(%error, "cannot name segment");
                return;
            }
        };
        let payload = PutPayload::from(bytes);
        let mut backoff = Duration::from_millis(200);
        let mut attempt = 0u32;
        loop {
            if attempt > 0 {
                metrics.upload_retries.fetch_add(1, Ordering::Relaxed);
            }
            attempt += 1;
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
                    metrics
                        .uncompressed_bytes
                        .fetch_add(summary.body_bytes, Ordering::Relaxed);
                    *shared.store_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
                    let uploaded = {
                        let mut spool = shared.spool();
                        let path = spool.forget(sealed.first_seq);
                        shared.publish_gauges(&spool);
                        path
                    };
                    shared.space.notify_all();
                    if let Some(path) = uploaded {
                        // Not under the spool lock and not on the runtime's threads: an
                        // unlink can wait for the disk (ext4 online discard).
                        let deleted = tokio::task::spawn_blocking(move || delete_file(&path)).await;
                        if let Ok(Err(error)) = deleted {
                            tracing::error!(%error, "cannot delete an uploaded spool file; it will be uploaded again after a restart (harmless)");
                        }
                    }
                    tracing::debug!(%key, records = summary.records, bytes = summary.object_bytes, "segment stored");
                    break;
                }
                Err(error) => {
                    metrics.upload_failures.fetch_add(1, Ordering::Relaxed);
                    let permanent = is_permanent(&error);
                    if permanent {
                        metrics
                            .upload_permanent_errors
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::error!(%error, %key, "segment upload refused by the store; records stay in the spool; fix the store settings (credentials, bucket)");
                        *shared.store_error.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(error.to_string());
                        backoff = backoff.max(Duration::from_secs(5));
                    } else {
                        tracing::warn!(%error, %key, retry_in = ?backoff, "segment upload failed; will retry");
                    }
                    if shared.past_deadline() {
                        return;
                    }
                    let wait = jitter(&mut rng, backoff);
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = async { while !shared.past_deadline() { tokio::time::sleep(Duration::from_millis(50)).await } } => return,
                    }
                    backoff =
                        (backoff * 2).min(Duration::from_secs(if permanent { 60 } else { 30 }));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{STREAM, captured_call};
    use super::*;
    use crate::spool::Spool;
    use std::io::Write;
    use tapline_proto::segment::{Limits, decode_segment};
    use tapline_proto::{LlmCall, Outcome};

    fn built_calls(path: &std::path::Path, metrics: &Metrics) -> Vec<LlmCall> {
        let (bytes, summary) = build_segment(
            path,
            3,
            tapline_proto::segment::VERSION,
            metrics,
            &MemoryBudget::new(crate::budget::DEFAULT_BYTES),
        )
        .unwrap();
        assert_eq!(summary.records, 1);
        decode_segment(&bytes, Limits::default())
            .unwrap()
            .into_iter()
            .filter_map(|r| match r.kind {
                Some(RecordKind::LlmCall(call)) => Some(call),
                _ => None,
            })
            .collect()
    }

    /// Regression: a 30 MB request with a 20 MB streamed answer (each under the capture
    /// cap) became a ~73 MB record that the readers refused, with its whole segment.
    #[test]
    fn a_call_too_large_for_the_readers_is_cut_when_its_segment_is_built() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), 1 << 30, 0).unwrap();
        let event = format!(
            "data: {{\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
            "x".repeat(1000)
        );
        let stream = event.repeat(20_000);
        let call = LlmCall {
            request_body: vec![b' '; 30 << 20].into(),
            request_body_size: 30 << 20,
            response_body: stream.clone().into_bytes().into(),
            response_body_size: stream.len() as u64,
            ..captured_call()
        };
        spool
            .append("s", 1, &mut Some(RecordKind::LlmCall(call)))
            .unwrap();
        let sealed = spool.seal().unwrap().unwrap();
        let calls = built_calls(&sealed.path, &Metrics::default());
        let call = &calls[0];
        assert!(prost::Message::encoded_len(call) <= crate::limits::MAX_RECORD_BYTES);
        assert_eq!(call.completions[0].text.len(), 20_000 * 1000);
        assert!(call.response_truncated);
        assert_eq!(call.response_body_size, stream.len() as u64);
        assert_eq!(call.request_body.len(), 30 << 20);
        assert!(
            call.capture_warnings
                .iter()
                .any(|w| w.starts_with("record_too_large: response_body cut")),
            "{:?}",
            call.capture_warnings
        );
    }

    /// A gzip answer that decodes to more than the budget holds is kept raw with a
    /// warning; under a budget that holds it, it is rebuilt.
    #[test]
    fn a_content_encoded_body_decodes_within_the_memory_budget() {
        let text = "x".repeat(2 << 20);
        let json = format!(
            "{{\"id\":\"c\",\"object\":\"chat.completion\",\"model\":\"m\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{text}\"}},\"finish_reason\":\"stop\"}}]}}"
        );
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(json.as_bytes()).unwrap();
        let gz = gz.finish().unwrap();
        let build = |limit: u64| {
            let dir = tempfile::tempdir().unwrap();
            let (mut spool, _) = Spool::open(dir.path(), 1 << 30, 0).unwrap();
            let call = LlmCall {
                streamed: false,
                response_headers: [("content-encoding".to_owned(), "gzip".to_owned())].into(),
                response_body: gz.clone().into(),
                response_body_size: gz.len() as u64,
                ..captured_call()
            };
            spool
                .append("s", 1, &mut Some(RecordKind::LlmCall(call)))
                .unwrap();
            let sealed = spool.seal().unwrap().unwrap();
            let budget = MemoryBudget::new(limit);
            let (bytes, _) =
                build_segment(&sealed.path, 3, 2, &Metrics::default(), &budget).unwrap();
            assert_eq!(budget.used(), 0, "the build gave its reservation back");
            match decode_segment(&bytes, Limits::default())
                .unwrap()
                .remove(0)
                .kind
            {
                Some(RecordKind::LlmCall(call)) => call,
                other => panic!("{other:?}"),
            }
        };
        let tight = build(4 << 20);
        assert!(tight.completions.is_empty());
        assert!(
            tight
                .capture_warnings
                .iter()
                .any(|w| w.contains("memory budget")),
            "{:?}",
            tight.capture_warnings
        );
        let roomy = build(64 << 20);
        assert_eq!(roomy.completions[0].text, text);
        assert!(
            roomy.capture_warnings.is_empty(),
            "{:?}",
            roomy.capture_warnings
        );
    }

    #[test]
    fn segments_carry_completed_calls_built_from_the_raw_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), 1 << 20, 0).unwrap();
        spool
            .append("s", 1, &mut Some(RecordKind::LlmCall(captured_call())))
            .unwrap();
        let sealed = spool.seal().unwrap().unwrap();
        // The spool holds the call as captured.
        let stored = crate::spool::read_sealed(&sealed.path).unwrap();
        let Some(RecordKind::LlmCall(raw)) = &stored[0].kind else {
            panic!("not a call: {:?}", stored[0]);
        };
        assert!(raw.completions.is_empty());
        assert_eq!(raw.outcome(), Outcome::Ok);

        let metrics = Metrics::default();
        let calls = built_calls(&sealed.path, &metrics);
        assert_eq!(calls[0].completions[0].text, "Hi");
        assert_eq!(calls[0].outcome(), Outcome::UpstreamError);
        assert_eq!(calls[0].error, "overloaded");
        assert_eq!(calls[0].response_body, STREAM.as_bytes());
        assert_eq!(metrics.body_errors.load(Ordering::Relaxed), 1);
        assert_eq!(metrics.capture_warnings.load(Ordering::Relaxed), 1);
    }

    /// `--segment-format 1` (an upgrade with older readers) writes what tapline 0.1 wrote;
    /// the default writes version 2, whose header is a zstd skippable frame.
    #[test]
    fn the_segment_format_setting_chooses_the_version_written() {
        let dir = tempfile::tempdir().unwrap();
        let (mut spool, _) = Spool::open(dir.path(), 1 << 20, 0).unwrap();
        spool
            .append("s", 1, &mut Some(RecordKind::LlmCall(captured_call())))
            .unwrap();
        let sealed = spool.seal().unwrap().unwrap();
        for (format, start) in [
            (1, b"TLSG".to_vec()),
            (
                2,
                tapline_proto::segment::SKIPPABLE_MAGIC
                    .to_le_bytes()
                    .to_vec(),
            ),
        ] {
            let (bytes, _) = build_segment(
                &sealed.path,
                3,
                format,
                &Metrics::default(),
                &MemoryBudget::new(crate::budget::DEFAULT_BYTES),
            )
            .unwrap();
            assert_eq!(&bytes[..4], &start[..]);
            let reader =
                tapline_proto::segment::SegmentReader::new(&bytes[..], Limits::default()).unwrap();
            assert_eq!(reader.version(), format);
            assert_eq!(decode_segment(&bytes, Limits::default()).unwrap().len(), 1);
        }
    }

    #[test]
    fn records_of_version_1_spool_files_are_already_complete() {
        // An older sidecar left a sealed file of format 1: its calls were completed
        // before they were spooled and must not be completed twice.
        let dir = tempfile::tempdir().unwrap();
        let mut call = captured_call();
        crate::rebuild::complete(&mut call);
        assert_eq!(call.capture_warnings.len(), 1);
        let record = tapline_proto::Record::new("s", 1, 1, RecordKind::LlmCall(call.clone()));
        let payload = prost::Message::encode_to_vec(&record);
        let path = dir.path().join(format!("{:016x}.sealed", 1));
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(b"TLSP\x01\0\0\0").unwrap();
        file.write_all(&(payload.len() as u32).to_le_bytes())
            .unwrap();
        file.write_all(&crc32c::crc32c(&payload).to_le_bytes())
            .unwrap();
        file.write_all(&payload).unwrap();
        drop(file);

        let (spool, recovery) = Spool::open(dir.path(), 1 << 20, 0).unwrap();
        assert_eq!(recovery.records, 1, "a version 1 file is read");
        let metrics = Metrics::default();
        let calls = built_calls(&spool.sealed()[0].path, &metrics);
        assert_eq!(calls, [call]);
        assert_eq!(metrics.capture_warnings.load(Ordering::Relaxed), 0);
    }
}
