//! The response side: chat completion JSON and stream chunks in vLLM's shapes (the ones
//! the sidecar's `rebuild` reads, see `sidecar/tests/fixtures/vllm_chat_*`), and the
//! server-sent-events body of a stream. Pure except for [`SseBody`], which turns the
//! engine's events into frames as they arrive.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::StatusCode;
use http_body::Frame;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::ApiError;
use crate::engine::{Event, Finish, TokenEvent};

/// What every response of one request shares.
#[derive(Debug, Clone)]
pub struct Meta {
    /// `chatcmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Whether per-token logprobs were asked for.
    pub logprobs: bool,
    /// Whether token ids were asked for (`return_token_ids`).
    pub token_ids: bool,
}

/// A logprob as JSON can carry it (vLLM writes -9999.0 for minus infinity).
fn finite_logprob(lp: f64) -> f64 {
    if lp.is_finite() { lp } else { -9999.0 }
}

/// One entry of `logprobs.content`.
fn logprob_entry(t: &TokenEvent) -> Value {
    json!({
        "token": t.token,
        "logprob": finite_logprob(t.logprob),
        "bytes": t.token.as_bytes(),
        "top_logprobs": [],
    })
}

fn usage(finish: &Finish) -> Value {
    json!({
        "prompt_tokens": finish.prompt_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        "completion_tokens": finish.completion_tokens,
    })
}

/// The whole answer (`chat.completion`).
pub fn completion(
    meta: &Meta,
    prompt_ids: &[u32],
    tokens: &[TokenEvent],
    finish: &Finish,
) -> Value {
    let logprobs = meta
        .logprobs
        .then(|| json!({ "content": tokens.iter().map(logprob_entry).collect::<Vec<_>>() }));
    let ids: Vec<u32> = tokens.iter().map(|t| t.id).collect();
    let mut usage = usage(finish);
    usage["prompt_tokens_details"] = Value::Null;
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": {
                "role": "assistant",
                "content": finish.content,
                "refusal": null,
                "annotations": null,
                "audio": null,
                "function_call": null,
                "tool_calls": [],
                "reasoning_content": null,
            },
            "logprobs": logprobs,
            "finish_reason": finish.reason,
            "stop_reason": finish.stop_reason,
            "token_ids": meta.token_ids.then_some(ids),
        }],
        "service_tier": null,
        "system_fingerprint": null,
        "usage": usage,
        "prompt_logprobs": null,
        "prompt_token_ids": meta.token_ids.then_some(prompt_ids),
        "kv_transfer_params": null,
    })
}

fn chunk(meta: &Meta, choices: Value) -> Value {
    json!({
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
    })
}

/// The first chunk: the assistant role, and the prompt ids when asked for.
pub fn first_chunk(meta: &Meta, prompt_ids: &[u32]) -> Value {
    let mut c = chunk(
        meta,
        json!([{
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        }]),
    );
    if meta.token_ids {
        c["prompt_token_ids"] = json!(prompt_ids);
    }
    c
}

/// The chunk of one token: its text delta, logprob and id, and the finish reason on
/// the last one.
pub fn token_chunk(meta: &Meta, t: &TokenEvent) -> Value {
    let mut choice = json!({
        "index": 0,
        "delta": {"content": t.delta},
        "logprobs": meta.logprobs.then(|| json!({"content": [logprob_entry(t)]})),
        "finish_reason": t.finish.as_ref().map(|f| f.reason),
    });
    if let Some(f) = &t.finish {
        choice["stop_reason"] = json!(f.stop_reason);
    }
    if meta.token_ids {
        choice["token_ids"] = json!([t.id]);
    }
    let mut c = chunk(meta, json!([choice]));
    if meta.token_ids {
        c["prompt_token_ids"] = Value::Null;
    }
    c
}

/// The last chunk with `stream_options.include_usage`: no choices, the usage.
pub fn usage_chunk(meta: &Meta, finish: &Finish) -> Value {
    let mut c = chunk(meta, json!([]));
    c["usage"] = usage(finish);
    c
}

/// An error inside a stream (after the 200 was sent), as vLLM sends it.
pub fn error_chunk(error: &ApiError) -> Value {
    let mut v = error.to_json();
    v["error"]["code"] = json!(error.status.as_u16());
    v
}

/// One server-sent event.
pub fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// The end of a stream.
const DONE: &[u8] = b"data: [DONE]\n\n";

/// A stream's body: the first chunk, one chunk per token event, the usage chunk when
/// asked for, `[DONE]`. Dropping it (the client went away) closes the event channel,
/// which stops the generation.
#[derive(Debug)]
pub struct SseBody {
    events: mpsc::UnboundedReceiver<Event>,
    meta: Meta,
    include_usage: bool,
    pending: VecDeque<Bytes>,
    done: bool,
}

