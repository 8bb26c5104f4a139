"""Kernel slots: the kernels a backend may provide, the ``"module:function"`` path naming each, and how a path is
checked (from the source, without importing it) and resolved (imported).

A backend class names its kernels, it does not implement them: a slot left at its default runs polyrl's reference
implementation in core. A path is checked statically first (``static_kernel_problem``: vendor modules stay
unloaded while ``polyrl backends`` runs) and imported only when a kernel first runs (``resolve_kernel``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

# The kernels a backend may provide, the class attribute naming each, and the reference implementation in core
# that runs when the slot is left at its default.
# ``decode_attention`` and ``linear_logprob_loss`` (0.3) came last: a slot added later goes at the end, so the order
# plugins and ``polyrl backends --json`` readers saw stays a prefix.
KERNELS: tuple[str, ...] = ("varlen_attention", "logprobs", "linear_logprobs", "experts", "decode_attention",
                            "linear_logprob_loss")
KERNEL_SLOTS: dict[str, str] = {"varlen_attention": "attention_kernel", "logprobs": "logprobs_kernel",
                                "linear_logprobs": "linear_logprobs_kernel", "experts": "experts_kernel",
                                "decode_attention": "decode_attention_kernel",
                                "linear_logprob_loss": "linear_logprob_loss_kernel"}
REFERENCE_KERNELS: dict[str, str] = {
    "varlen_attention": "polyrl.core.attention.reference:reference_varlen_attention",
    "logprobs": "polyrl.core.algorithms.logprobs:logprobs_and_entropy",
    "linear_logprobs": "polyrl.core.algorithms.linear_logprobs:linear_logprobs_and_entropy",
    "experts": "polyrl.core.models.experts:reference_experts",
    "decode_attention": "polyrl.core.attention.reference:reference_decode_attention",
    "linear_logprob_loss": "polyrl.core.algorithms.linear_loss:linear_logprob_loss",
}


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """One layer's call of the varlen attention kernel, what ``Backend.precompile`` is handed: q [T, q_heads,
    head_dim], k [T, kv_heads, head_dim], v [T, kv_heads, v_head_dim]; ``window`` keys (None: full causal);
    learnable ``sinks`` or none. The token count T is never part of it. A model's layouts:
    ``polyrl.core.attention.layouts.attention_layouts(config)``."""

    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None
    sinks: bool = False


def one_line(exc: BaseException) -> str:
    """``"TypeError: first line of the message"``: how a plugin's error is reported."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _split_path(path: object) -> tuple[str, str] | None:
    if not isinstance(path, str):
        return None
    module, sep, func = path.partition(":")
    if not sep or not module or not func.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        return None
    return module, func


def _top_level_names(tree: ast.Module) -> tuple[set[str], bool]:
    """Names a module binds at top level (defs, classes, assignments, imports, also inside if/try), and whether
    it defines a module ``__getattr__`` (then any name may exist)."""
    names: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            stack += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                stack += handler.body
    return names, "__getattr__" in names


@functools.lru_cache(maxsize=256)
def static_kernel_problem(path: str) -> str:
    """What is wrong with a ``"module:function"`` kernel path, found without importing the module (vendor
    modules stay unloaded): the module must exist and bind ``function`` at top level. "" when nothing is."""
    parts = _split_path(path)
    if parts is None:
        return f"{path!r} is not a 'module:function' path"
    module, func = parts
    try:
        spec = importlib.util.find_spec(module)
    except Exception as exc:  # a parent package that fails to import
        return f"{path!r}: cannot look up module {module} ({one_line(exc)})"
    if spec is None:
        return f"{path!r}: no module named {module!r}"
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        return ""  # an extension or namespace module: only importing it can tell (resolve_kernel)
    try:
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=origin)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"{path!r}: cannot read {origin} ({one_line(exc)})"
    names, dynamic = _top_level_names(tree)
    if func not in names and not dynamic:
        return f"{path!r}: module {module} has no function {func!r}"
    return ""


def resolve_kernel(path: str) -> Callable[..., Any]:
    """Import ``"module:function"`` and return the function; ``ImportError`` with a one-line reason otherwise.
    Not cached here (checks call it to see the module as it is now); a backend keeps what it resolved for its
    kernels (``Backend.kernel``)."""
    parts = _split_path(path)
    if parts is None:
        raise ImportError(f"{path!r} is not a 'module:function' path")
    module, func = parts
    try:
        fn = getattr(importlib.import_module(module), func)
    except ImportError as exc:
        raise ImportError(f"{path!r}: cannot import {module} ({one_line(exc)})") from exc
    except AttributeError:
        raise ImportError(f"{path!r}: module {module} has no function {func!r}") from None
    if not callable(fn):
        raise ImportError(f"{path!r}: {func} is not callable")
    return fn
