"""Prometheus metrics of onceflow: definitions, recording helpers, registry and exporter.

Multiprocess mode: when ``PROMETHEUS_MULTIPROC_DIR`` is set in the environment
*before Python starts* (prometheus_client chooses its value class at import), every
process writes its metrics to files in that directory and :func:`registry` merges
them. The start script must create the directory empty — wipe it at every start, as
files of a previous run would otherwise be summed in. Prefork children that exit
cleanly are marked dead (``worker_process_shutdown``), so their live gauges vanish;
a scrape also drops the live gauges of pids that no longer exist (same host).
See docs/metrics.md.
"""

from __future__ import annotations

from typing import Any

from onceflow.metrics.definitions import METRIC_NAMES

__all__ = [
    "METRIC_NAMES", "mark_dead", "multiproc_dir", "multiproc_dir_problem", "registry", "serve",
]  # fmt: skip

_LAZY = frozenset(("DatabaseCollector", *__all__[1:]))


def __getattr__(name: str) -> Any:
    # Lazy: the exposition side (database collector, HTTP server) is not needed to record,
    # and the recording side is imported by the queue itself.
    if name in _LAZY:
        from onceflow.metrics import exposition

        return getattr(exposition, name)
    raise AttributeError(name)
