"""Reads the files of `tapline-trainer export` with pyarrow and DuckDB and compares them
with what the records hold.

    python export_check.py OUT_DIR EXPECTED.json
    python export_check.py OUT_DIR --against-dump DUMP.jsonl

EXPECTED.json (written by trainer/tests/export.rs from the records themselves), or the
same built from `tapline-sidecar dump`'s JSON lines of the exported store:
{"calls": {span_id: {...}}, "rewards": {reward_id: {...}}, "episodes": {episode_id: {...}}}
Every key of an expected row is compared with the column of that name (a few are
derived: `completion_content` from the `completion` JSON). Exits non-zero naming the
first difference.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION_KEY = b"tapline.export.schema_version"

TYPES = {
    "calls": {
        "record_id": pa.string(),
        "sidecar_seq": pa.uint64(),
        "seq": pa.uint32(),
        "start_time": pa.timestamp("ns", tz="UTC"),
        "http_status": pa.uint32(),
        "streamed": pa.bool_(),
        "tags": pa.map_(pa.string(), pa.string()),
        "prompt_token_ids": pa.list_(pa.uint32()),
        "completion_token_ids": pa.list_(pa.uint32()),
        "completion_logprobs": pa.list_(pa.float64()),
        "capture_warnings": pa.list_(pa.string()),
    },
    "episodes": {
        "final_reward": pa.float64(),
        "reward_components": pa.map_(pa.string(), pa.float64()),
        "metadata": pa.map_(pa.string(), pa.string()),
        "calls": pa.uint64(),
        "incomplete": pa.bool_(),
        "start_time": pa.timestamp("ns", tz="UTC"),
    },
    "rewards": {
        "value": pa.float64(),
        "time": pa.timestamp("ns", tz="UTC"),
    },
}
ID_COLUMN = {"calls": "span_id", "rewards": "reward_id", "episodes": "episode_id"}


def fail(message: str) -> None:
    print(f"export_check: {message}", file=sys.stderr)
    sys.exit(1)


def same(a, b) -> bool:
    """Exact equality (floats included: the export must not round)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and a == b)


