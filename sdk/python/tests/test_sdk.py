"""The Python SDK (`tapline`) against the real sidecar binary and a fake upstream.

Each test that records something stops its sidecar with SIGTERM (so every record is
flushed) and checks the store's records, read with `tapline-sidecar dump`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import threading
import time
import urllib.request
from decimal import Decimal
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

import fake_upstream as fake  # on sys.path through the sidecar's conftest
import tapline
from tapline_sidecar_conftest import closed_port, payloads  # registered by conftest.py

MESSAGES = [{"role": "user", "content": "hello"}]
UUID7 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}")
TOKEN = "s3cret-token"


# -- helpers ------------------------------------------------------------------------------


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="test", max_retries=0, timeout=20.0)


def control_requests(sidecar) -> int:
    """The sidecar's `tapline_control_requests_total` (every request under /tapline/)."""
    with urllib.request.urlopen(f"{sidecar.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    m = re.search(r"^tapline_control_requests_total (\d+)$", text, re.M)
    assert m, text
    return int(m.group(1))


def events_of(records: list[dict], kind: str) -> list[dict]:
    return [e for e in payloads(records, "episode_event") if e["kind"] == kind]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tapline" and r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No TAPLINE_* settings from the outside, and a fresh default client."""
    monkeypatch.delenv("TAPLINE_SIDECAR_URL", raising=False)
    monkeypatch.delenv("TAPLINE_CONTROL_TOKEN", raising=False)
    tapline.set_default_client(None)
    yield
    tapline.set_default_client(None)


class FakeSidecar:
    """An HTTP server that answers every request with one fixed status and body."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json"):
        answer = (status, body, content_type)
        self.requests = 0

        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                outer.requests += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, body, ctype = answer
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeSidecar":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def silent_port() -> Iterator[str]:
    """A URL whose server accepts connections and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


# -- recording through the sidecar ----------------------------------------------------------


def test_openai_episode_with_rewards_produces_exactly_the_expected_records(sidecar, upstream):
    client = tapline.Client(sidecar.url, fail_open=False)
    spans: list[str] = []
    with client.episode("t1", group_id="g1", metadata={"seed": 7, "harness": "pytest"}) as ep:
        assert ep.enabled and ep.id is not None and UUID7.fullmatch(ep.id), ep.id
        assert ep.base_url == f"{sidecar.url}/e/{ep.id}/v1"
        assert ep.anthropic_base_url == f"{sidecar.url}/e/{ep.id}"
        assert (ep.task_id, ep.group_id, ep.bound, ep.ended) == ("t1", "g1", False, False)

        llm = openai_client(ep.base_url)
        messages: list[dict] = list(MESSAGES)
        for turn in range(3):
            raw = llm.chat.completions.with_raw_response.create(model="gpt-test", messages=messages)
            reply = raw.parse().choices[0].message.content
            assert reply == fake.TEXT
            span = tapline.span_id(raw)
            assert span and span == raw.headers["x-tapline-span-id"]
            spans.append(span)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"turn {turn + 1}"}]
        llm.close()

        call_reward = ep.reward(0.25, span_id=spans[1], tags={"judge": "rule"})
        component = ep.reward(1, name="tests_passed")
        final = ep.reward(0.75)
        episode_id = ep.id
    assert ep.ended
    assert len({call_reward, component, final}) == 3 and None not in (call_reward, component, final)
    assert len(set(spans)) == 3

    # The upstream saw three plain calls, without tapline headers.
    assert [r.path for r in upstream.requests] == ["/v1/chat/completions"] * 3
    assert not [h for r in upstream.requests for h in r.header_names if h.startswith("x-tapline-")]

    records = sidecar.records()
    assert sorted(r["kind"] for r in records) == ["episode_event"] * 2 + ["llm_call"] * 3 + ["reward"] * 3, records

    [start] = events_of(records, "start")
    [end] = events_of(records, "end")
    for e in (start, end):
        assert (e["episode_id"], e["task_id"], e["group_id"]) == (episode_id, "t1", "g1")
    assert start["bound"] is False
    assert start["metadata"] == {"seed": "7", "harness": "pytest"}
    assert end["status"] == "succeeded"
    assert not end.get("metadata")
    assert end["incomplete"] is False

    calls = sorted(payloads(records, "llm_call"), key=lambda c: c["seq"])
    assert [c["seq"] for c in calls] == [0, 1, 2]
    assert [c["span_id"] for c in calls] == spans
    for c in calls:
        assert (c["episode_id"], c["task_id"], c["group_id"]) == (episode_id, "t1", "g1")
        assert c["path"] == "/v1/chat/completions"
        assert c["completions"][0]["text"] == fake.TEXT
        assert (c["outcome"], c["error"]) == ("ok", "")

    rewards = {r["reward_id"]: r for r in payloads(records, "reward")}
    assert set(rewards) == {call_reward, component, final}
    got = {rid: (r["episode_id"], r["name"], r["value"], r["span_id"], r.get("tags") or {}) for rid, r in rewards.items()}
    assert got == {
        call_reward: (episode_id, "", 0.25, spans[1], {"judge": "rule"}),
        component: (episode_id, "tests_passed", 1.0, "", {}),
        final: (episode_id, "", 0.75, "", {}),
    }
    assert start["time_unix_nanos"] <= calls[0]["start_unix_nanos"]
    assert max(r["time_unix_nanos"] for r in rewards.values()) <= end["time_unix_nanos"]


