"""The emulated NPU's MoE matmuls: ``npu_grouped_matmul`` as documented, and no ``torch._grouped_mm``.

Part of the torch_npu emulator (polyrl.emulation.npu), on the CPU, never a claim about hardware.

``npu_grouped_matmul`` (op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md``; the
signature of ``op_plugin/config/op_plugin_functions.yaml`` on the 7.2.0 / 7.3.0 branches), the non-quantized
single-tensor cases of Atlas A2/A3 with ``group_list`` a Tensor:

- ``group_type=0`` (groups along M): x [M, K] not transposed, weight one tensor [E, K, N] (contiguous, or the
  transposed view of a contiguous [E, N, K]), y [M, N]; ``group_type=2`` (groups along K): x [K, M] given
  transposed (a view of a contiguous [M, K]), weight [M, N] not transposed, y [E, K, N];
- ``split_item`` 2 or 3 (one output tensor); ``group_list_type`` 0 (cumulative ends, non-decreasing, the last
  equal to the grouped axis) or 1 (sizes, summing to it); at most 1024 groups; inner axes < 65536;
- float16, bfloat16 or float32, x and weight alike; the output in x's dtype (fp32 accumulation);
- no autograd formula (op-plugin's derivatives.yaml has none): a backward through it raises.
Everything else (lists of several tensors, quantization, bias, activation, group_list as a list) is refused
as not emulated.

``torch._grouped_mm`` / ``torch.nn.functional.grouped_mm``: op-plugin registers ``_scaled_grouped_mm`` but no
``_grouped_mm`` for the NPU, so the dispatcher refuses it there. While the emulator is installed both are
refused, with the dispatcher's words, when called from an experts kernel of the ascend backend
(polyrl.core.models.experts.running_backend): a backend that picked transformers' default experts path fails
here as on hardware, while the cpu reference running beside it in the same process (parity) is untouched.
"""

from __future__ import annotations

from typing import Any

import torch

MAX_GROUPS = 1024
INNER_LIMIT = 65536
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _transposed_view(t: torch.Tensor) -> bool:
    """A 2-D or 3-D tensor whose last two axes are the swapped view of a contiguous tensor."""
    return t.dim() >= 2 and not t.is_contiguous() and t.transpose(-2, -1).is_contiguous()


def _sizes(group_list: Any, group_list_type: int, total: int, axis: str) -> list[int]:
    if not isinstance(group_list, torch.Tensor):
        raise NotImplementedError("npu emulator: npu_grouped_matmul with group_list as a list is not emulated")
    if group_list.dtype != torch.int64 or group_list.dim() != 1:
        raise RuntimeError(f"npu_grouped_matmul: group_list must be a 1-D int64 tensor, got {group_list.dtype} "
                           f"{tuple(group_list.shape)}")
    if group_list.numel() > MAX_GROUPS:
        raise RuntimeError(f"npu_grouped_matmul: group_list holds at most {MAX_GROUPS} groups, got {group_list.numel()}")
    values = [int(v) for v in group_list.tolist()]
    if group_list_type == 0:
        if any(b < a for a, b in zip([0, *values], values)) or (values and values[-1] != total):
            raise RuntimeError(f"npu_grouped_matmul: group_list (cumulative, group_list_type=0) must be non-decreasing "
                               f"and end at {axis}={total}, got {values}")
        return [b - a for a, b in zip([0, *values], values)]
    if group_list_type == 1:
        if any(v < 0 for v in values) or sum(values) != total:
            raise RuntimeError(f"npu_grouped_matmul: group_list (sizes, group_list_type=1) must be non-negative and sum "
                               f"to {axis}={total}, got {values}")
        return values
    raise NotImplementedError(f"npu emulator: npu_grouped_matmul group_list_type {group_list_type} is not emulated")


