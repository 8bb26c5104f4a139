"""The dry-run plan with expert parallelism: a rank gathers only its share of the experts, the all-to-all buffers
are counted, the DeepSeek-V3 PPO recipe is placed on 80-GB GPUs, and what blocks the 64-GB NPUs is named."""

from __future__ import annotations

import dataclasses
import json

import pytest

from polyrl.cli.dry_run import plan_backend
from polyrl.core.config import load_config
from polyrl.core.errors import BadInputError
from polyrl.core.plan import architecture_config, count_parameters, plan_memory
from polyrl.core.plan.placement import expert_parallel_sizes, find_placement

GIB = 2**30



def _with_ep(cfg, ep):
    return dataclasses.replace(cfg, sharding=dataclasses.replace(cfg.sharding, expert_parallel=ep))


def test_a_rank_gathers_only_its_experts_and_the_exchange_is_counted():
    cfg = load_config("deepseek_ppo")
    cuda = plan_backend("cuda")
    count = count_parameters(architecture_config(cfg)[0])
    assert count.num_experts == 256
    # one MoE layer of DeepSeek-V3: 256 experts x 3 x 7168 x 2048
    assert max(count.layer_experts) == 256 * 3 * 7168 * 2048
    plans = {ep: plan_memory(_with_ep(cfg, ep), cuda, nproc=8, nnodes=32) for ep in (1, 16)}
    for ep, plan in plans.items():
        layer = max(n - e + e // ep for n, e in zip(count.layer_params, count.layer_experts))
        expected = (count.root + 2 * layer) * 2 + layer * (2 + 4)  # bf16 gathered, bf16 + fp32 gradients
        assert plan.rows["gathered layers (FSDP2)"] == pytest.approx(expected / GIB)
    assert plans[16].rows["gathered layers (FSDP2)"] < plans[1].rows["gathered layers (FSDP2)"] / 5
    assert plans[16].rows["parameters"] == plans[1].rows["parameters"]  # the state is 1/world either way
    tokens, k, H = 4096, 8, 7168
    assert plans[16].rows["expert all-to-all buffers"] == pytest.approx(4 * tokens * k * H * 2 / GIB)
    assert "expert all-to-all buffers" not in plans[1].rows
    assert plans[16].fits and not plans[1].fits


def test_expert_parallel_must_divide_the_experts_and_needs_experts():
    cfg = load_config("deepseek_ppo", ["data.batch_size=48", "sharding.expert_parallel=3"])
    with pytest.raises(BadInputError, match="must divide the number of experts"):
        plan_memory(cfg, plan_backend("cuda"), nproc=8, nnodes=3)
    assert expert_parallel_sizes(24, 256) == [1, 2, 4, 8]
    assert expert_parallel_sizes(8, 0) == [1]


def test_deepseek_ppo_fits_on_256_gpus_with_the_recipes_ep(cli):
    rc, out, err = cli("recipes/deepseek_ppo.yaml", "--dry-run", "--backend", "cuda", "--nproc", "8", "--nnodes",
                       "32", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["config"]["sharding"]["expert_parallel"] == 16 and doc["memory_plan"]["fits"]
    assert set(doc["memory_plan"]["params"]) == {"actor", "reference", "critic"}
    assert "placement" not in doc


def test_too_few_gpus_print_the_smallest_placement(cli):
    rc, out, err = cli("recipes/deepseek_ppo.yaml", "--dry-run", "--backend", "cuda", "--nproc", "8", "--nnodes",
                       "4")
    assert rc == 2
    assert "# placement: smallest placement that fits: --nproc 8 --nnodes 32 (256 devices), " \
           "sharding.expert_parallel=16" in out
    [line] = [ln for ln in err.splitlines() if "error:" in ln]  # one line (after the absent data file's note)
    assert "smallest placement that fits: --nproc 8 --nnodes 32" in line


def test_npus_name_what_blocks_and_by_how_much():
    cfg = load_config("deepseek_ppo")
    placement = find_placement(cfg, plan_backend("ascend"), nproc=8)
    assert not placement.fits and placement.world_size == 256  # data.batch_size 256 caps the world
    text = placement.text()
    over = placement.plan.peak_gib - placement.plan.usable_gib
    assert over > 0 and f"{over:.1f} GiB over the device" in text
    assert "rollout KV cache" in text and "data.batch_size (256)" in text
    # a larger batch admits more devices, and the state they shrink is what was over
    bigger = find_placement(load_config("deepseek_ppo", ["data.batch_size=512"]), plan_backend("ascend"), nproc=8)
    assert bigger.fits and bigger.world_size == 512


def test_the_search_skips_expert_groups_the_collective_library_refuses(monkeypatch):
    """A collective library that refused world sizes 3, 5, 6, 7 (planted on the ascend backend: HCCL itself refuses
    none) would refuse ep=4 or 8 on 3 nodes of 8 (world 24: FSDP2 groups of 6 or 3): the search never plans them,
    and plans the other eps of that world."""
    from polyrl.core.plan import placement

    asked = []
    real = placement.plan_memory

    def recording(cfg, backend, **kw):
        asked.append((kw["nproc"] * kw["nnodes"], cfg.sharding.expert_parallel))
        return real(cfg, backend, **kw)

    monkeypatch.setattr(placement, "plan_memory", recording)
    cfg = load_config("deepseek_ppo", ["data.batch_size=24"])
    find_placement(cfg, plan_backend("ascend"), nproc=8, max_nodes=3, device_memory_gib=1)  # HCCL: no such rule
    assert {ep for world, ep in asked if world == 24} == {1, 2, 4, 8}
    asked.clear()
    refusing = plan_backend("ascend")
    policy = dataclasses.replace(refusing.sharding_policy(), world_sizes_refused=(3, 5, 6, 7),
                                 world_size_rule="the planted library refuses world sizes 3, 5, 6 and 7")
    monkeypatch.setattr(refusing, "sharding_policy", lambda: policy)
    find_placement(cfg, refusing, nproc=8, max_nodes=3, device_memory_gib=1)  # nothing fits
    at_24 = {ep for world, ep in asked if world == 24}
    assert at_24 == {1, 2}  # ep 4 and 8 (of 1, 2, 4, 8 dividing 24 and 256 experts) leave FSDP2 groups of 6 and 3
    asked.clear()
    find_placement(cfg, plan_backend("cuda"), nproc=8, max_nodes=3, device_memory_gib=1)  # NCCL has no such rule
    assert {ep for world, ep in asked if world == 24} == {1, 2, 4, 8}
