"""The fused lm_head + log-prob + entropy reference equals autograd through the full logits (values and the
gradients of hidden, weight and bias), for every chunking, temperature, ragged T and masked tokens."""

from __future__ import annotations

import pytest
import torch

from polyrl.core import algorithms as A
from polyrl.core.algorithms.linear_logprobs import linear_logprobs_and_entropy, vocab_chunk_for
from polyrl.core.tolerances import relative_error, tolerance


def _full(hidden, weight, bias, labels, tau):
    """Through the whole [N, V] logits in fp64: the definition."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    logs = torch.log_softmax(z / tau, -1)
    return logs.gather(-1, labels[..., None])[..., 0], -(logs.exp() * logs).sum(-1)


def _case(seed, lead, H, V, dtype=torch.float32, with_bias=False, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*lead, H, generator=g) * scale).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype) if with_bias else None
    labels = torch.randint(0, V, lead, generator=g)
    w_lp, w_ent = torch.randn(lead, generator=g), torch.randn(lead, generator=g)
    return hidden, weight, bias, labels, w_lp, w_ent


def _grads(fn, hidden, weight, bias, labels, w_lp, w_ent, tau, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    h, w = leaves[0], leaves[1]
    b = leaves[2] if bias is not None else None
    lp, ent = fn(h, w, b, labels, tau, **kw)
    loss = (lp * w_lp.to(lp.dtype)).sum() + (ent * w_ent.to(ent.dtype)).sum()
    loss.backward()
    return lp.detach(), ent.detach(), [t.grad for t in leaves]


def _fused(h, w, b, labels, tau, **kw):
    return linear_logprobs_and_entropy(h, w, labels, bias=b, temperature=tau, **kw)


def _check(got, exp, name, dtype):
    err, bar = relative_error(got, exp), tolerance(name, dtype)
    assert err <= bar, f"{name} {dtype}: relative error {err:.3g} > bar {bar:.3g}"


@pytest.mark.parametrize(
    "lead,H,V,chunk,vchunk,tau,with_bias",
    [
        ((13,), 8, 37, 4, 10, 1.0, False),  # ragged T, V not divisible by the vocab chunk
        ((2, 9), 16, 50, 5, 7, 0.7, True),  # batch dims, bias, temperature
        ((17,), 12, 29, 1024, None, 1.3, False),  # one tile (automatic vocab chunk)
        ((5,), 6, 11, 2, 1, 0.5, True),  # one vocab column per tile: the online lse at its extreme
    ],
)
def test_fused_equals_full_logits_fp32(lead, H, V, chunk, vchunk, tau, with_bias) -> None:
    hidden, weight, bias, labels, w_lp, w_ent = _case(0, lead, H, V, with_bias=with_bias)
    lp, ent, grads = _grads(_fused, hidden, weight, bias, labels, w_lp, w_ent, tau, chunk_size=chunk,
                            vocab_chunk_size=vchunk)
    lp_ref, ent_ref, grads_ref = _grads(_full, hidden, weight, bias, labels, w_lp.double(), w_ent.double(), tau)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == labels.shape
    _check(lp, lp_ref, "algorithms.linear_logprobs", "float32")
    _check(ent, ent_ref, "algorithms.linear_logprobs", "float32")
    for g, g_ref in zip(grads, grads_ref):
        _check(g, g_ref, "algorithms.linear_logprobs_grad", "float32")


def test_fused_gradients_fp64_gradcheck() -> None:
    """fp64 inputs: torch's numerical gradcheck of both outputs (entropy's gradient included)."""
    hidden, weight, bias, labels, _, _ = _case(1, (5,), 3, 7, dtype=torch.float64, with_bias=True)
    args = [t.clone().requires_grad_() for t in (hidden, weight, bias)]

    def fn(h, w, b):
        return linear_logprobs_and_entropy(h, w, labels, bias=b, temperature=0.8, chunk_size=3, vocab_chunk_size=4)

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7)


def test_single_outputs_and_masked_tokens() -> None:
    """Only log-probs, only entropy, and a loss that masks tokens (zero upstream gradient) give autograd's
    gradients; masked rows get exactly zero hidden gradient."""
    hidden, weight, _, labels, w_lp, w_ent = _case(2, (11,), 8, 23)
    mask = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.float32)
    for use_lp, use_ent in ((True, False), (False, True), (True, True)):
        a, b = w_lp * mask * use_lp, w_ent * mask * use_ent
        _, _, grads = _grads(_fused, hidden, weight, None, labels, a, b, 0.9, chunk_size=3, vocab_chunk_size=5)
        _, _, ref = _grads(_full, hidden, weight, None, labels, a.double(), b.double(), 0.9)
        for g, g_ref in zip(grads, ref):
            _check(g, g_ref, "algorithms.linear_logprobs_grad", "float32")
        assert torch.all(grads[0][mask == 0] == 0)
    # compute_entropy=False: the same log-probs, entropy zeros without a gradient path
    h = hidden.clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(h, weight, labels, compute_entropy=False, chunk_size=4)
    lp_ref, _ = _full(hidden, weight, None, labels, 1.0)
    _check(lp, lp_ref, "algorithms.linear_logprobs", "float32")
    assert torch.all(ent == 0) and not ent.requires_grad


def test_equals_unfused_chunked_logprobs_bitwise_close() -> None:
    """The same numbers as the trainer's unfused path (lm_head then A.logprobs_and_entropy) up to fp32
    rounding: the fused op replaces it without moving a recipe's metrics."""
    hidden, weight, _, labels, w_lp, w_ent = _case(3, (40,), 16, 61)
    lp, ent, grads = _grads(_fused, hidden, weight, None, labels, w_lp, w_ent, 0.7, chunk_size=16)

    def unfused(h, w, b, lab, tau):
        return A.logprobs_and_entropy(h @ w.t(), lab, chunk_size=16, temperature=tau)

    lp_u, ent_u, grads_u = _grads(unfused, hidden, weight, None, labels, w_lp, w_ent, 0.7)
    assert (lp - lp_u).abs().max() < 1e-5 and (ent - ent_u).abs().max() < 1e-5
    for g, g_u in zip(grads, grads_u):
        assert relative_error(g, g_u) < 1e-5


