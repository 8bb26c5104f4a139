"""polyrl's calls bind to the REAL op signatures of three op-plugin branches, not only to the emulator's.

The schema lines of ``npu_fusion_attention`` / ``npu_fusion_attention_grad`` (and of the MoE experts' ``npu_grouped_matmul`` /
``npu_grouped_matmul_add_``) are kept as test data
(data/op_plugin_signatures.txt, with their branch and commit). For each branch the ascend backend runs on an
emulated release of that branch (both sink routes, with and without a window) while every call it makes is
recorded; each recorded call must then bind to that branch's schema: positional arguments in order, keywords
that exist there, keyword-only arguments passed by keyword. A keyword a release does not have (``sink`` before
7.3.0, ``softmax_layout`` before 7.2.0) fails the binding.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from frozen_sources import sections

from polyrl.backends.ascend.attention import SINK_ENV
from polyrl.core.attention import varlen_attention
from polyrl.emulation.npu import emulated_ascend_backend, install_emulator

DATA = Path(__file__).parent / "data" / "op_plugin_signatures.txt"
# The emulated release that stands for each branch: (torch_npu version, CANN).
BRANCH_RELEASES = {"7.2.0": ("2.8.0", "8.3.RC1"), "7.3.0": ("2.8.0.post2", "8.5.0"), "master": ("2.9.0", "8.5.1")}


def _signature(args: str) -> inspect.Signature:
    """A Python signature from a schema line's argument list ("Tensor x, *, int group_type=-1")."""
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for arg in (a.strip() for a in args.split(", ")):
        if arg == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        decl, _, default = arg.partition("=")
        params.append(inspect.Parameter(decl.split()[-1], kind, default=default if default else inspect.Parameter.empty))
    return inspect.Signature(params)


def _schemas() -> dict[str, dict[str, inspect.Signature]]:
    """branch -> op name -> a Python signature built from the schema line."""
    return {branch: {m.group(1): _signature(m.group(2)) for m in (re.match(r"^(\w+)\((.*)\) ->", line) for line in lines)}
            for branch, lines in sections(DATA).items()}


SCHEMAS = _schemas()


def test_the_data_holds_three_branches_and_the_known_differences():
    assert set(SCHEMAS) == {"7.2.0", "7.3.0", "master"}
    assert all({"npu_grouped_matmul", "npu_grouped_matmul_add_"} <= set(ops) for ops in SCHEMAS.values())
    assert "sink" not in SCHEMAS["7.2.0"]["npu_fusion_attention"].parameters
    assert "softmax_layout" in SCHEMAS["7.2.0"]["npu_fusion_attention_grad"].parameters
    assert "sink" in SCHEMAS["7.3.0"]["npu_fusion_attention_grad"].parameters


def _record_calls(emulator, calls):
    """Wrap the emulated ops so every (args, kwargs) polyrl passes is kept."""
    for op in ("npu_fusion_attention", "npu_fusion_attention_grad"):
        inner = getattr(emulator.module, op)

        def wrapper(*args, _op=op, _inner=inner, **kwargs):
            calls.append((_op, args, kwargs))
            return _inner(*args, **kwargs)

        setattr(emulator.module, op, wrapper)


# 7.2.0 has no sink=, so only the lse route exists there (detection picks it).
@pytest.mark.parametrize(("branch", "mode"), [("7.2.0", "lse"), ("7.3.0", "native"), ("7.3.0", "lse"),
                                              ("master", "native"), ("master", "lse")])
def test_polyrl_calls_bind_to_the_branch_signatures(monkeypatch, branch, mode):
    version, cann = BRANCH_RELEASES[branch]
    monkeypatch.setenv(SINK_ENV, mode)
    calls: list = []
    with install_emulator(version, cann_version=cann) as emulator:
        _record_calls(emulator, calls)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(9, h, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
        sinks = torch.randn(4, generator=gen).requires_grad_()
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        for window in (None, 3):
            varlen_attention(q, k, v, cu, window=window, sinks=sinks, backend=emulated_ascend_backend()).sum().backward()
            varlen_attention(q, k, v, cu, window=window, backend=emulated_ascend_backend()).sum().backward()
    ops = {op for op, _, _ in calls}
    assert "npu_fusion_attention" in ops and ("npu_fusion_attention_grad" in ops) is (mode == "lse")
    for op, args, kwargs in calls:
        SCHEMAS[branch][op].bind(*args, **kwargs)  # TypeError if polyrl passes what the branch does not take


@pytest.mark.parametrize("branch", ["7.2.0", "7.3.0", "master"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_experts_calls_bind_to_the_branch_signatures(branch, dtype):
    """The MoE experts kernel's forward and backward (npu_grouped_matmul, npu_grouped_matmul_add_) against each
    branch's schema lines."""
    from polyrl.backends.ascend.experts import GroupedMatmul

    version, cann = BRANCH_RELEASES[branch]
    calls: list = []
    with install_emulator(version, cann_version=cann) as emulator:
        for op in ("npu_grouped_matmul", "npu_grouped_matmul_add_"):
            inner = getattr(emulator.module, op)
            setattr(emulator.module, op, lambda *a, _op=op, _inner=inner, **k: calls.append((_op, a, k)) or _inner(*a, **k))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(6, 4, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(3, 4, 5, generator=gen).to(dtype).requires_grad_()
        GroupedMatmul.apply(x, w, torch.tensor([2, 0, 4])).sum().backward()
    assert {op for op, _, _ in calls} == {"npu_grouped_matmul"} | ({"npu_grouped_matmul_add_"} if dtype != torch.float32
                                                                    else set())
    for op, args, kwargs in calls:
        SCHEMAS[branch][op].bind(*args, **kwargs)


def test_binding_would_catch_a_keyword_the_branch_lacks():
    with pytest.raises(TypeError):
        SCHEMAS["7.2.0"]["npu_fusion_attention"].bind(1, 2, 3, 4, "TND", sink=None)
    with pytest.raises(TypeError):  # keyword-only after input_layout in the grad op
        SCHEMAS["master"]["npu_fusion_attention_grad"].bind(1, 2, 3, 4, 5, "TND", None)
