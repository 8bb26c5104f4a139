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


def ppo_like(lp, old, adv):
    """A per-token loss term that depends on the log-prob nonlinearly (a clipped ratio, as PPO's): its gradient
    changes with the log-prob, so a fused op must take it at the op's own values."""
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28))


def loss_inputs(N, seed=1):
    """old log-probs, advantages and per-token aggregation weights [N] of ``ppo_like``; an entropy weight [N]."""
    g = torch.Generator().manual_seed(seed)
    return (-2.0 + torch.rand(N, generator=g), torch.randn(N, generator=g), torch.rand(N, generator=g) / N,
            torch.rand(N, generator=g) / N)


def unfused_loss_grads(fn, hidden, weight, bias, labels, tau, terms, *, entropy=True, device="cpu", **kw):
    """[loss, log-probs, entropies, dhidden, dweight(, dbias)] on the CPU: ``fn`` (a linear_logprobs kernel), then
    the loss sum(w * ppo_like(lp)) (+ sum(w_ent * ent)) through autograd."""
    old, adv, w, w_ent = (t.to(device) for t in terms)
    leaves = [t.clone().to(device).requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    lp, ent = fn(leaves[0], leaves[1], labels.to(device), bias=leaves[2] if bias is not None else None,
                 temperature=tau, compute_entropy=entropy, **kw)
    loss = (w * ppo_like(lp, old, adv.to(lp.dtype))).sum() + ((w_ent * ent).sum() if entropy else 0)
    loss.backward()
    return [loss.detach().cpu(), lp.detach().cpu(), ent.detach().cpu()] + [t.grad.cpu() for t in leaves]


def fused_loss_grads(fn, hidden, weight, bias, labels, tau, terms, *, entropy=True, device="cpu", calls=None, **kw):
    """The same through a fused-loss op ``fn`` (polyrl.core.algorithms.linear_loss's contract): ``token_grad``
    differentiates the same per-token terms on each chunk; the loss value is taken from the returned log-probs and
    the anchor added to it. ``calls`` (a list) collects each call's rows."""
    old, adv, w, w_ent = (t.to(device) for t in terms)

    def token_grad(t0, t1, lp_c, ent_c):
        if calls is not None:
            calls.append((t0, t1))
        lp_leaf = lp_c.detach().clone().requires_grad_()
        ent_leaf = ent_c.detach().clone().requires_grad_()
        part = (w[t0:t1] * ppo_like(lp_leaf, old[t0:t1], adv[t0:t1].to(lp_leaf.dtype))).sum()
        if entropy:
            part = part + (w_ent[t0:t1] * ent_leaf).sum()
        g_lp, g_ent = torch.autograd.grad(part, [lp_leaf, ent_leaf], allow_unused=True)
        return g_lp, (g_ent if entropy else None)

    leaves = [t.clone().to(device).requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    anchor, lp, ent = fn(leaves[0], leaves[1], labels.to(device), token_grad,
                         bias=leaves[2] if bias is not None else None, temperature=tau, compute_entropy=entropy, **kw)
    assert not lp.requires_grad and not ent.requires_grad and anchor.requires_grad and float(anchor.detach()) == 0.0
    loss = (w * ppo_like(lp, old, adv.to(lp.dtype))).sum() + ((w_ent * ent).sum() if entropy else 0)
    (loss + anchor).backward()
    return [loss.detach().cpu(), lp.cpu(), ent.cpu()] + [t.grad.cpu() for t in leaves]
