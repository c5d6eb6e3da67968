//! `tapline-trainer export` throughput on the spool bench's multi-turn agent traces
//! (`sidecar/benches/common/agent_traces.rs`: growing prompts, tool calls, 120 recorded
//! ids and log-probs per completion), stored as 8 MiB segments in an in-memory store.
//!
//! `cargo bench -p tapline-trainer --bench export [-- EPISODES TURNS]` (defaults 64 and
//! 12). Prints, as medians of 5 runs: the baseline (fetching and verifying every
//! segment, decoding its records, nothing written), the export of everything (one
//! pass) and the export of one task (two passes), in call rows/s, MB/s of records and
//! the ratio to the baseline, with the size of the files written.

#[path = "../../sidecar/benches/common/agent_traces.rs"]
mod agent_traces;

use std::time::{Duration, Instant};

use agent_traces::{Words, episode};
use futures::TryStreamExt;
use object_store::PutPayload;
use tapline_proto::keys::{SegmentKey, segments_root};
use tapline_proto::segment::{Limits, encode_segment, read_segment};
use tapline_proto::store::{StoreLocation, open_store};
use tapline_proto::{EndStatus, EpisodeEvent, EpisodeEventKind, Record, RecordKind, Reward};
use tapline_trainer::export::{ExportOptions, export};

const T0: i64 = 1_796_204_942_000_000_000;

/// The records of `episodes` episodes: start, the calls, a reward, the end.
fn records(episodes: usize, turns: usize) -> Vec<Record> {
    let mut words = Words(0x9e37_79b9_7f4a_7c15);
    let mut kinds = Vec::new();
    for e in 0..episodes {
        let episode_id = format!("ep-{e:06}");
        let task_id = format!("task-{}", e / 8);
        let event = |kind: EpisodeEventKind, n: u64| {
            RecordKind::EpisodeEvent(EpisodeEvent {
                event_id: format!("{episode_id}-{n}"),
                episode_id: episode_id.clone(),
                kind: kind as i32,
                task_id: task_id.clone(),
                status: if kind == EpisodeEventKind::End {
                    EndStatus::Succeeded as i32
                } else {
                    0
                },
                time_unix_nanos: T0 + e as i64 * 1_000_000_000 + n as i64,
                ..EpisodeEvent::default()
            })
        };
        kinds.push(event(EpisodeEventKind::Start, 0));
        kinds.extend(episode(&mut words, e, turns));
        kinds.push(RecordKind::Reward(Reward {
            reward_id: format!("{episode_id}-reward"),
            episode_id: episode_id.clone(),
            value: (e % 3) as f64 / 2.0,
            time_unix_nanos: T0 + e as i64 * 1_000_000_000 + 900_000_000,
            ..Reward::default()
        }));
        kinds.push(event(EpisodeEventKind::End, 1));
    }
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, k)| Record::new("bench", i as u64 + 1, T0 + i as i64 * 1_000_000, k))
        .collect()
}

/// Writes the records as segments cut at 8 MiB of records, as the sidecar does.
async fn write(location: &StoreLocation, records: &[Record]) -> u64 {
    let mut stored = 0u64;
    let mut start = 0;
    let mut size = 0;
    for i in 0..records.len() {
        size += prost::Message::encoded_len(&records[i]);
        if size >= 8 << 20 || i + 1 == records.len() {
            let chunk = &records[start..=i];
            let key = SegmentKey::new("bench", chunk[0].sidecar_seq, chunk[0].written_unix_nanos)
                .expect("sidecar id")
                .to_path(&location.prefix);
            let (bytes, _) = encode_segment(chunk, 3).expect("encode");
            stored += bytes.len() as u64;
            location
                .store
                .put(&key, PutPayload::from(bytes))
                .await
                .expect("put");
            start = i + 1;
            size = 0;
        }
    }
    stored
}

/// The baseline: list, fetch and verify every segment, decode its records.
async fn read_all(location: &StoreLocation) -> u64 {
    let metas: Vec<_> = location
        .store
        .list(Some(&segments_root(&location.prefix)))
        .try_collect()
        .await
        .expect("list");
    let mut records = 0u64;
    for meta in metas {
        let bytes = location
            .store
            .get(&meta.location)
            .await
            .expect("get")
            .bytes()
            .await
            .expect("bytes");
        records += read_segment(&bytes, Limits::default())
            .expect("segment")
            .records
            .len() as u64;
    }
    records
}

fn median(mut runs: Vec<Duration>) -> Duration {
    runs.sort();
    runs[runs.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let episodes = args.first().copied().unwrap_or(64);
    let turns = args.get(1).copied().unwrap_or(12);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let location = open_store("memory://export-bench").expect("store");
    let records = records(episodes, turns);
    let raw: u64 = records
        .iter()
        .map(|r| prost::Message::encoded_len(r) as u64)
        .sum();
    let calls = (episodes * turns) as u64;
    let stored = runtime.block_on(write(&location, &records));
    println!(
        "export: {episodes} episodes x {turns} calls = {calls} calls; records {:.1} MB, segments {:.1} MB (zstd 3); median of 5 runs, one core",
        raw as f64 / 1e6,
        stored as f64 / 1e6
    );
    let out = tempfile::tempdir().expect("tempdir");
    let mut rows = Vec::new();
    let time = |f: &mut dyn FnMut()| {
        f(); // warm-up
        median(
            (0..5)
                .map(|_| {
                    let started = Instant::now();
                    f();
                    started.elapsed()
                })
                .collect(),
        )
    };
    let baseline = time(&mut || {
        let n = runtime.block_on(read_all(&location));
        assert_eq!(n, records.len() as u64);
    });
    rows.push(("read and decode every segment (baseline)", baseline, None));
    let mut written = 0u64;
    let everything = time(&mut || {
        let summary = runtime
            .block_on(export(&location, out.path(), &ExportOptions::default()))
            .expect("export");
        assert_eq!(summary.calls, calls);
        written = summary.files.iter().map(|(_, b)| b).sum();
    });
    rows.push(("export everything (1 pass)", everything, Some(written)));
    let one_task = ExportOptions {
        tasks: vec!["task-0".into()],
        ..ExportOptions::default()
    };
    let filtered = time(&mut || {
        let summary = runtime
            .block_on(export(&location, out.path(), &one_task))
            .expect("export");
        assert_eq!(summary.calls, (8.min(episodes) * turns) as u64);
        written = summary.files.iter().map(|(_, b)| b).sum();
    });
    rows.push(("export --task task-0 (2 passes)", filtered, Some(written)));

    println!();
    println!("| run | median | calls read/s | record MB/s | vs baseline | files written |");
    println!("|---|---|---|---|---|---|");
    for (name, took, files) in rows {
        let secs = took.as_secs_f64();
        println!(
            "| {name} | {:.0} ms | {:.0} | {:.0} | {:.2}x | {} |",
            secs * 1e3,
            calls as f64 / secs,
            raw as f64 / secs / 1e6,
            baseline.as_secs_f64() / secs,
            files.map_or("-".to_owned(), |b| format!("{:.1} MB", b as f64 / 1e6)),
        );
    }
}
