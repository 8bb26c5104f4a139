"""polyrl: RL post-training (PPO, GRPO, DAPO) with one recipe across CPU, NVIDIA GPUs and Ascend NPUs.

Importing polyrl is cheap and touches no device: backends are discovered lazily through the
``polyrl.backends`` entry-point group, and vendor modules (triton, torch_npu, vllm) are only imported
inside the functions that need them. The transformers attention registration ``"polyrl"`` is put in
place on import when transformers is installed (see :mod:`polyrl.core.attention.hf`).
"""

from __future__ import annotations

__version__ = "0.3.0"


def _install_moved_module_aliases() -> None:
    # Old module paths (polyrl.testing.parity, polyrl.core.backend, ...) stay importable, with a warning, for
    # one minor version: see polyrl/_moved.py.
    from polyrl import _moved

    _moved.install()


def _register_transformers_attention() -> None:
    # The registration must exist as soon as polyrl is imported, so that
    # from_pretrained(..., attn_implementation="polyrl") works without further calls.
    try:
        from polyrl.core.attention import hf as hf_attention
    except ImportError:  # transformers missing or module not built yet: nothing to register
        return
    hf_attention.register()


_install_moved_module_aliases()
_register_transformers_attention()
