"""varlen_attention (cpu backend) against an independent fp64 dense oracle: forward and all four gradients.

The oracle (polyrl.testing.attention_oracle) is written the way transformers' eager GPT-OSS attention is.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from polyrl.core.attention import decode_attention, varlen_attention
from polyrl.core.attention import reference as reference_attention
from polyrl.core.tolerances import check_close
from polyrl.testing.attention_oracle import dense_attention_fp64 as dense_oracle


def cancellation_scales(q, k, v, cu, d_out, *, scale, window, sinks):
    """Norms of scale * |P * (dP - D)| summed without cancellation, for dQ and dK (fp64)."""
    g = q.shape[1] // k.shape[1]
    sq = sk = 0.0
    for a, b in itertools.pairwise(cu):
        if b == a:
            continue
        qd, kd, vd, dod = q[a:b].double(), k[a:b].double(), v[a:b].double(), d_out[a:b].double()
        kd, vd = kd.repeat_interleave(g, dim=1), vd.repeat_interleave(g, dim=1)
        logits = torch.einsum("ihd,jhd->hij", qd, kd) * scale
        i = torch.arange(b - a)[:, None]
        j = torch.arange(b - a)[None, :]
        allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
        logits = logits.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            logits = torch.cat([logits, sinks.double().view(-1, 1, 1).expand(-1, b - a, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., : b - a]
        o = torch.einsum("hij,jhd->ihd", p, vd)
        dp = torch.einsum("ihd,jhd->hij", dod, vd)
        delta = (dod * o).sum(-1).T  # [h, i]
        mag = p * (dp.abs() + delta.abs()[..., None])
        sq += (scale * torch.einsum("hij,jhd->ihd", mag, kd.abs())).pow(2).sum().item()
        sk += (scale * torch.einsum("hij,ihd->jhd", mag, qd.abs())).pow(2).sum().item()
    return sq**0.5, sk**0.5


def make_inputs(lengths, hq, hkv, d, dv, dtype, sink, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, dv, generator=gen).to(dtype)
    if sink is None:
        sinks = None
    elif sink == "random":
        sinks = torch.randn(hq, generator=gen).to(dtype)
    else:
        sinks = torch.full((hq,), float(sink)).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    d_out = torch.randn(t, hq, dv, generator=gen).to(dtype)
    return q, k, v, sinks, cu, d_out


def run_and_compare(lengths, hq, hkv, d, dv, dtype, window, sink, seed=0):
    q, k, v, sinks, cu, d_out = make_inputs(lengths, hq, hkv, d, dv, dtype, sink, seed)
    scale = d**-0.5
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    s_leaf = None if sinks is None else sinks.clone().requires_grad_(True)
    out = varlen_attention(*leaves, cu, window=window, sinks=s_leaf, backend="cpu")
    assert out.dtype == dtype and out.shape == (sum(lengths), hq, dv)
    out.backward(d_out)

    ref_leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref_s = None if sinks is None else sinks.double().requires_grad_(True)
    ref = dense_oracle(*ref_leaves, cu.tolist(), scale=scale, window=window, sinks=ref_s)
    ref.backward(d_out.double())

    pairs = [("attention.forward", out, ref)]
    pairs += [("attention.grad", a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
    if sinks is not None:
        pairs.append(("attention.grad", s_leaf.grad, ref_s.grad))
    # dQ and dK are sums of terms P_ij (dP_ij - D_i) that can cancel almost exactly (a one-key window: the
    # softmax of one logit is constant, so dQ = dK = 0 up to the sink's share). Any flash-style backward
    # then carries rounding of the size of the cancelling terms; where cancellation removes > 99% of that
    # size, measure the error against it instead of against the (near-zero) exact gradient.
    floors = cancellation_scales(q, k, v, cu.tolist(), d_out, scale=scale, window=window, sinks=sinks)
    report = []
    for idx, (name, actual, expected) in enumerate(pairs):
        assert actual.dtype == dtype
        floor = floors[idx - 1] if idx in (1, 2) else 0.0
        floor = floor if expected.double().norm() < 0.01 * floor else 0.0
        err, bar, ok = check_close(name, actual, expected, dtype, floor=floor)
        report.append((name, err, bar, ok))
    assert all(ok for *_, ok in report), report


DOCS = [1, 37, 300, 5, 1, 130, 2]  # ragged, includes length 1 and a document longer than any window here
WINDOWS = [None, 1, 3, 128]
SINKS = [None, "random", 30.0, -30.0]
GQA = [(4, 4), (4, 2), (8, 1)]  # ratios 1, 2, 8


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sink", SINKS)
def test_fp32_grid(window, sink):
    # Cycle GQA ratio and Dv != D through the window x sink grid so every value meets every other axis.
    i = WINDOWS.index(window) + len(WINDOWS) * SINKS.index(sink)
    hq, hkv = GQA[i % 3]
    dv = [16, 24][i % 2]
    run_and_compare(DOCS, hq, hkv, 16, dv, torch.float32, window, sink, seed=i)


@pytest.mark.parametrize("ratio", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window,sink", [(None, "random"), (3, None), (128, 30.0), (1, -30.0)])
def test_bf16(ratio, window, sink):
    run_and_compare(DOCS, *ratio, 16, 24, torch.bfloat16, window, sink, seed=7)


@pytest.mark.parametrize("window", [None, 5])
def test_many_small_tiles(monkeypatch, window):
    """Tiny tiles: documents and windows cross many tile borders; fully visible tiles skip the mask."""
    monkeypatch.setattr(reference_attention, "BLOCK_Q", 8)
    monkeypatch.setattr(reference_attention, "BLOCK_K", 16)
    monkeypatch.setattr(reference_attention, "SHORT_DOC", 0)  # every document through the tiles
    run_and_compare([1, 40, 3, 70, 1], 4, 2, 8, 12, torch.float32, window, "random", seed=3)


@pytest.mark.parametrize("short_doc,group_scores", [(0, 1 << 22), (1000, 1 << 22), (40, 1), (40, 4 * 37 * 37)])
@pytest.mark.parametrize("window,sink", [(None, "random"), (3, None), (128, 30.0)])
def test_every_split_between_dense_documents_and_tiles(monkeypatch, short_doc, group_scores, window, sink):
    """All tiled (0), all dense (1000), and both in one batch with dense groups of one document each (a budget
    of 1 score) or of several of one padded length."""
    monkeypatch.setattr(reference_attention, "SHORT_DOC", short_doc)
    monkeypatch.setattr(reference_attention, "SHORT_GROUP_SCORES", group_scores)
    run_and_compare(DOCS, 4, 2, 16, 24, torch.float32, window, sink, seed=8)


def test_short_documents_take_the_dense_path(monkeypatch):
    """A batch of short documents (an RL batch of short answers) builds no tile; a long one only tiles."""
    tiled = []
    real = reference_attention._forward
    monkeypatch.setattr(reference_attention, "_forward", lambda q, *a: tiled.append(q.shape[0]) or real(q, *a))
    q, k, v, sinks, cu, _ = make_inputs([20] * 30 + [300], 4, 2, 8, 8, torch.float32, "random", 9)
    varlen_attention(q, k, v, cu, sinks=sinks, backend="cpu")
    assert tiled == [300]  # the 30 short documents went dense
    groups, lens = reference_attention._short_groups(cu.tolist(), 4)
    assert [len(g) for g in groups] == [30] and lens == [20]


def _layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x [T, H, E] in the layouts the dense path reads rows of without a copy, and one it copies ("gapped")."""
    t, h, e = x.shape
    wide = torch.zeros(t, h, 2 * e)
    wide[..., :e] = x
    rows = torch.zeros(t * h + 3, e)[3:]  # a storage offset
    rows.copy_(x.reshape(t * h, e))
    return {
        "contiguous": x.contiguous(),
        "head-major": x.transpose(0, 1).contiguous().transpose(0, 1),  # transformers' [H, T, E] transposed
        "sliced": wide[..., :e],  # DeepSeek's v: the first Dv columns of each [H, 2 Dv] row
        "offset": rows.view(t, h, e),
        "strided": torch.stack([x, x], dim=-1)[..., 0],  # elements two apart: still a row view
        "gapped": torch.stack([x, x], dim=1)[:, 0],  # token rows not H rows apart: neither, copied
    }


