"""The PPO critic: the actor's architecture with its LM head replaced by a scalar value head.

The critic is built like the actor (same preset or checkpoint, its own seed) and keeps the decoder
trunk (``model.model`` in transformers causal LMs); the head is a zero-initialised ``Linear(H, 1)`` so
every initial value is 0 and the first advantages equal the returns. The head is in the trunk's dtype (a bf16
recipe has a bf16 critic: one dtype for the matmul, and the uniform parameter dtype FSDP2 asks for); the
values leave it as fp32, like every other per-token quantity of the update.
"""

from __future__ import annotations

import torch
from torch import nn


class ValueModel(nn.Module):
    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        self.model = causal_lm.model  # the decoder trunk; the LM head is dropped
        self.config = causal_lm.config
        hidden = causal_lm.config.hidden_size
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())  # the trunk's
        self.value_head = nn.Linear(hidden, 1, dtype=dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, **kwargs) -> torch.Tensor:
        """Values [B, T] (fp32) for the inputs the trunk accepts (input_ids, position_ids, attention_mask)."""
        hidden = self.model(**kwargs, use_cache=False).last_hidden_state  # [B, T, H] in the trunk's dtype
        return self.value_head(hidden).squeeze(-1).float()  # [B, T] fp32
