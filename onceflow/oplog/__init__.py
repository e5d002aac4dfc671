"""Layer 3: the op log of opId-deduplicated writes (arrives with its issue)."""
