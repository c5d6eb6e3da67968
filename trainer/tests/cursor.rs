//! The run cursor under random interleavings of uploads (in order, out of order, late
//! within the lookback, uploaded twice) and runs (successful or failed), for a cursor
//! started empty and one migrated from version 1: every segment is read exactly once
//! across the successful runs, and a failed run changes nothing. Two runs on one cursor:
//! exactly one advances it, on the memory, local and S3 (s3s-fs) stores.

#[path = "common/s3.rs"]
mod s3;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};
use proptest::prelude::*;
use tapline_proto::keys::{SegmentKey, hour_dir};
use tapline_proto::segment::encode_segment;
use tapline_proto::store::{StoreLocation, open_store};
use tapline_proto::{Record, RecordKind, Reward};
use tapline_trainer::ingest::{
    Cursor, CursorVersion, IngestError, IngestOptions, next_cursor, read_cursor_versioned,
    read_store, write_cursor,
};

const LOOKBACK: u32 = 3;
const SIDECARS: [&str; 3] = ["pod-a", "pod-b", "pod-c"];
const HOUR: i64 = 3600;
const T0: i64 = 1_798_758_000; // an hour boundary

#[derive(Debug, Clone)]
enum Op {
    /// A sidecar seals a segment of `count` records (not uploaded yet), its clock
    /// `ahead` hours ahead of the others'.
    Seal {
        sidecar: usize,
        count: u64,
        ahead: i64,
    },
    /// A sidecar uploads one of its sealed segments, `pick` chosen among them (out of
    /// order when not the oldest).
    Upload { sidecar: usize, pick: usize },
    /// A segment already uploaded is uploaded again (a retry after a lost answer).
    Reupload { pick: usize },
    /// Time passes.
    Tick { hours: i64 },
    /// A trainer run, failing before its cursor is written or not.
    Run { fail: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..SIDECARS.len(), 1..6u64).prop_map(|(sidecar, count)| Op::Seal { sidecar, count, ahead: 0 }),
        // pod-c's clock sometimes runs two lookbacks ahead.
        1 => (1..6u64).prop_map(|count| Op::Seal { sidecar: 2, count, ahead: 2 * i64::from(LOOKBACK) }),
        5 => (0..SIDECARS.len(), 0..4usize).prop_map(|(sidecar, pick)| Op::Upload { sidecar, pick }),
        1 => (0..64usize).prop_map(|pick| Op::Reupload { pick }),
        2 => (0..3i64).prop_map(|hours| Op::Tick { hours }),
        3 => any::<bool>().prop_map(|fail| Op::Run { fail }),
    ]
}

struct Segment {
    key: Path,
    bytes: bytes::Bytes,
    hour: i64,
}

struct World {
    location: StoreLocation,
    now: i64,
    next_seq: [u64; 3],
    sealed: [Vec<Segment>; 3],
    uploaded: Vec<Segment>,
    /// Keys that must be read (uploaded within the lookback).
    expected: BTreeSet<String>,
    /// Keys read by successful runs, with how many times.
    read: BTreeMap<String, u32>,
}

impl World {
    fn new() -> World {
        World {
            location: StoreLocation {
                store: Arc::new(InMemory::new()),
                prefix: Path::from("fleet"),
                display: "memory://fleet".into(),
            },
            now: T0,
            next_seq: [0; 3],
            sealed: Default::default(),
            uploaded: Vec::new(),
            expected: BTreeSet::new(),
            read: BTreeMap::new(),
        }
    }

    fn rel(&self, key: &Path) -> String {
        key.prefix_match(&self.location.prefix)
            .unwrap()
            .map(|p| p.as_ref().to_owned())
            .collect::<Vec<_>>()
            .join("/")
    }

