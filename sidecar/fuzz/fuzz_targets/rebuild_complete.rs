//! `rebuild::complete` on arbitrary response bytes of each API shape, streamed or not,
//! plain or compressed: never a panic, and the record stays within its limits.
#![no_main]

use std::io::Write;

use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use tapline_proto::{Api, LlmCall, Outcome};
use tapline_sidecar::rebuild::complete;

// Input: [api, flags, status high, status low] then the response body. `api` picks the
// shape; flags bit 0 = streamed, bits 1-2 = as sent / gzip / a claimed encoding the bytes
// do not follow.
fuzz_target!(|data: &[u8]| {
    let Some((&[api, flags, hi, lo], body)) = data.split_first_chunk::<4>() else {
        return;
    };
    let api = [
        Api::ChatCompletions,
        Api::Completions,
        Api::Responses,
        Api::AnthropicMessages,
        Api::Other,
    ][usize::from(api) % 5];
    let mut call = LlmCall {
        api: api as i32,
        streamed: flags & 1 == 1,
        http_status: u32::from(u16::from_be_bytes([hi, lo]) % 600),
        outcome: Outcome::Ok as i32,
        ..Default::default()
    };
    match (flags >> 1) % 4 {
        2 => {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(body).unwrap();
            call.response_body = gz.finish().unwrap().into();
            call.response_headers
                .insert("content-encoding".into(), "gzip".into());
        }
        3 => {
            call.response_body = body.to_vec().into();
            call.response_headers
                .insert("content-encoding".into(), "br".into());
        }
        _ => call.response_body = body.to_vec().into(),
    }
    let completed = complete(&mut call);
    assert_eq!(completed.warned, !call.capture_warnings.is_empty());
    // Then the writer's limits: whatever came in, the record fits (here under a small
    // bound, so the fuzzer reaches the cutting code too).
    let max = 4096;
    tapline_sidecar::limits::fit_call(&mut call, max);
    assert!(call.capture_warnings.len() <= tapline_sidecar::limits::MAX_WARNINGS + 2);
    let size = call.encoded_len();
    // Bodies go first; what is derived from them (ids, log-probs, a few warnings) is
    // smaller than they were, so only a record cut to no bodies at all may stay over.
    assert!(
        size <= max || (call.response_body.is_empty() && call.request_body.is_empty()),
        "{size} bytes after fit_call"
    );
    if completed.body_error {
        assert_ne!(call.outcome(), Outcome::Ok);
    }
});
