"""The ``linear_logprob_loss`` kernel slot (0.3): declared with the core reference as its default, provided by the
cuda backend (its cuBLAS version), left to the reference by the Ascend backend, and checked by the conformance
kit on the CPU backend; the kit's check fails a kernel that hands the loss's gradient to the wrong rows."""

from __future__ import annotations

import torch

from polyrl.backends.ascend import AscendBackend
from polyrl.backends.cpu import CpuBackend
from polyrl.backends.cuda import CudaBackend
from polyrl.core.algorithms.linear_loss import linear_logprob_loss
from polyrl.core.plugins import KERNELS, Backend
from polyrl.core.plugins.kernels import KERNEL_SLOTS, REFERENCE_KERNELS, resolve_kernel
from polyrl.plugins import linear_logprob_loss_check


def test_the_slot_is_declared_with_the_reference_as_default() -> None:
    assert KERNELS[-1] == "linear_logprob_loss" and KERNEL_SLOTS["linear_logprob_loss"] == "linear_logprob_loss_kernel"
    assert REFERENCE_KERNELS["linear_logprob_loss"] == "polyrl.core.algorithms.linear_loss:linear_logprob_loss"
    assert resolve_kernel(Backend.linear_logprob_loss_kernel) is linear_logprob_loss
    assert "linear_logprob_loss" in CudaBackend().provided_kernels()
    assert "linear_logprob_loss" in AscendBackend().introspection.kernels_fallback()


def test_conformance_check_passes_the_reference_and_fails_a_shifted_kernel() -> None:
    check = linear_logprob_loss_check(CpuBackend(), "float32")
    assert check.status == "pass", check.detail
    assert "weight gradient" in check.detail

    class Shifted(CpuBackend):
        """Hands each chunk's gradient to the rows one chunk later (a wrong offset in a kernel's loop)."""

        def linear_logprob_loss(self, hidden, weight, labels, token_grad, **kw):
            def shifted(t0, t1, lp, ent):
                g_lp, g_ent = token_grad(t0, t1, lp, ent)
                return torch.roll(g_lp, 1), g_ent

            return super().linear_logprob_loss(hidden, weight, labels, shifted, **kw)

    check = linear_logprob_loss_check(Shifted(), "float32")
    assert check.status == "fail" and "hidden gradient differ" in check.detail, check.detail
