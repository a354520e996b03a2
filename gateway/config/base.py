"""Pieces every section of the configuration shares: :class:`ConfigError`, the strict
base model of a section, :data:`AUTO_MODELS`."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

AUTO_MODELS = "auto"  # `backends[].models` entry: also serve what the backend's `/v1/models` lists

PositiveSeconds = Annotated[float, Field(gt=0)]


class ConfigError(Exception):
    """The config file is missing, unreadable or invalid. The message names the file
    and the field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
