"""The guards of the SWE recipe, without a model: what the agent's commands can reach in
mini-swe-agent's bubblewrap environment as swe.py configures it, and how swe.py grades.

Run by `cargo xtask swe` (and so by `cargo xtask test`) with .cache/swe-venv's Python:
    python -m pytest examples/swe/test_swe.py
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import swe

TASKS = sorted(p for p in swe.TASKS.iterdir() if (p / "task.json").is_file())


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return swe.make_workspace(swe.TASKS / "roman", tmp_path / "work")


def run(env, command: str) -> dict:
    return env.execute({"command": command})


def test_the_task_set_is_well_formed():
    assert len(TASKS) >= 4
    for task_dir in TASKS:
        task = swe.load_task(task_dir)
        assert task["instance_id"] == task_dir.name
        assert task["FAIL_TO_PASS"] and task["PASS_TO_PASS"]
        assert not set(task["FAIL_TO_PASS"]) & set(task["PASS_TO_PASS"])
        assert not any("test" in p.name for p in swe.repo_files(task_dir)), "tests must not ship in repo/"


@pytest.mark.parametrize("task_dir", TASKS, ids=lambda p: p.name)
def test_untouched_repo_fails_exactly_fail_to_pass_and_the_gold_patch_resolves(task_dir: Path, tmp_path: Path):
    task = swe.load_task(task_dir)
    work = swe.make_workspace(task_dir, tmp_path / "work")
    verdict = swe.grade(task_dir, work)
    assert verdict["tests"] == {t: t in task["PASS_TO_PASS"] for t in task["FAIL_TO_PASS"] + task["PASS_TO_PASS"]}
    assert verdict["fail_to_pass"] == 0.0 and verdict["pass_to_pass"] == 1.0
    assert not verdict["resolved"]
    subprocess.run(["patch", "-s", "-p1", "-i", str(task_dir / "gold.patch")], cwd=work, check=True)
    verdict = swe.grade(task_dir, work)
    assert verdict["resolved"] and verdict["reward"] == 1.0, verdict


def test_the_workspace_has_no_tests_and_no_history(workspace: Path):
    names = {p.name for p in workspace.rglob("*")}
    assert ".git" not in names
    assert not any(n.startswith("test") for n in names), names


def test_the_sandbox_hides_the_hidden_tests_and_the_host(workspace: Path):
    env = swe.sandbox(workspace, timeout=20)
    hidden = swe.TASKS / "roman" / "tests" / "test_numerals.py"
    out = run(env, f"cat {hidden}")
    assert out["returncode"] != 0 and "def test_" not in out["output"]
    out = run(env, "find / -name 'test_numerals.py' -not -path '/proc/*' 2>/dev/null; echo done")
    assert out["output"].strip() == "done", out["output"]
    # Nothing of this repository, the tasks or the harness's environment is visible.
    out = run(env, f"ls {swe.HERE} {Path.home()} 2>&1; env")
    assert "No such file or directory" in out["output"]
    assert "TAPLINE" not in out["output"] and "VIRTUAL_ENV" not in out["output"]
    # The agent can work in its copy of the repository.
    out = run(env, "sed -i 's/IIII/IV/' numerals/__init__.py && python3 -c 'import numerals; print(numerals.to_roman(3))'")
    assert out["returncode"] == 0 and out["output"].strip() == "III", out


def test_the_sandbox_has_no_network_and_no_package_installs(workspace: Path):
    env = swe.sandbox(workspace, timeout=30)
    out = run(env, "python3 -c \"import socket; socket.create_connection(('151.101.0.223', 443), timeout=3)\"")
    assert out["returncode"] != 0 and ("unreachable" in out["output"] or "Errno" in out["output"]), out
    # (past PEP 668's refusal, which a determined agent would pass too) no index is reachable
    out = run(env, "python3 -m pip install --break-system-packages --retries 0 --timeout 3 requests 2>&1 || echo INSTALL-FAILED")
    assert "INSTALL-FAILED" in out["output"], out
    assert "Network is unreachable" in out["output"] or "Failed to establish" in out["output"] or "No matching distribution" in out["output"], out
    out = run(env, "python3 -c 'import requests' 2>&1 || echo MISSING")
    assert "MISSING" in out["output"]


def test_a_planted_conftest_or_edited_test_does_not_change_the_reward(workspace: Path):
    # An agent that tries to pass by rigging pytest instead of fixing the code.
    (workspace / "conftest.py").write_text(
        "import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n    out = yield\n    out.get_result().outcome = 'passed'\n"
    )
    (workspace / "test_numerals.py").write_text("def test_subtractive_pairs():\n    pass\n")
    (workspace / "pytest.ini").write_text("[pytest]\naddopts = -p no:python\n")
    verdict = swe.grade(swe.TASKS / "roman", workspace)
    assert verdict["fail_to_pass"] == 0.0 and not verdict["resolved"], verdict


def test_a_sandbox_command_cannot_outlive_its_timeout(workspace: Path):
    env = swe.sandbox(workspace, timeout=2)
    out = run(env, "sleep 30")
    assert out["returncode"] == -1 and "timed out" in out["exception_info"], out
