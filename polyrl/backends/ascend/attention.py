"""varlen_attention on Ascend: ``torch_npu.npu_fusion_attention`` in the packed TND layout.

Design choices (docs/background.md §2, §4):

- Layout TND, one call for the whole packed batch: ``actual_seq_qlen = actual_seq_kvlen = cu_seqlens[1:]``
  as a host list (cumulative ends, no leading 0). GQA is native (``head_num`` = Hq, K/V not repeated).
  ``scale`` is always passed: the op's default is 1.0, not D ** -0.5.
- Causal: ``sparse_mode=3`` (bottom-right causal) with the compressed 2048x2048 mask. Each document has
  as many queries as keys, so bottom-right and top-left alignment coincide; 3 is the mode the TND varlen
  path is documented with.
- Window W (W most recent keys, query included): ``sparse_mode=4`` band with ``pre_tockens = W - 1``,
  ``next_tockens = 0`` — the op keeps key j of query i iff ``-pre <= j - i <= next``, so ``pre = W``
  (what some ports pass for GPT-OSS) would give W + 1 keys. :func:`mask_kwargs` is the one place that
  derives it and tests pin it.
- Sinks, two routes chosen by :func:`sink_mode`:
  * ``native``: the op's own ``sink=`` (fp32 [Hq], unscaled), forward and backward, on torch_npu
    2.6.0.post5 / 2.7.1.post2 / 2.8.0.post2 / 2.9.0+ with CANN >= 8.5.0;
  * ``lse``: older stacks (and Ascend 950). Run the op without sink and correct with its softmax statistics,
    asked for in token order (``softmax_layout="TND"``: TorchNPU 7.2.0 with CANN 8.3.RC1 on) — the only layout
    the documentation states plainly (op-plugin ``docs/context/torch_npu-npu_fusion_attention.md``@7.2.0 l. 131,
    @7.3.0 l. 135: the default is "NTD", which does not say whether heads lead the whole batch or each sequence,
    and a wrong guess would train GPT-OSS on wrong statistics silently). Without it the route is refused:
    ``O' = O * sigmoid(LSE - s)``; the backward is the op's own grad kernel fed the statistics of the
    softmax that includes the sink column (row max ``m' = max(m, s)``, row sum
    ``l' = l e^{m - m'} + e^{s - m'}``, i.e. ``sum + exp(s - max)`` re-based so that a large sink cannot
    overflow) and ``attention_in = O'``; ``ds_h = -sum_i p_sink_i rowsum(dO'_i * O'_i)`` with
    ``p_sink_i = exp(s_h - LSE'_i)``. Exact, not an approximation: it is the flash backward of the
    softmax with the sink column. Proven on polyrl.emulation.npu only — not on an NPU.
  ``POLYRL_ASCEND_SINK=native|lse`` overrides the detection.

``torch_npu`` is imported inside functions only (importing it without CANN breaks ``import torch``).
"""

from __future__ import annotations

import os
import re
import weakref
from typing import Any

import torch
from packaging.version import InvalidVersion, Version

SINK_ENV = "POLYRL_ASCEND_SINK"
SINK_MODES = ("native", "lse")
# torch_npu releases whose npu_fusion_attention(_grad) accept sink=; every release from 2.9.0 on does.
NATIVE_SINK_TORCH_NPU: dict[tuple[int, int], str] = {(2, 6): "2.6.0.post5", (2, 7): "2.7.1.post2", (2, 8): "2.8.0.post2"}
NATIVE_SINK_TORCH_NPU_ALL_FROM = "2.9.0"
NATIVE_SINK_CANN_MIN = (8, 5, 0)
COMPRESSED_MASK_SIZE = 2048
SPARSE_CAUSAL = 3  # rightDownCausal; == leftUpCausal here because every document has Sq == Skv
SPARSE_BAND = 4
# The op's documented limits (op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md, 约束说明):
# actual_seq_qlen holds at most 1K sequences in the varlen (TND) case, T <= 1M, D (and Dv) <= 768, Nq <= 256,
# Nq % Nkv == 0, Dq == Dk >= Dv. Beyond 1024 sequences or 1M tokens the batch is cut into several calls; Dk < Dv
# (never in polyrl's models) is padded; more than 256 query heads are cut into head groups.
MAX_SEQS_PER_CALL = 1024
MAX_TOKENS_PER_CALL = 1 << 20
MAX_HEAD_DIM = 768
MAX_HEADS = 256
SOFTMAX_LAYOUT_CANN_MIN = (8, 3, -1, 1)  # 8.3.RC1
FP32_CANN_MIN = (8, 2, -1, 1)  # 8.2.RC1

