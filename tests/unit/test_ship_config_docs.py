"""docs/configuration.md documents exactly the keys of the config schema (walked recursively from Config)."""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Iterator

from pydantic import BaseModel

from qosagent.config import Config
from qosagent.configbase import RESTART
from tests.conftest import REPO

DOC = REPO / "docs" / "configuration.md"


def _section(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """(how the path continues, the model) when a field holds a section, else None."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _section(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        models = [s for a in typing.get_args(annotation) if a is not type(None) and (s := _section(a))]
        return models[0] if len(models) == 1 else None
    if origin is list:
        inner = _section(typing.get_args(annotation)[0])
        return ("[]", inner[1]) if inner else None
    if origin is dict:
        inner = _section(typing.get_args(annotation)[1])
        return (".<name>", inner[1]) if inner else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return ("", annotation)
    return None


def schema_keys(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        key = prefix + name
        yield key
        sub = _section(field.annotation)
        if sub:
            yield from schema_keys(sub[1], key + sub[0] + ".")


def documented_keys() -> list[str]:
    return re.findall(r"^\| `([^`]+)` \|", DOC.read_text(), flags=re.M)


def test_walker_sees_nested_lists_maps_and_optionals() -> None:
    keys = set(schema_keys())
    assert {"tenants[].match.header.value", "tiers.<name>.quota.rps", "metrics.tls.cert_file"} <= keys


def test_every_schema_key_is_documented_and_every_documented_key_exists() -> None:
    schema, documented = set(schema_keys()), documented_keys()
    assert len(documented) == len(set(documented)), "a key is documented twice"
    missing, stale = sorted(schema - set(documented)), sorted(set(documented) - schema)
    assert not missing and not stale, f"undocumented keys: {missing}; documented but not in the schema: {stale}"


def restart_keys(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        key = prefix + name
        if RESTART in field.metadata:
            yield key
        sub = _section(field.annotation)
        if sub:
            yield from restart_keys(sub[1], key + sub[0] + ".")


def test_the_keys_a_reload_refuses_are_the_ones_the_doc_marks() -> None:
    marked = re.findall(r"^\| `([^`]+)` \|[^|]*\| Restart only\.", DOC.read_text(), flags=re.M)
    assert sorted(marked) == sorted(restart_keys())
