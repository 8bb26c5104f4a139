"""The run's backend travels with the run: ``polyrl run`` resolves it once and binds it where models are built, so
nothing on its path (attention, MoE experts) reads the process-wide default; a direct call naming no backend
does, and resolves it once."""

from __future__ import annotations

import pytest

from polyrl.cli import main as polyrl_main
from polyrl.core.plugins import selection


def test_a_run_never_asks_for_the_default_backend(tmp_path, monkeypatch, capsys):
    selection.reset_active_backend()

    def refuse() -> None:
        raise AssertionError("the run path read the process-wide default backend")

    monkeypatch.setattr(selection, "default_backend", refuse)
    for recipe in ("gpt_oss_dapo_tiny", "deepseek_ppo_tiny"):  # attention with sinks and windows; MoE experts
        rc = polyrl_main(["run", f"recipes/{recipe}.yaml", "--output", str(tmp_path / recipe), "--no-progress",
                          "trainer.total_steps=1", "data.batch_size=4", "rollout.n=2"])
        assert rc == 0, capsys.readouterr().err
    assert selection._active is None  # nothing set it either


def test_a_call_naming_no_backend_resolves_the_default_once(monkeypatch):
    torch = pytest.importorskip("torch")
    from polyrl.core.attention import varlen_attention

    selection.reset_active_backend()
    calls = []
    real = selection.resolve_backend
    monkeypatch.setattr(selection, "resolve_backend", lambda name=None: calls.append(name) or real(name))
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for _ in range(3):
        varlen_attention(q, q, q, cu)
    assert calls == [None] and selection._active is selection.default_backend()
    selection.reset_active_backend()
