"""Every Redis key, channel and broker queue onceflow uses, in one place (arq's
``constants.py`` pattern).

Each key of a workspace carries the workspace as a Redis Cluster hash tag
(``onceflow:{<workspace_id>}:…``), so a workspace's compute locks, its commit
broadcast channel and its counters live in one slot: Redis Cluster is then a
configuration change, not a code change (docs/sharding.md).
Parts are validated ids; ``{``, ``}`` and ``:`` inside a part are percent-escaped
so that no part can forge another key or move the hash tag.
"""

from __future__ import annotations

from onceflow.ids import check_id, check_worker_class

PREFIX = "onceflow"

#: Every broker queue of a worker class is ``onceflow.wc.<worker class>``: the class is
#: declared by a stage (never chosen by a client) and checked by
#: :func:`~onceflow.ids.check_worker_class`, so no queue onceflow sends to can name a
#: key of kombu's (``unacked``, ``_kombu.*``), of another app, or of onceflow's own
#: locks (``onceflow:{…}:…``). The maintenance queues are ``onceflow`` and
#: ``onceflow.<flow name>`` (:func:`onceflow.tasks.config.maintenance_queue_for`).
QUEUE_PREFIX = f"{PREFIX}.wc."


def queue_name(worker_class: str) -> str:
    """The broker queue of a worker class: ``onceflow.wc.<worker class>``."""
    return QUEUE_PREFIX + check_worker_class(worker_class)


def escape(part: str) -> str:
    """A key part with the characters that structure keys escaped (reversible)."""
    return part.replace("%", "%25").replace("{", "%7B").replace("}", "%7D").replace(":", "%3A")


def _ws(workspace_id: str) -> str:
    return f"{PREFIX}:{{{escape(check_id('workspace_id', workspace_id))}}}"


def lock_key(workspace_id: str, job_id: str, task: str) -> str:
    """The compute lock of one expensive call: ``onceflow:{ws}:lock:<job>:<task>``."""
    job = escape(check_id("job_id", job_id))
    return f"{_ws(workspace_id)}:lock:{job}:{escape(check_id('task', task))}"


def workspace_channel(workspace_id: str) -> str:
    """The pub/sub channel of a workspace's commit broadcasts (layer 3) and lock news (layer 2)."""
    return f"{_ws(workspace_id)}:events"


def counters_key(workspace_id: str) -> str:
    """A hash of a workspace's compute-lock outcome counters."""
    return f"{_ws(workspace_id)}:lock-stats"


def permit_key(workspace_id: str, permit_id: str, part: str = "") -> str:
    """A provider permit taken over HTTP under a claim: ``onceflow:{ws}:permit:<id>``
    (``part``: a key beside it, e.g. ``wait``)."""
    key = f"{_ws(workspace_id)}:permit:{escape(check_id('permit_id', permit_id))}"
    return f"{key}:{part}" if part else key


def budget_refusal_key(workspace_id: str, request_id: str, token_hash: str) -> str:
    """A budget refusal the permit route answered a claim with (``token_hash``: the claim
    token's SHA-256): ``onceflow:{ws}:budget-refused:<request>:<token hash>``."""
    request = escape(check_id("request_id", request_id))
    token = escape(check_id("token_hash", token_hash))
    return f"{_ws(workspace_id)}:budget-refused:{request}:{token}"


def counters_workspaces_key() -> str:
    """A set of the workspaces that have a counters hash (the dashboard lists them).

    Not tagged by a workspace: one key for the whole deployment (its own Redis Cluster slot).
    """
    return f"{PREFIX}:counters:workspaces"


def provider_key(provider: str, part: str) -> str:
    """A key of a provider's shared limits: ``{onceflow:prov:<provider>}:<part>``.

    Every key of a provider, the per-workspace counts of its fairness included (hash fields,
    not keys), carries the provider as its hash tag: the limit scripts touch one slot.
    """
    return f"{{{PREFIX}:prov:{escape(check_id('provider', provider))}}}:{part}"
