//! `tapline-trainer export`: the records of a store as Parquet files for the data tools
//! users already have (DuckDB, pandas/pyarrow, Polars, Spark).
//!
//! Three files in the output directory, each with the schema version in its key-value
//! metadata ([`SCHEMA_VERSION_KEY`] = [`SCHEMA_VERSION`]) and zstd-compressed pages:
//!
//! - `calls.parquet`: one row per LLM call ([`CALL_COLUMNS`]);
//! - `episodes.parquet`: one row per episode ([`EPISODE_COLUMNS`]);
//! - `rewards.parquet`: one row per reward ([`REWARD_COLUMNS`]).
//!
//! Records are read as the trainer reads them: segments in key order, each verified
//! whole before any of its rows is written, duplicates (at-least-once delivery) dropped
//! by record id with the first seen kept, episodes resolved as [`crate::ingest::assemble`]
//! resolves them (task and group from the start event, else the end event, else the
//! first call; the latest event of each kind; the final reward is the latest unnamed
//! episode-level reward, a component the latest of its name).
//!
//! Memory: one segment object at a time (plus `concurrent_reads - 1` fetched ahead), the
//! rows of one row group, a 16-byte key per record id seen (for duplicates) and a small
//! summary per episode — never the store's records.
//!
//! Filters select episodes: `--episode` by id, `--task` by the episode's task, `--since`
//! and `--until` by its start (the start event's time, else its first record's), and
//! every file then holds the rows of the selected episodes only. Calls without an
//! episode are exported when no `--episode`/`--task` is given and their start is within
//! `--since`/`--until`. With a filter, which episodes match is only known once every
//! segment was read: the export reads the store twice, the second time only the
//! segments that hold rows of selected episodes. Without one it reads it once.
//!
//! A segment that fails its checks is named and skipped; the export still writes the
//! rest and then fails ([`ExportError::Damaged`]) unless `skip_damaged` is set. Files are
//! written under temporary names and renamed when complete.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{
    BooleanBuilder, Float64Builder, ListBuilder, MapBuilder, StringBuilder, StructBuilder,
    TimestampNanosecondBuilder, UInt32Builder, UInt64Builder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Fields};
use futures::{StreamExt, TryStreamExt};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use serde_json::{Value, json};
use tapline_proto::json::enum_name;
use tapline_proto::keys::{SegmentKey, segments_root};
use tapline_proto::segment::{Limits, SkippedRecord, read_segment};
use tapline_proto::store::StoreLocation;
use tapline_proto::{
    Api, EpisodeEvent, EpisodeEventKind, LlmCall, Outcome, Record, RecordKind, Reward,
};

/// Version of the exported files' schema; a change of a column's meaning or type bumps
/// it, an added column does not.
pub const SCHEMA_VERSION: &str = "1";
/// Key of the schema version in each file's key-value metadata.
pub const SCHEMA_VERSION_KEY: &str = "tapline.export.schema_version";

/// The columns of `calls.parquet`: name, Arrow type, meaning.
pub const CALL_COLUMNS: &[(&str, &str, &str)] = &[
    ("record_id", "utf8", "id of the record (the span id)"),
    ("span_id", "utf8", "id of the call"),
    (
        "episode_id",
        "utf8?",
        "its episode; null for a call without one",
    ),
    (
        "task_id",
        "utf8?",
        "task, as the sidecar recorded it on the call",
    ),
    ("group_id", "utf8?", "comparison group within the task"),
    ("sidecar_id", "utf8", "the sidecar that recorded it"),
    (
        "sidecar_seq",
        "uint64",
        "its record's position in that sidecar's spool",
    ),
    (
        "seq",
        "uint32",
        "position of the call in its episode (from 0)",
    ),
    ("segment", "utf8", "key of the segment it was read from"),
    (
        "api",
        "utf8",
        "chat_completions, completions, responses, anthropic_messages, other",
    ),
    ("method", "utf8", "HTTP method"),
    ("path", "utf8", "request path"),
    (
        "start_time",
        "timestamp[ns, UTC]?",
        "request received (null: not known)",
    ),
    (
        "first_byte_time",
        "timestamp[ns, UTC]?",
        "first response byte from upstream",
    ),
    ("end_time", "timestamp[ns, UTC]?", "response complete"),
    (
        "http_status",
        "uint32?",
        "upstream status; null when there was none",
    ),
    (
        "outcome",
        "utf8",
        "ok, upstream_error, upstream_unreachable, timeout, client_aborted",
    ),
    ("error", "utf8?", "what went wrong, when something did"),
    ("streamed", "bool", "the response was a stream"),
    ("request_model", "utf8?", "model the client asked for"),
    ("response_model", "utf8?", "model the upstream named"),
    ("policy_version", "utf8?", "policy version that served it"),
    ("tags", "map<utf8, utf8>", "tags of the call"),
    (
        "request_messages",
        "utf8? (JSON)",
        "the conversation sent: `messages` (Anthropic: after `system` as a system message), Responses `input` (after `instructions`), completions `prompt`; null when the body is not JSON",
    ),
    ("request_tools", "utf8? (JSON)", "the request's `tools`"),
    (
        "request_truncated",
        "bool",
        "the request body was cut at the capture cap",
    ),
    (
        "response_truncated",
        "bool",
        "the response body was cut at the capture cap",
    ),
    ("choices", "uint32", "completions (choices) in the response"),
    (
        "completion",
        "utf8? (JSON)",
        "the first choice as an assistant message (role, content, reasoning_content, tool_calls)",
    ),
    (
        "other_completions",
        "utf8? (JSON)",
        "further choices (n > 1) as assistant messages; null with one",
    ),
    ("finish_reason", "utf8?", "why the first choice stopped"),
    (
        "tool_calls",
        "list<struct<id, type, name, arguments: utf8>>",
        "tool calls of the first choice, arguments as generated",
    ),
    (
        "prompt_token_ids",
        "list<uint32>?",
        "prompt ids the server returned; null when not recorded",
    ),
    (
        "completion_token_ids",
        "list<uint32>?",
        "ids of the first choice; null when not recorded",
    ),
    (
        "completion_logprobs",
        "list<float64>?",
        "log-probability of each of those ids under the serving policy; null when not recorded",
    ),
    (
        "prompt_tokens",
        "uint64?",
        "usage as reported; null without usage",
    ),
    ("completion_tokens", "uint64?", "usage as reported"),
    ("total_tokens", "uint64?", "usage as reported"),
    ("cached_prompt_tokens", "uint64?", "usage as reported"),
    ("reasoning_tokens", "uint64?", "usage as reported"),
    (
        "capture_warnings",
        "list<utf8>",
        "what the sidecar could not capture exactly",
    ),
];

