//! Round-trip, corruption and truncation tests of the segment format, each run on both
//! format versions: 1 (what tapline 0.1 wrote, still read) and 2 (written now).

use proptest::prelude::*;
use prost::Message as _;
use tapline_proto::segment::{
    self, Limits, SegmentError, SegmentReader, SkippedRecord, decode_segment,
    encode_segment_version, read_segment,
};
use tapline_proto::{
    Api, Completion, EndStatus, EpisodeEvent, EpisodeEventKind, LlmCall, Outcome, Record,
    RecordKind, Reward, ToolCall, Usage,
};

/// Every format version the reader reads.
const VERSIONS: [u8; 2] = [1, 2];

/// `encode_segment` in format `version`.
fn encode_segment<'a>(
    records: impl IntoIterator<Item = &'a Record>,
    level: i32,
    version: u8,
) -> Result<(Vec<u8>, segment::SegmentSummary), SegmentError> {
    encode_segment_version(records, level, version)
}

fn call(i: u64, body_len: usize) -> Record {
    let body: Vec<u8> = (0..body_len).map(|j| (j as u64 * 31 + i) as u8).collect();
    Record::new(
        "sidecar-a",
        i,
        1_700_000_000_000_000_000 + i as i64,
        RecordKind::LlmCall(LlmCall {
            span_id: format!("span-{i}"),
            episode_id: "ep".into(),
            api: Api::ChatCompletions as i32,
            outcome: Outcome::Ok as i32,
            request_body: format!(r#"{{"messages":[{{"role":"user","content":"q{i}"}}]}}"#)
                .into_bytes()
                .into(),
            response_body: body.into(),
            completions: vec![Completion {
                text: format!("answer {i}"),
                tool_calls: vec![ToolCall {
                    id: "call_1".into(),
                    r#type: "function".into(),
                    name: "f".into(),
                    arguments: "{\"a\": 1}".into(),
                }],
                token_ids: vec![1, 2, 3],
                logprobs: vec![-0.5, -0.25, -1.0],
                ..Default::default()
            }],
            usage: Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 3,
                ..Default::default()
            }),
            ..Default::default()
        }),
    )
}

fn sample_records() -> Vec<Record> {
    let mut records: Vec<Record> = (1..=4).map(|i| call(i, 40)).collect();
    records.push(Record::new(
        "sidecar-a",
        5,
        7,
        RecordKind::Reward(Reward {
            reward_id: "r".into(),
            episode_id: "ep".into(),
            value: 1.5,
            ..Default::default()
        }),
    ));
    records.push(Record::new(
        "sidecar-a",
        6,
        8,
        RecordKind::EpisodeEvent(EpisodeEvent {
            event_id: "e".into(),
            episode_id: "ep".into(),
            kind: EpisodeEventKind::End as i32,
            status: EndStatus::Succeeded as i32,
            ..Default::default()
        }),
    ));
    records
}

#[test]
fn round_trips_and_reports_summary() {
    let records = sample_records();
    for version in VERSIONS {
        let (bytes, summary) = encode_segment(&records, segment::DEFAULT_LEVEL, version).unwrap();
        assert_eq!(summary.records, records.len() as u64);
        assert_eq!(summary.object_bytes, bytes.len() as u64);
        let magic_at = if version == 1 { 0 } else { 8 };
        assert_eq!(&bytes[magic_at..magic_at + 4], b"TLSG");
        assert_eq!(bytes[magic_at + 4], version);
        assert_eq!(&bytes[bytes.len() - 4..], b"GSLT");
        assert_eq!(decode_segment(&bytes, Limits::default()).unwrap(), records);
        let reader = SegmentReader::new(&bytes[..], Limits::default()).unwrap();
        assert_eq!(reader.version(), version);
    }
    // What is written by default is the current version.
    let (bytes, _) = segment::encode_segment(&records, 3).unwrap();
    assert_eq!(
        bytes,
        encode_segment(&records, 3, segment::VERSION).unwrap().0
    );
    assert_eq!(segment::VERSION, 2);
}

