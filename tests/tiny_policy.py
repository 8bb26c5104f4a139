"""What the fused lm_head path's tests share (tests/models/test_models_lm_head.py, tests/trainer/test_fused_loss.py):
three rows of prompts and responses of different lengths (17-token vocabulary), and the two tiny model families."""

from __future__ import annotations

import torch

from polyrl.core.models import build_model
from polyrl.core.trainer.batch import SequenceBatch

BATCH = SequenceBatch.from_rollout(
    prompts=[[1, 5, 6], [1, 7], [1, 8, 9, 10]], responses=[[3, 4, 2], [11, 12, 13, 14], [15]],
    logprobs=[[0.0] * 3, [0.0] * 4, [0.0]], group_ids=[0, 0, 1])
FAMILIES = ["gpt_oss_tiny", "deepseek_v3_tiny"]


def tiny_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, vocab_size=17, seed=0)