/// The columns of `episodes.parquet`.
pub const EPISODE_COLUMNS: &[(&str, &str, &str)] = &[
    ("episode_id", "utf8", "id of the episode"),
    (
        "task_id",
        "utf8?",
        "its task (start event, else end event, else first call)",
    ),
    ("group_id", "utf8?", "its comparison group (same sources)"),
    (
        "status",
        "utf8?",
        "succeeded, failed, timed_out, aborted; null while no end was recorded",
    ),
    (
        "start_time",
        "timestamp[ns, UTC]?",
        "the start event's time",
    ),
    ("end_time", "timestamp[ns, UTC]?", "the end event's time"),
    (
        "first_time",
        "timestamp[ns, UTC]",
        "its earliest record (start event or call start)",
    ),
    ("last_time", "timestamp[ns, UTC]", "its latest record"),
    (
        "metadata",
        "map<utf8, utf8>",
        "harness metadata (the end event's over the start's)",
    ),
    ("calls", "uint64", "calls recorded"),
    ("failed_calls", "uint64", "calls whose outcome was not ok"),
    (
        "rewards",
        "uint64",
        "rewards recorded (every one, components and per-call included)",
    ),
    (
        "prompt_tokens",
        "uint64",
        "sum of the calls' reported prompt tokens",
    ),
    (
        "completion_tokens",
        "uint64",
        "sum of the calls' reported completion tokens",
    ),
    (
        "final_reward",
        "float64?",
        "the latest unnamed episode-level reward; null if none",
    ),
    (
        "reward_components",
        "map<utf8, float64>",
        "the latest named episode-level reward of each name",
    ),
    (
        "incomplete",
        "bool",
        "its kept start or end event says records of it were dropped (incomplete, or dropped_records > 0): the trainer does not train on it",
    ),
    (
        "dropped_records",
        "uint64",
        "records of it that were dropped",
    ),
    ("sidecar_ids", "list<utf8>", "sidecars that recorded it"),
];

/// The columns of `rewards.parquet`.
pub const REWARD_COLUMNS: &[(&str, &str, &str)] = &[
    ("reward_id", "utf8", "id of the reward"),
    ("episode_id", "utf8", "its episode"),
    (
        "span_id",
        "utf8?",
        "the call it rewards; null for the whole episode",
    ),
    ("name", "utf8?", "component name; null for the final reward"),
    ("value", "float64", "the value"),
    ("time", "timestamp[ns, UTC]", "when it was reported"),
    ("tags", "map<utf8, utf8>", "its tags"),
    ("sidecar_id", "utf8", "the sidecar that recorded it"),
    ("segment", "utf8", "key of the segment it was read from"),
];

/// What to export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Episodes that started at or after this time (Unix nanoseconds).
    pub since: Option<i64>,
    /// Episodes that started before this time (Unix nanoseconds).
    pub until: Option<i64>,
    /// Episodes of these tasks (any of them; empty: every task).
    pub tasks: Vec<String>,
    /// These episodes (any of them; empty: every episode).
    pub episodes: Vec<String>,
    /// Skip segments that fail their checks without failing the export.
    pub skip_damaged: bool,
    /// Segments fetched at once (at least 1).
    pub concurrent_reads: usize,
    /// Rows per written batch (a row group holds one or more).
    pub batch_rows: usize,
    /// zstd level of the Parquet pages.
    pub zstd_level: i32,
    /// Draw a progress bar on stderr (only drawn when it is a terminal).
    pub progress: bool,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            since: None,
            until: None,
            tasks: Vec::new(),
            episodes: Vec::new(),
            skip_damaged: false,
            concurrent_reads: 4,
            batch_rows: 1024,
            zstd_level: 3,
            progress: false,
        }
    }
}

impl ExportOptions {
    fn filtered(&self) -> bool {
        self.since.is_some()
            || self.until.is_some()
            || !self.tasks.is_empty()
            || !self.episodes.is_empty()
    }

    fn in_window(&self, time: i64) -> bool {
        self.since.is_none_or(|s| time >= s) && self.until.is_none_or(|u| time < u)
    }

    fn selects(&self, episode_id: &str, summary: &EpisodeSummary) -> bool {
        (self.episodes.is_empty() || self.episodes.iter().any(|e| e == episode_id))
            && (self.tasks.is_empty() || self.tasks.iter().any(|t| *t == summary.task().0))
            && self.in_window(summary.start_time())
    }

    /// Whether a call without an episode is exported.
    fn selects_unattributed(&self, record: &Record, call: &LlmCall) -> bool {
        self.episodes.is_empty() && self.tasks.is_empty() && self.in_window(call_time(record, call))
    }

    /// Whether a call without an episode can be selected at all.
    fn may_select_unattributed(&self) -> bool {
        self.episodes.is_empty() && self.tasks.is_empty()
    }
}

/// When a call started, else when its record was written (a call with no start time).
fn call_time(record: &Record, call: &LlmCall) -> i64 {
    if call.start_unix_nanos != 0 {
        call.start_unix_nanos
    } else {
        record.written_unix_nanos
    }
}

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// Listing or reading the store failed.
    #[error("store {store}: cannot {action}: {source}")]
    Store {
        /// The store.
        store: String,
        /// What was being done.
        action: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// Writing a file failed.
    #[error("cannot write {path}: {detail}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
    /// Segments failed their checks: they were skipped and the rest was exported.
    #[error(
        "{} damaged segment(s) skipped, the rest exported to {out}: {}; pass --skip-damaged to accept an export without them",
        damaged.len(),
        damaged.iter().map(|(k, e)| format!("{k}: {e}")).collect::<Vec<_>>().join("; ")
    )]
    Damaged {
        /// The segments and why, in key order.
        damaged: Vec<(String, String)>,
        /// Where the rest went.
        out: String,
        /// What was exported.
        summary: Box<ExportSummary>,
    },
}

/// What an export read and wrote.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ExportSummary {
    /// Segment objects listed.
    pub segments: u64,
    /// Segment reads (a segment read in both passes counts twice).
    pub segment_reads: u64,
    /// Segment bytes read.
    pub bytes_read: u64,
    /// Passes over the store (1 without a filter, 2 with one).
    pub passes: u32,
    /// Records read in the first pass (duplicates included).
    pub records: u64,
    /// Records dropped as duplicates of one read before.
    pub duplicate_records: u64,
    /// Rows written, by file.
    pub calls: u64,
    /// Rows of `episodes.parquet`.
    pub episodes: u64,
    /// Rows of `rewards.parquet`.
    pub rewards: u64,
    /// Calls without an episode among the rows of `calls.parquet`.
    pub unattributed_calls: u64,
    /// Rewards and events without an episode, records without a payload (not exported).
    pub orphan_records: u64,
    /// Segments that failed their checks (skipped), with the reason.
    pub damaged_segments: Vec<(String, String)>,
    /// Records over the reader's limit, passed over (the rest of their segment was read).
    pub oversized_records: Vec<(String, String)>,
    /// Objects under the segments directory that are not segment keys.
    pub foreign_objects: u64,
    /// The files written with their sizes in bytes.
    pub files: Vec<(String, u64)>,
}

