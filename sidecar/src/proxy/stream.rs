//! Response streaming: [`CaptureBody`], the body handed to the client. It passes each
//! upstream frame on as it arrives (rewritten for token fidelity), tees it into the
//! call's [`Capture`], cuts a silent upstream after the idle timeout, and holds the
//! response's last frame — the end of the body, or the end of an event stream's last
//! event ([`terminal_event`]) — until the call's record is in the spool.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tapline_proto::{Api, Outcome};

use super::capture::{Capture, Spooled};
use super::fidelity::Rewrite;
use crate::body::BoxError;
use crate::sse::{Terminal, TerminalWatch};
use crate::upstream::UpstreamBody;

/// The last event of a stream, by API. A client may close the connection as soon as it
/// saw this event (the openai SDK does at `[DONE]`), so the call is complete there,
/// whatever follows.
pub(super) fn terminal_event(api: Api) -> Option<Terminal> {
    match api {
        Api::ChatCompletions | Api::Completions => Some(Terminal::Data("[DONE]")),
        Api::AnthropicMessages => Some(Terminal::Named(&["message_stop"])),
        Api::Responses => Some(Terminal::Named(&[
            "response.completed",
            "response.incomplete",
            "response.failed",
        ])),
        Api::Other | Api::Unspecified => None,
    }
}

/// The last frame of a response, held back until its record is in the spool.
struct Held {
    ack: Spooled,
    frame: Option<Frame<Bytes>>,
    /// Gives up waiting after this long (policy `drop`); `None` waits as long as it
    /// takes.
    wait: Option<Duration>,
    /// The timer of `wait`, made when the ack is first not ready (it usually is).
    timeout: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// The response body handed to the client: the upstream body, teed into the capture.
pub(super) struct CaptureBody {
    inner: UpstreamBody,
    capture: Option<Capture>,
    rewrite: Rewrite,
    idle_timeout: Duration,
    /// Fires at the idle deadline; re-armed lazily (resetting a timer per frame is
    /// costly), and made only when the upstream first keeps the body waiting (most
    /// JSON answers arrive with their head and never need one).
    idle: Option<Pin<Box<tokio::time::Sleep>>>,
    /// When the last frame arrived.
    last_frame: tokio::time::Instant,
    /// Watches for the end of the stream's last event (event streams of known APIs).
    terminal: Option<TerminalWatch>,
    held: Option<Held>,
    /// Bytes already read (and teed into the capture) to send before `inner`'s.
    head: Option<Bytes>,
    done: bool,
}

impl CaptureBody {
    /// Wraps `inner` for the client; `terminal` watches an event stream for its last
    /// event.
    pub(super) fn new(
        inner: UpstreamBody,
        capture: Capture,
        rewrite: Rewrite,
        idle_timeout: Duration,
        terminal: Option<TerminalWatch>,
    ) -> Self {
        CaptureBody {
            inner,
            capture: Some(capture),
            rewrite,
            idle_timeout,
            idle: None,
            last_frame: tokio::time::Instant::now(),
            terminal,
            held: None,
            head: None,
            done: false,
        }
    }

    /// Sends `head` first: the start of the body, read before and already teed into
    /// the capture.
    pub(super) fn after(mut self, head: Bytes) -> Self {
        self.head = Some(head);
        self
    }

    fn finish(&mut self, outcome: Outcome, error: Option<String>) {
        if let Some(capture) = self.capture.take() {
            capture.finish(outcome, error);
        }
    }

    /// Records the call as complete and holds `frame` until the record is spooled.
    fn hold(&mut self, frame: Option<Frame<Bytes>>) {
        let Some(capture) = self.capture.take() else {
            self.held = Some(Held {
                ack: Box::pin(std::future::ready(Ok(()))),
                frame,
                wait: None,
                timeout: None,
            });
            return;
        };
        let wait = capture.state.ack_wait;
        let ack = capture.finish_acked(Outcome::Ok, None);
        self.held = Some(Held {
            ack,
            frame,
            wait,
            timeout: None,
        });
    }

