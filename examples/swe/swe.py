"""SWE-style rollouts of mini-swe-agent through a tapline sidecar.

The harness is the PyPI `mini-swe-agent`, unmodified: its `DefaultAgent`, its text-based
LiteLLM model and its bubblewrap environment, configured by its own `mini_textbased.yaml`.
tapline only changes where the model is: the episode's base URL on the sidecar. One
rollout:

1. starts an episode on the sidecar (task = the task's id, group = the task and the
   batch, so GRPO compares the samples of one task);
2. copies the task's repository into a fresh directory (no `.git`, no tests);
3. runs the agent on the issue text; its commands run in bubblewrap with the network
   cut (`--unshare-net`), an empty environment, its own PID namespace, and nothing of
   the host visible but `/usr`, `/bin`, `/lib*`, `/etc` (read-only) and the working
   directory: not the hidden tests, not this repository, not a package index;
4. grades the way SWE-bench does: the agent's versions of the repository's own files
   onto a clean copy (anything else it wrote, a `conftest.py` say, is ignored), then the
   hidden tests, then pytest; the reward is the fraction of FAIL_TO_PASS and
   PASS_TO_PASS tests that pass (1.0 only when all do), reported with both parts as
   named components;
5. ends the episode and writes `result.json` beside the agent's own trajectory.

    python swe.py rollout --task tasks/roman --sample 0 --out runs/ --model policy
    python swe.py grade --task tasks/roman --workspace DIR     # a workspace's reward

The sidecar is `TAPLINE_SIDECAR_URL` (default http://127.0.0.1:4100).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# mini-swe-agent and LiteLLM settings (environment, not code): no price-list fetch at
# import, no cost for a model LiteLLM does not know, no first-run questions, no banner.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
os.environ.setdefault("MSWEA_CONFIGURED", "true")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(Path(tempfile.gettempdir()) / "tapline-swe-mswea"))

HERE = Path(__file__).resolve().parent
TASKS = HERE / "tasks"

# bubblewrap around every command of the agent: mini-swe-agent's own defaults (read-only
# /usr /bin /lib /lib64 /etc, private /tmp, /proc, /dev), plus no environment of the
# host, no network, its own PID namespace, and death with the harness.
SANDBOX_EXTRA = ["--unshare-net", "--unshare-pid", "--die-with-parent", "--setenv", "HOME", "/tmp"]


def load_task(task_dir: Path) -> dict:
    task = json.loads((task_dir / "task.json").read_text())
    for key in ("instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS"):
        if key not in task:
            raise SystemExit(f"{task_dir}/task.json has no {key!r}")
    return task


def repo_files(task_dir: Path) -> list[Path]:
    """The repository's own files, relative to it."""
    repo = task_dir / "repo"
    return sorted(p.relative_to(repo) for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts)


def make_workspace(task_dir: Path, dest: Path) -> Path:
    """A fresh copy of the task's repository: no history, no tests."""
    shutil.copytree(task_dir / "repo", dest, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    return dest


def sandbox(workdir: Path, timeout: int = 30):
    """mini-swe-agent's bubblewrap environment, locked down (see SANDBOX_EXTRA)."""
    from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment, BubblewrapEnvironmentConfig

    config = yaml_config()
    wrapper = ["--clearenv", *BubblewrapEnvironmentConfig().wrapper_args, *SANDBOX_EXTRA]
    return BubblewrapEnvironment(
        cwd=str(workdir), timeout=timeout, env=config["environment"]["env"], wrapper_args=wrapper
    )


def yaml_config() -> dict:
    import yaml
    from minisweagent import package_dir

    return yaml.safe_load((Path(package_dir) / "config" / "mini_textbased.yaml").read_text())


def grade(task_dir: Path, workspace: Path, python: str = sys.executable) -> dict:
    """The hidden tests' verdict on a workspace, as SWE-bench grades a patch."""
    task = load_task(task_dir)
    wanted = task["FAIL_TO_PASS"] + task["PASS_TO_PASS"]
    with tempfile.TemporaryDirectory(prefix="swe-grade-") as tmp:
        clean = Path(tmp) / "repo"
        shutil.copytree(task_dir / "repo", clean)
        for rel in repo_files(task_dir):
            mine = workspace / rel
            if mine.is_file():
                shutil.copyfile(mine, clean / rel)
            else:
                (clean / rel).unlink()  # the agent deleted it
        for test in (task_dir / "tests").iterdir():
            shutil.copyfile(test, clean / test.name)
        report = Path(tmp) / "junit.xml"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(clean), "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(clean),
             f"--junitxml={report}", *wanted],
            cwd=clean, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        passed: dict[str, bool] = {t: False for t in wanted}
        if report.is_file():
            for case in ET.parse(report).getroot().iter("testcase"):
                module = case.get("classname", "").rsplit(".", 1)[-1]
                test_id = f"{module}.py::{case.get('name')}"
                ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
                if test_id in passed:
                    passed[test_id] = ok
    f2p = [passed[t] for t in task["FAIL_TO_PASS"]]
    p2p = [passed[t] for t in task["PASS_TO_PASS"]]
    return {
        "tests": passed,
        "fail_to_pass": sum(f2p) / len(f2p) if f2p else 1.0,
        "pass_to_pass": sum(p2p) / len(p2p) if p2p else 1.0,
        "reward": sum(passed.values()) / len(passed),
        "resolved": all(passed.values()),
        "pytest_exit": proc.returncode,
    }


