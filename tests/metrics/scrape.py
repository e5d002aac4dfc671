"""Scraping helpers: read a /metrics page over HTTP and sum its samples by labels."""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, headers: Mapping[str, str] | None = None) -> Samples:
    """Every sample of the page at ``url``, keyed by (name, labels)."""
    req = urllib.request.Request(url, headers=dict(headers or {}))  # noqa: S310 - test URL
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - a test URL
        return parse(resp.read().decode())


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)
