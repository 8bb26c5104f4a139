"""Which path the cuda backend's fused lm_head + log-prob op runs (polyrl.backends.cuda.linear_logprobs):
``POLYRL_LINEAR_LOGPROBS`` = ``cublas`` (the default: every matmul in cuBLAS, Triton reading the fp32 logits) |
``triton`` (the matmuls fused into Triton kernels), read at every call; another value is refused in one line.

Kept apart from the kernels' module, which imports Triton: ``polyrl backends`` reads ``linear_logprobs_report``
without a vendor import. The default is ``cublas`` since a GPU run of ``bench/logprob_linear.py`` measured it
faster at every size (H100, 16k tokens, V 201,088, with entropy: 141 ms against the Triton path's 199 ms and
Liger's 151 ms; docs/performance.md).
"""

from __future__ import annotations

import os

from polyrl.core.errors import BadInputError

PATH_ENV = "POLYRL_LINEAR_LOGPROBS"
PATHS = ("cublas", "triton")  # the first is the default


def linear_logprobs_path() -> str:
    """The path ``triton_linear_logprobs`` runs (unset or empty: ``cublas``); ``BadInputError`` for another value."""
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
    return {"bfloat16 / float16 / float32": f"{path} ({why}; measured on an H100 at 16k tokens: cublas 141 ms, triton 199 ms)",
            "float64": "reference (no fp64 tensor-core dot)",
            "override": f"{PATH_ENV}=cublas|triton (now: {path})"}
