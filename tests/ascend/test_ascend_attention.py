"""AscendBackend.varlen_attention through the torch_npu emulator, in both sink routes, against polyrl's CPU
reference: forward and dq/dk/dv/dsink. Proven on the emulator of the documented API, not on an NPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from polyrl.backends.ascend import attention as npu_attention
from polyrl.backends.ascend.attention import SINK_ENV
from polyrl.core.attention import varlen_attention
from polyrl.core.tolerances import check_close
from polyrl.emulation.npu import emulated_ascend_backend, install_emulator

DOC_LENS = (1, 7, 140, 1, 2)  # ragged, two documents of one token, one longer than the 128-key window
HKV, D = 2, 16


def make_case(groups, sinks, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, hq = sum(DOC_LENS), HKV * groups
    cu = torch.tensor([0, *itertools.accumulate(DOC_LENS)], dtype=torch.int32)
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (hq, HKV, HKV))
    # "+-30": half the heads +30 (the sink takes almost all the mass), half -30 (it takes none).
    s = {"none": None, "randn": torch.randn(hq, generator=gen),
         "+-30": torch.tensor([30.0, -30.0]).repeat_interleave(hq // 2) if hq > 1 else torch.tensor([30.0])}[sinks]
    d_out = torch.randn(t, hq, D, generator=gen)
    return (q, k, v), cu, s, d_out


def run(backend, inputs, cu, sinks, d_out, window, dtype=torch.float32):
    leaves = [x.detach().to(dtype).clone().requires_grad_() for x in inputs]
    s = None if sinks is None else sinks.detach().clone().requires_grad_()
    out = varlen_attention(*leaves, cu, window=window, sinks=s, backend=backend)
    out.backward(d_out.to(dtype))
    return [out] + [x.grad for x in leaves] + ([s.grad] if s is not None else [])


def compare(got, expected, dtype, names=("out", "dq", "dk", "dv", "dsink")):
    """(name, err, bar, ok) per tensor. dq/dk are exactly 0 for a window of 1 without sink: then the
    error is measured against the magnitude of dv, the scale of the terms that cancel."""
    floor = expected[3].double().norm().item()
    rows = []
    for name, a, e in zip(names, got, expected):
        f = floor if name in ("dq", "dk") and e.double().norm().item() < 1e-3 * floor else 0.0
        err, bar, ok = check_close("attention.forward" if name == "out" else "attention.grad", a, e, dtype, floor=f)
        rows.append((name, err, bar, ok))
    return rows


@pytest.fixture(params=["native", "lse"])
def route(request, monkeypatch):
    monkeypatch.setenv(SINK_ENV, request.param)
    with install_emulator() as emulator:
        yield request.param, emulator


@pytest.mark.parametrize("window", [None, 1, 3, 128])
@pytest.mark.parametrize("sinks", ["none", "randn", "+-30"])
@pytest.mark.parametrize("groups", [1, 2, 8])
def test_fp32_forward_and_gradients_match_the_reference(route, window, sinks, groups):
    mode, emulator = route
    inputs, cu, s, d_out = make_case(groups, sinks)
    expected = run("cpu", inputs, cu, s, d_out, window)
    got = run(emulated_ascend_backend(), inputs, cu, s, d_out, window)
    rows = compare(got, expected, torch.float32)
    assert all(ok for *_, ok in rows), rows
    # The route really taken: native passes sink= to the op; lse runs the op's grad kernel itself.
    fwd = [c for c in emulator.calls if c["op"] == "npu_fusion_attention"]
    assert fwd[-1]["sink"] is (s is not None and mode == "native")
    grad_calls = [c for c in emulator.calls if c["op"] == "npu_fusion_attention_grad"]
    assert bool(grad_calls) is (s is not None and mode == "lse")  # elsewhere autograd runs the op's backward
    assert fwd[-1]["scale"] == D**-0.5 and fwd[-1]["head_num"] == HKV * groups
    assert fwd[-1]["actual_seq_qlen"] == list(itertools.accumulate(DOC_LENS)) == fwd[-1]["actual_seq_kvlen"]
    if window is None:
        assert fwd[-1]["sparse_mode"] == 3
    else:
        assert (fwd[-1]["sparse_mode"], fwd[-1]["pre_tockens"], fwd[-1]["next_tockens"]) == (4, window - 1, 0)
    assert fwd[-1]["atten_mask"] == (2048, 2048)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 128])
def test_half_precision_matches_the_fp32_reference(route, dtype, window):
    inputs, cu, s, d_out = make_case(8, "randn", seed=1)
    expected = run("cpu", inputs, cu, s, d_out, window)
    got = run(emulated_ascend_backend(), inputs, cu, s, d_out, window, dtype=dtype)
    assert got[0].dtype == dtype and got[4].dtype == torch.float32
    rows = compare(got, expected, dtype)
    assert all(ok for *_, ok in rows), rows


def test_bf16_sink_parameter_gets_a_bf16_gradient(route):
    inputs, cu, s, d_out = make_case(2, "randn")
    got = run(emulated_ascend_backend(), inputs, cu, s.bfloat16(), d_out, 3)
    assert got[4].dtype == torch.bfloat16
    expected = run("cpu", inputs, cu, s.bfloat16(), d_out, 3)
    assert check_close("attention.grad", got[4], expected[4], torch.bfloat16)[2]


def test_window_is_w_minus_one_pre_tockens():
    kw = npu_attention.mask_kwargs(128, torch.device("cpu"))
    assert (kw["sparse_mode"], kw["pre_tockens"], kw["next_tockens"]) == (4, 127, 0)
    assert npu_attention.mask_kwargs(None, torch.device("cpu"))["sparse_mode"] == 3
    assert tuple(kw["atten_mask"].shape) == (2048, 2048) and kw["atten_mask"].dtype == torch.bool


@pytest.mark.parametrize("window", [3, 128])
def test_the_129_key_mistake_would_be_caught(route, monkeypatch, window):
    """pre_tockens = W (what two Ascend ports pass for GPT-OSS) lets each query see W + 1 keys."""
    right = npu_attention.mask_kwargs

    def off_by_one(w, device):
        kw = right(w, device)
        if w is not None:
            kw["pre_tockens"] = w
        return kw

    inputs, cu, s, d_out = make_case(2, "randn")
    expected = run("cpu", inputs, cu, s, d_out, window)
    assert all(ok for *_, ok in compare(run(emulated_ascend_backend(), inputs, cu, s, d_out, window), expected,
                                        torch.float32))
    monkeypatch.setattr(npu_attention, "mask_kwargs", off_by_one)
    rows = compare(run(emulated_ascend_backend(), inputs, cu, s, d_out, window), expected, torch.float32)
    assert not rows[0][3], rows  # the forward alone already fails
    assert rows[0][1] > 10 * rows[0][2], rows


def test_empty_documents_and_empty_batch(route):
    inputs, _, s, d_out = make_case(2, "randn")
    cu = torch.tensor([0, 0, 1, 8, 8, 148, 149, 151, 151], dtype=torch.int32)  # zero-length documents inside
    expected = run("cpu", inputs, cu, s, d_out, 3)
    got = run(emulated_ascend_backend(), inputs, cu, s, d_out, 3)
    assert all(ok for *_, ok in compare(got, expected, torch.float32))
    empty = varlen_attention(*(x[:0] for x in inputs), torch.zeros(2, dtype=torch.int32), sinks=s,
                             backend=emulated_ascend_backend())
    assert empty.shape == (0, 4, D)
