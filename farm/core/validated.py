"""The settings read and checked by pydantic-settings: what `farm.core.config.Settings` falls
back on for values it does not read itself (and for settings given as arguments). The fields
are `SettingsFields`'s, the one declaration of every setting."""

from __future__ import annotations

from pydantic import field_validator
from pydantic_core import PydanticKnownError
from pydantic_settings import BaseSettings, SettingsConfigDict

from farm.core.config import BOUNDS, ENV_PREFIX, SettingsFields


class ValidatedSettings(SettingsFields, BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    @field_validator(*BOUNDS)
    @classmethod
    def _within_bounds(cls, value: int, info) -> int:
        """`BOUNDS`, refused as pydantic's own ``Field(ge=, le=)`` refuses (same message)."""
        least, most = BOUNDS[info.field_name]
        if value < least:
            raise PydanticKnownError("greater_than_equal", {"ge": least})
        if value > most:
            raise PydanticKnownError("less_than_equal", {"le": most})
        return value
