"""Layer 2: the compute lock for per-call expensive work (arrives with its issue)."""