/// Version 2 is a zstd stream: its header and trailer are skippable frames, so a plain
/// zstd decoder yields exactly the length-delimited records, and nothing else.
#[test]
fn a_version_2_segment_is_a_zstd_stream_of_the_records() {
    let records = sample_records();
    let (bytes, _) = encode_segment(&records, 3, 2).unwrap();
    assert_eq!(&bytes[..4], &segment::SKIPPABLE_MAGIC.to_le_bytes());
    let body = zstd::stream::decode_all(&bytes[..]).unwrap();
    let mut expected = Vec::new();
    for record in &records {
        record.encode_length_delimited(&mut expected).unwrap();
    }
    assert_eq!(body, expected);
    let mut rest = &body[..];
    let mut decoded = Vec::new();
    while !rest.is_empty() {
        decoded.push(Record::decode_length_delimited(&mut rest).unwrap());
    }
    assert_eq!(decoded, records);
    // Version 1 is not one: its header is not a zstd frame.
    let (v1, _) = encode_segment(&records, 3, 1).unwrap();
    assert!(zstd::stream::decode_all(&v1[..]).is_err());
}

#[test]
fn an_empty_segment_round_trips() {
    for version in VERSIONS {
        let (bytes, _) = encode_segment(&[], 3, version).unwrap();
        assert!(
            decode_segment(&bytes, Limits::default())
                .unwrap()
                .is_empty()
        );
    }
}

#[test]
fn unknown_versions_are_not_written() {
    for version in [0, 3] {
        let err = encode_segment(&sample_records(), 3, version).unwrap_err();
        assert!(err.to_string().contains("cannot be written"), "{err}");
    }
}

#[test]
fn streams_bodies_much_larger_than_the_buffers() {
    // 300 records of 50 KiB each: many output chunks, records straddling chunk borders.
    let records: Vec<Record> = (1..=300).map(|i| call(i, 50_000)).collect();
    for version in VERSIONS {
        let (bytes, summary) = encode_segment(&records, 1, version).unwrap();
        assert!(summary.body_bytes > 10 << 20);
        // Feed the reader one byte at a time to exercise every input boundary.
        struct Trickle<'a>(&'a [u8]);
        impl std::io::Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.len().min(buf.len()).min(7);
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut reader = SegmentReader::new(Trickle(&bytes), Limits::default()).unwrap();
        let mut n = 0;
        while let Some(record) = reader.next_record().unwrap() {
            assert_eq!(record, records[n]);
            n += 1;
        }
        assert_eq!(n, records.len());
    }
}

#[test]
fn every_single_byte_corruption_is_detected() {
    for version in VERSIONS {
        let (bytes, _) = encode_segment(&sample_records(), 3, version).unwrap();
        for pos in 0..bytes.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut bad = bytes.clone();
                bad[pos] ^= flip;
                let result = decode_segment(&bad, Limits::default());
                assert!(
                    result.is_err(),
                    "version {version}: corruption at byte {pos} (xor {flip:#x}) was not detected"
                );
            }
        }
    }
}

#[test]
fn every_truncation_is_detected_as_truncation() {
    for version in VERSIONS {
        let (bytes, _) = encode_segment(&sample_records(), 3, version).unwrap();
        for len in 0..bytes.len() {
            match decode_segment(&bytes[..len], Limits::default()) {
                Err(SegmentError::Truncated { .. }) => {}
                other => panic!(
                    "version {version}: truncation to {len} of {} bytes gave {other:?}",
                    bytes.len()
                ),
            }
        }
    }
}

