"""What the embedded servers share: the result type, the error, and the constants."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

_log = logging.getLogger("onceflow.embedded")


PG_SYSTEM_USER = "onceflow-pg"
"""Unprivileged system user that runs PostgreSQL when onceflow itself runs as root."""

_HOST = "127.0.0.1"
_INSTALL_HINT = "pip install 'onceflow[embedded]'"
# Fast shutdown of a server with fsync=off takes well under a second; this only bounds a wedged one.
_STOP_TIMEOUT = 15.0
_POLL_INTERVAL = 0.05
# A free port is found by binding port 0 and closing the socket, so another process can take it
# before the server binds it; a server that exits with "Address already in use" is retried.
_PORT_ATTEMPTS = 3
_LOG_TAIL_LINES = 40
_LOG_TAIL_BYTES = 16_384


class EmbeddedServicesError(RuntimeError):
    """An embedded server could not be prepared, started or reached (message has its log tail)."""


@dataclass(frozen=True)
class EmbeddedServices:
    """Where the running embedded servers answer.

    ``database_url`` / ``redis_url`` are ``""`` for a server that was not asked for.
    """

    database_url: str
    redis_url: str
    data_dir: Path

    def env(self) -> dict[str, str]:
        """The ``ONCEFLOW_*`` variables that point onceflow at these servers."""
        env: dict[str, str] = {}
        if self.database_url:
            env["ONCEFLOW_DATABASE_URL"] = self.database_url
        if self.redis_url:
            env["ONCEFLOW_REDIS_URL"] = self.redis_url
        return env
