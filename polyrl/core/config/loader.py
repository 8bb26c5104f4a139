"""Loading a recipe: resolve its path, follow ``extends:``, apply dotted overrides, validate.

- A RECIPE argument is a file path, or a name/path under the packaged ``polyrl/recipes/``: ``gpt_oss_dapo_tiny``,
  ``gpt_oss_dapo_tiny.yaml`` and ``recipes/gpt_oss_dapo_tiny.yaml`` all find the packaged file from any
  directory. An existing file path wins over the packaged name.
- ``extends: OTHER`` (resolved like a RECIPE argument, relative paths from the extending file's folder first)
  loads OTHER and deep-merges this file on top: mappings merge key by key, anything else is replaced.
  Chains are followed; a cycle is an error.
- Overrides ``key.path=value`` are applied after the merge; the value is parsed as YAML (``1e-3`` is a
  float, ``[1, 2]`` a list, ``null`` None). The path must exist in the schema (free-form mappings such as
  ``model.overrides`` accept new keys).
Everything wrong is a ``BadInputError`` naming the file or key path.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from polyrl.core.config.checks import check_config
from polyrl.core.config.schema import RunConfig
from polyrl.core.config.validate import build_dataclass
from polyrl.core.errors import BadInputError

PACKAGED_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` as a string (it wants ``1.0e-3``); recipes write learning rates that way,
    so floats in exponent form without a dot are resolved as floats too."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def packaged_recipes() -> list[str]:
    return sorted(p.stem for p in PACKAGED_RECIPES.glob("*.yaml"))


def resolve_recipe(spec: str | os.PathLike[str], base_dir: Path | None = None) -> Path:
    """The file a RECIPE argument names (see module docstring). Raises BadInputError if none."""
    text = str(spec)
    candidates: list[Path] = []
    path = Path(text).expanduser()
    if base_dir is not None and not path.is_absolute():
        candidates.append(base_dir / path)
    candidates.append(path)
    # Packaged: strip a leading "recipes/" (or "polyrl/recipes/"), add ".yaml" when missing.
    name = text.replace("\\", "/")
    for prefix in ("polyrl/recipes/", "recipes/", "./recipes/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if not name.endswith((".yaml", ".yml")):
        name += ".yaml"
    candidates.append(PACKAGED_RECIPES / name)
    for cand in candidates:
        if cand.is_file():
            return cand.resolve()
    raise BadInputError(
        f"recipe not found: {text!r} (no such file, and no packaged recipe of that name; "
        f"packaged: {', '.join(packaged_recipes())})"
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInputError(f"cannot read recipe {str(path)!r}: {exc.strerror}") from None
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise BadInputError(f"YAML syntax error in {str(path)!r}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BadInputError(f"recipe {str(path)!r}: expected a mapping at the top level, got {type(data).__name__}")
    return data


# Free-form mappings of the schema (task parameters, architecture overrides): a child recipe that sets one
# replaces the parent's whole mapping — parameters of the parent's task make no sense for another task,
# and a merge could never remove a key.
REPLACED_MAPPINGS = frozenset({"data.task_params", "model.overrides", "model.critic_overrides"})


def deep_merge(base: dict[str, Any], top: dict[str, Any], _prefix: str = "") -> dict[str, Any]:
    """``top`` over ``base``: schema sections merge recursively, other values (and the free-form mappings
    of ``REPLACED_MAPPINGS``) replace. Inputs are not modified."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        path = f"{_prefix}{key}"
        if isinstance(value, dict) and isinstance(out.get(key), dict) and path not in REPLACED_MAPPINGS:
            out[key] = deep_merge(out[key], value, f"{path}.")
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_recipe_dict(spec: str | os.PathLike[str], *, _seen: tuple[Path, ...] = (), _base: Path | None = None) -> dict:
    """The merged (``extends`` resolved) but unvalidated mapping of a recipe."""
    path = resolve_recipe(spec, _base)
    if path in _seen:
        chain = " -> ".join(str(p.name) for p in (*_seen, path))
        raise BadInputError(f"recipe extends itself in a cycle: {chain}")
    data = _read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise BadInputError(f"{str(path)!r}: extends: expected a recipe name or path, got {type(parent).__name__}")
    base = load_recipe_dict(parent, _seen=(*_seen, path), _base=path.parent)
    return deep_merge(base, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], YAML-parsed value)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise BadInputError(f"bad override {text!r}: expected key.path=value")
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: keep the text (a string field will take it, a typed one will refuse it)
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set each dotted override in a copy of ``data``; the schema checks the keys and types afterwards."""
    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise BadInputError(f"override {text!r}: {'.'.join(parts[: i + 1])} is not a mapping")
            node = child
        node[parts[-1]] = value
    return out


def load_config(spec: str | os.PathLike[str], overrides: Sequence[str] = ()) -> RunConfig:
    """Resolve, merge, override and validate a recipe into a ``RunConfig``."""
    return config_from_dict(apply_overrides(load_recipe_dict(spec), overrides))


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Validate a plain mapping into a ``RunConfig``: types and keys, then the cross-field rules."""
    cfg = build_dataclass(RunConfig, data)
    check_config(cfg)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    """The fully resolved config as YAML (keys in schema order); loading it gives the same config."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, default_flow_style=None)
