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


# The first torch_npu of a TorchNPU release per torch minor: Ascend/pytorch version.txt at the tags
# v7.2.0-pytorch2.6.0 / -pytorch2.7.1 / -pytorch2.8.0 and v7.3.0-pytorch2.6.0 / 2.7.1 / 2.8.0 / 2.9.0. Every
# torch_npu from 2.9.0 on belongs to 7.3.0 or a later release.
TORCH_NPU_RELEASE_FIRSTS: dict[str, dict[tuple[int, int], str]] = {
    "7.2.0": {(2, 6): "2.6.0.post3", (2, 7): "2.7.1", (2, 8): "2.8.0"},
    "7.3.0": {(2, 6): "2.6.0.post5", (2, 7): "2.7.1.post2", (2, 8): "2.8.0.post2"},
}
TORCH_NPU_ALL_FROM = "2.9.0"


def torch_npu_at_least(version: str, release: str) -> bool:
    """Is torch_npu ``version`` of TorchNPU ``release`` ("7.2.0", "7.3.0") or a later one? An unreadable
    version is not."""
    from packaging.version import InvalidVersion

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    if v >= Version(TORCH_NPU_ALL_FROM):
        return True
    first = TORCH_NPU_RELEASE_FIRSTS[release].get((v.major, v.minor))
    return first is not None and v >= Version(first)


@dataclasses.dataclass(frozen=True)
class VllmAscendRelease:
    """One vllm-ascend release line X.Y (it pairs with vLLM X.Y), as its sources at ``tag`` say — read there,
    never run here (no NPU): what pip installs with it (requirements.txt's torch / torch-npu / transformers, the
    README's Python, the Dockerfile's CANN image and vLLM tag; frozen in tests/ascend/data/vllm_ascend_pins.txt,
    which a test holds this table to), and three behaviours the vllm rollout engine adapts to
    (polyrl.backends.ascend.rollout)."""

    tag: str
    cann: str
    torch: str  # torch / torch_npu base version
    torch_npu: str  # requirements.txt's exact pin
    transformers: str  # requirements.txt's specifier (vLLM's own line, where stricter, in the pins file)
    # Its attention applies GPT-OSS's learnable sinks: from v0.15.0rc1. v0.13's and v0.14's attention forward take
    # the sinks in **kwargs and drop them (no "sinks" in vllm_ascend/attention/ at those tags), so GPT-OSS would
    # roll out from another model than the one trained.
    gpt_oss_sinks: bool
    # NPUWorker has reload_weights (from v0.24.0rc1). Without it the weight sync loads through the model's own
    # load_weights (collective_rpc on the worker), as other RL frameworks do; the engine detects it at run time.
    reload_weights: bool
    # Its sliding-window attention passes pre_tokens = sliding_window to the fused attention ops, which keep
    # pre_tokens + 1 keys (the query included): W + 1 keys where training and vLLM mean W. polyrl then builds
    # the engine with sliding_window = W - 1 (attention_v1.py, prefill and decode paths, every tag below).
    pre_tokens_is_sliding_window: bool = True


VLLM_ASCEND_RELEASES: dict[str, VllmAscendRelease] = {
    "0.24": VllmAscendRelease("v0.24.0rc1", "9.0.1", "2.10.0", "2.10.0.post2", "==5.13.0", gpt_oss_sinks=True,
                              reload_weights=True),
    "0.23": VllmAscendRelease("v0.23.0", "9.1.0", "2.10.0", "2.10.0.post4", "==5.5.4", gpt_oss_sinks=True,
                              reload_weights=False),
    "0.18": VllmAscendRelease("v0.18.0", "8.5.1", "2.9.0", "2.9.0", ">=4.57.4", gpt_oss_sinks=True,
                              reload_weights=False),
    "0.15": VllmAscendRelease("v0.15.0rc1", "8.5.0", "2.9.0", "2.9.0", ">=4.57.4", gpt_oss_sinks=True,
                              reload_weights=False),
    "0.14": VllmAscendRelease("v0.14.0rc1", "8.5.0", "2.9.0", "2.9.0", ">=4.57.3", gpt_oss_sinks=False,
                              reload_weights=False),
    "0.13": VllmAscendRelease("v0.13.0", "8.5.0", "2.8.0", "2.8.0.post2", ">=4.57.4,<5", gpt_oss_sinks=False,
                              reload_weights=False),
}
# vllm-ascend release -> (CANN, torch / torch_npu base version).
VLLM_ASCEND_PAIRS: dict[str, tuple[str, str]] = {k: (r.cann, r.torch) for k, r in VLLM_ASCEND_RELEASES.items()}
GPT_OSS_SINKS_FROM = "0.15"


