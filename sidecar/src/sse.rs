//! Incremental server-sent-event framing, following the WHATWG "event stream
//! interpretation" rules.
//!
//! This is the one place that frames SSE bytes. [`LineFramer`] splits a stream into
//! lines; everything that reads a stream is built on it:
//! - [`SseParser`]: the events with their fields (the rebuild of a response);
//! - [`TerminalWatch`]: whether a stream's last event has arrived whole (the proxy
//!   holds the response's last frame until the call is recorded);
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

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// A complete line of an event stream, as a [`LineFramer`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Line<'a> {
    /// The line without its line end (and, for the first line of a stream, without a
    /// leading byte-order mark); only its first bytes when the framer keeps fewer
    /// ([`LineFramer::keeping`]).
    pub text: &'a [u8],
    /// Length of the whole line, without its line end.
    pub len: usize,
    /// Stream offset just past the line end (the end of the stream for a last line
    /// without one, completed by [`LineFramer::finish`]).
    pub end: u64,
    /// How the line ended.
    pub ending: LineEnd,
}

/// How a line ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineEnd {
    /// `\n`.
    Lf,
    /// `\r\n`, in one chunk.
    CrLf,
    /// `\r` followed by another byte than `\n`.
    Cr,
    /// `\r` at the end of a chunk: `\r\n` if the next chunk starts with `\n` (reported as
    /// [`Piece::LateLf`]), a lone `\r` otherwise.
    CrAtChunkEnd,
    /// None: the last line of a stream, completed by [`LineFramer::finish`].
    Eof,
}

/// What a [`LineFramer`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// A line was completed.
    Line(Line<'a>),
    /// The `\n` of a `\r\n` line end whose `\r` ended the previous chunk: the line reported
    /// last (completed at the `\r`) ends one byte later, at `end`.
    LateLf {
        /// The new end of that line.
        end: u64,
    },
}

/// Splits an event stream into lines, incrementally: a line ends at `\n`, `\r\n` or
/// `\r`, and a `\r\n` split across two chunks is one line end. A line is reported as
/// soon as its end is seen; a `\r` at the end of a chunk ends its line at once, and a
/// `\n` that starts the next chunk is then reported as [`Piece::LateLf`].
#[derive(Debug)]
pub struct LineFramer {
    /// Bytes of the current, not yet terminated line (at most `keep` of them).
    line: Vec<u8>,
    /// Length of the current line so far.
    len: usize,
    /// How many bytes of a line are kept.
    keep: usize,
    /// The previous chunk ended with `\r`: a `\n` at the start of the next chunk belongs to
    /// the same line end.
    pending_cr: bool,
    /// A line has been completed (before that, a leading byte-order mark is dropped).
    seen_line: bool,
    /// Bytes fed so far.
    fed: u64,
}

impl Default for LineFramer {
    fn default() -> Self {
        Self::new()
    }
}

impl LineFramer {
    /// A framer at the start of a stream that reports whole lines.
    pub fn new() -> Self {
        Self::keeping(usize::MAX)
    }

    /// A framer that keeps only the first `keep` bytes of a line (at least 3, the length
    /// of a byte-order mark), for readers that look at line starts only: its memory is
    /// bounded however long a line grows.
    pub fn keeping(keep: usize) -> Self {
        LineFramer {
            line: Vec::new(),
            len: 0,
            keep: keep.max(BOM.len()),
            pending_cr: false,
            seen_line: false,
            fed: 0,
        }
    }

    /// Bytes fed so far.
    pub fn fed(&self) -> u64 {
        self.fed
    }

