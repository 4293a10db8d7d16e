"""Read a service's /metrics as Prometheus does: the text format, parsed by prometheus_client's parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    """``sample name{labels}`` → value for every sample of ``url``/metrics (labels sorted, ``le`` kept)."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version="), r.headers
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def histogram_ok(m: dict[str, float], name: str) -> int:
    """Check a histogram's buckets are cumulative and end at its count; returns the count."""
    buckets = sorted(((float(k.split("le=")[1].rstrip("}")), v) for k, v in m.items() if k.startswith(f"{name}_bucket{{")))
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1][0] == float("inf") and counts[-1] == m[f"{name}_count"]
    assert m[f"{name}_sum"] >= 0
    return int(m[f"{name}_count"])
