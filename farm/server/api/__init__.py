"""The HTTP API (FastAPI): the only way submitters and edges reach a served farm."""
