//! [`TerminalWatch`]: whether the last event of a stream has arrived whole, for the
//! proxy, which holds the response's last frame until the call is recorded. Built on
//! [`LineFramer`], keeping only the start of each line.

use super::lines::{LineEnd, LineFramer, Piece, field};

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
/// when an [`SseParser`](super::SseParser) dispatches it. Only whole lines count: a marker inside a longer
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
            assert!(watch.framer.kept() <= WATCH_KEEP);
        }
        assert!(!watch.feed(b"\n\n"));
        assert!(watch.feed(b"data: [DONE]\n\n"));
    }
}
