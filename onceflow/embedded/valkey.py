"""The embedded Valkey: its probe and its child process."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from onceflow.embedded.base import (
    _HOST,
)
from onceflow.embedded.children import (
    _Child,
)

_log = logging.getLogger("onceflow.embedded")


# --------------------------------------------------------------------------- Valkey


def _valkey_probe(child: _Child, timeout: float) -> str | None:
    import redis

    client = redis.Redis(
        host=_HOST, port=child.port, socket_connect_timeout=timeout, socket_timeout=timeout
    )
    try:
        info = client.info("server")
    except (redis.RedisError, OSError) as exc:
        return str(exc) or type(exc).__name__
    finally:
        client.close()
    # As for PostgreSQL: make sure the server on the port is the one we started.
    pid = child.process.pid if child.process is not None else None
    if not isinstance(info, dict) or info.get("process_id") != pid:
        return f"port {child.port} is answered by another Redis-protocol server"
    return None


def _prepare_valkey(executable: Path, data_dir: Path) -> _Child:
    valkey_dir = data_dir / "valkey"
    valkey_dir.mkdir(exist_ok=True)

    def argv(port: int) -> list[str]:
        return [
            str(executable),
            "--port",
            str(port),
            "--bind",
            _HOST,
            # Nothing is persisted: a dev/test broker starts empty every time.
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(valkey_dir),
        ]

    return _Child(
        "Valkey",
        argv,
        log_path=data_dir / "valkey.log",
        cwd=data_dir,
        stop_signal=signal.SIGTERM,
    )
