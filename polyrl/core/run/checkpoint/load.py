"""Loading a checkpoint: verified first, then DCP state (resharded to this world size) and each rank's extra state;
the resume choice (the newest complete checkpoint, or the one ``--resume-from`` names) made by rank 0 for all."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyrl.core import distributed as D
from polyrl.core.errors import BadInputError
from polyrl.core.run.checkpoint.contents import EXTRA_KEYS, MODULE_GROUPS, dcp_state
from polyrl.core.run.checkpoint.layout import is_complete, latest_checkpoint, resolve_resume_from, set_aside_newer
from polyrl.core.run.checkpoint.reading import dcp_load
from polyrl.core.run.checkpoint.rng import set_rng_state
from polyrl.core.run.checkpoint.verify import RESUME_HOW, RESUME_NONE, refusal, verify_checkpoint
from polyrl.core.run.integrity import CheckpointRefused, load_extra

if TYPE_CHECKING:
    from torch import nn

    from polyrl.core.plugins.backend import Backend

log = logging.getLogger("polyrl.core.run.checkpoint")


def load_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *, backend: Backend | None = None) -> int:
    """Verify, then load a complete checkpoint directory into ``state`` in place; collective. Returns its step.

    Nothing in ``state`` is touched before ``verify_checkpoint`` has passed (a problem raises
    ``CheckpointRefused``). The world size may differ from the one that wrote it (DCP reshards model and
    optimizer). Per-rank state comes from this rank's file when it exists, else rank 0's; RNG is restored
    only on ranks that had a file (new ranks keep their own streams instead of cloning rank 0's).
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    if not is_complete(path):
        raise BadInputError(f"checkpoint {str(path)!r} is incomplete; refusing to load it")
    sd = dcp_state(state)
    marker = verify_checkpoint(path, sd)
    dcp_load(sd, path)
    for module_key, optim_key in MODULE_GROUPS:
        if module_key in sd:
            optim = state.get(optim_key)
            set_state_dict(
                state[module_key],
                optim if optim is not None else [],
                model_state_dict=sd[module_key],
                optim_state_dict=sd.get(optim_key, {}),
            )
    rank = D.get_rank()
    own = path / "extra" / f"rank_{rank}.pt"
    extra = load_extra(own if own.is_file() else path / "extra" / "rank_0.pt")
    for key in EXTRA_KEYS:
        if state.get(key) is not None and key in extra:
            state[key].load_state_dict(extra[key])
    if own.is_file():
        set_rng_state(extra["rng"], backend)
    else:
        # A rank that did not exist when the checkpoint was written keeps its own (seed-derived) RNG
        # rather than cloning rank 0's stream.
        log.warning("checkpoint written by %s processes has no RNG state for rank %d", marker.get("world_size"), rank)
    return int(marker["step"])


def load_latest_checkpoint(
    ckpt_dir: str | os.PathLike[str], state: Mapping[str, Any], *, backend: Backend | None = None,
    resume_from: str | None = None,
) -> int | None:
    """Resume from the newest complete checkpoint under ``ckpt_dir`` (or the one ``resume_from`` names);
    None when there is none. Collective.

    Rank 0 chooses and broadcasts the choice, so every rank loads the same step even if a directory
    appears between two ranks' scans. A checkpoint that fails verification is never skipped silently:
    the error names the file, what is wrong, and the newest earlier checkpoint that verifies. After
    resuming from a chosen earlier checkpoint, the newer ones are set aside (``set_aside_newer``).
    """
    choice: tuple[str | None, str | None] = (None, None)  # (path, error)
    if D.get_rank() == 0:
        try:
            found = resolve_resume_from(ckpt_dir, resume_from) if resume_from else latest_checkpoint(ckpt_dir)
            choice = (str(found) if found is not None else None, None)
        except BadInputError as exc:
            choice = (None, str(exc))
    found, error = D.broadcast_object(choice)
    if error is not None:
        raise BadInputError(error)
    if found is None:
        return None
    try:
        step = load_checkpoint(found, state, backend=backend)
    except CheckpointRefused as exc:
        raise refusal(exc, ckpt_dir, int(Path(found).name.split("_")[1]), RESUME_HOW, dcp_state(state),
                      RESUME_NONE) from None
    log.info("resumed from %s (step %d)", found, step)
    if resume_from and D.get_rank() == 0:
        for moved in set_aside_newer(ckpt_dir, step):
            log.warning("checkpoint %s is newer than the one resumed from: set aside as %s (delete it when no "
                        "longer needed)", moved.name, moved)
    D.barrier()
    return step


def load_model_weights(path: str | os.PathLike[str], model: nn.Module, key: str = "model") -> None:
    """Verify, then load only the weights of ``model`` (no optimizer) from a checkpoint directory: for
    export and eval. Raises ``CheckpointRefused`` before touching ``model`` when the checkpoint fails."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = {key: get_model_state_dict(model)}
    verify_checkpoint(path, sd)
    dcp_load(sd, path)
    set_model_state_dict(model, sd[key])
