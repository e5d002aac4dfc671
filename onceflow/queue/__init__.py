"""Layer 1: the durable stage queue on Postgres (``workspace_process_requests``)."""

from onceflow.queue.store import Queue

__all__ = ["Queue"]
