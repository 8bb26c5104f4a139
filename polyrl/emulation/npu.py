"""An emulator, on CPU, of the DOCUMENTED torch_npu attention API — for tests, never a claim about hardware.

There is no NPU where polyrl's suite runs, and installing torch-npu without Ascend's CANN breaks even
``import torch``. So the Ascend backend is exercised against this module placed in
``sys.modules["torch_npu"]``: it implements ``npu_fusion_attention`` and ``npu_fusion_attention_grad`` as
their public documentation describes them (docs/background.md §4), with dense per-sequence fp32 math written for
this file alone (it shares nothing with polyrl's reference attention, so agreement between the two means
something). What it emulates:

- layout TND only (packed tokens; ``actual_seq_qlen`` / ``actual_seq_kvlen`` = cumulative END positions,
  host Python lists), GQA native (``head_num`` = query heads, K/V never repeated by the caller);
- ``atten_mask=None`` -> full (non-causal) attention within each sequence, sparse_mode/pre/next ignored;
  sparse_mode 0 (explicit [maxSq, maxSkv] mask, True = masked, plus the pre/next band), 2 (top-left
  causal), 3 (bottom-right causal), 4 (band: keep key j of query i iff
  ``-pre_tockens <= j - i - (Skv - Sq) <= next_tockens``); modes 2/3/4 demand the compressed
  ``triu(ones(2048, 2048), 1)`` bool mask and refuse any other shape, as the real op does (the emulator is
  stricter than the op: it also refuses a 2048x2048 mask with other contents);
- ``softmax_max`` / ``softmax_sum``: fp32 [T, N, 8] (each value repeated 8 times), by default ordered per
  sequence as consecutive [N, s_b, 8] blocks — written from the kernel's offset formula (see
  :func:`_kernel_row`), not from polyrl's backend — and in token order only with ``softmax_layout="TND"``;
  ``LSE = max + log(sum)``; the sink (when given) is part of both;
- the release's signature (:func:`release_of`: ``softmax_layout`` from TorchNPU 7.2.0, ``sink`` from 7.3.0; an
  unknown keyword is a TypeError), the grad op's 4 outputs before 7.3.0 and 5 after, and op-plugin's checks
  before launch with its wording: ``sink=`` needs CANN 8.5.0 ("The param sink is not supported in this CANN
  version, ..."), ``softmax_layout="TND"`` without sink CANN 8.3.RC1;
- ``sink=``: fp32 [head_num], unscaled, with its own gradient; on an emulated Ascend 950
  (``soc_version="Ascend950..."``) with op-plugin 26.0.0 or later (torch_npu 2.7.1.post4 / 2.8.0.post4 /
  2.9.0.post2 / 2.10.0 on) the forward drops it and the backward uses it, as op-plugin does there (its 7.x
  branches have no Ascend 950 path: they check CANN's kernels as on any chip);
- the documented limits: at most 1024 sequences per call, T <= 1M, D <= 768, Nq <= 256, Nq % Nkv == 0,
  Dq == Dk >= Dv, and float32 inputs only from CANN 8.2.RC1;
- autograd like the real op (op-plugin's derivatives.yaml): gradients flow to query/key/value/sink through
  ``npu_fusion_attention_grad``; softmax_max / softmax_sum are differentiable outputs
  (``output_differentiability: [true, true, true, true, ...]``: they require grad) whose gradients the formula
  never reads — a loss through them trains nothing, silently, as on the device;
- MoE: ``npu_grouped_matmul``, ``npu_grouped_matmul_add_`` and no ``torch._grouped_mm`` for the ascend backend's experts
  (polyrl.emulation.npu_moe);
- ``npu_fusion_attention_grad`` recomputes the probabilities from the GIVEN softmax_max / softmax_sum and
  takes ``rowsum(dy * attention_in)`` from the GIVEN attention_in — which is what makes the LSE-correction
  route for sinks (polyrl.backends.ascend.attention) testable here.

Where each rule is written (op-plugin = Ascend/op-plugin at the branch named; Ascend/pytorch at the tag named):
the arguments, layouts, sparse modes and compressed mask, the sink's dtype and shape, the limits, fp32 from CANN
8.2.RC1 and ``softmax_layout`` from CANN 8.3.RC1: op-plugin ``docs/context/torch_npu-npu_fusion_attention.md``@7.2.0
and @7.3.0 (parameters, 约束说明); the signatures per release: ``op_plugin/config/op_plugin_functions.yaml``@7.1.0,
@7.2.0, @7.3.0, @26.0.0; the pre-launch checks and their wording, and Ascend 950's forward without ``sink=``:
``op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp``@7.3.0 (l. 255, 1081) and @26.0.0; the outputs'
differentiability and the grad formula: ``op_plugin/config/derivatives.yaml``@7.3.0; the default statistics offsets:
hicann ops-transformer ``attention/flash_attention_score/op_kernel/flash_attention_score_s1s2_bn2gs1.h`` (master);
which torch_npu belongs to which release: Ascend/pytorch ``version.txt`` at v7.2.0-pytorch2.6.0 ... v7.3.0-pytorch2.9.0
(polyrl.emulation.npu_releases). The MoE ops cite theirs in polyrl.emulation.npu_moe, HCCL's in polyrl.emulation.hccl.

Not emulated (refused loudly): other layouts, keep_prob < 1 (dropout), pse, padding_mask, prefix, sparse
modes 1/5/6/7/8, the ``npu`` device (tensors stay on the CPU; the backend takes its device from the inputs).
Every call is recorded (scalar arguments only) in ``NpuEmulator.calls`` so tests can check what a caller
passed (e.g. ``pre_tockens = W - 1``).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import sys
import types
from typing import Any

import torch

from polyrl.emulation.npu_moe import grouped_matmul_add, npu_grouped_matmul, refuse_grouped_mm, restore_grouped_mm
from polyrl.emulation.npu_releases import RELEASES, release_at_least, release_of

__all__ = ["RELEASES", "NpuEmulator", "emulated_ascend_backend", "install_emulator", "release_at_least", "release_of"]

MAX_TOCKENS = 2147483647
COMPRESSED_MASK_SIZE = 2048
STAT_REPEAT = 8  # softmax_max / softmax_sum carry each value 8 times (one 32-byte block per row)
_UNSET = object()  # "the caller did not pass sink=" (distinct from sink=None)


# --- masks -----------------------------------------------------------------------------------------
def _check_mask(atten_mask: torch.Tensor | None, sparse_mode: int, max_sq: int, max_skv: int) -> None:
    if atten_mask is None:
        return
    if sparse_mode not in (0, 2, 3, 4):
        raise NotImplementedError(f"npu emulator: sparse_mode {sparse_mode} is not emulated (0, 2, 3, 4 are)")
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise RuntimeError(f"npu_fusion_attention: atten_mask must be bool or uint8, got {atten_mask.dtype}")
    if sparse_mode == 0:
        if tuple(atten_mask.shape) != (max_sq, max_skv):
            raise RuntimeError(
                f"npu_fusion_attention: sparse_mode 0 with TND needs atten_mask [maxSq, maxSkv] = "
                f"[{max_sq}, {max_skv}], got {tuple(atten_mask.shape)}"
            )
        return
    size = COMPRESSED_MASK_SIZE
    if tuple(atten_mask.shape) != (size, size):
        raise RuntimeError(
            f"npu_fusion_attention: sparse_mode {sparse_mode} needs the compressed mask of shape [{size}, {size}] "
            f"(torch.triu(torch.ones({size}, {size}, dtype=torch.bool), 1)), got {tuple(atten_mask.shape)}"
        )
    if not torch.equal(atten_mask.bool(), _compressed_mask(atten_mask.device)):
        raise RuntimeError("npu emulator: the compressed mask must be triu(ones(2048, 2048), 1) (True above the diagonal)")


_MASKS: dict[torch.device, torch.Tensor] = {}


def _compressed_mask(device: torch.device) -> torch.Tensor:
    if device not in _MASKS:
        _MASKS[device] = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device).triu(1)
    return _MASKS[device]


def _keep(sq: int, skv: int, atten_mask, sparse_mode: int, pre: int, nxt: int, device) -> torch.Tensor:
    """bool [sq, skv]: True where query i of a sequence may attend key j of the same sequence."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(skv, device=device)[None, :]
    if atten_mask is None:  # documented: no mask means full attention, whatever sparse_mode/pre/next say
        return torch.ones(sq, skv, dtype=torch.bool, device=device)
    if sparse_mode == 0:  # explicit mask (top-left) and the band, top-left aligned
        return ~atten_mask[:sq, :skv].bool() & (j - i >= -pre) & (j - i <= nxt)
    if sparse_mode == 2:  # leftUpCausal
        return j <= i
    off = skv - sq  # bottom-right alignment
    if sparse_mode == 3:  # rightDownCausal
        return j - i - off <= 0
    return (j - i - off >= -pre) & (j - i - off <= nxt)  # sparse_mode 4: band


