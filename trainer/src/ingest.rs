//! Stage 1: segments from the store → records → episodes. The only stage that does
//! object-store IO ([`read_store`], [`write_cursor`]); [`assemble`] is pure.
//!
//! ## The run cursor
//!
//! Each run name has a cursor object at `{prefix}/trainer/runs/{run}/cursor.json`:
//!
//! ```json
//! {
//!   "version": 1,
//!   "watermark": "segments/v1/2026/12/01/09",
//!   "consumed": ["segments/v1/2026/12/02/08/pod-1/000000000000002a.tlseg", "..."],
//!   "pending_segments": ["..."],
//!   "pending_episodes": ["0193...-uuid", "..."]
//! }
//! ```
//!
//! A run reads every segment whose key sorts after `watermark` and is not in `consumed`,
//! plus the `pending_segments` again, keeping from those only the records of
//! `pending_episodes` (episodes that had not ended yet, within the grace period). After a
//! successful run the cursor is rewritten: every segment read is consumed; segments
//! holding records of episodes still pending become `pending_segments`; the watermark
//! moves to `lookback_hours` before the newest segment's hour and consumed keys below it
//! are forgotten. The lookback lets a sidecar that uploads late (after a restart or an
//! outage) still be read, as long as it is late by less than `lookback_hours`. The
//! cursor is only written after the batches are written, so a failed run reads the same
//! segments again. Two runs with the same name must not run at once.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};
use serde::{Deserialize, Serialize};
use tapline_proto::keys::{SegmentKey, segments_root};
use tapline_proto::segment::{Limits, SegmentError, SkippedRecord, read_segment};
use tapline_proto::store::StoreLocation;
use tapline_proto::{EpisodeEvent, EpisodeEventKind, LlmCall, Record, RecordKind, Reward};

/// Why records could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IngestError {
    /// A store operation failed.
    #[error("store {store}: {action}: {source}")]
    Store {
        /// The store, as displayed.
        store: String,
        /// What was being done.
        action: String,
        /// The store's error.
        source: object_store::Error,
    },
    /// A segment failed its checks.
    #[error(
        "segment {key} is unreadable: {source} (set ingest.skip_unreadable_segments = true to skip it and read the rest)"
    )]
    Segment {
        /// The segment's key.
        key: String,
        /// The decoder's error.
        source: SegmentError,
    },
    /// The cursor object is not one this version understands.
    #[error(
        "cursor {key} is not valid: {reason}; delete it to start the run over from the first segment"
    )]
    BadCursor {
        /// The cursor's key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The run name cannot be used in a key.
    #[error("run name {0:?} is invalid: use 1 to 128 characters from A-Z a-z 0-9 . _ -")]
    BadRunName(String),
}

/// Settings of the ingest stage (section `[ingest]` of the run config).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IngestOptions {
    /// How late (in hours) a segment may be uploaded, relative to the newest one
    /// already read, and still be found by the next run (default 24).
    pub lookback_hours: u32,
    /// Skip segments that fail their checks instead of failing the run (default
    /// false). Skipped segments are listed in the report and not read again.
    pub skip_unreadable_segments: bool,
    /// Segments fetched at once (default 8).
    pub concurrent_reads: usize,
}

impl Default for IngestOptions {
    fn default() -> Self {
        IngestOptions {
            lookback_hours: 24,
            skip_unreadable_segments: false,
            concurrent_reads: 8,
        }
    }
}

/// Progress of one run name through the store; see the module documentation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cursor {
    /// Format version (1).
    pub version: u32,
    /// Keys sorting at or before this one (relative to the store prefix) are not read.
    pub watermark: String,
    /// Keys after the watermark already read.
    pub consumed: BTreeSet<String>,
    /// Keys to read again for the records of `pending_episodes`.
    pub pending_segments: BTreeSet<String>,
    /// Episodes that had not ended at the last run.
    pub pending_episodes: BTreeSet<String>,
}

