//! Stage 1: segments from the store → records → episodes. The only stage that does
//! object-store IO ([`read_store`], [`write_cursor`]); [`assemble`] is pure.
//!
//! ## The run cursor
//!
//! Each run name has a cursor object at `{prefix}/trainer/runs/{run}/cursor.json`:
//!
//! ```json
//! {
//!   "version": 2,
//!   "watermark": "segments/v1/2026/12/01/09",
//!   "sidecars": {
//!     "pod-1": {"ranges": [[0, 4181], [4200, 4310]], "newest_hour": "segments/v1/2026/12/02/08"}
//!   },
//!   "pending_segments": ["..."],
//!   "pending_episodes": ["0193...-uuid", "..."]
//! }
//! ```
//!
//! A run reads every segment whose key sorts after `watermark` and that it has not read
//! before, plus the `pending_segments` again, keeping from those only the records of
//! `pending_episodes` (episodes that had not ended yet, within the grace period).
//!
//! What was read is kept per sidecar, not per segment: a sidecar's spool numbers its
//! records in increasing order for ever (from the clock when it starts with an empty
//! spool; `tapline_proto::keys`), so sidecar ids must be unique (the default, the host
//! name, is: two spools under one id could number records alike), a segment holds the records
//! `first_seq ..= first_seq + count - 1`, and `ranges` are those spans of the segments
//! read, merged. A segment was read iff its `first_seq` falls in a range of its sidecar
//! (spans of one sidecar never overlap). Segments arrive in order almost always, so a
//! busy sidecar is one range whatever its number of segments; one that uploads out of
//! order after a retry, or whose numbering jumped (a lost spool restarts from the clock),
//! has a few more until the hole is filled. The cursor's size follows the number of
//! sidecars, not of segments. (Version 1 kept every key read, in `consumed`; such a
//! cursor is read as is, its keys stay authoritative until the watermark passes them,
//! and it is written back as version 2.)
//!
//! After a successful run the cursor is rewritten: every segment read joins its
//! sidecar's ranges; segments holding records of episodes still pending become
//! `pending_segments`; the watermark moves to `lookback_hours` before the newest
//! segment's hour (a segment dated after the run's `now`, from a sidecar whose clock
//! runs ahead, counts as dated now), and a sidecar whose newest segment read is before the watermark is
//! forgotten (any segment of it that was read sorts before the watermark and is never
//! listed again). The lookback lets a sidecar that uploads late (after a restart or an
//! outage) still be read, as long as it is late by less than `lookback_hours`. The
//! cursor is only written after the batches are written, so a failed run reads the same
//! segments again. Two runs with the same name must not run at once.
//!
//! ## Listing and reading
//!
//! With a watermark, only the hour directories from the watermark's to the current
//! hour are listed, each with its own `list` call, concurrently, plus one listing of
//! everything after the current hour (sidecar clocks ahead). Segments are fetched and
//! decoded `concurrent_reads` at a time and assembled in key order, so the result is the
//! same as a sequential read; memory holds at most that many segment objects at once
//! besides the records kept.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, PutMode, PutPayload};
use serde::{Deserialize, Serialize};
use tapline_proto::keys::{SegmentKey, hour_dir, parse_hour_dir, segments_root};
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
    /// The cursor was written by someone else since this run read it.
    #[error(
        "cursor {key} of run {run:?} moved since this run read it: another trainer advanced it (two trainers on one run name?). This run committed nothing; what it read stays for the run that advanced the cursor or the next one"
    )]
    CursorMoved {
        /// The run name.
        run: String,
        /// The cursor's key.
        key: String,
    },
    /// The store cannot write conditionally, so a cursor could be advanced twice.
    #[error(
        "store {store} refuses conditional writes (create-if-absent, update-if-unchanged), which keep two trainers from advancing one cursor: use a store that has them (S3 and S3-compatible servers with If-Match, GCS, Azure, a local directory)"
    )]
    NoConditionalWrites {
        /// The store, as displayed.
        store: String,
    },
}

