"""A deterministic fake of the OpenAI chat completions and Anthropic messages APIs.

`FakeUpstream` runs a `ThreadingHTTPServer` (HTTP/1.1, keep-alive) on 127.0.0.1 with an
ephemeral port in a background thread. It answers:

- `POST /v1/chat/completions`: a `chat.completion` JSON document, or, with `"stream": true`,
  `data: {chunk}` server-sent events ending with `data: [DONE]` (role delta, content deltas,
  tool-call deltas keyed by index with their arguments split over several chunks, a
  finish_reason chunk, and a usage chunk with empty `choices` when
  `stream_options.include_usage` is true).
- `POST /v1/messages`: an Anthropic `message` JSON document, or, with `"stream": true`, the
  named events `message_start`, `content_block_start/delta/stop` (text, then `tool_use`
  with `input_json_delta` pieces), `ping`, `message_delta` and `message_stop`.

When the request carries `tools`, the answer calls the first two of them (one tool call
per tool) with the fixed arguments in `TOOL_ARGUMENTS`.

A test can script the chat completions answers instead (`script_chat(message, ...)`): each
request to `/v1/chat/completions` then answers with the next scripted assistant message,
as a `chat.completion` document or, with `"stream": true`, as chunks (role, content, each
tool call whole, finish_reason, usage when asked, `[DONE]`); once the script is used up,
requests get a 500. `reset()` ends the script.

Streams are sent with `Transfer-Encoding: chunked`, one event per HTTP chunk (one event is
deliberately split across two chunks), flushed after each chunk, so they really stream.

Every request is recorded (`requests`) with its path, headers and parsed JSON body, and
every response body is kept (`responses`) byte for byte, for assertions.

Streams end the way ASGI servers end them: the last event and the chunked-encoding
terminator (`0\r\n\r\n`) in one write. Two models change that, for tests about timing:

- `GATED_MODEL`: the first event is sent, then the server waits until `release_gate()`
  is called (at most `GATE_TIMEOUT` seconds) before sending the rest; it lets a test prove
  that a proxy forwards events as they arrive.
- `END_GATED_MODEL`: every event is sent, then the server waits for `release_gate()`
  before sending the terminator, like a server that is slow to close its response.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CREATED = 1_700_000_000
CHAT_ID = "chatcmpl-test1"
MESSAGE_ID = "msg_test1"
SYSTEM_FINGERPRINT = "fp_test1"
REQUEST_ID = "req_test1"

TEXT_PIECES = ["Let me ", "check that ", "for you."]
TEXT = "".join(TEXT_PIECES)

# Arguments of the tool calls made when tools are given, in order, and how each is split
# into stream fragments.
TOOL_ARGUMENT_PIECES = [
    ['{"city', '": "Par', 'is", "unit": ', '"celsius"}'],
    ['{"query": ', '"weather ', 'in Paris"}'],
]
TOOL_ARGUMENTS = ["".join(p) for p in TOOL_ARGUMENT_PIECES]
OPENAI_TOOL_CALL_IDS = ["call_test1", "call_test2"]
ANTHROPIC_TOOL_USE_IDS = ["toolu_test1", "toolu_test2"]

OPENAI_USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": 7,
    "total_tokens": 19,
    "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0},
    "completion_tokens_details": {
        "reasoning_tokens": 2,
        "audio_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    },
}
ANTHROPIC_INPUT_TOKENS = 20
ANTHROPIC_OUTPUT_TOKENS = 11
ANTHROPIC_CACHE_READ_TOKENS = 3

GATED_MODEL = "gated-model"
END_GATED_MODEL = "end-gated-model"
GATE_TIMEOUT = 10.0


@dataclass
class ReceivedRequest:
    """One request as the fake upstream received it."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    raw_body: bytes
    body: Any  # parsed JSON, or None when the body is not JSON

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def header_names(self) -> list[str]:
        return [k.lower() for k, _ in self.headers]


