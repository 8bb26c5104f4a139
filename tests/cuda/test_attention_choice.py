"""The cuda backend's attention choice, on CPU: FlashAttention-4 or the Triton kernel per call.

(a) the rule (polyrl.backends.cuda.attention_choice.decide / choose) for every case, the capability and FA4 import
    checks monkeypatched; (b) the dispatcher (cuda_varlen_attention) through a stand-in ``flash_attn.cute`` whose
    ``flash_attn_varlen_func`` takes keywords only, checks what it receives and computes polyrl's reference in FA4's
    terms, so that a wrong window, a positional call, a scaled or non-fp32 sink, a wrong max_seqlen or a
    non-deterministic default fails here; (c) ``polyrl backends`` reporting the choice per layout.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from polyrl.backends.cuda import attention_choice as ac
from polyrl.core.attention.reference import reference_varlen_attention
from polyrl.core.errors import BadInputError

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H200, B200, A100 = (9, 0), (10, 0), (8, 0)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(ac.ENV, raising=False)
    monkeypatch.delenv("POLYRL_FA4_DETERMINISTIC", raising=False)
    ac.clear_caches()
    yield
    ac.clear_caches()


def decide(layout="causal", dtype=BF16, d=64, dv=64, *, setting="auto", capability=H200, fa4="", sinks=True):
    return ac.decide(setting, layout, dtype, d, dv, has_sinks=sinks, capability=capability, fa4_problem=lambda: fa4)


# --- (a) the rule ---------------------------------------------------------------------------------------------
def test_causal_bf16_on_hopper_and_blackwell_with_fa4_runs_fa4_and_says_why():
    for capability in (H200, B200):
        choice = decide(capability=capability)
        assert choice.kernel == "fa4"
        # 7.542 / 4.273 ms fwd+bwd on the H200, 4x4096 (MEASURED)
        assert choice.reason == "measured 1.77x faster fwd+bwd than triton on NVIDIA H200, 4x4096"


def test_window_layers_keep_triton_where_it_measured_as_fast():
    choice = decide("window")
    assert choice.kernel == "triton"
    assert choice.reason == "measured 1.03x faster fwd+bwd than fa4 on NVIDIA H200, 4x4096 window 128"


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"dtype": FP32}, "FA4 takes bfloat16 / float16 inputs, not float32"),
    ({"dtype": FP16}, "FA4 not measured in float16 (only bfloat16)"),
    ({"d": 192, "dv": 128}, "FA4 not measured at head dims 192 / 128 (causal layers)"),  # DeepSeek MLA
    ({"d": 128, "dv": 128}, "FA4 not measured at head dims 128 / 128 (causal layers)"),
    ({"d": 320, "dv": 320}, "FA4 on compute capability 9.x takes 8..256, not head dims 320 / 320"),
    ({"d": 60, "dv": 60}, "FA4 needs head dims that are multiples of 8, got 60 / 60"),
    ({"fa4": "flash_attn.cute not installed; pip install 'polyrl[fa4]'"},
     "flash_attn.cute not installed; pip install 'polyrl[fa4]'"),
    ({"capability": A100}, "the FA4 path runs on compute capability 9.x / 10.x, not 8.0"),
    ({"capability": (12, 0)}, "the FA4 path runs on compute capability 9.x / 10.x, not 12.0"),
    ({"capability": None}, "the tensors are not on a CUDA device"),
    ({"capability": B200, "d": 256, "dv": 256}, "FA4's 256 / 256 backward takes no sink on compute capability 10.x"),
    ({"capability": B200, "d": 160, "dv": 160},
     "FA4 on compute capability 10.x takes 8..128, 192 / 128 or 256 / 256, not head dims 160 / 160"),
])
def test_auto_keeps_triton_with_the_reason(kwargs, reason):
    choice = decide(**kwargs)
    assert (choice.kernel, choice.reason) == ("triton", reason)


def test_the_fa4_import_is_asked_only_when_fa4_would_run():
    def must_not_ask() -> str:
        raise AssertionError("FA4 import checked for a call that keeps the Triton kernel")

    for layout, dtype, d, dv in [("window", BF16, 64, 64), ("causal", FP32, 64, 64), ("causal", BF16, 192, 128)]:
        assert ac.decide("auto", layout, dtype, d, dv, has_sinks=True, capability=H200,
                         fa4_problem=must_not_ask).kernel == "triton"
    assert ac.decide("triton", "causal", BF16, 64, 64, has_sinks=True, capability=H200,
                     fa4_problem=must_not_ask).kernel == "triton"


@pytest.mark.parametrize(("setting", "causal", "window"), [
    ("auto", "fa4", "triton"), ("", "fa4", "triton"), ("triton", "triton", "triton"), ("fa4", "fa4", "fa4"),
    (" FA4 ", "fa4", "fa4"), ("causal=triton,window=fa4", "triton", "fa4"), ("window=fa4", "fa4", "fa4"),
    ("causal=triton", "triton", "triton"), ("causal = auto , window = triton", "fa4", "triton"),
])
def test_the_environment_overrides_per_layout(setting, causal, window):
    assert decide("causal", setting=setting).kernel == causal
    assert decide("window", setting=setting).kernel == window


def test_a_forced_kernel_says_so():
    assert decide(setting="triton").reason == "POLYRL_CUDA_ATTENTION=triton"
    assert decide("window", setting="fa4").reason == "POLYRL_CUDA_ATTENTION=fa4"
    # forced fa4 takes what FA4 itself takes, measured or not (MLA dims on 9.x, fp16)
    assert decide(d=192, dv=128, setting="fa4").kernel == "fa4"
    assert decide(dtype=FP16, setting="causal=fa4").kernel == "fa4"


@pytest.mark.parametrize("setting", ["flash", "fa5", "causal=fa5", "causal:fa4", "layout=fa4",
                                     "causal=fa4,causal=triton", "causal=fa4,", "triton,fa4"])
def test_a_bad_setting_is_refused_on_one_line_naming_the_variable_and_the_values(setting):
    with pytest.raises(BadInputError) as info:
        decide(setting=setting)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"POLYRL_CUDA_ATTENTION={setting!r}")
    assert "auto, triton, fa4" in message and "causal=<impl>,window=<impl>" in message


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"fa4": "flash_attn.cute not installed; pip install 'polyrl[fa4]'"}, "flash_attn.cute not installed"),
    ({"dtype": FP32}, "not float32"),
    ({"capability": A100}, "not 8.0"),
    ({"capability": B200, "d": 256, "dv": 256}, "takes no sink"),
])
def test_forced_fa4_where_it_cannot_run_fails_with_the_reason_not_silently(kwargs, why):
    for setting in ("fa4", "causal=fa4"):
        with pytest.raises(BadInputError) as info:
            decide(setting=setting, **kwargs)
        message = str(info.value)
        assert "\n" not in message and why in message
        assert message.startswith(f"POLYRL_CUDA_ATTENTION={setting} forces FlashAttention-4 for causal layers")


def test_choose_reads_the_environment_and_the_device_and_remembers(fa4, monkeypatch):
    calls = []
    monkeypatch.setattr(ac, "device_capability", lambda device: calls.append(device) or H200)
    q, v = torch.zeros(4, 8, 64, dtype=BF16), torch.zeros(4, 2, 64, dtype=BF16)
    sinks = torch.zeros(8)
    assert ac.choose(q, v, None, sinks).kernel == "fa4"
    assert ac.choose(q, v, None, sinks).kernel == "fa4"
    assert len(calls) == 1  # the second call is remembered
    assert ac.choose(q, v, 128, sinks).kernel == "triton"
    monkeypatch.setenv(ac.ENV, "triton")
    assert ac.choose(q, v, None, sinks).kernel == "triton"
    monkeypatch.setenv(ac.ENV, "nonsense")
    with pytest.raises(BadInputError, match="POLYRL_CUDA_ATTENTION"):
        ac.choose(q, v, None, sinks)


def test_the_capability_is_read_once_per_device(monkeypatch):
    reads = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: reads.append(index) or (9, 0))
    for _ in range(3):
        assert ac.device_capability(torch.device("cuda", 1)) == (9, 0)
    assert ac.device_capability(torch.device("cuda", 0)) == (9, 0)
    assert reads == [1, 0]
    assert ac.device_capability(torch.device("cpu")) is None


def test_the_fa4_import_is_lazy_cached_and_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import of flash_attn.cute halted: not installed
    fn, why = ac._fa4_import()
    assert fn is None and why == "flash_attn.cute not installed; pip install 'polyrl[fa4]'"
    with pytest.raises(BadInputError, match=r"FlashAttention-4 is not usable: flash_attn\.cute not installed"):
        ac.fa4_function()
    ac.clear_caches()
    monkeypatch.delitem(sys.modules, "flash_attn.cute")
    attempts = []

    def broken(name, *args, **kwargs):
        attempts.append(name)
        raise RuntimeError("no usable CUDA toolkit flavour\nsecond line")

    monkeypatch.setattr(ac.importlib, "import_module", broken)
    assert ac._fa4_import() == (None, "flash_attn.cute does not import (RuntimeError: no usable CUDA toolkit flavour)")
    ac._fa4_import()
    assert attempts == ["flash_attn.cute"]  # cached: tried once


def test_importing_the_rule_and_the_backend_imports_no_fa4_and_touches_no_gpu():
    import subprocess

    probe = ("import sys, torch, polyrl.backends.cuda as c, polyrl.backends.cuda.attention_choice as a\n"
             "c.CudaBackend().describe(); a.layout_report()\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flash_attn', 'triton')),"
             " torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] False"


def test_the_installed_check_looks_on_disk_without_importing(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.delitem(sys.modules, "flash_attn.cute", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    import importlib
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:  # this machine has none: the check says so
        assert ac.fa4_installed_problem() == "flash_attn.cute not installed; pip install 'polyrl[fa4]'"
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)  # a namespace package, as the flash-attn-4 wheel ships
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    importlib.invalidate_caches()
    assert ac.fa4_installed_problem() == ""
    assert "flash_attn" not in sys.modules and "flash_attn.cute" not in sys.modules


# --- (b) the dispatcher through a stand-in FA4 ----------------------------------------------------------------
# flash-attn-4 4.0.0b36's flash_attn_varlen_func keyword parameters (the stand-in refuses others).
FA4_PARAMETERS = frozenset({
    "q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "min_seqlen_k",
    "seqused_q", "seqused_k", "gather_kv_indices", "page_table", "softmax_scale", "causal", "window_size",
    "learnable_sink", "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod", "score_mod_bwd", "mask_mod",
    "block_sparse_tensors", "aux_tensors", "aux_scalars", "return_lse", "scheduler_metadata", "seqlen_k_per_split",
    "disable_scheduler_metadata", "gather_bwd_recompute_p", "gather_bwd_token_chunk",
})


class StandInFA4:
    """``flash_attn_varlen_func`` in FA4's terms, computed by polyrl's reference: window_size (left, 0) means the
    left + 1 most recent keys, the sink is taken as FA4 takes it (unscaled), positional arguments are refused."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, *args, **kw):
        if args:
            raise TypeError(f"stand-in FA4: {len(args)} positional argument(s); the 4th positional is qv")
        unknown = set(kw) - FA4_PARAMETERS
        assert not unknown, f"not flash_attn_varlen_func parameters: {unknown}"
        q, k, v, cu = kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"]
        assert kw.get("qv") is None
        assert q.dtype in (BF16, FP16), "FA4 refuses fp32"
        assert kw["cu_seqlens_k"] is cu and cu.dtype == torch.int32 and cu.is_contiguous()
        longest = max(b - a for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]))
        assert kw["max_seqlen_q"] == kw["max_seqlen_k"] == longest, (kw["max_seqlen_q"], longest)
        assert isinstance(kw["max_seqlen_q"], int)
        assert kw.get("causal") is True
        left, right = kw.get("window_size", (None, None))
        assert right in (0, None) and (left is None) == (right is None)
        sink = kw.get("learnable_sink")
        if sink is not None:
            assert sink.dtype == torch.float32 and sink.shape == (q.shape[1],)
        self.calls.append({"deterministic": kw.get("deterministic", False), "window_size": (left, right)})
        out = reference_varlen_attention(q, k, v, cu, scale=kw["softmax_scale"],
                                         window=None if left is None else left + 1, sinks=sink)
        return out, torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)


