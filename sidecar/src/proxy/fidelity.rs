//! Token fidelity (`--upstream-kind vllm|sglang`): the proxy asks the upstream for
//! token ids and log-probs the harness did not ask for ([`inject`]), and removes them
//! again from the client's copy of the response ([`strip_injected`]; for event streams,
//! event by event, with [`SseRewriter`]), leaving every byte it does not change as it
//! was.

use bytes::{Bytes, BytesMut};
use serde_json::Value;
use tapline_proto::Api;

use crate::config::UpstreamKind;
use crate::sse::{LineFramer, Piece};

/// What the sidecar asked the upstream for on its own, to be removed from the response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Injected {
    /// `return_token_ids` was added: take `prompt_token_ids` and `token_ids` back out.
    pub token_ids: bool,
    /// `logprobs` was added: set `choices[].logprobs` to null.
    pub logprobs: bool,
    /// The upstream sends the id keys as `null` when not asked (vLLM 0.32): they are set
    /// to `null`, not removed, so the harness gets the fields a direct call returns.
    pub ids_null: bool,
}

impl Injected {
    /// Whether anything was added.
    pub(super) fn any(self) -> bool {
        self.token_ids || self.logprobs
    }
}

/// Adds token-id and logprob requests to a request body for vLLM/SGLang upstreams.
/// Returns the new body and what was added, or `None` when nothing was added.
pub fn inject(kind: UpstreamKind, api: Api, body: &[u8]) -> Option<(Bytes, Injected)> {
    if kind == UpstreamKind::Openai || !matches!(api, Api::ChatCompletions | Api::Completions) {
        return None;
    }
    let mut value: Value = serde_json::from_slice(body).ok()?;
    let obj = value.as_object_mut()?;
    let streaming = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let mut injected = Injected::default();
    // SGLang refuses return_token_ids on streamed chat completions.
    let ids_possible = !(kind == UpstreamKind::Sglang && api == Api::ChatCompletions && streaming);
    if ids_possible && !obj.contains_key("return_token_ids") {
        obj.insert("return_token_ids".into(), Value::Bool(true));
        injected.token_ids = true;
        injected.ids_null = kind == UpstreamKind::Vllm;
    }
    let asked_logprobs = match obj.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(_) => true,
    };
    if !asked_logprobs {
        let on = if api == Api::ChatCompletions {
            Value::Bool(true)
        } else {
            Value::from(0)
        };
        obj.insert("logprobs".into(), on);
        injected.logprobs = true;
    }
    if !injected.any() {
        return None;
    }
    let bytes = serde_json::to_vec(&value).ok()?;
    Some((Bytes::from(bytes), injected))
}

/// Removes injected fields from one response JSON object. Returns whether it changed.
pub fn strip_injected(value: &mut Value, injected: Injected) -> bool {
    let Some(obj) = value.as_object_mut() else {
        return false;
    };
    let mut changed = false;
    let take_ids = |obj: &mut serde_json::Map<String, Value>, key: &str| {
        if injected.ids_null {
            match obj.get_mut(key) {
                Some(v) if !v.is_null() => {
                    *v = Value::Null;
                    true
                }
                _ => false,
            }
        } else {
            obj.shift_remove(key).is_some()
        }
    };
    if injected.token_ids {
        changed |= take_ids(obj, "prompt_token_ids");
    }
    if let Some(Value::Array(choices)) = obj.get_mut("choices") {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            if injected.token_ids {
                changed |= take_ids(choice, "token_ids");
                changed |= take_ids(choice, "prompt_token_ids");
            }
            if injected.logprobs
                && let Some(lp) = choice.get_mut("logprobs")
                && !lp.is_null()
            {
                *lp = Value::Null;
                changed = true;
            }
        }
    }
    changed
}

/// Rewrites complete SSE events of a stream, leaving every event it does not change
/// byte for byte as it was.
#[derive(Debug)]
pub(super) struct SseRewriter {
    /// Bytes after the last complete event.
    pending: Vec<u8>,
    /// Finds the blank lines that end events (only line lengths matter: no line is kept).
    framer: LineFramer,
    /// Stream offset of `pending[0]`.
    start: u64,
    /// The line framed last was blank.
    blank: bool,
    injected: Injected,
    restore: Option<ModelRestore>,
}

/// `--policy`: the served name to give back as the harness's model name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ModelRestore {
    /// The name the upstream served the call under (`NAME@vN`).
    pub served: String,
    /// The name the harness asked for.
    pub alias: String,
}

impl ModelRestore {
    /// `bytes` with the served name given back, or `bytes` as they were.
    pub(super) fn apply(&self, bytes: Bytes) -> Bytes {
        super::model_name::restore_model(&bytes, &self.served, &self.alias).unwrap_or(bytes)
    }
}

impl SseRewriter {
    pub(super) fn new(injected: Injected, restore: Option<ModelRestore>) -> Self {
        SseRewriter {
            pending: Vec::new(),
            framer: LineFramer::keeping(0),
            start: 0,
            blank: false,
            injected,
            restore,
        }
    }

    /// Takes a chunk; returns the rewritten complete events it finished (maybe empty):
    /// everything up to the last blank line, so comments (keep-alives) pass at once too.
    pub(super) fn push(&mut self, chunk: &[u8]) -> Bytes {
        self.pending.extend_from_slice(chunk);
        let mut cut = None;
        let blank = &mut self.blank;
        self.framer.feed(chunk, |piece| match piece {
            Piece::Line(line) => {
                *blank = line.len == 0;
                if *blank {
                    cut = Some(line.end);
                }
            }
            Piece::LateLf { end } => {
                if *blank {
                    cut = Some(end);
                }
            }
        });
        let Some(cut) = cut else {
            return Bytes::new();
        };
        let end = usize::try_from(cut.saturating_sub(self.start))
            .map_or(self.pending.len(), |n| n.min(self.pending.len()));
        let rest = self.pending.split_off(end);
        let events = std::mem::replace(&mut self.pending, rest);
        self.start = cut;
        self.rewrite(&events)
    }

