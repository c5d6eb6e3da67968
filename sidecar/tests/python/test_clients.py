"""The official OpenAI and Anthropic Python clients through the sidecar.

Each test makes the same call once directly against the fake upstream and once through
the sidecar, checks that the client got exactly the same thing both times, then checks
the sidecar's record of the call against what the client sent and assembled.
"""

from __future__ import annotations

import json
import threading

import anthropic
import openai
import pytest

import fake_upstream as fake
from conftest import payloads

OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "web_search",
            "description": "Searches the web.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in OPENAI_TOOLS
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris? Ünïcödé ✓"},
]
ANTHROPIC_MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Ünïcödé ✓"}]
OPENAI_MODEL = "gpt-test-1"
ANTHROPIC_MODEL = "claude-test-1"


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="test", max_retries=0, timeout=20.0)


def anthropic_client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="test", max_retries=0, timeout=20.0)


def only_call(records: list[dict]) -> dict:
    calls = payloads(records, "llm_call")
    assert len(calls) == 1, calls
    assert len(records) == 1, records
    assert records[0]["id"] == calls[0]["span_id"]
    assert records[0]["sidecar_id"] == "pytest"
    return calls[0]


def check_outcome_ok(call: dict) -> None:
    """Checked last in each test, so that every other field is checked first."""
    assert (call["outcome"], call["error"]) == ("ok", "")


def check_record_common(call: dict, *, api: str, path: str, streamed: bool, upstream, direct_req, model: str) -> None:
    """Checks of a recorded successful call shared by every API.

    `upstream.requests[-1]` and `upstream.responses[-1]` must be the request and response
    of the call through the sidecar; `direct_req` the request of the direct call."""
    via_req = upstream.requests[-1]
    sent = upstream.wait_responses_finished()[-1]
    assert sent.complete and sent.status == 200 and sent.streamed == streamed

    assert call["api"] == api
    assert call["method"] == "POST"
    assert call["path"] == path
    assert call["streamed"] is streamed
    assert call["http_status"] == 200
    assert call["sidecar_id"] == "pytest"
    assert call["episode_id"] == ""
    assert call["capture_warnings"] == []

    # The request as the client sent it: the same JSON as the direct call, and the
    # exact bytes the upstream received through the sidecar.
    assert "request_body" in call, "request body was not valid UTF-8 text"
    assert json.loads(call["request_body"]) == direct_req.body
    assert json.loads(call["request_body"]) == via_req.body
    assert call["request_body"].encode() == via_req.raw_body
    assert call["request_body_size"] == len(via_req.raw_body)
    assert call["request_truncated"] is False
    assert call["request_model"] == model

    # The response exactly as the upstream sent it.
    assert call["response_body"].encode() == sent.body
    assert call["response_body_size"] == len(sent.body)
    assert call["response_truncated"] is False
    assert call["response_model"] == model
    assert call["policy_version"] == model

    # Credentials reach the upstream but are never recorded.
    lower = {k.lower(): v for k, v in call["request_headers"].items()}
    assert lower == call["request_headers"], "recorded header names must be lower-case"
    assert "authorization" not in lower and "x-api-key" not in lower
    assert via_req.header("authorization") == "Bearer test" or via_req.header("x-api-key") == "test"
    assert lower["content-type"] == "application/json"
    assert lower["user-agent"] == via_req.header("user-agent")
    assert call["response_headers"].get("x-request-id") == fake.REQUEST_ID
    assert call["response_headers"]["content-type"].startswith("text/event-stream" if streamed else "application/json")

    assert 0 < call["start_unix_nanos"] <= call["first_byte_unix_nanos"] <= call["end_unix_nanos"]


# --------------------------------------------------------------------------------------
# OpenAI chat completions


