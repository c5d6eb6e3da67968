//! What keeps every record the sidecar writes readable by its own readers.
//!
//! The segment readers (`dump`, the trainer's ingest) hold at most one record of
//! [`tapline_proto::segment::Limits::max_record_bytes`] (64 MiB) and pass over a larger
//! one. Each body is captured up to the capture cap (32 MiB), so a call with a large
//! request and a large streamed answer, plus its rebuilt completion, can exceed that.
//! [`fit_call`] runs when the segment is built and cuts, in this order, until the record
//! is at most [`MAX_RECORD_BYTES`]:
//!
//! 1. capture warnings beyond [`MAX_WARNINGS`] (one per bad SSE event could otherwise
//!    grow without bound), replaced by one warning that counts them;
//! 2. the raw response body (`response_truncated` is set, `response_body_size` keeps the
//!    full size; the completion rebuilt from it stays whole);
//! 3. the raw request body (`request_truncated`, `request_body_size` likewise);
//! 4. the rebuilt completions' text and reasoning.
//!
//! Decoding a `content-encoding` of a captured body stops at
//! [`crate::rebuild::MAX_DECODED_BYTES`] (128 MiB): the completion is then not rebuilt,
//! and the record says why in its capture warnings (the raw bytes are kept).
//!
//! Every cut adds a capture warning starting with `record_too_large:` that says what was
//! cut, from how many bytes to how many. A cut call is kept for inspection, and the
//! trainer drops it as `capture_truncated`, as it does a call over the capture cap: what
//! is lost is that one call, never the records that share its segment.

use prost::Message as _;
use tapline_proto::LlmCall;

/// Largest record the sidecar writes: the readers' 64 MiB limit less 1 MiB for the
/// record's envelope and length prefix.
pub const MAX_RECORD_BYTES: usize = (64 << 20) - (1 << 20);

/// Capture warnings kept per call; the rest are counted in one more warning.
pub const MAX_WARNINGS: usize = 100;

/// Bytes cut beyond the excess, for the warning a cut adds.
const SLACK: usize = 256;

/// Cuts `call` until its encoding is at most `max_bytes` (see the module doc); returns
/// whether anything was cut.
pub fn fit_call(call: &mut LlmCall, max_bytes: usize) -> bool {
    let mut cut = false;
    if call.capture_warnings.len() > MAX_WARNINGS {
        let dropped = call.capture_warnings.len() - MAX_WARNINGS;
        call.capture_warnings.truncate(MAX_WARNINGS);
        call.capture_warnings
            .push(format!("{dropped} more capture warnings were dropped"));
        cut = true;
    }
    let over = |call: &LlmCall| call.encoded_len().saturating_sub(max_bytes);
    if over(call) == 0 {
        return cut;
    }
    // Each cut takes a little more than the excess, for the warning it adds.
    let excess = over(call) + SLACK;
    if !call.response_body.is_empty() {
        let before = call.response_body.len();
        let keep = before.saturating_sub(excess);
        call.response_body.truncate(keep);
        call.response_truncated = true;
        call.capture_warnings.push(format!(
            "record_too_large: response_body cut from {before} to {keep} bytes"
        ));
        cut = true;
    }
    if over(call) > 0 && !call.request_body.is_empty() {
        let excess = over(call) + SLACK;
        let before = call.request_body.len();
        let keep = before.saturating_sub(excess);
        call.request_body.truncate(keep);
        call.request_truncated = true;
        call.capture_warnings.push(format!(
            "record_too_large: request_body cut from {before} to {keep} bytes"
        ));
        cut = true;
    }
    if over(call) > 0 {
        call.capture_warnings
            .push("record_too_large: completion text cut; the call cannot be trained on".into());
        let mut excess = over(call);
        for completion in &mut call.completions {
            for text in [&mut completion.text, &mut completion.reasoning] {
                if excess == 0 || text.is_empty() {
                    continue;
                }
                let before = text.len();
                let mut keep = before.saturating_sub(excess);
                while !text.is_char_boundary(keep) {
                    keep -= 1;
                }
                text.truncate(keep);
                excess = excess.saturating_sub(before - keep);
            }
        }
        cut = true;
    }
    cut
}

#[cfg(test)]
mod tests {
    use super::*;
    use tapline_proto::Completion;

    fn big_call() -> LlmCall {
        LlmCall {
            span_id: "s".into(),
            request_body: vec![b'q'; 30 << 20].into(),
            response_body: vec![b'r'; 20 << 20].into(),
            completions: vec![Completion {
                text: "a".repeat(20 << 20),
                ..Completion::default()
            }],
            ..LlmCall::default()
        }
    }

    /// Regression: a 30 MB request with a 20 MB streamed answer made a ~73 MB record
    /// that the readers refused.
    #[test]
    fn a_call_over_the_limit_is_cut_to_fit_and_flagged() {
        let mut call = big_call();
        assert!(call.encoded_len() > 64 << 20);
        assert!(fit_call(&mut call, MAX_RECORD_BYTES));
        assert!(call.encoded_len() <= MAX_RECORD_BYTES);
        // The raw response went first: the request and the completion are whole.
        assert!(call.response_truncated && !call.request_truncated);
        assert_eq!(call.request_body.len(), 30 << 20);
        assert_eq!(call.completions[0].text.len(), 20 << 20);
        assert!(
            call.capture_warnings
                .iter()
                .any(|w| w.starts_with("record_too_large: response_body cut from 20971520")),
            "{:?}",
            call.capture_warnings
        );
        // Under a tighter limit the request goes too ...
        let mut call = big_call();
        assert!(fit_call(&mut call, 25 << 20));
        assert!(call.encoded_len() <= 25 << 20);
        assert!(call.response_body.is_empty() && call.request_truncated);
        assert!(call.request_body.len() < 5 << 20 && !call.request_body.is_empty());
        assert_eq!(call.completions[0].text.len(), 20 << 20);
        // ... and then the completion.
        let mut call = big_call();
        assert!(fit_call(&mut call, 15 << 20));
        assert!(call.encoded_len() <= 15 << 20);
        assert!(call.request_body.is_empty());
        assert!(call.completions[0].text.len() < 15 << 20);
        assert!(
            call.capture_warnings
                .iter()
                .any(|w| w.contains("cannot be trained on"))
        );
        // A call within the limit is left alone.
        let mut small = LlmCall {
            request_body: b"{}".to_vec().into(),
            ..LlmCall::default()
        };
        let before = small.clone();
        assert!(!fit_call(&mut small, MAX_RECORD_BYTES));
        assert_eq!(small, before);
    }

    #[test]
    fn capture_warnings_are_capped_and_counted() {
        let mut call = LlmCall {
            capture_warnings: (0..250).map(|i| format!("bad event {i}")).collect(),
            ..LlmCall::default()
        };
        assert!(fit_call(&mut call, MAX_RECORD_BYTES));
        assert_eq!(call.capture_warnings.len(), MAX_WARNINGS + 1);
        assert_eq!(
            call.capture_warnings.last().unwrap(),
            "150 more capture warnings were dropped"
        );
    }

    #[test]
    fn multi_byte_text_is_cut_on_a_character_boundary() {
        let mut call = LlmCall {
            completions: vec![Completion {
                text: "é".repeat(1000),
                ..Completion::default()
            }],
            ..LlmCall::default()
        };
        assert!(fit_call(&mut call, 1001));
        assert!(call.encoded_len() <= 1001);
    }
}
