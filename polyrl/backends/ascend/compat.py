"""The ascend backend's rows of the compatibility table (polyrl.core.compat): torch_npu and CANN, vllm-ascend's
releases — what each pairs with and what polyrl's rollout relies on in it — and the CANN version read from the
toolkit's install files."""

from __future__ import annotations

import dataclasses
import os
import re
from importlib import metadata
from pathlib import Path

from packaging.version import Version

from polyrl.core.compat import Compatibility, Environment, Problem, base_version, minor

COMPONENTS: tuple[str, ...] = ("torch-npu", "vllm-ascend")
CANN_FACT = "cann"  # the CANN toolkit's version; None when no toolkit was found
TORCH_CUDA_FACT = "torch cuda"  # contributed by the cuda backend's rows (torch's CUDA version)



@dataclasses.dataclass(frozen=True)
class VllmAscendRelease:
    """One vllm-ascend release line X.Y (it pairs with vLLM X.Y), as its sources at the tag say — read there,
    never run here (no NPU): the README's CANN, requirements.txt's torch / torch_npu, and three behaviours the
    vllm rollout engine adapts to (polyrl.backends.ascend.rollout)."""

    cann: str
    torch: str  # torch / torch_npu base version
    # Its attention applies GPT-OSS's learnable sinks: from v0.15.0rc1. v0.13's attention forward takes the sinks
    # in **kwargs and drops them, so GPT-OSS would roll out from another model than the one trained.
    gpt_oss_sinks: bool
    # NPUWorker has reload_weights (from v0.24.0rc1). Without it the weight sync loads through the model's own
    # load_weights (collective_rpc on the worker), as other RL frameworks do; the engine detects it at run time.
    reload_weights: bool
    # Its sliding-window attention passes pre_tokens = sliding_window to the fused attention ops, which keep
    # pre_tokens + 1 keys (the query included): W + 1 keys where training and vLLM mean W. polyrl then builds
    # the engine with sliding_window = W - 1 (attention_v1.py, prefill and decode paths, every tag below).
    pre_tokens_is_sliding_window: bool


VLLM_ASCEND_RELEASES: dict[str, VllmAscendRelease] = {
    "0.24": VllmAscendRelease("9.0.1", "2.10.0", gpt_oss_sinks=True, reload_weights=True,
                              pre_tokens_is_sliding_window=True),  # v0.24.0rc1
    "0.23": VllmAscendRelease("9.1.0", "2.10.0", gpt_oss_sinks=True, reload_weights=False,
                              pre_tokens_is_sliding_window=True),
    "0.18": VllmAscendRelease("8.5.1", "2.9.0", gpt_oss_sinks=True, reload_weights=False,
                              pre_tokens_is_sliding_window=True),
    "0.15": VllmAscendRelease("8.5.0", "2.9.0", gpt_oss_sinks=True, reload_weights=False,
                              pre_tokens_is_sliding_window=True),  # v0.15.0rc1
    "0.13": VllmAscendRelease("8.5.0", "2.8.0", gpt_oss_sinks=False, reload_weights=False,
                              pre_tokens_is_sliding_window=True),
}
# vllm-ascend release -> (CANN, torch / torch_npu base version).
VLLM_ASCEND_PAIRS: dict[str, tuple[str, str]] = {k: (r.cann, r.torch) for k, r in VLLM_ASCEND_RELEASES.items()}
GPT_OSS_SINKS_FROM = "0.15"


def installed_vllm_ascend() -> str | None:
    """The installed vllm-ascend's version from its metadata (never imported), None when absent."""
    try:
        return metadata.version("vllm-ascend")
    except metadata.PackageNotFoundError:
        return None


def vllm_ascend_release(version: str) -> tuple[str, VllmAscendRelease]:
    """(release line, its facts) for a vllm-ascend version. A line the table does not know takes the facts of the
    nearest known one below it (the newest for a newer release: the sync probe checks what it assumes), or of the
    oldest for an older one."""
    mm = minor(version)
    key = f"{mm[0]}.{mm[1]}" if mm else ""
    if key in VLLM_ASCEND_RELEASES:
        return key, VLLM_ASCEND_RELEASES[key]
    known = sorted(VLLM_ASCEND_RELEASES, key=Version)
    below = [k for k in known if mm and Version(k) <= Version(f"{mm[0]}.{mm[1]}")]
    nearest = below[-1] if below else known[0]
    return nearest, VLLM_ASCEND_RELEASES[nearest]


def vllm_ascend_model_problem(version: str, model_type: str) -> str:
    """Why vllm-ascend ``version`` cannot serve ``model_type`` for training ("" when it can), one line."""
    _, release = vllm_ascend_release(version)
    if model_type == "gpt_oss" and not release.gpt_oss_sinks:
        return (f"vllm-ascend {version} cannot roll out GPT-OSS: its attention drops the sinks (GPT-OSS sinks from "
                f"vllm-ascend {GPT_OSS_SINKS_FROM}.0rc1); install vllm-ascend >= {GPT_OSS_SINKS_FROM} or set "
                "rollout.engine=hf")
    return ""

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