# --- layout of softmax_max / softmax_sum -----------------------------------------------------------
# Written from the kernel, not from polyrl's backend: hicann ops-transformer,
# attention/flash_attention_score/op_kernel/flash_attention_score_s1s2_bn2gs1.h, TND layout, writes the row
# statistics of (sequence b, KV head n2, group member g, query s1) at
#     softmaxMaxOffset = (s1SizeAcc * n2G + n2oIdx * gSize * s1Size + goIdx * s1Size + s1oIdx * s1BaseSize + i) * 8
# floats, where s1SizeAcc = the query tokens before sequence b, n2G = N (query heads), s1Size = s_b. The query head
# of (n2, g) is n2 * gSize + g (GQA: head h reads KV head h // G). Op-plugin allocates the tensor as [T, N, 8]
# (FlashAttentionKernelNpuOpApi.cpp), so "[T, N, 8]" is only its shape: in memory it is [N, s_b, 8] blocks per
# sequence. With softmax_layout="TND" ("same_as_input") the rows follow the input: row t * N + h.
def _kernel_row(s1_size_acc: int, n: int, g_size: int, n2: int, g: int, s1_size: int, s1: int) -> int:
    """The 8-float row (flat index / 8) of one statistic in the default TND order, as the kernel computes it."""
    return s1_size_acc * n + n2 * g_size * s1_size + g * s1_size + s1