#[test]
fn wrong_magic_future_version_and_trailing_bytes_are_distinct_errors() {
    let err =
        decode_segment(b"PK\x03\x04 a zip file, not a segment", Limits::default()).unwrap_err();
    assert!(matches!(err, SegmentError::WrongMagic { .. }), "{err}");
    assert!(err.to_string().contains("not a tapline segment"));
    // A zstd stream that is not a segment: a plain frame, and another tool's skippable frame.
    let plain = zstd::stream::encode_all(&b"hello"[..], 3).unwrap();
    let err = decode_segment(&plain, Limits::default()).unwrap_err();
    assert!(matches!(err, SegmentError::WrongMagic { .. }), "{err}");
    let mut other = 0x184D_2A50u32.to_le_bytes().to_vec();
    other.extend(8u32.to_le_bytes());
    other.extend(b"ABCD\x02\0\0\0");
    let err = decode_segment(&other, Limits::default()).unwrap_err();
    assert!(matches!(err, SegmentError::WrongMagic { .. }), "{err}");
    let mut foreign_frame = segment::SKIPPABLE_MAGIC.to_le_bytes().to_vec();
    foreign_frame.extend(8u32.to_le_bytes());
    foreign_frame.extend(b"ABCD\x02\0\0\0");
    let err = decode_segment(&foreign_frame, Limits::default()).unwrap_err();
    assert!(matches!(err, SegmentError::WrongMagic { .. }), "{err}");

    for version in VERSIONS {
        let (bytes, _) = encode_segment(&sample_records(), 3, version).unwrap();
        let version_at = if version == 1 { 4 } else { 12 };
        let mut future = bytes.clone();
        future[version_at] = 9;
        let err = decode_segment(&future, Limits::default()).unwrap_err();
        assert!(
            matches!(
                err,
                SegmentError::FutureVersion {
                    version: 9,
                    supported: 2
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("upgrade"));
        // Each version's header names its own version only.
        let mut swapped = bytes.clone();
        swapped[version_at] = 3 - version;
        let err = decode_segment(&swapped, Limits::default()).unwrap_err();
        assert!(matches!(err, SegmentError::Corrupted { .. }), "{err}");

        let mut longer = bytes.clone();
        longer.push(0);
        let err = decode_segment(&longer, Limits::default()).unwrap_err();
        assert!(matches!(err, SegmentError::Corrupted { .. }), "{err}");
    }
}

#[test]
fn limits_cap_memory() {
    let records: Vec<Record> = (1..=3).map(|i| call(i, 10_000)).collect();
    for version in VERSIONS {
        let (bytes, _) = encode_segment(&records, 3, version).unwrap();
        let small_records = Limits {
            max_record_bytes: 1_000,
            ..Limits::default()
        };
        let err = decode_segment(&bytes, small_records).unwrap_err();
        assert!(matches!(err, SegmentError::LimitExceeded { .. }), "{err}");
        let small_body = Limits {
            max_body_bytes: 15_000,
            ..Limits::default()
        };
        let err = decode_segment(&bytes, small_body).unwrap_err();
        assert!(matches!(err, SegmentError::LimitExceeded { .. }), "{err}");
    }
}

/// Regression: one record over the reader's limit made the whole segment unreadable,
/// and the small calls that shared it were lost with it.
#[test]
fn an_oversized_record_is_skipped_not_its_neighbours() {
    let sizes = [100, 120_000, 200, 90_000, 300];
    let records: Vec<Record> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| call(i as u64 + 1, *n))
        .collect();
    for version in VERSIONS {
        let (bytes, _) = encode_segment(&records, 3, version).unwrap();
        let limits = Limits {
            max_record_bytes: 50_000,
            ..Limits::default()
        };
        let expected_skipped: Vec<SkippedRecord> = [1usize, 3]
            .iter()
            .map(|&i| SkippedRecord {
                index: i as u64,
                bytes: records[i].encoded_len() as u64,
            })
            .collect();
        let contents = read_segment(&bytes, limits).unwrap();
        assert_eq!(
            contents.records,
            vec![records[0].clone(), records[2].clone(), records[4].clone()]
        );
        assert_eq!(contents.skipped, expected_skipped);
        assert!(contents.skipped[0].to_string().contains("record 1 ("));
        // Streaming a few bytes at a time gives the same, holding no skipped record.
        struct Trickle<'a>(&'a [u8]);
        impl std::io::Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.len().min(buf.len()).min(5);
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut reader = SegmentReader::new(Trickle(&bytes), limits).unwrap();
        let mut got = Vec::new();
        while let Some(r) = reader.next_record().unwrap() {
            got.push(r);
        }
        assert_eq!(got, contents.records);
        assert_eq!(reader.skipped(), &expected_skipped[..]);
        assert_eq!(reader.records_read(), 5);
        // The strict decoder still refuses the segment, naming the record.
        let err = decode_segment(&bytes, limits).unwrap_err().to_string();
        assert!(err.contains("record 1 is"), "{err}");
        // Damage inside a skipped record is still caught by the trailer's checks.
        for pos in [segment::HEADER_LEN + 10, bytes.len() / 2] {
            let mut bad = bytes.clone();
            bad[pos] ^= 0x40;
            assert!(read_segment(&bad, limits).is_err(), "flip at {pos}");
        }
    }
}

#[test]
fn a_reader_stops_after_its_first_error() {
    for version in VERSIONS {
        let (bytes, _) = encode_segment(&sample_records(), 3, version).unwrap();
        let cut = &bytes[..bytes.len() - 3];
        let mut reader = SegmentReader::new(cut, Limits::default()).unwrap();
        let mut result = reader.next_record();
        while let Ok(Some(_)) = result {
            result = reader.next_record();
        }
        assert!(matches!(result, Err(SegmentError::Truncated { .. })));
        assert!(matches!(reader.next_record(), Ok(None)));
    }
}