/// Exports the records of `location` into `out` (created if missing) as `options` say.
pub async fn export(
    location: &StoreLocation,
    out: &Path,
    options: &ExportOptions,
) -> Result<ExportSummary, ExportError> {
    let write_err = |path: &Path| {
        let path = path.to_owned();
        move |e: &dyn std::fmt::Display| ExportError::Write {
            path: path.clone(),
            detail: e.to_string(),
        }
    };
    std::fs::create_dir_all(out).map_err(|e| write_err(out)(&e))?;
    let mut summary = ExportSummary::default();
    let keys = list_segments(location, &mut summary).await?;
    summary.segments = keys.len() as u64;

    let mut calls = Table::create(out, "calls.parquet", options)?;
    let mut rewards = Table::create(out, "rewards.parquet", options)?;
    let mut call_rows = CallRows::default();
    let mut reward_rows = RewardRows::default();
    let mut index = Index::default();
    let filtered = options.filtered();

    // Pass 1: every segment; the rows themselves too when nothing is filtered.
    summary.passes = 1;
    let mut seen = Seen::default();
    let all: Vec<usize> = (0..keys.len()).collect();
    read_segments(
        location,
        &keys,
        &all,
        options,
        true,
        &mut summary,
        |key_index, records| {
            for record in records {
                index.records += 1;
                if !seen.insert(&record.id) {
                    index.duplicates += 1;
                    continue;
                }
                index.add(&record, key_index);
                if !filtered {
                    let segment = &keys[key_index].0;
                    match &record.kind {
                        Some(RecordKind::LlmCall(call)) => {
                            call_rows.push(&record, call, segment);
                            if call.episode_id.is_empty() {
                                index.unattributed_written += 1;
                            }
                        }
                        Some(RecordKind::Reward(reward)) if !reward.episode_id.is_empty() => {
                            reward_rows.push(&record, reward, segment);
                        }
                        _ => {}
                    }
                    calls.write_if_full(&mut call_rows, options)?;
                    rewards.write_if_full(&mut reward_rows, options)?;
                }
            }
            Ok(())
        },
    )
    .await?;
    summary.records = index.records;
    summary.duplicate_records = index.duplicates;
    summary.orphan_records = index.orphans;

    let selected: BTreeSet<&str> = index
        .episodes
        .iter()
        .filter(|(id, s)| !filtered || options.selects(id, s))
        .map(|(id, _)| id.as_str())
        .collect();

    if filtered {
        // Pass 2: only the segments holding rows of selected episodes (or calls without
        // one that may be selected), in key order, duplicates dropped again.
        summary.passes = 2;
        let mut wanted: BTreeSet<usize> = if options.may_select_unattributed() {
            index.unattributed_segments.clone()
        } else {
            BTreeSet::new()
        };
        for id in &selected {
            wanted.extend(index.episodes[*id].segments.iter().copied());
        }
        let wanted: Vec<usize> = wanted.into_iter().collect();
        let mut seen = Seen::default();
        let mut unattributed = 0u64;
        read_segments(
            location,
            &keys,
            &wanted,
            options,
            false,
            &mut summary,
            |key_index, records| {
                let segment = &keys[key_index].0;
                for record in records {
                    if !seen.insert(&record.id) {
                        continue;
                    }
                    match &record.kind {
                        Some(RecordKind::LlmCall(call)) => {
                            let keep = if call.episode_id.is_empty() {
                                options.selects_unattributed(&record, call)
                            } else {
                                selected.contains(call.episode_id.as_str())
                            };
                            if keep {
                                call_rows.push(&record, call, segment);
                                unattributed += u64::from(call.episode_id.is_empty());
                            }
                        }
                        Some(RecordKind::Reward(reward))
                            if selected.contains(reward.episode_id.as_str()) =>
                        {
                            reward_rows.push(&record, reward, segment);
                        }
                        _ => {}
                    }
                    calls.write_if_full(&mut call_rows, options)?;
                    rewards.write_if_full(&mut reward_rows, options)?;
                }
                Ok(())
            },
        )
        .await?;
        index.unattributed_written = unattributed;
    }
    summary.unattributed_calls = index.unattributed_written;

    let mut episodes = Table::create(out, "episodes.parquet", options)?;
    let mut episode_rows = EpisodeRows::default();
    for id in &selected {
        episode_rows.push(id, &index.episodes[*id]);
        episodes.write_if_full(&mut episode_rows, options)?;
    }
    // All three closed before any is renamed: an export that fails leaves the files of
    // the one before it, never a mix.
    summary.calls = calls.close(call_rows)?;
    summary.rewards = rewards.close(reward_rows)?;
    summary.episodes = episodes.close(episode_rows)?;
    for table in [calls, rewards, episodes] {
        summary.files.push(table.commit()?);
    }

    if !summary.damaged_segments.is_empty() && !options.skip_damaged {
        return Err(ExportError::Damaged {
            damaged: summary.damaged_segments.clone(),
            out: out.display().to_string(),
            summary: Box::new(summary),
        });
    }
    Ok(summary)
}

/// Every segment key under the store, in key order, relative to the prefix, with its
/// path.
async fn list_segments(
    location: &StoreLocation,
    summary: &mut ExportSummary,
) -> Result<Vec<(String, object_store::path::Path)>, ExportError> {
    let root = segments_root(&location.prefix);
    let metas: Vec<object_store::ObjectMeta> = location
        .store
        .list(Some(&root))
        .try_collect()
        .await
        .map_err(|source| ExportError::Store {
            store: location.display.clone(),
            action: format!("list {root}"),
            source,
        })?;
    let mut keys = Vec::new();
    for meta in metas {
        if SegmentKey::parse(&location.prefix, &meta.location).is_err() {
            summary.foreign_objects += 1;
            continue;
        }
        let rel = match meta.location.prefix_match(&location.prefix) {
            Some(parts) => parts
                .map(|p| p.as_ref().to_owned())
                .collect::<Vec<_>>()
                .join("/"),
            None => meta.location.to_string(),
        };
        keys.push((rel, meta.location));
    }
    keys.sort();
    Ok(keys)
}

/// Fetches the segments `which` (indices into `keys`, in order), `concurrent_reads` at a
/// time, and hands each verified segment's records to `each` in that order; a damaged
/// segment is recorded in the summary (once, in the first pass) and skipped.
async fn read_segments(
    location: &StoreLocation,
    keys: &[(String, object_store::path::Path)],
    which: &[usize],
    options: &ExportOptions,
    first_pass: bool,
    summary: &mut ExportSummary,
    mut each: impl FnMut(usize, Vec<Record>) -> Result<(), ExportError>,
) -> Result<(), ExportError> {
    let verb = if first_pass { "read" } else { "export" };
    let bar = progress_bar(options.progress, which.len() as u64, verb);
    let fetched = futures::stream::iter(which.iter().copied())
        .map(|i| {
            let store = location.store.clone();
            let path = keys[i].1.clone();
            let display = location.display.clone();
            async move {
                let bytes = match store.get(&path).await {
                    Ok(got) => got.bytes().await,
                    Err(e) => Err(e),
                };
                (i, bytes.map_err(|source| (display, path, source)))
            }
        })
        .buffered(options.concurrent_reads.max(1));
    futures::pin_mut!(fetched);
    let already_damaged: HashSet<String> = summary
        .damaged_segments
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    while let Some((i, bytes)) = fetched.next().await {
        let bytes = bytes.map_err(|(store, path, source)| ExportError::Store {
            store,
            action: format!("read {path}"),
            source,
        })?;
        summary.segment_reads += 1;
        summary.bytes_read += bytes.len() as u64;
        bar.inc(1);
        let key = &keys[i].0;
        if already_damaged.contains(key) {
            continue;
        }
        match read_segment(&bytes, Limits::default()) {
            Ok(contents) => {
                if first_pass {
                    summary.oversized_records.extend(
                        contents
                            .skipped
                            .iter()
                            .map(|s: &SkippedRecord| (key.clone(), s.to_string())),
                    );
                }
                drop(bytes);
                each(i, contents.records)?;
            }
            Err(error) => {
                // A segment that verified in the first pass and fails now (a partial
                // read, an object rewritten since) loses rows all the same: named too.
                let reason = if first_pass {
                    error.to_string()
                } else {
                    format!("{error} (on the second read; the first read verified it)")
                };
                summary.damaged_segments.push((key.clone(), reason));
            }
        }
    }
    bar.finish_and_clear();
    Ok(())
}

