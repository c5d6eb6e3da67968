"""A tool-using harness with the official anthropic client and the tapline SDK.

Run a tapline sidecar in front of an Anthropic-compatible server first, for example
`tapline-sidecar --upstream http://127.0.0.1:8000`, then `python examples/harness_anthropic.py`.
The same code is in README.md ("Adding tapline to a harness"), where the SDK's tests run it.
"""
import anthropic
import tapline

sidecar = tapline.Client(timeout=2.0)  # or tapline.Client("http://127.0.0.1:4100", token=...)
TOOLS = [{"name": "run_tests", "description": "Run the test suite.", "input_schema": {"type": "object"}}]

def run_tests() -> float:
    return 0.8  # your test runner: the fraction of tests that pass

def solve(task_id: str, prompt: str) -> None:
    with sidecar.episode(task_id, group_id="nightly-7") as ep:
        llm = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key="unused")
        messages: list = [{"role": "user", "content": prompt}]
        score = 0.0
        for _ in range(4):
            msg = llm.messages.create(model="my-model", max_tokens=1024, tools=TOOLS, messages=messages)
            messages.append({"role": "assistant", "content": msg.content})
            uses = [block for block in msg.content if block.type == "tool_use"]
            if not uses:
                break
            score = run_tests()
            ep.reward(score, name="tests_passed")  # a named component, once per test run
            results = [{"type": "tool_result", "tool_use_id": u.id, "content": f"{score:.0%} pass"} for u in uses]
            messages.append({"role": "user", "content": results})
        ep.reward(score)  # the final scalar reward

solve("fix-issue-123", "Make the failing test in tests/test_dates.py pass.")
