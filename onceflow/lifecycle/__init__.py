"""One stage lifecycle for every runner: what a run comes to (:mod:`.outcome`, a pure
table) and how that is written to the queue (:mod:`.record`).

The Celery stage task, the standalone worker, the Python pull worker and the HTTP claim
routes all decide a run's outcome through :func:`~onceflow.lifecycle.outcome.decide`, so
one body gives the same rows under each.
"""

from onceflow.lifecycle.outcome import (
    Outcome,
    RetryOn,
    brief_error,
    clamp_delay,
    decide,
    reported,
    succeeded,
)

__all__ = ["Outcome", "RetryOn", "brief_error", "clamp_delay", "decide", "reported", "succeeded"]