@pytest.fixture
def fa4(monkeypatch):
    """The stand-in installed as ``flash_attn.cute``, on a GPU of compute capability 9.0 (tensors stay on CPU)."""
    stand_in = StandInFA4()
    package = types.ModuleType("flash_attn")
    package.__path__ = []
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = stand_in
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(ac, "device_capability", lambda device: H200)
    ac.clear_caches()
    return stand_in


def _case(lengths, hq, hkv, d, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=gen).to(BF16)
    k = torch.randn(t, hkv, d, generator=gen).to(BF16)
    v = torch.randn(t, hkv, dv, generator=gen).to(BF16)
    sinks = torch.randn(hq, generator=gen) * 2
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    d_out = torch.randn(t, hq, dv, generator=gen).to(BF16)
    return q, k, v, sinks, cu, d_out


def _run(fn, q, k, v, sinks, cu, d_out, window, scale):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    out = fn(*leaves[:3], cu, scale=scale, window=window, sinks=leaves[3])
    out.backward(d_out)
    return out.detach(), [x.grad for x in leaves]


def _dispatch():
    from polyrl.backends.cuda.attention import cuda_varlen_attention

    return cuda_varlen_attention


# (lengths, Hq, Hkv, D, Dv, window, setting): auto sends the causal GPT-OSS-like layer to FA4; the window and the
# MLA dims go there only when forced (the stand-in then checks how the window is translated).
CASES = [
    ([5, 1, 17, 9], 8, 2, 64, 64, None, "auto"),
    ([40], 8, 1, 64, 64, None, "auto"),
    ([5, 1, 17, 9], 8, 2, 64, 64, 3, "fa4"),
    ([12, 20], 4, 4, 64, 64, 1, "window=fa4"),
    ([7, 13], 4, 2, 192, 128, None, "fa4"),
]


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d", "dv", "window", "setting"), CASES)
def test_the_fa4_path_equals_the_reference_forward_and_backward(fa4, monkeypatch, lengths, hq, hkv, d, dv, window,
                                                                setting):
    monkeypatch.setenv(ac.ENV, setting)
    q, k, v, sinks, cu, d_out = _case(lengths, hq, hkv, d, dv, seed=len(lengths) + d)
    scale = d**-0.5
    out, grads = _run(_dispatch(), q, k, v, sinks, cu, d_out, window, scale)
    assert len(fa4.calls) == 1, "the dispatcher did not run FA4"
    assert fa4.calls[0]["window_size"] == ((window - 1, 0) if window else (None, None))
    assert out.dtype == BF16 and out.shape == (sum(lengths), hq, dv)
    want_out, want_grads = _run(reference_varlen_attention, q, k, v, sinks, cu, d_out, window, scale)
    assert torch.equal(out, want_out)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_fa4_runs_deterministic_unless_turned_off(fa4, monkeypatch):
    q, k, v, sinks, cu, _ = _case([9, 4], 4, 2, 64, 64)
    _dispatch()(q, k, v, cu, scale=0.125, window=None, sinks=sinks)
    monkeypatch.setenv("POLYRL_FA4_DETERMINISTIC", "0")
    _dispatch()(q, k, v, cu, scale=0.125, window=None, sinks=sinks)
    assert [c["deterministic"] for c in fa4.calls] == [True, False]
    monkeypatch.setenv("POLYRL_FA4_DETERMINISTIC", "yes")
    with pytest.raises(BadInputError, match="POLYRL_FA4_DETERMINISTIC='yes'"):
        _dispatch()(q, k, v, cu, scale=0.125, window=None, sinks=sinks)


