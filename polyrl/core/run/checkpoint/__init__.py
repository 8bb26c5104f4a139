"""Checkpoints: DCP for model/optimizer state, per-rank files for the rest, atomic publication.

One concept per module: :mod:`.layout` (where checkpoints live and how they are named), :mod:`.contents` (what of
the trainer's state they hold), :mod:`.rng` (the generators restored), :mod:`.reading` (DCP read safely),
:mod:`.save` (the publication protocol), :mod:`.verify` (checked before loading; the refusal), :mod:`.load`
(loading and the resume choice). The names below are the package's surface (0.2's ``checkpoint.py`` paths).

Layout under a run's ``checkpoints/`` directory::

    step_00000010/             a complete checkpoint
      .metadata, *.distcp      torch.distributed.checkpoint: model, optimizer, critic, critic_optimizer
      extra/rank_<r>.pt        per rank: RNG states, trainer state, LR scheduler states (weights_only-safe)
      COMPLETE                 JSON written last inside the directory: step, world size, and each
                               file's size and sha256 (polyrl.core.run.integrity)
    step_00000020.tmp/         being written (or left by a killed run): never loaded, deleted on next save
    latest                     text file naming the newest complete checkpoint; replaced last
    superseded-<time>/         checkpoints newer than one resumed from with ``--resume-from`` (kept, never loaded)

Why this shape: DCP stores each rank's shards plus global metadata, so a checkpoint written by N
processes loads into M (it reshards on load), and with or without FSDP. Publication is a protocol, not
a hope: all ranks write into ``step_N.tmp``, barrier, rank 0 writes ``COMPLETE`` and renames the
directory (atomic on POSIX), then replaces ``latest`` (write a temp file + ``os.replace``). A kill at any
point leaves either the previous complete checkpoint or the new one, never a half. Loading picks the
newest directory that has ``COMPLETE`` and no ``.tmp`` suffix, verifies it before touching any state
(sizes, checksums, structure, fit to this run's model: ``verify_checkpoint``), and refuses a checkpoint
that fails with one line naming the file and the newest earlier checkpoint that verifies. Falling back
to that one is the user's decision (``--resume-from``), never taken silently.

Nothing here unpickles arbitrary objects: tensors and extra files go through ``torch.load(...,
weights_only=True)``; DCP's own ``.metadata`` (a pickle) is read with an allow-listed unpickler that
accepts only DCP's metadata classes, torch sizes/dtypes and paths.
"""

from polyrl.core.run.checkpoint.contents import EXTRA_KEYS, MODULE_GROUPS, dcp_state, extra_state
from polyrl.core.run.checkpoint.layout import (
    LATEST_FILE,
    STEP_RE,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
    resolve_resume_from,
    set_aside_newer,
    step_dirname,
)
from polyrl.core.run.checkpoint.load import load_checkpoint, load_latest_checkpoint, load_model_weights
from polyrl.core.run.checkpoint.reading import dcp_load
from polyrl.core.run.checkpoint.rng import rng_state, set_rng_state
from polyrl.core.run.checkpoint.save import TEST_DELAY_ENV, TEST_DELAY_STEP_ENV, save_checkpoint
from polyrl.core.run.checkpoint.verify import (
    RESUME_HOW,
    RESUME_NONE,
    VERIFIED_ENV,
    check_resume,
    newest_verified_before,
    refusal,
    verify_checkpoint,
)
from polyrl.core.run.integrity import COMPLETE_MARKER, CheckpointRefused

__all__ = [
    "COMPLETE_MARKER",
    "EXTRA_KEYS",
    "LATEST_FILE",
    "MODULE_GROUPS",
    "RESUME_HOW",
    "RESUME_NONE",
    "STEP_RE",
    "TEST_DELAY_ENV",
    "TEST_DELAY_STEP_ENV",
    "VERIFIED_ENV",
    "CheckpointRefused",
    "check_resume",
    "dcp_load",
    "dcp_state",
    "extra_state",
    "is_complete",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "load_model_weights",
    "newest_verified_before",
    "refusal",
    "resolve_checkpoint",
    "resolve_resume_from",
    "rng_state",
    "save_checkpoint",
    "set_aside_newer",
    "set_rng_state",
    "step_dirname",
    "verify_checkpoint",
]
