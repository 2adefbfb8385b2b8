"""Shared pieces of the config schema: the strict base model and the unit types."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from qosagent.units import parse_duration


class Section(BaseModel):
    """Every config mapping: unknown keys are errors, values are immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


Duration = Annotated[float, BeforeValidator(parse_duration), Field(description="duration such as 100ms or 10s")]
Port = Annotated[int, Field(ge=1, le=65535)]
Mode = Literal["enforce", "dry-run"]
