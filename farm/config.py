"""Settings from the environment (prefix ``FARM_``). Unset means the embedded default."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FARM_", extra="ignore")

    home: Path = Path(".farm")
    """Embedded mode keeps its SQLite database and blob folder here."""
    database_url: str | None = None
    """SQLAlchemy URL; default ``sqlite:///<home>/farm.db``."""
    storage_url: str | None = None
    """``s3://bucket/prefix`` or a folder; default ``<home>/store``."""

    @cached_property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home.resolve() / 'farm.db'}"

    @cached_property
    def resolved_storage_url(self) -> str:
        return self.storage_url or str(self.home.resolve() / "store")


def get_settings() -> Settings:
    return Settings()
