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


def compute_dtype(model_dtype: str, fsdp_param_dtype: str, *, sharded: bool) -> str:
    """The dtype forward and backward run in: the FSDP2 mixed-precision ``param_dtype`` of the backend's sharding
    policy when the model is sharded, the model's own (``model.dtype``) otherwise (the dry-run memory plan's sizes;
    the trainer's sync probe takes the policy's dtype even in one process, the bar of the sharded run)."""
    return fsdp_param_dtype if sharded else model_dtype


def lowest_precision(*dtypes: str) -> str:
    """The lowest precision among ``dtypes`` (names): "float32" when all are, else the first of the others in name
    order ("bfloat16" before "float16": bf16's tolerance is the looser). Whose tolerance a comparison of
    computations made in these dtypes uses."""
    others = sorted(set(dtypes) - {"float32"})
    return others[0] if others else "float32"
