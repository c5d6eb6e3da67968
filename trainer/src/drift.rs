//! Naming the reason two token sequences that should agree do not.
//!
//! Drift is measured in two places: a call's recorded ids against the ids its text
//! gives (prompt through the chat template, completion through the tokenizer), and a
//! call's prompt against the previous call's prompt + completion when merging. Both ask
//! [`classify`], which decodes the two sides and tries the known causes in order (see
//! PROTOCOLS.md, "Why text → tokens drifts"):
//!
//! 1. same text, a control token written as ordinary text on one side →
//!    [`DriftKind::SpecialTokenText`];
//! 2. same text, different ids → [`DriftKind::NonCanonicalBpe`] (e.g. sampled
//!    `[Hello, \n, \n]` against canonical `[Hello, \n\n]`);
//! 3. equal once `<think>…</think>` blocks are removed → [`DriftKind::ThinkingStripped`];
//! 4. equal once whitespace is removed → [`DriftKind::JsonReserialized`] when the first
//!    difference is inside a `{…}`, else [`DriftKind::Whitespace`];
//! 5. anything else → [`DriftKind::Other`] (for merging: the harness changed its
//!    history, or the template rewrote it).

use serde::Serialize;

use crate::model::Model;

/// Why two token sequences differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DriftKind {
    /// The decoded texts are equal but the ids are not: the sampled tokens are not the
    /// tokenizer's canonical encoding of their text.
    NonCanonicalBpe,
    /// The texts are equal but one side holds a special token's text as ordinary
    /// tokens, which re-tokenizes to the control token.
    SpecialTokenText,
    /// The texts differ by `<think>…</think>` blocks (templates drop earlier turns'
    /// reasoning; harnesses drop `reasoning_content`).
    ThinkingStripped,
    /// The texts differ only in whitespace inside JSON (tool-call arguments parsed and
    /// re-serialized, `{"a":1}` → `{"a": 1}`).
    JsonReserialized,
    /// The texts differ only in whitespace outside JSON (templates trimming content).
    Whitespace,
    /// Any other difference.
    Other,
}

impl DriftKind {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            DriftKind::NonCanonicalBpe => "non_canonical_bpe",
            DriftKind::SpecialTokenText => "special_token_text",
            DriftKind::ThinkingStripped => "thinking_stripped",
            DriftKind::JsonReserialized => "json_reserialized",
            DriftKind::Whitespace => "whitespace",
            DriftKind::Other => "other",
        }
    }
}

/// What must hold between the two sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relation {
    /// `actual` must equal `expected`.
    Equal,
    /// `actual` must start with `expected`.
    Prefix,
}

impl Relation {
    fn holds<T: PartialEq>(self, expected: &[T], actual: &[T]) -> bool {
        match self {
            Relation::Equal => expected == actual,
            Relation::Prefix => actual.starts_with(expected),
        }
    }
}

/// `None` when `relation` holds between the ids; otherwise the most specific reason.
pub fn classify(
    model: &Model,
    expected: &[u32],
    actual: &[u32],
    relation: Relation,
) -> Option<DriftKind> {
    if relation.holds(expected, actual) {
        return None;
    }
    let te = model.decode(expected);
    let ta = model.decode(actual);
    Some(classify_text(model, expected, &te, actual, &ta, relation))
}

fn classify_text(
    model: &Model,
    expected: &[u32],
    te: &str,
    actual: &[u32],
    ta: &str,
    relation: Relation,
) -> DriftKind {
    let holds = |e: &str, a: &str| relation.holds(e.as_bytes(), a.as_bytes());
    if holds(te, ta) {
        let hidden = |ids: &[u32], text: &str| {
            let ids = ids.iter().filter(|id| model.is_special(**id)).count();
            special_text_occurrences(model, text) > ids
        };
        return if hidden(expected, te) || hidden(actual, ta) {
            DriftKind::SpecialTokenText
        } else {
            DriftKind::NonCanonicalBpe
        };
    }
    let has_think = |t: &str| t.contains("<think>") || t.contains("</think>");
    let (se, sa) = (strip_think(te), strip_think(ta));
    if (has_think(te) || has_think(ta)) && holds(&se, &sa) {
        return DriftKind::ThinkingStripped;
    }
    if holds(&remove_whitespace(te), &remove_whitespace(ta)) {
        return if first_difference_in_json(te, ta) {
            DriftKind::JsonReserialized
        } else {
            DriftKind::Whitespace
        };
    }
    if holds(&remove_whitespace(&se), &remove_whitespace(&sa)) {
        return DriftKind::ThinkingStripped;
    }
    DriftKind::Other
}

fn special_text_occurrences(model: &Model, text: &str) -> usize {
    model
        .special_texts()
        .iter()
        .map(|t| text.matches(t.as_str()).count())
        .sum()
}

/// Removes every `<think>…</think>` block and the whitespace after it.
pub fn strip_think(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("<think>") {
        let Some(len) = rest[start..].find("</think>") else {
            break;
        };
        out.push_str(&rest[..start]);
        rest = rest[start + len + "</think>".len()..].trim_start();
    }
    out.push_str(rest);
    out
}

fn remove_whitespace(text: &str) -> String {
    text.chars().filter(|c| !c.is_whitespace()).collect()
}

/// Whether the first differing character of the two texts is inside braces.
fn first_difference_in_json(a: &str, b: &str) -> bool {
    let mut depth = 0i64;
    for (ca, cb) in a.chars().zip(b.chars()) {
        if ca != cb {
            return depth > 0;
        }
        match ca {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
    }
    depth > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn think_blocks_and_following_whitespace_are_removed() {
        assert_eq!(
            strip_think("a<think>\nr\n</think>\n\nb<think>x</think>c"),
            "abc"
        );
        assert_eq!(strip_think("no <think> end"), "no <think> end");
    }

    #[test]
    fn json_context_is_detected() {
        assert!(first_difference_in_json(
            r#"<tool_call>{"a":1}"#,
            r#"<tool_call>{"a": 1}"#
        ));
        assert!(!first_difference_in_json("x  y", "x y"));
    }
}
