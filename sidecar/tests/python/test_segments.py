"""Segments open to tools outside tapline: `zstd -dc` of a segment the sidecar wrote
(format version 2) yields the length-delimited records, which Python's `protobuf`
decodes with `proto/tapline/v1/record.proto` — through its API and through the one-line
command that record.proto documents, run as written. `--segment-format 1` still writes
what tapline 0.1 wrote (not a zstd stream), which `dump` reads.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from conftest import REPO_ROOT, payloads

PROTO = REPO_ROOT / "proto" / "tapline" / "v1" / "record.proto"


def zstd() -> str:
    found = shutil.which("zstd")
    if found is None:
        pytest.fail("the zstd command is missing: `apt-get install zstd` (cargo xtask test installs it)")
    return found


def documented_one_liner() -> str:
    """The shell line record.proto gives for reading a segment."""
    for line in PROTO.read_text().splitlines():
        if "zstd -dc" in line and "python3 -c" in line:
            return line.split("//", 1)[1].strip()
    pytest.fail("record.proto no longer documents how to read a segment with zstd and protobuf")


@pytest.fixture(scope="module")
def pb2_dir(tmp_path_factory) -> Path:
    """record.proto compiled for Python, as record.proto says (grpc_tools' protoc)."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("pb2")
    code = protoc.main(["protoc", f"-I{PROTO.parent}", f"--python_out={out}", str(PROTO)])
    assert code == 0, "protoc failed on record.proto"
    return out


def record_calls(sidecar, n: int) -> list[dict]:
    client = openai.OpenAI(base_url=f"{sidecar.url}/v1", api_key="test", max_retries=0, timeout=20.0)
    for i in range(n):
        client.chat.completions.create(model="gpt-test-1", messages=[{"role": "user", "content": f"question {i} ✓"}])
    client.close()
    return sidecar.records()


def test_zstd_dc_of_a_segment_yields_records_protobuf_decodes(upstream, start_sidecar, pb2_dir):
    sidecar = start_sidecar(upstream.url)
    records = record_calls(sidecar, 3)
    assert len(payloads(records, "llm_call")) == 3
    segments = sorted(sidecar.store_dir.rglob("*.tlseg"))
    assert segments

    sys.path.insert(0, str(pb2_dir))
    try:
        import record_pb2
        from google.protobuf import proto
    finally:
        sys.path.remove(str(pb2_dir))
    decoded = []
    for segment in segments:
        body = subprocess.run([zstd(), "-dc", str(segment)], capture_output=True, check=True).stdout
        stream = io.BytesIO(body)
        while (message := proto.parse_length_prefixed(record_pb2.Record, stream)) is not None:
            decoded.append(message)
    # The same records, in the same order, as tapline's own reader (dump) gives them.
    assert [m.id for m in decoded] == [r["id"] for r in records]
    for message, record in zip(decoded, records):
        call = record["llm_call"]
        assert message.WhichOneof("kind") == "llm_call"
        assert message.sidecar_seq == record["sidecar_seq"]
        assert message.llm_call.request_body.decode() == call["request_body"]
        assert message.llm_call.response_body.decode() == call["response_body"]
        assert [c.text for c in message.llm_call.completions] == [c["text"] for c in call["completions"]]
        assert message.llm_call.start_unix_nanos == call["start_unix_nanos"]

    # The documented line, run as written (its python3 is this venv's, which has protobuf).
    line = documented_one_liner().replace("SEGMENT.tlseg", str(segments[0]))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", "-c", line], cwd=pb2_dir, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    in_first = [m.id for m in decoded][: out.stdout.count("sidecar_seq:")]
    assert in_first and all(f'id: "{i}"' in out.stdout for i in in_first), out.stdout


def test_segment_format_1_is_still_written_on_request_and_read(upstream, start_sidecar):
    sidecar = start_sidecar(upstream.url, ["--segment-format", "1"])
    records = record_calls(sidecar, 2)
    assert len(payloads(records, "llm_call")) == 2
    segments = sorted(sidecar.store_dir.rglob("*.tlseg"))
    assert segments and all(s.read_bytes()[:4] == b"TLSG" for s in segments)
    # Not a zstd stream: its header is not a frame.
    out = subprocess.run([zstd(), "-dc", str(segments[0])], capture_output=True)
    assert out.returncode != 0
