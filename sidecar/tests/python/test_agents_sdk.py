"""An established agent framework, run unmodified, through the sidecar: the OpenAI Agents
SDK (`openai-agents`, pinned in xtask/requirements-test.txt).

`examples/agents_sdk_harness.py` is an ordinary Agents SDK program (an `Agent` with one
`@function_tool`, run with `Runner.run_sync`) plus a few lines marked `# tapline:`. This
test imports that file and runs its `run()` against the real sidecar in front of the
fake upstream, scripted to answer like a model that calls the tool and then answers.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
import time

import pytest
import tapline  # `cargo xtask test` installs sdk/python before running pytest

from conftest import REPO_ROOT, payloads

HARNESS = REPO_ROOT / "examples" / "agents_sdk_harness.py"
MODEL = "gpt-test-agents"
TOOL_CALL_ID = "call_mul1"
TOOL_CALL = {"id": TOOL_CALL_ID, "type": "function", "function": {"name": "multiply", "arguments": '{"a":17,"b":23}'}}
FINAL_ANSWER = "17 * 23 = 391.\nANSWER: 391"
MARK = "# tapline:"


def load_harness():
    spec = importlib.util.spec_from_file_location("agents_sdk_harness", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def harness():
    """The example's module, freshly imported (it imports the Agents SDK, `agents`)."""
    module = load_harness()
    yield module
    tapline.set_default_client(None)
    sys.modules.pop("agents_sdk_harness", None)


@pytest.fixture
def started_episodes(monkeypatch) -> list:
    """Every episode the tapline SDK starts (a spy on `Client.start_episode`)."""
    started: list = []
    real = tapline.Client.start_episode

    def spy(self, *args, **kwargs):
        ep = real(self, *args, **kwargs)
        started.append(ep)
        return ep

    monkeypatch.setattr(tapline.Client, "start_episode", spy)
    return started


def test_agents_sdk_harness_runs_unmodified_through_the_sidecar(upstream, sidecar, harness, started_episodes):
    # The model first calls the tool, then answers with the tool's result.
    upstream.script_chat({"tool_calls": [TOOL_CALL]}, {"content": FINAL_ANSWER})
    tapline.set_default_client(tapline.Client(sidecar.url, fail_open=False))
    [task] = harness.TASKS

    t0 = time.monotonic()
    output = harness.run(task, MODEL)
    elapsed = time.monotonic() - t0
    print(f"Agents SDK run through the sidecar: {elapsed:.3f}s")

    assert output == FINAL_ANSWER
    [ep] = started_episodes
    assert ep.id and ep.ended
    assert ep.task_id == task["id"] and ep.group_id == f"{task['id']}/b1"

    # The upstream saw two plain chat completions requests from the Agents SDK: the
    # second carries the assistant's tool call and the tool's result.
    reqs = upstream.requests
    assert [r.path for r in reqs] == ["/v1/chat/completions"] * 2
    for r in reqs:
        assert not [h for h in r.header_names if h.startswith("x-tapline-")], r.headers
        assert r.header("authorization") == "Bearer unused"
        assert r.body["model"] == MODEL
        assert not r.body.get("stream")  # Runner.run_sync does not stream
        assert [t["function"]["name"] for t in r.body["tools"]] == ["multiply"]
    first, second = (r.body for r in reqs)
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert first["messages"][1]["content"] == task["prompt"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "tool"]
    assert second["messages"][2]["tool_calls"][0]["id"] == TOOL_CALL_ID
    assert second["messages"][3] == {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": "391"}
    # What the Agents SDK sends besides model/messages/tools (printed for the record).
    print("request keys:", [sorted(r.body) for r in reqs])

    records = sidecar.records()
    calls = payloads(records, "llm_call")
    assert len(calls) == 2, calls
    assert [c["seq"] for c in calls] == [0, 1]
    assert calls[0]["end_unix_nanos"] <= calls[1]["start_unix_nanos"]
    sent = upstream.wait_responses_finished()
    for call, req, resp in zip(calls, reqs, sent):
        assert (call["episode_id"], call["task_id"], call["group_id"]) == (ep.id, ep.task_id, ep.group_id)
        assert call["api"] == "chat_completions" and call["path"] == "/v1/chat/completions"
        assert call["streamed"] is False and call["http_status"] == 200
        # Byte for byte what the SDK sent and what the upstream answered.
        assert call["request_body"].encode() == req.raw_body
        assert call["response_body"].encode() == resp.body
        assert call["request_model"] == MODEL
    assert json.loads(calls[1]["request_body"])["messages"][3] == {
        "role": "tool",
        "tool_call_id": TOOL_CALL_ID,
        "content": "391",
    }
    assert calls[1]["completions"][0]["text"] == FINAL_ANSWER

    [reward] = payloads(records, "reward")
    assert reward["episode_id"] == ep.id
    assert reward["value"] == 1.0 and reward["name"] == "" and reward["span_id"] == ""
    assert calls[1]["end_unix_nanos"] <= reward["time_unix_nanos"]

    events = payloads(records, "episode_event")
    assert [(e["kind"], e["episode_id"]) for e in events] == [("start", ep.id), ("end", ep.id)]
    assert events[1]["status"] == "succeeded" and events[1]["incomplete"] is False
    assert len(records) == 5, records

    assert [(c["outcome"], c["error"]) for c in calls] == [("ok", "")] * 2


def test_agents_sdk_harness_changes_only_marked_lines():
    """Everything of the harness that touches tapline (the `tapline` module, the episode
    `ep`, the disabled trace upload) is on a line marked `# tapline:` or under a marked
    comment; the rest is the Agents SDK program as it would be without tapline."""
    source = HARNESS.read_text()
    lines = source.splitlines()

    def marked(lineno: int) -> bool:
        if MARK in lines[lineno - 1]:
            return True
        # A statement under a comment block that starts with the mark.
        n = lineno - 2
        while n >= 0 and lines[n].lstrip().startswith("#"):
            if lines[n].lstrip().startswith(MARK):
                return True
            n -= 1
        return False

    touching = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in ("tapline", "ep", "set_tracing_disabled"):
            touching.add(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name == "tapline" for a in node.names):
            touching.add(node.lineno)
    # The `with` line of the episode holds the block's statements; those are checked one
    # by one, so the block's own ordinary lines (Agent, Runner) are not tapline's.
    unmarked = [f"{n}: {lines[n - 1].strip()}" for n in sorted(touching) if not marked(n)]
    assert not unmarked, "harness lines that touch tapline without a '# tapline:' mark:\n" + "\n".join(unmarked)
    assert len(touching) >= 6, touching  # the import, the episode, base URL, reward, client, tracing
    # The Agents SDK program itself: an Agent with a function tool, run by the Runner,
    # with the SDK's own OpenAI-compatible model class.
    assert re.search(r"^@function_tool$", source, re.M)
    assert "Runner.run_sync(agent" in source and "OpenAIChatCompletionsModel(" in source