def _stat_rows(cum_q: list[int], n: int, n_kv: int, device) -> torch.Tensor:
    """[T, N] long: for token t and query head h, the row holding its statistic (default layout)."""
    rows = torch.empty(cum_q[-1] if cum_q else 0, n, dtype=torch.long)
    g_size = n // n_kv
    acc = 0
    for end in cum_q:
        s1_size = end - acc
        for n2 in range(n_kv):
            for g in range(g_size):
                base = _kernel_row(acc, n, g_size, n2, g, s1_size, 0)
                rows[acc:end, n2 * g_size + g] = torch.arange(base, base + s1_size)
        acc = end
    return rows.to(device)


def _stats_out(x: torch.Tensor, cum_q: list[int], softmax_layout: str, n_kv: int) -> torch.Tensor:
    """[T, N] fp32 -> [T, N, 8] in the requested layout."""
    t, n = x.shape
    rep = x[..., None].expand(t, n, STAT_REPEAT)
    if softmax_layout == "TND":
        return rep.contiguous()
    out = torch.empty(t * n, STAT_REPEAT, dtype=x.dtype, device=x.device)
    out[_stat_rows(cum_q, n, n_kv, x.device).reshape(-1)] = rep.reshape(t * n, STAT_REPEAT)
    return out.view(t, n, STAT_REPEAT)


def _stats_in(x: torch.Tensor, cum_q: list[int], softmax_layout: str, n_kv: int) -> torch.Tensor:
    """[T, N, 8] in the given layout -> [T, N] fp32 (first of the 8 copies)."""
    t, n, _ = x.shape
    if softmax_layout == "TND":
        return x[..., 0].float()
    rows = _stat_rows(cum_q, n, n_kv, x.device)
    return x.reshape(t * n, -1)[rows.reshape(-1), 0].view(t, n).float()


# --- argument checks -------------------------------------------------------------------------------
def _cumulative(name: str, seqs, total: int) -> list[int]:
    if seqs is None:
        raise RuntimeError(f"npu_fusion_attention: input_layout TND needs {name}")
    if isinstance(seqs, torch.Tensor) or not isinstance(seqs, (list, tuple)):
        raise TypeError(f"npu_fusion_attention: {name} must be a host list of ints, got {type(seqs).__name__}")
    cum = [int(x) for x in seqs]
    if any(type(x) is not int for x in seqs):
        raise TypeError(f"npu_fusion_attention: {name} must hold Python ints")
    if not cum or cum[-1] != total or any(b < a for a, b in zip([0, *cum], cum)):
        raise RuntimeError(f"npu_fusion_attention: {name} must be non-decreasing cumulative ends ending at {total}, got {cum}")
    return cum


# The documented limits (op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md, 约束说明): the
# varlen (TND) case takes at most 1K sequences, T in 1..1M, D in 1..768 with Dq == Dk >= Dv, Nq in 1..256 with
# Nq % Nkv == 0. The real checks live in CANN's aclnn layer, whose wording is not public: the messages below are
# the emulator's own, each naming the rule.
MAX_SEQS = 1024
MAX_T = 1 << 20
MAX_D = 768
MAX_N = 256
FP32_FROM_CANN = (8, 2, -1, 1)  # float32 q/k/v: documented from TorchNPU 7.1.0 / CANN 8.2.RC1 (CANN 7.0.0: fp16/bf16)
SOFTMAX_LAYOUT_FROM_CANN = (8, 3, -1, 1)  # aclnnFlashAttentionVarLenScoreV4 (softmax_layout): CANN 8.3.RC1
SINK_FROM_CANN = (8, 5, 0, 0)  # aclnnFlashAttentionVarLenScoreV5 (sink): CANN 8.5.0


