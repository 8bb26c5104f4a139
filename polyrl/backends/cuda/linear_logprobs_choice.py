"""Which path the cuda backend's fused lm_head + log-prob op runs (polyrl.backends.cuda.linear_logprobs):
``POLYRL_LINEAR_LOGPROBS`` = ``triton`` (the default: matmuls fused into Triton kernels) | ``cublas`` (every
matmul in cuBLAS, Triton reading the fp32 logits), read at every call; another value is refused in one line.

Kept apart from the kernels' module, which imports Triton: ``polyrl backends`` reads ``linear_logprobs_report``
without a vendor import. The default moves to ``cublas`` only after an H200 run of ``bench/logprob_linear.py``
shows it faster (docs/performance.md).
"""

from __future__ import annotations

import os

from polyrl.core.errors import BadInputError

PATH_ENV = "POLYRL_LINEAR_LOGPROBS"
PATHS = ("triton", "cublas")  # the first is the default


def linear_logprobs_path() -> str:
    """The path ``triton_linear_logprobs`` runs (unset or empty: ``triton``); ``BadInputError`` for another value."""
    value = os.environ.get(PATH_ENV, "").strip() or PATHS[0]
    if value not in PATHS:
        raise BadInputError(f"{PATH_ENV}={value!r}: expected one of {', '.join(PATHS)}")
    return value


def linear_logprobs_report() -> dict[str, str]:
    """{case: "what runs (why)"} for ``polyrl backends`` (``kernel_choices``). No device, no vendor import."""
    try:
        path = linear_logprobs_path()
    except BadInputError as exc:
        return {"all": f"error ({exc})"}
    why = "the default" if not os.environ.get(PATH_ENV, "").strip() else f"{PATH_ENV}={path}"
    return {"bfloat16 / float16 / float32": f"{path} ({why}; the cublas path is not yet measured on a GPU)",
            "float64": "reference (no fp64 tensor-core dot)",
            "override": f"{PATH_ENV}=triton|cublas (now: {path})"}