    /// Feeds bytes (a chunk can end anywhere); hands every line they complete to `each`,
    /// in order.
    pub fn feed(&mut self, chunk: &[u8], mut each: impl FnMut(Piece<'_>)) {
        if chunk.is_empty() {
            return; // keeps a pending `\r` pending
        }
        let base = self.fed;
        self.fed = self.fed.saturating_add(chunk.len() as u64);
        let mut i = 0usize;
        if self.pending_cr {
            self.pending_cr = false;
            if chunk.first() == Some(&b'\n') {
                i = 1;
                each(Piece::LateLf {
                    end: base.saturating_add(1),
                });
            }
        }
        // SIMD search: this runs on every byte of every stream the proxy watches.
        while let Some(pos) = chunk
            .get(i..)
            .and_then(|rest| memchr::memchr2(b'\n', b'\r', rest))
        {
            let end = i + pos;
            let mut next = end + 1;
            let mut ending = LineEnd::Lf;
            if chunk.get(end) == Some(&b'\r') {
                ending = match chunk.get(next) {
                    Some(b'\n') => {
                        next += 1;
                        LineEnd::CrLf
                    }
                    Some(_) => LineEnd::Cr,
                    None => {
                        self.pending_cr = true;
                        LineEnd::CrAtChunkEnd
                    }
                };
            }
            let part = chunk.get(i..end).unwrap_or_default();
            self.complete(part, base.saturating_add(next as u64), ending, &mut each);
            i = next;
        }
        if let Some(rest) = chunk.get(i..) {
            self.buffer(rest);
        }
    }

    /// End of stream: reports a last line that had no line end. The framer is then ready
    /// for a new stream, except that [`LineFramer::fed`] keeps counting.
    pub fn finish(&mut self, mut each: impl FnMut(Piece<'_>)) {
        if self.len > 0 {
            self.complete(&[], self.fed, LineEnd::Eof, &mut each);
        }
        self.pending_cr = false;
        self.seen_line = false;
    }

    /// Adds bytes to the current line (keeping at most `keep`).
    fn buffer(&mut self, bytes: &[u8]) {
        let room = self.keep.saturating_sub(self.line.len()).min(bytes.len());
        self.line
            .extend_from_slice(bytes.get(..room).unwrap_or_default());
        self.len = self.len.saturating_add(bytes.len());
    }

    /// Completes the current line with its last bytes, `part`, and reports it.
    fn complete(
        &mut self,
        part: &[u8],
        end: u64,
        ending: LineEnd,
        each: &mut impl FnMut(Piece<'_>),
    ) {
        // The line buffer is lent out and given back, so its allocation is reused.
        let mut line = std::mem::take(&mut self.line);
        let len = self.len.saturating_add(part.len());
        let text = if self.len == 0 {
            // The whole line is in this chunk: no copy.
            part.get(..self.keep.min(part.len())).unwrap_or_default()
        } else {
            let room = self.keep.saturating_sub(line.len()).min(part.len());
            line.extend_from_slice(part.get(..room).unwrap_or_default());
            line.as_slice()
        };
        let first = !self.seen_line;
        self.seen_line = true;
        let (text, len) = match text.strip_prefix(BOM) {
            Some(rest) if first => (rest, len - BOM.len()),
            _ => (text, len),
        };
        each(Piece::Line(Line {
            text,
            len,
            end,
            ending,
        }));
        line.clear();
        self.line = line;
        self.len = 0;
    }
}

/// A line's field name and value: the name up to the first `:`, the value after it
/// without one leading space (a line without `:` is a name with an empty value; a
/// comment, starting with `:`, has an empty name).
fn field(line: &[u8]) -> (&[u8], &[u8]) {
    match line.iter().position(|&b| b == b':') {
        Some(colon) => {
            let name = line.get(..colon).unwrap_or_default();
            let mut value = line.get(colon + 1..).unwrap_or_default();
            if value.first() == Some(&b' ') {
                value = value.get(1..).unwrap_or_default();
            }
            (name, value)
        }
        None => (line, &[][..]),
    }
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

/// How the last event of a stream is recognised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Terminal {
    /// An event with a `data` line that is this text, give or take surrounding
    /// whitespace (`[DONE]`).
    Data(&'static str),
    /// An event named (its last `event` field) one of these.
    Named(&'static [&'static str]),
}

/// Bytes of a line a [`TerminalWatch`] keeps: more than the longest line it compares.
const WATCH_KEEP: usize = 64;

/// Watches a stream for the end of its last event ([`Terminal`]) without keeping the
/// stream: only the first bytes of each line are looked at.
///
/// The last event has ended once the blank line that closes it has arrived, which is
/// when an [`SseParser`] dispatches it. Only whole lines count: a marker inside a longer
/// line (say, in the text of a `data` line) or in a comment does not. One wait: when that
/// blank line ends in a `\r` at the end of a chunk and the stream's lines end in
/// `\r\n`, the event ends with the next chunk, which brings the `\n`, so that the bytes
/// up to the end of the event are all seen.
#[derive(Debug)]
pub struct TerminalWatch {
    framer: LineFramer,
    terminal: Terminal,
    /// The event being framed is the last one, so far.
    marked: bool,
    /// How the line framed last ended.
    last_end: LineEnd,
    /// The last event's blank line ended in a `\r` at the end of a chunk, after a `\r\n`:
    /// the event ends with the next chunk.
    awaiting_lf: bool,
    /// The last event has ended.
    ended: bool,
}

impl TerminalWatch {
    /// A watch at the start of a stream.
    pub fn new(terminal: Terminal) -> Self {
        TerminalWatch {
            framer: LineFramer::keeping(WATCH_KEEP),
            terminal,
            marked: false,
            last_end: LineEnd::Lf,
            awaiting_lf: false,
            ended: false,
        }
    }

    /// Feeds bytes; returns whether the last event has ended (with these bytes or
    /// before).
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        if self.ended || chunk.is_empty() {
            return self.ended;
        }
        if self.awaiting_lf {
            self.ended = true;
            return true;
        }
        let terminal = self.terminal;
        let TerminalWatch {
            framer,
            marked,
            last_end,
            awaiting_lf,
            ended,
            ..
        } = self;
        framer.feed(chunk, |piece| {
            let line = match piece {
                Piece::Line(line) => line,
                Piece::LateLf { .. } => {
                    *last_end = LineEnd::CrLf;
                    return;
                }
            };
            if *ended || *awaiting_lf {
                return;
            }
            // A `\r` that ended the previous chunk was a line end of its own.
            let before = match *last_end {
                LineEnd::CrAtChunkEnd => LineEnd::Cr,
                other => other,
            };
            *last_end = line.ending;
            if line.len == 0 {
                if *marked {
                    if line.ending == LineEnd::CrAtChunkEnd && before != LineEnd::Cr {
                        *awaiting_lf = true;
                    } else {
                        *ended = true;
                    }
                }
                *marked = false;
                return;
            }
            // A longer line than what is kept is none of the lines compared.
            let whole = line.len == line.text.len();
            match (terminal, field(line.text)) {
                (Terminal::Data(text), (b"data", value)) => {
                    *marked |= whole && value.trim_ascii() == text.as_bytes();
                }
                (Terminal::Named(names), (b"event", value)) => {
                    *marked = whole && names.iter().any(|n| n.as_bytes() == value);
                }
                _ => {}
            }
        });
        self.ended
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

    /// The lines a framer reports for `chunks`, with a late `\n` folded into the line it
    /// ends and a `\r` at a chunk end that proved lone counted as `Cr`.
    fn lines(framer: &mut LineFramer, chunks: &[&[u8]]) -> Vec<(Vec<u8>, usize, u64, LineEnd)> {
        let mut out: Vec<(Vec<u8>, usize, u64, LineEnd)> = Vec::new();
        for chunk in chunks {
            framer.feed(chunk, |piece| match piece {
                Piece::Line(line) => {
                    if let Some(last) = out.last_mut()
                        && last.3 == LineEnd::CrAtChunkEnd
                    {
                        last.3 = LineEnd::Cr;
                    }
                    out.push((line.text.to_vec(), line.len, line.end, line.ending));
                }
                Piece::LateLf { end } => {
                    let last = out.last_mut().expect("a late \\n follows a line");
                    assert_eq!(last.3, LineEnd::CrAtChunkEnd);
                    *last = (last.0.clone(), last.1, end, LineEnd::CrLf);
                }
            });
        }
        out
    }

    #[test]
    fn the_framer_reports_every_line_with_its_end_at_any_split() {
        let s = b"\xEF\xBB\xBFdata: a\r\n\r\nevent: e\rdata: b\n\n: c\r";
        let line = |t: &str, end, ending| (t.as_bytes().to_vec(), t.len(), end, ending);
        let expected = vec![
            line("data: a", 12, LineEnd::CrLf),
            line("", 14, LineEnd::CrLf),
            line("event: e", 23, LineEnd::Cr),
            line("data: b", 31, LineEnd::Lf),
            line("", 32, LineEnd::Lf),
            line(": c", 36, LineEnd::CrAtChunkEnd),
        ];
        assert_eq!(lines(&mut LineFramer::new(), &[s]), expected);
        for k in 0..=s.len() {
            let mut framer = LineFramer::new();
            assert_eq!(
                lines(&mut framer, &[&s[..k], &s[k..]]),
                expected,
                "split {k}"
            );
            assert_eq!(framer.fed(), s.len() as u64);
        }
        let bytes: Vec<&[u8]> = s.chunks(1).collect();
        assert_eq!(lines(&mut LineFramer::new(), &bytes), expected);
    }

    #[test]
    fn a_framer_that_keeps_line_starts_has_bounded_memory() {
        let mut framer = LineFramer::keeping(5);
        let long = vec![b'x'; 1 << 20];
        let mut seen = Vec::new();
        framer.feed(b"data: ", |_| {});
        for piece in long.chunks(1000) {
            framer.feed(piece, |_| {});
            assert!(framer.line.len() <= 5);
        }
        framer.feed(b"\n", |piece| {
            if let Piece::Line(line) = piece {
                seen.push((line.text.to_vec(), line.len));
            }
        });
        assert_eq!(seen, [(b"data:".to_vec(), 6 + (1 << 20))]);
        framer.feed(b"tail", |_| {});
        framer.finish(|piece| {
            if let Piece::Line(line) = piece {
                seen.push((line.text.to_vec(), line.len));
            }
        });
        assert_eq!(seen[1], (b"tail".to_vec(), 4));
    }

    /// Streams whose last event ends `end` bytes in (the rest follows it), and how their
    /// last event is recognised.
    fn terminal_streams() -> Vec<(Terminal, String, usize)> {
        let chat = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"data: [DONE]\\n\\nevent: message_stop\"}}]}\n\n",
            ": data: [DONE]\n\n",
            "data:[DONE] \n\n",
        );
        let anthropic = concat!(
            "event: message_stop\nevent: ping\ndata: {\"type\": \"ping\"}\n\n",
            "event: content_block_delta\ndata: {\"text\":\"event: message_stop\\n\\n\"}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let responses = concat!(
            "event: response.output_text.delta\ndata: {\"delta\":\"x\"}\n\n",
            "event:response.completed\ndata: {\"type\":\"response.completed\"}\n\n",
        );
        let mut out = Vec::new();
        for ending in ["\n", "\r\n", "\r"] {
            for (terminal, stream) in [
                (Terminal::Data("[DONE]"), chat),
                (Terminal::Named(&["message_stop"]), anthropic),
                (
                    Terminal::Named(&["response.completed", "response.failed"]),
                    responses,
                ),
            ] {
                let stream = stream.replace('\n', ending);
                let end = stream.len();
                out.push((terminal, format!("{stream}: after{ending}{ending}"), end));
            }
        }
        out
    }

    #[test]
    fn a_stream_ends_with_the_blank_line_after_its_last_event_at_any_split() {
        for (terminal, stream, end) in terminal_streams() {
            let bytes = stream.as_bytes();
            for k in 0..=bytes.len() {
                let mut watch = TerminalWatch::new(terminal);
                assert_eq!(watch.feed(&bytes[..k]), k >= end, "{stream:?} split {k}");
                assert!(
                    watch.feed(&bytes[k..]) || k == bytes.len(),
                    "{stream:?} split {k}"
                );
            }
            let mut watch = TerminalWatch::new(terminal);
            for (i, b) in bytes.iter().enumerate() {
                assert_eq!(
                    watch.feed(std::slice::from_ref(b)),
                    i + 1 >= end,
                    "{stream:?} byte {i}"
                );
            }
        }
    }

    #[test]
    fn a_crlf_stream_ends_with_the_lf_of_its_last_blank_line() {
        let mut watch = TerminalWatch::new(Terminal::Data("[DONE]"));
        assert!(!watch.feed(b"data: [DONE]\r\n\r"));
        assert!(watch.feed(b"\n"));
        // In a stream of lone `\r`s, the `\r` is the whole line end.
        let mut watch = TerminalWatch::new(Terminal::Data("[DONE]"));
        assert!(watch.feed(b"data: [DONE]\r\r"));
    }

    #[test]
    fn a_stream_without_its_last_event_never_ends_and_memory_stays_bounded() {
        let mut watch = TerminalWatch::new(Terminal::Data("[DONE]"));
        let line = format!("data: [DONE]{}", " ".repeat(100));
        assert!(!watch.feed(line.as_bytes()), "a line too long to compare");
        assert!(!watch.feed(b"\n\n"));
        let long = vec![b'x'; 1 << 20];
        assert!(!watch.feed(b"data: "));
        for piece in long.chunks(4096) {
            assert!(!watch.feed(piece));
            assert!(watch.framer.line.len() <= WATCH_KEEP);
        }
        assert!(!watch.feed(b"\n\n"));
        assert!(watch.feed(b"data: [DONE]\n\n"));
    }
}