impl SseBody {
    /// A body that starts with the first chunk and follows `events`.
    pub fn new(
        meta: Meta,
        prompt_ids: &[u32],
        include_usage: bool,
        events: mpsc::UnboundedReceiver<Event>,
    ) -> Self {
        let first = sse(&first_chunk(&meta, prompt_ids));
        SseBody {
            events,
            meta,
            include_usage,
            pending: VecDeque::from([first]),
            done: false,
        }
    }

    fn on_event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Token(t)) => {
                self.pending.push_back(sse(&token_chunk(&self.meta, &t)));
                if let Some(finish) = &t.finish {
                    if self.include_usage {
                        self.pending
                            .push_back(sse(&usage_chunk(&self.meta, finish)));
                    }
                    self.end();
                }
            }
            Some(Event::Started { .. }) => {}
            Some(Event::Failed(error)) => {
                self.pending.push_back(sse(&error_chunk(&error)));
                self.end();
            }
            None => {
                let error = ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the inference thread stopped during the generation",
                );
                self.pending.push_back(sse(&error_chunk(&error)));
                self.end();
            }
        }
    }

    fn end(&mut self) {
        self.pending.push_back(Bytes::from_static(DONE));
        self.done = true;
        self.events.close();
    }
}

impl http_body::Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        loop {
            if let Some(bytes) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match this.events.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(event) => this.on_event(event),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(flags: bool) -> Meta {
        Meta {
            id: "chatcmpl-1".into(),
            created: 7,
            model: "m".into(),
            logprobs: flags,
            token_ids: flags,
        }
    }

    fn tokens() -> (Vec<TokenEvent>, Finish) {
        let finish = Finish {
            reason: "stop",
            stop_reason: None,
            content: "Hi".into(),
            prompt_tokens: 3,
            completion_tokens: 2,
        };
        let t = |id, token: &str, delta: &str, finish| TokenEvent {
            id,
            logprob: -0.5,
            token: token.into(),
            delta: delta.into(),
            finish,
        };
        (
            vec![
                t(5, "Hi", "Hi", None),
                t(2, "<|im_end|>", "", Some(finish.clone())),
            ],
            finish,
        )
    }

    #[test]
    fn whole_answer_has_vllm_shape() {
        let (toks, finish) = tokens();
        let v = completion(&meta(true), &[1, 2, 3], &toks, &finish);
        assert_eq!(v["prompt_token_ids"], json!([1, 2, 3]));
        let c = &v["choices"][0];
        assert_eq!(c["token_ids"], json!([5, 2]));
        assert_eq!(c["message"]["content"], "Hi");
        assert_eq!(c["message"]["tool_calls"], json!([]));
        assert_eq!(c["finish_reason"], "stop");
        assert_eq!(c["logprobs"]["content"][1]["token"], "<|im_end|>");
        assert_eq!(c["logprobs"]["content"][1]["bytes"][0], 60);
        assert_eq!(c["logprobs"]["content"][0]["logprob"], -0.5);
        assert_eq!(v["usage"]["total_tokens"], 5);
        let v = completion(&meta(false), &[1], &toks, &finish);
        assert!(v["prompt_token_ids"].is_null() && v["choices"][0]["logprobs"].is_null());
        assert!(v["choices"][0]["token_ids"].is_null());
    }

    #[test]
    fn chunks_have_vllm_shape() {
        let (toks, finish) = tokens();
        let m = meta(true);
        let first = first_chunk(&m, &[1, 2]);
        assert_eq!(first["prompt_token_ids"], json!([1, 2]));
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        let last = token_chunk(&m, &toks[1]);
        assert!(last["prompt_token_ids"].is_null());
        assert_eq!(last["choices"][0]["token_ids"], json!([2]));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            last["choices"][0]["logprobs"]["content"][0]["logprob"],
            -0.5
        );
        let u = usage_chunk(&m, &finish);
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["completion_tokens"], 2);
        let plain = token_chunk(&meta(false), &toks[0]);
        let obj = plain.as_object().unwrap();
        assert!(!obj.contains_key("prompt_token_ids"));
        assert!(
            !plain["choices"][0]
                .as_object()
                .unwrap()
                .contains_key("token_ids")
        );
        assert!(plain["choices"][0]["finish_reason"].is_null());
    }

    #[test]
    fn non_finite_logprobs_stay_json() {
        assert_eq!(finite_logprob(f64::NEG_INFINITY), -9999.0);
        assert_eq!(finite_logprob(-1.5), -1.5);
    }
}