    /// Takes the end of the stream: returns what is pending, rewritten.
    pub(super) fn finish(&mut self) -> Bytes {
        let events = std::mem::take(&mut self.pending);
        self.start = self.framer.fed();
        self.rewrite(&events)
    }

    fn rewrite(&self, events: &[u8]) -> Bytes {
        let stripped = if self.injected.any() {
            rewrite_events(events, self.injected)
        } else {
            Bytes::copy_from_slice(events)
        };
        match &self.restore {
            Some(restore) => restore.apply(stripped),
            None => stripped,
        }
    }
}

/// Rewrites the `data:` lines of whole events whose JSON held injected fields.
fn rewrite_events(events: &[u8], injected: Injected) -> Bytes {
    let mut out = BytesMut::with_capacity(events.len());
    for line in events.split_inclusive(|b| *b == b'\n') {
        let body_len = line.len()
            - line
                .iter()
                .rev()
                .take_while(|b| matches!(b, b'\n' | b'\r'))
                .count();
        let (text, ending) = line.split_at(body_len);
        let rewritten = text
            .strip_prefix(b"data:")
            .map(|p| p.strip_prefix(b" ").unwrap_or(p))
            .filter(|payload| payload.first() == Some(&b'{'))
            .and_then(|payload| serde_json::from_slice::<Value>(payload).ok())
            .and_then(|mut v| strip_injected(&mut v, injected).then_some(v))
            .and_then(|v| serde_json::to_vec(&v).ok());
        match rewritten {
            Some(json) => {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&json);
                out.extend_from_slice(ending);
            }
            None => out.extend_from_slice(line),
        }
    }
    out.freeze()
}

/// How the response body is changed on its way to the client.
#[derive(Debug)]
pub(super) enum Rewrite {
    /// Unchanged.
    None,
    /// SSE stream: injected fields removed event by event.
    Sse(SseRewriter),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn injection_respects_what_the_harness_asked() {
        let body = br#"{"model":"m","messages":[],"logprobs":true,"top_logprobs":2}"#;
        let (new, inj) = inject(UpstreamKind::Vllm, Api::ChatCompletions, body).unwrap();
        assert_eq!(
            inj,
            Injected {
                token_ids: true,
                logprobs: false,
                ids_null: true,
            }
        );
        let v: Value = serde_json::from_slice(&new).unwrap();
        assert_eq!(v["return_token_ids"], true);
        assert_eq!(v["top_logprobs"], 2);
        assert!(inject(UpstreamKind::Openai, Api::ChatCompletions, body).is_none());
        let (new, inj) = inject(
            UpstreamKind::Sglang,
            Api::ChatCompletions,
            br#"{"stream":true}"#,
        )
        .unwrap();
        assert_eq!(
            inj,
            Injected {
                token_ids: false,
                logprobs: true,
                ids_null: false,
            }
        );
        assert!(!String::from_utf8_lossy(&new).contains("return_token_ids"));
        let (new, _) = inject(UpstreamKind::Vllm, Api::Completions, br#"{"prompt":"p"}"#).unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&new).unwrap()["logprobs"],
            0
        );
    }

    #[test]
    fn sse_rewriting_keeps_untouched_events_byte_for_byte_at_any_split() {
        let stream = b"data: {\"id\":\"x\",\"prompt_token_ids\":[1,2],\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"token_ids\":[5],\"logprobs\":{\"content\":[]}}]}\r\n\r\n: keep-alive\n\ndata: {\"id\":\"x\",\"choices\":[]}\n\ndata: [DONE]\n\n";
        let injected = Injected {
            token_ids: true,
            logprobs: true,
            ids_null: false,
        };
        let whole = {
            let mut r = SseRewriter::new(injected, None);
            let mut out = r.push(stream).to_vec();
            out.extend_from_slice(&r.finish());
            out
        };
        let text = String::from_utf8(whole.clone()).unwrap();
        assert_eq!(
            text,
            "data: {\"id\":\"x\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"logprobs\":null}]}\r\n\r\n: keep-alive\n\ndata: {\"id\":\"x\",\"choices\":[]}\n\ndata: [DONE]\n\n"
        );
        for split in 0..stream.len() {
            let mut r = SseRewriter::new(injected, None);
            let mut out = r.push(&stream[..split]).to_vec();
            out.extend_from_slice(&r.push(&stream[split..]));
            out.extend_from_slice(&r.finish());
            assert_eq!(out, whole, "split at {split}");
        }
    }

    #[test]
    fn sse_rewriting_passes_comments_and_events_as_soon_as_they_end() {
        let injected = Injected {
            token_ids: true,
            logprobs: false,
            ids_null: false,
        };
        let mut r = SseRewriter::new(injected, None);
        assert_eq!(&r.push(b": keep-alive\r\n")[..], b"");
        assert_eq!(&r.push(b"\r\n")[..], b": keep-alive\r\n\r\n");
        assert_eq!(
            &r.push(b"data: {\"prompt_token_ids\":[1]}\n\ndata: {\"a\"")[..],
            b"data: {}\n\n"
        );
        assert_eq!(&r.push(b":1}\n\n")[..], b"data: {\"a\":1}\n\n");
        assert_eq!(&r.push(b"data: [DONE]")[..], b"");
        assert_eq!(&r.finish()[..], b"data: [DONE]");
    }
}
