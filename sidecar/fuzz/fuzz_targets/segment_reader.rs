//! The segment reader (`dump`, the trainer's ingest) on arbitrary bytes: never a panic,
//! the strict and the skipping reader agree, and a tight record limit skips records
//! instead of failing the segment.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tapline_proto::segment::{Limits, decode_segment, read_segment};

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        // Small enough that a fuzzer-made segment can trip it; the window stays small so
        // one input cannot ask for gigabytes.
        max_record_bytes: 1 << 16,
        max_body_bytes: 16 << 20,
        max_window_log: 20,
    };
    let read = read_segment(data, limits);
    let strict = decode_segment(data, limits);
    match (&read, &strict) {
        (Ok(contents), Ok(records)) => {
            assert!(
                contents.skipped.is_empty(),
                "strict read passed over skipped records"
            );
            assert_eq!(&contents.records, records);
        }
        (Ok(contents), Err(_)) => {
            assert!(
                !contents.skipped.is_empty(),
                "strict read failed a segment the reader read whole"
            );
        }
        (Err(_), Ok(_)) => panic!("strict read accepted a segment the reader refused"),
        (Err(_), Err(_)) => {}
    }
    if let Ok(contents) = read {
        for skipped in &contents.skipped {
            assert!(
                skipped.bytes > limits.max_record_bytes as u64,
                "{skipped:?}"
            );
        }
    }
});
