"""The images of `cargo xtask image`, run as users run them (podman, host network).

1. `tapline-sidecar` in front of the fake OpenAI server of the sidecar's tests, its store
   and spool on mounted volumes: one call with the official `openai` client goes through
   it; the process runs as uid 65532; `podman stop` (SIGTERM) makes it seal and upload
   the record still in its spool, then exit 0; the record is in the store, written by
   65532, as `tapline-sidecar dump` (in the image) reads it.
2. `tapline-trainer` (`--trainer-image`) runs `prepare` on that store, mounted, with a
   real tokenizer mounted as the model: it reads the one segment and writes its batches.
   The libtorch image then runs `bench-update` (libtorch loads from the image's own
   libraries and trains); the `-prepare` image refuses `train`, naming the feature.

Run by `cargo xtask test` and `cargo xtask image --check`:
    image_check.py --containers-conf FILE --sidecar-image TAG --trainer-image TAG
                   --model DIR --work DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "sidecar" / "tests" / "python"))

from fake_upstream import FakeUpstream  # noqa: E402

UID = 65532


def log(message: str) -> None:
    print(f"image_check: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Podman:
    def __init__(self, conf: Path):
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = ["podman", "--runtime", "/usr/sbin/runc", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and out.returncode != 0:
            raise SystemExit(f"image_check: {' '.join(cmd)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
        return out


def owned_dir(path: Path) -> Path:
    """A directory the image's user can write (the check runs as root)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, UID, UID)
    return path


def check_sidecar(podman: Podman, image: str, work: Path) -> Path:
    store, spool = owned_dir(work / "store"), owned_dir(work / "spool")
    name = f"tapline-image-check-{os.getpid()}"
    port = free_port()
    with FakeUpstream() as upstream:
        podman(
            "run", "-d", "--name", name, "--network", "host",
            "-v", f"{store}:/data/store", "-v", f"{spool}:/var/lib/tapline/spool",
            "-e", f"TAPLINE_LISTEN=127.0.0.1:{port}",
            "-e", f"TAPLINE_UPSTREAM=http://127.0.0.1:{upstream.port}",
            "-e", "TAPLINE_STORE=/data/store",
            "-e", "TAPLINE_SIDECAR_ID=image-check",
            # Nothing is sealed by age: only the drain on SIGTERM uploads the record.
            "-e", "TAPLINE_SEGMENT_MAX_AGE_SECS=3600",
            image,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/tapline/v1/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"image_check: the sidecar did not become healthy:\n{podman('logs', name, check=False).stderr}")
                time.sleep(0.1)
            pid = podman("inspect", "--format", "{{.State.Pid}}", name).stdout.strip()
            uids = [line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:")][0]
            assert all(int(u) == UID for u in uids), f"the sidecar runs as uid {uids}, not {UID}"

            import openai

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-image-check")
            answer = client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "Say hi from the image."}]
            )
            assert answer.choices[0].message.content, answer
            assert not any(p.is_file() for p in store.rglob("*")), "uploaded before the drain"
            stopped = time.monotonic()
            podman("stop", "--time", "60", name, timeout=90)
            log(f"the sidecar drained and stopped {time.monotonic() - stopped:.1f}s after SIGTERM")
            code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
            assert code == "0", f"exit code {code} after SIGTERM:\n{podman('logs', name, check=False).stderr}"
        finally:
            podman("rm", "-f", name, check=False)
    segments = [p for p in store.rglob("*") if p.is_file()]
    assert segments, "nothing in the store after the drain"
    assert all(p.stat().st_uid == UID for p in segments), [(p, p.stat().st_uid) for p in segments]
    dumped = podman(
        "run", "--rm", "--network", "none", "-v", f"{store}:/data/store:ro",
        "--entrypoint", "tapline-sidecar", image, "dump", "--store", "/data/store",
    ).stdout  # fmt: skip
    records = [json.loads(line) for line in dumped.splitlines() if line.strip()]
    calls = [r for r in records if "llm_call" in json.dumps(r)]
    assert calls, f"no LLM call in the store: {records}"
    assert "Say hi from the image." in dumped, dumped[:2000]
    log(f"sidecar image: {len(segments)} segment(s), {len(records)} record(s) as uid {UID}")
    return store


def check_trainer(podman: Podman, image: str, store: Path, model: Path, work: Path) -> None:
    out = owned_dir(work / "batches")
    shutil.rmtree(out)
    owned_dir(out)
    done = podman(
        "run", "--rm", "--network", "none",
        "-v", f"{store}:/data/store", "-v", f"{model}:/model:ro", "-v", f"{out}:/out",
        image, "prepare", "--store", "/data/store", "--model", "/model", "--out", "/out/run",
    )  # fmt: skip
    report = json.loads((out / "run" / "report.json").read_text())
    segments = report["input"]["segments"]
    assert segments >= 1, report["input"]
    log(f"trainer image: prepare read {segments} segment(s): {done.stdout.strip().splitlines()[-1]}")
    if image.endswith("prepare"):
        # Without libtorch: `train` says what it needs.
        refused = podman("run", "--rm", "--network", "none", image, "train", "--store", "x", "--model", "x", "--out", "x", check=False)
        assert refused.returncode != 0 and "needs libtorch" in refused.stderr, refused
        log("trainer image without libtorch: train refuses, naming the feature")
    else:
        # libtorch loads from the image's own libraries and computes: two update steps.
        bench = podman(
            "run", "--rm", "--network", "none", image, "bench-update", "--preset", "smollm2-135m",
            "--device", "cpu", "--sequences", "1", "--seq-len", "32", "--warmup", "1", "--steps", "1",
        ).stdout  # fmt: skip
        result = json.loads(bench.strip().splitlines()[-1])
        assert result["tokens_per_second"] > 0, result
        log(f"trainer image: libtorch runs bench-update ({result['tokens_per_second']:.0f} tokens/s)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--containers-conf", type=Path, required=True)
    p.add_argument("--sidecar-image", required=True)
    p.add_argument("--trainer-image", required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    args = p.parse_args()
    podman = Podman(args.containers_conf)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    store = check_sidecar(podman, args.sidecar_image, args.work)
    check_trainer(podman, args.trainer_image, store, args.model, args.work)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
