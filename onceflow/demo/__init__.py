"""``onceflow demo``: a whole flow run for real (clients, workers, faults), with figures.

See :mod:`onceflow.demo.scenario` (the run), :mod:`onceflow.demo.stages` (the stages),
:mod:`onceflow.demo.standins` (the counting LLM and Maps servers) and
:mod:`onceflow.demo.report` (the figures and the invariants).
"""
