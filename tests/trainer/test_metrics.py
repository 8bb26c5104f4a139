"""The typed metrics of a step: each field names its metric, flattened once into a metrics.jsonl line."""

from __future__ import annotations

import dataclasses

from polyrl.core.trainer import metrics as M


def test_a_field_is_its_metric_and_none_is_left_out() -> None:
    actor = M.ActorMetrics(actor_pg_clipfrac=0.25, actor_pg_clipfrac_lower=0.0, actor_ppo_kl=1e-3,
                           actor_clipfrac_low=0.125, actor_clipfrac_high=0.5, actor_grad_norm=2.0, loss_policy=-0.5,
                           loss_total=-0.25, loss_kl=None)
    update = M.UpdateMetrics(critic=None, actor=actor, time_update_s=1.5)
    assert M.flatten(update) == {
        "actor/pg_clipfrac": 0.25, "actor/pg_clipfrac_lower": 0.0, "actor/ppo_kl": 1e-3, "actor/clipfrac_low": 0.125,
        "actor/clipfrac_high": 0.5, "actor/grad_norm": 2.0, "loss/policy": -0.5, "loss/total": -0.25,
        "time/update_s": 1.5}
    assert M.metric_name("dapo_overlong_penalty_mean") == "dapo/overlong_penalty_mean"


def test_every_namespace_is_one_the_logs_know() -> None:
    """The name of a field up to its first underscore is a namespace of metrics.jsonl (none has an underscore)."""
    known = {"reward", "response", "dapo", "prompt", "time", "batch", "rollout", "actor", "kl", "advantages", "critic",
             "loss", "train", "mismatch"}
    records = [M.RolloutMetrics, M.ViewMetrics, M.PrepareMetrics, M.MismatchMetrics, M.CriticMetrics, M.ActorMetrics,
               M.UpdateMetrics, M.StepMetrics]
    leaves = [f.name for r in records for f in dataclasses.fields(r)
              if f.name not in ("views", "prepare", "update", "critic", "actor", "sync", "memory", "mismatch")]
    assert {name.split("_", 1)[0] for name in leaves} == known
    assert all(M.metric_name(name).count("/") == 1 for name in leaves)
