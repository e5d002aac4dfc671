"""The terms of an HTTP pull worker's claim: what the Flow declares, not what the client asks.

A worker key is held by code the server does not run (a browser tab): what it sends is
checked against the stage's declaration, as a Celery or standalone worker's claim is set
by it.

* **Lease.** A claim gets its stage's lease (``lease_seconds=`` of the stage, else
  ``ONCEFLOW_LEASE_SECONDS``). A client may ask for a shorter one (it only shortens its
  own hold: a crashed tab's request is rescued sooner), never a longer one. The stage is
  known only once a row is claimed, so on a claim ``lease_seconds`` is a ceiling: the
  claim gets the shorter of it and its stage's lease (the answer's ``lease_seconds``
  says which); a value longer than every lease of the worker class's stages is refused.
  On a heartbeat the stage is known: longer than its lease is refused.
* **Run deadline.** Every claim gets its stage's ``max_runtime``
  (``ONCEFLOW_MAX_RUNTIME_SECONDS`` by default) as the run deadline, set on the database
  clock by the claim's own statement: heartbeats never extend the lease past it, so a tab
  that heartbeats forever loses its lease there and the request is rescued.
* **Retry delay.** ``retry_in`` of a failure is at most ``ONCEFLOW_BACKOFF_MAX_SECONDS``,
  the cap of the server's own backoff.

Refusals are :class:`~onceflow.errors.InvalidRequest` (422 ``invalid_request``), raised
before anything is written.
"""

from __future__ import annotations

from onceflow.errors import InvalidRequest
from onceflow.queue import StageTerms
from onceflow.settings import Settings
from onceflow.tasks import Flow


class ClaimTerms:
    """The leases, run bounds and retry cap of ``flow``'s stages under ``settings``."""

    def __init__(self, flow: Flow, settings: Settings) -> None:
        self.flow = flow
        self.settings = settings

    def stage_lease(self, stage: str) -> float:
        """The lease a claim of ``stage`` holds without a heartbeat: declared, else default."""
        spec = self.flow.stages.get(stage)
        declared = spec.lease_seconds if spec is not None else None
        return float(self.settings.lease_seconds if declared is None else declared)

    def stage_runtime(self, stage: str) -> float:
        """The run bound of ``stage``: declared, else ``ONCEFLOW_MAX_RUNTIME_SECONDS``."""
        spec = self.flow.stages.get(stage)
        declared = spec.max_runtime if spec is not None else None
        return float(self.settings.max_runtime_seconds if declared is None else declared)

    def class_stages(self, worker_class: str) -> list[str]:
        """The declared stages a claim of ``worker_class`` may pick."""
        return [n for n, spec in self.flow.stages.items() if worker_class in spec.worker_classes]

    def claim(
        self, worker_class: str, asked: float | None
    ) -> tuple[float | None, float, dict[str, StageTerms]]:
        """``(lease_seconds, max_runtime, stage_terms)`` for ``Queue.claim_next`` of
        ``worker_class``: each stage's terms, the client's lease as a ceiling; a row of a
        stage this Flow does not declare gets the defaults. 422 for a lease longer than
        every stage of the class allows."""
        stages = self.class_stages(worker_class)
        if asked is not None:
            longest = max((self.stage_lease(n) for n in stages), default=self.stage_lease(""))
            if asked > longest:
                raise InvalidRequest(
                    f"lease_seconds {asked:g} is longer than the lease of any stage of worker "
                    f"class {worker_class!r} (at most {longest:g} s); heartbeat to keep a claim"
                )
        terms = {
            name: StageTerms(_shorter(asked, self.stage_lease(name)), self.stage_runtime(name))
            for name in stages
        }
        default = _shorter(asked, float(self.settings.lease_seconds))
        return default, float(self.settings.max_runtime_seconds), terms

    def check_heartbeat(self, stage: str, asked: float) -> None:
        """422 unless ``asked`` is at most ``stage``'s lease."""
        lease = self.stage_lease(stage)
        if asked > lease:
            raise InvalidRequest(
                f"lease_seconds {asked:g} is longer than the {lease:g} s lease of stage "
                f"{stage!r}; heartbeat again instead"
            )

    def check_retry_in(self, retry_in: float) -> None:
        """422 unless ``retry_in`` is at most the backoff's cap."""
        cap = float(self.settings.backoff_max_seconds)
        if retry_in > cap:
            raise InvalidRequest(
                f"retry_in {retry_in:g} is longer than the server's longest retry delay "
                f"({cap:g} s, ONCEFLOW_BACKOFF_MAX_SECONDS)"
            )


def _shorter(asked: float | None, lease: float) -> float:
    return lease if asked is None else min(asked, lease)
