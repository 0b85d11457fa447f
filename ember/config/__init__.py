"""The cluster config: one pydantic schema for every service (see schema.py)."""
