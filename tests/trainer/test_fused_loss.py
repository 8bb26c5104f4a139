"""``model.fused_loss``: the actor loss's per-token gradient taken inside the fused log-prob op's forward
(``Backend.linear_logprob_loss`` through ``policy_forward(loss_terms=...)``) gives the same log-probs and parameter
gradients as the fused log-probs followed by the loss through autograd, for both model families, packed and padded,
with an aggregation whose sequences span the op's chunks (seq-mean-token-mean), a KL and an entropy term; a run
with it trains as the run without; a recipe that cannot take it is refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tiny_policy import FAMILIES, fused_loss_step, tiny_model

from polyrl.backends.cpu import CpuBackend
from polyrl.core.tolerances import relative_error, tolerance


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("packed", [True, False])
def test_fused_loss_equals_the_fused_logprobs_then_the_loss(model, packed) -> None:
    loss_a, lp_a, ent_a, grads_a = fused_loss_step(model, CpuBackend(), packed, fused_loss=False)
    loss_b, lp_b, ent_b, grads_b = fused_loss_step(model, CpuBackend(), packed, fused_loss=True)
    bar, grad_bar = tolerance("algorithms.linear_logprobs", "float32"), tolerance("model.grads", "float32")
    for what, a, b in (("loss", loss_a, loss_b), ("logp", lp_a, lp_b), ("entropy", ent_a, ent_b)):
        assert relative_error(b, a) <= bar, what
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    worst = max(relative_error(grads_b[n], grads_a[n]) for n in grads_a)
    assert worst <= grad_bar, f"worst parameter gradient rel err {worst:.2e} > {grad_bar:.2e}"


def test_a_run_with_the_fused_loss_trains_as_without(tmp_path: Path, run_cli, read_metrics) -> None:
    rows = {}
    for on in (False, True):
        out = tmp_path / f"run_{on}"
        rc, _, err = run_cli(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), "rollout.engine=hf",
                              "model.fused_logprobs=true", f"model.fused_loss={str(on).lower()}",
                              "trainer.total_steps=3", "data.batch_size=4", "rollout.n=4",
                              "algorithm.mini_batch_size=8", "trainer.save_every=0"])
        assert rc == 0, err
        rows[on] = read_metrics(out)
    assert len(rows[True]) == len(rows[False]) == 3
    for a, b in zip(rows[False], rows[True]):
        assert a["reward/mean"] == b["reward/mean"]
        assert math.isclose(a["loss/total"], b["loss/total"], rel_tol=1e-4, abs_tol=1e-6), (a["loss/total"],
                                                                                           b["loss/total"])


def test_the_fused_loss_without_the_fused_path_is_refused(tmp_path: Path, run_cli) -> None:
    out = tmp_path / "run"
    rc, _, err = run_cli(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), "model.fused_logprobs=false",
                          "model.fused_loss=true", "trainer.total_steps=1"])
    assert rc == 2
    assert "model.fused_loss=true needs the fused log-prob path" in err and "Traceback" not in err


def test_auto_takes_the_fused_loss_where_the_backend_has_its_own_kernel() -> None:
    """The rule trainer and plan share: auto on the fused path only with a backend kernel of its own (the cpu
    backend's is the core reference, which recomputes the logits); true without the fused path is refused."""
    from polyrl.core.errors import BadInputError
    from polyrl.core.models.lm_head import uses_fused_loss
    from polyrl.core.plugins.registry import get_registry

    backends = get_registry().backends
    cpu, cuda = backends["cpu"], backends["cuda"]
    assert uses_fused_loss("auto", True, cuda) and not uses_fused_loss("auto", True, cpu)
    assert not uses_fused_loss("auto", False, cuda) and not uses_fused_loss(False, True, cuda)
    assert uses_fused_loss(True, True, cpu)
    with pytest.raises(BadInputError, match=r"model\.fused_loss=true needs the fused log-prob path"):
        uses_fused_loss(True, False, cuda)
