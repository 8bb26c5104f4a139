"""Attention: the op, its exact reference, and its registration in transformers.

- :mod:`.op` — :func:`varlen_attention` (training, packed documents) and :func:`decode_attention`
  (generation against a KV cache): validation and dispatch to the active backend.
- :mod:`.reference` — the exact blockwise fp32 reference every backend falls back to and is tested against.
- :mod:`.hf` — the transformers attention implementation ``"polyrl"`` (attention and mask function).

The op is re-exported here lazily (``from polyrl.core.attention import varlen_attention``): ``import polyrl``
registers :mod:`.hf` and must not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["decode_attention", "varlen_attention"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from polyrl.core.attention import op

        return getattr(op, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