def _cann_tuple(text: str) -> tuple[int, int, int, int]:
    """'8.5.0' -> (8, 5, 0, 0), '8.3.RC1' -> (8, 3, -1, 1); anything unreadable -> (0, 0, 0, 0) (an old CANN)."""
    import re

    m = re.match(r"^\s*(\d+)\.(\d+)\.(?:(\d+)|RC(\d+))", text or "", re.IGNORECASE)
    if m is None:
        return (0, 0, 0, 0)
    if m.group(4) is not None:
        return int(m.group(1)), int(m.group(2)), -1, int(m.group(4))
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), 0


def _check_common(query, key, value, head_num, input_layout, pse, padding_mask, prefix, keep_prob,
                  cann: tuple[int, int, int, int]) -> None:
    if input_layout != "TND":
        raise NotImplementedError(f"npu emulator: only input_layout='TND' is emulated, got {input_layout!r}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() != 3:
            raise RuntimeError(f"npu_fusion_attention: TND {name} must be 3-D, got {tuple(x.shape)}")
        allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if cann >= FP32_FROM_CANN else ())
        if x.dtype not in allowed:
            raise RuntimeError(f"npu_fusion_attention: {name} dtype {x.dtype} is not supported by this CANN "
                               f"(supported: {', '.join(str(d) for d in allowed)})")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError("npu_fusion_attention: query, key and value must share a dtype")
    if head_num != query.shape[1]:
        raise RuntimeError(f"npu_fusion_attention: head_num={head_num} but query has {query.shape[1]} heads")
    if not 1 <= head_num <= MAX_N:
        raise RuntimeError(f"npu_fusion_attention: N (query heads) must be in [1, {MAX_N}], got {head_num}")
    if key.shape[1] != value.shape[1] or query.shape[1] % key.shape[1]:
        raise RuntimeError(f"npu_fusion_attention: {query.shape[1]} query heads vs {key.shape[1]} key heads (GQA needs N % Nkv == 0)")
    if key.shape[2] != query.shape[2]:
        raise RuntimeError("npu_fusion_attention: query and key head dims differ (Dq must equal Dk)")
    if value.shape[2] > key.shape[2]:
        raise RuntimeError(f"npu_fusion_attention: Dk >= Dv is required, got Dk={key.shape[2]}, Dv={value.shape[2]}")
    if max(query.shape[2], value.shape[2]) > MAX_D:
        raise RuntimeError(f"npu_fusion_attention: D must be in [1, {MAX_D}], got {max(query.shape[2], value.shape[2])}")
    if not 1 <= query.shape[0] <= MAX_T or not 1 <= key.shape[0] <= MAX_T:
        raise RuntimeError(f"npu_fusion_attention: varlen T must be in [1, {MAX_T}], got {query.shape[0]}")
    if keep_prob != 1.0:
        raise NotImplementedError("npu emulator: keep_prob < 1 (dropout) is not emulated")
    if pse is not None or padding_mask is not None or prefix is not None:
        raise NotImplementedError("npu emulator: pse, padding_mask and prefix are not emulated")


