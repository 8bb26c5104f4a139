"""The cuda backend's fused lm_head + log-prob + entropy (Triton forward and backward) on CPU tensors under
TRITON_INTERPRET=1, against the core reference and fp64 through the full logits. fp32 checks the math exactly;
fp16 the low-precision tile path (bf16 arithmetic is wrong in the interpreter: the gpu tests cover it). Shapes are
tiny but cover ragged token tiles, a vocabulary not divisible by the 16-column tiles, several vocabulary slices
(the slice merge), bias, temperature, and the label in the last, partial tile."""

from __future__ import annotations

import os

import pytest
import torch
from linear_logprobs_cases import make_inputs, run_with_grads, triton_kernel

from polyrl.core.algorithms.linear_logprobs import linear_logprobs_and_entropy
from polyrl.core.tolerances import relative_error, tolerance

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="interpreter tests run on CPU-only machines (the gpu tests cover CUDA)",
)


@pytest.mark.parametrize("N,H,V,dtype,with_bias,tau", [
    (37, 16, 120, torch.float32, True, 0.7),  # 3 token tiles (last ragged), 8 vocabulary tiles, bias
    (9, 16, 50, torch.float32, False, 1.0),  # one token tile, V not a multiple of 16
    (21, 32, 70, torch.float16, True, 1.3),  # fp16 tiles, fp32 accumulation
])
def test_triton_equals_reference_and_full_logits(N, H, V, dtype, with_bias, tau) -> None:
    args = make_inputs(N, H, V, dtype, with_bias, label_in_last_tile=True)
    got = run_with_grads(triton_kernel(), *args, tau, chunk_size=8, vocab_chunk_size=32)
    ref = run_with_grads(linear_logprobs_and_entropy, *args, tau, chunk_size=8, vocab_chunk_size=32)
    h, w, b, labels = (t.double() if t is not None and t.is_floating_point() else t for t in args[:4])
    z = h @ w.t() + (b if b is not None else 0)
    logs = torch.log_softmax(z / tau, -1)
    exact = [logs.gather(1, labels[:, None])[:, 0], -(logs.exp() * logs).sum(-1)]
    name = str(dtype).removeprefix("torch.")
    for what, g, e in zip(("logp", "entropy"), got[:2], exact):
        assert g.dtype == torch.float32
        err, bar = relative_error(g, e), tolerance("algorithms.linear_logprobs", name)
        assert err <= bar, f"{what}: {err:.2e} > {bar:.2e}"
    for g, r in zip(got[2:], ref[2:]):  # Triton backward vs the reference backward
        assert g.dtype == dtype
        err, bar = relative_error(g.float(), r.float()), tolerance("algorithms.linear_logprobs_grad", name)
        assert err <= bar, f"grad: {err:.2e} > {bar:.2e}"


def test_triton_single_outputs() -> None:
    """Only the log-probs (compute_entropy=False), and only the entropy, carry a gradient: the kernel's
    HAS_GLP / HAS_GENT paths give the reference's gradients."""
    hidden, weight, _, labels, w_lp, w_ent = make_inputs(20, 16, 45, torch.float32, False, seed=3, label_in_last_tile=True)
    bar = tolerance("algorithms.linear_logprobs_grad", "float32")
    for use_lp, use_ent in ((True, False), (False, True)):
        grads = []
        for fn in (triton_kernel(), linear_logprobs_and_entropy):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            lp, ent = fn(h, w, labels, compute_entropy=use_ent, vocab_chunk_size=16)
            ((lp * w_lp).sum() if use_lp else (ent * w_ent).sum()).backward()  # the other output unused: None
            grads.append((h.grad, w.grad, lp.detach(), ent.detach()))
        (gh, gw, lp, ent), (rh, rw, lp_ref, _) = grads
        assert relative_error(gh, rh) <= bar and relative_error(gw, rw) <= bar
        assert relative_error(lp, lp_ref) <= tolerance("algorithms.linear_logprobs", "float32")
        if not use_ent:
            assert torch.all(ent == 0)