@dataclass
class SentResponse:
    """One response body as the fake upstream sent it."""

    path: str
    status: int
    streamed: bool
    body: bytes = b""
    complete: bool = False  # the whole body, terminator included, was written
    broken: bool = False  # the peer went away before the body was written


def _tool_names(body: dict) -> list[str]:
    names = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        # OpenAI: {"type": "function", "function": {"name": ...}}; Anthropic: {"name": ...}
        name = (tool.get("function") or {}).get("name") or tool.get("name")
        if name:
            names.append(name)
    return names[: len(TOOL_ARGUMENTS)]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep quiet
        pass

    # -- request plumbing -------------------------------------------------------------

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while True:
                size_line = self.rfile.readline()
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    # trailers, up to the blank line
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()  # CRLF after the chunk
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _record_request(self) -> ReceivedRequest:
        raw = self._read_body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        req = ReceivedRequest(
            method=self.command,
            path=self.path,
            headers=list(self.headers.items()),
            raw_body=raw,
            body=body,
        )
        with self.server.lock:
            self.server.requests.append(req)
        return req

    def _new_response(self, status: int, streamed: bool) -> SentResponse:
        sent = SentResponse(path=self.path, status=status, streamed=streamed)
        with self.server.lock:
            self.server.responses.append(sent)
        return sent

    def _send_json(self, status: int, obj: Any) -> None:
        data = _dumps(obj).encode()
        sent = self._new_response(status, streamed=False)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-request-id", REQUEST_ID)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        sent.body = data
        sent.complete = True

    def _start_stream(self) -> SentResponse:
        sent = self._new_response(200, streamed=True)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-request-id", REQUEST_ID)
        self.end_headers()
        return sent

    def _chunk(self, sent: SentResponse, data: bytes, last: bool = False) -> None:
        out = b"%x\r\n%s\r\n" % (len(data), data)
        if last:
            out += b"0\r\n\r\n"
        self.wfile.write(out)
        self.wfile.flush()
        sent.body += data

    def _wait_gate(self) -> None:
        if not self.server.gate.wait(GATE_TIMEOUT):
            self.server.gate_timed_out = True

    def _send_events(self, sent: SentResponse, events: list[bytes], model: str) -> None:
        try:
            for n, event in enumerate(events):
                last = n == len(events) - 1 and model != END_GATED_MODEL
                if n == 2 and not last and len(event) > 10:
                    # One event split across two HTTP chunks: proxies must reassemble it.
                    half = len(event) // 2
                    self._chunk(sent, event[:half])
                    self._chunk(sent, event[half:])
                else:
                    self._chunk(sent, event, last=last)
                if n == 0 and model == GATED_MODEL:
                    self._wait_gate()
            if model == END_GATED_MODEL:
                self._wait_gate()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            sent.broken = True
            self.close_connection = True
            return
        sent.complete = True

    # -- routes -----------------------------------------------------------------------

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        req = self._record_request()
        path = self.path.split("?", 1)[0]
        body = req.body if isinstance(req.body, dict) else None
        if body is None:
            self._send_json(400, {"error": {"message": "body must be a JSON object", "type": "invalid_request_error"}})
            return
        if path == "/v1/chat/completions":
            self._chat(body)
        elif path == "/v1/messages":
            self._messages(body)
        else:
            self._not_found()

    def do_GET(self) -> None:  # noqa: N802
        self._record_request()
        self._not_found()

    def _not_found(self) -> None:
        self._send_json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    # OpenAI chat completions ------------------------------------------------------------

    def _chat(self, body: dict) -> None:
        with self.server.lock:
            script = self.server.chat_script
            scripted = script.pop(0) if script else None
        if script is not None:
            if scripted is None:
                self._send_json(500, {"error": {"message": "chat script used up", "type": "server_error"}})
            else:
                self._scripted_chat(body, scripted)
            return
        model = body.get("model", "")
        tools = _tool_names(body)
        finish_reason = "tool_calls" if tools else "stop"
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": TEXT, "refusal": None, "annotations": []}
            if tools:
                message["tool_calls"] = [
                    {
                        "id": OPENAI_TOOL_CALL_IDS[i],
                        "type": "function",
                        "function": {"name": name, "arguments": TOOL_ARGUMENTS[i]},
                    }
                    for i, name in enumerate(tools)
                ]
            self._send_json(
                200,
                {
                    "id": CHAT_ID,
                    "object": "chat.completion",
                    "created": CREATED,
                    "model": model,
                    "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
                    "usage": OPENAI_USAGE,
                    "service_tier": "default",
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                },
            )
            return

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(choices: list, **extra: Any) -> bytes:
            obj: dict[str, Any] = {
                "id": CHAT_ID,
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": model,
                "service_tier": "default",
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices,
            }
            if include_usage:
                obj["usage"] = None
            obj.update(extra)
            return b"data: " + _dumps(obj).encode() + b"\n\n"

        def choice(delta: dict, finish: str | None = None) -> list:
            return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

        events = [chunk(choice({"role": "assistant", "content": "", "refusal": None}))]
        events += [chunk(choice({"content": piece})) for piece in TEXT_PIECES]
        for i, name in enumerate(tools):
            events.append(
                chunk(
                    choice(
                        {
                            "tool_calls": [
                                {
                                    "index": i,
                                    "id": OPENAI_TOOL_CALL_IDS[i],
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""},
                                }
                            ]
                        }
                    )
                )
            )
            for piece in TOOL_ARGUMENT_PIECES[i]:
                events.append(chunk(choice({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})))
        events.append(chunk(choice({}, finish_reason)))
        if include_usage:
            events.append(chunk([], usage=OPENAI_USAGE))
        events.append(b"data: [DONE]\n\n")
        sent = self._start_stream()
        self._send_events(sent, events, model)

    def _scripted_chat(self, body: dict, scripted: dict) -> None:
        model = body.get("model", "")
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None, "annotations": [], **scripted}
        finish_reason = "tool_calls" if message.get("tool_calls") else "stop"
        base = {"id": CHAT_ID, "created": CREATED, "model": model, "system_fingerprint": SYSTEM_FINGERPRINT}
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            self._send_json(200, {**base, "object": "chat.completion", "choices": [choice], "usage": OPENAI_USAGE})
            return

        def chunk(delta: dict | None, finish: str | None = None, **extra: Any) -> bytes:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            obj = {**base, "object": "chat.completion.chunk", "choices": choices, **extra}
            return b"data: " + _dumps(obj).encode() + b"\n\n"

        events = [chunk({"role": "assistant", "content": ""})]
        if message.get("content"):
            events.append(chunk({"content": message["content"]}))
        for i, call in enumerate(message.get("tool_calls") or []):
            events.append(chunk({"tool_calls": [{"index": i, **call}]}))
        events.append(chunk({}, finish_reason))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(chunk(None, usage=OPENAI_USAGE))
        events.append(b"data: [DONE]\n\n")
        self._send_events(self._start_stream(), events, model)

    # Anthropic messages ---------------------------------------------------------------

    def _messages(self, body: dict) -> None:
        model = body.get("model", "")
        tools = _tool_names(body)
        stop_reason = "tool_use" if tools else "end_turn"
        if not body.get("stream"):
            content: list[dict[str, Any]] = [{"type": "text", "text": TEXT}]
            for i, name in enumerate(tools):
                content.append(
                    {"type": "tool_use", "id": ANTHROPIC_TOOL_USE_IDS[i], "name": name, "input": json.loads(TOOL_ARGUMENTS[i])}
                )
            self._send_json(
                200,
                {
                    "id": MESSAGE_ID,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": content,
                    "stop_reason": stop_reason,
                    "stop_sequence": None,
                    "usage": {
                        "input_tokens": ANTHROPIC_INPUT_TOKENS,
                        "output_tokens": ANTHROPIC_OUTPUT_TOKENS,
                        "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": ANTHROPIC_CACHE_READ_TOKENS,
                    },
                },
            )
            return

        def event(name: str, data: dict) -> bytes:
            return f"event: {name}\ndata: {_dumps(data)}\n\n".encode()

        events = [
            event(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": MESSAGE_ID,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {
                            "input_tokens": ANTHROPIC_INPUT_TOKENS,
                            "output_tokens": 1,
                            "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": ANTHROPIC_CACHE_READ_TOKENS,
                        },
                    },
                },
            ),
            event(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            ),
            event("ping", {"type": "ping"}),
        ]
        for piece in TEXT_PIECES:
            events.append(
                event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
                )
            )
        events.append(event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        for i, name in enumerate(tools):
            index = i + 1
            events.append(
                event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {"type": "tool_use", "id": ANTHROPIC_TOOL_USE_IDS[i], "name": name, "input": {}},
                    },
                )
            )
            for piece in [""] + TOOL_ARGUMENT_PIECES[i]:
                events.append(
                    event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": piece},
                        },
                    )
                )
            events.append(event("content_block_stop", {"type": "content_block_stop", "index": index}))
        events.append(
            event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": {"output_tokens": ANTHROPIC_OUTPUT_TOKENS},
                },
            )
        )
        events.append(event("message_stop", {"type": "message_stop"}))
        sent = self._start_stream()
        self._send_events(sent, events, model)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.requests: list[ReceivedRequest] = []
        self.responses: list[SentResponse] = []
        self.gate = threading.Event()
        self.gate_timed_out = False
        # Scripted chat completions answers (assistant messages), None when not scripted.
        self.chat_script: list[dict] | None = None


