"""docs/recipes.md documents every key of the schema, with its default (docs that match the code)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from polyrl.core.config import schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def schema_keys(cls: type = schema.RunConfig, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += schema_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_every_schema_key_is_documented():
    text = DOC.read_text()
    keys = schema_keys()
    assert len(keys) > 60
    missing = [k for k in keys if f"`{k}`" not in text]
    assert missing == []


def test_documented_keys_exist():
    import re

    documented = {k for k in re.findall(r"^\| `([a-z_.]+)` \|", DOC.read_text(), re.MULTILINE) if not k.endswith(".yaml")}
    assert documented - set(schema_keys()) == set()


def test_every_documented_key_is_in_the_schema():
    # The other way round: a key documented in a table of docs/recipes.md but gone from the schema (or never in
    # it) would be refused as unknown when a user copies it into a recipe.
    import re

    documented = [k for k in re.findall(r"^\| `([a-z_][a-z_0-9]*\.[a-z_0-9.]*)` \|", DOC.read_text(), re.M)
                  if not k.endswith(".yaml")]
    assert len(documented) > 60
    assert [k for k in documented if k not in set(schema_keys())] == []
