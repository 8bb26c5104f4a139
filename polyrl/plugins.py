"""The stable surface for plugin authors: everything a backend, task or rollout-engine plugin imports, in one
place. Names here keep their meaning across minor versions; a name that moves or goes is first kept with a
DeprecationWarning for one minor version (the CHANGELOG says which). Modules under ``polyrl.core`` are the
implementation and may be reorganised.

A backend::

    from polyrl.plugins import Availability, Backend, ShardingPolicy, hookimpl

    class RocmBackend(Backend):
        name = "rocm"
        ...

    @hookimpl
    def polyrl_register_backends(register):
        register(RocmBackend)

and its test suite: ``run_conformance("rocm", dtype="bfloat16").ok`` (docs/plugins.md, "Conformance kit").

- declaring a backend: :class:`Backend` (the core protocol :class:`BackendCore` — identity, detection, devices,
  kernels — composed with four parts, each a class to subclass when a backend changes it: :class:`Placement`,
  :class:`Collectives`, :class:`EngineOptions`, :class:`Introspection`), :class:`Availability`,
  :class:`ShardingPolicy` (the backend's FSDP policy), :data:`CAPABILITIES` (the capability vocabulary),
  :data:`KERNELS` and :data:`REFERENCE_KERNELS` (the kernel slots and polyrl's reference implementation of each);
  a fused expert exchange returns ``polyrl.core.plugins.expert_exchange.ExpertDispatch`` (it imports torch);
- ``polyrl doctor`` rows: :class:`Compatibility`, :class:`Environment`, :class:`Problem`;
- hooks: :data:`hookimpl` marks ``polyrl_register_backends`` / ``polyrl_register_tasks`` /
  ``polyrl_register_rollout_engines``; :func:`register_plugin` adds a plugin without an entry point;
- tasks and engines: :class:`Task`, :class:`Example`; :class:`RolloutEngine`, :class:`RolloutOutput`,
  :class:`SamplingParams`;
- the conformance kit: :func:`run_conformance`, :func:`run_attention_case` over :data:`ATTENTION_CASES`,
  :func:`logprobs_check`, :func:`linear_logprobs_check`, :func:`linear_logprob_loss_check`.

Importing this module is cheap: no torch, no device, no vendor module.
"""

from polyrl.core.compat import Compatibility, Environment, Problem
from polyrl.core.plugins import (
    CAPABILITIES,
    ENTRY_POINT_GROUPS,
    KERNELS,
    Availability,
    Backend,
    BackendCore,
    Collectives,
    EngineOptions,
    Introspection,
    Placement,
    ShardingPolicy,
    hookimpl,
    list_backends,
    register_plugin,
    unregister_plugin,
)
from polyrl.core.plugins.kernels import REFERENCE_KERNELS
from polyrl.core.rollout.engine import RolloutEngine, RolloutOutput, SamplingParams
from polyrl.core.tasks import Example, Task
from polyrl.testing.conformance import (
    ATTENTION_CASES,
    AttentionCase,
    CaseResult,
    ConformanceReport,
    linear_logprob_loss_check,
    linear_logprobs_check,
    logprobs_check,
    run_attention_case,
    run_conformance,
)

__all__ = [
    "ATTENTION_CASES",
    "CAPABILITIES",
    "ENTRY_POINT_GROUPS",
    "KERNELS",
    "REFERENCE_KERNELS",
    "AttentionCase",
    "Availability",
    "Backend",
    "BackendCore",
    "CaseResult",
    "Collectives",
    "Compatibility",
    "ConformanceReport",
    "EngineOptions",
    "Environment",
    "Example",
    "Introspection",
    "Placement",
    "Problem",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "ShardingPolicy",
    "Task",
    "hookimpl",
    "linear_logprob_loss_check",
    "linear_logprobs_check",
    "list_backends",
    "logprobs_check",
    "register_plugin",
    "run_attention_case",
    "run_conformance",
    "unregister_plugin",
]