_masks: dict[torch.device, torch.Tensor] = {}
_detected: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # torch_npu module -> {chip: (mode, reason)}


# --- sink support detection ------------------------------------------------------------------------
def torch_npu_supports_sink(version: str) -> bool:
    """Does this torch_npu release have ``sink=`` on npu_fusion_attention? (docs/background.md §4)"""
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    if v >= Version(NATIVE_SINK_TORCH_NPU_ALL_FROM):
        return True
    first = NATIVE_SINK_TORCH_NPU.get((v.major, v.minor))
    return first is not None and v >= Version(first)


def parse_cann_version(text: str) -> tuple[int, int, int, int] | None:
    """'8.5.0' -> (8, 5, 0, 0); '8.3.RC1' -> (8, 3, -1, 1) (a release candidate precedes x.y.0);
    anything after a release number ('8.5.0.alpha001') marks a pre-release: (8, 5, 0, -1)."""
    m = re.match(r"^\s*(\d+)\.(\d+)\.(?:(\d+)|RC(\d+))(\S*)", text or "", re.IGNORECASE)
    if m is None:
        return None
    major, minor = int(m.group(1)), int(m.group(2))
    if m.group(4) is not None:
        return major, minor, -1, int(m.group(4))
    return major, minor, int(m.group(3)), -1 if m.group(5) else 0


def cann_supports_sink(version: str | None) -> bool:
    parsed = parse_cann_version(version or "")
    return parsed is not None and parsed >= (*NATIVE_SINK_CANN_MIN, 0)


def _cann_version(torch_npu: Any) -> str | None:
    """CANN's version through torch_npu's documented helper (empty before CANN 8.1.RC1)."""
    for owner in (getattr(getattr(torch_npu, "npu", None), "utils", None), getattr(torch_npu, "utils", None)):
        fn = getattr(owner, "get_cann_version", None)
        if fn is not None:
            try:
                return fn(module="CANN") or None
            except Exception:  # an old helper with another signature: treat the version as unknown
                return None
    return None


def detect_sink_mode(torch_npu: Any) -> tuple[str, str]:
    """("native" | "lse", why) from the installed torch_npu, CANN and chip; unknown versions choose "lse".

    Ascend 950 always takes "lse": op-plugin's forward there passes no sink to the kernel while its backward does
    (polyrl.backends.ascend.chip), so the native route would be silently wrong."""
    from polyrl.backends.ascend.chip import is_ascend_950, soc_name

    chip = soc_name(torch_npu)
    cached = _detected.setdefault(torch_npu, {})
    if chip in cached:
        return cached[chip]
    version = str(getattr(torch_npu, "__version__", ""))
    cann = _cann_version(torch_npu)
    if is_ascend_950(chip):
        result = ("lse", f"{chip}: op-plugin's forward ignores sink= on Ascend 950 (its backward does not)")
    elif not torch_npu_supports_sink(version):
        result = ("lse", f"torch_npu {version or '?'} has no sink= (needs 2.6.0.post5 / 2.7.1.post2 / 2.8.0.post2 / 2.9.0+)")
    elif not cann_supports_sink(cann):
        result = ("lse", f"CANN {cann or 'version unknown'} is older than 8.5.0 (needed for sink=)")
    else:
        result = ("native", f"torch_npu {version} with CANN {cann} supports sink=")
    cached[chip] = result
    return result


