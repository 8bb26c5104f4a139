"""The backend is bound where the model is built: each model's "polyrl" attention runs the backend it was built
with, whatever the process's active backend is, so two models under two backends work side by side in one
process; a backend imports its kernel once, not per call."""

from __future__ import annotations

import copy

import pytest
import torch
from planted_backends import WrongScaleBackend

from polyrl.backends.cpu import CpuBackend
from polyrl.core.attention.hf import bind_backend, bound_backend
from polyrl.core.models import build_model
from polyrl.core.plugins import kernels as kernels_module
from polyrl.core.plugins.selection import get_active_backend, reset_active_backend, set_active_backend

VOCAB = 17


class Counting(CpuBackend):
    """The cpu backend, counting the attention calls it receives (each instance its own count)."""

    name = "counting"
    is_reference = False

    def __init__(self) -> None:
        self.calls = 0

    def varlen_attention(self, q, k, v, cu_seqlens, *, scale, window, sinks):
        self.calls += 1
        return super().varlen_attention(q, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks)


@pytest.fixture(autouse=True)
def _fresh_active_backend():
    reset_active_backend()
    yield
    reset_active_backend()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def test_two_models_under_two_backends_each_run_their_own():
    a, b = Counting(), Counting()
    model_a = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0, backend=a).eval()
    model_b = build_model("deepseek_v3_tiny", vocab_size=VOCAB, seed=0, backend=b).eval()
    layers_a, layers_b = model_a.config.num_hidden_layers, model_b.config.num_hidden_layers
    _logits(model_a)
    assert (a.calls, b.calls) == (layers_a, 0)
    _logits(model_b)
    _logits(model_a)
    assert (a.calls, b.calls) == (2 * layers_a, layers_b)
    # the process's active backend is neither, and changing it changes neither model
    set_active_backend("cpu")
    _logits(model_b)
    assert (a.calls, b.calls) == (2 * layers_a, 2 * layers_b)


def test_a_planted_backends_model_differs_from_the_cpu_model_beside_it():
    """Same weights, one model on the cpu backend, one on a backend that scales the sinks (GPT-OSS has sinks):
    each computes with its own attention, in either order."""
    cpu_model = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0, backend="cpu").eval()
    planted = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0, backend=WrongScaleBackend()).eval()
    reference = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0, attn_implementation="eager").eval()
    first = _logits(cpu_model)
    wrong = _logits(planted)
    again = _logits(cpu_model)
    torch.testing.assert_close(first, _logits(reference))  # the cpu model is the exact reference
    assert torch.equal(first, again)
    assert not torch.allclose(wrong, first, atol=1e-4)


def test_build_without_a_backend_binds_the_active_one_for_the_models_life():
    set_active_backend("cpu")
    model = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0)
    assert bound_backend(model) is get_active_backend()
    assert all(bound_backend(m) is get_active_backend() for m in model.modules())


def test_a_copy_shares_the_backend_and_rebinding_moves_the_model():
    counting = Counting()
    model = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0, backend=counting).eval()
    ref = copy.deepcopy(model)  # how the trainer makes its reference model
    assert bound_backend(ref) is counting
    other = Counting()
    bind_backend(ref, other)
    _logits(ref)
    assert (counting.calls, other.calls) == (0, model.config.num_hidden_layers)
    assert bound_backend(model) is counting


def test_a_kernel_is_resolved_once_per_backend(monkeypatch):
    resolved: list[str] = []
    real = kernels_module.resolve_kernel

    def counting_resolve(path):
        resolved.append(path)
        return real(path)

    monkeypatch.setattr(kernels_module, "resolve_kernel", counting_resolve)
    backend = CpuBackend()
    model = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0, backend=backend).eval()
    assert resolved == []  # nothing imported at build: vendor modules load when a kernel first runs
    _logits(model)
    _logits(model)
    # 2 forwards x every layer, one import per kernel (attention, then the MoE experts)
    assert resolved == [CpuBackend.attention_kernel, CpuBackend.experts_kernel]


def test_native_kernels_is_a_warning_alias():
    with pytest.warns(DeprecationWarning, match="provided_kernels"):
        assert CpuBackend().native_kernels == CpuBackend().provided_kernels()
