//! Storage cost and spool throughput on realistic multi-turn agent traces.
//!
//! Each synthetic episode is an agent loop: a system prompt with tool schemas, a task,
//! then turns of assistant tool calls and tool results; every call's request repeats the
//! whole conversation so far, as harnesses do. Prints bytes stored per call, the
//! compression ratio at several zstd settings, and records per second through
//! spool append + seal + segment build.
//!
//! `cargo bench -p tapline-sidecar --bench spool`

use std::time::Instant;

#[path = "common/agent_traces.rs"]
mod agent_traces;

use agent_traces::{Words, episode};
use tapline_proto::segment::encode_segment;
use tapline_proto::{Record, RecordKind};
use tapline_sidecar::spool::{Spool, read_sealed};

fn main() {
    let episodes = 64;
    let turns = 12;
    let mut words = Words(0x9e37_79b9_7f4a_7c15);
    let kinds: Vec<RecordKind> = (0..episodes)
        .flat_map(|e| episode(&mut words, e, turns))
        .collect();
    let records: Vec<Record> = kinds
        .iter()
        .enumerate()
        .map(|(i, k)| Record::new("bench", i as u64 + 1, 1_700_000_000_000_000_000, k.clone()))
        .collect();
    let raw: usize = records.iter().map(prost::Message::encoded_len).sum();
    let calls = records.len();
    println!(
        "{episodes} episodes x {turns} turns = {calls} calls; raw records {:.1} MiB ({:.1} KiB per call)",
        raw as f64 / 1048576.0,
        raw as f64 / calls as f64 / 1024.0
    );
    println!();
    println!("| segments | zstd | stored bytes per call | ratio | encode MB/s |");
    println!("|---|---|---|---|---|");
    // Segments cut at 8 MiB of records, as the sidecar does by default.
    let mut groups: Vec<&[Record]> = Vec::new();
    let mut start = 0;
    let mut size = 0;
    for (i, r) in records.iter().enumerate() {
        size += prost::Message::encoded_len(r);
        if size >= 8 << 20 {
            groups.push(&records[start..=i]);
            start = i + 1;
            size = 0;
        }
    }
    if start < records.len() {
        groups.push(&records[start..]);
    }
    for level in [1, 3, 9, 19] {
        let started = Instant::now();
        let stored: usize = groups
            .iter()
            .map(|g| encode_segment(g.iter(), level).unwrap().0.len())
            .sum();
        let secs = started.elapsed().as_secs_f64();
        println!(
            "| 8 MiB | level {level} | {:.0} B | {:.1}x | {:.0} |",
            stored as f64 / calls as f64,
            raw as f64 / stored as f64,
            raw as f64 / secs / 1e6
        );
    }
    // One segment per episode (cut at episode end), the worst case for cross-call reuse.
    let started = Instant::now();
    let stored: usize = records
        .chunks(turns)
        .map(|g| encode_segment(g.iter(), 3).unwrap().0.len())
        .sum();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "| 1 per episode | level 3 | {:.0} B | {:.1}x | {:.0} |",
        stored as f64 / calls as f64,
        raw as f64 / stored as f64,
        raw as f64 / secs / 1e6
    );

    // Throughput: spool append (+ fsync at seal) + read back + segment build.
    let dir = tempfile::tempdir().unwrap();
    let (mut spool, _) = Spool::open(dir.path(), u64::MAX, 0).unwrap();
    let started = Instant::now();
    let mut appended = 0u64;
    for kind in &kinds {
        spool
            .append("bench", 1_700_000_000_000_000_000, &mut Some(kind.clone()))
            .unwrap();
        appended += 1;
        if spool.open_bytes() >= 8 << 20 {
            let sealed = spool.seal().unwrap().unwrap();
            let back = read_sealed(&sealed.path).unwrap();
            encode_segment(&back, 3).unwrap();
            spool.ack(sealed.first_seq).unwrap();
        }
    }
    if let Some(sealed) = spool.seal().unwrap() {
        let back = read_sealed(&sealed.path).unwrap();
        encode_segment(&back, 3).unwrap();
        spool.ack(sealed.first_seq).unwrap();
    }
    let secs = started.elapsed().as_secs_f64();
    println!();
    println!(
        "spool append + seal (fsync) + read back + zstd-3 segment: {:.0} records/s, {:.0} MB/s (one core)",
        appended as f64 / secs,
        raw as f64 / secs / 1e6
    );
}