def sink_mode(torch_npu: Any) -> str:
    """The sink route: ``POLYRL_ASCEND_SINK`` if set, else :func:`detect_sink_mode`."""
    forced = os.environ.get(SINK_ENV, "").strip().lower()
    if forced:
        if forced not in SINK_MODES:
            raise ValueError(f"{SINK_ENV}={forced!r}: expected one of {', '.join(SINK_MODES)}")
        return forced
    return detect_sink_mode(torch_npu)[0]


# --- what the installed release has ---------------------------------------------------------------
def softmax_layout_supported(torch_npu: Any) -> bool:
    """``softmax_layout="TND"`` (statistics in token order): from TorchNPU 7.2.0 (torch_npu 2.6.0.post3 / 2.7.1 /
    2.8.0, any 2.9.0+; op-plugin ``op_plugin_functions.yaml``@7.2.0) with CANN 8.3.RC1 (the op's page @7.2.0)."""
    from polyrl.backends.ascend.compat import torch_npu_at_least

    version = str(getattr(torch_npu, "__version__", ""))
    parsed = parse_cann_version(_cann_version(torch_npu) or "")
    return torch_npu_at_least(version, "7.2.0") and parsed is not None and parsed >= SOFTMAX_LAYOUT_CANN_MIN


def lse_route_problem(torch_npu: Any) -> str:
    """Why the lse sink route cannot run on this release ("" when it can): it needs token-order statistics."""
    if softmax_layout_supported(torch_npu):
        return ""
    return (f"the lse sink route needs softmax_layout=\"TND\" (TorchNPU 7.2.0: torch_npu 2.6.0.post3 / 2.7.1 / 2.8.0 / "
            f"2.9.0+, with CANN 8.3.RC1+), found torch_npu {getattr(torch_npu, '__version__', '?')} with CANN "
            f"{_cann_version(torch_npu) or 'version unknown'}: upgrade them, or set model.attn_implementation=eager")


def fp32_supported(torch_npu: Any) -> bool:
    """float32 query/key/value: documented from TorchNPU 7.1.0 (CANN 8.2.RC1); CANN 7.0.0's page lists float16
    and bfloat16 only. An unknown CANN (the helper is empty before 8.1.RC1) counts as old."""
    parsed = parse_cann_version(_cann_version(torch_npu) or "")
    return parsed is not None and parsed >= FP32_CANN_MIN