@pytest.mark.parametrize("layout", ["contiguous", "head-major", "sliced", "offset", "strided", "gapped"])
def test_dense_path_reads_every_layout(layout):
    """The dense path gathers rows straight from q, k, v and dO as laid out (no copy where a row view exists);
    every layout gives the contiguous inputs' output and gradients bit for bit."""
    lengths = [8, 13, 1, 9, 12, 3]
    q, k, v, sinks, cu, d_out = make_inputs(lengths, 4, 2, 8, 6, torch.float32, "random", 21)
    results = {}
    for name in ("contiguous", layout):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        s_leaf = sinks.clone().requires_grad_(True)
        ins = [_layouts(x)[name] for x in leaves]
        out = varlen_attention(*ins, cu, window=3, sinks=s_leaf, backend="cpu")
        out.backward(_layouts(d_out)[name])
        results[name] = [out, *(x.grad for x in leaves), s_leaf.grad]
    assert all(torch.equal(a, b) for a, b in zip(results["contiguous"], results[layout]))
    x = _layouts(q)[layout]
    view, _ = reference_attention._row_view(x)
    assert (view.data_ptr() == x.data_ptr()) == (layout != "gapped")


@pytest.mark.parametrize("window", [1, 2, 3])
def test_dense_padding_rows_that_see_no_key(window):
    """A window shorter than a group's padding leaves a padding row of a short document with no causal key; its
    LSE' must not poison the gradients of the real rows (no sink to fall back on)."""
    run_and_compare([1, 2, 9, 12], 2, 1, 8, 8, torch.float32, window, None, seed=22)


