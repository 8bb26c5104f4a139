"""tests/cuda: Triton kernels under the interpreter on CPU, and the same kernels on a real GPU (marked gpu).

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates, i.e. when polyrl.backends.cuda.kernels is first
imported. On a machine without CUDA we switch the interpreter on here, before any test module imports the
kernels; on a CUDA machine the kernels compile for the GPU and only the ``gpu`` tests apply.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The gpu tests check numbers, not speed: one config per kernel instead of autotuning every shape class.
os.environ.setdefault("POLYRL_TRITON_AUTOTUNE", "0")


@pytest.fixture
def epilogue(request, monkeypatch):
    """The cuBLAS log-prob paths' two Triton epilogues (indirect parameter): 'triton', the kernels (on CPU tensors only
    under TRITON_INTERPRET=1), or 'torch', their torch stand-ins (what CPU tensors get without the interpreter)."""
    import polyrl.backends.cuda.linear_logprobs as LL
    from polyrl.backends.cuda.kernels.configs import interpreting

    if request.param == "triton" and not interpreting():
        pytest.skip("the Triton epilogues run on CPU tensors only under TRITON_INTERPRET=1")
    if request.param == "torch":
        monkeypatch.setattr(LL, "_runs_triton", lambda t: False)
    return request.param
