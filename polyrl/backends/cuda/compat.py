"""The cuda backend's rows of the compatibility table (polyrl.core.compat): what it reports, and torch's CUDA
version read from torch/version.py's text (a broken torch install cannot crash doctor)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from polyrl.core.compat import Compatibility

COMPONENTS: tuple[str, ...] = ("triton", "vllm", "torchvision")
TORCH_CUDA_FACT = "torch cuda"  # the CUDA version torch was built with; None for a CPU / NPU build


def torch_cuda_version() -> str | None:
    """torch.version.cuda, read from torch/version.py's text so that a broken torch cannot crash us."""
    try:
        path = metadata.distribution("torch").locate_file("torch/version.py")
        text = Path(str(path)).read_text()
    except (metadata.PackageNotFoundError, OSError):
        return None
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return m.group(1) if m else None


def compatibility() -> Compatibility:
    return Compatibility(components=COMPONENTS, facts={TORCH_CUDA_FACT: torch_cuda_version()})
