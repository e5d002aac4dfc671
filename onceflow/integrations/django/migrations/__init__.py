"""Django migrations of the onceflow app: one, which applies onceflow's own (Alembic)."""
