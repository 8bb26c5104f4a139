"""The ``decode_attention`` kernel slot (0.3, additive): declared like the other slots, its default the core reference
with the public op's contract, run by ``Backend.decode_attention``, and listed by ``polyrl backends`` (native for
cuda, reference for cpu and ascend)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from polyrl.backends.ascend import AscendBackend
from polyrl.backends.cpu import CpuBackend
from polyrl.backends.cuda import CudaBackend
from polyrl.cli import main as polyrl_main
from polyrl.core import plugins
from polyrl.core.attention import decode_attention
from polyrl.core.attention.reference import reference_decode_attention
from polyrl.core.plugins.kernels import KERNEL_SLOTS, resolve_kernel
from polyrl.plugins import KERNELS, REFERENCE_KERNELS, Backend


def test_the_slot_is_declared_with_the_reference_as_default():
    # added in 0.3 after the four older slots; later slots go after it (the order stays a prefix)
    assert KERNELS[:5] == ("varlen_attention", "logprobs", "linear_logprobs", "experts", "decode_attention")
    assert KERNEL_SLOTS["decode_attention"] == "decode_attention_kernel"
    assert REFERENCE_KERNELS["decode_attention"] == "polyrl.core.attention.reference:reference_decode_attention"
    assert Backend.decode_attention_kernel == REFERENCE_KERNELS["decode_attention"]
    assert resolve_kernel(Backend.decode_attention_kernel) is reference_decode_attention
    # the reference has the public op's contract: the same parameters, less the dispatch keyword
    op = dict(inspect.signature(decode_attention).parameters)
    del op["backend"]
    assert list(op) == list(inspect.signature(reference_decode_attention).parameters)
    assert all(op[n].default == p.default and op[n].kind == p.kind
               for n, p in inspect.signature(reference_decode_attention).parameters.items())


def test_backend_decode_attention_runs_the_slot_and_the_op_dispatches_to_it():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 2, 4, 8, generator=gen), torch.randn(2, 9, 2, 8, generator=gen), torch.randn(2, 9, 2, 6,
                                                                                                       generator=gen)
    mask = torch.arange(9)[None, :] >= torch.tensor([0, 3])[:, None]
    sinks = torch.randn(4, generator=gen)
    want = reference_decode_attention(q, k, v, key_padding_mask=mask, scale=0.3, window=4, sinks=sinks)
    backend = CpuBackend()
    assert torch.equal(backend.decode_attention(q, k, v, key_padding_mask=mask, scale=0.3, window=4, sinks=sinks), want)
    seen = []

    class Spy(CpuBackend):
        name = "spy"
        is_reference = False

        def decode_attention(self, q, k_cache, v_cache, **kwargs):
            seen.append(kwargs)
            return super().decode_attention(q, k_cache, v_cache, **kwargs)

    got = decode_attention(q, k, v, key_padding_mask=mask, window=4, sinks=sinks, backend=Spy())
    # the op validated and filled in the default scale (D ** -0.5) before the backend saw the call
    assert seen == [dict(key_padding_mask=mask, scale=8**-0.5, window=4, sinks=sinks)]
    assert torch.equal(got, reference_decode_attention(q, k, v, key_padding_mask=mask, window=4, sinks=sinks))
    assert Spy().provided_kernels() == frozenset({"decode_attention"})  # overriding the method provides it
    with pytest.raises(ValueError, match="q_len <= k_len"):
        decode_attention(torch.randn(2, 10, 4, 8), k, v, backend=Spy())  # 10 queries, 9 cache slots
    assert len(seen) == 1  # a refused call never reaches the backend


def test_backends_list_the_slot(capsys):
    assert "decode_attention" in CudaBackend().provided_kernels()
    assert "decode_attention" in AscendBackend().introspection.kernels_fallback()
    assert CpuBackend().describe()["kernels"]["decode_attention"] == REFERENCE_KERNELS["decode_attention"]
    plugins.reset_active_backend()
    assert polyrl_main(["backends", "--json"]) == 0
    by_name = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    assert by_name["cuda"]["kernels"]["decode_attention"] == "polyrl.backends.cuda.decode:triton_decode_attention"
    assert "decode_attention" in by_name["cuda"]["native_kernels"]
    assert "decode_attention" in by_name["ascend"]["kernels_fallback"]
    assert set(by_name["cuda"]["kernel_choices"]["decode_attention"]) >= {"override"}
    assert polyrl_main(["backends"]) == 0
    text = capsys.readouterr().out
    assert "decode_attention: native (polyrl.backends.cuda.decode:triton_decode_attention)" in text
    reference_line = "decode_attention: reference (polyrl.core.attention.reference:reference_decode_attention)"
    assert text.count(reference_line) >= 2  # cpu and ascend