fn progress_bar(show: bool, len: u64, verb: &str) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len).with_style(
        indicatif::ProgressStyle::with_template(
            "{msg} {bar:40} {pos}/{len} segments [{elapsed_precise} < {eta}]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(verb.to_owned());
    bar
}

/// Record ids seen: UUIDs as 16 bytes, anything else as its text.
#[derive(Default)]
struct Seen {
    uuids: HashSet<u128>,
    other: HashSet<String>,
}

impl Seen {
    /// True the first time `id` is seen (an empty id is never a duplicate).
    fn insert(&mut self, id: &str) -> bool {
        if id.is_empty() {
            return true;
        }
        match parse_uuid(id) {
            Some(u) => self.uuids.insert(u),
            None => self.other.insert(id.to_owned()),
        }
    }
}

/// A canonical hyphenated lower-case UUID as a number (other spellings are kept as text,
/// so two spellings of one UUID stay two ids, as they are to the trainer).
fn parse_uuid(id: &str) -> Option<u128> {
    let b = id.as_bytes();
    if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
        return None;
    }
    let mut value = 0u128;
    for (i, &c) in b.iter().enumerate() {
        if [8, 13, 18, 23].contains(&i) {
            continue;
        }
        let digit = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        value = value << 4 | u128::from(digit);
    }
    Some(value)
}

/// What pass 1 learns about the store.
#[derive(Default)]
struct Index {
    episodes: BTreeMap<String, EpisodeSummary>,
    records: u64,
    duplicates: u64,
    orphans: u64,
    /// Segments holding calls without an episode.
    unattributed_segments: BTreeSet<usize>,
    unattributed_written: u64,
}

/// Everything `episodes.parquet` says about one episode, gathered record by record.
#[derive(Default)]
struct EpisodeSummary {
    start: Option<EpisodeEvent>,
    end: Option<EpisodeEvent>,
    /// (start, seq, span, task, group) of the first call that names a task.
    first_task_call: Option<(i64, u32, String, String, String)>,
    first_time: Option<i64>,
    last_time: i64,
    calls: u64,
    failed_calls: u64,
    rewards: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    /// Latest episode-level reward per name: (time, reward id, value).
    latest: BTreeMap<String, (i64, String, f64)>,
    sidecars: BTreeSet<String>,
    segments: BTreeSet<usize>,
}

impl EpisodeSummary {
    /// Task and group as `ingest::assemble` resolves them.
    fn task(&self) -> (&str, &str) {
        [&self.start, &self.end]
            .into_iter()
            .flatten()
            .map(|e| (e.task_id.as_str(), e.group_id.as_str()))
            .chain(
                self.first_task_call
                    .iter()
                    .map(|c| (c.3.as_str(), c.4.as_str())),
            )
            .find(|(task, _)| !task.is_empty())
            .unwrap_or(("", ""))
    }

    /// The start event's time, else the earliest record's.
    fn start_time(&self) -> i64 {
        self.start
            .as_ref()
            .map(|e| e.time_unix_nanos)
            .or(self.first_time)
            .unwrap_or(0)
    }

    fn seen_at(&mut self, time: i64) {
        self.first_time = Some(self.first_time.map_or(time, |t| t.min(time)));
        self.last_time = self.last_time.max(time);
    }
}

impl Index {
    fn add(&mut self, record: &Record, key_index: usize) {
        let Some(episode_id) = record.episode_id() else {
            match &record.kind {
                Some(RecordKind::LlmCall(_)) => {
                    self.unattributed_segments.insert(key_index);
                }
                _ => self.orphans += 1,
            }
            return;
        };
        let e = self.episodes.entry(episode_id.to_owned()).or_default();
        e.segments.insert(key_index);
        e.sidecars.insert(record.sidecar_id.clone());
        match &record.kind {
            Some(RecordKind::LlmCall(call)) => {
                e.calls += 1;
                e.failed_calls += u64::from(call.outcome() != Outcome::Ok);
                if let Some(usage) = &call.usage {
                    e.prompt_tokens += usage.prompt_tokens;
                    e.completion_tokens += usage.completion_tokens;
                }
                if !call.task_id.is_empty() {
                    let candidate = (
                        call.start_unix_nanos,
                        call.seq,
                        call.span_id.clone(),
                        call.task_id.clone(),
                        call.group_id.clone(),
                    );
                    if e.first_task_call
                        .as_ref()
                        .is_none_or(|c| (candidate.0, candidate.1, &candidate.2) < (c.0, c.1, &c.2))
                    {
                        e.first_task_call = Some(candidate);
                    }
                }
                let time = if call.start_unix_nanos != 0 {
                    call.start_unix_nanos
                } else {
                    record.written_unix_nanos
                };
                e.seen_at(time);
                e.last_time = e.last_time.max(call.end_unix_nanos);
            }
            Some(RecordKind::Reward(reward)) => {
                e.rewards += 1;
                if reward.span_id.is_empty() {
                    // Latest by (time, id), as the trainer orders rewards.
                    let entry = (
                        reward.time_unix_nanos,
                        reward.reward_id.clone(),
                        reward.value,
                    );
                    // On a tie the later read wins, as the trainer's stable sort keeps it last.
                    let newer = e
                        .latest
                        .get(&reward.name)
                        .is_none_or(|old| (entry.0, &entry.1) >= (old.0, &old.1));
                    if newer {
                        e.latest.insert(reward.name.clone(), entry);
                    }
                }
                e.seen_at(reward.time_unix_nanos.max(record.written_unix_nanos));
            }
            Some(RecordKind::EpisodeEvent(event)) => {
                let slot = match event.kind() {
                    EpisodeEventKind::Start => &mut e.start,
                    EpisodeEventKind::End => &mut e.end,
                    EpisodeEventKind::Unspecified => {
                        self.orphans += 1;
                        return;
                    }
                };
                if slot
                    .as_ref()
                    .is_none_or(|old| old.time_unix_nanos <= event.time_unix_nanos)
                {
                    *slot = Some(event.clone());
                }
                e.seen_at(event.time_unix_nanos);
            }
            None => {}
        }
    }
}

fn opt_str(b: &mut StringBuilder, s: &str) {
    if s.is_empty() {
        b.append_null();
    } else {
        b.append_value(s);
    }
}

fn utc() -> TimestampNanosecondBuilder {
    TimestampNanosecondBuilder::new().with_timezone("UTC")
}

fn opt_time(b: &mut TimestampNanosecondBuilder, t: i64) {
    if t == 0 {
        b.append_null();
    } else {
        b.append_value(t);
    }
}

fn string_map() -> MapBuilder<StringBuilder, StringBuilder> {
    MapBuilder::new(None, StringBuilder::new(), StringBuilder::new())
}

fn push_map<'a>(
    b: &mut MapBuilder<StringBuilder, StringBuilder>,
    entries: impl IntoIterator<Item = (&'a String, &'a String)>,
) {
    // Sorted, so that a file does not depend on a hash map's order.
    let sorted: BTreeMap<&String, &String> = entries.into_iter().collect();
    for (k, v) in sorted {
        b.keys().append_value(k);
        b.values().append_value(v);
    }
    b.append(true).expect("keys and values appended in pairs");
}