def test_dense_plan_is_built_once_per_batch(monkeypatch):
    """Every layer's forward and backward of one batch shares one plan; another batch or another split builds
    its own."""
    built = []
    real = reference_attention._ShortPlan.__init__

    def spy(self, cu, *a):
        built.append(tuple(cu))
        real(self, cu, *a)

    monkeypatch.setattr(reference_attention._ShortPlan, "__init__", spy)
    monkeypatch.setattr(reference_attention, "_PLANS", {})
    q, k, v, sinks, cu, d_out = make_inputs([20] * 6, 4, 2, 8, 8, torch.float32, "random", 23)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    for _ in range(3):  # three layers
        varlen_attention(*leaves, cu, sinks=sinks, backend="cpu").backward(d_out)
    assert built == [tuple(cu.tolist())]
    varlen_attention(q[:40], k[:40], v[:40], cu[:3], sinks=sinks, backend="cpu")
    monkeypatch.setattr(reference_attention, "SHORT_DOC", 10)  # a new split of the same batch
    varlen_attention(q, k, v, cu, sinks=sinks, backend="cpu")
    assert len(built) == 3
    for i in range(2 * reference_attention._PLANS_KEPT):  # the cache stays bounded
        varlen_attention(q[:i + 1], k[:i + 1], v[:i + 1], cu.new_tensor([0, i + 1]), backend="cpu")
    assert len(reference_attention._PLANS) == reference_attention._PLANS_KEPT


def test_zero_length_document_and_single_token():
    run_and_compare([0, 1, 0, 4], 2, 1, 8, 8, torch.float32, None, "random", seed=4)
    run_and_compare([1], 2, 2, 8, 8, torch.float32, 2, None, seed=5)


def test_tile_memory_is_bounded(monkeypatch):
    """The forward never builds a score tile larger than BLOCK_Q x BLOCK_K per head."""
    seen = []
    real_bmm = torch.bmm

    def spy(a, b, *args, **kwargs):
        out = real_bmm(a, b, *args, **kwargs)
        seen.append(out.shape[-2] * out.shape[-1])
        return out

    monkeypatch.setattr(reference_attention.torch, "bmm", spy)
    t, hq = 2048, 2
    q, k, v = (torch.randn(t, hq, 8) for _ in range(3))
    cu = torch.tensor([0, t], dtype=torch.int32)
    varlen_attention(q, k, v, cu, backend="cpu")
    bq, bk = reference_attention.BLOCK_Q, reference_attention.BLOCK_K
    assert seen and max(seen) <= bq * bk < t * t


def test_decode_matches_varlen_on_last_rows():
    """decode_attention over a cache = the last rows of varlen_attention on the same document."""
    q, k, v, sinks, _, _ = make_inputs([50], 4, 2, 16, 24, torch.float32, "random", 11)
    cu = torch.tensor([0, 50], dtype=torch.int32)
    full = varlen_attention(q, k, v, cu, window=7, sinks=sinks, backend="cpu")
    for sq in (1, 5, 50):
        dec = decode_attention(q[None, -sq:], k[None], v[None], window=7, sinks=sinks)
        err, bar, ok = check_close("attention.forward", dec[0], full[-sq:], torch.float32)
        assert ok, (sq, err, bar)


def test_decode_left_padding():
    """Left-padded rows equal the unpadded row; fully padded query rows return zeros."""
    q, k, v, sinks, _, _ = make_inputs([12], 4, 2, 16, 16, torch.float32, "random", 12)
    pad = 3
    qp = torch.cat([torch.randn(pad, 4, 16), q])[None]
    kp = torch.cat([torch.randn(pad, 2, 16), k])[None]
    vp = torch.cat([torch.randn(pad, 2, 16), v])[None]
    mask = torch.tensor([[False] * pad + [True] * 12])
    out = decode_attention(qp, kp, vp, key_padding_mask=mask, sinks=sinks)
    ref = decode_attention(q[None], k[None], v[None], sinks=sinks)
    assert torch.allclose(out[0, pad:], ref[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(out[0, :pad], torch.zeros_like(out[0, :pad]))
    out_nosink = decode_attention(qp, kp, vp, key_padding_mask=mask)
    assert torch.isfinite(out_nosink).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=0), "window"),
        (dict(sinks=torch.zeros(3)), "sinks"),
        (dict(cu=torch.tensor([0, 5], dtype=torch.int32)), "end at T"),
        (dict(cu=torch.tensor([0.0, 6.0])), "integer"),
        (dict(k=torch.randn(6, 3, 8), v=torch.randn(6, 3, 8)), "multiple"),
        (dict(k=torch.randn(6, 2, 4)), "head dims"),
        (dict(v=torch.randn(6, 2, 8).double()), "dtype"),
    ],
)
def test_validation_errors(kwargs, match):
    args = dict(q=torch.randn(6, 4, 8), k=torch.randn(6, 2, 8), v=torch.randn(6, 2, 8))
    args["cu"] = torch.tensor([0, 2, 6], dtype=torch.int32)
    extra = {n: kwargs.pop(n) for n in list(kwargs) if n in args}
    args.update(extra)
    with pytest.raises(ValueError, match=match):
        varlen_attention(args["q"], args["k"], args["v"], args["cu"], backend="cpu", **kwargs)
