"""Shared by the interpreter and gpu tests: random cases and a run of kernel + fp64 oracle (polyrl.testing)."""

from __future__ import annotations

import torch

from polyrl.testing.attention_oracle import dense_attention_fp64 as dense_oracle


def make_case(lengths, hq, hkv, d, dv, dtype, sink, seed, device="cpu"):
    """Random q, k, v, sinks (fp32 [Hq] or None), cu_seqlens and an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, dv, generator=gen)
    sinks = torch.randn(hq, generator=gen) * 2 if sink else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    d_out = torch.randn(t, hq, dv, generator=gen)
    cast = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), None if sinks is None else sinks.to(device), cu.to(device), cast(d_out))


def run_both(fn, q, k, v, sinks, cu, d_out, *, window):
    """Output and grads of ``fn`` (leaves in the given dtype) and of the fp64 oracle, as dicts."""
    scale = q.shape[-1] ** -0.5
    leaves = {"q": q, "k": k, "v": v, **({"sinks": sinks} if sinks is not None else {})}
    ours = {n: x.detach().clone().requires_grad_() for n, x in leaves.items()}
    out = fn(ours["q"], ours["k"], ours["v"], cu, scale=scale, window=window, sinks=ours.get("sinks"))
    out.backward(d_out)
    ref = {n: x.detach().double().requires_grad_() for n, x in leaves.items()}
    expected = dense_oracle(ref["q"], ref["k"], ref["v"], cu, scale=scale, window=window, sinks=ref.get("sinks"))
    expected.backward(d_out.double())
    got = {"out": out.detach(), **{f"d{n}": x.grad for n, x in ours.items()}}
    want = {"out": expected.detach(), **{f"d{n}": x.grad for n, x in ref.items()}}
    return got, want


# The opt-in kernel paths (polyrl.backends.cuda.attention.KernelOptions keyword arguments), for the GPU and
# interpreter tests alike.
VARIANTS = {
    "atomic": {"bwd": "atomic"},
    "band": {"window_tiles": "band"},
    "aligned": {"window_tiles": "aligned"},
    "table": {"configs": "table"},
    "all": {"bwd": "atomic", "window_tiles": "band", "configs": "table"},
}