# --- op arguments ----------------------------------------------------------------------------------
def compressed_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 bool mask sparse modes 2/3/4 require (True = masked: strictly above the diagonal)."""
    if device not in _masks:
        size = COMPRESSED_MASK_SIZE
        _masks[device] = torch.ones(size, size, dtype=torch.bool, device=device).triu_(1)
    return _masks[device]


def mask_kwargs(window: int | None, device: torch.device) -> dict[str, Any]:
    """The mask arguments of npu_fusion_attention(_grad) for causal (window=None) or a W-key window."""
    if window is None:
        return {"atten_mask": compressed_mask(device), "sparse_mode": SPARSE_CAUSAL}
    # W keys including the query itself: j in [i - (W - 1), i]. pre_tockens = W would be W + 1 keys.
    return {"atten_mask": compressed_mask(device), "sparse_mode": SPARSE_BAND, "pre_tockens": window - 1,
            "next_tockens": 0}


_last_ends: list[Any] = [None, -1, None]  # cu_seqlens object, its version, its ends


def _seq_ends(cu_seqlens: torch.Tensor) -> list[int]:
    """cu_seqlens [N+1] -> cumulative ends without the leading 0, empty documents dropped (host ints).

    The op wants host lists, and reading a device tensor stalls the host: every layer of a forward receives the
    same ``cu_seqlens`` object (validated on the host once per micro-batch, polyrl.core.trainer.batch), so its
    ends are read once — the object is kept, and its in-place version checked — not once per layer."""
    c, version, ends = _last_ends
    if c is cu_seqlens and version == cu_seqlens._version:
        return ends
    ends = []
    for end in cu_seqlens.tolist()[1:]:
        if not ends or end != ends[-1]:
            ends.append(int(end))
    ends = [e for e in ends if e > 0]
    _last_ends[:] = [cu_seqlens, cu_seqlens._version, ends]
    return ends


def split_calls(ends: list[int], max_seqs: int | None = None, max_tokens: int | None = None
                ) -> list[tuple[int, int, list[int]]]:
    """Cut the packed documents into runs the op accepts: at most ``max_seqs`` sequences and ``max_tokens``
    tokens per call. Returns (token start, token end, ends relative to the start) per call; one call when the
    batch fits (the usual case). A single document longer than ``max_tokens`` cannot be cut (its keys are one
    softmax): ValueError."""
    max_seqs = MAX_SEQS_PER_CALL if max_seqs is None else max_seqs
    max_tokens = MAX_TOKENS_PER_CALL if max_tokens is None else max_tokens
    calls: list[tuple[int, int, list[int]]] = []
    start, run = 0, []
    for end in ends:
        prev = run[-1] + start if run else start
        if end - prev > max_tokens:
            raise ValueError(f"npu_fusion_attention: a document of {end - prev} tokens exceeds the op's limit of "
                             f"{max_tokens} tokens per call (T <= 1M)")
        if run and (len(run) == max_seqs or end - start > max_tokens):
            calls.append((start, prev, run))
            start, run = prev, []
        run.append(end - start)
    if run:
        calls.append((start, start + run[-1], run))
    return calls


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The documented limits no reroute can lift: head dim <= 768 and a GQA group of at most 256 heads."""
    d, dv = q.shape[2], v.shape[2]
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"npu_fusion_attention supports head dims up to {MAX_HEAD_DIM}, got D={d}, Dv={dv}")
    group = q.shape[1] // k.shape[1]
    if group > MAX_HEADS:
        raise ValueError(f"npu_fusion_attention supports at most {MAX_HEADS} query heads per call, and one KV head's "
                         f"group of {group} query heads cannot be split")


# --- softmax statistics: [T, Hq, 8] in token order (softmax_layout="TND") --------------------------------
def _stats_to_tokens(stat: torch.Tensor) -> torch.Tensor:
    """softmax_max/sum [T, Hq, 8] (the value repeated 8 times) -> [T, Hq] fp32."""
    return stat[..., 0].float()


def _stats_from_tokens(x: torch.Tensor) -> torch.Tensor:
    """[T, Hq] fp32 -> [T, Hq, 8] (the inverse of _stats_to_tokens)."""
    t, hq = x.shape
    return x.float()[..., None].expand(t, hq, 8).contiguous()


