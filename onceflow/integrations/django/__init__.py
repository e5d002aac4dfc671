"""Enqueue stages from Django, inside the caller's transaction (``pip install onceflow[django]``).

::

    from django.db import transaction
    from onceflow.integrations.django import enqueue
    from myproject.stages import flow

    with transaction.atomic():
        order = Order.objects.create(sku="A-1")
        enqueue(flow, "confirm_order", "shop", f"order-{order.pk}", "", {"order_id": order.pk})

:func:`enqueue` writes the request row through **Django's own connection**, so it
is part of the same transaction as the app's writes: a rollback leaves no row.
The Celery wake-up is sent in ``transaction.on_commit``: a rollback sends
nothing, and a wake-up lost between the commit and the send (a crash, a broker
outage) is sent later by the sweeper, because the row is the source of truth —
the pattern of Procrastinate's ``contrib/django``.

Django's ``DATABASES`` entry must name the Postgres database onceflow uses
(``ONCEFLOW_DATABASE_URL``, migrated with ``onceflow migrate``, ``manage.py
onceflow_migrate`` or, with the app installed, ``manage.py migrate``):
:func:`database_settings` builds that entry from the URL, and the app config
``"onceflow.integrations.django"`` (optional in ``INSTALLED_APPS``) adds onceflow's
tables to ``manage.py migrate``, onceflow's settings from ``settings.ONCEFLOW``, the
management command and a system check that warns when the two databases differ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.transaction import TransactionManagementError
from sqlalchemy import URL, make_url

from onceflow.errors import InvalidRequest
from onceflow.integrations.django.connector import DjangoConnector
from onceflow.models.requests import Dispatch, EnqueueResult
from onceflow.settings import get_settings
from onceflow.tasks import Flow

#: ``OPTIONS`` keys of Django's PostgreSQL backend that are not libpq connection parameters.
_DJANGO_ONLY_OPTIONS = frozenset({"isolation_level", "server_side_binding", "pool", "assume_role"})

#: What :meth:`onceflow.Queue.enqueue_many_with` calls: ``execute(query, params) -> rows``.
Executor = Callable[[str, dict[str, Any]], Sequence[Mapping[str, Any]]]


# Flow.enqueue's signature on purpose (plus `using`): delegates to Flow.new_request.
def enqueue(
    flow: Flow,
    stage: str,
    workspace_id: str,
    job_id: str,
    branch_path: str = "",
    input: Any = None,
    *,
    priority: int | None = None,
    worker_class: str | None = None,
    strict: bool = False,
    using: str = DEFAULT_DB_ALIAS,
) -> EnqueueResult:
    """Enqueue a stage request on Django's connection ``using``; send its wake-up on commit.

    Inside ``transaction.atomic()`` the row is written in that transaction (other
    connections see it only after the commit; a rollback leaves nothing) and the
    Celery message is sent by ``transaction.on_commit``. Outside one, Django's
    autocommit applies: the row commits at once and the message is sent at once.

    ``input`` is validated against the stage's pydantic model first: a clear
    :class:`~onceflow.InvalidRequest` (:class:`~onceflow.errors.UnknownStage` for
    an unknown stage) and nothing written. A duplicate that collapsed onto an
    existing row returns ``created=False`` and sends nothing (the row's creator
    sends it). The result describes the row as this transaction sees it.
    """
    item = flow.new_request(
        stage,
        workspace_id,
        job_id,
        branch_path,
        input,
        priority=priority,
        worker_class=worker_class,
    )
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise InvalidRequest(
            f"Django database {using!r} is {connection.vendor}, not the PostgreSQL database "
            "onceflow uses"
        )
    if not connection.in_atomic_block and not connection.get_autocommit():
        # on_commit would refuse after the write; refuse before it instead.
        raise TransactionManagementError(
            "onceflow enqueue needs autocommit or an atomic block (transaction.atomic())"
        )
    # Counted once committed (at once in autocommit), never for a rollback: the connector's
    # after-commit is transaction.on_commit. strict: the batch is written under a savepoint.
    [result] = flow.queue.enqueue_many([item], strict=strict, connection=DjangoConnector(using))
    if result.created:
        wake_up = Dispatch(result.request_id, stage, result.worker_class, result.workspace_id)
        # robust: a failed send after the commit is logged, never raised into the app
        # (Flow.dispatch already logs it and leaves the row for the sweeper).
        transaction.on_commit(functools.partial(flow.dispatch, wake_up), using=using, robust=True)
    return result


def cursor_executor(using: str = DEFAULT_DB_ALIAS) -> Executor:
    """An executor for :meth:`onceflow.Queue.enqueue_many_with` on Django's connection ``using``
    (prefer ``queue.enqueue_many(items, connection=DjangoConnector(using))``).

    Runs each statement on a cursor of that connection (so inside its current
    transaction) and returns the rows as dicts. Django's PostgreSQL backend takes
    psycopg's ``%(name)s`` placeholders and binds lists as arrays.
    """

    def execute(query: str, params: dict[str, Any]) -> Sequence[Mapping[str, Any]]:
        # Like Django's own writes: a database error inside the caller's atomic block marks
        # it for rollback, so a caught error cannot be followed by a silent commit. (Input
        # errors are raised before any statement runs and leave the transaction usable.)
        with (
            transaction.mark_for_rollback_on_error(using=using),
            connections[using].cursor() as cursor,
        ):
            cursor.execute(query, params)
            names = [column[0] for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    return execute


def database_settings(url: str | None = None) -> dict[str, Any]:
    """A Django ``DATABASES`` entry for onceflow's database (``ONCEFLOW_DATABASE_URL`` by default).

    ``DATABASES = {"default": database_settings()}`` keeps Django and onceflow on
    one database by construction. Query parameters become ``OPTIONS`` (libpq
    parameters such as ``sslmode``).
    """
    parsed = make_url(url or get_settings().database_url)
    if parsed.get_backend_name() != "postgresql":
        raise InvalidRequest(f"onceflow needs PostgreSQL, got a {parsed.get_backend_name()} URL")
    options = {
        key: value if isinstance(value, str) else value[-1] for key, value in parsed.query.items()
    }
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database or "",
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
        "OPTIONS": options,
    }


def database_url(using: str = DEFAULT_DB_ALIAS) -> str:
    """The SQLAlchemy URL (psycopg 3) of Django's database ``using``, password included.

    What ``manage.py onceflow_migrate`` migrates. Keep it out of logs.
    """
    entry: Mapping[str, Any] = connections[using].settings_dict
    port = entry.get("PORT")
    query = {
        str(key): str(value)
        for key, value in (entry.get("OPTIONS") or {}).items()
        if key not in _DJANGO_ONLY_OPTIONS and isinstance(value, str | int)
    }
    url = URL.create(
        "postgresql+psycopg",
        username=entry.get("USER") or None,
        password=entry.get("PASSWORD") or None,
        host=entry.get("HOST") or None,
        port=int(port) if port else None,
        database=entry.get("NAME") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


def same_database(django_url: str, onceflow_url: str) -> bool:
    """Whether two URLs name the same database (loopback spellings and the default port agree)."""
    a, b = make_url(django_url), make_url(onceflow_url)
    return _where(a) == _where(b)


def _where(url: URL) -> tuple[str, int, str]:
    host = url.host or "localhost"
    if host in {"127.0.0.1", "::1", "localhost"}:
        host = "localhost"
    return host, url.port or 5432, url.database or ""


__all__ = [
    "DjangoConnector",
    "Executor",
    "cursor_executor",
    "database_settings",
    "database_url",
    "enqueue",
    "same_database",
]