/// One episode with everything recorded about it.
#[derive(Debug, Clone, Default)]
pub struct Episode {
    /// The episode id.
    pub episode_id: String,
    /// Task (from the start event, else the end event, else its calls).
    pub task_id: String,
    /// Comparison group within the task (same sources).
    pub group_id: String,
    /// The start event, if recorded.
    pub start: Option<EpisodeEvent>,
    /// The end event, if recorded.
    pub end: Option<EpisodeEvent>,
    /// Its calls, ordered by start time, then `seq`, then span id.
    pub calls: Vec<LlmCall>,
    /// Its rewards, ordered by time, then id.
    pub rewards: Vec<Reward>,
    /// Time of its latest record (written time or event time), Unix nanoseconds.
    pub last_activity_unix_nanos: i64,
    /// Keys of the segments holding its records.
    pub segments: BTreeSet<String>,
}

/// Records joined into episodes.
#[derive(Debug, Clone, Default)]
pub struct Ingested {
    /// Episodes, ordered by id.
    pub episodes: Vec<Episode>,
    /// Records read (duplicates included).
    pub records: u64,
    /// Records dropped because a record with the same id was already read.
    pub duplicate_records: u64,
    /// Calls without an episode.
    pub unattributed_calls: u64,
    /// Rewards and events without an episode, and records without a payload.
    pub orphan_records: u64,
    /// The version of `[clean] policy` announced when the run started (set by the
    /// caller, which reads it from the store; `None` when no policy or none announced).
    pub latest_policy_version: Option<u64>,
}

/// Joins records into episodes: dedupes by `Record.id` (first seen wins), groups by
/// episode, orders calls and rewards. `segments` pairs each segment key with its
/// records, in reading order.
pub fn assemble(segments: impl IntoIterator<Item = (String, Vec<Record>)>) -> Ingested {
    let mut seen: HashSet<String> = HashSet::new();
    let mut episodes: BTreeMap<String, Episode> = BTreeMap::new();
    let mut out = Ingested::default();
    for (key, records) in segments {
        for record in records {
            out.records += 1;
            if !record.id.is_empty() && !seen.insert(record.id.clone()) {
                out.duplicate_records += 1;
                continue;
            }
            let Some(episode_id) = record.episode_id().map(str::to_owned) else {
                match record.kind {
                    Some(RecordKind::LlmCall(_)) => out.unattributed_calls += 1,
                    _ => out.orphan_records += 1,
                }
                continue;
            };
            let episode = episodes
                .entry(episode_id.clone())
                .or_insert_with(|| Episode {
                    episode_id,
                    ..Episode::default()
                });
            episode.segments.insert(key.clone());
            let mut time = record.written_unix_nanos;
            match record.kind {
                Some(RecordKind::LlmCall(call)) => episode.calls.push(call),
                Some(RecordKind::Reward(reward)) => {
                    time = time.max(reward.time_unix_nanos);
                    episode.rewards.push(reward);
                }
                Some(RecordKind::EpisodeEvent(event)) => {
                    time = time.max(event.time_unix_nanos);
                    let slot = match event.kind() {
                        EpisodeEventKind::Start => &mut episode.start,
                        EpisodeEventKind::End => &mut episode.end,
                        EpisodeEventKind::Unspecified => {
                            out.orphan_records += 1;
                            continue;
                        }
                    };
                    // Keep the latest event of each kind.
                    if slot
                        .as_ref()
                        .is_none_or(|old| old.time_unix_nanos <= event.time_unix_nanos)
                    {
                        *slot = Some(event);
                    }
                }
                None => {
                    out.orphan_records += 1;
                    continue;
                }
            }
            episode.last_activity_unix_nanos = episode.last_activity_unix_nanos.max(time);
        }
    }
    for episode in episodes.values_mut() {
        episode.calls.sort_by(|a, b| {
            (a.start_unix_nanos, a.seq, &a.span_id).cmp(&(b.start_unix_nanos, b.seq, &b.span_id))
        });
        episode.rewards.sort_by(|a, b| {
            (a.time_unix_nanos, &a.reward_id).cmp(&(b.time_unix_nanos, &b.reward_id))
        });
        let from_events = [&episode.start, &episode.end]
            .into_iter()
            .flatten()
            .map(|e| (e.task_id.as_str(), e.group_id.as_str()));
        let from_calls = episode
            .calls
            .iter()
            .map(|c| (c.task_id.as_str(), c.group_id.as_str()));
        let mut sources: Vec<(&str, &str)> = from_events.chain(from_calls).collect();
        sources.retain(|(task, _)| !task.is_empty());
        if let Some((task, group)) = sources.first() {
            episode.task_id = (*task).to_owned();
            episode.group_id = (*group).to_owned();
        }
    }
    out.episodes = episodes.into_values().collect();
    out
}

