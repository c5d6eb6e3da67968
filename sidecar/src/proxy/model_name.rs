//! Byte-exact model renaming for `--policy`: the request's top-level `model` becomes the
//! served name of the followed version ([`set_model`]), and the served name in the
//! response — JSON body or any stream event, wherever a JSON string equals it — becomes
//! the harness's own model name again ([`restore_model`]). Every other byte is left as it
//! was.

use std::ops::Range;

use bytes::{Bytes, BytesMut};

/// Skips whitespace from `i`.
fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// The end (exclusive) of the JSON string starting at `i` (a `"`), if it is closed.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
    None
}

/// The end (exclusive) of the JSON value starting at `i`, found by its brackets and
/// strings (the value is not checked; the body was parsed as JSON before).
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            Some(j)
        }
    }
}

/// The byte range (quotes included) of the string value of the top-level member `key`
/// of a JSON object, the last one when the key repeats (as JSON parsers read it).
pub fn top_level_string(body: &[u8], key: &str) -> Option<Range<usize>> {
    let mut i = ws(body, 0);
    if body.get(i) != Some(&b'{') {
        return None;
    }
    i = ws(body, i + 1);
    let mut found = None;
    while body.get(i) == Some(&b'"') {
        let key_end = string_end(body, i)?;
        let name: String = serde_json::from_slice(&body[i..key_end]).ok()?;
        i = ws(body, key_end);
        if body.get(i) != Some(&b':') {
            return None;
        }
        let start = ws(body, i + 1);
        let end = value_end(body, start)?;
        if name == key && body.get(start) == Some(&b'"') {
            found = Some(start..end);
        } else if name == key {
            found = None;
        }
        i = ws(body, end);
        match body.get(i) {
            Some(b',') => i = ws(body, i + 1),
            Some(b'}') => return found,
            _ => return None,
        }
    }
    if body.get(i) == Some(&b'}') {
        found
    } else {
        None
    }
}

/// The request body with its top-level `model` set to `served`, if the body has a
/// top-level string `model`.
pub fn set_model(body: &[u8], served: &str) -> Option<Bytes> {
    let span = top_level_string(body, "model")?;
    let value = serde_json::to_vec(served).ok()?;
    let mut out = BytesMut::with_capacity(body.len() + value.len());
    out.extend_from_slice(&body[..span.start]);
    out.extend_from_slice(&value);
    out.extend_from_slice(&body[span.end..]);
    Some(out.freeze())
}

/// Replaces every JSON string token equal to `served` in `text` (a JSON document or SSE
/// events holding JSON) by `alias` (JSON-encoded here). A `"` preceded by an odd number
/// of backslashes is inside a string, so text that merely mentions the name is kept.
/// Returns `None` when nothing was replaced.
pub fn restore_model(text: &[u8], served: &str, alias: &str) -> Option<Bytes> {
    let needle = format!("\"{served}\"");
    let needle = needle.as_bytes();
    let alias = serde_json::to_vec(alias).ok()?;
    let finder = memchr::memmem::Finder::new(needle);
    let mut out: Option<BytesMut> = None;
    let mut copied = 0;
    for at in finder.find_iter(text) {
        let backslashes = text[..at].iter().rev().take_while(|b| **b == b'\\').count();
        if backslashes % 2 == 1 {
            continue;
        }
        let o = out.get_or_insert_with(|| BytesMut::with_capacity(text.len()));
        o.extend_from_slice(&text[copied..at]);
        o.extend_from_slice(&alias);
        copied = at + needle.len();
    }
    let mut out = out?;
    out.extend_from_slice(&text[copied..]);
    Some(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_top_level_model_is_found_and_replaced_byte_exactly() {
        let body =
            br#" { "messages": [{"role":"user","content":"say \"model\": x","model":"inner"}],
            "model" : "policy", "stream": true, "n": {"model": "deep"} } "#;
        let out = set_model(body, "coder@v3").unwrap();
        let expected = String::from_utf8_lossy(body)
            .replace(r#""model" : "policy""#, r#""model" : "coder@v3""#);
        assert_eq!(String::from_utf8_lossy(&out), expected);
        // Escapes in keys and values, a repeated key (the last one counts), no model.
        assert_eq!(
            &set_model(br#"{"mod\u0065l":"a","model":"b"}"#, "s").unwrap()[..],
            br#"{"mod\u0065l":"a","model":"s"}"#
        );
        assert!(set_model(br#"{"messages":[]}"#, "s").is_none());
        assert!(set_model(br#"{"model":7}"#, "s").is_none());
        assert!(set_model(br#"["model","x"]"#, "s").is_none());
        assert!(set_model(br#"{"model":"x""#, "s").is_none());
    }

    #[test]
    fn the_served_name_is_restored_only_where_it_is_a_string_token() {
        let served = "coder@v3";
        let text = concat!(
            "data: {\"model\":\"coder@v3\",\"choices\":[{\"delta\":{\"content\":\"I am \\\"coder@v3\\\" and coder@v3\"}}]}\n\n",
            "event: message_start\ndata: {\"message\":{\"model\": \"coder@v3\"}}\n\n",
            "data: {\"path\":\"C:\\\\\",\"model\":\"coder@v3\"}\n\n",
        );
        let out = restore_model(text.as_bytes(), served, "policy").unwrap();
        assert_eq!(
            String::from_utf8(out.to_vec()).unwrap(),
            concat!(
                "data: {\"model\":\"policy\",\"choices\":[{\"delta\":{\"content\":\"I am \\\"coder@v3\\\" and coder@v3\"}}]}\n\n",
                "event: message_start\ndata: {\"message\":{\"model\": \"policy\"}}\n\n",
                "data: {\"path\":\"C:\\\\\",\"model\":\"policy\"}\n\n",
            )
        );
        assert!(restore_model(b"{\"model\":\"coder@v31\"}", served, "policy").is_none());
        // An alias that needs escaping is written as JSON.
        assert_eq!(
            &restore_model(b"{\"model\":\"coder@v3\"}", served, "a\"b").unwrap()[..],
            br#"{"model":"a\"b"}"#
        );
    }
}
