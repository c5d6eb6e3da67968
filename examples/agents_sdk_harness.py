"""An OpenAI Agents SDK program (the `openai-agents` package, unmodified) recorded by tapline.

The agent, its tool and the `Runner` call are an ordinary Agents SDK program for an
OpenAI-compatible server; the lines marked `# tapline:` are all that tapline adds.

Usage: start a tapline sidecar in front of any OpenAI-compatible chat completions server
(vLLM, SGLang, llama.cpp, ...), then run this file against it:

    tapline-sidecar --upstream http://127.0.0.1:8000
    python examples/agents_sdk_harness.py --sidecar http://127.0.0.1:4100 --model my-model

It needs `pip install ./sdk/python openai-agents` (xtask/requirements-test.txt pins the
version that sidecar/tests/python/test_agents_sdk.py runs `run()` with).
"""
from __future__ import annotations

import argparse
import re

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

import tapline  # tapline:

# tapline: the Agents SDK uploads a trace of every run to OpenAI's servers
# (api.openai.com/v1/traces) unless tracing is disabled; with a self-hosted model there
# is no OpenAI key to upload with, and the sidecar records every LLM call anyway.
set_tracing_disabled(True)

TASKS = [{"id": "mul-17-23", "prompt": "What is 17 * 23? End with ANSWER: <number>.", "answer": "391"}]


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def run(task: dict, model: str, sample: int = 0) -> str:
    """Runs the agent once on `task`; returns its final output."""
    # tapline: one episode per run; the samples of one task share a group id.
    with tapline.episode(task_id=task["id"], group_id=f"{task['id']}/b1", metadata={"sample": sample}) as ep:
        client = AsyncOpenAI(base_url=ep.base_url, api_key="unused")  # tapline: the episode's base URL
        agent = Agent(
            name="Calculator",
            instructions="You are a careful assistant. Use the multiply tool for multiplication.",
            tools=[multiply],
            model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        )
        result = Runner.run_sync(agent, task["prompt"])
        answer = re.search(r"ANSWER:\s*(-?\d+)", result.final_output or "")
        ep.reward(float(answer is not None and answer.group(1) == task["answer"]))  # tapline: the reward
    return result.final_output


def main() -> None:
    parser = argparse.ArgumentParser(description="An Agents SDK agent whose LLM calls go through a tapline sidecar.")
    parser.add_argument("--sidecar", help="the sidecar's URL (default: $TAPLINE_SIDECAR_URL or http://127.0.0.1:4100)")
    parser.add_argument("--model", default="my-model", help="the model name the upstream server serves")
    parser.add_argument("--samples", type=int, default=4, help="runs per task (one episode each)")
    args = parser.parse_args()
    tapline.set_default_client(tapline.Client(args.sidecar))  # tapline: which sidecar
    for task in TASKS:
        for sample in range(args.samples):
            print(f"{task['id']} #{sample}: {run(task, args.model, sample)}")


if __name__ == "__main__":
    main()