def test_no_sinks_pass_none(fa4):
    q, k, v, _, cu, _ = _case([9, 4], 4, 2, 64, 64)
    out = _dispatch()(q, k, v, cu, scale=0.125, window=None, sinks=None)
    assert torch.equal(out, reference_varlen_attention(q, k, v, cu, scale=0.125, window=None, sinks=None))


def test_sinks_reach_fa4_in_fp32_and_their_gradient_keeps_their_dtype(fa4):
    q, k, v, sinks, cu, d_out = _case([9, 4], 4, 2, 64, 64)
    leaf = sinks.to(BF16).requires_grad_()
    _dispatch()(q, k, v, cu, scale=0.125, window=None, sinks=leaf).backward(d_out)  # the stand-in checks fp32
    assert leaf.grad.dtype == BF16 and leaf.grad.shape == (4,)


def test_max_seqlen_is_read_once_per_cu_seqlens_object(fa4, monkeypatch):
    from polyrl.backends.cuda import fa4 as fa4_module

    q, k, v, sinks, cu, _ = _case([5, 30, 2], 4, 2, 64, 64)
    reads = []
    real_diff = torch.diff
    # the reads of this cu_seqlens (the stand-in's reference reads its own copy)
    monkeypatch.setattr(torch, "diff", lambda x, *a, **kw: (x is cu and reads.append(1)) or real_diff(x, *a, **kw))
    for _ in range(4):  # four layers of one forward
        _dispatch()(q, k, v, cu, scale=0.125, window=None, sinks=sinks)
    assert len(reads) == 1 and fa4_module.max_seqlen(cu, q.shape[0]) == 30
    cu[1:] = torch.tensor([10, 36, 37], dtype=torch.int32)  # changed in place: read again
    assert fa4_module.max_seqlen(cu, q.shape[0]) == 26 and len(reads) == 2