/// The stored version of a run's cursor: what the conditional write that advances it
/// expects to replace.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CursorVersion {
    /// There is no cursor yet: the write creates it, and fails if one appeared.
    #[default]
    Absent,
    /// The cursor object as read: the write replaces exactly it.
    Stored(object_store::UpdateVersion),
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
    /// Segments fetched and decoded at once (default 32: at S3's ~30 ms per request this
    /// reads ~28x faster than one at a time, `benches/fleet.rs`; memory holds at most this
    /// many segment objects, 8 MiB each at the sidecar's largest).
    pub concurrent_reads: usize,
}

impl Default for IngestOptions {
    fn default() -> Self {
        IngestOptions {
            lookback_hours: 24,
            skip_unreadable_segments: false,
            concurrent_reads: 32,
        }
    }
}

/// The cursor format written.
pub const CURSOR_VERSION: u32 = 2;

/// Progress of one run name through the store; see the module documentation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cursor {
    /// Format version ([`CURSOR_VERSION`]; 1 is read too).
    pub version: u32,
    /// Keys sorting at or before this one (relative to the store prefix) are not read.
    pub watermark: String,
    /// What was read of each sidecar's segments after the watermark.
    #[serde(default)]
    pub sidecars: BTreeMap<String, SidecarProgress>,
    /// Keys after the watermark read under version 1 (version 2 keeps `sidecars`
    /// instead; kept until the watermark passes them).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub consumed: BTreeSet<String>,
    /// Keys to read again for the records of `pending_episodes`.
    pub pending_segments: BTreeSet<String>,
    /// Episodes that had not ended at the last run.
    pub pending_episodes: BTreeSet<String>,
    /// The run that wrote this cursor (an id of its own): [`write_cursor`] tells a
    /// client retry of its own write that landed from another run's write.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub written_by: String,
}

impl Cursor {
    /// Whether the segment `rel` (relative key, parsed as `key`) was read before or
    /// sorts at or before the watermark.
    pub fn is_consumed(&self, rel: &str, key: &SegmentKey) -> bool {
        rel <= self.watermark.as_str()
            || self.consumed.contains(rel)
            || self
                .sidecars
                .get(&key.sidecar_id)
                .is_some_and(|p| p.contains(key.first_seq))
    }
}

/// The part of one sidecar's segments a run name has read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarProgress {
    /// Spool sequence spans `[first, last]` of the segments read: ascending, disjoint,
    /// and not adjacent (adjacent spans are merged).
    pub ranges: Vec<[u64; 2]>,
    /// Hour directory (relative to the store prefix) of the newest segment read.
    pub newest_hour: String,
}

impl SidecarProgress {
    /// Whether `seq` falls in a span.
    pub fn contains(&self, seq: u64) -> bool {
        let i = self.ranges.partition_point(|r| r[1] < seq);
        self.ranges.get(i).is_some_and(|r| r[0] <= seq)
    }

