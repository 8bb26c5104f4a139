"""MoE experts on the ascend backend: ``npu_grouped_matmul`` with a written backward, selected through the backend
like attention, against the cpu reference (transformers' grouped_mm path) — on the CPU emulator, not an NPU.

The emulated NPU has no ``torch._grouped_mm`` (op-plugin does not register it), so a backend that left its
experts to transformers' default would fail here as on hardware."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.attention.hf import bind_backend
from polyrl.core.models import build_model
from polyrl.core.plugins import get_registry
from polyrl.core.tolerances import check_close
from polyrl.emulation import npu_moe
from polyrl.emulation.npu import emulated_ascend_backend, install_emulator

PRESETS = ("gpt_oss_tiny", "deepseek_v3_tiny")


def _forward_backward(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(input_ids=ids).logits
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "experts" in n and p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", PRESETS)
def test_the_ascend_experts_kernel_matches_the_reference(npu, preset, dtype) -> None:
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(0))
    model = build_model(preset, vocab_size=32, seed=0, backend=get_registry().backends["cpu"], dtype=dtype)
    assert model.config._experts_implementation == "polyrl"
    ref_logits, ref_grads = _forward_backward(model, ids)
    assert ref_grads  # the experts' weights (and GPT-OSS's biases) get gradients
    bind_backend(model, emulated_ascend_backend())  # the same weights, now on the emulated NPU
    logits, grads = _forward_backward(model, ids)
    err, bar, ok = check_close("experts.forward", logits, ref_logits, dtype)
    assert ok, (err, bar)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        err, bar, ok = check_close("experts.grad", grads[name], ref_grads[name], dtype)
        assert ok, (name, err, bar)


def test_the_emulated_npu_refuses_grouped_mm_for_the_ascend_kernels(npu, monkeypatch) -> None:
    """What a backend that kept transformers' default experts path would meet: refused on the emulated NPU; the
    cpu reference beside it (same process, parity) keeps torch's grouped matmul."""
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(1))
    model = build_model("gpt_oss_tiny", vocab_size=32, seed=0, backend=get_registry().backends["cpu"])
    model(input_ids=ids)  # the reference runs torch's grouped_mm, untouched
    wrong = emulated_ascend_backend()
    monkeypatch.setattr(type(wrong), "experts_kernel", "polyrl.core.models.experts:reference_experts")
    bind_backend(model, wrong)
    with pytest.raises(NotImplementedError, match=r"Could not run 'aten::_grouped_mm' with arguments from the "
                                                  r"'PrivateUse1' backend"):
        model(input_ids=ids)


def test_npu_grouped_matmul_as_documented(npu) -> None:
    gmm = npu.module.npu_grouped_matmul
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 5, generator=gen), torch.randn(3, 5, 4, generator=gen)
    counts = torch.tensor([2, 0, 5])
    y = gmm([x], [w], group_list=counts, split_item=3, group_type=0, group_list_type=1)[0]
    assert torch.allclose(y, torch.cat([x[:2] @ w[0], x[2:] @ w[2]]))
    cum = gmm([x], [w], group_list=counts.cumsum(0), split_item=2, group_type=0, group_list_type=0)[0]
    assert torch.equal(cum, y)
    dy = torch.randn(7, 4, generator=gen)
    # the weight gradient an earlier polyrl took from it: not a case the documentation lists for Atlas A2/A3
    with pytest.raises(RuntimeError, match=r"group_type=2 .* not a documented case.*npu_grouped_matmul_add_"):
        gmm([x.t()], [dy], group_list=counts, split_item=3, group_type=2, group_list_type=1)
    for bad, match in (
        (dict(x=[x.t().contiguous().t()], group_type=0), "does not support a transposed x"),
        (dict(group_list=torch.tensor([2, 0, 4])), "sum to M=7"),
        (dict(group_list=[2, 0, 5]), "not emulated"),
        (dict(weight=[w.double()]), "not a supported non-quantized pair"),
        (dict(bias=[torch.zeros(3, 4)]), "not emulated"),
    ):
        kwargs = dict(x=[x], weight=[w], group_list=counts, split_item=3, group_type=0, group_list_type=1) | bad
        with pytest.raises((RuntimeError, NotImplementedError), match=match):
            gmm(kwargs.pop("x"), kwargs.pop("weight"), **kwargs)
    leaf = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="no autograd formula"):
        gmm([leaf], [w], group_list=counts, split_item=3, group_type=0, group_list_type=1)[0].sum().backward()


