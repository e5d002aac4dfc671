"""Celery signal hooks of the metrics (connected when onceflow.tasks.flow is imported).

* ``worker_process_shutdown`` (in a prefork child, as it exits): mark the child dead in
  the multiprocess directory, so its live gauges (``onceflow_stages_in_progress``) stop
  counting. A child killed outright (SIGKILL) runs no hook: the next scrape drops the
  live gauges of pids that no longer exist (see ``onceflow.metrics.exposition``).
* ``worker_ready`` (in the worker's main process only, after the pool has forked):
  with ``ONCEFLOW_METRICS_PORT`` set, serve the metrics of every process there.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery.signals import worker_process_shutdown, worker_ready

log = logging.getLogger("onceflow.metrics")


@worker_process_shutdown.connect
def _child_exits(pid: int | None = None, **_: Any) -> None:
    from onceflow.metrics.exposition import mark_dead

    mark_dead(pid or os.getpid())


@worker_ready.connect
def _serve_from_main_process(sender: Any = None, **_: Any) -> None:
    from onceflow.settings import get_settings
    from onceflow.shards import configured_map

    settings = get_settings()
    if settings.metrics_port is None:
        return
    from onceflow.metrics.exposition import multiproc_dir, multiproc_dir_problem, registry, serve

    problem = multiproc_dir_problem()
    if problem is not None:  # a metrics setting must not stop the worker
        log.error("metrics: not serving on port %s: %s", settings.metrics_port, problem)
        return
    if multiproc_dir() is None:
        log.warning(
            "metrics: ONCEFLOW_METRICS_PORT without PROMETHEUS_MULTIPROC_DIR serves this "
            "process only; a prefork pool's children record nothing visible there"
        )
    try:
        reg = registry(
            # every shard of a database split by workspace
            list(configured_map(settings).urls) if settings.metrics_database else None,
            database=settings.metrics_database,
            count_cap=settings.metrics_count_cap,
        )
        serve(settings.metrics_port, settings.metrics_bind, reg=reg)
    except OSError as exc:  # a taken port must not stop the worker
        log.error("metrics: cannot serve on port %s: %s", settings.metrics_port, exc)
