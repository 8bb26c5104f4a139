"""``model.fused_loss`` on the GPU (part of ``bash bench/gpu_check.sh``): the cuda backend's fused loss op
(``cublas_linear_logprob_loss``: cuBLAS matmuls, Triton epilogues) inside ``policy_forward`` gives the loss, log-probs
and every parameter gradient of the fused log-probs followed by the loss through autograd, for both tiny model
families built on the cuda backend (its Triton attention); and a short ``polyrl run --backend cuda`` with it trains as
the run without. fp32, as the tiny recipes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny_policy import FAMILIES, fused_loss_step

from polyrl.core.tolerances import relative_error, tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_fused_loss_equals_the_fused_logprobs_then_the_loss(family) -> None:
    from polyrl.core.models import build_model
    from polyrl.core.plugins.selection import resolve_backend

    backend = resolve_backend("cuda")
    torch.manual_seed(0)
    model = build_model(family, vocab_size=17, seed=0, backend=backend).to("cuda")
    loss_a, lp_a, ent_a, grads_a = fused_loss_step(model, backend, True, fused_loss=False)
    loss_b, lp_b, ent_b, grads_b = fused_loss_step(model, backend, True, fused_loss=True)
    bar, grad_bar = tolerance("algorithms.linear_logprobs", "float32"), tolerance("model.grads", "float32")
    for what, a, b in (("loss", loss_a, loss_b), ("logp", lp_a, lp_b), ("entropy", ent_a, ent_b)):
        assert relative_error(b, a) <= bar, (what, relative_error(b, a))
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    worst = max(relative_error(grads_b[n], grads_a[n]) for n in grads_a)
    assert worst <= grad_bar, f"worst parameter gradient rel err {worst:.2e} > {grad_bar:.2e}"


def test_a_gpu_run_with_the_fused_loss_trains_as_without(tmp_path: Path) -> None:
    from polyrl.cli import main as polyrl_main
    from polyrl.core.plugins.selection import reset_active_backend

    rows = {}
    for on in (False, True):
        out = tmp_path / f"run_{on}"
        reset_active_backend()
        rc = polyrl_main(["run", "recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), "--backend", "cuda",
                          "--no-progress", "model.fused_logprobs=true", f"model.fused_loss={str(on).lower()}",
                          "trainer.total_steps=2", "trainer.save_every=0"])
        assert rc == 0
        rows[on] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows[True]) == len(rows[False]) == 2
    # step 1 samples from the same weights: the same rollout, the same loss up to the op's rounding
    a, b = rows[False][0], rows[True][0]
    assert a["reward/mean"] == b["reward/mean"]
    assert math.isclose(a["loss/total"], b["loss/total"], rel_tol=1e-4, abs_tol=1e-6), (a["loss/total"], b["loss/total"])
    assert all(math.isfinite(r["actor/grad_norm"]) for r in rows[True] if "actor/grad_norm" in r)