def test_anthropic_client_on_anthropic_base_url(sidecar, upstream):
    client = tapline.Client(sidecar.url, fail_open=False)
    with client.episode("t-anthropic", group_id="g-a") as ep:
        llm = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key="test", max_retries=0, timeout=20.0)
        raw = llm.messages.with_raw_response.create(model="claude-test", max_tokens=16, messages=MESSAGES)
        assert raw.parse().content[0].text == fake.TEXT
        span = tapline.span_id(raw)
        llm.close()
        ep.reward(1.0, span_id=span)
        episode_id = ep.id
    assert [r.path for r in upstream.requests] == ["/v1/messages"]

    records = sidecar.records()
    [call] = payloads(records, "llm_call")
    assert (call["episode_id"], call["task_id"], call["group_id"], call["seq"]) == (episode_id, "t-anthropic", "g-a", 0)
    assert call["path"] == "/v1/messages" and call["api"] == "anthropic_messages"
    [reward] = payloads(records, "reward")
    assert (reward["episode_id"], reward["span_id"], reward["value"]) == (episode_id, call["span_id"], 1.0)
    assert [e["status"] for e in events_of(records, "end")] == ["succeeded"]


def test_bound_episode_attributes_calls_on_the_plain_base_url(sidecar, upstream):
    client = tapline.Client(sidecar.url, fail_open=False)
    ep = client.start_episode("t-bound", group_id="g-bound", bind=True)
    assert ep.bound and ep.enabled
    assert tapline.Client(sidecar.url).health()["bound_episode"] == ep.id

    # An unmodified harness: its base URL is the sidecar's plain one, not ep.base_url.
    llm = openai_client(f"{sidecar.url}/v1")
    spans = [tapline.span_id(llm.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)) for _ in range(2)]
    ep.reward(0.5, span_id=spans[0])
    result = ep.end("failed", metadata={"reason": "tests failed", "attempts": 2})
    assert result == tapline.EndResult(calls=2, incomplete=False, known=True)
    assert client.health()["bound_episode"] is None
    # After the end the binding is gone: the next call is unattributed.
    llm.chat.completions.create(model="m", messages=MESSAGES)
    llm.close()

    records = sidecar.records()
    assert sorted(r["kind"] for r in records) == ["episode_event"] * 2 + ["llm_call"] * 3 + ["reward"]
    calls = payloads(records, "llm_call")
    bound_calls = sorted((c for c in calls if c["episode_id"] == ep.id), key=lambda c: c["seq"])
    assert [(c["seq"], c["task_id"], c["group_id"], c["span_id"]) for c in bound_calls] == [
        (0, "t-bound", "g-bound", spans[0]),
        (1, "t-bound", "g-bound", spans[1]),
    ]
    [other] = [c for c in calls if c["episode_id"] != ep.id]
    assert (other["episode_id"], other["task_id"]) == ("", "")
    [start] = events_of(records, "start")
    assert start["bound"] is True and start["task_id"] == "t-bound"
    [end] = events_of(records, "end")
    assert end["status"] == "failed"
    assert end["metadata"] == {"reason": "tests failed", "attempts": "2"}
    [reward] = payloads(records, "reward")
    assert (reward["episode_id"], reward["span_id"], reward["value"]) == (ep.id, spans[0], 0.5)


