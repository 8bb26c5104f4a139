"""Inputs and the run-with-gradients helper shared by the fused lm_head log-prob tests (GPU and interpreter)."""

from __future__ import annotations

import torch


def triton_kernel():
    from polyrl.backends.cuda.linear_logprobs import triton_linear_logprobs

    return triton_linear_logprobs


def make_inputs(N, H, V, dtype, with_bias, seed=0, *, label_in_last_tile=False):
    """hidden [N, H], weight [V, H], bias [V] or None, labels [N], and the two upstream gradient weights [N]."""
    g = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(N, H, generator=g)).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    bias = (0.5 * torch.randn(V, generator=g)).to(dtype) if with_bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    if label_in_last_tile:
        labels[-1] = V - 1  # a label in the last, partial vocabulary tile
    return hidden, weight, bias, labels, torch.randn(N, generator=g), torch.randn(N, generator=g)


def run_with_grads(fn, hidden, weight, bias, labels, w_lp, w_ent, tau, *, device="cpu", **kw):
    """[log-probs, entropies, dhidden, dweight(, dbias)] on the CPU, from ``fn`` run on ``device`` with the loss
    sum(lp * w_lp) + sum(ent * w_ent)."""
    leaves = [t.clone().to(device).requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    b = leaves[2] if bias is not None else None
    lp, ent = fn(leaves[0], leaves[1], labels.to(device), bias=b, temperature=tau, **kw)
    ((lp * w_lp.to(device)).sum() + (ent * w_ent.to(device)).sum()).backward()
    return [lp.detach().cpu(), ent.detach().cpu()] + [t.grad.cpu() for t in leaves]


def cublas_kernel():
    from polyrl.backends.cuda.linear_logprobs import cublas_linear_logprobs

    return cublas_linear_logprobs


def fp64_full_logits(hidden, weight, bias, labels, tau):
    """(log-probs, entropies) in fp64 through the full [N, V] logits of the same (dtype-valued) inputs."""
    h, w = hidden.double(), weight.double()
    z = h @ w.t() + (bias.double() if bias is not None else 0)
    logs = torch.log_softmax(z / tau, -1)
    return logs.gather(1, labels[:, None])[:, 0], -(logs.exp() * logs).sum(-1)
