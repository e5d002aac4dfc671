"""No thread class of onceflow's sets an attribute that threading.Thread keeps for itself.

Python 3.13 added ``Thread._handle`` (3.14 ``_os_thread_handle``): a subclass that stored its
own ``self._handle`` made ``start()`` raise ``TypeError: 'handle' must be a _ThreadHandle``
there, so the compute lock's watchdog never started. Checked from the source, so it holds
whichever Python runs the tests.
"""

from __future__ import annotations

import ast
import threading

from tests.conftest import ROOT

#: Thread's own attributes on the Python running this, and those of newer ones.
RESERVED = set(vars(threading.Thread())) | {"_handle", "_os_thread_handle", "_context"}


def _thread_classes() -> list[tuple[str, ast.ClassDef]]:
    found = []
    for path in sorted((ROOT / "onceflow").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(base) in ("threading.Thread", "Thread") for base in node.bases
            ):
                found.append((str(path.relative_to(ROOT)), node))
    return found


def test_thread_subclasses_leave_threads_own_attributes_alone() -> None:
    classes = _thread_classes()
    assert len(classes) >= 3  # the watchdog, the pull heartbeat, the pull lock extender
    clashes = []
    for where, cls in classes:
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr in RESERVED
            ):
                clashes.append(f"{where}:{node.lineno} {cls.name}.{node.attr}")
    assert clashes == []
