"""Orders: placing one writes the order and enqueues its confirmation, in one transaction."""
