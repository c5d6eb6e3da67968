"""An upstream that cannot be reached: the client gets a 502 in the shape of its API, and
the call is recorded as upstream_unreachable."""

from __future__ import annotations

import anthropic
import openai
import pytest

from conftest import closed_port, payloads


def test_unreachable_upstream_gives_502_and_a_record(start_sidecar):
    sidecar = start_sidecar(f"http://127.0.0.1:{closed_port()}", ["--connect-timeout-secs", "5"])

    oa = openai.OpenAI(base_url=f"{sidecar.url}/v1", api_key="test", max_retries=0, timeout=20.0)
    with pytest.raises(openai.APIStatusError) as excinfo:
        oa.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}])
    err = excinfo.value
    assert isinstance(err, openai.InternalServerError)
    assert err.status_code == 502
    body = err.response.json()
    assert body["error"]["code"] == "upstream_unreachable"
    assert body["error"]["type"] == "upstream_unreachable"
    assert body["error"]["message"].startswith("tapline: upstream")
    assert err.code == "upstream_unreachable"
    openai_span = err.response.headers.get("x-tapline-span-id")
    assert openai_span

    # A streaming request fails the same way, before any event.
    with pytest.raises(openai.InternalServerError) as excinfo:
        oa.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert excinfo.value.status_code == 502
    oa.close()

    an = anthropic.Anthropic(base_url=sidecar.url, api_key="test", max_retries=0, timeout=20.0)
    with pytest.raises(anthropic.APIStatusError) as excinfo:
        an.messages.create(model="claude-test", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    an.close()
    err = excinfo.value
    assert isinstance(err, anthropic.InternalServerError)
    assert err.status_code == 502
    body = err.response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "api_error"
    assert body["error"]["message"].startswith("tapline: upstream")
    anthropic_span = err.response.headers.get("x-tapline-span-id")
    assert anthropic_span

    calls = payloads(sidecar.records(), "llm_call")
    assert [c["api"] for c in calls] == ["chat_completions", "chat_completions", "anthropic_messages"]
    assert calls[0]["span_id"] == openai_span and calls[2]["span_id"] == anthropic_span
    for c in calls:
        assert c["outcome"] == "upstream_unreachable"
        assert c["http_status"] == 502
        assert c["error"].startswith("tapline: upstream")
        assert c["streamed"] is False
        assert c["response_body"] == ""
        assert c["completions"] == []
        assert c["first_byte_unix_nanos"] == 0
        assert 0 < c["start_unix_nanos"] <= c["end_unix_nanos"]
        assert "authorization" not in c["request_headers"] and "x-api-key" not in c["request_headers"]
    assert [c["request_model"] for c in calls] == ["gpt-test", "gpt-test", "claude-test"]
    assert calls[1]["request_body"].find('"stream":true') != -1