/// What [`read_store`] found.
#[derive(Debug, Default)]
pub struct StoreRead {
    /// The episodes.
    pub ingested: Ingested,
    /// The cursor the run started from.
    pub cursor: Cursor,
    /// New segments read (keys relative to the store prefix), in key order.
    pub new_segments: Vec<String>,
    /// Pending segments read again.
    pub reread_segments: Vec<String>,
    /// Segments skipped because they failed their checks, with the reason.
    pub unreadable_segments: Vec<(String, String)>,
    /// Records larger than the reader's limit, passed over in segments that were read
    /// (the rest of each such segment was read).
    pub oversized_records: Vec<(String, SkippedRecord)>,
    /// Objects under the segments directory that are not segment keys.
    pub foreign_objects: u64,
    /// SHA-256 (hex) of every segment read, by key: the provenance of a run's manifest.
    pub checksums: std::collections::BTreeMap<String, String>,
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn cursor_path(prefix: &Path, run: &str) -> Path {
    prefix
        .child("trainer")
        .child("runs")
        .child(run)
        .child("cursor.json")
}

/// Checks that a run name can be one component of a key.
pub fn validate_run_name(run: &str) -> Result<(), IngestError> {
    let ok = !run.is_empty()
        && run.len() <= 128
        && !run.starts_with('.')
        && run
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(IngestError::BadRunName(run.to_owned()))
    }
}

/// Key relative to the store prefix.
fn relative(prefix: &Path, path: &Path) -> String {
    match path.prefix_match(prefix) {
        Some(parts) => parts
            .map(|p| p.as_ref().to_owned())
            .collect::<Vec<_>>()
            .join("/"),
        None => path.to_string(),
    }
}

fn absolute(prefix: &Path, relative: &str) -> Path {
    relative
        .split('/')
        .filter(|p| !p.is_empty())
        .fold(prefix.clone(), |path, part| path.child(part))
}

