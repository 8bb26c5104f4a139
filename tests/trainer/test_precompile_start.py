"""polyrl.core.trainer.setup.start_precompile: the trainer hands the backend its models' attention layouts and the
dtypes they run in before it builds them, and logs what the backend says when the build waits for it."""

from __future__ import annotations

from pathlib import Path

import torch

from polyrl.backends.cpu import CpuBackend
from polyrl.core.attention.layouts import AttentionLayout
from polyrl.core.config.loader import load_config
from polyrl.core.trainer.setup import start_precompile

RECIPES = Path(__file__).resolve().parents[2] / "polyrl" / "recipes"


class _Recording(CpuBackend):
    def precompile(self, layouts, dtypes, device):
        self.got = (list(layouts), list(dtypes), device)
        return lambda: "precompile: 3 kernels"


def test_the_backend_gets_the_actors_layouts_and_dtype():
    backend = _Recording()
    cfg = load_config(RECIPES / "gpt_oss_dapo_tiny.yaml")
    wait = start_precompile(cfg, backend, torch.device("cpu"))
    assert wait() == "precompile: 3 kernels"
    layouts, dtypes, device = backend.got
    assert layouts == [AttentionLayout(4, 2, 32, 32, 16, True), AttentionLayout(4, 2, 32, 32, None, True)]
    assert dtypes == [torch.float32] and device == torch.device("cpu")


def test_ppo_adds_the_critics_layouts_and_overrides_reach_them():
    backend = _Recording()
    cfg = load_config(RECIPES / "deepseek_ppo_tiny.yaml", ["model.dtype=bfloat16", "model.overrides.v_head_dim=16"])
    start_precompile(cfg, backend, torch.device("cpu"))
    layouts, dtypes, _ = backend.got
    assert layouts == [AttentionLayout(4, 4, 48, 16)] and dtypes == [torch.bfloat16]  # actor's and critic's, once


def test_nothing_for_other_attention_or_a_model_that_cannot_be_read():
    backend = _Recording()
    cfg = load_config(RECIPES / "gpt_oss_dapo_tiny.yaml", ["model.attn_implementation=eager"])
    assert start_precompile(cfg, backend, torch.device("cpu")) is None
    cfg = load_config(RECIPES / "gpt_oss_dapo_tiny.yaml", ["model.name=no_such_model"])
    assert start_precompile(cfg, backend, torch.device("cpu")) is None  # build_models refuses it, in one line
    assert not hasattr(backend, "got")


def test_the_default_backend_compiles_nothing_ahead():
    cfg = load_config(RECIPES / "gpt_oss_dapo_tiny.yaml")
    assert start_precompile(cfg, CpuBackend(), torch.device("cpu")) is None


def test_a_build_that_fails_drops_the_compiles_not_started(monkeypatch):
    import pytest

    from polyrl.core.trainer import setup

    dropped = []

    def started(*args):
        def wait():
            raise AssertionError("waited for after a failed build")
        wait.cancel = lambda: dropped.append(True)
        return wait

    def failing_task(cfg):
        raise ValueError("task refused")

    monkeypatch.setattr(setup, "start_precompile", started)
    monkeypatch.setattr(setup, "build_task", failing_task)
    with pytest.raises(ValueError, match="task refused"):
        setup.build_components(load_config(RECIPES / "gpt_oss_dapo_tiny.yaml"), CpuBackend(), torch.device("cpu"))
    assert dropped == [True]
