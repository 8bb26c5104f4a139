"""The model config as inference engines read it: fields their loaders need that transformers' config omits.

transformers 5's ``DeepseekV3Config`` has no ``topk_method`` / ``scoring_func``: its MoE gate always routes
DeepSeek-V3's way (sigmoid scores, the ``e_score_correction_bias`` added for the top-k choice only, "noaux_tc"
in DeepSeek's own ``config.json``). vLLM's DeepSeek loader reads those two fields and creates the bias only for
``topk_method == "noaux_tc"``; without them an export fails to load there (``KeyError:
'layers.1.mlp.gate.e_score_correction_bias'``) or routes with softmax scores. So every config polyrl writes for
serving — ``polyrl export``'s and the vllm engine's — carries them (:func:`serving_config`).
"""

from __future__ import annotations

import copy
from typing import Any

# model_type -> fields (name -> value) an engine's loader needs; set only where the config lacks them.
SERVING_FIELDS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
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
