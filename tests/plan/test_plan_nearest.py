"""A dry run whose recipe asks for an expert parallelism the world size refuses: still refused (exit 2, one line),
after the plan of the nearest placement a run accepts on those devices and the smallest placement that fits;
the plan's rows typed (the printed labels are the record's fields)."""

from __future__ import annotations

import json

import pytest

from polyrl.core.config import load_config
from polyrl.core.plan import plan_memory
from polyrl.core.plan.placement import nearest_expert_parallel
from polyrl.core.plan.rows import LABELS, PlanRows
from polyrl.core.plugins.registry import get_registry


def test_a_refused_expert_parallelism_prints_the_nearest_plan_and_the_smallest_that_fits(cli):
    rc, out, err = cli("recipes/deepseek_ppo.yaml", "--backend", "cuda", "--nproc", "8", "--dry-run")
    assert rc == 2 and "Traceback" not in err
    error = [line for line in err.splitlines() if line.startswith("polyrl run: error:")]
    assert len(error) == 1
    assert "sharding.expert_parallel=16 must divide the world size (8 processes" in error[0]
    assert "nearest accepted: sharding.expert_parallel=8" in error[0] and "smallest placement that fits" in error[0]
    assert "expert_parallel: 16" in out  # the recipe's own config is printed
    assert ("# sharding.expert_parallel=16 is refused on 8 device(s); the plan below is the nearest placement a run "
            "accepts: sharding.expert_parallel=8") in out
    assert "# memory plan: cuda" in out and "groups of 8 ranks, 32 of 256 experts" in out
    assert "# placement: smallest placement that fits: --nproc 8 --nnodes 32 (256 devices)" in out


def test_the_json_form_says_what_was_refused(cli):
    rc, out, _ = cli("recipes/deepseek_ppo.yaml", "--backend", "cuda", "--nproc", "8", "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 2 and doc["config"]["sharding"]["expert_parallel"] == 16
    assert "must divide the world size" in doc["refused"] and doc["memory_plan"]["expert_parallel"] == 8
    assert doc["placement"]["fits"] and doc["placement"]["world_size"] == 256


def test_the_nearest_is_none_when_the_ep_is_not_what_is_refused():
    cuda = get_registry().backends["cuda"]
    cfg = load_config("recipes/deepseek_ppo.yaml", [])
    assert nearest_expert_parallel(cfg, cuda, 16) is None  # 16 divides 16: nothing to correct
    assert nearest_expert_parallel(cfg, cuda, 8).sharding.expert_parallel == 8
    assert nearest_expert_parallel(load_config("recipes/deepseek_ppo.yaml", ["sharding.expert_parallel=1"]),
                                   cuda, 8) is None


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo_tiny", "deepseek_ppo_tiny"])
def test_the_rows_are_a_typed_record_read_by_label(recipe):
    plan = plan_memory(load_config(f"recipes/{recipe}.yaml", []), get_registry().backends["cpu"], nproc=2)
    rows = plan.rows
    assert isinstance(rows, PlanRows)
    assert rows["gathered layers (FSDP2)"] == rows.gathered_layers > 0
    assert list(rows)[:4] == [LABELS[f] for f in ("parameters", "gradients", "optimizer_state", "master_weights")]
    assert "expert all-to-all buffers" not in rows and rows.expert_buffers is None
    with pytest.raises(KeyError):
        rows["expert all-to-all buffers"]
    assert rows.sharded_gib() == pytest.approx(rows.parameters * 4 + rows.reference_model + rows.critic_state)
