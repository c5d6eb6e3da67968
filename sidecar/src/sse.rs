//! Incremental server-sent-event framing, following the WHATWG "event stream
//! interpretation" rules.
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
    /// Bytes of the current, not yet terminated line.
    line: Vec<u8>,
    /// The previous chunk ended with `\r`: a `\n` at the start of the next chunk belongs to
    /// the same line end.
    pending_cr: bool,
    /// The line end that ended with the pending `\r` dispatched an event.
    pending_cr_dispatched: bool,
    /// A line has been completed (before that, a leading byte-order mark is dropped).
    seen_line: bool,
    /// Bytes fed so far.
    fed: u64,
    /// Offset just after the blank line that ended the last dispatched event.
    consumed: u64,
    /// `data` lines of the current event, each followed by `\n`.
    data: String,
    /// At least one `data` line was seen for the current event.
    has_data: bool,
    /// The `event` field of the current event.
    event: Option<String>,
    /// The last event id buffer (persists across events).
    last_id: String,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes (a TCP chunk can end anywhere, inside a line, inside a `\r\n` pair, or
    /// inside a UTF-8 character); appends every event completed by them to `out`.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) {
        if chunk.is_empty() {
            return; // keeps a pending `\r` pending
        }
        let base = self.fed;
        self.fed = self.fed.saturating_add(chunk.len() as u64);
        let mut start = 0usize;
        if self.pending_cr {
            self.pending_cr = false;
            if chunk.first() == Some(&b'\n') {
                start = 1;
                if self.pending_cr_dispatched {
                    self.consumed = base.saturating_add(1);
                }
            }
            self.pending_cr_dispatched = false;
        }
        let mut i = start;
        while let Some(pos) = chunk
            .get(i..)
            .and_then(|rest| rest.iter().position(|&b| b == b'\n' || b == b'\r'))
        {
            let end = i + pos;
            if let Some(part) = chunk.get(i..end) {
                self.line.extend_from_slice(part);
            }
            let is_cr = chunk.get(end) == Some(&b'\r');
            let mut next = end + 1;
            let mut cr_at_chunk_end = false;
            if is_cr {
                match chunk.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    None => cr_at_chunk_end = true,
                }
            }
            let dispatched = self.complete_line(out);
            if dispatched {
                self.consumed = base.saturating_add(next as u64);
            }
            if cr_at_chunk_end {
                self.pending_cr = true;
                self.pending_cr_dispatched = dispatched;
            }
            i = next;
        }
        if let Some(rest) = chunk.get(i..) {
            self.line.extend_from_slice(rest);
        }
    }

    /// End of stream: dispatches a final event that was not terminated by a blank line
    /// (lenient; servers sometimes omit the last blank line). The parser is then ready for
    /// a new stream, except that [`SseParser::consumed_through_last_event`] keeps counting.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) {
        if !self.line.is_empty() {
            // A last line without its line end.
            self.complete_line(out);
        }
        if self.dispatch(out) {
            self.consumed = self.fed;
        }
        self.pending_cr = false;
        self.pending_cr_dispatched = false;
        self.seen_line = false;
        self.last_id.clear();
    }

    /// Number of bytes fed so far that belong to events already returned (i.e. the byte
    /// offset just after the blank line ending the last dispatched event). The proxy uses
    /// this to cut the raw stream at event boundaries.
    pub fn consumed_through_last_event(&self) -> u64 {
        self.consumed
    }

    /// Interprets the buffered line; returns true when it dispatched an event.
    fn complete_line(&mut self, out: &mut Vec<SseEvent>) -> bool {
        // The line buffer is lent out and given back, so its allocation is reused.
        let mut line = std::mem::take(&mut self.line);
        let first = !self.seen_line;
        self.seen_line = true;
        let text = match line.strip_prefix(BOM) {
            Some(rest) if first => rest,
            _ => line.as_slice(),
        };
        let dispatched = self.interpret(text, out);
        line.clear();
        self.line = line;
        dispatched
    }

    /// Applies one line (without its line end); returns true when it dispatched an event.
    fn interpret(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> bool {
        if line.is_empty() {
            return self.dispatch(out);
        }
        if line.first() == Some(&b':') {
            return false; // comment
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let field = line.get(..colon).unwrap_or_default();
                let mut value = line.get(colon + 1..).unwrap_or_default();
                if value.first() == Some(&b' ') {
                    value = value.get(1..).unwrap_or_default();
                }
                (field, value)
            }
            None => (line, &[][..]),
        };
        match field {
            b"data" => {
                self.data.push_str(&String::from_utf8_lossy(value));
                self.data.push('\n');
                self.has_data = true;
            }
            b"event" => self.event = Some(String::from_utf8_lossy(value).into_owned()),
            b"id" if !value.contains(&0) => {
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