/// The conversation a request sent, in the chat shape where the API has one.
fn request_messages(api: Api, body: &Value) -> Option<Value> {
    let obj = body.as_object()?;
    let system = |system: Option<&Value>, rest: Value| match (system, rest) {
        (Some(s), Value::Array(mut messages)) if !s.is_null() => {
            messages.insert(0, json!({"role": "system", "content": s}));
            Value::Array(messages)
        }
        (_, rest) => rest,
    };
    match api {
        Api::AnthropicMessages => Some(system(obj.get("system"), obj.get("messages")?.clone())),
        Api::Responses => {
            let input = match obj.get("input")? {
                Value::String(s) => json!([{"role": "user", "content": s}]),
                other => other.clone(),
            };
            Some(system(obj.get("instructions"), input))
        }
        Api::Completions => obj.get("prompt").cloned(),
        _ => obj.get("messages").or_else(|| obj.get("input")).cloned(),
    }
}

/// Builders of `calls.parquet`'s columns (see [`CALL_COLUMNS`]).
struct CallRows {
    rows: usize,
    bytes: usize,
    record_id: StringBuilder,
    span_id: StringBuilder,
    episode_id: StringBuilder,
    task_id: StringBuilder,
    group_id: StringBuilder,
    sidecar_id: StringBuilder,
    sidecar_seq: UInt64Builder,
    seq: UInt32Builder,
    segment: StringBuilder,
    api: StringBuilder,
    method: StringBuilder,
    path: StringBuilder,
    start_time: TimestampNanosecondBuilder,
    first_byte_time: TimestampNanosecondBuilder,
    end_time: TimestampNanosecondBuilder,
    http_status: UInt32Builder,
    outcome: StringBuilder,
    error: StringBuilder,
    streamed: BooleanBuilder,
    request_model: StringBuilder,
    response_model: StringBuilder,
    policy_version: StringBuilder,
    tags: MapBuilder<StringBuilder, StringBuilder>,
    request_messages: StringBuilder,
    request_tools: StringBuilder,
    request_truncated: BooleanBuilder,
    response_truncated: BooleanBuilder,
    choices: UInt32Builder,
    completion: StringBuilder,
    other_completions: StringBuilder,
    finish_reason: StringBuilder,
    tool_calls: ListBuilder<StructBuilder>,
    prompt_token_ids: ListBuilder<UInt32Builder>,
    completion_token_ids: ListBuilder<UInt32Builder>,
    completion_logprobs: ListBuilder<Float64Builder>,
    prompt_tokens: UInt64Builder,
    completion_tokens: UInt64Builder,
    total_tokens: UInt64Builder,
    cached_prompt_tokens: UInt64Builder,
    reasoning_tokens: UInt64Builder,
    capture_warnings: ListBuilder<StringBuilder>,
}

fn tool_call_fields() -> Fields {
    ["id", "type", "name", "arguments"]
        .into_iter()
        .map(|n| Field::new(n, DataType::Utf8, false))
        .collect()
}

impl Default for CallRows {
    fn default() -> Self {
        CallRows {
            rows: 0,
            bytes: 0,
            record_id: StringBuilder::new(),
            span_id: StringBuilder::new(),
            episode_id: StringBuilder::new(),
            task_id: StringBuilder::new(),
            group_id: StringBuilder::new(),
            sidecar_id: StringBuilder::new(),
            sidecar_seq: UInt64Builder::new(),
            seq: UInt32Builder::new(),
            segment: StringBuilder::new(),
            api: StringBuilder::new(),
            method: StringBuilder::new(),
            path: StringBuilder::new(),
            start_time: utc(),
            first_byte_time: utc(),
            end_time: utc(),
            http_status: UInt32Builder::new(),
            outcome: StringBuilder::new(),
            error: StringBuilder::new(),
            streamed: BooleanBuilder::new(),
            request_model: StringBuilder::new(),
            response_model: StringBuilder::new(),
            policy_version: StringBuilder::new(),
            tags: string_map(),
            request_messages: StringBuilder::new(),
            request_tools: StringBuilder::new(),
            request_truncated: BooleanBuilder::new(),
            response_truncated: BooleanBuilder::new(),
            choices: UInt32Builder::new(),
            completion: StringBuilder::new(),
            other_completions: StringBuilder::new(),
            finish_reason: StringBuilder::new(),
            tool_calls: ListBuilder::new(StructBuilder::from_fields(tool_call_fields(), 0))
                .with_field(Field::new(
                    "item",
                    DataType::Struct(tool_call_fields()),
                    false,
                )),
            prompt_token_ids: ListBuilder::new(UInt32Builder::new()),
            completion_token_ids: ListBuilder::new(UInt32Builder::new()),
            completion_logprobs: ListBuilder::new(Float64Builder::new()),
            prompt_tokens: UInt64Builder::new(),
            completion_tokens: UInt64Builder::new(),
            total_tokens: UInt64Builder::new(),
            cached_prompt_tokens: UInt64Builder::new(),
            reasoning_tokens: UInt64Builder::new(),
            capture_warnings: ListBuilder::new(StringBuilder::new()),
        }
    }
}