def test_openai_chat_non_streaming_with_tools(upstream, sidecar):
    params = dict(model=OPENAI_MODEL, messages=MESSAGES, tools=OPENAI_TOOLS, temperature=0.5)
    direct = openai_client(f"{upstream.url}/v1")
    expected = direct.chat.completions.create(**params)
    direct_req = upstream.requests[-1]

    client = openai_client(f"{sidecar.url}/v1")
    got = client.chat.completions.create(**params)
    client.close()
    direct.close()
    assert got.model_dump() == expected.model_dump()
    assert [r.path for r in upstream.requests] == ["/v1/chat/completions"] * 2

    message = got.choices[0].message
    assert message.content == fake.TEXT
    assert [t.function.arguments for t in message.tool_calls] == fake.TOOL_ARGUMENTS

    call = only_call(sidecar.records())
    check_record_common(
        call, api="chat_completions", path="/v1/chat/completions", streamed=False,
        upstream=upstream, direct_req=direct_req, model=OPENAI_MODEL,
    )  # fmt: skip
    assert len(call["completions"]) == 1
    completion = call["completions"][0]
    assert completion["index"] == 0
    assert completion["text"] == message.content
    assert completion["finish_reason"] == got.choices[0].finish_reason == "tool_calls"
    assert completion["tool_calls"] == [
        {"id": t.id, "type": "function", "name": t.function.name, "arguments": t.function.arguments}
        for t in message.tool_calls
    ]
    assert call["usage"] == {
        "prompt_tokens": got.usage.prompt_tokens,
        "completion_tokens": got.usage.completion_tokens,
        "total_tokens": got.usage.total_tokens,
        "cached_prompt_tokens": got.usage.prompt_tokens_details.cached_tokens,
        "reasoning_tokens": got.usage.completion_tokens_details.reasoning_tokens,
    }
    check_outcome_ok(call)


def assemble_openai_stream(chunks) -> dict:
    """What a harness builds from the chunks: text, tool calls by index, finish reason, usage."""
    text = ""
    tools: dict[int, dict] = {}
    finish_reason = None
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index == 0
            delta = choice.delta
            text += delta.content or ""
            for tc in delta.tool_calls or []:
                t = tools.setdefault(tc.index, {"id": "", "type": "", "name": "", "arguments": ""})
                t["id"] = tc.id or t["id"]
                t["type"] = tc.type or t["type"]
                if tc.function is not None:
                    t["name"] = tc.function.name or t["name"]
                    t["arguments"] += tc.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return {"text": text, "tool_calls": [tools[i] for i in sorted(tools)], "finish_reason": finish_reason, "usage": usage}