def test_bf16_inputs_match_bf16_logits_path() -> None:
    """bf16 hidden/weight: fp32 statistics of the bf16 product (what lm_head(h) gives), gradients in bf16."""
    hidden, weight, _, labels, w_lp, w_ent = _case(4, (33,), 32, 70, dtype=torch.bfloat16)
    lp, ent, grads = _grads(_fused, hidden, weight, None, labels, w_lp, w_ent, 1.0, chunk_size=8,
                            vocab_chunk_size=16)
    assert grads[0].dtype == grads[1].dtype == torch.bfloat16
    lp_ref, ent_ref, ref = _grads(_full, hidden, weight, None, labels, w_lp.double(), w_ent.double(), 1.0)
    _check(lp, lp_ref, "algorithms.linear_logprobs", "bfloat16")
    _check(ent, ent_ref, "algorithms.linear_logprobs", "bfloat16")
    for g, g_ref in zip(grads, ref):
        _check(g.float(), g_ref, "algorithms.linear_logprobs_grad", "bfloat16")


def test_bad_inputs_refused_and_vocab_chunk_rule() -> None:
    h, w, lab = torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="do not match"):
        linear_logprobs_and_entropy(h, torch.zeros(5, 3), lab)
    with pytest.raises(ValueError, match="labels"):
        linear_logprobs_and_entropy(h, w, lab[:2])
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs_and_entropy(h, w, lab, temperature=0)
    assert vocab_chunk_for(1024, 201088, None) == 8192 and vocab_chunk_for(2**16, 201088, None) == 1024
    assert vocab_chunk_for(1024, 100, None) == 100 and vocab_chunk_for(8, 100, 7) == 7


def test_bench_runs_at_toy_size_on_cpu(tmp_path) -> None:
    """bench/logprob_linear.py --quick --device cpu runs every method available here and they agree on Σ logp."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).parents[2] / "bench" / "logprob_linear.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(bench), "--quick", "--device", "cpu", "--out", str(out)], check=True,
                   env=env, capture_output=True, text=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    ran = [r for r in rows if "nll" in r]
    assert {r["method"] for r in ran} >= {"polyrl reference (chunked)", "transformers-style (full logits)"}
    for T in {r["T"] for r in ran}:
        nll = [r["nll"] for r in ran if r["T"] == T]
        assert max(nll) - min(nll) <= 1e-5 * abs(nll[0]), nll
