"""The collectives part of a backend: where tensors handed to a collective live, how the process group is set
up, and the exchanges of an expert-parallel MoE layer.

The MoE layers of an expert-parallel model (``sharding.expert_parallel`` > 1) send each token to the ranks holding
its experts and bring the results back through ``all_to_all``, ``expert_dispatch`` and ``expert_combine``. The
defaults are torch.distributed's ``all_to_all_single`` with variable split sizes (NCCL, HCCL and gloo all have it)
and the permutations of polyrl.core.plugins.expert_exchange around it; a backend with a fused MoE
dispatch/combine (one kernel that permutes and communicates) overrides ``expert_dispatch`` and ``expert_combine``
together, keeping their contract (that module's ``dispatch`` / ``combine``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from polyrl.core.plugins.part import BackendPart

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from polyrl.core.plugins.expert_exchange import ExpertDispatch


class Collectives(BackendPart):
    """The process group's set-up and the expert all-to-all. Reached as ``backend.collectives``; the library's
    name is the backend's ``collective_backend``."""

    methods: ClassVar[tuple[str, ...]] = ("comm_device", "process_group_options", "all_to_all", "expert_dispatch",
                                          "expert_combine")

    def comm_device(self, local_rank: int = 0) -> torch.device:
        """Where tensors handed to a collective must live (nccl/hccl reduce device memory only)."""
        return self.backend.device(local_rank)

    def process_group_options(self, local_rank: int = 0) -> dict[str, Any]:
        """Extra ``init_process_group`` arguments: by default the bound device (eager connection set-up)."""
        return {"device_id": self.backend.device(local_rank)}

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        group: ProcessGroup | None = None,
    ) -> None:
        """``output`` <- the rows every rank of ``group`` sends this one: row block r of ``input`` (sizes
        ``input_split_sizes``, None: equal) goes to rank r; blocks arrive in rank order (``output_split_sizes``).
        Not differentiable by itself (the MoE layer wraps it in autograd)."""
        import torch.distributed as dist

        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)

    def expert_dispatch(self, hidden: torch.Tensor, expert_ids: torch.Tensor, *, num_experts: int,
                        group: ProcessGroup | None = None) -> ExpertDispatch:
        """Send each of the ``k`` copies of every token (hidden [T, H], expert_ids [T, k] global expert indices) to
        the rank of ``group`` holding its expert (rank r holds experts [r * E/ep, (r + 1) * E/ep)). Returns an
        ``ExpertDispatch``: the rows this rank's experts must compute, grouped by local expert in ascending order,
        with their local expert ids, and what ``expert_combine`` needs to bring them back. Differentiable in
        ``hidden``. ``group`` None: one rank holds every expert (the rows are only permuted)."""
        from polyrl.core.plugins import expert_exchange  # torch: imported when a MoE layer first runs

        return expert_exchange.dispatch(self.all_to_all, hidden, expert_ids, num_experts=num_experts, group=group)

    def expert_combine(self, expert_out: torch.Tensor, dispatched: ExpertDispatch,
                       weights: torch.Tensor) -> torch.Tensor:
        """The inverse of ``expert_dispatch``: ``expert_out`` (one row per dispatched row, in its order) goes back
        to the tokens' ranks, where each token's ``k`` rows are weighted by ``weights`` [T, k] and summed, in
        fp32 or wider when ``weights`` is, into [T, H] of the tokens' dtype. Differentiable in both tensors."""
        from polyrl.core.plugins import expert_exchange

        return expert_exchange.combine(self.all_to_all, expert_out, dispatched, weights)
