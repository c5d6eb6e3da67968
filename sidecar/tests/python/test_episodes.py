"""Episode attribution through the control API (`/tapline/v1/...`), with urllib."""

from __future__ import annotations

import re

import openai

import fake_upstream as fake
from conftest import http_json, payloads

MESSAGES = [{"role": "user", "content": "hello"}]


def test_health(sidecar, upstream):
    status, headers, body = http_json("GET", f"{sidecar.url}/tapline/v1/health")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert body["status"] == "ok"
    assert body["sidecar_id"] == "pytest"
    assert body["upstream"] == upstream.url
    assert body["open_episodes"] == 0


def test_episode_calls_rewards_and_end_are_attributed(upstream, sidecar):
    status, _, created = http_json("POST", f"{sidecar.url}/tapline/v1/episodes", {"task_id": "t1", "group_id": "g1"})
    assert status == 201, created
    episode_id = created["episode_id"]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", episode_id), episode_id
    assert created["task_id"] == "t1" and created["group_id"] == "g1" and created["bound"] is False
    base_url = created["base_url"]
    assert base_url == f"{sidecar.url}/e/{episode_id}/v1"

    client = openai.OpenAI(base_url=base_url, api_key="test", max_retries=0, timeout=20.0)
    span_ids = []
    for turn in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-test", messages=[*MESSAGES, {"role": "user", "content": f"turn {turn}"}]
        )
        completion = raw.parse()
        assert completion.choices[0].message.content == fake.TEXT
        span_id = raw.headers.get("x-tapline-span-id")
        assert span_id, dict(raw.headers)
        span_ids.append(span_id)
    client.close()
    assert len(set(span_ids)) == 2

    # The upstream saw plain API paths and no tapline headers.
    assert [r.path for r in upstream.requests] == ["/v1/chat/completions"] * 2
    for r in upstream.requests:
        assert not [h for h in r.header_names if h.startswith("x-tapline-")], r.headers
    assert [r.body["messages"][-1]["content"] for r in upstream.requests] == ["turn 0", "turn 1"]

    status, _, reward = http_json("POST", f"{sidecar.url}/tapline/v1/episodes/{episode_id}/rewards", {"value": 1.0})
    assert status == 201, reward
    assert reward["episode_id"] == episode_id and reward["reward_id"]

    status, _, health = http_json("GET", f"{sidecar.url}/tapline/v1/health")
    assert health["open_episodes"] == 1

    status, _, ended = http_json("POST", f"{sidecar.url}/tapline/v1/episodes/{episode_id}/end", {"status": "succeeded"})
    assert status == 200, ended
    assert ended["episode_id"] == episode_id
    assert ended["status"] == "succeeded"
    assert ended["calls"] == 2
    assert ended["known"] is True
    assert ended["incomplete"] is False

    # The end event cuts a segment at once: the records show up without stopping the sidecar.
    records = sidecar.wait_for_records(
        lambda rs: len(rs) >= 5
        and any(r["kind"] == "episode_event" and r["episode_event"]["kind"] == "end" for r in rs)
    )
    assert len(records) == 5, records
    assert len({r["id"] for r in records}) == 5
    seqs = [r["sidecar_seq"] for r in records]
    assert seqs == sorted(seqs)

    calls = sorted(payloads(records, "llm_call"), key=lambda c: c["seq"])
    assert [c["seq"] for c in calls] == [0, 1]
    assert [c["span_id"] for c in calls] == span_ids
    for c in calls:
        assert c["episode_id"] == episode_id
        assert c["task_id"] == "t1"
        assert c["group_id"] == "g1"
        assert c["path"] == "/v1/chat/completions"
        assert c["api"] == "chat_completions"
        assert c["http_status"] == 200
        assert c["completions"][0]["text"] == fake.TEXT
        assert not [h for h in c["request_headers"] if h.startswith("x-tapline-")]

    [reward_record] = payloads(records, "reward")
    assert reward_record["reward_id"] == reward["reward_id"]
    assert reward_record["episode_id"] == episode_id
    assert reward_record["value"] == 1.0
    assert reward_record["span_id"] == ""
    assert reward_record["name"] == ""

    events = payloads(records, "episode_event")
    assert [e["kind"] for e in events] == ["start", "end"]
    start, end = events
    for e in events:
        assert (e["episode_id"], e["task_id"], e["group_id"]) == (episode_id, "t1", "g1")
    assert start["status"] == "unspecified"
    assert start["bound"] is False
    assert end["status"] == "succeeded"
    assert end["incomplete"] is False and end["dropped_records"] == 0
    assert start["time_unix_nanos"] <= calls[0]["start_unix_nanos"]
    assert calls[1]["end_unix_nanos"] <= reward_record["time_unix_nanos"] <= end["time_unix_nanos"]

    # Outcomes last, so that every other field is checked first.
    assert [(c["outcome"], c["error"]) for c in calls] == [("ok", "")] * 2


def test_bad_control_requests_get_json_errors(sidecar):
    status, _, created = http_json("POST", f"{sidecar.url}/tapline/v1/episodes", {"task_id": "t1", "group_id": "g1"})
    assert status == 201
    rewards_url = f"{sidecar.url}/tapline/v1/episodes/{created['episode_id']}/rewards"

    status, headers, body = http_json("POST", rewards_url, {"value": "NaN"})
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert body["error"]["code"] == "invalid_value"
    assert "finite" in body["error"]["message"]

    # Not JSON at all (Python writes a bare NaN, which JSON does not allow).
    status, _, body = http_json("POST", rewards_url, b'{"value": NaN}')
    assert status == 400
    assert body["error"]["code"] == "invalid_json"

    status, _, body = http_json("POST", rewards_url, {"value": 0.5, "bogus": 1})
    assert status == 400 and body["error"]["code"] == "invalid_json"

    status, _, body = http_json("POST", f"{sidecar.url}/tapline/v1/episodes", {"group_id": "g1"})
    assert status == 400 and body["error"]["code"] == "invalid_json"

    status, _, body = http_json("POST", f"{sidecar.url}/tapline/v1/episodes/not%20an%20id/rewards", {"value": 1})
    assert status == 400 and body["error"]["code"] == "invalid_episode_id"

    status, _, body = http_json("POST", f"{sidecar.url}/tapline/v1/episodes/{created['episode_id']}/end", {"status": "great"})
    assert status == 400 and body["error"]["code"] == "invalid_status"

    status, _, body = http_json("GET", f"{sidecar.url}/tapline/v1/episodes")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"

    status, _, body = http_json("GET", f"{sidecar.url}/tapline/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"

    # A bad episode id in a proxied path is refused before anything is forwarded.
    status, _, body = http_json("POST", f"{sidecar.url}/e/bad%21id/v1/chat/completions", {"model": "m"})
    assert status == 400 and body["error"]["code"] == "invalid_episode_id"

    # Only the episode start was recorded: refused requests write nothing.
    records = sidecar.records()
    assert [r["kind"] for r in records] == ["episode_event"]
