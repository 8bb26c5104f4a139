"""The torch_npu emulator against an independent fp64 dense formula (what the documentation says the op
computes), and its strictness: wrong masks, unsupported arguments and the sink keyword of old releases."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch

from polyrl.emulation.npu import COMPRESSED_MASK_SIZE, install_emulator

MASK = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool).triu(1)
# Unequal query / key lengths per sequence, so top-left (2) and bottom-right (3, 4) alignments differ.
Q_LENS, KV_LENS = (3, 5, 1, 6), (6, 5, 4, 9)


def cumulative(lens):
    return list(itertools.accumulate(lens))


def oracle(q, k, v, q_lens, kv_lens, *, scale, keep, sink):
    """fp64: per sequence, K/V repeated per head, the sink as an extra logit column, dropped after.
    keep(i, j, sq, skv) -> bool tensor. Returns (out [T, N, Dv], lse [T, N] with the sink)."""
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    qs = ks = 0
    for sq, skv in zip(q_lens, kv_lens):
        qd = q[qs:qs + sq].double()
        kd = k[ks:ks + skv].double().repeat_interleave(g, dim=1)
        vd = v[ks:ks + skv].double().repeat_interleave(g, dim=1)
        logits = torch.einsum("ihd,jhd->hij", qd, kd) * scale
        allowed = keep(torch.arange(sq)[:, None], torch.arange(skv)[None, :], sq, skv)
        logits = logits.masked_fill(~allowed, float("-inf"))
        if sink is not None:
            logits = torch.cat([logits, sink.double().view(-1, 1, 1).expand(-1, sq, 1)], dim=-1)
        lse = torch.logsumexp(logits, dim=-1)  # (N, sq)
        probs = torch.exp(logits - lse[..., None])
        if sink is not None:
            probs = probs[..., :-1]
        outs.append(torch.einsum("hij,jhd->ihd", probs, vd))
        lses.append(lse.T)
        qs, ks = qs + sq, ks + skv
    return torch.cat(outs), torch.cat(lses)


MODES = {  # name -> (op kwargs, the documented keep rule)
    "no_mask": ({"atten_mask": None, "sparse_mode": 3, "pre_tockens": 0, "next_tockens": 0},
                lambda i, j, sq, skv: torch.ones(sq, skv, dtype=torch.bool)),
    "sparse2": ({"atten_mask": MASK, "sparse_mode": 2}, lambda i, j, sq, skv: j <= i),
    "sparse3": ({"atten_mask": MASK, "sparse_mode": 3}, lambda i, j, sq, skv: j - i <= skv - sq),
    "sparse4": ({"atten_mask": MASK, "sparse_mode": 4, "pre_tockens": 2, "next_tockens": 1},
                lambda i, j, sq, skv: ((j - i - (skv - sq)) >= -2) & ((j - i - (skv - sq)) <= 1)),
}


def make_inputs(n, nkv, d=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(Q_LENS), n, d, generator=gen)
    k = torch.randn(sum(KV_LENS), nkv, d, generator=gen)
    v = torch.randn(sum(KV_LENS), nkv, dv, generator=gen)
    return q, k, v, gen


def call(npu, q, k, v, mode, sink=None, **extra):
    kwargs = dict(MODES[mode][0], scale=0.3, actual_seq_qlen=cumulative(Q_LENS), actual_seq_kvlen=cumulative(KV_LENS))
    if sink is not None:
        kwargs["sink"] = sink
    return npu.module.npu_fusion_attention(q, k, v, q.shape[1], "TND", **kwargs, **extra)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("groups", [1, 4])
def test_forward_and_statistics_match_the_dense_formula(npu, mode, with_sink, groups):
    q, k, v, gen = make_inputs(4, 4 // groups)  # N = 4 query heads over 4 or 1 KV heads
    sink = torch.randn(q.shape[1], generator=gen) * 3 if with_sink else None
    out, smax, ssum, *_ = call(npu, q, k, v, mode, sink=sink, softmax_layout="TND")
    exp_out, exp_lse = oracle(q, k, v, Q_LENS, KV_LENS, scale=0.3, keep=MODES[mode][1], sink=sink)
    assert out.dtype == q.dtype and out.shape == exp_out.shape
    assert rel(out, exp_out) < 1e-6
    assert smax.dtype == ssum.dtype == torch.float32 and smax.shape == (q.shape[0], q.shape[1], 8)
    assert torch.equal(smax, smax[..., :1].expand_as(smax)) and torch.equal(ssum, ssum[..., :1].expand_as(ssum))
    lse = smax[..., 0] + torch.log(ssum[..., 0])  # documented: LSE = max + log(sum)
    assert rel(lse, exp_lse) < 1e-6


def test_the_dense_formula_is_sensitive_to_alignment(npu):
    # Guard against a vacuous oracle: top-left and bottom-right causal differ on these lengths.
    q, k, v, _ = make_inputs(2, 2)
    a = call(npu, q, k, v, "sparse2")[0]
    b = call(npu, q, k, v, "sparse3")[0]
    assert rel(a, b) > 0.1


def test_default_statistics_are_ordered_per_sequence(npu):
    q, k, v, _ = make_inputs(4, 2)
    _, by_tok, _, *_ = call(npu, q, k, v, "sparse3", softmax_layout="TND")
    _, default, _, *_ = call(npu, q, k, v, "sparse3")
    assert default.shape == by_tok.shape
    assert not torch.equal(default, by_tok)
    flat = default.reshape(-1, 8)
    start = 0
    for s in Q_LENS:  # sequence b: one [N, s_b, 8] block beginning at row N * start_b
        block = flat[4 * start:4 * (start + s)].view(4, s, 8)
        assert torch.equal(block, by_tok[start:start + s].transpose(0, 1))
        start += s


def test_autograd_matches_the_dense_formula_and_ignores_statistic_gradients(npu):
    """op-plugin's derivatives.yaml: softmax_max / softmax_sum are differentiable outputs (they require grad, as on
    the device) and the formula reads only the output's gradient: a loss term through them changes nothing."""
    q, k, v, gen = make_inputs(4, 2)
    sink = torch.randn(4, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    out, smax, ssum, *_ = call(npu, *leaves[:3], "sparse4", sink=leaves[3])
    assert smax.requires_grad and ssum.requires_grad and smax.grad_fn is out.grad_fn
    d_out = torch.randn(out.shape, generator=gen)
    ((out * d_out).sum() + 1e3 * smax.sum() + 1e3 * ssum.sum()).backward()
    ref = [x.double().clone().requires_grad_() for x in (q, k, v, sink)]
    exp_out, _ = oracle(*ref[:3], Q_LENS, KV_LENS, scale=0.3, keep=MODES["sparse4"][1], sink=ref[3])
    (exp_out * d_out.double()).sum().backward()
    for got, exp in zip(leaves, ref):
        assert rel(got.grad, exp.grad) < 1e-5


def test_grad_op_recomputes_from_the_given_statistics(npu):
    """Fed the statistics of the softmax WITH a sink column and O' as attention_in, the grad op of a
    sink-free call returns the sink attention's dq/dk/dv: the identity the LSE fallback relies on."""
    q, k, v, gen = make_inputs(4, 1)
    sink = torch.randn(4, generator=gen) + 1.0
    out, smax, ssum, *_ = call(npu, q, k, v, "sparse3")
    with_sink = call(npu, q, k, v, "sparse3", sink=sink)  # its max / sum include the sink column
    # Those statistics are the sink-free ones plus the sink term: sum' e^{max'} = sum e^{max} + e^{s}.
    _, m, row_l, *_ = call(npu, q, k, v, "sparse3", softmax_layout="TND")
    _, m_s, l_s, *_ = call(npu, q, k, v, "sparse3", sink=sink, softmax_layout="TND")
    by_hand = (row_l[..., 0] + torch.exp(sink - m[..., 0])).double() * torch.exp(m[..., 0].double())
    assert rel(l_s[..., 0].double() * torch.exp(m_s[..., 0].double()), by_hand) < 1e-6
    # and O' = O * sigmoid(LSE - s)
    assert rel(with_sink[0], out * torch.sigmoid(m[..., 0] + torch.log(row_l[..., 0]) - sink)[..., None]) < 1e-6
    exp = [x.double().clone().requires_grad_() for x in (q, k, v)]
    exp_out, _ = oracle(*exp, Q_LENS, KV_LENS, scale=0.3, keep=MODES["sparse3"][1], sink=sink)
    d_out = torch.randn(exp_out.shape, generator=gen)
    (exp_out * d_out.double()).sum().backward()
    dq, dk, dv, *_ = npu.module.npu_fusion_attention_grad(
        q, k, v, d_out, 4, "TND", atten_mask=MASK, sparse_mode=3, softmax_max=with_sink[1], softmax_sum=with_sink[2],
        attention_in=with_sink[0], scale_value=0.3, actual_seq_qlen=cumulative(Q_LENS),
        actual_seq_kvlen=cumulative(KV_LENS))
    for got, e in zip((dq, dk, dv), exp):
        assert rel(got, e.grad) < 1e-5
    # The sink-free statistics give the sink-free gradients instead: the statistics are really used.
    dq0 = npu.module.npu_fusion_attention_grad(
        q, k, v, d_out, 4, "TND", atten_mask=MASK, sparse_mode=3, softmax_max=smax, softmax_sum=ssum,
        attention_in=out, scale_value=0.3, actual_seq_qlen=cumulative(Q_LENS), actual_seq_kvlen=cumulative(KV_LENS))[0]
    assert rel(dq0, exp[0].grad) > 1e-2


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"atten_mask": torch.ones(14, 14, dtype=torch.bool).triu(1), "sparse_mode": 3}, RuntimeError),  # [S, S] mask
        ({"atten_mask": MASK.T.contiguous(), "sparse_mode": 4}, RuntimeError),  # not the documented triu mask
        ({"atten_mask": MASK.float(), "sparse_mode": 2}, RuntimeError),  # wrong dtype
        ({"atten_mask": MASK, "sparse_mode": 1}, NotImplementedError),
        ({"keep_prob": 0.9}, NotImplementedError),
        ({"pse": torch.zeros(1)}, NotImplementedError),
        ({"actual_seq_qlen": torch.tensor(cumulative(Q_LENS))}, TypeError),  # must be a host list
        ({"actual_seq_qlen": [3, 8, 9, 14]}, RuntimeError),  # does not end at T
        ({"sink": torch.zeros(4, dtype=torch.bfloat16)}, RuntimeError),  # sinks are fp32
        ({"sink": torch.zeros(3)}, RuntimeError),  # one per query head
    ],
)
def test_refuses_what_the_op_refuses(npu, kwargs, error):
    q, k, v, _ = make_inputs(4, 2)
    base = {"scale": 0.3, "actual_seq_qlen": cumulative(Q_LENS), "actual_seq_kvlen": cumulative(KV_LENS)}
    with pytest.raises(error):
        npu.module.npu_fusion_attention(q, k, v, 4, "TND", **{**base, **kwargs})


