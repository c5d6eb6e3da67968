//! Incremental server-sent-event framing, following the WHATWG "event stream
//! interpretation" rules.
//!
//! This is the one place that frames SSE bytes. [`LineFramer`] (in `lines.rs`) splits
//! a stream into lines; everything that reads a stream is built on it:
//! - [`SseParser`]: the events with their fields (the rebuild of a response);
//! - [`TerminalWatch`] (in `terminal.rs`): whether a stream's last event has arrived
//!   whole (the proxy holds the response's last frame until the call is recorded);
//! - the proxy's rewriter of token-fidelity streams, which cuts the stream after the
//!   blank line that ends each event.
//!
//! Bytes may arrive in chunks that end anywhere: inside a line, between the `\r` and the
//! `\n` of a line end, or inside a UTF-8 character. Lines are buffered as bytes and only
//! decoded (lossily) once complete, so split characters are never mangled.
//!
//! Deviations from the browser algorithm, on purpose:
//! - An event is dispatched when it had at least one `data` line *or* an `event` line
//!   (browsers drop events without data; a named event without data is still worth
//!   recording).
//! - [`SseParser::finish`] dispatches a final event that was not terminated by a blank
//!   line (servers sometimes omit it).
//! - The event name is `None` when no `event` field was given (browsers say `message`).

mod lines;
mod terminal;

pub use lines::{Line, LineEnd, LineFramer, Piece};
pub use terminal::{Terminal, TerminalWatch};

