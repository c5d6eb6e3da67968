"""What `cargo xtask swe --smoke` checks after its rollouts, and the figures it reports.

    python check.py --sidecar-bin BIN --store URL --store-dir DIR --rollouts DIR [--metrics FILE]

For every rollout (`result.json` beside mini-swe-agent's `trajectory.json`):
- every LLM call the sidecar recorded for the episode is one the agent made, in order:
  the request's messages are the agent's own history at that step (its trajectory, the
  `extra` bookkeeping aside) and the recorded answer is the assistant message that
  follows in it; there are as many calls as assistant messages;
- every call of the store belongs to a rollout's episode (none unattributed, none in
  another episode);
- the rewards recorded are the grader's: final reward, fail_to_pass, pass_to_pass.
Prints one JSON object: calls, actions run, prompt growth, stored bytes per call and the
compression ratio (`zstd -dc` of each segment is its records), the sidecar's added
latency as a share of the rollouts' wall time, and the rewards.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path


def fail(message: str) -> None:
    print(f"swe check: {message}", file=sys.stderr)
    sys.exit(1)


def plain(message: dict) -> dict:
    """A trajectory message as the agent sent it: without mini-swe-agent's `extra` and
    the fields LiteLLM drops when they are None."""
    return {k: v for k, v in message.items() if k != "extra" and v is not None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sidecar-bin", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--store-dir", required=True)
    parser.add_argument("--rollouts", required=True)
    parser.add_argument("--metrics", default=None, help="the /metrics of the sidecar of --metrics-model's rollouts")
    parser.add_argument("--metrics-model", default=None, help="the model whose rollouts went through that sidecar")
    args = parser.parse_args()

    dump = subprocess.run([args.sidecar_bin, "dump", "--store", args.store], capture_output=True, text=True)
    if dump.returncode != 0:
        fail(f"dump failed: {dump.stderr}")
    records = [json.loads(line) for line in dump.stdout.splitlines() if line.strip()]
    calls_by_episode: dict[str, list[dict]] = {}
    rewards_by_episode: dict[str, list[dict]] = {}
    for record in records:
        if record["kind"] == "llm_call":
            calls_by_episode.setdefault(record["llm_call"]["episode_id"], []).append(record["llm_call"])
        elif record["kind"] == "reward":
            rewards_by_episode.setdefault(record["reward"]["episode_id"], []).append(record["reward"])

    results = [json.loads(p.read_text()) for p in sorted(Path(args.rollouts).glob("*/result.json"))]
    if not results:
        fail(f"no rollout results under {args.rollouts}")
    episodes = {r["episode_id"] for r in results}
    if None in episodes or len(episodes) != len(results):
        fail(f"rollouts without their own episode: {[r['episode_id'] for r in results]}")
    stray = set(calls_by_episode) - episodes
    if stray:
        fail(f"calls outside the rollouts' episodes: {sorted(stray)} ({sum(len(calls_by_episode[e]) for e in stray)} calls)")

    actions = 0
    prompt_chars: list[list[int]] = []
    for result in results:
        episode = result["episode_id"]
        trajectory = json.loads(Path(result["trajectory"]).read_text())
        messages = trajectory["messages"]
        # A model turn: an assistant message, or (when the answer held no valid action)
        # the format-error message mini-swe-agent appended instead, which keeps the
        # answer in `extra.model_response`.
        assistant = [
            i for i, m in enumerate(messages)
            if m["role"] == "assistant" or "model_response" in (m.get("extra") or {})
        ]
        calls = sorted(calls_by_episode.get(episode, []), key=lambda c: (c["start_unix_nanos"], c["seq"]))
        if len(calls) != len(assistant):
            fail(f"{result['task']}-{result['sample']}: {len(calls)} calls recorded, {len(assistant)} model turns in the trajectory")
        sizes = []
        for n, (call, at) in enumerate(zip(calls, assistant)):
            request = json.loads(call["request_body"])
            sent = request["messages"]
            if len(sent) != at or sent != [plain(m) for m in messages[:at]]:
                fail(f"{result['task']}-{result['sample']} call {n}: the recorded request is not the agent's history at that step")
            turn = messages[at]
            answer = turn["content"] if turn["role"] == "assistant" else turn["extra"]["model_response"]
            if call["completions"][0]["text"] != answer:
                fail(f"{result['task']}-{result['sample']} call {n}: recorded answer {call['completions'][0]['text']!r} != trajectory {answer!r}")
            sizes.append(len(call["request_body"]))
            if turn["role"] == "assistant":
                actions += len((turn.get("extra") or {}).get("actions", []))
        prompt_chars.append(sizes)
        rewards = {(r["name"], r["span_id"]): r["value"] for r in rewards_by_episode.get(episode, [])}
        want = {("", ""): result["reward"], ("fail_to_pass", ""): result["fail_to_pass"], ("pass_to_pass", ""): result["pass_to_pass"]}
        if rewards != want:
            fail(f"{result['task']}-{result['sample']}: rewards recorded {rewards}, the grader gave {want}")
        passed = sum(result["tests"].values()) / len(result["tests"])
        if passed != result["reward"]:
            fail(f"{result['task']}-{result['sample']}: reward {result['reward']} but {passed} of the hidden tests passed")

    stored = 0
    bodies = []
    for segment in sorted(Path(args.store_dir).rglob("*.tlseg")):
        stored += segment.stat().st_size
        bodies.append(subprocess.run(["zstd", "-dc", str(segment)], capture_output=True, check=True).stdout)
    raw = sum(len(b) for b in bodies)
    # The same records in one segment (the sidecar cuts at 10 s or 8 MiB; this smoke run
    # cuts every second, so its segments hold a few records each).
    together = len(subprocess.run(["zstd", "-3", "-c"], input=b"".join(bodies), capture_output=True, check=True).stdout)
    n_calls = sum(len(v) for v in calls_by_episode.values())
    wall = sum(r["seconds"] for r in results if args.metrics_model in (None, r.get("model")))
    added = None
    if args.metrics:
        text = Path(args.metrics).read_text()
        total = re.search(r"^tapline_added_latency_seconds_sum(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M)
        added = float(total.group(1)) if total else None
    rewards = {
        model: sorted(r["reward"] for r in results if r.get("model") == model)
        for model in sorted({r.get("model") for r in results})
    }
    print(json.dumps({
        "rollouts": len(results),
        "calls": n_calls,
        "calls_per_rollout": n_calls / len(results),
        "actions_run": actions,
        "exit_status": {s: sum(r["exit_status"] == s for r in results) for s in sorted({r["exit_status"] for r in results})},
        "request_bytes_first_last": [[s[0], s[-1]] for s in prompt_chars if s],
        "stored_bytes_per_call": stored / max(n_calls, 1),
        "record_bytes_per_call": raw / max(n_calls, 1),
        "compression_ratio": raw / stored if stored else None,
        "compression_ratio_one_segment": raw / together if together else None,
        "rollout_seconds": wall,
        "sidecar_added_seconds": added,
        "sidecar_share_of_wall_time": added / wall if added is not None and wall else None,
        "rewards": rewards,
        "resolved": {m: sum(r["resolved"] for r in results if r.get("model") == m) for m in rewards},
    }))


if __name__ == "__main__":
    main()
