"""The app factory of each process of ``onceflow api --workers N``.

uvicorn starts N processes (spawned: each imports this module afresh) and each calls
:func:`app`. Everything the API holds is per process already — its queue's pools, its
work listener and lines of long-poll claimers, its event hub, its in-memory rate limits —
so the processes share nothing but Postgres and Redis. The parent passes what it was
given (the Flow, the log format and level) in the environment.
"""

from __future__ import annotations

import os
from typing import Any

#: The environment the parent sets for its worker processes.
LOG_FORMAT_ENV = "ONCEFLOW_LOG_FORMAT"
LOG_LEVEL_ENV = "ONCEFLOW_API_LOG_LEVEL"


def app() -> Any:
    """The FastAPI app of this process: the ``ONCEFLOW_APP`` Flow, traced as onceflow-api."""
    from onceflow import tracing
    from onceflow.cli.process_logs import chosen_format, start
    from onceflow.integrations.fastapi import create_app
    from onceflow.settings import get_settings
    from onceflow.tasks.loader import load_app

    tracing.configure_logging(os.environ.get(LOG_LEVEL_ENV, "info"), chosen_format(None))
    start("onceflow-api")
    _, flow = load_app(get_settings().app)
    return create_app(flow=flow)
