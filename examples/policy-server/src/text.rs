//! The completion's text as it grows: given the decode of every visible token so far,
//! [`TextTracker::step`] says what may be sent now and whether a stop string ended the
//! generation.
//!
//! Text that may still change is held back: a trailing U+FFFD (the decoder's stand-in
//! for an incomplete UTF-8 sequence, which the next byte-level token may complete) and,
//! when there are stop strings, the last `longest stop - 1` bytes (they may be the start
//! of a stop string, which must never be sent). So the concatenated deltas of a stream
//! equal the content of the same generation answered whole. Pure.

/// What one step produced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Delta {
    /// Text to send now (may be empty).
    pub text: String,
    /// The stop string that ended the generation, if one did.
    pub stop: Option<String>,
}

/// Tracks the sent text of one generation.
#[derive(Debug, Clone, Default)]
pub struct TextTracker {
    stop: Vec<String>,
    hold: usize,
    sent: String,
    final_text: Option<String>,
}

impl TextTracker {
    /// A tracker that ends the text at the first of `stop`.
    pub fn new(stop: Vec<String>) -> Self {
        let hold = stop.iter().map(String::len).max().unwrap_or(1).max(1) - 1;
        TextTracker {
            stop,
            hold,
            sent: String::new(),
            final_text: None,
        }
    }

    /// Takes the decode of all visible tokens so far; `last` when no token will follow.
    /// After a step that returned a stop string, or a `last` step, the text is final.
    pub fn step(&mut self, full: &str, last: bool) -> Delta {
        if self.final_text.is_some() {
            return Delta::default();
        }
        let found = self
            .stop
            .iter()
            .filter_map(|s| full.find(s.as_str()).map(|at| (at, s.clone())))
            .min_by_key(|(at, _)| *at);
        if let Some((at, s)) = found {
            let text = self.finish(&full[..at]);
            return Delta {
                text,
                stop: Some(s),
            };
        }
        if last {
            return Delta {
                text: self.finish(full),
                stop: None,
            };
        }
        let stable = full.trim_end_matches('\u{FFFD}');
        let mut end = stable.len().saturating_sub(self.hold);
        while !stable.is_char_boundary(end) {
            end -= 1;
        }
        let stable = &stable[..end];
        match stable.strip_prefix(self.sent.as_str()) {
            Some(new) if !new.is_empty() => {
                self.sent.push_str(new);
                Delta {
                    text: new.to_owned(),
                    stop: None,
                }
            }
            _ => Delta::default(),
        }
    }

    /// Fixes the final text and returns what of it was not sent yet. Should the decode
    /// have changed text already sent (tokenizers do not do that for byte-level BPE), the
    /// part after the common prefix is sent.
    fn finish(&mut self, text: &str) -> String {
        let rest = match text.strip_prefix(self.sent.as_str()) {
            Some(rest) => rest.to_owned(),
            None => {
                let common = self
                    .sent
                    .char_indices()
                    .zip(text.chars())
                    .find(|((_, a), b)| a != b)
                    .map_or(self.sent.len().min(text.len()), |((i, _), _)| i);
                text.get(common..).unwrap_or_default().to_owned()
            }
        };
        self.sent.push_str(&rest);
        self.final_text = Some(text.to_owned());
        rest
    }

    /// The final text (the content of the answer), once the generation ended.
    pub fn final_text(&self) -> Option<&str> {
        self.final_text.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds successive decodes; returns the deltas and the stop string.
    fn run(stop: &[&str], decodes: &[&str]) -> (Vec<String>, Option<String>, String) {
        let mut t = TextTracker::new(stop.iter().map(|s| s.to_string()).collect());
        let mut deltas = Vec::new();
        let mut stopped = None;
        for (i, d) in decodes.iter().enumerate() {
            let delta = t.step(d, i + 1 == decodes.len());
            deltas.push(delta.text);
            if delta.stop.is_some() {
                stopped = delta.stop;
                break;
            }
        }
        (deltas, stopped, t.final_text().unwrap().to_owned())
    }

    #[test]
    fn incomplete_utf8_is_held_back() {
        let (deltas, stop, text) = run(&[], &["a", "a\u{FFFD}", "a\u{FFFD}\u{FFFD}", "aé", "aéb"]);
        assert_eq!(deltas, ["a", "", "", "é", "b"]);
        assert_eq!((stop, text.as_str()), (None, "aéb"));
    }

    #[test]
    fn a_trailing_replacement_character_is_sent_at_the_end() {
        let (deltas, _, text) = run(&[], &["a", "a\u{FFFD}"]);
        assert_eq!(deltas.concat(), text);
        assert_eq!(text, "a\u{FFFD}");
    }

    #[test]
    fn stop_strings_are_cut_and_never_sent() {
        let (deltas, stop, text) = run(
            &["END", "x"],
            &["Hel", "Hello E", "Hello EN", "Hello ENDING", "never"],
        );
        assert_eq!(stop.as_deref(), Some("END"));
        assert_eq!(text, "Hello ");
        assert_eq!(deltas, ["H", "ello", " ", ""]);
        assert_eq!(deltas.concat(), text);
        // The earliest stop string wins.
        let (_, stop, text) = run(&["END", "lo"], &["Hello END"]);
        assert_eq!((stop.as_deref(), text.as_str()), (Some("lo"), "Hel"));
    }

    #[test]
    fn held_back_text_is_flushed_at_the_end() {
        let (deltas, stop, text) = run(&["STOP"], &["abcdef", "abcdefS"]);
        assert_eq!(deltas, ["abc", "defS"]);
        assert_eq!((stop, text.as_str()), (None, "abcdefS"));
    }

    #[test]
    fn a_decode_that_rewrites_sent_text_does_not_repeat_it() {
        let (deltas, _, text) = run(&[], &["ab", "ac"]);
        assert_eq!(deltas, ["ab", "c"]);
        assert_eq!(text, "ac");
    }
}