fn arb_record() -> impl Strategy<Value = Record> {
    let call = (
        "[a-z0-9-]{0,12}",
        proptest::collection::vec(any::<u8>(), 0..300),
        proptest::collection::vec(any::<u8>(), 0..300),
        proptest::collection::vec(any::<u32>(), 0..20),
        proptest::collection::vec(-50.0f64..0.0, 0..20),
        any::<bool>(),
        0i32..6,
        proptest::collection::btree_map("[a-z-]{1,8}", ".{0,10}", 0..3),
    )
        .prop_map(|(episode, req, resp, ids, lps, streamed, outcome, tags)| {
            RecordKind::LlmCall(LlmCall {
                span_id: uuid_like(&req),
                episode_id: episode,
                request_body: req.into(),
                response_body: resp.into(),
                prompt_token_ids: ids.clone(),
                completions: vec![Completion {
                    token_ids: ids,
                    logprobs: lps,
                    ..Default::default()
                }],
                streamed,
                outcome,
                tags,
                ..Default::default()
            })
        });
    let reward = (".{0,10}", -1e9f64..1e9, ".{0,8}").prop_map(|(ep, value, name)| {
        RecordKind::Reward(Reward {
            reward_id: "r".into(),
            episode_id: ep,
            value,
            name,
            ..Default::default()
        })
    });
    let event = (
        any::<bool>(),
        0i32..5,
        proptest::collection::btree_map(".{1,5}", ".{0,20}", 0..4),
    )
        .prop_map(|(start, status, metadata)| {
            RecordKind::EpisodeEvent(EpisodeEvent {
                event_id: "e".into(),
                kind: if start {
                    EpisodeEventKind::Start
                } else {
                    EpisodeEventKind::End
                } as i32,
                status,
                metadata,
                ..Default::default()
            })
        });
    (prop_oneof![call, reward, event], any::<u64>(), any::<i64>())
        .prop_map(|(kind, seq, t)| Record::new("s", seq, t, kind))
}

fn uuid_like(seed: &[u8]) -> String {
    format!("{:08x}", crc32c::crc32c(seed))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn any_sequence_of_records_round_trips(records in proptest::collection::vec(arb_record(), 0..40), level in 1i32..10, version in 1u8..=2) {
        let (bytes, summary) = encode_segment(&records, level, version).unwrap();
        prop_assert_eq!(summary.records as usize, records.len());
        prop_assert_eq!(decode_segment(&bytes, Limits::default()).unwrap(), records);
    }

    #[test]
    fn corruption_anywhere_in_random_segments_is_detected(
        records in proptest::collection::vec(arb_record(), 1..10),
        pos_frac in 0.0f64..1.0,
        flip in 1u8..=255,
        version in 1u8..=2,
    ) {
        let (mut bytes, _) = encode_segment(&records, 3, version).unwrap();
        let pos = ((bytes.len() as f64) * pos_frac) as usize % bytes.len();
        bytes[pos] ^= flip;
        prop_assert!(decode_segment(&bytes, Limits::default()).is_err());
        let small = Limits { max_record_bytes: 64, ..Limits::default() };
        prop_assert!(read_segment(&bytes, small).is_err());
    }

    /// Whatever the limit, the reader returns exactly the records within it, in order,
    /// and names every other one.
    #[test]
    fn records_over_the_limit_are_skipped_and_named(
        records in proptest::collection::vec(arb_record(), 0..30),
        limit in 0usize..400,
        version in 1u8..=2,
    ) {
        let (bytes, _) = encode_segment(&records, 3, version).unwrap();
        let contents = read_segment(&bytes, Limits { max_record_bytes: limit, ..Limits::default() }).unwrap();
        let kept: Vec<Record> = records.iter().filter(|r| r.encoded_len() <= limit).cloned().collect();
        let skipped: Vec<SkippedRecord> = records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.encoded_len() > limit)
            .map(|(i, r)| SkippedRecord { index: i as u64, bytes: r.encoded_len() as u64 })
            .collect();
        prop_assert_eq!(contents.records, kept);
        prop_assert_eq!(contents.skipped, skipped);
    }
}
