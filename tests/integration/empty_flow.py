"""A Flow that declares no stage: workers and beat refuse to start on it."""

from onceflow.tasks import Flow

flow = Flow()