/// Reads the run's cursor (`None` reads from the first segment) and every segment it
/// says is new or pending, and joins the records.
pub async fn read_store(
    location: &StoreLocation,
    run: Option<&str>,
    options: &IngestOptions,
) -> Result<StoreRead, IngestError> {
    let store = &location.store;
    let prefix = &location.prefix;
    let store_err = |action: String| {
        let display = location.display.clone();
        move |source| IngestError::Store {
            store: display,
            action,
            source,
        }
    };
    let cursor = match run {
        Some(run) => {
            validate_run_name(run)?;
            read_cursor(location, run).await?
        }
        None => Cursor::default(),
    };

    let root = segments_root(prefix);
    let listing = if cursor.watermark.is_empty() {
        store.list(Some(&root))
    } else {
        store.list_with_offset(Some(&root), &absolute(prefix, &cursor.watermark))
    };
    let metas: Vec<_> = listing
        .try_collect()
        .await
        .map_err(store_err(format!("list {root}")))?;
    let mut read = StoreRead {
        cursor: cursor.clone(),
        ..StoreRead::default()
    };
    let mut new_paths = Vec::new();
    for meta in metas {
        if SegmentKey::parse(prefix, &meta.location).is_err() {
            read.foreign_objects += 1;
            continue;
        }
        let rel = relative(prefix, &meta.location);
        if rel.as_str() <= cursor.watermark.as_str() || cursor.consumed.contains(&rel) {
            continue;
        }
        new_paths.push((rel, meta.location));
    }
    new_paths.sort();
    let reread: Vec<(String, Path)> = cursor
        .pending_segments
        .iter()
        .map(|k| (k.clone(), absolute(prefix, k)))
        .collect();

    let fetch = |(rel, path): (String, Path), reread: bool| {
        let store: std::sync::Arc<dyn ObjectStore> = store.clone();
        let err = store_err(format!("read {path}"));
        async move {
            let bytes = match store.get(&path).await {
                Ok(got) => got.bytes().await.map_err(err)?,
                Err(object_store::Error::NotFound { .. }) if reread => bytes::Bytes::new(),
                Err(e) => return Err(err(e)),
            };
            Ok::<_, IngestError>((rel, bytes, reread))
        }
    };
    let jobs = reread
        .into_iter()
        .map(|p| (p, true))
        .chain(new_paths.into_iter().map(|p| (p, false)));
    let fetched: Vec<(String, bytes::Bytes, bool)> = futures::stream::iter(jobs)
        .map(|(p, reread)| fetch(p, reread))
        .buffered(options.concurrent_reads.max(1))
        .try_collect()
        .await?;

    let mut segments: Vec<(String, Vec<Record>)> = Vec::with_capacity(fetched.len());
    for (rel, bytes, reread) in fetched {
        if reread && bytes.is_empty() {
            // A pending segment that was deleted since: nothing left to read in it.
            read.reread_segments.push(rel);
            continue;
        }
        read.checksums.insert(rel.clone(), sha256_hex(&bytes));
        let records = match read_segment(&bytes, Limits::default()) {
            Ok(contents) => {
                read.oversized_records
                    .extend(contents.skipped.into_iter().map(|s| (rel.clone(), s)));
                contents.records
            }
            Err(source) if options.skip_unreadable_segments => {
                read.unreadable_segments
                    .push((rel.clone(), source.to_string()));
                if !reread {
                    read.new_segments.push(rel);
                }
                continue;
            }
            Err(source) => return Err(IngestError::Segment { key: rel, source }),
        };
        let records = if reread {
            read.reread_segments.push(rel.clone());
            records
                .into_iter()
                .filter(|r| {
                    r.episode_id()
                        .is_some_and(|e| cursor.pending_episodes.contains(e))
                })
                .collect()
        } else {
            read.new_segments.push(rel.clone());
            records
        };
        segments.push((rel, records));
    }
    read.ingested = assemble(segments);
    Ok(read)
}

/// Reads the run's cursor (the empty cursor when there is none yet).
pub async fn read_cursor(location: &StoreLocation, run: &str) -> Result<Cursor, IngestError> {
    let path = cursor_path(&location.prefix, run);
    let bytes = match location.store.get(&path).await {
        Ok(got) => got.bytes().await,
        Err(object_store::Error::NotFound { .. }) => return Ok(Cursor::default()),
        Err(e) => Err(e),
    }
    .map_err(|source| IngestError::Store {
        store: location.display.clone(),
        action: format!("read cursor {path}"),
        source,
    })?;
    let cursor: Cursor = serde_json::from_slice(&bytes).map_err(|e| IngestError::BadCursor {
        key: path.to_string(),
        reason: e.to_string(),
    })?;
    if cursor.version != 1 {
        return Err(IngestError::BadCursor {
            key: path.to_string(),
            reason: format!("version {} is not 1", cursor.version),
        });
    }
    Ok(cursor)
}

/// The cursor after a successful run; see the module documentation.
///
/// `pending` maps each episode still pending to the segments holding its records.
pub fn next_cursor(
    read: &StoreRead,
    pending: &BTreeMap<String, BTreeSet<String>>,
    lookback_hours: u32,
    prefix: &Path,
) -> Cursor {
    let mut consumed = read.cursor.consumed.clone();
    consumed.extend(read.new_segments.iter().cloned());
    let pending_segments: BTreeSet<String> = pending.values().flatten().cloned().collect();
    let newest_hour = consumed
        .iter()
        .filter_map(|k| SegmentKey::parse(prefix, &absolute(prefix, k)).ok())
        .map(|k| k.hour_unix_secs)
        .max();
    let mut watermark = read.cursor.watermark.clone();
    if let Some(hour) = newest_hour {
        let cut = hour - i64::from(lookback_hours) * 3600;
        // The path of a segment of that hour, cut after the hour component.
        let probe = SegmentKey {
            hour_unix_secs: cut,
            sidecar_id: "x".into(),
            first_seq: 0,
        }
        .to_path(prefix);
        let parts: Vec<String> = probe
            .prefix_match(prefix)
            .map(|p| p.map(|p| p.as_ref().to_owned()).collect())
            .unwrap_or_default();
        let candidate = parts[..parts.len().saturating_sub(2)].join("/");
        if candidate > watermark {
            watermark = candidate;
        }
    }
    consumed.retain(|k| k.as_str() > watermark.as_str());
    Cursor {
        version: 1,
        watermark,
        consumed,
        pending_segments,
        pending_episodes: pending.keys().cloned().collect(),
    }
}