    /// Adds the span `first ..= last`, merging it with the spans it overlaps or touches.
    pub fn insert(&mut self, first: u64, last: u64) {
        let (first, last) = (first.min(last), first.max(last));
        // Spans ending before `first - 1` stay left; spans starting after `last + 1` right.
        let lo = self
            .ranges
            .partition_point(|r| r[1].saturating_add(1) < first);
        let hi = self
            .ranges
            .partition_point(|r| r[0] <= last.saturating_add(1));
        let (mut a, mut b) = (first, last);
        if lo < hi {
            a = a.min(self.ranges[lo][0]);
            b = b.max(self.ranges[hi - 1][1]);
        }
        self.ranges.splice(lo..hi, [[a, b]]);
    }
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
    /// Its stored version ([`CursorVersion::Absent`] for a read without a run name, or
    /// one that followed another reader's plan).
    pub cursor_version: CursorVersion,
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
    /// Records in each new segment read (those skipped as oversized included; 1 for an
    /// unreadable segment, whose count is unknown): its span of sequence numbers.
    pub record_counts: BTreeMap<String, u64>,
    /// `list` calls made.
    pub list_calls: u64,
    /// The time the run took for now ([`read_store`]'s `now_unix_nanos`): segments dated
    /// after it (a sidecar whose clock runs ahead) move the watermark as if dated now.
    /// `None`: no such cap.
    pub now_unix_nanos: Option<i64>,
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The key of the run's cursor in `location`.
pub fn cursor_key(location: &StoreLocation, run: &str) -> String {
    cursor_path(&location.prefix, run).to_string()
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

/// The hour directories listed one by one at most; a longer window (a run name not run
/// for a week) is listed in one pass after the watermark.
const MAX_HOURS_LISTED: i64 = 24 * 8;

/// What one reader read, for others to read exactly the same (the ranks of a
/// distributed run: rank 0 lists, the others read its list, so a segment landing between
/// two listings cannot make their batches differ).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadPlan {
    /// The cursor the read started from.
    pub cursor: Cursor,
    /// The new segments read (relative keys).
    pub segments: Vec<String>,
    /// The time the read took as now.
    pub now_unix_nanos: i64,
}

impl StoreRead {
    /// The plan that reads exactly what this read read.
    pub fn plan(&self, now_unix_nanos: i64) -> ReadPlan {
        ReadPlan {
            cursor: self.cursor.clone(),
            segments: self.new_segments.clone(),
            now_unix_nanos,
        }
    }
}

/// Reads the run's cursor (`None` reads from the first segment) and every segment it
/// says is new or pending, and joins the records. `now_unix_nanos` bounds the hour
/// directories listed one by one (later ones are listed in one pass).
pub async fn read_store(
    location: &StoreLocation,
    run: Option<&str>,
    options: &IngestOptions,
    now_unix_nanos: i64,
) -> Result<StoreRead, IngestError> {
    read_store_planned(location, run, options, now_unix_nanos, None).await
}

/// [`read_store`], or with `plan` the cursor and new segments another reader read (no
/// listing; the pending segments come from the plan's cursor).
pub async fn read_store_planned(
    location: &StoreLocation,
    run: Option<&str>,
    options: &IngestOptions,
    now_unix_nanos: i64,
    plan: Option<&ReadPlan>,
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
    let (cursor, cursor_version) = match (run, plan) {
        (_, Some(plan)) => (plan.cursor.clone(), CursorVersion::Absent),
        (Some(run), None) => {
            validate_run_name(run)?;
            read_cursor_versioned(location, run).await?
        }
        (None, None) => (Cursor::default(), CursorVersion::Absent),
    };
    let concurrency = options.concurrent_reads.max(1);

    let mut read = StoreRead {
        cursor: cursor.clone(),
        cursor_version,
        now_unix_nanos: Some(now_unix_nanos),
        ..StoreRead::default()
    };
    let metas = match plan {
        Some(_) => (Vec::new(), 0),
        None => list_after(location, &cursor.watermark, now_unix_nanos, concurrency).await?,
    };
    read.list_calls = metas.1;
    let mut new_paths: Vec<(String, Path)> = plan
        .map(|p| {
            p.segments
                .iter()
                .map(|k| (k.clone(), absolute(prefix, k)))
                .collect()
        })
        .unwrap_or_default();
    for meta in metas.0 {
        let Ok(key) = SegmentKey::parse(prefix, &meta.location) else {
            read.foreign_objects += 1;
            continue;
        };
        let rel = relative(prefix, &meta.location);
        if cursor.is_consumed(&rel, &key) {
            continue;
        }
        new_paths.push((rel, meta.location));
    }
    new_paths.sort();
    new_paths.dedup();
    let reread: Vec<(String, Path)> = cursor
        .pending_segments
        .iter()
        .map(|k| (k.clone(), absolute(prefix, k)))
        .collect();

    // Fetch and decode `concurrency` segments at a time, in key order.
    let fetch = |(rel, path): (String, Path), reread: bool| {
        let store: std::sync::Arc<dyn ObjectStore> = store.clone();
        let err = store_err(format!("read {path}"));
        async move {
            let bytes = match store.get(&path).await {
                Ok(got) => got.bytes().await.map_err(err)?,
                // A pending segment deleted since: nothing left to read in it.
                Err(object_store::Error::NotFound { .. }) if reread => {
                    return Ok::<_, IngestError>((rel, reread, None));
                }
                Err(e) => return Err(err(e)),
            };
            let decoded = tokio::task::spawn_blocking(move || {
                (sha256_hex(&bytes), read_segment(&bytes, Limits::default()))
            })
            .await
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic.into_panic()));
            Ok((rel, reread, Some(decoded)))
        }
    };
    let jobs = reread
        .into_iter()
        .map(|p| (p, true))
        .chain(new_paths.into_iter().map(|p| (p, false)));
    let mut fetched = futures::stream::iter(jobs)
        .map(|(p, reread)| fetch(p, reread))
        .buffered(concurrency);

    let mut segments: Vec<(String, Vec<Record>)> = Vec::new();
    while let Some(next) = fetched.next().await {
        let (rel, reread, decoded) = next?;
        let Some((checksum, decoded)) = decoded else {
            read.reread_segments.push(rel);
            continue;
        };
        read.checksums.insert(rel.clone(), checksum);
        let records = match decoded {
            Ok(contents) => {
                if !reread {
                    read.record_counts.insert(
                        rel.clone(),
                        (contents.records.len() + contents.skipped.len()) as u64,
                    );
                }
                read.oversized_records
                    .extend(contents.skipped.into_iter().map(|s| (rel.clone(), s)));
                contents.records
            }
            Err(source) if options.skip_unreadable_segments => {
                read.unreadable_segments
                    .push((rel.clone(), source.to_string()));
                if !reread {
                    read.record_counts.insert(rel.clone(), 1);
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

/// Lists the objects under the segments directory that sort after `watermark` (every
/// one when it is empty): the hour directories from the watermark's to `now`'s one by
/// one, `concurrency` at a time, and everything after in one pass. Returns the objects
/// (unordered) and the number of `list` calls.
async fn list_after(
    location: &StoreLocation,
    watermark: &str,
    now_unix_nanos: i64,
    concurrency: usize,
) -> Result<(Vec<object_store::ObjectMeta>, u64), IngestError> {
    let store = &location.store;
    let prefix = &location.prefix;
    let root = segments_root(prefix);
    let err = |action: String| {
        let display = location.display.clone();
        move |source| IngestError::Store {
            store: display,
            action,
            source,
        }
    };
    let whole = |offset: Option<Path>| async move {
        let listing = match &offset {
            None => store.list(Some(&root)),
            Some(offset) => store.list_with_offset(Some(&root), offset),
        };
        listing
            .try_collect::<Vec<_>>()
            .await
            .map_err(err(format!("list {}", segments_root(prefix))))
    };
    if watermark.is_empty() {
        return Ok((whole(None).await?, 1));
    }
    let watermark_path = absolute(prefix, watermark);
    let Ok(from) = parse_hour_dir(prefix, &watermark_path) else {
        // Not an hour directory (written by hand?): everything after it.
        return Ok((whole(Some(watermark_path)).await?, 1));
    };
    let now_hour = now_unix_nanos.div_euclid(1_000_000_000).div_euclid(3600) * 3600;
    let to = now_hour.max(from);
    if (to - from) / 3600 > MAX_HOURS_LISTED {
        return Ok((whole(Some(watermark_path)).await?, 1));
    }
    // The watermark's own hour directory sorts before its keys: they are after it.
    let hours: Vec<Path> = (0..=(to - from) / 3600)
        .map(|i| hour_dir(prefix, from + i * 3600))
        .collect();
    let calls = hours.len() as u64 + 1;
    let per_hour = futures::stream::iter(hours)
        .map(|dir| async move {
            store
                .list(Some(&dir))
                .try_collect::<Vec<_>>()
                .await
                .map_err(err(format!("list {dir}")))
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<_>>();
    let after = whole(Some(hour_dir(prefix, to + 3600)));
    let (per_hour, after) = futures::join!(per_hour, after);
    let mut metas: Vec<_> = per_hour?.into_iter().flatten().collect();
    metas.extend(after?);
    Ok((metas, calls))
}

/// Reads the run's cursor (the empty cursor when there is none yet).
pub async fn read_cursor(location: &StoreLocation, run: &str) -> Result<Cursor, IngestError> {
    Ok(read_cursor_versioned(location, run).await?.0)
}

/// Reads the run's cursor and its stored version, which [`write_cursor`] expects.
pub async fn read_cursor_versioned(
    location: &StoreLocation,
    run: &str,
) -> Result<(Cursor, CursorVersion), IngestError> {
    let path = cursor_path(&location.prefix, run);
    let store_err = |source| IngestError::Store {
        store: location.display.clone(),
        action: format!("read cursor {path}"),
        source,
    };
    let got = match location.store.get(&path).await {
        Ok(got) => got,
        Err(object_store::Error::NotFound { .. }) => {
            return Ok((Cursor::default(), CursorVersion::Absent));
        }
        Err(e) => return Err(store_err(e)),
    };
    let version = object_store::UpdateVersion {
        e_tag: got.meta.e_tag.clone(),
        version: got.meta.version.clone(),
    };
    let bytes = got.bytes().await.map_err(store_err)?;
    let cursor: Cursor = serde_json::from_slice(&bytes).map_err(|e| IngestError::BadCursor {
        key: path.to_string(),
        reason: e.to_string(),
    })?;
    match cursor.version {
        // Version 1 keeps every key read in `consumed`, which version 2 still honours.
        1 if cursor.sidecars.is_empty() => Ok((cursor, CursorVersion::Stored(version))),
        CURSOR_VERSION => Ok((cursor, CursorVersion::Stored(version))),
        v => Err(IngestError::BadCursor {
            key: path.to_string(),
            reason: format!("version {v} is not one this trainer reads (1 or {CURSOR_VERSION})"),
        }),
    }
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
    let mut sidecars = read.cursor.sidecars.clone();
    for rel in &read.new_segments {
        let Ok(key) = SegmentKey::parse(prefix, &absolute(prefix, rel)) else {
            // Not a segment key (cannot happen: only keys are read); kept as a key.
            consumed.insert(rel.clone());
            continue;
        };
        let count = read.record_counts.get(rel).copied().unwrap_or(1).max(1);
        let hour = relative(prefix, &hour_dir(prefix, key.hour_unix_secs));
        let progress = sidecars.entry(key.sidecar_id.clone()).or_default();
        progress.insert(key.first_seq, key.first_seq.saturating_add(count - 1));
        if hour > progress.newest_hour {
            progress.newest_hour = hour;
        }
    }
    // A sidecar whose clock runs ahead must not drag the watermark past the segments
    // the others are still uploading: hours after now count as now.
    let latest_believable = read
        .now_unix_nanos
        .map_or(i64::MAX, |n| n.div_euclid(1_000_000_000));
    let newest_hour = sidecars
        .values()
        .filter_map(|p| parse_hour_dir(prefix, &absolute(prefix, &p.newest_hour)).ok())
        .chain(
            consumed
                .iter()
                .filter_map(|k| SegmentKey::parse(prefix, &absolute(prefix, k)).ok())
                .map(|k| k.hour_unix_secs),
        )
        .map(|hour| hour.min(latest_believable))
        .max();
    let mut watermark = read.cursor.watermark.clone();
    if let Some(hour) = newest_hour {
        let candidate = relative(
            prefix,
            &hour_dir(prefix, hour - i64::from(lookback_hours) * 3600),
        );
        if candidate > watermark {
            watermark = candidate;
        }
    }
    consumed.retain(|k| k.as_str() > watermark.as_str());
    // The keys of an hour sort after its directory: a sidecar whose newest segment read
    // is in the watermark's hour is still listed, one from before is not.
    sidecars.retain(|_, p| p.newest_hour.as_str() >= watermark.as_str());
    Cursor {
        version: CURSOR_VERSION,
        watermark,
        sidecars,
        consumed,
        pending_segments: pending.values().flatten().cloned().collect(),
        pending_episodes: pending.keys().cloned().collect(),
        // The caller names the run that writes it.
        written_by: String::new(),
    }
}

/// Writes the run's cursor (after the batches are written) if the store still holds the
/// version `expected` that the run read: a conditional put (`PutMode::Create` when there
/// was none, `PutMode::Update` otherwise), so of two runs that read the same cursor
/// exactly one advances it and the other gets [`IngestError::CursorMoved`]. Returns the
/// version written.
pub async fn write_cursor(
    location: &StoreLocation,
    run: &str,
    cursor: &Cursor,
    expected: &CursorVersion,
) -> Result<CursorVersion, IngestError> {
    validate_run_name(run)?;
    let path = cursor_path(&location.prefix, run);
    let body = serde_json::to_vec_pretty(cursor).unwrap_or_default();
    let mode = match expected {
        CursorVersion::Absent => PutMode::Create,
        CursorVersion::Stored(v) => PutMode::Update(v.clone()),
    };
    match location
        .store
        .put_opts(&path, PutPayload::from(body), mode.into())
        .await
    {
        Ok(put) => Ok(CursorVersion::Stored(put.into())),
        Err(
            object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. },
        ) => {
            // A client retry of a write that landed (an error answer to the first try)
            // finds its own cursor, `written_by` this run: a success, not a lost race.
            match read_cursor_versioned(location, run).await {
                Ok((now, version)) if !cursor.written_by.is_empty() && now == *cursor => {
                    Ok(version)
                }
                _ => Err(IngestError::CursorMoved {
                    run: run.to_owned(),
                    key: path.to_string(),
                }),
            }
        }
        Err(object_store::Error::NotImplemented) => Err(IngestError::NoConditionalWrites {
            store: location.display.clone(),
        }),
        Err(source) => Err(IngestError::Store {
            store: location.display.clone(),
            action: format!("write cursor {path}"),
            source,
        }),
    }
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
        // Segments of one sidecar with one record each: 1 and 2, 3 (2 is before the
        // watermark's hour, but the sidecar is kept for its newest segment).
        assert_eq!(cursor.sidecars["s"].ranges, [[1, 3]], "{cursor:?}");
        assert_eq!(
            cursor.sidecars["s"].newest_hour,
            "segments/v1/2027/01/16/14"
        );
        assert!(cursor.consumed.is_empty());
    }

    #[test]
    fn spans_merge_when_they_touch_and_answer_membership() {
        let mut p = SidecarProgress::default();
        p.insert(10, 19);
        p.insert(30, 39);
        assert_eq!(p.ranges, [[10, 19], [30, 39]]);
        assert!(p.contains(10) && p.contains(19) && p.contains(35));
        assert!(!p.contains(9) && !p.contains(20) && !p.contains(29) && !p.contains(40));
        p.insert(20, 25);
        assert_eq!(p.ranges, [[10, 25], [30, 39]]);
        p.insert(26, 29);
        assert_eq!(p.ranges, [[10, 39]]);
        p.insert(0, 4);
        p.insert(50, 50);
        p.insert(45, 48);
        assert_eq!(p.ranges, [[0, 4], [10, 39], [45, 48], [50, 50]]);
        p.insert(3, 60);
        assert_eq!(p.ranges, [[0, 60]]);
        p.insert(u64::MAX - 1, u64::MAX);
        assert!(p.contains(u64::MAX) && !p.contains(61));
    }

    #[test]
    fn a_version_1_cursor_reads_and_is_written_as_version_2() {
        let v1 = r#"{"version":1,"watermark":"segments/v1/2026/12/01/09","consumed":["segments/v1/2026/12/02/08/pod-1/000000000000002a.tlseg"],"pending_segments":[],"pending_episodes":[]}"#;
        let cursor: Cursor = serde_json::from_str(v1).unwrap();
        assert_eq!(cursor.consumed.len(), 1);
        let prefix = Path::from("");
        let key = SegmentKey::parse(
            &prefix,
            &Path::from("segments/v1/2026/12/02/08/pod-1/000000000000002a.tlseg"),
        )
        .unwrap();
        assert!(cursor.is_consumed(
            "segments/v1/2026/12/02/08/pod-1/000000000000002a.tlseg",
            &key
        ));
        let read = StoreRead {
            cursor,
            ..StoreRead::default()
        };
        let next = next_cursor(&read, &BTreeMap::new(), 24, &prefix);
        assert_eq!(next.version, CURSOR_VERSION);
        assert_eq!(next.consumed.len(), 1, "kept until the watermark passes it");
    }
}