    async fn apply(&mut self, op: &Op) {
        match *op {
            Op::Seal {
                sidecar,
                count,
                ahead,
            } => {
                let first = self.next_seq[sidecar];
                self.next_seq[sidecar] += count;
                let sealed_at = self.now + ahead * HOUR;
                let nanos = (sealed_at + 7) * 1_000_000_000;
                let records: Vec<Record> = (first..first + count)
                    .map(|seq| {
                        Record::new(
                            SIDECARS[sidecar],
                            seq,
                            nanos,
                            RecordKind::Reward(Reward {
                                reward_id: format!("{}-{seq}", SIDECARS[sidecar]),
                                episode_id: format!("ep-{}", seq % 4),
                                value: 1.0,
                                ..Reward::default()
                            }),
                        )
                    })
                    .collect();
                let key = SegmentKey::new(SIDECARS[sidecar], first, nanos)
                    .unwrap()
                    .to_path(&self.location.prefix);
                let (bytes, _) = encode_segment(&records, 1).unwrap();
                self.sealed[sidecar].push(Segment {
                    key,
                    bytes: bytes.into(),
                    hour: sealed_at - sealed_at.rem_euclid(HOUR),
                });
            }
            Op::Upload { sidecar, pick } => {
                if self.sealed[sidecar].is_empty() {
                    return;
                }
                let i = pick % self.sealed[sidecar].len();
                let segment = self.sealed[sidecar].remove(i);
                // Later than the lookback allows: the sidecar gives it up (a sidecar
                // late by more than `lookback_hours` is documented to be missed).
                let now_hour = self.now - self.now.rem_euclid(HOUR);
                if segment.hour < now_hour - i64::from(LOOKBACK) * HOUR {
                    return;
                }
                self.put(&segment).await;
                self.expected.insert(self.rel(&segment.key));
                self.uploaded.push(segment);
            }
            Op::Reupload { pick } => {
                if self.uploaded.is_empty() {
                    return;
                }
                let i = pick % self.uploaded.len();
                let (key, bytes) = (self.uploaded[i].key.clone(), self.uploaded[i].bytes.clone());
                self.location
                    .store
                    .put(&key, PutPayload::from(bytes))
                    .await
                    .unwrap();
            }
            Op::Tick { hours } => self.now += hours * HOUR,
            Op::Run { fail } => self.run(fail).await,
        }
    }

    async fn put(&self, segment: &Segment) {
        self.location
            .store
            .put(&segment.key, PutPayload::from(segment.bytes.clone()))
            .await
            .unwrap();
    }

    async fn cursor_bytes(&self) -> Option<bytes::Bytes> {
        let path = self
            .location
            .prefix
            .child("trainer")
            .child("runs")
            .child("r")
            .child("cursor.json");
        match self.location.store.get(&path).await {
            Ok(got) => Some(got.bytes().await.unwrap()),
            Err(_) => None,
        }
    }

    async fn run(&mut self, fail: bool) {
        let options = IngestOptions {
            lookback_hours: LOOKBACK,
            concurrent_reads: 3,
            ..IngestOptions::default()
        };
        let before = self.cursor_bytes().await;
        let read = read_store(
            &self.location,
            Some("r"),
            &options,
            self.now * 1_000_000_000,
        )
        .await
        .unwrap();
        assert_eq!(
            read.ingested.records,
            read.record_counts.values().sum::<u64>(),
            "every record of every new segment is read"
        );
        if fail {
            // The run fails before its cursor: nothing it read counts, nothing changed.
            assert_eq!(self.cursor_bytes().await, before);
            return;
        }
        let cursor = next_cursor(&read, &BTreeMap::new(), LOOKBACK, &self.location.prefix);
        write_cursor(&self.location, "r", &cursor, &read.cursor_version)
            .await
            .unwrap();
        for key in read.new_segments {
            *self.read.entry(key).or_default() += 1;
        }
        // The cursor stays small: a span or a few per sidecar, never a key per segment.
        assert!(cursor.consumed.iter().all(|k| k > &cursor.watermark));
        for progress in cursor.sidecars.values() {
            assert!(progress.ranges.len() <= 1 + self.uploaded.len());
        }
    }