impl CallRows {
    fn push(&mut self, record: &Record, call: &LlmCall, segment: &str) {
        self.rows += 1;
        self.record_id.append_value(&record.id);
        self.span_id.append_value(&call.span_id);
        opt_str(&mut self.episode_id, &call.episode_id);
        opt_str(&mut self.task_id, &call.task_id);
        opt_str(&mut self.group_id, &call.group_id);
        self.sidecar_id.append_value(&record.sidecar_id);
        self.sidecar_seq.append_value(record.sidecar_seq);
        self.seq.append_value(call.seq);
        self.segment.append_value(segment);
        self.api
            .append_value(enum_name(call.api().as_str_name(), "API_"));
        self.method.append_value(&call.method);
        self.path.append_value(&call.path);
        opt_time(&mut self.start_time, call.start_unix_nanos);
        opt_time(&mut self.first_byte_time, call.first_byte_unix_nanos);
        opt_time(&mut self.end_time, call.end_unix_nanos);
        if call.http_status == 0 {
            self.http_status.append_null();
        } else {
            self.http_status.append_value(call.http_status);
        }
        self.outcome
            .append_value(enum_name(call.outcome().as_str_name(), "OUTCOME_"));
        opt_str(&mut self.error, &call.error);
        self.streamed.append_value(call.streamed);
        opt_str(&mut self.request_model, &call.request_model);
        opt_str(&mut self.response_model, &call.response_model);
        opt_str(&mut self.policy_version, &call.policy_version);
        push_map(&mut self.tags, &call.tags);
        let body: Option<Value> = serde_json::from_slice(&call.request_body).ok();
        let messages = body
            .as_ref()
            .and_then(|b| request_messages(call.api(), b))
            .map(|m| m.to_string());
        let tools = body
            .as_ref()
            .and_then(|b| b.get("tools"))
            .filter(|t| !t.is_null())
            .map(Value::to_string);
        self.bytes +=
            messages.as_ref().map_or(0, String::len) + tools.as_ref().map_or(0, String::len);
        self.request_messages.append_option(messages);
        self.request_tools.append_option(tools);
        self.request_truncated.append_value(call.request_truncated);
        self.response_truncated
            .append_value(call.response_truncated);
        self.choices.append_value(call.completions.len() as u32);
        let first = call.completions.first();
        let completion = first.map(|c| crate::tokenize::completion_message(c).to_string());
        self.bytes += completion.as_ref().map_or(0, String::len);
        self.completion.append_option(completion);
        if call.completions.len() > 1 {
            let others: Vec<Value> = call.completions[1..]
                .iter()
                .map(crate::tokenize::completion_message)
                .collect();
            let text = Value::Array(others).to_string();
            self.bytes += text.len();
            self.other_completions.append_value(text);
        } else {
            self.other_completions.append_null();
        }
        opt_str(
            &mut self.finish_reason,
            first.map_or("", |c| c.finish_reason.as_str()),
        );
        let calls = self.tool_calls.values();
        for tc in first.map_or(&[][..], |c| &c.tool_calls[..]) {
            for (i, value) in [&tc.id, &tc.r#type, &tc.name, &tc.arguments]
                .into_iter()
                .enumerate()
            {
                calls
                    .field_builder::<StringBuilder>(i)
                    .expect("tool call fields are strings")
                    .append_value(value);
            }
            calls.append(true);
        }
        self.tool_calls.append(true);
        let ids = |b: &mut ListBuilder<UInt32Builder>, ids: &[u32]| {
            if ids.is_empty() {
                b.append_null();
            } else {
                b.values().append_slice(ids);
                b.append(true);
            }
        };
        ids(&mut self.prompt_token_ids, &call.prompt_token_ids);
        ids(
            &mut self.completion_token_ids,
            first.map_or(&[][..], |c| &c.token_ids[..]),
        );
        let logprobs = first.map_or(&[][..], |c| &c.logprobs[..]);
        if logprobs.is_empty() {
            self.completion_logprobs.append_null();
        } else {
            self.completion_logprobs.values().append_slice(logprobs);
            self.completion_logprobs.append(true);
        }
        self.bytes += 4 * call.prompt_token_ids.len() + 12 * logprobs.len();
        let usage = call.usage.as_ref();
        for (b, v) in [
            (&mut self.prompt_tokens, usage.map(|u| u.prompt_tokens)),
            (
                &mut self.completion_tokens,
                usage.map(|u| u.completion_tokens),
            ),
            (&mut self.total_tokens, usage.map(|u| u.total_tokens)),
            (
                &mut self.cached_prompt_tokens,
                usage.map(|u| u.cached_prompt_tokens),
            ),
            (
                &mut self.reasoning_tokens,
                usage.map(|u| u.reasoning_tokens),
            ),
        ] {
            b.append_option(v);
        }
        for w in &call.capture_warnings {
            self.capture_warnings.values().append_value(w);
        }
        self.capture_warnings.append(true);
    }
}

/// A set of column builders that becomes one record batch.
trait Rows {
    fn len(&self) -> usize;
    fn bytes(&self) -> usize;
    /// The columns built so far, emptying the builders.
    fn finish(&mut self) -> Vec<(&'static str, ArrayRef, bool)>;
}

impl Rows for CallRows {
    fn len(&self) -> usize {
        self.rows
    }

    fn bytes(&self) -> usize {
        self.bytes
    }

    fn finish(&mut self) -> Vec<(&'static str, ArrayRef, bool)> {
        self.rows = 0;
        self.bytes = 0;
        vec![
            (
                "record_id",
                Arc::new(self.record_id.finish()) as ArrayRef,
                false,
            ),
            ("span_id", Arc::new(self.span_id.finish()), false),
            ("episode_id", Arc::new(self.episode_id.finish()), true),
            ("task_id", Arc::new(self.task_id.finish()), true),
            ("group_id", Arc::new(self.group_id.finish()), true),
            ("sidecar_id", Arc::new(self.sidecar_id.finish()), false),
            ("sidecar_seq", Arc::new(self.sidecar_seq.finish()), false),
            ("seq", Arc::new(self.seq.finish()), false),
            ("segment", Arc::new(self.segment.finish()), false),
            ("api", Arc::new(self.api.finish()), false),
            ("method", Arc::new(self.method.finish()), false),
            ("path", Arc::new(self.path.finish()), false),
            ("start_time", Arc::new(self.start_time.finish()), true),
            (
                "first_byte_time",
                Arc::new(self.first_byte_time.finish()),
                true,
            ),
            ("end_time", Arc::new(self.end_time.finish()), true),
            ("http_status", Arc::new(self.http_status.finish()), true),
            ("outcome", Arc::new(self.outcome.finish()), false),
            ("error", Arc::new(self.error.finish()), true),
            ("streamed", Arc::new(self.streamed.finish()), false),
            ("request_model", Arc::new(self.request_model.finish()), true),
            (
                "response_model",
                Arc::new(self.response_model.finish()),
                true,
            ),
            (
                "policy_version",
                Arc::new(self.policy_version.finish()),
                true,
            ),
            ("tags", Arc::new(self.tags.finish()), false),
            (
                "request_messages",
                Arc::new(self.request_messages.finish()),
                true,
            ),
            ("request_tools", Arc::new(self.request_tools.finish()), true),
            (
                "request_truncated",
                Arc::new(self.request_truncated.finish()),
                false,
            ),
            (
                "response_truncated",
                Arc::new(self.response_truncated.finish()),
                false,
            ),
            ("choices", Arc::new(self.choices.finish()), false),
            ("completion", Arc::new(self.completion.finish()), true),
            (
                "other_completions",
                Arc::new(self.other_completions.finish()),
                true,
            ),
            ("finish_reason", Arc::new(self.finish_reason.finish()), true),
            ("tool_calls", Arc::new(self.tool_calls.finish()), false),
            (
                "prompt_token_ids",
                Arc::new(self.prompt_token_ids.finish()),
                true,
            ),
            (
                "completion_token_ids",
                Arc::new(self.completion_token_ids.finish()),
                true,
            ),
            (
                "completion_logprobs",
                Arc::new(self.completion_logprobs.finish()),
                true,
            ),
            ("prompt_tokens", Arc::new(self.prompt_tokens.finish()), true),
            (
                "completion_tokens",
                Arc::new(self.completion_tokens.finish()),
                true,
            ),
            ("total_tokens", Arc::new(self.total_tokens.finish()), true),
            (
                "cached_prompt_tokens",
                Arc::new(self.cached_prompt_tokens.finish()),
                true,
            ),
            (
                "reasoning_tokens",
                Arc::new(self.reasoning_tokens.finish()),
                true,
            ),
            (
                "capture_warnings",
                Arc::new(self.capture_warnings.finish()),
                false,
            ),
        ]
    }
}

/// Builders of `rewards.parquet`'s columns (see [`REWARD_COLUMNS`]).
struct RewardRows {
    rows: usize,
    reward_id: StringBuilder,
    episode_id: StringBuilder,
    span_id: StringBuilder,
    name: StringBuilder,
    value: Float64Builder,
    time: TimestampNanosecondBuilder,
    tags: MapBuilder<StringBuilder, StringBuilder>,
    sidecar_id: StringBuilder,
    segment: StringBuilder,
}

impl Default for RewardRows {
    fn default() -> Self {
        RewardRows {
            rows: 0,
            reward_id: StringBuilder::new(),
            episode_id: StringBuilder::new(),
            span_id: StringBuilder::new(),
            name: StringBuilder::new(),
            value: Float64Builder::new(),
            time: utc(),
            tags: string_map(),
            sidecar_id: StringBuilder::new(),
            segment: StringBuilder::new(),
        }
    }
}

impl RewardRows {
    fn push(&mut self, record: &Record, reward: &Reward, segment: &str) {
        self.rows += 1;
        self.reward_id.append_value(&reward.reward_id);
        self.episode_id.append_value(&reward.episode_id);
        opt_str(&mut self.span_id, &reward.span_id);
        opt_str(&mut self.name, &reward.name);
        self.value.append_value(reward.value);
        self.time.append_value(reward.time_unix_nanos);
        push_map(&mut self.tags, &reward.tags);
        self.sidecar_id.append_value(&record.sidecar_id);
        self.segment.append_value(segment);
    }
}

impl Rows for RewardRows {
    fn len(&self) -> usize {
        self.rows
    }

