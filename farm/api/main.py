"""ASGI entry point for uvicorn: ``uvicorn farm.api.main:app`` (settings from FARM_*)."""

from farm.api.app import create_app

app = create_app()
