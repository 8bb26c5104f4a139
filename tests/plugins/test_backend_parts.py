"""The Backend's parts: each answers for its concern with its own defaults, with a part subclass the backend names,
or with a 0.2-style override of the method on the Backend subclass (on the class, patched later, or set on the
object), and the 0.2 names on the Backend reach the same answers; ``super()`` in an override reaches the default."""

from __future__ import annotations

import pytest

from polyrl.core.errors import BadInputError
from polyrl.core.plugins.backend import PARTS as PARTS_OF_BACKEND
from polyrl.plugins import Availability, Backend, Placement, ShardingPolicy


class Plain(Backend):
    name = "plain"

    def detect(self) -> Availability:
        return Availability(True)


class OldStyle(Plain):
    name = "old"

    def sharding_policy(self) -> ShardingPolicy:
        return ShardingPolicy(world_sizes_refused=(5,), world_size_rule="old refuses 5")

    def process_group_options(self, local_rank: int = 0) -> dict:
        return {**super().process_group_options(local_rank), "old": local_rank}


class NewPlacement(Placement):
    def sharding_policy(self) -> ShardingPolicy:
        return ShardingPolicy(world_sizes_refused=(7,))


class NewStyle(Plain):
    name = "new"
    placement_part = NewPlacement


def test_every_part_method_is_a_backend_method_and_the_core_stays_small():
    for part, cls in PARTS_OF_BACKEND.items():
        for name in cls.methods:
            assert callable(getattr(Backend, name)), (part, name)
    core = {n for n, v in vars(Backend.__mro__[1]).items() if callable(v) and not n.startswith("_")}
    assert core == {"detect", "availability", "kernel_paths", "declaration_problems", "device", "bind_device",
                    "kernel", "varlen_attention", "logprobs", "linear_logprobs", "experts", "decode_attention",
                    "linear_logprob_loss",
                    "precompile"}


@pytest.mark.parametrize(("cls", "refused"), [(Plain, ()), (OldStyle, (5,)), (NewStyle, (7,))])
def test_the_part_and_the_0_2_name_give_one_answer(cls, refused):
    b = cls()
    assert b.placement.sharding_policy().world_sizes_refused == b.sharding_policy().world_sizes_refused == refused
    for size in refused:
        with pytest.raises(BadInputError, match=f"world size {size} is refused"):
            b.placement.check_world_size(size)  # the part's default reads the override
        with pytest.raises(BadInputError):
            b.check_world_size(size)
    b.placement.check_world_size(2)


def test_an_override_reaches_the_default_through_super_and_patches_are_seen():
    b = OldStyle()
    assert set(b.collectives.process_group_options(1)) == {"device_id", "old"} == set(b.process_group_options(1))
    b.memory_metrics = lambda: {"memory/x": 1.0}  # on the object
    assert b.placement.memory_metrics() == {"memory/x": 1.0}
    with pytest.MonkeyPatch.context() as m:  # on the class, after the part was built
        m.setattr(OldStyle, "rollout_engine_options", lambda self, engine: {"late": engine})
        assert b.engines.rollout_engine_options("hf") == {"late": "hf"}
    assert b.engines.rollout_engine_options("hf") == {}
    assert b.placement is b.placement and repr(b.placement) == "<Placement of backend 'old'>"