def _check_sink(sink, head_num: int) -> torch.Tensor | None:
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or sink.dtype != torch.float32 or tuple(sink.shape) != (head_num,):
        raise RuntimeError(f"npu_fusion_attention: sink must be a float32 tensor [head_num={head_num}], "
                           f"got {getattr(sink, 'dtype', type(sink))} {tuple(getattr(sink, 'shape', ()))}")
    return sink


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Everything about a call that is not a differentiable tensor."""

    head_num: int
    scale: float
    cum_q: list[int]
    cum_kv: list[int]
    atten_mask: torch.Tensor | None
    sparse_mode: int
    pre: int
    nxt: int

    def sequences(self):
        """Yield (q_start, q_end, kv_start, kv_end) per sequence."""
        qs = ks = 0
        for qe, ke in zip(self.cum_q, self.cum_kv):
            yield qs, qe, ks, ke
            qs, ks = qe, ke


def _geometry(head_num, query, key, scale, seq_q, seq_kv, atten_mask, sparse_mode, pre, nxt) -> _Geometry:
    cum_q = _cumulative("actual_seq_qlen", seq_q, query.shape[0])
    cum_kv = _cumulative("actual_seq_kvlen", seq_kv, key.shape[0])
    if len(cum_q) != len(cum_kv):
        raise RuntimeError("npu_fusion_attention: actual_seq_qlen and actual_seq_kvlen differ in length")
    if len(cum_q) > MAX_SEQS:
        raise RuntimeError(f"npu_fusion_attention: varlen actual_seq_qlen holds at most {MAX_SEQS} sequences, "
                           f"got {len(cum_q)}")
    lens_q = [b - a for a, b in zip([0, *cum_q], cum_q)]
    lens_kv = [b - a for a, b in zip([0, *cum_kv], cum_kv)]
    _check_mask(atten_mask, sparse_mode, max(lens_q), max(lens_kv))
    return _Geometry(int(head_num), float(scale), cum_q, cum_kv, atten_mask, int(sparse_mode), int(pre), int(nxt))


# --- dense per-sequence math -----------------------------------------------------------------------
def _logits(g: _Geometry, query, key, qs, qe, ks, ke) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked fp32 logits [N, sq, skv] (-inf where masked) and the keep mask [sq, skv]."""
    n, nkv = query.shape[1], key.shape[1]
    qb = query[qs:qe].float().transpose(0, 1)  # (N, sq, D)
    kb = key[ks:ke].float().transpose(0, 1).repeat_interleave(n // nkv, dim=0)  # (N, skv, D): head h -> h // G
    keep = _keep(qe - qs, ke - ks, g.atten_mask, g.sparse_mode, g.pre, g.nxt, query.device)
    return (g.scale * qb @ kb.transpose(1, 2)).masked_fill(~keep, float("-inf")), keep


def _forward(g: _Geometry, query, key, value, sink):
    """attention_out [T, N, Dv] fp32, row max [T, N] and row sum [T, N] (sink included in both)."""
    t, n = query.shape[:2]
    nkv = key.shape[1]
    out = torch.zeros(t, n, value.shape[2], dtype=torch.float32, device=query.device)
    row_max = torch.full((t, n), float("-inf"), device=query.device)
    row_sum = torch.zeros(t, n, device=query.device)
    for qs, qe, ks, ke in g.sequences():
        if qe == qs:
            continue
        logits, _ = _logits(g, query, key, qs, qe, ks, ke)  # (N, sq, skv)
        m = logits.amax(dim=-1) if ke > ks else torch.full(logits.shape[:2], float("-inf"), device=query.device)
        if sink is not None:
            m = torch.maximum(m, sink.float()[:, None])
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a row that sees nothing stays 0
        p = torch.exp(logits - m_safe[..., None])
        row_l = p.sum(dim=-1)
        if sink is not None:
            row_l = row_l + torch.exp(sink.float()[:, None] - m_safe)
        vb = value[ks:ke].float().transpose(0, 1).repeat_interleave(n // nkv, dim=0)  # (N, skv, Dv)
        o = (p @ vb) / torch.where(row_l > 0, row_l, torch.ones_like(row_l))[..., None]
        out[qs:qe] = o.transpose(0, 1)
        row_max[qs:qe] = m.transpose(0, 1)
        row_sum[qs:qe] = row_l.transpose(0, 1)
    return out, row_max, row_sum


def _backward(g: _Geometry, query, key, value, dy, row_max, row_sum, attention_in, sink):
    """dq, dk, dv (fp32) and dsink [N] from the GIVEN row max / sum [T, N] and attention_in."""
    n = query.shape[1]
    nkv = key.shape[1]
    grp = n // nkv
    dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    dk = torch.zeros(key.shape, dtype=torch.float32, device=query.device)
    dv = torch.zeros(value.shape, dtype=torch.float32, device=query.device)
    delta = (dy.float() * attention_in.float()).sum(dim=-1)  # (T, N): rowsum(dO * O)
    for qs, qe, ks, ke in g.sequences():
        if qe == qs or ke == ks:
            continue
        logits, _ = _logits(g, query, key, qs, qe, ks, ke)
        m = row_max[qs:qe].transpose(0, 1)[..., None]  # (N, sq, 1)
        row_l = row_sum[qs:qe].transpose(0, 1)[..., None]
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(logits - m) / torch.where(row_l > 0, row_l, torch.ones_like(row_l))  # (N, sq, skv)
        dyb = dy[qs:qe].float().transpose(0, 1)  # (N, sq, Dv)
        qb = query[qs:qe].float().transpose(0, 1)
        kb = key[ks:ke].float().transpose(0, 1).repeat_interleave(grp, dim=0)
        vb = value[ks:ke].float().transpose(0, 1).repeat_interleave(grp, dim=0)
        ds = p * (dyb @ vb.transpose(1, 2) - delta[qs:qe].transpose(0, 1)[..., None])
        dq[qs:qe] = (g.scale * ds @ kb).transpose(0, 1)
        # Sum the G query heads of each KV head: (N, skv, E) -> (Nkv, G, skv, E) -> (Nkv, skv, E).
        dk[ks:ke] = (g.scale * ds.transpose(1, 2) @ qb).view(nkv, grp, ke - ks, -1).sum(1).transpose(0, 1)
        dv[ks:ke] = (p.transpose(1, 2) @ dyb).view(nkv, grp, ke - ks, -1).sum(1).transpose(0, 1)
    dsink = None
    if sink is not None:
        m = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        p_sink = torch.exp(sink.float()[None, :] - m) / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
        dsink = -(p_sink * delta).sum(dim=0)
    return dq, dk, dv, dsink


class _FusionAttention(torch.autograd.Function):
    """The forward op as autograd sees it on the device: its backward is the grad op; the two softmax statistics
    are differentiable outputs whose gradients the backward drops (op-plugin's derivatives.yaml)."""

    @staticmethod
    def forward(ctx, query, key, value, sink, forward_sink, g: _Geometry, softmax_layout: str, n_kv: int):
        out, row_max, row_sum = _forward(g, query, key, value, forward_sink)
        out = out.to(query.dtype)
        smax = _stats_out(row_max, g.cum_q, softmax_layout, n_kv)
        ssum = _stats_out(row_sum, g.cum_q, softmax_layout, n_kv)
        ctx.save_for_backward(query, key, value, sink, out, row_max, row_sum)
        ctx.g = g
        # op-plugin: output_differentiability [true, true, true, true, ...]: the statistics require grad, and
        # backward below never reads the gradients they receive
        return out, smax, ssum

    @staticmethod
    def backward(ctx, d_out, _d_max, _d_sum):
        query, key, value, sink, out, row_max, row_sum = ctx.saved_tensors
        dq, dk, dv, dsink = _backward(ctx.g, query, key, value, d_out.to(query.dtype), row_max, row_sum, out, sink)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dsink, None, None, None, None


# --- the emulated module ---------------------------------------------------------------------------

class NpuEmulator:
    """One emulated torch_npu release on one chip. ``module`` is what lands in ``sys.modules["torch_npu"]``.

    ``version`` picks the release (:func:`release_of`; ``release=`` overrides it), ``cann_version`` what CANN's
    kernels can do (fp32 inputs from 8.2.RC1, softmax_layout from 8.3.RC1, sink from 8.5.0), ``soc_version``
    the chip ("Ascend950..." emulates op-plugin's Ascend 950 path: the forward drops sink=)."""

    def __init__(self, version: str = "2.9.0", *, cann_version: str = "8.5.0", release: str | None = None,
                 soc_version: str = "Ascend910B3"):
        self.version = version
        self.release = release or release_of(version)
        if self.release not in RELEASES:
            raise ValueError(f"npu emulator: release {self.release!r} is not one of {RELEASES}")
        self.cann_version = cann_version
        self.soc_version = soc_version
        self.calls: list[dict[str, Any]] = []
        self.module = self._build_module()
        self._saved: dict[str, types.ModuleType | None] = {}

    @property
    def supports_sink(self) -> bool:
        return release_at_least(self.release, "7.3.0")

    @property
    def supports_softmax_layout(self) -> bool:
        return release_at_least(self.release, "7.2.0")

    @property
    def is_950(self) -> bool:
        return self.soc_version.lower().startswith("ascend950")

    @property
    def has_950_path(self) -> bool:
        """op-plugin's Ascend 950 branch (one aclnn kernel, the forward without sink=): from 26.0.0, on a 950."""
        return self.is_950 and release_at_least(self.release, "26.0.0")

    # The two documented ops. Keywords a release does not have are refused as Python refuses them.
    def npu_fusion_attention(
        self, query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
        scale=1.0, keep_prob=1.0, pre_tockens=MAX_TOCKENS, next_tockens=MAX_TOCKENS, inner_precise=0,
        prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
        sync=False, softmax_layout=_UNSET, sink=_UNSET, dropout_mask=_UNSET, seed=_UNSET, offset=_UNSET,
    ):
        op = "npu_fusion_attention"
        softmax_layout, sink = self._gate_keywords(op, softmax_layout, sink)
        for name, given in (("dropout_mask", dropout_mask), ("seed", seed), ("offset", offset)):
            if given is not _UNSET and not release_at_least(self.release, "26.0.0"):
                raise TypeError(f"{op}() got an unexpected keyword argument '{name}' "
                                f"(emulated torch_npu {self.version}, TorchNPU {self.release})")
        if dropout_mask not in (_UNSET, None):
            raise NotImplementedError("npu emulator: dropout_mask (dropout) is not emulated")
        cann = _cann_tuple(self.cann_version)
        _check_common(query, key, value, head_num, input_layout, pse, padding_mask, prefix, keep_prob, cann)
        sink = _check_sink(sink, head_num)
        self._check_kernel_available(op, sink, softmax_layout, cann, "aclnnFlashAttentionVarLenScore")
        g = _geometry(head_num, query, key, scale, actual_seq_qlen, actual_seq_kvlen, atten_mask, sparse_mode,
                      pre_tockens, next_tockens)
        # Ascend 950 (op-plugin 26.0.0 on): aclnnFlashAttentionScoreV4 with no sink (the backward still gets it).
        forward_sink = None if self.has_950_path else sink
        self._record(op, g, scale=scale, sink=sink is not None, softmax_layout=softmax_layout,
                     actual_seq_qlen=list(actual_seq_qlen), actual_seq_kvlen=list(actual_seq_kvlen))
        out, smax, ssum = _FusionAttention.apply(query, key, value, sink, forward_sink, g, softmax_layout,
                                                 key.shape[1])
        softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)  # reserved by the op
        return out, smax, ssum, softmax_out, 0, 0, 0

    def npu_fusion_attention_grad(
        self, query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None,
        softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, scale_value=1.0, keep_prob=1.0,
        pre_tockens=MAX_TOCKENS, next_tockens=MAX_TOCKENS, inner_precise=0, seed=0, offset=0, numels=0,
        prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
        sync=False, softmax_layout=_UNSET, sink=_UNSET,
    ):
        op = "npu_fusion_attention_grad"
        softmax_layout, sink = self._gate_keywords(op, softmax_layout, sink)
        cann = _cann_tuple(self.cann_version)
        _check_common(query, key, value, head_num, input_layout, pse, padding_mask, prefix, keep_prob, cann)
        sink = _check_sink(sink, head_num)
        self._check_kernel_available(op, sink, softmax_layout, cann, "aclnnFlashAttentionUnpaddingScoreGrad")
        if softmax_max is None or softmax_sum is None or attention_in is None:
            raise RuntimeError("npu_fusion_attention_grad: softmax_max, softmax_sum and attention_in are required")
        t, n = query.shape[:2]
        for name, x in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
            if x.dtype != torch.float32 or tuple(x.shape) != (t, n, STAT_REPEAT):
                raise RuntimeError(f"npu_fusion_attention_grad: {name} must be float32 [{t}, {n}, 8], "
                                   f"got {x.dtype} {tuple(x.shape)}")
        if tuple(attention_in.shape) != (t, n, value.shape[2]) or tuple(dy.shape) != tuple(attention_in.shape):
            raise RuntimeError("npu_fusion_attention_grad: dy and attention_in must be [T, N, Dv]")
        g = _geometry(head_num, query, key, scale_value, actual_seq_qlen, actual_seq_kvlen, atten_mask,
                      sparse_mode, pre_tockens, next_tockens)
        self._record(op, g, scale=scale_value, sink=sink is not None, softmax_layout=softmax_layout,
                     actual_seq_qlen=list(actual_seq_qlen), actual_seq_kvlen=list(actual_seq_kvlen))
        n_kv = key.shape[1]
        with torch.no_grad():
            dq, dk, dv, dsink = _backward(g, query, key, value, dy,
                                          _stats_in(softmax_max, g.cum_q, softmax_layout, n_kv),
                                          _stats_in(softmax_sum, g.cum_q, softmax_layout, n_kv), attention_in, sink)
        empty = torch.empty(0, device=query.device)
        grads = (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), empty)
        if not self.supports_sink:
            return grads  # 4 outputs up to 7.2.0
        return (*grads, dsink if dsink is not None else torch.empty(0, device=query.device))

    def get_cann_version(self, module: str = "CANN") -> str:
        return self.cann_version if module == "CANN" else ""

    def get_device_name(self, device=None) -> str:
        return self.soc_version

    # --- plumbing ---------------------------------------------------------------------------------
    def _gate_keywords(self, op: str, softmax_layout, sink) -> tuple[str, Any]:
        """The release's signature: an unknown keyword is a TypeError, as from the real binding."""
        for name, value, has in (("softmax_layout", softmax_layout, self.supports_softmax_layout),
                                 ("sink", sink, self.supports_sink)):
            if value is not _UNSET and not has:
                raise TypeError(f"{op}() got an unexpected keyword argument '{name}' "
                                f"(emulated torch_npu {self.version}, TorchNPU {self.release})")
        layout = "" if softmax_layout is _UNSET else softmax_layout
        if layout not in ("", "TND"):  # op-plugin's own check, its wording
            raise RuntimeError("only supported softmax_layout=TND")
        return layout, (None if sink is _UNSET else sink)

    def _check_kernel_available(self, op: str, sink, softmax_layout: str, cann, kernel: str) -> None:
        """op-plugin's checks before it launches (FlashAttentionKernelNpuOpApi.cpp, chips before Ascend 950):
        sink= needs the V5 aclnn kernel (CANN 8.5.0), softmax_layout="TND" without sink the V4 one (8.3.RC1)."""
        if self.has_950_path:
            return  # one kernel (aclnnFlashAttentionScoreV4 / GradV4) takes every argument there
        if sink is not None and cann < SINK_FROM_CANN:
            raise RuntimeError(f"The param sink is not supported in this CANN version, {kernel}V5 is not available")
        if sink is None and softmax_layout == "TND" and cann < SOFTMAX_LAYOUT_FROM_CANN:
            raise RuntimeError("The param softmax_layout is not supported")

    def _record(self, op: str, g: _Geometry, **extra) -> None:
        self.calls.append({"op": op, "head_num": g.head_num, "sparse_mode": g.sparse_mode, "pre_tockens": g.pre,
                           "next_tockens": g.nxt, "atten_mask": None if g.atten_mask is None else tuple(g.atten_mask.shape),
                           **extra})

    def _build_module(self) -> types.ModuleType:
        mod = types.ModuleType("torch_npu", "Emulated torch_npu (polyrl.emulation.npu): not an NPU.")
        mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
        mod.__version__ = self.version
        mod.__polyrl_emulator__ = self
        mod.npu_fusion_attention = self.npu_fusion_attention
        mod.npu_fusion_attention_grad = self.npu_fusion_attention_grad
        mod.npu_grouped_matmul = npu_grouped_matmul  # polyrl.emulation.npu_moe
        mod.npu_grouped_matmul_add_ = grouped_matmul_add(release_at_least(self.release, "26.0.0"))
        npu = types.ModuleType("torch_npu.npu")
        npu.utils = types.ModuleType("torch_npu.npu.utils")
        npu.utils.get_cann_version = self.get_cann_version
        npu.get_device_name = self.get_device_name
        utils = types.ModuleType("torch_npu.utils")
        utils.get_cann_version = self.get_cann_version
        mod.npu, mod.utils = npu, utils
        return mod

    def _submodules(self) -> dict[str, types.ModuleType]:
        m = self.module
        return {"torch_npu": m, "torch_npu.npu": m.npu, "torch_npu.npu.utils": m.npu.utils, "torch_npu.utils": m.utils}

    def install(self) -> NpuEmulator:
        for name, sub in self._submodules().items():
            self._saved[name] = sys.modules.get(name)
            sys.modules[name] = sub
        self._grouped_mm = refuse_grouped_mm()  # no torch._grouped_mm on the emulated NPU
        return self

    def uninstall(self) -> None:
        for name, previous in self._saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
        self._saved.clear()
        restore_grouped_mm(getattr(self, "_grouped_mm", {}))
        self._grouped_mm = {}

    def __enter__(self) -> NpuEmulator:
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()


