"""Layer 1: the durable stage queue on Postgres (``workspace_process_requests``)."""

from onceflow.queue.batch import Depth, Failure
from onceflow.queue.claims import StageTerms
from onceflow.queue.store import AsyncQueue, Queue

__all__ = ["AsyncQueue", "Depth", "Failure", "Queue", "StageTerms"]
