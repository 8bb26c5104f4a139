"""The smallest placement of a recipe: how many nodes and which expert parallelism make its memory plan fit.

``polyrl run RECIPE --dry-run --nproc N`` calls :func:`find_placement` when the plan of the placement asked for
does not fit: with N devices per node, it tries 1, 2, ... nodes and, on each world size, every expert-parallel
size ``ep`` that divides both the world size and the number of experts (smallest first: fewer ranks in each
all-to-all), skipping the world sizes a run refuses (``check_placement``: the backend's collective library,
``data.batch_size`` in equal shares), planning each with :func:`polyrl.core.plan.memory.plan_memory`, and returns the first that fits.
When none fits up to ``max_nodes``, it names what does not shrink with more devices (activations, gathered
layers, the rollout's buffers) and by how much it exceeds the device.

A recipe whose ``sharding.expert_parallel`` a run refuses on N devices (it does not divide N) is planned at the
nearest ep that it accepts there (:func:`nearest_expert_parallel`), then the same search runs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from polyrl.core.config import RunConfig
from polyrl.core.distributed.sharding import check_placement
from polyrl.core.errors import BadInputError
from polyrl.core.plan.memory import MemoryPlan, architecture_config, count_parameters, plan_memory

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend

MAX_NODES = 128


@dataclasses.dataclass
class Placement:
    nproc: int
    nnodes: int
    expert_parallel: int
    plan: MemoryPlan
    fits: bool
    notes: list[str]

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def text(self) -> str:
        mesh = (f"sharding.expert_parallel={self.expert_parallel} (ep {self.expert_parallel} x FSDP2 "
                f"{self.world_size // self.expert_parallel} for the experts)" if self.expert_parallel > 1
                else "no expert parallelism")
        head = (f"smallest placement that fits: --nproc {self.nproc} --nnodes {self.nnodes} "
                f"({self.world_size} devices), {mesh}: peak {self.plan.peak_gib:.1f} of "
                f"{self.plan.usable_gib:.1f} GiB usable")
        if not self.fits:
            head = (f"no placement fits: the largest a run accepts, --nproc {self.nproc} --nnodes {self.nnodes} "
                    f"({self.world_size} devices) with {mesh}, needs {self.plan.peak_gib:.1f} GiB of "
                    f"{self.plan.usable_gib:.1f} usable")
        return "\n".join([head, *self.notes])

    def to_dict(self) -> dict[str, Any]:
        return {"nproc": self.nproc, "nnodes": self.nnodes, "world_size": self.world_size,
                "expert_parallel": self.expert_parallel, "fits": self.fits, "peak_gib": round(self.plan.peak_gib, 3),
                "usable_gib": round(self.plan.usable_gib, 3), "notes": self.notes}


def expert_parallel_sizes(world: int, num_experts: int) -> list[int]:
    """Every ep that divides both the world size and the number of experts (1 first)."""
    if num_experts <= 0:
        return [1]
    return [ep for ep in range(1, min(world, num_experts) + 1) if world % ep == 0 and num_experts % ep == 0]


def blocking_items(plan: MemoryPlan) -> list[str]:
    """The items of the plan's peak phase that more devices do not shrink, largest first, and the excess."""
    phase = max(plan.phases, key=lambda k: plan.phases[k])
    fixed = plan.rows.fixed()
    over = plan.peak_gib - plan.usable_gib
    items = ", ".join(f"{k} {v:.1f} GiB" for k, v in sorted(fixed.items(), key=lambda kv: -kv[1])[:4])
    lines = [f"peak phase {phase}: {over:.1f} GiB over the device; what more devices do not shrink: {items}"]
    state = plan.rows.sharded_gib()
    lines.append(f"sharded state left at {plan.world_size} devices: {state:.1f} GiB")
    return lines


def _with_ep(cfg: RunConfig, ep: int) -> RunConfig:
    return dataclasses.replace(cfg, sharding=dataclasses.replace(cfg.sharding, expert_parallel=ep))


def nearest_expert_parallel(cfg: RunConfig, backend: Backend, world: int) -> RunConfig | None:
    """When ``sharding.expert_parallel`` is what makes a run refuse ``world`` devices (it does not divide the world
    size or the number of experts, or the backend refuses its groups): ``cfg`` with the nearest ep a run accepts
    there (ties: the larger, fewer experts per device). None when the refusal is not the ep's (another ep would be
    refused too) or the recipe asks for none."""
    asked = cfg.sharding.expert_parallel
    if asked <= 1:
        return None
    config, _ = architecture_config(cfg)
    num_experts = count_parameters(config).num_experts
    for ep in sorted(expert_parallel_sizes(world, num_experts), key=lambda ep: (abs(ep - asked), -ep)):
        if ep == asked:
            return None
        placed = _with_ep(cfg, ep)
        try:
            check_placement(placed, backend, world)
        except BadInputError:
            continue
        return placed
    return None


def find_placement(cfg: RunConfig, backend: Backend, *, nproc: int, max_nodes: int = MAX_NODES,
                   device_memory_gib: float | None = None, vocab_size: int | None = None) -> Placement:
    """The fewest nodes of ``nproc`` devices, then the smallest ep, whose memory plan fits (see the module
    docstring); when none does up to ``max_nodes``, the plan with the lowest peak there, with what blocks."""
    config, _ = architecture_config(cfg)
    num_experts = count_parameters(config).num_experts
    best: tuple[float, int, int, MemoryPlan] | None = None
    for nnodes in range(1, max_nodes + 1):
        world = nproc * nnodes
        for ep in expert_parallel_sizes(world, num_experts):
            placed = _with_ep(cfg, ep)
            try:  # what a run accepts: the collective library's group sizes (world, world / ep, ep), equal shares
                check_placement(placed, backend, world)
            except BadInputError:
                continue
            plan = plan_memory(placed, backend, nproc=nproc, nnodes=nnodes,
                               device_memory_gib=device_memory_gib, vocab_size=vocab_size)
            if plan.fits:
                return Placement(nproc, nnodes, ep, plan, True, [])
            if best is None or nnodes > best[1] or (nnodes == best[1] and plan.peak_gib < best[0]):
                best = (plan.peak_gib, nnodes, ep, plan)  # the largest admissible world, its lowest peak
    if best is None:
        raise BadInputError(f"no world size up to {max_nodes} nodes of {nproc} devices is accepted (backend "
                            f"{backend.name!r}, data.batch_size {cfg.data.batch_size})")
    _, nnodes, ep, plan = best
    notes = blocking_items(plan)
    if nnodes < max_nodes:
        notes.append(f"more devices are refused: data.batch_size ({cfg.data.batch_size}) must be a multiple of the "
                     f"world size (a larger batch admits more)")
    return Placement(nproc, nnodes, ep, plan, False, notes)