    fn bytes(&self) -> usize {
        self.rows * 128
    }

    fn finish(&mut self) -> Vec<(&'static str, ArrayRef, bool)> {
        self.rows = 0;
        vec![
            (
                "reward_id",
                Arc::new(self.reward_id.finish()) as ArrayRef,
                false,
            ),
            ("episode_id", Arc::new(self.episode_id.finish()), false),
            ("span_id", Arc::new(self.span_id.finish()), true),
            ("name", Arc::new(self.name.finish()), true),
            ("value", Arc::new(self.value.finish()), false),
            ("time", Arc::new(self.time.finish()), false),
            ("tags", Arc::new(self.tags.finish()), false),
            ("sidecar_id", Arc::new(self.sidecar_id.finish()), false),
            ("segment", Arc::new(self.segment.finish()), false),
        ]
    }
}

/// Builders of `episodes.parquet`'s columns (see [`EPISODE_COLUMNS`]).
struct EpisodeRows {
    rows: usize,
    episode_id: StringBuilder,
    task_id: StringBuilder,
    group_id: StringBuilder,
    status: StringBuilder,
    start_time: TimestampNanosecondBuilder,
    end_time: TimestampNanosecondBuilder,
    first_time: TimestampNanosecondBuilder,
    last_time: TimestampNanosecondBuilder,
    metadata: MapBuilder<StringBuilder, StringBuilder>,
    calls: UInt64Builder,
    failed_calls: UInt64Builder,
    rewards: UInt64Builder,
    prompt_tokens: UInt64Builder,
    completion_tokens: UInt64Builder,
    final_reward: Float64Builder,
    reward_components: MapBuilder<StringBuilder, Float64Builder>,
    incomplete: BooleanBuilder,
    dropped_records: UInt64Builder,
    sidecar_ids: ListBuilder<StringBuilder>,
}

impl Default for EpisodeRows {
    fn default() -> Self {
        EpisodeRows {
            rows: 0,
            episode_id: StringBuilder::new(),
            task_id: StringBuilder::new(),
            group_id: StringBuilder::new(),
            status: StringBuilder::new(),
            start_time: utc(),
            end_time: utc(),
            first_time: utc(),
            last_time: utc(),
            metadata: string_map(),
            calls: UInt64Builder::new(),
            failed_calls: UInt64Builder::new(),
            rewards: UInt64Builder::new(),
            prompt_tokens: UInt64Builder::new(),
            completion_tokens: UInt64Builder::new(),
            final_reward: Float64Builder::new(),
            reward_components: MapBuilder::new(None, StringBuilder::new(), Float64Builder::new()),
            incomplete: BooleanBuilder::new(),
            dropped_records: UInt64Builder::new(),
            sidecar_ids: ListBuilder::new(StringBuilder::new()),
        }
    }
}

impl EpisodeRows {
    fn push(&mut self, id: &str, e: &EpisodeSummary) {
        self.rows += 1;
        self.episode_id.append_value(id);
        let (task, group) = e.task();
        opt_str(&mut self.task_id, task);
        opt_str(&mut self.group_id, group);
        match &e.end {
            Some(end) => self
                .status
                .append_value(enum_name(end.status().as_str_name(), "END_STATUS_")),
            None => self.status.append_null(),
        }
        self.start_time
            .append_option(e.start.as_ref().map(|s| s.time_unix_nanos));
        self.end_time
            .append_option(e.end.as_ref().map(|s| s.time_unix_nanos));
        self.first_time.append_value(e.first_time.unwrap_or(0));
        self.last_time.append_value(e.last_time);
        let mut metadata: HashMap<&String, &String> = HashMap::new();
        for event in [&e.start, &e.end].into_iter().flatten() {
            metadata.extend(&event.metadata);
        }
        push_map(&mut self.metadata, metadata);
        self.calls.append_value(e.calls);
        self.failed_calls.append_value(e.failed_calls);
        self.rewards.append_value(e.rewards);
        self.prompt_tokens.append_value(e.prompt_tokens);
        self.completion_tokens.append_value(e.completion_tokens);
        self.final_reward
            .append_option(e.latest.get("").map(|(_, _, v)| *v));
        for (name, (_, _, value)) in e.latest.iter().filter(|(n, _)| !n.is_empty()) {
            self.reward_components.keys().append_value(name);
            self.reward_components.values().append_value(*value);
        }
        self.reward_components
            .append(true)
            .expect("keys and values appended in pairs");
        // As the trainer's `clean` decides it, from the kept start and end events.
        let kept = || [&e.start, &e.end].into_iter().flatten();
        let incomplete = kept().any(|ev| ev.incomplete || ev.dropped_records > 0);
        let dropped = kept().map(|ev| ev.dropped_records).max().unwrap_or(0);
        self.incomplete.append_value(incomplete);
        self.dropped_records.append_value(dropped);
        for s in &e.sidecars {
            self.sidecar_ids.values().append_value(s);
        }
        self.sidecar_ids.append(true);
    }
}

impl Rows for EpisodeRows {
    fn len(&self) -> usize {
        self.rows
    }

    fn bytes(&self) -> usize {
        self.rows * 256
    }