def test_head_num_and_layout_are_checked(npu):
    q, k, v, _ = make_inputs(4, 2)
    base = {"scale": 0.3, "actual_seq_qlen": cumulative(Q_LENS), "actual_seq_kvlen": cumulative(KV_LENS)}
    with pytest.raises(RuntimeError, match="head_num"):
        npu.module.npu_fusion_attention(q, k, v, 2, "TND", **base)
    with pytest.raises(NotImplementedError):
        npu.module.npu_fusion_attention(q, k, v, 4, "BSND", **base)


def test_old_release_does_not_know_the_sink_keyword():
    q, k, v, _ = make_inputs(4, 2)
    base = {"scale": 0.3, "actual_seq_qlen": cumulative(Q_LENS), "actual_seq_kvlen": cumulative(KV_LENS)}
    with install_emulator(version="2.8.0", cann_version="8.3.RC1") as old:
        import torch_npu

        assert torch_npu is old.module and torch_npu.__version__ == "2.8.0"
        assert torch_npu.npu.utils.get_cann_version(module="CANN") == "8.3.RC1"
        torch_npu.npu_fusion_attention(q, k, v, 4, "TND", **base)  # fine without sink
        with pytest.raises(TypeError, match="sink"):
            torch_npu.npu_fusion_attention(q, k, v, 4, "TND", sink=torch.zeros(4), **base)
        with pytest.raises(TypeError, match="sink"):
            torch_npu.npu_fusion_attention_grad(
                q, k, v, torch.zeros(q.shape[0], 4, 6), 4, "TND", sink=None, actual_seq_qlen=base["actual_seq_qlen"],
                actual_seq_kvlen=base["actual_seq_kvlen"])


def test_install_and_uninstall_restore_sys_modules(monkeypatch):
    placeholder = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", placeholder)
    with install_emulator(version="2.7.1.post2") as emulator:
        assert sys.modules["torch_npu"] is emulator.module
        assert sys.modules["torch_npu.npu.utils"] is emulator.module.npu.utils
    assert sys.modules["torch_npu"] is placeholder
    assert "torch_npu.npu.utils" not in sys.modules
    handle = install_emulator()
    assert sys.modules["torch_npu"] is handle.module
    handle.uninstall()
    assert sys.modules["torch_npu"] is placeholder
