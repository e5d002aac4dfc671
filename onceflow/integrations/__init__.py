"""Thin adapters that let web apps and agents enqueue stages, each behind its extra.

``onceflow[django]``, ``onceflow[fastapi]`` and ``onceflow[mcp]``. They use only
onceflow's public API; nothing in the core imports them.
"""