/// Writes the run's cursor (after the batches are written).
pub async fn write_cursor(
    location: &StoreLocation,
    run: &str,
    cursor: &Cursor,
) -> Result<(), IngestError> {
    validate_run_name(run)?;
    let path = cursor_path(&location.prefix, run);
    let body = serde_json::to_vec_pretty(cursor).unwrap_or_default();
    location
        .store
        .put(&path, PutPayload::from(body))
        .await
        .map_err(|source| IngestError::Store {
            store: location.display.clone(),
            action: format!("write cursor {path}"),
            source,
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tapline_proto::EndStatus;

    fn call(span: &str, episode: &str, start: i64, seq: u32) -> Record {
        Record::new(
            "s",
            1,
            start,
            RecordKind::LlmCall(LlmCall {
                span_id: span.into(),
                episode_id: episode.into(),
                task_id: "t".into(),
                start_unix_nanos: start,
                seq,
                ..LlmCall::default()
            }),
        )
    }

    #[test]
    fn dedupes_joins_and_orders() {
        let end = Record::new(
            "s",
            9,
            50,
            RecordKind::EpisodeEvent(EpisodeEvent {
                event_id: "e-end".into(),
                episode_id: "ep".into(),
                kind: EpisodeEventKind::End as i32,
                status: EndStatus::Succeeded as i32,
                task_id: "task-from-end".into(),
                group_id: "g".into(),
                time_unix_nanos: 70,
                ..EpisodeEvent::default()
            }),
        );
        let reward = Record::new(
            "s",
            10,
            60,
            RecordKind::Reward(Reward {
                reward_id: "r1".into(),
                episode_id: "ep".into(),
                value: 1.0,
                time_unix_nanos: 60,
                ..Reward::default()
            }),
        );
        let seg1 = vec![
            call("c2", "ep", 20, 1),
            call("c1", "ep", 10, 0),
            call("u", "", 5, 0),
        ];
        let seg2 = vec![call("c1", "ep", 10, 0), end, reward.clone(), reward];
        let ing = assemble([("a".to_owned(), seg1), ("b".to_owned(), seg2)]);
        assert_eq!(ing.records, 7);
        assert_eq!(ing.duplicate_records, 2);
        assert_eq!(ing.unattributed_calls, 1);
        let ep = &ing.episodes[0];
        let spans: Vec<_> = ep.calls.iter().map(|c| c.span_id.as_str()).collect();
        assert_eq!(spans, ["c1", "c2"]);
        assert_eq!(ep.task_id, "task-from-end");
        assert_eq!(ep.group_id, "g");
        assert_eq!(ep.rewards.len(), 1);
        assert_eq!(ep.last_activity_unix_nanos, 70);
        assert_eq!(ep.segments.len(), 2);
    }

    #[test]
    fn watermark_trails_the_newest_hour() {
        let prefix = Path::from("p");
        let key = |hour: i64, seq| {
            relative(
                &prefix,
                &SegmentKey::new("s", seq, hour * 3_600_000_000_000)
                    .unwrap()
                    .to_path(&prefix),
            )
        };
        let read = StoreRead {
            new_segments: vec![key(500_000, 1), key(500_010, 2), key(500_030, 3)],
            ..StoreRead::default()
        };
        let cursor = next_cursor(&read, &BTreeMap::new(), 24, &prefix);
        assert_eq!(cursor.watermark, "segments/v1/2027/01/15/14");
        assert_eq!(cursor.consumed.len(), 2, "{cursor:?}");
        assert!(cursor.consumed.iter().all(|k| k > &cursor.watermark));
    }
}
