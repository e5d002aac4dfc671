"""A small Django project that enqueues onceflow stages in its own transactions."""
