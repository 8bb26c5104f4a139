"""polyrl.backends.cuda.precompile on a GPU (part of ``bash bench/gpu_check.sh``): the launches it records compile
to the keys the real calls look up, so that a layout's forward and backward, at another token count and through
transformers' packed views, compile nothing more after it."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _count_compiles():
    import triton

    seen: list[str] = []

    def hook(**kwargs):  # Triton calls it with keywords only, after each compile (in the compiling thread)
        seen.append((kwargs["fn"].name, threading.current_thread().name))

    old = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    return seen, lambda: setattr(triton.knobs.runtime, "jit_post_compile_hook", old)


# Layouts no other test of the suite runs (head counts 6 / 3, head dim 80, windows 48 / none): their kernels are not
# in the process's in-memory caches before this test, so a miss would compile.
LAYOUTS = [(6, 3, 80, 80, 48, True), (6, 3, 80, 80, None, True)]


def test_gpu_precompiled_layouts_compile_nothing_at_their_real_calls(monkeypatch):
    from polyrl.backends.cuda.attention import triton_varlen_attention
    from polyrl.backends.cuda.precompile import precompile
    from polyrl.core.attention.layouts import AttentionLayout

    monkeypatch.setenv("POLYRL_CUDA_ATTENTION", "triton")
    device = torch.device("cuda", torch.cuda.current_device())
    layouts = [AttentionLayout(*row) for row in LAYOUTS]
    seen, restore = _count_compiles()
    try:
        wait = precompile(layouts, [torch.bfloat16], device)
        assert wait is not None
        line = wait()
        assert "failed" not in line, line
        names = {name for name, _ in seen}
        assert {"attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel", "bwd_preprocess_kernel"} <= names, seen
        # every compile on the pool: none made by the recording (a launch it did not catch compiles where it runs)
        assert all(thread.startswith("polyrl-precompile") for _, thread in seen), seen
        assert len(seen) >= 2 * 3 + 1, (line, seen)  # forward, dQ, dK/dV per layout, the preprocess kernel once
        seen.clear()
        for hq, hkv, d, dv, window, _ in LAYOUTS:
            b, s = 1, 333  # another token count than the recording's; transformers' [B, H, S, D] transposed
            q = torch.randn(b, hq, s, d, device=device, dtype=torch.bfloat16).transpose(1, 2).reshape(b * s, hq, d)
            k = torch.randn(b, hkv, s, d, device=device, dtype=torch.bfloat16).transpose(1, 2).reshape(b * s, hkv, d)
            v = torch.randn(b, hkv, s, dv, device=device, dtype=torch.bfloat16).transpose(1, 2).reshape(b * s, hkv, dv)
            q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
            sinks = torch.zeros(hq, device=device, dtype=torch.bfloat16, requires_grad=True)
            cu = torch.tensor([0, 100, s], device=device, dtype=torch.int32)
            out = triton_varlen_attention(q, k, v, cu, scale=d ** -0.5, window=window, sinks=sinks)
            out.float().square().sum().backward()
        torch.cuda.synchronize()
    finally:
        restore()
    assert seen == [], f"compiled again at the real calls: {seen} (precompiled: {line})"
    assert torch.isfinite(q.grad).all() and torch.isfinite(sinks.grad).all()