def install_emulator(version: str = "2.9.0", *, cann_version: str = "8.5.0", release: str | None = None,
                     soc_version: str = "Ascend910B3") -> NpuEmulator:
    """Put an emulated torch_npu into ``sys.modules`` now; undo with ``.uninstall()`` or use it as a context
    manager (``with install_emulator(version="2.8.0", cann_version="8.3.RC1") as npu: ...``)."""
    return NpuEmulator(version, cann_version=cann_version, release=release, soc_version=soc_version).install()


def emulated_ascend_backend():
    """The real AscendBackend with only detection and device swapped: available, and on the CPU, so that
    the conformance kit runs its kernels through whatever torch_npu is in sys.modules (the emulator)."""
    from polyrl.backends.ascend import AscendBackend
    from polyrl.core.plugins.backend import Availability

    class EmulatedAscendBackend(AscendBackend):
        def detect(self) -> Availability:
            if "torch_npu" not in sys.modules or not hasattr(sys.modules["torch_npu"], "__polyrl_emulator__"):
                return Availability(False, "the torch_npu emulator is not installed (polyrl.emulation.npu)")
            return Availability(True, "emulated torch_npu on CPU (not an NPU)")

        def device(self, local_rank: int = 0) -> torch.device:
            return torch.device("cpu")

    return EmulatedAscendBackend()