class _NoGrad(torch.autograd.Function):
    """The op's outputs as autograd sees them: there is no formula, a backward through them raises."""

    @staticmethod
    def forward(ctx, y, *inputs):
        return y

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("npu emulator: npu_grouped_matmul has no autograd formula in op-plugin (derivatives.yaml); "
                           "write its backward (as polyrl.backends.ascend.experts does)")


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None):
    unsupported = {"bias": bias, "scale": scale, "offset": offset, "antiquant_scale": antiquant_scale,
                   "antiquant_offset": antiquant_offset, "per_token_scale": per_token_scale,
                   "activation_input": activation_input, "activation_quant_scale": activation_quant_scale,
                   "activation_quant_offset": activation_quant_offset}
    given = [k for k, v in unsupported.items() if v is not None]
    if given or act_type:
        raise NotImplementedError(f"npu emulator: npu_grouped_matmul with {given or ['act_type']} is not emulated")
    if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
        raise TypeError("npu_grouped_matmul(): x and weight must be lists of tensors")
    if len(x) != 1 or len(weight) != 1:
        raise NotImplementedError("npu emulator: npu_grouped_matmul with several x or weight tensors is not emulated")
    if split_item not in (2, 3):
        raise NotImplementedError(f"npu emulator: split_item {split_item} (several outputs) is not emulated")
    a, w = x[0], weight[0]
    if max(a.shape[-1], w.shape[-1]) >= INNER_LIMIT:
        raise RuntimeError(f"npu_grouped_matmul: the last axis of x and weight must be < {INNER_LIMIT}")
    if a.dtype not in _DTYPES or w.dtype != a.dtype:
        raise RuntimeError(f"npu_grouped_matmul: x {a.dtype} with weight {w.dtype} is not a supported non-quantized "
                           "pair (float16, bfloat16 or float32, alike)")
    if output_dtype is not None and output_dtype != a.dtype:
        raise RuntimeError(f"npu_grouped_matmul: output_dtype {output_dtype} must be x's dtype {a.dtype}")
    if group_type == 0:
        if a.dim() != 2 or w.dim() != 3:
            raise RuntimeError(f"npu_grouped_matmul: group_type=0 needs x 2-D and one 3-D weight, got "
                               f"{tuple(a.shape)} and {tuple(w.shape)}")
        if not a.is_contiguous():
            raise RuntimeError("npu_grouped_matmul: group_type=0 does not support a transposed x")
        if not (w.is_contiguous() or _transposed_view(w)):
            raise RuntimeError("npu_grouped_matmul: weight must be contiguous [E, K, N] or its transposed view")
        if a.shape[1] != w.shape[1]:
            raise RuntimeError(f"npu_grouped_matmul: x [M, K={a.shape[1]}] does not match weight [E, K={w.shape[1]}, N]")
        sizes = _sizes(group_list, group_list_type, a.shape[0], "M")
        if len(sizes) != w.shape[0]:
            raise RuntimeError(f"npu_grouped_matmul: group_list has {len(sizes)} groups, weight {w.shape[0]} experts")
        out = torch.empty(a.shape[0], w.shape[2], dtype=a.dtype, device=a.device)
        start = 0
        for e, n in enumerate(sizes):
            out[start:start + n] = (a[start:start + n].float() @ w[e].float()).to(a.dtype)
            start += n
    elif group_type == 2:
        if a.dim() != 2 or w.dim() != 2:
            raise RuntimeError(f"npu_grouped_matmul: group_type=2 needs x and weight 2-D, got {tuple(a.shape)} and "
                               f"{tuple(w.shape)}")
        if not _transposed_view(a):
            raise RuntimeError("npu_grouped_matmul: group_type=2 needs x transposed ([K, M], a view of [M, K])")
        if not w.is_contiguous():
            raise RuntimeError("npu_grouped_matmul: group_type=2 does not support a transposed weight")
        if a.shape[1] != w.shape[0]:
            raise RuntimeError(f"npu_grouped_matmul: x [K, M={a.shape[1]}] does not match weight [M={w.shape[0]}, N]")
        sizes = _sizes(group_list, group_list_type, a.shape[1], "M")
        out = torch.zeros(len(sizes), a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        start = 0
        for e, n in enumerate(sizes):
            out[e] = (a[:, start:start + n].float() @ w[start:start + n].float()).to(a.dtype)
            start += n
    else:
        raise NotImplementedError(f"npu emulator: npu_grouped_matmul group_type {group_type} is not emulated")
    if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):
        out = _NoGrad.apply(out, a, w)
    return [out]


# --- no torch._grouped_mm on the emulated NPU -------------------------------------------------------------


def _refusing(original: Any, name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        from polyrl.core.models.experts import running_backend

        if running_backend() == "ascend":
            raise NotImplementedError(
                f"Could not run 'aten::_grouped_mm' with arguments from the 'PrivateUse1' backend (emulated NPU: "
                f"op-plugin registers _scaled_grouped_mm, not _grouped_mm; called as torch {name})")
        return original(*args, **kwargs)

    refuse.__polyrl_emulator_refusal__ = original  # type: ignore[attr-defined]
    return refuse


def refuse_grouped_mm() -> dict[tuple[Any, str], Any]:
    """Replace torch's grouped matmul entry points by refusing ones; returns what to restore."""
    saved = {}
    for owner, name in ((torch, "_grouped_mm"), (torch.nn.functional, "grouped_mm")):
        original = getattr(owner, name, None)
        if original is None or hasattr(original, "__polyrl_emulator_refusal__"):
            continue
        saved[(owner, name)] = original
        setattr(owner, name, _refusing(original, f"{owner.__name__}.{name}"))
    return saved


def restore_grouped_mm(saved: dict[tuple[Any, str], Any]) -> None:
    for (owner, name), original in saved.items():
        setattr(owner, name, original)