    fn finish(&mut self) -> Vec<(&'static str, ArrayRef, bool)> {
        self.rows = 0;
        vec![
            (
                "episode_id",
                Arc::new(self.episode_id.finish()) as ArrayRef,
                false,
            ),
            ("task_id", Arc::new(self.task_id.finish()), true),
            ("group_id", Arc::new(self.group_id.finish()), true),
            ("status", Arc::new(self.status.finish()), true),
            ("start_time", Arc::new(self.start_time.finish()), true),
            ("end_time", Arc::new(self.end_time.finish()), true),
            ("first_time", Arc::new(self.first_time.finish()), false),
            ("last_time", Arc::new(self.last_time.finish()), false),
            ("metadata", Arc::new(self.metadata.finish()), false),
            ("calls", Arc::new(self.calls.finish()), false),
            ("failed_calls", Arc::new(self.failed_calls.finish()), false),
            ("rewards", Arc::new(self.rewards.finish()), false),
            (
                "prompt_tokens",
                Arc::new(self.prompt_tokens.finish()),
                false,
            ),
            (
                "completion_tokens",
                Arc::new(self.completion_tokens.finish()),
                false,
            ),
            ("final_reward", Arc::new(self.final_reward.finish()), true),
            (
                "reward_components",
                Arc::new(self.reward_components.finish()),
                false,
            ),
            ("incomplete", Arc::new(self.incomplete.finish()), false),
            (
                "dropped_records",
                Arc::new(self.dropped_records.finish()),
                false,
            ),
            ("sidecar_ids", Arc::new(self.sidecar_ids.finish()), false),
        ]
    }
}

/// Rows buffered before they are handed to the Parquet writer.
const BATCH_BYTES: usize = 16 << 20;
/// Encoded bytes a row group may hold in memory before it is written out.
const ROW_GROUP_BYTES: usize = 64 << 20;

/// One Parquet file being written under a temporary name.
struct Table {
    name: &'static str,
    path: PathBuf,
    partial: PathBuf,
    file: Option<File>,
    writer: Option<ArrowWriter<File>>,
    schema: Option<arrow_schema::SchemaRef>,
    props: WriterProperties,
    rows: u64,
}

impl Table {
    fn create(
        out: &Path,
        name: &'static str,
        options: &ExportOptions,
    ) -> Result<Table, ExportError> {
        let path = out.join(name);
        let partial = out.join(format!(".{name}.partial"));
        let file = File::create(&partial).map_err(|e| ExportError::Write {
            path: partial.clone(),
            detail: e.to_string(),
        })?;
        let level = ZstdLevel::try_new(options.zstd_level).map_err(|e| ExportError::Write {
            path: path.clone(),
            detail: format!("zstd level {}: {e}", options.zstd_level),
        })?;
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(level))
            .set_key_value_metadata(Some(vec![
                KeyValue::new(SCHEMA_VERSION_KEY.to_owned(), SCHEMA_VERSION.to_owned()),
                KeyValue::new(
                    "tapline.export.table".to_owned(),
                    name.trim_end_matches(".parquet").to_owned(),
                ),
                KeyValue::new(
                    "tapline.export.written_by".to_owned(),
                    format!(
                        "tapline-trainer {} ({})",
                        env!("CARGO_PKG_VERSION"),
                        crate::GIT_COMMIT
                    ),
                ),
            ]))
            .build();
        Ok(Table {
            name,
            path,
            partial,
            file: Some(file),
            writer: None,
            schema: None,
            props,
            rows: 0,
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> ExportError {
        ExportError::Write {
            path: self.path.clone(),
            detail: e.to_string(),
        }
    }

    /// Hands the buffered rows to the writer once there are enough of them.
    fn write_if_full(
        &mut self,
        rows: &mut impl Rows,
        options: &ExportOptions,
    ) -> Result<(), ExportError> {
        if rows.len() >= options.batch_rows.max(1) || rows.bytes() >= BATCH_BYTES {
            self.write(rows)?;
        }
        Ok(())
    }

    fn write(&mut self, rows: &mut impl Rows) -> Result<(), ExportError> {
        let n = rows.len();
        let columns = rows.finish();
        let batch = RecordBatch::try_from_iter_with_nullable(columns).map_err(|e| self.err(e))?;
        if self.writer.is_none() {
            // The schema version in the Arrow schema too, where readers of the schema
            // (pyarrow's `read_schema`, Polars) look.
            let metadata = [(SCHEMA_VERSION_KEY.to_owned(), SCHEMA_VERSION.to_owned())];
            let schema = Arc::new(batch.schema().as_ref().clone().with_metadata(metadata));
            let file = self
                .file
                .take()
                .expect("the file is there until the writer takes it");
            let writer = ArrowWriter::try_new(file, schema.clone(), Some(self.props.clone()))
                .map_err(|e| self.err(e))?;
            self.writer = Some(writer);
            self.schema = Some(schema);
        }
        let schema = self.schema.clone().expect("set with the writer");
        let batch = batch.with_schema(schema).map_err(|e| self.err(e))?;
        let writer = self.writer.as_mut().expect("created above");
        writer.write(&batch).map_err(|e| ExportError::Write {
            path: self.path.clone(),
            detail: e.to_string(),
        })?;
        if writer.in_progress_size() >= ROW_GROUP_BYTES {
            writer.flush().map_err(|e| ExportError::Write {
                path: self.path.clone(),
                detail: e.to_string(),
            })?;
        }
        self.rows += n as u64;
        Ok(())
    }

    /// Writes the last rows (an empty file still gets its schema) and closes the file,
    /// still under its temporary name (`Table` removes it if dropped before `commit`);
    /// returns its row count.
    fn close(&mut self, mut rows: impl Rows) -> Result<u64, ExportError> {
        if rows.len() > 0 || self.writer.is_none() {
            self.write(&mut rows)?;
        }
        let writer = self.writer.take().expect("written at least once");
        writer.close().map_err(|e| self.err(e))?;
        Ok(self.rows)
    }

    /// Gives a closed file its name; its size.
    fn commit(mut self) -> Result<(String, u64), ExportError> {
        std::fs::rename(&self.partial, &self.path).map_err(|e| self.err(e))?;
        self.partial = PathBuf::new();
        let size = std::fs::metadata(&self.path)
            .map_err(|e| self.err(e))?
            .len();
        Ok((self.name.to_owned(), size))
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // A table dropped before `commit` (an error): leave no partial file behind.
        if !self.partial.as_os_str().is_empty() && self.partial.exists() {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_parse_only_in_canonical_form() {
        assert_eq!(
            parse_uuid("0193a5b2-7c1d-7e3f-8a9b-0c1d2e3f4a5b"),
            Some(0x0193a5b2_7c1d_7e3f_8a9b_0c1d2e3f4a5b)
        );
        assert_eq!(parse_uuid("0193A5B2-7c1d-7e3f-8a9b-0c1d2e3f4a5b"), None);
        assert_eq!(parse_uuid("ep-1-call-0"), None);
        let mut seen = Seen::default();
        assert!(seen.insert("0193a5b2-7c1d-7e3f-8a9b-0c1d2e3f4a5b"));
        assert!(!seen.insert("0193a5b2-7c1d-7e3f-8a9b-0c1d2e3f4a5b"));
        assert!(seen.insert("x"));
        assert!(!seen.insert("x"));
        assert!(seen.insert(""));
        assert!(seen.insert(""));
    }

    #[test]
    fn request_messages_take_each_apis_conversation() {
        let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(
            request_messages(Api::ChatCompletions, &chat),
            Some(json!([{"role": "user", "content": "hi"}]))
        );
        let anthropic =
            json!({"system": "be brief", "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(
            request_messages(Api::AnthropicMessages, &anthropic),
            Some(
                json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
            )
        );
        let responses = json!({"instructions": "be brief", "input": "hi"});
        assert_eq!(
            request_messages(Api::Responses, &responses),
            Some(
                json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
            )
        );
        assert_eq!(
            request_messages(Api::Completions, &json!({"prompt": "2+2="})),
            Some(json!("2+2="))
        );
        assert_eq!(request_messages(Api::ChatCompletions, &json!([1])), None);
    }

    #[test]
    fn the_column_docs_name_every_column_written() {
        let names =
            |rows: &mut dyn FnMut() -> Vec<(&'static str, ArrayRef, bool)>| -> Vec<&'static str> {
                rows().into_iter().map(|(n, _, _)| n).collect()
            };
        let documented = |cols: &[(&'static str, &str, &str)]| -> Vec<&'static str> {
            cols.iter().map(|(n, _, _)| *n).collect()
        };
        let mut calls = CallRows::default();
        assert_eq!(names(&mut || calls.finish()), documented(CALL_COLUMNS));
        let mut rewards = RewardRows::default();
        assert_eq!(names(&mut || rewards.finish()), documented(REWARD_COLUMNS));
        let mut episodes = EpisodeRows::default();
        assert_eq!(
            names(&mut || episodes.finish()),
            documented(EPISODE_COLUMNS)
        );
    }
}
