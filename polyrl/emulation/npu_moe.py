"""The emulated NPU's MoE matmuls: ``npu_grouped_matmul`` and ``npu_grouped_matmul_add_`` as documented, and no
``torch._grouped_mm``.

Part of the torch_npu emulator (polyrl.emulation.npu), on the CPU, never a claim about hardware. Each rule cites
its source (op-plugin = Ascend/op-plugin at the branch named; ops-transformer = CANN's kernels, hicann
ops-transformer on gitcode).

``npu_grouped_matmul`` (signature: op-plugin ``op_plugin/config/op_plugin_functions.yaml``@7.2.0 and @7.3.0; cases:
``docs/context/torch_npu-npu_grouped_matmul.md``@7.3.0, the table of Atlas A2/A3 scenarios, l. 257-273), the
non-quantized single-tensor case with ``group_list`` a Tensor:

- ``group_type=0`` (groups along M) only: x [M, K] not transposed ("x不支持转置"), weight one tensor [E, K, N]
  (contiguous, or the transposed view of a contiguous [E, N, K]: "支持weight转置"), y [M, N]. The page lists
  group_type -1 and 0 for A2/A3; ``group_type=2`` (groups along K, the weight gradient) is not among them and is
  refused here — its documented op is ``npu_grouped_matmul_add_`` (below);
- ``split_item`` 2 or 3 (one output tensor); ``group_list_type`` 0 (cumulative ends, non-decreasing, the last
  equal to M) or 1 (sizes, summing to M); at most 1024 groups; inner axes < 65536 (the same page);
- float16, bfloat16 or float32, x and weight alike; the output in x's dtype (fp32 accumulation);
- no autograd formula (op-plugin's derivatives.yaml has none): a backward through it raises.
Everything else (lists of several tensors, quantization, bias, activation, group_list as a list) is refused
as not emulated.

``npu_grouped_matmul_add_(y, x, weight, group_list, *, transpose_x=True, transpose_weight=False, group_type=2)``
(signature: op_plugin_functions.yaml@7.1.0 to @7.3.0; 26.0.0 adds ``group_list_type=0``), in place
``y_e += x_e^T @ weight_e`` with the rows of x and weight grouped along the reduced axis:

- ``group_type`` 2 only (op-plugin ``op_plugin/python/meta/_meta_registrations.py``@7.3.0: "group_type only
  supports 2"); ``transpose_x=True``, ``transpose_weight=False`` (the only case op-plugin's
  ``test/test_custom_ops/test_npu_grouped_matmul_add.py``@7.3.0 runs; ops-transformer
  ``gmm/grouped_matmul_add/README.md``: K-axis groups);
- x [K, M] and weight [K, N], both contiguous, float16 or bfloat16 alike; y float32, [E * M, N] (the upstream
  test's shape) (ops-transformer README: x / weight FLOAT16, BFLOAT16; y FLOAT32);
- ``group_list`` a 1-D int64 tensor of cumulative ends along K (the 7.x schema has no ``group_list_type``; the
  upstream test passes [256, 512]); from 26.0.0 ``group_list_type=0`` (cumulative) is the only one emulated;
- no autograd formula.

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
        raise RuntimeError("npu_grouped_matmul: group_type=2 (groups along K) with a transposed x is not a documented "
                           "case on Atlas A2/A3 (op-plugin's documentation of the op lists group_type -1 and 0, x "
                           "not transposed); the weight gradient's op is npu_grouped_matmul_add_")
    else:
        raise NotImplementedError(f"npu emulator: npu_grouped_matmul group_type {group_type} is not emulated")
    if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):
        out = _NoGrad.apply(out, a, w)
    return [out]


_ADD_DTYPES = (torch.float16, torch.bfloat16)


def grouped_matmul_add(release_has_group_list_type: bool) -> Any:
    """``npu_grouped_matmul_add_`` with the signature of a release (``group_list_type`` from 26.0.0)."""

    def npu_grouped_matmul_add_(y, x, weight, group_list, *, transpose_x=True, transpose_weight=False,
                                group_type=2, **extra):
        if extra and (not release_has_group_list_type or set(extra) != {"group_list_type"}):
            raise TypeError(f"npu_grouped_matmul_add_() got an unexpected keyword argument {next(iter(extra))!r}")
        if extra.get("group_list_type", 0) != 0:
            raise NotImplementedError("npu emulator: npu_grouped_matmul_add_ with group_list_type != 0 is not emulated")
        if group_type != 2:
            raise RuntimeError(f"group_type only supports 2, but got {group_type}")
        if not transpose_x or transpose_weight:
            raise NotImplementedError("npu emulator: npu_grouped_matmul_add_ is emulated with transpose_x=True, "
                                      "transpose_weight=False only (the documented case)")
        if x.dim() != 2 or weight.dim() != 2 or not x.is_contiguous() or not weight.is_contiguous():
            raise RuntimeError(f"npu_grouped_matmul_add_: x [K, M] and weight [K, N] must be 2-D and contiguous, got "
                               f"{tuple(x.shape)} and {tuple(weight.shape)}")
        if x.dtype not in _ADD_DTYPES or weight.dtype != x.dtype:
            raise RuntimeError(f"npu_grouped_matmul_add_: x {x.dtype} with weight {weight.dtype}: both must be float16 "
                               "or bfloat16, alike")
        if y.dtype != torch.float32 or not y.is_contiguous():
            raise RuntimeError(f"npu_grouped_matmul_add_: y must be a contiguous float32 tensor, got {y.dtype}")
        if x.shape[0] != weight.shape[0]:
            raise RuntimeError(f"npu_grouped_matmul_add_: x [K={x.shape[0]}, M] does not match weight "
                               f"[K={weight.shape[0]}, N]")
        sizes = _sizes(group_list, 0, x.shape[0], "K")
        m, n = x.shape[1], weight.shape[1]
        if y.dim() != 2 or tuple(y.shape) != (len(sizes) * m, n):
            raise RuntimeError(f"npu_grouped_matmul_add_: y must be [groups * M, N] = [{len(sizes) * m}, {n}], got "
                               f"{tuple(y.shape)}")
        out = y.view(len(sizes), m, n)
        start = 0
        for e, k in enumerate(sizes):
            out[e] += x[start:start + k].float().t() @ weight[start:start + k].float()
            start += k
        return y

    return npu_grouped_matmul_add_


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