def test_npu_grouped_matmul_add_as_documented(npu) -> None:
    """y[e] += x_e^T @ w_e, groups along the reduced axis (cumulative ends), fp16/bf16 in, fp32 y in place."""
    add = npu.module.npu_grouped_matmul_add_
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(7, 5, generator=gen).bfloat16(), torch.randn(7, 4, generator=gen).bfloat16()
    ends = torch.tensor([2, 2, 7])  # expert 1 has no rows
    y = torch.ones(3 * 5, 4)
    assert add(y, x, dy, ends, transpose_x=True, transpose_weight=False, group_type=2) is y
    want = torch.stack([x[:2].float().t() @ dy[:2].float(), torch.zeros(5, 4), x[2:].float().t() @ dy[2:].float()])
    assert torch.allclose(y.view(3, 5, 4), want + 1)
    for args, kwargs, match in (
        ((y, x, dy, ends), dict(group_type=0), "group_type only supports 2"),
        ((y, x.float(), dy.float(), ends), {}, "float16 or bfloat16"),
        ((y.bfloat16(), x, dy, ends), {}, "float32"),
        ((y, x, dy, torch.tensor([2, 0, 5])), {}, "non-decreasing and end at K=7"),
        ((y, x, dy, ends), dict(transpose_x=False), "emulated with transpose_x=True"),
        ((y, x, dy, ends), dict(group_list_type=1), "unexpected keyword argument 'group_list_type'"),  # 7.x schema
        ((torch.ones(3, 5, 4), x, dy, ends), {}, r"\[groups \* M, N\]"),
    ):
        with pytest.raises((RuntimeError, NotImplementedError, TypeError), match=match):
            add(*args, **kwargs)


def test_the_experts_weight_gradient_uses_the_documented_op(npu, monkeypatch) -> None:
    """bf16 experts: the weight gradient through npu_grouped_matmul_add_ (never npu_grouped_matmul group_type=2);
    fp32 experts: no NPU op takes fp32 there, one matmul per expert."""
    from polyrl.backends.ascend.experts import GroupedMatmul

    calls = []
    real_add, real_gmm = npu.module.npu_grouped_matmul_add_, npu.module.npu_grouped_matmul
    monkeypatch.setattr(npu.module, "npu_grouped_matmul_add_", lambda *a, **k: calls.append("add") or real_add(*a, **k))
    monkeypatch.setattr(npu.module, "npu_grouped_matmul",
                        lambda *a, **k: calls.append(f"gmm{k['group_type']}") or real_gmm(*a, **k))
    gen = torch.Generator().manual_seed(4)
    counts = torch.tensor([3, 0, 2])
    for dtype, want in ((torch.bfloat16, ["gmm0", "gmm0", "add"]), (torch.float32, ["gmm0", "gmm0"])):
        calls.clear()
        x = torch.randn(5, 6, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(3, 6, 4, generator=gen).to(dtype).requires_grad_()
        dy = torch.randn(5, 4, generator=gen).to(dtype)
        GroupedMatmul.apply(x, w, counts).backward(dy)
        assert calls == want, (dtype, calls)
        ref = torch.stack([x[:3].float().t() @ dy[:3].float(), torch.zeros(6, 4), x[3:].float().t() @ dy[3:].float()])
        assert torch.allclose(w.grad.float(), ref.to(dtype).float(), rtol=1e-2, atol=1e-2)
        assert not w.grad[1].any()


def test_the_refusal_leaves_with_the_emulator() -> None:
    original = torch.nn.functional.grouped_mm
    with install_emulator():
        assert hasattr(torch.nn.functional.grouped_mm, "__polyrl_emulator_refusal__")
    assert torch.nn.functional.grouped_mm is original
    assert npu_moe.refuse_grouped_mm  # the module's own API