def test_the_window_and_fp32_go_to_triton(fa4, monkeypatch):
    from polyrl.backends.cuda import attention

    ran = []
    monkeypatch.setattr(attention, "triton_varlen_attention",
                        lambda q, k, v, cu, **kw: ran.append(kw) or torch.zeros(q.shape[0], q.shape[1], v.shape[2]))
    q, k, v, sinks, cu, _ = _case([9, 4], 4, 2, 64, 64)
    _dispatch()(q, k, v, cu, scale=0.125, window=4, sinks=sinks, options="opts")
    _dispatch()(q.float(), k.float(), v.float(), cu, scale=0.125, window=None, sinks=sinks)
    assert fa4.calls == [] and [r["window"] for r in ran] == [4, None] and ran[0]["options"] == "opts"


def test_the_backend_slot_is_the_dispatcher(fa4):
    from polyrl.backends.cuda import CudaBackend

    backend = CudaBackend()
    assert backend.attention_kernel == "polyrl.backends.cuda.attention:cuda_varlen_attention"
    assert backend.declaration_problems(resolve=True) == []
    q, k, v, sinks, cu, _ = _case([9, 4], 8, 2, 64, 64)
    out = backend.varlen_attention(q, k, v, cu, scale=0.125, window=None, sinks=sinks)
    assert len(fa4.calls) == 1
    assert torch.equal(out, reference_varlen_attention(q, k, v, cu, scale=0.125, window=None, sinks=sinks))


