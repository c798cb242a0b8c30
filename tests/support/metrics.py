"""Reading Prometheus text from an engine's or a gateway's /metrics: one parser for the tests
(prometheus_client's), summed over the series that match a name and labels."""

from __future__ import annotations

import urllib.request

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` (a counter's `_total` included) whose labels
    include `labels`."""
    out = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, f"{name}_total") and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                out += sample.value
    return out


async def scraped(url: str, name: str, **labels: str) -> float:
    """`total` of what `url` (a /metrics URL) serves now; for servers on the test's loop."""
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return total(await r.text(), name, **labels)


def scraped_sync(url: str, name: str, **labels: str) -> float:
    """`scraped` for servers in other processes, from synchronous code."""
    with urllib.request.urlopen(url, timeout=5) as r:
        return total(r.read().decode(), name, **labels)
