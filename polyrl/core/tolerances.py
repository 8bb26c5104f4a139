"""THE one table of parity tolerances: every comparison a test or a parity report makes is listed here.

Errors are measured as a relative norm, ``||actual - expected|| / ||expected||`` (in fp64), which is stable
across shapes and does not explode on entries close to zero the way an element-wise relative error does.
The key is ``(comparison, dtype)`` where dtype is the dtype of the *inputs* of the thing under test
("float32", "bfloat16", "float16"). A report prints the measured error next to the bar (``check_close``).

Append-only for other helpers: add a clearly separated block with a comment saying who needs it and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# (comparison, input dtype) -> maximum relative norm error.
TOLERANCES: dict[tuple[str, str], float] = {
    # --- attention op: an implementation vs an independent fp64 dense reference ------------------------
    # fp32 inputs: exact fp32 math, only accumulation order differs from fp64 (measured ~1e-7).
    ("attention.forward", "float32"): 1e-5,
    ("attention.grad", "float32"): 1e-5,
    # bf16/fp16 inputs: the math is fp32; the error is the final rounding of the output / gradients to the
    # input dtype (bf16 has 8 mantissa bits: ~2e-3 relative rms). FA4/FLA measure 2e-3..3.4e-3 on H200.
    ("attention.forward", "bfloat16"): 6e-3,
    ("attention.grad", "bfloat16"): 6e-3,
    ("attention.forward", "float16"): 1e-3,
    ("attention.grad", "float16"): 1e-3,
    # --- transformers integration: attn_implementation="polyrl" vs "eager" on tiny models -------------
    ("model.logits", "float32"): 1e-5,
    # parameter gradients of a loss on those logits (same comparison, backward).
    ("model.grads", "float32"): 1e-5,
    # per-token logprobs of a packed batch vs each document alone (same implementation).
    ("model.logprobs_packed", "float32"): 1e-5,
    # --- algorithms helper: chunked fp32 logprobs/entropy (A.logprobs_and_entropy) vs fp64 log_softmax ---
    # The math is fp32 on the exact input values for every input dtype (measured ~1e-7 relative norm).
    ("algorithms.logprobs", "float32"): 1e-6,
    ("algorithms.logprobs", "bfloat16"): 1e-6,
    ("algorithms.logprobs_grad", "float32"): 1e-5,
    # bf16 logits get a bf16 gradient: its final rounding dominates (~2e-3 relative rms).
    ("algorithms.logprobs_grad", "bfloat16"): 6e-3,
    # --- trainer/rollout helper: the hf engine's sampling logprobs (KV cache, left padding) vs the trainer's
    # packed recompute / a full forward of each sequence alone. Same fp32 math, different kernels/order.
    ("rollout.logprobs", "float32"): 1e-5,
}


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def tolerance(name: str, dtype: torch.dtype | str) -> float:
    """The bar for ``name`` at ``dtype``; a missing entry is an error, never a silent default."""
    key = (name, _dtype_name(dtype))
    if key not in TOLERANCES:
        known = sorted({n for n, _ in TOLERANCES})
        raise KeyError(f"no tolerance for {key}; comparisons in the table: {known}")
    return TOLERANCES[key]


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """``||actual - expected|| / max(||expected||, floor)`` computed in fp64.

    ``floor`` is for comparisons whose exact answer is zero (e.g. dQ of a window of one key without sink):
    pass the magnitude of the terms that cancel, so rounding is measured against that scale.
    """
    a = actual.detach().double()
    e = expected.detach().double()
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    num = (a - e).norm().item()
    den = max(e.norm().item(), floor)
    if den == 0.0:
        return num
    return num / den


def check_close(
    name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | str, *, floor: float = 0.0
) -> tuple[float, float, bool]:
    """Measured relative error, the bar from the table, and whether it passes. NaNs never pass."""
    err = relative_error(actual, expected, floor)
    bar = tolerance(name, dtype)
    return err, bar, bool(err <= bar)  # err <= bar is False for NaN


# --- sharding / checkpoints (issue 6, distributed helper) -----------------------------------------------
# N-process FSDP2 (gloo, fp32) vs the 1-process run on the same global batch: only the order of the
# gradient reduction and of the global-norm sum differs (measured ~5e-8 relative on the toy loop).
TOLERANCES[("distributed.loss", "float32")] = 1e-5

# --- parity harness (polyrl/testing/parity.py, `polyrl parity --level model`) -----------------------------
# Per-token logprobs of the tiny presets on a backend vs the CPU fp32 reference, packed documents.
# fp32: same math, different kernel — accumulation order only. bf16: the whole model runs in bf16 on the
# accelerator (weights, activations), so the error is dominated by bf16 matmuls, not by attention; the bar is
# provisional until measured on GPU/NPU hardware.
TOLERANCES[("model.logprobs", "float32")] = 1e-5
TOLERANCES[("model.logprobs", "bfloat16")] = 3e-2