def plain_rows(data: pa.Table) -> list[dict]:
    """Rows as Python values: timestamps as Unix nanoseconds, maps as dicts."""
    columns = {}
    for field in data.schema:
        column = data.column(field.name)
        if pa.types.is_timestamp(field.type):
            columns[field.name] = column.cast(pa.int64()).to_pylist()
        elif pa.types.is_map(field.type):
            columns[field.name] = [None if v is None else dict(v) for v in column.to_pylist()]
        else:
            columns[field.name] = column.to_pylist()
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def expected_from_dump(path: Path) -> dict:
    """What the export of a store must hold, from `dump`'s lines of it: duplicates dropped
    (first seen kept, dump reads segments in the export's order), episodes resolved as
    the trainer resolves them."""
    seen: set[str] = set()
    calls: dict[str, dict] = {}
    rewards: dict[str, dict] = {}
    episodes: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record["id"] and record["id"] in seen:
            continue
        seen.add(record["id"])
        kind = record["kind"]
        body = record.get(kind) or {}
        episode = body.get("episode_id") or None
        if episode is not None:
            e = episodes.setdefault(episode, {"calls": 0, "rewards": 0, "_start": None, "_end": None, "_call": None, "_final": None})
        if kind == "llm_call":
            first = body["completions"][0] if body["completions"] else None
            calls[body["span_id"]] = {
                "episode_id": episode,
                "task_id": body["task_id"] or None,
                "seq": body["seq"],
                "outcome": body["outcome"],
                "start_time": body["start_unix_nanos"],
                "prompt_token_ids": body["prompt_token_ids"] or None,
                "completion_token_ids": (first["token_ids"] or None) if first else None,
                "completion_logprobs": (first["logprobs"] or None) if first else None,
                "finish_reason": (first["finish_reason"] or None) if first else None,
                "tool_calls": first["tool_calls"] if first else [],
                "completion_content": first["text"] if first else None,
            }
            if episode is not None:
                e["calls"] += 1
                if body["task_id"]:
                    key = (body["start_unix_nanos"], body["seq"], body["span_id"])
                    if e["_call"] is None or key < e["_call"][0]:
                        e["_call"] = (key, body["task_id"], body["group_id"])
        elif kind == "reward" and episode is not None:
            rewards[body["reward_id"]] = {
                "episode_id": episode,
                "span_id": body["span_id"] or None,
                "name": body["name"] or None,
                "value": body["value"],
            }
            e["rewards"] += 1
            if not body["span_id"] and not body["name"]:
                key = (body["time_unix_nanos"], body["reward_id"])
                if e["_final"] is None or key > e["_final"][0]:
                    e["_final"] = (key, body["value"])
        elif kind == "episode_event" and episode is not None:
            slot = "_start" if body["kind"] == "start" else "_end"
            if e[slot] is None or e[slot]["time_unix_nanos"] <= body["time_unix_nanos"]:
                e[slot] = body
    for e in episodes.values():
        sources = [(ev["task_id"], ev["group_id"]) for ev in (e["_start"], e["_end"]) if ev]
        if e["_call"]:
            sources.append(e["_call"][1:])
        task, group = next(((t, g) for t, g in sources if t), (None, None))
        e["task_id"], e["group_id"] = task, group or None
        e["status"] = e["_end"]["status"] if e["_end"] else None
        e["final_reward"] = e["_final"][1] if e["_final"] else None
        for k in ("_start", "_end", "_call", "_final"):
            del e[k]
    return {"calls": calls, "rewards": rewards, "episodes": episodes}


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2] == "--against-dump":
        expected = expected_from_dump(Path(sys.argv[3]))
    else:
        expected = json.loads(Path(sys.argv[2]).read_text())
    for table, rows in expected.items():
        path = out / f"{table}.parquet"
        pf = pq.ParquetFile(path)
        for where, metadata in [("file", pf.metadata.metadata), ("Arrow schema", pf.schema_arrow.metadata)]:
            if (metadata or {}).get(SCHEMA_VERSION_KEY) != b"1":
                fail(f"{path}: the {where} metadata has no {SCHEMA_VERSION_KEY!r} = b'1': {metadata}")
        kv = duckdb.connect().execute(
            f"SELECT value FROM parquet_kv_metadata('{path}') WHERE key = '{SCHEMA_VERSION_KEY.decode()}'"
        ).fetchall()
        if kv != [(b"1",)]:
            fail(f"DuckDB reads the schema version of {path} as {kv}")
        schema = pf.schema_arrow
        for name, ty in TYPES[table].items():
            got = schema.field(name).type
            if got != ty:
                fail(f"{path}: column {name} is {got}, not {ty}")
        data = pq.read_table(path)
        ids = data.column(ID_COLUMN[table]).to_pylist()
        if len(ids) != len(set(ids)):
            fail(f"{path}: duplicate rows {sorted(i for i in ids if ids.count(i) > 1)}")
        if set(ids) != set(rows):
            fail(f"{path}: rows {sorted(set(ids) ^ set(rows))} differ (got {len(ids)}, expected {len(rows)})")
        # Rows of one file in the order written; compare each expected key.
        by_id = {row[ID_COLUMN[table]]: row for row in plain_rows(data)}
        for row_id, want in rows.items():
            got = by_id[row_id]
            for key, value in want.items():
                if key == "completion_content":
                    actual = None if got["completion"] is None else json.loads(got["completion"])["content"]
                elif key == "request_messages":
                    actual = None if got[key] is None else json.loads(got[key])
                else:
                    actual = got[key]
                    if key.endswith("time") and value == 0:
                        value = None  # 0 means not known: a null
                if not same(actual, value):
                    fail(f"{path}: {row_id}.{key} is {actual!r}, the record says {value!r}")
        # DuckDB reads the same file: its count and a typed aggregate agree.
        con = duckdb.connect()
        count = con.execute(f"SELECT count(*) FROM read_parquet('{path}')").fetchone()[0]
        if count != len(rows):
            fail(f"DuckDB counts {count} rows in {path}, expected {len(rows)}")
        if table == "calls" and rows:
            total = con.execute(
                f"SELECT sum(len(completion_token_ids)), sum(list_sum(completion_logprobs)) FROM read_parquet('{path}')"
            ).fetchone()
            want_ids = sum(len(r["completion_token_ids"] or []) for r in rows.values())
            want_lp = sum(sum(r["completion_logprobs"] or []) for r in rows.values())
            if total[0] != want_ids or not math.isclose(total[1], want_lp, rel_tol=1e-12):
                fail(f"DuckDB: {total} token ids / log-prob sum, expected {(want_ids, want_lp)}")
        if table == "episodes" and rows:
            by_task = dict(
                con.execute(
                    f"SELECT task_id, avg(final_reward) FROM read_parquet('{path}') GROUP BY task_id"
                ).fetchall()
            )
            want: dict[str, list[float]] = {}
            for r in rows.values():
                values = want.setdefault(r["task_id"], [])
                if r["final_reward"] is not None:
                    values.append(r["final_reward"])
            for task, values in want.items():
                mean = sum(values) / len(values) if values else None
                got = by_task.get(task)
                if (got is None) != (mean is None) or (mean is not None and not math.isclose(got, mean, rel_tol=1e-12)):
                    fail(f"DuckDB: mean final reward of {task} is {got}, expected {mean} (of {values})")
    # The three files join on episode_id: every call and reward of an exported episode.
    con = duckdb.connect()
    orphans = con.execute(
        f"""SELECT count(*) FROM read_parquet('{out / "rewards.parquet"}') r
            LEFT JOIN read_parquet('{out / "episodes.parquet"}') e USING (episode_id)
            WHERE e.episode_id IS NULL"""
    ).fetchone()[0]
    if orphans:
        fail(f"{orphans} rewards have no row in episodes.parquet")
    print(f"export_check: {', '.join(f'{len(v)} {k}' for k, v in expected.items())} match")


if __name__ == "__main__":
    main()
