"""Shared by the decode interpreter and gpu tests: random KV-cache cases and the check against the core reference."""

from __future__ import annotations

import torch

from polyrl.core.tolerances import check_close, tolerance


def make_decode_case(b, sq, sk, hq, hkv, d, dv, dtype, *, pads=None, sink=False, seed=0, device="cpu",
                     head_major=False):
    """q [B, Sq, Hq, D], k_cache [B, Sk, Hkv, D], v_cache [B, Sk, Hkv, Dv] in ``dtype``; mask bool [B, Sk] with
    ``pads[r]`` left-padded slots in row r (None: no mask); sinks fp32 [Hq] or None. ``head_major``: q, k, v are
    transposed views of [B, H, S, D] tensors, as transformers hands them to the attention function."""
    gen = torch.Generator().manual_seed(seed)

    def draw(s, h, e):
        if head_major:
            return torch.randn(b, h, s, e, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(b, s, h, e, generator=gen).to(device=device, dtype=dtype)

    q, k, v = draw(sq, hq, d), draw(sk, hkv, d), draw(sk, hkv, dv)
    sinks = (2 * torch.randn(hq, generator=gen)).to(device) if sink else None
    mask = None
    if pads is not None:
        assert len(pads) == b
        mask = torch.arange(sk)[None, :] >= torch.tensor(pads)[:, None]
        mask = mask.to(device)
    return q, k, v, mask, sinks


def visible_rows(b, sq, sk, hq, mask, window) -> torch.Tensor:
    """bool [B, Sq, Hq]: does the query see at least one key (else its output is zeros)."""
    qpos = torch.arange(sk - sq, sk)[:, None]
    kpos = torch.arange(sk)[None, :]
    allowed = (kpos <= qpos) & ((qpos - kpos < window) if window is not None else True)
    allowed = allowed[None].expand(b, sq, sk)
    if mask is not None:
        allowed = allowed & mask.cpu()[:, None, :]
    return allowed.any(-1)[:, :, None].expand(b, sq, hq)


def assert_matches_reference(got, want, dtype, visible=None):
    """The attention bars of polyrl/core/tolerances.py: relative norm error, and the worst row's ((b, query, head)
    vector) error against its own size, which a norm over many rows would dilute; rows that see no key must be
    exactly zero in both."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got).all(), "non-finite output"
    err, bar, ok = check_close("attention.forward", got, want, dtype)
    assert ok, f"relative error {err:.2e} > {bar:.1e}"
    a, e = got.double().cpu(), want.double().cpu()
    num, den = (a - e).norm(dim=-1), e.norm(dim=-1)
    if visible is not None:
        hidden = ~visible
        assert torch.equal(a[hidden], torch.zeros_like(a[hidden])), "a query that sees no key is not zero"
        assert torch.equal(e[hidden], torch.zeros_like(e[hidden]))
    ratio = torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, torch.inf, 0.0))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    row_bar = tolerance("attention.forward.row", dtype)
    where = tuple(int(x) for x in (ratio == ratio.max()).nonzero()[0]) if ratio.numel() else ()
    assert worst <= row_bar, f"worst row (b, query, head) {where}: {worst:.2e} > {row_bar:.1e}"
