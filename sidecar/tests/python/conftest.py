"""Fixtures for the sidecar's Python integration tests.

- `fake_upstream` (session): the fake OpenAI/Anthropic server of `fake_upstream.py`.
- `upstream` (function): the same server with its request log cleared for the test.
- `start_sidecar` (function): a factory that starts `tapline-sidecar` processes (stopped
  with SIGTERM at teardown); `sidecar` is one pointed at the fake upstream.

The binary is `$TAPLINE_SIDECAR_BIN`, by default `target/debug/tapline-sidecar` of this
workspace (build it with `cargo build -p tapline-sidecar`). The session works on a
snapshot of it (a hard link or copy), so that a concurrent `cargo build` replacing the
file does not disturb a running suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_upstream import FakeUpstream  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[3]
SIDECAR_BIN = Path(os.environ.get("TAPLINE_SIDECAR_BIN") or REPO_ROOT / "target" / "debug" / "tapline-sidecar")
# How long to wait for the binary to reappear while a concurrent `cargo build` relinks it.
BIN_WAIT = 60.0

START_TIMEOUT = 15.0
STOP_TIMEOUT = 20.0


def free_port() -> int:
    """A port that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (connections are refused)."""
    return free_port()


def http_json(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, dict[str, str], Any]:
    """Sends a JSON request with urllib; returns (status, lower-case headers, parsed body).
    4xx/5xx answers are returned, not raised."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, headers, raw = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, e.headers, e.read()
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw
    return status, {k.lower(): v for k, v in headers.items()}, parsed


def clean_env() -> dict[str, str]:
    """The environment without TAPLINE_* settings (they would override the flags' absence),
    except the log filter."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TAPLINE_") or k == "TAPLINE_LOG"}


def snapshot_binary(dest_dir: Path) -> Path:
    """A private snapshot of the sidecar binary (hard link, else copy)."""
    deadline = time.monotonic() + BIN_WAIT
    while not SIDECAR_BIN.is_file():
        if time.monotonic() > deadline:
            pytest.fail(f"sidecar binary {SIDECAR_BIN} not found: run `cargo build -p tapline-sidecar` or set TAPLINE_SIDECAR_BIN")
        time.sleep(0.2)
    dest = dest_dir / "tapline-sidecar"
    try:
        os.link(SIDECAR_BIN, dest)
    except OSError:
        shutil.copy2(SIDECAR_BIN, dest)
    return dest


class Sidecar:
    """One `tapline-sidecar` process and the store it records to."""

    def __init__(self, bin_path: Path, upstream_url: str, workdir: Path, extra_args: list[str] | None = None):
        self.bin = bin_path
        self.upstream_url = upstream_url
        self.workdir = workdir
        self.store_dir = workdir / "store"
        self.spool_dir = workdir / "spool"
        self.store_url = f"file://{self.store_dir}"
        self.log_path = workdir / "sidecar.log"
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.returncode: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Sidecar":
        # The port is picked before the sidecar binds it; retry if someone took it meanwhile.
        for _attempt in range(3):
            self.port = free_port()
            args = [
                str(self.bin),
                "--listen", f"127.0.0.1:{self.port}",
                "--upstream", self.upstream_url,
                "--store", self.store_url,
                "--spool-dir", str(self.spool_dir),
                "--sidecar-id", "pytest",
                "--segment-max-age-secs", "0.2",
                *self.extra_args,
            ]  # fmt: skip
            env = clean_env()
            env.setdefault("TAPLINE_LOG", "info")
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
            finally:
                log.close()
            if self._wait_healthy():
                return self
            if self.proc.poll() is None:
                self.stop()
                break
            self.proc = None
        pytest.fail(f"sidecar did not become healthy; log:\n{self.log()}")

    def _wait_healthy(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/tapline/v1/health", timeout=1.0) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.02)
        return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int:
        """SIGTERM, then waits for the exit (the sidecar flushes its records first).
        Returns the exit status."""
        if self.proc is None:
            return self.returncode if self.returncode is not None else 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"sidecar did not exit within {STOP_TIMEOUT}s of SIGTERM; log:\n{self.log()}")
        self.returncode = self.proc.returncode
        self.proc = None
        return self.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def dump(self) -> list[dict]:
        """Every record in the store now, via `tapline-sidecar dump`."""
        if not self.store_dir.exists():
            return []
        out = subprocess.run(
            [str(self.bin), "dump", "--store", self.store_url],
            capture_output=True,
            timeout=30,
            env=clean_env(),
        )
        assert out.returncode == 0, f"dump failed ({out.returncode}): {out.stderr.decode(errors='replace')}"
        return [json.loads(line) for line in out.stdout.decode().splitlines() if line.strip()]

    def records(self) -> list[dict]:
        """Stops the sidecar (so every record is flushed) and returns all records."""
        code = self.stop()
        assert code == 0, f"sidecar exited with {code}; log:\n{self.log()}"
        return self.dump()

    def wait_for_records(self, predicate: Callable[[list[dict]], bool], timeout: float = 10.0) -> list[dict]:
        """Polls the store of a running sidecar until `predicate(records)` holds."""
        deadline = time.monotonic() + timeout
        records: list[dict] = []
        while time.monotonic() < deadline:
            records = self.dump()
            if predicate(records):
                return records
            time.sleep(0.05)
        raise AssertionError(f"records did not arrive within {timeout}s; have {len(records)}: {records}")


def payloads(records: list[dict], kind: str) -> list[dict]:
    """The payloads of the records of one kind (`llm_call`, `reward`, `episode_event`),
    in store order."""
    return [r[kind] for r in records if r["kind"] == kind]


@pytest.fixture(scope="session")
def sidecar_bin(tmp_path_factory) -> Path:
    return snapshot_binary(tmp_path_factory.mktemp("bin"))


@pytest.fixture(scope="session")
def fake_upstream():
    with FakeUpstream() as up:
        yield up


@pytest.fixture
def upstream(fake_upstream: FakeUpstream) -> FakeUpstream:
    fake_upstream.reset()
    return fake_upstream


@pytest.fixture
def start_sidecar(tmp_path: Path, sidecar_bin: Path):
    started: list[Sidecar] = []

    def start(upstream_url: str, extra_args: list[str] | None = None) -> Sidecar:
        workdir = tmp_path / f"sidecar{len(started)}"
        workdir.mkdir()
        sc = Sidecar(sidecar_bin, upstream_url, workdir, extra_args)
        started.append(sc)
        return sc.start()

    yield start
    errors = []
    for sc in started:
        try:
            sc.stop()
        except AssertionError as e:
            errors.append(str(e))
        # Shown by pytest when the test failed.
        print(f"--- sidecar log ({sc.log_path}) ---\n{sc.log()}")
    if errors:
        pytest.fail("\n".join(errors))


@pytest.fixture
def sidecar(start_sidecar, upstream: FakeUpstream) -> Sidecar:
    return start_sidecar(upstream.url)
