"""pytest fixtures for running a Flow inline (:mod:`onceflow.testing`).

Registered as the pytest plugin ``onceflow`` (the ``pytest11`` entry point): with onceflow
installed, a test asks for ``onceflow_runner`` and gets a callable::

    def test_scores(onceflow_runner):
        flow.enqueue("evaluate", "ws-test", "job-1", "main", {"columns": ["fit"]})
        report = onceflow_runner(flow, workspace_id="ws-test")
        assert report.outcomes() == {"succeeded": 2}

``onceflow_runner(flow=None, **options)`` is :func:`~onceflow.testing.run_until_idle`;
without a ``flow`` it runs the one your ``onceflow_flow`` fixture returns. The database
and Redis are the ones your settings name (``ONCEFLOW_DATABASE_URL``,
``ONCEFLOW_REDIS_URL``): point them at test servers. onceflow itself is imported only when
a test asks for a fixture, and ``-p no:onceflow`` turns the plugin off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from onceflow.tasks import Flow
    from onceflow.testing import RunReport


@pytest.fixture()
def onceflow_flow() -> Flow:
    """The Flow ``onceflow_runner()`` runs when given none: override it in your conftest."""
    raise pytest.UsageError(
        "onceflow_runner() was called without a flow: pass one, or define a fixture "
        "named onceflow_flow that returns your Flow"
    )


@pytest.fixture()
def onceflow_runner(request: pytest.FixtureRequest) -> Callable[..., RunReport]:
    """:func:`onceflow.testing.run_until_idle`, the flow defaulting to ``onceflow_flow``."""
    from onceflow.testing import run_until_idle

    def run(flow: Flow | None = None, **options: Any) -> RunReport:
        if flow is None:
            flow = request.getfixturevalue("onceflow_flow")
        return run_until_idle(flow, **options)

    return run