    /// As if a trainer of the version-1 cursor had read every segment uploaded so far.
    async fn write_v1_cursor(&mut self) {
        let keys: BTreeSet<String> = self.uploaded.iter().map(|s| self.rel(&s.key)).collect();
        // (Dates after now count as now, as the version-2 cursor counts them: the old
        // trainer let a clock ahead push its watermark past live data.)
        let newest = self.uploaded.iter().map(|s| s.hour.min(self.now)).max();
        let watermark = newest.map_or_else(String::new, |h| {
            self.rel(&hour_dir(
                &self.location.prefix,
                h - i64::from(LOOKBACK) * HOUR,
            ))
        });
        let consumed: BTreeSet<String> = keys.iter().filter(|k| **k > watermark).cloned().collect();
        let v1 = serde_json::json!({
            "version": 1,
            "watermark": watermark,
            "consumed": consumed,
            "pending_segments": [],
            "pending_episodes": [],
        });
        let cursor: Cursor = serde_json::from_value(v1).unwrap();
        let (_, version) = read_cursor_versioned(&self.location, "r").await.unwrap();
        write_cursor(&self.location, "r", &cursor, &version)
            .await
            .unwrap();
        for key in keys {
            *self.read.entry(key).or_default() += 1;
        }
    }

    async fn finish(&mut self) {
        // Everything sealed is uploaded, and a last run reads what is left.
        for sidecar in 0..SIDECARS.len() {
            while !self.sealed[sidecar].is_empty() {
                self.apply(&Op::Upload { sidecar, pick: 0 }).await;
            }
        }
        self.run(false).await;
        let twice: Vec<_> = self.read.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "read more than once: {twice:?}");
        let missed: Vec<_> = self
            .expected
            .iter()
            .filter(|k| !self.read.contains_key(*k))
            .collect();
        assert!(missed.is_empty(), "never read: {missed:?}");
    }
}

fn check(ops: &[Op], migrate_after: Option<usize>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut world = World::new();
        for (i, op) in ops.iter().enumerate() {
            if migrate_after == Some(i) {
                // The old trainer ran until here; the new one takes over its cursor.
                world.write_v1_cursor().await;
            }
            if migrate_after.is_some_and(|m| i < m) && matches!(op, Op::Run { .. }) {
                continue;
            }
            world.apply(op).await;
        }
        world.finish().await;
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_segment_is_read_exactly_once(ops in prop::collection::vec(op(), 1..80)) {
        check(&ops, None);
    }

    #[test]
    fn a_migrated_version_1_cursor_reads_every_segment_exactly_once(
        ops in prop::collection::vec(op(), 1..80),
        migrate in 0..80usize,
    ) {
        let migrate = migrate.min(ops.len().saturating_sub(1));
        check(&ops, Some(migrate));
    }
}

/// The cursor of a sidecar that uploads in order is one span, whatever its number of
/// segments, and a hole left by an out-of-order upload closes when it arrives.
#[test]
fn in_order_uploads_keep_one_span_per_sidecar() {
    let mut ops = Vec::new();
    for _ in 0..50 {
        for sidecar in 0..3 {
            ops.push(Op::Seal {
                sidecar,
                count: 3,
                ahead: 0,
            });
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut world = World::new();
        for op in &ops {
            world.apply(op).await;
        }
        // pod-a uploads its second segment last.
        world
            .apply(&Op::Upload {
                sidecar: 0,
                pick: 1,
            })
            .await;
        let hole_kept = world.sealed[0].remove(0);
        for sidecar in 0..3 {
            while !world.sealed[sidecar].is_empty() {
                world.apply(&Op::Upload { sidecar, pick: 0 }).await;
            }
        }
        world.run(false).await;
        let cursor: Cursor = serde_json::from_slice(&world.cursor_bytes().await.unwrap()).unwrap();
        assert_eq!(cursor.sidecars["pod-a"].ranges, [[3, 149]]);
        assert_eq!(cursor.sidecars["pod-b"].ranges, [[0, 149]]);
        world.put(&hole_kept).await;
        world.expected.insert(world.rel(&hole_kept.key));
        world.uploaded.push(hole_kept);
        world.run(false).await;
        let cursor: Cursor = serde_json::from_slice(&world.cursor_bytes().await.unwrap()).unwrap();
        assert_eq!(cursor.sidecars["pod-a"].ranges, [[0, 149]]);
        // A sidecar whose clock runs 5 hours ahead: its hour directory is after the
        // hours listed one by one, and still read.
        world
            .apply(&Op::Seal {
                sidecar: 2,
                count: 2,
                ahead: 5,
            })
            .await;
        world
            .apply(&Op::Upload {
                sidecar: 2,
                pick: 0,
            })
            .await;
        let before = world.read.len();
        world.run(false).await;
        assert_eq!(world.read.len(), before + 1);
        world.finish().await;
    });
}

