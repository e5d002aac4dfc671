"""A standalone onceflow worker process for the tests: ``python -m tests.integration.worker_app``.

Arguments: database URL, log path, worker class, concurrency, prefetch, body seconds.
Each body appends ``<request id> <pid>`` to the log (one O_APPEND write: lines from
several processes never interleave) before it returns, so a test counts executions.
The line ``ready`` is printed once the worker is about to run.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from onceflow.context import StageContext
from onceflow.queue import Queue
from onceflow.settings import get_settings
from onceflow.worker import Worker


def double(ctx: StageContext) -> dict[str, int]:
    """A handler for ``onceflow work tests.integration.worker_app:double``."""
    return {"double": 2 * ctx.request.input["i"]}


def main() -> None:
    url, log_path, worker_class, concurrency, prefetch, seconds = sys.argv[1:7]
    logging.basicConfig(level=logging.WARNING)
    settings = get_settings().model_copy(update={"sweep_interval_seconds": 0.5})
    queue = Queue(url, settings)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def body(ctx: StageContext) -> dict[str, int]:
        if float(seconds):
            time.sleep(float(seconds))
        os.write(fd, f"{ctx.request.request_id} {os.getpid()}\n".encode())
        return {"pid": os.getpid()}

    worker = Worker(
        queue,
        [worker_class],
        body,
        concurrency=int(concurrency),
        prefetch=int(prefetch),
        lease_seconds=1.0,
    )
    print("ready", flush=True)
    worker.run()
    print(f"stopped {worker.stats}", flush=True)


if __name__ == "__main__":
    main()
