"""The ``onceflow`` command line: what scripts and operators rely on.

Every command reads the database from ``ONCEFLOW_DATABASE_URL``; results go to
stdout (one JSON object with ``--json`` or where scripts parse it), errors to
stderr with a non-zero exit status.

The commands live in ``commands_requests``, ``commands_processes``, ``commands_keys``,
``commands_spend`` and ``commands_dev``; ``base`` holds the ``main`` group they register on.
"""

from __future__ import annotations

from onceflow.cli.base import (
    _APP_OPTION as _APP_OPTION,
)
from onceflow.cli.base import (
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    main,
)
from onceflow.cli.base import (
    F as F,
)
from onceflow.cli.base import (
    _check_database_url as _check_database_url,
)
from onceflow.cli.base import (
    _echo_json as _echo_json,
)
from onceflow.cli.base import (
    _enqueue_flow as _enqueue_flow,
)
from onceflow.cli.base import (
    _errors_to_exit as _errors_to_exit,
)
from onceflow.cli.base import (
    _load as _load,
)
from onceflow.cli.base import (
    _one_line as _one_line,
)
from onceflow.cli.base import (
    _queue as _queue,
)
from onceflow.cli.commands_cache import cache
from onceflow.cli.commands_dev import (
    demo,
    dev_services,
)
from onceflow.cli.commands_keys import mint_worker_token
from onceflow.cli.commands_processes import (
    api,
    beat,
    flower,
    mcp_,
    metrics,
    sweep,
    work,
    worker,
)
from onceflow.cli.commands_requests import (
    cancel,
    enqueue,
    list_,
    migrate,
    requeue,
    show,
    status,
)
from onceflow.cli.commands_spend import budget, spend_

__all__ = [
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_USAGE",
    "api",
    "beat",
    "budget",
    "cache",
    "cancel",
    "demo",
    "dev_services",
    "enqueue",
    "flower",
    "list_",
    "main",
    "mcp_",
    "metrics",
    "migrate",
    "mint_worker_token",
    "requeue",
    "show",
    "spend_",
    "status",
    "sweep",
    "work",
    "worker",
]

if __name__ == "__main__":  # pragma: no cover
    main()
