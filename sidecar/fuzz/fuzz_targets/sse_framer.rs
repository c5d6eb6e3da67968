//! The SSE framer: never a panic, and the events do not depend on where the stream was
//! cut into chunks (the first input byte chooses the cuts).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tapline_sidecar::sse::SseParser;

fuzz_target!(|data: &[u8]| {
    let Some((&step, stream)) = data.split_first() else {
        return;
    };
    let mut whole = SseParser::new();
    let mut expected = Vec::new();
    whole.feed(stream, &mut expected);
    let consumed = whole.consumed_through_last_event();
    assert!(consumed <= stream.len() as u64);
    whole.finish(&mut expected);

    // Chunks of 1..=16 bytes, varying along the stream.
    let mut chunked = SseParser::new();
    let mut got = Vec::new();
    let mut at = 0;
    let mut size = usize::from(step % 16) + 1;
    while at < stream.len() {
        let end = (at + size).min(stream.len());
        chunked.feed(&stream[at..end], &mut got);
        at = end;
        size = (size * 7 + 3) % 16 + 1;
    }
    assert_eq!(chunked.consumed_through_last_event(), consumed);
    chunked.finish(&mut got);
    assert_eq!(got, expected);
});