# -- validation ---------------------------------------------------------------------------


BAD_REWARD_VALUES = [
    math.nan,
    math.inf,
    -math.inf,
    float("-nan"),
    True,
    False,
    None,
    "1.0",
    b"1",
    10**400,  # an int beyond float's range
    Decimal("0.5"),
    complex(1, 0),
    [1.0],
]


def test_invalid_arguments_are_refused_before_anything_is_sent(sidecar):
    client = tapline.Client(sidecar.url, fail_open=False)
    ep = client.start_episode("t-invalid")
    aclient = tapline.AsyncClient(sidecar.url, fail_open=False)
    aep = tapline.AsyncEpisode(ep)
    before = control_requests(sidecar)

    for value in BAD_REWARD_VALUES:
        with pytest.raises(ValueError) as excinfo:
            ep.reward(value)
        assert isinstance(excinfo.value, tapline.InvalidArgument)
        assert isinstance(excinfo.value, tapline.TaplineError)
        assert "reward value" in str(excinfo.value)
        with pytest.raises(ValueError):
            asyncio.run(aep.reward(value))
    with pytest.raises(ValueError, match="finite"):
        ep.reward(math.nan)
    with pytest.raises(ValueError, match="finite"):
        ep.reward(-math.inf, name="format_ok")
    with pytest.raises(ValueError, match="real number"):
        ep.reward(True)

    bad_calls = [
        lambda: ep.reward(1.0, span_id="not a span id"),
        lambda: ep.reward(1.0, span_id=""),
        lambda: ep.reward(1.0, name=""),
        lambda: ep.reward(1.0, name=3),
        lambda: ep.reward(1.0, tags={"k": 1}),
        lambda: ep.reward(1.0, tags=["k"]),
        lambda: ep.end("great"),
        lambda: ep.end(""),
        lambda: ep.end("Succeeded"),
        lambda: ep.end(None),
        lambda: ep.end("succeeded", metadata={"x": math.nan}),
        lambda: ep.end("succeeded", metadata={1: "x"}),
        lambda: client.start_episode(""),
        lambda: client.start_episode("   "),
        lambda: client.start_episode(None),
        lambda: client.start_episode("t", group_id=3),
        lambda: client.start_episode("t", bind="yes"),
        lambda: client.start_episode("t", episode_id="bad/id"),
        lambda: client.start_episode("t", metadata={"k": object()}),
        lambda: client.episode("").__enter__(),
        lambda: asyncio.run(aclient.start_episode("")),
        lambda: asyncio.run(aep.end("done")),
        lambda: tapline.Client("localhost:4100"),
        lambda: tapline.Client(sidecar.url, timeout=0),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call #{i} was accepted")

    # The sidecar saw none of them, and the episode is still open.
    assert control_requests(sidecar) == before
    assert not ep.ended

    # Real finite numbers of any kind are fine.
    assert ep.reward(3, name="int") and ep.reward(Fraction(1, 4), name="fraction") and ep.reward(-0.0, name="zero")
    assert ep.end("timed_out")
    records = sidecar.records()
    values = {r["name"]: r["value"] for r in payloads(records, "reward")}
    assert values == {"int": 3.0, "fraction": 0.25, "zero": 0.0}
    assert [e["status"] for e in events_of(records, "end")] == ["timed_out"]


def test_span_id_helper():
    assert tapline.span_id(httpx.Response(200, headers={"X-Tapline-Span-Id": "abc-1"})) == "abc-1"
    assert tapline.span_id({"X-Tapline-Span-Id": "abc-2"}) == "abc-2"
    assert tapline.span_id({"content-type": "application/json"}) is None
    assert tapline.span_id(httpx.Response(200)) is None
    with pytest.raises(TypeError):
        tapline.span_id(42)


def test_client_settings_from_the_environment(monkeypatch):
    assert tapline.Client().url == tapline.DEFAULT_URL == "http://127.0.0.1:4100"
    monkeypatch.setenv("TAPLINE_SIDECAR_URL", "http://sidecar.local:9000/")
    monkeypatch.setenv("TAPLINE_CONTROL_TOKEN", "from-env")
    client = tapline.Client()
    assert client.url == "http://sidecar.local:9000"
    assert client.fail_open is True and client.timeout == 5.0
    assert "token=set" in repr(client)
    assert tapline.Client("https://other:1").url == "https://other:1"
    assert tapline.Client("http://127.0.0.1:4100/v1/").url == "http://127.0.0.1:4100"  # not the LLM base URL
    assert tapline.Client("http://gateway/sidecar-7").url == "http://gateway/sidecar-7"
    assert tapline.default_client().url == "http://sidecar.local:9000"
    assert tapline.AsyncClient().url == "http://sidecar.local:9000"


# -- the sidecar down, fail-open and fail-closed ------------------------------------------


def test_sidecar_down_fail_open_keeps_the_harness_running(caplog, monkeypatch):
    url = f"http://127.0.0.1:{closed_port()}"
    client = tapline.Client(url, timeout=2.0)
    ran = []
    with caplog.at_level(logging.WARNING, logger="tapline"):
        with client.episode("t-down", group_id="g") as ep:
            assert ep.id is None and not ep.enabled
            assert ep.base_url == f"{url}/v1" and ep.anthropic_base_url == url
            assert ep.reward(1.0) is None
            assert ep.reward(0.5, name="format_ok", span_id="0193a0b2-7c3d-7def-8123-456789abcdef") is None
            ran.append("harness")
        assert ep.ended
        # Invalid values are still refused, also without a sidecar.
        with pytest.raises(ValueError):
            ep.reward(math.nan)
        # The harness's own exception goes through untouched.
        with pytest.raises(KeyError, match="mine"):
            with client.episode("t-down") as ep2:
                raise KeyError("mine")
        assert ep2.ended
        # The module-level helper, configured from the environment.
        monkeypatch.setenv("TAPLINE_SIDECAR_URL", url)
        with tapline.episode(task_id="t-module", group_id="g") as ep3:
            assert ep3.base_url == f"{url}/v1"
            ep3.reward(0.0)
            ran.append("module")
    assert ran == ["harness", "module"]
    warnings = warnings_of(caplog)
    # One warning per episode start; the disabled episodes' rewards and ends send nothing.
    assert len(warnings) == 3, warnings
    assert all(url in w and "fail_open" in w for w in warnings), warnings
    assert "t-down" in warnings[0]


def test_sidecar_down_fail_closed_raises():
    url = f"http://127.0.0.1:{closed_port()}"
    client = tapline.Client(url, fail_open=False, timeout=2.0)
    with pytest.raises(tapline.SidecarUnavailable) as excinfo:
        client.start_episode("t-down")
    assert isinstance(excinfo.value, tapline.TaplineError)
    assert excinfo.value.url == f"{url}/tapline/v1/episodes"
    assert "refused" in str(excinfo.value).lower()

    ran = False
    with pytest.raises(tapline.SidecarUnavailable):
        with client.episode("t-down"):
            ran = True
    assert not ran
    with pytest.raises(tapline.SidecarUnavailable):
        asyncio.run(tapline.AsyncClient(url, fail_open=False).start_episode("t-down"))
    # health() is a check: it raises in either mode.
    with pytest.raises(tapline.SidecarUnavailable):
        tapline.Client(url).health()


def test_silent_sidecar_times_out(silent_port, caplog):
    client = tapline.Client(silent_port, fail_open=False, timeout=0.3)
    started = time.monotonic()
    with pytest.raises(tapline.SidecarUnavailable, match="timed out"):
        client.start_episode("t-silent")
    assert time.monotonic() - started < 3.0
    with caplog.at_level(logging.WARNING, logger="tapline"):
        ep = tapline.Client(silent_port, timeout=0.3).start_episode("t-silent")
    assert not ep.enabled
    assert len(warnings_of(caplog)) == 1


def test_sidecar_lost_mid_episode(sidecar, caplog):
    open_ep = tapline.Client(sidecar.url).start_episode("t-lost", group_id="open")
    closed_ep = tapline.Client(sidecar.url, fail_open=False).start_episode("t-lost", group_id="closed")
    sidecar.stop()

    with caplog.at_level(logging.WARNING, logger="tapline"):
        assert open_ep.reward(1.0) is None
        assert open_ep.end("succeeded") is None
    assert open_ep.ended
    assert len(warnings_of(caplog)) == 2

    with pytest.raises(tapline.SidecarUnavailable):
        closed_ep.reward(1.0)
    with pytest.raises(tapline.SidecarUnavailable):
        closed_ep.end("failed")
    assert not closed_ep.ended  # the end can be tried again

    # Only the two starts were recorded.
    records = sidecar.dump()
    assert sorted((r["kind"], r["episode_event"]["kind"], r["episode_event"]["group_id"]) for r in records) == [
        ("episode_event", "start", "closed"),
        ("episode_event", "start", "open"),
    ]


def test_server_errors_fail_open_but_client_errors_raise(caplog):
    error = json.dumps({"error": {"message": "the sidecar could not queue the record", "code": "record_dropped"}})
    with FakeSidecar(503, error.encode()) as busy:
        with caplog.at_level(logging.WARNING, logger="tapline"):
            ep = tapline.Client(busy.url).start_episode("t-busy")
        assert not ep.enabled
        assert len(warnings_of(caplog)) == 1 and "record_dropped" in warnings_of(caplog)[0]
        with pytest.raises(tapline.SidecarRejected) as excinfo:
            tapline.Client(busy.url, fail_open=False).start_episode("t-busy")
        assert (excinfo.value.status, excinfo.value.code) == (503, "record_dropped")
        assert excinfo.value.message == "the sidecar could not queue the record"

    # Not a sidecar at all: a plain-text 404 is a rejection, even in fail-open mode.
    with FakeSidecar(404, b"Not Found", "text/plain") as other:
        with pytest.raises(tapline.SidecarRejected) as excinfo:
            tapline.Client(other.url).start_episode("t-other")
        assert (excinfo.value.status, excinfo.value.code, excinfo.value.message) == (404, None, "Not Found")

    # A 2xx answer that is not JSON: unavailable.
    with FakeSidecar(200, b"<html>hello</html>", "text/html") as html:
        with pytest.raises(tapline.SidecarUnavailable, match="not a JSON object"):
            tapline.Client(html.url, fail_open=False).start_episode("t-html")
        assert not tapline.Client(html.url).start_episode("t-html").enabled


# -- the context manager ------------------------------------------------------------------


def test_context_manager_ends_aborted_on_exception(sidecar, upstream):
    client = tapline.Client(sidecar.url, fail_open=False)
    with pytest.raises(RuntimeError, match="harness crashed"):
        with client.episode("t-abort", group_id="g") as ep1:
            ep1.reward(0.1, name="partial")
            raise RuntimeError("harness crashed")
    assert ep1.ended

    # Ended in the block: nothing more on exit.
    with client.episode("t-early") as ep2:
        ep2.end("failed")
    with pytest.raises(tapline.TaplineError, match="already ended"):
        ep2.end()
    # A reward after the end is refused by the sidecar, and nothing is recorded.
    with pytest.raises(tapline.SidecarRejected) as excinfo:
        ep2.reward(1.0)
    assert (excinfo.value.status, excinfo.value.code) == (409, "episode_ended")

    # Ended in the block, then an exception: it propagates, no second end.
    with pytest.raises(ZeroDivisionError):
        with client.episode("t-ended-then-raise") as ep3:
            ep3.end("timed_out")
            1 / 0  # noqa: B018

    # An episode is a context manager itself.
    with client.start_episode("t-direct") as ep4:
        pass
    assert ep4.ended

    # The module-level helper on the default client.
    tapline.set_default_client(client)
    with pytest.raises(ValueError, match="bad input"):
        with tapline.episode(task_id="t-module", group_id="g-module") as ep5:
            raise ValueError("bad input")

    records = sidecar.records()
    starts = events_of(records, "start")
    ends = events_of(records, "end")
    assert len(starts) == len(ends) == 5
    assert {e["episode_id"] for e in starts} == {e["episode_id"] for e in ends} == {ep.id for ep in (ep1, ep2, ep3, ep4, ep5)}
    got = {e["task_id"]: (e["status"], e.get("metadata") or {}) for e in ends}
    assert got == {
        "t-abort": ("aborted", {"exception": "RuntimeError"}),
        "t-early": ("failed", {}),
        "t-ended-then-raise": ("timed_out", {}),
        "t-direct": ("succeeded", {}),
        "t-module": ("aborted", {"exception": "ValueError"}),
    }
    [reward] = payloads(records, "reward")
    assert (reward["episode_id"], reward["name"], reward["value"]) == (ep1.id, "partial", 0.1)


# -- asyncio ------------------------------------------------------------------------------


def test_async_client_flow(sidecar, upstream, caplog):
    down_url = f"http://127.0.0.1:{closed_port()}"

    async def harness() -> tuple[str, list[str], list[str]]:
        client = tapline.AsyncClient(sidecar.url, fail_open=False)
        async with client.episode("t-async", group_id="g-async", metadata={"k": "v"}) as ep:
            assert ep.base_url == f"{sidecar.url}/e/{ep.id}/v1"
            llm = openai.AsyncOpenAI(base_url=ep.base_url, api_key="test", max_retries=0, timeout=20.0)
            spans = []
            for turn in range(2):
                raw = await llm.chat.completions.with_raw_response.create(
                    model="gpt-test", messages=[*MESSAGES, {"role": "user", "content": f"turn {turn}"}]
                )
                spans.append(tapline.span_id(raw))
            await llm.close()
            reward_ids = [
                await ep.reward(0.5, span_id=spans[0]),
                await ep.reward(1.0, name="tests_passed"),
                await ep.reward(0.9),
            ]
            episode_id = ep.id
        assert ep.ended

        with pytest.raises(ValueError, match="boom"):
            async with client.episode("t-async-abort"):
                raise ValueError("boom")

        # A cancelled harness task ends its episode as aborted.
        entered = asyncio.Event()

        async def long_harness() -> None:
            async with client.episode("t-async-cancel"):
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(long_harness())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        # Ended explicitly.
        ep4 = await client.start_episode("t-async-explicit")
        assert await ep4.end("failed") == tapline.EndResult(calls=0, incomplete=False, known=True)
        assert (await client.health())["open_episodes"] == 0

        # The sidecar down: fail-open goes on, fail-closed raises.
        async with tapline.AsyncClient(down_url, timeout=2.0).episode("t-async-down") as down:
            assert not down.enabled and down.base_url == f"{down_url}/v1"
            assert await down.reward(1.0) is None
        with pytest.raises(tapline.SidecarUnavailable):
            async with tapline.AsyncClient(down_url, fail_open=False, timeout=2.0).episode("t-async-down"):
                pytest.fail("the block must not run")
        return episode_id, spans, reward_ids

    with caplog.at_level(logging.WARNING, logger="tapline"):
        episode_id, spans, reward_ids = asyncio.run(harness())
    assert len(warnings_of(caplog)) == 1

    records = sidecar.records()
    mine = [r for r in records if (r.get("llm_call") or r.get("reward") or r.get("episode_event"))["episode_id"] == episode_id]
    assert sorted(r["kind"] for r in mine) == ["episode_event"] * 2 + ["llm_call"] * 2 + ["reward"] * 3
    calls = sorted(payloads(mine, "llm_call"), key=lambda c: c["seq"])
    assert [(c["seq"], c["span_id"], c["task_id"], c["group_id"]) for c in calls] == [
        (0, spans[0], "t-async", "g-async"),
        (1, spans[1], "t-async", "g-async"),
    ]
    rewards = {r["reward_id"]: (r["name"], r["value"], r["span_id"]) for r in payloads(mine, "reward")}
    assert rewards == {
        reward_ids[0]: ("", 0.5, spans[0]),
        reward_ids[1]: ("tests_passed", 1.0, ""),
        reward_ids[2]: ("", 0.9, ""),
    }
    [start] = events_of(mine, "start")
    assert start["metadata"] == {"k": "v"}
    ends = {e["task_id"]: (e["status"], e.get("metadata") or {}) for e in events_of(records, "end")}
    assert ends == {
        "t-async": ("succeeded", {}),
        "t-async-abort": ("aborted", {"exception": "ValueError"}),
        "t-async-cancel": ("aborted", {"exception": "CancelledError"}),
        "t-async-explicit": ("failed", {}),
    }
    assert len(records) == len(mine) + 6  # the other three episodes' starts and ends


# -- the control token --------------------------------------------------------------------


def test_control_token_is_sent(start_sidecar, upstream, monkeypatch):
    sidecar = start_sidecar(upstream.url, ["--control-token", TOKEN])

    # Without the token, or with a wrong one: refused, also fail-open (a configuration
    # error, not an outage).
    for client in (tapline.Client(sidecar.url), tapline.Client(sidecar.url, token="wrong")):
        with pytest.raises(tapline.SidecarRejected) as excinfo:
            client.start_episode("t-token")
        assert (excinfo.value.status, excinfo.value.code) == (401, "unauthorized")
        assert "control token" in excinfo.value.message

    with tapline.Client(sidecar.url, token=TOKEN, fail_open=False).episode("t-token-arg") as ep1:
        ep1.reward(1.0)
    monkeypatch.setenv("TAPLINE_CONTROL_TOKEN", TOKEN)
    with tapline.Client(sidecar.url, fail_open=False).episode("t-token-env") as ep2:
        ep2.reward(0.5)

    async def harness() -> None:
        async with tapline.AsyncClient(sidecar.url, fail_open=False).episode("t-token-async") as ep:
            await ep.reward(0.25)

    asyncio.run(harness())

    records = sidecar.records()
    ends = {e["task_id"]: e["status"] for e in events_of(records, "end")}
    assert ends == {"t-token-arg": "succeeded", "t-token-env": "succeeded", "t-token-async": "succeeded"}
    assert sorted(r["value"] for r in payloads(records, "reward")) == [0.25, 0.5, 1.0]
    assert len(records) == 9


# -- the README's harness examples --------------------------------------------------------


def readme_examples() -> list[str]:
    """The Python blocks of the README section "Adding tapline to a harness"."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    start = readme.index("## Adding tapline to a harness")
    end = readme.find("\n## ", start + 1)
    section = readme[start : end if end != -1 else len(readme)]
    return re.findall(r"^```python\n(.*?)^```$", section, re.M | re.S)


def test_readme_harness_examples_run_and_record(sidecar, upstream, monkeypatch, caplog):
    openai_example, anthropic_example = readme_examples()
    for code in (openai_example, anthropic_example):
        assert len(code.splitlines()) < 30
    monkeypatch.setenv("TAPLINE_SIDECAR_URL", sidecar.url)
    with caplog.at_level(logging.WARNING, logger="tapline"):
        exec(compile(openai_example, "README.md (OpenAI example)", "exec"), {"__name__": "readme_openai"})
        exec(compile(anthropic_example, "README.md (Anthropic example)", "exec"), {"__name__": "readme_anthropic"})
    assert warnings_of(caplog) == []

    records = sidecar.records()
    starts = {e["episode_id"]: e for e in events_of(records, "start")}
    ends = {e["episode_id"]: e for e in events_of(records, "end")}
    assert starts.keys() == ends.keys() and len(starts) == 5
    calls = payloads(records, "llm_call")
    rewards = payloads(records, "reward")
    for eid, start in starts.items():
        mine = sorted((c for c in calls if c["episode_id"] == eid), key=lambda c: c["seq"])
        my_rewards = [r for r in rewards if r["episode_id"] == eid]
        if start["task_id"] == "add-17-25":  # the OpenAI example: the fake never answers, 3 turns
            assert start["group_id"] == "add-17-25/b1"
            assert [c["seq"] for c in mine] == [0, 1, 2] and {c["path"] for c in mine} == {"/v1/chat/completions"}
            assert sorted((r["name"], r["value"], r["span_id"]) for r in my_rewards) == sorted(
                [("format_ok", 0.0, c["span_id"]) for c in mine] + [("correct", 0.0, ""), ("", pytest.approx(-0.2), "")]
            )
            assert ends[eid]["status"] == "timed_out"
        else:  # the Anthropic example: the fake calls the tool every turn, 4 turns
            assert (start["task_id"], start["group_id"]) == ("fix-issue-123", "nightly-7")
            assert [c["seq"] for c in mine] == [0, 1, 2, 3] and {c["path"] for c in mine} == {"/v1/messages"}
            assert sorted((r["name"], r["value"]) for r in my_rewards) == [("", 0.8)] + [("tests_passed", 0.8)] * 4
            assert ends[eid]["status"] == "succeeded"
    assert sorted(s["metadata"]["sample"] for s in starts.values() if s["task_id"] == "add-17-25") == ["0", "1", "2", "3"]
    assert len(records) == len(calls) + len(rewards) + 10