def rollout(args: argparse.Namespace) -> dict:
    import litellm
    import tapline
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    litellm.suppress_debug_info = True  # its "Provider List" banner for a model it has no price of
    task_dir = Path(args.task).resolve()
    task = load_task(task_dir)
    out = Path(args.out).resolve() / f"{task['instance_id']}-{args.sample}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    workspace = make_workspace(task_dir, out / "work")
    # Fail-closed: a rollout the sidecar cannot record is an error here, not a silent loss.
    client = tapline.Client(args.sidecar, fail_open=False)
    started = time.monotonic()
    episode = client.start_episode(
        task_id=task["instance_id"],
        group_id=f"{task['instance_id']}/{args.batch}",
        metadata={"sample": args.sample, "batch": args.batch, "harness": "mini-swe-agent"},
    )
    config = yaml_config()
    model = LitellmTextbasedModel(
        model_name=f"openai/{args.model}",
        model_kwargs={
            **config["model"].get("model_kwargs", {}),
            "api_base": episode.base_url,
            "api_key": os.environ.get("OPENAI_API_KEY", "unused"),
            "temperature": args.temperature,
            **({"max_tokens": args.max_tokens} if args.max_tokens else {}),
        },
        **{k: v for k, v in config["model"].items() if k != "model_kwargs"},
    )
    agent_config = {k: v for k, v in config["agent"].items() if k != "mode"}
    agent = DefaultAgent(
        model,
        sandbox(workspace, timeout=args.command_timeout),
        **agent_config | {"step_limit": args.step_limit, "cost_limit": 0.0, "output_path": out / "trajectory.json"},
    )
    try:
        info = agent.run(task["problem_statement"])
        exit_status = info.get("exit_status", "")
    except Exception as error:  # the harness's own failure: the episode failed
        exit_status = f"{type(error).__name__}: {error}"
    verdict = grade(task_dir, workspace, args.grader_python or sys.executable)
    episode.reward(verdict["fail_to_pass"], name="fail_to_pass")
    episode.reward(verdict["pass_to_pass"], name="pass_to_pass")
    episode.reward(verdict["reward"])
    status = {"Submitted": "succeeded", "LimitsExceeded": "timed_out"}.get(exit_status, "failed")
    episode.end(status, metadata={"exit_status": exit_status})
    result = {
        "episode_id": episode.id,
        "task": task["instance_id"],
        "sample": args.sample,
        "model": args.model,
        "exit_status": exit_status,
        "seconds": round(time.monotonic() - started, 3),
        "trajectory": str(out / "trajectory.json"),
        **verdict,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rollout", help="one rollout of one task")
    r.add_argument("--task", required=True, help="a task directory (task.json, repo/, tests/)")
    r.add_argument("--sample", type=int, default=0)
    r.add_argument("--batch", default="0", help="rollout batch, part of the GRPO group")
    r.add_argument("--out", required=True, help="rollouts go to OUT/<task>-<sample>/")
    r.add_argument("--model", required=True, help="the served model name")
    r.add_argument("--sidecar", default=None, help="sidecar URL [TAPLINE_SIDECAR_URL]")
    r.add_argument("--step-limit", type=int, default=30)
    r.add_argument("--max-tokens", type=int, default=0, help="0: the server's default")
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--command-timeout", type=int, default=60)
    r.add_argument("--grader-python", default=None, help="the Python with pytest [this one]")
    g = sub.add_parser("grade", help="the hidden tests' verdict on a workspace")
    g.add_argument("--task", required=True)
    g.add_argument("--workspace", required=True)
    args = parser.parse_args()
    if args.command == "rollout":
        print(json.dumps(rollout(args)))
    else:
        print(json.dumps(grade(Path(args.task).resolve(), Path(args.workspace).resolve())))


if __name__ == "__main__":
    main()
