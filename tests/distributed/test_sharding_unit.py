"""Sharding helpers in one process: layer discovery, backend quirks, grad-norm clipping, launcher argv."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import nn

from polyrl.backends.ascend import AscendBackend
from polyrl.backends.cpu import CpuBackend
from polyrl.backends.cuda import CudaBackend
from polyrl.core import distributed as D
from polyrl.core.config import ShardingConfig, load_config
from polyrl.core.distributed.launch import strip_nproc, torchrun_command
from polyrl.core.distributed.sharding import (
    apply_sharding,
    check_placement,
    check_sharding,
    clip_grad_norm,
    decoder_layers,
    sharding_policy,
)
from polyrl.core.dtypes import compute_dtype
from polyrl.core.errors import BadInputError


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.lm_head = nn.Linear(4, 2)


def test_decoder_layers_found_at_hf_path() -> None:
    m = Wrapped()
    assert decoder_layers(m) == list(m.model.layers)


def test_decoder_layers_found_by_no_split_class_name() -> None:
    class Block(nn.Linear):
        pass

    m = nn.Sequential(Block(2, 2), nn.ReLU(), Block(2, 2))
    m._no_split_modules = ["Block"]
    assert decoder_layers(m) == [m[0], m[2]]


def test_no_process_group_means_no_sharding() -> None:
    m = Wrapped()
    assert apply_sharding(m, CpuBackend()) is m
    assert not any(type(x).__name__.startswith("FSDP") for x in m.modules())


class _RefusingWorldSizes(AscendBackend):
    """A collective library that refuses world sizes 3, 5, 6, 7 (planted: HCCL itself refuses none, its
    ProcessGroupHCCL.cpp has no such check)."""

    def sharding_policy(self):
        import dataclasses

        return dataclasses.replace(super().sharding_policy(), world_sizes_refused=(3, 5, 6, 7),
                                   world_size_rule="the planted library refuses world sizes 3, 5, 6 and 7")


def test_backend_quirks_refused_with_a_message() -> None:
    with pytest.raises(BadInputError, match="cpu_offload"):
        check_sharding(CpuBackend(), 2, ShardingConfig(cpu_offload=True))
    with pytest.raises(BadInputError, match="world size 3"):
        check_sharding(_RefusingWorldSizes(), 3, ShardingConfig())
    check_sharding(AscendBackend(), 3, ShardingConfig())  # HCCL refuses no world size
    check_sharding(AscendBackend(), 4, ShardingConfig(cpu_offload=True))
    check_sharding(CudaBackend(), 3, ShardingConfig(cpu_offload=True))


def test_placement_is_refused_in_one_place() -> None:
    cfg = load_config("gpt_oss_dapo_tiny.yaml", ["data.batch_size=6"])
    check_placement(cfg, CpuBackend(), 3)
    with pytest.raises(BadInputError, match=r"data.batch_size \(6\) must be a multiple of the world size \(4 "):
        check_placement(cfg, CpuBackend(), 4)
    with pytest.raises(BadInputError, match="world size 3"):  # the backend's refusal, through the same call
        check_placement(cfg, _RefusingWorldSizes(), 3)
    cfg.sharding.cpu_offload = True
    with pytest.raises(BadInputError, match="cpu_offload"):
        check_placement(cfg, CpuBackend(), 2)


def test_env_defaults_do_not_override_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "300")
    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    applied = D.apply_env_defaults(AscendBackend())
    assert applied == {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    import os

    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "300"


@pytest.mark.parametrize("max_norm", [None, 0.1, 100.0])
def test_clip_grad_norm_matches_torch(max_norm: float | None) -> None:
    torch.manual_seed(0)
    a, b = Wrapped(), Wrapped()
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 4)
    for m in (a, b):
        m.lm_head(torch.stack([layer(x) for layer in m.model.layers]).sum(0)).pow(2).sum().backward()
    ours = clip_grad_norm(a.parameters(), max_norm)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), max_norm if max_norm else float("inf"))
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_single_process_helpers_are_identity() -> None:
    assert (D.get_rank(), D.get_world_size(), D.is_main_process()) == (0, 1, True)
    assert D.all_reduce_metrics({"a": 1.5, "b": 2}) == {"a": 1.5, "b": 2.0}
    assert D.broadcast_object("x") == "x"
    assert D.rank_slice(8, 1, 2) == slice(4, 8)
    with pytest.raises(BadInputError, match="evenly"):
        D.rank_slice(7, 0, 2)


def test_under_torchrun_reads_the_environment() -> None:
    assert D.under_torchrun({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert not D.under_torchrun({})


def test_launcher_command_strips_nproc() -> None:
    argv = ["run", "r.yaml", "--nproc", "2", "--seed=3", "--nproc=4", "a.b=1"]
    assert strip_nproc(argv) == ["run", "r.yaml", "--seed=3", "a.b=1"]
    cmd = torchrun_command(argv, 2)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[-6:] == ["-m", "polyrl", "run", "r.yaml", "--seed=3", "a.b=1"]
    with pytest.raises(BadInputError):
        torchrun_command(argv, 0)


def test_run_nproc_refuses_bad_input_before_launching(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    from polyrl.cli import main as cli_main

    out = tmp_path / "never"
    assert cli_main(["run", "gpt_oss_dapo_tiny.yaml", "--nproc", "3", "--output", str(out)]) == 2
    assert "data.batch_size (64) must be a multiple of" in capsys.readouterr().err
    assert cli_main(["run", "gpt_oss_dapo_tiny.yaml", "--nproc", "2", "no.such=1", "--output", str(out)]) == 2
    assert not out.exists()


def test_the_recipe_sets_the_mixed_precision_dtypes() -> None:
    for backend in (CpuBackend(), CudaBackend(), AscendBackend()):
        own = backend.sharding_policy()
        assert sharding_policy(backend, ShardingConfig()) == own  # null: the backend's policy as it is
        mixed = sharding_policy(backend, ShardingConfig(param_dtype="bfloat16", reduce_dtype="bfloat16"))
        assert (mixed.param_dtype, mixed.reduce_dtype) == ("bfloat16", "bfloat16")
        assert dataclasses.replace(mixed, param_dtype=own.param_dtype, reduce_dtype=own.reduce_dtype) == own
    with pytest.raises(BadInputError, match=r"sharding.param_dtype: expected one of .* got str 'fp8'"):
        load_config("gpt_oss_dapo_tiny.yaml", ["sharding.param_dtype=fp8"])


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo_tiny.yaml", "deepseek_ppo_tiny.yaml", "deepseek_ppo_tiny_vllm.yaml"])
def test_the_tiny_recipes_compute_alike_at_any_process_count(recipe: str) -> None:
    """One process never shards (it computes in model.dtype); a sharded run computes in the FSDP2 param_dtype. The
    tiny recipes pin it to their model.dtype, so --nproc 2 is the 1-process numerics on every backend (bf16 compute
    made gpt_oss_dapo_tiny plateau on 2 processes: docs/distributed.md, "Mixed precision")."""
    cfg = load_config(recipe)
    for backend in (CpuBackend(), CudaBackend(), AscendBackend()):
        policy = sharding_policy(backend, cfg.sharding)
        assert compute_dtype(cfg.model.dtype, policy.param_dtype, sharded=True) == cfg.model.dtype, backend.name


_GATHER_DTYPE = """
import torch, torch.distributed as dist
from torch import nn
from polyrl.backends.cpu import CpuBackend
from polyrl.core.config import ShardingConfig
from polyrl.core.distributed.sharding import apply_sharding

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for param_dtype in (None, "bfloat16"):
    m = nn.Module()
    m.model = nn.Module()
    m.model.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
    apply_sharding(m, CpuBackend(), ShardingConfig(param_dtype=param_dtype))
    print(param_dtype, m.model.layers[0](torch.randn(2, 4)).dtype, m.model.layers[0].weight.dtype)
dist.destroy_process_group()
"""


def test_fsdp2_gathers_parameters_in_the_recipes_param_dtype() -> None:
    """In a process of its own: a process group left in the test process would be inherited by the reward pool's
    forked workers, whose copy of it crashes there (its threads do not survive the fork)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _GATHER_DTYPE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # the output dtype is the gathered parameters'; the sharded master weights stay float32 either way
    assert out.stdout.split("\n")[:2] == ["None torch.float32 torch.float32", "bfloat16 torch.bfloat16 torch.float32"]
