"""`/metrics` as Prometheus reads it: the content type says OpenMetrics, which Prometheus
parses with its OpenMetrics parser; the Prometheus project's own (strict) parser reads
every family with its type and help."""

from __future__ import annotations

import urllib.request

import openai
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics


def scrape(sidecar) -> tuple[str, str]:
    with urllib.request.urlopen(f"{sidecar.url}/metrics", timeout=5) as resp:
        return resp.headers["content-type"], resp.read().decode()


def test_metrics_parse_as_openmetrics(sidecar, upstream):
    client = openai.OpenAI(base_url=f"{sidecar.url}/v1", api_key="test", max_retries=0, timeout=20.0)
    client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}])
    content_type, text = scrape(sidecar)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0"), content_type
    assert text.endswith("# EOF\n"), text[-200:]

    families = {f.name: f for f in parse_openmetrics(text)}
    for family in families.values():
        assert family.documentation, f"{family.name} has no help"
    assert families["tapline_requests"].type == "counter"
    requests = {s.labels["api"]: s.value for s in families["tapline_requests"].samples if s.name.endswith("_total")}
    assert requests["chat_completions"] == 1, requests
    assert set(requests) == {"chat_completions", "completions", "responses", "anthropic_messages", "other"}
    calls = {s.labels["outcome"]: s.value for s in families["tapline_calls"].samples if s.name.endswith("_total")}
    assert calls["ok"] == 1, calls
    assert families["tapline_spool_records"].type == "gauge"
    assert families["tapline_oldest_unacked_age_seconds"].type == "gauge"

    latency = families["tapline_added_latency_seconds"]
    assert latency.type == "histogram"
    buckets = [s for s in latency.samples if s.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 1, buckets
    counts = [s.value for s in buckets]
    assert counts == sorted(counts), "buckets are cumulative"
    (count,) = [s.value for s in latency.samples if s.name.endswith("_count")]
    (total,) = [s.value for s in latency.samples if s.name.endswith("_sum")]
    assert count == 1 and 0 < total < 1, (count, total)