@dataclass
class FakeUpstream:
    """The fake server; use `start()`/`stop()` or as a context manager."""

    _server: _Server | None = None
    _thread: threading.Thread | None = None

    def start(self) -> "FakeUpstream":
        self._server = _Server()
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-upstream", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.gate.set()
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeUpstream":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """Base URL without a path, e.g. http://127.0.0.1:12345."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list[ReceivedRequest]:
        assert self._server is not None
        with self._server.lock:
            return list(self._server.requests)

    @property
    def responses(self) -> list[SentResponse]:
        assert self._server is not None
        with self._server.lock:
            return list(self._server.responses)

    def reset(self) -> None:
        """Forgets recorded traffic, ends any chat script and closes the gate."""
        assert self._server is not None
        with self._server.lock:
            self._server.requests.clear()
            self._server.responses.clear()
            self._server.chat_script = None
        self._server.gate.clear()
        self._server.gate_timed_out = False

    def script_chat(self, *messages: dict) -> None:
        """Answers the next chat completions requests with these assistant messages, in
        order (e.g. `{"content": "hi"}` or `{"tool_calls": [{"id": ..., "type": "function",
        "function": {"name": ..., "arguments": "{...}"}}]}`); then 500s until `reset()`."""
        assert self._server is not None
        with self._server.lock:
            self._server.chat_script = [dict(m) for m in messages]

    def wait_responses_finished(self, timeout: float = 10.0) -> list[SentResponse]:
        """Waits until every response was written to its end (or its peer went away);
        a client can finish reading before the server thread marks a response done."""
        deadline = time.monotonic() + timeout
        while True:
            responses = self.responses
            if all(r.complete or r.broken for r in responses):
                return responses
            if time.monotonic() > deadline:
                raise AssertionError(f"responses still being written after {timeout}s: {responses}")
            time.sleep(0.01)

    def release_gate(self) -> None:
        assert self._server is not None
        self._server.gate.set()

    @property
    def gate_timed_out(self) -> bool:
        assert self._server is not None
        return self._server.gate_timed_out