def test_forcing_fa4_where_it_does_not_import_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setattr(ac, "device_capability", lambda device: H200)
    monkeypatch.setenv(ac.ENV, "fa4")
    q, k, v, sinks, cu, _ = _case([9, 4], 4, 2, 64, 64)
    with pytest.raises(BadInputError, match=r"forces FlashAttention-4 for causal layers.*flash_attn\.cute not installed"):
        _dispatch()(q, k, v, cu, scale=0.125, window=None, sinks=sinks)


# --- (c) polyrl backends ----------------------------------------------------------------------------------------
def _backends(capsys, *args) -> str:
    from polyrl.cli import main

    assert main(["backends", *args]) == 0
    return capsys.readouterr().out


def _cuda_choices(capsys) -> dict:
    data = json.loads(_backends(capsys, "--json"))
    cuda = {b["name"]: b for b in data["backends"]}["cuda"]
    assert "kernels" in cuda and "native_kernels" in cuda  # today's keys stay
    return cuda["kernel_choices"]["varlen_attention"]


def test_polyrl_backends_reports_the_choice_per_layout(capsys, monkeypatch):
    monkeypatch.setattr(ac, "fa4_installed_problem", lambda: "")
    choices = _cuda_choices(capsys)
    assert choices["causal"] == ("fa4 (measured 1.77x faster fwd+bwd than triton on NVIDIA H200, 4x4096); "
                                 "triton on GPUs other than compute capability 9.x / 10.x")
    assert choices["window"] == "triton (measured 1.03x faster fwd+bwd than fa4 on NVIDIA H200, 4x4096 window 128)"
    assert "192 / 128" in choices["other"] and "now: auto" in choices["other"]
    monkeypatch.setenv(ac.ENV, "causal=fa4")
    assert _cuda_choices(capsys)["causal"] == ("fa4 (POLYRL_CUDA_ATTENTION=causal=fa4); an error on GPUs other than "
                                               "compute capability 9.x / 10.x")
    monkeypatch.delenv(ac.ENV)
    text = _backends(capsys)
    assert "varlen_attention: native (polyrl.backends.cuda.attention:cuda_varlen_attention)" in text
    assert "  causal: fa4 (measured 1.77x faster fwd+bwd than triton" in text
    assert "  window: triton (measured 1.03x faster" in text


