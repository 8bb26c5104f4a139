"""The one map from dtype names to torch dtypes: recipes (``model.dtype``), backends' sharding policies
(``param_dtype`` / ``reduce_dtype``) and ``polyrl export --dtype`` all name dtypes by these strings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrl.core.errors import BadInputError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def torch_dtype(name: str, *, what: str = "dtype") -> torch.dtype:
    """``torch.<name>`` for a supported name; ``BadInputError`` naming ``what`` (e.g. "model.dtype") otherwise."""
    import torch

    if name not in DTYPE_NAMES:
        raise BadInputError(f"{what}: unknown dtype {name!r} (expected one of {', '.join(DTYPE_NAMES)})")
    return getattr(torch, name)