/// Two trainer runs read the cursor of one run name and both try to advance it: on every
/// kind of store, exactly one write lands (create for the first cursor, update after),
/// the other is refused as [`IngestError::CursorMoved`] and changes nothing; and of many
/// racing at once, exactly one wins (memory and local stores).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_runs_on_one_cursor_exactly_one_advances_it() {
    let dir = tempfile::tempdir().unwrap();
    let addr = s3::s3s_server(&dir.path().join("s3")).await;
    let stores = [
        format!("memory://cursor-race-{}", std::process::id()),
        format!("file://{}", dir.path().join("local").display()),
        s3::url(addr, "race"),
    ];
    for url in &stores {
        let location = open_store(url).unwrap();
        let options = IngestOptions::default();
        let cursor_now = || async {
            read_cursor_versioned(&location, "r")
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}"))
                .0
        };
        for round in 0..3 {
            let (a, b) = (
                read_store(&location, Some("r"), &options, T0 * 1_000_000_000)
                    .await
                    .unwrap(),
                read_store(&location, Some("r"), &options, T0 * 1_000_000_000)
                    .await
                    .unwrap(),
            );
            assert_eq!(
                a.cursor_version == CursorVersion::Absent,
                round == 0,
                "{url}: round {round}: {:?}",
                a.cursor_version
            );
            let pending = |who: &str| {
                BTreeMap::from([(format!("{who}-{round}"), BTreeSet::from(["seg".to_owned()]))])
            };
            let next_a = next_cursor(&a, &pending("a"), LOOKBACK, &location.prefix);
            let next_b = next_cursor(&b, &pending("b"), LOOKBACK, &location.prefix);
            write_cursor(&location, "r", &next_a, &a.cursor_version)
                .await
                .unwrap_or_else(|e| panic!("{url}: round {round}: {e}"));
            let lost = write_cursor(&location, "r", &next_b, &b.cursor_version).await;
            match lost {
                Err(IngestError::CursorMoved { ref run, .. }) if run == "r" => {}
                other => panic!("{url}: round {round}: the second write gave {other:?}"),
            }
            assert_eq!(cursor_now().await, next_a, "{url}: round {round}");
        }

        // A client retry of a write that landed: the same cursor from the same stale
        // version is that run's own write, a success; without a writer id it is not.
        let (cursor, version) = read_cursor_versioned(&location, "r").await.unwrap();
        let mine = Cursor {
            written_by: "run-7".into(),
            ..cursor.clone()
        };
        write_cursor(&location, "r", &mine, &version).await.unwrap();
        write_cursor(&location, "r", &mine, &version)
            .await
            .unwrap_or_else(|e| panic!("{url}: the retried write: {e}"));
        let (_, version_now) = read_cursor_versioned(&location, "r").await.unwrap();
        let anonymous = Cursor {
            written_by: String::new(),
            ..cursor.clone()
        };
        write_cursor(&location, "r", &anonymous, &version_now)
            .await
            .unwrap();
        assert!(matches!(
            write_cursor(&location, "r", &anonymous, &version_now).await,
            Err(IngestError::CursorMoved { .. })
        ));

        // Eight runs from one version at once: one wins. (Not on s3s-fs: it checks
        // If-Match and then writes, without a lock between, so concurrent requests all
        // pass; S3 itself makes the check and the write one step.)
        if url.starts_with("s3://") {
            continue;
        }
        let (cursor, version) = read_cursor_versioned(&location, "r").await.unwrap();
        let writes = (0..8).map(|i| {
            let (location, version) = (location.clone(), version.clone());
            let mut next = cursor.clone();
            next.pending_episodes = BTreeSet::from([format!("racer-{i}")]);
            tokio::spawn(async move {
                write_cursor(&location, "r", &next, &version)
                    .await
                    .map(|_| next)
            })
        });
        let mut won = Vec::new();
        for w in writes.collect::<Vec<_>>() {
            match w.await.unwrap() {
                Ok(next) => won.push(next),
                Err(IngestError::CursorMoved { .. }) => {}
                Err(e) => panic!("{url}: {e}"),
            }
        }
        assert_eq!(won.len(), 1, "{url}: {} writes won", won.len());
        assert_eq!(cursor_now().await, won[0], "{url}");
    }
}
