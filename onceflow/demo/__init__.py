"""``onceflow demo``: the seed's whole flow, run for real, with figures that prove it.

See :mod:`onceflow.demo.scenario` (the run), :mod:`onceflow.demo.stages` (the stages),
:mod:`onceflow.demo.standins` (the counting LLM and Maps servers) and
:mod:`onceflow.demo.report` (the figures and the invariants).
"""
