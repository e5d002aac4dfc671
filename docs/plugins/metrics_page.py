"""The metrics reference page, rendered from the metric definitions themselves.

Process-recorded metrics come from :mod:`onceflow.metrics.definitions` (the module's
metric objects, and the metrics its zero-argument functions create on first use); the
database gauges from one scrape of :class:`onceflow.metrics.collector.DatabaseCollector`
answered by an empty database, so no server is needed.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

from markdown_text import code, one_line, text
from prometheus_client.metrics import MetricWrapperBase

from onceflow.metrics import collector, definitions

PAGE = "reference/metrics.md"


@dataclass(frozen=True)
class Metric:
    """One metric as PromQL names it."""

    name: str
    kind: str
    labels: tuple[str, ...]
    help: str


def _sample_name(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


def _recorded() -> Iterator[MetricWrapperBase]:
    seen: set[int] = set()
    for _, value in vars(definitions).items():
        if isinstance(value, MetricWrapperBase) and id(value) not in seen:
            seen.add(id(value))
            yield value
    for name, func in inspect.getmembers(definitions, inspect.isfunction):
        if name.startswith("_") or func.__module__ != definitions.__name__:
            continue
        if inspect.signature(func).parameters:
            continue
        value = func()
        if isinstance(value, MetricWrapperBase) and id(value) not in seen:
            seen.add(id(value))
            yield value


def recorded_metrics() -> list[Metric]:
    """Every metric a process records (counters, histograms, gauges)."""
    out = []
    for metric in _recorded():
        (family,) = metric.describe()
        out.append(
            Metric(
                _sample_name(family.name, family.type),
                family.type,
                tuple(metric._labelnames),
                family.documentation,
            )
        )
    return sorted(out, key=lambda m: m.name)


def database_metrics() -> list[Metric]:
    """Every gauge the database collector answers at a scrape."""
    db = collector.DatabaseCollector("postgresql+psycopg://docs.invalid/onceflow")
    empty = collector.Answer(rows=[], estimate=-1.0, health={})
    db._answers = lambda: [empty]  # type: ignore[method-assign]
    return [
        Metric(f.name, f.type, tuple(getattr(f, "_labelnames", ())), f.documentation)
        for f in db.collect()
    ]


def all_metrics() -> list[Metric]:
    """Recorded metrics, then the database's."""
    return [*recorded_metrics(), *database_metrics()]


def render() -> str:
    """The whole page."""
    intro = (
        "Every Prometheus metric of onceflow, generated from its definitions "
        "(`onceflow/metrics/definitions.py` and the database collector) when this site is "
        "built. Names are as PromQL spells them: counters with `_total`, histograms by base "
        "name (`_bucket`, `_sum` and `_count` samples). How to expose and scrape them, what "
        "each label's values are and which process records what: docs/metrics.md."
    )
    lines = ["# Metrics", "", text(intro, page=PAGE), ""]
    for title, metrics in (
        ("Recorded by the processes", recorded_metrics()),
        ("Read from the database at each scrape", database_metrics()),
    ):
        lines += [f"## {title}", "", "| Name | Type | Labels | Help |", "|---|---|---|---|"]
        for m in metrics:
            labels = ", ".join(code(label) for label in m.labels) or "—"
            lines.append(
                f"| {code(m.name)} | {m.kind} | {labels} | {text(one_line(m.help), page=PAGE)} |"
            )
        lines.append("")
    return "\n".join(lines)
