"""The default flow: ``ONCEFLOW_APP`` points here unless a project names its own.

It declares no stages; ``celery -A onceflow.tasks.default worker`` finds ``app``.
Projects declare stages on their own :class:`~onceflow.tasks.Flow` and set
``ONCEFLOW_APP=myproject.stages:flow``.
"""

from onceflow.tasks.flow import Flow

flow = Flow()
app = flow.app