def test_polyrl_backends_says_why_fa4_does_not_run(capsys, monkeypatch):
    monkeypatch.setattr(ac, "fa4_installed_problem", lambda: "flash_attn.cute not installed; pip install 'polyrl[fa4]'")
    assert _cuda_choices(capsys)["causal"] == "triton (flash_attn.cute not installed; pip install 'polyrl[fa4]')"
    monkeypatch.setenv(ac.ENV, "triton")
    choices = _cuda_choices(capsys)
    assert choices["causal"] == choices["window"] == "triton (POLYRL_CUDA_ATTENTION=triton)"
    monkeypatch.setenv(ac.ENV, "fa4")
    assert "cannot run this call: flash_attn.cute not installed" in _cuda_choices(capsys)["causal"]
    monkeypatch.setenv(ac.ENV, "causal=nope")
    assert _cuda_choices(capsys)["causal"].startswith("error (POLYRL_CUDA_ATTENTION='causal=nope': expected")


def test_a_plugins_kernel_choices_that_raises_is_a_warning_not_a_crash():
    from polyrl.backends.cpu import CpuBackend

    class Broken(CpuBackend):
        def kernel_choices(self):
            raise RuntimeError("boom")

    described = Broken().describe()
    assert described["kernel_choices"] == {}
    assert "kernel_choices() raised RuntimeError: boom" in described["warnings"]
    assert CpuBackend().describe()["kernel_choices"] == {}
