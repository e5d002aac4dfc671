"""Enqueue a plan through the Flow in a process of its own (its metrics land in the
multiprocess directory): ``python -m tests.metrics.enqueuer '<json plan>'``.

The plan: a list of [stage, job, input, delay_seconds]; each item is enqueued once, and
the ones marked ``dup`` twice (the second collapses onto the first).
"""

from __future__ import annotations

import json
import sys

from tests.metrics.stages import flow


def main() -> None:
    plan = json.loads(sys.argv[1])
    for item in plan:
        req = flow.new_request(item["stage"], "ws-m", item["job"], item.get("branch", ""),
                               item.get("input", {}))  # fmt: skip
        if item.get("delay"):
            from dataclasses import replace

            req = replace(req, run_after_seconds=item["delay"])
        for _ in range(2 if item.get("dup") else 1):
            [res] = flow.queue.enqueue_many([req])
            if res.created:
                from onceflow.models.requests import Dispatch

                flow.dispatch(Dispatch(res.request_id, req.stage, res.worker_class))


if __name__ == "__main__":
    main()