def test_openai_chat_streaming_with_tools_and_usage(upstream, sidecar):
    params = dict(
        model=OPENAI_MODEL, messages=MESSAGES, tools=OPENAI_TOOLS, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    direct = openai_client(f"{upstream.url}/v1")
    expected = list(direct.chat.completions.create(**params))
    direct_req = upstream.requests[-1]

    client = openai_client(f"{sidecar.url}/v1")
    chunks = list(client.chat.completions.create(**params))
    client.close()
    direct.close()
    assert [c.model_dump() for c in chunks] == [c.model_dump() for c in expected]
    assert len(chunks) > 10

    got = assemble_openai_stream(chunks)
    assert got["text"] == fake.TEXT
    assert [t["arguments"] for t in got["tool_calls"]] == fake.TOOL_ARGUMENTS
    assert chunks[-1].choices == [] and got["usage"] is not None

    call = only_call(sidecar.records())
    check_record_common(
        call, api="chat_completions", path="/v1/chat/completions", streamed=True,
        upstream=upstream, direct_req=direct_req, model=OPENAI_MODEL,
    )  # fmt: skip
    assert json.loads(call["request_body"])["stream_options"] == {"include_usage": True}
    assert call["response_body"].endswith("data: [DONE]\n\n")
    assert len(call["completions"]) == 1
    completion = call["completions"][0]
    assert completion["text"] == got["text"]
    assert completion["finish_reason"] == got["finish_reason"] == "tool_calls"
    assert completion["tool_calls"] == got["tool_calls"]
    usage = got["usage"]
    assert call["usage"] == {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "cached_prompt_tokens": usage.prompt_tokens_details.cached_tokens,
        "reasoning_tokens": usage.completion_tokens_details.reasoning_tokens,
    }
    check_outcome_ok(call)


def test_openai_stream_events_are_forwarded_as_they_arrive(upstream, sidecar):
    """The upstream holds the stream after its first event until the client has that
    event; a proxy that buffered the stream would make the upstream wait in vain."""
    client = openai_client(f"{sidecar.url}/v1")
    stream = client.chat.completions.create(model=fake.GATED_MODEL, messages=MESSAGES, stream=True)
    try:
        it = iter(stream)
        first = next(it)
        assert not upstream.gate_timed_out, "the first event only arrived after the upstream gave up waiting"
        assert first.choices[0].delta.role == "assistant"
        upstream.release_gate()
        rest = list(it)
    finally:
        upstream.release_gate()
        stream.close()
        client.close()
    assert "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices) == fake.TEXT
    assert not upstream.gate_timed_out
    call = only_call(sidecar.records())
    assert call["streamed"] is True
    assert call["completions"][0]["text"] == fake.TEXT
    check_outcome_ok(call)


def test_openai_stream_closed_by_the_client_after_done_is_recorded_ok(upstream, sidecar):
    """The OpenAI SDK stops reading at `data: [DONE]` and closes the response without
    waiting for the end of the HTTP body (the chunked terminator), which servers send in
    a separate write, sometimes a little later. The client got every event, so the call
    is complete and must not be recorded as client_aborted. Here the fake upstream holds
    the terminator until the client is done, which makes the timing deterministic."""
    client = openai_client(f"{sidecar.url}/v1")
    try:
        chunks = list(client.chat.completions.create(model=fake.END_GATED_MODEL, messages=MESSAGES, stream=True))
    finally:
        client.close()
        upstream.release_gate()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == fake.TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"
    call = only_call(sidecar.records())
    assert not upstream.gate_timed_out
    assert call["streamed"] is True
    assert call["response_body"].endswith("data: [DONE]\n\n")
    assert call["completions"][0]["text"] == fake.TEXT
    assert call["completions"][0]["finish_reason"] == "stop"
    assert call["capture_warnings"] == []
    check_outcome_ok(call)


# --------------------------------------------------------------------------------------
# Anthropic messages


def check_anthropic_completion(call: dict, message) -> None:
    assert len(call["completions"]) == 1
    completion = call["completions"][0]
    assert completion["index"] == 0
    assert completion["text"] == "".join(b.text for b in message.content if b.type == "text")
    assert completion["finish_reason"] == message.stop_reason == "tool_use"
    tool_uses = [b for b in message.content if b.type == "tool_use"]
    assert len(tool_uses) == 2
    assert [(t["id"], t["type"], t["name"]) for t in completion["tool_calls"]] == [
        (b.id, "tool_use", b.name) for b in tool_uses
    ]
    assert [json.loads(t["arguments"]) for t in completion["tool_calls"]] == [b.input for b in tool_uses]
    usage = message.usage
    assert call["usage"] == {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "cached_prompt_tokens": usage.cache_read_input_tokens,
        "reasoning_tokens": 0,
    }


def test_anthropic_messages_non_streaming_with_tools(upstream, sidecar):
    params = dict(model=ANTHROPIC_MODEL, max_tokens=256, system="Be brief.", messages=ANTHROPIC_MESSAGES, tools=ANTHROPIC_TOOLS)
    direct = anthropic_client(upstream.url)
    expected = direct.messages.create(**params)
    direct_req = upstream.requests[-1]

    client = anthropic_client(sidecar.url)
    got = client.messages.create(**params)
    client.close()
    direct.close()
    assert got.model_dump() == expected.model_dump()
    assert [r.path for r in upstream.requests] == ["/v1/messages"] * 2
    assert [b.type for b in got.content] == ["text", "tool_use", "tool_use"]
    assert [b.input for b in got.content[1:]] == [json.loads(a) for a in fake.TOOL_ARGUMENTS]

    call = only_call(sidecar.records())
    check_record_common(
        call, api="anthropic_messages", path="/v1/messages", streamed=False,
        upstream=upstream, direct_req=direct_req, model=ANTHROPIC_MODEL,
    )  # fmt: skip
    assert call["request_headers"].get("anthropic-version") == upstream.requests[-1].header("anthropic-version")
    check_anthropic_completion(call, got)
    check_outcome_ok(call)


def test_anthropic_messages_streaming_with_tools(upstream, sidecar):
    params = dict(model=ANTHROPIC_MODEL, max_tokens=256, messages=ANTHROPIC_MESSAGES, tools=ANTHROPIC_TOOLS)

    def run(client):
        with client.messages.stream(**params) as stream:
            events = list(stream)
            final = stream.get_final_message()
        client.close()
        return events, final

    expected_events, expected_final = run(anthropic_client(upstream.url))
    direct_req = upstream.requests[-1]
    events, final = run(anthropic_client(sidecar.url))
    assert [e.model_dump() for e in events] == [e.model_dump() for e in expected_events]
    assert final.model_dump() == expected_final.model_dump()
    event_types = [e.type for e in events]
    for t in ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"):
        assert t in event_types
    assert final.content[0].text == fake.TEXT

    call = only_call(sidecar.records())
    check_record_common(
        call, api="anthropic_messages", path="/v1/messages", streamed=True,
        upstream=upstream, direct_req=direct_req, model=ANTHROPIC_MODEL,
    )  # fmt: skip
    assert json.loads(call["request_body"])["stream"] is True
    assert "event: ping" in call["response_body"]
    check_anthropic_completion(call, final)
    # Streamed tool arguments are recorded exactly as generated: the partial_json pieces.
    partial: dict[int, str] = {}
    for e in events:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            partial[e.index] = partial.get(e.index, "") + e.delta.partial_json
    assert [t["arguments"] for t in call["completions"][0]["tool_calls"]] == [partial[i] for i in sorted(partial)]
    assert [t["arguments"] for t in call["completions"][0]["tool_calls"]] == fake.TOOL_ARGUMENTS
    check_outcome_ok(call)


# --------------------------------------------------------------------------------------
# Concurrency and errors


def test_parallel_calls_are_recorded_separately(upstream, sidecar):
    n = 6
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        params = dict(model=f"model-{i}", messages=[{"role": "user", "content": f"q{i}"}])
        try:
            client = openai_client(f"{sidecar.url}/v1")
            if i % 2 == 0:
                chunks = list(client.chat.completions.create(**params, stream=True))
                results[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                results[i] = client.chat.completions.create(**params).choices[0].message.content
            client.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert results == {i: fake.TEXT for i in range(n)}

    calls = payloads(sidecar.records(), "llm_call")
    assert len(calls) == n
    by_model = {c["request_model"]: c for c in calls}
    assert sorted(by_model) == sorted(f"model-{i}" for i in range(n))
    for i in range(n):
        c = by_model[f"model-{i}"]
        assert c["response_model"] == f"model-{i}"
        assert c["streamed"] is (i % 2 == 0)
        assert json.loads(c["request_body"])["messages"][0]["content"] == f"q{i}"
        assert c["completions"][0]["text"] == fake.TEXT
    assert len({c["span_id"] for c in calls}) == n
    # Unattributed calls are numbered among themselves.
    assert sorted(c["seq"] for c in calls) == list(range(n))
    # Outcomes last, so that every other field is checked first.
    assert [by_model[f"model-{i}"]["outcome"] for i in range(n)] == ["ok"] * n


def test_upstream_error_status_is_passed_through(upstream, sidecar):
    """A 4xx answer of the upstream reaches the client unchanged and is recorded as
    upstream_error with its status."""
    client = openai_client(f"{sidecar.url}/v1")
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.post("/no-such-endpoint", body={"model": "m"}, cast_to=object)
    client.close()
    assert excinfo.value.status_code == 404
    assert excinfo.value.response.json()["error"]["type"] == "not_found"
    call = only_call(sidecar.records())
    assert call["api"] == "other"
    assert call["path"] == "/v1/no-such-endpoint"
    assert call["http_status"] == 404
    assert call["request_model"] == "m"
    assert call["outcome"] == "upstream_error", (call["outcome"], call["error"])
