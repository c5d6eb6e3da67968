"""A scripted expert behind an OpenAI-compatible chat completions endpoint: for each of
the recipe's tasks it answers as a competent agent would in mini-swe-agent's text format
— read the module, apply the fix (the task's gold patch), check it, submit — one step per
call, from the conversation it is sent.

`cargo xtask swe` runs one expert rollout per task beside the policy's samples, through
a sidecar like every other rollout: records of a multi-step agent that really runs bash
actions and reads their observations (a 135M policy rarely produces a valid action), and
a resolved task in each group, so the grader's positive path and non-zero advantages
are exercised too. Its answers carry no token ids: the trainer tokenizes them from text.

    python expert.py --port 8123
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TASKS = Path(__file__).resolve().parent / "tasks"


def scripts() -> list[tuple[str, list[str]]]:
    """(problem statement, the expert's answers in order) of every task."""
    out = []
    for task_dir in sorted(p for p in TASKS.iterdir() if (p / "task.json").is_file()):
        task = json.loads((task_dir / "task.json").read_text())
        module = next(p for p in sorted((task_dir / "repo").rglob("*.py")))
        rel = module.relative_to(task_dir / "repo")
        patch = (task_dir / "gold.patch").read_text()
        package = rel.parts[0]
        steps = [
            f"THOUGHT: The issue is in `{package}`. Let me read the module first.\n\n"
            f"```mswea_bash_command\nnl -ba {rel}\n```",
            "THOUGHT: I see the bug. I will fix it with a patch.\n\n"
            f"```mswea_bash_command\npatch -p1 <<'PATCH'\n{patch}PATCH\n```",
            "THOUGHT: Let me check that the module still imports and see the change.\n\n"
            f"```mswea_bash_command\npython3 -c 'import {package}' && sed -n '1,40p' {rel}\n```",
            "THOUGHT: The fix is in place. Submitting.\n\n"
            "```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
        ]
        out.append((task["problem_statement"], steps))
    return out


SCRIPTS = scripts()


def answer(messages: list[dict]) -> str:
    """The expert's next answer for this conversation."""
    text = "\n".join(m.get("content") or "" for m in messages if m.get("role") == "user")
    for statement, steps in SCRIPTS:
        if statement in text:
            done = sum(1 for m in messages if m.get("role") == "assistant")
            return steps[min(done, len(steps) - 1)]
    return "THOUGHT: I do not know this task.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.reply(200, {"status": "ok"} if self.path == "/health" else {"object": "list", "data": [{"id": "expert"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        if not self.path.endswith("/chat/completions"):
            self.reply(404, {"error": {"message": f"no route {self.path}"}})
            return
        content = answer(body.get("messages", []))
        prompt = sum(len((m.get("content") or "").split()) for m in body.get("messages", []))
        self.reply(200, {
            "id": f"chatcmpl-expert-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "expert"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": len(content.split()), "total_tokens": prompt + len(content.split())},
        })  # fmt: skip

    def reply(self, status: int, payload: dict) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"expert listening on 127.0.0.1:{args.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
