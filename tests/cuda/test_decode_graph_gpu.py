"""The hf engine's ``rollout.decode: graph`` on a real GPU: the same tokens as the dynamic decode and log-probs
within rounding, on both tiny model families (fp32 and bf16), with ragged prompts, a sliding window shorter than
the sequences and stop tokens; one capture reused across calls of one shape; a new capture after the weights'
storage changes (a LoRA merge swaps tensors), with results that follow the new weights. Skipped without CUDA.

Run on one H100 (2026-12-05, 42b8909): the bf16 cases captured and matched dynamic; the fp32 cases could not be
captured (transformers' fp32 experts read the expert offsets on the host), the engine warned once and decoded as
static, with the same tokens. Since then a step to be captured runs fp32 experts through transformers' batched_mm
path (polyrl.core.models.experts); on one H100 (2026-12-06, c178864) every case here passed, fp32 captured."""

from __future__ import annotations

import pytest
import torch

from polyrl.backends.cuda import CudaBackend
from polyrl.core.models import build_model
from polyrl.core.rollout import SamplingParams, build_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[1, 5, 6, 7, 8, 9, 3, 4, 5], [1, 9, 8], [1, 4, 4, 4, 4], [1, 7], [1, 9, 8]] * 4
MAX_TOKENS = 14


def _model(name: str, dtype: torch.dtype):
    overrides = {"sliding_window": 4} if name == "gpt_oss_tiny" else None
    return build_model(name, vocab_size=17, seed=0, overrides=overrides, dtype=dtype, backend="cuda",
                       device="cuda").eval()


def _generate(engine, seed: int = 0):
    params = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, stop_token_ids=[3])
    return engine.generate(PROMPTS, params, row_seeds=[seed * 100 + i for i in range(len(PROMPTS))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gpt_oss_tiny", "deepseek_v3_tiny"])
def test_gpu_graph_decode_equals_dynamic(name: str, dtype: torch.dtype) -> None:
    model = _model(name, dtype)
    dyn = _generate(build_engine("hf", model, pad_token_id=0))
    engine = build_engine("hf", model, pad_token_id=0, decode="graph", backend=CudaBackend())
    got = _generate(engine)
    assert got.response_ids == dyn.response_ids and got.finish_reasons == dyn.finish_reasons
    err = max(abs(a - b) for x, y in zip(got.logprobs, dyn.logprobs) for a, b in zip(x, y))
    print(name, dtype, "max |dlogp|", err)
    assert err < (1e-4 if dtype == torch.float32 else 3e-2), err
    again = _generate(engine, seed=1)
    assert engine._static.captures == 1  # same shape, same weights: the graph is replayed, not captured again
    assert again.response_ids == _generate(build_engine("hf", model, pad_token_id=0), seed=1).response_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_new_weight_storage_is_captured_again(dtype: torch.dtype) -> None:
    model = _model("gpt_oss_tiny", dtype)
    engine = build_engine("hf", model, pad_token_id=0, decode="graph", backend=CudaBackend())
    _generate(engine)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.data = head.data.clone() * 1.5  # new storage, other values: what a LoRA merge does to a weight
    got = _generate(engine)
    assert engine._static.captures == 2
    want = _generate(build_engine("hf", model, pad_token_id=0))
    assert got.response_ids == want.response_ids