    fn sent(&self, n: usize) {
        if let Some(c) = &self.capture {
            c.state
                .metrics
                .response_bytes
                .fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// Whether the stream's last event is complete with `data`: the blank line that ends
    /// it has arrived.
    fn is_terminal(&mut self, data: &[u8]) -> bool {
        if self.capture.is_none() {
            return false;
        }
        self.terminal.as_mut().is_some_and(|watch| watch.feed(data))
    }
}

impl Body for CaptureBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some(held) = &mut this.held {
                let acked = held.ack.as_mut().poll(cx).is_ready();
                if !acked
                    && held.timeout.is_none()
                    && let Some(wait) = held.wait
                {
                    held.timeout = Some(Box::pin(tokio::time::sleep(wait)));
                }
                let gave_up = !acked
                    && held
                        .timeout
                        .as_mut()
                        .is_some_and(|t| t.as_mut().poll(cx).is_ready());
                if !acked && !gave_up {
                    return Poll::Pending;
                }
                if gave_up {
                    tracing::warn!(
                        "record not spooled in time; sending the end of the response anyway"
                    );
                }
                let frame = this.held.take().and_then(|h| h.frame);
                match frame {
                    Some(frame) => return Poll::Ready(Some(Ok(frame))),
                    None => {
                        this.done = true;
                        return Poll::Ready(None);
                    }
                }
            }
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(head) = this.head.take() {
                this.last_frame = tokio::time::Instant::now();
                this.sent(head.len());
                let frame = (!head.is_empty()).then(|| Frame::data(head));
                if this.inner.is_end_stream() {
                    // The head was all of it: the last frame, held like any other.
                    this.hold(frame);
                    continue;
                }
                if let Some(frame) = frame {
                    return Poll::Ready(Some(Ok(frame)));
                }
                continue;
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    this.last_frame = tokio::time::Instant::now();
                    let Some(data) = frame.data_ref() else {
                        return Poll::Ready(Some(Ok(frame)));
                    };
                    if let Some(capture) = &mut this.capture {
                        capture.push(data);
                    }
                    let terminal = this.is_terminal(data);
                    let last = this.inner.is_end_stream();
                    let mut out = match &mut this.rewrite {
                        Rewrite::None => frame.into_data().unwrap_or_default(),
                        Rewrite::Sse(rewriter) => rewriter.push(data),
                    };
                    if terminal || last {
                        if let Rewrite::Sse(rewriter) = &mut this.rewrite {
                            let tail = rewriter.finish();
                            if !tail.is_empty() {
                                let mut joined = BytesMut::from(&out[..]);
                                joined.extend_from_slice(&tail);
                                out = joined.freeze();
                            }
                        }
                        this.sent(out.len());
                        let frame = (!out.is_empty()).then(|| Frame::data(out));
                        if this.capture.is_some() {
                            this.hold(frame);
                            continue;
                        }
                        if let Some(frame) = frame {
                            return Poll::Ready(Some(Ok(frame)));
                        }
                        continue;
                    }
                    if !out.is_empty() {
                        this.sent(out.len());
                        return Poll::Ready(Some(Ok(Frame::data(out))));
                    }
                }
                Poll::Ready(Some(Err(error))) => {
                    this.done = true;
                    this.finish(
                        Outcome::UpstreamError,
                        Some(format!("upstream body failed: {error}")),
                    );
                    return Poll::Ready(Some(Err(error.into())));
                }
                Poll::Ready(None) => {
                    let tail = match &mut this.rewrite {
                        Rewrite::None => Bytes::new(),
                        Rewrite::Sse(rewriter) => rewriter.finish(),
                    };
                    this.sent(tail.len());
                    let frame = (!tail.is_empty()).then(|| Frame::data(tail));
                    this.hold(frame);
                    continue;
                }
                Poll::Pending => {
                    let deadline = this.last_frame + this.idle_timeout;
                    let idle = this
                        .idle
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                    let mut silent = false;
                    while idle.as_mut().poll(cx).is_ready() {
                        if deadline > tokio::time::Instant::now() {
                            // Frames arrived since the timer was armed: wait the rest.
                            idle.as_mut().reset(deadline);
                            continue;
                        }
                        silent = true;
                        break;
                    }
                    if !silent {
                        return Poll::Pending;
                    }
                    let message = format!(
                        "upstream sent nothing for {:.0?}; response cut",
                        this.idle_timeout
                    );
                    this.done = true;
                    this.finish(Outcome::Timeout, Some(message.clone()));
                    return Poll::Ready(Some(Err(message.into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        match self.rewrite {
            Rewrite::None => {
                let inner = self.inner.size_hint();
                let head = self.head.as_ref().map_or(0, |h| h.len() as u64);
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + head);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + head);
                }
                hint
            }
            Rewrite::Sse(_) => SizeHint::default(),
        }
    }
}

impl Drop for CaptureBody {
    fn drop(&mut self) {
        if self.capture.is_some() {
            self.finish(
                Outcome::ClientAborted,
                Some("client closed the connection before the response ended".to_owned()),
            );
        }
    }
}