use lines::field;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event` field, if one was given.
    pub event: Option<String>,
    /// The `data` lines joined with `\n`.
    pub data: String,
    /// The last event id (the `id` field persists across events, as the spec says), if one
    /// was set and is not empty.
    pub id: Option<String>,
}

/// Incremental parser; feed it chunks with [`SseParser::feed`], then call
/// [`SseParser::finish`] at the end of the stream.
#[derive(Debug, Default)]
pub struct SseParser {
    framer: LineFramer,
    fields: Fields,
}

/// The event being assembled and what was dispatched so far.
#[derive(Debug, Default)]
struct Fields {
    /// Offset just after the blank line that ended the last dispatched event.
    consumed: u64,
    /// The line completed last dispatched an event (its line end may still grow by a
    /// late `\n`).
    last_dispatched: bool,
    /// `data` lines of the current event, each followed by `\n`.
    data: String,
    /// At least one `data` line was seen for the current event.
    has_data: bool,
    /// The `event` field of the current event.
    event: Option<String>,
    /// The last event id buffer (persists across events).
    last_id: String,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes (a TCP chunk can end anywhere, inside a line, inside a `\r\n` pair, or
    /// inside a UTF-8 character); appends every event completed by them to `out`.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) {
        let fields = &mut self.fields;
        self.framer.feed(chunk, |piece| fields.take(piece, out));
    }

    /// End of stream: dispatches a final event that was not terminated by a blank line
    /// (lenient; servers sometimes omit the last blank line). The parser is then ready for
    /// a new stream, except that [`SseParser::consumed_through_last_event`] keeps counting.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) {
        let fields = &mut self.fields;
        self.framer.finish(|piece| fields.take(piece, out));
        if self.fields.dispatch(out) {
            self.fields.consumed = self.framer.fed();
        }
        self.fields.last_dispatched = false;
        self.fields.last_id.clear();
    }

    /// Number of bytes fed so far that belong to events already returned (i.e. the byte
    /// offset just after the blank line ending the last dispatched event), for callers
    /// that cut the raw stream at event boundaries.
    pub fn consumed_through_last_event(&self) -> u64 {
        self.fields.consumed
    }
}

impl Fields {
    /// Takes what the framer found.
    fn take(&mut self, piece: Piece<'_>, out: &mut Vec<SseEvent>) {
        match piece {
            Piece::Line(line) => {
                let dispatched = self.interpret(line.text, out);
                if dispatched {
                    self.consumed = line.end;
                }
                self.last_dispatched = dispatched;
            }
            Piece::LateLf { end } => {
                if self.last_dispatched {
                    self.consumed = end;
                }
            }
        }
    }

    /// Applies one line (without its line end); returns true when it dispatched an event.
    fn interpret(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> bool {
        if line.is_empty() {
            return self.dispatch(out);
        }
        if line.first() == Some(&b':') {
            return false; // comment
        }
        match field(line) {
            (b"data", value) => {
                self.data.push_str(&String::from_utf8_lossy(value));
                self.data.push('\n');
                self.has_data = true;
            }
            (b"event", value) => self.event = Some(String::from_utf8_lossy(value).into_owned()),
            (b"id", value) if !value.contains(&0) => {
                self.last_id = String::from_utf8_lossy(value).into_owned();
            }
            _ => {} // `retry` and unknown fields are ignored
        }
        false
    }

    /// Dispatches the current event if it has data or a name; resets the event buffers.
    fn dispatch(&mut self, out: &mut Vec<SseEvent>) -> bool {
        let has_data = std::mem::take(&mut self.has_data);
        let event = self.event.take().filter(|e| !e.is_empty());
        let mut data = std::mem::take(&mut self.data);
        if !has_data && event.is_none() {
            return false;
        }
        if data.ends_with('\n') {
            data.pop();
        }
        let id = (!self.last_id.is_empty()).then(|| self.last_id.clone());
        out.push(SseEvent { event, data, id });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_whole(input: &[u8]) -> (Vec<SseEvent>, u64) {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        p.feed(input, &mut out);
        p.finish(&mut out);
        (out, p.consumed_through_last_event())
    }

    fn ev(event: Option<&str>, data: &str) -> SseEvent {
        SseEvent {
            event: event.map(str::to_owned),
            data: data.to_owned(),
            id: None,
        }
    }

    const STREAM: &str = ": keep-alive\n\
        event: message_start\n\
        data: {\"a\":\"h\u{e9}llo \u{1F600}\"}\n\
        \n\
        data: line1\n\
        data:line2\n\
        data:  two spaces\n\
        \n\
        : comment between\n\
        event: ping\n\
        \n\
        data: [DONE]\n\
        \n";

    fn expected() -> Vec<SseEvent> {
        vec![
            ev(Some("message_start"), "{\"a\":\"h\u{e9}llo \u{1F600}\"}"),
            ev(None, "line1\nline2\n two spaces"),
            ev(Some("ping"), ""),
            ev(None, "[DONE]"),
        ]
    }

    #[test]
    fn whole_stream() {
        let (events, consumed) = parse_whole(STREAM.as_bytes());
        assert_eq!(events, expected());
        assert_eq!(consumed, STREAM.len() as u64);
    }

    fn with_endings(ending: &str) -> String {
        STREAM.replace('\n', ending)
    }

    #[test]
    fn all_line_endings() {
        for ending in ["\n", "\r\n", "\r"] {
            let s = with_endings(ending);
            let (events, consumed) = parse_whole(s.as_bytes());
            assert_eq!(events, expected(), "ending {ending:?}");
            assert_eq!(consumed, s.len() as u64, "ending {ending:?}");
        }
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        for ending in ["\n", "\r\n", "\r"] {
            let s = with_endings(ending);
            let bytes = s.as_bytes();
            for k in 0..=bytes.len() {
                let mut p = SseParser::new();
                let mut out = Vec::new();
                p.feed(&bytes[..k], &mut out);
                p.feed(&bytes[k..], &mut out);
                assert_eq!(p.consumed_through_last_event(), bytes.len() as u64);
                p.finish(&mut out);
                assert_eq!(out, expected(), "ending {ending:?} split {k}");
            }
        }
    }

    #[test]
    fn byte_by_byte_with_mixed_endings() {
        let s = "data: a\r\ndata: b\r\rdata: c\n\nevent: x\rdata: \u{4e2d}\u{6587}\r\n\r\n";
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for b in s.as_bytes() {
            p.feed(std::slice::from_ref(b), &mut out);
        }
        p.finish(&mut out);
        assert_eq!(
            out,
            vec![
                ev(None, "a\nb"),
                ev(None, "c"),
                ev(Some("x"), "\u{4e2d}\u{6587}")
            ]
        );
        assert_eq!(p.consumed_through_last_event(), s.len() as u64);
    }

    #[test]
    fn consumed_stops_at_last_dispatched_event() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        p.feed(b"data: one\n\ndata: tw", &mut out);
        assert_eq!(out, vec![ev(None, "one")]);
        assert_eq!(p.consumed_through_last_event(), 11);
        p.feed(b"o\n", &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(p.consumed_through_last_event(), 11);
        p.feed(b"\n: trailing comment\n\n", &mut out);
        assert_eq!(out, vec![ev(None, "one"), ev(None, "two")]);
        assert_eq!(p.consumed_through_last_event(), 22);
    }

    #[test]
    fn cr_at_chunk_end_then_lf() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        p.feed(b"data: x\r\n\r", &mut out);
        assert_eq!(out, vec![ev(None, "x")]);
        assert_eq!(p.consumed_through_last_event(), 10);
        p.feed(b"\ndata: y\r\n\r\n", &mut out);
        assert_eq!(p.consumed_through_last_event(), 22);
        assert_eq!(out, vec![ev(None, "x"), ev(None, "y")]);
    }

    #[test]
    fn empty_chunk_between_cr_and_lf() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for chunk in [
            &b"data: a\r"[..],
            b"",
            b"\ndata: b\r",
            b"",
            b"\n\r",
            b"",
            b"\n",
        ] {
            p.feed(chunk, &mut out);
        }
        assert_eq!(out, vec![ev(None, "a\nb")]);
        assert_eq!(p.consumed_through_last_event(), 20);
    }

    #[test]
    fn missing_final_blank_line() {
        let (events, consumed) = parse_whole(b"data: a\n\ndata: b\n");
        assert_eq!(events, vec![ev(None, "a"), ev(None, "b")]);
        assert_eq!(consumed, 17);
        let (events, _) = parse_whole(b"event: e\ndata: {\"x\":1}");
        assert_eq!(events, vec![ev(Some("e"), "{\"x\":1}")]);
    }

    #[test]
    fn comments_and_empty_events_are_not_dispatched() {
        let (events, consumed) = parse_whole(b": hi\n\n\n\nretry: 10\n\nfoo: bar\n\n");
        assert!(events.is_empty());
        assert_eq!(consumed, 0);
    }

    #[test]
    fn empty_data_line_is_dispatched() {
        let (events, _) = parse_whole(b"data\n\ndata:\ndata:\n\n");
        assert_eq!(events, vec![ev(None, ""), ev(None, "\n")]);
    }

    #[test]
    fn ids_persist_and_bom_is_dropped() {
        let (events, _) = parse_whole(b"\xEF\xBB\xBFid: 7\ndata: a\n\ndata: b\n\nid\ndata: c\n\n");
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].data, "a");
        assert_eq!(events[0].id.as_deref(), Some("7"));
        assert_eq!(events[1].id.as_deref(), Some("7"));
        assert_eq!(events[2].id, None);
    }

    #[test]
    fn split_utf8_and_invalid_bytes() {
        let s = "data: \u{1F600}\n\n".as_bytes();
        for k in 0..=s.len() {
            let mut p = SseParser::new();
            let mut out = Vec::new();
            p.feed(&s[..k], &mut out);
            p.feed(&s[k..], &mut out);
            p.finish(&mut out);
            assert_eq!(out, vec![ev(None, "\u{1F600}")]);
        }
        let (events, _) = parse_whole(b"data: \xff\xfe\n\n");
        assert_eq!(events, vec![ev(None, "\u{FFFD}\u{FFFD}")]);
    }
}
