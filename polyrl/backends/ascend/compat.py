"""The ascend backend's rows of the compatibility table (polyrl.core.compat): torch_npu and CANN, vllm-ascend's
release pairs, and the CANN version read from the toolkit's install files."""

from __future__ import annotations

import os
import re
from pathlib import Path

from packaging.version import Version

from polyrl.core.compat import Compatibility, Environment, Problem, base_version, minor

COMPONENTS: tuple[str, ...] = ("torch-npu", "vllm-ascend")
CANN_FACT = "cann"  # the CANN toolkit's version; None when no toolkit was found
TORCH_CUDA_FACT = "torch cuda"  # contributed by the cuda backend's rows (torch's CUDA version)

# vllm-ascend release -> (CANN, torch / torch_npu base version); vllm-ascend X.Y pairs with vLLM X.Y.
VLLM_ASCEND_PAIRS: dict[str, tuple[str, str]] = {
    "0.23": ("9.1.0", "2.10.0"),
    "0.18": ("8.5.1", "2.9.0"),
    "0.13": ("8.5.0", "2.8.0"),
}

_CANN_VERSION_RE = re.compile(r"version\s*[=:]\s*([0-9][0-9A-Za-z.]*)", re.IGNORECASE)


def parse_cann_version(text: str) -> str | None:
    """Read the version from CANN's ascend_toolkit_install.info / version.cfg text."""
    m = _CANN_VERSION_RE.search(text)
    return m.group(1) if m else None


def cann_home() -> str | None:
    """The CANN toolkit directory, from the environment set by CANN's set_env.sh or the default path."""
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        path = os.environ.get(var)
        if path and os.path.isdir(path):
            return path
    default = "/usr/local/Ascend/ascend-toolkit/latest"
    return default if os.path.isdir(default) else None


def cann_version() -> str | None:
    """The installed CANN toolkit's version ("unknown" when its files do not say), None without a toolkit."""
    home = cann_home()
    if home is None:
        return None
    for name in ("ascend_toolkit_install.info", "version.cfg", "version.info"):
        for path in Path(home).glob(f"**/{name}"):
            try:
                found = parse_cann_version(path.read_text(errors="replace"))
            except OSError:
                continue
            if found:
                return found
    return "unknown"


def torch_npu_without_cann(env: Environment) -> list[Problem]:
    if "torch-npu" in env.versions and env.facts.get(CANN_FACT) is None:
        return [Problem(
            "torch-npu",
            f"torch-npu {env.versions['torch-npu']} is installed but Ascend CANN was not found",
            "without CANN, torch_npu's backend autoload breaks `import torch` itself: install CANN and source "
            "its set_env.sh, or `pip uninstall torch-npu` (TORCH_DEVICE_BACKEND_AUTOLOAD=0 is a stopgap)",
        )]
    return []


def torch_npu_pairs_torch(env: Environment) -> list[Problem]:
    npu, torch = env.versions.get("torch-npu"), env.versions.get("torch")
    if npu and torch and base_version(npu) != base_version(torch):
        return [Problem("torch-npu", f"torch-npu {npu} does not pair with torch {torch}",
                        f"install torch=={base_version(npu)} (torch_npu X.Y.Z pairs with torch X.Y.Z)")]
    if npu and env.facts.get(TORCH_CUDA_FACT):
        return [Problem("torch-npu", f"torch-npu {npu} is installed beside a CUDA torch ({env.facts[TORCH_CUDA_FACT]})",
                        "torch_npu refuses to load with a CUDA build: use separate environments")]
    return []


def vllm_ascend_pairs(env: Environment) -> list[Problem]:
    va = env.versions.get("vllm-ascend")
    if va is None:
        return []
    mm = minor(va)
    key = f"{mm[0]}.{mm[1]}" if mm else ""
    if key not in VLLM_ASCEND_PAIRS:
        return [Problem("vllm-ascend", f"vllm-ascend {va} is not in polyrl's compatibility table",
                        f"known pairs: {', '.join(sorted(VLLM_ASCEND_PAIRS))}; behaviour untested")]
    cann, torch_base = VLLM_ASCEND_PAIRS[key]
    problems = []
    vllm = env.versions.get("vllm")
    if vllm and minor(vllm) != mm:
        problems.append(Problem("vllm-ascend", f"vllm-ascend {va} needs vLLM {key}.x, found vllm {vllm}",
                                f"pip install 'vllm=={key}.*'"))
    found = env.facts.get(CANN_FACT)
    if found and base_version(found) and base_version(found) < Version(cann):
        problems.append(Problem("cann", f"vllm-ascend {va} needs CANN >= {cann}, found {found}",
                                f"upgrade CANN to {cann}"))
    npu = env.versions.get("torch-npu")
    if npu and base_version(npu) != Version(torch_base):
        problems.append(Problem("torch-npu", f"vllm-ascend {va} pairs with torch_npu {torch_base}, found {npu}",
                                f"install torch=={torch_base} and the matching torch-npu"))
    return problems


RULES = (torch_npu_without_cann, torch_npu_pairs_torch, vllm_ascend_pairs)


def compatibility() -> Compatibility:
    return Compatibility(components=COMPONENTS, facts={CANN_FACT: cann_version()}, rules=RULES)
