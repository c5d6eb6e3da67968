//! `tapline-sidecar dump`: every record in a store as one JSON object per line, or, with
//! `--episode ID`, the records of one episode (`--format pretty`: as a conversation,
//! [`crate::trace`]).
//!
//! Segments are read in key order (time, then sidecar, then sequence). A segment that
//! fails to read is reported on stderr with its key and the reason, the others are still
//! printed, and the command fails at the end so a script notices. A record over the
//! reader's limit is reported the same way, and the rest of its segment is printed.

use std::io::Write;

use anyhow::{Context, bail};
use futures::TryStreamExt;
use object_store::path::Path;
use tapline_proto::json::record_to_json;
use tapline_proto::keys::{SegmentKey, segments_root};
use tapline_proto::segment::{Limits, read_segment};
use tapline_proto::store::StoreLocation;

/// What a dump saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DumpSummary {
    /// Segments printed.
    pub segments: usize,
    /// Records printed.
    pub records: usize,
    /// Segments that could not be read.
    pub failed_segments: usize,
    /// Records passed over as larger than the reader's limit (their segments were
    /// printed).
    pub oversized_records: usize,
    /// Objects under the segments directory that are not segment keys (skipped).
    pub foreign_objects: usize,
}

/// How `dump` prints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DumpFormat {
    /// One JSON object per record and line (with its `segment`).
    #[default]
    Json,
    /// One episode as a conversation, for reading in a terminal (needs `--episode`).
    Pretty,
}

/// What `dump` prints.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    /// Only segments whose key starts with this, relative to the segments directory
    /// (e.g. `2026/12/02`).
    pub key_prefix: Option<String>,
    /// Only the records of this episode (its start and end, calls and rewards).
    pub episode: Option<String>,
    /// JSON lines or the conversation view.
    pub format: DumpFormat,
}

/// Prints the records of the segments under `location` to `out`, as `options` say.
pub async fn dump(
    location: &StoreLocation,
    options: &DumpOptions,
    out: &mut dyn Write,
) -> anyhow::Result<DumpSummary> {
    if options.format == DumpFormat::Pretty && options.episode.is_none() {
        bail!(
            "--format pretty shows one episode: add --episode ID (the ids are in the episode_id fields of `dump`'s JSON)"
        );
    }
    let key_prefix = options.key_prefix.as_deref();
    let episode = options.episode.as_deref();
    let mut kept = Vec::new();
    let root = segments_root(&location.prefix);
    let list_prefix = match key_prefix
        .map(|p| p.trim_matches('/'))
        .filter(|p| !p.is_empty())
    {
        Some(p) => {
            Path::parse(format!("{root}/{p}")).with_context(|| format!("invalid --prefix {p:?}"))?
        }
        None => root.clone(),
    };
    let mut metas: Vec<_> = location
        .store
        .list(Some(&list_prefix))
        .try_collect()
        .await
        .with_context(|| format!("listing {list_prefix} in {location}"))?;
    metas.sort_by(|a, b| a.location.cmp(&b.location));
    let mut summary = DumpSummary::default();
    for meta in metas {
        let key = &meta.location;
        if SegmentKey::parse(&location.prefix, key).is_err() {
            summary.foreign_objects += 1;
            eprintln!("dump: skipping {key}: not a segment key");
            continue;
        }
        let bytes = match location.store.get(key).await {
            Ok(get) => get.bytes().await,
            Err(e) => Err(e),
        };
        let contents = bytes
            .map_err(anyhow::Error::from)
            .and_then(|b| read_segment(&b, Limits::default()).map_err(anyhow::Error::from));
        match contents {
            Ok(contents) => {
                for skipped in &contents.skipped {
                    summary.oversized_records += 1;
                    eprintln!("dump: segment {key}: {skipped}");
                }
                let records: Vec<_> = contents
                    .records
                    .into_iter()
                    .filter(|r| episode.is_none() || r.episode_id() == episode)
                    .collect();
                summary.segments += 1;
                summary.records += records.len();
                if options.format == DumpFormat::Pretty {
                    kept.extend(records);
                    continue;
                }
                for record in &records {
                    let mut value = record_to_json(record);
                    value["segment"] = serde_json::Value::String(key.to_string());
                    serde_json::to_writer(&mut *out, &value)?;
                    out.write_all(b"\n")?;
                }
            }
            Err(e) => {
                summary.failed_segments += 1;
                eprintln!("dump: cannot read segment {key}: {e:#}");
            }
        }
    }
    if let (DumpFormat::Pretty, Some(episode)) = (options.format, episode) {
        if kept.is_empty() {
            bail!(
                "no record of episode {episode} in {} segment(s) read",
                summary.segments
            );
        }
        out.write_all(crate::trace::render(&kept, episode).as_bytes())?;
    }
    out.flush()?;
    if summary.oversized_records > 0 && summary.failed_segments == 0 {
        bail!(
            "{} record(s) were larger than the reader's limit and were skipped (see the messages above); every other record was printed",
            summary.oversized_records
        );
    }
    if summary.failed_segments > 0 {
        bail!(
            "{} of {} segments could not be read (see the messages above)",
            summary.failed_segments,
            summary.failed_segments + summary.segments
        );
    }
    Ok(summary)
}