@dataclasses.dataclass(frozen=True)
class AscendStack:
    """One set pip installs together with polyrl (a CPU test resolves its pins against pyproject.toml's). The
    rollout engine is ``hf``: no vllm-ascend release installs beside polyrl's transformers (docs/ascend.md, "The
    stacks": v0.13.0 pins transformers < 5, v0.14-v0.18 run on a vLLM that pins < 5, v0.19.1rc1-v0.25.1rc1 pin an
    exact 5.x below 5.16.1). CANN and torch / torch_npu are the pairs vllm-ascend's releases were built on."""

    cann: str
    torch: str
    torch_npu: str
    transformers: str  # polyrl's own range (pyproject.toml)
    python: str
    vllm_ascend: str | None = None  # None: none installs beside polyrl; rollout.engine resolves to hf
    paired_with: str = ""  # the vllm-ascend release whose CANN / torch pair this is

    def line(self) -> str:
        return (f"CANN {self.cann}, torch=={self.torch}, torch-npu=={self.torch_npu}, "
                f"transformers{self.transformers}, Python{self.python}, rollout.engine=hf")


POLYRL_TRANSFORMERS = ">=5.16.1,<5.20"  # pyproject.toml's (a test keeps them equal)
# Newest first: doctor names the first as the row to install.
ASCEND_STACKS: tuple[AscendStack, ...] = (
    AscendStack("9.1.0", "2.10.0", "2.10.0.post4", POLYRL_TRANSFORMERS, ">=3.10,<3.13", paired_with="v0.23.0"),
    AscendStack("8.5.1", "2.9.0", "2.9.0", POLYRL_TRANSFORMERS, ">=3.10,<3.12", paired_with="v0.18.0"),
    AscendStack("8.5.0", "2.8.0", "2.8.0.post2", POLYRL_TRANSFORMERS, ">=3.10,<3.12", paired_with="v0.13.0"),
)


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


def seed_era_stack(env: Environment) -> list[Problem]:
    """torch-npu beside a transformers 4 (the stack of the first published GPT-OSS port on Ascend: vllm-ascend
    v0.13.0, torch 2.8, transformers 4.57): refused in one line naming the newest row that installs with polyrl."""
    npu, tf = env.versions.get("torch-npu"), env.versions.get("transformers")
    if not npu or not tf or Version(tf).major >= 5:
        return []
    va = env.versions.get("vllm-ascend")
    beside = f", vllm-ascend {va}" if va else ""
    return [Problem(
        "transformers",
        f"transformers {tf} with torch-npu {npu}{beside} is the seed-era Ascend stack, which polyrl does not run (it "
        f"needs transformers{POLYRL_TRANSFORMERS}, which no vllm-ascend release accepts)",
        f"install the newest supported row: {ASCEND_STACKS[0].line()}",
    )]


RULES = (torch_npu_without_cann, torch_npu_pairs_torch, vllm_ascend_pairs, seed_era_stack)


def compatibility() -> Compatibility:
    return Compatibility(components=COMPONENTS, facts={CANN_FACT: cann_version()}, rules=RULES)
