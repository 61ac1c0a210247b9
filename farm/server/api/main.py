"""ASGI entry point for uvicorn: ``uvicorn farm.server.api.main:app`` (settings from FARM_*)."""

from farm.server.api.app import create_app

app = create_app()
