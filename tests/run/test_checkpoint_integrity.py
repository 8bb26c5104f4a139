"""Checkpoint integrity in one process: what COMPLETE records, each damage named before any state is touched,
legacy markers, the earlier checkpoint that verifies, ``--resume-from`` and setting newer ones aside."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from polyrl.core.errors import BadInputError
from polyrl.core.run import checkpoint as C
from polyrl.core.run import integrity as I


def _state(seed: int = 0, width: int = 6) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt}


def _train(state: dict) -> None:
    loss = state["model"](torch.randn(4, state["model"][0].in_features)).pow(2).mean()
    loss.backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def _saved(root: Path, steps: tuple[int, ...] = (1, 2)) -> dict:
    state = _state()
    for step in steps:
        _train(state)
        C.save_checkpoint(root, step, state)
    return state


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


class _Boom:
    """A pickle that runs a shell command when loaded: what a planted checkpoint file would carry."""

    def __init__(self, witness: Path) -> None:
        self.witness = witness

    def __reduce__(self):
        return (os.system, (f"touch {self.witness}",))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "planted metadata pickle": (".metadata", lambda p, w: p.write_bytes(pickle.dumps(_Boom(w)))),
    "planted extra-state pickle": ("extra/rank_0.pt", lambda p, w: torch.save({"rng": _Boom(w)}, p)),
    "truncated shard": ("__0_0.distcp", lambda p, w: os.truncate(p, 1000)),
    "missing rank file": ("extra/rank_0.pt", lambda p, w: p.unlink()),
    "flipped byte in a shard": ("__0_0.distcp", lambda p, w: _flip(p, p.stat().st_size // 2)),
}


def test_marker_records_size_and_digest_of_every_file_hashed_while_writing(tmp_path: Path, monkeypatch) -> None:
    def no_read_back(path: Path) -> dict:
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr(I, "digest_file", no_read_back)
    _saved(tmp_path, (1,))
    step_dir = tmp_path / "step_00000001"
    marker = json.loads((step_dir / "COMPLETE").read_text())
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()} - {"COMPLETE"}
    assert set(marker["files"]) == on_disk == {".metadata", "__0_0.distcp", "extra/rank_0.pt"}
    for name, record in marker["files"].items():
        data = (step_dir / name).read_bytes()
        assert record == {"size": len(data), "digest": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_each_damage_is_refused_in_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    _saved(tmp_path)
    name, damage = DAMAGE[case]
    witness = tmp_path.parent / f"{tmp_path.name}-ran"
    damage(tmp_path / "step_00000002" / name, witness)
    before = tree(tmp_path)
    fresh = _state(seed=7)
    weights = [p.detach().clone() for p in fresh["model"].parameters()]
    with pytest.raises(BadInputError) as info:
        C.load_latest_checkpoint(tmp_path, fresh)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / "step_00000002" / name) + ": ")
    assert "the newest earlier checkpoint that verifies is step_00000001" in msg
    assert "--resume-from step_00000001" in msg
    assert not witness.exists()  # the payload never ran
    assert tree(tmp_path) == before  # nothing on disk changed
    assert all(torch.equal(a, b) for a, b in zip(weights, fresh["model"].parameters()))  # no state touched


def test_what_is_wrong_is_said(tmp_path: Path) -> None:
    _saved(tmp_path, (1,))
    step = tmp_path / "step_00000001"
    os.truncate(step / "__0_0.distcp", 1000)
    with pytest.raises(BadInputError, match=r"__0_0\.distcp: truncated: 1000 bytes on disk, \d+ were written; "
                                            "no earlier checkpoint verifies and fits this run: to start over"):
        C.load_latest_checkpoint(tmp_path, _state())
    _saved(tmp_path / "b", (1,))
    _flip(tmp_path / "b" / "step_00000001" / "__0_0.distcp", 100)
    with pytest.raises(BadInputError, match=r"__0_0\.distcp: checksum mismatch"):
        C.load_latest_checkpoint(tmp_path / "b", _state())
    _saved(tmp_path / "c", (1,))
    marker = tmp_path / "c" / "step_00000001" / "COMPLETE"
    marker.write_text(marker.read_text().replace('"world_size": 1', '"world_size": 2'))
    with pytest.raises(BadInputError, match=r"COMPLETE: corrupt \(its own checksum"):
        C.load_latest_checkpoint(tmp_path / "c", _state())
    _saved(tmp_path / "d", (1,))
    (tmp_path / "d" / "step_00000001").rename(tmp_path / "d" / "step_00000003")  # copied under another name
    with pytest.raises(BadInputError, match=r"step_00000003/COMPLETE: records step 1, not this directory's step 3"):
        C.load_latest_checkpoint(tmp_path / "d", _state())


def test_a_checkpoint_of_another_model_is_refused_before_loading(tmp_path: Path) -> None:
    _saved(tmp_path, (1,))
    with pytest.raises(BadInputError, match=r"\.metadata: entry 'model\.0\.weight' is \[6, 6\] in the checkpoint "
                                            r"and \[8, 8\] in this run"):
        C.load_latest_checkpoint(tmp_path, _state(width=8))
    other = {"model": nn.Sequential(nn.Linear(6, 3))}
    with pytest.raises(BadInputError, match=r"\.metadata: has no entry 'critic\.0\.weight' \(and 3 more\) that this run needs"):
        C.load_latest_checkpoint(tmp_path, {"model": other["model"], "critic": _state()["model"]})


def _strip_records(step_dir: Path) -> None:
    marker = json.loads((step_dir / "COMPLETE").read_text())
    (step_dir / "COMPLETE").write_text(json.dumps({k: marker[k] for k in ("step", "world_size", "time")}))


def test_legacy_checkpoints_load_and_get_the_checks_that_remain(tmp_path: Path) -> None:
    saved = _saved(tmp_path, (1, 2))
    for step in (1, 2):
        _strip_records(tmp_path / C.step_dirname(step))
    fresh = _state(seed=3)
    assert C.load_latest_checkpoint(tmp_path, fresh) == 2
    assert all(torch.equal(a, b) for a, b in zip(saved["model"].parameters(), fresh["model"].parameters()))
    shard = tmp_path / "step_00000002" / "__0_0.distcp"
    full = shard.stat().st_size
    os.truncate(shard, 1000)  # found from DCP's own index of byte ranges
    with pytest.raises(BadInputError, match=r"__0_0\.distcp: truncated: 1000 bytes on disk, the checkpoint's "
                                            r"index needs \d+; .*--resume-from step_00000001"):
        C.load_latest_checkpoint(tmp_path, _state())
    assert full > 1000
    (tmp_path / "step_00000001" / "extra" / "rank_0.pt").unlink()
    with pytest.raises(BadInputError, match=r"step_00000001/extra/rank_0\.pt: missing"):
        C.load_latest_checkpoint(tmp_path, _state(), resume_from="1")


def test_resume_from_an_earlier_checkpoint_sets_newer_ones_aside(tmp_path: Path) -> None:
    _saved(tmp_path, (1, 2, 3))
    expected = _state()
    C.load_checkpoint(tmp_path / "step_00000002", expected)
    _flip(tmp_path / "step_00000003" / "__0_0.distcp", 50)
    with pytest.raises(BadInputError, match="step_00000002"):
        C.load_latest_checkpoint(tmp_path, _state())
    fresh = _state(seed=5)
    assert C.load_latest_checkpoint(tmp_path, fresh, resume_from="step_00000002") == 2
    assert all(torch.equal(a, b) for a, b in zip(expected["model"].parameters(), fresh["model"].parameters()))
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [1, 2]  # the next plain resume takes step 2
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and (aside[0] / "step_00000003" / "COMPLETE").is_file()  # kept, not deleted
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"


@pytest.mark.parametrize("spec", ["2", "step_2", "step_00000002", "PATH"])
def test_resume_from_spellings(tmp_path: Path, spec: str) -> None:
    _saved(tmp_path, (1, 2))
    spec = str(tmp_path / "step_00000002") if spec == "PATH" else spec
    assert C.resolve_resume_from(tmp_path, spec) == tmp_path / "step_00000002"


def test_resume_from_what_is_not_there_is_bad_input(tmp_path: Path) -> None:
    _saved(tmp_path, (1,))
    with pytest.raises(BadInputError, match=r"no complete checkpoint step_00000005 .*complete ones: step_00000001"):
        C.load_latest_checkpoint(tmp_path, _state(), resume_from="step_5")
    with pytest.raises(BadInputError, match="not a checkpoint of this run"):
        C.resolve_resume_from(tmp_path, str(tmp_path.parent / "elsewhere" / "step_00000001"))


def test_launcher_check_refuses_in_one_line_and_spares_the_workers_the_digests(tmp_path: Path, monkeypatch) -> None:
    """``polyrl run --nproc N`` verifies in the launcher (``check_resume``) before any worker starts; the
    workers then skip the digests of that same checkpoint, never the other checks."""
    monkeypatch.delenv(C.VERIFIED_ENV, raising=False)
    _saved(tmp_path, (1, 2))
    _flip(tmp_path / "step_00000002" / "__0_0.distcp", 10)
    with pytest.raises(BadInputError, match=r"step_00000002/__0_0\.distcp: checksum mismatch.*--resume-from "
                                            r"step_00000001"):
        C.check_resume(tmp_path)
    assert C.VERIFIED_ENV not in os.environ
    C.check_resume(tmp_path, "step_1")
    hashed: list[Path] = []
    monkeypatch.setattr(I, "_check_digest", lambda path, record, algorithm: hashed.append(path))
    C.verify_checkpoint(tmp_path / "step_00000001")
    assert hashed == []  # verified by the launcher: same directory, same marker
    C.verify_checkpoint(tmp_path / "step_00000002")
    assert len(hashed) == 3  # another checkpoint: hashed
    os.truncate(tmp_path / "step_00000001" / "__0_0.distcp", 100)
    with pytest.raises(BadInputError, match="truncated"):  # sizes are still checked
        C.verify_checkpoint(tmp_path / "step_00000001")
