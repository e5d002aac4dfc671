"""The stages of the SDK tests (``ONCEFLOW_APP=tests.browser.sdk_stages:flow``).

``t-tab*`` classes are pull classes: browser tabs claim them over HTTP with the SDK's
``PullWorker``; ``t-tab-celery`` runs in a real Celery worker. The body of a pull-class
stage lives in the tab (JavaScript): the function here only declares the stage (its
input model, worker class and lease) and is never called.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from onceflow.tasks import Flow, StageContext

flow = Flow()
app = flow.app
TAB = "t-tab"


class TabInput(BaseModel):
    value: int = 0


@flow.stage("tab_noop", input=TabInput, worker_class=TAB, lease_seconds=5.0)
def tab_noop(ctx: StageContext, data: TabInput) -> dict[str, Any]:
    """Run by a tab (this body is not called for a pull class)."""
    raise NotImplementedError("a pull-class stage runs in the browser")
