"""Shared pieces of the config schema: the strict base model and the unit types."""

from __future__ import annotations

from typing import Annotated, Literal

import re

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo

from qosagent.units import parse_duration


class Section(BaseModel):
    """Every config mapping: unknown keys are errors, values are immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _regex(v: str) -> str:
    try:
        re.compile(v)
    except re.error as e:
        raise ValueError(f"not a regular expression: {e}") from None
    return v


Regex = Annotated[str, AfterValidator(_regex)]
# Re-validating a section that was validated already (config.with_metrics merges command-line keys into the file's)
# hands its durations back as seconds; only that context may pass a bare number, which a file never may.
REVALIDATE = {"seconds": True}


def _duration(value: object, info: ValidationInfo) -> float:
    if isinstance(value, float) and info.context == REVALIDATE:
        return value
    return parse_duration(value)


Duration = Annotated[float, BeforeValidator(_duration), Field(description="duration such as 100ms or 10s")]


def duration_between(lo: float, hi: float, say: str) -> object:
    """A Duration from lo to hi seconds; outside, the error `expected between {say}`."""
    def check(v: float) -> float:
        if not lo <= v <= hi:
            raise ValueError(f"expected between {say}")
        return v
    return Annotated[Duration, AfterValidator(check)]
Port = Annotated[int, Field(ge=1, le=65535)]
Mode = Literal["enforce", "dry-run"]


class _Restart:
    """Marks a key that is read only at start (what was loaded, attached or opened from it stays): a reload that
    changes it is refused, naming the key, instead of reporting success and changing nothing."""

    def __repr__(self) -> str:
        return "RESTART"


RESTART = _Restart()


def restart_changes(old: BaseModel, new: BaseModel, prefix: str = "") -> list[str]:
    """Key paths marked RESTART whose value differs between two configs of the same schema."""
    out: list[str] = []
    for name, field in type(old).model_fields.items():
        a, b = getattr(old, name), getattr(new, name)
        path = prefix + name
        if RESTART in field.metadata:
            if a != b:
                out.append(path)
        elif isinstance(a, BaseModel) and type(a) is type(b):
            out.extend(restart_changes(a, b, path + "."))
    return out
