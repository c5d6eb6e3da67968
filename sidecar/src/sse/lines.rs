//! [`LineFramer`]: an event stream cut into lines, incrementally, with each line's end
//! offset and line end. The parser, the terminal-event watch and the proxy's rewriter
//! all read streams through it.

/// The UTF-8 byte-order mark, dropped from the start of a stream.
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

    /// Bytes of the current line kept so far.
    #[cfg(test)]
    pub(super) fn kept(&self) -> usize {
        self.line.len()
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
pub(super) fn field(line: &[u8]) -> (&[u8], &[u8]) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
