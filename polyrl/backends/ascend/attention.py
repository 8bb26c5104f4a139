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
  * ``lse``: older stacks. Run the op without sink and correct with its softmax statistics:
    ``O' = O * sigmoid(LSE - s)``; the backward is the op's own grad kernel fed the statistics of the
    softmax that includes the sink column (row max ``m' = max(m, s)``, row sum
    ``l' = l e^{m - m'} + e^{s - m'}``, i.e. ``sum + exp(s - max)`` re-based so that a large sink cannot
    overflow) and ``attention_in = O'``; ``ds_h = -sum_i p_sink_i rowsum(dO'_i * O'_i)`` with
    ``p_sink_i = exp(s_h - LSE'_i)``. Exact, not an approximation: it is the flash backward of the
    softmax with the sink column. Proven on polyrl.testing.npu_emulator only — not on an NPU.
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

_masks: dict[torch.device, torch.Tensor] = {}
_detected: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # torch_npu module -> (mode, reason)


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
    """("native" | "lse", why) from the installed torch_npu and CANN; unknown versions choose "lse"."""
    if torch_npu in _detected:
        return _detected[torch_npu]
    version = str(getattr(torch_npu, "__version__", ""))
    cann = _cann_version(torch_npu)
    if not torch_npu_supports_sink(version):
        result = ("lse", f"torch_npu {version or '?'} has no sink= (needs 2.6.0.post5 / 2.7.1.post2 / 2.8.0.post2 / 2.9.0+)")
    elif not cann_supports_sink(cann):
        result = ("lse", f"CANN {cann or 'version unknown'} is older than 8.5.0 (needed for sink=)")
    else:
        result = ("native", f"torch_npu {version} with CANN {cann} supports sink=")
    _detected[torch_npu] = result
    return result


def sink_mode(torch_npu: Any) -> str:
    """The sink route: ``POLYRL_ASCEND_SINK`` if set, else :func:`detect_sink_mode`."""
    forced = os.environ.get(SINK_ENV, "").strip().lower()
    if forced:
        if forced not in SINK_MODES:
            raise ValueError(f"{SINK_ENV}={forced!r}: expected one of {', '.join(SINK_MODES)}")
        return forced
    return detect_sink_mode(torch_npu)[0]


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


def _seq_ends(cu_seqlens: torch.Tensor) -> list[int]:
    """cu_seqlens [N+1] -> cumulative ends without the leading 0, empty documents dropped (host ints)."""
    ends = []
    for end in cu_seqlens.tolist()[1:]:
        if not ends or end != ends[-1]:
            ends.append(int(end))
    return [e for e in ends if e > 0]


def _stat_rows(ends: list[int], hq: int, device: torch.device) -> torch.Tensor:
    """[T, Hq]: the row of softmax_max/sum ([T*Hq] rows of 8) holding (token, head) in the op's default
    TND order, where sequence b's statistics are one [Hq, s_b] block starting at row Hq * start_b."""
    ends_t = torch.tensor(ends, dtype=torch.long, device=device)
    lens = torch.diff(ends_t, prepend=ends_t.new_zeros(1))
    starts = ends_t - lens
    tok = torch.arange(int(ends[-1]), device=device)
    doc = torch.repeat_interleave(torch.arange(len(ends), device=device), lens)  # [T]
    head = torch.arange(hq, device=device)[None, :]
    return (hq * starts[doc])[:, None] + head * lens[doc][:, None] + (tok - starts[doc])[:, None]


def _stats_to_tokens(stat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """softmax_max/sum [T, Hq, 8] (default order) -> [T, Hq] fp32."""
    t, hq = rows.shape
    return stat.reshape(t * hq, -1)[rows.reshape(-1), 0].view(t, hq).float()


def _stats_from_tokens(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[T, Hq] fp32 -> [T, Hq, 8] in the op's default order (the inverse of _stats_to_tokens)."""
    t, hq = x.shape
    out = torch.empty(t * hq, 8, dtype=torch.float32, device=x.device)
    out[rows.reshape(-1)] = x.reshape(t * hq, 1).float().expand(t * hq, 8)
    return out.view(t, hq, 8)


# --- the sink correction through the softmax statistics -----------------------------------------------
class _LseSinkAttention(torch.autograd.Function):
    """O' = O * sigmoid(LSE - s) forward; npu_fusion_attention_grad on (m', l', O') backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, op_kwargs: dict[str, Any], scale: float):
        import torch_npu

        hq = q.shape[1]
        out, smax, ssum = torch_npu.npu_fusion_attention(q, k, v, hq, "TND", scale=scale, **op_kwargs)[:3]
        rows = _stat_rows(op_kwargs["actual_seq_qlen"], hq, q.device)
        m = _stats_to_tokens(smax, rows)  # (T, Hq) row max of the sink-free logits
        row_l = _stats_to_tokens(ssum, rows)  # (T, Hq) sum of exp(logit - m)
        s = sinks.float()[None, :]
        lse = m + torch.log(row_l)
        out_s = (out.float() * torch.sigmoid(lse - s)[..., None]).to(q.dtype)  # O'
        m_s = torch.maximum(m, s)  # statistics of the softmax that has the sink column
        l_s = row_l * torch.exp(m - m_s) + torch.exp(s - m_s)
        lse_s = m_s + torch.log(l_s)  # LSE' = logaddexp(LSE, s)
        ctx.save_for_backward(q, k, v, sinks, out_s, _stats_from_tokens(m_s, rows), _stats_from_tokens(l_s, rows),
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
    is q's (an NPU on hardware; the CPU under the emulator).
    """
    import torch_npu

    t, hq = q.shape[:2]
    if t == 0:
        return q.new_zeros(0, hq, v.shape[2])
    ends = _seq_ends(cu_seqlens)
    op_kwargs = {"actual_seq_qlen": ends, "actual_seq_kvlen": ends, **mask_kwargs(window, q.device)}
    if sinks is None:
        return torch_npu.npu_fusion_attention(q, k, v, hq, "TND", scale=scale, **op_kwargs)[0]
    if sink_mode(torch_npu) == "native":
        # The op takes the sinks in fp32; autograd casts dsink back to the parameter's dtype.
        return torch_npu.npu_fusion_attention(q, k, v, hq, "TND", scale=scale, sink=sinks.float(), **op_kwargs)[0]
    return _LseSinkAttention.apply(q, k, v, sinks, op_kwargs, scale)
