"""polyrl's calls bind to the REAL op signatures of three op-plugin branches, not only to the emulator's.

The schema lines of ``npu_fusion_attention`` / ``npu_fusion_attention_grad`` are kept as test data
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

from polyrl.backends.ascend.attention import SINK_ENV
from polyrl.core.attention import varlen_attention
from polyrl.emulation.npu import emulated_ascend_backend, install_emulator

DATA = Path(__file__).parent / "data" / "op_plugin_signatures.txt"
# The emulated release that stands for each branch: (torch_npu version, CANN).
BRANCH_RELEASES = {"7.2.0": ("2.8.0", "8.3.RC1"), "7.3.0": ("2.8.0.post2", "8.5.0"), "master": ("2.9.0", "8.5.1")}


def _schemas() -> dict[str, dict[str, inspect.Signature]]:
    """branch -> op name -> a Python signature built from the schema line."""
    out: dict[str, dict[str, inspect.Signature]] = {}
    branch = None
    for line in DATA.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^\[(\S+)\] [0-9a-f]{40}$", line)
        if m:
            branch = m.group(1)
            out[branch] = {}
            continue
        name, args = re.match(r"^(\w+)\((.*)\) ->", line).groups()
        params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
        for arg in (a.strip() for a in args.split(", ")):
            if arg == "*":
                kind = inspect.Parameter.KEYWORD_ONLY
                continue
            decl, _, default = arg.partition("=")
            pname = decl.split()[-1]
            params.append(inspect.Parameter(pname, kind, default=default if default else inspect.Parameter.empty))
        out[branch][name] = inspect.Signature(params)
    return out


SCHEMAS = _schemas()


def test_the_data_holds_three_branches_and_the_known_differences():
    assert set(SCHEMAS) == {"7.2.0", "7.3.0", "master"}
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


def test_binding_would_catch_a_keyword_the_branch_lacks():
    with pytest.raises(TypeError):
        SCHEMAS["7.2.0"]["npu_fusion_attention"].bind(1, 2, 3, 4, "TND", sink=None)
    with pytest.raises(TypeError):  # keyword-only after input_layout in the grad op
        SCHEMAS["master"]["npu_fusion_attention_grad"].bind(1, 2, 3, 4, 5, "TND", None)
