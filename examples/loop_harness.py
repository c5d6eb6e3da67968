"""The closed-loop demo's harness: two-turn arithmetic, an ordinary Python harness.

It uses only the official `openai` client and the tapline SDK, as any harness would:
each episode asks a sum, tells the model whether it was right and asks it to add one
more number, then reports one programmatic reward. The samples of a task share a
group id, so the trainer compares them with each other (GRPO).

    python examples/loop_harness.py --sidecar http://127.0.0.1:4100 --iteration 0

Reward per turn, for a calculator's reply: 0.5 when the right number is in it, 0.3 when
it starts with a digit, 0.2 when it is at most eight words (so "7" and "3 + 4 = 7" both
score 1); the episode's reward is the mean of its two turns. Prints one JSON line with
the iteration's figures on stdout.
"""
import argparse
import json
import random
import re
import sys
import time

import openai
import tapline

SYSTEM = "You are a calculator. Reply with the number only."


def score(reply: str, answer: int) -> float:
    text = reply.strip()
    correct = str(answer) in re.findall(r"\d+", text)
    digit_first = text[:1].isdigit()
    short = 0 < len(text.split()) <= 8
    return 0.5 * correct + 0.3 * digit_first + 0.2 * short


def run_episode(args, task: dict, sample: int, seed: int) -> dict:
    group = f"{task['id']}/it{args.iteration}"
    with tapline.episode(task_id=task["id"], group_id=group, metadata={"sample": sample}) as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key="unused", max_retries=0, timeout=600)
        a, b, c = task["a"], task["b"], task["c"]
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {a} + {b}?"},
        ]
        scores, tokens = [], 0
        for turn, answer in enumerate([a + b, a + b + c]):
            response = llm.chat.completions.create(
                model=args.model,
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=seed * 10 + turn,
            )
            reply = response.choices[0].message.content or ""
            tokens += response.usage.completion_tokens if response.usage else 0
            scores.append(score(reply, answer))
            messages.append({"role": "assistant", "content": reply})
            verdict = "Correct" if scores[-1] > 0 else f"No, it is {a + b}"
            messages.append({"role": "user", "content": f"{verdict}. Now add {c} to {a + b}."})
        reward = sum(scores) / len(scores)
        ep.reward(reward)
    return {"reward": reward, "completion_tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sidecar", required=True, help="the sidecar's URL")
    parser.add_argument("--iteration", type=int, default=0)
    parser.add_argument("--tasks", type=int, default=3, help="tasks per iteration")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per task")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--model", default="policy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tapline.set_default_client(tapline.Client(args.sidecar, fail_open=False))
    rng = random.Random(args.seed * 1_000_003 + args.iteration)
    started = time.monotonic()
    results = []
    for t in range(args.tasks):
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        task = {"id": f"sum-{a}-{b}-{c}", "a": a, "b": b, "c": c}
        for sample in range(args.group_size):
            seed = rng.randint(0, 2**31)
            results.append(run_episode(args, task, sample, seed))
    summary = {
        "iteration": args.iteration,
        "episodes": len(results),
        "mean_reward": sum(r["reward"] for r in results) / max(1, len(results)),
        "completion_tokens": sum(r["completion_tokens"] for r in results),
        "seconds": time.monotonic() - started,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
