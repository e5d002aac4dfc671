"""A run's compute-lock outcomes as its history row keeps them: what each cell of
``compute_once`` did for the run (paid, waited, found stored…), capped in number and size."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

#: At most this many compute-lock outcomes of one run are kept in its history (the first).
LOCK_OUTCOMES_CAP = 50
#: A cell's name in the history is cut to this many characters.
LOCK_CELL_CAP = 200


def lock_outcomes_text(locks: Sequence[Mapping[str, Any]] | None) -> str | None:
    """A run's compute-lock outcomes as the JSON its history row keeps (None for none): the
    first :data:`LOCK_OUTCOMES_CAP`, each ``{"cell", "outcome"}`` with the cell's name cut."""
    if not locks:
        return None
    kept = [
        {"cell": str(lock.get("cell", ""))[:LOCK_CELL_CAP], "outcome": str(lock.get("outcome"))}
        for lock in list(locks)[:LOCK_OUTCOMES_CAP]
    ]
    return json.dumps(kept, separators=(",", ":"))


__all__ = ["LOCK_CELL_CAP", "LOCK_OUTCOMES_CAP", "lock_outcomes_text"]