# --- the sink correction through the softmax statistics -----------------------------------------------
class _LseSinkAttention(torch.autograd.Function):
    """O' = O * sigmoid(LSE - s) forward; npu_fusion_attention_grad on (m', l', O') backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, op_kwargs: dict[str, Any], scale: float):
        import torch_npu

        hq = q.shape[1]
        out, smax, ssum = torch_npu.npu_fusion_attention(q, k, v, hq, "TND", scale=scale, **op_kwargs)[:3]
        m = _stats_to_tokens(smax)  # (T, Hq) row max of the sink-free logits
        row_l = _stats_to_tokens(ssum)  # (T, Hq) sum of exp(logit - m)
        s = sinks.float()[None, :]
        lse = m + torch.log(row_l)
        out_s = (out.float() * torch.sigmoid(lse - s)[..., None]).to(q.dtype)  # O'
        m_s = torch.maximum(m, s)  # statistics of the softmax that has the sink column
        l_s = row_l * torch.exp(m - m_s) + torch.exp(s - m_s)
        lse_s = m_s + torch.log(l_s)  # LSE' = logaddexp(LSE, s)
        ctx.save_for_backward(q, k, v, sinks, out_s, _stats_from_tokens(m_s), _stats_from_tokens(l_s),
                              lse_s)
        ctx.op_kwargs, ctx.scale = op_kwargs, scale
        return out_s

    @staticmethod
    def backward(ctx, d_out):
        import torch_npu

        q, k, v, sinks, out_s, smax_s, ssum_s, lse_s = ctx.saved_tensors
        d_out = d_out.to(q.dtype).contiguous()
        dq, dk, dv = torch_npu.npu_fusion_attention_grad(
            q, k, v, d_out, q.shape[1], "TND", softmax_max=smax_s, softmax_sum=ssum_s, attention_in=out_s,
            scale_value=ctx.scale, **ctx.op_kwargs,
        )[:3]
        d_sinks = None
        if ctx.needs_input_grad[3]:
            delta = (d_out.float() * out_s.float()).sum(dim=-1)  # (T, Hq) rowsum(dO' * O')
            p_sink = torch.exp(sinks.float()[None, :] - lse_s)  # the sink's share of each row
            d_sinks = (-(p_sink * delta).sum(dim=0)).to(sinks.dtype)
        return dq, dk, dv, d_sinks, None, None


def npu_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The Backend.varlen_attention contract (polyrl.core.attention) on npu_fusion_attention.

    q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv], cu_seqlens [N+1] -> [T, Hq, Dv] in q's dtype; the device
    is q's (an NPU on hardware; the CPU in CPU mode). Within the op's limits this is one call; beyond them the
    batch is cut (more than 1024 sequences or 1M tokens: by documents; more than 256 query heads: by KV-head
    groups), and Dk < Dv is padded with zero columns (which leave the logits unchanged).
    """
    import torch_npu

    t, hq = q.shape[:2]
    dv = v.shape[2]
    if t == 0:
        return q.new_zeros(0, hq, dv)
    check_shapes(q, k, v)
    if q.dtype == torch.float32 and not fp32_supported(torch_npu):
        raise ValueError(f"npu_fusion_attention takes float32 inputs from CANN 8.2.RC1 on (found CANN "
                         f"{_cann_version(torch_npu) or 'version unknown'}): set model.dtype to bfloat16")
    if q.shape[2] < dv:  # the op wants Dk >= Dv: zero columns add nothing to q.k
        q = torch.nn.functional.pad(q, (0, dv - q.shape[2]))
        k = torch.nn.functional.pad(k, (0, dv - k.shape[2]))
    mode = sink_mode(torch_npu) if sinks is not None else None
    if mode == "lse" and (problem := lse_route_problem(torch_npu)):
        raise ValueError(problem)
    layout = {"softmax_layout": "TND"} if mode == "lse" else {}
    calls = split_calls(_seq_ends(cu_seqlens))
    hkv = k.shape[1]
    kv_per_call = max(1, MAX_HEADS // (hq // hkv))
    outs = []
    for start, end, ends in calls:
        op_kwargs = {"actual_seq_qlen": ends, "actual_seq_kvlen": ends, **mask_kwargs(window, q.device), **layout}
        parts = []
        for h0 in range(0, hkv, kv_per_call):  # one pass unless Hq > 256
            h1 = min(h0 + kv_per_call, hkv)
            qh = slice(h0 * (hq // hkv), h1 * (hq // hkv))
            parts.append(_attend(q[start:end, qh], k[start:end, h0:h1], v[start:end, h0:h1],
                                 None if sinks is None else sinks[qh], op_kwargs, scale, mode))
        outs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _attend(q, k, v, sinks, op_kwargs: dict[str, Any], scale: float, mode: str | None) -> torch.Tensor:
    """One npu_fusion_attention call (and its backward) on a run the op accepts."""
    import torch_npu

    hq = q.shape[1]
    if sinks is None:
        return torch_npu.npu_fusion_attention(q, k, v, hq, "TND", scale=scale, **op_kwargs)[0]
    if mode == "native":
        # The op takes the sinks in fp32; autograd casts dsink back to the parameter's dtype.
        return torch_npu.npu_fusion_attention(q, k, v, hq, "TND", scale=scale, sink=sinks.float(), **op_kwargs)[0]
    return _LseSinkAttention.apply(q, k, v, sinks, op_kwargs, scale)
